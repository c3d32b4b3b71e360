//! Property tests of the codec, the generator and the router: round trips for every legal
//! configuration, no CID collisions across instances, and a stable, even hash route.

use std::collections::HashSet;

use proptest::prelude::*;
use ringmux_quic_lb::{
    CidCodec, CidGenerator, ConnectionIdGenerator, KeySet, Mode, QuicLbConfig, Route, Router,
    MAX_NODE_ID_LEN, MAX_PLAINTEXT_LEN, MIN_NONCE_LEN,
};

/// Deterministic test bytes (splitmix64), so statistical tests never flake.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn fill(&mut self, buf: &mut [u8]) {
        for b in buf {
            *b = self.next() as u8;
        }
    }
}

fn short_header(cid: &[u8]) -> Vec<u8> {
    let mut d = vec![0x40];
    d.extend_from_slice(cid);
    d.extend_from_slice(&[0; 21]);
    d
}

fn client_initial(dcid: &[u8]) -> Vec<u8> {
    let mut d = vec![0xc0, 0, 0, 0, 1, dcid.len() as u8];
    d.extend_from_slice(dcid);
    d.extend_from_slice(&[0, 0, 0x40, 0x10]);
    d.extend_from_slice(&[0; 16]);
    d
}

/// Every legal (node-ID length, nonce length) × (plaintext, encrypted) — encrypted is
/// single-pass exactly when server ID + nonce = 16 — through generator, router and an external
/// load balancer's view.
#[test]
fn every_legal_layout_round_trips() {
    let mut rng = Rng(1);
    let mut seen_modes = HashSet::new();
    for node_len in 1..=MAX_NODE_ID_LEN {
        for nonce_len in MIN_NONCE_LEN..=MAX_PLAINTEXT_LEN - node_len - 1 {
            for key in [None, Some([0x5a; 16])] {
                let mut node_id = vec![0; node_len];
                rng.fill(&mut node_id);
                let config = QuicLbConfig {
                    config_id: (node_len % 7) as u8,
                    node_id: node_id.clone(),
                    instance_count: 64,
                    nonce_len: nonce_len as u8,
                    key,
                };
                config.validate().unwrap();
                seen_modes.insert(config.mode());
                let router = Router::new(&config, [3; 16]).unwrap();
                // What an external QUIC-LB load balancer configured with the node-ID length sees.
                let external =
                    CidCodec::new(config.config_id, node_len, nonce_len + 1, key).unwrap();
                assert_eq!(external.mode(), config.mode());
                for instance in [0u8, 1, 33, 63] {
                    let mut generator = CidGenerator::new(&config, instance, None).unwrap();
                    for _ in 0..4 {
                        let cid = generator.generate_cid();
                        assert_eq!(cid.len(), config.cid_len());
                        assert_eq!(
                            cid[0],
                            (config.config_id << 5) | (config.cid_len() - 1) as u8
                        );
                        assert_eq!(router.route(&short_header(&cid)), Route::Owned(instance));
                        assert_eq!(router.route(&client_initial(&cid)), Route::Owned(instance));
                        assert_eq!(&*external.decode_server_id(&cid).unwrap(), &node_id[..]);
                        let pt = router.codec().decode(&cid).unwrap();
                        assert_eq!(pt.server_id(), [&node_id[..], &[instance]].concat());
                        assert!(generator.validate(&cid).is_ok());
                    }
                }
            }
        }
    }
    assert_eq!(seen_modes.len(), 3, "{seen_modes:?}");
}

