//! The producer's word that its next publish is near (`TailLine::busy`, shm-layout.md): it holds
//! a consumer's spin past its budget, for at most `BUSY_SPIN`, and a producer adopted by a new
//! process image of the demux does not leave a stale word standing.

mod common;

use std::time::Duration;

use ringmux_ring::spin::BUSY_SPIN;
use ringmux_ring::{Producer, ProducerFds, RingConfig};

const US: Duration = Duration::from_micros(1);

#[test]
fn the_word_holds_a_spin_that_has_no_budget() {
    let (mut p, mut c) = common::pair(16, 0);
    assert!(!c.spins_on(US), "a consumer with no budget sleeps at once");
    p.hint_busy(true);
    assert!(c.spins_on(US), "the producer says its next batch is near");
    assert!(!c.spins_on(BUSY_SPIN), "for at most BUSY_SPIN");
    p.hint_busy(false);
    assert!(!c.spins_on(US), "the word withdrawn: sleep");
}

#[test]
fn an_adopted_producer_restates_the_word() {
    let cfg = RingConfig {
        slots: 16,
        slot_bytes: 2048,
    };
    let mut p = Producer::create(&cfg).unwrap();
    let mut c = common::attach(&p, common::NO_SPIN);
    p.hint_busy(true);
    let (state, [region, page, rx, tx]) = p.export();
    let fds = ProducerFds {
        region: common::dup(region),
        page: common::dup(page),
        doorbell_rx: common::dup(rx),
        doorbell_tx: common::dup(tx),
    };
    drop(p);
    let mut q = Producer::adopt(&cfg, fds, state).unwrap();
    assert!(c.spins_on(US), "the old image's word still stands");
    q.hint_busy(false);
    assert!(
        !c.spins_on(US),
        "the new image's first hint is stored even though it never said busy"
    );
}
