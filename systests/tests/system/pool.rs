//! Several backends behind one upstream route, end to end: ringmux started with a
//! configuration file whose routes name two or three HTTP/1.1 services started by the test
//! (`ringmux_testkit::upstream`), and each policy's spread counted at the backends; one backend
//! stopped under load (no 502 for the GETs, which move to the others; it is ejected, counted)
//! then started again (traffic returns); a POST whose body reached a backend that then failed
//! is not retried, one whose backend refused the connection is; a body past `max_body` gets 413
//! over HTTP/3, HTTP/2 and HTTP/1.1, before the backend sees it when its length is known.

use ringmux_systests::harness;

use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use harness::{bounded, Forward, Ringmux};
use http::{Method, Request, StatusCode};
use ringmux_demux::metrics::Scrape;
use ringmux_testkit::client::H3Conn;
use ringmux_testkit::curl::{self, Reach};
use ringmux_testkit::upstream::Upstream;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const LIMIT: Duration = Duration::from_secs(120);

const NAME: &str = "pool.test";

fn backend() -> Upstream {
    Upstream::start("127.0.0.1:0".parse().unwrap(), 1).expect("starting a backend")
}

/// The label of a backend in the series (`proxy::pool`'s rule).
fn label(addr: SocketAddr) -> String {
    addr.to_string().replace(['.', ':'], "_")
}

/// `harness::one_site_config` for this file's site.
fn config(dir: &Path, instances: u8, routes: &str) -> String {
    harness::one_site_config(dir, NAME, instances, routes)
}

/// A `[[site.route]]` at `path` to `backends`, the prefix stripped, with `more` keys.
fn route(path: &str, backends: &[String], more: &str) -> String {
    let urls: Vec<String> = backends.iter().map(|u| format!("\"{u}\"")).collect();
    format!(
        "[[site.route]]\npath = \"{path}\"\nupstream = [{}]\nstrip_prefix = true\n{more}\n",
        urls.join(", ")
    )
}

fn url(u: &Upstream) -> String {
    format!("http://{}", u.addr())
}

/// Each backend's requests so far.
fn counts(backends: &[&Upstream]) -> Vec<u64> {
    backends.iter().map(|b| b.stats().requests()).collect()
}

fn delta(after: &[u64], before: &[u64]) -> Vec<u64> {
    after.iter().zip(before).map(|(a, b)| a - b).collect()
}

async fn connect(rm: &Ringmux) -> H3Conn {
    rm.client()
        .connect(rm.listen, NAME)
        .await
        .expect("connecting to pool.test")
}

