//! `ringmux`: the demux and supervisor. See `ringmux --help` and README.md; the parts
//! live in the library (`lib.rs`).
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(clippy::undocumented_unsafe_blocks)]

use std::io::Write;
use std::net::SocketAddr;
use std::os::fd::AsFd;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use ringmux_proto::{Handoff, IngressKind};
use ringmux_quic_lb::{KeySet, QuicLbConfig, Router};

use ringmux_demux::admission::Admission;
use ringmux_demux::certs::CertPem;
use ringmux_demux::config::{self, Command, Config};
use ringmux_demux::dataplane::{self, DataPlane, DataPlaneLink, Liveness};
use ringmux_demux::forward::{self, Forward, IngressHandles};
use ringmux_demux::metrics::{self, Counters};
use ringmux_demux::sessions::Sessions;
use ringmux_demux::supervisor::control;
use ringmux_demux::tickets::{HelloInspector, TicketBindings};
use ringmux_demux::{alloc, lbconfig, logs, supervisor, sys, upgrade};
use ringmux_proto::sites::SiteTable;

#[global_allocator]
static ALLOC: alloc::CountingAlloc = alloc::CountingAlloc;

fn main() -> ExitCode {
    // First of all, before reading a single argument: every `execve` makes a process dumpable
    // again, and a new image of the demux (`ringmux upgrade`) holds the hand-over's keys,
    // rings and sessions from its first instruction. While dumpable, any process of its user
    // could open its memory.
    if let Err(e) = sys::make_non_dumpable() {
        let _ = writeln!(
            std::io::stderr(),
            "ringmux: making the process non-dumpable: {e}"
        );
        return ExitCode::FAILURE;
    }
    let cli = match config::parse() {
        Ok(cli) => cli,
        Err(e) => {
            if let Some(e) = e.downcast_ref::<clap::Error>() {
                e.exit();
            }
            let _ = writeln!(std::io::stderr(), "ringmux: {e:#}");
            return ExitCode::FAILURE;
        }
    };
    if let Err(e) = logs::start() {
        let _ = writeln!(std::io::stderr(), "ringmux: starting the log thread: {e}");
        return ExitCode::FAILURE;
    }
    let result = match cli.command {
        Some(Command::Stats { metrics }) => {
            metrics::fetch(metrics.as_str()).and_then(|m| print(&metrics::stats::table(&m)))
        }
        Some(Command::Reload {
            control_socket,
            timeout,
        }) => supervisor::control::request(
            &control_socket,
            &control::Request::Reload,
            Duration::from_secs(timeout),
        ),
        Some(Command::Upgrade {
            control_socket,
            timeout,
        }) => supervisor::control::request(
            &control_socket,
            &control::Request::Upgrade,
            Duration::from_secs(timeout),
        ),
        Some(Command::Acme {
            command:
                config::AcmeCommand::Renew {
                    name,
                    control_socket,
                    timeout,
                },
        }) => supervisor::control::request(
            &control_socket,
            &control::Request::AcmeRenew(name),
            Duration::from_secs(timeout),
        ),
        Some(Command::LbConfig {
            balancer: lbconfig::Balancer::Nftables(args),
        }) => args
            .validate()
            .and_then(|plan| print(&lbconfig::nftables(&plan))),
        Some(Command::NewKeyFile { path }) => new_key_file(&path),
        Some(Command::UpgradeCheck) => print(&format!("{}\n", upgrade::Compat::ours().line())),
        Some(Command::Check { run }) => check(*run),
        None => cli.run.validate().and_then(run),
    };
    // What is queued goes out before the process does.
    logs::flush(Duration::from_secs(1));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // Written directly: a standard error that fails loses the line, nothing more.
            let _ = writeln!(std::io::stderr(), "ringmux: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// `ringmux check`: the configuration checked as a start checks it, and the certificate of the
/// command line's site loaded; what would serve is printed, or every problem.
fn check(run: config::RunArgs) -> Result<()> {
    let mut problems: Vec<String> = run
        .file
        .as_ref()
        .map(|f| f.problems.iter().map(|p| p.to_string()).collect())
        .unwrap_or_default();
    let cfg = match run.validate() {
        Ok(cfg) if problems.is_empty() => cfg,
        Ok(_) => anyhow::bail!("{}", problems.join("\n")),
        Err(e) => {
            problems.push(format!("{e:#}"));
            anyhow::bail!("{}", problems.join("\n"))
        }
    };
    let summary = match &cfg.sites {
        Some(table) => {
            let mut s = String::new();
            for site in &table.sites {
                s.push_str(&format!(
                    "site {}: names {}; {} route(s){}\n",
                    site.label,
                    site.names.join(", "),
                    site.routes.len(),
                    if site.acme {
                        "; certificate by ACME"
                    } else {
                        ""
                    }
                ));
            }
            if let Some(acme) = &cfg.acme {
                s.push_str(&format!(
                    "acme: {} by {}, state in {}\n",
                    acme.directory,
                    match acme.challenge {
                        ringmux_demux::acme::ChallengeKind::TlsAlpn01 => "tls-alpn-01",
                        ringmux_demux::acme::ChallengeKind::Http01 => "http-01",
                    },
                    acme.state.display()
                ));
            }
            s
        }
        None => {
            if let (Some(c), Some(k)) = (&cfg.args.cert, &cfg.args.key) {
                CertPem::load(c, k).context("--cert / RINGMUX_CERT and --key / RINGMUX_KEY")?;
            }
            "one site from the command line, answering every name\n".to_string()
        }
    };
    print(&format!("{summary}configuration OK\n"))
}

/// Writes `text` to standard output: a command's answer (an output closed early is an error,
/// not a panic).
fn print(text: &str) -> Result<()> {
    std::io::stdout()
        .write_all(text.as_bytes())
        .context("writing to standard output")
}

/// `ringmux new-key-file PATH`: fresh keys, written with mode 0600 to a file that must not
/// exist yet (a key file in use is never replaced by accident).
fn new_key_file(path: &std::path::Path) -> Result<()> {
    KeySet::generate()
        .context("generating keys")?
        .write_new(path)
        .with_context(|| {
            format!(
                "creating the key file {} (it must not exist yet: remove it first to replace it, \
                 and its folder must exist)",
                path.display()
            )
        })?;
    let _ = writeln!(
        std::io::stderr(),
        "ringmux: wrote {} (mode 0600); give the same file to every node behind one balancer \
         (--key-file)",
        path.display()
    );
    Ok(())
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
            "workers run as root (--worker-user root, or ringmux lacks CAP_SETUID): confined \
             by the system-call filter and without capabilities, but they own every root-owned \
             file, the demux's /proc files among them (one can make the demux the OOM killer's \
             first choice). Leave --worker-user (RINGMUX_WORKER_USER) out, as root, to run them \
             as nobody"
        );
    }
    match upgrade::inherited() {
        None => fresh(cfg, signals),
        Some(inherited) => resume(cfg, signals, inherited?),
    }
}

