//! `ringmux-proto`: the contract between the ringmux demux and its workers, sans I/O.
//!
//! Both sides link this crate and nothing of each other: the demux never links the worker
//! library (nor quinn's HTTP stack), and a worker program written against `ringmux-worker`
//! speaks this contract through it. `control-protocol.md` at the repository root is the
//! normative description; `tests/doc.rs` holds the document and this code together.
//!
//! * `certs` (feature `certs`): the hand-off's certificate, read, checked or made, and
//!   parsed, the same way on both sides.
//! * [`health`]: the order of the health table's slots, from the site table, for both sides.
//! * [`handoff`]: the first message on the control socket, demux → worker: configuration
//!   and keys, with descriptors attached in a fixed order.
//! * [`header_field`]: a header field the configuration writes (a fixed response's, a header
//!   rule's), its name and value checked once, and the fields ringmux owns.
//! * [`limits`]: per-client limits of a site or route (`allow`, `deny`, `rate`), declared once.
//! * [`message`]: every later control message ([`Message`]), in both directions.
//! * `serve` (feature `serve-args`): the built-in worker's serving options, declared once
//!   for `ringmux` and `ringmux-worker`.
//! * [`route`]: what a route does, each kind and its limits declared once, read alike from
//!   the configuration file by the demux and from the site table by a worker.
//! * [`rules`]: what a site or route does around its content (header rules, HSTS, CORS,
//!   error pages, a single-page app's fallback), each value declared and checked once.
//! * [`series`]: the labelled counters and gauges of a `STATS` report, which any worker
//!   program names itself.
//! * [`session`]: the codec of the session-store socket (cross-instance TLS resumption).
//! * [`sites`]: the sites a worker serves (names, certificate, routes), which the demux hands
//!   every worker as JSON in a sealed memfd, and the lookup of a name among them.
//! * [`upstream`]: the built-in server's `--upstream` URL, checked alike by the demux (which
//!   refuses a bad one at start) and by the built-in `ringmux-worker` program, whose command
//!   line carries it.
//! * `x509` (feature `x509`): a leaf certificate's names and validity, for the demux's checks
//!   and the ACME client.
//!
//! This crate owns bytes only. It never opens, reads or writes a descriptor (but for `certs`,
//! which reads the operator's PEM files), and never knows QUIC or HTTP: sockets, `SCM_RIGHTS`
//! and polling live in each side's `sys` module.

#![deny(unsafe_code)]

#[cfg(feature = "certs")]
pub mod certs;
pub mod handoff;
pub mod header_field;
pub mod health;
pub mod limits;
#[cfg(feature = "logging")]
pub mod logging;
pub mod message;
pub mod route;
pub mod rules;
pub mod series;
#[cfg(feature = "serve-args")]
pub mod serve;
pub mod session;
pub mod sites;
pub mod upstream;
#[cfg(feature = "x509")]
pub mod x509;

pub use handoff::{generation_slot, Handoff, HandoffError, IngressKind, GENERATION_SLOTS};
pub use message::{
    ChallengeSet, Http01, Message, MessageError, SiteCertificate, TlsAlpn01, WorkerReport,
};
pub use upstream::{UpstreamError, UpstreamScheme, UpstreamUrl};

/// `error` and each of its sources joined by `: `, as anyhow's `{:#}` shows a chain, leaving
/// out a source whose text its error already wrote (hyper's and instant-acme's errors often
/// print their source too): one line for an operator where an error travels as text (a log
/// field, a control client's answer, the reason an upgrade or an order failed). The house's one
/// chain joiner.
pub fn one_line(error: &dyn std::error::Error) -> String {
    let mut line = error.to_string();
    let mut source = error.source();
    while let Some(s) = source {
        let text = s.to_string();
        if !line.contains(&text) {
            line.push_str(": ");
            line.push_str(&text);
        }
        source = s.source();
    }
    line
}

/// Version of the contract this build speaks. The demux writes it first in every hand-off and
/// a worker refuses any other (a demux and a worker from different builds may disagree on any
/// field, descriptor or message). Raise it with every incompatible change; `control-protocol.md`
/// says what each version changed.
pub const PROTOCOL_VERSION: u32 = 12;

/// Largest control message, either direction.
pub const MAX_MESSAGE: usize = 256 * 1024;

/// Largest `STATS` message a worker sends ([`WorkerReport::encode_rotating`]): site rows past it
/// wait for a later report. Below [`MAX_MESSAGE`], and below what Linux lets one packet of a
/// `SOCK_SEQPACKET` socket hold with the default send buffer (`net.core.wmem_default`, 208 KiB):
/// a larger one would fail to send whole.
pub const MAX_STATS: usize = 160 * 1024;

