//! `ringmux-worker`: ringmux's built-in instance. Started by the `ringmux` demux (never by
//! hand), it attaches with [`Worker::attach`] and serves HTTP/3 from one quinn endpoint, and
//! with `--tcp on` HTTPS over TCP from the demux's listener, on a current-thread tokio
//! runtime: each request by the route of its site (static files, the built-in `/hello.txt`
//! and `/bytes/N`, the proxy to an HTTP/1.1 service, redirects, fixed responses); the worker's
//! own `--root` or `--upstream` set the routes of the command line's site. It drains gracefully when the
//! demux asks (or on SIGTERM) and exits at once if the demux goes away. With `--sink`
//! (ringmux's `--worker-mode sink`) it drains its ring and counts, for benchmarks. How it
//! serves is its command line ([`Options`], which ringmux fills from its own options of the
//! same names); the rest comes in the hand-off. [`Server`] does all of it.
#![deny(unsafe_code)]

use std::process::ExitCode;

use clap::Parser;
use ringmux_server::options::Options;
use ringmux_server::Server;
use ringmux_worker::Worker;

fn main() -> ExitCode {
    let options = Options::parse();
    ringmux_proto::logging::init();
    let served = Worker::attach()
        .map_err(anyhow::Error::from)
        .and_then(|worker| Ok(Server::new(worker, options).run()?));
    match served {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("worker failed: {e:#}");
            ExitCode::FAILURE
        }
    }
}
