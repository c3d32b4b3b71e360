//! A broken or hostile worker, and overload. `ringmux-fault-worker` (the test tool in
//! test-tools/fault-worker) plays one fault on instance 1, once; the replacement is the real worker. Checked:
//! the demux stays up, detects and counts the fault, resets that ring, restarts that worker,
//! and instance 0 never notices. Overload: a burst far beyond what a ring holds, a worker that
//! stops draining, while the other instance serves; memory stays flat and every datagram is
//! accounted for.

use ringmux_systests::harness;
use ringmux_testkit::{temp_dir, tool, TempDir};

use ringmux_demux::metrics::names;
use std::net::UdpSocket;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use harness::{bounded, check_bytes, unused_tcp_port, Forward, Metrics, Ringmux};

fn fault_worker() -> PathBuf {
    // A test tool of its own package (test-tools/fault-worker), built beside ringmux by
    // scripts/test.sh.
    harness::binary("ringmux-fault-worker")
}

/// The environment that makes the fault worker play `fault` once on instance 1, with its marker
/// in `dir` and `real` as the real worker it becomes.
fn fault_env(fault: &str, dir: &TempDir, real: &std::path::Path) -> Vec<(&'static str, String)> {
    vec![
        ("RINGMUX_FAULT", fault.to_string()),
        ("RINGMUX_FAULT_INSTANCE", "1".to_string()),
        (
            "RINGMUX_FAULT_MARKER",
            dir.path().join("played").to_string_lossy().into_owned(),
        ),
        ("RINGMUX_REAL_WORKER", real.to_string_lossy().into_owned()),
    ]
}

/// What an attack that looks for processes under `/proc` (siblings, the demux, its own
/// status) is given: every worker's allow-list closes `/proc` (docs/security.md), so without it the attack would find nothing, and what refuses it would be the
/// allow-list rather than the wall it aims at (the filter, the Landlock domain's ptrace scope).
const READ_PROC: [&str; 2] = ["--worker-read", "/proc"];

/// Starts 2 instances whose instance 1 plays `fault` once.
fn start_faulty(fault: &str, extra: &[&str], dir: &TempDir) -> Ringmux {
    start_faulty_in(Forward::Shm, fault, extra, dir)
}

/// [`start_faulty`] in forwarding mode `forward`.
fn start_faulty_in(forward: Forward, fault: &str, extra: &[&str], dir: &TempDir) -> Ringmux {
    open_to_workers(dir);
    let env = fault_env(fault, dir, &harness::worker_bin());
    Ringmux::start_with(2, forward, extra, fault_worker(), &env)
}

/// Lets the workers (nobody, when the tests run as root) write the fault's marker and report.
fn open_to_workers(dir: &TempDir) {
    std::fs::set_permissions(
        dir.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o777),
    )
    .unwrap();
}

/// `bin` in `dir` (a hard link, or a copy across file systems), executable by anyone.
fn world_executable_copy(bin: &std::path::Path, dir: &TempDir) -> PathBuf {
    let to = dir.path().join(bin.file_name().expect("a file name"));
    if std::fs::hard_link(bin, &to).is_err() {
        std::fs::copy(bin, &to).expect("copying a worker binary");
    }
    std::fs::set_permissions(&to, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    to
}

/// Short-header datagrams whose DCID routes to `instance`.
fn blast(rm: &Ringmux, instance: u8, count: usize) {
    let sock = UdpSocket::bind("127.0.0.1:0").unwrap();
    let mut pkt = vec![0x40u8];
    pkt.extend_from_slice(&rm.dcid_for(instance, 17));
    pkt.resize(1200, 0xab);
    for _ in 0..count {
        let _ = sock.send_to(&pkt, rm.listen);
    }
}

/// Instance 0 keeps serving: a pinned connection fetches and checks a body.
async fn instance0_serves(rm: &Ringmux) {
    let client = rm.pinned_client(0);
    let conn = rm.connect(&client).await;
    let r = conn.get("/bytes/50000").await.expect("GET on instance 0");
    check_bytes("instance 0", &r, 50_000);
}

/// Plays `fault` and checks detection, reset, restart and isolation, within 60 s.
async fn fault_is_contained(fault: &str, expect_violation: bool) {
    bounded(Duration::from_secs(60), play_fault(fault, expect_violation)).await;
}

async fn play_fault(fault: &str, expect_violation: bool) {
    let dir = temp_dir("ringmux-fault");
    let rm = start_faulty(fault, &["--stall-secs", "1"], &dir);
    let before = rm.metrics();
    assert_eq!(before.instance(names::WORKER_RESTARTS, 1), 0.0);
    // Feed instance 1 until the fault has been played and the worker replaced.
    let deadline = Instant::now() + Duration::from_secs(30);
    let m = loop {
        blast(&rm, 1, 20);
        let m = rm.metrics();
        if m.instance(names::WORKER_RESTARTS, 1) >= 1.0 && m.instance(names::WORKER_UP, 1) == 1.0 {
            break m;
        }
        assert!(
            Instant::now() < deadline,
            "instance 1 was not replaced after {fault}; metrics:\n{m}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(
        dir.path().join("played").exists(),
        "the fault worker never played {fault}"
    );
    if expect_violation {
        assert!(
            m.instance(names::RING_VIOLATIONS, 1) >= 1.0,
            "{fault} not detected:\n{m}"
        );
    }
    assert_eq!(
        m.instance(names::WORKER_RESTARTS, 0),
        0.0,
        "instance 0 noticed:\n{m}"
    );
    assert_eq!(m.instance(names::RING_VIOLATIONS, 0), 0.0);
    instance0_serves(&rm).await;
    // The replacement (the real worker) serves on a reset ring.
    let client = rm.pinned_client(1);
    let conn = rm.connect(&client).await;
    let r = conn
        .get("/bytes/1000")
        .await
        .expect("GET on the replacement");
    check_bytes("replacement", &r, 1000);
    let m = rm.wait_balanced(Duration::from_secs(5)).await;
    assert!(m.get(names::RECEIVED) > 0.0);
}

#[tokio::test]
async fn head_written_ahead_of_tail() {
    fault_is_contained("head-ahead", true).await;
}

#[tokio::test]
async fn head_moved_backwards() {
    fault_is_contained("head-backwards", true).await;
}

#[tokio::test]
async fn worker_stops_draining() {
    fault_is_contained("stop-draining", true).await;
}

/// A worker floods its control socket from two threads while its ring stalls: the supervisor
/// reads a bounded number of messages per worker per round, so it still acts on the stall.
#[tokio::test]
async fn control_flood_with_a_stalled_ring() {
    fault_is_contained("control-flood", true).await;
}

/// A draining worker that closes its control socket but keeps running (and ignores SIGTERM)
/// cannot hold the demux past its grace period: it is killed at the deadline and ringmux exits.
#[tokio::test]
async fn a_lingering_drain_ends_at_the_grace_deadline() {
    bounded(Duration::from_secs(60), async {
        let dir = temp_dir("ringmux-linger");
        let mut rm = start_faulty("linger", &["--grace", "2"], &dir);
        let pids = rm.worker_pids().await;
        rm.signal(libc::SIGTERM);
        let status = rm.wait_exit(Duration::from_secs(30)).await;
        assert!(status.success(), "ringmux exited with {status}");
        assert!(
            dir.path().join("played").exists(),
            "the fault was never played"
        );
        let left = harness::wait_gone(&pids, Duration::from_secs(10)).await;
        assert!(
            left.is_empty(),
            "workers still alive after the demux exited: {left:?}"
        );
    })
    .await
}

/// The worker tries to fill its doorbell and makes its end blocking, then stops draining: the
/// attack that blocked the demux's writes to a shared eventfd. The doorbell is a pipe, whose
/// write end is the demux's alone: the data plane never blocks, instance 0 serves throughout,
/// and the worker is replaced as a stalled one (a violation).
#[tokio::test]
async fn worker_jams_its_doorbell() {
    fault_is_contained("jam-doorbell", true).await;
}

#[tokio::test]
async fn worker_dies_mid_batch() {
    fault_is_contained("die-mid-batch", false).await;
}

/// One slow worker (its ring full) does not slow the others: instance 1 never drains (and is
/// not declared stuck within the test), instance 0 serves throughout; the excess is counted as
/// ring_full.
#[tokio::test]
async fn full_ring_of_one_instance_does_not_slow_another() {
    bounded(Duration::from_secs(60), async {
        let dir = temp_dir("ringmux-slow");
        let rm = start_faulty(
            "stop-draining",
            &["--stall-secs", "600", "--ring-slots", "64"],
            &dir,
        );
        blast(&rm, 1, 2000);
        // The occupancy gauge is refreshed every 100 ms, the drop counter every batch.
        rm.wait_for(
            "ring_full drops and a full ring (64 slots) on the stuck instance",
            Duration::from_secs(10),
            |m| m.dropped("ring_full") > 0.0 && m.instance(names::RING_OCCUPANCY, 1) == 64.0,
        )
        .await;
        for _ in 0..5 {
            blast(&rm, 1, 200);
            instance0_serves(&rm).await;
        }
        let m = rm.wait_balanced(Duration::from_secs(5)).await;
        assert_eq!(m.instance(names::WORKER_RESTARTS, 0), 0.0);
        assert!(m.dropped("ring_full") >= 2000.0 - 64.0, "{m}");
    })
    .await;
}

fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("/proc status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches(" kB").trim().parse().ok())
        .expect("VmRSS")
}

/// Offered load far beyond what the rings take: the demux and its workers are paused (SIGSTOP)
/// while the socket fills, then the demux alone is resumed into a burst ~60 times a ring, so
/// the rings overflow whatever the speed of the machine. Memory stays flat, every datagram is
/// accounted for by reason, and both instances serve again once the workers resume.
#[tokio::test]
async fn overload_burst_keeps_memory_flat_and_accounts_for_everything() {
    bounded(Duration::from_secs(90), async {
        let rm = Ringmux::start(
            2,
            Forward::Shm,
            // The workers are stopped for a moment each round: not long enough to be stuck.
            &[
                "--ring-slots",
                "256",
                "--rcvbuf",
                "67108864",
                "--stall-secs",
                "600",
            ],
        );
        instance0_serves(&rm).await;
        let workers = rm.worker_pids().await;
        let signal_workers = |sig| {
            for &pid in &workers {
                nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), sig)
                    .unwrap_or_else(|e| panic!("kill({pid}, {sig}): {e}"));
            }
        };
        let rss_before = rss_kib(rm.pid);
        for round in 0..3 {
            let full_before = rm.metrics().dropped("ring_full");
            signal_workers(nix::sys::signal::Signal::SIGSTOP);
            rm.signal(libc::SIGSTOP);
            let senders: Vec<_> = (0..2u8)
                .map(|i| {
                    let target = rm.listen;
                    let mut pkt = vec![0x40u8];
                    pkt.extend_from_slice(&rm.dcid_for(i, 17));
                    pkt.resize(1200, round);
                    std::thread::spawn(move || {
                        let sock = UdpSocket::bind("127.0.0.1:0").unwrap();
                        for _ in 0..15_000 {
                            let _ = sock.send_to(&pkt, target);
                        }
                    })
                })
                .collect();
            for s in senders {
                s.join().unwrap();
            }
            rm.signal(libc::SIGCONT);
            // Nothing drains the rings until the workers resume: 15 000 datagrams per
            // instance meet 256 slots.
            rm.wait_for(
                "the paused workers' rings to overflow, every datagram accounted for",
                Duration::from_secs(20),
                |m| m.dropped("ring_full") > full_before && m.balanced(),
            )
            .await;
            signal_workers(nix::sys::signal::Signal::SIGCONT);
            rm.wait_balanced(Duration::from_secs(20)).await;
        }
        let m: Metrics = rm.wait_balanced(Duration::from_secs(20)).await;
        assert!(
            m.dropped("ring_full") > 0.0,
            "the burst never overflowed a ring:\n{m}"
        );
        assert_eq!(
            m.get(names::DATAPLANE_ALLOCATIONS),
            0.0,
            "the data plane allocated:\n{m}"
        );
        let rss_after = rss_kib(rm.pid);
        // Flat: the rings and buffers are preallocated; allow for page-cache noise only.
        assert!(
            rss_after <= rss_before + 8 * 1024,
            "demux RSS grew from {rss_before} KiB to {rss_after} KiB"
        );
        // Both instances serve after the storm.
        instance0_serves(&rm).await;
        let client = rm.pinned_client(1);
        let conn = rm.connect(&client).await;
        check_bytes(
            "instance 1 after overload",
            &conn.get("/bytes/20000").await.expect("GET"),
            20_000,
        );
        eprintln!(
            "overload: RSS {rss_before} -> {rss_after} KiB; drops {:?}",
            m.dropped("ring_full")
        );
    })
    .await;
}

