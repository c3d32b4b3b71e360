//! The worker side: a quinn [`ConnectionIdGenerator`] that issues QUIC-LB CIDs carrying this
//! node and instance, and recognises them again in `validate`.
//!
//! This module owns nonce management (draft-21 §9.7 "Connection ID Entropy"): one counter per
//! generator, started at a random value and never reused under one key. It calls the OS only in
//! [`CidGenerator::new`] (to seed the counter); generating a CID is pure arithmetic and AES.

use std::time::Duration;

use aes::cipher::KeyInit;
use aes::Aes128;
use quinn_proto::{ConnectionId, ConnectionIdGenerator, InvalidCid};

use crate::codec::{permute, CidCodec, MAX_CID_LEN, MAX_PLAINTEXT_LEN, UNROUTABLE_CONFIG_ID};
use crate::config::{ConfigError, Mode, QuicLbConfig};

/// Issues the CIDs of one instance on one node (plug into quinn with
/// `EndpointConfig::cid_generator(move || Box::new(CidGenerator::new(&cfg, i, life).unwrap()))`).
///
/// Every CID is `first octet ‖ E(node_id ‖ slot << 6 | instance ‖ nonce)`, where `slot` is the
/// worker generation's slot ([`crate::server_id_byte`]). The instance byte inside the
/// plaintext keeps the ciphertexts of instances that share a key distinct even if their nonce
/// counters overlap (draft-21 §"Server Process Demultiplexing"). Not `Clone`: two copies would
/// issue the same nonces.
///
/// Nonces: with a key, the nonce is a big-endian counter of `nonce_len` octets started at a
/// random value (draft-21 §9.7). Without a key (plaintext mode) the draft requires nonces with
/// "no observable relationship" to earlier ones, so the counter is passed through a keyed
/// permutation with a generator-local random AES key: unique and unlinkable. When the counter
/// has gone all the way round (2^32 CIDs with a 4-octet nonce), the draft says a server "MUST
/// ... use the 4-tuple routing config rotation codepoint": the generator then issues `0b111`
/// CIDs, which the demux routes by hash, not to this instance. Watch
/// [`CidGenerator::nonces_remaining`] and rotate the configuration well before that.
pub struct CidGenerator {
    codec: CidCodec,
    /// node_id ‖ server_id_byte(instance, slot).
    server_id: [u8; MAX_PLAINTEXT_LEN],
    node_id_len: usize,
    instance: u8,
    counter: NonceCounter,
    /// Generator-local key: masks plaintext-mode nonces and fills unroutable CIDs.
    local: Aes128,
    lifetime: Option<Duration>,
}

/// A big-endian counter over `len` octets that knows how many values are left before it would
/// repeat its random start.
struct NonceCounter {
    value: [u8; MAX_PLAINTEXT_LEN],
    /// The value most recently handed out.
    last: [u8; MAX_PLAINTEXT_LEN],
    len: usize,
    remaining: u128,
}

impl CidGenerator {
    /// A generator for `instance` (which must be below `config.instance_count`); `lifetime` is
    /// handed to quinn as [`ConnectionIdGenerator::cid_lifetime`] (`Some(d)`: quinn retires and
    /// replaces CIDs every `d`).
    pub fn new(
        config: &QuicLbConfig,
        instance: u8,
        lifetime: Option<Duration>,
    ) -> Result<Self, ConfigError> {
        Self::in_slot(config, instance, 0, lifetime)
    }

    /// A generator for `instance` of the worker generation in `slot` (below
    /// [`crate::GENERATION_SLOTS`]; taken modulo it): the demux routes its CIDs to that
    /// generation's worker, beside the other generations' workers of the same instance.
    pub fn in_slot(
        config: &QuicLbConfig,
        instance: u8,
        slot: u8,
        lifetime: Option<Duration>,
    ) -> Result<Self, ConfigError> {
        config.validate()?;
        if instance >= config.instance_count {
            return Err(ConfigError::Instance {
                value: instance,
                instance_count: config.instance_count,
            });
        }
        let codec = CidCodec::new(
            config.config_id,
            config.server_id_len(),
            usize::from(config.nonce_len),
            config.key,
        )?;
        let node_id_len = config.node_id.len();
        let mut server_id = [0u8; MAX_PLAINTEXT_LEN];
        server_id[..node_id_len].copy_from_slice(&config.node_id);
        server_id[node_id_len] = crate::server_id_byte(instance, slot);

        let mut seed = [0u8; 16 + MAX_PLAINTEXT_LEN];
        getrandom::fill(&mut seed).map_err(ConfigError::Randomness)?;
        let (local_key, start) = seed.split_at(16);
        let local_key: [u8; 16] = local_key.try_into().unwrap_or([0; 16]);
        let len = codec.nonce_len();
        let mut value = [0u8; MAX_PLAINTEXT_LEN];
        value[..len].copy_from_slice(&start[..len]);
        let remaining = 1u128.checked_shl(8 * len as u32).unwrap_or(u128::MAX);

        Ok(Self {
            codec,
            server_id,
            node_id_len,
            instance,
            counter: NonceCounter {
                value,
                last: [0; MAX_PLAINTEXT_LEN],
                len,
                remaining,
            },
            local: Aes128::new(&local_key.into()),
            lifetime,
        })
    }

