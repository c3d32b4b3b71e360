//! What a site does around its content (`docs/operators/headers-and-errors.md`), end to end on
//! a real ringmux, asked by curl over HTTP/1.1 and HTTP/2 and by aioquic over HTTP/3: header
//! rules of the site and of a route, HSTS (and none on the plain-HTTP listener), a CORS
//! preflight and a credentialed request, a rule on the request a backend gets, a single-page
//! app's fallback, and error pages for ringmux's own 404 and the proxy's 502. Then `ringmux
//! check` refusing each kind of bad rule by its key.

use super::*;

/// The body of the app's `index.html`.
const INDEX: &str = "<div id=app></div>\n";
const PAGE_404: &str = "<h1>not here</h1>\n";
const PAGE_502: &str = "<h1>backend down</h1>\n";
const APP: &str = "https://app.example";

/// a.test with every rule, its files and error pages in `dir`; `upstream` behind `/api`, and
/// `/down` proxied to a port nothing listens on.
fn rules_config(dir: &Path, upstream: &str) -> PathBuf {
    let d = dir.display();
    certificate(dir, "a", A.common_name, A.names, false);
    open_folder(&dir.join("root/app"));
    open_file(&dir.join("root/app/index.html"), INDEX);
    open_file(&dir.join("404.html"), PAGE_404);
    open_file(&dir.join("502.html"), PAGE_502);
    let down = harness::unused_tcp_port();
    let text = format!(
        r#"
[[site]]
names = ["a.test", "www.a.test"]
cert = "{d}/a.pem"
key = "{d}/a.key"
hsts = {{ max_age = 31536000, include_subdomains = true }}
  [site.headers]
  set = {{ "x-frame-options" = "DENY" }}
  remove = ["last-modified", "etag"]
  [site.cors]
  origins = ["{APP}"]
  methods = ["GET", "PUT"]
  headers = ["content-type"]
  credentials = true
  max_age = 600
  [site.errors]
  404 = "{d}/404.html"
  502 = "{d}/502.html"
  [[site.route]]
  path = "/app"
  root = "{d}/root"
  fallback = "/app/index.html"
  headers = {{ set = {{ "content-security-policy" = "default-src 'self'" }} }}
  [[site.route]]
  path = "/api"
  upstream = "{upstream}"
  strip_prefix = true
  request_headers = {{ set = {{ "x-from" = "ringmux" }}, remove = ["cookie"] }}
  [[site.route]]
  path = "/down"
  upstream = "http://{down}"
"#
    );
    let path = dir.join("rules.toml");
    std::fs::write(&path, text).unwrap();
    path
}

