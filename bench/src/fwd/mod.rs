//! The forwarding benchmark behind `fwd-bench`: ring (`shm`) vs Unix socket (`unix`) vs
//! receive-only (`drop`) forwarding in the demux, side by side in alternating rounds.
//!
//! * [`datagrams`]: routable QUIC short-header datagrams (QUIC-LB CIDs from a shared key file).
//! * [`sender`]: the load generator (many source ports, `sendmmsg` or UDP GSO trains).
//! * [`ringmux`]: starting a `ringmux --worker-mode sink`, parking it (SIGSTOP), scraping its
//!   Prometheus metrics and waiting for its counters to settle.
//! * [`os`]: the `/proc` readers (per-thread `schedstat`, `/proc/net/udp`) and the scheduling
//!   calls (affinity, SCHED_FIFO, signals). Every syscall of the harness lives here or in
//!   [`sender`].
//! * [`measure`]: one (round, mode) measurement, saturated (pre-fill then drain, as
//!   the C reference forwarder does) or live (a timed blast).
//! * [`reference`](mod@reference): building and running the C reference forwarder in the same alternation.
//! * [`report`]: per-mode summaries (median, min–max), ratios, the Markdown table, JSON and SVG.
//!
//! The harness never changes what it measures: it reads the demux's own counters and the
//! kernel's per-thread accounting, and only adds load through the sender.

pub mod datagrams;
pub mod measure;
pub mod os;
pub mod reference;
pub mod report;
pub mod ringmux;
pub mod sender;
