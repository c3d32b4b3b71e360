//! Sites over HTTPS on TCP: a [`Router`] of two sites served by `tcp::serve` on loopback, asked
//! over TLS (server name `localhost`) with HTTP/1.1 requests written by hand, so that the host
//! field can be anything, or missing; an HTTP/1.1 service on loopback echoes what the proxy
//! passes it.
//!
//! Every test body runs under a timeout, and every wait is on an event, never a sleep.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use ringmux_proto::sites::{Action, Route, Site, SiteTable};
use ringmux_server::access_log::AccessLog;
use ringmux_server::reply::HELLO_BODY;
use ringmux_server::sites::{Router, RouterOptions, SiteCounts};
use ringmux_server::stats::ServerStats;
use ringmux_server::tcp::{serve, TcpOptions};
use ringmux_testkit::temp_dir;
use ringmux_worker::tls::{tcp_tls_config, CertChain};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::watch;

const TEST_TIMEOUT: Duration = Duration::from_secs(60);

async fn bounded<F: std::future::Future<Output = ()>>(f: F) {
    tokio::time::timeout(TEST_TIMEOUT, f)
        .await
        .expect("test timed out");
}

/// An HTTP/1.1 service answering every request with its method and path as received.
async fn echo_upstream() -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let service = hyper::service::service_fn(|req: http::Request<_>| async move {
                let said = format!("{} {}", req.method(), req.uri());
                Ok::<_, Infallible>(http::Response::new(Full::new(Bytes::from(said))))
            });
            tokio::spawn(
                hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), service),
            );
        }
    });
    addr
}

/// A response as read off the wire.
struct Answer {
    status: u16,
    head: String,
    body: Vec<u8>,
}

impl Answer {
    fn header(&self, name: &str) -> Option<&str> {
        self.head.lines().find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case(name).then(|| v.trim())
        })
    }
}

struct Server {
    addr: SocketAddr,
    chain: CertChain,
    stats: Arc<ServerStats>,
    _stop: watch::Sender<bool>,
}

impl Server {
    async fn start(router: Router) -> Server {
        let chain = CertChain::self_signed().unwrap();
        let tls = Arc::new(tcp_tls_config(&chain).unwrap());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let stats = Arc::new(ServerStats::default());
        let (stop, stop_rx) = watch::channel(false);
        tokio::spawn(serve(
            listener,
            tls,
            router,
            stats.clone(),
            stop_rx,
            TcpOptions::default(),
        ));
        Server {
            addr,
            chain,
            stats,
            _stop: stop,
        }
    }

