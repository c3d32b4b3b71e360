//! TLS for the worker: the certificate chain, the session-resumption state shared by every
//! worker process, and the rustls server configuration handed to quinn.
//!
//! This module owns everything TLS-shaped a worker needs and nothing else: it never touches
//! sockets, QUIC keys (see [`crate::quic`]) or HTTP.
//!
//! # Resumption and 0-RTT across instances
//!
//! A resumed connection lands on whichever instance its new random DCID hashes to, so every
//! instance must be able to accept a ticket another instance issued. There are two ways, and
//! rustls treats them differently:
//!
//! * **Stateless tickets** ([`SharedTicketer`], [`Resumption::SharedTickets`]): the session state
//!   is sealed into the ticket with a key all instances share. Resumption (no certificate, one
//!   fewer signature) works on every instance. **rustls 0.23 never accepts 0-RTT with stateless
//!   tickets** (`tls13.rs`: "early_data with stateless resumption is not allowed", following
//!   RFC 8446 §8.1: stateless tickets cannot be made single-use, so early data would be
//!   replayable). Tickets it issues carry no `early_data` extension, so clients do not even try.
//! * **A session store** ([`Resumption::SessionStore`]): tickets are random IDs looked up (and
//!   removed: single use) in a [`StoresServerSessions`]. rustls accepts 0-RTT here. Across
//!   instances this needs a store that all instances share; across *processes* that means a
//!   store backed by shared memory or the demux, which ringmux does not have yet.
//!
//! [`server_crypto`] uses stateless shared tickets: the safe default that works across processes
//! today. [`server_crypto_with`] takes either.

use std::fmt;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, PoisonError, RwLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use quinn::crypto::rustls::QuicServerConfig;
use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM, NONCE_LEN};
use ring::rand::{SecureRandom, SystemRandom};
use ringmux_proto::certs::{CertError, CertPem};
use ringmux_proto::sites::{SiteIndex, SiteTable};
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ProducesTickets, ResolvesServerCert, StoresServerSessions};
use rustls::sign::CertifiedKey;

/// ALPN token for HTTP/3 over QUIC v1 (RFC 9114 §3.1).
pub const ALPN_H3: &[u8] = b"h3";

/// Subject alternative names of [`CertChain::self_signed`].
pub use ringmux_proto::certs::SELF_SIGNED_NAMES;

/// Errors from loading or making certificates and building the TLS configuration.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// The certificate or key could not be read, parsed or made.
    #[error(transparent)]
    Cert(#[from] CertError),
    /// rustls refused the certificate, key or settings (its error is in the message, so not
    /// the error's `source`).
    #[error("TLS configuration rejected: {0}")]
    Rustls(rustls::Error),
    /// quinn refused the rustls configuration (it needs TLS 1.3 and an AES-128-GCM suite; in
    /// the message, so not the error's `source`).
    #[error("TLS configuration unusable for QUIC: {0}")]
    Quic(quinn::crypto::rustls::NoInitialCipherSuite),
}

impl From<rustls::Error> for TlsError {
    fn from(e: rustls::Error) -> Self {
        TlsError::Rustls(e)
    }
}

impl From<quinn::crypto::rustls::NoInitialCipherSuite> for TlsError {
    fn from(e: quinn::crypto::rustls::NoInitialCipherSuite) -> Self {
        TlsError::Quic(e)
    }
}

/// A certificate chain (leaf first) and its private key.
pub struct CertChain {
    pub certs: Vec<CertificateDer<'static>>,
    pub key: PrivateKeyDer<'static>,
}

impl fmt::Debug for CertChain {
    // Never print key material.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CertChain")
            .field("certs", &self.certs.len())
            .field("key", &"<redacted>")
            .finish()
    }
}

impl Clone for CertChain {
    fn clone(&self) -> Self {
        CertChain {
            certs: self.certs.clone(),
            key: self.key.clone_key(),
        }
    }
}

impl CertChain {
    /// A fresh self-signed certificate for [`SELF_SIGNED_NAMES`] (ECDSA P-256).
    pub fn self_signed() -> Result<Self, TlsError> {
        Self::from_cert_pem(&CertPem::self_signed()?)
    }

