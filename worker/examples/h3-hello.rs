//! A minimal HTTP/3 application behind ringmux: `GET /` says hello (and which instance
//! answered) in JSON, `POST /echo` parses a JSON body and sends it back (400 if it is not JSON).
//! It answers the same over HTTPS on TCP (HTTP/1.1 and HTTP/2, hyper) when ringmux hands it the
//! listener (`--tcp on`, the default), with an `alt-svc` field so browsers find HTTP/3. Run it
//! as ringmux's instances:
//!
//! ```text
//! cargo build --release --examples
//! target/release/ringmux --worker-cmd target/release/examples/h3-hello
//! ```

use bytes::{Buf, Bytes, BytesMut};
use h3::error::StreamError;
use http::{Method, Response, StatusCode};
use ringmux_worker::Worker;
use serde_json::json;

type Stream = h3::server::RequestStream<h3_quinn::BidiStream<Bytes>, Bytes>;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let worker = Worker::attach()?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let tls = worker.tls_config(&[b"h3"])?;
        let endpoint = worker.endpoint(worker.server_config(tls)?)?;
        let instance = worker.instance();
        if let Some(listener) = worker.tcp_listener() {
            let listener = tokio::net::TcpListener::from_std(listener)?;
            let tls =
                tokio_rustls::TlsAcceptor::from(std::sync::Arc::new(worker.tcp_tls_config()?));
            let alt_svc = worker.alt_svc().map(str::to_owned);
            let mut drain = worker.drain_signal();
            tokio::spawn(async move {
                loop {
                    let accepted = tokio::select! {
                        a = listener.accept() => a,
                        _ = drain.wait() => break,
                    };
                    let Ok((tcp, _)) = accepted else { continue };
                    let (tls, alt_svc) = (tls.clone(), alt_svc.clone());
                    tokio::spawn(async move {
                        let Ok(stream) = tls.accept(tcp).await else {
                            return;
                        };
                        let service = hyper::service::service_fn(move |req| {
                            answer_tcp(req, instance, alt_svc.clone())
                        });
                        let builder = hyper_util::server::conn::auto::Builder::new(
                            hyper_util::rt::TokioExecutor::new(),
                        );
                        let _ = builder
                            .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                            .await;
                    });
                }
            });
        }
        let mut drain = worker.drain_signal();
        loop {
            let incoming = tokio::select! {
                i = endpoint.accept() => i,
                _ = drain.wait() => None,
            };
            let Some(incoming) = incoming else { break };
            let drain = worker.drain_signal();
            tokio::spawn(async move {
                let Ok(conn) = incoming.await else { return };
                let Ok(mut h3) = h3::server::builder()
                    .build::<_, Bytes>(h3_quinn::Connection::new(conn))
                    .await
                else {
                    return;
                };
                let (mut drain, mut draining) = (drain, false);
                loop {
                    tokio::select! {
                        req = h3.accept() => match req {
                            Ok(Some(resolver)) => {
                                tokio::spawn(async move {
                                    if let Ok((req, stream)) = resolver.resolve_request().await {
                                        let _ = answer(req, stream, instance).await;
                                    }
                                });
                            }
                            _ => break,
                        },
                        // GOAWAY, then serve what was accepted until the client is done.
                        _ = drain.wait(), if !draining => {
                            draining = true;
                            let _ = h3.shutdown(0).await;
                        }
                    }
                }
            });
        }
        endpoint.set_server_config(None);
        endpoint.wait_idle().await;
        Ok(())
    })
}

async fn answer(req: http::Request<()>, mut s: Stream, instance: u8) -> Result<(), StreamError> {
    let mut body = BytesMut::new();
    while let Some(mut chunk) = s.recv_data().await? {
        body.extend_from_slice(&chunk.copy_to_bytes(chunk.remaining()));
    }
    let (status, out) = respond(req.method(), req.uri().path(), &body, instance);
    let resp = Response::builder()
        .status(status)
        .header("content-type", "application/json");
    s.send_response(resp.body(()).expect("valid response"))
        .await?;
    s.send_data(Bytes::from(out.to_string())).await?;
    s.finish().await
}

/// The same over TCP (hyper), plus `alt-svc`.
async fn answer_tcp(
    req: http::Request<hyper::body::Incoming>,
    instance: u8,
    alt_svc: Option<String>,
) -> Result<Response<http_body_util::Full<Bytes>>, hyper::Error> {
    use http_body_util::BodyExt;
    let (parts, body) = req.into_parts();
    let body = body.collect().await?.to_bytes();
    let (status, out) = respond(&parts.method, parts.uri.path(), &body, instance);
    let mut resp = Response::builder()
        .status(status)
        .header("content-type", "application/json");
    if let Some(v) = alt_svc {
        resp = resp.header("alt-svc", v);
    }
    Ok(resp
        .body(http_body_util::Full::new(Bytes::from(out.to_string())))
        .expect("valid response"))
}

/// What to answer, whichever the transport.
fn respond(
    method: &Method,
    path: &str,
    body: &[u8],
    instance: u8,
) -> (StatusCode, serde_json::Value) {
    match (method, path) {
        (&Method::GET, "/") => (
            StatusCode::OK,
            json!({ "hello": "world", "instance": instance }),
        ),
        (&Method::POST, "/echo") => match serde_json::from_slice::<serde_json::Value>(body) {
            Ok(v) => (StatusCode::OK, json!({ "echo": v, "instance": instance })),
            Err(e) => (StatusCode::BAD_REQUEST, json!({ "error": e.to_string() })),
        },
        _ => (StatusCode::NOT_FOUND, json!({ "error": "not found" })),
    }
}