async fn get_ok(conn: &H3Conn, path: &str) {
    let r = conn.get(path).await.expect(path);
    assert_eq!(r.status, StatusCode::OK, "GET {path}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_policy_spreads_as_it_says() {
    let b = [backend(), backend(), backend()];
    let all: Vec<&Upstream> = b.iter().collect();
    let urls: Vec<String> = b.iter().map(url).collect();
    let dir = ringmux_testkit::temp_dir("ringmux-pool");
    let routes = [
        route("/rr", &urls, "lb = \"round_robin\""),
        route("/lc", &urls, "lb = \"least_conn\""),
        route("/r2", &urls, ""),
        route("/ch", &urls, "lb = \"client_hash\""),
    ]
    .concat();
    // One worker: round robin's turn and the requests in flight are one worker's.
    let rm = Ringmux::start(
        1,
        Forward::Shm,
        &["--config", &config(dir.path(), 1, &routes)],
    );
    bounded(LIMIT, async {
        let conn = connect(&rm).await;

        let before = counts(&all);
        for _ in 0..30 {
            get_ok(&conn, "/rr/hello").await;
        }
        assert_eq!(delta(&counts(&all), &before), [10, 10, 10], "round_robin");

        // Three slow responses at once: each goes to the backend with none in flight.
        let before = counts(&all);
        let mut slow = Vec::new();
        for _ in 0..3 {
            let r = conn
                .start(Method::GET, "/lc/slow?n=200&ms=10", None)
                .await
                .expect("GET /lc/slow");
            assert_eq!(r.status(), StatusCode::OK);
            slow.push(r);
        }
        assert_eq!(delta(&counts(&all), &before), [1, 1, 1], "least_conn");
        drop(slow);

        let before = counts(&all);
        for _ in 0..60 {
            get_ok(&conn, "/r2/hello").await;
        }
        let got = delta(&counts(&all), &before);
        assert_eq!(got.iter().sum::<u64>(), 60);
        assert!(
            got.iter().all(|n| *n > 0),
            "random_two uses every backend: {got:?}"
        );

        let before = counts(&all);
        for _ in 0..20 {
            get_ok(&conn, "/ch/hello").await;
        }
        let mut got = delta(&counts(&all), &before);
        got.sort_unstable();
        assert_eq!(
            got,
            [0, 0, 20],
            "client_hash keeps one client on one backend"
        );

        let m = rm
            .wait_for("the backends' series", Duration::from_secs(10), |m| {
                m.sum("ringmux_worker_backend_requests_total") >= 113.0
            })
            .await;
        for u in &b {
            assert!(state_is(&m, &label(u.addr()), "up"), "{m}");
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_stopped_under_load_is_ejected_and_comes_back() {
    let mut b = vec![backend(), backend(), backend()];
    let urls: Vec<String> = b.iter().map(url).collect();
    let gone = b[1].addr();
    let dir = ringmux_testkit::temp_dir("ringmux-pool");
    let routes = route("/", &urls, "eject_for = 2");
    let rm = Ringmux::start(
        2,
        Forward::Shm,
        &["--config", &config(dir.path(), 2, &routes)],
    );
    bounded(LIMIT, async {
        // Load: four connections (both workers) sending GETs back to back until stopped.
        let stop = Arc::new(AtomicBool::new(false));
        let failures = Arc::new(Mutex::new(Vec::new()));
        let mut load = Vec::new();
        for _ in 0..4 {
            let conn = connect(&rm).await;
            let (stop, failures) = (stop.clone(), failures.clone());
            load.push(tokio::spawn(async move {
                let mut n = 0u64;
                // Bounded: the test's own limit stops it otherwise.
                while !stop.load(Ordering::Relaxed) && n < 1_000_000 {
                    match conn.get("/hello").await {
                        Ok(r) if r.status == StatusCode::OK => {}
                        Ok(r) => failures.lock().unwrap().push(format!("{}", r.status)),
                        Err(e) => failures.lock().unwrap().push(e.to_string()),
                    }
                    n += 1;
                }
                n
            }));
        }
        b[1].stats().wait_requests(20, LIMIT).await;
        drop(b.remove(1));
        let m = rm
            .wait_for("the stopped backend ejected", LIMIT, |m| {
                let e = "ringmux_worker_backend_ejections_total";
                m.sum_where(e, "backend", &label(gone)) >= 1.0
            })
            .await;
        assert!(
            m.sum("ringmux_worker_backend_retries_total") >= 1.0,
            "requests moved: {m}"
        );
        // Started again on its address: once its ejection ends, traffic returns.
        let back = Upstream::start(gone, 1).expect("starting the backend again");
        back.stats().wait_requests(10, LIMIT).await;
        stop.store(true, Ordering::Relaxed);
        let mut sent = 0;
        for l in load {
            sent += l.await.expect("a load task");
        }
        let failures = std::mem::take(&mut *failures.lock().unwrap());
        assert!(failures.is_empty(), "of {sent} GETs: {failures:?}");
        // Every worker reports it up again.
        rm.wait_for("the backend up again", Duration::from_secs(10), |m| {
            state_is(m, &label(gone), "up")
        })
        .await;
    })
    .await;
}

/// Whether every instance that reports a state of `backend` reports `state`, and one does.
fn state_is(m: &Scrape, backend: &str, state: &str) -> bool {
    let needle = format!("backend=\"{backend}\"");
    let set: Vec<&String> = m
        .series
        .iter()
        .filter(|(k, v)| {
            k.starts_with("ringmux_worker_backend_state{") && k.contains(&needle) && **v == 1.0
        })
        .map(|(k, _)| k)
        .collect();
    !set.is_empty()
        && set
            .iter()
            .all(|k| k.contains(&format!("state=\"{state}\"")))
}

/// A backend that reads one request whole (head and a `content-length` body), then closes
/// the connection without answering: what a backend that dies mid-request does.
async fn closer() -> (SocketAddr, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let task = tokio::spawn(async move {
        while let Ok((mut tcp, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut got = Vec::new();
                let mut buf = [0u8; 4096];
                loop {
                    match tcp.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => got.extend_from_slice(&buf[..n]),
                    }
                    let text = String::from_utf8_lossy(&got).to_ascii_lowercase();
                    let Some(end) = text.find("\r\n\r\n") else {
                        continue;
                    };
                    let length: usize = text[..end]
                        .lines()
                        .find_map(|l| l.strip_prefix("content-length:"))
                        .and_then(|v| v.trim().parse().ok())
                        .unwrap_or(0);
                    if got.len() >= end + 4 + length {
                        let _ = tcp.shutdown().await;
                        return;
                    }
                }
            });
        }
    });
    (addr, task)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_requests_that_cannot_repeat_an_effect_are_retried() {
    let good = backend();
    let (closing, closer_task) = closer().await;
    let refused = harness::unused_tcp_port();
    let dir = ringmux_testkit::temp_dir("ringmux-pool");
    let keep = "lb = \"round_robin\"\nmax_fails = 0";
    let routes = [
        route("/closing", &[format!("http://{closing}"), url(&good)], keep),
        route("/refused", &[format!("http://{refused}"), url(&good)], keep),
    ]
    .concat();
    let rm = Ringmux::start(
        1,
        Forward::Shm,
        &["--config", &config(dir.path(), 1, &routes)],
    );
    bounded(LIMIT, async {
        let conn = connect(&rm).await;
        let body = Bytes::from(vec![b'x'; 1000]);
        let post = |path: &'static str| {
            let conn = &conn;
            let body = body.clone();
            async move {
                let mut s = conn
                    .open(
                        Request::post(path)
                            .header("content-length", "1000")
                            .body(())
                            .unwrap(),
                    )
                    .await
                    .expect("open");
                s.send_data(body).await.expect("send the body");
                s.finish().await.expect("finish");
                s.recv_response().await.expect("the response head").status()
            }
        };
        // Round robin: the first request of each route goes to its first backend.
        let before = good.stats().requests();
        assert_eq!(post("/closing/sha256").await, StatusCode::BAD_GATEWAY);
        assert_eq!(good.stats().requests(), before, "the POST was not retried");
        get_ok(&conn, "/closing/hello").await; // the good one's turn
        let before = good.stats().requests();
        get_ok(&conn, "/closing/hello").await; // the closer's turn, then retried
        assert_eq!(good.stats().requests(), before + 1, "the GET was retried");

        // A refused connection: the POST never reached it, so it moves on, body whole.
        let r = conn
            .request(Method::POST, "/refused/sha256", Some(body.clone()), true)
            .await
            .expect("POST /refused/sha256");
        assert_eq!(r.status, StatusCode::OK);
        let text = String::from_utf8_lossy(r.body.as_deref().unwrap_or_default()).into_owned();
        assert!(
            text.starts_with("POST 1000 "),
            "the whole body reached the other backend: {text}"
        );
        let m = rm
            .wait_for("the retries counted", Duration::from_secs(10), |m| {
                m.sum("ringmux_worker_backend_retries_total") >= 2.0
            })
            .await;
        assert_eq!(
            m.sum_where(
                "ringmux_worker_backend_retries_total",
                "backend",
                &label(closing)
            ),
            1.0,
            "{m}"
        );
    })
    .await;
    closer_task.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_past_max_body_gets_413_on_every_transport() {
    let good = backend();
    let routes = route("/", &[url(&good)], "max_body = 1000");
    past_1000_bytes_is_413(&good, &routes, "/sha256").await;
}

/// A site's `max_body` holds on its upstream route that sets none, over every transport; a
/// route's own `max_body = 0` lifts it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sites_max_body_holds_on_its_routes() {
    let good = backend();
    let routes = format!(
        "max_body = \"1000B\"\n{}{}",
        route("/", &[url(&good)], ""),
        route("/any", &[url(&good)], "max_body = 0")
    );
    past_1000_bytes_is_413(&good, &routes, "/sha256").await;
    // The route that lifts it: 5000 bytes pass, over HTTP/3.
    let dir = ringmux_testkit::temp_dir("ringmux-pool");
    let rm = Ringmux::start(
        1,
        Forward::Shm,
        &["--config", &config(dir.path(), 1, &routes)],
    );
    bounded(LIMIT, async {
        let conn = connect(&rm).await;
        let big = Some(Bytes::from(vec![b'x'; 5000]));
        let r = conn
            .request(Method::POST, "/any/sha256", big, true)
            .await
            .expect("POST past the site's limit");
        assert_eq!(r.status, StatusCode::OK);
    })
    .await;
}

/// ringmux with one site holding `routes` to the backend `good`: a POST to `path` of more
/// than 1000 bytes gets 413 (before the backend for a length over HTTP/3), one of 1000 does
/// not, over HTTP/3, HTTP/2 and HTTP/1.1 (with a length and chunked).
async fn past_1000_bytes_is_413(good: &Upstream, routes: &str, path: &str) {
    let dir = ringmux_testkit::temp_dir("ringmux-pool");
    let rm = Ringmux::start(
        1,
        Forward::Shm,
        &["--config", &config(dir.path(), 1, routes)],
    );
    let small = dir.path().join("small");
    let large = dir.path().join("large");
    std::fs::write(&small, vec![b'x'; 1000]).unwrap();
    std::fs::write(&large, vec![b'x'; 5000]).unwrap();
    bounded(LIMIT, async {
        let conn = connect(&rm).await;
        // HTTP/3, the length given: refused before the backend sees the request.
        let before = good.stats().requests();
        let mut s = conn
            .open(
                Request::post(path)
                    .header("content-length", "5000")
                    .body(())
                    .unwrap(),
            )
            .await
            .expect("open");
        let _ = s.send_data(Bytes::from(vec![b'x'; 5000])).await;
        let _ = s.finish().await;
        let head = s.recv_response().await.expect("the 413's head");
        assert_eq!(head.status(), StatusCode::PAYLOAD_TOO_LARGE);
        assert_eq!(
            good.stats().requests(),
            before,
            "nothing reached the backend"
        );
        // HTTP/3 without a length: streamed, then cut at the limit.
        let r = conn
            .request(
                Method::POST,
                path,
                Some(Bytes::from(vec![b'x'; 5000])),
                false,
            )
            .await
            .expect("POST without a length");
        assert_eq!(r.status, StatusCode::PAYLOAD_TOO_LARGE);
        let r = conn
            .request(
                Method::POST,
                path,
                Some(Bytes::from(vec![b'x'; 1000])),
                false,
            )
            .await
            .expect("POST at the limit");
        assert_eq!(r.status, StatusCode::OK);

        let port = rm.listen.port();
        let at = |f: &Path| format!("@{}", f.display());
        for (version, extra) in [
            ("--http2", vec![]),
            ("--http1.1", vec![]),
            ("--http1.1", vec!["-H", "transfer-encoding: chunked"]),
        ] {
            for (file, want) in [(&large, 413), (&small, 200)] {
                let data = at(file);
                let mut args = vec![version, "-X", "POST", "--data-binary", data.as_str()];
                args.extend(extra.iter().copied());
                let got = curl::get(
                    dir.path(),
                    port,
                    Reach::Name(NAME),
                    None,
                    &args,
                    path,
                    LIMIT,
                )
                .await
                .unwrap_or_else(|e| panic!("curl {args:?}: {e}"));
                assert_eq!(got.status, want, "curl {args:?}: {}", got.body);
            }
        }
    })
    .await;
}
