//! The secrets every instance of a ringmux deployment shares, and the key file that carries them
//! across restarts and across boxes.
//!
//! This module owns generating the keys from the OS's randomness, the key-file format (parse,
//! write, permission check) and the fixed binary form sent to workers over the control socket.
//! It does not turn the secrets into quinn or rustls key objects (the worker does that) and it
//! never logs a secret: `Debug` is redacted.
//!
//! # Key file format (version 1)
//!
//! UTF-8 text, one `name = hex` per line; blank lines and lines starting with `#` are ignored;
//! every name must appear exactly once; hex is case-insensitive, without `0x`:
//!
//! ```text
//! # ringmux key file v1 - keep it secret: chmod 600
//! quic_lb         = <32 hex digits>    # QUIC-LB AES-128 CID key (same on every box of a pool)
//! routing_hash    = <32 hex digits>    # SipHash key for DCIDs no instance owns
//! stateless_reset = <128 hex digits>   # quinn EndpointConfig reset key (HMAC-SHA256)
//! token           = <128 hex digits>   # quinn Retry/NEW_TOKEN key (HKDF input)
//! session_ticket  = <64 hex digits>    # TLS session-ticket key (resumption/0-RTT on any instance)
//! ```
//!
//! Trailing `# comments` after a value are allowed. The file must not be accessible by group or
//! others (mode `0600` or stricter); [`KeySet::load`] refuses it otherwise. Boxes behind one
//! QUIC-LB load balancer use the same file (the QUIC-LB key must match; each box has its own
//! `node_id`), which also lets any box answer any other's stateless resets and tokens.

use std::path::{Path, PathBuf};

/// All long-lived secrets of one deployment.
#[derive(Clone, PartialEq, Eq)]
pub struct KeySet {
    /// AES-128 key of the QUIC-LB CID encryption ([`crate::QuicLbConfig::key`]).
    pub quic_lb: [u8; 16],
    /// SipHash key for routing DCIDs no instance owns ([`crate::Router::new`]).
    pub routing_hash: [u8; 16],
    /// Stateless-reset key (quinn `EndpointConfig::new(Arc<ring::hmac::Key>)`).
    pub stateless_reset: [u8; 64],
    /// Retry / NEW_TOKEN key (quinn `ServerConfig::new(.., Arc<ring::hkdf::Prk>)`).
    pub token: [u8; 64],
    /// TLS session-ticket key, so a resumed or 0-RTT connection is accepted by any instance.
    pub session_ticket: [u8; 32],
}

/// Failure to generate or decode a key set.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// The OS random number generator failed.
    #[error("the OS random number generator failed: {0}")]
    Randomness(getrandom::Error),
    /// [`KeySet::from_bytes`] got the wrong number of bytes.
    #[error("key set is {found} bytes, expected {expected} (format version {BINARY_VERSION})")]
    WrongLength {
        /// Bytes received.
        found: usize,
        /// Bytes the format has.
        expected: usize,
    },
    /// [`KeySet::from_bytes`] got an unknown format version.
    #[error("key set format version {found}, this build understands {BINARY_VERSION}")]
    UnsupportedVersion {
        /// The version byte received.
        found: u8,
    },
}

/// Failure to load a key file; every variant names the file.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KeyFileError {
    /// The file could not be opened, inspected, read or ([`KeySet::write_new`]) created and
    /// written.
    #[error("key file {path}: {error}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error (in the message, so not the error's `source`).
        error: std::io::Error,
    },
    /// Group or others may access the file.
    #[error(
        "key file {path} is accessible by group or others (mode {mode:04o}); run `chmod 600 {path}`"
    )]
    Permissions {
        /// The file.
        path: PathBuf,
        /// Its permission bits.
        mode: u32,
    },
    /// A line that is not `name = value`, or a name this format does not have.
    #[error("key file {path}, line {line}: {message}")]
    Syntax {
        /// The file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// What is wrong.
        message: String,
    },
    /// A value that is not hex.
    #[error("key file {path}, line {line}: `{key}` is not valid hex ({error})")]
    BadHex {
        /// The file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// The key name.
        key: &'static str,
        /// The decoder's complaint (in the message, so not the error's `source`).
        error: hex::FromHexError,
    },
    /// A value of the wrong length.
    #[error(
        "key file {path}, line {line}: `{key}` is {found} bytes ({} hex digits), expected {expected} bytes ({} hex digits)",
        found * 2,
        expected * 2
    )]
    WrongLength {
        /// The file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// The key name.
        key: &'static str,
        /// Bytes found.
        found: usize,
        /// Bytes required.
        expected: usize,
    },
    /// A key given twice.
    #[error("key file {path}, line {line}: `{key}` appears again (first on line {first})")]
    Duplicate {
        /// The file.
        path: PathBuf,
        /// 1-based line number of the repetition.
        line: usize,
        /// The key name.
        key: &'static str,
        /// Line of the first occurrence.
        first: usize,
    },
    /// A key not given at all.
    #[error("key file {path}: `{key}` is missing")]
    Missing {
        /// The file.
        path: PathBuf,
        /// The key name.
        key: &'static str,
    },
}

