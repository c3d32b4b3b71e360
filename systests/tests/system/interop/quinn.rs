//! End to end with the project's quinn + h3 client: real ringmux processes on loopback, every
//! scenario once over shared-memory rings and once over unix sockets.

use ringmux_systests::harness;

use ringmux_demux::metrics::names;
use std::net::UdpSocket;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use harness::{bounded, check_bytes, pin, zero_rtt_across, Forward, Ringmux, SERVER_NAME};

const LIMIT: Duration = Duration::from_secs(90);

/// The harness finds the binaries where cargo built them for these tests: in the profile's
/// folder of the target folder cargo names for this package's tests (`CARGO_TARGET_TMPDIR` is
/// its `tmp`; the ringmux binary is another package's, so there is no `CARGO_BIN_EXE_ringmux`).
#[test]
fn the_harness_runs_the_ringmux_cargo_built_for_these_tests() {
    let target = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .parent()
        .expect("the target folder");
    let profile = if cfg!(debug_assertions) {
        "debug"
    } else {
        "release"
    };
    let cargo = target.join(profile).join("ringmux");
    assert_eq!(
        harness::binary("ringmux").canonicalize().unwrap(),
        cargo.canonicalize().unwrap()
    );
}

/// 24 connections from one client socket, pinned round-robin over 3 instances, 4 GETs of
/// `/bytes/N` each (distinct N): every body is checked byte for byte, and the demux and the
/// workers must have seen it all on every instance.
async fn many_connections(forward: Forward) {
    const INSTANCES: u8 = 3;
    const CONNECTIONS: usize = 24;
    const GETS: usize = 4;
    let rm = Ringmux::start(INSTANCES, forward, &[]);
    let mut client = rm.client();
    let next = Arc::new(AtomicUsize::new(0));
    let turn = next.clone();
    pin(&mut client, rm.router.clone(), move || {
        (turn.fetch_add(1, Ordering::Relaxed) % usize::from(INSTANCES)) as u8
    });
    let client = Arc::new(client);
    let mut tasks = Vec::new();
    for c in 0..CONNECTIONS {
        let client = client.clone();
        let listen = rm.listen;
        tasks.push(tokio::spawn(async move {
            let conn = client
                .connect(listen, SERVER_NAME)
                .await
                .unwrap_or_else(|e| panic!("connection {c}: {e}"));
            let gets = (0..GETS).map(|g| {
                let n = (c * 7919 + g * 104_729 + g * g * 65_537) as u64;
                let conn = &conn;
                async move {
                    let resp = conn
                        .get(&format!("/bytes/{n}"))
                        .await
                        .unwrap_or_else(|e| panic!("connection {c} GET /bytes/{n}: {e}"));
                    check_bytes(&format!("connection {c}"), &resp, n);
                }
            });
            futures_join_all(gets).await;
            conn.close().await.expect("clean close");
        }));
    }
    for t in tasks {
        t.await.expect("connection task");
    }
    assert_eq!(
        next.load(Ordering::Relaxed),
        CONNECTIONS,
        "one DCID per connection"
    );
    let per_instance = (CONNECTIONS / usize::from(INSTANCES) * GETS) as f64;
    let m = rm
        .wait_for(
            "every instance to report its connections and requests",
            Duration::from_secs(10),
            |m| {
                (0..INSTANCES).all(|i| {
                    m.instance(names::WORKER_REQUESTS, i) >= per_instance
                        && m.instance(names::WORKER_CONNECTIONS_ACCEPTED, i)
                            >= (CONNECTIONS / usize::from(INSTANCES)) as f64
                })
            },
        )
        .await;
    for i in 0..INSTANCES {
        assert!(
            m.instance(names::FORWARDED, i) > 0.0,
            "nothing forwarded to instance {i}:\n{m}"
        );
    }
    assert!(
        m.sum(names::WORKER_REQUESTS) >= (CONNECTIONS * GETS) as f64,
        "requests served < requests made:\n{m}"
    );
    let m = rm.wait_balanced(Duration::from_secs(5)).await;
    assert_eq!(m.sum(names::DROPPED), 0.0, "drops:\n{m}");
}

