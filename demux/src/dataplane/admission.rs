//! Admission of new connections, decided in the data plane before a datagram reaches a ring:
//! the demux answers token-less Initials with a stateless Retry itself (so a flood from
//! spoofed addresses never costs a worker a handshake), checks the tokens its Retries carry,
//! and holds every source prefix to a budget of new connections while under pressure.
//!
//! Tokens are quinn's own (quinn-proto 0.11 `token.rs`), sealed with the token key every
//! worker's endpoint shares (`ServerConfig::new(crypto, token_key)`), so the worker that gets
//! the client's second Initial accepts the token, marks the address validated and sends the
//! `original_destination_connection_id` and `retry_source_connection_id` transport parameters
//! from it. The format, which quinn keeps private:
//!
//! ```text
//! plaintext = 0x00 (Retry) ‖ ip (0x00 ‖ 4 octets | 0x01 ‖ 16 octets) ‖ port (u16 BE)
//!             ‖ original DCID length (1) ‖ original DCID ‖ issued (u64 BE, Unix seconds)
//! key       = HKDF-SHA256-Expand(PRK = HKDF-Extract(salt = "", token secret), info = nonce, 32)
//! token     = AES-256-GCM(key, 96-bit zero nonce, no AAD)(plaintext) ‖ tag ‖ nonce (16 octets)
//! ```
//!
//! The system tests `interop::quinn::retry_*` and `interop::clients::*_retry` pin it against
//! real quinn workers and third-party clients. Validation tokens (quinn's NEW_TOKEN, type `0x01`
//! with an IP and an issue time) decode the same way.
//!
//! The Initials it lets in that open a connection are shown to the [`HelloInspector`], which
//! tells the session store which instance each ClientHello's tickets went to (`tickets.rs`).
//!
//! Nothing here allocates after [`Admission::new`], and nothing panics on any input.

use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use ring::aead::{self, Aad, LessSafeKey, Nonce, UnboundKey};
use ring::hkdf;
use ringmux_quic_lb::{LongHeader, Reader, Router, QUIC_V1};
use siphasher::sip::SipHasher13;

use crate::tickets::HelloInspector;

/// RFC 9001 §5.8: the Retry integrity key and nonce of QUIC v1.
const RETRY_KEY_V1: [u8; 16] = [
    0xbe, 0x0c, 0x69, 0x0b, 0x9f, 0x66, 0x57, 0x5a, 0x1d, 0x76, 0x6b, 0x54, 0xe3, 0x68, 0xc8, 0x4e,
];
const RETRY_NONCE_V1: [u8; 12] = [
    0x46, 0x15, 0x99, 0xd3, 0x5d, 0x63, 0x2b, 0xf2, 0x23, 0x98, 0x25, 0xbb,
];
/// How long a Retry token is good for: quinn's default `retry_token_lifetime`, which the
/// workers keep, so a token the demux accepts is one the worker accepts.
pub const RETRY_TOKEN_LIFETIME: Duration = Duration::from_secs(15);
/// quinn's default NEW_TOKEN lifetime (`ValidationTokenConfig::lifetime`).
const VALIDATION_TOKEN_LIFETIME: Duration = Duration::from_secs(14 * 24 * 3600);
/// Largest sealed token the demux opens: a Retry token with an IPv6 address and a 20-octet
/// original DCID is 1 + 17 + 2 + 21 + 8 = 49 octets, plus the 16-octet tag.
const MAX_SEALED: usize = 80;
const TAG: usize = 16;
const TOKEN_NONCE: usize = 16;
/// The window in which new-connection packets are counted for `--retry auto`.
const WINDOW_NS: u64 = 100_000_000;
/// How long pressure lasts after its last sign.
const PRESSURE_HOLD_NS: u64 = 1_000_000_000;
/// Buckets of the per-prefix budget: fixed at start (8 octets each).
const BUDGET_BUCKETS: usize = 4096;

/// When the demux answers a token-less Initial with a Retry (`--retry`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum RetryMode {
    /// Never: every Initial goes to a worker.
    Never,
    /// Under pressure: new-connection packets above `--retry-above` per second, or a ring past
    /// `--initial-shed-at`; for a second after the last sign.
    Auto,
    /// Always: every client address is validated (one extra round trip per connection).
    Always,
}

/// What admission needs from the configuration.
#[derive(Clone, Debug)]
pub struct Settings {
    pub retry: RetryMode,
    /// New-connection packets per second (box-wide) above which `auto` sends Retries.
    pub retry_above: u32,
    /// New connections per second one source prefix may open while under pressure (0: no
    /// budget), with a burst of as many.
    pub prefix_budget: u32,
    /// Prefix lengths the budget groups sources by.
    pub prefix_v4: u8,
    pub prefix_v6: u8,
}

/// What happens to a packet that opens a connection.
#[derive(Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Into the ring.
    Forward,
    /// Dropped: the ring is past `--initial-shed-at`.
    Shed,
    /// Dropped: a Retry token of ours for another address, or expired.
    TokenRefused,
    /// Dropped: its source prefix spent its budget.
    OverBudget,
    /// Answered with the Retry in [`Admission::retry_packet`].
    Retry,
}

/// The result of looking at a token.
#[derive(Debug, PartialEq, Eq)]
enum TokenCheck {
    /// No token, or one the demux cannot open (another server's, garbage): the address is not
    /// validated, as RFC 9000 §8.1.3 asks.
    Unvalidated,
    /// Ours and good: the address is validated.
    Valid,
    /// A Retry token of ours that does not fit: quinn refuses the connection, so nothing is
    /// forwarded.
    Refused,
}

