//! `h3-probe`: HTTP/3 load generator. C connections × S concurrent streams of GET for a
//! duration (or a request budget), optionally in P processes whose results are merged; reports
//! req/s, latency percentiles (hdrhistogram) and errors by kind, as text on stdout and
//! optionally as JSON.

use std::io::IsTerminal;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Parser;
use futures_util::stream::{FuturesUnordered, StreamExt};
use ringmux_bench::fwd::os;
use ringmux_bench::stats::{ProbeReport, ProbeShard, ProbeStats};
use ringmux_testkit::client::{client_config, ClientError, H3Client, H3Conn};
use tokio::sync::watch;

/// HTTP/3 load generator: C connections × S concurrent streams of GET.
///
/// Requests completing during the warm-up are not counted. Ctrl-C stops early and still
/// reports what was measured. Exit status: 0 if at least one request succeeded, 1 otherwise.
#[derive(Debug, Parser)]
#[command(name = "h3-probe", version)]
struct Args {
    /// Target URL, e.g. https://127.0.0.1:4433/bytes/1024. The host is also the TLS server
    /// name (IP literals work with the self-signed ringmux certificate).
    #[arg(long, env = "H3_PROBE_URL")]
    url: String,

    /// Number of QUIC connections, each on its own UDP socket.
    #[arg(long, short = 'c', default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    connections: u32,

    /// Concurrent request streams per connection (keep ≤ the server's stream limit, 100 for
    /// ringmux, or requests queue).
    #[arg(long, short = 's', default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    streams: u32,

    /// Measurement duration in seconds, after the warm-up.
    #[arg(long, short = 'd', default_value_t = 10.0)]
    seconds: f64,

    /// Stop after this many counted requests (successes and errors) even if time is left.
    #[arg(long, short = 'n')]
    requests: Option<u64>,

    /// Warm-up in seconds: requests completing before it ends are not counted.
    #[arg(long, default_value_t = 0.0)]
    warmup: f64,

    /// Write the report as JSON to this file (fields: requests, requests_per_s, goaways, errors
    /// {kind: count, total}, latency_us {p50, p99, p999, max}).
    #[arg(long)]
    json: Option<PathBuf>,

    /// Expected response body length; other lengths count as error `body_len`.
    #[arg(long)]
    expect_len: Option<u64>,

    /// Accept any server certificate (load testing against self-signed servers).
    #[arg(long, conflicts_with = "ca")]
    insecure: bool,

    /// Trust the certificates in this PEM file (instead of --insecure).
    #[arg(long)]
    ca: Option<PathBuf>,

    /// Per-request timeout in seconds (error kind `request_timeout`).
    #[arg(long, default_value_t = 10.0)]
    timeout: f64,

    /// Runtime worker threads (default: number of CPUs).
    #[arg(long)]
    threads: Option<usize>,

    /// Run this many processes, each with --connections × --streams (and --requests, if given,
    /// each), and merge their counts and latency histograms into one report. One process's
    /// runtime can become the bottleneck before the server does.
    #[arg(long, short = 'p', default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=256))]
    processes: u32,

    /// Give each stream slot a task of its own, as h3-probe did before its slots became
    /// futures of their connection's task. Each request then tends to leave in a packet of its
    /// own (about 1.1 datagrams to the server per request instead of 0.25 with 16 × 8), at
    /// about twice the client's CPU per request: for comparing with earlier figures.
    #[arg(long)]
    task_per_stream: bool,

    /// Add this header to every request, as `NAME: VALUE` (repeatable), e.g.
    /// `--header 'accept-encoding: br'`.
    #[arg(long = "header", short = 'H', value_name = "NAME: VALUE", value_parser = parse_header)]
    headers: Vec<(http::HeaderName, http::HeaderValue)>,

    /// Internal (set by --processes): write this process's share as JSON here, print nothing.
    #[arg(long, hide = true)]
    shard_out: Option<PathBuf>,
}

/// What each stream task needs.
struct Plan {
    addr: SocketAddr,
    server_name: String,
    path: String,
    expect_len: Option<u64>,
    timeout: Duration,
    measure_from: Instant,
    budget: Option<u64>,
    /// Requests counted so far (all tasks), for the budget and the progress bar.
    counted: AtomicU64,
    /// `--task-per-stream`.
    task_per_stream: bool,
    /// `--header`: added to every request.
    headers: http::HeaderMap,
}