/// Version byte that starts [`KeySet::to_bytes`].
pub const BINARY_VERSION: u8 = 1;
/// Length of [`KeySet::to_bytes`]: version byte + 16 + 16 + 64 + 64 + 32.
pub const BINARY_LEN: usize = 1 + 16 + 16 + 64 + 64 + 32;

/// Field names in file and binary order, with their lengths.
const FIELDS: [(&str, usize); 5] = [
    ("quic_lb", 16),
    ("routing_hash", 16),
    ("stateless_reset", 64),
    ("token", 64),
    ("session_ticket", 32),
];

impl KeySet {
    /// Fresh keys from the OS's randomness.
    pub fn generate() -> Result<Self, KeyError> {
        let mut bytes = [0u8; BINARY_LEN];
        bytes[0] = BINARY_VERSION;
        getrandom::fill(&mut bytes[1..]).map_err(KeyError::Randomness)?;
        Self::from_bytes(&bytes)
    }

    /// Reads a key file (format in the module docs), refusing one that group or others can
    /// access, and naming the line and key of any error.
    pub fn load(path: &Path) -> Result<Self, KeyFileError> {
        let io = |error| KeyFileError::Io {
            path: path.to_owned(),
            error,
        };
        let file = std::fs::File::open(path).map_err(io)?;
        check_permissions(path, &file)?;
        let text = std::io::read_to_string(file).map_err(io)?;
        Self::parse(path, &text)
    }

    /// A key file already read (by a caller with its own rules for reading files): `mode` is
    /// the permission bits of the file read, refused if group or others may access it; `text`
    /// is parsed as [`KeySet::load`] does.
    pub fn from_file(path: &Path, text: &str, mode: u32) -> Result<Self, KeyFileError> {
        let mode = mode & 0o7777;
        if mode & 0o077 != 0 {
            return Err(KeyFileError::Permissions {
                path: path.to_owned(),
                mode,
            });
        }
        Self::parse(path, text)
    }

    /// Writes the set as a new key file at `path`: mode 0600 from the moment it exists, synced
    /// to disk. A file already there is refused (`AlreadyExists`), so a key file in use is never
    /// replaced by accident.
    pub fn write_new(&self, path: &Path) -> Result<(), KeyFileError> {
        use std::io::Write;
        let io = |error| KeyFileError::Io {
            path: path.to_owned(),
            error,
        };
        let mut options = std::fs::OpenOptions::new();
        options.write(true).create_new(true);
        #[cfg(unix)]
        std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
        let mut file = options.open(path).map_err(io)?;
        file.write_all(self.to_key_file().as_bytes())
            .and_then(|()| file.sync_all())
            .map_err(io)
    }

    /// Parses key-file text; `path` is only used in error messages.
    pub fn parse(path: &Path, text: &str) -> Result<Self, KeyFileError> {
        let mut values: [Option<(usize, Vec<u8>)>; 5] = Default::default();
        for (index, raw) in text.lines().enumerate() {
            let line = index + 1;
            let content = raw.split('#').next().unwrap_or("").trim();
            if content.is_empty() {
                continue;
            }
            let syntax = |message: String| KeyFileError::Syntax {
                path: path.to_owned(),
                line,
                message,
            };
            let Some((name, value)) = content.split_once('=') else {
                return Err(syntax(format!("expected `name = hex`, found `{content}`")));
            };
            let name = name.trim();
            let Some(slot) = FIELDS.iter().position(|(n, _)| *n == name) else {
                let known: Vec<_> = FIELDS.iter().map(|(n, _)| *n).collect();
                return Err(syntax(format!(
                    "unknown key `{name}` (known: {})",
                    known.join(", ")
                )));
            };
            let (key, expected) = FIELDS[slot];
            if let Some((first, _)) = &values[slot] {
                return Err(KeyFileError::Duplicate {
                    path: path.to_owned(),
                    line,
                    key,
                    first: *first,
                });
            }
            let bytes = hex::decode(value.trim()).map_err(|error| KeyFileError::BadHex {
                path: path.to_owned(),
                line,
                key,
                error,
            })?;
            if bytes.len() != expected {
                return Err(KeyFileError::WrongLength {
                    path: path.to_owned(),
                    line,
                    key,
                    found: bytes.len(),
                    expected,
                });
            }
            values[slot] = Some((line, bytes));
        }
        let mut binary = Vec::with_capacity(BINARY_LEN);
        binary.push(BINARY_VERSION);
        for (slot, value) in values.iter().enumerate() {
            match value {
                Some((_, bytes)) => binary.extend_from_slice(bytes),
                None => {
                    return Err(KeyFileError::Missing {
                        path: path.to_owned(),
                        key: FIELDS[slot].0,
                    })
                }
            }
        }
        // Cannot fail: every field was checked for length above.
        Self::from_bytes(&binary).map_err(|e| KeyFileError::Syntax {
            path: path.to_owned(),
            line: 0,
            message: e.to_string(),
        })
    }

