//! ACME challenges over TCP: `tcp::serve` and `tcp::serve_redirects` on loopback with the
//! worker library's [`SiteCerts`] and [`AcmeAnswers`], as the built-in worker wires them, asked
//! by rustls clients that take any certificate (a TLS-ALPN-01 certificate carries the critical
//! `acmeIdentifier` extension no path validation accepts; the CA checks it by hand), so each
//! test looks at which certificate it got. TLS-ALPN-01 (RFC 8737) on the HTTPS listener,
//! HTTP-01 (RFC 8555 §8.3) on the plain-HTTP one; that QUIC never answers a challenge is
//! `ringmux_worker::acme`'s test.
//!
//! Every test body runs under a timeout, and every wait is on an event, never a sleep.

use std::net::SocketAddr;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

use ringmux_proto::message::{ChallengeSet, Http01, TlsAlpn01, ACME_TLS_ALPN};
use ringmux_proto::sites::{Action, Route, Site, SiteTable};
use ringmux_server::redirect::serve_redirects;
use ringmux_server::sites::{Router, RouterOptions};
use ringmux_server::stats::ServerStats;
use ringmux_server::tcp::{serve, TcpErrorKind, TcpOptions};
use ringmux_testkit::tls::AnyCertificate;
use ringmux_worker::tls::{tcp_tls_config, SiteCerts};
use ringmux_worker::AcmeAnswers;
use rustls::pki_types::{CertificateDer, ServerName};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::watch;

const TEST_TIMEOUT: Duration = Duration::from_secs(60);

async fn bounded<F: std::future::Future<Output = ()>>(f: F) {
    tokio::time::timeout(TEST_TIMEOUT, f)
        .await
        .expect("test timed out");
}

/// A certificate and its key, PEM.
struct Pem {
    cert: String,
    key: String,
}

impl Pem {
    /// A self-signed certificate for `name`; with `acme_identifier`, the critical
    /// `acmeIdentifier` extension holding it (RFC 8737 §3: the SHA-256 of the key
    /// authorization), as a TLS-ALPN-01 certificate.
    fn for_name(name: &str, acme_identifier: Option<&[u8; 32]>) -> Pem {
        let mut params = rcgen::CertificateParams::new(vec![name.to_string()]).unwrap();
        if let Some(digest) = acme_identifier {
            params.custom_extensions = vec![rcgen::CustomExtension::new_acme_identifier(digest)];
        }
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = params.self_signed(&key).unwrap();
        Pem {
            cert: cert.pem(),
            key: key.serialize_pem(),
        }
    }

    fn leaf(&self) -> CertificateDer<'static> {
        use rustls::pki_types::pem::PemObject;
        CertificateDer::from_pem_slice(self.cert.as_bytes()).unwrap()
    }
}

/// Both listeners of one worker: the ACME site `a.test` (its certificate installed as the
/// demux's first `CERTIFICATE` would) and `b.test`, whose certificate is the operator's.
struct Server {
    https: SocketAddr,
    http: SocketAddr,
    answers: AcmeAnswers,
    site: Pem,
    stats: Arc<ServerStats>,
    _stop: watch::Sender<bool>,
}

/// The key authorization of the HTTP-01 challenge, and its token.
const TOKEN: &str = "evaGxfADs6pSRb2LAv9IZf17Dt3juxGJ-PCt92wr-oA";
const KEY_AUTHORIZATION: &str =
    "evaGxfADs6pSRb2LAv9IZf17Dt3juxGJ-PCt92wr-oA.nP1qzpXGymHBrUEepNY9HCsQk7K8KhOypzEt62jcerQ";

impl Server {
    async fn start() -> Server {
        let site = Pem::for_name("a.test", None);
        let operator = Pem::for_name("b.test", None);
        let respond = |label: &str, acme: bool, pem: Option<&Pem>| Site {
            label: label.into(),
            names: vec![label.into()],
            cert_pem: pem.map(|p| p.cert.clone()).unwrap_or_default(),
            key_pem: pem.map(|p| p.key.clone()).unwrap_or_default(),
            acme,
            redirect_names: Vec::new(),
            compress: None,
            rules: Default::default(),
            routes: vec![Route {
                compress: None,
                path: "/".into(),
                action: Action::Respond(
                    ringmux_proto::route::Respond::new(200, &format!("{label}\n")).unwrap(),
                ),
                rules: Default::default(),
                limits: Default::default(),
            }],
            limits: Default::default(),
        };
        let table = SiteTable {
            sites: vec![
                respond("a.test", true, None),
                respond("b.test", false, Some(&operator)),
            ],
            default_site: None,
        };
        let certs = SiteCerts::new(&table).unwrap();
        certs.install(0, &site.cert, &site.key).unwrap();
        let tls = Arc::new(tcp_tls_config(&certs).unwrap());
        let router = Router::new(&table, &RouterOptions::default()).unwrap();
        let answers = AcmeAnswers::new();
        let stats = Arc::new(ServerStats::default());
        let (stop, stop_rx) = watch::channel(false);
        let opts = TcpOptions {
            acme: answers.clone(),
            ..TcpOptions::default()
        };
        let https = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let http = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let (https_addr, http_addr) = (https.local_addr().unwrap(), http.local_addr().unwrap());
        tokio::spawn(serve(
            https,
            tls,
            router.clone(),
            stats.clone(),
            stop_rx.clone(),
            opts.clone(),
        ));
        tokio::spawn(serve_redirects(
            http,
            https_addr.port(),
            router,
            stats.clone(),
            stop_rx,
            opts,
        ));
        Server {
            https: https_addr,
            http: http_addr,
            answers,
            site,
            stats,
            _stop: stop,
        }
    }