/// `--header`'s value: `NAME: VALUE`.
fn parse_header(v: &str) -> anyhow::Result<(http::HeaderName, http::HeaderValue)> {
    let (name, value) = v.split_once(':').with_context(|| {
        format!("--header {v:?}: expected NAME: VALUE, e.g. 'accept-encoding: br'")
    })?;
    let name = http::HeaderName::from_bytes(name.trim().as_bytes())
        .with_context(|| format!("--header {v:?}: {:?} is not a header name", name.trim()))?;
    let value = http::HeaderValue::from_str(value.trim())
        .with_context(|| format!("--header {v:?}: {:?} is not a header value", value.trim()))?;
    Ok((name, value))
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    // A copy started by --processes never starts copies of its own.
    if args.processes > 1 && args.shard_out.is_none() {
        let ok = run_processes(&args)?;
        std::process::exit(if ok { 0 } else { 1 });
    }
    let mut rt = tokio::runtime::Builder::new_multi_thread();
    if let Some(n) = args.threads {
        rt.worker_threads(n.max(1));
    }
    let rt = rt
        .enable_all()
        .build()
        .context("cannot start the tokio runtime")?;
    let ok = rt.block_on(run(args))?;
    if !ok {
        std::process::exit(1);
    }
    Ok(())
}

/// First pause after a failed request; each further consecutive failure adds as much.
const BACKOFF: Duration = Duration::from_millis(10);
/// Longest pause after failed requests.
const MAX_BACKOFF: Duration = Duration::from_millis(200);
/// How long connections get to end after the run's deadline.
const FINISH_WAIT: Duration = Duration::from_secs(5);

