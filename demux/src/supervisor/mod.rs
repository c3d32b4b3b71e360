//! Worker supervision: spawns worker processes as direct children, hands each its descriptors
//! and configuration over a control socket, notices a death at once (pidfd and the control
//! socket closing), resets the dead instance's ring and starts a replacement, brings up a new
//! worker generation on `ringmux reload` (or SIGHUP) while the old one drains, and runs the
//! graceful shutdown on SIGTERM/SIGINT. Other instances never notice.
//!
//! Workers live in lanes (one per instance and generation slot, numbered as
//! `ringmux_quic_lb::Router::lane` numbers them); [`policy`] explains.
//!
//! This module is the event loop: it waits for what happens, feeds it to [`policy`], which
//! decides (READY deadlines, back-off, crash loops, draining) without processes or clocks, and
//! carries the decisions out. The rest is by concern, each file below this one and none of
//! them using it: [`spawn`] plans a worker's start without I/O and carries the plan out,
//! [`reload`] reads the next configuration, [`handover`] is what `ringmux upgrade` takes and
//! gives, [`workers`] the processes and descriptors of each lane, [`acme`] the certificates
//! relayed, [`control`] `ringmux reload`'s socket, [`sandbox`] and [`filesystem`] the
//! workers' confinement.

use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};
use std::sync::atomic::Ordering;
use std::sync::mpsc::TryRecvError;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use nix::sys::signalfd::SignalFd;
use ringmux_proto::{Message, MAX_MESSAGE};

use crate::budget::{MessageKind, Verdict};
use crate::config::Config;
use crate::dataplane::{DataPlaneLink, Event};
use crate::forward::{IngressHandles, Lanes};
use crate::metrics::Counters;
use crate::sys::{self, ChildProcess};

pub mod acme;
pub mod control;
pub mod filesystem;
pub mod handover;
pub mod health;
pub mod policy;
pub mod reload;
pub mod sandbox;
pub mod spawn;
pub mod workers;

pub use handover::{Exported, Upgrade};
pub use spawn::{TcpListeners, Template};

use control::ControlServer;
use policy::{Action, Limits, Policy};
use sandbox::WorkerFilter;
use workers::Worker;

/// How often the supervisor looks for processes re-parented to the demux (descendants of a
/// worker whose parent died) when no worker died since the last look.
const ORPHAN_SWEEP: Duration = Duration::from_secs(1);

/// Most control messages read from one worker per supervision round (a worker sends one STATS a
/// second; more is a flood). Over time its [`Budget`](crate::budget::Budget)
/// ([`budget::CONTROL`](crate::budget::CONTROL)) bounds them.
const CONTROL_READS_PER_ROUND: usize = 16;

pub struct Supervisor {
    cfg: Config,
    template: Template,
    /// The public socket's address: every worker's sending socket is bound to it.
    public: std::net::SocketAddr,
    counters: Arc<Counters>,
    link: DataPlaneLink,
    signals: SignalFd,
    policy: Policy,
    workers: Vec<Worker>,
    sessions: crate::sessions::Sessions,
    /// The workers' confinement; `None` with `--sandbox off`.
    filter: Option<WorkerFilter>,
    /// The listening TCP sockets every worker accepts from, at its descriptors 5 (`--tcp on`)
    /// and 6 (`--redirect-http`).
    tcp: TcpListeners,
    /// Whether workers get an access-log pipe (`--access-log`), at their descriptor 7. The
    /// log thread writes what comes through it; the file is opened again at every reload.
    access_log: bool,
    /// The Landlock ruleset each worker enters a domain of; `None` with `--sandbox off` or
    /// where the kernel has no Landlock.
    domain: Option<sys::WorkerDomain>,
    /// When to look for orphans next (sooner after a worker died).
    next_sweep: Instant,
    /// How the lanes of the instances are numbered.
    lanes: Lanes,
    /// `ringmux reload`'s socket, unless `--control-socket off`.
    control: Option<ControlServer>,
    /// Control clients waiting for the outcome of the reload under way, and a reload's answer
    /// until the workers it replaced stopped accepting.
    reloads: reload::Waiters,
    /// Why starting each lane's worker failed last, for the reload's answer.
    start_errors: Vec<Option<String>>,
    /// What the policy decided while the supervisor was reading (READY, reset replies), to
    /// carry out with the round's other actions.
    deferred: Vec<Action>,
    /// The `ringmux` binary on disk (what an upgrade executes).
    binary: std::path::PathBuf,
    /// An upgrade that passed its checks: [`Supervisor::run`] returns it.
    upgrade: Option<Upgrade>,
    /// Control clients of the upgrade that made this process image, to answer once it serves.
    waiters_upgrade: Vec<u64>,
    /// Where a worker's control message is read: room for the largest ([`MAX_MESSAGE`]).
    control_buf: Box<[u8]>,
    /// What the ACME engine publishes, relayed to the workers; `None` without ACME sites.
    acme: Option<acme::Relay>,
    /// The active health checks, fed the template's health table.
    health: health::Checks,
}

