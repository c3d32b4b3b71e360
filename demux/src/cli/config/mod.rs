//! `ringmux` command line: every option has a `RINGMUX_*` environment twin, documented in
//! `--help`, and a key of the same name in the configuration file (`--config`, [`mod@file`]).
//! [`parse`] reads the command line and the file; [`RunArgs::validate`] turns the arguments into
//! a checked [`Config`]; every refusal names the option, its variable, the value and what is
//! accepted, and the file's place when the file set it.

pub mod acme;
pub mod file;
pub mod running;
pub mod sites;

pub use crate::options::{default_nonce_len, node_id_bytes, Toggle};

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::admission::RetryMode;
pub use crate::forward::ForwardMode;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand, ValueEnum};
use ringmux_proto::serve::ServeArgs;
use ringmux_proto::sites::{Action, Route, Site, SiteTable};
use ringmux_proto::UpstreamUrl;
use ringmux_ring::{ConfigError, RingConfig, RingField, SpinPolicy};

/// Spreads one public QUIC/HTTP-3 UDP port over several worker processes.
///
/// The demux receives every datagram on the public socket, routes it by its QUIC connection ID
/// (QUIC-LB), and forwards it to the owning worker through a shared-memory ring (or, for
/// comparison, a unix socket). Workers serve HTTP/3 and send directly on the public socket.
#[derive(Parser, Debug)]
#[command(name = "ringmux", version, args_conflicts_with_subcommands = true)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Option<Command>,
    #[command(flatten)]
    pub run: RunArgs,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Check a configuration without starting: does everything a start does except bind and
    /// spawn (reads the configuration file and every option, loads and matches every
    /// certificate and key, checks that each certificate covers its site's names and is valid
    /// now, that roots exist and the workers' user may read them, that upstreams parse, that
    /// no name belongs to two sites), prints each problem with its place, and exits 0 only
    /// when ringmux would start with it.
    Check {
        /// Also reach what the configuration names on the network: the ACME CA's directory is
        /// fetched over the roots the ACME client would trust ([acme] ca_roots and the
        /// system's), and its answer (or the TLS or network error) is printed.
        #[arg(long, env = "RINGMUX_CHECK_ONLINE")]
        online: bool,
        /// Boxed: every option of a start, which would make each `Command` that large.
        #[command(flatten)]
        run: Box<RunArgs>,
    },
    /// Print the metrics of a running ringmux as a table.
    Stats {
        #[command(flatten)]
        target: running::MetricsTarget,
    },
    /// Start a new generation of every worker, then drain the old one; no connection is lost.
    /// Same as SIGHUP to the running ringmux. Re-read on reload: the configuration file
    /// (--config), the command line's environment, the certificate and key files, and the
    /// worker program on disk now; the sites, certificates, routes, upstreams, the built-in
    /// worker's options, --grace and --max-draining change, every other setting needs a restart (a reload that would
    /// change one is refused, naming it). Exits 0 once the new generation serves and the old
    /// one accepts no new connection; non-zero with the reason when it failed or was refused
    /// (the old generation then serves on).
    Reload {
        #[command(flatten)]
        target: running::ControlTarget,
        /// Seconds to wait for the answer.
        #[arg(long, default_value_t = 600)]
        timeout: u64,
    },
    /// Replace the running demux with the ringmux binary on disk now, without losing a
    /// connection or a datagram: the new demux takes over the public socket, every ring, each
    /// worker's sockets, the keys, the session cache and the counters, while the workers run on.
    /// Same as SIGUSR2 to the running ringmux. The new binary runs with the same command line and
    /// environment; it must speak the running workers' protocol and ring layout (it is asked
    /// first). Refused while a reload is under way or a worker is restarting. Exits 0 once the
    /// new demux serves; non-zero with the reason when it was refused (the old demux then serves
    /// on). Run `ringmux reload` afterwards to move the workers to the new build too.
    Upgrade {
        #[command(flatten)]
        target: running::ControlTarget,
        /// Seconds to wait for the answer.
        #[arg(long, default_value_t = 60)]
        timeout: u64,
    },
    /// Certificates from the ACME CA of the configuration file's `[acme]` table.
    Acme {
        #[command(subcommand)]
        command: AcmeCommand,
    },
    /// Print the configuration of a load balancer in front of several ringmux nodes (boxes),
    /// each with its own --node-id, that routes every packet carrying one of the nodes'
    /// connection IDs to the node that issued it, so that a client that moves (a new address
    /// or port) keeps its connection, and spreads new TCP connections (HTTPS, plain HTTP) over
    /// the nodes. docs/operators/cluster.md.
    LbConfig {
        #[command(subcommand)]
        balancer: crate::lbconfig::Balancer,
    },
    /// Write a new key file with fresh random keys (mode 0600; an existing file is never
    /// overwritten), to give to every ringmux node behind one load balancer (--key-file).
    NewKeyFile {
        /// Where to write it.
        path: PathBuf,
    },
    /// Prints what this binary speaks to a running demux that asks whether it may hand over
    /// to it (`ringmux upgrade` runs it).
    #[command(hide = true)]
    UpgradeCheck,
}

/// `ringmux acme …`.
#[derive(Subcommand, Debug)]
pub enum AcmeCommand {
    /// Order a new certificate now for the site with this name (or for every site with
    /// `acme = true`), whatever the age of the one it has, as `certbot renew
    /// --force-renewal` does. Exits 0 once every worker serves the new certificate, over TCP
    /// and QUIC alike; non-zero with the CA's error when the order failed (the site serves
    /// its certificate on).
    Renew {
        /// A name of the site to renew; every ACME site when left out.
        name: Option<String>,
        #[command(flatten)]
        target: running::ControlTarget,
        /// Seconds to wait for the answer (an order takes seconds to minutes).
        #[arg(long, default_value_t = 600)]
        timeout: u64,
    },
}

/// The command line, with the configuration file's settings (`--config`) placed before its
/// own flags, so that a flag or an environment variable wins over the file. Exits with clap's
/// message on a bad command line (as `Cli::parse` does); a configuration file that does not
/// parse is an error naming each problem's place.
pub fn parse() -> Result<Cli> {
    parse_from(std::env::args_os().collect())
}

/// [`parse`] of `argv`. A bad command line is a [`clap::Error`] (the caller exits with it, as
/// `Cli::parse` would); a configuration file that does not parse is an error naming each
/// problem's place.
pub fn parse_from(argv: Vec<std::ffi::OsString>) -> Result<Cli> {
    use clap::{CommandFactory, FromArgMatches};
    let matches = Cli::command()
        .try_get_matches_from(argv.clone())
        .map_err(named_variable)?;
    let mut cli = Cli::from_arg_matches(&matches)?;
    let (run, run_matches, insert_at) = match &cli.command {
        None => (&cli.run, &matches, 1),
        Some(Command::Check { run, .. }) => {
            let at = argv
                .iter()
                .skip(1)
                .position(|a| a == "check")
                .map_or(1, |i| i + 2);
            (
                &**run,
                matches.subcommand_matches("check").unwrap_or(&matches),
                at,
            )
        }
        Some(_) => return Ok(cli),
    };
    let Some(path) = run.config.clone() else {
        let raw = ringmux_proto::serve::raw_values(run_matches);
        if let Some(run) = run_args(&mut cli) {
            run.raw = raw;
        }
        return Ok(cli);
    };
    let file = file::FileConfig::read(&path).map_err(anyhow::Error::new)?;
    // `ringmux check` goes on, to show what else is wrong.
    if !file.problems.is_empty() && cli.command.is_none() {
        return Err(file::Problems(file.problems).into());
    }
    let flags = file.flags(run_matches);
    let mut argv = argv;
    let at = insert_at.min(argv.len());
    argv.splice(at..at, flags.into_iter().map(std::ffi::OsString::from));
    let matches = Cli::command().try_get_matches_from(argv).map_err(|e| {
        let why = e.render().to_string();
        anyhow::anyhow!(
            "the settings of {} and the command line do not go together: {}",
            path.display(),
            why.lines()
                .next()
                .unwrap_or_default()
                .trim_start_matches("error: ")
        )
    })?;
    let mut cli = Cli::from_arg_matches(&matches)?;
    let raw =
        ringmux_proto::serve::raw_values(matches.subcommand_matches("check").unwrap_or(&matches));
    if let Some(run) = run_args(&mut cli) {
        run.file = Some(std::sync::Arc::new(file));
        run.raw = raw;
    }
    Ok(cli)
}

/// A bad value of an option, named with its environment variable too (clap's message names
/// only the flag, though the value may have come from the variable); any other clap error as
/// it is (help, version, usage), for the caller to exit with.
fn named_variable(e: clap::Error) -> anyhow::Error {
    use clap::error::{ContextKind, ContextValue, ErrorKind};
    use clap::CommandFactory;
    if !matches!(
        e.kind(),
        ErrorKind::ValueValidation | ErrorKind::InvalidValue
    ) {
        return e.into();
    }
    let Some(ContextValue::String(arg)) = e.get(ContextKind::InvalidArg) else {
        return e.into();
    };
    let long = arg
        .split_whitespace()
        .next()
        .unwrap_or_default()
        .trim_start_matches("--");
    let cmd = Cli::command();
    let Some(env) = cmd
        .get_arguments()
        .find(|a| a.get_long() == Some(long))
        .and_then(|a| a.get_env())
    else {
        return e.into();
    };
    let value = match e.get(ContextKind::InvalidValue) {
        Some(ContextValue::String(v)) => v.clone(),
        _ => String::new(),
    };
    let why = e.render().to_string();
    let why = why.lines().next().unwrap_or_default();
    let why = why.rsplit(": ").next().unwrap_or(why);
    anyhow::anyhow!(
        "--{long} / {}={value} is not valid: {why}",
        env.to_string_lossy()
    )
}

/// The options of a start (`ringmux` alone, or `ringmux check`).
fn run_args(cli: &mut Cli) -> Option<&mut RunArgs> {
    match &mut cli.command {
        None => Some(&mut cli.run),
        Some(Command::Check { run, .. }) => Some(&mut **run),
        Some(_) => None,
    }
}

/// The options a reload takes up: what the workers of a new generation are given (the sites
/// and their certificates, the built-in worker's options, the program, what it may read and
/// write), the drains' bounds and the access log's path. Every other option needs a restart.
pub const RELOADABLE: [&str; 23] = [
    "cert",
    "key",
    "root",
    "upstream",
    "upstream_timeout",
    "max_bytes",
    "file_cache_mb",
    "cache_control",
    "tcp_max_connections",
    "tcp_idle_timeout",
    "max_tunnels",
    "tunnel_idle",
    "tunnel_drain",
    "tunnel_drain_spread",
    "access_log",
    "access_log_format",
    "worker_bin",
    "worker_cmd",
    "worker_mode",
    "worker_read",
    "worker_write",
    "grace",
    "max_draining",
];

