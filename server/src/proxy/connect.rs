//! How the proxy reaches one backend: the client for its URL's scheme and its route's TLS
//! settings ([`Backend::new`]), and what a failed TLS handshake says to the client
//! ([`tls_refusal`]). `crate::proxy` owns the request; this module owns the connection.
//!
//! * `http://` and `h2c://`: TCP (TCP_NODELAY); HTTP/1.1, or HTTP/2 with prior knowledge
//!   (RFC 9113 §3.3).
//! * `https://` and `h2://`: TLS over that TCP with the ring provider, ALPN `http/1.1` or `h2`
//!   (RFC 9113 §3.2), verified against the route's roots ([`UpstreamTls::roots_pem`]: its
//!   `upstream_ca`, else the system's, both read by the demux: the worker reads no file) for
//!   the name `upstream_sni`, else the URL's host. An IP address is sent as no SNI (RFC 6066
//!   §3) and verified as an IP address of the certificate.
//! * HTTP/2 multiplexes every request to one backend over one connection; HTTP/1.1 keeps a pool
//!   of keep-alive connections. Both are hyper-util's client.

use std::error::Error as StdError;
use std::sync::Arc;
use std::time::Duration;

use http::uri::Scheme;
use http::Request;
use hyper_rustls::{FixedServerNameResolver, HttpsConnector};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::{Builder, Client, ResponseFuture};
use hyper_util::rt::{TokioExecutor, TokioTimer};
use ringmux_proto::route::UpstreamTls;
use ringmux_proto::{UpstreamScheme, UpstreamUrl};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};

/// The body of a request to the upstream (the proxy's `ProxyBody`, named here so that this
/// module imports nothing of its parent).
type ProxyBody = http_body_util::combinators::UnsyncBoxBody<
    bytes::Bytes,
    Box<dyn std::error::Error + Send + Sync>,
>;

/// Idle upstream connections kept per worker; more are closed when they go idle.
const POOL_IDLE_MAX: usize = 256;

/// How long an idle upstream connection is kept.
const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(60);

/// How often an idle HTTP/2 connection to a backend is pinged, so a backend gone silently is
/// found before a request waits on it.
const H2_KEEP_ALIVE: Duration = Duration::from_secs(30);

/// The client of one backend.
pub(super) struct Backend {
    client: Clients,
    scheme: UpstreamScheme,
}

enum Clients {
    Clear(Client<HttpConnector, ProxyBody>),
    Tls(Client<HttpsConnector<HttpConnector>, ProxyBody>),
}

/// Why a backend's client cannot be made: its TLS settings. Checked by the demux first, so
/// this is met only by a worker's own `--upstream` or a table from another build.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error(
        "{url}: no certificates to verify it against (the demux hands over the route's \
         upstream_ca or the system's roots; a worker's own --upstream cannot be TLS)"
    )]
    NoRoots { url: String },
    #[error("{url}: the certificates to trust are not PEM certificates: {error}")]
    Pem {
        url: String,
        error: rustls::pki_types::pem::Error,
    },
    #[error("{url}: certificate {index} (from 0) cannot be a trust anchor: {error}")]
    Anchor {
        url: String,
        index: usize,
        error: rustls::Error,
    },
    #[error("{url}: {name:?} is not a TLS server name")]
    ServerName { url: String, name: String },
    #[error("{url}: TLS: {error}")]
    Tls { url: String, error: rustls::Error },
}

impl Backend {
    /// The client of `url`, verified as `tls` says over TLS. A connection attempt gives up
    /// after `timeout`.
    pub(super) fn new(
        url: &UpstreamUrl,
        tls: &UpstreamTls,
        timeout: Duration,
    ) -> Result<Backend, ConnectError> {
        let mut tcp = HttpConnector::new();
        tcp.set_nodelay(true);
        tcp.set_connect_timeout(Some(timeout));
        let mut builder = Client::builder(TokioExecutor::new());
        builder
            .pool_max_idle_per_host(POOL_IDLE_MAX)
            .pool_idle_timeout(POOL_IDLE_TIMEOUT);
        if url.scheme.http2() {
            builder
                .http2_only(true)
                .timer(TokioTimer::new())
                .http2_keep_alive_interval(H2_KEEP_ALIVE)
                .http2_keep_alive_timeout(timeout);
        }
        let client = match url.scheme.tls() {
            false => Clients::Clear(builder.build(tcp)),
            true => Clients::Tls(tls_client(&builder, tcp, url, tls)?),
        };
        Ok(Backend {
            client,
            scheme: url.scheme,
        })
    }

    /// The scheme of the request URIs: `https` over TLS (hyper-rustls connects only those).
    pub(super) fn uri_scheme(&self) -> Scheme {
        match self.scheme.tls() {
            true => Scheme::HTTPS,
            false => Scheme::HTTP,
        }
    }

    /// The version of the requests sent.
    pub(super) fn version(&self) -> http::Version {
        match self.scheme.http2() {
            true => http::Version::HTTP_2,
            false => http::Version::HTTP_11,
        }
    }

    pub(super) fn request(&self, request: Request<ProxyBody>) -> ResponseFuture {
        match &self.client {
            Clients::Clear(c) => c.request(request),
            Clients::Tls(c) => c.request(request),
        }
    }
}

