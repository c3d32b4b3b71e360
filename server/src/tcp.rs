//! HTTPS over TCP beside HTTP/3: the built-in server's second transport. Browsers open QUIC only
//! to an origin that told them over TCP (an `alt-svc` field, RFC 7838; RFC 9114 §3.1.1), and
//! fall back to TCP where UDP is blocked, so the same site answers on both: the request is
//! routed by [`Router`], the one path HTTP/3 takes too (a connection's site is the one its TLS
//! server name chooses; a request for another site's host is answered 421), and every TCP
//! response carries the `alt-svc` value ringmux was given.
//!
//! TLS 1.3 and 1.2 with ringmux's certificate (tokio-rustls), ALPN `h2` and `http/1.1`, served
//! by hyper (HTTP/1.1 or HTTP/2, as ALPN chose; HTTP/1.1 without ALPN).
//! Connections come from the demux's listening socket, which every worker accepts from
//! ([`ringmux_worker::Worker::tcp_listener`]).
//!
//! Bad input and overload: a TLS handshake must finish within [`TcpOptions::handshake_timeout`]
//! (idle or half-open connections never pile up), an HTTP/1.1 request head within
//! [`TcpOptions::header_timeout`] (slowloris; an idle keep-alive connection waits for its next
//! head, so this closes it too), and an HTTP/2 connection with no request in flight is sent
//! GOAWAY after [`TcpOptions::idle_timeout`]. At [`TcpOptions::max_connections`] the
//! connection idle longest (HTTP/1.1 between requests, HTTP/2 without a stream) is asked to
//! finish to make room for a new one, and only when none is idle is the new one closed at
//! accept. A request head is at most [`TcpOptions::max_header_bytes`]
//! (HTTP/1.1: 431 and the connection closed; HTTP/2: `SETTINGS_MAX_HEADER_LIST_SIZE`, over it
//! 431 on that stream), HTTP/2 streams are capped per connection and rapid resets are h2's to
//! refuse (GOAWAY `ENHANCE_YOUR_CALM`). Each is counted in [`ServerStats::tcp_errors`] by
//! [`TcpErrorKind`]; requests by protocol in `requests_h1` and `requests_h2`.
//!
//! On drain: this worker stops accepting (the others and the next generation keep the queue),
//! every connection is told to finish (HTTP/2 GOAWAY, HTTP/1.1 `connection: close`), and the
//! server returns when the last one closed; the caller bounds that with its grace.
//!
//! ACME challenges (`control-protocol.md`, "Control messages"), from the worker's
//! [`AcmeAnswers`] ([`TcpOptions::acme`]), are answered here and never over QUIC. TLS-ALPN-01
//! (RFC 8737 §3): a ClientHello whose ALPN list is `acme-tls/1` alone, for a name with a pending
//! challenge, gets the challenge's certificate and `acme-tls/1`, and the connection ends after
//! the handshake; any other ClientHello offering `acme-tls/1` is refused with
//! `no_application_protocol` (counted as `tls_failed`), never served a site's certificate.
//! HTTP-01 is the plain-HTTP listener's (`crate::redirect`), which runs on this module's
//! connection handling (`serve_plain`).
//!
//! Every connection hyper is done with is closed gracefully (`close_gracefully`): TLS
//! `close_notify` and the write side shut, then what the client still sends is read and thrown
//! away until it closes its side, or what was sent has arrived and the client went quiet, or a
//! bound passes. Closing at once would lose data: a socket closed with unread input, or
//! receiving any once closed (an HTTP/2 client's WINDOW_UPDATE as it reads on), answers with a
//! reset (RFC 1122 §4.2.2.13) and throws away what it had not yet delivered. RFC 9112 §9.6
//! describes this close; nginx's `lingering_close` is the same.

use std::collections::HashMap;
use std::convert::Infallible;
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::{header, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Empty, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::{oneshot, watch, Notify};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tracing::{debug, info};

use futures_util::future::BoxFuture;
use ringmux_proto::message::ACME_TLS_ALPN;
use ringmux_worker::AcmeAnswers;

use crate::access_log::{Ending, Logged};
use crate::proxy::{ClientGone, Exchange, Upstream};
use crate::reply::{fill_pattern, Body, Reply, CHUNK};
use crate::request::with_path;
use crate::sites::{Local, Router, Target};
use crate::stats::ServerStats;
pub use crate::stats::TcpErrorKind;

#[allow(unsafe_code)]
mod sys;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

impl TcpErrorKind {
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
    /// Connections this worker serves at once. At the cap the connection idle longest is
    /// asked to finish to make room for a new one; when none is idle, the new one is closed at
    /// accept. Connections being closed are not counted, but at most as many again are kept.
    pub max_connections: usize,
    /// Longest a TLS handshake may take.
    pub handshake_timeout: Duration,
    /// Longest an HTTP/1.1 request head may take to arrive.
    pub header_timeout: Duration,
    /// Longest an HTTP/2 connection may stay open with no request in flight; then it is sent
    /// GOAWAY and closed. (HTTP/1.1 has `header_timeout`.)
    pub idle_timeout: Duration,
    /// HTTP/2 streams a client may have open at once on one connection.
    pub max_streams: u32,
    /// Largest request head in bytes: over HTTP/1.1 a larger one is answered 431; over HTTP/2
    /// it is the `SETTINGS_MAX_HEADER_LIST_SIZE` the server announces. HTTP/1.1 holds the head
    /// in its read buffer of this size (at least 8 KiB).
    pub max_header_bytes: u32,
    /// Held while the listener accepts, dropped the moment it stops on a drain
    /// (`Worker::accepting`): then the demux knows no new connection reaches this worker.
    pub accepting: Option<Arc<ringmux_worker::Accepting>>,
    /// The ACME challenges pending now (`Worker::acme_answers`): TLS-ALPN-01 on the HTTPS
    /// listener, HTTP-01 on the plain-HTTP one (see the module documentation). None by
    /// default.
    pub acme: AcmeAnswers,
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
            accepting: None,
            acme: AcmeAnswers::new(),
        }
    }
}

