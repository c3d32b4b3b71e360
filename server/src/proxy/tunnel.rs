//! Tunnels through the reverse proxy: WebSockets, and any HTTP/1.1 upgrade, from HTTP/1.1
//! clients (the `Upgrade` handshake, RFC 9110 §7.8) and from HTTP/2 clients (extended CONNECT
//! with `:protocol websocket`, RFC 8441 §4), to the route's HTTP/1.1 upstream, which always
//! sees the HTTP/1.1 handshake (RFC 6455 §4.1). Once both sides switched protocols, the bytes
//! are copied both ways through a fixed buffer per direction: a side that stops reading stops
//! the other side's reads (backpressure), nothing grows.
//!
//! * HTTP/1.1: the client's `upgrade` field (hop-by-hop, so otherwise dropped) goes upstream
//!   with `connection: upgrade`; the upstream's 101 comes back with its `upgrade` field, and
//!   the key and accept of a WebSocket handshake pass untouched (the client checks them).
//! * HTTP/2: the upstream is sent a `GET` with `upgrade: websocket`, a `sec-websocket-key` of
//!   ours (RFC 6455 §4.1: 16 random bytes, base64), and the client's `sec-websocket-version`,
//!   `-protocol` and `-extensions`; its `sec-websocket-accept` is checked against our key
//!   (§4.2.2) and its 101 becomes the client's 200 (RFC 8441 §5).
//! * An upstream that does not switch answers as it would any request (its 4xx, say); a 101
//!   with a wrong accept is a 502 ([`ErrorKind::Protocol`], counted). A 101 to a request that
//!   asked for no upgrade is refused by [`Upstream::exchange`] the same way.
//! * Each worker holds at most [`TunnelOptions::max`] tunnels: one more is answered 503
//!   (`tunnels_refused`). A tunnel with no byte either way for [`TunnelOptions::idle`] is
//!   closed (`tunnels_closed{how="idle"}`). Each tunnel ends with its one access-log line:
//!   status 101 (or 200), the bytes sent to the client, its duration, how it ended and, last,
//!   the bytes received from it.
//! * A WebSocket's bytes go through [`websocket::copy`], which follows each direction's frames
//!   ([`frames`]); a malformed one cuts the tunnel (`tunnels_closed{how="malformed"}`). Any
//!   other upgrade is copied as bytes.
//! * When the worker drains (a reload, a stop) with a [`TunnelDrain`], each tunnel closes at
//!   its own time, drawn uniformly from [`TunnelDrain::after`] to `after` plus
//!   [`TunnelDrain::spread`] after the drain began, so that a reload does not make every
//!   client reconnect in the same second: a WebSocket with status 1001 to both sides at a
//!   frame boundary, then its closing handshake (at most [`CLOSE_BOUND`]); any other tunnel at
//!   once. Either way `tunnels_closed{how="drain"}`, its line ending `cut:drain`. Without one,
//!   a draining worker keeps its tunnels until they end or the demux cuts it.
//!
//! This module knows no transport: the TCP front hands it the client's pending upgrade
//! ([`hyper::upgrade::OnUpgrade`]) and what the tunnel must hold while it lives
//! ([`ClientSide`]). HTTP/3 carries no tunnel: `h3` 0.0.8 cannot carry `:protocol websocket`
//! (RFC 9220), so the HTTP/3 server never announces extended CONNECT and browsers open their
//! WebSockets over TCP.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http::header;
use http::request::Parts;
use http::{HeaderValue, Method, Request, StatusCode};
use hyper::upgrade::OnUpgrade;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::watch;
use tokio::time::Instant;
use tracing::debug;

use super::{empty_body, find, ClientGone, ErrorKind, Exchange, ProxyBody, Upstream};
use crate::access_log::{Ending, Logged};

mod frames;
mod websocket;

use websocket::{CopyError, Finish};

/// Default of [`TunnelOptions::idle`]: nginx closes a tunnel after `proxy_read_timeout`
/// (60 s) without a byte from the upstream, which applications without a heartbeat of their
/// own run into; Caddy keeps one for good. Five minutes lets a quiet dashboard live while a
/// peer that vanished without a FIN does not hold its slot for long.
pub const DEFAULT_IDLE: Duration = Duration::from_secs(300);

