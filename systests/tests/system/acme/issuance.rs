//! Certificates from ACME, end to end: a real ringmux with a site of `acme = true` and a site of
//! its own certificate, ordering from Pebble (Let's Encrypt's test CA, Debian's `pebble`, on
//! loopback with its DNS server answering every name with 127.0.0.1), whose validator connects
//! to ringmux's own listeners: TLS-ALPN-01 on the HTTPS port, HTTP-01 on the plain-HTTP one.
//! Clients nobody here wrote check what is served: curl over TCP and aioquic over HTTP/3, each
//! verifying the chain against Pebble's root and the name.
//!
//! Pebble missing skips these tests with a loud message, unless `CI` is set.

use std::net::{SocketAddr, TcpListener, UdpSocket};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use harness::{Forward, Ringmux};
use ringmux_demux::metrics::names;
use ringmux_systests::harness;
use ringmux_testkit::aioquic::Json;
use ringmux_testkit::curl;
use ringmux_testkit::pebble::{Pebble, PebbleConfig};
use ringmux_testkit::tool::{self, tail};
use ringmux_testkit::{temp_dir, TempDir};

const CLIENT_TIMEOUT: Duration = Duration::from_secs(60);
/// An order from Pebble takes a second or two here; this bounds every wait for one.
const ORDER_LIMIT: Duration = Duration::from_secs(90);
/// What a.test's `/` answers.
const A_INDEX: &str = "the root of a.test\n";

/// A loopback port free for both TCP and UDP now (ringmux listens on both with one number, and
/// Pebble must be told the TCP one before ringmux starts).
fn free_port() -> u16 {
    for _ in 0..100 {
        let tcp = TcpListener::bind("127.0.0.1:0").expect("a TCP port");
        let port = tcp.local_addr().unwrap().port();
        if UdpSocket::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no port free for both TCP and UDP in 100 tries");
}

/// A folder every user may read: the workers run as nobody when the tests run as root.
fn open_folder(path: &Path) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(path).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
}

/// The files of one test: the sites' roots, b.test's own certificate, Pebble's API root.
struct Setup {
    dir: TempDir,
    pebble: Pebble,
    port: u16,
    http_port: u16,
}

impl Setup {
    /// Pebble for a ringmux on `port` (TCP, TLS-ALPN-01) and `http_port` (plain HTTP,
    /// HTTP-01); `None` when Pebble is not installed (and `CI` not set).
    fn new(tls_port_for_pebble: Option<u16>) -> Option<Setup> {
        Setup::with_eab(tls_port_for_pebble, None)
    }

    /// As [`Setup::new`], Pebble requiring the external account binding `eab`.
    fn with_eab(
        tls_port_for_pebble: Option<u16>,
        eab: Option<(&'static str, &'static str)>,
    ) -> Option<Setup> {
        let port = free_port();
        let http_port = free_port();
        let mut config = PebbleConfig::new(http_port, tls_port_for_pebble.unwrap_or(port));
        config.eab = eab;
        // Every order validates again: a renewal is tested on the wire.
        config.authz_reuse = 0;
        let pebble = Pebble::start_with(config)?;
        let dir = temp_dir("ringmux-acme");
        let d = dir.path();
        open_folder(d);
        open_folder(&d.join("a"));
        open_folder(&d.join("b"));
        std::fs::write(d.join("a/index.html"), A_INDEX).unwrap();
        std::fs::write(d.join("b/index.html"), "the root of b.test\n").unwrap();
        std::fs::write(d.join("pebble-api.pem"), pebble.api_root_pem()).unwrap();
        std::fs::write(d.join("issuer.pem"), pebble.issuer_root_pem()).unwrap();
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec!["b.test".to_string()])
            .unwrap()
            .self_signed(&key)
            .unwrap();
        std::fs::write(d.join("b.pem"), cert.pem()).unwrap();
        std::fs::write(d.join("b.key"), key.serialize_pem()).unwrap();
        Some(Setup {
            dir,
            pebble,
            port,
            http_port,
        })
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// The configuration file: a.test and www.a.test by ACME over `challenge`, from
    /// `directory` (Pebble's unless given), b.test with its own certificate; state in
    /// `state` under the test's folder.
    fn config(&self, challenge: &str, directory: Option<&str>, state: &str) -> PathBuf {
        self.config_with(challenge, directory, state, "")
    }

