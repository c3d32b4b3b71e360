//! What a request is answered with, whatever the transport: `Reply` (status, header fields,
//! `Body`) and the answers the worker makes itself: files from a document root
//! ([`crate::files`]) and the built-ins (`/hello.txt`, `/bytes/N`).
//!
//! This module never touches a stream or a connection: each front (`h3`, `tcp`, `redirect`)
//! sends a `Reply` its own way, a `Body::File` in `CHUNK`s.

use std::borrow::Cow;
use std::fs::File;
use std::sync::{Arc, LazyLock};

use bytes::Bytes;
use http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use tracing::warn;

use crate::compress::{coded_stream, ChunkStream};
use crate::files::{coded_file, Form};
use crate::files::{evaluate, Content, Decision, DocRoot, Lookup, StaticFile};
use crate::request::clean_path;

/// Size of the chunks in which bodies are sent (and large files read).
pub(crate) const CHUNK: usize = 64 * 1024;

/// Default cap for `/bytes/N`.
pub const DEFAULT_MAX_BYTES: u64 = 64 * 1024 * 1024;

/// Body of the built-in `/hello.txt`.
pub const HELLO_BODY: &[u8] = b"hello from ringmux\n";

/// Byte `offset` of the `/bytes/N` body. A prime period (251) so that a chunk delivered at the
/// wrong offset changes the checksum.
pub fn pattern_byte(offset: u64) -> u8 {
    (offset % 251) as u8
}

/// Fills `buf` with the `/bytes/N` pattern starting at body offset `offset`.
pub fn fill_pattern(offset: u64, buf: &mut [u8]) {
    for (i, b) in buf.iter_mut().enumerate() {
        *b = pattern_byte(offset + i as u64);
    }
}

/// A response body.
pub(crate) enum Body {
    Empty,
    Static(&'static [u8]),
    Text(String),
    Pattern(u64),
    /// A file (or part of one) already in memory.
    Memory(Bytes),
    /// `len` bytes of an open file from `offset`, streamed in [`CHUNK`]s.
    File {
        root: DocRoot,
        file: Arc<File>,
        offset: u64,
        len: u64,
    },
    /// Chunks of a length known only at their end (a body coded on the fly); never empty
    /// chunks. A reply with one has no `content-length`.
    Stream(ChunkStream),
}

impl Body {
    pub(crate) fn len(&self) -> u64 {
        match self {
            Body::Empty => 0,
            Body::Static(b) => b.len() as u64,
            Body::Text(s) => s.len() as u64,
            Body::Memory(b) => b.len() as u64,
            Body::Pattern(n) | Body::File { len: n, .. } => *n,
            // Not known before the end; such a reply is never built with a content-length.
            Body::Stream(_) => 0,
        }
    }

    /// The body as a stream of chunks (for coding it on the fly).
    fn into_stream(self) -> ChunkStream {
        use futures_util::stream;
        let one =
            |b: Bytes| -> ChunkStream { Box::pin(stream::iter((!b.is_empty()).then_some(Ok(b)))) };
        match self {
            Body::Empty => one(Bytes::new()),
            Body::Static(b) => one(Bytes::from_static(b)),
            Body::Text(s) => one(Bytes::from(s)),
            Body::Memory(b) => one(b),
            Body::Pattern(len) => Box::pin(stream::unfold(0u64, move |sent| async move {
                if sent >= len {
                    return None;
                }
                let n = (len - sent).min(CHUNK as u64) as usize;
                let mut chunk = vec![0; n];
                fill_pattern(sent, &mut chunk);
                Some((Ok(Bytes::from(chunk)), sent + n as u64))
            })),
            Body::File {
                root,
                file,
                offset,
                len,
            } => Box::pin(stream::unfold(0u64, move |sent| {
                let (root, file) = (root.clone(), file.clone());
                async move {
                    if sent >= len {
                        return None;
                    }
                    let want = (len - sent).min(CHUNK as u64) as usize;
                    match root.read_chunk(&file, offset + sent, want).await {
                        Ok(chunk) if chunk.is_empty() => Some((
                            Err(std::io::Error::new(
                                std::io::ErrorKind::UnexpectedEof,
                                format!("file changed size while sending ({sent} of {len} bytes)"),
                            )),
                            len,
                        )),
                        Ok(chunk) => {
                            let n = chunk.len() as u64;
                            Some((Ok(chunk), sent + n))
                        }
                        Err(e) => Some((Err(e), len)),
                    }
                }
            })),
            Body::Stream(s) => s,
        }
    }
}

/// What to send back: status, header fields, body.
pub(crate) struct Reply {
    pub(crate) status: StatusCode,
    pub(crate) headers: HeaderMap,
    pub(crate) body: Body,
}

impl Reply {
    /// A reply with `content-type` and a `content-length` that matches `body`.
    pub(crate) fn new(status: StatusCode, content_type: &'static str, body: Body) -> Reply {
        Reply::with_headers(status, HeaderMap::new(), content_type, body)
    }