    /// The instance number this generator writes into every CID.
    pub fn instance(&self) -> u8 {
        self.instance
    }

    /// The codec in use (config ID, lengths, mode).
    pub fn codec(&self) -> &CidCodec {
        &self.codec
    }

    /// CIDs left before the nonce counter would repeat (`2^(8 * nonce_len)` at start, saturating
    /// at `u128::MAX` for nonces of 16 octets or more). At 0 the generator issues unroutable (`0b111`) CIDs.
    pub fn nonces_remaining(&self) -> u128 {
        self.counter.remaining
    }

    /// Whether `cid` decodes to this node and this instance under this configuration. A
    /// restarted worker with the same instance number therefore accepts its predecessor's CIDs
    /// and answers them with stateless resets (with the shared reset key).
    pub fn is_own(&self, cid: &[u8]) -> bool {
        match self.codec.decode_server_id(cid) {
            Some(sid) => sid[..] == self.server_id[..=self.node_id_len],
            None => false,
        }
    }

    fn next_cid(&mut self) -> ConnectionId {
        let sid_len = self.node_id_len + 1;
        let Some(nonce) = self.counter.next() else {
            return self.unroutable_cid();
        };
        let mut nonce_bytes = [0u8; MAX_PLAINTEXT_LEN];
        let n = nonce.len();
        nonce_bytes[..n].copy_from_slice(nonce);
        if self.codec.mode() == Mode::Plaintext {
            permute(&self.local, &mut nonce_bytes[..n]);
        }
        match self
            .codec
            .encode(&self.server_id[..sid_len], &nonce_bytes[..n])
        {
            Ok(cid) => cid,
            // Unreachable: both lengths come from the same validated configuration.
            Err(_) => self.unroutable_cid(),
        }
    }

    /// `0b111 ‖ length` followed by a keyed permutation of `server ID ‖ counter`: unique, and
    /// unlinkable without the generator-local key (draft-21 §3.1 "Configuration Failover").
    fn unroutable_cid(&mut self) -> ConnectionId {
        let cid_len = self.codec.cid_len();
        let sid_len = self.node_id_len + 1;
        let mut cid = [0u8; MAX_CID_LEN];
        cid[0] = (UNROUTABLE_CONFIG_ID << 5) | (cid_len - 1) as u8;
        cid[1..=sid_len].copy_from_slice(&self.server_id[..sid_len]);
        let nonce = self.counter.step();
        cid[1 + sid_len..cid_len].copy_from_slice(nonce);
        permute(&self.local, &mut cid[1..cid_len]);
        ConnectionId::new(&cid[..cid_len])
    }
}

impl ConnectionIdGenerator for CidGenerator {
    fn generate_cid(&mut self) -> ConnectionId {
        self.next_cid()
    }

    /// Accepts only CIDs that decode to this node and instance, so quinn answers nothing else
    /// with a stateless reset (quinn consults this only for short headers of unknown
    /// connections, `quinn-proto` 0.11 `Endpoint::stateless_reset`).
    fn validate(&self, cid: &ConnectionId) -> Result<(), InvalidCid> {
        if self.is_own(cid) {
            Ok(())
        } else {
            Err(InvalidCid)
        }
    }

    fn cid_len(&self) -> usize {
        self.codec.cid_len()
    }

    fn cid_lifetime(&self) -> Option<Duration> {
        self.lifetime
    }
}

impl std::fmt::Debug for CidGenerator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CidGenerator")
            .field("codec", &self.codec)
            .field("node_id", &hex::encode(&self.server_id[..self.node_id_len]))
            .field("instance", &self.instance)
            .field("nonces_remaining", &self.counter.remaining)
            .field("lifetime", &self.lifetime)
            .finish_non_exhaustive()
    }
}

impl NonceCounter {
    /// The next unused nonce, or `None` once every value has been issued.
    fn next(&mut self) -> Option<&[u8]> {
        if self.remaining == 0 {
            return None;
        }
        if self.remaining != u128::MAX {
            self.remaining -= 1;
        }
        Some(self.step())
    }

