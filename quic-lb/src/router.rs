//! The demux side: which instance owns a datagram.
//!
//! This module owns the per-datagram decision: take the Destination Connection ID of the header
//! [`Header::parse`] read (the QUIC invariant header of RFC 8999, plus the QUIC v1 long-header
//! types of RFC 9000 §17.2), then decode that DCID or hash it. It never allocates, never panics
//! on any input, keeps no state between datagrams and never looks at addresses, so connection
//! migration and NAT rebinding need nothing special.
//!
//! GRO: a coalesced receive buffer is several datagrams. The caller splits it at the segment
//! size and calls [`Router::route`] once per segment; segments of one train may carry different
//! DCIDs (CID rotation) and so may go to different instances.

use siphasher::sip::SipHasher13;

use crate::codec::{CidCodec, MAX_CID_LEN, MAX_PLAINTEXT_LEN};
use crate::config::{ConfigError, QuicLbConfig, GENERATION_SLOTS, MAX_INSTANCES};
use crate::header::{Header, MalformedReason};
use crate::ConnectionId;

/// Where a datagram goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Route {
    /// The DCID decodes to this node and a configured instance: this *lane* (the instance's
    /// worker in one generation slot, `slot * instance_count + instance`, see [`Router::lane`])
    /// owns the connection.
    Owned(u8),
    /// The DCID is not ours to decode (client-chosen Initial/0-RTT DCID, another node's or
    /// another config's CID, unknown version, garbage): a keyed hash of the DCID picks the
    /// instance (not a lane: which generation gets new connections is the demux's choice), which
    /// answers with a handshake, version negotiation or a stateless reset.
    Hashed(u8),
    /// Too short to carry the header it claims, or a DCID longer than QUIC allows.
    Malformed(MalformedReason),
}

/// The demux's routing function for one node: a precomputed AES key schedule, the node ID, the
/// instance count and a SipHash-1-3 key. `route` is a pure function of the datagram's DCID.
#[derive(Clone)]
pub struct Router {
    codec: CidCodec,
    node_id: [u8; MAX_PLAINTEXT_LEN],
    node_id_len: usize,
    instance_count: u8,
    hasher: SipHasher13,
}

impl Route {
    /// Where the datagram goes, unless it is malformed: the lane of an `Owned` route, the
    /// instance of a `Hashed` one (the same number for the lanes of generation slot 0).
    pub fn instance(&self) -> Option<u8> {
        match *self {
            Route::Owned(i) | Route::Hashed(i) => Some(i),
            Route::Malformed(_) => None,
        }
    }
}

impl Router {
    /// Validates `config` and expands the AES key schedule; `hash_key` keys the SipHash used for
    /// DCIDs this node does not own (use [`crate::KeySet::routing_hash`]).
    pub fn new(config: &QuicLbConfig, hash_key: [u8; 16]) -> Result<Self, ConfigError> {
        config.validate()?;
        let codec = CidCodec::new(
            config.config_id,
            config.server_id_len(),
            usize::from(config.nonce_len),
            config.key,
        )?;
        let mut node_id = [0u8; MAX_PLAINTEXT_LEN];
        node_id[..config.node_id.len()].copy_from_slice(&config.node_id);
        Ok(Self {
            codec,
            node_id,
            node_id_len: config.node_id.len(),
            instance_count: config.instance_count,
            hasher: SipHasher13::new_with_key(&hash_key),
        })
    }

    /// Routes one datagram (one GRO segment). Never panics; every input gets a decision.
    ///
    /// The fixed bit (0x40) is ignored: quinn greases it and clients follow (RFC 9287).
    #[inline]
    pub fn route(&self, datagram: &[u8]) -> Route {
        match self.parse(datagram) {
            Ok(header) => self.route_dcid(header.dcid()),
            Err(reason) => Route::Malformed(reason),
        }
    }

