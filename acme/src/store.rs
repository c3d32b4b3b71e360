//! The state directory (its layout is in the module docs of `acme`): making and checking it,
//! the site locks, and reading and writing its files whole. Other nodes write the same
//! directory, so everything read here is untrusted input: sizes are bounded, names checked
//! before they become paths, and nothing read may panic.
//!
//! Writes are atomic: a temporary file (0600) in the same folder, `fsync`, `rename(2)` over the
//! old one, so a reader sees the old file or the new, never half of one. A certificate is two
//! files: the key is renamed into place before the chain, and a reader checks that the two go
//! together (a reader between the two renames sees a pair that does not, and tries again at
//! its next poll).
//!
//! Every file the engine reads back is sealed (`seal`: an HMAC with a key no worker holds) and
//! its seal checked before its content is looked at: a file a demux did not write is refused,
//! counted by kind ([`Store::refused`]) and logged at a rate limit.
//!
//! Plain blocking file calls, made on the engine's own thread: a hung network file system
//! stalls ACME, never the data plane.

use std::collections::BTreeMap;
use std::fs::{self, DirBuilder, File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime};

use serde::{Deserialize, Serialize};

use super::seal::{KeyFileSecret, Sealer, Unsealed};
use super::Issued;
use crate::sys::{self, LockedFile};

/// The largest file read from the directory: a chain or key is a few KiB.
const MAX_FILE: u64 = 1 << 20;
/// The most challenge files looked at in one scan.
pub const MAX_CHALLENGES: usize = 4096;

/// How often a refused file is logged at most (the rest are counted).
const REFUSAL_LOG_INTERVAL: Duration = Duration::from_secs(10);

/// The state directory, made and checked, with the key that seals its files.
#[derive(Debug)]
pub struct Store {
    root: PathBuf,
    sealer: Sealer,
    /// Files refused for their seal, by [`FileKind`].
    refused: [AtomicU64; FileKind::ALL.len()],
    /// When a refusal was last logged, and how many were not logged since.
    refusal_log: Mutex<(Option<Instant>, u64)>,
}

/// The kinds of files the engine reads back, as the metric's `file` label names them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FileKind {
    Certificate,
    Challenge,
    Attempt,
    Account,
}

impl FileKind {
    pub const ALL: [FileKind; 4] = [
        FileKind::Certificate,
        FileKind::Challenge,
        FileKind::Attempt,
        FileKind::Account,
    ];

    /// The `file` label of `ringmux_acme_state_refused_total`.
    pub fn label(self) -> &'static str {
        let i = FileKind::ALL.iter().position(|k| *k == self).unwrap_or(0);
        super::STATE_FILES[i]
    }
}

/// Why a stored certificate is not read.
#[derive(Debug)]
pub enum CertRefused {
    /// Its files are not usable (unreadable, not PEM, a key that does not go with the chain).
    Bad(String),
    /// Its files carry no seal at all (an older ringmux's): the caller decides (the engine
    /// adopts such a certificate once, at start). Both files are unsealed.
    Unsealed(Box<Certificate>),
    /// A seal that does not verify, or one file sealed and the other not: refused, counted.
    Forged(String),
}

impl std::fmt::Display for CertRefused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CertRefused::Bad(why) | CertRefused::Forged(why) => f.write_str(why),
            CertRefused::Unsealed(c) => write!(
                f,
                "certificate {} carries no seal: {}",
                c.issued.serial,
                Unsealed::Missing
            ),
        }
    }
}

/// Why the state directory cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    #[error("cannot make the ACME state directory {}: {error}", path.display())]
    Make { path: PathBuf, error: io::Error },
    #[error("the ACME state directory {} is not a directory", path.display())]
    NotADirectory { path: PathBuf },
    #[error(
        "the ACME state directory {} is open to others (mode {mode:o}): it holds the account's \
         and the certificates' private keys; chmod 700 {}",
        path.display(),
        path.display()
    )]
    OpenToOthers { path: PathBuf, mode: u32 },
    #[error("the ACME state directory's seal key {}", path.display())]
    SealKey {
        path: PathBuf,
        #[source]
        error: io::Error,
    },
}

/// What a file holds now: a rename gives it a new inode, a rewrite a new size or time. The
/// engine re-reads a file only when its stamp changed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stamp {
    dev: u64,
    ino: u64,
    len: u64,
    mtime: i64,
    mtime_nsec: i64,
}

impl Stamp {
    fn of(m: &fs::Metadata) -> Stamp {
        Stamp {
            dev: m.dev(),
            ino: m.ino(),
            len: m.len(),
            mtime: m.mtime(),
            mtime_nsec: m.mtime_nsec(),
        }
    }
}

