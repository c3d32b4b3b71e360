//! End-to-end test harness: starts a real `ringmux` (and so its `ringmux-worker` children) on
//! loopback, reads its ready line, scrapes its Prometheus metrics, and kills the whole process
//! tree when dropped, also when the test panics (then the tail of ringmux's log is printed).
//!
//! It also knows ringmux's routing: every start gets a fresh key file, so the harness builds the
//! same QUIC-LB [`Router`] as the demux and can choose client DCIDs that land on a given
//! instance (quinn through [`Ringmux::pinned_client`], gtlsclient through `--dcid`).
//!
//! The binaries it runs are the workspace's, found where cargo builds them ([`binary`]).

use ringmux_demux::metrics::names;
use ringmux_testkit::{temp_dir, TempDir};
use std::fs::File;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use quinn::ConnectionId;
use ringmux_quic_lb::{KeySet, QuicLbConfig, Router};
use ringmux_testkit::client::{client_config, Fnv64, H3Client, H3Conn, Response};

/// Name the tests use as SNI / :authority host (the self-signed certificate covers it, and the
/// test client accepts any certificate anyway).
pub const SERVER_NAME: &str = "localhost";

/// How datagrams go from the demux to the workers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Forward {
    Shm,
    Unix,
    /// Kernel steering (`--forward reuseport`, which brings `--plaintext-cids`).
    Reuseport,
}

impl Forward {
    pub fn as_arg(self) -> &'static str {
        match self {
            Forward::Shm => "shm",
            Forward::Unix => "unix",
            Forward::Reuseport => "reuseport",
        }
    }
}

/// A running ringmux. Dropping it SIGKILLs the demux and any worker still around.
pub struct Ringmux {
    pub listen: SocketAddr,
    pub metrics: SocketAddr,
    pub pid: u32,
    pub instances: u8,
    /// The demux's routing function (same keys and QUIC-LB configuration).
    pub router: Router,
    child: Option<Child>,
    dir: TempDir,
    /// `--control-socket`.
    control: PathBuf,
}

/// Everything [`Ringmux::launch`] starts a demux with.
pub struct Launch<'a> {
    /// Its files: the key file, the control socket, `ringmux.log`.
    pub dir: TempDir,
    /// The demux binary (a copy an upgrade test can replace, or [`binary`]`("ringmux")`).
    pub demux: &'a Path,
    pub instances: u8,
    pub forward: Forward,
    /// Further arguments; the harness adds its own defaults for those not given here.
    pub extra: &'a [&'a str],
    pub worker_bin: PathBuf,
    /// Extra environment for the demux, which its workers inherit.
    pub env: &'a [(&'a str, String)],
    /// The demux's standard error (`None`: the file `ringmux.log` in `dir`, which
    /// [`Ringmux::log_tail`] reads).
    pub stderr: Option<std::os::fd::OwnedFd>,
}

impl Ringmux {
    /// Starts ringmux with `instances` workers in `forward` mode plus `extra` arguments, and
    /// waits (bounded) for its ready line.
    pub fn start(instances: u8, forward: Forward, extra: &[&str]) -> Ringmux {
        Ringmux::start_with(instances, forward, extra, worker_bin(), &[])
    }

    /// As [`Ringmux::start`], with another worker binary and extra environment for the demux
    /// (which its workers inherit).
    pub fn start_with(
        instances: u8,
        forward: Forward,
        extra: &[&str],
        worker_bin: PathBuf,
        env: &[(&str, String)],
    ) -> Ringmux {
        let dir = temp_dir("ringmux-e2e");
        Ringmux::start_in(
            dir,
            &binary("ringmux"),
            instances,
            forward,
            extra,
            worker_bin,
            env,
        )
    }

