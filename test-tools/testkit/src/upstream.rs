//! An HTTP/1.1 service (hyper) to put behind `ringmux --upstream`: the upstream of the proxy
//! tests and of the proxy benchmark (`http1-upstream`).
//!
//! | request | response |
//! |---|---|
//! | `GET /hello` | 200, `hello from upstream\n` |
//! | `GET /bytes/N` | 200, N bytes of [`pattern_byte`] in 64 KiB frames with `content-length`; `?chunked` without it |
//! | `POST` or `PUT /sha256` | 200, `METHOD LEN HEX\n`: the request body's length and SHA-256; each request trailer comes back as a header `x-trailer-NAME` |
//! | `GET /headers` | 200, `METHOD PATH\n` then one `name: value\n` per request header, in arrival order |
//! | `GET /trailers` | 200, body `trailers follow\n`, then the trailer `x-checksum: 42` (declared in `trailer`; sent when the request has `te: trailers`) |
//! | `GET /slow?n=N&ms=M` | 200, N frames of 1 KiB, one every M ms (chunked) |
//! | `GET /hang` | nothing, ever |
//! | `GET /abort` | the connection is closed without a response |
//! | `GET /hop` | 200 with hop-by-hop fields (`connection: x-private`, `x-private`, `keep-alive`) and `x-public: ok` |
//! | `GET /status/N` | status N, empty body |
//! | anything else | 404 |
//!
//! [`Stats`] counts requests, and response or request bodies that ended early (the other side
//! went away): what the cancellation tests wait for.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt;
use http::{HeaderMap, HeaderValue, Method, Request, Response, StatusCode};
use http_body::Frame;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio::sync::watch;

/// Size of the frames of `/bytes/N`.
const FRAME: usize = 64 * 1024;

type Body = UnsyncBoxBody<Bytes, std::io::Error>;

/// Byte `offset` of a `/bytes/N` body: a prime period (251), so a chunk at the wrong offset
/// changes the hash.
pub fn pattern_byte(offset: u64) -> u8 {
    (offset % 251) as u8
}

/// What the upstream has seen.
#[derive(Debug)]
pub struct Stats {
    /// Requests whose head has arrived. Watch with [`Stats::wait_requests`].
    requests: watch::Sender<u64>,
    /// Response bodies dropped before their end, and request bodies that broke off: the peer
    /// (the proxy) closed the connection. Watch with [`Stats::wait_aborted`].
    aborted: watch::Sender<u64>,
}

impl Default for Stats {
    fn default() -> Self {
        Stats {
            requests: watch::Sender::new(0),
            aborted: watch::Sender::new(0),
        }
    }
}

impl Stats {
    /// Requests whose head has arrived so far.
    pub fn requests(&self) -> u64 {
        *self.requests.borrow()
    }

    /// Waits until at least `n` request heads arrived, at most `limit`; returns the count then.
    pub async fn wait_requests(&self, n: u64, limit: Duration) -> u64 {
        let mut rx = self.requests.subscribe();
        let _ = tokio::time::timeout(limit, rx.wait_for(|v| *v >= n)).await;
        self.requests()
    }

    /// Bodies that ended early so far.
    pub fn aborted(&self) -> u64 {
        *self.aborted.borrow()
    }

    /// Waits until at least `n` bodies ended early, at most `limit`; returns the count then.
    pub async fn wait_aborted(&self, n: u64, limit: Duration) -> u64 {
        let mut rx = self.aborted.subscribe();
        let _ = tokio::time::timeout(limit, rx.wait_for(|v| *v >= n)).await;
        self.aborted()
    }

    fn abort(&self) {
        self.aborted.send_modify(|v| *v += 1);
    }
}

