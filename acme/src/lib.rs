//! Certificates from an ACME CA (RFC 8555): ordering, storing and renewing the certificate of
//! every site with `acme = true`.
//!
//! # Where it runs
//!
//! On a thread of its own in the demux, with its own current-thread tokio runtime: never on the
//! receive thread, never on the supervisor's, never in a worker (workers are confined and get no
//! outbound network; the ACME account key must not be readable by them). The thread talks to the
//! CA and to the state directory only. What it produces — every ACME site's certificate and the
//! challenges pending now — it publishes as an [`AcmeView`] and signals on an eventfd
//! ([`Acme::wake_fd`]) that the supervisor polls with its other descriptors; the supervisor
//! sends the view's changes to the live workers (`CERTIFICATE`, `CHALLENGES`) and into the
//! hand-off of every worker it starts later.
//!
//! # The state directory
//!
//! ```text
//! STATE/                         0700
//!   account.json                 0600  the ACME account (its key), per directory URL
//!   certs/LABEL/cert.pem         0600  the site's chain, leaf first (written whole, renamed)
//!   certs/LABEL/key.pem          0600  its key
//!   certs/LABEL/attempt.json     0600  its failed orders in a row and when to retry (absent
//!                                      after a success): every node backs off alike
//!   challenges/TOKEN.json        0600  a pending challenge, while its order runs
//!   locks/LABEL.lock             0600  flock(2) held by the node ordering LABEL
//!   locks/.account.lock          0600  held while the account is made
//!   seal.key                     0600  the key of the seals, when there is no key_file
//! ```
//!
//! Every file above that the engine reads back (account, certificates and keys, failure
//! records, challenges) ends in a seal, an HMAC-SHA256 of its place and content under a key no
//! worker holds (`seal` has the format, where the key comes from, and what happens to files
//! from before the seal). A file without a valid seal is refused, logged at a rate limit and
//! counted in `ringmux_acme_state_refused_total`; a challenge for a name none of this node's
//! ACME sites has is never answered. Every node sharing a state directory needs the same
//! `key_file` (or none, and then they share `seal.key`).
//!
//! LABEL is the site's first name. Several nodes may share one state directory (a network file
//! system): the node that takes a site's lock orders its certificate; every node reads the
//! certificates and pending challenges of the directory (re-read every
//! [`STATE_POLL_INTERVAL`]), so every node answers every challenge and serves the same
//! certificate.
//!
//! The interface below is what the rest of the demux uses; the engine is in the submodules:
//!
//! * `engine`: the thread: polls the state directory, starts orders, publishes.
//! * `order`: one order's ACME exchange (RFC 8555 §7.4) and the account (§7.3).
//! * `schedule`: when each site orders (renewal, back-off, `Retry-After`, ARI), sans I/O.
//! * `store`: the state directory's files and locks.
//! * `challenge`: a pending challenge's file and the workers' answer to it.
//! * `https`: the HTTPS client instant-acme reaches the CA through.
//!
//! Nothing here may panic on what the CA or the state directory (another node's writes) holds:
//! both are read as untrusted input.

mod challenge;
mod engine;
mod https;
mod order;
mod schedule;
pub mod seal;
mod store;
mod sys;

pub use challenge::ChallengeError;
pub use https::{ClientError, RequestError};
pub use store::{AccountFileError, CertificateError, OpenError};

use std::os::fd::{AsFd, BorrowedFd};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use ringmux_proto::ChallengeSet;

/// How often every node re-reads the state directory for certificates and challenges other
/// nodes wrote.
pub const STATE_POLL_INTERVAL: Duration = Duration::from_millis(500);

/// Let's Encrypt's production directory: the default of `[acme] directory`.
pub const LETS_ENCRYPT: &str = "https://acme-v02.api.letsencrypt.org/directory";

/// The default of `[acme] state`.
pub const DEFAULT_STATE: &str = "/var/lib/ringmux/acme";

/// The kinds of state-directory files the engine reads back, as the `file` label of
/// `ringmux_acme_state_refused_total` names them.
pub const STATE_FILES: [&str; 4] = ["certificate", "challenge", "attempt", "account"];

