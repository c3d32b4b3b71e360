//! A TLS session store shared by all worker processes and held by the demux, so that 0-RTT
//! works whichever worker a resumed connection lands on.
//!
//! This module owns the wire format of the session-store socket and both of its ends: the
//! worker's [`RemoteSessionStore`] (a rustls [`StoresServerSessions`]) and the demux's
//! [`SessionCache`] with its per-worker [`SessionCache::serve_worker`] loop. It never touches
//! QUIC, HTTP or the datagram path.
//!
//! # Why
//!
//! A client's resumed connection uses a fresh random DCID, so it usually reaches another
//! worker than the one that issued its ticket. rustls 0.23 accepts 0-RTT only with *stateful*
//! resumption (`server/tls13.rs`: early data is allowed only if `!config.ticketer.enabled()`,
//! and tickets from a stateless ticketer carry no `early_data` extension), following RFC 8446
//! §8.1: a stateless ticket cannot be made single-use, so its early data could be replayed. With
//! a session store, rustls issues random 32-byte ticket IDs, [`StoresServerSessions::put`]s the
//! session under them, and on resumption [`StoresServerSessions::take`]s it: the store removes
//! the entry, so each ticket resumes (and carries early data) at most once. Workers are
//! separate processes, so the store lives in the demux and the workers reach it over a socket.
//!
//! # Wire format
//!
//! One Unix `SOCK_SEQPACKET` socket pair per worker, used for nothing else (see
//! [`session_socket_pair`]); one message per packet, integers little-endian:
//!
//! * request, worker → demux: `op u8 ‖ req_id u64 ‖ key_len u16 ‖ key ‖ value`, `op` one of
//!   [`Op`] (PUT = 1, GET = 2, TAKE = 3). `key_len` is 1..=[`MAX_KEY_LEN`]; `value` is
//!   0..=[`MAX_VALUE_LEN`] bytes for PUT and empty for GET and TAKE.
//! * reply, demux → worker, to every well-formed request: `req_id u64 ‖ status u8 ‖ value`.
//!   GET/TAKE: status 1 (found, `value` follows) or 0 (not found, nothing follows). PUT:
//!   status 1 (stored) or 0 (refused), never a value.
//!
//! A malformed request gets no reply (the worker times out), and is counted.
//!
//! # Ordering: PUT is acknowledged
//!
//! rustls calls `put` while building the `NewSessionTicket` message, before the ticket leaves
//! worker A, and issues the ticket only if `put` returns `true`. [`RemoteSessionStore::put`]
//! returns `true` only once the demux has *acknowledged* the PUT, so every ticket a client can
//! hold is already in the cache when it reaches worker B: B's TAKE cannot overtake A's PUT.
//!
//! A fire-and-forget PUT is not enough. It is queued on A's socket before the ticket leaves A,
//! but each worker's socket is served by its own demux thread, and when the machine is busy
//! A's thread can stay unscheduled while the client gets its ticket, connects to B and B's
//! thread answers B's TAKE with a miss: 0-RTT refused. The end-to-end test hit exactly this
//! on a loaded two-core box. The price of the acknowledgement is one round trip to the demux
//! per ticket (two per full handshake), microseconds when the demux thread is idle, at most
//! the timeout (then `put` returns `false` and that ticket is not issued).
//!
//! # Security properties
//!
//! * **Single use.** TAKE removes the entry under the cache's lock, so across all workers one
//!   ticket yields at most one successful resumption and so at most one acceptance of its
//!   0-RTT data. A replayed ClientHello (to the same or any other worker) finds nothing and
//!   falls back to a full handshake, in which rustls rejects the early data.
//! * **What a hostile worker can do.** The demux treats every request as untrusted input. A
//!   worker can only *insert* sessions (under keys of its choosing) and *look up or take*
//!   sessions whose key it already knows; it cannot list keys. Keys are 32 random bytes sent to
//!   the client inside the encrypted `NewSessionTicket`, but they come back in the clear in
//!   the ClientHello (QUIC Initial protection is not confidentiality), and the value holds the
//!   session's resumption secret, from which that resumption's 0-RTT keys follow. So a worker
//!   that could observe ClientHellos routed to *other* workers (which the demux never gives
//!   it) could read those sessions and decrypt their 0-RTT data; the ClientHellos routed to it,
//!   it takes itself. Inserting forged sessions gives it nothing: it holds the certificate's
//!   private key anyway. What it *can* do is deny service: flooding PUTs evicts other
//!   workers' sessions (those clients then do full handshakes), taking a key it knows costs
//!   that client its 0-RTT, and spamming requests costs the CPU of its own serving thread.
//!   Memory stays bounded ([`CacheLimits`]), keys are hashed with SipHash under a random key
//!   (no hash flooding), and malformed or oversized requests are dropped and counted, never a
//!   panic.
//! * **Worker side.** A dead, slow or hostile demux can make `put` fail (no ticket), make
//!   `get`/`take` return `None` (a full handshake), or hand back a wrong session; rustls then
//!   checks the PSK binder, which fails for a session that does not belong to the ticket, and
//!   aborts that handshake (`decrypt_error`). The worker never blocks longer than its timeout
//!   per request and never panics on a reply.
//!
//! # Limits
//!
//! * Every `put`/`get`/`take` blocks the worker's (single-threaded) runtime for one round trip
//!   to the demux, microseconds normally, at most the timeout ([`DEFAULT_TIMEOUT`], 50 ms) if
//!   the demux stalls. A lookup that times out returns `None`; if the late reply was a TAKE
//!   hit, that session is gone (safe: the client does a full handshake). A PUT that times out
//!   returns `false` (no ticket); if the demux stores it later, the entry is never used and
//!   ages out.
//! * rustls tells clients a stateful ticket lives 24 h (hard-coded), while the cache forgets
//!   entries after [`CacheLimits::ttl`] (default 6 h, like [`crate::tls::TICKET_LIFETIME`]) or
//!   when evicted (oldest first). A forgotten ticket means a full handshake.
//! * The cache dies with the demux: after a demux restart every client does a full handshake.
//! * A zero-length message reads as end-of-file on a `SOCK_SEQPACKET` socket, so a worker that
//!   sends one ends its own serving thread, as if it had died.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use rustls::server::StoresServerSessions;
use tracing::{debug, warn};

