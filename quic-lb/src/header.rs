//! Reading a QUIC packet header out of bytes from the network: the one parser of the workspace.
//!
//! - [`Reader`] is a bounds-checked cursor with the variable-length integer of RFC 9000 §16.
//!   Every read answers `None` when the bytes run out, and leaves the cursor where it was.
//! - [`Header::parse`] reads a datagram's first packet once: the short header's Destination
//!   Connection ID, or the long header's version, CIDs and (QUIC v1) type-specific fields, as a
//!   [`LongHeader`] view. The router decides on its DCID ([`crate::RouteCache::route_header`]);
//!   the demux's admission and ClientHello inspector read the same view instead of parsing
//!   again.
//!
//! Every byte here is untrusted: nothing indexes past what arrived, allocates or panics, and
//! every length read is checked against the bytes left before it is used.

use crate::codec::MAX_CID_LEN;

/// The QUIC v1 version number (RFC 9000 §15).
pub const QUIC_V1: u32 = 1;
/// The QUIC v2 version number (RFC 9369 §3.1).
pub const QUIC_V2: u32 = 0x6b33_43cf;
/// Header form bit: 1 = long header (RFC 8999 §5.1).
const LONG_HEADER: u8 = 0x80;
/// The type bits (`first >> 4 & 3`) of a v1 Initial and Retry (RFC 9000 §17.2).
const V1_INITIAL: u8 = 0;
const V1_RETRY: u8 = 3;

/// Why a datagram has no header to route by.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MalformedReason {
    /// Zero-length datagram.
    Empty,
    /// Short header shorter than 1 + the configured CID length.
    ShortHeaderTruncated,
    /// Long header cut inside the version, CID lengths, CIDs, or (QUIC v1) the token or Length
    /// field, or a v1 Length larger than the datagram.
    LongHeaderTruncated,
    /// Long-header DCID length above 20 (RFC 9000 §17.2; quinn cannot parse those either).
    DcidTooLong,
    /// QUIC v1 or v2 long-header SCID length above 20: "Endpoints that receive a version 1
    /// long header with a value larger than 20 MUST drop the packet" (RFC 9000 §17.2; v2
    /// keeps the rule, RFC 9369). Other versions may use up to 255 (RFC 8999).
    ScidTooLong,
}

impl MalformedReason {
    /// A snake_case label for metrics.
    pub fn as_str(&self) -> &'static str {
        match self {
            MalformedReason::Empty => "empty",
            MalformedReason::ShortHeaderTruncated => "short_header_truncated",
            MalformedReason::LongHeaderTruncated => "long_header_truncated",
            MalformedReason::DcidTooLong => "dcid_too_long",
            MalformedReason::ScidTooLong => "scid_too_long",
        }
    }

    /// Every reason, for registering metric labels up front.
    pub const ALL: [MalformedReason; 5] = [
        MalformedReason::Empty,
        MalformedReason::ShortHeaderTruncated,
        MalformedReason::LongHeaderTruncated,
        MalformedReason::DcidTooLong,
        MalformedReason::ScidTooLong,
    ];
}

impl std::fmt::Display for MalformedReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A cursor over untrusted bytes. A read that does not fit answers `None` and consumes
/// nothing.
#[derive(Clone, Copy, Debug)]
pub struct Reader<'a> {
    rest: &'a [u8],
    /// The length of the bytes it started with.
    len: usize,
}

impl<'a> Reader<'a> {
    /// A cursor at the start of `bytes`.
    #[inline]
    pub fn new(bytes: &'a [u8]) -> Self {
        Reader {
            rest: bytes,
            len: bytes.len(),
        }
    }

