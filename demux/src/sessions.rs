//! The demux's half of the cross-instance TLS session store: one shared, bounded, single-use
//! cache ([`SessionCache`]) and one thread per worker answering its session socket. Workers
//! store the sessions they issue tickets for and take them back on resumption, so 0-RTT works
//! whichever instance a resumed connection lands on. The worker's half is
//! `ringmux_worker::sessions`; the wire format is `ringmux_proto::session`, specified in
//! `control-protocol.md` ("Session store").
//!
//! Every request is untrusted input: memory stays bounded ([`CacheLimits`]), keys are hashed
//! with SipHash under a random key (no hash flooding), malformed or oversized requests are
//! dropped and counted, never a panic. A worker can insert sessions under keys of its choosing;
//! it can take only a session whose ticket came in a ClientHello the demux routed to its
//! instance ([`TakeGate`], `tickets.rs`); it cannot list keys. What a worker costs is bounded
//! too: each instance's sessions have a quota of the cache (so one instance's PUTs evict only
//! its own oldest sessions), and each worker's requests a rate ([`crate::budget::SESSIONS`]):
//! past it they are answered "not stored" / "not found" unserved and counted, and past the
//! budget's drop rate its socket is not read until the budget allows.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use ringmux_proto::session::{decode_reply, encode_reply, Op, Request, MAX_REQUEST_LEN};
use tracing::{debug, warn};

use crate::budget::{self, Budget, MessageKind, Verdict};
use crate::metrics::{Counters, TakeResult};
use crate::sys;
use crate::tickets::{Claim, TicketBindings};

/// How long a session may be resumed: six hours, the ticket lifetime workers announce.
pub const TICKET_LIFETIME: Duration = Duration::from_secs(6 * 60 * 60);

/// Serves every worker's session requests from one cache, each held to its instance's
/// ticket bindings.
pub struct Sessions {
    cache: Arc<SessionCache>,
    tickets: Option<Arc<TicketBindings>>,
    counters: Arc<Counters>,
}

impl Sessions {
    /// `tickets`: the bindings the data plane records, `None` where it sees no ClientHello
    /// (kernel steering): then every TAKE is granted. `counters`: where TAKEs are counted by
    /// [`TakeResult`].
    /// The cache is shared by `counters.instance_count` instances, each with an equal quota.
    pub fn new(tickets: Option<Arc<TicketBindings>>, counters: Arc<Counters>) -> Self {
        let limits = CacheLimits::default().shared_by(counters.instance_count);
        Sessions {
            cache: Arc::new(SessionCache::with_limits(limits)),
            tickets,
            counters,
        }
    }

    /// The cache (for a hand-over to a new process image).
    pub fn cache(&self) -> &Arc<SessionCache> {
        &self.cache
    }

    /// Serves instance `i`'s session socket on its own thread until the worker closes it
    /// (exits or dies), its sessions under the instance's quota and its requests within
    /// [`budget::SESSIONS`]; a malformed request is counted and answered with nothing.
    pub fn serve(&self, instance: u8, sock: OwnedFd) {
        let cache = self.cache.clone();
        let gate = TakeGate::Instance {
            instance,
            tickets: self.tickets.clone(),
            counters: self.counters.clone(),
        };
        let spawned = std::thread::Builder::new()
            .name(format!("sessions-{instance}"))
            .spawn(move || {
                let within = Some(budget::SESSIONS);
                if let Err(e) = cache.serve_worker_within(sock, &gate, within) {
                    tracing::warn!(instance, error = %e, "session socket failed");
                }
            });
        if let Err(e) = spawned {
            // Without the thread the worker's lookups time out: resumption degrades to full
            // handshakes, nothing else breaks.
            tracing::error!(instance, error = %e, "could not start the session thread");
        }
    }
}

/// Which TAKEs a session thread serves.
pub enum TakeGate {
    /// Those of sessions whose ticket the demux saw in a ClientHello it routed to `instance`
    /// (`tickets.rs`), or every one without `tickets` (`--forward reuseport`: the kernel
    /// steers, the demux sees no ClientHello); every result counted in `counters`. What each
    /// worker's thread uses.
    Instance {
        instance: u8,
        tickets: Option<Arc<TicketBindings>>,
        counters: Arc<Counters>,
    },
    /// Every TAKE: the store on its own, for tests of its semantics.
    Open,
}

