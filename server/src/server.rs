//! The built-in server's owner: [`Server`] takes an attached [`Worker`] and the program's
//! [`Options`] and serves until the demux drains or cuts it. It wires the sites' [`Router`],
//! the access log, the counters' report to the demux ([`Reporting`]) and one front per
//! transport the hand-off gave (HTTP/3 always, HTTPS over TCP with `--tcp on`, the plain-HTTP
//! redirects with `--redirect-http`), or the benchmark sink (`--sink`) instead of them all.
//!
//! It owns the worker's lifetime, not what any front does: the fronts serve until the drain
//! signal and return once their connections ended; this module bounds what follows (the
//! endpoint's last closes, the access log's last lines) and carries out a cut.

use std::future::Future;
use std::io;
use std::sync::Arc;
use std::time::Duration;

use ringmux_worker::tls::ALPN_H3;
use ringmux_worker::{AttachError, Worker};

use crate::access_log::{AccessLog, Ending};
use crate::h3::{serve_with, HttpOptions};
use crate::options::Options;
use crate::sink;
use crate::sites::{with_command_line, Router, RouterError, RouterOptions};
use crate::stats::{Reporting, ServerStats};
use crate::tcp::TcpOptions;

/// Longest a drained worker waits for its last connections after the HTTP/3 server returned
/// (the demux enforces its own `--grace` on top).
const DRAIN_WAIT: Duration = Duration::from_secs(60);

/// Longest a cut worker waits for its connections' closes to be sent.
const CLOSE_WAIT: Duration = Duration::from_millis(300);

/// Longest a worker on its way out waits for its access-log lines to be written: within the
/// time the demux gives a worker told to cut (`ringmux_proto::CUT_WAIT`).
const EXIT_FLUSH: Duration = Duration::from_secs(2);

/// The built-in server of one worker: `Server::new(worker, options).run()`.
pub struct Server {
    worker: Worker,
    options: Options,
}

