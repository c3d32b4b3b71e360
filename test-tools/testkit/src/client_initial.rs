//! Client Initial packets for tests, protected with rustls' QUIC Initial keys (an
//! implementation independent of the demux's), carrying ClientHellos whose pre-shared-key
//! identities the test chooses. Only the structure the demux reads is real: the cipher suite,
//! randoms and binders are filler, so a worker's TLS stack refuses these ClientHellos.

use rustls::crypto::ring::cipher_suite::TLS13_AES_128_GCM_SHA256;
use rustls::quic::{Keys, Version};
use rustls::{CipherSuite, Side, SupportedCipherSuite};

/// A ClientHello (handshake header included) offering `identities`, with `padding` octets of
/// a padding extension (RFC 7685) before the `pre_shared_key` extension, which comes last
/// (RFC 8446 §4.2.11).
pub fn client_hello(identities: &[&[u8]], padding: usize) -> Vec<u8> {
    let mut body = vec![0x03, 0x03];
    body.extend_from_slice(&[0x5a; 32]); // random
    body.push(0); // legacy_session_id
    body.extend_from_slice(&2u16.to_be_bytes());
    body.extend_from_slice(&u16::from(CipherSuite::TLS13_AES_128_GCM_SHA256).to_be_bytes());
    body.extend_from_slice(&[1, 0]); // compression: null
    let mut exts = Vec::new();
    if padding > 0 {
        exts.extend_from_slice(&21u16.to_be_bytes());
        exts.extend_from_slice(&(padding as u16).to_be_bytes());
        exts.resize(exts.len() + padding, 0);
    }
    if !identities.is_empty() {
        let mut ids = Vec::new();
        for id in identities {
            ids.extend_from_slice(&(id.len() as u16).to_be_bytes());
            ids.extend_from_slice(id);
            ids.extend_from_slice(&0x0102_0304u32.to_be_bytes());
        }
        let mut binders = Vec::new();
        for _ in identities {
            binders.push(32);
            binders.extend_from_slice(&[0xbb; 32]);
        }
        let mut psk = Vec::new();
        psk.extend_from_slice(&(ids.len() as u16).to_be_bytes());
        psk.extend_from_slice(&ids);
        psk.extend_from_slice(&(binders.len() as u16).to_be_bytes());
        psk.extend_from_slice(&binders);
        exts.extend_from_slice(&41u16.to_be_bytes());
        exts.extend_from_slice(&(psk.len() as u16).to_be_bytes());
        exts.extend_from_slice(&psk);
    }
    body.extend_from_slice(&(exts.len() as u16).to_be_bytes());
    body.extend_from_slice(&exts);
    let mut msg = vec![1];
    msg.extend_from_slice(&(body.len() as u32).to_be_bytes()[1..]);
    msg.extend_from_slice(&body);
    msg
}

/// A CRYPTO frame (RFC 9000 §19.6) of `data` at `offset`.
pub fn crypto_frame(offset: u64, data: &[u8]) -> Vec<u8> {
    let mut f = vec![0x06];
    put_varint(&mut f, offset);
    put_varint(&mut f, data.len() as u64);
    f.extend_from_slice(data);
    f
}

/// A protected client Initial of QUIC v1 carrying `frames`, padded so that the packet is at
/// least 1200 octets, with a two-octet packet number `pn`. Keys from `key_dcid` (the DCID of
/// the client's first Initial), which is normally `dcid` itself.
pub fn initial_packet(
    dcid: &[u8],
    key_dcid: &[u8],
    scid: &[u8],
    token: &[u8],
    pn: u16,
    frames: &[u8],
) -> Vec<u8> {
    let suite = match TLS13_AES_128_GCM_SHA256 {
        SupportedCipherSuite::Tls13(s) => s,
        _ => unreachable!("a TLS 1.3 suite"),
    };
    let keys = Keys::initial(
        Version::V1,
        suite,
        suite.quic.expect("QUIC support"),
        key_dcid,
        Side::Client,
    );
    let mut header = vec![0xc1]; // long header, Initial, two-octet packet number
    header.extend_from_slice(&1u32.to_be_bytes());
    header.push(dcid.len() as u8);
    header.extend_from_slice(dcid);
    header.push(scid.len() as u8);
    header.extend_from_slice(scid);
    put_varint(&mut header, token.len() as u64);
    header.extend_from_slice(token);
    let fixed = header.len() + 2 + 2 + 16;
    let mut payload = frames.to_vec();
    if fixed + payload.len() < 1200 {
        payload.resize(1200 - fixed, 0); // PADDING frames
    }
    let length = 2 + payload.len() + 16;
    assert!(length < 16384);
    header.extend_from_slice(&(0x4000 | length as u16).to_be_bytes());
    let pn_at = header.len();
    header.extend_from_slice(&pn.to_be_bytes());
    let tag = keys
        .local
        .packet
        .encrypt_in_place(u64::from(pn), &header, &mut payload)
        .expect("sealing");
    payload.extend_from_slice(tag.as_ref());
    // The sample starts 4 octets past the packet number's start (RFC 9001 §5.4.2).
    let sample = payload[2..18].to_vec();
    let (first, rest) = header.split_at_mut(1);
    keys.local
        .header
        .encrypt_in_place(&sample, &mut first[0], &mut rest[pn_at - 1..])
        .expect("header protection");
    header.extend_from_slice(&payload);
    header
}

fn put_varint(out: &mut Vec<u8>, v: u64) {
    match v {
        0..=63 => out.push(v as u8),
        64..=16383 => out.extend_from_slice(&(0x4000 | v as u16).to_be_bytes()),
        _ => out.extend_from_slice(&(0x8000_0000 | v as u32).to_be_bytes()),
    }
}
