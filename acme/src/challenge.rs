//! A pending challenge as the state directory holds it (`challenges/TOKEN.json`), written by
//! the node that orders, read by every node; and the answer the workers give from it: the key
//! authorization for HTTP-01 (RFC 8555 §8.3), a self-signed certificate carrying its SHA-256
//! for TLS-ALPN-01 (RFC 8737 §3).
//!
//! The file holds the key authorization only, never a private key: each node makes its own
//! TLS-ALPN-01 certificate from it (any certificate with the right name and extension passes).

use std::time::SystemTime;

use ringmux_proto::{Http01, TlsAlpn01};
use serde::{Deserialize, Serialize};

use super::store::{is_token, unix_secs};
use super::ChallengeKind;

/// `challenges/TOKEN.json`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChallengeFile {
    pub kind: Kind,
    /// The name under validation, lower case.
    pub name: String,
    pub token: String,
    pub key_authorization: String,
    /// Seconds since the Unix epoch after which the file is stale: the node that wrote it
    /// died before its order ended (a live one removes its files).
    pub expires: u64,
}

/// A challenge type, as the file names it (RFC 8555's names).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Kind {
    #[serde(rename = "http-01")]
    Http01,
    #[serde(rename = "tls-alpn-01")]
    TlsAlpn01,
}

impl From<ChallengeKind> for Kind {
    fn from(k: ChallengeKind) -> Kind {
        match k {
            ChallengeKind::Http01 => Kind::Http01,
            ChallengeKind::TlsAlpn01 => Kind::TlsAlpn01,
        }
    }
}

/// What the workers answer a challenge with.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Answer {
    Http01(Http01),
    TlsAlpn01(TlsAlpn01),
}

