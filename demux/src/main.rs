//! `ringmux`: the demux and supervisor. See `ringmux --help` and README.md; the parts
//! live in the library (`lib.rs`).
#![deny(unsafe_code)]
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(clippy::undocumented_unsafe_blocks)]

use std::io::Write;
use std::net::SocketAddr;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::OsStringExt;
use std::path::PathBuf;
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
use ringmux_demux::metrics::counters::CounterSnapshot;
use ringmux_demux::metrics::{self, Counters};
use ringmux_demux::sessions::{Frozen, Sessions};
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
        Some(Command::Stats { target }) => target
            .address()
            .and_then(|a| metrics::fetch(a.as_str()))
            .and_then(|m| print(&metrics::stats::table(&m))),
        Some(Command::Reload { target, timeout }) => control_request(
            &target,
            &control::Request::Reload,
            Duration::from_secs(timeout),
        ),
        Some(Command::Upgrade { target, timeout }) => control_request(
            &target,
            &control::Request::Upgrade,
            Duration::from_secs(timeout),
        ),
        Some(Command::Acme {
            command:
                config::AcmeCommand::Renew {
                    name,
                    target,
                    timeout,
                },
        }) => control_request(
            &target,
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
        Some(Command::Check { run, online }) => check(*run, online),
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

/// Sends `request` to the running ringmux `target` names and prints its answer.
fn control_request(
    target: &config::running::ControlTarget,
    request: &control::Request,
    timeout: Duration,
) -> Result<()> {
    supervisor::control::request(&target.socket()?, request, timeout)
}

/// `ringmux check`: the configuration checked as a start checks it, and the certificate of the
/// command line's site loaded; what would serve is printed, or every problem.
fn check(run: config::RunArgs, online: bool) -> Result<()> {
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
    if let Some(p) = &cfg.args.key_file {
        ringmux_demux::certs::load_key_file(p).context("--key-file / RINGMUX_KEY_FILE")?;
    }
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
                        ringmux_acme::ChallengeKind::TlsAlpn01 => "tls-alpn-01",
                        ringmux_acme::ChallengeKind::Http01 => "http-01",
                    },
                    acme.state.display()
                ));
            }
            s
        }
        None => {
            if let (Some(c), Some(k)) = (&cfg.args.cert, &cfg.args.key) {
                ringmux_demux::certs::load(c, k)
                    .context("--cert / RINGMUX_CERT and --key / RINGMUX_KEY")?;
            }
            "one site from the command line, answering every name\n".to_string()
        }
    };
    let warnings: String = cfg
        .confinement_warnings()
        .iter()
        .map(|w| format!("warning: {w}\n"))
        .collect();
    if online {
        if let Some(acme) = &cfg.acme {
            match ringmux_acme::probe_directory(acme, Duration::from_secs(15)) {
                Ok(terms) => print(&format!(
                    "acme: the directory {} answers{}\n",
                    acme.directory,
                    terms.map_or(String::new(), |t| format!(" (terms of service: {t})"))
                ))?,
                Err(e) => anyhow::bail!(
                    "acme: the directory {} does not answer as the ACME client would reach it: \
                     {}",
                    acme.directory,
                    ringmux_demux::one_line(&e)
                ),
            }
        }
    }
    print(&format!(
        "{summary}{warnings}configuration OK\n{}",
        running_verdict(&cfg)
    ))
}

