//! Which instance may take which TLS session from the shared session store: the demux reads
//! the pre-shared-key identities (ticket IDs) of every new connection's ClientHello as it
//! forwards the Initial, remembers which instance it routed each to ([`TicketBindings`]), and
//! the session threads serve a `TAKE` only to that instance.
//!
//! # Why
//!
//! A ticket ID travels in the clear in the ClientHello of a resumed connection (Initial
//! protection is keyed by the client's DCID, so anyone on the path can remove it), and the
//! session stored under it holds the resumption secret from which that connection's 0-RTT keys
//! follow. Without this check any worker that learned a ticket ID (from the network, say)
//! could take the session and read that connection's early data, or take it first and cost the
//! client its 0-RTT. With it, a worker takes only sessions whose ClientHello the demux gave it.
//!
//! # Reading ClientHellos ([`HelloInspector`], on the data plane)
//!
//! The demux reads the Initials it lets in that open a connection: those whose DCID the
//! client chose (they route by hash), and those that carry a token (the Initial after a Retry,
//! whose DCID is the Retry's SCID). A client's later Initials, acknowledgements under the
//! server's CID, are not read. Neither is a first Initial whose random DCID happens to decode
//! as one of ours (it needs exactly our CID length and first octet, and to decrypt to this
//! node's ID): that rare client resumes with a full handshake. For each, the inspector derives
//! the client's Initial keys from the packet's DCID (RFC 9001 §5.2: HKDF-SHA256 with the v1
//! salt, labels `client in`, `quic key`, `quic iv`, `quic hp`), removes header protection
//! (§5.4, AES-128) and opens the payload (AES-128-GCM, §5.3) in a scratch copy (the datagram
//! itself is forwarded untouched), then collects the CRYPTO frames (RFC 9000 §19.6). A
//! ClientHello can span several Initials and datagrams, and
//! some clients send its pieces out of order: pieces are gathered per DCID in a fixed table
//! until the message (RFC 8446 §4.1.2, its length from the handshake header) is whole. Its
//! `pre_shared_key` extension (§4.2.11) lists the identities; each is bound to the instance.
//! Everything is bounded and allocated at start: [`PENDING_HELLOS`] gatherings of at most
//! [`MAX_HELLO`] octets, the oldest given up for a new one. Nothing panics on any input.
//!
//! # Binding ([`TicketBindings`], shared with the session threads)
//!
//! A fixed table of [`BINDING_SLOTS`] words, four-way set-associative, indexed by SipHash of the
//! identity under a random key (no one can aim at a set), each word `tag (40) ‖ instance (8) ‖
//! seconds (16)`. The first binding of an identity holds for [`BINDING_HOLD`]: a later Initial
//! that carries the same ticket to another instance does not move it (a worker that copies a
//! ticket it saw into an Initial of its own cannot take the binding over), while a
//! retransmission to the same instance renews it. A `TAKE` is granted when the identity is bound
//! to the asking instance and the binding is fresh, and the binding is then used up; otherwise
//! it is refused without looking at the store (the session stays for its instance), as
//! `foreign` (bound to another instance) or `unbound` (never seen, given up, or aged out).
//! A refused TAKE costs the client only its resumption: it gets a full handshake.
//!
//! The data plane stores a binding before it publishes the datagram into the ring (or sends
//! it on the worker's socket), and the worker asks only after it read the datagram, so a
//! binding is always in the table before the TAKE that needs it (`SYNC: ticket-binding`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use ring::aead::quic::{HeaderProtectionKey, AES_128};
use ring::aead::{self, Aad, LessSafeKey, Nonce, UnboundKey};
use ring::hkdf;
use ringmux_quic_lb::{LongHeader, Reader};
use siphasher::sip::SipHasher13;

/// Words in the binding table (32 KiB).
pub const BINDING_SLOTS: usize = 4096;
/// Words of one set.
const WAYS: usize = 4;
/// How long a binding holds: a worker asks for the session while it reads the ClientHello,
/// microseconds to milliseconds after the demux forwarded it.
pub const BINDING_HOLD: Duration = Duration::from_secs(10);
/// ClientHellos gathered at once.
pub const PENDING_HELLOS: usize = 64;
/// Largest ClientHello read (handshake header included). Browsers' with post-quantum key
/// shares are about 1 800 octets.
pub const MAX_HELLO: usize = 4096;
/// Largest Initial packet read; a longer one is counted as unopened.
const MAX_PACKET: usize = 4096;
/// Identities bound from one ClientHello; rustls offers one.
const MAX_IDENTITIES: usize = 8;

