//! The reverse proxy (`ringmux --upstream`) end to end: ringmux and its built-in workers in
//! front of a real HTTP/1.1 service started by the test, hyper's (`ringmux_testkit::upstream`) or
//! Python's `http.server` (`test-tools/python/http1_upstream.py`). Checked: methods, bodies
//! both ways (100 MiB each way by SHA-256, with the workers' peak memory), trailers both ways,
//! headers both ways (hop-by-hop removed, the client's address in `forwarded`/`x-forwarded-*`,
//! also after a migration), 502 and 504 with their metrics and log lines, and that a client
//! that cancels its stream cancels the upstream exchange. gtlsclient and aioquic through the
//! proxy are in `e2e_interop.rs`.

use ringmux_systests::harness;

use std::net::{SocketAddr, UdpSocket};
use std::time::Duration;

use bytes::{Buf, Bytes};
use h3::error::Code;
use harness::{bounded, hex, peak_rss, sha256_hex, upload_byte, Forward, PyUpstream, Ringmux};
use http::{HeaderMap, HeaderValue, Method, Request, StatusCode};
use http_body_util::{BodyExt, StreamBody};
use hyper::body::Frame;
use ringmux_demux::metrics::names;
use ringmux_testkit::client::{H3Conn, Response};
use ringmux_testkit::tcp_client::{ClientBody, TcpConn, Version};
use ringmux_testkit::upstream::{pattern_byte, Upstream};

const LIMIT: Duration = Duration::from_secs(180);

type Stream = h3::client::RequestStream<h3_quinn::BidiStream<Bytes>, Bytes>;
type BoxError = Box<dyn std::error::Error + Send + Sync>;

fn hyper_upstream() -> Upstream {
    Upstream::start("127.0.0.1:0".parse().unwrap(), 1).expect("starting the hyper upstream")
}

fn proxy(upstream: SocketAddr, instances: u8, extra: &[&str]) -> Ringmux {
    let url = format!("http://{upstream}");
    let mut args = vec!["--upstream", url.as_str()];
    args.extend_from_slice(extra);
    Ringmux::start(instances, Forward::Shm, &args)
}

fn text(resp: &Response) -> String {
    String::from_utf8_lossy(resp.body.as_deref().unwrap_or_default()).into_owned()
}

/// The SHA-256 of `/bytes/N` as the upstreams make it.
fn pattern_sha256(n: u64) -> String {
    let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
    let period: Vec<u8> = (0..251).map(pattern_byte).collect();
    let mut left = n;
    while left > 0 {
        let k = left.min(251);
        ctx.update(&period[..k as usize]);
        left -= k;
    }
    hex(ctx.finish().as_ref())
}

/// Opens `method path` with `headers`; the caller sends the body.
async fn open(conn: &H3Conn, method: Method, path: &str, headers: &[(&str, &str)]) -> Stream {
    let mut req = Request::builder().method(method).uri(path);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    conn.open(req.body(()).unwrap()).await.expect("open")
}

/// Reads a whole response: head, body (SHA-256 and length; kept when short), trailers.
struct Read {
    status: StatusCode,
    headers: HeaderMap,
    len: u64,
    sha256: String,
    text: String,
    trailers: Option<HeaderMap>,
}

async fn read_all(stream: &mut Stream) -> Result<Read, h3::error::StreamError> {
    let head = stream.recv_response().await?;
    let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
    let mut len = 0u64;
    let mut kept = Vec::new();
    while let Some(mut chunk) = stream.recv_data().await? {
        while chunk.has_remaining() {
            let part = chunk.chunk();
            ctx.update(part);
            if kept.len() < 64 * 1024 {
                kept.extend_from_slice(&part[..part.len().min(64 * 1024 - kept.len())]);
            }
            len += part.len() as u64;
            let n = part.len();
            chunk.advance(n);
        }
    }
    let trailers = stream.recv_trailers().await?;
    Ok(Read {
        status: head.status(),
        headers: head.headers().clone(),
        len,
        sha256: hex(ctx.finish().as_ref()),
        text: String::from_utf8_lossy(&kept).into_owned(),
        trailers,
    })
}

