//! The PROXY protocol on the TCP listener (`--proxy-protocol-from`, docs/operators/limits.md):
//! behind a listed balancer the client its header names is the client everywhere (the access
//! log, `deny`), whatever the version and the HTTP version; curl's own version 1 header is
//! read; an unlisted source's header is not believed; a listed source without a valid header
//! is closed and counted by why.
//!
//! The balancer is a relay in the test on loopback, connecting to ringmux from 127.0.0.3 and
//! writing the header it is given before relaying curl's bytes both ways; curl reaches ringmux
//! directly from 127.0.0.2 with `--interface` (both listed), or from 127.0.0.1 (not listed).

use ringmux_systests::harness;

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use harness::{bounded, Forward, Ringmux};
use ringmux_demux::metrics::names;
use ringmux_testkit::curl::{self, Got, Reach};
use ringmux_testkit::{temp_dir, tool, TempDir};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpSocket, TcpStream};

const LIMIT: Duration = Duration::from_secs(90);
const CLIENT_LIMIT: Duration = Duration::from_secs(20);
const REFUSED: &str = "ringmux_worker_proxy_protocol_refused_total";
/// The relay's source address, and curl's when it reaches ringmux as a listed source.
const RELAY: &str = "127.0.0.3";
const LISTED_CURL: &str = "127.0.0.2";

/// A ringmux of one worker whose one site answers `/` with 200 and denies 198.51.100.0/24,
/// listing 127.0.0.2 and 127.0.0.3 as balancers, its access log in its folder.
struct Setup {
    dir: TempDir,
    rm: Ringmux,
}

impl Setup {
    fn start() -> Setup {
        let dir = temp_dir("ringmux-proxy-protocol");
        let d = dir.path();
        let mut params =
            rcgen::CertificateParams::new(vec!["localhost".to_string()]).expect("parameters");
        params.distinguished_name = rcgen::DistinguishedName::new();
        let key = rcgen::KeyPair::generate().expect("a key pair");
        let cert = params.self_signed(&key).expect("a certificate");
        std::fs::write(d.join("site.pem"), cert.pem()).unwrap();
        std::fs::write(d.join("site.key"), key.serialize_pem()).unwrap();
        let config = d.join("ringmux.toml");
        let text = format!(
            r#"proxy_protocol_from = ["{LISTED_CURL}", "{RELAY}/32"]
access_log = "{log}"

[[site]]
names = ["localhost"]
cert = "{d}/site.pem"
key = "{d}/site.key"
deny = ["198.51.100.0/24"]
[[site.route]]
path = "/"
respond = {{ status = 200, body = "hi\n" }}
"#,
            log = d.join("access.log").display(),
            d = d.display(),
        );
        std::fs::write(&config, text).unwrap();
        let rm = Ringmux::start(1, Forward::Shm, &["--config", config.to_str().unwrap()]);
        Setup { dir, rm }
    }

    fn port(&self) -> u16 {
        self.rm.listen.port()
    }

    fn to(&self) -> SocketAddr {
        SocketAddr::new(self.rm.listen.ip(), self.port())
    }

    fn access_log(&self) -> PathBuf {
        self.dir.path().join("access.log")
    }

    /// curl `/` on `port` (ringmux's, or a relay's) with `args`.
    async fn curl(&self, port: u16, args: &[&str]) -> Result<Got, String> {
        let reach = Reach::Name("localhost");
        curl::get(self.rm.dir(), port, reach, None, args, "/", CLIENT_LIMIT).await
    }

    /// curl `/` through a balancer that opens its connection with `header`.
    async fn through(&self, header: &[u8], args: &[&str]) -> Got {
        let relay = relay(self.to(), header.to_vec()).await;
        self.curl(relay, args)
            .await
            .unwrap_or_else(|e| panic!("curl {args:?} through the relay: {e}"))
    }

    /// Waits until the access log has `n` lines, and returns them, each split into fields
    /// (time client protocol method authority path status bytes ...).
    async fn log_lines(&self, n: usize) -> Vec<Vec<String>> {
        self.rm
            .wait_for("the access-log lines", LIMIT, |m| {
                m.sum(names::WORKER_ACCESS_LOG_LINES) >= n as f64
            })
            .await;
        let text = std::fs::read_to_string(self.access_log()).unwrap_or_default();
        let lines: Vec<Vec<String>> = text
            .lines()
            .map(|l| l.split(' ').map(str::to_string).collect())
            .collect();
        assert_eq!(lines.len(), n, "{text}");
        lines
    }
}

