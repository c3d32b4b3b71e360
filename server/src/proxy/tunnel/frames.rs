//! WebSocket framing as a tunnel sees it (RFC 6455 §5.2): where each frame of one direction
//! starts and ends in its byte stream, so that the tunnel can put a close frame of its own
//! between two frames, and see the peer's close. Only frame heads are read (2 to 14 bytes each:
//! FIN, RSV1–3, opcode; MASK and a 7-, 16- or 64-bit length; the masking key); payloads are
//! counted, never unmasked nor kept.
//!
//! A head that breaks §5.2 is [`Malformed`]: a reserved bit set with no extension negotiated
//! (§5.2, "RSV1, RSV2, RSV3"), a reserved opcode, a control frame that is fragmented or longer
//! than 125 bytes (§5.5), a 64-bit length with its top bit set, or a frame masked the wrong way
//! for its sender (§5.1: a client masks every frame, a server none). Nothing here panics on any
//! input.

/// Who writes the frames of a direction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Sender {
    /// The client: every frame masked (RFC 6455 §5.3).
    Client,
    /// The server (the upstream): no frame masked.
    Server,
}

/// Opcode of a close frame (RFC 6455 §5.5.1).
const CLOSE: u8 = 0x8;

/// The status code of our close frames: 1001, "going away" (RFC 6455 §7.4.1), a server
/// going down.
pub(crate) const GOING_AWAY: u16 = 1001;

/// A frame head that breaks RFC 6455 §5.2.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub(crate) enum Malformed {
    #[error("reserved bits {0:#05b} set with no extension negotiated (RFC 6455 §5.2)")]
    Reserved(u8),
    #[error("reserved opcode {0:#x} (RFC 6455 §5.2)")]
    Opcode(u8),
    #[error("a fragmented control frame (RFC 6455 §5.5)")]
    FragmentedControl,
    #[error("a control frame of {0} bytes, past 125 (RFC 6455 §5.5)")]
    ControlLength(u64),
    #[error("a 64-bit payload length with its most significant bit set (RFC 6455 §5.2)")]
    Length,
    #[error("a {sender:?} frame {how} (RFC 6455 §5.1)")]
    Mask { sender: Sender, how: &'static str },
}

/// One direction's frames, read as the bytes pass.
#[derive(Debug)]
pub(crate) struct Frames {
    sender: Sender,
    /// An extension was negotiated (`sec-websocket-extensions` in the 101), which may give
    /// the reserved bits a meaning (permessage-deflate's RSV1, RFC 7692 §6).
    extensions: bool,
    /// The head being read: `have` of its bytes so far.
    head: [u8; MAX_HEAD],
    have: usize,
    /// Payload bytes left of the frame whose head was read.
    remaining: u64,
    /// The opcode of the frame being read.
    opcode: u8,
    /// A whole close frame passed.
    closed: bool,
}

/// The longest head: 2 bytes, a 64-bit length, a masking key.
const MAX_HEAD: usize = 14;

impl Frames {
    pub(crate) fn new(sender: Sender, extensions: bool) -> Frames {
        Frames {
            sender,
            extensions,
            head: [0; MAX_HEAD],
            have: 0,
            remaining: 0,
            opcode: 0,
            closed: false,
        }
    }

    /// Who writes these frames.
    pub(crate) fn sender(&self) -> Sender {
        self.sender
    }

    /// Whether the bytes read so far end a frame (or none was read yet).
    pub(crate) fn at_boundary(&self) -> bool {
        self.have == 0 && self.remaining == 0
    }

    /// Whether a whole close frame passed.
    pub(crate) fn closed(&self) -> bool {
        self.closed
    }

    /// Reads `bytes`, which follow those read before, and returns how many it took: all of
    /// them, or with `stop`, those up to the first frame boundary (0 when the bytes read
    /// before end a frame).
    pub(crate) fn advance(&mut self, bytes: &[u8], stop: bool) -> Result<usize, Malformed> {
        let mut at = 0;
        while at < bytes.len() {
            if stop && self.at_boundary() {
                break;
            }
            if self.remaining > 0 {
                let left = bytes.len() - at;
                let n = usize::try_from(self.remaining).map_or(left, |r| r.min(left));
                at += n;
                self.remaining -= n as u64;
                if self.remaining == 0 {
                    self.frame_ended();
                }
                continue;
            }
            self.head[self.have] = bytes[at];
            self.have += 1;
            at += 1;
            if let Some(len) = self.head_read()? {
                self.have = 0;
                self.remaining = len;
                if len == 0 {
                    self.frame_ended();
                }
            }
        }
        Ok(at)
    }

