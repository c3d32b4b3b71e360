//! A worker's reports cost the demux a bounded amount (`demux/src/budget.rs`): instance 1 runs
//! `ringmux-fault-worker` (test-tools/fault-worker, `floods.rs`), which floods the demux with
//! well-formed messages, while instance 0 runs the real worker. Checked: the excess is counted
//! in `ringmux_worker_messages_dropped_total`, instance 0's messages and sessions are untouched,
//! and a real client still gets its answers.

use std::path::PathBuf;
use std::time::Duration;

use ringmux_demux::metrics::names;
use ringmux_systests::harness;
use ringmux_testkit::{temp_dir, TempDir};

use harness::{bounded, check_bytes, pin, Forward, Ringmux, SERVER_NAME};

/// Starts 2 instances whose instance 1 plays `fault` (its marker in `dir`).
fn start_flooding(fault: &str, dir: &TempDir) -> Ringmux {
    // The workers (nobody, when the tests run as root) write the marker and the report.
    std::fs::set_permissions(
        dir.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o777),
    )
    .unwrap();
    let env = vec![
        ("RINGMUX_FAULT", fault.to_string()),
        ("RINGMUX_FAULT_INSTANCE", "1".to_string()),
        ("RINGMUX_FAULT_MARKER", marker(dir).to_string_lossy().into()),
        (
            "RINGMUX_REAL_WORKER",
            harness::worker_bin().to_string_lossy().into(),
        ),
    ];
    let fault_worker = harness::binary("ringmux-fault-worker");
    Ringmux::start_with(2, Forward::Shm, &[], fault_worker, &env)
}

fn marker(dir: &TempDir) -> PathBuf {
    dir.path().join("played")
}

fn dropped(m: &harness::Metrics, instance: &str, kind: &str) -> f64 {
    m.samples(names::WORKER_MESSAGES_DROPPED)
        .into_iter()
        .filter(|(labels, _)| {
            labels.contains(&("instance".into(), instance.into()))
                && labels.contains(&("kind".into(), kind.into()))
        })
        .map(|(_, v)| v)
        .sum()
}

/// Instance 1 sends STATS with forged counters as fast as the demux reads them. The excess is
/// dropped and counted; the scrape survives the forged values (they are the worker's word,
/// exposed as given, sums saturated); a series under the demux's own metric's name is refused
/// and no more than `MAX_SERIES` are kept, the rest counted; instance 0's reports still arrive
/// and it serves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stats_flood_is_dropped_counted_and_starves_no_one() {
    bounded(Duration::from_secs(90), async {
        let dir = temp_dir("ringmux-stats-flood");
        let rm = start_flooding("stats-flood", &dir);
        let m = rm
            .wait_for(
                "instance 1's STATS drops to be counted",
                Duration::from_secs(30),
                |m| dropped(m, "1", "stats") > 0.0,
            )
            .await;
        assert_eq!(
            m.instance(names::WORKER_CONNECTIONS, 1),
            i64::MAX as f64,
            "a forged gauge shows as given, capped to the exposition's range:\n{m}"
        );
        // Its series: the demux's own metric is not forged, and no more series are kept than
        // the bound (its 3 requests by protocol and the first forged ones), the rest counted.
        assert_eq!(m.instance(names::WORKER_RESTARTS, 1), 0.0, "{m}");
        let forged = m
            .samples("ringmux_worker_zz_forged_total")
            .into_iter()
            .filter(|(labels, _)| labels.contains(&("instance".into(), "1".into())))
            .count();
        assert_eq!(forged, ringmux_proto::series::MAX_SERIES - 3, "{m}");
        assert_eq!(
            m.sum_where(names::WORKER_REQUESTS, "protocol", "h3"),
            u64::MAX as f64,
            "{m}"
        );
        let series_dropped = m
            .samples(names::WORKER_REPORT_PARTS_DROPPED)
            .into_iter()
            .filter(|(labels, _)| {
                labels.contains(&("instance".into(), "1".into()))
                    && labels.contains(&("kind".into(), "series".into()))
            })
            .map(|(_, v)| v)
            .sum::<f64>();
        assert!(series_dropped >= 48.0, "once per series per report:\n{m}");
        // Instance 0 serves, and its own report of the request gets through the flood.
        let client = rm.pinned_client(0);
        let conn = rm.connect(&client).await;
        let r = conn.get("/bytes/50000").await.expect("GET on instance 0");
        check_bytes("instance 0 during the flood", &r, 50_000);
        harness::third_party_served(&rm, 0).await;
        let m = rm
            .wait_for(
                "instance 0 to report its request during the flood",
                Duration::from_secs(10),
                |m| m.instance(names::WORKER_REQUESTS, 0) >= 1.0,
            )
            .await;
        for kind in ["stats", "control", "session"] {
            assert_eq!(dropped(&m, "0", kind), 0.0, "instance 0's {kind}:\n{m}");
        }
        assert_eq!(m.instance(names::WORKER_RESTARTS, 0), 0.0, "{m}");
        std::fs::write(dir.path().join("played.done"), b"1").unwrap();
        let sent = harness::fault_report(dir.path(), Duration::from_secs(30)).await;
        eprintln!("fault worker: {sent:?}; metrics:\n{m}");
    })
    .await
}

/// Instance 0 issues a session ticket; then instance 1 floods the session store with more PUTs
/// than the whole cache holds. Instance 0's session survives (its quota is its own): the ticket
/// still resumes with 0-RTT. The flood's excess is counted, and nothing of instance 0's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_flood_evicts_no_other_instance_s_sessions() {
    bounded(Duration::from_secs(120), async {
        let dir = temp_dir("ringmux-session-flood");
        let rm = start_flooding("session-flood", &dir);
        let mut client = rm.client();
        pin(&mut client, rm.router.clone(), || 0);
        let conn = rm.connect(&client).await;
        check_bytes("first", &conn.get("/bytes/100").await.expect("GET"), 100);
        // The ticket (and so the demux's acknowledgement of its PUT) has arrived by the time a
        // response has.
        conn.close().await.expect("clean close");

        std::fs::write(dir.path().join("played.go"), b"1").unwrap();
        let sent = harness::fault_report(dir.path(), Duration::from_secs(90)).await;
        assert!(
            sent.get("session-puts").map(String::as_str) == Some("70000"),
            "the flood did not go out whole: {sent:?}"
        );
        let before = rm.metrics();
        assert!(
            dropped(&before, "1", "session") > 0.0,
            "instance 1's excess PUTs were not counted:\n{before}"
        );
        assert_eq!(dropped(&before, "0", "session"), 0.0, "{before}");

        let (conn, zrtt) = client
            .connect_0rtt(rm.listen, SERVER_NAME)
            .await
            .expect("resumed connection");
        assert!(zrtt.attempted(), "no ticket allowing early data");
        check_bytes(
            "0-RTT after the flood",
            &conn.get("/bytes/2000").await.expect("GET in 0-RTT"),
            2000,
        );
        assert!(
            zrtt.accepted().await,
            "0-RTT rejected: instance 0's session was evicted by instance 1's flood"
        );
        conn.close().await.expect("clean close");
        let after = rm.metrics();
        let hits = |m: &harness::Metrics| m.labelled(names::SESSION_TAKES, "result", "hit");
        assert!(hits(&after) > hits(&before), "{after}");
        // Instance 1 is still the flooding worker (no QUIC there).
        harness::third_party_served(&rm, 0).await;
    })
    .await
}
