//! A broken or hostile worker, and overload. `ringmux-fault-worker` (the test tool in
//! test-tools/fault-worker) plays one fault on instance 1, once; the replacement is the real worker. Checked:
//! the demux stays up, detects and counts the fault, resets that ring, restarts that worker,
//! and instance 0 never notices. Overload: a burst far beyond what a ring holds, a worker that
//! stops draining, while the other instance serves; memory stays flat and every datagram is
//! accounted for.

mod harness;

use ringmux_demux::metrics::names;
use std::net::UdpSocket;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use harness::{bounded, check_bytes, Forward, Metrics, Ringmux, TempDir};

fn fault_worker() -> PathBuf {
    // A test tool of its own package (test-tools/fault-worker), built beside ringmux by
    // scripts/test.sh.
    PathBuf::from(env!("CARGO_BIN_EXE_ringmux")).with_file_name("ringmux-fault-worker")
}

/// Starts 2 instances whose instance 1 plays `fault` once.
fn start_faulty(fault: &str, extra: &[&str], dir: &TempDir) -> Ringmux {
    let env = [
        ("RINGMUX_FAULT", fault.to_string()),
        ("RINGMUX_FAULT_INSTANCE", "1".to_string()),
        (
            "RINGMUX_FAULT_MARKER",
            dir.path().join("played").to_string_lossy().into_owned(),
        ),
        (
            "RINGMUX_REAL_WORKER",
            harness::worker_bin().to_string_lossy().into_owned(),
        ),
    ];
    Ringmux::start_with(2, Forward::Shm, extra, fault_worker(), &env)
}

/// Short-header datagrams whose DCID routes to `instance`.
fn blast(rm: &Ringmux, instance: u8, count: usize) {
    let sock = UdpSocket::bind("127.0.0.1:0").unwrap();
    let mut pkt = vec![0x40u8];
    pkt.extend_from_slice(&rm.dcid_for(instance, 17));
    pkt.resize(1200, 0xab);
    for _ in 0..count {
        let _ = sock.send_to(&pkt, rm.listen);
    }
}

/// Instance 0 keeps serving: a pinned connection fetches and checks a body.
async fn instance0_serves(rm: &Ringmux) {
    let client = rm.pinned_client(0);
    let conn = rm.connect(&client).await;
    let r = conn.get("/bytes/50000").await.expect("GET on instance 0");
    check_bytes("instance 0", &r, 50_000);
}

/// Plays `fault` and checks detection, reset, restart and isolation, within 60 s.
async fn fault_is_contained(fault: &str, expect_violation: bool) {
    bounded(Duration::from_secs(60), play_fault(fault, expect_violation)).await;
}