async fn run(args: Args) -> anyhow::Result<bool> {
    for (name, v) in [
        ("--seconds", args.seconds),
        ("--warmup", args.warmup),
        ("--timeout", args.timeout),
    ] {
        if !(v.is_finite() && v >= 0.0) {
            bail!("{name} must be a non-negative number of seconds, got {v}");
        }
    }
    let uri: http::Uri = args
        .url
        .parse()
        .with_context(|| format!("bad --url {:?}", args.url))?;
    if uri.scheme_str() != Some("https") {
        bail!("--url {:?}: only https:// URLs are supported", args.url);
    }
    let host = uri.host().context("--url has no host")?;
    let host = host
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_string();
    let port = uri.port_u16().unwrap_or(443);
    let path = uri
        .path_and_query()
        .map_or("/".to_string(), |p| p.to_string());
    let addr = tokio::net::lookup_host((host.as_str(), port))
        .await
        .with_context(|| format!("cannot resolve {host}:{port}"))?
        .next()
        .with_context(|| format!("{host}:{port} resolves to no address"))?;

    let config = match (&args.ca, args.insecure) {
        (Some(ca), _) => {
            let pem =
                std::fs::read(ca).with_context(|| format!("cannot read --ca {}", ca.display()))?;
            let certs =
                rustls_pemfile_certs(&pem).with_context(|| format!("--ca {}", ca.display()))?;
            client_config(Some(&certs)).with_context(|| format!("--ca {}", ca.display()))?
        }
        (None, true) => client_config(None)?,
        (None, false) => {
            bail!("pass --ca PEM to verify the server, or --insecure to accept any certificate")
        }
    };

    let start = Instant::now();
    let warmup = Duration::from_secs_f64(args.warmup);
    let measure = Duration::from_secs_f64(args.seconds);
    let plan = Arc::new(Plan {
        addr,
        server_name: host,
        path,
        expect_len: args.expect_len,
        timeout: Duration::from_secs_f64(args.timeout),
        measure_from: start + warmup,
        budget: args.requests,
        counted: AtomicU64::new(0),
        task_per_stream: args.task_per_stream,
        headers: args.headers.iter().cloned().collect(),
    });
    // The process's CPU time when the measurement starts (u64::MAX until then), so that the
    // client's own cost per request covers the measured window only.
    let cpu_at_start = Arc::new(AtomicU64::new(u64::MAX));
    {
        let cpu_at_start = cpu_at_start.clone();
        let at = tokio::time::Instant::from_std(plan.measure_from);
        tokio::spawn(async move {
            tokio::time::sleep_until(at).await;
            cpu_at_start.store(os::own_process_cpu_ns(), Ordering::Relaxed);
        });
    }
    let (stop_tx, stop) = watch::channel(false);
    let stop_tx = Arc::new(stop_tx);

    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..args.connections {
        tasks.spawn(connection(
            plan.clone(),
            config.clone(),
            args.streams,
            stop.clone(),
            stop_tx.clone(),
        ));
    }

    let progress = if args.shard_out.is_some() {
        None
    } else {
        progress_bar(warmup + measure)
    };
    let deadline = tokio::time::Instant::from_std(start + warmup + measure);
    let mut budget_done = stop.clone();
    let interrupted = tokio::select! {
        _ = tokio::time::sleep_until(deadline) => false,
        _ = budget_done.wait_for(|s| *s) => false,
        r = tokio::signal::ctrl_c() => { r.context("cannot listen for Ctrl-C")?; true }
        _ = tick(&progress, &plan, start) => false,
    };
    let _ = stop_tx.send(true);
    let measured = Instant::now().saturating_duration_since(plan.measure_from);
    let cpu = match cpu_at_start.load(Ordering::Relaxed) {
        u64::MAX => None,
        at => Some(Duration::from_nanos(
            os::own_process_cpu_ns().saturating_sub(at),
        )),
    };
    if let Some(p) = &progress {
        p.finish_and_clear();
    }
    if interrupted && args.shard_out.is_none() {
        eprintln!("interrupted: reporting what was measured");
    }

    // `--seconds` is a hard bound: connections get FINISH_WAIT to close and report, then
    // whatever has not ended is cut off (its counts are lost, and said so).
    let mut total = ProbeStats::new();
    let finish = tokio::time::Instant::now() + FINISH_WAIT;
    loop {
        match tokio::time::timeout_at(finish, tasks.join_next()).await {
            Ok(Some(Ok(stats))) => total.merge(&stats),
            Ok(Some(Err(e))) => eprintln!("connection task failed: {e}"),
            Ok(None) => break,
            Err(_) => {
                eprintln!(
                    "{} connections did not end within {FINISH_WAIT:?} of the deadline: cut off, \
                     their requests not counted",
                    tasks.len()
                );
                tasks.abort_all();
                break;
            }
        }
    }
    if let Some(path) = &args.shard_out {
        let mut shard = ProbeShard::new(&total, measured);
        shard.client_cpu_s = cpu.map(|c| c.as_secs_f64());
        let json = serde_json::to_string(&shard)?;
        std::fs::write(path, json)
            .with_context(|| format!("cannot write the shard {}", path.display()))?;
        return Ok(total.requests() > 0);
    }
    let mut report = total.report(measured);
    if let Some(cpu) = cpu {
        report = report.with_client_cpu(cpu);
    }
    print_report(&args, &report, measured);
    if let Some(path) = &args.json {
        let json = serde_json::to_string_pretty(&report)?;
        std::fs::write(path, json + "\n")
            .with_context(|| format!("cannot write --json {}", path.display()))?;
    }
    Ok(report.requests > 0)
}