/// Everything a supervisor is made of, handed over whole at construction: what every start
/// makes (the configuration, the workers' template, the link to the data plane), the
/// descriptors it keeps for every worker (the TCP listeners, the control socket), and the
/// lanes a previous process image handed over with their workers (none at a first start:
/// [`Supervisor::start_all`] starts them).
pub struct Parts {
    pub cfg: Config,
    pub template: Template,
    /// The public socket's address: every worker's sending socket is bound to it.
    pub public: std::net::SocketAddr,
    pub counters: Arc<Counters>,
    pub link: DataPlaneLink,
    pub signals: SignalFd,
    /// Serves the workers' session sockets, held to the bindings the data plane's admission
    /// records (`tickets.rs`).
    pub sessions: crate::sessions::Sessions,
    /// The listening TCP sockets every worker accepts from.
    pub tcp: TcpListeners,
    /// What the ACME engine publishes, relayed to the workers; `None` without ACME sites.
    pub acme: Option<acme::Relay>,
    /// `ringmux reload`'s socket (unless `--control-socket off`), and the clients of the
    /// upgrade that made this process image, waiting on it for its outcome.
    pub control: Option<(OwnedFd, Vec<OwnedFd>)>,
    /// The lanes handed over, each with its running worker; only their worker's descriptors
    /// are here (the ingresses went to the forwarding mode). Empty at a first start.
    pub lanes: Vec<crate::upgrade::Lane<OwnedFd>>,
    /// The generation new connections go to (with handed-over lanes).
    pub active_generation: u64,
    /// The session cache handed over.
    pub frozen: Vec<crate::sessions::Frozen>,
    /// The `ringmux` binary on disk (what an upgrade executes).
    pub binary: std::path::PathBuf,
}

/// How [`Supervisor::run`] ended.
pub enum Outcome {
    /// Every worker is gone (a shutdown).
    Done,
    /// An upgrade was asked for and the new binary passed its check: hand over to it.
    Upgrade(Upgrade),
}

impl Supervisor {
    /// The supervisor of `parts`: it adopts the workers of the lanes handed over (this
    /// process's children still, with their sockets and pipes) and serves the control socket;
    /// its clients of the upgrade are told the last line once this image serves
    /// ([`Supervisor::answer_upgrade`]).
    pub fn new(parts: Parts) -> Result<Self> {
        let Parts {
            cfg,
            template,
            public,
            counters,
            link,
            signals,
            sessions,
            tcp,
            acme,
            control,
            lanes: handed,
            active_generation,
            frozen,
            binary,
        } = parts;
        let numbering = Lanes::new(cfg.instances);
        let lanes = numbering.count();
        let limits = Limits::new(cfg.ready_timeout(), cfg.grace(), cfg.max_draining());
        let filter = spawn::worker_filter(&cfg, tcp.redirect.is_some())?;
        let domain = spawn::worker_domain(&cfg)?;
        if domain.is_some() {
            let abi = sys::landlock_abi().unwrap_or(0);
            for gap in sys::landlock_gaps(abi) {
                tracing::warn!(
                    landlock_abi = abi,
                    "this kernel's Landlock leaves one right to every worker: {gap}"
                );
            }
        }
        let access_log = cfg.access_log() != crate::config::AccessLog::Off;
        crate::logs::access_to(cfg.access_log().open()?);
        let now = Instant::now();
        let policy = match handed.is_empty() {
            true => Policy::new(limits, numbering, now),
            false => {
                let phases: Vec<(u64, crate::upgrade::LanePhase)> =
                    handed.iter().map(|l| (l.generation, l.phase)).collect();
                counters
                    .active_generation
                    .store(active_generation, Ordering::Relaxed);
                Policy::adopt(limits, numbering, now, active_generation, &phases)
            }
        };
        sessions.cache().restore(frozen, now);
        let (control, waiters_upgrade) = match control {
            Some((listener, waiting)) => {
                let path = std::path::Path::new(&cfg.args.control_socket);
                let (server, ids) = ControlServer::adopt(listener, path, waiting);
                (Some(server), ids)
            }
            None => (None, Vec::new()),
        };
        let mut sup = Supervisor {
            filter,
            domain,
            tcp,
            access_log,
            next_sweep: now + ORPHAN_SWEEP,
            policy,
            workers: (0..lanes).map(|_| Worker::default()).collect(),
            lanes: numbering,
            control,
            reloads: reload::Waiters::default(),
            start_errors: vec![None; lanes],
            deferred: Vec::new(),
            binary,
            upgrade: None,
            waiters_upgrade,
            control_buf: vec![0; MAX_MESSAGE].into_boxed_slice(),
            acme,
            health: health::Checks::new(counters.health.clone()),
            cfg,
            template,
            public,
            counters,
            link,
            signals,
            sessions,
        };
        for (l, lane) in handed.into_iter().enumerate() {
            if let Some(w) = lane.worker {
                sup.adopt_worker(l, lane.phase, w)?;
            }
        }
        Ok(sup)
    }

