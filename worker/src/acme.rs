//! ACME at run time: the pending challenges a worker answers ([`AcmeAnswers`], RFC 8555 §8),
//! and what it does with the demux's `CERTIFICATE` and `CHALLENGES` control messages
//! (`control-protocol.md`, "Control messages").
//!
//! The answers are for the TCP listeners only: HTTP-01 tokens on the plain-HTTP listener
//! (RFC 8555 §8.3), TLS-ALPN-01 certificates on the HTTPS one (RFC 8737 §3). They are never
//! consulted over QUIC, by construction: the QUIC configuration takes its certificates from
//! [`SiteCerts`], which knows nothing of challenges, and offers the application's ALPN only
//! (`h3`), so a QUIC ClientHello offering `acme-tls/1` alone fails with
//! `no_application_protocol`, and one offering it beside `h3` gets the site's certificate.
//!
//! This module answers no request and owns no socket: the listeners ask it.

use std::borrow::Cow;
use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, PoisonError, RwLock};

use ringmux_proto::message::{ChallengeSet, SiteCertificate, ACME_TLS_ALPN};
use rustls::server::{NoServerSessionStorage, ResolvesServerCert};
use rustls::sign::CertifiedKey;

use crate::tls::{self, CertSource, SiteCerts, TlsError};

/// The ACME challenges pending now, as the demux's last `CHALLENGES` set them: each
/// [`AcmeAnswers::replace`] swaps the whole set at once. Cheap to clone; every clone sees
/// the same set. Empty until the first set.
#[derive(Clone, Default)]
pub struct AcmeAnswers {
    current: Arc<RwLock<Arc<Answers>>>,
}

/// One set of answers, never changed once made: a reader holds it while it looks up.
#[derive(Default)]
struct Answers {
    /// The `seq` of the `CHALLENGES` it came from; `None` before the first.
    seq: Option<u64>,
    /// HTTP-01: the key authorization of each token.
    http01: HashMap<String, String>,
    /// TLS-ALPN-01: by the name under validation, lower case.
    tls_alpn01: HashMap<String, TlsAlpnAnswer>,
}

/// A TLS-ALPN-01 challenge's certificate, and the TLS configuration that presents it.
struct TlsAlpnAnswer {
    key: Arc<CertifiedKey>,
    config: Arc<rustls::ServerConfig>,
}

/// Why [`AcmeAnswers::replace`] refused a set; the set before stays in use.
#[derive(Debug, thiserror::Error)]
#[error("the TLS-ALPN-01 certificate for {name}: {error}")]
pub struct ChallengeError {
    /// The name whose entry was refused.
    pub name: String,
    /// Why (in the message, so not the error's `source`).
    pub error: TlsError,
}

impl fmt::Debug for AcmeAnswers {
    // Never print key authorizations or keys.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let answers = self.snapshot();
        f.debug_struct("AcmeAnswers")
            .field("seq", &answers.seq)
            .field("http01", &answers.http01.len())
            .field("tls_alpn01", &answers.tls_alpn01.len())
            .finish()
    }
}

impl AcmeAnswers {
    /// No challenge pending.
    pub fn new() -> AcmeAnswers {
        AcmeAnswers::default()
    }

    /// Makes `set` the challenges answered from now on, in place of the set before, whole:
    /// every TLS-ALPN-01 certificate is parsed and its key checked first, and when one is
    /// refused, so is the set (the set before stays in use), so that a set in use is always
    /// the one a `seq` names.
    pub fn replace(&self, set: &ChallengeSet) -> Result<(), ChallengeError> {
        let mut tls_alpn01 = HashMap::with_capacity(set.tls_alpn01.len());
        for c in &set.tls_alpn01 {
            let refused = |error| ChallengeError {
                name: c.name.clone(),
                error,
            };
            let key = Arc::new(challenge_key(&c.cert_pem, &c.key_pem).map_err(refused)?);
            let config = Arc::new(tls_alpn01_config(key.clone()).map_err(refused)?);
            tls_alpn01.insert(c.name.to_ascii_lowercase(), TlsAlpnAnswer { key, config });
        }
        let http01 = set
            .http01
            .iter()
            .map(|c| (c.token.clone(), c.key_authorization.clone()))
            .collect();
        let answers = Arc::new(Answers {
            seq: Some(set.seq),
            http01,
            tls_alpn01,
        });
        *self.current.write().unwrap_or_else(PoisonError::into_inner) = answers;
        Ok(())
    }

