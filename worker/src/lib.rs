//! `ringmux-worker`: run your own quinn (or h3) server as the instances behind one ringmux
//! port.
//!
//! ringmux's demux receives every datagram on the public UDP port and hands each one to the
//! instance that owns its connection, through a shared-memory ring. An instance is any program
//! that ringmux starts (`ringmux --worker-cmd 'PROGRAM ARGS'`) and that calls
//! [`Worker::attach`]: it gets a ready [`quinn::Endpoint`] fed by its ring, with the connection
//! IDs, keys and session store every instance must share, and a signal for when to drain.
//!
//! ```no_run
//! use ringmux_worker::Worker;
//!
//! fn main() -> Result<(), Box<dyn std::error::Error>> {
//!     let worker = Worker::attach()?; // fails with a clear message outside ringmux
//!     let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
//!     rt.block_on(async {
//!         let tls = worker.tls_config(&[b"echo"])?; // the operator's certificate, your ALPN
//!         let endpoint = worker.endpoint(worker.server_config(tls)?)?;
//!         let mut drain = worker.drain_signal();
//!         loop {
//!             let incoming = tokio::select! {
//!                 i = endpoint.accept() => i,
//!                 _ = drain.wait() => None,
//!             };
//!             let Some(incoming) = incoming else { break };
//!             tokio::spawn(async move {
//!                 let Ok(conn) = incoming.await else { return };
//!                 while let Ok((mut send, mut recv)) = conn.accept_bi().await {
//!                     let _ = tokio::io::copy(&mut recv, &mut send).await;
//!                     let _ = send.finish();
//!                 }
//!             });
//!         }
//!         endpoint.close(0u32.into(), b"draining");
//!         endpoint.wait_idle().await;
//!         Ok(())
//!     })
//! }
//! ```
//!
//! `worker/examples/` has this echo server and a small h3 application; [`Worker`]'s docs say
//! what the library shares between instances and what stays the application's.
//!
//! The modules below are the library; ringmux's own built-in server (HTTP/3 and HTTPS over
//! TCP, static files, the reverse proxy, the benchmark sink) is built on them in the
//! `ringmux-server` package, which also makes the `ringmux-worker` program:
//!
//! * [`attach`]: [`Worker`], the attachment to the demux.
//! * [`tls`]: certificate chain, shared session-ticket key, rustls server config; the sites'
//!   certificates ([`tls::SiteCerts`]), one table that QUIC and TCP share, whose ACME sites'
//!   certificates the demux replaces at run time.
//! * [`acme`]: the ACME challenges pending now ([`AcmeAnswers`], [`Worker::acme_answers`]),
//!   which the TCP listeners answer (HTTP-01, TLS-ALPN-01) and QUIC never does.
//! * [`quic`]: quinn endpoint/server configuration with the keys shared by all instances.
//! * [`socket`]: [`socket::RingSocket`], a quinn `AsyncUdpSocket` over a ringmux ingress.
//! * [`ingress`]: where datagrams come from (ring or unix socket), and the unix framing decoder.
//! * [`counters`]: the program's own counters and gauges ([`Worker::counter`]), which ringmux
//!   exposes as `ringmux_worker_NAME_total{instance,…}`.
//! * [`control`]: the worker's end of the control socket (messages from `ringmux-proto`).
//! * [`sessions`]: the TLS session store every instance shares, held by the demux.
//!
//! Every system call of this crate is wrapped once, in a private module (`sys`, the only one
//! allowed unsafe code); [`cpu_time`] and [`poll_readable`] are the two a worker that reads its
//! ingress itself needs.
#![deny(unsafe_code)]
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(clippy::undocumented_unsafe_blocks)]

pub mod acme;
pub mod attach;
pub mod control;
pub mod counters;
pub mod health_table;
pub mod ingress;
pub mod quic;
pub mod rate_tables;
pub mod sessions;
pub mod sni;
pub mod socket;
#[allow(unsafe_code)]
mod sys;
pub mod tls;

pub use acme::AcmeAnswers;
pub use attach::{Accepting, AttachError, Drain, RawParts, Worker};
pub use counters::{Counter, Gauge};
pub use ringmux_proto::series::SeriesError;
pub use sys::{cpu_time, poll_readable};

// The contract and the CID codec must agree on how many generations a CID tells apart.
const _: () = assert!(ringmux_proto::GENERATION_SLOTS == ringmux_quic_lb::GENERATION_SLOTS);
