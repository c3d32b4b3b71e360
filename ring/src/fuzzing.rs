//! Arbitrary bytes as a ring's shared memory, for the `consumer` fuzz target
//! (`ring/fuzz/fuzz_targets/consumer.rs`) and its corpus replay (`tests/fuzz_corpus.rs`).
//! Not part of the stable API.
//!
//! Input layout: byte 0 selects the mode; bit 0 set means "write a valid header first" (so the
//! fuzzer reaches the drain path instead of stopping at attach), bits 1–7 pick the expected
//! generation. The next 128 bytes become the consumer page's first line, the rest the producer
//! region (padded or cut to the geometry the header declares when bit 0 is set).

use std::io::Write;
use std::os::fd::OwnedFd;
use std::time::Duration;

use crate::layout::{LAYOUT_VERSION, MAGIC, SLOTS_OFFSET};
use nix::fcntl::SealFlag;

use crate::shm::{add_seals, memfd, BASE_SEALS, REGION_SEALS};
use crate::{Consumer, SpinPolicy};

/// The fuzzed consumer never spins.
const NO_SPIN: SpinPolicy = SpinPolicy::Adaptive {
    max: Duration::ZERO,
};

/// Geometry of the "valid header" mode: the smallest legal ring.
const SLOTS: u32 = 4;
const SLOT_BYTES: u32 = 1280;

/// Attaches to and drains a ring made of `data`. Must never panic, hang or read out of bounds;
/// returns how many datagrams were handed out (for the replay test's curiosity).
pub fn consume_arbitrary(data: &[u8]) -> usize {
    let Some((&mode, rest)) = data.split_first() else {
        return 0;
    };
    let (page_bytes, region_bytes) = rest.split_at(rest.len().min(128));
    let generation = u64::from(mode >> 1);
    let mut region = region_bytes.to_vec();
    if mode & 1 == 1 {
        let len = (SLOTS_OFFSET + SLOTS * SLOT_BYTES) as usize;
        region.resize(len.max(region.len()).min(len), 0);
        let put = |r: &mut Vec<u8>, off: usize, b: &[u8]| r[off..off + b.len()].copy_from_slice(b);
        put(&mut region, 0, &MAGIC.to_le_bytes());
        put(&mut region, 8, &LAYOUT_VERSION.to_le_bytes());
        put(&mut region, 12, &0u32.to_le_bytes());
        put(&mut region, 16, &SLOTS.to_le_bytes());
        put(&mut region, 20, &SLOT_BYTES.to_le_bytes());
        put(&mut region, 24, &SLOTS_OFFSET.to_le_bytes());
        put(&mut region, 32, &(len as u64).to_le_bytes());
        put(&mut region, 40, &generation.to_le_bytes());
    }
    let Ok(ring) = sealed(&region, REGION_SEALS) else {
        return 0;
    };
    let mut page = page_bytes.to_vec();
    page.resize(4096, 0);
    let Ok(page) = sealed(&page, BASE_SEALS) else {
        return 0;
    };
    let Ok(bell) = crate::Doorbell::new() else {
        return 0;
    };
    let Ok(bell) = bell.consumer_end().try_clone_to_owned() else {
        return 0;
    };
    let Ok(mut c) = Consumer::attach(ring, page, bell, generation, NO_SPIN) else {
        return 0;
    };
    let mut handed = 0;
    for _ in 0..4 {
        match c.drain(8, |d| {
            // Touch every byte handed out: it must be inside the mapping.
            handed += 1;
            let mut copy = vec![0u8; d.len()];
            d.copy_to(&mut copy);
            std::hint::black_box(copy.iter().fold(0u8, |a, b| a ^ b));
        }) {
            Ok(d) if d.slots > 0 => {}
            _ => break,
        }
    }
    let _ = c.prepare_sleep();
    c.end_sleep();
    handed
}

fn sealed(bytes: &[u8], seals: SealFlag) -> std::io::Result<OwnedFd> {
    let mut f = memfd(c"ringmux-fuzz", 0)?;
    f.write_all(bytes)?;
    add_seals(&f, seals)?;
    Ok(f.into())
}
