//! One `ringmux` under test: started with sink workers, found (`data-plane` thread, worker
//! pids), parked and resumed with SIGSTOP/SIGCONT, scraped over its Prometheus endpoint, and
//! stopped (SIGTERM, then SIGKILL if it lingers; also on drop, so a failing run leaves nothing).

use std::io::{BufRead, BufReader};
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use ringmux_demux::metrics::names;

use super::os;

/// How to start ringmux.
#[derive(Clone, Debug)]
pub struct Spec {
    pub ringmux: PathBuf,
    pub worker: PathBuf,
    pub instances: u8,
    /// `shm`, `unix` or `drop`.
    pub forward: String,
    /// `sink` (fwd-bench) or `http`.
    pub worker_mode: String,
    pub rcvbuf: usize,
    /// `--cpus`: demux first, then instances.
    pub cpus: Option<String>,
    pub key_file: PathBuf,
    /// The loopback address ringmux listens on (`127.0.0.1` or `::1`); the sender follows.
    pub loopback: IpAddr,
    /// Where ringmux's stderr goes.
    pub log: PathBuf,
    /// Anything else (`--spin-us 50`, `--ring-slots 4096`, ...).
    pub extra: Vec<String>,
}

/// A running ringmux.
pub struct Ringmux {
    child: Option<Child>,
    pub pid: u32,
    pub listen: SocketAddr,
    pub metrics: SocketAddr,
    /// The `data-plane` thread: the demux cost is its CPU time.
    pub data_plane: u32,
    log: PathBuf,
    stopped: bool,
}