impl TakeGate {
    /// The reply to `request` if the gate refuses it (a TAKE of a session this instance may
    /// not have: answered "not found", the session stays), else `None`.
    fn refuses(&self, request: &[u8]) -> Option<Vec<u8>> {
        let TakeGate::Instance {
            instance,
            tickets,
            counters,
        } = self
        else {
            return None;
        };
        let tickets = tickets.as_ref()?;
        let req = Request::parse(request).filter(|r| r.op == Op::Take)?;
        let result = match tickets.claim(
            req.key,
            *instance,
            ringmux_ring::monotonic_ns() / 1_000_000_000,
        ) {
            Claim::Granted => return None,
            Claim::Foreign => TakeResult::Foreign,
            Claim::Unbound => TakeResult::Unbound,
        };
        counters.count_take(result);
        Some(encode_reply(req.req_id, None))
    }

    /// The instance whose sessions the thread stores (charged to its quota), if any.
    fn instance(&self) -> Option<u8> {
        match self {
            TakeGate::Instance { instance, .. } => Some(*instance),
            TakeGate::Open => None,
        }
    }

    /// Counts a request dropped past the worker's budget.
    fn dropped(&self) {
        if let TakeGate::Instance {
            instance, counters, ..
        } = self
        {
            // The instance's lane in the first generation slot (lane numbers are `slot *
            // instances + instance`): the metric sums an instance's lanes.
            if let Some(lane) = counters.instances.get(usize::from(*instance)) {
                MessageKind::Session.count_dropped(lane);
            }
        }
    }

    /// Counts a TAKE the store answered with `reply`.
    fn answered(&self, request: &[u8], reply: &[u8]) {
        if let TakeGate::Instance { counters, .. } = self {
            if Request::parse(request).is_some_and(|r| r.op == Op::Take) {
                let found = matches!(decode_reply(reply), Some((_, Some(_))));
                counters.count_take(if found {
                    TakeResult::Hit
                } else {
                    TakeResult::Miss
                });
            }
        }
    }
}

/// Bounds of a [`SessionCache`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CacheLimits {
    /// Most entries; the oldest is evicted to make room.
    pub max_entries: usize,
    /// Most bytes of keys and values plus [`ENTRY_OVERHEAD`] per entry; the oldest entries are
    /// evicted to make room. Bounds memory even if a worker stores only maximal values.
    pub max_bytes: usize,
    /// Entries older than this are forgotten.
    pub ttl: Duration,
    /// Most entries of one instance: its PUT past them evicts its own oldest.
    pub instance_entries: usize,
    /// Most bytes of one instance (counted as for `max_bytes`): its PUT past them evicts its
    /// own oldest.
    pub instance_bytes: usize,
}

/// Bytes charged per entry on top of its key and value (map and order bookkeeping).
pub const ENTRY_OVERHEAD: usize = 128;

impl Default for CacheLimits {
    /// 65 536 entries, 64 MiB, 6 h ([`TICKET_LIFETIME`]); one instance may hold all of it.
    fn default() -> Self {
        CacheLimits {
            max_entries: 65_536,
            max_bytes: 64 << 20,
            ttl: TICKET_LIFETIME,
            instance_entries: 65_536,
            instance_bytes: 64 << 20,
        }
    }
}

impl CacheLimits {
    /// These limits with each of `instances` instances held to an equal share of the entries
    /// and bytes: the quotas add up to the whole, so no instance's PUT ever evicts another's
    /// session.
    pub fn shared_by(self, instances: usize) -> Self {
        let n = instances.max(1);
        CacheLimits {
            instance_entries: self.max_entries / n,
            instance_bytes: self.max_bytes / n,
            ..self
        }
    }
}

