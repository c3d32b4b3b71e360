//! The backends of one upstream route and the choice among them: a [`Pool`] picks a backend
//! for each request by its route's policy ([`Balance`]), counts each backend's requests in
//! flight, takes a backend that keeps failing out of the choice for a while (passive health,
//! [`PassiveHealth`]), moves a failed request to another backend when that cannot repeat an
//! effect (`ringmux_proto::route::Retries`), and refuses a request body past the route's `max_body` with a 413.
//! How one backend is reached (its connection pool, its scheme) is [`Upstream`]'s; this module
//! only chooses among them.
//!
//! * A backend ([`Backend`]) is one per URL in a worker, shared by every route that names it,
//!   so its counters and its health are one too; the policy and thresholds are the route's.
//! * A request is retried only when it never reached a backend (the connection could not be
//!   made: hyper had not read a byte of its body, which is taken back), or when its method is
//!   idempotent (RFC 9110 §9.2.2) and it has no body, so a second attempt cannot repeat an
//!   effect; never on a response, whatever its status, nor on a timeout (a slow backend would
//!   cost twice). Each retry goes to a backend this request has not tried.
//! * Passive health is per worker: a backend that failed `max_fails` times within
//!   `fail_window` is left out of the choice for `eject_for`, then chosen again. When every
//!   backend is out, the choice is among all of them (a pool never answers 502 only because it
//!   ejected everything: a backend that recovered is found by the next request).
//! * Active health is the demux's, one verdict for the box ([`Verdicts`], `super::health`): a
//!   backend it marks down is left out of the choice as an ejected one is, and counted
//!   (`backend_skipped_down`). When it marks every backend of the route down, the request is
//!   answered 503 at once, as Caddy answers when no upstream is available: nothing is tried.
//!   A tunnel (a WebSocket) is refused the same way (`Pool::tunnel`).
//! * Every decision is counted per backend and reported as series labelled by the backend
//!   ([`report`]): bounded, as the backends are the configuration's.

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Context, Poll};
use std::time::Instant;

use bytes::Bytes;
use http::{header, Method, Request, StatusCode};
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use ringmux_proto::route::{Balance, Balancing, BodyLimit, PassiveHealth};
use ringmux_proto::WorkerReport;
use tracing::warn;

use super::health::Verdicts;
use super::{
    empty_body, Ask, BoxError, ClientSide, ErrorKind, Exchange, Opened, ProxyBody, Upstream,
};
use crate::access_log::Logged;

/// Why a backend's request failed, for `ringmux_worker_backend_failures_total{backend,kind}`:
/// the proxy's [`ErrorKind`]s, then a 5xx response.
pub const FAILURE_LABELS: [&str; ErrorKind::ALL.len() + 1] = [
    "connect",
    "reset",
    "timeout",
    "protocol",
    "tls",
    "status_5xx",
];

/// The body of the 503 when the demux's health checks mark every backend of the route down.
const ALL_DOWN: &[u8] =
    b"no healthy upstream: every backend of this route is down by its health check\n";

/// The body of a refusal for `max_body`.
const TOO_LARGE: &[u8] = b"request body too large\n";

/// The most of a refused body read and thrown away before the 413 goes out, and how long that
/// may take: a client that sent its small body already gets the answer rather than a stream
/// reset (over HTTP/2, dropping a body the client is still sending resets its stream before
/// the answer can go), and a large upload is not read to its end.
const DISCARD_MAX: u64 = 256 * 1024;
const DISCARD_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

/// Reads `body` and throws it away, up to [`DISCARD_MAX`] bytes or [`DISCARD_WAIT`].
async fn discard(mut body: ProxyBody) {
    let drain = async {
        let mut read = 0u64;
        while let Some(Ok(frame)) = body.frame().await {
            read += frame.data_ref().map_or(0, |d| d.len() as u64);
            if read > DISCARD_MAX {
                break;
            }
        }
    };
    let _ = tokio::time::timeout(DISCARD_WAIT, drain).await;
}

/// One backend of a worker: how it is reached, its requests in flight, its passive health and
/// its counters. One per URL, shared by the routes that name it.
pub struct Backend {
    upstream: Arc<Upstream>,
    /// The backend as a label value: its `HOST:PORT` with every other byte than `[a-z0-9]` as
    /// `_` (`127.0.0.1:8080` is `127_0_0_1_8080`).
    label: String,
    in_flight: AtomicUsize,
    health: Health,
    /// Requests sent to it (each attempt of a request counts).
    requests: AtomicU64,
    /// Responses with a 5xx status.
    status_5xx: AtomicU64,
    /// Requests that failed here and went on to another backend.
    retried: AtomicU64,
    /// Times it was ejected.
    ejections: AtomicU64,
    /// Times a choice left it out because the demux's health check marks it down.
    skipped_down: AtomicU64,
}

