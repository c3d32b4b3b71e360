//! HTTPS over TCP beside HTTP/3 on the same port (`--tcp`, on by default): Debian's curl over
//! HTTP/1.1 and HTTP/2 gets the same site as the quinn client over HTTP/3, every TCP response
//! says where HTTP/3 is (`alt-svc`), bad input is closed while both transports serve, and a
//! download in flight survives a reload.

use ringmux_systests::harness;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};

use std::time::{Duration, Instant};

use harness::{bounded, check_bytes, expected_bytes, Forward, Ringmux};
use http_body_util::{BodyExt, Empty};
use ringmux_demux::metrics::names;
use ringmux_testkit::client::Fnv64;
use ringmux_testkit::tcp_client::{tls_connect, TcpConn, Version};
use ringmux_testkit::{temp_dir, tool};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// What one curl run got: status, header fields (names lower-case), body.
struct Got {
    status: u16,
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
}

/// Whether curl can run here; `false` means skip (only allowed outside CI).
fn have_curl() -> bool {
    tool::CURL.present()
}

/// The TCP address of `rm`: the UDP socket's, by default.
fn tcp_addr(rm: &Ringmux) -> SocketAddr {
    SocketAddr::new(rm.listen.ip(), rm.listen.port())
}

/// curl `path` on `rm` over TCP with `args` (`--http1.1`, `--http2`, `-X POST`, …).
async fn curl(rm: &Ringmux, args: &[&str], path: &str) -> Got {
    let dir = rm.dir();
    let head = dir.join(format!("head-{}", harness::random_u64()));
    let body = dir.join(format!("body-{}", harness::random_u64()));
    let url = format!("https://{}{path}", tcp_addr(rm));
    let out = tokio::process::Command::new("curl")
        .args(["-sS", "-k", "--max-time", "30", "-D"])
        .arg(&head)
        .arg("-o")
        .arg(&body)
        .args(args)
        .arg(&url)
        .output()
        .await
        .expect("running curl");
    assert!(
        out.status.success(),
        "curl {args:?} {url}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    parse(&head, &body)
}

fn parse(head: &Path, body: &Path) -> Got {
    let text = std::fs::read_to_string(head).expect("curl's header dump");
    // The last response block (curl writes one per response, 1xx included).
    let block = text
        .split("\r\n\r\n")
        .filter(|b| !b.trim().is_empty())
        .last()
        .unwrap_or("");
    let mut lines = block.lines();
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    Got {
        status,
        headers,
        body: std::fs::read(body).unwrap_or_default(),
    }
}

/// (length, FNV-1a) of `body`, as [`expected_bytes`] gives it for `/bytes/N`.
fn fnv(body: &[u8]) -> (u64, u64) {
    let mut sum = Fnv64::new();
    sum.update(body);
    (body.len() as u64, sum.finish())
}

/// Over HTTP/1.1 and HTTP/2: the built-ins with `alt-svc` naming the UDP port, HEAD with the
/// length and no body, a POST's body counted, 405 for other methods; the same bodies as the
/// quinn client gets over HTTP/3 from the same port.
#[tokio::test]
async fn curl_gets_the_same_site_over_http1_and_http2_with_alt_svc() {
    if !have_curl() {
        return;
    }
    bounded(Duration::from_secs(60), async {
        let rm = Ringmux::start(2, Forward::Shm, &[]);
        let alt_svc = format!("h3=\":{}\"; ma=86400", rm.listen.port());
        for (version, proto) in [("--http1.1", "HTTP/1.1"), ("--http2", "HTTP/2")] {
            let hello = curl(&rm, &[version, "-w", "%{http_version}"], "/hello.txt").await;
            assert_eq!(hello.status, 200, "{proto}");
            assert_eq!(hello.body, ringmux_server::reply::HELLO_BODY, "{proto}");
            assert_eq!(hello.header("alt-svc"), Some(alt_svc.as_str()), "{proto}");
            let big = curl(&rm, &[version], "/bytes/1000000").await;
            assert_eq!(fnv(&big.body), expected_bytes(1_000_000), "{proto}");
            let head = curl(&rm, &[version, "-I"], "/bytes/5000").await;
            assert_eq!(head.status, 200, "{proto}");
            assert_eq!(head.header("content-length"), Some("5000"), "{proto}");
            let sized = tokio::process::Command::new("curl")
                .args([
                    "-sk",
                    "-I",
                    version,
                    "-o",
                    "/dev/null",
                    "-w",
                    "%{size_download}",
                ])
                .arg(format!("https://{}/bytes/5000", tcp_addr(&rm)))
                .output()
                .await
                .unwrap();
            assert_eq!(
                String::from_utf8_lossy(&sized.stdout),
                "0",
                "{proto}: HEAD has no body"
            );
            let posted = curl(
                &rm,
                &[version, "-X", "POST", "--data-binary", "@/etc/hostname"],
                "/echo-len",
            )
            .await;
            let len = std::fs::metadata("/etc/hostname").map(|m| m.len()).unwrap();
            assert_eq!(posted.body, format!("{len}\n").as_bytes(), "{proto}");
            let put = curl(&rm, &[version, "-X", "PUT"], "/hello.txt").await;
            assert_eq!(put.status, 405, "{proto}");
            assert!(put.header("allow").is_some(), "{proto}");
            let missing = curl(&rm, &[version], "/nowhere").await;
            assert_eq!(missing.status, 404, "{proto}");
        }
        // curl says which protocol it spoke: ALPN chose it.
        let out = tokio::process::Command::new("curl")
            .args(["-sk", "--http2", "-o", "/dev/null", "-w", "%{http_version}"])
            .arg(format!("https://{}/hello.txt", tcp_addr(&rm)))
            .output()
            .await
            .unwrap();
        assert_eq!(String::from_utf8_lossy(&out.stdout), "2");
        // HTTP/3 from the same port, the same body.
        let conn = rm.connect(&rm.client()).await;
        check_bytes(
            "HTTP/3",
            &conn.get("/bytes/1000000").await.unwrap(),
            1_000_000,
        );
        // Counted by protocol: 7 curl runs over each TCP protocol (the HEAD check's included,
        // and the version check's over HTTP/2), one request over HTTP/3.
        let m = rm
            .wait_for("requests by protocol", Duration::from_secs(10), |m| {
                let by = |p: &str| m.sum_where("ringmux_worker_requests_total", "protocol", p);
                by("h1") >= 7.0 && by("h2") >= 8.0 && by("h3") >= 1.0
            })
            .await;
        assert_eq!(
            m.sum_where("ringmux_worker_requests_total", "protocol", "unknown"),
            0.0,
            "{m}"
        );
    })
    .await;
}

/// A client nobody here wrote that follows Alt-Svc (PyPI's niquests) asks over TCP first, reads
/// `alt-svc`, and takes the next requests to HTTP/3 on the UDP port, as a browser does.
#[tokio::test]
async fn a_client_follows_alt_svc_from_http2_to_http3() {
    if !tool::NIQUESTS.present() {
        return;
    }
    bounded(Duration::from_secs(60), async {
        let rm = Ringmux::start(2, Forward::Shm, &[]);
        let before = rm.metrics().get("ringmux_datagrams_received_total");
        let script = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../test-tools/python/follow_alt_svc.py"
        );
        let out = tokio::process::Command::new("python3")
            .arg(script)
            .arg(format!("https://{}/hello.txt", tcp_addr(&rm)))
            .output()
            .await
            .expect("python3");
        let text = String::from_utf8_lossy(&out.stdout);
        let lines: Vec<Vec<&str>> = text.lines().map(|l| l.splitn(3, ' ').collect()).collect();
        assert_eq!(
            lines.len(),
            4,
            "{text}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let alt_svc = format!("h3=\":{}\"; ma=86400", rm.listen.port());
        assert_eq!(
            lines[0],
            ["200", "20", alt_svc.as_str()],
            "first over HTTP/2: {text}"
        );
        for l in &lines[1..] {
            assert_eq!(l[..2], ["200", "30"], "then over HTTP/3: {text}");
        }
        let after = rm.metrics().get("ringmux_datagrams_received_total");
        assert!(
            after > before,
            "no datagram reached the demux: {before} -> {after}"
        );
    })
    .await;
}