impl Config {
    /// The options that differ between this running configuration and `new` and that a
    /// reload cannot take up, by the configuration file's key (and flag) names; empty when a
    /// reload can apply `new`.
    pub fn restart_needed(&self, new: &Config) -> Vec<String> {
        let mut ids: Vec<&String> = self.args.raw.keys().chain(new.args.raw.keys()).collect();
        ids.sort();
        ids.dedup();
        let mut changed: Vec<String> = ids
            .into_iter()
            .filter(|id| !RELOADABLE.contains(&id.as_str()) && id.as_str() != "config")
            .filter(|id| self.args.raw.get(*id) != new.args.raw.get(*id))
            .map(|id| format!("{id} (--{})", id.replace('_', "-")))
            .collect();
        if (self.access_log() == AccessLog::Off) != (new.access_log() == AccessLog::Off) {
            changed.push("access_log on or off (--access-log)".into());
        }
        if !acme::same(self.acme.as_ref(), new.acme.as_ref()) {
            changed.push("the [acme] table".into());
        }
        changed
    }
}

/// `e`, placed as every other problem of the configuration file is (`FILE:LINE:COLUMN: message`,
/// the form compilers print and editors jump to): at the first option it names that the file
/// set, any other such option named after that place.
fn placed(e: anyhow::Error, file: &file::FileConfig) -> anyhow::Error {
    let text = format!("{e:#}");
    let mut set = file.settings.iter().filter(|s| {
        let flag = format!("--{} ", s.key.replace('_', "-"));
        text.contains(&flag) || text.contains(&format!("({})", s.key))
    });
    let Some(first) = set.next() else {
        return e;
    };
    let others: Vec<String> = set.map(|s| format!("{} at {}", s.key, s.at)).collect();
    match others.is_empty() {
        true => e.context(first.at.to_string()),
        false => e.context(format!(
            "{}: {} here, {}",
            first.at,
            first.key,
            others.join(", ")
        )),
    }
}

/// `--redirect-http`: an address, or `off`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RedirectHttp {
    Off,
    At(SocketAddr),
}

fn parse_redirect_http(s: &str) -> std::result::Result<RedirectHttp, FlagValueError> {
    match s.trim() {
        "off" => Ok(RedirectHttp::Off),
        addr => addr
            .parse()
            .map(RedirectHttp::At)
            .map_err(FlagValueError::RedirectAddress),
    }
}

/// Why clap refuses a value of `--redirect-http` or `--grace` (it shows the message after
/// the flag's name).
#[derive(Debug, thiserror::Error)]
enum FlagValueError {
    #[error("{0}: expected IP:PORT (e.g. 0.0.0.0:80 or [::]:80) or off")]
    RedirectAddress(std::net::AddrParseError),
    #[error("0 would cut every drain at once: expected at least 1 second, or off for no bound")]
    ZeroGrace,
    #[error("expected a number of seconds (at least 1), or off for no bound; got {0:?}")]
    GraceNotSeconds(String),
}

/// Where plain HTTP is served ([`RunArgs::plain_http`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PlainHttp {
    /// `--redirect-http ADDR`: not listening there is a failure.
    Required(SocketAddr),
    /// Port 80 beside an HTTPS listener on 443, `--redirect-http` unset: a port that is
    /// taken is a warning.
    Auto(SocketAddr),
}

impl PlainHttp {
    pub fn addr(self) -> SocketAddr {
        match self {
            PlainHttp::Required(a) | PlainHttp::Auto(a) => a,
        }
    }
}

/// `--grace`: a bound on drains in seconds, or none.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Grace(pub Option<u64>);

impl std::fmt::Display for Grace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            Some(s) => write!(f, "{s}"),
            None => f.write_str("off"),
        }
    }
}

/// `--grace`'s value: `off` or `none` (no bound), or a number of seconds, at least 1.
fn parse_grace(v: &str) -> std::result::Result<Grace, FlagValueError> {
    match v.trim() {
        "off" | "none" | "" => Ok(Grace(None)),
        n => match n.parse::<u64>() {
            Ok(0) => Err(FlagValueError::ZeroGrace),
            Ok(s) => Ok(Grace(Some(s))),
            Err(_) => Err(FlagValueError::GraceNotSeconds(n.to_string())),
        },
    }
}

/// Where the control socket (`ringmux reload`) is by default.
pub const DEFAULT_CONTROL_SOCKET: &str = "/run/ringmux/control.sock";
/// Where the metrics are served by default.
pub const DEFAULT_METRICS: &str = "127.0.0.1:9433";

/// What the workers run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum WorkerMode {
    /// HTTP/3 over quinn (the product).
    Http,
    /// Drain and count without quinn, checking each datagram's connection ID (benchmarks).
    Sink,
}

/// How workers are confined (`--sandbox`).
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sandbox {
    /// The system-call filter and the Landlock allow-list; refuses to start without Landlock.
    On,
    /// The system-call filter alone, for a kernel without Landlock.
    FilterOnly,
    /// Nothing: for debugging a worker only.
    Off,
}

/// How a worker's spin before sleeping adapts (`--spin`).
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpinMode {
    Adaptive,
    Fixed,
}