/// Uploads `n` bytes (a pattern distinct from the download one) in 64 KiB frames with
/// `method` to `/sha256`, returns the upstream's answer and the body's SHA-256.
async fn upload(conn: &H3Conn, method: Method, n: u64, with_length: bool) -> (Read, String) {
    let len = n.to_string();
    let headers: Vec<(&str, &str)> = if with_length {
        vec![("content-length", len.as_str())]
    } else {
        vec![]
    };
    let mut stream = open(conn, method, "/sha256", &headers).await;
    let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
    let mut sent = 0u64;
    while sent < n {
        let k = (n - sent).min(64 * 1024);
        let chunk: Vec<u8> = (sent..sent + k).map(upload_byte).collect();
        ctx.update(&chunk);
        stream
            .send_data(Bytes::from(chunk))
            .await
            .expect("send body");
        sent += k;
    }
    stream.finish().await.expect("finish the request");
    let read = read_all(&mut stream).await.expect("read the answer");
    (read, hex(ctx.finish().as_ref()))
}

/// GET, HEAD, POST and PUT with and without a length, status codes passed through, headers
/// both ways, trailers both ways, and the client's address after a migration.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn methods_headers_and_trailers() {
    let up = hyper_upstream();
    let rm = proxy(up.addr(), 2, &[]);
    bounded(LIMIT, async {
        let client = rm.client();
        let conn = rm.connect(&client).await;

        let hello = conn.get_body("/hello").await.expect("GET /hello");
        assert_eq!(hello.status, StatusCode::OK);
        assert_eq!(text(&hello), "hello from upstream\n");

        let head = conn
            .request(Method::HEAD, "/bytes/1000", None, true)
            .await
            .expect("HEAD");
        assert_eq!(head.status, StatusCode::OK);
        assert_eq!(head.headers["content-length"], "1000");
        assert_eq!(head.body_len, 0, "HEAD has no body");

        for (method, with_length) in [(Method::POST, false), (Method::PUT, true)] {
            let (read, sha) = upload(&conn, method.clone(), 100_000, with_length).await;
            assert_eq!(read.status, StatusCode::OK);
            assert_eq!(read.text, format!("{method} 100000 {sha}\n"));
        }
        let empty = conn
            .request(Method::POST, "/sha256", None, true)
            .await
            .expect("POST without a body");
        assert_eq!(text(&empty), format!("POST 0 {}\n", sha256_hex(b"")));

        // A body shorter than its own content-length is the client's fault: 400, and no
        // upstream error counted.
        let mut s = open(&conn, Method::POST, "/sha256", &[("content-length", "100")]).await;
        s.send_data(Bytes::from_static(b"only ten b"))
            .await
            .expect("data");
        s.finish().await.expect("finish");
        let r = read_all(&mut s).await.expect("short body");
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{}", r.text);

        for code in [201u16, 404, 503] {
            let r = conn.get(&format!("/status/{code}")).await.expect("status");
            assert_eq!(r.status.as_u16(), code);
        }

        // Request headers: the client's own pass, spoofed forwarding fields do not.
        let mut s = open(
            &conn,
            Method::GET,
            "/headers?x=1",
            &[
                ("x-custom", "abc"),
                ("x-forwarded-for", "6.6.6.6"),
                ("forwarded", "for=6.6.6.6"),
                ("x-forwarded-proto", "gopher"),
            ],
        )
        .await;
        s.finish().await.expect("finish");
        let got = read_all(&mut s).await.expect("GET /headers").text;
        let port = client.local_addr().unwrap().port();
        for line in [
            "GET /headers?x=1".to_string(),
            "x-custom: abc".into(),
            "x-forwarded-for: 127.0.0.1".into(),
            "x-forwarded-proto: https".into(),
            format!("host: localhost:{}", rm.listen.port()),
            format!("x-forwarded-host: localhost:{}", rm.listen.port()),
            format!(
                "forwarded: for=\"127.0.0.1:{port}\";proto=https;host=\"localhost:{}\"",
                rm.listen.port()
            ),
        ] {
            assert!(got.lines().any(|l| l == line), "no {line:?} in\n{got}");
        }
        assert!(!got.contains("6.6.6.6") && !got.contains("gopher"), "{got}");

        // Response headers: hop-by-hop fields are removed, the others pass.
        let hop = conn.get("/hop").await.expect("GET /hop");
        assert_eq!(hop.headers["x-public"], "ok");
        for gone in ["connection", "x-private", "keep-alive"] {
            assert!(!hop.headers.contains_key(gone), "{gone}: {:?}", hop.headers);
        }

        // Trailers, client → upstream: they come back as x-trailer-* headers. HTTP/1.1 carries
        // the trailer fields a request declares in `trailer`.
        let mut s = open(&conn, Method::POST, "/sha256", &[("trailer", "x-sum")]).await;
        s.send_data(Bytes::from_static(b"abc")).await.expect("data");
        let mut t = HeaderMap::new();
        t.insert("x-sum", HeaderValue::from_static("7"));
        s.send_trailers(t).await.expect("trailers");
        s.finish().await.expect("finish");
        let r = read_all(&mut s).await.expect("POST with trailers");
        assert_eq!(r.text, format!("POST 3 {}\n", sha256_hex(b"abc")));
        assert_eq!(r.headers["x-trailer-x-sum"], "7", "{:?}", r.headers);

        // Trailers, upstream → client.
        let mut s = open(&conn, Method::GET, "/trailers", &[("te", "trailers")]).await;
        s.finish().await.expect("finish");
        let r = read_all(&mut s).await.expect("GET /trailers");
        assert_eq!(r.text, "trailers follow\n");
        let trailers = r.trailers.expect("trailers from the upstream");
        assert_eq!(trailers["x-checksum"], "42");

        // After a migration (new socket, new port) the upstream sees the new address.
        let socket = UdpSocket::bind("127.0.0.1:0").unwrap();
        let new_port = socket.local_addr().unwrap().port();
        client.rebind(socket).expect("rebind");
        let mut s = open(&conn, Method::GET, "/headers", &[]).await;
        s.finish().await.expect("finish");
        let got = read_all(&mut s)
            .await
            .expect("GET /headers after migration")
            .text;
        let want = format!("forwarded: for=\"127.0.0.1:{new_port}\";");
        assert!(
            got.lines().any(|l| l.starts_with(&want)),
            "no {want:?} after the migration from port {port} in\n{got}"
        );
        let m = rm
            .wait_for("the workers' reports", Duration::from_secs(20), |m| {
                m.sum(names::WORKER_REQUESTS) >= 10.0
            })
            .await;
        assert_eq!(m.sum(names::WORKER_UPSTREAM_ERRORS), 0.0, "{m}");
        conn.close().await.expect("close");
    })
    .await;
}