/// `--root` over TCP: the file, its validators, a conditional request (304), a range (206),
/// and the same `etag` as over HTTP/3.
#[tokio::test]
async fn files_over_tcp_answer_conditional_and_range_requests() {
    if !have_curl() {
        return;
    }
    bounded(Duration::from_secs(60), async {
        let root = temp_dir("ringmux-tcp-root");
        let content: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        std::fs::write(root.path().join("data.bin"), &content).unwrap();
        let root_arg = root.path().to_string_lossy().into_owned();
        let rm = Ringmux::start(2, Forward::Shm, &["--root", &root_arg]);
        let full = curl(&rm, &["--http2"], "/data.bin").await;
        assert_eq!(full.status, 200);
        assert_eq!(full.body, content);
        let etag = full.header("etag").expect("an etag").to_string();
        let cond = format!("if-none-match: {etag}");
        let not_modified = curl(&rm, &["--http1.1", "-H", &cond], "/data.bin").await;
        assert_eq!(not_modified.status, 304);
        let range = curl(&rm, &["--http2", "-H", "range: bytes=10-19"], "/data.bin").await;
        assert_eq!(range.status, 206);
        assert_eq!(range.body, &content[10..20]);
        let conn = rm.connect(&rm.client()).await;
        let h3 = conn.get("/data.bin").await.unwrap();
        assert_eq!(
            h3.headers.get("etag").and_then(|v| v.to_str().ok()),
            Some(etag.as_str()),
            "the same etag over HTTP/3"
        );
    })
    .await;
}