/// A response body over TCP.
pub(crate) type TcpBody = UnsyncBoxBody<Bytes, io::Error>;

/// Serves HTTPS over TCP on `listener` until `shutdown` becomes `true` (or its sender is
/// dropped), then drains: see the module documentation.
pub async fn serve(
    listener: tokio::net::TcpListener,
    tls: Arc<rustls::ServerConfig>,
    sites: impl Into<Router>,
    stats: Arc<ServerStats>,
    shutdown: watch::Receiver<bool>,
    opts: TcpOptions,
) {
    let https = Kind::Https(tokio_rustls::TlsAcceptor::from(tls));
    serve_connections(listener, https, sites.into(), stats, shutdown, opts).await;
}

/// What answers each request of a plain-HTTP/1.1 listener ([`serve_plain`]), given the client's
/// address.
pub(crate) type PlainAnswer = Arc<
    dyn Fn(SocketAddr, Request<Incoming>) -> BoxFuture<'static, Response<TcpBody>> + Send + Sync,
>;

/// Serves plain HTTP/1.1 on `listener` until `shutdown`, as [`serve`] serves HTTPS (the same
/// accepting, cap, timeouts, drain and graceful close), each request answered by `answer`.
/// `what` names the listener in the log. The plain-HTTP listener (`crate::redirect`) runs on it.
pub(crate) async fn serve_plain(
    listener: tokio::net::TcpListener,
    what: &'static str,
    answer: PlainAnswer,
    router: Router,
    stats: Arc<ServerStats>,
    shutdown: watch::Receiver<bool>,
    opts: TcpOptions,
) {
    let plain = Kind::Plain { what, answer };
    serve_connections(listener, plain, router, stats, shutdown, opts).await;
}

/// What a listener serves.
#[derive(Clone)]
enum Kind {
    Https(tokio_rustls::TlsAcceptor),
    /// Plain HTTP/1.1, each request answered by `answer`.
    Plain {
        what: &'static str,
        answer: PlainAnswer,
    },
}

impl Kind {
    fn name(&self) -> &'static str {
        match self {
            Kind::Https(_) => "HTTPS over TCP",
            Kind::Plain { what, .. } => what,
        }
    }
}

async fn serve_connections(
    listener: tokio::net::TcpListener,
    kind: Kind,
    router: Router,
    stats: Arc<ServerStats>,
    mut shutdown: watch::Receiver<bool>,
    opts: TcpOptions,
) {
    stats.sites.init(&router);
    let what = kind.name();
    let mut opts = opts;
    let accepting = opts.accepting.take();
    let opts = Arc::new(opts);
    let mut connections = JoinSet::new();
    let mut registry = Registry::new();
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
                match registry.admit(opts.max_connections) {
                    Admission::Room => {}
                    Admission::MadeRoom => stats.count_tcp_error(TcpErrorKind::Evicted),
                    Admission::Full => {
                        stats.count_tcp_error(TcpErrorKind::OverCap);
                        drop(stream);
                        continue;
                    }
                }
                let tracked = registry.next();
                let conn = Conn {
                    kind: kind.clone(),
                    router: router.clone(),
                    stats: stats.clone(),
                    shutdown: shutdown.clone(),
                    opts: opts.clone(),
                    tracked: tracked.clone(),
                };
                let task = connections.spawn(conn.run(stream, remote));
                registry.insert(task.id(), tracked);
            }
            Some(joined) = connections.join_next_with_id(), if !connections.is_empty() => {
                registry.remove(match joined {
                    Ok((id, ())) => id,
                    Err(e) => e.id(),
                });
            }
        }
    }
    // This worker takes no more connections; the queue stays with the others and the demux.
    drop(listener);
    drop(accepting);
    info!(
        connections = connections.len(),
        "{what} stopping: no more accepts, draining"
    );
    while connections.join_next().await.is_some() {}
    info!("{what} stopped");
}

/// A TLS alert record ending a handshake for a server name no site has: fatal (2),
/// `unrecognized_name` (112), RFC 6066 §3.
const UNRECOGNIZED_NAME: [u8; 7] = [0x15, 0x03, 0x03, 0x00, 0x02, 0x02, 0x70];

