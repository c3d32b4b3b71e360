//! Replays the router fuzz corpus (`fuzz/corpus/router/`, seeds plus anything the fuzzer kept)
//! through the shared harness, and checks the decisions the named seeds were written for.
//!
//! `cargo test -p ringmux-quic-lb --test fuzz_corpus -- --ignored write_seed_corpus` rewrites
//! the seed files (deterministic: fixed keys and nonces).

#[path = "support/router_harness.rs"]
mod harness;

use std::path::PathBuf;

use ringmux_quic_lb::{ConnectionIdGenerator, MalformedReason, Route};

fn corpus_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/router")
}

/// A CID of `case` for `instance` with a fixed nonce.
fn cid(case: usize, instance: u8, nonce_byte: u8) -> Vec<u8> {
    let c = &harness::cases()[case];
    let mut sid = c.config.node_id.clone();
    sid.push(instance);
    let nonce = vec![nonce_byte; usize::from(c.config.nonce_len)];
    c.router.codec().encode(&sid, &nonce).unwrap().to_vec()
}

fn short(first: u8, cid: &[u8], payload: usize) -> Vec<u8> {
    let mut d = vec![first];
    d.extend_from_slice(cid);
    d.extend((0..payload).map(|i| (i * 7 + 3) as u8));
    d
}

/// v1 long header: `first`, version, DCID, SCID, then `type_fields` and `payload` bytes.
fn long(first: u8, version: u32, dcid: &[u8], type_fields: &[u8], payload: usize) -> Vec<u8> {
    let mut d = vec![first];
    d.extend_from_slice(&version.to_be_bytes());
    d.push(dcid.len() as u8);
    d.extend_from_slice(dcid);
    let scid = [0x5c, 0x1d, 0x00, 0x42, 0x99, 0x17, 0xee, 0x01];
    d.push(scid.len() as u8);
    d.extend_from_slice(&scid);
    d.extend_from_slice(type_fields);
    d.extend((0..payload).map(|i| (i * 13 + 1) as u8));
    d
}

fn varint2(v: usize) -> [u8; 2] {
    [0x40 | (v >> 8) as u8, v as u8]
}

const CLIENT_DCID: [u8; 18] = [
    0x83, 0x94, 0xc8, 0xf0, 0x3e, 0x51, 0x57, 0x08, 0x2a, 0x6b, 0x0c, 0x11, 0x9e, 0x55, 0x21, 0x7d,
    0x40, 0x03,
];

