//! The router fuzz harness, shared by the cargo-fuzz target (`fuzz/fuzz_targets/router.rs`
//! includes this file with `#[path]`) and the corpus replay test (`tests/fuzz_corpus.rs`), so a
//! crash the fuzzer finds replays as a failing `cargo test`.
//!
//! It owns three fixed configurations (single-pass, four-pass, plaintext) and the invariants
//! every routing decision must satisfy. It panics on a violated invariant; that is its job.

#![allow(dead_code)] // each includer uses a different subset

use std::sync::OnceLock;

use ringmux_quic_lb::{
    destination_cid, CidGenerator, ConnectionId, ConnectionIdGenerator, QuicLbConfig, Route, Router,
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
/// - it agrees with [`destination_cid`] + [`Router::route_dcid`];
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
        match destination_cid(data, router.cid_len()) {
            Err(reason) => assert_eq!(route, Route::Malformed(reason), "{}", case.name),
            Ok(dcid) => {
                assert_eq!(route, router.route_dcid(dcid), "{}", case.name);
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
