//! Compression end to end: a real ringmux serving a site whose `/` is files (coded), `/off`
//! the same files with `compress = false`, and `/api` Python's HTTP/1.1 service, asked by curl
//! over HTTP/1.1 and HTTP/2 and by aioquic over HTTP/3. Each coding is chosen from the
//! request's `accept-encoding` and its body decodes (here, with the codecs' own crates) to the
//! file byte for byte; `vary` and the per-coding ETags are checked with a 304 for the coding
//! the tag belongs to and a 200 for another; Range and HEAD; a precompressed `.br` sibling with
//! content of its own, so that it is told apart from a copy ringmux made; a backend's
//! `content-encoding` and `cache-control: no-transform` respected.
//!
//! Whether a request finds the file's coded copy in the cache or codes it on the fly depends
//! on the file's age (a file changed in the last 2 s is not cached); both give the same
//! headers but `content-length`, and bodies that decode the same, which is what is checked
//! here (the cache's own path is `compress::files`'s unit tests).

use std::io::Read;
use std::path::Path;
use std::time::Duration;

use harness::{bounded, Forward, PyUpstream, Ringmux};
use ringmux_server::compress::{compress_whole, Coding, Level};
use ringmux_systests::harness;
use ringmux_testkit::aioquic::Json;
use ringmux_testkit::tool;
use ringmux_testkit::{temp_dir, TempDir};

const LIMIT: Duration = Duration::from_secs(180);
const CLIENT_TIMEOUT: Duration = Duration::from_secs(60);

/// What the `.br` sibling of `pre.css` decodes to: not `pre.css`.
const SIBLING_TEXT: &str = "/* from the precompressed sibling */\n";

/// The site on disk, and the upstream of `/api`.
struct Setup {
    dir: TempDir,
    upstream: PyUpstream,
    app_js: Vec<u8>,
}

impl Setup {
    fn new() -> Setup {
        use std::os::unix::fs::PermissionsExt;
        let dir = temp_dir("ringmux-compress");
        let d = dir.path();
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec!["c.test".to_string()])
            .unwrap()
            .self_signed(&key)
            .unwrap();
        std::fs::write(d.join("c.pem"), cert.pem()).unwrap();
        std::fs::write(d.join("c.key"), key.serialize_pem()).unwrap();
        let root = d.join("root");
        std::fs::create_dir_all(&root).unwrap();
        std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o755)).unwrap();
        let app_js: Vec<u8> = (0..3000)
            .flat_map(|i| format!("console.log('line {i}', {});\n", i * 7 % 13).into_bytes())
            .collect();
        let pre_css = "body { color: black; }\n".repeat(100);
        let sibling = compress_whole(Coding::Br, Level::Cached, SIBLING_TEXT.as_bytes()).unwrap();
        // The sibling after the file: not older than it.
        for (name, data) in [
            ("app.js", app_js.as_slice()),
            ("pre.css", pre_css.as_bytes()),
            ("pre.css.br", &sibling[..]),
        ] {
            std::fs::write(root.join(name), data).unwrap();
            std::fs::set_permissions(root.join(name), std::fs::Permissions::from_mode(0o644))
                .unwrap();
        }
        Setup {
            dir,
            upstream: PyUpstream::start(),
            app_js,
        }
    }

    fn start(&self) -> Ringmux {
        let d = self.dir.path().display();
        let upstream = self.upstream.url();
        let text = format!(
            r#"
[[site]]
names = ["c.test"]
cert = "{d}/c.pem"
key = "{d}/c.key"
[[site.route]]
path = "/"
root = "{d}/root"
[[site.route]]
path = "/off"
root = "{d}/root"
compress = false
[[site.route]]
path = "/api"
upstream = "{upstream}"
strip_prefix = true
[[site.route]]
path = "/api-off"
upstream = "{upstream}"
strip_prefix = true
compress = false
"#
        );
        let config = self.dir.path().join("compress.toml");
        std::fs::write(&config, text).unwrap();
        Ringmux::start(2, Forward::Shm, &["--config", &config.to_string_lossy()])
    }
}

/// The upstream's `/text/N` body (test-tools/python/http1_upstream.py).
fn upstream_text(n: usize) -> Vec<u8> {
    let mut body = Vec::new();
    let mut i = 0;
    while body.len() < n {
        body.extend_from_slice(format!("<p>line {i} of the upstream's text</p>\n").as_bytes());
        i += 1;
    }
    body.truncate(n);
    body
}

