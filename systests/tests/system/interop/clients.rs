//! End to end with third-party HTTP/3 clients: ngtcp2's `gtlsclient` (Debian `ngtcp2-client`)
//! and aioquic (Python, driven through `ringmux_testkit::aioquic`'s script). How they behave
//! and what their output means is said where each is used: gtlsclient exits 0 whatever
//! happened and writes everything to stderr; aioquic ignores stateless resets.
//!
//! A client that is not installed skips its tests with a loud message, unless `CI` is set: then
//! its absence is a failure.

use ringmux_demux::metrics::names;
use ringmux_systests::harness;
use ringmux_testkit::aioquic::Json;
use ringmux_testkit::temp_dir;
use ringmux_testkit::tool::{self, tail};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use harness::{
    bounded, check_bytes, expected_bytes, hex, sha256_hex, upload_byte, Forward, PyUpstream,
    Ringmux,
};
use ringmux_testkit::client::Fnv64;

const LIMIT: Duration = Duration::from_secs(120);
const CLIENT_TIMEOUT: Duration = Duration::from_secs(60);

// ---------------------------------------------------------------------------------------------
// gtlsclient

/// One gtlsclient run against `rm`: its stderr (where it writes everything).
async fn gtls(rm: &Ringmux, opts: &[String], paths: &[&str]) -> String {
    let port = rm.listen.port().to_string();
    let mut args: Vec<String> = vec![
        "--exit-on-all-streams-close".into(),
        "--no-quic-dump".into(),
        "--no-http-dump".into(),
        "--timeout=10s".into(),
        "--handshake-timeout=5s".into(),
    ];
    args.extend(opts.iter().cloned());
    args.push("127.0.0.1".into());
    args.push(port.clone());
    args.extend(paths.iter().map(|p| format!("https://127.0.0.1:{port}{p}")));
    let out = tool::run("gtlsclient", &args, rm.dir(), CLIENT_TIMEOUT).await;
    // gtlsclient exits 0 even on a handshake timeout or a reset: success is read from the output.
    out.stderr
}

/// The lines every successful gtlsclient request prints, and no error.
fn assert_gtls_ok(what: &str, log: &str, requests: usize) {
    let statuses = log.matches("[:status: 200]").count();
    let closed = log.matches("closed with error code 256").count();
    let errors: Vec<&str> = log.lines().filter(|l| l.contains("ERR_")).collect();
    assert!(
        statuses == requests && closed == requests && errors.is_empty(),
        "{what}: {statuses}/{requests} responses with status 200, {closed}/{requests} streams \
         closed with H3_NO_ERROR, errors {errors:?}\n--- gtlsclient (last lines) ---\n{}",
        tail(log, 40)
    );
}

/// Checks a body gtlsclient saved (`--download DIR` names it after the last path component).
fn assert_download(dir: &Path, n: u64) {
    let path = dir.join(n.to_string());
    let body = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut sum = Fnv64::new();
    sum.update(&body);
    assert_eq!(
        (body.len() as u64, sum.finish()),
        expected_bytes(n),
        "{}: (length, FNV) differs from fill_pattern",
        path.display()
    );
}