/// 100 MiB up and 100 MiB down, each checked by SHA-256, without a worker holding a body: the
/// workers' peak memory stays far below one body.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_100_mib_each_way() {
    const N: u64 = 100 << 20;
    let up = hyper_upstream();
    let rm = proxy(up.addr(), 2, &[]);
    bounded(LIMIT, async {
        let pids = rm.worker_pids().await;
        let before: Vec<u64> = pids.iter().map(|p| peak_rss(*p)).collect();
        let conn = rm.connect(&rm.client()).await;
        let (read, sha) = upload(&conn, Method::PUT, N, false).await;
        assert_eq!(read.status, StatusCode::OK);
        assert_eq!(read.text, format!("PUT {N} {sha}\n"));

        let mut s = open(&conn, Method::GET, &format!("/bytes/{N}"), &[]).await;
        s.finish().await.expect("finish");
        let down = read_all(&mut s).await.expect("download");
        assert_eq!(down.status, StatusCode::OK);
        assert_eq!(down.len, N);
        assert_eq!(down.sha256, pattern_sha256(N));
        conn.close().await.expect("close");

        for (pid, before) in pids.iter().zip(before) {
            let after = peak_rss(*pid);
            eprintln!("worker {pid}: peak RSS {before} -> {after} bytes");
            assert!(
                after < before + (32 << 20),
                "worker {pid}: peak RSS grew from {before} to {after} bytes moving 100 MiB each way"
            );
        }
    })
    .await;
}

