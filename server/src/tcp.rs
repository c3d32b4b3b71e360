//! HTTPS over TCP beside HTTP/3: the built-in server's second transport. Browsers open QUIC only
//! to an origin that told them over TCP (an `alt-svc` field, RFC 7838; RFC 9114 §3.1.1), and
//! fall back to TCP where UDP is blocked, so the same site answers on both: the request is
//! routed by `crate::http::route`, the one path HTTP/3 takes too, and every TCP response
//! carries the `alt-svc` value ringmux was given.
//!
//! TLS 1.3 and 1.2 with ringmux's certificate (tokio-rustls), ALPN `h2` and `http/1.1`, served
//! by hyper (HTTP/1.1 or HTTP/2, as ALPN chose; HTTP/1.1 without ALPN).
//! Connections come from the demux's listening socket, which every worker accepts from
//! ([`ringmux_worker::Worker::tcp_listener`]).
//!
//! Bad input and overload: a TLS handshake must finish within [`TcpOptions::handshake_timeout`]
//! (idle or half-open connections never pile up), an HTTP/1.1 request head within
//! [`TcpOptions::header_timeout`] (slowloris); past [`TcpOptions::max_connections`] a new
//! connection is closed at accept; a request head is at most [`TcpOptions::max_header_bytes`]
//! (HTTP/1.1: 431 and the connection closed; HTTP/2: `SETTINGS_MAX_HEADER_LIST_SIZE`, over it
//! 431 on that stream), HTTP/2 streams are capped per connection and rapid resets are h2's to
//! refuse (GOAWAY `ENHANCE_YOUR_CALM`). Each is counted in [`ServerStats::tcp_errors`] by
//! [`TcpErrorKind`]; requests by protocol in `requests_h1` and `requests_h2`.
//!
//! On drain: this worker stops accepting (the others and the next generation keep the queue),
//! every connection is told to finish (HTTP/2 GOAWAY, HTTP/1.1 `connection: close`), and the
//! server returns when the last one closed; the caller bounds that with its grace.

use std::convert::Infallible;
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::{header, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Empty, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::sync::watch;
use tokio::task::JoinSet;
use tracing::{debug, info};

use crate::http::{
    authority_of, fill_pattern, route, Body, Logged, Reply, ServerStats, Site, CHUNK,
};
use crate::proxy::{ClientGone, Exchange, Upstream};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Why a TCP connection was refused or ended early, for
/// `ringmux_worker_tcp_errors_total{kind}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TcpErrorKind {
    /// Closed at accept: this worker serves [`TcpOptions::max_connections`] already.
    OverCap,
    /// The TLS handshake failed (garbage instead of TLS, a client that gave up).
    TlsFailed,
    /// The TLS handshake did not finish within [`TcpOptions::handshake_timeout`].
    TlsTimeout,
    /// An HTTP/1.1 request head did not arrive within [`TcpOptions::header_timeout`].
    HeaderTimeout,
    /// An HTTP/1.1 request head larger than [`TcpOptions::max_header_bytes`] (answered 431).
    TooLarge,
    /// An HTTP/2 client that reset or provoked too many streams (rapid reset): its connection
    /// was closed with GOAWAY `ENHANCE_YOUR_CALM`.
    RapidReset,
    /// Any other HTTP/1.1 or HTTP/2 protocol violation that ended the connection.
    Protocol,
}

