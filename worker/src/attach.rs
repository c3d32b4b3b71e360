//! [`Worker`]: what a process started by ringmux calls to become one instance.
//!
//! ```no_run
//! # async fn app() -> Result<(), Box<dyn std::error::Error>> {
//! let worker = ringmux_worker::Worker::attach()?; // the hand-off from the demux
//! let tls = worker.tls_config(&[b"h3"])?; // or build your own rustls::ServerConfig
//! let server = worker.server_config(tls)?; // a quinn::ServerConfig: adjust it freely
//! let endpoint = worker.endpoint(server)?; // a quinn::Endpoint fed by this instance's ring
//! let mut drain = worker.drain_signal();
//! loop {
//!     tokio::select! {
//!         incoming = endpoint.accept() => match incoming {
//!             Some(incoming) => { tokio::spawn(async move { let _conn = incoming.await; }); }
//!             None => break,
//!         },
//!         _ = drain.wait() => break, // the demux asked us to drain
//!     }
//! }
//! endpoint.close(0u32.into(), b"draining");
//! endpoint.wait_idle().await;
//! # Ok(()) }
//! ```
//!
//! # What the library shares, and what stays yours
//!
//! Instances must look like one server to a client, so a few things are not the
//! application's to choose; the library sets them and refuses configurations that conflict:
//!
//! * **Connection IDs**: QUIC-LB CIDs that route to this instance (the endpoint's
//!   `EndpointConfig` is the library's, with the shared stateless-reset key, so a sibling or a
//!   replacement can reset this instance's connections after it dies).
//! * **Address-validation tokens** (Retry, NEW_TOKEN): sealed with the shared token key, so a
//!   token from one instance is valid on every instance ([`Worker::server_config`]). The demux
//!   sends Retries itself (`ringmux --retry`), in quinn's token format under that key: keep
//!   the token key, and a `retry_token_lifetime` of at least quinn's default 15 s, or the
//!   clients it validated are refused.
//! * **TLS session resumption and 0-RTT**: sessions are stored in the demux's cache, so a
//!   resumed connection is accepted whichever instance it reaches. The library sets
//!   `session_storage` of your rustls config and refuses one with a stateless `ticketer`
//!   (rustls never accepts 0-RTT with stateless tickets).
//! * **The socket**: datagrams arrive through the ring (or the unix ingress); replies leave
//!   from the public socket. Never bind sockets of your own on the public address.
//!
//! Everything else is yours: the rustls config (ALPN, certificates, cipher suites), the quinn
//! `ServerConfig` and `TransportConfig` (limits, timeouts, congestion control), what you serve.
//!
//! # What it does for you
//!
//! Reads the hand-off (the demux has already pinned the process to its CPU), dies with
//! the demux, reports `READY` once the endpoint exists, reports counters about once a second,
//! and turns the demux's drain request (and SIGTERM) into [`Worker::drain_signal`]. It puts
//! the ACME certificates the demux sends into [`Worker::certificates`] (QUIC and TCP at once)
//! and its pending challenges into [`Worker::acme_answers`], and confirms each (`APPLIED`);
//! answering the challenges on the TCP listeners is the program's (ringmux's own server does).

use std::fmt;
use std::io;
use std::net::SocketAddr;
use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use quinn::crypto::rustls::QuicServerConfig;
use ringmux_proto::series::{Series, SeriesError};
use ringmux_proto::{
    Handoff, HandoffError, IngressKind, Message, WorkerReport, CONTROL_FD_ENV, PUBLIC_FD_ENV,
};
use ringmux_quic_lb::{CidGenerator, KeySet, QuicLbConfig, Router};
use ringmux_ring::Consumer;
use tokio::sync::watch;

use crate::acme::{self, AcmeAnswers};
use crate::control::{self, ControlError};
use crate::ingress::Ingress;
use crate::quic::{endpoint_config, server_config, ServerOptions};
use crate::sessions::RemoteSessionStore;
use crate::socket::{CountingSocket, IngressStats, RingSocket};
use crate::sys::{self, SockType};
use crate::tls::{self, SiteCerts, TlsError};
use ringmux_proto::sites::SiteTable;