/// Over HTTP/1.1, HTTP/2 and HTTP/3: the site's and the route's rules, HSTS, the fallback, the
/// error pages and the backend's request; CORS over TCP; no HSTS on plain HTTP.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn header_rules_hsts_fallback_and_error_pages_on_every_protocol() {
    if !tool::CURL.present() || !tool::AIOQUIC.present() {
        return;
    }
    bounded(LIMIT, async {
        let dir = temp_dir("ringmux-rules");
        let upstream = PyUpstream::start();
        let config = rules_config(dir.path(), &upstream.url());
        let plain = harness::unused_tcp_port();
        let rm = Ringmux::start(
            1,
            Forward::Shm,
            &[
                "--config",
                &config.to_string_lossy(),
                "--redirect-http",
                &plain.to_string(),
            ],
        );
        let cert = dir.path().join("a.pem");
        let a = Reach::Name("a.test");
        let hsts = "max-age=31536000; includeSubDomains";
        for (flag, _) in TCP_VERSIONS {
            let app = curl_ok(&rm, a, Some(&cert), &[flag], "/app/settings").await;
            assert_eq!(
                (app.status, app.body.as_str()),
                (200, INDEX),
                "{flag}: {app:?}"
            );
            assert_eq!(app.header("x-frame-options"), Some("DENY"), "{flag}");
            let csp = app.header("content-security-policy");
            assert_eq!(csp, Some("default-src 'self'"), "{flag}");
            assert_eq!(
                app.header("strict-transport-security"),
                Some(hsts),
                "{flag}"
            );
            assert_eq!(app.header("last-modified"), None, "{flag}: removed");
            assert_eq!(app.header("etag"), None, "{flag}: removed");
            let js = curl_ok(&rm, a, Some(&cert), &[flag], "/app/x.js").await;
            assert_eq!(
                (js.status, js.body.as_str()),
                (404, PAGE_404),
                "{flag}: {js:?}"
            );
            assert_eq!(js.header("cache-control"), Some("no-store"), "{flag}");
            assert_eq!(
                js.header("content-type"),
                Some("text/html; charset=utf-8"),
                "{flag}"
            );
            let down = curl_ok(&rm, a, Some(&cert), &[flag], "/down/x").await;
            assert_eq!((down.status, down.body.as_str()), (502, PAGE_502), "{flag}");
            assert_eq!(down.header("cache-control"), Some("no-store"), "{flag}");
            assert_eq!(down.header("strict-transport-security"), Some(hsts));
            let args = [flag, "-H", "cookie: secret=1", "-H", "x-mine: 1"];
            let api = curl_ok(&rm, a, Some(&cert), &args, "/api/headers").await;
            let asked: Vec<&str> = api.body.lines().collect();
            assert!(asked.contains(&"x-from: ringmux"), "{flag}: {asked:?}");
            assert!(asked.contains(&"x-mine: 1"), "{flag}: {asked:?}");
            assert!(
                !asked.iter().any(|l| l.starts_with("cookie")),
                "{flag}: {asked:?}"
            );
            assert_eq!(
                api.header("x-frame-options"),
                Some("DENY"),
                "{flag}: proxied"
            );
            assert_eq!(
                api.header("content-security-policy"),
                None,
                "{flag}: /app's"
            );
        }
        let (got, _) = aioquic_ok(&rm, "a.test", &["/app/settings", "/app/x.js", "/down/x"]).await;
        let h = |i: usize, name: &str| got[i].headers[name].as_str().map(str::to_owned);
        assert_eq!(
            (got[0].status, got[0].body.as_str()),
            (200, INDEX),
            "h3: {got:?}"
        );
        assert_eq!(h(0, "x-frame-options").as_deref(), Some("DENY"), "h3");
        assert_eq!(
            h(0, "content-security-policy").as_deref(),
            Some("default-src 'self'"),
            "h3"
        );
        assert_eq!(
            h(0, "strict-transport-security").as_deref(),
            Some(hsts),
            "h3"
        );
        assert_eq!(h(0, "last-modified"), None, "h3: removed");
        assert_eq!((got[1].status, got[1].body.as_str()), (404, PAGE_404), "h3");
        assert_eq!(h(1, "cache-control").as_deref(), Some("no-store"), "h3");
        assert_eq!((got[2].status, got[2].body.as_str()), (502, PAGE_502), "h3");
        assert_eq!(h(2, "cache-control").as_deref(), Some("no-store"), "h3");

        // The plain-HTTP listener redirects, without HSTS (RFC 6797 §7.2).
        let out = tokio::process::Command::new("curl")
            .args(["-sS", "-D", "-", "-o", "/dev/null", "-H", "host: a.test"])
            .arg(format!("http://{plain}/app/settings"))
            .output()
            .await
            .expect("curl");
        let head = String::from_utf8_lossy(&out.stdout).to_ascii_lowercase();
        assert!(head.starts_with("http/1.1 301"), "{head}");
        assert!(!head.contains("strict-transport-security"), "{head}");
    })
    .await
}