/// A TLS alert record ending a handshake that offers `acme-tls/1` with no challenge to answer:
/// fatal (2), `no_application_protocol` (120), RFC 7301 §3.2.
const NO_APPLICATION_PROTOCOL: [u8; 7] = [0x15, 0x03, 0x03, 0x00, 0x02, 0x02, 0x78];

/// What a TLS handshake on the HTTPS listener came to.
enum Handshake {
    /// A client to serve HTTP.
    Serve(tokio_rustls::server::TlsStream<TcpStream>),
    /// A TLS-ALPN-01 challenge answered: the connection ends here (RFC 8737 §3).
    Challenge(tokio_rustls::server::TlsStream<TcpStream>),
    /// Refused with `unrecognized_name`: the ClientHello named no site (why, for the log).
    UnknownName(io::Error),
}

/// One TCP connection's task state.
struct Conn {
    kind: Kind,
    router: Router,
    stats: Arc<ServerStats>,
    shutdown: watch::Receiver<bool>,
    opts: Arc<TcpOptions>,
    /// What the listener sees of this connection.
    tracked: Arc<Tracked>,
}

impl Conn {
    /// The TLS handshake, once its ClientHello names a site (or the default site answers): a
    /// name no site has, or none, without a default site, is refused with the
    /// `unrecognized_name` alert (counted as `unknown_name`, not as `tls_failed`), as RFC 6066 §3 says, before any
    /// certificate is chosen. A ClientHello offering `acme-tls/1` is a TLS-ALPN-01
    /// validation, answered with the challenge's configuration or refused, never with
    /// `acceptor`'s (see the module documentation).
    async fn handshake(
        &self,
        acceptor: &tokio_rustls::TlsAcceptor,
        stream: TcpStream,
    ) -> io::Result<Handshake> {
        let start =
            tokio_rustls::LazyConfigAcceptor::new(rustls::server::Acceptor::default(), stream)
                .await?;
        let hello = start.client_hello();
        if let Some(alone) = offers_acme_tls(&hello) {
            // RFC 8737 §3: the CA offers `acme-tls/1` alone, for the name under validation.
            let name = hello.server_name().map(str::to_owned);
            let config = name
                .as_deref()
                .filter(|_| alone)
                .and_then(|n| self.opts.acme.tls_alpn01_config(n));
            let Some(config) = config else {
                let problem = format!("acme-tls/1 offered, no challenge pending for {name:?}");
                return Err(refuse(start.io, &NO_APPLICATION_PROTOCOL, problem).await);
            };
            return start.into_stream(config).await.map(Handshake::Challenge);
        }
        if self.router.connection_site(hello.server_name()).is_none() {
            let problem = format!("no site for the server name {:?}", hello.server_name());
            let refused = refuse(start.io, &UNRECOGNIZED_NAME, problem).await;
            return Ok(Handshake::UnknownName(refused));
        }
        let tls = start.into_stream(acceptor.config().clone()).await?;
        Ok(Handshake::Serve(tls))
    }