    /// Loads a PEM certificate chain and a PEM private key (PKCS#8, PKCS#1 or SEC1).
    pub fn from_pem_files(cert: &Path, key: &Path) -> Result<Self, TlsError> {
        Self::from_cert_pem(&CertPem::load(cert, key)?)
    }

    /// Parses PEM text: a chain (leaf first) and its key, as the hand-off carries them.
    pub fn from_pem(cert_pem: &str, key_pem: &str) -> Result<Self, TlsError> {
        let (certs, key) = ringmux_proto::certs::parse_pem(cert_pem, key_pem)?;
        Ok(CertChain { certs, key })
    }

    fn from_cert_pem(pem: &CertPem) -> Result<Self, TlsError> {
        Self::from_pem(&pem.chain, &pem.key)
    }
}

/// How resumed sessions are recognised, see the module docs.
#[derive(Clone)]
pub enum Resumption {
    /// Stateless tickets sealed with a key every instance shares: resumption anywhere, no 0-RTT.
    SharedTickets(Arc<SharedTicketer>),
    /// Single-use tickets looked up in a store: 0-RTT, but only on instances sharing the store.
    SessionStore(Arc<dyn StoresServerSessions>),
}

impl fmt::Debug for Resumption {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Resumption::SharedTickets(t) => f.debug_tuple("SharedTickets").field(t).finish(),
            Resumption::SessionStore(s) => f.debug_tuple("SessionStore").field(s).finish(),
        }
    }
}

/// Number of session tickets sent after each full handshake. More than one lets a client open
/// parallel resumed connections (each ticket is meant to be used once).
pub const TICKETS_PER_HANDSHAKE: usize = 2;

/// The QUIC server crypto config with stateless tickets sealed by `ticket_secret`, which all
/// worker processes share: TLS 1.3 only, ALPN `h3`, ring provider.
pub fn server_crypto(
    certs: &impl CertSource,
    ticket_secret: &[u8; 32],
) -> Result<Arc<QuicServerConfig>, TlsError> {
    let ticketer = Arc::new(SharedTicketer::new(ticket_secret));
    server_crypto_with(certs, Resumption::SharedTickets(ticketer))
}

/// Like [`server_crypto`] with an explicit resumption mechanism.
pub fn server_crypto_with(
    certs: &impl CertSource,
    resumption: Resumption,
) -> Result<Arc<QuicServerConfig>, TlsError> {
    let mut tls = quic_tls_config(certs, &[ALPN_H3])?;
    match resumption {
        Resumption::SharedTickets(t) => tls.ticketer = t,
        Resumption::SessionStore(s) => tls.session_storage = s,
    }
    Ok(Arc::new(QuicServerConfig::try_from(tls)?))
}

/// A rustls server configuration for QUIC with the certificates of `certs` and the ALPN
/// protocols `alpn`: TLS 1.3 only, the ring provider, 0-RTT allowed,
/// [`TICKETS_PER_HANDSHAKE`] tickets; resumption is the caller's to set (`ticketer` or
/// `session_storage`).
pub fn quic_tls_config(
    certs: &impl CertSource,
    alpn: &[&[u8]],
) -> Result<rustls::ServerConfig, TlsError> {
    let mut tls = rustls_config(certs, &[&rustls::version::TLS13])?;
    tls.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    // QUIC allows only 0 or 0xffffffff here (RFC 9001 §4.6.1); quinn rejects anything else.
    tls.max_early_data_size = u32::MAX;
    tls.send_tls13_tickets = TICKETS_PER_HANDSHAKE;
    Ok(tls)
}

/// A rustls server configuration for HTTPS over TCP with the certificates of `certs`: TLS 1.3
/// and 1.2, the ring provider, ALPN `h2` then `http/1.1`. Sessions resume within the process
/// (rustls' in-memory cache and stateless tickets are its defaults); no 0-RTT over TCP.
pub fn tcp_tls_config(certs: &impl CertSource) -> Result<rustls::ServerConfig, TlsError> {
    let mut tls = rustls_config(certs, &[&rustls::version::TLS13, &rustls::version::TLS12])?;
    tls.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(tls)
}