    /// [`Header::parse`] with this router's CID length, for a caller that reads more of the
    /// header than its DCID (route it with [`RouteCache::route_header`] or
    /// [`Router::route_dcid`]).
    #[inline]
    pub fn parse<'a>(&self, datagram: &'a [u8]) -> Result<Header<'a>, MalformedReason> {
        Header::parse(datagram, self.codec.cid_len())
    }

    /// The decision for a DCID already cut out of a header: `Owned` (a lane) if it decodes to
    /// this node and an instance below `instance_count`, otherwise `Hashed` (an instance).
    #[inline]
    pub fn route_dcid(&self, dcid: &[u8]) -> Route {
        match self.owner(dcid) {
            Some(instance) => Route::Owned(instance),
            None => Route::Hashed(self.hash_instance(dcid)),
        }
    }

    /// The lane that issued `dcid` ([`Router::lane`] of its instance and generation slot), if
    /// it was issued on this node under this configuration by a configured instance.
    #[inline]
    pub fn owner(&self, dcid: &[u8]) -> Option<u8> {
        let sid = self.codec.decode_server_id(dcid)?;
        let (node, byte) = sid.split_at(self.node_id_len);
        let byte = *byte.first()?;
        let (instance, slot) = (byte & (MAX_INSTANCES - 1), byte >> 6);
        (node == &self.node_id[..self.node_id_len] && instance < self.instance_count)
            .then(|| self.lane(instance, slot))
    }

    /// The lane of `instance` in generation slot `slot`: `slot * instance_count + instance`, so
    /// the lanes of slot 0 are numbered like the instances and every lane is below
    /// [`Router::lanes`]. `instance` must be below `instance_count` and `slot` below
    /// [`GENERATION_SLOTS`].
    #[inline]
    pub fn lane(&self, instance: u8, slot: u8) -> u8 {
        // At most 3 * 64 + 63 = 255: no overflow.
        slot * self.instance_count + instance
    }

    /// A CID that routes to `lane` (as [`Router::owner`] decodes it), with `nonce` (the
    /// configuration's nonce length; in plaintext mode it is visible, so make it random). The
    /// demux's own Retry packets choose such a CID, so that the client's next Initial reaches a
    /// chosen worker. `None` if `lane` is not below [`Router::lanes`] or `nonce` has the wrong
    /// length.
    pub fn cid_for_lane(&self, lane: u8, nonce: &[u8]) -> Option<ConnectionId> {
        if usize::from(lane) >= self.lanes() {
            return None;
        }
        let (instance, slot) = (lane % self.instance_count, lane / self.instance_count);
        let mut sid = [0u8; MAX_PLAINTEXT_LEN];
        sid[..self.node_id_len].copy_from_slice(&self.node_id[..self.node_id_len]);
        sid[self.node_id_len] = crate::server_id_byte(instance, slot);
        self.codec.encode(&sid[..=self.node_id_len], nonce).ok()
    }

    /// Number of lanes: [`GENERATION_SLOTS`] × `instance_count` (at most 256).
    pub fn lanes(&self) -> usize {
        usize::from(GENERATION_SLOTS) * usize::from(self.instance_count)
    }

    /// `SipHash-1-3(routing key, dcid) mod instance_count`: the fallback for DCIDs nobody here
    /// owns. Pure, so every Initial of one handshake (multi-datagram ClientHello, retransmits,
    /// 0-RTT) meets the same instance (draft-21 §4.2 "Fallback Algorithms").
    #[inline]
    pub fn hash_instance(&self, dcid: &[u8]) -> u8 {
        // The modulo bias is below 255 / 2^64: negligible.
        (self.hasher.hash(dcid) % u64::from(self.instance_count)) as u8
    }

    /// Number of instances routed to.
    pub fn instance_count(&self) -> u8 {
        self.instance_count
    }

    /// The fixed short-header DCID length (= every CID the workers issue).
    pub fn cid_len(&self) -> usize {
        self.codec.cid_len()
    }

    /// The codec the router decodes with.
    pub fn codec(&self) -> &CidCodec {
        &self.codec
    }
}

