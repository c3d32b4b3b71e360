//! The shared session store: the demux's `SessionCache` on its own, both halves over real
//! `SOCK_SEQPACKET` socket pairs, and 0-RTT across two quinn server endpoints whose only shared
//! state is a cache behind those sockets (each endpoint talks to it as a worker process would).
//!
//! Every test is bounded by a timeout; every wait is on an event (a reply, a thread ending, a
//! datagram), never a sleep.

use std::net::{SocketAddr, UdpSocket};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle as ThreadHandle;
use std::time::{Duration, Instant};

use http::StatusCode;
use ringmux_demux::sessions::{CacheLimits, SessionCache, TakeGate};
use ringmux_demux::sys::seqpacket_pair as session_socket_pair;
use ringmux_proto::session::{
    decode_reply, encode_request, Op, MAX_KEY_LEN, MAX_REQUEST_LEN, MAX_VALUE_LEN,
};
use ringmux_server::h3::{serve_with, HttpOptions};
use ringmux_server::sites::Site;
use ringmux_server::stats::ServerStats;
use ringmux_testkit::client::{client_config, H3Client};
use ringmux_worker::quic::{endpoint_config, server_config, ServerOptions};
use ringmux_worker::sessions::RemoteSessionStore;
use ringmux_worker::tls::{server_crypto_with, CertChain, Resumption};
use rustls::server::StoresServerSessions;
use tokio::sync::watch;
use tokio::task::JoinHandle;

const TEST_TIMEOUT: Duration = Duration::from_secs(60);

// ---------------------------------------------------------------------------------------------
// SessionCache::handle
// ---------------------------------------------------------------------------------------------

/// PUT, checking the acknowledgement.
fn put(cache: &SessionCache, key: &[u8], value: &[u8]) {
    let reply = cache
        .handle(&encode_request(Op::Put, 77, key, value))
        .expect("PUT is acknowledged");
    assert_eq!(decode_reply(&reply), Some((77, Some(&[][..]))), "stored");
}

/// Sends TAKE with `req_id`, checks the reply echoes it, returns the value if found.
fn lookup(cache: &SessionCache, op: Op, req_id: u64, key: &[u8]) -> Option<Vec<u8>> {
    let reply = cache
        .handle(&encode_request(op, req_id, key, &[]))
        .expect("TAKE is answered");
    let (id, value) = decode_reply(&reply).expect("well-formed reply");
    assert_eq!(id, req_id);
    value.map(<[u8]>::to_vec)
}

#[test]
fn put_take_semantics() {
    let cache = SessionCache::new();
    put(&cache, b"k1", b"v1");
    // A GET (code 2 in protocol version 2) is no operation any more: unanswered, counted, and
    // the session stays where it was, for the one TAKE that resumes it.
    let mut get = encode_request(Op::Take, 7, b"k1", &[]);
    get[0] = 2;
    assert_eq!(cache.handle(&get), None, "a GET was answered");
    assert_eq!(cache.stats().malformed, 1);
    // TAKE removes it: single use.
    assert_eq!(
        lookup(&cache, Op::Take, u64::MAX, b"k1").as_deref(),
        Some(&b"v1"[..])
    );
    assert_eq!(lookup(&cache, Op::Take, 9, b"k1"), None);

    // PUT replaces.
    put(&cache, b"k2", b"old");
    put(&cache, b"k2", b"new");
    assert_eq!(cache.stats().entries, 1);
    assert_eq!(
        lookup(&cache, Op::Take, 11, b"k2").as_deref(),
        Some(&b"new"[..])
    );
    // Limits are inclusive.
    let key = [0xaa; MAX_KEY_LEN];
    let value = vec![0x55; MAX_VALUE_LEN];
    put(&cache, &key, &value);
    assert_eq!(
        lookup(&cache, Op::Take, 12, &key).as_deref(),
        Some(&value[..])
    );
    // An empty value is a value.
    put(&cache, b"k3", b"");
    assert_eq!(
        lookup(&cache, Op::Take, 13, b"k3").as_deref(),
        Some(&[][..])
    );

    let s = cache.stats();
    assert_eq!(
        (s.puts, s.hits, s.misses, s.malformed, s.evictions),
        (5, 4, 1, 1, 0),
        "{s:?}"
    );
    assert_eq!((s.entries, s.bytes), (0, 0), "{s:?}");
}

