//! The HTTP/3 server of a worker: accepting QUIC connections on a quinn endpoint, serving
//! requests by the worker's sites ([`Router`]), graceful shutdown, and the counters in
//! [`ServerStats`]. The answers both transports share live here too: files from a document
//! root (`files`) and the built-ins (`builtin`).
//!
//! This module owns request handling only. It never creates endpoints or sockets (the caller
//! hands it a ready [`quinn::Endpoint`]) and never applies the shutdown grace period: [`serve`]
//! returns once every connection has finished, and the caller decides how long to wait.
//!
//! Everything spawned here is `Send` and uses `tokio::spawn`, so it runs on the worker's
//! current-thread runtime as well as on a multi-thread one.

use std::borrow::Cow;
use std::fs::File;
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock};
use std::time::{Duration, Instant, SystemTime};

use bytes::{Buf, Bytes, BytesMut};
use futures_util::future::{FutureExt, Shared};
use h3::error::Code;
use h3::server::RequestStream;
use http::{header, HeaderMap, HeaderValue, Method, Request, Response, StatusCode};
use tokio::sync::watch;
use tokio::task::JoinSet;
use tracing::{debug, info, warn};

use crate::access_log::{AccessLog, Entry};
use crate::files::{evaluate, Content, Decision, DocRoot, Lookup, StaticFile};
use crate::proxy::{proxy_h3, Outcome, Upstream};
use crate::sites::{Local, Router, SiteStats, Target};

/// Request stream type of the h3 server over quinn.
type Stream = RequestStream<h3_quinn::BidiStream<Bytes>, Bytes>;

/// Size of the chunks in which bodies are sent (and large files read).
pub(crate) const CHUNK: usize = 64 * 1024;

/// Default cap for `/bytes/N`.
pub const DEFAULT_MAX_BYTES: u64 = 64 * 1024 * 1024;

/// Body of the built-in `/hello.txt`.
pub const HELLO_BODY: &[u8] = b"hello from ringmux\n";

/// One site answering every host, as the command line sets it up without a site table: what
/// [`serve`] and [`crate::tcp::serve`] serve when given one (`Router::from`), for tests and
/// programs embedding the server. The worker program serves a [`Router`] over its site table,
/// whose built-in and upstream routes answer as this describes.
///
/// * `GET`/`HEAD` of a regular file under `root` (if set; [`crate::files`]), with
///   `content-type` from the extension, `ETag`, `Last-Modified`, `Accept-Ranges` and the
///   configured `Cache-Control`; conditional requests (304, 412) and one byte range (206, 416)
///   per RFC 9110. A path ending in `/` serves that directory's `index.html`; a directory
///   named without the slash is redirected (301) to the path with it. Request paths are
///   percent-decoded one segment at a time; a segment that is `..` or decodes to something
///   holding `/`, NUL or a backslash, or to invalid UTF-8, is refused with 400. Symlinks are
///   followed only while they stay beneath `root` (relative targets; absolute ones are refused).
/// * Built-ins, when `root` has no file of that name: `/hello.txt` ([`HELLO_BODY`]) and
///   `/bytes/N`: N bytes of [`fill_pattern`], N ≤ `max_bytes` (400 otherwise).
/// * `POST /echo-len`: reads the whole request body and answers with its length in decimal.
/// * Any other method: 405 (after reading the request body).
#[derive(Debug, Clone)]
pub struct Site {
    pub root: Option<DocRoot>,
    pub max_bytes: u64,
    /// Proxy every request to this upstream instead ([`crate::proxy`]); `root` and the
    /// built-ins are then not used.
    pub upstream: Option<Arc<Upstream>>,
    /// One line per request, over TCP and HTTP/3 (`--access-log`).
    pub access_log: Option<Arc<AccessLog>>,
}

impl Default for Site {
    fn default() -> Self {
        Site {
            root: None,
            max_bytes: DEFAULT_MAX_BYTES,
            upstream: None,
            access_log: None,
        }
    }
}

/// The authority a request names: its URI's (HTTP/2, HTTP/3 `:authority`), else its `host`
/// field (HTTP/1.1).
pub(crate) fn authority_of(parts: &http::request::Parts) -> Option<&str> {
    parts.uri.authority().map(|a| a.as_str()).or_else(|| {
        parts
            .headers
            .get(header::HOST)
            .and_then(|h| h.to_str().ok())
    })
}

/// A request's access-log line, begun when its head arrived ([`Site::access_log`]).
pub(crate) struct Logged {
    log: Arc<AccessLog>,
    /// The site's label, or `-`; `None`: the line names no site ([`Router::log_label`]).
    site: Option<Arc<str>>,
    time: SystemTime,
    start: Instant,
    client: SocketAddr,
    protocol: &'static str,
    method: Method,
    authority: Option<String>,
    path: String,
}

impl Logged {
    /// Begins the line of `parts` from `client` over `protocol`, answered by `site`, if the
    /// worker logs.
    pub(crate) fn begin(
        router: &Router,
        site: Option<usize>,
        client: SocketAddr,
        protocol: &'static str,
        parts: &http::request::Parts,
    ) -> Option<Logged> {
        let log = router.access_log()?.clone();
        let authority = authority_of(parts).map(str::to_owned);
        Some(Logged {
            log,
            site: router.log_label(site),
            time: SystemTime::now(),
            start: Instant::now(),
            client,
            protocol,
            method: parts.method.clone(),
            authority,
            path: parts
                .uri
                .path_and_query()
                .map_or_else(|| parts.uri.path().to_owned(), |p| p.as_str().to_owned()),
        })
    }