/// A running upstream on its own thread and runtime; stops when dropped.
pub struct Upstream {
    addr: SocketAddr,
    stats: Arc<Stats>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Upstream {
    /// Listens on `addr` (port 0: any) with `threads` runtime threads (1: current-thread).
    pub fn start(addr: SocketAddr, threads: usize) -> std::io::Result<Upstream> {
        let std_listener = std::net::TcpListener::bind(addr)?;
        std_listener.set_nonblocking(true)?;
        let addr = std_listener.local_addr()?;
        let stats = Arc::new(Stats::default());
        let (stop, stopped) = tokio::sync::oneshot::channel();
        let rt = if threads <= 1 {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?
        } else {
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(threads)
                .enable_all()
                .build()?
        };
        let served = stats.clone();
        let thread = std::thread::Builder::new()
            .name("upstream".into())
            .spawn(move || {
                rt.block_on(async move {
                    let Ok(listener) = TcpListener::from_std(std_listener) else {
                        return;
                    };
                    tokio::select! {
                        _ = serve(listener, served) => {}
                        _ = stopped => {}
                    }
                });
                // Dropping the runtime ends every connection task.
            })?;
        Ok(Upstream {
            addr,
            stats,
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn stats(&self) -> &Arc<Stats> {
        &self.stats
    }
}

impl Drop for Upstream {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Accepts HTTP/1.1 connections on `listener` forever.
pub async fn serve(listener: TcpListener, stats: Arc<Stats>) {
    loop {
        let Ok((tcp, _)) = listener.accept().await else {
            continue;
        };
        let _ = tcp.set_nodelay(true);
        let stats = stats.clone();
        tokio::spawn(async move {
            let svc = service_fn(move |req| handle(req, stats.clone()));
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(tcp), svc)
                .await;
        });
    }
}

/// The error that makes hyper close a connection without answering (`/abort`).
#[derive(Debug, thiserror::Error)]
#[error("aborted on request")]
struct Abort;

async fn handle(req: Request<Incoming>, stats: Arc<Stats>) -> Result<Response<Body>, Abort> {
    stats.requests.send_modify(|v| *v += 1);
    let path = req.uri().path().to_owned();
    let query = req.uri().query().unwrap_or("").to_owned();
    let method = req.method().clone();
    // HEAD is answered as GET; hyper leaves the body out.
    let route = if method == Method::HEAD {
        Method::GET
    } else {
        method.clone()
    };
    let resp = match (&route, path.as_str()) {
        (&Method::GET, "/hello") => text(StatusCode::OK, "hello from upstream\n".into()),
        (&Method::GET, p) if p.starts_with("/bytes/") => match p["/bytes/".len()..].parse() {
            Ok(n) => bytes(n, query == "chunked", stats),
            Err(_) => text(StatusCode::BAD_REQUEST, "bad length\n".into()),
        },
        (&Method::POST | &Method::PUT, "/sha256") => sha256(req, stats).await,
        (&Method::GET, "/headers") => {
            let mut s = format!("{} {}\n", method, req.uri());
            for (k, v) in req.headers() {
                s.push_str(&format!(
                    "{}: {}\n",
                    k,
                    String::from_utf8_lossy(v.as_bytes())
                ));
            }
            text(StatusCode::OK, s)
        }
        (&Method::GET, "/trailers") => {
            let mut t = HeaderMap::new();
            t.insert("x-checksum", HeaderValue::from_static("42"));
            let frames = futures_util::stream::iter([
                Ok(Frame::data(Bytes::from_static(b"trailers follow\n"))),
                Ok(Frame::trailers(t)),
            ]);
            let mut r = Response::new(StreamBody::new(frames).boxed_unsync());
            // HTTP/1.1 sends only the trailer fields the head declares.
            r.headers_mut()
                .insert("trailer", HeaderValue::from_static("x-checksum"));
            r
        }
        (&Method::GET, "/slow") => {
            let arg = |k: &str| {
                query
                    .split('&')
                    .find_map(|kv| kv.strip_prefix(k)?.strip_prefix('='))
                    .and_then(|v| v.parse::<u64>().ok())
            };
            slow(arg("n").unwrap_or(100), arg("ms").unwrap_or(10), stats)
        }
        (&Method::GET, "/hang") => {
            return Ok(std::future::pending::<Response<Body>>().await);
        }
        (&Method::GET, "/abort") => return Err(Abort),
        (&Method::GET, "/hop") => {
            let mut r = text(StatusCode::OK, "hop\n".into());
            let h = r.headers_mut();
            h.insert("connection", HeaderValue::from_static("x-private"));
            h.insert("x-private", HeaderValue::from_static("secret"));
            h.insert("keep-alive", HeaderValue::from_static("timeout=5"));
            h.insert("x-public", HeaderValue::from_static("ok"));
            r
        }
        (&Method::GET, p) if p.starts_with("/status/") => {
            match p["/status/".len()..]
                .parse::<u16>()
                .ok()
                .and_then(|c| StatusCode::from_u16(c).ok())
            {
                Some(code) => {
                    let mut r = Response::new(
                        Full::new(Bytes::new())
                            .map_err(|n| match n {})
                            .boxed_unsync(),
                    );
                    *r.status_mut() = code;
                    r
                }
                None => text(StatusCode::BAD_REQUEST, "bad status\n".into()),
            }
        }
        _ => text(StatusCode::NOT_FOUND, "not found\n".into()),
    };
    Ok(resp)
}

fn text(status: StatusCode, body: String) -> Response<Body> {
    let mut r = Response::new(
        Full::new(Bytes::from(body))
            .map_err(|n| match n {})
            .boxed_unsync(),
    );
    *r.status_mut() = status;
    r.headers_mut()
        .insert("content-type", HeaderValue::from_static("text/plain"));
    r
}

/// Counts a body in [`Stats::aborted`] if it is dropped before its end.
struct Guard {
    stats: Arc<Stats>,
    done: bool,
}

impl Guard {
    fn complete(mut self) {
        self.done = true;
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        if !self.done {
            self.stats.abort();
        }
    }
}

/// The frames of `stream` as a body, counted in [`Stats::aborted`] if dropped before the end.
fn counted<S>(stats: Arc<Stats>, stream: S) -> Body
where
    S: futures_util::Stream<Item = Bytes> + Send + 'static,
{
    let guard = Guard { stats, done: false };
    let frames =
        futures_util::stream::unfold((Box::pin(stream), guard), |(mut s, guard)| async move {
            match s.next().await {
                Some(b) => Some((Ok(Frame::data(b)), (s, guard))),
                None => {
                    guard.complete();
                    None
                }
            }
        });
    StreamBody::new(frames).boxed_unsync()
}

fn bytes(n: u64, chunked: bool, stats: Arc<Stats>) -> Response<Body> {
    let chunks = futures_util::stream::iter((0..n).step_by(FRAME)).map(move |start| {
        let len = (n - start).min(FRAME as u64);
        Bytes::from((start..start + len).map(pattern_byte).collect::<Vec<u8>>())
    });
    let mut r = Response::new(counted(stats, chunks));
    let h = r.headers_mut();
    h.insert(
        "content-type",
        HeaderValue::from_static("application/octet-stream"),
    );
    if !chunked {
        h.insert("content-length", HeaderValue::from(n));
    }
    r
}

fn slow(n: u64, ms: u64, stats: Arc<Stats>) -> Response<Body> {
    let chunks = futures_util::stream::iter(0..n).then(move |_| async move {
        tokio::time::sleep(Duration::from_millis(ms)).await;
        Bytes::from(vec![b'.'; 1024])
    });
    Response::new(counted(stats, chunks))
}

async fn sha256(req: Request<Incoming>, stats: Arc<Stats>) -> Response<Body> {
    let method = req.method().clone();
    let mut body = req.into_body();
    let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
    let mut len = 0u64;
    let mut trailers = None;
    loop {
        match body.frame().await {
            None => break,
            Some(Err(_)) => {
                stats.abort();
                return text(StatusCode::BAD_REQUEST, "request body broke off\n".into());
            }
            Some(Ok(f)) => match f.into_data() {
                Ok(d) => {
                    len += d.len() as u64;
                    ctx.update(&d);
                }
                Err(f) => trailers = f.into_trailers().ok(),
            },
        }
    }
    let digest = ctx.finish();
    let hex: String = digest.as_ref().iter().map(|b| format!("{b:02x}")).collect();
    let mut r = text(StatusCode::OK, format!("{method} {len} {hex}\n"));
    for (k, v) in trailers.iter().flatten() {
        if let Ok(name) = http::HeaderName::from_bytes(format!("x-trailer-{k}").as_bytes()) {
            r.headers_mut().append(name, v.clone());
        }
    }
    r
}