/// The `--forward` mode's name, as the hand-over state records it.
fn forward_name(cfg: &Config) -> String {
    use clap::ValueEnum;
    cfg.args
        .forward
        .to_possible_value()
        .map_or_else(String::new, |v| v.get_name().to_string())
}

/// The QUIC-LB configuration and router of `cfg` with `keys`.
fn routing(cfg: &Config, keys: &KeySet) -> Result<(QuicLbConfig, Router)> {
    let lb = QuicLbConfig {
        config_id: cfg.args.config_id,
        node_id: cfg.node_id.clone(),
        instance_count: cfg.instances,
        nonce_len: cfg.nonce_len,
        key: (!cfg.args.plaintext_cids).then_some(keys.quic_lb),
    };
    lb.validate()
        .context("QUIC-LB configuration (--node-id, --config-id, --nonce-len, --instances)")?;
    let router = Router::new(&lb, keys.routing_hash).context("QUIC-LB router")?;
    Ok((lb, router))
}

/// What every worker is handed, apart from its own descriptors and numbers.
fn template(
    cfg: &Config,
    lb: &QuicLbConfig,
    keys: &KeySet,
    sites: &SiteTable,
    public_addr: SocketAddr,
) -> supervisor::Template {
    let handoff = Handoff {
        instance: 0,
        instances: cfg.instances,
        generation: 1,
        worker_generation: 1,
        // Both set per worker from its ingress descriptors.
        ingress: IngressKind::default(),
        spin: cfg.spin,
        public_addr,
        tcp: cfg.args.tcp_on(),
        redirect: cfg.args.redirect_http.is_some(),
        access_log: cfg.access_log() != config::AccessLog::Off,
        config_id: lb.config_id,
        node_id: lb.node_id.clone(),
        nonce_len: lb.nonce_len,
        encrypt_cids: lb.key.is_some(),
        keys: keys.to_bytes(),
        cid_lifetime: (cfg.args.cid_lifetime > 0)
            .then(|| Duration::from_secs(cfg.args.cid_lifetime)),

        cpu: None,
        idle_timeout: Duration::from_secs(cfg.args.idle_timeout),
        alt_svc: cfg.alt_svc(public_addr.port()),
    };
    supervisor::Template::new(handoff, sites)
}