    /// Writes the line: `status` (`None`: no response went out) and the body bytes sent.
    pub(crate) fn end(self, status: Option<StatusCode>, bytes: u64) {
        self.log.record(&Entry {
            time: self.time,
            client: self.client,
            protocol: self.protocol,
            method: self.method.as_str(),
            authority: self.authority.as_deref(),
            path: &self.path,
            status: status.map(|s| s.as_u16()),
            bytes,
            duration: self.start.elapsed(),
            site: self.site.as_deref(),
        });
    }
}

/// Byte `offset` of the `/bytes/N` body. A prime period (251) so that a chunk delivered at the
/// wrong offset changes the checksum.
pub fn pattern_byte(offset: u64) -> u8 {
    (offset % 251) as u8
}

/// Fills `buf` with the `/bytes/N` pattern starting at body offset `offset`.
pub fn fill_pattern(offset: u64, buf: &mut [u8]) {
    for (i, b) in buf.iter_mut().enumerate() {
        *b = pattern_byte(offset + i as u64);
    }
}

/// Counters of one worker's HTTP/3 server. All `Relaxed`: independent statistics, nothing is
/// published through them.
#[derive(Debug, Default)]
pub struct ServerStats {
    pub connections_accepted: AtomicU64,
    pub connections_active: AtomicU64,
    /// Connections whose handshake or HTTP/3 setup failed.
    pub connections_failed: AtomicU64,
    /// Retry packets sent (address validation, [`HttpOptions::retry`]).
    pub retries_sent: AtomicU64,
    pub requests_total: AtomicU64,
    /// Requests that ended without a complete response: the client reset the stream or went
    /// away, or reading a file failed (the stream is then reset, not answered with 5xx).
    pub requests_failed: AtomicU64,
    pub responses_2xx: AtomicU64,
    /// 301 (directory without its slash) and 304 (not modified).
    pub responses_3xx: AtomicU64,
    pub responses_4xx: AtomicU64,
    pub responses_5xx: AtomicU64,
    /// Response body bytes handed to QUIC (or TCP).
    pub bytes_sent: AtomicU64,
    /// HTTPS over TCP ([`crate::tcp`]): connections accepted (those closed at once over the
    /// cap included).
    pub tcp_connections: AtomicU64,
    /// TCP connections refused or ended for bad input or overload, by
    /// [`crate::tcp::TcpErrorKind`].
    pub tcp_errors: [AtomicU64; crate::tcp::TcpErrorKind::ALL.len()],
    /// Requests by protocol (each also counted in `requests_total`).
    pub requests_h1: AtomicU64,
    pub requests_h2: AtomicU64,
    pub requests_h3: AtomicU64,
    /// Responses per site and status class ([`SiteStats::snapshot`]); rows made when serving
    /// begins.
    pub sites: SiteStats,
}

/// A plain copy of [`ServerStats`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StatsSnapshot {
    pub connections_accepted: u64,
    pub connections_active: u64,
    pub connections_failed: u64,
    pub retries_sent: u64,
    pub requests_total: u64,
    pub requests_failed: u64,
    pub responses_2xx: u64,
    pub responses_3xx: u64,
    pub responses_4xx: u64,
    pub responses_5xx: u64,
    pub bytes_sent: u64,
}

impl ServerStats {
    pub fn snapshot(&self) -> StatsSnapshot {
        let l = |c: &AtomicU64| c.load(Ordering::Relaxed);
        StatsSnapshot {
            connections_accepted: l(&self.connections_accepted),
            connections_active: l(&self.connections_active),
            connections_failed: l(&self.connections_failed),
            retries_sent: l(&self.retries_sent),
            requests_total: l(&self.requests_total),
            requests_failed: l(&self.requests_failed),
            responses_2xx: l(&self.responses_2xx),
            responses_3xx: l(&self.responses_3xx),
            responses_4xx: l(&self.responses_4xx),
            responses_5xx: l(&self.responses_5xx),
            bytes_sent: l(&self.bytes_sent),
        }
    }

    /// Puts this server's counters in a `STATS` report: requests and connections in the keys
    /// every worker has, the rest as this server's own series (`control-protocol.md`, "STATS
    /// series"): `requests{protocol}` (`h1`, `h2`, `h3`), `tcp_connections` and
    /// `tcp_errors{kind}` (by [`crate::tcp::TcpErrorKind`]), every one each time, 0 or not.
    /// The rows by site are the caller's (their indices are the site table's).
    pub fn report(&self, r: &mut ringmux_proto::WorkerReport) {
        let l = |c: &AtomicU64| c.load(Ordering::Relaxed);
        r.connections_total = l(&self.connections_accepted);
        r.requests_total = l(&self.requests_total);
        let by_protocol = [
            ("h1", &self.requests_h1),
            ("h2", &self.requests_h2),
            ("h3", &self.requests_h3),
        ];
        let mut series = Vec::new();
        for (protocol, c) in by_protocol {
            series.push(r.set_counter("requests", &[("protocol", protocol)], l(c)));
        }
        series.push(r.set_counter("tcp_connections", &[], l(&self.tcp_connections)));
        for kind in crate::tcp::TcpErrorKind::ALL {
            let v = l(&self.tcp_errors[kind as usize]);
            series.push(r.set_counter("tcp_errors", &[("kind", kind.as_str())], v));
        }
        // Fixed names, held to the rules by the tests: a refusal is a bug here.
        debug_assert!(series.iter().all(Result::is_ok), "{series:?}");
    }

