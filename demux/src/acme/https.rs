//! The HTTPS client instant-acme talks to the CA through (its `HttpClient` trait): hyper's
//! HTTP/1.1 client connection over tokio-rustls, on the ring provider, trusting the system's
//! roots and `[acme] ca_roots`.
//!
//! Ours rather than instant-acme's hyper-rustls client because the CA is a remote party that
//! may hang or misbehave: every request has a deadline (connection, handshake, answer and body
//! together), an answer's body is bounded, and the `Retry-After` of a refusal is kept for the
//! engine (instant-acme's problem documents drop the header; RFC 8555 §6.6 asks a client that
//! is rate-limited to honour it). Idle connections are kept per authority and reused: an order
//! makes a dozen requests to one host.

use std::future::Future;
use std::pin::Pin;
use std::str::FromStr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http::header::{HOST, RETRY_AFTER};
use http::{Request, Uri};
use http_body_util::{BodyExt, Limited};
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use instant_acme::{BodyWrapper, BytesResponse, HttpClient};
use rustls::pki_types::{CertificateDer, ServerName};

/// The largest answer body taken from a CA: a chain or a directory is a few KiB.
const MAX_BODY: usize = 1 << 20;
/// Idle connections kept (an order at a time per site, a few sites at once).
const MAX_IDLE: usize = 8;

/// The client; cheap to clone (every clone shares the connections and the `Retry-After`).
#[derive(Clone)]
pub struct CaClient {
    inner: Arc<Inner>,
}

struct Inner {
    tls: tokio_rustls::TlsConnector,
    deadline: Duration,
    idle: Mutex<Vec<(String, SendRequest<BodyWrapper<Bytes>>)>>,
    retry_after: Mutex<Option<SystemTime>>,
}

/// Why the client cannot be made.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("[acme] ca_roots: root {index} is not a certificate rustls accepts: {error}")]
    BadRoot { index: usize, error: rustls::Error },
    #[error(
        "no root to trust for the CA: the system has none ({system}) and [acme] ca_roots is empty"
    )]
    NoRoots { system: String },
    #[error("the TLS configuration: {0}")]
    Tls(rustls::Error),
}

