//! The reverse proxy of the built-in worker (`ringmux --upstream http://HOST:PORT`): every
//! request, over HTTP/3 or TCP, is passed to an HTTP service, the way nginx's `proxy_pass`
//! does: HTTP/1.1 or HTTP/2, in the clear or over TLS, as the upstream's URL says (`connect`
//! makes the client). [`Upstream::exchange`] is the one path of both transports: it takes an `http` request
//! whose body streams from the client and returns the upstream's response, whose body streams
//! back ([`UpstreamBody`]); the HTTP/3 front (`h3::proxy`) drives it on an h3 request stream,
//! the TCP front (`tcp`) hands it hyper's request and returns its response to hyper. This
//! module knows neither transport.
//!
//! * One [`Upstream`] per worker holds hyper's client and its pool of keep-alive connections
//!   (TCP_NODELAY), so requests reuse connections instead of opening one each; over HTTP/2,
//!   one connection carries them all.
//! * Bodies stream both ways: the request body is read from the client only as fast as the
//!   upstream connection takes it, and the response body goes out frame by frame; neither is
//!   held whole. Trailers pass in both directions where HTTP/1.1 allows: with chunked encoding,
//!   the fields the head declared in `trailer`, and towards the client only if the request
//!   said `te: trailers`.
//! * Hop-by-hop fields (RFC 9110 §7.6.1: `connection` and the fields it names, `keep-alive`,
//!   `proxy-connection`, `te` other than `trailers`, `transfer-encoding`, `upgrade`) are removed
//!   both ways. `host` is the client's `:authority` (or its `host` over HTTP/1.1). The client's
//!   own `forwarded` and `x-forwarded-*` fields are replaced, never trusted: `forwarded`
//!   (RFC 7239) names the client's address and port, `x-forwarded-for` its address,
//!   `x-forwarded-proto` is `https` and `x-forwarded-host` the authority. The address is the
//!   TCP peer, or the QUIC connection's current one, so it follows a migration. A request that
//!   arrived in 0-RTT carries `early-data: 1` (RFC 8470 §5.1).
//! * An upstream that refuses the connection, resets it or answers with something that is not
//!   HTTP gets the client a 502; no response head within the timeout a 504. A response body
//!   that breaks off, or stalls longer than the timeout between frames, resets the client's
//!   stream (its head is already out; over HTTP/1.1 the connection closes). Each is counted per
//!   [`ErrorKind`] and logged once when that kind of failure starts, not once per request.
//! * A client that resets its stream, or stops reading, ends the upstream exchange: the hyper
//!   request is dropped, which closes that upstream connection instead of returning it to the
//!   pool.
//! * Upgrades (WebSockets) are tunnels, the path of `tunnel` (`Upstream::tunnel` is what the
//!   TCP front calls for a request that asks for one); `upgrade` is hop-by-hop everywhere else.

use std::error::Error as StdError;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderName};
use http::uri::{Authority, PathAndQuery};
use http::{HeaderMap, HeaderValue, Method, Request, Response, StatusCode, Uri};
use http_body::{Body as _, Frame};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Empty};
pub use ringmux_proto::route::UpstreamTls;
pub use ringmux_proto::UpstreamUrl;
use tracing::{debug, info, warn};

pub mod health;
pub mod pool;
mod tunnel;
pub(crate) use tunnel::{Ask, ClientSide, Opened, TunnelCounters};
pub use tunnel::{TunnelDrain, TunnelEnd, TunnelOptions};

/// Default for [`Upstream::new`]'s `timeout` (nginx's `proxy_read_timeout` is the same).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

mod connect;

pub use connect::ConnectError;

pub(crate) type BoxError = Box<dyn StdError + Send + Sync>;

/// The body of a request to the upstream.
pub type ProxyBody = UnsyncBoxBody<Bytes, BoxError>;

