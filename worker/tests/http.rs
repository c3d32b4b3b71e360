//! End-to-end HTTP/3 tests: real quinn server endpoints on loopback UDP sockets with the
//! worker's TLS/QUIC configuration and `serve`, driven by the `ringmux-bench` client.
//!
//! Every test body runs under a timeout, and every wait is on an event (a response, a task
//! ending), never a sleep.

use std::future::Future;
use std::net::{SocketAddr, UdpSocket};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, StatusCode};
use ringmux_bench::client::{client_config, Fnv64, H3Client, H3Conn, Response};
use ringmux_worker::http::{fill_pattern, serve_with, ServerStats, Site, HELLO_BODY};
use ringmux_worker::quic::{endpoint_config, server_config, ServerOptions};
use ringmux_worker::tls::{server_crypto_with, CertChain, Resumption, SharedTicketer};
use rustls::server::ServerSessionMemoryCache;
use tokio::sync::watch;
use tokio::task::JoinHandle;

const TEST_TIMEOUT: Duration = Duration::from_secs(60);

/// Secrets shared by the "instances" of one test.
struct Secrets {
    ticket: [u8; 32],
    reset: [u8; 64],
    token: [u8; 64],
}

const SECRETS: Secrets = Secrets {
    ticket: [0x11; 32],
    reset: [0x22; 64],
    token: [0x33; 64],
};

/// One running server instance.
struct Server {
    addr: SocketAddr,
    stats: Arc<ServerStats>,
    stop: watch::Sender<bool>,
    task: JoinHandle<()>,
}

impl Server {
    fn start(chain: &CertChain, resumption: Resumption, site: Site, opts: ServerOptions) -> Server {
        let crypto = server_crypto_with(chain, resumption).expect("server crypto");
        let ep_cfg = endpoint_config(&SECRETS.reset, || {
            Box::new(quinn_proto::RandomConnectionIdGenerator::new(8))
        });
        let srv_cfg = server_config(crypto, &SECRETS.token, &opts);
        let socket = UdpSocket::bind("127.0.0.1:0").expect("bind server socket");
        let endpoint =
            quinn::Endpoint::new(ep_cfg, Some(srv_cfg), socket, Arc::new(quinn::TokioRuntime))
                .expect("server endpoint");
        let addr = endpoint.local_addr().expect("server address");
        let stats = Arc::new(ServerStats::default());
        let (stop, stop_rx) = watch::channel(false);
        let task = tokio::spawn({
            let stats = stats.clone();
            async move { serve_with(endpoint, Arc::new(site), stats, stop_rx, &opts).await }
        });
        Server {
            addr,
            stats,
            stop,
            task,
        }
    }

    fn simple(chain: &CertChain) -> Server {
        Server::start(
            chain,
            shared_tickets(),
            Site::default(),
            ServerOptions::default(),
        )
    }

    async fn shutdown(self) {
        let _ = self.stop.send(true);
        self.task.await.expect("serve task");
    }
}

fn shared_tickets() -> Resumption {
    Resumption::SharedTickets(Arc::new(SharedTicketer::new(&SECRETS.ticket)))
}

fn client_for(chain: &CertChain, server: &Server) -> H3Client {
    let cfg = client_config(Some(&chain.certs)).expect("client config");
    H3Client::new(cfg, server.addr).expect("client endpoint")
}

async fn connect(client: &H3Client, server: &Server) -> H3Conn {
    client
        .connect(server.addr, "localhost")
        .await
        .expect("connect")
}

/// The common start of a test: a server with built-ins only, a client trusting its
/// certificate, and one connection.
async fn simple_setup() -> (Server, H3Client, H3Conn) {
    let chain = CertChain::self_signed().unwrap();
    let server = Server::simple(&chain);
    let client = client_for(&chain, &server);
    let conn = connect(&client, &server).await;
    (server, client, conn)
}

