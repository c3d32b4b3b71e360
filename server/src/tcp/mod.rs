//! HTTPS over TCP beside HTTP/3: the built-in server's second transport. Browsers open QUIC only
//! to an origin that told them over TCP (an `alt-svc` field, RFC 7838; RFC 9114 §3.1.1), and
//! fall back to TCP where UDP is blocked, so the same site answers on both: the request is
//! routed by [`Router`], the one path HTTP/3 takes too (a connection's site is the one its TLS
//! server name chooses; a request for another site's host is answered 421), and every TCP
//! response carries the `alt-svc` value ringmux was given.
//!
//! TLS 1.3 and 1.2 with ringmux's certificate (tokio-rustls), ALPN `h2` and `http/1.1`, served
//! by hyper (HTTP/1.1 or HTTP/2, as ALPN chose; HTTP/1.1 without ALPN). HTTP/1.1 upgrades
//! and HTTP/2's extended CONNECT (`SETTINGS_ENABLE_CONNECT_PROTOCOL`, RFC 8441 §3) carry the
//! proxy's tunnels (WebSockets); a tunnel outlives its HTTP/1.1 connection's task, and holds
//! its HTTP/2 connection busy while it lives.
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
//!
//! Behind a balancer that hides the client's address, [`TcpOptions::proxy_protocol_from`]
//! names the balancer's addresses, whose connections begin with a PROXY protocol header
//! (versions 1 and 2): the address it gives is the client's for everything after
//! (`proxy_protocol.rs`).
//!
//! The module by concern: `accept.rs` (the accept loop and the cap), `registry.rs` (each
//! connection as its listener sees it: idle or busy, eviction), `conn.rs` (one connection:
//! PROXY header, handshake, serving, being asked to finish), `proxy_protocol.rs` (the PROXY
//! header), `answer.rs` (one request), `body.rs` (the
//! response body hyper sends: one tracked type), `close.rs` (the graceful close) and `sys.rs`
//! (its one system call, the only unsafe code of the crate).
//!
//! [`Router`]: crate::sites::Router
//! [`ServerStats::tcp_errors`]: crate::stats::ServerStats::tcp_errors

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::future::BoxFuture;
use http::{HeaderValue, Request, Response};
use http_body_util::combinators::UnsyncBoxBody;
use hyper::body::Incoming;
use ringmux_proto::limits::Cidr;
use ringmux_worker::AcmeAnswers;

pub use crate::stats::TcpErrorKind;
pub(crate) use body::body_of;

mod accept;
mod answer;
mod body;
mod close;
mod conn;
mod proxy_protocol;
mod registry;
#[allow(unsafe_code)]
mod sys;

pub use accept::serve;
pub(crate) use accept::serve_plain;

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
    /// The worker's tunnels through the proxy (WebSockets, HTTP/1.1 upgrades): their cap and
    /// idle timeout, shared by its listeners (`crate::proxy::TunnelOptions`).
    pub tunnels: Arc<crate::proxy::TunnelOptions>,
    /// The sources whose connections begin with a PROXY protocol header (`proxy_protocol.rs`:
    /// a balancer's), whose client address then stands for the peer's; empty by default (no
    /// connection's bytes are read as a header).
    pub proxy_protocol_from: Vec<Cidr>,
    /// Longest a listed source's PROXY header may take to arrive whole.
    pub proxy_header_timeout: Duration,
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
            tunnels: Arc::default(),
            proxy_protocol_from: Vec::new(),
            proxy_header_timeout: Duration::from_secs(5),
        }
    }
}

/// A response body over TCP.
pub(crate) type TcpBody = UnsyncBoxBody<Bytes, io::Error>;

/// What answers each request of a plain-HTTP/1.1 listener ([`serve_plain`]), given the client's
/// address.
pub(crate) type PlainAnswer = Arc<
    dyn Fn(SocketAddr, Request<Incoming>) -> BoxFuture<'static, Response<TcpBody>> + Send + Sync,
>;

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
