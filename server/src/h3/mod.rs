//! The HTTP/3 front of a worker: accepting QUIC connections on a quinn endpoint, serving
//! requests by the worker's sites ([`Router`]) with the answers every transport shares
//! ([`crate::reply`], the proxy's exchange through `h3::proxy`), graceful shutdown, and counting
//! into [`ServerStats`].
//!
//! This module owns the HTTP/3 transport only. It never creates endpoints or sockets (the caller
//! hands it a ready [`quinn::Endpoint`]) and never applies the shutdown grace period: [`serve`]
//! returns once every connection has finished, and the caller decides how long to wait.
//!
//! Everything spawned here is `Send` and uses `tokio::spawn`, so it runs on the worker's
//! current-thread runtime as well as on a multi-thread one.

use std::io;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use futures_util::future::{FutureExt, Shared};
use h3::error::Code;
use h3::server::RequestStream;
use http::{HeaderMap, Method, Request, Response, StatusCode};
use tokio::sync::watch;
use tokio::task::JoinSet;
use tracing::{debug, info};

use crate::access_log::{Ending, Logged};
use crate::compress::ProxyCoding;
use crate::proxy::pool::Pool;
use crate::reply::{fill_pattern, Body, Reply, CHUNK};
use crate::request::with_path;
use crate::rules::Applied;
use crate::sites::{Local, Router, Target};
use crate::stats::ServerStats;

mod proxy;

use proxy::{proxy_h3, Outcome};

/// Request stream type of the h3 server over quinn.
type Stream = RequestStream<h3_quinn::BidiStream<Bytes>, Bytes>;

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

impl Conn {
    async fn run(mut self, incoming: quinn::Incoming) {
        let remote = incoming.remote_address();
        let (conn, handshake) = match self.handshake(incoming).await {
            Ok(c) => c,
            Err(e) => {
                let counter = match refused_for_its_name(&e) {
                    true => &self.stats.quic_unknown_name,
                    false => &self.stats.connections_failed,
                };
                counter.fetch_add(1, Ordering::Relaxed);
                debug!(%remote, error = %e, "connection failed before HTTP/3");
                return;
            }
        };
        let mut h3c: h3::server::Connection<h3_quinn::Connection, Bytes> =
            // Never `SETTINGS_ENABLE_CONNECT_PROTOCOL` (RFC 9220 §3): h3 0.0.8 cannot carry
            // `:protocol websocket`, so browsers must open their WebSockets over TCP, where
            // the proxy tunnels them (`proxy::tunnel`).
            match h3::server::builder()
                .enable_extended_connect(false)
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
        let sni: Option<Arc<str>> = sni.as_deref().map(Arc::from);

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
                            sni: sni.clone(),
                            stats: self.stats.clone(),
                            handshake: handshake.clone(),
                            early_requests: self.early_requests,
                        };
                        let stats = self.stats.clone();
                        // Boxed: the request's state (h3's header decoding, the reply) is
                        // kilobytes, and a task's future is moved in and out of its cell
                        // several times per request; the box is moved once.
                        requests.spawn(Box::pin(async move {
                            match resolver.resolve_request().await {
                                Ok((request, stream)) => req.handle(request, stream).await,
                                Err(e) => {
                                    stats.requests_failed.fetch_add(1, Ordering::Relaxed);
                                    debug!(error = %e, "bad request headers");
                                }
                            }
                        }));
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
            // SETTINGS (found with headless Chromium, `systests/tests/system/browser.rs`).
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

/// Whether the handshake ended with our TLS alert unrecognized_name (112; QUIC error 0x170,
/// RFC 9001 §4.8): a ClientHello for a name no site has, or without one, and no default site.
fn refused_for_its_name(e: &quinn::ConnectionError) -> bool {
    matches!(e, quinn::ConnectionError::TransportError(t)
        if t.code == quinn::TransportErrorCode::crypto(112))
}

fn handshake_done(f: impl std::future::Future<Output = ()> + Send + 'static) -> HandshakeDone {
    f.boxed().shared()
}

/// One request's task state.
struct Req {
    conn: quinn::Connection,
    router: Router,
    /// The connection's site.
    site: Option<usize>,
    /// The connection's TLS server name, for the access log.
    sni: Option<Arc<str>>,
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

impl RequestError {
    /// How the request's access-log line says it ended.
    fn ending(&self) -> Ending {
        match self {
            RequestError::Stream(h3::error::StreamError::ConnectionError {
                0: h3::error::ConnectionError::Timeout { .. },
                ..
            }) => Ending::CutTimeout,
            RequestError::Stream(_) => Ending::CutClient,
            RequestError::Io(_) | RequestError::Truncated { .. } => Ending::CutError,
        }
    }
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

impl Req {
    async fn handle(self, request: Request<()>, mut stream: Stream) {
        let _active = self.stats.begin_request();
        let (mut parts, ()) = request.into_parts();
        let choice = self.router.choose(self.site, &parts, false);
        let site = choice.answering(self.site);
        let remote = self.conn.remote_address();
        let mut logged = self.router.begin_log(site, remote, "h3", &parts);
        let (target, rules) = (self.router).target_for(
            choice,
            &parts.method,
            &parts.headers,
            &parts.uri,
            remote.ip(),
        );
        if let Some(l) = logged.as_mut() {
            l.note(rules.route_path(), || self.sni.clone());
        }
        let local = match target {
            Target::Proxy {
                upstream,
                path,
                compress,
            } => {
                let upstream = upstream.clone();
                if let Some(path) = path {
                    parts.uri = with_path(&parts.uri, path);
                }
                // What the client accepts, before the route's rules change the request.
                let coding = ProxyCoding::of(&parts.method, &parts.headers, compress);
                rules.request(&mut parts.headers);
                let request = Request::from_parts(parts, ());
                // Boxed: the proxy's state is most of a request's, and files need none of it.
                let proxied =
                    Box::pin(self.proxy(site, &upstream, request, stream, coding, &rules)).await;
                if let Some(l) = logged {
                    match proxied {
                        Outcome::Answered { status, bytes } => l.end(Some(status), bytes),
                        Outcome::Failed => l.end_as(None, 0, Ending::CutClient),
                    }
                }
                return;
            }
            Target::Local(local) => local,
        };
        let result = self
            .respond(
                &parts.method,
                &parts.headers,
                local,
                &rules,
                &mut stream,
                &mut logged,
            )
            .await;
        let (method, path) = (&parts.method, parts.uri.path());
        let ending = match result {
            Ok(status) => {
                self.stats.count_response(site, status);
                debug!(%method, %path, status = status.as_u16(), "request done");
                Ending::Ok
            }
            Err(RequestError::Stream(e)) if e.is_h3_no_error() => {
                self.stats.requests_failed.fetch_add(1, Ordering::Relaxed);
                Ending::CutClient
            }
            Err(e) => {
                // The response is already (partly) out: reset the stream so the client sees an
                // error rather than a short body that looks complete.
                stream.stop_stream(Code::H3_INTERNAL_ERROR);
                self.stats.requests_failed.fetch_add(1, Ordering::Relaxed);
                debug!(%method, %path, error = %e, "request failed");
                e.ending()
            }
        };
        if let Some(l) = logged {
            l.finish(ending);
        }
    }

