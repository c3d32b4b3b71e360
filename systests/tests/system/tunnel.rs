//! WebSockets through the proxy (`server/src/proxy/tunnel.rs`): a Python `websockets` echo
//! service behind ringmux, Python clients over HTTP/1.1 (`websockets`) and HTTP/2 extended
//! CONNECT (`h2`, RFC 8441), the cap, the idle timeout, an unasked 101, each counted and in
//! the access log (`test-tools/python/ws_client.py` says what each client does).

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use ringmux_systests::harness;

use harness::{bounded, Forward, PyUpstream, Ringmux};
use ringmux_testkit::temp_dir;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

const LIMIT: Duration = Duration::from_secs(180);

const OPENED: &str = "ringmux_worker_tunnels_opened_total";
const CLOSED: &str = "ringmux_worker_tunnels_closed_total";
const REFUSED: &str = "ringmux_worker_tunnels_refused_total";
const BYTES: &str = "ringmux_worker_tunnel_bytes_total";

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
