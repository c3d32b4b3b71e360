//! Receive coalescing: how the data plane waits once a receive has emptied the socket's queue.
//!
//! Sparse datagrams are best met by sleeping in `poll` until the next one: it is taken at once.
//! But each such sleep ends in a wake-up, and below saturation a wake-up is most of what the
//! data plane costs: scheduling it out and back in, on a virtual machine whose idle CPUs halt,
//! an interrupt into a halted CPU for the sender too, ~20 µs of CPU between the two for two or
//! three datagrams a wake-up at a site's rates (bench/RESULTS.md, "Where the demux's time goes
//! below saturation"). So while datagrams keep coming, the data plane sleeps a bounded window on
//! a timer instead, nobody waiting on the socket, and then takes in one receive every datagram
//! that arrived meanwhile: one wake-up for all of them, and the workers' rings published (their
//! doorbells rung) once for all of them too. That is what a NIC's interrupt moderation and
//! Linux's NAPI (`napi_defer_hard_irqs`, `gro_flush_timeout`) do for the kernel.
//!
//! The price is latency: a datagram arriving in a window waits for its end, at most the window
//! (`--recv-coalesce-us`). So the window is only taken when it pays, and never longer than it
//! takes to fill a receive batch:
//!
//! * A running estimate of the arrival rate: arrivals counted with an exponential decay of
//!   [`HORIZON`], so that bursts (a client's flight, a sender's `sendmmsg`) count by their
//!   average over many of them, not by how fast one comes in. An arrival is what the socket
//!   queues and what would wake the data plane: a datagram, or a whole GRO train, which one
//!   receive buffer takes ([`Coalesce::received`] counts messages). Trains a few per window
//!   apart gain nothing from waiting: they already come one wake-up each.
//! * After a short receive, the next wait is the timer when at least [`MIN_EXPECTED`]
//!   arrivals are expected within the longest window; else `poll` on the socket, as before.
//! * The window is the time a full receive batch takes to arrive at that rate, at most the
//!   longest window: the faster the arrivals, the shorter the wait.
//! * A window that brought nothing ends the coalescing at once (the rate estimate drops and the
//!   next wait is the socket), as NAPI re-arms the interrupt after an empty poll: an idle
//!   demux sleeps in `poll` and costs nothing.
//! * Coalescing must not slow the arrivals themselves. Clients that wait for each response
//!   before sending the next request (a few connections with a request or two in flight) send
//!   only as fast as they are answered, and a window delays every answer: measured here, two
//!   connections of two streams made a third of the requests with it (bench/RESULTS.md).
//!   So, as Linux's dynamic interrupt moderation (`net_dim`) steps its moderation by the
//!   throughput each step brings, the data plane tries the other way every [`STEADY`] for
//!   [`TRIAL`] and compares the arrival rates: coalescing stays (or comes back) unless the
//!   arrivals come [`THROTTLE`] times faster without it. Many independent clients send at
//!   their own pace, and a busy box answers faster with the CPU the windows save, so for them
//!   it stays. It starts off, and is first tried after [`STEADY`].
//!
//! Sans I/O: the data plane reports each receive ([`Coalesce::received`]) and asks how to wait
//! ([`Coalesce::next_wait`]).

use std::time::Duration;

/// Arrivals expected within the longest window for coalescing to be worth its latency: a
/// window must save the wake-ups of several arrivals, not trade one wake-up for another.
pub const MIN_EXPECTED: f64 = 4.0;

/// The time over which arrivals are averaged: past arrivals weigh `exp(-age / HORIZON)`. Long
/// against the gaps between bursts at the rates where coalescing starts (a burst of 32
/// datagrams every 3.2 ms is 10 000/s, within 15 %, at any moment), short against a change
/// of load a person would notice.
const HORIZON_NS: f64 = 10_000_000.0;

/// The horizon arrivals are averaged over (weight `exp(-age / HORIZON)`), as a duration.
pub const HORIZON: Duration = Duration::from_nanos(HORIZON_NS as u64);