/// The data plane's admission of new connections and the session threads, sharing one table
/// of ticket bindings: admission reads the ClientHellos it lets in, the session threads hold
/// TAKEs to them. Kernel steering shows the demux no ClientHello: nothing to hold TAKEs to.
fn admission_and_sessions(
    cfg: &Config,
    router: &Router,
    token_key: &[u8; 64],
    counters: &Arc<Counters>,
) -> (Admission, Sessions) {
    let tickets = Arc::new(TicketBindings::new());
    let gated = cfg
        .args
        .forward
        .demux_sees_handshakes()
        .then(|| tickets.clone());
    let sessions = Sessions::new(gated, counters.clone());
    let admission = Admission::new(
        cfg.admission(),
        router.clone(),
        token_key,
        HelloInspector::new(tickets),
    );
    (admission, sessions)
}

/// A first start: bind, make the rings, start the workers.
fn fresh(cfg: Config, signals: nix::sys::signalfd::SignalFd) -> Result<()> {
    let keys = match &cfg.args.key_file {
        Some(p) => KeySet::load(p).context("--key-file / RINGMUX_KEY_FILE")?,
        None => KeySet::generate().context("generating keys")?,
    };
    let sites = match &cfg.sites {
        Some(sites) => sites.clone(),
        None => cfg.site_table(match (&cfg.args.cert, &cfg.args.key) {
            (Some(c), Some(k)) => {
                CertPem::load(c, k).context("--cert / RINGMUX_CERT and --key / RINGMUX_KEY")?
            }
            _ => CertPem::self_signed()?,
        }),
    };
    let (udp, https) = bind_public_and_tcp(&cfg)?;
    let tcp = supervisor::TcpListeners {
        https,
        redirect: match cfg.args.redirect_http {
            Some(addr) => Some(
                sys::tcp_listener(addr)
                    .with_context(|| format!("listening on TCP {addr} (--redirect-http)"))?
                    .into(),
            ),
            None => None,
        },
    };
    let demux = Demux::new(cfg, signals, keys, sites, udp)?;
    let metrics = match demux.cfg.metrics {
        Some(addr) => Some(metrics::exposition::bind(addr)?),
        None => None,
    };
    demux.serve(metrics, tcp, Start::Fresh)
}