/// Why the ACME client cannot start. Each keeps its source; `ringmux_proto::one_line` writes
/// the chain as one line.
#[derive(Debug, thiserror::Error)]
pub enum AcmeError {
    #[error("the ACME directory {0:?} is not an https:// URL (RFC 8555 §6.1)")]
    Directory(String),
    #[error(transparent)]
    State(#[from] store::OpenError),
    #[error(transparent)]
    Client(#[from] https::ClientError),
    #[error("{what}")]
    Io {
        what: &'static str,
        #[source]
        error: std::io::Error,
    },
}

/// Why the CA's directory did not answer as one (`ringmux check --online`).
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    #[error(transparent)]
    Client(#[from] https::ClientError),
    #[error("the probe's tokio runtime")]
    Runtime(#[source] std::io::Error),
    #[error("the ACME directory {directory:?} is not a URL")]
    NotUrl {
        directory: String,
        #[source]
        error: http::uri::InvalidUri,
    },
    #[error(transparent)]
    Request(#[from] https::RequestError),
    #[error("{directory} answered {status}, not a directory")]
    Status {
        directory: String,
        status: http::StatusCode,
    },
    #[error("{directory} answered, but not with an ACME directory (no newNonce, newAccount and newOrder)")]
    NotDirectory { directory: String },
}

/// The system's root certificates as rustls-native-certs finds them (`SSL_CERT_FILE`,
/// `SSL_CERT_DIR`, else the distribution's bundle), the same the ACME client trusts, with the
/// first error met while reading them. The demux hands them to the workers for TLS upstreams
/// (a confined worker cannot read `/etc/ssl`).
pub fn system_roots() -> (
    Vec<rustls::pki_types::CertificateDer<'static>>,
    Option<String>,
) {
    let found = rustls_native_certs::load_native_certs();
    (found.certs, found.errors.first().map(ToString::to_string))
}

/// Fetches the CA's directory as the engine would, over the roots it would trust (`[acme]
/// ca_roots` and the system's), within `deadline`: `ringmux check --online`. Returns the
/// directory's `meta.termsOfService` when it has one.
pub fn probe_directory(
    settings: &AcmeSettings,
    deadline: Duration,
) -> Result<Option<String>, ProbeError> {
    let client = https::CaClient::new(
        &settings.ca_roots,
        settings.ca_roots_file.as_deref(),
        deadline,
    )?;
    let uri = settings
        .directory
        .parse::<http::Uri>()
        .map_err(|error| ProbeError::NotUrl {
            directory: settings.directory.clone(),
            error,
        })?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(ProbeError::Runtime)?;
    let (status, body) = runtime.block_on(client.get(uri))?;
    let directory = settings.directory.clone();
    if !status.is_success() {
        return Err(ProbeError::Status { directory, status });
    }
    let json: serde_json::Value = serde_json::from_slice(&body).unwrap_or(serde_json::Value::Null);
    let has = |k: &str| json.get(k).is_some_and(serde_json::Value::is_string);
    if !(has("newNonce") && has("newAccount") && has("newOrder")) {
        return Err(ProbeError::NotDirectory { directory });
    }
    Ok(json
        .pointer("/meta/termsOfService")
        .and_then(|t| t.as_str())
        .map(str::to_owned))
}

/// Why a renewal asked for by name (`ringmux acme renew`) did not happen.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RenewError {
    #[error("{0} is not a name of an ACME site")]
    UnknownName(String),
    #[error("no renewal {0} is known")]
    UnknownTicket(u64),
    /// The site's order failed (the CA's or the network's words), or it is never ordered.
    #[error("{label}: {reason}")]
    Site { label: String, reason: String },
}

/// The challenge type a CA is asked to validate with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChallengeKind {
    /// RFC 8737, on the TCP listener (port 443 for a public CA).
    TlsAlpn01,
    /// RFC 8555 §8.3, on the plain-HTTP listener (`redirect_http`, port 80 for a public CA).
    Http01,
}

/// External account binding (RFC 8555 §7.3.4), for CAs that require one.
#[derive(Clone)]
pub struct Eab {
    pub kid: String,
    /// The MAC key, decoded from the base64url of `eab_hmac_key`.
    pub hmac_key: Vec<u8>,
}

impl std::fmt::Debug for Eab {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Eab")
            .field("kid", &self.kid)
            .finish_non_exhaustive()
    }
}

/// The `[acme]` table, checked.
#[derive(Clone, Debug)]
pub struct AcmeSettings {
    /// The CA's directory URL (`https://…`).
    pub directory: String,
    /// The account's contact (`mailto:` is added).
    pub email: Option<String>,
    pub state: PathBuf,
    pub challenge: ChallengeKind,
    /// Extra roots (DER) trusted for the CA's own HTTPS, besides the system's: a private CA,
    /// or a test CA such as Pebble.
    pub ca_roots: Vec<Vec<u8>>,
    /// The file `ca_roots` was read from (`[acme] ca_roots`), named in TLS errors.
    pub ca_roots_file: Option<PathBuf>,
    pub eab: Option<Eab>,
    /// The deployment's key file (`key_file`), when there is one: the key that seals the
    /// state directory's files is derived from it; else it is `STATE/seal.key`.
    pub key_file: Option<seal::KeyFileSecret>,
}

/// A site whose certificate comes from ACME.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AcmeSite {
    /// Its index in the site table.
    pub site: usize,
    /// Its first name: the name of its files in the state directory.
    pub label: String,
    /// Every name the certificate must cover (exact names: a wildcard needs DNS-01, which
    /// ringmux does not do, and the configuration refuses it).
    pub names: Vec<String>,
}

