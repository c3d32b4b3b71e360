//! Helpers shared by the ring's integration tests: a ring whose consumer lives in this process,
//! and re-running this test binary as a child process that inherits ring descriptors.
#![allow(dead_code)]
#![allow(clippy::multiple_unsafe_ops_per_block)] // raw calls of a process playing hostile, each block commented

use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use ringmux_ring::{Consumer, Producer, RingConfig, SpinPolicy};

/// Descriptor numbers a child finds its ring at.
pub const CHILD_RING_FD: i32 = 3;
pub const CHILD_PAGE_FD: i32 = 4;
pub const CHILD_BELL_FD: i32 = 5;

pub fn dup(fd: BorrowedFd<'_>) -> OwnedFd {
    fd.try_clone_to_owned().expect("dup")
}

/// A consumer that never spins: it sleeps as soon as its ring runs dry.
pub const NO_SPIN: SpinPolicy = SpinPolicy::Adaptive {
    max: Duration::ZERO,
};

/// A producer and a consumer attached to it in this process.
pub fn pair(slots: u32, spin_us: u32) -> (Producer, Consumer) {
    let cfg = RingConfig {
        slots,
        slot_bytes: 2048,
    };
    let p = Producer::create(&cfg).expect("create ring");
    let max = Duration::from_micros(u64::from(spin_us));
    let c = attach(&p, SpinPolicy::Adaptive { max });
    (p, c)
}

/// A consumer of `p`'s current generation, attached in this process.
pub fn attach(p: &Producer, spin: SpinPolicy) -> Consumer {
    let h = p.handles();
    Consumer::attach(
        dup(h.ring),
        dup(h.page),
        dup(h.doorbell),
        h.generation,
        spin,
    )
    .expect("attach")
}

/// Re-runs this test binary, selecting the single test `role` (which acts only when
/// `RINGMUX_TEST_ROLE` names it), with the producer's descriptors at fds 3, 4, 5.
pub fn spawn_child(role: &str, p: &Producer, env: &[(&str, String)]) -> Child {
    let h = p.handles();
    let fds = [
        h.ring.as_raw_fd(),
        h.page.as_raw_fd(),
        h.doorbell.as_raw_fd(),
    ];
    let mut cmd = Command::new(std::env::current_exe().expect("current_exe"));
    cmd.args([
        "--exact",
        role,
        "--nocapture",
        "--test-threads=1",
        "--include-ignored",
    ])
    .env("RINGMUX_TEST_ROLE", role)
    .env("RINGMUX_TEST_GENERATION", h.generation.to_string())
    .stdout(Stdio::piped())
    .stderr(Stdio::inherit());
    for (k, v) in env {
        cmd.env(k, v);
    }
    // SAFETY: between fork and exec only dup2 (async-signal-safe) runs. dup2 clears CLOEXEC on
    // the new descriptor, so the child inherits exactly fds 3, 4, 5. Sources are first moved
    // above 10 so that a source equal to a target is not clobbered.
    unsafe {
        cmd.pre_exec(move || {
            let mut high = [0; 3];
            for (i, fd) in fds.iter().enumerate() {
                high[i] = libc::fcntl(*fd, libc::F_DUPFD_CLOEXEC, 10);
                if high[i] < 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            for (i, target) in [CHILD_RING_FD, CHILD_PAGE_FD, CHILD_BELL_FD]
                .iter()
                .enumerate()
            {
                if libc::dup2(high[i], *target) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
    cmd.spawn().expect("spawn child test process")
}

/// In a child: the role this process was started for, if any.
pub fn child_role() -> Option<String> {
    std::env::var("RINGMUX_TEST_ROLE").ok()
}

/// In a child: attach to the inherited ring.
pub fn child_attach(spin: SpinPolicy) -> Consumer {
    use std::os::fd::FromRawFd;
    let generation: u64 = std::env::var("RINGMUX_TEST_GENERATION")
        .unwrap()
        .parse()
        .unwrap();
    // SAFETY: the parent placed the ring's descriptors at these numbers (spawn_child) and nothing
    // else in this process owns them.
    let (r, p, b) = unsafe {
        (
            OwnedFd::from_raw_fd(CHILD_RING_FD),
            OwnedFd::from_raw_fd(CHILD_PAGE_FD),
            OwnedFd::from_raw_fd(CHILD_BELL_FD),
        )
    };
    Consumer::attach(r, p, b, generation, spin).expect("child attach")
}

/// Waits for a child at most `limit`, killing it when the limit passes (the watchdog).
pub fn wait_with_watchdog(child: &mut Child, limit: Duration) -> std::process::ExitStatus {
    let deadline = std::time::Instant::now() + limit;
    loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            return status;
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("child exceeded its {limit:?} watchdog and was killed");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
