//! Several sites on one port (`--config` with `[[site]]` tables), end to end: a real ringmux
//! serving three sites, `a.test` (two names), `b.test` and the wildcard `*.w.test`, each with
//! its own certificate and its own root, asked by clients nobody here wrote: curl over HTTP/1.1
//! and HTTP/2 (`--resolve` makes the name, so the TLS server name), aioquic over HTTP/3 (its
//! `--server-name`). Each client reports the subject of the certificate it was given, so a
//! test sees which site's certificate went out, not only which content.
//!
//! Also `ringmux check` on broken files, each problem asserted with its place, and a start
//! with such a file, which must fail with the same words.
//!
//! A client that is not installed skips its tests with a loud message, unless `CI` is set.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use harness::{bounded, Forward, Metrics, PyUpstream, Ringmux};
use ringmux_demux::metrics::names;
use ringmux_systests::harness;
use ringmux_testkit::aioquic::Json;
use ringmux_testkit::curl::{self, Reach};
use ringmux_testkit::tool::{self, tail};
use ringmux_testkit::{temp_dir, TempDir};

const LIMIT: Duration = Duration::from_secs(120);
const CLIENT_TIMEOUT: Duration = Duration::from_secs(60);

/// What every site of these tests has: its names, the subject of its certificate, the body
/// of `/` in its root.
struct SiteSpec {
    /// The certificate's file stem.
    stem: &'static str,
    names: &'static [&'static str],
    common_name: &'static str,
    index: &'static str,
}

const A: SiteSpec = SiteSpec {
    stem: "a",
    names: &["a.test", "www.a.test"],
    common_name: "ringmux test site a",
    index: "the root of a.test\n",
};
const B: SiteSpec = SiteSpec {
    stem: "b",
    names: &["b.test"],
    common_name: "ringmux test site b",
    index: "the root of b.test\n",
};
const W: SiteSpec = SiteSpec {
    stem: "w",
    names: &["*.w.test"],
    common_name: "ringmux test site w",
    index: "the root of *.w.test\n",
};

/// Each name a client asks for, and the site that must answer it.
const ASKED: [(&str, &SiteSpec); 4] = [
    ("a.test", &A),
    ("www.a.test", &A),
    ("b.test", &B),
    ("x.w.test", &W),
];

/// What a.test's `/hi` answers.
const HI: &str = "hi from a.test\n";
/// What a request for another site than its connection's gets, with status 421.
const MISDIRECTED: &str = "this connection does not serve that host\n";

/// A certificate and its key, written as PEM files.
struct CertFiles {
    cert: PathBuf,
    key: PathBuf,
}

/// A self-signed certificate for `names` with the subject `CN=common_name`, written to
/// `dir/STEM.pem` and `dir/STEM.key`; valid from 1975 to 4096 (rcgen's default), or, if
/// `expired`, during 2020 only.
fn certificate(
    dir: &Path,
    stem: &str,
    common_name: &str,
    names: &[&str],
    expired: bool,
) -> CertFiles {
    let mut params =
        rcgen::CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())
            .expect("certificate parameters");
    params.distinguished_name = rcgen::DistinguishedName::new();
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, common_name);
    if expired {
        params.not_before = rcgen::date_time_ymd(2020, 1, 1);
        params.not_after = rcgen::date_time_ymd(2021, 1, 1);
    }
    let key = rcgen::KeyPair::generate().expect("a key pair");
    let cert = params.self_signed(&key).expect("a self-signed certificate");
    let files = CertFiles {
        cert: dir.join(format!("{stem}.pem")),
        key: dir.join(format!("{stem}.key")),
    };
    std::fs::write(&files.cert, cert.pem()).expect("writing the certificate");
    std::fs::write(&files.key, key.serialize_pem()).expect("writing the key");
    files
}

/// A folder every user may read: the workers run as nobody when the tests run as root.
fn open_folder(path: &Path) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(path).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
}

fn open_file(path: &Path, text: &str) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(path, text).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o644)).unwrap();
}

/// The three sites on disk, and the upstream a.test's `/api` proxies to.
struct Sites {
    dir: TempDir,
    upstream: PyUpstream,
}

impl Sites {
    fn new() -> Sites {
        let dir = temp_dir("ringmux-sites");
        for site in [&A, &B, &W] {
            certificate(dir.path(), site.stem, site.common_name, site.names, false);
            let root = dir.path().join(format!("root-{}", site.stem));
            open_folder(&root);
            open_file(&root.join("index.html"), site.index);
        }
        Sites {
            dir,
            upstream: PyUpstream::start(),
        }
    }

    fn cert(&self, site: &SiteSpec) -> PathBuf {
        self.dir.path().join(format!("{}.pem", site.stem))
    }

    /// The configuration file of the three sites, with `extra` at its top (settings,
    /// `default_site`).
    fn config(&self, extra: &str) -> PathBuf {
        let d = self.dir.path().display();
        let upstream = self.upstream.url();
        let text = format!(
            r#"{extra}
[[site]]
names = ["a.test", "www.a.test"]
cert = "{d}/a.pem"
key = "{d}/a.key"
[[site.route]]
path = "/"
root = "{d}/root-a"
[[site.route]]
path = "/api"
upstream = "{upstream}"
strip_prefix = true
[[site.route]]
path = "/old"
redirect = "https://b.test{{path}}?{{query}}"
status = 301
[[site.route]]
path = "/hi"
respond = {{ status = 200, body = {HI:?}, headers = {{ "X-Ringmux-Test" = "hi", "cache-control" = "no-store" }} }}

[[site]]
names = ["b.test"]
cert = "{d}/b.pem"
key = "{d}/b.key"
[[site.route]]
path = "/"
root = "{d}/root-b"

[[site]]
names = ["*.w.test"]
cert = "{d}/w.pem"
key = "{d}/w.key"
[[site.route]]
path = "/"
root = "{d}/root-w"
"#
        );
        let path = self
            .dir
            .path()
            .join(format!("sites-{}.toml", harness::random_u64()));
        std::fs::write(&path, text).unwrap();
        path
    }

    /// A ringmux of two workers serving the sites, with `extra` at the top of its file.
    fn start(&self, extra: &str) -> Ringmux {
        self.start_edited(extra, |text| text)
    }

    /// As [`Sites::start`], the file's text passed through `edit` first.
    fn start_edited(&self, extra: &str, edit: impl FnOnce(String) -> String) -> Ringmux {
        let config = self.config(extra);
        let text = std::fs::read_to_string(&config).unwrap();
        std::fs::write(&config, edit(text)).unwrap();
        Ringmux::start(2, Forward::Shm, &["--config", &config.to_string_lossy()])
    }
}

// ---------------------------------------------------------------------------------------------
// curl (HTTPS over TCP)

/// What one curl run got.
#[derive(Debug)]
struct Got {
    status: u16,
    /// `%{http_version}`: "1.1" or "2".
    version: String,
    /// The leaf certificate's subject as curl prints it, spaces taken out: `CN=...`.
    subject: String,
    /// The response's header section, names lower-case.
    headers: Vec<(String, String)>,
    body: String,
}