/// Longest key the store accepts. rustls uses 32-byte random ticket IDs; the key of a lookup is
/// the ticket a client presented, so it is attacker-controlled and checked before it is sent.
pub const MAX_KEY_LEN: usize = 255;
/// Longest session value the store accepts (rustls' encoded `ServerSessionValue`, typically a
/// few hundred bytes; more only with client certificates).
pub const MAX_VALUE_LEN: usize = 16 * 1024;
/// Request header: `op u8 ‖ req_id u64 ‖ key_len u16`.
pub const REQUEST_HEADER_LEN: usize = 1 + 8 + 2;
/// Reply header: `req_id u64 ‖ status u8`.
pub const REPLY_HEADER_LEN: usize = 8 + 1;
/// Largest valid request.
pub const MAX_REQUEST_LEN: usize = REQUEST_HEADER_LEN + MAX_KEY_LEN + MAX_VALUE_LEN;
/// Largest valid reply.
pub const MAX_REPLY_LEN: usize = REPLY_HEADER_LEN + MAX_VALUE_LEN;
/// How long a worker waits for the demux's reply to a request by default.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_millis(50);

const STATUS_NOT_FOUND: u8 = 0;
const STATUS_FOUND: u8 = 1;

/// Request operations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Op {
    /// Store `value` under `key`, replacing any previous value. Acknowledged (status 1) or
    /// refused (status 0).
    Put = 1,
    /// Look `key` up, leaving it in place.
    Get = 2,
    /// Look `key` up and remove it (single use).
    Take = 3,
}

impl Op {
    fn from_u8(b: u8) -> Option<Op> {
        match b {
            1 => Some(Op::Put),
            2 => Some(Op::Get),
            3 => Some(Op::Take),
            _ => None,
        }
    }
}