    /// As [`Setup::config`], with `more` (further `[[site]]`s) at the end.
    fn config_with(
        &self,
        challenge: &str,
        directory: Option<&str>,
        state: &str,
        more: &str,
    ) -> PathBuf {
        let d = self.dir.path().display();
        let text = format!(
            r#"redirect_http = "127.0.0.1:{http}"
[acme]
directory = "{directory}"
email = "ops@a.test"
state = "{d}/{state}"
challenge = "{challenge}"
ca_roots = "{d}/pebble-api.pem"

[[site]]
names = ["a.test", "www.a.test"]
acme = true
  [[site.route]]
  path = "/"
  root = "{d}/a"

[[site]]
names = ["b.test"]
cert = "{d}/b.pem"
key = "{d}/b.key"
  [[site.route]]
  path = "/"
  root = "{d}/b"
{more}"#,
            http = self.http_port,
            directory = directory.map_or_else(|| self.pebble.directory_url(), str::to_string),
        );
        let path = self.path(&format!("ringmux-{state}.toml"));
        std::fs::write(&path, text).unwrap();
        path
    }

    /// A ringmux of the setup's: one key file for every start, as a deployment keeps its own
    /// (the seals of the ACME state directory's files are made with a key derived from it).
    fn start(&self, config: &Path) -> Ringmux {
        let listen = SocketAddr::from(([127, 0, 0, 1], self.port)).to_string();
        let key_file = self.dir.path().join("keys");
        if !key_file.exists() {
            ringmux_quic_lb::KeySet::generate()
                .unwrap()
                .write_new(&key_file)
                .unwrap();
        }
        Ringmux::start(
            2,
            Forward::Shm,
            &[
                "--config",
                config.to_str().unwrap(),
                "--listen",
                &listen,
                "--key-file",
                key_file.to_str().unwrap(),
            ],
        )
    }
}

/// Waits until a.test serves a certificate (the metrics show its expiry), or the bound passes.
async fn issued(rm: &Ringmux) {
    rm.wait_for(
        "a.test's certificate from Pebble (ringmux_certificate_expiry_seconds{site=\"a.test\"})",
        ORDER_LIMIT,
        |m| {
            m.samples(names::CERTIFICATE_EXPIRY)
                .iter()
                .any(|(labels, _)| labels.iter().any(|(k, v)| k == "site" && v == "a.test"))
        },
    )
    .await;
}

/// What a client was served.
#[derive(Debug)]
struct Served {
    status: u16,
    body: String,
    /// The leaf's serial, lower-case hex without leading zeros or colons.
    serial: String,
}

fn serial_text(s: &str) -> String {
    let hex: String = s
        .chars()
        .filter(|c| c.is_ascii_hexdigit())
        .collect::<String>()
        .to_ascii_lowercase();
    let trimmed = hex.trim_start_matches('0');
    if trimmed.is_empty() {
        "0".into()
    } else {
        trimmed.into()
    }
}

/// curl over TCP (HTTP/2) for `name` on `rm`, verifying the chain against Pebble's root.
async fn curl(setup: &Setup, rm: &Ringmux, name: &str) -> Result<Served, String> {
    let port = rm.listen.port();
    let issuer = setup.path("issuer.pem");
    let reach = curl::Reach::Name(name);
    let args = ["--http2"];
    let got = curl::get(
        rm.dir(),
        port,
        reach,
        Some(&issuer),
        &args,
        "/",
        CLIENT_TIMEOUT,
    )
    .await?;
    let serial = got
        .serial
        .as_deref()
        .map(serial_text)
        .ok_or_else(|| format!("no serial number in curl's %{{certs}}: {got:?}"))?;
    Ok(Served {
        status: got.status,
        body: got.body,
        serial,
    })
}

