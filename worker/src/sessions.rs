//! A TLS session store shared by all worker processes and held by the demux, so that 0-RTT
//! works whichever worker a resumed connection lands on.
//!
//! This module owns the worker's end of the session-store socket: [`RemoteSessionStore`], a
//! rustls [`StoresServerSessions`] that asks the demux's cache. It never touches QUIC, HTTP or
//! the datagram path.
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
//! The session socket's codec is [`ringmux_proto::session`], specified in
//! `control-protocol.md` ("Session store"). The demux end, the cache itself, lives in the demux.
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
//!   private key anyway. What it *can* do is deny service to its own clients: flooding PUTs
//!   evicts only its own instance's sessions (each instance has a quota of the cache), taking
//!   a key it knows costs that client its 0-RTT, and spamming requests costs at most its own
//!   serving thread's budget (the demux serves a worker's requests up to a rate, then drops
//!   and counts them; `demux/src/budget.rs`).
//!   Memory stays bounded (the cache's limits), keys are hashed with SipHash under a random key
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
//!   entries after its TTL (6 h, [`crate::tls::TICKET_LIFETIME`]) or
//!   when evicted (oldest first). A forgotten ticket means a full handshake.
//! * The cache dies with the demux: after a demux restart every client does a full handshake.
//! * A zero-length message reads as end-of-file on a `SOCK_SEQPACKET` socket, so a worker that
//!   sends one ends its own serving thread, as if it had died.

use std::fmt;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use ringmux_proto::session::{
    decode_reply, encode_request, Op, MAX_KEY_LEN, MAX_REPLY_LEN, MAX_VALUE_LEN,
};
use rustls::server::StoresServerSessions;
use tracing::{debug, warn};

use crate::sys;

/// How long a worker waits for the demux's reply to a request by default.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_millis(50);

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
    /// TAKE requests answered "found".
    pub hits: u64,
    /// TAKE requests answered "not found" (or refused locally: key too long).
    pub misses: u64,
    /// Requests with no matching reply within the timeout.
    pub timeouts: u64,
    /// Requests that failed on the socket (send or receive error, demux gone).
    pub errors: u64,
    /// Replies discarded: for an earlier, timed-out request, or malformed.
    pub stale_replies: u64,
}

/// The worker's session store: forwards rustls' `put`/`get`/`take` to the demux's
/// session cache over the worker's session socket.
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
    /// Status 1: found (TAKE) or stored (PUT, empty value).
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
            match sys::recv_packet(self.fd.as_fd(), &mut self.buf, true) {
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
        if let Err(e) = sys::send_packet(self.fd.as_fd(), &msg, true) {
            return self.broken("send", &e);
        }
        loop {
            let now = Instant::now();
            if now >= deadline {
                return Exchange::TimedOut;
            }
            match sys::poll_readable(self.fd.as_fd(), Some(deadline - now)) {
                Ok(false) => return Exchange::TimedOut,
                Ok(true) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return self.broken("poll", &e),
            }
            let n = match sys::recv_packet(self.fd.as_fd(), &mut self.buf, true) {
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

    /// rustls asks `get` only for TLS 1.2 resumption, which QUIC never uses (RFC 9001 §4.2
    /// requires TLS 1.3); the demux's store has no such operation.
    fn get(&self, _key: &[u8]) -> Option<Vec<u8>> {
        None
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

fn is_disconnect(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(
            nix::libc::EPIPE
                | nix::libc::ECONNRESET
                | nix::libc::ENOTCONN
                | nix::libc::ECONNREFUSED
        )
    )
}