impl Got {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

/// curl `path` on `rm` over TCP, reaching it as `reach`, trusting `cacert` (`None`: any
/// certificate) with `args` (`--http1.1`, `-H`, ...): what it got, or its standard error if it
/// failed.
async fn curl(
    rm: &Ringmux,
    reach: Reach<'_>,
    cacert: Option<&Path>,
    args: &[&str],
    path: &str,
) -> Result<Got, String> {
    let port = rm.listen.port();
    let got = curl::get(rm.dir(), port, reach, cacert, args, path, CLIENT_TIMEOUT).await?;
    // The first certificate curl lists is the leaf.
    let subject = got
        .subject
        .as_deref()
        .unwrap_or_else(|| panic!("curl {args:?} {path}: no certificate subject in {got:?}"))
        .replace(' ', "");
    Ok(Got {
        status: got.status,
        version: got.version,
        subject,
        headers: got.headers,
        body: got.body,
    })
}

/// As [`curl`], which must succeed.
async fn curl_ok(
    rm: &Ringmux,
    reach: Reach<'_>,
    cacert: Option<&Path>,
    args: &[&str],
    path: &str,
) -> Got {
    curl(rm, reach, cacert, args, path)
        .await
        .unwrap_or_else(|e| panic!("curl {args:?} {path}: {e}"))
}

const TCP_VERSIONS: [(&str, &str); 2] = [("--http1.1", "1.1"), ("--http2", "2")];

fn subject_of(site: &SiteSpec) -> String {
    format!("CN={}", site.common_name).replace(' ', "")
}

// ---------------------------------------------------------------------------------------------
// aioquic (HTTP/3)

/// One aioquic connection with the TLS server name `server_name` ("" for none) that GETs each
/// of `paths` (a path, or https://HOST/PATH for another :authority): the script's result.
async fn aioquic(rm: &Ringmux, server_name: &str, paths: &[&str]) -> Json {
    let mut args = vec![
        ringmux_testkit::aioquic::script()
            .to_string_lossy()
            .into_owned(),
        "127.0.0.1".into(),
        rm.listen.port().to_string(),
        "paths".into(),
        "--server-name".into(),
        server_name.into(),
    ];
    for p in paths {
        args.extend(["--path".to_string(), p.to_string()]);
    }
    let out = tool::run("python3", &args, rm.dir(), CLIENT_TIMEOUT).await;
    ringmux_testkit::aioquic::result(&out.stdout).unwrap_or_else(|| {
        panic!(
            "aioquic: no JSON result in {:?}\n{}",
            out.stdout,
            tail(&out.stderr, 40)
        )
    })
}

/// As [`aioquic`], which must succeed: for each path, its status, body and header fields;
/// and the subject of the certificate the server sent.
async fn aioquic_ok(rm: &Ringmux, server_name: &str, paths: &[&str]) -> (Vec<H3Got>, String) {
    let j = aioquic(rm, server_name, paths).await;
    assert_eq!(
        j["ok"],
        Json::Bool(true),
        "aioquic with server name {server_name:?}, {paths:?}: {}",
        j["error"]
    );
    let got = (0..paths.len())
        .map(|i| {
            let summary = j["bodies"][i].as_str().expect("a body summary");
            H3Got {
                status: summary.split(' ').nth(1).unwrap().parse().unwrap(),
                body: j["texts"][i].as_str().unwrap().to_string(),
                headers: j["headers"][i].clone(),
            }
        })
        .collect();
    let subject = j["peer"]["subject"]
        .as_str()
        .expect("the peer's subject")
        .to_string();
    (got, subject)
}

#[derive(Debug)]
struct H3Got {
    status: u16,
    body: String,
    headers: Json,
}

// ---------------------------------------------------------------------------------------------
// Serving

/// Over HTTP/1.1 and HTTP/2, each name gets its own site's certificate (curl verifies it
/// against that site's alone) and its own site's root; `x.w.test` the wildcard's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_name_gets_its_sites_certificate_and_root_over_tcp() {
    if !tool::CURL.present() {
        return;
    }
    bounded(LIMIT, async {
        let sites = Sites::new();
        let rm = sites.start("");
        for (name, site) in ASKED {
            for (flag, version) in TCP_VERSIONS {
                let got = curl_ok(
                    &rm,
                    Reach::Name(name),
                    Some(&sites.cert(site)),
                    &[flag],
                    "/",
                )
                .await;
                let what = format!("{name} {flag}");
                assert_eq!(got.status, 200, "{what}: {got:?}");
                assert_eq!(got.version, version, "{what}");
                assert_eq!(got.subject, subject_of(site), "{what}: the certificate");
                assert_eq!(got.body, site.index, "{what}: the content");
            }
        }
    })
    .await
}

/// Over HTTP/3 likewise: aioquic sends each name as its server name and reports the
/// certificate it was given.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_name_gets_its_sites_certificate_and_root_over_http3() {
    if !tool::AIOQUIC.present() {
        return;
    }
    bounded(LIMIT, async {
        let sites = Sites::new();
        let rm = sites.start("");
        for (name, site) in ASKED {
            let (got, subject) = aioquic_ok(&rm, name, &["/"]).await;
            assert_eq!(subject, format!("CN={}", site.common_name), "{name}");
            assert_eq!(
                (got[0].status, got[0].body.as_str()),
                (200, site.index),
                "{name}"
            );
        }
    })
    .await
}

/// a.test's routes on all three protocols: `/api` proxied with its prefix taken off (the
/// upstream says what it was asked), `/old` redirected with the path and query put in the
/// target, `/hi` answered from the file with the header fields it names; b.test has none of
/// them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sites_routes_proxy_redirect_and_respond_on_every_protocol() {
    if !tool::CURL.present() || !tool::AIOQUIC.present() {
        return;
    }
    bounded(LIMIT, async {
        let sites = Sites::new();
        let rm = sites.start("");
        let a = sites.cert(&A);
        let location = "https://b.test/old/x/y?q=1&r=2";
        for (flag, _) in TCP_VERSIONS {
            let www = Reach::Name("www.a.test");
            let api = curl_ok(&rm, www, Some(&a), &[flag], "/api/headers").await;
            assert_eq!(api.status, 200, "{flag}: {api:?}");
            assert_eq!(
                api.body.lines().next(),
                Some("GET /headers"),
                "{flag}: what the upstream was asked"
            );
            let old = curl_ok(&rm, www, Some(&a), &[flag], "/old/x/y?q=1&r=2").await;
            assert_eq!(old.status, 301, "{flag}: {old:?}");
            assert_eq!(old.header("location"), Some(location), "{flag}");
            let hi = curl_ok(&rm, www, Some(&a), &[flag], "/hi").await;
            assert_eq!((hi.status, hi.body.as_str()), (200, HI), "{flag}");
            assert_eq!(hi.header("x-ringmux-test"), Some("hi"), "{flag}: {hi:?}");
            assert_eq!(
                hi.header("cache-control"),
                Some("no-store"),
                "{flag}: {hi:?}"
            );
            let not_b = curl_ok(
                &rm,
                Reach::Name("b.test"),
                Some(&sites.cert(&B)),
                &[flag],
                "/hi",
            )
            .await;
            assert_eq!(not_b.status, 404, "{flag}: b.test/hi {not_b:?}");
        }
        let (got, _) = aioquic_ok(
            &rm,
            "www.a.test",
            &["/api/headers", "/old/x/y?q=1&r=2", "/hi"],
        )
        .await;
        assert_eq!(got[0].status, 200, "h3 /api: {got:?}");
        assert_eq!(got[0].body.lines().next(), Some("GET /headers"), "h3 /api");
        assert_eq!(got[1].status, 301, "h3 /old: {got:?}");
        assert_eq!(got[1].headers["location"], location, "h3 /old");
        assert_eq!((got[2].status, got[2].body.as_str()), (200, HI), "h3 /hi");
        assert_eq!(got[2].headers["x-ringmux-test"], "hi", "h3 /hi: {got:?}");
        assert_eq!(
            got[2].headers["cache-control"], "no-store",
            "h3 /hi: {got:?}"
        );
    })
    .await
}