/// How long the way in force (coalescing or not) runs between two trials of the other.
pub const STEADY: Duration = Duration::from_secs(1);
/// How long a trial lasts; the way in force is measured over as long just before it.
pub const TRIAL: Duration = Duration::from_millis(20);
/// Coalescing is off while the arrivals come this many times faster without it.
pub const THROTTLE: f64 = 1.2;
/// Arrivals two measurements must hold together for a decision (fewer: the way in force
/// stays).
const MIN_COMPARED: u64 = 64;
/// The shortest measurement of the way in force a decision trusts: traffic that resumes after
/// a pause longer than [`STEADY`] starts a trial at once, with nothing measured before it.
const MIN_BEFORE: Duration = Duration::from_millis(10);

/// The data plane's receive-coalescing state.
#[derive(Debug, Clone)]
pub struct Coalesce {
    /// The longest window, ns (0: never coalesce).
    max_ns: f64,
    /// Messages in a full receive batch (the window never waits for more).
    batch: f64,
    /// Arrivals so far, each weighed `exp(-age / HORIZON)` at `last_ns`: the rate is this over
    /// the horizon.
    arrivals: f64,
    /// When the last receive returned (`CLOCK_MONOTONIC`, ns; 0: none yet).
    last_ns: u64,
    /// Whether coalescing slows the arrivals, as the last trial found.
    trials: Trials,
}

/// The trials of coalescing against waking for each arrival (the module's description).
#[derive(Debug, Clone, Default)]
struct Trials {
    /// Coalescing is the way in force.
    on: bool,
    /// A trial of the other way is running.
    trying: bool,
    /// When the current phase (steady or trial) began (ns; 0: not yet).
    began_ns: u64,
    /// Arrivals are being counted (the last [`TRIAL`] of a steady phase, and the trial):
    /// `count` since `counting_ns`.
    counting: bool,
    counting_ns: u64,
    count: u64,
    /// The way in force's arrivals and time just before the trial.
    before: (u64, u64),
}

impl Trials {
    /// Whether windows may be taken now.
    fn allowed(&self) -> bool {
        self.on != self.trying
    }

    fn received(&mut self, now_ns: u64, messages: usize) {
        if self.began_ns == 0 {
            self.began_ns = now_ns;
        }
        let elapsed = now_ns.saturating_sub(self.began_ns);
        if self.counting {
            self.count += messages as u64;
        }
        if !self.trying {
            let steady = STEADY.as_nanos() as u64;
            if !self.counting && elapsed >= steady - TRIAL.as_nanos() as u64 {
                (self.counting, self.counting_ns, self.count) = (true, now_ns, 0);
            }
            if elapsed >= steady {
                self.before = (self.count, now_ns.saturating_sub(self.counting_ns));
                (self.trying, self.began_ns) = (true, now_ns);
                (self.counting_ns, self.count) = (now_ns, 0);
            }
        } else if elapsed >= TRIAL.as_nanos() as u64 {
            let rate = |(n, ns): (u64, u64)| n as f64 / ns.max(1) as f64;
            let (before, trial) = (self.before, (self.count, elapsed));
            if before.0 + trial.0 >= MIN_COMPARED && before.1 >= MIN_BEFORE.as_nanos() as u64 {
                let (with, without) = if self.on {
                    (rate(before), rate(trial))
                } else {
                    (rate(trial), rate(before))
                };
                self.on = without <= THROTTLE * with;
            }
            (self.trying, self.counting, self.began_ns) = (false, false, now_ns);
        }
    }
}

/// How to wait for the next datagrams.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wait {
    /// Sleep in `poll` until the socket is readable.
    Socket,
    /// Sleep this long on a timer, then receive whatever came.
    Window(Duration),
}

impl Coalesce {
    /// Coalescing windows of at most `max` (zero: never), for receives of `batch` messages.
    pub fn new(max: Duration, batch: usize) -> Coalesce {
        Coalesce {
            max_ns: max.as_nanos() as f64,
            batch: batch.max(1) as f64,
            arrivals: 0.0,
            last_ns: 0,
            trials: Trials::default(),
        }
    }

