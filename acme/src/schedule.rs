//! When each ACME site orders next: renewal at a third of the lifetime left or in the CA's ARI
//! window (RFC 9773), retries with exponential back-off and jitter, a CA's `Retry-After`, and
//! forced renewals. Sans I/O: every decision takes `now` and the jitter as arguments, so the
//! tests drive it on a fake clock; the engine (`engine.rs`) carries the decisions out.
//!
//! Every time here comes from a certificate or a CA (or a file another node wrote), so no
//! arithmetic may overflow or panic: additions are checked and saturate at [`far_future`].

use std::time::{Duration, SystemTime};

/// A certificate's validity (`notBefore`, `notAfter`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Validity {
    pub not_before: SystemTime,
    pub not_after: SystemTime,
}

/// A renewal window suggested by the CA (RFC 9773 §4.2, `suggestedWindow`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Window {
    pub start: SystemTime,
    pub end: SystemTime,
}

/// A number in `[0, 1)` that spreads retries (and the point chosen in an ARI window) so that
/// nodes and sites do not act in step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Jitter(f64);

impl Jitter {
    /// `x` clamped into `[0, 1)`; NaN is 0.
    pub fn new(x: f64) -> Jitter {
        if x.is_nan() || x < 0.0 {
            Jitter(0.0)
        } else if x >= 1.0 {
            Jitter(1.0 - f64::EPSILON)
        } else {
            Jitter(x)
        }
    }

    /// From the system's random source (0 if it fails: jitter is a courtesy, not a need).
    pub fn random() -> Jitter {
        let mut b = [0u8; 8];
        match getrandom::fill(&mut b) {
            // 53 random bits, the precision of an f64 in [0, 1).
            Ok(()) => Jitter::new((u64::from_ne_bytes(b) >> 11) as f64 / (1u64 << 53) as f64),
            Err(_) => Jitter(0.0),
        }
    }

    /// `d` scaled by the jitter: somewhere in `[0, d)`.
    fn of(self, d: Duration) -> Duration {
        // Finite and in [0, 1): mul_f64 cannot panic on it; d is at most the back-off cap.
        d.mul_f64(self.0)
    }
}

/// How failed orders are retried: the first retry `base` after the failure, doubling with
/// each failure in a row up to `cap`; each delay is cut by up to half at random ("equal
/// jitter"), so a delay lies in `(d/2, d]` and the next one in `(d, 2d]`: it always grows
/// until the cap. A CA's `Retry-After` is honoured up to `max_retry_after` from now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Backoff {
    pub base: Duration,
    pub cap: Duration,
    pub max_retry_after: Duration,
}

impl Default for Backoff {
    /// One minute doubling to one day; a `Retry-After` up to a week (Let's Encrypt's longest
    /// rate-limit window).
    fn default() -> Self {
        Backoff {
            base: Duration::from_secs(60),
            cap: Duration::from_secs(86_400),
            max_retry_after: Duration::from_secs(7 * 86_400),
        }
    }
}

impl Backoff {
    /// The delay before the attempt after `failures` failed ones in a row (`failures` ≥ 1).
    pub fn delay(&self, failures: u32, jitter: Jitter) -> Duration {
        let doublings = failures.saturating_sub(1).min(63);
        let d = self
            .base
            .checked_mul(1u32.checked_shl(doublings.min(31)).unwrap_or(u32::MAX))
            .unwrap_or(self.cap)
            .min(self.cap);
        d - jitter.of(d / 2)
    }
}

/// The schedule of one site.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SiteSchedule {
    cert: Option<Validity>,
    /// The point chosen in the CA's ARI window for `cert`, if the CA suggested one.
    ari: Option<SystemTime>,
    /// Failed orders in a row (this node's or, through the state directory, another's).
    failures: u32,
    /// No order before this (after a failure).
    retry_at: Option<SystemTime>,
    /// `Acme::renew` asked for an order whatever the certificate's age.
    forced: bool,
}

impl SiteSchedule {
    /// The site's certificate is now `cert` (`None`: it has none that covers its names). A new
    /// certificate ends a run of failures and forgets the ARI point of the old one.
    pub fn certificate(&mut self, cert: Option<Validity>) {
        if self.cert != cert {
            self.cert = cert;
            self.ari = None;
            if cert.is_some() {
                self.failures = 0;
                self.retry_at = None;
            }
        }
    }