/// Why a challenge file is not answered.
#[derive(Debug, thiserror::Error)]
pub enum ChallengeError {
    #[error("cannot read it")]
    Read(#[source] std::io::Error),
    #[error("not a challenge")]
    NotJson(#[source] serde_json::Error),
    #[error("its token is not its name")]
    TokenNotName,
    #[error("{0:?} is not a DNS name")]
    NotDnsName(String),
    #[error("its key authorization is not TOKEN.THUMBPRINT")]
    KeyAuthorization,
    #[error("stale: its order ended long ago")]
    Stale,
    #[error("cannot make the TLS-ALPN-01 certificate")]
    TlsAlpn01(#[source] rcgen::Error),
}

impl ChallengeFile {
    /// Reads the file of `token` (its name); `Err` says what is wrong, including staleness.
    pub fn parse(
        token: &str,
        bytes: &[u8],
        now: SystemTime,
    ) -> Result<ChallengeFile, ChallengeError> {
        let file: ChallengeFile = serde_json::from_slice(bytes).map_err(ChallengeError::NotJson)?;
        if file.token != token || !is_token(&file.token) {
            return Err(ChallengeError::TokenNotName);
        }
        if !is_dns_name(&file.name) {
            return Err(ChallengeError::NotDnsName(truncated(&file.name)));
        }
        let ka = &file.key_authorization;
        let well_formed = ka.len() <= 512
            && ka
                .strip_prefix(&file.token)
                .and_then(|rest| rest.strip_prefix('.'))
                .is_some_and(is_token);
        if !well_formed {
            return Err(ChallengeError::KeyAuthorization);
        }
        if file.expires <= unix_secs(now) {
            return Err(ChallengeError::Stale);
        }
        Ok(file)
    }

    pub fn to_json(&self) -> Vec<u8> {
        // A struct of strings and integers always serializes.
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// The answer the workers give; a TLS-ALPN-01 certificate is made here (fresh key).
    pub fn answer(&self) -> Result<Answer, ChallengeError> {
        Ok(match self.kind {
            Kind::Http01 => Answer::Http01(Http01 {
                name: self.name.clone(),
                token: self.token.clone(),
                key_authorization: self.key_authorization.clone(),
            }),
            Kind::TlsAlpn01 => Answer::TlsAlpn01(
                tls_alpn01(&self.name, &self.key_authorization)
                    .map_err(ChallengeError::TlsAlpn01)?,
            ),
        })
    }
}

/// The TLS-ALPN-01 certificate of RFC 8737 §3: self-signed, for `name` only, with the critical
/// `acmeIdentifier` extension holding the SHA-256 of the key authorization; ECDSA P-256.
pub fn tls_alpn01(name: &str, key_authorization: &str) -> Result<TlsAlpn01, rcgen::Error> {
    let digest = ring::digest::digest(&ring::digest::SHA256, key_authorization.as_bytes());
    let mut params = rcgen::CertificateParams::new(vec![name.to_owned()])?;
    params.distinguished_name = rcgen::DistinguishedName::new();
    params
        .custom_extensions
        .push(rcgen::CustomExtension::new_acme_identifier(digest.as_ref()));
    let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)?;
    let cert = params.self_signed(&key)?;
    Ok(TlsAlpn01 {
        name: name.to_owned(),
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
    })
}

/// A lower-case DNS name of letters, digits, hyphens and dots (what an ACME site may have:
/// the configuration refuses wildcards for ACME).
fn is_dns_name(name: &str) -> bool {
    (1..=253).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
}

fn truncated(s: &str) -> String {
    s.chars().take(64).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn file(kind: Kind) -> ChallengeFile {
        ChallengeFile {
            kind,
            name: "a.test".into(),
            token: "tok-1_x".into(),
            key_authorization: "tok-1_x.thumb_print".into(),
            expires: unix_secs(SystemTime::now()) + 600,
        }
    }

    #[test]
    fn files_round_trip_and_answer() {
        let now = SystemTime::now();
        let f = file(Kind::Http01);
        let back = ChallengeFile::parse("tok-1_x", &f.to_json(), now).unwrap();
        assert_eq!(back, f);
        let json = String::from_utf8(f.to_json()).unwrap();
        assert!(json.contains("\"http-01\""), "{json}");
        assert_eq!(
            f.answer().unwrap(),
            Answer::Http01(Http01 {
                name: "a.test".into(),
                token: "tok-1_x".into(),
                key_authorization: "tok-1_x.thumb_print".into(),
            })
        );
    }

    #[test]
    fn the_tls_alpn01_certificate_carries_the_digest_critically() {
        use x509_parser::prelude::*;
        let Answer::TlsAlpn01(t) = file(Kind::TlsAlpn01).answer().unwrap() else {
            panic!("not TLS-ALPN-01");
        };
        assert_eq!(t.name, "a.test");
        let (chain, _key) = ringmux_proto::certs::parse_pem(&t.cert_pem, &t.key_pem).unwrap();
        let (_, cert) = X509Certificate::from_der(chain[0].as_ref()).unwrap();
        // id-pe-acmeIdentifier, 1.3.6.1.5.5.7.1.31 (RFC 8737 §6.1).
        let oid = x509_parser::oid_registry::Oid::from(&[1, 3, 6, 1, 5, 5, 7, 1, 31]).unwrap();
        let ext = cert
            .extensions()
            .iter()
            .find(|e| e.oid == oid)
            .expect("acmeIdentifier");
        assert!(ext.critical);
        let digest = ring::digest::digest(&ring::digest::SHA256, b"tok-1_x.thumb_print");
        // An OCTET STRING of 32 bytes.
        assert_eq!(&ext.value[..2], &[0x04, 0x20]);
        assert_eq!(&ext.value[2..], digest.as_ref());
        let san = cert.subject_alternative_name().unwrap().unwrap();
        assert_eq!(san.value.general_names, [GeneralName::DNSName("a.test")]);
    }

    proptest::proptest! {
        /// Whatever another node (or anyone able to write the directory) put in a file, reading
        /// it does not panic.
        #[test]
        fn any_bytes_are_read_without_panicking(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..512)) {
            let _ = ChallengeFile::parse("tok", &bytes, SystemTime::now());
        }
    }

    #[test]
    fn bad_or_stale_files_are_refused() {
        let now = SystemTime::now();
        let good = file(Kind::Http01);
        let cases: Vec<(&str, Vec<u8>)> = vec![
            ("tok-1_x", b"".to_vec()),
            ("tok-1_x", b"{\"kind\":\"dns-01\"}".to_vec()),
            ("other", good.to_json()),
            (
                "tok-1_x",
                ChallengeFile {
                    name: "../etc".into(),
                    ..good.clone()
                }
                .to_json(),
            ),
            (
                "tok-1_x",
                ChallengeFile {
                    name: "A.test".into(),
                    ..good.clone()
                }
                .to_json(),
            ),
            (
                "tok-1_x",
                ChallengeFile {
                    key_authorization: "other.thumb".into(),
                    ..good.clone()
                }
                .to_json(),
            ),
            (
                "tok-1_x",
                ChallengeFile {
                    key_authorization: "tok-1_x.".into(),
                    ..good.clone()
                }
                .to_json(),
            ),
            (
                "tok-1_x",
                ChallengeFile {
                    expires: unix_secs(now - Duration::from_secs(1)),
                    ..good.clone()
                }
                .to_json(),
            ),
        ];
        for (token, bytes) in cases {
            assert!(
                ChallengeFile::parse(token, &bytes, now).is_err(),
                "{}",
                String::from_utf8_lossy(&bytes)
            );
        }
    }
}
