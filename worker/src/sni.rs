//! The QUIC handshake's server name, checked before rustls sees the ClientHello: a name no site
//! has (or none), without a default site, is refused with the TLS alert `unrecognized_name`
//! (RFC 6066 §3; QUIC error 0x100 + 112, RFC 9001 §4.8), as HTTPS over TCP refuses it. rustls
//! itself would answer `access_denied` once its certificate resolver found nothing.
//!
//! [`SniGate`] wraps quinn's rustls server configuration; its sessions hold the CRYPTO bytes of
//! the Initial packets back until the whole ClientHello is there, read its `server_name`, and
//! then hand every byte on to rustls, or close the connection.

use std::any::Any;
use std::sync::Arc;

use quinn_proto::crypto::{self, ExportKeyingMaterialError, KeyPair, Keys, PacketKey};
use quinn_proto::transport_parameters::TransportParameters;
use quinn_proto::{ConnectionId, Side, TransportError, TransportErrorCode};

use crate::tls::SiteCerts;

/// TLS alert `unrecognized_name`.
const UNRECOGNIZED_NAME: u8 = 112;

/// Longest ClientHello held back; a longer one goes to rustls as it comes (which judges it).
const MAX_HELLO: usize = 64 * 1024;

/// A QUIC server crypto configuration whose handshakes first check the ClientHello's server
/// name against the sites ([`SiteCerts::site_for`]).
pub struct SniGate {
    inner: Arc<dyn crypto::ServerConfig>,
    sites: SiteCerts,
}

impl SniGate {
    pub fn new(inner: Arc<dyn crypto::ServerConfig>, sites: SiteCerts) -> SniGate {
        SniGate { inner, sites }
    }
}

impl crypto::ServerConfig for SniGate {
    fn initial_keys(
        &self,
        version: u32,
        dst_cid: &ConnectionId,
    ) -> Result<Keys, crypto::UnsupportedVersion> {
        self.inner.initial_keys(version, dst_cid)
    }

    fn retry_tag(&self, version: u32, orig_dst_cid: &ConnectionId, packet: &[u8]) -> [u8; 16] {
        self.inner.retry_tag(version, orig_dst_cid, packet)
    }

    fn start_session(
        self: Arc<Self>,
        version: u32,
        params: &TransportParameters,
    ) -> Box<dyn crypto::Session> {
        Box::new(GatedSession {
            inner: self.inner.clone().start_session(version, params),
            sites: self.sites.clone(),
            held: Some(Vec::new()),
        })
    }
}

/// A server session that holds the ClientHello back until its server name is checked.
struct GatedSession {
    inner: Box<dyn crypto::Session>,
    sites: SiteCerts,
    /// The handshake bytes received so far, until the ClientHello is whole and checked.
    held: Option<Vec<u8>>,
}

impl crypto::Session for GatedSession {
    fn initial_keys(&self, dst_cid: &ConnectionId, side: Side) -> Keys {
        self.inner.initial_keys(dst_cid, side)
    }

    fn handshake_data(&self) -> Option<Box<dyn Any>> {
        self.inner.handshake_data()
    }

    fn peer_identity(&self) -> Option<Box<dyn Any>> {
        self.inner.peer_identity()
    }

    fn early_crypto(&self) -> Option<(Box<dyn crypto::HeaderKey>, Box<dyn PacketKey>)> {
        self.inner.early_crypto()
    }

    fn early_data_accepted(&self) -> Option<bool> {
        self.inner.early_data_accepted()
    }

    fn is_handshaking(&self) -> bool {
        self.inner.is_handshaking()
    }

    fn read_handshake(&mut self, buf: &[u8]) -> Result<bool, TransportError> {
        let Some(held) = self.held.as_mut() else {
            return self.inner.read_handshake(buf);
        };
        held.extend_from_slice(buf);
        let verdict = match hello_length(held) {
            Some(len) if held.len() >= len => server_name(&held[4..len])
                .map(|name| self.sites.site_for(name).is_some())
                // Not a ClientHello rustls can read: it says so itself.
                .unwrap_or(true),
            // Not whole yet: wait for more CRYPTO bytes.
            Some(_) if held.len() < MAX_HELLO => return Ok(false),
            _ => true,
        };
        let held = self.held.take().unwrap_or_default();
        if !verdict {
            return Err(TransportError {
                code: TransportErrorCode::crypto(UNRECOGNIZED_NAME),
                frame: None,
                reason: "no site has this server name".into(),
            });
        }
        self.inner.read_handshake(&held)
    }

    fn transport_parameters(&self) -> Result<Option<TransportParameters>, TransportError> {
        self.inner.transport_parameters()
    }

    fn write_handshake(&mut self, buf: &mut Vec<u8>) -> Option<Keys> {
        self.inner.write_handshake(buf)
    }

    fn next_1rtt_keys(&mut self) -> Option<KeyPair<Box<dyn PacketKey>>> {
        self.inner.next_1rtt_keys()
    }

