//! One TCP connection, from its PROXY header (a listed balancer's, `proxy_protocol.rs`) and
//! its TLS handshake (ACME's TLS-ALPN-01 and unknown names answered there) to its graceful
//! close: hyper serves it over HTTP/1.1 or HTTP/2 as ALPN chose, and
//! it is asked to finish when the worker drains, its listener needs its room, or it stays idle
//! (`Conn::drive`); what ended it with bad input is counted by [`TcpErrorKind`].

use std::io;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use ringmux_proto::message::ACME_TLS_ALPN;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio::sync::{oneshot, watch};
use tokio::time::Instant;
use tracing::debug;

use super::answer::{handle, Connection};
use super::body::tracked;
use super::close::{close_gracefully, lend, Transport};
use super::proxy_protocol::client_of;
use super::registry::{Tracked, CLOSING, OPEN};
use super::{Kind, TcpErrorKind, TcpOptions};
use crate::sites::Router;
use crate::stats::ServerStats;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

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
pub(super) struct Conn {
    pub(super) kind: Kind,
    pub(super) router: Router,
    pub(super) stats: Arc<ServerStats>,
    pub(super) shutdown: watch::Receiver<bool>,
    pub(super) opts: Arc<TcpOptions>,
    /// What the listener sees of this connection.
    pub(super) tracked: Arc<Tracked>,
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

    pub(super) async fn run(mut self, mut stream: TcpStream, peer: SocketAddr) {
        let _ = stream.set_nodelay(true);
        // Behind a listed balancer, the client it names is the remote from here on.
        let Some(remote) = client_of(&mut stream, peer, &self.opts, &self.stats).await else {
            return;
        };
        let acceptor = match &self.kind {
            Kind::Https(acceptor) => acceptor.clone(),
            Kind::Plain { answer, .. } => {
                let answer = answer.clone();
                let tracked_conn = self.tracked.clone();
                let stats = self.stats.clone();
                let service = hyper::service::service_fn(move |req| {
                    let answered = answer(remote, req);
                    tracked(
                        tracked_conn.begin(&stats),
                        async move { (answered.await, None) },
                    )
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
        let sni: Option<Arc<str>> = tls.get_ref().1.server_name().map(Arc::from);
        let site = self.router.connection_site(sni.as_deref());
        let router = self.router.clone();
        let stats = self.stats.clone();
        let alt_svc = self.opts.alt_svc.clone();
        let tracked_conn = self.tracked.clone();
        let tunnels = self.opts.tunnels.clone();
        let service = hyper::service::service_fn(move |req| {
            let conn = Connection {
                router: router.clone(),
                site,
                sni: sni.clone(),
                stats: stats.clone(),
                alt_svc: alt_svc.clone(),
                remote,
                tracked: tracked_conn.clone(),
                tunnels: tunnels.clone(),
            };
            let in_flight = tracked_conn.begin(&stats);
            tracked(in_flight, handle(conn, req))
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
                // RFC 8441 §3: WebSockets over HTTP/2 (the proxy's tunnels).
                .enable_connect_protocol()
                .serve_connection(io, service);
            self.drive(remote, conn, Some(self.opts.idle_timeout)).await;
        } else {
            // An upgraded connection is the tunnel's from then on: it never comes back to be
            // closed here.
            let conn = self.http1().serve_connection(io, service).with_upgrades();
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
    /// request in flight for [`GOAWAY_WAIT`](super::registry::GOAWAY_WAIT) since. `conn` is
    /// dropped on return, and with it the stream it was lent.
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

impl<I, S, B> Graceful for hyper::server::conn::http1::UpgradeableConnection<I, S>
where
    S: hyper::service::HttpService<Incoming, ResBody = B>,
    S::Error: Into<BoxError>,
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
    B: hyper::body::Body + 'static,
    B::Error: Into<BoxError>,
{
    fn graceful_shutdown(self: std::pin::Pin<&mut Self>) {
        hyper::server::conn::http1::UpgradeableConnection::graceful_shutdown(self)
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