#[test]
fn eviction_oldest_first_at_capacity() {
    let cache = SessionCache::with_limits(CacheLimits {
        max_entries: 4,
        ..CacheLimits::default()
    });
    for i in 0..6u8 {
        put(&cache, &[i], &[i; 10]);
    }
    let s = cache.stats();
    assert_eq!((s.entries, s.evictions, s.puts), (4, 2, 6), "{s:?}");
    // Replacing a key moves it to the back: 2 is now the newest, 3 the oldest, and 6 evicts 3.
    put(&cache, &[2], b"again");
    put(&cache, &[6], b"six");
    for gone in [0u8, 1, 3] {
        assert_eq!(lookup(&cache, Op::Take, 1, &[gone]), None, "{gone}");
    }
    for i in [4u8, 5] {
        assert_eq!(lookup(&cache, Op::Take, 1, &[i]), Some(vec![i; 10]));
    }
    assert_eq!(
        lookup(&cache, Op::Take, 1, &[2]).as_deref(),
        Some(&b"again"[..])
    );
    assert_eq!(
        lookup(&cache, Op::Take, 1, &[6]).as_deref(),
        Some(&b"six"[..])
    );

    // The byte budget evicts too: room for two maximal entries only.
    let cache = SessionCache::with_limits(CacheLimits {
        max_bytes: 2 * (MAX_VALUE_LEN + 1024),
        ..CacheLimits::default()
    });
    for i in 0..5u8 {
        put(&cache, &[i], &vec![i; MAX_VALUE_LEN]);
    }
    let s = cache.stats();
    assert_eq!((s.entries, s.evictions), (2, 3), "{s:?}");
    assert!(s.bytes <= 2 * (MAX_VALUE_LEN as u64 + 1024), "{s:?}");
    assert!(lookup(&cache, Op::Take, 1, &[4]).is_some());

    // An entry that can never fit is refused (status 0), not dropped silently.
    let cache = SessionCache::with_limits(CacheLimits {
        max_bytes: 1000,
        ..CacheLimits::default()
    });
    let reply = cache
        .handle(&encode_request(Op::Put, 5, b"k", &[0; 2000]))
        .unwrap();
    assert_eq!(decode_reply(&reply), Some((5, None)));
    let s = cache.stats();
    assert_eq!((s.refused, s.puts, s.entries), (1, 0, 0), "{s:?}");
}

#[test]
fn entries_expire_after_ttl() {
    let ttl = Duration::from_secs(600);
    let cache = SessionCache::with_limits(CacheLimits {
        ttl,
        ..CacheLimits::default()
    });
    let t0 = Instant::now();
    let at = |secs| t0 + Duration::from_secs(secs);
    let req = |op, key: &[u8], value: &[u8]| encode_request(op, 1, key, value);
    let found = |reply: Option<Vec<u8>>| decode_reply(&reply.unwrap()).unwrap().1.is_some();
    assert!(found(cache.handle_at(&req(Op::Put, b"old1", b"1"), at(0))));
    assert!(found(cache.handle_at(&req(Op::Put, b"old2", b"1"), at(0))));
    assert!(found(cache.handle_at(&req(Op::Put, b"new", b"2"), at(300))));
    assert!(found(
        cache.handle_at(&req(Op::Take, b"old1", b""), at(599))
    ));
    // At 600 s "old2" has expired (dropped from the front), "new" has not.
    assert!(!found(
        cache.handle_at(&req(Op::Take, b"old2", b""), at(600))
    ));
    assert!(found(cache.handle_at(&req(Op::Take, b"new", b""), at(899))));
    let s = cache.stats();
    assert_eq!((s.expired, s.entries), (1, 0), "{s:?}");
}