/// A CORS preflight from the allowed origin gets 204 and the allow fields; one from another
/// origin none; a credentialed GET from the allowed origin its origin, `vary` and credentials.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cors_answers_preflights_and_credentialed_requests() {
    if !tool::CURL.present() {
        return;
    }
    bounded(LIMIT, async {
        let dir = temp_dir("ringmux-cors");
        let upstream = PyUpstream::start();
        let config = rules_config(dir.path(), &upstream.url());
        let rm = Ringmux::start(1, Forward::Shm, &["--config", &config.to_string_lossy()]);
        let cert = dir.path().join("a.pem");
        let a = Reach::Name("a.test");
        for (flag, _) in TCP_VERSIONS {
            let origin = format!("origin: {APP}");
            let pre = [
                flag,
                "-X",
                "OPTIONS",
                "-H",
                &origin,
                "-H",
                "access-control-request-method: PUT",
            ];
            let got = curl_ok(&rm, a, Some(&cert), &pre, "/api/headers").await;
            assert_eq!(got.status, 204, "{flag}: {got:?}");
            assert_eq!(got.header("access-control-allow-origin"), Some(APP));
            assert_eq!(got.header("access-control-allow-methods"), Some("GET, PUT"));
            assert_eq!(
                got.header("access-control-allow-headers"),
                Some("content-type")
            );
            assert_eq!(got.header("access-control-max-age"), Some("600"));
            assert_eq!(got.header("access-control-allow-credentials"), Some("true"));
            let evil = [
                flag,
                "-X",
                "OPTIONS",
                "-H",
                "origin: https://evil.example",
                "-H",
                "access-control-request-method: PUT",
            ];
            let got = curl_ok(&rm, a, Some(&cert), &evil, "/app/").await;
            assert_ne!(got.status, 204, "{flag}: {got:?}");
            assert_eq!(got.header("access-control-allow-origin"), None, "{flag}");
            let with = [flag, "-H", &origin, "-H", "cookie: session=1"];
            let got = curl_ok(&rm, a, Some(&cert), &with, "/app/settings").await;
            assert_eq!(got.status, 200, "{flag}: {got:?}");
            assert_eq!(got.header("access-control-allow-origin"), Some(APP));
            assert_eq!(got.header("access-control-allow-credentials"), Some("true"));
            assert_eq!(got.header("vary"), Some("origin"), "{flag}: {got:?}");
        }
    })
    .await
}

/// The same CORS over HTTP/3 (the project's quinn client, which sends any method and field):
/// a preflight from the allowed origin gets 204 and the allow fields, one from another origin
/// none, and a credentialed GET from the allowed origin its origin, `vary` and credentials.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cors_answers_preflights_and_credentialed_requests_over_http3() {
    bounded(LIMIT, async {
        let dir = temp_dir("ringmux-cors-h3");
        let upstream = PyUpstream::start();
        let config = rules_config(dir.path(), &upstream.url());
        let rm = Ringmux::start(1, Forward::Shm, &["--config", &config.to_string_lossy()]);
        let conn = rm
            .client()
            .connect(rm.listen, "a.test")
            .await
            .expect("connecting over HTTP/3");
        let preflight =
            |origin: &'static str| [("origin", origin), ("access-control-request-method", "PUT")];
        let (status, h) = h3_ask(&conn, "OPTIONS", "/api/headers", &preflight(APP)).await;
        assert_eq!(status, 204, "{h:?}");
        let field = |h: &http::HeaderMap, name: &str| {
            h.get(name).and_then(|v| v.to_str().ok()).map(str::to_owned)
        };
        assert_eq!(
            field(&h, "access-control-allow-origin").as_deref(),
            Some(APP)
        );
        assert_eq!(
            field(&h, "access-control-allow-methods").as_deref(),
            Some("GET, PUT")
        );
        assert_eq!(
            field(&h, "access-control-allow-headers").as_deref(),
            Some("content-type")
        );
        assert_eq!(field(&h, "access-control-max-age").as_deref(), Some("600"));
        assert_eq!(
            field(&h, "access-control-allow-credentials").as_deref(),
            Some("true")
        );
        let evil = preflight("https://evil.example");
        let (status, h) = h3_ask(&conn, "OPTIONS", "/app/", &evil).await;
        assert_ne!(status, 204, "{h:?}");
        assert_eq!(field(&h, "access-control-allow-origin"), None, "{h:?}");
        let with = [("origin", APP), ("cookie", "session=1")];
        let (status, h) = h3_ask(&conn, "GET", "/app/settings", &with).await;
        assert_eq!(status, 200, "{h:?}");
        assert_eq!(
            field(&h, "access-control-allow-origin").as_deref(),
            Some(APP)
        );
        assert_eq!(
            field(&h, "access-control-allow-credentials").as_deref(),
            Some("true")
        );
        assert_eq!(field(&h, "vary").as_deref(), Some("origin"), "{h:?}");
    })
    .await
}