    /// Lane `l`'s running worker `w`, handed over by a previous process image.
    fn adopt_worker(
        &mut self,
        l: usize,
        phase: crate::upgrade::LanePhase,
        w: crate::upgrade::Worker<OwnedFd>,
    ) -> Result<()> {
        let instance = self.lanes.at(l).instance;
        let pid = w.pid;
        let (worker, sessions) = handover::adopt(l, instance, w)?;
        self.sessions.serve(instance, sessions);
        self.counters.instances[l]
            .worker_pid
            .store(u64::from(pid), Ordering::Relaxed);
        if phase != crate::upgrade::LanePhase::Idle {
            self.link.liveness().set_up(l, true);
        }
        self.workers[l] = worker;
        Ok(())
    }

    /// The ACME engine's counters and certificates, for the metrics.
    pub fn acme_status(&self) -> Option<ringmux_acme::AcmeStatus> {
        self.acme.as_ref().map(acme::Relay::status)
    }

    /// Relays what the ACME engine published since the last look ([`acme::Relay::forward`]),
    /// keeps a changed certificate in the template for every worker started later, and answers
    /// the `ringmux acme renew` clients whose renewal is over.
    fn forward_acme(&mut self) {
        let Some(relay) = self.acme.as_mut() else {
            return;
        };
        let sent = relay.forward(&self.workers, self.lanes, &self.counters);
        if sent.certs_changed {
            self.template = Template::new(self.template.handoff.clone(), relay.table());
        }
        for (client, line) in sent.renewals_over {
            if let Some(c) = self.control.as_mut() {
                c.answer(client, &line);
            }
        }
    }

    /// `ringmux acme renew [NAME]` from control client `client`.
    fn acme_renew(&mut self, client: u64, name: Option<String>) {
        let refused = match self.acme.as_mut() {
            None => Some("no site takes its certificate from ACME (acme = true)".to_string()),
            Some(r) => r
                .renew(client, name.as_deref())
                .err()
                .map(|e| e.to_string()),
        };
        if let Some(c) = self.control.as_mut() {
            match refused {
                None => c.tell(client, "renewing"),
                Some(why) => c.answer(client, &format!("error: {why}")),
            }
        }
    }

    /// Starts every worker with its initial descriptors and waits until each has reported ready
    /// or died. One that dies or stays silent is logged, replaced and retried with back-off like
    /// any later death (once the data plane runs); only a program of which no instance at all
    /// becomes ready stops the demux (nothing could serve).
    pub fn start_all(&mut self, handles: Vec<IngressHandles>) -> Result<()> {
        for (i, h) in handles.into_iter().enumerate() {
            self.spawn(i as u8, h)
                .with_context(|| format!("starting worker {i}"))?;
            self.policy.on(Instant::now(), policy::Event::Started(i));
        }
        let deadline = Instant::now() + self.cfg.ready_timeout();
        // Settled: every instance is ready, or its first worker already died. A dead one is
        // replaced once the data plane runs (which resets its ring), so waiting for it here
        // would only hold every other instance back until the deadline.
        let settled = |s: &Self| {
            (0..s.lanes.instances()).all(|i| s.policy.is_ready(i) || s.workers[i].child.is_none())
        };
        while !settled(self) && Instant::now() < deadline {
            self.step(Duration::from_millis(100))?;
        }
        let ready = (0..self.lanes.instances())
            .filter(|&i| self.policy.is_ready(i))
            .count();
        if ready == 0 {
            bail!(
                "no instance of the worker program {} reported READY within {:?} \
                 (--ready-timeout); a worker must call ringmux_worker::Worker::attach and create \
                 its endpoint. See its log above",
                self.cfg.worker_program(),
                self.cfg.ready_timeout()
            );
        }
        tracing::info!(
            ready,
            instances = self.lanes.instances(),
            program = self.cfg.worker_program(),
            "workers ready"
        );
        Ok(())
    }

    /// Supervises until a shutdown signal, then drains, and returns when every worker is gone;
    /// or returns an upgrade to carry out.
    pub fn run(&mut self) -> Result<Outcome> {
        loop {
            if self.step(Duration::from_millis(50))? {
                return Ok(Outcome::Done);
            }
            if let Some(u) = self.upgrade.take() {
                return Ok(Outcome::Upgrade(u));
            }
        }
    }

