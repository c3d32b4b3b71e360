//! Replays the consumer fuzz corpus (`ring/fuzz/corpus/consumer/`) through the fuzz harness, and
//! checks that hand-made hostile inputs are survived: a crash the fuzzer found stays fixed.

use ringmux_ring::fuzzing::consume_arbitrary;

#[test]
fn corpus_replays_without_panic() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/fuzz/corpus/consumer");
    let mut n = 0;
    for entry in std::fs::read_dir(dir).expect("corpus directory") {
        let data = std::fs::read(entry.unwrap().path()).unwrap();
        consume_arbitrary(&data);
        n += 1;
    }
    assert!(n >= 5, "corpus has only {n} inputs");
}

/// A valid header whose tail claims two published slots with descriptors that lie.
fn crafted(tail: u64, descs: &[(u32, u32, u8)]) -> Vec<u8> {
    let mut d = vec![1u8]; // valid-header mode, generation 0
    d.extend_from_slice(&[0u8; 128]); // consumer page: head 0
    let mut region = vec![0u8; 4096 + 4 * 1280];
    region[128..136].copy_from_slice(&tail.to_le_bytes());
    for (i, (len, seg, family)) in descs.iter().enumerate() {
        let off = 4096 + i * 1280;
        region[off..off + 4].copy_from_slice(&len.to_le_bytes());
        region[off + 4..off + 8].copy_from_slice(&seg.to_le_bytes());
        region[off + 8] = *family;
    }
    d.extend_from_slice(&region);
    d
}

#[test]
fn hostile_ring_contents_are_refused_or_skipped() {
    // Valid descriptors are handed out.
    assert_eq!(
        consume_arbitrary(&crafted(2, &[(10, 10, 4), (1216, 1216, 6)])),
        2
    );
    // A length beyond the slot, a zero segment, a bad family: skipped, nothing handed out.
    assert_eq!(
        consume_arbitrary(&crafted(3, &[(u32::MAX, 1, 4), (10, 0, 4), (10, 10, 9)])),
        0
    );
    // A tail beyond the capacity or far ahead: a violation, nothing handed out.
    assert_eq!(consume_arbitrary(&crafted(5, &[(10, 10, 4)])), 0);
    assert_eq!(consume_arbitrary(&crafted(u64::MAX, &[(10, 10, 4)])), 0);
    // Garbage and truncation never get past attach.
    assert_eq!(consume_arbitrary(&[0u8; 3]), 0);
    assert_eq!(consume_arbitrary(&[]), 0);
}

#[test]
#[ignore = "regenerates the seed corpus: cargo test -p ringmux-ring --test fuzz_corpus -- --ignored"]
fn write_seed_corpus() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/fuzz/corpus/consumer");
    std::fs::create_dir_all(dir).unwrap();
    let seeds: Vec<(&str, Vec<u8>)> = vec![
        ("valid-two", crafted(2, &[(10, 10, 4), (1216, 1216, 6)])),
        (
            "lying-descriptors",
            crafted(3, &[(u32::MAX, 1, 4), (10, 0, 4), (10, 10, 9)]),
        ),
        ("tail-too-far", crafted(5, &[(10, 10, 4)])),
        ("tail-max", crafted(u64::MAX, &[])),
        ("garbage-header", vec![0x55; 4096 + 200]),
        ("tiny", vec![0, 1, 2]),
    ];
    for (name, data) in seeds {
        std::fs::write(format!("{dir}/{name}"), data).unwrap();
    }
}
