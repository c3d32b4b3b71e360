//! The parts of `ringmux`, the demux and supervisor, as a library so that each can be tested on
//! its own; `main.rs` composes them. See `ringmux --help`, README.md and docs/. The folders, from the
//! data plane down to the system calls:
//!
//! * [`dataplane`]: the receive loop: route every datagram and hand it to its instance; in its
//!   folder, re-exported here:
//!   * [`dispatch`]: what becomes of one datagram (which lane, or which drop), decided without
//!     I/O.
//!   * [`admission`]: new connections under pressure: the demux's Retry, its tokens, and the
//!     per-source-prefix budget.
//!   * [`tickets`]: which instance may take which session: the ClientHellos' ticket IDs, read
//!     from the Initials the demux forwards.
//!   * [`forward`]: the forwarding modes (`shm`, `unix`, `drop`, `reuseport`), one file each
//!     behind one trait; the lanes they forward to; what crosses `ringmux upgrade` per lane.
//! * The control plane:
//!   * [`supervisor`]: worker processes: start, hand off, watch, restart, drain, decided apart
//!     from their effects; the workers' system-call filter; the operator's control socket; the
//!     ACME engine's certificates to the workers.
//!   * [`budget`]: how much of the demux's time each worker's messages may take.
//!   * [`sessions`]: the TLS session cache all workers share.
//!   * [`logs`]: the log thread: the demux's own lines, its workers' output and access logs.
//!   * [`certs`]: the certificate handed to the workers, and what a leaf certificate says.
//!   * The ACME client is a crate of its own, `ringmux-acme`, run on a thread of its own; the
//!     supervisor relays what it publishes.
//! * [`upgrade`]: `ringmux upgrade`, the demux replacing its own process image.
//! * [`metrics`]: counters, which lanes are up, the Prometheus endpoint, `ringmux stats`: the
//!   crate `ringmux-metrics`, re-exported here.
//! * The command line (folder `cli/`, private; re-exported here):
//!   * [`config`]: the command line, the configuration file and their checks.
//!   * `ringmux lb-config`, the rules of a load balancer in front of several boxes, and the
//!     option values both command lines parse (on/off, a node's QUIC-LB identity), are the
//!     crate `ringmux-lb`, re-exported as [`lbconfig`] and [`options`].
//! * [`sys`]: every system call of the demux, wrapped once, one file per topic, and the
//!   counting allocator behind `ringmux_dataplane_allocations_total` ([`alloc`], re-exported
//!   here). The only module allowed unsafe code; it imports nothing of the crate above it.
//!
//! The demux never links the worker library, quinn's connection layer or an HTTP server: what
//! it shares with workers is the contract crate `ringmux-proto`. Its one HTTP client is the
//! ACME engine's, on a thread of its own, talking to the CA only.
//!
//! The modules are layered: each imports only modules below it (and the crates beneath the
//! demux, `ringmux-metrics` among them), bottom to top `sys`; `certs`; `budget`, `logs`;
//! `dataplane` (inside it `tickets`, `admission`, `dispatch`, `forward`, then the loop);
//! `sessions`; `cli` (`config`, over the crate `ringmux-lb`); `upgrade`; `supervisor`
//! (which reads a [`config::Config`], at start and at every reload); and `main.rs`.
//! `scripts/mod-graph.py` prints which imports which and fails on a circle or a mutual import
//! (CI runs it).
#![deny(unsafe_code)]
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(clippy::undocumented_unsafe_blocks)]

pub mod budget;
pub mod certs;
mod cli;
pub mod dataplane;
pub mod logs;
pub mod sessions;
pub mod supervisor;
pub mod sys;
pub mod upgrade;

pub use cli::config;
pub use dataplane::{admission, dispatch, forward, tickets};
pub use ringmux_lb as lbconfig;
pub use ringmux_lb::options;
pub use ringmux_metrics as metrics;
pub use sys::alloc;

pub use ringmux_proto::one_line;
