//! The reverse proxy over HTTP/3: one request stream passed to [`Upstream::exchange`], the
//! proxy's one path, and the upstream's response sent back on the stream. What the proxy does
//! to a request (fields, forwarding, timeouts) is [`crate::proxy`]'s; this module only moves
//! frames between h3 and the exchange.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bytes::{Buf, Bytes};
use h3::error::Code;
use h3::server::RequestStream;
use http::{header, Method, Request, Response, StatusCode};
use http_body::Frame;
use http_body_util::{BodyExt, StreamBody};
use tracing::debug;

use crate::compress::ProxyCoding;
use crate::proxy::pool::Pool;
use crate::proxy::{empty_body, BoxError, ClientGone, Exchange, ProxyBody};
use crate::reply::{Body, Reply};
use crate::rules::Applied;

/// The request stream of the h3 server over quinn.
type Stream = RequestStream<h3_quinn::BidiStream<Bytes>, Bytes>;
type RecvHalf = RequestStream<h3_quinn::RecvStream, Bytes>;
type SendHalf = RequestStream<h3_quinn::SendStream<Bytes>, Bytes>;

/// How a proxied HTTP/3 request ended, for the caller's counters.
#[derive(Debug)]
pub enum Outcome {
    /// The upstream's response (or our 502/504) went out whole, with this status and this
    /// many body bytes.
    Answered { status: StatusCode, bytes: u64 },
    /// The exchange broke off: the client went away, or the upstream failed mid-body.
    Failed,
}

/// What becomes of the upstream's response on its way to the client: its coding, then the
/// route's response rules.
pub(crate) struct Shaping<'a, 'r> {
    pub coding: ProxyCoding,
    pub rules: &'a Applied<'r>,
}

/// Passes one HTTP/3 request to `upstream` and its response back on `stream`, shaped as
/// `shaping` says. `remote` is the client's current address, `early` whether the request
/// arrived in 0-RTT. Counts response body bytes handed to QUIC into `sent`.
pub(crate) async fn proxy_h3(
    upstream: &Arc<Pool>,
    request: Request<()>,
    stream: Stream,
    remote: SocketAddr,
    early: bool,
    sent: &AtomicU64,
    shaping: Shaping<'_, '_>,
) -> Outcome {
    let Shaping { coding, rules } = shaping;
    let (mut tx, mut rx) = stream.split();
    let (parts, ()) = request.into_parts();
    let head = parts.method == Method::HEAD;
    // The body's length is known from `content-length`; without one, a body that is empty
    // must be known as empty before the head goes upstream.
    let body = if parts.headers.contains_key(header::CONTENT_LENGTH) {
        request_body(rx, None)
    } else {
        let first = match rx.recv_data().await {
            Err(e) => return client_gone_early(e),
            Ok(Some(mut first)) => Some(Frame::data(first.copy_to_bytes(first.remaining()))),
            Ok(None) => match rx.recv_trailers().await {
                Err(e) => return client_gone_early(e),
                Ok(None) => None,
                Ok(Some(t)) => Some(Frame::trailers(t)),
            },
        };
        match first {
            None => empty_body(),
            first => request_body(rx, first),
        }
    };
    let response = match upstream
        .exchange(Request::from_parts(parts, body), remote, early)
        .await
    {
        Exchange::Response(r) => r,
        // Our own answers are rare: their state out of the request's.
        Exchange::Reply(status, body) => {
            return Box::pin(reply(&mut tx, rules, rules.own_error(status, body))).await
        }
        Exchange::ClientGone => {
            tx.stop_stream(Code::H3_REQUEST_CANCELLED);
            return Outcome::Failed;
        }
    };
    let (mut parts, body) = response.into_parts();
    let body = coding.code(&mut parts, body);
    rules.response(&mut parts.headers);
    let status = parts.status;
    if let Err(e) = tx.send_response(Response::from_parts(parts, ())).await {
        debug!(error = %e, "client went away before the response head");
        return Outcome::Failed;
    }
    if head {
        return finish(&mut tx, status, 0).await;
    }
    let sent = match body {
        // Most responses are passed as they are, polled with no coder around them.
        Err(plain) => send_body(&mut tx, plain, sent).await,
        Ok(coded) => Box::pin(send_body(&mut tx, coded, sent)).await,
    };
    match sent {
        Some(bytes) => finish(&mut tx, status, bytes).await,
        None => Outcome::Failed,
    }
}

