//! How much of the demux's time one worker's messages may take: a [`Budget`] per worker and
//! socket (its control socket, its session socket), decided here without I/O or clocks of its
//! own and tested on a fake clock; the supervisor and the session threads carry it out.
//!
//! A budget holds two token buckets (GCRA, the "virtual scheduling" form of ITU-T I.371's
//! generic cell rate algorithm: one theoretical arrival time per bucket, no floats):
//! - **serve**: messages acted on (a `STATS` report stored, a session PUT or TAKE answered);
//! - **drop**: messages read beyond that and dropped, each counted by the caller.
//!
//! When both are spent the caller reads nothing from that worker until [`Budget::read_after`]
//! (at least [`Limits::pause`] later, so that a flood wakes the caller at most once a pause
//! however fine the buckets' intervals):
//! its messages wait in its socket, whose buffer fills, and the worker's own sends then block or
//! fail. So one worker's messages cost the demux at most `serve + drop` reads a second however
//! fast it sends, and a flood is still visible as counted drops. This module never reads a
//! socket, never sleeps and never counts: it only answers "now?" and "serve or drop?".

use std::time::{Duration, Instant};

/// A sustained rate with a burst: `per_second` on average, up to `burst` at once after a quiet
/// spell. Both at least 1.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rate {
    pub per_second: u32,
    pub burst: u32,
}

/// The two rates of a [`Budget`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Messages acted on.
    pub serve: Rate,
    /// Messages read past `serve` and dropped.
    pub drop: Rate,
    /// The least time a spent budget makes the caller wait: tokens gather meanwhile (up to the
    /// bursts), and are then read in one go.
    pub pause: Duration,
}

/// A worker's control messages other than `READY` (`STATS`, and any message the demux does not
/// know). A worker reports once a second (`worker/src/attach.rs`, `control_task`); a worker
/// whose runtime was blocked for a while catches up with one report per missed second (tokio's
/// default `MissedTickBehavior::Burst`), which the burst absorbs.
pub const CONTROL: Limits = Limits {
    serve: Rate {
        per_second: 4,
        burst: 16,
    },
    drop: Rate {
        per_second: 64,
        burst: 64,
    },
    pause: Duration::from_millis(10),
};

/// A worker's session-store requests (`ringmux_proto::session`). A full handshake costs the
/// worker one PUT per ticket (`TICKETS_PER_HANDSHAKE`, 2, in `worker/src/tls.rs`), a resumption
/// one TAKE more: 10 000 a second is 5 000 full handshakes a second from one worker, more than
/// one core completes.
pub const SESSIONS: Limits = Limits {
    serve: Rate {
        per_second: 10_000,
        burst: 10_000,
    },
    drop: Rate {
        per_second: 1_000,
        burst: 1_000,
    },
    // A worker past its rate waits this long for a reply, well within its own timeout
    // (`worker/src/sessions.rs`, 50 ms).
    pause: Duration::from_millis(5),
};

/// Which of a worker's messages was dropped: the `kind` label of
/// `ringmux_worker_messages_dropped_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MessageKind {
    /// A `STATS` report.
    Stats,
    /// Any other control message but `READY` (which is never dropped).
    Control,
    /// A session-store request.
    Session,
}

impl MessageKind {
    /// The kind of a control message, from its first word alone (`ringmux_proto::message`):
    /// a message to drop is not parsed.
    pub fn of_control(packet: &[u8]) -> MessageKind {
        let word = packet.split(|b| *b == b' ').next().unwrap_or_default();
        if word == ringmux_proto::message::WORDS[1].as_bytes() {
            MessageKind::Stats
        } else {
            MessageKind::Control
        }
    }

    /// Counts a message of this kind of the lane's worker dropped past its budget.
    pub fn count_dropped(self, lane: &crate::metrics::InstanceCounters) {
        let counter = match self {
            MessageKind::Stats => &lane.stats_dropped,
            MessageKind::Control => &lane.control_dropped,
            MessageKind::Session => &lane.session_dropped,
        };
        counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
}

/// What to do with a message just read ([`Budget::spend`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Act on it.
    Serve,
    /// Drop it, and count it.
    Drop,
}