    /// What is left to read.
    #[inline]
    pub fn rest(&self) -> &'a [u8] {
        self.rest
    }

    /// Whether nothing is left.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.rest.is_empty()
    }

    /// Octets read so far: the offset of [`Reader::rest`] in the bytes it started with.
    #[inline]
    pub fn offset(&self) -> usize {
        // `rest` is a suffix of those bytes: never longer.
        self.len.saturating_sub(self.rest.len())
    }

    /// The next `n` octets.
    #[inline]
    pub fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let (head, rest) = self.rest.split_at_checked(n)?;
        self.rest = rest;
        Some(head)
    }

    /// The next `N` octets as an array.
    #[inline]
    pub fn array<const N: usize>(&mut self) -> Option<[u8; N]> {
        let (head, rest) = self.rest.split_first_chunk::<N>()?;
        self.rest = rest;
        Some(*head)
    }

    /// One octet.
    #[inline]
    pub fn u8(&mut self) -> Option<u8> {
        let (&b, rest) = self.rest.split_first()?;
        self.rest = rest;
        Some(b)
    }

    /// A big-endian 16-bit integer (TLS lengths and types, RFC 8446 §3).
    #[inline]
    pub fn u16(&mut self) -> Option<u16> {
        self.array().map(u16::from_be_bytes)
    }

    /// A big-endian 32-bit integer (a QUIC version).
    #[inline]
    pub fn u32(&mut self) -> Option<u32> {
        self.array().map(u32::from_be_bytes)
    }

    /// A big-endian 64-bit integer.
    #[inline]
    pub fn u64(&mut self) -> Option<u64> {
        self.array().map(u64::from_be_bytes)
    }

    /// A variable-length integer (RFC 9000 §16): the two high bits of the first octet give its
    /// length, 1, 2, 4 or 8 octets.
    #[inline]
    pub fn varint(&mut self) -> Option<u64> {
        let &first = self.rest.first()?;
        let bytes = self.take(1 << (first >> 6))?;
        Some(
            bytes
                .iter()
                .skip(1)
                .fold(u64::from(first & 0x3f), |v, &b| (v << 8) | u64::from(b)),
        )
    }
}

/// The header of a datagram's first packet, read once ([`Header::parse`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Header<'a> {
    /// A short header (RFC 9000 §17.3): its Destination Connection ID, whose length is not on
    /// the wire (the server's fixed CID length).
    Short {
        /// The Destination Connection ID.
        dcid: &'a [u8],
    },
    /// A long header (RFC 8999 §5.1; RFC 9000 §17.2 for version 1).
    Long(LongHeader<'a>),
}

/// A long header: the version-independent fields (RFC 8999 §5.1) of any version, and for QUIC
/// v1 the type-specific ones (RFC 9000 §17.2), checked as quinn checks them before it would
/// process the packet: the Initial's token and Length, 0-RTT's and Handshake's Length, and
/// the Length within the datagram.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LongHeader<'a> {
    bytes: &'a [u8],
    first: u8,
    version: u32,
    dcid: &'a [u8],
    scid: &'a [u8],
    token: &'a [u8],
    /// QUIC v1 Initial, 0-RTT and Handshake: where the packet number starts, and where the
    /// packet ends (the Length counts from the packet number).
    payload: Option<(usize, usize)>,
}

/// The type of a long-header packet, of a version whose type bits are known (v1 and v2 number
/// them differently: RFC 9000 §17.2, RFC 9369 §3.2).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PacketType {
    /// Initial: a client opens a connection with it.
    Initial,
    /// 0-RTT: a client's early data.
    ZeroRtt,
    /// Handshake.
    Handshake,
    /// Retry: a server's answer to an Initial.
    Retry,
}

impl<'a> Header<'a> {
    /// Reads the header of `datagram`'s first packet; `short_header_cid_len` is the server's
    /// fixed CID length, the DCID length of a short header.
    ///
    /// - Short header (first bit 0): `datagram[1..1 + short_header_cid_len]`.
    /// - Long header: `first(1) version(4) dcid_len(1) dcid scid_len(1) scid` (RFC 8999 §5.1),
    ///   with `dcid_len ≤ 20`, and `scid_len ≤ 20` for QUIC v1 and v2. Any version is accepted,
    ///   including 0 (version negotiation); for QUIC v1 the type-specific fields must fit too
    ///   ([`LongHeader`]).
    ///
    /// The fixed bit (0x40) is not looked at: quinn greases it and clients follow (RFC 9287).
    #[inline]
    pub fn parse(datagram: &'a [u8], short_header_cid_len: usize) -> Result<Self, MalformedReason> {
        let Some(&first) = datagram.first() else {
            return Err(MalformedReason::Empty);
        };
        if first & LONG_HEADER == 0 {
            return datagram
                .get(1..short_header_cid_len.saturating_add(1))
                .map(|dcid| Header::Short { dcid })
                .ok_or(MalformedReason::ShortHeaderTruncated);
        }
        LongHeader::read(datagram).map(Header::Long)
    }

    /// The Destination Connection ID.
    #[inline]
    pub fn dcid(&self) -> &'a [u8] {
        match self {
            Header::Short { dcid } => dcid,
            Header::Long(long) => long.dcid,
        }
    }

    /// The long header, if it is one.
    #[inline]
    pub fn long(&self) -> Option<&LongHeader<'a>> {
        match self {
            Header::Short { .. } => None,
            Header::Long(long) => Some(long),
        }
    }
}