/// Why a worker cannot attach or configure its endpoint.
#[derive(Debug, thiserror::Error)]
pub enum AttachError {
    /// The process was not started by ringmux.
    #[error(
        "{var} is not set: this program is a ringmux worker and must be started by ringmux, \
         e.g. `ringmux --worker-cmd '{program}'` (ringmux passes it its control and public sockets)"
    )]
    NotStartedByRingmux { var: &'static str, program: String },
    /// A descriptor named by the environment is not what ringmux passes there.
    #[error(
        "{var}={value:?}: {problem}; it is set by ringmux for its workers, do not set it by hand"
    )]
    BadInheritedFd {
        var: &'static str,
        value: String,
        problem: String,
    },
    /// The hand-off could not be read or used (the reason is in the message, so not the
    /// error's `source`).
    #[error("reading the hand-off from the demux: {0}")]
    Control(ControlError),
    /// The hand-off was read but does not make sense (keys, QUIC-LB parameters, certificate).
    #[error("the hand-off's {what}: {problem}")]
    Handoff { what: &'static str, problem: String },
    /// The application's configuration conflicts with what instances must share.
    #[error("configuration conflict: {0}")]
    Conflict(String),
    /// TLS configuration refused.
    #[error(transparent)]
    Tls(#[from] TlsError),
    /// A system call failed.
    #[error("{what}: {error}")]
    Io {
        what: &'static str,
        /// The OS error (in the message, so not the error's `source`).
        error: io::Error,
    },
}

impl From<ControlError> for AttachError {
    fn from(e: ControlError) -> Self {
        AttachError::Control(e)
    }
}

impl From<HandoffError> for AttachError {
    fn from(e: HandoffError) -> Self {
        AttachError::Control(ControlError::Handoff(e))
    }
}

/// Fires when the worker should drain ([`Worker::drain_signal`]), or stop serving now
/// ([`Worker::cut_signal`]).
#[derive(Debug, Clone)]
pub struct Drain(watch::Receiver<bool>);

impl Drain {
    /// Resolves once draining was requested (at once if it was already). Cancel-safe: use it
    /// in `tokio::select!`.
    pub async fn wait(&mut self) {
        // An error means the worker (and its sender) is gone: drain too.
        let _ = self.0.wait_for(|d| *d).await;
    }

    /// Whether draining was requested.
    pub fn is_requested(&self) -> bool {
        *self.0.borrow()
    }

    /// The underlying watch channel (`true` once draining), for APIs that take one.
    pub fn into_receiver(self) -> watch::Receiver<bool> {
        self.0
    }
}

pub use crate::counters::ReportFn;

/// One ringmux instance: the hand-off received, its descriptors held until the endpoint is
/// made. See the module documentation.
pub struct Worker {
    instance: u8,
    /// The worker generation (1 at start, one more per reload); its slot is in every CID.
    worker_generation: u64,
    instances: u8,
    lb: QuicLbConfig,
    keys: KeySet,
    cid_lifetime: Option<Duration>,
    public_addr: SocketAddr,
    /// The sites this worker serves, as the demux handed them over.
    sites: SiteTable,
    /// Their certificates, chosen by SNI; the demux replaces an ACME site's at run time.
    certificates: SiteCerts,
    /// The ACME challenges pending now, as the demux sets them.
    acme: AcmeAnswers,
    /// The operator's QUIC idle timeout (`ringmux --idle-timeout`).
    idle_timeout: Duration,
    alt_svc: Option<String>,
    parts: Mutex<Option<Parts>>,
    /// The descriptors every worker shares, until taken.
    shared: Mutex<Shared>,
    sessions: Arc<RemoteSessionStore>,
    drain_tx: watch::Sender<bool>,
    /// `true` once the demux said `CUT` ([`Worker::cut_signal`]).
    cut_tx: watch::Sender<bool>,
    /// What each report carries of the program's: its series and its [`ReportFn`].
    report: Arc<crate::counters::Report>,
    /// The loops that accept from the shared listeners ([`Worker::accepting`]).
    accepting: Arc<AcceptState>,
}

/// Whether this worker still accepts from the shared TCP listeners: what `STOPPED` reports.
#[derive(Debug, Default)]
struct AcceptState {
    /// A shared listener was taken ([`Worker::tcp_listener`], [`Worker::redirect_listener`]).
    taken: AtomicBool,
    /// Every [`Accepting`] guard handed out ([`Worker::accepting`]).
    guards: AtomicBool,
    /// Guards alive.
    live: std::sync::atomic::AtomicUsize,
    /// Woken when the last guard goes.
    gone: tokio::sync::Notify,
}

impl AcceptState {
    /// No loop of this worker accepts from a shared listener: none was taken, or every loop
    /// that said it accepts ([`Accepting`]) has stopped. A listener taken without a guard
    /// never counts as stopped.
    fn stopped(&self) -> bool {
        !self.taken.load(Ordering::Acquire)
            || (self.guards.load(Ordering::Acquire) && self.live.load(Ordering::Acquire) == 0)
    }
}

/// Held by a loop that accepts from a shared listener ([`Worker::accepting`]); dropped when it
/// stops accepting on a drain.
#[derive(Debug)]
pub struct Accepting(Arc<AcceptState>);

impl Drop for Accepting {
    fn drop(&mut self) {
        if self.0.live.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.gone.notify_one();
        }
    }
}

/// The descriptors every worker shares with the others and the demux (5 to 7), until the
/// program takes them.
#[derive(Debug, Default)]
struct Shared {
    /// The HTTPS listener (`--tcp on`): [`Worker::tcp_listener`].
    tcp: Option<OwnedFd>,
    /// The plain-HTTP listener (`--redirect-http`): [`Worker::redirect_listener`].
    redirect: Option<OwnedFd>,
    /// The access log (`--access-log`): [`Worker::access_log`].
    access_log: Option<OwnedFd>,
}

/// The shared descriptor at `fd` when the hand-off says it is there. Not close-on-exec: the
/// filter holds it to its number, as 3 and 4.
fn adopt_shared(
    present: bool,
    fd: i32,
    what: &'static str,
) -> Result<Option<OwnedFd>, AttachError> {
    if !present {
        return Ok(None);
    }
    sys::adopt_inherited(fd, false)
        .map(Some)
        .map_err(|error| AttachError::Io { what, error })
}

