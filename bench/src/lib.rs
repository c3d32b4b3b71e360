//! ringmux benchmarks and load generators; the clients they drive are the test kit's
//! (`ringmux_testkit::client`, `ringmux_testkit::upstream`).
//!
//! * [`fwd`]: the forwarding benchmark (`fwd-bench`): ringmux against the C reference.
//! * [`stats`]: latency histograms, error counts and the JSON report of `h3-probe`.
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(clippy::undocumented_unsafe_blocks)]

pub mod fwd;
pub mod stats;
