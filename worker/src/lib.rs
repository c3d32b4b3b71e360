//! ringmux worker library: the pieces a worker process composes around its quinn endpoint.
//!
//! * [`tls`]: certificate chain, shared session-ticket key, rustls server config.
//! * [`quic`]: quinn endpoint/server configuration with the keys shared by all instances.
//! * [`http`]: the HTTP/3 server loop, the static [`http::Site`], server counters.
//! * [`files`]: static files under a document root (openat2, cache, RFC 9110 validators).
//! * [`socket`]: [`socket::RingSocket`], a quinn `AsyncUdpSocket` over a ringmux ingress.
//! * [`control`]: the hand-off and control messages between the demux and a worker.
//! * [`sink`]: the count-only benchmark worker (no quinn).
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(clippy::undocumented_unsafe_blocks)]

pub mod control;
pub mod files;
pub mod http;
pub mod quic;
pub mod sessions;
pub mod sink;
pub mod socket;
pub mod tls;