/// aioquic over HTTP/3 for `name` on `rm`, verifying the chain against Pebble's root.
async fn aioquic(setup: &Setup, rm: &Ringmux, name: &str) -> Result<Served, String> {
    let args: Vec<String> = vec![
        ringmux_testkit::aioquic::script()
            .to_string_lossy()
            .into_owned(),
        "127.0.0.1".into(),
        rm.listen.port().to_string(),
        "paths".into(),
        "--server-name".into(),
        name.into(),
        "--ca-certs".into(),
        setup.path("issuer.pem").display().to_string(),
        "--path".into(),
        "/".into(),
    ];
    let out = tool::run("python3", &args, rm.dir(), CLIENT_TIMEOUT).await;
    let j: Json = ringmux_testkit::aioquic::result(&out.stdout).ok_or_else(|| {
        format!(
            "aioquic: no result in {:?}: {}",
            out.stdout,
            tail(&out.stderr, 20)
        )
    })?;
    if j["ok"] != Json::Bool(true) {
        return Err(format!("aioquic: {}", j["error"]));
    }
    let summary = j["bodies"][0].as_str().unwrap_or_default();
    Ok(Served {
        status: summary
            .split(' ')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or(0),
        body: j["texts"][0].as_str().unwrap_or_default().to_string(),
        serial: serial_text(j["peer"]["serial"].as_str().unwrap_or_default()),
    })
}

/// Our own quinn HTTP/3 client, a new connection with a full handshake (a fresh session
/// cache), verifying the chain against Pebble's root and the name.
async fn quinn(setup: &Setup, rm: &Ringmux, name: &str) -> Result<Served, String> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::CertificateDer;
    let roots: Vec<CertificateDer<'static>> =
        CertificateDer::pem_file_iter(setup.path("issuer.pem"))
            .map_err(|e| e.to_string())?
            .collect::<Result<_, _>>()
            .map_err(|e| e.to_string())?;
    let config = ringmux_testkit::client::client_config(Some(&roots)).map_err(|e| e.to_string())?;
    let client =
        ringmux_testkit::client::H3Client::new(config, rm.listen).map_err(|e| e.to_string())?;
    let conn = client
        .connect(rm.listen, name)
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let serial = conn
        .quic()
        .peer_identity()
        .and_then(|id| id.downcast::<Vec<CertificateDer<'static>>>().ok())
        .and_then(|chain| {
            let leaf = chain.first()?;
            let (_, cert) = x509_parser::parse_x509_certificate(leaf).ok()?;
            Some(serial_text(&cert.raw_serial_as_string()))
        })
        .ok_or("no peer certificate")?;
    let resp = conn
        .get_body("/")
        .await
        .map_err(|e| format!("GET /: {e}"))?;
    let body = resp
        .body
        .map(|b| String::from_utf8_lossy(&b).into_owned())
        .unwrap_or_default();
    client.close().await;
    Ok(Served {
        status: resp.status.as_u16(),
        body,
        serial,
    })
}

/// a.test's two names on both transports: 200, its root, one serial; returns the serial.
async fn served_on_both(setup: &Setup, rm: &Ringmux) -> String {
    let mut serials = Vec::new();
    for name in ["a.test", "www.a.test"] {
        for (transport, got) in [
            ("curl (TCP)", curl(setup, rm, name).await),
            ("aioquic (HTTP/3)", aioquic(setup, rm, name).await),
            ("quinn (HTTP/3)", quinn(setup, rm, name).await),
        ] {
            let got = got.unwrap_or_else(|e| panic!("{transport} for {name}: {e}"));
            assert_eq!(
                (got.status, got.body.as_str()),
                (200, A_INDEX),
                "{transport} for {name}"
            );
            serials.push(got.serial);
        }
    }
    serials.dedup();
    assert_eq!(
        serials.len(),
        1,
        "one certificate on both transports: {serials:?}"
    );
    serials.remove(0)
}

fn skip(what: &str) {
    eprintln!("SKIPPED {what}: pebble is not installed (apt-get install pebble)");
}