/// The TLS client of `url`: `tls`'s roots, its server name, ALPN for the URL's HTTP version.
fn tls_client(
    builder: &Builder,
    tcp: HttpConnector,
    url: &UpstreamUrl,
    tls: &UpstreamTls,
) -> Result<Client<HttpsConnector<HttpConnector>, ProxyBody>, ConnectError> {
    let at = || url.to_string();
    let mut roots = rustls::RootCertStore::empty();
    for (index, der) in CertificateDer::pem_slice_iter(tls.roots_pem.as_bytes()).enumerate() {
        let der = der.map_err(|error| ConnectError::Pem { url: at(), error })?;
        roots.add(der).map_err(|error| ConnectError::Anchor {
            url: at(),
            index,
            error,
        })?;
    }
    if roots.is_empty() {
        return Err(ConnectError::NoRoots { url: at() });
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|error| ConnectError::Tls { url: at(), error })?
        .with_root_certificates(roots)
        .with_no_client_auth();
    let name = tls.sni.as_ref().map_or(url.host(), |s| s.as_str());
    let name = ServerName::try_from(name.to_owned()).map_err(|_| ConnectError::ServerName {
        url: at(),
        name: name.to_owned(),
    })?;
    let https = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(config)
        .https_only()
        .with_server_name_resolver(FixedServerNameResolver::new(name));
    let connector = match url.scheme.http2() {
        true => https.enable_http2().wrap_connector(tcp),
        false => https.enable_http1().wrap_connector(tcp),
    };
    Ok(builder.build(connector))
}

/// What a client is told when the TLS handshake with its backend failed, if `e` is such a
/// failure: the reason in words (an unknown CA, a name the certificate does not cover, …).
pub(super) fn tls_refusal(e: &(dyn StdError + 'static)) -> Option<&'static [u8]> {
    use rustls::CertificateError as C;
    let why: &'static [u8] = match rustls_error(e)? {
        rustls::Error::InvalidCertificate(c) => match c {
            C::UnknownIssuer => {
                b"upstream TLS: the upstream's certificate is from an unknown CA (not the \
                  route's upstream_ca nor a system root)\n"
            }
            C::NotValidForName | C::NotValidForNameContext { .. } => {
                b"upstream TLS: the upstream's certificate is not valid for the name asked \
                  (upstream_sni, or the upstream URL's host)\n"
            }
            C::Expired | C::ExpiredContext { .. } => {
                b"upstream TLS: the upstream's certificate has expired\n"
            }
            C::NotValidYet | C::NotValidYetContext { .. } => {
                b"upstream TLS: the upstream's certificate is not valid yet\n"
            }
            _ => b"upstream TLS: the upstream's certificate is invalid\n",
        },
        rustls::Error::AlertReceived(_) => {
            b"upstream TLS: the upstream refused the handshake (an alert)\n"
        }
        rustls::Error::NoApplicationProtocol => {
            b"upstream TLS: the upstream speaks none of the protocols asked (ALPN)\n"
        }
        _ => b"upstream TLS: the handshake with the upstream failed\n",
    };
    Some(why)
}

/// The rustls error in `e`'s source chain. An `io::Error` carries it as its inner error,
/// which its `source` skips, so each is looked into.
fn rustls_error<'a>(e: &'a (dyn StdError + 'static)) -> Option<&'a rustls::Error> {
    let mut cur: Option<&(dyn StdError + 'static)> = Some(e);
    while let Some(err) = cur {
        if let Some(t) = err.downcast_ref::<rustls::Error>() {
            return Some(t);
        }
        if let Some(inner) = err
            .downcast_ref::<std::io::Error>()
            .and_then(|io| io.get_ref())
        {
            if let Some(t) = rustls_error(inner) {
                return Some(t);
            }
        }
        cur = err.source();
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tls_failures_say_why_through_io_errors() {
        let unknown = rustls::Error::InvalidCertificate(rustls::CertificateError::UnknownIssuer);
        let io = std::io::Error::new(std::io::ErrorKind::InvalidData, unknown);
        let why = tls_refusal(&io).unwrap();
        assert!(why.starts_with(b"upstream TLS: the upstream's certificate is from an unknown CA"));
        let name = rustls::Error::InvalidCertificate(rustls::CertificateError::NotValidForName);
        let boxed: Box<dyn StdError + Send + Sync> = Box::new(std::io::Error::other(name));
        let why = String::from_utf8_lossy(tls_refusal(boxed.as_ref()).unwrap());
        assert!(why.contains("not valid for the name asked"), "{why}");
        let refused = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
        assert!(tls_refusal(&refused).is_none());
    }

    #[test]
    fn a_tls_backend_needs_roots_and_a_server_name() {
        let url: UpstreamUrl = "https://127.0.0.1:9".parse().unwrap();
        let none = UpstreamTls::default();
        let e = Backend::new(&url, &none, Duration::from_secs(1))
            .err()
            .unwrap();
        assert!(matches!(e, ConnectError::NoRoots { .. }), "{e}");
        let garbage = UpstreamTls {
            roots_pem: "-----BEGIN CERTIFICATE-----\nnot base64!\n-----END CERTIFICATE-----\n"
                .into(),
            sni: None,
        };
        let e = Backend::new(&url, &garbage, Duration::from_secs(1)).err();
        assert!(e.is_some(), "a PEM of no certificate is refused");
        let clear: UpstreamUrl = "h2c://127.0.0.1:9".parse().unwrap();
        let b = Backend::new(&clear, &none, Duration::from_secs(1)).unwrap();
        assert_eq!(
            (b.uri_scheme(), b.version()),
            (Scheme::HTTP, http::Version::HTTP_2)
        );
    }
}
