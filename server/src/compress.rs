//! Response compression: which coding a request gets ([`negotiate`], RFC 9110 §12.5.3), which
//! responses are worth coding ([`compressible`]), and the coders themselves ([`Encoder`]: gzip,
//! brotli and zstd behind one type).
//!
//! Two kinds of work, two levels ([`Level`]):
//! * **Cached copies** of small static files are coded once per file version, whole, on tokio's
//!   blocking pool ([`compress_whole`]), and kept in the file cache beside the plain bytes
//!   (`files.rs`): a heavier level, paid once per version and worker.
//! * **On the fly** (a file too fresh or too large for the cache, a proxied body): a light
//!   level, in steps of at most [`STEP`] input bytes with a yield to the runtime between steps
//!   ([`coded_stream`], `compress/body.rs`'s `CodedBody`), so one large body never holds up the worker's
//!   other connections.
//!
//! This module never decides a route's policy (`compress = false` is the router's) and never
//! touches a stream.

mod body;

pub(crate) use body::ProxyCoding;

use std::io::{self, Write};
use std::pin::Pin;

use bytes::Bytes;
use futures_util::Stream;
use http::{header, HeaderMap, HeaderValue};

/// Bodies shorter than this are sent as they are: the coding's own framing and the extra
/// header fields would eat most of what it saves (nginx's `gzip_min_length` is 20 bytes,
/// Caddy's `minimum_length` 512; Akamai and Cloudflare leave bodies under 1 KiB alone).
pub const MIN_LENGTH: u64 = 1024;

/// The most input one on-the-fly step codes before it yields to the runtime: at the light
/// levels of [`Level::OnTheFly`] a step takes well under a millisecond.
pub const STEP: usize = 16 * 1024;

/// A content coding ringmux produces, in the order it prefers them when a client accepts
/// several equally: brotli, then zstd, then gzip (smaller output first at comparable cost).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Coding {
    Br,
    Zstd,
    Gzip,
}

impl Coding {
    /// Every coding, in order of preference.
    pub const ALL: [Coding; 3] = [Coding::Br, Coding::Zstd, Coding::Gzip];

    /// Its token in `accept-encoding` and `content-encoding` (RFC 9110 §8.4.1, RFC 7932,
    /// RFC 8878).
    pub fn token(self) -> &'static str {
        match self {
            Coding::Br => "br",
            Coding::Zstd => "zstd",
            Coding::Gzip => "gzip",
        }
    }

    /// The extension of a precompressed sibling file (`app.js.br`), as `brotli`, `zstd` and
    /// `gzip` name their output.
    pub fn extension(self) -> &'static str {
        match self {
            Coding::Br => "br",
            Coding::Zstd => "zst",
            Coding::Gzip => "gz",
        }
    }

    /// The `content-encoding` value.
    pub fn header(self) -> HeaderValue {
        HeaderValue::from_static(self.token())
    }

    pub(crate) fn index(self) -> usize {
        self as usize
    }
}

/// How hard to compress.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Level {
    /// A copy kept in the file cache, made once per file version on the blocking pool.
    /// brotli 9, zstd 12, gzip 9: measured on a 900 KB JavaScript file, brotli 11 took 26 times
    /// as long as 9 (1.3 s against 0.05 s with the reference C library) for 14 % less, and
    /// zstd 19 ten times as long as 12 for 13 % less; every worker codes each deployed file
    /// again, so the slowest levels are left to build tools (serve their output as `.br` and
    /// `.zst` siblings).
    Cached,
    /// Per response: brotli 4, zstd 3 and gzip 5, the defaults of Caddy's `encode` for zstd
    /// and gzip and brotli's own advice for dynamic content (levels 4–5).
    OnTheFly,
}

impl Level {
    fn of(self, coding: Coding) -> u32 {
        match (self, coding) {
            (Level::Cached, Coding::Br) => 9,
            (Level::Cached, Coding::Zstd) => 12,
            (Level::Cached, Coding::Gzip) => 9,
            (Level::OnTheFly, Coding::Br) => 4,
            (Level::OnTheFly, Coding::Zstd) => 3,
            (Level::OnTheFly, Coding::Gzip) => 5,
        }
    }
}

