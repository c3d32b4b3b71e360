//! A leaf certificate read for what the demux checks and the ACME client renews by: its DNS
//! names and its validity. The demux's configuration checks, its metrics and the ACME client
//! read leaves alike through this module.

use std::time::SystemTime;

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

/// A certificate that is not X.509 DER.
#[derive(Debug, thiserror::Error)]
#[error("not X.509: {0}")]
pub struct LeafError(String);

/// Reads a leaf certificate's names and validity.
pub fn leaf(der: &[u8]) -> Result<Leaf, LeafError> {
    use x509_parser::prelude::*;
    let (_, cert) = X509Certificate::from_der(der).map_err(|e| LeafError(e.to_string()))?;
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

    #[test]
    fn a_self_signed_leaf_reads_its_names_and_garbage_is_refused() {
        let pem = crate::certs::CertPem::self_signed().unwrap();
        let (chain, _) = pem.parse().unwrap();
        let leaf = leaf(&chain[0]).unwrap();
        assert!(
            leaf.names.iter().any(|n| n == "localhost"),
            "{:?}",
            leaf.names
        );
        assert!(leaf.not_before < leaf.not_after);
        let e = super::leaf(b"not a certificate").err().unwrap().to_string();
        assert!(e.starts_with("not X.509"), "{e}");
    }
}
