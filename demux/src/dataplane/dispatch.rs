//! What becomes of one datagram, decided without I/O: route it to a lane by its connection ID,
//! let admission judge a packet that opens a connection, and say whether to forward it, drop it
//! (and why) or answer it with a Retry. The receive loop (`dataplane/mod.rs`) does the I/O around
//! it: receive, split trains, push what [`classify`] forwards, send the Retries.

use std::net::SocketAddr;

use ringmux_quic_lb::{Header, Route, RouteCache, Router};

use crate::admission::{Admission, Verdict};
use crate::metrics::DropReason;

/// What to do with one datagram (one segment of a GRO train).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Disposition {
    /// Push it to this lane (instance and generation slot, [`Router::lane`]'s numbering).
    Forward { lane: usize },
    /// Drop it, counted under this reason.
    Drop(DropReason),
    /// Answer the client with a Retry ([`Admission::retry_packet`]); the datagram itself is
    /// dropped as [`DropReason::Retry`].
    Retry,
}

/// One datagram as it arrived.
#[derive(Debug, Clone, Copy)]
pub struct Arrival<'a> {
    pub bytes: &'a [u8],
    pub remote: SocketAddr,
    /// The batch's receive time (`CLOCK_MONOTONIC`, ns).
    pub now_ns: u64,
}