fn legal_config() -> impl Strategy<Value = (QuicLbConfig, u8)> {
    (1..=MAX_NODE_ID_LEN)
        .prop_flat_map(|node_len| {
            (
                0u8..=6,
                proptest::collection::vec(any::<u8>(), node_len),
                MIN_NONCE_LEN..=MAX_PLAINTEXT_LEN - node_len - 1,
                proptest::option::of(any::<[u8; 16]>()),
                1u8..=64,
            )
        })
        .prop_flat_map(|(config_id, node_id, nonce_len, key, count)| {
            let config = QuicLbConfig {
                config_id,
                node_id,
                instance_count: count,
                nonce_len: nonce_len as u8,
                key,
            };
            (Just(config), 0..count)
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Encode then decode returns the same server ID and nonce, for any legal layout, key and
    /// nonce value.
    #[test]
    fn codec_round_trip((config, instance) in legal_config(), nonce_seed in any::<u64>()) {
        let codec = CidCodec::new(
            config.config_id, config.server_id_len(), usize::from(config.nonce_len), config.key,
        ).unwrap();
        let sid = [&config.node_id[..], &[instance]].concat();
        let mut nonce = vec![0; usize::from(config.nonce_len)];
        Rng(nonce_seed).fill(&mut nonce);
        let cid = codec.encode(&sid, &nonce).unwrap();
        let pt = codec.decode(&cid).unwrap();
        prop_assert_eq!(pt.server_id(), &sid[..]);
        prop_assert_eq!(pt.nonce(), &nonce[..]);
        prop_assert_eq!(&*codec.decode_server_id(&cid).unwrap(), &sid[..]);
        if config.mode() != Mode::Plaintext {
            // Encryption must actually hide the plaintext.
            prop_assert_ne!(&cid[1..], &[&sid[..], &nonce[..]].concat()[..]);
        }
    }

    /// Generator → router gives the generator's instance, in short and long headers.
    #[test]
    fn generator_router_round_trip((config, instance) in legal_config()) {
        let router = Router::new(&config, [9; 16]).unwrap();
        let mut generator = CidGenerator::new(&config, instance, None).unwrap();
        let cid = generator.generate_cid();
        prop_assert_eq!(router.route(&short_header(&cid)), Route::Owned(instance));
        prop_assert_eq!(router.route(&client_initial(&cid)), Route::Owned(instance));
    }

    /// Any bytes get a total decision with an instance in range.
    #[test]
    fn route_is_total(data in proptest::collection::vec(any::<u8>(), 0..64), count in 1u8..=64) {
        let mut config = QuicLbConfig::default_with_key([1; 16]);
        config.instance_count = count;
        let router = Router::new(&config, [2; 16]).unwrap();
        let route = router.route(&data);
        prop_assert_eq!(route, router.route(&data));
        match route {
            Route::Owned(lane) => prop_assert!(usize::from(lane) < router.lanes()),
            Route::Hashed(i) => prop_assert!(i < count),
            Route::Malformed(_) => {}
        }
    }
}

/// CIDs of different instances never collide, even with the shortest nonce (4 octets) where
/// counters started at random points are most likely to overlap, and in every mode.
#[test]
fn instances_never_collide() {
    for (key, nonce_len) in [(Some([7; 16]), 4u8), (Some([7; 16]), 14), (None, 4)] {
        let config = QuicLbConfig {
            config_id: 0,
            node_id: vec![0],
            instance_count: 16,
            nonce_len,
            key,
        };
        let mut seen = HashSet::new();
        for instance in 0..16 {
            let mut generator = CidGenerator::new(&config, instance, None).unwrap();
            for _ in 0..12_500 {
                let cid = generator.generate_cid();
                assert!(
                    seen.insert(cid),
                    "collision: mode {:?} nonce {nonce_len}",
                    config.mode()
                );
            }
        }
        assert_eq!(seen.len(), 200_000);
    }
}

/// The codec is a permutation: distinct nonces under one server ID give distinct CIDs (what makes
/// a never-repeating counter sufficient), here with a 4-octet nonce in four-pass mode.
#[test]
fn distinct_nonces_give_distinct_cids() {
    let codec = CidCodec::new(0, 2, 4, Some([1; 16])).unwrap();
    let mut seen = HashSet::new();
    for n in 0u32..100_000 {
        assert!(seen.insert(codec.encode(&[0, 1], &n.to_be_bytes()).unwrap()));
    }
}

/// The hash route of client-chosen DCIDs is stable (two routers with the same key agree, and
/// agree with themselves) and even: chi-square over 100k DCIDs below the 99.9% critical value,
/// and max/min bin within 15% (up to 16 instances). Fixed key and DCIDs: deterministic.
#[test]
fn hash_route_is_stable_and_even() {
    let key = *b"routing-hash-key";
    for (count, critical) in [(4u8, 16.27), (7, 22.46), (16, 37.70), (64, 103.44)] {
        let mut config = QuicLbConfig::default_with_key([1; 16]);
        config.instance_count = count;
        let a = Router::new(&config, key).unwrap();
        let b = Router::new(&config, key).unwrap();
        let mut bins = vec![0u64; usize::from(count)];
        let mut rng = Rng(u64::from(count));
        let samples = 100_000u64;
        for _ in 0..samples {
            let mut dcid = [0u8; 18];
            rng.fill(&mut dcid);
            let datagram = client_initial(&dcid);
            let route = a.route(&datagram);
            assert_eq!(route, b.route(&datagram));
            assert_eq!(route, a.route(&datagram));
            let Route::Hashed(i) = route else {
                panic!("client DCID routed {route:?}")
            };
            bins[usize::from(i)] += 1;
        }
        let expected = samples as f64 / f64::from(count);
        let chi2: f64 = bins
            .iter()
            .map(|&o| (o as f64 - expected).powi(2) / expected)
            .sum();
        let (min, max) = (*bins.iter().min().unwrap(), *bins.iter().max().unwrap());
        eprintln!("{count} instances: chi2 {chi2:.1} (critical {critical}), min {min} max {max}");
        assert!(
            chi2 < critical,
            "count {count}: chi2 {chi2:.1} >= {critical}: {bins:?}"
        );
        if count <= 16 {
            assert!(max as f64 / min as f64 <= 1.15, "count {count}: {bins:?}");
        }
    }
}

/// The hash key matters: another key sends a good share of DCIDs elsewhere.
#[test]
fn hash_route_depends_on_key() {
    let mut config = QuicLbConfig::default_with_key([1; 16]);
    config.instance_count = 8;
    let a = Router::new(&config, [1; 16]).unwrap();
    let b = Router::new(&config, [2; 16]).unwrap();
    let mut rng = Rng(5);
    let moved = (0..1000)
        .filter(|_| {
            let mut dcid = [0u8; 20];
            rng.fill(&mut dcid);
            a.route_dcid(&dcid) != b.route_dcid(&dcid)
        })
        .count();
    assert!(moved > 800, "{moved}");
}

/// Boxes behind one load balancer share a key file and differ in node ID: each box owns its
/// CIDs, hashes the other's, and the external load balancer decodes the right node.
#[test]
fn same_key_file_on_several_boxes() {
    let keys = KeySet::parse(
        std::path::Path::new("shared"),
        &KeySet::generate().unwrap().to_key_file(),
    )
    .unwrap();
    let config_for = |node: u8| QuicLbConfig {
        config_id: 3,
        node_id: vec![0xbb, node],
        instance_count: 6,
        nonce_len: 8,
        key: Some(keys.quic_lb),
    };
    let (box_a, box_b) = (config_for(1), config_for(2));
    let router_a = Router::new(&box_a, keys.routing_hash).unwrap();
    let router_b = Router::new(&box_b, keys.routing_hash).unwrap();
    let external = CidCodec::new(3, 2, 9, Some(keys.quic_lb)).unwrap();
    let cid_a = CidGenerator::new(&box_a, 4, None).unwrap().generate_cid();
    let cid_b = CidGenerator::new(&box_b, 5, None).unwrap().generate_cid();
    assert_eq!(router_a.route_dcid(&cid_a), Route::Owned(4));
    assert_eq!(router_b.route_dcid(&cid_b), Route::Owned(5));
    assert!(matches!(router_a.route_dcid(&cid_b), Route::Hashed(_)));
    assert!(matches!(router_b.route_dcid(&cid_a), Route::Hashed(_)));
    assert_eq!(&*external.decode_server_id(&cid_a).unwrap(), &[0xbb, 1]);
    assert_eq!(&*external.decode_server_id(&cid_b).unwrap(), &[0xbb, 2]);
}