impl CaClient {
    /// Trusts the system's roots (as rustls-native-certs finds them: `SSL_CERT_FILE`,
    /// `SSL_CERT_DIR`, else the distribution's bundle) and `extra_roots` (DER). `deadline`
    /// bounds each request.
    pub fn new(extra_roots: &[Vec<u8>], deadline: Duration) -> Result<CaClient, ClientError> {
        let mut roots = rustls::RootCertStore::empty();
        let system = rustls_native_certs::load_native_certs();
        let (added, _ignored) = roots.add_parsable_certificates(system.certs);
        for (index, der) in extra_roots.iter().enumerate() {
            roots
                .add(CertificateDer::from(der.clone()))
                .map_err(|error| ClientError::BadRoot { index, error })?;
        }
        if roots.is_empty() {
            let system = match system.errors.first() {
                Some(e) => e.to_string(),
                None => "no certificate found".into(),
            };
            return Err(ClientError::NoRoots { system });
        }
        if added == 0 {
            tracing::warn!(
                errors = ?system.errors.iter().map(ToString::to_string).collect::<Vec<_>>(),
                "ACME: no system root certificates found; trusting [acme] ca_roots only"
            );
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(ClientError::Tls)?
            .with_root_certificates(roots)
            .with_no_client_auth();
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(CaClient {
            inner: Arc::new(Inner {
                tls: tokio_rustls::TlsConnector::from(Arc::new(config)),
                deadline,
                idle: Mutex::new(Vec::new()),
                retry_after: Mutex::new(None),
            }),
        })
    }

    /// A handle for instant-acme's account builder.
    pub fn boxed(&self) -> Box<dyn HttpClient> {
        Box::new(self.clone())
    }

    /// The `Retry-After` of the last refusal (a status ≥ 400), taken: whoever asks next
    /// gets `None` until another refusal carries one.
    pub fn take_retry_after(&self) -> Option<SystemTime> {
        self.inner.retry_after.lock().ok()?.take()
    }
}

impl HttpClient for CaClient {
    fn request(
        &self,
        req: Request<BodyWrapper<Bytes>>,
    ) -> Pin<Box<dyn Future<Output = Result<BytesResponse, instant_acme::Error>> + Send>> {
        let inner = self.inner.clone();
        Box::pin(async move {
            let uri = req.uri().clone();
            match tokio::time::timeout(inner.deadline, inner.send(req)).await {
                Ok(Ok(response)) => Ok(response),
                Ok(Err(why)) => Err(other(why)),
                Err(_) => Err(other(format!(
                    "{uri}: no answer within {:?}",
                    inner.deadline
                ))),
            }
        })
    }
}

impl Inner {
    async fn send(&self, req: Request<BodyWrapper<Bytes>>) -> Result<BytesResponse, String> {
        let (mut parts, body) = req.into_parts();
        let uri = parts.uri.clone();
        let get = parts.method == http::Method::GET;
        if uri.scheme_str() != Some("https") {
            return Err(format!("{uri}: the CA must be reached over https"));
        }
        let (Some(host), Some(authority)) = (uri.host(), uri.authority()) else {
            return Err(format!("{uri}: no host"));
        };
        let authority = authority.as_str().to_owned();
        let host = host
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_owned();
        let port = uri.port_u16().unwrap_or(443);
        // Origin form with a Host header: what a client connection sends (RFC 9112 §3.2).
        let path = uri.path_and_query().map_or("/", |p| p.as_str());
        parts.uri = Uri::from_str(path).map_err(|e| format!("{uri}: {e}"))?;
        parts.headers.insert(
            HOST,
            authority
                .parse()
                .map_err(|_| format!("{uri}: not a Host header"))?,
        );
        let req = Request::from_parts(parts, body);

        let failed = |e: hyper::Error| format!("{uri}: {}", super::order::error_line(&e));
        let (mut sender, pooled) = match self.idle_sender(&authority) {
            Some(s) => (s, true),
            None => (self.connect(&host, port, &authority).await?, false),
        };
        let response = match sender.try_send_request(req).await {
            Ok(response) => response,
            // A kept connection the CA closed before the request went out: once more, on a
            // new one (the request was not sent, so its nonce is unused).
            Err(mut e) if pooled => match e.take_message() {
                Some(req) => {
                    sender = self.connect(&host, port, &authority).await?;
                    sender.send_request(req).await.map_err(failed)?
                }
                None => return Err(failed(e.into_error())),
            },
            Err(e) => return Err(failed(e.into_error())),
        };
        let (mut parts, body) = response.into_parts();
        let body = Limited::new(body, MAX_BODY)
            .collect()
            .await
            .map_err(|e| format!("{uri}: reading the answer: {e}"))?
            .to_bytes();
        if let Some(value) = parts.headers.get(RETRY_AFTER) {
            let at = retry_after(value);
            if parts.status.as_u16() >= 400 {
                if let (Some(at), Ok(mut slot)) = (at, self.retry_after.lock()) {
                    *slot = Some(at);
                }
            }
            // instant-acme adds a Retry-After's seconds to the time without checking: a
            // number too large for the clock would panic there. Bounded here.
            if text_secs(value).is_some_and(|s| s > MAX_RETRY_AFTER_SECS) {
                parts
                    .headers
                    .insert(RETRY_AFTER, http::HeaderValue::from(MAX_RETRY_AFTER_SECS));
            }
        }
        if get && parts.status.is_success() {
            // The directory (RFC 8555 §7.1.1): instant-acme builds requests to its URLs
            // expecting them to parse, and panics if one does not. Refused here instead.
            check_urls(&body).map_err(|why| format!("{uri}: {why}"))?;
        }
        // The answer is read whole: the connection is ready for the next request.
        if let Ok(mut idle) = self.idle.lock() {
            if idle.len() < MAX_IDLE && !sender.is_closed() {
                idle.push((authority, sender));
            }
        }
        Ok(BytesResponse {
            parts,
            body: Box::new(body),
        })
    }