#[derive(clap::Args, Debug, Clone)]
pub struct RunArgs {
    /// Configuration file (TOML): every option below under its name with `_` for `-` (e.g.
    /// `tcp_max_connections = 1024`), and the sites (`[[site]]`, docs/operators/sites.md). An
    /// option given on the command line or in its environment variable wins over the file.
    /// `ringmux check` checks a file without starting; `ringmux reload` reads it again.
    #[arg(long, env = "RINGMUX_CONFIG", value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// The configuration file, read ([`parse`]).
    #[arg(skip)]
    pub file: Option<std::sync::Arc<file::FileConfig>>,
    /// Every option's value as given, the file's included ([`parse`]): what a reload compares
    /// to tell which options changed.
    #[arg(skip)]
    pub raw: std::collections::BTreeMap<String, Vec<String>>,
    /// How the built-in worker serves (declared once for ringmux and ringmux-worker).
    #[command(flatten)]
    pub serve: ServeArgs,
    /// Public UDP address to serve on. `[::]:PORT` is dual-stack.
    #[arg(long, env = "RINGMUX_LISTEN", default_value = "127.0.0.1:4433")]
    pub listen: SocketAddr,
    /// Serve HTTPS over TCP (HTTP/1.1 and HTTP/2, TLS 1.3 and 1.2) beside HTTP/3, on
    /// --tcp-listen, with an alt-svc field on every response so browsers find HTTP/3: the demux
    /// makes one listening socket and every worker accepts from it (built-in responses, --root
    /// and --upstream alike). A program of your own takes the listener with
    /// `Worker::tcp_listener`.
    #[arg(long, env = "RINGMUX_TCP", value_enum, default_value = "on")]
    pub tcp: Toggle,
    /// TCP address to listen on with --tcp on. Default: the address and port of --listen
    /// (the port the UDP socket got, when --listen names port 0).
    #[arg(long, env = "RINGMUX_TCP_LISTEN")]
    pub tcp_listen: Option<SocketAddr>,
    /// The `alt-svc` field value every response over TCP carries, telling browsers where HTTP/3
    /// is: `auto` (the default) is `h3=":PORT"; ma=86400` with the UDP port; give another value
    /// when a balancer maps the public port, or `off` for none.
    #[arg(long, env = "RINGMUX_ALT_SVC", default_value = "auto")]
    pub alt_svc: String,
    /// Also listen for plain HTTP on this TCP address (port 80 on a real site) and answer every
    /// request with a 301 to `https://` with the same host and path (the HTTPS port of --tcp /
    /// --tcp-listen, left out when 443), and ACME's HTTP-01 challenges; with `[[site]]` tables,
    /// only for their names (another host gets 421). Needs --tcp on. The workers serve it, from
    /// one socket the demux makes, as they serve HTTPS. Unset, and the HTTPS listener on port
    /// 443: port 80 of the same address, as Caddy does (a port 80 that is taken is then a
    /// warning, not a failure); `off`: no plain HTTP at all.
    #[arg(long, env = "RINGMUX_REDIRECT_HTTP", value_name = "ADDR|off", value_parser = parse_redirect_http)]
    pub redirect_http: Option<RedirectHttp>,
    /// Write one line per request, over TCP and HTTP/3, to this file (opened for appending,
    /// created 0640 if missing, opened again at every `ringmux reload` so a rotated log is
    /// let go), to `stderr` (each line prefixed `[instance N] `, as the workers' output is), or
    /// `off` (the default). The fields: time (UTC), client address,
    /// protocol (h1, h2, h3), method, authority, path, status (`-`: none sent), response body
    /// bytes the client was sent, duration in seconds (until the last byte left the worker:
    /// the HTTP/3 stream finished, or the TCP body handed to the socket), instance, site (the
    /// label of the site that answered, `-` for none), and how it ended: `ok`, `cut:drain`
    /// (cut at the end of a drain: --grace, --max-draining), `cut:client` (the client reset
    /// or closed), `cut:timeout`, `cut:worker-exit`, `cut:error`. Every request has its line,
    /// a cut one too. Lines are written off the request path; when a worker's queue is full a
    /// line is dropped and counted (ringmux_worker_access_log_dropped_total), never waited
    /// for.
    #[arg(
        long,
        env = "RINGMUX_ACCESS_LOG",
        default_value = "off",
        value_name = "PATH|stderr|off"
    )]
    pub access_log: String,
    /// Number of worker processes (1–64).
    #[arg(long, env = "RINGMUX_INSTANCES", default_value_t = 2)]
    pub instances: u32,
    /// Forwarding mode: shm (rings), unix (SOCK_SEQPACKET baseline), drop (benchmark floor) or
    /// reuseport (kernel steering: each worker its own SO_REUSEPORT socket, picked by a BPF
    /// program from the connection ID; needs --plaintext-cids; no admission, shedding or
    /// counting per datagram in the demux, and no `ringmux upgrade` yet).
    #[arg(long, env = "RINGMUX_FORWARD", value_enum, default_value = "shm")]
    pub forward: ForwardMode,
    /// Unix socket `ringmux reload` talks to (mode 0600, its folder is made if missing); `off`
    /// disables it (SIGHUP still reloads).
    #[arg(long, env = "RINGMUX_CONTROL_SOCKET", default_value = DEFAULT_CONTROL_SOCKET)]
    pub control_socket: String,
    /// Prometheus metrics address (`http://ADDR/metrics`); `off` disables.
    #[arg(long, env = "RINGMUX_METRICS", default_value = DEFAULT_METRICS)]
    pub metrics: String,
    /// PEM certificate chain. Default: a self-signed certificate for localhost, 127.0.0.1 and ::1.
    /// Not with `[[site]]` tables, each of which has its own.
    #[arg(long, env = "RINGMUX_CERT")]
    pub cert: Option<PathBuf>,
    /// PEM private key for --cert.
    #[arg(long, env = "RINGMUX_KEY")]
    pub key: Option<PathBuf>,
    /// Document root for static files of the built-in worker. Default: built-ins only
    /// (/hello.txt, /bytes/N).
    #[arg(long, env = "RINGMUX_ROOT")]
    pub root: Option<PathBuf>,
    /// Reverse proxy: pass every request to this HTTP service (`http://HOST:PORT`; `https://`,
    /// `h2c://` for HTTP/2 in the clear, `h2://` for HTTP/2 over TLS) instead of serving files; the built-in worker streams bodies both ways and adds `forwarded` and
    /// `x-forwarded-*` with the client's address. Not with --root.
    #[arg(long, env = "RINGMUX_UPSTREAM")]
    pub upstream: Option<String>,
    /// Shared key file (QUIC-LB, routing hash, stateless reset, token and ticket keys), mode 0600.
    /// Default: fresh keys at every start. Use one file for every box behind one load balancer.
    #[arg(long, env = "RINGMUX_KEY_FILE")]
    pub key_file: Option<PathBuf>,
    /// CPUs to pin to: the first for the demux, then one per instance in order (e.g. `0,1,2`).
    #[arg(long, env = "RINGMUX_CPUS", value_delimiter = ',')]
    pub cpus: Vec<usize>,
    #[command(flatten)]
    pub ring: RingArgs,
    /// Receive buffers per recvmmsg call (1–32), each up to 64 KiB with GRO.
    #[arg(long, env = "RINGMUX_RECV_BATCH", default_value_t = 32)]
    pub recv_batch: usize,
    /// Longest receive coalescing window, in µs (0–1000; 0: off). While datagrams keep coming
    /// (at least 4 expected within it), the demux sleeps this long (at most; shorter when a
    /// receive batch fills sooner) on a timer instead of being woken by each arrival, then
    /// takes every datagram that came in one receive: one wake-up, and one doorbell per worker,
    /// for all of them. Each datagram waits at most this long more; a window that brings
    /// nothing returns to waking on each arrival.
    #[arg(long, env = "RINGMUX_RECV_COALESCE_US", default_value_t = 250)]
    pub recv_coalesce_us: u64,
    /// Read each datagram's ECN bits (IP_RECVTOS / IPV6_RECVTCLASS) and pass them to the
    /// workers, so QUIC's ECN validation and congestion feedback work for traffic from clients.
    /// `off` saves the kernel one control message per datagram (about 5 % of the demux's cost
    /// without GRO, bench/RESULTS.md); clients then see ECN validation fail and stop marking.
    #[arg(long, env = "RINGMUX_ECN", value_enum, default_value_t = Toggle::On)]
    pub ecn: Toggle,
    /// SO_RCVBUF of the public socket in bytes (forced past net.core.rmem_max when root).
    #[arg(long, env = "RINGMUX_RCVBUF", default_value_t = 32 << 20)]
    pub rcvbuf: usize,
    /// SO_SNDBUF of the public socket in bytes.
    #[arg(long, env = "RINGMUX_SNDBUF", default_value_t = 8 << 20)]
    pub sndbuf: usize,
    /// Bound on a drain, in seconds, or `off` (the default): no bound. A generation replaced
    /// by a reload (or every worker, on SIGTERM/SIGINT) stops accepting, closes its idle
    /// connections and serves every request in flight to its end, however long, unless this
    /// is set: then what it still serves after that many seconds is cut (each cut request is
    /// logged). A second SIGTERM/SIGINT cuts at once. Taken up by `ringmux reload`, running
    /// drains included.
    #[arg(long, env = "RINGMUX_GRACE", default_value = "off", value_name = "SECONDS|off", value_parser = parse_grace)]
    pub grace: Grace,
    /// Most generations that drain beside the serving one (1–3; the connection IDs' two
    /// generation bits hold no more). A reload past it does not wait: it cuts the oldest
    /// draining generation (its workers end what they serve, each cut request logged, and
    /// exit). Taken up by `ringmux reload`.
    #[arg(long, env = "RINGMUX_MAX_DRAINING", default_value_t = 3)]
    pub max_draining: u8,
    /// Path of the built-in worker program, ringmux-worker, to which ringmux passes the
    /// built-in server's options (--max-bytes, --file-cache-mb, --cache-control,
    /// --upstream-timeout, --tcp-max-connections, --tcp-idle-timeout, --worker-mode) on its
    /// command line; the sites (--root, --upstream, `[[site]]`) reach it in the hand-off.
    /// Default: next to this executable.
    #[arg(long, env = "RINGMUX_WORKER_BIN")]
    pub worker_bin: Option<PathBuf>,
    /// The program every instance runs, with its arguments, split like a shell would:
    /// 'PROGRAM [ARGS...]'. Any program built on the ringmux-worker library
    /// (`Worker::attach`); it gets the arguments written here and no others, so the built-in
    /// worker's --root, --cache-control, --upstream and --worker-mode sink are refused beside
    /// it. Default: the built-in ringmux-worker (--worker-bin).
    #[arg(long, env = "RINGMUX_WORKER_CMD")]
    pub worker_cmd: Option<String>,
    /// Confine every worker before its program starts: a system-call filter refuses signals
    /// to any other process, ptrace and reading other processes' memory, new processes, and
    /// receiving on, changing or duplicating the public socket; a Landlock domain makes the
    /// file system an allow-list (read its program, libraries and site roots, plus
    /// --worker-read; write nowhere but --worker-write) (docs/security.md).
    /// Without Landlock (Linux 5.13, `landlock` among the boot's LSMs) ringmux refuses to
    /// start: `filter-only` runs the filter alone, and a worker then reads and writes every
    /// file its user may. `off` is for debugging a worker only: any worker can then stop,
    /// trace or read the demux and its siblings, and read every instance's datagrams.
    #[arg(long, env = "RINGMUX_SANDBOX", value_enum, default_value_t = Sandbox::On)]
    pub sandbox: Sandbox,
    /// Run the workers as this user (a name or a numeric UID), with its primary group and no
    /// supplementary groups, so that the file permissions keep them from ringmux's own files
    /// (keys, ACME state) and they cannot signal, trace or read the demux whatever the filter
    /// allows. Needs ringmux to hold CAP_SETUID and CAP_SETGID: root, or a unit that grants
    /// them (deploy/ringmux.service: ringmux as `ringmux`, workers as `ringmux-worker`).
    /// Default: `nobody` when ringmux holds them. Without them, or naming ringmux's own user,
    /// ringmux refuses to start unless this is `self`: the workers then keep ringmux's user
    /// and Landlock's allow-list is all that keeps them from its files. As root, `root` keeps
    /// the workers root, without capabilities (as `self`). The worker program must be
    /// executable by that user (every folder above it open to it), and the site roots
    /// readable.
    #[arg(long, env = "RINGMUX_WORKER_USER")]
    pub worker_user: Option<String>,
    /// What the workers may read beyond their program, its libraries and the site roots,
    /// for a program of your own (--worker-cmd): absolute paths, comma-separated (a TOML
    /// array in the file), each granting reading and executing everything beneath it
    /// (Landlock). They must exist.
    #[arg(
        long,
        env = "RINGMUX_WORKER_READ",
        value_delimiter = ',',
        value_name = "PATHS"
    )]
    pub worker_read: Vec<PathBuf>,
    /// Where the workers may write, for a program of your own: absolute paths,
    /// comma-separated (a TOML array in the file), each granting every right beneath it
    /// (read, write, create, remove, rename). Default: nowhere (a worker's log and access log
    /// are pipes). They must exist; never name ringmux's state, keys or configuration.
    #[arg(
        long,
        env = "RINGMUX_WORKER_WRITE",
        value_delimiter = ',',
        value_name = "PATHS"
    )]
    pub worker_write: Vec<PathBuf>,
    /// Seconds a starting worker has to report READY before it is killed and replaced.
    #[arg(long, env = "RINGMUX_READY_TIMEOUT", default_value_t = 30)]
    pub ready_timeout: u64,
    /// What the built-in worker runs: http (the server) or sink (count-only, for benchmarks).
    #[arg(long, env = "RINGMUX_WORKER_MODE", value_enum, default_value = "http")]
    pub worker_mode: WorkerMode,
    /// QUIC-LB node ID of this box, hex (1 or more bytes); unique per box behind one load balancer.
    #[arg(long, env = "RINGMUX_NODE_ID", default_value = "00")]
    pub node_id: String,
    /// QUIC-LB config rotation codepoint (0–6).
    #[arg(long, env = "RINGMUX_CONFIG_ID", default_value_t = 0)]
    pub config_id: u8,
    /// QUIC-LB nonce length in bytes (4–18). Default: 16 − node-ID length − 1, so that server ID
    /// + nonce is one AES block (single-pass, 17-byte CIDs).
    #[arg(long, env = "RINGMUX_NONCE_LEN")]
    pub nonce_len: Option<u8>,
    /// Issue unencrypted (plaintext-mode) QUIC-LB connection IDs.
    #[arg(long, env = "RINGMUX_PLAINTEXT_CIDS")]
    pub plaintext_cids: bool,
    /// Seconds after which workers rotate connection IDs (0: never).
    #[arg(long, env = "RINGMUX_CID_LIFETIME", default_value_t = 0)]
    pub cid_lifetime: u64,
    /// When the demux itself answers a new connection's first Initial (one without a token)
    /// with a stateless Retry, so that the client proves its address before any worker spends
    /// a handshake on it: `auto` under pressure (more than `--retry-above` new-connection
    /// packets per second, or a ring past `--initial-shed-at`, and for a second after), `always`
    /// (one extra round trip for every connection), `never`. The token is checked by the demux
    /// and by the worker, whose quinn accepts it.
    #[arg(long, env = "RINGMUX_RETRY", value_enum, default_value_t = RetryMode::Auto)]
    pub retry: RetryMode,
    /// New-connection packets per second (Initials and 0-RTT of unknown connections, the whole
    /// box) above which `--retry auto` sends Retries.
    #[arg(long, env = "RINGMUX_RETRY_ABOVE", default_value_t = 1000)]
    pub retry_above: u32,
    /// New-connection packets per second one source prefix (`--prefix-v4` / `--prefix-v6`)
    /// may send to the workers while the demux is under pressure (see `--retry`), with a burst
    /// of as many; the excess is dropped (counted `prefix_budget`). 0: no budget. A fixed
    /// table of 4096 hashed cells (32 KiB): prefixes that share a cell share its budget.
    #[arg(long, env = "RINGMUX_PREFIX_BUDGET", default_value_t = 100)]
    pub prefix_budget: u32,
    /// IPv4 prefix length the budget groups sources by.
    #[arg(long, env = "RINGMUX_PREFIX_V4", default_value_t = 24)]
    pub prefix_v4: u8,
    /// IPv6 prefix length the budget groups sources by.
    #[arg(long, env = "RINGMUX_PREFIX_V6", default_value_t = 56)]
    pub prefix_v6: u8,
    /// QUIC idle timeout in seconds, of every worker program (the worker library's
    /// `Worker::server_config` applies it).
    #[arg(long, env = "RINGMUX_IDLE_TIMEOUT", default_value_t = 30)]
    pub idle_timeout: u64,
    /// Ring occupancy, in percent of its slots, from which the demux admits no new connections
    /// to that instance (their Initial and 0-RTT packets are dropped, counted
    /// `initial_shed`), so the room left goes to the connections already running. 100: only a
    /// full ring refuses anything. `shm` forwarding only.
    #[arg(long, env = "RINGMUX_INITIAL_SHED_AT", default_value_t = 50)]
    pub initial_shed_at: u32,
    /// Seconds a worker may leave a non-empty ring untouched before it is declared stuck,
    /// killed and replaced.
    #[arg(long, env = "RINGMUX_STALL_SECS", default_value_t = 5)]
    pub stall_secs: u64,
}