/// Without `default_site`, a handshake for a name no site has, or without a name, is refused
/// with the TLS alert unrecognized_name (RFC 6066 §3), over TCP and over QUIC (error 0x170 =
/// 0x100 + 112, RFC 9001 §4.8); a known name still gets through on the same server afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_default_site_unknown_names_and_no_name_fail_the_handshake() {
    if !tool::CURL.present() || !tool::AIOQUIC.present() {
        return;
    }
    bounded(LIMIT, async {
        let sites = Sites::new();
        let rm = sites.start("");
        for (what, reach) in [
            ("no server name", Reach::Address),
            ("an unknown name", Reach::Name("nope.test")),
        ] {
            for (flag, _) in TCP_VERSIONS {
                let err = curl(&rm, reach, None, &[flag], "/")
                    .await
                    .map(|got| format!("{got:?}"))
                    .expect_err(&format!("{what} {flag}: curl got an answer"));
                // 35: CURLE_SSL_CONNECT_ERROR, here the server's alert.
                assert!(
                    err.contains("(35)") && err.to_ascii_lowercase().contains("unrecognized name"),
                    "{what} {flag}: {err}"
                );
            }
        }
        // Each refusal is counted as one for its name, none as a failed handshake (`ringmux
        // stats` once showed them as "refused (over cap, TLS)").
        let refused = 2.0 * TCP_VERSIONS.len() as f64;
        let kind = |m: &Metrics, k: &str| m.sum_where(names::WORKER_TCP_ERRORS, "kind", k);
        let m = rm
            .wait_for("the refusals counted", LIMIT, |m| {
                kind(m, "unknown_name") >= refused
            })
            .await;
        assert_eq!(kind(&m, "unknown_name"), refused, "{m}");
        assert_eq!(kind(&m, "tls_failed"), 0.0, "{m}");
        assert_eq!(kind(&m, "over_cap"), 0.0, "{m}");
        for (what, name) in [("no server name", ""), ("an unknown name", "nope.test")] {
            let j = aioquic(&rm, name, &["/"]).await;
            assert_eq!(j["ok"], Json::Bool(false), "{what} over QUIC: {j}");
            let err = j["error"].as_str().unwrap_or_default();
            assert!(err.contains("error code 0x170"), "{what} over QUIC: {err}");
        }
        // Counted as refused for their name over QUIC too, not as failed connections.
        let quic =
            |m: &Metrics| m.sum_where("ringmux_worker_quic_errors_total", "kind", "unknown_name");
        let m = rm
            .wait_for("the QUIC refusals counted", LIMIT, |m| quic(m) >= 2.0)
            .await;
        assert_eq!(quic(&m), 2.0, "{m}");
        assert_eq!(m.sum("ringmux_worker_connections_failed_total"), 0.0, "{m}");
        let got = curl_ok(&rm, Reach::Name("a.test"), Some(&sites.cert(&A)), &[], "/").await;
        assert_eq!(got.body, A.index);
        let (got, _) = aioquic_ok(&rm, "a.test", &["/"]).await;
        assert_eq!(got[0].body, A.index);
    })
    .await
}

/// With `default_site = "a.test"`, a handshake for an unknown name or without a name gets
/// a.test's certificate and its requests a.test's content, on all three protocols; the other
/// sites' names still get their own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_default_site_answers_unknown_names_and_no_name() {
    if !tool::CURL.present() || !tool::AIOQUIC.present() {
        return;
    }
    bounded(LIMIT, async {
        let sites = Sites::new();
        let rm = sites.start(r#"default_site = "a.test""#);
        for (what, reach) in [
            ("no server name", Reach::Address),
            ("an unknown name", Reach::Name("nope.test")),
        ] {
            for (flag, _) in TCP_VERSIONS {
                let got = curl_ok(&rm, reach, None, &[flag], "/").await;
                assert_eq!(got.status, 200, "{what} {flag}: {got:?}");
                assert_eq!(got.subject, subject_of(&A), "{what} {flag}");
                assert_eq!(got.body, A.index, "{what} {flag}");
                let hi = curl_ok(&rm, reach, None, &[flag], "/hi").await;
                assert_eq!(hi.body, HI, "{what} {flag}");
            }
        }
        for (what, name) in [("no server name", ""), ("an unknown name", "nope.test")] {
            let (got, subject) = aioquic_ok(&rm, name, &["/", "/hi"]).await;
            assert_eq!(subject, format!("CN={}", A.common_name), "{what} over QUIC");
            assert_eq!(
                (got[0].status, got[0].body.as_str(), got[1].body.as_str()),
                (200, A.index, HI),
                "{what} over QUIC"
            );
        }
        let got = curl_ok(&rm, Reach::Name("b.test"), Some(&sites.cert(&B)), &[], "/").await;
        assert_eq!(
            (got.subject, got.body),
            (subject_of(&B), B.index.to_string())
        );
        let (got, subject) = aioquic_ok(&rm, "x.w.test", &["/"]).await;
        assert_eq!(
            (subject, got[0].body.as_str()),
            (format!("CN={}", W.common_name), W.index)
        );
    })
    .await
}

/// On a connection made for a.test (its server name), a request for b.test or x.w.test is
/// answered 421 (RFC 9110 §15.5.20), one for a.test's own names 200 with a.test's content:
/// the host field over HTTP/1.1, the :authority over HTTP/2 (curl turns `-H host:` into it)
/// and HTTP/3 (all on one connection).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_for_another_site_on_a_connection_is_misdirected() {
    if !tool::CURL.present() || !tool::AIOQUIC.present() {
        return;
    }
    bounded(LIMIT, async {
        let sites = Sites::new();
        let rm = sites.start("");
        let a = sites.cert(&A);
        let port = rm.listen.port();
        for (flag, _) in TCP_VERSIONS {
            for (host, status, body) in [
                ("b.test", 421, MISDIRECTED),
                ("x.w.test", 421, MISDIRECTED),
                ("www.a.test", 200, A.index),
                ("a.test", 200, A.index),
            ] {
                let host_field = format!("host: {host}:{port}");
                let got = curl_ok(
                    &rm,
                    Reach::Name("a.test"),
                    Some(&a),
                    &[flag, "-H", &host_field],
                    "/",
                )
                .await;
                assert_eq!(got.subject, subject_of(&A), "{flag} {host}");
                assert_eq!(
                    (got.status, got.body.as_str()),
                    (status, body),
                    "{flag}, host {host} on a connection for a.test"
                );
            }
        }
        let urls =
            ["b.test", "x.w.test", "www.a.test", "a.test"].map(|h| format!("https://{h}:{port}/"));
        let paths: Vec<&str> = urls.iter().map(String::as_str).collect();
        let (got, subject) = aioquic_ok(&rm, "a.test", &paths).await;
        assert_eq!(subject, format!("CN={}", A.common_name));
        let seen: Vec<(u16, &str)> = got.iter().map(|g| (g.status, g.body.as_str())).collect();
        assert_eq!(
            seen,
            [
                (421, MISDIRECTED),
                (421, MISDIRECTED),
                (200, A.index),
                (200, A.index)
            ],
            "HTTP/3, :authority b.test, x.w.test, www.a.test, a.test on one connection for a.test"
        );
    })
    .await
}