    /// `method path` over a new TLS connection to `localhost`, with `host` if given (and a
    /// body if given), the connection closed after it.
    async fn ask(&self, method: &str, path: &str, host: Option<&str>, body: &str) -> Answer {
        let mut roots = rustls::RootCertStore::empty();
        for c in &self.chain.certs {
            roots.add(c.clone()).unwrap();
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut cfg = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
        cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
        let tcp = tokio::net::TcpStream::connect(self.addr).await.unwrap();
        let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
        let mut tls = tokio_rustls::TlsConnector::from(Arc::new(cfg))
            .connect(name, tcp)
            .await
            .expect("TLS handshake");
        let mut req = format!("{method} {path} HTTP/1.1\r\nconnection: close\r\n");
        if let Some(h) = host {
            req.push_str(&format!("host: {h}\r\n"));
        }
        req.push_str(&format!("content-length: {}\r\n\r\n{body}", body.len()));
        tls.write_all(req.as_bytes()).await.unwrap();
        let mut raw = Vec::new();
        tls.read_to_end(&mut raw).await.expect("the response");
        let split = raw
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .expect("a response head");
        let head = String::from_utf8(raw[..split].to_vec()).unwrap();
        let status = head[9..12].parse().unwrap();
        Answer {
            status,
            head,
            body: raw[split + 4..].to_vec(),
        }
    }
}

fn route(path: &str, action: Action) -> Route {
    Route {
        compress: None,
        path: path.into(),
        action,
        rules: Default::default(),
        limits: Default::default(),
    }
}

fn site(label: &str, routes: Vec<Route>) -> Site {
    Site {
        label: label.into(),
        names: vec![label.into()],
        cert_pem: String::new(),
        key_pem: String::new(),
        acme: false,
        redirect_names: Vec::new(),
        compress: None,
        rules: Default::default(),
        routes,
        limits: Default::default(),
    }
}

#[tokio::test]
async fn each_request_is_answered_by_its_sites_route() {
    bounded(async {
        let tmp = temp_dir("ringmux-sites-tcp");
        let stat = tmp.path().join("static");
        std::fs::create_dir_all(stat.join("sub")).unwrap();
        std::fs::write(stat.join("index.html"), b"<p>index</p>").unwrap();
        std::fs::write(stat.join("a.css"), b"p{}").unwrap();
        let log_path = tmp.path().join("access.log");
        let log_file = std::fs::File::create(&log_path).unwrap();
        let log =
            AccessLog::start(log_file, 0, ringmux_server::access_log::LogFormat::Ringmux).unwrap();
        let upstream: ringmux_proto::UpstreamUrl =
            format!("http://{}", echo_upstream().await).parse().unwrap();
        let table = SiteTable {
            sites: vec![
                site(
                    "localhost",
                    vec![
                        route(
                            "/",
                            Action::Respond(
                                ringmux_proto::route::Respond::new(200, "home\n").unwrap(),
                            ),
                        ),
                        route("/static", Action::Files { root: stat.clone() }),
                        route("/api", Action::upstream(upstream.clone(), true)),
                        route("/raw", Action::upstream(upstream, false)),
                        route(
                            "/old",
                            Action::Redirect {
                                to: "https://new.test{path}?{query}"
                                    .to_string()
                                    .try_into()
                                    .unwrap(),
                                status: 301.try_into().unwrap(),
                            },
                        ),
                        route("/b/", Action::Builtin { root: None }),
                    ],
                ),
                site(
                    "other.test",
                    vec![route(
                        "/",
                        Action::Respond(
                            ringmux_proto::route::Respond::new(200, "other\n").unwrap(),
                        ),
                    )],
                ),
            ],
            default_site: None,
        };
        let opts = RouterOptions {
            access_log: Some(log.clone()),
            ..RouterOptions::default()
        };
        let server = Server::start(Router::new(&table, &opts).unwrap()).await;
        let get = |path: &'static str| server.ask("GET", path, Some("localhost"), "");

        let home = get("/").await;
        assert_eq!((home.status, &home.body[..]), (200, &b"home\n"[..]));
        assert_eq!(
            home.header("content-type"),
            Some("text/plain; charset=utf-8")
        );
        // Files beneath the prefix: the directory redirect keeps the prefix, no built-ins.
        let dir = get("/static").await;
        assert_eq!(
            (dir.status, dir.header("location")),
            (301, Some("/static/"))
        );
        let sub = get("/static/sub").await;
        assert_eq!(sub.header("location"), Some("/static/sub/"));
        assert_eq!(get("/static/").await.body, b"<p>index</p>");
        assert_eq!(get("/static/a.css").await.body, b"p{}");
        assert_eq!(get("/static/hello.txt").await.status, 404);
        assert_eq!(
            server
                .ask("POST", "/static/a.css", Some("localhost"), "x")
                .await
                .status,
            405
        );
        assert_eq!(get("/b/hello.txt").await.body, HELLO_BODY);
        // The proxy, with and without the prefix; the query goes along.
        assert_eq!(get("/api/x?q=1").await.body, b"GET /x?q=1");
        let posted = server.ask("POST", "/api", Some("localhost"), "abc").await;
        assert_eq!(posted.body, b"POST /");
        assert_eq!(get("/raw/y").await.body, b"GET /raw/y");
        let moved = get("/old/p?x=1").await;
        assert_eq!(
            (moved.status, moved.header("location")),
            (301, Some("https://new.test/old/p?x=1"))
        );
        assert_eq!(moved.header("content-length"), Some("0"));
        // Another site's host on this site's connection, a host of no site, no host at all.
        let other = server.ask("GET", "/", Some("other.test"), "").await;
        assert_eq!(
            other.status,
            421,
            "{}",
            String::from_utf8_lossy(&other.body)
        );
        assert_eq!(
            server
                .ask("GET", "/", Some("nowhere.test"), "")
                .await
                .status,
            421
        );
        assert_eq!(server.ask("GET", "/", None, "").await.status, 400);
        assert_eq!(
            server
                .ask("GET", "/", Some("LOCALHOST:443"), "")
                .await
                .status,
            200
        );

        let rows = server.stats.sites.snapshot();
        assert_eq!(
            rows[0],
            SiteCounts {
                label: "localhost".into(),
                // 2xx: home, index, a.css, hello, 3 proxied, and LOCALHOST; 3xx: 2 directories,
                // the redirect; 4xx: 404, 405, 421 twice, 400.
                responses: [0, 8, 3, 5, 0],
                misdirected: 2,
            }
        );
        assert_eq!(rows[1].responses, [0; 5], "nothing served as other.test");

        log.flush(Duration::from_secs(20));
        assert_eq!(log.dropped(), 0);
        let text = std::fs::read_to_string(&log_path).unwrap();
        let lines: Vec<Vec<&str>> = text.lines().map(|l| l.split(' ').collect()).collect();
        assert_eq!(lines.len(), 16, "{text}");
        for l in &lines {
            // The ten fields of before, then the site, then how it ended.
            assert_eq!(l.len(), 12, "{l:?}");
            assert_eq!(l[10], "localhost", "{l:?}");
            assert_eq!(l[11], "ok", "{l:?}");
        }
        assert!(
            lines.iter().any(|l| l[4] == "other.test" && l[6] == "421"),
            "{text}"
        );
    })
    .await;
}

/// The command line's site answers every host on every connection.
#[tokio::test]
async fn the_command_line_site_answers_every_host() {
    bounded(async {
        let table = ringmux_server::sites::command_line_table();
        let server = Server::start(Router::new(&table, &RouterOptions::default()).unwrap()).await;
        for host in ["localhost", "a.test", "127.0.0.1:4433", "[::1]"] {
            let hello = server.ask("GET", "/hello.txt", Some(host), "").await;
            assert_eq!((hello.status, &hello.body[..]), (200, HELLO_BODY), "{host}");
        }
        assert_eq!(server.ask("GET", "/hello.txt", None, "").await.status, 400);
        let rows = server.stats.sites.snapshot();
        assert_eq!(rows[0].label, "default");
        assert_eq!(rows[0].responses, [0, 4, 0, 1, 0]);
    })
    .await;
}
