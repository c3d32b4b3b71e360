//! Cost of `Router::route` per datagram (not a test): short headers with single-pass CIDs,
//! short headers with four-pass CIDs, and client Initials (hash path).
//!
//! Run: `cargo bench -p ringmux-quic-lb`. Each case routes a pool of 4096 distinct datagrams
//! (so the branch predictor cannot learn one CID) over and over; cases run interleaved in
//! rounds, and the report gives the median with min–max of the per-round ns/datagram.
//! Environment: `ROUTE_BENCH_ROUNDS` (default 15), `ROUTE_BENCH_DATAGRAMS` per round and case
//! (default 4,000,000).

use std::hint::black_box;
use std::time::Instant;

use ringmux_quic_lb::{CidGenerator, ConnectionIdGenerator, Mode, QuicLbConfig, Route, Router};

const POOL: usize = 4096;
const INSTANCES: u8 = 8;

struct Case {
    name: &'static str,
    router: Router,
    datagrams: Vec<Vec<u8>>,
    expect_owned: bool,
    ns: Vec<f64>,
}

fn short_header_case(name: &'static str, config: QuicLbConfig) -> Case {
    let router = Router::new(&config, *b"bench-route-hash").expect("valid bench config");
    let mut generators: Vec<_> = (0..INSTANCES)
        .map(|i| CidGenerator::new(&config, i, None).expect("generator"))
        .collect();
    let datagrams = (0..POOL)
        .map(|n| {
            let cid = generators[n % usize::from(INSTANCES)].generate_cid();
            let mut d = vec![0x40 | (n as u8 & 0x1f)];
            d.extend_from_slice(&cid);
            d.resize(1200, 0xa5);
            d
        })
        .collect();
    Case {
        name,
        router,
        datagrams,
        expect_owned: true,
        ns: Vec::new(),
    }
}

fn initial_case() -> Case {
    let mut config = QuicLbConfig::default_with_key(*b"bench-quic-lb-k!");
    config.instance_count = INSTANCES;
    let router = Router::new(&config, *b"bench-route-hash").expect("valid bench config");
    let mut state = 0x1234_5678_9abc_def0u64;
    let datagrams = (0..POOL)
        .map(|_| {
            let mut d = vec![0xc3, 0, 0, 0, 1, 18];
            for _ in 0..18 {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                d.push((state >> 56) as u8);
            }
            d.extend_from_slice(&[8, 1, 2, 3, 4, 5, 6, 7, 8, 0]); // SCID, token length 0
            let payload = 1200 - d.len() - 2;
            d.extend_from_slice(&[0x40 | (payload >> 8) as u8, payload as u8]);
            d.resize(1200, 0);
            d
        })
        .collect();
    Case {
        name: "initial (hash path)",
        router,
        datagrams,
        expect_owned: false,
        ns: Vec::new(),
    }
}

fn run_round(case: &mut Case, datagrams: usize) {
    let router = black_box(&case.router);
    let mut checksum = 0u64;
    let start = Instant::now();
    let mut done = 0;
    while done < datagrams {
        for d in &case.datagrams {
            let route = router.route(black_box(d));
            checksum = checksum.wrapping_add(match route {
                Route::Owned(i) => u64::from(i),
                Route::Hashed(i) => 256 + u64::from(i),
                Route::Malformed(_) => 1 << 20,
            });
        }
        done += case.datagrams.len();
    }
    let elapsed = start.elapsed();
    black_box(checksum);
    case.ns.push(elapsed.as_nanos() as f64 / done as f64);
}

fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.replace(['_', ','], "").parse().ok())
        .unwrap_or(default)
}

fn main() {
    // `cargo test --benches` runs this binary with `--bench` absent: keep that quick.
    let benching = std::env::args().any(|a| a == "--bench");
    let rounds = if benching {
        env("ROUTE_BENCH_ROUNDS", 15)
    } else {
        1
    };
    let per_round = if benching {
        env("ROUTE_BENCH_DATAGRAMS", 4_000_000)
    } else {
        POOL
    };

    let mut single = QuicLbConfig::default_with_key(*b"bench-quic-lb-k!");
    single.instance_count = INSTANCES;
    let mut four = single.clone();
    four.nonce_len = 6; // server ID 2 + nonce 6 = 8 octets: four-pass, 3 AES passes to decode
    assert_eq!(single.mode(), Mode::SinglePass);
    assert_eq!(four.mode(), Mode::FourPass);
    let mut cases = [
        short_header_case("short header, single-pass CID (17 B)", single),
        short_header_case("short header, four-pass CID (9 B)", four),
        initial_case(),
    ];
    for case in &cases {
        for d in &case.datagrams {
            let route = case.router.route(d);
            let ok = match route {
                Route::Owned(_) => case.expect_owned,
                Route::Hashed(_) => !case.expect_owned,
                Route::Malformed(_) => false,
            };
            assert!(ok, "{}: unexpected {route:?}", case.name);
        }
    }
    // Warm-up round, discarded.
    for case in cases.iter_mut() {
        run_round(case, per_round.min(1 << 20));
        case.ns.clear();
    }
    for _ in 0..rounds {
        for case in cases.iter_mut() {
            run_round(case, per_round);
        }
    }
    println!(
        "Router::route, {rounds} interleaved rounds x {per_round} datagrams, pool {POOL}, {INSTANCES} instances"
    );
    println!("{:<40} {:>10} {:>18}", "case", "median ns", "min-max ns");
    for case in &mut cases {
        case.ns.sort_by(f64::total_cmp);
        let median = case.ns[case.ns.len() / 2];
        let (min, max) = (case.ns[0], case.ns[case.ns.len() - 1]);
        println!(
            "{:<40} {median:>10.1} {:>18}",
            case.name,
            format!("{min:.1}-{max:.1}")
        );
    }
}