/// The record of a site's failed orders (`certs/LABEL/attempt.json`), so that every node backs
/// off alike: written by the node that failed, under the site's lock; removed on success.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Attempt {
    /// Failed orders in a row.
    pub failures: u32,
    /// No order before this (seconds since the Unix epoch).
    pub retry_at: u64,
    /// The last failure, as the CA or the network said it.
    pub error: String,
    /// What the site asked for when it failed ([`crate::AcmeSettings::fingerprint`] of its
    /// names and the `[acme]` table): a record made under another configuration is not held
    /// against the new one (the operator may have fixed the mistake). Empty in records from
    /// before the field: those are kept.
    #[serde(default)]
    pub config: String,
}

impl Store {
    /// Makes `root` (and missing parents) with mode 0700, or checks that the existing one is
    /// a directory closed to others; then makes `certs/`, `challenges/` and `locks/` in it.
    /// The seal key is derived from `key_file` when given (see `seal`), else read from (or
    /// made as) `root/seal.key`.
    pub fn open(root: &Path, key_file: Option<&KeyFileSecret>) -> Result<Store, OpenError> {
        let make = |path: &Path| {
            DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(path)
                .map_err(|error| OpenError::Make {
                    path: path.to_owned(),
                    error,
                })
        };
        make(root)?;
        let meta = fs::metadata(root).map_err(|error| OpenError::Make {
            path: root.to_owned(),
            error,
        })?;
        if !meta.is_dir() {
            return Err(OpenError::NotADirectory {
                path: root.to_owned(),
            });
        }
        let mode = meta.permissions().mode() & 0o7777;
        if mode & 0o077 != 0 {
            return Err(OpenError::OpenToOthers {
                path: root.to_owned(),
                mode,
            });
        }
        for sub in ["certs", "challenges", "locks"] {
            make(&root.join(sub))?;
        }
        let sealer = match key_file {
            Some(secret) => Sealer::from_key_file(secret),
            None => Sealer::in_state_dir(root).map_err(|error| OpenError::SealKey {
                path: root.join(super::seal::KEY_FILE),
                error,
            })?,
        };
        Ok(Store::with_sealer(root, sealer))
    }

    fn with_sealer(root: &Path, sealer: Sealer) -> Store {
        Store {
            root: root.to_owned(),
            sealer,
            refused: Default::default(),
            refusal_log: Mutex::new((None, 0)),
        }
    }

    /// Files refused for their seal so far, in [`FileKind::ALL`]'s order.
    pub fn refused(&self) -> [u64; FileKind::ALL.len()] {
        std::array::from_fn(|i| self.refused[i].load(Ordering::Relaxed))
    }

    /// Counts a file refused for its seal, and logs it unless one was logged in the last
    /// [`REFUSAL_LOG_INTERVAL`] (those not logged are counted in the next line).
    fn refuse(&self, kind: FileKind, path: &Path, why: &dyn std::fmt::Display) {
        let i = FileKind::ALL.iter().position(|k| *k == kind).unwrap_or(0);
        self.refused[i].fetch_add(1, Ordering::Relaxed);
        let mut log = match self.refusal_log.lock() {
            Ok(l) => l,
            Err(poisoned) => poisoned.into_inner(),
        };
        let now = Instant::now();
        if log
            .0
            .is_some_and(|last| now.duration_since(last) < REFUSAL_LOG_INTERVAL)
        {
            log.1 += 1;
            return;
        }
        let unlogged = std::mem::take(&mut log.1);
        log.0 = Some(now);
        tracing::warn!(
            file = %path.display(),
            kind = kind.label(),
            error = %why,
            not_logged_before = unlogged,
            key = self.sealer.origin(),
            "ACME: a file of the state directory refused: a demux did not write it (counted in ringmux_acme_state_refused_total)"
        );
    }

    /// Reads the sealed file at `place` (relative to the root): its content, or `Err` (a
    /// missing file is `NotFound`; one whose seal does not verify, or that has none, is
    /// `InvalidData`, counted as `kind` and logged).
    fn read_sealed(&self, place: &str, kind: FileKind) -> io::Result<Vec<u8>> {
        let path = self.root.join(place);
        let bytes = read_bounded(&path)?;
        match self.sealer.open(place, &bytes) {
            Ok(content) => Ok(content.to_vec()),
            Err(why) => {
                self.refuse(kind, &path, &why);
                Err(io::Error::new(io::ErrorKind::InvalidData, why.to_string()))
            }
        }
    }