/// `method path` with `fields` on `conn` over HTTP/3: the status and the response's fields,
/// its body read to the end.
async fn h3_ask(
    conn: &ringmux_testkit::client::H3Conn,
    method: &str,
    path: &str,
    fields: &[(&str, &str)],
) -> (u16, http::HeaderMap) {
    let mut req = http::Request::builder().method(method).uri(path);
    for (name, value) in fields {
        req = req.header(*name, *value);
    }
    let mut stream = conn
        .open(req.body(()).unwrap())
        .await
        .expect("a request stream");
    // A server that answered already may have stopped our side (STOP_SENDING): the response
    // is still read below, and any real failure shows there.
    let _ = stream.finish().await;
    let head = stream.recv_response().await.expect("a response head");
    while stream.recv_data().await.expect("the body").is_some() {}
    (head.status().as_u16(), head.headers().clone())
}

/// `ringmux check` refuses a forbidden header, a bad HSTS, `*` with credentials, a fallback
/// outside the root and an unreadable error page, each by its key.
#[test]
fn check_refuses_bad_rules_by_their_key() {
    let parts = Parts::new();
    std::fs::write(parts.dir.path().join("root/index.html"), "x").unwrap();
    let cases = [
        (
            "[site.headers]\nset = { \"alt-svc\" = \"h3=\\\":1\\\"\" }",
            "site.headers: alt-svc: ringmux owns this field",
        ),
        (
            "[site.headers]\nremove = [\"Connection\"]",
            "site.headers: connection: ringmux owns this field",
        ),
        ("hsts = \"1y\"", "site.hsts"),
        (
            "hsts = { max_age = 60, include_subdomains = true, preload = true }",
            "site.hsts: preload = true needs",
        ),
        (
            "[site.cors]\norigins = [\"*\"]\ncredentials = true",
            "site.cors: origins = [\"*\"] with credentials = true",
        ),
        (
            "[site.errors]\n404 = \"{D}/missing.html\"",
            "site.errors.404 = ",
        ),
        (
            "[site.errors]\n404 = \"{D}/fifo\"",
            "the error page cannot be read",
        ),
        (
            "[site.errors]\n418 = \"{D}/a.pem\"",
            "site.errors.418: status 418",
        ),
    ];
    // Site-level keys go between the site's own and its route.
    let (head, route) = SITE.split_at(SITE.find("[[site.route]]").unwrap());
    for (i, (rule, says)) in cases.iter().enumerate() {
        let file = parts.file(&format!("rule-{i}"), &format!("{head}{rule}\n{route}"));
        let out = check(&file, &[]);
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{rule}: {err}");
        assert!(err.contains(says), "{rule}: expected {says:?} in {err}");
    }
    for (route, says) in [
        ("fallback = \"/../a.pem\"", "fallback = \"/../a.pem\": "),
        (
            "fallback = \"/nothere.html\"",
            "fallback = \"/nothere.html\": ",
        ),
        (
            "fallback = \"/index.html\"\nrequest_headers = { set = { \"x\" = \"y\" } }",
            "request_headers goes with upstream only",
        ),
    ] {
        let file = parts.file("fallback", &format!("{SITE}{route}\n"));
        let out = check(&file, &[]);
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{route}: {err}");
        assert!(err.contains(says), "{route}: expected {says:?} in {err}");
    }
    let good = parts.file("good", &format!("{SITE}fallback = \"/index.html\"\n"));
    let out = check(&good, &[]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
}

/// A user agent a log must not let forge a line or a field.
const HOSTILE_UA: &str = "ua \"quoted\" back\\slash \\\" tab\tend";

/// ringmux with the rules' site, its access log in `format`; `n` requests over HTTP/1.1 and
/// HTTP/2 with [`HOSTILE_UA`] and a quoted referer; every line written. (A newline cannot reach
/// the server inside a field: the unit tests of `access_log::formats` escape one.)
async fn logged(format: &str, n: usize) -> (TempDir, PathBuf, String) {
    let dir = temp_dir("ringmux-log-format");
    let upstream = PyUpstream::start();
    let config = rules_config(dir.path(), &upstream.url());
    let log = dir.path().join("access.log");
    let rm = Ringmux::start(
        1,
        Forward::Shm,
        &[
            "--config",
            &config.to_string_lossy(),
            "--access-log",
            &log.to_string_lossy(),
            "--access-log-format",
            format,
        ],
    );
    let cert = dir.path().join("a.pem");
    let ua = format!("user-agent: {HOSTILE_UA}");
    for i in 0..n {
        let flag = TCP_VERSIONS[i % 2].0;
        let args = [flag, "-H", &ua, "-H", "referer: https://r.example/\"x\""];
        let got = curl_ok(&rm, Reach::Name("a.test"), Some(&cert), &args, "/app/x?q=1").await;
        assert_eq!(got.status, 200, "{got:?}");
    }
    let m = rm
        .wait_for("every line written", LIMIT, |m| {
            m.sum(names::WORKER_ACCESS_LOG_LINES) >= n as f64
        })
        .await;
    assert_eq!(m.sum(names::WORKER_ACCESS_LOG_DROPPED), 0.0, "{m}");
    drop(rm);
    let text = std::fs::read_to_string(&log).unwrap();
    drop(upstream);
    (dir, log, text)
}

/// `combined` lines read by GoAccess as `COMBINED`: every request counted, the hostile user
/// agent kept in its field.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn combined_lines_are_read_by_goaccess() {
    if !tool::CURL.present() || which("goaccess").is_none() {
        return;
    }
    bounded(LIMIT, async {
        let n = 6;
        let (dir, log, text) = logged("combined", n).await;
        assert_eq!(text.lines().count(), n, "{text}");
        let report = dir.path().join("report.json");
        let out = Command::new("goaccess")
            .arg(&log)
            .args(["--log-format=COMBINED", "--no-global-config", "-o"])
            .arg(&report)
            .output()
            .expect("goaccess");
        assert!(out.status.success(), "{}", text_of(&out.stderr));
        let json: Json = serde_json::from_slice(&std::fs::read(&report).unwrap()).unwrap();
        let general = &json["general"];
        assert_eq!(general["total_requests"], Json::from(n), "{general}");
        assert_eq!(general["failed_requests"], Json::from(0), "{general}");
        assert_eq!(general["valid_requests"], Json::from(n), "{general}");
    })
    .await
}