fn download_dir(rm: &Ringmux, name: &str) -> PathBuf {
    let d = rm.dir().join(name);
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gtlsclient_get_hello() {
    if !tool::GTLSCLIENT.present() {
        return;
    }
    bounded(LIMIT, async {
        let rm = Ringmux::start(3, Forward::Shm, &[]);
        let dir = download_dir(&rm, "dl");
        let log = gtls(
            &rm,
            &[format!("--download={}", dir.display())],
            &["/hello.txt"],
        )
        .await;
        assert!(log.contains("Negotiated ALPN is h3"), "{}", tail(&log, 40));
        assert_gtls_ok("GET /hello.txt", &log, 1);
        let body = std::fs::read(dir.join("hello.txt")).expect("saved /hello.txt");
        assert!(
            log.contains(&format!("[content-length: {}]", body.len())),
            "saved {} bytes, not the content-length announced",
            body.len()
        );
        assert!(!body.is_empty(), "empty /hello.txt");
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gtlsclient_100_requests_one_connection() {
    if !tool::GTLSCLIENT.present() {
        return;
    }
    bounded(LIMIT, async {
        let rm = Ringmux::start(3, Forward::Shm, &[]);
        let log = gtls(&rm, &["-n".into(), "100".into()], &["/bytes/5000"]).await;
        assert_gtls_ok("100 requests on one connection", &log, 100);
        assert_eq!(
            log.matches("QUIC handshake has completed").count(),
            1,
            "more than one connection"
        );
        rm.wait_for(
            "the workers to report 100 requests",
            Duration::from_secs(5),
            |m| m.sum(names::WORKER_REQUESTS) >= 100.0,
        )
        .await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gtlsclient_20_connections() {
    if !tool::GTLSCLIENT.present() {
        return;
    }
    bounded(LIMIT, async {
        const N: u64 = 20;
        let rm = Ringmux::start(3, Forward::Shm, &[]);
        let runs = (0..N).map(|i| {
            let dir = download_dir(&rm, &format!("dl{i}"));
            let path = format!("/bytes/{}", 1000 + i * 997);
            let rm = &rm;
            async move {
                let log = gtls(rm, &[format!("--download={}", dir.display())], &[&path]).await;
                (i, dir, log)
            }
        });
        for (i, dir, log) in join_all(runs).await {
            assert_gtls_ok(&format!("connection {i}"), &log, 1);
            assert_download(&dir, 1000 + i * 997);
        }
        let m = rm
            .wait_for(
                "the workers to report 20 connections",
                Duration::from_secs(5),
                |m| m.sum(names::WORKER_CONNECTIONS_ACCEPTED) >= N as f64,
            )
            .await;
        let busy = (0..3)
            .filter(|&i| m.instance(names::WORKER_CONNECTIONS_ACCEPTED, i) > 0.0)
            .count();
        assert!(
            busy >= 2,
            "20 random DCIDs all landed on one instance:\n{m}"
        );
    })
    .await
}

/// Active migration: a new socket and a new server-issued CID, which must route to the worker
/// that issued it (gtlsclient's `--change-local-addr` takes a spare CID the worker issued).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gtlsclient_active_migration() {
    gtlsclient_active_migration_in(Forward::Shm).await
}

/// The same under kernel steering: the program reads the new CID's instance.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gtlsclient_active_migration_reuseport() {
    gtlsclient_active_migration_in(Forward::Reuseport).await
}

async fn gtlsclient_active_migration_in(forward: Forward) {
    if !tool::GTLSCLIENT.present() {
        return;
    }
    bounded(LIMIT, async {
        const N: u64 = 2_000_000;
        let rm = Ringmux::start(3, forward, &[]);
        let dir = download_dir(&rm, "dl");
        let log = gtls(
            &rm,
            &[
                "--change-local-addr=100ms".into(),
                "--delay-stream=300ms".into(),
                format!("--download={}", dir.display()),
            ],
            &[&format!("/bytes/{N}")],
        )
        .await;
        assert!(
            log.contains("Local address is now")
                && log.contains("Path validation against path")
                && log.contains("succeeded"),
            "no validated move:\n{}",
            tail(&log, 40)
        );
        assert_gtls_ok("download after active migration", &log, 1);
        assert_download(&dir, N);
    })
    .await
}

/// NAT rebinding: same CID from a new port; the worker must answer there and validate it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gtlsclient_nat_rebinding() {
    gtlsclient_nat_rebinding_in(Forward::Unix).await
}

/// The same under kernel steering: the CID routes, not the address.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gtlsclient_nat_rebinding_reuseport() {
    gtlsclient_nat_rebinding_in(Forward::Reuseport).await
}

async fn gtlsclient_nat_rebinding_in(forward: Forward) {
    if !tool::GTLSCLIENT.present() {
        return;
    }
    bounded(LIMIT, async {
        const N: u64 = 2_000_000;
        let rm = Ringmux::start(3, forward, &[]);
        let dir = download_dir(&rm, "dl");
        let log = gtls(
            &rm,
            &[
                "--change-local-addr=100ms".into(),
                "--nat-rebinding".into(),
                "--delay-stream=300ms".into(),
                format!("--download={}", dir.display()),
            ],
            &[&format!("/bytes/{N}")],
        )
        .await;
        assert!(
            log.contains("Local address is now"),
            "no rebinding:\n{}",
            tail(&log, 40)
        );
        assert!(
            log.contains("frm rx") && log.contains("PATH_CHALLENGE"),
            "the server did not validate the new path (no PATH_CHALLENGE received)"
        );
        assert_gtls_ok("download after NAT rebinding", &log, 1);
        assert_download(&dir, N);
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gtlsclient_key_update() {
    if !tool::GTLSCLIENT.present() {
        return;
    }
    bounded(LIMIT, async {
        const N: u64 = 4 << 20;
        let rm = Ringmux::start(3, Forward::Shm, &[]);
        let dir = download_dir(&rm, "dl");
        let log = gtls(
            &rm,
            &[
                "--key-update=20ms".into(),
                // quinn starts a key update of its own after a random 10..1000 packets; if it
                // lands just before gtlsclient's, ngtcp2 refuses the client's
                // (ERR_INVALID_STATE) and gtlsclient closes. Holding the request until after
                // the client's update keeps the two apart.
                "--delay-stream=100ms".into(),
                format!("--download={}", dir.display()),
            ],
            &[&format!("/bytes/{N}")],
        )
        .await;
        // "Updating traffic key" appears in every run; these two only after a real update.
        assert!(
            log.contains("Initiate key update") && log.contains("key update confirmed"),
            "no confirmed key update:\n{}",
            tail(&log, 40)
        );
        assert_gtls_ok("download across a key update", &log, 1);
        assert_download(&dir, N);
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gtlsclient_10mib_download() {
    if !tool::GTLSCLIENT.present() {
        return;
    }
    bounded(LIMIT, async {
        const N: u64 = 10 << 20;
        let rm = Ringmux::start(3, Forward::Shm, &[]);
        let dir = download_dir(&rm, "dl");
        let log = gtls(
            &rm,
            &[format!("--download={}", dir.display())],
            &[&format!("/bytes/{N}")],
        )
        .await;
        assert_gtls_ok("10 MiB download", &log, 1);
        assert_download(&dir, N);
    })
    .await
}

/// 0-RTT with the ticket of instance 0 on a connection whose first DCID routes to instance 2.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gtlsclient_0rtt_on_another_instance() {
    if !tool::GTLSCLIENT.present() {
        return;
    }
    bounded(LIMIT, async {
        let rm = Ringmux::start(3, Forward::Shm, &[]);
        let session = rm.dir().join("session");
        let tp = rm.dir().join("tp");
        let files = [
            format!("--session-file={}", session.display()),
            format!("--tp-file={}", tp.display()),
        ];
        let run_on = |instance: u8| {
            let mut opts = files.to_vec();
            opts.push(format!("--dcid={}", hex(&rm.dcid_for(instance, 18))));
            opts
        };
        let first = gtls(&rm, &run_on(0), &["/bytes/100"]).await;
        assert_gtls_ok("first connection", &first, 1);
        assert!(session.is_file() && tp.is_file(), "no session or tp file");
        let before = rm.metrics();
        let second = gtls(&rm, &run_on(2), &["/bytes/3000"]).await;
        assert_gtls_ok("resumed connection", &second, 1);
        assert!(
            second.contains("type=0RTT"),
            "no 0-RTT packet sent:\n{}",
            tail(&second, 40)
        );
        assert!(
            !second.contains("Early data was rejected"),
            "0-RTT rejected by instance 2 (ticket from instance 0)"
        );
        // If the server took the 0-RTT request, its response starts before the client sends
        // the request again in 1-RTT (a PTO probe may resend it; a rejection must).
        let lines: Vec<&str> = second.lines().collect();
        let first = |pred: &dyn Fn(&str) -> bool| lines.iter().position(|l| pred(l));
        let response =
            first(&|l| l.contains("frm rx") && l.contains("STREAM") && l.contains(" id=0x0 "))
                .expect("no response data on stream 0");
        let resent =
            first(&|l| l.contains("frm tx") && l.contains("1RTT STREAM") && l.contains(" id=0x0 "));
        assert!(
            resent.is_none_or(|r| response < r),
            "the response came only after the request was resent in 1-RTT (0-RTT ignored):\n{}",
            lines[..response + 1].join("\n")
        );
        let after = rm.metrics();
        assert!(
            after.instance(names::FORWARDED, 2) > before.instance(names::FORWARDED, 2),
            "the resumed connection did not reach instance 2"
        );
        harness::assert_taken_through_binding(&before, &after);
    })
    .await
}

/// `--retry`: gtlsclient logs the Retry it received and then completes its request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gtlsclient_retry() {
    if !tool::GTLSCLIENT.present() {
        return;
    }
    bounded(LIMIT, async {
        let rm = Ringmux::start(3, Forward::Shm, &["--retry", "always"]);
        let log = gtls(&rm, &[], &["/bytes/777"]).await;
        assert!(
            log.lines()
                .any(|l| l.contains("pkt rx") && l.contains("type=Retry")),
            "no Retry received with --retry:\n{}",
            tail(&log, 40)
        );
        assert_gtls_ok("request after Retry", &log, 1);
        assert_demux_retried(&rm.metrics(), 1.0);
    })
    .await
}

// ---------------------------------------------------------------------------------------------
// aioquic

/// Runs one scenario of aioquic_client.py and returns its JSON result, checked for `ok` and
/// for every body it reports (status 200, and the `/bytes/N` pattern).
async fn aioquic(rm: &Ringmux, scenario: &str, extra: &[String]) -> Json {
    let json = aioquic_raw(rm, scenario, extra).await;
    for body in json
        .get("bodies")
        .and_then(Json::as_array)
        .into_iter()
        .flatten()
    {
        let text = body.as_str().expect("body summary");
        let f: Vec<&str> = text.split(' ').collect();
        assert_eq!(f.len(), 4, "body summary {text:?}");
        assert_eq!(f[1], "200", "aioquic {scenario}: {text}");
        let len: u64 = f[2].parse().unwrap();
        if let Some(n) = f[0].strip_prefix("/bytes/") {
            let n: u64 = n.parse().unwrap();
            assert_eq!(len, n, "aioquic {scenario}: length of {text}");
            if scenario != "download" {
                let sum = u64::from_str_radix(f[3], 16).unwrap();
                assert_eq!(
                    sum,
                    expected_bytes(n).1,
                    "aioquic {scenario}: content of {text} differs from fill_pattern"
                );
            }
        }
    }
    json
}

/// Runs one scenario of aioquic_client.py and returns its JSON result, checked for `ok`.
async fn aioquic_raw(rm: &Ringmux, scenario: &str, extra: &[String]) -> Json {
    let script = ringmux_testkit::aioquic::script();
    let mut args = vec![
        script.to_string_lossy().into_owned(),
        "127.0.0.1".into(),
        rm.listen.port().to_string(),
        scenario.into(),
        "--dir".into(),
        rm.dir().to_string_lossy().into_owned(),
    ];
    args.extend(extra.iter().cloned());
    let out = tool::run("python3", &args, rm.dir(), CLIENT_TIMEOUT).await;
    let json = ringmux_testkit::aioquic::result(&out.stdout).unwrap_or_else(|| {
        panic!(
            "aioquic {scenario}: no JSON result in {:?}\n{}",
            out.stdout,
            tail(&out.stderr, 40)
        )
    });
    assert_eq!(
        json.get("ok").and_then(Json::as_bool),
        Some(true),
        "aioquic {scenario} failed: {:?}\n{}",
        json.get("error"),
        tail(&out.stderr, 40)
    );
    json
}

fn bodies(j: &Json) -> usize {
    j.get("bodies").and_then(Json::as_array).map_or(0, Vec::len)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aioquic_get() {
    if !tool::AIOQUIC.present() {
        return;
    }
    bounded(LIMIT, async {
        let rm = Ringmux::start(3, Forward::Shm, &[]);
        let j = aioquic(&rm, "get", &[]).await;
        assert_eq!(bodies(&j), 2);
    })
    .await
}

/// `--retry always`: the demux answers aioquic's first Initial with a Retry, and the worker's
/// quinn accepts the token the demux minted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aioquic_retry() {
    if !tool::AIOQUIC.present() {
        return;
    }
    bounded(LIMIT, async {
        let rm = Ringmux::start(2, Forward::Shm, &["--retry", "always"]);
        let j = aioquic(&rm, "get", &[]).await;
        assert_eq!(bodies(&j), 2);
        let m = rm.metrics();
        assert_demux_retried(&m, 1.0);
    })
    .await
}

/// A flood of real Initials (aioquic ClientHellos from 64 source ports of 127.0.1.1, never
/// followed up) while an established connection downloads and a new one connects. Under that
/// pressure the demux answers the flood with its own Retries (`--retry auto`, the default), so
/// no worker spends a handshake on it; the established connection loses no datagram in the
/// demux (nothing is dropped but the flood's new-connection packets); the new connection
/// completes through a Retry; every datagram is accounted for; the demux's memory stays flat.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn initial_flood_spares_established_connections() {
    if !tool::AIOQUIC.present() {
        return;
    }
    bounded(LIMIT, async {
        let rm = Ringmux::start(2, Forward::Shm, &[]);
        let established = rm.client();
        let conn = rm.connect(&established).await;
        check_bytes(
            "before the flood",
            &conn.get("/bytes/1000").await.unwrap(),
            1000,
        );
        let rss_before = harness::peak_rss(rm.pid);
        // 2 000 Initials a second for 4 s: twice `--retry-above`'s default.
        const FLOOD: usize = 8000;
        let during = async {
            let newcomer = rm.client();
            let (download, fresh) = tokio::join!(conn.get("/bytes/20000000"), async {
                let c = rm.connect(&newcomer).await;
                c.get("/bytes/5000").await
            });
            check_bytes("download during the flood", &download.unwrap(), 20_000_000);
            check_bytes("new connection during the flood", &fresh.unwrap(), 5000);
            rm.metrics()
        };
        let (m_during, m) = under_flood(&rm, FLOOD, 2000, during).await;
        assert!(
            m_during.labelled(names::TOKENS, "result", "accepted") >= 1.0,
            "the new connection did not come through a Retry:\n{m_during}"
        );
        let flood_drops =
            m.dropped("retry") + m.dropped("initial_shed") + m.dropped("prefix_budget");
        assert!(
            m.dropped("retry") > FLOOD as f64 / 2.0,
            "most of the flood should have met a Retry:\n{m}"
        );
        assert_eq!(
            m.sum(names::DROPPED),
            flood_drops,
            "a datagram other than the flood's was dropped:\n{m}"
        );
        let rss_after = harness::peak_rss(rm.pid);
        assert!(
            rss_after <= rss_before + (8 << 20),
            "demux peak RSS grew from {rss_before} to {rss_after} bytes"
        );
    })
    .await
}

/// Floods `rm` with `count` Initials at `rate` per second (`bench/initial-flood.py`, from 64
/// source ports of 127.0.1.1: another /24 than the test's clients at 127.0.0.1) and runs
/// `during` once the flood has put the demux under pressure. Returns what `during` returned,
/// and the metrics once the whole flood was received and every datagram accounted for.
async fn under_flood<T>(
    rm: &Ringmux,
    count: usize,
    rate: u32,
    during: impl std::future::Future<Output = T>,
) -> (T, harness::Metrics) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../bench/initial-flood.py");
    let args: Vec<String> = [
        script.to_string_lossy().as_ref(),
        "127.0.0.1",
        &rm.listen.port().to_string(),
        "--count",
        &count.to_string(),
        "--unique",
        "400",
        "--rate",
        &rate.to_string(),
        "--ports",
        "64",
        "--source",
        "127.0.1.1",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let under_pressure = async {
        rm.wait_for(
            "the flood to put the demux under pressure",
            Duration::from_secs(30),
            |m| m.get(names::ADMISSION_PRESSURE) == 1.0,
        )
        .await;
        during.await
    };
    let (flood, out) = tokio::join!(
        tool::run("python3", &args, rm.dir(), CLIENT_TIMEOUT),
        under_pressure
    );
    assert!(
        flood.stdout.contains(&format!("\"sent\": {count}")),
        "initial-flood.py: {}\n{}",
        flood.stdout,
        tail(&flood.stderr, 20)
    );
    let m = rm
        .wait_for(
            "the whole flood received and accounted for",
            Duration::from_secs(20),
            |m| m.balanced() && m.get(names::RECEIVED) >= count as f64,
        )
        .await;
    (out, m)
}

/// No source can take all the room: without Retries (`--retry never`), a flood of Initials
/// from one /24 puts the demux under pressure, and that prefix may then send no more than its
/// budget (`--prefix-budget 50` a second) to the workers; the rest is dropped as
/// `prefix_budget`. A client from another prefix still connects at once, and every datagram
/// is accounted for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flooding_prefix_is_held_to_its_budget() {
    if !tool::AIOQUIC.present() {
        return;
    }
    bounded(LIMIT, async {
        let rm = Ringmux::start(
            2,
            Forward::Shm,
            &["--retry", "never", "--prefix-budget", "50"],
        );
        const FLOOD: usize = 6000;
        let during = async {
            let client = rm.client();
            let c = rm.connect(&client).await;
            check_bytes(
                "a client of another prefix",
                &c.get("/bytes/5000").await.unwrap(),
                5000,
            );
        };
        let ((), m) = under_flood(&rm, FLOOD, 2000, during).await;
        // 3 s of flood at 2 000/s: at most 50/s (and a burst of 50) may pass once the pressure
        // is on, which the first 100 ms of it turn on.
        let budget = m.dropped("prefix_budget");
        assert!(
            budget >= FLOOD as f64 * 0.8,
            "the prefix was not held to its budget:\n{m}"
        );
        assert_eq!(m.dropped("retry"), 0.0, "{m}");
        assert_eq!(
            m.sum(names::DROPPED),
            budget + m.dropped("initial_shed"),
            "a datagram other than the flood's was dropped:\n{m}"
        );
    })
    .await
}

/// The demux sent at least `n` Retries and accepted as many tokens: the address validation was
/// the demux's own (the workers are never asked to send one).
fn assert_demux_retried(m: &harness::Metrics, n: f64) {
    assert!(
        m.labelled(names::RETRIES, "result", "sent") >= n
            && m.labelled(names::TOKENS, "result", "accepted") >= n,
        "expected {n} Retries sent and tokens accepted by the demux:\n{m}"
    );
    assert_eq!(m.dropped("token_refused"), 0.0, "{m}");
    assert_eq!(
        m.dropped("retry"),
        m.labelled(names::RETRIES, "result", "sent")
            + m.labelled(names::RETRIES, "result", "unsent"),
        "{m}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aioquic_100_requests_one_connection() {
    if !tool::AIOQUIC.present() {
        return;
    }
    bounded(LIMIT, async {
        let rm = Ringmux::start(3, Forward::Unix, &[]);
        let j = aioquic(&rm, "many", &[]).await;
        assert_eq!(bodies(&j), 100);
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aioquic_20_connections() {
    if !tool::AIOQUIC.present() {
        return;
    }
    bounded(LIMIT, async {
        let rm = Ringmux::start(3, Forward::Shm, &[]);
        let j = aioquic(&rm, "conns", &[]).await;
        assert_eq!(bodies(&j), 20);
        rm.wait_for(
            "the workers to report 20 connections",
            Duration::from_secs(5),
            |m| m.sum(names::WORKER_CONNECTIONS_ACCEPTED) >= 20.0,
        )
        .await;
    })
    .await
}

async fn aioquic_migration(scenario: &str, forward: Forward) {
    let rm = Ringmux::start(3, forward, &[]);
    let dcid = format!("--dcid={}", hex(&rm.dcid_for(1, 8)));
    let j = aioquic(&rm, scenario, &[dcid]).await;
    assert_eq!(bodies(&j), 2);
    assert_eq!(
        j.get("moved_before_end").and_then(Json::as_bool),
        Some(true),
        "the download ended before the move: nothing was tested"
    );
    assert_ne!(
        j.get("port_before").and_then(Json::as_u64),
        j.get("port_after").and_then(Json::as_u64),
        "the port did not change"
    );
}

/// A new socket mid-download with the same CID (NAT rebinding as the server sees it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aioquic_rebinding() {
    if !tool::AIOQUIC.present() {
        return;
    }
    bounded(LIMIT, aioquic_migration("migrate", Forward::Shm)).await
}

/// NAT rebinding under kernel steering.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aioquic_rebinding_reuseport() {
    if !tool::AIOQUIC.present() {
        return;
    }
    bounded(LIMIT, aioquic_migration("migrate", Forward::Reuseport)).await
}

/// A new socket mid-download and a switch to another server-issued CID (active migration).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aioquic_migration_new_cid() {
    if !tool::AIOQUIC.present() {
        return;
    }
    bounded(LIMIT, aioquic_migration("migrate_cid", Forward::Shm)).await
}

/// Active migration to another server-issued CID under kernel steering.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aioquic_migration_new_cid_reuseport() {
    if !tool::AIOQUIC.present() {
        return;
    }
    bounded(LIMIT, aioquic_migration("migrate_cid", Forward::Reuseport)).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aioquic_key_update() {
    if !tool::AIOQUIC.present() {
        return;
    }
    bounded(LIMIT, async {
        let rm = Ringmux::start(3, Forward::Shm, &[]);
        let j = aioquic(&rm, "keyupdate", &[]).await;
        // aioquic switches both directions' keys at once: responses after each update decrypt
        // only if the server followed.
        assert_eq!(bodies(&j), 3);
        let updates = j.get("key_updated_events").and_then(Json::as_u64);
        assert!(updates >= Some(2), "key_updated events: {updates:?}");
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aioquic_10mib_download() {
    if !tool::AIOQUIC.present() {
        return;
    }
    bounded(LIMIT, async {
        let rm = Ringmux::start(3, Forward::Shm, &[]);
        let j = aioquic(&rm, "download", &[]).await;
        assert_eq!(bodies(&j), 1);
        assert_download(rm.dir(), 10 << 20);
    })
    .await
}

/// Ticket from instance 0, early data on a connection routed to instance 2.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aioquic_0rtt_on_another_instance() {
    if !tool::AIOQUIC.present() {
        return;
    }
    bounded(LIMIT, async {
        let rm = Ringmux::start(3, Forward::Shm, &[]);
        let dcids = [
            format!("--dcid={}", hex(&rm.dcid_for(0, 8))),
            format!("--dcid2={}", hex(&rm.dcid_for(2, 8))),
        ];
        let j = aioquic(&rm, "zerortt", &dcids).await;
        assert_eq!(bodies(&j), 2);
        let flag = |k: &str| j.get(k).and_then(Json::as_bool);
        assert_eq!(flag("session_resumed"), Some(true), "not resumed: {j:?}");
        assert!(
            j.get("sent_0rtt_packets").and_then(Json::as_u64) >= Some(1),
            "no 0-RTT packet sent: {j:?}"
        );
        assert_eq!(
            flag("early_data_accepted"),
            Some(true),
            "0-RTT rejected on instance 2 (ticket from instance 0): {j:?}"
        );
        let m = rm.metrics();
        assert!(
            m.instance(names::FORWARDED, 2) > 0.0,
            "nothing reached instance 2"
        );
        harness::assert_taken_through_binding(&harness::Metrics::default(), &m);
    })
    .await
}

// ---------------------------------------------------------------------------------------------
// Processes

/// Polls all futures to completion, returning their outputs in order.
async fn join_all<F: std::future::Future>(futs: impl Iterator<Item = F>) -> Vec<F::Output> {
    let mut futs: Vec<_> = futs.map(|f| Some(Box::pin(f))).collect();
    let mut out: Vec<Option<F::Output>> = futs.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (slot, f) in out.iter_mut().zip(futs.iter_mut()) {
            if let Some(fut) = f {
                match fut.as_mut().poll(cx) {
                    std::task::Poll::Ready(v) => {
                        *slot = Some(v);
                        *f = None;
                    }
                    std::task::Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            std::task::Poll::Pending
        } else {
            std::task::Poll::Ready(())
        }
    })
    .await;
    out.into_iter().map(Option::unwrap).collect()
}

/// The h3-hello example (worker/examples/h3-hello.rs) run as the instances with --worker-cmd.
fn start_h3_hello() -> Ringmux {
    let cmd = harness::binary("examples/h3-hello")
        .to_string_lossy()
        .into_owned();
    Ringmux::start(3, Forward::Shm, &["--worker-cmd", &cmd])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gtlsclient_against_the_h3_hello_example() {
    if !tool::GTLSCLIENT.present() {
        return;
    }
    bounded(LIMIT, async {
        let rm = start_h3_hello();
        let dir = download_dir(&rm, "dl");
        let log = gtls(&rm, &[format!("--download={}", dir.display())], &["/"]).await;
        assert!(log.contains("Negotiated ALPN is h3"), "{}", tail(&log, 40));
        assert_gtls_ok("GET / of h3-hello", &log, 1);
        // gtlsclient saves the body of "/" under the name of the URI's last component: none.
        let saved: Vec<_> = std::fs::read_dir(&dir).unwrap().flatten().collect();
        let body = saved
            .iter()
            .find_map(|e| std::fs::read_to_string(e.path()).ok())
            .unwrap_or_else(|| panic!("no body saved; log:\n{}", tail(&log, 40)));
        assert!(body.contains("\"hello\":\"world\""), "{body}");
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aioquic_against_the_h3_hello_example() {
    if !tool::AIOQUIC.present() {
        return;
    }
    bounded(LIMIT, async {
        let rm = start_h3_hello();
        let args: Vec<String> = ["--path", "/", "--path", "/missing"]
            .map(String::from)
            .to_vec();
        let out = aioquic_raw(&rm, "paths", &args).await;
        let texts = out
            .get("texts")
            .and_then(Json::as_array)
            .cloned()
            .unwrap_or_default();
        assert_eq!(texts.len(), 2, "{out:?}");
        let hello = texts[0].as_str().unwrap();
        assert!(hello.contains("\"hello\":\"world\""), "{hello}");
        let summaries = out
            .get("bodies")
            .and_then(Json::as_array)
            .cloned()
            .unwrap_or_default();
        assert!(
            summaries[0].as_str().unwrap().starts_with("/ 200 "),
            "{summaries:?}"
        );
        assert!(
            summaries[1].as_str().unwrap().starts_with("/missing 404 "),
            "{summaries:?}"
        );
    })
    .await
}

/// `ringmux --upstream` in front of each upstream: hyper's and Python's `http.server`.
fn proxies() -> Vec<(&'static str, Ringmux, Box<dyn std::any::Any>)> {
    let hyper = ringmux_testkit::upstream::Upstream::start("127.0.0.1:0".parse().unwrap(), 1)
        .expect("starting the hyper upstream");
    let py = PyUpstream::start();
    let hyper_url = format!("http://{}", hyper.addr());
    vec![
        (
            "hyper",
            Ringmux::start(2, Forward::Shm, &["--upstream", &hyper_url]),
            Box::new(hyper),
        ),
        (
            "python",
            Ringmux::start(2, Forward::Shm, &["--upstream", &py.url()]),
            Box::new(py),
        ),
    ]
}

/// gtlsclient through the reverse proxy: GET, a 3 MB download checked against the pattern, the
/// forwarded headers, and a 2 MiB POST checked by SHA-256 at the upstream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gtlsclient_through_the_proxy() {
    if !tool::GTLSCLIENT.present() {
        return;
    }
    bounded(LIMIT, async {
        for (name, rm, _upstream) in proxies() {
            let dir = download_dir(&rm, "dl");
            let dl = format!("--download={}", dir.display());
            let log = gtls(
                &rm,
                std::slice::from_ref(&dl),
                &["/hello", "/headers", "/bytes/3000000"],
            )
            .await;
            assert_gtls_ok(&format!("{name}: GETs through the proxy"), &log, 3);
            let hello = std::fs::read_to_string(dir.join("hello")).expect("saved /hello");
            assert!(hello.starts_with("hello from upstream"), "{name}: {hello}");
            let headers = std::fs::read_to_string(dir.join("headers")).expect("saved /headers");
            assert!(
                headers.contains("x-forwarded-for: 127.0.0.1\n")
                    && headers.contains("forwarded: for=\"127.0.0.1:"),
                "{name}: {headers}"
            );
            assert_download(&dir, 3_000_000);

            let body: Vec<u8> = (0..2u64 << 20).map(upload_byte).collect();
            let file = rm.dir().join("upload.bin");
            std::fs::write(&file, &body).unwrap();
            let log = gtls(
                &rm,
                &[
                    dl,
                    "-m".into(),
                    "POST".into(),
                    format!("--data={}", file.display()),
                ],
                &["/sha256"],
            )
            .await;
            assert_gtls_ok(&format!("{name}: POST through the proxy"), &log, 1);
            let answer = std::fs::read_to_string(dir.join("sha256")).expect("saved /sha256");
            assert_eq!(
                answer,
                format!("POST {} {}\n", body.len(), sha256_hex(&body)),
                "{name}"
            );
        }
    })
    .await
}

/// aioquic through the reverse proxy: GET, a 1 MB download checked against the pattern, the
/// forwarded headers, and a 1 MB POST checked by SHA-256 at the upstream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aioquic_through_the_proxy() {
    if !tool::AIOQUIC.present() {
        return;
    }
    bounded(LIMIT, async {
        for (name, rm, _upstream) in proxies() {
            let args: Vec<String> = [
                "--path",
                "/hello",
                "--path",
                "/headers",
                "--path",
                "/bytes/1000000",
            ]
            .map(String::from)
            .to_vec();
            let out = aioquic(&rm, "paths", &args).await;
            let texts = out
                .get("texts")
                .and_then(Json::as_array)
                .cloned()
                .unwrap_or_default();
            assert_eq!(texts.len(), 3, "{name}: {out:?}");
            let hello = texts[0].as_str().unwrap();
            assert!(hello.starts_with("hello from upstream"), "{name}: {hello}");
            let headers = texts[1].as_str().unwrap();
            assert!(
                headers.contains("x-forwarded-for: 127.0.0.1\n")
                    && headers.contains("x-forwarded-proto: https\n"),
                "{name}: {headers}"
            );

            let n = 1_000_000u64;
            let args: Vec<String> = vec![
                "--path".into(),
                "/sha256".into(),
                "--upload-bytes".into(),
                n.to_string(),
            ];
            let out = aioquic(&rm, "upload", &args).await;
            let texts = out
                .get("texts")
                .and_then(Json::as_array)
                .cloned()
                .unwrap_or_default();
            let body: Vec<u8> = (0..n).map(upload_byte).collect();
            assert_eq!(
                texts.first().and_then(|t| t.as_str()),
                Some(format!("POST {n} {}\n", sha256_hex(&body)).as_str()),
                "{name}: {out:?}"
            );
        }
    })
    .await
}

// ---------------------------------------------------------------------------------------------
// Reloads: new worker generations while clients keep transferring

/// The kernel's drop count of the UDP socket bound to `port` (the `drops` column of
/// `/proc/net/udp`): datagrams that overflowed its receive buffer. The system-wide
/// `RcvbufErrors` of `/proc/net/snmp` also counts the clients' own sockets, which a 50 MiB
/// download into a small default buffer overflows now and then.
fn socket_drops(port: u16) -> u64 {
    let table = std::fs::read_to_string("/proc/net/udp").expect("reading /proc/net/udp");
    let port = format!(":{port:04X}");
    let row = table
        .lines()
        .find(|l| {
            l.split_whitespace()
                .nth(1)
                .is_some_and(|a| a.ends_with(&port))
        })
        .unwrap_or_else(|| panic!("no socket on {port} in /proc/net/udp:\n{table}"));
    row.split_whitespace().last().unwrap().parse().unwrap()
}

/// Workers of the draining generations still up.
fn draining(m: &harness::Metrics) -> f64 {
    m.sum_where(names::GENERATION_WORKERS, "state", "draining")
}

/// h3-probe (16 connections × 8 streams) and a 50 MiB download each with gtlsclient and aioquic
/// run across three reloads in a row, an upgrade of the demux itself, and one more reload.
/// Every reload and the upgrade succeed; the upgrade keeps the demux's PID and every worker
/// process; no request fails (requests a draining worker turns away with GOAWAY move to a new
/// connection, as clients do); both downloads are complete and exact; the demux drops nothing
/// and the kernel overflows nothing on the public socket (its `/proc/net/udp` drop count, the
/// socket's share of `RcvbufErrors`) throughout; every replaced worker exits 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reloads_and_an_upgrade_under_load_lose_nothing() {
    if !tool::GTLSCLIENT.present() || !tool::AIOQUIC.present() {
        return;
    }
    bounded(Duration::from_secs(200), async {
        const N: u64 = 50 << 20;
        let rm = Ringmux::start(2, Forward::Shm, &["--grace", "60"]);
        let probe = harness::binary("h3-probe");
        let json = rm.dir().join("probe.json");
        let url = format!("https://127.0.0.1:{}/bytes/1000", rm.listen.port());
        let probe_args: Vec<String> = [
            "--url",
            &url,
            "--insecure",
            "--expect-len",
            "1000",
            "-c",
            "16",
            "-s",
            "8",
            "--seconds",
            "10",
            "--json",
        ]
        .iter()
        .map(|s| s.to_string())
        .chain([json.to_string_lossy().into_owned()])
        .collect();
        let dir = download_dir(&rm, "dl");
        let gtls_args = [format!("--download={}", dir.display())];
        let gtls_path = format!("/bytes/{N}");
        let aio_args = ["--bytes".to_string(), N.to_string()];
        let probe_run = tool::run(
            probe.to_str().unwrap(),
            &probe_args,
            rm.dir(),
            CLIENT_TIMEOUT,
        );
        let gtls_paths = [gtls_path.as_str()];
        let gtls_run = gtls(&rm, &gtls_args, &gtls_paths);
        let aio_run = aioquic(&rm, "download", &aio_args);
        let reloads = async {
            // Every client is connected: 16 + 2 connections on the first generation.
            rm.wait_for("18 connections", Duration::from_secs(20), |m| {
                m.sum(names::WORKER_CONNECTIONS) >= 18.0
            })
            .await;
            let port = rm.listen.port();
            let before = (rm.metrics().sum(names::DROPPED), socket_drops(port));
            let mut answers = Vec::new();
            for _ in 0..3 {
                answers.push(rm.reload(Duration::from_secs(30)).await);
            }
            let m = rm.metrics();
            let draining_then = draining(&m);
            // The serving generation's workers (draining ones may finish meanwhile).
            let serving = |m: &harness::Metrics| -> Vec<u32> {
                (0..2)
                    .map(|i| m.instance(names::WORKER_PID, i) as u32)
                    .collect()
            };
            let workers = serving(&m);
            let upgraded = rm.upgrade(Duration::from_secs(30)).await;
            let after_upgrade = (rm.metrics().sum(names::DROPPED), socket_drops(port));
            let workers_after = (serving(&rm.metrics()), harness::children_of(rm.pid));
            // Generation 5 would take generation 1's connection-ID slot, which the downloads
            // keep draining: the reload takes generation 6's, free once generation 2 (which
            // holds no long request) is done, and neither waits nor cuts. Were generation 2
            // still draining, three generations would be, and the reload would cut the oldest
            // (--max-draining): so wait until only generation 1 drains (generations 2 and 3
            // hold short requests alone): generation 1's two workers, no more. Exactly two: the
            // new demux image reports no generation until its workers' first reports.
            rm.wait_for("generations 2 and 3 gone", Duration::from_secs(30), |m| {
                draining(m) == 2.0
            })
            .await;
            answers.push(rm.reload(Duration::from_secs(90)).await);
            let after = (rm.metrics().sum(names::DROPPED), socket_drops(port));
            let upgrade = (upgraded, workers, workers_after, after_upgrade);
            (answers, upgrade, before, after, draining_then)
        };
        let (probe_out, gtls_log, aio, (answers, upgrade, before, after, draining_then)) =
            tokio::join!(probe_run, gtls_run, aio_run, reloads);

        for ((ok, text), generation) in answers.iter().zip([2, 3, 4, 6]) {
            assert!(ok, "reload to generation {generation}: {text}");
            assert!(
                text.contains(&format!("ok generation={generation}")),
                "{text}"
            );
        }
        let ((ok, text), workers, workers_after, after_upgrade) = upgrade;
        assert!(ok, "upgrade: {text}");
        assert!(
            text.contains(&format!("ok upgraded: pid {}", rm.pid)),
            "{text}"
        );
        assert!(workers.iter().all(|&p| p > 0), "{workers:?}");
        assert_eq!(
            workers, workers_after.0,
            "the serving workers after the upgrade"
        );
        for pid in &workers {
            assert!(
                workers_after.1.contains(pid),
                "worker {pid} is no child of the demux after the upgrade: {workers_after:?}"
            );
        }
        assert!(
            draining_then >= 1.0,
            "the downloads kept a replaced generation draining across the reloads"
        );
        assert_eq!(
            before, after_upgrade,
            "(demux drops, kernel drops on the public socket) during the reloads and the upgrade"
        );
        assert_eq!(
            before, after,
            "(demux drops, kernel drops on the public socket) during the last reload"
        );
        let report: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&json).expect("the --json report")).unwrap();
        assert_eq!(
            report["errors"]["total"].as_u64(),
            Some(0),
            "{report}\n{}",
            probe_out.stdout
        );
        assert!(report["requests"].as_u64().unwrap() > 1000, "{report}");
        assert!(
            report["goaways"].as_u64().unwrap() > 0,
            "no draining seen: {report}"
        );
        assert_gtls_ok("50 MiB download across reloads", &gtls_log, 1);
        assert_download(&dir, N);
        assert_eq!(bodies(&aio), 1);
        assert_download(rm.dir(), N);

        // Every replaced worker exits once its last connection is done, with status 0.
        let m = rm
            .wait_for(
                "no draining generation left",
                Duration::from_secs(30),
                |m| draining(m) == 0.0,
            )
            .await;
        assert_eq!(m.get(names::GENERATION_ACTIVE), 6.0);
        assert_eq!(m.labelled(names::RELOADS, "result", "ok"), 4.0);
        assert_eq!(m.labelled(names::UPGRADES, "result", "ok"), 1.0);
        assert_eq!(m.labelled(names::UPGRADES, "result", "failed"), 0.0);
        let exited = |log: &str| log.lines().filter(|l| l.contains("worker exited")).count();
        let log = rm
            .wait_for_log("every old worker's exit", Duration::from_secs(20), |log| {
                exited(log) >= 8
            })
            .await;
        let exits: Vec<&str> = log
            .lines()
            .filter(|l| l.contains("worker exited"))
            .collect();
        assert_eq!(exits.len(), 8, "4 generations × 2 workers: {exits:#?}");
        assert!(
            exits.iter().all(|l| l.contains("unix_wait_status(0)")),
            "{exits:#?}"
        );
        assert!(!log.contains("killing"), "nothing killed:\n{log}");
        assert!(!log.contains("cutting"), "nothing cut:\n{log}");
        rm.wait_balanced(Duration::from_secs(10)).await;
    })
    .await
}

/// What a worker program that is a shell script exec'ing the built-in worker reads beyond
/// itself (`--worker-read`): the shell and the worker.
fn script_reads() -> String {
    format!("/bin,/usr/bin,{}", harness::worker_bin().display())
}

/// Writes an executable shell script `name` into `dir`.
fn script(dir: &Path, name: &str, body: &str) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let path = dir.join(name);
    std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path
}

/// A reload whose new worker program exits at once is abandoned: `ringmux reload` fails and
/// says why, the first generation serves on (a client still gets its page), and a reload with
/// the program mended succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_reload_leaves_the_old_generation_serving() {
    if !tool::GTLSCLIENT.present() {
        return;
    }
    bounded(LIMIT, async {
        let bin = temp_dir("ringmux-reload-bin");
        let worker = harness::worker_bin();
        let good = format!("exec {} \"$@\"", worker.display());
        let prog = script(bin.path(), "worker.sh", &good);
        let cmd = prog.to_string_lossy().into_owned();
        let reads = script_reads();
        let rm = Ringmux::start(
            2,
            Forward::Shm,
            &["--worker-cmd", &cmd, "--worker-read", &reads],
        );
        assert_gtls_ok("before", &gtls(&rm, &[], &["/hello.txt"]).await, 1);

        script(bin.path(), "worker.sh", "echo 'broken build' >&2; exit 3");
        let (ok, text) = rm.reload(Duration::from_secs(30)).await;
        assert!(!ok, "{text}");
        assert!(
            text.contains("generation 2 abandoned")
                && text.contains("exited before it reported READY")
                && text.contains("generation 1 serves on"),
            "{text}"
        );
        let m = rm.metrics();
        assert_eq!(m.get(names::GENERATION_ACTIVE), 1.0);
        assert_eq!(m.labelled(names::RELOADS, "result", "failed"), 1.0);
        assert_gtls_ok(
            "after the failed reload",
            &gtls(&rm, &[], &["/hello.txt"]).await,
            1,
        );

        script(bin.path(), "worker.sh", &good);
        let (ok, text) = rm.reload(Duration::from_secs(30)).await;
        assert!(ok && text.contains("ok generation=2"), "{text}");
        assert_gtls_ok(
            "after the good reload",
            &gtls(&rm, &[], &["/hello.txt"]).await,
            1,
        );
        let m = rm.metrics();
        assert_eq!(m.get(names::GENERATION_ACTIVE), 2.0);
        assert_eq!(m.labelled(names::RELOADS, "result", "ok"), 1.0);
    })
    .await
}

/// An upgrade to a binary that exits at once, or that speaks another worker protocol, is refused
/// before anything is handed over; one whose new image refuses the state it is given (a wrapper
/// that changes `--forward`) goes back to the old binary, which takes the state back. Each time
/// `ringmux upgrade` fails with the reason and the old demux serves on: same PID, same workers,
/// a client still gets its page. A good binary then upgrades.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_upgrade_leaves_the_old_demux_serving() {
    if !tool::GTLSCLIENT.present() {
        return;
    }
    bounded(LIMIT, async {
        use ringmux_demux::upgrade::{Compat, STATE_FORMAT};
        let bin = temp_dir("ringmux-upgrade-bin");
        let demux = bin.path().join("ringmux");
        let real = harness::binary("ringmux").display().to_string();
        std::fs::copy(&real, &demux).unwrap();
        let rm = Ringmux::start_in(
            temp_dir("ringmux-e2e"),
            &demux,
            2,
            Forward::Shm,
            &[],
            harness::worker_bin(),
            &[],
        );
        assert_gtls_ok("before", &gtls(&rm, &[], &["/hello.txt"]).await, 1);
        let workers = rm.worker_pids().await;
        // The running binary cannot be written (ETXTBSY): a deploy replaces the file.
        let replace = |body: &str| {
            std::fs::remove_file(&demux).unwrap();
            script(bin.path(), "ringmux", body);
        };
        let ours = Compat::ours();
        let cases = [
            ("exit 1".to_string(), "failed `upgrade-check`"),
            (
                format!(
                    "echo 'ringmux-upgrade state-format={STATE_FORMAT} protocol={} \
                     ring-layout={}'",
                    ours.protocol + 1,
                    ours.ring_layout
                ),
                "worker protocol version",
            ),
            (
                format!(
                    "case \"$1\" in upgrade-check) exec {real} \"$@\";; esac\n\
                     exec {real} $(echo \"$@\" | sed 's/--forward shm/--forward unix/')"
                ),
                "the new binary refused the hand-over",
            ),
        ];
        for (i, (body, why)) in cases.iter().enumerate() {
            replace(body);
            let (ok, text) = rm.upgrade(Duration::from_secs(30)).await;
            assert!(!ok, "case {i}: {text}");
            assert!(
                text.contains(why) && text.contains("serves on"),
                "case {i}: {text}"
            );
            assert_gtls_ok(
                &format!("after failed upgrade {i}"),
                &gtls(&rm, &[], &["/hello.txt"]).await,
                1,
            );
            assert_eq!(rm.worker_pids().await, workers, "case {i}");
            let m = rm.metrics();
            assert_eq!(
                m.labelled(names::UPGRADES, "result", "failed"),
                (i + 1) as f64
            );
            assert_eq!(m.labelled(names::UPGRADES, "result", "ok"), 0.0);
        }

        replace(&format!("exec {real} \"$@\""));
        let (ok, text) = rm.upgrade(Duration::from_secs(30)).await;
        assert!(ok, "{text}");
        assert!(
            text.contains(&format!("ok upgraded: pid {}", rm.pid)),
            "{text}"
        );
        assert_gtls_ok(
            "after the upgrade",
            &gtls(&rm, &[], &["/hello.txt"]).await,
            1,
        );
        assert_eq!(rm.worker_pids().await, workers);
        let m = rm.metrics();
        assert_eq!(m.labelled(names::UPGRADES, "result", "ok"), 1.0);
        assert_eq!(m.labelled(names::UPGRADES, "result", "failed"), 3.0);
        rm.wait_balanced(Duration::from_secs(10)).await;
    })
    .await
}

/// SIGTERM while a reload is still starting its workers: the reload fails with the reason,
/// every generation drains (the new workers too, once they start), and ringmux exits 0. Also
/// SIGHUP reloads like `ringmux reload`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_during_a_reload_drains_every_generation() {
    bounded(LIMIT, async {
        let bin = temp_dir("ringmux-reload-bin");
        let (slow, fifo) = (bin.path().join("slow"), bin.path().join("fifo"));
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        // The workers (nobody, when the tests run as root) open it read-write.
        std::fs::set_permissions(
            &fifo,
            std::os::unix::fs::PermissionsExt::from_mode(0o666),
        )
        .unwrap();
        // While `slow` exists, a new worker waits 3 s before it starts (a builtin read on a
        // fifo nobody writes: no child process, which the sandbox would refuse).
        let prog = bin.path().join("worker.sh");
        std::fs::write(
            &prog,
            format!(
                "#!/bin/bash\nif [ -e {slow} ]; then read -r -t 3 _ <> {fifo}; fi\nexec {worker} \"$@\"\n",
                slow = slow.display(),
                fifo = fifo.display(),
                worker = harness::worker_bin().display()
            ),
        )
        .unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&prog, std::fs::Permissions::from_mode(0o755)).unwrap();
        let cmd = prog.to_string_lossy().into_owned();
        // The script opens the fifo beside it for reading and writing.
        let (reads, writes) = (script_reads(), bin.path().to_string_lossy().into_owned());
        let mut rm = Ringmux::start(
            2,
            Forward::Shm,
            &[
                "--worker-cmd",
                &cmd,
                "--grace",
                "20",
                "--worker-read",
                &reads,
                "--worker-write",
                &writes,
            ],
        );

        // SIGHUP: generation 2.
        rm.signal(libc::SIGHUP);
        rm.wait_for("generation 2 serving", Duration::from_secs(20), |m| {
            m.get(names::GENERATION_ACTIVE) == 2.0
        })
        .await;

        std::fs::write(&slow, b"").unwrap();
        let log = rm.dir().join("ringmux.log");
        let reload = rm.reload(Duration::from_secs(30));
        let term = async {
            // Both of generation 3's workers are started (and wait in the script): stop now.
            let deadline = Instant::now() + Duration::from_secs(20);
            while std::fs::read_to_string(&log)
                .unwrap_or_default()
                .lines()
                .filter(|l| l.contains("worker started") && l.contains("generation=3"))
                .count()
                < 2
            {
                assert!(Instant::now() < deadline, "generation 3 never started");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            rm.signal(libc::SIGTERM);
        };
        let ((ok, text), ()) = tokio::join!(reload, term);
        assert!(!ok, "{text}");
        assert!(text.contains("a shutdown came first"), "{text}");
        let status = rm.wait_exit(Duration::from_secs(30)).await;
        assert!(status.success(), "{status:?}");
        let log = std::fs::read_to_string(&log).unwrap();
        assert!(!log.contains("killing"), "every worker drained:\n{log}");
        let exits = log.lines().filter(|l| l.contains("worker exited")).count();
        assert_eq!(exits, 6, "generations 1, 2 and 3, 2 workers each:\n{log}");
    })
    .await
}
