//! A real browser against ringmux: Debian's headless Chromium loads a page from `--root` over
//! HTTPS on TCP (where it negotiates HTTP/2) and over HTTP/3, and ringmux's request counters
//! say which transport carried it.
//!
//! Chromium trusts ringmux's self-signed certificate (the one ringmux makes at start-up, read
//! from a TLS handshake) through `--ignore-certificate-errors-spki-list`, pinned by the base64
//! SHA-256 of its SubjectPublicKeyInfo. That pin is enough over TCP and for an origin Chromium
//! is told to reach over QUIC (`--origin-to-force-quic-on`), but not for HTTP/3 found through
//! `alt-svc`: Chromium takes Alt-Svc to QUIC only for a certificate that chains to a known root
//! (ERR_QUIC_CERT_ROOT_NOT_KNOWN). With the pin alone its net log shows the QUIC handshakes to
//! the advertised port closed with CERTIFICATE_VERIFY_FAILED and every request staying on
//! HTTP/2. So the HTTP/3 test forces QUIC; the Alt-Svc path itself is checked with niquests in
//! `tcp.rs`.
//!
//! Which transport carried the page is read from ringmux's request counters, which the worker
//! (a single instance here) reports about once a second. After Chromium exits, each test sends
//! what Chromium never does, a request head over 64 KiB (answered 431, counted as `too_large`),
//! and waits for the report that holds it: the worker counts a request when it arrives, so each
//! of Chromium's was counted before Chromium had its answer, before the probe, and that report
//! holds them all.

use ringmux_systests::harness;

use std::fs::File;
use std::net::SocketAddr;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use harness::{bounded, Forward, Ringmux};
use http_body_util::{BodyExt, Empty};
use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
use ringmux_demux::metrics::names;
use ringmux_testkit::tcp_client::{tls_connect, TcpConn, Version};
use ringmux_testkit::{temp_dir, tool, TempDir};

/// Bound of one Chromium run (a page load from loopback takes well under a second).
const CHROMIUM_LIMIT: Duration = Duration::from_secs(30);

/// Whether Chromium can run here; `false` means skip (only allowed outside CI).
fn have_chromium() -> bool {
    tool::CHROMIUM.present()
}

/// A `--root` holding an `index.html` whose body is `marker`.
fn site(marker: &str) -> TempDir {
    let root = temp_dir("ringmux-browser-root");
    let page = format!(
        "<!doctype html>\n<html><head><title>ringmux</title></head>\
         <body><p id=\"marker\">{marker}</p></body></html>\n"
    );
    std::fs::write(root.path().join("index.html"), page).expect("writing index.html");
    root
}

/// A marker no other page or error page holds.
fn marker() -> String {
    format!("ringmux-browser-{:016x}", harness::random_u64())
}

/// The TCP address of `rm`: the UDP socket's, by default.
fn tcp_addr(rm: &Ringmux) -> SocketAddr {
    SocketAddr::new(rm.listen.ip(), rm.listen.port())
}

/// The `--ignore-certificate-errors-spki-list` value for the certificate `rm` serves: base64 of
/// SHA-256 of its SubjectPublicKeyInfo.
async fn spki_pin(rm: &Ringmux) -> String {
    let tls = tls_connect(tcp_addr(rm), b"h2")
        .await
        .expect("a TLS connection to read ringmux's certificate");
    let certs = tls
        .get_ref()
        .1
        .peer_certificates()
        .expect("ringmux sent a certificate");
    let spki = subject_public_key_info(certs[0].as_ref());
    base64(ring::digest::digest(&ring::digest::SHA256, spki).as_ref())
}