/// What the ringmux running on `cfg`'s control socket would make of a reload now (`ringmux
/// check`): a warning when it would refuse it (above all a setting only a restart changes),
/// else a line saying it would take it; nothing when no ringmux runs there.
fn running_verdict(cfg: &Config) -> String {
    let socket = cfg.args.control_socket.as_str();
    let path = std::path::Path::new(socket);
    if socket == "off" || !path.exists() {
        return String::new();
    }
    let asked = control::exchange(
        path,
        &control::Request::ReloadCheck,
        Duration::from_secs(60),
        |_| Ok(()),
    );
    match asked {
        Ok(last) if last.starts_with("ok") => format!("the ringmux running on {socket}: {last}\n"),
        Ok(last) if last.starts_with("error: unknown request") => format!(
            "note: the ringmux running on {socket} is older and cannot say whether it would \
             reload this file\n"
        ),
        Ok(last) => format!(
            "warning: the ringmux running on {socket} would refuse a reload now: {}\n",
            last.strip_prefix("error: ").unwrap_or(&last)
        ),
        Err(e) => format!("note: no ringmux answers on {socket} ({e:#})\n"),
    }
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
    for warning in cfg.confinement_warnings() {
        tracing::warn!("{warning}");
    }
    let start = match upgrade::inherited() {
        None => Start::bind(&cfg)?,
        Some(inherited) => Start::take(&cfg, inherited?)?,
    };
    serve(cfg, signals, start)
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

/// What every worker is handed, apart from its own descriptors and numbers; `redirect`: the
/// demux holds a plain-HTTP listener for them.
fn template(
    cfg: &Config,
    lb: &QuicLbConfig,
    keys: &KeySet,
    sites: &SiteTable,
    public_addr: SocketAddr,
    redirect: bool,
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
        redirect,
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

/// What a start begins with: every descriptor the demux keeps ([`upgrade::Fds`]), the keys
/// and the sites, and what runs on from a previous process image. A first start binds and
/// makes them ([`Start::bind`]); a start by `ringmux upgrade` takes them from the hand-over
/// ([`Start::take`]). That is the only difference between the two: [`serve`] runs on either.
struct Start {
    fds: upgrade::Fds<OwnedFd>,
    keys: KeySet,
    sites: SiteTable,
    /// The generation new connections go to.
    active_generation: u64,
    /// The session cache handed over.
    frozen: Vec<Frozen>,
    /// When the previous image received its last datagram (`CLOCK_MONOTONIC`, ns; 0: none).
    last_recv_ns: u64,
    /// The `ringmux` binary on disk (what an upgrade executes).
    binary: PathBuf,
    /// What the previous image counted, and how its upgrade ended; `None` at a first start.
    handed: Option<Handed>,
}

/// What a start by `ringmux upgrade` carries on with besides the descriptors.
struct Handed {
    counters: CounterSnapshot,
    /// Why the image after this binary refused the hand-over, when this is the previous
    /// binary executed again.
    refused: Option<String>,
}

impl Start {
    /// A first start: the keys and sites of the configuration, the public socket and the
    /// listeners bound.
    fn bind(cfg: &Config) -> Result<Start> {
        let keys = match &cfg.args.key_file {
            Some(p) => {
                ringmux_demux::certs::load_key_file(p).context("--key-file / RINGMUX_KEY_FILE")?
            }
            None => KeySet::generate().context("generating keys")?,
        };
        let sites = match &cfg.sites {
            Some(sites) => sites.clone(),
            None => cfg.site_table(match (&cfg.args.cert, &cfg.args.key) {
                (Some(c), Some(k)) => ringmux_demux::certs::load(c, k)
                    .context("--cert / RINGMUX_CERT and --key / RINGMUX_KEY")?,
                _ => CertPem::self_signed()?,
            }),
        };
        let (udp, https) = bind_public_and_tcp(cfg)?;
        let redirect = match cfg.args.plain_http() {
            Some(config::PlainHttp::Required(addr)) => Some(
                sys::tcp_listener(addr)
                    .with_context(|| format!("listening on TCP {addr} (--redirect-http)"))?
                    .into(),
            ),
            Some(config::PlainHttp::Auto(addr)) => match sys::tcp_listener(addr) {
                Ok(l) => Some(l.into()),
                Err(e) => {
                    tracing::warn!(
                        %addr,
                        error = %e,
                        "plain HTTP is not served: HTTPS listens on port 443, so ringmux \
                         redirects port 80 of its address, which it cannot listen on; free \
                         the port, give --redirect-http / RINGMUX_REDIRECT_HTTP another \
                         address, or turn it off (off)"
                    );
                    None
                }
            },
            None => None,
        };
        let metrics = match cfg.metrics {
            Some(addr) => Some(metrics::exposition::bind(addr)?.into()),
            None => None,
        };
        let fds = upgrade::Fds {
            tcp: https,
            redirect,
            metrics,
            control: supervisor::control::bind(cfg)?,
            ..upgrade::Fds::new(udp.into())
        };
        Ok(Start {
            fds,
            keys,
            sites,
            active_generation: 1,
            frozen: Vec::new(),
            last_recv_ns: 0,
            binary: std::env::current_exe().unwrap_or_else(|_| "ringmux".into()),
            handed: None,
        })
    }

    /// A start by `ringmux upgrade`: everything the previous image handed over. A state this
    /// image cannot use sends it back to the previous binary, which serves on and says why.
    fn take(cfg: &Config, inherited: upgrade::Inherited) -> Result<Start> {
        let state = inherited.take(&forward_name(cfg), cfg.instances)?;
        let keys = hex::decode(&state.keys)
            .ok()
            .and_then(|b| KeySet::from_bytes(&b).ok())
            .context("the hand-over's keys")?;
        let sites = state.sites;
        let mut fds = state.fds;
        let public = std::net::UdpSocket::from(fds.public);
        let public_addr = public.local_addr()?;
        fds.public = public.into();
        // The same command line runs again: a difference means another configuration after all.
        if fds.tcp.is_some() != cfg.tcp_addr(public_addr).is_some() {
            anyhow::bail!("--tcp differs from the running demux's: restart ringmux to change it")
        }
        let plain_http = cfg.args.plain_http();
        // Port 80 beside 443 (`Auto`) was served or not, as it could be bound at start.
        if !matches!(plain_http, Some(config::PlainHttp::Auto(_)))
            && fds.redirect.is_some() != plain_http.is_some()
        {
            anyhow::bail!(
                "--redirect-http differs from the running demux's: restart ringmux to change it"
            )
        }
        if let (None, Some(addr)) = (&fds.metrics, cfg.metrics) {
            fds.metrics = Some(metrics::exposition::bind(addr)?.into());
        }
        Ok(Start {
            fds,
            keys,
            sites,
            active_generation: state.active_generation,
            frozen: state
                .sessions
                .into_iter()
                .filter_map(|e| e.thaw(cfg.instances))
                .collect(),
            last_recv_ns: state.last_recv_ns,
            binary: std::ffi::OsString::from_vec(state.binary).into(),
            handed: Some(Handed {
                counters: state.counters,
                refused: inherited.refused,
            }),
        })
    }
}

/// Runs the demux on what `start` holds until shutdown: the routing, the counters and the
/// workers' template around its keys and sites; the metrics, the ACME engine, the session
/// threads; then the forwarding mode on its lanes (made anew, or the ones handed over), and
/// [`Serve`] on it.
fn serve(cfg: Config, signals: nix::sys::signalfd::SignalFd, start: Start) -> Result<()> {
    let Start {
        fds,
        keys,
        sites,
        active_generation,
        frozen,
        last_recv_ns,
        binary,
        handed,
    } = start;
    let upgrade::Fds {
        public,
        metrics,
        tcp,
        redirect,
        control,
        answers,
        health,
        lanes,
    } = fds;
    let (lb, router) = routing(&cfg, &keys)?;
    let public = dataplane::PublicSocket::new(
        std::net::UdpSocket::from(public),
        cfg.args.ecn == config::Toggle::On,
    )
    .context("configuring the public socket")?;
    let public_addr = public.socket().local_addr()?;
    let counters = Arc::new(Counters::new(cfg.instances, router.lanes()).with_sites(&sites));
    logs::count_into(counters.clone());
    if let Ok(mut p) = counters.program.write() {
        *p = cfg.worker_label();
    }
    let answer = handed.map(|h| carry_on(&counters, &public, h, &binary));
    let liveness = Liveness::new(router.lanes());
    // A lane handed over: its ingress to the forwarding mode, its worker to the supervisor,
    // and up before the data plane starts.
    let mut ingresses = Vec::with_capacity(lanes.len());
    let mut workers = Vec::with_capacity(lanes.len());
    for (l, mut lane) in lanes.into_iter().enumerate() {
        if lane.phase != upgrade::LanePhase::Idle {
            liveness.set_up(l, true);
        }
        ingresses.push(lane.ingress.take());
        workers.push(lane);
    }
    // The ACME engine, with the certificates it has stored in the workers' site table.
    let mut table = sites;
    let acme = supervisor::acme::Relay::start(&cfg, &mut table, router.lanes())?;
    let mut template = template(&cfg, &lb, &keys, &table, public_addr, redirect.is_some());
    supervisor::health::HealthTable::take_over(&mut template.health, health);
    metrics::counters::set_certificates(&counters, &table);
    let (metrics_addr, metrics) = serve_metrics(
        metrics.map(std::net::TcpListener::from),
        &counters,
        &liveness,
    )?;
    let (admission, sessions) = admission_and_sessions(&cfg, &router, &keys.token, &counters);
    let stop = Arc::new(AtomicBool::new(false));
    let (link, plane_control) = DataPlaneLink::new(stop.clone(), liveness);
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
    let serve = Serve {
        supervisor: supervisor::Parts {
            cfg: cfg.clone(),
            template,
            public: public_addr,
            counters: counters.clone(),
            link,
            signals,
            sessions,
            tcp: supervisor::TcpListeners {
                https: tcp,
                redirect,
            },
            acme,
            control: control.map(|listener| (listener, answers)),
            lanes: workers,
            active_generation,
            frozen,
            binary,
        },
        plane: Plane {
            public,
            router,
            admission,
            control: plane_control,
            stop,
            active_generation,
            last_recv_ns,
        },
        handing: Handing {
            cfg: cfg.clone(),
            counters,
            metrics,
            keys: hex::encode(keys.to_bytes()),
        },
        metrics_addr,
        answer,
    };
    if ingresses.is_empty() {
        forward::start(mode, setup, serve).context("creating the forwarding mode's ingress")?
    } else {
        forward::adopt(mode, setup, ingresses, serve).context("taking over the rings")?
    }
}

/// Goes on from what the previous image counted (`handed`), counts its upgrade (or its
/// refusal) and what waited in the public socket's queue meanwhile, and returns the last line
/// for the clients that asked for the upgrade.
fn carry_on(
    counters: &Counters,
    public: &dataplane::PublicSocket,
    handed: Handed,
    binary: &std::path::Path,
) -> String {
    counters.restore(&handed.counters);
    let counted = match handed.refused {
        None => &counters.upgrades,
        Some(_) => &counters.upgrades_failed,
    };
    counted.fetch_add(1, Ordering::Relaxed);
    counters.upgrade_queued_bytes.store(
        sys::queued_bytes(public.socket().as_fd()).unwrap_or(0),
        Ordering::Relaxed,
    );
    match handed.refused {
        None => format!(
            "ok upgraded: pid {} serves with {}",
            std::process::id(),
            binary.display()
        ),
        Some(why) => {
            format!(
                "error: the new binary refused the hand-over: {why}; the previous demux serves on"
            )
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

/// Everything the demux runs, once the forwarding mode exists.
struct Serve {
    /// The supervisor, whole.
    supervisor: supervisor::Parts,
    /// The data plane, but for its forwarding mode.
    plane: Plane,
    /// What a hand-over writes besides what the supervisor and the data plane export.
    handing: Handing,
    metrics_addr: Option<SocketAddr>,
    /// The last line for the clients that asked for the upgrade that made this image.
    answer: Option<String>,
}

/// The data plane's parts, but for its forwarding mode.
struct Plane {
    public: dataplane::PublicSocket,
    router: Router,
    /// The data plane's admission of new connections (it mints with the shared token key, and
    /// binds the tickets of the ClientHellos it lets in to their instance).
    admission: Admission,
    control: dataplane::Control,
    stop: Arc<AtomicBool>,
    active_generation: u64,
    /// When a previous image received its last datagram (0: none).
    last_recv_ns: u64,
}

/// What [`hand_over`] writes besides what the supervisor and the data plane export.
struct Handing {
    cfg: Config,
    counters: Arc<Counters>,
    /// A duplicate of the metrics listener.
    metrics: Option<std::net::TcpListener>,
    /// The shared keys, hex (`KeySet::to_bytes`).
    keys: String,
}

impl forward::WithForward for Serve {
    type Output = Result<()>;

    /// Starts the workers to start (none when every lane was handed over with its worker),
    /// then the data plane, supervises until shutdown; carries out an upgrade when asked for
    /// one (and serves on if it fails).
    fn run<F: Forward>(self, forward: F, handles: Vec<IngressHandles>) -> Result<()> {
        let Serve {
            supervisor: parts,
            plane,
            handing,
            metrics_addr,
            answer,
        } = self;
        let cfg = &handing.cfg;
        let counters = &handing.counters;
        let public_addr = parts.public;
        let stop = plane.stop;
        let dp = DataPlane::new(
            plane.public,
            plane.router,
            forward,
            counters.clone(),
            plane.admission,
            cfg.args.recv_batch,
            Duration::from_secs(cfg.args.stall_secs),
        )
        .coalescing(Duration::from_micros(cfg.args.recv_coalesce_us))
        .with_active_slot(ringmux_proto::generation_slot(plane.active_generation))
        .resumed_after(Some(plane.last_recv_ns));
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
        let (mut sup, mut data_plane) = if handles.is_empty() {
            // Every lane was handed over with its worker running and its ring taken over:
            // forward at once (the datagrams wait in the socket's queue meanwhile) and set the
            // supervisor up while the data plane runs.
            let data_plane = start(dp, plane.control)?;
            match supervisor::Supervisor::new(parts) {
                Ok(sup) => (sup, data_plane),
                Err(e) => {
                    stop.store(true, Ordering::Relaxed);
                    let _ = data_plane.join();
                    return Err(e);
                }
            }
        } else {
            // Workers to start are ready, or dead, before the data plane forwards to them.
            let mut sup = supervisor::Supervisor::new(parts)?;
            sup.start_all(handles)?;
            (sup, start(dp, plane.control)?)
        };
        tracing::info!(
            listen = %public_addr,
            instances = cfg.instances,
            forward = ?cfg.args.forward,
            "serving https://{}/",
            display_addr(public_addr)
        );
        // One machine-readable line on stdout for scripts and tests: the bound addresses (a
        // standard output that fails loses it; ringmux serves on).
        let _ = writeln!(
            std::io::stdout(),
            "ringmux ready listen={public_addr} metrics={} pid={}",
            metrics_addr.map_or("off".to_string(), |a| a.to_string()),
            std::process::id()
        );
        if let Some(line) = &answer {
            sup.answer_upgrade(line);
        }
        loop {
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
            let why = hand_over(&handing, &mut sup, &mut dp, &upgrade);
            sup.upgrade_failed(upgrade, &why);
            stop.store(false, Ordering::Relaxed);
            data_plane = start(dp, control)?;
        }
    }
}

/// Hands everything over to the binary of `upgrade` and executes it: the descriptors the
/// supervisor and the data plane export, with `handing`'s, as one [`upgrade::Fds`]. Returns
/// only if that failed, saying why.
fn hand_over<F: Forward>(
    handing: &Handing,
    sup: &mut supervisor::Supervisor,
    dp: &mut DataPlane<F>,
    upgrade: &supervisor::Upgrade,
) -> String {
    use std::os::fd::AsRawFd;
    let (public, ingress) = match dp.export() {
        Ok(x) => x,
        Err(e) => return format!("exporting the rings: {e}"),
    };
    let mut fds = upgrade::Fds {
        metrics: handing.metrics.as_ref().map(AsRawFd::as_raw_fd),
        ..upgrade::Fds::new(public)
    };
    let exported = match sup.export(upgrade, &mut fds) {
        Ok(e) => e,
        Err(e) => return format!("{e:#}"),
    };
    for (lane, ingress) in fds.lanes.iter_mut().zip(ingress) {
        lane.ingress = ingress;
    }
    let state = upgrade::State {
        compat: upgrade::Compat::ours(),
        forward: forward_name(&handing.cfg),
        instances: handing.cfg.instances,
        keys: handing.keys.clone(),
        sites: exported.sites,
        fds,
        active_generation: exported.active_generation,
        counters: handing.counters.snapshot(),
        sessions: exported.sessions,
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
    let addr = free_udp_address(cfg.args.listen)?;
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
            "receive buffer capped by net.core.rmem_max (see deploy/launch.sh)"
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

/// `listen` if no socket holds its UDP address and port now (a port of 0: one the kernel finds
/// free). The public socket binds with `SO_REUSEPORT` (every worker's sending socket joins its
/// group), which on its own would let a second ringmux on the same address join the first one's
/// group, say it is ready and never receive a datagram (the group's program steers every one to
/// the first member). A probe bound without `SO_REUSEPORT` fails where any socket holds the
/// address, whatever its options; it is closed before the public socket binds.
fn free_udp_address(listen: SocketAddr) -> Result<SocketAddr> {
    let probe = sys::udp_socket(listen)
        .with_context(|| format!("a UDP socket for {listen} (dual-stack on [::])"))?;
    match probe.bind(&listen.into()) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => anyhow::bail!(
            "UDP {listen} (--listen / RINGMUX_LISTEN) is in use already, by another ringmux or \
             another program (`ss -ulpn 'sport = :{port}'` names it): stop it, or give this \
             ringmux another address or port",
            port = listen.port()
        ),
        Err(e) => {
            return Err(anyhow::Error::new(e)
                .context(format!("binding {listen} (--listen / RINGMUX_LISTEN)")))
        }
    }
    let bound = probe
        .local_addr()
        .ok()
        .and_then(|a| a.as_socket())
        .context("the probe socket's address")?;
    Ok(SocketAddr::new(listen.ip(), bound.port()))
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