    /// Tells the clients that asked for the upgrade `line`, and closes them.
    pub fn answer_upgrade(&mut self, line: &str) {
        let ids = std::mem::take(&mut self.waiters_upgrade);
        if let Some(c) = self.control.as_mut() {
            for id in ids {
                c.answer(id, line);
            }
        }
    }

    /// An upgrade asked for by control client `client` (or by SIGUSR2): refused unless the
    /// supervisor is settled and the new binary speaks what the running workers speak
    /// ([`handover::refusal`]).
    fn upgrade_request(&mut self, client: Option<u64>) {
        let refused = handover::refusal(
            self.cfg.args.forward,
            &self.policy,
            &self.workers,
            self.lanes,
            &self.binary,
        );
        if let Err(why) = refused {
            tracing::warn!(reason = %why, "upgrade refused; this demux serves on");
            self.counters
                .upgrades_failed
                .fetch_add(1, Ordering::Relaxed);
            if let (Some(id), Some(c)) = (client, self.control.as_mut()) {
                c.answer(id, &format!("error: {why}; this demux serves on"));
            }
            return;
        }
        let clients = match (&mut self.upgrade, client) {
            (Some(u), Some(id)) => {
                u.clients.push(id);
                return;
            }
            (Some(_), None) => return,
            (None, c) => c.into_iter().collect(),
        };
        self.upgrade = Some(Upgrade {
            binary: self.binary.clone(),
            clients,
        });
    }

    /// Everything a new process image takes over from the supervisor: its descriptors by
    /// number into `fds` (the TCP listeners, the control socket with the clients of `upgrade`,
    /// and a lane each, with its worker, for the data plane to add the ingress to), and the
    /// rest returned. The session cache stops answering until [`Supervisor::upgrade_failed`]
    /// (if the upgrade does not happen).
    pub fn export(
        &mut self,
        upgrade: &Upgrade,
        fds: &mut crate::upgrade::Fds<RawFd>,
    ) -> Result<Exported> {
        let now = Instant::now();
        let phases = self.policy.export(now)?;
        fds.lanes = handover::export_lanes(phases, &self.workers);
        if let Some(c) = &self.control {
            let (listener, answers) = c.export(&upgrade.clients);
            fds.control = Some(listener);
            fds.answers = answers;
        }
        fds.tcp = self.tcp.https.as_ref().map(AsRawFd::as_raw_fd);
        fds.redirect = self.tcp.redirect.as_ref().map(AsRawFd::as_raw_fd);
        let sessions = self
            .sessions
            .cache()
            .freeze(now)
            .into_iter()
            .map(crate::sessions::SessionEntry::freeze)
            .collect();
        Ok(Exported {
            active_generation: self.policy.active(),
            sites: self.template.sites.clone(),
            sessions,
        })
    }

    /// The upgrade did not happen (`why`): answers its clients, and serves on.
    pub fn upgrade_failed(&mut self, upgrade: Upgrade, why: &str) {
        self.sessions.cache().thaw();
        self.counters
            .upgrades_failed
            .fetch_add(1, Ordering::Relaxed);
        tracing::error!(reason = %why, "upgrade failed; this demux serves on");
        if let Some(c) = self.control.as_mut() {
            for id in upgrade.clients {
                c.answer(id, &format!("error: {why}; this demux serves on"));
            }
        }
    }

    /// Answers `client` whether a reload now would start a new generation
    /// ([`reload::check_line`]): nothing started.
    fn reload_check(&mut self, client: u64) {
        let answer = reload::check_line(&self.cfg, &self.template, self.acme.is_some());
        if let Some(c) = self.control.as_mut() {
            c.answer(client, &answer);
        }
    }

    /// A reload asked for by control client `client` (or by SIGHUP): reads the command line's
    /// configuration file and certificates again, checked as a start checks them
    /// ([`reload::next_generation`]), then lets the policy start the next generation with
    /// them. Refusals are answered at once, and the running configuration serves on.
    fn reload(&mut self, client: Option<u64>) -> Vec<Action> {
        let answer = |s: &mut Self, line: &str| {
            if let (Some(id), Some(c)) = (client, s.control.as_mut()) {
                c.answer(id, line);
            }
        };
        let next = match reload::next_generation(&self.cfg, &self.template, self.acme.is_some()) {
            Ok(next) => next,
            Err(why) => {
                tracing::error!(error = format!("{why:#}"), "reload refused");
                self.counters.reloads_failed.fetch_add(1, Ordering::Relaxed);
                answer(
                    self,
                    &format!(
                        "error: {why:#}; generation {} serves on",
                        self.policy.active()
                    ),
                );
                return Vec::new();
            }
        };
        let actions = self.policy.on(Instant::now(), policy::Event::Reload);
        if let Some(Action::ReloadRefused(r)) = actions.first() {
            let why = reload::refusal_line(r);
            tracing::warn!(reason = %why, "reload refused");
            answer(self, &format!("error: {why}"));
            return Vec::new();
        }
        // The next generation starts from these.
        next.apply(reload::Running {
            cfg: &mut self.cfg,
            template: &mut self.template,
            domain: &mut self.domain,
            acme: self.acme.as_mut(),
            policy: &mut self.policy,
            counters: &self.counters,
        });
        self.reloads.join(self.control.as_mut(), client);
        actions
    }