/// The one rustls server builder: the certificates of `certs` under the ring provider with
/// `versions`, no client authentication.
pub fn rustls_config(
    certs: &impl CertSource,
    versions: &[&'static rustls::SupportedProtocolVersion],
) -> Result<rustls::ServerConfig, TlsError> {
    Ok(rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(versions)?
        .with_no_client_auth()
        .with_cert_resolver(certs.resolver()?))
}

/// The crypto provider of every configuration here. Always named: with more than one provider
/// compiled in (rustls' default features add aws-lc-rs), the process default is ambiguous.
pub(crate) fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// What a server configuration takes its certificates from: one chain for every handshake
/// ([`CertChain`]), or the sites' certificates chosen by SNI ([`SiteCerts`]).
pub trait CertSource {
    /// The resolver rustls asks for each handshake's certificate.
    fn resolver(&self) -> Result<Arc<dyn ResolvesServerCert>, TlsError>;
}

impl CertSource for CertChain {
    fn resolver(&self) -> Result<Arc<dyn ResolvesServerCert>, TlsError> {
        Ok(Arc::new(SiteCerts::single(self)?))
    }
}

impl CertSource for SiteCerts {
    fn resolver(&self) -> Result<Arc<dyn ResolvesServerCert>, TlsError> {
        Ok(Arc::new(self.clone()))
    }
}

/// The certificate of every site of a [`SiteTable`], chosen for each handshake by its server
/// name (SNI): an exact name before a one-label wildcard, else the default site's; with no
/// default site, a handshake without SNI or for a name no site has fails (rustls would send
/// the `access_denied` alert; `Worker::server_config` and the built-in server's TCP side
/// refuse such a ClientHello with `unrecognized_name` first). The same resolver serves QUIC
/// and TCP, so both transports always present the same certificate for a name.
///
/// Cheap to clone, and every clone shares one table of certificates: an ACME site's new
/// certificate ([`SiteCerts::install`]) reaches every configuration built from this one (the
/// QUIC one and the TCP one alike) at once, for every handshake from then on. An ACME site
/// has no certificate until its first one is installed, and a handshake for it fails until
/// then.
#[derive(Clone)]
pub struct SiteCerts {
    /// One per site, in the table's order.
    slots: Arc<[Slot]>,
    index: Arc<SiteIndex>,
}

/// A site's certificate as handshakes get it now.
struct Slot {
    label: Box<str>,
    /// Its certificate comes from ACME: [`SiteCerts::install`] may replace it.
    acme: bool,
    /// `None`: an ACME site before its first certificate. A lock, not an atomic swap: a
    /// handshake holds it for a reference count's increment, a certificate is replaced every
    /// few weeks.
    key: RwLock<Option<Arc<CertifiedKey>>>,
}

impl fmt::Debug for SiteCerts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SiteCerts")
            .field("sites", &self.slots.len())
            .finish_non_exhaustive()
    }
}

/// Why [`SiteCerts::install`] refused a certificate; the site keeps the one it had.
#[derive(Debug, thiserror::Error)]
pub enum InstallError {
    /// The index is past the site table.
    #[error("no site {site}: the site table has {sites}")]
    NoSuchSite { site: usize, sites: usize },
    /// The site's certificate is the operator's, never replaced at run time.
    #[error("site {label} is not an ACME site: its certificate is the operator's")]
    NotAcme { label: String },
    /// The chain or key does not parse, or the key is not the leaf's.
    #[error(transparent)]
    Tls(#[from] TlsError),
}

impl SiteCerts {
    /// Every site's certificate and key, parsed, each key checked against its certificate; an
    /// error names the site. An ACME site without a certificate yet (both PEM texts empty) has
    /// none until [`SiteCerts::install`].
    pub fn new(table: &SiteTable) -> Result<SiteCerts, TlsError> {
        let provider = provider();
        let slots = table
            .sites
            .iter()
            .map(|site| {
                let pending = site.acme && site.cert_pem.is_empty() && site.key_pem.is_empty();
                let key = match pending {
                    true => None,
                    false => Some(Arc::new(certified_key(
                        &site.label,
                        &site.cert_pem,
                        &site.key_pem,
                        &provider,
                    )?)),
                };
                Ok(Slot {
                    label: site.label.as_str().into(),
                    acme: site.acme,
                    key: RwLock::new(key),
                })
            })
            .collect::<Result<Vec<_>, TlsError>>()?;
        Ok(SiteCerts {
            slots: slots.into(),
            index: Arc::new(SiteIndex::new(table)),
        })
    }

