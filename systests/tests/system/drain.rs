//! Drains without a clock (`--grace`, `--max-draining`; docs/operators/upgrades.md): slow downloads over HTTP/1.1, HTTP/2 and HTTP/3 outlive reloads and an
//! upgrade byte-exact and end `ok` in the access log; with `--grace` they are cut and logged
//! cut with the bytes sent; past `--max-draining` the oldest draining generation is the one
//! cut.
//!
//! The downloads are paced by the client (curl's `--limit-rate`, and a reader that takes the
//! HTTP/3 body at that rate), so the server is held by flow control as by a slow link.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Buf;
use ringmux_demux::metrics::names;

use ringmux_systests::harness::{self, bounded, expected_bytes, Forward, Metrics, Ringmux};
use ringmux_testkit::client::Fnv64;
use ringmux_testkit::{temp_dir, tool};
use tokio::process::Child;
use tokio::task::JoinHandle;

/// The clients' pace: curl's `--limit-rate 1M` (bytes a second).
const RATE: u64 = 1 << 20;
const RATE_ARG: &str = "1M";

/// A download paced at [`RATE`] over one protocol.
struct Download {
    /// `h1`, `h2` or `h3`: the access log's protocol field.
    protocol: &'static str,
    /// Body bytes the client has so far.
    got: Progress,
    /// Its end: the body's length and FNV-1a 64, or why it failed.
    end: JoinHandle<Result<(u64, u64), String>>,
}

enum Progress {
    /// curl writes the body to this file.
    File(PathBuf),
    Counter(Arc<AtomicU64>),
}

impl Download {
    /// curl over TCP (`--http1.1` or `--http2`) of `path` on `rm`.
    fn curl(rm: &Ringmux, http2: bool, path: &str) -> Download {
        let out = rm.dir().join(format!("download-{}", harness::random_u64()));
        let child: Child = tokio::process::Command::new("curl")
            .args(["-sS", "-k", "--limit-rate", RATE_ARG])
            .arg(if http2 { "--http2" } else { "--http1.1" })
            .arg("-o")
            .arg(&out)
            .arg(format!("https://{}{path}", rm.listen))
            .kill_on_drop(true)
            .spawn()
            .expect("curl");
        let file = out.clone();
        let end = tokio::spawn(async move {
            let status = child
                .wait_with_output()
                .await
                .map_err(|e| e.to_string())?
                .status;
            let body = std::fs::read(&file).unwrap_or_default();
            let mut sum = Fnv64::new();
            sum.update(&body);
            match status.success() {
                true => Ok((body.len() as u64, sum.finish())),
                false => Err(format!("curl {status} after {} bytes", body.len())),
            }
        });
        Download {
            protocol: if http2 { "h2" } else { "h1" },
            got: Progress::File(out),
            end,
        }
    }

    /// The project's HTTP/3 client, reading the body at [`RATE`].
    async fn h3(rm: &Ringmux, path: &str) -> Download {
        let client = rm.client();
        let conn = rm.connect(&client).await;
        let req = http::Request::get(path).body(()).unwrap();
        let got = Arc::new(AtomicU64::new(0));
        let counter = got.clone();
        let end = tokio::spawn(async move {
            // Both live as long as the download.
            let (_client, conn) = (client, conn);
            let mut stream = conn.open(req).await.map_err(|e| e.to_string())?;
            stream.finish().await.map_err(|e| e.to_string())?;
            let head = stream.recv_response().await.map_err(|e| e.to_string())?;
            if head.status() != 200 {
                return Err(format!("status {}", head.status()));
            }
            let (start, mut sum, mut len) = (tokio::time::Instant::now(), Fnv64::new(), 0u64);
            loop {
                let chunk = stream
                    .recv_data()
                    .await
                    .map_err(|e| format!("HTTP/3 body broke off after {len} bytes: {e}"))?;
                let Some(mut chunk) = chunk else { break };
                while chunk.has_remaining() {
                    let part = chunk.chunk();
                    sum.update(part);
                    len += part.len() as u64;
                    let n = part.len();
                    chunk.advance(n);
                }
                counter.store(len, Ordering::Relaxed);
                // The pace of a slow link: the rest waits in QUIC's flow control.
                let due = start + Duration::from_secs_f64(len as f64 / RATE as f64);
                tokio::time::sleep_until(due).await;
            }
            Ok((len, sum.finish()))
        });
        Download {
            protocol: "h3",
            got: Progress::Counter(got),
            end,
        }
    }

    fn received(&self) -> u64 {
        match &self.got {
            Progress::File(p) => std::fs::metadata(p).map_or(0, |m| m.len()),
            Progress::Counter(c) => c.load(Ordering::Relaxed),
        }
    }
}

