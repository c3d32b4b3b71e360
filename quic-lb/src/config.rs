//! The QUIC-LB configuration shared by the demux and every worker, and its validation.
//!
//! This module owns the parameters (config rotation codepoint, node ID, instance count, nonce
//! length, key) and the draft's limits on them. It never touches the network or the OS: a
//! [`QuicLbConfig`] that passes [`QuicLbConfig::validate`] is all the codec, the generator and
//! the router need.

/// Longest QUIC v1 connection ID (RFC 9000 §17.2).
pub const MAX_CID_LEN: usize = 20;
/// Longest plaintext block: server ID + nonce "MUST sum to 19 octets or less" (draft-21 §5.2).
pub const MAX_PLAINTEXT_LEN: usize = MAX_CID_LEN - 1;
/// Shortest nonce the draft allows (draft-21 §5.2).
pub const MIN_NONCE_LEN: usize = 4;
/// Plaintext length at which the draft mandates single-pass encryption (draft-21 §5.4.1).
pub const SINGLE_PASS_LEN: usize = 16;

/// Highest usable config rotation codepoint: `0b111` means "unroutable" (draft-21 §3.1).
pub const MAX_CONFIG_ID: u8 = 6;
/// Longest node ID: server ID (node ID + 1 instance byte) + the shortest nonce must fit in 19 octets.
pub const MAX_NODE_ID_LEN: usize = MAX_PLAINTEXT_LEN - MIN_NONCE_LEN - 1;

/// Worker generations a server-ID byte tells apart: its top two bits carry the generation's
/// slot, so up to four generations of one instance (one serving, up to three draining) own
/// connections at once and the demux routes each to its own worker without any table.
pub const GENERATION_SLOTS: u8 = 4;
/// Most instances per node: the server-ID byte's low six bits carry the instance number.
pub const MAX_INSTANCES: u8 = 64;

/// The byte after the node ID in every CID's server ID: `slot << 6 | instance`.
///
/// `instance` must be below [`MAX_INSTANCES`] and `slot` below [`GENERATION_SLOTS`]; higher bits
/// are masked off.
#[inline]
pub const fn server_id_byte(instance: u8, slot: u8) -> u8 {
    (slot % GENERATION_SLOTS) << 6 | (instance % MAX_INSTANCES)
}

/// How this box encodes connection IDs (draft-ietf-quic-load-balancers-21).
///
/// The plaintext block of every CID is `node_id ‖ instance ‖ nonce`. An external QUIC-LB load
/// balancer is configured with `server-id-length = node_id.len()` (the instance byte is part of
/// its nonce) and routes to this box; the demux decodes one byte more and routes to the instance.
/// All boxes behind one load balancer share `config_id`, the node-ID length, `nonce_len` and
/// `key`, and differ in `node_id`.
#[derive(Clone, PartialEq, Eq)]
pub struct QuicLbConfig {
    /// Config rotation codepoint, the top 3 bits of every CID: `0..=6`.
    pub config_id: u8,
    /// This box's server ID as the external load balancer knows it: 1 or more opaque bytes.
    pub node_id: Vec<u8>,
    /// Number of worker instances on this box: `1..=64` ([`MAX_INSTANCES`]); instance numbers are
    /// `0..instance_count`.
    pub instance_count: u8,
    /// Nonce octets per CID: at least 4, and server ID + nonce at most 19.
    pub nonce_len: u8,
    /// AES-128 key; `None` selects the draft's plaintext (unencrypted) mode.
    pub key: Option<[u8; 16]>,
}

/// Which of the draft's algorithms a configuration selects.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Mode {
    /// No key: the server ID is readable by anyone.
    Plaintext,
    /// Key and server ID + nonce = 16 octets: one AES-128-ECB block (draft-21 §5.4.1).
    SinglePass,
    /// Key and any other length: four-round Feistel network over AES-128-ECB (draft-21 §5.4.2).
    FourPass,
}

