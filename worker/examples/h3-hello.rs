//! A minimal HTTP/3 application behind ringmux: `GET /` says hello (and which instance
//! answered) in JSON, `POST /echo` parses a JSON body and sends it back (400 if it is not JSON). Run it as ringmux's instances:
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
    let (status, out) = match (req.method(), req.uri().path()) {
        (&Method::GET, "/") => (
            StatusCode::OK,
            json!({ "hello": "world", "instance": instance }),
        ),
        (&Method::POST, "/echo") => match serde_json::from_slice::<serde_json::Value>(&body) {
            Ok(v) => (StatusCode::OK, json!({ "echo": v, "instance": instance })),
            Err(e) => (StatusCode::BAD_REQUEST, json!({ "error": e.to_string() })),
        },
        _ => (StatusCode::NOT_FOUND, json!({ "error": "not found" })),
    };
    let resp = Response::builder()
        .status(status)
        .header("content-type", "application/json");
    s.send_response(resp.body(()).expect("valid response"))
        .await?;
    s.send_data(Bytes::from(out.to_string())).await?;
    s.finish().await
}
