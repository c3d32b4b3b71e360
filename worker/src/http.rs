//! The HTTP/3 server of a worker: accepting QUIC connections on a quinn endpoint, serving
//! requests from a [`Site`], graceful shutdown, and the counters in [`ServerStats`].
//!
//! This module owns request handling only. It never creates endpoints or sockets (the caller
//! hands it a ready [`quinn::Endpoint`]) and never applies the shutdown grace period: [`serve`]
//! returns once every connection has finished, and the caller decides how long to wait.
//!
//! Everything spawned here is `Send` and uses `tokio::spawn`, so it runs on the worker's
//! current-thread runtime as well as on a multi-thread one.

use std::io;
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use futures_util::future::{FutureExt, Shared};
use h3::error::Code;
use h3::server::RequestStream;
use http::{header, HeaderValue, Method, Request, Response, StatusCode};
use tokio::io::AsyncReadExt;
use tokio::sync::watch;
use tokio::task::JoinSet;
use tracing::{debug, info, warn};

use crate::quic::ServerOptions;

/// Request stream type of the h3 server over quinn.
type Stream = RequestStream<h3_quinn::BidiStream<Bytes>, Bytes>;

/// Size of the chunks in which bodies are sent (and files read).
const CHUNK: usize = 64 * 1024;

/// Default cap for `/bytes/N`.
pub const DEFAULT_MAX_BYTES: u64 = 64 * 1024 * 1024;

/// Body of the built-in `/hello.txt`.
pub const HELLO_BODY: &[u8] = b"hello from ringmux\n";

/// What a worker serves.
///
/// * `GET`/`HEAD` of a regular file under `root` (if set), with `content-type` from the
///   extension. Paths with `..`, `%` (no percent-decoding is done, so none is accepted), NUL or
///   backslashes are refused with 400; symlinks are followed only if the target stays under
///   `root`.
/// * Built-ins, when `root` has no file of that name: `/hello.txt` ([`HELLO_BODY`]) and
///   `/bytes/N`: N bytes of [`fill_pattern`], N ≤ `max_bytes` (400 otherwise).
/// * `POST /echo-len`: reads the whole request body and answers with its length in decimal.
/// * Any other method: 405 (after reading the request body).
#[derive(Debug, Clone)]
pub struct Site {
    pub root: Option<PathBuf>,
    pub max_bytes: u64,
}

impl Default for Site {
    fn default() -> Self {
        Site {
            root: None,
            max_bytes: DEFAULT_MAX_BYTES,
        }
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
    /// Retry packets sent (address validation, [`ServerOptions::retry`]).
    pub retries_sent: AtomicU64,
    pub requests_total: AtomicU64,
    /// Requests that ended without a complete response: the client reset the stream or went
    /// away, or reading a file failed (the stream is then reset, not answered with 5xx).
    pub requests_failed: AtomicU64,
    pub responses_2xx: AtomicU64,
    pub responses_4xx: AtomicU64,
    pub responses_5xx: AtomicU64,
    /// Response body bytes handed to QUIC.
    pub bytes_sent: AtomicU64,
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
            responses_4xx: l(&self.responses_4xx),
            responses_5xx: l(&self.responses_5xx),
            bytes_sent: l(&self.bytes_sent),
        }
    }

    fn count_response(&self, status: StatusCode) {
        let c = match status.as_u16() {
            200..=299 => &self.responses_2xx,
            400..=499 => &self.responses_4xx,
            500..=599 => &self.responses_5xx,
            _ => return,
        };
        c.fetch_add(1, Ordering::Relaxed);
    }
}

/// [`serve_with`] with default [`ServerOptions`] (no Retry, early GET/HEAD served).
pub async fn serve(
    endpoint: quinn::Endpoint,
    site: Arc<Site>,
    stats: Arc<ServerStats>,
    shutdown: watch::Receiver<bool>,
) {
    serve_with(endpoint, site, stats, shutdown, &ServerOptions::default()).await
}