/// The rings' geometry and the workers' spin: the one place that names their flags and
/// variables; [`RingArgs::validate`] makes the [`RingConfig`] the rings are built from,
/// [`RingArgs::spin`] the [`SpinPolicy`] every worker's consumer spins by.
#[derive(clap::Args, Debug, Clone)]
pub struct RingArgs {
    /// Slots per ring: a power of two from 4 to 1048576.
    #[arg(long, env = "RINGMUX_RING_SLOTS", default_value_t = RingConfig::default().slots)]
    pub ring_slots: u32,
    /// Bytes per slot, 64-byte descriptor included: a multiple of 64 from 1280 to 65600.
    #[arg(long, env = "RINGMUX_SLOT_BYTES", default_value_t = RingConfig::default().slot_bytes)]
    pub slot_bytes: u32,
    /// How long an idle worker polls its ring before sleeping on the doorbell, in µs (0–1000000):
    /// the most, with --spin adaptive.
    #[arg(long, env = "RINGMUX_SPIN_US", default_value_t = SpinPolicy::DEFAULT_US)]
    pub spin_us: u32,
    /// How a worker's spin adapts: `adaptive` (the default) spins about four typical short
    /// gaps between datagrams (at most --spin-us), and not at all when the gaps are mostly
    /// longer than --spin-us (trains of datagrams, or the demux's coalescing windows), since an
    /// empty spin burns CPU a sleep would not: the box's CPU per request end to end and per
    /// datagram at moderate rates is the lowest with it, and saturated it costs the same.
    /// `fixed` always spins --spin-us: a shorter ring-latency tail at moderate rates (tens of
    /// µs at the 99th percentile) for more CPU (bench/RESULTS.md has the figures).
    #[arg(long, env = "RINGMUX_SPIN", value_enum, default_value = "adaptive")]
    pub spin: SpinMode,
}

impl RingArgs {
    /// The ring's settings, checked against the ring's bounds; a refusal names the flag, its
    /// variable, the value and the accepted range.
    pub fn validate(&self) -> Result<RingConfig> {
        let ring = RingConfig {
            slots: self.ring_slots,
            slot_bytes: self.slot_bytes,
        };
        ring.validate().map_err(ring_error)?;
        Ok(ring)
    }

    /// The workers' spin (`--spin`, `--spin-us`), checked against the ring's bound; a refusal
    /// names the flag as [`RingArgs::validate`]'s do.
    pub fn spin(&self) -> Result<SpinPolicy> {
        SpinPolicy::from_micros(self.spin_us, self.spin == SpinMode::Adaptive).map_err(ring_error)
    }
}

/// A ring setting's refusal, naming its flag and variable.
fn ring_error(e: ConfigError) -> anyhow::Error {
    let flag = match e.field {
        RingField::Slots => "--ring-slots / RINGMUX_RING_SLOTS",
        RingField::SlotBytes => "--slot-bytes / RINGMUX_SLOT_BYTES",
        RingField::SpinUs => "--spin-us / RINGMUX_SPIN_US",
    };
    anyhow::anyhow!("{flag}={} is not valid: expected {}", e.value, e.expected)
}

/// The QUIC-LB settings of the command line, checked ([`Config`] keeps them).
struct QuicLbSettings {
    instances: u8,
    node_id: Vec<u8>,
    nonce_len: u8,
}

/// Validated configuration.
#[derive(Debug, Clone)]
pub struct Config {
    pub args: RunArgs,
    pub ring: RingConfig,
    /// How every worker's consumer spins (`--spin`, `--spin-us`), handed to it as it stands.
    pub spin: SpinPolicy,
    pub node_id: Vec<u8>,
    pub nonce_len: u8,
    pub metrics: Option<SocketAddr>,
    /// The program every instance runs, then its arguments: those of `--worker-cmd`, or the
    /// built-in worker's options.
    pub worker_cmd: Vec<String>,
    pub instances: u8,
    /// `--upstream`, checked.
    pub upstream: Option<UpstreamUrl>,
    /// `--worker-user`, looked up.
    pub worker_user: Option<WorkerUser>,
    /// The sites of the configuration file, checked, certificates read; `None` without
    /// `[[site]]` (the command line then makes one site, [`Config::site_table`]).
    pub sites: Option<SiteTable>,
    /// The `[acme]` table, checked: `Some` when the file has one or a site has `acme = true`.
    pub acme: Option<ringmux_acme::AcmeSettings>,
}

/// Where the access log goes (`--access-log`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AccessLog {
    Off,
    Stderr,
    File(std::path::PathBuf),
}

impl AccessLog {
    /// Where the log thread writes the workers' access-log lines: the file opened for
    /// appending (created 0640), standard error, or nowhere.
    pub fn open(&self) -> Result<crate::logs::AccessOut> {
        use std::os::unix::fs::OpenOptionsExt;
        Ok(match self {
            AccessLog::Off => crate::logs::AccessOut::Off,
            AccessLog::Stderr => crate::logs::AccessOut::Stderr,
            AccessLog::File(path) => crate::logs::AccessOut::File(
                std::fs::OpenOptions::new()
                    .append(true)
                    .create(true)
                    .mode(0o640)
                    .open(path)
                    .with_context(|| {
                        format!(
                            "--access-log / RINGMUX_ACCESS_LOG={}: cannot open it for appending \
                             (does its directory exist, and may ringmux write there?)",
                            path.display()
                        )
                    })?
                    .into(),
            ),
        })
    }
}

/// The user workers run as (`--worker-user`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerUser {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
}

impl RunArgs {
    /// Whether to serve HTTPS over TCP (`--tcp`).
    pub fn tcp_on(&self) -> bool {
        self.tcp == Toggle::On
    }

    /// Where plain HTTP is served, if anywhere: `--redirect-http`'s address, else port 80 of the
    /// HTTPS listener's address when that listens on port 443.
    pub fn plain_http(&self) -> Option<PlainHttp> {
        match self.redirect_http {
            Some(RedirectHttp::Off) => None,
            Some(RedirectHttp::At(addr)) => Some(PlainHttp::Required(addr)),
            None if self.tcp_on() => {
                let https = self.tcp_listen.unwrap_or(self.listen);
                (https.port() == 443).then(|| PlainHttp::Auto(SocketAddr::new(https.ip(), 80)))
            }
            None => None,
        }
    }

    /// The checked configuration; a refusal of an option the configuration file set names
    /// the file's place too.
    pub fn validate(self) -> Result<Config> {
        let file = self.file.clone();
        self.validate_options().map_err(|e| match &file {
            Some(file) => placed(e, file),
            None => e,
        })
    }

    fn validate_options(self) -> Result<Config> {
        let ring = self.ring.validate()?;
        let spin = self.ring.spin()?;
        let QuicLbSettings {
            instances,
            node_id,
            nonce_len,
        } = self.quic_lb()?;
        self.data_plane()?;
        self.supervision()?;
        let metrics = self.metrics_addr()?;
        let upstream = self.serving()?;
        self.builtin_only()?;
        let worker_cmd = self.worker_program()?;
        self.tcp_and_logs()?;
        let worker_user = self.worker_user(&worker_cmd)?;
        self.confinement()?;
        let sites = self.sites(worker_user.as_ref())?;
        let acme = self.acme(sites.as_ref())?;
        Ok(Config {
            ring,
            spin,
            node_id,
            nonce_len,
            metrics,
            worker_cmd,
            instances,
            upstream,
            worker_user,
            sites,
            acme,
            args: self,
        })
    }

    /// The sites of the configuration file, if it has any; the options that belong to a site
    /// are refused beside them.
    fn sites(&self, worker_user: Option<&WorkerUser>) -> Result<Option<SiteTable>> {
        let Some(file) = self.file.as_ref().filter(|f| !f.sites.is_empty()) else {
            return Ok(None);
        };
        let set = [
            ("--root / RINGMUX_ROOT (root)", self.root.is_some()),
            (
                "--upstream / RINGMUX_UPSTREAM (upstream)",
                self.upstream.is_some(),
            ),
            ("--cert / RINGMUX_CERT (cert)", self.cert.is_some()),
            ("--key / RINGMUX_KEY (key)", self.key.is_some()),
        ];
        if let Some((flag, _)) = set.iter().find(|(_, on)| *on) {
            bail!(
                "{flag} is set beside the [[site]] tables of {}: each site has its own \
                 (cert and key in its [[site]], root and upstream in its [[site.route]]s); \
                 drop the option",
                file.path.display()
            );
        }
        Ok(Some(
            sites::build(file, worker_user).map_err(anyhow::Error::new)?,
        ))
    }

    /// The `[acme]` settings, when the file has the table or a site takes `acme = true`.
    fn acme(&self, sites: Option<&SiteTable>) -> Result<Option<ringmux_acme::AcmeSettings>> {
        let Some(file) = self.file.as_ref() else {
            return Ok(None);
        };
        let wanted = sites.is_some_and(|t| t.sites.iter().any(|s| s.acme));
        if file.acme.is_none() && !wanted {
            return Ok(None);
        }
        Ok(Some(
            acme::settings(file, self).map_err(anyhow::Error::new)?,
        ))
    }