/// The admission state of one data plane.
pub struct Admission {
    settings: Settings,
    router: Router,
    token_prk: hkdf::Prk,
    retry_key: LessSafeKey,
    /// New-connection packets in the current window, and when it began.
    window_count: u32,
    window_start_ns: u64,
    window_limit: u32,
    pressure_until_ns: u64,
    budget: PrefixBudget,
    /// Reads the ClientHellos of the connections let in.
    hellos: HelloInspector,
    /// `original DCID length ‖ original DCID ‖ Retry packet ‖ tag`: the pseudo-packet the tag
    /// covers, and the packet after its first `1 + len` octets.
    retry_buf: [u8; 512],
    retry_span: (usize, usize),
    /// Retries sent, and not sent (the socket's send buffer was full); tokens accepted (a
    /// refused one is a [`Verdict::TokenRefused`], counted as a drop).
    pub stats: Stats,
}

/// Counts kept by [`Admission`] (the data plane publishes them).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    pub retries_sent: u64,
    pub retries_unsent: u64,
    pub tokens_accepted: u64,
}

impl Admission {
    /// `token_secret` is the key file's `token` (the HKDF input every worker's quinn endpoint
    /// uses); `router` the data plane's, for the CIDs Retries choose; `hellos` reads the
    /// ClientHellos of the connections let in.
    pub fn new(
        settings: Settings,
        router: Router,
        token_secret: &[u8; 64],
        hellos: HelloInspector,
    ) -> Self {
        let token_prk = hkdf::Salt::new(hkdf::HKDF_SHA256, &[]).extract(token_secret);
        let retry_key = LessSafeKey::new(
            UnboundKey::new(&aead::AES_128_GCM, &RETRY_KEY_V1).expect("a 16-octet AES-128 key"),
        );
        let window_limit = (settings.retry_above / 10).max(1);
        let budget = PrefixBudget::new(settings.prefix_budget);
        Admission {
            settings,
            router,
            token_prk,
            retry_key,
            window_count: 0,
            window_start_ns: 0,
            window_limit,
            pressure_until_ns: 0,
            budget,
            hellos,
            retry_buf: [0; 512],
            retry_span: (0, 0),
            stats: Stats::default(),
        }
    }

    /// Whether the demux is under pressure at `now_ns` (`CLOCK_MONOTONIC`).
    pub fn under_pressure(&self, now_ns: u64) -> bool {
        now_ns < self.pressure_until_ns
    }

    /// Decides for a datagram from `remote`, headed for `lane`, whose first packet opens a
    /// connection: `header` ([`LongHeader::starts_connection`]), as the dispatcher read it. `hashed`: its DCID is no instance's (the client chose
    /// it), so it is a new connection; otherwise it carries one of our CIDs (the Initial after
    /// a Retry, one of a handshake in progress, or one sent to a CID learned elsewhere).
    /// `crowded`: the lane's ring is past `--initial-shed-at`.
    ///
    /// Only a token validates an address, whatever the DCID: every Retry the demux sends tells
    /// its SCID, one of our CIDs, to whoever asked, so "the DCID is ours" proves nothing about
    /// the sender. An Initial to our CID without a token the demux can validate is a
    /// new-connection packet like any other: counted towards pressure, shed from a crowded
    /// ring, held to its prefix's budget, and answered with a Retry under `--retry always`
    /// (and under `auto` while under pressure).
    pub fn decide(
        &mut self,
        header: &LongHeader<'_>,
        remote: SocketAddr,
        lane: u8,
        hashed: bool,
        crowded: bool,
        now_ns: u64,
    ) -> Verdict {
        if !header.is_v1_initial() {
            if !hashed {
                // 0-RTT (or a QUIC v2 Initial) to one of our CIDs. Such a packet cannot open
                // a connection: a server creates one only for a client Initial (RFC 9000
                // §5.2.2; quinn-proto 0.11 `Endpoint::handle` ignores any other long-header
                // packet of an unknown connection, and answers a version it does not speak,
                // such as v2, with a Version Negotiation). It reaches a connection only if an
                // Initial already opened it, and that Initial met this admission. Handshake
                // packets do not come here at all (`starts_connection`).
                return Verdict::Forward;
            }
            // 0-RTT of a connection nobody owns, or another version's Initial.
            self.count(crowded, now_ns);
            return if crowded {
                Verdict::Shed
            } else {
                Verdict::Forward
            };
        }
        if hashed {
            self.count(crowded, now_ns);
        }
        // A token of ours decides alone, whatever the DCID: a good one admits (the Initial after
        // our Retry, whose ClientHello the inspector reads), a refused one never costs a worker
        // anything.
        match self.check_token(header.token(), remote) {
            TokenCheck::Refused => return Verdict::TokenRefused,
            // A validated address: let it in past the shedding threshold (the ring still has
            // room, and this is who the room is kept for).
            TokenCheck::Valid => return self.admit(header, remote, lane, now_ns),
            TokenCheck::Unvalidated => {}
        }
        if !hashed {
            // Our CID, and no token or one the demux cannot open (garbage, another server's):
            // the address is not validated (RFC 9000 §8.1.3; a quinn worker treats such a token
            // as none, quinn-proto 0.11 `token.rs` `IncomingToken::from_header`), so neither
            // may be a way past `--retry always`, pressure or the prefix budget.
            //
            // Legitimate clients: after a Retry, a client repeats its token in every Initial
            // (RFC 9000 §8.1.2, §17.2.5.3), so under `always` its Initials to our CIDs carry
            // one. Without a Retry (under `auto` and `never`, or a NEW_TOKEN token that a client
            // might not repeat), a client's later Initials of a handshake in progress come here:
            // forwarded while there is no pressure. A Retry that one of them draws under
            // pressure is discarded by the client, which has processed the server's Initial
            // (RFC 9000 §17.2.5.2): the cost is that datagram, and the client finishes in
            // Handshake packets, which pass (it drops its Initial keys when it first sends one,
            // RFC 9001 §4.9.1).
            self.count(crowded, now_ns);
        }
        let retry = match self.settings.retry {
            RetryMode::Never => false,
            RetryMode::Auto => self.under_pressure(now_ns),
            RetryMode::Always => true,
        };
        if retry && self.mint_retry(header, remote, lane) {
            return Verdict::Retry;
        }
        if crowded {
            return Verdict::Shed;
        }
        match self.budgeted(remote, now_ns) {
            // A token-less Initial to our CID is a later one of a handshake, whose ClientHello
            // was read with its first Initial: not read again.
            Verdict::Forward if !hashed && header.token().is_empty() => Verdict::Forward,
            Verdict::Forward => self.observe(header, lane, now_ns),
            refused => refused,
        }
    }

