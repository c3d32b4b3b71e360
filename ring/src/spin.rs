//! How long an idle consumer spins before it sleeps on the doorbell, adapted to what arrivals
//! and wake-ups cost. Sans I/O: the consumer reports how long each idle period lasted (from
//! the ring found empty to the next datagram, whether it came during the spin or woke a sleep)
//! and reads the next budget.
//!
//! A spin pays when the next datagram comes before it ends: the consumer takes it at once,
//! where a sleep costs a doorbell write and a wake-up, about 20 µs of CPU on the two sides
//! together ([`WAKE_COST`]). A spin that ends empty is pure waste, its whole budget burned before
//! the sleep that follows anyway. So the consumer keeps two running averages over its idle
//! periods: the share of them shorter than the configured maximum ([`SpinPolicy::max`]), and how
//! long those short ones last. It spins for four typical short gaps, and only when that
//! pays on average: when `share × WAKE_COST` exceeds `(1 − share) × budget`, the wake-ups saved
//! against the spins that end empty. Otherwise it sleeps at once.
//!
//! * Datagrams close together (a busy consumer): every gap is short, the budget stays at up to
//!   the maximum, as the fixed spin of old.
//! * Trains of datagrams (GSO) separated by longer gaps than the maximum: the gaps between
//!   trains are long and nothing arrives during a spin; the share falls and the consumer sleeps
//!   at once, as a socket's reader would.
//! * Bursts with short gaps inside and long ones between: the budget shrinks to what catches
//!   the short gaps, and no more is burned on each long one.
//!
//! The price: a gap longer than four typical ones but shorter than the maximum now costs a
//! wake-up the fixed spin would have saved, so at moderate rates a few more datagrams wait for
//! one (bench/RESULTS.md). [`SpinPolicy::Fixed`] keeps the fixed spin (`--spin fixed`).

use std::time::Duration;

use crate::config::{ConfigError, RingField};

/// How an idle consumer spins before it sleeps on the doorbell: one value from the demux's
/// command line (`--spin`, `--spin-us`) through the worker's hand-off to
/// `Consumer::attach`, which spins by it ([`AdaptiveSpin`]). The producer never spins, so the
/// ring's geometry (`RingConfig`) holds none.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpinPolicy {
    /// Always spin this long: the shortest tail and the cheapest producer under saturation.
    Fixed(Duration),
    /// Spin about four typical short gaps between datagrams, at most `max`, and not at all
    /// when the gaps are mostly longer than `max` (this module's description).
    Adaptive { max: Duration },
}

impl Default for SpinPolicy {
    /// The adaptive spin, at most [`SpinPolicy::DEFAULT_US`]: it spins what pays and no more,
    /// and saturated it costs what the fixed spin does (bench/RESULTS.md, issue #43).
    fn default() -> Self {
        SpinPolicy::Adaptive {
            max: Duration::from_micros(u64::from(SpinPolicy::DEFAULT_US)),
        }
    }
}

impl SpinPolicy {
    /// The default spin, µs.
    ///
    /// 50 µs: on these virtualised machines a doorbell costs the waker ~11 µs and the sleeper
    /// ~9 µs of CPU and ~28 µs of latency (measured with the C reference forwarder beside
    /// `ring/benches/ring.rs`, bench/RESULTS.md), the price of receiving 25–30
    /// datagrams. A consumer that keeps polling for 50 µs after its ring runs dry rides out the
    /// gaps between receive batches at any load above ~20 k datagrams/s, so doorbells vanish
    /// under load (the reference measured 0.0002 per datagram with ~50 µs), while an idle
    /// worker still goes to sleep within 50 µs and burns no CPU.
    pub const DEFAULT_US: u32 = 50;
    /// The longest spin a policy may name, µs.
    pub const MAX_US: u32 = 1_000_000;

    const EXPECTED: &'static str = "microseconds from 0 to 1000000";

    /// The policy that spins `us` µs (at most, when `adaptive`), checked against
    /// [`SpinPolicy::MAX_US`]; a refusal names [`RingField::SpinUs`].
    pub fn from_micros(us: u32, adaptive: bool) -> Result<SpinPolicy, ConfigError> {
        if us > Self::MAX_US {
            return Err(ConfigError {
                field: RingField::SpinUs,
                value: us,
                expected: Self::EXPECTED,
            });
        }
        let max = Duration::from_micros(u64::from(us));
        Ok(if adaptive {
            SpinPolicy::Adaptive { max }
        } else {
            SpinPolicy::Fixed(max)
        })
    }