    fn with_headers(
        status: StatusCode,
        mut headers: HeaderMap,
        content_type: &'static str,
        body: Body,
    ) -> Reply {
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
        headers.insert(header::CONTENT_LENGTH, HeaderValue::from(body.len()));
        Reply {
            status,
            headers,
            body,
        }
    }

    pub(crate) fn text(status: StatusCode, msg: &'static [u8]) -> Reply {
        Reply::new(status, "text/plain", Body::Static(msg))
    }
}

/// The reply to a GET or HEAD of a built-in route (the command line's), whatever the
/// transport: a file from `root`, else a built-in (`/hello.txt`, `/bytes/N`), 400 for a bad
/// path, or 404. `rest` is the request path `path` beneath the route's prefix.
pub(crate) async fn builtin(
    root: Option<&DocRoot>,
    max_bytes: u64,
    method: &Method,
    headers: &HeaderMap,
    path: &str,
    rest: &str,
) -> Reply {
    let Some(rel) = clean_rest(rest) else {
        return Reply::text(StatusCode::BAD_REQUEST, b"bad path\n");
    };
    if let Some(root) = root {
        if let Some(reply) = file_reply(root, method, headers, path, rest, rel).await {
            return reply;
        }
    }
    if rest == "/hello.txt" {
        // Its content-length made once: `HeaderValue::from(usize)` allocates each time.
        static LENGTH: LazyLock<HeaderValue> =
            LazyLock::new(|| HeaderValue::from(HELLO_BODY.len()));
        let mut headers = HeaderMap::with_capacity(2);
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
        headers.insert(header::CONTENT_LENGTH, LENGTH.clone());
        return Reply {
            status: StatusCode::OK,
            headers,
            body: Body::Static(HELLO_BODY),
        };
    }
    if let Some(n) = rest.strip_prefix("/bytes/") {
        return match n.parse::<u64>() {
            Ok(n) if n <= max_bytes => {
                Reply::new(StatusCode::OK, "application/octet-stream", Body::Pattern(n))
            }
            _ => Reply::text(StatusCode::BAD_REQUEST, b"bad length\n"),
        };
    }
    Reply::text(StatusCode::NOT_FOUND, b"not found\n")
}

/// The reply to a GET or HEAD of a file route: the file `rest` (the request path `path`
/// beneath the route's prefix) from `root`, 400 for a bad path, or 404.
pub(crate) async fn files(
    root: &DocRoot,
    method: &Method,
    headers: &HeaderMap,
    path: &str,
    rest: &str,
) -> Reply {
    let Some(rel) = clean_rest(rest) else {
        return Reply::text(StatusCode::BAD_REQUEST, b"bad path\n");
    };
    match file_reply(root, method, headers, path, rest, rel).await {
        Some(reply) => reply,
        None => Reply::text(StatusCode::NOT_FOUND, b"not found\n"),
    }
}

/// The reply to a GET or HEAD that found no file on a route with a single-page app's
/// `fallback` (a path beneath `root`, checked at load): that file, or 404 if it is gone.
pub(crate) async fn fallback(
    root: &DocRoot,
    method: &Method,
    headers: &HeaderMap,
    fallback: &str,
) -> Reply {
    let rel = Cow::Borrowed(fallback);
    match file_reply(root, method, headers, fallback, fallback, rel).await {
        Some(reply) => reply,
        None => Reply::text(StatusCode::NOT_FOUND, b"not found\n"),
    }
}

/// [`clean_path`] of the path beneath a route's prefix; `""` (the prefix itself) names the
/// route's directory.
fn clean_rest(rest: &str) -> Option<Cow<'_, str>> {
    if rest.is_empty() {
        return Some(Cow::Borrowed(""));
    }
    clean_path(rest)
}