/// Counters and gauges of a [`SessionCache`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// PUTs stored.
    pub puts: u64,
    /// TAKEs that found their key.
    pub hits: u64,
    /// TAKEs that did not (never stored, already taken, evicted or expired).
    pub misses: u64,
    /// Entries evicted to stay within [`CacheLimits`] (an instance's own, past its quota, or
    /// the oldest of all).
    pub evictions: u64,
    /// Entries dropped because they were older than [`CacheLimits::ttl`].
    pub expired: u64,
    /// Requests dropped unanswered: malformed, unknown op, key or value out of bounds.
    pub malformed: u64,
    /// Requests read past the worker's budget and not served ([`crate::budget`]).
    pub over_budget: u64,
    /// Well-formed PUTs refused because the entry can never fit [`CacheLimits`].
    pub refused: u64,
    /// Replies not sent because the worker's socket was full or gone.
    pub dropped_replies: u64,
    /// Entries now.
    pub entries: u64,
    /// Bytes charged now (see [`CacheLimits::max_bytes`]).
    pub bytes: u64,
}

/// The demux's session cache, shared by all workers: bounded, FIFO eviction (within an
/// instance's quota first), entries expire after a TTL, TAKE removes (single use).
/// Thread-safe; one thread per worker runs [`SessionCache::serve_worker_within`].
pub struct SessionCache {
    limits: CacheLimits,
    inner: Mutex<Store>,
}

struct Store {
    /// std's `HashMap` hashes with SipHash-1-3 under a per-map random key, so worker-chosen
    /// keys cannot force collisions.
    map: HashMap<Vec<u8>, Entry>,
    /// Insertion order: sequence number → key. Oldest first, which is also the expiry order.
    order: BTreeMap<u64, Vec<u8>>,
    /// Each instance's entries, to hold it to its quota.
    owned: HashMap<u8, Owned>,
    next_seq: u64,
    bytes: usize,
    stats: CacheStats,
    /// Handed over to a new process image ([`SessionCache::freeze`]): requests go unanswered.
    frozen: bool,
}

struct Entry {
    seq: u64,
    stored_at: Instant,
    value: Vec<u8>,
    /// The instance that stored it; `None` for the store on its own ([`SessionCache::handle`])
    /// and for entries an image of the demux from before quotas handed over.
    owner: Option<u8>,
}

/// One instance's share of the cache.
#[derive(Default)]
struct Owned {
    /// Its entries' sequence numbers (keys of `Store::order`), oldest first.
    seqs: std::collections::BTreeSet<u64>,
    bytes: usize,
}

/// One entry of the cache as handed to a new process image ([`SessionCache::freeze`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Frozen {
    pub key: Vec<u8>,
    pub value: Vec<u8>,
    /// Its age when frozen.
    pub age: Duration,
    /// The instance that stored it (see [`SessionCache::handle_as`]).
    pub instance: Option<u8>,
}

/// One entry of the session cache as `ringmux upgrade`'s document carries it
/// (`upgrade::State::sessions`): [`Frozen`] in hex.
#[derive(serde::Serialize, serde::Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct SessionEntry {
    /// Hex.
    pub key: String,
    pub value: String,
    /// How old it was when handed over.
    pub age_ms: u64,
    /// The instance that stored it, charged to its quota of the cache; absent from an image
    /// from before quotas (such an entry is held to the global limits alone), and an image from
    /// before quotas ignores it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instance: Option<u8>,
}

impl SessionEntry {
    /// The entry as the old image writes it.
    pub fn freeze(e: Frozen) -> SessionEntry {
        SessionEntry {
            key: hex::encode(e.key),
            value: hex::encode(e.value),
            age_ms: e.age.as_millis() as u64,
            instance: e.instance,
        }
    }

    /// The entry for a cache of `instances` instances; `None` if it does not decode.
    pub fn thaw(self, instances: u8) -> Option<Frozen> {
        Some(Frozen {
            key: hex::decode(self.key).ok()?,
            value: hex::decode(self.value).ok()?,
            age: Duration::from_millis(self.age_ms),
            // An instance this image does not have (the count is the same across an upgrade,
            // so only a forged state) is held to the global limits alone.
            instance: self.instance.filter(|i| *i < instances),
        })
    }
}

impl SessionCache {
    /// A cache with [`CacheLimits::default`].
    pub fn new() -> Self {
        Self::with_limits(CacheLimits::default())
    }

