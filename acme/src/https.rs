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
    /// The roots trusted, as an operator names them (for a TLS failure's message).
    roots: String,
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

/// Why a request to the CA failed. Each names the URL or the authority, and keeps its source.
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    #[error("{uri}: the CA must be reached over https")]
    NotHttps { uri: Uri },
    #[error("{uri}: no host")]
    NoHost { uri: Uri },
    #[error("{uri}: not a request target")]
    Target {
        uri: Uri,
        #[source]
        error: http::uri::InvalidUri,
    },
    #[error("{uri}: not a Host header")]
    HostHeader { uri: Uri },
    #[error("{authority}: not a server name")]
    ServerName {
        authority: String,
        #[source]
        error: rustls::pki_types::InvalidDnsNameError,
    },
    #[error("connecting to {authority}")]
    Connect {
        authority: String,
        #[source]
        error: std::io::Error,
    },
    /// The TLS handshake failed; when the CA's certificate is not trusted, the message names
    /// the roots that were (`[acme] ca_roots`, the system's), which is where the fix is.
    #[error("TLS with {authority}{}", untrusted_hint(error, roots))]
    Tls {
        authority: String,
        roots: String,
        #[source]
        error: std::io::Error,
    },
    #[error("HTTP/1.1 with {authority}")]
    Handshake {
        authority: String,
        #[source]
        error: hyper::Error,
    },
    #[error("{uri}")]
    Send {
        uri: Uri,
        #[source]
        error: hyper::Error,
    },
    #[error("{uri}: reading the answer")]
    Body {
        uri: Uri,
        #[source]
        error: Box<dyn std::error::Error + Send + Sync>,
    },
    #[error("{uri}: {key} is not a URL")]
    NotUrl { uri: Uri, key: String },
    #[error("{uri}: no answer within {deadline:?}")]
    Deadline { uri: Uri, deadline: Duration },
}

/// `: the CA's certificate is not signed by a trusted root (ROOTS)` when `error` is rustls
/// refusing the CA's certificate; empty otherwise.
fn untrusted_hint(error: &std::io::Error, roots: &str) -> String {
    let refused = error
        .get_ref()
        .and_then(|e| e.downcast_ref::<rustls::Error>())
        .is_some_and(|e| matches!(e, rustls::Error::InvalidCertificate(_)));
    if refused {
        format!(" (the CA's certificate is checked against {roots})")
    } else {
        String::new()
    }
}

impl CaClient {
    /// Trusts the system's roots (as rustls-native-certs finds them: `SSL_CERT_FILE`,
    /// `SSL_CERT_DIR`, else the distribution's bundle) and `extra_roots` (DER). `deadline`
    /// bounds each request.
    /// `roots_file`, the file `extra_roots` came from, is named in errors.
    pub fn new(
        extra_roots: &[Vec<u8>],
        roots_file: Option<&std::path::Path>,
        deadline: Duration,
    ) -> Result<CaClient, ClientError> {
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
        let described = match roots_file {
            Some(file) if added > 0 => format!(
                "[acme] ca_roots ({}) and the system's {added} roots",
                file.display()
            ),
            Some(file) => format!("[acme] ca_roots ({}) only", file.display()),
            None => {
                format!("the system's {added} roots; a private CA's root goes in [acme] ca_roots")
            }
        };
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
                roots: described,
                deadline,
                idle: Mutex::new(Vec::new()),
                retry_after: Mutex::new(None),
            }),
        })
    }

    /// GETs `uri` (within the deadline): its status and body.
    pub async fn get(&self, uri: Uri) -> Result<(http::StatusCode, Bytes), RequestError> {
        let mut req = Request::new(BodyWrapper::from(Vec::new()));
        *req.uri_mut() = uri.clone();
        let deadline = self.inner.deadline;
        let (parts, body) = tokio::time::timeout(deadline, self.inner.exchange(req))
            .await
            .map_err(|_| RequestError::Deadline { uri, deadline })??;
        Ok((parts.status, body))
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
            match tokio::time::timeout(inner.deadline, inner.exchange(req)).await {
                Ok(Ok((parts, body))) => Ok(BytesResponse {
                    parts,
                    body: Box::new(body),
                }),
                Ok(Err(why)) => Err(other(why)),
                Err(_) => Err(other(RequestError::Deadline {
                    uri,
                    deadline: inner.deadline,
                })),
            }
        })
    }
}

