//! `ringmux-worker`: one ringmux instance. Started by the `ringmux` demux as its child with a
//! control socket; receives its hand-off (keys, certificate, ring or unix ingress, its descriptor
//! of the public socket), serves HTTP/3 from one quinn endpoint on a current-thread tokio runtime,
//! and drains gracefully on `SHUTDOWN` (or SIGTERM). Exits at once if the demux goes away.

use std::os::fd::{AsFd, FromRawFd, OwnedFd};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Parser;
use ringmux_quic_lb::{CidGenerator, KeySet, QuicLbConfig, Router};
use ringmux_ring::Consumer;
use ringmux_worker::control::{self, Handoff, IngressKind, WorkerReport};
use ringmux_worker::files::{DocRoot, FileOptions};
use ringmux_worker::http::{serve_with, ServerStats, Site};
use ringmux_worker::quic::{endpoint_config, server_config, ServerOptions};
use ringmux_worker::sessions::RemoteSessionStore;
use ringmux_worker::sink::{self, SinkIngress};
use ringmux_worker::socket::{Ingress, RingSocket};
use ringmux_worker::tls::{server_crypto_with, CertChain, Resumption};
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;

/// One ringmux worker instance (started by `ringmux`, not by hand).
#[derive(Parser, Debug)]
#[command(version, about, long_about = None)]
struct Args {
    /// Descriptor number of the control socket inherited from the demux.
    #[arg(long, env = "RINGMUX_CONTROL_FD")]
    control_fd: i32,
}

fn main() {
    let args = Args::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    match run(args) {
        Ok(()) => {}
        Err(e) => {
            tracing::error!("worker failed: {e:#}");
            std::process::exit(1);
        }
    }
}

fn run(args: Args) -> Result<()> {
    // Die with the demux even if it is SIGKILLed: the control socket closing covers the rest.
    // SAFETY: plain prctl.
    unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) };
    // SAFETY: getppid cannot fail.
    if unsafe { libc::getppid() } == 1 {
        bail!("the demux exited before this worker started");
    }
    if args.control_fd < 3 {
        bail!("--control-fd {} is a standard stream; expected the inherited control socket (3 or more)", args.control_fd);
    }
    // SAFETY: the demux passed this descriptor to us for our exclusive use.
    let control = unsafe { OwnedFd::from_raw_fd(args.control_fd) };
    let (h, fds) =
        control::recv_handoff(control.as_fd()).context("reading the hand-off from the demux")?;
    let instance = h.instance;
    let _span = tracing::info_span!("worker", instance).entered();
    if let Some(cpu) = h.cpu {
        let ok = core_affinity::get_core_ids()
            .and_then(|ids| ids.into_iter().find(|c| c.id == cpu))
            .is_some_and(core_affinity::set_for_current);
        if !ok {
            tracing::warn!(cpu, "could not pin to CPU");
        }
    }
    if h.sink {
        return run_sink(h, fds, control);
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(serve(h, fds, control))
}

/// The QUIC-LB configuration every instance shares.
fn lb_config(h: &Handoff, keys: &KeySet) -> QuicLbConfig {
    QuicLbConfig {
        config_id: h.config_id,
        node_id: h.node_id.clone(),
        instance_count: h.instances,
        nonce_len: h.nonce_len,
        key: h.encrypt_cids.then_some(keys.quic_lb),
    }
}

/// Benchmark sink: no quinn, just drain, check and count.
fn run_sink(h: Handoff, fds: Vec<OwnedFd>, control: OwnedFd) -> Result<()> {
    let keys = KeySet::from_bytes(&h.keys).map_err(|e| anyhow::anyhow!("hand-off keys: {e}"))?;
    let router = Router::new(&lb_config(&h, &keys), keys.routing_hash)
        .map_err(|e| anyhow::anyhow!("QUIC-LB config: {e}"))?;
    let mut fds = fds.into_iter().skip(1); // a sink never sends on the public socket
    let ingress = match h.ingress {
        IngressKind::Shm => {
            let ring = fds.next().context("ring")?;
            let page = fds.next().context("page")?;
            let bell = fds.next().context("doorbell")?;
            let spin = Duration::from_micros(u64::from(h.spin_us));
            SinkIngress::Ring(
                Consumer::attach(ring, page, bell, h.generation, spin)
                    .context("attaching to the ring")?,
            )
        }
        IngressKind::Unix => SinkIngress::Unix(fds.next().context("unix ingress socket")?),
    };
    control::send(control.as_fd(), b"READY").context("reporting ready")?;
    tracing::info!(ingress = ?h.ingress, "sink running");
    sink::run(ingress, router, h.instance, control).context("sink")
}