    /// The `seq` of the set in use; `None` before the first.
    pub fn seq(&self) -> Option<u64> {
        self.snapshot().seq
    }

    /// HTTP-01: the key authorization that answers `GET /.well-known/acme-challenge/TOKEN`
    /// for a pending `token` (compared exactly).
    pub fn http01(&self, token: &str) -> Option<String> {
        self.snapshot().http01.get(token).cloned()
    }

    /// TLS-ALPN-01: the certificate a handshake for `name` offering only `acme-tls/1` gets
    /// (RFC 8737 §3), for a pending `name` (compared without regard to ASCII case).
    pub fn tls_alpn01(&self, name: &str) -> Option<Arc<CertifiedKey>> {
        let answers = self.snapshot();
        answers.tls_alpn01.get(&*lower(name)).map(|a| a.key.clone())
    }

    /// TLS-ALPN-01: the TLS configuration that presents [`AcmeAnswers::tls_alpn01`]'s
    /// certificate for `name`: its only ALPN `acme-tls/1` (RFC 8737 §6.2), TLS 1.3 and 1.2
    /// (RFC 8737 §4 asks for 1.2 or later), the ring provider, no session resumption (a
    /// resumed handshake would present no certificate) and no tickets. For TCP only.
    pub fn tls_alpn01_config(&self, name: &str) -> Option<Arc<rustls::ServerConfig>> {
        let answers = self.snapshot();
        answers
            .tls_alpn01
            .get(&*lower(name))
            .map(|a| a.config.clone())
    }