impl std::fmt::Debug for Router {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Router")
            .field("codec", &self.codec)
            .field("node_id", &hex::encode(&self.node_id[..self.node_id_len]))
            .field("instance_count", &self.instance_count)
            .finish_non_exhaustive()
    }
}

/// The route of the last short-header DCID seen. Under load consecutive datagrams mostly belong
/// to one connection (always within a GRO train), so an exact DCID match saves the AES decode.
/// Only short headers are cached: their DCID is at a fixed place and routing depends on it alone.
/// Keep one per receive batch, so that nothing outlives a change of the routing (a pure function
/// of the DCID anyway).
pub struct RouteCache {
    cid_len: usize,
    dcid: [u8; MAX_CID_LEN],
    route: Option<Route>,
}

impl RouteCache {
    /// An empty cache for `router`'s connection-ID length.
    pub fn new(router: &Router) -> Self {
        RouteCache {
            cid_len: router.cid_len().min(MAX_CID_LEN),
            dcid: [0; MAX_CID_LEN],
            route: None,
        }
    }

    /// What `router.route(seg)` answers, without the AES decode when `seg` is a short header
    /// with the same DCID as the last one cached.
    #[inline]
    pub fn route(&mut self, router: &Router, seg: &[u8]) -> Route {
        match router.parse(seg) {
            Ok(header) => self.route_header(router, &header),
            Err(reason) => Route::Malformed(reason),
        }
    }

    /// The route of a header `router` parsed ([`Router::parse`]): `Owned` or `Hashed`, as
    /// [`Router::route_dcid`] answers for its DCID, without the AES decode when it is a short
    /// header with the same DCID as the last one cached.
    #[inline]
    pub fn route_header(&mut self, router: &Router, header: &Header<'_>) -> Route {
        let n = self.cid_len;
        let dcid = match *header {
            Header::Short { dcid } if dcid.len() == n => dcid,
            _ => return router.route_dcid(header.dcid()),
        };
        if let Some(r) = self.route {
            if same_bytes(dcid, &self.dcid[..n]) {
                return r;
            }
        }
        let r = router.route_dcid(dcid);
        self.dcid[..n].copy_from_slice(dcid);
        self.route = Some(r);
        r
    }
}