/// One worker's budget on one socket. Starts full.
#[derive(Clone, Debug)]
pub struct Budget {
    serve: Bucket,
    drop: Bucket,
    pause: Duration,
    /// Set when the budget was found spent: nothing is read before it.
    resume: Option<Instant>,
}

impl Budget {
    /// A full budget at `now`.
    pub fn new(limits: Limits, now: Instant) -> Self {
        Budget {
            serve: Bucket::new(limits.serve, now),
            drop: Bucket::new(limits.drop, now),
            pause: limits.pause,
            resume: None,
        }
    }

    /// `None` if a message may be read at `now`; else the moment from which one may: when a
    /// bucket has a token again, and no sooner than [`Limits::pause`] after the budget was
    /// found spent.
    pub fn read_after(&mut self, now: Instant) -> Option<Instant> {
        if let Some(resume) = self.resume {
            if now < resume {
                return Some(resume);
            }
            self.resume = None;
        }
        match (
            self.serve.conforms_after(now),
            self.drop.conforms_after(now),
        ) {
            (Some(s), Some(d)) => {
                let resume = s.min(d).max(now + self.pause);
                self.resume = Some(resume);
                Some(resume)
            }
            _ => None,
        }
    }

    /// Spends on a message read at `now`: served while the serve bucket has a token, else
    /// dropped. A message read although [`Budget::read_after`] said to wait is dropped too, and
    /// pushes the next read further out.
    pub fn spend(&mut self, now: Instant) -> Verdict {
        if self.serve.take(now) {
            Verdict::Serve
        } else {
            self.drop.charge(now);
            // A read past a pause starts the next one from here.
            self.resume = None;
            Verdict::Drop
        }
    }
}

/// One token bucket as GCRA: `tat` is the theoretical arrival time of the next message; a
/// message at `t` conforms if `tat <= t + tolerance`, and moves `tat` one interval on from
/// `max(tat, t)`. `tolerance = (burst - 1) * interval` lets `burst` through at once. The log
/// thread meters bytes with one too (`logs.rs`), charging several tokens at a time.
#[derive(Clone, Debug)]
pub struct Bucket {
    interval: Duration,
    tolerance: Duration,
    tat: Instant,
}

impl Bucket {
    /// A full bucket at `now`.
    pub fn new(rate: Rate, now: Instant) -> Self {
        let interval = Duration::from_secs(1) / rate.per_second.max(1);
        Bucket {
            interval,
            tolerance: interval * (rate.burst.max(1) - 1),
            tat: now,
        }
    }

    /// `None` if a message conforms at `now`; else when the next one will.
    pub fn conforms_after(&self, now: Instant) -> Option<Instant> {
        let limit = now + self.tolerance;
        (self.tat > limit).then(|| now + (self.tat - limit))
    }

    /// Takes a token if there is one at `now`.
    fn take(&mut self, now: Instant) -> bool {
        if self.conforms_after(now).is_some() {
            return false;
        }
        self.charge(now);
        true
    }

    /// Moves the theoretical arrival time on by one interval, conforming or not.
    fn charge(&mut self, now: Instant) {
        self.charge_n(now, 1);
    }

