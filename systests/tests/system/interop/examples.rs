//! Applications built on the `ringmux-worker` library, run as the instances with
//! `--worker-cmd`: the examples `worker/examples/h3-hello.rs` (h3) and `echo.rs` (raw quinn,
//! ALPN `echo`). Checked: connections land on every instance in shm and unix modes, a client
//! migrates mid-transfer, a killed instance's clients get a stateless reset and its replacement
//! serves, 0-RTT resumes on another instance, the demux reports what the instances run, and
//! the echo example's own counters reach the metrics.
//! gtlsclient and aioquic against h3-hello are in `e2e_interop.rs`.

use ringmux_systests::harness;

use std::net::UdpSocket;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use harness::{bounded, dcid_routed_to, zero_rtt_across, Forward, Ringmux, SERVER_NAME};
use http::{Method, StatusCode};
use quinn::ConnectionId;
use ringmux_demux::metrics::names;
use ringmux_testkit::client::client_config_alpn;

const LIMIT: Duration = Duration::from_secs(120);

/// An example binary, built beside ringmux by `cargo build --examples` (scripts/test.sh).
pub fn example(name: &str) -> PathBuf {
    harness::binary(&format!("examples/{name}"))
}

/// ringmux with `instances` instances of the example `name`.
fn start_example(name: &str, instances: u8, forward: Forward, extra: &[&str]) -> Ringmux {
    let cmd = example(name).to_string_lossy().into_owned();
    let mut args = vec!["--worker-cmd", cmd.as_str()];
    args.extend_from_slice(extra);
    Ringmux::start(instances, forward, &args)
}

fn body_text(resp: &ringmux_testkit::client::Response) -> String {
    String::from_utf8_lossy(resp.body.as_deref().unwrap_or_default()).into_owned()
}