/// The DER element at the start of `der`: (tag, the whole element, its contents).
fn der_element(der: &[u8]) -> (u8, &[u8], &[u8]) {
    let (len, head) = match der[1] {
        short if short < 0x80 => (short as usize, 2),
        long => {
            let n = (long & 0x7f) as usize;
            let len = der[2..2 + n]
                .iter()
                .fold(0usize, |len, &b| (len << 8) | b as usize);
            (len, 2 + n)
        }
    };
    (der[0], &der[..head + len], &der[head..head + len])
}

/// The SubjectPublicKeyInfo (whole DER element) of an X.509 certificate (RFC 5280 §4.1:
/// the TBSCertificate's optional `[0]` version, serial number, signature algorithm, issuer,
/// validity and subject come first).
fn subject_public_key_info(cert: &[u8]) -> &[u8] {
    let (_, _, certificate) = der_element(cert);
    let (_, _, mut rest) = der_element(certificate);
    let mut fields = Vec::new();
    while !rest.is_empty() {
        let (tag, whole, _) = der_element(rest);
        fields.push((tag, whole));
        rest = &rest[whole.len()..];
    }
    let at = if fields[0].0 == 0xa0 { 6 } else { 5 };
    let (tag, spki) = fields[at];
    assert_eq!(tag, 0x30, "the SubjectPublicKeyInfo is a SEQUENCE");
    spki
}