/// 502 for an upstream that closes without answering, 504 for one that does not answer in
/// time, a reset stream for a body that stalls; each counted by kind and logged once per cause.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_failures_are_502_504_and_counted() {
    let up = hyper_upstream();
    let rm = proxy(up.addr(), 1, &["--upstream-timeout", "1"]);
    bounded(LIMIT, async {
        let conn = rm.connect(&rm.client()).await;
        for _ in 0..3 {
            let r = conn.get_body("/abort").await.expect("GET /abort");
            assert_eq!(r.status, StatusCode::BAD_GATEWAY);
            assert_eq!(text(&r), "upstream closed the connection\n");
        }
        for _ in 0..2 {
            let r = conn.get_body("/hang").await.expect("GET /hang");
            assert_eq!(r.status, StatusCode::GATEWAY_TIMEOUT);
            assert_eq!(text(&r), "upstream did not answer in time\n");
        }
        // The head arrives, then the body stalls past the timeout: a reset, not a short body.
        let slow = conn
            .start(Method::GET, "/slow?n=3&ms=3000", None)
            .await
            .expect("head of /slow");
        assert_eq!(slow.status(), StatusCode::OK);
        assert!(
            slow.read_body(false).await.is_err(),
            "a stalled body ends in a reset"
        );

        let m = rm
            .wait_for("upstream errors reported", Duration::from_secs(20), |m| {
                let k = |kind| m.sum_where(names::WORKER_UPSTREAM_ERRORS, "kind", kind);
                k("reset") >= 3.0 && k("timeout") >= 3.0
            })
            .await;
        assert_eq!(
            m.sum_where(names::WORKER_UPSTREAM_ERRORS, "kind", "connect"),
            0.0
        );
        // A success clears the failing state: the next failure is logged again.
        let ok = conn.get_body("/hello").await.expect("GET /hello");
        assert_eq!(ok.status, StatusCode::OK);
        let r = conn.get_body("/abort").await.expect("GET /abort again");
        assert_eq!(r.status, StatusCode::BAD_GATEWAY);
        conn.close().await.expect("close");

        let failing = |log: &str, kind: &str| {
            log.lines()
                .filter(|l| {
                    l.contains("upstream failing") && l.contains(&format!("kind=\"{kind}\""))
                })
                .count()
        };
        let again = |log: &str| log.matches("upstream answering again").count();
        // The last failure's line reaches the log after its 502 reached the client: wait for
        // every expected line, then check that there is no more than expected.
        let log = rm
            .wait_for_log("the upstream's failures", Duration::from_secs(20), |log| {
                failing(log, "reset") >= 2 && failing(log, "timeout") >= 2 && again(log) >= 2
            })
            .await;
        // reset: once for the first three, once after /hello succeeded. timeout: once for the
        // two 504s, once for the stalled body (its head had come: a success in between).
        assert_eq!(failing(&log, "reset"), 2, "{log}");
        assert_eq!(failing(&log, "timeout"), 2, "{log}");
        assert_eq!(again(&log), 2, "{log}");
    })
    .await;

    // Nothing listening: connect errors, 502.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = closed.local_addr().unwrap();
    drop(closed);
    let rm = proxy(addr, 1, &[]);
    bounded(LIMIT, async {
        let conn = rm.connect(&rm.client()).await;
        let r = conn.get_body("/hello").await.expect("GET");
        assert_eq!(r.status, StatusCode::BAD_GATEWAY);
        assert_eq!(text(&r), "upstream refused the connection\n");
        rm.wait_for("a connect error reported", Duration::from_secs(20), |m| {
            m.sum_where(names::WORKER_UPSTREAM_ERRORS, "kind", "connect") >= 1.0
        })
        .await;
        conn.close().await.expect("close");
    })
    .await;
}