/// With `[[site]]`s, the plain-HTTP listener redirects only the sites' names, over HTTP/1.1:
/// a host no site is named gets 421 and no `location`, even with a default site (which answers
/// unknown names on TLS, not here); so does an absolute-form target naming another host,
/// whatever `host` says; a host with user information gets 400.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_plain_http_listener_redirects_only_the_sites_names() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    bounded(LIMIT, async {
        let sites = Sites::new();
        let redirect = harness::unused_tcp_port();
        let rm = sites.start(&format!(
            "default_site = \"a.test\"\nredirect_http = \"{redirect}\""
        ));
        // The status and location of one request, written as it stands.
        let ask = |head: String| async move {
            let mut s = tokio::net::TcpStream::connect(redirect).await.unwrap();
            s.write_all(head.as_bytes()).await.unwrap();
            let mut answer = Vec::new();
            s.read_to_end(&mut answer).await.unwrap();
            let text = String::from_utf8_lossy(&answer).into_owned();
            let status = text
                .split(' ')
                .nth(1)
                .and_then(|c| c.parse::<u16>().ok())
                .unwrap_or_else(|| panic!("no status in {text:?}"));
            let location = text.lines().find_map(|l| {
                l.to_ascii_lowercase()
                    .strip_prefix("location: ")
                    .map(str::to_owned)
            });
            (status, location, text)
        };
        let get = |target: &str, host: &str| {
            format!("GET {target} HTTP/1.1\r\nhost: {host}\r\nconnection: close\r\n\r\n")
        };
        for (target, host, to) in [
            ("/x?y=1", "a.test", "https://a.test:"),
            ("/", "WWW.A.TEST.", "https://www.a.test.:"),
            ("/", "x.w.test:80", "https://x.w.test:"),
            ("http://b.test/", "evil.example", "https://b.test:"),
        ] {
            let (status, location, text) = ask(get(target, host)).await;
            assert_eq!(status, 301, "{target} {host}: {text}");
            let location = location.unwrap_or_default();
            assert!(location.starts_with(to), "{target} {host}: {location}");
        }
        for (target, host, want) in [
            ("/", "evil.example", 421),
            ("/", "evil.example:80", 421),
            ("/", "a.test.evil.example", 421),
            ("http://evil.example/", "a.test", 421),
            ("/", "a.test@evil.example", 400),
            ("http://a.test@evil.example/", "a.test", 400),
        ] {
            let (status, location, text) = ask(get(target, host)).await;
            assert_eq!(status, want, "{target} {host}: {text}");
            assert_eq!(location, None, "{target} {host}: {text}");
            assert!(!text.contains("evil.example"), "{target} {host}: {text}");
        }
        drop(rm);
    })
    .await
}

// ---------------------------------------------------------------------------------------------
// The configuration file: ringmux check, and a start

fn ringmux(args: &[&std::ffi::OsStr], env: &[(&str, &str)]) -> Output {
    Command::new(harness::binary("ringmux"))
        .args(args)
        .env("RUST_LOG", "warn")
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .output()
        .expect("running ringmux")
}

/// `ringmux check --config FILE [args]`.
fn check(file: &Path, args: &[&str]) -> Output {
    let mut all: Vec<&std::ffi::OsStr> = vec!["check".as_ref(), "--config".as_ref(), file.as_ref()];
    all.extend(args.iter().map(|a| std::ffi::OsStr::new(*a)));
    ringmux(&all, &[])
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// What the check tests' files refer to: certificates good and bad, a root.
struct Parts {
    dir: TempDir,
}

impl Parts {
    fn new() -> Parts {
        let dir = temp_dir("ringmux-sites-check");
        let d = dir.path();
        certificate(d, "a", A.common_name, A.names, false);
        certificate(d, "b", B.common_name, B.names, false);
        certificate(d, "ab", "a.test and b.test", &["a.test", "b.test"], false);
        certificate(d, "old", "expired", &["a.test"], true);
        open_folder(&d.join("root"));
        open_folder(&d.join("open"));
        // A root in a folder only its owner may enter.
        open_folder(&d.join("closed/site"));
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(d.join("closed"), std::fs::Permissions::from_mode(0o700))
                .unwrap();
        }
        // Files that are no files: a FIFO nothing writes to, and a 2 GiB sparse file.
        nix::unistd::mkfifo(
            &d.join("fifo"),
            nix::sys::stat::Mode::from_bits_truncate(0o600),
        )
        .unwrap();
        std::fs::File::create(d.join("sparse"))
            .unwrap()
            .set_len(2 << 30)
            .unwrap();
        Parts { dir }
    }

    fn path(&self, name: &str) -> String {
        self.dir.path().join(name).to_string_lossy().into_owned()
    }

    /// `text` written as a file; `{D}` in it stands for the folder of the parts.
    fn file(&self, name: &str, text: &str) -> PathBuf {
        let path = self.dir.path().join(format!("{name}.toml"));
        let d = self.dir.path().to_string_lossy();
        std::fs::write(&path, text.replace("{D}", &d)).unwrap();
        path
    }
}

/// A good site of seven lines: `[[site]]` on the first, `cert` on the third (column 8), the
/// route's header on the fifth.
const SITE: &str = r#"[[site]]
names = ["a.test", "www.a.test"]
cert = "{D}/a.pem"
key = "{D}/a.key"
[[site.route]]
path = "/"
root = "{D}/root"
"#;

/// [`SITE`] with its certificate from ACME.
const ACME_SITE: &str = r#"[[site]]
names = ["a.test", "www.a.test"]
acme = true
[[site.route]]
path = "/"
root = "{D}/root"
"#;

/// A problem as `ringmux check` must name it: line, column, the message's beginning (`FILE`
/// in it stands for the file's path).
type Placed = (usize, usize, String);

