//! The response body hyper sends over TCP, one type for every request ([`TrackedBody`]): it
//! keeps its request in flight, on its connection and in the stats, until hyper is done with
//! it, and writes the request's access-log line then; and the hyper body of a [`Body`]
//! ([`body_of`]), counting what it sends.

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use http::{header, Response, StatusCode};
use http_body_util::{BodyExt, Empty, Full, StreamBody};
use hyper::body::{Frame, SizeHint};

use super::registry::InFlight;
use super::TcpBody;
use crate::access_log::{Ending, Logged};
use crate::reply::{fill_pattern, Body, CHUNK};
use crate::stats::ServerStats;

/// Answers a request with `answer` (its response, and its access-log line if the worker logs),
/// the response's body tracked: `in_flight` is held, and the line written, when hyper is done
/// with the body (or drops the request unanswered).
pub(super) async fn tracked(
    in_flight: InFlight,
    answer: impl Future<Output = (Response<TcpBody>, Option<Logged>)>,
) -> Result<Response<TrackedBody>, Infallible> {
    let (resp, logged) = answer.await;
    let log = logged.map(|logged| LogLine {
        logged: Some(logged),
        status: resp.status(),
        bytes: 0,
        length: resp
            .headers()
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok()?.parse().ok()),
        ended: false,
        failed: false,
    });
    Ok(resp.map(|inner| TrackedBody {
        inner,
        log,
        _in_flight: in_flight,
    }))
}

/// A response body as hyper sends it: its request stays in flight until the body drops, and
/// its access-log line, if it has one, is written as it drops.
pub(super) struct TrackedBody {
    inner: TcpBody,
    log: Option<LogLine>,
    /// Dropped after the line is written (`Drop` runs before the fields drop).
    _in_flight: InFlight,
}

/// What the access-log line of a response body says when hyper is done with it (sent whole,
/// or given up with its connection): the bytes that went out, and `ok` once hyper took its
/// last frame, else cut. Its duration ends then: every byte handed to hyper to write to the
/// socket (docs/operators/access-log.md says what that leaves out).
struct LogLine {
    /// `None` once written.
    logged: Option<Logged>,
    status: StatusCode,
    bytes: u64,
    /// Its `content-length`, if it has one.
    length: Option<u64>,
    /// hyper took its end (or its last byte of `length`).
    ended: bool,
    /// It broke off with an error of its own (a file that could not be read).
    failed: bool,
}

impl LogLine {
    /// Notes what the body's poll gave hyper.
    fn saw(&mut self, polled: &Poll<Option<Result<Frame<Bytes>, io::Error>>>) {
        match polled {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    self.bytes += data.len() as u64;
                }
                if self.length.is_some_and(|n| self.bytes >= n) {
                    self.ended = true;
                }
            }
            Poll::Ready(Some(Err(_))) => self.failed = true,
            Poll::Ready(None) => self.ended = true,
            Poll::Pending => {}
        }
    }

    /// Writes the line; `at_end`: the body had nothing left to send.
    fn write(&mut self, at_end: bool) {
        let Some(logged) = self.logged.take() else {
            return;
        };
        let ending = if self.ended || (!self.failed && at_end) {
            Ending::Ok
        } else if self.failed {
            Ending::CutError
        } else {
            // Dropped unfinished: its connection ended (the client's doing), or the worker
            // was told to cut (`Logged::end_as` says so then).
            Ending::CutClient
        };
        logged.end_as(Some(self.status), self.bytes, ending);
    }
}

impl hyper::body::Body for TrackedBody {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        let this = &mut *self;
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        if let Some(log) = &mut this.log {
            log.saw(&polled);
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for TrackedBody {
    fn drop(&mut self) {
        if let Some(log) = &mut self.log {
            log.write(hyper::body::Body::is_end_stream(&self.inner));
        }
    }
}

/// A [`Body`] as a hyper body: in-memory ones whole, generated and file bodies as a stream of
/// [`CHUNK`]s (a file never held whole; one that shrinks under us ends the body with an error,
/// which breaks the connection rather than sending a short body that looks complete).
pub(crate) fn body_of(body: Body, stats: Arc<ServerStats>) -> TcpBody {
    let whole = |b: Bytes| {
        stats
            .bytes_sent
            .fetch_add(b.len() as u64, Ordering::Relaxed);
        Full::new(b).map_err(|never| match never {}).boxed_unsync()
    };
    match body {
        Body::Empty => Empty::new().map_err(|never| match never {}).boxed_unsync(),
        Body::Static(b) => whole(Bytes::from_static(b)),
        Body::Text(s) => whole(Bytes::from(s)),
        Body::Memory(b) => whole(b),
        Body::Pattern(len) => {
            let chunks = futures_util::stream::unfold(0u64, move |sent| {
                let stats = stats.clone();
                async move {
                    if sent >= len {
                        return None;
                    }
                    let n = (len - sent).min(CHUNK as u64) as usize;
                    let mut chunk = BytesMut::zeroed(n);
                    fill_pattern(sent, &mut chunk);
                    stats.bytes_sent.fetch_add(n as u64, Ordering::Relaxed);
                    Some((Ok(Frame::data(chunk.freeze())), sent + n as u64))
                }
            });
            StreamBody::new(chunks).boxed_unsync()
        }
        Body::File {
            root,
            file,
            offset,
            len,
        } => {
            let chunks = futures_util::stream::unfold(0u64, move |sent| {
                let (root, file, stats) = (root.clone(), file.clone(), stats.clone());
                async move {
                    if sent >= len {
                        return None;
                    }
                    let want = (len - sent).min(CHUNK as u64) as usize;
                    match root.read_chunk(&file, offset + sent, want).await {
                        Ok(chunk) if chunk.is_empty() => Some((
                            Err(io::Error::new(
                                io::ErrorKind::UnexpectedEof,
                                format!("file changed size while sending ({sent} of {len} bytes)"),
                            )),
                            len,
                        )),
                        Ok(chunk) => {
                            let n = chunk.len() as u64;
                            stats.bytes_sent.fetch_add(n, Ordering::Relaxed);
                            Some((Ok(Frame::data(chunk)), sent + n))
                        }
                        Err(e) => Some((Err(e), len)),
                    }
                }
            });
            StreamBody::new(chunks).boxed_unsync()
        }
        Body::Stream(chunks) => {
            use futures_util::StreamExt;
            let chunks = chunks.map(move |chunk| {
                let chunk = chunk?;
                stats
                    .bytes_sent
                    .fetch_add(chunk.len() as u64, Ordering::Relaxed);
                Ok(Frame::data(chunk))
            });
            StreamBody::new(chunks).boxed_unsync()
        }
    }
}