/// The coding to answer a request with `headers`, or `None` for the identity (RFC 9110
/// §12.5.3). Each coding's weight is the `q` of its own token, else the one of `*`, else 0
/// (not acceptable); `q=0` refuses. The coding with the highest weight wins, ties going to
/// [`Coding::ALL`]'s order; an explicit `identity` with a higher weight than every coding
/// wins over them. No `accept-encoding` at all: the identity (a client that says nothing is
/// sent nothing it may not decode, as every server does).
pub fn negotiate(headers: &HeaderMap) -> Option<Coding> {
    let mut weights: [Option<u16>; 3] = [None; 3];
    let (mut star, mut identity) = (None, None);
    let mut any = false;
    for value in headers.get_all(header::ACCEPT_ENCODING) {
        any = true;
        let Ok(value) = value.to_str() else {
            continue;
        };
        for element in value.split(',') {
            let mut parts = element.split(';');
            let token = parts.next().unwrap_or("").trim();
            if token.is_empty() {
                continue;
            }
            let Some(q) = weight(parts) else {
                continue; // a malformed weight: ignore the element, not the field
            };
            let slot = match token.to_ascii_lowercase().as_str() {
                "br" => &mut weights[Coding::Br.index()],
                "zstd" => &mut weights[Coding::Zstd.index()],
                // RFC 9110 §8.4.1.3: x-gzip is gzip.
                "gzip" | "x-gzip" => &mut weights[Coding::Gzip.index()],
                "*" => &mut star,
                "identity" => &mut identity,
                _ => continue,
            };
            // A token given twice keeps its highest weight.
            *slot = Some(slot.map_or(q, |old: u16| old.max(q)));
        }
    }
    if !any {
        return None;
    }
    let mut best: Option<(Coding, u16)> = None;
    for coding in Coding::ALL {
        let q = weights[coding.index()].or(star).unwrap_or(0);
        if q > 0 && best.is_none_or(|(_, b)| q > b) {
            best = Some((coding, q));
        }
    }
    let (coding, q) = best?;
    match identity {
        Some(i) if i > q => None,
        _ => Some(coding),
    }
}

/// The `q` parameter among an element's parameters, in thousandths (RFC 9110 §12.4.2: `0`
/// to `1` with up to three decimals); 1000 without one; `None` if it is malformed.
fn weight<'a>(params: impl Iterator<Item = &'a str>) -> Option<u16> {
    let mut q = 1000;
    for p in params {
        let Some((name, value)) = p.split_once('=') else {
            continue;
        };
        if !name.trim().eq_ignore_ascii_case("q") {
            continue;
        }
        let value = value.trim();
        let (int, frac) = value.split_once('.').unwrap_or((value, ""));
        let digits = |s: &str| s.bytes().all(|b| b.is_ascii_digit());
        if !(int == "0" || int == "1") || frac.len() > 3 || !digits(frac) {
            return None;
        }
        let mut thousandths = 0u16;
        for (i, b) in frac.bytes().enumerate() {
            thousandths += u16::from(b - b'0') * [100, 10, 1][i];
        }
        q = if int == "1" {
            if thousandths != 0 {
                return None;
            }
            1000
        } else {
            thousandths
        };
    }
    Some(q)
}

/// Whether a body of this `content-type` is worth coding: text, and the structured text and
/// binary formats that compress well (JavaScript, JSON, XML, SVG, WebAssembly, the font
/// formats without their own compression). Images, audio, video, archives and `woff2` are
/// compressed already.
pub fn compressible(content_type: &str) -> bool {
    let essence = content_type
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    if essence.starts_with("text/") {
        return true;
    }
    if essence.ends_with("+json") || essence.ends_with("+xml") {
        return true; // application/manifest+json, image/svg+xml, application/atom+xml, …
    }
    matches!(
        essence.as_str(),
        "application/javascript"
            | "application/x-javascript"
            | "application/ecmascript"
            | "application/json"
            | "application/xml"
            | "application/wasm"
            | "application/x-ndjson"
            | "font/ttf"
            | "font/otf"
            | "image/x-icon"
            | "image/bmp"
    )
}

/// A coder of one body: data in, coded bytes out as they become available.
pub struct Encoder {
    inner: Inner,
}

enum Inner {
    Br(Box<brotli::CompressorWriter<Vec<u8>>>),
    Zstd(zstd::stream::write::Encoder<'static, Vec<u8>>),
    Gzip(flate2::write::GzEncoder<Vec<u8>>),
}

impl std::fmt::Debug for Encoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let coding = match self.inner {
            Inner::Br(_) => Coding::Br,
            Inner::Zstd(_) => Coding::Zstd,
            Inner::Gzip(_) => Coding::Gzip,
        };
        f.debug_struct("Encoder").field("coding", &coding).finish()
    }
}