/// Each broken file refused by `ringmux check` with exit status 1 and its one problem
/// (several for the last) named at its place, `FILE:LINE:COLUMN: message`, the first line
/// starting `ringmux: `.
#[test]
fn check_names_every_problem_at_its_place() {
    let parts = Parts::new();
    let p = |name: &str| parts.path(name);
    // (what, the file, [a problem])
    let mut cases: Vec<(&str, String, Vec<Placed>)> = vec![
        (
            "an unknown setting",
            format!("tcp_max_conections = 5\n{SITE}"),
            vec![(
                1,
                1,
                "unknown setting `tcp_max_conections`; did you mean `tcp_max_connections`?".into(),
            )],
        ),
        (
            "an unknown key of a site",
            SITE.replace("[[site.route]]", "nmes = [\"c.test\"]\n[[site.route]]"),
            vec![(
                5,
                1,
                "unknown key of [[site]] `nmes`; did you mean `names`?".into(),
            )],
        ),
        (
            "an unknown key of a route",
            format!("{SITE}upstraem = \"http://127.0.0.1:9\"\n"),
            vec![(
                8,
                1,
                "unknown key of [[site.route]] `upstraem`; did you mean `upstream`?".into(),
            )],
        ),
        (
            "a setting out of its flag's range",
            format!("instances = 0\n{SITE}"),
            vec![(
                1,
                13,
                "--instances / RINGMUX_INSTANCES=0 is not valid: expected 1 to 64".into(),
            )],
        ),
        (
            "a timeout of 0",
            format!("tcp_idle_timeout = 0\n{SITE}"),
            vec![(
                1,
                20,
                "tcp_idle_timeout = 0 is not valid: 0 is not in 1..=3600".into(),
            )],
        ),
        (
            "a setting of the wrong type",
            format!("instances = \"two\"\n{SITE}"),
            vec![(1, 13, "instances = \"two\" is not valid: invalid digit found in string".into())],
        ),
        (
            "a name in two sites",
            format!(
                "{SITE}\n{}",
                SITE.replace("\"a.test\", \"www.a.test\"", "\"b.test\", \"A.test\"")
                    .replace("a.pem", "ab.pem")
                    .replace("a.key", "ab.key")
            ),
            vec![(
                10,
                20,
                "the name a.test belongs to two sites: this one and the site at FILE:2:10; give \
                 each name to one site only"
                    .into(),
            )],
        ),
        (
            "a certificate not covering a name",
            SITE.replace("\"www.a.test\"", "\"c.test\""),
            vec![(
                3,
                8,
                format!(
                    "the certificate {} does not cover the site's name c.test (it covers a.test, \
                     www.a.test)",
                    p("a.pem")
                ),
            )],
        ),
        (
            "an expired certificate",
            SITE.replace("\"www.a.test\"", "\"a.test\"")
                .replace("a.pem", "old.pem")
                .replace("a.key", "old.key"),
            vec![(
                3,
                8,
                format!("the certificate {} expired on ", p("old.pem")),
            )],
        ),
        (
            "a key not matching its certificate",
            SITE.replace("a.key", "b.key"),
            vec![(
                4,
                7,
                format!(
                    "the key {} does not go with the certificate {}",
                    p("b.key"),
                    p("a.pem")
                ),
            )],
        ),
        (
            "a missing certificate file",
            SITE.replace("a.pem", "nowhere.pem"),
            vec![(
                3,
                8,
                format!(
                    "cannot read the certificate file {}: No such file or directory",
                    p("nowhere.pem")
                ),
            )],
        ),
        (
            "a root that does not exist",
            SITE.replace("{D}/root", "{D}/nowhere"),
            vec![(7, 8, format!("root = {}: not a directory", p("nowhere")))],
        ),
        (
            "an upstream of another scheme",
            format!("{SITE}[[site.route]]\npath = \"/api\"\nupstream = \"ftp://127.0.0.1:9\"\n"),
            vec![(
                10,
                12,
                "upstream = \"ftp://127.0.0.1:9\": expected http://HOST:PORT, https://HOST:PORT"
                    .into(),
            )],
        ),
        (
            "an upstream_ca that does not exist",
            format!(
                "{SITE}[[site.route]]\npath = \"/api\"\nupstream = \"https://127.0.0.1:9\"\n\
                 upstream_ca = \"{{D}}/nowhere.pem\"\n"
            ),
            vec![(
                11,
                15,
                format!("upstream_ca = {}: cannot read it: ", p("nowhere.pem")),
            )],
        ),
        (
            "an upstream_ca without a certificate",
            format!(
                "{SITE}[[site.route]]\npath = \"/api\"\nupstream = \"h2://127.0.0.1:9\"\n\
                 upstream_ca = \"{{D}}/a.key\"\n"
            ),
            vec![(
                11,
                15,
                format!("upstream_ca = {}: no CERTIFICATE in it", p("a.key")),
            )],
        ),
        (
            "upstream_sni beside an upstream in the clear",
            format!(
                "{SITE}[[site.route]]\npath = \"/api\"\nupstream = \"h2c://127.0.0.1:9\"\n\
                 upstream_sni = \"api.internal\"\n"
            ),
            vec![(
                11,
                16,
                "upstream_sni goes with a TLS upstream (https:// or h2://), and upstream = \
                 \"h2c://127.0.0.1:9\" is in the clear"
                    .into(),
            )],
        ),
        (
            "a redirect status of 300",
            format!(
                "{SITE}[[site.route]]\npath = \"/old\"\nredirect = \"https://b.test{{path}}\"\n\
                 status = 300\n"
            ),
            vec![(11, 10, "status = 300: a redirect is 301, 302, 307 or 308".into())],
        ),
        (
            "a route with two actions",
            format!(
                "{SITE}[[site.route]]\npath = \"/x\"\nrespond = {{ status = 200, body = \"x\" \
                 }}\nredirect = \"https://b.test/\"\n"
            ),
            vec![(8, 1, "a [[site.route]] takes one action: root = DIR, upstream = URL, redirect = URL, or respond = { status = N, body = \"...\" }".into())],
        ),
        (
            "a default site that is no site",
            format!("default_site = \"z.test\"\n{SITE}"),
            vec![(
                1,
                16,
                "default_site = \"z.test\" is no site's name: name one of the names of a \
                 [[site]]"
                    .into(),
            )],
        ),
        (
            "a TOML syntax error",
            format!("instances = \n{SITE}"),
            vec![(1, 13, "not valid TOML: ".into())],
        ),
        (
            "a site's option beside the sites",
            format!("root = \"{{D}}/root\"\n{SITE}"),
            vec![(
                1,
                8,
                "--root / RINGMUX_ROOT (root) is set beside the [[site]] tables of FILE: each \
                 site has its own (cert and key in its [[site]], root and upstream in its \
                 [[site.route]]s); drop the option"
                    .into(),
            )],
        ),
        (
            "three problems at once",
            format!(
                "tcp_max_conections = 5\n{}[[site.route]]\npath = \"/old\"\nredirect = \
                 \"https://b.test/\"\nstatus = 300\n",
                SITE.replace("a.pem", "nowhere.pem")
            ),
            vec![
                (1, 1, "unknown setting `tcp_max_conections`".into()),
                (
                    4,
                    8,
                    format!("cannot read the certificate file {}", p("nowhere.pem")),
                ),
                (12, 10, "status = 300: a redirect is".into()),
            ],
        ),
        (
            "acme beside cert and key",
            SITE.replace("key = \"{D}/a.key\"", "key = \"{D}/a.key\"\nacme = true"),
            vec![(
                3,
                8,
                "site a.test: cert and key beside acme = true: the certificate comes from the \
                 [acme] CA; drop cert and key, or drop acme = true"
                    .into(),
            )],
        ),
        (
            "a wildcard by ACME",
            ACME_SITE.replace("\"www.a.test\"", "\"*.a.test\""),
            vec![(
                2,
                20,
                "site a.test: the wildcard *.a.test with acme = true: a wildcard certificate \
                 needs the DNS-01 challenge"
                    .into(),
            )],
        ),
        (
            "an unknown key of [acme]",
            format!("[acme]\nemial = \"ops@a.test\"\n{ACME_SITE}"),
            vec![(
                2,
                1,
                "unknown key of [acme] `emial`; did you mean `email`?".into(),
            )],
        ),
        (
            "a challenge ringmux does not answer",
            format!("[acme]\nchallenge = \"dns-01\"\n{ACME_SITE}"),
            vec![(
                2,
                13,
                "acme.challenge = \"dns-01\": expected \"tls-alpn-01\" (the default: on the \
                 TCP listener) or \"http-01\" (on redirect_http)"
                    .into(),
            )],
        ),
        (
            "http-01 without the plain-HTTP listener",
            format!("[acme]\nchallenge = \"http-01\"\n{ACME_SITE}"),
            vec![(
                2,
                13,
                "acme.challenge = \"http-01\" is answered on the plain-HTTP listener: set \
                 redirect_http = \"0.0.0.0:80\""
                    .into(),
            )],
        ),
        (
            "tls-alpn-01 without TCP",
            format!("tcp = \"off\"\n{ACME_SITE}"),
            vec![(
                4,
                8,
                "acme.challenge = \"tls-alpn-01\" is answered on the TCP listener, but tcp is \
                 off"
                .into(),
            )],
        ),
        (
            "a relative state directory",
            format!("[acme]\nstate = \"acme\"\n{ACME_SITE}"),
            vec![(2, 9, "acme.state = \"acme\": give an absolute path".into())],
        ),
        (
            "a state directory open to others",
            format!("[acme]\nstate = \"{{D}}/open\"\n{ACME_SITE}"),
            vec![(
                2,
                9,
                format!(
                    "acme.state = {}: open to others (mode 755), and it holds the account's \
                     and sites' private keys: chmod 700 {}",
                    p("open"),
                    p("open")
                ),
            )],
        ),
        (
            "an external account binding without its key",
            format!("[acme]\neab_kid = \"kid-1\"\n{ACME_SITE}"),
            vec![(
                2,
                11,
                "acme.eab_kid and acme.eab_hmac_key go together".into(),
            )],
        ),
        (
            "a directory that is not https",
            format!("[acme]\ndirectory = \"http://ca.test/dir\"\nemail = \"ops\"\n{ACME_SITE}"),
            vec![
                (
                    2,
                    13,
                    "acme.directory = \"http://ca.test/dir\": expected the CA's directory URL, \
                     https://HOST/"
                        .into(),
                ),
                (3, 9, "acme.email = \"ops\": expected one address".into()),
            ],
        ),
        (
            "a certificate that is a FIFO",
            SITE.replace("a.pem", "fifo"),
            vec![(
                3,
                8,
                format!(
                    "cannot read the certificate file {}: a FIFO, not a regular file",
                    p("fifo")
                ),
            )],
        ),
        (
            "a key that is a device",
            SITE.replace("{D}/a.key", "/dev/zero"),
            vec![(
                3,
                8,
                "cannot read the private key file /dev/zero: a character device, not a regular \
                 file"
                    .into(),
            )],
        ),
        (
            "a certificate of 2 GiB",
            SITE.replace("a.pem", "sparse"),
            vec![(
                3,
                8,
                format!(
                    "cannot read the certificate file {}: 2147483648 bytes, more than the \
                     1048576",
                    p("sparse")
                ),
            )],
        ),
        (
            "roots that are a FIFO",
            format!("[acme]\nca_roots = \"{{D}}/fifo\"\n{ACME_SITE}"),
            vec![(
                2,
                12,
                format!(
                    "acme.ca_roots = {}: cannot read it: a FIFO, not a regular file",
                    p("fifo")
                ),
            )],
        ),
        (
            "a root in /proc",
            SITE.replace("{D}/root", "/proc/self"),
            vec![(
                7,
                8,
                "root = /proc/self: on proc, a file system the kernel makes up".into(),
            )],
        ),
        (
            "a site's deny with a prefix too long",
            SITE.replace("[[site.route]]", "deny = [\"203.0.113.0/33\"]\n[[site.route]]"),
            vec![(
                5,
                8,
                "deny: \"203.0.113.0/33\": the prefix length is 0 to 32 (IPv4) or 128 (IPv6)"
                    .into(),
            )],
        ),
        (
            "a route's allow with bits beyond its prefix",
            format!("{SITE}allow = [\"10.0.0.0/8\", \"10.0.0.1/8\"]\n"),
            vec![(
                8,
                9,
                "allow: \"10.0.0.1/8\": bits are set beyond the prefix: write the block's first \
                 address (e.g. 203.0.113.0/24)"
                    .into(),
            )],
        ),
        (
            "PROXY protocol sources with bits beyond a prefix",
            format!("proxy_protocol_from = [\"10.0.0.1/8\"]\n{SITE}"),
            vec![(
                1,
                23,
                "proxy_protocol_from = [\"10.0.0.1/8\"] is not valid: \"10.0.0.1/8\": bits are \
                 set beyond the prefix: write the block's first address (e.g. 203.0.113.0/24)"
                    .into(),
            )],
        ),
        (
            "roots that are no certificates",
            format!("[acme]\nca_roots = \"{{D}}/a.key\"\n{ACME_SITE}"),
            vec![(
                2,
                12,
                format!("acme.ca_roots = {}: no CERTIFICATE in it", p("a.key")),
            )],
        ),
    ];
    // As root, ringmux runs its workers as nobody, who must be able to read every root.
    if nix::unistd::geteuid().is_root() {
        let nobody = nix::unistd::User::from_name("nobody")
            .ok()
            .flatten()
            .expect("the user nobody");
        cases.push((
            "a root the workers' user cannot enter",
            SITE.replace("{D}/root", "{D}/closed/site"),
            vec![(
                7,
                8,
                format!(
                    "root = {} cannot be reached by user nobody (UID {}), whom the workers \
                     run as: it may not enter the folder {}",
                    p("closed/site"),
                    nobody.uid,
                    p("closed")
                ),
            )],
        ));
    } else {
        eprintln!(
            "not checked: a root the workers cannot enter (ringmux runs them as nobody only \
             when it runs as root)"
        );
    }
    for (i, (what, body, want)) in cases.iter().enumerate() {
        let file = parts.file(&format!("broken-{i}"), body);
        let shown = file.display().to_string();
        let out = check(&file, &[]);
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{what}: {err}");
        assert!(
            !text(&out.stdout).contains("configuration OK"),
            "{what}: {}",
            text(&out.stdout)
        );
        let lines: Vec<&str> = err.lines().collect();
        assert!(lines[0].starts_with("ringmux: "), "{what}: {err}");
        let problems: Vec<&str> = lines
            .iter()
            .map(|l| l.strip_prefix("ringmux: ").unwrap_or(l))
            .collect();
        assert_eq!(problems.len(), want.len(), "{what}: {err}");
        for (line, column, message) in want {
            let expected = format!(
                "{shown}:{line}:{column}: {}",
                message.replace("FILE", &shown)
            );
            assert!(
                problems.iter().any(|p| p.starts_with(&expected)),
                "{what}: expected a line starting\n  {expected}\ngot\n{err}"
            );
        }
        // A string continuation without its backslash leaves the next line's indentation in
        // the message (a date may pad its day with one space: "Jan  1").
        assert!(!err.contains("   "), "{what}: a run of spaces in {err:?}");
    }
}