/// Default of [`TunnelOptions::max`] (as many as `--tcp-max-connections`' default).
pub const DEFAULT_MAX: usize = 4096;

/// Bytes each direction of a tunnel holds at most (one read, then written out whole).
const COPY_BUFFER: usize = 16 * 1024;

/// How long a WebSocket closed on a drain has for its closing handshake (each side's close
/// frame, or the end of its stream) before it is cut: RFC 6455 §7.1.1 leaves the wait to the
/// server; a peer that answers at all answers within a round trip.
pub const CLOSE_BOUND: Duration = Duration::from_secs(5);

/// The GUID of the WebSocket handshake (RFC 6455 §1.3).
const WEBSOCKET_GUID: &str = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11";

/// A worker's tunnels: the settings and how many are open now (for the cap).
#[derive(Debug)]
pub struct TunnelOptions {
    /// Tunnels one worker holds at once; one more is answered 503 (`--max-tunnels`).
    pub max: usize,
    /// A tunnel with no byte either way for this long is closed (`--tunnel-idle`).
    pub idle: Duration,
    open: AtomicUsize,
    /// Woken when `open` falls to 0.
    none_open: tokio::sync::Notify,
    /// When a draining worker closes its tunnels, and the worker's drain signal; `None`:
    /// never (`--tunnel-drain off`).
    drain: Option<(TunnelDrain, watch::Receiver<bool>)>,
}

/// When a draining worker closes its tunnels (`--tunnel-drain`, `--tunnel-drain-spread`):
/// each at its own time, drawn uniformly from `after` to `after + spread` after the drain
/// began (after the tunnel opened, for one opened while draining).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TunnelDrain {
    pub after: Duration,
    pub spread: Duration,
}

impl TunnelOptions {
    pub fn new(max: usize, idle: Duration) -> TunnelOptions {
        TunnelOptions {
            max,
            idle,
            open: AtomicUsize::new(0),
            none_open: tokio::sync::Notify::new(),
            drain: None,
        }
    }

    /// These options, whose tunnels close as `drain` says once `draining` holds `true` (the
    /// worker's drain signal).
    pub fn with_drain(self, drain: TunnelDrain, draining: watch::Receiver<bool>) -> Self {
        TunnelOptions {
            drain: Some((drain, draining)),
            ..self
        }
    }

    /// Tunnels open now.
    pub fn open(&self) -> usize {
        self.open.load(Ordering::Relaxed)
    }

    /// Returns once no tunnel is open: a draining listener waits for its tunnels so, which
    /// outlive their HTTP/1.1 connections' tasks (the demux's `--grace` bounds the wait).
    pub async fn all_closed(&self) {
        loop {
            let notified = self.none_open.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.open() == 0 {
                return;
            }
            notified.await;
        }
    }

    /// A slot for one more tunnel, unless [`TunnelOptions::max`] are open.
    fn reserve(self: &Arc<Self>) -> Option<Slot> {
        let taken = self
            .open
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                (n < self.max).then_some(n + 1)
            });
        taken.ok().map(|_| Slot(self.clone()))
    }
}

impl Default for TunnelOptions {
    fn default() -> Self {
        TunnelOptions::new(DEFAULT_MAX, DEFAULT_IDLE)
    }
}

/// One tunnel's place under the cap, given back as it drops.
struct Slot(Arc<TunnelOptions>);

impl Drop for Slot {
    fn drop(&mut self) {
        if self.0.open.fetch_sub(1, Ordering::Relaxed) == 1 {
            self.0.none_open.notify_waiters();
        }
    }
}

/// How a tunnel ended, for `ringmux_worker_tunnels_closed_total{how}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TunnelEnd {
    /// Both sides finished (each closed its side, and the other was told).
    Closed,
    /// No byte either way for [`TunnelOptions::idle`].
    Idle,
    /// A side reset or failed (or a side never completed its switch of protocols).
    Error,
    /// Closed by the worker's drain ([`TunnelDrain`]).
    Drain,
    /// A side sent a malformed WebSocket frame (RFC 6455 §5.2).
    Malformed,
}

