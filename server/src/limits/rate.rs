//! Request rates counted over every worker of the box: the decision of one request, over the
//! single-writer tables of `ringmux_ring::tally` (one per worker, summed).
//!
//! A limit of `burst` requests per window of `W = burst / rate` is a sliding-window count:
//! the requests admitted in the current window plus those of the previous one weighted by how
//! much of it is still inside the sliding window (`prev × (W − elapsed) / W + cur`), the
//! estimate Cloudflare and nginx-style limiters use. A request is admitted when the estimate
//! with it stays within `burst`, and counted in this worker's own cell of the window.
//!
//! What a hostile worker can do is bounded here: each table's count for a window is clamped
//! to `burst` before it is summed, and cells of any window but the current and previous one
//! are ignored, so a table adds between 0 and `burst` to every estimate (it can make a key
//! limited for every worker, or add nothing: never more than one full limit's worth).

use std::hash::Hasher;
use std::net::IpAddr;

use ringmux_proto::limits::RateLimit;
use ringmux_ring::tally::{Tallies, TALLY_SLOTS};
use siphasher::sip::SipHasher13;

/// The tables' slots one rate-limited gate hashes its clients into: its own share, so that
/// gates of different windows never share a cell.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Share {
    pub(crate) first: u32,
    pub(crate) len: u32,
}

impl Share {
    /// Share `i` of `n` equal shares of the slots (at least one slot each).
    pub(crate) fn of(i: u32, n: u32) -> Share {
        let len = (TALLY_SLOTS / n.max(1)).max(1);
        Share {
            first: (i * len) % TALLY_SLOTS,
            len,
        }
    }
}

/// The slot of client `addr` (already canonical) in `share`, keyed by `limit`'s prefixes.
pub(crate) fn slot(key: [u64; 2], share: Share, limit: &RateLimit, addr: IpAddr) -> u32 {
    let mut h = SipHasher13::new_with_keys(key[0], key[1]);
    match addr {
        IpAddr::V4(a) => {
            let bits = u32::from(a);
            let len = u32::from(limit.prefix_v4.get());
            h.write_u8(4);
            h.write_u32(if len >= 32 {
                bits
            } else {
                bits & !(u32::MAX >> len)
            });
        }
        IpAddr::V6(a) => {
            let bits = u128::from(a);
            let len = u32::from(limit.prefix_v6.get());
            h.write_u8(6);
            h.write_u128(if len >= 128 {
                bits
            } else {
                bits & !(u128::MAX >> len)
            });
        }
    }
    share.first + (h.finish() % u64::from(share.len)) as u32
}

/// A cell's value: `window << 32 | count`.
fn split(v: u64) -> (u32, u32) {
    ((v >> 32) as u32, v as u32)
}

/// Admits one request at `now_ms` (a monotonic clock every worker shares) against `limit` in
/// slot `slot` of `tables`, counting it in this worker's cell; or refuses it, with the seconds
/// until one would be admitted.
pub(crate) fn admit(
    tables: &Tallies,
    slot: u32,
    limit: &RateLimit,
    now_ms: u64,
) -> Result<(), u64> {
    let window = limit.window_ms();
    let burst = u64::from(limit.burst.get());
    let epoch = now_ms / window;
    let (cur, prev) = (epoch as u32, (epoch as u32).wrapping_sub(1));
    let elapsed = now_ms % window;
    // Per table, its counts of the two windows, each clamped.
    let mut sums = [0u64; 2];
    let mut table = [0u64; 2];
    let mut last = usize::MAX;
    let flush = |table: &mut [u64; 2], sums: &mut [u64; 2]| {
        sums[0] += table[0].min(burst);
        sums[1] += table[1].min(burst);
        *table = [0, 0];
    };
    tables.read(slot, |t, v| {
        if t != last {
            flush(&mut table, &mut sums);
            last = t;
        }
        let (w, count) = split(v);
        if w == cur {
            table[0] += u64::from(count);
        } else if w == prev {
            table[1] += u64::from(count);
        }
    });
    flush(&mut table, &mut sums);
    let [cur_sum, prev_sum] = sums;
    // prev × (W − elapsed) / W + cur + 1 ≤ burst, in integers: × W on both sides.
    let weighted = prev_sum * (window - elapsed) + (cur_sum + 1) * window;
    if weighted <= burst * window {
        tables.update(slot, (epoch % 2) as usize, |v| {
            let (w, count) = split(v);
            let count = if w == cur { count.saturating_add(1) } else { 1 };
            u64::from(cur) << 32 | u64::from(count)
        });
        return Ok(());
    }
    Err(retry_after(window, burst, elapsed, cur_sum, prev_sum))
}

