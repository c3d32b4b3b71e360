//! The parts of `ringmux`, the demux and supervisor, as a library so that each can be tested on
//! its own; `main.rs` composes them. See `ringmux --help` and README.md.
//!
//! * [`config`]: the command line and its checks.
//! * [`acme`]: certificates from an ACME CA, on a thread of their own.
//! * [`dataplane`]: the receive loop: route every datagram and hand it to its instance.
//! * [`admission`]: new connections under pressure: the demux's Retry, its tokens, and the
//!   per-source-prefix budget.
//! * [`dispatch`]: what becomes of one datagram (which lane, or which drop), decided without
//!   I/O.
//! * [`forward`]: the forwarding modes (`shm`, `unix`, `drop`), one file each behind one trait.
//! * [`supervisor`]: worker processes: start, hand off, watch, restart, drain.
//! * [`budget`]: how much of the demux's time each worker's messages may take.
//! * [`sessions`]: the TLS session cache all workers share.
//! * [`tickets`]: which instance may take which session: the ClientHellos' ticket IDs, read
//!   from the Initials the demux forwards.
//! * [`metrics`]: counters, the Prometheus endpoint, `ringmux stats`.
//! * [`certs`]: the certificate handed to the workers.
//! * [`sys`]: every system call of the demux, wrapped once.
//! * [`upgrade`]: `ringmux upgrade`, the demux replacing its own process image.
//! * [`alloc`]: the counting allocator behind `ringmux_dataplane_allocations_total`.
//! * [`logs`]: the log thread: the demux's own lines, its workers' output and access logs.
//! * [`lbconfig`]: `ringmux lb-config`, the rules of a load balancer in front of several boxes.
//! * [`options`]: option values both command lines parse (on/off, a node's QUIC-LB identity).
//!
//! The demux never links the worker library, quinn's connection layer or an HTTP server: what
//! it shares with workers is the contract crate `ringmux-proto`. Its one HTTP client is the
//! ACME engine's, on a thread of its own, talking to the CA only.
#![deny(unsafe_code)]
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(clippy::undocumented_unsafe_blocks)]

pub mod acme;
pub mod admission;
pub mod budget;
pub mod certs;
pub mod config;
pub mod dataplane;
pub mod dispatch;
pub mod forward;
pub mod lbconfig;
pub mod logs;
pub mod metrics;
pub mod options;
pub mod sessions;
pub mod supervisor;
pub mod sys;
pub mod tickets;
pub mod upgrade;

pub use sys::alloc;

/// `error` and each of its sources, joined by `: `, as anyhow's `{:#}` shows a chain: one line
/// for an operator where an error travels as text (a control client's answer, the reason an
/// upgrade was refused).
pub fn one_line(error: &dyn std::error::Error) -> String {
    let mut line = error.to_string();
    let mut source = error.source();
    while let Some(s) = source {
        line.push_str(": ");
        line.push_str(&s.to_string());
        source = s.source();
    }
    line
}
