//! TLS and HTTP/2 upstreams end to end: a real ringmux with one site whose routes reach
//! backends the test starts, with a private CA and leaf made here (rcgen).
//!
//! * `https://` verified against the route's `upstream_ca`, with the name `upstream_sni` (the
//!   backend reports the SNI it got): 200. The same backend under another CA: 502 saying
//!   "unknown CA"; asked by its IP address (no SNI, an IP the certificate does not hold): 502
//!   saying the name does not match. Both counted under `kind="tls"`.
//! * `h2://` (HTTP/2 over TLS, ALPN `h2`) to the same backend, which reports the protocol.
//! * A gRPC-like echo over `h2c://` (length-prefixed messages, `grpc-status` in trailers) from
//!   an HTTP/2 client and an HTTP/3 client: each message echoed before the next is sent (both
//!   bodies stream), `te: trailers` reaching the backend, the trailers reaching the client.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use harness::{bounded, Forward, Ringmux};
use http::{HeaderMap, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper_util::rt::{TokioExecutor, TokioIo};
use ringmux_demux::metrics::names;
use ringmux_systests::harness;
use ringmux_testkit::tcp_client::{ClientBody, TcpConn, Version};
use ringmux_testkit::temp_dir;

const LIMIT: Duration = Duration::from_secs(120);

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The name the backend's certificate is for, and the SNI ringmux must send.
const BACKEND_NAME: &str = "backend.test";

/// A CA (its certificate as PEM) and a leaf it signed for `names`, with the leaf's key.
struct Pki {
    ca_pem: String,
    leaf: rustls::pki_types::CertificateDer<'static>,
    key: rustls::pki_types::PrivateKeyDer<'static>,
}

fn pki(names: &[&str]) -> Pki {
    let ca_key = rcgen::KeyPair::generate().expect("a CA key");
    let mut ca = rcgen::CertificateParams::new(Vec::<String>::new()).expect("CA parameters");
    ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    ca.distinguished_name
        .push(rcgen::DnType::CommonName, "ringmux test upstream CA");
    let ca_cert = ca.self_signed(&ca_key).expect("the CA certificate");
    let issuer = rcgen::Issuer::new(ca, ca_key);
    let leaf_key = rcgen::KeyPair::generate().expect("a leaf key");
    let leaf =
        rcgen::CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())
            .expect("leaf parameters")
            .signed_by(&leaf_key, &issuer)
            .expect("the leaf certificate");
    Pki {
        ca_pem: ca_cert.pem(),
        leaf: leaf.der().clone(),
        key: rustls::pki_types::PrivateKeyDer::Pkcs8(leaf_key.serialize_der().into()),
    }
}

/// A TLS backend (ALPN `h2` or `http/1.1`) answering every request with the SNI it was asked
/// for, the ALPN chosen and the request's version and path.
async fn tls_backend(pki: &Pki) -> SocketAddr {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("TLS versions")
        .with_no_client_auth()
        .with_single_cert(vec![pki.leaf.clone()], pki.key.clone_key())
        .expect("the backend's certificate");
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                // A handshake ringmux refuses ends here.
                let Ok(tls) = acceptor.accept(tcp).await else {
                    return;
                };
                let conn = tls.get_ref().1;
                let sni = conn.server_name().unwrap_or("-").to_string();
                let alpn = conn
                    .alpn_protocol()
                    .map_or("-".into(), |a| String::from_utf8_lossy(a).into_owned());
                let h2 = alpn == "h2";
                let service = hyper::service::service_fn(move |req: Request<Incoming>| {
                    let text = format!(
                        "sni={sni} alpn={alpn} version={:?} path={}\n",
                        req.version(),
                        req.uri().path()
                    );
                    async move { Ok::<_, Infallible>(Response::new(Full::new(Bytes::from(text)))) }
                });
                let io = TokioIo::new(tls);
                let _ = match h2 {
                    true => {
                        hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                            .serve_connection(io, service)
                            .await
                    }
                    false => {
                        hyper::server::conn::http1::Builder::new()
                            .serve_connection(io, service)
                            .await
                    }
                };
            });
        }
    });
    addr
}

/// A gRPC-like echo over HTTP/2 in the clear: each length-prefixed message of the request
/// (gRPC's framing: a flag byte, a 4-byte length) is sent back as soon as it is whole, then
/// trailers `grpc-status: 0` and `grpc-message` with the count. The response head says which
/// `te` the request carried (`x-saw-te`).
async fn grpc_echo() -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            tokio::spawn(async move {
                let service = hyper::service::service_fn(|req: Request<Incoming>| async move {
                    Ok::<_, Infallible>(echo(req))
                });
                let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(tcp), service)
                    .await;
            });
        }
    });
    addr
}

type EchoBody =
    StreamBody<futures_util::stream::BoxStream<'static, Result<Frame<Bytes>, Infallible>>>;