fn orders(rm: &Ringmux, result: &str) -> f64 {
    rm.metrics().sum_where(names::ACME_ORDERS, "result", result)
}

/// TLS-ALPN-01 on the HTTPS listener: the site is issued at start, both names verify on both
/// transports; the site with a certificate of its own served all along. Then a restart with
/// the same state serves the stored certificate without ordering.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_site_is_issued_over_tls_alpn_01_and_a_restart_reuses_it() {
    let Some(setup) = Setup::new(None) else {
        return skip("a_site_is_issued_over_tls_alpn_01_and_a_restart_reuses_it");
    };
    let config = setup.config("tls-alpn-01", None, "state");
    let rm = setup.start(&config);
    // b.test serves its own certificate whatever ACME does.
    let b = curl_insecure(&rm, "b.test").await;
    assert_eq!(b, 200, "b.test while a.test is ordered");
    issued(&rm).await;
    let serial = served_on_both(&setup, &rm).await;
    assert_eq!(orders(&rm, "issued"), 1.0, "{}", rm.log_tail(30));
    let log = rm.log_tail(400);
    assert!(
        log.contains("a.test"),
        "a log line for the order of a.test:\n{log}"
    );
    drop(rm);

    let rm = setup.start(&config);
    // The stored certificate is in the first workers' hand-off: no wait for an order.
    assert_eq!(
        served_on_both(&setup, &rm).await,
        serial,
        "the stored certificate"
    );
    assert_eq!(orders(&rm, "issued"), 0.0, "a restart orders nothing");

    // `ringmux stats` shows the days left per name (Pebble's certificates last five years).
    let stats = ringmux(&rm, &["stats", "--metrics", &rm.metrics.to_string()]).await;
    let line = stats
        .stdout
        .lines()
        .find(|l| l.starts_with("certificates:"))
        .unwrap_or_else(|| panic!("no certificates line in ringmux stats:\n{}", stats.stdout))
        .to_string();
    for name in ["a.test (a.test)", "www.a.test (a.test)", "b.test (b.test)"] {
        assert!(line.contains(name), "{name} in {line:?}");
    }
    let days: Vec<u64> = line
        .split(|c: char| !c.is_ascii_digit())
        .filter_map(|n| n.parse().ok())
        .collect();
    assert!(
        days.iter().any(|d| (1800..=1830).contains(d)),
        "about 1826 days left for a.test in {line:?}"
    );

    // An upgrade of the demux in place starts the engine anew from the stored certificate.
    let up = ringmux(
        &rm,
        &[
            "upgrade",
            "--control-socket",
            &rm.control_socket().display().to_string(),
            "--timeout",
            "60",
        ],
    )
    .await;
    assert!(up.success, "ringmux upgrade: {}{}", up.stdout, up.stderr);
    assert_eq!(
        served_on_both(&setup, &rm).await,
        serial,
        "after the upgrade"
    );
    assert_eq!(orders(&rm, "issued"), 0.0, "an upgrade orders nothing");
}

/// `ringmux ARGS…` run to its end.
async fn ringmux(rm: &Ringmux, args: &[&str]) -> tool::Output {
    let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    tool::run(
        harness::binary("ringmux").to_str().unwrap(),
        &args,
        rm.dir(),
        ORDER_LIMIT,
    )
    .await
}

