//! Which form of a static file a request gets ([`coded_file`]): the plain file, a
//! precompressed sibling (`app.js.br` beside `app.js`), a coded copy kept in the file cache, or
//! the file coded on the fly.
//!
//! * A sibling is used when it exists and is not older than the file (a stale `.br` left by an
//!   earlier build is not sent for a newer file).
//! * A cached file version is coded once per coding, whole, on the blocking pool, at
//!   [`Level::Cached`]; the copy is kept in the version's [`FileMeta::variants`] and charged to
//!   its cache entry ([`DocRoot::charge`]), so it goes when the version goes. Requests that come
//!   while it is being made wait for it (one job per version and coding, however many wait).
//!   For a cached version, whether it has a sibling is decided at that same first request: a
//!   sibling deployed later, for an unchanged file, is seen once the file's entry leaves the
//!   cache (deploy siblings with their files).
//! * A file too fresh or too large for the cache is coded on the fly ([`crate::compress::coded_stream`]),
//!   after a look for a sibling at every request (the file is read from the disk anyway).
//! * A request with `Range` gets the plain file (as nginx does): ranges of a coded form would
//!   be ranges of bytes no client can rely on.

use std::sync::Arc;

use bytes::Bytes;
use http::{header, HeaderMap, HeaderValue, Method};
use tokio::sync::OnceCell;

use super::{Content, DocRoot, FileMeta, Lookup, StaticFile};
use crate::compress::{add_vary, coded_etag, compress_whole, negotiate, Coding, Level};

/// What each coding of one cached file version is sent as; empty until asked.
#[derive(Debug, Default)]
pub struct Variants([OnceCell<Variant>; 3]);

/// The form of a cached file version in one coding.
#[derive(Debug)]
enum Variant {
    /// The sibling file (`rel.br`, …), looked up at each request (it has its own cache entry).
    Sibling,
    /// Our coded copy, with the header fields of its 200.
    Copy { meta: Arc<FileMeta>, body: Bytes },
    /// Coding saves too little: send the plain file.
    Plain,
}

/// The form a file is served in.
pub(crate) enum Form {
    /// As it is.
    Plain(StaticFile),
    /// A coded form of known length (a sibling or a cached copy), served like a file: its
    /// `meta` has the coded form's length, entity tag and header fields.
    Coded(StaticFile),
    /// `file` coded on the fly in `coding`: `meta` has the coded form's entity tag and header
    /// fields, and no length.
    OnTheFly {
        file: StaticFile,
        meta: Arc<FileMeta>,
        coding: Coding,
    },
}

/// The form of `file` (the file `rel` of `root`) to answer a `method` request with `headers`.
pub(crate) async fn coded_file(
    root: &DocRoot,
    rel: &str,
    file: StaticFile,
    method: &Method,
    headers: &HeaderMap,
) -> Form {
    if !file.meta.compressible || (method == Method::GET && headers.contains_key(header::RANGE)) {
        return Form::Plain(file);
    }
    let Some(coding) = negotiate(headers) else {
        return Form::Plain(file);
    };
    if !file.cached {
        if let Some(sibling) = sibling(root, rel, &file.meta, coding).await {
            return Form::Coded(sibling);
        }
        let meta = Arc::new(coded_meta(&file.meta, coding, &file.meta.etag, None));
        return Form::OnTheFly { file, meta, coding };
    }
    let variant = file.meta.variants.0[coding.index()]
        .get_or_init(|| decide(root, rel, &file, coding))
        .await;
    match variant {
        Variant::Plain => Form::Plain(file),
        Variant::Copy { meta, body } => Form::Coded(StaticFile {
            meta: meta.clone(),
            content: Content::Memory(body.clone()),
            cached: true,
        }),
        Variant::Sibling => match sibling(root, rel, &file.meta, coding).await {
            Some(sibling) => Form::Coded(sibling),
            // Gone since: code it on the fly until the file's entry is renewed.
            None => {
                let meta = Arc::new(coded_meta(&file.meta, coding, &file.meta.etag, None));
                Form::OnTheFly { file, meta, coding }
            }
        },
    }
}

