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
//! them using it, each part of the supervisor's state a type of its own there:
//! [`spawn`] plans a worker's start without I/O and carries the plan out ([`spawn::Launcher`]:
//! what every start is given), [`workers`] the processes and descriptors of each lane and what
//! they say ([`workers::WorkerTable`]), [`reload`] reads the next configuration and answers
//! its clients ([`reload::Reloads`]), [`handover`] is what `ringmux upgrade` takes and gives,
//! [`acme`] the certificates relayed ([`acme::Relay`]), [`control`] `ringmux reload`'s socket
//! and its clients ([`control::Clients`]), [`sandbox`] and [`filesystem`] the workers'
//! confinement.

use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use nix::sys::signalfd::SignalFd;
use ringmux_proto::Message;

use crate::config::Config;
use crate::dataplane::{DataPlaneLink, Event};
use crate::forward::{IngressHandles, Lanes};
use crate::metrics::Counters;
use crate::sys;

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

use control::Clients;
use policy::{Action, Limits, Policy};
use spawn::Launcher;
use workers::{Worker, WorkerTable};

pub struct Supervisor {
    cfg: Config,
    template: Template,
    counters: Arc<Counters>,
    link: DataPlaneLink,
    signals: SignalFd,
    policy: Policy,
    /// Every lane's worker, by lane.
    workers: WorkerTable,
    sessions: crate::sessions::Sessions,
    /// What every worker's start is given besides its lane.
    launcher: Launcher,
    /// How the lanes of the instances are numbered.
    lanes: Lanes,
    /// `ringmux reload`'s socket (unless `--control-socket off`) and its clients.
    control: Clients,
    /// Control clients waiting for the outcome of the reload under way, and why each lane's
    /// start failed last.
    reloads: reload::Reloads,
    /// What the policy decided while the supervisor was reading (READY, reset replies), to
    /// carry out with the round's other actions.
    deferred: Vec<Action>,
    /// The `ringmux` binary on disk (what an upgrade executes).
    binary: PathBuf,
    /// An upgrade that passed its checks: [`Supervisor::run`] returns it.
    upgrade: Option<Upgrade>,
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
        let launcher = Launcher::new(&cfg, public, tcp)?;
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
        let control = Clients::adopt(control, std::path::Path::new(&cfg.args.control_socket));
        let mut sup = Supervisor {
            launcher,
            policy,
            workers: WorkerTable::new(lanes, now),
            lanes: numbering,
            control,
            reloads: reload::Reloads::new(lanes),
            deferred: Vec::new(),
            binary,
            upgrade: None,
            acme,
            health: health::Checks::new(counters.health.clone()),
            cfg,
            template,
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
        self.control.answer_upgrade(line);
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
        match refused {
            Ok(()) => Upgrade::ask(&mut self.upgrade, client, &self.binary),
            Err(why) => {
                tracing::warn!(reason = %why, "upgrade refused; this demux serves on");
                self.counters
                    .upgrades_failed
                    .fetch_add(1, Ordering::Relaxed);
                let line = format!("error: {why}; this demux serves on");
                self.control.answer(client, &line);
            }
        }
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
        if let Some((listener, answers)) = self.control.export(&upgrade.clients) {
            fds.control = Some(listener);
            fds.answers = answers;
        }
        let tcp = &self.launcher.tcp;
        fds.tcp = tcp.https.as_ref().map(AsRawFd::as_raw_fd);
        fds.redirect = tcp.redirect.as_ref().map(AsRawFd::as_raw_fd);
        fds.health = self.health.handed_over(self.template.health.as_ref());
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
        for id in upgrade.clients {
            self.control
                .answer(id, &format!("error: {why}; this demux serves on"));
        }
    }