#[test]
fn malformed_and_oversized_requests_are_refused_and_counted() {
    let cache = SessionCache::new();
    put(&cache, b"k", b"v");
    let mut bad: Vec<Vec<u8>> = vec![
        vec![],
        vec![1],
        vec![2; 10], // one byte short of a header
        encode_request(Op::Put, 1, &[7; MAX_KEY_LEN + 1], b"v"), // key too long
        encode_request(Op::Put, 1, b"", b"v"), // empty key
        encode_request(Op::Put, 1, b"k2", &vec![0; MAX_VALUE_LEN + 1]), // value too long
        encode_request(Op::Take, 1, b"k", b"junk"), // TAKE carries no value
        vec![0; MAX_REQUEST_LEN + 1],
    ];
    // Unknown ops, GET (2, protocol version 2) among them.
    for op in [0u8, 2, 4, 0xff] {
        let mut r = encode_request(Op::Take, 1, b"k", b"");
        r[0] = op;
        bad.push(r);
    }
    // key_len pointing past the end.
    let mut r = encode_request(Op::Take, 1, b"k", b"");
    r[9..11].copy_from_slice(&200u16.to_le_bytes());
    bad.push(r);
    for (i, r) in bad.iter().enumerate() {
        assert_eq!(cache.handle(r), None, "request {i} was answered");
    }
    let s = cache.stats();
    assert_eq!(s.malformed, bad.len() as u64, "{s:?}");
    // Nothing was stored or removed by them.
    assert_eq!((s.puts, s.entries, s.hits, s.misses), (1, 1, 0, 0), "{s:?}");
    assert_eq!(
        lookup(&cache, Op::Take, 1, b"k").as_deref(),
        Some(&b"v"[..])
    );
}

/// Random byte strings, half of them starting like a real request: no panic, memory within the
/// limits, every answer well-formed.
#[test]
fn random_requests_never_panic_or_exceed_limits() {
    let limits = CacheLimits {
        max_entries: 64,
        max_bytes: 256 * 1024,
        ttl: Duration::from_secs(3600),
        ..CacheLimits::default()
    };
    let cache = SessionCache::with_limits(limits);
    let mut rng = XorShift(0x9e37_79b9_7f4a_7c15);
    for i in 0..600 {
        let len = match i % 3 {
            0 => rng.below(40),
            1 => rng.below(600),
            _ => rng.below(MAX_REQUEST_LEN + 64),
        };
        let mut msg: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
        if i % 2 == 0 && msg.len() >= 11 {
            // Plausible header: a real op and a key length that sometimes fits.
            msg[0] = 1 + (rng.next() % 3) as u8;
            let key_len = rng.below(msg.len() - 10) as u16;
            msg[9..11].copy_from_slice(&key_len.to_le_bytes());
        }
        if let Some(reply) = cache.handle(&msg) {
            assert!(decode_reply(&reply).is_some(), "malformed reply {reply:?}");
        }
        let s = cache.stats();
        assert!(s.entries <= limits.max_entries as u64, "{s:?}");
        assert!(s.bytes <= limits.max_bytes as u64, "{s:?}");
    }
    let s = cache.stats();
    assert!(s.malformed > 100, "{s:?}");
    assert!(
        s.puts > 10,
        "the generator should produce some valid PUTs: {s:?}"
    );
}

struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            (self.next() % n as u64) as usize
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Both halves over socket pairs
// ---------------------------------------------------------------------------------------------

/// A `serve_worker` thread; its result arrives on `done` when it returns.
struct Served {
    done: mpsc::Receiver<std::io::Result<()>>,
    _thread: ThreadHandle<()>,
}

