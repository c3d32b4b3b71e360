//! The reverse proxy of the built-in worker (`ringmux --upstream http://HOST:PORT`): every
//! HTTP/3 request is passed to an HTTP/1.1 service, the way nginx's `proxy_pass` does.
//!
//! * One [`Upstream`] per worker holds hyper's client and its pool of keep-alive connections
//!   (TCP_NODELAY), so requests reuse connections instead of opening one each.
//! * Bodies stream both ways: the request body is read from the QUIC stream only as fast as the
//!   upstream connection takes it, and the response body goes out frame by frame; neither is
//!   held whole. Trailers pass in both directions where HTTP/1.1 allows: with chunked encoding,
//!   the fields the head declared in `trailer`, and towards the client only if the request
//!   said `te: trailers`.
//! * Hop-by-hop fields (RFC 9110 §7.6.1: `connection` and the fields it names, `keep-alive`,
//!   `proxy-connection`, `te` other than `trailers`, `transfer-encoding`, `upgrade`) are removed
//!   both ways. `host` is the client's `:authority`. The client's own `forwarded` and
//!   `x-forwarded-*` fields are replaced, never trusted: `forwarded` (RFC 7239) names the client's
//!   address and port, `x-forwarded-for` its address, `x-forwarded-proto` is `https` and
//!   `x-forwarded-host` the authority. The address is the connection's current one, so it follows
//!   a migration. A request that arrived in 0-RTT carries `early-data: 1` (RFC 8470 §5.1).
//! * An upstream that refuses the connection, resets it or answers with something that is not
//!   HTTP gets the client a 502; no response head within the timeout a 504. A response body
//!   that breaks off, or stalls longer than the timeout between frames, resets the client's
//!   stream (its head is already out). Each is counted per [`ErrorKind`] and logged once when
//!   that kind of failure starts, not once per request.
//! * A client that resets its stream, or stops reading, ends the upstream exchange: the hyper
//!   request is dropped, which closes that upstream connection instead of returning it to the
//!   pool.

use std::error::Error as StdError;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use bytes::{Buf, Bytes};
use h3::error::Code;
use h3::server::RequestStream;
use http::header::{self, HeaderName};
use http::uri::{Authority, PathAndQuery, Scheme};
use http::{HeaderMap, HeaderValue, Method, Request, Response, StatusCode, Uri};
use http_body::Frame;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Empty, StreamBody};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
pub use ringmux_proto::UpstreamUrl;
use tracing::{debug, info, warn};

/// Default for [`Upstream::new`]'s `timeout` (nginx's `proxy_read_timeout` is the same).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

/// Idle upstream connections kept per worker; more are closed when they go idle.
const POOL_IDLE_MAX: usize = 256;

/// How long an idle upstream connection is kept.
const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(60);

type BoxError = Box<dyn StdError + Send + Sync>;

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
}

impl ErrorKind {
    /// Every kind, in the order of [`Upstream::errors`].
    pub const ALL: [ErrorKind; 4] = [
        ErrorKind::Connect,
        ErrorKind::Reset,
        ErrorKind::Timeout,
        ErrorKind::Protocol,
    ];

    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::Connect => "connect",
            ErrorKind::Reset => "reset",
            ErrorKind::Timeout => "timeout",
            ErrorKind::Protocol => "protocol",
        }
    }

    fn status(self) -> StatusCode {
        match self {
            ErrorKind::Timeout => StatusCode::GATEWAY_TIMEOUT,
            _ => StatusCode::BAD_GATEWAY,
        }
    }

    fn body(self) -> &'static [u8] {
        match self {
            ErrorKind::Connect => b"upstream refused the connection\n",
            ErrorKind::Reset => b"upstream closed the connection\n",
            ErrorKind::Timeout => b"upstream did not answer in time\n",
            ErrorKind::Protocol => b"upstream sent an invalid response\n",
        }
    }
}

