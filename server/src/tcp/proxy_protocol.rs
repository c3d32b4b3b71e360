//! The PROXY protocol on the TCP listeners (HAProxy's `proxy-protocol.txt`, versions 1 and 2):
//! behind a balancer that hides the client's address, the balancer opens each connection with
//! a header that names it, and that address stands for the peer's everywhere after (the access
//! log, `allow`/`deny`, rates, `forwarded` and `x-forwarded-for` to upstreams).
//!
//! Opt-in and by source only ([`TcpOptions::proxy_protocol_from`]): a connection from a listed
//! block must begin with a header, either version, complete within
//! [`TcpOptions::proxy_header_timeout`], or it is closed and counted ([`ProxyRefusal`]); a
//! connection from any other source is served as it is, its first bytes never read as a header
//! (anyone could write one). Version 2's `LOCAL` command (a balancer's own health check),
//! version 1's `UNKNOWN`, and version 2 headers of no IP family (`UNSPEC`, `AF_UNIX`) keep the
//! peer's address, as the protocol asks. Type-length-value fields of version 2 are read and
//! ignored. QUIC has no such header here: UDP reaches the demux without a balancer's header.
//!
//! [`parse`] decides on the bytes read so far and nothing else (sans I/O, tested with hostile
//! inputs); [`read_header`] reads from the socket exactly the header's bytes and not one more,
//! so what follows (the TLS ClientHello, an HTTP/1.1 request) stays in the socket for the
//! listener: version 2 says its length, version 1 ends at its CRLF, which is looked for in
//! what the socket holds (`peek`) before anything is taken from it.
//!
//! [`TcpOptions::proxy_protocol_from`]: super::TcpOptions::proxy_protocol_from
//! [`TcpOptions::proxy_header_timeout`]: super::TcpOptions::proxy_header_timeout

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;
use tracing::debug;

use super::TcpOptions;
use crate::stats::{ProxyRefusal, ServerStats};

/// The longest version 1 header, its CRLF included (`proxy-protocol.txt` §2.1).
pub(crate) const V1_MAX: usize = 107;
/// Version 2's fixed part: the signature, version and command, family and protocol, length.
const V2_FIXED: usize = 16;
/// The most bytes of addresses and type-length-value fields a version 2 header may carry
/// here. The addresses take at most 216 (`AF_UNIX`); balancers add a few short fields (an
/// endpoint's ID, a TLS note). The protocol allows 65535.
pub(crate) const V2_MAX_BODY: usize = 1024;
/// Version 2's signature (`proxy-protocol.txt` §2.2).
const V2_SIGNATURE: [u8; 12] = *b"\r\n\r\n\0\r\nQUIT\n";
/// Version 1's start.
const V1_PREFIX: &[u8] = b"PROXY ";
/// What is read before looking: no header is shorter (`PROXY UNKNOWN\r\n` is 15 bytes,
/// version 2 at least 16), so these bytes are the header's whichever it is.
const FIRST: usize = 15;

/// What a whole header says of the client.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Header {
    /// A proxied connection from this client.
    Client(SocketAddr),
    /// No client address (version 2 `LOCAL`, version 1 `UNKNOWN`, no IP family): the peer's
    /// stands.
    Peer,
}

/// What the bytes read so far come to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Parsed {
    /// They are a whole header, and nothing more.
    Done(Header),
    /// The header goes on for at least this many more bytes: read them all.
    Exactly(usize),
    /// A version 1 header whose CRLF has not come: read up to the first `\n`, at most this
    /// many bytes.
    Line(usize),
}