fn echo(req: Request<Incoming>) -> Response<EchoBody> {
    let saw_te = req
        .headers()
        .get(http::header::TE)
        .cloned()
        .unwrap_or(HeaderValue::from_static("none"));
    let (tx, rx) = tokio::sync::mpsc::channel::<Frame<Bytes>>(4);
    let mut body = req.into_body();
    tokio::spawn(async move {
        let mut buf = BytesMut::new();
        let mut count = 0u32;
        while let Some(Ok(frame)) = body.frame().await {
            let Ok(data) = frame.into_data() else {
                continue;
            };
            buf.put(data);
            while buf.len() >= 5 {
                let len = u32::from_be_bytes([buf[1], buf[2], buf[3], buf[4]]) as usize;
                if buf.len() < 5 + len {
                    break;
                }
                let message = buf.split_to(5 + len).freeze();
                count += 1;
                if tx.send(Frame::data(message)).await.is_err() {
                    return;
                }
            }
        }
        let mut trailers = HeaderMap::new();
        trailers.insert("grpc-status", HeaderValue::from_static("0"));
        trailers.insert(
            "grpc-message",
            HeaderValue::from_str(&format!("echoed {count}")).unwrap(),
        );
        let _ = tx.send(Frame::trailers(trailers)).await;
    });
    let frames =
        futures_util::stream::unfold(
            rx,
            |mut rx| async move { rx.recv().await.map(|f| (Ok(f), rx)) },
        );
    let mut resp = Response::new(StreamBody::new(Box::pin(frames) as _));
    let h = resp.headers_mut();
    h.insert("content-type", HeaderValue::from_static("application/grpc"));
    h.insert("x-saw-te", saw_te);
    resp
}

/// One gRPC message: a flag byte 0, the length, the bytes.
fn message(text: &str) -> Bytes {
    let mut b = BytesMut::with_capacity(5 + text.len());
    b.put_u8(0);
    b.put_u32(text.len() as u32);
    b.put_slice(text.as_bytes());
    b.freeze()
}

fn write(dir: &Path, name: &str, text: &str) -> String {
    use std::os::unix::fs::PermissionsExt;
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
    path.display().to_string()
}

/// ringmux with one site, `localhost`, whose routes reach the TLS backend `tls` (with the
/// right CA, another CA, no SNI) and the echo `grpc`.
fn ringmux(dir: &Path, tls: SocketAddr, grpc: SocketAddr, right: &Pki, other: &Pki) -> Ringmux {
    let site = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).unwrap();
    let cert = write(dir, "site.pem", &site.cert.pem());
    let key = write(dir, "site.key", &site.signing_key.serialize_pem());
    let ca = write(dir, "ca.pem", &right.ca_pem);
    let other_ca = write(dir, "other-ca.pem", &other.ca_pem);
    let config = format!(
        r#"default_site = "localhost"
[[site]]
names = ["localhost"]
cert = "{cert}"
key = "{key}"
  [[site.route]]
  path = "/tls"
  upstream = "https://{tls}"
  upstream_ca = "{ca}"
  upstream_sni = "{BACKEND_NAME}"
  [[site.route]]
  path = "/wrong-ca"
  upstream = "https://{tls}"
  upstream_ca = "{other_ca}"
  upstream_sni = "{BACKEND_NAME}"
  [[site.route]]
  path = "/wrong-name"
  upstream = "https://{tls}"
  upstream_ca = "{ca}"
  [[site.route]]
  path = "/h2"
  upstream = "h2://{tls}"
  upstream_ca = "{ca}"
  upstream_sni = "{BACKEND_NAME}"
  [[site.route]]
  path = "/echo.Echo"
  upstream = "h2c://{grpc}"
"#
    );
    let file = write(dir, "ringmux.toml", &config);
    Ringmux::start(1, Forward::Shm, &["--config", &file])
}

/// Over HTTP/3 and HTTP/2: the TLS routes answer as their settings say, and the echo streams
/// both ways with its trailers intact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_and_http2_upstreams_with_grpc_trailers() {
    let dir = temp_dir("ringmux-upstream-tls");
    let right = pki(&[BACKEND_NAME]);
    let other = pki(&[BACKEND_NAME]);
    let tls = tls_backend(&right).await;
    let grpc = grpc_echo().await;
    let rm = ringmux(dir.path(), tls, grpc, &right, &other);
    bounded(LIMIT, async {
        let conn = rm.connect(&rm.client()).await;
        for (path, status, says) in [
            (
                "/tls/a",
                StatusCode::OK,
                format!("sni={BACKEND_NAME} alpn=http/1.1 version=HTTP/1.1 path=/tls/a\n"),
            ),
            (
                "/h2/b",
                StatusCode::OK,
                format!("sni={BACKEND_NAME} alpn=h2 version=HTTP/2.0 path=/h2/b\n"),
            ),
            (
                "/wrong-ca",
                StatusCode::BAD_GATEWAY,
                "upstream TLS: the upstream's certificate is from an unknown CA".into(),
            ),
            (
                "/wrong-name",
                StatusCode::BAD_GATEWAY,
                "upstream TLS: the upstream's certificate is not valid for the name asked".into(),
            ),
        ] {
            let resp = conn.get_body(path).await.expect(path);
            let text =
                String::from_utf8_lossy(resp.body.as_deref().unwrap_or_default()).into_owned();
            assert_eq!(resp.status, status, "{path}: {text}");
            assert!(text.starts_with(&says), "{path}: {text}");
        }
        rm.wait_for("the TLS failures counted", Duration::from_secs(20), |m| {
            m.sum_where(names::WORKER_UPSTREAM_ERRORS, "kind", "tls") == 2.0
        })
        .await;
        // The log says why in rustls' words.
        rm.wait_for_log("the TLS failure logged", Duration::from_secs(20), |log| {
            log.lines().any(|l| {
                l.contains("upstream failing")
                    && l.contains("kind=\"tls\"")
                    && l.contains("invalid peer certificate")
            })
        })
        .await;

        echo_over_h3(&conn).await;
        let tcp = SocketAddr::new(rm.listen.ip(), rm.listen.port());
        let mut h2 = TcpConn::connect(tcp, Version::Http2)
            .await
            .expect("HTTP/2 over TLS");
        echo_over_h2(&mut h2).await;
    })
    .await;
}

