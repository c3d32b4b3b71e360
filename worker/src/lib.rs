//! ringmux worker library: the pieces a worker process composes around its quinn endpoint.
//!
//! * [`tls`]: certificate chain, shared session-ticket key, rustls server config.
//! * [`quic`]: quinn endpoint/server configuration with the keys shared by all instances.
//! * [`http`]: the HTTP/3 server loop, the static [`http::Site`], server counters.
//! * [`socket`]: [`socket::RingSocket`], a quinn `AsyncUdpSocket` over a ringmux ingress.
//! * [`ingress`]: where datagrams come from (ring or unix socket), and the unix framing decoder.
//! * [`control`]: the worker's end of the control socket (messages from `ringmux-proto`).
//! * [`sessions`]: the TLS session store every instance shares, held by the demux.
//! * [`sink`]: the count-only benchmark worker (no quinn).
//! * [`sys`]: every system call of this crate, wrapped once.
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(clippy::undocumented_unsafe_blocks)]

pub mod control;
pub mod http;
pub mod ingress;
pub mod quic;
pub mod sessions;
pub mod sink;
pub mod socket;
pub mod sys;
pub mod tls;
