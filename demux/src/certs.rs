//! The certificate the workers serve: loaded from the operator's PEM files and checked at start
//! (so a bad file is refused by the demux, naming it, rather than by every worker), or a fresh
//! self-signed one for local use. Workers receive the PEM text in the hand-off.

use std::path::Path;

use anyhow::{bail, Context, Result};

/// Subject alternative names of the self-signed certificate.
pub const SELF_SIGNED_NAMES: [&str; 3] = ["localhost", "127.0.0.1", "::1"];

/// PEM text of a certificate chain (leaf first) and of its private key.
#[derive(Clone)]
pub struct CertPem {
    pub chain: String,
    pub key: String,
}

impl std::fmt::Debug for CertPem {
    // Never print key material.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CertPem").finish_non_exhaustive()
    }
}

impl CertPem {
    /// Reads and checks a PEM chain (at least one `CERTIFICATE`) and a PEM private key
    /// (PKCS#8, PKCS#1 or SEC1).
    pub fn load(cert: &Path, key: &Path) -> Result<Self> {
        let read = |what: &str, flag: &str, path: &Path| {
            std::fs::read_to_string(path)
                .with_context(|| format!("{flag}: cannot read the {what} file {}", path.display()))
        };
        let chain = read("certificate", "--cert / RINGMUX_CERT", cert)?;
        let key_pem = read("private key", "--key / RINGMUX_KEY", key)?;
        let certs = rustls_pemfile::certs(&mut chain.as_bytes())
            .collect::<Result<Vec<_>, _>>()
            .with_context(|| {
                format!("--cert / RINGMUX_CERT: {} is not valid PEM", cert.display())
            })?;
        if certs.is_empty() {
            bail!(
                "--cert / RINGMUX_CERT: {} holds no CERTIFICATE block",
                cert.display()
            );
        }
        let found = rustls_pemfile::private_key(&mut key_pem.as_bytes())
            .with_context(|| format!("--key / RINGMUX_KEY: {} is not valid PEM", key.display()))?;
        if found.is_none() {
            bail!(
                "--key / RINGMUX_KEY: {} holds no PRIVATE KEY, RSA PRIVATE KEY or EC PRIVATE KEY block",
                key.display()
            );
        }
        Ok(CertPem {
            chain,
            key: key_pem,
        })
    }

    /// A fresh self-signed certificate for [`SELF_SIGNED_NAMES`] (ECDSA P-256).
    pub fn self_signed() -> Result<Self> {
        let names: Vec<String> = SELF_SIGNED_NAMES.iter().map(|s| s.to_string()).collect();
        let ck = rcgen::generate_simple_self_signed(names)
            .context("making a self-signed certificate")?;
        Ok(CertPem {
            chain: ck.cert.pem(),
            key: ck.signing_key.serialize_pem(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn self_signed_round_trips_through_files() {
        let made = CertPem::self_signed().unwrap();
        let dir = std::env::temp_dir().join(format!("ringmux-certs-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (c, k) = (dir.join("cert.pem"), dir.join("key.pem"));
        std::fs::write(&c, &made.chain).unwrap();
        std::fs::write(&k, &made.key).unwrap();
        let loaded = CertPem::load(&c, &k).unwrap();
        assert_eq!(loaded.chain, made.chain);
        // A key where the certificate should be, and the other way round, are refused by name.
        let e = CertPem::load(&k, &k).unwrap_err().to_string();
        assert!(e.contains("--cert") && e.contains("no CERTIFICATE"), "{e}");
        let e = CertPem::load(&c, &c).unwrap_err().to_string();
        assert!(e.contains("--key") && e.contains("no PRIVATE KEY"), "{e}");
        let e = CertPem::load(&dir.join("missing.pem"), &k)
            .unwrap_err()
            .to_string();
        assert!(e.contains("missing.pem"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