    /// One round: wait up to `timeout` for anything to happen, feed what happened to the
    /// policy, carry out its actions. `Ok(true)` once the shutdown is complete.
    fn step(&mut self, timeout: Duration) -> Result<bool> {
        let mut fds = vec![sys::signal_fd(&self.signals)];
        let now = Instant::now();
        let mut timeout = timeout;
        for w in &mut self.workers {
            fds.extend(w.pidfd.as_ref().map(|p| p.as_fd()));
            // A worker that spent its budget is not listened to until it may be read again:
            // its flood waits in its own socket instead of waking this loop (its death still
            // shows on its pidfd).
            match w.budget.read_after(now) {
                None => fds.extend(w.control.as_ref().map(|c| c.as_fd())),
                Some(at) if w.control.is_some() => {
                    timeout = timeout.min(at.saturating_duration_since(now));
                }
                Some(_) => {}
            }
        }
        if let Some(c) = &self.control {
            fds.extend(c.fds());
        }
        if let Some(a) = &self.acme {
            fds.push(a.fd());
        }
        if let Some(until) = self.reloads.due() {
            timeout = timeout.min(until.saturating_duration_since(now));
        }
        let _ = sys::poll_readable(&fds, Some(timeout));
        drop(fds);

        let mut actions = Vec::new();
        let requests = match self.control.as_mut() {
            Some(c) => {
                let workers: Vec<u32> = self
                    .workers
                    .iter()
                    .filter_map(|w| w.child.as_ref().map(ChildProcess::id))
                    .collect();
                c.poll(Instant::now(), |pid| workers.contains(&pid))
            }
            None => Vec::new(),
        };
        for (client, request) in requests {
            match request {
                control::Request::Reload => actions.extend(self.reload(Some(client))),
                control::Request::ReloadCheck => self.reload_check(client),
                control::Request::Upgrade => self.upgrade_request(Some(client)),
                control::Request::AcmeRenew(name) => self.acme_renew(client, name),
            }
        }
        let signal = sys::read_signal(&self.signals);
        if signal == Some(libc::SIGHUP) {
            tracing::info!("SIGHUP: reloading");
            actions.extend(self.reload(None));
        } else if signal == Some(libc::SIGUSR2) {
            tracing::info!("SIGUSR2: upgrading");
            self.upgrade_request(None);
        } else if let Some(sig) = signal {
            if self.policy.shutting_down() {
                tracing::warn!(signal = sig, "second signal: stopping now");
            } else {
                match self.cfg.grace() {
                    Some(grace) => tracing::info!(signal = sig, ?grace, "shutting down: draining workers (what they still serve at the end of --grace is cut; a second signal cuts it now)"),
                    None => tracing::info!(signal = sig, "shutting down: draining workers until every request in flight is done (no --grace; a second signal cuts them now)"),
                }
            }
            actions.extend(
                self.policy
                    .on(Instant::now(), policy::Event::ShutdownSignal),
            );
        }
        while let Some(Event::Misbehaved { lane, stalled }) = self.link.next_event() {
            let i = usize::from(lane);
            tracing::error!(
                instance = self.lanes.at(i).instance,
                lane,
                stalled,
                "killing misbehaving worker"
            );
            actions.extend(self.policy.on(Instant::now(), policy::Event::Misbehaved(i)));
        }
        for i in 0..self.workers.len() {
            let closed = self.read_control(i) == Liveness::Gone;
            if closed {
                // Stop polling it; the process itself may still be running.
                self.workers[i].control = None;
            }
            // A draining worker that closed its control socket is gone only once its process
            // is: until then the grace deadline still applies to it. Any other worker that
            // closes it is dead or broken either way, and `reap` makes sure.
            let gone = self.workers[i].exited() || (closed && !self.policy.draining(i));
            if gone && self.workers[i].child.is_some() {
                self.reap(i);
                actions.extend(self.policy.on(Instant::now(), policy::Event::Exited(i)));
            }
            self.collect_reset(i)?;
        }
        self.forward_acme();
        self.health.follow(self.template.health.as_ref());
        if Instant::now() >= self.next_sweep {
            self.kill_orphans();
        }
        actions.append(&mut self.deferred);
        actions.extend(self.policy.tick(Instant::now()));
        let done = self.carry_out(actions);
        self.answer_reload(Instant::now());
        let now = Instant::now();
        for (l, c) in self.counters.instances.iter().enumerate() {
            let (generation, state) = self.policy.lane(l);
            let draining = self
                .policy
                .draining_since(l)
                .map(|s| now.saturating_duration_since(s));
            c.set_lane(generation, state, draining);
        }
        done
    }