    /// A cache with explicit limits.
    pub fn with_limits(limits: CacheLimits) -> Self {
        SessionCache {
            limits,
            inner: Mutex::new(Store {
                map: HashMap::new(),
                order: BTreeMap::new(),
                owned: HashMap::new(),
                next_seq: 0,
                bytes: 0,
                stats: CacheStats::default(),
                frozen: false,
            }),
        }
    }

    /// The limits.
    pub fn limits(&self) -> CacheLimits {
        self.limits
    }

    /// Counters since creation, and the current size.
    pub fn stats(&self) -> CacheStats {
        let store = self.store();
        CacheStats {
            entries: store.map.len() as u64,
            bytes: store.bytes as u64,
            ..store.stats
        }
    }

    /// Handles one request: the reply to send back, or `None` for a malformed request (which
    /// is counted). Never panics on any input.
    pub fn handle(&self, request: &[u8]) -> Option<Vec<u8>> {
        self.handle_at(request, Instant::now())
    }

    /// [`SessionCache::handle`] as if the time were `now` (for tests of expiry).
    pub fn handle_at(&self, request: &[u8], now: Instant) -> Option<Vec<u8>> {
        self.handle_as(None, request, now)
    }

    /// Handles one request of `instance` at `now`: a PUT is charged to its quota
    /// ([`CacheLimits::instance_entries`], [`CacheLimits::instance_bytes`]) and evicts its own
    /// oldest sessions to stay within it; `None` is held to the global limits alone.
    pub fn handle_as(&self, instance: Option<u8>, request: &[u8], now: Instant) -> Option<Vec<u8>> {
        let mut store = self.store();
        if store.frozen {
            return None;
        }
        let Some(req) = Request::parse(request) else {
            store.stats.malformed += 1;
            let n = store.stats.malformed;
            if n.is_power_of_two() {
                warn!(
                    len = request.len(),
                    total = n,
                    "malformed session store request"
                );
            }
            return None;
        };
        store.expire(now, self.limits.ttl);
        let value = match req.op {
            Op::Put => store
                .put(req.key, req.value, now, &self.limits, instance)
                .then(Vec::new),
            Op::Take => store.take(req.key, now, self.limits.ttl),
        };
        Some(encode_reply(req.req_id, value.as_deref()))
    }

    /// Serves one worker's session socket until the worker closes it (returns `Ok`, e.g. the
    /// worker died) or a fatal socket error (`Err`), its TAKEs held to `gate`. Blocking: run it
    /// on a dedicated thread, one per worker. Works whether or not `sock` is in non-blocking
    /// mode.
    ///
    /// Replies are sent without blocking: if the worker's receive queue is full (it is not
    /// reading its replies), the reply is dropped and counted, and the worker times out. To
    /// stop the loop while the worker lives, `shutdown(2)` a duplicate of `sock`.
    pub fn serve_worker(self: Arc<Self>, sock: OwnedFd, gate: &TakeGate) -> io::Result<()> {
        self.serve_worker_within(sock, gate, None)
    }