/// Why the upstream could not be used, for `ringmux_worker_upstream_errors_total{kind}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// The TCP connection could not be made (refused, unreachable, name not found). 502.
    Connect,
    /// The connection closed or reset before the response was complete. 502, or a stream reset
    /// when the response head was already sent.
    Reset,
    /// No response head within the timeout, or a body that stalled longer than it. 504, or a
    /// stream reset when the response head was already sent.
    Timeout,
    /// The upstream answered with something that is not a usable HTTP/1.1 response. 502.
    Protocol,
    /// The TLS handshake with the upstream failed (an unknown CA, a certificate for another
    /// name, …). 502, saying why.
    Tls,
}

impl ErrorKind {
    /// Every kind, in the order of [`Upstream::errors`].
    pub const ALL: [ErrorKind; 5] = [
        ErrorKind::Connect,
        ErrorKind::Reset,
        ErrorKind::Timeout,
        ErrorKind::Protocol,
        ErrorKind::Tls,
    ];

    /// The metric labels, in [`ErrorKind::ALL`] order.
    pub const LABELS: [&'static str; Self::ALL.len()] =
        ["connect", "reset", "timeout", "protocol", "tls"];

    /// The metric label.
    pub fn as_str(self) -> &'static str {
        Self::LABELS[self as usize]
    }

    pub(crate) fn status(self) -> StatusCode {
        match self {
            ErrorKind::Timeout => StatusCode::GATEWAY_TIMEOUT,
            _ => StatusCode::BAD_GATEWAY,
        }
    }

    pub(crate) fn body(self) -> &'static [u8] {
        match self {
            ErrorKind::Connect => b"upstream refused the connection\n",
            ErrorKind::Reset => b"upstream closed the connection\n",
            ErrorKind::Timeout => b"upstream did not answer in time\n",
            ErrorKind::Protocol => b"upstream sent an invalid response\n",
            ErrorKind::Tls => b"upstream TLS: the handshake with the upstream failed\n",
        }
    }
}

/// One worker's connection to the upstream: the client with its pool, the timeout, and the
/// error counters.
pub struct Upstream {
    authority: Authority,
    timeout: Duration,
    client: connect::Backend,
    errors: [AtomicU64; ErrorKind::ALL.len()],
    /// Per kind: a failure of that kind was logged and no request has succeeded since.
    failing: [AtomicBool; ErrorKind::ALL.len()],
}

impl std::fmt::Debug for Upstream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Upstream")
            .field("authority", &self.authority)
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

/// What [`Upstream::exchange`] came to, whatever the transport.
pub enum Exchange {
    /// The upstream answered: send this head, then its body (frames as they come, then the
    /// trailers). The body fails with an [`UpstreamError`] (already counted) if the upstream
    /// breaks off or stalls: the transport must then reset the client's stream, not end it.
    Response(Response<UpstreamBody>),
    /// Answer with this short `text/plain` reply of ours (400, 501, 502, 504).
    Reply(StatusCode, &'static [u8]),
    /// The client went away (or reset its stream) before its request was sent upstream.
    ClientGone,
}

/// The client's side of an exchange failed (reset its stream, went away): not the upstream's
/// fault, and not counted as an upstream error. A request body passed to [`Upstream::exchange`]
/// ends with this error when the client breaks it off.
#[derive(Debug, thiserror::Error)]
#[error("client: {0}")]
pub struct ClientGone(pub BoxError);

/// The upstream failed after its response head was sent: counted in [`Upstream::errors`].
#[derive(Debug, thiserror::Error)]
#[error("upstream {}: {message}", kind.as_str())]
pub struct UpstreamError {
    pub kind: ErrorKind,
    message: String,
}

impl Upstream {
    /// A client for `url`, verified as `tls` says over TLS. Every request waits at most
    /// `timeout` for the response head, and at most `timeout` between two frames of the
    /// response body. Needs a tokio runtime only when requests are made.
    pub fn new(
        url: &UpstreamUrl,
        tls: &UpstreamTls,
        timeout: Duration,
    ) -> Result<Upstream, ConnectError> {
        Ok(Upstream {
            authority: url.authority.clone(),
            timeout,
            client: connect::Backend::new(url, tls, timeout)?,
            errors: Default::default(),
            failing: Default::default(),
        })
    }

