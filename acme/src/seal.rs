//! The seal on every file of the state directory the engine reads back: an HMAC-SHA256 of the
//! file's place and content, with a key no worker holds, so that a file a demux did not write
//! (planted by a worker that could reach the folder, or by anyone else) is refused.
//!
//! # Format (version 1)
//!
//! A sealed file is its content followed by one trailer line of fixed length:
//!
//! ```text
//! CONTENT
//! #ringmux-seal v1 <64 hex digits>\n
//! ```
//!
//! The digits are `HMAC-SHA256(key, "ringmux-acme-state v1\0" ‖ PLACE ‖ "\0" ‖ CONTENT)`, where
//! PLACE is the file's path inside the state directory (`certs/LABEL/cert.pem`,
//! `challenges/TOKEN.json`…): a sealed file moved to another place (another site's folder,
//! another token) no longer verifies. PEM readers skip the trailer (text outside a PEM block),
//! so `openssl x509 -in cert.pem` still reads a sealed chain.
//!
//! # The key
//!
//! With a key file (`key_file`, shared by every node behind one balancer), the seal key is
//! derived from it (an HMAC of the whole key set under a label of its own), so that every node
//! sharing the state directory and the key file verifies every other's files, and the key lives
//! outside the state directory. Without one, the demux makes `STATE/seal.key` (32 random bytes,
//! hex, mode 0600) on first use and reads it afterwards; nodes sharing the directory share it
//! too. Either way no worker may read it: the key file and the state directory are outside
//! every worker's reach (the workers' file-system allow-list). A state directory several nodes
//! share is best used with a key file: then the key is not in the shared folder at all.
//! Replacing the key file (or removing `seal.key`) makes every stored file unverifiable: the
//! sites are ordered anew and a new account is made.
//!
//! # Files from before the seal
//!
//! A file without any trailer was written by a ringmux older than the seal (or planted).
//! Challenges, failure records and accounts are refused like forged ones (an order makes new
//! ones; a refused account is replaced by a new one). A stored certificate without a trailer
//! is adopted by the engine's first read only, at start, so that a site keeps serving through
//! the upgrade, and its site is ordered for at once: the new, sealed certificate replaces it
//! within one order. After the start, a certificate without a seal is refused like a forged one.

use std::fs::OpenOptions;
use std::io::{self, Read, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// The deployment's key file (`key_file`) as the demux read it: its path and the bytes of its
/// key set, from which the seal key is derived. The engine never reads the file itself.
#[derive(Clone, PartialEq, Eq)]
pub struct KeyFileSecret {
    path: PathBuf,
    bytes: Vec<u8>,
}

impl KeyFileSecret {
    /// `bytes`: the key set's own encoding (`KeySet::to_bytes` of `ringmux-quic-lb`).
    pub fn new(path: PathBuf, bytes: Vec<u8>) -> KeyFileSecret {
        KeyFileSecret { path, bytes }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl std::fmt::Debug for KeyFileSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeyFileSecret")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

/// The trailer's start, before the hex digits.
const TAG: &[u8] = b"\n#ringmux-seal v1 ";
/// The whole trailer: tag, 64 hex digits, newline.
pub const TRAILER_LEN: usize = TAG.len() + 64 + 1;
/// What the MAC input starts with (the format's version is in it).
const DOMAIN: &[u8] = b"ringmux-acme-state v1\0";
/// The label the key is derived under from a key file.
const DERIVE_LABEL: &[u8] = b"ringmux acme state seal v1";
/// The key's file in the state directory when there is no key file.
pub const KEY_FILE: &str = "seal.key";

/// The key that seals and checks the state directory's files.
pub struct Sealer {
    key: ring::hmac::Key,
    /// Where it came from, for messages.
    origin: String,
}

impl std::fmt::Debug for Sealer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sealer")
            .field("origin", &self.origin)
            .finish_non_exhaustive()
    }
}

/// Why a file's content is not to be trusted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unsealed {
    /// No trailer at all: written before the seal existed, or by someone else.
    Missing,
    /// A trailer whose MAC does not verify: not written by a demux holding this key (or moved
    /// from another place, or changed since).
    Forged,
}

impl std::fmt::Display for Unsealed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Unsealed::Missing => "it carries no seal: not written by this version of ringmux",
            Unsealed::Forged => "its seal does not verify: not written by a ringmux demux",
        })
    }
}