/// A start by `ringmux upgrade`: take over what the previous image handed over. A state this
/// image cannot use sends it back to the previous binary, which serves on and says why.
fn resume(
    cfg: Config,
    signals: nix::sys::signalfd::SignalFd,
    inherited: upgrade::Inherited,
) -> Result<()> {
    let back = |refusal: upgrade::Refusal| -> anyhow::Error {
        let why = refusal.reason();
        if inherited.refused.is_some() {
            // Already the previous binary, gone back to: no further back.
            return anyhow::anyhow!("the hand-over state was refused twice: {why}");
        }
        tracing::error!(reason = %why, "refusing the hand-over; going back to the previous binary");
        anyhow::Error::new(upgrade::go_back(&inherited, &why)).context(format!(
            "refusing the hand-over ({why}); going back to the previous binary failed"
        ))
    };
    let state = inherited.parse().map_err(back)?;
    let taken = state
        .take(&forward_name(&cfg), cfg.instances)
        .map_err(back)?;
    upgrade::forget_fallback();
    let keys = hex::decode(&taken.keys)
        .ok()
        .and_then(|b| KeySet::from_bytes(&b).ok())
        .context("the hand-over's keys")?;
    let sites = SiteTable::from_json(taken.sites.as_bytes())
        .map_err(|e| anyhow::anyhow!("the hand-over's {e}"))?;
    let udp = std::net::UdpSocket::from(taken.public);
    // The same command line runs again: a difference means another configuration after all.
    if taken.tcp.is_some() != cfg.tcp_addr(udp.local_addr()?).is_some() {
        anyhow::bail!("--tcp differs from the running demux's: restart ringmux to change it")
    }
    if taken.redirect.is_some() != cfg.args.redirect_http.is_some() {
        anyhow::bail!(
            "--redirect-http differs from the running demux's: restart ringmux to change it"
        )
    }
    let tcp = supervisor::TcpListeners {
        https: taken.tcp,
        redirect: taken.redirect,
    };
    let demux = Demux::new(cfg, signals, keys, sites, udp)?;
    let counters = &demux.counters;
    counters.restore(&taken.counters);
    match &inherited.refused {
        None => counters.upgrades.fetch_add(1, Ordering::Relaxed),
        Some(_) => counters.upgrades_failed.fetch_add(1, Ordering::Relaxed),
    };
    counters.upgrade_queued_bytes.store(
        sys::queued_bytes(demux.public.socket().as_fd()).unwrap_or(0),
        Ordering::Relaxed,
    );
    let metrics = match (taken.metrics, demux.cfg.metrics) {
        (Some(fd), _) => Some(std::net::TcpListener::from(fd)),
        (None, Some(addr)) => Some(metrics::exposition::bind(addr)?),
        (None, None) => None,
    };
    let mut ingress = Vec::with_capacity(demux.lanes());
    let mut workers = Vec::with_capacity(demux.lanes());
    for (lane, l) in taken.lanes.into_iter().enumerate() {
        // Up before the data plane starts, which is before the supervisor is set up.
        if l.phase != upgrade::LanePhase::Idle {
            demux.liveness.set_up(lane, true);
        }
        ingress.push(l.ingress);
        workers.push((l.generation, l.phase, l.worker));
    }
    let sessions = taken
        .sessions
        .into_iter()
        .filter_map(|e| {
            Some(ringmux_demux::sessions::Frozen {
                key: hex::decode(e.key).ok()?,
                value: hex::decode(e.value).ok()?,
                age: Duration::from_millis(e.age_ms),
                // An instance this image does not have (the count is the same across an
                // upgrade, so only a forged state) is held to the global limits alone.
                instance: e.instance.filter(|i| *i < demux.cfg.instances),
            })
        })
        .collect();
    let control = taken.control.map(|l| {
        (
            l,
            demux.cfg.args.control_socket.clone().into(),
            taken.answers,
        )
    });
    let answer = match &inherited.refused {
        None => format!(
            "ok upgraded: pid {} serves with {}",
            std::process::id(),
            taken.binary.display()
        ),
        Some(why) => format!(
            "error: the new binary refused the hand-over: {why}; the previous demux serves on"
        ),
    };
    let resumed = Resumed {
        adopted: supervisor::Adopted {
            active_generation: taken.active_generation,
            sessions,
            lanes: workers,
            control,
            binary: taken.binary.clone(),
        },
        answer,
        last_recv_ns: taken.last_recv_ns,
    };
    demux.serve(metrics, tcp, Start::Resume(ingress, resumed))
}

