//! WebSockets through the proxy (`server/src/proxy/tunnel.rs`): a Python `websockets` echo
//! service behind ringmux, Python clients over HTTP/1.1 (`websockets`) and HTTP/2 extended
//! CONNECT (`h2`, RFC 8441), the cap, the idle timeout, an unasked 101, each counted and in
//! the access log (`test-tools/python/ws_client.py` says what each client does). Tunnels
//! across a reload, with and without `--tunnel-drain`; bad inputs (data before the 101, bytes
//! that are no WebSocket frame, an upstream that resets, a client that never reads), each
//! ending its own tunnel only while a request beside it is answered.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use ringmux_systests::harness;

use harness::{bounded, Forward, PyUpstream, Ringmux};
use ringmux_testkit::temp_dir;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, Command};

const LIMIT: Duration = Duration::from_secs(180);

const OPENED: &str = "ringmux_worker_tunnels_opened_total";
const CLOSED: &str = "ringmux_worker_tunnels_closed_total";
const REFUSED: &str = "ringmux_worker_tunnels_refused_total";
const BYTES: &str = "ringmux_worker_tunnel_bytes_total";

/// `ws_client.py ARGS` as [`client`] starts it, its stdin piped too (`many`, `flood`).
fn commanded(rm: &Ringmux, args: &[&str]) -> Child {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../test-tools/python/ws_client.py");
    let port = rm.listen.port().to_string();
    let mut cmd = Command::new("python3");
    cmd.arg(&script).arg(args[0]).arg(&port).args(&args[1..]);
    cmd.stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .kill_on_drop(true);
    cmd.spawn()
        .unwrap_or_else(|e| panic!("python3 {}: {e}", script.display()))
}

/// A GET of `path` over HTTPS on TCP with curl: the status and the body.
async fn get(rm: &Ringmux, path: &str) -> (String, String) {
    let out = Command::new("curl")
        .args(["-sk", "-w", "\n%{http_code}"])
        .arg(format!("https://127.0.0.1:{}{path}", rm.listen.port()))
        .output()
        .await
        .expect("curl");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, status) = text.rsplit_once('\n').unwrap_or(("", &text));
    (status.to_owned(), body.trim().to_owned())
}