    /// One chain for every handshake, whatever its server name.
    pub fn single(chain: &CertChain) -> Result<SiteCerts, TlsError> {
        let key = CertifiedKey::from_der(chain.certs.clone(), chain.key.clone_key(), &provider())?;
        let slot = Slot {
            label: "-".into(),
            acme: false,
            key: RwLock::new(Some(Arc::new(key))),
        };
        Ok(SiteCerts {
            slots: vec![slot].into(),
            index: Arc::new(SiteIndex::catch_all(0)),
        })
    }

    /// The site a handshake with server name `sni` gets the certificate of (an index into the
    /// site table), as the resolver chooses it.
    pub fn site_for(&self, sni: Option<&str>) -> Option<usize> {
        self.index.for_host(sni)
    }

    /// The certificate a handshake for `site` gets now; `None` for an ACME site that has none
    /// yet, or an index past the table.
    pub fn current(&self, site: usize) -> Option<Arc<CertifiedKey>> {
        let slot = self.slots.get(site)?;
        // A writer that panicked left a whole `Option` behind: the lock guards nothing else.
        let key = slot.key.read().unwrap_or_else(PoisonError::into_inner);
        key.clone()
    }

    /// The label of `site`, as the site table names it.
    pub fn label(&self, site: usize) -> Option<&str> {
        self.slots.get(site).map(|s| &*s.label)
    }

    /// Makes the chain `cert_pem` (leaf first) with the key `key_pem` the certificate of the
    /// ACME site `site`, for every handshake from now on, on every configuration built from
    /// this table (QUIC and TCP alike); connections already made keep theirs. Refuses, and the
    /// site keeps its certificate, when `site` is past the table or not an ACME site, when
    /// either text does not parse, or when the key is not the leaf's. Returns what it
    /// installed.
    pub fn install(
        &self,
        site: usize,
        cert_pem: &str,
        key_pem: &str,
    ) -> Result<Arc<CertifiedKey>, InstallError> {
        let slot = self.slots.get(site).ok_or(InstallError::NoSuchSite {
            site,
            sites: self.slots.len(),
        })?;
        if !slot.acme {
            return Err(InstallError::NotAcme {
                label: slot.label.to_string(),
            });
        }
        let key = Arc::new(certified_key(&slot.label, cert_pem, key_pem, &provider())?);
        *slot.key.write().unwrap_or_else(PoisonError::into_inner) = Some(key.clone());
        Ok(key)
    }
}

impl ResolvesServerCert for SiteCerts {
    fn resolve(&self, hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        self.current(self.site_for(hello.server_name())?)
    }
}

/// Counters of a [`SharedTicketer`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TicketStats {
    /// Tickets sealed.
    pub issued: u64,
    /// Tickets that opened and were still fresh.
    pub accepted: u64,
    /// Tickets that failed to open (other key, tampered, garbage) or had expired.
    pub rejected: u64,
}

/// Stateless TLS 1.3 session tickets sealed with AES-256-GCM under a key derived from a secret
/// shared by all worker processes, so a ticket issued by one instance opens on any other.
///
/// Ticket format: `nonce (12) ‖ AES-256-GCM(issued_at_secs_be (8) ‖ rustls state) ‖ tag (16)`.
/// The nonce is random per ticket. With a fixed key, 2^32 random nonces keep the collision
/// probability below 2^-32 (NIST SP 800-38D §8.3), so rotate the secret well before that many
/// tickets are issued (and regularly anyway: forward secrecy of resumed sessions lasts only as
/// long as the secret).
pub struct SharedTicketer {
    key: LessSafeKey,
    rng: SystemRandom,
    lifetime: Duration,
    issued: AtomicU64,
    accepted: AtomicU64,
    rejected: AtomicU64,
}

/// Default ticket lifetime.
pub const TICKET_LIFETIME: Duration = Duration::from_secs(6 * 60 * 60);

/// Tickets issued up to this far in the "future" (clock differences between hosts sharing the
/// secret) are still accepted.
const CLOCK_SKEW: u64 = 60;

/// HKDF info label: the shared secret may be reused for other purposes, the ticket key must not
/// be equal to it.
const TICKET_KEY_INFO: &[u8] = b"ringmux tls13 ticket key v1";