fn serve(cache: &Arc<SessionCache>, demux_end: OwnedFd) -> Served {
    let (tx, done) = mpsc::channel();
    let cache = cache.clone();
    let thread = std::thread::spawn(move || {
        let _ = tx.send(cache.serve_worker(demux_end, &TakeGate::Open));
    });
    Served {
        done,
        _thread: thread,
    }
}

impl Served {
    fn wait(&self) -> std::io::Result<()> {
        self.done
            .recv_timeout(Duration::from_secs(10))
            .expect("serve_worker did not return")
    }
}

#[test]
fn remote_store_round_trip_and_serve_worker_ends_with_the_worker() {
    let cache = Arc::new(SessionCache::new());
    let (demux_end, worker_end) = session_socket_pair().unwrap();
    let served = serve(&cache, demux_end);
    let store = RemoteSessionStore::new(worker_end);

    assert!(store.can_cache());
    assert!(store.put(b"ticket".to_vec(), b"session".to_vec()));
    // rustls' TLS 1.2 lookup: never asked of the demux, which has no such operation.
    assert_eq!(store.get(b"ticket"), None);
    assert_eq!(store.take(b"ticket").as_deref(), Some(&b"session"[..]));
    assert_eq!(store.take(b"ticket"), None);
    // Refused locally, never sent.
    assert!(!store.put(vec![1; MAX_KEY_LEN + 1], b"v".to_vec()));
    assert!(!store.put(b"k".to_vec(), vec![0; MAX_VALUE_LEN + 1]));
    assert_eq!(store.take(&[1; 4000]), None);

    let r = store.stats();
    assert_eq!(
        (
            r.puts,
            r.put_failures,
            r.hits,
            r.misses,
            r.timeouts,
            r.errors
        ),
        (1, 2, 1, 2, 0, 0),
        "{r:?}"
    );
    let s = cache.stats();
    assert_eq!(
        (s.puts, s.hits, s.misses, s.malformed),
        (1, 1, 1, 0),
        "{s:?}"
    );

    drop(store);
    served.wait().expect("clean end when the worker closes");
}

#[test]
fn serve_worker_survives_garbage_from_the_worker() {
    let cache = Arc::new(SessionCache::new());
    let (demux_end, worker_end) = session_socket_pair().unwrap();
    let served = serve(&cache, demux_end);

    raw_send(&worker_end, &[3, 1, 2]);
    raw_send(&worker_end, &vec![0xff; MAX_REQUEST_LEN + 5000]); // truncated on receive
    raw_send(&worker_end, &encode_request(Op::Put, 41, b"k", b"v"));
    raw_send(&worker_end, &encode_request(Op::Take, 42, b"k", b""));
    // Only the well-formed requests are answered.
    let answer = || raw_recv(&worker_end, Duration::from_secs(10)).unwrap();
    assert_eq!(decode_reply(&answer()), Some((41, Some(&b""[..]))));
    assert_eq!(decode_reply(&answer()), Some((42, Some(&b"v"[..]))));
    let s = cache.stats();
    assert_eq!((s.malformed, s.puts, s.hits), (2, 1, 1), "{s:?}");

    // A zero-length message reads as end-of-file on SOCK_SEQPACKET: the worker ends its own
    // serving thread (documented limit).
    raw_send(&worker_end, &[]);
    served.wait().unwrap();
}

