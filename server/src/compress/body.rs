//! Proxied response bodies coded on the fly ([`ProxyCoding`], [`CodedBody`]), whatever the
//! transport: the upstream's frames are coded as they come, at [`Level::OnTheFly`], at most
//! [`STEP`] bytes per poll, and what the coder holds is flushed whenever the upstream has
//! nothing more to give yet (so a stream of events reaches the client as the events come).
//!
//! A response is left as the upstream sent it when the request was a HEAD, when the route
//! says `compress = false`, when it is a 206 or has no body (1xx, 204, 304), when the upstream
//! set `content-encoding` (it is coded already) or `cache-control: no-transform` (RFC 9111
//! §5.2.2.6), when its type is not text ([`super::compressible`]), or when its
//! `content-length` is under [`super::MIN_LENGTH`].

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{header, response, HeaderMap, Method, StatusCode};
use http_body::{Body, Frame, SizeHint};

use super::{add_vary, coded_etag, compressible, negotiate, Coding, Encoder, Level};
use super::{MIN_LENGTH, STEP};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// What a proxied request allows, taken from it before it goes upstream.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ProxyCoding {
    /// The route compresses and the request is not a HEAD.
    enabled: bool,
    /// What the client accepts, if anything.
    coding: Option<Coding>,
}

impl ProxyCoding {
    /// Nothing coded: what a tunnel's refused upgrade is answered with.
    pub(crate) const NONE: ProxyCoding = ProxyCoding {
        enabled: false,
        coding: None,
    };

    /// For a `method` request with `headers` on a route that compresses if `compress`.
    pub(crate) fn of(method: &Method, headers: &HeaderMap, compress: bool) -> ProxyCoding {
        let enabled = compress && method != Method::HEAD;
        ProxyCoding {
            enabled,
            coding: if enabled { negotiate(headers) } else { None },
        }
    }

    /// The client's response: `head` rewritten if the body is to be coded (`content-encoding`,
    /// no `content-length`, a coded entity tag, `vary`), `vary` added to any response that
    /// could have been coded, and `body` coded or passed as it is.
    pub(crate) fn apply<B>(self, head: &mut response::Parts, body: B) -> CodedBody<B> {
        self.code(head, body).unwrap_or_else(CodedBody::plain)
    }

    /// [`ProxyCoding::apply`], but a body left as it is comes back as it is (`Err`), with no
    /// wrapper to poll through: most proxied responses are never coded.
    pub(crate) fn code<B>(self, head: &mut response::Parts, body: B) -> Result<CodedBody<B>, B> {
        if !self.enabled || !eligible(head.status, &head.headers) {
            return Err(body);
        }
        add_vary(&mut head.headers);
        let Some(coding) = self.coding else {
            return Err(body);
        };
        let Ok(encoder) = Encoder::new(coding, Level::OnTheFly) else {
            return Err(body);
        };
        let h = &mut head.headers;
        h.remove(header::CONTENT_LENGTH);
        h.remove(header::ACCEPT_RANGES);
        h.insert(header::CONTENT_ENCODING, coding.header());
        if let Some(tag) = h.get(header::ETAG) {
            let coded = coded_etag(tag, coding);
            h.insert(header::ETAG, coded);
        }
        Ok(CodedBody {
            encoder: Some(encoder),
            ..CodedBody::plain(body)
        })
    }
}

/// Whether a response with this status and these fields may be coded.
fn eligible(status: StatusCode, headers: &HeaderMap) -> bool {
    if status.is_informational()
        || matches!(
            status,
            StatusCode::PARTIAL_CONTENT | StatusCode::NO_CONTENT | StatusCode::NOT_MODIFIED
        )
    {
        return false;
    }
    if headers.contains_key(header::CONTENT_ENCODING) || headers.contains_key(header::CONTENT_RANGE)
    {
        return false;
    }
    let no_transform = headers.get_all(header::CACHE_CONTROL).iter().any(|v| {
        v.to_str().is_ok_and(|s| {
            s.split(',')
                .any(|d| d.trim().eq_ignore_ascii_case("no-transform"))
        })
    });
    if no_transform {
        return false;
    }
    let text = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(compressible);
    let long_enough = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok())
        .is_none_or(|n| n >= MIN_LENGTH);
    text && long_enough
}

/// A response body passed as it is, or coded as it streams.
pub(crate) struct CodedBody<B> {
    inner: B,
    /// `None`: passed as it is (or, with `done`, finished).
    encoder: Option<Encoder>,
    /// Input not coded yet.
    pending: Bytes,
    /// The coder holds input it has not flushed.
    unflushed: bool,
    /// The upstream's trailers, sent after the last coded bytes.
    trailers: Option<HeaderMap>,
    /// The upstream's body ended (and the coder with it).
    done: bool,
}

impl<B> CodedBody<B> {
    /// `body` passed as it is.
    fn plain(body: B) -> CodedBody<B> {
        CodedBody {
            inner: body,
            encoder: None,
            pending: Bytes::new(),
            unflushed: false,
            trailers: None,
            done: false,
        }
    }
}