    /// The payload length once the head is whole, checked; `None` while bytes of it are
    /// missing.
    fn head_read(&mut self) -> Result<Option<u64>, Malformed> {
        let h = &self.head[..self.have];
        if h.len() < 2 {
            return Ok(None);
        }
        let (fin, rsv, opcode) = (h[0] & 0x80 != 0, (h[0] >> 4) & 0x7, h[0] & 0x0f);
        let (masked, len7) = (h[1] & 0x80 != 0, h[1] & 0x7f);
        let extended = match len7 {
            126 => 2,
            127 => 8,
            _ => 0,
        };
        let need = 2 + extended + if masked { 4 } else { 0 };
        if h.len() < need {
            return Ok(None);
        }
        let len = match extended {
            0 => u64::from(len7),
            n => h[2..2 + n]
                .iter()
                .fold(0u64, |sum, b| sum << 8 | u64::from(*b)),
        };
        if rsv != 0 && !self.extensions {
            return Err(Malformed::Reserved(rsv));
        }
        if !matches!(opcode, 0x0..=0x2 | 0x8..=0xa) {
            return Err(Malformed::Opcode(opcode));
        }
        if len >> 63 != 0 {
            return Err(Malformed::Length);
        }
        if opcode & 0x8 != 0 {
            if !fin {
                return Err(Malformed::FragmentedControl);
            }
            if len > 125 {
                return Err(Malformed::ControlLength(len));
            }
        }
        match (self.sender, masked) {
            (Sender::Client, false) => {
                return Err(Malformed::Mask {
                    sender: self.sender,
                    how: "not masked",
                })
            }
            (Sender::Server, true) => {
                return Err(Malformed::Mask {
                    sender: self.sender,
                    how: "masked",
                })
            }
            _ => {}
        }
        self.opcode = opcode;
        Ok(Some(len))
    }

    fn frame_ended(&mut self) {
        if self.opcode == CLOSE {
            self.closed = true;
        }
    }
}