/// A large download survives the client moving to a new UDP port mid-transfer (RFC 9000 §9):
/// the same CIDs arrive from a new address and the worker must answer there.
async fn migration(forward: Forward) {
    const N: u64 = 48 << 20;
    let rm = Ringmux::start(2, forward, &[]);
    let client = rm.pinned_client(1);
    let conn = Arc::new(rm.connect(&client).await);
    let before = client.local_addr().unwrap();
    let downloader = conn.clone();
    let body = tokio::spawn(async move { downloader.get(&format!("/bytes/{N}")).await });
    // Move once some of the body has arrived.
    while conn.quic().stats().udp_rx.bytes < (1 << 20) {
        assert!(
            !body.is_finished(),
            "the download ended before 1 MiB arrived"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    client
        .rebind(UdpSocket::bind("127.0.0.1:0").unwrap())
        .expect("rebind");
    let after = client.local_addr().unwrap();
    assert_ne!(before.port(), after.port(), "rebind kept the port");
    let moved_at = conn.quic().stats().udp_rx.bytes;
    assert!(
        !body.is_finished(),
        "the download finished before the move: nothing was tested"
    );
    let resp = body.await.unwrap().expect("download after migration");
    check_bytes("migrated download", &resp, N);
    assert!(
        conn.quic().stats().udp_rx.bytes > moved_at + (1 << 20),
        "little arrived after the move"
    );
    // The connection still works on the new path.
    let resp = conn.get("/bytes/1000").await.expect("GET after migration");
    check_bytes("after migration", &resp, 1000);
}

/// `--retry always`: the demux answers every Initial without a token with a Retry; the
/// client's second Initial goes to the CID the Retry chose (owned by the instance the first
/// one hashed to), whose quinn accepts the demux's token. Connections succeed on every
/// instance.
async fn retry(forward: Forward) {
    let rm = Ringmux::start(2, forward, &["--retry", "always"]);
    for instance in 0..2 {
        let client = rm.pinned_client(instance);
        let conn = rm.connect(&client).await;
        let resp = conn.get("/bytes/5000").await.expect("GET with --retry");
        check_bytes("with --retry", &resp, 5000);
        conn.close().await.expect("clean close");
    }
    rm.wait_for(
        "both instances to report a connection",
        Duration::from_secs(5),
        |m| (0..2).all(|i| m.instance(names::WORKER_CONNECTIONS_ACCEPTED, i) >= 1.0),
    )
    .await;
    let m = rm.metrics();
    assert!(
        m.labelled(names::RETRIES, "result", "sent") >= 2.0
            && m.labelled(names::TOKENS, "result", "accepted") >= 2.0,
        "the demux sent no Retry or accepted no token:\n{m}"
    );
    assert_eq!(m.dropped("token_refused"), 0.0, "{m}");
}

/// 0-RTT: a ticket from instance `first`, resumed with early data on instance `second`.
async fn zero_rtt(forward: Forward, first: u8, second: u8) {
    let rm = Ringmux::start(3, forward, &[]);
    let (first_resp, resp) = zero_rtt_across(&rm, first, second, "/bytes/100", "/bytes/3000").await;
    check_bytes("first connection", &first_resp, 100);
    check_bytes("0-RTT request", &resp, 3000);
}

/// `join_all` without pulling in futures-util as a dev-dependency: polls all to completion.
async fn futures_join_all<F: std::future::Future<Output = ()>>(futs: impl Iterator<Item = F>) {
    let mut futs: Vec<_> = futs.map(Box::pin).collect();
    std::future::poll_fn(|cx| {
        futs.retain_mut(|f| f.as_mut().poll(cx).is_pending());
        if futs.is_empty() {
            std::task::Poll::Ready(())
        } else {
            std::task::Poll::Pending
        }
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_connections_shm() {
    bounded(LIMIT, many_connections(Forward::Shm)).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_connections_unix() {
    bounded(LIMIT, many_connections(Forward::Unix)).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migration_shm() {
    bounded(LIMIT, migration(Forward::Shm)).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migration_unix() {
    bounded(LIMIT, migration(Forward::Unix)).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_shm() {
    bounded(LIMIT, retry(Forward::Shm)).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_unix() {
    bounded(LIMIT, retry(Forward::Unix)).await
}

/// Control for the cross-instance case: resumption on the instance that issued the ticket.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zero_rtt_same_instance_shm() {
    bounded(LIMIT, zero_rtt(Forward::Shm, 0, 0)).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zero_rtt_other_instance_shm() {
    bounded(LIMIT, zero_rtt(Forward::Shm, 0, 2)).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zero_rtt_other_instance_unix() {
    bounded(LIMIT, zero_rtt(Forward::Unix, 1, 0)).await
}

/// `--listen [::]:PORT` is dual-stack: clients reach every instance over IPv4 and IPv6, replies
/// leave from the address each client used.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dual_stack_listen_serves_ipv4_and_ipv6() {
    bounded(Duration::from_secs(60), async {
        let rm = Ringmux::start(2, Forward::Shm, &["--listen", "[::]:0"]);
        assert!(
            rm.listen.is_ipv6() && rm.listen.ip().is_unspecified(),
            "{}",
            rm.listen
        );
        let port = rm.listen.port();
        for target in [format!("127.0.0.1:{port}"), format!("[::1]:{port}")] {
            each_instance_serves(&rm, target.parse().unwrap()).await;
        }
        let m = rm.wait_balanced(Duration::from_secs(5)).await;
        assert!(m.instance(names::FORWARDED, 0) > 0.0);
        assert!(m.instance(names::FORWARDED, 1) > 0.0);
    })
    .await;
}

/// A connection pinned to each of the two instances fetches and checks a body via `target`.
async fn each_instance_serves(rm: &Ringmux, target: std::net::SocketAddr) {
    for instance in 0..2u8 {
        let mut client = ringmux_testkit::client::H3Client::new(
            ringmux_testkit::client::client_config(None).unwrap(),
            target,
        )
        .unwrap();
        harness::pin(&mut client, rm.router.clone(), move || instance);
        let conn = client
            .connect(target, harness::SERVER_NAME)
            .await
            .expect("connect");
        let r = conn.get("/bytes/3000").await.expect("GET");
        check_bytes(&format!("{target} instance {instance}"), &r, 3000);
    }
}

/// `--listen [::1]:PORT`, a specific IPv6 address: the demux asks the kernel for no destination
/// address (it knows it), and every instance still serves and replies from that address.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn specific_ipv6_listen_serves_every_instance() {
    bounded(Duration::from_secs(60), async {
        if std::net::UdpSocket::bind("[::1]:0").is_err() {
            eprintln!("no IPv6 loopback on this machine; the IPv4 tests cover the code path");
            return;
        }
        let rm = Ringmux::start(2, Forward::Shm, &["--listen", "[::1]:0"]);
        assert_eq!(rm.listen.ip(), "::1".parse::<std::net::IpAddr>().unwrap());
        each_instance_serves(&rm, rm.listen).await;
        let m = rm.wait_balanced(Duration::from_secs(5)).await;
        assert!(m.instance(names::FORWARDED, 0) > 0.0);
        assert!(m.instance(names::FORWARDED, 1) > 0.0);
        // The load generator over IPv6 too: its `:authority` is `[::1]:PORT`.
        let url = format!("https://[::1]:{}/bytes/1000", rm.listen.port());
        let report = run_probe(&url, &["-c", "4", "-s", "4", "-n", "200"]).await;
        assert_eq!(report["errors"]["total"].as_u64(), Some(0), "{report}");
        assert!(report["requests"].as_u64().unwrap() >= 200, "{report}");
    })
    .await;
}

/// Runs h3-probe against `url` (any certificate, bodies of 1000 bytes) with `args`, at most 60
/// seconds, and returns its JSON report; fails the test if it fails.
async fn run_probe(url: &str, args: &[&str]) -> serde_json::Value {
    let dir = ringmux_testkit::temp_dir("ringmux-probe");
    let json = dir.path().join("probe.json");
    let probe = harness::binary("h3-probe");
    let out = tokio::process::Command::new(&probe)
        .args(["--url", url, "--insecure", "--expect-len", "1000"])
        .args(args)
        .args(["--seconds", "60", "--json"])
        .arg(&json)
        .output()
        .await
        .expect("running h3-probe");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "h3-probe failed: {}\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let mut report: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&json).expect("the --json report")).unwrap();
    report["stdout"] = stdout.into_owned().into();
    report
}

/// `--ecn off`: the demux asks for no ECN bits; every instance still serves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ecn_off_still_serves() {
    bounded(Duration::from_secs(60), async {
        let rm = Ringmux::start(2, Forward::Shm, &["--ecn", "off"]);
        each_instance_serves(&rm, rm.listen).await;
        rm.wait_balanced(Duration::from_secs(5)).await;
    })
    .await;
}

/// `h3-probe --processes 2`: two copies load ringmux, each stops after its request budget, and
/// the parent merges their counts and histograms into one JSON report.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h3_probe_merges_its_processes() {
    bounded(Duration::from_secs(90), async {
        let rm = Ringmux::start(2, Forward::Shm, &[]);
        let url = format!("https://127.0.0.1:{}/bytes/1000", rm.listen.port());
        let report = run_probe(&url, &["-c", "2", "-s", "2", "-p", "2", "-n", "40"]).await;
        let stdout = report["stdout"].as_str().unwrap_or_default();
        assert!(
            stdout.contains("2 processes x 2 connections x 2 streams"),
            "{stdout}"
        );
        let requests = report["requests"].as_u64().unwrap();
        // Each process stops once it has counted its own 40 (a few more may be in flight).
        assert!((80..=100).contains(&requests), "{report}");
        assert_eq!(report["errors"]["total"].as_u64(), Some(0), "{report}");
        assert!(report["requests_per_s"].as_f64().unwrap() > 0.0, "{report}");
        let lat = &report["latency_us"];
        let (p50, max) = (lat["p50"].as_u64().unwrap(), lat["max"].as_u64().unwrap());
        assert!(p50 > 0 && p50 <= max, "{report}");
    })
    .await;
}

/// A reload in either forwarding mode: the new generation serves new connections, while a
/// download that started on the old generation runs to its end on the old worker (its
/// connection got GOAWAY and closes after it); then the old worker exits.
async fn reload_keeps_connections(forward: Forward) {
    const N: u64 = 20 << 20;
    let rm = Ringmux::start(2, forward, &["--grace", "30"]);
    let client = rm.client();
    let old = rm.connect(&client).await;
    // Headers in, body held back by flow control until it is read.
    let download = old
        .start(http::Method::GET, &format!("/bytes/{N}"), None)
        .await
        .expect("starting the download");
    let (ok, text) = rm.reload(Duration::from_secs(30)).await;
    assert!(ok && text.contains("ok generation=2"), "{text}");
    let fresh = rm.connect(&rm.client()).await;
    check_bytes(
        "a new connection after the reload",
        &fresh.get("/bytes/3000").await.expect("GET after"),
        3000,
    );
    let on =
        |m: &harness::Metrics, g: &str| m.sum_where(names::GENERATION_CONNECTIONS, "generation", g);
    rm.wait_for(
        "the download on generation 1, the new connection on generation 2",
        Duration::from_secs(10),
        |m| on(m, "1") >= 1.0 && on(m, "2") >= 1.0,
    )
    .await;
    let body = download.read_body(true).await.expect("the download's body");
    check_bytes("the download across the reload", &body, N);
    // The drained connection takes no new request.
    assert!(
        old.get("/bytes/10").await.is_err(),
        "a request after GOAWAY"
    );
    let m = rm
        .wait_for("generation 1 gone", Duration::from_secs(20), |m| {
            !m.series.keys().any(|k| k.contains("generation=\"1\""))
        })
        .await;
    assert_eq!(m.get(names::GENERATION_ACTIVE), 2.0);
    // Making, handing over and closing the new generation's ingress allocated nothing on the
    // data plane (reply channels are bounded; rings are made on the ring-spares thread).
    assert_eq!(m.get(names::DATAPLANE_ALLOCATIONS), 0.0, "{m}");
    check_bytes(
        "after the old generation left",
        &fresh.get("/bytes/1000").await.expect("GET at the end"),
        1000,
    );
    rm.wait_balanced(Duration::from_secs(10)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_keeps_connections_shm() {
    bounded(
        Duration::from_secs(90),
        reload_keeps_connections(Forward::Shm),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_keeps_connections_unix() {
    bounded(
        Duration::from_secs(90),
        reload_keeps_connections(Forward::Unix),
    )
    .await;
}

/// An upgrade of the demux in either forwarding mode: a download that started before it runs
/// to its end after it on the same connection, which goes on taking requests (the workers
/// noticed nothing: no GOAWAY, the same processes); a session ticket issued before it resumes
/// with 0-RTT after it on the other instance (the session cache was handed over); nothing is
/// dropped and nothing allocated on the data plane.
async fn upgrade_keeps_connections(forward: Forward) {
    const N: u64 = 20 << 20;
    let rm = Ringmux::start(2, forward, &[]);
    let workers = rm.worker_pids().await;
    let client = rm.client();
    let old = rm.connect(&client).await;
    let download = old
        .start(http::Method::GET, &format!("/bytes/{N}"), None)
        .await
        .expect("starting the download");
    // A ticket from instance 0, to resume on instance 1 after the upgrade.
    let target = std::sync::Arc::new(std::sync::atomic::AtomicU8::new(0));
    let mut resuming = rm.client();
    let t = target.clone();
    pin(&mut resuming, rm.router.clone(), move || {
        t.load(std::sync::atomic::Ordering::Relaxed)
    });
    let first = rm.connect(&resuming).await;
    check_bytes("before", &first.get("/bytes/100").await.expect("GET"), 100);
    first.close().await.expect("clean close");

    let (ok, text) = rm.upgrade(Duration::from_secs(30)).await;
    assert!(ok && text.contains("ok upgraded"), "{text}");
    assert_eq!(
        rm.worker_pids().await,
        workers,
        "the workers after the upgrade"
    );

    let body = download.read_body(true).await.expect("the download's body");
    check_bytes("the download across the upgrade", &body, N);
    check_bytes(
        "the same connection after the upgrade",
        &old.get("/bytes/3000")
            .await
            .expect("GET on the old connection"),
        3000,
    );
    target.store(1, std::sync::atomic::Ordering::Relaxed);
    let (conn, zrtt) = resuming
        .connect_0rtt(rm.listen, SERVER_NAME)
        .await
        .expect("resumed connection");
    assert!(zrtt.attempted(), "no ticket allowing early data");
    check_bytes(
        "0-RTT after the upgrade",
        &conn.get("/bytes/2000").await.expect("GET in 0-RTT"),
        2000,
    );
    assert!(
        zrtt.accepted().await,
        "0-RTT rejected after the upgrade: the session cache was not handed over"
    );
    conn.close().await.expect("clean close");
    let m = rm.wait_balanced(Duration::from_secs(10)).await;
    assert_eq!(m.labelled(names::UPGRADES, "result", "ok"), 1.0);
    assert_eq!(m.sum(names::DROPPED), 0.0, "{m}");
    assert_eq!(m.get(names::DATAPLANE_ALLOCATIONS), 0.0, "{m}");
    // The workers' output pipes passed to the new image with the rest: what the workers that
    // were started before the upgrade say as a reload drains them reaches the log.
    let (ok, text) = rm.reload(Duration::from_secs(30)).await;
    assert!(ok, "{text}");
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while !rm
        .log_tail(400)
        .lines()
        .any(|l| l.starts_with("[instance 0] ") && l.contains("drained; exiting"))
    {
        assert!(
            std::time::Instant::now() < deadline,
            "an old worker's last line never reached the log:\n{}",
            rm.log_tail(40)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upgrade_keeps_connections_shm() {
    bounded(
        Duration::from_secs(90),
        upgrade_keeps_connections(Forward::Shm),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upgrade_keeps_connections_unix() {
    bounded(
        Duration::from_secs(90),
        upgrade_keeps_connections(Forward::Unix),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_keeps_connections_reuseport() {
    bounded(
        Duration::from_secs(90),
        reload_keeps_connections(Forward::Reuseport),
    )
    .await;
}

/// A quinn client whose connections start with DCIDs the kernel's steering program sends to
/// `instance`: it spreads client-chosen DCIDs by their first four octets, read as a big-endian
/// number, modulo the instances (`demux/src/dataplane/forward/steering.rs`).
fn steered_client(rm: &Ringmux, instance: u8) -> ringmux_testkit::client::H3Client {
    let mut client = rm.client();
    client.set_initial_dst_cid_provider(Arc::new(move || {
        let mut dcid = harness::random_u64().to_be_bytes();
        dcid[..4].copy_from_slice(&u32::from(instance).to_be_bytes());
        quinn::ConnectionId::new(&dcid)
    }));
    client
}

/// Kernel steering (`--forward reuseport`): each connection reaches the instance the program
/// picks from its first DCID and stays there on the CIDs that instance issued, bodies arrive
/// whole, and the demux itself receives nothing (it only supervises).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reuseport_steers_each_connection_to_its_instance() {
    bounded(LIMIT, async {
        const N: u8 = 3;
        let rm = Ringmux::start(N, Forward::Reuseport, &[]);
        for i in 0..N {
            let conn = rm.connect(&steered_client(&rm, i)).await;
            let n = 40_000 + u64::from(i) * 7919;
            let resp = conn.get(&format!("/bytes/{n}")).await.expect("GET");
            check_bytes(&format!("instance {i}"), &resp, n);
            conn.close().await.expect("clean close");
            rm.wait_for(
                "the instance to report its connection",
                Duration::from_secs(5),
                |m| m.instance(names::WORKER_CONNECTIONS_ACCEPTED, i) >= 1.0,
            )
            .await;
        }
        let m = rm.metrics();
        for i in 0..N {
            assert_eq!(
                m.instance(names::WORKER_CONNECTIONS_ACCEPTED, i),
                1.0,
                "instance {i}:\n{m}"
            );
            assert!(m.instance(names::WORKER_DATAGRAMS, i) > 0.0, "{m}");
        }
        assert_eq!(
            m.get(names::RECEIVED),
            0.0,
            "datagrams reached the demux's own socket: the kernel did not steer them\n{m}"
        );
    })
    .await
}

/// `ringmux upgrade` cannot take a reuseport group over yet: it says so, and the demux serves
/// on with every worker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upgrade_in_reuseport_mode_is_refused_and_nothing_changes() {
    bounded(LIMIT, async {
        let rm = Ringmux::start(2, Forward::Reuseport, &[]);
        let pids = rm.worker_pids().await;
        let (ok, text) = rm.upgrade(Duration::from_secs(30)).await;
        assert!(!ok, "an upgrade went through: {text}");
        assert!(text.contains("reuseport"), "{text}");
        for i in 0..2 {
            let conn = rm.connect(&steered_client(&rm, i)).await;
            check_bytes(
                "after the refusal",
                &conn.get("/bytes/999").await.expect("GET"),
                999,
            );
        }
        assert_eq!(rm.worker_pids().await, pids);
    })
    .await
}