/// A balancer for one connection: listens on 127.0.0.1, and connects the client it accepts to
/// `to` from [`RELAY`], writing `header` first; its port.
async fn relay(to: SocketAddr, header: Vec<u8>) -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        let Ok((mut client, _)) = listener.accept().await else {
            return;
        };
        let mut upstream = connect_from(RELAY, to).await;
        upstream.write_all(&header).await.unwrap();
        let _ = tokio::io::copy_bidirectional(&mut client, &mut upstream).await;
    });
    port
}

/// A TCP connection to `to` from the address `from`.
async fn connect_from(from: &str, to: SocketAddr) -> TcpStream {
    let socket = TcpSocket::new_v4().unwrap();
    let from: IpAddr = from.parse().unwrap();
    socket.bind(SocketAddr::new(from, 0)).unwrap();
    socket.connect(to).await.unwrap()
}

/// A version 2 PROXY header (`command` 1: PROXY, 0: LOCAL) from `client`.
fn v2(command: u8, client: SocketAddr, to: SocketAddr) -> Vec<u8> {
    let mut h = b"\r\n\r\n\0\r\nQUIT\n".to_vec();
    let mut body = Vec::new();
    let family = match (client.ip(), to.ip()) {
        (IpAddr::V4(c), IpAddr::V4(t)) => {
            body.extend(c.octets());
            body.extend(t.octets());
            0x11
        }
        (IpAddr::V6(c), t) => {
            body.extend(c.octets());
            body.extend(match t {
                IpAddr::V4(t) => t.to_ipv6_mapped().octets(),
                IpAddr::V6(t) => t.octets(),
            });
            0x21
        }
        _ => panic!("an IPv4 client to an IPv4 address, or an IPv6 client"),
    };
    body.extend(client.port().to_be_bytes());
    body.extend(to.port().to_be_bytes());
    h.extend([0x20 | command, family]);
    h.extend((body.len() as u16).to_be_bytes());
    h.extend(body);
    h
}

/// The access-log line whose client field is `client`.
fn line_of<'a>(lines: &'a [Vec<String>], client: &str) -> &'a [String] {
    lines
        .iter()
        .find(|l| l[1] == client)
        .unwrap_or_else(|| panic!("no access-log line for {client} in {lines:?}"))
}

/// Behind a listed balancer, over HTTP/1.1 and HTTP/2: a version 1 header and a version 2 one
/// (IPv4 and IPv6) give the access log their client; a client within the site's `deny` is
/// refused 403 by the address its header names (the balancer's is not denied); version 2's
/// `LOCAL` keeps the balancer's own address. curl's own `--haproxy-protocol` (version 1) from
/// a listed source is read too. No connection is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listed_balancer_names_the_client() {
    if !tool::CURL.present() {
        return;
    }
    bounded(LIMIT, async {
        let s = Setup::start();
        let to = s.to();
        let mut expected = Vec::new();
        for (i, flag) in [(0u16, "--http1.1"), (1, "--http2")] {
            let port = |n: u16| 40_000 + 10 * i + n;
            let want_version = if i == 0 { "1.1" } else { "2" };
            let v1 = format!("PROXY TCP4 203.0.113.9 127.0.0.1 {} 443\r\n", port(1));
            let got = s.through(v1.as_bytes(), &[flag]).await;
            assert_eq!((got.status, got.version.as_str()), (200, want_version));
            expected.push((format!("203.0.113.9:{}", port(1)), "200"));

            let six: SocketAddr = format!("[2001:db8::9]:{}", port(2)).parse().unwrap();
            let got = s.through(&v2(1, six, to), &[flag]).await;
            assert_eq!(got.status, 200, "{flag} v2 IPv6: {got:?}");
            expected.push((six.to_string(), "200"));

            let denied: SocketAddr = format!("198.51.100.7:{}", port(3)).parse().unwrap();
            let got = s.through(&v2(1, denied, to), &[flag]).await;
            assert_eq!(got.status, 403, "{flag} v2 of a denied client: {got:?}");
            expected.push((denied.to_string(), "403"));

            let v1 = format!("PROXY TCP4 198.51.100.8 127.0.0.1 {} 443\r\n", port(4));
            let got = s.through(v1.as_bytes(), &[flag]).await;
            assert_eq!(got.status, 403, "{flag} v1 of a denied client: {got:?}");
            expected.push((format!("198.51.100.8:{}", port(4)), "403"));

            let health: SocketAddr = "192.0.2.1:1".parse().unwrap();
            let got = s.through(&v2(0, health, to), &[flag]).await;
            assert_eq!(got.status, 200, "{flag} v2 LOCAL: {got:?}");
        }
        let got = s
            .curl(
                s.port(),
                &["--interface", LISTED_CURL, "--haproxy-protocol"],
            )
            .await
            .expect("curl --haproxy-protocol from a listed source");
        assert_eq!(got.status, 200, "{got:?}");

        let lines = s.log_lines(expected.len() + 3).await;
        for (client, status) in &expected {
            assert_eq!(line_of(&lines, client)[6], *status, "{client}: {lines:?}");
        }
        let local: Vec<_> = lines
            .iter()
            .filter(|l| l[1].starts_with(&format!("{RELAY}:")))
            .collect();
        assert_eq!(
            local.len(),
            2,
            "LOCAL keeps the balancer's address: {lines:?}"
        );
        assert!(
            lines
                .iter()
                .any(|l| l[1].starts_with(&format!("{LISTED_CURL}:"))),
            "curl's own header: {lines:?}"
        );
        let denied = |m: &harness::Metrics| {
            m.sum_where("ringmux_worker_requests_refused_total", "reason", "denied")
        };
        let m =
            s.rm.wait_for("four denials", LIMIT, |m| denied(m) >= 4.0)
                .await;
        assert_eq!(denied(&m), 4.0, "{m}");
        assert_eq!(m.sum(REFUSED), 0.0, "{m}");
    })
    .await
}

