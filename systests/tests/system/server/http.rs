//! End-to-end HTTP/3 tests: real quinn server endpoints on loopback UDP sockets with the
//! worker's TLS/QUIC configuration and `serve`, driven by the test kit's client.
//!
//! Every test body runs under a timeout, and every wait is on an event (a response, a task
//! ending), never a sleep.

use ringmux_testkit::{aioquic, temp_dir, tool, TempDir};
use std::future::Future;
use std::net::{SocketAddr, UdpSocket};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

use bytes::{Buf, Bytes};
use http::{Method, StatusCode};
use ringmux_server::files::{Content, DocRoot, FileOptions, Lookup};
use ringmux_server::h3::{serve_with, HttpOptions};
use ringmux_server::reply::{fill_pattern, HELLO_BODY};
use ringmux_server::sites::{Router, RouterOptions, Site};
use ringmux_server::stats::ServerStats;
use ringmux_testkit::client::{client_config, Fnv64, H3Client, H3Conn, Response};
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
    fn start(
        chain: &CertChain,
        resumption: Resumption,
        sites: impl Into<Router>,
        opts: HttpOptions,
    ) -> Server {
        let router: Router = sites.into();
        let crypto = server_crypto_with(chain, resumption).expect("server crypto");
        let ep_cfg = endpoint_config(&SECRETS.reset, || {
            Box::new(quinn_proto::RandomConnectionIdGenerator::new(8))
        });
        let srv_cfg = server_config(crypto, &SECRETS.token, &ServerOptions::default());
        let socket = UdpSocket::bind("127.0.0.1:0").expect("bind server socket");
        let endpoint =
            quinn::Endpoint::new(ep_cfg, Some(srv_cfg), socket, Arc::new(quinn::TokioRuntime))
                .expect("server endpoint");
        let addr = endpoint.local_addr().expect("server address");
        let stats = Arc::new(ServerStats::default());
        let (stop, stop_rx) = watch::channel(false);
        let task = tokio::spawn({
            let stats = stats.clone();
            async move { serve_with(endpoint, router, stats, stop_rx, &opts).await }
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
            HttpOptions::default(),
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
        let s = &server.stats;
        assert_eq!(s.connections_accepted.load(Relaxed), 1);
        // 1 hello + 9 bytes + 1 head + 4 errors
        assert_eq!(s.requests_total.load(Relaxed), 15);
        assert_eq!(s.responses_2xx.load(Relaxed), 11);
        assert_eq!(s.responses_4xx.load(Relaxed), 4);
        server.shutdown().await;
    })
    .await
}

