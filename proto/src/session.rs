//! The session-store socket's codec: how a worker asks the demux's shared TLS session cache to
//! store, look up or take a session, and how the demux answers.
//!
//! One Unix `SOCK_SEQPACKET` socket pair per worker, used for nothing else; one message per
//! packet, integers little-endian:
//!
//! * request, worker → demux: `op u8 ‖ req_id u64 ‖ key_len u16 ‖ key ‖ value`, `op` one of
//!   [`Op`]. `key_len` is 1..=[`MAX_KEY_LEN`]; `value` is 0..=[`MAX_VALUE_LEN`] bytes for PUT
//!   and empty for TAKE.
//! * reply, demux → worker, to every well-formed request: `req_id u64 ‖ status u8 ‖ value`.
//!   TAKE: [`STATUS_FOUND`] (`value` follows) or [`STATUS_NOT_FOUND`] (nothing follows).
//!   PUT: [`STATUS_FOUND`] (stored) or [`STATUS_NOT_FOUND`] (refused), never a value.
//!
//! A malformed request gets no reply (the worker times out), and the demux counts it. There is
//! no lookup that leaves a session in place: TLS 1.3 resumption only ever takes one (single
//! use), and a lookup would let any worker read, again and again, every session whose ticket
//! it has seen. Code 2, a GET in protocol version 2, is an unknown operation now.

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

/// Reply status: not found (TAKE) or refused (PUT).
pub const STATUS_NOT_FOUND: u8 = 0;
/// Reply status: found (TAKE; the value follows) or stored (PUT).
pub const STATUS_FOUND: u8 = 1;

/// Request operations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Op {
    /// Store `value` under `key`, replacing any previous value. Acknowledged or refused.
    Put = 1,
    /// Look `key` up and remove it (single use).
    Take = 3,
}

impl Op {
    /// Every operation, for tables and tests.
    pub const ALL: [Op; 2] = [Op::Put, Op::Take];

    /// The operation with wire code `b`.
    pub fn from_u8(b: u8) -> Option<Op> {
        Op::ALL.into_iter().find(|op| *op as u8 == b)
    }

    /// The name in the contract document.
    pub fn name(self) -> &'static str {
        match self {
            Op::Put => "PUT",
            Op::Take => "TAKE",
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

/// A request that passed validation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Request<'a> {
    pub op: Op,
    pub req_id: u64,
    pub key: &'a [u8],
    pub value: &'a [u8],
}

impl Request<'_> {
    /// Parses and validates a request; `None` for anything malformed (too short or long,
    /// unknown op, key length out of range, a value with TAKE). Never panics.
    pub fn parse(msg: &[u8]) -> Option<Request<'_>> {
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
            Op::Take => value.is_empty(),
        };
        value_ok.then_some(Request {
            op,
            req_id,
            key,
            value,
        })
    }
}

/// Encodes a reply: `Some(value)` is found (or stored, with an empty value), `None` not found
/// (or refused).
pub fn encode_reply(req_id: u64, value: Option<&[u8]>) -> Vec<u8> {
    let mut reply = Vec::with_capacity(REPLY_HEADER_LEN + value.map_or(0, <[u8]>::len));
    reply.extend_from_slice(&req_id.to_le_bytes());
    match value {
        Some(v) => {
            reply.push(STATUS_FOUND);
            reply.extend_from_slice(v);
        }
        None => reply.push(STATUS_NOT_FOUND),
    }
    reply
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_and_replies_round_trip() {
        for op in Op::ALL {
            let value: &[u8] = if op == Op::Put { b"v" } else { b"" };
            let msg = encode_request(op, 42, b"key", value);
            assert_eq!(
                Request::parse(&msg),
                Some(Request {
                    op,
                    req_id: 42,
                    key: b"key",
                    value
                })
            );
            assert_eq!(Op::from_u8(op as u8), Some(op));
        }
        assert_eq!(
            decode_reply(&encode_reply(7, Some(b"v"))),
            Some((7, Some(&b"v"[..])))
        );
        assert_eq!(decode_reply(&encode_reply(8, None)), Some((8, None)));
    }

    #[test]
    fn malformed_requests_are_refused() {
        let ok = encode_request(Op::Put, 1, b"k", b"v");
        assert!(Request::parse(&ok).is_some());
        let mut bad_op = ok.clone();
        bad_op[0] = 9;
        let long_key = encode_request(Op::Take, 1, &[0; MAX_KEY_LEN + 1], b"");
        let big_value = encode_request(Op::Put, 1, b"k", &vec![0; MAX_VALUE_LEN + 1]);
        let take_with_value = encode_request(Op::Take, 1, b"k", b"v");
        // A GET of protocol version 2 (code 2): no such operation any more.
        let mut get = encode_request(Op::Take, 1, b"k", b"");
        get[0] = 2;
        let empty_key = encode_request(Op::Take, 1, b"", b"");
        let mut cut = encode_request(Op::Take, 1, b"key", b"");
        cut.pop();
        for m in [
            &bad_op[..],
            &long_key,
            &big_value,
            &take_with_value,
            &get,
            &empty_key,
            &cut,
            &ok[..5],
            &[],
        ] {
            assert_eq!(Request::parse(m), None, "{m:02x?}");
        }
    }

    #[test]
    fn malformed_replies_are_refused() {
        let mut value_after_miss = encode_reply(1, None);
        value_after_miss.push(0);
        let mut bad_status = encode_reply(1, None);
        bad_status[8] = 2;
        for r in [&value_after_miss[..], &bad_status, &[0; 8]] {
            assert_eq!(decode_reply(r), None, "{r:02x?}");
        }
        assert_eq!(decode_reply(&vec![0; MAX_REPLY_LEN + 1]), None);
    }
}