/// RFC 9001 §5.2: the initial salt of QUIC version 1.
const INITIAL_SALT_V1: [u8; 20] = [
    0x38, 0x76, 0x2c, 0xf7, 0xf5, 0x59, 0x34, 0xb3, 0x4d, 0x17, 0x9a, 0xe6, 0xa4, 0xc8, 0x0c, 0xad,
    0xcc, 0xbb, 0x7f, 0x0a,
];
/// RFC 8446 §4.2.11.
const EXT_PRE_SHARED_KEY: u16 = 41;
const HANDSHAKE_CLIENT_HELLO: u8 = 1;
const TAG_LEN: usize = 16;

/// The answer to a worker's `TAKE`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Claim {
    /// The identity's ClientHello went to this instance: look the session up.
    Granted,
    /// It went to another instance: refused.
    Foreign,
    /// No fresh binding: refused.
    Unbound,
}

/// Identity → instance, written by the data plane, read (and used up) by the session threads.
pub struct TicketBindings {
    slots: Box<[AtomicU64]>,
    hasher: SipHasher13,
}

impl Default for TicketBindings {
    fn default() -> Self {
        Self::new()
    }
}

impl TicketBindings {
    /// An empty table with a random hash key (a fixed one if the system has no randomness,
    /// which costs only the protection against aimed collisions).
    pub fn new() -> Self {
        let mut key = [0u8; 16];
        let _ = getrandom::fill(&mut key);
        TicketBindings {
            slots: (0..BINDING_SLOTS).map(|_| AtomicU64::new(0)).collect(),
            hasher: SipHasher13::new_with_key(&key),
        }
    }

    /// Binds `identity` to `instance` at `now_s` (seconds of `CLOCK_MONOTONIC`), unless a fresh
    /// binding to another instance holds it. Data plane only (one writer of new bindings).
    pub fn bind(&self, identity: &[u8], instance: u8, now_s: u64) {
        let (set, tag) = self.locate(identity);
        let mut victim = 0;
        let mut victim_age = 0u64;
        for (j, slot) in set.iter().enumerate() {
            let word = slot.load(Ordering::Relaxed);
            let e = Entry::unpack(word);
            if word != 0 && e.tag == tag {
                if e.fresh(now_s) && e.instance != instance {
                    return;
                }
                victim = j;
                break;
            }
            let age = if word == 0 { u64::MAX } else { e.age(now_s) };
            if age >= victim_age {
                victim_age = age;
                victim = j;
            }
        }
        // SYNC: ticket-binding. Stored before the datagram is published to the worker (the
        // ring's Release publish of `tail`, or the unix socket's send), which the worker's
        // TAKE follows; the session thread's Acquire load below sees it.
        set[victim].store(Entry::pack(tag, instance, now_s), Ordering::Release);
    }

    /// Whether `instance` may take the session of `identity` at `now_s`; a granted binding
    /// is used up.
    pub fn claim(&self, identity: &[u8], instance: u8, now_s: u64) -> Claim {
        let (set, tag) = self.locate(identity);
        for slot in set {
            // SYNC: ticket-binding (see `bind`).
            let word = slot.load(Ordering::Acquire);
            let e = Entry::unpack(word);
            if word == 0 || e.tag != tag || !e.fresh(now_s) {
                continue;
            }
            if e.instance != instance {
                return Claim::Foreign;
            }
            // Used up. If the data plane rewrote the word meanwhile, it holds another
            // binding now and stays.
            let _ = slot.compare_exchange(word, 0, Ordering::Relaxed, Ordering::Relaxed);
            return Claim::Granted;
        }
        Claim::Unbound
    }

    /// The set `identity` lives in, and its tag (never 0, so a zero word is empty).
    fn locate(&self, identity: &[u8]) -> (&[AtomicU64], u64) {
        let h = self.hasher.hash(identity);
        let first = (h as usize % BINDING_SLOTS) & !(WAYS - 1);
        (&self.slots[first..first + WAYS], (h >> 24) | 1)
    }
}