/// One connection: connects (again after a connection-level failure) and keeps `streams`
/// requests in flight on it until stopped ([`slots`]).
async fn connection(
    plan: Arc<Plan>,
    config: quinn::ClientConfig,
    streams: u32,
    mut stop: watch::Receiver<bool>,
    stop_tx: Arc<watch::Sender<bool>>,
) -> ProbeStats {
    let mut stats = ProbeStats::new();
    let client = match H3Client::new(config, plan.addr) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("cannot open a client socket: {e}");
            stats.record_error("io");
            return stats;
        }
    };
    while !*stop.borrow() {
        let conn = tokio::select! {
            c = client.connect(plan.addr, &plan.server_name) => c,
            _ = stop.wait_for(|s| *s) => break,
        };
        let conn = match conn {
            Ok(c) => c,
            Err(e) => {
                count_error(&plan, &mut stats, &e, &stop_tx);
                // Back off a little so a dead server does not turn into a busy loop.
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_millis(100)) => {}
                    _ = stop.wait_for(|s| *s) => {}
                }
                continue;
            }
        };
        let uri = match conn.uri(&plan.path) {
            Ok(u) => u,
            Err(e) => {
                // The URL parsed, so this cannot fail for one connection and not the next.
                eprintln!("cannot make the request URI: {e}");
                stats.record_error(e.kind());
                break;
            }
        };
        let conn = if plan.task_per_stream {
            // A task per slot, each one slot of its own.
            let conn = Arc::new(conn);
            let mut tasks = tokio::task::JoinSet::new();
            for _ in 0..streams {
                let (plan, conn, uri) = (plan.clone(), conn.clone(), uri.clone());
                let (stop, stop_tx) = (stop.clone(), stop_tx.clone());
                tasks.spawn(async move {
                    let mut stats = ProbeStats::new();
                    slots(&plan, &conn, &uri, 1, &mut stats, stop, &stop_tx).await;
                    stats
                });
            }
            while let Some(r) = tasks.join_next().await {
                if let Ok(s) = r {
                    stats.merge(&s);
                }
            }
            Arc::try_unwrap(conn).ok()
        } else {
            slots(
                &plan,
                &conn,
                &uri,
                streams,
                &mut stats,
                stop.clone(),
                &stop_tx,
            )
            .await;
            Some(conn)
        };
        if let Some(conn) = conn {
            let _ = tokio::time::timeout(Duration::from_secs(1), conn.close()).await;
        }
    }
    let _ = tokio::time::timeout(Duration::from_secs(1), client.close()).await;
    stats
}

/// `streams` request slots on one connection, each sending its next request as soon as its
/// previous one ended, until stopped or every slot has ended (the connection died or the
/// server drained it). The slots are futures of the connection's own task rather than a task
/// each, so a response that arrives wakes one task, not one task per stream and a hop
/// between the runtime's threads.
async fn slots(
    plan: &Plan,
    conn: &H3Conn,
    uri: &http::Uri,
    streams: u32,
    stats: &mut ProbeStats,
    mut stop: watch::Receiver<bool>,
    stop_tx: &watch::Sender<bool>,
) {
    let mut slots = FuturesUnordered::new();
    for _ in 0..streams {
        slots.push(request(plan, conn, uri, 0));
    }
    let stopped = stop.wait_for(|s| *s);
    tokio::pin!(stopped);
    loop {
        let (failures, t0, done, result) = tokio::select! {
            // An unfinished request at the end is neither a success nor an error.
            _ = &mut stopped => return,
            next = slots.next() => match next {
                Some(r) => r,
                None => return,
            },
        };
        let counted = done >= plan.measure_from;
        match result {
            Ok(Ok((status, len))) => {
                let kind = if !status.is_success() {
                    Some(format!("status_{}", status.as_u16()))
                } else if plan.expect_len.is_some_and(|n| n != len) {
                    Some("body_len".to_string())
                } else {
                    None
                };
                if counted {
                    match kind {
                        Some(k) => stats.record_error(&k),
                        None => stats.record_ok(done - t0),
                    }
                    count(plan, stop_tx);
                }
                slots.push(request(plan, conn, uri, 0));
            }
            Ok(Err(e)) if e.refused_by_goaway() || conn.closed_gracefully() => {
                // The server drains (a reload, say) and never saw this request: not an error.
                // This slot ends; the connection moves to a new one once every slot has.
                stats.goaways += 1;
            }
            Ok(Err(e)) => {
                if counted {
                    count_error(plan, stats, &e, stop_tx);
                }
                // A dead connection ends the slot (the connection reconnects); otherwise the
                // slot goes on after a pause.
                if conn.quic().close_reason().is_none() {
                    slots.push(request(plan, conn, uri, failures.saturating_add(1)));
                }
            }
            Err(_) => {
                if counted {
                    stats.record_error("request_timeout");
                    count(plan, stop_tx);
                }
                slots.push(request(plan, conn, uri, failures.saturating_add(1)));
            }
        }
    }
}

/// What one request of a slot returned: the slot's consecutive failures before it, when it
/// was sent and when it ended, and its status and body length, an error or a timeout.
type Outcome = (
    u32,
    Instant,
    Instant,
    Result<Result<(http::StatusCode, u64), ClientError>, tokio::time::error::Elapsed>,
);