/// What a first start and a start by `ringmux upgrade` build alike, around the keys, the
/// certificate and the public socket each came by its own way: the routing, the counters and
/// liveness, the workers' template. [`Demux::serve`] builds the rest and runs.
struct Demux {
    cfg: Config,
    signals: nix::sys::signalfd::SignalFd,
    keys: KeySet,
    router: Router,
    template: supervisor::Template,
    public: dataplane::PublicSocket,
    counters: Arc<Counters>,
    liveness: Arc<Liveness>,
}

/// How [`Demux::serve`] comes by the forwarding mode's ingresses.
enum Start {
    /// Made anew, with the workers to start on them.
    Fresh,
    /// Handed over by the previous image (one entry per lane), its workers running on them.
    Resume(Vec<Option<upgrade::Ingress>>, Resumed),
}

impl Demux {
    fn new(
        cfg: Config,
        signals: nix::sys::signalfd::SignalFd,
        keys: KeySet,
        sites: SiteTable,
        udp: std::net::UdpSocket,
    ) -> Result<Demux> {
        let (lb, router) = routing(&cfg, &keys)?;
        let public = dataplane::PublicSocket::new(udp, cfg.args.ecn == config::Toggle::On)
            .context("configuring the public socket")?;
        let public_addr = public.socket().local_addr()?;
        let lanes = router.lanes();
        let counters = Arc::new(Counters::new(cfg.instances, lanes).with_sites(&sites));
        logs::count_into(counters.clone());
        if let Ok(mut p) = counters.program.write() {
            *p = cfg.worker_label();
        }
        let template = template(&cfg, &lb, &keys, &sites, public_addr);
        Ok(Demux {
            signals,
            keys,
            router,
            template,
            public,
            counters,
            liveness: Liveness::new(lanes),
            cfg,
        })
    }

    /// Lanes in all (instances × generation slots).
    fn lanes(&self) -> usize {
        self.router.lanes()
    }

    /// Serves the metrics on `metrics`, builds the forwarding mode (`start`) and runs
    /// everything on it until shutdown.
    fn serve(
        self,
        metrics: Option<std::net::TcpListener>,
        tcp: supervisor::TcpListeners,
        start: Start,
    ) -> Result<()> {
        let Demux {
            cfg,
            signals,
            keys,
            router,
            template,
            public,
            counters,
            liveness,
        } = self;
        let (metrics_addr, metrics_listener) = serve_metrics(metrics, &counters, &liveness)?;
        let setup = forward::Setup {
            instances: cfg.instances,
            lanes: router.lanes(),
            ring: &cfg.ring,
            shed_at: cfg.shed_at_slots(),
            // Only a mode whose lanes join the public socket's group needs a duplicate of it.
            public: match cfg.args.forward.workers_receive() {
                true => Some(forward::Public {
                    socket: public.socket().try_clone()?.into(),
                    router: router.clone(),
                    rcvbuf: cfg.args.rcvbuf,
                    sndbuf: cfg.args.sndbuf,
                }),
                false => None,
            },
        };
        let mode = cfg.args.forward;
        let (admission, sessions) = admission_and_sessions(&cfg, &router, &keys.token, &counters);
        let (ingress, resume) = match start {
            Start::Fresh => (None, None),
            Start::Resume(ingress, resumed) => (Some(ingress), Some(resumed)),
        };
        let serve = Serve {
            cfg: cfg.clone(),
            template,
            public,
            router,
            counters,
            liveness,
            signals,
            metrics_addr,
            metrics_listener,
            keys: hex::encode(keys.to_bytes()),
            admission,
            sessions,
            resume,
            tcp,
        };
        match ingress {
            None => forward::start(mode, setup, serve)
                .context("creating the forwarding mode's ingress")?,
            Some(ingress) => {
                forward::adopt(mode, setup, ingress, serve).context("taking over the rings")?
            }
        }
    }
}