/// A good file (settings, a default site, two sites with every kind of route) passes with a
/// line per site and `configuration OK`, exit status 0.
#[test]
fn check_accepts_a_good_file_with_a_summary() {
    let parts = Parts::new();
    let file = parts.file(
        "good",
        &format!(
            "tcp_max_connections = 100\ndefault_site = \"a.test\"\n{SITE}\
             [[site.route]]\npath = \"/old\"\nredirect = \"https://b.test{{path}}?{{query}}\"\n\
             status = 308\n\
             [[site.route]]\npath = \"/api\"\nupstream = \"http://127.0.0.1:9\"\n\
             strip_prefix = true\n\
             [[site]]\nnames = [\"b.test\"]\ncert = \"{{D}}/b.pem\"\nkey = \"{{D}}/b.key\"\n\
             [[site.route]]\npath = \"/hi\"\nrespond = {{ status = 200, body = \"hi\" }}\n"
        ),
    );
    let out = check(&file, &[]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(
        text(&out.stdout),
        "site a.test: names a.test, www.a.test; 3 route(s)\n\
         site b.test: names b.test; 1 route(s)\n\
         configuration OK\n"
    );
}

/// A site with `acme = true` and an `[acme]` table pass, and the summary says where the
/// certificate comes from.
#[test]
fn check_accepts_an_acme_site() {
    let parts = Parts::new();
    let file = parts.file(
        "acme",
        &format!(
            "redirect_http = \"127.0.0.1:0\"\n[acme]\ndirectory = \"https://ca.test/dir\"\n\
             email = \"mailto:ops@a.test\"\nstate = \"{{D}}/acme\"\nchallenge = \"http-01\"\n\
             eab_kid = \"kid-1\"\neab_hmac_key = \"c2VjcmV0\"\n{ACME_SITE}"
        ),
    );
    let out = check(&file, &[]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(
        text(&out.stdout),
        format!(
            "site a.test: names a.test, www.a.test; 1 route(s); certificate by ACME\n\
             acme: https://ca.test/dir by http-01, state in {}\n\
             configuration OK\n",
            parts.path("acme")
        )
    );
}

/// A start with a broken file stops before serving, with the words `ringmux check` prints:
/// a problem of the file's keys, of a setting's value and of a site.
#[test]
fn a_start_with_a_broken_file_fails_as_check_does() {
    let parts = Parts::new();
    let keys = parts.dir.path().join("keys");
    ringmux_quic_lb::KeySet::generate()
        .unwrap()
        .write_new(&keys)
        .unwrap();
    let control = parts.dir.path().join("control.sock");
    for (what, body) in [
        (
            "an unknown setting",
            format!("tcp_max_conections = 5\n{SITE}"),
        ),
        ("a setting out of range", format!("instances = 0\n{SITE}")),
        (
            "an expired certificate",
            SITE.replace("\"www.a.test\"", "\"a.test\"")
                .replace("a.pem", "old.pem")
                .replace("a.key", "old.key"),
        ),
    ] {
        let file = parts.file("broken", &body);
        let checked = check(&file, &[]);
        assert_eq!(checked.status.code(), Some(1), "{what}");
        let started = harness::until_exit::<&std::ffi::OsStr>(&[
            "--config".as_ref(),
            file.as_ref(),
            "--listen".as_ref(),
            "127.0.0.1:0".as_ref(),
            "--metrics".as_ref(),
            "127.0.0.1:0".as_ref(),
            "--key-file".as_ref(),
            keys.as_ref(),
            "--control-socket".as_ref(),
            control.as_ref(),
            "--worker-bin".as_ref(),
            harness::worker_bin().as_ref(),
        ]);
        assert_eq!(
            started.status.code(),
            Some(1),
            "{what}: {}",
            text(&started.stderr)
        );
        assert!(
            !text(&started.stdout).contains("ringmux ready"),
            "{what}: it started"
        );
        assert_eq!(
            text(&started.stderr),
            text(&checked.stderr),
            "{what}: a start's words and check's"
        );
    }
}

/// A value given on the command line, or in its environment variable, wins over the file's:
/// `instances = 0` in the file is refused alone and accepted beside `--instances 2` or
/// `RINGMUX_INSTANCES=2`; ringmux then starts with two workers, and a setting of the file no
/// flag gives (`alt_svc`) is what its responses carry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_command_line_wins_over_the_file() {
    bounded(LIMIT, async {
        let sites = Sites::new();
        let alt_svc = r#"h3=":7443"; ma=60"#;
        let file = sites.config(&format!("instances = 0\nalt_svc = {alt_svc:?}"));
        let alone = check(&file, &[]);
        assert_eq!(alone.status.code(), Some(1), "{}", text(&alone.stdout));
        assert!(
            text(&alone.stderr).contains(":1:13: --instances / RINGMUX_INSTANCES=0 is not valid"),
            "{}",
            text(&alone.stderr)
        );
        let flag = check(&file, &["--instances", "2"]);
        assert_eq!(flag.status.code(), Some(0), "{}", text(&flag.stderr));
        let variable = ringmux(
            &["check".as_ref(), "--config".as_ref(), file.as_ref()],
            &[("RINGMUX_INSTANCES", "2")],
        );
        assert_eq!(
            variable.status.code(),
            Some(0),
            "{}",
            text(&variable.stderr)
        );

        // The harness gives --instances 2 on the command line.
        let rm = Ringmux::start(2, Forward::Shm, &["--config", &file.to_string_lossy()]);
        assert_eq!(rm.worker_pids().await.len(), 2);
        if tool::CURL.present() {
            let got = curl_ok(&rm, Reach::Name("b.test"), Some(&sites.cert(&B)), &[], "/").await;
            assert_eq!(got.body, B.index);
            assert_eq!(got.header("alt-svc"), Some(alt_svc), "{got:?}");
        }
    })
    .await
}

// ---------------------------------------------------------------------------------------------
// Reload

/// FNV-1a 64 of `bytes`, as the aioquic script sums a body.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// A reload that replaces a.test's certificate while 20 MiB downloads from b.test run over
/// HTTP/1.1 and HTTP/2 (slow readers, so they span the reload) and HTTP/3: each download
/// arrives byte-exact, and a.test's new certificate is served on both transports as soon as
/// `ringmux reload` answers. Then a broken file is refused by the reload, which says why, and
/// the configuration running serves on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_replaces_a_certificate_while_downloads_from_another_site_run() {
    if !tool::CURL.present() || !tool::AIOQUIC.present() {
        return;
    }
    bounded(LIMIT, async {
        let sites = Sites::new();
        let big: Vec<u8> = (0..20u32 << 20)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();
        open_file_bytes(&sites.dir.path().join("root-b/big.bin"), &big);
        let config = sites.config("");
        let rm = Ringmux::start(2, Forward::Shm, &["--config", &config.to_string_lossy()]);
        let got = curl_ok(&rm, Reach::Name("a.test"), Some(&sites.cert(&A)), &[], "/").await;
        assert_eq!(got.subject, subject_of(&A));

        // Downloads from b.test: curl at 4 MiB/s (5 s each), aioquic at its own pace.
        let downloads: Vec<_> = TCP_VERSIONS
            .iter()
            .map(|(flag, _)| {
                let out = rm.dir().join(format!("big-{}", &flag[2..]));
                let port = rm.listen.port();
                let args: Vec<String> = [
                    "-sS",
                    "--max-time",
                    "60",
                    "--limit-rate",
                    "4M",
                    *flag,
                    "--resolve",
                ]
                .map(String::from)
                .into_iter()
                .chain([
                    format!("b.test:{port}:127.0.0.1"),
                    "--cacert".into(),
                    sites.cert(&B).to_string_lossy().into_owned(),
                    "-o".into(),
                    out.to_string_lossy().into_owned(),
                    format!("https://b.test:{port}/big.bin"),
                ])
                .collect();
                let dir = rm.dir().to_owned();
                (
                    out,
                    tokio::spawn(
                        async move { tool::run("curl", &args, &dir, CLIENT_TIMEOUT).await },
                    ),
                )
            })
            .collect();
        let h3 = {
            let args = vec![
                ringmux_testkit::aioquic::script()
                    .to_string_lossy()
                    .into_owned(),
                "127.0.0.1".into(),
                rm.listen.port().to_string(),
                "paths".into(),
                "--server-name".into(),
                "b.test".into(),
                "--path".into(),
                "/big.bin".into(),
            ];
            let dir = rm.dir().to_owned();
            tokio::spawn(async move { tool::run("python3", &args, &dir, CLIENT_TIMEOUT).await })
        };
        // The reload once both TCP downloads are under way (bounded wait on their files).
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while downloads
            .iter()
            .any(|(out, _)| std::fs::metadata(out).map_or(0, |m| m.len()) < 1 << 20)
        {
            assert!(
                std::time::Instant::now() < deadline,
                "the downloads did not start"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        const A2: SiteSpec = SiteSpec {
            common_name: "ringmux test site a renewed",
            ..A
        };
        certificate(sites.dir.path(), A2.stem, A2.common_name, A2.names, false);
        let (ok, answer) = rm.reload(Duration::from_secs(30)).await;
        assert!(ok, "{answer}");
        for (flag, _) in TCP_VERSIONS {
            let got = curl_ok(
                &rm,
                Reach::Name("a.test"),
                Some(&sites.cert(&A2)),
                &[flag],
                "/",
            )
            .await;
            assert_eq!(
                (got.status, got.subject.as_str()),
                (200, subject_of(&A2).as_str()),
                "{flag}"
            );
        }
        let (_, subject) = aioquic_ok(&rm, "a.test", &["/"]).await;
        assert!(
            subject.contains("renewed"),
            "HTTP/3 after the reload: {subject}"
        );
        for (out, task) in downloads {
            let result = task.await.unwrap();
            assert!(result.success, "{}: {}", out.display(), result.stderr);
            let body = std::fs::read(&out).unwrap();
            assert!(
                body.len() == big.len() && body == big,
                "{}: {} bytes, not byte-exact",
                out.display(),
                body.len()
            );
        }
        let out = h3.await.unwrap();
        let j = ringmux_testkit::aioquic::result(&out.stdout).expect("aioquic's result");
        assert_eq!(
            j["bodies"][0].as_str(),
            Some(format!("/big.bin 200 {} {:016x}", big.len(), fnv1a(&big)).as_str()),
            "HTTP/3 download across the reload: {j}"
        );

        // A broken file: refused with its reason; the running configuration serves on.
        let text = std::fs::read_to_string(&config).unwrap();
        std::fs::write(&config, format!("tcp_max_conections = 5\n{text}")).unwrap();
        let (ok, answer) = rm.reload(Duration::from_secs(30)).await;
        assert!(!ok, "a broken file reloaded: {answer}");
        assert!(
            answer.contains("unknown setting `tcp_max_conections`") && answer.contains(":1:1"),
            "{answer}"
        );
        let got = curl_ok(&rm, Reach::Name("a.test"), Some(&sites.cert(&A2)), &[], "/").await;
        assert_eq!((got.status, got.body.as_str()), (200, A.index));
        // And a change only a restart applies (the harness gives --instances on the command
        // line, which wins over the file: another setting).
        std::fs::write(&config, format!("retry_above = 7\n{text}")).unwrap();
        let (ok, answer) = rm.reload(Duration::from_secs(30)).await;
        assert!(
            !ok && answer.contains("retry_above (--retry-above) changed"),
            "{answer}"
        );
    })
    .await
}

fn open_file_bytes(path: &Path, bytes: &[u8]) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(path, bytes).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o644)).unwrap();
}

