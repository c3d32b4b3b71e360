//! Reading QUIC and TLS fields out of bytes from the network: one bounds-checked cursor, so
//! that no parser in the demux indexes past what arrived. Every read answers `None` when the
//! bytes run out; nothing here panics.

/// A cursor over untrusted bytes; `.0` is what is left.
pub(crate) struct Reader<'a>(pub(crate) &'a [u8]);

impl<'a> Reader<'a> {
    /// The next `n` octets.
    pub(crate) fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Some(head)
    }

    pub(crate) fn u8(&mut self) -> Option<u8> {
        self.take(1).map(|b| b[0])
    }

    /// A big-endian 16-bit length or type (TLS, RFC 8446 §3).
    pub(crate) fn u16(&mut self) -> Option<usize> {
        self.take(2)
            .map(|b| usize::from(u16::from_be_bytes([b[0], b[1]])))
    }

    /// A variable-length integer (RFC 9000 §16).
    pub(crate) fn varint(&mut self) -> Option<u64> {
        let first = self.u8()?;
        let len = 1usize << (first >> 6);
        let mut v = u64::from(first & 0x3f);
        for &b in self.take(len - 1)? {
            v = (v << 8) | u64::from(b);
        }
        Some(v)
    }
}

/// QUIC version 1 (RFC 9000).
pub(crate) const V1: u32 = 1;

/// The header fields of a QUIC v1 Initial packet (RFC 9000 §17.2.2) up to its token, and the
/// cursor after them (at the Length field).
#[derive(Debug)]
pub(crate) struct Initial<'a> {
    pub(crate) dcid: &'a [u8],
    pub(crate) scid: &'a [u8],
    pub(crate) token: &'a [u8],
    pub(crate) rest: &'a [u8],
}

impl<'a> Initial<'a> {
    /// The Initial at the start of `packet`; `None` for anything else (another type or
    /// version, a connection ID longer than 20 octets, a header cut short).
    pub(crate) fn parse(packet: &'a [u8]) -> Option<Initial<'a>> {
        let mut r = Reader(packet);
        let first = r.u8()?;
        // Long header, type Initial (0b00).
        if first & 0x80 == 0 || first & 0x30 != 0 {
            return None;
        }
        if u32::from_be_bytes(r.take(4)?.try_into().ok()?) != V1 {
            return None;
        }
        let dcid_len = usize::from(r.u8()?);
        let dcid = r.take(dcid_len)?;
        let scid_len = usize::from(r.u8()?);
        let scid = r.take(scid_len)?;
        if dcid_len > 20 || scid_len > 20 {
            return None;
        }
        let token_len = usize::try_from(r.varint()?).ok()?;
        let token = r.take(token_len)?;
        Some(Initial {
            dcid,
            scid,
            token,
            rest: r.0,
        })
    }
}