impl std::fmt::Debug for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Backend")
            .field("label", &self.label)
            .finish_non_exhaustive()
    }
}

impl Backend {
    pub fn new(upstream: Arc<Upstream>) -> Backend {
        Backend {
            label: label_of(upstream.authority().as_str()),
            upstream,
            in_flight: AtomicUsize::new(0),
            health: Health::default(),
            requests: AtomicU64::new(0),
            status_5xx: AtomicU64::new(0),
            retried: AtomicU64::new(0),
            ejections: AtomicU64::new(0),
            skipped_down: AtomicU64::new(0),
        }
    }

    pub fn upstream(&self) -> &Arc<Upstream> {
        &self.upstream
    }

    /// Whether it is ejected now.
    pub fn ejected(&self) -> bool {
        self.health.ejected(now_ms())
    }

    /// Its requests in flight in this worker.
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// A failure of a request sent here: counted towards its ejection.
    fn failed(&self, passive: &PassiveHealth) {
        if self.health.fail(passive, now_ms()) {
            self.ejections.fetch_add(1, Ordering::Relaxed);
            warn!(
                backend = %self.upstream.authority(),
                fails = passive.max_fails,
                window_s = u32::from(passive.fail_window),
                eject_s = u32::from(passive.eject_for),
                "backend ejected: too many failures; counted in \
                 ringmux_worker_backend_ejections_total"
            );
        }
    }
}

/// A request in flight at a backend: counted in [`Backend::in_flight`] until dropped, which
/// is when the response body ends (the guard rides in it) or the exchange fails.
pub struct InFlight(Arc<Backend>);