/// What [`Worker::endpoint`] consumes.
struct Parts {
    control: OwnedFd,
    public: OwnedFd,
    /// The ring or unix ingress; `None` with kernel steering (`ingress=reuseport`): the
    /// worker receives on its own socket at descriptor 4.
    ingress: Option<Ingress>,
}

impl fmt::Debug for Worker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Worker")
            .field("instance", &self.instance)
            .field("generation", &self.worker_generation)
            .field("instances", &self.instances)
            .field("public_addr", &self.public_addr)
            .finish_non_exhaustive()
    }
}

impl Worker {
    /// Receives the hand-off from the demux that started this process: its configuration,
    /// the shared keys and certificate, and its descriptors, and arranges for it to die with
    /// the demux. Makes the process non-dumpable, so that no sibling worker can trace it or read
    /// its memory. (The demux has already pinned the process to its CPU, if the operator asked
    /// for that, before the program started.) Blocks until the
    /// hand-off arrives (the demux sends it right after starting the process).
    pub fn attach() -> Result<Worker, AttachError> {
        let (control, public) = inherited_sockets()?;
        sys::die_with_parent().map_err(|error| AttachError::Io {
            what: "arming the parent-death signal",
            error,
        })?;
        sys::make_non_dumpable().map_err(|error| AttachError::Io {
            what: "making the worker non-dumpable",
            error,
        })?;
        let (h, fds) = control::recv_handoff(control.as_fd())?;
        let shared = Shared {
            tcp: adopt_shared(h.tcp, ringmux_proto::TCP_FD, "taking the TCP listener")?,
            redirect: adopt_shared(
                h.redirect,
                ringmux_proto::REDIRECT_FD,
                "taking the plain-HTTP listener",
            )?,
            access_log: adopt_shared(
                h.access_log,
                ringmux_proto::ACCESS_LOG_FD,
                "taking the access log",
            )?,
        };
        let mut w = Worker::from_handoff(h, fds, control, public)?;
        w.shared = Mutex::new(shared);
        Ok(w)
    }