/// `redirect_names`: www.a.test, under a.test's certificate, answers every request with a 301
/// to a.test, the path, the query and the port kept, over HTTP/1.1, HTTP/2 and HTTP/3; a.test
/// itself is served as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redirect_names_send_clients_to_the_first_name() {
    if !tool::CURL.present() || !tool::AIOQUIC.present() {
        return;
    }
    bounded(LIMIT, async {
        let sites = Sites::new();
        let rm = sites.start_edited("", |text| {
            text.replacen(
                "names = [\"a.test\", \"www.a.test\"]",
                "names = [\"a.test\"]\nredirect_names = [\"www.a.test\"]",
                1,
            )
        });
        let port = rm.listen.port();
        let location = format!("https://a.test:{port}/x/y?q=1&r=2");
        for (flag, version) in TCP_VERSIONS {
            let got = curl_ok(
                &rm,
                Reach::Name("www.a.test"),
                Some(&sites.cert(&A)),
                &[flag],
                "/x/y?q=1&r=2",
            )
            .await;
            assert_eq!(
                (got.status, got.version.as_str()),
                (301, version),
                "{flag}: {got:?}"
            );
            assert_eq!(got.header("location"), Some(location.as_str()), "{flag}");
            assert_eq!(got.subject, subject_of(&A), "{flag}: a.test's certificate");
            let home = curl_ok(
                &rm,
                Reach::Name("a.test"),
                Some(&sites.cert(&A)),
                &[flag],
                "/",
            )
            .await;
            assert_eq!((home.status, home.body.as_str()), (200, A.index), "{flag}");
        }
        let with_port = format!("https://www.a.test:{port}/x/y?q=1&r=2");
        let (got, subject) =
            aioquic_ok(&rm, "www.a.test", &[&with_port, "https://www.a.test/z"]).await;
        assert_eq!(
            subject.replace(' ', ""),
            subject_of(&A),
            "h3: a.test's certificate"
        );
        assert_eq!(got[0].status, 301, "h3: {got:?}");
        assert_eq!(got[0].headers["location"], location.as_str(), "h3");
        assert_eq!(got[1].status, 301, "h3: {got:?}");
        assert_eq!(
            got[1].headers["location"], "https://a.test/z",
            "h3, no port named"
        );
        let (got, _) = aioquic_ok(&rm, "a.test", &["/"]).await;
        assert_eq!(
            (got[0].status, got[0].body.as_str()),
            (200, A.index),
            "h3 a.test"
        );
    })
    .await
}