/// One request of a slot: `GET uri`, the body read to its end and counted. After `failures`
/// consecutive failed requests on this slot it first waits a little longer each time (up to
/// MAX_BACKOFF), so a request that fails at once never becomes a busy loop that starves the
/// runtime (and with it the timer that ends the run).
async fn request(plan: &Plan, conn: &H3Conn, uri: &http::Uri, failures: u32) -> Outcome {
    if failures > 0 {
        tokio::time::sleep((BACKOFF * failures).min(MAX_BACKOFF)).await;
    }
    let t0 = Instant::now();
    let result = tokio::time::timeout(plan.timeout, conn.get_len_with(uri, &plan.headers)).await;
    (failures, t0, Instant::now(), result)
}

fn count_error(
    plan: &Plan,
    stats: &mut ProbeStats,
    e: &ClientError,
    stop_tx: &watch::Sender<bool>,
) {
    if Instant::now() >= plan.measure_from {
        stats.record_error(e.kind());
        count(plan, stop_tx);
    }
}

fn count(plan: &Plan, stop_tx: &watch::Sender<bool>) {
    // Relaxed: a counter; the stop signal itself goes through the watch channel.
    let n = plan.counted.fetch_add(1, Ordering::Relaxed) + 1;
    if plan.budget.is_some_and(|b| n >= b) {
        let _ = stop_tx.send(true);
    }
}

fn progress_bar(total: Duration) -> Option<indicatif::ProgressBar> {
    if !std::io::stderr().is_terminal() {
        return None;
    }
    let bar = indicatif::ProgressBar::new(total.as_millis() as u64);
    let style = indicatif::ProgressStyle::with_template("{bar:40} {elapsed}/{duration} {msg}")
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar());
    bar.set_style(style);
    Some(bar)
}

/// Updates the progress bar; never returns (it is one arm of the main select).
async fn tick(bar: &Option<indicatif::ProgressBar>, plan: &Plan, start: Instant) {
    let Some(bar) = bar else {
        return std::future::pending().await;
    };
    let mut every = tokio::time::interval(Duration::from_millis(250));
    loop {
        every.tick().await;
        bar.set_position(start.elapsed().as_millis() as u64);
        let phase = if Instant::now() < plan.measure_from {
            "warm-up"
        } else {
            "measuring"
        };
        bar.set_message(format!(
            "{phase}: {} requests",
            plan.counted.load(Ordering::Relaxed)
        ));
    }
}

/// `--processes P`: runs P copies of this program (same arguments, one process each, no
/// --json), waits for them and merges what they measured. Ctrl-C reaches the whole foreground
/// process group: the copies stop and report, and this process, which ignores it, merges.
fn run_processes(args: &Args) -> anyhow::Result<bool> {
    let exe = std::env::current_exe().context("cannot find this executable to start copies")?;
    let dir = tempfile::Builder::new()
        .prefix("h3-probe-")
        .tempdir()
        .context("cannot create a temporary folder")?;
    let child_args = without_options(
        std::env::args_os().skip(1),
        &["--processes", "-p", "--json"],
    );
    let mut children = Vec::new();
    for i in 0..args.processes {
        let shard = dir.path().join(format!("{i}.json"));
        let child = std::process::Command::new(&exe)
            .args(&child_args)
            .arg("--shard-out")
            .arg(&shard)
            .stdout(std::process::Stdio::null())
            .spawn()
            .with_context(|| format!("cannot start copy {i} of {}", exe.display()))?;
        children.push((child, shard));
    }
    // Ctrl-C must stop the copies, not this process: it still has one thread (no runtime yet),
    // so blocking SIGINT here keeps it pending until exit. The copies were started (and exec'd,
    // which `spawn` waits for) before, with SIGINT unblocked.
    ringmux_bench::fwd::os::hold_sigint().context("cannot block SIGINT")?;
    let mut total = ProbeStats::new();
    let (mut measured_s, mut reported) = (0.0, 0u32);
    // The copies' CPU over their windows, if every copy measured it.
    let mut cpu_s = Some(0.0);
    for (i, (mut child, shard)) in children.into_iter().enumerate() {
        let status = child.wait()?;
        let parsed = std::fs::read(&shard)
            .ok()
            .and_then(|b| serde_json::from_slice::<ProbeShard>(&b).ok());
        match parsed {
            Some(s) => {
                total.merge(&s.stats());
                measured_s += s.measured_s;
                reported += 1;
                cpu_s = cpu_s.zip(s.client_cpu_s).map(|(a, b)| a + b);
            }
            None => eprintln!("h3-probe: process {i} reported nothing ({status})"),
        }
    }
    drop(dir);
    if reported == 0 {
        bail!("none of the {} processes reported", args.processes);
    }
    if reported < args.processes {
        eprintln!(
            "h3-probe: only {reported} of {} processes reported; the figures cover those",
            args.processes
        );
    }
    let measured = Duration::from_secs_f64(measured_s / f64::from(reported));
    let mut report = total.report(measured);
    if let Some(cpu) = cpu_s {
        report = report.with_client_cpu(Duration::from_secs_f64(cpu));
    }
    print_report(args, &report, measured);
    if let Some(path) = &args.json {
        let json = serde_json::to_string_pretty(&report)?;
        std::fs::write(path, json + "\n")
            .with_context(|| format!("cannot write --json {}", path.display()))?;
    }
    Ok(report.requests > 0)
}

