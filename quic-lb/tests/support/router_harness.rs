//! The router fuzz harness, shared by the cargo-fuzz target (`fuzz/fuzz_targets/router.rs`
//! includes this file with `#[path]`) and the corpus replay test (`tests/fuzz_corpus.rs`), so a
//! crash the fuzzer finds replays as a failing `cargo test`.
//!
//! It owns three fixed configurations (single-pass, four-pass, plaintext) and the invariants
//! every routing decision must satisfy. It panics on a violated invariant; that is its job.

#![allow(dead_code)] // each includer uses a different subset

use std::sync::OnceLock;

use ringmux_quic_lb::{
    CidGenerator, ConnectionId, ConnectionIdGenerator, Header, LongHeader, QuicLbConfig, Reader,
    Route, RouteCache, Router,
};

/// One configuration under test: its router and one generator per instance.
pub struct Case {
    pub name: &'static str,
    pub config: QuicLbConfig,
    pub router: Router,
    pub generators: Vec<CidGenerator>,
}

/// Fixed QUIC-LB key of the harness (not a secret: test data).
pub const KEY: [u8; 16] = *b"ringmux-fuzz-key";
/// Fixed routing-hash key of the harness.
pub const HASH_KEY: [u8; 16] = *b"ringmux-hash-key";

/// The three configurations: `single_pass` (default 17-byte CIDs, 4 instances), `four_pass`
/// (config 2, 2-byte node, 6-byte nonce, 8 instances), `plaintext` (config 1, 1-byte node,
/// 5-byte nonce, 3 instances).
pub fn cases() -> &'static [Case] {
    static CASES: OnceLock<Vec<Case>> = OnceLock::new();
    CASES.get_or_init(|| {
        let mut single = QuicLbConfig::default_with_key(KEY);
        single.instance_count = 4;
        let four = QuicLbConfig {
            config_id: 2,
            node_id: vec![0x12, 0x34],
            instance_count: 8,
            nonce_len: 6,
            key: Some(KEY),
        };
        let plain = QuicLbConfig {
            config_id: 1,
            node_id: vec![0xab],
            instance_count: 3,
            nonce_len: 5,
            key: None,
        };
        [
            ("single_pass", single),
            ("four_pass", four),
            ("plaintext", plain),
        ]
        .into_iter()
        .map(|(name, config)| Case {
            name,
            router: Router::new(&config, HASH_KEY).expect("harness config is valid"),
            generators: (0..config.instance_count)
                .map(|i| CidGenerator::new(&config, i, None).expect("harness generator"))
                .collect(),
            config,
        })
        .collect()
    })
}

/// Routes `data` through every case and checks the invariants:
/// - the decision is total and pure (same answer twice), with a lane or instance in range;
/// - it agrees with [`Header::parse`] + [`Router::route_dcid`], and with a [`RouteCache`];
/// - a parsed long header's fields lie within `data`, in order ([`check_long_header`]), and
///   [`LongHeader::parse`] reads the same one;
/// - `Owned(i)` exactly when instance `i`'s generator validates the DCID;
/// - `validate` on the first ≤ 20 bytes of `data` never panics and agrees with the router.
pub fn exercise(data: &[u8]) {
    for case in cases() {
        let router = &case.router;
        let route = router.route(data);
        assert_eq!(route, router.route(data), "{}: not pure", case.name);
        match route {
            Route::Owned(lane) => assert!(usize::from(lane) < router.lanes(), "{}", case.name),
            Route::Hashed(i) => assert!(i < router.instance_count(), "{}", case.name),
            Route::Malformed(_) => {}
        }
        let mut cache = RouteCache::new(router);
        assert_eq!(cache.route(router, data), route, "{}: cache", case.name);
        assert_eq!(cache.route(router, data), route, "{}: cached", case.name);
        match router.parse(data) {
            Err(reason) => assert_eq!(route, Route::Malformed(reason), "{}", case.name),
            Ok(header) => {
                let dcid = header.dcid();
                assert_eq!(route, router.route_dcid(dcid), "{}", case.name);
                match header {
                    Header::Long(long) => {
                        check_long_header(data, &long);
                        assert_eq!(LongHeader::parse(data), Some(long), "{}", case.name);
                    }
                    Header::Short { dcid } => {
                        assert_eq!(dcid.len(), router.cid_len(), "{}", case.name);
                        assert_eq!(LongHeader::parse(data), None, "{}", case.name);
                    }
                }
                let cid = ConnectionId::new(dcid);
                for generator in &case.generators {
                    let own = generator.validate(&cid).is_ok();
                    let owned_here = route == Route::Owned(generator.instance());
                    assert_eq!(own, owned_here, "{}: {route:?}", case.name);
                }
            }
        }
        let prefix = &data[..data.len().min(20)];
        let cid = ConnectionId::new(prefix);
        for generator in &case.generators {
            if generator.validate(&cid).is_ok() {
                assert_eq!(
                    router.owner(prefix),
                    Some(generator.instance()),
                    "{}",
                    case.name
                );
            }
        }
    }
}

/// The invariants of a long header read from `data`: every field a part of `data`, in wire
/// order, the DCID within 20 octets, the packet number and end (v1) within the datagram; and
/// the cursor's reads over the rest never panic nor run past it.
pub fn check_long_header(data: &[u8], long: &LongHeader<'_>) {
    let base = data.as_ptr() as usize;
    let at = |field: &[u8]| {
        let start = field.as_ptr() as usize - base;
        assert!(
            start + field.len() <= data.len(),
            "field outside the datagram"
        );
        start
    };
    assert_eq!(long.bytes(), data);
    assert!(long.dcid().len() <= 20);
    assert_eq!(at(long.dcid()), 6);
    assert_eq!(at(long.scid()), 7 + long.dcid().len());
    if !long.token().is_empty() {
        assert!(at(long.token()) > at(long.scid()) + long.scid().len());
    }
    match (long.packet_number_at(), long.packet_end()) {
        (Some(pn), Some(end)) => {
            assert_eq!(long.version(), 1);
            assert!(pn >= 7 + long.dcid().len() + long.scid().len() + long.token().len());
            assert!(
                pn <= end && end <= data.len(),
                "{pn}..{end} of {}",
                data.len()
            );
        }
        (None, None) => {}
        other => panic!("packet number and end apart: {other:?}"),
    }
    if long.is_v1_initial() {
        assert!(long.starts_connection() && long.scid().len() <= 20);
    }
    // Whatever follows the header, read as varints until they run out.
    let mut r = Reader::new(
        long.bytes()
            .get(long.packet_end().unwrap_or(0)..)
            .unwrap_or(&[]),
    );
    let mut last = r.offset();
    while r.varint().is_some() {
        assert!(r.offset() > last && r.offset() <= data.len());
        last = r.offset();
    }
}