/// Runs a test body with a deadline, so a hang fails instead of blocking CI.
async fn bounded<F: Future<Output = ()>>(f: F) {
    tokio::time::timeout(TEST_TIMEOUT, f)
        .await
        .expect("test timed out");
}

fn pattern_checksum(len: u64) -> u64 {
    let mut sum = Fnv64::new();
    let mut buf = vec![0u8; 65536];
    let mut off = 0u64;
    while off < len {
        let n = (len - off).min(buf.len() as u64) as usize;
        fill_pattern(off, &mut buf[..n]);
        sum.update(&buf[..n]);
        off += n as u64;
    }
    sum.finish()
}

fn checksum(data: &[u8]) -> u64 {
    let mut sum = Fnv64::new();
    sum.update(data);
    sum.finish()
}

fn header<'a>(resp: &'a Response, name: &str) -> &'a str {
    resp.headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
}

#[tokio::test]
async fn builtins_head_and_errors() {
    bounded(async {
        let (server, _client, conn) = simple_setup().await;

        let hello = conn.get_body("/hello.txt").await.unwrap();
        assert_eq!(hello.status, StatusCode::OK);
        assert_eq!(hello.body.as_deref(), Some(HELLO_BODY));
        assert_eq!(header(&hello, "content-type"), "text/plain");

        for n in [
            0u64,
            1,
            250,
            251,
            65_535,
            65_536,
            65_537,
            1_000_000,
            10 << 20,
        ] {
            let r = conn.get(&format!("/bytes/{n}")).await.unwrap();
            assert_eq!(r.status, StatusCode::OK, "/bytes/{n}");
            assert_eq!(r.body_len, n, "/bytes/{n}");
            assert_eq!(r.body_checksum, pattern_checksum(n), "/bytes/{n}");
            assert_eq!(header(&r, "content-length"), n.to_string());
        }

        let head = conn
            .request(Method::HEAD, "/bytes/1000", None, false)
            .await
            .unwrap();
        assert_eq!(head.status, StatusCode::OK);
        assert_eq!(head.body_len, 0);
        assert_eq!(header(&head, "content-length"), "1000");

        for (path, status) in [
            ("/nope", StatusCode::NOT_FOUND),
            ("/bytes/", StatusCode::BAD_REQUEST),
            ("/bytes/x", StatusCode::BAD_REQUEST),
            ("/bytes/67108865", StatusCode::BAD_REQUEST), // > 64 MiB default cap
        ] {
            let r = conn.get(path).await.unwrap();
            assert_eq!(r.status, status, "{path}");
        }

        conn.close().await.unwrap();
        let s = server.stats.snapshot();
        assert_eq!(s.connections_accepted, 1);
        // 1 hello + 9 bytes + 1 head + 4 errors
        assert_eq!(s.requests_total, 15);
        assert_eq!(s.responses_2xx, 11);
        assert_eq!(s.responses_4xx, 4);
        server.shutdown().await;
    })
    .await
}

#[tokio::test]
async fn path_escapes_are_refused() {
    bounded(async {
        let root = TempDir::new("escape");
        std::fs::write(root.path().join("ok.txt"), b"ok").unwrap();
        let chain = CertChain::self_signed().unwrap();
        let site = Site {
            root: Some(root.path().to_path_buf()),
            ..Site::default()
        };
        let server = Server::start(&chain, shared_tickets(), site, ServerOptions::default());
        let client = client_for(&chain, &server);
        let conn = connect(&client, &server).await;

        for path in [
            "/../etc/passwd",
            "/%2e%2e/etc/passwd",
            "/%2E%2E%2Fetc%2Fpasswd",
            "/a/../../etc/passwd",
            "/..%2fetc/passwd",
            "/ok.txt/../../etc/passwd",
        ] {
            let r = conn.get_body(path).await.unwrap();
            assert_eq!(r.status, StatusCode::BAD_REQUEST, "{path}: {:?}", r.body);
        }
        assert_eq!(conn.get("/ok.txt").await.unwrap().status, StatusCode::OK);
        conn.close().await.unwrap();
        server.shutdown().await;
    })
    .await
}