    /// The upstream's `HOST:PORT`.
    pub fn authority(&self) -> &Authority {
        &self.authority
    }

    /// Errors so far, per kind in [`ErrorKind::ALL`] order.
    pub fn errors(&self) -> [u64; ErrorKind::ALL.len()] {
        std::array::from_fn(|i| self.errors[i].load(Ordering::Relaxed))
    }

    /// Passes one request to the upstream: the one path of both transports. `remote` is the
    /// client's address (its current one over QUIC, the TCP peer over TCP), `early` whether the
    /// request arrived in 0-RTT. The request's body must end with a [`ClientGone`] error when
    /// the client breaks it off, and be known empty (`is_end_stream`) when it is, or hyper
    /// would announce a chunked body for a GET.
    pub async fn exchange(
        self: &Arc<Self>,
        request: Request<ProxyBody>,
        remote: SocketAddr,
        early: bool,
    ) -> Exchange {
        match self.attempt(request, remote, early).await {
            Ok(exchange) => exchange,
            Err(kind) => Exchange::Reply(kind.status(), kind.body()),
        }
    }

    /// [`Upstream::exchange`], but a failure of the upstream (counted already) is returned as
    /// its kind, for [`pool::Pool`] to decide whether another backend may take the request.
    pub(crate) async fn attempt(
        self: &Arc<Self>,
        request: Request<ProxyBody>,
        remote: SocketAddr,
        early: bool,
    ) -> Result<Exchange, ErrorKind> {
        if request.method() == Method::CONNECT {
            // No tunnels: the upstream speaks plain HTTP/1.1 requests only.
            return Ok(Exchange::Reply(
                StatusCode::NOT_IMPLEMENTED,
                b"CONNECT is not supported\n",
            ));
        }
        let request = self.upstream_request(request, remote, early);
        let response = match tokio::time::timeout(self.timeout, self.client.request(request)).await
        {
            Err(_) => return Err(self.fail(ErrorKind::Timeout, &"no response head")),
            Ok(Err(e)) => {
                if let Some(gone) = find::<ClientGone>(&e) {
                    debug!(error = %gone, "client went away while its request body was sent upstream");
                    return Ok(Exchange::ClientGone);
                }
                if find::<hyper::Error>(&e).is_some_and(|h| h.is_user()) {
                    // Our side of the exchange: a request body shorter or longer than the
                    // client's own content-length, say. Not the upstream's failure.
                    debug!(error = %e, "request refused by the HTTP/1.1 client");
                    return Ok(Exchange::Reply(
                        StatusCode::BAD_REQUEST,
                        b"bad request body\n",
                    ));
                }
                if let Some(why) = connect::tls_refusal(&e) {
                    // Answered with its reason rather than retried on another backend: a
                    // certificate the route's settings refuse is the operator's to fix.
                    // Logged with its sources: hyper's own line is only "client error (Connect)".
                    self.count(ErrorKind::Tls, &ringmux_proto::one_line(&e));
                    return Ok(Exchange::Reply(StatusCode::BAD_GATEWAY, why));
                }
                return Err(self.fail(classify(&e), &e));
            }
            Ok(Ok(r)) => r,
        };
        if response.status().is_informational() {
            // hyper consumes 100 Continue itself; anything else (101) needs an upgrade we never
            // asked for (the upgrades asked for take `tunnel`'s path).
            let e = format!("status {} as the final response", response.status());
            return Err(self.fail(ErrorKind::Protocol, &e));
        }
        self.recovered();
        Ok(self.response(response))
    }