    /// Does what the policy decided. `Ok(true)`: the shutdown is complete.
    fn carry_out(&mut self, actions: Vec<Action>) -> Result<bool> {
        let mut queue = std::collections::VecDeque::from(actions);
        while let Some(action) = queue.pop_front() {
            match action {
                Action::Kill(i, why) => self.kill(i, why),
                Action::Cut(i, why) => self.cut(i, why),
                Action::Close(l) => {
                    self.workers[l].handles = None;
                    self.link.close(l as u8);
                }
                Action::Activate { generation } => {
                    let slot = ringmux_proto::generation_slot(generation);
                    // The data plane looks at commands at least every gauge period.
                    let switched = self
                        .link
                        .activate(slot)
                        .recv_timeout(Duration::from_secs(2));
                    if switched.is_err() {
                        bail!("the data plane did not switch to generation {generation}");
                    }
                    self.counters
                        .active_generation
                        .store(generation, Ordering::Relaxed);
                    tracing::info!(generation, "new connections go to the new generation");
                }
                a @ (Action::Reloaded { .. }
                | Action::ReloadFailed { .. }
                | Action::ReloadWaits { .. }) => self.report_reload(a),
                Action::ReloadRefused(_) => {}
                Action::RequestReset(i) => {
                    self.workers[i].reset_reply = Some(self.link.request_reset(i as u8));
                }
                Action::Start(i) => queue.extend(self.start(i)),
                Action::Drain(i) => {
                    if !self.policy.shutting_down() {
                        tracing::info!(
                            instance = self.lanes.at(i).instance,
                            generation = self.policy.lane(i).0,
                            "asking a replaced worker to drain"
                        );
                    }
                    if let Some(c) = &self.workers[i].control {
                        let _ = sys::send_packet(c.as_fd(), &Message::Shutdown.encode());
                    }
                }
                Action::Died(d) => workers::log_death(&d, self.cfg.worker_program()),
                Action::Finish => {
                    tracing::info!("all workers exited");
                    self.reloads.tell(
                        self.control.as_mut(),
                        "error: ringmux is shutting down",
                        true,
                    );
                    self.kill_orphans();
                    return Ok(true);
                }
                Action::CutAllAndFinish => {
                    workers::cut_all(&mut self.workers, &self.counters, self.lanes);
                    self.kill_orphans();
                    return Ok(true);
                }
            }
        }
        Ok(false)
    }

    /// Kills lane `i`'s worker, saying why when it is news.
    fn kill(&mut self, i: usize, why: policy::Why) {
        let (instance, generation) = (self.lanes.at(i).instance, self.policy.lane(i).0);
        workers::log_kill(why, instance, generation, &self.cfg);
        if let Some(c) = self.workers[i].child.as_mut() {
            let _ = c.kill();
        }
    }

    /// Tells lane `i`'s worker to cut (`CUT`): the end of its drain. The policy kills it if it
    /// is still there [`policy::CUT_WAIT`] later.
    fn cut(&mut self, i: usize, why: policy::Why) {
        let (instance, generation) = (self.lanes.at(i).instance, self.policy.lane(i).0);
        let age = self
            .policy
            .draining_since(i)
            .map(|s| Instant::now().saturating_duration_since(s));
        workers::log_cut(why, instance, generation, age, &self.cfg);
        self.counters.instances[i]
            .cuts
            .fetch_add(1, Ordering::Relaxed);
        if let Some(c) = &self.workers[i].control {
            let _ = sys::send_packet(c.as_fd(), &Message::Cut.encode());
        }
    }

    /// Starts lane `i`'s worker on the ingress reset for it; what the policy answers.
    fn start(&mut self, i: usize) -> Vec<Action> {
        let Some(h) = self.workers[i].handles.take() else {
            return Vec::new();
        };
        let (generation, _) = self.policy.lane(i);
        if generation == self.policy.active() {
            self.counters.instances[i]
                .restarts
                .fetch_add(1, Ordering::Relaxed);
        }
        let event = match self.spawn(i as u8, h) {
            Ok(()) => {
                self.start_errors[i] = None;
                policy::Event::Started(i)
            }
            Err(e) => {
                let why = format!("{e:#}");
                tracing::error!(instance = self.lanes.at(i).instance, generation, error = %why, "starting a worker failed");
                self.start_errors[i] = Some(why);
                policy::Event::StartFailed(i)
            }
        };
        self.policy.on(Instant::now(), event)
    }