#[tokio::test]
async fn static_files_from_root() {
    bounded(async {
        let root = TempDir::new("static");
        let big: Vec<u8> = (0..3_000_000u32).map(|i| (i * 7 % 256) as u8).collect();
        std::fs::write(root.path().join("index.html"), b"<h1>hi</h1>").unwrap();
        std::fs::create_dir(root.path().join("sub")).unwrap();
        std::fs::write(root.path().join("sub/data.json"), b"{\"a\":1}").unwrap();
        std::fs::write(root.path().join("big.bin"), &big).unwrap();
        std::fs::write(root.path().join("hello.txt"), b"overridden\n").unwrap();
        let outside = TempDir::new("outside");
        std::fs::write(outside.path().join("secret.txt"), b"secret").unwrap();
        std::os::unix::fs::symlink(
            outside.path().join("secret.txt"),
            root.path().join("leak.txt"),
        )
        .unwrap();
        std::os::unix::fs::symlink(
            root.path().join("index.html"),
            root.path().join("alias.html"),
        )
        .unwrap();

        let chain = CertChain::self_signed().unwrap();
        let site = Site {
            root: Some(root.path().to_path_buf()),
            ..Site::default()
        };
        let server = Server::start(&chain, shared_tickets(), site, ServerOptions::default());
        let client = client_for(&chain, &server);
        let conn = connect(&client, &server).await;

        let r = conn.get_body("/index.html").await.unwrap();
        assert_eq!(r.status, StatusCode::OK);
        assert_eq!(r.body.as_deref(), Some(&b"<h1>hi</h1>"[..]));
        assert_eq!(header(&r, "content-type"), "text/html; charset=utf-8");
        assert_eq!(header(&r, "content-length"), "11");

        let r = conn.get_body("/sub/data.json").await.unwrap();
        assert_eq!(header(&r, "content-type"), "application/json");
        assert_eq!(r.body.as_deref(), Some(&b"{\"a\":1}"[..]));

        let r = conn.get("/big.bin").await.unwrap();
        assert_eq!(r.body_len, big.len() as u64);
        assert_eq!(r.body_checksum, checksum(&big));
        assert_eq!(header(&r, "content-type"), "application/octet-stream");

        // A file in the root overrides a built-in.
        let r = conn.get_body("/hello.txt").await.unwrap();
        assert_eq!(r.body.as_deref(), Some(&b"overridden\n"[..]));

        // Symlinks: inside the root is served, leaving it is not.
        assert_eq!(
            conn.get("/alias.html").await.unwrap().status,
            StatusCode::OK
        );
        let r = conn.get_body("/leak.txt").await.unwrap();
        assert_eq!(r.status, StatusCode::NOT_FOUND, "{:?}", r.body);
        // Directories are not files.
        assert_eq!(
            conn.get("/sub").await.unwrap().status,
            StatusCode::NOT_FOUND
        );
        assert_eq!(conn.get("/").await.unwrap().status, StatusCode::NOT_FOUND);

        conn.close().await.unwrap();
        server.shutdown().await;
    })
    .await
}

#[tokio::test]
async fn request_bodies_are_read_to_the_end() {
    bounded(async {
        let (server, _client, conn) = simple_setup().await;

        for n in [0usize, 1, 100_000, 3 << 20] {
            let body = Bytes::from(vec![0xab; n]);
            let r = conn
                .request(Method::POST, "/echo-len", Some(body), true)
                .await
                .unwrap();
            assert_eq!(r.status, StatusCode::OK);
            assert_eq!(r.body.as_deref(), Some(format!("{n}\n").as_bytes()));
        }
        let r = conn
            .request(
                Method::PUT,
                "/hello.txt",
                Some(Bytes::from(vec![1; 500_000])),
                false,
            )
            .await
            .unwrap();
        assert_eq!(r.status, StatusCode::METHOD_NOT_ALLOWED);
        assert_eq!(header(&r, "allow"), "GET, HEAD, POST");
        let r = conn
            .request(
                Method::POST,
                "/hello.txt",
                Some(Bytes::from_static(b"x")),
                false,
            )
            .await
            .unwrap();
        assert_eq!(r.status, StatusCode::METHOD_NOT_ALLOWED);

        conn.close().await.unwrap();
        server.shutdown().await;
    })
    .await
}

