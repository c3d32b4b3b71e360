//! The command line's declaration: every subcommand ([`Cli`], [`Command`]), every option of a
//! start ([`RunArgs`], [`RingArgs`]) with its `RINGMUX_*` variable and its help, the values the
//! flags take, and the client commands' targets ([`ControlTarget`], [`MetricsTarget`]). The
//! configuration file's keys are these options' names ([`mod@super::file`]); what they resolve
//! to is [`super::resolve`]'s. This module declares and parses single values only: it imports
//! no sibling but the file as read ([`super::document`]), which it holds.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Result;
use clap::{Args, Parser, Subcommand, ValueEnum};
use ringmux_proto::serve::ServeArgs;
use ringmux_ring::{ConfigError, RingConfig, RingField, SpinPolicy};

use super::document::FileConfig;
use crate::admission::RetryMode;
use crate::forward::ForwardMode;
use crate::options::Toggle;

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
        /// fetched over the roots the ACME client would trust (`[acme]` ca_roots and the
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
        target: MetricsTarget,
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
        target: ControlTarget,
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
        target: ControlTarget,
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
        target: ControlTarget,
        /// Seconds to wait for the answer (an order takes seconds to minutes).
        #[arg(long, default_value_t = 600)]
        timeout: u64,
    },
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
    /// The configuration file, read ([`super::parse`]).
    #[arg(skip)]
    pub file: Option<std::sync::Arc<FileConfig>>,
    /// Every option's value as given, the file's included ([`super::parse`]): what a reload compares
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
    /// µs at the 99th percentile) for more CPU (bench/RESULTS.md has the figures). Either
    /// polls on for up to 100 µs while the demux is saturated (its receives fill their batches
    /// back to back), so that it then pays no wake-ups.
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
}

/// The control socket of the running ringmux (`reload`, `upgrade`, `acme renew`).
#[derive(Args, Debug, Clone)]
pub struct ControlTarget {
    /// The running ringmux's configuration file: the control socket is the file's
    /// `control_socket` unless --control-socket / RINGMUX_CONTROL_SOCKET names one.
    #[arg(long, env = "RINGMUX_CONFIG")]
    pub config: Option<PathBuf>,
    /// Control socket of the running ringmux [default: the file's `control_socket`, else
    /// /run/ringmux/control.sock].
    #[arg(long, env = "RINGMUX_CONTROL_SOCKET")]
    pub control_socket: Option<PathBuf>,
}

/// The metrics address of the running ringmux (`stats`).
#[derive(Args, Debug, Clone)]
pub struct MetricsTarget {
    /// The running ringmux's configuration file: the metrics address is the file's `metrics`
    /// unless --metrics / RINGMUX_METRICS names one.
    #[arg(long, env = "RINGMUX_CONFIG")]
    pub config: Option<PathBuf>,
    /// Metrics address of the running ringmux [default: the file's `metrics`, else
    /// 127.0.0.1:9433].
    #[arg(long, env = "RINGMUX_METRICS")]
    pub metrics: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

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
