//! The supervisor's decisions, apart from their effects (as `quinn-proto` is apart from
//! sockets): when a starting worker has waited too long for READY, how long a dead one waits
//! before its replacement (back-off, crash loops), when a replacement may start (its new ring
//! generation exists), and how a shutdown drains. It never forks, polls, signals or reads a
//! clock: the caller feeds [`Event`]s with the time, and carries out the [`Action`]s returned.
//! `supervisor.rs` is that caller; the tests below drive it on a fake clock.

use std::time::{Duration, Instant};

/// The supervisor's timings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// How long a starting worker may take to report READY.
    pub ready_timeout: Duration,
    /// How long workers may drain after a shutdown signal.
    pub grace: Duration,
    /// First restart delay of a crash loop; doubled each crash up to `backoff_max`.
    pub backoff_min: Duration,
    pub backoff_max: Duration,
    /// A worker that was ready and ran this long before dying is not in a crash loop: restart
    /// at once.
    pub healthy_uptime: Duration,
}

impl Limits {
    /// ringmux's timings around the operator's READY timeout and grace period.
    pub fn new(ready_timeout: Duration, grace: Duration) -> Self {
        Limits {
            ready_timeout,
            grace,
            backoff_min: Duration::from_millis(100),
            backoff_max: Duration::from_secs(5),
            healthy_uptime: Duration::from_secs(10),
        }
    }
}

/// What happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    /// A worker process was started for the instance.
    Started(usize),
    /// It reported READY.
    Ready(usize),
    /// Its process is gone (it exited, was killed, or its control socket closed).
    Exited(usize),
    /// Starting a replacement failed (no process exists).
    StartFailed(usize),
    /// The data plane reports it broke the ring protocol or stopped draining.
    Misbehaved(usize),
    /// The instance's new ingress generation is ready for a replacement.
    ResetDone(usize),
    /// SIGTERM or SIGINT.
    ShutdownSignal,
}

/// What to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Kill the instance's process (its death comes back as [`Event::Exited`]).
    Kill(usize, Why),
    /// Ask the data plane for a new ingress generation for the instance.
    RequestReset(usize),
    /// Start a replacement now.
    Start(usize),
    /// Ask the instance to drain (control message SHUTDOWN).
    Drain(usize),
    /// The instance died outside a shutdown: log it.
    Died(Death),
    /// Shutdown complete: every worker is gone.
    Finish,
    /// Shutdown cut short (grace over, or a second signal): kill every remaining worker and
    /// finish.
    KillAllAndFinish,
}

/// Why a worker is killed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Why {
    /// It did not report READY within the timeout.
    NotReady,
    /// The data plane reported it (ring protocol violation, or a stalled ring).
    Misbehaved,
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
    /// Started at the instance's `started`, not READY yet.
    Starting,
    Ready,
    /// Dead; a replacement starts at `restart_at` once the ingress is reset.
    Down {
        restart_at: Instant,
        reset_done: bool,
    },
    /// Asked to drain; not replaced when it exits.
    Draining,
    /// Exited during the shutdown.
    Gone,
}

#[derive(Debug, Clone, Copy)]
struct Instance {
    phase: Phase,
    started: Instant,
    backoff: Duration,
    crashes: u32,
    /// Killed for missing the READY deadline (kill once, then wait for the death).
    timed_out: bool,
}

/// The decisions for every instance.
#[derive(Debug)]
pub struct Policy {
    limits: Limits,
    instances: Vec<Instance>,
    /// Set by the first shutdown signal: when the grace period ends.
    shutdown_deadline: Option<Instant>,
}

impl Policy {
    /// `n` instances, each being started at `now`.
    pub fn new(limits: Limits, n: usize, now: Instant) -> Self {
        let fresh = Instance {
            phase: Phase::Starting,
            started: now,
            backoff: limits.backoff_min,
            crashes: 0,
            timed_out: false,
        };
        Policy {
            limits,
            instances: vec![fresh; n],
            shutdown_deadline: None,
        }
    }

    /// Whether instance `i` has reported READY (and not died since).
    pub fn is_ready(&self, i: usize) -> bool {
        self.instances[i].phase == Phase::Ready
    }

    /// Whether a shutdown is under way.
    pub fn shutting_down(&self) -> bool {
        self.shutdown_deadline.is_some()
    }

    /// Whether instance `i` was asked to drain (its exit is expected, not a crash).
    pub fn draining(&self, i: usize) -> bool {
        matches!(self.instances[i].phase, Phase::Draining | Phase::Gone)
    }