/// A client that cancels its stream mid-download, or resets it mid-upload, ends the upstream
/// exchange: the upstream sees its response (or the request body) break off.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_stream_cancels_the_upstream_request() {
    let up = hyper_upstream();
    let rm = proxy(up.addr(), 1, &[]);
    bounded(LIMIT, async {
        let conn = rm.connect(&rm.client()).await;
        let mut s = open(&conn, Method::GET, "/slow?n=100000&ms=5", &[]).await;
        s.finish().await.expect("finish");
        let head = s.recv_response().await.expect("head");
        assert_eq!(head.status(), StatusCode::OK);
        let first = s.recv_data().await.expect("data").expect("a first chunk");
        assert!(first.remaining() > 0);
        // Dropping the stream unread stops the server's sending (quinn sends STOP_SENDING).
        drop(s);
        let aborted = up.stats().wait_aborted(1, Duration::from_secs(30)).await;
        assert_eq!(aborted, 1, "the upstream's response body broke off once");

        let seen = up.stats().requests();
        let mut s = open(
            &conn,
            Method::POST,
            "/sha256",
            &[("content-length", "10000000")],
        )
        .await;
        s.send_data(Bytes::from(vec![1u8; 1 << 20]))
            .await
            .expect("data");
        // Reset only once the upstream is reading the body (before that there is nothing
        // upstream to cancel).
        let now = up
            .stats()
            .wait_requests(seen + 1, Duration::from_secs(30))
            .await;
        assert_eq!(now, seen + 1, "the upload reached the upstream");
        s.stop_stream(Code::H3_REQUEST_CANCELLED);
        drop(s);
        let aborted = up.stats().wait_aborted(2, Duration::from_secs(30)).await;
        assert_eq!(aborted, 2, "the upstream's request body broke off too");

        // The worker is unharmed.
        let ok = conn.get_body("/hello").await.expect("GET /hello");
        assert_eq!(ok.status, StatusCode::OK);
        conn.close().await.expect("close");
    })
    .await;
}

/// Python's http.server behind the proxy: GET, a 20 MiB download, POST (chunked) and PUT
/// (with a length) uploads checked by SHA-256, and the forwarded headers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_http_server_upstream() {
    let py = PyUpstream::start();
    let rm = proxy(py.addr, 2, &[]);
    bounded(LIMIT, async {
        let conn = rm.connect(&rm.client()).await;
        let hello = conn.get_body("/hello").await.expect("GET /hello");
        assert_eq!(text(&hello), "hello from upstream (python)\n");
        let n = 20u64 << 20;
        let mut s = open(&conn, Method::GET, &format!("/bytes/{n}"), &[]).await;
        s.finish().await.expect("finish");
        let down = read_all(&mut s).await.expect("download");
        assert_eq!((down.len, down.sha256), (n, pattern_sha256(n)));
        for (method, with_length) in [(Method::POST, false), (Method::PUT, true)] {
            let (read, sha) = upload(&conn, method.clone(), 8 << 20, with_length).await;
            assert_eq!(read.text, format!("{method} {} {sha}\n", 8 << 20));
        }
        let headers = text(&conn.get_body("/headers").await.expect("GET /headers"));
        assert!(
            headers.contains("\nx-forwarded-for: 127.0.0.1\n"),
            "{headers}"
        );
        assert!(
            headers.contains("\nforwarded: for=\"127.0.0.1:"),
            "{headers}"
        );
        conn.close().await.expect("close");
    })
    .await;
}

/// A request over TCP: `method path` with `headers`, the body `body` (streamed in 64 KiB frames
/// when `chunks`, one frame otherwise) and `trailers`.
fn tcp_request(
    method: Method,
    path: &str,
    headers: &[(&str, &str)],
    body: Vec<u8>,
    trailers: Option<HeaderMap>,
) -> Request<ClientBody> {
    let mut req = Request::builder()
        .method(method)
        .uri(path)
        .header("host", "localhost");
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let mut frames: Vec<Result<Frame<Bytes>, BoxError>> = body
        .chunks(64 * 1024)
        .map(|c| Ok(Frame::data(Bytes::copy_from_slice(c))))
        .collect();
    if let Some(t) = trailers {
        frames.push(Ok(Frame::trailers(t)));
    }
    let body = StreamBody::new(futures_util::stream::iter(frames)).boxed_unsync();
    req.body(body).expect("a valid request")
}