    /// [`SessionCache::serve_worker`], its PUTs charged to the gate's instance, and with
    /// `limits` its requests held to a [`Budget`]: past the serve rate a request is answered
    /// "not stored" / "not found" at once, unserved, and counted (the worker does a full
    /// handshake instead of waiting out its timeout); past the drop rate the socket is not read
    /// until the budget allows, so a flood costs this thread a bounded number of reads a second.
    pub fn serve_worker_within(
        self: Arc<Self>,
        sock: OwnedFd,
        gate: &TakeGate,
        limits: Option<budget::Limits>,
    ) -> io::Result<()> {
        let fd = sock.as_fd();
        let mut buf = vec![0u8; MAX_REQUEST_LEN + 1];
        let mut budget = limits.map(|l| Budget::new(l, Instant::now()));
        loop {
            if let Some(at) = budget.as_mut().and_then(|b| b.read_after(Instant::now())) {
                // A pause of the budget (5 ms with `SESSIONS`): a shutdown of the socket
                // meanwhile is seen right after.
                std::thread::sleep(at.saturating_duration_since(Instant::now()));
                continue;
            }
            let n = match sys::recv_packet(fd, &mut buf) {
                Ok(0) => {
                    debug!("session socket closed by the worker");
                    return Ok(());
                }
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    match sys::poll_readable(&[fd], None) {
                        Ok(_) => continue,
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                        Err(e) => return Err(e),
                    }
                }
                Err(e) if sys::is_disconnect(&e) => return Ok(()),
                Err(e) => return Err(e),
            };
            // A truncated message (n > MAX_REQUEST_LEN, from MSG_TRUNC) is passed on as an
            // oversized one so that `handle` counts it.
            let request = if n <= MAX_REQUEST_LEN {
                &buf[..n]
            } else {
                &buf[..]
            };
            let over = budget
                .as_mut()
                .is_some_and(|b| b.spend(Instant::now()) == Verdict::Drop);
            let reply = if over {
                // Unserved: neither the ticket bindings nor the cache's entries are touched.
                self.store().stats.over_budget += 1;
                gate.dropped();
                match Request::parse(request) {
                    Some(req) => encode_reply(req.req_id, None),
                    None => continue,
                }
            } else {
                match gate.refuses(request) {
                    Some(refusal) => refusal,
                    None => {
                        let Some(reply) = self.handle_as(gate.instance(), request, Instant::now())
                        else {
                            continue;
                        };
                        gate.answered(request, &reply);
                        reply
                    }
                }
            };
            match sys::send_packet(fd, &reply) {
                Ok(()) => {}
                Err(e) if sys::is_disconnect(&e) => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    self.store().stats.dropped_replies += 1;
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Every live entry, oldest first: key, value and age at `now`. From here on requests go
    /// unanswered (a worker asking meanwhile times out and does a full handshake) until
    /// [`SessionCache::thaw`]: what a new process image takes over is all there is.
    pub fn freeze(&self, now: Instant) -> Vec<Frozen> {
        let mut store = self.store();
        store.frozen = true;
        store.expire(now, self.limits.ttl);
        store
            .order
            .values()
            .filter_map(|k| {
                let e = store.map.get(k)?;
                Some(Frozen {
                    key: k.clone(),
                    value: e.value.clone(),
                    age: now.saturating_duration_since(e.stored_at),
                    instance: e.owner,
                })
            })
            .collect()
    }

    /// Answers requests again (the hand-over did not happen).
    pub fn thaw(&self) {
        self.store().frozen = false;
    }

    /// Stores entries a previous process image handed over, as old as they were then and
    /// charged to the instances that stored them.
    pub fn restore(&self, entries: Vec<Frozen>, now: Instant) {
        let mut store = self.store();
        for e in entries {
            let stored_at = now.checked_sub(e.age).unwrap_or(now);
            store.put(&e.key, &e.value, stored_at, &self.limits, e.instance);
        }
        store.stats.puts = 0;
    }

    fn store(&self) -> MutexGuard<'_, Store> {
        // Nothing panics under this lock; should that change, the maps stay consistent between
        // statements that could panic, so keep serving.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Default for SessionCache {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for SessionCache {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SessionCache")
            .field("limits", &self.limits)
            .field("stats", &self.stats())
            .finish()
    }
}

impl Store {
    fn cost(key: &[u8], value: &[u8]) -> usize {
        key.len() + value.len() + ENTRY_OVERHEAD
    }

    fn remove(&mut self, key: &[u8]) -> Option<Entry> {
        let entry = self.map.remove(key)?;
        self.order.remove(&entry.seq);
        let cost = Self::cost(key, &entry.value);
        self.bytes = self.bytes.saturating_sub(cost);
        if let Some(o) = entry.owner {
            if let Some(owned) = self.owned.get_mut(&o) {
                owned.seqs.remove(&entry.seq);
                owned.bytes = owned.bytes.saturating_sub(cost);
                if owned.seqs.is_empty() {
                    self.owned.remove(&o);
                }
            }
        }
        Some(entry)
    }

    /// Removes the oldest entry.
    fn pop_oldest(&mut self) -> bool {
        let Some(key) = self.order.first_key_value().map(|(_, k)| k.clone()) else {
            return false;
        };
        if self.remove(&key).is_none() {
            // An order entry without its map entry cannot happen (both change together);
            // drop it all the same, so that eviction always makes progress.
            self.order.pop_first();
        }
        true
    }