/// Both instances serve after an attack: quinn on instance 0, and a client nobody here wrote
/// (gtlsclient) on each.
async fn both_instances_serve(rm: &Ringmux) {
    instance0_serves(rm).await;
    harness::third_party_served(rm, 0).await;
    harness::third_party_served(rm, 1).await;
}

/// The effective user ID of process `pid`, from `/proc/PID/status`.
fn effective_uid(pid: u32) -> String {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|v| v.split_whitespace().nth(1))
        .expect("effective uid")
        .to_string()
}

/// The outcomes the fault worker recorded (`MARKER.report`), once it has written them.
async fn report(dir: &TempDir) -> std::collections::HashMap<String, String> {
    harness::fault_report(dir.path(), Duration::from_secs(30)).await
}

/// Asserts that each of `attempts` came out as `expected` in `report`.
fn assert_outcomes(
    report: &std::collections::HashMap<String, String>,
    attempts: &[&str],
    expected: &str,
) {
    for a in attempts {
        assert_eq!(
            report.get(*a).map(String::as_str),
            Some(expected),
            "{a}; whole report: {report:?}"
        );
    }
}

/// Plays an attack on the confinement on instance 1 (which then becomes the real worker, in
/// the same process, still confined) and checks that the demux and both instances serve and
/// nothing was restarted. Returns the report.
async fn play_attack(attack: &str, extra: &[&str]) -> std::collections::HashMap<String, String> {
    let dir = temp_dir("ringmux-attack");
    let rm = start_faulty(attack, extra, &dir);
    let found = report(&dir).await;
    instance0_serves(&rm).await;
    let client = rm.pinned_client(1);
    let conn = rm.connect(&client).await;
    check_bytes(
        "the attacker, now the real worker",
        &conn.get("/bytes/3000").await.expect("GET on instance 1"),
        3000,
    );
    let m = rm.wait_balanced(Duration::from_secs(5)).await;
    for i in 0..2 {
        assert_eq!(
            m.instance(names::WORKER_RESTARTS, i),
            0.0,
            "instance {i}:\n{m}"
        );
    }
    found
}

/// A confined worker cannot stop, signal, renice, re-pin, read or trace the demux; signals to
/// its process group or to every process are refused too. Nor can it open the demux's memory,
/// even as root: it runs without capabilities (no `CAP_SYS_PTRACE`), and the demux is
/// non-dumpable.
#[tokio::test]
async fn a_confined_worker_cannot_reach_the_demux() {
    bounded(Duration::from_secs(60), async {
        let r = play_attack("signal-parent", &[]).await;
        assert_outcomes(
            &r,
            &[
                "kill-parent-stop",
                "kill-process-group",
                "kill-every-process",
                "tkill-parent",
                "pin-parent",
                "renice-parent",
                "read-parent-memory",
                "ptrace-parent",
            ],
            "EPERM",
        );
        assert_outcomes(&r, &["open-parent-mem"], "EACCES");
    })
    .await;
}

/// A worker cannot reload the demux through its control socket, even where the socket's
/// permissions let it connect (a worker running as the demux's user): the demux turns away a
/// connection from any worker's process, and no reload happens.
#[tokio::test]
async fn a_worker_cannot_ask_for_a_reload_or_an_upgrade() {
    bounded(Duration::from_secs(60), async {
        let dir = temp_dir("ringmux-attack-reload");
        let sock = dir
            .path()
            .join("control.sock")
            .to_string_lossy()
            .into_owned();
        let mut env = fault_env("reload", &dir, &harness::worker_bin());
        env.push(("RINGMUX_FAULT_CONTROL_SOCKET", sock.clone()));
        // Workers of the demux's own user (root here), whom the socket's mode lets connect.
        let rm = Ringmux::start_with(
            2,
            Forward::Shm,
            &["--control-socket", &sock, "--worker-user", "root"],
            fault_worker(),
            &env,
        );
        let r = report(&dir).await;
        assert_outcomes(&r, &["reload-connect", "upgrade-connect"], "ok");
        assert_outcomes(
            &r,
            &["reload-answer", "upgrade-answer"],
            "error: refused: not from a worker",
        );
        instance0_serves(&rm).await;
        let m = rm.metrics();
        assert_eq!(m.get(names::GENERATION_ACTIVE), 1.0, "{m}");
        assert_eq!(m.sum(names::RELOADS), 0.0, "{m}");
        assert_eq!(m.sum(names::UPGRADES), 0.0, "{m}");
        // The operator still can.
        let (ok, text) = rm.reload(Duration::from_secs(30)).await;
        assert!(ok, "{text}");
    })
    .await
}