impl<'a> LongHeader<'a> {
    /// The long header at the start of `packet`; `None` for a short header or anything
    /// [`Header::parse`] calls malformed. For the packets coalesced after the first
    /// (RFC 9000 §12.2).
    #[inline]
    pub fn parse(packet: &'a [u8]) -> Option<Self> {
        match packet.first() {
            Some(&first) if first & LONG_HEADER != 0 => LongHeader::read(packet).ok(),
            _ => None,
        }
    }

    /// Reads a long header; `packet[0]` has the long-header bit set.
    #[inline]
    fn read(packet: &'a [u8]) -> Result<Self, MalformedReason> {
        use MalformedReason::LongHeaderTruncated as Truncated;
        // first(1) version(4) dcid_len(1): one bounds check for the fixed part.
        let Some(&[first, v0, v1, v2, v3, dcid_len]) = packet.get(..6) else {
            return Err(Truncated);
        };
        let version = u32::from_be_bytes([v0, v1, v2, v3]);
        let dcid_len = usize::from(dcid_len);
        if dcid_len > MAX_CID_LEN {
            return Err(MalformedReason::DcidTooLong);
        }
        let mut r = Reader::new(packet);
        r.take(6);
        let dcid = r.take(dcid_len).ok_or(Truncated)?;
        let scid_len = usize::from(r.u8().ok_or(Truncated)?);
        if scid_len > MAX_CID_LEN && matches!(version, QUIC_V1 | QUIC_V2) {
            return Err(MalformedReason::ScidTooLong);
        }
        let scid = r.take(scid_len).ok_or(Truncated)?;
        let mut header = LongHeader {
            bytes: packet,
            first,
            version,
            dcid,
            scid,
            token: &[],
            payload: None,
        };
        if version == QUIC_V1 {
            // RFC 9000 §17.2: Initial has a token before its Length; 0-RTT and Handshake a
            // Length only; Retry a token and an integrity tag, no Length. A Length past the
            // end of the datagram is refused as quinn refuses it ("packet too short to
            // contain payload length").
            let bits = (first >> 4) & 0x3;
            if bits == V1_INITIAL {
                let token_len = r.varint().ok_or(Truncated)?;
                let token_len = usize::try_from(token_len).map_err(|_| Truncated)?;
                header.token = r.take(token_len).ok_or(Truncated)?;
            }
            if bits != V1_RETRY {
                let length = r.varint().ok_or(Truncated)?;
                let pn_at = r.offset();
                // `rest` is what follows the Length: the packet may not run past it.
                if length > r.rest().len() as u64 {
                    return Err(Truncated);
                }
                header.payload = Some((pn_at, pn_at + length as usize));
            }
        }
        Ok(header)
    }

    /// The QUIC version (0: version negotiation).
    #[inline]
    pub fn version(&self) -> u32 {
        self.version
    }

    /// The first octet as it arrived (header protection still on for v1's low bits).
    #[inline]
    pub fn first(&self) -> u8 {
        self.first
    }