#[test]
fn lookup_times_out_when_the_demux_never_answers() {
    let (demux_end, worker_end) = session_socket_pair().unwrap();
    let timeout = Duration::from_millis(50);
    let store = RemoteSessionStore::with_timeout(worker_end, timeout);

    let start = Instant::now();
    assert_eq!(store.take(b"ticket"), None);
    let took = start.elapsed();
    assert!(took >= timeout, "returned after {took:?}");
    assert!(took < Duration::from_secs(2), "took {took:?}");
    assert_eq!(store.stats().timeouts, 1);

    // The request did reach the demux end. Answer it now, too late: the next lookup must not
    // mistake that reply for its own.
    let first = raw_recv(&demux_end, Duration::from_secs(5)).unwrap();
    assert_eq!(first[0], Op::Take as u8);
    let first_id = u64::from_le_bytes(first[1..9].try_into().unwrap());
    raw_send(&demux_end, &reply(first_id, Some(b"stale")));
    assert_eq!(store.take(b"ticket"), None);
    let r = store.stats();
    assert_eq!((r.timeouts, r.stale_replies, r.hits), (2, 1, 0), "{r:?}");

    // The demux goes away: lookups fail at once, puts are refused, no more tickets.
    drop(demux_end);
    let start = Instant::now();
    assert_eq!(store.take(b"ticket"), None);
    assert!(start.elapsed() < timeout, "took {:?}", start.elapsed());
    assert!(!store.put(b"k".to_vec(), b"v".to_vec()));
    assert!(!store.can_cache());
    assert_eq!((store.stats().errors, store.stats().put_failures), (2, 1));
}

#[test]
fn replies_are_matched_by_request_id() {
    let (demux_end, worker_end) = session_socket_pair().unwrap();
    // A long timeout: the answer must be matched by id, not by timing.
    let store = RemoteSessionStore::with_timeout(worker_end, Duration::from_secs(10));
    // Left over from some earlier request: dropped before the next request is sent.
    raw_send(&demux_end, &reply(12345, Some(b"leftover")));
    let answerer = std::thread::spawn(move || {
        let req = raw_recv(&demux_end, Duration::from_secs(10)).expect("request");
        assert_eq!(req[0], Op::Take as u8);
        let id = u64::from_le_bytes(req[1..9].try_into().unwrap());
        assert_eq!(&req[11..], b"ticket");
        // A reply for another request, then garbage, then the answer.
        raw_send(&demux_end, &reply(id.wrapping_add(1), Some(b"wrong")));
        raw_send(&demux_end, &[1, 2, 3]);
        raw_send(&demux_end, &reply(id, Some(b"fresh")));
        demux_end
    });
    assert_eq!(store.take(b"ticket").as_deref(), Some(&b"fresh"[..]));
    let r = store.stats();
    assert_eq!((r.hits, r.stale_replies, r.timeouts), (1, 3, 0), "{r:?}");
    let _demux_end = answerer.join().unwrap();
}

fn reply(req_id: u64, value: Option<&[u8]>) -> Vec<u8> {
    let mut r = req_id.to_le_bytes().to_vec();
    match value {
        Some(v) => {
            r.push(1);
            r.extend_from_slice(v);
        }
        None => r.push(0),
    }
    r
}

fn raw_send(fd: &OwnedFd, msg: &[u8]) {
    use nix::sys::socket::{send, MsgFlags};
    let n = send(fd.as_raw_fd(), msg, MsgFlags::MSG_NOSIGNAL).expect("send");
    assert_eq!(n, msg.len());
}

/// One message, waiting at most `timeout`.
fn raw_recv(fd: &OwnedFd, timeout: Duration) -> Option<Vec<u8>> {
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    let mut pfd = [PollFd::new(fd.as_fd(), PollFlags::POLLIN)];
    let timeout = PollTimeout::try_from(timeout).unwrap_or(PollTimeout::MAX);
    if poll(&mut pfd, timeout).ok()? == 0 {
        return None;
    }
    let mut buf = vec![0u8; MAX_REQUEST_LEN + 1];
    let n = nix::sys::socket::recv(
        fd.as_raw_fd(),
        &mut buf,
        nix::sys::socket::MsgFlags::empty(),
    )
    .ok()?;
    buf.truncate(n);
    Some(buf)
}

// ---------------------------------------------------------------------------------------------
// 0-RTT across two server endpoints sharing the cache through sockets
// ---------------------------------------------------------------------------------------------

const RESET_SECRET: [u8; 64] = [0x22; 64];
const TOKEN_SECRET: [u8; 64] = [0x33; 64];