/// `ringmux check --online` fetches the CA's directory over the roots the ACME client would
/// trust: with Pebble's root in `ca_roots` it answers; with another root, the check fails and
/// names `ca_roots` and its file, where the fix is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_online_reaches_the_directory_and_names_wrong_roots() {
    let Some(setup) = Setup::new(None) else {
        return skip("check_online_reaches_the_directory_and_names_wrong_roots");
    };
    let config = setup.config("http-01", None, "online");
    let check = |config: &Path| {
        let args: Vec<String> = ["check", "--online", "--config", config.to_str().unwrap()]
            .iter()
            .map(|a| a.to_string())
            .collect();
        let dir = setup.dir.path().to_owned();
        async move {
            tool::run(
                harness::binary("ringmux").to_str().unwrap(),
                &args,
                &dir,
                ORDER_LIMIT,
            )
            .await
        }
    };
    let ok = check(&config).await;
    assert!(ok.success, "{}{}", ok.stdout, ok.stderr);
    let directory = setup.pebble.directory_url();
    assert!(
        ok.stdout
            .contains(&format!("the directory {directory} answers")),
        "{}",
        ok.stdout
    );
    // Without --online nothing is fetched, and nothing is said of the directory's answer.
    let args = vec![
        "check".to_string(),
        "--config".into(),
        config.display().to_string(),
    ];
    let offline = tool::run(
        harness::binary("ringmux").to_str().unwrap(),
        &args,
        setup.dir.path(),
        ORDER_LIMIT,
    )
    .await;
    assert!(
        offline.success && !offline.stdout.contains("answers"),
        "{}",
        offline.stdout
    );

    // Another root in ca_roots: Pebble's certificate is not trusted.
    let wrong = setup.path("wrong-roots.pem");
    let other = rcgen::generate_simple_self_signed(vec!["other.test".to_string()]).unwrap();
    std::fs::write(&wrong, other.cert.pem()).unwrap();
    let text = std::fs::read_to_string(&config)
        .unwrap()
        .replace("pebble-api.pem", "wrong-roots.pem");
    let bad = setup.path("ringmux-wrong-roots.toml");
    std::fs::write(&bad, text).unwrap();
    let refused = check(&bad).await;
    assert!(!refused.success, "{}", refused.stdout);
    let wrong = wrong.display().to_string();
    assert!(
        refused
            .stderr
            .contains(&format!("[acme] ca_roots ({wrong})"))
            && refused.stderr.contains("TLS with"),
        "{}",
        refused.stderr
    );
}

/// HTTP-01 on the plain-HTTP listener.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_site_is_issued_over_http_01() {
    let Some(setup) = Setup::new(None) else {
        return skip("a_site_is_issued_over_http_01");
    };
    let rm = setup.start(&setup.config("http-01", None, "state"));
    issued(&rm).await;
    served_on_both(&setup, &rm).await;
    assert_eq!(orders(&rm, "issued"), 1.0);
}

/// b.test over TCP with any certificate: its status.
async fn curl_insecure(rm: &Ringmux, name: &str) -> u16 {
    let port = rm.listen.port();
    let args: Vec<String> = [
        "-sS",
        "-k",
        "--max-time",
        "20",
        "-o",
        "/dev/null",
        "-w",
        "%{http_code}",
        "--resolve",
    ]
    .map(String::from)
    .into_iter()
    .chain([
        format!("{name}:{port}:127.0.0.1"),
        format!("https://{name}:{port}/"),
    ])
    .collect();
    let out = tool::run("curl", &args, rm.dir(), CLIENT_TIMEOUT).await;
    out.stdout.trim().parse().unwrap_or(0)
}