fn decode(encoding: Option<&str>, body: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    match encoding {
        None => out.extend_from_slice(body),
        Some("br") => drop(brotli::Decompressor::new(body, 4096).read_to_end(&mut out)),
        Some("zstd") => drop(
            zstd::stream::read::Decoder::new(body)
                .unwrap()
                .read_to_end(&mut out),
        ),
        Some("gzip") => drop(flate2::read::GzDecoder::new(body).read_to_end(&mut out)),
        Some(other) => panic!("unexpected content-encoding {other}"),
    }
    out
}

/// What one request got, whatever the client.
#[derive(Debug)]
struct Got {
    status: u16,
    /// Names lower-case.
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Got {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    fn decoded(&self) -> Vec<u8> {
        decode(self.header("content-encoding"), &self.body)
    }
}

/// curl `path` of `c.test` over TCP with `args`; the body as it came (not decoded, unless
/// `args` says `--compressed`).
async fn curl(rm: &Ringmux, dir: &Path, args: &[&str], path: &str) -> Got {
    let n = harness::random_u64();
    let (head, body) = (dir.join(format!("h{n}")), dir.join(format!("b{n}")));
    let port = rm.listen.port();
    let mut all: Vec<String> = vec![
        "-sS".into(),
        "-k".into(),
        "--max-time".into(),
        "20".into(),
        "-w".into(),
        "%{http_code}".into(),
        "-D".into(),
        head.display().to_string(),
        "-o".into(),
        body.display().to_string(),
        "--resolve".into(),
        format!("c.test:{port}:127.0.0.1"),
    ];
    all.extend(args.iter().map(|a| a.to_string()));
    all.push(format!("https://c.test:{port}{path}"));
    let out = tool::run("curl", &all, dir, CLIENT_TIMEOUT).await;
    assert!(out.success, "curl {all:?}: {}", out.stderr);
    let headers = std::fs::read_to_string(&head)
        .unwrap()
        .lines()
        .skip(1)
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    Got {
        status: out.stdout.trim().parse().unwrap(),
        headers,
        body: std::fs::read(&body).unwrap_or_default(),
    }
}

fn accept(coding: &str) -> String {
    format!("accept-encoding: {coding}")
}

/// Slow readers through compression.
mod slow;

/// Over HTTP/1.1 and HTTP/2 (curl): every check of this module's doc.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compression_over_http1_and_http2() {
    if !tool::CURL.present() {
        return;
    }
    bounded(LIMIT, async {
        let s = Setup::new();
        let rm = s.start();
        let dir = s.dir.path();
        for version in ["--http1.1", "--http2"] {
            let get = |args: Vec<String>, path: &'static str| {
                let mut all = vec![version.to_string()];
                all.extend(args);
                let rm = &rm;
                async move {
                    let refs: Vec<&str> = all.iter().map(String::as_str).collect();
                    curl(rm, dir, &refs, path).await
                }
            };
            let h = |v: &str| vec!["-H".to_string(), v.to_string()];
            // Each coding from accept-encoding, q-values respected.
            let mut tags = Vec::new();
            for (accepted, want) in [
                ("br", Some("br")),
                ("zstd", Some("zstd")),
                ("gzip", Some("gzip")),
                ("gzip, deflate, br, zstd", Some("br")),
                ("gzip;q=0.5, zstd;q=0.9", Some("zstd")),
                ("br;q=0, *", Some("zstd")),
                ("identity", None),
                ("deflate", None),
            ] {
                let g = get(h(&accept(accepted)), "/app.js").await;
                let what = format!("{version} accept-encoding: {accepted}");
                assert_eq!(g.status, 200, "{what}");
                assert_eq!(g.header("content-encoding"), want, "{what}");
                assert_eq!(g.header("vary"), Some("accept-encoding"), "{what}");
                assert_eq!(g.decoded(), s.app_js, "{what}: decodes to the file");
                tags.push((want, g.header("etag").unwrap().to_string()));
            }
            let tag = |c: Option<&str>| tags.iter().find(|(w, _)| *w == c).unwrap().1.clone();
            let (plain, br) = (tag(None), tag(Some("br")));
            assert_eq!(
                br,
                format!("{}-br\"", plain.trim_end_matches('"')),
                "{version}"
            );
            assert_ne!(tag(Some("zstd")), br);
            // curl --compressed decodes what it gets itself.
            let g = get(vec!["--compressed".into()], "/app.js").await;
            assert!(g.header("content-encoding").is_some(), "{version}");
            assert_eq!(g.body, s.app_js, "{version} --compressed");
            // 304 for the coding the tag is of, 200 for another.
            let inm = format!("if-none-match: {br}");
            let mut args = h(&accept("br"));
            args.extend(h(&inm));
            assert_eq!(get(args, "/app.js").await.status, 304, "{version}");
            let mut args = h(&accept("gzip"));
            args.extend(h(&inm));
            let g = get(args, "/app.js").await;
            assert_eq!(g.status, 200, "{version}");
            assert_eq!(g.header("content-encoding"), Some("gzip"));
            // Range: the plain bytes.
            let mut args = h(&accept("br"));
            args.extend(h("range: bytes=10-109"));
            let g = get(args, "/app.js").await;
            assert_eq!(g.status, 206, "{version}");
            assert_eq!(g.header("content-encoding"), None);
            assert_eq!(g.body, &s.app_js[10..110]);
            // HEAD: the coded response's fields, no body.
            let mut args = h(&accept("br"));
            args.push("-I".into());
            let g = get(args, "/app.js").await;
            assert_eq!(g.status, 200, "{version}");
            assert_eq!(g.header("content-encoding"), Some("br"));
            assert_eq!(g.header("etag"), Some(br.as_str()));
            // curl -I writes the header block where a body would go: that block and nothing
            // after it.
            let out = String::from_utf8_lossy(&g.body);
            assert!(
                out.starts_with("HTTP/") && out.ends_with("\r\n\r\n"),
                "{version}: HEAD wrote more than its head: {out:?}"
            );
            // The precompressed sibling, told apart by its content.
            let g = get(h(&accept("br")), "/pre.css").await;
            assert_eq!(g.header("content-encoding"), Some("br"), "{version}");
            assert_eq!(
                g.decoded(),
                SIBLING_TEXT.as_bytes(),
                "{version}: the sibling"
            );
            // compress = false: plain, no vary.
            let g = get(h(&accept("br")), "/off/app.js").await;
            assert_eq!(g.header("content-encoding"), None, "{version}");
            assert_eq!(g.header("vary"), None);
            assert_eq!(g.body, s.app_js);
            proxied(version, &get, &h).await;
        }
    })
    .await
}

