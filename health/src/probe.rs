//! One probe of one backend: `GET path` on a new connection, over the backend's own protocol
//! as the proxy reaches it (`server/src/proxy/connect.rs`): HTTP/1.1 for `http://` and
//! `https://`, HTTP/2 with prior knowledge for `h2c://`, HTTP/2 over TLS (ALPN `h2`) for
//! `h2://`; over TLS verified against the route's roots for `upstream_sni` or the URL's host.
//! A response head of 2xx or 3xx within the timeout passes; the body is never read.

use std::error::Error as StdError;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{header, Request, Uri};
use http_body_util::Empty;
use hyper_rustls::{FixedServerNameResolver, HttpsConnector};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use ringmux_proto::route::UpstreamTls;
use ringmux_proto::UpstreamUrl;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};

/// How a probe ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// 2xx or 3xx within the timeout.
    Pass,
    /// No response head within the timeout.
    Timeout,
    /// The connection could not be made.
    Connect,
    /// A response of another status.
    Status,
    /// The TLS handshake failed, or the route's TLS settings cannot make a client.
    Tls,
    /// The connection broke, or the answer was not HTTP.
    Protocol,
}

impl Outcome {
    /// Every outcome, in the order of [`Outcome::as_str`]'s labels.
    pub const ALL: [Outcome; 6] = [
        Outcome::Pass,
        Outcome::Timeout,
        Outcome::Connect,
        Outcome::Status,
        Outcome::Tls,
        Outcome::Protocol,
    ];

    /// The `result` label of `ringmux_health_probes_total`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Outcome::Pass => "pass",
            Outcome::Timeout => "timeout",
            Outcome::Connect => "connect",
            Outcome::Status => "status",
            Outcome::Tls => "tls",
            Outcome::Protocol => "protocol",
        }
    }
}

/// The user agent of every probe, so a backend's log tells them apart.
const USER_AGENT: &str = concat!("ringmux-health/", env!("CARGO_PKG_VERSION"));

/// The client of one backend's probes; `None` when its TLS settings cannot make one (every
/// probe then fails as [`Outcome::Tls`], and the reason is logged once).
pub struct Prober {
    client: Option<Clients>,
    uri: Uri,
    authority: String,
    http2: bool,
}

enum Clients {
    Clear(Client<HttpConnector, Empty<Bytes>>),
    Tls(Client<HttpsConnector<HttpConnector>, Empty<Bytes>>),
}

impl Prober {
    /// The prober of `path` on `url`, verified as `tls` says over TLS.
    pub fn new(url: &UpstreamUrl, tls: &UpstreamTls, path: &str) -> Prober {
        let mut tcp = HttpConnector::new();
        tcp.enforce_http(!url.scheme.tls());
        tcp.set_nodelay(true);
        let mut builder = Client::builder(TokioExecutor::new());
        // A new connection per probe: a probe finds a backend that stopped accepting, and a
        // probe that is cut ends its own connection only.
        builder.pool_max_idle_per_host(0);
        if url.scheme.http2() {
            builder.http2_only(true).timer(TokioTimer::new());
        }
        let client = match url.scheme.tls() {
            false => Some(Clients::Clear(builder.build(tcp))),
            true => match tls_connector(tcp, url, tls) {
                Ok(c) => Some(Clients::Tls(builder.build(c))),
                Err(why) => {
                    tracing::warn!(backend = %url, reason = %why, "health checks of this backend cannot verify it: every probe fails (tls)");
                    None
                }
            },
        };
        let scheme = match url.scheme.tls() {
            true => "https",
            false => "http",
        };
        let uri = format!("{scheme}://{}{path}", url.authority)
            .parse()
            .unwrap_or_default();
        Prober {
            client,
            uri,
            authority: url.authority.to_string(),
            http2: url.scheme.http2(),
        }
    }

    /// One probe, ended at `timeout`: its connection is dropped then, whatever it was doing.
    pub async fn probe(&self, timeout: Duration) -> Outcome {
        let Some(client) = &self.client else {
            return Outcome::Tls;
        };
        let mut request = Request::get(self.uri.clone());
        if !self.http2 {
            // HTTP/2 carries the authority as `:authority`, from the URI.
            request = request.header(header::HOST, &self.authority);
        }
        let Ok(request) = request
            .header(header::USER_AGENT, USER_AGENT)
            .body(Empty::<Bytes>::new())
        else {
            return Outcome::Protocol;
        };
        let response = match client {
            Clients::Clear(c) => c.request(request),
            Clients::Tls(c) => c.request(request),
        };
        match tokio::time::timeout(timeout, response).await {
            Err(_) => Outcome::Timeout,
            Ok(Ok(r)) if r.status().is_success() || r.status().is_redirection() => Outcome::Pass,
            Ok(Ok(_)) => Outcome::Status,
            Ok(Err(e)) if has_rustls_error(&e) => Outcome::Tls,
            Ok(Err(e)) if e.is_connect() => Outcome::Connect,
            Ok(Err(_)) => Outcome::Protocol,
        }
    }
}

