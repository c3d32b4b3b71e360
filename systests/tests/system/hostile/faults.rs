//! Fault injection against real ringmux processes: a worker killed mid-transfer, SIGTERM and
//! SIGKILL of the demux, and a storm of malformed datagrams next to real traffic.

use ringmux_systests::harness;

use ringmux_demux::metrics::names;
use std::net::UdpSocket;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use harness::{
    alive, bounded, check_bytes, dcid_routed_to, random_bytes, random_u64, wait_gone, Forward,
    Ringmux,
};

const LIMIT: Duration = Duration::from_secs(120);

/// kill -9 of instance 1's worker while instances 0 and 2 stream large bodies: their transfers
/// complete, the client of instance 1 gets a stateless reset (not an idle timeout) within a few
/// seconds, and a replacement worker comes up and serves a new connection on instance 1.
async fn worker_killed(forward: Forward) {
    const BIG: u64 = 32 << 20;
    const VICTIM: u8 = 1;
    let rm = Ringmux::start(3, forward, &["--idle-timeout", "30"]);
    let pids = rm.worker_pids().await;
    let victim_pid = pids[usize::from(VICTIM)];

    let victim_client = rm.pinned_client(VICTIM);
    let victim = rm.connect(&victim_client).await;
    let resp = victim.get("/bytes/10").await.expect("victim's first GET");
    check_bytes("victim before the kill", &resp, 10);

    // Survivors: two connections each on instances 0 and 2, each downloading BIG.
    let mut survivors = Vec::new();
    let mut conns = Vec::new();
    for instance in [0u8, 2, 0, 2] {
        let client = rm.pinned_client(instance);
        let conn = Arc::new(rm.connect(&client).await);
        let c = conn.clone();
        let task = tokio::spawn(async move {
            let _keep = client;
            c.get(&format!("/bytes/{BIG}")).await
        });
        survivors.push((instance, task));
        conns.push(conn);
    }
    // Kill once every survivor is receiving its body.
    let deadline = Instant::now() + Duration::from_secs(10);
    while conns
        .iter()
        .any(|c| c.quic().stats().udp_rx.bytes < (256 << 10))
    {
        assert!(
            Instant::now() < deadline,
            "survivor downloads did not start"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    // A worker pid the demux reported and /proc confirmed.
    harness::kill(victim_pid).expect("kill -9 of the worker");
    let killed_at = Instant::now();
    let unfinished = survivors.iter().filter(|(_, t)| !t.is_finished()).count();
    assert!(
        unfinished > 0,
        "every survivor finished before the kill: nothing was tested"
    );

    // The victim's next request meets the replacement (or nobody), which can only answer with
    // a stateless reset, since every instance shares the reset key.
    let err = victim
        .get("/bytes/10")
        .await
        .expect_err("a request on a dead worker's connection succeeded");
    let elapsed = killed_at.elapsed();
    let reason = victim.quic().close_reason();
    assert!(
        matches!(reason, Some(quinn::ConnectionError::Reset)),
        "victim connection ended with {reason:?} ({err}, kind {}) after {elapsed:?}, \
         expected a stateless reset",
        err.kind()
    );
    assert!(
        elapsed < Duration::from_secs(8),
        "stateless reset took {elapsed:?}"
    );

    for (instance, task) in survivors {
        let resp = task
            .await
            .expect("survivor task")
            .unwrap_or_else(|e| panic!("download on instance {instance} failed: {e}"));
        check_bytes(&format!("survivor on instance {instance}"), &resp, BIG);
    }

    let m = rm
        .wait_for(
            "instance 1 restarted, up, and reporting a new pid",
            Duration::from_secs(10),
            |m| {
                let pid = m.instance(names::WORKER_PID, VICTIM);
                m.instance(names::WORKER_RESTARTS, VICTIM) >= 1.0
                    && m.instance(names::WORKER_UP, VICTIM) == 1.0
                    && pid > 0.0
                    && pid != f64::from(victim_pid)
            },
        )
        .await;
    for i in [0u8, 2] {
        assert_eq!(
            m.instance(names::WORKER_RESTARTS, i),
            0.0,
            "instance {i} restarted too"
        );
    }
    assert!(!alive(victim_pid), "killed worker {victim_pid} still alive");
    let new_pid = m.instance(names::WORKER_PID, VICTIM) as u32;
    assert!(
        alive(new_pid),
        "replacement worker {new_pid} is not running"
    );

    let client = rm.pinned_client(VICTIM);
    let conn = rm.connect(&client).await;
    let resp = conn
        .get("/bytes/77777")
        .await
        .expect("GET on the replacement");
    check_bytes("replacement worker", &resp, 77777);
    conn.close().await.expect("clean close");
    rm.wait_for(
        "the replacement to report the new connection",
        Duration::from_secs(5),
        |m| m.instance(names::WORKER_CONNECTIONS_ACCEPTED, VICTIM) >= 1.0,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_killed_shm() {
    bounded(LIMIT, worker_killed(Forward::Shm)).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_killed_unix() {
    bounded(LIMIT, worker_killed(Forward::Unix)).await
}

/// SIGTERM with a connection still open: ringmux drains, exits 0 within `--grace 5` (plus
/// slack for process teardown), and leaves no worker behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_exits_cleanly() {
    bounded(LIMIT, async {
        const GRACE: u64 = 5;
        let mut rm = Ringmux::start(2, Forward::Shm, &["--grace", &GRACE.to_string()]);
        let pids = rm.worker_pids().await;
        let client = rm.client();
        let conn = rm.connect(&client).await;
        let resp = conn.get("/bytes/1234").await.expect("GET");
        check_bytes("before SIGTERM", &resp, 1234);

        let start = Instant::now();
        rm.signal(libc::SIGTERM);
        let status = rm.wait_exit(Duration::from_secs(GRACE + 10)).await;
        let took = start.elapsed();
        assert_eq!(status.code(), Some(0), "ringmux exit status {status:?}");
        // Every worker drained and exited on its own: none had to be cut at the deadline.
        let log = rm.log_tail(400);
        assert!(!log.contains("cutting"), "a worker did not drain:\n{log}");
        assert_eq!(log.matches("worker exited").count(), 2, "{log}");
        assert!(
            !log.contains("unix_wait_status(9)"),
            "a worker was killed:\n{log}"
        );
        assert!(
            took <= Duration::from_secs(GRACE + 2),
            "ringmux took {took:?} to exit with --grace {GRACE}"
        );
        let left = wait_gone(&pids, Duration::from_secs(2)).await;
        assert!(left.is_empty(), "workers {left:?} outlived ringmux");
        drop(conn);
    })
    .await
}

/// SIGKILL of the demux: it cannot tell its workers, so they must notice (PR_SET_PDEATHSIG,
/// control socket closing) and die on their own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_of_demux_takes_workers_down() {
    bounded(LIMIT, async {
        let mut rm = Ringmux::start(3, Forward::Shm, &[]);
        let pids = rm.worker_pids().await;
        rm.signal(libc::SIGKILL);
        rm.wait_exit(Duration::from_secs(5)).await;
        let left = wait_gone(&pids, Duration::from_secs(5)).await;
        assert!(
            left.is_empty(),
            "workers {left:?} survived the demux's SIGKILL"
        );
    })
    .await
}

/// The kinds of junk the storm sends.
#[derive(Clone, Copy, Debug)]
enum Junk {
    Garbage,
    TruncatedLong,
    DcidTooLong,
    UnknownVersion,
    Runt,
    Oversize,
}

/// Zero-length datagrams are left to `zero_length_datagrams_are_counted`.
const JUNK: [Junk; 6] = [
    Junk::Garbage,
    Junk::TruncatedLong,
    Junk::DcidTooLong,
    Junk::UnknownVersion,
    Junk::Runt,
    Junk::Oversize,
];

fn junk(kind: Junk) -> Vec<u8> {
    let r = random_u64();
    match kind {
        Junk::Garbage => random_bytes(1 + (r % 1400) as usize),
        Junk::TruncatedLong => {
            // A v1 Initial header cut somewhere inside its fields.
            let mut d = vec![0xc0, 0, 0, 0, 1, 8];
            d.extend_from_slice(&random_bytes(8));
            d.extend_from_slice(&[8]);
            d.extend_from_slice(&random_bytes(8));
            d.extend_from_slice(&[0x00, 0x44, 0xd0]); // token 0, Length 1232 > what follows
            d.truncate(1 + (r % (d.len() as u64 - 1)) as usize);
            if r.is_multiple_of(5) {
                d.extend_from_slice(&random_bytes(50)); // whole header, Length past the end
            }
            d
        }
        Junk::DcidTooLong => {
            let len = 21 + (r % 235) as u8;
            let mut d = vec![0xc0, 0, 0, 0, 1, len];
            d.extend_from_slice(&random_bytes(usize::from(len) + 40));
            d
        }
        Junk::UnknownVersion => {
            // Version negotiation needs ≥ 1200 bytes (RFC 9000 §6, §14.1).
            let mut d = vec![0xc0, 0x1a, 0x2a, 0x3a, 0x4a, 8];
            d.extend_from_slice(&random_bytes(8));
            d.push(8);
            d.extend_from_slice(&random_bytes(8));
            d.resize(1200, 0);
            d
        }
        Junk::Runt => random_bytes(1),
        Junk::Oversize => {
            let mut d = random_bytes(3000);
            d[0] = 0x40 | (d[0] & 0x3f); // a short header with some DCID
            d
        }
    }
}

/// 50 000 junk datagrams at full speed while a real client keeps making requests: ringmux keeps
/// running, every real request succeeds, and every received datagram is accounted for.
async fn bad_input_storm(forward: Forward) {
    const STORM: usize = 50_000;
    let mut rm = Ringmux::start(2, forward, &[]);
    let stop = Arc::new(AtomicBool::new(false));
    let requests = Arc::new(AtomicU64::new(0));

    let client = rm.client();
    let conn = Arc::new(rm.connect(&client).await);
    let (c, s, n) = (conn.clone(), stop.clone(), requests.clone());
    let real = tokio::spawn(async move {
        let mut i = 0u64;
        while !s.load(Ordering::Relaxed) || i < 20 {
            let size = 1 + (i * 7919) % 200_000;
            let resp = c
                .get(&format!("/bytes/{size}"))
                .await
                .unwrap_or_else(|e| panic!("real request {i} during the storm: {e}"));
            check_bytes(&format!("real request {i}"), &resp, size);
            i += 1;
            n.store(i, Ordering::Relaxed);
        }
    });
    // A second client connecting during the storm, pinned to each instance in turn.
    let mut fresh = Vec::new();
    for instance in 0..2u8 {
        fresh.push(rm.pinned_client(instance));
    }

    let listen = rm.listen;
    let router = rm.router.clone();
    let storm = tokio::task::spawn_blocking(move || {
        let sock = UdpSocket::bind("127.0.0.1:0").unwrap();
        let mut expected_malformed = 0u64;
        let mut per_kind = [0u64; JUNK.len()];
        for i in 0..STORM {
            let k = (random_u64() % JUNK.len() as u64) as usize;
            let d = junk(JUNK[k]);
            if router.route(&d).instance().is_none() {
                expected_malformed += 1;
            }
            per_kind[k] += 1;
            // Loopback drops nothing on send; ENOBUFS would be a (harmless) local drop.
            let _ = sock.send_to(&d, listen);
            if i.is_multiple_of(5_000) {
                // A valid-looking short header for a CID only instance 1 could own.
                let mut d = vec![0x41];
                d.extend_from_slice(&dcid_routed_to(&router, 1, 17));
                d.extend_from_slice(&random_bytes(40));
                let _ = sock.send_to(&d, listen);
            }
        }
        (expected_malformed, per_kind)
    });
    let mut fresh_ok = 0;
    while !storm.is_finished() {
        for c in &fresh {
            let conn = rm.connect(c).await;
            let resp = conn
                .get("/bytes/4321")
                .await
                .expect("new connection during the storm");
            check_bytes("new connection during the storm", &resp, 4321);
            conn.close().await.expect("clean close");
            fresh_ok += 1;
        }
    }
    let (expected_malformed, per_kind) = storm.await.unwrap();
    stop.store(true, Ordering::Relaxed);
    real.await.expect("real requests");
    assert!(fresh_ok >= 2, "no new connection was made during the storm");
    assert!(rm.running(), "ringmux died during the storm");

    let m = rm.wait_balanced(Duration::from_secs(10)).await;
    let malformed = m.dropped("malformed");
    eprintln!(
        "storm {per_kind:?} (Garbage, TruncatedLong, DcidTooLong, UnknownVersion, Runt, \
         Oversize): {expected_malformed} malformed by the router; demux counted {malformed}; \
         {} real requests, {fresh_ok} fresh connections\n{m}",
        requests.load(Ordering::Relaxed)
    );
    assert!(malformed > 0.0, "no malformed datagram counted:\n{m}");
    let kernel_drops = udp_drops(rm.listen.port());
    if kernel_drops == Some(0) {
        // Nothing was lost before the demux: its count must match the router's exactly.
        assert_eq!(
            malformed, expected_malformed as f64,
            "malformed datagrams counted by the demux vs sent"
        );
        if forward == Forward::Shm {
            assert_eq!(
                m.dropped("oversize"),
                per_kind[5] as f64,
                "3000-byte datagrams fit no 2 KiB slot: each must be counted oversize"
            );
        }
    } else {
        eprintln!("the kernel dropped {kernel_drops:?} datagrams: counts checked as bounds");
        assert!(
            malformed <= expected_malformed as f64,
            "more malformed ({malformed}) than the storm contained ({expected_malformed})"
        );
    }
    assert!(
        m.received() >= (STORM / 2) as f64,
        "the demux received only {} of {STORM} storm datagrams",
        m.received()
    );
    if forward == Forward::Shm {
        assert!(
            m.dropped("oversize") > 0.0,
            "3000-byte datagrams fit no 2 KiB slot but none was counted oversize:\n{m}"
        );
    }
    for i in 0..2 {
        assert_eq!(m.instance(names::WORKER_UP, i), 1.0, "instance {i} down");
        assert_eq!(
            m.instance(names::WORKER_RESTARTS, i),
            0.0,
            "instance {i} restarted during the storm"
        );
    }
    // Still serving after the storm.
    let resp = conn.get("/bytes/99").await.expect("GET after the storm");
    check_bytes("after the storm", &resp, 99);
}

/// A zero-length UDP datagram is a datagram received, and a malformed one (the router's
/// `MalformedReason::Empty`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zero_length_datagrams_are_counted() {
    bounded(LIMIT, async {
        const N: usize = 10;
        let rm = Ringmux::start(1, Forward::Shm, &[]);
        let sock = UdpSocket::bind("127.0.0.1:0").unwrap();
        for _ in 0..N {
            sock.send_to(&[], rm.listen).unwrap();
        }
        // And a 1-byte runt. Loopback may reorder datagrams when the sending thread moves
        // between CPUs (each CPU has its own backlog), so wait for the count, not for the last.
        sock.send_to(&[0x40], rm.listen).unwrap();
        rm.wait_for("all of them to be counted", Duration::from_secs(5), |m| {
            m.received() >= (N + 1) as f64
        })
        .await;
        let m = rm.wait_balanced(Duration::from_secs(5)).await;
        assert_eq!(
            udp_drops(rm.listen.port()),
            Some(0),
            "the kernel dropped datagrams"
        );
        assert_eq!(
            (m.received(), m.dropped("malformed")),
            ((N + 1) as f64, (N + 1) as f64),
            "{N} zero-length datagrams and one runt: (received, malformed)"
        );
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_storm_shm() {
    bounded(LIMIT, bad_input_storm(Forward::Shm)).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_storm_unix() {
    bounded(LIMIT, bad_input_storm(Forward::Unix)).await
}

/// Datagrams the kernel dropped on the 127.0.0.1 UDP socket bound to `port` (the last column
/// of /proc/net/udp), if the socket is listed.
fn udp_drops(port: u16) -> Option<u64> {
    let table = std::fs::read_to_string("/proc/net/udp").ok()?;
    let local = format!("0100007F:{port:04X}");
    table.lines().skip(1).find_map(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        (fields.get(1) == Some(&local.as_str()))
            .then(|| fields.last()?.parse().ok())
            .flatten()
    })
}

/// Starts ringmux (2 instances, shm, `--grace 5`) through `script`, a wrapper that sets up
/// the process as a shell or a terminal would and then executes ringmux with its arguments.
fn start_wrapped(script: &str) -> Ringmux {
    use std::os::unix::fs::PermissionsExt;
    let dir = ringmux_testkit::temp_dir("ringmux-wrapped");
    let wrapper = dir.path().join("ringmux-wrapped");
    std::fs::write(&wrapper, script).unwrap();
    std::fs::set_permissions(&wrapper, std::fs::Permissions::from_mode(0o755)).unwrap();
    Ringmux::start_in(
        dir,
        &wrapper,
        2,
        Forward::Shm,
        &["--grace", "5"],
        harness::worker_bin(),
        &[],
    )
}

/// Started with SIGINT and SIGHUP ignored (as a shell starts a background job, and nohup),
/// ringmux still reloads on SIGHUP and drains and exits on SIGINT: it blocks them and reads
/// them from a signalfd, and a blocked signal is queued whatever its disposition.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn signals_ignored_at_start_still_reach_the_demux() {
    bounded(LIMIT, async {
        let mut rm = start_wrapped(&format!(
            "#!/bin/sh\ntrap '' INT HUP\nexec {} \"$@\"\n",
            harness::binary("ringmux").display()
        ));
        // The premise: the demux runs with both ignored (SigIgn, a hexadecimal mask of signal
        // numbers less one).
        let status = std::fs::read_to_string(format!("/proc/{}/status", rm.pid)).unwrap();
        let ignored = status
            .lines()
            .find_map(|l| l.strip_prefix("SigIgn:"))
            .and_then(|m| u64::from_str_radix(m.trim(), 16).ok())
            .expect("SigIgn in /proc/PID/status");
        for sig in [libc::SIGINT, libc::SIGHUP] {
            assert_ne!(
                ignored & (1 << (sig - 1)),
                0,
                "signal {sig} not ignored: {status}"
            );
        }

        rm.signal(libc::SIGHUP);
        rm.wait_for(
            "the reload SIGHUP asked for",
            Duration::from_secs(30),
            |m| m.labelled(names::RELOADS, "result", "ok") == 1.0,
        )
        .await;
        rm.signal(libc::SIGINT);
        let status = rm.wait_exit(Duration::from_secs(30)).await;
        assert_eq!(status.code(), Some(0), "ringmux exit status {status:?}");
    })
    .await
}

/// Ctrl-C at a terminal sends SIGINT to the whole foreground process group, not to ringmux
/// alone. The workers have process groups of their own, so it reaches the demux only, which
/// drains them: each exits 0, none dies of the signal. (ringmux runs here as the leader of a
/// group, with SIGINT's default disposition, as a shell's foreground job does.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ctrl_c_at_a_terminal_drains_the_workers() {
    // python3 is a test prerequisite (the harness's upstream and the aioquic client run on it).
    bounded(LIMIT, async {
        let mut rm = start_wrapped(&format!(
            "#!/usr/bin/env python3\n\
             import os, signal, sys\n\
             os.setsid()\n\
             signal.signal(signal.SIGINT, signal.SIG_DFL)\n\
             os.execv({bin:?}, [{bin:?}] + sys.argv[1:])\n",
            bin = harness::binary("ringmux").display().to_string()
        ));
        let pids = rm.worker_pids().await;
        let client = rm.client();
        let conn = rm.connect(&client).await;
        let resp = conn.get("/bytes/1234").await.expect("GET");
        check_bytes("before Ctrl-C", &resp, 1234);

        let group = nix::unistd::Pid::from_raw(rm.pid as i32);
        nix::sys::signal::killpg(group, nix::sys::signal::Signal::SIGINT).expect("killpg");
        let status = rm.wait_exit(Duration::from_secs(30)).await;
        assert_eq!(status.code(), Some(0), "ringmux exit status {status:?}");
        let log = rm.log_tail(400);
        assert_eq!(log.matches("worker exited").count(), 2, "{log}");
        assert_eq!(
            log.matches("unix_wait_status(0)").count(),
            2,
            "a worker did not drain and exit 0:\n{log}"
        );
        let left = wait_gone(&pids, Duration::from_secs(5)).await;
        assert!(left.is_empty(), "workers {left:?} outlived ringmux");
        drop(conn);
    })
    .await
}

/// ringmux's standard error fails under it: made non-blocking and full (a stalled log
/// collector), then closed (a collector that went away). The demux drops its lines and counts
/// them, and serves on: a reload (which logs) goes through each time, requests are answered.
/// Its workers write to pipes of their own, so what they log is dropped by the demux too,
/// never by them failing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_standard_error_costs_lines_not_the_demux() {
    use std::io::Write;
    bounded(LIMIT, async {
        let (read, write) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC).unwrap();
        let rm = Ringmux::launch(harness::Launch {
            dir: ringmux_testkit::temp_dir("ringmux-stderr"),
            demux: &harness::binary("ringmux"),
            instances: 2,
            forward: Forward::Shm,
            extra: &["--grace", "2"],
            worker_bin: harness::worker_bin(),
            env: &[],
            stderr: Some(write.try_clone().unwrap()),
        });
        // The same open file description as the demux's standard error: non-blocking for it
        // too from now on. Then fill the pipe.
        rustix::io::ioctl_fionbio(&write, true).unwrap();
        let mut pipe = std::fs::File::from(write);
        let block = [b'.'; 4096];
        let mut filled = 0usize;
        while filled < 16 << 20 {
            match pipe.write(&block) {
                Ok(n) => filled += n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) => panic!("filling the pipe: {e}"),
            }
        }
        let dropped = |m: &harness::Metrics| m.get(names::LOG_LINES_DROPPED);
        let before = dropped(&rm.metrics());
        let (ok, text) = rm.reload(Duration::from_secs(30)).await;
        assert!(
            ok,
            "reload with a full, non-blocking standard error: {text}"
        );
        let m = rm
            .wait_for("lines dropped", Duration::from_secs(10), |m| {
                dropped(m) > before
            })
            .await;
        let full = dropped(&m);
        both_serve(&rm).await;

        // The reader goes away: every write fails with EPIPE.
        drop(read);
        let (ok, text) = rm.reload(Duration::from_secs(30)).await;
        assert!(ok, "reload with a closed standard error: {text}");
        rm.wait_for("more lines dropped", Duration::from_secs(10), |m| {
            dropped(m) > full
        })
        .await;
        both_serve(&rm).await;
        let m = rm.metrics();
        assert_eq!(
            m.labelled(names::RELOADS, "result", "ok"),
            2.0,
            "both reloads went through:\n{m}"
        );
    })
    .await
}

/// A request answered on each of 2 instances, by the harness's client and by a client nobody
/// here wrote.
async fn both_serve(rm: &Ringmux) {
    for i in 0..2 {
        harness::third_party_served(rm, i).await;
        let client = rm.pinned_client(i);
        let conn = rm.connect(&client).await;
        check_bytes(
            &format!("instance {i}"),
            &conn.get("/bytes/1000").await.expect("GET"),
            1000,
        );
    }
}