/// Waits (bounded) until each download has more than `at_least` bytes.
async fn wait_received(downloads: &[&Download], at_least: &[u64], what: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let got: Vec<u64> = downloads.iter().map(|d| d.received()).collect();
        if got.iter().zip(at_least).all(|(g, min)| g > min) {
            return;
        }
        assert!(Instant::now() < deadline, "{what}: got {got:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The three downloads of `path`: HTTP/1.1, HTTP/2, HTTP/3.
async fn three_downloads(rm: &Ringmux, path: &str) -> Vec<Download> {
    let d = vec![
        Download::curl(rm, false, path),
        Download::curl(rm, true, path),
        Download::h3(rm, path).await,
    ];
    wait_received(
        &d.iter().collect::<Vec<_>>(),
        &[1 << 20; 3],
        "the downloads never started",
    )
    .await;
    d
}

/// The access log's lines for `path`, split into fields, once there are `n` (bounded).
async fn log_lines(log: &Path, path: &str, n: usize) -> Vec<Vec<String>> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        let lines: Vec<Vec<String>> = text
            .lines()
            .map(|l| l.split(' ').map(str::to_owned).collect::<Vec<_>>())
            .filter(|f| f.len() == 12 && f[5] == path)
            .collect();
        if lines.len() >= n {
            return lines;
        }
        assert!(
            Instant::now() < deadline,
            "{} of {n} access-log lines for {path}:\n{text}",
            lines.len()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// `name`'s value for generation `generation`, summed over instances and states.
fn of_generation(m: &Metrics, name: &str, generation: u64) -> f64 {
    m.samples(name)
        .iter()
        .filter(|(labels, _)| {
            labels
                .iter()
                .any(|(k, v)| k == "generation" && *v == generation.to_string())
        })
        .map(|(_, v)| v)
        .sum()
}

/// A ringmux of one instance writing its access log into a folder of its own, with `extra`
/// options: the folder (kept while it lives), the log's path, the ringmux.
fn logged_ringmux(extra: &[&str]) -> (ringmux_testkit::TempDir, PathBuf, Ringmux) {
    let logs = temp_dir("ringmux-drain-log");
    let log = logs.path().join("access.log");
    let log_arg = log.to_string_lossy().into_owned();
    let mut args = vec!["--access-log", log_arg.as_str()];
    args.extend_from_slice(extra);
    let rm = Ringmux::start(1, Forward::Shm, &args);
    (logs, log, rm)
}

fn have_curl() -> bool {
    tool::CURL.present()
}

/// Three slow downloads (about 13 s each, longer than the old 10 s grace period) across two
/// reloads and an upgrade, with no `--grace`: every byte arrives, the draining generation shows
/// its requests and its age, and each request's line ends `ok` with every byte.
#[tokio::test]
async fn slow_downloads_outlive_reloads_and_an_upgrade() {
    if !have_curl() {
        return;
    }
    bounded(Duration::from_secs(120), async {
        let (_logs, log, rm) = logged_ringmux(&[]);
        let n: u64 = 13 << 20;
        let path = format!("/bytes/{n}");
        let downloads = three_downloads(&rm, &path).await;
        let (ok, text) = rm.reload(Duration::from_secs(30)).await;
        assert!(ok, "first reload: {text}");
        // Generation 1 drains with the three requests, and says for how long.
        rm.wait_for(
            "generation 1 draining with 3 requests in flight",
            Duration::from_secs(10),
            |m| {
                of_generation(m, names::GENERATION_REQUESTS, 1) >= 3.0
                    && of_generation(m, names::GENERATION_DRAINING_SECONDS, 1) > 0.0
            },
        )
        .await;
        let before: Vec<u64> = downloads.iter().map(Download::received).collect();
        wait_received(
            &downloads.iter().collect::<Vec<_>>(),
            &before.iter().map(|b| b + (1 << 20)).collect::<Vec<_>>(),
            "the downloads went on after the reload",
        )
        .await;
        let (ok, text) = rm.reload(Duration::from_secs(30)).await;
        assert!(ok, "second reload: {text}");
        let (ok, text) = rm.upgrade(Duration::from_secs(30)).await;
        assert!(ok, "upgrade: {text}");
        let want = expected_bytes(n);
        for d in downloads {
            let got = bounded(Duration::from_secs(60), d.end).await.unwrap();
            assert_eq!(got, Ok(want), "{}: every byte, the right ones", d.protocol);
        }
        let lines = log_lines(&log, &path, 3).await;
        for protocol in ["h1", "h2", "h3"] {
            let line = lines
                .iter()
                .find(|f| f[2] == protocol)
                .unwrap_or_else(|| panic!("no {protocol} line in {lines:?}"));
            assert_eq!(
                [line[6].as_str(), line[7].as_str(), line[11].as_str()],
                ["200", n.to_string().as_str(), "ok"],
                "{line:?}"
            );
            assert!(line[8].parse::<f64>().is_ok(), "duration {line:?}");
        }
        let m = rm.metrics();
        assert_eq!(m.sum(names::WORKER_CUTS), 0.0, "nothing cut:\n{m}");
    })
    .await;
}

/// With `--grace 3` the same downloads are cut 3 s into the drain: each client sees its
/// download break off, and each request's line says `cut:drain` with the status and fewer
/// bytes than the body.
#[tokio::test]
async fn with_a_grace_period_the_cut_requests_are_logged_cut() {
    if !have_curl() {
        return;
    }
    bounded(Duration::from_secs(90), async {
        let (_logs, log, rm) = logged_ringmux(&["--grace", "3"]);
        let n: u64 = 13 << 20;
        let path = format!("/bytes/{n}");
        let downloads = three_downloads(&rm, &path).await;
        let (ok, text) = rm.reload(Duration::from_secs(30)).await;
        assert!(ok, "reload: {text}");
        for d in downloads {
            let got = bounded(Duration::from_secs(30), d.end).await.unwrap();
            assert!(got.is_err(), "{}: not cut: {got:?}", d.protocol);
        }
        let lines = log_lines(&log, &path, 3).await;
        for protocol in ["h1", "h2", "h3"] {
            let line = lines
                .iter()
                .find(|f| f[2] == protocol)
                .unwrap_or_else(|| panic!("no {protocol} line in {lines:?}"));
            assert_eq!([&line[6], &line[11]], ["200", "cut:drain"], "{line:?}");
            let bytes: u64 = line[7].parse().unwrap();
            assert!(bytes > 0 && bytes < n, "{line:?}");
        }
        let m = rm.metrics();
        assert!(m.sum(names::WORKER_CUTS) >= 1.0, "{m}");
        rm.wait_for_log("the cut", Duration::from_secs(5), |l| {
            l.contains("end of --grace")
        })
        .await;
    })
    .await;
}

/// A client that goes away in the middle of a download (curl killed over HTTP/1.1 and HTTP/2,
/// the HTTP/3 connection dropped, which closes it): each request's line says `cut:client`, with
/// the status and fewer bytes than the body; no worker is cut.
#[tokio::test]
async fn a_client_that_goes_away_is_logged_cut_client() {
    if !have_curl() {
        return;
    }
    bounded(Duration::from_secs(90), async {
        let (_logs, log, rm) = logged_ringmux(&[]);
        let n: u64 = 13 << 20;
        let path = format!("/bytes/{n}");
        let downloads = three_downloads(&rm, &path).await;
        for d in &downloads {
            // Dropping the task kills curl (kill_on_drop) or drops the HTTP/3 connection.
            d.end.abort();
        }
        let lines = log_lines(&log, &path, 3).await;
        for protocol in ["h1", "h2", "h3"] {
            let line = lines
                .iter()
                .find(|f| f[2] == protocol)
                .unwrap_or_else(|| panic!("no {protocol} line in {lines:?}"));
            assert_eq!([&line[6], &line[11]], ["200", "cut:client"], "{line:?}");
            let bytes: u64 = line[7].parse().unwrap();
            assert!(bytes > 0 && bytes < n, "{line:?}");
        }
        assert_eq!(rm.metrics().sum(names::WORKER_CUTS), 0.0);
    })
    .await;
}

/// A client that falls silent in the middle of an HTTP/3 download (aioquic stopped with
/// SIGSTOP: it neither reads nor acknowledges nor closes) is cut by the QUIC idle timeout
/// (`--idle-timeout 2`), and its line says `cut:timeout` with the status and fewer bytes than
/// the body.
#[tokio::test]
async fn a_silent_client_is_logged_cut_timeout() {
    if !tool::AIOQUIC.present() {
        return;
    }
    bounded(Duration::from_secs(90), async {
        let logs = temp_dir("ringmux-drain-log");
        let log = logs.path().join("access.log");
        let log_arg = log.to_string_lossy().into_owned();
        let rm = Ringmux::start(
            1,
            Forward::Shm,
            &["--access-log", &log_arg, "--idle-timeout", "2"],
        );
        let n: u64 = 64 << 20;
        let path = format!("/bytes/{n}");
        let mut client = tokio::process::Command::new("python3")
            .arg(ringmux_testkit::aioquic::script())
            .args(["127.0.0.1", &rm.listen.port().to_string(), "paths"])
            .args(["--server-name", "localhost", "--path", &path])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("python3");
        let pid = client.id().expect("a running client").to_string();
        rm.wait_for("the download in flight", Duration::from_secs(30), |m| {
            m.sum(names::GENERATION_REQUESTS) >= 1.0
        })
        .await;
        let stopped = std::process::Command::new("kill")
            .args(["-STOP", &pid])
            .status()
            .expect("kill");
        assert!(stopped.success());
        let lines = log_lines(&log, &path, 1).await;
        let _ = client.kill().await;
        let line = &lines[0];
        assert_eq!(
            [&line[2], &line[6], &line[11]],
            ["h3", "200", "cut:timeout"],
            "{line:?}"
        );
        let bytes: u64 = line[7].parse().unwrap();
        assert!(bytes < n, "{line:?}");
    })
    .await;
}

/// The worker processes of `rm` alive now.
fn workers(rm: &Ringmux) -> usize {
    harness::children_of(rm.pid)
        .into_iter()
        .filter(|&p| harness::is_worker(p))
        .count()
}

/// Waits (bounded) until `rm` has at most `n` worker processes.
async fn wait_workers_at_most(rm: &Ringmux, n: usize, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while workers(rm) > n {
        assert!(
            Instant::now() < deadline,
            "{what}: {} workers, expected at most {n}",
            workers(rm)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Reloads in a row under long downloads with `--max-draining 1`: once each reload is done
/// at most one generation drains beside the serving one, and the one cut is always the
/// oldest: the download of generation 1 first, while generation 2's goes on, then that one.
#[tokio::test]
async fn reloads_past_max_draining_cut_the_oldest_generation() {
    if !have_curl() {
        return;
    }
    bounded(Duration::from_secs(120), async {
        let logs = temp_dir("ringmux-drain-log");
        let log = logs.path().join("access.log");
        let log_arg = log.to_string_lossy().into_owned();
        let rm = Ringmux::start(
            1,
            Forward::Shm,
            &["--access-log", &log_arg, "--max-draining", "1"],
        );
        // About a minute each (the most /bytes/N serves, --max-bytes): longer than the test,
        // only a cut ends them.
        let n: u64 = 64 << 20;
        let path = format!("/bytes/{n}");
        let first = Download::curl(&rm, false, &path);
        wait_received(&[&first], &[1 << 20], "the first download never started").await;
        let (ok, text) = rm.reload(Duration::from_secs(30)).await;
        assert!(ok, "reload 1: {text}");
        let second = Download::curl(&rm, true, &path);
        wait_received(&[&second], &[1 << 20], "the second download never started").await;
        // Generation 3: 1 and 2 would drain; 1 is cut.
        let (ok, text) = rm.reload(Duration::from_secs(30)).await;
        assert!(ok, "reload 2: {text}");
        let got = bounded(Duration::from_secs(20), first.end).await.unwrap();
        assert!(got.is_err(), "generation 1's download not cut: {got:?}");
        assert!(
            !second.end.is_finished(),
            "generation 2's download was cut too"
        );
        wait_workers_at_most(&rm, 2, "after reload 2").await;
        let lines = log_lines(&log, &path, 1).await;
        assert_eq!(
            [&lines[0][2], &lines[0][11]],
            ["h1", "cut:drain"],
            "the oldest went first: {lines:?}"
        );
        // Three more in a row: the first cuts generation 2's download; never more than one
        // generation drains beside the serving one once a reload is done.
        for r in 3..=5 {
            let (ok, text) = rm.reload(Duration::from_secs(30)).await;
            assert!(ok, "reload {r}: {text}");
            wait_workers_at_most(&rm, 2, &format!("after reload {r}")).await;
        }
        let got = bounded(Duration::from_secs(20), second.end).await.unwrap();
        assert!(got.is_err(), "generation 2's download not cut: {got:?}");
        let lines = log_lines(&log, &path, 2).await;
        assert_eq!(
            lines
                .iter()
                .map(|f| format!("{} {} {}", f[2], f[6], f[11]))
                .collect::<Vec<_>>(),
            ["h1 200 cut:drain", "h2 200 cut:drain"]
        );
        for f in &lines {
            let bytes: u64 = f[7].parse().unwrap();
            assert!(bytes > 0 && bytes < n, "{f:?}");
        }
        let m = rm.metrics();
        assert!(m.sum(names::WORKER_CUTS) >= 2.0, "{m}");
    })
    .await;
}

/// `grace` is reloadable: a download drains with no clock, then a reload with `grace = 2` in
/// the configuration file bounds the drain under way too (counted from its start), and the
/// download is cut and logged so.
#[tokio::test]
async fn a_grace_set_by_a_reload_bounds_the_drains_under_way() {
    if !have_curl() {
        return;
    }
    bounded(Duration::from_secs(90), async {
        let files = temp_dir("ringmux-drain-config");
        let log = files.path().join("access.log");
        let config = files.path().join("ringmux.toml");
        let setting = |extra: &str| {
            let text = format!("access_log = {:?}\n{extra}", log.to_string_lossy());
            std::fs::write(&config, text).unwrap();
        };
        setting("");
        let config_arg = config.to_string_lossy().into_owned();
        let rm = Ringmux::start(1, Forward::Shm, &["--config", &config_arg]);
        let n: u64 = 64 << 20;
        let path = format!("/bytes/{n}");
        let download = Download::curl(&rm, false, &path);
        wait_received(&[&download], &[1 << 20], "the download never started").await;
        // Generation 1 drains with no clock.
        let (ok, text) = rm.reload(Duration::from_secs(30)).await;
        assert!(ok, "first reload: {text}");
        rm.wait_for(
            "generation 1 draining its download",
            Duration::from_secs(10),
            |m| of_generation(m, names::GENERATION_REQUESTS, 1) >= 1.0,
        )
        .await;
        assert!(!download.end.is_finished(), "cut with no grace");
        // Now bounded: generation 1's drain is cut (it began before this reload).
        setting("grace = 2\n");
        let (ok, text) = rm.reload(Duration::from_secs(30)).await;
        assert!(ok, "the reload that sets grace: {text}");
        let got = bounded(Duration::from_secs(20), download.end)
            .await
            .unwrap();
        assert!(got.is_err(), "not cut: {got:?}");
        let lines = log_lines(&log, &path, 1).await;
        assert_eq!(
            [&lines[0][2], &lines[0][6], &lines[0][11]],
            ["h1", "200", "cut:drain"]
        );
    })
    .await;
}

/// A stop drains the same way: after SIGTERM, with no grace, a slow download runs to its end
/// (ringmux still up meanwhile), its line says `ok`, and ringmux exits 0. A second SIGTERM
/// cuts: the download breaks off, and its line, `cut:drain`, is in the log when ringmux has
/// exited (the worker writes it before it exits, the demux before it does).
#[tokio::test]
async fn a_stop_drains_with_no_clock_and_a_second_signal_cuts_with_every_line_written() {
    if !have_curl() {
        return;
    }
    bounded(Duration::from_secs(90), async {
        for second_signal in [false, true] {
            let logs = temp_dir("ringmux-drain-log");
            let log = logs.path().join("access.log");
            let log_arg = log.to_string_lossy().into_owned();
            let mut rm = Ringmux::start(1, Forward::Shm, &["--access-log", &log_arg]);
            // About 6 s at the clients' pace; to be cut, more than the socket buffers on the
            // way (several MiB) can hold.
            let n: u64 = if second_signal { 64 << 20 } else { 6 << 20 };
            let path = format!("/bytes/{n}");
            let download = Download::curl(&rm, true, &path);
            wait_received(&[&download], &[1 << 20], "the download never started").await;
            rm.signal(libc::SIGTERM);
            let before = download.received();
            wait_received(
                &[&download],
                &[before + (1 << 20)],
                "no progress after SIGTERM",
            )
            .await;
            assert!(rm.running(), "ringmux exited with a request in flight");
            if second_signal {
                rm.signal(libc::SIGTERM);
            }
            let status = rm.wait_exit(Duration::from_secs(30)).await;
            assert!(status.success(), "ringmux exited with {status}");
            let got = bounded(Duration::from_secs(30), download.end)
                .await
                .unwrap();
            // Written before ringmux exited: read once, no waiting.
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            let line: Vec<&str> = text
                .lines()
                .find(|l| l.contains(&path))
                .unwrap_or_else(|| panic!("no line for {path} in:\n{text}"))
                .split(' ')
                .collect();
            if second_signal {
                assert!(got.is_err(), "not cut: {got:?}");
                assert_eq!(line[11], "cut:drain", "{line:?}");
                assert!(line[7].parse::<u64>().unwrap() < n, "{line:?}");
            } else {
                assert_eq!(got, Ok(expected_bytes(n)));
                assert_eq!([line[7], line[11]], [n.to_string().as_str(), "ok"]);
            }
        }
    })
    .await;
}