#[tokio::test]
async fn path_escapes_are_refused() {
    bounded(async {
        let root = temp_dir("escape");
        std::fs::write(root.path().join("ok.txt"), b"ok").unwrap();
        let chain = CertChain::self_signed().unwrap();
        let site = root_site(root.path(), FileOptions::default());
        let server = Server::start(&chain, shared_tickets(), site, HttpOptions::default());
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
        let root = temp_dir("static");
        let big: Vec<u8> = (0..3_000_000u32).map(|i| (i * 7 % 256) as u8).collect();
        std::fs::write(root.path().join("index.html"), b"<h1>hi</h1>").unwrap();
        std::fs::create_dir(root.path().join("sub")).unwrap();
        std::fs::write(root.path().join("sub/data.json"), b"{\"a\":1}").unwrap();
        std::fs::write(root.path().join("big.bin"), &big).unwrap();
        std::fs::write(root.path().join("hello.txt"), b"overridden\n").unwrap();
        let outside = temp_dir("outside");
        std::fs::write(outside.path().join("secret.txt"), b"secret").unwrap();
        std::os::unix::fs::symlink(
            outside.path().join("secret.txt"),
            root.path().join("leak.txt"),
        )
        .unwrap();
        // Relative and staying beneath the root: served.
        std::os::unix::fs::symlink("index.html", root.path().join("alias.html")).unwrap();
        std::os::unix::fs::symlink("../sub/data.json", root.path().join("sub/up.json")).unwrap();
        // Absolute, even to a file inside the root: refused (RESOLVE_BENEATH).
        std::os::unix::fs::symlink(
            root.path().join("index.html"),
            root.path().join("absolute.html"),
        )
        .unwrap();
        // Relative but climbing out of the root: refused.
        let climb = Path::new("..")
            .join(outside.path().file_name().unwrap())
            .join("secret.txt");
        std::os::unix::fs::symlink(climb, root.path().join("climb.txt")).unwrap();
        // Through /proc: a magic link, refused (RESOLVE_NO_MAGICLINKS).
        std::os::unix::fs::symlink("/proc/self/root/etc/hostname", root.path().join("magic"))
            .unwrap();

        let chain = CertChain::self_signed().unwrap();
        let site = root_site(root.path(), FileOptions::default());
        let server = Server::start(&chain, shared_tickets(), site, HttpOptions::default());
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
        let r = conn.get_body("/alias.html").await.unwrap();
        assert_eq!(r.body.as_deref(), Some(&b"<h1>hi</h1>"[..]));
        let r = conn.get_body("/sub/up.json").await.unwrap();
        assert_eq!(r.body.as_deref(), Some(&b"{\"a\":1}"[..]));
        for path in ["/leak.txt", "/climb.txt", "/absolute.html", "/magic"] {
            let r = conn.get_body(path).await.unwrap();
            assert_eq!(r.status, StatusCode::NOT_FOUND, "{path}: {:?}", r.body);
        }
        // A directory: its index.html with the slash, a redirect to the slash without it.
        let r = conn.get_body("/").await.unwrap();
        assert_eq!(r.body.as_deref(), Some(&b"<h1>hi</h1>"[..]));
        let r = conn.get("/sub").await.unwrap();
        assert_eq!(r.status, StatusCode::MOVED_PERMANENTLY);
        assert_eq!(header(&r, "location"), "/sub/");
        // No index.html in sub/: no listing.
        assert_eq!(
            conn.get("/sub/").await.unwrap().status,
            StatusCode::NOT_FOUND
        );

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
        assert_eq!(server.stats.requests_total.load(Relaxed), 100);
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
            HttpOptions::default(),
        );
        let b = Server::start(
            &chain,
            Resumption::SharedTickets(ticketer_b.clone()),
            Site::default(),
            HttpOptions::default(),
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
            HttpOptions::default(),
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
            HttpOptions::default(),
        );
        let b = Server::start(
            &chain,
            Resumption::SessionStore(store),
            Site::default(),
            HttpOptions::default(),
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
        assert_eq!(b.stats.requests_total.load(Relaxed), 1);
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
        let opts = HttpOptions {
            retry: true,
            ..HttpOptions::default()
        };
        let server = Server::start(&chain, shared_tickets(), Site::default(), opts);
        let client = client_for(&chain, &server);
        let conn = connect(&client, &server).await;
        assert_eq!(conn.get("/hello.txt").await.unwrap().status, StatusCode::OK);
        conn.close().await.unwrap();
        let s = &server.stats;
        assert_eq!(s.retries_sent.load(Relaxed), 1, "{s:?}");
        assert_eq!(s.connections_accepted.load(Relaxed), 1);
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

/// One HTTP/3 connection that sends request header fields of the test's choosing (the bench
/// client sends none).
struct RawConn {
    send: h3::client::SendRequest<h3_quinn::OpenStreams, Bytes>,
    driver: JoinHandle<()>,
}

/// A response read by [`RawConn`].
struct RawResponse {
    status: StatusCode,
    headers: http::HeaderMap,
    body: Vec<u8>,
}

impl RawResponse {
    fn header(&self, name: &str) -> &str {
        self.headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
    }
}

impl RawConn {
    async fn open(client: &H3Client, server: &Server) -> RawConn {
        let quic = client
            .endpoint()
            .connect(server.addr, "localhost")
            .expect("connect")
            .await
            .expect("handshake");
        let (mut driver, send) = h3::client::new(h3_quinn::Connection::new(quic))
            .await
            .expect("HTTP/3 setup");
        let driver = tokio::spawn(async move {
            let _ = std::future::poll_fn(|cx| driver.poll_close(cx)).await;
        });
        RawConn { send, driver }
    }

    async fn request(&self, method: Method, path: &str, fields: &[(&str, &str)]) -> RawResponse {
        self.request_at("localhost", method, path, fields).await
    }

    /// [`RawConn::request`] with `authority` as the `:authority`.
    async fn request_at(
        &self,
        authority: &str,
        method: Method,
        path: &str,
        fields: &[(&str, &str)],
    ) -> RawResponse {
        let mut req = http::Request::builder()
            .method(method)
            .uri(format!("https://{authority}{path}"));
        for (k, v) in fields {
            req = req.header(*k, *v);
        }
        let mut send = self.send.clone();
        let mut stream = send
            .send_request(req.body(()).unwrap())
            .await
            .expect("send request");
        let _ = stream.finish().await;
        let head = stream.recv_response().await.expect("response head");
        let mut body = Vec::new();
        while let Some(mut chunk) = stream.recv_data().await.expect("response body") {
            while chunk.has_remaining() {
                let part = chunk.chunk();
                body.extend_from_slice(part);
                let n = part.len();
                chunk.advance(n);
            }
        }
        RawResponse {
            status: head.status(),
            headers: head.headers().clone(),
            body,
        }
    }

    async fn get(&self, path: &str, fields: &[(&str, &str)]) -> RawResponse {
        self.request(Method::GET, path, fields).await
    }
}

impl Drop for RawConn {
    fn drop(&mut self) {
        self.driver.abort();
    }
}

/// Bytes of a test file that differ at every offset of a 64 KiB chunk.
fn file_bytes(len: usize) -> Vec<u8> {
    (0..len as u32).map(|i| (i * 7 + i / 251) as u8).collect()
}

#[tokio::test]
async fn validators_and_conditional_requests() {
    bounded(async {
        let root = temp_dir("conditional");
        std::fs::write(root.path().join("a.txt"), b"0123456789").unwrap();
        let chain = CertChain::self_signed().unwrap();
        let opts = FileOptions {
            cache_control: Some(http::HeaderValue::from_static("public, max-age=60")),
            ..FileOptions::default()
        };
        let server = Server::start(
            &chain,
            shared_tickets(),
            root_site(root.path(), opts),
            HttpOptions::default(),
        );
        let client = client_for(&chain, &server);
        let c = RawConn::open(&client, &server).await;

        let r = c.get("/a.txt", &[]).await;
        assert_eq!(r.status, StatusCode::OK);
        assert_eq!(r.body, b"0123456789");
        assert_eq!(r.header("content-type"), "text/plain;charset=utf-8");
        assert_eq!(r.header("content-length"), "10");
        assert_eq!(r.header("accept-ranges"), "bytes");
        assert_eq!(r.header("cache-control"), "public, max-age=60");
        let etag = r.header("etag").to_owned();
        let modified = r.header("last-modified").to_owned();
        assert!(
            etag.starts_with('"') && etag.ends_with('"') && etag.len() > 2,
            "{etag}"
        );
        assert!(modified.ends_with(" GMT"), "{modified}");

        let head = c.request(Method::HEAD, "/a.txt", &[]).await;
        assert_eq!(head.status, StatusCode::OK);
        assert!(head.body.is_empty());
        assert_eq!(head.header("content-length"), "10");
        assert_eq!(head.header("etag"), etag);

        for fields in [
            vec![("if-none-match", etag.as_str())],
            vec![("if-none-match", "\"nope\", W/\"x\"")],
            vec![("if-modified-since", modified.as_str())],
            vec![
                ("if-none-match", "\"nope\""),
                ("if-modified-since", modified.as_str()),
            ],
            vec![("if-match", "\"nope\"")],
            vec![("if-unmodified-since", "Thu, 01 Jan 1970 00:00:00 GMT")],
            vec![("if-match", etag.as_str())],
        ] {
            let r = c.get("/a.txt", &fields).await;
            let want = match fields[0] {
                ("if-none-match", v) if v == etag => StatusCode::NOT_MODIFIED,
                ("if-modified-since", _) => StatusCode::NOT_MODIFIED,
                ("if-match", v) if v != etag => StatusCode::PRECONDITION_FAILED,
                ("if-unmodified-since", _) => StatusCode::PRECONDITION_FAILED,
                _ => StatusCode::OK,
            };
            assert_eq!(r.status, want, "{fields:?}");
            if want == StatusCode::NOT_MODIFIED {
                // RFC 9110 §15.4.5: no content; validators and Cache-Control as a 200 would.
                assert!(r.body.is_empty(), "{fields:?}");
                assert!(r.headers.get("content-length").is_none(), "{fields:?}");
                assert_eq!(r.header("etag"), etag);
                assert_eq!(r.header("cache-control"), "public, max-age=60");
            }
        }
        let r = c
            .request(Method::HEAD, "/a.txt", &[("if-none-match", &etag)])
            .await;
        assert_eq!(r.status, StatusCode::NOT_MODIFIED);

        let s = &server.stats;
        assert_eq!(s.responses_3xx.load(Relaxed), 3, "{s:?}");
        server.shutdown().await;
    })
    .await
}

#[tokio::test]
async fn byte_ranges() {
    bounded(async {
        let root = temp_dir("ranges");
        std::fs::write(root.path().join("small.txt"), b"0123456789").unwrap();
        std::fs::write(root.path().join("empty.txt"), b"").unwrap();
        // Larger than any cached file: streamed from the descriptor.
        let big = file_bytes(600_000);
        std::fs::write(root.path().join("big.bin"), &big).unwrap();
        let chain = CertChain::self_signed().unwrap();
        let server = Server::start(
            &chain,
            shared_tickets(),
            root_site(root.path(), FileOptions::default()),
            HttpOptions::default(),
        );
        let client = client_for(&chain, &server);
        let c = RawConn::open(&client, &server).await;

        for (range, body, content_range) in [
            ("bytes=0-4", &b"01234"[..], "bytes 0-4/10"),
            ("bytes=7-", b"789", "bytes 7-9/10"),
            ("bytes=-2", b"89", "bytes 8-9/10"),
            ("bytes=-20", b"0123456789", "bytes 0-9/10"),
            ("bytes=9-100", b"9", "bytes 9-9/10"),
        ] {
            let r = c.get("/small.txt", &[("range", range)]).await;
            assert_eq!(r.status, StatusCode::PARTIAL_CONTENT, "{range}");
            assert_eq!(r.body, body, "{range}");
            assert_eq!(r.header("content-range"), content_range, "{range}");
            assert_eq!(
                r.header("content-length"),
                body.len().to_string(),
                "{range}"
            );
        }
        for range in ["bytes=10-", "bytes=-0"] {
            let r = c.get("/small.txt", &[("range", range)]).await;
            assert_eq!(r.status, StatusCode::RANGE_NOT_SATISFIABLE, "{range}");
            assert_eq!(r.header("content-range"), "bytes */10", "{range}");
        }
        let r = c.get("/empty.txt", &[("range", "bytes=0-")]).await;
        assert_eq!(r.status, StatusCode::RANGE_NOT_SATISFIABLE);
        assert_eq!(r.header("content-range"), "bytes */0");
        // Ignored: invalid, several ranges, another unit, HEAD.
        for range in ["bytes=5-1", "bytes=0-1,3-4", "lines=1-2"] {
            let r = c.get("/small.txt", &[("range", range)]).await;
            assert_eq!(r.status, StatusCode::OK, "{range}");
            assert_eq!(r.body, b"0123456789", "{range}");
        }
        let r = c
            .request(Method::HEAD, "/small.txt", &[("range", "bytes=0-1")])
            .await;
        assert_eq!(r.status, StatusCode::OK);

        // If-Range (RFC 9110 §13.1.5): the range only while the validator still matches.
        let etag = c.get("/small.txt", &[]).await.header("etag").to_owned();
        let r = c
            .get("/small.txt", &[("range", "bytes=1-2"), ("if-range", &etag)])
            .await;
        assert_eq!(
            (r.status, r.body.as_slice()),
            (StatusCode::PARTIAL_CONTENT, &b"12"[..])
        );
        let r = c
            .get(
                "/small.txt",
                &[("range", "bytes=1-2"), ("if-range", "\"old\"")],
            )
            .await;
        assert_eq!(r.status, StatusCode::OK);
        assert_eq!(r.body.len(), 10);

        // Ranges of a streamed file, across 64 KiB chunk boundaries.
        for (start, end) in [
            (0u64, 0u64),
            (65_530, 200_000),
            (599_990, 599_999),
            (131_072, 131_072),
        ] {
            let range = format!("bytes={start}-{end}");
            let r = c.get("/big.bin", &[("range", &range)]).await;
            assert_eq!(r.status, StatusCode::PARTIAL_CONTENT, "{range}");
            assert_eq!(
                r.header("content-range"),
                format!("bytes {start}-{end}/600000"),
                "{range}"
            );
            assert!(
                r.body == big[start as usize..=end as usize],
                "{range}: {} bytes, content differs",
                r.body.len()
            );
        }
        let r = c.get("/big.bin", &[("range", "bytes=600000-")]).await;
        assert_eq!(r.status, StatusCode::RANGE_NOT_SATISFIABLE);
        server.shutdown().await;
    })
    .await
}

#[tokio::test]
async fn cached_files_are_revalidated() {
    bounded(async {
        let root = temp_dir("cache");
        let path = root.path().join("page.html");
        std::fs::write(&path, b"version one").unwrap();
        std::fs::write(root.path().join("gone.txt"), b"soon gone").unwrap();
        let chain = CertChain::self_signed().unwrap();

        // Never revalidated within the test: an edit is not seen, which proves the cache
        // answers (and that it is bounded by the interval, below).
        let pinned = DocRoot::open(
            root.path(),
            FileOptions {
                revalidate: Duration::from_secs(3600),
                settle: Duration::ZERO,
                ..FileOptions::default()
            },
        )
        .unwrap();
        // Revalidated at every request.
        let checked = DocRoot::open(
            root.path(),
            FileOptions {
                revalidate: Duration::ZERO,
                settle: Duration::ZERO,
                ..FileOptions::default()
            },
        )
        .unwrap();
        let start = |root: &DocRoot| {
            let site = Site {
                root: Some(root.clone()),
                ..Site::default()
            };
            Server::start(&chain, shared_tickets(), site, HttpOptions::default())
        };
        let (a, b) = (start(&pinned), start(&checked));
        let client = client_for(&chain, &a);
        let (ca, cb) = (connect(&client, &a).await, connect(&client, &b).await);
        let body = |r: Response| r.body.unwrap_or_default();

        for conn in [&ca, &cb] {
            assert_eq!(
                body(conn.get_body("/page.html").await.unwrap()),
                &b"version one"[..]
            );
            assert_eq!(
                body(conn.get_body("/page.html").await.unwrap()),
                &b"version one"[..]
            );
        }
        assert_eq!(pinned.stats().cache_fills.load(Relaxed), 1);
        assert_eq!(pinned.stats().cache_hits.load(Relaxed), 1);
        assert_eq!(checked.stats().cache_hits.load(Relaxed), 0);
        assert_eq!(checked.stats().revalidated.load(Relaxed), 1);

        // An edit in place (same inode, new size and times).
        std::fs::write(&path, b"version two, longer").unwrap();
        assert_eq!(
            body(ca.get_body("/page.html").await.unwrap()),
            &b"version one"[..]
        );
        assert_eq!(
            body(cb.get_body("/page.html").await.unwrap()),
            &b"version two, longer"[..]
        );
        // A replacement by rename, with the same size and mtime as the file it replaces: the
        // inode tells them apart.
        let old_mtime = std::fs::metadata(&path).unwrap().modified().unwrap();
        let tmp = root.path().join(".page.tmp");
        std::fs::write(&tmp, b"VERSION TWO, LONGER").unwrap();
        std::fs::File::options()
            .write(true)
            .open(&tmp)
            .unwrap()
            .set_modified(old_mtime)
            .unwrap();
        std::fs::rename(&tmp, &path).unwrap();
        assert_eq!(
            body(cb.get_body("/page.html").await.unwrap()),
            &b"VERSION TWO, LONGER"[..]
        );
        // Deleted: gone at once from the revalidating root.
        assert_eq!(cb.get("/gone.txt").await.unwrap().status, StatusCode::OK);
        std::fs::remove_file(root.path().join("gone.txt")).unwrap();
        assert_eq!(
            cb.get("/gone.txt").await.unwrap().status,
            StatusCode::NOT_FOUND
        );

        ca.close().await.unwrap();
        cb.close().await.unwrap();
        a.shutdown().await;
        b.shutdown().await;
    })
    .await
}

/// A file whose pages were dropped from the page cache is served whole. Whether its reads go
/// to the blocking pool depends on the kernel: this one (6.18, ext4) starts readahead for an
/// `RWF_NOWAIT` read and returns the data instead of `EAGAIN`, so the test does not insist.
#[tokio::test]
async fn files_evicted_from_the_page_cache_are_served_whole() {
    bounded(async {
        let root = temp_dir("cold");
        let big = file_bytes(3 << 20);
        let path = root.path().join("cold.bin");
        std::fs::write(&path, &big).unwrap();
        let f = std::fs::File::open(&path).unwrap();
        f.sync_all().unwrap();
        // SAFETY: plain posix_fadvise on a descriptor we own: drop its clean pages.
        let rc = unsafe {
            libc::posix_fadvise(
                std::os::fd::AsRawFd::as_raw_fd(&f),
                0,
                0,
                libc::POSIX_FADV_DONTNEED,
            )
        };
        assert_eq!(rc, 0);
        let docroot = DocRoot::open(root.path(), FileOptions::default()).unwrap();
        let chain = CertChain::self_signed().unwrap();
        let site = Site {
            root: Some(docroot.clone()),
            ..Site::default()
        };
        let server = Server::start(&chain, shared_tickets(), site, HttpOptions::default());
        let client = client_for(&chain, &server);
        let conn = connect(&client, &server).await;
        let r = conn.get("/cold.bin").await.unwrap();
        assert_eq!(r.status, StatusCode::OK);
        assert_eq!(
            (r.body_len, r.body_checksum),
            (big.len() as u64, checksum(&big))
        );
        conn.close().await.unwrap();
        server.shutdown().await;
    })
    .await
}

/// A document root whose two symlinks a thread swaps, as fast as it can, between a target
/// inside the root and one outside: `file` (relative, climbing out with `..`) and `dir` (a
/// directory symlink, absolute outside). Inside targets hold "inside", outside ones "SECRET".
/// Dropping it stops the thread.
struct SymlinkSwapper {
    root: TempDir,
    _outside: TempDir,
    stop: Arc<std::sync::atomic::AtomicBool>,
    swaps: Arc<std::sync::atomic::AtomicU64>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl SymlinkSwapper {
    fn start() -> SymlinkSwapper {
        let root = temp_dir("race-root");
        let outside = temp_dir("race-outside");
        std::fs::write(root.path().join("inside.txt"), b"inside").unwrap();
        std::fs::create_dir(root.path().join("real")).unwrap();
        std::fs::write(root.path().join("real/f.txt"), b"inside").unwrap();
        std::fs::write(outside.path().join("f.txt"), b"SECRET").unwrap();
        let out_name = outside.path().file_name().unwrap().to_owned();
        // (link, target inside, target outside)
        let links: Vec<(PathBuf, PathBuf, PathBuf)> = vec![
            (
                root.path().join("file"),
                PathBuf::from("inside.txt"),
                Path::new("..").join(&out_name).join("f.txt"),
            ),
            (
                root.path().join("dir"),
                PathBuf::from("real"),
                outside.path().to_path_buf(),
            ),
        ];
        for (link, inside, _) in &links {
            std::os::unix::fs::symlink(inside, link).unwrap();
        }
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let swaps = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let thread = std::thread::spawn({
            let (stop, swaps) = (stop.clone(), swaps.clone());
            move || {
                // Bounded in count; the test stops it much earlier.
                for n in 0..50_000_000u64 {
                    if stop.load(Relaxed) {
                        break;
                    }
                    for (link, inside, out) in &links {
                        let target = if n % 2 == 0 { out } else { inside };
                        let tmp = link.with_extension("swap");
                        let _ = std::fs::remove_file(&tmp);
                        std::os::unix::fs::symlink(target, &tmp).unwrap();
                        // rename(2) replaces the link atomically: it always exists.
                        std::fs::rename(&tmp, link).unwrap();
                    }
                    swaps.store(n + 1, Relaxed);
                }
            }
        });
        // Start racing once the thread swaps (bounded: it swaps within microseconds).
        for _ in 0..1_000_000 {
            if swaps.load(Relaxed) > 0 {
                break;
            }
            std::thread::yield_now();
        }
        SymlinkSwapper {
            root,
            _outside: outside,
            stop,
            swaps,
            thread: Some(thread),
        }
    }

    /// Cache off and every lookup resolved anew, so each one races the swaps.
    fn docroot(&self) -> DocRoot {
        DocRoot::open(
            self.root.path(),
            FileOptions {
                cache_bytes: 0,
                revalidate: Duration::ZERO,
                ..FileOptions::default()
            },
        )
        .unwrap()
    }

    fn swaps(&self) -> u64 {
        self.swaps.load(Relaxed)
    }
}

impl Drop for SymlinkSwapper {
    fn drop(&mut self) {
        self.stop.store(true, Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Lookups racing the swaps: outside content is never returned.
#[tokio::test]
async fn symlink_swaps_never_serve_outside_content() {
    bounded(async {
        let race = SymlinkSwapper::start();
        let docroot = race.docroot();
        let (mut served, mut refused) = (0u32, 0u32);
        // At least 20 000 lookups, and on until both answers were seen (at most 400 000).
        for i in 0..400_000u32 {
            if i >= 20_000 && served > 0 && refused > 0 {
                break;
            }
            let rel = if i % 2 == 0 { "file" } else { "dir/f.txt" };
            match docroot.lookup(rel).await.unwrap() {
                Lookup::File(f) => {
                    let body = match &f.content {
                        Content::Memory(b) => b.to_vec(),
                        Content::Disk(file) => {
                            docroot.read_chunk(file, 0, 64).await.unwrap().to_vec()
                        }
                    };
                    assert_eq!(
                        body, b"inside",
                        "lookup {i} of {rel} served outside content"
                    );
                    served += 1;
                }
                Lookup::NotFound => refused += 1,
                other => panic!("lookup {i} of {rel}: {other:?}"),
            }
        }
        // Both kinds of answer happened, or the swapper never raced the lookups.
        assert!(
            served > 0 && refused > 0,
            "served {served}, refused {refused}, swaps {}",
            race.swaps()
        );
    })
    .await
}

/// HTTP/3 requests racing the swaps, 32 at a time: every answer is the inside content or 404.
#[tokio::test]
async fn symlink_swaps_during_requests_never_serve_outside_content() {
    bounded(async {
        let race = SymlinkSwapper::start();
        let chain = CertChain::self_signed().unwrap();
        let site = Site {
            root: Some(race.docroot()),
            ..Site::default()
        };
        let server = Server::start(&chain, shared_tickets(), site, HttpOptions::default());
        let client = client_for(&chain, &server);
        let conn = connect(&client, &server).await;
        let (mut served, mut refused) = (0u32, 0u32);
        // At least 2 000 requests, and on until both answers were seen (at most 40 000).
        for batch in 0..1250u32 {
            if batch >= 63 && served > 0 && refused > 0 {
                break;
            }
            let requests = (0..32u32).map(|i| {
                let conn = &conn;
                let path = if i % 2 == 0 { "/file" } else { "/dir/f.txt" };
                async move { (path, conn.get_body(path).await.unwrap()) }
            });
            for (path, r) in futures_util::future::join_all(requests).await {
                match r.status {
                    StatusCode::OK => {
                        assert_eq!(
                            r.body.as_deref(),
                            Some(&b"inside"[..]),
                            "{path} served outside content"
                        );
                        served += 1;
                    }
                    StatusCode::NOT_FOUND => refused += 1,
                    other => panic!("{path}: {other}"),
                }
            }
        }
        assert!(
            served > 0 && refused > 0,
            "served {served}, refused {refused}, swaps {}",
            race.swaps()
        );
        conn.close().await.unwrap();
        server.shutdown().await;
    })
    .await
}

// ---------------------------------------------------------------------------------------------
// Third-party clients: ngtcp2's gtlsclient and aioquic, as in systests/tests/system/interop/clients.rs
// (gtlsclient exits 0 whatever happened and writes everything to stderr; aioquic ignores
// stateless resets). A client that is not installed skips its test loudly, unless CI is set:
// then its absence is a failure (`ringmux_testkit::tool`).

const CLIENT_TIMEOUT: Duration = Duration::from_secs(50);

/// A document root for the third-party clients: a page, a stylesheet, a 1.5 MB file (streamed,
/// not cached) and a directory.
fn interop_root() -> (TempDir, Vec<u8>) {
    let root = temp_dir("interop");
    std::fs::write(root.path().join("index.html"), b"<h1>index</h1>").unwrap();
    std::fs::write(root.path().join("a.txt"), b"0123456789").unwrap();
    std::fs::write(root.path().join("style.css"), b"h1 { color: red }").unwrap();
    let big = file_bytes(1_500_000);
    std::fs::write(root.path().join("big.bin"), &big).unwrap();
    std::fs::create_dir(root.path().join("sub")).unwrap();
    (root, big)
}

fn interop_server(chain: &CertChain, root: &Path) -> Server {
    let opts = FileOptions {
        cache_control: Some(http::HeaderValue::from_static("public, max-age=60")),
        ..FileOptions::default()
    };
    Server::start(
        chain,
        shared_tickets(),
        root_site(root, opts),
        HttpOptions::default(),
    )
}

async fn gtls(server: &Server, dir: &Path, opts: &[&str], paths: &[&str]) -> String {
    let port = server.addr.port().to_string();
    let mut args: Vec<String> = [
        "--exit-on-all-streams-close",
        "--no-quic-dump",
        "--no-http-dump",
        "--timeout=10s",
        "--handshake-timeout=5s",
    ]
    .iter()
    .chain(opts)
    .map(|s| s.to_string())
    .collect();
    args.push("127.0.0.1".into());
    args.push(port.clone());
    args.extend(paths.iter().map(|p| format!("https://127.0.0.1:{port}{p}")));
    // gtlsclient exits 0 even on a handshake timeout or a reset: success is read from the output.
    tool::run("gtlsclient", &args, dir, CLIENT_TIMEOUT)
        .await
        .stderr
}

fn assert_gtls(what: &str, log: &str, status: &str, requests: usize, fields: &[&str]) {
    let statuses = log.matches(&format!("[:status: {status}]")).count();
    let closed = log.matches("closed with error code 256").count();
    let errors: Vec<&str> = log.lines().filter(|l| l.contains("ERR_")).collect();
    let missing: Vec<&&str> = fields.iter().filter(|f| !log.contains(**f)).collect();
    assert!(
        statuses == requests && closed == requests && errors.is_empty() && missing.is_empty(),
        "{what}: {statuses}/{requests} responses with status {status}, {closed}/{requests} \
         streams closed with H3_NO_ERROR, errors {errors:?}, missing {missing:?}\n\
         --- gtlsclient ---\n{log}"
    );
}

#[tokio::test]
async fn gtlsclient_fetches_files_with_validators() {
    if !tool::GTLSCLIENT.present() {
        return;
    }
    bounded(async {
        let (root, big) = interop_root();
        let chain = CertChain::self_signed().unwrap();
        let server = interop_server(&chain, root.path());
        let work = temp_dir("gtls");
        let dl = work.path().join("dl");
        std::fs::create_dir(&dl).unwrap();
        let download = format!("--download={}", dl.display());

        let log = gtls(
            &server,
            work.path(),
            &[&download],
            &["/index.html", "/style.css", "/big.bin"],
        )
        .await;
        assert_gtls(
            "GET of three files",
            &log,
            "200",
            3,
            &[
                "[etag: \"",
                "[last-modified: ",
                "[accept-ranges: bytes]",
                "[cache-control: public, max-age=60]",
                "[content-type: text/css]",
                "[content-type: text/html; charset=utf-8]",
                "[content-length: 1500000]",
            ],
        );
        assert_eq!(
            std::fs::read(dl.join("index.html")).unwrap(),
            b"<h1>index</h1>"
        );
        assert_eq!(
            std::fs::read(dl.join("style.css")).unwrap(),
            b"h1 { color: red }"
        );
        let got = std::fs::read(dl.join("big.bin")).unwrap();
        assert!(got == big, "big.bin: {} bytes, content differs", got.len());

        let log = gtls(&server, work.path(), &["-m", "HEAD"], &["/big.bin"]).await;
        assert_gtls(
            "HEAD",
            &log,
            "200",
            1,
            &["[content-length: 1500000]", "[etag: \""],
        );

        let log = gtls(&server, work.path(), &[], &["/sub"]).await;
        assert_gtls(
            "directory without slash",
            &log,
            "301",
            1,
            &["[location: /sub/]"],
        );
        let log = gtls(&server, work.path(), &[], &["/"]).await;
        assert_gtls("index", &log, "200", 1, &["[content-length: 14]"]);
        server.shutdown().await;
    })
    .await
}

#[tokio::test]
async fn aioquic_conditional_and_range_requests() {
    if !tool::AIOQUIC.present() {
        return;
    }
    bounded(async {
        let (root, big) = interop_root();
        let chain = CertChain::self_signed().unwrap();
        let server = interop_server(&chain, root.path());
        let work = temp_dir("aioquic");
        let requests = [
            "GET|/a.txt",
            "GET|/a.txt|if-none-match:$ETAG",
            "GET|/a.txt|if-modified-since:$LAST_MODIFIED",
            "GET|/a.txt|if-none-match:\"other\"",
            "GET|/a.txt|range:bytes=2-5",
            "GET|/a.txt|range:bytes=20-",
            "GET|/a.txt|range:bytes=2-5|if-range:\"other\"",
            // Not HEAD: aioquic 1.7.2 checks a HEAD response's content-length against its
            // (empty) body and closes the connection (H3_MESSAGE_ERROR); gtlsclient and the
            // quinn tests cover HEAD.
            "GET|/a.txt|if-match:\"other\"",
            "GET|/big.bin|range:bytes=100000-299999",
            "GET|/",
        ];
        let mut args = vec![
            aioquic::script().to_string_lossy().into_owned(),
            "127.0.0.1".into(),
            server.addr.port().to_string(),
            "requests".into(),
        ];
        args.extend(
            requests
                .iter()
                .flat_map(|r| ["--request".into(), r.to_string()]),
        );
        let out = tool::run("python3", &args, work.path(), CLIENT_TIMEOUT).await;
        let result = aioquic::result(&out.stdout);
        let result = result
            .as_ref()
            .filter(|r| out.success && r["ok"] == true)
            .unwrap_or_else(|| panic!("aioquic_client.py failed:\n{}\n{}", out.stdout, out.stderr));
        let lines = result["responses"]
            .as_array()
            .map_or(&[][..], Vec::as_slice);
        assert_eq!(lines.len(), requests.len(), "{}", out.stdout);
        let f = |i: usize, k: &str| lines[i][k].as_str().unwrap_or("");
        let expect = [
            ("200", 10, checksum(b"0123456789")),
            ("304", 0, checksum(b"")),
            ("304", 0, checksum(b"")),
            ("200", 10, checksum(b"0123456789")),
            ("206", 4, checksum(b"2345")),
            (
                "416",
                b"range not satisfiable\n".len(),
                checksum(b"range not satisfiable\n"),
            ),
            ("200", 10, checksum(b"0123456789")),
            ("412", 20, checksum(b"precondition failed\n")),
            ("206", 200_000, checksum(&big[100_000..300_000])),
            ("200", 14, checksum(b"<h1>index</h1>")),
        ];
        for (i, (status, len, sum)) in expect.iter().enumerate() {
            let what = requests[i];
            assert_eq!(f(i, "status"), *status, "{what}: {:?}", lines[i]);
            assert_eq!(f(i, "body_len"), len.to_string(), "{what}: {:?}", lines[i]);
            assert_eq!(f(i, "body_fnv"), format!("{sum:016x}"), "{what}: content");
        }
        assert!(f(0, "etag").starts_with('"'), "{:?}", lines[0]);
        assert_eq!(f(1, "etag"), f(0, "etag"));
        assert_eq!(f(1, "cache-control"), "public, max-age=60");
        assert_eq!(f(4, "content-range"), "bytes 2-5/10");
        assert_eq!(f(5, "content-range"), "bytes */10");
        assert_eq!(f(8, "content-range"), "bytes 100000-299999/1500000");
        server.shutdown().await;
    })
    .await
}

/// A site serving `root` with `opts`.
fn root_site(root: &Path, opts: FileOptions) -> Site {
    Site {
        root: Some(DocRoot::open(root, opts).expect("opening the document root")),
        ..Site::default()
    }
}

/// Sites over HTTP/3: the connection's site is the one its server name (`localhost`) chooses;
/// a request whose `:authority` names another site, or none, is answered 421 and counted; the
/// routes of the connection's site answer the rest, request bodies read and dropped.
#[tokio::test]
async fn requests_for_another_sites_host_are_misdirected() {
    use ringmux_proto::sites::{Action, Route, Site as TableSite, SiteTable};
    bounded(async {
        let site = |label: &str, names: &[&str], routes: Vec<Route>| TableSite {
            label: label.into(),
            names: names.iter().map(|n| n.to_string()).collect(),
            cert_pem: String::new(),
            key_pem: String::new(),
            acme: false,
            redirect_names: Vec::new(),
            compress: None,
            rules: Default::default(),
            routes,
            limits: Default::default(),
        };
        let respond = |path: &str, status, body: &str| Route {
            compress: None,
            path: path.into(),
            action: Action::Respond(ringmux_proto::route::Respond::new(status, body).unwrap()),
            rules: Default::default(),
            limits: Default::default(),
        };
        let table = SiteTable {
            sites: vec![
                site(
                    "local",
                    &["localhost"],
                    vec![
                        respond("/", 200, "local\n"),
                        respond("/gone", 410, "gone\n"),
                        Route {
                            compress: None,
                            path: "/b".into(),
                            action: Action::Builtin { root: None },
                            rules: Default::default(),
                            limits: Default::default(),
                        },
                    ],
                ),
                site("wild", &["*.example"], vec![respond("/", 200, "wild\n")]),
            ],
            default_site: None,
        };
        let router = Router::new(&table, &RouterOptions::default()).unwrap();
        let chain = CertChain::self_signed().unwrap();
        let server = Server::start(&chain, shared_tickets(), router, HttpOptions::default());
        let client = client_for(&chain, &server);
        let conn = RawConn::open(&client, &server).await;

        let home = conn.get("/", &[]).await;
        assert_eq!(
            (home.status, &home.body[..]),
            (StatusCode::OK, &b"local\n"[..])
        );
        assert_eq!(home.header("content-type"), "text/plain; charset=utf-8");
        let gone = conn.request(Method::POST, "/gone", &[]).await;
        assert_eq!(
            (gone.status, &gone.body[..]),
            (StatusCode::GONE, &b"gone\n"[..])
        );
        let hello = conn.get("/b/hello.txt", &[]).await;
        assert_eq!(hello.body, HELLO_BODY);
        for authority in ["a.example", "example", "localhost.example:443"] {
            let r = conn.request_at(authority, Method::GET, "/", &[]).await;
            assert_eq!(r.status, StatusCode::MISDIRECTED_REQUEST, "{authority}");
        }
        let same = conn
            .request_at("LOCALHOST:443", Method::GET, "/", &[])
            .await;
        assert_eq!(same.status, StatusCode::OK);

        // Counted once a request's task ends: after the server has finished with them all.
        drop(conn);
        let stats = server.stats.clone();
        server.shutdown().await;
        let rows = stats.sites.snapshot();
        assert_eq!(rows[0].label, "local");
        assert_eq!(rows[0].responses, [0, 3, 0, 4, 0]);
        assert_eq!(rows[0].misdirected, 3);
        assert_eq!(rows[1].responses, [0; 5]);
    })
    .await;
}