    /// A reload asked for by control client `client` (or by SIGHUP): reads the command line's
    /// configuration file and certificates again, checked as a start checks them
    /// ([`reload::next_generation`]), then lets the policy start the next generation with
    /// them. Refusals are answered at once, and the running configuration serves on.
    fn reload(&mut self, client: Option<u64>) -> Vec<Action> {
        let next = match reload::next_generation(&self.cfg, &self.template, self.acme.is_some()) {
            Ok(next) => next,
            Err(why) => {
                tracing::error!(error = format!("{why:#}"), "reload refused");
                self.counters.reloads_failed.fetch_add(1, Ordering::Relaxed);
                let active = self.policy.active();
                let line = format!("error: {why:#}; generation {active} serves on");
                self.control.answer(client, &line);
                return Vec::new();
            }
        };
        let actions = self.policy.on(Instant::now(), policy::Event::Reload);
        if let Some(Action::ReloadRefused(r)) = actions.first() {
            let why = reload::refusal_line(r);
            tracing::warn!(reason = %why, "reload refused");
            self.control.answer(client, &format!("error: {why}"));
            return Vec::new();
        }
        // The next generation starts from these.
        next.apply(reload::Running {
            cfg: &mut self.cfg,
            template: &mut self.template,
            domain: &mut self.launcher.domain,
            acme: self.acme.as_mut(),
            policy: &mut self.policy,
            counters: &self.counters,
        });
        self.reloads.waiters.join(self.control.server(), client);
        actions
    }

    /// One round: wait up to `timeout` for anything to happen, feed what happened to the
    /// policy, carry out its actions. `Ok(true)` once the shutdown is complete.
    fn step(&mut self, timeout: Duration) -> Result<bool> {
        let now = Instant::now();
        let mut timeout = timeout;
        let mut fds = vec![sys::signal_fd(&self.signals)];
        self.workers.poll_fds(now, &mut timeout, &mut fds);
        fds.extend(self.control.fds());
        if let Some(a) = &self.acme {
            fds.push(a.fd());
        }
        if let Some(until) = self.reloads.waiters.due() {
            timeout = timeout.min(until.saturating_duration_since(now));
        }
        let _ = sys::poll_readable(&fds, Some(timeout));
        drop(fds);

        let mut actions = Vec::new();
        let workers = &self.workers;
        let requests = self.control.poll(Instant::now(), |pid| workers.runs(pid));
        for (client, request) in requests {
            match request {
                control::Request::Reload => actions.extend(self.reload(Some(client))),
                control::Request::ReloadCheck => {
                    let acme = self.acme.is_some();
                    let answer = reload::check_line(&self.cfg, &self.template, acme);
                    self.control.answer(client, &answer);
                }
                control::Request::Upgrade => self.upgrade_request(Some(client)),
                control::Request::AcmeRenew(name) => {
                    acme::renew_request(self.acme.as_mut(), client, name, &mut self.control)
                }
            }
        }
        actions.extend(self.signal());
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
            let closed = self.read_control(i);
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
            if self.workers.collect_reset(i)? {
                let done = self.policy.on(Instant::now(), policy::Event::ResetDone(i));
                self.deferred.extend(done);
            }
        }
        if let Some(relay) = self.acme.as_mut() {
            let (workers, control) = (&self.workers, &mut self.control);
            relay.relay(
                workers,
                self.lanes,
                &self.counters,
                &mut self.template,
                control,
            );
        }
        self.health.follow(self.template.health.as_ref());
        if self.workers.sweep_due(Instant::now()) {
            self.workers.kill_orphans();
        }
        actions.append(&mut self.deferred);
        actions.extend(self.policy.tick(Instant::now()));
        let done = self.carry_out(actions);
        let (reloads, mut books) = self.reload_books();
        reloads.answer(&mut books, Instant::now());
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

