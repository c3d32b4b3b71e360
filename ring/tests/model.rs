//! Model test: random sequences of push / publish / drain / sleep / wake on a real memfd ring
//! (producer and consumer in one process), checked step by step against a `VecDeque` oracle,
//! including the doorbell promise: exactly one ring per announced sleep that new data ends, none
//! while the consumer is awake.

mod common;

use std::collections::VecDeque;
use std::os::fd::AsRawFd;

use proptest::prelude::*;
use ringmux_ring::{DatagramMeta, PushError};

#[derive(Clone, Debug)]
enum Op {
    Push(usize),
    Publish,
    Drain(usize),
    Sleep,
    Wake,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0usize..2100).prop_map(Op::Push),
        2 => Just(Op::Publish),
        2 => (1usize..12).prop_map(Op::Drain),
        1 => Just(Op::Sleep),
        1 => Just(Op::Wake),
    ]
}

fn meta(seq: u64) -> DatagramMeta {
    DatagramMeta {
        remote: "127.0.0.1:9".parse().unwrap(),
        local_ip: None,
        ecn: (seq % 4) as u8,
        segment_size: 0,
        rx_timestamp_ns: seq,
    }
}

fn payload(seq: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (seq as usize).wrapping_mul(31).wrapping_add(i) as u8)
        .collect()
}

fn doorbell_pending(fd: i32) -> bool {
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    // SAFETY: the consumer that owns `fd` outlives this call.
    let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
    let mut p = [PollFd::new(fd, PollFlags::POLLIN)];
    poll(&mut p, PollTimeout::ZERO) == Ok(1)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]
    #[test]
    fn ring_matches_oracle(slots_log in 2u32..5, ops in proptest::collection::vec(op(), 1..300)) {
        let slots = 1u32 << slots_log;
        let (mut p, mut c) = common::pair(slots, 0);
        let cap = p.payload_capacity();
        let bell_fd = c.doorbell_fd().as_raw_fd();
        let mut pending: VecDeque<(u64, usize)> = VecDeque::new();
        let mut visible: VecDeque<(u64, usize)> = VecDeque::new();
        let mut seq = 0u64;
        let (mut sleeping, mut rung) = (false, false);
        let mut expected_doorbells = 0u64;

        // What a publish of `pending` does in the oracle.
        let publish = |pending: &mut VecDeque<(u64, usize)>, visible: &mut VecDeque<(u64, usize)>,
                       sleeping: bool, rung: &mut bool, expected: &mut u64| {
            if !pending.is_empty() {
                visible.extend(pending.drain(..));
                if sleeping && !*rung { *rung = true; *expected += 1; }
            }
        };

        for op in ops {
            match op {
                Op::Push(len) => {
                    let r = p.try_push(&meta(seq), &payload(seq, len));
                    if len == 0 {
                        prop_assert_eq!(r, Err(PushError::Empty));
                    } else if len > cap {
                        prop_assert_eq!(r, Err(PushError::Oversize { len, capacity: cap }));
                    } else if pending.len() + visible.len() >= slots as usize {
                        prop_assert_eq!(r, Err(PushError::Full));
                    } else {
                        prop_assert_eq!(r, Ok(()));
                        pending.push_back((seq, len));
                        if pending.len() >= (slots / 4) as usize {
                            publish(&mut pending, &mut visible, sleeping, &mut rung, &mut expected_doorbells);
                        }
                    }
                    seq += 1;
                }
                Op::Publish => {
                    let had = !pending.is_empty();
                    let before = expected_doorbells;
                    publish(&mut pending, &mut visible, sleeping, &mut rung, &mut expected_doorbells);
                    let rang = p.publish();
                    prop_assert_eq!(rang, had && expected_doorbells > before);
                }
                Op::Drain(max) => {
                    let mut got = Vec::new();
                    let d = c.drain(max, |dg| got.push((dg.meta.rx_timestamp_ns, dg.to_vec(), dg.meta.ecn))).unwrap();
                    let n = max.min(visible.len());
                    prop_assert_eq!(d.slots, n);
                    prop_assert_eq!(d.invalid, 0);
                    for (s, body, ecn) in got {
                        let (es, elen) = visible.pop_front().unwrap();
                        prop_assert_eq!(s, es);
                        prop_assert_eq!(ecn, (es % 4) as u8);
                        prop_assert_eq!(body, payload(es, elen));
                    }
                }
                Op::Sleep => {
                    if !sleeping {
                        // Announcing a sleep first takes what earlier sleeps left rung.
                        let slept = c.prepare_sleep().unwrap();
                        prop_assert!(!doorbell_pending(bell_fd));
                        prop_assert_eq!(slept, visible.is_empty());
                        if slept { sleeping = true; rung = false; }
                    }
                }
                Op::Wake => {
                    if sleeping {
                        prop_assert_eq!(doorbell_pending(bell_fd), rung);
                        c.end_sleep();
                        sleeping = false;
                        // Waking reads nothing: the ring stays until the next announcement.
                        prop_assert_eq!(doorbell_pending(bell_fd), rung);
                    }
                }
            }
            prop_assert_eq!(p.stats().doorbells, expected_doorbells);
        }
    }
}