impl<B> Body for CodedBody<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        if this.done {
            return Poll::Ready(this.trailers.take().map(|t| Ok(Frame::trailers(t))));
        }
        let Some(encoder) = this.encoder.as_mut() else {
            return Pin::new(&mut this.inner).poll_frame(cx).map_err(Into::into);
        };
        if !this.pending.is_empty() {
            let n = this.pending.len().min(STEP);
            let step = this.pending.split_to(n);
            let out = encoder.push(&step)?;
            this.unflushed = true;
            if !out.is_empty() {
                return Poll::Ready(Some(Ok(Frame::data(out))));
            }
            // One step per poll: let the worker's other tasks run before the next.
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        loop {
            match Pin::new(&mut this.inner).poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                    Ok(data) if data.is_empty() => continue,
                    Ok(data) => {
                        this.pending = data;
                        return Pin::new(this).poll_frame(cx);
                    }
                    Err(frame) => {
                        if let Ok(trailers) = frame.into_trailers() {
                            this.trailers = Some(trailers);
                        }
                        continue;
                    }
                },
                Poll::Ready(Some(Err(e))) => {
                    this.done = true;
                    this.encoder = None;
                    return Poll::Ready(Some(Err(e.into())));
                }
                Poll::Ready(None) => {
                    this.done = true;
                    let last = match this.encoder.take() {
                        Some(e) => e.finish()?,
                        None => Bytes::new(),
                    };
                    if last.is_empty() {
                        return Poll::Ready(this.trailers.take().map(|t| Ok(Frame::trailers(t))));
                    }
                    return Poll::Ready(Some(Ok(Frame::data(last))));
                }
                Poll::Pending => {
                    if this.unflushed {
                        this.unflushed = false;
                        let out = encoder.flush()?;
                        if !out.is_empty() {
                            return Poll::Ready(Some(Ok(Frame::data(out))));
                        }
                    }
                    return Poll::Pending;
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        if self.encoder.is_none() && !self.done {
            return self.inner.is_end_stream();
        }
        self.done && self.trailers.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        if self.encoder.is_none() && !self.done {
            return self.inner.size_hint();
        }
        SizeHint::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;
    use http_body_util::{BodyExt, StreamBody};
    use std::io::Read;

    fn head(fields: &[(&'static str, &'static str)], status: u16) -> response::Parts {
        let mut r = http::Response::new(());
        *r.status_mut() = StatusCode::from_u16(status).unwrap();
        for (k, v) in fields {
            r.headers_mut().append(*k, HeaderValue::from_static(v));
        }
        r.into_parts().0
    }

    fn client(accept: &'static str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(header::ACCEPT_ENCODING, HeaderValue::from_static(accept));
        h
    }

    #[test]
    fn only_text_bodies_the_upstream_left_plain_are_coded() {
        let text = ("content-type", "text/html");
        let get = ProxyCoding::of(&Method::GET, &client("br"), true);
        for (fields, status, coded, vary) in [
            (&[text][..], 200, true, true),
            (&[text, ("content-length", "5000")], 404, true, true),
            (&[text, ("content-length", "100")], 200, false, false),
            (&[("content-type", "image/png")], 200, false, false),
            (&[], 200, false, false),
            (&[text, ("content-encoding", "gzip")], 200, false, false),
            (
                &[text, ("cache-control", "public, No-Transform")],
                200,
                false,
                false,
            ),
            (&[text, ("content-range", "bytes 0-1/9")], 200, false, false),
            (&[text], 206, false, false),
            (&[text], 304, false, false),
        ] {
            let mut h = head(fields, status);
            let body = get.apply(&mut h, http_body_util::Empty::<Bytes>::new());
            let what = format!("{fields:?} {status}");
            assert_eq!(body.encoder.is_some(), coded, "{what}");
            assert_eq!(
                h.headers.contains_key(header::CONTENT_ENCODING),
                coded || fields.iter().any(|(k, _)| *k == "content-encoding"),
                "{what}"
            );
            assert_eq!(h.headers.contains_key(header::VARY), vary, "{what}");
        }
        for p in [
            ProxyCoding::of(&Method::HEAD, &client("br"), true),
            ProxyCoding::of(&Method::GET, &client("br"), false),
            ProxyCoding::of(&Method::GET, &client("identity"), true),
        ] {
            let mut h = head(&[text, ("content-length", "5000"), ("etag", "\"t\"")], 200);
            let body = p.apply(&mut h, http_body_util::Empty::<Bytes>::new());
            assert!(body.encoder.is_none(), "{p:?}");
            assert_eq!(h.headers[header::CONTENT_LENGTH], "5000");
            assert_eq!(h.headers[header::ETAG], "\"t\"");
        }
    }

    #[tokio::test]
    async fn a_coded_body_decodes_to_the_upstreams_and_keeps_its_trailers() {
        let data: Vec<u8> = (0..150_000u32)
            .map(|i| b"<p>hello</p>\n"[(i % 13) as usize])
            .collect();
        let mut frames: Vec<Result<Frame<Bytes>, std::io::Error>> = data
            .chunks(40_000)
            .map(|c| Ok(Frame::data(Bytes::copy_from_slice(c))))
            .collect();
        let mut trailers = HeaderMap::new();
        trailers.insert("x-sum", HeaderValue::from_static("1"));
        frames.push(Ok(Frame::trailers(trailers)));
        let upstream = StreamBody::new(futures_util::stream::iter(frames));
        let mut h = head(&[("content-type", "text/html"), ("etag", "\"v1\"")], 200);
        let body =
            ProxyCoding::of(&Method::GET, &client("gzip, zstd"), true).apply(&mut h, upstream);
        assert_eq!(h.headers[header::CONTENT_ENCODING], "zstd");
        assert_eq!(h.headers[header::ETAG], "\"v1-zstd\"");
        assert_eq!(h.headers[header::VARY], "accept-encoding");
        let collected = body.collect().await.unwrap();
        assert_eq!(collected.trailers().unwrap()["x-sum"], "1");
        let coded = collected.to_bytes();
        assert!(coded.len() < data.len() / 10);
        let mut out = Vec::new();
        zstd::stream::read::Decoder::new(&coded[..])
            .unwrap()
            .read_to_end(&mut out)
            .unwrap();
        assert_eq!(out, data);
    }
}
