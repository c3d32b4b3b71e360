//! ringmux benchmarks and load generators.
//!
//! * [`client`]: an HTTP/3 client (quinn + h3) for `h3-probe` and end-to-end tests.
//! * [`upstream`]: an HTTP/1.1 service (hyper) to put behind `ringmux --upstream`.
//! * [`stats`]: latency histograms, error counts and the JSON report of `h3-probe`.
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(clippy::undocumented_unsafe_blocks)]

pub mod client;
pub mod fwd;
pub mod stats;
pub mod tcp_client;
pub mod upstream;