    /// Removes the oldest entry of `instance`.
    fn pop_oldest_of(&mut self, instance: u8) -> bool {
        let Some(owned) = self.owned.get_mut(&instance) else {
            return false;
        };
        let Some(seq) = owned.seqs.pop_first() else {
            return false;
        };
        match self.order.get(&seq).cloned() {
            Some(key) => {
                self.remove(&key);
            }
            None => {
                // As in `pop_oldest`: never left half-done.
                if owned.seqs.is_empty() {
                    self.owned.remove(&instance);
                }
            }
        }
        true
    }

    /// Drops entries older than `ttl`, oldest first (insertion order is age order).
    fn expire(&mut self, now: Instant, ttl: Duration) {
        while let Some((_, key)) = self.order.first_key_value() {
            let expired = self
                .map
                .get(key)
                .is_none_or(|e| now.saturating_duration_since(e.stored_at) >= ttl);
            if !expired {
                break;
            }
            self.pop_oldest();
            self.stats.expired += 1;
        }
    }

    /// Stores `value` under `key` for `owner`; `false` if it can never fit the limits (or the
    /// owner's quota).
    fn put(
        &mut self,
        key: &[u8],
        value: &[u8],
        now: Instant,
        limits: &CacheLimits,
        owner: Option<u8>,
    ) -> bool {
        let cost = Self::cost(key, value);
        self.remove(key);
        let quota_refuses =
            owner.is_some() && (limits.instance_entries == 0 || cost > limits.instance_bytes);
        if limits.max_entries == 0 || cost > limits.max_bytes || quota_refuses {
            self.stats.refused += 1;
            return false;
        }
        if let Some(o) = owner {
            // Its own oldest first: within its quota an instance never touches another's.
            while self.owned.get(&o).is_some_and(|owned| {
                owned.seqs.len() >= limits.instance_entries
                    || owned.bytes + cost > limits.instance_bytes
            }) {
                if !self.pop_oldest_of(o) {
                    break;
                }
                self.stats.evictions += 1;
            }
        }
        while self.map.len() >= limits.max_entries || self.bytes + cost > limits.max_bytes {
            if !self.pop_oldest() {
                break;
            }
            self.stats.evictions += 1;
        }
        let seq = self.next_seq;
        self.next_seq += 1;
        self.order.insert(seq, key.to_vec());
        self.map.insert(
            key.to_vec(),
            Entry {
                seq,
                stored_at: now,
                value: value.to_vec(),
                owner,
            },
        );
        self.bytes += cost;
        if let Some(o) = owner {
            let owned = self.owned.entry(o).or_default();
            owned.seqs.insert(seq);
            owned.bytes += cost;
        }
        self.stats.puts += 1;
        true
    }