/// One worker's connection to the upstream: the client with its pool, the timeout, and the
/// error counters.
pub struct Upstream {
    authority: Authority,
    timeout: Duration,
    client: Client<HttpConnector, ProxyBody>,
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

/// How a proxied request ended, for the caller's counters.
#[derive(Debug)]
pub enum Outcome {
    /// The upstream's response (or our 502/504) went out whole, with this status.
    Answered(StatusCode),
    /// The exchange broke off: the client went away, or the upstream failed mid-body.
    Failed,
}

/// The request stream of the h3 server over quinn.
type Stream = RequestStream<h3_quinn::BidiStream<Bytes>, Bytes>;
type RecvHalf = RequestStream<h3_quinn::RecvStream, Bytes>;
type SendHalf = RequestStream<h3_quinn::SendStream<Bytes>, Bytes>;

/// The client's side of an exchange failed (reset its stream, went away): not the upstream's
/// fault, and not counted as an upstream error.
#[derive(Debug, thiserror::Error)]
#[error("client stream: {0}")]
struct ClientGone(h3::error::StreamError);

impl Upstream {
    /// A client for `url`. Every request waits at most `timeout` for the response head, and at
    /// most `timeout` between two frames of the response body. Needs a tokio runtime only when
    /// requests are made.
    pub fn new(url: &UpstreamUrl, timeout: Duration) -> Upstream {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(timeout));
        let client = Client::builder(TokioExecutor::new())
            .pool_max_idle_per_host(POOL_IDLE_MAX)
            .pool_idle_timeout(POOL_IDLE_TIMEOUT)
            .build(connector);
        Upstream {
            authority: url.authority.clone(),
            timeout,
            client,
            errors: Default::default(),
            failing: Default::default(),
        }
    }

    /// The upstream's `HOST:PORT`.
    pub fn authority(&self) -> &Authority {
        &self.authority
    }

    /// Errors so far, per kind in [`ErrorKind::ALL`] order.
    pub fn errors(&self) -> [u64; ErrorKind::ALL.len()] {
        std::array::from_fn(|i| self.errors[i].load(Ordering::Relaxed))
    }

    /// Passes one request to the upstream and its response back. `remote` is the client's
    /// current address, `early` whether the request arrived in 0-RTT. Counts `bytes_sent`
    /// (response body bytes handed to QUIC) into `sent`.
    pub async fn proxy(
        &self,
        request: Request<()>,
        stream: Stream,
        remote: SocketAddr,
        early: bool,
        sent: &AtomicU64,
    ) -> Outcome {
        let method = request.method().clone();
        let (mut tx, rx) = stream.split();
        if method == Method::CONNECT {
            // No tunnels: the upstream speaks plain HTTP/1.1 requests only.
            return reply(
                &mut tx,
                StatusCode::NOT_IMPLEMENTED,
                b"CONNECT is not supported\n",
            )
            .await;
        }
        let upstream_req = match self.upstream_request(request, rx, remote, early).await {
            Ok(r) => r,
            Err(e) => {
                debug!(error = %e, "client went away before its request was sent upstream");
                return Outcome::Failed;
            }
        };
        let response = match tokio::time::timeout(self.timeout, self.client.request(upstream_req))
            .await
        {
            Err(_) => {
                return self
                    .fail(&mut tx, ErrorKind::Timeout, &"no response head")
                    .await
            }
            Ok(Err(e)) => {
                if let Some(gone) = find::<ClientGone>(&e) {
                    debug!(error = %gone, "client went away while its request body was sent upstream");
                    tx.stop_stream(Code::H3_REQUEST_CANCELLED);
                    return Outcome::Failed;
                }
                if find::<hyper::Error>(&e).is_some_and(|h| h.is_user()) {
                    // Our side of the exchange: a request body shorter or longer than the
                    // client's own content-length, say. Not the upstream's failure.
                    debug!(error = %e, "request refused by the HTTP/1.1 client");
                    return reply(&mut tx, StatusCode::BAD_REQUEST, b"bad request body\n").await;
                }
                let kind = classify(&e);
                return self.fail(&mut tx, kind, &e).await;
            }
            Ok(Ok(r)) => r,
        };
        if response.status().is_informational() {
            // hyper consumes 100 Continue itself; anything else (101) needs an upgrade we never
            // asked for.
            let e = format!("status {} as the final response", response.status());
            return self.fail(&mut tx, ErrorKind::Protocol, &e).await;
        }
        self.recovered();
        let (mut parts, body) = response.into_parts();
        strip_hop_by_hop(&mut parts.headers);
        let status = parts.status;
        let head = Response::from_parts(parts, ());
        if let Err(e) = tx.send_response(head).await {
            debug!(error = %e, "client went away before the response head");
            return Outcome::Failed;
        }
        if method == Method::HEAD {
            return finish(&mut tx, status).await;
        }
        match self.stream_body(&mut tx, body, sent).await {
            Ok(()) => finish(&mut tx, status).await,
            Err(BodyError::Client(e)) => {
                debug!(error = %e, "client went away during the response body");
                Outcome::Failed
            }
            Err(BodyError::Upstream(kind, e)) => {
                self.count(kind, &e);
                // The head is out: a reset, not a short body that looks complete.
                tx.stop_stream(Code::H3_INTERNAL_ERROR);
                Outcome::Failed
            }
        }
    }

