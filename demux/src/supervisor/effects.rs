//! What the policy decided, carried out: the supervisor's parts its actions act on, borrowed
//! for a round ([`Effects`]), and each action done to them (a worker started, killed, told to
//! drain or cut, reaped; a lane's ingress reset or closed; a generation activated; a reload's
//! clients answered; the shutdown finished). It decides nothing: [`super::policy`] does, and
//! hears here what came of it (`Started`, `StartFailed`, `Ready`). The loop in `mod.rs` waits
//! for events and hands the policy's actions over.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use ringmux_proto::Message;

use super::acme;
use super::control::Clients;
use super::policy::{self, Action, Policy};
use super::reload::{Books, Reloads};
use super::spawn::{self, Launcher, Template};
use super::workers::{self, Named, WorkerTable};
use crate::config::Config;
use crate::dataplane::DataPlaneLink;
use crate::forward::{IngressHandles, Lanes};
use crate::metrics::Counters;
use crate::sessions::Sessions;

/// The supervisor's parts the policy's actions act on, borrowed from it.
pub struct Effects<'a> {
    pub cfg: &'a Config,
    pub template: &'a Template,
    pub counters: &'a Counters,
    pub link: &'a DataPlaneLink,
    pub policy: &'a mut Policy,
    pub workers: &'a mut WorkerTable,
    pub sessions: &'a Sessions,
    pub launcher: &'a Launcher,
    pub lanes: Lanes,
    pub control: &'a mut Clients,
    pub reloads: &'a mut Reloads,
    pub acme: Option<&'a mut acme::Relay>,
}

impl Effects<'_> {
    /// Does what the policy decided, and what it answers to that in turn. `Ok(true)`: the
    /// shutdown is complete.
    pub fn carry_out(&mut self, actions: Vec<Action>) -> Result<bool> {
        let mut queue = VecDeque::from(actions);
        while let Some(action) = queue.pop_front() {
            match action {
                Action::Kill(i, why) => self.workers.kill(i, why, self.named(i), self.cfg),
                Action::Cut(i, why) => {
                    let since = self.policy.draining_since(i);
                    let age = since.map(|s| Instant::now().saturating_duration_since(s));
                    let c = &self.counters.instances[i];
                    let who = self.named(i);
                    self.workers.cut(i, why, who, age, self.cfg, c);
                }
                Action::Close(l) => {
                    self.workers[l].handles = None;
                    self.link.close(l as u8);
                }
                Action::Activate { generation } => self.activate(generation)?,
                a @ (Action::Reloaded { .. }
                | Action::ReloadFailed { .. }
                | Action::ReloadWaits { .. }) => {
                    let (reloads, mut books) = self.books();
                    reloads.report(a, &mut books);
                }
                Action::ReloadRefused(_) => {}
                Action::RequestReset(i) => {
                    self.workers[i].reset_reply = Some(self.link.request_reset(i as u8));
                }
                Action::Start(i) => queue.extend(self.start(i)),
                Action::Drain(i) => {
                    if !self.policy.shutting_down() {
                        let Named {
                            instance,
                            generation,
                        } = self.named(i);
                        tracing::info!(instance, generation, "asking a replaced worker to drain");
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
                    workers::cut_all(self.workers, self.counters, self.lanes);
                    self.workers.kill_orphans();
                    return Ok(true);
                }
            }
        }
        Ok(false)
    }

    /// Starts lane `lane`'s worker on `handles` ([`Launcher::start`]), and keeps the books
    /// ([`WorkerTable::started`]): its session socket served, the ACME challenges pending sent.
    pub fn spawn(&mut self, lane: u8, handles: IngressHandles) -> Result<()> {
        let l = usize::from(lane);
        let who = self.named(l);
        let slot = spawn::Slot {
            lane: l,
            instance: who.instance,
            generation: who.generation,
            ingress: spawn::ingress_kind(&handles),
        };
        let acme = self.acme.is_some();
        let (started, challenges) =
            self.launcher
                .start(self.cfg, self.template, slot, acme, handles)?;
        // The challenges pending now: the site table it got has every certificate already.
        let relay = self.acme.as_mut().filter(|_| challenges);
        let challenges = relay.and_then(|a| a.challenges_message(l, true));
        let (counters, labels) = (&self.counters.instances[l], &self.template.site_labels);
        let sessions = self
            .workers
            .started(l, started, counters, labels.clone(), challenges);
        self.sessions.serve(who.instance, sessions);
        Ok(())
    }

    /// Reads pending control messages of lane `i`'s worker ([`WorkerTable::read`]) and acts
    /// on its `READY`s and confirmations: whether its control socket closed, and what the
    /// policy answers to its `READY`s.
    pub fn hear(&mut self, i: usize) -> (bool, Vec<Action>) {
        let heard = self.workers.read(i, self.counters);
        let mut actions = Vec::new();
        for _ in 0..heard.ready {
            if !self.policy.is_ready(i) {
                self.link.liveness().set_up(i, true);
                let Named {
                    instance,
                    generation,
                } = self.named(i);
                tracing::info!(instance, generation, "worker ready");
            }
            actions.extend(self.policy.on(Instant::now(), policy::Event::Ready(i)));
        }
        if let Some(a) = self.acme.as_mut() {
            for seq in heard.applied {
                a.applied(i, seq);
            }
        }
        (heard.gone, actions)
    }

    /// Collects the process of a dead worker ([`WorkerTable::reap`]) and forgets it.
    pub fn reap(&mut self, i: usize) {
        if let Some(a) = self.acme.as_mut() {
            a.forget(i);
        }
        let (draining, who) = (self.policy.draining(i), self.named(i));
        let (counters, liveness) = (&self.counters.instances[i], self.link.liveness());
        self.workers.reap(i, draining, who, counters, liveness);
    }

    /// Tells the clients of the reload under way what they wait for, if it is time
    /// ([`Reloads::answer`]).
    pub fn answer_reloads(&mut self) {
        let (reloads, mut books) = self.books();
        reloads.answer(&mut books, Instant::now());
    }

    /// Which worker lane `i` holds, as its log lines name it.
    fn named(&self, i: usize) -> Named {
        Named {
            instance: self.lanes.at(i).instance,
            generation: self.policy.lane(i).0,
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

    /// New connections go to `generation`'s lanes: the data plane switches (it looks at
    /// commands at least every gauge period), then the counters say so.
    fn activate(&mut self, generation: u64) -> Result<()> {
        let slot = ringmux_proto::generation_slot(generation);
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
        Ok(())
    }

    /// The reloads' books, with what they read of the rest of the supervisor.
    fn books(&mut self) -> (&mut Reloads, Books<'_>) {
        let books = Books {
            cfg: self.cfg,
            policy: &*self.policy,
            counters: self.counters,
            workers: &self.workers[..],
            control: &mut *self.control,
        };
        (&mut *self.reloads, books)
    }
}
