//! The certificate of the hand-off (`cert_pem`, `key_pem`): PEM text read from the operator's
//! files and checked, or a fresh self-signed one for local use, and the DER a TLS library takes
//! from it. The demux checks the files at start and hands the text on; the worker library reads
//! the same text with the same reader, so what the demux accepts every worker can use.
//!
//! Behind the `certs` feature (rcgen and rustls' PEM reader), which the demux and the worker
//! library turn on. Bytes and files only: no TLS configuration is built here.

use std::fmt;
use std::path::{Path, PathBuf};

use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

/// Subject alternative names of [`CertPem::self_signed`].
pub const SELF_SIGNED_NAMES: [&str; 3] = ["localhost", "127.0.0.1", "::1"];

/// A certificate that cannot be read, parsed or made.
#[derive(Debug, thiserror::Error)]
pub enum CertError {
    /// A PEM file could not be read.
    #[error("cannot read the {what} file {}: {error}", path.display())]
    Read {
        what: &'static str,
        path: PathBuf,
        /// The OS error (in the message, so not the error's `source`).
        error: std::io::Error,
    },
    /// PEM text does not hold what it should.
    #[error("{origin}: {problem}")]
    Pem { origin: String, problem: String },
    /// rcgen could not make the self-signed certificate (its error is in the message, so not
    /// the error's `source`).
    #[error("cannot make a self-signed certificate: {0}")]
    SelfSigned(rcgen::Error),
}

impl From<rcgen::Error> for CertError {
    fn from(e: rcgen::Error) -> Self {
        CertError::SelfSigned(e)
    }
}

/// PEM text of a certificate chain (leaf first) and of its private key (PKCS#8, PKCS#1 or
/// SEC1), as the hand-off carries them.
#[derive(Clone, PartialEq, Eq)]
pub struct CertPem {
    pub chain: String,
    pub key: String,
}

impl fmt::Debug for CertPem {
    // Never print key material.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CertPem").finish_non_exhaustive()
    }
}

/// A certificate chain (leaf first) and its private key, parsed.
pub type CertDer = (Vec<CertificateDer<'static>>, PrivateKeyDer<'static>);

impl CertPem {
    /// Reads a PEM chain and a PEM private key, each checked to hold what it should; an error
    /// names the file.
    pub fn load(cert: &Path, key: &Path) -> Result<Self, CertError> {
        Self::load_with(cert, key, |path| std::fs::read_to_string(path))
    }

    /// [`CertPem::load`], reading each file with `read` (the demux reads only regular files of
    /// bounded size).
    pub fn load_with(
        cert: &Path,
        key: &Path,
        read: impl Fn(&Path) -> std::io::Result<String>,
    ) -> Result<Self, CertError> {
        let read = |what, path: &Path| {
            read(path).map_err(|error| CertError::Read {
                what,
                path: path.to_owned(),
                error,
            })
        };
        let pem = CertPem {
            chain: read("certificate", cert)?,
            key: read("private key", key)?,
        };
        parse_certs(
            &pem.chain,
            &format!("the certificate file {}", cert.display()),
        )?;
        parse_key(&pem.key, &format!("the private key file {}", key.display()))?;
        Ok(pem)
    }

    /// A fresh self-signed certificate for [`SELF_SIGNED_NAMES`] (ECDSA P-256).
    pub fn self_signed() -> Result<Self, CertError> {
        let names: Vec<String> = SELF_SIGNED_NAMES.iter().map(|s| s.to_string()).collect();
        let ck = rcgen::generate_simple_self_signed(names)?;
        Ok(CertPem {
            chain: ck.cert.pem(),
            key: ck.signing_key.serialize_pem(),
        })
    }

    /// The chain and the key in DER, as rustls takes them.
    pub fn parse(&self) -> Result<CertDer, CertError> {
        parse_pem(&self.chain, &self.key)
    }
}

/// PEM text of a chain (leaf first) and of its key, in DER, as rustls takes them.
pub fn parse_pem(chain: &str, key: &str) -> Result<CertDer, CertError> {
    Ok((
        parse_certs(chain, "the certificate PEM")?,
        parse_key(key, "the private key PEM")?,
    ))
}

fn parse_certs(pem: &str, origin: &str) -> Result<Vec<CertificateDer<'static>>, CertError> {
    let bad = |problem: String| CertError::Pem {
        origin: origin.to_string(),
        problem,
    };
    let certs = CertificateDer::pem_slice_iter(pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| bad(format!("malformed PEM: {e}")))?;
    if certs.is_empty() {
        return Err(bad("no CERTIFICATE block found".into()));
    }
    Ok(certs)
}

fn parse_key(pem: &str, origin: &str) -> Result<PrivateKeyDer<'static>, CertError> {
    PrivateKeyDer::from_pem_slice(pem.as_bytes()).map_err(|e| CertError::Pem {
        origin: origin.to_string(),
        problem: match e {
            rustls_pki_types::pem::Error::NoItemsFound => {
                "no PRIVATE KEY, RSA PRIVATE KEY or EC PRIVATE KEY block found".into()
            }
            e => format!("malformed PEM: {e}"),
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn self_signed_parses_and_round_trips_through_files() {
        let made = CertPem::self_signed().unwrap();
        let (certs, key) = made.parse().unwrap();
        assert_eq!(certs.len(), 1);
        assert!(matches!(key, PrivateKeyDer::Pkcs8(_)));

        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        let (c, k) = (dir.join("cert.pem"), dir.join("key.pem"));
        std::fs::write(&c, &made.chain).unwrap();
        std::fs::write(&k, &made.key).unwrap();
        let loaded = CertPem::load(&c, &k);
        // A key where the certificate should be, and the other way round, are refused naming
        // the file and what is missing.
        let swapped = CertPem::load(&k, &k).unwrap_err().to_string();
        let no_key = CertPem::load(&c, &c).unwrap_err().to_string();
        let missing = CertPem::load(&dir.join("missing.pem"), &k)
            .unwrap_err()
            .to_string();
        assert_eq!(loaded.unwrap(), made);
        assert!(
            swapped.contains("certificate file") && swapped.contains("key.pem"),
            "{swapped}"
        );
        assert!(swapped.contains("no CERTIFICATE"), "{swapped}");
        assert!(
            no_key.contains("private key file") && no_key.contains("no PRIVATE KEY"),
            "{no_key}"
        );
        assert!(missing.contains("missing.pem"), "{missing}");
    }

    #[test]
    fn bad_pem_text_is_refused_naming_its_origin() {
        let e = CertPem {
            chain: String::new(),
            key: String::new(),
        }
        .parse()
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("certificate PEM") && e.contains("no CERTIFICATE"),
            "{e}"
        );
        let good = CertPem::self_signed().unwrap();
        let e = CertPem {
            key: "-----BEGIN PRIVATE KEY-----\nnot base64!\n".into(),
            ..good
        }
        .parse()
        .unwrap_err()
        .to_string();
        assert!(e.contains("private key PEM"), "{e}");
    }
}