    /// Tells the clients of a reload that succeeded (`ringmux reload`) once every worker of
    /// the replaced generation has said it accepts no new connection (`STOPPED`) or is gone,
    /// or at the latest after [`ringmux_proto::STOPPED_WAIT`] ([`reload::Waiters::answer`]).
    fn answer_reload(&mut self, now: Instant) {
        let Some(replaced) = self.reloads.replaced() else {
            return;
        };
        let lanes = self.policy.lanes_of(replaced);
        let stopped = self.workers[lanes]
            .iter()
            .all(|w| w.stopped || w.child.is_none());
        self.reloads.answer(self.control.as_mut(), now, stopped);
    }

    /// Logs how a reload went and tells whoever asked for it (`ringmux reload`).
    fn report_reload(&mut self, action: Action) {
        match action {
            Action::Reloaded {
                generation,
                replaced: old,
            } => {
                self.counters.reloads.fetch_add(1, Ordering::Relaxed);
                tracing::info!(generation, draining = old, "reload done");
                // Answered once the replaced workers accept no new connection.
                self.reloads.done(generation, old, Instant::now());
                self.answer_reload(Instant::now());
            }
            Action::ReloadFailed {
                generation,
                instance,
                why,
            } => {
                self.counters.reloads_failed.fetch_add(1, Ordering::Relaxed);
                let lane = self.policy.lanes_of(generation).start + instance;
                let why = reload::failure_line(
                    why,
                    instance,
                    self.cfg.worker_program(),
                    self.cfg.ready_timeout(),
                    self.start_errors[lane].as_deref(),
                );
                let active = self.policy.active();
                tracing::error!(generation, reason = %why, serving = active, "reload failed");
                self.reloads.tell(
                    self.control.as_mut(),
                    &format!(
                        "error: generation {generation} abandoned: {why}; generation {active} \
                         serves on"
                    ),
                    true,
                );
            }
            Action::ReloadWaits {
                generation,
                draining,
            } => {
                tracing::info!(
                    generation,
                    draining,
                    "reload waits for a generation to drain"
                );
                self.reloads.tell(
                    self.control.as_mut(),
                    &reload::waits_line(generation, draining),
                    false,
                );
            }
            _ => {}
        }
    }

    /// Starts lane `lane`'s worker on `handles` as [`spawn::plan`] plans it, and keeps the
    /// books: its session socket served, its counters started again, its descriptors held.
    fn spawn(&mut self, lane: u8, handles: IngressHandles) -> Result<()> {
        let l = usize::from(lane);
        let slot = spawn::Slot {
            lane: l,
            instance: self.lanes.at(l).instance,
            generation: self.policy.lane(l).0,
            ingress: spawn::ingress_kind(&handles),
        };
        let around = spawn::Surroundings {
            public: self.public,
            tcp: self.tcp.https.is_some(),
            redirect: self.tcp.redirect.is_some(),
            access_log: self.access_log,
            filter: self.filter.is_some(),
            landlock: self.domain.is_some(),
            may_drop_bounding_set: sys::may_drop_bounding_set(),
            acme: self.acme.is_some(),
        };
        let plan = spawn::plan(&self.cfg, &self.template, &around, slot);
        let held = spawn::Held {
            tcp: &self.tcp,
            filter: self.filter.as_ref(),
            domain: self.domain.as_ref(),
        };
        let started = spawn::launch(&plan, handles, held)?;
        let i = slot.instance;
        self.sessions.serve(i, started.sessions);
        let lane_counters = &self.counters.instances[l];
        lane_counters
            .worker_pid
            .store(u64::from(started.child.id()), Ordering::Relaxed);
        // The new worker's totals start at 0, and it reports only the sites it answered, by
        // the indices of the table it was handed.
        lane_counters.sites.start(self.template.site_labels.clone());
        lane_counters.series.clear();
        tracing::info!(
            instance = i,
            pid = started.child.id(),
            generation = started.handoff.worker_generation,
            ring_generation = started.handoff.generation,
            "worker started"
        );
        // The challenges pending now: the site table it got has every certificate already.
        if plan.acme_challenges {
            if let Some(m) = self
                .acme
                .as_mut()
                .and_then(|a| a.challenges_message(l, true))
            {
                let _ = sys::send_packet(started.control.as_fd(), &m.encode());
            }
        }
        self.workers[l] = Worker {
            child: Some(started.child),
            pidfd: started.pidfd,
            control: Some(started.control),
            sessions: Some(started.sessions_dup),
            pipes: Some(started.pipes),
            stopped: false,
            ..std::mem::take(&mut self.workers[l])
        };
        Ok(())
    }