/// Serves the metrics on `listener`, keeping a duplicate of it to hand over on an upgrade.
fn serve_metrics(
    listener: Option<std::net::TcpListener>,
    counters: &Arc<Counters>,
    liveness: &Arc<Liveness>,
) -> Result<(Option<SocketAddr>, Option<std::net::TcpListener>)> {
    let Some(listener) = listener else {
        return Ok((None, None));
    };
    let kept = listener.try_clone()?;
    let bound = metrics::exposition::serve_on(listener, counters.clone(), liveness.clone())?;
    tracing::info!(%bound, "metrics at http://{bound}/metrics");
    Ok((Some(bound), Some(kept)))
}

/// What a resumed image does differently.
struct Resumed {
    adopted: supervisor::Adopted,
    /// The last line for the clients that asked for the upgrade.
    answer: String,
    /// When the previous image received its last datagram (`CLOCK_MONOTONIC`, ns).
    last_recv_ns: u64,
}

/// Everything the demux runs, once the forwarding mode exists.
struct Serve {
    cfg: Config,
    template: supervisor::Template,
    public: dataplane::PublicSocket,
    router: Router,
    counters: Arc<Counters>,
    liveness: Arc<Liveness>,
    signals: nix::sys::signalfd::SignalFd,
    metrics_addr: Option<SocketAddr>,
    /// A duplicate of the metrics listener, to hand over.
    metrics_listener: Option<std::net::TcpListener>,
    /// The shared keys, hex (`KeySet::to_bytes`), to hand over.
    keys: String,
    /// The data plane's admission of new connections (it mints with the shared token key, and
    /// binds the tickets of the ClientHellos it lets in to their instance).
    admission: Admission,
    /// The session threads, held to those bindings.
    sessions: Sessions,
    resume: Option<Resumed>,
    /// The listening TCP sockets every worker accepts from (`--tcp on`, `--redirect-http`).
    tcp: supervisor::TcpListeners,
}

impl forward::WithForward for Serve {
    type Output = Result<()>;