/// ringmux (one worker) proxying to `ws_upstream.py`, with an access log and `extra`.
fn start(extra: &[&str]) -> (PyUpstream, ringmux_testkit::TempDir, PathBuf, Ringmux) {
    let py = PyUpstream::start_script("ws_upstream.py");
    let logs = temp_dir("ringmux-tunnel-log");
    let log = logs.path().join("access.log");
    let url = py.url();
    let mut args = vec![
        "--upstream",
        url.as_str(),
        "--access-log",
        log.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    let rm = Ringmux::start(1, Forward::Shm, &args);
    (py, logs, log, rm)
}

/// `ws_client.py ARGS` against ringmux's TCP port, its stdout piped.
fn client(rm: &Ringmux, args: &[&str]) -> Child {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../test-tools/python/ws_client.py");
    let port = rm.listen.port().to_string();
    let mut cmd = Command::new("python3");
    cmd.arg(&script).arg(args[0]).arg(&port).args(&args[1..]);
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .kill_on_drop(true);
    cmd.spawn()
        .unwrap_or_else(|e| panic!("python3 {}: {e}", script.display()))
}

/// Every line `child` writes until it exits, and whether it exited 0.
async fn finish(child: Child) -> (Vec<String>, bool) {
    let out = child.wait_with_output().await.expect("ws_client.py");
    let text = String::from_utf8_lossy(&out.stdout);
    (
        text.lines().map(str::to_owned).collect(),
        out.status.success(),
    )
}

/// The next line `child` writes.
async fn next_line(lines: &mut tokio::io::Lines<BufReader<tokio::process::ChildStdout>>) -> String {
    lines
        .next_line()
        .await
        .expect("reading ws_client.py")
        .expect("ws_client.py ended without a line")
}

/// The access log's lines for `path`, once there are `n` (the worker writes them off its
/// request path).
async fn log_lines(log: &Path, path: &str, n: usize) -> Vec<Vec<String>> {
    loop {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        let lines: Vec<Vec<String>> = text
            .lines()
            .map(|l| l.split(' ').map(str::to_owned).collect::<Vec<_>>())
            .filter(|f| f.get(5).map(String::as_str) == Some(path))
            .collect();
        if lines.len() >= n {
            return lines;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// 1 000 messages both ways and a 50 MiB binary message over HTTP/1.1, 1 000 messages over
/// HTTP/2 extended CONNECT; each tunnel counted, its bytes both ways counted, and its line
/// logged at its end: 101 (200 for HTTP/2), bytes down, `ok`, then bytes up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn websocket_echo_over_http1_and_http2() {
    let (_py, _logs, log, rm) = start(&[]);
    bounded(LIMIT, async {
        let (out, ok) = finish(client(&rm, &["echo", "/echo", "1000", "50"])).await;
        assert!(ok && out == ["ok 1000 50"], "{out:?}");
        let (out, ok) = finish(client(&rm, &["h2", "/echo", "1000"])).await;
        assert!(ok && out == ["ok 1000"], "{out:?}");

        let m = rm
            .wait_for("both tunnels closed", LIMIT, |m| m.sum(CLOSED) >= 2.0)
            .await;
        assert_eq!(m.sum(OPENED), 2.0, "{m}");
        assert_eq!(m.sum_where(CLOSED, "how", "closed"), 2.0, "{m}");
        let up = m.sum_where(BYTES, "direction", "up");
        let down = m.sum_where(BYTES, "direction", "down");
        assert!(up > (50 << 20) as f64 && down > (50 << 20) as f64, "{m}");

        let lines = log_lines(&log, "/echo", 2).await;
        let by_proto = |p: &str| {
            lines
                .iter()
                .find(|f| f[2] == p)
                .unwrap_or_else(|| panic!("no {p} line: {lines:?}"))
                .clone()
        };
        let (h1, h2) = (by_proto("h1"), by_proto("h2"));
        assert_eq!((h1[3].as_str(), h1[6].as_str()), ("GET", "101"), "{h1:?}");
        assert_eq!(
            (h2[3].as_str(), h2[6].as_str()),
            ("CONNECT", "200"),
            "{h2:?}"
        );
        for f in [&h1, &h2] {
            assert_eq!(f.len(), 13, "{f:?}");
            assert_eq!(f[11], "ok", "{f:?}");
            let (down, up): (u64, u64) = (f[7].parse().unwrap(), f[12].parse().unwrap());
            assert!(down > 1000 && up > 1000, "{f:?}");
        }
        let h1_down: u64 = h1[7].parse().unwrap();
        assert!(h1_down > 50 << 20, "{h1:?}");
    })
    .await;
}

/// `--max-tunnels 1`: a second WebSocket gets 503 while the first is open, counted; an
/// upstream that answers 101 to a request that asked for no upgrade is a 502, counted as a
/// protocol error; one that refuses the upgrade is answered as it answered (403).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cap_an_unasked_101_and_a_refusal() {
    let (_py, _logs, _log, rm) = start(&["--max-tunnels", "1"]);
    bounded(LIMIT, async {
        let mut first = client(&rm, &["hold", "/echo"]);
        let mut lines = BufReader::new(first.stdout.take().unwrap()).lines();
        assert_eq!(next_line(&mut lines).await, "open");
        let (out, _) = finish(client(&rm, &["status", "/echo"])).await;
        assert_eq!(out, ["status 503"]);
        // The report reaches the demux about once a second.
        rm.wait_for("the refusal counted", LIMIT, |m| {
            m.sum(REFUSED) == 1.0 && m.sum(OPENED) == 1.0
        })
        .await;
        first.kill().await.expect("kill the first client");
        rm.wait_for("the first tunnel closed", LIMIT, |m| m.sum(CLOSED) == 1.0)
            .await;
        let (out, _) = finish(client(&rm, &["status", "/refuse"])).await;
        assert_eq!(out, ["status 403"]);

        let out = Command::new("curl")
            .args(["-sk", "-o", "/dev/null", "-w", "%{http_code}"])
            .arg(format!("https://127.0.0.1:{}/unasked", rm.listen.port()))
            .output()
            .await
            .expect("curl");
        assert_eq!(String::from_utf8_lossy(&out.stdout), "502");
        rm.wait_for("the unasked 101 counted", LIMIT, |m| {
            m.sum_where(
                ringmux_demux::metrics::names::WORKER_UPSTREAM_ERRORS,
                "kind",
                "protocol",
            ) == 1.0
        })
        .await;
    })
    .await;
}

/// `--tunnel-idle 1`: a WebSocket that sends nothing is closed (no close frame: the proxy
/// does not speak WebSocket), counted as idle, its line ending `cut:timeout`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_tunnel_is_closed() {
    let (_py, _logs, log, rm) = start(&["--tunnel-idle", "1"]);
    bounded(LIMIT, async {
        let (out, _) = finish(client(&rm, &["hold", "/echo"])).await;
        assert_eq!(out, ["open", "closed 1006"]);
        let m = rm
            .wait_for("the idle tunnel counted", LIMIT, |m| m.sum(CLOSED) >= 1.0)
            .await;
        assert_eq!(m.sum_where(CLOSED, "how", "idle"), 1.0, "{m}");
        let lines = log_lines(&log, "/echo", 1).await;
        assert_eq!(lines[0][6], "101", "{lines:?}");
        assert_eq!(lines[0][11], "cut:timeout", "{lines:?}");
    })
    .await;
}

/// `--tunnel-drain 1 --tunnel-drain-spread 3`: eight WebSockets across a reload live on in the
/// draining worker, then each is closed with 1001, the client told and the upstream too, at
/// times spread over the window (not all the same), each line ending `cut:drain`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_closes_websockets_with_1001_spread_after_tunnel_drain() {
    let drain = ["--tunnel-drain", "1", "--tunnel-drain-spread", "3"];
    let (_py, _logs, log, rm) = start(&drain);
    bounded(LIMIT, async {
        let mut many = commanded(&rm, &["many", "/echo", "8"]);
        let mut stdin = many.stdin.take().unwrap();
        let mut lines = BufReader::new(many.stdout.take().unwrap()).lines();
        assert_eq!(next_line(&mut lines).await, "open 8");
        stdin.write_all(b"echo\n").await.unwrap();
        assert_eq!(next_line(&mut lines).await, "echoed 8");

        let (ok, text) = rm.reload(Duration::from_secs(30)).await;
        assert!(ok, "reload: {text}");
        stdin.write_all(b"wait\n").await.unwrap();
        let mut times = Vec::new();
        for _ in 0..8 {
            let line = next_line(&mut lines).await;
            let f: Vec<&str> = line.split(' ').collect();
            assert_eq!(f[..2], ["closed", "1001"], "{line}");
            times.push(f[2].parse::<u64>().unwrap());
        }
        times.sort_unstable();
        times.dedup();
        assert!(
            times.len() > 1,
            "every close at the same instant: {times:?}"
        );

        // The upstream was sent 1001 on each too (a new request reaches the new generation).
        let codes = loop {
            let (status, body) = get(&rm, "/closes").await;
            assert_eq!(status, "200", "{body}");
            let codes: Vec<String> = body.split_whitespace().map(str::to_owned).collect();
            if codes.len() >= 8 {
                break codes;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        assert_eq!(codes, vec!["1001"; 8]);
        let lines = log_lines(&log, "/echo", 8).await;
        for f in &lines {
            assert_eq!(
                (f[6].as_str(), f[11].as_str()),
                ("101", "cut:drain"),
                "{f:?}"
            );
        }
    })
    .await;
}

/// Without `--tunnel-drain` (off, the default), WebSockets outlive a reload in the draining
/// worker and go on echoing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_tunnel_drain_websockets_outlive_a_reload() {
    let (_py, _logs, _log, rm) = start(&[]);
    bounded(LIMIT, async {
        let mut many = commanded(&rm, &["many", "/echo", "4"]);
        let mut stdin = many.stdin.take().unwrap();
        let mut lines = BufReader::new(many.stdout.take().unwrap()).lines();
        assert_eq!(next_line(&mut lines).await, "open 4");
        for _ in 0..2 {
            let (ok, text) = rm.reload(Duration::from_secs(30)).await;
            assert!(ok, "reload: {text}");
            stdin.write_all(b"echo\n").await.unwrap();
            assert_eq!(next_line(&mut lines).await, "echoed 4");
        }
        let m = rm.metrics();
        assert_eq!(m.sum(CLOSED), 0.0, "{m}");
    })
    .await;
}

/// A client that sends a frame before the 101 has it echoed once the tunnel is up; one that
/// sends bytes that are no WebSocket frame is cut, counted as `malformed`; an upstream that
/// resets mid-tunnel ends that tunnel only, counted as `error`. A WebSocket and a request
/// beside them are answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn early_data_garbage_and_a_reset_end_only_their_tunnel() {
    let (_py, _logs, _log, rm) = start(&[]);
    bounded(LIMIT, async {
        let (out, _) = finish(client(&rm, &["early", "/echo"])).await;
        assert_eq!(out, ["status 101", "echo early"]);
        let (out, _) = finish(client(&rm, &["garbage", "/echo"])).await;
        assert_eq!(out, ["status 101", "closed"]);
        let (out, _) = finish(client(&rm, &["early", "/reset"])).await;
        assert_eq!(out, ["status 101", "closed"]);
        let m = rm
            .wait_for("the three tunnels ended", LIMIT, |m| m.sum(CLOSED) >= 3.0)
            .await;
        assert_eq!(m.sum_where(CLOSED, "how", "malformed"), 1.0, "{m}");
        // The reset, and the early client too when it leaves without TLS's close_notify.
        assert!(m.sum_where(CLOSED, "how", "error") >= 1.0, "{m}");
        assert_eq!(m.sum(CLOSED), 3.0, "{m}");

        let (out, ok) = finish(client(&rm, &["echo", "/echo", "100", "1"])).await;
        assert!(ok && out == ["ok 100 1"], "{out:?}");
        let (status, _) = get(&rm, "/closes").await;
        assert_eq!(status, "200");
    })
    .await;
}