/// `--alt-svc off` sends none; a value of the operator's is sent as given.
#[tokio::test]
async fn alt_svc_can_be_set_or_switched_off() {
    if !have_curl() {
        return;
    }
    bounded(Duration::from_secs(60), async {
        let rm = Ringmux::start(1, Forward::Shm, &["--alt-svc", "off"]);
        let got = curl(&rm, &["--http1.1"], "/hello.txt").await;
        assert_eq!(got.status, 200);
        assert_eq!(got.header("alt-svc"), None);
        drop(rm);
        let value = "h3=\":443\"; ma=60";
        let rm = Ringmux::start(1, Forward::Shm, &["--alt-svc", value]);
        let got = curl(&rm, &["--http2"], "/hello.txt").await;
        assert_eq!(got.header("alt-svc"), Some(value));
    })
    .await;
}

/// Garbage instead of TLS is closed at once, and 400 connections that never start a handshake
/// do not stop a new client over either transport; they are closed when the handshake timeout
/// (10 s) passes, as is a connection that never sends a request head after its handshake
/// (slowloris; closed gracefully, with TLS close_notify). Each is counted by kind.
#[tokio::test]
async fn garbage_and_idle_connections_leave_both_transports_serving() {
    if !have_curl() {
        return;
    }
    bounded(Duration::from_secs(90), async {
        let rm = Ringmux::start(2, Forward::Shm, &[]);
        let mut garbage = TcpStream::connect(tcp_addr(&rm)).unwrap();
        garbage
            .write_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            .unwrap();
        garbage
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let started = Instant::now();
        let mut buf = [0u8; 512];
        // The server answers a TLS alert at most, then closes: end of file, or a reset.
        loop {
            match garbage.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            }
            assert!(started.elapsed() < Duration::from_secs(10), "never closed");
        }
        let idle: Vec<TcpStream> = (0..400)
            .map(|_| TcpStream::connect(tcp_addr(&rm)).expect("an idle connection"))
            .collect();
        let mut silent = tls_connect(tcp_addr(&rm), b"http/1.1")
            .await
            .expect("a TLS connection that then says nothing");
        let got = curl(&rm, &["--http2"], "/hello.txt").await;
        assert_eq!(got.status, 200);
        let conn = rm.connect(&rm.client()).await;
        check_bytes("HTTP/3", &conn.get("/bytes/1000").await.unwrap(), 1000);
        let kind = |m: &harness::Metrics, k: &str| m.sum_where(names::WORKER_TCP_ERRORS, "kind", k);
        let m = rm
            .wait_for("the timeouts counted", Duration::from_secs(40), |m| {
                kind(m, "tls_timeout") >= 400.0 && kind(m, "header_timeout") >= 1.0
            })
            .await;
        assert_eq!(kind(&m, "tls_failed"), 1.0, "the garbage: {m}");
        assert!(m.sum(names::WORKER_TCP_CONNECTIONS) >= 403.0, "{m}");
        // The server closed the silent connection, gracefully: TLS close_notify, then the end
        // of the stream (a TLS stream cut without close_notify reads as an error).
        let (_, end) = read_until_closed(&mut silent, Duration::from_secs(5))
            .await
            .expect("the silent connection is still open");
        assert!(end.is_ok(), "closed without close_notify: {end:?}");
        let mut buf = [0u8; 64];
        for mut s in idle {
            s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            assert!(
                matches!(s.read(&mut buf), Ok(0) | Err(_)),
                "an idle connection is open"
            );
        }
        let got = curl(&rm, &["--http1.1"], "/hello.txt").await;
        assert_eq!(got.status, 200);
        check_bytes("HTTP/3", &conn.get("/bytes/1000").await.unwrap(), 1000);
    })
    .await;
}

