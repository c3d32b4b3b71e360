//! `ringmux-server`: ringmux's built-in server, and the `ringmux-worker` program ringmux starts
//! by default. Built on the `ringmux-worker` library like any other application behind
//! ringmux: it attaches to the demux, serves HTTP/3 on the endpoint the library hands it, and
//! HTTPS over TCP on the listener the demux shares.
//!
//! The core answers requests whatever the transport, and imports no front:
//!
//! * [`request`]: what a request names (authority, cleaned path).
//! * [`reply`]: what it is answered with (`Reply`, its body), the built-ins and the
//!   file replies.
//! * [`sites`]: the worker's sites ready to serve ([`sites::Router`]; one site alone:
//!   [`sites::Site`]): which site a request belongs to (421 when its connection's certificate
//!   is another site's) and which route answers it.
//! * [`compress`]: response compression (gzip, brotli, zstd): negotiation, coders.
//! * `rules`: header rules, HSTS, CORS and error pages around every response.
//! * [`files`]: static files under a document root (openat2, cache, RFC 9110 validators).
//! * [`proxy`]: the reverse proxy to an HTTP/1.1 upstream (`--upstream`), one exchange for
//!   every transport.
//! * [`limits`]: per-client limits before a route answers (`allow`/`deny`: 403, rates: 429).
//! * [`access_log`]: one line per request, written off the request path.
//! * [`stats`]: the server's counters, each declared once, and how they go into a `STATS`
//!   report.
//!
//! One front per transport on top of it:
//!
//! * [`h3`]: HTTP/3 on the endpoint the library hands the worker.
//! * [`tcp`]: HTTPS over TCP (HTTP/1.1 and HTTP/2 by ALPN) with `alt-svc`.
//! * [`redirect`]: the plain-HTTP listener's redirects and HTTP-01 answers, on `tcp`'s
//!   connection handling.
//!
//! Beside them, [`options`]: the `ringmux-worker` program's command line, which ringmux fills
//! from its own options when it runs the built-in worker; [`sink`]: the count-only benchmark
//! worker (no quinn); and their owner, [`Server`] ([`server`]): `Server::new(worker,
//! options).run()` wires the sites, the access log, the report and the fronts of one worker.
//!
//! Safe code only, but for the one system call tokio does not make for the TCP front
//! (`tcp::sys`).
#![deny(unsafe_code)]
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(clippy::undocumented_unsafe_blocks)]

pub mod access_log;
pub mod compress;
pub mod files;
pub mod h3;
pub mod limits;
pub mod options;
pub mod proxy;
pub mod redirect;
pub mod reply;
pub mod request;
pub(crate) mod rules;
pub mod server;
pub mod sink;
pub mod sites;
pub mod stats;
pub mod tcp;

pub use server::{Server, ServerError};