    /// The QUIC-LB settings: the instance count, the node ID and the nonce length, and whether
    /// the forwarding mode can read the connection IDs they make.
    fn quic_lb(&self) -> Result<QuicLbSettings> {
        if self.forward == ForwardMode::Reuseport && !self.plaintext_cids {
            bail!(
                "--forward reuseport / RINGMUX_FORWARD=reuseport needs --plaintext-cids \
                 (RINGMUX_PLAINTEXT_CIDS=true): the kernel's steering program reads the instance \
                 from the connection ID and cannot decrypt it"
            );
        }
        if !(1..=u32::from(ringmux_quic_lb::MAX_INSTANCES)).contains(&self.instances) {
            bail!(
                "--instances / RINGMUX_INSTANCES={} is not valid: expected 1 to 64 (a \
                 connection ID holds 6 bits of instance beside 2 of worker generation)",
                self.instances
            );
        }
        let node_id = node_id_bytes(&self.node_id).with_context(|| {
            format!(
                "--node-id / RINGMUX_NODE_ID={:?} is not valid: expected at least one hex byte \
                 (an optional 0x before them), e.g. 00 or 0a1b",
                self.node_id
            )
        })?;
        let nonce_len = self
            .nonce_len
            .unwrap_or_else(|| default_nonce_len(node_id.len()));
        Ok(QuicLbSettings {
            instances: self.instances as u8,
            node_id,
            nonce_len,
        })
    }

    /// The data plane's receive batch and its admission of new connections (shedding, the
    /// source prefixes, the Retry threshold).
    fn data_plane(&self) -> Result<()> {
        if !(1..=quinn_udp::BATCH_SIZE).contains(&self.recv_batch) {
            bail!(
                "--recv-batch / RINGMUX_RECV_BATCH={} is not valid: expected 1 to {}",
                self.recv_batch,
                quinn_udp::BATCH_SIZE
            );
        }
        if self.recv_coalesce_us > 1000 {
            bail!(
                "--recv-coalesce-us / RINGMUX_RECV_COALESCE_US={} is not valid: expected 0 to 1000 (µs; 0: no coalescing)",
                self.recv_coalesce_us
            );
        }
        if !(1..=100).contains(&self.initial_shed_at) {
            bail!(
                "--initial-shed-at / RINGMUX_INITIAL_SHED_AT={} is not valid: expected 1 to 100 (percent of a ring's slots; 100: never shed)",
                self.initial_shed_at
            );
        }
        if self.prefix_v4 > 32 {
            bail!(
                "--prefix-v4 / RINGMUX_PREFIX_V4={} is not valid: expected 0 to 32 (bits of an IPv4 address)",
                self.prefix_v4
            );
        }
        if self.prefix_v6 > 128 {
            bail!(
                "--prefix-v6 / RINGMUX_PREFIX_V6={} is not valid: expected 0 to 128 (bits of an IPv6 address)",
                self.prefix_v6
            );
        }
        if self.retry_above == 0 {
            bail!(
                "--retry-above / RINGMUX_RETRY_ABOVE=0 is not valid: expected at least 1 (packets per second); for a Retry on every connection use --retry always"
            );
        }
        Ok(())
    }

    /// The supervisor's timeouts.
    fn supervision(&self) -> Result<()> {
        if !(1..=3).contains(&self.max_draining) {
            bail!(
                "--max-draining / RINGMUX_MAX_DRAINING={} is not valid: expected 1 to 3 (the \
                 generations a connection ID can tell apart beside the serving one)",
                self.max_draining
            );
        }
        if self.ready_timeout == 0 {
            bail!("--ready-timeout / RINGMUX_READY_TIMEOUT=0 is not valid: expected at least 1 second");
        }
        Ok(())
    }

    /// Where the metrics are served (`None`: off).
    fn metrics_addr(&self) -> Result<Option<SocketAddr>> {
        let metrics = match self.metrics.as_str() {
            "off" | "" => None,
            a => Some(a.parse().with_context(|| {
                format!("--metrics / RINGMUX_METRICS={a:?} is not valid: expected ADDR:PORT or off")
            })?),
        };
        Ok(metrics)
    }

    /// The program every instance runs, then its arguments.
    fn worker_program(&self) -> Result<Vec<String>> {
        let worker_cmd = match &self.worker_cmd {
            Some(cmd) => {
                let words = shlex::split(cmd).filter(|w| !w.is_empty()).with_context(|| {
                    format!("--worker-cmd / RINGMUX_WORKER_CMD={cmd:?} is not valid: expected 'PROGRAM [ARGS...]' with balanced quotes")
                })?;
                let program = find_program(&words[0]).with_context(|| {
                    format!("--worker-cmd / RINGMUX_WORKER_CMD: program {:?} not found (give a path, or a name on PATH)", words[0])
                })?;
                std::iter::once(program.display().to_string())
                    .chain(words.into_iter().skip(1))
                    .collect()
            }
            None => {
                let worker_bin = match &self.worker_bin {
                    Some(p) => p.clone(),
                    None => std::env::current_exe()
                        .context("locating this executable")?
                        .with_file_name("ringmux-worker"),
                };
                if !worker_bin.is_file() {
                    bail!(
                        "worker binary {} not found: build it (`cargo build --release`) or pass --worker-bin / RINGMUX_WORKER_BIN",
                        worker_bin.display()
                    );
                }
                std::iter::once(worker_bin.display().to_string())
                    .chain(self.builtin_worker_args()?)
                    .collect()
            }
        };
        Ok(worker_cmd)
    }

    /// The built-in worker's arguments after its program: how it serves, from the options of
    /// the same names (`ringmux-worker --help`), each passed whatever its value so that the
    /// worker never falls back on a default of its own. A program of `--worker-cmd` gets none
    /// of them: what it does not understand it would refuse, so these options are refused with
    /// it rather than dropped without a word. `--root` and `--upstream` are not among them:
    /// they reach every worker in the site table, as the routes of the command line's site.
    fn builtin_worker_args(&self) -> Result<Vec<String>> {
        let mut args = ServeArgs::worker_args(&self.raw);
        if self.worker_mode == WorkerMode::Sink {
            args.push("--sink".into());
        }
        Ok(args)
    }

    /// Options only the built-in worker understands, refused beside `--worker-cmd`, whose
    /// program gets none of them (see [`RunArgs::builtin_worker_args`]).
    fn builtin_only(&self) -> Result<()> {
        if self.worker_cmd.is_none() {
            return Ok(());
        }
        let set = [
            ("--root / RINGMUX_ROOT", self.root.is_some()),
            (
                "--cache-control / RINGMUX_CACHE_CONTROL",
                self.serve.cache_control.is_some(),
            ),
            ("--upstream / RINGMUX_UPSTREAM", self.upstream.is_some()),
            (
                "--worker-mode / RINGMUX_WORKER_MODE=sink",
                self.worker_mode == WorkerMode::Sink,
            ),
        ];
        if let Some((flag, _)) = set.iter().find(|(_, on)| *on) {
            bail!(
                "{flag} is an option of the built-in worker, which --worker-cmd / \
                 RINGMUX_WORKER_CMD replaces: give your program its own options inside \
                 --worker-cmd (e.g. --worker-cmd 'ringmux-worker --root DIR' for the built-in \
                 one, see ringmux-worker --help), or drop --worker-cmd"
            );
        }
        Ok(())
    }

    /// What the built-in server serves: the files, the proxy's upstream (returned, checked) and
    /// the headers it adds.
    fn serving(&self) -> Result<Option<UpstreamUrl>> {
        if self.root.is_some() && self.upstream.is_some() {
            bail!(
                "--root / RINGMUX_ROOT and --upstream / RINGMUX_UPSTREAM are both set: the \
                 built-in worker serves files or proxies, not both (give each its own path in \
                 a [[site]] of a configuration file to have both)"
            );
        }
        match (&self.cert, &self.key) {
            (Some(_), None) => bail!(
                "--cert / RINGMUX_CERT is set without --key / RINGMUX_KEY: give the private \
                 key of the certificate too"
            ),
            (None, Some(_)) => bail!(
                "--key / RINGMUX_KEY is set without --cert / RINGMUX_CERT: give the certificate \
                 chain too"
            ),
            _ => {}
        }
        if let Some(root) = &self.root {
            if root.to_str().is_none() {
                bail!(
                    "--root / RINGMUX_ROOT={} is not valid: the workers receive it in the site \
                     table, which holds UTF-8 only; name the folder by a UTF-8 path (a symbolic \
                     link will do)",
                    root.display()
                );
            }
            if !root.is_dir() {
                bail!(
                    "--root / RINGMUX_ROOT={} is not a directory",
                    root.display()
                );
            }
            if let Err(e) = std::fs::read_dir(root) {
                bail!(
                    "--root / RINGMUX_ROOT={}: the folder cannot be read ({e}); the workers \
                     could serve nothing from it",
                    root.display()
                );
            }
            if let Ok(Some(fs)) = crate::sys::pseudo_file_system(root) {
                bail!(
                    "--root / RINGMUX_ROOT={}: on {fs}, a file system the kernel makes up (its \
                     files are the system's state, not a site's); name a folder of files",
                    root.display()
                );
            }
        }
        let upstream = match &self.upstream {
            Some(up) => match up.parse::<UpstreamUrl>() {
                Ok(u) if u.scheme.tls() => match crate::certs::system_roots_pem() {
                    Ok(_) => Some(u),
                    Err(e) => bail!("--upstream / RINGMUX_UPSTREAM={up}: {e}"),
                },
                Ok(u) => Some(u),
                Err(e) => bail!("--upstream / RINGMUX_UPSTREAM={e}"),
            },
            None => None,
        };
        let av = &self.alt_svc;
        if av.trim().is_empty() || !av.bytes().all(|b| b == b'\t' || (0x20..0x7f).contains(&b)) {
            bail!(
                "--alt-svc / RINGMUX_ALT_SVC={av:?} is not valid: expected auto, off, or a header \
                 value of printable ASCII, e.g. 'h3=\":443\"; ma=86400'"
            );
        }
        Ok(upstream)
    }

    /// HTTPS over TCP, its redirects and the access log.
    fn tcp_and_logs(&self) -> Result<()> {
        if matches!(self.redirect_http, Some(RedirectHttp::At(_))) && !self.tcp_on() {
            bail!(
                "--redirect-http / RINGMUX_REDIRECT_HTTP is set but --tcp / RINGMUX_TCP is off: \
                 the redirects would point to an HTTPS port nothing listens on; drop --tcp off"
            );
        }
        if self.access_log.trim().is_empty() {
            bail!(
                "--access-log / RINGMUX_ACCESS_LOG is empty: expected a file path, stderr or off"
            );
        }
        if self.tcp_listen.is_some() && !self.tcp_on() {
            bail!(
                "--tcp-listen / RINGMUX_TCP_LISTEN is set but --tcp / RINGMUX_TCP is off: drop \
                 --tcp off (TCP is on by default), or drop --tcp-listen"
            );
        }
        Ok(())
    }