    /// The key file text for these keys (format in the module docs). Write it with mode 0600.
    pub fn to_key_file(&self) -> String {
        let mut out = String::from(
            "# ringmux key file v1 - keep it secret: chmod 600\n\
             # Same file on every box behind one QUIC-LB load balancer; each box has its own node_id.\n",
        );
        for ((name, _), value) in FIELDS.iter().zip(self.fields()) {
            out.push_str(&format!("{name:<15} = {}\n", hex::encode(value)));
        }
        out
    }

    /// Fixed binary form for the control socket: version byte 1, then the five keys in the
    /// order of the struct ([`BINARY_LEN`] bytes).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(BINARY_LEN);
        out.push(BINARY_VERSION);
        for value in self.fields() {
            out.extend_from_slice(value);
        }
        out
    }

    /// Inverse of [`KeySet::to_bytes`].
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, KeyError> {
        if bytes.len() != BINARY_LEN {
            return Err(KeyError::WrongLength {
                found: bytes.len(),
                expected: BINARY_LEN,
            });
        }
        let (&version, rest) = bytes.split_first().ok_or(KeyError::WrongLength {
            found: 0,
            expected: BINARY_LEN,
        })?;
        if version != BINARY_VERSION {
            return Err(KeyError::UnsupportedVersion { found: version });
        }
        let mut keys = KeySet {
            quic_lb: [0; 16],
            routing_hash: [0; 16],
            stateless_reset: [0; 64],
            token: [0; 64],
            session_ticket: [0; 32],
        };
        let mut rest = rest;
        for field in keys.fields_mut() {
            let (head, tail) = rest.split_at(field.len());
            field.copy_from_slice(head);
            rest = tail;
        }
        Ok(keys)
    }

    fn fields(&self) -> [&[u8]; 5] {
        [
            &self.quic_lb,
            &self.routing_hash,
            &self.stateless_reset,
            &self.token,
            &self.session_ticket,
        ]
    }

    fn fields_mut(&mut self) -> [&mut [u8]; 5] {
        [
            &mut self.quic_lb,
            &mut self.routing_hash,
            &mut self.stateless_reset,
            &mut self.token,
            &mut self.session_ticket,
        ]
    }
}

impl std::fmt::Debug for KeySet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("KeySet { <redacted> }")
    }
}

#[cfg(unix)]
fn check_permissions(path: &Path, file: &std::fs::File) -> Result<(), KeyFileError> {
    use std::os::unix::fs::PermissionsExt;
    let metadata = file.metadata().map_err(|error| KeyFileError::Io {
        path: path.to_owned(),
        error,
    })?;
    let mode = metadata.permissions().mode() & 0o7777;
    if mode & 0o077 != 0 {
        return Err(KeyFileError::Permissions {
            path: path.to_owned(),
            mode,
        });
    }
    Ok(())
}

