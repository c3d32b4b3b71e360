//! Synthetic QUIC short-header datagrams whose Destination Connection IDs decode, with the
//! benchmark's key file, to a chosen instance: what a client of an established connection
//! sends. One [`Connection`] per sender socket, so every GSO train carries one CID (RFC 9000
//! §5.1: a peer picks the DCID; one 4-tuple is one connection here).

use std::path::Path;

use anyhow::{bail, Result};
use ringmux_quic_lb::{ConnectionIdGenerator, KeySet, QuicLbConfig, Route, Router};

/// Short-header form: fixed bit set, long-header bit clear (RFC 9000 §17.3.1).
const SHORT_HEADER: u8 = 0x40;

/// A connection the sender impersonates: the instance that owns it and its DCID.
#[derive(Clone, Debug)]
pub struct Connection {
    pub instance: u8,
    pub cid: Vec<u8>,
}

/// Writes fresh keys to `path` (mode 0600, as `KeySet::load` demands) and returns them.
pub fn write_key_file(path: &Path) -> Result<KeySet> {
    let keys = KeySet::generate().map_err(|e| anyhow::anyhow!("generating keys: {e}"))?;
    keys.write_new(path)?;
    Ok(keys)
}

/// ringmux's defaults: config 0, node ID `00`, 14-octet nonce (single-pass AES, 17-byte CIDs);
/// `plaintext`: as with `--plaintext-cids` (no encryption).
pub fn lb_config(keys: &KeySet, instances: u8, plaintext: bool) -> QuicLbConfig {
    QuicLbConfig {
        config_id: 0,
        node_id: vec![0],
        instance_count: instances,
        nonce_len: 14,
        key: (!plaintext).then_some(keys.quic_lb),
    }
}

/// `count` connections spread round-robin over the instances, each checked with the demux's
/// own [`Router`] so a key or configuration mismatch fails here and not as `bad_cid` later.
pub fn connections(
    keys: &KeySet,
    instances: u8,
    count: usize,
    plaintext: bool,
) -> Result<Vec<Connection>> {
    let cfg = lb_config(keys, instances, plaintext);
    let router =
        Router::new(&cfg, keys.routing_hash).map_err(|e| anyhow::anyhow!("QUIC-LB router: {e}"))?;
    let mut gens = (0..instances)
        .map(|i| ringmux_quic_lb::CidGenerator::new(&cfg, i, None))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| anyhow::anyhow!("QUIC-LB generator: {e}"))?;
    let mut out = Vec::with_capacity(count);
    for n in 0..count {
        let instance = (n % usize::from(instances)) as u8;
        let cid = gens[usize::from(instance)].generate_cid().to_vec();
        let mut probe = vec![SHORT_HEADER];
        probe.extend_from_slice(&cid);
        probe.resize(64, 0);
        if router.route(&probe) != Route::Owned(instance) {
            bail!("a generated CID does not route to its instance {instance}: key mismatch?");
        }
        out.push(Connection { instance, cid });
    }
    Ok(out)
}

/// Fills one datagram of `buf.len()` bytes: header byte (random low bits, as a real short
/// header's protected bits look), DCID, a sequence number, constant padding.
pub fn fill(buf: &mut [u8], cid: &[u8], seq: u64, rng: &mut XorShift) {
    buf[0] = SHORT_HEADER | (rng.next_u64() as u8 & 0x3f);
    let end = 1 + cid.len();
    buf[1..end].copy_from_slice(cid);
    if buf.len() >= end + 8 {
        buf[end..end + 8].copy_from_slice(&seq.to_le_bytes());
    }
}

/// A tiny xorshift64* generator: the header bits need to vary, not to be unpredictable.
pub struct XorShift(u64);

impl XorShift {
    pub fn new(seed: u64) -> Self {
        XorShift(seed | 1)
    }

    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connections_route_to_their_instance() {
        let keys = KeySet::generate().unwrap();
        let conns = connections(&keys, 3, 12, false).unwrap();
        let router = Router::new(&lb_config(&keys, 3, false), keys.routing_hash).unwrap();
        let mut rng = XorShift::new(7);
        for (n, c) in conns.iter().enumerate() {
            assert_eq!(c.cid.len(), 17);
            assert_eq!(c.instance as usize, n % 3);
            let mut d = vec![0xabu8; 1200];
            fill(&mut d, &c.cid, n as u64, &mut rng);
            assert_eq!(d[0] & 0xc0, 0x40);
            assert_eq!(router.route(&d), Route::Owned(c.instance));
        }
    }
}