/// What the bytes `held` (everything read from the connection so far) come to: a whole
/// header, how much more to read, or why the connection is refused.
pub(crate) fn parse(held: &[u8]) -> Result<Parsed, ProxyRefusal> {
    let n = held.len();
    let start = &held[..n.min(FIRST)];
    let v1 = V1_PREFIX.starts_with(&start[..start.len().min(V1_PREFIX.len())]);
    let v2 = V2_SIGNATURE.starts_with(&start[..start.len().min(V2_SIGNATURE.len())]);
    if !v1 && !v2 {
        return Err(ProxyRefusal::Missing);
    }
    if n < FIRST {
        return Ok(Parsed::Exactly(FIRST - n));
    }
    if v2 {
        if n < V2_FIXED {
            return Ok(Parsed::Exactly(V2_FIXED - n));
        }
        let body = usize::from(u16::from_be_bytes([held[14], held[15]]));
        if body > V2_MAX_BODY {
            return Err(ProxyRefusal::Oversize);
        }
        return match (V2_FIXED + body).checked_sub(n) {
            Some(0) => v2_header(held[12], held[13], &held[V2_FIXED..]).map(Parsed::Done),
            Some(more) => Ok(Parsed::Exactly(more)),
            None => Err(ProxyRefusal::Malformed),
        };
    }
    match held.iter().position(|&b| b == b'\n') {
        Some(end) if end + 1 == n && held[end - 1] == b'\r' => {
            v1_header(&held[V1_PREFIX.len()..end - 1]).map(Parsed::Done)
        }
        Some(_) => Err(ProxyRefusal::Malformed),
        None if n >= V1_MAX => Err(ProxyRefusal::Oversize),
        None => Ok(Parsed::Line(V1_MAX - n)),
    }
}

/// Reads a whole header from `stream`, taking from it exactly the header's bytes; the caller
/// bounds it in time. Each step reads at least one byte, and no header is longer than
/// `V2_FIXED + V2_MAX_BODY`: the loop ends.
pub(crate) async fn read_header(stream: &mut TcpStream) -> Result<Header, ProxyRefusal> {
    let mut held = Vec::with_capacity(V1_MAX);
    loop {
        let take = match parse(&held)? {
            Parsed::Done(header) => return Ok(header),
            Parsed::Exactly(more) => more,
            Parsed::Line(room) => {
                let mut ahead = [0u8; V1_MAX];
                let seen = match stream.peek(&mut ahead[..room]).await {
                    Ok(0) | Err(_) => return Err(ProxyRefusal::Closed),
                    Ok(seen) => seen,
                };
                // Up to the line's end if it is there, else all of it (all the header's).
                ahead[..seen]
                    .iter()
                    .position(|&b| b == b'\n')
                    .map_or(seen, |end| end + 1)
            }
        };
        let from = held.len();
        held.resize(from + take, 0);
        if stream.read_exact(&mut held[from..]).await.is_err() {
            return Err(ProxyRefusal::Closed);
        }
    }
}

/// The client's address of the connection `stream` from `peer`: `peer` itself unless it is
/// within `opts.proxy_protocol_from`; then the address its PROXY header names (or `peer`, for
/// a header that names none). `None`: no whole, valid header in time; the connection is to be
/// closed, and that is counted and logged here.
pub(super) async fn client_of(
    stream: &mut TcpStream,
    peer: SocketAddr,
    opts: &TcpOptions,
    stats: &ServerStats,
) -> Option<SocketAddr> {
    if !opts
        .proxy_protocol_from
        .iter()
        .any(|b| b.contains(peer.ip()))
    {
        return Some(peer);
    }
    let read = tokio::time::timeout(opts.proxy_header_timeout, read_header(stream)).await;
    let why = match read {
        Ok(Ok(Header::Client(client))) => return Some(client),
        Ok(Ok(Header::Peer)) => return Some(peer),
        Ok(Err(why)) => why,
        Err(_) => ProxyRefusal::Timeout,
    };
    stats.count_proxy_refusal(why);
    debug!(%peer, %why, "PROXY protocol: connection refused");
    None
}