/// The proxy's part of [`compression_over_http1_and_http2`].
async fn proxied<F, Fut>(version: &str, get: &F, h: &impl Fn(&str) -> Vec<String>)
where
    F: Fn(Vec<String>, &'static str) -> Fut,
    Fut: std::future::Future<Output = Got>,
{
    let text = upstream_text(20_000);
    let g = get(h(&accept("zstd, gzip")), "/api/text/20000").await;
    assert_eq!(g.status, 200, "{version}");
    assert_eq!(g.header("content-encoding"), Some("zstd"), "{version}");
    assert_eq!(g.header("vary"), Some("accept-encoding"));
    assert_eq!(
        g.header("content-length"),
        None,
        "{version}: its length is unknown"
    );
    assert_eq!(g.decoded(), text, "{version}: the upstream's body");
    // The backend's own coding passes unchanged.
    let g = get(h(&accept("br")), "/api/text/20000?ce=gzip").await;
    assert_eq!(g.header("content-encoding"), Some("gzip"), "{version}");
    assert_eq!(g.body, text, "{version}: as the backend sent it");
    // no-transform, and compress = false.
    for path in ["/api/text/20000?cc=no-transform", "/api-off/text/20000"] {
        let g = get(h(&accept("br")), path).await;
        assert_eq!(g.header("content-encoding"), None, "{version} {path}");
        assert_eq!(g.body, text, "{version} {path}");
    }
    // HEAD: nothing coded.
    let mut args = h(&accept("br"));
    args.push("-I".into());
    let g = get(args, "/api/text/20000").await;
    assert_eq!(g.header("content-encoding"), None, "{version} HEAD");
    assert_eq!(g.header("content-length"), Some("20000"));
}

/// Over HTTP/3 (aioquic): the codings, the per-coding 304, Range, HEAD, the sibling and the
/// proxy, on one connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compression_over_http3() {
    if !tool::AIOQUIC.present() {
        return;
    }
    bounded(LIMIT, async {
        let s = Setup::new();
        let rm = s.start();
        let requests = [
            "GET|/app.js|accept-encoding:br",
            "GET|/app.js|accept-encoding:zstd",
            "GET|/app.js|accept-encoding:gzip;q=0.5, zstd;q=0.1",
            "GET|/app.js|accept-encoding:br|if-none-match:$ETAG",
            "GET|/app.js|accept-encoding:zstd|if-none-match:$ETAG",
            "GET|/app.js|accept-encoding:br|range:bytes=0-99",
            "HEAD|/app.js|accept-encoding:br",
            "GET|/pre.css|accept-encoding:br",
            "GET|/off/app.js|accept-encoding:br",
            "GET|/api/text/20000|accept-encoding:br",
            "GET|/api/text/20000?ce=gzip|accept-encoding:br",
        ];
        let mut args = vec![
            ringmux_testkit::aioquic::script()
                .to_string_lossy()
                .into_owned(),
            "127.0.0.1".into(),
            rm.listen.port().to_string(),
            "requests".into(),
            "--server-name".into(),
            "c.test".into(),
        ];
        for r in requests {
            args.extend(["--request".to_string(), r.to_string()]);
        }
        let out = tool::run("python3", &args, rm.dir(), CLIENT_TIMEOUT).await;
        let j = ringmux_testkit::aioquic::result(&out.stdout)
            .unwrap_or_else(|| panic!("aioquic: {}", tool::tail(&out.stderr, 40)));
        assert_eq!(j["ok"], Json::Bool(true), "aioquic: {}", j["error"]);
        let got: Vec<Got> = (0..requests.len())
            .map(|i| {
                let r = &j["responses"][i];
                let obj = r.as_object().expect("a response");
                let hex = r["body_hex"].as_str().unwrap();
                Got {
                    status: r["status"].as_str().unwrap().parse().unwrap(),
                    headers: obj
                        .iter()
                        .filter(|(k, _)| !k.starts_with("body_") && *k != "status")
                        .map(|(k, v)| (k.clone(), v.as_str().unwrap_or("").to_string()))
                        .collect(),
                    body: (0..hex.len() / 2)
                        .map(|k| u8::from_str_radix(&hex[2 * k..2 * k + 2], 16).unwrap())
                        .collect(),
                }
            })
            .collect();
        for (i, want) in [(0, "br"), (1, "zstd"), (2, "gzip")] {
            let g = &got[i];
            assert_eq!(g.status, 200, "{}", requests[i]);
            assert_eq!(g.header("content-encoding"), Some(want), "{}", requests[i]);
            assert_eq!(g.header("vary"), Some("accept-encoding"));
            assert_eq!(g.decoded(), s.app_js, "{}", requests[i]);
        }
        assert!(got[0].header("etag").unwrap().ends_with("-br\""));
        assert_eq!(got[3].status, 304, "the br tag, asked in br");
        assert_eq!(got[4].status, 200, "the br tag, asked in zstd");
        assert_eq!(got[4].header("content-encoding"), Some("zstd"));
        assert_eq!(got[5].status, 206);
        assert_eq!(got[5].header("content-encoding"), None);
        assert_eq!(got[5].body, &s.app_js[..100]);
        assert_eq!(got[6].status, 200);
        assert_eq!(got[6].header("content-encoding"), Some("br"));
        assert!(got[6].body.is_empty());
        assert_eq!(got[7].decoded(), SIBLING_TEXT.as_bytes(), "the sibling");
        assert_eq!(got[8].header("content-encoding"), None, "compress = false");
        assert_eq!(got[8].body, s.app_js);
        let text = upstream_text(20_000);
        assert_eq!(got[9].header("content-encoding"), Some("br"), "proxied");
        assert_eq!(got[9].decoded(), text);
        assert_eq!(
            got[10].header("content-encoding"),
            Some("gzip"),
            "the backend's"
        );
        assert_eq!(got[10].body, text);
    })
    .await
}