    /// Moves the theoretical arrival time on by `n` intervals, conforming or not: `n` tokens
    /// taken at once, into debt if need be.
    pub fn charge_n(&mut self, now: Instant, n: u32) {
        self.tat = self.tat.max(now) + self.interval * n;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: Limits = Limits {
        serve: Rate {
            per_second: 4,
            burst: 3,
        },
        drop: Rate {
            per_second: 10,
            burst: 2,
        },
        pause: Duration::ZERO,
    };

    /// Spends on every message the budget lets be read at `now`: the verdicts.
    fn read_all(b: &mut Budget, now: Instant) -> Vec<Verdict> {
        let mut out = Vec::new();
        // Bounded: a budget lets at most both bursts through at one instant.
        for _ in 0..100 {
            if b.read_after(now).is_some() {
                break;
            }
            out.push(b.spend(now));
        }
        out
    }

    #[test]
    fn a_full_budget_serves_its_burst_then_drops_its_burst_then_waits() {
        let t0 = Instant::now();
        let mut b = Budget::new(LIMITS, t0);
        use Verdict::{Drop, Serve};
        assert_eq!(read_all(&mut b, t0), [Serve, Serve, Serve, Drop, Drop]);
        // The drop bucket refills first: one drop every 100 ms.
        assert_eq!(b.read_after(t0), Some(t0 + Duration::from_millis(100)));
    }

    #[test]
    fn a_flood_costs_at_most_both_rates_over_time() {
        let t0 = Instant::now();
        let mut b = Budget::new(LIMITS, t0);
        let (mut served, mut dropped) = (0u32, 0u32);
        let mut now = t0;
        // A sender that always has a message waiting, checked every millisecond for 10 s.
        for _ in 0..10_000 {
            for v in read_all(&mut b, now) {
                match v {
                    Verdict::Serve => served += 1,
                    Verdict::Drop => dropped += 1,
                }
            }
            now += Duration::from_millis(1);
        }
        // 10 s at 4/s plus a burst of 3; at 10/s plus a burst of 2 (the last period may or
        // may not have come round).
        assert!((42..=43).contains(&served), "served {served}");
        assert!((100..=102).contains(&dropped), "dropped {dropped}");
    }

    #[test]
    fn a_sender_within_its_rate_is_never_dropped() {
        let t0 = Instant::now();
        let mut b = Budget::new(LIMITS, t0);
        // One message every 250 ms (exactly the rate) for a minute.
        for k in 0..240u32 {
            let now = t0 + Duration::from_millis(250) * k;
            assert_eq!(b.read_after(now), None, "message {k}");
            assert_eq!(b.spend(now), Verdict::Serve, "message {k}");
        }
    }

    #[test]
    fn a_spent_budget_waits_at_least_its_pause_then_reads_what_gathered() {
        let t0 = Instant::now();
        let pause = Duration::from_millis(350);
        let mut b = Budget::new(Limits { pause, ..LIMITS }, t0);
        read_all(&mut b, t0);
        assert_eq!(b.read_after(t0), Some(t0 + pause));
        // Asked again meanwhile, the same moment: the pause does not move on with the clock.
        let meanwhile = t0 + Duration::from_millis(200);
        assert_eq!(b.read_after(meanwhile), Some(t0 + pause));
        // By then one serve token (250 ms) and three drop intervals (100 ms) have come round;
        // the drop bucket's burst of 2 caps what gathered.
        let verdicts = read_all(&mut b, t0 + pause);
        use Verdict::{Drop, Serve};
        assert_eq!(verdicts, [Serve, Drop, Drop]);
    }

    #[test]
    fn a_quiet_spell_refills_the_burst_and_no_more() {
        let t0 = Instant::now();
        let mut b = Budget::new(LIMITS, t0);
        read_all(&mut b, t0);
        let later = t0 + Duration::from_secs(60);
        let verdicts = read_all(&mut b, later);
        let served = verdicts.iter().filter(|v| **v == Verdict::Serve).count();
        assert_eq!((served, verdicts.len()), (3, 5), "{verdicts:?}");
    }

    #[test]
    fn reading_while_told_to_wait_is_dropped_and_pushes_the_next_read_out() {
        let t0 = Instant::now();
        let mut b = Budget::new(LIMITS, t0);
        read_all(&mut b, t0);
        let next = b.read_after(t0).expect("spent");
        assert_eq!(b.spend(t0), Verdict::Drop);
        assert!(b.read_after(t0).expect("still spent") > next);
    }

    #[test]
    fn the_shipped_limits_serve_a_real_worker() {
        // A worker reports once a second; after its runtime was blocked for 15 s it sends the
        // missed reports at once: all served.
        let t0 = Instant::now();
        let mut b = Budget::new(CONTROL, t0);
        for k in 0..60u32 {
            assert_eq!(b.spend(t0 + Duration::from_secs(k.into())), Verdict::Serve);
        }
        let caught_up = t0 + Duration::from_secs(75);
        for _ in 0..15 {
            assert_eq!(b.spend(caught_up), Verdict::Serve);
        }
        // Two PUTs per handshake at 5 000 handshakes a second, for ten seconds.
        let mut b = Budget::new(SESSIONS, t0);
        for k in 0..100_000u32 {
            let now = t0 + Duration::from_micros(100) * k;
            assert_eq!(b.spend(now), Verdict::Serve, "request {k}");
        }
    }
}
