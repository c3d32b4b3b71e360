//! `ringmux-worker`: ringmux's built-in instance. Started by the `ringmux` demux (never by
//! hand), it attaches with [`Worker::attach`] and serves HTTP/3 from one quinn endpoint, and
//! with `--tcp on` HTTPS over TCP from the demux's listener, on a current-thread tokio
//! runtime: each request by the route of its site (static files, the built-in `/hello.txt`
//! and `/bytes/N`, the proxy to an HTTP/1.1 service, redirects, fixed responses); the worker's
//! own `--root` or `--upstream` set the routes of the command line's site. It drains gracefully when the
//! demux asks (or on SIGTERM) and exits at once if the demux goes away. With `--sink` (ringmux's
//! `--worker-mode sink`) it drains its ring and counts, for benchmarks. How it serves is its
//! command line ([`Options`], which ringmux fills from its own options of the same names); the
//! rest comes in the hand-off.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Parser;
use ringmux_server::access_log::{AccessLog, Ending};
use ringmux_server::h3::{serve_with, HttpOptions};
use ringmux_server::options::Options;
use ringmux_server::proxy::ErrorKind as ProxyErrorKind;
use ringmux_server::sink;
use ringmux_server::sites::{with_command_line, Router, RouterOptions};
use ringmux_server::stats::ServerStats;
use ringmux_server::tcp::TcpOptions;
use ringmux_worker::tls::ALPN_H3;
use ringmux_worker::Worker;

/// Longest a drained worker waits for its last connections after the HTTP/3 server returned
/// (the demux enforces its own `--grace` on top).
const DRAIN_WAIT: Duration = Duration::from_secs(60);

/// Longest a cut worker waits for its connections' closes to be sent.
const CLOSE_WAIT: Duration = Duration::from_millis(300);

/// Longest a worker on its way out waits for its access-log lines to be written: within the
/// time the demux gives a worker told to cut (`ringmux_proto::CUT_WAIT`).
const EXIT_FLUSH: Duration = Duration::from_secs(2);

fn main() {
    let options = Options::parse();
    ringmux_proto::logging::init();
    if let Err(e) = run(options) {
        tracing::error!("worker failed: {e:#}");
        std::process::exit(1);
    }
}