    /// The CA's suggested window for the current certificate: renew at a random point in it,
    /// as RFC 9773 §4.2 asks (a window that ends before it starts is ignored).
    pub fn renewal_window(&mut self, window: Window, jitter: Jitter) {
        let Ok(width) = window.end.duration_since(window.start) else {
            return;
        };
        self.ari = Some(
            window
                .start
                .checked_add(jitter.of(width))
                .unwrap_or(window.end),
        );
    }

    /// When the current certificate should be replaced: the ARI point if the CA gave one,
    /// else when a third of its lifetime is left (Let's Encrypt's advice); at once without a
    /// certificate, or for one whose validity makes no sense.
    pub fn renew_at(&self) -> SystemTime {
        let Some(v) = self.cert else {
            return SystemTime::UNIX_EPOCH;
        };
        if let Some(ari) = self.ari {
            return ari.min(v.not_after);
        }
        match v.not_after.duration_since(v.not_before) {
            Ok(life) if !life.is_zero() => {
                v.not_after.checked_sub(life / 3).unwrap_or(v.not_before)
            }
            _ => SystemTime::UNIX_EPOCH,
        }
    }

    /// When the next order is due: at once if forced, else the renewal time or, after a
    /// failure, the retry time if that is later.
    pub fn next_attempt(&self) -> SystemTime {
        if self.forced {
            return SystemTime::UNIX_EPOCH;
        }
        let renew = self.renew_at();
        match self.retry_at {
            Some(r) if r > renew => r,
            _ => renew,
        }
    }

    pub fn due(&self, now: SystemTime) -> bool {
        self.next_attempt() <= now
    }

    /// Order now whatever the certificate's age or the back-off.
    pub fn force(&mut self) {
        self.forced = true;
    }

    /// An order succeeded; its certificate comes through [`SiteSchedule::certificate`].
    pub fn issued(&mut self) {
        self.forced = false;
        self.failures = 0;
        self.retry_at = None;
    }

    /// An order failed at `now`: the next attempt after the back-off, or after the CA's
    /// `Retry-After` if that is later (bounded by `backoff.max_retry_after`). Returns it.
    pub fn failed(
        &mut self,
        now: SystemTime,
        retry_after: Option<SystemTime>,
        backoff: &Backoff,
        jitter: Jitter,
    ) -> SystemTime {
        self.forced = false;
        self.failures = self.failures.saturating_add(1);
        let mut at = now
            .checked_add(backoff.delay(self.failures, jitter))
            .unwrap_or_else(far_future);
        if let Some(ra) = retry_after {
            let latest = now
                .checked_add(backoff.max_retry_after)
                .unwrap_or_else(far_future);
            at = at.max(ra.min(latest));
        }
        self.retry_at = Some(at);
        at
    }

    /// Another node's failures, read from the state directory: the same back-off holds here,
    /// so that N nodes do not retry N times as often. A later local failure counts on from it.
    pub fn adopt(&mut self, failures: u32, retry_at: SystemTime) {
        self.failures = failures;
        self.retry_at = Some(retry_at);
    }

    /// The site's configuration changed (its names): failures under the old one do not delay
    /// an order under the new one.
    pub fn forget_failures(&mut self) {
        self.failures = 0;
        self.retry_at = None;
    }

    pub fn failures(&self) -> u32 {
        self.failures
    }
}