/// One word of the binding table.
struct Entry {
    tag: u64,
    instance: u8,
    secs: u16,
}

impl Entry {
    fn pack(tag: u64, instance: u8, now_s: u64) -> u64 {
        (tag << 24) | (u64::from(instance) << 16) | (now_s & 0xffff)
    }

    fn unpack(word: u64) -> Entry {
        Entry {
            tag: word >> 24,
            instance: (word >> 16) as u8,
            secs: word as u16,
        }
    }

    /// Seconds since it was stored (modulo 2^16: a binding 18 hours old looks new again, long
    /// after every session it could name has expired from the store).
    fn age(&self, now_s: u64) -> u64 {
        u64::from((now_s as u16).wrapping_sub(self.secs))
    }

    fn fresh(&self, now_s: u64) -> bool {
        self.age(now_s) < BINDING_HOLD.as_secs()
    }
}

/// What the inspector counted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HelloStats {
    /// ClientHellos read whole (with or without identities).
    pub read: u64,
    /// Initials that did not open with the keys of their DCID: after a Retry, a client's later
    /// Initials (they carry the token too, under the server's CID, with the Retry SCID's
    /// keys); garbage; or longer than the inspector reads.
    pub unopened: u64,
    /// Opened Initials whose frames, or whose CRYPTO stream, is not a ClientHello that parses.
    pub unparsed: u64,
    /// ClientHellos given up: longer than [`MAX_HELLO`], or still incomplete when their place
    /// was needed.
    pub abandoned: u64,
}

/// Reads the identities of forwarded ClientHellos and binds them. Owned by the data plane.
pub struct HelloInspector {
    /// Where an Initial is opened (the datagram itself is forwarded as it came).
    scratch: Box<[u8; MAX_PACKET]>,
    /// HKDF-Extract's key, the v1 initial salt: its HMAC state made once.
    salt: hkdf::Salt,
    hellos: Gathering,
}

/// ClientHellos being gathered, and what becomes of them.
struct Gathering {
    bindings: Arc<TicketBindings>,
    pending: Box<[Pending]>,
    /// The next place to give up when none is free (round robin: the oldest gathering).
    next_victim: usize,
    stats: HelloStats,
}

/// A ClientHello being gathered from CRYPTO frames.
struct Pending {
    /// Its Initials' DCID; `dcid_len == 0`: free.
    dcid: [u8; 20],
    dcid_len: u8,
    /// The whole message's length (handshake header included) once known, else 0.
    total: usize,
    buf: [u8; MAX_HELLO],
    /// Which octets of `buf` have arrived.
    have: [u64; MAX_HELLO / 64],
}

impl HelloStats {
    /// The `result` labels of `ringmux_client_hellos_total`, in the order of [`HelloStats::values`].
    pub const LABELS: [&'static str; 4] = crate::metrics::counters::HELLO_RESULTS;

    /// The counts, labelled by [`HelloStats::LABELS`].
    pub fn values(&self) -> [u64; 4] {
        [self.read, self.unopened, self.unparsed, self.abandoned]
    }
}

impl HelloInspector {
    pub fn new(bindings: Arc<TicketBindings>) -> Self {
        HelloInspector {
            scratch: Box::new([0; MAX_PACKET]),
            salt: hkdf::Salt::new(hkdf::HKDF_SHA256, &INITIAL_SALT_V1),
            hellos: Gathering {
                bindings,
                pending: (0..PENDING_HELLOS)
                    .map(|_| Pending {
                        dcid: [0; 20],
                        dcid_len: 0,
                        total: 0,
                        buf: [0; MAX_HELLO],
                        have: [0; MAX_HELLO / 64],
                    })
                    .collect(),
                next_victim: 0,
                stats: HelloStats::default(),
            },
        }
    }

    /// What it counted.
    pub fn stats(&self) -> HelloStats {
        self.hellos.stats
    }

    /// Reads the Initial packets at the start of `datagram` (one UDP datagram, or one GRO
    /// segment), forwarded to `instance` at `now_ns` (`CLOCK_MONOTONIC`), and binds the
    /// identities of any ClientHello they complete.
    pub fn observe(&mut self, datagram: &[u8], instance: u8, now_ns: u64) {
        if let Some(first) = LongHeader::parse(datagram) {
            self.observe_header(&first, instance, now_ns);
        }
    }