    /// The set in use, held only as long as the caller looks.
    fn snapshot(&self) -> Arc<Answers> {
        // A writer that panicked left a whole `Arc` behind: the lock guards nothing else.
        self.current
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

/// Carries out a `CERTIFICATE`: installs the certificate into the sites' shared table (QUIC
/// and TCP at once, [`SiteCerts::install`]) and logs it. Whether it is in use, so that the
/// caller answers `APPLIED`; a refused one (a site past the table, not an ACME site, a chain
/// that does not parse or a key not the leaf's) is logged and the site keeps its
/// certificate.
pub(crate) fn apply_certificate(certs: &SiteCerts, c: &SiteCertificate) -> bool {
    let site = usize::try_from(c.site).unwrap_or(usize::MAX);
    match certs.install(site, &c.cert_pem, &c.key_pem) {
        Ok(key) => {
            let leaf = key.end_entity_cert().ok();
            let parsed = leaf.and_then(|l| x509_parser::parse_x509_certificate(l).ok());
            let (serial, not_after) = match parsed {
                Some((_, cert)) => (
                    cert.raw_serial_as_string(),
                    cert.validity().not_after.to_string(),
                ),
                None => Default::default(),
            };
            tracing::info!(
                seq = c.seq,
                site = certs.label(site).unwrap_or_default(),
                serial,
                not_after,
                sha256 = leaf.map(sha256_hex).unwrap_or_default(),
                "serving a new certificate from ACME"
            );
            true
        }
        Err(e) => {
            tracing::error!(seq = c.seq, site = c.site, error = %e, "certificate refused");
            false
        }
    }
}

/// Carries out a `CHALLENGES`: replaces the pending challenges whole
/// ([`AcmeAnswers::replace`]) and logs it. Whether the set is in use (the caller answers
/// `APPLIED`); a refused one is logged and the set before stays.
pub(crate) fn apply_challenges(answers: &AcmeAnswers, set: &ChallengeSet) -> bool {
    match answers.replace(set) {
        Ok(()) => {
            tracing::info!(
                seq = set.seq,
                http01 = set.http01.len(),
                tls_alpn01 = set.tls_alpn01.len(),
                "ACME challenges in use"
            );
            tracing::debug!(
                http01 = ?set.http01.iter().map(|c| &c.name).collect::<Vec<_>>(),
                tls_alpn01 = ?set.tls_alpn01.iter().map(|c| &c.name).collect::<Vec<_>>(),
                "names under validation"
            );
            true
        }
        Err(e) => {
            tracing::error!(seq = set.seq, error = %e, "ACME challenges refused");
            false
        }
    }
}

/// A TLS-ALPN-01 certificate (PEM, leaf first) and its key, parsed, the key checked against
/// the leaf. Not by rustls' own check (`CertifiedKey::from_der`): webpki refuses to parse a
/// certificate with a critical extension it does not know, and RFC 8737 §3 makes
/// `acmeIdentifier` critical in every such certificate, so that no other client accepts it.
fn challenge_key(cert_pem: &str, key_pem: &str) -> Result<CertifiedKey, TlsError> {
    let refused = |problem: String| {
        TlsError::Cert(ringmux_proto::certs::CertError::Pem {
            origin: "the TLS-ALPN-01 certificate".into(),
            problem,
        })
    };
    let chain = tls::CertChain::from_pem(cert_pem, key_pem)?;
    let key = tls::provider().key_provider.load_private_key(chain.key)?;
    let leaf = chain
        .certs
        .first()
        .ok_or_else(|| refused("no certificate".into()))?;
    let spki = match x509_parser::parse_x509_certificate(leaf) {
        Ok((_, leaf)) => leaf.public_key().raw.to_vec(),
        Err(e) => return Err(refused(format!("unreadable: {e}"))),
    };
    // A key that cannot tell its public half is taken, as rustls takes it.
    if key.public_key().is_some_and(|k| *k != *spki) {
        return Err(refused("the key is not the certificate's".into()));
    }
    Ok(CertifiedKey::new(chain.certs, key))
}

/// The configuration of [`AcmeAnswers::tls_alpn01_config`].
fn tls_alpn01_config(key: Arc<CertifiedKey>) -> Result<rustls::ServerConfig, TlsError> {
    let versions = [&rustls::version::TLS13, &rustls::version::TLS12];
    let mut tls = tls::rustls_config(&ChallengeCert(key), &versions)?;
    tls.alpn_protocols = vec![ACME_TLS_ALPN.to_vec()];
    tls.session_storage = Arc::new(NoServerSessionStorage {});
    tls.send_tls13_tickets = 0;
    Ok(tls)
}

/// One challenge's certificate as a [`CertSource`].
struct ChallengeCert(Arc<CertifiedKey>);

impl CertSource for ChallengeCert {
    fn resolver(&self) -> Result<Arc<dyn ResolvesServerCert>, TlsError> {
        Ok(Arc::new(rustls::sign::SingleCertAndKey::from(
            self.0.clone(),
        )))
    }
}

/// `name` in lower case, copied only when it is not already.
fn lower(name: &str) -> Cow<'_, str> {
    match name.bytes().any(|b| b.is_ascii_uppercase()) {
        true => Cow::Owned(name.to_ascii_lowercase()),
        false => Cow::Borrowed(name),
    }
}

/// The SHA-256 of `der` in hex: the fingerprint `openssl x509 -fingerprint -sha256` shows.
fn sha256_hex(der: &rustls::pki_types::CertificateDer<'_>) -> String {
    use std::fmt::Write as _;
    let digest = ring::digest::digest(&ring::digest::SHA256, der);
    digest.as_ref().iter().fold(String::new(), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tls::tests::{leaf, quic_handshake, tcp_handshake};
    use crate::tls::{quic_tls_config, ALPN_H3};
    use ringmux_proto::certs::CertPem;
    use ringmux_proto::message::{Http01, TlsAlpn01};
    use ringmux_proto::sites::{Site, SiteTable};

    fn http01(token: &str, key_authorization: &str) -> Http01 {
        Http01 {
            name: "a.test".into(),
            token: token.into(),
            key_authorization: key_authorization.into(),
        }
    }

    /// A TLS-ALPN-01 certificate for `name`: self-signed, with the critical `acmeIdentifier`
    /// extension (RFC 8737 §3).
    fn challenge_pem(name: &str) -> CertPem {
        let mut params = rcgen::CertificateParams::new(vec![name.to_string()]).unwrap();
        params.custom_extensions = vec![rcgen::CustomExtension::new_acme_identifier(&[7; 32])];
        let key = rcgen::KeyPair::generate().unwrap();
        CertPem {
            chain: params.self_signed(&key).unwrap().pem(),
            key: key.serialize_pem(),
        }
    }

    fn tls_alpn01(name: &str, pem: &CertPem) -> TlsAlpn01 {
        TlsAlpn01 {
            name: name.into(),
            cert_pem: pem.chain.clone(),
            key_pem: pem.key.clone(),
        }
    }

    /// Each set replaces the one before whole; a set with a certificate that does not parse,
    /// or whose key is not its own, is refused whole and the set before stays.
    #[test]
    fn a_set_replaces_the_one_before_whole() {
        let answers = AcmeAnswers::new();
        assert_eq!((answers.seq(), answers.http01("t1")), (None, None));
        let (one, two) = (challenge_pem("a.test"), challenge_pem("b.test"));
        answers
            .replace(&ChallengeSet {
                seq: 1,
                http01: vec![http01("t1", "t1.thumb")],
                tls_alpn01: vec![tls_alpn01("A.Test", &one)],
            })
            .unwrap();
        assert_eq!(answers.http01("t1").as_deref(), Some("t1.thumb"));
        assert_eq!(answers.http01("T1"), None, "tokens compare exactly");
        let key = answers
            .tls_alpn01("a.TEST")
            .expect("names compare in any case");
        assert_eq!(key.cert[0], leaf(&one));
        assert!(answers.tls_alpn01_config("a.test").is_some());

        let clone = answers.clone();
        clone
            .replace(&ChallengeSet {
                seq: 2,
                http01: vec![http01("t2", "t2.thumb")],
                tls_alpn01: vec![tls_alpn01("b.test", &two)],
            })
            .unwrap();
        assert_eq!(answers.seq(), Some(2), "clones share the set");
        assert_eq!(answers.http01("t1"), None);
        assert_eq!(answers.http01("t2").as_deref(), Some("t2.thumb"));
        assert!(answers.tls_alpn01("a.test").is_none());
        assert_eq!(answers.tls_alpn01("b.test").unwrap().cert[0], leaf(&two));

        let mismatched = TlsAlpn01 {
            key_pem: one.key.clone(),
            ..tls_alpn01("c.test", &two)
        };
        for bad in [
            mismatched,
            tls_alpn01(
                "c.test",
                &CertPem {
                    chain: "x".into(),
                    key: "y".into(),
                },
            ),
        ] {
            let err = answers
                .replace(&ChallengeSet {
                    seq: 3,
                    http01: vec![http01("t3", "t3.thumb")],
                    tls_alpn01: vec![tls_alpn01("d.test", &one), bad],
                })
                .unwrap_err();
            assert!(err.to_string().contains("c.test"), "{err}");
            assert_eq!(answers.seq(), Some(2));
            assert_eq!(answers.http01("t3"), None);
            assert!(answers.tls_alpn01("d.test").is_none());
            assert!(answers.tls_alpn01("b.test").is_some());
        }

        answers.replace(&ChallengeSet::default()).unwrap();
        assert_eq!(answers.http01("t2"), None);
        assert!(answers.tls_alpn01("b.test").is_none());
        assert!(!format!("{answers:?}").contains("thumb"));
    }

    /// The TLS-ALPN-01 configuration presents the challenge's certificate with ALPN
    /// `acme-tls/1`, and nothing to a client that does not offer it.
    #[test]
    fn the_challenge_configuration_speaks_acme_tls_only() {
        let answers = AcmeAnswers::new();
        let pem = challenge_pem("a.test");
        answers
            .replace(&ChallengeSet {
                seq: 1,
                http01: Vec::new(),
                tls_alpn01: vec![tls_alpn01("a.test", &pem)],
            })
            .unwrap();
        let config = answers.tls_alpn01_config("a.test").unwrap();
        let (cert, alpn) = tcp_handshake(config.clone(), "a.test", &[ACME_TLS_ALPN]).unwrap();
        assert_eq!(cert, leaf(&pem));
        assert_eq!(alpn.as_deref(), Some(ACME_TLS_ALPN));
        assert!(tcp_handshake(config, "a.test", &[b"h2"]).is_err());
    }

    /// QUIC never answers a challenge: with one pending for the name, a QUIC handshake
    /// offering `acme-tls/1` alone fails, and one offering it beside `h3` gets the site's
    /// certificate with `h3`, never the challenge's.
    #[test]
    fn quic_never_presents_a_challenge_certificate() {
        let (site_pem, challenge) = (CertPem::self_signed().unwrap(), challenge_pem("a.test"));
        let table = SiteTable {
            sites: vec![Site {
                label: "a.test".into(),
                names: vec!["a.test".into()],
                cert_pem: String::new(),
                key_pem: String::new(),
                acme: true,
                redirect_names: Vec::new(),
                compress: None,
                rules: Default::default(),
                routes: Vec::new(),
                limits: Default::default(),
            }],
            default_site: None,
        };
        let certs = SiteCerts::new(&table).unwrap();
        let answers = AcmeAnswers::new();
        answers
            .replace(&ChallengeSet {
                seq: 1,
                http01: Vec::new(),
                tls_alpn01: vec![tls_alpn01("a.test", &challenge)],
            })
            .unwrap();
        let quic = Arc::new(quic_tls_config(&certs, &[ALPN_H3]).unwrap());
        // Before the site's first certificate, and after it.
        assert!(quic_handshake(quic.clone(), "a.test", &[ACME_TLS_ALPN]).is_err());
        certs.install(0, &site_pem.chain, &site_pem.key).unwrap();
        let refused = quic_handshake(quic.clone(), "a.test", &[ACME_TLS_ALPN]);
        assert!(
            matches!(refused, Err(rustls::Error::NoApplicationProtocol)),
            "{refused:?}"
        );
        let (cert, alpn) = quic_handshake(quic, "a.test", &[ACME_TLS_ALPN, ALPN_H3]).unwrap();
        assert_eq!((cert, alpn.as_deref()), (leaf(&site_pem), Some(ALPN_H3)));
    }

    /// What the control task does with `CERTIFICATE` and `CHALLENGES`: whatever arrives, it
    /// answers `APPLIED` only for what is in use, and never panics.
    #[test]
    fn updates_are_applied_or_refused() {
        let (mut table, pem) = (SiteTable::default(), CertPem::self_signed().unwrap());
        for (label, acme) in [("a.test", true), ("b.test", false)] {
            table.sites.push(Site {
                label: label.into(),
                names: vec![label.into()],
                cert_pem: if acme {
                    String::new()
                } else {
                    pem.chain.clone()
                },
                key_pem: if acme { String::new() } else { pem.key.clone() },
                acme,
                redirect_names: Vec::new(),
                compress: None,
                rules: Default::default(),
                routes: Vec::new(),
                limits: Default::default(),
            });
        }
        let certs = SiteCerts::new(&table).unwrap();
        let certificate = |site, cert_pem: &str, key_pem: &str| SiteCertificate {
            seq: 9,
            site,
            cert_pem: cert_pem.into(),
            key_pem: key_pem.into(),
        };
        assert!(!apply_certificate(
            &certs,
            &certificate(1, &pem.chain, &pem.key)
        ));
        assert!(!apply_certificate(
            &certs,
            &certificate(2, &pem.chain, &pem.key)
        ));
        assert!(!apply_certificate(
            &certs,
            &certificate(u32::MAX, &pem.chain, &pem.key)
        ));
        assert!(!apply_certificate(&certs, &certificate(0, "garbage", "")));
        assert!(certs.current(0).is_none());
        assert!(apply_certificate(
            &certs,
            &certificate(0, &pem.chain, &pem.key)
        ));
        assert_eq!(certs.current(0).unwrap().cert[0], leaf(&pem));

        let answers = AcmeAnswers::new();
        let bad = tls_alpn01(
            "a.test",
            &CertPem {
                chain: String::new(),
                key: String::new(),
            },
        );
        let set = |tls_alpn01| ChallengeSet {
            seq: 10,
            http01: vec![http01("t", "t.k")],
            tls_alpn01,
        };
        assert!(!apply_challenges(&answers, &set(vec![bad])));
        assert_eq!(answers.seq(), None);
        assert!(apply_challenges(&answers, &set(Vec::new())));
        assert_eq!(answers.http01("t").as_deref(), Some("t.k"));
    }
}