    fn take(&mut self, key: &[u8], now: Instant, ttl: Duration) -> Option<Vec<u8>> {
        // `expire` only looks at the oldest entries; an entry can still be stale here if the
        // caller's clock went backwards between calls (tests), so check its own age too.
        let fresh = self
            .map
            .get(key)
            .map(|e| now.saturating_duration_since(e.stored_at) < ttl);
        let value = match fresh {
            Some(true) => self.remove(key).map(|e| e.value),
            Some(false) => {
                self.remove(key);
                self.stats.expired += 1;
                None
            }
            None => None,
        };
        if value.is_some() {
            self.stats.hits += 1;
        } else {
            self.stats.misses += 1;
        }
        value
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ringmux_proto::session::encode_request;

    /// 8 entries and 8 KiB in all, shared by 2 instances.
    fn cache() -> SessionCache {
        SessionCache::with_limits(
            CacheLimits {
                max_entries: 8,
                max_bytes: 8 << 10,
                ..CacheLimits::default()
            }
            .shared_by(2),
        )
    }

    fn put(c: &SessionCache, instance: Option<u8>, key: &[u8], value: &[u8], now: Instant) {
        let reply = c.handle_as(instance, &encode_request(Op::Put, 1, key, value), now);
        assert_eq!(
            reply.as_deref().and_then(decode_reply),
            Some((1, Some(&[][..]))),
            "PUT {key:?} stored"
        );
    }

    fn found(c: &SessionCache, key: &[u8], now: Instant) -> bool {
        let reply = c.handle_at(&encode_request(Op::Take, 2, key, b""), now);
        matches!(reply.as_deref().and_then(decode_reply), Some((2, Some(_))))
    }

    #[test]
    fn an_instance_past_its_entries_evicts_only_its_own_oldest() {
        let c = cache();
        let now = Instant::now();
        put(&c, Some(0), b"zero-a", b"v", now);
        put(&c, Some(0), b"zero-b", b"v", now);
        for k in 0..100u32 {
            put(&c, Some(1), format!("one-{k}").as_bytes(), b"v", now);
        }
        let s = c.stats();
        assert_eq!(
            s.entries, 6,
            "2 of instance 0, instance 1's quota of 4: {s:?}"
        );
        assert_eq!(s.evictions, 96);
        assert!(found(&c, b"zero-a", now) && found(&c, b"zero-b", now));
        // Instance 1 keeps its newest four.
        assert!(found(&c, b"one-99", now) && found(&c, b"one-96", now));
        assert!(!found(&c, b"one-95", now));
    }

    #[test]
    fn an_instance_past_its_bytes_evicts_only_its_own_oldest() {
        let c = cache();
        let now = Instant::now();
        put(&c, Some(0), b"zero", &[0; 1000], now);
        // 1 KiB values: three fit in instance 1's 4 KiB with their overhead.
        for k in 0..50u32 {
            put(&c, Some(1), format!("one-{k}").as_bytes(), &[1; 1024], now);
        }
        let s = c.stats();
        assert!(s.bytes <= 8 << 10, "{s:?}");
        assert!(found(&c, b"zero", now));
        assert!(found(&c, b"one-49", now));
        assert!(!found(&c, b"one-0", now));
    }

    #[test]
    fn a_value_over_the_quota_is_refused_not_stored() {
        let c = cache();
        let now = Instant::now();
        put(&c, Some(0), b"zero", b"v", now);
        let big = encode_request(Op::Put, 3, b"big", &[0; 5000]);
        let reply = c.handle_as(Some(1), &big, now);
        assert_eq!(reply.as_deref().and_then(decode_reply), Some((3, None)));
        assert_eq!(c.stats().refused, 1);
        assert!(found(&c, b"zero", now));
    }

    #[test]
    fn without_an_instance_the_global_limits_alone_apply() {
        let c = cache();
        let now = Instant::now();
        for k in 0..20u32 {
            put(&c, None, format!("k-{k}").as_bytes(), b"v", now);
        }
        assert_eq!(c.stats().entries, 8);
        assert!(found(&c, b"k-19", now) && !found(&c, b"k-11", now));
    }

    #[test]
    fn a_hand_over_keeps_each_entry_charged_to_its_instance() {
        let c = cache();
        let now = Instant::now();
        put(&c, Some(0), b"zero", b"v", now);
        put(&c, Some(1), b"one", b"v", now);
        put(&c, None, b"old", b"v", now);
        let frozen = c.freeze(now);
        assert_eq!(
            frozen.iter().map(|e| e.instance).collect::<Vec<_>>(),
            [Some(0), Some(1), None]
        );
        let next = cache();
        next.restore(frozen, now);
        for k in 0..100u32 {
            put(&next, Some(1), format!("one-{k}").as_bytes(), b"v", now);
        }
        assert!(found(&next, b"zero", now) && found(&next, b"old", now));
        assert!(
            !found(&next, b"one", now),
            "instance 1's own oldest went first"
        );
        // An image from before quotas hands over entries without an instance.
        let json = r#"{"key":"6b","value":"76","age_ms":5}"#;
        let e: SessionEntry = serde_json::from_str(json).unwrap();
        assert_eq!(e.instance, None);
        assert!(!serde_json::to_string(&e).unwrap().contains("instance"));
    }

    #[test]
    fn quotas_add_up_to_no_more_than_the_whole() {
        for n in 1..=9 {
            let l = CacheLimits::default().shared_by(n);
            assert!(l.instance_entries * n <= l.max_entries, "{n}");
            assert!(l.instance_bytes * n <= l.max_bytes, "{n}");
        }
    }
}
