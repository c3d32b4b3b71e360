//! Worker supervision: spawns worker processes as direct children, hands each its descriptors
//! and configuration over a control socket, notices a death at once (pidfd and the control
//! socket closing), resets the dead instance's ring and starts a replacement, brings up a new
//! worker generation on `ringmux reload` (or SIGHUP) while the old one drains, and runs the
//! graceful shutdown on SIGTERM/SIGINT. Other instances never notice.
//!
//! Workers live in lanes (one per instance and generation slot, numbered as
//! `ringmux_quic_lb::Router::lane` numbers them); [`policy`] explains.
//!
//! This module is the event loop: it waits for what happens (a worker's message or death, a
//! control client, a signal, the data plane, the ACME engine), feeds it to [`policy`], which
//! decides (READY deadlines, back-off, crash loops, draining) without processes or clocks, and
//! hands the decisions to [`effects`], which carries them out. The rest is by concern, each
//! file below this one and none of them using it, each part of the supervisor's state a type
//! of its own there: [`signals`] tells the signals apart, [`spawn`] plans a worker's start without I/O and carries the plan out ([`spawn::Launcher`]:
//! what every start is given), [`workers`] the processes and descriptors of each lane and what
//! they say ([`workers::WorkerTable`]), [`reload`] reads the next configuration and answers
//! its clients ([`reload::Reloads`]), [`handover`] is what `ringmux upgrade` takes and gives,
//! [`acme`] the certificates relayed ([`acme::Relay`]), [`control`] `ringmux reload`'s socket
//! and its clients ([`control::Clients`]), [`sandbox`] and [`filesystem`] the workers'
//! confinement.

use std::os::fd::{OwnedFd, RawFd};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use nix::sys::signalfd::SignalFd;

use crate::config::Config;
use crate::dataplane::{DataPlaneLink, Event};
use crate::forward::{IngressHandles, Lanes};
use crate::metrics::Counters;
use crate::sys;

pub mod acme;
pub mod control;
pub mod effects;
pub mod filesystem;
pub mod handover;
pub mod health;
pub mod policy;
pub mod reload;
pub mod sandbox;
pub mod signals;
pub mod spawn;
pub mod workers;

pub use handover::{Exported, Upgrade};
pub use spawn::{TcpListeners, Template};