    /// The upstream's final `response` as the client gets it.
    fn response(self: &Arc<Self>, response: Response<hyper::body::Incoming>) -> Exchange {
        let (mut parts, body) = response.into_parts();
        strip_hop_by_hop(&mut parts.headers);
        let body = UpstreamBody {
            inner: body,
            upstream: self.clone(),
            stall: Box::pin(tokio::time::sleep(self.timeout)),
            done: false,
            guard: None,
        };
        Exchange::Response(Response::from_parts(parts, body))
    }

    /// The HTTP/1.1 request for the client's `request`.
    fn upstream_request(
        &self,
        request: Request<ProxyBody>,
        remote: SocketAddr,
        early: bool,
    ) -> Request<ProxyBody> {
        let (mut parts, body) = request.into_parts();
        let authority = crate::request::authority_of(&parts).map(str::to_owned);
        let path = parts
            .uri
            .path_and_query()
            .cloned()
            .unwrap_or_else(|| PathAndQuery::from_static("/"));
        let mut uri = http::uri::Parts::default();
        uri.scheme = Some(self.client.uri_scheme());
        uri.authority = Some(self.authority.clone());
        uri.path_and_query = Some(path);
        // Scheme, authority and path were each parsed already, so the URI is valid; the
        // fallback only keeps this free of panics.
        parts.uri = Uri::from_parts(uri).unwrap_or_else(|_| Uri::from_static("/"));
        parts.version = self.client.version();
        let h = &mut parts.headers;
        strip_hop_by_hop(h);
        for name in [
            "forwarded",
            "x-forwarded-for",
            "x-forwarded-proto",
            "x-forwarded-host",
            "early-data",
        ] {
            h.remove(name);
        }
        // `expect: 100-continue` would make hyper wait for a 100 the client cannot use here.
        h.remove(header::EXPECT);
        add_forwarded(h, remote, authority.as_deref());
        if parts.version == http::Version::HTTP_2 {
            // `:authority` is the upstream URL's, and a `host` that differs from it may be
            // refused as malformed (RFC 9113 §8.3.1): the client's is in `x-forwarded-host`.
            h.remove(header::HOST);
        }
        if early {
            h.insert("early-data", HeaderValue::from_static("1"));
        }
        let length: Option<u64> = h
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse().ok());
        let body = if length == Some(0) || body.is_end_stream() {
            empty_body()
        } else {
            body.map_frame(|frame| match frame.into_trailers() {
                Ok(mut trailers) => {
                    strip_hop_by_hop(&mut trailers);
                    Frame::trailers(trailers)
                }
                Err(frame) => frame,
            })
            .boxed_unsync()
        };
        Request::from_parts(parts, body)
    }

    /// Counts a failure of `kind`.
    fn fail(&self, kind: ErrorKind, e: &dyn std::fmt::Display) -> ErrorKind {
        self.count(kind, e);
        kind
    }

    /// [`Upstream::fail`], answered to the client at once (a tunnel is never retried).
    fn fail_reply(&self, kind: ErrorKind, e: &dyn std::fmt::Display) -> Exchange {
        let kind = self.fail(kind, e);
        Exchange::Reply(kind.status(), kind.body())
    }

    fn count(&self, kind: ErrorKind, e: &dyn std::fmt::Display) {
        let i = kind as usize;
        self.errors[i].fetch_add(1, Ordering::Relaxed);
        if !self.failing[i].swap(true, Ordering::Relaxed) {
            warn!(
                upstream = %self.authority,
                kind = kind.as_str(),
                error = %e,
                "upstream failing; further failures of this kind are counted in \
                 ringmux_worker_upstream_errors_total, not logged, until a request succeeds"
            );
        }
    }

    fn recovered(&self) {
        let mut was = false;
        for f in &self.failing {
            // Loads first: the common case (nothing failing) writes no shared line.
            if f.load(Ordering::Relaxed) {
                was |= f.swap(false, Ordering::Relaxed);
            }
        }
        if was {
            info!(upstream = %self.authority, "upstream answering again");
        }
    }
}