    /// Starts (or takes over) the workers, then the data plane, supervises until shutdown;
    /// carries out an upgrade when asked for one (and serves on if it fails).
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
            metrics_listener,
            keys,
            admission,
            sessions,
            resume,
            tcp,
        } = self;
        let public_addr = public.socket().local_addr()?;
        // The ACME engine, with the certificates it has stored in the workers' site table.
        let mut table = SiteTable::from_json(template.sites.as_bytes())?;
        let acme = supervisor::acme::Relay::start(&cfg, &mut table, router.lanes())?;
        let template = match acme {
            Some(_) => supervisor::Template::new(template.handoff, &table),
            None => template,
        };
        metrics::counters::set_certificates(&counters, &table);
        let stop = Arc::new(AtomicBool::new(false));
        let (link, control) = DataPlaneLink::new(stop.clone(), liveness);
        let active_generation = match &resume {
            Some(r) => r.adopted.active_generation,
            None => counters.active_generation.load(Ordering::Relaxed),
        };
        let dp = DataPlane::new(
            public,
            router,
            forward,
            counters.clone(),
            admission,
            cfg.args.recv_batch,
            Duration::from_secs(cfg.args.stall_secs),
        )
        .with_active_slot(ringmux_proto::generation_slot(active_generation))
        .resumed_after(resume.as_ref().map(|r| r.last_recv_ns));
        let cpu = cfg.demux_cpu();
        let start = move |dp: DataPlane<F>, control: dataplane::Control| {
            std::thread::Builder::new()
                .name("data-plane".into())
                .spawn(move || {
                    if let Some(cpu) = cpu {
                        pin(cpu);
                    }
                    dp.run(control)
                })
        };
        let (mut sup, answer, mut data_plane) = match resume {
            None => {
                let mut sup = supervisor::Supervisor::new(
                    cfg.clone(),
                    template,
                    public_addr,
                    counters.clone(),
                    link,
                    signals,
                    sessions,
                )?;
                sup.serve_tcp(tcp);
                sup.relay_acme(acme);
                sup.start_all(handles)?;
                (sup, None, start(dp, control)?)
            }
            Some(r) => {
                // The workers never stopped and the rings are taken over: forward at once
                // (the datagrams wait in the socket's queue meanwhile) and set up the rest of
                // the supervisor while the data plane runs. Its lanes are marked up already.
                let data_plane = start(dp, control)?;
                match supervisor::Supervisor::adopt(
                    cfg.clone(),
                    template,
                    public_addr,
                    counters.clone(),
                    link,
                    signals,
                    sessions,
                    r.adopted,
                ) {
                    Ok(mut sup) => {
                        sup.serve_tcp(tcp);
                        sup.relay_acme(acme);
                        (sup, Some(r.answer), data_plane)
                    }
                    Err(e) => {
                        stop.store(true, Ordering::Relaxed);
                        let _ = data_plane.join();
                        return Err(e);
                    }
                }
            }
        };
        let mut first = true;
        loop {
            if first {
                first = false;
                tracing::info!(
                    listen = %public_addr,
                    instances = cfg.instances,
                    forward = ?cfg.args.forward,
                    "serving https://{}/",
                    display_addr(public_addr)
                );
                // One machine-readable line on stdout for scripts and tests: the bound addresses
                // (a standard output that fails loses it; ringmux serves on).
                let _ = writeln!(
                    std::io::stdout(),
                    "ringmux ready listen={public_addr} metrics={} pid={}",
                    metrics_addr.map_or("off".to_string(), |a| a.to_string()),
                    std::process::id()
                );
                if let Some(line) = &answer {
                    sup.answer_upgrade(line);
                }
            }
            let outcome = sup.run();
            stop.store(true, Ordering::Relaxed);
            let Ok((mut dp, control)) = data_plane.join() else {
                anyhow::bail!("the data plane panicked");
            };
            let upgrade = match outcome {
                Ok(supervisor::Outcome::Upgrade(u)) => u,
                done => {
                    let received = counters.received.load(Ordering::Relaxed);
                    tracing::info!(
                        received,
                        forwarded = counters.forwarded_total(),
                        dropped = counters.dropped_total(),
                        "stopped"
                    );
                    return done.map(|_| ());
                }
            };
            let why = hand_over(
                &cfg,
                &mut sup,
                &mut dp,
                &upgrade,
                &counters,
                metrics_listener.as_ref(),
                &keys,
            );
            sup.upgrade_failed(upgrade, &why);
            stop.store(false, Ordering::Relaxed);
            data_plane = start(dp, control)?;
        }
    }
}