    pub(crate) fn count_tcp_error(&self, kind: crate::tcp::TcpErrorKind) {
        self.tcp_errors[kind as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a response of site `site` (`None`: of no site), by class, for the site too.
    pub(crate) fn count_response(&self, site: Option<usize>, status: StatusCode) {
        self.sites.count(site, status);
        let c = match status.as_u16() {
            200..=299 => &self.responses_2xx,
            300..=399 => &self.responses_3xx,
            400..=499 => &self.responses_4xx,
            500..=599 => &self.responses_5xx,
            _ => return,
        };
        c.fetch_add(1, Ordering::Relaxed);
    }
}

/// How [`serve_with`] takes connections and requests: this server's own choices, beside the
/// QUIC options every worker's endpoint has (`ringmux_worker::quic::ServerOptions`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpOptions {
    /// Answer every Initial without an address-validation token with a Retry (RFC 9000 §8.1.2).
    /// Costs one round trip per new client; protects against amplification and spoofed floods.
    /// Under ringmux the demux sends the Retries (`--retry`), so the built-in worker leaves it
    /// off.
    pub retry: bool,
    /// Serve GET and HEAD requests that arrive in 0-RTT before the handshake completes (the
    /// point of 0-RTT). Other methods always wait for the handshake, so a replayed 0-RTT flight
    /// can never run them (RFC 8470 §3, RFC 9114 §4.1 on idempotent methods).
    pub early_requests: bool,
}

impl Default for HttpOptions {
    fn default() -> Self {
        HttpOptions {
            retry: false,
            early_requests: true,
        }
    }
}

/// [`serve_with`] with default [`HttpOptions`] (no Retry, early GET/HEAD served).
pub async fn serve(
    endpoint: quinn::Endpoint,
    sites: impl Into<Router>,
    stats: Arc<ServerStats>,
    shutdown: watch::Receiver<bool>,
) {
    serve_with(endpoint, sites, stats, shutdown, &HttpOptions::default()).await
}

/// Serves HTTP/3 on `endpoint` until `shutdown` becomes `true` (or its sender is dropped).
///
/// On shutdown: new connection attempts are refused (CONNECTION_REFUSED, RFC 9000 §20.1), every
/// connection gets an HTTP/3 GOAWAY (RFC 9114 §5.2), requests already accepted run to
/// completion, then each connection closes with H3_NO_ERROR. Returns when all connection tasks
/// have ended; the caller bounds that with its grace timeout and then drops or closes the
/// endpoint.
///
/// Each connection serves the site its TLS server name chooses ([`Router::connection_site`]);
/// a request for a host of another site is answered 421.
///
/// The QUIC options (idle timeout, streams) are the endpoint's, from
/// [`ringmux_worker::quic::server_config`].
pub async fn serve_with(
    endpoint: quinn::Endpoint,
    sites: impl Into<Router>,
    stats: Arc<ServerStats>,
    mut shutdown: watch::Receiver<bool>,
    opts: &HttpOptions,
) {
    let router: Router = sites.into();
    stats.sites.init(&router);
    let mut connections = JoinSet::new();
    let mut stopping = *shutdown.borrow_and_update();
    while !stopping {
        tokio::select! {
            changed = shutdown.changed() => {
                // A dropped sender can never signal again: treat it as a shutdown.
                stopping = changed.is_err() || *shutdown.borrow_and_update();
            }
            incoming = endpoint.accept() => {
                let Some(incoming) = incoming else { break }; // endpoint closed
                if opts.retry && !incoming.remote_address_validated() && incoming.may_retry() {
                    // Stateless: the client comes back with a token naming its address.
                    match incoming.retry() {
                        Ok(()) => {
                            stats.retries_sent.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(e) => debug!(error = %e, "retry failed"),
                    }
                    continue;
                }
                stats.connections_accepted.fetch_add(1, Ordering::Relaxed);
                let conn = Conn {
                    router: router.clone(),
                    stats: stats.clone(),
                    shutdown: shutdown.clone(),
                    early_requests: opts.early_requests,
                };
                connections.spawn(conn.run(incoming));
            }
            // Reap finished tasks so the set does not grow with the connection count.
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
    info!(
        connections = connections.len(),
        "HTTP/3 server stopping: refusing new connections, draining"
    );
    // Stop quinn from handing out new connections; Initials from now on are refused.
    endpoint.set_server_config(None);
    loop {
        tokio::select! {
            incoming = endpoint.accept() => match incoming {
                // Already queued before set_server_config(None): refuse explicitly.
                Some(incoming) => incoming.refuse(),
                None => break,
            },
            next = connections.join_next() => if next.is_none() { break },
        }
    }
    while connections.join_next().await.is_some() {}
    info!("HTTP/3 server stopped");
}

/// One connection's task state.
struct Conn {
    router: Router,
    stats: Arc<ServerStats>,
    shutdown: watch::Receiver<bool>,
    early_requests: bool,
}

/// Decrements `connections_active` however the connection task ends.
struct ActiveGuard(Arc<ServerStats>);

impl Drop for ActiveGuard {
    fn drop(&mut self) {
        self.0.connections_active.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Conn {
    async fn run(mut self, incoming: quinn::Incoming) {
        let remote = incoming.remote_address();
        self.stats
            .connections_active
            .fetch_add(1, Ordering::Relaxed);
        let _active = ActiveGuard(self.stats.clone());
        let (conn, handshake) = match self.handshake(incoming).await {
            Ok(c) => c,
            Err(e) => {
                self.stats
                    .connections_failed
                    .fetch_add(1, Ordering::Relaxed);
                debug!(%remote, error = %e, "connection failed before HTTP/3");
                return;
            }
        };
        let mut h3c: h3::server::Connection<h3_quinn::Connection, Bytes> =
            match h3::server::builder()
                .build(h3_quinn::Connection::new(conn.clone()))
                .await
            {
                Ok(c) => c,
                Err(e) => {
                    self.stats
                        .connections_failed
                        .fetch_add(1, Ordering::Relaxed);
                    debug!(%remote, error = %e, "HTTP/3 setup failed");
                    return;
                }
            };
        let sni = conn
            .handshake_data()
            .and_then(|d| d.downcast::<quinn::crypto::rustls::HandshakeData>().ok())
            .and_then(|d| d.server_name);
        let site = self.router.connection_site(sni.as_deref());
        debug!(%remote, ?sni, ?site, "HTTP/3 connection up");

        let mut requests = JoinSet::new();
        let mut draining = false;
        loop {
            if !draining && *self.shutdown.borrow_and_update() {
                draining = true;
                // GOAWAY with the last accepted request id: those still run, later ones are
                // rejected with H3_REQUEST_REJECTED so the client can retry them elsewhere.
                if let Err(e) = h3c.shutdown(0).await {
                    debug!(%remote, error = %e, "sending GOAWAY failed");
                    break;
                }
            }
            if draining && requests.is_empty() {
                break;
            }
            tokio::select! {
                changed = self.shutdown.changed(), if !draining => {
                    if changed.is_err() {
                        // Sender gone: same as a shutdown, handled at the loop top.
                        self.shutdown.mark_changed();
                    }
                }
                Some(_) = requests.join_next(), if !requests.is_empty() => {}
                accepted = h3c.accept() => match accepted {
                    Ok(Some(resolver)) => {
                        self.stats.requests_total.fetch_add(1, Ordering::Relaxed);
                        self.stats.requests_h3.fetch_add(1, Ordering::Relaxed);
                        let req = Req {
                            conn: conn.clone(),
                            router: self.router.clone(),
                            site,
                            stats: self.stats.clone(),
                            handshake: handshake.clone(),
                            early_requests: self.early_requests,
                        };
                        let stats = self.stats.clone();
                        requests.spawn(async move {
                            match resolver.resolve_request().await {
                                Ok((request, stream)) => req.handle(request, stream).await,
                                Err(e) => {
                                    stats.requests_failed.fetch_add(1, Ordering::Relaxed);
                                    debug!(error = %e, "bad request headers");
                                }
                            }
                        });
                    }
                    // The client sent GOAWAY and everything it asked for is done.
                    Ok(None) => break,
                    Err(e) => {
                        if !e.is_h3_no_error() {
                            debug!(%remote, error = %e, "HTTP/3 connection error");
                        }
                        break;
                    }
                },
            }
        }
        // Requests already accepted finish even if the connection loop ended for another reason
        // (they fail fast if the connection itself is gone).
        while requests.join_next().await.is_some() {}
        // A finished request has only *queued* its response; closing now would discard what
        // the client has not acknowledged yet.
        wait_delivered(&conn).await;
        // Dropping the h3 connection closes the QUIC connection with H3_NO_ERROR.
        drop(h3c);
        conn.closed().await;
        debug!(%remote, "connection closed");
    }

    /// Completes (or, with early requests on, starts) the handshake. The returned future
    /// resolves when the handshake has completed.
    async fn handshake(
        &self,
        incoming: quinn::Incoming,
    ) -> Result<(quinn::Connection, HandshakeDone), quinn::ConnectionError> {
        let mut connecting = incoming.accept()?;
        if self.early_requests {
            // The whole ClientHello first: until it is read the client's transport parameters
            // are not, and a ClientHello in two Initials (Chromium's, with its post-quantum key
            // share, is about 1 950 bytes) would hand us the connection after the first with a
            // peer stream limit of 0. h3 then waits to open its control stream, and quinn does
            // not wake that wait when the limits arrive: the connection never gets its
            // SETTINGS (found with headless Chromium, `demux/tests/browser.rs`).
            connecting.handshake_data().await?;
            // Server side `into_0rtt` always succeeds: streams opened in 0-RTT are handed to us
            // now and our responses go out as 0.5-RTT data.
            match connecting.into_0rtt() {
                Ok((conn, done)) => return Ok((conn, handshake_done(done.map(|_| ())))),
                Err(connecting) => {
                    let conn = connecting.await?;
                    return Ok((conn, handshake_done(std::future::ready(()))));
                }
            }
        }
        let conn = connecting.await?;
        Ok((conn, handshake_done(std::future::ready(()))))
    }
}

/// Waits until the connection is closed by the peer or has stopped sending: the best available
/// sign that every queued response byte has been acknowledged.
///
/// Why a heuristic: quinn only reports acknowledgement per stream (`SendStream::stopped`), and
/// h3-quinn keeps the quinn `SendStream` private. quinn keeps (re)transmitting until all stream
/// data is acknowledged, with a probe timeout of about 1.5–3 RTT (RFC 9002 §6.2), so a server
/// that sent no datagram for 3 RTT (at least 50 ms) has nothing left in flight. A client that
/// stops reading also makes us quiet; it loses the rest of its response, as it would at the
/// caller's grace timeout anyway.
async fn wait_delivered(conn: &quinn::Connection) {
    loop {
        let sent = conn.stats().udp_tx.datagrams;
        let quiet = (conn.rtt() * 3).max(Duration::from_millis(50));
        tokio::select! {
            _ = conn.closed() => return,
            _ = tokio::time::sleep(quiet) => {}
        }
        if conn.stats().udp_tx.datagrams == sent {
            return;
        }
    }
}

/// Resolves when the handshake has completed; shared by all requests of a connection.
type HandshakeDone = Shared<futures_util::future::BoxFuture<'static, ()>>;

fn handshake_done(f: impl std::future::Future<Output = ()> + Send + 'static) -> HandshakeDone {
    f.boxed().shared()
}

/// One request's task state.
struct Req {
    conn: quinn::Connection,
    router: Router,
    /// The connection's site.
    site: Option<usize>,
    stats: Arc<ServerStats>,
    handshake: HandshakeDone,
    early_requests: bool,
}

/// Why a request could not be answered normally.
#[derive(Debug, thiserror::Error)]
enum RequestError {
    // The inner errors are in the messages, so not the error's `source`.
    #[error("stream: {0}")]
    Stream(h3::error::StreamError),
    #[error("reading file: {0}")]
    Io(io::Error),
    #[error("file changed size while sending ({sent} of {len} bytes)")]
    Truncated { sent: u64, len: u64 },
}

impl From<h3::error::StreamError> for RequestError {
    fn from(e: h3::error::StreamError) -> Self {
        RequestError::Stream(e)
    }
}

impl From<io::Error> for RequestError {
    fn from(e: io::Error) -> Self {
        RequestError::Io(e)
    }
}

/// A response body.
pub(crate) enum Body {
    Empty,
    Static(&'static [u8]),
    Text(String),
    Pattern(u64),
    /// A file (or part of one) already in memory.
    Memory(Bytes),
    /// `len` bytes of an open file from `offset`, streamed in [`CHUNK`]s.
    File {
        root: DocRoot,
        file: Arc<File>,
        offset: u64,
        len: u64,
    },
}

impl Body {
    pub(crate) fn len(&self) -> u64 {
        match self {
            Body::Empty => 0,
            Body::Static(b) => b.len() as u64,
            Body::Text(s) => s.len() as u64,
            Body::Memory(b) => b.len() as u64,
            Body::Pattern(n) | Body::File { len: n, .. } => *n,
        }
    }
}

/// What to send back: status, header fields, body.
pub(crate) struct Reply {
    pub(crate) status: StatusCode,
    pub(crate) headers: HeaderMap,
    pub(crate) body: Body,
}

impl Reply {
    /// A reply with `content-type` and a `content-length` that matches `body`.
    pub(crate) fn new(status: StatusCode, content_type: &'static str, body: Body) -> Reply {
        Reply::with_headers(status, HeaderMap::new(), content_type, body)
    }

    fn with_headers(
        status: StatusCode,
        mut headers: HeaderMap,
        content_type: &'static str,
        body: Body,
    ) -> Reply {
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
        headers.insert(header::CONTENT_LENGTH, HeaderValue::from(body.len()));
        Reply {
            status,
            headers,
            body,
        }
    }

    pub(crate) fn text(status: StatusCode, msg: &'static [u8]) -> Reply {
        Reply::new(status, "text/plain", Body::Static(msg))
    }
}

impl Req {
    async fn handle(self, request: Request<()>, mut stream: Stream) {
        let (mut parts, ()) = request.into_parts();
        let choice = self.router.choose(self.site, &parts, false);
        let site = choice.answering(self.site);
        let remote = self.conn.remote_address();
        let logged = Logged::begin(&self.router, site, remote, "h3", &parts);
        let local = match self.router.target(choice, &parts.method, &parts.uri) {
            Target::Proxy { upstream, path } => {
                let upstream = upstream.clone();
                if let Some(path) = path {
                    parts.uri = with_path(&parts.uri, path);
                }
                let request = Request::from_parts(parts, ());
                let (status, bytes) = match self.proxy(site, &upstream, request, stream).await {
                    Outcome::Answered { status, bytes } => (Some(status), bytes),
                    Outcome::Failed => (None, 0),
                };
                if let Some(l) = logged {
                    l.end(status, bytes);
                }
                return;
            }
            Target::Local(local) => local,
        };
        let result = self
            .respond(&parts.method, &parts.headers, local, &mut stream)
            .await;
        let (method, path) = (&parts.method, parts.uri.path());
        let (status, bytes) = match result {
            Ok((status, bytes)) => {
                self.stats.count_response(site, status);
                debug!(%method, %path, status = status.as_u16(), "request done");
                (Some(status), bytes)
            }
            Err(RequestError::Stream(e)) if e.is_h3_no_error() => {
                self.stats.requests_failed.fetch_add(1, Ordering::Relaxed);
                (None, 0)
            }
            Err(e) => {
                // The response is already (partly) out: reset the stream so the client sees an
                // error rather than a short body that looks complete.
                stream.stop_stream(Code::H3_INTERNAL_ERROR);
                self.stats.requests_failed.fetch_add(1, Ordering::Relaxed);
                debug!(%method, %path, error = %e, "request failed");
                (None, 0)
            }
        };
        if let Some(l) = logged {
            l.end(status, bytes);
        }
    }

    /// Passes the request to the upstream. Like [`Req::respond`], a request that may be replayed
    /// 0-RTT data waits for the handshake unless it is a GET or HEAD with early requests on;
    /// one forwarded before the handshake completed says so with `early-data: 1`.
    async fn proxy(
        &self,
        site: Option<usize>,
        upstream: &Arc<Upstream>,
        request: Request<()>,
        stream: Stream,
    ) -> Outcome {
        let method = request.method().clone();
        let path = request.uri().path().to_string();
        let safe = method == Method::GET || method == Method::HEAD;
        let mut early = self.handshake.clone().now_or_never().is_none();
        if early && !(safe && self.early_requests) {
            self.handshake.clone().await;
            early = false;
        }
        let remote = self.conn.remote_address();
        match proxy_h3(
            upstream,
            request,
            stream,
            remote,
            early,
            &self.stats.bytes_sent,
        )
        .await
        {
            outcome @ Outcome::Answered { status, .. } => {
                self.stats.count_response(site, status);
                debug!(%method, %path, status = status.as_u16(), "proxied");
                outcome
            }
            Outcome::Failed => {
                self.stats.requests_failed.fetch_add(1, Ordering::Relaxed);
                Outcome::Failed
            }
        }
    }

    async fn respond(
        &self,
        method: &Method,
        headers: &HeaderMap,
        local: Local<'_>,
        stream: &mut Stream,
    ) -> Result<(StatusCode, u64), RequestError> {
        let safe = method == Method::GET || method == Method::HEAD;
        if !(safe && self.early_requests) {
            // Possibly 0-RTT (replayable) data: act on it only once the handshake has proven
            // the client is live (RFC 8470 §3 "wait for the handshake").
            self.handshake.clone().await;
        }

        let mut reply = match local {
            Local::EchoLen => {
                let n = drain(stream).await?;
                Reply::new(StatusCode::OK, "text/plain", Body::Text(format!("{n}\n")))
            }
            Local::Get(lookup) => lookup.reply(method, headers).await,
            Local::Reply(reply) => {
                if !safe {
                    drain(stream).await?;
                }
                reply
            }
        };

        let status = reply.status;
        let mut resp = Response::new(());
        *resp.status_mut() = status;
        *resp.headers_mut() = std::mem::take(&mut reply.headers);
        stream.send_response(resp).await?;
        let mut bytes = 0;
        if method != Method::HEAD {
            bytes = reply.body.len();
            self.send_body(stream, reply.body).await?;
        }
        stream.finish().await?;
        // Read the request side to its end so quinn does not answer the client's FIN with
        // STOP_SENDING(0), which a client that finishes late sees as "Remote reset: 0".
        drain(stream).await?;
        Ok((status, bytes))
    }

    async fn send_body(&self, stream: &mut Stream, body: Body) -> Result<(), RequestError> {
        match body {
            Body::Empty => {}
            Body::Static(b) => self.send(stream, Bytes::from_static(b)).await?,
            Body::Text(s) => self.send(stream, Bytes::from(s)).await?,
            Body::Memory(b) => {
                if !b.is_empty() {
                    self.send(stream, b).await?;
                }
            }
            Body::Pattern(len) => {
                let mut sent = 0u64;
                while sent < len {
                    let n = (len - sent).min(CHUNK as u64) as usize;
                    let mut chunk = BytesMut::zeroed(n);
                    fill_pattern(sent, &mut chunk);
                    self.send(stream, chunk.freeze()).await?;
                    sent += n as u64;
                }
            }
            Body::File {
                root,
                file,
                offset,
                len,
            } => {
                let mut sent = 0u64;
                while sent < len {
                    let want = (len - sent).min(CHUNK as u64) as usize;
                    let chunk = root.read_chunk(&file, offset + sent, want).await?;
                    if chunk.is_empty() {
                        // The file shrank under us: reset rather than end short.
                        return Err(RequestError::Truncated { sent, len });
                    }
                    sent += chunk.len() as u64;
                    self.send(stream, chunk).await?;
                }
            }
        }
        Ok(())
    }

    async fn send(&self, stream: &mut Stream, data: Bytes) -> Result<(), RequestError> {
        let n = data.len() as u64;
        stream.send_data(data).await?;
        self.stats.bytes_sent.fetch_add(n, Ordering::Relaxed);
        Ok(())
    }
}

/// `uri` with its path and query replaced by `path`.
pub(crate) fn with_path(uri: &http::Uri, path: http::uri::PathAndQuery) -> http::Uri {
    let mut parts = uri.clone().into_parts();
    parts.path_and_query = Some(path);
    // Only the path changed, to another that parsed: the parts make a URI again.
    http::Uri::from_parts(parts).unwrap_or_else(|_| uri.clone())
}

/// The reply to a GET or HEAD of a built-in route (the command line's), whatever the
/// transport: a file from `root`, else a built-in (`/hello.txt`, `/bytes/N`), 400 for a bad
/// path, or 404. `rest` is the request path `path` beneath the route's prefix.
pub(crate) async fn builtin(
    root: Option<&DocRoot>,
    max_bytes: u64,
    method: &Method,
    headers: &HeaderMap,
    path: &str,
    rest: &str,
) -> Reply {
    let Some(rel) = clean_rest(rest) else {
        return Reply::text(StatusCode::BAD_REQUEST, b"bad path\n");
    };
    if let Some(root) = root {
        if let Some(reply) = file_reply(root, method, headers, path, rest, rel).await {
            return reply;
        }
    }
    if rest == "/hello.txt" {
        // Its content-length made once: `HeaderValue::from(usize)` allocates each time.
        static LENGTH: LazyLock<HeaderValue> =
            LazyLock::new(|| HeaderValue::from(HELLO_BODY.len()));
        let mut headers = HeaderMap::with_capacity(2);
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
        headers.insert(header::CONTENT_LENGTH, LENGTH.clone());
        return Reply {
            status: StatusCode::OK,
            headers,
            body: Body::Static(HELLO_BODY),
        };
    }
    if let Some(n) = rest.strip_prefix("/bytes/") {
        return match n.parse::<u64>() {
            Ok(n) if n <= max_bytes => {
                Reply::new(StatusCode::OK, "application/octet-stream", Body::Pattern(n))
            }
            _ => Reply::text(StatusCode::BAD_REQUEST, b"bad length\n"),
        };
    }
    Reply::text(StatusCode::NOT_FOUND, b"not found\n")
}

/// The reply to a GET or HEAD of a file route: the file `rest` (the request path `path`
/// beneath the route's prefix) from `root`, 400 for a bad path, or 404.
pub(crate) async fn files(
    root: &DocRoot,
    method: &Method,
    headers: &HeaderMap,
    path: &str,
    rest: &str,
) -> Reply {
    let Some(rel) = clean_rest(rest) else {
        return Reply::text(StatusCode::BAD_REQUEST, b"bad path\n");
    };
    match file_reply(root, method, headers, path, rest, rel).await {
        Some(reply) => reply,
        None => Reply::text(StatusCode::NOT_FOUND, b"not found\n"),
    }
}

/// [`clean_path`] of the path beneath a route's prefix; `""` (the prefix itself) names the
/// route's directory.
fn clean_rest(rest: &str) -> Option<Cow<'_, str>> {
    if rest.is_empty() {
        return Some(Cow::Borrowed(""));
    }
    clean_path(rest)
}

/// The reply for `rest` (cleaned to `rel`) from `root`, or `None` to fall through to the
/// built-ins (nothing there, or a directory without `index.html`). A directory named without
/// its final slash is redirected to the request path `path` with one.
async fn file_reply(
    root: &DocRoot,
    method: &Method,
    headers: &HeaderMap,
    path: &str,
    rest: &str,
    rel: Cow<'_, str>,
) -> Option<Reply> {
    let dir_request = rest.ends_with('/');
    let rel = if !dir_request {
        rel
    } else if rel.is_empty() {
        Cow::Borrowed("index.html")
    } else {
        Cow::Owned(format!("{rel}/index.html"))
    };
    match root.lookup(&rel).await {
        Ok(Lookup::File(file)) => Some(serve_file(root, method, headers, file)),
        Ok(Lookup::Directory) if !dir_request => {
            // Like nginx and Caddy: relative links in the index page need the trailing slash.
            let Ok(location) = HeaderValue::from_str(&format!("{path}/")) else {
                return Some(Reply::text(StatusCode::BAD_REQUEST, b"bad path\n"));
            };
            let mut r = Reply::text(StatusCode::MOVED_PERMANENTLY, b"moved\n");
            r.headers.insert(header::LOCATION, location);
            Some(r)
        }
        Ok(Lookup::Directory | Lookup::NotFound) => None,
        Ok(Lookup::Forbidden) => Some(Reply::text(StatusCode::FORBIDDEN, b"forbidden\n")),
        Err(e) => {
            warn!(path, error = %e, "cannot read file");
            Some(Reply::text(
                StatusCode::INTERNAL_SERVER_ERROR,
                b"cannot read file\n",
            ))
        }
    }
}

/// 200, 206, 304, 412 or 416 for a file, per [`evaluate`].
fn serve_file(root: &DocRoot, method: &Method, headers: &HeaderMap, file: StaticFile) -> Reply {
    let meta = &file.meta;
    // Everything but a whole file gets the validators and Cache-Control only.
    let validators = || {
        let mut h = HeaderMap::with_capacity(6);
        for name in [header::ETAG, header::LAST_MODIFIED, header::CACHE_CONTROL] {
            if let Some(v) = meta.headers.get(&name) {
                h.insert(name, v.clone());
            }
        }
        h
    };
    let (start, len, mut h) = match evaluate(method, headers, meta) {
        Decision::Full => {
            // The common case: the 200's fields were built once, with the file's metadata.
            let body = body_of(root, file.content, 0, meta.len);
            return Reply {
                status: StatusCode::OK,
                headers: meta.headers.clone(),
                body,
            };
        }
        Decision::NotModified => {
            // RFC 9110 §15.4.5: no content, and no Content-Length unless it is the 200's.
            return Reply {
                status: StatusCode::NOT_MODIFIED,
                headers: validators(),
                body: Body::Empty,
            };
        }
        Decision::PreconditionFailed => {
            return Reply::with_headers(
                StatusCode::PRECONDITION_FAILED,
                validators(),
                "text/plain",
                Body::Static(b"precondition failed\n"),
            );
        }
        Decision::RangeNotSatisfiable => {
            let mut h = validators();
            h.insert(
                header::CONTENT_RANGE,
                HeaderValue::from_str(&format!("bytes */{}", meta.len))
                    .unwrap_or(HeaderValue::from_static("bytes */0")),
            );
            return Reply::with_headers(
                StatusCode::RANGE_NOT_SATISFIABLE,
                h,
                "text/plain",
                Body::Static(b"range not satisfiable\n"),
            );
        }
        Decision::Partial { start, len } => (start, len, validators()),
    };
    // §14.4: first-last/complete-length, last inclusive.
    let range = format!("bytes {start}-{}/{}", start + len - 1, meta.len);
    if let Ok(v) = HeaderValue::from_str(&range) {
        h.insert(header::CONTENT_RANGE, v);
    }
    let body = body_of(root, file.content, start, len);
    Reply::with_headers(StatusCode::PARTIAL_CONTENT, h, meta.content_type, body)
}

/// `len` bytes of a file's content from `start` (within the file: [`evaluate`] clamps ranges).
fn body_of(root: &DocRoot, content: Content, start: u64, len: u64) -> Body {
    match content {
        Content::Memory(b) => {
            let (s, e) = (start as usize, (start + len) as usize);
            Body::Memory(if e <= b.len() { b.slice(s..e) } else { b })
        }
        Content::Disk(file) => Body::File {
            root: root.clone(),
            file,
            offset: start,
            len,
        },
    }
}

/// Reads the request body to its end, returning its length.
async fn drain(stream: &mut Stream) -> Result<u64, RequestError> {
    let mut n = 0u64;
    while let Some(mut chunk) = stream.recv_data().await? {
        n += chunk.remaining() as u64;
        chunk.advance(chunk.remaining());
    }
    Ok(n)
}

/// The request path as a relative path of plain components joined by `/` (`""` for the
/// root), or `None` if it could name anything outside the root or something other than the
/// client meant. Each segment is percent-decoded (RFC 3986 §2.1); `.` and empty segments are
/// dropped; `..`, and segments that decode to something holding `/`, NUL or a backslash, or to
/// invalid UTF-8, refuse the whole path.
fn clean_path(path: &str) -> Option<Cow<'_, str>> {
    let rest = path.strip_prefix('/')?;
    // The common case, a path that is already plain (no escapes, no empty, `.` or `..`
    // segment), is returned as it stands, without a copy.
    let trimmed = rest.strip_suffix('/').unwrap_or(rest);
    if !trimmed.contains(['%', '\0', '\\'])
        && (trimmed.is_empty()
            || trimmed
                .split('/')
                .all(|s| !s.is_empty() && s != "." && s != ".."))
    {
        return Some(Cow::Borrowed(trimmed));
    }
    decoded_path(path).map(Cow::Owned)
}

/// [`clean_path`] the long way: every segment decoded and checked, the result built anew.
fn decoded_path(path: &str) -> Option<String> {
    if !path.starts_with('/') {
        return None;
    }
    let mut rel = String::with_capacity(path.len());
    for raw in path.split('/') {
        let seg = percent_decode(raw)?;
        match &*seg {
            "" | "." => continue,
            ".." => return None,
            s if s.contains(['/', '\0', '\\']) => return None,
            _ => {}
        }
        if !rel.is_empty() {
            rel.push('/');
        }
        rel.push_str(&seg);
    }
    Some(rel)
}

/// `%XX` escapes decoded; `None` for a bad escape or a result that is not UTF-8.
fn percent_decode(s: &str) -> Option<Cow<'_, str>> {
    if !s.contains('%') {
        return Some(Cow::Borrowed(s));
    }
    let mut out = Vec::with_capacity(s.len());
    let mut bytes = s.bytes();
    while let Some(b) = bytes.next() {
        if b != b'%' {
            out.push(b);
            continue;
        }
        let hi = (bytes.next()? as char).to_digit(16)?;
        let lo = (bytes.next()? as char).to_digit(16)?;
        out.push((hi * 16 + lo) as u8);
    }
    String::from_utf8(out).ok().map(Cow::Owned)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clean_paths_taken_as_they_stand_are_what_decoding_would_give() {
        // Every path of up to four segments drawn from these, with and without a trailing
        // slash: the borrowed shortcut must agree with the long way on each.
        let parts = [
            "", ".", "..", "a", "b.txt", "%41", "%2e", "a%2Fb", "x\\y", "%",
        ];
        let mut paths = vec![String::new()];
        for _ in 0..4 {
            let longer: Vec<String> = paths
                .iter()
                .flat_map(|p| parts.iter().map(move |s| format!("{p}/{s}")))
                .collect();
            paths.extend(longer);
        }
        let mut borrowed = 0;
        for p in paths.iter().flat_map(|p| [p.clone(), format!("{p}/")]) {
            let fast = clean_path(&p);
            borrowed += usize::from(matches!(fast, Some(Cow::Borrowed(_))));
            assert_eq!(fast.as_deref(), decoded_path(&p).as_deref(), "{p:?}");
        }
        assert!(borrowed > 100, "the shortcut was taken {borrowed} times");
    }

    #[test]
    fn clean_path_refuses_escapes() {
        assert_eq!(clean_path("/a/b.txt").as_deref(), Some("a/b.txt"));
        assert_eq!(clean_path("/a//./b").as_deref(), Some("a/b"));
        assert_eq!(clean_path("/").as_deref(), Some(""));
        assert_eq!(clean_path("/sub/").as_deref(), Some("sub"));
        assert_eq!(clean_path("/my%20file.txt").as_deref(), Some("my file.txt"));
        assert_eq!(clean_path("/%2e/x").as_deref(), Some("x"));
        assert_eq!(clean_path("/caf%C3%A9").as_deref(), Some("café"));
        for bad in [
            "/../etc/passwd",
            "/a/../../b",
            "/%2e%2e/x",
            "/%2E%2E%2Fetc%2Fpasswd",
            "/..%2fetc/passwd",
            "/a%2fb",
            "/a%00",
            "/a%5c..",
            "/a%zz",
            "/a%2",
            "/%ff",
            "relative",
            "/a\\..\\b",
            "/a\0",
        ] {
            assert_eq!(clean_path(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn pattern_is_position_dependent() {
        let mut a = [0u8; 300];
        fill_pattern(0, &mut a);
        let mut b = [0u8; 50];
        fill_pattern(250, &mut b);
        assert_eq!(&a[250..300], &b[..]);
        assert_eq!(a[251], 0);
    }
}