#[cfg(not(unix))]
fn check_permissions(_path: &Path, _file: &std::fs::File) -> Result<(), KeyFileError> {
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> KeySet {
        let mut bytes = [0u8; BINARY_LEN];
        bytes[0] = BINARY_VERSION;
        for (i, b) in bytes[1..].iter_mut().enumerate() {
            *b = i as u8;
        }
        KeySet::from_bytes(&bytes).unwrap()
    }

    fn parse(text: &str) -> Result<KeySet, KeyFileError> {
        KeySet::parse(Path::new("/etc/ringmux/keys"), text)
    }

    #[test]
    fn generate_differs_and_roundtrips() {
        let a = KeySet::generate().unwrap();
        let b = KeySet::generate().unwrap();
        assert_ne!(a, b);
        assert_eq!(KeySet::from_bytes(&a.to_bytes()).unwrap(), a);
        assert_eq!(parse(&a.to_key_file()).unwrap(), a);
    }

    #[test]
    fn binary_layout() {
        let k = sample();
        let bytes = k.to_bytes();
        assert_eq!(bytes.len(), 193);
        assert_eq!(bytes[0], 1);
        assert_eq!(k.quic_lb[0], 0);
        assert_eq!(k.routing_hash[0], 16);
        assert_eq!(k.stateless_reset[0], 32);
        assert_eq!(k.token[0], 96);
        assert_eq!(k.session_ticket[31], 191);
        assert!(matches!(
            KeySet::from_bytes(&bytes[..192]),
            Err(KeyError::WrongLength {
                found: 192,
                expected: 193
            })
        ));
        let mut v2 = bytes.clone();
        v2[0] = 2;
        assert!(matches!(
            KeySet::from_bytes(&v2),
            Err(KeyError::UnsupportedVersion { found: 2 })
        ));
    }

    #[test]
    fn file_errors_say_which() {
        let good = sample().to_key_file();
        let e = parse(&good.replace("quic_lb ", "quic_lbx"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("line 3") && e.contains("unknown key `quic_lbx`"),
            "{e}"
        );

        let e = parse(&good.replacen("= 00", "= zz", 1))
            .unwrap_err()
            .to_string();
        assert!(e.contains("`quic_lb` is not valid hex"), "{e}");

        let short = good.replacen("= 00", "= ", 1);
        let e = parse(&short).unwrap_err().to_string();
        assert!(
            e.contains("`quic_lb` is 15 bytes (30 hex digits), expected 16 bytes (32 hex digits)"),
            "{e}"
        );

        let first_line = good.lines().nth(2).unwrap();
        let e = parse(&format!("{good}{first_line}\n"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("`quic_lb` appears again (first on line 3)"),
            "{e}"
        );

        let without_token: String = good
            .lines()
            .filter(|l| !l.starts_with("token"))
            .map(|l| format!("{l}\n"))
            .collect();
        let e = parse(&without_token).unwrap_err().to_string();
        assert!(
            e.contains("`token` is missing") && e.contains("/etc/ringmux/keys"),
            "{e}"
        );

        let e = parse("just garbage\n").unwrap_err().to_string();
        assert!(e.contains("line 1") && e.contains("name = hex"), "{e}");
    }

    #[test]
    fn comments_whitespace_and_case() {
        let k = sample();
        let mut text = String::from("\n  # leading comment\n\n");
        for ((name, _), value) in FIELDS.iter().zip(k.fields()) {
            text.push_str(&format!(
                "  {name}={}   # trailing comment\n",
                hex::encode_upper(value)
            ));
        }
        assert_eq!(parse(&text).unwrap(), k);
    }

    #[test]
    fn debug_is_redacted() {
        assert_eq!(format!("{:?}", sample()), "KeySet { <redacted> }");
    }

    #[cfg(unix)]
    #[test]
    fn load_checks_permissions_and_write_new_makes_a_private_file() {
        use std::os::unix::fs::PermissionsExt;
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        let path = dir.join("keys");
        let k = sample();
        std::fs::write(&path, k.to_key_file()).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = KeySet::load(&path).unwrap_err().to_string();
        assert!(
            e.contains("mode 0644") && e.contains(&format!("chmod 600 {}", path.display())),
            "{e}"
        );
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(KeySet::load(&path).unwrap(), k);
        let e = KeySet::load(&dir.join("absent")).unwrap_err();
        assert!(
            e.to_string().contains("absent") && e.to_string().contains("No such file"),
            "{e}"
        );
        // The message holds the OS error, so it is not also the source (printed twice in a
        // chain otherwise).
        assert!(std::error::Error::source(&e).is_none());
        // Written new: mode 0600, loads back; never over a file that exists.
        let new = dir.join("new");
        k.write_new(&new).unwrap();
        let mode = std::fs::metadata(&new).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "{mode:o}");
        assert_eq!(KeySet::load(&new).unwrap(), k);
        let e = sample().write_new(&path).unwrap_err();
        assert!(
            matches!(&e, KeyFileError::Io { error, .. } if error.kind() == std::io::ErrorKind::AlreadyExists),
            "{e}"
        );
    }
}