/// What a TCP response came to: head fields, body text, SHA-256 and length, trailers.
struct TcpRead {
    status: StatusCode,
    headers: HeaderMap,
    text: String,
    len: u64,
    sha256: String,
    trailers: Option<HeaderMap>,
}

async fn tcp_read(resp: http::Response<hyper::body::Incoming>) -> Result<TcpRead, hyper::Error> {
    let (parts, mut body) = resp.into_parts();
    let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
    let (mut text, mut len, mut trailers) = (Vec::new(), 0u64, None);
    while let Some(frame) = body.frame().await {
        match frame?.into_data() {
            Ok(data) => {
                ctx.update(&data);
                len += data.len() as u64;
                if text.len() < 64 * 1024 {
                    text.extend_from_slice(&data);
                }
            }
            Err(f) => trailers = f.into_trailers().ok(),
        }
    }
    Ok(TcpRead {
        status: parts.status,
        headers: parts.headers,
        text: String::from_utf8_lossy(&text).into_owned(),
        len,
        sha256: hex(ctx.finish().as_ref()),
        trailers,
    })
}

async fn tcp_send(conn: &mut TcpConn, req: Request<ClientBody>) -> TcpRead {
    let resp = conn.send(req).await.expect("response head over TCP");
    tcp_read(resp).await.expect("response body over TCP")
}