    /// [`Admission::budgeted`]; an Initial let in is shown to the ClientHello inspector.
    fn admit(
        &mut self,
        header: &LongHeader<'_>,
        remote: SocketAddr,
        lane: u8,
        now_ns: u64,
    ) -> Verdict {
        match self.budgeted(remote, now_ns) {
            Verdict::Forward => self.observe(header, lane, now_ns),
            refused => refused,
        }
    }

    /// Shows an Initial headed for `lane` to the ClientHello inspector; [`Verdict::Forward`].
    fn observe(&mut self, header: &LongHeader<'_>, lane: u8, now_ns: u64) -> Verdict {
        let instance = lane % self.router.instance_count().max(1);
        self.hellos.observe_header(header, instance, now_ns);
        Verdict::Forward
    }

    /// What the ClientHello inspector counted.
    pub fn hello_stats(&self) -> crate::tickets::HelloStats {
        self.hellos.stats()
    }

    /// Some ring is past `--initial-shed-at` at `now_ns`: pressure (for every instance).
    pub fn crowded(&mut self, now_ns: u64) {
        self.pressure_until_ns = now_ns.saturating_add(PRESSURE_HOLD_NS);
    }

    /// Counts a new-connection packet; a full window or a crowded ring is pressure.
    fn count(&mut self, crowded: bool, now_ns: u64) {
        if now_ns.wrapping_sub(self.window_start_ns) >= WINDOW_NS {
            self.window_start_ns = now_ns;
            self.window_count = 0;
        }
        self.window_count = self.window_count.saturating_add(1);
        if crowded || self.window_count > self.window_limit {
            self.pressure_until_ns = now_ns.saturating_add(PRESSURE_HOLD_NS);
        }
    }

    /// `Forward`, unless under pressure and `remote`'s prefix has spent its budget.
    fn budgeted(&mut self, remote: SocketAddr, now_ns: u64) -> Verdict {
        if self.under_pressure(now_ns)
            && !self.budget.take(
                remote.ip(),
                self.settings.prefix_v4,
                self.settings.prefix_v6,
                now_ns,
            )
        {
            Verdict::OverBudget
        } else {
            Verdict::Forward
        }
    }

    /// The Retry [`Admission::decide`] answered [`Verdict::Retry`] with.
    pub fn retry_packet(&self) -> &[u8] {
        let (start, end) = self.retry_span;
        &self.retry_buf[start..end]
    }

    /// Builds a Retry for `initial` into `retry_buf`: SCID a fresh CID of `lane`, DCID the
    /// client's SCID, a token for `remote` carrying the Initial's DCID as the original one
    /// (whoever chose it: the client, or one of our CIDs, which quinn's workers accept the
    /// same), the integrity tag (RFC 9001 §5.8). `false` if randomness is unavailable.
    fn mint_retry(&mut self, initial: &LongHeader<'_>, remote: SocketAddr, lane: u8) -> bool {
        let mut random = [0u8; 1 + TOKEN_NONCE + 20];
        if getrandom::fill(&mut random).is_err() {
            return false;
        }
        let (first_bits, rest) = random.split_at_mut(1);
        let (token_nonce, cid_nonce) = rest.split_at_mut(TOKEN_NONCE);
        let (odcid, client_scid) = (initial.dcid(), initial.scid());
        let nonce_len = self.router.codec().nonce_len();
        let Some(nonce) = cid_nonce.get_mut(..nonce_len) else {
            return false;
        };
        let Some(mut scid) = self.router.cid_for_lane(lane, nonce) else {
            return false;
        };
        // RFC 9000 §17.2.5.1: the Retry's SCID must differ from the Initial's DCID, which may
        // be a CID of this lane. Another nonce is another CID (the encoding is a permutation).
        if scid[..] == *odcid {
            let Some(b) = nonce.first_mut() else {
                return false;
            };
            *b ^= 1;
            let Some(other) = self.router.cid_for_lane(lane, nonce) else {
                return false;
            };
            scid = other;
        }
        let (first_bits, token_nonce) = (&*first_bits, &*token_nonce);
        let buf = &mut self.retry_buf;
        let mut w = Writer {
            buf: &mut *buf,
            at: 0,
        };
        // The pseudo-packet's prefix (RFC 9001 §5.8).
        w.put(&[odcid.len() as u8]);
        w.put(odcid);
        let start = w.at;
        // Long header, fixed bit, type Retry (0b11), four unused random bits.
        w.put(&[0xf0 | (first_bits[0] & 0x0f)]);
        w.put(&QUIC_V1.to_be_bytes());
        w.put(&[client_scid.len() as u8]);
        w.put(client_scid);
        w.put(&[scid.len() as u8]);
        w.put(&scid);
        // The token: plaintext, sealed in place, tag, nonce.
        let token_start = w.at;
        w.put(&[0x00]);
        put_addr(&mut w, remote);
        w.put(&[odcid.len() as u8]);
        w.put(odcid);
        w.put(&unix_secs().to_be_bytes());
        let Some(end) = w.fits(TAG + TOKEN_NONCE + TAG) else {
            return false;
        };
        let key = token_aead(&self.token_prk, token_nonce);
        let Ok(tag) = key.seal_in_place_separate_tag(
            Nonce::assume_unique_for_key([0; 12]),
            Aad::empty(),
            &mut buf[token_start..end],
        ) else {
            return false;
        };
        let mut w = Writer {
            buf: &mut *buf,
            at: end,
        };
        w.put(tag.as_ref());
        w.put(token_nonce);
        let packet_end = w.at;
        let Ok(tag) = self.retry_key.seal_in_place_separate_tag(
            Nonce::assume_unique_for_key(RETRY_NONCE_V1),
            Aad::from(&buf[..packet_end]),
            &mut [],
        ) else {
            return false;
        };
        buf[packet_end..packet_end + TAG].copy_from_slice(tag.as_ref());
        self.retry_span = (start, packet_end + TAG);
        true
    }