/// Decides what becomes of `d`. `active` is the first lane of the generation new connections
/// go to; `crowded(lane)` says whether that lane's ingress was past `--initial-shed-at` when the
/// batch began. Established traffic (a short header) pays the route and one test of its first
/// octet. The header is read once ([`Router::parse`]): the route takes its DCID, and admission
/// the same parsed view.
#[inline]
pub fn classify(
    router: &Router,
    cache: &mut RouteCache,
    admission: &mut Admission,
    d: Arrival<'_>,
    active: usize,
    crowded: impl Fn(usize) -> bool,
) -> Disposition {
    let Ok(header) = router.parse(d.bytes) else {
        return Disposition::Drop(DropReason::Malformed);
    };
    let route = cache.route_header(router, &header);
    let lane = match route {
        Route::Owned(lane) => usize::from(lane),
        Route::Hashed(i) => active + usize::from(i),
        // Not from a header that parsed; kept apart all the same.
        Route::Malformed(_) => return Disposition::Drop(DropReason::Malformed),
    };
    let opens = match header {
        Header::Long(ref long) if long.starts_connection() => long,
        _ => return Disposition::Forward { lane },
    };
    let hashed = matches!(route, Route::Hashed(_));
    // A lane number fits a byte: the router numbers at most 256 lanes.
    let verdict = admission.decide(opens, d.remote, lane as u8, hashed, crowded(lane), d.now_ns);
    match verdict {
        Verdict::Forward => Disposition::Forward { lane },
        Verdict::Shed => Disposition::Drop(DropReason::InitialShed),
        Verdict::TokenRefused => Disposition::Drop(DropReason::TokenRefused),
        Verdict::OverBudget => Disposition::Drop(DropReason::PrefixBudget),
        Verdict::Retry => Disposition::Retry,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::admission::{RetryMode, Settings};
    use ringmux_quic_lb::{CidGenerator, ConnectionIdGenerator, QuicLbConfig};

    const CLIENT: &str = "192.0.2.7:4433";

    /// Two instances: lane `slot * 2 + instance`; new connections go to slot 1 (lanes 2, 3).
    fn parts(retry: RetryMode) -> (Router, Admission, QuicLbConfig) {
        let mut cfg = QuicLbConfig::default_with_key([7; 16]);
        cfg.instance_count = 2;
        let router = Router::new(&cfg, [3; 16]).unwrap();
        let admission = Admission::new(
            Settings {
                retry,
                retry_above: 1000,
                prefix_budget: 0,
                prefix_v4: 24,
                prefix_v6: 56,
            },
            router.clone(),
            &[9; 64],
            crate::tickets::HelloInspector::new(Default::default()),
        );
        (router, admission, cfg)
    }

    fn initial(dcid: &[u8]) -> Vec<u8> {
        let mut p = vec![0xc3, 0, 0, 0, 1, dcid.len() as u8];
        p.extend_from_slice(dcid);
        p.extend_from_slice(&[8, 1, 2, 3, 4, 5, 6, 7, 8, 0, 0x44, 0x00]);
        p.resize(1200, 0);
        p
    }

    fn arrival(bytes: &[u8]) -> Arrival<'_> {
        Arrival {
            bytes,
            remote: CLIENT.parse().unwrap(),
            now_ns: 1_000_000_000,
        }
    }

    #[test]
    fn established_traffic_goes_to_the_lane_its_cid_names() {
        let (router, mut admission, cfg) = parts(RetryMode::Never);
        let mut cache = RouteCache::new(&router);
        for (instance, slot) in [(0, 0), (1, 0), (0, 1), (1, 1), (1, 3)] {
            let mut gen = CidGenerator::in_slot(&cfg, instance, slot, None).unwrap();
            let mut short = vec![0x40];
            short.extend_from_slice(&gen.generate_cid());
            short.extend_from_slice(&[0; 40]);
            let d = classify(
                &router,
                &mut cache,
                &mut admission,
                arrival(&short),
                2,
                |_| false,
            );
            assert_eq!(
                d,
                Disposition::Forward {
                    lane: usize::from(router.lane(instance, slot))
                }
            );
        }
    }

    #[test]
    fn new_connections_are_hashed_to_the_active_generation() {
        let (router, mut admission, _) = parts(RetryMode::Never);
        let mut cache = RouteCache::new(&router);
        let mut lanes = std::collections::BTreeSet::new();
        for i in 0..64u8 {
            let p = initial(&[i, 1, 2, 3, 4, 5, 6, 7]);
            match classify(&router, &mut cache, &mut admission, arrival(&p), 2, |_| {
                false
            }) {
                Disposition::Forward { lane } => lanes.insert(lane),
                other => panic!("an Initial of a client DCID: {other:?}"),
            };
        }
        assert_eq!(
            lanes.into_iter().collect::<Vec<_>>(),
            vec![2, 3],
            "slot 1's lanes, both"
        );
    }

    #[test]
    fn what_does_not_parse_is_dropped_as_malformed() {
        let (router, mut admission, _) = parts(RetryMode::Never);
        let mut cache = RouteCache::new(&router);
        // A v1 Initial whose SCID is 21 octets: v1 endpoints drop it (RFC 9000 §17.2).
        let mut long_scid = vec![0xc3, 0, 0, 0, 1, 8, 1, 2, 3, 4, 5, 6, 7, 8, 21];
        long_scid.extend_from_slice(&[9; 21]);
        long_scid.resize(1200, 0);
        for bytes in [
            &b""[..],
            &[0x40][..],
            &[0xc3, 0, 0, 0, 1, 200][..],
            &long_scid[..],
        ] {
            assert_eq!(
                classify(
                    &router,
                    &mut cache,
                    &mut admission,
                    arrival(bytes),
                    0,
                    |_| false
                ),
                Disposition::Drop(DropReason::Malformed),
                "{bytes:02x?}"
            );
        }
    }

    /// The header is read once: a long header that opens no connection (Handshake, version
    /// negotiation) is forwarded without admission, and an Initial whose Length runs past the
    /// datagram is malformed, not admission's to judge.
    #[test]
    fn long_headers_that_open_nothing_pass_and_cut_initials_are_malformed() {
        let (router, mut admission, _) = parts(RetryMode::Always);
        let mut cache = RouteCache::new(&router);
        let mut classify = |bytes: &[u8]| {
            classify(
                &router,
                &mut cache,
                &mut admission,
                arrival(bytes),
                2,
                |_| false,
            )
        };
        let mut handshake = initial(&[4; 8]);
        handshake[0] = 0xe3;
        // Handshake: no token field, so the Length is the octet after the SCID.
        let at = 6 + 8 + 9;
        handshake.splice(at..at + 3, [0x40, 0x10]);
        assert!(matches!(
            classify(&handshake),
            Disposition::Forward { lane: 2 | 3 }
        ));
        let mut negotiation = initial(&[4; 8]);
        negotiation[1..5].copy_from_slice(&[0; 4]);
        assert!(matches!(
            classify(&negotiation),
            Disposition::Forward { lane: 2 | 3 }
        ));
        assert_eq!(classify(&initial(&[4; 8])), Disposition::Retry);
        let mut cut = initial(&[4; 8]);
        cut.truncate(0x400 + 6 + 8 + 9 + 3 - 1);
        assert_eq!(classify(&cut), Disposition::Drop(DropReason::Malformed));
    }

    #[test]
    fn admission_decides_for_new_connections_only() {
        let (router, mut admission, cfg) = parts(RetryMode::Always);
        let mut cache = RouteCache::new(&router);
        let p = initial(&[9, 1, 2, 3, 4, 5, 6, 7]);
        assert_eq!(
            classify(&router, &mut cache, &mut admission, arrival(&p), 0, |_| {
                false
            }),
            Disposition::Retry,
            "--retry always: an Initial without a token meets a Retry"
        );
        // Established traffic never meets admission, Retry or not.
        let mut gen = CidGenerator::in_slot(&cfg, 1, 0, None).unwrap();
        let mut short = vec![0x40];
        short.extend_from_slice(&gen.generate_cid());
        short.extend_from_slice(&[0; 40]);
        assert_eq!(
            classify(
                &router,
                &mut cache,
                &mut admission,
                arrival(&short),
                0,
                |_| true
            ),
            Disposition::Forward {
                lane: usize::from(router.lane(1, 0))
            }
        );
    }
}