/// Encodes a request. No limits are checked here (tests use it to build oversized requests);
/// a `key` longer than `u16::MAX` bytes is cut to that length field's range.
pub fn encode_request(op: Op, req_id: u64, key: &[u8], value: &[u8]) -> Vec<u8> {
    let key = &key[..key.len().min(usize::from(u16::MAX))];
    let mut msg = Vec::with_capacity(REQUEST_HEADER_LEN + key.len() + value.len());
    msg.push(op as u8);
    msg.extend_from_slice(&req_id.to_le_bytes());
    // Cannot truncate: cut to u16::MAX above.
    msg.extend_from_slice(&(key.len() as u16).to_le_bytes());
    msg.extend_from_slice(key);
    msg.extend_from_slice(value);
    msg
}

/// Decodes a reply: `(req_id, Some(value))` if found (or stored, with an empty value),
/// `(req_id, None)` if not (or refused), `None` if the reply is malformed (too short or long,
/// unknown status, a value after status 0).
pub fn decode_reply(reply: &[u8]) -> Option<(u64, Option<&[u8]>)> {
    if reply.len() < REPLY_HEADER_LEN || reply.len() > MAX_REPLY_LEN {
        return None;
    }
    let req_id = u64::from_le_bytes(reply[..8].try_into().ok()?);
    let value = &reply[REPLY_HEADER_LEN..];
    match reply[8] {
        STATUS_FOUND => Some((req_id, Some(value))),
        STATUS_NOT_FOUND if value.is_empty() => Some((req_id, None)),
        _ => None,
    }
}

