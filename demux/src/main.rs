//! `ringmux`: the demux and supervisor. See `ringmux --help`, README.md and DESIGN.md.
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(clippy::undocumented_unsafe_blocks)]

mod alloc;
mod config;
mod dataplane;
mod metrics;
mod sessions;
mod supervisor;

use std::net::SocketAddr;
use std::os::fd::{AsRawFd, OwnedFd};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Parser;
use ringmux_quic_lb::{KeySet, QuicLbConfig, Router};
use ringmux_ring::Producer;
use ringmux_worker::control::{Handoff, IngressKind};
use ringmux_worker::tls::CertChain;

use config::{Cli, Command, Config, ForwardMode};
use dataplane::{DataPlane, DataPlaneLink, Forwarder, IngressHandles};
use metrics::Counters;

#[global_allocator]
static ALLOC: alloc::CountingAlloc = alloc::CountingAlloc;

fn main() -> ExitCode {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let result = match cli.command {
        Some(Command::Stats { metrics }) => {
            metrics::fetch(&metrics).map(|text| print!("{}", metrics::stats_table(&text)))
        }
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
    let signals = supervisor::block_signals().context("setting up signal handling")?;
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
    let chain = match (&cfg.args.cert, &cfg.args.key) {
        (Some(c), Some(k)) => CertChain::from_pem_files(c, k)?,
        _ => CertChain::self_signed()?,
    };
    let (cert_pem, key_pem) = chain.to_pem();

    let public =
        dataplane::PublicSocket::new(bind_public(&cfg)?, cfg.args.ecn == config::Toggle::On)
            .context("configuring the public socket")?;
    let public_addr = public.socket().local_addr()?;

    let counters = Arc::new(Counters::new(cfg.instances));
    let mut rings = Vec::new();
    let mut handles = Vec::new();
    let mut unix_ends = Vec::new();
    for i in 0..cfg.instances {
        match cfg.args.forward {
            ForwardMode::Shm | ForwardMode::Drop => {
                let mut p = Producer::create(&cfg.ring).context("creating a ring")?;
                p.watch_doorbell(counters.ringing.clone(), u32::from(i) + 1);
                handles.push(dataplane::shm_handles(&p)?);
                rings.push(p);
            }
            ForwardMode::Unix => {
                let (ours, theirs) =
                    dataplane::unix_pair().context("creating a unix forwarding socket")?;
                unix_ends.push(ours);
                handles.push(IngressHandles::Unix(theirs));
            }
        }
    }
    let forwarder = match cfg.args.forward {
        ForwardMode::Shm => Forwarder::Shm(rings),
        ForwardMode::Drop => Forwarder::Drop(rings),
        ForwardMode::Unix => Forwarder::Unix(unix_ends),
    };
    let template = Handoff {
        instance: 0,
        instances: cfg.instances,
        generation: 1,
        ingress: if cfg.args.forward == ForwardMode::Unix {
            IngressKind::Unix
        } else {
            IngressKind::Shm
        },
        spin_us: cfg.ring.spin_us,
        public_addr,
        config_id: lb.config_id,
        node_id: lb.node_id.clone(),
        nonce_len: lb.nonce_len,
        encrypt_cids: lb.key.is_some(),
        keys: keys.to_bytes(),
        cid_lifetime: (cfg.args.cid_lifetime > 0)
            .then(|| Duration::from_secs(cfg.args.cid_lifetime)),
        root: cfg.args.root.clone(),
        max_bytes: cfg.args.max_bytes,
        file_cache_bytes: cfg.args.file_cache_mb << 20,
        cache_control: cfg.args.cache_control.clone(),
        retry: cfg.args.retry,
        idle_timeout: Duration::from_secs(cfg.args.idle_timeout),
        cpu: None,
        cert_pem,
        key_pem,
        sink: cfg.args.worker_mode == config::WorkerMode::Sink,
    };

    let metrics_addr = match cfg.metrics {
        Some(addr) => {
            let bound = metrics::serve(addr, counters.clone())?;
            tracing::info!(%bound, "metrics at http://{bound}/metrics");
            Some(bound)
        }
        None => None,
    };
    let stop = Arc::new(AtomicBool::new(false));
    let (link, control) = DataPlaneLink::new(stop.clone());
    let public_fd: OwnedFd = public.socket().try_clone()?.into();
    let mut sup = supervisor::Supervisor::new(
        cfg.clone(),
        template,
        public_fd,
        counters.clone(),
        link,
        signals,
    );
    sup.start_all(handles)?;

    let dp = DataPlane::new(
        public,
        router,
        forwarder,
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
    force_buffer(&s, libc::SO_RCVBUFFORCE, cfg.args.rcvbuf);
    force_buffer(&s, libc::SO_SNDBUFFORCE, cfg.args.sndbuf);
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

fn force_buffer(s: &socket2::Socket, opt: libc::c_int, bytes: usize) {
    let v = bytes.min(i32::MAX as usize / 2) as libc::c_int;
    // SAFETY: setsockopt with a valid int; failure (not privileged) is fine, we fall back.
    unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            opt,
            (&v as *const libc::c_int).cast(),
            4,
        );
    }
}

fn pin(cpu: usize) {
    let ok = core_affinity::get_core_ids()
        .and_then(|ids| ids.into_iter().find(|c| c.id == cpu))
        .is_some_and(core_affinity::set_for_current);
    if !ok {
        tracing::warn!(cpu, "could not pin the data plane to CPU");
    }
}

fn display_addr(a: SocketAddr) -> String {
    match a {
        SocketAddr::V6(v) if v.ip().is_unspecified() => format!("[::1]:{}", v.port()),
        SocketAddr::V4(v) if v.ip().is_unspecified() => format!("127.0.0.1:{}", v.port()),
        a => a.to_string(),
    }
}