/// A client that sends and never reads: its tunnel fills the buffers on its way and stops,
/// well short of what it tried to send, while a WebSocket and a request beside it are
/// answered; killed, its tunnel ends and is counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_never_reads_stalls_only_its_tunnel() {
    let (_py, _logs, _log, rm) = start(&[]);
    bounded(LIMIT, async {
        let mut flood = commanded(&rm, &["flood", "/echo"]);
        let mut lines = BufReader::new(flood.stdout.take().unwrap()).lines();
        assert_eq!(next_line(&mut lines).await, "status 101");
        let line = next_line(&mut lines).await;
        let sent: u64 = match line.strip_prefix("stalled ") {
            Some(n) => n.parse().unwrap(),
            None => panic!("the flood never stalled: {line}"),
        };
        // Socket buffers on the way (each a few MiB at most) and one 16 KiB buffer per
        // direction in the worker: far below what an unbounded buffer would take in.
        assert!(sent < 256 << 20, "{sent} bytes taken in before the stall");

        let (out, ok) = finish(client(&rm, &["echo", "/echo", "100", "1"])).await;
        assert!(ok && out == ["ok 100 1"], "{out:?}");
        let (status, _) = get(&rm, "/closes").await;
        assert_eq!(status, "200");

        flood.kill().await.expect("kill the flood");
        rm.wait_for("both tunnels ended", LIMIT, |m| {
            m.sum(OPENED) == 2.0 && m.sum(CLOSED) == 2.0
        })
        .await;
    })
    .await;
}
