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