    /// Opens `token` if it is one of ours and checks it against `remote`.
    fn check_token(&mut self, token: &[u8], remote: SocketAddr) -> TokenCheck {
        let check = open_token(&self.token_prk, token, remote, SystemTime::now());
        if check == TokenCheck::Valid {
            self.stats.tokens_accepted += 1;
        }
        check
    }
}

/// A bounds-checked cursor into a fixed buffer; writes past the end are dropped and noticed
/// by [`Writer::fits`].
struct Writer<'a> {
    buf: &'a mut [u8; 512],
    at: usize,
}

impl Writer<'_> {
    fn put(&mut self, bytes: &[u8]) {
        if let Some(dst) = self.buf.get_mut(self.at..self.at + bytes.len()) {
            dst.copy_from_slice(bytes);
        }
        self.at += bytes.len();
    }

    /// Where the written part ends, if it and `more` octets after it fit.
    fn fits(&self, more: usize) -> Option<usize> {
        (self.at + more <= self.buf.len()).then_some(self.at)
    }
}

fn put_addr(w: &mut Writer<'_>, addr: SocketAddr) {
    match addr.ip() {
        IpAddr::V4(ip) => {
            w.put(&[0]);
            w.put(&ip.octets());
        }
        IpAddr::V6(ip) => {
            w.put(&[1]);
            w.put(&ip.octets());
        }
    }
    w.put(&addr.port().to_be_bytes());
}

/// The AEAD key of one token: quinn-proto's `HandshakeTokenKey::aead_from_hkdf` for
/// `ring::hkdf::Prk`.
fn token_aead(prk: &hkdf::Prk, nonce: &[u8]) -> LessSafeKey {
    let info = [nonce];
    let mut key = [0u8; 32];
    // Expanding to one SHA-256 output length (32 octets) cannot fail.
    let _ = prk
        .expand(&info, hkdf::HKDF_SHA256)
        .and_then(|okm| okm.fill(&mut key));
    LessSafeKey::new(UnboundKey::new(&aead::AES_256_GCM, &key).expect("a 32-octet AES-256 key"))
}

fn unix_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Opens and checks a token as a quinn worker would.
fn open_token(prk: &hkdf::Prk, token: &[u8], remote: SocketAddr, now: SystemTime) -> TokenCheck {
    let Some(sealed_len) = token.len().checked_sub(TOKEN_NONCE) else {
        return TokenCheck::Unvalidated;
    };
    if !(TAG + 1..=MAX_SEALED).contains(&sealed_len) {
        return TokenCheck::Unvalidated;
    }
    let (sealed, nonce) = token.split_at(sealed_len);
    let mut copy = [0u8; MAX_SEALED];
    let copy = &mut copy[..sealed_len];
    copy.copy_from_slice(sealed);
    let key = token_aead(prk, nonce);
    let Ok(plain) = key.open_in_place(Nonce::assume_unique_for_key([0; 12]), Aad::empty(), copy)
    else {
        return TokenCheck::Unvalidated;
    };
    let mut r = Reader::new(plain);
    let now_secs = now.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let fresh =
        |issued: u64, lifetime: Duration| issued.saturating_add(lifetime.as_secs()) >= now_secs;
    match r.u8() {
        Some(0) => {
            let parsed = (|| {
                let ip = token_ip(&mut r)?;
                let port = r.u16()?;
                let odcid_len = usize::from(r.u8()?);
                if odcid_len > 20 {
                    return None;
                }
                r.take(odcid_len)?;
                let issued = r.u64()?;
                r.is_empty().then_some((SocketAddr::new(ip, port), issued))
            })();
            match parsed {
                None => TokenCheck::Unvalidated,
                Some((addr, issued)) if addr == remote && fresh(issued, RETRY_TOKEN_LIFETIME) => {
                    TokenCheck::Valid
                }
                Some(_) => TokenCheck::Refused,
            }
        }
        Some(1) => {
            let parsed = (|| {
                let ip = token_ip(&mut r)?;
                let issued = r.u64()?;
                r.is_empty().then_some((ip, issued))
            })();
            // The worker also checks that it was not used before (a log the demux lacks);
            // here it only earns its address the room a validated one gets.
            match parsed {
                Some((ip, issued))
                    if ip == remote.ip() && fresh(issued, VALIDATION_TOKEN_LIFETIME) =>
                {
                    TokenCheck::Valid
                }
                _ => TokenCheck::Unvalidated,
            }
        }
        _ => TokenCheck::Unvalidated,
    }
}

/// An address in a token: `0x00 ‖ 4 octets` or `0x01 ‖ 16 octets`.
fn token_ip(r: &mut Reader<'_>) -> Option<IpAddr> {
    match r.u8()? {
        0 => Some(IpAddr::from(r.array::<4>()?)),
        1 => Some(IpAddr::from(r.array::<16>()?)),
        _ => None,
    }
}

/// Per-source-prefix budget of new connections: a fixed table of GCRA cells (one theoretical
/// arrival time each), indexed by a keyed hash of the prefix, so that its memory is fixed at
/// start and nobody can aim at another prefix's cell. Prefixes that share a cell share its
/// budget.
struct PrefixBudget {
    /// Theoretical arrival time of each cell (ns, `CLOCK_MONOTONIC`); empty: no budget.
    cells: Vec<u64>,
    /// Nanoseconds per connection, and the burst tolerance (as many connections as a second
    /// allows).
    interval_ns: u64,
    tolerance_ns: u64,
    hasher: SipHasher13,
}