impl TunnelEnd {
    /// Every kind, in the order of `ServerStats::tunnels_closed`.
    pub const ALL: [TunnelEnd; 5] = [
        TunnelEnd::Closed,
        TunnelEnd::Idle,
        TunnelEnd::Error,
        TunnelEnd::Drain,
        TunnelEnd::Malformed,
    ];

    /// The metric labels, in [`TunnelEnd::ALL`] order.
    pub const LABELS: [&'static str; Self::ALL.len()] =
        ["closed", "idle", "error", "drain", "malformed"];

    fn ending(self) -> Ending {
        match self {
            TunnelEnd::Closed => Ending::Ok,
            TunnelEnd::Idle => Ending::CutTimeout,
            TunnelEnd::Error | TunnelEnd::Malformed => Ending::CutError,
            TunnelEnd::Drain => Ending::CutDrain,
        }
    }
}

/// Where tunnels are counted (the server's counters, `ServerStats`, declared with the others).
pub(crate) trait TunnelCounters: Send + Sync {
    fn opened(&self);
    fn refused(&self);
    fn closed(&self, how: TunnelEnd);
    /// `n` bytes read from the client (`up`) or from the upstream.
    fn moved(&self, up: bool, n: u64);
}

/// What a client asked to tunnel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Ask {
    /// An HTTP/1.1 `Upgrade` to these protocols (`upgrade` field as sent).
    Upgrade(HeaderValue),
    /// An HTTP/2 extended CONNECT for a WebSocket (RFC 8441 §4).
    WebSocket,
}