    /// The user the workers run as, if not the demux's own, and that it can execute
    /// `worker_cmd`'s program. Workers keep ringmux's own user only when asked to
    /// (`self`, or `root` as root) or with `--sandbox off`: a worker of ringmux's user could
    /// otherwise read and write every file ringmux may, its keys and ACME state among them,
    /// but for Landlock.
    fn worker_user(&self, worker_cmd: &[String]) -> Result<Option<WorkerUser>> {
        let flag = "--worker-user / RINGMUX_WORKER_USER";
        let me = nix::unistd::geteuid();
        let worker_user = match self.worker_user.as_deref().map(str::trim) {
            Some(SELF_WORKER_USER) => None,
            Some("root" | "0") if me.is_root() => None,
            Some(u) => Some(WorkerUser::look_up(u)?),
            None if self.sandbox == Sandbox::Off => None,
            None if crate::sys::may_switch_user() => {
                Some(WorkerUser::look_up(DEFAULT_WORKER_USER).with_context(|| {
                    format!(
                        "ringmux may switch users (CAP_SETUID and CAP_SETGID), so its workers \
                         run as {DEFAULT_WORKER_USER:?} unless {flag} names another user (or \
                         `self`, to keep them ringmux's own)"
                    )
                })?)
            }
            None => bail!(
                "ringmux runs as UID {me} without CAP_SETUID and CAP_SETGID, so its workers \
                 would run as its own user and could read and write every file it may but for \
                 Landlock: grant ringmux both capabilities (as deploy/ringmux.service does) \
                 and set {flag} to a user of the workers' own (e.g. ringmux-worker), or set \
                 {flag}=self (TOML: worker_user = \"self\") to accept workers of ringmux's user"
            ),
        };
        if let Some(user) = &worker_user {
            let program = Path::new(&worker_cmd[0]);
            if let Err(why) = user.can_execute(program) {
                let why = crate::one_line(&why);
                bail!(
                    "the worker program {} cannot be executed by user {} (UID {}), whom the \
                     workers run as: {why}. Install ringmux where that user may read and \
                     execute it (e.g. /opt/ringmux/bin), or choose another user with \
                     --worker-user / RINGMUX_WORKER_USER (root keeps the workers root, \
                     without capabilities)",
                    program.display(),
                    user.name,
                    user.uid
                );
            }
            if let Some(root) = &self.root {
                if let Err(why) = user.can_enter(root) {
                    let why = crate::one_line(&why);
                    bail!(
                        "--root / RINGMUX_ROOT={} cannot be reached by user {} (UID {}), whom \
                         the workers run as: {why}. Let that user enter it and every folder \
                         above it, and read the files to serve (e.g. chmod o+rx), or choose \
                         another user with --worker-user / RINGMUX_WORKER_USER",
                        root.display(),
                        user.name,
                        user.uid
                    );
                }
            }
        }
        Ok(worker_user)
    }

    /// The file system's allow-list: `--worker-read` and `--worker-write` name absolute paths
    /// that exist, and Landlock is there to enforce it (unless `--sandbox` says otherwise).
    fn confinement(&self) -> Result<()> {
        for (flag, paths) in [
            ("--worker-read / RINGMUX_WORKER_READ", &self.worker_read),
            ("--worker-write / RINGMUX_WORKER_WRITE", &self.worker_write),
        ] {
            for path in paths {
                if !path.is_absolute() {
                    bail!(
                        "{flag}={} is not valid: expected absolute paths (starting with /)",
                        path.display()
                    );
                }
                if let Err(e) = std::fs::symlink_metadata(path) {
                    bail!(
                        "{flag}={}: {}; name paths that exist (the workers are granted what is \
                         beneath each)",
                        path.display(),
                        crate::one_line(&e)
                    );
                }
            }
        }
        if self.sandbox == Sandbox::On && crate::sys::landlock_abi().is_none() {
            bail!(
                "this kernel has no Landlock (Linux 5.13 or later, with landlock among the \
                 boot's LSMs: lsm=...,landlock), which keeps every worker to the files it needs: \
                 use a kernel with it, or set --sandbox / RINGMUX_SANDBOX=filter-only to run \
                 the workers under the system-call filter alone, where each may read and write \
                 every file its user may"
            );
        }
        Ok(())
    }
}

/// Why a [`WorkerUser`] may not execute the worker program ([`WorkerUser::can_execute`]).
#[derive(Debug, thiserror::Error)]
pub enum Unreachable {
    /// The program or a folder above it cannot be looked at (by ringmux itself).
    #[error("{}", path.display())]
    Unreadable {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The user has no search permission on `folder`.
    #[error("it may not enter the folder {}", folder.display())]
    ClosedFolder { folder: PathBuf },
    /// The user has no execute permission on `program`.
    #[error("{} is not executable for it", program.display())]
    NotExecutable { program: PathBuf },
}

/// Whom the workers of a ringmux that may switch users (root, or CAP_SETUID and CAP_SETGID)
/// run as, unless `--worker-user` says otherwise.
pub const DEFAULT_WORKER_USER: &str = "nobody";

/// `--worker-user self`: the workers keep ringmux's own user, asked for explicitly.
pub const SELF_WORKER_USER: &str = "self";

impl WorkerUser {
    /// `Ok` if this user may execute `program`: search permission on every folder above it and
    /// execute permission on the file itself, by the owner, group and other bits (access
    /// control lists are not read). `Err` names what is closed.
    pub fn can_execute(&self, program: &Path) -> std::result::Result<(), Unreachable> {
        self.can_reach(program, 0o1, |program| Unreachable::NotExecutable {
            program,
        })
    }

    /// `Ok` if this user may enter `folder` and every folder above it (`--root`: a worker
    /// opens the root by its path, then each file beneath it), by the same bits as
    /// [`WorkerUser::can_execute`].
    pub fn can_enter(&self, folder: &Path) -> std::result::Result<(), Unreachable> {
        self.can_reach(folder, 0o1, |folder| Unreachable::ClosedFolder { folder })
    }

    /// `Ok` if this user may enter every folder above `path` and has the permission `bits`
    /// (other's bits: 4 read, 1 execute or search) on `path` itself; else `denied(path)` or
    /// the folder that is closed.
    fn can_reach(
        &self,
        path: &Path,
        bits: u32,
        denied: impl FnOnce(PathBuf) -> Unreachable,
    ) -> std::result::Result<(), Unreachable> {
        let program = path;
        use std::os::unix::fs::MetadataExt;
        let metadata = |path: &Path| {
            std::fs::metadata(path).map_err(|source| Unreachable::Unreadable {
                path: path.to_owned(),
                source,
            })
        };
        let program = program
            .canonicalize()
            .map_err(|source| Unreachable::Unreadable {
                path: program.to_owned(),
                source,
            })?;
        let allows = |m: &std::fs::Metadata, bits: u32| {
            let mode = m.mode();
            let granted = if m.uid() == self.uid {
                mode >> 6
            } else if m.gid() == self.gid {
                mode >> 3
            } else {
                mode
            };
            granted & bits == bits
        };
        for dir in program.ancestors().skip(1) {
            if !allows(&metadata(dir)?, 0o1) {
                return Err(Unreachable::ClosedFolder {
                    folder: dir.to_owned(),
                });
            }
        }
        if !allows(&metadata(&program)?, bits) {
            return Err(denied(program));
        }
        Ok(())
    }

    /// `spec`, a user name or a numeric UID, from the user database: neither root nor
    /// ringmux's own user, and ringmux must hold CAP_SETUID and CAP_SETGID to switch to it.
    fn look_up(spec: &str) -> Result<WorkerUser> {
        use nix::unistd::{Uid, User};
        let flag = "--worker-user / RINGMUX_WORKER_USER";
        let found = match spec.trim().parse::<u32>() {
            Ok(uid) => User::from_uid(Uid::from_raw(uid)),
            Err(_) => User::from_name(spec.trim()),
        };
        let user = match found {
            Ok(Some(u)) => u,
            Ok(None) => {
                bail!("{flag}={spec:?} is not valid: no such user (see /etc/passwd; e.g. nobody)")
            }
            Err(e) => bail!("{flag}={spec:?}: looking the user up failed: {e}"),
        };
        if user.uid.is_root() {
            bail!(
                "{flag}={spec:?} is root by another name: name an unprivileged user, e.g. \
                 nobody, or `root` itself to keep the workers root without capabilities"
            );
        }
        let me = nix::unistd::geteuid();
        if user.uid == me {
            bail!(
                "{flag}={spec:?} is ringmux's own user (UID {me}): its workers could read and \
                 write every file ringmux may but for Landlock. Name a user of the workers' own \
                 (e.g. ringmux-worker), or `self` to accept workers of ringmux's user"
            );
        }
        if !crate::sys::may_switch_user() {
            bail!(
                "{flag}={spec:?} needs ringmux to hold CAP_SETUID and CAP_SETGID (as root, or \
                 granted by its unit: AmbientCapabilities=CAP_SETUID CAP_SETGID, see \
                 deploy/ringmux.service); it is UID {me} without them. Grant them, or set \
                 {flag}=self to run the workers as ringmux's own user"
            );
        }
        Ok(WorkerUser {
            name: user.name,
            uid: user.uid.as_raw(),
            gid: user.gid.as_raw(),
        })
    }
}

/// `name` if it is a path to a file, else the first file of that name on `PATH`.
fn find_program(name: &str) -> Option<PathBuf> {
    if name.contains('/') {
        let p = PathBuf::from(name);
        return p.is_file().then_some(p);
    }
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
}

impl Config {
    /// The site table of the command line: one site, the default, answering every name with
    /// `cert` (`--cert`/`--key`, or the self-signed one), serving `--upstream`, or `--root`
    /// and the built-in responses.
    pub fn site_table(&self, cert: crate::certs::CertPem) -> SiteTable {
        let action = match &self.upstream {
            Some(url) => {
                let mut action = Action::upstream(url.clone(), false);
                if let Action::Upstream { tls, .. } = &mut action {
                    // Checked by `serving` when the configuration was read; a bundle gone
                    // since leaves the worker to refuse the route, naming it.
                    if url.scheme.tls() {
                        tls.roots_pem = crate::certs::system_roots_pem().unwrap_or_default();
                    }
                }
                action
            }
            None => Action::Builtin {
                root: self.args.root.clone(),
            },
        };
        SiteTable {
            sites: vec![Site {
                label: "default".into(),
                names: Vec::new(),
                cert_pem: cert.chain,
                key_pem: cert.key,
                acme: false,
                routes: vec![Route {
                    compress: None,
                    path: "/".into(),
                    action,
                    rules: Default::default(),
                    limits: Default::default(),
                }],
                redirect_names: Vec::new(),
                compress: None,
                rules: Default::default(),
                limits: Default::default(),
            }],
            default_site: Some(0),
        }
    }

    /// The `alt-svc` value for TCP responses (`--alt-svc`), the UDP port being `udp_port`.
    pub fn alt_svc(&self, udp_port: u16) -> Option<String> {
        match self.args.alt_svc.trim() {
            "off" => None,
            "auto" => Some(format!("h3=\":{udp_port}\"; ma=86400")),
            value => Some(value.to_string()),
        }
    }