/// Standard base64 with padding (RFC 4648 §4).
fn base64(data: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for chunk in data.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, &b)| n | (b as u32) << (16 - 8 * i));
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ALPHABET[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// What one Chromium run printed: the DOM (`--dump-dom`) and its log.
struct Dump {
    dom: String,
    log: String,
}

impl Dump {
    /// The end of Chromium's log, for a failure message.
    fn log_tail(&self) -> String {
        let lines: Vec<&str> = self.log.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }
}

/// Loads `url` in a headless Chromium with a fresh profile in `rm`'s directory, trusting `rm`'s
/// certificate by its SPKI pin, plus `flags`; bounded by [`CHROMIUM_LIMIT`].
async fn chromium(rm: &Ringmux, run: &str, flags: &[String], url: &str) -> Dump {
    let dir = rm.dir().join(run);
    std::fs::create_dir_all(&dir).expect("creating Chromium's directory");
    let dom_path = dir.join("dom.html");
    let log_path = dir.join("chromium.log");
    let pin = spki_pin(rm).await;
    // Output to files, not pipes: a helper process that outlives the browser would hold a pipe
    // open. Its own process group, so that every process it starts goes when it is done.
    let mut child = tokio::process::Command::new("chromium")
        // --no-sandbox: as root Chromium refuses to start sandboxed (and in a container it
        // often cannot); the page is our own, from loopback.
        .args(["--headless=new", "--no-sandbox", "--disable-gpu"])
        .arg(format!("--user-data-dir={}", dir.join("profile").display()))
        .arg(format!("--ignore-certificate-errors-spki-list={pin}"))
        .args(flags)
        .arg("--dump-dom")
        .arg(url)
        // Whatever it writes outside the profile (~/.pki, caches) stays in the test's dir.
        .env("HOME", &dir)
        .stdin(Stdio::null())
        .stdout(File::create(&dom_path).expect("creating dom.html"))
        .stderr(File::create(&log_path).expect("creating chromium.log"))
        .process_group(0)
        .kill_on_drop(true)
        .spawn()
        .expect("starting chromium");
    let group = Pid::from_raw(child.id().expect("chromium's pid") as i32);
    let status = tokio::time::timeout(CHROMIUM_LIMIT, child.wait()).await;
    let _ = killpg(group, Signal::SIGKILL);
    let read =
        |p: &Path| String::from_utf8_lossy(&std::fs::read(p).unwrap_or_default()).into_owned();
    let dump = Dump {
        dom: read(&dom_path),
        log: read(&log_path),
    };
    match status {
        Ok(Ok(s)) => assert!(
            s.success(),
            "chromium {url}: {s}; its log:\n{}",
            dump.log_tail()
        ),
        Ok(Err(e)) => panic!("waiting for chromium: {e}"),
        Err(_) => panic!(
            "chromium {url} did not finish within {CHROMIUM_LIMIT:?}; its log:\n{}",
            dump.log_tail()
        ),
    }
    dump
}

/// Asserts that `dump` holds the page with `marker`.
fn assert_page(dump: &Dump, marker: &str, over: &str) {
    assert!(
        dump.dom.contains(marker),
        "{over}: the DOM Chromium dumped lacks {marker:?}:\n{}\n--- chromium's log ---\n{}",
        dump.dom,
        dump.log_tail()
    );
}

/// Requests ringmux's single worker has counted over `protocol`.
fn requests(m: &harness::Metrics, protocol: &str) -> f64 {
    m.sum_where(names::WORKER_REQUESTS, "protocol", protocol)
}

/// The metrics once they hold every request of a Chromium run that has ended: sends a request
/// head over 64 KiB (which Chromium never sends) and waits for its `too_large` to be reported.
async fn metrics_after_chromium(rm: &Ringmux) -> harness::Metrics {
    let too_large =
        |m: &harness::Metrics| m.sum_where(names::WORKER_TCP_ERRORS, "kind", "too_large");
    let mut h1 = TcpConn::connect(tcp_addr(rm), Version::Http1)
        .await
        .expect("an HTTP/1.1 connection");
    let request = http::Request::get("https://localhost/hello.txt")
        .header("x-big", "x".repeat(70 * 1024))
        .body(Empty::new().map_err(|never| match never {}).boxed_unsync())
        .unwrap();
    let r = h1.send(request).await.expect("a response to the big head");
    assert_eq!(
        r.status(),
        http::StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE
    );
    rm.wait_for(
        "the worker to report the head over 64 KiB sent after Chromium",
        Duration::from_secs(10),
        |m| too_large(m) >= 1.0,
    )
    .await
}

/// Chromium loads a page from a fresh ringmux (`quic`: with QUIC forced for its origin) and
/// sends every request over `protocol`, none over the other two.
async fn chromium_loads_a_page(quic: bool, protocol: &str) {
    let marker = marker();
    let root = site(&marker);
    let root_arg = root.path().to_string_lossy().into_owned();
    let rm = Ringmux::start(1, Forward::Shm, &["--root", &root_arg]);
    let (name, flags, url) = if quic {
        let flags = vec![
            "--enable-quic".to_string(),
            format!("--origin-to-force-quic-on={}", rm.listen),
        ];
        ("quic", flags, format!("https://{}/", rm.listen))
    } else {
        ("tcp", Vec::new(), format!("https://{}/", tcp_addr(&rm)))
    };
    let dump = chromium(&rm, name, &flags, &url).await;
    assert_page(&dump, &marker, &format!("over {protocol}"));

    let m = metrics_after_chromium(&rm).await;
    assert!(requests(&m, protocol) >= 1.0, "no {protocol} request:\n{m}");
    for other in ["h1", "h2", "h3"].into_iter().filter(|p| *p != protocol) {
        assert_eq!(requests(&m, other), 0.0, "Chromium spoke {other}:\n{m}");
    }
}

/// No QUIC flag: Chromium loads the page over HTTPS on TCP, HTTP/2 by ALPN, and sends nothing
/// over HTTP/3.
#[tokio::test]
async fn chromium_loads_a_page_over_tcp_with_http2() {
    if !have_chromium() {
        return;
    }
    bounded(Duration::from_secs(90), chromium_loads_a_page(false, "h2")).await;
}

/// QUIC forced for ringmux's origin: Chromium loads the page over HTTP/3 and sends nothing over
/// TCP.
#[tokio::test]
async fn chromium_loads_a_page_over_http3_when_quic_is_forced() {
    if !have_chromium() {
        return;
    }
    bounded(Duration::from_secs(90), chromium_loads_a_page(true, "h3")).await;
}