impl PrefixBudget {
    fn new(per_second: u32) -> Self {
        let mut key = [0u8; 16];
        // Without randomness the key is fixed: cells stay bounded, only aiming gets easier.
        let _ = getrandom::fill(&mut key);
        let interval_ns = if per_second == 0 {
            0
        } else {
            1_000_000_000 / u64::from(per_second)
        };
        PrefixBudget {
            cells: if per_second == 0 {
                Vec::new()
            } else {
                vec![0; BUDGET_BUCKETS]
            },
            interval_ns,
            tolerance_ns: 1_000_000_000u64.saturating_sub(interval_ns),
            hasher: SipHasher13::new_with_key(&key),
        }
    }

    /// Takes one connection from `ip`'s prefix at `now_ns`; `false` if it has none left.
    fn take(&mut self, ip: IpAddr, v4: u8, v6: u8, now_ns: u64) -> bool {
        if self.cells.is_empty() {
            return true;
        }
        let key: u128 = match ip {
            IpAddr::V4(a) => mask(u128::from(u32::from(a)) << 96, v4),
            IpAddr::V6(a) => match a.to_ipv4_mapped() {
                Some(a) => mask(u128::from(u32::from(a)) << 96, v4),
                None => mask(u128::from(a), v6) | 1,
            },
        };
        let cell = (self.hasher.hash(&key.to_be_bytes()) as usize) % self.cells.len();
        let tat = self.cells[cell].max(now_ns);
        if tat - now_ns > self.tolerance_ns {
            return false;
        }
        self.cells[cell] = tat + self.interval_ns;
        true
    }
}