/// The form of a cached version in `coding`: its sibling if it has one, else our copy (made on
/// the blocking pool), else plain if coding does not pay.
async fn decide(root: &DocRoot, rel: &str, file: &StaticFile, coding: Coding) -> Variant {
    if sibling(root, rel, &file.meta, coding).await.is_some() {
        return Variant::Sibling;
    }
    let Content::Memory(plain) = &file.content else {
        return Variant::Plain; // a cached version is always in memory
    };
    let data = plain.clone();
    let job = tokio::task::spawn_blocking(move || compress_whole(coding, Level::Cached, &data));
    let body = match job.await {
        Ok(Ok(body)) => body,
        Ok(Err(e)) => {
            tracing::warn!(path = rel, coding = coding.token(), error = %e, "cannot compress");
            return Variant::Plain;
        }
        Err(e) => {
            tracing::warn!(path = rel, coding = coding.token(), error = %e, "compression failed");
            return Variant::Plain;
        }
    };
    // Less than 1/8 saved is not worth the decoding (already compressed data in a text type).
    if body.len() as u64 > file.meta.len - file.meta.len / 8 {
        return Variant::Plain;
    }
    let meta = Arc::new(coded_meta(
        &file.meta,
        coding,
        &file.meta.etag,
        Some(body.len() as u64),
    ));
    root.charge(rel, &file.meta, body.len() as u64);
    Variant::Copy { meta, body }
}

/// The sibling of `rel` in `coding` as a coded form of the file `plain`, if it exists, is a
/// regular file and is not older than `plain`.
async fn sibling(
    root: &DocRoot,
    rel: &str,
    plain: &Arc<FileMeta>,
    coding: Coding,
) -> Option<StaticFile> {
    let name = format!("{rel}.{}", coding.extension());
    let Ok(Lookup::File(sibling)) = root.lookup(&name).await else {
        return None;
    };
    if sibling.meta.modified_secs < plain.modified_secs {
        return None;
    }
    let meta = coded_meta(plain, coding, &sibling.meta.etag, Some(sibling.meta.len));
    Some(StaticFile {
        meta: Arc::new(meta),
        content: sibling.content,
        cached: sibling.cached,
    })
}