/// Why a backend's TLS settings make no client.
#[derive(Debug, thiserror::Error)]
enum TlsSetup {
    #[error("no certificates to verify it against")]
    NoRoots,
    #[error("certificate {index} of its roots: {why}")]
    Root { index: usize, why: String },
    #[error("{0:?} is not a TLS server name")]
    ServerName(String),
    #[error("{0}")]
    Rustls(#[from] rustls::Error),
}

/// The TLS connector of `url`: the route's roots, its server name, ALPN of the URL's HTTP
/// version; as the proxy's (`server/src/proxy/connect.rs`).
fn tls_connector(
    tcp: HttpConnector,
    url: &UpstreamUrl,
    tls: &UpstreamTls,
) -> Result<HttpsConnector<HttpConnector>, TlsSetup> {
    let mut roots = rustls::RootCertStore::empty();
    for (index, der) in CertificateDer::pem_slice_iter(tls.roots_pem.as_bytes()).enumerate() {
        let der = der.map_err(|e| TlsSetup::Root {
            index,
            why: e.to_string(),
        })?;
        roots.add(der).map_err(|e| TlsSetup::Root {
            index,
            why: e.to_string(),
        })?;
    }
    if roots.is_empty() {
        return Err(TlsSetup::NoRoots);
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth();
    let name = tls.sni.as_ref().map_or(url.host(), |s| s.as_str());
    let name =
        ServerName::try_from(name.to_owned()).map_err(|_| TlsSetup::ServerName(name.to_owned()))?;
    let https = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(config)
        .https_only()
        .with_server_name_resolver(FixedServerNameResolver::new(name));
    Ok(match url.scheme.http2() {
        true => https.enable_http2().wrap_connector(tcp),
        false => https.enable_http1().wrap_connector(tcp),
    })
}

/// Whether `e`'s source chain holds a rustls error (an `io::Error` carries it as its inner
/// error, which its `source` skips, so each is looked into).
fn has_rustls_error(e: &(dyn StdError + 'static)) -> bool {
    let mut cur: Option<&(dyn StdError + 'static)> = Some(e);
    // Bounded: a chain of errors is short, and this stops at 16 links.
    for _ in 0..16 {
        let Some(err) = cur else {
            return false;
        };
        if err.downcast_ref::<rustls::Error>().is_some() {
            return true;
        }
        if let Some(inner) = err
            .downcast_ref::<std::io::Error>()
            .and_then(|io| io.get_ref())
        {
            if inner.downcast_ref::<rustls::Error>().is_some() {
                return true;
            }
        }
        cur = err.source();
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    fn url(port: u16) -> UpstreamUrl {
        format!("http://127.0.0.1:{port}").parse().unwrap()
    }

    /// A server that answers each connection's request with `head`, or never answers.
    async fn serve(head: Option<&'static str>) -> u16 {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let mut buf = [0u8; 1024];
                    let _ = s.read(&mut buf).await;
                    match head {
                        Some(h) => {
                            let _ = s.write_all(h.as_bytes()).await;
                        }
                        // Holds the connection open, answering nothing, until the prober
                        // closes it.
                        None => while s.read(&mut buf).await.is_ok_and(|n| n > 0) {},
                    }
                });
            }
        });
        port
    }

    #[tokio::test]
    async fn statuses_timeouts_and_refusals_are_told_apart() {
        let timeout = Duration::from_millis(300);
        let tls = UpstreamTls::default();
        let ok = serve(Some("HTTP/1.1 204 No Content\r\n\r\n")).await;
        let moved = serve(Some("HTTP/1.1 302 Found\r\ncontent-length: 0\r\n\r\n")).await;
        let bad = serve(Some("HTTP/1.1 503 Nope\r\ncontent-length: 0\r\n\r\n")).await;
        let junk = serve(Some("SSH-2.0-nope\r\n\r\n")).await;
        let hangs = serve(None).await;
        // A port nothing listens on: bound, then closed.
        let closed = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let refused = closed.local_addr().unwrap().port();
        drop(closed);
        for (port, outcome) in [
            (ok, Outcome::Pass),
            (moved, Outcome::Pass),
            (bad, Outcome::Status),
            (junk, Outcome::Protocol),
            (hangs, Outcome::Timeout),
            (refused, Outcome::Connect),
        ] {
            let p = Prober::new(&url(port), &tls, "/healthz");
            assert_eq!(p.probe(timeout).await, outcome, "port {port}");
        }
        let tls_url: UpstreamUrl = format!("https://127.0.0.1:{ok}").parse().unwrap();
        let no_roots = Prober::new(&tls_url, &tls, "/h");
        assert_eq!(no_roots.probe(timeout).await, Outcome::Tls);
    }
}