    fn from_handoff(
        h: Handoff,
        fds: Vec<OwnedFd>,
        control: OwnedFd,
        public: OwnedFd,
    ) -> Result<Worker, AttachError> {
        let bad = |what, problem: String| AttachError::Handoff { what, problem };
        let keys = KeySet::from_bytes(&h.keys).map_err(|e| bad("keys", e.to_string()))?;
        let lb = QuicLbConfig {
            config_id: h.config_id,
            node_id: h.node_id.clone(),
            instance_count: h.instances,
            nonce_len: h.nonce_len,
            key: h.encrypt_cids.then_some(keys.quic_lb),
        };
        // Checked once here, so that the endpoint's generator factory cannot fail later.
        CidGenerator::in_slot(&lb, h.instance, h.generation_slot(), h.cid_lifetime)
            .map_err(|e| bad("QUIC-LB parameters", e.to_string()))?;
        // Descriptors in hand-off order: ingress…, session socket, site table
        // (`control-protocol.md`, "Descriptors"); their count was checked on receipt. The
        // public socket came at descriptor 4.
        let mut fds = fds.into_iter();
        let mut next = |what: &'static str| {
            fds.next()
                .ok_or_else(|| bad("descriptors", format!("{what} missing")))
        };
        let ingress = ingress_of(&h, &mut next)?;
        let sessions = Arc::new(RemoteSessionStore::new(next("session socket")?));
        let sites =
            read_site_table(next("site table")?).map_err(|e| bad("site table", e.to_string()))?;
        let certificates = SiteCerts::new(&sites)?;
        let (drain_tx, _) = watch::channel(false);
        let (cut_tx, _) = watch::channel(false);
        Ok(Worker {
            instance: h.instance,
            instances: h.instances,
            worker_generation: h.worker_generation,
            lb,
            keys,
            cid_lifetime: h.cid_lifetime,
            public_addr: h.public_addr,
            sites,
            certificates,
            acme: AcmeAnswers::new(),
            idle_timeout: h.idle_timeout,
            alt_svc: h.alt_svc,
            shared: Mutex::default(),
            parts: Mutex::new(Some(Parts {
                control,
                public,
                ingress,
            })),
            sessions,
            drain_tx,
            cut_tx,
            report: Arc::default(),
            accepting: Arc::default(),
        })
    }

    /// This instance's number, `0..instances()`.
    pub fn instance(&self) -> u8 {
        self.instance
    }

    /// The worker generation this process belongs to: 1 for the workers started with ringmux,
    /// one more for each `ringmux reload`. The demux routes this generation's connections to
    /// this process, and new ones to the newest generation.
    pub fn generation(&self) -> u64 {
        self.worker_generation
    }

    /// How many instances share the public address.
    pub fn instances(&self) -> u8 {
        self.instances
    }

    /// The public address clients send to (also the endpoint's local address).
    pub fn public_addr(&self) -> SocketAddr {
        self.public_addr
    }

    /// The sites ringmux serves: each one's names, certificate and routes (`[[site]]` in
    /// ringmux's configuration file, or one default site from its command line, with the
    /// operator's `--cert`/`--key` or the self-signed certificate ringmux made at start).
    pub fn sites(&self) -> &SiteTable {
        &self.sites
    }

    /// The sites' certificates, chosen by SNI: what [`Worker::tls_config`] and
    /// [`Worker::tcp_tls_config`] present. [`SiteCerts::site_for`] tells which site a
    /// connection's server name chose. The demux's `CERTIFICATE` messages replace an ACME
    /// site's certificate here, for QUIC and TCP at once; [`Worker::sites`] keeps the PEM text
    /// of the hand-off.
    pub fn certificates(&self) -> &SiteCerts {
        &self.certificates
    }

    /// The ACME challenges pending now, which the demux's `CHALLENGES` messages replace
    /// (once [`Worker::endpoint`] started the control task). A program that serves
    /// [`Worker::tcp_listener`] or [`Worker::redirect_listener`] answers them there, and
    /// never over QUIC: TLS-ALPN-01 (RFC 8737) on the HTTPS listener, a ClientHello whose
    /// ALPN list is `acme-tls/1` alone for a pending name handshaking with
    /// [`AcmeAnswers::tls_alpn01_config`] and closing after it, any other one offering
    /// `acme-tls/1` refused; HTTP-01 on the plain-HTTP listener,
    /// `GET /.well-known/acme-challenge/TOKEN` answered 200 with [`AcmeAnswers::http01`]
    /// as `text/plain` before any redirect (`control-protocol.md`, "Control messages").
    pub fn acme_answers(&self) -> &AcmeAnswers {
        &self.acme
    }

    /// The demux's listening TCP socket, when ringmux runs with `--tcp on`: serve HTTPS over
    /// TCP from it (hyper, axum, …) beside HTTP/3. Every instance accepts from this one socket
    /// (one accept queue, made once by the demux, so a restart, a reload or an upgrade never
    /// refuses a connection); a worker may accept on it and nothing else (no `shutdown`,
    /// options, or flags: its file description is every worker's and the demux's). It is
    /// non-blocking already, as `tokio::net::TcpListener::from_std` wants. `None` with
    /// `--tcp off`, and after the first call.
    pub fn tcp_listener(&self) -> Option<std::net::TcpListener> {
        self.accepting.taken.store(true, Ordering::Release);
        self.shared
            .lock()
            .ok()?
            .tcp
            .take()
            .map(std::net::TcpListener::from)
    }

    /// The demux's listening socket for plain HTTP, when ringmux runs with `--redirect-http`:
    /// ringmux's own worker answers every request on it with a 301 to `https://`. Shared and
    /// held like [`Worker::tcp_listener`]'s. `None` without it, and after the first call.
    pub fn redirect_listener(&self) -> Option<std::net::TcpListener> {
        self.accepting.taken.store(true, Ordering::Release);
        self.shared
            .lock()
            .ok()?
            .redirect
            .take()
            .map(std::net::TcpListener::from)
    }

    /// The access log, when ringmux runs with `--access-log`: a file open for appending (or
    /// the demux's standard error) that every worker shares. Write whole lines, each `write` a
    /// whole number of lines of at most 4096 bytes together (so that lines of different
    /// workers never interleave); the built-in server's `ringmux_server::access_log::AccessLog` does. Its flags, its length
    /// and its number are every worker's: the filter refuses changing them. `None` without
    /// it, and after the first call.
    pub fn access_log(&self) -> Option<std::fs::File> {
        self.shared
            .lock()
            .ok()?
            .access_log
            .take()
            .map(std::fs::File::from)
    }

    /// The `alt-svc` field value to put on every response over TCP ([`Worker::tcp_listener`]),
    /// telling browsers where HTTP/3 is: `h3=":PORT"; ma=86400` with the public UDP port, or
    /// what the operator gave `ringmux --alt-svc` (a balancer may map the port); `None` with
    /// `--alt-svc off`.
    pub fn alt_svc(&self) -> Option<&str> {
        self.alt_svc.as_deref()
    }

    /// The operator's QUIC idle timeout (`ringmux --idle-timeout`), which
    /// [`Worker::server_config`] applies.
    pub fn idle_timeout(&self) -> Duration {
        self.idle_timeout
    }

    /// A rustls server configuration for QUIC with the sites' certificates (by SNI) and the given
    /// ALPN protocols: TLS 1.3 only, the ring provider, 0-RTT allowed (`max_early_data_size`
    /// 0xffffffff, the only non-zero value QUIC allows, RFC 9001 §4.6.1). Pass it, changed as
    /// you like, to [`Worker::server_config`].
    pub fn tls_config(&self, alpn: &[&[u8]]) -> Result<rustls::ServerConfig, AttachError> {
        Ok(tls::quic_tls_config(&self.certificates, alpn)?)
    }

    /// A rustls server configuration for HTTPS over TCP ([`Worker::tcp_listener`]) with the
    /// sites' certificates (by SNI): TLS 1.3 and 1.2, the ring provider, ALPN `h2` then `http/1.1`
    /// (change `alpn_protocols` to serve only one). Sessions resume within this worker (rustls'
    /// in-memory cache and stateless tickets are its defaults); no 0-RTT over TCP.
    pub fn tcp_tls_config(&self) -> Result<rustls::ServerConfig, AttachError> {
        Ok(tls::tcp_tls_config(&self.certificates)?)
    }

    /// A quinn server configuration over `tls` with what instances must share: sessions stored
    /// in the demux's cache (so resumption and 0-RTT work on every instance) and the shared
    /// token key (Retry and NEW_TOKEN tokens valid on every instance). Transport limits are
    /// ringmux's defaults with the operator's idle timeout; replace them with
    /// `ServerConfig::transport_config` if you like.
    ///
    /// A handshake for a server name no site has (or none), without a default site, is refused
    /// with the TLS alert `unrecognized_name` before `tls` sees it ([`crate::sni`]).
    ///
    /// Refuses a `tls` with a stateless session `ticketer`: rustls then never accepts 0-RTT,
    /// and instances could not share single-use sessions.
    pub fn server_config(
        &self,
        mut tls: rustls::ServerConfig,
    ) -> Result<quinn::ServerConfig, AttachError> {
        if tls.ticketer.enabled() {
            return Err(AttachError::Conflict(
                "the rustls config has a session ticketer; ringmux shares TLS sessions through \
                 the demux so that 0-RTT works on every instance: leave `ticketer` unset"
                    .into(),
            ));
        }
        tls.session_storage = self.sessions.clone();
        let crypto = QuicServerConfig::try_from(tls).map_err(TlsError::from)?;
        // A server name no site has is refused with unrecognized_name, before rustls.
        let gated = crate::sni::SniGate::new(Arc::new(crypto), self.certificates.clone());
        let opts = ServerOptions {
            idle_timeout: self.idle_timeout,
            ..ServerOptions::default()
        };
        Ok(server_config(Arc::new(gated), &self.keys.token, &opts))
    }

    /// The quinn endpoint of this instance: its `AsyncUdpSocket` is the ring (or unix
    /// ingress) for receiving and the public socket for sending, its connection IDs route to
    /// this instance, its stateless-reset key is the shared one. Reports `READY` to the demux
    /// and starts the control task (counters once a second, drain requests).
    ///
    /// Call it once, inside a tokio runtime (a current-thread one is what ringmux's own worker
    /// uses: one endpoint per process, instances for scale).
    pub fn endpoint(&self, server: quinn::ServerConfig) -> Result<quinn::Endpoint, AttachError> {
        let parts = self
            .parts
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .ok_or_else(|| AttachError::Conflict("Worker::endpoint was called twice".into()))?;
        let io = |what| move |error| AttachError::Io { what, error };
        let (socket, ingress_stats): (Arc<dyn quinn::AsyncUdpSocket>, _) = match parts.ingress {
            Some(ingress) => {
                let socket = RingSocket::new(ingress, parts.public, self.public_addr)
                    .map_err(io("setting up the ingress socket"))?;
                let stats = socket.stats();
                (Arc::new(socket), stats)
            }
            None => {
                let socket = CountingSocket::new(parts.public)
                    .map_err(io("setting up the worker's own socket"))?;
                let stats = socket.stats();
                (Arc::new(socket), stats)
            }
        };
        let (lb, instance, lifetime) = (self.lb.clone(), self.instance, self.cid_lifetime);
        let slot = ringmux_proto::generation_slot(self.worker_generation);
        let factory = move || -> Box<dyn quinn::ConnectionIdGenerator> {
            match CidGenerator::in_slot(&lb, instance, slot, lifetime) {
                Ok(g) => Box::new(g),
                // Checked in `attach`; unreachable unless the same input changes its answer.
                Err(e) => panic!("QUIC-LB generator refused parameters it accepted before: {e}"),
            }
        };
        let endpoint = quinn::Endpoint::new_with_abstract_socket(
            endpoint_config(&self.keys.stateless_reset, factory),
            Some(server),
            socket,
            Arc::new(quinn::TokioRuntime),
        )
        .map_err(io("creating the quinn endpoint"))?;
        // Non-blocking from here on: the reactor's readiness can be stale, and a blocking recv
        // on a stale readiness would stall the whole runtime.
        socket2::SockRef::from(&parts.control)
            .set_nonblocking(true)
            .map_err(io("control socket"))?;
        let control =
            sys::AsyncReadable::new(parts.control).map_err(io("registering the control socket"))?;
        control::send(control.get_ref().as_fd(), &Message::Ready).map_err(io("reporting ready"))?;
        tokio::spawn(control_task(
            control,
            self.drain_tx.clone(),
            self.cut_tx.clone(),
            endpoint.clone(),
            ingress_stats,
            self.report.clone(),
            self.accepting.clone(),
            Pushed {
                certificates: self.certificates.clone(),
                acme: self.acme.clone(),
            },
        ));
        Ok(endpoint)
    }

    /// A [`Drain`] that fires when the demux asks this worker to drain (on a shutdown, or
    /// when a newer generation replaces it) or the process gets SIGTERM: stop accepting,
    /// finish what is in flight (an HTTP/3 server sends GOAWAY), then return from `main`.
    /// Take as many as you need (one per connection task, say).
    pub fn drain_signal(&self) -> Drain {
        Drain(self.drain_tx.subscribe())
    }

    /// A [`Drain`] that fires when the demux tells this draining worker to cut (control
    /// message `CUT`): its grace period (`ringmux --grace`) is over, or its generation is the
    /// oldest draining one and a reload needs room (`--max-draining`). End every request in
    /// flight now, write what the program logs of each (say it was cut), and exit: the demux
    /// kills the process [`ringmux_proto::CUT_WAIT`] after the message. A program that does not
    /// listen is killed then.
    pub fn cut_signal(&self) -> Drain {
        Drain(self.cut_tx.subscribe())
    }

    /// A guard for a loop that accepts from [`Worker::tcp_listener`] or
    /// [`Worker::redirect_listener`]: take one before the loop starts and drop it as soon as
    /// the loop stops accepting on a drain (before the connections in flight finish). Once
    /// every guard is gone after the demux asked this worker to drain, the library tells the
    /// demux (`STOPPED`), and `ringmux reload` answers at once: every connection made after
    /// its answer reaches the new generation. A program that takes a listener and no guard
    /// still works; its reloads answer after up to 2 s (`ringmux_proto::STOPPED_WAIT`).
    pub fn accepting(&self) -> Accepting {
        self.accepting.guards.store(true, Ordering::Release);
        self.accepting.live.fetch_add(1, Ordering::AcqRel);
        Accepting(self.accepting.clone())
    }

    /// Resolves when draining was requested (see [`Worker::drain_signal`]).
    pub async fn drain_requested(&self) {
        self.drain_signal().wait().await
    }

    /// Sets what fills the application's counters (connections, requests, responses by site,
    /// series of its own) of each report to the demux; ringmux shows them per instance in its
    /// metrics. Without it, connections (open now, and accepted since start) come from the
    /// endpoint and requests stay 0. Responses by site ([`WorkerReport::sites`]) go by the
    /// site's index in [`Worker::sites`]; when one report cannot hold every row, each report
    /// carries the rows after the previous one's. Series of the program's own
    /// ([`WorkerReport::set_counter`], [`WorkerReport::set_gauge`]) are exposed as
    /// `ringmux_worker_NAME_total{instance,…}` (see [`Worker::counter`], which needs no
    /// closure); the function runs after the declared ones are in the report.
    pub fn set_report(&self, f: impl Fn(&mut WorkerReport) + Send + Sync + 'static) {
        *self.report.fill.lock().unwrap_or_else(|e| e.into_inner()) = Some(Box::new(f));
    }

    /// A counter of the program's own, `name{labels}`, reported in every `STATS` from now on
    /// and exposed by ringmux as `ringmux_worker_NAME_total{instance="I",KEY="VALUE",…}`,
    /// summed over the instance's workers. Declaring one series twice gives the same counter.
    /// Names and label keys are `[a-z0-9_]` from a letter, values `[a-z0-9_]`, within the
    /// bounds of [`ringmux_proto::series`]; a name of ringmux's own metrics (`restarts`,
    /// `connections`, …) is dropped by the demux and counted in
    /// `ringmux_worker_report_parts_dropped_total{kind="series"}`.
    ///
    /// ```no_run
    /// # let worker = ringmux_worker::Worker::attach()?;
    /// let bytes_in = worker.counter("echo_bytes", &[("direction", "in")])?;
    /// bytes_in.add(512); // ringmux_worker_echo_bytes_total{instance="0",direction="in"} 512
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn counter(
        &self,
        name: &str,
        labels: &[(&str, &str)],
    ) -> Result<crate::Counter, SeriesError> {
        self.report.counter(Series::counter(name, labels)?)
    }

    /// A gauge of the program's own, `name{labels}`: as [`Worker::counter`], exposed as
    /// `ringmux_worker_NAME{instance="I",…}`, the value of the instance's newest worker.
    pub fn gauge(&self, name: &str, labels: &[(&str, &str)]) -> Result<crate::Gauge, SeriesError> {
        self.report.gauge(Series::gauge(name, labels)?)
    }

    /// For a worker that reads its datagrams itself, without quinn (ringmux's benchmark sink,
    /// `--worker-mode sink`): tells the demux this worker is ready and hands over the ingress,
    /// the worker's own socket, the router that says which connection IDs are this worker's,
    /// and the control socket, on which the caller reports (`STATS`) and hears `SHUTDOWN`.
    pub fn into_raw(self) -> Result<RawParts, AttachError> {
        let parts = self
            .parts
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .ok_or_else(|| AttachError::Conflict("the endpoint exists already".into()))?;
        let router =
            Router::new(&self.lb, self.keys.routing_hash).map_err(|e| AttachError::Handoff {
                what: "QUIC-LB parameters",
                problem: e.to_string(),
            })?;
        control::send(parts.control.as_fd(), &Message::Ready).map_err(|error| AttachError::Io {
            what: "reporting ready",
            error,
        })?;
        let lane = router.lane(
            self.instance,
            ringmux_proto::generation_slot(self.worker_generation),
        );
        Ok(RawParts {
            ingress: parts.ingress,
            socket: parts.public,
            router,
            lane,
            control: parts.control,
        })
    }
}