/// One server endpoint, set up as a worker process sets up its own.
struct Server {
    addr: SocketAddr,
    stats: Arc<ServerStats>,
    store: Arc<RemoteSessionStore>,
    stop: watch::Sender<bool>,
    task: JoinHandle<()>,
}

impl Server {
    fn start(chain: &CertChain, worker_end: OwnedFd) -> Server {
        // A generous timeout: this test is about the cross-instance path, not about how fast
        // a loaded CI box schedules the cache thread.
        let store = Arc::new(RemoteSessionStore::with_timeout(
            worker_end,
            Duration::from_secs(2),
        ));
        let crypto =
            server_crypto_with(chain, Resumption::SessionStore(store.clone())).expect("crypto");
        let ep_cfg = endpoint_config(&RESET_SECRET, || {
            Box::new(quinn_proto::RandomConnectionIdGenerator::new(8))
        });
        let opts = ServerOptions::default();
        let srv_cfg = server_config(crypto, &TOKEN_SECRET, &opts);
        let socket = UdpSocket::bind("127.0.0.1:0").expect("bind server socket");
        let endpoint =
            quinn::Endpoint::new(ep_cfg, Some(srv_cfg), socket, Arc::new(quinn::TokioRuntime))
                .expect("server endpoint");
        let addr = endpoint.local_addr().expect("server address");
        let stats = Arc::new(ServerStats::default());
        let (stop, stop_rx) = watch::channel(false);
        let task = tokio::spawn({
            let stats = stats.clone();
            async move {
                serve_with(
                    endpoint,
                    Arc::new(Site::default()),
                    stats,
                    stop_rx,
                    &HttpOptions::default(),
                )
                .await
            }
        });
        Server {
            addr,
            stats,
            store,
            stop,
            task,
        }
    }

    async fn shutdown(self) {
        let _ = self.stop.send(true);
        self.task.await.expect("serve task");
    }
}

/// A UDP relay in front of a server that records the client's first flight (every datagram
/// the client sent before the server's first answer): what an on-path attacker captures to
/// replay a ClientHello with its 0-RTT data.
struct Relay {
    addr: SocketAddr,
    first_flight: Arc<std::sync::Mutex<Vec<Vec<u8>>>>,
    task: JoinHandle<()>,
}

impl Relay {
    async fn start(server: SocketAddr) -> Relay {
        let sock = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let addr = sock.local_addr().unwrap();
        let first_flight = Arc::new(std::sync::Mutex::new(Vec::new()));
        let task = tokio::spawn({
            let first_flight = first_flight.clone();
            async move {
                let mut buf = vec![0u8; 65536];
                let mut client = None;
                let mut server_spoke = false;
                while let Ok((n, from)) = sock.recv_from(&mut buf).await {
                    let datagram = &buf[..n];
                    if from == server {
                        server_spoke = true;
                        if let Some(client) = client {
                            let _ = sock.send_to(datagram, client).await;
                        }
                    } else {
                        client = Some(from);
                        if !server_spoke {
                            first_flight.lock().unwrap().push(datagram.to_vec());
                        }
                        let _ = sock.send_to(datagram, server).await;
                    }
                }
            }
        });
        Relay {
            addr,
            first_flight,
            task,
        }
    }
}