    /// Passes the request to the upstream. Like [`Req::respond`], a request that may be replayed
    /// 0-RTT data waits for the handshake unless it is a GET or HEAD with early requests on;
    /// one forwarded before the handshake completed says so with `early-data: 1`.
    async fn proxy(
        &self,
        site: Option<usize>,
        upstream: &Arc<Pool>,
        request: Request<()>,
        stream: Stream,
        coding: ProxyCoding,
        rules: &Applied<'_>,
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
            proxy::Shaping { coding, rules },
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
        rules: &Applied<'_>,
        stream: &mut Stream,
        logged: &mut Option<Logged>,
    ) -> Result<StatusCode, RequestError> {
        let safe = method == Method::GET || method == Method::HEAD;
        if !(safe && self.early_requests) {
            // Possibly 0-RTT (replayable) data: act on it only once the handshake has proven
            // the client is live (RFC 8470 §3 "wait for the handshake").
            self.handshake.clone().await;
        }

        let reply = match local {
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
        let mut reply = rules.error_page(reply);
        rules.response(&mut reply.headers);

        let status = reply.status;
        let mut resp = Response::new(());
        *resp.status_mut() = status;
        *resp.headers_mut() = std::mem::take(&mut reply.headers);
        stream.send_response(resp).await?;
        if let Some(l) = logged.as_mut() {
            l.head_sent(status);
        }
        if method != Method::HEAD {
            self.send_body(stream, reply.body, logged).await?;
        }
        // The last byte is handed to QUIC: the access log's duration ends here (with the
        // stream finished, the client's flow-control window is all QUIC still holds).
        stream.finish().await?;
        if let Some(l) = logged.take() {
            l.finish(Ending::Ok);
        }
        // Read the request side to its end so quinn does not answer the client's FIN with
        // STOP_SENDING(0), which a client that finishes late sees as "Remote reset: 0".
        drain(stream).await?;
        Ok(status)
    }

    async fn send_body(
        &self,
        stream: &mut Stream,
        body: Body,
        logged: &mut Option<Logged>,
    ) -> Result<(), RequestError> {
        match body {
            Body::Empty => {}
            Body::Static(b) => self.send(stream, logged, Bytes::from_static(b)).await?,
            Body::Text(s) => self.send(stream, logged, Bytes::from(s)).await?,
            Body::Memory(b) => {
                if !b.is_empty() {
                    self.send(stream, logged, b).await?;
                }
            }
            Body::Pattern(len) => {
                let mut sent = 0u64;
                while sent < len {
                    let n = (len - sent).min(CHUNK as u64) as usize;
                    let mut chunk = BytesMut::zeroed(n);
                    fill_pattern(sent, &mut chunk);
                    self.send(stream, logged, chunk.freeze()).await?;
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
                    self.send(stream, logged, chunk).await?;
                }
            }
            Body::Stream(mut chunks) => {
                use futures_util::StreamExt;
                while let Some(chunk) = chunks.next().await {
                    self.send(stream, logged, chunk?).await?;
                }
            }
        }
        Ok(())
    }

    async fn send(
        &self,
        stream: &mut Stream,
        logged: &mut Option<Logged>,
        data: Bytes,
    ) -> Result<(), RequestError> {
        let n = data.len() as u64;
        stream.send_data(data).await?;
        self.stats.bytes_sent.fetch_add(n, Ordering::Relaxed);
        if let Some(l) = logged.as_mut() {
            l.body_sent(n);
        }
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