/// What [`Worker::into_raw`] hands over.
pub struct RawParts {
    /// Where the demux forwards this worker's datagrams; `None` under kernel steering
    /// (`--forward reuseport`), where they arrive on `socket`.
    pub ingress: Option<Ingress>,
    /// The worker's own UDP socket (descriptor 4): it sends, and under kernel steering it
    /// receives too.
    pub socket: OwnedFd,
    /// Routes connection IDs; a datagram is this worker's when it routes to
    /// `Route::Owned(lane)`.
    pub router: Router,
    /// This worker's lane (its instance in its generation slot).
    pub lane: u8,
    /// The control socket, non-blocking use only through [`crate::control`].
    pub control: OwnedFd,
}

impl fmt::Debug for RawParts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RawParts")
            .field("lane", &self.lane)
            .field("socket", &self.socket)
            .field("control", &self.control)
            .finish_non_exhaustive()
    }
}

/// Set by the first [`Worker::attach`] that takes the inherited descriptors.
static ATTACHED: AtomicBool = AtomicBool::new(false);

/// The control socket and the public socket, at the descriptors `RINGMUX_CONTROL_FD` and
/// `RINGMUX_PUBLIC_FD` name, each checked to be what it should.
fn inherited_sockets() -> Result<(OwnedFd, OwnedFd), AttachError> {
    let program = std::env::args().next().unwrap_or_else(|| "PROGRAM".into());
    let control = inherited_number(CONTROL_FD_ENV, &program)?;
    let public = inherited_number(PUBLIC_FD_ENV, &program)?;
    let bad = |var: &'static str, fd: RawFd, problem: &str| AttachError::BadInheritedFd {
        var,
        value: fd.to_string(),
        problem: problem.into(),
    };
    if control == public {
        return Err(bad(
            PUBLIC_FD_ENV,
            public,
            "the same descriptor as the control socket",
        ));
    }
    // Only once: a second attach in the same process must not own the descriptors again.
    if ATTACHED.swap(true, Ordering::AcqRel) {
        return Err(bad(
            CONTROL_FD_ENV,
            control,
            "already taken by an earlier Worker::attach in this process",
        ));
    }
    // Ringmux passed both to this process for its exclusive use. They stay inheritable: the
    // sandbox holds them to their numbers, 3 and 4.
    let take = |fd: RawFd, var: &'static str| {
        ringmux_inherit::adopt(fd, false).map_err(|e| bad(var, fd, &e.to_string()))
    };
    let control = take(control, CONTROL_FD_ENV)?;
    let public = match take(public, PUBLIC_FD_ENV) {
        Ok(p) => p,
        Err(e) => {
            ringmux_inherit::give_back(control);
            return Err(e);
        }
    };
    let wrong = if sys::socket_type(control.as_fd()) != Some(SockType::SeqPacket) {
        Some(bad(
            CONTROL_FD_ENV,
            control.as_raw_fd(),
            "not a SOCK_SEQPACKET socket",
        ))
    } else if sys::socket_type(public.as_fd()) != Some(SockType::Datagram) {
        Some(bad(PUBLIC_FD_ENV, public.as_raw_fd(), "not a UDP socket"))
    } else {
        None
    };
    if let Some(e) = wrong {
        // Not ours after all: give them back unclosed.
        ringmux_inherit::give_back(control);
        ringmux_inherit::give_back(public);
        return Err(e);
    }
    Ok((control, public))
}