    /// As [`Ringmux::start`], running the demux binary `demux` (a copy an upgrade test can
    /// replace) with its files in `dir`.
    pub fn start_in(
        dir: TempDir,
        demux: &Path,
        instances: u8,
        forward: Forward,
        extra: &[&str],
        worker_bin: PathBuf,
        env: &[(&str, String)],
    ) -> Ringmux {
        Ringmux::launch(Launch {
            dir,
            demux,
            instances,
            forward,
            extra,
            worker_bin,
            env,
            stderr: None,
        })
    }

    /// Starts ringmux as `launch` says and waits (bounded) for its ready line.
    pub fn launch(launch: Launch<'_>) -> Ringmux {
        let Launch {
            dir,
            demux,
            instances,
            forward,
            extra,
            worker_bin,
            env,
            stderr,
        } = launch;
        let keys = KeySet::generate().expect("generating keys");
        let key_file = dir.path().join("keys");
        keys.write_new(&key_file).expect("writing the key file");
        // Same QUIC-LB configuration as ringmux's defaults (node 00, config 0, nonce filling
        // one AES block), so this router agrees with the demux's.
        let lb = QuicLbConfig {
            config_id: 0,
            node_id: vec![0],
            instance_count: instances,
            nonce_len: 14,
            key: (forward != Forward::Reuseport && !extra.contains(&"--plaintext-cids"))
                .then_some(keys.quic_lb),
        };
        let router = Router::new(&lb, keys.routing_hash).expect("QUIC-LB router");

        let log: Stdio = match stderr {
            Some(fd) => fd.into(),
            None => File::create(dir.path().join("ringmux.log"))
                .expect("creating the log file")
                .into(),
        };
        let instances_arg = instances.to_string();
        let worker_bin_arg = worker_bin.to_string_lossy().into_owned();
        let key_file_arg = key_file.to_string_lossy().into_owned();
        let control_arg = dir
            .path()
            .join("control.sock")
            .to_string_lossy()
            .into_owned();
        let mut args: Vec<&str> = Vec::new();
        if !extra.contains(&"--control-socket") {
            args.extend(["--control-socket", &control_arg]);
        }
        if !extra.contains(&"--listen") {
            args.extend(["--listen", "127.0.0.1:0"]);
        }
        args.extend([
            "--metrics",
            "127.0.0.1:0",
            "--instances",
            &instances_arg,
            "--forward",
            forward.as_arg(),
            "--worker-bin",
            &worker_bin_arg,
        ]);
        // A test that shares one key file between two ringmux processes gives its own.
        if !extra.contains(&"--key-file") {
            args.extend(["--key-file", &key_file_arg]);
        }
        if forward == Forward::Reuseport && !extra.contains(&"--plaintext-cids") {
            args.push("--plaintext-cids");
        }
        // As root, ringmux runs its workers as nobody, who must be able to execute them. Where
        // this build's folder is closed to nobody, keep them root (without capabilities) and
        // say so: the tests that need the default copy the binaries somewhere open.
        if nix::unistd::geteuid().is_root()
            && !extra.contains(&"--worker-user")
            && !open_to_others(Path::new(&worker_bin_arg))
        {
            eprintln!(
                "note: {worker_bin_arg} is not executable by nobody: the workers run as root \
                 (--worker-user root)"
            );
            args.extend(["--worker-user", "root"]);
        }
        // Unprivileged, ringmux cannot give its workers a user of their own: accept its own.
        if !nix::unistd::geteuid().is_root() && !extra.contains(&"--worker-user") {
            args.extend(["--worker-user", "self"]);
        }
        // The fault worker (test-tools/fault-worker) writes its marker and report beside the
        // marker and becomes the real worker: both granted by the workers' allow-list.
        let fault_files: Vec<String> = env
            .iter()
            .filter_map(|(k, v)| match *k {
                "RINGMUX_FAULT_MARKER" => Path::new(v)
                    .parent()
                    .map(|d| format!("--worker-write={}", d.display())),
                "RINGMUX_REAL_WORKER" => Some(format!("--worker-read={v}")),
                _ => None,
            })
            .collect();
        args.extend(fault_files.iter().map(String::as_str));
        args.extend_from_slice(extra);
        let mut child = Command::new(demux)
            .args(&args)
            .env(
                "RUST_LOG",
                std::env::var("RUST_LOG").unwrap_or("info".into()),
            )
            .env("NO_COLOR", "1")
            .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log)
            .spawn()
            .expect("spawning ringmux");
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if line.starts_with("ringmux ready ") {
                    let _ = tx.send(line);
                }
            }
        });
        let mut rm = Ringmux {
            listen: "0.0.0.0:0".parse().unwrap(),
            metrics: "0.0.0.0:0".parse().unwrap(),
            pid: child.id(),
            instances,
            router,
            child: Some(child),
            control: PathBuf::from(
                extra
                    .iter()
                    .position(|a| *a == "--control-socket")
                    .and_then(|i| extra.get(i + 1))
                    .map_or(control_arg.as_str(), |p| *p),
            ),
            dir,
        };
        let line = match rx.recv_timeout(Duration::from_secs(30)) {
            Ok(line) => line,
            Err(_) => {
                let status = rm.child.as_mut().and_then(|c| c.try_wait().ok()).flatten();
                panic!(
                    "ringmux did not print its ready line within 30 s (exit status {status:?}); \
                     args {args:?}\n--- log ---\n{}",
                    rm.log_tail(60)
                );
            }
        };
        let field = |name: &str| -> String {
            line.split_whitespace()
                .find_map(|kv| kv.strip_prefix(name))
                .unwrap_or_else(|| panic!("no {name} in ready line {line:?}"))
                .to_string()
        };
        rm.listen = field("listen=").parse().expect("listen address");
        rm.metrics = field("metrics=").parse().expect("metrics address");
        let pid: u32 = field("pid=").parse().expect("pid");
        assert_eq!(pid, rm.pid, "ready line pid vs spawned child");
        rm
    }

    /// The control socket `ringmux reload` talks to.
    pub fn control_socket(&self) -> PathBuf {
        self.control.clone()
    }

    /// Runs `ringmux reload` against this ringmux (bounded by `timeout`): its exit status and
    /// what it printed (stdout, then stderr).
    pub async fn reload(&self, timeout: Duration) -> (bool, String) {
        self.ask("reload", timeout).await
    }

    /// Runs `ringmux upgrade` against this ringmux, as [`Ringmux::reload`] does `reload`.
    pub async fn upgrade(&self, timeout: Duration) -> (bool, String) {
        self.ask("upgrade", timeout).await
    }

    async fn ask(&self, what: &str, timeout: Duration) -> (bool, String) {
        let out = tokio::process::Command::new(binary("ringmux"))
            .arg(what)
            .arg("--control-socket")
            .arg(self.control_socket())
            .arg("--timeout")
            .arg(timeout.as_secs().max(1).to_string())
            .kill_on_drop(true)
            .output();
        let out = bounded(timeout + Duration::from_secs(5), out)
            .await
            .unwrap_or_else(|e| panic!("running ringmux {what}: {e}"));
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        (out.status.success(), text)
    }

    /// One scrape of `/metrics`.
    pub fn metrics(&self) -> Metrics {
        ringmux_demux::metrics::fetch(self.metrics)
            .unwrap_or_else(|e| panic!("scraping {}: {e:#}", self.metrics))
    }

    /// Polls the metrics until `pred` holds; panics with the last scrape and `what` after
    /// `timeout`.
    pub async fn wait_for(
        &self,
        what: &str,
        timeout: Duration,
        pred: impl Fn(&Metrics) -> bool,
    ) -> Metrics {
        let deadline = Instant::now() + timeout;
        loop {
            let m = self.metrics();
            if pred(&m) {
                return m;
            }
            if Instant::now() >= deadline {
                panic!("timed out after {timeout:?} waiting for {what}; last metrics:\n{m}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits until ringmux's (and its workers') log satisfies `pred`, polling every 50 ms up to
    /// `timeout`, and returns the log then. A line a worker wrote reaches the file through the
    /// demux's log thread, after the response that caused it: read the log through this, not at
    /// once after a request.
    pub async fn wait_for_log(
        &self,
        what: &str,
        timeout: Duration,
        pred: impl Fn(&str) -> bool,
    ) -> String {
        let path = self.dir.path().join("ringmux.log");
        let deadline = Instant::now() + timeout;
        loop {
            let log = std::fs::read_to_string(&path).unwrap_or_default();
            if pred(&log) {
                return log;
            }
            if Instant::now() >= deadline {
                panic!("timed out after {timeout:?} waiting for {what} in the log:\n{log}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits for a quiet moment at which every received datagram is accounted for:
    /// `received == Σ forwarded + Σ dropped`.
    pub async fn wait_balanced(&self, timeout: Duration) -> Metrics {
        self.wait_for(
            "received == Σforwarded + Σdropped",
            timeout,
            Metrics::balanced,
        )
        .await
    }

    /// The pid the demux reports for every instance (`ringmux_worker_pid`), once all are
    /// non-zero; checked against the demux's actual children.
    pub async fn worker_pids(&self) -> Vec<u32> {
        let n = self.instances;
        let m = self
            .wait_for(
                "ringmux_worker_pid of every instance to be set (workers report once a second)",
                Duration::from_secs(5),
                |m| (0..n).all(|i| m.instance(names::WORKER_PID, i) > 0.0),
            )
            .await;
        let pids: Vec<u32> = (0..n)
            .map(|i| m.instance(names::WORKER_PID, i) as u32)
            .collect();
        let mut children = children_of(self.pid);
        children.sort_unstable();
        let mut sorted = pids.clone();
        sorted.sort_unstable();
        assert_eq!(
            sorted, children,
            "ringmux_worker_pid values vs the demux's child processes"
        );
        pids
    }

    /// Sends `sig` to the demux.
    pub fn signal(&self, sig: libc::c_int) {
        // Our own child, not reaped yet: the pid is still its.
        let sig = nix::sys::signal::Signal::try_from(sig).expect("a signal number");
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.pid as i32), sig)
            .unwrap_or_else(|e| panic!("kill({}, {sig}): {e}", self.pid));
    }

    /// Waits (bounded) for the demux to exit and reaps it.
    pub async fn wait_exit(&mut self, timeout: Duration) -> ExitStatus {
        let deadline = Instant::now() + timeout;
        let child = self.child.as_mut().expect("ringmux already reaped");
        loop {
            if let Some(status) = child.try_wait().expect("waitpid") {
                return status;
            }
            if Instant::now() >= deadline {
                panic!("ringmux did not exit within {timeout:?}");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Whether the demux is still running.
    pub fn running(&mut self) -> bool {
        match self.child.as_mut() {
            Some(c) => c.try_wait().expect("waitpid").is_none(),
            None => false,
        }
    }

    /// A scratch directory removed with this ringmux.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Last `lines` lines of ringmux's (and its workers') log.
    pub fn log_tail(&self, lines: usize) -> String {
        let text = std::fs::read_to_string(self.dir.path().join("ringmux.log")).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    /// A random DCID of `len` bytes that the demux routes to `instance`.
    pub fn dcid_for(&self, instance: u8, len: usize) -> Vec<u8> {
        dcid_routed_to(&self.router, instance, len)
    }

    /// A quinn/h3 client whose connections all start with DCIDs routed to `instance`.
    pub fn pinned_client(&self, instance: u8) -> H3Client {
        let mut c = self.client();
        pin(&mut c, self.router.clone(), move || instance);
        c
    }

    /// A quinn/h3 client; the demux picks the instance from its random DCIDs.
    pub fn client(&self) -> H3Client {
        H3Client::new(client_config(None).expect("client config"), self.listen)
            .expect("binding the client")
    }

    /// Connects `client` to this ringmux.
    pub async fn connect(&self, client: &H3Client) -> H3Conn {
        client
            .connect(self.listen, SERVER_NAME)
            .await
            .unwrap_or_else(|e| panic!("connecting to ringmux at {}: {e}", self.listen))
    }
}

impl Drop for Ringmux {
    fn drop(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        let workers = children_of(self.pid);
        let _ = child.kill();
        let _ = child.wait();
        // The workers die with the demux (PR_SET_PDEATHSIG); make sure anyway, but only
        // processes that still are ringmux workers.
        for pid in workers {
            if is_worker(pid) {
                let _ = kill(pid);
            }
        }
        if std::thread::panicking() {
            eprintln!(
                "--- ringmux log (last 80 lines) ---\n{}\n--- end of ringmux log ---",
                self.log_tail(80)
            );
        }
    }
}

/// What `ringmux-fault-worker` recorded in `DIR/played.report` (its `name=value` lines), once
/// it has written it, waiting at most `timeout`.
///
/// # Panics
/// If no report was written within `timeout`.
pub async fn fault_report(
    dir: &Path,
    timeout: Duration,
) -> std::collections::HashMap<String, String> {
    let path = dir.join("played.report");
    let deadline = Instant::now() + timeout;
    loop {
        if let Ok(text) = std::fs::read_to_string(&path) {
            return text
                .lines()
                .filter_map(|l| l.split_once('='))
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
        }
        assert!(
            Instant::now() < deadline,
            "the fault worker wrote no report within {timeout:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A client nobody here wrote (Debian's gtlsclient) fetches `/hello.txt` from instance
/// `instance`. Skipped (said loudly) where it is not installed, except under CI.
pub async fn third_party_served(rm: &Ringmux, instance: u8) {
    if !ringmux_testkit::tool::GTLSCLIENT.present() {
        return;
    }
    let log = gtls_get(rm, &rm.dcid_for(instance, 18), "/hello.txt").await;
    assert!(
        log.contains("[:status: 200]"),
        "gtlsclient got no 200:\n{}",
        log.lines().rev().take(30).collect::<Vec<_>>().join("\n")
    );
}

/// One gtlsclient GET of `path` whose first Initial goes to `dcid`: what it printed (all of it
/// goes to stderr; it exits 0 whatever happened).
pub async fn gtls_get(rm: &Ringmux, dcid: &[u8], path: &str) -> String {
    let port = rm.listen.port().to_string();
    let out = tokio::process::Command::new("gtlsclient")
        .args([
            "--exit-on-all-streams-close",
            "--no-quic-dump",
            "--no-http-dump",
            "--timeout=10s",
            "--handshake-timeout=5s",
            &format!("--dcid={}", hex(dcid)),
            "127.0.0.1",
            &port,
            &format!("https://127.0.0.1:{port}{path}"),
        ])
        .current_dir(rm.dir())
        .stdin(Stdio::null())
        .kill_on_drop(true)
        .output();
    let out = bounded(Duration::from_secs(60), out)
        .await
        .expect("running gtlsclient");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// The `ringmux-worker` binary, the built-in server.
pub fn worker_bin() -> PathBuf {
    binary("ringmux-worker")
}

/// The binary `name` (or `examples/NAME`, an example) of this workspace's build: in the folder
/// cargo builds binaries into (`target/debug`, where `CARGO_BIN_EXE_*` point), the parent of the
/// `deps` folder holding the test executable that runs this.
///
/// # Panics
/// If it is not there: a package's tests build only that package's binaries, so the tests
/// need `cargo build --workspace --bins --examples` first (scripts/test.sh does it).
pub fn binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("the path of this test executable");
    let mut dir = exe.parent().expect("the folder of this test executable");
    if dir.file_name().is_some_and(|n| n == "deps") {
        dir = dir.parent().expect("the folder above deps");
    }
    let path = dir.join(name);
    assert!(
        path.is_file(),
        "{} is missing: run `cargo build --workspace --bins --examples` before these tests",
        path.display()
    );
    path
}

/// One scrape of the metrics, read by the demux's own reader.
pub use ringmux_demux::metrics::Scrape as Metrics;

/// Makes every new connection of `client` start with a random 20-byte DCID that `router`
/// sends to the instance `target()` names at that moment.
pub fn pin(client: &mut H3Client, router: Router, target: impl Fn() -> u8 + Send + Sync + 'static) {
    client.set_initial_dst_cid_provider(Arc::new(move || {
        ConnectionId::new(&dcid_routed_to(&router, target(), 20))
    }));
}

/// A random DCID of `len` bytes (8..=20) routed to `instance` by `router`.
pub fn dcid_routed_to(router: &Router, instance: u8, len: usize) -> Vec<u8> {
    assert!(instance < router.instance_count());
    for _ in 0..100_000 {
        let dcid = random_bytes(len);
        if router.route_dcid(&dcid).instance() == Some(instance) {
            return dcid;
        }
    }
    panic!("no DCID found for instance {instance}");
}

/// Not cryptographic: SplitMix64 over a clock-seeded global counter.
pub fn random_u64() -> u64 {
    static STATE: AtomicU64 = AtomicU64::new(0);
    let seed = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let _ = STATE.compare_exchange(0, seed | 1, Ordering::Relaxed, Ordering::Relaxed);
    let mut z = STATE.fetch_add(0x9e37_79b9_7f4a_7c15, Ordering::Relaxed);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

pub fn random_bytes(len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        out.extend_from_slice(&random_u64().to_le_bytes());
    }
    out.truncate(len);
    out
}

/// The `/bytes/n` body ringmux serves, as (length, FNV-1a 64).
pub fn expected_bytes(n: u64) -> (u64, u64) {
    let mut sum = Fnv64::new();
    let mut buf = vec![0u8; 64 << 10];
    let mut offset = 0u64;
    while offset < n {
        let len = (n - offset).min(buf.len() as u64) as usize;
        ringmux_server::reply::fill_pattern(offset, &mut buf[..len]);
        sum.update(&buf[..len]);
        offset += len as u64;
    }
    (n, sum.finish())
}

/// Checks a `/bytes/n` response: status 200, length and content.
pub fn check_bytes(what: &str, resp: &Response, n: u64) {
    assert_eq!(resp.status, 200, "{what}: status");
    let (len, sum) = expected_bytes(n);
    assert_eq!(resp.body_len, len, "{what}: body length of /bytes/{n}");
    assert_eq!(
        resp.body_checksum, sum,
        "{what}: body checksum of /bytes/{n} (content differs from fill_pattern)"
    );
}

/// Runs `fut` with a deadline; a test that hangs fails instead.
pub async fn bounded<T>(limit: Duration, fut: impl std::future::Future<Output = T>) -> T {
    match tokio::time::timeout(limit, fut).await {
        Ok(v) => v,
        Err(_) => panic!("test did not finish within {limit:?}"),
    }
}

/// Direct children of `pid` (all its threads).
pub fn children_of(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return out;
    };
    for task in tasks.flatten() {
        if let Ok(text) = std::fs::read_to_string(task.path().join("children")) {
            out.extend(
                text.split_whitespace()
                    .filter_map(|p| p.parse::<u32>().ok()),
            );
        }
    }
    out.sort_unstable();
    out.dedup();
    out
}

/// Whether `pid` is a live (not zombie) process.
pub fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the parenthesised command name, which may contain spaces.
        Ok(stat) => stat
            .rsplit_once(") ")
            .and_then(|(_, rest)| rest.chars().next())
            .is_some_and(|state| state != 'Z' && state != 'X'),
        Err(_) => false,
    }
}

/// Whether `pid` is a live `ringmux-worker` process.
pub fn is_worker(pid: u32) -> bool {
    alive(pid)
        && std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| {
            let cmd = String::from_utf8_lossy(&c);
            cmd.contains("ringmux-worker") || cmd.contains("ringmux-fault-worker")
        })
}

/// Waits (bounded) until none of `pids` is alive; returns those still alive at the deadline.
pub async fn wait_gone(pids: &[u32], timeout: Duration) -> Vec<u32> {
    let deadline = Instant::now() + timeout;
    loop {
        let left: Vec<u32> = pids.iter().copied().filter(|&p| alive(p)).collect();
        if left.is_empty() || Instant::now() >= deadline {
            return left;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Whether every folder above `path` may be entered, and `path` executed, by a user that owns
/// none of them and is in none of their groups.
pub fn open_to_others(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    let Ok(path) = path.canonicalize() else {
        return false;
    };
    path.ancestors()
        .all(|p| std::fs::metadata(p).is_ok_and(|m| m.permissions().mode() & 0o001 != 0))
}

/// 0-RTT across instances: a first connection, pinned to instance `first`, GETs `first_path`
/// and so receives a session ticket; a second connection, pinned to instance `second`, sends
/// `GET second_path` as 0-RTT data, which must reach `second` and be accepted. Returns both
/// responses.
pub async fn zero_rtt_across(
    rm: &Ringmux,
    first: u8,
    second: u8,
    first_path: &str,
    second_path: &str,
) -> (Response, Response) {
    let target = Arc::new(std::sync::atomic::AtomicU8::new(first));
    let mut client = rm.client();
    let t = target.clone();
    pin(&mut client, rm.router.clone(), move || {
        t.load(std::sync::atomic::Ordering::Relaxed)
    });
    let conn = rm.connect(&client).await;
    let first_resp = conn.get_body(first_path).await.expect("first GET");
    // The ticket (NewSessionTicket after the handshake) has arrived by the time a response has.
    conn.close().await.expect("clean close");
    let before = rm.metrics();

    target.store(second, std::sync::atomic::Ordering::Relaxed);
    let (conn, zrtt) = client
        .connect_0rtt(rm.listen, SERVER_NAME)
        .await
        .expect("second connection");
    assert!(zrtt.attempted(), "0-RTT not attempted: after the first connection the client holds no ticket that allows early data");
    let resp = conn.get_body(second_path).await.expect("GET in 0-RTT");
    let accepted = zrtt.accepted().await;
    let after = rm
        .wait_for(
            "instance `second` to report the resumed connection",
            Duration::from_secs(5),
            |m| {
                m.instance(names::WORKER_CONNECTIONS_ACCEPTED, second)
                    > before.instance(names::WORKER_CONNECTIONS_ACCEPTED, second)
            },
        )
        .await;
    assert!(
        after.instance(names::FORWARDED, second) > before.instance(names::FORWARDED, second),
        "the resumed connection did not reach instance {second}"
    );
    assert!(
        accepted,
        "0-RTT rejected: ticket from instance {first}, resumed on instance {second}"
    );
    assert_taken_through_binding(&before, &after);
    conn.close().await.expect("clean close");
    (first_resp, resp)
}

/// Between `before` and `after` a session was taken through a ticket binding (`tickets.rs`):
/// the demux read a ClientHello, granted a TAKE that found its session, and refused none.
pub fn assert_taken_through_binding(before: &Metrics, after: &Metrics) {
    let rise = |name: &str, result: &str| {
        after.labelled(name, "result", result) - before.labelled(name, "result", result)
    };
    assert!(
        rise(names::CLIENT_HELLOS, "read") >= 1.0,
        "no ClientHello read:\n{after}"
    );
    assert!(
        rise(names::SESSION_TAKES, "hit") >= 1.0,
        "no session taken:\n{after}"
    );
    for refused in ["foreign", "unbound"] {
        assert_eq!(
            rise(names::SESSION_TAKES, refused),
            0.0,
            "a TAKE refused as {refused}:\n{after}"
        );
    }
}

/// SIGKILL to `pid`.
pub fn kill(pid: u32) -> nix::Result<()> {
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
}

/// Python's `http.server` as an HTTP/1.1 upstream (`test-tools/python/http1_upstream.py`),
/// listening on loopback; killed when dropped.
pub struct PyUpstream {
    pub addr: SocketAddr,
    child: Child,
}

impl PyUpstream {
    /// Starts it and waits (bounded) for its "listening PORT" line.
    pub fn start() -> PyUpstream {
        PyUpstream::start_script("http1_upstream.py")
    }

    /// Starts `test-tools/python/SCRIPT`, which says "listening PORT" as `http1_upstream.py`
    /// does (`ws_upstream.py`, say), and waits (bounded) for that line.
    pub fn start_script(script: &str) -> PyUpstream {
        let name = script;
        let script = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../test-tools/python")
            .join(name);
        let mut child = Command::new("python3")
            .arg(&script)
            .arg("0")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("starting python3 {}: {e}", script.display()));
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = BufReader::new(stdout).read_line(&mut line);
            let _ = tx.send(line);
        });
        let line = rx
            .recv_timeout(Duration::from_secs(30))
            .unwrap_or_else(|_| panic!("{name} did not say where it listens within 30 s"));
        let port: u16 = line
            .trim()
            .strip_prefix("listening ")
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| panic!("{name} said {line:?}"));
        PyUpstream {
            addr: SocketAddr::from(([127, 0, 0, 1], port)),
            child,
        }
    }

    /// `http://ADDR` for `--upstream`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

impl Drop for PyUpstream {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Peak resident memory of a process (`VmHWM`), in bytes.
pub fn peak_rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

/// Lower-case hexadecimal of `bytes`.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// SHA-256 of `data`, in hexadecimal (what the test upstreams answer to `/sha256`).
pub fn sha256_hex(data: &[u8]) -> String {
    hex(ring::digest::digest(&ring::digest::SHA256, data).as_ref())
}

/// Byte `offset` of the bodies the proxy tests upload (`aioquic_client.py upload` makes the
/// same): another period than the download pattern, so the two cannot be confused.
pub fn upload_byte(offset: u64) -> u8 {
    (offset * 7 % 253) as u8
}

/// A loopback TCP address nothing listens on at the moment (for a listener ringmux makes,
/// such as `--redirect-http`'s): the port the kernel gave a socket just closed.
pub fn unused_tcp_port() -> std::net::SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a loopback port")
}

/// Runs the ringmux binary with `args`, which must exit within 30 s (it is killed and the test
/// failed otherwise): a start that must be refused, a command that must finish.
pub fn until_exit<S: AsRef<std::ffi::OsStr>>(args: &[S]) -> std::process::Output {
    let mut child = Command::new(binary("ringmux"))
        .args(args)
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("running ringmux");
    let deadline = Instant::now() + Duration::from_secs(30);
    while child.try_wait().expect("waitpid").is_none() {
        if Instant::now() >= deadline {
            let _ = child.kill();
            let out = child.wait_with_output().expect("its output");
            panic!(
                "ringmux did not exit within 30 s: it started\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().expect("its output")
}

/// A configuration file in `dir` of one site named `name` (a self-signed certificate for it
/// written beside, readable by the workers' user), `instances` workers and `routes` (TOML
/// `[[site.route]]` tables), listening on any loopback port; its path.
pub fn one_site_config(dir: &Path, name: &str, instances: u8, routes: &str) -> String {
    use std::os::unix::fs::PermissionsExt;
    let made = rcgen::generate_simple_self_signed(vec![name.to_string()]).unwrap();
    let (cert, key) = (dir.join("site.pem"), dir.join("site.key"));
    for (path, text) in [
        (&cert, made.cert.pem()),
        (&key, made.signing_key.serialize_pem()),
    ] {
        std::fs::write(path, text).unwrap();
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o644)).unwrap();
    }
    let text = format!(
        "listen = \"127.0.0.1:0\"\ninstances = {instances}\n\n[[site]]\nnames = [\"{name}\"]\n\
         cert = \"{}\"\nkey = \"{}\"\n{routes}",
        cert.display(),
        key.display()
    );
    let path = dir.join("ringmux.toml");
    std::fs::write(&path, text).unwrap();
    path.display().to_string()
}