/// `ringmux acme renew a.test` under a load of TCP and HTTP/3 requests that verify every
/// chain: no request fails, and once it exits 0 both transports serve the new serial.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forced_renewal_under_load_fails_no_request() {
    let Some(setup) = Setup::new(None) else {
        return skip("a_forced_renewal_under_load_fails_no_request");
    };
    let rm = setup.start(&setup.config("tls-alpn-01", None, "state"));
    issued(&rm).await;
    let old = served_on_both(&setup, &rm).await;

    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let load = |client: u8| {
        let stop = stop.clone();
        let (setup, rm) = (&setup, &rm);
        async move {
            let mut served = Vec::new();
            // Bounded: at most 300 requests or until the renewal is over.
            for _ in 0..300 {
                if stop.load(std::sync::atomic::Ordering::Relaxed) {
                    break;
                }
                let got = match client {
                    0 => curl(setup, rm, "a.test").await,
                    1 => aioquic(setup, rm, "a.test").await,
                    _ => quinn(setup, rm, "a.test").await,
                };
                served.push(got);
            }
            served
        }
    };
    let renew = async {
        let out = tool::run(
            harness::binary("ringmux").to_str().unwrap(),
            &[
                "acme".into(),
                "renew".into(),
                "a.test".into(),
                "--control-socket".into(),
                rm.control_socket().display().to_string(),
                "--timeout".into(),
                "80".into(),
            ],
            rm.dir(),
            ORDER_LIMIT,
        )
        .await;
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        out
    };
    let (out, tcp, aioquic_h3, quinn_h3) = tokio::join!(renew, load(0), load(1), load(2));
    assert!(
        out.success,
        "ringmux acme renew: {}{}\n{}",
        out.stdout,
        out.stderr,
        rm.log_tail(40)
    );
    assert!(out.stdout.contains("ok: renewed a.test"), "{}", out.stdout);
    for (transport, served) in [
        ("curl (TCP)", &tcp),
        ("aioquic (HTTP/3)", &aioquic_h3),
        ("quinn (HTTP/3)", &quinn_h3),
    ] {
        assert!(
            !served.is_empty(),
            "no {transport} request ran during the renewal"
        );
        for s in served {
            let s = s
                .as_ref()
                .unwrap_or_else(|e| panic!("a {transport} request during the renewal: {e}"));
            assert_eq!((s.status, s.body.as_str()), (200, A_INDEX), "{transport}");
        }
    }
    let new = served_on_both(&setup, &rm).await;
    assert_ne!(new, old, "the renewal's certificate is served");
    let said = out
        .stdout
        .split_once("(serial ")
        .and_then(|(_, rest)| rest.split_once(')'))
        .map(|(serial, _)| serial_text(serial));
    assert_eq!(
        said.as_deref(),
        Some(new.as_str()),
        "ringmux acme renew names the new serial: {}",
        out.stdout
    );
    eprintln!(
        "renewal under load: {} curl (TCP), {} aioquic and {} quinn (HTTP/3) requests, each on \
         a new connection, none failed; serial {old} -> {new}",
        tcp.len(),
        aioquic_h3.len(),
        quinn_h3.len()
    );
}

/// Challenges reach the workers only when a demux sealed them and they are for a name of an
/// ACME site: with the CA down (no order of ringmux's own), three files are planted in the
/// running ringmux's state folder, as a worker sharing its user could: one without a seal for
/// a.test, one sealed (with the deployment's key, as another node's demux seals) for evil.test,
/// a name no site has, and one sealed for a.test. Only the last is answered over HTTP-01; the
/// other two are counted in `ringmux_acme_state_refused_total` and never answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_sealed_challenges_for_the_sites_names_are_answered() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Some(setup) = Setup::new(None) else {
        return skip("only_sealed_challenges_for_the_sites_names_are_answered");
    };
    let directory = format!("https://127.0.0.1:{}/dir", free_port());
    let config = setup.config("http-01", Some(&directory), "planted");
    let rm = setup.start(&config);
    let key_file = setup.path("keys");
    let keys = ringmux_demux::certs::load_key_file(&key_file).unwrap();
    let secret = ringmux_acme::seal::KeyFileSecret::new(key_file.clone(), keys.to_bytes());
    let sealer = ringmux_acme::seal::Sealer::from_key_file(&secret);
    let challenges = setup.path("planted/challenges");
    let expires = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
        + 3600;
    let plant = |token: &str, name: &str, sealed: bool| {
        let json = format!(
            r#"{{"kind":"http-01","name":"{name}","token":"{token}","key_authorization":"{token}.thumb","expires":{expires}}}"#
        );
        let place = format!("challenges/{token}.json");
        let bytes = if sealed {
            sealer.seal(&place, json.as_bytes())
        } else {
            json.into_bytes()
        };
        let tmp = challenges.join(format!(".{token}.planting"));
        std::fs::write(&tmp, bytes).unwrap();
        std::fs::rename(&tmp, challenges.join(format!("{token}.json"))).unwrap();
    };
    plant("plain-token", "a.test", false);
    plant("evil-token", "evil.test", true);
    plant("good-token", "a.test", true);
    let http = SocketAddr::from(([127, 0, 0, 1], setup.http_port));
    // The status and body of GET /.well-known/acme-challenge/TOKEN with `host`.
    let ask = |token: &'static str, host: &'static str| async move {
        let mut s = tokio::net::TcpStream::connect(http).await.unwrap();
        let head = format!(
            "GET /.well-known/acme-challenge/{token} HTTP/1.1\r\nhost: {host}\r\n\
             connection: close\r\n\r\n"
        );
        s.write_all(head.as_bytes()).await.unwrap();
        let mut answer = Vec::new();
        s.read_to_end(&mut answer).await.unwrap();
        String::from_utf8_lossy(&answer).into_owned()
    };
    // The sealed challenge for a.test reaches the workers (so the others had the time to).
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let got = ask("good-token", "a.test").await;
        if got.starts_with("HTTP/1.1 200") {
            assert!(got.ends_with("good-token.thumb"), "{got}");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the sealed challenge never answered: {got}\n{}",
            rm.log_tail(40)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let m = rm
        .wait_for("the planted challenges counted", ORDER_LIMIT, |m| {
            m.sum_where(names::ACME_STATE_REFUSED, "file", "challenge") >= 1.0
                && m.sum_where(names::ACME_STATE_REFUSED, "file", "foreign-challenge") >= 1.0
        })
        .await;
    assert_eq!(
        m.sum_where(names::ACME_STATE_REFUSED, "file", "certificate"),
        0.0
    );
    for (token, host) in [
        ("plain-token", "a.test"),
        ("evil-token", "evil.test"),
        ("evil-token", "a.test"),
    ] {
        let got = ask(token, host).await;
        assert!(!got.starts_with("HTTP/1.1 200"), "{token} {host}: {got}");
        assert!(!got.contains(".thumb"), "{token} {host}: {got}");
    }
    // The log thread writes the line when it gets to it: waited for, not read once.
    rm.wait_for_log("the refusal logged", ORDER_LIMIT, |log| {
        log.contains("refused") && log.contains("plain-token.json")
    })
    .await;
}