/// A request head over the limit (64 KiB) gets 431 over HTTP/1.1 and is refused over HTTP/2;
/// an HTTP/2 client that opens and resets streams without end (rapid reset) has its connection
/// closed. Both are counted, and both transports serve afterwards.
#[tokio::test]
async fn oversized_heads_and_rapid_resets_are_refused_and_counted() {
    if !have_curl() {
        return;
    }
    bounded(Duration::from_secs(60), async {
        let rm = Ringmux::start(1, Forward::Shm, &[]);
        let big = "x".repeat(70 * 1024);
        let request = || {
            http::Request::get("https://localhost/hello.txt")
                .header("x-big", big.as_str())
                .body(Empty::new().map_err(|never| match never {}).boxed_unsync())
                .unwrap()
        };
        let mut h1 = TcpConn::connect(tcp_addr(&rm), Version::Http1)
            .await
            .unwrap();
        let r = h1
            .send(request())
            .await
            .expect("a response to the big head");
        assert_eq!(
            r.status(),
            http::StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE
        );
        let mut h2c = TcpConn::connect(tcp_addr(&rm), Version::Http2)
            .await
            .unwrap();
        match h2c.send(request()).await {
            Ok(r) => assert_eq!(
                r.status(),
                http::StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE
            ),
            Err(e) => eprintln!("HTTP/2 refused the big head: {e}"),
        }

        // Rapid reset: HEADERS then RST_STREAM, again and again, on one connection.
        let tls = tls_connect(tcp_addr(&rm), b"h2").await.unwrap();
        let (mut client, connection) = h2::client::handshake(tls).await.unwrap();
        let connection = tokio::spawn(connection);
        // The stream limit the server announced (SETTINGS_MAX_CONCURRENT_STREAMS), once its
        // SETTINGS arrived.
        let deadline = Instant::now() + Duration::from_secs(10);
        client = client.ready().await.unwrap();
        while client.current_max_send_streams() != 128 {
            assert!(
                Instant::now() < deadline,
                "max concurrent streams {}",
                client.current_max_send_streams()
            );
            tokio::task::yield_now().await;
            client = client.ready().await.unwrap();
        }
        let mut sent = 0;
        for _ in 0..10_000 {
            let Ok(ready) = client.ready().await else {
                break;
            };
            client = ready;
            let req = http::Request::get("https://localhost/hello.txt")
                .body(())
                .unwrap();
            let Ok((_, mut stream)) = client.send_request(req, true) else {
                break;
            };
            stream.send_reset(h2::Reason::CANCEL);
            sent += 1;
        }
        let ended = tokio::time::timeout(Duration::from_secs(10), connection)
            .await
            .expect("the server closed the rapid-reset connection");
        // GOAWAY ENHANCE_YOUR_CALM, or a broken pipe when the client was still writing as
        // the server closed; which kind it was, the server's counter says.
        let e = ended.unwrap().expect_err("closed with an error");
        eprintln!("the rapid-reset connection ended after {sent} streams: {e}");

        let kind = |m: &harness::Metrics, k: &str| m.sum_where(names::WORKER_TCP_ERRORS, "kind", k);
        rm.wait_for("the bad input counted", Duration::from_secs(20), |m| {
            kind(m, "too_large") >= 1.0 && kind(m, "rapid_reset") >= 1.0
        })
        .await;
        assert_eq!(curl(&rm, &["--http2"], "/hello.txt").await.status, 200);
        assert_eq!(curl(&rm, &["--http1.1"], "/hello.txt").await.status, 200);
        let conn = rm.connect(&rm.client()).await;
        check_bytes("HTTP/3", &conn.get("/bytes/1000").await.unwrap(), 1000);
    })
    .await;
}

/// What happens while a download is under way.
#[derive(Clone, Copy, Debug)]
enum During {
    Reload,
    Upgrade,
}

/// A download over TCP in flight when a reload starts finishes byte-exact on the old
/// generation; new connections after it reach the new one.
#[tokio::test]
async fn a_tcp_download_survives_a_reload() {
    download_across(During::Reload).await;
}

/// A download over TCP in flight across `ringmux upgrade` (the demux never touches TCP bytes;
/// the new image takes the listener over) finishes byte-exact, and new connections are served.
#[tokio::test]
async fn a_tcp_download_survives_an_upgrade() {
    download_across(During::Upgrade).await;
}