    /// The TCP address to listen on (`--tcp-listen`, else `--listen`'s with the UDP socket's
    /// port), with `--tcp on`.
    pub fn tcp_addr(&self, udp: SocketAddr) -> Option<SocketAddr> {
        self.args.tcp_on().then(|| {
            self.args
                .tcp_listen
                .unwrap_or_else(|| SocketAddr::new(self.args.listen.ip(), udp.port()))
        })
    }

    /// Where the access log goes (`--access-log`).
    pub fn access_log(&self) -> AccessLog {
        match self.args.access_log.trim() {
            "off" => AccessLog::Off,
            "stderr" => AccessLog::Stderr,
            path => AccessLog::File(path.into()),
        }
    }

    /// What the operator should know of how the workers are confined, said at start and by
    /// `ringmux check`: a confinement turned down (`--sandbox`), workers of ringmux's own user.
    pub fn confinement_warnings(&self) -> Vec<String> {
        let mut warnings = Vec::new();
        match self.args.sandbox {
            Sandbox::Off => warnings.push(
                "--sandbox off: workers run UNCONFINED. Any worker can stop, trace or read the \
                 demux and its siblings, start processes, read every instance's datagrams and \
                 every file its user may. For debugging a worker only"
                    .to_string(),
            ),
            Sandbox::FilterOnly => warnings.push(
                "--sandbox filter-only: no Landlock allow-list; every worker may read and write \
                 every file its user may"
                    .to_string(),
            ),
            Sandbox::On => {}
        }
        if self.args.sandbox != Sandbox::Off && self.worker_user.is_none() {
            let me = nix::unistd::geteuid();
            warnings.push(match me.is_root() {
                true => "workers run as root (--worker-user root or self): confined by the \
                         system-call filter and Landlock and without capabilities, but of the \
                         demux's user ID. Leave --worker-user (RINGMUX_WORKER_USER) out, as \
                         root, to run them as nobody"
                    .to_string(),
                false => format!(
                    "workers run as ringmux's own user (UID {me}, --worker-user self): the \
                     file permissions do not keep them from ringmux's files (keys, ACME \
                     state, configuration); only the Landlock allow-list does. Grant ringmux \
                     CAP_SETUID and CAP_SETGID and name a user of the workers' own \
                     (deploy/ringmux.service)"
                ),
            });
        }
        warnings
    }

    /// The program every instance runs (for logs and metrics).
    pub fn worker_program(&self) -> &str {
        &self.worker_cmd[0]
    }

    /// What the workers run, as the metrics show it: `--worker-cmd`'s program and arguments,
    /// or the built-in worker's program alone (its options are this command line's).
    pub fn worker_label(&self) -> String {
        match self.args.worker_cmd {
            Some(_) => self.worker_cmd.join(" "),
            None => self.worker_program().to_string(),
        }
    }

    /// The ring occupancy (slots) from which new connections are shed; `u64::MAX` at 100 %.
    pub fn shed_at_slots(&self) -> u64 {
        match self.args.initial_shed_at {
            100 => u64::MAX,
            pct => (u64::from(self.ring.slots) * u64::from(pct))
                .div_ceil(100)
                .max(1),
        }
    }

    /// What the data plane's admission of new connections needs.
    pub fn admission(&self) -> crate::admission::Settings {
        crate::admission::Settings {
            retry: self.args.retry,
            retry_above: self.args.retry_above,
            prefix_budget: self.args.prefix_budget,
            prefix_v4: self.args.prefix_v4,
            prefix_v6: self.args.prefix_v6,
        }
    }

    /// How long a starting worker has to report READY.
    pub fn ready_timeout(&self) -> Duration {
        Duration::from_secs(self.args.ready_timeout)
    }

    /// How long a drain may last (`None`: no bound, the default).
    pub fn grace(&self) -> Option<Duration> {
        self.args.grace.0.map(Duration::from_secs)
    }

    /// Most generations draining beside the serving one.
    pub fn max_draining(&self) -> usize {
        usize::from(self.args.max_draining)
    }

    /// CPU of the demux's data plane, if pinning was asked for.
    pub fn demux_cpu(&self) -> Option<usize> {
        self.args.cpus.first().copied()
    }