impl TcpErrorKind {
    /// Every kind, in the order of [`ServerStats::tcp_errors`].
    pub const ALL: [TcpErrorKind; 7] = [
        TcpErrorKind::OverCap,
        TcpErrorKind::TlsFailed,
        TcpErrorKind::TlsTimeout,
        TcpErrorKind::HeaderTimeout,
        TcpErrorKind::TooLarge,
        TcpErrorKind::RapidReset,
        TcpErrorKind::Protocol,
    ];

    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            TcpErrorKind::OverCap => "over_cap",
            TcpErrorKind::TlsFailed => "tls_failed",
            TcpErrorKind::TlsTimeout => "tls_timeout",
            TcpErrorKind::HeaderTimeout => "header_timeout",
            TcpErrorKind::TooLarge => "too_large",
            TcpErrorKind::RapidReset => "rapid_reset",
            TcpErrorKind::Protocol => "protocol",
        }
    }

    /// What ended a connection with `e`, if it was the client's bad input; `None` for a client
    /// that simply went away.
    fn of(e: &(dyn std::error::Error + 'static)) -> Option<TcpErrorKind> {
        let mut cur = Some(e);
        while let Some(err) = cur {
            if let Some(h) = err.downcast_ref::<hyper::Error>() {
                if h.is_timeout() {
                    return Some(TcpErrorKind::HeaderTimeout);
                }
                if h.is_parse_too_large() {
                    return Some(TcpErrorKind::TooLarge);
                }
                if h.is_parse() {
                    return Some(TcpErrorKind::Protocol);
                }
            }
            if let Some(h2) = err.downcast_ref::<h2::Error>() {
                if h2.is_io() || h2.is_remote() {
                    return None;
                }
                return match h2.reason() {
                    Some(h2::Reason::ENHANCE_YOUR_CALM) => Some(TcpErrorKind::RapidReset),
                    Some(h2::Reason::NO_ERROR) | None => None,
                    Some(_) => Some(TcpErrorKind::Protocol),
                };
            }
            cur = err.source();
        }
        None
    }
}

/// How the TCP side serves.
#[derive(Clone, Debug)]
pub struct TcpOptions {
    /// The `alt-svc` field of every response; `None`: none.
    pub alt_svc: Option<HeaderValue>,
    /// Connections this worker serves at once; more are closed at accept.
    pub max_connections: usize,
    /// Longest a TLS handshake may take.
    pub handshake_timeout: Duration,
    /// Longest an HTTP/1.1 request head may take to arrive.
    pub header_timeout: Duration,
    /// Longest an HTTP/2 connection may stay open with no request in flight.
    pub idle_timeout: Duration,
    /// HTTP/2 streams a client may have open at once on one connection.
    pub max_streams: u32,
    /// Largest request head in bytes: over HTTP/1.1 a larger one is answered 431; over HTTP/2
    /// it is the `SETTINGS_MAX_HEADER_LIST_SIZE` the server announces. HTTP/1.1 holds the head
    /// in its read buffer of this size (at least 8 KiB).
    pub max_header_bytes: u32,
}

impl Default for TcpOptions {
    fn default() -> Self {
        TcpOptions {
            alt_svc: None,
            max_connections: 4096,
            handshake_timeout: Duration::from_secs(10),
            header_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(60),
            max_streams: 128,
            max_header_bytes: 64 * 1024,
        }
    }
}

/// A response body over TCP.
type TcpBody = UnsyncBoxBody<Bytes, io::Error>;

/// Serves HTTPS over TCP on `listener` until `shutdown` becomes `true` (or its sender is
/// dropped), then drains: see the module documentation.
pub async fn serve(
    listener: tokio::net::TcpListener,
    tls: Arc<rustls::ServerConfig>,
    site: Arc<Site>,
    stats: Arc<ServerStats>,
    shutdown: watch::Receiver<bool>,
    opts: TcpOptions,
) {
    let https = Kind::Https(tokio_rustls::TlsAcceptor::from(tls));
    serve_connections(listener, https, site, stats, shutdown, opts).await;
}

/// Serves plain HTTP on `listener` (`--redirect-http`) until `shutdown`, as [`serve`] serves
/// HTTPS: every request is answered with a 301 to `https://` with the same host and path, on
/// `https_port` (left out when 443). A request without a usable `host` gets 400. Counted as
/// HTTP/1.1 requests, and logged when the site logs.
pub async fn serve_redirects(
    listener: tokio::net::TcpListener,
    https_port: u16,
    site: Arc<Site>,
    stats: Arc<ServerStats>,
    shutdown: watch::Receiver<bool>,
    opts: TcpOptions,
) {
    let redirect = Kind::Redirect { https_port };
    serve_connections(listener, redirect, site, stats, shutdown, opts).await;
}

/// What a listener serves.
#[derive(Clone)]
enum Kind {
    Https(tokio_rustls::TlsAcceptor),
    /// Plain HTTP/1.1, answered with redirects to HTTPS on this port.
    Redirect {
        https_port: u16,
    },
}

impl Kind {
    fn name(&self) -> &'static str {
        match self {
            Kind::Https(_) => "HTTPS over TCP",
            Kind::Redirect { .. } => "plain HTTP (redirects)",
        }
    }
}