/// The same attack with `--sandbox off` gets through (the demux is stopped, and continued at
/// once by the attacker): what the test above shows is the filter's doing.
#[tokio::test]
async fn an_unconfined_worker_can_stop_the_demux() {
    bounded(Duration::from_secs(60), async {
        let dir = temp_dir("ringmux-attack-off");
        let rm = start_faulty("signal-parent", &["--sandbox", "off"], &dir);
        let r = report(&dir).await;
        assert_outcomes(
            &r,
            &["kill-parent-stop", "kill-process-group", "tkill-parent"],
            "ok",
        );
        instance0_serves(&rm).await;
    })
    .await;
}

/// A confined worker cannot signal its sibling, by PID or by pidfd: instance 0 keeps its process.
#[tokio::test]
async fn a_confined_worker_cannot_signal_a_sibling() {
    bounded(Duration::from_secs(60), async {
        let r = play_attack("signal-sibling", &READ_PROC).await;
        assert_eq!(
            r.get("siblings-found").map(String::as_str),
            Some("1"),
            "{r:?}"
        );
        assert_outcomes(&r, &["kill-sibling", "pidfd-signal-sibling"], "EPERM");
    })
    .await;
}

/// A confined worker starts threads but no process: fork and spawn are refused, clone3 answers
/// ENOSYS (so the C library falls back to clone, whose flags the filter reads).
#[tokio::test]
async fn a_confined_worker_cannot_start_processes() {
    bounded(Duration::from_secs(60), async {
        let r = play_attack("fork", &[]).await;
        assert_outcomes(&r, &["fork", "spawn"], "EPERM");
        assert_outcomes(&r, &["clone3"], "ENOSYS");
        assert_outcomes(&r, &["thread"], "ok");
    })
    .await;
}

/// A confined worker cannot receive on, duplicate, reconfigure or pass on the public socket,
/// nor get at the wire another way; afterwards every datagram sent to either instance is
/// forwarded, none lost.
#[tokio::test]
async fn a_confined_worker_cannot_receive_on_the_public_socket() {
    bounded(Duration::from_secs(60), async {
        let dir = temp_dir("ringmux-attack-recv");
        let rm = start_faulty("recv-public", &[], &dir);
        let r = report(&dir).await;
        assert_outcomes(
            &r,
            &[
                "recv-public",
                "read-public",
                "recvmsg-public",
                "recvmmsg-public",
                "dup-public",
                "dup2-public",
                "fcntl-dupfd-public",
                "pass-public-to-itself",
                "io-uring",
                "linux-aio",
                "packet-socket",
                "raw-socket",
                "setsockopt-public",
                "shutdown-public",
                "connect-public",
                "close-control",
            ],
            "EPERM",
        );
        // Descriptor 4 is the worker's own socket: its file status flags are its own.
        assert_outcomes(&r, &["clear-nonblock-public"], "ok");
        instance0_serves(&rm).await;
        forwards_everything(&rm).await;
    })
    .await;
}

/// 300 more datagrams to each instance are all received and forwarded, none dropped, and no
/// worker was restarted.
async fn forwards_everything(rm: &Ringmux) {
    let before = rm.wait_balanced(Duration::from_secs(5)).await;
    blast(rm, 0, 300);
    blast(rm, 1, 300);
    let m = rm
        .wait_for(
            "600 more datagrams forwarded",
            Duration::from_secs(10),
            |m| m.balanced() && m.get(names::RECEIVED) >= before.get(names::RECEIVED) + 600.0,
        )
        .await;
    let dropped = m.sum(names::DROPPED) - before.sum(names::DROPPED);
    assert_eq!(dropped, 0.0, "datagrams dropped after the attack:\n{m}");
    for i in 0..2 {
        assert_eq!(
            m.instance(names::WORKER_RESTARTS, i),
            0.0,
            "instance {i}:\n{m}"
        );
    }
}

/// The filter's rules name descriptors 3 and 4, so no worker may free, renumber or replace
/// them by any route (an `execve` would hand the number to a socket of its own, and the rules
/// would bind that socket instead): `FIOCLEX`/`FIONCLEX`, `F_SETFD`, `close_range` with
/// `CLOSE_RANGE_CLOEXEC`, `dup3` onto them. `ioctl` is an allow-list: non-blocking mode and
/// close-on-exec on the worker's own descriptors pass, I/O signals and interface changes do
/// not. Had a route worked, the fault worker would have gone on to receive a copy of the
/// public socket on "3" and blind it; the box serves both instances, a client nobody here
/// wrote included, and forwards everything.
#[tokio::test]
async fn a_confined_worker_cannot_free_the_descriptors_the_rules_name() {
    bounded(Duration::from_secs(60), async {
        let dir = temp_dir("ringmux-attack-free");
        let rm = start_faulty("free-named", &[], &dir);
        let r = report(&dir).await;
        assert_outcomes(&r, &["copy-control", "fionbio-own", "fioclex-own"], "ok");
        let mut routes = Vec::new();
        for fd in ["control", "public"] {
            for how in [
                "fioclex",
                "fionclex",
                "setfd-cloexec",
                "close-range-cloexec",
                "dup3-cloexec-onto",
            ] {
                routes.push(format!("{how}-{fd}"));
            }
        }
        let routes: Vec<&str> = routes.iter().map(String::as_str).collect();
        assert_outcomes(&r, &routes, "EPERM");
        assert_outcomes(&r, &["fioasync-own", "siocsifflags"], "EPERM");
        assert!(
            !r.keys().any(|k| k.starts_with("stage2")),
            "the attack went on in a new image: {r:?}"
        );
        instance0_serves(&rm).await;
        let client = rm.pinned_client(1);
        let conn = rm.connect(&client).await;
        check_bytes(
            "the attacker, now the real worker",
            &conn.get("/bytes/3000").await.expect("GET on instance 1"),
            3000,
        );
        harness::third_party_served(&rm, 0).await;
        harness::third_party_served(&rm, 1).await;
        forwards_everything(&rm).await;
    })
    .await;
}

/// Starts 2 instances whose instance 1 plays `fault`, with `env` added for the workers.
fn start_faulty_env(fault: &str, extra: &[&str], dir: &TempDir, env: &[(&str, String)]) -> Ringmux {
    open_to_workers(dir);
    let mut all = fault_env(fault, dir, &harness::worker_bin());
    all.extend(env.iter().cloned());
    Ringmux::start_with(2, Forward::Shm, extra, fault_worker(), &all)
}