    /// CPU of instance `i`: the list after the demux's, cycled.
    pub fn worker_cpu(&self, i: u8) -> Option<usize> {
        let rest = self.args.cpus.get(1..)?;
        (!rest.is_empty()).then(|| rest[i as usize % rest.len()])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Parses and validates a command line (the worker program is /bin/true, which exists).
    fn check(args: &[&str]) -> Result<Config> {
        let mut argv = vec!["ringmux", "--worker-bin", "/bin/true"];
        // Without CAP_SETUID, workers of ringmux's user must be asked for.
        if !crate::sys::may_switch_user() && !args.contains(&"--worker-user") {
            argv.extend(["--worker-user", "self"]);
        }
        argv.extend_from_slice(args);
        parse_from(argv.into_iter().map(Into::into).collect())?
            .run
            .validate()
    }

    fn refused(args: &[&str]) -> String {
        format!("{:#}", check(args).expect_err("accepted a bad value"))
    }

    #[test]
    fn a_reload_takes_up_grace_and_max_draining_but_not_instances() {
        let running = check(&[]).unwrap();
        let bounded = check(&["--grace", "30", "--max-draining", "1"]).unwrap();
        assert_eq!(running.restart_needed(&bounded), Vec::<String>::new());
        assert_eq!(bounded.restart_needed(&running), Vec::<String>::new());
        let more = check(&["--instances", "3", "--grace", "30"]).unwrap();
        assert_eq!(
            running.restart_needed(&more),
            ["instances (--instances)".to_string()]
        );
    }

    #[test]
    fn defaults_are_valid() {
        let c = check(&[]).unwrap();
        assert_eq!(c.instances, 2);
        assert_eq!(
            c.worker_cmd,
            [
                "/bin/true",
                "--max-bytes=67108864",
                "--file-cache-mb=64",
                "--upstream-timeout=60",
                "--tcp-max-connections=4096",
                "--tcp-idle-timeout=60",
                "--max-tunnels=4096",
                "--tunnel-idle=300",
                "--access-log-format=ringmux"
            ]
        );
        assert_eq!(c.worker_label(), "/bin/true");
        assert_eq!(
            c.nonce_len, 14,
            "node ID 00: server ID 2 bytes, nonce fills 16"
        );
        assert_eq!(c.ready_timeout(), Duration::from_secs(30));
        assert_eq!(c.grace(), None, "no clock on a drain by default");
        assert_eq!(c.max_draining(), 3);
        for off in ["off", "none"] {
            assert_eq!(check(&["--grace", off]).unwrap().grace(), None);
        }
        let bounded = check(&["--grace", "7", "--max-draining", "1"]).unwrap();
        assert_eq!(bounded.grace(), Some(Duration::from_secs(7)));
        assert_eq!(bounded.max_draining(), 1);
        assert_eq!(c.metrics, Some("127.0.0.1:9433".parse().unwrap()));
        // Half of the default 4096 slots; at 100 % never.
        assert_eq!(c.shed_at_slots(), 2048);
        let never = check(&["--initial-shed-at", "100"]).unwrap();
        assert_eq!(never.shed_at_slots(), u64::MAX);
        let tiny = check(&["--initial-shed-at", "1", "--ring-slots", "64"]).unwrap();
        assert_eq!(tiny.shed_at_slots(), 1);
        let steered = check(&["--forward", "reuseport", "--plaintext-cids"]).unwrap();
        assert_eq!(steered.args.forward, ForwardMode::Reuseport);
    }

    #[test]
    fn bad_values_are_refused_naming_flag_variable_and_value() {
        for (args, wants) in [
            (
                &["--instances", "0"][..],
                &["--instances", "RINGMUX_INSTANCES", "0"][..],
            ),
            (&["--instances", "65"], &["--instances", "65", "1 to 64"]),
            (
                &["--forward", "reuseport"],
                &["--forward reuseport", "RINGMUX_FORWARD", "--plaintext-cids"],
            ),
            (
                &["--recv-batch", "33"],
                &["--recv-batch", "RINGMUX_RECV_BATCH", "33"],
            ),
            (
                &["--recv-coalesce-us", "1001"],
                &[
                    "--recv-coalesce-us",
                    "RINGMUX_RECV_COALESCE_US",
                    "1001",
                    "0 to 1000",
                ],
            ),
            (
                &["--node-id", "zz"],
                &["--node-id", "RINGMUX_NODE_ID", "zz"],
            ),
            (&["--grace", "0"], &["--grace", "RINGMUX_GRACE", "off"]),
            (&["--grace", "soon"], &["--grace", "RINGMUX_GRACE", "soon"]),
            (
                &["--max-draining", "4"],
                &["--max-draining", "RINGMUX_MAX_DRAINING", "4", "1 to 3"],
            ),
            (
                &["--max-draining", "0"],
                &["--max-draining", "RINGMUX_MAX_DRAINING", "0", "1 to 3"],
            ),
            (
                &["--ready-timeout", "0"],
                &["--ready-timeout", "RINGMUX_READY_TIMEOUT"],
            ),
            (
                &["--metrics", "nope"],
                &["--metrics", "RINGMUX_METRICS", "nope"],
            ),
            (
                &["--ring-slots", "1000"],
                &["--ring-slots", "RINGMUX_RING_SLOTS", "1000", "power of two"],
            ),
            (
                &["--slot-bytes", "1500"],
                &[
                    "--slot-bytes",
                    "RINGMUX_SLOT_BYTES",
                    "1500",
                    "multiple of 64",
                ],
            ),
            (
                &["--spin-us", "2000000"],
                &["--spin-us", "RINGMUX_SPIN_US", "2000000", "0 to 1000000"],
            ),
            (
                &["--worker-cmd", "'unbalanced"],
                &["--worker-cmd", "RINGMUX_WORKER_CMD"],
            ),
            (
                &["--worker-cmd", ""],
                &["--worker-cmd", "RINGMUX_WORKER_CMD"],
            ),
            (
                &["--worker-cmd", "no-such-program-here --flag"],
                &["--worker-cmd", "no-such-program-here", "PATH"],
            ),
            (
                &["--root", "/nonexistent/root"],
                &["--root", "RINGMUX_ROOT"],
            ),
            (
                &["--upstream", "ftp://127.0.0.1:8443"],
                &[
                    "--upstream",
                    "RINGMUX_UPSTREAM",
                    "ftp://127.0.0.1:8443",
                    "h2c://HOST:PORT",
                ],
            ),
            (
                &["--upstream", "http://127.0.0.1:8080/api"],
                &["--upstream", "RINGMUX_UPSTREAM", "/api", "path"],
            ),
            (
                &["--initial-shed-at", "0"],
                &["--initial-shed-at", "RINGMUX_INITIAL_SHED_AT", "1 to 100"],
            ),
            (
                &["--initial-shed-at", "101"],
                &["--initial-shed-at", "RINGMUX_INITIAL_SHED_AT", "101"],
            ),
            (
                &["--alt-svc", "h3=\":443\"\u{1}"],
                &["--alt-svc", "RINGMUX_ALT_SVC", "printable ASCII"],
            ),
            (
                &["--tcp", "off", "--tcp-listen", "127.0.0.1:8443"],
                &["--tcp-listen", "RINGMUX_TCP_LISTEN", "--tcp off"],
            ),
            (
                &["--tcp-idle-timeout", "3601"],
                &[
                    "--tcp-idle-timeout",
                    "RINGMUX_TCP_IDLE_TIMEOUT",
                    "3601",
                    "1..=3600",
                ],
            ),
            (
                &["--worker-user", "no-such-user-here"],
                &["--worker-user", "RINGMUX_WORKER_USER", "no such user"],
            ),
            (
                &["--upstream-timeout", "0"],
                &["--upstream-timeout", "RINGMUX_UPSTREAM_TIMEOUT", "1..=3600"],
            ),
        ] {
            let e = refused(args);
            for w in wants {
                assert!(e.contains(w), "{args:?}: {e:?} does not name {w:?}");
            }
        }
    }

    /// Node IDs of 1 to 8 bytes (8: an AWS NLB QUIC server ID, written as NLB gives it, with
    /// 0x) make a QUIC-LB configuration the codec accepts, with the default nonce filling one
    /// AES block; the longest node ID leaves the shortest nonce in a 20-byte CID.
    #[test]
    fn node_ids_of_1_to_8_bytes_and_the_default_nonce() {
        for len in 1..=8usize {
            let hex = format!("0x{}", "a5".repeat(len));
            let c = check(&["--node-id", &hex, "--plaintext-cids"]).unwrap();
            assert_eq!(c.node_id, vec![0xa5; len]);
            assert_eq!(usize::from(c.nonce_len), 16 - len - 1, "{len}");
            let lb = ringmux_quic_lb::QuicLbConfig {
                config_id: c.args.config_id,
                node_id: c.node_id.clone(),
                instance_count: c.instances,
                nonce_len: c.nonce_len,
                key: None,
            };
            lb.validate().unwrap();
            assert_eq!(lb.cid_len(), 17);
        }
        assert_eq!(default_nonce_len(11), 4);
        assert_eq!(default_nonce_len(14), 4);
        let e = refused(&["--node-id", "0x"]);
        assert!(
            e.contains("--node-id") && e.contains("at least one hex byte"),
            "{e}"
        );
    }

    #[test]
    fn upstream_is_checked_and_excludes_root() {
        let c = check(&["--upstream", "http://localhost:8080"]).unwrap();
        assert_eq!(
            c.upstream.map(|u| u.to_string()).as_deref(),
            Some("http://localhost:8080")
        );
        let e = refused(&["--upstream", "http://localhost:8080", "--root", "/"]);
        assert!(e.contains("--root") && e.contains("--upstream"), "{e}");
    }

    #[test]
    fn worker_read_and_write_name_absolute_paths_that_exist() {
        let c = check(&[
            "--worker-read",
            "/usr/lib,/etc/ssl",
            "--worker-write",
            "/tmp",
        ])
        .unwrap();
        assert_eq!(
            c.args.worker_read,
            [PathBuf::from("/usr/lib"), PathBuf::from("/etc/ssl")]
        );
        assert_eq!(c.args.worker_write, [PathBuf::from("/tmp")]);
        let e = refused(&["--worker-read", "usr/lib"]);
        assert!(
            e.contains("--worker-read / RINGMUX_WORKER_READ=usr/lib") && e.contains("absolute"),
            "{e}"
        );
        let e = refused(&["--worker-write", "/no/such/folder"]);
        assert!(
            e.contains("--worker-write / RINGMUX_WORKER_WRITE=/no/such/folder")
                && e.contains("exist"),
            "{e}"
        );
    }

    /// `self` keeps the workers ringmux's own user, and says so; naming ringmux's own user
    /// otherwise is refused.
    #[test]
    fn workers_of_ringmuxs_own_user_are_asked_for_by_name() {
        let c = check(&["--worker-user", "self"]).unwrap();
        assert_eq!(c.worker_user, None);
        let warnings = c.confinement_warnings().join("\n");
        assert!(
            warnings.contains("--worker-user") && warnings.contains("self"),
            "{warnings}"
        );
        let me = nix::unistd::geteuid();
        if !me.is_root() {
            let e = refused(&["--worker-user", &me.to_string()]);
            assert!(
                e.contains("ringmux's own user") && e.contains("self"),
                "{e}"
            );
        }
        let c = check(&["--sandbox", "filter-only", "--worker-user", "self"]).unwrap();
        let warnings = c.confinement_warnings().join("\n");
        assert!(warnings.contains("filter-only"), "{warnings}");
    }

    /// As root (or with CAP_SETUID and CAP_SETGID), the workers run as nobody unless told.
    #[test]
    fn a_ringmux_that_may_switch_users_runs_its_workers_as_nobody() {
        if !crate::sys::may_switch_user() {
            eprintln!("skipped: this test process may not switch users");
            return;
        }
        let c = check(&[]).unwrap();
        assert_eq!(
            c.worker_user.as_ref().map(|u| u.name.as_str()),
            Some(DEFAULT_WORKER_USER)
        );
        assert!(c.confinement_warnings().is_empty());
    }

    #[test]
    fn worker_cmd_is_split_like_a_shell_and_found_on_path() {
        let c = check(&["--worker-cmd", "true --name 'two words' x\\ y"]).unwrap();
        assert!(c.worker_cmd[0].ends_with("/true"), "{:?}", c.worker_cmd);
        assert_eq!(c.worker_cmd[1..], ["--name", "two words", "x y"]);
        assert_eq!(c.worker_program(), c.worker_cmd[0]);
        assert_eq!(c.worker_label(), c.worker_cmd.join(" "));
    }

    #[test]
    fn the_built_in_workers_options_go_to_it_alone() {
        let c = check(&[
            "--root",
            "/",
            "--cache-control",
            "no-cache",
            "--worker-mode",
            "sink",
        ])
        .unwrap();
        assert!(
            !c.worker_cmd.iter().any(|a| a.starts_with("--root")),
            "--root goes in the site table: {:?}",
            c.worker_cmd
        );
        for arg in ["--cache-control=no-cache", "--sink"] {
            assert!(
                c.worker_cmd.iter().any(|a| a == arg),
                "{arg}: {:?}",
                c.worker_cmd
            );
        }
        let c = check(&["--worker-cmd", "true --root /srv"]).unwrap();
        assert_eq!(
            c.worker_cmd[1..],
            ["--root", "/srv"],
            "only what --worker-cmd says"
        );
        for (flag, value) in [
            ("--root", "/"),
            ("--cache-control", "no-cache"),
            ("--upstream", "http://127.0.0.1:8080"),
            ("--worker-mode", "sink"),
        ] {
            let e = refused(&["--worker-cmd", "true", flag, value]);
            assert!(e.contains(flag) && e.contains("--worker-cmd"), "{e}");
        }
    }

    #[test]
    fn a_worker_user_must_reach_the_worker_program() {
        let tmp = ringmux_testkit::temp_dir("ringmux-reach");
        let base = tmp.path().to_path_buf();
        let inner = base.join("inner");
        std::fs::create_dir_all(&inner).unwrap();
        let program = inner.join("prog");
        std::fs::write(&program, b"#!/bin/sh\n").unwrap();
        let stranger = stranger();
        set_mode(&base, 0o755);
        set_mode(&inner, 0o755);
        set_mode(&program, 0o755);
        assert!(stranger.can_execute(&program).is_ok());
        set_mode(&inner, 0o750);
        let e = stranger.can_execute(&program).unwrap_err();
        assert!(
            matches!(&e, Unreachable::ClosedFolder { folder } if *folder == inner.canonicalize().unwrap()),
            "{e}"
        );
        assert!(e.to_string().contains("inner"), "{e}");
        set_mode(&inner, 0o755);
        set_mode(&program, 0o754);
        let e = stranger.can_execute(&program).unwrap_err().to_string();
        assert!(e.contains("not executable"), "{e}");
        let gone = stranger
            .can_execute(&base.join("no-such-program"))
            .unwrap_err();
        let e = crate::one_line(&gone);
        assert!(e.contains("no-such-program: "), "the path, then why: {e}");
    }

    /// A user that owns none of a test's files, in no group of them: the other bits decide.
    fn stranger() -> WorkerUser {
        WorkerUser {
            name: "stranger".into(),
            uid: 4_000_000_001,
            gid: 4_000_000_001,
        }
    }

    fn set_mode(path: &Path, mode: u32) {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
    }

    #[test]
    fn a_worker_user_must_enter_the_root() {
        let tmp = ringmux_testkit::temp_dir("ringmux-reach-root");
        let above = tmp.path().join("above");
        let root = above.join("site");
        std::fs::create_dir_all(&root).unwrap();
        let stranger = stranger();
        set_mode(&above, 0o755);
        set_mode(&root, 0o711);
        assert!(stranger.can_enter(&root).is_ok());
        for closed in [&root, &above] {
            set_mode(closed, 0o750);
            let e = stranger.can_enter(&root).unwrap_err();
            assert!(
                matches!(&e, Unreachable::ClosedFolder { folder } if *folder == closed.canonicalize().unwrap()),
                "{e}"
            );
            set_mode(closed, 0o755);
        }
    }

    #[test]
    fn cpus_go_to_the_demux_first_then_cycle_over_instances() {
        let c = check(&["--instances", "3", "--cpus", "0,2,3"]).unwrap();
        assert_eq!(c.demux_cpu(), Some(0));
        assert_eq!(
            (0..3).map(|i| c.worker_cpu(i)).collect::<Vec<_>>(),
            [Some(2), Some(3), Some(2)]
        );
        let c = check(&[]).unwrap();
        assert_eq!((c.demux_cpu(), c.worker_cpu(0)), (None, None));
    }

    #[test]
    fn grace_and_redirect_refusals_say_why_in_their_words() {
        assert_eq!(
            parse_grace("0").unwrap_err().to_string(),
            "0 would cut every drain at once: expected at least 1 second, or off for no bound"
        );
        assert_eq!(
            parse_grace("soon").unwrap_err().to_string(),
            "expected a number of seconds (at least 1), or off for no bound; got \"soon\""
        );
        assert_eq!(parse_grace(" 30 ").unwrap(), Grace(Some(30)));
        assert_eq!(
            parse_redirect_http("localhost:80").unwrap_err().to_string(),
            "invalid socket address syntax: expected IP:PORT (e.g. 0.0.0.0:80 or [::]:80) or off"
        );
        assert_eq!(parse_redirect_http("off").unwrap(), RedirectHttp::Off);
    }
}