/// Sends `body`'s frames on `tx`, counting its data bytes into `sent`: how many, or `None`
/// when the client went away or the body failed (the stream is reset then: the head is out,
/// and a short body must not look complete).
async fn send_body<B>(tx: &mut SendHalf, mut body: B, sent: &AtomicU64) -> Option<u64>
where
    B: http_body::Body<Data = Bytes> + Unpin,
{
    let mut bytes = 0u64;
    while let Some(frame) = body.frame().await {
        let sending = match frame {
            // Counted already.
            Err(_) => {
                tx.stop_stream(Code::H3_INTERNAL_ERROR);
                return None;
            }
            Ok(frame) => match frame.into_data() {
                Ok(data) if data.is_empty() => continue,
                Ok(data) => {
                    let n = data.len() as u64;
                    let r = tx.send_data(data).await;
                    if r.is_ok() {
                        sent.fetch_add(n, Ordering::Relaxed);
                        bytes += n;
                    }
                    r
                }
                Err(frame) => match frame.into_trailers() {
                    Ok(trailers) => tx.send_trailers(trailers).await,
                    Err(_) => continue,
                },
            },
        };
        if let Err(e) = sending {
            debug!(error = %e, "client went away during the response body");
            return None;
        }
    }
    Some(bytes)
}

fn client_gone_early(e: h3::error::StreamError) -> Outcome {
    debug!(error = %e, "client went away before its request was sent upstream");
    Outcome::Failed
}

/// Finishes the stream after a complete response of `bytes` body bytes.
async fn finish(tx: &mut SendHalf, status: StatusCode, bytes: u64) -> Outcome {
    match tx.finish().await {
        Ok(()) => Outcome::Answered { status, bytes },
        Err(e) => {
            debug!(error = %e, "client went away at the end of the response");
            Outcome::Failed
        }
    }
}

/// A complete response of ours (the proxy's 502 or 504, or the site's page for it), after
/// the rules.
async fn reply(tx: &mut SendHalf, rules: &Applied<'_>, mut reply: Reply) -> Outcome {
    rules.response(&mut reply.headers);
    let status = reply.status;
    let body = match reply.body {
        Body::Static(b) => Bytes::from_static(b),
        Body::Memory(b) => b,
        // The proxy's own answers are one of those two.
        _ => Bytes::new(),
    };
    let mut head = Response::new(());
    *head.status_mut() = status;
    *head.headers_mut() = reply.headers;
    if let Err(e) = tx.send_response(head).await {
        debug!(error = %e, "client went away before our response");
        return Outcome::Failed;
    }
    let len = body.len() as u64;
    if let Err(e) = tx.send_data(body).await {
        debug!(error = %e, "client went away during our response");
        return Outcome::Failed;
    }
    finish(tx, status, len).await
}

/// The request body as hyper polls it: `first` (a frame already read), then the stream's data
/// frames, then its trailers. A client error ends it with [`ClientGone`].
fn request_body(rx: RecvHalf, first: Option<Frame<Bytes>>) -> ProxyBody {
    enum State {
        Data(RecvHalf),
        Done,
    }
    let gone = |e: h3::error::StreamError| BoxError::from(ClientGone(Box::new(e)));
    let first = futures_util::stream::iter(first.map(Ok));
    let rest = futures_util::stream::unfold(State::Data(rx), move |state| async move {
        let State::Data(mut rx) = state else {
            return None;
        };
        loop {
            match rx.recv_data().await {
                Ok(Some(mut buf)) => {
                    if !buf.has_remaining() {
                        continue;
                    }
                    let data = buf.copy_to_bytes(buf.remaining());
                    return Some((Ok(Frame::data(data)), State::Data(rx)));
                }
                Ok(None) => {
                    return match rx.recv_trailers().await {
                        Ok(None) => None,
                        Ok(Some(t)) => Some((Ok(Frame::trailers(t)), State::Done)),
                        Err(e) => Some((Err(gone(e)), State::Done)),
                    };
                }
                Err(e) => return Some((Err(gone(e)), State::Done)),
            }
        }
    });
    use futures_util::StreamExt;
    StreamBody::new(first.chain(rest)).boxed_unsync()
}