/// The first whole gRPC message of `buf`, taken off it: its bytes without the prefix.
fn take_message(buf: &mut BytesMut) -> Option<Bytes> {
    if buf.len() < 5 {
        return None;
    }
    let len = u32::from_be_bytes([buf[1], buf[2], buf[3], buf[4]]) as usize;
    (buf.len() >= 5 + len).then(|| buf.split_to(5 + len).freeze().slice(5..))
}

fn grpc_request<B>(body: B) -> Request<B> {
    Request::builder()
        .method(Method::POST)
        .uri("https://localhost/echo.Echo/Chat")
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(body)
        .unwrap()
}

async fn echo_over_h3(conn: &ringmux_testkit::client::H3Conn) {
    let mut stream = conn
        .open(grpc_request(()))
        .await
        .expect("open the gRPC stream");
    let mut buf = BytesMut::new();
    stream.send_data(message("one")).await.expect("message one");
    let head = stream.recv_response().await.expect("the response head");
    assert_eq!(head.status(), StatusCode::OK);
    assert_eq!(
        head.headers()["x-saw-te"],
        "trailers",
        "te reaches the backend"
    );
    // Each echo comes back before the next message is sent: both bodies stream.
    for text in ["one", "two"] {
        if text != "one" {
            stream.send_data(message(text)).await.expect("message");
        }
        let got = loop {
            if let Some(m) = take_message(&mut buf) {
                break m;
            }
            let mut chunk = stream
                .recv_data()
                .await
                .expect("response data")
                .expect("the body ended inside a message");
            buf.put(chunk.copy_to_bytes(chunk.remaining()));
        };
        assert_eq!(got, text.as_bytes(), "HTTP/3");
    }
    stream.finish().await.expect("the end of the request");
    assert!(stream
        .recv_data()
        .await
        .expect("the end of the data")
        .is_none());
    let trailers = stream
        .recv_trailers()
        .await
        .expect("trailers")
        .expect("some trailers");
    assert_eq!(trailers["grpc-status"], "0", "HTTP/3: {trailers:?}");
    assert_eq!(trailers["grpc-message"], "echoed 2", "HTTP/3: {trailers:?}");
}

async fn echo_over_h2(conn: &mut TcpConn) {
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, BoxError>>(4);
    let frames =
        futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|f| (f, rx)) });
    let body: ClientBody = StreamBody::new(frames).boxed_unsync();
    tx.send(Ok(Frame::data(message("one")))).await.unwrap();
    let resp = conn
        .send(grpc_request(body))
        .await
        .expect("the response head");
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(
        resp.headers()["x-saw-te"],
        "trailers",
        "te reaches the backend"
    );
    let mut body = resp.into_body();
    let mut buf = BytesMut::new();
    let mut trailers = None;
    for text in ["one", "two"] {
        if text != "one" {
            tx.send(Ok(Frame::data(message(text)))).await.unwrap();
        }
        let got = loop {
            if let Some(m) = take_message(&mut buf) {
                break m;
            }
            let frame = body
                .frame()
                .await
                .expect("the body ended inside a message")
                .expect("a response frame");
            match frame.into_data() {
                Ok(data) => buf.put(data),
                Err(f) => trailers = f.into_trailers().ok(),
            }
        };
        assert_eq!(got, text.as_bytes(), "HTTP/2");
    }
    drop(tx);
    while let Some(frame) = body.frame().await {
        if let Ok(t) = frame.expect("a response frame").into_trailers() {
            trailers = Some(t);
        }
    }
    let trailers = trailers.expect("trailers over HTTP/2");
    assert_eq!(trailers["grpc-status"], "0", "HTTP/2: {trailers:?}");
    assert_eq!(trailers["grpc-message"], "echoed 2", "HTTP/2: {trailers:?}");
}
