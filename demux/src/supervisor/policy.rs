//! The supervisor's decisions, apart from their effects (as `quinn-proto` is apart from
//! sockets): when a starting worker has waited too long for READY, how long a dead one waits
//! before its replacement (back-off, crash loops), when a replacement may start (its new ring
//! generation exists), how a reload brings up a new worker generation and retires the old one,
//! and how a shutdown drains. It never forks, polls, signals or reads a clock: the caller feeds
//! [`Event`]s with the time, and carries out the [`Action`]s returned. `supervisor.rs` is that
//! caller; the tests below drive it on a fake clock.
//!
//! Workers live in *lanes*: lane `slot * instances + instance` is the worker of `instance` in
//! worker-generation slot `slot` (`(generation - 1) mod 4`, which its connection IDs carry).
//! The active generation's lanes are restarted when they die; a new generation (a reload)
//! becomes active once every one of its workers is READY, and the one before it then drains.
//!
//! A drain has no clock unless [`Limits::grace`] sets one: a replaced worker serves what it has
//! in flight to its end. What bounds the drains is [`Limits::max_draining`], the generations
//! that may drain beside the serving one: a reload past it *cuts* the oldest (control message
//! `CUT`: the worker ends what it serves, logs each request it cut, and exits), and so does a
//! grace period that ends. A cut worker still there [`CUT_WAIT`] later is killed.

use std::time::{Duration, Instant};

use ringmux_proto::generation_slot;

use crate::forward::Lanes;

/// How long after a new generation became active the old one is asked to drain: datagrams the
/// data plane handed to the old workers just before the switch (the first packets of a
/// connection among them) are taken and answered first.
pub const DRAIN_DELAY: Duration = Duration::from_millis(100);

/// How long a worker told to cut (control message `CUT`) has to end what it serves, write its
/// access-log lines and exit before it is killed.
pub use ringmux_proto::CUT_WAIT;

/// The supervisor's timings and bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// How long a starting worker may take to report READY.
    pub ready_timeout: Duration,
    /// How long workers may drain (after a shutdown signal, or once replaced by a reload);
    /// `None`: as long as they serve anything.
    pub grace: Option<Duration>,
    /// Most generations draining beside the serving one (1 to 3: the generation slots).
    pub max_draining: usize,
    /// First restart delay of a crash loop; doubled each crash up to `backoff_max`.
    pub backoff_min: Duration,
    pub backoff_max: Duration,
    /// A worker that was ready and ran this long before dying is not in a crash loop: restart
    /// at once.
    pub healthy_uptime: Duration,
}

impl Limits {
    /// ringmux's timings around the operator's READY timeout, grace period and bound on
    /// draining generations (held to 1..=3).
    pub fn new(ready_timeout: Duration, grace: Option<Duration>, max_draining: usize) -> Self {
        Limits {
            ready_timeout,
            grace,
            max_draining: max_draining.clamp(1, 3),
            backoff_min: Duration::from_millis(100),
            backoff_max: Duration::from_secs(5),
            healthy_uptime: Duration::from_secs(10),
        }
    }
}

/// What happened. Numbers are lanes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    /// A worker process was started in the lane.
    Started(usize),
    /// It reported READY.
    Ready(usize),
    /// Its process is gone (it exited, was killed, or its control socket closed).
    Exited(usize),
    /// Starting a worker failed (no process exists).
    StartFailed(usize),
    /// The data plane reports it broke the ring protocol or stopped draining.
    Misbehaved(usize),
    /// The lane's new ingress is ready for a worker.
    ResetDone(usize),
    /// SIGTERM or SIGINT.
    ShutdownSignal,
    /// `ringmux reload` or SIGHUP: start a new generation of every instance.
    Reload,
}

/// What to do. Numbers are lanes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Kill the lane's process (its death comes back as [`Event::Exited`]).
    Kill(usize, Why),
    /// Tell the lane's worker to cut (control message `CUT`): end every request it still
    /// serves, write their access-log lines, exit. Killed [`CUT_WAIT`] later if still there.
    Cut(usize, Why),
    /// Ask the data plane for a new ingress for the lane.
    RequestReset(usize),
    /// Start a worker in the lane now.
    Start(usize),
    /// Ask the lane's worker to drain (control message SHUTDOWN).
    Drain(usize),
    /// No generation holds the lane any more: close its ingress.
    Close(usize),
    /// The lane's worker died outside a shutdown and is replaced: log it.
    Died(Death),
    /// Hash new connections to `generation`'s lanes from now on.
    Activate { generation: u64 },
    /// The reload is done: `generation` serves, `replaced` drains.
    Reloaded { generation: u64, replaced: u64 },
    /// The reload of `generation` failed; the generation before serves on.
    ReloadFailed {
        generation: u64,
        instance: usize,
        why: Failure,
    },
    /// A reload was asked for while one cannot start now.
    ReloadRefused(Refusal),
    /// The reload of `generation` waits for `draining`, which holds its slot, to exit.
    ReloadWaits { generation: u64, draining: u64 },
    /// Shutdown complete: every worker is gone.
    Finish,
    /// Shutdown cut short (grace over, or a second signal): cut every remaining worker, kill
    /// those still there after [`CUT_WAIT`], and finish.
    CutAllAndFinish,
}

/// Why a worker is killed or cut.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Why {
    /// It did not report READY within the timeout.
    NotReady,
    /// The data plane reported it (ring protocol violation, or a stalled ring).
    Misbehaved,
    /// It was still draining when the grace period ended.
    GraceOver,
    /// Its generation was the oldest draining one when a reload needed room
    /// ([`Limits::max_draining`], or its generation slot).
    TooManyDraining,
    /// It was told to cut and did not exit within [`CUT_WAIT`].
    CutIgnored,
    /// Its generation failed to start: every worker of it goes.
    Abandoned,
}

/// Why a new generation was abandoned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// A worker exited (or was killed as misbehaving) before every one was READY.
    Exited,
    /// A worker could not be started at all.
    StartFailed,
    /// A worker did not report READY within the timeout.
    NotReady,
    /// A shutdown came first.
    Shutdown,
}

/// Why the supervisor has nothing to hand over now ([`Policy::export`]): only a settled one
/// hands over.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Unsettled {
    #[error("ringmux is shutting down")]
    ShuttingDown,
    #[error(
        "a reload is under way (generation {generation} is starting); run the upgrade once it \
         is done"
    )]
    Reloading { generation: u64 },
    #[error(
        "instance {instance}'s worker (generation {generation}) is starting, restarting or being \
         stopped; run the upgrade again in a moment"
    )]
    LaneBusy { instance: usize, generation: u64 },
}