impl Ask {
    /// What the request head `parts` asks to tunnel, if anything: an HTTP/1.1 request whose
    /// `connection` names `upgrade` and that has an `upgrade` field, or an HTTP/2 CONNECT with
    /// `:protocol websocket`. Any other CONNECT is no tunnel (answered as before: 501).
    pub(crate) fn of(parts: &Parts) -> Option<Ask> {
        if parts.method == Method::CONNECT {
            let protocol = parts.extensions.get::<hyper::ext::Protocol>()?;
            let h2 = parts.version == http::Version::HTTP_2;
            return (h2 && protocol.as_str().eq_ignore_ascii_case("websocket"))
                .then_some(Ask::WebSocket);
        }
        if parts.version != http::Version::HTTP_11 {
            return None;
        }
        let upgrade = parts
            .headers
            .get_all(header::CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .any(|t| t.trim().eq_ignore_ascii_case("upgrade"));
        let protocols = parts.headers.get(header::UPGRADE)?;
        upgrade.then(|| Ask::Upgrade(protocols.clone()))
    }

    /// The status the client sees once the tunnel is up.
    fn status(&self) -> StatusCode {
        match self {
            Ask::Upgrade(_) => StatusCode::SWITCHING_PROTOCOLS,
            Ask::WebSocket => StatusCode::OK,
        }
    }
}

/// What the client's transport gives a tunnel: its side's pending switch of protocols, and
/// what the tunnel holds until it ends.
pub(crate) struct ClientSide {
    /// Resolves once the response head is out (hyper's `upgrade::on` of the request).
    pub(crate) upgrade: OnUpgrade,
    pub(crate) stats: Arc<dyn TunnelCounters>,
    pub(crate) tunnels: Arc<TunnelOptions>,
    /// Held while the tunnel lives (its connection's request in flight).
    pub(crate) hold: Box<dyn Send>,
}

/// What [`Upstream::tunnel`] came to.
pub(crate) enum Opened {
    /// Send this head (101, or 200 over HTTP/2) with no body: the tunnel runs in its own task
    /// from then on, and writes the access-log line at its end.
    Head(http::response::Parts),
    /// Answer as any exchange: the upstream did not switch, or failed.
    Exchange(Exchange),
}

impl Upstream {
    /// Opens a tunnel for the request head `parts` that asked `ask`, from the client at
    /// `remote`: the upstream's handshake, then (once the head returned is out) the copy. The
    /// tunnel takes the request's access-log line from `logged` and writes it at its end; an
    /// upstream that did not switch leaves it there.
    pub(crate) async fn tunnel(
        self: &Arc<Self>,
        parts: Parts,
        ask: Ask,
        remote: SocketAddr,
        client: ClientSide,
        logged: &mut Option<Logged>,
    ) -> Opened {
        let Some(slot) = client.tunnels.reserve() else {
            client.stats.refused();
            debug!(%remote, max = client.tunnels.max, "tunnel refused: the worker's cap");
            let text = b"too many tunnels open on this server; try again later\n";
            return Opened::Exchange(Exchange::Reply(StatusCode::SERVICE_UNAVAILABLE, text));
        };
        let (request, key) = self.handshake(parts, &ask, remote);
        let response = match tokio::time::timeout(self.timeout, self.client.request(request)).await
        {
            Err(_) => {
                return Opened::Exchange(self.fail_reply(ErrorKind::Timeout, &"no response head"))
            }
            Ok(Err(e)) => {
                if find::<ClientGone>(&e).is_some() {
                    return Opened::Exchange(Exchange::ClientGone);
                }
                return Opened::Exchange(self.fail_reply(super::classify(&e), &e));
            }
            Ok(Ok(r)) => r,
        };
        if response.status() != StatusCode::SWITCHING_PROTOCOLS {
            // Not switched (a 4xx from an application that wants no WebSocket here, say):
            // answered as any response.
            return Opened::Exchange(self.response(response));
        }
        if let Some(key) = key {
            let accept = response.headers().get("sec-websocket-accept");
            if accept.map(HeaderValue::as_bytes) != Some(accept_of(&key).as_bytes()) {
                let e = format!("101 with sec-websocket-accept {accept:?} for our key");
                return Opened::Exchange(self.fail_reply(ErrorKind::Protocol, &e));
            }
        }
        self.recovered();
        let (mut head, _) = response.into_parts();
        let Some(backend) = head.extensions.remove::<OnUpgrade>() else {
            let e = "101 without an upgradable connection";
            return Opened::Exchange(self.fail_reply(ErrorKind::Protocol, &e));
        };
        let protocols = head.headers.get(header::UPGRADE).cloned();
        // A WebSocket is copied frame by frame; its extensions may use the reserved bits.
        let websocket = match (&ask, &protocols) {
            (Ask::WebSocket, _) => true,
            (Ask::Upgrade(asked), p) => p
                .as_ref()
                .unwrap_or(asked)
                .as_bytes()
                .eq_ignore_ascii_case(b"websocket"),
        };
        let websocket = websocket.then(|| head.headers.contains_key("sec-websocket-extensions"));
        super::strip_hop_by_hop(&mut head.headers);
        match &ask {
            Ask::Upgrade(asked) => {
                // The accept passes as it came: the client checks it against its key.
                let protocols = protocols.unwrap_or_else(|| asked.clone());
                head.headers.insert(header::UPGRADE, protocols);
                let upgrade = HeaderValue::from_static("upgrade");
                head.headers.insert(header::CONNECTION, upgrade);
            }
            Ask::WebSocket => {
                // RFC 8441 §5: a 2xx, with no accept (the key was ours).
                head.status = ask.status();
                head.headers.remove("sec-websocket-accept");
            }
        }
        let tunnel = Tunnel {
            stats: client.stats,
            logged: logged.take(),
            _hold: client.hold,
            _slot: slot,
            status: head.status,
            idle: client.tunnels.idle,
            timeout: self.timeout,
            websocket,
            drain: client.tunnels.drain.clone(),
        };
        tokio::spawn(tunnel.run(client.upgrade, backend));
        Opened::Head(head)
    }