/// The upstream's response body as the client gets it: its frames as they come, trailers
/// without hop-by-hop fields. A body that breaks off, or stalls longer than the upstream
/// timeout between two frames, ends with an [`UpstreamError`], counted once.
pub struct UpstreamBody {
    inner: hyper::body::Incoming,
    upstream: Arc<Upstream>,
    stall: Pin<Box<tokio::time::Sleep>>,
    done: bool,
    /// Kept until the body ends, then dropped: the pool's count of the request in flight at
    /// its backend.
    pub(crate) guard: Option<Box<dyn std::any::Any + Send + Sync>>,
}

impl UpstreamBody {
    fn failed(&mut self, kind: ErrorKind, message: String) -> UpstreamError {
        self.done = true;
        self.guard = None;
        self.upstream.count(kind, &message);
        UpstreamError { kind, message }
    }
}

impl http_body::Body for UpstreamBody {
    type Data = Bytes;
    type Error = UpstreamError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, UpstreamError>>> {
        let this = self.get_mut();
        if this.done {
            return Poll::Ready(None);
        }
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(None) => {
                this.done = true;
                this.guard = None;
                Poll::Ready(None)
            }
            Poll::Ready(Some(Err(e))) => {
                let kind = if e.is_parse() {
                    ErrorKind::Protocol
                } else {
                    ErrorKind::Reset
                };
                Poll::Ready(Some(Err(this.failed(kind, e.to_string()))))
            }
            Poll::Ready(Some(Ok(frame))) => {
                let deadline = tokio::time::Instant::now() + this.upstream.timeout;
                this.stall.as_mut().reset(deadline);
                match frame.into_trailers() {
                    Ok(mut trailers) => {
                        strip_hop_by_hop(&mut trailers);
                        Poll::Ready(Some(Ok(Frame::trailers(trailers))))
                    }
                    Err(frame) => Poll::Ready(Some(Ok(frame))),
                }
            }
            Poll::Pending => match this.stall.as_mut().poll(cx) {
                Poll::Ready(()) => {
                    let e = this.failed(ErrorKind::Timeout, "response body stalled".into());
                    Poll::Ready(Some(Err(e)))
                }
                Poll::Pending => Poll::Pending,
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// An empty request body.
pub(crate) fn empty_body() -> ProxyBody {
    Empty::new().map_err(|never| match never {}).boxed_unsync()
}

/// Removes the hop-by-hop fields (RFC 9110 §7.6.1), including those `connection` names.
fn strip_hop_by_hop(h: &mut HeaderMap) {
    let named: Vec<HeaderName> = h
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|n| HeaderName::from_bytes(n.trim().as_bytes()).ok())
        .collect();
    for n in named {
        h.remove(n);
    }
    for n in [
        header::CONNECTION,
        header::TRANSFER_ENCODING,
        header::UPGRADE,
        header::PROXY_AUTHENTICATE,
        header::PROXY_AUTHORIZATION,
    ] {
        h.remove(n);
    }
    h.remove("keep-alive");
    h.remove("proxy-connection");
    // `te: trailers` is end-to-end in meaning (the client accepts trailers); any other value
    // describes this hop only.
    let trailers_ok = h
        .get(header::TE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| {
            v.split(',')
                .any(|t| t.trim().eq_ignore_ascii_case("trailers"))
        });
    h.remove(header::TE);
    if trailers_ok {
        h.insert(header::TE, HeaderValue::from_static("trailers"));
    }
}

/// Adds `forwarded`, `x-forwarded-for`, `-proto` and `-host` for a client at `remote` that asked
/// for `authority`.
fn add_forwarded(h: &mut HeaderMap, remote: SocketAddr, authority: Option<&str>) {
    let ip = remote.ip().to_canonical();
    // RFC 7239 §6: an IPv6 node is bracketed, and a node with a port is a quoted string.
    let node = match ip {
        std::net::IpAddr::V4(v4) => format!("\"{v4}:{}\"", remote.port()),
        std::net::IpAddr::V6(v6) => format!("\"[{v6}]:{}\"", remote.port()),
    };
    let mut forwarded = format!("for={node};proto=https");
    if let Some(a) = authority.filter(|a| a.bytes().all(|b| b.is_ascii_graphic())) {
        forwarded.push_str(&format!(";host=\"{}\"", a.replace(['"', '\\'], "")));
        if let Ok(v) = HeaderValue::from_str(a) {
            h.insert("x-forwarded-host", v.clone());
            h.insert(header::HOST, v);
        }
    }
    // Addresses and visible ASCII only: these always make valid field values.
    if let Ok(v) = HeaderValue::from_str(&forwarded) {
        h.insert("forwarded", v);
    }
    if let Ok(v) = HeaderValue::from_str(&ip.to_string()) {
        h.insert("x-forwarded-for", v);
    }
    h.insert("x-forwarded-proto", HeaderValue::from_static("https"));
}

/// Which [`ErrorKind`] a failed hyper request is.
fn classify(e: &hyper_util::client::legacy::Error) -> ErrorKind {
    if e.is_connect() {
        return ErrorKind::Connect;
    }
    match find::<hyper::Error>(e) {
        Some(h) if h.is_parse() || h.is_parse_status() => ErrorKind::Protocol,
        Some(h) if h.is_timeout() => ErrorKind::Timeout,
        _ => ErrorKind::Reset,
    }
}

/// The first error of type `T` in `e`'s source chain (`e` included).
fn find<'a, T: StdError + 'static>(e: &'a (dyn StdError + 'static)) -> Option<&'a T> {
    let mut cur: Option<&(dyn StdError + 'static)> = Some(e);
    while let Some(err) = cur {
        if let Some(t) = err.downcast_ref::<T>() {
            return Some(t);
        }
        cur = err.source();
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hop_by_hop_fields_go_and_te_trailers_stays() {
        let mut h = HeaderMap::new();
        h.insert(header::CONNECTION, HeaderValue::from_static("close, x-hop"));
        h.insert("x-hop", HeaderValue::from_static("1"));
        h.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        h.insert(
            header::TRANSFER_ENCODING,
            HeaderValue::from_static("chunked"),
        );
        h.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
        h.insert(header::TE, HeaderValue::from_static("gzip, trailers"));
        h.insert("x-end-to-end", HeaderValue::from_static("kept"));
        strip_hop_by_hop(&mut h);
        let mut names: Vec<&str> = h.keys().map(|k| k.as_str()).collect();
        names.sort();
        assert_eq!(names, ["te", "x-end-to-end"]);
        assert_eq!(h[header::TE], "trailers");

        let mut h = HeaderMap::new();
        h.insert(header::TE, HeaderValue::from_static("gzip"));
        strip_hop_by_hop(&mut h);
        assert!(h.is_empty());
    }

    #[test]
    fn forwarded_fields_name_the_client() {
        let mut h = HeaderMap::new();
        add_forwarded(
            &mut h,
            "192.0.2.7:4711".parse().unwrap(),
            Some("example.com"),
        );
        assert_eq!(
            h["forwarded"],
            "for=\"192.0.2.7:4711\";proto=https;host=\"example.com\""
        );
        assert_eq!(h["x-forwarded-for"], "192.0.2.7");
        assert_eq!(h["x-forwarded-proto"], "https");
        assert_eq!(h["x-forwarded-host"], "example.com");
        assert_eq!(h[header::HOST], "example.com");

        let mut h = HeaderMap::new();
        add_forwarded(&mut h, "[::ffff:192.0.2.7]:9".parse().unwrap(), None);
        assert_eq!(h["forwarded"], "for=\"192.0.2.7:9\";proto=https");
        let mut h = HeaderMap::new();
        add_forwarded(&mut h, "[2001:db8::1]:443".parse().unwrap(), None);
        assert_eq!(h["forwarded"], "for=\"[2001:db8::1]:443\";proto=https");
        assert_eq!(h["x-forwarded-for"], "2001:db8::1");
        assert!(!h.contains_key(header::HOST));
    }
}