    /// [`HelloInspector::observe`] of a datagram whose first header is already read (admission
    /// read it): `first`'s packet, then those coalesced after it.
    pub fn observe_header(&mut self, first: &LongHeader<'_>, instance: u8, now_ns: u64) {
        let mut header = Some(*first);
        // Coalesced packets (RFC 9000 §12.2): Initials come first; stop at anything else.
        while let Some(h) = header {
            let Some(end) = self.observe_packet(&h, instance, now_ns) else {
                break;
            };
            header = h.bytes().get(end..).and_then(LongHeader::parse);
        }
    }

    /// Reads the Initial `header` begins; its end if the next packet may be read.
    fn observe_packet(
        &mut self,
        header: &LongHeader<'_>,
        instance: u8,
        now_ns: u64,
    ) -> Option<usize> {
        let initial = InitialSpan::of(header)?;
        let len = initial.end;
        let stats = &mut self.hellos.stats;
        let (Some(packet), Some(data)) = (self.scratch.get_mut(..len), header.bytes().get(..len))
        else {
            // Longer than the inspector reads.
            stats.unopened += 1;
            return Some(len);
        };
        packet.copy_from_slice(data);
        let Some(plain) = unprotect(packet, header.dcid(), &initial, &self.salt) else {
            stats.unopened += 1;
            return Some(len);
        };
        let dcid = header.dcid();
        let mut frames = Reader::new(plain);
        while let Some(kind) = frames.varint() {
            match kind {
                // PADDING: clients pad their Initials to 1 200 octets with hundreds of them,
                // so a run is skipped at once.
                0x00 => {
                    let rest = frames.rest();
                    let run = rest.iter().position(|&b| b != 0).unwrap_or(rest.len());
                    frames.take(run);
                }
                // PING.
                0x01 => {}
                // ACK (RFC 9000 §19.3): largest, delay, range count, first range, ranges, ECN.
                0x02 | 0x03 => {
                    let skipped = (|| {
                        frames.varint()?;
                        frames.varint()?;
                        let ranges = frames.varint()?;
                        frames.varint()?;
                        for _ in 0..ranges.min(plain.len() as u64) {
                            frames.varint()?;
                            frames.varint()?;
                        }
                        if kind == 0x03 {
                            for _ in 0..3 {
                                frames.varint()?;
                            }
                        }
                        Some(())
                    })();
                    if skipped.is_none() {
                        break;
                    }
                }
                0x06 => {
                    let (Some(offset), Some(n)) = (frames.varint(), frames.varint()) else {
                        break;
                    };
                    let Some(bytes) = usize::try_from(n).ok().and_then(|n| frames.take(n)) else {
                        break;
                    };
                    self.hellos.crypto(dcid, offset, bytes, instance, now_ns);
                }
                // CONNECTION_CLOSE, or a frame an Initial may not carry: nothing more to read.
                _ => break,
            }
        }
        Some(len)
    }
}

impl Gathering {
    /// Adds CRYPTO data at `offset` to the ClientHello of `dcid`; binds its identities once
    /// it is whole.
    fn crypto(&mut self, dcid: &[u8], offset: u64, bytes: &[u8], instance: u8, now_ns: u64) {
        let Some(i) = self.place_for(dcid) else {
            return;
        };
        let p = &mut self.pending[i];
        let end = offset.saturating_add(bytes.len() as u64);
        if end > MAX_HELLO as u64 {
            p.dcid_len = 0;
            self.stats.abandoned += 1;
            return;
        }
        let (start, end) = (offset as usize, end as usize);
        p.buf[start..end].copy_from_slice(bytes);
        mark(&mut p.have, start, end);
        if p.total == 0 && covered(&p.have, 4) {
            if p.buf[0] != HANDSHAKE_CLIENT_HELLO {
                p.dcid_len = 0;
                self.stats.unparsed += 1;
                return;
            }
            let body =
                usize::from(p.buf[1]) << 16 | usize::from(p.buf[2]) << 8 | usize::from(p.buf[3]);
            p.total = 4 + body;
            if p.total > MAX_HELLO {
                p.dcid_len = 0;
                self.stats.abandoned += 1;
                return;
            }
        }
        if p.total == 0 || !covered(&p.have, p.total) {
            return;
        }
        p.dcid_len = 0;
        let p = &self.pending[i];
        let mut ids: [&[u8]; MAX_IDENTITIES] = [&[]; MAX_IDENTITIES];
        match psk_identities(&p.buf[4..p.total], &mut ids) {
            Some(n) => {
                self.stats.read += 1;
                for id in &ids[..n] {
                    self.bindings.bind(id, instance, now_ns / 1_000_000_000);
                }
            }
            None => self.stats.unparsed += 1,
        }
    }