async fn play_fault(fault: &str, expect_violation: bool) {
    let dir = TempDir::new("ringmux-fault");
    let rm = start_faulty(fault, &["--stall-secs", "1"], &dir);
    let before = rm.metrics();
    assert_eq!(before.instance(names::WORKER_RESTARTS, 1), 0.0);
    // Feed instance 1 until the fault has been played and the worker replaced.
    let deadline = Instant::now() + Duration::from_secs(30);
    let m = loop {
        blast(&rm, 1, 20);
        let m = rm.metrics();
        if m.instance(names::WORKER_RESTARTS, 1) >= 1.0 && m.instance(names::WORKER_UP, 1) == 1.0 {
            break m;
        }
        assert!(
            Instant::now() < deadline,
            "instance 1 was not replaced after {fault}; metrics:\n{m}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(
        dir.path().join("played").exists(),
        "the fault worker never played {fault}"
    );
    if expect_violation {
        assert!(
            m.instance(names::RING_VIOLATIONS, 1) >= 1.0,
            "{fault} not detected:\n{m}"
        );
    }
    assert_eq!(
        m.instance(names::WORKER_RESTARTS, 0),
        0.0,
        "instance 0 noticed:\n{m}"
    );
    assert_eq!(m.instance(names::RING_VIOLATIONS, 0), 0.0);
    instance0_serves(&rm).await;
    // The replacement (the real worker) serves on a reset ring.
    let client = rm.pinned_client(1);
    let conn = rm.connect(&client).await;
    let r = conn
        .get("/bytes/1000")
        .await
        .expect("GET on the replacement");
    check_bytes("replacement", &r, 1000);
    let m = rm.wait_balanced(Duration::from_secs(5)).await;
    assert!(m.get(names::RECEIVED) > 0.0);
}

#[tokio::test]
async fn head_written_ahead_of_tail() {
    fault_is_contained("head-ahead", true).await;
}

#[tokio::test]
async fn head_moved_backwards() {
    fault_is_contained("head-backwards", true).await;
}

#[tokio::test]
async fn worker_stops_draining() {
    fault_is_contained("stop-draining", true).await;
}

/// A worker floods its control socket from two threads while its ring stalls: the supervisor
/// reads a bounded number of messages per worker per round, so it still acts on the stall.
#[tokio::test]
async fn control_flood_with_a_stalled_ring() {
    fault_is_contained("control-flood", true).await;
}

/// A draining worker that closes its control socket but keeps running (and ignores SIGTERM)
/// cannot hold the demux past its grace period: it is killed at the deadline and ringmux exits.
#[tokio::test]
async fn a_lingering_drain_ends_at_the_grace_deadline() {
    bounded(Duration::from_secs(60), async {
        let dir = TempDir::new("ringmux-linger");
        let mut rm = start_faulty("linger", &["--grace", "2"], &dir);
        let pids = rm.worker_pids().await;
        rm.signal(libc::SIGTERM);
        let status = rm.wait_exit(Duration::from_secs(30)).await;
        assert!(status.success(), "ringmux exited with {status}");
        assert!(
            dir.path().join("played").exists(),
            "the fault was never played"
        );
        let left = harness::wait_gone(&pids, Duration::from_secs(10)).await;
        assert!(
            left.is_empty(),
            "workers still alive after the demux exited: {left:?}"
        );
    })
    .await
}

/// The worker tries to fill its doorbell and makes its end blocking, then stops draining: the
/// attack that blocked the demux's writes to a shared eventfd. The doorbell is a pipe, whose
/// write end is the demux's alone: the data plane never blocks, instance 0 serves throughout,
/// and the worker is replaced as a stalled one (a violation).
#[tokio::test]
async fn worker_jams_its_doorbell() {
    fault_is_contained("jam-doorbell", true).await;
}

#[tokio::test]
async fn worker_dies_mid_batch() {
    fault_is_contained("die-mid-batch", false).await;
}

/// One slow worker (its ring full) does not slow the others: instance 1 never drains (and is
/// not declared stuck within the test), instance 0 serves throughout; the excess is counted as
/// ring_full.
#[tokio::test]
async fn full_ring_of_one_instance_does_not_slow_another() {
    bounded(Duration::from_secs(60), async {
        let dir = TempDir::new("ringmux-slow");
        let rm = start_faulty(
            "stop-draining",
            &["--stall-secs", "600", "--ring-slots", "64"],
            &dir,
        );
        blast(&rm, 1, 2000);
        // The occupancy gauge is refreshed every 100 ms, the drop counter every batch.
        rm.wait_for(
            "ring_full drops and a full ring (64 slots) on the stuck instance",
            Duration::from_secs(10),
            |m| m.dropped("ring_full") > 0.0 && m.instance(names::RING_OCCUPANCY, 1) == 64.0,
        )
        .await;
        for _ in 0..5 {
            blast(&rm, 1, 200);
            instance0_serves(&rm).await;
        }
        let m = rm.wait_balanced(Duration::from_secs(5)).await;
        assert_eq!(m.instance(names::WORKER_RESTARTS, 0), 0.0);
        assert!(m.dropped("ring_full") >= 2000.0 - 64.0, "{m}");
    })
    .await;
}

fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("/proc status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches(" kB").trim().parse().ok())
        .expect("VmRSS")
}

/// Offered load far beyond what the rings take: the demux is paused (SIGSTOP) while its socket
/// fills, then resumed into a burst ~60 times a ring. Memory stays flat, every datagram is
/// accounted for by reason, and both instances serve again afterwards.
#[tokio::test]
async fn overload_burst_keeps_memory_flat_and_accounts_for_everything() {
    bounded(Duration::from_secs(90), async {
        let rm = Ringmux::start(
            2,
            Forward::Shm,
            &["--ring-slots", "256", "--rcvbuf", "67108864"],
        );
        instance0_serves(&rm).await;
        let rss_before = rss_kib(rm.pid);
        for round in 0..3 {
            rm.signal(libc::SIGSTOP);
            let senders: Vec<_> = (0..2u8)
                .map(|i| {
                    let target = rm.listen;
                    let mut pkt = vec![0x40u8];
                    pkt.extend_from_slice(&rm.dcid_for(i, 17));
                    pkt.resize(1200, round);
                    std::thread::spawn(move || {
                        let sock = UdpSocket::bind("127.0.0.1:0").unwrap();
                        for _ in 0..15_000 {
                            let _ = sock.send_to(&pkt, target);
                        }
                    })
                })
                .collect();
            for s in senders {
                s.join().unwrap();
            }
            rm.signal(libc::SIGCONT);
            rm.wait_balanced(Duration::from_secs(20)).await;
        }
        let m: Metrics = rm.wait_balanced(Duration::from_secs(20)).await;
        assert!(
            m.dropped("ring_full") > 0.0,
            "the burst never overflowed a ring:\n{m}"
        );
        assert_eq!(
            m.get(names::DATAPLANE_ALLOCATIONS),
            0.0,
            "the data plane allocated:\n{m}"
        );
        let rss_after = rss_kib(rm.pid);
        // Flat: the rings and buffers are preallocated; allow for page-cache noise only.
        assert!(
            rss_after <= rss_before + 8 * 1024,
            "demux RSS grew from {rss_before} KiB to {rss_after} KiB"
        );
        // Both instances serve after the storm.
        instance0_serves(&rm).await;
        let client = rm.pinned_client(1);
        let conn = rm.connect(&client).await;
        check_bytes(
            "instance 1 after overload",
            &conn.get("/bytes/20000").await.expect("GET"),
            20_000,
        );
        eprintln!(
            "overload: RSS {rss_before} -> {rss_after} KiB; drops {:?}",
            m.dropped("ring_full")
        );
    })
    .await;
}