impl InFlight {
    fn new(backend: &Arc<Backend>) -> InFlight {
        backend.in_flight.fetch_add(1, Ordering::Relaxed);
        backend.requests.fetch_add(1, Ordering::Relaxed);
        InFlight(backend.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The backends of one route and how it shares its requests among them.
pub struct Pool {
    backends: Vec<Arc<Backend>>,
    balancing: Balancing,
    max_body: BodyLimit,
    /// The next turn of `round_robin`.
    turn: AtomicUsize,
    /// The demux's verdicts on the backends, when the route checks their health.
    verdicts: Option<Verdicts>,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool")
            .field("backends", &self.backends)
            .field("balancing", &self.balancing)
            .finish_non_exhaustive()
    }
}

/// A request's body, as the attempts of a [`Pool::exchange`] share it.
enum Held {
    /// None: every attempt sends an empty body.
    Empty,
    /// A body the first attempt takes when hyper first polls it; still there after an attempt
    /// that failed before, so the next attempt may send it.
    Unread(Arc<Mutex<Option<ProxyBody>>>),
}

/// What the attempts of a request that may be retried share.
struct Attempts {
    /// The request's head, copied for each attempt.
    parts: http::request::Parts,
    held: Held,
    /// Set when the body passed `max_body` (`None`: no limit, or no body).
    cut: Option<Arc<AtomicBool>>,
    remote: SocketAddr,
    early: bool,
}

/// `backend`'s `response` as the client gets it: a 5xx counted towards its ejection, any
/// other status clearing its failures, and the request in flight there until the body ends.
fn answered(
    backend: &Backend,
    passive: &PassiveHealth,
    in_flight: InFlight,
    mut response: http::Response<super::UpstreamBody>,
) -> Exchange {
    if response.status().is_server_error() {
        backend.status_5xx.fetch_add(1, Ordering::Relaxed);
        backend.failed(passive);
    } else {
        backend.health.succeeded();
    }
    response.body_mut().guard = Some(Box::new(in_flight));
    Exchange::Response(response)
}

impl Pool {
    /// A pool of `backends` (at least one, as a route's declaration holds), shared by
    /// `balancing`, refusing bodies past `max_body`.
    pub fn new(backends: Vec<Arc<Backend>>, balancing: Balancing, max_body: BodyLimit) -> Pool {
        Pool {
            backends,
            balancing,
            max_body,
            turn: AtomicUsize::new(0),
            verdicts: None,
        }
    }

    /// The pool that leaves out what `verdicts` marks down.
    pub fn checked(mut self, verdicts: Verdicts) -> Pool {
        self.verdicts = Some(verdicts);
        self
    }

    /// Whether the demux's health checks mark every backend down.
    fn all_down(&self) -> bool {
        self.verdicts
            .as_ref()
            .is_some_and(|v| (0..self.backends.len()).all(|i| v.down(i)))
    }

    /// The backends, in the route's order.
    pub fn backends(&self) -> &[Arc<Backend>] {
        &self.backends
    }

    /// The first backend's upstream (a route with one backend has only it).
    pub fn first(&self) -> &Arc<Upstream> {
        self.backends[0].upstream()
    }

    /// Passes one request to a backend, and on to another when it failed and may be retried
    /// (the module's rules); [`Upstream::exchange`]'s contract otherwise, for both transports.
    /// The refusals and the attempts that keep the request for a retry are out of line, so
    /// the state of the common request (one attempt, the request moved as it is) stays small.
    pub async fn exchange(
        self: &Arc<Self>,
        request: Request<ProxyBody>,
        remote: SocketAddr,
        early: bool,
    ) -> Exchange {
        if let Some(refusal) = self.all_down_refusal() {
            Box::pin(discard(request.into_body())).await;
            return refusal;
        }
        let limit = self.max_body.get();
        let length = content_length(request.headers());
        if let (Some(limit), Some(length)) = (limit, length) {
            if length > limit {
                Box::pin(discard(request.into_body())).await;
                return Exchange::Reply(StatusCode::PAYLOAD_TOO_LARGE, TOO_LARGE);
            }
        }
        let empty = length == Some(0) || request.body().is_end_stream();
        // A body past `max_body` says so here: whatever the attempt then came to, the answer
        // is 413 (hyper reports the body's error as a request of ours it refused).
        let cut = match (limit, empty) {
            (Some(_), false) => Some(Arc::new(AtomicBool::new(false))),
            _ => None,
        };
        let limited = |body: ProxyBody| match (limit, &cut) {
            (Some(limit), Some(cut)) => LimitedBody::new(body, limit, cut.clone()).boxed_unsync(),
            _ => body,
        };
        let retries = usize::from(self.balancing.retries.get());
        if retries == 0 || self.backends.len() == 1 {
            return self.once(request.map(limited), remote, early, cut).await;
        }
        let (parts, body) = request.into_parts();
        let held = match empty {
            true => Held::Empty,
            false => Held::Unread(Arc::new(Mutex::new(Some(limited(body))))),
        };
        let attempts = Attempts {
            parts,
            held,
            cut,
            remote,
            early,
        };
        Box::pin(self.with_retries(attempts, retries)).await
    }

    /// The answer when the demux's health checks mark every backend down, each counted as
    /// skipped: a 503 at once, nothing tried (requests and tunnels alike).
    fn all_down_refusal(&self) -> Option<Exchange> {
        if !self.all_down() {
            return None;
        }
        for b in &self.backends {
            b.skipped_down.fetch_add(1, Ordering::Relaxed);
        }
        Some(Exchange::Reply(StatusCode::SERVICE_UNAVAILABLE, ALL_DOWN))
    }

    /// The one attempt of a request no other attempt could follow (one backend, or no
    /// retries): the request goes to the chosen backend as it is, nothing kept for a retry.
    async fn once(
        &self,
        request: Request<ProxyBody>,
        remote: SocketAddr,
        early: bool,
        cut: Option<Arc<AtomicBool>>,
    ) -> Exchange {
        let backend = self.choose(remote, &[]);
        let in_flight = InFlight::new(&backend);
        let result = backend.upstream.attempt(request, remote, early).await;
        let passive = &self.balancing.passive;
        match result {
            Ok(Exchange::Response(response)) => answered(&backend, passive, in_flight, response),
            _ if cut.as_ref().is_some_and(|c| c.load(Ordering::Relaxed)) => {
                Exchange::Reply(StatusCode::PAYLOAD_TOO_LARGE, TOO_LARGE)
            }
            Ok(other) => other,
            Err(kind) => {
                backend.failed(passive);
                Exchange::Reply(kind.status(), kind.body())
            }
        }
    }

    /// The attempts of a request that may go to another backend after a failure (the
    /// module's rules), up to `retries` more.
    async fn with_retries(&self, attempts: Attempts, retries: usize) -> Exchange {
        let Attempts {
            parts,
            held,
            cut,
            remote,
            early,
        } = attempts;
        let idempotent = matches!(
            parts.method,
            Method::GET
                | Method::HEAD
                | Method::OPTIONS
                | Method::PUT
                | Method::DELETE
                | Method::TRACE
        );
        let empty = matches!(held, Held::Empty);
        let mut tried = Vec::with_capacity(2);
        loop {
            let backend = self.choose(remote, &tried);
            let body = match &held {
                Held::Empty => empty_body(),
                Held::Unread(slot) => TakeOnce::new(slot.clone()).boxed_unsync(),
            };
            let mut request = Request::new(body);
            *request.method_mut() = parts.method.clone();
            *request.uri_mut() = parts.uri.clone();
            *request.version_mut() = parts.version;
            *request.headers_mut() = parts.headers.clone();
            let in_flight = InFlight::new(&backend);
            let passive = &self.balancing.passive;
            match backend.upstream.attempt(request, remote, early).await {
                Ok(Exchange::Response(response)) => {
                    return answered(&backend, passive, in_flight, response);
                }
                _ if cut.as_ref().is_some_and(|c| c.load(Ordering::Relaxed)) => {
                    return Exchange::Reply(StatusCode::PAYLOAD_TOO_LARGE, TOO_LARGE);
                }
                Ok(other) => return other,
                Err(kind) => {
                    backend.failed(passive);
                    let unread = match &held {
                        Held::Empty => true,
                        Held::Unread(slot) => lock(slot).is_some(),
                    };
                    let may_retry = match kind {
                        // Never reached the backend: hyper reads no body before it connects.
                        ErrorKind::Connect | ErrorKind::Tls => unread,
                        ErrorKind::Reset | ErrorKind::Protocol => idempotent && empty,
                        ErrorKind::Timeout => false,
                    };
                    tried.push(backend.clone());
                    if !may_retry || tried.len() > retries || tried.len() >= self.backends.len() {
                        return Exchange::Reply(kind.status(), kind.body());
                    }
                    backend.retried.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    }

    /// Opens a tunnel to one backend, chosen as a request's is and never retried (the
    /// client's bytes may have reached it); when the demux's checks mark every backend down,
    /// a 503 at once as a request gets, counted the same way, and no backend is tried.
    pub(crate) async fn tunnel(
        &self,
        parts: http::request::Parts,
        ask: Ask,
        remote: SocketAddr,
        client: ClientSide,
        logged: &mut Option<Logged>,
    ) -> Opened {
        if let Some(refusal) = self.all_down_refusal() {
            return Opened::Exchange(refusal);
        }
        let backend = self.choose(remote, &[]);
        let upstream = backend.upstream();
        upstream.tunnel(parts, ask, remote, client, logged).await
    }

    /// The backend for a request from `remote` that has tried `tried` already: by the route's
    /// policy among those neither down (by the demux's check), ejected nor tried, else among
    /// those neither down nor tried, else among those not tried.
    fn choose(&self, remote: SocketAddr, tried: &[Arc<Backend>]) -> Arc<Backend> {
        if let ([only], []) = (&self.backends[..], tried) {
            // The one backend, whatever its state (as below, with nothing to choose from):
            // no lists to make for the most common route.
            if self.verdicts.as_ref().is_some_and(|v| v.down(0)) {
                only.skipped_down.fetch_add(1, Ordering::Relaxed);
            }
            return only.clone();
        }
        let now = now_ms();
        let untried = |b: &&Arc<Backend>| !tried.iter().any(|t| Arc::ptr_eq(t, b));
        // Each verdict loaded once for this choice.
        let up: Vec<&Arc<Backend>> = self
            .backends
            .iter()
            .enumerate()
            .filter(|(i, b)| {
                let down = self.verdicts.as_ref().is_some_and(|v| v.down(*i));
                if down {
                    b.skipped_down.fetch_add(1, Ordering::Relaxed);
                }
                !down
            })
            .map(|(_, b)| b)
            .collect();
        let mut usable: Vec<&Arc<Backend>> = up
            .iter()
            .copied()
            .filter(untried)
            .filter(|b| !b.health.ejected(now))
            .collect();
        if usable.is_empty() {
            usable = up.iter().copied().filter(untried).collect();
        }
        if usable.is_empty() {
            usable = self.backends.iter().filter(untried).collect();
        }
        if usable.is_empty() {
            // Only when every backend was tried, which `exchange` stops before.
            usable = self.backends.iter().collect();
        }
        let i = pick(
            self.balancing.lb,
            &usable,
            remote,
            || self.turn.fetch_add(1, Ordering::Relaxed),
            random,
        );
        usable[i].clone()
    }
}

/// The index in `usable` (not empty) that `policy` picks for a request from `remote`; `turn`
/// gives round robin's next turn, `random` a random number.
fn pick(
    policy: Balance,
    usable: &[&Arc<Backend>],
    remote: SocketAddr,
    turn: impl FnOnce() -> usize,
    mut random: impl FnMut() -> u64,
) -> usize {
    let n = usable.len();
    if n == 1 {
        return 0;
    }
    match policy {
        Balance::RoundRobin => turn() % n,
        Balance::LeastConn => (0..n).min_by_key(|&i| usable[i].in_flight()).unwrap_or(0),
        Balance::RandomTwo => {
            let a = (random() % n as u64) as usize;
            // A second one, other than the first.
            let b = (a + 1 + (random() % (n as u64 - 1)) as usize) % n;
            match usable[b].in_flight() < usable[a].in_flight() {
                true => b,
                false => a,
            }
        }
        Balance::ClientHash => {
            // Rendezvous hashing (Thaler and Ravishankar 1998): the highest hash of the
            // client's address and the backend. Deterministic (SipHash with fixed keys), so
            // every worker picks the same backend for one client.
            let ip = remote.ip().to_canonical();
            (0..n)
                .max_by_key(|&i| {
                    let mut h = DefaultHasher::new();
                    (ip, &usable[i].label).hash(&mut h);
                    h.finish()
                })
                .unwrap_or(0)
        }
    }
}

/// A random number, from a per-thread xorshift seeded by the standard library's random keys:
/// good enough to pick between two backends, and no dependency.
fn random() -> u64 {
    use std::cell::Cell;
    thread_local! {
        static STATE: Cell<u64> = Cell::new({
            use std::hash::BuildHasher;
            std::collections::hash_map::RandomState::new().hash_one(0u64) | 1
        });
    }
    STATE.with(|s| {
        // xorshift64 (Marsaglia 2003).
        let mut x = s.get();
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        s.set(x);
        x
    })
}

/// A backend's passive health: its failures in the current window, and until when it is
/// ejected. Decisions take `now` (milliseconds since [`now_ms`]'s epoch), so they are tested
/// without a clock.
#[derive(Debug, Default)]
struct Health {
    /// Until when the backend is out of the choice, in [`now_ms`]; 0 when it is not. Read on
    /// every choice, written on an ejection only.
    ejected_until: AtomicU64,
    window: Mutex<Window>,
}

#[derive(Debug, Default)]
struct Window {
    start: u64,
    fails: u32,
}

impl Health {
    fn ejected(&self, now: u64) -> bool {
        // Relaxed: a hint for the choice; nothing else is published through it.
        now < self.ejected_until.load(Ordering::Relaxed)
    }

    /// A failure at `now`; whether it ejects the backend.
    fn fail(&self, passive: &PassiveHealth, now: u64) -> bool {
        if passive.max_fails == 0 || self.ejected(now) {
            return false;
        }
        let mut w = lock(&self.window);
        let window_ms = passive.fail_window.duration().as_millis() as u64;
        if w.fails == 0 || now.saturating_sub(w.start) >= window_ms {
            *w = Window {
                start: now,
                fails: 0,
            };
        }
        w.fails += 1;
        if w.fails < passive.max_fails {
            return false;
        }
        *w = Window::default();
        let until = now + passive.eject_for.duration().as_millis() as u64;
        self.ejected_until.store(until, Ordering::Relaxed);
        true
    }

    /// A response that was no failure: the failures so far no longer count.
    fn succeeded(&self) {
        let mut w = lock(&self.window);
        if w.fails != 0 {
            *w = Window::default();
        }
    }
}

/// Milliseconds since this process first asked (never 0, so 0 can mean "not ejected").
fn now_ms() -> u64 {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    let epoch = *EPOCH.get_or_init(Instant::now);
    epoch.elapsed().as_millis() as u64 + 1
}

/// A lock whose holder never panics while holding it; a poisoned one is taken as it is.
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The request's `content-length`, if it has a valid one.
fn content_length(h: &http::HeaderMap) -> Option<u64> {
    h.get(header::CONTENT_LENGTH)?.to_str().ok()?.parse().ok()
}

/// `authority` as a label value of a series: `[a-z0-9_]`, at most 64 bytes.
fn label_of(authority: &str) -> String {
    ringmux_proto::series::label_value(authority)
}

/// A request body past the route's `max_body`: the exchange answers 413 when nothing of the
/// response was sent yet.
#[derive(Debug, thiserror::Error)]
#[error("request body larger than max_body ({limit} bytes)")]
struct BodyTooLarge {
    limit: u64,
}

/// A request body that fails with [`BodyTooLarge`] once it carried more than its limit, frame
/// by frame, and says so in `cut`: nothing past the limit is passed on, and nothing is held.
struct LimitedBody {
    inner: ProxyBody,
    limit: u64,
    seen: u64,
    cut: Arc<AtomicBool>,
}

impl LimitedBody {
    fn new(inner: ProxyBody, limit: u64, cut: Arc<AtomicBool>) -> LimitedBody {
        LimitedBody {
            inner,
            limit,
            seen: 0,
            cut,
        }
    }
}

impl Body for LimitedBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let frame = std::task::ready!(Pin::new(&mut self.inner).poll_frame(cx));
        if let Some(Ok(data)) = frame.as_ref().map(|f| f.as_ref().map(Frame::data_ref)) {
            self.seen += data.map_or(0, |d| d.len() as u64);
            if self.seen > self.limit {
                // Relaxed: the failure of the request reaches the pool through hyper's
                // channel, which orders this store before the pool's load.
                self.cut.store(true, Ordering::Relaxed);
                let limit = self.limit;
                return Poll::Ready(Some(Err(BoxError::from(BodyTooLarge { limit }))));
            }
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// A request body taken out of its slot when first polled, so that an attempt that failed
/// before reading it leaves it for the next.
struct TakeOnce {
    slot: Arc<Mutex<Option<ProxyBody>>>,
    taken: Option<ProxyBody>,
}

impl TakeOnce {
    fn new(slot: Arc<Mutex<Option<ProxyBody>>>) -> TakeOnce {
        TakeOnce { slot, taken: None }
    }
}

impl Body for TakeOnce {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if self.taken.is_none() {
            let taken = lock(&self.slot).take();
            self.taken = taken;
        }
        match self.taken.as_mut() {
            Some(body) => Pin::new(body).poll_frame(cx),
            // Another attempt took it: this one cannot send it.
            None => Poll::Ready(Some(Err("request body already sent".into()))),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.taken {
            Some(b) => b.is_end_stream(),
            None => lock(&self.slot).as_ref().is_none_or(|b| b.is_end_stream()),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.taken {
            Some(b) => b.size_hint(),
            None => lock(&self.slot)
                .as_ref()
                .map_or_else(SizeHint::default, |b| b.size_hint()),
        }
    }
}

/// Puts every backend's series in `r`, each backend once (`backends` may name one twice, from
/// two routes): requests, failures by kind, retries, ejections, and its state now.
pub fn report<'b>(backends: impl Iterator<Item = &'b Arc<Backend>>, r: &mut WorkerReport) {
    let mut seen: Vec<&str> = Vec::new();
    for b in backends {
        if seen.contains(&b.label.as_str()) {
            continue;
        }
        seen.push(&b.label);
        let label = [("backend", b.label.as_str())];
        let errors = b.upstream.errors();
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let mut set = |name: &str, labels: &[(&str, &str)], v: u64| {
            // A refusal is past the bound of series (one report's): dropped, as the
            // contract says.
            let _ = r.set_counter(name, labels, v);
        };
        set("backend_requests", &label, get(&b.requests));
        set("backend_retries", &label, get(&b.retried));
        set("backend_ejections", &label, get(&b.ejections));
        set("backend_skipped_down", &label, get(&b.skipped_down));
        for (i, kind) in FAILURE_LABELS.iter().enumerate() {
            let v = errors.get(i).copied().unwrap_or_else(|| get(&b.status_5xx));
            set(
                "backend_failures",
                &[("backend", &b.label), ("kind", kind)],
                v,
            );
        }
        let state = match b.ejected() {
            true => "ejected",
            false => "up",
        };
        for s in ["up", "ejected"] {
            let labels = [("backend", b.label.as_str()), ("state", s)];
            let _ = r.set_gauge("backend_state", &labels, u64::from(s == state));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ringmux_proto::route::HealthSeconds;

    fn backend(port: u16) -> Arc<Backend> {
        let url = format!("http://127.0.0.1:{port}").parse().unwrap();
        let tls = ringmux_proto::route::UpstreamTls::default();
        let upstream = Upstream::new(&url, &tls, super::super::DEFAULT_TIMEOUT).expect("plain");
        let upstream = Arc::new(upstream);
        Arc::new(Backend::new(upstream))
    }

    fn client(last: u8) -> SocketAddr {
        SocketAddr::from(([192, 0, 2, last], 4000))
    }

    #[test]
    fn labels_are_the_authority_in_series_characters() {
        assert_eq!(label_of("127.0.0.1:8080"), "127_0_0_1_8080");
        assert_eq!(label_of("[::1]:80"), "___1__80");
        assert_eq!(label_of("App.Example:1"), "app_example_1");
        assert_eq!(label_of(&"a".repeat(100)).len(), 64);
    }

    #[test]
    fn round_robin_takes_each_in_turn() {
        let all = [backend(1), backend(2), backend(3)];
        let usable: Vec<&Arc<Backend>> = all.iter().collect();
        let mut turn = 0;
        let got: Vec<usize> = (0..6)
            .map(|_| {
                pick(
                    Balance::RoundRobin,
                    &usable,
                    client(1),
                    || {
                        turn += 1;
                        turn - 1
                    },
                    || 0,
                )
            })
            .collect();
        assert_eq!(got, [0, 1, 2, 0, 1, 2]);
    }

    #[test]
    fn least_conn_and_random_two_prefer_fewer_in_flight() {
        let all = [backend(1), backend(2), backend(3)];
        let usable: Vec<&Arc<Backend>> = all.iter().collect();
        let _busy = [
            InFlight::new(&all[0]),
            InFlight::new(&all[0]),
            InFlight::new(&all[2]),
        ];
        assert_eq!(pick(Balance::LeastConn, &usable, client(1), || 0, || 0), 1);
        // Random picks 0 then 0 + 1 + 1 = 2: of the two, 2 has fewer in flight.
        let mut draws = [0u64, 1].into_iter();
        let got = pick(
            Balance::RandomTwo,
            &usable,
            client(1),
            || 0,
            || draws.next().unwrap_or(0),
        );
        assert_eq!(got, 2);
        // Never the same one twice, whatever the draws.
        for a in 0..3u64 {
            for b in 0..3u64 {
                let mut d = [a, b].into_iter();
                let i = pick(
                    Balance::RandomTwo,
                    &usable,
                    client(1),
                    || 0,
                    || d.next().unwrap_or(0),
                );
                assert!(i < 3);
            }
        }
        drop(_busy);
        assert_eq!(all.iter().map(|b| b.in_flight()).sum::<usize>(), 0);
    }

    #[test]
    fn client_hash_keeps_a_client_and_moves_only_the_ejecteds_clients() {
        let all = [backend(1), backend(2), backend(3)];
        let usable: Vec<&Arc<Backend>> = all.iter().collect();
        let at = |u: &[&Arc<Backend>], c| pick(Balance::ClientHash, u, client(c), || 0, || 0);
        let before: Vec<usize> = (0..60).map(|c| at(&usable, c)).collect();
        assert_eq!(before, (0..60).map(|c| at(&usable, c)).collect::<Vec<_>>());
        for i in 0..3 {
            assert!(before.contains(&i), "backend {i} gets clients: {before:?}");
        }
        // Without backend 1: the others keep their clients.
        let without: Vec<&Arc<Backend>> = vec![&all[0], &all[2]];
        for (c, was) in before.iter().enumerate() {
            let now = without[at(&without, c as u8)];
            if *was != 1 {
                assert!(Arc::ptr_eq(now, &all[*was]), "client {c} moved");
            }
        }
    }

    /// A pool of `all`, round robin, reading its verdicts at slots 1 and on of a table whose
    /// slot 0 is another route's; and the table.
    fn checked(all: &[Arc<Backend>]) -> (Arc<Pool>, ringmux_ring::health::HealthWriter) {
        use ringmux_ring::health::{HealthReader, HealthWriter};
        let table = HealthWriter::create(1 + all.len() as u32).unwrap();
        let reader = HealthReader::attach(table.read_only().unwrap()).unwrap();
        let balancing = Balancing {
            lb: Balance::RoundRobin,
            ..Balancing::default()
        };
        let pool = Pool::new(all.to_vec(), balancing, BodyLimit::default())
            .checked(Verdicts::new(Arc::new(reader), 1));
        (Arc::new(pool), table)
    }

    #[test]
    fn a_backend_down_by_the_demuxs_check_is_left_out_and_counted() {
        use ringmux_ring::health::Verdict;
        let all = [backend(1), backend(2)];
        let (pool, table) = checked(&all);
        let picks = |n| {
            (0..n)
                .map(|_| pool.choose(client(1), &[]).label.clone())
                .collect::<Vec<_>>()
        };
        // Another route's slot down, ours without a verdict: both are chosen.
        table.set(0, Verdict::Down);
        let mut got = picks(4);
        got.sort();
        got.dedup();
        assert_eq!(got.len(), 2, "{got:?}");
        table.set(2, Verdict::Down);
        assert!(picks(4).iter().all(|l| *l == all[0].label));
        assert_eq!(all[1].skipped_down.load(Ordering::Relaxed), 4);
        assert_eq!(all[0].skipped_down.load(Ordering::Relaxed), 0);
        // Up again: chosen again.
        table.set(2, Verdict::Up);
        assert!(picks(4).contains(&all[1].label));
        assert!(!pool.all_down());
    }

    #[tokio::test]
    async fn every_backend_down_is_a_503_with_none_tried() {
        use ringmux_ring::health::Verdict;
        let all = [backend(1), backend(2)];
        let (pool, table) = checked(&all);
        table.set(1, Verdict::Down);
        table.set(2, Verdict::Down);
        let request = Request::get("/x").body(empty_body()).unwrap();
        let Exchange::Reply(status, body) = pool.exchange(request, client(1), false).await else {
            panic!("a reply of ringmux's own");
        };
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert!(body.starts_with(b"no healthy upstream"));
        assert!(all.iter().all(|b| b.requests.load(Ordering::Relaxed) == 0));
        assert!(all
            .iter()
            .all(|b| b.skipped_down.load(Ordering::Relaxed) == 1));
    }

    /// Tunnel counters that count nothing: a refused tunnel is counted by the pool.
    struct NoCounts;

    impl super::super::TunnelCounters for NoCounts {
        fn opened(&self) {}
        fn refused(&self) {}
        fn closed(&self, _: super::super::TunnelEnd) {}
        fn moved(&self, _: bool, _: u64) {}
    }

    #[tokio::test]
    async fn every_backend_down_refuses_a_tunnel_with_a_503_and_none_tried() {
        use ringmux_ring::health::Verdict;
        let all = [backend(1), backend(2)];
        let (pool, table) = checked(&all);
        table.set(1, Verdict::Down);
        table.set(2, Verdict::Down);
        let mut head = Request::get("/ws").body(()).unwrap();
        let side = ClientSide {
            upgrade: hyper::upgrade::on(&mut head),
            stats: Arc::new(NoCounts),
            tunnels: Arc::default(),
            hold: Box::new(()),
        };
        let ask = Ask::Upgrade(http::HeaderValue::from_static("websocket"));
        let (parts, ()) = head.into_parts();
        let opened = pool.tunnel(parts, ask, client(1), side, &mut None).await;
        let Opened::Exchange(Exchange::Reply(status, body)) = opened else {
            panic!("a reply of ringmux's own");
        };
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert!(body.starts_with(b"no healthy upstream"));
        assert!(all
            .iter()
            .all(|b| b.skipped_down.load(Ordering::Relaxed) == 1));
    }

    #[test]
    fn failures_in_a_window_eject_for_a_while() {
        let h = Health::default();
        let passive = PassiveHealth {
            max_fails: 3,
            fail_window: HealthSeconds::try_from(10).unwrap(),
            eject_for: HealthSeconds::try_from(30).unwrap(),
        };
        // Two failures, then the window passes: they no longer count.
        assert!(!h.fail(&passive, 1_000));
        assert!(!h.fail(&passive, 2_000));
        assert!(!h.fail(&passive, 11_000));
        assert!(!h.fail(&passive, 12_000));
        assert!(!h.ejected(12_000));
        // A success clears the count.
        h.succeeded();
        assert!(!h.fail(&passive, 13_000));
        assert!(!h.fail(&passive, 14_000));
        assert!(h.fail(&passive, 15_000), "the third within 10 s");
        assert!(h.ejected(15_000) && h.ejected(44_999));
        assert!(!h.fail(&passive, 20_000), "ejected already: not again");
        assert!(!h.ejected(45_000), "chosen again after 30 s");
        let never = PassiveHealth {
            max_fails: 0,
            ..passive
        };
        let h = Health::default();
        assert!((0..100).all(|t| !h.fail(&never, t)));
    }
}