/// A configuration value outside what the draft or ringmux allows. Each variant names the field,
/// the value and the accepted range.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// `config_id` is the unroutable codepoint or does not fit in 3 bits.
    #[error("config_id = {value}: must be 0..=6 (0b111 is the draft's \"unroutable\" codepoint)")]
    ConfigId {
        /// The rejected value.
        value: u8,
    },
    /// `node_id` is empty or leaves no room for the instance byte and a 4-octet nonce.
    #[error(
        "node_id is {len} bytes: must be 1..={max} bytes (server ID = node_id + 1 instance \
         byte; server ID + nonce must be at most 19 octets, nonce at least 4)"
    )]
    NodeIdLength {
        /// The rejected length.
        len: usize,
        /// The longest allowed node ID.
        max: usize,
    },
    /// `instance_count` is 0.
    #[error(
        "instance_count = {value}: must be 1..=64 (the server-ID byte after the node ID holds 6 \
         bits of instance and 2 of worker generation)"
    )]
    InstanceCount {
        /// The rejected value.
        value: u8,
    },
    /// `nonce_len` is below the draft's minimum or makes the CID longer than 20 octets.
    #[error(
        "nonce_len = {value}: must be {min}..={max} with a {node_id_len}-byte node_id (server \
         ID + nonce must be at most 19 octets)"
    )]
    NonceLength {
        /// The rejected value.
        value: u8,
        /// The shortest allowed nonce.
        min: usize,
        /// The longest allowed nonce for this node-ID length.
        max: usize,
        /// The node-ID length the maximum was computed from.
        node_id_len: usize,
    },
    /// A generator was asked for an instance number the configuration does not have.
    #[error("instance = {value}: must be 0..{instance_count} (below instance_count)")]
    Instance {
        /// The rejected instance number.
        value: u8,
        /// The configured instance count.
        instance_count: u8,
    },
    /// A server-ID length passed to [`crate::CidCodec::new`] is out of range.
    #[error("server_id_len = {value}: must be 1..={max} (server ID + nonce at most 19 octets)")]
    ServerIdLength {
        /// The rejected length.
        value: usize,
        /// The longest allowed server ID for the given nonce length.
        max: usize,
    },
    /// The OS random number generator failed while seeding a nonce counter.
    #[error("the OS random number generator failed: {0}")]
    Randomness(getrandom::Error),
}

impl QuicLbConfig {
    /// Checks every field against the draft's limits (draft-21 §5.2) and ringmux's own
    /// (instance byte in the server ID, `1..=64` instances).
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.config_id > MAX_CONFIG_ID {
            return Err(ConfigError::ConfigId {
                value: self.config_id,
            });
        }
        let node_id_len = self.node_id.len();
        if node_id_len == 0 || node_id_len > MAX_NODE_ID_LEN {
            return Err(ConfigError::NodeIdLength {
                len: node_id_len,
                max: MAX_NODE_ID_LEN,
            });
        }
        if self.instance_count == 0 || self.instance_count > MAX_INSTANCES {
            return Err(ConfigError::InstanceCount {
                value: self.instance_count,
            });
        }
        let max_nonce = MAX_PLAINTEXT_LEN - self.server_id_len();
        let nonce_len = usize::from(self.nonce_len);
        if !(MIN_NONCE_LEN..=max_nonce).contains(&nonce_len) {
            return Err(ConfigError::NonceLength {
                value: self.nonce_len,
                min: MIN_NONCE_LEN,
                max: max_nonce,
                node_id_len,
            });
        }
        Ok(())
    }

    /// Length of every CID this configuration issues: `1 + node_id.len() + 1 + nonce_len`.
    ///
    /// This is the fixed length the demux uses to cut the DCID out of a short header, and what
    /// quinn must be told through [`quinn_proto::ConnectionIdGenerator::cid_len`].
    pub fn cid_len(&self) -> usize {
        1 + self.server_id_len() + usize::from(self.nonce_len)
    }

    /// The default: config 0, one-byte node ID `0`, one instance, and a 14-octet nonce so that
    /// server ID + nonce = 16 octets (single-pass AES, 17-byte CIDs). Set `instance_count` to the
    /// number of workers before use.
    pub fn default_with_key(key: [u8; 16]) -> Self {
        Self {
            config_id: 0,
            node_id: vec![0],
            instance_count: 1,
            nonce_len: (SINGLE_PASS_LEN - 2) as u8,
            key: Some(key),
        }
    }

    /// Server ID length in octets: the node ID plus the instance byte.
    pub fn server_id_len(&self) -> usize {
        self.node_id.len() + 1
    }

    /// The algorithm this configuration selects.
    pub fn mode(&self) -> Mode {
        match self.key {
            None => Mode::Plaintext,
            Some(_) if self.server_id_len() + usize::from(self.nonce_len) == SINGLE_PASS_LEN => {
                Mode::SinglePass
            }
            Some(_) => Mode::FourPass,
        }
    }
}