/// The top `bits` bits of `v`.
fn mask(v: u128, bits: u8) -> u128 {
    match bits {
        0 => 0,
        b if b >= 128 => v,
        b => v & !(u128::MAX >> b),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ringmux_quic_lb::QuicLbConfig;

    fn admission(retry: RetryMode, budget: u32) -> Admission {
        let mut cfg = QuicLbConfig::default_with_key([7; 16]);
        cfg.instance_count = 2;
        let router = Router::new(&cfg, [3; 16]).unwrap();
        Admission::new(
            Settings {
                retry,
                retry_above: 1000,
                prefix_budget: budget,
                prefix_v4: 24,
                prefix_v6: 56,
            },
            router,
            &[9; 64],
            crate::tickets::HelloInspector::new(Default::default()),
        )
    }

    /// The header of `packet` as the dispatcher hands it over.
    fn header(packet: &[u8]) -> LongHeader<'_> {
        LongHeader::parse(packet).expect("a long header")
    }

    fn initial(dcid: &[u8], scid: &[u8], token: &[u8]) -> Vec<u8> {
        let mut p = vec![0xc3, 0, 0, 0, 1, dcid.len() as u8];
        p.extend_from_slice(dcid);
        p.push(scid.len() as u8);
        p.extend_from_slice(scid);
        assert!(token.len() < 16384);
        if token.len() < 64 {
            p.push(token.len() as u8);
        } else {
            p.extend_from_slice(&(0x4000 | token.len() as u16).to_be_bytes());
        }
        p.extend_from_slice(token);
        p.extend_from_slice(&[0x44, 0x00]);
        p.resize(1200, 0);
        p
    }

    const CLIENT: &str = "192.0.2.7:4433";

    /// RFC 9001 Appendix A.4: the Retry packet of the sample handshake and its tag.
    #[test]
    fn retry_tag_matches_rfc9001_a4() {
        let odcid = hex::decode("8394c8f03e515708").unwrap();
        let packet =
            hex::decode("ff000000010008f067a5502a4262b5746f6b656e04a265ba2eff4d829058fb3f0f2496ba")
                .unwrap();
        let (body, tag) = packet.split_at(packet.len() - TAG);
        let mut aad = vec![odcid.len() as u8];
        aad.extend_from_slice(&odcid);
        aad.extend_from_slice(body);
        let key = LessSafeKey::new(UnboundKey::new(&aead::AES_128_GCM, &RETRY_KEY_V1).unwrap());
        let got = key
            .seal_in_place_separate_tag(
                Nonce::assume_unique_for_key(RETRY_NONCE_V1),
                Aad::from(&aad[..]),
                &mut [],
            )
            .unwrap();
        assert_eq!(got.as_ref(), tag);
    }

    #[test]
    fn a_minted_retry_carries_a_token_that_checks_and_a_cid_of_the_lane() {
        let mut a = admission(RetryMode::Always, 0);
        let remote: SocketAddr = CLIENT.parse().unwrap();
        let odcid = [0x11; 8];
        let scid = [0x22; 5];
        let v = a.decide(
            &header(&initial(&odcid, &scid, &[])),
            remote,
            3,
            true,
            false,
            1,
        );
        assert_eq!(v, Verdict::Retry);
        let retry = a.retry_packet().to_vec();
        assert_eq!(retry[0] & 0xf0, 0xf0, "a v1 Retry");
        assert_eq!(&retry[1..5], &[0, 0, 0, 1]);
        assert_eq!(usize::from(retry[5]), scid.len());
        assert_eq!(&retry[6..11], &scid);
        let cid_len = usize::from(retry[11]);
        let new_cid = &retry[12..12 + cid_len];
        assert_eq!(a.router.owner(new_cid), Some(3), "routes back to lane 3");
        let token = &retry[12 + cid_len..retry.len() - TAG];
        // The tag covers the original DCID and the packet.
        let mut aad = vec![odcid.len() as u8];
        aad.extend_from_slice(&odcid);
        aad.extend_from_slice(&retry[..retry.len() - TAG]);
        let tag = a
            .retry_key
            .seal_in_place_separate_tag(
                Nonce::assume_unique_for_key(RETRY_NONCE_V1),
                Aad::from(&aad[..]),
                &mut [],
            )
            .unwrap();
        assert_eq!(tag.as_ref(), &retry[retry.len() - TAG..]);
        // The client's next Initial, to the new CID with the token: forwarded and counted.
        let again = initial(new_cid, &scid, token);
        assert_eq!(
            a.decide(&header(&again), remote, 3, false, true, 2),
            Verdict::Forward
        );
        assert_eq!(a.stats.tokens_accepted, 1);
        // From another address: refused, and never forwarded.
        let other: SocketAddr = "192.0.2.8:4433".parse().unwrap();
        assert_eq!(
            a.decide(&header(&again), other, 3, false, false, 3),
            Verdict::TokenRefused
        );
        assert_eq!(a.stats.tokens_accepted, 1);
        // A token sealed with another key is nobody's: treated as none (another Retry).
        let mut b = admission(RetryMode::Always, 0);
        b.token_prk = hkdf::Salt::new(hkdf::HKDF_SHA256, &[]).extract(&[1; 64]);
        assert_eq!(
            b.decide(&header(&again), remote, 3, true, false, 4),
            Verdict::Retry
        );
        assert_eq!(b.stats.tokens_accepted, 0);
    }

    #[test]
    fn an_expired_retry_token_is_refused_and_a_validation_token_validates() {
        let a = admission(RetryMode::Never, 0);
        let remote: SocketAddr = CLIENT.parse().unwrap();
        let seal = |plain: &[u8]| {
            let nonce = [5u8; TOKEN_NONCE];
            let mut buf = plain.to_vec();
            let key = token_aead(&a.token_prk, &nonce);
            key.seal_in_place_append_tag(
                Nonce::assume_unique_for_key([0; 12]),
                Aad::empty(),
                &mut buf,
            )
            .unwrap();
            buf.extend_from_slice(&nonce);
            buf
        };
        let now = UNIX_EPOCH + Duration::from_secs(1_000_000);
        let mut retry = vec![0, 0, 192, 0, 2, 7, 0x11, 0x51, 2, 0xaa, 0xbb];
        retry.extend_from_slice(&(1_000_000u64 - 16).to_be_bytes());
        assert_eq!(
            open_token(&a.token_prk, &seal(&retry), remote, now),
            TokenCheck::Refused
        );
        let mut validation = vec![1, 0, 192, 0, 2, 7];
        validation.extend_from_slice(&(1_000_000u64 - 3600).to_be_bytes());
        assert_eq!(
            open_token(&a.token_prk, &seal(&validation), remote, now),
            TokenCheck::Valid
        );
        let elsewhere: SocketAddr = "198.51.100.1:1".parse().unwrap();
        assert_eq!(
            open_token(&a.token_prk, &seal(&validation), elsewhere, now),
            TokenCheck::Unvalidated
        );
        // Trailing octets: not a token of this format.
        validation.push(0);
        assert_eq!(
            open_token(&a.token_prk, &seal(&validation), remote, now),
            TokenCheck::Unvalidated
        );
    }

    #[test]
    fn auto_retries_only_under_pressure_and_crowded_sheds_without_retry() {
        let mut a = admission(RetryMode::Auto, 0);
        let remote: SocketAddr = CLIENT.parse().unwrap();
        let p = initial(&[0x33; 8], &[0x44; 8], &[]);
        // 1000/s is 100 per 100 ms window: the 101st within a window is pressure.
        for _ in 0..100 {
            assert_eq!(
                a.decide(&header(&p), remote, 0, true, false, 10),
                Verdict::Forward
            );
        }
        assert_eq!(
            a.decide(&header(&p), remote, 0, true, false, 11),
            Verdict::Retry
        );
        // Pressure holds for a second after the last sign.
        let later = 11 + PRESSURE_HOLD_NS - 1;
        assert_eq!(
            a.decide(&header(&p), remote, 0, true, false, later),
            Verdict::Retry
        );
        let quiet = later + PRESSURE_HOLD_NS + 1;
        assert_eq!(
            a.decide(&header(&p), remote, 0, true, false, quiet),
            Verdict::Forward
        );
        // A crowded ring is pressure at once, for the packets to any ring.
        assert_eq!(
            a.decide(&header(&p), remote, 0, true, true, quiet + 1),
            Verdict::Retry
        );
        let calm = quiet + 1 + PRESSURE_HOLD_NS;
        assert_eq!(
            a.decide(&header(&p), remote, 0, true, false, calm),
            Verdict::Forward
        );
        a.crowded(calm + 1);
        assert_eq!(
            a.decide(&header(&p), remote, 0, true, false, calm + 2),
            Verdict::Retry
        );
        let mut never = admission(RetryMode::Never, 0);
        assert_eq!(
            never.decide(&header(&p), remote, 0, true, true, 1),
            Verdict::Shed
        );
        assert_eq!(
            never.decide(&header(&p), remote, 0, true, false, 2),
            Verdict::Forward
        );
    }

    #[test]
    fn a_prefix_over_budget_is_refused_under_pressure_only_and_others_are_not() {
        let mut a = admission(RetryMode::Never, 10);
        let p = initial(&[0x33; 8], &[0x44; 8], &[]);
        let greedy: SocketAddr = "203.0.113.9:1000".parse().unwrap();
        let neighbour: SocketAddr = "203.0.113.200:1000".parse().unwrap();
        let other: SocketAddr = "198.51.100.1:1000".parse().unwrap();
        // Not under pressure: no budget.
        for _ in 0..50 {
            assert_eq!(
                a.decide(&header(&p), greedy, 0, true, false, 1),
                Verdict::Forward
            );
        }
        // Under pressure (a crowded ring sheds; a valid token would pass it): a second's worth
        // (10) then refusals, shared by the whole /24.
        a.pressure_until_ns = u64::MAX;
        let mut passed = 0;
        for _ in 0..50 {
            if a.budgeted(greedy, 1_000) == Verdict::Forward {
                passed += 1;
            }
        }
        assert_eq!(passed, 10);
        assert_eq!(a.budgeted(neighbour, 1_000), Verdict::OverBudget);
        assert_eq!(a.budgeted(other, 1_000), Verdict::Forward);
        // A tenth of a second later the prefix has earned one more.
        assert_eq!(a.budgeted(greedy, 100_001_000), Verdict::Forward);
        assert_eq!(a.budgeted(greedy, 100_001_000), Verdict::OverBudget);
    }

    #[test]
    fn no_input_panics() {
        let mut a = admission(RetryMode::Always, 5);
        let remote: SocketAddr = "[2001:db8::1]:443".parse().unwrap();
        let mut seed = 0x1234_5678_u64;
        for len in 0..300 {
            let mut p = vec![0u8; len];
            for b in &mut p {
                seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
                *b = (seed >> 56) as u8;
            }
            if let Some(b) = p.first_mut() {
                *b = 0xc0 | (*b & 0x0f);
            }
            // What the dispatcher would hand over: a long header that parses.
            let Some(h) = LongHeader::parse(&p) else {
                continue;
            };
            for hashed in [false, true] {
                let _ = a.decide(&h, remote, 1, hashed, len % 2 == 0, len as u64);
            }
        }
        // Maximal lengths: 20-octet CIDs, a 63-octet token.
        let p = initial(&[1; 20], &[2; 20], &[3; 63]);
        assert_eq!(
            a.decide(&header(&p), remote, 1, true, false, 1),
            Verdict::Retry
        );
        assert!(a.retry_packet().len() < 256);
    }

    /// A CID of `lane` as a worker (or a Retry of the demux) issues it.
    fn our_cid(a: &Admission, lane: u8) -> Vec<u8> {
        let nonce = vec![0x6e; a.router.codec().nonce_len()];
        let cid = a.router.cid_for_lane(lane, &nonce).unwrap().to_vec();
        assert_eq!(a.router.owner(&cid), Some(lane));
        cid
    }

    /// The SCID and token of the Retry [`Admission::retry_packet`] holds, sent to `dcid`.
    fn parse_retry(retry: &[u8], dcid: &[u8]) -> (Vec<u8>, Vec<u8>) {
        assert_eq!(retry[0] & 0xf0, 0xf0, "a v1 Retry");
        assert_eq!(usize::from(retry[5]), dcid.len());
        assert_eq!(&retry[6..6 + dcid.len()], dcid);
        let at = 6 + dcid.len();
        let cid_len = usize::from(retry[at]);
        let cid = retry[at + 1..at + 1 + cid_len].to_vec();
        let token = retry[at + 1 + cid_len..retry.len() - TAG].to_vec();
        (cid, token)
    }

    /// The original DCID a Retry token of `a` carries.
    fn token_odcid(a: &Admission, token: &[u8]) -> Vec<u8> {
        let (sealed, nonce) = token.split_at(token.len() - TOKEN_NONCE);
        let mut buf = sealed.to_vec();
        let plain = token_aead(&a.token_prk, nonce)
            .open_in_place(
                Nonce::assume_unique_for_key([0; 12]),
                Aad::empty(),
                &mut buf,
            )
            .expect("a token of ours");
        // 0x00 (Retry) ‖ 0x00 ‖ IPv4 ‖ port ‖ ODCID length ‖ ODCID ‖ issued
        assert_eq!(&plain[..2], &[0, 0]);
        let len = usize::from(plain[8]);
        plain[9..9 + len].to_vec()
    }

    /// Issue #30 item 3: an attacker harvests our CIDs from our own Retries (their SCIDs) and
    /// sends token-less Initials to them. Under `--retry always` each gets a Retry like any
    /// token-less Initial; the Retry's token carries that CID as the original DCID and is
    /// accepted when it comes back, and the Retry's SCID is another CID of the lane.
    #[test]
    fn always_retries_a_token_less_initial_to_our_cid() {
        let mut a = admission(RetryMode::Always, 0);
        let remote: SocketAddr = CLIENT.parse().unwrap();
        let ours = our_cid(&a, 1);
        let scid = [0x22; 8];
        for t in 1..=20 {
            let p = initial(&ours, &scid, &[]);
            assert_eq!(
                a.decide(&header(&p), remote, 1, false, false, t),
                Verdict::Retry
            );
        }
        let retry = a.retry_packet().to_vec();
        let (new_cid, token) = parse_retry(&retry, &scid);
        assert_ne!(
            new_cid, ours,
            "RFC 9000 §17.2.5.1: SCID differs from the DCID"
        );
        assert_eq!(a.router.owner(&new_cid), Some(1));
        assert_eq!(
            token_odcid(&a, &token),
            ours,
            "the original DCID is our CID"
        );
        // The integrity tag covers our CID as the original DCID (RFC 9001 §5.8).
        let mut aad = vec![ours.len() as u8];
        aad.extend_from_slice(&ours);
        aad.extend_from_slice(&retry[..retry.len() - TAG]);
        let tag = a
            .retry_key
            .seal_in_place_separate_tag(
                Nonce::assume_unique_for_key(RETRY_NONCE_V1),
                Aad::from(&aad[..]),
                &mut [],
            )
            .unwrap();
        assert_eq!(tag.as_ref(), &retry[retry.len() - TAG..]);
        // The client's next Initial, with the token: let in.
        let again = initial(&new_cid, &scid, &token);
        assert_eq!(
            a.decide(&header(&again), remote, 1, false, false, 21),
            Verdict::Forward
        );
        assert_eq!(a.stats.tokens_accepted, 1);
        // 0-RTT to our CID cannot open a connection at a worker: left alone.
        let mut zero_rtt = initial(&ours, &scid, &[]);
        zero_rtt[0] = 0xd3;
        assert_eq!(
            a.decide(&header(&zero_rtt), remote, 1, false, false, 22),
            Verdict::Forward
        );
    }

    /// A token the demux cannot open is no token (RFC 9000 §8.1.3), and quinn's workers treat
    /// it so: to our CID under `always` it gets a Retry, like none. A Retry token of ours from
    /// another address is still refused, and a good one still admits.
    #[test]
    fn a_garbage_token_to_our_cid_is_no_way_around_always() {
        let mut a = admission(RetryMode::Always, 0);
        let remote: SocketAddr = CLIENT.parse().unwrap();
        let ours = our_cid(&a, 0);
        let scid = [0x33; 8];
        let mut foreign = admission(RetryMode::Always, 0);
        foreign.token_prk = hkdf::Salt::new(hkdf::HKDF_SHA256, &[]).extract(&[1; 64]);
        let hashed = initial(&[0x11; 8], &scid, &[]);
        assert_eq!(
            foreign.decide(&header(&hashed), remote, 0, true, false, 1),
            Verdict::Retry
        );
        let (_, foreign_token) = parse_retry(foreign.retry_packet(), &scid);
        for (what, token) in [
            ("short garbage", vec![1, 2, 3]),
            ("garbage of a token's length", vec![0x5a; 60]),
            ("another key's token", foreign_token),
        ] {
            let p = initial(&ours, &scid, &token);
            assert_eq!(
                a.decide(&header(&p), remote, 0, false, false, 2),
                Verdict::Retry,
                "{what}"
            );
            let (_, t) = parse_retry(a.retry_packet(), &scid);
            assert_eq!(token_odcid(&a, &t), ours, "{what}");
        }
        assert_eq!(a.stats.tokens_accepted, 0);
        assert_eq!(
            a.stats.retries_sent, 0,
            "the data plane counts what it sends"
        );
        // Ours, for another address: refused, not retried.
        assert_eq!(
            a.decide(&header(&hashed), remote, 0, true, false, 3),
            Verdict::Retry
        );
        let (cid, token) = parse_retry(a.retry_packet(), &scid);
        let other: SocketAddr = "192.0.2.8:4433".parse().unwrap();
        let back = initial(&cid, &scid, &token);
        assert_eq!(
            a.decide(&header(&back), other, 0, false, false, 4),
            Verdict::TokenRefused
        );
        assert_eq!(
            a.decide(&header(&back), remote, 0, false, true, 5),
            Verdict::Forward
        );
    }

    /// Under `auto`, token-less Initials to our CIDs (a handshake's later Initials, or a
    /// harvested CID) are forwarded while there is no pressure, count towards it, and get a
    /// Retry under it.
    #[test]
    fn auto_counts_initials_to_our_cid_and_retries_them_under_pressure() {
        let mut a = admission(RetryMode::Auto, 0);
        let remote: SocketAddr = CLIENT.parse().unwrap();
        let ours = initial(&our_cid(&a, 1), &[0x44; 8], &[]);
        let garbage = initial(&our_cid(&a, 1), &[0x44; 8], &[0x5a; 40]);
        let new = initial(&[0x33; 8], &[0x44; 8], &[]);
        // 1000/s is 100 per 100 ms window: these 100 fill it.
        for i in 0..100 {
            let p = if i % 2 == 0 { &ours } else { &garbage };
            assert_eq!(
                a.decide(&header(p), remote, 1, false, false, 10),
                Verdict::Forward
            );
        }
        assert!(!a.under_pressure(10));
        // The 101st, a new connection's: pressure.
        assert_eq!(
            a.decide(&header(&new), remote, 0, true, false, 11),
            Verdict::Retry
        );
        assert_eq!(
            a.decide(&header(&ours), remote, 1, false, false, 12),
            Verdict::Retry
        );
        assert_eq!(
            a.decide(&header(&garbage), remote, 1, false, false, 13),
            Verdict::Retry
        );
        // After the hold, forwarded again; a crowded ring is pressure at once.
        let quiet = 13 + PRESSURE_HOLD_NS;
        assert_eq!(
            a.decide(&header(&ours), remote, 1, false, false, quiet),
            Verdict::Forward
        );
        assert_eq!(
            a.decide(&header(&ours), remote, 1, false, true, quiet + 1),
            Verdict::Retry
        );
        assert!(a.under_pressure(quiet + 2));
    }

    /// Under `never`, token-less Initials to our CIDs count towards pressure, are shed from a
    /// crowded ring and held to their prefix's budget under pressure, and never retried.
    #[test]
    fn never_holds_initials_to_our_cid_to_pressure_shedding_and_the_budget() {
        let mut a = admission(RetryMode::Never, 10);
        let ours = initial(&our_cid(&a, 0), &[0x44; 8], &[]);
        let greedy: SocketAddr = "203.0.113.9:1000".parse().unwrap();
        let other: SocketAddr = "198.51.100.1:1000".parse().unwrap();
        for _ in 0..100 {
            assert_eq!(
                a.decide(&header(&ours), greedy, 0, false, false, 1),
                Verdict::Forward
            );
        }
        assert!(!a.under_pressure(1));
        // The 101st in the window is pressure; the budget (10 a second, burst 10) applies.
        let mut passed = 0;
        for _ in 0..50 {
            match a.decide(&header(&ours), greedy, 0, false, false, 2) {
                Verdict::Forward => passed += 1,
                v => assert_eq!(v, Verdict::OverBudget),
            }
        }
        assert!(a.under_pressure(2));
        assert_eq!(passed, 10);
        assert_eq!(
            a.decide(&header(&ours), other, 0, false, false, 3),
            Verdict::Forward
        );
        assert_eq!(
            a.decide(&header(&ours), other, 0, false, true, 4),
            Verdict::Shed
        );
    }
}