    /// Returns the current value and increments it (big-endian, wrapping within `len` octets).
    fn step(&mut self) -> &[u8] {
        self.last = self.value;
        for byte in self.value[..self.len].iter_mut().rev() {
            let (v, carry) = byte.overflowing_add(1);
            *byte = v;
            if !carry {
                break;
            }
        }
        &self.last[..self.len]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counter(start: &[u8]) -> NonceCounter {
        let mut value = [0u8; MAX_PLAINTEXT_LEN];
        value[..start.len()].copy_from_slice(start);
        NonceCounter {
            value,
            last: [0; MAX_PLAINTEXT_LEN],
            len: start.len(),
            remaining: 3,
        }
    }

    #[test]
    fn counter_carries_wraps_and_stops() {
        let mut c = counter(&[0x00, 0xff, 0xfe]);
        assert_eq!(c.next().unwrap(), &[0x00, 0xff, 0xfe]);
        assert_eq!(c.next().unwrap(), &[0x00, 0xff, 0xff]);
        assert_eq!(c.next().unwrap(), &[0x01, 0x00, 0x00]);
        assert!(c.next().is_none());
        let mut c = counter(&[0xff, 0xff]);
        c.next();
        assert_eq!(c.next().unwrap(), &[0x00, 0x00]);
    }

    #[test]
    fn exhausted_generator_issues_unroutable_cids() {
        let mut cfg = QuicLbConfig::default_with_key([1; 16]);
        cfg.instance_count = 2;
        let mut g = CidGenerator::new(&cfg, 1, None).unwrap();
        assert_eq!(g.nonces_remaining(), 1 << 112, "14-octet nonce");
        g.counter.remaining = 1;
        let cid = g.generate_cid();
        assert_eq!(cid[0] >> 5, 0, "last routable CID");
        assert!(g.is_own(&cid));
        let cid = g.generate_cid();
        assert_eq!(cid.len(), 17);
        assert_eq!(cid[0], 0xe0 | 16, "0b111 and self-encoded length");
        assert!(!g.is_own(&cid));
        assert_ne!(cid, g.generate_cid(), "unroutable CIDs still differ");
    }

    #[test]
    fn four_octet_nonce_capacity() {
        let mut cfg = QuicLbConfig::default_with_key([1; 16]);
        cfg.nonce_len = 4;
        let g = CidGenerator::new(&cfg, 0, Some(Duration::from_secs(60))).unwrap();
        assert_eq!(g.nonces_remaining(), 1 << 32);
        assert_eq!(g.cid_lifetime(), Some(Duration::from_secs(60)));
        assert_eq!(g.cid_len(), 7);
    }

    #[test]
    fn instance_must_be_below_count() {
        let mut cfg = QuicLbConfig::default_with_key([1; 16]);
        cfg.instance_count = 4;
        let e = CidGenerator::new(&cfg, 4, None).unwrap_err().to_string();
        assert!(e.contains("instance = 4") && e.contains("0..4"), "{e}");
    }

    #[test]
    fn validate_accepts_only_own_node_and_instance() {
        let mut cfg = QuicLbConfig::default_with_key([9; 16]);
        cfg.instance_count = 3;
        let mut a = CidGenerator::new(&cfg, 0, None).unwrap();
        let mut b = CidGenerator::new(&cfg, 1, None).unwrap();
        let mut other_node = cfg.clone();
        other_node.node_id = vec![1];
        let mut c = CidGenerator::new(&other_node, 0, None).unwrap();
        let (ca, cb, cc) = (a.generate_cid(), b.generate_cid(), c.generate_cid());
        assert!(a.validate(&ca).is_ok());
        assert!(a.validate(&cb).is_err());
        assert!(a.validate(&cc).is_err());
        assert!(b.validate(&cb).is_ok());
        assert!(a.validate(&ConnectionId::new(&[0; 8])).is_err());
        assert!(a.validate(&ConnectionId::new(&[])).is_err());
    }

    #[test]
    fn plaintext_nonces_are_masked_but_server_id_is_clear() {
        let mut cfg = QuicLbConfig::default_with_key([0; 16]);
        cfg.key = None;
        cfg.node_id = vec![0xab, 0xcd];
        cfg.instance_count = 8;
        cfg.nonce_len = 6;
        let mut g = CidGenerator::new(&cfg, 5, None).unwrap();
        let x = g.generate_cid();
        let y = g.generate_cid();
        assert_eq!(&x[..4], &[0x09, 0xab, 0xcd, 5]);
        assert_eq!(&y[..4], &[0x09, 0xab, 0xcd, 5]);
        // A raw counter would differ only in the last octet(s); the mask spreads the change.
        let differing = x[4..].iter().zip(&y[4..]).filter(|(p, q)| p != q).count();
        assert!(differing >= 3, "{x:?} {y:?}");
        assert!(g.validate(&x).is_ok());
    }
}