async fn serve(h: Handoff, mut fds: Vec<OwnedFd>, control: OwnedFd) -> Result<()> {
    let keys = KeySet::from_bytes(&h.keys).map_err(|e| anyhow::anyhow!("hand-off keys: {e}"))?;
    let lb = lb_config(&h, &keys);
    // Validate once here so that the factory below cannot fail.
    CidGenerator::new(&lb, h.instance, h.cid_lifetime)
        .map_err(|e| anyhow::anyhow!("QUIC-LB config: {e}"))?;
    let (instance, lifetime) = (h.instance, h.cid_lifetime);
    let factory = move || -> Box<dyn quinn::ConnectionIdGenerator> {
        Box::new(CidGenerator::new(&lb, instance, lifetime).expect("validated above"))
    };

    let chain = CertChain::from_pem(&h.cert_pem, &h.key_pem).context("hand-off certificate")?;
    let opts = ServerOptions {
        idle_timeout: h.idle_timeout,
        retry: h.retry,
        ..ServerOptions::default()
    };

    // Descriptors in hand-off order: public socket, ingress…, session socket.
    // TLS sessions live in the demux's cache, so a resumed (0-RTT) connection is accepted
    // whichever instance its new connection ID hashes to (rustls allows 0-RTT only with a
    // single-use session store, never with stateless tickets).
    let sessions = fds.pop().context("session socket missing")?;
    let store = Arc::new(RemoteSessionStore::new(sessions));
    let crypto = server_crypto_with(&chain, Resumption::SessionStore(store))?;
    let server = server_config(crypto, &keys.token, &opts);
    let mut fds = fds.into_iter();
    let public = fds.next().context("public socket missing")?;
    let ingress = match h.ingress {
        IngressKind::Shm => {
            let (ring, page, bell) = (
                fds.next().context("ring")?,
                fds.next().context("page")?,
                fds.next().context("doorbell")?,
            );
            let c = Consumer::attach(
                ring,
                page,
                bell,
                h.generation,
                Duration::from_micros(u64::from(h.spin_us)),
            )
            .context("attaching to the ring")?;
            Ingress::Ring(c)
        }
        IngressKind::Unix => Ingress::Unix(fds.next().context("unix ingress socket")?),
    };
    let socket =
        Arc::new(RingSocket::new(ingress, public, h.public_addr).context("ingress socket")?);
    let ingress_stats = socket.stats();
    let endpoint = quinn::Endpoint::new_with_abstract_socket(
        endpoint_config(&keys.stateless_reset, factory),
        Some(server),
        socket,
        Arc::new(quinn::TokioRuntime),
    )?;

    let (shutdown_tx, shutdown_rx) = tokio::sync::watch::channel(false);
    let stats = Arc::new(ServerStats::default());
    // Non-blocking from here on: the reactor's readiness can be stale, and a blocking recv on
    // a stale readiness would stall the whole runtime (seen: a drain that never finished).
    socket2::SockRef::from(&control)
        .set_nonblocking(true)
        .context("control socket")?;
    // SAFETY: `control` is an open descriptor owned by the AsyncFd for its whole life.
    let control = unsafe { AsyncFd::register_with_interest(control, Interest::READABLE) }
        .map_err(std::io::Error::from)?;
    control::send(control.get_ref().as_fd(), b"READY").context("reporting ready")?;
    tracing::info!(ingress = ?h.ingress, generation = h.generation, "serving");

    let root = match &h.root {
        Some(path) => {
            let cache_control =
                match &h.cache_control {
                    Some(v) => Some(http::HeaderValue::from_str(v).with_context(|| {
                        format!("--cache-control / RINGMUX_CACHE_CONTROL={v:?}")
                    })?),
                    None => None,
                };
            let opts = FileOptions {
                cache_bytes: h.file_cache_bytes,
                cache_control,
                ..FileOptions::default()
            };
            Some(DocRoot::open(path, opts)?)
        }
        None => None,
    };
    let site = Arc::new(Site {
        root,
        max_bytes: h.max_bytes,
    });
    let server_fut = serve_with(endpoint.clone(), site, stats.clone(), shutdown_rx, &opts);
    tokio::pin!(server_fut);
    let mut report = tokio::time::interval(Duration::from_secs(1));
    let mut sigterm = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let grace = Duration::from_secs(60);
    let mut draining = false;
    loop {
        tokio::select! {
            r = control.readable() => {
                let mut guard = r?;
                let mut buf = [0u8; 256];
                match control::recv_with_fds(guard.get_inner().as_fd(), &mut buf) {
                    Ok(Some((n, _))) if &buf[..n] == b"SHUTDOWN" => {
                        tracing::info!("draining on request of the demux");
                        draining = true;
                        let _ = shutdown_tx.send(true);
                    }
                    Ok(Some(_)) => {}
                    Ok(None) => {
                        tracing::warn!("control socket closed: the demux is gone; exiting");
                        std::process::exit(0);
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => guard.clear_ready(),
                    Err(e) => return Err(e).context("control socket"),
                }
            }
            _ = sigterm.recv(), if !draining => {
                tracing::info!("SIGTERM: draining");
                draining = true;
                let _ = shutdown_tx.send(true);
            }
            _ = report.tick() => {
                let s = stats.snapshot();
                let r = WorkerReport {
                    connections_active: s.connections_active,
                    connections_total: s.connections_accepted,
                    requests_total: s.requests_total,
                    datagrams_in: ingress_stats.received.load(std::sync::atomic::Ordering::Relaxed),
                    datagrams_dropped: ingress_stats.dropped.load(std::sync::atomic::Ordering::Relaxed),
                    cpu_ns: sink::cpu_ns(),
                    pid: u64::from(std::process::id()),
                    ..WorkerReport::default()
                };
                let _ = control::send(control.get_ref().as_fd(), r.encode().as_bytes());
            }
            () = &mut server_fut => break,
        }
    }
    let _ = tokio::time::timeout(grace, endpoint.wait_idle()).await;
    tracing::info!("drained; exiting");
    Ok(())
}