/// The CA unreachable at start, and a challenge that fails: the other site serves, the failure
/// is logged with its reason and counted, the ACME site's handshakes fail meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ca_down_or_a_failed_challenge_leaves_the_other_sites_serving() {
    // Pebble's validator pointed at a port nothing listens on: every challenge fails.
    let closed = free_port();
    let Some(setup) = Setup::new(Some(closed)) else {
        return skip("a_ca_down_or_a_failed_challenge_leaves_the_other_sites_serving");
    };
    for (what, directory, state) in [
        (
            "the CA down",
            Some(format!("https://127.0.0.1:{}/dir", free_port())),
            "down",
        ),
        ("a failed challenge", None, "refused"),
    ] {
        let config = setup.config("tls-alpn-01", directory.as_deref(), state);
        let rm = setup.start(&config);
        rm.wait_for(
            &format!("{what}: a failed order counted"),
            ORDER_LIMIT,
            |m| m.sum_where(names::ACME_ORDERS, "result", "failed") >= 1.0,
        )
        .await;
        assert_eq!(
            curl_insecure(&rm, "b.test").await,
            200,
            "{what}: b.test serves"
        );
        let a = curl(&setup, &rm, "a.test").await;
        assert!(a.is_err(), "{what}: a.test has no certificate yet: {a:?}");
        let deadline = Instant::now() + Duration::from_secs(10);
        let log = loop {
            let log = rm.log_tail(400);
            if log.contains("a.test") && (log.contains("WARN") || log.contains("ERROR"))
                || Instant::now() > deadline
            {
                break log;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        assert!(
            log.lines()
                .any(|l| l.contains("a.test") && (l.contains("WARN") || l.contains("ERROR"))),
            "{what}: a log line naming the site and the failure:\n{log}"
        );
        eprintln!("{what}: {}", tail(&log, 3));
    }
}

/// A reload that adds an ACME site: the engine orders its certificate while the running sites
/// serve on, and every worker serves it once issued, without another reload.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_adds_an_acme_site() {
    let Some(setup) = Setup::new(None) else {
        return skip("a_reload_adds_an_acme_site");
    };
    let config = setup.config("tls-alpn-01", None, "state");
    let rm = setup.start(&config);
    issued(&rm).await;
    let serial = served_on_both(&setup, &rm).await;
    open_folder(&setup.path("c"));
    std::fs::write(setup.path("c/index.html"), A_INDEX).unwrap();
    let c_site = format!(
        "\n[[site]]\nnames = [\"c.test\"]\nacme = true\n  [[site.route]]\n  path = \"/\"\n  \
         root = \"{}\"\n",
        setup.path("c").display()
    );
    // The same file, rewritten: ringmux reload reads the path it started with.
    let again = setup.config_with("tls-alpn-01", None, "state", &c_site);
    assert_eq!(again, config);
    let out = ringmux(
        &rm,
        &[
            "reload",
            "--control-socket",
            &rm.control_socket().display().to_string(),
            "--timeout",
            "60",
        ],
    )
    .await;
    assert!(out.success, "ringmux reload: {}{}", out.stdout, out.stderr);
    rm.wait_for("c.test's certificate from Pebble", ORDER_LIMIT, |m| {
        m.samples(names::CERTIFICATE_EXPIRY)
            .iter()
            .any(|(labels, _)| labels.iter().any(|(k, v)| k == "site" && v == "c.test"))
    })
    .await;
    for (transport, got) in [
        ("curl (TCP)", curl(&setup, &rm, "c.test").await),
        ("quinn (HTTP/3)", quinn(&setup, &rm, "c.test").await),
    ] {
        let got = got.unwrap_or_else(|e| panic!("{transport} for c.test: {e}"));
        assert_eq!(
            (got.status, got.body.as_str()),
            (200, A_INDEX),
            "{transport}"
        );
        assert_ne!(
            got.serial, serial,
            "{transport}: c.test has a certificate of its own"
        );
    }
    // a.test kept its certificate through the reload.
    assert_eq!(served_on_both(&setup, &rm).await, serial);
    assert_eq!(orders(&rm, "issued"), 2.0);
}