/// An unlisted source's header is not believed (its bytes are garbage before TLS: the
/// handshake fails), and the same source without one is served and logged under its own
/// address. A listed source is closed, and counted by why, without a header, with one over
/// its bound, with a malformed one, and when it closes within it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unbelieved_and_refused_headers() {
    if !tool::CURL.present() {
        return;
    }
    bounded(LIMIT, async {
        let s = Setup::start();
        let to = s.to();
        let e = s
            .curl(s.port(), &["--haproxy-protocol"])
            .await
            .expect_err("an unlisted source's header is garbage before TLS");
        assert!(!e.is_empty());
        s.rm.wait_for("the TLS failure", LIMIT, |m| {
            m.sum_where(names::WORKER_TCP_ERRORS, "kind", "tls_failed") >= 1.0
        })
        .await;
        let got = s.curl(s.port(), &[]).await.expect("plain curl");
        assert_eq!(got.status, 200);
        let lines = s.log_lines(1).await;
        assert!(lines[0][1].starts_with("127.0.0.1:"), "{lines:?}");

        // Listed, no header: curl's ClientHello is not one.
        s.curl(s.port(), &["--interface", LISTED_CURL])
            .await
            .expect_err("a listed source without a header is closed");
        let why =
            |why: &'static str| move |m: &harness::Metrics| m.sum_where(REFUSED, "why", why) >= 1.0;
        s.rm.wait_for("missing", LIMIT, why("missing")).await;

        let oversize = format!("PROXY TCP4 {} 1 2\r\n", "1".repeat(120));
        let mut bad_version = v2(1, "192.0.2.1:1".parse().unwrap(), to);
        bad_version[12] = 0x31;
        for (bytes, reason) in [
            (oversize.into_bytes(), "oversize"),
            (bad_version, "malformed"),
            (b"PROXY TCP4 192.0.2.1".to_vec(), "closed"),
        ] {
            let mut c = connect_from(RELAY, to).await;
            c.write_all(&bytes).await.unwrap();
            if reason == "closed" {
                c.shutdown().await.unwrap();
            }
            // Refused: the server closes without a byte (or resets, for unread input).
            let mut rest = Vec::new();
            let _ = c.read_to_end(&mut rest).await;
            assert!(rest.is_empty(), "{reason}: {rest:?}");
            s.rm.wait_for(reason, LIMIT, why(reason)).await;
        }
        let m = s.rm.metrics();
        assert_eq!(m.sum_where(REFUSED, "why", "timeout"), 0.0, "{m}");
        assert_eq!(s.log_lines(1).await.len(), 1);
    })
    .await
}