    /// The gathering of `dcid`: the one under way, a free one, or the oldest, given up.
    fn place_for(&mut self, dcid: &[u8]) -> Option<usize> {
        if dcid.is_empty() {
            return None;
        }
        let mut free = None;
        for (i, p) in self.pending.iter().enumerate() {
            if p.dcid_len == 0 {
                free.get_or_insert(i);
            } else if &p.dcid[..usize::from(p.dcid_len)] == dcid {
                return Some(i);
            }
        }
        let i = match free {
            Some(i) => i,
            None => {
                let i = self.next_victim;
                self.next_victim = (i + 1) % self.pending.len();
                self.stats.abandoned += 1;
                i
            }
        };
        let p = &mut self.pending[i];
        p.dcid[..dcid.len()].copy_from_slice(dcid);
        p.dcid_len = dcid.len() as u8;
        p.total = 0;
        p.have = [0; MAX_HELLO / 64];
        Some(i)
    }
}

/// Marks octets `start..end` of a gathering as arrived.
fn mark(have: &mut [u64; MAX_HELLO / 64], start: usize, end: usize) {
    let mut bit = start;
    while bit < end {
        let (word, shift) = (bit / 64, bit % 64);
        let n = (64 - shift).min(end - bit);
        have[word] |= (u64::MAX >> (64 - n)) << shift;
        bit += n;
    }
}

/// Whether octets `0..n` have all arrived.
fn covered(have: &[u64; MAX_HELLO / 64], n: usize) -> bool {
    let (whole, part) = (n / 64, n % 64);
    have[..whole].iter().all(|&w| w == u64::MAX)
        && (part == 0 || have[whole] & ((1u64 << part) - 1) == (1u64 << part) - 1)
}

/// Where the packet number and the end of a v1 Initial are, in the bytes its [`LongHeader`]
/// was read from.
struct InitialSpan {
    /// Offset of the (protected) packet number.
    pn_at: usize,
    /// Offset just past the packet (the Length field counts from `pn_at`).
    end: usize,
}

impl InitialSpan {
    /// The span of a v1 Initial long enough to open: `None` for any other packet.
    fn of(header: &LongHeader<'_>) -> Option<InitialSpan> {
        if !header.is_v1_initial() {
            return None;
        }
        let (pn_at, end) = (header.packet_number_at()?, header.packet_end()?);
        // Header protection samples 16 octets from 4 past the packet number (RFC 9001
        // §5.4.2).
        (end.checked_sub(pn_at)? >= 4 + 16).then_some(InitialSpan { pn_at, end })
    }
}

/// Removes the protection of the client Initial `packet` (its own copy of the packet `at`
/// spans, opened in place) sent to `dcid`; the plaintext frames, or `None` if it does not open
/// with its DCID's keys.
fn unprotect<'a>(
    packet: &'a mut [u8],
    dcid: &[u8],
    at: &InitialSpan,
    salt: &hkdf::Salt,
) -> Option<&'a [u8]> {
    let keys = ClientInitialKeys::derive(salt, dcid)?;
    let sample = packet.get(at.pn_at + 4..at.pn_at + 4 + 16)?;
    let mask = keys.hp.new_mask(sample).ok()?;
    let first = packet.first_mut()?;
    *first ^= mask[0] & 0x0f;
    let pn_len = usize::from(*first & 0x03) + 1;
    let mut pn = 0u64;
    let pn_bytes = packet.get_mut(at.pn_at..at.pn_at + pn_len)?;
    for (b, m) in pn_bytes.iter_mut().zip(&mask[1..]) {
        *b ^= m;
        pn = (pn << 8) | u64::from(*b);
    }
    // A client's first Initials are numbered from 0, so the truncated number is the number
    // (RFC 9000 §17.1 decoding with no packet received yet).
    let mut nonce = keys.iv;
    for (n, p) in nonce[4..].iter_mut().zip(pn.to_be_bytes()) {
        *n ^= p;
    }
    let (header, payload) = packet
        .get_mut(..at.end)?
        .split_at_mut_checked(at.pn_at + pn_len)?;
    if payload.len() < TAG_LEN {
        return None;
    }
    let plain = keys
        .packet
        .open_in_place(
            Nonce::assume_unique_for_key(nonce),
            Aad::from(&*header),
            payload,
        )
        .ok()?;
    Some(plain)
}