/// The reply for `rest` (cleaned to `rel`) from `root`, or `None` to fall through to the
/// built-ins (nothing there, or a directory without `index.html`). A directory named without
/// its final slash is redirected to the request path `path` with one.
async fn file_reply(
    root: &DocRoot,
    method: &Method,
    headers: &HeaderMap,
    path: &str,
    rest: &str,
    rel: Cow<'_, str>,
) -> Option<Reply> {
    let dir_request = rest.ends_with('/');
    let rel = if !dir_request {
        rel
    } else if rel.is_empty() {
        Cow::Borrowed("index.html")
    } else {
        Cow::Owned(format!("{rel}/index.html"))
    };
    match root.lookup(&rel).await {
        Ok(Lookup::File(file)) => Some(match coded_file(root, &rel, file, method, headers).await {
            Form::Plain(file) | Form::Coded(file) => serve_file(root, method, headers, file),
            Form::OnTheFly { file, meta, coding } => {
                // The coded form's validators and fields, the plain file's bytes coded as they go.
                let coded = StaticFile {
                    meta,
                    content: file.content,
                    cached: file.cached,
                };
                let mut reply = serve_file(root, method, headers, coded);
                if reply.status == StatusCode::OK {
                    let plain = std::mem::replace(&mut reply.body, Body::Empty);
                    reply.body = Body::Stream(coded_stream(coding, plain.into_stream()));
                }
                reply
            }
        }),
        Ok(Lookup::Directory) if !dir_request => {
            // Like nginx and Caddy: relative links in the index page need the trailing slash.
            let Ok(location) = HeaderValue::from_str(&format!("{path}/")) else {
                return Some(Reply::text(StatusCode::BAD_REQUEST, b"bad path\n"));
            };
            let mut r = Reply::text(StatusCode::MOVED_PERMANENTLY, b"moved\n");
            r.headers.insert(header::LOCATION, location);
            Some(r)
        }
        Ok(Lookup::Directory | Lookup::NotFound) => None,
        Ok(Lookup::Forbidden) => Some(Reply::text(StatusCode::FORBIDDEN, b"forbidden\n")),
        Err(e) => {
            warn!(path, error = %e, "cannot read file");
            Some(Reply::text(
                StatusCode::INTERNAL_SERVER_ERROR,
                b"cannot read file\n",
            ))
        }
    }
}

/// 200, 206, 304, 412 or 416 for a file, per [`evaluate`].
fn serve_file(root: &DocRoot, method: &Method, headers: &HeaderMap, file: StaticFile) -> Reply {
    let meta = &file.meta;
    // Everything but a whole file gets the validators and Cache-Control only.
    let validators = || {
        let mut h = HeaderMap::with_capacity(6);
        for name in [
            header::ETAG,
            header::LAST_MODIFIED,
            header::CACHE_CONTROL,
            header::VARY,
        ] {
            if let Some(v) = meta.headers.get(&name) {
                h.insert(name, v.clone());
            }
        }
        h
    };
    let (start, len, mut h) = match evaluate(method, headers, meta) {
        Decision::Full => {
            // The common case: the 200's fields were built once, with the file's metadata.
            let body = body_of(root, file.content, 0, meta.len);
            return Reply {
                status: StatusCode::OK,
                headers: meta.headers.clone(),
                body,
            };
        }
        Decision::NotModified => {
            // RFC 9110 §15.4.5: no content, and no Content-Length unless it is the 200's.
            return Reply {
                status: StatusCode::NOT_MODIFIED,
                headers: validators(),
                body: Body::Empty,
            };
        }
        Decision::PreconditionFailed => {
            return Reply::with_headers(
                StatusCode::PRECONDITION_FAILED,
                validators(),
                "text/plain",
                Body::Static(b"precondition failed\n"),
            );
        }
        Decision::RangeNotSatisfiable => {
            let mut h = validators();
            h.insert(
                header::CONTENT_RANGE,
                HeaderValue::from_str(&format!("bytes */{}", meta.len))
                    .unwrap_or(HeaderValue::from_static("bytes */0")),
            );
            return Reply::with_headers(
                StatusCode::RANGE_NOT_SATISFIABLE,
                h,
                "text/plain",
                Body::Static(b"range not satisfiable\n"),
            );
        }
        Decision::Partial { start, len } => (start, len, validators()),
    };
    // §14.4: first-last/complete-length, last inclusive.
    let range = format!("bytes {start}-{}/{}", start + len - 1, meta.len);
    if let Ok(v) = HeaderValue::from_str(&range) {
        h.insert(header::CONTENT_RANGE, v);
    }
    let body = body_of(root, file.content, start, len);
    Reply::with_headers(StatusCode::PARTIAL_CONTENT, h, meta.content_type, body)
}

/// `len` bytes of a file's content from `start` (within the file: [`evaluate`] clamps ranges).
fn body_of(root: &DocRoot, content: Content, start: u64, len: u64) -> Body {
    match content {
        Content::Memory(b) => {
            let (s, e) = (start as usize, (start + len) as usize);
            Body::Memory(if e <= b.len() { b.slice(s..e) } else { b })
        }
        Content::Disk(file) => Body::File {
            root: root.clone(),
            file,
            offset: start,
            len,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pattern_is_position_dependent() {
        let mut a = [0u8; 300];
        fill_pattern(0, &mut a);
        let mut b = [0u8; 50];
        fill_pattern(250, &mut b);
        assert_eq!(&a[250..300], &b[..]);
        assert_eq!(a[251], 0);
    }
}