/// Every instance answers its pinned clients, with its own instance number; the JSON echo
/// echoes; the demux reports the program.
async fn h3_hello_on_every_instance(forward: Forward) {
    let rm = start_example("h3-hello", 3, forward, &[]);
    for i in 0..3u8 {
        let client = rm.pinned_client(i);
        let conn = rm.connect(&client).await;
        let resp = conn.get_body("/").await.expect("GET /");
        assert_eq!(resp.status, StatusCode::OK);
        let text = body_text(&resp);
        assert!(text.contains(&format!("\"instance\":{i}")), "{text}");
        let echo = conn
            .request(
                Method::POST,
                "/echo",
                Some(Bytes::from_static(br#"{"x":[1,2,3]}"#)),
                true,
            )
            .await
            .expect("POST /echo");
        assert_eq!(echo.status, StatusCode::OK);
        assert!(
            body_text(&echo).contains(r#""echo":{"x":[1,2,3]}"#),
            "{}",
            body_text(&echo)
        );
        let bad = conn
            .request(
                Method::POST,
                "/echo",
                Some(Bytes::from_static(b"{nope")),
                true,
            )
            .await
            .expect("POST /echo with a bad body");
        assert_eq!(bad.status, StatusCode::BAD_REQUEST);
        conn.close().await.expect("clean close");
    }
    let m = rm.metrics();
    for i in 0..3u8 {
        assert!(m.instance(names::FORWARDED, i) > 0.0, "instance {i}:\n{m}");
    }
    let programs = m.label_values(names::WORKER_INFO, "program");
    assert_eq!(programs.len(), 3, "{m}");
    assert!(
        programs.iter().all(|p| p.ends_with("examples/h3-hello")),
        "{programs:?}"
    );
    // The same application over TCP, through `Worker::tcp_listener` (curl, when installed).
    if ringmux_testkit::tool::CURL.present() {
        let url = format!("https://{}/echo", rm.listen);
        let out = tokio::process::Command::new("curl")
            .args([
                "-sk",
                "--http2",
                "-i",
                "-X",
                "POST",
                "--data",
                r#"{"y":true}"#,
            ])
            .arg(&url)
            .output()
            .await
            .expect("curl");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(text.contains(r#""echo":{"y":true}"#), "{text}");
        assert!(text.to_ascii_lowercase().contains("alt-svc: h3="), "{text}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h3_hello_on_every_instance_shm() {
    bounded(LIMIT, h3_hello_on_every_instance(Forward::Shm)).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h3_hello_on_every_instance_unix() {
    bounded(LIMIT, h3_hello_on_every_instance(Forward::Unix)).await
}

/// A raw quinn client of the echo example, pinned to `instance`.
fn echo_client(rm: &Ringmux, instance: u8) -> quinn::Endpoint {
    let mut cfg = client_config_alpn(None, b"echo").expect("client config");
    let router = rm.router.clone();
    cfg.initial_dst_cid_provider(Arc::new(move || {
        ConnectionId::new(&dcid_routed_to(&router, instance, 20))
    }));
    let mut ep = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).expect("client endpoint");
    ep.set_default_client_config(cfg);
    ep
}

/// Every instance echoes; on instance 1 the client moves to a new UDP port in the middle of a
/// 4 MiB stream, and every byte still comes back in order.
async fn echo_with_migration(forward: Forward) {
    const N: usize = 4 << 20;
    let rm = start_example("echo", 3, forward, &[]);
    for i in 0..3u8 {
        let ep = echo_client(&rm, i);
        let conn = ep
            .connect(rm.listen, SERVER_NAME)
            .unwrap()
            .await
            .unwrap_or_else(|e| panic!("connecting to instance {i}: {e}"));
        let (mut send, mut recv) = conn.open_bi().await.expect("open stream");
        let data: Arc<Vec<u8>> = Arc::new((0..N).map(|k| (k % 251) as u8).collect());
        let reader = tokio::spawn(async move { recv.read_to_end(N + 1).await });
        let mut moved = false;
        for (k, chunk) in data.chunks(64 << 10).enumerate() {
            send.write_all(chunk).await.expect("write");
            if i == 1 && k == 16 {
                let before = ep.local_addr().unwrap();
                ep.rebind(UdpSocket::bind("127.0.0.1:0").unwrap())
                    .expect("rebind");
                assert_ne!(before.port(), ep.local_addr().unwrap().port());
                moved = true;
            }
        }
        send.finish().expect("finish");
        let back = reader.await.unwrap().expect("echoed stream");
        assert_eq!(back.len(), N, "instance {i}");
        assert!(back == *data, "instance {i}: echoed bytes differ");
        assert_eq!(moved, i == 1);
        conn.close(0u32.into(), b"done");
        ep.wait_idle().await;
    }
    let m = rm.metrics();
    for i in 0..3u8 {
        assert!(m.instance(names::FORWARDED, i) > 0.0, "instance {i}:\n{m}");
    }
    // The example's own counters (`Worker::counter`), which ringmux knows nothing of, reach
    // its metrics per instance, in the next report (once a second).
    let series = |i: u8, direction: &str| {
        format!("ringmux_worker_echo_bytes_total{{instance=\"{i}\",direction=\"{direction}\"}}")
    };
    let m = rm
        .wait_for(
            "the echo example's own counters",
            Duration::from_secs(10),
            |m| (0..3u8).all(|i| m.get(&series(i, "in")) == N as f64),
        )
        .await;
    for i in 0..3u8 {
        assert_eq!(m.get(&series(i, "out")), N as f64, "instance {i}:\n{m}");
        assert_eq!(
            m.get(&format!(
                "ringmux_worker_echo_streams_total{{instance=\"{i}\"}}"
            )),
            1.0
        );
    }
    assert_eq!(
        m.sum_where(names::WORKER_REPORT_PARTS_DROPPED, "kind", "series"),
        0.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn echo_with_migration_shm() {
    bounded(LIMIT, echo_with_migration(Forward::Shm)).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn echo_with_migration_unix() {
    bounded(LIMIT, echo_with_migration(Forward::Unix)).await
}

/// kill -9 of one instance: its client gets a stateless reset (every instance shares the reset
/// key, so the replacement can send it), the replacement serves, the others never notice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h3_hello_killed_instance_resets_and_is_replaced() {
    bounded(LIMIT, async {
        const VICTIM: u8 = 1;
        let rm = start_example("h3-hello", 3, Forward::Shm, &[]);
        let pids = rm.worker_pids().await;
        let client = rm.pinned_client(VICTIM);
        let victim = rm.connect(&client).await;
        assert_eq!(
            victim.get("/").await.expect("GET before").status,
            StatusCode::OK
        );
        let bystander_client = rm.pinned_client(0);
        let bystander = rm.connect(&bystander_client).await;

        let victim_pid = pids[usize::from(VICTIM)];
        harness::kill(victim_pid).expect("kill -9 of the worker");
        let killed_at = Instant::now();
        victim
            .get("/")
            .await
            .expect_err("a request on a dead instance's connection succeeded");
        let reason = victim.quic().close_reason();
        assert!(
            matches!(reason, Some(quinn::ConnectionError::Reset)),
            "ended with {reason:?} after {:?}, expected a stateless reset",
            killed_at.elapsed()
        );
        assert_eq!(
            bystander.get("/").await.expect("bystander").status,
            StatusCode::OK
        );
        rm.wait_for(
            "the replacement of instance 1",
            Duration::from_secs(20),
            |m| {
                m.instance(names::WORKER_RESTARTS, VICTIM) >= 1.0
                    && m.instance(names::WORKER_UP, VICTIM) == 1.0
            },
        )
        .await;
        let client = rm.pinned_client(VICTIM);
        let conn = rm.connect(&client).await;
        let resp = conn.get_body("/").await.expect("GET on the replacement");
        assert!(
            body_text(&resp).contains("\"instance\":1"),
            "{}",
            body_text(&resp)
        );
        let m = rm.metrics();
        for i in [0u8, 2] {
            assert_eq!(
                m.instance(names::WORKER_RESTARTS, i),
                0.0,
                "instance {i} restarted"
            );
        }
    })
    .await
}

/// A ticket issued by instance 0 resumes with 0-RTT on instance 2: the examples share sessions
/// through the demux without a line of code for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h3_hello_zero_rtt_on_another_instance() {
    bounded(LIMIT, async {
        let rm = start_example("h3-hello", 3, Forward::Shm, &[]);
        let (first, second) = zero_rtt_across(&rm, 0, 2, "/", "/").await;
        assert!(
            body_text(&first).contains("\"instance\":0"),
            "{}",
            body_text(&first)
        );
        assert!(
            body_text(&second).contains("\"instance\":2"),
            "{}",
            body_text(&second)
        );
    })
    .await
}

/// A program that is not a ringmux worker (it never reports READY) is named in the log and
/// replaced; with no instance ready, the demux gives up with a message naming it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_program_that_never_attaches_is_named() {
    bounded(LIMIT, async {
        let dir = ringmux_testkit::temp_dir("ringmux-notworker");
        let out = tokio::process::Command::new(harness::binary("ringmux"))
            .args([
                "--listen",
                "127.0.0.1:0",
                "--metrics",
                "off",
                "--instances",
                "2",
            ])
            .args(["--worker-cmd", "sleep 600", "--ready-timeout", "2"])
            .env("NO_COLOR", "1")
            .current_dir(dir.path())
            .output()
            .await
            .expect("running ringmux");
        let log = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success(),
            "ringmux served with no worker ready:\n{log}"
        );
        assert!(log.contains("did not report READY"), "{log}");
        assert!(
            log.contains("/sleep"),
            "the log does not name the program:\n{log}"
        );
        assert!(log.contains("no instance of the worker program"), "{log}");
    })
    .await
}

/// `--cpus`: the demux pins each worker before its program starts, so any program runs on its
/// CPU without a line of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_start_pinned_to_their_cpus() {
    bounded(LIMIT, async {
        let rm = start_example("h3-hello", 2, Forward::Shm, &["--cpus", "0,1,0"]);
        let pids = rm.worker_pids().await;
        for (i, pid) in pids.iter().enumerate() {
            let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
            let allowed = status
                .lines()
                .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
                .map(str::trim)
                .unwrap_or_default()
                .to_string();
            let want = if i == 0 { "1" } else { "0" };
            assert_eq!(allowed, want, "instance {i} (pid {pid})");
        }
    })
    .await
}