/// Why the server could not start or serve.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// The worker's TLS, endpoint or raw parts could not be set up from the hand-off.
    #[error("setting up the worker")]
    Worker(#[from] AttachError),
    #[error("opening the sites' routes")]
    Routes(#[from] RouterError),
    #[error("starting the access log's thread")]
    AccessLog(#[source] io::Error),
    #[error("building the tokio runtime")]
    Runtime(#[source] io::Error),
    /// A listener the demux handed over could not be used.
    #[error("registering the {what} listener")]
    Listener {
        what: &'static str,
        #[source]
        error: io::Error,
    },
    #[error("the hand-off's alt_svc {value:?} is not a header value")]
    AltSvc {
        value: String,
        #[source]
        error: http::header::InvalidHeaderValue,
    },
    #[error("the sink")]
    Sink(#[source] io::Error),
    #[error("the rate tables the demux handed over")]
    RateTables(#[from] ringmux_worker::rate_tables::RateTablesError),
    #[error("the health table the demux handed over")]
    HealthTable(#[from] ringmux_worker::health_table::HealthTableUseError),
}

impl Server {
    pub fn new(worker: Worker, options: Options) -> Server {
        Server { worker, options }
    }

    /// Serves until the demux drains this worker (or SIGTERM does) and every connection ended,
    /// or until it is told to cut; then writes what the access log still holds. The sink
    /// (`--sink`) runs until the control socket closes or says `SHUTDOWN`.
    pub fn run(self) -> Result<(), ServerError> {
        let Server { worker, options } = self;
        let _span = tracing::info_span!("worker", instance = worker.instance()).entered();
        if options.sink {
            return run_sink(worker);
        }
        let access_log = match worker.access_log() {
            Some(file) => {
                let format = options.serve.access_log_format;
                let log = AccessLog::start(file, worker.instance(), format);
                Some(log.map_err(ServerError::AccessLog)?)
            }
            None => None,
        };
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(ServerError::Runtime)?;
        let served = rt.block_on(serve(worker, options, access_log.clone()));
        // Whatever still runs (requests of a cut, or of a worker leaving for another reason)
        // ends with the runtime: each request's line is written as its task drops, then
        // flushed.
        if let Some(log) = &access_log {
            log.ending_all(Ending::CutWorkerExit);
        }
        drop(rt);
        if let Some(log) = &access_log {
            log.flush(EXIT_FLUSH);
        }
        served
    }
}

/// The benchmark sink in place of the server: it drains the worker's ring (or its own socket)
/// and counts.
fn run_sink(worker: Worker) -> Result<(), ServerError> {
    tracing::info!("sink running");
    let raw = worker.into_raw()?;
    let source = match raw.ingress {
        Some(ingress) => sink::Source::Ingress(ingress),
        None => sink::Source::Socket(raw.socket),
    };
    sink::run(source, raw.router, raw.lane, raw.control).map_err(ServerError::Sink)
}

async fn serve(
    worker: Worker,
    options: Options,
    access_log: Option<Arc<AccessLog>>,
) -> Result<(), ServerError> {
    // The endpoint's transport (idle timeout) is the library's; the demux sends the Retries.
    let tls = worker.tls_config(&[ALPN_H3])?;
    let endpoint = worker.endpoint(worker.server_config(tls)?)?;
    let stats = Arc::new(ServerStats::default());
    let router = routes(&worker, &options, access_log.clone())?;
    let reporting = Reporting {
        stats: stats.clone(),
        router: router.clone(),
        access_log: access_log.clone(),
    };
    worker.set_report(move |r| reporting.fill(r));
    tracing::info!(sites = ?router.labels().collect::<Vec<_>>(), "serving");
    let (tcp, redirects) = tcp_fronts(&worker, &options, &router, &stats)?;
    let h3_options = HttpOptions::default();
    let h3 = serve_with(
        endpoint.clone(),
        router,
        stats,
        worker.drain_signal().into_receiver(),
        &h3_options,
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

/// The sites the demux handed over, opened; this program's own `--root` or `--upstream` (a
/// program of `ringmux --worker-cmd`) replace the routes of the command line's site.
fn routes(
    worker: &Worker,
    options: &Options,
    access_log: Option<Arc<AccessLog>>,
) -> Result<Router, ServerError> {
    let table = with_command_line(
        worker.sites().clone(),
        options.root.as_deref(),
        options.upstream.as_ref(),
    );
    let opts = RouterOptions {
        max_bytes: options.serve.max_bytes,
        files: options.file_options(),
        upstream_timeout: options.upstream_timeout(),
        access_log,
        rate_tables: ringmux_worker::rate_tables::inherited()?.map(Arc::new),
        health_table: ringmux_worker::health_table::inherited()?.map(Arc::new),
    };
    Ok(Router::new(&table, &opts)?)
}

/// HTTPS over TCP beside HTTP/3 (`--tcp on`), through the same sites, and plain HTTP answered
/// with redirects to the HTTPS port (`--redirect-http`): the fronts the hand-off has listeners
/// for, on one set of [`TcpOptions`].
#[allow(clippy::type_complexity)]
fn tcp_fronts(
    worker: &Worker,
    options: &Options,
    router: &Router,
    stats: &Arc<ServerStats>,
) -> Result<
    (
        Option<impl Future<Output = ()>>,
        Option<impl Future<Output = ()>>,
    ),
    ServerError,
> {
    let Some(listener) = worker.tcp_listener() else {
        return Ok((None, None));
    };
    let mut tunnels = crate::proxy::TunnelOptions::new(
        options.serve.max_tunnels as usize,
        std::time::Duration::from_secs(options.serve.tunnel_idle),
    );
    if let Some(drain) = options.tunnel_drain() {
        tunnels = tunnels.with_drain(drain, worker.drain_signal().into_receiver());
    }
    let opts = TcpOptions {
        max_connections: options.serve.tcp_max_connections as usize,
        idle_timeout: options.tcp_idle_timeout(),
        proxy_protocol_from: options.serve.proxy_protocol_from.clone(),
        accepting: Some(Arc::new(worker.accepting())),
        acme: worker.acme_answers().clone(),
        tunnels: Arc::new(tunnels),
        ..TcpOptions::default()
    };
    let registered = |what, listener| {
        tokio::net::TcpListener::from_std(listener)
            .map_err(|error| ServerError::Listener { what, error })
    };
    let https_port = listener
        .local_addr()
        .map_err(|error| ServerError::Listener { what: "TCP", error })?
        .port();
    let alt_svc = match worker.alt_svc() {
        Some(v) => Some(
            http::HeaderValue::from_str(v).map_err(|error| ServerError::AltSvc {
                value: v.to_owned(),
                error,
            })?,
        ),
        None => None,
    };
    tracing::info!("serving HTTPS over TCP too");
    let tcp = crate::tcp::serve(
        registered("TCP", listener)?,
        Arc::new(worker.tcp_tls_config()?),
        router.clone(),
        stats.clone(),
        worker.drain_signal().into_receiver(),
        TcpOptions {
            alt_svc,
            ..opts.clone()
        },
    );
    let redirects = match worker.redirect_listener() {
        Some(listener) => {
            let listener = registered("plain-HTTP", listener)?;
            tracing::info!("answering plain HTTP with redirects to HTTPS");
            Some(crate::redirect::serve_redirects(
                listener,
                https_port,
                router.clone(),
                stats.clone(),
                worker.drain_signal().into_receiver(),
                opts,
            ))
        }
        None => None,
    };
    Ok((Some(tcp), redirects))
}

/// Runs `f`, if there is one.
async fn optional(f: Option<impl Future<Output = ()>>) {
    if let Some(f) = f {
        f.await
    }
}