/// Waits (bounded) for `file` to exist.
async fn wait_file(file: &std::path::Path) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !file.exists() {
        assert!(
            Instant::now() < deadline,
            "{} never appeared",
            file.display()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Descriptor 4 is a worker's own sending socket, bound to the public address in a group whose
/// steering never picks it: even unconfined, a worker that receives on it gets nothing meant
/// for anyone (datagrams to both instances were sent meanwhile), a `connect` and a shutdown on
/// it blind nobody, and its filters are locked by the demux, so no steering program for the
/// whole group (nor a socket filter) gets attached through it. The box forwards everything after, and both
/// instances serve (the attacker's, as the real worker, sends on that same socket).
#[tokio::test]
async fn a_workers_own_socket_cannot_blind_the_box_even_unconfined() {
    bounded(Duration::from_secs(60), async {
        let dir = temp_dir("ringmux-attack-own-socket");
        let rm = start_faulty_env(
            "own-socket",
            &["--sandbox", "off"],
            &dir,
            &[("RINGMUX_FAULT_UNCONFINED", "1".into())],
        );
        wait_file(&dir.path().join("played.receiving")).await;
        blast(&rm, 0, 200);
        blast(&rm, 1, 200);
        let r = report(&dir).await;
        assert_outcomes(&r, &["received-on-own-socket"], "0");
        assert_outcomes(
            &r,
            &[
                "own-socket-lock-filter",
                "own-socket-connect",
                "own-socket-shutdown",
            ],
            "ok",
        );
        // The demux locked the socket's filters: no steering program for the whole group, and
        // no socket filter either, through it, even unconfined.
        assert_outcomes(&r, &["own-socket-steer", "own-socket-filter"], "EPERM");
        instance0_serves(&rm).await;
        let client = rm.pinned_client(1);
        let conn = rm.connect(&client).await;
        check_bytes(
            "the attacker, now the real worker",
            &conn.get("/bytes/3000").await.expect("GET on instance 1"),
            3000,
        );
        harness::third_party_served(&rm, 0).await;
        harness::third_party_served(&rm, 1).await;
        forwards_everything(&rm).await;
    })
    .await;
}

/// Confined, the same worker may not even try: receiving on, filtering, connecting or shutting
/// down its sending socket are refused, and so is binding any socket to a device (which takes
/// a socket out of its `SO_REUSEPORT` group as a better match for everything arriving on that
/// device).
#[tokio::test]
async fn a_confined_worker_cannot_reconfigure_its_sending_socket() {
    bounded(Duration::from_secs(60), async {
        let dir = temp_dir("ringmux-attack-own-socket-confined");
        let rm = start_faulty("own-socket", &[], &dir);
        let r = report(&dir).await;
        assert_outcomes(&r, &["received-on-own-socket"], "0");
        assert_outcomes(
            &r,
            &[
                "last-receive",
                "own-socket-steer",
                "own-socket-filter",
                "own-socket-lock-filter",
                "own-socket-connect",
                "own-socket-shutdown",
                "own-socket-bind-device",
                "other-socket-bind-device",
            ],
            "EPERM",
        );
        both_instances_serve(&rm).await;
        forwards_everything(&rm).await;
    })
    .await;
}

/// What the spy watches: a reload (new workers start) or an upgrade (a new image of the demux).
#[derive(Clone, Copy)]
enum Trigger {
    Reload,
    Upgrade,
}

/// Plays `spy` on instance 1 (a serving worker probing the memory of every process that starts
/// beside it, and of the demux), carries out `trigger` once it watches, then tells it to stop.
async fn spy_while(trigger: Trigger) -> std::collections::HashMap<String, String> {
    let dir = temp_dir("ringmux-attack-spy");
    // The spy never says it stopped accepting (STOPPED): a reload answers after
    // STOPPED_WAIT, and the spy must outlive that to write its report.
    let mut extra = vec!["--grace", "10", READ_PROC[0], READ_PROC[1]];
    if matches!(trigger, Trigger::Upgrade) {
        // Without CAP_SETUID (the upgrade test empties the bounding set) ringmux cannot give
        // its workers a user of their own, and starts only when told they keep its.
        extra.extend(["--worker-user", "self"]);
    }
    let rm = start_faulty("spy", &extra, &dir);
    wait_file(&dir.path().join("played.watching")).await;
    let (ok, text) = match trigger {
        Trigger::Reload => rm.reload(Duration::from_secs(30)).await,
        Trigger::Upgrade => rm.upgrade(Duration::from_secs(30)).await,
    };
    assert!(ok, "{text}");
    std::fs::write(dir.path().join("played.done"), b"1").unwrap();
    let r = report(&dir).await;
    // Instance 1 is still the spy after an upgrade: no QUIC there.
    instance0_serves(&rm).await;
    harness::third_party_served(&rm, 0).await;
    r
}

/// A worker cannot open the memory of a sibling that starts beside it (a reload's new
/// generation), not even in the milliseconds after its `execve` and before the worker library
/// makes it non-dumpable: each worker is in a Landlock domain of its own from its first
/// instruction, and Landlock refuses to trace (so to open the memory of) a process outside the
/// tracer's domain. Nor can it open the demux's. Nor can it open for writing the files under
/// `/proc` that its user may write in that window (a sibling's `oom_score_adj`, `autogroup`),
/// the demux's, or its own autogroup (which it would share with the demux were they in one
/// session); and it stays in its own session and process group (`setpgid` into the demux's
/// group and `setsid` are refused).
#[tokio::test]
async fn a_worker_cannot_open_a_starting_siblings_memory() {
    bounded(Duration::from_secs(90), async {
        let r = spy_while(Trigger::Reload).await;
        let siblings: u32 = r["new-siblings"].parse().unwrap();
        assert!(siblings >= 2, "the spy saw {siblings} new workers: {r:?}");
        for k in [
            "open-new-sibling-mem",
            "open-demux-mem",
            "write-new-sibling-oom-score",
            "write-new-sibling-autogroup",
            "write-own-autogroup",
            "write-demux-oom-score",
            "join-demux-group",
            "new-session",
        ] {
            assert!(matches!(r[k].as_str(), "EACCES" | "EPERM"), "{k}: {r:?}");
        }
    })
    .await;
}

/// Nor the memory of a new image of the demux during `ringmux upgrade`: it turns non-dumpable
/// before it reads its arguments, and it is outside every worker's Landlock domain anyway.
/// ringmux runs without capabilities here, as the shipped unit runs it (unprivileged): a
/// worker then holds every capability the demux holds, which is what the kernel's own check
/// asks of a tracer besides the user.
#[tokio::test]
async fn a_worker_cannot_open_the_demuxs_memory_during_an_upgrade() {
    // This test's own thread starts ringmux: with its bounding set empty, no `execve` (ringmux's
    // nor a new image's) gains a capability, root or not.
    for cap in 0..64u64 {
        match rustix::thread::remove_capability_from_bounding_set(
            rustix::thread::CapabilitySet::from_bits_retain(1 << cap),
        ) {
            Ok(()) | Err(rustix::io::Errno::PERM) => {}
            Err(_) => break,
        }
    }
    bounded(Duration::from_secs(90), async {
        let r = spy_while(Trigger::Upgrade).await;
        assert!(
            matches!(r["open-demux-mem"].as_str(), "EACCES" | "EPERM"),
            "{r:?}"
        );
        // The demux's `ringmux upgrade-check` of the new binary is a child of its own (it may
        // be gone before a probe: ENOENT).
        assert_ne!(r["open-new-sibling-mem"], "ok", "{r:?}");
    })
    .await;
}

/// A worker dies with the demux whatever it asks: `prctl` is an allow-list, and the parent-death
/// signal can only be set to SIGKILL (never disarmed), the process only made non-dumpable, no
/// tracer named, no subreaper made. A descriptor ringmux inherited from its own parent (here
/// number 57) does not reach the worker. After SIGKILL of ringmux no worker survives.
#[tokio::test]
async fn a_confined_worker_dies_with_the_demux_and_inherits_nothing() {
    bounded(Duration::from_secs(60), async {
        // Not close-on-exec: ringmux inherits it, as from a careless parent.
        let null = std::fs::File::open("/dev/null").unwrap();
        // SAFETY: dup2 onto a number this test process does not otherwise use.
        let r = unsafe { libc::dup2(std::os::fd::AsRawFd::as_raw_fd(&null), 57) };
        assert_eq!(r, 57);
        let dir = temp_dir("ringmux-attack-prctl");
        let mut rm = start_faulty_env(
            "prctl",
            &[],
            &dir,
            &[("RINGMUX_FAULT_INHERITED", "57".into())],
        );
        let r = report(&dir).await;
        assert_outcomes(
            &r,
            &[
                "pdeathsig-off",
                "pdeathsig-term",
                "dumpable-on",
                "ptracer-any",
                "subreaper",
            ],
            "EPERM",
        );
        assert_outcomes(&r, &["pdeathsig-now"], &libc::SIGKILL.to_string());
        assert_outcomes(&r, &["dumpable-off", "set-name"], "ok");
        assert_outcomes(&r, &["inherited-open"], "EBADF");
        both_instances_serve(&rm).await;
        let pids = rm.worker_pids().await;
        assert_eq!(pids.len(), 2, "{pids:?}");
        rm.signal(libc::SIGKILL);
        rm.wait_exit(Duration::from_secs(5)).await;
        let left = harness::wait_gone(&pids, Duration::from_secs(5)).await;
        assert!(
            left.is_empty(),
            "workers {left:?} survived the demux's SIGKILL"
        );
    })
    .await;
}

/// Without the filter the same worker does receive on the public socket (it finds the queue
/// empty or takes a datagram): the refusals above are the filter's.
#[tokio::test]
async fn an_unconfined_worker_can_receive_on_the_public_socket() {
    bounded(Duration::from_secs(60), async {
        let dir = temp_dir("ringmux-attack-recv-off");
        let _rm = start_faulty("recv-public", &["--sandbox", "off"], &dir);
        let r = report(&dir).await;
        let got = r.get("recv-public").map(String::as_str);
        assert!(matches!(got, Some("ok" | "EAGAIN")), "{r:?}");
    })
    .await;
}

/// With `--worker-user`, workers run as that user (and so cannot even open the demux's memory);
/// the confinement still applies. Siblings share that user, and still cannot open each other's
/// memory: the worker library makes its process non-dumpable. Needs root; skipped otherwise.
#[tokio::test]
async fn workers_run_as_the_worker_user() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("skipped: --worker-user needs the test to run as root");
        return;
    }
    let nobody = nix::unistd::User::from_name("nobody")
        .ok()
        .flatten()
        .expect("a user named nobody");
    bounded(Duration::from_secs(60), async {
        let dir = temp_dir("ringmux-attack-user");
        // The workers, running as nobody, write the marker and report here, and run from here:
        // the build's own folder may sit below one that nobody cannot enter.
        std::fs::set_permissions(
            dir.path(),
            std::os::unix::fs::PermissionsExt::from_mode(0o777),
        )
        .unwrap();
        let fault = world_executable_copy(&fault_worker(), &dir);
        let real = world_executable_copy(&harness::worker_bin(), &dir);
        let env = fault_env("signal-sibling", &dir, &real);
        let rm = Ringmux::start_with(
            2,
            Forward::Shm,
            &["--worker-user", "nobody", READ_PROC[0], READ_PROC[1]],
            fault,
            &env,
        );
        let r = report(&dir).await;
        assert_outcomes(&r, &["open-sibling-mem"], "EACCES");
        assert_outcomes(&r, &["kill-sibling", "pidfd-signal-sibling"], "EPERM");
        instance0_serves(&rm).await;
        for pid in rm.worker_pids().await {
            let uid = effective_uid(pid);
            assert_eq!(uid, nobody.uid.to_string(), "worker {pid}");
        }
    })
    .await;
}