/// Why a reload was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// The previous reload is still starting `generation`.
    Starting { generation: u64 },
    /// A shutdown is under way.
    ShuttingDown,
}

/// How a worker died, for the log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Death {
    pub instance: usize,
    /// How long it ran.
    pub uptime: Duration,
    /// It had reported READY.
    pub was_ready: bool,
    /// Deaths in a row, each before `healthy_uptime`.
    pub crashes: u32,
    /// When the replacement starts (once its ingress is reset).
    pub restart_in: Duration,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// No generation holds the lane.
    Idle,
    /// Started at the lane's `started`, not READY yet.
    Starting,
    Ready,
    /// Dead (or not started yet); a worker starts at `restart_at` once the ingress is reset.
    Down {
        restart_at: Instant,
        reset_done: bool,
    },
    /// Replaced (by a reload) or shutting down since `since`; `told` once asked to drain. Not
    /// restarted when it exits; cut when the grace period is over or its generation must make
    /// room, then killed if it does not exit.
    Draining {
        since: Instant,
        told: bool,
        cut: Cut,
    },
    /// Its generation failed to start: killed, waiting for its death.
    Abandoned,
    /// Exited during the shutdown.
    Gone,
}

/// Whether a draining worker was told to cut.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Cut {
    No,
    /// Told at this time.
    Told(Instant),
    /// Killed after [`CUT_WAIT`].
    Killed,
}

#[derive(Debug, Clone, Copy)]
struct Lane {
    phase: Phase,
    /// The worker generation holding the lane (0: none).
    generation: u64,
    started: Instant,
    backoff: Duration,
    crashes: u32,
    /// Killed for missing the READY deadline (kill once, then wait for the death).
    timed_out: bool,
}

/// The decisions for every lane.
#[derive(Debug)]
pub struct Policy {
    limits: Limits,
    numbering: Lanes,
    lanes: Vec<Lane>,
    /// The generation new connections go to.
    active: u64,
    /// A reload under way: the generation starting, and whether it still waits for its slot.
    candidate: Option<(u64, bool)>,
    /// Set by the first shutdown signal: when it came (the grace period counts from there).
    shutdown_since: Option<Instant>,
}

impl Policy {
    /// The lanes of `numbering`, the first generation of each instance being started at `now`
    /// (generation slot 0; the other slots' lanes are idle).
    pub fn new(limits: Limits, numbering: Lanes, now: Instant) -> Self {
        let lane = |phase, generation| Lane {
            phase,
            generation,
            started: now,
            backoff: limits.backoff_min,
            crashes: 0,
            timed_out: false,
        };
        let lanes = numbering
            .all()
            .map(|l| {
                if l.slot == 0 {
                    lane(Phase::Starting, 1)
                } else {
                    lane(Phase::Idle, 0)
                }
            })
            .collect();
        Policy {
            limits,
            numbering,
            lanes,
            active: 1,
            candidate: None,
            shutdown_since: None,
        }
    }

    /// The lanes a previous process image of the demux handed over (`ringmux upgrade`): each
    /// lane's generation and phase, `active` the generation new connections go to.
    pub fn adopt(
        limits: Limits,
        numbering: Lanes,
        now: Instant,
        active: u64,
        lanes: &[(u64, crate::upgrade::LanePhase)],
    ) -> Self {
        use crate::upgrade::LanePhase;
        let lanes = lanes
            .iter()
            .map(|&(generation, phase)| Lane {
                phase: match phase {
                    LanePhase::Idle => Phase::Idle,
                    LanePhase::Ready => Phase::Ready,
                    LanePhase::Draining { elapsed_ms, told } => Phase::Draining {
                        since: now
                            .checked_sub(Duration::from_millis(elapsed_ms))
                            .unwrap_or(now),
                        told,
                        cut: Cut::No,
                    },
                },
                generation,
                started: now,
                backoff: limits.backoff_min,
                crashes: 0,
                timed_out: false,
            })
            .collect();
        Policy {
            limits,
            numbering,
            lanes,
            active,
            candidate: None,
            shutdown_since: None,
        }
    }

    /// Every lane's generation and phase for a new process image, or why there is none to
    /// hand over now: only a settled supervisor hands over (no reload, restart or shutdown
    /// under way), so that no decision is lost between the two images.
    pub fn export(&self, now: Instant) -> Result<Vec<(u64, crate::upgrade::LanePhase)>, Unsettled> {
        use crate::upgrade::LanePhase;
        if self.shutdown_since.is_some() {
            return Err(Unsettled::ShuttingDown);
        }
        if let Some((generation, _)) = self.candidate {
            return Err(Unsettled::Reloading { generation });
        }
        self.lanes
            .iter()
            .enumerate()
            .map(|(l, lane)| {
                let phase = match lane.phase {
                    Phase::Idle | Phase::Gone => LanePhase::Idle,
                    Phase::Ready => LanePhase::Ready,
                    Phase::Draining {
                        since,
                        told,
                        cut: Cut::No,
                    } => LanePhase::Draining {
                        elapsed_ms: now.saturating_duration_since(since).as_millis() as u64,
                        told,
                    },
                    Phase::Starting
                    | Phase::Down { .. }
                    | Phase::Abandoned
                    | Phase::Draining { .. } => {
                        return Err(Unsettled::LaneBusy {
                            instance: usize::from(self.numbering.at(l).instance),
                            generation: lane.generation,
                        })
                    }
                };
                Ok((lane.generation, phase))
            })
            .collect()
    }

    /// Whether lane `l`'s worker has reported READY (and not died since).
    pub fn is_ready(&self, l: usize) -> bool {
        self.lanes[l].phase == Phase::Ready
    }

    /// Whether a shutdown is under way.
    pub fn shutting_down(&self) -> bool {
        self.shutdown_since.is_some()
    }

    /// Whether lane `l`'s worker was asked to drain, or is being killed with its failed
    /// generation (its exit is expected, not a crash).
    pub fn draining(&self, l: usize) -> bool {
        matches!(
            self.lanes[l].phase,
            Phase::Draining { .. } | Phase::Gone | Phase::Abandoned
        )
    }