    /// Writes `content` sealed for `place` (relative to the root), atomically.
    fn write_sealed(&self, place: &str, content: &[u8]) -> io::Result<()> {
        let path = self.root.join(place);
        let (dir, name) = match (path.parent(), path.file_name().and_then(|n| n.to_str())) {
            (Some(d), Some(n)) => (d.to_owned(), n.to_owned()),
            _ => return Err(io::Error::other(format!("{place}: not a file's place"))),
        };
        write_atomic(&dir, &name, &self.sealer.seal(place, content))
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    fn site_dir(&self, label: &str) -> PathBuf {
        self.root.join("certs").join(label)
    }

    // -----------------------------------------------------------------------------------------
    // Certificates
    // -----------------------------------------------------------------------------------------

    /// The stamps of a site's `cert.pem` and `key.pem`; `None` while either is missing.
    pub fn cert_stamp(&self, label: &str) -> Option<(Stamp, Stamp)> {
        let dir = self.site_dir(label);
        let cert = fs::symlink_metadata(dir.join("cert.pem")).ok()?;
        let key = fs::symlink_metadata(dir.join("key.pem")).ok()?;
        Some((Stamp::of(&cert), Stamp::of(&key)))
    }

    /// A site's stored certificate: `Ok(None)` if there is none. A pair whose seals verify is
    /// `Ok`; see [`CertRefused`] for the rest (a forged one is counted and logged here).
    pub fn read_cert(&self, label: &str) -> Result<Option<Certificate>, CertRefused> {
        let dir = self.site_dir(label);
        /// A file's bytes, and the length of its content if its seal verifies.
        type Read = (Vec<u8>, Result<usize, Unsealed>);
        let read = |name: &str| -> Result<Option<Read>, CertRefused> {
            let place = format!("certs/{label}/{name}");
            match read_bounded(&dir.join(name)) {
                Ok(bytes) => {
                    let sealed = self.sealer.open(&place, &bytes).map(<[u8]>::len);
                    Ok(Some((bytes, sealed)))
                }
                Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
                Err(e) => Err(CertRefused::Bad(format!(
                    "{}: {e}",
                    dir.join(name).display()
                ))),
            }
        };
        let (Some(chain), Some(key)) = (read("cert.pem")?, read("key.pem")?) else {
            return Ok(None);
        };
        let unsealed = match (&chain.1, &key.1) {
            (Ok(_), Ok(_)) => false,
            (Err(Unsealed::Missing), Err(Unsealed::Missing)) => true,
            (c, k) => {
                let (name, why) = match (c, k) {
                    (Err(why), _) => ("cert.pem", *why),
                    (_, Err(why)) => ("key.pem", *why),
                    _ => ("cert.pem", Unsealed::Forged),
                };
                let why = match why {
                    // One file sealed, the other not: not a pair an older ringmux wrote.
                    Unsealed::Missing => Unsealed::Forged,
                    w => w,
                };
                self.refuse(FileKind::Certificate, &dir.join(name), &why);
                return Err(CertRefused::Forged(format!(
                    "{}: {why}",
                    dir.join(name).display()
                )));
            }
        };
        let text = |(mut bytes, sealed): Read, name: &str| {
            if let Ok(len) = sealed {
                bytes.truncate(len);
            }
            String::from_utf8(bytes)
                .map_err(|_| CertRefused::Bad(format!("{}: not UTF-8", dir.join(name).display())))
        };
        let (chain, key) = (text(chain, "cert.pem")?, text(key, "key.pem")?);
        let cert = examine(chain, key)
            .map_err(|why| CertRefused::Bad(format!("{}: {why}", dir.display())))?;
        if unsealed {
            Err(CertRefused::Unsealed(Box::new(cert)))
        } else {
            Ok(Some(cert))
        }
    }

    /// Counts and logs a stored certificate without a seal that the caller does not adopt.
    pub fn refuse_unsealed_cert(&self, label: &str) {
        self.refuse(
            FileKind::Certificate,
            &self.site_dir(label).join("cert.pem"),
            &Unsealed::Missing,
        );
    }

    /// Stores a site's certificate and key (0600): the key first, then the chain.
    pub fn write_cert(&self, label: &str, issued: &Issued) -> io::Result<()> {
        let dir = self.site_dir(label);
        DirBuilder::new().recursive(true).mode(0o700).create(&dir)?;
        self.write_sealed(&format!("certs/{label}/key.pem"), issued.key_pem.as_bytes())?;
        self.write_sealed(
            &format!("certs/{label}/cert.pem"),
            issued.chain_pem.as_bytes(),
        )
    }

    // -----------------------------------------------------------------------------------------
    // Failed attempts
    // -----------------------------------------------------------------------------------------

    pub fn attempt_stamp(&self, label: &str) -> Option<Stamp> {
        fs::symlink_metadata(self.site_dir(label).join("attempt.json"))
            .ok()
            .map(|m| Stamp::of(&m))
    }

    /// `None` if there is no record or it cannot be read (a torn or foreign file is as good as
    /// none: the node that wrote it retries anyway; one without a valid seal is also counted).
    pub fn read_attempt(&self, label: &str) -> Option<Attempt> {
        let bytes = self
            .read_sealed(&format!("certs/{label}/attempt.json"), FileKind::Attempt)
            .ok()?;
        serde_json::from_slice(&bytes).ok()
    }

    pub fn write_attempt(&self, label: &str, attempt: &Attempt) -> io::Result<()> {
        let dir = self.site_dir(label);
        DirBuilder::new().recursive(true).mode(0o700).create(&dir)?;
        let json = serde_json::to_vec(attempt).map_err(io::Error::other)?;
        self.write_sealed(&format!("certs/{label}/attempt.json"), &json)
    }

    pub fn remove_attempt(&self, label: &str) {
        let _ = fs::remove_file(self.site_dir(label).join("attempt.json"));
    }

    // -----------------------------------------------------------------------------------------
    // Locks
    // -----------------------------------------------------------------------------------------

    /// Takes `locks/LABEL.lock` without waiting: `Ok(None)` when another process (a node
    /// sharing the directory) or another order of this one holds it.
    pub fn try_lock(&self, label: &str) -> io::Result<Option<LockedFile>> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(self.root.join("locks").join(format!("{label}.lock")))?;
        sys::try_lock_exclusive(file)
    }

