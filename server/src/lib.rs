//! `ringmux-server`: ringmux's built-in server, and the `ringmux-worker` program ringmux starts
//! by default. Built on the `ringmux-worker` library like any other application behind
//! ringmux: it attaches to the demux, serves HTTP/3 on the endpoint the library hands it, and
//! HTTPS over TCP on the listener the demux shares.
//!
//! * [`http`]: the HTTP/3 server loop, the one-site [`http::Site`], server counters.
//! * [`sites`]: the worker's sites ready to serve ([`sites::Router`]): which site a request
//!   belongs to (421 when its connection's certificate is another site's) and which route
//!   answers it.
//! * [`tcp`]: HTTPS over TCP (HTTP/1.1 and HTTP/2 by ALPN) with `alt-svc`, and the plain-HTTP
//!   redirects.
//! * [`files`]: static files under a document root (openat2, cache, RFC 9110 validators).
//! * [`proxy`]: the reverse proxy to an HTTP/1.1 upstream (`--upstream`), for both transports.
//! * [`access_log`]: one line per request, written off the request path.
//! * [`options`]: the `ringmux-worker` program's command line, which ringmux fills from its own
//!   options when it runs the built-in worker.
//! * [`sink`]: the count-only benchmark worker (no quinn).
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(clippy::undocumented_unsafe_blocks)]

pub mod access_log;
pub mod files;
pub mod http;
pub mod options;
pub mod proxy;
pub mod sink;
pub mod sites;
pub mod tcp;