    /// Reads pending control messages of worker `i`.
    ///
    /// At most [`CONTROL_READS_PER_ROUND`] messages, and no more than its [`Budget`] allows: a
    /// worker that floods its socket gets no more of the supervisor's time than that, and every
    /// other duty still comes round. Messages past the budget's serve rate are dropped unparsed
    /// and counted; `READY` is acted on all the same (it spends, so a flood of it is bounded
    /// too).
    fn read_control(&mut self, i: usize) -> Liveness {
        let buf = &mut self.control_buf;
        for _ in 0..CONTROL_READS_PER_ROUND {
            let w = &mut self.workers[i];
            let Some(control) = w.control.as_ref() else {
                return Liveness::Alive;
            };
            if w.budget.read_after(Instant::now()).is_some() {
                return Liveness::Alive;
            }
            let n = match sys::recv_packet(control.as_fd(), buf) {
                Ok(0) => return Liveness::Gone,
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Liveness::Alive,
                Err(_) => return Liveness::Gone,
            };
            let ic = &self.counters.instances[i];
            let packet = &buf[..n.min(buf.len())];
            let ready = packet == ringmux_proto::message::WORDS[0].as_bytes();
            if w.budget.spend(Instant::now()) == Verdict::Drop && !ready {
                MessageKind::of_control(packet).count_dropped(ic);
                continue;
            }
            // An oversized packet (longer than the buffer) is ignored.
            let report = buf
                .get(..n)
                .map_or(workers::Report::Ignored, workers::Report::of);
            match report {
                workers::Report::Ready => {
                    if !self.policy.is_ready(i) {
                        self.link.liveness().set_up(i, true);
                        let generation = self.policy.lane(i).0;
                        tracing::info!(
                            instance = self.lanes.at(i).instance,
                            generation,
                            "worker ready"
                        );
                    }
                    let actions = self.policy.on(Instant::now(), policy::Event::Ready(i));
                    self.deferred.extend(actions);
                }
                workers::Report::Stats(r) => {
                    ic.record_report(&r, ic.sites.rows_known(self.counters.site_labels.len()))
                }
                workers::Report::Stopped => w.stopped = true,
                workers::Report::Malformed => {
                    ic.reports_malformed.fetch_add(1, Ordering::Relaxed);
                }
                workers::Report::Applied(seq) => {
                    if let Some(a) = self.acme.as_mut() {
                        a.applied(i, seq);
                    }
                }
                workers::Report::Ignored => {}
            }
        }
        Liveness::Alive
    }

    /// Collects the process of a dead worker ([`Worker::reap`]) and says how it ended.
    fn reap(&mut self, i: usize) {
        let ic = &self.counters.instances[i];
        self.link.liveness().set_up(i, false);
        ic.worker_pid.store(0, Ordering::Relaxed);
        let draining = self.policy.draining(i);
        if let Some(a) = self.acme.as_mut() {
            a.forget(i);
        }
        let Some(status) = self.workers[i].reap(draining) else {
            return;
        };
        let (instance, generation) = (self.lanes.at(i).instance, self.policy.lane(i).0);
        if draining {
            tracing::info!(instance, generation, ?status, "worker exited");
        } else {
            tracing::warn!(instance, generation, ?status, "worker process ended");
        }
        // Its descendants are re-parented to the demux now (or as their parents die): look for
        // them at once, and again each round while any turn up.
        self.kill_orphans();
    }

    /// Kills the processes dead workers left behind ([`workers::kill_orphans`]); looks again
    /// next round while any turn up.
    fn kill_orphans(&mut self) {
        let found = workers::kill_orphans(&self.workers);
        self.next_sweep = Instant::now()
            + if found > 0 {
                // Their own children are re-parented as they die: next round.
                Duration::ZERO
            } else {
                ORPHAN_SWEEP
            };
    }

    /// Takes the new generation's descriptors once the data plane has reset the ingress.
    fn collect_reset(&mut self, i: usize) -> Result<()> {
        let w = &mut self.workers[i];
        let Some(rx) = &w.reset_reply else {
            return Ok(());
        };
        match rx.try_recv() {
            Ok(Ok(h)) => {
                w.handles = Some(h);
                w.reset_reply = None;
                let actions = self.policy.on(Instant::now(), policy::Event::ResetDone(i));
                self.deferred.extend(actions);
                Ok(())
            }
            Ok(Err(e)) => bail!("resetting the ring of instance {i}: {e}"),
            Err(TryRecvError::Empty) => Ok(()),
            Err(TryRecvError::Disconnected) => bail!("the data plane stopped"),
        }
    }
}

#[derive(PartialEq, Eq)]
enum Liveness {
    Alive,
    Gone,
}