/// Version 1's line between `PROXY ` and its CRLF: `TCP4|TCP6 SRC DST SPORT DPORT`, or
/// `UNKNOWN` and anything.
fn v1_header(line: &[u8]) -> Result<Header, ProxyRefusal> {
    let bad = ProxyRefusal::Malformed;
    if line.iter().any(|&b| !(0x20..0x7f).contains(&b)) {
        return Err(bad);
    }
    let line = std::str::from_utf8(line).map_err(|_| bad)?;
    let mut words = line.split(' ');
    let family = words.next().ok_or(bad)?;
    if family == "UNKNOWN" {
        return Ok(Header::Peer);
    }
    let fields: Vec<&str> = words.collect();
    let [src, dst, sport, dport] = fields[..] else {
        return Err(bad);
    };
    // The destination is checked too, though only the source is taken.
    let src: IpAddr = match family {
        "TCP4" => {
            dst.parse::<Ipv4Addr>().map_err(|_| bad)?;
            src.parse::<Ipv4Addr>().map_err(|_| bad)?.into()
        }
        "TCP6" => {
            dst.parse::<Ipv6Addr>().map_err(|_| bad)?;
            src.parse::<Ipv6Addr>().map_err(|_| bad)?.into()
        }
        _ => return Err(bad),
    };
    // Decimal digits only: `u16`'s parser would take `+80`.
    let port = |p: &str| match p.len() {
        1..=5 if p.bytes().all(|b| b.is_ascii_digit()) => p.parse::<u16>().map_err(|_| bad),
        _ => Err(bad),
    };
    port(dport)?;
    Ok(Header::Client(SocketAddr::new(src, port(sport)?)))
}