    /// The longest an idle period spins: the fixed spin, or the adaptive one's cap.
    pub fn max(&self) -> Duration {
        match *self {
            SpinPolicy::Fixed(max) | SpinPolicy::Adaptive { max } => max,
        }
    }

    /// Whether the spin adapts to the gaps between datagrams.
    pub fn adapts(&self) -> bool {
        matches!(self, SpinPolicy::Adaptive { .. })
    }
}

/// What one sleep and wake-up cost the box: the producer's doorbell write and the sleeper's
/// wake-up together (an eventfd write that wakes a sleeper on the other CPU costs the writer
/// about 11 µs and the sleeper about 9 µs on the 2-CPU virtual machines ringmux is measured on).
pub const WAKE_COST: Duration = Duration::from_micros(20);

/// The longest an idle period spins on the producer's word that its next publish is near
/// (`TailLine::busy`, shm-layout.md), whatever the budget. The producer gives its word only
/// when its receives fill their batches and come at most this far apart: saturated, with single
/// datagrams, a batch of 32 takes it ~45 µs here, right at the default spin, so without the
/// word every other gap would cost the producer a doorbell (~11 µs, a quarter of the batch).
pub const BUSY_SPIN: Duration = Duration::from_micros(100);

/// The spin budget of one consumer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdaptiveSpin {
    /// `false`: always `max` ([`SpinPolicy::Fixed`]).
    adapts: bool,
    /// This idle period spun past its budget on the producer's word: its length says when
    /// the producer's next batch came, not how datagrams are spaced, so it is not learnt from.
    held: bool,
    max: Duration,
    budget: Duration,
    /// Running average of the share of idle periods shorter than `max`.
    short_share: f64,
    /// Running average of the length of those, ns.
    short_gap_ns: f64,
}

/// Weight of the newest idle period in the share (1/16) and in the short-gap length (1/8).
const SHARE_WEIGHT: f64 = 1.0 / 16.0;
const GAP_WEIGHT: f64 = 1.0 / 8.0;

/// The budget in typical short gaps: enough to catch most of the short gaps, whose lengths
/// spread around their average.
const GAPS: f64 = 4.0;

impl AdaptiveSpin {
    /// The spin of `policy`. Either starts as the fixed spin of old, the whole maximum; only an
    /// [`SpinPolicy::Adaptive`] one moves from there.
    pub fn new(policy: SpinPolicy) -> AdaptiveSpin {
        let max = policy.max();
        AdaptiveSpin {
            adapts: policy.adapts(),
            held: false,
            max,
            budget: max,
            short_share: 1.0,
            short_gap_ns: max.as_nanos() as f64 / 2.0,
        }
    }

    /// Whether the budget adapts (else [`AdaptiveSpin::idle_ended`] does nothing, and a caller
    /// may skip measuring the gap).
    pub fn adapts(&self) -> bool {
        self.adapts
    }

    /// How long the next idle period spins.
    pub fn budget(&self) -> Duration {
        self.budget
    }

    /// The configured maximum.
    pub fn max(&self) -> Duration {
        self.max
    }

    /// Whether an idle period that began `elapsed` ago spins on: within the budget, or past it
    /// while `producer_busy` (the producer's word that its next publish is near) for up to
    /// [`BUSY_SPIN`] in all.
    #[inline]
    pub fn spins_on(&mut self, elapsed: Duration, producer_busy: bool) -> bool {
        if elapsed < self.budget {
            return true;
        }
        if producer_busy && elapsed < BUSY_SPIN {
            self.held = true;
            return true;
        }
        false
    }