/// As root with no `--worker-user`, ringmux runs its workers as nobody: a worker of user ID 0,
/// even without a capability, owns every root-owned file, the demux's `/proc` files among
/// them, and could make the demux the OOM killer's first choice (`oom_score_adj`) or lower its
/// scheduling weight (`autogroup`). With `--worker-user root` it still cannot open them for
/// writing where the kernel has Landlock: each worker's domain refuses writing anything under
/// `/proc`. (Without Landlock it can, which shows what the default user refuses.) Needs root.
#[tokio::test]
async fn a_root_demuxs_workers_run_as_nobody_and_cannot_touch_its_proc_files() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("skipped: the default worker user applies when ringmux runs as root");
        return;
    }
    let nobody = nix::unistd::User::from_name("nobody")
        .ok()
        .flatten()
        .expect("a user named nobody");
    bounded(Duration::from_secs(90), async {
        let landlock = ringmux_demux::sys::landlock_abi().is_some();
        let as_root = if landlock { "EACCES" } else { "ok" };
        for (extra, expected) in [
            (&[][..], "EACCES"),
            (&["--worker-user", "root"][..], as_root),
        ] {
            let dir = temp_dir("ringmux-attack-proc");
            open_to_workers(&dir);
            // Somewhere nobody may execute them: the build's own folder may be closed to it.
            let fault = world_executable_copy(&fault_worker(), &dir);
            let real = world_executable_copy(&harness::worker_bin(), &dir);
            let env = fault_env("signal-parent", &dir, &real);
            let rm = Ringmux::start_with(2, Forward::Shm, extra, fault, &env);
            let r = report(&dir).await;
            assert_outcomes(
                &r,
                &["open-parent-oom-score-adj", "open-parent-autogroup"],
                expected,
            );
            let want_uid = if extra.is_empty() {
                nobody.uid.as_raw()
            } else {
                0
            };
            for pid in rm.worker_pids().await {
                let uid = effective_uid(pid);
                assert_eq!(uid, want_uid.to_string(), "worker {pid} with {extra:?}");
            }
            both_instances_serve(&rm).await;
        }
    })
    .await;
}

/// A worker holds no capability, whatever ringmux was given: the shipped unit runs ringmux as an
/// unprivileged user with the ambient capability `CAP_NET_BIND_SERVICE`, which every program it
/// executes would inherit. Here ringmux runs as nobody with that ambient capability (through
/// `setpriv`); the worker's sets are all empty and it cannot bind a privileged port, while the
/// demux serves. Needs root and util-linux's `setpriv`; skipped otherwise.
#[tokio::test]
async fn a_worker_holds_no_capability_ringmux_was_given() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("skipped: starting ringmux as another user needs root");
        return;
    }
    if !tool::SETPRIV.present() {
        return;
    }
    let setpriv = tool::which("setpriv").expect("setpriv, which ran");
    bounded(Duration::from_secs(60), async {
        let dir = temp_dir("ringmux-attack-caps");
        open_to_workers(&dir);
        let demux = world_executable_copy(&harness::binary("ringmux"), &dir);
        let fault = world_executable_copy(&fault_worker(), &dir);
        let real = world_executable_copy(&harness::worker_bin(), &dir);
        // The harness's own files (key file, control socket, log).
        let files = temp_dir("ringmux-caps-files");
        // ringmux as nobody with CAP_NET_BIND_SERVICE ambient, as systemd's User= and
        // AmbientCapabilities= start it; its files its own.
        let wrapper = dir.path().join("as-unit");
        std::fs::write(
            &wrapper,
            format!(
                "#!/bin/sh\nchown -R 65534 '{dir}' '{files}'\nexec '{setpriv}' --reuid=65534 \
                 --regid=65534 --clear-groups --inh-caps=+net_bind_service \
                 --ambient-caps=+net_bind_service '{demux}' \"$@\"\n",
                dir = dir.path().display(),
                files = files.path().display(),
                setpriv = setpriv.display(),
                demux = demux.display(),
            ),
        )
        .unwrap();
        std::fs::set_permissions(
            &wrapper,
            std::os::unix::fs::PermissionsExt::from_mode(0o755),
        )
        .unwrap();
        let env = fault_env("capabilities", &dir, &real);
        // Without CAP_SETUID it cannot give its workers a user of their own: they keep its.
        let rm = Ringmux::start_in(
            files,
            &wrapper,
            2,
            Forward::Shm,
            &["--worker-user", "self", READ_PROC[0], READ_PROC[1]],
            fault,
            &env,
        );
        let r = report(&dir).await;
        assert_outcomes(
            &r,
            &[
                "cap-effective",
                "cap-permitted",
                "cap-inheritable",
                "cap-ambient",
            ],
            "0000000000000000",
        );
        assert_outcomes(&r, &["bind-privileged-port"], "EACCES");
        both_instances_serve(&rm).await;
    })
    .await;
}

/// With `--tcp on` every worker holds the demux's listening TCP socket at descriptor 5 and may
/// accept on it, nothing else: shutting it down, changing its options or its status flags
/// (every worker's and the demux's), duplicating, closing or freeing it are refused, and so is
/// listening anywhere. The same holds for the plain-HTTP listener (`--redirect-http`, 6). The
/// listeners keep taking connections after the attack and across an upgrade (the new image
/// takes them over).
#[tokio::test]
async fn a_confined_worker_cannot_touch_the_shared_tcp_listeners() {
    bounded(Duration::from_secs(60), async {
        let dir = temp_dir("ringmux-attack-tcp");
        let redirect = unused_tcp_port();
        let rm = start_faulty(
            "tcp-listener",
            &["--tcp", "on", "--redirect-http", &redirect.to_string()],
            &dir,
        );
        let r = report(&dir).await;
        assert_outcomes(
            &r,
            &[
                "redirect-shutdown",
                "redirect-clear-nonblock",
                "redirect-dup",
            ],
            "EPERM",
        );
        std::net::TcpStream::connect_timeout(&redirect, Duration::from_secs(5))
            .expect("the plain-HTTP listener takes connections after the attack");
        assert_outcomes(&r, &["accept"], "EAGAIN");
        assert_outcomes(
            &r,
            &[
                "listener-setsockopt",
                "listener-clear-nonblock",
                "listener-fionbio",
                "listener-dup",
                "listener-dupfd",
                "listener-cloexec",
                "listener-listen",
                "listener-shutdown",
                "listener-close",
                "listen-elsewhere",
            ],
            "EPERM",
        );
        instance0_serves(&rm).await;
        let tcp = std::net::SocketAddr::new(rm.listen.ip(), rm.listen.port());
        std::net::TcpStream::connect_timeout(&tcp, Duration::from_secs(5))
            .expect("the listener takes connections after the attack");
        let (ok, text) = rm.upgrade(Duration::from_secs(30)).await;
        assert!(ok, "{text}");
        std::net::TcpStream::connect_timeout(&tcp, Duration::from_secs(5))
            .expect("the listener takes connections after an upgrade");
        std::net::TcpStream::connect_timeout(&redirect, Duration::from_secs(5))
            .expect("the plain-HTTP listener takes connections after an upgrade");
        harness::third_party_served(&rm, 0).await;
        harness::third_party_served(&rm, 1).await;
    })
    .await;
}