    /// The upstream's handshake for `parts`, and the key we chose when we made the
    /// WebSocket handshake ourselves (HTTP/2 clients send none).
    fn handshake(
        &self,
        parts: Parts,
        ask: &Ask,
        remote: SocketAddr,
    ) -> (Request<ProxyBody>, Option<String>) {
        // The client's body, if any, is the tunnel's first bytes: none goes with the head.
        let request = Request::from_parts(parts, empty_body());
        // Keeps every end-to-end field, the `sec-websocket-*` ones included.
        let mut request = self.upstream_request(request, remote, false);
        let key = match ask {
            Ask::Upgrade(protocols) => {
                request
                    .headers_mut()
                    .insert(header::UPGRADE, protocols.clone());
                None
            }
            Ask::WebSocket => {
                *request.method_mut() = Method::GET;
                let h = request.headers_mut();
                h.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
                if !h.contains_key("sec-websocket-version") {
                    // RFC 8441 §5 has the client send it; RFC 6455 §4.1 knows 13 only.
                    h.insert("sec-websocket-version", HeaderValue::from_static("13"));
                }
                let key = new_key();
                // Base64 only: always a valid value.
                if let Ok(v) = HeaderValue::from_str(&key) {
                    h.insert("sec-websocket-key", v);
                }
                Some(key)
            }
        };
        let h = request.headers_mut();
        h.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        h.remove(header::CONTENT_LENGTH);
        (request, key)
    }
}

/// One tunnel once its head is out: both sides' switch of protocols, the copy, the counts
/// and the access-log line.
struct Tunnel {
    stats: Arc<dyn TunnelCounters>,
    logged: Option<Logged>,
    _hold: Box<dyn Send>,
    _slot: Slot,
    status: StatusCode,
    idle: Duration,
    /// How long either side may take to switch protocols.
    timeout: Duration,
    /// A WebSocket: whether it negotiated an extension. `None`: another protocol.
    websocket: Option<bool>,
    drain: Option<(TunnelDrain, watch::Receiver<bool>)>,
}

/// A tunnel's copy, whichever it is.
type Copying = Pin<Box<dyn Future<Output = Result<Finish, CopyError>> + Send>>;

impl Tunnel {
    async fn run(mut self, client: OnUpgrade, backend: OnUpgrade) {
        let both = async { tokio::try_join!(client, backend) };
        let (client, backend) = match tokio::time::timeout(self.timeout, both).await {
            Ok(Ok(sides)) => sides,
            Ok(Err(e)) => return self.end(TunnelEnd::Error, 0, 0, &e),
            Err(_) => return self.end(TunnelEnd::Error, 0, 0, &"switching protocols timed out"),
        };
        self.stats.opened();
        let activity = Arc::new(Activity::new());
        let from_client = Arc::new(AtomicU64::new(0));
        let from_backend = Arc::new(AtomicU64::new(0));
        let metered = |io, bytes: &Arc<AtomicU64>, up| Metered {
            io: TokioIo::new(io),
            bytes: bytes.clone(),
            counted: self.stats.clone(),
            up,
            activity: activity.clone(),
        };
        let client = metered(client, &from_client, true);
        let backend = metered(backend, &from_backend, false);
        let (closing, told) = watch::channel(false);
        let copy: Copying = match self.websocket {
            Some(extensions) => Box::pin(websocket::copy(
                client,
                backend,
                extensions,
                told,
                COPY_BUFFER,
            )),
            None => Box::pin(async move {
                let (mut client, mut backend) = (client, backend);
                let (up, down) = (COPY_BUFFER, COPY_BUFFER);
                tokio::io::copy_bidirectional_with_sizes(&mut client, &mut backend, up, down)
                    .await?;
                Ok::<_, CopyError>(Finish::Ended)
            }),
        };
        let (how, why) = self.copied(copy, &activity, &closing).await;
        let up = from_client.load(Ordering::Relaxed);
        let down = from_backend.load(Ordering::Relaxed);
        self.end(how, up, down, &why);
    }