/// Serves HTTP/3 on `endpoint` until `shutdown` becomes `true` (or its sender is dropped).
///
/// On shutdown: new connection attempts are refused (CONNECTION_REFUSED, RFC 9000 §20.1), every
/// connection gets an HTTP/3 GOAWAY (RFC 9114 §5.2), requests already accepted run to
/// completion, then each connection closes with H3_NO_ERROR. Returns when all connection tasks
/// have ended; the caller bounds that with its grace timeout and then drops or closes the
/// endpoint.
///
/// `opts.retry` and `opts.early_requests` are read here; the other options belong to
/// [`crate::quic::server_config`].
pub async fn serve_with(
    endpoint: quinn::Endpoint,
    site: Arc<Site>,
    stats: Arc<ServerStats>,
    mut shutdown: watch::Receiver<bool>,
    opts: &ServerOptions,
) {
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
                    site: site.clone(),
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
    site: Arc<Site>,
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
        debug!(%remote, "HTTP/3 connection up");

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
                        let req = Req {
                            site: self.site.clone(),
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
        let connecting = incoming.accept()?;
        if self.early_requests {
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
    site: Arc<Site>,
    stats: Arc<ServerStats>,
    handshake: HandshakeDone,
    early_requests: bool,
}

/// Why a request could not be answered normally.
#[derive(Debug, thiserror::Error)]
enum RequestError {
    #[error("stream: {0}")]
    Stream(#[from] h3::error::StreamError),
    #[error("reading file: {0}")]
    Io(#[from] io::Error),
    #[error("file changed size while sending ({sent} of {len} bytes)")]
    Truncated { sent: u64, len: u64 },
}

/// What to send back.
enum Body {
    Empty,
    Static(&'static [u8]),
    Text(String),
    Pattern(u64),
    File(tokio::fs::File, u64),
}

impl Body {
    fn len(&self) -> u64 {
        match self {
            Body::Empty => 0,
            Body::Static(b) => b.len() as u64,
            Body::Text(s) => s.len() as u64,
            Body::Pattern(n) | Body::File(_, n) => *n,
        }
    }
}

impl Req {
    async fn handle(self, request: Request<()>, mut stream: Stream) {
        let method = request.method().clone();
        let path = request.uri().path().to_string();
        let result = self.respond(&request, &mut stream).await;
        match result {
            Ok(status) => {
                self.stats.count_response(status);
                debug!(%method, %path, status = status.as_u16(), "request done");
            }
            Err(RequestError::Stream(e)) if e.is_h3_no_error() => {
                self.stats.requests_failed.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => {
                // The response is already (partly) out: reset the stream so the client sees an
                // error rather than a short body that looks complete.
                stream.stop_stream(Code::H3_INTERNAL_ERROR);
                self.stats.requests_failed.fetch_add(1, Ordering::Relaxed);
                debug!(%method, %path, error = %e, "request failed");
            }
        }
    }

    async fn respond(
        &self,
        request: &Request<()>,
        stream: &mut Stream,
    ) -> Result<StatusCode, RequestError> {
        let method = request.method();
        let path = request.uri().path();
        let safe = method == Method::GET || method == Method::HEAD;
        if !(safe && self.early_requests) {
            // Possibly 0-RTT (replayable) data: act on it only once the handshake has proven
            // the client is live (RFC 8470 §3 "wait for the handshake").
            self.handshake.clone().await;
        }

        let (status, content_type, body) = if method == Method::POST && path == "/echo-len" {
            let n = drain(stream).await?;
            (StatusCode::OK, "text/plain", Body::Text(format!("{n}\n")))
        } else if !safe {
            drain(stream).await?;
            (
                StatusCode::METHOD_NOT_ALLOWED,
                "text/plain",
                Body::Static(b"method not allowed\n"),
            )
        } else {
            self.route(path).await
        };

        let mut resp = Response::builder()
            .status(status)
            .header(header::CONTENT_TYPE, content_type)
            .header(header::CONTENT_LENGTH, body.len());
        if status == StatusCode::METHOD_NOT_ALLOWED {
            resp = resp.header(header::ALLOW, HeaderValue::from_static("GET, HEAD, POST"));
        }
        // Only fixed, valid header values above: building cannot fail.
        let resp = resp.body(()).unwrap_or_default();
        stream.send_response(resp).await?;
        if method != Method::HEAD {
            self.send_body(stream, body).await?;
        }
        stream.finish().await?;
        // G9: read the request side to its end so quinn does not answer the client's FIN with
        // STOP_SENDING(0), which a client that finishes late sees as "Remote reset: 0".
        drain(stream).await?;
        Ok(status)
    }

    async fn route(&self, path: &str) -> (StatusCode, &'static str, Body) {
        let bad = |msg| (StatusCode::BAD_REQUEST, "text/plain", Body::Static(msg));
        let Some(rel) = clean_path(path) else {
            return bad(b"bad path\n");
        };
        if let Some(root) = &self.site.root {
            match open_under(root, &rel).await {
                Ok(Some((file, len))) => {
                    return (StatusCode::OK, content_type(&rel), Body::File(file, len));
                }
                Ok(None) => {}
                Err(e) => {
                    warn!(path, error = %e, "cannot open file");
                    return (StatusCode::INTERNAL_SERVER_ERROR, "text/plain", Body::Empty);
                }
            }
        }
        if path == "/hello.txt" {
            return (StatusCode::OK, "text/plain", Body::Static(HELLO_BODY));
        }
        if let Some(n) = path.strip_prefix("/bytes/") {
            return match n.parse::<u64>() {
                Ok(n) if n <= self.site.max_bytes => {
                    (StatusCode::OK, "application/octet-stream", Body::Pattern(n))
                }
                _ => bad(b"bad length\n"),
            };
        }
        (
            StatusCode::NOT_FOUND,
            "text/plain",
            Body::Static(b"not found\n"),
        )
    }

    async fn send_body(&self, stream: &mut Stream, body: Body) -> Result<(), RequestError> {
        match body {
            Body::Empty => {}
            Body::Static(b) => self.send(stream, Bytes::from_static(b)).await?,
            Body::Text(s) => self.send(stream, Bytes::from(s)).await?,
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
            Body::File(mut file, len) => {
                let mut sent = 0u64;
                loop {
                    let mut chunk = BytesMut::zeroed(CHUNK);
                    let n = file.read(&mut chunk).await?;
                    if n == 0 {
                        break;
                    }
                    if sent + n as u64 > len {
                        return Err(RequestError::Truncated {
                            sent: sent + n as u64,
                            len,
                        });
                    }
                    chunk.truncate(n);
                    self.send(stream, chunk.freeze()).await?;
                    sent += n as u64;
                }
                if sent != len {
                    return Err(RequestError::Truncated { sent, len });
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

/// Reads the request body to its end, returning its length.
async fn drain(stream: &mut Stream) -> Result<u64, RequestError> {
    let mut n = 0u64;
    while let Some(mut chunk) = stream.recv_data().await? {
        n += chunk.remaining() as u64;
        chunk.advance(chunk.remaining());
    }
    Ok(n)
}

/// The request path as a relative path of normal components, or `None` if it could name
/// anything outside the root: `..`, percent-encoding (we do not decode, so refuse it rather
/// than serve a different file than the client meant), NUL, backslash, or not absolute.
fn clean_path(path: &str) -> Option<PathBuf> {
    if !path.starts_with('/') || path.contains(['%', '\0', '\\']) {
        return None;
    }
    let mut rel = PathBuf::new();
    for seg in path.split('/') {
        match seg {
            "" | "." => {}
            ".." => return None,
            s => rel.push(s),
        }
    }
    // Belt and braces: every component must be a plain name.
    rel.components()
        .all(|c| matches!(c, Component::Normal(_)))
        .then_some(rel)
}

/// Opens `rel` under `root` if it is a regular file whose real path (after symlinks) stays
/// under the real path of `root`. `Ok(None)` means "not here".
async fn open_under(root: &Path, rel: &Path) -> io::Result<Option<(tokio::fs::File, u64)>> {
    if rel.as_os_str().is_empty() {
        return Ok(None);
    }
    let real_root = tokio::fs::canonicalize(root).await?;
    let real = match tokio::fs::canonicalize(root.join(rel)).await {
        Ok(p) => p,
        Err(e)
            if matches!(
                e.kind(),
                io::ErrorKind::NotFound | io::ErrorKind::NotADirectory
            ) =>
        {
            return Ok(None)
        }
        Err(e) => return Err(e),
    };
    if !real.starts_with(&real_root) {
        debug!(path = %rel.display(), "symlink leaves the document root");
        return Ok(None);
    }
    let file = match tokio::fs::File::open(&real).await {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    let meta = file.metadata().await?;
    if !meta.is_file() {
        return Ok(None);
    }
    Ok(Some((file, meta.len())))
}

fn content_type(path: &Path) -> &'static str {
    let ext = path
        .extension()
        .and_then(|e| e.to_str())
        .map(str::to_ascii_lowercase);
    match ext.as_deref() {
        Some("html" | "htm") => "text/html; charset=utf-8",
        Some("txt") => "text/plain; charset=utf-8",
        Some("css") => "text/css",
        Some("js" | "mjs") => "text/javascript",
        Some("json") => "application/json",
        Some("svg") => "image/svg+xml",
        Some("png") => "image/png",
        Some("jpg" | "jpeg") => "image/jpeg",
        Some("gif") => "image/gif",
        Some("webp") => "image/webp",
        Some("ico") => "image/x-icon",
        Some("wasm") => "application/wasm",
        Some("pdf") => "application/pdf",
        Some("xml") => "application/xml",
        _ => "application/octet-stream",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clean_path_refuses_escapes() {
        assert_eq!(clean_path("/a/b.txt"), Some(PathBuf::from("a/b.txt")));
        assert_eq!(clean_path("/a//./b"), Some(PathBuf::from("a/b")));
        for bad in [
            "/../etc/passwd",
            "/a/../../b",
            "/%2e%2e/x",
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