#[tokio::test]
async fn hundred_concurrent_streams_on_one_connection() {
    bounded(async {
        let (server, _client, conn) = simple_setup().await;

        let requests = (0..100u64).map(|i| {
            let conn = &conn;
            async move { (i, conn.get(&format!("/bytes/{}", 10_000 + i)).await) }
        });
        let results = futures_util::future::join_all(requests).await;
        for (i, r) in results {
            let r = r.unwrap_or_else(|e| panic!("request {i}: {e}"));
            assert_eq!(r.status, StatusCode::OK);
            assert_eq!(r.body_checksum, pattern_checksum(10_000 + i));
        }
        assert_eq!(server.stats.snapshot().requests_total, 100);
        conn.close().await.unwrap();
        server.shutdown().await;
    })
    .await
}

/// With stateless shared tickets, a session from instance A resumes on instance B, but rustls
/// refuses 0-RTT for stateless tickets (RFC 8446 §8.1), so the client does not even attempt it.
/// If this starts failing on `attempted()`, rustls changed policy: revisit `tls.rs` docs.
#[tokio::test]
async fn shared_tickets_resume_across_instances_without_0rtt() {
    bounded(async {
        let chain = CertChain::self_signed().unwrap();
        let ticketer_a = Arc::new(SharedTicketer::new(&SECRETS.ticket));
        let ticketer_b = Arc::new(SharedTicketer::new(&SECRETS.ticket));
        let a = Server::start(
            &chain,
            Resumption::SharedTickets(ticketer_a.clone()),
            Site::default(),
            ServerOptions::default(),
        );
        let b = Server::start(
            &chain,
            Resumption::SharedTickets(ticketer_b.clone()),
            Site::default(),
            ServerOptions::default(),
        );
        assert_ne!(a.addr, b.addr);
        let client = client_for(&chain, &a);

        let conn = connect(&client, &a).await;
        // A full round trip after the handshake: the tickets (sent right after the client's
        // Finished) have been processed by the time the response is in.
        assert_eq!(conn.get("/hello.txt").await.unwrap().status, StatusCode::OK);
        conn.close().await.unwrap();
        assert!(ticketer_a.stats().issued >= 1);

        let (conn, zero_rtt) = client.connect_0rtt(b.addr, "localhost").await.unwrap();
        assert!(
            !zero_rtt.attempted(),
            "rustls now offers 0-RTT with stateless tickets"
        );
        assert_eq!(conn.get("/hello.txt").await.unwrap().status, StatusCode::OK);
        assert_eq!(ticketer_b.stats().accepted, 1, "B must resume A's session");
        assert_eq!(ticketer_b.stats().rejected, 0);
        conn.close().await.unwrap();

        // Control: an instance with another secret cannot open the ticket.
        let other = Arc::new(SharedTicketer::new(&[0x99; 32]));
        let c = Server::start(
            &chain,
            Resumption::SharedTickets(other.clone()),
            Site::default(),
            ServerOptions::default(),
        );
        let conn = connect(&client, &c).await;
        assert_eq!(conn.get("/hello.txt").await.unwrap().status, StatusCode::OK);
        assert_eq!(other.stats().accepted, 0);
        assert!(other.stats().rejected >= 1);
        conn.close().await.unwrap();

        a.shutdown().await;
        b.shutdown().await;
        c.shutdown().await;
    })
    .await
}