    /// The generation holding lane `l` (0: none) and what its worker does, for the metrics.
    pub fn lane(&self, l: usize) -> (u64, crate::metrics::LaneState) {
        use crate::metrics::LaneState;
        let lane = &self.lanes[l];
        let state = match lane.phase {
            Phase::Idle | Phase::Gone => LaneState::Idle,
            Phase::Starting | Phase::Down { .. } => LaneState::Starting,
            Phase::Ready => LaneState::Serving,
            Phase::Draining { .. } | Phase::Abandoned => LaneState::Draining,
        };
        (lane.generation, state)
    }

    /// The generation new connections go to.
    pub fn active(&self) -> u64 {
        self.active
    }

    /// The lanes of `generation` (one per instance, in instance order).
    pub fn lanes_of(&self, generation: u64) -> std::ops::Range<usize> {
        let first = self.numbering.of(0, generation_slot(generation)).index;
        first..first + self.numbering.instances()
    }

    /// Decides what `event` calls for.
    pub fn on(&mut self, now: Instant, event: Event) -> Vec<Action> {
        let mut out = Vec::new();
        match event {
            Event::Started(l) => {
                let lane = &mut self.lanes[l];
                lane.phase = Phase::Starting;
                lane.started = now;
                lane.timed_out = false;
                if self.shutdown_since.is_some() {
                    // Started just as the shutdown came: drain it too.
                    lane.phase = Phase::Draining {
                        since: now,
                        told: true,
                        cut: Cut::No,
                    };
                    out.push(Action::Drain(l));
                }
            }
            Event::Ready(l) => {
                if self.lanes[l].phase == Phase::Starting {
                    self.lanes[l].phase = Phase::Ready;
                    self.activate_if_ready(now, &mut out);
                }
            }
            Event::Exited(l) => self.died(now, l, Failure::Exited, &mut out),
            Event::StartFailed(l) => self.died(now, l, Failure::StartFailed, &mut out),
            Event::Misbehaved(l) => {
                if matches!(
                    self.lanes[l].phase,
                    Phase::Starting | Phase::Ready | Phase::Draining { .. }
                ) {
                    out.push(Action::Kill(l, Why::Misbehaved));
                }
            }
            Event::ResetDone(l) => match self.lanes[l].phase {
                Phase::Down { restart_at, .. } => {
                    self.lanes[l].phase = Phase::Down {
                        restart_at,
                        reset_done: true,
                    };
                }
                // Nobody will use it any more (its generation was replaced or abandoned).
                Phase::Idle => out.push(Action::Close(l)),
                _ => {}
            },
            Event::ShutdownSignal => {
                if self.shutdown_since.is_some() {
                    out.push(Action::CutAllAndFinish);
                    return out;
                }
                self.shutdown_since = Some(now);
                if let Some((generation, _)) = self.candidate.take() {
                    let instance = 0;
                    out.push(Action::ReloadFailed {
                        generation,
                        instance,
                        why: Failure::Shutdown,
                    });
                }
                for (l, lane) in self.lanes.iter_mut().enumerate() {
                    lane.phase = match lane.phase {
                        Phase::Starting | Phase::Ready | Phase::Draining { told: false, .. } => {
                            out.push(Action::Drain(l));
                            Phase::Draining {
                                since: now,
                                told: true,
                                cut: Cut::No,
                            }
                        }
                        p @ (Phase::Draining { .. } | Phase::Abandoned) => p,
                        // Nobody to drain and no replacement to start.
                        Phase::Down { .. } | Phase::Gone | Phase::Idle => Phase::Gone,
                    };
                }
                self.finish_if_all_gone(&mut out);
            }
            Event::Reload => self.reload(now, &mut out),
        }
        out
    }

    /// Takes up new limits (a reload): a grace period set, changed or removed applies to the
    /// drains under way too, counted from when each began; a lower `max_draining` applies at
    /// the next reload.
    pub fn set_limits(&mut self, limits: Limits) {
        self.limits = limits;
    }

    /// When lane `l`'s worker began to drain, if it drains.
    pub fn draining_since(&self, l: usize) -> Option<Instant> {
        match self.lanes[l].phase {
            Phase::Draining { since, .. } => Some(since),
            _ => None,
        }
    }