impl Sealer {
    /// The key derived from a deployment's key file.
    pub fn from_key_file(key_file: &KeyFileSecret) -> Sealer {
        let master = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, &key_file.bytes);
        let derived = ring::hmac::sign(&master, DERIVE_LABEL);
        Sealer {
            key: ring::hmac::Key::new(ring::hmac::HMAC_SHA256, derived.as_ref()),
            origin: format!("derived from the key file {}", key_file.path.display()),
        }
    }

    /// The key of `root/seal.key`, made (0600, whole, by a link that fails if another node made
    /// it first) when missing. Not following a symbolic link, reading at most a few bytes.
    pub fn in_state_dir(root: &Path) -> io::Result<Sealer> {
        let path = root.join(KEY_FILE);
        let made = match read_key(&path) {
            Ok(key) => key,
            Err(e) if e.kind() == io::ErrorKind::NotFound => make_key(root, &path)?,
            Err(e) => return Err(e),
        };
        Ok(Sealer {
            key: ring::hmac::Key::new(ring::hmac::HMAC_SHA256, &made),
            origin: format!("{}", path.display()),
        })
    }

    /// A key of fixed bytes (tests).
    #[cfg(test)]
    pub fn fixed(bytes: &[u8]) -> Sealer {
        Sealer {
            key: ring::hmac::Key::new(ring::hmac::HMAC_SHA256, bytes),
            origin: "a test key".into(),
        }
    }

    /// Where the key came from.
    pub fn origin(&self) -> &str {
        &self.origin
    }

    /// `content` with its trailer for the file at `place` (its path inside the directory).
    pub fn seal(&self, place: &str, content: &[u8]) -> Vec<u8> {
        let tag = self.mac(place, content);
        let mut out = Vec::with_capacity(content.len() + TRAILER_LEN);
        out.extend_from_slice(content);
        out.extend_from_slice(TAG);
        out.extend_from_slice(hex::encode(tag.as_ref()).as_bytes());
        out.push(b'\n');
        out
    }

    /// The content of a sealed file read from `place`, if its seal verifies (in constant time).
    pub fn open<'a>(&self, place: &str, bytes: &'a [u8]) -> Result<&'a [u8], Unsealed> {
        let split = bytes
            .len()
            .checked_sub(TRAILER_LEN)
            .ok_or(Unsealed::Missing)?;
        let (content, trailer) = bytes.split_at(split);
        let digits = trailer
            .strip_prefix(TAG)
            .and_then(|t| t.strip_suffix(b"\n"))
            .ok_or(Unsealed::Missing)?;
        let tag = hex::decode(digits).map_err(|_| Unsealed::Forged)?;
        ring::hmac::verify(&self.key, &mac_input(place, content), &tag)
            .map_err(|_| Unsealed::Forged)?;
        Ok(content)
    }

    fn mac(&self, place: &str, content: &[u8]) -> ring::hmac::Tag {
        ring::hmac::sign(&self.key, &mac_input(place, content))
    }
}

fn mac_input(place: &str, content: &[u8]) -> Vec<u8> {
    let mut input = Vec::with_capacity(DOMAIN.len() + place.len() + 1 + content.len());
    input.extend_from_slice(DOMAIN);
    input.extend_from_slice(place.as_bytes());
    input.push(0);
    input.extend_from_slice(content);
    input
}

/// Reads `seal.key`: 64 hex digits (and an optional newline), a regular file closed to others.
fn read_key(path: &Path) -> io::Result<[u8; 32]> {
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK)
        .open(path)?;
    let meta = file.metadata()?;
    let bad = |why: String| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "{}: {why}; remove it to make a new key (every stored certificate is then \
                 ordered again)",
                path.display()
            ),
        )
    };
    if !meta.is_file() {
        return Err(bad("not a regular file".into()));
    }
    if meta.mode() & 0o077 != 0 {
        return Err(bad(format!(
            "open to others (mode {:o}); chmod 600 it",
            meta.mode() & 0o7777
        )));
    }
    let mut text = Vec::new();
    file.take(130).read_to_end(&mut text)?;
    let digits = text.strip_suffix(b"\n").unwrap_or(&text);
    let mut key = [0u8; 32];
    hex::decode_to_slice(digits, &mut key)
        .map_err(|_| bad("not 64 hex digits (a seal key of ringmux's)".into()))?;
    Ok(key)
}