const ISSUED_LEN: usize = 8;

impl SharedTicketer {
    /// A ticketer with the default [`TICKET_LIFETIME`].
    pub fn new(secret: &[u8; 32]) -> Self {
        Self::with_lifetime(secret, TICKET_LIFETIME)
    }

    /// A ticketer whose tickets expire after `lifetime` (clamped to 1 s ..= 7 days, RFC 8446
    /// §4.6.1).
    pub fn with_lifetime(secret: &[u8; 32], lifetime: Duration) -> Self {
        let lifetime = lifetime.clamp(Duration::from_secs(1), Duration::from_secs(7 * 86_400));
        let prk = ring::hkdf::Salt::new(ring::hkdf::HKDF_SHA256, &[]).extract(secret);
        let mut key = [0u8; 32];
        // `expand`/`fill` fail only when the output is longer than 255 hash lengths; 32 bytes
        // from SHA-256 HKDF cannot fail.
        prk.expand(&[TICKET_KEY_INFO], &AES_256_GCM)
            .and_then(|okm| okm.fill(&mut key))
            .expect("HKDF-SHA256 expand to 32 bytes");
        let unbound = UnboundKey::new(&AES_256_GCM, &key).expect("AES-256 key is 32 bytes");
        SharedTicketer {
            key: LessSafeKey::new(unbound),
            rng: SystemRandom::new(),
            lifetime,
            issued: AtomicU64::new(0),
            accepted: AtomicU64::new(0),
            rejected: AtomicU64::new(0),
        }
    }

    /// Counters since creation.
    pub fn stats(&self) -> TicketStats {
        // Relaxed: independent statistics counters, nothing is published through them.
        TicketStats {
            issued: self.issued.load(Ordering::Relaxed),
            accepted: self.accepted.load(Ordering::Relaxed),
            rejected: self.rejected.load(Ordering::Relaxed),
        }
    }

    fn open(&self, cipher: &[u8]) -> Option<Vec<u8>> {
        if cipher.len() < NONCE_LEN + ISSUED_LEN + AES_256_GCM.tag_len() {
            return None;
        }
        let (nonce, sealed) = cipher.split_at(NONCE_LEN);
        let nonce = Nonce::try_assume_unique_for_key(nonce).ok()?;
        let mut buf = sealed.to_vec();
        let plain = self.key.open_in_place(nonce, Aad::empty(), &mut buf).ok()?;
        let (issued, state) = plain.split_at(ISSUED_LEN);
        let issued = u64::from_be_bytes(issued.try_into().ok()?);
        let now = unix_now();
        let fresh = issued <= now.saturating_add(CLOCK_SKEW)
            && now.saturating_sub(issued) <= self.lifetime.as_secs();
        fresh.then(|| state.to_vec())
    }
}

impl fmt::Debug for SharedTicketer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SharedTicketer")
            .field("lifetime", &self.lifetime)
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

impl ProducesTickets for SharedTicketer {
    fn enabled(&self) -> bool {
        true
    }

    fn lifetime(&self) -> u32 {
        u32::try_from(self.lifetime.as_secs()).unwrap_or(u32::MAX)
    }

    fn encrypt(&self, plain: &[u8]) -> Option<Vec<u8>> {
        let mut nonce = [0u8; NONCE_LEN];
        // A failing system RNG means no ticket (rustls then sends none), never a reused nonce.
        self.rng.fill(&mut nonce).ok()?;
        let mut out = Vec::with_capacity(NONCE_LEN + ISSUED_LEN + plain.len() + 16);
        out.extend_from_slice(&nonce);
        out.extend_from_slice(&unix_now().to_be_bytes());
        out.extend_from_slice(plain);
        let mut sealed = out.split_off(NONCE_LEN);
        self.key
            .seal_in_place_append_tag(
                Nonce::assume_unique_for_key(nonce),
                Aad::empty(),
                &mut sealed,
            )
            .ok()?;
        out.extend_from_slice(&sealed);
        // Relaxed: statistics only.
        self.issued.fetch_add(1, Ordering::Relaxed);
        Some(out)
    }

