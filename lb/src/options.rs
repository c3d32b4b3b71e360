//! Option values that both command lines parse, `ringmux`'s (its configuration, in the demux)
//! and `ringmux lb-config`'s ([`crate`]): an on/off switch and a node's QUIC-LB identity.
//! Imports nothing of the crate.

/// An on/off setting.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Toggle {
    On,
    Off,
}

/// A node ID as `--node-id` takes it: hex bytes, at least one, with or without `0x` (so that
/// an 8-byte QUIC server ID written `0x` + 16 hex digits is taken as it is). `None` if it is
/// not that.
pub fn node_id_bytes(text: &str) -> Option<Vec<u8>> {
    let text = text.trim();
    let digits = text
        .strip_prefix("0x")
        .or_else(|| text.strip_prefix("0X"))
        .unwrap_or(text);
    hex::decode(digits).ok().filter(|b| !b.is_empty())
}

/// The nonce length when `--nonce-len` is not given, for a node ID of `node_id_len` bytes: the
/// server ID (node ID and instance byte) and the nonce fill one AES block (16 bytes, single-pass
/// encryption, 17-byte CIDs); past a 11-byte node ID, the shortest nonce (4 bytes). Every node
/// behind one balancer, and `ringmux lb-config`, derive it the same way.
pub fn default_nonce_len(node_id_len: usize) -> u8 {
    let server_id = node_id_len + 1;
    match 16usize.checked_sub(server_id) {
        Some(n) if n >= ringmux_quic_lb::MIN_NONCE_LEN => n as u8,
        _ => ringmux_quic_lb::MIN_NONCE_LEN as u8,
    }
}