/// A CA that requires an external account binding: with the key ID and MAC key it gave, the
/// site is issued; with a wrong MAC key the account is refused, counted and logged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_external_account_binding_is_given_to_a_ca_that_requires_one() {
    const KID: &str = "kid-1";
    const KEY: &str = "zWNDZM6eQGHWpSRTPal5eIUYFTu7EajVIoguysqZ9wG44nMEtx3MUAsUDkMTQ12W";
    let Some(setup) = Setup::with_eab(None, Some((KID, KEY))) else {
        return skip("an_external_account_binding_is_given_to_a_ca_that_requires_one");
    };
    let with_eab = |state: &str, key: &str| {
        let path = setup.config("tls-alpn-01", None, state);
        let text = std::fs::read_to_string(&path).unwrap().replace(
            "challenge = ",
            &format!("eab_kid = \"{KID}\"\neab_hmac_key = \"{key}\"\nchallenge = "),
        );
        std::fs::write(&path, text).unwrap();
        path
    };
    let wrong = KEY.replace('z', "y");
    let rm = setup.start(&with_eab("wrong", &wrong));
    rm.wait_for("a refused account counted", ORDER_LIMIT, |m| {
        m.sum_where(names::ACME_ORDERS, "result", "failed") >= 1.0
    })
    .await;
    assert!(curl(&setup, &rm, "a.test").await.is_err(), "no certificate");
    let log = rm.log_tail(400);
    let refused = log
        .lines()
        .find(|l| l.contains("WARN") && l.contains("a.test"))
        .unwrap_or_else(|| panic!("no failure logged for a.test:\n{log}"));
    eprintln!("a wrong MAC key: {refused}");
    assert!(
        refused.to_ascii_lowercase().contains("account"),
        "the failure names the account: {refused}"
    );
    drop(rm);

    let rm = setup.start(&with_eab("right", KEY));
    issued(&rm).await;
    served_on_both(&setup, &rm).await;
    assert_eq!(orders(&rm, "issued"), 1.0);
}