/// Two endpoints ("workers" A and B) with no shared state but the demux's cache, each reaching
/// it over its own socket pair served by its own thread, as in the real deployment:
///
/// 1. full handshake on A: A stores its tickets in the cache;
/// 2. 0-RTT to B with A's ticket: accepted, the request is answered;
/// 3. the first flight of step 2, replayed to A: the ticket was taken, so the cache misses and
///    A does a full handshake (no 0-RTT keys, the replayed request is never decrypted);
/// 4. a normal second 0-RTT connection from the same client is accepted again: the rustls
///    client never reuses a ticket (its store hands each out at most once), it takes the next
///    one it holds (A sent two, B two more). Replaying a ticket needs a raw replay as in 3.
#[tokio::test]
async fn zero_rtt_across_workers_through_the_demux_cache() {
    tokio::time::timeout(TEST_TIMEOUT, async {
        let chain = CertChain::self_signed().unwrap();
        let cache = Arc::new(SessionCache::new());
        let (demux_a, worker_a) = session_socket_pair().unwrap();
        let (demux_b, worker_b) = session_socket_pair().unwrap();
        let _served_a = serve(&cache, demux_a);
        let _served_b = serve(&cache, demux_b);
        let a = Server::start(&chain, worker_a);
        let b = Server::start(&chain, worker_b);
        let client = H3Client::new(client_config(Some(&chain.certs)).unwrap(), a.addr).unwrap();

        // 1. Full handshake on A.
        let conn = client.connect(a.addr, "localhost").await.unwrap();
        // A full round trip after the handshake: the tickets have arrived by now.
        assert_eq!(conn.get("/hello.txt").await.unwrap().status, StatusCode::OK);
        conn.close().await.unwrap();
        // PUTs are acknowledged before rustls issues the ticket: both are in the cache.
        assert_eq!(a.store.stats().puts, 2, "{:?}", a.store.stats());
        assert_eq!(cache.stats().puts, 2, "{:?}", cache.stats());

        // 2. 0-RTT to B (through the recording relay).
        let relay = Relay::start(b.addr).await;
        let (conn, zero_rtt) = client.connect_0rtt(relay.addr, "localhost").await.unwrap();
        assert!(zero_rtt.attempted(), "client had no 0-RTT-capable ticket");
        let r = conn.get("/bytes/5000").await.unwrap();
        assert_eq!(r.status, StatusCode::OK);
        assert_eq!(r.body_len, 5000);
        assert!(zero_rtt.accepted().await, "B rejected the 0-RTT data");
        conn.close().await.unwrap();
        assert_eq!(b.stats.requests_total.load(Relaxed), 1);
        assert_eq!(b.store.stats().hits, 1, "{:?}", b.store.stats());
        let s = cache.stats();
        assert_eq!((s.hits, s.misses), (1, 0), "{s:?}");
        relay.task.abort();

        // 3. Replay B's first flight to A from another address.
        let flight = relay.first_flight.lock().unwrap().clone();
        assert!(!flight.is_empty());
        let attacker = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
        for datagram in &flight {
            attacker.send_to(datagram, a.addr).await.unwrap();
        }
        // A answers (ServerHello) only after rustls has looked the ticket up.
        let mut buf = vec![0u8; 65536];
        let (_, from) = attacker.recv_from(&mut buf).await.unwrap();
        assert_eq!(from, a.addr);
        let s = cache.stats();
        assert_eq!(
            (s.hits, s.misses),
            (1, 1),
            "replayed ticket must miss: {s:?}"
        );
        assert_eq!(a.store.stats().misses, 1);
        assert_eq!(
            a.stats.requests_total.load(Relaxed),
            1,
            "only step 1's request"
        );

        // 4. The client's next 0-RTT attempt uses another ticket: accepted.
        let (conn, zero_rtt) = client.connect_0rtt(b.addr, "localhost").await.unwrap();
        assert!(zero_rtt.attempted());
        assert_eq!(conn.get("/hello.txt").await.unwrap().status, StatusCode::OK);
        assert!(zero_rtt.accepted().await);
        conn.close().await.unwrap();
        let s = cache.stats();
        assert_eq!((s.hits, s.misses, s.malformed), (2, 1, 0), "{s:?}");
        // Every ticket either instance issued was acknowledged by the cache.
        assert_eq!(s.puts, a.store.stats().puts + b.store.stats().puts, "{s:?}");

        b.shutdown().await;
        // A still has the attacker's half-open handshake, which would hold its graceful
        // shutdown until the idle timeout: just stop it.
        a.task.abort();
    })
    .await
    .expect("test timed out");
}