    // -----------------------------------------------------------------------------------------
    // The account
    // -----------------------------------------------------------------------------------------

    /// The stored account for `directory`, as instant-acme wrote its credentials; `Ok(None)`
    /// if there is none.
    pub fn read_account(
        &self,
        directory: &str,
    ) -> Result<Option<serde_json::Value>, AccountFileError> {
        Ok(self.read_accounts()?.remove(directory))
    }

    /// Adds or replaces the account of `directory`, keeping the others (a CA's staging and
    /// production directories have different accounts).
    pub fn write_account(&self, directory: &str, credentials: serde_json::Value) -> io::Result<()> {
        let mut all = self.read_accounts().unwrap_or_default();
        all.insert(directory.to_owned(), credentials);
        let json =
            serde_json::to_vec_pretty(&AccountsFile { accounts: all }).map_err(io::Error::other)?;
        self.write_sealed("account.json", &json)
    }

    fn read_accounts(&self) -> Result<BTreeMap<String, serde_json::Value>, AccountFileError> {
        let path = self.root.join("account.json");
        match self.read_sealed("account.json", FileKind::Account) {
            Ok(bytes) => serde_json::from_slice::<AccountsFile>(&bytes)
                .map(|f| f.accounts)
                .map_err(|error| AccountFileError::Json { path, error }),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(BTreeMap::new()),
            Err(error) => Err(AccountFileError::Read { path, error }),
        }
    }

    // -----------------------------------------------------------------------------------------
    // Challenges
    // -----------------------------------------------------------------------------------------

    /// The tokens of `challenges/TOKEN.json` with their stamps (at most [`MAX_CHALLENGES`];
    /// other names, such as temporary files, are skipped).
    pub fn challenge_files(&self) -> io::Result<Vec<(String, Stamp)>> {
        let mut found = Vec::new();
        for entry in fs::read_dir(self.root.join("challenges"))? {
            let entry = entry?;
            let name = entry.file_name();
            let Some(token) = name.to_str().and_then(|n| n.strip_suffix(".json")) else {
                continue;
            };
            if !is_token(token) {
                continue;
            }
            let Ok(meta) = entry.metadata() else {
                continue;
            };
            if meta.is_file() {
                found.push((token.to_owned(), Stamp::of(&meta)));
            }
            if found.len() == MAX_CHALLENGES {
                break;
            }
        }
        Ok(found)
    }

    pub fn read_challenge(&self, token: &str) -> io::Result<Vec<u8>> {
        if !is_token(token) {
            return Err(io::Error::other("not a challenge token"));
        }
        self.read_sealed(&format!("challenges/{token}.json"), FileKind::Challenge)
    }

    pub fn write_challenge(&self, token: &str, json: &[u8]) -> io::Result<()> {
        if !is_token(token) {
            return Err(io::Error::other(format!(
                "the CA's challenge token {:?} is not base64url",
                token.chars().take(64).collect::<String>()
            )));
        }
        self.write_sealed(&format!("challenges/{token}.json"), json)
    }

    pub fn remove_challenge(&self, token: &str) {
        if is_token(token) {
            let _ = fs::remove_file(self.root.join("challenges").join(format!("{token}.json")));
        }
    }
}

#[derive(Serialize, Deserialize)]
struct AccountsFile {
    /// By directory URL.
    accounts: BTreeMap<String, serde_json::Value>,
}