/// A certificate and key, as PEM, and what the demux needs to know of it.
#[derive(Clone, PartialEq, Eq)]
pub struct Issued {
    pub chain_pem: String,
    pub key_pem: String,
    /// The leaf's serial number, hex.
    pub serial: String,
    pub not_before: SystemTime,
    pub not_after: SystemTime,
}

impl AcmeSettings {
    /// A short digest of what an order for a site with `names` asks the CA: the names, the
    /// directory, the challenge type, the account's contact and external binding. A failure
    /// recorded under one fingerprint does not delay an order under another.
    pub fn fingerprint(&self, names: &[String]) -> String {
        let mut names: Vec<String> = names.iter().map(|n| n.to_ascii_lowercase()).collect();
        names.sort();
        let mut text = format!(
            "v1\0{}\0{:?}\0{}\0{}",
            self.directory,
            self.challenge,
            self.email.as_deref().unwrap_or_default(),
            self.eab.as_ref().map_or("", |e| e.kid.as_str()),
        );
        for n in names {
            text.push('\0');
            text.push_str(&n);
        }
        let digest = ring::digest::digest(&ring::digest::SHA256, text.as_bytes());
        hex::encode(&digest.as_ref()[..12])
    }
}

impl Issued {
    /// Whether the chain and key read (the key going with the leaf) and the leaf covers every
    /// one of `names`: what the demux checks before it hands a certificate to its workers.
    pub fn check_covers(&self, names: &[String]) -> Result<(), CertificateError> {
        store::examine(self.chain_pem.clone(), self.key_pem.clone())?.covers(names)
    }
}

impl std::fmt::Debug for Issued {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Issued")
            .field("serial", &self.serial)
            .field("not_after", &self.not_after)
            .finish_non_exhaustive()
    }
}

/// What the engine publishes: the certificate of every ACME site that has one, and every
/// challenge pending now (its `seq` is 0: the supervisor numbers what it sends).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AcmeView {
    /// By site index. Each entry's `u64` is raised whenever that site's certificate changes.
    pub certs: Vec<(usize, u64, Issued)>,
    /// Raised whenever the set of challenges changes.
    pub challenges_version: u64,
    pub challenges: ChallengeSet,
}

/// Counters and gauges for the metrics and `ringmux stats`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AcmeStatus {
    /// `ringmux_acme_orders_total{result="issued"}`.
    pub orders_issued: u64,
    /// `ringmux_acme_orders_total{result="failed"}`.
    pub orders_failed: u64,
    /// `ringmux_acme_state_refused_total{file=…}`, in [`STATE_FILES`]' order: files of the
    /// state directory refused because no demux sealed them.
    pub state_refused: [u64; STATE_FILES.len()],
    /// `ringmux_acme_state_refused_total{file="foreign-challenge"}`: sealed challenges for a
    /// name no ACME site of this node has (never answered).
    pub foreign_challenges: u64,
    /// Per ACME site: its label, the names, the current certificate's notAfter (if any), the
    /// last error (if the last attempt failed) and when the next attempt is due.
    pub sites: Vec<SiteStatus>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SiteStatus {
    pub label: String,
    pub names: Vec<String>,
    pub not_after: Option<SystemTime>,
    /// The last failure (this node's, or another's sharing the state directory), or why the
    /// site is never ordered for; `None` once a certificate came.
    pub last_error: Option<String>,
    /// When the next order is due; `None` while one runs or is about to (due now, or waiting
    /// for the node that holds the site's lock).
    pub next_attempt: Option<SystemTime>,
}

