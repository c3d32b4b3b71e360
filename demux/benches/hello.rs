//! What reading a new connection's ClientHello for its ticket IDs (`tickets.rs`) costs the
//! data plane, per Initial: one that opens and binds a ticket (a resumption's first flight),
//! one without a ticket (a first visit), and one that does not open with its DCID's keys (a
//! client's later Initials). Each case runs in interleaved rounds; medians with min–max.
//!
//! `cargo bench -p ringmux-demux --bench hello [-- --rounds 7 --count 20000]`

use std::sync::Arc;
use std::time::Instant;

use ringmux_demux::tickets::{HelloInspector, TicketBindings};
use ringmux_testkit::client_initial::{client_hello, crypto_frame, initial_packet};

fn arg(name: &str, default: usize) -> usize {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// `count` Initials of one kind with distinct DCIDs (so no key is reused between them).
fn initials(count: usize, kind: &str) -> Vec<Vec<u8>> {
    (0..count)
        .map(|i| {
            let mut dcid = [0u8; 8];
            dcid[..8].copy_from_slice(&(i as u64).to_be_bytes());
            let ticket = [(i % 251) as u8; 32];
            let (hello, key_dcid) = match kind {
                "resumption" => (client_hello(&[&ticket], 300), dcid),
                "first-visit" => (client_hello(&[], 300), dcid),
                _ => (client_hello(&[], 300), [0xee; 8]),
            };
            initial_packet(&dcid, &key_dcid, &[1; 8], &[], 0, &crypto_frame(0, &hello))
        })
        .collect()
}

fn main() {
    let rounds = arg("--rounds", 7);
    let count = arg("--count", 20_000);
    let kinds = ["resumption", "first-visit", "unopened"];
    let sets: Vec<Vec<Vec<u8>>> = kinds.iter().map(|k| initials(count, k)).collect();
    let mut insp = HelloInspector::new(Arc::new(TicketBindings::new()));
    let mut ns: Vec<Vec<f64>> = vec![Vec::new(); kinds.len()];
    for round in 0..rounds {
        for (k, set) in sets.iter().enumerate() {
            let t = Instant::now();
            for p in set {
                insp.observe(std::hint::black_box(p), (round % 4) as u8, 1_000_000_000);
            }
            ns[k].push(t.elapsed().as_nanos() as f64 / count as f64);
        }
    }
    println!(
        "ClientHello inspection, {} rounds of {count} Initials of {} octets each",
        rounds,
        sets[0][0].len()
    );
    for (k, kind) in kinds.iter().enumerate() {
        let v = &mut ns[k];
        v.sort_by(f64::total_cmp);
        println!(
            "RES hello {kind:<12} ns/Initial median {:>7.0}  (min {:.0}, max {:.0})",
            v[v.len() / 2],
            v[0],
            v[v.len() - 1]
        );
    }
    println!("stats: {:?}", insp.stats());
}