/// Whether `label` can name files: a site's first name, which the configuration checked as a
/// DNS name; this only keeps a path inside its folder.
pub fn is_safe_label(label: &str) -> bool {
    !label.is_empty()
        && label.len() <= 253
        && !label.starts_with('.')
        && label
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-._*".contains(&b))
}

/// Whether `token` is a challenge token (RFC 8555 §8.1: base64url, no padding), and so a safe
/// file name. A CA's token has at least 128 bits (22 characters); 256 is plenty of margin.
pub fn is_token(token: &str) -> bool {
    (1..=256).contains(&token.len())
        && token
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

/// A certificate chain and key, checked, and what it says of itself.
#[derive(Clone, Debug)]
pub struct Certificate {
    pub issued: Issued,
    /// Its DNS names, lower case.
    pub names: Vec<String>,
    /// The leaf, DER (for its ARI identifier).
    pub leaf: Vec<u8>,
}

impl Certificate {
    /// Whether it covers every one of `names` and is valid at `now`; `Err` says why not.
    pub fn fits(&self, names: &[String], now: SystemTime) -> Result<(), CertificateError> {
        self.covers(names)?;
        if self.issued.not_after <= now {
            return Err(CertificateError::Expired);
        }
        if self.issued.not_before > now {
            return Err(CertificateError::NotYetValid);
        }
        Ok(())
    }

    /// Whether it covers every one of `names`; `Err` names those it does not.
    pub fn covers(&self, names: &[String]) -> Result<(), CertificateError> {
        let missing: Vec<&str> = names
            .iter()
            .filter(|n| !ringmux_proto::x509::covers(&self.names, &n.to_ascii_lowercase()))
            .map(String::as_str)
            .collect();
        if !missing.is_empty() {
            return Err(CertificateError::Uncovered {
                missing: missing.join(", "),
                covers: self.names.join(", "),
            });
        }
        Ok(())
    }
}

/// Why a certificate is not used.
#[derive(Debug, thiserror::Error)]
pub enum CertificateError {
    #[error(transparent)]
    Pem(#[from] ringmux_proto::certs::CertError),
    #[error("no certificate")]
    Empty,
    #[error("the key does not go with the certificate")]
    KeyMismatch(#[source] rustls::Error),
    #[error(transparent)]
    NotX509(#[from] ringmux_proto::x509::LeafError),
    #[error("it does not cover {missing} (it covers {covers})")]
    Uncovered { missing: String, covers: String },
    #[error("it has expired")]
    Expired,
    #[error("it is not valid yet")]
    NotYetValid,
}

/// Why the account file is not used.
#[derive(Debug, thiserror::Error)]
pub enum AccountFileError {
    #[error("{}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        error: io::Error,
    },
    #[error("{}", path.display())]
    Json {
        path: PathBuf,
        #[source]
        error: serde_json::Error,
    },
}

/// Reads a PEM chain (leaf first) and its PEM key: both parse, the key goes with the leaf
/// (rustls' own check, under the ring provider the workers use), and the leaf is X.509.
pub fn examine(chain_pem: String, key_pem: String) -> Result<Certificate, CertificateError> {
    let (chain, key) = ringmux_proto::certs::parse_pem(&chain_pem, &key_pem)?;
    let leaf_der = chain
        .first()
        .ok_or(CertificateError::Empty)?
        .as_ref()
        .to_vec();
    let provider = rustls::crypto::ring::default_provider();
    rustls::sign::CertifiedKey::from_der(chain, key, &provider)
        .map_err(CertificateError::KeyMismatch)?;
    let leaf = ringmux_proto::x509::leaf(&leaf_der)?;
    // The leaf read as X.509 just above: its serial reads too.
    let serial = serial_hex(&leaf_der).unwrap_or_default();
    Ok(Certificate {
        issued: Issued {
            chain_pem,
            key_pem,
            serial,
            not_before: leaf.not_before,
            not_after: leaf.not_after,
        },
        names: leaf.names,
        leaf: leaf_der,
    })
}

/// The leaf's serial number in hex, without leading zero bytes (as Pebble's management API and
/// `openssl x509 -serial` write it, in lower case).
fn serial_hex(der: &[u8]) -> Option<String> {
    use x509_parser::prelude::*;
    let (_, cert) = X509Certificate::from_der(der).ok()?;
    let raw = cert.tbs_certificate.raw_serial();
    let start = raw
        .iter()
        .position(|b| *b != 0)
        .unwrap_or(raw.len().saturating_sub(1));
    Some(hex::encode(&raw[start.min(raw.len())..]))
}

/// Seconds since the Unix epoch (0 before it).
pub fn unix_secs(t: SystemTime) -> u64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The time `secs` after the Unix epoch, saturating at [`super::schedule::far_future`].
pub fn from_unix_secs(secs: u64) -> SystemTime {
    SystemTime::UNIX_EPOCH
        .checked_add(Duration::from_secs(secs))
        .map_or_else(super::schedule::far_future, |t| {
            t.min(super::schedule::far_future())
        })
}

/// Reads a whole file of at most [`MAX_FILE`] bytes, not following a symbolic link.
fn read_bounded(path: &Path) -> io::Result<Vec<u8>> {
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)?;
    let mut bytes = Vec::new();
    file.take(MAX_FILE + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > MAX_FILE {
        return Err(io::Error::other(format!(
            "larger than {MAX_FILE} bytes: not one of ours"
        )));
    }
    Ok(bytes)
}

/// Writes `dir/name` whole: a temporary file (0600) beside it, flushed to disk, renamed over
/// the old one; then the folder is flushed so that the rename survives a crash.
fn write_atomic(dir: &Path, name: &str, bytes: &[u8]) -> io::Result<()> {
    let mut rand = [0u8; 6];
    let _ = getrandom::fill(&mut rand);
    let tmp = dir.join(format!(
        ".{name}.{}-{}.tmp",
        std::process::id(),
        hex::encode(rand)
    ));
    let written = (|| {
        let mut f = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_CLOEXEC)
            .open(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        fs::rename(&tmp, dir.join(name))
    })();
    if written.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    written?;
    if let Ok(d) = File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn closed_dir() -> tempfile::TempDir {
        tempfile::Builder::new()
            .prefix("ringmux-acme-store-")
            .permissions(fs::Permissions::from_mode(0o700))
            .tempdir()
            .unwrap()
    }

    fn self_signed(names: &[&str]) -> Issued {
        let ck = rcgen::generate_simple_self_signed(
            names.iter().map(|s| s.to_string()).collect::<Vec<_>>(),
        )
        .unwrap();
        examine(ck.cert.pem(), ck.signing_key.serialize_pem())
            .unwrap()
            .issued
    }

    #[test]
    fn the_directory_is_made_closed_and_an_open_one_refused() {
        let tmp = closed_dir();
        let root = tmp.path().join("a/b/state");
        let store = Store::open(&root, None).unwrap();
        for d in [root.clone(), root.join("certs"), root.join("locks")] {
            let mode = fs::metadata(&d).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, 0o700, "{}", d.display());
        }
        drop(store);
        fs::set_permissions(&root, fs::Permissions::from_mode(0o755)).unwrap();
        let e = Store::open(&root, None).unwrap_err().to_string();
        assert!(
            e.contains(&root.display().to_string()) && e.contains("chmod 700") && e.contains("755"),
            "{e}"
        );
        let file = tmp.path().join("file");
        fs::write(&file, b"x").unwrap();
        let e = Store::open(&file, None).unwrap_err().to_string();
        assert!(e.contains("file"), "{e}");
    }

    #[test]
    fn certificates_round_trip_with_their_serial_names_and_modes() {
        let tmp = closed_dir();
        let store = Store::open(tmp.path(), None).unwrap();
        assert!(store.read_cert("a.test").unwrap().is_none());
        assert!(store.cert_stamp("a.test").is_none());
        let issued = self_signed(&["a.test", "www.a.test"]);
        store.write_cert("a.test", &issued).unwrap();
        let stamp = store.cert_stamp("a.test").unwrap();
        let back = store.read_cert("a.test").unwrap().unwrap();
        assert_eq!(back.issued, issued);
        assert_eq!(back.names, ["a.test", "www.a.test"]);
        assert!(!back.issued.serial.is_empty() && !back.issued.serial.starts_with("00"));
        let names = |n: &[&str]| n.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let now = SystemTime::now();
        assert!(back.fits(&names(&["A.test"]), now).is_ok());
        let e = back.fits(&names(&["a.test", "b.test"]), now).unwrap_err();
        assert!(e.to_string().contains("b.test"), "{e}");
        assert!(back
            .fits(&names(&["a.test"]), back.issued.not_after)
            .is_err());
        for f in ["cert.pem", "key.pem"] {
            let m = fs::metadata(tmp.path().join("certs/a.test").join(f)).unwrap();
            assert_eq!(m.permissions().mode() & 0o777, 0o600, "{f}");
        }
        // A rewrite changes the stamp; no temporary file is left.
        store
            .write_cert("a.test", &self_signed(&["a.test"]))
            .unwrap();
        assert_ne!(store.cert_stamp("a.test").unwrap(), stamp);
        let left: Vec<_> = fs::read_dir(tmp.path().join("certs/a.test"))
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(left.len(), 2, "{left:?}");
    }

    #[test]
    fn broken_files_are_errors_not_panics() {
        let tmp = closed_dir();
        let store = Store::open(tmp.path(), None).unwrap();
        let dir = tmp.path().join("certs/a.test");
        fs::create_dir_all(&dir).unwrap();
        let one = self_signed(&["a.test"]);
        let other = self_signed(&["a.test"]);
        let cases: [(&[u8], &[u8]); 6] = [
            (b"", b""),
            (b"\xff\xfe", one.key_pem.as_bytes()),
            (
                b"-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n",
                one.key_pem.as_bytes(),
            ),
            (one.chain_pem.as_bytes(), other.key_pem.as_bytes()),
            (one.chain_pem.as_bytes(), b"garbage"),
            (one.key_pem.as_bytes(), one.chain_pem.as_bytes()),
        ];
        for (cert, key) in cases {
            fs::write(dir.join("cert.pem"), cert).unwrap();
            fs::write(dir.join("key.pem"), key).unwrap();
            let e = store.read_cert("a.test").unwrap_err().to_string();
            assert!(e.contains("a.test"), "{e}");
        }
        // Too large.
        fs::write(dir.join("cert.pem"), vec![b'a'; MAX_FILE as usize + 1]).unwrap();
        let e = store.read_cert("a.test").unwrap_err().to_string();
        assert!(e.contains("larger"), "{e}");
        // A symbolic link is not followed.
        fs::remove_file(dir.join("cert.pem")).unwrap();
        fs::write(tmp.path().join("elsewhere"), one.chain_pem.as_bytes()).unwrap();
        std::os::unix::fs::symlink(tmp.path().join("elsewhere"), dir.join("cert.pem")).unwrap();
        fs::write(dir.join("key.pem"), one.key_pem.as_bytes()).unwrap();
        assert!(store.read_cert("a.test").is_err());
        // A torn attempt record reads as none.
        fs::write(dir.join("attempt.json"), b"{\"failures\":").unwrap();
        assert_eq!(store.read_attempt("a.test"), None);
        let a = Attempt {
            failures: 2,
            retry_at: 77,
            error: "no".into(),
            config: "c".into(),
        };
        store.write_attempt("a.test", &a).unwrap();
        assert_eq!(store.read_attempt("a.test"), Some(a));
        store.remove_attempt("a.test");
        assert_eq!(store.attempt_stamp("a.test"), None);
    }

    #[test]
    fn files_a_demux_did_not_write_are_refused_and_counted() {
        let tmp = closed_dir();
        let store = Store::open(tmp.path(), None).unwrap();
        let count =
            |k: FileKind| store.refused()[FileKind::ALL.iter().position(|x| *x == k).unwrap()];
        let dir = tmp.path().join("certs/a.test");
        let one = self_signed(&["a.test"]);
        store.write_cert("a.test", &one).unwrap();
        assert!(store.read_cert("a.test").unwrap().is_some());
        // The files are PEM with a trailer after the last block, still readable as PEM.
        let on_disk = fs::read_to_string(dir.join("cert.pem")).unwrap();
        assert!(on_disk.starts_with(&one.chain_pem) && on_disk.contains("#ringmux-seal v1 "));

        // A planted pair without seals (as a worker writes it, or an older ringmux did).
        let planted = self_signed(&["a.test"]);
        fs::write(dir.join("cert.pem"), &planted.chain_pem).unwrap();
        fs::write(dir.join("key.pem"), &planted.key_pem).unwrap();
        assert!(matches!(
            store.read_cert("a.test"),
            Err(CertRefused::Unsealed(_))
        ));
        store.refuse_unsealed_cert("a.test");
        assert_eq!(count(FileKind::Certificate), 1);
        // One sealed file beside a planted one, or a seal copied from another site's file.
        store.write_cert("a.test", &one).unwrap();
        fs::write(dir.join("cert.pem"), &planted.chain_pem).unwrap();
        assert!(matches!(
            store.read_cert("a.test"),
            Err(CertRefused::Forged(_))
        ));
        store.write_cert("b.test", &one).unwrap();
        fs::copy(
            tmp.path().join("certs/b.test/cert.pem"),
            dir.join("cert.pem"),
        )
        .unwrap();
        assert!(matches!(
            store.read_cert("a.test"),
            Err(CertRefused::Forged(_))
        ));
        assert_eq!(count(FileKind::Certificate), 3);

        // Challenges, failure records and accounts: refused, counted.
        fs::write(tmp.path().join("challenges/tok.json"), b"{}").unwrap();
        assert_eq!(
            store.read_challenge("tok").unwrap_err().kind(),
            io::ErrorKind::InvalidData
        );
        store.write_challenge("tok", b"{}").unwrap();
        assert_eq!(store.read_challenge("tok").unwrap(), b"{}");
        fs::copy(
            tmp.path().join("challenges/tok.json"),
            tmp.path().join("challenges/other.json"),
        )
        .unwrap();
        assert!(store.read_challenge("other").is_err());
        assert_eq!(count(FileKind::Challenge), 2);
        fs::write(
            dir.join("attempt.json"),
            br#"{"failures":9,"retry_at":1,"error":"x"}"#,
        )
        .unwrap();
        assert_eq!(store.read_attempt("a.test"), None);
        assert_eq!(count(FileKind::Attempt), 1);
        fs::write(tmp.path().join("account.json"), br#"{"accounts":{}}"#).unwrap();
        assert!(store.read_account("https://a/dir").is_err());
        assert_eq!(count(FileKind::Account), 1);

        // Another key (another deployment's, or a worker's own) does not verify.
        let keys = ringmux_quic_lb::KeySet::generate().unwrap();
        let key_file = KeyFileSecret::new(tmp.path().join("keys"), keys.to_bytes());
        let other = Store::open(tmp.path(), Some(&key_file)).unwrap();
        assert!(other.read_challenge("tok").is_err());
        other.write_challenge("tok", b"[]").unwrap();
        assert_eq!(other.read_challenge("tok").unwrap(), b"[]");
        assert!(store.read_challenge("tok").is_err());
    }

    proptest::proptest! {
        /// Whatever a certificate or key file holds, examining it does not panic.
        #[test]
        fn any_pem_is_examined_without_panicking(
            cert in "(-----BEGIN CERTIFICATE-----\n)?[A-Za-z0-9+/=\n]{0,300}(-----END CERTIFICATE-----\n)?",
            key in "(-----BEGIN PRIVATE KEY-----\n)?[A-Za-z0-9+/=\n]{0,200}(-----END PRIVATE KEY-----\n)?",
        ) {
            let _ = examine(cert, key);
        }
    }

    #[test]
    fn a_site_lock_is_exclusive_until_dropped() {
        let tmp = closed_dir();
        let store = Store::open(tmp.path(), None).unwrap();
        let held = store.try_lock("a.test").unwrap().expect("free");
        // Another open file description (as another node's would be) cannot take it.
        assert!(store.try_lock("a.test").unwrap().is_none());
        assert!(store.try_lock("b.test").unwrap().is_some());
        drop(held);
        assert!(store.try_lock("a.test").unwrap().is_some());
    }

    #[test]
    fn accounts_are_kept_per_directory() {
        let tmp = closed_dir();
        let store = Store::open(tmp.path(), None).unwrap();
        assert_eq!(store.read_account("https://a/dir").unwrap(), None);
        store
            .write_account("https://a/dir", serde_json::json!({"id": "1"}))
            .unwrap();
        store
            .write_account("https://b/dir", serde_json::json!({"id": "2"}))
            .unwrap();
        assert_eq!(
            store.read_account("https://a/dir").unwrap(),
            Some(serde_json::json!({"id": "1"}))
        );
        let mode = fs::metadata(tmp.path().join("account.json"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        fs::write(tmp.path().join("account.json"), b"[").unwrap();
        assert!(store.read_account("https://a/dir").is_err());
    }

    #[test]
    fn challenge_files_are_listed_by_token_and_bad_names_skipped() {
        let tmp = closed_dir();
        let store = Store::open(tmp.path(), None).unwrap();
        store.write_challenge("tok_-1", b"{}").unwrap();
        assert!(store.write_challenge("../x", b"{}").is_err());
        assert!(store.write_challenge("", b"{}").is_err());
        let dir = tmp.path().join("challenges");
        fs::write(dir.join("not a token.json"), b"{}").unwrap();
        fs::write(dir.join(".tok.json.1-2.tmp"), b"{}").unwrap();
        let found = store.challenge_files().unwrap();
        assert_eq!(found.len(), 1);
        assert_eq!(found[0].0, "tok_-1");
        assert_eq!(store.read_challenge("tok_-1").unwrap(), b"{}");
        assert!(store.read_challenge("../account").is_err());
        store.remove_challenge("tok_-1");
        assert!(store.challenge_files().unwrap().is_empty());
    }

    #[test]
    fn labels_and_tokens_that_could_escape_are_refused() {
        for good in ["a.test", "xn--bcher-kva.example", "localhost", "a_b.test"] {
            assert!(is_safe_label(good), "{good}");
        }
        for bad in ["", ".", "..", "../x", "a/b", ".hidden", "a\0b", "é.test"] {
            assert!(!is_safe_label(bad), "{bad:?}");
        }
        assert!(is_token("AbC-_09"));
        for bad in ["", "a.b", "a/b", "a=", &"a".repeat(257)] {
            assert!(!is_token(bad), "{bad:?}");
        }
    }
}