/// A connected `SOCK_SEQPACKET` pair for one worker's session store, close-on-exec:
/// `(demux_end, worker_end)`. The demux runs [`SessionCache::serve_worker`] on the first and
/// hands the second to the worker (SCM_RIGHTS in the hand-off).
pub fn session_socket_pair() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [-1; 2];
    // SAFETY: `fds` is a valid, writable array of two c_ints, as socketpair(2) requires.
    let rc = unsafe {
        libc::socketpair(
            libc::AF_UNIX,
            libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC,
            0,
            fds.as_mut_ptr(),
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: socketpair succeeded, so both descriptors are open and owned by nobody else.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

// ---------------------------------------------------------------------------------------------
// Worker half
// ---------------------------------------------------------------------------------------------

/// Counters of a [`RemoteSessionStore`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RemoteStats {
    /// PUTs the demux acknowledged (each one a ticket rustls issued).
    pub puts: u64,
    /// PUTs that returned `false`, so rustls issued no ticket: oversized, refused by the demux,
    /// timed out or failed (the last two also count in `timeouts` and `errors`).
    pub put_failures: u64,
    /// GET and TAKE requests answered "found".
    pub hits: u64,
    /// GET and TAKE requests answered "not found" (or refused locally: key too long).
    pub misses: u64,
    /// Requests with no matching reply within the timeout.
    pub timeouts: u64,
    /// Requests that failed on the socket (send or receive error, demux gone).
    pub errors: u64,
    /// Replies discarded: for an earlier, timed-out request, or malformed.
    pub stale_replies: u64,
}

/// The worker's session store: forwards rustls' `put`/`get`/`take` to the demux's
/// [`SessionCache`] over the worker's session socket.
///
/// Every call waits for the demux's reply for at most the timeout (default
/// [`DEFAULT_TIMEOUT`]). On timeout or any error `put` returns `false` (no ticket) and
/// `get`/`take` return `None` (full handshake); nothing panics. Once the demux has closed its
/// end, every call fails at once.
pub struct RemoteSessionStore {
    channel: Mutex<Channel>,
    timeout: Duration,
    puts: AtomicU64,
    put_failures: AtomicU64,
    hits: AtomicU64,
    misses: AtomicU64,
    timeouts: AtomicU64,
    errors: AtomicU64,
    stale_replies: AtomicU64,
}

struct Channel {
    fd: OwnedFd,
    /// Id of the next request; replies carrying another id are stale.
    next_id: u64,
    /// The demux end is closed (or the socket broke): stop trying.
    dead: bool,
    /// Receive buffer, one byte longer than the longest valid reply to detect oversize.
    buf: Vec<u8>,
}

/// Outcome of one request/reply exchange.
enum Exchange {
    /// Status 1: found (GET, TAKE) or stored (PUT, empty value).
    Yes(Vec<u8>),
    /// Status 0: not found or refused.
    No,
    TimedOut,
    Failed,
}

impl RemoteSessionStore {
    /// A store over the worker's end of its session socket, with [`DEFAULT_TIMEOUT`].
    pub fn new(fd: OwnedFd) -> Self {
        Self::with_timeout(fd, DEFAULT_TIMEOUT)
    }

    /// A store whose lookups wait at most `timeout` for the demux's reply.
    pub fn with_timeout(fd: OwnedFd, timeout: Duration) -> Self {
        RemoteSessionStore {
            channel: Mutex::new(Channel {
                fd,
                next_id: 1,
                dead: false,
                buf: vec![0; MAX_REPLY_LEN + 1],
            }),
            timeout,
            puts: AtomicU64::new(0),
            put_failures: AtomicU64::new(0),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            timeouts: AtomicU64::new(0),
            errors: AtomicU64::new(0),
            stale_replies: AtomicU64::new(0),
        }
    }

    /// The lookup timeout.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Counters since creation.
    pub fn stats(&self) -> RemoteStats {
        // Relaxed: independent statistics counters, nothing is published through them.
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        RemoteStats {
            puts: get(&self.puts),
            put_failures: get(&self.put_failures),
            hits: get(&self.hits),
            misses: get(&self.misses),
            timeouts: get(&self.timeouts),
            errors: get(&self.errors),
            stale_replies: get(&self.stale_replies),
        }
    }

    fn channel(&self) -> MutexGuard<'_, Channel> {
        // Nothing panics while the lock is held; if something ever did, the channel state is
        // still consistent (stale replies are filtered by id), so keep using it.
        self.channel.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn count(counter: &AtomicU64) {
        // Relaxed: statistics only.
        counter.fetch_add(1, Ordering::Relaxed);
    }

    fn lookup(&self, op: Op, key: &[u8]) -> Option<Vec<u8>> {
        if key.is_empty() || key.len() > MAX_KEY_LEN {
            // Not a ticket this store issued: a miss, without bothering the demux.
            Self::count(&self.misses);
            return None;
        }
        match self.exchange(op, key, &[]) {
            Some(Exchange::Yes(value)) => {
                Self::count(&self.hits);
                Some(value)
            }
            Some(Exchange::No) => {
                Self::count(&self.misses);
                None
            }
            _ => None,
        }
    }

    /// One exchange with the demux; timeouts and failures are counted here and come back as
    /// `None`.
    fn exchange(&self, op: Op, key: &[u8], value: &[u8]) -> Option<Exchange> {
        let result = self
            .channel()
            .exchange(op, key, value, self.timeout, &self.stale_replies);
        match result {
            Exchange::TimedOut => {
                Self::count(&self.timeouts);
                debug!(?op, timeout = ?self.timeout, "session store request timed out");
                None
            }
            Exchange::Failed => {
                Self::count(&self.errors);
                None
            }
            answered => Some(answered),
        }
    }
}

impl Channel {
    fn exchange(
        &mut self,
        op: Op,
        key: &[u8],
        value: &[u8],
        timeout: Duration,
        stale: &AtomicU64,
    ) -> Exchange {
        if self.dead {
            return Exchange::Failed;
        }
        let deadline = Instant::now() + timeout;
        // Replies that arrived after an earlier request timed out: drop them now, so the
        // socket's receive queue cannot fill up with them. Bounded by the deadline too: a
        // demux flooding replies must not hold the worker here.
        while Instant::now() < deadline {
            match recv(self.fd.as_fd(), &mut self.buf, libc::MSG_DONTWAIT) {
                Ok(0) => return self.died("session socket closed by the demux"),
                Ok(_) => {
                    stale.fetch_add(1, Ordering::Relaxed); // Relaxed: statistics only.
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return self.broken("receive", &e),
            }
        }
        let req_id = self.next_id;
        self.next_id = self.next_id.wrapping_add(1);
        let msg = encode_request(op, req_id, key, value);
        if let Err(e) = send_nonblocking(self.fd.as_fd(), &msg) {
            return self.broken("send", &e);
        }
        loop {
            let now = Instant::now();
            if now >= deadline {
                return Exchange::TimedOut;
            }
            match poll_readable(self.fd.as_fd(), Some(deadline - now)) {
                Ok(false) => return Exchange::TimedOut,
                Ok(true) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return self.broken("poll", &e),
            }
            let n = match recv(self.fd.as_fd(), &mut self.buf, libc::MSG_DONTWAIT) {
                Ok(0) => return self.died("session socket closed by the demux"),
                Ok(n) => n,
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
                    ) =>
                {
                    continue
                }
                Err(e) => return self.broken("receive", &e),
            };
            // `n` can exceed the buffer (MSG_TRUNC reports the real length): then it is too
            // long to be valid anyway.
            let reply = self.buf.get(..n).unwrap_or(&[]);
            match decode_reply(reply) {
                Some((id, Some(value))) if id == req_id => return Exchange::Yes(value.to_vec()),
                Some((id, None)) if id == req_id => return Exchange::No,
                _ => {
                    stale.fetch_add(1, Ordering::Relaxed); // Relaxed: statistics only.
                }
            }
        }
    }

    fn died(&mut self, why: &str) -> Exchange {
        if !self.dead {
            warn!("{why}: TLS resumption falls back to full handshakes");
        }
        self.dead = true;
        Exchange::Failed
    }

    fn broken(&mut self, what: &str, e: &io::Error) -> Exchange {
        if is_disconnect(e) {
            return self.died("session socket closed by the demux");
        }
        debug!(error = %e, "session store {what} failed");
        Exchange::Failed
    }
}

impl StoresServerSessions for RemoteSessionStore {
    fn put(&self, key: Vec<u8>, value: Vec<u8>) -> bool {
        if key.is_empty() || key.len() > MAX_KEY_LEN || value.len() > MAX_VALUE_LEN {
            Self::count(&self.put_failures);
            return false;
        }
        // Wait for the acknowledgement: see "Ordering" in the module docs.
        let stored = matches!(self.exchange(Op::Put, &key, &value), Some(Exchange::Yes(_)));
        Self::count(if stored {
            &self.puts
        } else {
            &self.put_failures
        });
        stored
    }

    fn get(&self, key: &[u8]) -> Option<Vec<u8>> {
        self.lookup(Op::Get, key)
    }

    fn take(&self, key: &[u8]) -> Option<Vec<u8>> {
        self.lookup(Op::Take, key)
    }

    fn can_cache(&self) -> bool {
        !self.channel().dead
    }
}

impl fmt::Debug for RemoteSessionStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RemoteSessionStore")
            .field("timeout", &self.timeout)
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

// ---------------------------------------------------------------------------------------------
// Demux half
// ---------------------------------------------------------------------------------------------

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
}