/// A close frame with status [`GOING_AWAY`] as `to` must receive it: from a server
/// (unmasked) to the client, or from a client (masked with `key`, RFC 6455 §5.3) to the
/// server. Returns the buffer and the length used.
pub(crate) fn going_away(to: Sender, key: [u8; 4]) -> ([u8; 8], usize) {
    let code = GOING_AWAY.to_be_bytes();
    match to {
        Sender::Client => ([0x80 | CLOSE, 2, code[0], code[1], 0, 0, 0, 0], 4),
        Sender::Server => (
            [
                0x80 | CLOSE,
                0x80 | 2,
                key[0],
                key[1],
                key[2],
                key[3],
                code[0] ^ key[0],
                code[1] ^ key[1],
            ],
            8,
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A frame as `sender` writes it, FIN set, with `payload` (masked with a fixed key for a
    /// client: only the head matters here).
    fn frame(sender: Sender, opcode: u8, payload: &[u8]) -> Vec<u8> {
        let mask = if sender == Sender::Client { 0x80 } else { 0 };
        let mut f = vec![0x80 | opcode];
        match payload.len() {
            n @ 0..=125 => f.push(mask | n as u8),
            n @ 126..=65535 => {
                f.push(mask | 126);
                f.extend_from_slice(&(n as u16).to_be_bytes());
            }
            n => {
                f.push(mask | 127);
                f.extend_from_slice(&(n as u64).to_be_bytes());
            }
        }
        if sender == Sender::Client {
            f.extend_from_slice(&[1, 2, 3, 4]);
        }
        f.extend_from_slice(payload);
        f
    }

    #[test]
    fn boundaries_are_found_whatever_the_reads() {
        for sender in [Sender::Client, Sender::Server] {
            let frames = [
                frame(sender, 0x1, b"hello"),
                frame(sender, 0x2, &[7; 300]),
                frame(sender, 0x9, b""),
                frame(sender, 0x2, &[9; 70_000]),
                frame(sender, 0x8, &GOING_AWAY.to_be_bytes()),
            ];
            let stream: Vec<u8> = frames.concat();
            let ends: Vec<usize> = frames
                .iter()
                .scan(0, |at, f| {
                    *at += f.len();
                    Some(*at)
                })
                .collect();
            // Every read size, from a byte at a time: each stop lands on the next end.
            for chunk in [1, 2, 3, 7, 14, 100, 4096, stream.len()] {
                let mut f = Frames::new(sender, false);
                let mut at = 0;
                let mut stops = Vec::new();
                while at < stream.len() {
                    let end = (at + chunk).min(stream.len());
                    let mut from = at;
                    while from < end {
                        let n = f.advance(&stream[from..end], true).unwrap();
                        from += n;
                        if f.at_boundary() {
                            if from > 0 {
                                stops.push(from);
                            }
                            // Past the boundary, as a tunnel that forwards on.
                            if from < end {
                                let n = f.advance(&stream[from..from + 1], false).unwrap();
                                from += n;
                            }
                        }
                    }
                    at = end;
                }
                stops.dedup();
                assert_eq!(stops, ends, "{sender:?}, reads of {chunk}");
                assert!(f.closed());
            }
        }
    }

    #[test]
    fn a_stop_at_a_boundary_takes_nothing() {
        let mut f = Frames::new(Sender::Server, false);
        let two = [
            frame(Sender::Server, 0x1, b"a"),
            frame(Sender::Server, 0x1, b"b"),
        ]
        .concat();
        assert_eq!(f.advance(&two, true).unwrap(), 0, "at a boundary already");
        assert_eq!(f.advance(&two[..1], false).unwrap(), 1);
        assert_eq!(
            f.advance(&two[1..], true).unwrap(),
            2,
            "up to the first frame's end"
        );
        assert_eq!(f.advance(&two[3..], true).unwrap(), 0);
        assert_eq!(f.advance(&two[3..], false).unwrap(), 3);
        assert!(f.at_boundary() && !f.closed());
    }

    #[test]
    fn malformed_heads_are_refused() {
        let refused = |sender, extensions, bytes: &[u8]| {
            Frames::new(sender, extensions)
                .advance(bytes, false)
                .unwrap_err()
        };
        let c = Sender::Client;
        assert_eq!(
            refused(c, false, &[0xc1, 0x80, 0, 0, 0, 0]),
            Malformed::Reserved(4)
        );
        assert_eq!(
            refused(c, false, &[0x83, 0x80, 0, 0, 0, 0]),
            Malformed::Opcode(3)
        );
        assert_eq!(
            refused(c, false, &[0x09, 0x80, 0, 0, 0, 0]),
            Malformed::FragmentedControl
        );
        assert_eq!(
            refused(c, false, &[0x88, 0xfe, 0, 126, 0, 0, 0, 0]),
            Malformed::ControlLength(126)
        );
        let huge = [0x82, 0xff, 0x80, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];
        assert_eq!(refused(c, false, &huge), Malformed::Length);
        assert!(matches!(
            refused(c, false, &[0x81, 0x01, b'x']),
            Malformed::Mask { .. }
        ));
        assert!(matches!(
            refused(Sender::Server, false, &[0x81, 0x81, 0, 0, 0, 0]),
            Malformed::Mask { .. }
        ));
        // With an extension negotiated, RSV1 is its (permessage-deflate).
        let mut f = Frames::new(Sender::Server, true);
        assert_eq!(f.advance(&[0xc1, 0x01, b'x'], false).unwrap(), 3);
    }

    #[test]
    fn random_bytes_never_panic() {
        // A fixed xorshift: the same bytes every run.
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..2000 {
            let mut bytes = [0u8; 64];
            for b in &mut bytes {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                *b = x as u8;
            }
            for sender in [Sender::Client, Sender::Server] {
                for extensions in [false, true] {
                    let mut f = Frames::new(sender, extensions);
                    let _ = f.advance(&bytes, x & 1 == 0);
                }
            }
        }
    }

    #[test]
    fn our_close_frames_read_back() {
        let (to_client, n) = going_away(Sender::Client, [0; 4]);
        assert_eq!(&to_client[..n], &[0x88, 2, 0x03, 0xe9]);
        let mut f = Frames::new(Sender::Server, false);
        assert_eq!(f.advance(&to_client[..n], false).unwrap(), n);
        assert!(f.closed());
        let key = [0xa1, 0xb2, 0xc3, 0xd4];
        let (to_server, n) = going_away(Sender::Server, key);
        assert_eq!(n, 8);
        assert_eq!([to_server[6] ^ key[0], to_server[7] ^ key[1]], [0x03, 0xe9]);
        let mut f = Frames::new(Sender::Client, false);
        assert_eq!(f.advance(&to_server[..n], false).unwrap(), n);
        assert!(f.closed());
    }
}