    /// The longest window.
    pub fn max(&self) -> Duration {
        Duration::from_nanos(self.max_ns as u64)
    }

    /// A receive returned `messages` (datagrams or GRO trains; 0: it found none) at `now_ns`.
    pub fn received(&mut self, now_ns: u64, messages: usize) {
        let age = now_ns.saturating_sub(self.last_ns) as f64;
        self.arrivals = self.arrivals * (-age / HORIZON_NS).exp() + messages as f64;
        self.last_ns = now_ns;
        if self.max_ns > 0.0 {
            self.trials.received(now_ns, messages);
        }
    }

    /// Whether coalescing is the way in force (outside a trial of the other).
    pub fn in_force(&self) -> bool {
        self.trials.on
    }

    /// Arrivals per ns, as the decayed count estimates it.
    fn rate(&self) -> f64 {
        self.arrivals / HORIZON_NS
    }

    /// How to wait after a receive that emptied the queue: `found` is how many messages that
    /// receive took (0: it found none, which ends any coalescing).
    pub fn next_wait(&self, found: usize) -> Wait {
        if found == 0 || self.max_ns <= 0.0 || !self.trials.allowed() {
            return Wait::Socket;
        }
        let rate = self.rate();
        if rate * self.max_ns < MIN_EXPECTED {
            return Wait::Socket;
        }
        let window = (self.batch / rate).min(self.max_ns);
        Wait::Window(Duration::from_nanos(window as u64))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAX: Duration = Duration::from_micros(250);

    /// Feeds `c` a receive every `every_us` from `*t` for `for_ns`, of `n(trying)` messages
    /// (`trying`: a trial of the other way is running).
    fn feed(c: &mut Coalesce, t: &mut u64, for_ns: u64, every_us: u64, n: impl Fn(bool) -> usize) {
        let end = *t + for_ns;
        while *t < end {
            *t += every_us * 1000;
            c.received(*t, n(c.trials.trying));
        }
    }

    /// A coalescer after its first trial (past [`STEADY`]) of receives of `n` messages every
    /// `every_us`: the trial found the arrivals as fast with windows, so they are in force.
    fn steady(n: usize, every_us: u64) -> Coalesce {
        let mut c = Coalesce::new(MAX, 32);
        let mut t = 1_000_000_000;
        assert!(!c.in_force(), "coalescing starts off");
        let past_first_trial = (STEADY + TRIAL * 2).as_nanos() as u64;
        feed(&mut c, &mut t, past_first_trial, every_us, |_| n);
        assert!(c.in_force(), "{c:?}");
        c
    }

    #[test]
    fn sparse_datagrams_wait_on_the_socket() {
        // One arrival every 100 µs: 2.5 expected in the longest window, not worth it.
        assert_eq!(steady(1, 100).next_wait(1), Wait::Socket);
        // Nothing known yet.
        assert_eq!(Coalesce::new(MAX, 32).next_wait(1), Wait::Socket);
    }

    #[test]
    fn a_steady_flow_waits_the_longest_window_for_less_than_a_batch() {
        // Three arrivals every 60 µs: 50 000/s, 12.5 in 250 µs.
        assert_eq!(steady(3, 60).next_wait(3), Wait::Window(MAX));
    }

    #[test]
    fn fast_arrivals_wait_no_longer_than_a_batch_takes() {
        // 16 arrivals every 10 µs: 1.6 M/s, a batch of 32 in 20 µs.
        let w = steady(16, 10).next_wait(16);
        let Wait::Window(d) = w else { panic!("{w:?}") };
        assert!(
            (Duration::from_micros(19)..=Duration::from_micros(21)).contains(&d),
            "{d:?}"
        );
    }

    #[test]
    fn an_empty_receive_returns_to_the_socket_and_the_estimate_falls() {
        let mut c = steady(3, 60);
        assert_eq!(c.next_wait(0), Wait::Socket);
        // The flow stopped: one empty window, then a lone datagram 50 ms (five horizons)
        // later does not start coalescing again.
        let t = c.last_ns;
        c.received(t + 250_000, 0);
        assert_eq!(c.next_wait(0), Wait::Socket);
        c.received(t + 50_000_000, 1);
        assert_eq!(c.next_wait(1), Wait::Socket);
    }

    #[test]
    fn bursts_count_by_their_average_rate() {
        // 32 arrivals every 3.2 ms (10 000/s), taken in two receives 5 µs apart: the rate is
        // of arrivals over the horizon, whatever moment of a burst one looks at.
        let mut c = Coalesce::new(MAX, 32);
        let mut t = 0;
        for _ in 0..100 {
            t += 3_200_000;
            c.received(t, 5);
            assert_eq!(c.next_wait(5), Wait::Socket);
            t += 5_000;
            c.received(t, 27);
            assert_eq!(c.next_wait(27), Wait::Socket);
        }
        // Twice as many bursts (20 000/s): worth a window, once a trial found that windows
        // do not slow them.
        for _ in 0..800 {
            t += 1_600_000;
            c.received(t, 32);
        }
        assert!(c.in_force(), "{c:?}");
        assert_eq!(c.next_wait(32), Wait::Window(MAX));
    }

    #[test]
    fn coalescing_that_slows_the_arrivals_is_turned_off_and_stays_off() {
        // Clients that wait for their answers: three times as many arrivals without windows.
        let mut c = steady(3, 60);
        let mut t = c.last_ns;
        let lockstep = |trying: bool, on: bool| if on != trying { 1 } else { 3 };
        // Up to and through the next trial (of no windows): the arrivals triple.
        feed(
            &mut c,
            &mut t,
            (STEADY + TRIAL * 2).as_nanos() as u64,
            60,
            |trying| lockstep(trying, true),
        );
        assert!(!c.in_force(), "{c:?}");
        assert_eq!(c.next_wait(3), Wait::Socket);
        // The next trial (of windows) finds them slow again: off it stays.
        feed(
            &mut c,
            &mut t,
            (STEADY + TRIAL * 2).as_nanos() as u64,
            60,
            |trying| lockstep(trying, false),
        );
        assert!(!c.in_force(), "{c:?}");
    }

    #[test]
    fn a_trial_without_windows_that_is_no_faster_keeps_them() {
        let mut c = steady(3, 60);
        let mut t = c.last_ns;
        // As fast without: the windows stay.
        feed(
            &mut c,
            &mut t,
            (STEADY + TRIAL * 2).as_nanos() as u64,
            60,
            |_| 3,
        );
        assert!(c.in_force(), "{c:?}");
    }

    #[test]
    fn traffic_resuming_after_a_pause_is_not_compared_with_the_pause() {
        let mut c = steady(3, 60);
        let mut t = c.last_ns + 5_000_000_000;
        // The first receive after five idle seconds starts a trial (of no windows) with
        // nothing measured before it; arrivals as fast as ever must not read as throttled.
        feed(&mut c, &mut t, (TRIAL * 2).as_nanos() as u64, 60, |_| 3);
        assert!(c.in_force(), "{c:?}");
    }

    #[test]
    fn too_few_arrivals_decide_nothing() {
        // One arrival every 2 ms: 10 in each measurement, fewer than a decision needs.
        let mut c = Coalesce::new(MAX, 32);
        let mut t = 1_000_000_000;
        feed(&mut c, &mut t, (STEADY * 3).as_nanos() as u64, 2_000, |_| 1);
        assert!(!c.in_force(), "{c:?}");
    }

    #[test]
    fn a_zero_maximum_never_coalesces() {
        let mut c = Coalesce::new(Duration::ZERO, 32);
        for i in 1..100 {
            c.received(i * 10_000, 32);
        }
        assert_eq!(c.next_wait(32), Wait::Socket);
        assert_eq!(c.max(), Duration::ZERO);
    }
}