    /// Sets the pending challenges: a TLS-ALPN-01 certificate for `name` (returned) and the
    /// HTTP-01 token [`TOKEN`].
    fn challenge(&self, name: &str) -> Pem {
        let pem = Pem::for_name(name, Some(&[0xa5; 32]));
        self.answers
            .replace(&ChallengeSet {
                seq: 1,
                http01: vec![Http01 {
                    name: name.into(),
                    token: TOKEN.into(),
                    key_authorization: KEY_AUTHORIZATION.into(),
                }],
                tls_alpn01: vec![TlsAlpn01 {
                    name: name.into(),
                    cert_pem: pem.cert.clone(),
                    key_pem: pem.key.clone(),
                }],
            })
            .unwrap();
        pem
    }

    /// A TLS handshake naming `name`, offering `alpn` over `versions`.
    async fn handshake(
        &self,
        name: &str,
        alpn: &[&[u8]],
        versions: &[&'static rustls::SupportedProtocolVersion],
    ) -> Result<tokio_rustls::client::TlsStream<tokio::net::TcpStream>, rustls::Error> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut config = rustls::ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(versions)
            .unwrap()
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(AnyCertificate))
            .with_no_client_auth();
        config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        let tcp = tokio::net::TcpStream::connect(self.https).await.unwrap();
        let name = ServerName::try_from(name.to_string()).unwrap();
        tokio_rustls::TlsConnector::from(Arc::new(config))
            .connect(name, tcp)
            .await
            .map_err(|e| {
                let inner = e.get_ref().and_then(|e| e.downcast_ref::<rustls::Error>());
                inner
                    .cloned()
                    .unwrap_or_else(|| rustls::Error::General(e.to_string()))
            })
    }

    /// `request` on the plain-HTTP listener, the connection closed after it: the response
    /// head and body.
    async fn plain(&self, request: &str) -> (String, Vec<u8>) {
        let mut tcp = tokio::net::TcpStream::connect(self.http).await.unwrap();
        tcp.write_all(request.as_bytes()).await.unwrap();
        let mut raw = Vec::new();
        tcp.read_to_end(&mut raw).await.unwrap();
        let split = raw
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .expect("a response head");
        let head = String::from_utf8(raw[..split].to_vec()).unwrap();
        (head, raw[split + 4..].to_vec())
    }

    fn tls_failed(&self) -> u64 {
        self.stats.tcp_errors[TcpErrorKind::TlsFailed as usize].load(Relaxed)
    }
}

const BOTH: [&rustls::SupportedProtocolVersion; 2] =
    [&rustls::version::TLS13, &rustls::version::TLS12];

fn leaf_of(tls: &tokio_rustls::client::TlsStream<tokio::net::TcpStream>) -> CertificateDer<'_> {
    tls.get_ref().1.peer_certificates().unwrap()[0].clone()
}

/// A ClientHello offering `acme-tls/1` alone for a name with a pending challenge gets the
/// challenge's certificate and `acme-tls/1`, over TLS 1.3 and 1.2, in any case of the name,
/// and the server ends the connection after the handshake (`close_notify`).
#[tokio::test]
async fn tls_alpn01_gets_the_challenge_certificate_then_the_end() {
    bounded(async {
        let server = Server::start().await;
        let challenge = server.challenge("a.test");
        for (name, versions) in [
            ("a.test", &BOTH[..]),
            ("a.test", &BOTH[1..]),
            ("A.Test", &BOTH[..1]),
        ] {
            let mut tls = server
                .handshake(name, &[ACME_TLS_ALPN], versions)
                .await
                .unwrap_or_else(|e| panic!("{name} {versions:?}: {e}"));
            assert_eq!(leaf_of(&tls), challenge.leaf(), "{name} {versions:?}");
            assert_eq!(tls.get_ref().1.alpn_protocol(), Some(ACME_TLS_ALPN));
            let mut rest = Vec::new();
            assert_eq!(tls.read_to_end(&mut rest).await.unwrap(), 0, "no HTTP");
        }
        assert_eq!(server.tls_failed(), 0);
    })
    .await;
}