/// 0-RTT across instances works when they share a (single-use) session store: the request
/// goes to B in 0-RTT and B accepts it. In one process an in-memory store can be shared; across
/// worker processes this needs a store in shared memory or behind the demux.
#[tokio::test]
async fn zero_rtt_across_instances_with_shared_session_store() {
    bounded(async {
        let chain = CertChain::self_signed().unwrap();
        let store = ServerSessionMemoryCache::new(1024);
        let a = Server::start(
            &chain,
            Resumption::SessionStore(store.clone()),
            Site::default(),
            ServerOptions::default(),
        );
        let b = Server::start(
            &chain,
            Resumption::SessionStore(store),
            Site::default(),
            ServerOptions::default(),
        );
        let client = client_for(&chain, &a);

        let conn = connect(&client, &a).await;
        assert_eq!(conn.get("/hello.txt").await.unwrap().status, StatusCode::OK);
        conn.close().await.unwrap();

        let (conn, zero_rtt) = client.connect_0rtt(b.addr, "localhost").await.unwrap();
        assert!(zero_rtt.attempted(), "client had no 0-RTT-capable ticket");
        // Sent as 0-RTT data: this request is in flight before the handshake completes.
        let r = conn.get("/bytes/5000").await.unwrap();
        assert_eq!(r.status, StatusCode::OK);
        assert_eq!(r.body_checksum, pattern_checksum(5000));
        assert!(zero_rtt.accepted().await, "B rejected the 0-RTT data");
        assert_eq!(b.stats.snapshot().requests_total, 1);
        conn.close().await.unwrap();

        a.shutdown().await;
        b.shutdown().await;
    })
    .await
}

#[tokio::test]
async fn retry_round_trip() {
    bounded(async {
        let chain = CertChain::self_signed().unwrap();
        let opts = ServerOptions {
            retry: true,
            ..ServerOptions::default()
        };
        let server = Server::start(&chain, shared_tickets(), Site::default(), opts);
        let client = client_for(&chain, &server);
        let conn = connect(&client, &server).await;
        assert_eq!(conn.get("/hello.txt").await.unwrap().status, StatusCode::OK);
        conn.close().await.unwrap();
        let s = server.stats.snapshot();
        assert_eq!(s.retries_sent, 1, "{s:?}");
        assert_eq!(s.connections_accepted, 1);
        server.shutdown().await;
    })
    .await
}

#[tokio::test]
async fn client_migration_with_rebind() {
    bounded(async {
        let (server, client, conn) = simple_setup().await;
        assert_eq!(conn.get("/hello.txt").await.unwrap().status, StatusCode::OK);
        let before = client.local_addr().unwrap();
        client
            .rebind(UdpSocket::bind("127.0.0.1:0").unwrap())
            .unwrap();
        assert_ne!(client.local_addr().unwrap(), before);
        let r = conn.get("/bytes/200000").await.unwrap();
        assert_eq!(r.body_checksum, pattern_checksum(200_000));
        conn.close().await.unwrap();
        server.shutdown().await;
    })
    .await
}

#[tokio::test]
async fn graceful_shutdown_finishes_in_flight_download() {
    bounded(async {
        let (server, _client, conn) = simple_setup().await;
        let len = 10u64 << 20;

        // Response headers in: the request is accepted and the body is streaming.
        let download = conn.start(Method::GET, &format!("/bytes/{len}"), None).await.unwrap();
        assert_eq!(download.status(), StatusCode::OK);

        server.stop.send(true).unwrap();
        let r = download.read_body(false).await.unwrap();
        assert_eq!(r.body_len, len);
        assert_eq!(r.body_checksum, pattern_checksum(len));

        // serve() returns on its own once the connection has drained.
        server.task.await.unwrap();
        // The server closed the connection gracefully after GOAWAY.
        let reason = conn.quic().closed().await;
        assert!(
            matches!(&reason, quinn::ConnectionError::ApplicationClosed(c) if c.error_code == quinn::VarInt::from_u32(0x100)),
            "{reason:?}"
        );
    })
    .await
}

/// A directory under the system temp dir, removed on drop (also when a test panics).
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!(
            "ringmux-worker-test-{}-{tag}-{n}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