    fn decrypt(&self, cipher: &[u8]) -> Option<Vec<u8>> {
        // `cipher` is attacker-controlled: every failure is `None`, nothing here can panic.
        let plain = self.open(cipher);
        // Relaxed: statistics only.
        let counter = if plain.is_some() {
            &self.accepted
        } else {
            &self.rejected
        };
        counter.fetch_add(1, Ordering::Relaxed);
        plain
    }
}

/// The chain and key of site `label`, parsed, the key checked against the leaf
/// (`CertifiedKey::from_der`); an error names the site.
fn certified_key(
    label: &str,
    cert_pem: &str,
    key_pem: &str,
    provider: &rustls::crypto::CryptoProvider,
) -> Result<CertifiedKey, TlsError> {
    let origin = |problem: String| {
        TlsError::Cert(CertError::Pem {
            origin: format!("site {label}"),
            problem,
        })
    };
    let (certs, key) =
        ringmux_proto::certs::parse_pem(cert_pem, key_pem).map_err(|e| origin(e.to_string()))?;
    CertifiedKey::from_der(certs, key, provider).map_err(|e| origin(e.to_string()))
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use ringmux_proto::sites::Site;
    use ringmux_testkit::tls::AnyCertificate;
    use rustls::pki_types::ServerName;

    /// What a client saw of a handshake: the server's leaf and the ALPN protocol chosen.
    pub(crate) type Seen = (CertificateDer<'static>, Option<Vec<u8>>);

    /// A TLS handshake over TCP with `config`, in memory (rustls on both ends), by a client
    /// naming `name` and offering `alpn`.
    pub(crate) fn tcp_handshake(
        config: Arc<rustls::ServerConfig>,
        name: &str,
        alpn: &[&[u8]],
    ) -> Result<Seen, rustls::Error> {
        let versions = [&rustls::version::TLS13, &rustls::version::TLS12];
        let name = ServerName::try_from(name.to_string()).expect("a server name");
        let client = rustls::ClientConnection::new(client_config(&versions, alpn), name)?;
        let mut client = rustls::Connection::from(client);
        let mut server = rustls::Connection::from(rustls::ServerConnection::new(config)?);
        for _ in 0..10 {
            let to_server = drain_tls(&mut client);
            feed_tls(&mut server, &to_server)?;
            let to_client = drain_tls(&mut server);
            feed_tls(&mut client, &to_client)?;
            if !client.is_handshaking() && !server.is_handshaking() {
                break;
            }
        }
        seen(&client)
    }

    /// A QUIC handshake (RFC 9001's TLS messages, without packets) with `config`, in memory,
    /// by a client naming `name` and offering `alpn`.
    pub(crate) fn quic_handshake(
        config: Arc<rustls::ServerConfig>,
        name: &str,
        alpn: &[&[u8]],
    ) -> Result<Seen, rustls::Error> {
        use rustls::quic::{ClientConnection, ServerConnection, Version};
        let name = ServerName::try_from(name.to_string()).expect("a server name");
        let client_config = client_config(&[&rustls::version::TLS13], alpn);
        let params = b"transport parameters".to_vec();
        let mut client = ClientConnection::new(client_config, Version::V1, name, params.clone())?;
        let mut server = ServerConnection::new(config, Version::V1, params)?;
        for _ in 0..10 {
            // Each call writes up to the next change of keys, and each level's bytes are read
            // on their own, as QUIC carries them in packets of their own (RFC 9001 §4.1.3).
            loop {
                let mut bytes = Vec::new();
                let next = client.write_hs(&mut bytes);
                if !bytes.is_empty() {
                    server.read_hs(&bytes)?;
                }
                if next.is_none() {
                    break;
                }
            }
            loop {
                let mut bytes = Vec::new();
                let next = server.write_hs(&mut bytes);
                if !bytes.is_empty() {
                    client.read_hs(&bytes)?;
                }
                if next.is_none() {
                    break;
                }
            }
            if !client.is_handshaking() && !server.is_handshaking() {
                break;
            }
        }
        seen(&client)
    }

    fn seen(client: &rustls::CommonState) -> Result<Seen, rustls::Error> {
        if client.is_handshaking() {
            return Err(rustls::Error::General(
                "the handshake did not finish".into(),
            ));
        }
        let leaf = client
            .peer_certificates()
            .and_then(|c| c.first())
            .ok_or(rustls::Error::NoCertificatesPresented)?;
        Ok((
            leaf.clone().into_owned(),
            client.alpn_protocol().map(<[u8]>::to_vec),
        ))
    }

    fn drain_tls(from: &mut rustls::Connection) -> Vec<u8> {
        let mut bytes = Vec::new();
        while from.wants_write() {
            if from.write_tls(&mut bytes).is_err() {
                break;
            }
        }
        bytes
    }

    fn feed_tls(to: &mut rustls::Connection, mut bytes: &[u8]) -> Result<(), rustls::Error> {
        while !bytes.is_empty() {
            if to.read_tls(&mut bytes).is_err() {
                break;
            }
            to.process_new_packets()?;
        }
        Ok(())
    }

    /// A client that takes any certificate (these tests look at which one it got).
    fn client_config(
        versions: &[&'static rustls::SupportedProtocolVersion],
        alpn: &[&[u8]],
    ) -> Arc<rustls::ClientConfig> {
        let mut config = rustls::ClientConfig::builder_with_provider(provider())
            .with_protocol_versions(versions)
            .expect("protocol versions")
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(AnyCertificate))
            .with_no_client_auth();
        config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        Arc::new(config)
    }

    /// The leaf of `pem`, as a handshake presents it.
    pub(crate) fn leaf(pem: &CertPem) -> CertificateDer<'static> {
        CertChain::from_pem(&pem.chain, &pem.key).unwrap().certs[0].clone()
    }

    fn acme_table() -> (SiteTable, CertPem) {
        let operator = CertPem::self_signed().unwrap();
        let site = |label: &str, acme: bool, pem: Option<&CertPem>| Site {
            label: label.into(),
            names: vec![label.into()],
            cert_pem: pem.map(|p| p.chain.clone()).unwrap_or_default(),
            key_pem: pem.map(|p| p.key.clone()).unwrap_or_default(),
            acme,
            redirect_names: Vec::new(),
            compress: None,
            rules: Default::default(),
            routes: Vec::new(),
            limits: Default::default(),
        };
        let table = SiteTable {
            sites: vec![
                site("a.test", true, None),
                site("b.test", false, Some(&operator)),
            ],
            default_site: None,
        };
        (table, operator)
    }

    /// An ACME site has no certificate until one is installed; each one installed reaches
    /// configurations for QUIC and TCP made before it, at once; a chain whose key is not the
    /// leaf's, empty text, an index past the table and a site whose certificate is the
    /// operator's are refused, and the site keeps what it had.
    #[test]
    fn an_installed_certificate_reaches_quic_and_tcp_at_once() {
        let (table, operator) = acme_table();
        let certs = SiteCerts::new(&table).unwrap();
        let quic = Arc::new(quic_tls_config(&certs, &[ALPN_H3]).unwrap());
        let tcp = Arc::new(tcp_tls_config(&certs).unwrap());
        let both = |name: &str| {
            (
                quic_handshake(quic.clone(), name, &[ALPN_H3]).map(|s| s.0),
                tcp_handshake(tcp.clone(), name, &[b"h2"]).map(|s| s.0),
            )
        };
        assert!(certs.current(0).is_none());
        let (q, t) = both("a.test");
        assert!(q.is_err() && t.is_err(), "no certificate yet: {q:?} {t:?}");
        assert_eq!(both("b.test"), (Ok(leaf(&operator)), Ok(leaf(&operator))));

        let (first, renewed) = (
            CertPem::self_signed().unwrap(),
            CertPem::self_signed().unwrap(),
        );
        for pem in [&first, &renewed] {
            let installed = certs.install(0, &pem.chain, &pem.key).unwrap();
            assert_eq!(installed.cert[0], leaf(pem));
            assert_eq!(both("a.test"), (Ok(leaf(pem)), Ok(leaf(pem))));
        }

        let refused = [
            certs.install(0, &first.chain, &renewed.key),
            certs.install(0, "", ""),
            certs.install(0, &first.chain, "not a key"),
            certs.install(1, &first.chain, &first.key),
            certs.install(2, &first.chain, &first.key),
        ];
        let refused: Vec<String> = refused
            .into_iter()
            .map(|r| r.map(|_| ()).unwrap_err().to_string())
            .collect();
        assert!(refused[0].contains("site a.test"), "{refused:?}");
        assert!(
            refused[3].contains("b.test is not an ACME site"),
            "{refused:?}"
        );
        assert!(refused[4].contains("no site 2"), "{refused:?}");
        assert_eq!(both("a.test"), (Ok(leaf(&renewed)), Ok(leaf(&renewed))));
        assert_eq!(both("b.test"), (Ok(leaf(&operator)), Ok(leaf(&operator))));
        assert_eq!(certs.label(0), Some("a.test"));
    }

    /// An ACME site whose certificate the table carries already (a worker started after the
    /// first `CERTIFICATE`) serves it from the start; a broken one still stops the worker.
    #[test]
    fn an_acme_site_with_a_certificate_in_the_table_serves_it() {
        let (mut table, _) = acme_table();
        let pem = CertPem::self_signed().unwrap();
        table.sites[0].cert_pem = pem.chain.clone();
        table.sites[0].key_pem = pem.key.clone();
        let certs = SiteCerts::new(&table).unwrap();
        assert_eq!(certs.current(0).unwrap().cert[0], leaf(&pem));
        table.sites[0].key_pem = String::new();
        let err = SiteCerts::new(&table).unwrap_err().to_string();
        assert!(err.contains("site a.test"), "{err}");
    }

    #[test]
    fn pem_text_and_files_give_the_same_chain() {
        let pem = CertPem::self_signed().unwrap();
        let chain = CertChain::from_pem(&pem.chain, &pem.key).unwrap();
        assert_eq!(chain.certs.len(), 1);
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        let (c, k) = (dir.join("cert.pem"), dir.join("key.pem"));
        std::fs::write(&c, &pem.chain).unwrap();
        std::fs::write(&k, &pem.key).unwrap();
        let loaded = CertChain::from_pem_files(&c, &k);
        let loaded = loaded.unwrap();
        assert_eq!(loaded.certs, chain.certs);
        assert_eq!(loaded.key.secret_der(), chain.key.secret_der());
    }

    #[test]
    fn pem_errors_name_the_origin() {
        let err = CertChain::from_pem("", "").unwrap_err().to_string();
        assert!(
            err.contains("certificate PEM") && err.contains("no CERTIFICATE"),
            "{err}"
        );
        let missing = Path::new("/nonexistent/cert.pem");
        let err = CertChain::from_pem_files(missing, missing)
            .unwrap_err()
            .to_string();
        assert!(err.contains("/nonexistent/cert.pem"), "{err}");
    }

    #[test]
    fn quic_and_tcp_configs_differ_where_they_should() {
        let chain = CertChain::self_signed().unwrap();
        let quic = quic_tls_config(&chain, &[b"x"]).unwrap();
        assert_eq!(quic.alpn_protocols, [b"x".to_vec()]);
        assert_eq!(quic.max_early_data_size, u32::MAX);
        let tcp = tcp_tls_config(&chain).unwrap();
        assert_eq!(tcp.alpn_protocols, [b"h2".to_vec(), b"http/1.1".to_vec()]);
        assert_eq!(tcp.max_early_data_size, 0);
    }

    #[test]
    fn tickets_open_across_instances_only_with_the_same_secret() {
        let a = SharedTicketer::new(&[7; 32]);
        let b = SharedTicketer::new(&[7; 32]);
        let other = SharedTicketer::new(&[8; 32]);
        let t1 = a.encrypt(b"session state").unwrap();
        let t2 = a.encrypt(b"session state").unwrap();
        assert_ne!(t1, t2, "nonce must be random per ticket");
        assert_eq!(b.decrypt(&t1).as_deref(), Some(&b"session state"[..]));
        assert_eq!(other.decrypt(&t1), None);
        let mut tampered = t1.clone();
        *tampered.last_mut().unwrap() ^= 1;
        assert_eq!(b.decrypt(&tampered), None);
        for len in 0..40 {
            assert_eq!(b.decrypt(&vec![0u8; len]), None);
        }
        assert_eq!(
            b.stats(),
            TicketStats {
                issued: 0,
                accepted: 1,
                rejected: 41
            }
        );
        assert_eq!(a.stats().issued, 2);
    }

    #[test]
    fn server_crypto_builds() {
        let chain = CertChain::self_signed().unwrap();
        server_crypto(&chain, &[1; 32]).unwrap();
    }
}