    fn is_valid_retry(&self, orig_dst_cid: &ConnectionId, header: &[u8], payload: &[u8]) -> bool {
        self.inner.is_valid_retry(orig_dst_cid, header, payload)
    }

    fn export_keying_material(
        &self,
        output: &mut [u8],
        label: &[u8],
        context: &[u8],
    ) -> Result<(), ExportKeyingMaterialError> {
        self.inner.export_keying_material(output, label, context)
    }
}

/// The length of the handshake message starting `bytes` (its 4-byte header included) if it is
/// a ClientHello (type 1) whose header is there; `None` otherwise (not one, or too short to
/// tell: then `bytes` is shorter than 4 only).
fn hello_length(bytes: &[u8]) -> Option<usize> {
    match bytes {
        [1, a, b, c, ..] => {
            Some(4 + (usize::from(*a) << 16 | usize::from(*b) << 8 | usize::from(*c)))
        }
        [1] | [1, _] | [1, _, _] | [] => Some(usize::MAX),
        _ => None,
    }
}

/// The `server_name` of a ClientHello's body (after the handshake header): `Some(None)` when it
/// has none, `None` when the body does not parse.
fn server_name(body: &[u8]) -> Option<Option<&str>> {
    let mut r = Reader(body);
    r.take(2 + 32)?; // legacy_version, random
    let session = r.u8()?;
    r.take(usize::from(session))?;
    let suites = r.u16()?;
    r.take(usize::from(suites))?;
    let compression = r.u8()?;
    r.take(usize::from(compression))?;
    if r.0.is_empty() {
        return Some(None);
    }
    let len = r.u16()?;
    let mut ext = Reader(r.take(usize::from(len))?);
    while !ext.0.is_empty() {
        let kind = ext.u16()?;
        let len = ext.u16()?;
        let data = ext.take(usize::from(len))?;
        if kind == 0 {
            // server_name_list: one host_name (type 0) in practice.
            let mut list = Reader(data);
            let len = list.u16()?;
            let mut names = Reader(list.take(usize::from(len))?);
            while !names.0.is_empty() {
                let kind = names.u8()?;
                let len = names.u16()?;
                let name = names.take(usize::from(len))?;
                if kind == 0 {
                    return std::str::from_utf8(name).ok().map(Some);
                }
            }
            return Some(None);
        }
    }
    Some(None)
}

/// Bytes read from the front, each read checked against what is left.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let (head, rest) = (self.0.get(..n)?, self.0.get(n..)?);
        self.0 = rest;
        Some(head)
    }

    fn u8(&mut self) -> Option<u8> {
        self.take(1).map(|b| b[0])
    }

    fn u16(&mut self) -> Option<u16> {
        self.take(2).map(|b| u16::from_be_bytes([b[0], b[1]]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A ClientHello body with the given extensions (type, data).
    fn hello(extensions: &[(u16, Vec<u8>)]) -> Vec<u8> {
        let mut b = vec![3, 3];
        b.extend([7u8; 32]);
        b.extend([0]); // session id
        b.extend([0, 2, 0x13, 0x01]); // one suite
        b.extend([1, 0]); // null compression
        let mut ext = Vec::new();
        for (kind, data) in extensions {
            ext.extend(kind.to_be_bytes());
            ext.extend((data.len() as u16).to_be_bytes());
            ext.extend(data);
        }
        b.extend((ext.len() as u16).to_be_bytes());
        b.extend(ext);
        b
    }

    fn sni(name: &str) -> (u16, Vec<u8>) {
        let mut entry = vec![0];
        entry.extend((name.len() as u16).to_be_bytes());
        entry.extend(name.as_bytes());
        let mut data = (entry.len() as u16).to_be_bytes().to_vec();
        data.extend(entry);
        (0, data)
    }

    #[test]
    fn the_server_name_is_read_and_bad_bodies_refused() {
        assert_eq!(
            server_name(&hello(&[(10, vec![0, 0]), sni("a.test")])),
            Some(Some("a.test"))
        );
        assert_eq!(server_name(&hello(&[(10, vec![0, 0])])), Some(None));
        let body = hello(&[sni("a.test")]);
        for cut in 0..body.len() {
            assert_ne!(server_name(&body[..cut]), Some(Some("a.test")), "{cut}");
        }
        assert_eq!(hello_length(&[1, 0, 1, 0]), Some(260));
        assert_eq!(hello_length(&[1, 0]), Some(usize::MAX));
        assert_eq!(hello_length(&[2, 0, 0, 0]), None);
    }

    proptest::proptest! {
        /// Any bytes after a ClientHello's header: read or refused, never a panic.
        #[test]
        fn any_body_is_read_or_refused(body in proptest::collection::vec(proptest::num::u8::ANY, 0..600)) {
            let _ = server_name(&body);
            let _ = hello_length(&body);
        }
    }
}
