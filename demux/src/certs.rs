//! The certificate the workers serve: loaded from the operator's PEM files and checked at start
//! and at every reload (so a bad file is refused by the demux, naming it, rather than by every
//! worker), or a fresh self-signed one for local use. Workers receive the PEM text in the
//! hand-off. The reading, checking and making are `ringmux_proto::certs`, which the worker
//! library reads the hand-off's text with too. [`leaf`] and [`covers`] read a leaf certificate's
//! names and validity, for the configuration's checks, the ACME engine and the metrics.

pub use ringmux_proto::certs::{CertError, CertPem, SELF_SIGNED_NAMES};
pub use ringmux_proto::x509::{covers, leaf, Leaf, LeafError};

use std::path::Path;

use ringmux_quic_lb::{KeyFileError, KeySet};

/// Reads and checks an operator's certificate chain and key ([`CertPem::load`]), each only if
/// it is a regular file of at most [`crate::sys::MAX_PEM_FILE`] bytes: a FIFO, a device or a
/// huge file is refused at once, naming the file.
pub fn load(cert: &Path, key: &Path) -> Result<CertPem, CertError> {
    CertPem::load_with(cert, key, |path| {
        crate::sys::read_operator_text(path, crate::sys::MAX_PEM_FILE)
    })
}

/// Reads the deployment's key file (`key_file`): a regular file of at most
/// [`crate::sys::MAX_PEM_FILE`] bytes, closed to group and others ([`KeySet::from_file`]).
pub fn load_key_file(path: &Path) -> Result<KeySet, KeyFileError> {
    let io = |error| KeyFileError::Io {
        path: path.to_owned(),
        error,
    };
    let file = crate::sys::read_operator_file(path, crate::sys::MAX_PEM_FILE).map_err(io)?;
    let text = String::from_utf8(file.bytes).map_err(|_| {
        io(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "not UTF-8 text",
        ))
    })?;
    use std::os::unix::fs::PermissionsExt;
    KeySet::from_file(path, &text, file.metadata.permissions().mode())
}

/// Why the certificates a TLS upstream is verified against cannot be had. The messages leave
/// the key and file to the reader, which names them.
#[derive(Debug, thiserror::Error)]
pub enum TrustError {
    #[error("cannot read it: {0}")]
    Read(std::io::Error),
    #[error("not PEM certificates: {0}")]
    Pem(rustls::pki_types::pem::Error),
    #[error("no CERTIFICATE in it; give a PEM file of the certificates to trust")]
    Empty,
    #[error("certificate {index} (from 0) cannot be a trust anchor: {error}")]
    Anchor { index: usize, error: rustls::Error },
    #[error(
        "no system root certificates found ({0}); give the route upstream_ca = \"FILE\", or \
         install the distribution's CA bundle (or set SSL_CERT_FILE)"
    )]
    NoSystemRoots(String),
}

/// `upstream_ca`: the PEM text of `path`, a regular file of at most
/// [`crate::sys::MAX_PEM_FILE`] bytes holding one or more certificates, each usable as a
/// trust anchor. The workers get the text in the site table: they read no file for it.
pub fn load_upstream_ca(path: &Path) -> Result<String, TrustError> {
    let text =
        crate::sys::read_operator_text(path, crate::sys::MAX_PEM_FILE).map_err(TrustError::Read)?;
    anchors(text.as_bytes())?;
    Ok(text)
}

/// The system's root certificates ([`ringmux_acme::system_roots`]: `SSL_CERT_FILE`,
/// `SSL_CERT_DIR`, else the distribution's bundle), as PEM text: what a TLS upstream without
/// `upstream_ca` is verified against. Read by the demux and handed over, since a confined
/// worker may not read `/etc/ssl`.
pub fn system_roots_pem() -> Result<String, TrustError> {
    use base64::Engine as _;
    let (found, error) = ringmux_acme::system_roots();
    let mut roots = rustls::RootCertStore::empty();
    let mut pem = String::new();
    for der in found {
        // Only the certificates rustls can use as anchors (a bundle may hold others).
        if roots.add(der.clone()).is_err() {
            continue;
        }
        let b64 = base64::engine::general_purpose::STANDARD.encode(der.as_ref());
        pem.push_str("-----BEGIN CERTIFICATE-----\n");
        for line in b64.as_bytes().chunks(64) {
            pem.push_str(&String::from_utf8_lossy(line));
            pem.push('\n');
        }
        pem.push_str("-----END CERTIFICATE-----\n");
    }
    if roots.is_empty() {
        let why = error.unwrap_or_else(|| "none in the system's bundle".into());
        return Err(TrustError::NoSystemRoots(why));
    }
    Ok(pem)
}

/// The certificates of PEM `text`, each checked to be a usable trust anchor.
fn anchors(text: &[u8]) -> Result<rustls::RootCertStore, TrustError> {
    use rustls::pki_types::{pem::PemObject, CertificateDer};
    let certs = CertificateDer::pem_slice_iter(text)
        .collect::<Result<Vec<_>, _>>()
        .map_err(TrustError::Pem)?;
    if certs.is_empty() {
        return Err(TrustError::Empty);
    }
    let mut roots = rustls::RootCertStore::empty();
    for (index, der) in certs.into_iter().enumerate() {
        roots
            .add(der)
            .map_err(|error| TrustError::Anchor { index, error })?;
    }
    Ok(roots)
}