/// The arguments without the named options and their values (`--opt V` and `--opt=V`).
fn without_options(
    args: impl Iterator<Item = std::ffi::OsString>,
    drop: &[&str],
) -> Vec<std::ffi::OsString> {
    let mut out = Vec::new();
    let mut skip_value = false;
    for a in args {
        if std::mem::take(&mut skip_value) {
            continue;
        }
        let text = a.to_string_lossy();
        if drop.contains(&text.as_ref()) {
            skip_value = true;
        } else if !drop.iter().any(|d| {
            // `--opt=V`, and a short option with its value attached (`-p4`).
            if d.starts_with("--") {
                text.starts_with(&format!("{d}="))
            } else {
                text.starts_with(d) && !text.starts_with("--")
            }
        }) {
            out.push(a);
        }
    }
    out
}

fn print_report(args: &Args, r: &ProbeReport, measured: Duration) {
    println!(
        "h3-probe {} : {}{} connections x {} streams, {:.1} s measured",
        args.url,
        if args.processes > 1 {
            format!("{} processes x ", args.processes)
        } else {
            String::new()
        },
        args.connections,
        args.streams,
        measured.as_secs_f64()
    );
    println!("requests      {}", r.requests);
    println!("requests/s    {:.1}", r.requests_per_s);
    if r.goaways > 0 {
        println!(
            "goaway        {} requests moved to a new connection",
            r.goaways
        );
    }
    println!(
        "latency (us)  p50 {}  p99 {}  p99.9 {}  max {}",
        r.latency_us.p50, r.latency_us.p99, r.latency_us.p999, r.latency_us.max
    );
    if let Some(cpu) = r.client_cpu_us_per_request {
        println!("client CPU    {cpu:.2} us per request");
    }
    let errors: Vec<String> = r
        .errors
        .iter()
        .filter(|(k, _)| k.as_str() != "total")
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    println!(
        "errors        {}{}",
        r.errors.get("total").copied().unwrap_or(0),
        if errors.is_empty() {
            String::new()
        } else {
            format!(" ({})", errors.join(", "))
        }
    );
}

/// Certificates from PEM text.
fn rustls_pemfile_certs(
    pem: &[u8],
) -> anyhow::Result<Vec<rustls::pki_types::CertificateDer<'static>>> {
    use rustls::pki_types::pem::PemObject;
    let certs = rustls::pki_types::CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .context("malformed PEM")?;
    if certs.is_empty() {
        bail!("no CERTIFICATE block found");
    }
    Ok(certs)
}

#[cfg(test)]
mod tests {
    use super::without_options;

    #[test]
    fn copies_get_neither_processes_nor_json() {
        let args = [
            "--url",
            "https://x/",
            "-p",
            "3",
            "--json",
            "out.json",
            "-c",
            "4",
            "-p5",
            "--processes=2",
            "--json=a",
            "--streams",
            "8",
        ]
        .map(std::ffi::OsString::from);
        let kept = without_options(args.into_iter(), &["--processes", "-p", "--json"]);
        assert_eq!(
            kept,
            ["--url", "https://x/", "-c", "4", "--streams", "8"].map(std::ffi::OsString::from)
        );
    }
}