/// Hands everything over to the binary of `upgrade` and executes it; returns only if that
/// failed, saying why.
fn hand_over<F: Forward>(
    cfg: &Config,
    sup: &mut supervisor::Supervisor,
    dp: &mut DataPlane<F>,
    upgrade: &supervisor::Upgrade,
    counters: &Counters,
    metrics: Option<&std::net::TcpListener>,
    keys: &str,
) -> String {
    use std::os::fd::AsRawFd;
    let exported = match sup.export(upgrade) {
        Ok(e) => e,
        Err(e) => return format!("{e:#}"),
    };
    let (public_fd, ingress) = match dp.export() {
        Ok(x) => x,
        Err(e) => return format!("exporting the rings: {e}"),
    };
    let lanes = exported
        .lanes
        .into_iter()
        .zip(ingress)
        .map(
            |((generation, phase, worker), ingress)| upgrade::LaneState {
                generation,
                phase,
                worker,
                ingress,
            },
        )
        .collect();
    let state = upgrade::State {
        compat: upgrade::Compat::ours(),
        forward: forward_name(cfg),
        instances: cfg.instances,
        keys: keys.to_string(),
        sites: exported.sites,
        public_fd,
        metrics_fd: metrics.map(|m| m.as_raw_fd()),
        tcp_fd: sup.tcp_fds().https,
        redirect_fd: sup.tcp_fds().redirect,
        control_fd: exported.control_fd,
        answer_fds: exported.answer_fds,
        active_generation: exported.active_generation,
        counters: counters.snapshot(),
        sessions: exported.sessions,
        lanes,
        last_recv_ns: dp.last_recv_ns(),
        argv: upgrade::argv(),
        binary: upgrade.binary.clone().into_os_string().into_encoded_bytes(),
    };
    tracing::info!(binary = %upgrade.binary.display(), "upgrade: handing over");
    // The new image reads the workers' pipes on: nothing read may stay unwritten here.
    let parked = logs::park(Duration::from_secs(1));
    logs::flush(Duration::from_secs(1));
    let e = upgrade::exec(&upgrade.binary, &state);
    drop(parked);
    format!("executing {}: {e}", upgrade.binary.display())
}

/// Binds the public socket: dual-stack for `[::]`, large buffers (forced past the sysctl limits
/// when privileged), non-blocking.
/// The public UDP socket and, with `--tcp on`, the HTTPS listener on the same port (or on
/// `--tcp-listen`). With `--listen` at port 0 the kernel picks a port free for UDP, which a
/// TCP socket may hold already: then both are tried again on another port (a few times).
fn bind_public_and_tcp(
    cfg: &Config,
) -> Result<(std::net::UdpSocket, Option<std::os::fd::OwnedFd>)> {
    const ATTEMPTS: usize = 16;
    let same_port = cfg.args.listen.port() == 0 && cfg.args.tcp_listen.is_none();
    let mut attempt = 0;
    loop {
        attempt += 1;
        let udp = bind_public(cfg)?;
        let Some(addr) = cfg.tcp_addr(udp.local_addr()?) else {
            return Ok((udp, None));
        };
        match sys::tcp_listener(addr) {
            Ok(l) => return Ok((udp, Some(l.into()))),
            Err(e)
                if same_port && attempt < ATTEMPTS && e.kind() == std::io::ErrorKind::AddrInUse =>
            {
                continue
            }
            Err(e) => {
                return Err(anyhow::Error::new(e)
                    .context(format!("listening on TCP {addr} (--tcp-listen / --listen)")))
            }
        }
    }
}

fn bind_public(cfg: &Config) -> Result<std::net::UdpSocket> {
    let addr: SocketAddr = cfg.args.listen;
    let s = sys::udp_socket(addr)
        .with_context(|| format!("a UDP socket for {addr} (dual-stack on [::])"))?;
    // The first member of the address's SO_REUSEPORT group: every worker's own socket joins it
    // after this one (the lanes' sockets under --forward reuseport), and the group's steering
    // program picks this socket for every datagram (under reuseport: for none).
    s.set_reuse_port(true)
        .context("SO_REUSEPORT on the public socket")?;
    // Fails when not privileged: the plain sizes below are then capped by the sysctl limits.
    sys::size_buffers(&s, cfg.args.rcvbuf, cfg.args.sndbuf);
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
    if !cfg.args.forward.workers_receive() {
        sys::attach_reuseport_program(s.as_fd(), &sys::NEVER_STEER_PROGRAM)
            .context("attaching the public socket's steering program")?;
        // Neither a socket filter nor another steering program, ever, through this socket.
        // (Kernel steering re-attaches its program through it at every reload.)
        sys::lock_filter(s.as_fd()).context("SO_LOCK_FILTER on the public socket")?;
    }
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
