//! Active health checks end to end: ringmux started with a configuration file whose route
//! checks its backends (`health = { path = "/healthz", interval = 1, timeout = 0.5 }`), each
//! backend a small HTTP/1.1 service of this file whose `/healthz` answers 200, 503 or never,
//! as the test sets it. A backend whose check fails gets no request (none is a 502) and
//! gets traffic again once its check passes; every worker agrees, as they read one verdict; a
//! backend is probed once per interval for the box, not per worker nor per route; a health
//! endpoint that hangs is cut by the timeout, counted, and stalls no other backend's checks.

use ringmux_systests::harness;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use harness::{bounded, Forward, Ringmux};
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use ringmux_demux::metrics::Scrape;
use ringmux_testkit::client::H3Conn;

const LIMIT: Duration = Duration::from_secs(90);

const NAME: &str = "health.test";

const CHECK: &str = "health = { path = \"/healthz\", interval = 1, timeout = 0.5 }";

/// What a backend's `/healthz` does.
#[derive(Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
enum Healthz {
    Ok = 0,
    Unavailable = 1,
    Hang = 2,
}

/// A backend: `/healthz` from ringmux's checks as [`Healthz`] says, 200 to anything else;
/// counts both.
struct Backend {
    addr: SocketAddr,
    healthz: Arc<AtomicU8>,
    /// Probes of `/healthz` (by ringmux's user agent), and other requests.
    probes: Arc<AtomicU64>,
    requests: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl Backend {
    async fn start(healthz: Healthz) -> Backend {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mode = Arc::new(AtomicU8::new(healthz as u8));
        let probes = Arc::new(AtomicU64::new(0));
        let requests = Arc::new(AtomicU64::new(0));
        let (m, p, r) = (mode.clone(), probes.clone(), requests.clone());
        let task = tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                let (m, p, r) = (m.clone(), p.clone(), r.clone());
                tokio::spawn(async move {
                    let svc = service_fn(move |req| answer(req, m.clone(), p.clone(), r.clone()));
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(tcp), svc)
                        .await;
                });
            }
        });
        Backend {
            addr,
            healthz: mode,
            probes,
            requests,
            task,
        }
    }

    fn set(&self, healthz: Healthz) {
        self.healthz.store(healthz as u8, Ordering::Relaxed);
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Its label in the series (`proxy::pool`'s rule).
    fn label(&self) -> String {
        self.addr.to_string().replace(['.', ':'], "_")
    }

    fn requests(&self) -> u64 {
        self.requests.load(Ordering::Relaxed)
    }
}

impl Drop for Backend {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn answer(
    req: Request<Incoming>,
    healthz: Arc<AtomicU8>,
    probes: Arc<AtomicU64>,
    requests: Arc<AtomicU64>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let probe = req.uri().path() == "/healthz"
        && req
            .headers()
            .get("user-agent")
            .is_some_and(|v| v.as_bytes().starts_with(b"ringmux-health/"));
    let status = match probe {
        true => {
            probes.fetch_add(1, Ordering::Relaxed);
            match healthz.load(Ordering::Relaxed) {
                0 => StatusCode::OK,
                1 => StatusCode::SERVICE_UNAVAILABLE,
                // Never answers; the connection ends when the prober closes it.
                _ => std::future::pending().await,
            }
        }
        false => {
            requests.fetch_add(1, Ordering::Relaxed);
            StatusCode::OK
        }
    };
    let mut r = Response::new(Full::new(Bytes::from_static(b"ok\n")));
    *r.status_mut() = status;
    Ok(r)
}

/// `harness::one_site_config` for this file's site.
fn config(dir: &Path, instances: u8, routes: &str) -> String {
    harness::one_site_config(dir, NAME, instances, routes)
}

/// A `[[site.route]]` at `path` to `backends` with the check, round robin.
fn route(path: &str, backends: &[&Backend]) -> String {
    let urls: Vec<String> = backends
        .iter()
        .map(|b| format!("\"{}\"", b.url()))
        .collect();
    format!(
        "[[site.route]]\npath = \"{path}\"\nupstream = [{}]\nlb = \"round_robin\"\n{CHECK}\n",
        urls.join(", ")
    )
}

/// The demux's verdict on `backend` (`ringmux_backend_up`): 1, 0, or `None` before one.
fn up(m: &Scrape, backend: &Backend) -> Option<f64> {
    let needle = format!("backend=\"{}\"", backend.label());
    let got: Vec<f64> = m
        .series
        .iter()
        .filter(|(k, _)| k.starts_with("ringmux_backend_up{") && k.contains(&needle))
        .map(|(_, v)| *v)
        .collect();
    got.first().copied()
}

/// The demux's probes of `backend` with `result`.
fn probes(m: &Scrape, backend: &Backend, result: &str) -> f64 {
    m.samples("ringmux_health_probes_total")
        .iter()
        .filter(|(l, _)| {
            l.iter()
                .any(|(k, v)| k == "backend" && *v == backend.label())
                && l.iter().any(|(k, v)| k == "result" && v == result)
        })
        .map(|(_, v)| v)
        .sum()
}

/// `n` GETs over each of `conns`: every one must be a 200.
async fn get_all(conns: &[H3Conn], n: usize) {
    for conn in conns {
        for _ in 0..n {
            let r = conn.get("/x").await.expect("GET /x");
            assert_eq!(r.status, StatusCode::OK, "GET /x");
        }
    }
}

/// A connection to each of `instances` workers.
async fn connections(rm: &Ringmux, instances: u8) -> Vec<H3Conn> {
    let mut conns = Vec::new();
    for i in 0..instances {
        conns.push(
            rm.pinned_client(i)
                .connect(rm.listen, NAME)
                .await
                .expect("connecting to health.test"),
        );
    }
    conns
}

/// A good backend and one whose `/healthz` does `sick`, behind one checked route served by
/// two workers (the route's configuration in the folder returned).
async fn pool_of_two(sick: Healthz) -> (Backend, Backend, ringmux_testkit::TempDir, Ringmux) {
    let good = Backend::start(Healthz::Ok).await;
    let sick = Backend::start(sick).await;
    let dir = ringmux_testkit::temp_dir("ringmux-health");
    let routes = route("/", &[&good, &sick]);
    let rm = Ringmux::start(
        2,
        Forward::Shm,
        &["--config", &config(dir.path(), 2, &routes)],
    );
    (good, sick, dir, rm)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_whose_check_fails_gets_no_requests_and_comes_back() {
    let (good, sick, _dir, rm) = pool_of_two(Healthz::Unavailable).await;
    bounded(LIMIT, async {
        rm.wait_for("the sick backend down, the good one up", LIMIT, |m| {
            up(m, &sick) == Some(0.0) && up(m, &good) == Some(1.0)
        })
        .await;
        let conns = connections(&rm, 2).await;
        let before = sick.requests();
        get_all(&conns, 10).await;
        assert_eq!(sick.requests(), before, "a backend down gets no request");
        // Both workers left it out, as they read one verdict.
        let m = rm
            .wait_for("both workers' skips reported", LIMIT, |m| {
                let skipped = m.samples("ringmux_worker_backend_skipped_down_total");
                let of_sick: Vec<_> = skipped
                    .iter()
                    .filter(|(l, v)| {
                        *v > 0.0 && l.iter().any(|(k, v)| k == "backend" && *v == sick.label())
                    })
                    .collect();
                of_sick.len() == 2
            })
            .await;
        assert_eq!(
            m.sum_where(
                "ringmux_worker_backend_requests_total",
                "backend",
                &sick.label()
            ),
            0.0,
            "{m}"
        );
        // It recovers: marked up within an interval or so, and traffic returns.
        sick.set(Healthz::Ok);
        rm.wait_for("the backend up again", LIMIT, |m| up(m, &sick) == Some(1.0))
            .await;
        let before = sick.requests();
        get_all(&conns, 10).await;
        assert!(sick.requests() > before, "traffic returns to it");
        // Down again, and the other too: the route answers 503 at once, trying neither.
        sick.set(Healthz::Unavailable);
        good.set(Healthz::Unavailable);
        rm.wait_for("both down", LIMIT, |m| {
            up(m, &sick) == Some(0.0) && up(m, &good) == Some(0.0)
        })
        .await;
        let (a, b) = (good.requests(), sick.requests());
        let r = conns[0].get("/x").await.expect("GET /x");
        assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!((good.requests(), sick.requests()), (a, b));
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_is_probed_once_per_interval_for_the_box() {
    let b = Backend::start(Healthz::Ok).await;
    let dir = ringmux_testkit::temp_dir("ringmux-health");
    // Two routes name it with the same path, and two workers serve them.
    let routes = [route("/a", &[&b]), route("/b", &[&b])].concat();
    let rm = Ringmux::start(
        2,
        Forward::Shm,
        &["--config", &config(dir.path(), 2, &routes)],
    );
    bounded(LIMIT, async {
        let m = rm
            .wait_for("five probes counted", LIMIT, |m| {
                probes(m, &b, "pass") >= 5.0
            })
            .await;
        // The demux's count, then the backend's: the backend saw exactly those probes (one
        // more at most, sent between the two reads), not one per worker nor per route.
        let counted = probes(&m, &b, "pass") as u64;
        let seen = b.probes.load(Ordering::Relaxed);
        assert!(
            seen == counted || seen == counted + 1,
            "the backend saw {seen} probes, the demux sent {counted}"
        );
        assert_eq!(b.requests(), 0, "the workers sent nothing themselves");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_health_endpoint_that_hangs_is_cut_by_its_timeout() {
    let good = Backend::start(Healthz::Ok).await;
    let hangs = Backend::start(Healthz::Hang).await;
    let dir = ringmux_testkit::temp_dir("ringmux-health");
    let routes = route("/", &[&good, &hangs]);
    let rm = Ringmux::start(
        1,
        Forward::Shm,
        &["--config", &config(dir.path(), 1, &routes)],
    );
    bounded(LIMIT, async {
        let m = rm
            .wait_for("the hanging backend's probes timed out", LIMIT, |m| {
                probes(m, &hangs, "timeout") >= 3.0 && up(m, &hangs) == Some(0.0)
            })
            .await;
        // Its probes were cut, one by one, while the other's went on passing.
        let passed_then = probes(&m, &good, "pass");
        rm.wait_for("the other backend's probes go on", LIMIT, |m| {
            probes(m, &good, "pass") >= passed_then + 2.0
        })
        .await;
        let conns = connections(&rm, 1).await;
        let before = hangs.requests();
        get_all(&conns, 10).await;
        assert_eq!(
            hangs.requests(),
            before,
            "no request to the hanging backend"
        );
        let m = rm.metrics();
        assert_eq!(up(&m, &good), Some(1.0), "{m}");
    })
    .await;
}

/// After `ringmux upgrade` the new demux writes the verdicts into the health table the workers
/// it adopted read: a backend whose check starts failing after the upgrade gets no request from
/// them, and when both fail the route answers 503 at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_handed_over_by_an_upgrade_read_fresh_verdicts() {
    let (good, sick, _dir, rm) = pool_of_two(Healthz::Ok).await;
    bounded(LIMIT, async {
        rm.wait_for("both backends up", LIMIT, |m| {
            up(m, &sick) == Some(1.0) && up(m, &good) == Some(1.0)
        })
        .await;
        let pids = rm.worker_pids().await;
        let conns = connections(&rm, 2).await;
        get_all(&conns, 4).await;
        assert!(sick.requests() > 0, "both backends served before");
        let (ok, text) = rm.upgrade(Duration::from_secs(30)).await;
        assert!(ok, "upgrade: {text}");
        assert_eq!(rm.worker_pids().await, pids, "the workers were handed over");
        // The new demux's checks mark it down: the adopted workers read that verdict.
        sick.set(Healthz::Unavailable);
        rm.wait_for("the sick backend down after the upgrade", LIMIT, |m| {
            up(m, &sick) == Some(0.0)
        })
        .await;
        let before = sick.requests();
        get_all(&conns, 10).await;
        let fresh = connections(&rm, 2).await;
        get_all(&fresh, 10).await;
        assert_eq!(sick.requests(), before, "a backend down gets no request");
        good.set(Healthz::Unavailable);
        rm.wait_for("both down", LIMIT, |m| up(m, &good) == Some(0.0))
            .await;
        let (a, b) = (good.requests(), sick.requests());
        for conn in [&conns[0], &conns[1], &fresh[0], &fresh[1]] {
            let r = conn.get("/x").await.expect("GET /x");
            assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE);
        }
        assert_eq!((good.requests(), sick.requests()), (a, b));
    })
    .await;
}
