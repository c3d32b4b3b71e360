//! Pebble, Let's Encrypt's ACME test CA (Debian's `pebble`), with its DNS server
//! (`pebble-challtestsrv`) answering every name with 127.0.0.1, on free loopback ports: the CA
//! the ACME tests order from.
//!
//! Pebble's validator connects to `httpPort` (HTTP-01) and `tlsPort` (TLS-ALPN-01) of the
//! name under validation, which the DNS server sends to 127.0.0.1: the test binds its
//! challenge responders first and passes their ports. Pebble's own HTTPS (the ACME API and the
//! management interface) uses a certificate made here, under a root made here
//! ([`Pebble::api_root_der`], for the client to trust); the certificates it issues chain to
//! another root, new with every start ([`Pebble::issuer_root_pem`]).
//!
//! Pebble refuses [`PebbleConfig::nonce_reject`] percent of good nonces with `badNonce`
//! (5 by default, as Pebble itself): clients must retry, and these tests show that they do.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::tool::{self, Tool};
use crate::TempDir;

/// Pebble and its DNS server (Debian's `pebble` package has both).
pub const PEBBLE: Tool = Tool {
    program: "pebble",
    probe: &["-h"],
    install: "apt-get install pebble",
};

pub const PEBBLE_CHALLTESTSRV: Tool = Tool {
    program: "pebble-challtestsrv",
    probe: &["-h"],
    install: "apt-get install pebble",
};

/// How long Pebble and its DNS server may take to answer after they start.
const START_LIMIT: Duration = Duration::from_secs(30);

/// What a test chooses of Pebble.
#[derive(Clone, Copy, Debug)]
pub struct PebbleConfig {
    /// Where Pebble's validator connects for HTTP-01.
    pub http_port: u16,
    /// Where it connects for TLS-ALPN-01.
    pub tls_port: u16,
    /// `PEBBLE_WFE_NONCEREJECT`: the percentage of good nonces refused.
    pub nonce_reject: u8,
    /// `PEBBLE_AUTHZREUSE`: the percentage of orders that reuse a valid authorization of the
    /// same account (Pebble's default is 50; 0 makes every order validate again).
    pub authz_reuse: u8,
    /// External account binding required, with this key ID and MAC key (base64url), the only
    /// one Pebble knows; `None`: not required.
    pub eab: Option<(&'static str, &'static str)>,
}

impl PebbleConfig {
    pub fn new(http_port: u16, tls_port: u16) -> PebbleConfig {
        PebbleConfig {
            http_port,
            tls_port,
            nonce_reject: 5,
            authz_reuse: 50,
            eab: None,
        }
    }
}

/// A running Pebble and DNS server, killed on drop.
pub struct Pebble {
    dir: TempDir,
    pebble: Child,
    dns: Child,
    listen: SocketAddr,
    management: SocketAddr,
    api_root_pem: String,
    api_root_der: Vec<u8>,
}

impl Pebble {
    /// Starts Pebble for a server whose HTTP-01 responder listens on `http_port` and whose
    /// TLS-ALPN-01 responder on `tls_port` (both on 127.0.0.1), with Pebble's defaults
    /// otherwise. `None` (the test must skip, which was said on stderr) where Pebble is not
    /// installed and `CI` is not set.
    pub fn start(http_port: u16, tls_port: u16) -> Option<Pebble> {
        Pebble::start_with(PebbleConfig::new(http_port, tls_port))
    }