/// Whole seconds (at least 1) until a request would be admitted, if no one else asks.
fn retry_after(window: u64, burst: u64, elapsed: u64, cur: u64, prev: u64) -> u64 {
    let wait_ms = if cur < burst {
        // Within this window, once the previous one has slid out far enough:
        // prev × (W − elapsed − t) ≤ (burst − cur − 1) × W.
        let room = (burst - cur - 1) * window;
        let need = prev * (window - elapsed);
        need.saturating_sub(room).div_ceil(prev.max(1))
    } else {
        // In the next window, this one's count becoming the previous.
        let into_next = cur
            .saturating_sub(burst - 1)
            .saturating_mul(window)
            .div_ceil(cur.max(1));
        (window - elapsed) + into_next
    };
    wait_ms.div_ceil(1000).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use ringmux_proto::limits::{FileLimits, Limits, Rate};
    use ringmux_ring::tally;
    use std::os::fd::OwnedFd;

    fn limit(rate: &str, burst: u64) -> RateLimit {
        let l = Limits::try_from(FileLimits {
            rate: Some(Rate::try_from(rate.to_string()).unwrap()),
            burst: Some(burst.try_into().unwrap()),
            ..FileLimits::default()
        })
        .unwrap();
        l.rate.unwrap()
    }

    /// Four workers' views of four tables.
    fn workers(n: usize) -> (Vec<OwnedFd>, Vec<Tallies>) {
        let fds: Vec<OwnedFd> = (0..n).map(|_| tally::create([3, 4]).unwrap()).collect();
        let views = (0..n)
            .map(|i| {
                let peers = (0..n)
                    .filter(|&j| j != i)
                    .map(|j| tally::read_only(&fds[j]).unwrap())
                    .collect();
                Tallies::attach(fds[i].try_clone().unwrap(), peers).unwrap()
            })
            .collect();
        (fds, views)
    }

    #[test]
    fn four_workers_admit_one_burst_together() {
        let (_fds, w) = workers(4);
        let l = limit("5/s", 10);
        let addr: IpAddr = "192.0.2.1".parse().unwrap();
        let s = slot(w[0].hash_key(), Share::of(0, 1), &l, addr);
        let now = 1_000_000;
        let admitted = (0..40)
            .filter(|i| admit(&w[i % 4], s, &l, now).is_ok())
            .count();
        assert_eq!(admitted, 10);
        // Another client (another slot, barring a collision of this fixed key) is unaffected.
        let other = slot(
            w[0].hash_key(),
            Share::of(0, 1),
            &l,
            "192.0.2.2".parse().unwrap(),
        );
        assert_ne!(s, other);
        assert!(admit(&w[1], other, &l, now).is_ok());
        // Refused with the time until the window slides: 10 more at the next window's end.
        let e = admit(&w[2], s, &l, now + 1).unwrap_err();
        assert!((1..=3).contains(&e), "{e}");
        // Two windows later the client is admitted again.
        assert!(admit(&w[3], s, &l, now + 2 * l.window_ms()).is_ok());
    }

    #[test]
    fn the_long_run_rate_is_the_rate() {
        let (_fds, w) = workers(2);
        let l = limit("10/s", 10);
        let s = 5;
        // One request every 10 ms for 10 s, from both workers in turn: 100 admitted, or 10 %
        // about it (the sliding estimate weighs the previous window as if evenly spread).
        let admitted = (0..1000u64)
            .filter(|i| admit(&w[(*i % 2) as usize], s, &l, 5_000_000 + i * 10).is_ok())
            .count();
        assert!((90..=110).contains(&admitted), "{admitted}");
    }

    #[test]
    fn a_hostile_table_adds_at_most_one_burst() {
        let (fds, w) = workers(2);
        let l = limit("5/s", 10);
        let now = 7_000_000;
        let epoch = (now / l.window_ms()) as u32;
        // Worker 1's own table, written as it likes: huge counts of the current window.
        let hostile = Tallies::attach(fds[1].try_clone().unwrap(), vec![]).unwrap();
        hostile.update(9, (epoch % 2) as usize, |_| {
            u64::from(epoch) << 32 | 0xffff_ffff
        });
        assert!(
            admit(&w[0], 9, &l, now).is_err(),
            "inflated: the key is limited"
        );
        // Zeroed (or a window far off): the honest worker still admits one burst only.
        hostile.update(9, (epoch % 2) as usize, |_| {
            u64::from(epoch.wrapping_add(9)) << 32 | 99
        });
        let admitted = (0..30).filter(|_| admit(&w[0], 9, &l, now).is_ok()).count();
        assert_eq!(admitted, 10);
    }

    /// Garbage of every kind in a hostile worker's own table (torn values, counts up to
    /// `u32::MAX`, windows near and far): an honest worker never admits more than one burst
    /// for a key; cells of any window but the current and the previous one change nothing;
    /// and a cell of the current window takes `min(count, burst)` from the burst, no more (a
    /// fixed-seed generator, so a failure repeats).
    #[test]
    fn garbage_in_a_table_counts_at_most_its_share() {
        let (fds, w) = workers(2);
        let hostile = Tallies::attach(fds[1].try_clone().unwrap(), vec![]).unwrap();
        let l = limit("5/s", 10);
        let burst = 10u64;
        let window = l.window_ms();
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            seed ^= seed >> 12;
            seed ^= seed << 25;
            seed ^= seed >> 27;
            seed.wrapping_mul(0x9e37_79b9_7f4a_7c15)
        };
        for round in 0..300u64 {
            // A window of its own each round, so the honest counts of the last one are stale.
            let now = 9_000_000 + round * 4 * window + next() % window;
            let epoch = (now / window) as u32;
            let slot = (round % 97) as u32;
            let far = |r: u64| epoch.wrapping_add(2 + (r % (u64::from(u32::MAX) - 3)) as u32);
            let count = |r: u64| match r % 3 {
                0 => u32::MAX,
                _ => (r >> 8) as u32 % 40,
            };
            let kind = next() % 3;
            let cells = match kind {
                0 => [(far(next()), count(next())), (far(next()), count(next()))],
                1 => [(epoch, count(next())), (far(next()), count(next()))],
                _ => [
                    (next() as u32, next() as u32),
                    (next() as u32, next() as u32),
                ],
            };
            for (c, (win, n)) in cells.into_iter().enumerate() {
                hostile.update(slot, c, |_| u64::from(win) << 32 | u64::from(n));
            }
            let admitted = (0..3 * burst)
                .filter(|_| admit(&w[0], slot, &l, now).is_ok())
                .count() as u64;
            let want = match kind {
                0 => Some(burst),
                1 => Some(burst - u64::from(cells[0].1).min(burst)),
                _ => None,
            };
            assert!(
                admitted <= burst,
                "round {round}: {cells:?} admitted {admitted}"
            );
            if let Some(want) = want {
                assert_eq!(admitted, want, "round {round}: {cells:?}");
            }
        }
    }

    #[test]
    fn prefixes_make_one_client_of_a_block() {
        let key = [1, 1];
        let l = limit("5/s", 5);
        let share = Share::of(1, 4);
        let a = slot(key, share, &l, "2001:db8:1:2::1".parse().unwrap());
        let b = slot(key, share, &l, "2001:db8:1:2:ffff::9".parse().unwrap());
        assert_eq!(a, b, "one /64");
        assert!((share.first..share.first + share.len).contains(&a));
    }
}