/// A worker forks a child that detaches (`setsid`) and keeps its ring, doorbell and sockets,
/// then dies (unconfined: the filter would refuse the fork). The demux, a child subreaper, kills
/// the survivor; the replacement gets a ring of its own (a new memfd), serves, and is not taken
/// for a stalled worker; instance 0 never notices.
#[tokio::test]
async fn a_dead_workers_descendants_are_killed_and_its_ring_replaced() {
    bounded(Duration::from_secs(60), async {
        let dir = temp_dir("ringmux-fork-and-jam");
        let rm = start_faulty(
            "fork-and-jam",
            &["--sandbox", "off", "--stall-secs", "1"],
            &dir,
        );
        let r = report(&dir).await;
        let orphan: u32 = r["orphan-pid"].parse().unwrap();
        let old_ring: u64 = r["ring-inode"].parse().unwrap();
        assert!(old_ring > 0, "{r:?}");
        let left = harness::wait_gone(&[orphan], Duration::from_secs(10)).await;
        assert!(
            left.is_empty(),
            "the forked survivor {orphan} is still alive"
        );
        let m = rm
            .wait_for("instance 1 replaced and up", Duration::from_secs(20), |m| {
                m.instance(names::WORKER_RESTARTS, 1) >= 1.0
                    && m.instance(names::WORKER_UP, 1) == 1.0
            })
            .await;
        let replacement = m.instance(names::WORKER_PID, 1) as u32;
        // The worker maps its ring and closes the descriptor: the mapping names the memfd.
        let maps = std::fs::read_to_string(format!("/proc/{replacement}/maps")).unwrap();
        let rings: Vec<u64> = maps
            .lines()
            .filter(|l| l.contains("memfd:ringmux-ring"))
            .filter_map(|l| l.split_whitespace().nth(4)?.parse().ok())
            .collect();
        assert!(
            !rings.is_empty(),
            "the replacement maps no ring memfd:\n{maps}"
        );
        assert!(
            !rings.contains(&old_ring),
            "the replacement got the dead worker's ring memfd {old_ring}"
        );
        // Served for longer than the stall period (1 s): the replacement is draining and not
        // killed as stalled.
        let client = rm.pinned_client(1);
        let conn = rm.connect(&client).await;
        let until = Instant::now() + Duration::from_millis(2500);
        let mut requests = 0;
        while Instant::now() < until {
            blast(&rm, 1, 20);
            check_bytes(
                "replacement",
                &conn
                    .get("/bytes/2000")
                    .await
                    .expect("GET on the replacement"),
                2000,
            );
            requests += 1;
        }
        instance0_serves(&rm).await;
        let m = rm.wait_balanced(Duration::from_secs(5)).await;
        assert_eq!(
            m.instance(names::WORKER_RESTARTS, 1),
            1.0,
            "after {requests} requests:\n{m}"
        );
        assert_eq!(m.instance(names::WORKER_RESTARTS, 0), 0.0, "{m}");
    })
    .await;
}

/// Instance 1's worker stops draining its 64-slot ring (and is never declared stuck), so the
/// test decides when the ring is past `--initial-shed-at 50`; `extra` adds options.
fn start_crowdable(dir: &TempDir, extra: &[&str]) -> Ringmux {
    let mut args = vec![
        "--stall-secs",
        "600",
        "--ring-slots",
        "64",
        "--initial-shed-at",
        "50",
    ];
    args.extend_from_slice(extra);
    start_faulty("stop-draining", &args, dir)
}

/// A QUIC v1 Initial to `dcid` from `scid` carrying `token`, padded to 1200 bytes.
fn initial_with(dcid: &[u8], scid: &[u8], token: &[u8]) -> Vec<u8> {
    let mut p = vec![0xc3, 0, 0, 0, 1, dcid.len() as u8];
    p.extend_from_slice(dcid);
    p.push(scid.len() as u8);
    p.extend_from_slice(scid);
    assert!(token.len() < 16384);
    p.extend_from_slice(&(0x4000 | token.len() as u16).to_be_bytes());
    p.extend_from_slice(token);
    let payload = 1200 - p.len() - 2;
    p.extend_from_slice(&(0x4000 | payload as u16).to_be_bytes());
    p.resize(1200, 0x5a);
    p
}

/// The SCID and token of a QUIC v1 Retry sent to `dcid` (RFC 9000 §17.2.5).
fn parse_retry(p: &[u8], dcid: &[u8]) -> (Vec<u8>, Vec<u8>) {
    assert_eq!(p[0] & 0xf0, 0xf0, "not a Retry: {p:02x?}");
    assert_eq!(&p[1..5], &[0, 0, 0, 1], "not QUIC v1");
    let dl = usize::from(p[5]);
    assert_eq!(&p[6..6 + dl], dcid, "a Retry for another client");
    let sl = usize::from(p[6 + dl]);
    let scid = p[7 + dl..7 + dl + sl].to_vec();
    let token = p[7 + dl + sl..p.len() - 16].to_vec();
    assert!(!token.is_empty(), "a Retry without a token");
    (scid, token)
}

/// Under pressure (here: instance 1's ring is past `--initial-shed-at`; `--retry auto` is the
/// default) the demux answers a token-less Initial with a Retry itself, whichever instance it
/// hashes to. The Initial that comes back with the token, to the CID the Retry chose, is let
/// in, even to the crowded ring (a validated address is who the room is kept for); the same
/// token from another address is refused. Nothing is shed.
#[tokio::test]
async fn under_pressure_the_demux_retries_and_lets_validated_initials_in() {
    bounded(Duration::from_secs(60), async {
        let dir = temp_dir("ringmux-retry");
        let rm = start_crowdable(&dir, &[]);
        let fwd = |m: &Metrics, i| m.instance(names::FORWARDED, i);
        blast(&rm, 1, 40);
        let before = rm
            .wait_for(
                "instance 1 holding 40 datagrams",
                Duration::from_secs(10),
                |m| m.balanced() && fwd(m, 1) == 40.0,
            )
            .await;
        let client = UdpSocket::bind("127.0.0.1:0").unwrap();
        client
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        const N: usize = 20;
        let mut retried = Vec::new();
        for i in 0..N {
            let scid = [i as u8; 8];
            let odcid = harness::random_u64().to_be_bytes();
            client
                .send_to(&initial_with(&odcid, &scid, &[]), rm.listen)
                .unwrap();
            let mut buf = [0u8; 1500];
            let (n, from) = client
                .recv_from(&mut buf)
                .expect("a Retry from the demux within 5 s");
            assert_eq!(from, rm.listen);
            retried.push((scid, parse_retry(&buf[..n], &scid)));
        }
        // A Retry leaves mid-batch; the counters are published at the batch's end.
        let m = rm
            .wait_for("the Retries counted", Duration::from_secs(10), |m| {
                m.balanced() && m.labelled(names::RETRIES, "result", "sent") == N as f64
            })
            .await;
        assert_eq!(m.dropped("retry"), N as f64, "{m}");
        assert_eq!(m.labelled(names::RETRIES, "result", "sent"), N as f64);
        assert_eq!(m.get(names::ADMISSION_PRESSURE), 1.0, "{m}");
        for (scid, (cid, token)) in &retried {
            client
                .send_to(&initial_with(cid, scid, token), rm.listen)
                .unwrap();
        }
        // One scrape is not atomic: wait until it shows all three at once.
        let forwarded = |m: &Metrics| fwd(m, 0) + fwd(m, 1);
        let m = rm
            .wait_for(
                "every Initial with a token accepted and forwarded",
                Duration::from_secs(10),
                |m| {
                    m.balanced()
                        && m.labelled(names::TOKENS, "result", "accepted") == N as f64
                        && forwarded(m) - forwarded(&before) == N as f64
                },
            )
            .await;
        assert!(
            fwd(&m, 1) > 40.0,
            "no validated Initial entered the crowded ring:\n{m}"
        );
        assert_eq!(m.dropped("initial_shed"), 0.0, "{m}");
        // The token is the client's address's: from another port it is refused.
        let thief = UdpSocket::bind("127.0.0.1:0").unwrap();
        let (scid, (cid, token)) = &retried[0];
        thief
            .send_to(&initial_with(cid, scid, token), rm.listen)
            .unwrap();
        let after = rm
            .wait_for("the replayed token refused", Duration::from_secs(10), |m| {
                m.balanced() && m.dropped("token_refused") == 1.0
            })
            .await;
        assert_eq!(forwarded(&after), forwarded(&m), "{after}");
    })
    .await;
}

