//! quinn endpoint and server configuration for a worker.
//!
//! This module owns the QUIC-level knobs and the keys every worker process must share so that
//! instances are interchangeable for a client: the stateless-reset key (any instance can reset a
//! connection of a dead sibling, RFC 9000 §10.3) and the address-validation token key (a Retry
//! or NEW_TOKEN token issued by one instance is accepted by any other, RFC 9000 §8.1). The
//! connection-ID generator comes from the caller (quic-lb), so this module never decides CIDs.
//! TLS lives in [`crate::tls`].

use std::sync::Arc;
use std::time::Duration;

use quinn::{ConnectionIdGenerator, EndpointConfig, IdleTimeout, TransportConfig, VarInt};

/// QUIC options of a worker's server endpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerOptions {
    /// Close a connection after this long without any packet (RFC 9000 §10.1). The effective
    /// timeout is the smaller of ours and the client's.
    pub idle_timeout: Duration,
    /// Concurrent request streams a client may open (`initial_max_streams_bidi`). Keep ≥ 100:
    /// browsers and load generators expect at least that (RFC 9114 §6.1 "SHOULD NOT be < 100").
    /// quinn keeps an entry for every stream the peer may open in two hash maps (the streams'
    /// send and receive halves) from the connection's start, and a map's table doubles when
    /// it is 7/8 full. 100 (quic-go's and Chromium's default) and [`MAX_UNI_STREAMS`] fit
    /// tables of 128 entries where 128 and 16 needed 256: 5 kB less per connection. Freed
    /// streams leave tombstones, so over a long connection a table may double once more:
    /// to 256 entries here, to 512 with 128 and 16.
    pub max_streams: u32,
}

/// Unidirectional streams a client may open (`initial_max_streams_uni`): HTTP/3 needs 3 per
/// side (control, QPACK encoder and decoder, RFC 9114 §6.2); the rest is room for reserved
/// (grease) stream types and extensions, within quinn's 128-entry tables with the default
/// [`ServerOptions::max_streams`].
pub const MAX_UNI_STREAMS: u32 = 8;

impl Default for ServerOptions {
    fn default() -> Self {
        ServerOptions {
            idle_timeout: Duration::from_secs(30),
            max_streams: 100,
        }
    }
}

/// Endpoint configuration with the reset key derived from the shared `reset_secret` and the
/// CID generator made by `cid_factory` (called once per endpoint).
pub fn endpoint_config(
    reset_secret: &[u8; 64],
    cid_factory: impl Fn() -> Box<dyn ConnectionIdGenerator> + Send + Sync + 'static,
) -> EndpointConfig {
    // quinn-proto implements `HmacKey` for `ring::hmac::Key`; the reset token is
    // HMAC-SHA256(key, cid), so every instance computes the same token for a CID.
    let reset_key = Arc::new(ring::hmac::Key::new(ring::hmac::HMAC_SHA256, reset_secret));
    let mut cfg = EndpointConfig::new(reset_key);
    cfg.cid_generator(cid_factory);
    cfg
}

/// Server configuration: `crypto` from [`crate::tls::server_crypto`], token key derived from
/// the shared `token_secret`, transport limits from `opts`.
pub fn server_config(
    crypto: Arc<dyn quinn::crypto::ServerConfig>,
    token_secret: &[u8; 64],
    opts: &ServerOptions,
) -> quinn::ServerConfig {
    // quinn-proto implements `HandshakeTokenKey` for `ring::hkdf::Prk`: each token is sealed
    // under a key expanded from this PRK with a random per-token nonce, so sharing the PRK is
    // all it takes for every instance to open every instance's tokens.
    let token_key =
        Arc::new(ring::hkdf::Salt::new(ring::hkdf::HKDF_SHA256, &[]).extract(token_secret));
    let mut cfg = quinn::ServerConfig::new(crypto, token_key);
    cfg.transport_config(Arc::new(transport_config(opts)));
    cfg
}

fn transport_config(opts: &ServerOptions) -> TransportConfig {
    let mut t = TransportConfig::default();
    t.max_concurrent_bidi_streams(VarInt::from_u32(opts.max_streams));
    t.max_concurrent_uni_streams(VarInt::from_u32(MAX_UNI_STREAMS));
    // An out-of-range timeout (beyond 2^62 ms) cannot be expressed: fall back to quinn's.
    if let Ok(idle) = IdleTimeout::try_from(opts.idle_timeout) {
        t.max_idle_timeout(Some(idle));
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_peers_streams_fit_quinns_smallest_tables() {
        // quinn-proto keeps an entry per stream the peer may open; a table of 128 entries
        // takes 112 (7/8) before it doubles (`ServerOptions::max_streams`).
        let max_streams = ServerOptions::default().max_streams;
        assert!(max_streams >= 100, "RFC 9114 §6.1 asks for at least 100");
        let peer = max_streams + MAX_UNI_STREAMS;
        assert!(
            peer <= 112,
            "{peer} streams need quinn's tables of 256 entries"
        );
    }

    #[test]
    fn configs_build_with_shared_keys() {
        let chain = crate::tls::CertChain::self_signed().unwrap();
        let crypto = crate::tls::server_crypto(&chain, &[1; 32]).unwrap();
        let _ = server_config(crypto, &[2; 64], &ServerOptions::default());
        let _ = endpoint_config(&[3; 64], || {
            Box::new(quinn_proto::RandomConnectionIdGenerator::new(8))
        });
    }
}
