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
//!   challenges/TOKEN.json        0600  a pending challenge, while its order runs
//!   locks/LABEL.lock                   flock(2) held by the node ordering LABEL
//! ```
//!
//! LABEL is the site's first name. Several nodes may share one state directory (a network file
//! system): the node that takes a site's lock orders its certificate; every node reads the
//! certificates and pending challenges of the directory (re-read every
//! [`STATE_POLL_INTERVAL`]), so every node answers every challenge and serves the same
//! certificate.
//!
//! The interface below is what the rest of the demux uses; the engine is in the submodules.

use std::os::fd::BorrowedFd;
use std::path::PathBuf;
use std::time::{Duration, SystemTime};

use ringmux_proto::ChallengeSet;

/// How often every node re-reads the state directory for certificates and challenges other
/// nodes wrote.
pub const STATE_POLL_INTERVAL: Duration = Duration::from_millis(500);

/// Let's Encrypt's production directory: the default of `[acme] directory`.
pub const LETS_ENCRYPT: &str = "https://acme-v02.api.letsencrypt.org/directory";

/// The default of `[acme] state`.
pub const DEFAULT_STATE: &str = "/var/lib/ringmux/acme";

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
    pub eab: Option<Eab>,
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
#[derive(Clone, Debug, Default)]
pub struct AcmeStatus {
    /// `ringmux_acme_orders_total{result="issued"}`.
    pub orders_issued: u64,
    /// `ringmux_acme_orders_total{result="failed"}`.
    pub orders_failed: u64,
    /// Per ACME site: its label, the names, the current certificate's notAfter (if any), the
    /// last error (if the last attempt failed) and when the next attempt is due.
    pub sites: Vec<SiteStatus>,
}

#[derive(Clone, Debug)]
pub struct SiteStatus {
    pub label: String,
    pub names: Vec<String>,
    pub not_after: Option<SystemTime>,
    pub last_error: Option<String>,
    pub next_attempt: Option<SystemTime>,
}

/// An answer to [`Acme::renew`], polled with [`Acme::renewed`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RenewTicket(pub u64);

/// The engine's thread, and the demux's end of it.
pub struct Acme {
    _private: (),
}

impl Acme {
    /// Checks `settings` against the file system (the state directory exists or can be made
    /// with mode 0700, and is not open to others), loads every stored certificate of `sites`
    /// that is still valid and covers the site's names, and starts the thread. The view is
    /// ready at once ([`Acme::view`]): a site with a valid stored certificate serves it from
    /// the first worker's hand-off, without an order.
    pub fn start(_settings: AcmeSettings, _sites: Vec<AcmeSite>) -> anyhow::Result<Acme> {
        anyhow::bail!("ACME is not built yet")
    }

    /// Readable when the view or status changed since [`Acme::view`] was last called.
    pub fn wake_fd(&self) -> BorrowedFd<'_> {
        unimplemented!()
    }

    /// The current view; clears [`Acme::wake_fd`].
    pub fn view(&self) -> AcmeView {
        unimplemented!()
    }

    pub fn status(&self) -> AcmeStatus {
        unimplemented!()
    }

    /// The ACME sites changed (a reload): order for the new ones, forget the removed ones.
    pub fn set_sites(&self, _sites: Vec<AcmeSite>) {
        unimplemented!()
    }

    /// Orders a new certificate now for the site one of whose names is `name`, or for every
    /// ACME site (`None`), whatever their certificates' age. Err names an unknown name.
    pub fn renew(&self, _name: Option<&str>) -> Result<RenewTicket, String> {
        unimplemented!()
    }

    /// `None` while the renewal runs; then `Ok` with the site indexes renewed (their new
    /// certificates are in the view), or `Err` with the CA's error.
    pub fn renewed(&self, _ticket: RenewTicket) -> Option<Result<Vec<usize>, String>> {
        unimplemented!()
    }
}