impl Ringmux {
    /// Starts ringmux and waits (up to 30 s) for its `ringmux ready ...` line.
    pub fn start(spec: &Spec) -> Result<Self> {
        let log = std::fs::File::create(&spec.log)
            .with_context(|| format!("creating {}", spec.log.display()))?;
        let mut cmd = Command::new(&spec.ringmux);
        cmd.arg("--listen")
            .arg(SocketAddr::new(spec.loopback, 0).to_string())
            .args(["--metrics", "127.0.0.1:0"])
            .args(["--instances", &spec.instances.to_string()])
            .args(["--forward", &spec.forward])
            .args(["--worker-mode", &spec.worker_mode])
            .arg("--worker-bin")
            .arg(&spec.worker)
            .arg("--key-file")
            .arg(&spec.key_file)
            .args(["--rcvbuf", &spec.rcvbuf.to_string()])
            .args(["--grace", "2"]);
        if let Some(c) = &spec.cpus {
            cmd.args(["--cpus", c]);
        }
        cmd.args(&spec.extra)
            .env(
                "RUST_LOG",
                std::env::var("RUST_LOG")
                    .ok()
                    .filter(|v| !v.is_empty())
                    .unwrap_or_else(|| "warn".into()),
            )
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log);
        let mut child = cmd
            .spawn()
            .with_context(|| format!("starting {}", spec.ringmux.display()))?;
        let stdout = child.stdout.take().context("ringmux stdout")?;
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(|l| l.ok()) {
                if line.starts_with("ringmux ready") {
                    let _ = tx.send(line);
                }
            }
        });
        let mut rm = Ringmux {
            child: Some(child),
            pid: 0,
            listen: "0.0.0.0:0".parse()?,
            metrics: "0.0.0.0:0".parse()?,
            data_plane: 0,
            log: spec.log.clone(),
            stopped: false,
        };
        let line = match rx.recv_timeout(Duration::from_secs(30)) {
            Ok(l) => l,
            Err(_) => bail!(
                "ringmux did not print its ready line in 30 s; log {}:\n{}",
                spec.log.display(),
                rm.log_tail()
            ),
        };
        let field = |k: &str| {
            line.split_ascii_whitespace()
                .find_map(|w| w.strip_prefix(k))
                .ok_or_else(|| anyhow!("no {k} in {line:?}"))
        };
        rm.listen = field("listen=")?.parse().context("listen= address")?;
        rm.metrics = field("metrics=")?
            .parse()
            .context("metrics= address (not off)")?;
        rm.pid = field("pid=")?.parse().context("pid=")?;
        let deadline = Instant::now() + Duration::from_secs(5);
        rm.data_plane = loop {
            if let Some(t) = os::thread_by_name(rm.pid, "data-plane")? {
                break t;
            }
            if Instant::now() > deadline {
                bail!("ringmux {} has no thread named data-plane", rm.pid);
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        Ok(rm)
    }

    /// Waits until every sink has reported its pid (`ringmux_worker_pid`), which also means
    /// the sinks are attached and running.
    pub fn worker_pids(&self, instances: u8, timeout: Duration) -> Result<Vec<u32>> {
        let deadline = Instant::now() + timeout;
        loop {
            let m = self.scrape()?;
            let pids: Vec<u32> = (0..instances)
                .map(|i| m.instance(names::WORKER_PID, i) as u32)
                .collect();
            if pids.iter().all(|p| *p != 0) {
                return Ok(pids);
            }
            if Instant::now() > deadline {
                bail!("workers did not report their pids within {timeout:?}: {pids:?}");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Parks the whole demux process (SIGSTOP) and waits until the data plane is stopped.
    pub fn park(&mut self) -> Result<()> {
        os::signal(self.pid, libc::SIGSTOP)?;
        self.stopped = true;
        if !os::wait_state(
            self.pid,
            self.data_plane,
            &['T', 't'],
            Duration::from_secs(2),
        )? {
            bail!("ringmux {} did not stop", self.pid);
        }
        Ok(())
    }

    /// Resumes a parked demux (SIGCONT).
    pub fn resume(&mut self) -> Result<()> {
        os::signal(self.pid, libc::SIGCONT)?;
        self.stopped = false;
        Ok(())
    }

    /// Fetches and parses `/metrics`. Never call it while parked: the metrics thread is
    /// stopped too.
    pub fn scrape(&self) -> Result<Metrics> {
        fetch_metrics(self.metrics)
    }

    /// Scrapes until the datagram counters have not moved for `quiet` (longer than the
    /// sinks' 250 ms report period and the demux's 100 ms gauge period), up to `timeout`.
    pub fn settle(&self, quiet: Duration, timeout: Duration) -> Result<Metrics> {
        let deadline = Instant::now() + timeout;
        let mut last = self.scrape()?;
        let mut since = Instant::now();
        loop {
            std::thread::sleep(Duration::from_millis(50));
            let m = self.scrape()?;
            if fingerprint(&m) != fingerprint(&last) {
                last = m;
                since = Instant::now();
            } else if since.elapsed() >= quiet {
                return Ok(m);
            }
            if Instant::now() > deadline {
                bail!("ringmux counters still moving after {timeout:?}");
            }
        }
    }

    /// The last lines of ringmux's stderr, for error messages.
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }

    /// SIGTERM, wait for exit (workers drain within `--grace`), SIGKILL after 5 s.
    pub fn shutdown(mut self) -> Result<()> {
        self.terminate()
    }

    fn terminate(&mut self) -> Result<()> {
        let Some(mut child) = self.child.take() else {
            return Ok(());
        };
        if self.stopped {
            let _ = os::signal(self.pid, libc::SIGCONT);
        }
        let _ = os::signal(self.pid, libc::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            if child.try_wait()?.is_some() {
                return Ok(());
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                bail!("ringmux {} ignored SIGTERM for 5 s; killed", self.pid);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Ringmux {
    fn drop(&mut self) {
        let _ = self.terminate();
    }
}

/// One scrape of ringmux's metrics (the demux's own reader of its text format).
pub use ringmux_demux::metrics::Scrape as Metrics;

/// The counters that must stop moving before a run is read.
fn fingerprint(m: &Metrics) -> [u64; 6] {
    [
        m.sum(names::RECEIVED),
        m.sum(names::FORWARDED),
        m.sum(names::DROPPED),
        m.sum(names::WORKER_DATAGRAMS),
        m.sum(names::WORKER_DATAGRAMS_DROPPED),
        m.sum(names::DOORBELLS),
    ]
    .map(|v| v as u64)
}

/// `GET /metrics` over plain HTTP/1.1.
pub fn fetch_metrics(addr: SocketAddr) -> Result<Metrics> {
    ringmux_demux::metrics::fetch(addr)
}
