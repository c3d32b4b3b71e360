//! The certificate the workers serve: loaded from the operator's PEM files and checked at start
//! and at every reload (so a bad file is refused by the demux, naming it, rather than by every
//! worker), or a fresh self-signed one for local use. Workers receive the PEM text in the
//! hand-off. The reading, checking and making are `ringmux_proto::certs`, which the worker
//! library reads the hand-off's text with too. [`leaf`] and [`covers`] read a leaf certificate's
//! names and validity, for the configuration's checks, the ACME engine and the metrics.

pub use ringmux_proto::certs::{CertError, CertPem, SELF_SIGNED_NAMES};

use std::path::Path;
use std::time::SystemTime;

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

/// What the leaf certificate says of itself.
pub struct Leaf {
    /// Its DNS names (subject alternative names), lower case.
    pub names: Vec<String>,
    pub not_before: SystemTime,
    pub not_after: SystemTime,
    /// The two as the certificate writes them (UTC).
    pub not_before_text: String,
    pub not_after_text: String,
}

/// Reads a leaf certificate's names and validity.
pub fn leaf(der: &[u8]) -> Result<Leaf, String> {
    use x509_parser::prelude::*;
    let (_, cert) = X509Certificate::from_der(der).map_err(|e| format!("not X.509: {e}"))?;
    let mut names = Vec::new();
    if let Ok(Some(san)) = cert.subject_alternative_name() {
        for n in &san.value.general_names {
            if let GeneralName::DNSName(d) = n {
                names.push(d.to_ascii_lowercase());
            }
        }
    }
    let time = |t: ASN1Time| {
        let secs = t.timestamp();
        match u64::try_from(secs) {
            Ok(s) => SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(s),
            Err(_) => SystemTime::UNIX_EPOCH,
        }
    };
    let v = cert.validity();
    Ok(Leaf {
        names,
        not_before: time(v.not_before),
        not_after: time(v.not_after),
        not_before_text: v.not_before.to_string(),
        not_after_text: v.not_after.to_string(),
    })
}

/// Whether a certificate for `sans` covers the site name `name`: the same name, or a wildcard
/// of the certificate covering it (one label); a site's wildcard needs the same wildcard.
pub fn covers(sans: &[String], name: &str) -> bool {
    sans.iter().any(|san| {
        san == name
            || (!name.starts_with("*.")
                && san
                    .strip_prefix("*.")
                    .is_some_and(|parent| name.split_once('.').is_some_and(|(_, p)| p == parent)))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_certificate_covers_its_names_and_its_wildcards_one_label() {
        let sans = vec!["a.test".to_string(), "*.w.test".to_string()];
        assert!(covers(&sans, "a.test"));
        assert!(covers(&sans, "x.w.test"));
        assert!(covers(&sans, "*.w.test"));
        assert!(!covers(&sans, "w.test"));
        assert!(!covers(&sans, "x.y.w.test"));
        assert!(!covers(&sans, "b.test"));
        assert!(!covers(&["x.w.test".to_string()], "*.w.test"));
    }
}
