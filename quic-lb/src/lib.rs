//! `ringmux-quic-lb`: the contract between the demux and the workers about who owns a datagram.
//!
//! - [`CidGenerator`] (worker side) issues QUIC-LB connection IDs
//!   (draft-ietf-quic-load-balancers-21) whose plaintext block is
//!   `node_id ‖ instance ‖ nonce`, so an external QUIC-LB load balancer configured with the
//!   node-ID length routes to the right box and the demux, reading one byte more, to the right
//!   process.
//! - [`Header`] (demux side) reads a datagram's QUIC packet header once, with the
//!   bounds-checked [`Reader`] and its varint: the one parser of QUIC headers that routing,
//!   admission and the demux's ClientHello inspector share.
//! - [`Router`] (demux side) decides [`Route::Owned`], [`Route::Hashed`] or
//!   [`Route::Malformed`] for a datagram, as a pure function of the Destination Connection ID
//!   [`Header`] read, without allocating.
//! - [`KeySet`] holds the secrets all instances share, generated or loaded from a key file.
//! - [`CidCodec`] is the draft's codec itself (plaintext, single-pass AES, four-pass Feistel).
//!
//! This crate knows nothing of sockets, rings or processes.

#![deny(unsafe_op_in_unsafe_fn)]
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod codec;
mod config;
mod generator;
mod header;
mod keys;
mod router;

pub use codec::{
    CidCodec, EncodeError, Plaintext, ServerId, MAX_CID_LEN, MAX_PLAINTEXT_LEN, MIN_NONCE_LEN,
    SINGLE_PASS_LEN, UNROUTABLE_CONFIG_ID,
};
pub use config::{
    server_id_byte, ConfigError, Mode, QuicLbConfig, GENERATION_SLOTS, MAX_CONFIG_ID,
    MAX_INSTANCES, MAX_NODE_ID_LEN,
};
pub use generator::CidGenerator;
pub use header::{Header, LongHeader, MalformedReason, PacketType, Reader, QUIC_V1, QUIC_V2};
pub use keys::{KeyError, KeyFileError, KeySet, BINARY_LEN as KEYSET_BINARY_LEN};
pub use router::{Route, RouteCache, Router};

/// Re-exported so users name the same trait and types this crate implements.
pub use quinn_proto::{ConnectionId, ConnectionIdGenerator, InvalidCid};