    /// Runs `copy` to its end, or to the tunnel's idle timeout, or to its close on a drain
    /// (told to the WebSocket copy by `closing`, then bounded by [`CLOSE_BOUND`]).
    async fn copied(
        // `&mut`: `_hold` is `Send` only, so a shared `&Tunnel` could not cross an await.
        &mut self,
        mut copy: Copying,
        activity: &Activity,
        closing: &watch::Sender<bool>,
    ) -> (TunnelEnd, String) {
        let due = drain_due(self.drain.clone());
        tokio::pin!(due);
        let mut cut_at: Option<Instant> = None;
        loop {
            let cut = async {
                match cut_at {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                done = &mut copy => {
                    let draining = cut_at.is_some();
                    return match done {
                        Ok(Finish::Ended) if !draining => (TunnelEnd::Closed, String::new()),
                        Ok(_) => (TunnelEnd::Drain, String::new()),
                        Err(e @ CopyError::Malformed { .. }) => (TunnelEnd::Malformed, e.to_string()),
                        Err(e) if draining => (TunnelEnd::Drain, e.to_string()),
                        Err(e) => (TunnelEnd::Error, e.to_string()),
                    };
                }
                () = activity.idle_for(self.idle) => return (TunnelEnd::Idle, String::new()),
                () = &mut due, if cut_at.is_none() => {
                    if self.websocket.is_none() {
                        return (TunnelEnd::Drain, "not a WebSocket: cut".into());
                    }
                    // The copy holds the receiver while it runs.
                    let _ = closing.send(true);
                    cut_at = Some(Instant::now() + CLOSE_BOUND);
                }
                () = cut => return (TunnelEnd::Drain, "no closing handshake in time".into()),
            }
        }
    }

    /// Counts the end, and writes the line: `up` bytes from the client, `down` to it.
    fn end(&mut self, how: TunnelEnd, up: u64, down: u64, why: &dyn std::fmt::Display) {
        self.stats.closed(how);
        debug!(?how, up, down, %why, "tunnel ended");
        if let Some(logged) = self.logged.take() {
            logged.end_tunnel(self.status, down, up, how.ending());
        }
    }
}

/// Returns when a tunnel of `drain` is to close: once the worker drains, after
/// [`TunnelDrain::after`] and a share of [`TunnelDrain::spread`] drawn uniformly. Never without
/// one (or if the drain signal is gone).
async fn drain_due(drain: Option<(TunnelDrain, watch::Receiver<bool>)>) {
    let Some((drain, mut draining)) = drain else {
        return std::future::pending().await;
    };
    if draining.wait_for(|d| *d).await.is_err() {
        return std::future::pending().await;
    }
    let mut draw = [0u8; 4];
    // The system's generator failing puts every tunnel at `after`: closed, only not spread.
    let _ = ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut draw);
    let share = f64::from(u32::from_le_bytes(draw)) / f64::from(u32::MAX);
    tokio::time::sleep(drain.after + drain.spread.mul_f64(share)).await;
}

/// When a tunnel last moved a byte, either way.
struct Activity {
    start: Instant,
    /// Milliseconds from `start` to the last read of a byte.
    last_ms: AtomicU64,
}

impl Activity {
    fn new() -> Activity {
        Activity {
            start: Instant::now(),
            last_ms: AtomicU64::new(0),
        }
    }

    fn touch(&self) {
        let ms = self.start.elapsed().as_millis() as u64;
        self.last_ms.store(ms, Ordering::Relaxed);
    }

    /// Returns once no byte moved for `idle`.
    async fn idle_for(&self, idle: Duration) {
        loop {
            let last = self.start + Duration::from_millis(self.last_ms.load(Ordering::Relaxed));
            let due = last + idle;
            if Instant::now() >= due {
                return;
            }
            tokio::time::sleep_until(due).await;
        }
    }
}

/// One side of a tunnel: its reads counted (bytes, and as activity).
struct Metered<T> {
    io: T,
    bytes: Arc<AtomicU64>,
    counted: Arc<dyn TunnelCounters>,
    /// Reads from the client (the bytes go up); else from the upstream.
    up: bool,
    activity: Arc<Activity>,
}

impl<T: AsyncRead + Unpin> AsyncRead for Metered<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.io).poll_read(cx, buf);
        let n = (buf.filled().len() - before) as u64;
        if n > 0 {
            self.bytes.fetch_add(n, Ordering::Relaxed);
            self.counted.moved(self.up, n);
            self.activity.touch();
        }
        polled
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Metered<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

