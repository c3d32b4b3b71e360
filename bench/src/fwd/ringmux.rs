//! One `ringmux` under test: started with sink workers, found (`data-plane` thread, worker
//! pids), parked and resumed with SIGSTOP/SIGCONT, scraped over its Prometheus endpoint, and
//! stopped (SIGTERM, then SIGKILL if it lingers; also on drop, so a failing run leaves nothing).

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};

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
        cmd.args(["--listen", "127.0.0.1:0", "--metrics", "127.0.0.1:0"])
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
                .map(|i| m.labelled("ringmux_worker_pid", "instance", &i.to_string()) as u32)
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
            if m.fingerprint() != last.fingerprint() {
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

/// One Prometheus text scrape: series (`name{labels}`) → value.
#[derive(Clone, Debug, Default)]
pub struct Metrics {
    pub series: BTreeMap<String, f64>,
}

impl Metrics {
    pub fn parse(text: &str) -> Metrics {
        let series = text
            .lines()
            .filter(|l| !l.starts_with('#'))
            .filter_map(|l| {
                let (k, v) = l.rsplit_once(' ')?;
                Some((k.to_string(), v.parse().ok()?))
            })
            .collect();
        Metrics { series }
    }

    /// Sum of every series of metric `name` (all label sets).
    pub fn sum(&self, name: &str) -> f64 {
        self.series
            .iter()
            .filter(|(k, _)| {
                k.as_str() == name || k.strip_prefix(name).is_some_and(|r| r.starts_with('{'))
            })
            .map(|(_, v)| v)
            .sum()
    }

    /// The series of `name` with `label="value"`, 0 if absent.
    pub fn labelled(&self, name: &str, label: &str, value: &str) -> f64 {
        self.series
            .get(&format!("{name}{{{label}=\"{value}\"}}"))
            .copied()
            .unwrap_or(0.0)
    }

    /// Every `label` value of `name` with its value.
    pub fn by_label(&self, name: &str, label: &str) -> BTreeMap<String, f64> {
        let prefix = format!("{name}{{{label}=\"");
        self.series
            .iter()
            .filter_map(|(k, v)| {
                let rest = k.strip_prefix(&prefix)?;
                Some((rest.split('"').next()?.to_string(), *v))
            })
            .collect()
    }

    /// Largest value among the series of `name`.
    pub fn max(&self, name: &str) -> f64 {
        self.by_label(name, "instance")
            .values()
            .copied()
            .fold(0.0, f64::max)
    }

    /// The counters that must stop moving before a run is read.
    fn fingerprint(&self) -> [u64; 6] {
        [
            self.sum("ringmux_datagrams_received_total"),
            self.sum("ringmux_datagrams_forwarded_total"),
            self.sum("ringmux_datagrams_dropped_total"),
            self.sum("ringmux_worker_datagrams_total"),
            self.sum("ringmux_worker_datagrams_dropped_total"),
            self.sum("ringmux_doorbells_total"),
        ]
        .map(|v| v as u64)
    }
}

/// `GET /metrics` over plain HTTP/1.1.
pub fn fetch_metrics(addr: SocketAddr) -> Result<Metrics> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2))
        .with_context(|| format!("connecting to metrics at {addr}"))?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    // One write: ringmux answers as soon as it has the request line and closes; a request
    // written in pieces would meet a closed socket (EPIPE) or make the close a reset.
    let req = format!("GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    s.write_all(req.as_bytes())
        .with_context(|| format!("requesting metrics from {addr}"))?;
    let mut text = String::new();
    s.read_to_string(&mut text)
        .with_context(|| format!("reading metrics from {addr}"))?;
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b)
        .ok_or_else(|| anyhow!("malformed HTTP response from {addr}"))?;
    Ok(Metrics::parse(body))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_prometheus_text() {
        let m = Metrics::parse(
            "# HELP x y\nringmux_datagrams_received_total 12\n\
             ringmux_datagrams_dropped_total{reason=\"ring_full\"} 3\n\
             ringmux_datagrams_dropped_total{reason=\"oversize\"} 4\n\
             ringmux_worker_pid{instance=\"0\"} 77\n\
             ringmux_worker_pid{instance=\"1\"} 78\n# EOF\n",
        );
        assert_eq!(m.sum("ringmux_datagrams_received_total"), 12.0);
        assert_eq!(m.sum("ringmux_datagrams_dropped_total"), 7.0);
        assert_eq!(m.labelled("ringmux_worker_pid", "instance", "1"), 78.0);
        assert_eq!(
            m.by_label("ringmux_datagrams_dropped_total", "reason")["ring_full"],
            3.0
        );
        assert_eq!(m.max("ringmux_worker_pid"), 78.0);
        assert_eq!(m.sum("ringmux_datagrams"), 0.0);
    }
}