/// An answer to [`Acme::renew`], polled with [`Acme::renewed`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RenewTicket(pub u64);

/// The engine's timing. `Default` is production's; tests shorten the back-off.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pacing {
    /// The first retry after a failed order; doubled after each failure in a row (with up to
    /// half taken off at random) up to `backoff_cap`. A CA's `Retry-After` may ask for later.
    pub backoff_base: Duration,
    pub backoff_cap: Duration,
    /// Each request to the CA: connection, handshake, answer.
    pub request_deadline: Duration,
    /// A whole order, from the account to the stored certificate.
    pub order_deadline: Duration,
}

impl Default for Pacing {
    /// One minute doubling to a day; 30 s per request; 10 minutes per order.
    fn default() -> Self {
        let backoff = schedule::Backoff::default();
        Pacing {
            backoff_base: backoff.base,
            backoff_cap: backoff.cap,
            request_deadline: Duration::from_secs(30),
            order_deadline: Duration::from_secs(600),
        }
    }
}

/// The engine's thread, and the demux's end of it. Dropping it stops the thread (an order
/// running then is abandoned: its challenge files removed, its lock released).
pub struct Acme {
    shared: Arc<engine::Shared>,
    commands: Option<tokio::sync::mpsc::UnboundedSender<engine::Command>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Acme {
    /// Checks `settings` against the file system (the state directory exists or can be made
    /// with mode 0700, and is not open to others), loads every stored certificate of `sites`
    /// that is still valid and covers the site's names, and starts the thread. The view is
    /// ready at once ([`Acme::view`]): a site with a valid stored certificate serves it from
    /// the first worker's hand-off, without an order.
    pub fn start(settings: AcmeSettings, sites: Vec<AcmeSite>) -> Result<Acme, AcmeError> {
        Acme::start_with(settings, sites, Pacing::default())
    }

    /// [`Acme::start`] with other timing (tests).
    pub fn start_with(
        settings: AcmeSettings,
        sites: Vec<AcmeSite>,
        pacing: Pacing,
    ) -> Result<Acme, AcmeError> {
        let url = settings.directory.parse::<http::Uri>();
        if !url.is_ok_and(|u| u.scheme_str() == Some("https") && u.host().is_some()) {
            return Err(AcmeError::Directory(settings.directory));
        }
        let store = store::Store::open(&settings.state, settings.key_file.as_ref())?;
        let client = https::CaClient::new(
            &settings.ca_roots,
            settings.ca_roots_file.as_deref(),
            pacing.request_deadline,
        )?;
        let io = |what| move |error| AcmeError::Io { what, error };
        let wake = sys::Bell::new().map_err(io("the ACME engine's eventfd"))?;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(io("the ACME engine's tokio runtime"))?;
        let shared = Arc::new(engine::Shared {
            wake,
            published: Mutex::new(engine::Published {
                sites: sites.clone(),
                ..Default::default()
            }),
        });
        let engine = engine::Engine::new(settings, pacing, sites, store, client, shared.clone());
        let (commands, receiver) = tokio::sync::mpsc::unbounded_channel();
        let thread = std::thread::Builder::new()
            .name("ringmux-acme".into())
            .spawn(move || runtime.block_on(engine.run(receiver)))
            .map_err(io("starting the ACME engine's thread"))?;
        Ok(Acme {
            shared,
            commands: Some(commands),
            thread: Some(thread),
        })
    }

    /// Readable when the view or status changed since [`Acme::view`] was last called.
    pub fn wake_fd(&self) -> BorrowedFd<'_> {
        self.shared.wake.as_fd()
    }

