//! `ringmux`: the demux and supervisor. See `ringmux --help` and README.md; the parts
//! live in the library (`lib.rs`).
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(clippy::undocumented_unsafe_blocks)]

use std::net::SocketAddr;
use std::os::fd::{AsFd, OwnedFd};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Parser;
use ringmux_proto::{Handoff, IngressKind, ServeOptions};
use ringmux_quic_lb::{KeySet, QuicLbConfig, Router};

use ringmux_demux::certs::CertPem;
use ringmux_demux::config::{self, Cli, Command, Config};
use ringmux_demux::dataplane::{self, DataPlane, DataPlaneLink, Liveness};
use ringmux_demux::forward::{self, Forward, IngressHandles};
use ringmux_demux::metrics::{self, Counters};
use ringmux_demux::{alloc, supervisor, sys};

#[global_allocator]
static ALLOC: alloc::CountingAlloc = alloc::CountingAlloc;

fn main() -> ExitCode {
    let cli = Cli::parse();
    ringmux_proto::logging::init();
    let result = match cli.command {
        Some(Command::Stats { metrics }) => {
            metrics::fetch(metrics.as_str()).map(|m| print!("{}", metrics::stats::table(&m)))
        }
        Some(Command::Reload {
            control_socket,
            timeout,
        }) => supervisor::control::reload(&control_socket, Duration::from_secs(timeout)),
        None => cli.run.validate().and_then(run),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ringmux: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cfg: Config) -> Result<()> {
    // Before any thread exists, so that every thread inherits the mask.
    let signals = sys::shutdown_signals().context("setting up signal handling")?;
    // No process of the same user (a worker above all) may trace this one or read its memory,
    // and every orphaned descendant of a worker becomes this process's child, to be killed.
    sys::harden_demux().context("making the demux non-dumpable and a child subreaper")?;
    if cfg.args.sandbox == config::Toggle::Off {
        tracing::warn!(
            "--sandbox off: workers run UNCONFINED. Any worker can stop, trace or read the \
             demux and its siblings, start processes and read every instance's datagrams. \
             For debugging a worker only"
        );
    } else if cfg.worker_user.is_none() && nix::unistd::geteuid().is_root() {
        tracing::warn!(
            "workers run as root: confined by the system-call filter and without capabilities, \
             but they own every root-owned file. Give --worker-user (RINGMUX_WORKER_USER), \
             e.g. nobody"
        );
    }
    let keys = match &cfg.args.key_file {
        Some(p) => {
            KeySet::load(p).map_err(|e| anyhow::anyhow!("--key-file / RINGMUX_KEY_FILE: {e}"))?
        }
        None => KeySet::generate().map_err(|e| anyhow::anyhow!("generating keys: {e}"))?,
    };
    let lb = QuicLbConfig {
        config_id: cfg.args.config_id,
        node_id: cfg.node_id.clone(),
        instance_count: cfg.instances,
        nonce_len: cfg.nonce_len,
        key: (!cfg.args.plaintext_cids).then_some(keys.quic_lb),
    };
    lb.validate().map_err(|e| {
        anyhow::anyhow!(
            "QUIC-LB configuration (--node-id, --config-id, --nonce-len, --instances): {e}"
        )
    })?;
    let router =
        Router::new(&lb, keys.routing_hash).map_err(|e| anyhow::anyhow!("QUIC-LB router: {e}"))?;
    let cert = match (&cfg.args.cert, &cfg.args.key) {
        (Some(c), Some(k)) => CertPem::load(c, k)?,
        _ => CertPem::self_signed()?,
    };

    let public =
        dataplane::PublicSocket::new(bind_public(&cfg)?, cfg.args.ecn == config::Toggle::On)
            .context("configuring the public socket")?;
    let public_addr = public.socket().local_addr()?;

    let lanes = router.lanes();
    let counters = Arc::new(Counters::new(cfg.instances, lanes));
    let liveness = Liveness::new(lanes);
    if let Ok(mut p) = counters.program.write() {
        *p = cfg.worker_cmd.join(" ");
    }
    let template = Handoff {
        instance: 0,
        instances: cfg.instances,
        generation: 1,
        worker_generation: 1,
        // Both set per worker from its ingress descriptors.
        ingress: IngressKind::Shm,
        spin_us: cfg.ring.spin_us,
        public_addr,
        config_id: lb.config_id,
        node_id: lb.node_id.clone(),
        nonce_len: lb.nonce_len,
        encrypt_cids: lb.key.is_some(),
        keys: keys.to_bytes(),
        cid_lifetime: (cfg.args.cid_lifetime > 0)
            .then(|| Duration::from_secs(cfg.args.cid_lifetime)),

        cpu: None,
        cert_pem: cert.chain,
        key_pem: cert.key,
        serve: ServeOptions {
            root: cfg.args.root.clone(),
            max_bytes: cfg.args.max_bytes,
            file_cache_bytes: cfg.args.file_cache_mb << 20,
            cache_control: cfg.args.cache_control.clone(),
            upstream: cfg.upstream.clone(),
            upstream_timeout: Duration::from_secs(cfg.args.upstream_timeout),
            retry: cfg.args.retry,
            idle_timeout: Duration::from_secs(cfg.args.idle_timeout),
            sink: cfg.args.worker_mode == config::WorkerMode::Sink,
        },
    };

    let metrics_addr = match cfg.metrics {
        Some(addr) => {
            let bound = metrics::exposition::serve(addr, counters.clone(), liveness.clone())?;
            tracing::info!(%bound, "metrics at http://{bound}/metrics");
            Some(bound)
        }
        None => None,
    };
    let setup = forward::Setup {
        instances: cfg.instances,
        lanes,
        ring: &cfg.ring,
        shed_at: cfg.shed_at_slots(),
    };
    let mode = cfg.args.forward;
    let serve = Serve {
        cfg: cfg.clone(),
        template,
        public,
        router,
        counters,
        liveness,
        signals,
        metrics_addr,
    };
    forward::start(mode, setup, serve).context("creating the forwarding mode's ingress")?
}

/// Everything the demux runs, once the forwarding mode exists.
struct Serve {
    cfg: Config,
    template: Handoff,
    public: dataplane::PublicSocket,
    router: Router,
    counters: Arc<Counters>,
    liveness: Arc<Liveness>,
    signals: nix::sys::signalfd::SignalFd,
    metrics_addr: Option<SocketAddr>,
}

impl forward::WithForward for Serve {
    type Output = Result<()>;

    /// Starts the workers, then the data plane, supervises until shutdown.
    fn run<F: Forward>(self, forward: F, handles: Vec<IngressHandles>) -> Result<()> {
        let Serve {
            cfg,
            template,
            public,
            router,
            counters,
            liveness,
            signals,
            metrics_addr,
        } = self;
        let public_addr = public.socket().local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let (link, control) = DataPlaneLink::new(stop.clone(), liveness);
        let public_fd: OwnedFd = public.socket().try_clone()?.into();
        let mut sup = supervisor::Supervisor::new(
            cfg.clone(),
            template,
            public_fd,
            counters.clone(),
            link,
            signals,
        )?;
        sup.start_all(handles)?;

        let dp = DataPlane::new(
            public,
            router,
            forward,
            counters.clone(),
            cfg.args.recv_batch,
            Duration::from_secs(cfg.args.stall_secs),
        );
        let cpu = cfg.demux_cpu();
        let data_plane = std::thread::Builder::new()
            .name("data-plane".into())
            .spawn(move || {
                if let Some(cpu) = cpu {
                    pin(cpu);
                }
                dp.run(control)
            })?;
        tracing::info!(
            listen = %public_addr,
            instances = cfg.instances,
            forward = ?cfg.args.forward,
            "serving https://{}/",
            display_addr(public_addr)
        );
        // One machine-readable line on stdout for scripts and tests: the bound addresses.
        println!(
            "ringmux ready listen={public_addr} metrics={} pid={}",
            metrics_addr.map_or("off".to_string(), |a| a.to_string()),
            std::process::id()
        );
        let result = sup.run();
        stop.store(true, Ordering::Relaxed);
        let _ = data_plane.join();
        let received = counters.received.load(Ordering::Relaxed);
        tracing::info!(
            received,
            forwarded = counters.forwarded_total(),
            dropped = counters.dropped_total(),
            "stopped"
        );
        result
    }
}

/// Binds the public socket: dual-stack for `[::]`, large buffers (forced past the sysctl limits
/// when privileged), non-blocking.
fn bind_public(cfg: &Config) -> Result<std::net::UdpSocket> {
    use socket2::{Domain, Protocol, Socket, Type};
    let addr: SocketAddr = cfg.args.listen;
    let s = Socket::new(
        Domain::for_address(addr),
        Type::DGRAM.cloexec(),
        Some(Protocol::UDP),
    )?;
    if addr.is_ipv6() && addr.ip().is_unspecified() {
        s.set_only_v6(false)
            .context("enabling dual-stack on [::]")?;
    }
    // Fails when not privileged: the plain sizes below are then capped by the sysctl limits.
    let _ = sys::force_buffer(s.as_fd(), false, cfg.args.rcvbuf);
    let _ = sys::force_buffer(s.as_fd(), true, cfg.args.sndbuf);
    if s.recv_buffer_size().unwrap_or(0) < cfg.args.rcvbuf {
        let _ = s.set_recv_buffer_size(cfg.args.rcvbuf);
    }
    if s.send_buffer_size().unwrap_or(0) < cfg.args.sndbuf {
        let _ = s.set_send_buffer_size(cfg.args.sndbuf);
    }
    // Linux reports twice the size it grants (it counts its own overhead).
    let got = s.recv_buffer_size().unwrap_or(0) / 2;
    if got < cfg.args.rcvbuf {
        tracing::warn!(
            requested = cfg.args.rcvbuf,
            got,
            "receive buffer capped by net.core.rmem_max (see scripts/launch.sh)"
        );
    }
    s.bind(&addr.into())
        .with_context(|| format!("binding {addr} (--listen / RINGMUX_LISTEN)"))?;
    s.set_nonblocking(true)?;
    Ok(s.into())
}

fn pin(cpu: usize) {
    if let Err(e) = sys::pin_to_cpu(cpu) {
        tracing::warn!(cpu, error = %e, "could not pin the data plane to CPU");
    }
}

fn display_addr(a: SocketAddr) -> String {
    match a {
        SocketAddr::V6(v) if v.ip().is_unspecified() => format!("[::1]:{}", v.port()),
        SocketAddr::V4(v) if v.ip().is_unspecified() => format!("127.0.0.1:{}", v.port()),
        a => a.to_string(),
    }
}