impl Inner {
    /// Sends `req` and reads the whole answer.
    async fn exchange(
        &self,
        req: Request<BodyWrapper<Bytes>>,
    ) -> Result<(http::response::Parts, Bytes), RequestError> {
        let (mut parts, body) = req.into_parts();
        let uri = parts.uri.clone();
        let get = parts.method == http::Method::GET;
        if uri.scheme_str() != Some("https") {
            return Err(RequestError::NotHttps { uri });
        }
        let (Some(host), Some(authority)) = (uri.host(), uri.authority()) else {
            return Err(RequestError::NoHost { uri });
        };
        let authority = authority.as_str().to_owned();
        let host = host
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_owned();
        let port = uri.port_u16().unwrap_or(443);
        // Origin form with a Host header: what a client connection sends (RFC 9112 §3.2).
        let path = uri.path_and_query().map_or("/", |p| p.as_str());
        parts.uri = Uri::from_str(path).map_err(|error| RequestError::Target {
            uri: uri.clone(),
            error,
        })?;
        let host_header = authority
            .parse()
            .map_err(|_| RequestError::HostHeader { uri: uri.clone() })?;
        parts.headers.insert(HOST, host_header);
        let req = Request::from_parts(parts, body);

        let failed = |error: hyper::Error| RequestError::Send {
            uri: uri.clone(),
            error,
        };
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
            .map_err(|error| RequestError::Body {
                uri: uri.clone(),
                error,
            })?
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
            if let Some(key) = not_url(&body) {
                return Err(RequestError::NotUrl { uri, key });
            }
        }
        // The answer is read whole: the connection is ready for the next request.
        if let Ok(mut idle) = self.idle.lock() {
            if idle.len() < MAX_IDLE && !sender.is_closed() {
                idle.push((authority, sender));
            }
        }
        Ok((parts, body))
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
    ) -> Result<SendRequest<BodyWrapper<Bytes>>, RequestError> {
        let authority = || authority.to_owned();
        let name =
            ServerName::try_from(host.to_owned()).map_err(|error| RequestError::ServerName {
                authority: authority(),
                error,
            })?;
        let tcp = tokio::net::TcpStream::connect((host, port))
            .await
            .map_err(|error| RequestError::Connect {
                authority: authority(),
                error,
            })?;
        let _ = tcp.set_nodelay(true);
        let tls = self
            .tls
            .connect(name, tcp)
            .await
            .map_err(|error| RequestError::Tls {
                authority: authority(),
                roots: self.roots.clone(),
                error,
            })?;
        let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
            .await
            .map_err(|error| RequestError::Handshake {
                authority: authority(),
                error,
            })?;
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

/// The first key of a JSON object answer whose string value is not a URL that parses: every
/// such string of a directory is a URL (so is renewal information's `explanationURL`). Other
/// answers have none.
fn not_url(body: &[u8]) -> Option<String> {
    let Ok(serde_json::Value::Object(fields)) = serde_json::from_slice(body) else {
        return None;
    };
    fields.into_iter().find_map(|(key, value)| match value {
        serde_json::Value::String(url) if Uri::from_str(&url).is_err() => Some(key),
        _ => None,
    })
}

fn other(why: RequestError) -> instant_acme::Error {
    instant_acme::Error::Other(Box::new(why))
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
            not_url(br#"{"newNonce":"https://ca/nonce","meta":{"x":"not a url"}}"#),
            None
        );
        assert_eq!(not_url(b"-----BEGIN CERTIFICATE-----"), None);
        let key = not_url(br#"{"newNonce":"https://ca/no nce"}"#);
        assert_eq!(key.as_deref(), Some("newNonce"));
    }

    #[test]
    fn a_bad_extra_root_is_named() {
        let e = CaClient::new(&[b"not DER".to_vec()], None, Duration::from_secs(1))
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("root 0"), "{e}");
    }

    /// A CA whose certificate no trusted root signed: the error names `[acme] ca_roots` and
    /// its file, where the fix is.
    #[tokio::test]
    async fn an_untrusted_ca_names_the_roots_it_was_checked_against() {
        let served = rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap();
        let other = rcgen::generate_simple_self_signed(vec!["other.test".into()]).unwrap();
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(
                vec![served.cert.der().clone()],
                rustls::pki_types::PrivateKeyDer::Pkcs8(served.signing_key.serialize_der().into()),
            )
            .unwrap();
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        tokio::spawn(async move {
            if let Ok((tcp, _)) = listener.accept().await {
                let _ = acceptor.accept(tcp).await;
            }
        });
        let roots = std::path::Path::new("/etc/ringmux/test-roots.pem");
        let client = CaClient::new(
            &[other.cert.der().to_vec()],
            Some(roots),
            Duration::from_secs(10),
        )
        .unwrap();
        let connected = client
            .inner
            .connect("localhost", port, &format!("localhost:{port}"))
            .await;
        let Err(e) = connected else {
            panic!("an untrusted certificate was accepted");
        };
        let line = ringmux_proto::one_line(&e);
        assert!(
            line.contains("[acme] ca_roots (/etc/ringmux/test-roots.pem)"),
            "{line}"
        );
        assert!(
            line.contains(&format!("TLS with localhost:{port}")),
            "{line}"
        );
    }
}