async fn download_across(during: During) {
    if !have_curl() {
        return;
    }
    bounded(Duration::from_secs(90), async {
        let rm = Ringmux::start(2, Forward::Shm, &["--grace", "30"]);
        let out: PathBuf = rm.dir().join("download");
        let n: u64 = 20_000_000;
        // About 4 s at this rate: the reload happens in the middle.
        let mut download = tokio::process::Command::new("curl")
            .args(["-sS", "-k", "--http1.1", "--limit-rate", "5M", "-o"])
            .arg(&out)
            .arg(format!("https://{}/bytes/{n}", tcp_addr(&rm)))
            .spawn()
            .expect("curl");
        // Under way: some of it has arrived.
        let deadline = Instant::now() + Duration::from_secs(20);
        while std::fs::metadata(&out).map_or(0, |m| m.len()) < 1_000_000 {
            assert!(Instant::now() < deadline, "the download never started");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let (ok, text) = match during {
            During::Reload => rm.reload(Duration::from_secs(30)).await,
            During::Upgrade => rm.upgrade(Duration::from_secs(30)).await,
        };
        assert!(ok, "{during:?}: {text}");
        let got = curl(&rm, &["--http2"], "/hello.txt").await;
        assert_eq!(got.status, 200, "a new connection after the {during:?}");
        let status = download.wait().await.unwrap();
        assert!(status.success(), "the download failed: {status}");
        let body = std::fs::read(&out).unwrap();
        assert_eq!(
            fnv(&body),
            expected_bytes(n),
            "byte-exact across the reload"
        );
    })
    .await;
}

/// A slow HTTP/2 reader across reloads (curl's `--limit-rate`, a file under `--root` larger
/// than the socket buffers, so that the old worker is done with the stream while most of it
/// is still on its way): the old worker closes the connection gracefully, and no byte it sent
/// is lost to a reset. Ten runs, each byte-exact.
#[tokio::test]
async fn a_slow_http2_download_survives_reloads_byte_exact() {
    if !have_curl() {
        return;
    }
    bounded(Duration::from_secs(240), async {
        let root = temp_dir("ringmux-tcp-slow-reader");
        let content = harness::random_bytes(18 << 20);
        std::fs::write(root.path().join("big.bin"), &content).unwrap();
        let root_arg = root.path().to_string_lossy().into_owned();
        let rm = Ringmux::start(1, Forward::Shm, &["--root", &root_arg, "--grace", "60"]);
        for run in 0..10 {
            let out = rm.dir().join(format!("download-{run}"));
            let mut download = tokio::process::Command::new("curl")
                .args(["-sS", "-k", "--http2", "--limit-rate", "8M", "-o"])
                .arg(&out)
                .arg(format!("https://{}/big.bin", tcp_addr(&rm)))
                .spawn()
                .expect("curl");
            let deadline = Instant::now() + Duration::from_secs(20);
            while std::fs::metadata(&out).map_or(0, |m| m.len()) < 1_000_000 {
                assert!(
                    Instant::now() < deadline,
                    "run {run}: the download never started"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            let (ok, text) = rm.reload(Duration::from_secs(30)).await;
            assert!(ok, "run {run}: {text}");
            let status = download.wait().await.unwrap();
            assert!(status.success(), "run {run}: the download failed: {status}");
            let body = std::fs::read(&out).unwrap();
            assert!(
                body == content,
                "run {run}: {} of {} bytes, or not the file's",
                body.len(),
                content.len()
            );
        }
    })
    .await;
}

/// `--redirect-http`: plain HTTP answered with 301 to the HTTPS port, same host and path.
/// `--access-log`: one line per request over HTTP/3, HTTP/2, HTTP/1.1 and the redirects, with
/// the fields docs/operators/access-log.md names; a reload opens the path again, so a rotated log is let go.
#[tokio::test]
async fn redirects_to_https_and_an_access_log_of_every_request() {
    if !have_curl() {
        return;
    }
    bounded(Duration::from_secs(90), async {
        let redirect = harness::unused_tcp_port();
        let dir = temp_dir("ringmux-access-log");
        // Under the test's own folder, which may be closed to the workers' user: the demux
        // opens the log, the workers only write to what it gives them.
        let log = dir.path().join("access.log");
        let rm = Ringmux::start(
            2,
            Forward::Shm,
            &[
                "--redirect-http",
                &redirect.to_string(),
                "--access-log",
                log.to_str().unwrap(),
            ],
        );
        let https = tcp_addr(&rm).port();
        for (host, want) in [
            (None, format!("https://127.0.0.1:{https}/some/path?x=1")),
            (
                Some("example.com:8080"),
                format!("https://example.com:{https}/some/path?x=1"),
            ),
        ] {
            let mut cmd = tokio::process::Command::new("curl");
            cmd.args([
                "-sS",
                "-o",
                "/dev/null",
                "-w",
                "%{http_code} %{redirect_url}",
            ]);
            if let Some(h) = host {
                cmd.args(["-H", &format!("host: {h}")]);
            }
            let out = cmd
                .arg(format!("http://{redirect}/some/path?x=1"))
                .output()
                .await
                .expect("curl");
            let got = String::from_utf8_lossy(&out.stdout).into_owned();
            assert_eq!(got, format!("301 {want}"), "{host:?}");
        }

        let conn = rm.connect(&rm.client()).await;
        check_bytes("HTTP/3", &conn.get("/bytes/1000").await.unwrap(), 1000);
        assert_eq!(curl(&rm, &["--http2"], "/hello.txt").await.status, 200);
        assert_eq!(curl(&rm, &["--http1.1"], "/nowhere").await.status, 404);
        let lines = || std::fs::read_to_string(&log).unwrap_or_default();
        let m = rm
            .wait_for("five lines written", Duration::from_secs(20), |m| {
                m.sum(names::WORKER_ACCESS_LOG_LINES) >= 5.0
            })
            .await;
        assert_eq!(m.sum(names::WORKER_ACCESS_LOG_DROPPED), 0.0, "{m}");
        let text = lines();
        let fields: Vec<Vec<&str>> = text.lines().map(|l| l.split(' ').collect()).collect();
        assert_eq!(fields.len(), 5, "{text}");
        let find = |protocol: &str, path: &str| {
            fields
                .iter()
                .find(|f| f[2] == protocol && f[5] == path)
                .unwrap_or_else(|| panic!("no {protocol} {path} in\n{text}"))
        };
        // time client protocol method authority path status bytes duration instance site ending
        let h3 = find("h3", "/bytes/1000");
        assert_eq!(
            &h3[3..8],
            [
                "GET",
                &format!("localhost:{}", rm.listen.port()),
                "/bytes/1000",
                "200",
                "1000"
            ]
        );
        let h2 = find("h2", "/hello.txt");
        assert_eq!(&h2[6..8], ["200", "19"]);
        let h1 = find("h1", "/nowhere");
        assert_eq!(h1[6], "404");
        let moved = find("h1", "/some/path?x=1");
        assert_eq!(moved[6], "301");
        for f in &fields {
            assert_eq!(f.len(), 12, "{f:?}");
            assert_eq!(f[10], "default", "site {f:?}");
            assert_eq!(f[11], "ok", "ending {f:?}");
            assert!(f[0].ends_with('Z') && f[0].len() == 24, "time {f:?}");
            assert!(f[1].starts_with("127.0.0.1:"), "client {f:?}");
            assert!(f[8].parse::<f64>().is_ok(), "duration {f:?}");
            assert!(["0", "1"].contains(&f[9]), "instance {f:?}");
        }

        // Rotation: move the log away, reload; the new generation writes to a new file.
        let before = lines();
        let rotated = dir.path().join("access.log.1");
        std::fs::rename(&log, &rotated).unwrap();
        let (ok, answer) = rm.reload(Duration::from_secs(30)).await;
        assert!(ok, "{answer}");
        // The old generation may still take a connection or two while it learns it drains:
        // those lines go to the rotated file, as they should.
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            assert_eq!(curl(&rm, &["--http2"], "/hello.txt").await.status, 200);
            if lines().contains(" h2 GET ") {
                break;
            }
            assert!(Instant::now() < deadline, "nothing in the new log");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let old = std::fs::read_to_string(&rotated).unwrap();
        assert!(
            old.starts_with(&before),
            "the rotated log lost lines:\n{old}"
        );
    })
    .await;
}

/// `--tcp-max-connections` held by busy connections (a response in flight on each): a new
/// connection is closed as soon as it is accepted (counted as `over_cap`), and connections are
/// taken again once the worker has room.
#[tokio::test]
async fn connections_past_the_cap_are_closed_at_accept_and_counted() {
    if !have_curl() {
        return;
    }
    bounded(Duration::from_secs(60), async {
        let rm = Ringmux::start(1, Forward::Shm, &["--tcp-max-connections", "2"]);
        // Each asks for a body far larger than the socket buffers and reads none of it, so
        // its response stays in flight: neither connection is idle.
        let mut held = Vec::new();
        for version in [Version::Http1, Version::Http2] {
            let mut conn = TcpConn::connect(tcp_addr(&rm), version).await.unwrap();
            // HTTP/1.1 names the host in its own field (RFC 9112 §3.2: 400 without one).
            let req = http::Request::get("https://localhost/bytes/60000000")
                .header(http::header::HOST, "localhost")
                .body(Empty::new().map_err(|never| match never {}).boxed_unsync())
                .unwrap();
            let resp = conn.send(req).await.expect("a response head");
            assert_eq!(resp.status(), http::StatusCode::OK, "{version:?}");
            held.push((conn, resp));
        }
        assert!(
            tls_connect(tcp_addr(&rm), b"h2").await.is_err(),
            "a third connection was served"
        );
        let m = rm
            .wait_for("the refusal counted", Duration::from_secs(20), |m| {
                m.sum_where(names::WORKER_TCP_ERRORS, "kind", "over_cap") >= 1.0
            })
            .await;
        assert_eq!(
            tcp_kind(&m, "evicted"),
            0.0,
            "a busy connection was closed: {m}"
        );
        // HTTP/3 is not TCP's cap.
        let conn = rm.connect(&rm.client()).await;
        check_bytes("HTTP/3", &conn.get("/bytes/1000").await.unwrap(), 1000);
        drop(held);
        // Served again once the worker has seen the two connections end.
        let deadline = Instant::now() + Duration::from_secs(20);
        while tls_connect(tcp_addr(&rm), b"h2").await.is_err() {
            assert!(Instant::now() < deadline, "never served again");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(curl(&rm, &["--http2"], "/hello.txt").await.status, 200);
    })
    .await;
}

/// At `--tcp-max-connections` held by idle HTTP/2 connections a new client is served, not
/// refused: the connection idle longest is sent GOAWAY and closed to make room (counted as
/// `evicted`), and the other one serves on.
#[tokio::test]
async fn at_the_cap_the_connection_idle_longest_makes_room() {
    if !have_curl() {
        return;
    }
    bounded(Duration::from_secs(60), async {
        let rm = Ringmux::start(1, Forward::Shm, &["--tcp-max-connections", "2"]);
        let (mut older, older_conn) = h2_client(tcp_addr(&rm)).await;
        assert_eq!(h2_get(&mut older, "/hello.txt").await, 200);
        let (mut newer, newer_conn) = h2_client(tcp_addr(&rm)).await;
        assert_eq!(h2_get(&mut newer, "/hello.txt").await, 200);
        // Both are idle and the cap is reached: a third client is served all the same.
        assert_eq!(curl(&rm, &["--http2"], "/hello.txt").await.status, 200);
        let ended = tokio::time::timeout(Duration::from_secs(20), older_conn)
            .await
            .expect("the connection idle longest is still open");
        eprintln!("the older connection ended: {ended:?}");
        assert!(!newer_conn.is_finished(), "the newer connection was closed");
        assert_eq!(h2_get(&mut newer, "/hello.txt").await, 200);
        let m = rm
            .wait_for("the eviction counted", Duration::from_secs(20), |m| {
                tcp_kind(m, "evicted") >= 1.0
            })
            .await;
        assert_eq!(tcp_kind(&m, "over_cap"), 0.0, "{m}");
    })
    .await;
}

/// `--tcp-idle-timeout`: an HTTP/2 client that sends its preface and SETTINGS and then nothing
/// (no acknowledgement, no answer to the server's PING) is sent GOAWAY and closed, and counted
/// as `idle_timeout`. A download that outlasts the timeout several times over is not cut: its
/// stream is in flight all along.
#[tokio::test]
async fn an_idle_http2_connection_is_closed_but_a_busy_one_is_not() {
    if !have_curl() {
        return;
    }
    bounded(Duration::from_secs(90), async {
        let rm = Ringmux::start(1, Forward::Shm, &["--tcp-idle-timeout", "1"]);
        let out = rm.dir().join("download");
        // Far more than the socket buffers hold: at this rate the server has a stream in
        // flight for about 7 s, longer than the idle timeout and the wait for an answer to
        // GOAWAY together.
        let n: u64 = 60_000_000;
        let mut download = tokio::process::Command::new("curl")
            .args(["-sS", "-k", "--http2", "--limit-rate", "8M", "-o"])
            .arg(&out)
            .arg(format!("https://{}/bytes/{n}", tcp_addr(&rm)))
            .spawn()
            .expect("curl");
        let mut silent = silent_h2(tcp_addr(&rm)).await;
        let (sent, end) = read_until_closed(&mut silent, Duration::from_secs(30))
            .await
            .expect("the idle connection is still open");
        assert!(end.is_ok(), "closed without close_notify: {end:?}");
        let frames = h2_frames(&sent);
        let goaway = frames
            .iter()
            .find(|(kind, _)| *kind == H2_GOAWAY)
            .unwrap_or_else(|| panic!("no GOAWAY before the close, only {frames:?}"));
        assert_eq!(goaway.1.get(4..8), Some(&[0u8; 4][..]), "GOAWAY NO_ERROR");
        rm.wait_for("the idle close counted", Duration::from_secs(20), |m| {
            tcp_kind(m, "idle_timeout") >= 1.0
        })
        .await;
        let status = download.wait().await.unwrap();
        assert!(status.success(), "the busy connection was cut: {status}");
        let body = std::fs::read(&out).unwrap();
        assert_eq!(
            fnv(&body),
            expected_bytes(n),
            "the busy download, byte-exact"
        );
    })
    .await;
}

/// `ringmux_worker_tcp_errors_total{kind}`, summed over the instances.
fn tcp_kind(m: &harness::Metrics, kind: &str) -> f64 {
    m.sum_where(names::WORKER_TCP_ERRORS, "kind", kind)
}

/// An HTTP/2 connection over TLS that sends the client preface and an empty SETTINGS frame
/// (RFC 9113 §3.4) and then nothing at all.
async fn silent_h2(addr: SocketAddr) -> ringmux_testkit::tcp_client::TlsStream {
    let mut tls = tls_connect(addr, b"h2").await.expect("TLS with ALPN h2");
    tls.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        .await
        .unwrap();
    // A frame header (RFC 9113 §4.1): length 0, type SETTINGS (4), no flags, stream 0.
    tls.write_all(&[0, 0, 0, 4, 0, 0, 0, 0, 0]).await.unwrap();
    tls.flush().await.unwrap();
    tls
}

/// Everything the server sent on `conn` until it closed it, and how it ended: `Ok` at the end
/// of the stream after TLS close_notify, an error otherwise (the end of the TCP stream without
/// it, a reset). `None` if it was still open after `limit`.
async fn read_until_closed(
    conn: &mut ringmux_testkit::tcp_client::TlsStream,
    limit: Duration,
) -> Option<(Vec<u8>, std::io::Result<()>)> {
    let mut sent = Vec::new();
    let mut chunk = [0u8; 4096];
    let read = async {
        loop {
            match conn.read(&mut chunk).await {
                Ok(0) => break Ok(()),
                Ok(n) => sent.extend_from_slice(&chunk[..n]),
                Err(e) => break Err(e),
            }
        }
    };
    let end = tokio::time::timeout(limit, read).await.ok()?;
    Some((sent, end))
}

/// The HTTP/2 frame type of GOAWAY (RFC 9113 §6.8).
const H2_GOAWAY: u8 = 7;

/// The frames in `bytes` (RFC 9113 §4.1), as (type, payload); a cut-off last frame is left out.
fn h2_frames(mut bytes: &[u8]) -> Vec<(u8, Vec<u8>)> {
    let mut frames = Vec::new();
    while bytes.len() >= 9 {
        let len = u32::from_be_bytes([0, bytes[0], bytes[1], bytes[2]]) as usize;
        let Some(payload) = bytes.get(9..9 + len) else {
            break;
        };
        frames.push((bytes[3], payload.to_vec()));
        bytes = &bytes[9 + len..];
    }
    frames
}

/// An HTTP/2 client (the h2 crate) over TLS to `addr`, and its connection's task, which ends
/// when the connection does.
async fn h2_client(
    addr: SocketAddr,
) -> (
    h2::client::SendRequest<bytes::Bytes>,
    tokio::task::JoinHandle<Result<(), h2::Error>>,
) {
    let tls = tls_connect(addr, b"h2").await.expect("TLS with ALPN h2");
    let (client, connection) = h2::client::handshake(tls).await.expect("HTTP/2 handshake");
    (client, tokio::spawn(connection))
}

/// GETs `path` on `client` and reads the whole body; the status.
async fn h2_get(client: &mut h2::client::SendRequest<bytes::Bytes>, path: &str) -> u16 {
    let ready = client
        .clone()
        .ready()
        .await
        .expect("the connection takes a request");
    *client = ready;
    let req = http::Request::get(format!("https://localhost{path}"))
        .body(())
        .unwrap();
    let (resp, _) = client.send_request(req, true).expect("a request sent");
    let resp = resp.await.expect("a response");
    let status = resp.status().as_u16();
    let mut body = resp.into_body();
    while let Some(data) = body.data().await {
        let data = data.expect("the body");
        let _ = body.flow_control().release_capacity(data.len());
    }
    status
}

/// Plain HTTP with nothing to configure: an HTTPS listener on port 443 and no
/// `--redirect-http` serve port 80 of the same address with redirects; a port 80 that is taken
/// is a warning, not a failure; `--redirect-http off` serves none. Needs root (port 443, 80);
/// each case on an address of its own in 127.0.0.0/8.
#[tokio::test]
async fn port_80_redirects_by_itself_beside_port_443() {
    if !have_curl() || !nix::unistd::geteuid().is_root() {
        eprintln!("skipped: needs curl and root (ports 443 and 80)");
        return;
    }
    bounded(Duration::from_secs(90), async {
        let served = Ringmux::start(1, Forward::Shm, &["--listen", "127.8.0.1:443"]);
        let out = tokio::process::Command::new("curl")
            .args([
                "-sS",
                "-o",
                "/dev/null",
                "-w",
                "%{http_code} %{redirect_url}",
            ])
            .args(["-H", "host: a.test", "http://127.8.0.1/p/q?x=1"])
            .output()
            .await
            .expect("curl");
        let got = String::from_utf8_lossy(&out.stdout).into_owned();
        assert_eq!(
            got,
            "301 https://a.test/p/q?x=1",
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        drop(served);

        // Port 80 taken: ringmux serves HTTPS all the same, and says why port 80 is not.
        let taken = std::net::TcpListener::bind("127.8.0.2:80").expect("taking port 80");
        let rm = Ringmux::start(1, Forward::Shm, &["--listen", "127.8.0.2:443"]);
        assert_eq!(curl_at("127.8.0.2:443").await, 200);
        rm.wait_for_log("the warning", Duration::from_secs(10), |log| {
            log.contains("plain HTTP is not served") && log.contains("127.8.0.2:80")
        })
        .await;
        drop((rm, taken));

        // Off: nothing listens on port 80.
        let _rm = Ringmux::start(
            1,
            Forward::Shm,
            &["--listen", "127.8.0.3:443", "--redirect-http", "off"],
        );
        assert_eq!(curl_at("127.8.0.3:443").await, 200);
        let refused =
            std::net::TcpStream::connect("127.8.0.3:80").expect_err("nothing listens on port 80");
        assert_eq!(refused.kind(), std::io::ErrorKind::ConnectionRefused);
    })
    .await;
}

/// The status of `GET https://ADDR/hello.txt` over TCP (any certificate).
async fn curl_at(addr: &str) -> u16 {
    let out = tokio::process::Command::new("curl")
        .args(["-sSk", "-o", "/dev/null", "-w", "%{http_code}"])
        .arg(format!("https://{addr}/hello.txt"))
        .output()
        .await
        .expect("curl");
    String::from_utf8_lossy(&out.stdout).parse().unwrap_or(0)
}