    /// # Panics
    /// If either program does not answer within 30 seconds, or the files cannot be written.
    pub fn start_with(config: PebbleConfig) -> Option<Pebble> {
        if !PEBBLE.present() || !PEBBLE_CHALLTESTSRV.present() {
            return None;
        }
        let dir = crate::temp_dir("ringmux-pebble");
        let (api_root_pem, api_root_der, cert_pem, key_pem) = api_certificate();
        let write = |name: &str, text: &str| {
            let path = dir.path().join(name);
            std::fs::write(&path, text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            path
        };
        let cert = write("api-cert.pem", &cert_pem);
        let key = write("api-key.pem", &key_pem);

        let dns_port = free_udp_and_tcp_port();
        let dns_management = free_port();
        let dns = spawn(
            Command::new(PEBBLE_CHALLTESTSRV.program)
                .args(["-defaultIPv4", "127.0.0.1", "-defaultIPv6", ""])
                .args(["-dns01", &format!("127.0.0.1:{dns_port}")])
                .args(["-http01", "", "-https01", "", "-tlsalpn01", ""])
                .args(["-management", &format!("127.0.0.1:{dns_management}")]),
            dir.path(),
            "challtestsrv",
        );

        let listen: SocketAddr = ([127, 0, 0, 1], free_port()).into();
        let management: SocketAddr = ([127, 0, 0, 1], free_port()).into();
        let json = serde_json::json!({
            "pebble": {
                "listenAddress": listen.to_string(),
                "managementListenAddress": management.to_string(),
                "certificate": cert,
                "privateKey": key,
                "httpPort": config.http_port,
                "tlsPort": config.tls_port,
                "ocspResponderURL": "",
                "externalAccountBindingRequired": config.eab.is_some(),
                "externalAccountMACKeys": config
                    .eab
                    .map(|(kid, key)| serde_json::json!({ kid: key }))
                    .unwrap_or_else(|| serde_json::json!({})),
            }
        });
        let cfg = write("pebble.json", &json.to_string());
        let pebble = spawn(
            Command::new(PEBBLE.program)
                .arg("-config")
                .arg(&cfg)
                .args(["-dnsserver", &format!("127.0.0.1:{dns_port}")])
                .env("PEBBLE_VA_NOSLEEP", "1")
                .env("PEBBLE_WFE_NONCEREJECT", config.nonce_reject.to_string())
                .env("PEBBLE_AUTHZREUSE", config.authz_reuse.to_string()),
            dir.path(),
            "pebble",
        );
        let mut p = Pebble {
            dir,
            pebble,
            dns,
            listen,
            management,
            api_root_pem,
            api_root_der,
        };
        p.wait_until_answering(&[([127, 0, 0, 1], dns_management).into(), listen, management]);
        Some(p)
    }

    /// The ACME directory.
    pub fn directory_url(&self) -> String {
        format!("https://{}/dir", self.listen)
    }

    /// The root of Pebble's own HTTPS certificate (the ACME API's and the management's), to
    /// trust as the CA's.
    pub fn api_root_pem(&self) -> &str {
        &self.api_root_pem
    }

    pub fn api_root_der(&self) -> Vec<u8> {
        self.api_root_der.clone()
    }

    /// The root the certificates Pebble issues chain to (`GET /roots/0` of the management
    /// interface; new with every start of Pebble).
    ///
    /// # Panics
    /// If the management interface does not answer it.
    pub fn issuer_root_pem(&self) -> String {
        let body = https_get(self.management, "/roots/0", &self.api_root_der)
            .unwrap_or_else(|e| panic!("GET https://{}/roots/0: {e}", self.management));
        assert!(
            body.contains("BEGIN CERTIFICATE"),
            "GET /roots/0 answered {body:?}"
        );
        body
    }

    /// The last lines of both programs' output, for a failing test's message.
    pub fn log(&self) -> String {
        let read = |name: &str| {
            let text = std::fs::read(self.dir.path().join(name)).unwrap_or_default();
            tool::tail(&String::from_utf8_lossy(&text), 30)
        };
        format!(
            "--- pebble ---\n{}\n--- pebble-challtestsrv ---\n{}",
            read("pebble.log"),
            read("challtestsrv.log")
        )
    }

    /// Polls the ports until each accepts a connection; fails the test with the programs'
    /// output if either exits or the deadline passes.
    fn wait_until_answering(&mut self, addrs: &[SocketAddr]) {
        let deadline = Instant::now() + START_LIMIT;
        for addr in addrs {
            loop {
                if TcpStream::connect_timeout(addr, Duration::from_millis(200)).is_ok() {
                    break;
                }
                let exited = [
                    ("pebble", &mut self.pebble),
                    ("challtestsrv", &mut self.dns),
                ]
                .into_iter()
                .find_map(|(name, child)| Some((name, child.try_wait().ok()??)));
                if let Some((name, status)) = exited {
                    panic!("{name} exited ({status}) at start\n{}", self.log());
                }
                assert!(
                    Instant::now() < deadline,
                    "{addr} does not answer {START_LIMIT:?} after Pebble started\n{}",
                    self.log()
                );
                // Waiting for a port to open: there is nothing to wait on but time.
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
}

impl Drop for Pebble {
    fn drop(&mut self) {
        for child in [&mut self.pebble, &mut self.dns] {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Starts `cmd` in `dir`, its output in `dir/NAME.log`.
fn spawn(cmd: &mut Command, dir: &Path, name: &str) -> Child {
    let log = dir.join(format!("{name}.log"));
    let out = std::fs::File::create(&log).unwrap_or_else(|e| panic!("{}: {e}", log.display()));
    let err = out
        .try_clone()
        .unwrap_or_else(|e| panic!("{}: {e}", log.display()));
    cmd.current_dir(dir)
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .spawn()
        .unwrap_or_else(|e| panic!("starting {name}: {e}"))
}

/// A root (PEM and DER) and a certificate and key under it for 127.0.0.1 and localhost.
fn api_certificate() -> (String, Vec<u8>, String, String) {
    use rcgen::{
        BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose,
    };
    let made = (|| -> Result<_, rcgen::Error> {
        let root_key = KeyPair::generate()?;
        let mut root = CertificateParams::new(Vec::<String>::new())?;
        root.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        root.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        root.distinguished_name
            .push(DnType::CommonName, "ringmux tests: Pebble API root");
        let root_cert = root.self_signed(&root_key)?;
        let issuer = Issuer::new(root, &root_key);
        let key = KeyPair::generate()?;
        let leaf = CertificateParams::new(vec!["127.0.0.1".to_string(), "localhost".to_string()])?
            .signed_by(&key, &issuer)?;
        Ok((
            root_cert.pem(),
            root_cert.der().to_vec(),
            leaf.pem(),
            key.serialize_pem(),
        ))
    })();
    made.unwrap_or_else(|e| panic!("making Pebble's API certificate: {e}"))
}

/// A loopback TCP port free now (the usual race of asking for one is accepted in tests).
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a loopback port")
        .port()
}

/// A loopback port free for UDP and TCP both (the DNS server takes both).
fn free_udp_and_tcp_port() -> u16 {
    for _ in 0..100 {
        let udp = UdpSocket::bind("127.0.0.1:0").expect("a loopback UDP port");
        let port = udp.local_addr().expect("its address").port();
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no loopback port free for UDP and TCP in 100 tries");
}

/// `GET path` over HTTPS/1.0 (so the answer is not chunked and ends with the connection),
/// trusting `root` only; the body of a 200.
fn https_get(addr: SocketAddr, path: &str, root: &[u8]) -> Result<String, String> {
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(root.to_vec().into())
        .map_err(|e| format!("the API root: {e}"))?;
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| e.to_string())?
    .with_root_certificates(roots)
    .with_no_client_auth();
    let name = rustls::pki_types::ServerName::IpAddress(addr.ip().into());
    let conn = rustls::ClientConnection::new(Arc::new(config), name).map_err(|e| e.to_string())?;
    let tcp =
        TcpStream::connect_timeout(&addr, Duration::from_secs(5)).map_err(|e| e.to_string())?;
    tcp.set_read_timeout(Some(Duration::from_secs(10)))
        .map_err(|e| e.to_string())?;
    let mut tls = rustls::StreamOwned::new(conn, tcp);
    write!(tls, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").map_err(|e| e.to_string())?;
    let mut raw = Vec::new();
    match tls.read_to_end(&mut raw) {
        Ok(_) => {}
        // A server that closes without close_notify: what came is whole for HTTP/1.0.
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof && !raw.is_empty() => {}
        Err(e) => return Err(e.to_string()),
    }
    let text = String::from_utf8_lossy(&raw);
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| format!("no end of header in {text:?}"))?;
    if !head.starts_with("HTTP/1.0 200") && !head.starts_with("HTTP/1.1 200") {
        return Err(format!("answered {head:?}"));
    }
    Ok(body.to_string())
}