    /// Decides what `event` calls for.
    pub fn on(&mut self, now: Instant, event: Event) -> Vec<Action> {
        let mut out = Vec::new();
        match event {
            Event::Started(i) => {
                let inst = &mut self.instances[i];
                inst.phase = Phase::Starting;
                inst.started = now;
                inst.timed_out = false;
                if self.shutdown_deadline.is_some() {
                    // Started just as the shutdown came: drain it too.
                    inst.phase = Phase::Draining;
                    out.push(Action::Drain(i));
                }
            }
            Event::Ready(i) => {
                if self.instances[i].phase == Phase::Starting {
                    self.instances[i].phase = Phase::Ready;
                }
            }
            Event::Exited(i) | Event::StartFailed(i) => self.died(now, i, &mut out),
            Event::Misbehaved(i) => {
                if matches!(
                    self.instances[i].phase,
                    Phase::Starting | Phase::Ready | Phase::Draining
                ) {
                    out.push(Action::Kill(i, Why::Misbehaved));
                }
            }
            Event::ResetDone(i) => {
                if let Phase::Down { restart_at, .. } = self.instances[i].phase {
                    self.instances[i].phase = Phase::Down {
                        restart_at,
                        reset_done: true,
                    };
                }
            }
            Event::ShutdownSignal => {
                if self.shutdown_deadline.is_some() {
                    out.push(Action::KillAllAndFinish);
                    return out;
                }
                self.shutdown_deadline = Some(now + self.limits.grace);
                for (i, inst) in self.instances.iter_mut().enumerate() {
                    inst.phase = match inst.phase {
                        Phase::Starting | Phase::Ready => {
                            out.push(Action::Drain(i));
                            Phase::Draining
                        }
                        // Nobody to drain and no replacement to start.
                        Phase::Down { .. } | Phase::Gone => Phase::Gone,
                        Phase::Draining => Phase::Draining,
                    };
                }
                self.finish_if_all_gone(&mut out);
            }
        }
        out
    }

    /// Decides what the passing of time calls for: READY deadlines, restarts that are due, the
    /// end of the grace period.
    pub fn tick(&mut self, now: Instant) -> Vec<Action> {
        let mut out = Vec::new();
        if let Some(deadline) = self.shutdown_deadline {
            if now >= deadline && self.instances.iter().any(|i| i.phase != Phase::Gone) {
                out.push(Action::KillAllAndFinish);
            }
            return out;
        }
        for (i, inst) in self.instances.iter_mut().enumerate() {
            match inst.phase {
                Phase::Starting
                    if !inst.timed_out
                        && now.saturating_duration_since(inst.started)
                            > self.limits.ready_timeout =>
                {
                    inst.timed_out = true;
                    out.push(Action::Kill(i, Why::NotReady));
                }
                Phase::Down {
                    restart_at,
                    reset_done: true,
                } if now >= restart_at => {
                    out.push(Action::Start(i));
                }
                _ => {}
            }
        }
        out
    }

    fn died(&mut self, now: Instant, i: usize, out: &mut Vec<Action>) {
        let limits = self.limits;
        let inst = &mut self.instances[i];
        if matches!(inst.phase, Phase::Draining | Phase::Gone) || self.shutdown_deadline.is_some() {
            inst.phase = Phase::Gone;
            self.finish_if_all_gone(out);
            return;
        }
        let was_ready = inst.phase == Phase::Ready;
        let uptime = now.saturating_duration_since(inst.started);
        // Only a worker that served for a while was healthy: one that never became ready, or
        // could not even be started, is part of a crash loop however long it took.
        if was_ready && uptime >= limits.healthy_uptime {
            inst.backoff = limits.backoff_min;
            inst.crashes = 0;
        } else {
            inst.crashes += 1;
        }
        // The first death after a healthy run restarts at once; a crash loop backs off.
        let restart_in = if inst.crashes == 0 {
            Duration::ZERO
        } else {
            inst.backoff
        };
        if inst.crashes > 0 {
            inst.backoff = (inst.backoff * 2).min(limits.backoff_max);
        }
        inst.phase = Phase::Down {
            restart_at: now + restart_in,
            reset_done: false,
        };
        out.push(Action::Died(Death {
            instance: i,
            uptime,
            was_ready,
            crashes: inst.crashes,
            restart_in,
        }));
        out.push(Action::RequestReset(i));
    }

    fn finish_if_all_gone(&self, out: &mut Vec<Action>) {
        if self.instances.iter().all(|i| i.phase == Phase::Gone) {
            out.push(Action::Finish);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    fn limits() -> Limits {
        Limits::new(Duration::from_secs(30), Duration::from_secs(10))
    }

    /// A policy with every instance started and READY at `t0`.
    fn running(n: usize) -> (Policy, Instant) {
        let t0 = Instant::now();
        let mut p = Policy::new(limits(), n, t0);
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
        let mut p = Policy::new(limits(), 2, t0);
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
    fn the_grace_period_and_a_second_signal_cut_the_drain_short() {
        let (mut p, t0) = running(2);
        p.on(t0, Event::ShutdownSignal);
        assert!(p.tick(t0 + Duration::from_secs(10) - MS).is_empty());
        assert_eq!(
            p.tick(t0 + Duration::from_secs(10)),
            [Action::KillAllAndFinish]
        );

        let (mut p, t0) = running(2);
        p.on(t0, Event::ShutdownSignal);
        assert_eq!(
            p.on(t0 + MS, Event::ShutdownSignal),
            [Action::KillAllAndFinish]
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
}