    /// The HTTP/1.1 request for `request`, its body streamed from `rx`.
    async fn upstream_request(
        &self,
        request: Request<()>,
        mut rx: RecvHalf,
        remote: SocketAddr,
        early: bool,
    ) -> Result<Request<ProxyBody>, ClientGone> {
        let (mut parts, ()) = request.into_parts();
        let authority = parts
            .uri
            .authority()
            .map(|a| a.as_str().to_owned())
            .or_else(|| {
                parts
                    .headers
                    .get(header::HOST)
                    .and_then(|h| h.to_str().ok())
                    .map(str::to_owned)
            });
        let path = parts
            .uri
            .path_and_query()
            .cloned()
            .unwrap_or_else(|| PathAndQuery::from_static("/"));
        let mut uri = http::uri::Parts::default();
        uri.scheme = Some(Scheme::HTTP);
        uri.authority = Some(self.authority.clone());
        uri.path_and_query = Some(path);
        // Scheme, authority and path were each parsed already, so the URI is valid; the
        // fallback only keeps this free of panics.
        parts.uri = Uri::from_parts(uri).unwrap_or_else(|_| Uri::from_static("/"));
        parts.version = http::Version::HTTP_11;
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
        if early {
            h.insert("early-data", HeaderValue::from_static("1"));
        }
        // Without a length, an empty body must be known as empty before the head goes out, or
        // hyper would announce a chunked body for a GET.
        let length: Option<u64> = h
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse().ok());
        let body = if length == Some(0) {
            Empty::new().map_err(|never| match never {}).boxed_unsync()
        } else if length.is_some() {
            request_body(rx, None)
        } else {
            match rx.recv_data().await.map_err(ClientGone)? {
                None => match rx.recv_trailers().await.map_err(ClientGone)? {
                    None => Empty::new().map_err(|never| match never {}).boxed_unsync(),
                    Some(t) => request_body(rx, Some(Frame::trailers(t))),
                },
                Some(mut first) => {
                    let first = first.copy_to_bytes(first.remaining());
                    request_body(rx, Some(Frame::data(first)))
                }
            }
        };
        Ok(Request::from_parts(parts, body))
    }

    /// Sends the upstream's response body: data frames as they come, then its trailers.
    async fn stream_body(
        &self,
        tx: &mut SendHalf,
        mut body: hyper::body::Incoming,
        sent: &AtomicU64,
    ) -> Result<(), BodyError> {
        loop {
            let frame = match tokio::time::timeout(self.timeout, body.frame()).await {
                Err(_) => {
                    return Err(BodyError::Upstream(
                        ErrorKind::Timeout,
                        "response body stalled".into(),
                    ))
                }
                Ok(None) => return Ok(()),
                Ok(Some(Err(e))) => {
                    let kind = if e.is_parse() {
                        ErrorKind::Protocol
                    } else {
                        ErrorKind::Reset
                    };
                    return Err(BodyError::Upstream(kind, e.to_string()));
                }
                Ok(Some(Ok(f))) => f,
            };
            match frame.into_data() {
                Ok(data) => {
                    if data.is_empty() {
                        continue;
                    }
                    let n = data.len() as u64;
                    tx.send_data(data).await.map_err(BodyError::Client)?;
                    sent.fetch_add(n, Ordering::Relaxed);
                }
                Err(frame) => {
                    if let Ok(mut trailers) = frame.into_trailers() {
                        strip_hop_by_hop(&mut trailers);
                        tx.send_trailers(trailers)
                            .await
                            .map_err(BodyError::Client)?;
                        return Ok(());
                    }
                }
            }
        }
    }

    /// Answers with the 502/504 of `kind` and counts it.
    async fn fail(
        &self,
        tx: &mut SendHalf,
        kind: ErrorKind,
        e: &(dyn std::fmt::Display + Sync),
    ) -> Outcome {
        self.count(kind, e);
        reply(tx, kind.status(), kind.body()).await
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

/// Why sending a response body stopped.
enum BodyError {
    Client(h3::error::StreamError),
    Upstream(ErrorKind, String),
}

/// Finishes the stream after a complete response.
async fn finish(tx: &mut SendHalf, status: StatusCode) -> Outcome {
    match tx.finish().await {
        Ok(()) => Outcome::Answered(status),
        Err(e) => {
            debug!(error = %e, "client went away at the end of the response");
            Outcome::Failed
        }
    }
}

/// A complete short text response of ours.
async fn reply(tx: &mut SendHalf, status: StatusCode, body: &'static [u8]) -> Outcome {
    let mut head = Response::new(());
    *head.status_mut() = status;
    let h = head.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
    h.insert(header::CONTENT_LENGTH, HeaderValue::from(body.len()));
    if let Err(e) = tx.send_response(head).await {
        debug!(error = %e, "client went away before our response");
        return Outcome::Failed;
    }
    if let Err(e) = tx.send_data(Bytes::from_static(body)).await {
        debug!(error = %e, "client went away during our response");
        return Outcome::Failed;
    }
    finish(tx, status).await
}

/// The request body as hyper polls it: `first` (a frame already read), then the stream's data
/// frames, then its trailers. A client error ends it with [`ClientGone`].
fn request_body(rx: RecvHalf, first: Option<Frame<Bytes>>) -> ProxyBody {
    enum State {
        Data(RecvHalf),
        Done,
    }
    let first = futures_util::stream::iter(first.map(Ok));
    let rest = futures_util::stream::unfold(State::Data(rx), |state| async move {
        let State::Data(mut rx) = state else {
            return None;
        };
        loop {
            match rx.recv_data().await {
                Ok(Some(mut buf)) => {
                    if !buf.has_remaining() {
                        continue;
                    }
                    let data = buf.copy_to_bytes(buf.remaining());
                    return Some((Ok(Frame::data(data)), State::Data(rx)));
                }
                Ok(None) => {
                    return match rx.recv_trailers().await {
                        Ok(None) => None,
                        Ok(Some(mut t)) => {
                            strip_hop_by_hop(&mut t);
                            Some((Ok(Frame::trailers(t)), State::Done))
                        }
                        Err(e) => Some((Err(ClientGone(e).into()), State::Done)),
                    };
                }
                Err(e) => return Some((Err(ClientGone(e).into()), State::Done)),
            }
        }
    });
    use futures_util::StreamExt;
    StreamBody::new(first.chain(rest)).boxed_unsync()
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