    /// An idle period ended after `gap`: the next datagram came (during the spin, or by
    /// waking the sleep).
    pub fn idle_ended(&mut self, gap: Duration) {
        if std::mem::take(&mut self.held) || !self.adapts {
            return;
        }
        let short = gap < self.max;
        self.short_share += (f64::from(u8::from(short)) - self.short_share) * SHARE_WEIGHT;
        if short {
            self.short_gap_ns += (gap.as_nanos() as f64 - self.short_gap_ns) * GAP_WEIGHT;
        }
        let budget = Duration::from_nanos((GAPS * self.short_gap_ns) as u64).min(self.max);
        let saved = self.short_share * WAKE_COST.as_nanos() as f64;
        let burned = (1.0 - self.short_share) * budget.as_nanos() as f64;
        self.budget = if saved > burned {
            budget
        } else {
            Duration::ZERO
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAX: Duration = Duration::from_micros(50);

    fn adaptive(max: Duration) -> AdaptiveSpin {
        AdaptiveSpin::new(SpinPolicy::Adaptive { max })
    }

    fn after(gaps: &[u64]) -> AdaptiveSpin {
        let mut s = adaptive(MAX);
        for _ in 0..200 {
            for &g in gaps {
                s.idle_ended(Duration::from_micros(g));
            }
        }
        s
    }

    #[test]
    fn close_arrivals_spin_four_of_their_gaps() {
        assert_eq!(adaptive(MAX).budget(), MAX);
        let b = after(&[5]).budget();
        assert!(
            (Duration::from_micros(19)..=Duration::from_micros(21)).contains(&b),
            "{b:?}"
        );
        assert_eq!(after(&[40]).budget(), MAX, "capped at the maximum");
    }

    #[test]
    fn long_gaps_only_mean_no_spin() {
        assert_eq!(after(&[200]).budget(), Duration::ZERO);
        // GSO trains: a long gap between trains, nothing short in between.
        assert_eq!(after(&[130, 130, 130]).budget(), Duration::ZERO);
    }

    #[test]
    fn bursts_keep_a_spin_that_catches_their_short_gaps() {
        // Four short gaps of 8 µs, then a long one: a spin of ~32 µs saves four wake-ups and
        // burns 32 µs once.
        let b = after(&[8, 8, 8, 8, 1000]).budget();
        assert!(
            (Duration::from_micros(28)..=Duration::from_micros(36)).contains(&b),
            "{b:?}"
        );
        // One short gap in ten: not worth spinning for.
        assert_eq!(
            after(&[8, 1000, 1000, 1000, 1000, 1000, 1000, 1000, 1000, 1000]).budget(),
            Duration::ZERO
        );
    }

    #[test]
    fn the_producers_word_holds_a_spin_past_its_budget_and_no_further() {
        let us = Duration::from_micros;
        // Gaps of 60 µs, just over the maximum: the budget falls to nothing.
        let mut s = after(&[60]);
        assert_eq!(s.budget(), Duration::ZERO);
        assert!(!s.spins_on(us(1), false), "no word, no spin");
        assert!(s.spins_on(us(1), true), "the producer's next batch is near");
        assert!(s.spins_on(us(99), true));
        assert!(!s.spins_on(BUSY_SPIN, true), "at most BUSY_SPIN in all");
        // Within the budget the word changes nothing, and such a period is learnt from.
        let mut f = AdaptiveSpin::new(SpinPolicy::Fixed(MAX));
        assert!(f.spins_on(us(10), false));
        assert!(!f.spins_on(MAX, false));
    }

    #[test]
    fn a_period_held_by_the_word_is_not_learnt_from() {
        let us = Duration::from_micros;
        let mut held = after(&[5]);
        let before = held.budget();
        for _ in 0..200 {
            // Spun past the budget on the word; the batch came after 60 µs.
            assert!(held.spins_on(us(40), true));
            held.idle_ended(us(60));
        }
        assert_eq!(
            held.budget(),
            before,
            "held periods leave the budget as it was"
        );
        let mut unheld = after(&[5]);
        for _ in 0..200 {
            unheld.idle_ended(us(60));
        }
        assert_eq!(
            unheld.budget(),
            Duration::ZERO,
            "the same gaps, learnt, end the spin"
        );
    }

    #[test]
    fn a_fixed_spin_stays() {
        let mut s = AdaptiveSpin::new(SpinPolicy::Fixed(MAX));
        for _ in 0..100 {
            s.idle_ended(Duration::from_millis(1));
        }
        assert_eq!(s.budget(), MAX);
    }

    #[test]
    fn zero_maximum_never_spins() {
        let mut s = adaptive(Duration::ZERO);
        s.idle_ended(Duration::from_micros(3));
        assert_eq!(s.budget(), Duration::ZERO);
    }

    #[test]
    fn policies_are_checked_against_the_longest_spin() {
        assert_eq!(
            SpinPolicy::from_micros(50, false),
            Ok(SpinPolicy::Fixed(MAX))
        );
        assert_eq!(SpinPolicy::from_micros(50, true), Ok(SpinPolicy::default()));
        assert_eq!(
            SpinPolicy::from_micros(SpinPolicy::MAX_US, true),
            Ok(SpinPolicy::Adaptive {
                max: Duration::from_secs(1)
            })
        );
        let e = SpinPolicy::from_micros(2_000_000, true).unwrap_err();
        assert_eq!((e.field, e.value), (RingField::SpinUs, 2_000_000));
        let msg = e.to_string();
        assert!(msg.contains("spin_us") && msg.contains("expected"), "{msg}");
    }
}