/// Bytes charged per entry on top of its key and value (map and order bookkeeping).
pub const ENTRY_OVERHEAD: usize = 128;

impl Default for CacheLimits {
    /// 65 536 entries, 64 MiB, 6 h ([`crate::tls::TICKET_LIFETIME`]).
    fn default() -> Self {
        CacheLimits {
            max_entries: 65_536,
            max_bytes: 64 << 20,
            ttl: crate::tls::TICKET_LIFETIME,
        }
    }
}

/// Counters and gauges of a [`SessionCache`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// PUTs stored.
    pub puts: u64,
    /// GETs and TAKEs that found their key.
    pub hits: u64,
    /// GETs and TAKEs that did not (never stored, already taken, evicted or expired).
    pub misses: u64,
    /// Entries evicted to stay within [`CacheLimits`].
    pub evictions: u64,
    /// Entries dropped because they were older than [`CacheLimits::ttl`].
    pub expired: u64,
    /// Requests dropped unanswered: malformed, unknown op, key or value out of bounds.
    pub malformed: u64,
    /// Well-formed PUTs refused because the entry can never fit [`CacheLimits`].
    pub refused: u64,
    /// Replies not sent because the worker's socket was full or gone.
    pub dropped_replies: u64,
    /// Entries now.
    pub entries: u64,
    /// Bytes charged now (see [`CacheLimits::max_bytes`]).
    pub bytes: u64,
}