    /// The current view; clears [`Acme::wake_fd`].
    pub fn view(&self) -> AcmeView {
        // Cleared before the view is read: a change after the read rings it again.
        self.shared.wake.clear();
        self.published().view.clone()
    }

    pub fn status(&self) -> AcmeStatus {
        self.published().status.clone()
    }

    /// The ACME sites changed (a reload): order for the new ones, forget the removed ones.
    pub fn set_sites(&self, sites: Vec<AcmeSite>) {
        self.published().sites = sites.clone();
        self.send(engine::Command::SetSites(sites));
    }

    /// Orders a new certificate now for the site one of whose names is `name`, or for every
    /// ACME site (`None`), whatever their certificates' age. Err names an unknown name.
    pub fn renew(&self, name: Option<&str>) -> Result<RenewTicket, RenewError> {
        let mut p = self.published();
        let labels: Vec<String> = match name {
            None => p.sites.iter().map(|s| s.label.clone()).collect(),
            Some(name) => {
                let site = p
                    .sites
                    .iter()
                    .find(|s| s.names.iter().any(|n| n.eq_ignore_ascii_case(name)))
                    .ok_or_else(|| RenewError::UnknownName(name.to_owned()))?;
                vec![site.label.clone()]
            }
        };
        p.next_ticket += 1;
        let ticket = p.next_ticket;
        p.tickets.insert(ticket, None);
        p.trim_tickets();
        drop(p);
        self.send(engine::Command::Renew { ticket, labels });
        Ok(RenewTicket(ticket))
    }

    /// `None` while the renewal runs; then `Ok` with the site indexes renewed (their new
    /// certificates are in the view), or `Err` with the CA's error. A ticket is remembered for
    /// the last 1024 renewals; an older or unknown one is `Err`.
    pub fn renewed(&self, ticket: RenewTicket) -> Option<Result<Vec<usize>, RenewError>> {
        match self.published().tickets.get(&ticket.0) {
            Some(result) => result.clone(),
            None => Some(Err(RenewError::UnknownTicket(ticket.0))),
        }
    }

    fn published(&self) -> MutexGuard<'_, engine::Published> {
        // A panic elsewhere while holding the lock leaves plain data behind: still usable.
        match self.shared.published.lock() {
            Ok(p) => p,
            Err(poisoned) => poisoned.into_inner(),
        }
    }

    fn send(&self, command: engine::Command) {
        if let Some(c) = &self.commands {
            // Fails only if the thread is gone; the status says nothing new then.
            let _ = c.send(command);
        }
    }
}

impl Drop for Acme {
    fn drop(&mut self) {
        // Closing the channel ends the engine's loop.
        self.commands = None;
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings() -> AcmeSettings {
        AcmeSettings {
            directory: "https://ca.test/dir".into(),
            email: None,
            state: PathBuf::from("/nowhere"),
            challenge: ChallengeKind::TlsAlpn01,
            ca_roots: Vec::new(),
            ca_roots_file: None,
            eab: None,
            key_file: None,
        }
    }

    #[test]
    fn the_fingerprint_follows_what_an_order_asks_and_nothing_else() {
        let s = settings();
        let names = |n: &[&str]| n.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let one = s.fingerprint(&names(&["a.test", "www.a.test"]));
        assert_eq!(one, s.fingerprint(&names(&["WWW.a.test", "a.test"])));
        assert_ne!(one, s.fingerprint(&names(&["a.test"])));
        assert_ne!(one, s.fingerprint(&names(&["a.test", "www.a.tes"])));
        let other_ca = AcmeSettings {
            directory: "https://other.test/dir".into(),
            ..settings()
        };
        assert_ne!(one, other_ca.fingerprint(&names(&["a.test", "www.a.test"])));
        let http = AcmeSettings {
            challenge: ChallengeKind::Http01,
            ..settings()
        };
        assert_ne!(one, http.fingerprint(&names(&["a.test", "www.a.test"])));
        // Not what the state directory is or where the roots come from.
        let moved = AcmeSettings {
            state: PathBuf::from("/elsewhere"),
            ca_roots_file: Some(PathBuf::from("/r.pem")),
            ..settings()
        };
        assert_eq!(one, moved.fingerprint(&names(&["a.test", "www.a.test"])));
    }
}