/// A QUIC v1 Initial with a random 8-byte DCID, padded to 1200 bytes: well-formed for the
/// router (token and Length fields), undecryptable for a worker, which drops it.
fn initial_packet() -> Vec<u8> {
    let mut p = vec![0xc3, 0, 0, 0, 1, 8];
    p.extend_from_slice(&harness::random_u64().to_be_bytes());
    p.extend_from_slice(&[0, 0]); // SCID length 0, token length 0
    let payload = 1200 - p.len() - 2;
    p.extend_from_slice(&[0x40 | (payload >> 8) as u8, payload as u8]);
    p.resize(1200, 0x5a);
    p
}

fn send_initials(rm: &Ringmux, count: usize) {
    let sock = UdpSocket::bind("127.0.0.1:0").unwrap();
    for _ in 0..count {
        let _ = sock.send_to(&initial_packet(), rm.listen);
    }
}

/// Room for established connections: instance 1's worker stops draining, and once its ring
/// (64 slots) is half full (`--initial-shed-at 50`) the demux admits no new connection's
/// packets to it (counted `initial_shed`), while packets of established connections still go
/// in until the ring is full, and new connections hashed to instance 0 are untouched.
/// Shedding alone (`--retry never`): the demux's Retries have a test of their own.
#[tokio::test]
async fn a_crowded_ring_sheds_new_connections_and_keeps_room_for_established_ones() {
    bounded(Duration::from_secs(60), async {
        let dir = temp_dir("ringmux-shed");
        // 200 Initials from one address in a burst put the demux under pressure, where the
        // prefix budget (another test's subject) would take its share of them: off here, so
        // that every Initial is either shed or forwarded.
        let rm = start_crowdable(&dir, &["--retry", "never", "--prefix-budget", "0"]);
        let fwd = |m: &Metrics, i| m.instance(names::FORWARDED, i);
        // Below the threshold (at most 20 of 20 can reach instance 1): nothing is shed.
        send_initials(&rm, 20);
        let m = rm
            .wait_for("20 Initials received", Duration::from_secs(10), |m| {
                m.balanced() && m.get(names::RECEIVED) >= 20.0
            })
            .await;
        assert_eq!(m.dropped("initial_shed"), 0.0, "{m}");
        // Fill instance 1's ring to 40 of 64 with packets of an established connection.
        let k = fwd(&m, 1);
        blast(&rm, 1, 40 - k as usize);
        let before = rm
            .wait_for(
                "instance 1 holding 40 datagrams",
                Duration::from_secs(10),
                |m| m.balanced() && fwd(m, 1) == 40.0,
            )
            .await;
        // Past the threshold: new connections to instance 1 are shed, those to 0 are not.
        send_initials(&rm, 200);
        let m = rm
            .wait_for("200 more received", Duration::from_secs(10), |m| {
                m.balanced() && m.get(names::RECEIVED) >= before.get(names::RECEIVED) + 200.0
            })
            .await;
        let shed = m.dropped("initial_shed");
        assert!(shed > 0.0, "no Initial shed:\n{m}");
        assert_eq!(
            fwd(&m, 1),
            40.0,
            "a new connection's packet entered the crowded ring"
        );
        assert_eq!(shed + fwd(&m, 0) - fwd(&before, 0), 200.0, "{m}");
        // Established traffic still goes in, up to the ring's end.
        blast(&rm, 1, 20);
        let after = rm
            .wait_for(
                "20 more forwarded to instance 1",
                Duration::from_secs(10),
                |m| m.balanced() && fwd(m, 1) == 60.0,
            )
            .await;
        assert_eq!(after.dropped("ring_full"), 0.0, "{after}");
        assert_eq!(after.dropped("initial_shed"), shed, "{after}");
    })
    .await;
}

/// A worker cannot take a session whose ticket came in a ClientHello the demux routed to
/// another instance, even a session stored under a key it knows (here it stored both itself):
/// instance 1 (`take-foreign-session`) asks for the session offered to instance 0 and is
/// refused, and for the one offered to it and gets it. Both ClientHellos are real QUIC v1
/// Initials (protected with rustls' Initial keys), whose DCIDs hash to each instance.
#[tokio::test]
async fn a_worker_cannot_take_a_session_offered_to_another_instance() {
    bounded(Duration::from_secs(60), async {
        let dir = temp_dir("ringmux-attack-sessions");
        let rm = start_faulty("take-foreign-session", &[], &dir);
        rm.wait_for("both workers up", Duration::from_secs(20), |m| {
            (0..2).all(|i| m.instance(names::WORKER_UP, i) == 1.0)
        })
        .await;
        let client = UdpSocket::bind("127.0.0.1:0").unwrap();
        let scid = [0x5c; 8];
        // The fault worker's tickets (test-tools/fault-worker: FOREIGN_TICKET, OWN_TICKET).
        for (instance, ticket) in [(0u8, [0xa0u8; 32]), (1, [0xb1; 32])] {
            let dcid = rm.dcid_for(instance, 8);
            let hello = ringmux_testkit::client_initial::client_hello(&[&ticket], 0);
            let frames = ringmux_testkit::client_initial::crypto_frame(0, &hello);
            let p = ringmux_testkit::client_initial::initial_packet(
                &dcid,
                &dcid,
                &scid,
                &[],
                0,
                &frames,
            );
            client.send_to(&p, rm.listen).unwrap();
        }
        let r = report(&dir).await;
        assert_outcomes(&r, &["take-foreign"], "not-found");
        assert_outcomes(&r, &["take-own"], "found");
        let m = rm.metrics();
        let takes = |result| m.labelled(names::SESSION_TAKES, "result", result);
        assert_eq!(takes("foreign"), 1.0, "{m}");
        assert!(takes("hit") >= 1.0, "{m}");
        assert!(
            m.labelled(names::CLIENT_HELLOS, "result", "read") >= 2.0,
            "{m}"
        );
        // Instance 0 serves on.
        instance0_serves(&rm).await;
    })
    .await;
}

/// Under kernel steering (`--forward reuseport`) a confined worker receives on its own socket
/// of the group, but cannot replace or detach the program that steers every instance's
/// datagrams, join the group with another socket, connect its socket to a client's address,
/// or swap the descriptor; then, as the real worker in the same confined process, it serves,
/// and so does instance 0, with every datagram steered by the kernel (none reaches the demux).
#[tokio::test]
async fn a_confined_worker_cannot_steal_the_kernels_steering() {
    bounded(Duration::from_secs(60), async {
        let dir = temp_dir("ringmux-attack-steering");
        let rm = start_faulty_in(Forward::Reuseport, "steal-steering", &[], &dir);
        let r = report(&dir).await;
        assert_outcomes(&r, &["receive-own-socket"], "EAGAIN");
        assert_outcomes(
            &r,
            &[
                "attach-program",
                "detach-program",
                "join-group",
                "connect-own-socket",
                "replace-own-socket",
                "close-own-socket",
            ],
            "EPERM",
        );
        for i in 0..2u8 {
            let mut client = rm.client();
            // The program spreads client-chosen DCIDs by their first four octets as a
            // big-endian number, modulo the instances.
            client.set_initial_dst_cid_provider(std::sync::Arc::new(move || {
                let mut dcid = harness::random_u64().to_be_bytes();
                dcid[..4].copy_from_slice(&u32::from(i).to_be_bytes());
                quinn::ConnectionId::new(&dcid)
            }));
            let conn = rm.connect(&client).await;
            check_bytes(
                &format!("instance {i}"),
                &conn.get("/bytes/5000").await.expect("GET"),
                5000,
            );
        }
        let m = rm
            .wait_for(
                "both workers to report their connection",
                Duration::from_secs(10),
                |m| (0..2).all(|i| m.instance(names::WORKER_CONNECTIONS_ACCEPTED, i) >= 1.0),
            )
            .await;
        for i in 0..2 {
            assert_eq!(m.instance(names::WORKER_RESTARTS, i), 0.0, "{m}");
        }
        assert_eq!(m.get(names::RECEIVED), 0.0, "{m}");
    })
    .await;
}