/// The descriptor number in environment variable `var`, checked to be open and not a standard
/// stream.
fn inherited_number(var: &'static str, program: &str) -> Result<RawFd, AttachError> {
    let value = std::env::var(var).map_err(|_| AttachError::NotStartedByRingmux {
        var,
        program: program.to_string(),
    })?;
    let bad = |problem: &str| AttachError::BadInheritedFd {
        var,
        value: value.clone(),
        problem: problem.into(),
    };
    let fd: RawFd = value.trim().parse().map_err(|_| bad("not a number"))?;
    if fd < 3 {
        return Err(bad("a standard stream, not a descriptor ringmux passed"));
    }
    if std::fs::metadata(format!("/proc/self/fd/{fd}")).is_err() {
        return Err(bad("no such open descriptor"));
    }
    Ok(fd)
}

/// What the demux changes in a running worker: the ACME sites' certificates and the pending
/// challenges.
struct Pushed {
    certificates: SiteCerts,
    acme: AcmeAnswers,
}

/// Talks to the demux until it goes away: counters about once a second, drain requests (and
/// SIGTERM) into `drain`, ACME certificates and challenges into `pushed`, each answered
/// `APPLIED` once in use. When the demux closes the control socket the worker exits at once:
/// nothing would route datagrams to it any more.
#[allow(clippy::too_many_arguments)]
async fn control_task(
    control: sys::AsyncReadable,
    drain: watch::Sender<bool>,
    cut: watch::Sender<bool>,
    endpoint: quinn::Endpoint,
    ingress: Arc<IngressStats>,
    report: Arc<crate::counters::Report>,
    accepting: Arc<AcceptState>,
    pushed: Pushed,
) {
    let mut inbox = control::Receiver::new();
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    // Asked to drain by the demux, and whether STOPPED went out.
    let (mut asked, mut told) = (false, false);
    // The site row the next report starts at, when one report cannot hold every row.
    let mut next_site = 0;
    let mut sigterm =
        tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
    loop {
        if asked && !told && accepting.stopped() {
            told = control::send(control.get_ref().as_fd(), &Message::Stopped).is_ok();
        }
        tokio::select! {
            ready = control.readable() => {
                let Ok(mut guard) = ready else { return };
                match inbox.recv(guard.get_inner().as_fd()) {
                    Ok(Some(Ok(Message::Shutdown))) => {
                        tracing::info!("draining on request of the demux");
                        let _ = drain.send(true);
                        asked = true;
                    }
                    Ok(Some(Ok(Message::Cut))) => {
                        tracing::warn!("told to cut by the demux: ending what is still in flight");
                        let _ = drain.send(true);
                        let _ = cut.send(true);
                        asked = true;
                    }
                    Ok(Some(Ok(Message::Certificate(c)))) => {
                        if acme::apply_certificate(&pushed.certificates, &c) {
                            applied(&control, c.seq);
                        }
                    }
                    Ok(Some(Ok(Message::Challenges(set)))) => {
                        if acme::apply_challenges(&pushed.acme, &set) {
                            applied(&control, set.seq);
                        }
                    }
                    Ok(Some(_)) => {}
                    Ok(None) => {
                        tracing::warn!("control socket closed: the demux is gone; exiting");
                        std::process::exit(0);
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => guard.clear_ready(),
                    Err(e) => {
                        tracing::error!(error = %e, "control socket failed; exiting");
                        std::process::exit(1);
                    }
                }
            }
            () = accepting.gone.notified(), if asked && !told => {}
            Some(()) = async { match sigterm.as_mut() { Some(s) => s.recv().await, None => None } } => {
                tracing::info!("SIGTERM: draining");
                let _ = drain.send(true);
            }
            _ = tick.tick() => {
                let mut r = WorkerReport {
                    connections_active: endpoint.open_connections() as u64,
                    connections_total: endpoint.stats().accepted_handshakes,
                    datagrams_in: ingress.received.load(Ordering::Relaxed),
                    datagrams_dropped: ingress.dropped.load(Ordering::Relaxed),
                    cpu_ns: u64::try_from(sys::cpu_time().as_nanos()).unwrap_or(u64::MAX),
                    pid: u64::from(std::process::id()),
                    ..WorkerReport::default()
                };
                report.fill(&mut r);
                if let Ok(next) = control::send_stats_nowait(control.get_ref().as_fd(), &r, next_site) {
                    next_site = next;
                }
            }
        }
    }
}

/// Tells the demux the update numbered `seq` is in use. Never waits: the control task also
/// carries the drain; a demux that does not read its socket has bigger troubles, and its
/// own timeout tells it the update was not confirmed.
fn applied(control: &sys::AsyncReadable, seq: u64) {
    if let Err(e) = control::send_nowait(control.get_ref().as_fd(), &Message::Applied(seq)) {
        tracing::warn!(seq, error = %e, "could not send APPLIED");
    }
}

/// Reads the site table from its sealed memfd, whole, from offset 0 (`control-protocol.md`,
/// "Sites"), and closes it.
fn read_site_table(fd: OwnedFd) -> Result<SiteTable, SiteTableError> {
    use std::io::Read;
    let mut text = Vec::new();
    std::fs::File::from(fd)
        .take(ringmux_proto::MAX_SITE_TABLE as u64 + 1)
        .read_to_end(&mut text)
        .map_err(SiteTableError::Read)?;
    if text.len() > ringmux_proto::MAX_SITE_TABLE {
        return Err(SiteTableError::TooLong);
    }
    Ok(SiteTable::from_json(&text)?)
}

/// Why the hand-off's site table cannot be used ([`read_site_table`]).
#[derive(Debug, thiserror::Error)]
enum SiteTableError {
    #[error("reading it: {0}")]
    Read(io::Error),
    #[error("longer than MAX_SITE_TABLE ({} bytes)", ringmux_proto::MAX_SITE_TABLE)]
    TooLong,
    #[error(transparent)]
    Table(#[from] ringmux_proto::sites::SitesError),
}

/// The ingress hand-off `h` describes, built from its descriptors: `next` gives them in
/// hand-off order, naming the one it wants. `None`: the worker receives on its own socket
/// (descriptor 4) and has no ingress.
fn ingress_of(
    h: &Handoff,
    mut next: impl FnMut(&'static str) -> Result<OwnedFd, AttachError>,
) -> Result<Option<Ingress>, AttachError> {
    Ok(match h.ingress {
        IngressKind::Reuseport => None,
        IngressKind::Shm => {
            let (ring, page, bell) = (next("ring")?, next("page")?, next("doorbell")?);
            let consumer =
                Consumer::attach(ring, page, bell, h.generation, h.spin).map_err(|e| {
                    AttachError::Handoff {
                        what: "ring",
                        problem: e.to_string(),
                    }
                })?;
            Some(Ingress::Ring(consumer))
        }
        IngressKind::Unix => Some(Ingress::Unix(next("unix ingress socket")?)),
    })
}