/// Hand-written so that the key never reaches a log line.
impl std::fmt::Debug for QuicLbConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QuicLbConfig")
            .field("config_id", &self.config_id)
            .field("node_id", &hex::encode(&self.node_id))
            .field("instance_count", &self.instance_count)
            .field("nonce_len", &self.nonce_len)
            .field("key", &self.key.map(|_| "<redacted>"))
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base() -> QuicLbConfig {
        QuicLbConfig::default_with_key([7; 16])
    }

    #[test]
    fn default_is_single_pass_17_bytes() {
        let c = base();
        c.validate().unwrap();
        assert_eq!(c.cid_len(), 17);
        assert_eq!(c.mode(), Mode::SinglePass);
    }

    #[test]
    fn errors_name_the_field() {
        let mut c = base();
        c.config_id = 7;
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("config_id = 7") && e.contains("0..=6"), "{e}");

        let mut c = base();
        c.node_id.clear();
        let e = c.validate().unwrap_err().to_string();
        assert!(
            e.contains("node_id is 0 bytes") && e.contains("1..=14"),
            "{e}"
        );

        let mut c = base();
        c.node_id = vec![0; 15];
        assert!(matches!(
            c.validate(),
            Err(ConfigError::NodeIdLength { len: 15, max: 14 })
        ));

        let mut c = base();
        c.instance_count = 0;
        let e = c.validate().unwrap_err().to_string();
        assert!(
            e.contains("instance_count = 0") && e.contains("1..=64"),
            "{e}"
        );

        let mut c = base();
        c.nonce_len = 3;
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("nonce_len = 3") && e.contains("4..=17"), "{e}");

        let mut c = base();
        c.node_id = vec![1, 2, 3];
        c.nonce_len = 16;
        assert!(matches!(
            c.validate(),
            Err(ConfigError::NonceLength {
                value: 16,
                max: 15,
                ..
            })
        ));
    }

    #[test]
    fn limits_are_inclusive() {
        let mut c = base();
        c.config_id = 6;
        c.node_id = vec![9; 14];
        c.nonce_len = 4;
        c.instance_count = MAX_INSTANCES;
        c.validate().unwrap();
        c.instance_count = MAX_INSTANCES + 1;
        assert!(c.validate().unwrap_err().to_string().contains("1..=64"));
        c.instance_count = MAX_INSTANCES;
        assert_eq!(c.cid_len(), 20);
        c.key = None;
        assert_eq!(c.mode(), Mode::Plaintext);
        c.key = Some([0; 16]);
        assert_eq!(c.mode(), Mode::FourPass);
    }

    #[test]
    fn debug_hides_the_key() {
        let s = format!("{:?}", base());
        assert!(s.contains("redacted") && !s.contains("7, 7"), "{s}");
    }
}