/// A ClientHello offering `acme-tls/1` gets no site's certificate: refused with
/// `no_application_protocol` for a name without a challenge (a site's, or no site's), when
/// it offers another protocol too, and once the set that held the challenge is replaced.
#[tokio::test]
async fn acme_tls_without_a_pending_challenge_is_refused() {
    bounded(async {
        let server = Server::start().await;
        server.challenge("a.test");
        let refusals: [(&str, &[&[u8]]); 4] = [
            ("b.test", &[ACME_TLS_ALPN]),
            ("unknown.test", &[ACME_TLS_ALPN]),
            ("a.test", &[ACME_TLS_ALPN, b"h2"]),
            ("a.test", &[b"http/1.1", ACME_TLS_ALPN]),
        ];
        for (name, alpn) in refusals {
            let refused = server.handshake(name, alpn, &BOTH).await;
            assert!(
                matches!(
                    refused,
                    Err(rustls::Error::AlertReceived(
                        rustls::AlertDescription::NoApplicationProtocol
                    ))
                ),
                "{name} {alpn:?}: {:?}",
                refused.map(|_| ())
            );
        }
        assert_eq!(server.tls_failed(), 4);
        server.answers.replace(&ChallengeSet::default()).unwrap();
        let refused = server.handshake("a.test", &[ACME_TLS_ALPN], &BOTH).await;
        assert!(refused.is_err(), "the challenge was withdrawn");
        assert_eq!(server.tls_failed(), 5);
    })
    .await;
}

/// With a challenge pending for its name, a client that does not offer `acme-tls/1` gets
/// the site's certificate and its protocol, and is served.
#[tokio::test]
async fn a_normal_client_gets_the_site_certificate() {
    bounded(async {
        let server = Server::start().await;
        server.challenge("a.test");
        let h2 = server
            .handshake("a.test", &[b"h2", b"http/1.1"], &BOTH)
            .await
            .unwrap();
        assert_eq!(leaf_of(&h2), server.site.leaf());
        assert_eq!(h2.get_ref().1.alpn_protocol(), Some(&b"h2"[..]));
        let mut h1 = server.handshake("a.test", &[], &BOTH).await.unwrap();
        assert_eq!(leaf_of(&h1), server.site.leaf());
        h1.write_all(b"GET / HTTP/1.1\r\nhost: a.test\r\nconnection: close\r\n\r\n")
            .await
            .unwrap();
        let mut raw = Vec::new();
        h1.read_to_end(&mut raw).await.unwrap();
        let text = String::from_utf8_lossy(&raw);
        assert!(
            text.starts_with("HTTP/1.1 200") && text.ends_with("\r\n\r\na.test\n"),
            "{text}"
        );
        assert_eq!(server.tls_failed(), 0);
    })
    .await;
}

/// On the plain-HTTP listener, `GET` and `HEAD` of a pending token get its key authorization
/// as `text/plain`, whatever the host; any other path, token or method, and a token whose set
/// was replaced, gets the redirect as before.
#[tokio::test]
async fn http01_answers_the_token_and_redirects_the_rest() {
    bounded(async {
        let server = Server::start().await;
        server.challenge("a.test");
        let path = format!("/.well-known/acme-challenge/{TOKEN}");
        let ask = |method: &str, path: &str, host: &str| {
            format!("{method} {path} HTTP/1.1\r\nhost: {host}\r\nconnection: close\r\n\r\n")
        };
        let (head, body) = server.plain(&ask("GET", &path, "a.test")).await;
        assert!(head.starts_with("HTTP/1.1 200"), "{head}");
        assert!(head.contains("content-type: text/plain"), "{head}");
        assert_eq!(body, KEY_AUTHORIZATION.as_bytes());
        let (head, body) = server.plain(&ask("GET", &path, "other.test")).await;
        assert!(head.starts_with("HTTP/1.1 200"), "{head}");
        assert_eq!(body, KEY_AUTHORIZATION.as_bytes());
        let (head, body) = server.plain(&ask("HEAD", &path, "a.test")).await;
        assert!(head.starts_with("HTTP/1.1 200"), "{head}");
        assert!(
            head.contains(&format!("content-length: {}", KEY_AUTHORIZATION.len())),
            "{head}"
        );
        assert!(body.is_empty());

        let port = server.https.port();
        let redirected = |path: &str| format!("location: https://a.test:{port}{path}");
        for (method, path) in [
            ("GET", "/.well-known/acme-challenge/unknown".to_string()),
            ("GET", format!("/.well-known/acme-challenge/{TOKEN}x")),
            ("GET", format!("/.well-known/acme-challenge/{TOKEN}/")),
            ("GET", format!("/{TOKEN}")),
            ("POST", path.clone()),
        ] {
            let (head, _) = server.plain(&ask(method, &path, "a.test")).await;
            assert!(head.starts_with("HTTP/1.1 301"), "{method} {path}: {head}");
            assert!(head.contains(&redirected(&path)), "{method} {path}: {head}");
        }
        server.answers.replace(&ChallengeSet::default()).unwrap();
        let (head, _) = server.plain(&ask("GET", &path, "a.test")).await;
        assert!(head.starts_with("HTTP/1.1 301"), "{head}");
    })
    .await;
}