fn run(options: Options) -> Result<()> {
    let worker = Worker::attach()?;
    let _span = tracing::info_span!("worker", instance = worker.instance()).entered();
    if options.sink {
        tracing::info!("sink running");
        let raw = worker.into_raw().context("sink")?;
        let source = match raw.ingress {
            Some(ingress) => sink::Source::Ingress(ingress),
            None => sink::Source::Socket(raw.socket),
        };
        return sink::run(source, raw.router, raw.lane, raw.control).context("sink");
    }
    let access_log = match worker.access_log() {
        Some(file) => Some(
            AccessLog::start(file, worker.instance())
                .context("starting the access log's thread")?,
        ),
        None => None,
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let served = rt.block_on(serve(worker, options, access_log.clone()));
    // Whatever still runs (requests of a cut, or of a worker leaving for another reason) ends
    // with the runtime: each request's line is written as its task drops, then flushed.
    if let Some(log) = &access_log {
        log.ending_all(Ending::CutWorkerExit);
    }
    drop(rt);
    if let Some(log) = &access_log {
        log.flush(EXIT_FLUSH);
    }
    served
}

async fn serve(worker: Worker, options: Options, access_log: Option<Arc<AccessLog>>) -> Result<()> {
    // The endpoint's transport (idle timeout) is the library's; the demux sends the Retries.
    let opts = HttpOptions::default();
    let tls = worker.tls_config(&[ALPN_H3])?;
    let endpoint = worker.endpoint(worker.server_config(tls)?)?;
    let stats = Arc::new(ServerStats::default());
    // The sites the demux handed over; this program's own --root or --upstream (a program of
    // `ringmux --worker-cmd`) replace the routes of the command line's site.
    let table = with_command_line(
        worker.sites().clone(),
        options.root.as_deref(),
        options.upstream.as_ref(),
    );
    let router = Router::new(
        &table,
        &RouterOptions {
            max_bytes: options.serve.max_bytes,
            files: options.file_options(),
            upstream_timeout: options.upstream_timeout(),
            access_log: access_log.clone(),
        },
    )
    .context("opening the sites' routes")?;
    let reported = stats.clone();
    let reported_router = router.clone();
    let reported_log = access_log.clone();
    worker.set_report(move |r| {
        reported.report(r);
        // Every series each time, 0 or not, as every key was before they were series.
        let (written, dropped) = reported_log
            .as_ref()
            .map_or((0, 0), |log| (log.written(), log.dropped()));
        let _ = r.set_counter("access_log_lines", &[], written);
        let _ = r.set_counter("access_log_dropped", &[], dropped);
        for (kind, v) in ProxyErrorKind::ALL
            .iter()
            .zip(reported_router.upstream_errors())
        {
            let _ = r.set_counter("upstream_errors", &[("kind", kind.as_str())], v);
        }
        // The rows are the table's sites in its order, then no site's: the indices the demux
        // knows them by (`control-protocol.md`, "STATS keys by site").
        for (site, row) in (0u32..).zip(reported.sites.snapshot()) {
            let row = row.report_row();
            if row.iter().any(|v| *v != 0) {
                r.sites.insert(site, row);
            }
        }
    });
    tracing::info!(sites = ?router.labels().collect::<Vec<_>>(), "serving");
    // HTTPS over TCP beside HTTP/3 (`--tcp on`), through the same site.
    let mut https_port = None;
    let tcp = match worker.tcp_listener() {
        Some(listener) => {
            https_port = Some(listener.local_addr()?.port());
            let listener = tokio::net::TcpListener::from_std(listener)
                .context("registering the TCP listener")?;
            let tls = Arc::new(worker.tcp_tls_config()?);
            let alt_svc = match worker.alt_svc() {
                Some(v) => Some(
                    http::HeaderValue::from_str(v)
                        .with_context(|| format!("the hand-off's alt_svc {v:?}"))?,
                ),
                None => None,
            };
            tracing::info!("serving HTTPS over TCP too");
            Some(ringmux_server::tcp::serve(
                listener,
                tls,
                router.clone(),
                stats.clone(),
                worker.drain_signal().into_receiver(),
                TcpOptions {
                    alt_svc,
                    max_connections: options.serve.tcp_max_connections as usize,
                    idle_timeout: options.tcp_idle_timeout(),
                    accepting: Some(Arc::new(worker.accepting())),
                    acme: worker.acme_answers().clone(),
                    ..TcpOptions::default()
                },
            ))
        }
        None => None,
    };
    // Plain HTTP answered with redirects to the HTTPS port (`--redirect-http`).
    let redirects = match (worker.redirect_listener(), https_port) {
        (Some(listener), Some(port)) => {
            let listener = tokio::net::TcpListener::from_std(listener)
                .context("registering the plain-HTTP listener")?;
            tracing::info!("answering plain HTTP with redirects to HTTPS");
            Some(ringmux_server::redirect::serve_redirects(
                listener,
                port,
                router.clone(),
                stats.clone(),
                worker.drain_signal().into_receiver(),
                TcpOptions {
                    max_connections: options.serve.tcp_max_connections as usize,
                    idle_timeout: options.tcp_idle_timeout(),
                    accepting: Some(Arc::new(worker.accepting())),
                    acme: worker.acme_answers().clone(),
                    ..TcpOptions::default()
                },
            ))
        }
        _ => None,
    };
    let h3 = serve_with(
        endpoint.clone(),
        router,
        stats,
        worker.drain_signal().into_receiver(),
        &opts,
    );
    // Told to cut (the drain's bound is over), the serving stops where it is: every request
    // still in flight is dropped, and its access-log line says `cut:drain`.
    let mut cut = worker.cut_signal();
    tokio::select! {
        _ = async { tokio::join!(h3, optional(tcp), optional(redirects)) } => {}
        () = cut.wait() => {
            if let Some(log) = &access_log {
                log.ending_all(Ending::CutDrain);
            }
            tracing::warn!("told to cut: ending every request still in flight");
            endpoint.close(0u32.into(), b"cut");
            // Long enough for the CONNECTION_CLOSE frames to go out (clients then see the cut
            // at once rather than at their idle timeout), well within CUT_WAIT.
            let _ = tokio::time::timeout(CLOSE_WAIT, endpoint.wait_idle()).await;
            return Ok(());
        }
    }
    let _ = tokio::time::timeout(DRAIN_WAIT, endpoint.wait_idle()).await;
    if let Some(log) = &access_log {
        log.flush(DRAIN_WAIT);
    }
    tracing::info!("drained; exiting");
    Ok(())
}

/// Runs `f`, if there is one.
async fn optional(f: Option<impl std::future::Future<Output = ()>>) {
    if let Some(f) = f {
        f.await
    }
}