async fn serve_connections(
    listener: tokio::net::TcpListener,
    kind: Kind,
    site: Arc<Site>,
    stats: Arc<ServerStats>,
    mut shutdown: watch::Receiver<bool>,
    opts: TcpOptions,
) {
    let what = kind.name();
    let opts = Arc::new(opts);
    let mut connections = JoinSet::new();
    let mut stopping = *shutdown.borrow_and_update();
    while !stopping {
        tokio::select! {
            changed = shutdown.changed() => {
                stopping = changed.is_err() || *shutdown.borrow_and_update();
            }
            accepted = listener.accept() => {
                let (stream, remote) = match accepted {
                    Ok(a) => a,
                    // Another worker took it first (one queue, many acceptors), or a
                    // connection reset before it was accepted: nothing to do.
                    Err(e) => {
                        debug!(error = %e, "TCP accept");
                        continue;
                    }
                };
                stats.tcp_connections.fetch_add(1, Ordering::Relaxed);
                if connections.len() >= opts.max_connections {
                    stats.count_tcp_error(TcpErrorKind::OverCap);
                    drop(stream);
                    continue;
                }
                let conn = Conn {
                    kind: kind.clone(),
                    site: site.clone(),
                    stats: stats.clone(),
                    shutdown: shutdown.clone(),
                    opts: opts.clone(),
                };
                connections.spawn(conn.run(stream, remote));
            }
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
    // This worker takes no more connections; the queue stays with the others and the demux.
    drop(listener);
    info!(
        connections = connections.len(),
        "{what} stopping: no more accepts, draining"
    );
    while connections.join_next().await.is_some() {}
    info!("{what} stopped");
}

/// One TCP connection's task state.
struct Conn {
    kind: Kind,
    site: Arc<Site>,
    stats: Arc<ServerStats>,
    shutdown: watch::Receiver<bool>,
    opts: Arc<TcpOptions>,
}

impl Conn {
    async fn run(self, stream: tokio::net::TcpStream, remote: std::net::SocketAddr) {
        let _ = stream.set_nodelay(true);
        let acceptor = match &self.kind {
            Kind::Https(acceptor) => acceptor.clone(),
            Kind::Redirect { https_port } => {
                let (site, stats, port) = (self.site.clone(), self.stats.clone(), *https_port);
                let service = hyper::service::service_fn(move |req| {
                    redirect(site.clone(), stats.clone(), port, remote, req)
                });
                let conn = self.http1().serve_connection(TokioIo::new(stream), service);
                return self.drive(remote, conn).await;
            }
        };
        let tls = match tokio::time::timeout(self.opts.handshake_timeout, acceptor.accept(stream))
            .await
        {
            Ok(Ok(tls)) => tls,
            Ok(Err(e)) => {
                // Garbage instead of TLS ends here at once.
                self.stats.count_tcp_error(TcpErrorKind::TlsFailed);
                debug!(%remote, error = %e, "TLS handshake failed");
                return;
            }
            Err(_) => {
                self.stats.count_tcp_error(TcpErrorKind::TlsTimeout);
                debug!(%remote, "TLS handshake timed out");
                return;
            }
        };
        let site = self.site.clone();
        let stats = self.stats.clone();
        let alt_svc = self.opts.alt_svc.clone();
        let service = hyper::service::service_fn(move |req| {
            handle(site.clone(), stats.clone(), alt_svc.clone(), remote, req)
        });
        // The protocol is the one ALPN chose (HTTP/1.1 without ALPN), never sniffed from a
        // preface: a client that sends nothing after its handshake meets the header timeout.
        let io = TokioIo::new(tls);
        if io.inner().get_ref().1.alpn_protocol() == Some(b"h2") {
            let conn = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                .timer(TokioTimer::new())
                .max_concurrent_streams(self.opts.max_streams)
                .max_header_list_size(self.opts.max_header_bytes)
                .serve_connection(io, service);
            self.drive(remote, conn).await;
        } else {
            let conn = self.http1().serve_connection(io, service);
            self.drive(remote, conn).await;
        }
    }

    /// hyper's HTTP/1.1 server with this listener's limits.
    fn http1(&self) -> hyper::server::conn::http1::Builder {
        let mut b = hyper::server::conn::http1::Builder::new();
        b.timer(TokioTimer::new())
            .header_read_timeout(self.opts.header_timeout)
            .max_header_size(self.opts.max_header_bytes as usize);
        b
    }

    /// Serves `conn` to its end; once draining starts, tells it to finish (HTTP/2 GOAWAY,
    /// HTTP/1.1 `connection: close` after the request in flight) and waits for that.
    async fn drive<C: Graceful>(mut self, remote: SocketAddr, conn: C) {
        tokio::pin!(conn);
        let mut draining = *self.shutdown.borrow_and_update();
        loop {
            if draining {
                conn.as_mut().graceful_shutdown();
                if let Err(e) = conn.as_mut().await {
                    self.ended(remote, &e);
                }
                return;
            }
            tokio::select! {
                done = conn.as_mut() => {
                    if let Err(e) = done {
                        self.ended(remote, &e);
                    }
                    return;
                }
                changed = self.shutdown.changed() => {
                    draining = changed.is_err() || *self.shutdown.borrow_and_update();
                }
            }
        }
    }
}

/// hyper's HTTP/1.1 and HTTP/2 server connections, as [`Conn::drive`] uses them.
trait Graceful: std::future::Future<Output = Result<(), hyper::Error>> {
    fn graceful_shutdown(self: std::pin::Pin<&mut Self>);
}

impl<I, S, B> Graceful for hyper::server::conn::http1::Connection<I, S>
where
    S: hyper::service::HttpService<Incoming, ResBody = B>,
    S::Error: Into<BoxError>,
    I: hyper::rt::Read + hyper::rt::Write + Unpin,
    B: hyper::body::Body + 'static,
    B::Error: Into<BoxError>,
{
    fn graceful_shutdown(self: std::pin::Pin<&mut Self>) {
        hyper::server::conn::http1::Connection::graceful_shutdown(self)
    }
}

impl<I, S, B, E> Graceful for hyper::server::conn::http2::Connection<I, S, E>
where
    S: hyper::service::HttpService<Incoming, ResBody = B>,
    S::Error: Into<BoxError>,
    I: hyper::rt::Read + hyper::rt::Write + Unpin,
    B: hyper::body::Body + 'static,
    B::Error: Into<BoxError>,
    E: hyper::rt::bounds::Http2ServerConnExec<S::Future, B>,
{
    fn graceful_shutdown(self: std::pin::Pin<&mut Self>) {
        hyper::server::conn::http2::Connection::graceful_shutdown(self)
    }
}

impl Conn {
    /// Counts why the connection to `remote` ended with `e`, if it was bad input.
    fn ended(&self, remote: SocketAddr, e: &hyper::Error) {
        let kind = TcpErrorKind::of(e);
        if let Some(kind) = kind {
            self.stats.count_tcp_error(kind);
        }
        debug!(%remote, error = %e, kind = kind.map(TcpErrorKind::as_str), "TCP connection ended");
    }
}

/// Answers one request over TCP through the paths HTTP/3 takes (`route`, or the proxy's
/// `Upstream::exchange`), plus `alt-svc`.
async fn handle(
    site: Arc<Site>,
    stats: Arc<ServerStats>,
    alt_svc: Option<HeaderValue>,
    remote: SocketAddr,
    req: Request<Incoming>,
) -> Result<Response<TcpBody>, Infallible> {
    stats.requests_total.fetch_add(1, Ordering::Relaxed);
    let protocol = if req.version() == http::Version::HTTP_2 {
        stats.requests_h2.fetch_add(1, Ordering::Relaxed);
        "h2"
    } else {
        stats.requests_h1.fetch_add(1, Ordering::Relaxed);
        "h1"
    };
    let (parts, body) = req.into_parts();
    let logged = Logged::begin(&site, remote, protocol, &parts);
    let req = Request::from_parts(parts, body);
    let mut resp = match &site.upstream {
        Some(upstream) => proxy(upstream, &stats, remote, req).await,
        None => respond(&site, &stats, req).await,
    };
    if let Some(v) = alt_svc {
        resp.headers_mut().insert(header::ALT_SVC, v);
    }
    Ok(match logged {
        None => resp,
        Some(logged) => {
            let status = resp.status();
            resp.map(|inner| {
                LoggedBody {
                    inner,
                    logged: Some(logged),
                    status,
                    bytes: 0,
                }
                .boxed_unsync()
            })
        }
    })
}

/// The redirect of a request on the plain-HTTP listener: 301 to `https://HOST[:PORT]PATH`.
async fn redirect(
    site: Arc<Site>,
    stats: Arc<ServerStats>,
    https_port: u16,
    remote: SocketAddr,
    req: Request<Incoming>,
) -> Result<Response<TcpBody>, Infallible> {
    stats.requests_total.fetch_add(1, Ordering::Relaxed);
    stats.requests_h1.fetch_add(1, Ordering::Relaxed);
    let (parts, _body) = req.into_parts();
    let logged = Logged::begin(&site, remote, "h1", &parts);
    let host = authority_of(&parts).and_then(|h| h.parse::<http::uri::Authority>().ok());
    let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    let location = host.and_then(|host| {
        let port = if https_port == 443 {
            String::new()
        } else {
            format!(":{https_port}")
        };
        HeaderValue::from_str(&format!("https://{}{port}{path}", host.host())).ok()
    });
    let reply = match location {
        Some(location) => {
            let mut r = Reply::text(StatusCode::MOVED_PERMANENTLY, b"moved to https\n");
            r.headers.insert(header::LOCATION, location);
            r
        }
        None => Reply::text(
            StatusCode::BAD_REQUEST,
            b"a host is needed to redirect to https\n",
        ),
    };
    stats.count_response(reply.status);
    let bytes = reply.body.len();
    if let Some(l) = logged {
        l.end(Some(reply.status), bytes);
    }
    let mut resp = Response::new(body_of(reply.body, stats));
    *resp.status_mut() = reply.status;
    *resp.headers_mut() = reply.headers;
    Ok(resp)
}

/// A response body that writes its request's access-log line when hyper is done with it
/// (sent whole, or given up with its connection), with the bytes that went out.
struct LoggedBody {
    inner: TcpBody,
    logged: Option<Logged>,
    status: StatusCode,
    bytes: u64,
}

impl hyper::body::Body for LoggedBody {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        let polled = std::pin::Pin::new(&mut self.inner).poll_frame(cx);
        if let std::task::Poll::Ready(Some(Ok(frame))) = &polled {
            if let Some(data) = frame.data_ref() {
                self.bytes += data.len() as u64;
            }
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for LoggedBody {
    fn drop(&mut self) {
        if let Some(logged) = self.logged.take() {
            logged.end(Some(self.status), self.bytes);
        }
    }
}

/// Passes a request to the upstream: the proxy's one path, fed hyper's request body.
async fn proxy(
    upstream: &Arc<Upstream>,
    stats: &Arc<ServerStats>,
    remote: SocketAddr,
    req: Request<Incoming>,
) -> Response<TcpBody> {
    let (parts, body) = req.into_parts();
    let body = body
        .map_err(|e| BoxError::from(ClientGone(Box::new(e))))
        .boxed_unsync();
    match upstream
        .exchange(Request::from_parts(parts, body), remote, false)
        .await
    {
        Exchange::Response(resp) => {
            stats.count_response(resp.status());
            let stats = stats.clone();
            resp.map(|body| {
                body.map_frame(move |frame| {
                    if let Some(data) = frame.data_ref() {
                        let n = data.len() as u64;
                        stats.bytes_sent.fetch_add(n, Ordering::Relaxed);
                    }
                    frame
                })
                // Counted already; hyper resets the HTTP/2 stream, or closes the HTTP/1.1
                // connection, rather than ending the body short.
                .map_err(io::Error::other)
                .boxed_unsync()
            })
        }
        Exchange::Reply(status, text) => {
            stats.count_response(status);
            let reply = Reply::text(status, text);
            let mut resp = Response::new(body_of(reply.body, stats.clone()));
            *resp.status_mut() = reply.status;
            *resp.headers_mut() = reply.headers;
            resp
        }
        Exchange::ClientGone => {
            stats.requests_failed.fetch_add(1, Ordering::Relaxed);
            // hyper sends nothing for a request whose client is gone; the status is moot.
            let mut resp =
                Response::new(Empty::new().map_err(|never| match never {}).boxed_unsync());
            *resp.status_mut() = StatusCode::BAD_REQUEST;
            resp
        }
    }
}

/// Serves a request from the built-ins or the document root, as HTTP/3 does.
async fn respond(
    site: &Site,
    stats: &Arc<ServerStats>,
    req: Request<Incoming>,
) -> Response<TcpBody> {
    let method = req.method().clone();
    let path = req.uri().path().to_owned();
    let safe = method == Method::GET || method == Method::HEAD;
    let reply = if method == Method::POST && path == "/echo-len" {
        match count_body(req.into_body()).await {
            Ok(n) => Reply::new(StatusCode::OK, "text/plain", Body::Text(format!("{n}\n"))),
            Err(_) => Reply::text(StatusCode::BAD_REQUEST, b"request body broke off\n"),
        }
    } else if !safe {
        let mut r = Reply::text(StatusCode::METHOD_NOT_ALLOWED, b"method not allowed\n");
        r.headers
            .insert(header::ALLOW, HeaderValue::from_static("GET, HEAD, POST"));
        r
    } else {
        route(site, &method, req.headers(), &path).await
    };
    stats.count_response(reply.status);
    let mut resp = Response::new(if method == Method::HEAD {
        Empty::new().map_err(|never| match never {}).boxed_unsync()
    } else {
        body_of(reply.body, stats.clone())
    });
    *resp.status_mut() = reply.status;
    *resp.headers_mut() = reply.headers;
    resp
}

/// Reads a request body to its end, counting its bytes (never holding it).
async fn count_body(mut body: Incoming) -> Result<u64, hyper::Error> {
    let mut n = 0u64;
    while let Some(frame) = body.frame().await {
        if let Some(data) = frame?.data_ref() {
            n += data.len() as u64;
        }
    }
    Ok(n)
}

/// A [`Body`] as a hyper body: in-memory ones whole, generated and file bodies as a stream of
/// [`CHUNK`]s (a file never held whole; one that shrinks under us ends the body with an error,
/// which breaks the connection rather than sending a short body that looks complete).
fn body_of(body: Body, stats: Arc<ServerStats>) -> TcpBody {
    let whole = |b: Bytes| {
        stats
            .bytes_sent
            .fetch_add(b.len() as u64, Ordering::Relaxed);
        Full::new(b).map_err(|never| match never {}).boxed_unsync()
    };
    match body {
        Body::Empty => Empty::new().map_err(|never| match never {}).boxed_unsync(),
        Body::Static(b) => whole(Bytes::from_static(b)),
        Body::Text(s) => whole(Bytes::from(s)),
        Body::Memory(b) => whole(b),
        Body::Pattern(len) => {
            let chunks = futures_util::stream::unfold(0u64, move |sent| {
                let stats = stats.clone();
                async move {
                    if sent >= len {
                        return None;
                    }
                    let n = (len - sent).min(CHUNK as u64) as usize;
                    let mut chunk = BytesMut::zeroed(n);
                    fill_pattern(sent, &mut chunk);
                    stats.bytes_sent.fetch_add(n as u64, Ordering::Relaxed);
                    Some((Ok(Frame::data(chunk.freeze())), sent + n as u64))
                }
            });
            StreamBody::new(chunks).boxed_unsync()
        }
        Body::File {
            root,
            file,
            offset,
            len,
        } => {
            let chunks = futures_util::stream::unfold(0u64, move |sent| {
                let (root, file, stats) = (root.clone(), file.clone(), stats.clone());
                async move {
                    if sent >= len {
                        return None;
                    }
                    let want = (len - sent).min(CHUNK as u64) as usize;
                    match root.read_chunk(&file, offset + sent, want).await {
                        Ok(chunk) if chunk.is_empty() => Some((
                            Err(io::Error::new(
                                io::ErrorKind::UnexpectedEof,
                                format!("file changed size while sending ({sent} of {len} bytes)"),
                            )),
                            len,
                        )),
                        Ok(chunk) => {
                            let n = chunk.len() as u64;
                            stats.bytes_sent.fetch_add(n, Ordering::Relaxed);
                            Some((Ok(Frame::data(chunk)), sent + n))
                        }
                        Err(e) => Some((Err(e), len)),
                    }
                }
            });
            StreamBody::new(chunks).boxed_unsync()
        }
    }
}