    async fn run(mut self, stream: TcpStream, remote: SocketAddr) {
        let _ = stream.set_nodelay(true);
        let acceptor = match &self.kind {
            Kind::Https(acceptor) => acceptor.clone(),
            Kind::Plain { answer, .. } => {
                let answer = answer.clone();
                let tracked = self.tracked.clone();
                let stats = self.stats.clone();
                let service = hyper::service::service_fn(move |req| {
                    counted(tracked.begin(&stats), answer(remote, req))
                });
                self.tracked.open();
                let (io, back) = lend(stream);
                let conn = self.http1().serve_connection(TokioIo::new(io), service);
                self.drive(remote, conn, None).await;
                return self.close(remote, back).await;
            }
        };
        let tls = match tokio::time::timeout(
            self.opts.handshake_timeout,
            self.handshake(&acceptor, stream),
        )
        .await
        {
            Ok(Ok(Handshake::Serve(tls))) => tls,
            Ok(Ok(Handshake::Challenge(tls))) => {
                debug!(%remote, name = tls.get_ref().1.server_name(), "TLS-ALPN-01 answered");
                // Not counted against the cap while it closes.
                self.tracked.phase.store(CLOSING, Ordering::Relaxed);
                if let Err(why) = close_gracefully(tls).await {
                    self.stats.count_tcp_error(TcpErrorKind::LingerCut);
                    debug!(%remote, why, "graceful close cut short");
                }
                return;
            }
            Ok(Ok(Handshake::UnknownName(why))) => {
                self.stats.count_tcp_error(TcpErrorKind::UnknownName);
                debug!(%remote, error = %why, "TLS handshake refused");
                return;
            }
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
        let site = self.router.connection_site(tls.get_ref().1.server_name());
        let router = self.router.clone();
        let stats = self.stats.clone();
        let alt_svc = self.opts.alt_svc.clone();
        let tracked = self.tracked.clone();
        let service = hyper::service::service_fn(move |req| {
            let conn = Connection {
                router: router.clone(),
                site,
                stats: stats.clone(),
                alt_svc: alt_svc.clone(),
                remote,
            };
            let in_flight = tracked.begin(&stats);
            counted(in_flight, handle(conn, req))
        });
        self.tracked.open();
        // The protocol is the one ALPN chose (HTTP/1.1 without ALPN), never sniffed from a
        // preface: a client that sends nothing after its handshake meets the header timeout.
        let h2 = tls.get_ref().1.alpn_protocol() == Some(b"h2");
        let (io, back) = lend(tls);
        let io = TokioIo::new(io);
        if h2 {
            let conn = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                .timer(TokioTimer::new())
                .max_concurrent_streams(self.opts.max_streams)
                .max_header_list_size(self.opts.max_header_bytes)
                .serve_connection(io, service);
            self.drive(remote, conn, Some(self.opts.idle_timeout)).await;
        } else {
            let conn = self.http1().serve_connection(io, service);
            self.drive(remote, conn, None).await;
        }
        self.close(remote, back).await;
    }

    /// Closes the connection hyper handed `back` (its connection dropped by now) gracefully.
    async fn close<T: Transport>(&self, remote: SocketAddr, mut back: oneshot::Receiver<T>) {
        // Not counted against the cap while it closes.
        self.tracked.phase.store(CLOSING, Ordering::Relaxed);
        // hyper's connection, which held the stream, is gone: the stream came back with its
        // drop, or never will (nothing to close then).
        let Ok(io) = back.try_recv() else {
            return;
        };
        if let Err(why) = close_gracefully(io).await {
            self.stats.count_tcp_error(TcpErrorKind::LingerCut);
            debug!(%remote, why, "graceful close cut short");
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

    /// Serves `conn` to its end. It is asked to finish (HTTP/2 GOAWAY, HTTP/1.1
    /// `connection: close` after the request in flight) once draining starts, when its
    /// listener needs its room, or when it had no request in flight for `idle_timeout`
    /// (`None`: no such clock). Once asked, it is given up on when it has been without a
    /// request in flight for [`GOAWAY_WAIT`] since. `conn` is dropped on return, and with it
    /// the stream it was lent.
    async fn drive<C: Graceful>(
        &mut self,
        remote: SocketAddr,
        conn: C,
        idle_timeout: Option<Duration>,
    ) {
        tokio::pin!(conn);
        let mut asked_at = None;
        let mut finish = (*self.shutdown.borrow_and_update()).then_some(Finish::Drain);
        let mut step_at = self.tracked.step_at(idle_timeout, asked_at);
        let clock = tokio::time::sleep_until(step_at.unwrap_or_else(Instant::now));
        tokio::pin!(clock);
        loop {
            if let Some(why) = finish.take() {
                asked_at = Some(Instant::now());
                self.asked(remote, why);
                conn.as_mut().graceful_shutdown();
                step_at = self.tracked.step_at(idle_timeout, asked_at);
                if let Some(at) = step_at {
                    clock.as_mut().reset(at);
                }
            }
            tokio::select! {
                done = conn.as_mut() => {
                    if let Err(e) = done {
                        self.ended(remote, &e);
                    }
                    return;
                }
                changed = self.shutdown.changed(), if asked_at.is_none() => {
                    if changed.is_err() || *self.shutdown.borrow_and_update() {
                        finish = Some(Finish::Drain);
                    }
                }
                () = self.tracked.evict.notified(), if asked_at.is_none() => {
                    finish = Some(Finish::Evicted);
                }
                () = &mut clock, if step_at.is_some() => {
                    // Requests may have come and gone since the clock was set.
                    step_at = self.tracked.step_at(idle_timeout, asked_at);
                    match step_at {
                        Some(at) if at > Instant::now() => clock.as_mut().reset(at),
                        _ if asked_at.is_some() => {
                            // A client that never answers the GOAWAY's PING (RFC 9113 §6.8)
                            // would keep an HTTP/2 connection open for good.
                            debug!(%remote, "no request in flight and no end: closing");
                            return;
                        }
                        _ => finish = Some(Finish::Idle),
                    }
                }
            }
        }
    }

    /// Notes that the connection to `remote` was asked to finish, and counts why.
    fn asked(&self, remote: SocketAddr, why: Finish) {
        let phase = &self.tracked.phase;
        let why = match why {
            // The listener moved it to CLOSING and counted it already.
            Finish::Evicted => why,
            Finish::Idle => {
                match phase.compare_exchange(OPEN, CLOSING, Ordering::Relaxed, Ordering::Relaxed) {
                    Ok(_) => {
                        self.stats.count_tcp_error(TcpErrorKind::IdleTimeout);
                        why
                    }
                    // The listener took it first, to make room.
                    Err(_) => Finish::Evicted,
                }
            }
            Finish::Drain => {
                phase.store(CLOSING, Ordering::Relaxed);
                why
            }
        };
        debug!(%remote, ?why, "asking the connection to finish");
    }
}

/// Whether a ClientHello offers `acme-tls/1` (RFC 8737 §6.2), and if so whether alone.
fn offers_acme_tls(hello: &rustls::server::ClientHello<'_>) -> Option<bool> {
    let (mut acme, mut others) = (false, false);
    for protocol in hello.alpn()? {
        match protocol == ACME_TLS_ALPN {
            true => acme = true,
            false => others = true,
        }
    }
    acme.then_some(!others)
}

/// Ends a handshake before it began with a fatal `alert` record, and the write side shut;
/// the error to report, which says why (`problem`).
async fn refuse(mut io: TcpStream, alert: &[u8], problem: String) -> io::Error {
    let _ = io.write_all(alert).await;
    let _ = io.shutdown().await;
    io::Error::new(io::ErrorKind::InvalidData, problem)
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

/// Why a connection was asked to finish.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Finish {
    /// The worker drains.
    Drain,
    /// No request in flight for [`TcpOptions::idle_timeout`].
    Idle,
    /// Its listener needed the room for a new connection.
    Evicted,
}

/// How long a connection asked to finish may stay without a request in flight before it is
/// closed anyway (and closed gracefully): an HTTP/2 client has that long to answer the PING of
/// a graceful GOAWAY (RFC 9113 §6.8), which a round trip does.
const GOAWAY_WAIT: Duration = Duration::from_secs(5);

/// [`Tracked::phase`]: the TLS handshake; neither idle nor busy.
const HANDSHAKE: u8 = 0;
/// [`Tracked::phase`]: serving HTTP; idle when no request is in flight.
const OPEN: u8 = 1;
/// [`Tracked::phase`]: asked to finish, or closing; not counted against the cap.
const CLOSING: u8 = 2;

/// One connection as its listener and its task both see it: whether it is idle and since when,
/// and the listener's request that it make room. The connection's task writes `phase` (the
/// listener only moves an idle connection from [`OPEN`] to [`CLOSING`]); its requests write
/// `in_flight` and `idle_since_ms`.
struct Tracked {
    /// Accept order: of two connections idle since the same millisecond, the older goes first.
    seq: u64,
    /// The listener's start, from which `idle_since_ms` counts.
    epoch: Instant,
    /// [`HANDSHAKE`], [`OPEN`] or [`CLOSING`].
    phase: AtomicU8,
    /// Requests in flight (HTTP/2 streams): from hyper's call of the service to the end of the
    /// response body, or its drop.
    in_flight: AtomicU32,
    /// When `in_flight` last fell to 0 (before any request: when the connection opened), in
    /// milliseconds since `epoch`.
    idle_since_ms: AtomicU64,
    /// Wakes the task once the listener moved it to [`CLOSING`].
    evict: Notify,
}

impl Tracked {
    /// The handshake is done: it serves, and is idle until its first request.
    fn open(&self) {
        self.idle_since_ms
            .store(self.ms_since_epoch(Instant::now()), Ordering::Relaxed);
        let _ = self
            .phase
            .compare_exchange(HANDSHAKE, OPEN, Ordering::Relaxed, Ordering::Relaxed);
    }

    /// A request begins (hyper called the service): in flight, on this connection and in
    /// `stats`, until the returned guard drops.
    fn begin(self: &Arc<Self>, stats: &Arc<ServerStats>) -> InFlight {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        InFlight(self.clone(), stats.begin_request())
    }

    /// When the connection is due for its next step if no request comes: the idle timeout
    /// (`idle_timeout`, if it has one) or, once it was asked to finish (at `asked_at`), being
    /// given up on ([`GOAWAY_WAIT`] without a request in flight since then). While a request is
    /// in flight: that long from now, to look again.
    fn step_at(
        &self,
        idle_timeout: Option<Duration>,
        asked_at: Option<Instant>,
    ) -> Option<Instant> {
        let (limit, from) = match asked_at {
            Some(at) => (GOAWAY_WAIT, Some(at)),
            None => (idle_timeout?, None),
        };
        let idle_from = match self.idle_since() {
            Some(ms) => self.epoch + Duration::from_millis(ms),
            None => Instant::now(),
        };
        Some(idle_from.max(from.unwrap_or(idle_from)) + limit)
    }

    /// Since when (milliseconds since `epoch`) it has had no request in flight; `None` while
    /// one is. Relaxed loads: a request that ends as this reads may leave the previous time,
    /// which at worst asks a connection with no request in flight to finish a moment early.
    fn idle_since(&self) -> Option<u64> {
        (self.in_flight.load(Ordering::Relaxed) == 0)
            .then(|| self.idle_since_ms.load(Ordering::Relaxed))
    }

    fn ms_since_epoch(&self, at: Instant) -> u64 {
        u64::try_from(at.saturating_duration_since(self.epoch).as_millis()).unwrap_or(u64::MAX)
    }
}

/// A request in flight on a connection (see [`Tracked::begin`]).
struct InFlight(
    Arc<Tracked>,
    #[allow(dead_code)] crate::stats::ActiveRequest,
);

impl Drop for InFlight {
    fn drop(&mut self) {
        let tracked = &self.0;
        if tracked.in_flight.fetch_sub(1, Ordering::Relaxed) == 1 {
            let now = tracked.ms_since_epoch(Instant::now());
            tracked.idle_since_ms.store(now, Ordering::Relaxed);
        }
    }
}

/// Answers a request with `answer`, holding `in_flight` until hyper is done with the response
/// body (or drops the request unanswered).
async fn counted(
    in_flight: InFlight,
    answer: impl std::future::Future<Output = Response<TcpBody>>,
) -> Result<Response<InFlightBody>, Infallible> {
    Ok(answer.await.map(|body| InFlightBody {
        body,
        _in_flight: in_flight,
    }))
}

/// A response body and its request's [`InFlight`].
struct InFlightBody {
    body: TcpBody,
    _in_flight: InFlight,
}

impl hyper::body::Body for InFlightBody {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        std::pin::Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.body.size_hint()
    }
}

/// The connections of one listener, for its cap.
struct Registry {
    epoch: Instant,
    next_seq: u64,
    connections: HashMap<tokio::task::Id, Arc<Tracked>>,
}

/// What the cap says to a new connection.
#[derive(Debug, PartialEq, Eq)]
enum Admission {
    /// Under the cap.
    Room,
    /// At the cap: the connection idle longest was asked to finish.
    MadeRoom,
    /// At the cap with none idle (or as many again closing): close the new one.
    Full,
}

impl Registry {
    fn new() -> Registry {
        Registry {
            epoch: Instant::now(),
            next_seq: 0,
            connections: HashMap::new(),
        }
    }

    /// Whether a new connection may be served under `max`, making room if it takes that: the
    /// connection idle longest moves to [`CLOSING`] and its task is woken to finish it. Looks
    /// at every connection, but only at the cap.
    fn admit(&mut self, max: usize) -> Admission {
        if self.connections.len() < max {
            return Admission::Room;
        }
        if self.connections.len() >= max.saturating_mul(2) {
            return Admission::Full;
        }
        let mut counted = 0;
        let mut idlest: Option<(u64, u64, &Arc<Tracked>)> = None;
        for t in self.connections.values() {
            match t.phase.load(Ordering::Relaxed) {
                CLOSING => continue,
                OPEN => {
                    if let Some(since) = t.idle_since() {
                        if idlest.is_none_or(|(s, seq, _)| (since, t.seq) < (s, seq)) {
                            idlest = Some((since, t.seq, t));
                        }
                    }
                }
                _ => {}
            }
            counted += 1;
        }
        if counted < max {
            return Admission::Room;
        }
        let Some((_, _, t)) = idlest else {
            return Admission::Full;
        };
        match t
            .phase
            .compare_exchange(OPEN, CLOSING, Ordering::Relaxed, Ordering::Relaxed)
        {
            Ok(_) => {
                t.evict.notify_one();
                Admission::MadeRoom
            }
            // It began to close on its own since the load above: the room is there.
            Err(_) => Admission::Room,
        }
    }

    /// The state of the next connection, in its handshake.
    fn next(&mut self) -> Arc<Tracked> {
        self.next_seq += 1;
        Arc::new(Tracked {
            seq: self.next_seq,
            epoch: self.epoch,
            phase: AtomicU8::new(HANDSHAKE),
            in_flight: AtomicU32::new(0),
            idle_since_ms: AtomicU64::new(0),
            evict: Notify::new(),
        })
    }

    fn insert(&mut self, task: tokio::task::Id, tracked: Arc<Tracked>) {
        self.connections.insert(task, tracked);
    }

    fn remove(&mut self, task: tokio::task::Id) {
        self.connections.remove(&task);
    }
}

/// How long a graceful close waits for a client that went quiet (nginx's `lingering_timeout`
/// is the same), unless what was sent is still arriving.
const LINGER_QUIET: Duration = Duration::from_secs(5);
/// The longest a graceful close takes in all (nginx's `lingering_time`).
const LINGER_TIME: Duration = Duration::from_secs(30);
/// The most a graceful close reads and throws away.
const LINGER_BYTES: u64 = 1 << 20;

/// A connection's byte stream: TLS over TCP, or TCP itself (the plain-HTTP redirects).
trait Transport: AsyncRead + AsyncWrite + Unpin + Send + 'static {
    /// The TCP socket under it (what TLS still held is dropped: call it once `shutdown` sent
    /// `close_notify`).
    fn into_tcp(self) -> TcpStream;
}

impl Transport for TcpStream {
    fn into_tcp(self) -> TcpStream {
        self
    }
}

impl Transport for tokio_rustls::server::TlsStream<TcpStream> {
    fn into_tcp(self) -> TcpStream {
        self.into_inner().0
    }
}

/// Closes a connection without losing what was sent on it: TLS `close_notify` and the write
/// side shut (the FIN goes after everything written), then what the client still sends is read
/// and thrown away until it closes its side. It ends earlier once the client has been quiet for
/// [`LINGER_QUIET`] and everything sent has arrived (nothing is left to lose), or stopped
/// taking it (no progress in that time); and at [`LINGER_TIME`] or [`LINGER_BYTES`] in any
/// case. `Err` says why it was cut short while the client could still lose data.
async fn close_gracefully<T: Transport>(mut io: T) -> Result<(), &'static str> {
    let deadline = Instant::now() + LINGER_TIME;
    // A no-op if hyper closed the write side already (it does when it ends a connection
    // itself); waits while the send buffer is full, which is the client's to drain.
    match tokio::time::timeout_at(deadline, io.shutdown()).await {
        Ok(Ok(())) => {}
        // A reset or a broken pipe: nothing more can be delivered.
        Ok(Err(_)) => return Ok(()),
        Err(_) => return Err("the client took nothing in time to send close_notify"),
    }
    let mut tcp = io.into_tcp();
    let mut unacknowledged = sys::unacknowledged_bytes(&tcp).unwrap_or(0);
    let mut discarded = 0u64;
    let mut buf = [0u8; 1024];
    loop {
        let now = Instant::now();
        if now >= deadline {
            return match sys::unacknowledged_bytes(&tcp).unwrap_or(0) {
                0 => Ok(()),
                _ => Err("the client was still receiving when the time was up"),
            };
        }
        let quiet_until = (now + LINGER_QUIET).min(deadline);
        match tokio::time::timeout_at(quiet_until, tcp.read(&mut buf)).await {
            // The client closed its side (or reset): it has everything it will read.
            Ok(Ok(0)) | Ok(Err(_)) => return Ok(()),
            Ok(Ok(n)) => {
                discarded += n as u64;
                if discarded > LINGER_BYTES {
                    return Err("the client kept sending");
                }
            }
            Err(_) => {
                let left = sys::unacknowledged_bytes(&tcp).unwrap_or(0);
                if left == 0 {
                    // Everything sent has arrived: a reset now loses the client nothing.
                    return Ok(());
                }
                if left >= unacknowledged && Instant::now() < deadline {
                    return Err("the client stopped taking what was sent");
                }
                unacknowledged = left;
            }
        }
    }
}