/// Equality of two short slices of one length, compared 8 bytes at a time inline. A slice `==`
/// calls libc's `memcmp`, which the profile showed at a quarter of the data plane's time.
#[inline(always)]
fn same_bytes(a: &[u8], b: &[u8]) -> bool {
    debug_assert_eq!(a.len(), b.len());
    let (mut ca, mut cb) = (a.chunks_exact(8), b.chunks_exact(8));
    for (x, y) in (&mut ca).zip(&mut cb) {
        let x = u64::from_ne_bytes(x.try_into().expect("8 bytes"));
        let y = u64::from_ne_bytes(y.try_into().expect("8 bytes"));
        if x != y {
            return false;
        }
    }
    ca.remainder()
        .iter()
        .zip(cb.remainder())
        .all(|(x, y)| x == y)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::header::QUIC_V2;
    use crate::CidGenerator;
    use quinn_proto::ConnectionIdGenerator;

    fn config(count: u8) -> QuicLbConfig {
        let mut c = QuicLbConfig::default_with_key([0x42; 16]);
        c.instance_count = count;
        c
    }

    fn short(cid: &[u8]) -> Vec<u8> {
        let mut d = vec![0x41];
        d.extend_from_slice(cid);
        d.extend_from_slice(&[0xaa; 30]);
        d
    }

    /// A v1 Initial: first, version, dcid, scid, token len 0, Length, payload.
    fn initial(dcid: &[u8], payload: usize) -> Vec<u8> {
        let mut d = vec![0xc3, 0, 0, 0, 1, dcid.len() as u8];
        d.extend_from_slice(dcid);
        d.extend_from_slice(&[8, 1, 2, 3, 4, 5, 6, 7, 8]);
        d.push(0); // token length
        d.extend_from_slice(&[0x40 | (payload >> 8) as u8, payload as u8]);
        d.extend(std::iter::repeat_n(0x5a, payload));
        d
    }

    /// What the dispatcher asks of a datagram: a long header that opens a connection.
    fn starts_connection(datagram: &[u8]) -> bool {
        Header::parse(datagram, 17)
            .ok()
            .and_then(|h| h.long().map(|l| l.starts_connection()))
            .unwrap_or(false)
    }

    #[test]
    fn initial_and_zero_rtt_packets_start_connections() {
        let mut p = initial(&[7; 8], 20);
        assert!(starts_connection(&p));
        p[0] = 0xd3; // v1 0-RTT
        assert!(starts_connection(&p));
        p[0] = 0xe3; // v1 Handshake
        assert!(!starts_connection(&p));
        p[0] = 0xf3; // v1 Retry
        assert!(!starts_connection(&p));
        p[1..5].copy_from_slice(&QUIC_V2.to_be_bytes());
        for (first, starts) in [(0xc3, false), (0xd3, true), (0xe3, true), (0xf3, false)] {
            p[0] = first; // v2: Retry, Initial, 0-RTT, Handshake
            assert_eq!(starts_connection(&p), starts, "v2 first byte {first:#x}");
        }
        p[1..5].copy_from_slice(&0u32.to_be_bytes()); // version negotiation
        p[0] = 0xc3;
        assert!(!starts_connection(&p));
        assert!(!starts_connection(&short(&[1; 17])));
        assert!(!starts_connection(&[0xc3, 0, 0]));
        assert!(!starts_connection(&[]));
    }

    #[test]
    fn own_cids_are_owned_in_short_and_long_headers() {
        let cfg = config(4);
        let router = Router::new(&cfg, [1; 16]).unwrap();
        for i in 0..4 {
            let mut g = CidGenerator::new(&cfg, i, None).unwrap();
            let cid = g.generate_cid();
            assert_eq!(router.route(&short(&cid)), Route::Owned(i));
            let mut greased = short(&cid);
            greased[0] &= !0x40;
            assert_eq!(router.route(&greased), Route::Owned(i), "fixed bit clear");
            assert_eq!(router.route(&initial(&cid, 100)), Route::Owned(i));
        }
    }

    #[test]
    fn cid_for_lane_routes_to_that_lane() {
        let cfg = config(3);
        let router = Router::new(&cfg, [1; 16]).unwrap();
        let nonce = vec![0x5a; usize::from(cfg.nonce_len)];
        for lane in 0..router.lanes() as u8 {
            let cid = router.cid_for_lane(lane, &nonce).expect("a CID");
            assert_eq!(cid.len(), router.cid_len());
            assert_eq!(
                router.route(&short(&cid)),
                Route::Owned(lane),
                "lane {lane}"
            );
        }
        assert!(router.cid_for_lane(router.lanes() as u8, &nonce).is_none());
        assert!(router.cid_for_lane(0, &nonce[1..]).is_none(), "short nonce");
    }

    #[test]
    fn instance_beyond_count_is_hashed() {
        let router = Router::new(&config(2), [1; 16]).unwrap();
        let mut g = CidGenerator::new(&config(4), 3, None).unwrap();
        let cid = g.generate_cid();
        assert!(matches!(router.route(&short(&cid)), Route::Hashed(i) if i < 2));
    }

    #[test]
    fn client_initial_is_hashed_consistently() {
        let router = Router::new(&config(7), [1; 16]).unwrap();
        let dcid = [0x11u8; 18];
        let a = router.route(&initial(&dcid, 1200));
        let b = router.route(&initial(&dcid, 600));
        assert!(matches!(a, Route::Hashed(_)));
        assert_eq!(a, b);
        // 0-RTT with the same DCID meets the same instance.
        let mut zero_rtt = initial(&dcid, 0);
        zero_rtt[0] = 0xd0;
        let n = zero_rtt.len();
        zero_rtt.truncate(n - 3); // drop token length and 2-byte Length
        zero_rtt.push(0x05);
        zero_rtt.extend_from_slice(&[0; 5]);
        assert_eq!(router.route(&zero_rtt), a);
    }

    #[test]
    fn malformed_reasons() {
        let router = Router::new(&config(2), [1; 16]).unwrap();
        let m = Route::Malformed;
        assert_eq!(router.route(&[]), m(MalformedReason::Empty));
        assert_eq!(
            router.route(&[0x40; 17]),
            m(MalformedReason::ShortHeaderTruncated)
        );
        assert!(router.route(&[0x40; 18]).instance().is_some());
        assert_eq!(
            router.route(&[0xc0, 0, 0]),
            m(MalformedReason::LongHeaderTruncated)
        );
        assert_eq!(
            router.route(&[0xc0, 0, 0, 0, 1, 21, 0, 0]),
            m(MalformedReason::DcidTooLong)
        );
        assert_eq!(
            router.route(&[0xc0, 0, 0, 0, 1, 8, 0, 0]),
            m(MalformedReason::LongHeaderTruncated)
        );
        // Missing SCID length.
        assert_eq!(
            router.route(&[0xc0, 0xff, 0, 0, 2, 1, 9]),
            m(MalformedReason::LongHeaderTruncated)
        );
        // Unknown version: invariants only, so the rest may be anything.
        assert!(matches!(
            router.route(&[0xc0, 0xff, 0, 0, 2, 1, 9, 0]),
            Route::Hashed(_)
        ));
        // Version negotiation (version 0) parses by invariants.
        assert!(matches!(
            router.route(&[0x80, 0, 0, 0, 0, 1, 9, 0, 0, 0, 0, 1]),
            Route::Hashed(_)
        ));
        // v1 Initial whose Length points past the end.
        let mut d = initial(&[1; 8], 100);
        d.truncate(d.len() - 1);
        assert_eq!(router.route(&d), m(MalformedReason::LongHeaderTruncated));
        // v1 Initial cut inside the token length / token.
        let mut d = vec![0xc0, 0, 0, 0, 1, 0, 0, 0x44];
        assert_eq!(router.route(&d), m(MalformedReason::LongHeaderTruncated));
        d.truncate(7);
        assert_eq!(router.route(&d), m(MalformedReason::LongHeaderTruncated));
        // v1 Retry has no Length.
        assert!(matches!(
            router.route(&[0xf0, 0, 0, 0, 1, 0, 0]),
            Route::Hashed(_)
        ));
    }

    #[test]
    fn other_config_other_node_and_unroutable_are_hashed() {
        let cfg = config(3);
        let router = Router::new(&cfg, [1; 16]).unwrap();
        let mut other = cfg.clone();
        other.node_id = vec![1];
        let cid = CidGenerator::new(&other, 0, None).unwrap().generate_cid();
        assert!(matches!(router.route(&short(&cid)), Route::Hashed(_)));
        let mut other = cfg.clone();
        other.config_id = 1;
        let cid = CidGenerator::new(&other, 0, None).unwrap().generate_cid();
        assert!(matches!(router.route(&short(&cid)), Route::Hashed(_)));
        let mut own = CidGenerator::new(&cfg, 0, None)
            .unwrap()
            .generate_cid()
            .to_vec();
        own[0] |= 0xe0;
        assert!(matches!(router.route(&short(&own)), Route::Hashed(_)));
    }

    #[test]
    fn labels() {
        let labels: Vec<_> = MalformedReason::ALL.iter().map(|r| r.as_str()).collect();
        assert_eq!(
            labels,
            [
                "empty",
                "short_header_truncated",
                "long_header_truncated",
                "dcid_too_long",
                "scid_too_long"
            ]
        );
        assert_eq!(Route::Malformed(MalformedReason::Empty).instance(), None);
        assert_eq!(Route::Hashed(3).instance(), Some(3));
    }

    /// Every generation slot of every instance has its own lane, in both CID modes; a CID of
    /// an instance beyond the count is no lane's, whatever its slot bits.
    #[test]
    fn each_generation_slot_routes_to_its_own_lane() {
        for key in [Some([7; 16]), None] {
            let mut cfg = QuicLbConfig::default_with_key([7; 16]);
            cfg.key = key;
            cfg.instance_count = 3;
            let router = Router::new(&cfg, [9; 16]).unwrap();
            assert_eq!(router.lanes(), 12);
            let mut seen = std::collections::HashSet::new();
            for slot in 0..GENERATION_SLOTS {
                for i in 0..3 {
                    let mut g = CidGenerator::in_slot(&cfg, i, slot, None).unwrap();
                    let cid = g.generate_cid();
                    let lane = router.owner(&cid).expect("owned");
                    assert_eq!(lane, slot * 3 + i);
                    assert_eq!(lane, router.lane(i, slot));
                    assert!(seen.insert(lane));
                }
            }
            // Instance 3 does not exist: hashed, in every slot.
            let mut wide = cfg.clone();
            wide.instance_count = 4;
            for slot in 0..GENERATION_SLOTS {
                let cid = CidGenerator::in_slot(&wide, 3, slot, None)
                    .unwrap()
                    .generate_cid();
                assert_eq!(router.owner(&cid), None, "slot {slot}");
            }
        }
    }

    /// The cache must answer exactly what the router answers, whatever the sequence.
    #[test]
    fn route_cache_agrees_with_the_router() {
        let mut cfg = QuicLbConfig::default_with_key([7; 16]);
        cfg.instance_count = 4;
        let router = Router::new(&cfg, [9; 16]).unwrap();
        let mut gens: Vec<CidGenerator> = (0..4)
            .map(|i| CidGenerator::new(&cfg, i, None).unwrap())
            .collect();
        let mut x = 0x1234_5678u64;
        let mut rnd = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let mut datagrams: Vec<Vec<u8>> = Vec::new();
        for i in 0..2000 {
            let r = rnd();
            let d = match r % 5 {
                0 | 1 => {
                    // short header with an owned CID, repeated a few times
                    let cid = gens[(r as usize / 7) % 4].generate_cid();
                    let mut d = vec![0x40 | (r as u8 & 0x3f)];
                    d.extend_from_slice(&cid);
                    d.resize(20 + (r as usize % 50), 1);
                    d
                }
                2 => (0..(r % 40) as usize).map(|_| rnd() as u8).collect(), // garbage, runts
                3 => datagrams.last().cloned().unwrap_or_default(),         // repeat
                _ => {
                    // long header with a random DCID
                    let mut d = vec![0xc0, 0, 0, 0, 1, 8];
                    d.extend((0..8).map(|_| rnd() as u8));
                    d.extend_from_slice(&[0, 0, 1, 0]);
                    d.resize(1200, 0);
                    d
                }
            };
            datagrams.push(d);
            if i % 100 == 0 {
                datagrams.push(vec![0x40]); // truncated short header
            }
        }
        assert!(same_bytes(b"0123456789abcdefXYZ", b"0123456789abcdefXYZ"));
        assert!(!same_bytes(b"0123456789abcdefXYZ", b"0123456789abcdefXYz"));
        assert!(!same_bytes(b"1123456789abcdefXYZ", b"0123456789abcdefXYZ"));
        let mut cache = RouteCache::new(&router);
        for d in &datagrams {
            assert_eq!(cache.route(&router, d), router.route(d), "{d:02x?}");
        }
    }
}