/// Header rules, HSTS, CORS, fallbacks and error pages.
mod rules;
/// `allow` and `deny` answer 403 on HTTP/1.1, HTTP/2 and HTTP/3 to the client address each
/// transport sees (127.0.0.1 here): a route's list replaces its site's, and a site's list
/// holds for its routes without one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allow_and_deny_answer_403_on_every_protocol() {
    if !tool::CURL.present() || !tool::AIOQUIC.present() {
        return;
    }
    bounded(LIMIT, async {
        let sites = Sites::new();
        let rm = sites.start_edited("", |text| {
            let text = text.replacen(
                "path = \"/hi\"\n",
                "path = \"/hi\"\ndeny = [\"127.0.0.0/8\"]\n",
                1,
            );
            // b.test: only blocks the client is not in, on the site.
            let allow = "b.key\"\nallow = [\"10.0.0.0/8\", \"2001:db8::/32\"]\n";
            text.replacen("b.key\"\n", allow, 1)
        });
        let (a, b) = (sites.cert(&A), sites.cert(&B));
        for (flag, _) in TCP_VERSIONS {
            let a_name = Reach::Name("a.test");
            let hi = curl_ok(&rm, a_name, Some(&a), &[flag], "/hi").await;
            assert_eq!(hi.status, 403, "{flag}: a.test/hi {hi:?}");
            let root = curl_ok(&rm, a_name, Some(&a), &[flag], "/").await;
            assert_eq!(root.status, 200, "{flag}: a.test/ {root:?}");
            let b_root = curl_ok(&rm, Reach::Name("b.test"), Some(&b), &[flag], "/").await;
            assert_eq!(b_root.status, 403, "{flag}: b.test/ {b_root:?}");
        }
        let (got, _) = aioquic_ok(&rm, "a.test", &["/hi", "/"]).await;
        assert_eq!(
            (got[0].status, got[1].status),
            (403, 200),
            "h3 a.test: {got:?}"
        );
        let (got, _) = aioquic_ok(&rm, "b.test", &["/"]).await;
        assert_eq!(got[0].status, 403, "h3 b.test: {got:?}");
        let refused = "ringmux_worker_requests_refused_total";
        rm.wait_for("six refusals counted", LIMIT, |m| {
            m.sum_where(refused, "reason", "denied") >= 6.0
        })
        .await;
    })
    .await
}

/// A rate holds for the box, not per worker: one client (127.0.0.1) over four HTTP/3
/// connections pinned to the four workers gets exactly the burst admitted over them all
/// (each worker served its share, the metrics show), the rest 429 with `retry-after`; a
/// second client (127.0.0.2) is not affected. `1/m` with a burst of 20: the window is 20
/// minutes, so no window turns during the test and the count is exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rate_holds_across_four_workers() {
    use ringmux_testkit::client::{client_config, H3Client};
    bounded(LIMIT, async {
        let sites = Sites::new();
        let config = sites.config("");
        let text = std::fs::read_to_string(&config).unwrap().replacen(
            "path = \"/hi\"\n",
            "path = \"/hi\"\nrate = \"1/m\"\nburst = 20\n",
            1,
        );
        std::fs::write(&config, text).unwrap();
        let rm = Ringmux::start(4, Forward::Shm, &["--config", &config.to_string_lossy()]);
        let client = |from: &str, instance: u8| {
            let socket = std::net::UdpSocket::bind((from, 0)).expect("binding a client");
            let mut c = H3Client::with_socket(client_config(None).unwrap(), socket).unwrap();
            let dcid = rm.dcid_for(instance, 20);
            c.set_initial_dst_cid_provider(std::sync::Arc::new(move || {
                quinn::ConnectionId::new(&dcid)
            }));
            c
        };
        let clients: Vec<H3Client> = (0..4).map(|i| client("127.0.0.1", i)).collect();
        let mut conns = Vec::new();
        for c in &clients {
            conns.push(c.connect(rm.listen, "a.test").await.expect("connecting"));
        }
        let (mut admitted, mut limited) = (0, 0);
        for i in 0..80 {
            let r = conns[i % 4].get("/hi").await.expect("GET /hi");
            match r.status.as_u16() {
                200 => admitted += 1,
                429 => {
                    let retry = r.headers.get("retry-after").and_then(|v| v.to_str().ok());
                    assert!(retry.is_some_and(|v| v.parse::<u64>().is_ok()), "{r:?}");
                    limited += 1;
                }
                other => panic!("GET /hi: {other}"),
            }
        }
        assert_eq!((admitted, limited), (20, 60), "one burst over four workers");
        let other = client("127.0.0.2", 1);
        let conn = other
            .connect(rm.listen, "a.test")
            .await
            .expect("connecting");
        for _ in 0..5 {
            let r = conn.get("/hi").await.expect("GET /hi from 127.0.0.2");
            assert_eq!(r.status, 200, "a second client is not limited");
        }
        let m = rm
            .wait_for("every refusal counted", LIMIT, |m| {
                m.sum_where("ringmux_worker_requests_refused_total", "reason", "rate") >= 60.0
            })
            .await;
        for i in 0..4 {
            let served = m.sum_where("ringmux_worker_requests_total", "instance", &i.to_string());
            assert!(served >= 20.0, "instance {i} served {served} requests: {m}");
        }
    })
    .await
}