/// `json` lines, each read by Python's `json` as one object with the fields named, the
/// hostile user agent and referer whole in their fields.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_lines_are_read_by_python() {
    if !tool::CURL.present() {
        return;
    }
    bounded(LIMIT, async {
        let n = 4;
        let (dir, log, text) = logged("json", n).await;
        assert_eq!(text.lines().count(), n, "{text}");
        let script = dir.path().join("read.py");
        std::fs::write(
            &script,
            "import json, sys\n\
             for line in open(sys.argv[1]):\n\
             \x20   o = json.loads(line)\n\
             \x20   print(json.dumps([o['method'], o['path'], o['query'], o['status'], \
             o['route'], o['sni'], o['user_agent'], o['referer'], o['ending'], o['site'], \
             o['protocol']]))\n",
        )
        .unwrap();
        let out = Command::new("python3")
            .arg(&script)
            .arg(&log)
            .output()
            .expect("python3");
        assert!(out.status.success(), "{}\n{text}", text_of(&out.stderr));
        for (i, line) in text_of(&out.stdout).lines().enumerate() {
            let got: Json = serde_json::from_str(line).unwrap();
            let protocol = if i % 2 == 0 { "h1" } else { "h2" };
            let want = serde_json::json!([
                "GET",
                "/app/x",
                "q=1",
                200,
                "/app",
                "a.test",
                HOSTILE_UA,
                "https://r.example/\"x\"",
                "ok",
                "a.test",
                protocol
            ]);
            assert_eq!(got, want, "line {i}");
        }
    })
    .await
}

fn which(program: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join(program))
            .find(|p| p.is_file())
    })
}

fn text_of(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}