/// A time later than any certificate's: what a saturated addition gives.
pub fn far_future() -> SystemTime {
    // 9999-12-31, the latest GeneralizedTime (RFC 5280 §4.1.2.5); representable everywhere
    // SystemTime is 64-bit seconds.
    SystemTime::UNIX_EPOCH + Duration::from_secs(253_402_300_799)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const MIN: Duration = Duration::from_secs(60);
    const DAY: Duration = Duration::from_secs(86_400);
    const ONE_SEC: Duration = Duration::from_secs(1);

    fn at(secs: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(secs)
    }

    /// A fake clock: what the engine's loop would see, minute by minute.
    struct Clock(SystemTime);

    impl Clock {
        fn advance(&mut self, d: Duration) -> SystemTime {
            self.0 += d;
            self.0
        }
    }

    #[test]
    fn a_site_without_a_certificate_is_due_at_once() {
        let s = SiteSchedule::default();
        assert!(s.due(at(0)));
        assert!(s.due(at(1_000_000)));
    }

    #[test]
    fn renewal_comes_when_a_third_of_the_lifetime_is_left() {
        let mut s = SiteSchedule::default();
        let nb = at(1_000_000);
        // 90 days: renew after 60.
        s.certificate(Some(Validity {
            not_before: nb,
            not_after: nb + 90 * DAY,
        }));
        assert_eq!(s.renew_at(), nb + 60 * DAY);
        assert!(!s.due(nb + 60 * DAY - Duration::from_secs(1)));
        assert!(s.due(nb + 60 * DAY));
        // 6-day certificates renew after 4 days.
        s.certificate(Some(Validity {
            not_before: nb,
            not_after: nb + 6 * DAY,
        }));
        assert_eq!(s.renew_at(), nb + 4 * DAY);
        // Nonsense validity: renew at once.
        s.certificate(Some(Validity {
            not_before: nb,
            not_after: nb,
        }));
        assert!(s.due(at(0)));
        s.certificate(Some(Validity {
            not_before: nb + DAY,
            not_after: nb,
        }));
        assert!(s.due(at(0)));
    }

    #[test]
    fn an_ari_window_decides_when_the_ca_gives_one() {
        let nb = at(1_000_000);
        let mut s = SiteSchedule::default();
        s.certificate(Some(Validity {
            not_before: nb,
            not_after: nb + 90 * DAY,
        }));
        // Earlier than the third (the CA wants it replaced), at a random point in the window.
        let w = Window {
            start: nb + 10 * DAY,
            end: nb + 12 * DAY,
        };
        s.renewal_window(w, Jitter::new(0.0));
        assert_eq!(s.renew_at(), w.start);
        s.renewal_window(w, Jitter::new(0.5));
        assert_eq!(s.renew_at(), nb + 11 * DAY);
        s.renewal_window(w, Jitter::new(0.999_999));
        assert!(s.renew_at() < w.end && s.renew_at() > nb + 11 * DAY);
        // Never after notAfter, whatever the CA says.
        s.renewal_window(
            Window {
                start: nb + 100 * DAY,
                end: nb + 101 * DAY,
            },
            Jitter::new(0.0),
        );
        assert_eq!(s.renew_at(), nb + 90 * DAY);
        // A backwards window is ignored.
        let before = s.clone();
        s.renewal_window(
            Window {
                start: nb + 5 * DAY,
                end: nb + 4 * DAY,
            },
            Jitter::new(0.0),
        );
        assert_eq!(s, before);
        // A new certificate forgets the old one's window.
        s.certificate(Some(Validity {
            not_before: nb + DAY,
            not_after: nb + 91 * DAY,
        }));
        assert_eq!(s.renew_at(), nb + 61 * DAY);
    }

    #[test]
    fn failures_back_off_doubling_with_jitter_up_to_a_day() {
        let b = Backoff::default();
        let mut clock = Clock(at(1_000_000));
        let mut s = SiteSchedule::default();
        let mut last_delay = Duration::ZERO;
        for n in 1..=20u32 {
            let now = clock.0;
            let j = Jitter::new((n as f64 * 0.37) % 1.0);
            let next = s.failed(now, None, &b, j);
            let delay = next.duration_since(now).unwrap();
            let d = (MIN * 2u32.pow((n - 1).min(30))).min(DAY);
            assert!(
                delay > d / 2 && delay <= d,
                "failure {n}: {delay:?} vs {d:?}"
            );
            if d < DAY {
                assert!(
                    delay > last_delay,
                    "failure {n}: {delay:?} <= {last_delay:?}"
                );
            }
            assert_eq!(s.failures(), n);
            // Not due a second before, due at the time.
            assert!(!s.due(next - Duration::from_secs(1)));
            assert!(s.due(next));
            last_delay = delay;
            clock.advance(delay);
        }
        // Capped: a day at most even after many failures.
        assert!(last_delay <= DAY);
        // Success ends the run.
        s.issued();
        s.certificate(Some(Validity {
            not_before: clock.0,
            not_after: clock.0 + 90 * DAY,
        }));
        assert_eq!(s.failures(), 0);
        let now = clock.advance(MIN);
        assert_eq!(s.failed(now, None, &b, Jitter::new(0.0)), now + MIN);
    }

    #[test]
    fn retry_after_is_honoured_up_to_a_week() {
        let b = Backoff::default();
        let now = at(1_000_000);
        let mut s = SiteSchedule::default();
        // Later than the back-off: wins.
        assert_eq!(
            s.failed(now, Some(now + 3 * 3600 * ONE_SEC), &b, Jitter::new(0.0)),
            now + Duration::from_secs(3 * 3600)
        );
        // Earlier than the back-off: the back-off wins.
        let mut s = SiteSchedule::default();
        assert_eq!(
            s.failed(
                now,
                Some(now + Duration::from_secs(1)),
                &b,
                Jitter::new(0.0)
            ),
            now + MIN
        );
        // Absurd: bounded.
        let mut s = SiteSchedule::default();
        assert_eq!(
            s.failed(now, Some(far_future()), &b, Jitter::new(0.0)),
            now + 7 * DAY
        );
    }

    #[test]
    fn a_forced_renewal_is_due_at_once_and_ends_with_the_order() {
        let b = Backoff::default();
        let now = at(1_000_000);
        let mut s = SiteSchedule::default();
        s.certificate(Some(Validity {
            not_before: now,
            not_after: now + 90 * DAY,
        }));
        assert!(!s.due(now));
        s.force();
        assert!(s.due(now));
        // Also through a back-off.
        s.failed(now, None, &b, Jitter::new(0.0));
        assert!(!s.due(now));
        s.force();
        assert!(s.due(now));
        s.issued();
        assert!(!s.due(now));
    }

    #[test]
    fn another_nodes_failures_hold_here_too() {
        let b = Backoff::default();
        let now = at(1_000_000);
        let mut s = SiteSchedule::default();
        s.adopt(3, now + 4 * MIN);
        assert!(!s.due(now + 3 * MIN));
        assert!(s.due(now + 4 * MIN));
        // The next local failure counts on: the fourth in a row, 8 minutes.
        let next = s.failed(now, None, &b, Jitter::new(0.0));
        assert_eq!(next, now + 8 * MIN);
    }

    #[test]
    fn a_short_base_scales_the_whole_schedule() {
        let b = Backoff {
            base: Duration::from_millis(100),
            cap: Duration::from_secs(1),
            ..Backoff::default()
        };
        assert_eq!(b.delay(1, Jitter::new(0.0)), Duration::from_millis(100));
        assert_eq!(b.delay(4, Jitter::new(0.0)), Duration::from_millis(800));
        assert_eq!(b.delay(5, Jitter::new(0.0)), Duration::from_secs(1));
        assert_eq!(b.delay(u32::MAX, Jitter::new(0.0)), Duration::from_secs(1));
    }

    #[test]
    fn jitter_is_clamped() {
        assert_eq!(Jitter::new(f64::NAN), Jitter::new(0.0));
        assert_eq!(Jitter::new(-3.0), Jitter::new(0.0));
        assert!(Jitter::new(7.0).0 < 1.0);
        for _ in 0..100 {
            let j = Jitter::random().0;
            assert!((0.0..1.0).contains(&j), "{j}");
        }
    }

    proptest! {
        /// Whatever the certificate, the window, the CA's Retry-After and the clock say, the
        /// schedule neither panics nor goes backwards from now after a failure.
        #[test]
        fn any_times_are_handled(
            nb in any::<u64>(), na in any::<u64>(),
            ws in any::<u64>(), we in any::<u64>(),
            now in 0u64..253_402_300_799, ra in proptest::option::of(any::<u64>()),
            failures in 0u32..200, j in any::<f64>(), base_ms in 0u64..u64::MAX / 2,
        ) {
            let t = |s: u64| SystemTime::UNIX_EPOCH.checked_add(Duration::from_secs(s % 253_402_300_800)).unwrap();
            let b = Backoff { base: Duration::from_millis(base_ms), ..Backoff::default() };
            let mut s = SiteSchedule::default();
            s.certificate(Some(Validity { not_before: t(nb), not_after: t(na) }));
            s.renewal_window(Window { start: t(ws), end: t(we) }, Jitter::new(j));
            let _ = s.renew_at();
            s.adopt(failures, t(now));
            let now = t(now);
            let next = s.failed(now, ra.map(t), &b, Jitter::new(j));
            prop_assert!(next >= now);
            prop_assert!(s.next_attempt() >= now);
        }
    }
}