    fn idle_sender(&self, authority: &str) -> Option<SendRequest<BodyWrapper<Bytes>>> {
        let mut idle = self.idle.lock().ok()?;
        idle.retain(|(_, s)| !s.is_closed());
        let i = idle
            .iter()
            .position(|(a, s)| a == authority && s.is_ready())?;
        Some(idle.swap_remove(i).1)
    }

    async fn connect(
        &self,
        host: &str,
        port: u16,
        authority: &str,
    ) -> Result<SendRequest<BodyWrapper<Bytes>>, String> {
        let name = ServerName::try_from(host.to_owned())
            .map_err(|e| format!("{authority}: not a server name: {e}"))?;
        let tcp = tokio::net::TcpStream::connect((host, port))
            .await
            .map_err(|e| format!("connecting to {authority}: {e}"))?;
        let _ = tcp.set_nodelay(true);
        let tls = self
            .tls
            .connect(name, tcp)
            .await
            .map_err(|e| format!("TLS with {authority}: {e}"))?;
        let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
            .await
            .map_err(|e| format!("HTTP/1.1 with {authority}: {e}"))?;
        // The connection runs on the engine's runtime until its sender is dropped.
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!(error = %e, "ACME: connection to the CA ended");
            }
        });
        Ok(sender)
    }
}

/// The longest `Retry-After` passed on to instant-acme: 30 days.
const MAX_RETRY_AFTER_SECS: u64 = 30 * 86_400;

/// A `Retry-After` (RFC 9110 §10.2.3): seconds, or an HTTP date.
fn retry_after(value: &http::HeaderValue) -> Option<SystemTime> {
    match text_secs(value) {
        Some(secs) => SystemTime::now().checked_add(Duration::from_secs(secs)),
        None => httpdate::parse_http_date(value.to_str().ok()?.trim()).ok(),
    }
}

/// A `Retry-After` in seconds, read as instant-acme reads it.
fn text_secs(value: &http::HeaderValue) -> Option<u64> {
    value.to_str().ok()?.trim().parse::<u64>().ok()
}

/// Every string at the top of a JSON object answer is a URL that parses (a directory's are;
/// so is renewal information's `explanationURL`). Other answers pass.
fn check_urls(body: &[u8]) -> Result<(), String> {
    let Ok(serde_json::Value::Object(fields)) = serde_json::from_slice(body) else {
        return Ok(());
    };
    for (key, value) in fields {
        if let serde_json::Value::String(url) = value {
            if Uri::from_str(&url).is_err() {
                return Err(format!("{key} is not a URL"));
            }
        }
    }
    Ok(())
}

fn other(why: String) -> instant_acme::Error {
    instant_acme::Error::Other(why.into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_reads_seconds_and_dates() {
        let now = SystemTime::now();
        let at = retry_after(&http::HeaderValue::from_static("120")).unwrap();
        let d = at.duration_since(now).unwrap();
        assert!(
            d >= Duration::from_secs(119) && d <= Duration::from_secs(121),
            "{d:?}"
        );
        let at = retry_after(&http::HeaderValue::from_static(
            "Wed, 21 Oct 2015 07:28:00 GMT",
        ));
        assert_eq!(
            at,
            Some(SystemTime::UNIX_EPOCH + Duration::from_secs(1_445_412_480))
        );
        assert_eq!(retry_after(&http::HeaderValue::from_static("soon")), None);
        assert_eq!(
            retry_after(&http::HeaderValue::from_static("99999999999999999999")),
            None
        );
    }

    #[test]
    fn directory_urls_that_would_not_parse_are_refused() {
        assert_eq!(
            check_urls(br#"{"newNonce":"https://ca/nonce","meta":{"x":"not a url"}}"#),
            Ok(())
        );
        assert_eq!(check_urls(b"-----BEGIN CERTIFICATE-----"), Ok(()));
        let e = check_urls(br#"{"newNonce":"https://ca/no nce"}"#).unwrap_err();
        assert!(e.contains("newNonce"), "{e}");
    }

    #[test]
    fn a_bad_extra_root_is_named() {
        let e = CaClient::new(&[b"not DER".to_vec()], Duration::from_secs(1))
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("root 0"), "{e}");
    }
}