/// Makes `seal.key` whole: written to a temporary file, then linked into place (`link(2)`
/// fails if another node made it meanwhile: that one is read and used).
fn make_key(root: &Path, path: &Path) -> io::Result<[u8; 32]> {
    let mut key = [0u8; 32];
    getrandom::fill(&mut key).map_err(|e| io::Error::other(e.to_string()))?;
    let mut rand = [0u8; 6];
    getrandom::fill(&mut rand).map_err(|e| io::Error::other(e.to_string()))?;
    let tmp = root.join(format!(
        ".{KEY_FILE}.{}-{}.tmp",
        std::process::id(),
        hex::encode(rand)
    ));
    let linked = (|| {
        let mut f = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_CLOEXEC | libc::O_NOFOLLOW)
            .open(&tmp)?;
        f.write_all(format!("{}\n", hex::encode(key)).as_bytes())?;
        f.sync_all()?;
        std::fs::hard_link(&tmp, path)
    })();
    let _ = std::fs::remove_file(&tmp);
    match linked {
        Ok(()) => {
            if let Ok(d) = std::fs::File::open(root) {
                let _ = d.sync_all();
            }
            Ok(key)
        }
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => read_key(path),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn a_sealed_file_opens_at_its_place_only() {
        let s = Sealer::fixed(b"k");
        let sealed = s.seal("certs/a.test/cert.pem", b"PEM\n");
        assert_eq!(sealed.len(), 4 + TRAILER_LEN);
        assert_eq!(s.open("certs/a.test/cert.pem", &sealed), Ok(&b"PEM\n"[..]));
        // Another place, another key, a changed byte anywhere, no trailer: refused.
        assert_eq!(
            s.open("certs/b.test/cert.pem", &sealed),
            Err(Unsealed::Forged)
        );
        assert_eq!(
            Sealer::fixed(b"other").open("certs/a.test/cert.pem", &sealed),
            Err(Unsealed::Forged)
        );
        for i in 0..sealed.len() {
            let mut bad = sealed.clone();
            bad[i] ^= 0x01;
            assert!(s.open("certs/a.test/cert.pem", &bad).is_err(), "byte {i}");
        }
        assert_eq!(
            s.open("certs/a.test/cert.pem", b"PEM\n"),
            Err(Unsealed::Missing)
        );
        assert_eq!(s.open("x", b""), Err(Unsealed::Missing));
        // Content that happens to end like a trailer of the wrong digits is forged.
        let mut fake = b"x".to_vec();
        fake.extend_from_slice(TAG);
        fake.extend_from_slice(&[b'0'; 64]);
        fake.push(b'\n');
        assert_eq!(s.open("x", &fake), Err(Unsealed::Forged));
    }

    #[test]
    fn keys_from_one_key_file_agree_and_differ_from_another() {
        let key = |k: ringmux_quic_lb::KeySet| KeyFileSecret::new("/k".into(), k.to_bytes());
        let a = key(ringmux_quic_lb::KeySet::generate().unwrap());
        let b = key(ringmux_quic_lb::KeySet::generate().unwrap());
        let sealed = Sealer::from_key_file(&a).seal("x", b"y");
        assert!(Sealer::from_key_file(&a).open("x", &sealed).is_ok());
        assert!(Sealer::from_key_file(&b).open("x", &sealed).is_err());
    }

    #[test]
    fn the_state_key_is_made_once_closed_and_read_back() {
        let tmp = tempfile::tempdir().unwrap();
        let one = Sealer::in_state_dir(tmp.path()).unwrap();
        let path = tmp.path().join(KEY_FILE);
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let sealed = one.seal("x", b"y");
        let two = Sealer::in_state_dir(tmp.path()).unwrap();
        assert!(two.open("x", &sealed).is_ok());
        // No temporary file is left.
        assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 1);
        // Open to others, not hex, or a link: refused with the path.
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = Sealer::in_state_dir(tmp.path()).unwrap_err().to_string();
        assert!(e.contains("seal.key") && e.contains("644"), "{e}");
        std::fs::remove_file(&path).unwrap();
        std::fs::write(&path, b"zz").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert!(Sealer::in_state_dir(tmp.path()).is_err());
        std::fs::remove_file(&path).unwrap();
        std::os::unix::fs::symlink("/dev/zero", &path).unwrap();
        assert!(Sealer::in_state_dir(tmp.path()).is_err());
    }
}