/// A new `sec-websocket-key`: 16 random bytes, base64 (RFC 6455 §4.1).
fn new_key() -> String {
    let mut nonce = [0u8; 16];
    // The system's generator failing leaves a fixed key: the handshake still checks out, and
    // the key is no secret (it only proves the upstream speaks WebSocket).
    let _ = ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut nonce);
    base64(&nonce)
}

/// The `sec-websocket-accept` for `key` (RFC 6455 §4.2.2): base64 of the SHA-1 of the key
/// and the GUID.
fn accept_of(key: &str) -> String {
    let mut ctx = ring::digest::Context::new(&ring::digest::SHA1_FOR_LEGACY_USE_ONLY);
    ctx.update(key.as_bytes());
    ctx.update(WEBSOCKET_GUID.as_bytes());
    base64(ctx.finish().as_ref())
}

/// Standard base64 with padding (RFC 4648 §4), for the handshake's few bytes.
fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = u32::from(b[0]) << 16 | u32::from(b[1]) << 8 | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(char::from(ALPHABET[(n >> (18 - 6 * i) & 63) as usize]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_accept_is_rfc_6455s_example() {
        // RFC 6455 §1.3.
        assert_eq!(
            accept_of("dGhlIHNhbXBsZSBub25jZQ=="),
            "s3pPLMBiTxaQ9kYGzzhZRbK+xOo="
        );
        assert_eq!(base64(b"f"), "Zg==");
        assert_eq!(base64(b"fo"), "Zm8=");
        assert_eq!(base64(b"foo"), "Zm9v");
        assert_eq!(new_key().len(), 24);
    }

    /// Whether `due` is over when polled once now.
    async fn over(due: Pin<&mut impl Future<Output = ()>>) -> bool {
        tokio::select! {
            biased;
            () = due => true,
            () = std::future::ready(()) => false,
        }
    }

    #[tokio::test]
    async fn a_tunnel_is_due_only_once_its_worker_drains() {
        let now = TunnelDrain {
            after: Duration::ZERO,
            spread: Duration::ZERO,
        };
        let (drains, draining) = watch::channel(false);
        let due = drain_due(Some((now, draining.clone())));
        tokio::pin!(due);
        assert!(!over(due.as_mut()).await, "due before the drain");
        drains.send(true).unwrap();
        due.await;

        let never = drain_due(None);
        tokio::pin!(never);
        assert!(!over(never.as_mut()).await);
        let (gone, draining) = watch::channel(false);
        drop(gone);
        let never = drain_due(Some((now, draining)));
        tokio::pin!(never);
        assert!(!over(never.as_mut()).await, "due with no drain signal left");
    }

    fn parts(req: http::request::Builder) -> Parts {
        req.body(()).unwrap().into_parts().0
    }

    #[test]
    fn what_asks_for_a_tunnel() {
        let h1 = || Request::get("/chat").version(http::Version::HTTP_11);
        let ws = Ask::of(&parts(
            h1().header("connection", "keep-alive, Upgrade")
                .header("upgrade", "websocket"),
        ));
        assert_eq!(
            ws,
            Some(Ask::Upgrade(HeaderValue::from_static("websocket")))
        );
        assert_eq!(Ask::of(&parts(h1().header("upgrade", "websocket"))), None);
        assert_eq!(Ask::of(&parts(h1().header("connection", "upgrade"))), None);

        let connect = |protocol: Option<&str>| {
            let mut b = Request::connect("https://example.com/chat").version(http::Version::HTTP_2);
            if let Some(p) = protocol {
                b = b.extension(hyper::ext::Protocol::from(p));
            }
            Ask::of(&parts(b))
        };
        assert_eq!(connect(Some("websocket")), Some(Ask::WebSocket));
        assert_eq!(connect(Some("connect-udp")), None);
        assert_eq!(connect(None), None);
    }
}