    /// The Destination Connection ID (at most 20 octets).
    #[inline]
    pub fn dcid(&self) -> &'a [u8] {
        self.dcid
    }

    /// The Source Connection ID (at most 255 octets: RFC 8999 allows other versions that many).
    #[inline]
    pub fn scid(&self) -> &'a [u8] {
        self.scid
    }

    /// A QUIC v1 Initial's token; empty for every other packet.
    #[inline]
    pub fn token(&self) -> &'a [u8] {
        self.token
    }

    /// The bytes the header was read from: its packet, and any coalesced after it.
    #[inline]
    pub fn bytes(&self) -> &'a [u8] {
        self.bytes
    }

    /// Where the (protected) packet number starts in [`LongHeader::bytes`]: QUIC v1 Initial,
    /// 0-RTT and Handshake packets only.
    #[inline]
    pub fn packet_number_at(&self) -> Option<usize> {
        self.payload.map(|(pn_at, _)| pn_at)
    }

    /// Where the packet ends in [`LongHeader::bytes`] (no further than its end), so where a
    /// coalesced one begins: QUIC v1 Initial, 0-RTT and Handshake packets only.
    #[inline]
    pub fn packet_end(&self) -> Option<usize> {
        self.payload.map(|(_, end)| end)
    }

    /// The packet's type, for QUIC v1 and v2; `None` for other versions.
    #[inline]
    pub fn packet_type(&self) -> Option<PacketType> {
        use PacketType::*;
        let bits = (self.first >> 4) & 0x3;
        match (self.version, bits) {
            (QUIC_V1, V1_INITIAL) | (QUIC_V2, 1) => Some(Initial),
            (QUIC_V1, 1) | (QUIC_V2, 2) => Some(ZeroRtt),
            (QUIC_V1, 2) | (QUIC_V2, 3) => Some(Handshake),
            (QUIC_V1 | QUIC_V2, _) => Some(Retry),
            _ => None,
        }
    }

    /// Whether this is a packet a client opens a connection with: an Initial or a 0-RTT packet
    /// of QUIC v1 or v2. Handshake and Retry packets, other versions and version negotiation
    /// are not.
    #[inline]
    pub fn starts_connection(&self) -> bool {
        matches!(
            self.packet_type(),
            Some(PacketType::Initial | PacketType::ZeroRtt)
        )
    }

    /// Whether this is a QUIC v1 Initial (its CIDs are within v1's 20 octets: [`Header::parse`]
    /// refuses any other): the packet whose token admission checks and whose ClientHello the
    /// demux reads.
    #[inline]
    pub fn is_v1_initial(&self) -> bool {
        self.version == QUIC_V1 && self.packet_type() == Some(PacketType::Initial)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A v1 long header: `first`, version 1, DCID, an 8-octet SCID, then `fields`.
    fn long(first: u8, dcid: &[u8], fields: &[u8]) -> Vec<u8> {
        let mut d = vec![first, 0, 0, 0, 1, dcid.len() as u8];
        d.extend_from_slice(dcid);
        d.extend_from_slice(&[8, 1, 2, 3, 4, 5, 6, 7, 8]);
        d.extend_from_slice(fields);
        d
    }

    #[test]
    fn varints_of_each_length_and_cut_short() {
        for (bytes, v) in [
            (&[0x25][..], 37u64),
            (&[0x7b, 0xbd], 15293),
            (&[0x9d, 0x7f, 0x3e, 0x7d], 494878333),
            (
                &[0xc2, 0x19, 0x7c, 0x5e, 0xff, 0x14, 0xe8, 0x8c],
                151288809941952652,
            ),
        ] {
            let mut r = Reader::new(bytes);
            assert_eq!(r.varint(), Some(v));
            assert!(r.is_empty());
            assert_eq!(r.offset(), bytes.len());
            let cut = &bytes[..bytes.len() - 1];
            let mut r = Reader::new(cut);
            assert_eq!(r.varint(), None);
            assert_eq!(r.offset(), 0, "a failed read consumes nothing");
        }
    }

    #[test]
    fn reader_reads_fixed_widths_and_refuses_past_the_end() {
        let mut r = Reader::new(&[1, 0, 2, 0, 0, 0, 3, 9]);
        assert_eq!(r.u8(), Some(1));
        assert_eq!(r.u16(), Some(2));
        assert_eq!(r.u32(), Some(3));
        assert_eq!(r.u16(), None);
        assert_eq!(r.rest(), &[9]);
        assert_eq!(r.take(usize::MAX), None);
        assert_eq!(r.u64(), None);
        assert_eq!(r.take(1), Some(&[9][..]));
        assert_eq!(r.u8(), None);
    }

    #[test]
    fn a_v1_initial_is_read_to_its_packet_number_and_end() {
        // Token "tok", Length 5 (packet number and payload), then a coalesced octet.
        let mut d = long(0xc3, &[0xaa; 8], &[3, b't', b'o', b'k', 5]);
        let pn_at = d.len();
        d.extend_from_slice(&[0; 5]);
        d.push(0x40);
        let Ok(Header::Long(h)) = Header::parse(&d, 17) else {
            panic!("a long header");
        };
        assert_eq!(h.version(), QUIC_V1);
        assert_eq!(h.dcid(), &[0xaa; 8]);
        assert_eq!(h.scid(), &[1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(h.token(), b"tok");
        assert_eq!(h.packet_type(), Some(PacketType::Initial));
        assert!(h.starts_connection() && h.is_v1_initial());
        assert_eq!(h.packet_number_at(), Some(pn_at));
        assert_eq!(h.packet_end(), Some(pn_at + 5));
        assert_eq!(h.bytes(), &d[..]);
        assert_eq!(LongHeader::parse(&d), Some(h));
        // The Length one past the end.
        let mut cut = d.clone();
        cut.truncate(pn_at + 4);
        assert_eq!(
            Header::parse(&cut, 17),
            Err(MalformedReason::LongHeaderTruncated)
        );
        assert_eq!(LongHeader::parse(&cut), None);
    }

    #[test]
    fn types_of_v1_and_v2_and_which_start_a_connection() {
        let mut d = long(0xc0, &[7; 8], &[0, 1, 0]);
        let types = [
            (0xc0, QUIC_V1, PacketType::Initial, true),
            (0xd0, QUIC_V1, PacketType::ZeroRtt, true),
            (0xe0, QUIC_V1, PacketType::Handshake, false),
            (0xf0, QUIC_V1, PacketType::Retry, false),
            (0xc0, QUIC_V2, PacketType::Retry, false),
            (0xd0, QUIC_V2, PacketType::Initial, true),
            (0xe0, QUIC_V2, PacketType::ZeroRtt, true),
            (0xf0, QUIC_V2, PacketType::Handshake, false),
        ];
        for (first, version, kind, starts) in types {
            d[0] = first;
            d[1..5].copy_from_slice(&version.to_be_bytes());
            let h = LongHeader::parse(&d).expect("parses");
            assert_eq!(h.packet_type(), Some(kind), "{first:#x} v{version:#x}");
            assert_eq!(h.starts_connection(), starts, "{first:#x} v{version:#x}");
            assert_eq!(h.is_v1_initial(), version == QUIC_V1 && first == 0xc0);
        }
        d[1..5].copy_from_slice(&0u32.to_be_bytes()); // version negotiation
        let h = LongHeader::parse(&d).expect("invariants only");
        assert_eq!(h.packet_type(), None);
        assert!(!h.starts_connection());
        assert_eq!(h.packet_end(), None);
    }

    /// A v1 or v2 long header with an SCID over 20 octets is dropped (RFC 9000 §17.2); another
    /// version may carry one (RFC 8999), and one of 20 octets is fine.
    #[test]
    fn a_long_scid_is_malformed_in_v1_and_v2_only() {
        let packet = |version: u32, scid_len: u8| {
            let mut d = vec![0xc0];
            d.extend_from_slice(&version.to_be_bytes());
            d.push(8);
            d.extend_from_slice(&[1; 8]);
            d.push(scid_len);
            d.extend(std::iter::repeat_n(2, usize::from(scid_len)));
            d.extend_from_slice(&[0, 1, 0]);
            d
        };
        for version in [QUIC_V1, QUIC_V2] {
            let d = packet(version, 21);
            assert_eq!(
                Header::parse(&d, 8).err(),
                Some(MalformedReason::ScidTooLong)
            );
            assert!(LongHeader::parse(&d).is_none());
            let d = packet(version, 20);
            let h = LongHeader::parse(&d).expect("20 octets");
            assert_eq!(h.scid().len(), 20);
        }
        let d = packet(0x1a2a_3a4a, 255);
        let h = LongHeader::parse(&d).expect("the invariants allow it");
        assert_eq!((h.scid().len(), h.packet_type()), (255, None));
    }

    #[test]
    fn short_headers_and_malformed_datagrams() {
        let d = [0x41, 1, 2, 3, 4, 5];
        assert_eq!(
            Header::parse(&d, 4),
            Ok(Header::Short {
                dcid: &[1, 2, 3, 4]
            })
        );
        assert_eq!(Header::parse(&d, 4).unwrap().long(), None);
        assert_eq!(LongHeader::parse(&d), None);
        assert_eq!(
            Header::parse(&d, 6),
            Err(MalformedReason::ShortHeaderTruncated)
        );
        assert_eq!(
            Header::parse(&d, usize::MAX),
            Err(MalformedReason::ShortHeaderTruncated)
        );
        assert_eq!(Header::parse(&[], 4), Err(MalformedReason::Empty));
        assert_eq!(
            Header::parse(&[0xc0, 0, 0, 0, 1, 21, 0], 4),
            Err(MalformedReason::DcidTooLong)
        );
        let d = long(0xe0, &[3; 8], &[0x00]);
        assert!(Header::parse(&d, 4).is_ok());
        for cut in 1..d.len() {
            assert_eq!(
                Header::parse(&d[..cut], 4),
                Err(MalformedReason::LongHeaderTruncated),
                "cut at {cut}"
            );
        }
    }
}