    /// The signal that came, if one did: SIGHUP reloads, SIGUSR2 upgrades, any other starts
    /// the shutdown (a second one cuts it); what the policy answers.
    fn signal(&mut self) -> Vec<Action> {
        let signal = sys::read_signal(&self.signals);
        if signal == Some(libc::SIGHUP) {
            tracing::info!("SIGHUP: reloading");
            return self.reload(None);
        }
        if signal == Some(libc::SIGUSR2) {
            tracing::info!("SIGUSR2: upgrading");
            self.upgrade_request(None);
            return Vec::new();
        }
        let Some(sig) = signal else {
            return Vec::new();
        };
        if self.policy.shutting_down() {
            tracing::warn!(signal = sig, "second signal: stopping now");
        } else {
            match self.cfg.grace() {
                Some(grace) => tracing::info!(signal = sig, ?grace, "shutting down: draining workers (what they still serve at the end of --grace is cut; a second signal cuts it now)"),
                None => tracing::info!(signal = sig, "shutting down: draining workers until every request in flight is done (no --grace; a second signal cuts them now)"),
            }
        }
        self.policy
            .on(Instant::now(), policy::Event::ShutdownSignal)
    }

    /// The reloads' books, with what they read of the rest of the supervisor.
    fn reload_books(&mut self) -> (&mut reload::Reloads, reload::Books<'_>) {
        let books = reload::Books {
            cfg: &self.cfg,
            policy: &self.policy,
            counters: &self.counters,
            workers: &self.workers,
            control: &mut self.control,
        };
        (&mut self.reloads, books)
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
                | Action::ReloadWaits { .. }) => {
                    let (reloads, mut books) = self.reload_books();
                    reloads.report(a, &mut books);
                }
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
                    self.workers[i].tell(&Message::Shutdown);
                }
                Action::Died(d) => workers::log_death(&d, self.cfg.worker_program()),
                Action::Finish => {
                    tracing::info!("all workers exited");
                    let last = "error: ringmux is shutting down";
                    self.reloads.waiters.tell(self.control.server(), last, true);
                    self.workers.kill_orphans();
                    return Ok(true);
                }
                Action::CutAllAndFinish => {
                    workers::cut_all(&mut self.workers, &self.counters, self.lanes);
                    self.workers.kill_orphans();
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
        self.workers[i].tell(&Message::Cut);
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
                self.reloads.started(i, None);
                policy::Event::Started(i)
            }
            Err(e) => {
                let why = format!("{e:#}");
                tracing::error!(instance = self.lanes.at(i).instance, generation, error = %why, "starting a worker failed");
                self.reloads.started(i, Some(why));
                policy::Event::StartFailed(i)
            }
        };
        self.policy.on(Instant::now(), event)
    }

    /// Starts lane `lane`'s worker on `handles` ([`Launcher::start`]), and keeps the books:
    /// its session socket served, its counters started again, its descriptors held.
    fn spawn(&mut self, lane: u8, handles: IngressHandles) -> Result<()> {
        let l = usize::from(lane);
        let slot = spawn::Slot {
            lane: l,
            instance: self.lanes.at(l).instance,
            generation: self.policy.lane(l).0,
            ingress: spawn::ingress_kind(&handles),
        };
        let acme = self.acme.is_some();
        let (started, challenges) =
            self.launcher
                .start(&self.cfg, &self.template, slot, acme, handles)?;
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
        if challenges {
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

    /// Reads pending control messages of lane `i`'s worker ([`WorkerTable::read`]) and acts
    /// on its `READY`s and confirmations; `true` when its control socket closed.
    fn read_control(&mut self, i: usize) -> bool {
        let heard = self.workers.read(i, &self.counters);
        for _ in 0..heard.ready {
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
        if let Some(a) = self.acme.as_mut() {
            for seq in heard.applied {
                a.applied(i, seq);
            }
        }
        heard.gone
    }

    /// Collects the process of a dead worker ([`WorkerTable::reap`]) and forgets it.
    fn reap(&mut self, i: usize) {
        self.link.liveness().set_up(i, false);
        self.counters.instances[i]
            .worker_pid
            .store(0, Ordering::Relaxed);
        let draining = self.policy.draining(i);
        if let Some(a) = self.acme.as_mut() {
            a.forget(i);
        }
        let (instance, generation) = (self.lanes.at(i).instance, self.policy.lane(i).0);
        self.workers.reap(i, draining, instance, generation);
    }
}