/// The demux's session cache, shared by all workers: bounded, FIFO eviction, entries expire
/// after a TTL, TAKE removes (single use). Thread-safe; one thread per worker runs
/// [`SessionCache::serve_worker`].
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
    next_seq: u64,
    bytes: usize,
    stats: CacheStats,
}

struct Entry {
    seq: u64,
    stored_at: Instant,
    value: Vec<u8>,
}

/// A request that passed validation.
struct Request<'a> {
    op: Op,
    req_id: u64,
    key: &'a [u8],
    value: &'a [u8],
}

impl Request<'_> {
    fn parse(msg: &[u8]) -> Option<Request<'_>> {
        if msg.len() < REQUEST_HEADER_LEN || msg.len() > MAX_REQUEST_LEN {
            return None;
        }
        let op = Op::from_u8(msg[0])?;
        let req_id = u64::from_le_bytes(msg[1..9].try_into().ok()?);
        let key_len = usize::from(u16::from_le_bytes(msg[9..11].try_into().ok()?));
        if key_len == 0 || key_len > MAX_KEY_LEN {
            return None;
        }
        let rest = &msg[REQUEST_HEADER_LEN..];
        let key = rest.get(..key_len)?;
        let value = &rest[key_len..];
        let value_ok = match op {
            Op::Put => value.len() <= MAX_VALUE_LEN,
            Op::Get | Op::Take => value.is_empty(),
        };
        value_ok.then_some(Request {
            op,
            req_id,
            key,
            value,
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
                next_seq: 0,
                bytes: 0,
                stats: CacheStats::default(),
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
        let mut store = self.store();
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
                .put(req.key, req.value, now, &self.limits)
                .then(Vec::new),
            Op::Get | Op::Take => store.lookup(req.key, req.op == Op::Take, now, self.limits.ttl),
        };
        let mut reply = Vec::with_capacity(REPLY_HEADER_LEN + value.as_ref().map_or(0, Vec::len));
        reply.extend_from_slice(&req.req_id.to_le_bytes());
        match value {
            Some(v) => {
                reply.push(STATUS_FOUND);
                reply.extend_from_slice(&v);
            }
            None => reply.push(STATUS_NOT_FOUND),
        }
        Some(reply)
    }

    /// Serves one worker's session socket until the worker closes it (returns `Ok`, e.g. the
    /// worker died) or a fatal socket error (`Err`). Blocking: run it on a dedicated thread,
    /// one per worker. Works whether or not `sock` is in non-blocking mode.
    ///
    /// Replies are sent without blocking: if the worker's receive queue is full (it is not
    /// reading its replies), the reply is dropped and counted, and the worker times out. To
    /// stop the loop while the worker lives, `shutdown(2)` a duplicate of `sock`.
    pub fn serve_worker(self: Arc<Self>, sock: OwnedFd) -> io::Result<()> {
        let fd = sock.as_fd();
        let mut buf = vec![0u8; MAX_REQUEST_LEN + 1];
        loop {
            let n = match recv(fd, &mut buf, 0) {
                Ok(0) => {
                    debug!("session socket closed by the worker");
                    return Ok(());
                }
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => match poll_readable(fd, None) {
                    Ok(_) => continue,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(e) => return Err(e),
                },
                Err(e) if is_disconnect(&e) => return Ok(()),
                Err(e) => return Err(e),
            };
            // A truncated message (n > MAX_REQUEST_LEN, from MSG_TRUNC) is passed on as an
            // oversized one so that `handle` counts it.
            let request = if n <= MAX_REQUEST_LEN {
                &buf[..n]
            } else {
                &buf[..]
            };
            let Some(reply) = self.handle(request) else {
                continue;
            };
            match send_nonblocking(fd, &reply) {
                Ok(()) => {}
                Err(e) if is_disconnect(&e) => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    self.store().stats.dropped_replies += 1;
                }
                Err(e) => return Err(e),
            }
        }
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
        self.bytes = self.bytes.saturating_sub(Self::cost(key, &entry.value));
        Some(entry)
    }

    /// Removes the oldest entry.
    fn pop_oldest(&mut self) -> bool {
        let Some((_, key)) = self.order.pop_first() else {
            return false;
        };
        if let Some(entry) = self.map.remove(&key) {
            self.bytes = self.bytes.saturating_sub(Self::cost(&key, &entry.value));
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

    /// Stores `value` under `key`; `false` if it can never fit the limits.
    fn put(&mut self, key: &[u8], value: &[u8], now: Instant, limits: &CacheLimits) -> bool {
        let cost = Self::cost(key, value);
        self.remove(key);
        if limits.max_entries == 0 || cost > limits.max_bytes {
            self.stats.refused += 1;
            return false;
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
            },
        );
        self.bytes += cost;
        self.stats.puts += 1;
        true
    }

    fn lookup(&mut self, key: &[u8], take: bool, now: Instant, ttl: Duration) -> Option<Vec<u8>> {
        // `expire` only looks at the oldest entries; an entry can still be stale here if the
        // caller's clock went backwards between calls (tests), so check its own age too.
        let fresh = self
            .map
            .get(key)
            .map(|e| now.saturating_duration_since(e.stored_at) < ttl);
        let value = match fresh {
            Some(true) if take => self.remove(key).map(|e| e.value),
            Some(true) => self.map.get(key).map(|e| e.value.clone()),
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

// ---------------------------------------------------------------------------------------------
// Syscalls
// ---------------------------------------------------------------------------------------------

/// `recv(2)` with `MSG_TRUNC`: for `SOCK_SEQPACKET` (Linux ≥ 3.4) the result is the message's
/// real length, which may exceed `buf.len()` (the rest was discarded). `Ok(0)`: end of file.
fn recv(fd: BorrowedFd<'_>, buf: &mut [u8], flags: libc::c_int) -> io::Result<usize> {
    // SAFETY: `buf` is valid for writes of `buf.len()` bytes for the duration of the call, and
    // `fd` is an open descriptor borrowed for that long.
    let n = unsafe {
        libc::recv(
            fd.as_raw_fd(),
            buf.as_mut_ptr().cast(),
            buf.len(),
            flags | libc::MSG_TRUNC,
        )
    };
    // A negative result (only -1) fails the conversion: the error is in errno.
    usize::try_from(n).map_err(|_| io::Error::last_os_error())
}

/// Sends one message without blocking and without SIGPIPE. A partial send cannot happen on
/// `SOCK_SEQPACKET`; it would be reported as an error.
fn send_nonblocking(fd: BorrowedFd<'_>, msg: &[u8]) -> io::Result<()> {
    loop {
        // SAFETY: `msg` is valid for reads of `msg.len()` bytes for the duration of the call,
        // and `fd` is an open descriptor borrowed for that long.
        let n = unsafe {
            libc::send(
                fd.as_raw_fd(),
                msg.as_ptr().cast(),
                msg.len(),
                libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
            )
        };
        match usize::try_from(n) {
            Ok(n) if n == msg.len() => return Ok(()),
            Ok(_) => return Err(io::Error::other("session message sent partially")),
            Err(_) => {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
        }
    }
}

/// Waits until `fd` is readable (or hung up, or in error: the next `recv` says which), for at
/// most `timeout` (`None`: forever). `Ok(false)`: timed out.
fn poll_readable(fd: BorrowedFd<'_>, timeout: Option<Duration>) -> io::Result<bool> {
    let timeout_ms = match timeout {
        None => -1,
        // Round up, so a short remaining time polls at least once instead of spinning.
        Some(t) => {
            let ms = t.as_micros().div_ceil(1000);
            libc::c_int::try_from(ms).unwrap_or(libc::c_int::MAX)
        }
    };
    let mut pfd = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: `pfd` is one valid, writable pollfd, matching the count of 1.
    let rc = unsafe { libc::poll(&mut pfd, 1, timeout_ms) };
    match rc {
        0 => Ok(false),
        n if n > 0 => Ok(true),
        _ => Err(io::Error::last_os_error()),
    }
}

fn is_disconnect(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EPIPE | libc::ECONNRESET | libc::ENOTCONN | libc::ECONNREFUSED)
    )
}