impl Encoder {
    pub fn new(coding: Coding, level: Level) -> io::Result<Encoder> {
        let q = level.of(coding);
        let inner = match coding {
            // lgwin 22 (a 4 MiB window): brotli's default, which every browser decodes.
            Coding::Br => Inner::Br(Box::new(brotli::CompressorWriter::new(
                Vec::new(),
                4096,
                q,
                22,
            ))),
            Coding::Zstd => {
                let mut e = zstd::stream::write::Encoder::new(Vec::new(), q as i32)?;
                // RFC 8878 §3.1.1.1.2: HTTP decoders need not take windows over 8 MiB; with
                // the content size unknown for streams, keep the window within it.
                e.set_parameter(zstd::zstd_safe::CParameter::WindowLog(23))?;
                Inner::Zstd(e)
            }
            Coding::Gzip => Inner::Gzip(flate2::write::GzEncoder::new(
                Vec::new(),
                flate2::Compression::new(q),
            )),
        };
        Ok(Encoder { inner })
    }

    /// Codes `data`; returns what the coder has written so far (maybe nothing: coders buffer).
    pub fn push(&mut self, data: &[u8]) -> io::Result<Bytes> {
        match &mut self.inner {
            Inner::Br(w) => w.write_all(data)?,
            Inner::Zstd(w) => w.write_all(data)?,
            Inner::Gzip(w) => w.write_all(data)?,
        }
        Ok(self.take())
    }

    /// Makes everything pushed so far decodable (a sync flush) and returns the output.
    pub fn flush(&mut self) -> io::Result<Bytes> {
        match &mut self.inner {
            Inner::Br(w) => w.flush()?,
            Inner::Zstd(w) => w.flush()?,
            Inner::Gzip(w) => w.flush()?,
        }
        Ok(self.take())
    }

    /// Ends the coded body; returns its last bytes.
    pub fn finish(self) -> io::Result<Bytes> {
        let out = match self.inner {
            Inner::Br(w) => w.into_inner(),
            Inner::Zstd(w) => w.finish()?,
            Inner::Gzip(w) => w.finish()?,
        };
        Ok(Bytes::from(out))
    }

    fn take(&mut self) -> Bytes {
        let out = match &mut self.inner {
            Inner::Br(w) => w.get_mut(),
            Inner::Zstd(w) => w.get_mut(),
            Inner::Gzip(w) => w.get_mut(),
        };
        Bytes::from(std::mem::take(out))
    }
}

/// `data` coded whole (for a cached copy: run it on the blocking pool).
pub fn compress_whole(coding: Coding, level: Level, data: &[u8]) -> io::Result<Bytes> {
    let mut e = Encoder::new(coding, level)?;
    let mut out = e.push(data)?.to_vec();
    out.extend_from_slice(&e.finish()?);
    Ok(Bytes::from(out))
}

/// A body as a stream of chunks, each a `Result` (a file that cannot be read breaks it off).
pub type ChunkStream = Pin<Box<dyn Stream<Item = io::Result<Bytes>> + Send>>;

/// `source` coded on the fly at [`Level::OnTheFly`]: each source chunk is coded in steps of
/// at most [`STEP`] bytes with a yield to the runtime after each, and the coded bytes go out
/// as they come (never an empty chunk).
pub fn coded_stream(coding: Coding, source: ChunkStream) -> ChunkStream {
    use futures_util::StreamExt;
    struct State {
        source: ChunkStream,
        encoder: Option<Encoder>,
        pending: Bytes,
    }
    let encoder = match Encoder::new(coding, Level::OnTheFly) {
        Ok(e) => e,
        Err(e) => return Box::pin(futures_util::stream::once(async move { Err(e) })),
    };
    let state = State {
        source,
        encoder: Some(encoder),
        pending: Bytes::new(),
    };
    Box::pin(futures_util::stream::unfold(state, |mut s| async move {
        loop {
            let encoder = s.encoder.as_mut()?;
            if s.pending.is_empty() {
                match s.source.next().await {
                    Some(Ok(chunk)) => s.pending = chunk,
                    Some(Err(e)) => {
                        s.encoder = None;
                        return Some((Err(e), s));
                    }
                    None => {
                        let last = s.encoder.take()?.finish();
                        return Some((last, s));
                    }
                }
                continue;
            }
            let n = s.pending.len().min(STEP);
            let step = s.pending.split_to(n);
            let out = encoder.push(&step);
            // Let the worker's other tasks run between two steps of coding.
            tokio::task::yield_now().await;
            match out {
                Ok(out) if out.is_empty() => continue,
                Ok(out) => return Some((Ok(out), s)),
                Err(e) => {
                    s.encoder = None;
                    return Some((Err(e), s));
                }
            }
        }
    }))
}