/// The metadata of the `coding` form of `plain`: the entity tag `etag` (the plain file's, or
/// the sibling's) marked with the coding, and the header fields of its 200: the plain file's
/// with `content-encoding`, `vary`, the coded length if known (else none: the transport frames
/// it), and no `accept-ranges` (a coded form is sent whole).
fn coded_meta(plain: &FileMeta, coding: Coding, etag: &HeaderValue, len: Option<u64>) -> FileMeta {
    let etag = coded_etag(etag, coding);
    let mut headers = plain.headers.clone();
    headers.insert(header::CONTENT_ENCODING, coding.header());
    headers.insert(header::ETAG, etag.clone());
    headers.remove(header::ACCEPT_RANGES);
    match len {
        Some(n) => drop(headers.insert(header::CONTENT_LENGTH, HeaderValue::from(n))),
        None => drop(headers.remove(header::CONTENT_LENGTH)),
    }
    add_vary(&mut headers);
    FileMeta {
        len: len.unwrap_or(plain.len),
        etag,
        last_modified: plain.last_modified.clone(),
        modified_secs: plain.modified_secs,
        content_type: plain.content_type,
        headers,
        compressible: false,
        variants: Variants::default(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::files::{FileCache, FileOptions};
    use std::io::Read;
    use std::time::Duration;

    fn accept(v: &'static str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(header::ACCEPT_ENCODING, HeaderValue::from_static(v));
        h
    }

    async fn form(root: &DocRoot, rel: &str, headers: &HeaderMap) -> Form {
        let Ok(Lookup::File(file)) = root.lookup(rel).await else {
            panic!("{rel}: no file");
        };
        coded_file(root, rel, file, &Method::GET, headers).await
    }

    fn memory(file: &StaticFile) -> Bytes {
        match &file.content {
            Content::Memory(b) => b.clone(),
            Content::Disk(_) => panic!("expected a body in memory"),
        }
    }

    /// A cached file is coded once per coding, the copy charged to the cache and served from
    /// it; a fresh sibling wins, an older one does not; Range and small files stay plain.
    #[tokio::test]
    async fn cached_copies_and_siblings() {
        let tmp = ringmux_testkit::temp_dir("ringmux-compress-files");
        let dir = tmp.path();
        let js: Vec<u8> = (0..50_000u32)
            .flat_map(|i| format!("var v{i} = {};\n", i % 97).into_bytes())
            .collect();
        std::fs::write(dir.join("app.js"), &js).unwrap();
        std::fs::write(dir.join("small.css"), b"a{}").unwrap();
        std::fs::write(dir.join("logo.png"), &js).unwrap();
        let opts = FileOptions {
            settle: Duration::ZERO,
            revalidate: Duration::from_secs(3600),
            ..FileOptions::default()
        };
        let js = &js[..js.len().min(200_000)];
        std::fs::write(dir.join("app.js"), js).unwrap();
        let cache = FileCache::new(8 << 20);
        let root = DocRoot::open_with_cache(dir, opts, &cache).unwrap();

        let Form::Plain(plain) = form(&root, "app.js", &HeaderMap::new()).await else {
            panic!("no accept-encoding: plain");
        };
        assert!(plain.cached);
        assert_eq!(plain.meta.headers[header::VARY], "accept-encoding");
        let before = cache.used();
        let Form::Coded(coded) = form(&root, "app.js", &accept("gzip, br")).await else {
            panic!("a cached copy");
        };
        let body = memory(&coded);
        assert_eq!(
            cache.used(),
            before + body.len() as u64,
            "the copy is charged"
        );
        let mut out = Vec::new();
        brotli::Decompressor::new(&body[..], 4096)
            .read_to_end(&mut out)
            .unwrap();
        assert_eq!(out, js);
        let h = &coded.meta.headers;
        assert_eq!(h[header::CONTENT_ENCODING], "br");
        assert_eq!(h[header::CONTENT_LENGTH], body.len().to_string().as_str());
        assert_eq!(coded.meta.etag, coded_etag(&plain.meta.etag, Coding::Br));
        assert!(!h.contains_key(header::ACCEPT_RANGES));
        // The second request is the same copy, charged once.
        let Form::Coded(again) = form(&root, "app.js", &accept("br")).await else {
            panic!("the cached copy again");
        };
        assert_eq!(memory(&again).as_ptr(), body.as_ptr());
        assert_eq!(cache.used(), before + body.len() as u64);

        // Range: plain; a small file and a PNG: plain, and the PNG has no vary.
        let mut ranged = accept("br");
        ranged.insert(header::RANGE, HeaderValue::from_static("bytes=0-9"));
        assert!(matches!(
            form(&root, "app.js", &ranged).await,
            Form::Plain(_)
        ));
        assert!(matches!(
            form(&root, "small.css", &accept("br")).await,
            Form::Plain(_)
        ));
        let Form::Plain(png) = form(&root, "logo.png", &accept("br")).await else {
            panic!("png: plain");
        };
        assert!(!png.meta.headers.contains_key(header::VARY));

        // A sibling not older than the file is sent as it is; an older one is not.
        std::fs::write(dir.join("app.js.zst"), b"precompressed zstd").unwrap();
        let Form::Coded(sib) = form(&root, "app.js", &accept("zstd")).await else {
            panic!("the sibling");
        };
        assert_eq!(&memory(&sib)[..], b"precompressed zstd");
        assert_eq!(sib.meta.headers[header::CONTENT_ENCODING], "zstd");
        assert_eq!(sib.meta.headers[header::CONTENT_LENGTH], "18");
        std::fs::write(dir.join("old.css"), js).unwrap();
        std::fs::write(dir.join("old.css.gz"), b"stale").unwrap();
        let past = std::time::SystemTime::now() - Duration::from_secs(3600);
        std::fs::File::options()
            .write(true)
            .open(dir.join("old.css.gz"))
            .unwrap()
            .set_modified(past)
            .unwrap();
        let Form::Coded(ours) = form(&root, "old.css", &accept("gzip")).await else {
            panic!("our copy, not the stale sibling");
        };
        let mut out = Vec::new();
        flate2::read::GzDecoder::new(&memory(&ours)[..])
            .read_to_end(&mut out)
            .unwrap();
        assert_eq!(out, js);
    }

    /// A file too fresh for the cache is coded on the fly, with the coded form's validators.
    #[tokio::test]
    async fn a_fresh_file_is_coded_on_the_fly() {
        let tmp = ringmux_testkit::temp_dir("ringmux-compress-fresh");
        std::fs::write(tmp.path().join("a.json"), vec![b'7'; 5000]).unwrap();
        let root = DocRoot::open(tmp.path(), FileOptions::default()).unwrap();
        let Form::OnTheFly { file, meta, coding } = form(&root, "a.json", &accept("zstd")).await
        else {
            panic!("on the fly");
        };
        assert!(!file.cached);
        assert_eq!(coding, Coding::Zstd);
        assert!(!meta.headers.contains_key(header::CONTENT_LENGTH));
        assert_eq!(meta.headers[header::CONTENT_ENCODING], "zstd");
        assert_eq!(meta.etag, coded_etag(&file.meta.etag, Coding::Zstd));
        // compress = false: plain, no vary.
        let off = FileOptions {
            compress: false,
            ..FileOptions::default()
        };
        let root = DocRoot::open(tmp.path(), off).unwrap();
        let Form::Plain(p) = form(&root, "a.json", &accept("zstd")).await else {
            panic!("compress = false: plain");
        };
        assert!(!p.meta.headers.contains_key(header::VARY));
    }
}
