//! `http1-upstream`: the HTTP/1.1 service of the proxy benchmark, to run behind
//! `ringmux --upstream http://ADDR`. Its paths are listed in `ringmux_testkit::upstream`
//! (`/hello`, `/bytes/N`, `/sha256`, `/headers`, …). Runs until SIGINT or SIGTERM.

use std::net::SocketAddr;

use anyhow::{Context, Result};
use clap::Parser;
use ringmux_testkit::upstream::Upstream;

/// An HTTP/1.1 test service (hyper) for `ringmux --upstream`.
#[derive(Parser, Debug)]
#[command(version, about, long_about = None)]
struct Args {
    /// Address to listen on.
    #[arg(
        long,
        env = "RINGMUX_BENCH_UPSTREAM_LISTEN",
        default_value = "127.0.0.1:8080"
    )]
    listen: SocketAddr,
    /// Runtime threads (1: a current-thread runtime).
    #[arg(long, env = "RINGMUX_BENCH_UPSTREAM_THREADS", default_value_t = 1)]
    threads: usize,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let up = Upstream::start(args.listen, args.threads)
        .with_context(|| format!("listening on --listen {}", args.listen))?;
    println!("http1-upstream listening on http://{}", up.addr());
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        tokio::select! {
            r = tokio::signal::ctrl_c() => r?,
            _ = term.recv() => {}
        }
        anyhow::Ok(())
    })?;
    println!("http1-upstream: {} requests", up.stats().requests());
    Ok(())
}