/// The entity tag of the `coding` form of a representation tagged `etag`: the coding's token
/// inside the quotes (`"abc"` → `"abc-br"`), so a cache holding both forms tells them apart
/// and a 304 answers only for the form the client has (RFC 9110 §8.8.3.3).
pub fn coded_etag(etag: &HeaderValue, coding: Coding) -> HeaderValue {
    let b = etag.as_bytes();
    let Some(inner) = b.strip_suffix(b"\"") else {
        return etag.clone();
    };
    let mut v = Vec::with_capacity(b.len() + 6);
    v.extend_from_slice(inner);
    v.push(b'-');
    v.extend_from_slice(coding.token().as_bytes());
    v.push(b'"');
    HeaderValue::from_bytes(&v).unwrap_or_else(|_| etag.clone())
}

/// Adds `accept-encoding` to `vary` unless it is there (a `vary: *` covers it).
pub fn add_vary(headers: &mut HeaderMap) {
    let covered = headers.get_all(header::VARY).iter().any(|v| {
        v.to_str().is_ok_and(|s| {
            s.split(',')
                .any(|t| t.trim() == "*" || t.trim().eq_ignore_ascii_case("accept-encoding"))
        })
    });
    if !covered {
        headers.append(header::VARY, HeaderValue::from_static("accept-encoding"));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    fn accept(values: &[&'static str]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for v in values {
            h.append(header::ACCEPT_ENCODING, HeaderValue::from_static(v));
        }
        h
    }

    #[test]
    fn negotiation_follows_q_values_and_prefers_br_zstd_gzip() {
        use Coding::*;
        for (values, want) in [
            (&[][..], None),
            (&[""][..], None),
            (&["gzip"], Some(Gzip)),
            (&["gzip, deflate, br, zstd"], Some(Br)),
            (&["gzip, zstd"], Some(Zstd)),
            (&["GZIP"], Some(Gzip)),
            (&["x-gzip"], Some(Gzip)),
            (&["deflate"], None),
            (&["*"], Some(Br)),
            (&["*;q=0.5, br;q=0"], Some(Zstd)),
            (&["br;q=0, zstd;q=0, *"], Some(Gzip)),
            (&["gzip;q=1.0, br;q=0.9"], Some(Gzip)),
            (&["br;q=0.5, gzip;q=0.5"], Some(Br)),
            (&["br;q=0.001"], Some(Br)),
            (&["br;q=0"], None),
            (&["br;q=0.000"], None),
            (&["*;q=0"], None),
            (&["gzip;q=0.5, identity"], None),
            (&["gzip, identity;q=0.5"], Some(Gzip)),
            (&["gzip;q=0.5, identity;q=0.5"], Some(Gzip)),
            (&["identity"], None),
            // Malformed weights drop their element only.
            (&["br;q=2, gzip"], Some(Gzip)),
            (&["br;q=0.5555, gzip;q=0.1"], Some(Gzip)),
            (&["br;q=x, zstd;q=1.5, gzip;q=1.000"], Some(Gzip)),
            (&["br ; Q=0.8 , gzip;q=0.7"], Some(Br)),
            // Several field lines make one list.
            (&["gzip", "br"], Some(Br)),
            (&["br;q=0", "br;q=1"], Some(Br)),
        ] {
            assert_eq!(negotiate(&accept(values)), want, "{values:?}");
        }
    }

    #[test]
    fn text_formats_are_compressible_and_media_is_not() {
        for t in [
            "text/html; charset=utf-8",
            "text/css",
            "text/javascript; charset=utf-8",
            "application/json",
            "application/manifest+json",
            "image/svg+xml",
            "application/wasm",
            "APPLICATION/XML",
        ] {
            assert!(compressible(t), "{t}");
        }
        for t in [
            "image/png",
            "font/woff2",
            "application/gzip",
            "application/octet-stream",
            "video/mp4",
            "",
        ] {
            assert!(!compressible(t), "{t}");
        }
    }

    fn decode(coding: Coding, data: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        match coding {
            Coding::Br => brotli::Decompressor::new(data, 4096)
                .read_to_end(&mut out)
                .unwrap(),
            Coding::Zstd => zstd::stream::read::Decoder::new(data)
                .unwrap()
                .read_to_end(&mut out)
                .unwrap(),
            Coding::Gzip => flate2::read::GzDecoder::new(data)
                .read_to_end(&mut out)
                .unwrap(),
        };
        out
    }

    fn sample(len: usize) -> Vec<u8> {
        let line = b"function f(a) { return a * 31 + 7; }\n";
        (0..len)
            .map(|i| line[i % line.len()] ^ (i / 5000) as u8)
            .collect()
    }

    #[test]
    fn every_coding_round_trips_whole_and_streamed_with_flushes() {
        let data = sample(100_000);
        for coding in Coding::ALL {
            for level in [Level::Cached, Level::OnTheFly] {
                let whole = compress_whole(coding, level, &data).unwrap();
                assert!(whole.len() < data.len() / 4, "{coding:?} {level:?}");
                assert_eq!(decode(coding, &whole), data, "{coding:?} {level:?}");
            }
            // Pushed in pieces with a flush in the middle: the flushed prefix decodes alone
            // (what a proxied stream relies on) and the whole decodes to the input.
            let mut e = Encoder::new(coding, Level::OnTheFly).unwrap();
            let mut out = e.push(&data[..30_000]).unwrap().to_vec();
            out.extend_from_slice(&e.flush().unwrap());
            let flushed = out.len();
            out.extend_from_slice(&e.push(&data[30_000..]).unwrap());
            out.extend_from_slice(&e.finish().unwrap());
            assert_eq!(decode(coding, &out), data, "{coding:?}");
            let mut prefix = Vec::new();
            let mut partial: Box<dyn Read> = match coding {
                Coding::Br => Box::new(brotli::Decompressor::new(&out[..flushed], 4096)),
                Coding::Zstd => {
                    Box::new(zstd::stream::read::Decoder::new(&out[..flushed]).unwrap())
                }
                Coding::Gzip => Box::new(flate2::read::GzDecoder::new(&out[..flushed])),
            };
            let _ = partial.read_to_end(&mut prefix); // ends early: the stream is unfinished
            assert_eq!(&prefix[..], &data[..30_000], "{coding:?}");
        }
    }

    #[tokio::test]
    async fn a_coded_stream_decodes_to_its_source_and_passes_errors_on() {
        use futures_util::StreamExt;
        let data = sample(200_000);
        for coding in Coding::ALL {
            let chunks: Vec<io::Result<Bytes>> = data
                .chunks(70_000)
                .map(|c| Ok(Bytes::copy_from_slice(c)))
                .collect();
            let s = coded_stream(coding, Box::pin(futures_util::stream::iter(chunks)));
            let parts: Vec<Bytes> = s.map(|r| r.unwrap()).collect().await;
            assert!(parts.iter().all(|p| !p.is_empty()));
            assert_eq!(decode(coding, &parts.concat()), data, "{coding:?}");
        }
        let broken = futures_util::stream::iter(vec![
            Ok(Bytes::from_static(b"abc")),
            Err(io::Error::other("disk")),
        ]);
        let mut s = coded_stream(Coding::Gzip, Box::pin(broken));
        let mut saw_error = false;
        while let Some(r) = s.next().await {
            saw_error |= r.is_err();
        }
        assert!(saw_error);
    }

    #[test]
    fn coded_etags_carry_the_coding_and_vary_is_added_once() {
        let tag = HeaderValue::from_static("\"abc\"");
        assert_eq!(coded_etag(&tag, Coding::Br), "\"abc-br\"");
        assert_eq!(coded_etag(&tag, Coding::Zstd), "\"abc-zstd\"");
        let mut h = HeaderMap::new();
        add_vary(&mut h);
        add_vary(&mut h);
        assert_eq!(h.get_all(header::VARY).iter().count(), 1);
        let mut h = HeaderMap::new();
        h.insert(
            header::VARY,
            HeaderValue::from_static("origin, Accept-Encoding"),
        );
        add_vary(&mut h);
        assert_eq!(h.get_all(header::VARY).iter().count(), 1);
        let mut h = HeaderMap::new();
        h.insert(header::VARY, HeaderValue::from_static("origin"));
        add_vary(&mut h);
        assert_eq!(h.get_all(header::VARY).iter().count(), 2);
    }
}
