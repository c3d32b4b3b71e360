//! Two-process stress test over the memfd: this process produces at least 10 million datagrams of
//! mixed lengths carrying sequence numbers and a full-payload pattern; a child process (this test
//! binary re-run in the `stress_consumer` role) consumes and checks them. Nothing may be lost
//! except counted full-ring drops, nothing duplicated, nothing reordered, every payload intact.
//! Bounded by the count and by a watchdog that kills the child.

mod common;

use std::io::{BufRead, BufReader};
use std::time::Duration;

use ringmux_ring::{DatagramMeta, PushError, SpinPolicy};

const TOTAL: u64 = 10_000_000;
const END_MARK: u64 = u64::MAX;

fn len_for(seq: u64) -> usize {
    // 16..=1500 bytes, spread over the range.
    16 + (seq.wrapping_mul(2_654_435_761) % 1485) as usize
}

/// seq in bytes 0..8, then 8-byte words derived from seq.
fn fill(seq: u64, buf: &mut [u8]) {
    buf[..8].copy_from_slice(&seq.to_le_bytes());
    let word = seq.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0x5555_5555_5555_5555;
    let mut chunks = buf[8..].chunks_exact_mut(8);
    for (i, c) in (&mut chunks).enumerate() {
        c.copy_from_slice(&(word ^ i as u64).to_le_bytes());
    }
    let rem = chunks.into_remainder();
    let n = rem.len();
    rem.copy_from_slice(&word.to_le_bytes()[..n]);
}

fn meta(seq: u64) -> DatagramMeta {
    DatagramMeta {
        remote: "127.0.0.1:4433".parse().unwrap(),
        local_ip: None,
        ecn: 0,
        segment_size: 0,
        rx_timestamp_ns: seq,
    }
}

#[test]
fn ten_million_datagrams_across_processes() {
    let (mut p, consumer_here) = common::pair(4096, 50);
    drop(consumer_here); // the consumer lives in the child
    let mut child = common::spawn_child("stress_consumer", &p, &[]);
    let stdout = child.stdout.take().unwrap();

    let mut buf = vec![0u8; 1500];
    let mut dropped = 0u64;
    for seq in 0..TOTAL {
        let len = len_for(seq);
        fill(seq, &mut buf[..len]);
        match p.try_push(&meta(seq), &buf[..len]) {
            Ok(()) => {}
            Err(PushError::Full) => dropped += 1,
            Err(e) => panic!("push {seq}: {e}"),
        }
        if seq % 32 == 31 {
            p.publish();
        }
    }
    // The end marker must get through: retry while full, bounded by the watchdog below.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        match p.try_push(&meta(END_MARK), &dropped.to_le_bytes()) {
            Ok(()) => break,
            Err(PushError::Full) => {
                p.publish();
                assert!(
                    std::time::Instant::now() < deadline,
                    "consumer stopped draining"
                );
                std::thread::yield_now();
            }
            Err(e) => panic!("end mark: {e}"),
        }
    }
    p.publish();

    let status = common::wait_with_watchdog(&mut child, Duration::from_secs(240));
    let report: Vec<String> = BufReader::new(stdout)
        .lines()
        .map_while(Result::ok)
        .collect();
    assert!(status.success(), "consumer failed: {status:?} {report:?}");
    // libtest may print "test stress_consumer ... " on the same line, so look inside lines.
    let line = report
        .iter()
        .find_map(|l| l.find("RESULT ").map(|i| &l[i..]))
        .expect("consumer printed no RESULT line");
    let field = |k: &str| -> u64 {
        line.split_whitespace()
            .find_map(|kv| kv.strip_prefix(&format!("{k}=")))
            .unwrap_or_else(|| panic!("no {k} in {line}"))
            .parse()
            .unwrap()
    };
    let (received, gaps, bad, next) = (
        field("received"),
        field("gaps"),
        field("bad"),
        field("next"),
    );
    assert_eq!(bad, 0, "{line}");
    assert_eq!(
        received + dropped,
        TOTAL,
        "{line}, producer dropped {dropped}"
    );
    // Missing numbers: holes before the last one received, plus any dropped after it.
    let missing = gaps + (TOTAL - next);
    assert_eq!(
        missing, dropped,
        "every missing sequence number is a counted drop: {line}"
    );
    assert!(
        received >= TOTAL / 10,
        "too little was delivered to mean anything: {line}"
    );
    eprintln!("stress: {line} dropped={dropped}");
}

/// The child's role: drain, check order and contents, report.
#[test]
#[ignore = "child-process role: run by common::spawn_child, not on its own"]
fn stress_consumer() {
    if common::child_role().as_deref() != Some("stress_consumer") {
        return;
    }
    let mut c = common::child_attach(SpinPolicy::Adaptive {
        max: Duration::from_micros(50),
    });
    let mut expect = vec![0u8; 1500];
    let mut got = vec![0u8; 1500];
    let (mut next, mut received, mut gaps, mut bad) = (0u64, 0u64, 0u64, 0u64);
    let mut done = false;
    let mut idle_waits = 0;
    while !done {
        let d = c
            .drain(64, |dg| {
                let seq = dg.meta.rx_timestamp_ns;
                if seq == END_MARK {
                    done = true;
                    return;
                }
                if seq < next {
                    bad += 1; // duplicate or reordered
                    return;
                }
                gaps += seq - next;
                next = seq + 1;
                received += 1;
                let len = len_for(seq);
                fill(seq, &mut expect[..len]);
                let n = dg.copy_to(&mut got);
                if n != len || got[..n] != expect[..len] {
                    bad += 1;
                }
            })
            .expect("producer violation");
        bad += d.invalid as u64;
        if d.slots == 0 && !done {
            // Bounded: a producer that vanished leaves us waiting at most ~10 s.
            if !c.wait(Some(Duration::from_millis(100))).expect("wait") {
                idle_waits += 1;
                assert!(idle_waits < 100, "no data for 10 s");
            } else {
                idle_waits = 0;
            }
        }
    }
    println!("\nRESULT received={received} gaps={gaps} bad={bad} next={next}");
}