/// The client's Initial keys of one DCID (RFC 9001 §5.2).
struct ClientInitialKeys {
    packet: LessSafeKey,
    iv: [u8; 12],
    hp: HeaderProtectionKey,
}

impl ClientInitialKeys {
    /// `salt`: the v1 initial salt's.
    fn derive(salt: &hkdf::Salt, dcid: &[u8]) -> Option<Self> {
        let initial = salt.extract(dcid);
        let mut client = [0u8; 32];
        expand_label(&initial, b"client in", &mut client)?;
        let client = hkdf::Prk::new_less_safe(hkdf::HKDF_SHA256, &client);
        let (mut key, mut iv, mut hp) = ([0u8; 16], [0u8; 12], [0u8; 16]);
        expand_label(&client, b"quic key", &mut key)?;
        expand_label(&client, b"quic iv", &mut iv)?;
        expand_label(&client, b"quic hp", &mut hp)?;
        Some(ClientInitialKeys {
            packet: LessSafeKey::new(UnboundKey::new(&aead::AES_128_GCM, &key).ok()?),
            iv,
            hp: HeaderProtectionKey::new(&AES_128, &hp).ok()?,
        })
    }
}

/// TLS 1.3's HKDF-Expand-Label with an empty context (RFC 8446 §7.1), into `out`.
fn expand_label(prk: &hkdf::Prk, label: &[u8], out: &mut [u8]) -> Option<()> {
    struct Len(usize);
    impl hkdf::KeyType for Len {
        fn len(&self) -> usize {
            self.0
        }
    }
    let length = (out.len() as u16).to_be_bytes();
    let label_len = [(b"tls13 ".len() + label.len()) as u8];
    let info: [&[u8]; 5] = [&length, &label_len, b"tls13 ", label, &[0]];
    prk.expand(&info, Len(out.len())).ok()?.fill(out).ok()
}

/// The `pre_shared_key` identities of a ClientHello `body` (after the handshake header), into
/// `out`; how many, or `None` if it does not parse. A ClientHello without the extension has
/// none; identities past [`MAX_IDENTITIES`] are left out.
fn psk_identities<'a>(body: &'a [u8], out: &mut [&'a [u8]; MAX_IDENTITIES]) -> Option<usize> {
    let mut r = Reader::new(body);
    r.take(2 + 32)?; // legacy_version, random
    let n = usize::from(r.u8()?);
    r.take(n)?; // legacy_session_id
    let n = r.u16()?;
    r.take(usize::from(n))?; // cipher_suites
    let n = usize::from(r.u8()?);
    r.take(n)?; // legacy_compression_methods
    if r.is_empty() {
        return Some(0);
    }
    let n = r.u16()?;
    let mut exts = Reader::new(r.take(usize::from(n))?);
    while !exts.is_empty() {
        let kind = exts.u16()?;
        let n = exts.u16()?;
        let data = exts.take(usize::from(n))?;
        if kind != EXT_PRE_SHARED_KEY {
            continue;
        }
        // OfferedPsks: identities<7..2^16-1> (identity<1..2^16-1>, obfuscated_ticket_age
        // u32), then the binders, which are not needed here.
        let mut psk = Reader::new(data);
        let n = psk.u16()?;
        let mut ids = Reader::new(psk.take(usize::from(n))?);
        let mut count = 0;
        while !ids.is_empty() {
            let n = ids.u16()?;
            let id = ids.take(usize::from(n))?;
            ids.take(4)?;
            if count < MAX_IDENTITIES && !id.is_empty() {
                out[count] = id;
                count += 1;
            }
        }
        return Some(count);
    }
    Some(0)
}