/// Version 2 after its signature: the version and command byte, the family and protocol
/// byte, and the `body` its length says (addresses, then type-length-value fields).
fn v2_header(version_command: u8, family: u8, body: &[u8]) -> Result<Header, ProxyRefusal> {
    let bad = ProxyRefusal::Malformed;
    if version_command >> 4 != 2 || family & 0x0f > 2 {
        return Err(bad);
    }
    match version_command & 0x0f {
        // LOCAL: the balancer's own connection; the address block is ignored.
        0 => return Ok(Header::Peer),
        // PROXY
        1 => {}
        _ => return Err(bad),
    }
    let word = |at: usize| u16::from_be_bytes([body[at], body[at + 1]]);
    match family >> 4 {
        // AF_UNSPEC, AF_UNIX: no IP address to take.
        0 => Ok(Header::Peer),
        3 if body.len() >= 216 => Ok(Header::Peer),
        // AF_INET: source, destination, source port, destination port.
        1 if body.len() >= 12 => {
            let src: [u8; 4] = body[0..4].try_into().map_err(|_| bad)?;
            Ok(Header::Client(SocketAddr::new(src.into(), word(8))))
        }
        // AF_INET6: the same, 16-byte addresses.
        2 if body.len() >= 36 => {
            let src: [u8; 16] = body[0..16].try_into().map_err(|_| bad)?;
            Ok(Header::Client(SocketAddr::new(src.into(), word(32))))
        }
        _ => Err(bad),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The header `bytes` read the way [`read_header`] reads: a step at a time, each step
    /// given what it asks for from `bytes`; what it came to and how many bytes it took.
    fn stepwise(bytes: &[u8]) -> (Result<Header, ProxyRefusal>, usize) {
        let mut held = Vec::new();
        loop {
            let take = match parse(&held) {
                Err(e) => return (Err(e), held.len()),
                Ok(Parsed::Done(h)) => return (Ok(h), held.len()),
                Ok(Parsed::Exactly(more)) => more,
                Ok(Parsed::Line(room)) => {
                    let ahead = &bytes[held.len()..bytes.len().min(held.len() + room)];
                    ahead
                        .iter()
                        .position(|&b| b == b'\n')
                        .map_or(ahead.len(), |e| e + 1)
                }
            };
            if take == 0 || held.len() + take > bytes.len() {
                return (Err(ProxyRefusal::Closed), held.len());
            }
            held.extend_from_slice(&bytes[held.len()..held.len() + take]);
        }
    }

    fn v2(command: u8, family: u8, body: &[u8]) -> Vec<u8> {
        let mut h = V2_SIGNATURE.to_vec();
        h.extend([0x20 | command, family]);
        h.extend((body.len() as u16).to_be_bytes());
        h.extend(body);
        h
    }

    fn v2_inet(src: [u8; 4], port: u16) -> Vec<u8> {
        let mut body = src.to_vec();
        body.extend([127, 0, 0, 1]);
        body.extend(port.to_be_bytes());
        body.extend(443u16.to_be_bytes());
        v2(1, 0x11, &body)
    }

    /// Each header is taken whole and nothing after it: the ClientHello that follows stays.
    #[test]
    fn version_1_headers() {
        let after = b"\x16\x03\x01 the ClientHello";
        for (line, want) in [
            (
                "PROXY TCP4 192.0.2.7 127.0.0.1 56324 443\r\n",
                Header::Client("192.0.2.7:56324".parse().unwrap()),
            ),
            (
                "PROXY TCP6 2001:db8::7 ::1 65535 443\r\n",
                Header::Client("[2001:db8::7]:65535".parse().unwrap()),
            ),
            ("PROXY UNKNOWN\r\n", Header::Peer),
            (
                "PROXY UNKNOWN ffff:f...f:ffff ffff:f...f:ffff 65535 65535\r\n",
                Header::Peer,
            ),
        ] {
            let mut bytes = line.as_bytes().to_vec();
            bytes.extend(after);
            assert_eq!(stepwise(&bytes), (Ok(want), line.len()), "{line:?}");
        }
    }

    #[test]
    fn version_2_headers() {
        let after = b"\x16\x03\x01 the ClientHello";
        let mut inet6 = vec![0x20, 0x01, 0x0d, 0xb8];
        inet6.extend([0; 11]);
        inet6.push(9);
        inet6.extend([0; 15]);
        inet6.push(1);
        inet6.extend(4433u16.to_be_bytes());
        inet6.extend(443u16.to_be_bytes());
        // A type-length-value field after the addresses (PP2_TYPE_AUTHORITY), ignored.
        let mut with_tlv = v2_inet([198, 51, 100, 7], 1234);
        with_tlv.extend([0x02, 0x00, 0x04]);
        with_tlv.extend(b"a.io");
        with_tlv[15] += 7;
        for (header, want) in [
            (
                v2_inet([203, 0, 113, 9], 40000),
                Header::Client("203.0.113.9:40000".parse().unwrap()),
            ),
            (
                v2(1, 0x21, &inet6),
                Header::Client("[2001:db8::9]:4433".parse().unwrap()),
            ),
            (
                with_tlv,
                Header::Client("198.51.100.7:1234".parse().unwrap()),
            ),
            // LOCAL: a balancer's health check; its address block is ignored.
            (v2(0, 0x11, &[0; 12]), Header::Peer),
            (v2(0, 0x00, &[]), Header::Peer),
            (v2(1, 0x00, &[]), Header::Peer),
            (v2(1, 0x31, &[0; 216]), Header::Peer),
        ] {
            let mut bytes = header.clone();
            bytes.extend(after);
            assert_eq!(stepwise(&bytes), (Ok(want), header.len()), "{header:?}");
        }
    }

    #[test]
    fn bad_headers_are_refused_with_their_reason() {
        let long_v1 = format!("PROXY TCP4 {} 1 2\r\n", "1".repeat(100));
        let mut v2_long = v2_inet([192, 0, 2, 1], 1);
        v2_long[14..16].copy_from_slice(&((V2_MAX_BODY + 1) as u16).to_be_bytes());
        let mut v2_short_inet = v2(1, 0x11, &[0; 11]);
        v2_short_inet.extend([0; 64]);
        let cases: Vec<(Vec<u8>, ProxyRefusal)> = vec![
            (
                b"GET / HTTP/1.1\r\nhost: a\r\n\r\n".to_vec(),
                ProxyRefusal::Missing,
            ),
            // A TLS ClientHello's first bytes.
            (
                b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\x9a\x41\x07\x7e\x10".to_vec(),
                ProxyRefusal::Missing,
            ),
            (
                b"PROXY\r\nGET / HTTP/1.1\r\n".to_vec(),
                ProxyRefusal::Missing,
            ),
            (
                b"proxy TCP4 1.2.3.4 1.2.3.4 1 2\r\n".to_vec(),
                ProxyRefusal::Missing,
            ),
            (long_v1.into_bytes(), ProxyRefusal::Oversize),
            (v2_long, ProxyRefusal::Oversize),
            (
                b"PROXY TCP4 1.2.3.4 1.2.3.4 1 2\n".to_vec(),
                ProxyRefusal::Malformed,
            ),
            (
                b"PROXY TCP4 1.2.3.4 1.2.3.4 1 2\r\r\n".to_vec(),
                ProxyRefusal::Malformed,
            ),
            (
                b"PROXY TCP4 1.2.3.4  1.2.3.4 1 2\r\n".to_vec(),
                ProxyRefusal::Malformed,
            ),
            (
                b"PROXY TCP4 1.2.3.4 1.2.3.4 +1 2\r\n".to_vec(),
                ProxyRefusal::Malformed,
            ),
            (
                b"PROXY TCP4 1.2.3.4 1.2.3.4 65536 2\r\n".to_vec(),
                ProxyRefusal::Malformed,
            ),
            (
                b"PROXY TCP4 1.2.3.4 1.2.3.4 1 2 3\r\n".to_vec(),
                ProxyRefusal::Malformed,
            ),
            (
                b"PROXY TCP4 ::1 ::1 1 2\r\n".to_vec(),
                ProxyRefusal::Malformed,
            ),
            (
                b"PROXY TCP6 1.2.3.4 1.2.3.4 1 2\r\n".to_vec(),
                ProxyRefusal::Malformed,
            ),
            (
                b"PROXY TCP4 01.2.3.4 1.2.3.4 1 2\r\n".to_vec(),
                ProxyRefusal::Malformed,
            ),
            (
                b"PROXY UDP4 1.2.3.4 1.2.3.4 1 2\r\n".to_vec(),
                ProxyRefusal::Malformed,
            ),
            (
                b"PROXY TCP4 1.2.3.4 1.2.3.4 1 \xc3\xa9\r\n".to_vec(),
                ProxyRefusal::Malformed,
            ),
            // Version 2: another version, an unknown command, family or protocol, an address
            // block shorter than its family's.
            (
                {
                    let mut h = v2_inet([1, 2, 3, 4], 1);
                    h[12] = 0x11;
                    h
                },
                ProxyRefusal::Malformed,
            ),
            (
                {
                    let mut h = v2_inet([1, 2, 3, 4], 1);
                    h[12] = 0x22;
                    h
                },
                ProxyRefusal::Malformed,
            ),
            (
                {
                    let mut h = v2_inet([1, 2, 3, 4], 1);
                    h[13] = 0x41;
                    h
                },
                ProxyRefusal::Malformed,
            ),
            (
                {
                    let mut h = v2_inet([1, 2, 3, 4], 1);
                    h[13] = 0x13;
                    h
                },
                ProxyRefusal::Malformed,
            ),
            (v2_short_inet, ProxyRefusal::Malformed),
        ];
        for (bytes, want) in cases {
            assert_eq!(
                stepwise(&bytes).0,
                Err(want),
                "{:?}",
                String::from_utf8_lossy(&bytes)
            );
        }
    }

    /// A header cut anywhere is never taken for one: the reader asks for more (and the
    /// connection ends: `Closed`), whatever the cut.
    #[test]
    fn truncated_headers_ask_for_more() {
        let whole = [
            b"PROXY TCP4 192.0.2.7 127.0.0.1 56324 443\r\n".to_vec(),
            b"PROXY UNKNOWN\r\n".to_vec(),
            v2_inet([203, 0, 113, 9], 40000),
            v2(0, 0x00, &[]),
        ];
        for header in whole {
            for cut in 0..header.len() {
                assert_eq!(
                    stepwise(&header[..cut]).0,
                    Err(ProxyRefusal::Closed),
                    "{header:?} cut at {cut}"
                );
            }
        }
    }

    /// Hostile inputs, fuzz-like: random bytes, and good headers with random bytes changed,
    /// cut or appended (a fixed-seed generator, so a failure repeats). Whatever comes, the
    /// parser never panics, never asks for more than the bounds allow, and never takes more
    /// than it was given nor a header past its bound.
    #[test]
    fn hostile_inputs_are_refused_or_bounded() {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            // xorshift64*
            seed ^= seed >> 12;
            seed ^= seed << 25;
            seed ^= seed >> 27;
            seed.wrapping_mul(0x2545_f491_4f6c_dd1d)
        };
        let seeds = [
            b"PROXY TCP4 192.0.2.7 127.0.0.1 56324 443\r\n".to_vec(),
            b"PROXY TCP6 2001:db8::7 ::1 65535 443\r\n".to_vec(),
            v2_inet([203, 0, 113, 9], 40000),
            v2(1, 0x21, &[7; 36]),
            v2(0, 0x00, &[]),
        ];
        for round in 0..20_000 {
            let mut bytes = match round % 4 {
                0 => (0..next() % 200).map(|_| next() as u8).collect(),
                _ => seeds[(next() % seeds.len() as u64) as usize].clone(),
            };
            for _ in 0..next() % 4 {
                if bytes.is_empty() {
                    break;
                }
                let at = (next() % bytes.len() as u64) as usize;
                match next() % 3 {
                    0 => bytes[at] = next() as u8,
                    1 => bytes.truncate(at),
                    _ => bytes.extend((0..next() % 64).map(|_| next() as u8)),
                }
            }
            let (got, took) = stepwise(&bytes);
            assert!(took <= bytes.len(), "{bytes:?}");
            assert!(took <= V2_FIXED + V2_MAX_BODY, "{bytes:?}");
            if bytes.starts_with(V1_PREFIX) {
                assert!(took <= V1_MAX, "{bytes:?}");
            }
            if got.is_ok() {
                assert!(parse(&bytes[..took]).is_ok_and(|p| matches!(p, Parsed::Done(_))));
            }
        }
    }

    /// Over a real socket: the header taken, the bytes after it left for the listener, even
    /// when the header comes a byte at a time; an unlisted peer's case is the caller's.
    #[tokio::test]
    async fn read_header_takes_the_header_and_leaves_the_rest() {
        use tokio::io::AsyncWriteExt;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let line = b"PROXY TCP4 192.0.2.7 127.0.0.1 56324 443\r\nGET / HTTP/1.1\r\n";
        let v2h = v2_inet([203, 0, 113, 9], 40000);
        for (bytes, one_at_a_time) in [
            (line.to_vec(), false),
            (line.to_vec(), true),
            ([v2h.as_slice(), b"rest"].concat(), true),
        ] {
            let client = tokio::spawn({
                let bytes = bytes.clone();
                async move {
                    let mut c = TcpStream::connect(addr).await.unwrap();
                    c.set_nodelay(true).unwrap();
                    for chunk in bytes.chunks(if one_at_a_time { 1 } else { bytes.len() }) {
                        c.write_all(chunk).await.unwrap();
                        c.flush().await.unwrap();
                    }
                    c.shutdown().await.unwrap();
                    c
                }
            });
            let (mut s, _) = listener.accept().await.unwrap();
            let header = read_header(&mut s).await.unwrap();
            let mut rest = Vec::new();
            s.read_to_end(&mut rest).await.unwrap();
            let _client = client.await.unwrap();
            let taken = bytes.len() - rest.len();
            assert_eq!(stepwise(&bytes), (Ok(header), taken));
            assert!(rest.starts_with(b"GET") || rest == b"rest", "{rest:?}");
        }
    }
}