/// Lends `io` to hyper: the [`HandBack`] hyper owns, and where `io` comes back when hyper drops
/// it, so the connection's task can still close it gracefully.
fn lend<T>(io: T) -> (HandBack<T>, oneshot::Receiver<T>) {
    let (tx, rx) = oneshot::channel();
    (
        HandBack {
            io: Some(io),
            back: Some(tx),
        },
        rx,
    )
}

/// A stream lent to hyper (see [`lend`]); reads and writes pass straight through.
struct HandBack<T> {
    /// `None` only inside `drop`.
    io: Option<T>,
    back: Option<oneshot::Sender<T>>,
}

impl<T> Drop for HandBack<T> {
    fn drop(&mut self) {
        if let (Some(io), Some(back)) = (self.io.take(), self.back.take()) {
            // The receiver gone (its task ended): the stream closes here, as it used to.
            let _ = back.send(io);
        }
    }
}

impl<T> HandBack<T> {
    fn io(&mut self) -> io::Result<std::pin::Pin<&mut T>>
    where
        T: Unpin,
    {
        match self.io.as_mut() {
            Some(io) => Ok(std::pin::Pin::new(io)),
            None => Err(io::Error::from(io::ErrorKind::NotConnected)),
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for HandBack<T> {
    fn poll_read(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> std::task::Poll<io::Result<()>> {
        match self.get_mut().io() {
            Ok(io) => io.poll_read(cx, buf),
            Err(e) => std::task::Poll::Ready(Err(e)),
        }
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for HandBack<T> {
    fn poll_write(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<io::Result<usize>> {
        match self.get_mut().io() {
            Ok(io) => io.poll_write(cx, buf),
            Err(e) => std::task::Poll::Ready(Err(e)),
        }
    }

    fn poll_write_vectored(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> std::task::Poll<io::Result<usize>> {
        match self.get_mut().io() {
            Ok(io) => io.poll_write_vectored(cx, bufs),
            Err(e) => std::task::Poll::Ready(Err(e)),
        }
    }

    fn is_write_vectored(&self) -> bool {
        self.io.as_ref().is_some_and(|io| io.is_write_vectored())
    }

    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<io::Result<()>> {
        match self.get_mut().io() {
            Ok(io) => io.poll_flush(cx),
            Err(e) => std::task::Poll::Ready(Err(e)),
        }
    }

    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<io::Result<()>> {
        match self.get_mut().io() {
            Ok(io) => io.poll_shutdown(cx),
            Err(e) => std::task::Poll::Ready(Err(e)),
        }
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

/// What a request over TCP needs of its connection.
struct Connection {
    router: Router,
    /// The connection's site, by its TLS server name.
    site: Option<usize>,
    stats: Arc<ServerStats>,
    alt_svc: Option<HeaderValue>,
    remote: SocketAddr,
}

/// Answers one request over TCP through the paths HTTP/3 takes (the router, then the files,
/// the built-ins or the proxy's `Upstream::exchange`), plus `alt-svc`.
async fn handle(conn: Connection, req: Request<Incoming>) -> Response<TcpBody> {
    let stats = &conn.stats;
    stats.requests_total.fetch_add(1, Ordering::Relaxed);
    let http1 = req.version() != http::Version::HTTP_2;
    let protocol = if http1 {
        stats.requests_h1.fetch_add(1, Ordering::Relaxed);
        "h1"
    } else {
        stats.requests_h2.fetch_add(1, Ordering::Relaxed);
        "h2"
    };
    let (mut parts, body) = req.into_parts();
    let choice = conn.router.choose(conn.site, &parts, http1);
    let site = choice.answering(conn.site);
    let logged = conn.router.begin_log(site, conn.remote, protocol, &parts);
    let target = conn.router.target(choice, &parts.method, &parts.uri);
    let mut resp = match target {
        Target::Proxy { upstream, path } => {
            let upstream = upstream.clone();
            if let Some(path) = path {
                parts.uri = with_path(&parts.uri, path);
            }
            let req = Request::from_parts(parts, body);
            proxy(&upstream, site, stats, conn.remote, req).await
        }
        Target::Local(local) => {
            respond(local, site, stats, &parts.method, &parts.headers, body).await
        }
    };
    if let Some(v) = conn.alt_svc {
        resp.headers_mut().insert(header::ALT_SVC, v);
    }
    match logged {
        None => resp,
        Some(logged) => {
            let status = resp.status();
            let length = resp
                .headers()
                .get(header::CONTENT_LENGTH)
                .and_then(|v| v.to_str().ok()?.parse().ok());
            resp.map(|inner| {
                LoggedBody {
                    inner,
                    logged: Some(logged),
                    status,
                    bytes: 0,
                    length,
                    ended: false,
                    failed: false,
                }
                .boxed_unsync()
            })
        }
    }
}

/// A response body that writes its request's access-log line when hyper is done with it
/// (sent whole, or given up with its connection), with the bytes that went out: `ok` once
/// hyper took its last frame, else cut. Its duration ends then: every byte handed to hyper to
/// write to the socket (README "Access log" says what that leaves out).
struct LoggedBody {
    inner: TcpBody,
    logged: Option<Logged>,
    status: StatusCode,
    bytes: u64,
    /// Its `content-length`, if it has one.
    length: Option<u64>,
    /// hyper took its end (or its last byte of `length`).
    ended: bool,
    /// It broke off with an error of its own (a file that could not be read).
    failed: bool,
}

impl hyper::body::Body for LoggedBody {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        let polled = std::pin::Pin::new(&mut self.inner).poll_frame(cx);
        match &polled {
            std::task::Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    self.bytes += data.len() as u64;
                }
                if self.length.is_some_and(|n| self.bytes >= n) {
                    self.ended = true;
                }
            }
            std::task::Poll::Ready(Some(Err(_))) => self.failed = true,
            std::task::Poll::Ready(None) => self.ended = true,
            std::task::Poll::Pending => {}
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
        let Some(logged) = self.logged.take() else {
            return;
        };
        let ending =
            if self.ended || (!self.failed && hyper::body::Body::is_end_stream(&self.inner)) {
                Ending::Ok
            } else if self.failed {
                Ending::CutError
            } else {
                // Dropped unfinished: its connection ended (the client's doing), or the worker
                // was told to cut (`Logged::end_as` says so then).
                Ending::CutClient
            };
        logged.end_as(Some(self.status), self.bytes, ending);
    }
}

/// Passes a request to the upstream: the proxy's one path, fed hyper's request body.
async fn proxy(
    upstream: &Arc<Upstream>,
    site: Option<usize>,
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
            stats.count_response(site, resp.status());
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
            stats.count_response(site, status);
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

/// Answers a request this worker answers itself, as HTTP/3 does.
async fn respond(
    local: Local<'_>,
    site: Option<usize>,
    stats: &Arc<ServerStats>,
    method: &Method,
    headers: &http::HeaderMap,
    body: Incoming,
) -> Response<TcpBody> {
    let reply = match local {
        Local::EchoLen => match count_body(body).await {
            Ok(n) => Reply::new(StatusCode::OK, "text/plain", Body::Text(format!("{n}\n"))),
            Err(_) => Reply::text(StatusCode::BAD_REQUEST, b"request body broke off\n"),
        },
        Local::Get(lookup) => lookup.reply(method, headers).await,
        Local::Reply(reply) => reply,
    };
    stats.count_response(site, reply.status);
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
pub(crate) fn body_of(body: Body, stats: Arc<ServerStats>) -> TcpBody {
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The server writes more than the client has read and closes; the client reads on and
    /// sends a byte after each read, as an HTTP/2 client sends WINDOW_UPDATE. Closed gracefully,
    /// the socket takes those bytes rather than answering them with a reset, so the client gets
    /// every byte and then the end of the stream.
    #[tokio::test]
    async fn a_graceful_close_delivers_everything_to_a_client_still_talking() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let mut client = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (mut server, _) = listener.accept().await.unwrap();
        // Far more than the socket buffers hold: the server's last write returns while much
        // of it is still on its way.
        let payload: Vec<u8> = (0..16u32 << 20).map(|i| (i % 251) as u8).collect();
        let sent = payload.clone();
        let server = tokio::spawn(async move {
            server.write_all(&sent).await.unwrap();
            close_gracefully(server).await
        });
        let mut got = Vec::with_capacity(payload.len());
        let mut buf = vec![0u8; 64 << 10];
        let end = loop {
            match client.read(&mut buf).await {
                Ok(0) => break Ok(()),
                Ok(n) => {
                    got.extend_from_slice(&buf[..n]);
                    if let Err(e) = client.write_all(b"w").await {
                        break Err(e);
                    }
                }
                Err(e) => break Err(e),
            }
        };
        assert!(
            got == payload,
            "{} of {} bytes, then {end:?}",
            got.len(),
            payload.len()
        );
        assert!(end.is_ok(), "{end:?}");
        drop(client);
        assert_eq!(server.await.unwrap(), Ok(()));
    }
}
