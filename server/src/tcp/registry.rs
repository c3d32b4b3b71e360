//! Each connection as its listener and its own task both see it ([`Tracked`]: handshake,
//! open, closing; requests in flight and since when it is idle), and the listener's set of them
//! ([`Registry`]) that holds the cap: at it, the connection idle longest is asked to make room.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

use crate::stats::ServerStats;

/// How long a connection asked to finish may stay without a request in flight before it is
/// closed anyway (and closed gracefully): an HTTP/2 client has that long to answer the PING of
/// a graceful GOAWAY (RFC 9113 §6.8), which a round trip does.
pub(super) const GOAWAY_WAIT: Duration = Duration::from_secs(5);

/// [`Tracked::phase`]: the TLS handshake; neither idle nor busy.
pub(super) const HANDSHAKE: u8 = 0;
/// [`Tracked::phase`]: serving HTTP; idle when no request is in flight.
pub(super) const OPEN: u8 = 1;
/// [`Tracked::phase`]: asked to finish, or closing; not counted against the cap.
pub(super) const CLOSING: u8 = 2;

/// One connection as its listener and its task both see it: whether it is idle and since when,
/// and the listener's request that it make room. The connection's task writes `phase` (the
/// listener only moves an idle connection from [`OPEN`] to [`CLOSING`]); its requests write
/// `in_flight` and `idle_since_ms`.
pub(super) struct Tracked {
    /// Accept order: of two connections idle since the same millisecond, the older goes first.
    seq: u64,
    /// The listener's start, from which `idle_since_ms` counts.
    epoch: Instant,
    /// [`HANDSHAKE`], [`OPEN`] or [`CLOSING`].
    pub(super) phase: AtomicU8,
    /// Requests in flight (HTTP/2 streams): from hyper's call of the service to the end of the
    /// response body, or its drop.
    in_flight: AtomicU32,
    /// When `in_flight` last fell to 0 (before any request: when the connection opened), in
    /// milliseconds since `epoch`.
    idle_since_ms: AtomicU64,
    /// Wakes the task once the listener moved it to [`CLOSING`].
    pub(super) evict: Notify,
}

impl Tracked {
    /// The handshake is done: it serves, and is idle until its first request.
    pub(super) fn open(&self) {
        self.idle_since_ms
            .store(self.ms_since_epoch(Instant::now()), Ordering::Relaxed);
        let _ = self
            .phase
            .compare_exchange(HANDSHAKE, OPEN, Ordering::Relaxed, Ordering::Relaxed);
    }

    /// A request begins (hyper called the service): in flight, on this connection and in
    /// `stats`, until the returned guard drops.
    pub(super) fn begin(self: &Arc<Self>, stats: &Arc<ServerStats>) -> InFlight {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        InFlight(self.clone(), stats.begin_request())
    }

    /// When the connection is due for its next step if no request comes: the idle timeout
    /// (`idle_timeout`, if it has one) or, once it was asked to finish (at `asked_at`), being
    /// given up on ([`GOAWAY_WAIT`] without a request in flight since then). While a request is
    /// in flight: that long from now, to look again.
    pub(super) fn step_at(
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
pub(super) struct InFlight(
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

/// The connections of one listener, for its cap.
pub(super) struct Registry {
    epoch: Instant,
    next_seq: u64,
    connections: HashMap<tokio::task::Id, Arc<Tracked>>,
}

/// What the cap says to a new connection.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Admission {
    /// Under the cap.
    Room,
    /// At the cap: the connection idle longest was asked to finish.
    MadeRoom,
    /// At the cap with none idle (or as many again closing): close the new one.
    Full,
}

impl Registry {
    pub(super) fn new() -> Registry {
        Registry {
            epoch: Instant::now(),
            next_seq: 0,
            connections: HashMap::new(),
        }
    }

    /// Whether a new connection may be served under `max`, making room if it takes that: the
    /// connection idle longest moves to [`CLOSING`] and its task is woken to finish it. Looks
    /// at every connection, but only at the cap.
    pub(super) fn admit(&mut self, max: usize) -> Admission {
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
    pub(super) fn next(&mut self) -> Arc<Tracked> {
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

    pub(super) fn insert(&mut self, task: tokio::task::Id, tracked: Arc<Tracked>) {
        self.connections.insert(task, tracked);
    }

    pub(super) fn remove(&mut self, task: tokio::task::Id) {
        self.connections.remove(&task);
    }
}