    /// What the metrics show of every lane `now`, in lane order: its generation and state
    /// ([`Policy::lane`]), and how long its worker has drained, if it drains.
    pub fn gauges(
        &self,
        now: Instant,
    ) -> impl Iterator<Item = (u64, crate::metrics::LaneState, Option<Duration>)> + '_ {
        (0..self.lanes.len()).map(move |l| {
            let (generation, state) = self.lane(l);
            let since = self.draining_since(l);
            let draining = since.map(|s| now.saturating_duration_since(s));
            (generation, state, draining)
        })
    }

    /// Decides what the passing of time calls for: READY deadlines, restarts that are due, the
    /// old generation's drain, the end of a grace period, cut workers that did not exit.
    pub fn tick(&mut self, now: Instant) -> Vec<Action> {
        let mut out = Vec::new();
        if let Some(since) = self.shutdown_since {
            let over = self.limits.grace.is_some_and(|g| now >= since + g);
            if over
                && self
                    .lanes
                    .iter()
                    .any(|l| !matches!(l.phase, Phase::Gone | Phase::Idle))
            {
                out.push(Action::CutAllAndFinish);
                return out;
            }
            // A worker cut before the shutdown came still has CUT_WAIT to exit.
            for (l, lane) in self.lanes.iter_mut().enumerate() {
                if let Phase::Draining {
                    since,
                    told,
                    cut: Cut::Told(at),
                } = lane.phase
                {
                    if now >= at + CUT_WAIT {
                        lane.phase = Phase::Draining {
                            since,
                            told,
                            cut: Cut::Killed,
                        };
                        out.push(Action::Kill(l, Why::CutIgnored));
                    }
                }
            }
            return out;
        }
        let limits = self.limits;
        for (l, lane) in self.lanes.iter_mut().enumerate() {
            match lane.phase {
                Phase::Starting
                    if !lane.timed_out
                        && now.saturating_duration_since(lane.started) > limits.ready_timeout =>
                {
                    lane.timed_out = true;
                    out.push(Action::Kill(l, Why::NotReady));
                }
                Phase::Down {
                    restart_at,
                    reset_done: true,
                } if now >= restart_at => {
                    out.push(Action::Start(l));
                }
                Phase::Draining {
                    since,
                    told: false,
                    cut,
                } if now >= since + DRAIN_DELAY => {
                    lane.phase = Phase::Draining {
                        since,
                        told: true,
                        cut,
                    };
                    out.push(Action::Drain(l));
                }
                Phase::Draining {
                    since,
                    told,
                    cut: Cut::No,
                } if limits.grace.is_some_and(|g| now >= since + g) => {
                    lane.phase = Phase::Draining {
                        since,
                        told,
                        cut: Cut::Told(now),
                    };
                    out.push(Action::Cut(l, Why::GraceOver));
                }
                Phase::Draining {
                    since,
                    told,
                    cut: Cut::Told(at),
                } if now >= at + CUT_WAIT => {
                    lane.phase = Phase::Draining {
                        since,
                        told,
                        cut: Cut::Killed,
                    };
                    out.push(Action::Kill(l, Why::CutIgnored));
                }
                _ => {}
            }
        }
        out
    }

    /// A reload: start the next generation in its slot, or wait for the slot, or refuse.
    fn reload(&mut self, now: Instant, out: &mut Vec<Action>) {
        if self.shutdown_since.is_some() {
            out.push(Action::ReloadRefused(Refusal::ShuttingDown));
            return;
        }
        if let Some((generation, _)) = self.candidate {
            out.push(Action::ReloadRefused(Refusal::Starting { generation }));
            return;
        }
        // The next generation number whose connection-ID slot no draining generation holds
        // (numbers may be skipped: only their order matters). With every other slot held (three
        // generations drain), the next one's: its holder, the oldest, is cut.
        let free = |g: u64| {
            self.lanes_of(g)
                .all(|l| matches!(self.lanes[l].phase, Phase::Idle))
        };
        let generation = (self.active + 1..=self.active + 3)
            .find(|&g| free(g))
            .unwrap_or(self.active + 1);
        self.candidate = Some((generation, true));
        self.start_candidate(now, out);
    }

    /// Starts the waiting candidate once no older generation holds its slot.
    fn start_candidate(&mut self, now: Instant, out: &mut Vec<Action>) {
        let Some((generation, true)) = self.candidate else {
            return;
        };
        let lanes = self.lanes_of(generation);
        if let Some(busy) = self.lanes[lanes.clone()]
            .iter()
            .find(|l| !matches!(l.phase, Phase::Idle))
        {
            // Only a draining generation can hold the slot (the oldest of three): it goes
            // now, and the reload waits for its workers to write their logs and exit.
            let draining = busy.generation;
            self.cut_generation(now, draining, Why::TooManyDraining, out);
            out.push(Action::ReloadWaits {
                generation,
                draining,
            });
            return;
        }
        self.candidate = Some((generation, false));
        for l in lanes {
            let lane = &mut self.lanes[l];
            *lane = Lane {
                phase: Phase::Down {
                    restart_at: now,
                    reset_done: false,
                },
                generation,
                started: now,
                backoff: self.limits.backoff_min,
                crashes: 0,
                timed_out: false,
            };
            out.push(Action::RequestReset(l));
        }
    }

    /// Makes the candidate the active generation once each of its workers is READY, and has
    /// the one before drain.
    fn activate_if_ready(&mut self, now: Instant, out: &mut Vec<Action>) {
        let Some((generation, false)) = self.candidate else {
            return;
        };
        if !self.lanes_of(generation).all(|l| self.is_ready(l)) {
            return;
        }
        self.candidate = None;
        let old = self.active;
        self.active = generation;
        out.push(Action::Activate { generation });
        for l in self.lanes_of(old) {
            let lane = &mut self.lanes[l];
            match lane.phase {
                Phase::Starting | Phase::Ready => {
                    lane.phase = Phase::Draining {
                        since: now,
                        told: false,
                        cut: Cut::No,
                    };
                }
                // Dead and waiting for its replacement: nobody replaces it now. Its
                // ingress closes now, or when a reset still under way comes back.
                Phase::Down { reset_done, .. } => {
                    lane.phase = Phase::Idle;
                    if reset_done {
                        out.push(Action::Close(l));
                    }
                }
                _ => {}
            }
        }
        out.push(Action::Reloaded {
            generation,
            replaced: old,
        });
        // At most `max_draining` generations drain beside the serving one: the oldest go.
        let mut draining = self.draining_generations();
        while draining.len() > self.limits.max_draining {
            let oldest = draining.remove(0);
            self.cut_generation(now, oldest, Why::TooManyDraining, out);
        }
    }

    /// The generations with a worker draining and not told to cut, oldest first.
    fn draining_generations(&self) -> Vec<u64> {
        let mut g: Vec<u64> = self
            .lanes
            .iter()
            .filter(|l| matches!(l.phase, Phase::Draining { cut: Cut::No, .. }))
            .map(|l| l.generation)
            .collect();
        g.sort_unstable();
        g.dedup();
        g
    }

    /// Cuts every worker of `generation` still draining and not told yet: asked to drain first
    /// if it was not (its clients get their GOAWAY), then told to cut.
    fn cut_generation(&mut self, now: Instant, generation: u64, why: Why, out: &mut Vec<Action>) {
        for l in self.lanes_of(generation) {
            let lane = &mut self.lanes[l];
            if lane.generation != generation {
                continue;
            }
            if let Phase::Draining {
                since,
                told,
                cut: Cut::No,
            } = lane.phase
            {
                if !told {
                    out.push(Action::Drain(l));
                }
                lane.phase = Phase::Draining {
                    since,
                    told: true,
                    cut: Cut::Told(now),
                };
                out.push(Action::Cut(l, why));
            }
        }
    }

    /// Abandons the candidate: its live workers are killed, its lanes freed as they die.
    fn abandon(&mut self, instance: usize, why: Failure, out: &mut Vec<Action>) {
        let Some((generation, false)) = self.candidate.take() else {
            return;
        };
        for l in self.lanes_of(generation) {
            let lane = &mut self.lanes[l];
            match lane.phase {
                Phase::Starting | Phase::Ready => {
                    lane.phase = Phase::Abandoned;
                    out.push(Action::Kill(l, Why::Abandoned));
                }
                Phase::Down { reset_done, .. } => {
                    lane.phase = Phase::Idle;
                    if reset_done {
                        out.push(Action::Close(l));
                    }
                }
                _ => {}
            }
        }
        out.push(Action::ReloadFailed {
            generation,
            instance,
            why,
        });
    }

    fn died(&mut self, now: Instant, l: usize, how: Failure, out: &mut Vec<Action>) {
        let limits = self.limits;
        let candidate = self.candidate.map(|(g, _)| g);
        let lane = &mut self.lanes[l];
        if self.shutdown_since.is_some() {
            lane.phase = Phase::Gone;
            self.finish_if_all_gone(out);
            return;
        }
        match lane.phase {
            Phase::Draining { .. } | Phase::Abandoned | Phase::Idle | Phase::Gone => {
                // Its generation is over: free the lane (a reload may wait for it).
                lane.phase = Phase::Idle;
                out.push(Action::Close(l));
                self.start_candidate(now, out);
                return;
            }
            _ => {}
        }
        if candidate == Some(lane.generation) && lane.generation != self.active {
            let why = match (how, lane.timed_out) {
                (Failure::StartFailed, _) => Failure::StartFailed,
                (_, true) => Failure::NotReady,
                _ => Failure::Exited,
            };
            lane.phase = Phase::Idle;
            out.push(Action::Close(l));
            self.abandon(usize::from(self.numbering.at(l).instance), why, out);
            self.start_candidate(now, out);
            return;
        }
        let was_ready = lane.phase == Phase::Ready;
        let uptime = now.saturating_duration_since(lane.started);
        // Only a worker that served for a while was healthy: one that never became ready, or
        // could not even be started, is part of a crash loop however long it took.
        if was_ready && uptime >= limits.healthy_uptime {
            lane.backoff = limits.backoff_min;
            lane.crashes = 0;
        } else {
            lane.crashes += 1;
        }
        // The first death after a healthy run restarts at once; a crash loop backs off.
        let restart_in = if lane.crashes == 0 {
            Duration::ZERO
        } else {
            lane.backoff
        };
        if lane.crashes > 0 {
            lane.backoff = (lane.backoff * 2).min(limits.backoff_max);
        }
        lane.phase = Phase::Down {
            restart_at: now + restart_in,
            reset_done: false,
        };
        out.push(Action::Died(Death {
            instance: usize::from(self.numbering.at(l).instance),
            uptime,
            was_ready,
            crashes: lane.crashes,
            restart_in,
        }));
        out.push(Action::RequestReset(l));
    }

    fn finish_if_all_gone(&self, out: &mut Vec<Action>) {
        if self
            .lanes
            .iter()
            .all(|l| matches!(l.phase, Phase::Gone | Phase::Idle))
        {
            out.push(Action::Finish);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    /// A grace period of 10 s, and the most draining generations.
    fn limits() -> Limits {
        Limits::new(Duration::from_secs(30), Some(Duration::from_secs(10)), 3)
    }

    /// A policy with every instance started and READY at `t0`.
    fn running(n: usize) -> (Policy, Instant) {
        let t0 = Instant::now();
        let mut p = Policy::new(limits(), Lanes::new(n as u8), t0);
        for i in 0..n {
            assert!(p.on(t0, Event::Ready(i)).is_empty());
        }
        (p, t0)
    }

    fn died(actions: &[Action]) -> Death {
        match actions {
            [Action::Died(d), Action::RequestReset(_)] => *d,
            other => panic!("expected a death and a reset request, got {other:?}"),
        }
    }

    #[test]
    fn a_worker_that_never_reports_ready_is_killed_once() {
        let t0 = Instant::now();
        let mut p = Policy::new(limits(), Lanes::new(2), t0);
        p.on(t0, Event::Ready(0));
        assert!(p.tick(t0 + Duration::from_secs(30)).is_empty());
        let late = t0 + Duration::from_secs(30) + MS;
        assert_eq!(p.tick(late), [Action::Kill(1, Why::NotReady)]);
        assert!(p.tick(late + MS).is_empty(), "killed again");
        let d = died(&p.on(late + 2 * MS, Event::Exited(1)));
        assert!(!d.was_ready);
        assert_eq!(d.crashes, 1);
    }

    #[test]
    fn a_healthy_worker_is_restarted_at_once_after_its_reset() {
        let (mut p, t0) = running(2);
        let t = t0 + Duration::from_secs(60);
        let d = died(&p.on(t, Event::Exited(1)));
        assert_eq!(
            (d.crashes, d.restart_in, d.was_ready),
            (0, Duration::ZERO, true)
        );
        // Not before its ingress is reset, whatever the time.
        assert!(p.tick(t + Duration::from_secs(1)).is_empty());
        p.on(t + Duration::from_secs(1), Event::ResetDone(1));
        assert_eq!(p.tick(t + Duration::from_secs(1)), [Action::Start(1)]);
        p.on(t + Duration::from_secs(1), Event::Started(1));
        assert!(p.tick(t + Duration::from_secs(2)).is_empty());
        assert!(!p.is_ready(1));
        p.on(t + Duration::from_secs(2), Event::Ready(1));
        assert!(p.is_ready(1) && p.is_ready(0));
    }

    #[test]
    fn a_crash_loop_backs_off_doubling_to_the_maximum_and_health_resets_it() {
        let (mut p, t0) = running(1);
        let mut t = t0 + Duration::from_secs(60);
        // First death after a healthy run: at once. Then quick deaths back off.
        let mut delays = Vec::new();
        for _ in 0..9 {
            let d = died(&p.on(t, Event::Exited(0)));
            delays.push(d.restart_in);
            p.on(t, Event::ResetDone(0));
            if !d.restart_in.is_zero() {
                assert!(p.tick(t + d.restart_in - MS).is_empty(), "started early");
            }
            t += d.restart_in;
            assert_eq!(p.tick(t), [Action::Start(0)]);
            p.on(t, Event::Started(0));
            t += MS;
        }
        let ms = |v: u64| Duration::from_millis(v);
        assert_eq!(
            delays,
            [
                ms(0),
                ms(100),
                ms(200),
                ms(400),
                ms(800),
                ms(1600),
                ms(3200),
                ms(5000),
                ms(5000)
            ]
        );
        // A run longer than healthy_uptime forgets the loop.
        p.on(t, Event::Ready(0));
        let d = died(&p.on(t + Duration::from_secs(11), Event::Exited(0)));
        assert_eq!((d.crashes, d.restart_in), (0, Duration::ZERO));
    }

    #[test]
    fn a_failed_start_is_retried_with_back_off() {
        let (mut p, t0) = running(1);
        let t = t0 + Duration::from_secs(60);
        died(&p.on(t, Event::Exited(0)));
        p.on(t, Event::ResetDone(0));
        assert_eq!(p.tick(t), [Action::Start(0)]);
        let d = died(&p.on(t, Event::StartFailed(0)));
        assert_eq!(d.restart_in, Duration::from_millis(100));
    }

    #[test]
    fn a_misbehaving_worker_is_killed_and_then_replaced() {
        let (mut p, t0) = running(2);
        assert_eq!(
            p.on(t0, Event::Misbehaved(1)),
            [Action::Kill(1, Why::Misbehaved)]
        );
        died(&p.on(t0 + MS, Event::Exited(1)));
        // Reports about a worker that is already dead kill nothing.
        assert!(p.on(t0 + MS, Event::Misbehaved(1)).is_empty());
    }

    #[test]
    fn shutdown_drains_every_worker_and_finishes_when_all_are_gone() {
        let (mut p, t0) = running(3);
        let t = t0 + Duration::from_secs(60);
        died(&p.on(t, Event::Exited(2))); // down, waiting for its restart
        let a = p.on(t, Event::ShutdownSignal);
        assert_eq!(a, [Action::Drain(0), Action::Drain(1)]);
        assert!(p.shutting_down() && p.draining(0));
        // No restart during a shutdown, even once the reset is done.
        p.on(t, Event::ResetDone(2));
        assert!(p.tick(t + Duration::from_secs(1)).is_empty());
        assert!(p
            .on(t + Duration::from_secs(2), Event::Exited(0))
            .is_empty());
        assert_eq!(
            p.on(t + Duration::from_secs(3), Event::Exited(1)),
            [Action::Finish]
        );
    }

    #[test]
    fn the_gauges_show_each_lane_and_how_long_it_drains() {
        use crate::metrics::LaneState;
        let (mut p, t0) = running(2);
        let g = p.lane(0).0;
        let gauges = |p: &Policy, t: Instant| p.gauges(t).collect::<Vec<_>>();
        let t = t0 + Duration::from_secs(60);
        let all = gauges(&p, t);
        // Every lane, those of the other generation slots idle.
        assert_eq!(all.len(), Lanes::new(2).count());
        let serving = (g, LaneState::Serving, None);
        assert_eq!(all[..2], [serving, serving]);
        assert!(all[2..]
            .iter()
            .all(|&(_, s, d)| s == LaneState::Idle && d.is_none()));
        p.on(t, Event::ShutdownSignal);
        let later = t + Duration::from_secs(7);
        let draining = (g, LaneState::Draining, Some(Duration::from_secs(7)));
        assert_eq!(gauges(&p, later)[..2], [draining, draining]);
        p.on(later, Event::Exited(1));
        let (_, state, since) = gauges(&p, later)[1];
        assert_eq!((state, since), (LaneState::Idle, None));
    }

    #[test]
    fn the_grace_period_and_a_second_signal_cut_the_drain_short() {
        let (mut p, t0) = running(2);
        p.on(t0, Event::ShutdownSignal);
        assert!(p.tick(t0 + Duration::from_secs(10) - MS).is_empty());
        assert_eq!(
            p.tick(t0 + Duration::from_secs(10)),
            [Action::CutAllAndFinish]
        );

        let (mut p, t0) = running(2);
        p.on(t0, Event::ShutdownSignal);
        assert_eq!(
            p.on(t0 + MS, Event::ShutdownSignal),
            [Action::CutAllAndFinish]
        );
    }

    #[test]
    fn a_worker_started_as_the_shutdown_came_is_drained_too() {
        let (mut p, t0) = running(1);
        died(&p.on(t0, Event::Exited(0)));
        // The shutdown finds nobody to drain: done at once.
        assert_eq!(p.on(t0, Event::ShutdownSignal), [Action::Finish]);
        let (mut p, t0) = running(2);
        died(&p.on(t0, Event::Exited(1)));
        p.on(t0, Event::ShutdownSignal);
        assert_eq!(p.on(t0, Event::Started(1)), [Action::Drain(1)]);
    }

    /// Reloads `p` (2 instances, generation `g - 1` active) up to the point where generation
    /// `g`'s workers run: returns its lanes.
    fn start_generation(p: &mut Policy, t: Instant, g: u64) -> [usize; 2] {
        let lanes = p.lanes_of(g);
        let [a, b] = [lanes.start, lanes.start + 1];
        assert_eq!(
            p.on(t, Event::Reload),
            [Action::RequestReset(a), Action::RequestReset(b)]
        );
        assert_eq!(p.lane(a).0, g);
        p.on(t, Event::ResetDone(a));
        p.on(t, Event::ResetDone(b));
        // (The tick may also ask an older generation to drain.)
        let starts: Vec<Action> = p
            .tick(t)
            .into_iter()
            .filter(|a| matches!(a, Action::Start(_)))
            .collect();
        assert_eq!(starts, [Action::Start(a), Action::Start(b)]);
        p.on(t, Event::Started(a));
        p.on(t, Event::Started(b));
        [a, b]
    }

    #[test]
    fn a_reload_switches_once_every_new_worker_is_ready_then_drains_the_old_one() {
        let (mut p, t0) = running(2);
        let t = t0 + Duration::from_secs(60);
        let [a, b] = start_generation(&mut p, t, 2);
        assert_eq!([a, b], [2, 3], "generation 2 is slot 1");
        assert!(p.on(t, Event::Ready(a)).is_empty(), "not before both");
        assert_eq!(p.active(), 1);
        assert_eq!(
            p.on(t, Event::Ready(b)),
            [
                Action::Activate { generation: 2 },
                Action::Reloaded {
                    generation: 2,
                    replaced: 1
                }
            ]
        );
        assert_eq!(p.active(), 2);
        assert!(p.draining(0) && p.draining(1));
        // The old workers are asked to drain a moment after the switch, then get --grace.
        assert!(p.tick(t + DRAIN_DELAY - MS).is_empty());
        assert_eq!(
            p.tick(t + DRAIN_DELAY),
            [Action::Drain(0), Action::Drain(1)]
        );
        assert_eq!(p.on(t + DRAIN_DELAY, Event::Exited(0)), [Action::Close(0)]);
        // At the end of the grace period the one left is told to cut, then killed if it
        // does not exit.
        let grace = Duration::from_secs(10);
        assert!(p.tick(t + grace - MS).is_empty());
        assert_eq!(p.tick(t + grace), [Action::Cut(1, Why::GraceOver)]);
        assert!(p.tick(t + grace + MS).is_empty(), "cut once");
        assert!(p.tick(t + grace + CUT_WAIT - MS).is_empty());
        assert_eq!(
            p.tick(t + grace + CUT_WAIT),
            [Action::Kill(1, Why::CutIgnored)]
        );
        assert!(p.tick(t + grace + CUT_WAIT + MS).is_empty(), "killed once");
        assert_eq!(p.on(t + grace, Event::Exited(1)), [Action::Close(1)]);
        // The new generation is supervised like the first: a death is replaced.
        died(&p.on(t + grace, Event::Exited(a)));
    }

    #[test]
    fn a_new_generation_that_fails_is_abandoned_and_the_old_one_serves_on() {
        // A worker that exits before READY.
        let (mut p, t0) = running(2);
        let [a, b] = start_generation(&mut p, t0, 2);
        p.on(t0, Event::Ready(a));
        assert_eq!(
            p.on(t0, Event::Exited(b)),
            [
                Action::Close(b),
                Action::Kill(a, Why::Abandoned),
                Action::ReloadFailed {
                    generation: 2,
                    instance: 1,
                    why: Failure::Exited
                }
            ]
        );
        assert_eq!(p.active(), 1);
        assert!(
            p.is_ready(0) && p.is_ready(1),
            "the old generation serves on"
        );
        assert_eq!(p.on(t0, Event::Exited(a)), [Action::Close(a)]);
        // The next reload tries generation 2 again, in the freed slot.
        start_generation(&mut p, t0, 2);

        // A worker that never reports READY.
        let (mut p, t0) = running(2);
        let [a, b] = start_generation(&mut p, t0, 2);
        p.on(t0, Event::Ready(b));
        let late = t0 + Duration::from_secs(31);
        assert_eq!(p.tick(late), [Action::Kill(a, Why::NotReady)]);
        let out = p.on(late, Event::Exited(a));
        assert!(
            out.contains(&Action::ReloadFailed {
                generation: 2,
                instance: 0,
                why: Failure::NotReady
            }),
            "{out:?}"
        );

        // A program that cannot be started.
        let (mut p, t0) = running(2);
        let lanes = p.lanes_of(2);
        p.on(t0, Event::Reload);
        p.on(t0, Event::ResetDone(lanes.start));
        let out = p.on(t0, Event::StartFailed(lanes.start));
        assert!(
            matches!(
                out.last(),
                Some(Action::ReloadFailed {
                    why: Failure::StartFailed,
                    ..
                })
            ),
            "{out:?}"
        );
        // The other lane's reset comes back later: nobody uses it, it is closed.
        assert_eq!(
            p.on(t0, Event::ResetDone(lanes.start + 1)),
            [Action::Close(lanes.start + 1)]
        );
    }

    #[test]
    fn reloads_in_a_row_keep_three_generations_draining_and_the_fifth_cuts_the_oldest() {
        let (mut p, t0) = running(2);
        let mut t = t0;
        for g in 2..=4 {
            let [a, b] = start_generation(&mut p, t, g);
            p.on(t, Event::Ready(a));
            p.on(t, Event::Ready(b));
            assert_eq!(p.active(), g);
            t += Duration::from_secs(1);
        }
        // Generations 1, 2 and 3 still drain (none has exited yet): 5 needs slot 0, held by
        // 1, which is cut at once; the reload waits for its workers to exit.
        assert_eq!(
            p.on(t, Event::Reload),
            [
                Action::Cut(0, Why::TooManyDraining),
                Action::Cut(1, Why::TooManyDraining),
                Action::ReloadWaits {
                    generation: 5,
                    draining: 1
                }
            ]
        );
        // Killed if they do not exit in time (generation 3, replaced at `t - 1 s`, is asked
        // to drain by then too).
        assert_eq!(
            p.tick(t + CUT_WAIT),
            [
                Action::Kill(0, Why::CutIgnored),
                Action::Kill(1, Why::CutIgnored),
                Action::Drain(4),
                Action::Drain(5)
            ]
        );
        assert_eq!(
            p.on(t, Event::Reload),
            [Action::ReloadRefused(Refusal::Starting { generation: 5 })]
        );
        assert_eq!(
            p.on(t, Event::Exited(0)),
            [
                Action::Close(0),
                Action::ReloadWaits {
                    generation: 5,
                    draining: 1
                }
            ]
        );
        assert_eq!(
            p.on(t, Event::Exited(1)),
            [
                Action::Close(1),
                Action::RequestReset(0),
                Action::RequestReset(1)
            ]
        );
        assert_eq!(p.lane(0).0, 5);
    }

    #[test]
    fn a_shutdown_during_a_reload_drains_every_generation() {
        let (mut p, t0) = running(2);
        let [a, _b] = start_generation(&mut p, t0, 2);
        p.on(t0, Event::Ready(a));
        let out = p.on(t0, Event::ShutdownSignal);
        assert_eq!(
            out[0],
            Action::ReloadFailed {
                generation: 2,
                instance: 0,
                why: Failure::Shutdown
            }
        );
        assert_eq!(
            out[1..],
            [
                Action::Drain(0),
                Action::Drain(1),
                Action::Drain(2),
                Action::Drain(3)
            ]
        );
        assert_eq!(
            p.on(t0, Event::Reload),
            [Action::ReloadRefused(Refusal::ShuttingDown)]
        );
        for l in 0..3 {
            assert!(p.on(t0, Event::Exited(l)).is_empty());
        }
        assert_eq!(p.on(t0, Event::Exited(3)), [Action::Finish]);
    }

    /// Reloads `p` (2 instances) to generation `g`, every new worker READY at `t`: the
    /// actions of the activation.
    fn reload_to(p: &mut Policy, t: Instant, g: u64) -> Vec<Action> {
        let [a, b] = start_generation(p, t, g);
        p.on(t, Event::Ready(a));
        p.on(t, Event::Ready(b))
    }

    fn no_grace(max_draining: usize) -> Limits {
        Limits::new(Duration::from_secs(30), None, max_draining)
    }

    #[test]
    fn with_no_grace_a_drain_is_never_cut() {
        let t0 = Instant::now();
        let mut p = Policy::new(no_grace(3), Lanes::new(2), t0);
        p.on(t0, Event::Ready(0));
        p.on(t0, Event::Ready(1));
        reload_to(&mut p, t0, 2);
        assert_eq!(
            p.tick(t0 + DRAIN_DELAY),
            [Action::Drain(0), Action::Drain(1)]
        );
        let year = Duration::from_secs(365 * 86_400);
        assert!(p.tick(t0 + year).is_empty(), "no clock on the drain");
        assert_eq!(p.draining_since(0), Some(t0));
        assert_eq!(p.draining_since(2), None, "generation 2 serves");
        // A shutdown with no grace waits as long: only a second signal cuts it.
        p.on(t0 + year, Event::ShutdownSignal);
        assert!(p.tick(t0 + 2 * year).is_empty());
        assert_eq!(
            p.on(t0 + 2 * year, Event::ShutdownSignal),
            [Action::CutAllAndFinish]
        );
    }

    #[test]
    fn a_grace_set_by_a_reload_applies_to_the_drains_under_way() {
        let t0 = Instant::now();
        let mut p = Policy::new(no_grace(3), Lanes::new(2), t0);
        p.on(t0, Event::Ready(0));
        p.on(t0, Event::Ready(1));
        reload_to(&mut p, t0, 2);
        p.tick(t0 + DRAIN_DELAY);
        let t = t0 + Duration::from_secs(60);
        assert!(p.tick(t).is_empty());
        // grace = 90 s, counted from the start of the drain: due at t0 + 90 s.
        let grace = |s| Limits::new(Duration::from_secs(30), Some(Duration::from_secs(s)), 3);
        p.set_limits(grace(90));
        assert!(p.tick(t0 + Duration::from_secs(90) - MS).is_empty());
        assert_eq!(
            p.tick(t0 + Duration::from_secs(90)),
            [
                Action::Cut(0, Why::GraceOver),
                Action::Cut(1, Why::GraceOver)
            ]
        );
        // A grace shorter than the drain so far cuts at the next tick; one removed, never.
        let (mut p, t0) = running(2);
        reload_to(&mut p, t0, 2);
        p.set_limits(no_grace(3));
        assert_eq!(
            p.tick(t0 + Duration::from_secs(3600)),
            [Action::Drain(0), Action::Drain(1)]
        );
        p.set_limits(grace(5));
        assert_eq!(
            p.tick(t0 + Duration::from_secs(3600) + MS),
            [
                Action::Cut(0, Why::GraceOver),
                Action::Cut(1, Why::GraceOver)
            ]
        );
        // The same for a shutdown's drain.
        let t0 = Instant::now();
        let mut p = Policy::new(no_grace(3), Lanes::new(1), t0);
        p.on(t0, Event::Ready(0));
        p.on(t0, Event::ShutdownSignal);
        assert!(p.tick(t0 + Duration::from_secs(3600)).is_empty());
        p.set_limits(grace(5));
        assert_eq!(
            p.tick(t0 + Duration::from_secs(3600)),
            [Action::CutAllAndFinish]
        );
    }

    #[test]
    fn a_reload_past_max_draining_cuts_the_oldest_draining_generation() {
        let t0 = Instant::now();
        let mut p = Policy::new(no_grace(1), Lanes::new(2), t0);
        p.on(t0, Event::Ready(0));
        p.on(t0, Event::Ready(1));
        // Generation 1 drains beside 2: within the bound.
        let out = reload_to(&mut p, t0, 2);
        assert!(!out.iter().any(|a| matches!(a, Action::Cut(..))), "{out:?}");
        let t = t0 + Duration::from_secs(1);
        p.tick(t);
        // Generation 3: 1 and 2 would drain; 1, the oldest, is cut (told to drain already).
        let out = reload_to(&mut p, t, 3);
        assert_eq!(
            out,
            [
                Action::Activate { generation: 3 },
                Action::Reloaded {
                    generation: 3,
                    replaced: 2
                },
                Action::Cut(0, Why::TooManyDraining),
                Action::Cut(1, Why::TooManyDraining)
            ]
        );
        // Generation 4 at once, before 2 was even told to drain: told, then cut.
        let out = reload_to(&mut p, t, 4);
        assert_eq!(
            out[2..],
            [
                Action::Drain(2),
                Action::Cut(2, Why::TooManyDraining),
                Action::Drain(3),
                Action::Cut(3, Why::TooManyDraining)
            ]
        );
        assert_eq!(p.lane(4).0, 3, "generation 3 drains on");
        assert!(p.draining(4) && p.draining(5));
        // The cut workers exit: their lanes are free; 3 drains on without a clock.
        for l in 0..4 {
            assert_eq!(p.on(t, Event::Exited(l)), [Action::Close(l)]);
        }
        let later = t + Duration::from_secs(3600);
        assert_eq!(p.tick(later), [Action::Drain(4), Action::Drain(5)]);
        assert!(p.tick(later + Duration::from_secs(3600)).is_empty());
        // A cut generation is not handed over by an upgrade before it is gone.
        let (mut p, t0) = running(2);
        p.set_limits(no_grace(1));
        reload_to(&mut p, t0, 2);
        reload_to(&mut p, t0, 3);
        assert_eq!(
            p.export(t0),
            Err(Unsettled::LaneBusy {
                instance: 0,
                generation: 1
            })
        );
    }

    #[test]
    fn drains_survive_an_upgrade_with_their_age() {
        let (mut p, t0) = running(2);
        p.set_limits(no_grace(3));
        reload_to(&mut p, t0, 2);
        p.tick(t0 + DRAIN_DELAY);
        let t = t0 + Duration::from_secs(42);
        let lanes = p.export(t).unwrap();
        let t1 = t + Duration::from_secs(1);
        let mut q = Policy::adopt(limits(), Lanes::new(2), t1, 2, &lanes);
        assert_eq!(
            q.draining_since(0),
            Some(t1 - Duration::from_secs(42)),
            "its age carried over"
        );
        // The new image's grace (10 s) is long over: cut at its first tick.
        assert_eq!(
            q.tick(t1),
            [
                Action::Cut(0, Why::GraceOver),
                Action::Cut(1, Why::GraceOver)
            ]
        );
    }

    #[test]
    fn a_reload_takes_a_free_slot_rather_than_cut_a_generation_within_the_bound() {
        let (mut p, t0) = running(2);
        p.set_limits(no_grace(3));
        for g in 2..=4 {
            reload_to(&mut p, t0, g);
        }
        // Generations 2 and 3 are done; 1 drains on in slot 0, which 5 would need.
        for l in 2..6 {
            p.on(t0, Event::Exited(l));
        }
        let lanes = p.lanes_of(6);
        assert_eq!(
            p.on(t0, Event::Reload),
            [
                Action::RequestReset(lanes.start),
                Action::RequestReset(lanes.start + 1)
            ],
            "generation 6, in slot 1, without waiting or cutting"
        );
        assert_eq!(p.lane(lanes.start).0, 6);
        assert!(p.draining(0) && p.draining(1), "generation 1 drains on");
    }
}