/// `--upstream` over TCP, HTTP/1.1 and HTTP/2: the one proxy path HTTP/3 takes. Methods, bodies
/// both ways by SHA-256 (10 MiB), forwarded fields naming the TCP peer (spoofed ones replaced),
/// hop-by-hop fields removed, trailers both ways (HTTP/2), `alt-svc` on proxied responses, and
/// 502/504/a reset for a failing upstream, counted as over HTTP/3.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxy_serves_tcp_as_it_serves_http3() {
    const N: u64 = 10 << 20;
    let up = hyper_upstream();
    let rm = proxy(up.addr(), 2, &["--upstream-timeout", "2"]);
    let tcp = SocketAddr::new(rm.listen.ip(), rm.listen.port());
    bounded(LIMIT, async {
        for version in [Version::Http1, Version::Http2] {
            let mut conn = TcpConn::connect(tcp, version).await.expect("TLS over TCP");
            let hello = tcp_send(
                &mut conn,
                tcp_request(Method::GET, "/hello", &[], vec![], None),
            )
            .await;
            assert_eq!(hello.status, StatusCode::OK, "{version:?}");
            assert_eq!(hello.text, "hello from upstream\n");
            assert_eq!(
                hello.headers["alt-svc"],
                format!("h3=\":{}\"; ma=86400", rm.listen.port())
            );

            let head = tcp_send(
                &mut conn,
                tcp_request(Method::HEAD, "/bytes/1000", &[], vec![], None),
            )
            .await;
            assert_eq!(head.headers["content-length"], "1000");
            assert_eq!(head.len, 0, "HEAD has no body");

            let body: Vec<u8> = (0..N).map(upload_byte).collect();
            let sha = sha256_hex(&body);
            for (method, length) in [(Method::POST, false), (Method::PUT, true)] {
                let n = N.to_string();
                let headers: &[(&str, &str)] = if length {
                    &[("content-length", n.as_str())]
                } else {
                    &[]
                };
                let r = tcp_send(
                    &mut conn,
                    tcp_request(method.clone(), "/sha256", headers, body.clone(), None),
                )
                .await;
                assert_eq!(r.text, format!("{method} {N} {sha}\n"), "{version:?}");
            }
            let down = tcp_send(
                &mut conn,
                tcp_request(Method::GET, &format!("/bytes/{N}"), &[], vec![], None),
            )
            .await;
            assert_eq!((down.status, down.len), (StatusCode::OK, N));
            assert_eq!(down.sha256, pattern_sha256(N));

            // The TCP peer, not what the client claims.
            let got = tcp_send(
                &mut conn,
                tcp_request(
                    Method::GET,
                    "/headers?x=1",
                    &[
                        ("x-custom", "abc"),
                        ("x-forwarded-for", "6.6.6.6"),
                        ("forwarded", "for=6.6.6.6"),
                    ],
                    vec![],
                    None,
                ),
            )
            .await
            .text;
            let peer = conn.local_addr().port();
            for line in [
                "GET /headers?x=1".to_string(),
                "x-custom: abc".into(),
                "x-forwarded-for: 127.0.0.1".into(),
                "x-forwarded-proto: https".into(),
                "host: localhost".into(),
                format!("forwarded: for=\"127.0.0.1:{peer}\";proto=https;host=\"localhost\""),
            ] {
                assert!(
                    got.lines().any(|l| l == line),
                    "{version:?}: no {line:?} in\n{got}"
                );
            }
            assert!(!got.contains("6.6.6.6"), "{got}");

            let hop = tcp_send(
                &mut conn,
                tcp_request(Method::GET, "/hop", &[], vec![], None),
            )
            .await;
            assert_eq!(hop.headers["x-public"], "ok");
            assert!(!hop.headers.contains_key("x-private"), "{:?}", hop.headers);

            if version == Version::Http2 {
                // Trailers both ways (HTTP/1.1 clients rarely send them; hyper's does not).
                let mut t = HeaderMap::new();
                t.insert("x-sum", HeaderValue::from_static("7"));
                let r = tcp_send(
                    &mut conn,
                    tcp_request(
                        Method::POST,
                        "/sha256",
                        &[("trailer", "x-sum")],
                        b"abc".to_vec(),
                        Some(t),
                    ),
                )
                .await;
                assert_eq!(r.text, format!("POST 3 {}\n", sha256_hex(b"abc")));
                assert_eq!(r.headers["x-trailer-x-sum"], "7", "{:?}", r.headers);
                let r = tcp_send(
                    &mut conn,
                    tcp_request(
                        Method::GET,
                        "/trailers",
                        &[("te", "trailers")],
                        vec![],
                        None,
                    ),
                )
                .await;
                assert_eq!(r.text, "trailers follow\n");
                assert_eq!(
                    r.trailers.expect("trailers from the upstream")["x-checksum"],
                    "42"
                );
            }

            // A failing upstream: 502, 504, and a reset (not a short body) when the body stalls.
            let r = tcp_send(
                &mut conn,
                tcp_request(Method::GET, "/abort", &[], vec![], None),
            )
            .await;
            assert_eq!(r.status, StatusCode::BAD_GATEWAY);
            assert_eq!(r.text, "upstream closed the connection\n");
            let r = tcp_send(
                &mut conn,
                tcp_request(Method::GET, "/hang", &[], vec![], None),
            )
            .await;
            assert_eq!(r.status, StatusCode::GATEWAY_TIMEOUT);
            assert_eq!(r.text, "upstream did not answer in time\n");
            let slow = conn
                .send(tcp_request(
                    Method::GET,
                    "/slow?n=3&ms=5000",
                    &[],
                    vec![],
                    None,
                ))
                .await
                .expect("head of /slow");
            assert_eq!(slow.status(), StatusCode::OK);
            assert!(
                tcp_read(slow).await.is_err(),
                "{version:?}: a stalled body ends in an error"
            );
        }
        let m = rm
            .wait_for(
                "requests and upstream errors reported",
                Duration::from_secs(20),
                |m| {
                    let k = |kind| m.sum_where(names::WORKER_UPSTREAM_ERRORS, "kind", kind);
                    k("reset") >= 2.0
                        && k("timeout") >= 4.0
                        && m.sum_where(names::WORKER_REQUESTS, "protocol", "h1") >= 10.0
                        && m.sum_where(names::WORKER_REQUESTS, "protocol", "h2") >= 12.0
                },
            )
            .await;
        assert_eq!(
            m.sum_where(names::WORKER_REQUESTS, "protocol", "h3"),
            0.0,
            "{m}"
        );
    })
    .await;
}