/// The seed files and the decision each must get from case 0 (single pass, 4 instances);
/// `None` means "Hashed, any instance".
fn seeds() -> Vec<(&'static str, Vec<u8>, Option<Route>)> {
    use MalformedReason::*;
    let own = cid(0, 2, 0x11);
    let mut initial_fields = vec![0x00]; // token length 0
    initial_fields.extend_from_slice(&varint2(1162));
    let mut token_fields = vec![0x05, 0x74, 0x6f, 0x6b, 0x65, 0x6e]; // token "token"
    token_fields.extend_from_slice(&varint2(1150));
    let mut coalesced = long(0xe1, 1, &own, &varint2(40), 40);
    coalesced.extend(
        long(0xc1, 1, &own, &initial_fields, 1162)
            .into_iter()
            .take(300),
    );
    vec![
        (
            "short-single-pass-owned",
            short(0x43, &own, 40),
            Some(Route::Owned(2)),
        ),
        (
            "short-fixed-bit-greased",
            short(0x03, &cid(0, 3, 0x22), 40),
            Some(Route::Owned(3)),
        ),
        ("short-four-pass", short(0x41, &cid(1, 5, 0x33), 30), None),
        ("short-plaintext", short(0x41, &cid(2, 1, 0x44), 30), None),
        (
            "initial-client-dcid-1200",
            long(0xc3, 1, &CLIENT_DCID, &initial_fields, 1162),
            None,
        ),
        (
            "initial-after-retry-owned",
            long(0xc0, 1, &own, &initial_fields, 1162),
            Some(Route::Owned(2)),
        ),
        (
            "handshake-owned",
            long(0xe1, 1, &own, &varint2(60), 60),
            Some(Route::Owned(2)),
        ),
        (
            "zero-rtt-client-dcid",
            long(0xd1, 1, &CLIENT_DCID, &varint2(80), 80),
            None,
        ),
        (
            "coalesced-handshake-initial",
            coalesced,
            Some(Route::Owned(2)),
        ),
        (
            "initial-with-token",
            long(0xc2, 1, &CLIENT_DCID, &token_fields, 1150),
            None,
        ),
        (
            "v2-initial",
            long(0xd3, 0x6b33_43cf, &CLIENT_DCID, &initial_fields, 1162),
            None,
        ),
        (
            "retry",
            long(0xf0, 1, &CLIENT_DCID, &[0x74, 0x6f, 0x6b], 16),
            None,
        ),
        (
            "version-negotiation",
            long(0x80, 0, &CLIENT_DCID, &[0, 0, 0, 1], 0),
            None,
        ),
        (
            "unknown-version",
            long(0xc0, 0x1a2a_3a4a, &CLIENT_DCID, &[], 50),
            None,
        ),
        (
            "short-truncated",
            short(0x40, &own[..10], 0),
            Some(Route::Malformed(ShortHeaderTruncated)),
        ),
        (
            "long-truncated-in-dcid",
            long(0xc0, 1, &CLIENT_DCID, &[], 0)[..12].to_vec(),
            Some(Route::Malformed(LongHeaderTruncated)),
        ),
        (
            "initial-length-past-end",
            long(0xc0, 1, &CLIENT_DCID, &initial_fields, 1000),
            Some(Route::Malformed(LongHeaderTruncated)),
        ),
        (
            "dcid-too-long",
            [&[0xc0, 0, 0, 0, 1, 21][..], &[0x77; 40]].concat(),
            Some(Route::Malformed(DcidTooLong)),
        ),
        (
            "scid-too-long",
            [
                &[0xc0, 0, 0, 0, 1, 18][..],
                &CLIENT_DCID,
                &[21],
                &[0x55; 21],
                &initial_fields,
                &[0; 1162],
            ]
            .concat(),
            Some(Route::Malformed(ScidTooLong)),
        ),
        ("empty", Vec::new(), Some(Route::Malformed(Empty))),
    ]
}

#[test]
fn replay_fuzz_corpus() {
    let dir = corpus_dir();
    let mut files = 0;
    for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.unwrap().path();
        if path.is_file() {
            let data = std::fs::read(&path).unwrap();
            harness::exercise(&data);
            files += 1;
        }
    }
    assert!(
        files >= 12,
        "only {files} corpus files in {}",
        dir.display()
    );
}

#[test]
fn seeds_route_as_named() {
    let router = &harness::cases()[0].router;
    for (name, data, expected) in seeds() {
        let on_disk = std::fs::read(corpus_dir().join(name))
            .unwrap_or_else(|e| panic!("seed {name}: {e} (run write_seed_corpus)"));
        assert_eq!(on_disk, data, "seed {name} differs from its generator");
        let route = router.route(&data);
        match expected {
            Some(want) => assert_eq!(route, want, "seed {name}"),
            None => assert!(matches!(route, Route::Hashed(_)), "seed {name}: {route:?}"),
        }
    }
    // The four-pass and plaintext seeds are owned in their own configurations.
    let four = &harness::cases()[1];
    assert_eq!(
        four.router.route(&short(0x41, &cid(1, 5, 0x33), 30)),
        Route::Owned(5)
    );
    let plain = &harness::cases()[2];
    assert_eq!(
        plain.router.route(&short(0x41, &cid(2, 1, 0x44), 30)),
        Route::Owned(1)
    );
}

#[test]
fn generated_cids_replay_through_the_harness() {
    // A few live generator CIDs, in short and long headers, through the same invariants.
    for case in harness::cases() {
        let mut generator =
            ringmux_quic_lb::CidGenerator::new(&case.config, case.config.instance_count - 1, None)
                .unwrap();
        for _ in 0..8 {
            let cid = generator.generate_cid();
            assert!(generator.validate(&cid).is_ok());
            let datagram = short(0x40, &cid, 24);
            harness::exercise(&datagram);
            assert_eq!(
                case.router.route(&datagram),
                Route::Owned(case.config.instance_count - 1),
                "{}",
                case.name
            );
        }
    }
}

#[test]
#[ignore = "writes fuzz/corpus/router/; run by hand after changing the seeds"]
fn write_seed_corpus() {
    let dir = corpus_dir();
    std::fs::create_dir_all(&dir).unwrap();
    for (name, data, _) in seeds() {
        std::fs::write(dir.join(name), data).unwrap();
    }
}