/// A worker's access log (descriptor 7) and standard error (2) are pipes of its own, read by
/// the demux: it can write lines, and nothing it does reaches a line someone else wrote. With
/// `--access-log FILE` the file keeps its first line and gets the worker's line appended; with
/// `--access-log stderr` ringmux's standard error (here a file, as `2>file` makes it) keeps its
/// first lines. Positional writes (`pwrite64`, `pwritev2` with `RWF_NOAPPEND`), truncating
/// and seeking fail on a pipe.
#[tokio::test]
async fn a_worker_cannot_rewrite_the_access_log_or_ringmuxs_standard_error() {
    bounded(Duration::from_secs(90), async {
        for to in ["file", "stderr"] {
            let dir = temp_dir("ringmux-attack-log");
            let log = dir.path().join("access.log");
            std::fs::write(&log, "a line before the workers started\n").unwrap();
            let target = match to {
                "file" => log.to_str().unwrap().to_string(),
                _ => "stderr".to_string(),
            };
            let rm = start_faulty("log-rewrite", &["--access-log", &target], &dir);
            let r = report(&dir).await;
            assert_outcomes(&r, &["log-write"], "ok");
            for k in [
                "log-pwrite",
                "log-pwritev2-noappend",
                "log-truncate",
                "log-seek",
                "stderr-pwrite",
                "stderr-pwritev2-noappend",
                "stderr-truncate",
                "stderr-seek",
            ] {
                assert_ne!(r.get(k).map(String::as_str), Some("ok"), "{k}: {r:?}");
            }
            let written = if to == "file" {
                log.clone()
            } else {
                rm.dir().join("ringmux.log")
            };
            let deadline = Instant::now() + Duration::from_secs(10);
            let text = loop {
                let text = std::fs::read_to_string(&written).unwrap_or_default();
                if text.contains("a line from the fault worker") {
                    break text;
                }
                assert!(
                    Instant::now() < deadline,
                    "the worker's line never came: {text}"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            };
            assert!(!text.contains("OVERWRITTEN"), "{to}: {text}");
            if to == "file" {
                assert!(
                    text.starts_with("a line before the workers started\n"),
                    "{text}"
                );
            } else {
                // ringmux's own first line is still its first.
                assert!(
                    text.lines().next().is_some_and(|l| l.contains("ringmux")),
                    "{text}"
                );
            }
            instance0_serves(&rm).await;
            harness::third_party_served(&rm, 1).await;
        }
    })
    .await;
}

/// A worker cannot write a line that passes for the demux's: every line of ringmux's standard
/// error that came from a worker starts with its `[instance N] ` prefix, access lines included
/// with `--access-log stderr`; a carriage return, C1 controls (as UTF-8 and as raw bytes), a
/// Unicode line separator and invalid UTF-8 come out as `?`, so neither ringmux's standard
/// error nor the access-log file gets a line the worker split in two or a terminal control.
#[tokio::test]
async fn a_worker_cannot_forge_ringmuxs_log_lines() {
    bounded(Duration::from_secs(120), async {
        for to in ["stderr", "file"] {
            let dir = temp_dir("ringmux-attack-forge");
            let log = dir.path().join("access.log");
            let target = match to {
                "file" => log.to_str().unwrap().to_string(),
                _ => "stderr".to_string(),
            };
            let rm = start_faulty("log-forge", &["--access-log", &target], &dir);
            let r = report(&dir).await;
            assert_outcomes(&r, &["forge-stderr", "forge-log"], "ok");
            let stderr = rm.dir().join("ringmux.log");
            // Five lines written to standard error, five to the access log.
            let (on_stderr, in_file) = if to == "stderr" { (10, 0) } else { (5, 5) };
            let forged = |path: &std::path::Path| {
                let bytes = std::fs::read(path).unwrap_or_default();
                let n = String::from_utf8_lossy(&bytes)
                    .lines()
                    .filter(|l| l.contains("forged-by-worker"))
                    .count();
                (bytes, n)
            };
            let deadline = Instant::now() + Duration::from_secs(20);
            while forged(&stderr).1 < on_stderr || forged(&log).1 < in_file {
                assert!(
                    Instant::now() < deadline,
                    "{to}: the forged lines never all came: {} on stderr, {} in the file",
                    forged(&stderr).1,
                    forged(&log).1
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            for (path, expected) in [(&stderr, on_stderr), (&log, in_file)] {
                let (bytes, n) = forged(path);
                assert_eq!(n, expected, "{to}: {}", path.display());
                let text = String::from_utf8(bytes)
                    .unwrap_or_else(|e| panic!("{to}: {} is not UTF-8: {e}", path.display()));
                let bad: Vec<char> = text
                    .chars()
                    .filter(|&c| {
                        (c.is_control() && c != '\n' && c != '\t')
                            || c == '\u{2028}'
                            || c == '\u{fffd}'
                    })
                    .collect();
                assert!(
                    bad.is_empty(),
                    "{to}: {bad:?} in {}:\n{text}",
                    path.display()
                );
                for line in text.lines().filter(|l| l.contains("forged-by-worker")) {
                    if path == &stderr {
                        assert!(line.starts_with("[instance 1] "), "{to}: {line:?}");
                    }
                }
                // What followed a carriage return or a C1 next line stays on its line.
                for line in text.lines() {
                    if line.contains("after a CR") || line.contains("INFO next line") {
                        assert!(line.contains("forged-by-worker"), "{to}: {line:?}");
                    }
                }
            }
            if to == "stderr" {
                let text = std::fs::read_to_string(&stderr).unwrap();
                assert!(
                    text.contains(
                        "[instance 1] forged-by-worker c1-utf8 ? INFO next line ?31m csi"
                    ),
                    "{text}"
                );
                assert!(
                    text.contains("[instance 1] forged-by-worker c1-raw ? INFO next line ?31m csi"),
                    "{text}"
                );
            }
            instance0_serves(&rm).await;
        }
    })
    .await;
}

/// A worker that makes its standard error non-blocking and floods it (which used to make the
/// demux's own next log write fail, and the demux panic) loses its own lines only: the demux
/// passes on a burst of them, prefixed with the instance, cut at their maximum length and with
/// control characters replaced, drops the rest and counts them for that instance alone, and
/// serves on; the flooding worker, become the real worker, serves too.
#[tokio::test]
async fn a_worker_flooding_its_standard_error_loses_its_own_lines_only() {
    bounded(Duration::from_secs(90), async {
        let dir = temp_dir("ringmux-attack-flood");
        let rm = start_faulty("stderr-flood", &[], &dir);
        let r = report(&dir).await;
        assert_outcomes(&r, &["stderr-nonblock"], "ok");
        let m = rm
            .wait_for("the flood's excess counted", Duration::from_secs(20), |m| {
                m.instance(names::WORKER_LOG_LINES_DROPPED, 1) > 0.0
            })
            .await;
        assert_eq!(m.instance(names::WORKER_LOG_LINES_DROPPED, 0), 0.0, "{m}");
        assert!(m.instance(names::WORKER_LOG_LINES, 1) > 0.0, "{m}");
        assert!(m.instance(names::WORKER_LOG_LINES, 0) > 0.0, "{m}");
        instance0_serves(&rm).await;
        harness::third_party_served(&rm, 0).await;
        harness::third_party_served(&rm, 1).await;
        let text = std::fs::read_to_string(rm.dir().join("ringmux.log")).unwrap();
        assert!(
            text.contains("[instance 1] fault-worker flood line 000000 ?[31mred?[0m"),
            "flood lines prefixed, escape sequences replaced"
        );
        assert!(text.contains(" [cut]"), "the 100 KiB line is cut");
        assert!(!text.contains('\u{1b}'), "no escape character passes");
        let longest = text.lines().map(str::len).max().unwrap_or(0);
        assert!(longest <= 8 * 1024 + 64, "a line of {longest} bytes passed");
        assert!(
            text.lines().any(|l| l.starts_with("[instance 0] ")),
            "instance 0's lines pass too"
        );
        let m = rm.wait_balanced(Duration::from_secs(5)).await;
        assert_eq!(m.instance(names::WORKER_RESTARTS, 1), 0.0, "{m}");
    })
    .await;
}

/// Every worker runs in a session of its own (so in a process group and a scheduler autogroup
/// of its own), apart from the demux's and from each other's.
#[tokio::test]
async fn each_worker_has_a_session_of_its_own() {
    bounded(Duration::from_secs(60), async {
        let rm = Ringmux::start(2, Forward::Shm, &[]);
        let session = |pid: u32| -> String {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
            // After the command's closing parenthesis: state, ppid, pgrp, session.
            let rest = &stat[stat.rfind(')').unwrap() + 2..];
            rest.split_whitespace().nth(3).unwrap().to_string()
        };
        let workers: Vec<u32> = harness::children_of(rm.pid)
            .into_iter()
            .filter(|&p| harness::is_worker(p))
            .collect();
        assert_eq!(workers.len(), 2, "{workers:?}");
        let mut sessions: Vec<String> = workers.iter().map(|&p| session(p)).collect();
        for (w, s) in workers.iter().zip(&sessions) {
            assert_eq!(*s, w.to_string(), "worker {w} leads its own session");
        }
        sessions.push(session(rm.pid));
        sessions.sort();
        sessions.dedup();
        assert_eq!(sessions.len(), 3, "{sessions:?}");
    })
    .await;
}