/// Largest site table a worker reads ([`sites`]): room for thousands of sites with their
/// certificate chains.
pub const MAX_SITE_TABLE: usize = 256 << 20;

/// How long `ringmux reload` waits, past the new generation's READY, for each worker it
/// replaced to send `STOPPED` ([`Message::Stopped`]) before it answers anyway.
pub const STOPPED_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// How long a worker told to cut ([`Message::Cut`]) has to end its requests, write their
/// access-log lines and exit before the demux kills it.
pub const CUT_WAIT: std::time::Duration = std::time::Duration::from_secs(3);

/// Most descriptors a hand-off places (at [`FIRST_HANDOFF_FD`] and on).
pub const MAX_FDS: usize = 8;

/// The descriptor number of a hand-off's first descriptor; the others follow it, in the order
/// of `control-protocol.md`, "Descriptors". The demux places them there before the worker
/// program starts, as it places [`CONTROL_FD`] and [`PUBLIC_FD`]: no descriptor ever arrives
/// in a worker after its `execve` (the demux's system-call filter refuses every receipt of
/// one), so no worker can get a second number for a descriptor the filter's rules name.
pub const FIRST_HANDOFF_FD: i32 = 8;

/// The descriptor number of the first of the rate tables (`ringmux_ring::tally`), when the site
/// table limits a rate: every worker of the generation finds its own table here, writable,
/// then every other worker's, read-only, one per instance in instance order from its own on
/// ([`RATE_TABLES_ENV`] gives how many). Placed by the demux after the hand-off's own (past
/// [`MAX_FDS`] of them), for the built-in server; a program of one's own may ignore them.
pub const RATE_TABLES_FD: i32 = FIRST_HANDOFF_FD + MAX_FDS as i32;

/// The most rate tables a worker is given: one per instance.
pub const MAX_RATE_TABLES: usize = 64;

/// Name of the environment variable in which the demux tells a worker how many rate tables
/// it finds from [`RATE_TABLES_FD`] on; unset when no site limits a rate.
pub const RATE_TABLES_ENV: &str = "RINGMUX_RATE_TABLES";

/// The descriptor number of the health table (`ringmux_ring::health`), when a route of the
/// site table checks its backends' health: the demux's verdict on each backend, which the
/// worker maps read-only (the memfd is sealed against writing). Placed after the rate tables'
/// numbers; [`HEALTH_TABLE_ENV`] says it is there.
pub const HEALTH_TABLE_FD: i32 = RATE_TABLES_FD + MAX_RATE_TABLES as i32;

/// Name of the environment variable set to `1` when the health table is at
/// [`HEALTH_TABLE_FD`]; unset when no route checks health.
pub const HEALTH_TABLE_ENV: &str = "RINGMUX_HEALTH_TABLE";

/// The descriptor number of the demux's listening TCP socket, when the hand-off's `tcp` is 1
/// (nothing is open there otherwise): one accept queue all workers share, created once by the
/// demux, so a worker's restart, a reload or an upgrade never refuses a connection. A worker
/// accepts on it and serves what it accepted; the filter refuses everything else on it.
pub const TCP_FD: i32 = 5;

/// The descriptor number of the demux's listening socket for plain HTTP, when the hand-off's
/// `redirect` is 1 (`--redirect-http`; nothing is open there otherwise): shared like
/// [`TCP_FD`], and every request on it is answered with a redirect to `https://`.
pub const REDIRECT_FD: i32 = 6;

/// The descriptor number of the access log, when the hand-off's `access_log` is 1
/// (`--access-log`; nothing is open there otherwise): a file the demux opened for appending, or
/// its standard error. Every worker shares it, writes whole lines and may not truncate it,
/// re-flag it or duplicate it.
pub const ACCESS_LOG_FD: i32 = 7;

/// Name of the environment variable in which the demux tells a worker the number of its
/// control socket (always 3 today). A process without it was not started by ringmux.
pub const CONTROL_FD_ENV: &str = "RINGMUX_CONTROL_FD";

/// Name of the environment variable in which the demux tells a worker the number of its
/// descriptor of the public socket.
pub const PUBLIC_FD_ENV: &str = "RINGMUX_PUBLIC_FD";

/// The descriptor number at which every worker finds its sending socket ([`PUBLIC_FD_ENV`]),
/// bound to the public address. Fixed, and placed by the demux before the worker program
/// starts, so that the demux's system-call filter can name it: a worker may send on it, never
/// receive on it, duplicate it or change it.
pub const PUBLIC_FD: i32 = 4;

/// The descriptor number of the control socket ([`CONTROL_FD_ENV`]).
pub const CONTROL_FD: i32 = 3;