use control::Clients;
use effects::Effects;
use handover::Upgrades;
use policy::{Action, Limits, Policy};
use signals::Signal;
use spawn::Launcher;
use workers::WorkerTable;

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
    /// The binary an upgrade executes, and the upgrade that passed its checks:
    /// [`Supervisor::run`] returns it.
    upgrades: Upgrades,
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
        let cfg = parts.cfg;
        let numbering = Lanes::new(cfg.instances);
        let lanes = numbering.count();
        let limits = Limits::new(cfg.ready_timeout(), cfg.grace(), cfg.max_draining());
        let launcher = Launcher::new(&cfg, parts.public, parts.tcp)?;
        crate::logs::access_to(cfg.access_log().open()?);
        let now = Instant::now();
        let (handed, active) = (parts.lanes, parts.active_generation);
        let policy = match handed.is_empty() {
            true => Policy::new(limits, numbering, now),
            false => {
                let phases: Vec<_> = handed.iter().map(|l| (l.generation, l.phase)).collect();
                let counters = &parts.counters.active_generation;
                counters.store(active, Ordering::Relaxed);
                Policy::adopt(limits, numbering, now, active, &phases)
            }
        };
        parts.sessions.cache().restore(parts.frozen, now);
        let path = std::path::Path::new(&cfg.args.control_socket);
        let control = Clients::adopt(parts.control, path);
        let mut sup = Supervisor {
            launcher,
            policy,
            workers: WorkerTable::new(lanes, now),
            lanes: numbering,
            control,
            reloads: reload::Reloads::new(lanes),
            deferred: Vec::new(),
            upgrades: Upgrades::new(parts.binary),
            acme: parts.acme,
            health: health::Checks::new(parts.counters.health.clone()),
            cfg,
            template: parts.template,
            counters: parts.counters,
            link: parts.link,
            signals: parts.signals,
            sessions: parts.sessions,
        };
        for (l, lane) in handed.into_iter().enumerate() {
            let Some(w) = lane.worker else { continue };
            let (instance, pid) = (sup.lanes.at(l).instance, w.pid);
            let (worker, sessions) = handover::adopt(l, instance, w)?;
            sup.sessions.serve(instance, sessions);
            let idle = lane.phase == crate::upgrade::LanePhase::Idle;
            let (counters, liveness) = (&sup.counters.instances[l], sup.link.liveness());
            sup.workers
                .adopted(l, worker, pid, idle, counters, liveness);
        }
        Ok(sup)
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
            self.effects()
                .spawn(i as u8, h)
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
            if let Some(u) = self.upgrades.take() {
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
        let (forward, binary) = (self.cfg.args.forward, &self.upgrades.binary);
        let checked = handover::refusal(forward, &self.policy, &self.workers, self.lanes, binary);
        let (counters, control) = (&self.counters, &mut self.control);
        self.upgrades.ask(client, checked, counters, control);
    }

    /// Everything a new process image takes over from the supervisor for `upgrade`
    /// ([`handover::export`]): its descriptors by number into `fds`, and the rest returned.
    /// The session cache stops answering until [`Supervisor::upgrade_failed`] (if the upgrade
    /// does not happen).
    pub fn export(
        &mut self,
        upgrade: &Upgrade,
        fds: &mut crate::upgrade::Fds<RawFd>,
    ) -> Result<Exported> {
        let from = handover::Handing {
            policy: &self.policy,
            workers: &self.workers,
            control: &self.control,
            tcp: &self.launcher.tcp,
            sessions: self.sessions.cache(),
            sites: &self.template.sites,
        };
        let exported = handover::export(from, upgrade, fds)?;
        // The health tables go over with the workers, which keep reading them.
        fds.health = self.health.handed_over(self.template.health.as_ref());
        Ok(exported)
    }

    /// The upgrade did not happen (`why`): answers its clients, and serves on.
    pub fn upgrade_failed(&mut self, upgrade: Upgrade, why: &str) {
        self.sessions.cache().thaw();
        handover::failed(upgrade, why, &self.counters, &mut self.control);
    }

    /// A reload asked for by control client `client` (or by SIGHUP)
    /// ([`reload::Reloads::request`]): what the policy answers.
    fn reload(&mut self, client: Option<u64>) -> Vec<Action> {
        let running = reload::Running {
            cfg: &mut self.cfg,
            template: &mut self.template,
            domain: &mut self.launcher.domain,
            acme: self.acme.as_mut(),
            policy: &mut self.policy,
            counters: &self.counters,
        };
        self.reloads.request(client, running, &mut self.control)
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
            let (closed, ready) = self.effects().hear(i);
            self.deferred.extend(ready);
            if closed {
                // Stop polling it; the process itself may still be running.
                self.workers[i].control = None;
            }
            // A draining worker that closed its control socket is gone only once its process
            // is: until then the grace deadline still applies to it. Any other worker that
            // closes it is dead or broken either way, and `reap` makes sure.
            let gone = self.workers[i].exited() || (closed && !self.policy.draining(i));
            if gone && self.workers[i].child.is_some() {
                self.effects().reap(i);
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
        let done = self.effects().carry_out(actions);
        self.effects().answer_reloads();
        let gauges = self.policy.gauges(Instant::now());
        for (c, (generation, state, draining)) in self.counters.instances.iter().zip(gauges) {
            c.set_lane(generation, state, draining);
        }
        done
    }

    /// The signal that came, if one did ([`Signal`]); what the policy answers.
    fn signal(&mut self) -> Vec<Action> {
        let Some(raw) = sys::read_signal(&self.signals) else {
            return Vec::new();
        };
        let signal = Signal::of(raw, self.policy.shutting_down());
        signal.log(self.cfg.grace());
        match signal {
            Signal::Reload => self.reload(None),
            Signal::Upgrade => {
                self.upgrade_request(None);
                Vec::new()
            }
            Signal::Stop { .. } => self
                .policy
                .on(Instant::now(), policy::Event::ShutdownSignal),
        }
    }

    /// What the policy's actions act on, borrowed for a round.
    fn effects(&mut self) -> Effects<'_> {
        Effects {
            cfg: &self.cfg,
            template: &self.template,
            counters: &self.counters,
            link: &self.link,
            policy: &mut self.policy,
            workers: &mut self.workers,
            sessions: &self.sessions,
            launcher: &self.launcher,
            lanes: self.lanes,
            control: &mut self.control,
            reloads: &mut self.reloads,
            acme: self.acme.as_mut(),
        }
    }
}
