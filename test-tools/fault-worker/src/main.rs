//! `ringmux-fault-worker`: a test tool, not part of a deployment. Given to `ringmux` as
//! `--worker-bin`, it behaves as a broken or hostile worker for one instance, once, and as the
//! real worker otherwise, so tests can check that the demux survives, counts, resets the ring
//! and restarts the worker while the other instances carry on.
//!
//! Environment (inherited from the demux):
//! - `RINGMUX_REAL_WORKER`: path of the real `ringmux-worker` (exec'd for every other case,
//!   with this program's arguments: the built-in worker's options ringmux passed);
//! - `RINGMUX_FAULT`: `head-ahead` (writes a head far beyond the tail), `head-backwards`
//!   (consumes, then moves head back), `stop-draining` (attaches, reports ready, never drains),
//!   `die-mid-batch` (reads part of a batch, then aborts), `flip-wakeup` (drains, but flips
//!   `need_wakeup` wildly), `jam-doorbell` (tries to fill its doorbell, clears `O_NONBLOCK` on its end
//!   and announces a sleep, stopping there: what made a shared eventfd block the demux's next
//!   doorbell write), `control-flood` (stops draining and
//!   floods the control socket with one-byte messages from two threads, so that a supervisor
//!   that reads until the socket is empty never gets to its watchdog), `linger` (on SHUTDOWN,
//!   closes its control socket and keeps running, ignoring SIGTERM: a drain that never ends),
//!   `fork-and-jam` (forks a child that detaches with `setsid` and keeps the ring, doorbell
//!   and sockets, clearing `O_NONBLOCK` and writing the doorbell; then dies), and the attacks on
//!   the confinement, each recorded in `MARKER.report` before the real worker is exec'd in
//!   the same process: `signal-parent`, `signal-sibling`, `fork`, `recv-public`, `reload` (asks
//!   for a reload on the control socket named by `RINGMUX_FAULT_CONTROL_SOCKET`),
//!   `steal-steering` (under `--forward reuseport`: change the kernel's steering, join the
//!   group, connect or swap its own socket), `files` (reads and writes the ACME state, files
//!   outside the roots, the site root and elsewhere), `rate-tables` (tries every way to write
//!   its sibling's rate table, then fills its own with garbage) (`attacks.rs`); and `take-foreign-session` (stores two sessions, then, once a datagram
//!   reached it, tries to take a session whose ClientHello went to another instance and one
//!   whose ClientHello came to it, and records both answers); `stats-flood` and
//!   `session-flood`, floods of well-formed reports and session-store PUTs (`floods.rs`);
//! - `RINGMUX_FAULT_INSTANCE`: the instance to break (default 1);
//! - `RINGMUX_FAULT_MARKER`: a file created when the fault is played; if it exists, behave.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::time::{Duration, Instant};

use nix::fcntl::{fcntl, FcntlArg, OFlag};
use nix::sys::socket::MsgFlags;
use ringmux_proto::session::{decode_reply, encode_request, Op, MAX_REPLY_LEN};
use ringmux_proto::{Handoff, Message, MAX_MESSAGE};
use ringmux_ring::{Consumer, SpinPolicy};
use ringmux_worker::control;

mod attacks;
mod floods;

fn main() {
    let marker =
        std::env::var("RINGMUX_FAULT_MARKER").unwrap_or_else(|_| "/nonexistent/marker".into());
    if let Ok(copy) = std::env::var(attacks::RENUMBERED_ENV) {
        // The second image of `free-named`: descriptor 3 was freed by the first.
        let mut outcomes = attacks::Outcomes::new();
        attacks::renumbered(&mut outcomes);
        for (attempt, outcome) in &outcomes {
            eprintln!("fault-worker: {attempt}: {outcome}");
        }
        let mut lines: Vec<(&str, String)> = Vec::new();
        let before = std::fs::read_to_string(format!("{marker}.report")).unwrap_or_default();
        let before: Vec<(String, String)> = before
            .lines()
            .filter_map(|l| l.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        lines.extend(before.iter().map(|(k, v)| (k.as_str(), v.clone())));
        lines.extend(outcomes.iter().map(|(k, v)| (*k, v.clone())));
        write_report(&marker, &lines);
        let real = std::env::var("RINGMUX_REAL_WORKER").expect("RINGMUX_REAL_WORKER");
        let e = std::process::Command::new(real)
            .args(std::env::args_os().skip(1))
            .env(ringmux_proto::CONTROL_FD_ENV, copy)
            .env_remove(attacks::RENUMBERED_ENV)
            .exec();
        panic!("exec of the real worker failed: {e}");
    }
    let control_fd: i32 = std::env::var(ringmux_proto::CONTROL_FD_ENV)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3);
    let fault = std::env::var("RINGMUX_FAULT").unwrap_or_default();
    let target: u8 = std::env::var("RINGMUX_FAULT_INSTANCE")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    // SAFETY: the demux handed us this descriptor; it stays open while borrowed here.
    let control = unsafe { BorrowedFd::borrow_raw(control_fd) };
    let handoff = peek_handoff(control);
    let ours = handoff.as_ref().is_some_and(|h| h.instance == target);
    if !ours || std::path::Path::new(&marker).exists() || fault.is_empty() {
        let real = std::env::var("RINGMUX_REAL_WORKER")
            .expect("RINGMUX_REAL_WORKER must name the real worker");
        let e = std::process::Command::new(real)
            .args(std::env::args_os().skip(1))
            .exec();
        panic!("exec of the real worker failed: {e}");
    }
    let _ = std::fs::write(&marker, fault.as_bytes());
    let real = || std::env::var("RINGMUX_REAL_WORKER").expect("RINGMUX_REAL_WORKER");
    if let Some(outcomes) = attacks::play(&fault) {
        for (attempt, outcome) in &outcomes {
            eprintln!("fault-worker: instance {target}: {attempt}: {outcome}");
        }
        write_report(&marker, &outcomes);
        if fault == "free-named" && attacks::freed_a_named_descriptor(&outcomes) {
            // Descriptor 3 can be freed: make sure it is close-on-exec, keep a copy of the
            // control socket (the first attempt made one at 10 or above) and go on in a new
            // image, where 3 is free.
            let copy = outcomes
                .iter()
                .find(|(a, _)| *a == "copy-control-fd")
                .map_or_else(|| "10".to_string(), |(_, fd)| fd.clone());
            // SAFETY: F_SETFD takes no memory.
            unsafe { libc::fcntl(control_fd, libc::F_SETFD, libc::FD_CLOEXEC) };
            let me = std::env::current_exe().expect("this program");
            let e = std::process::Command::new(me)
                .args(std::env::args_os().skip(1))
                .env(attacks::RENUMBERED_ENV, copy)
                .exec();
            panic!("exec of this program again failed: {e}");
        }
        // The hand-off is still unread: the real worker takes it, under the same filter.
        let e = std::process::Command::new(real())
            .args(std::env::args_os().skip(1))
            .exec();
        panic!("exec of the real worker failed: {e}");
    }
    // SAFETY: as above; from here on this process owns the control socket.
    let control = unsafe { OwnedFd::from_raw_fd(control_fd) };
    let (h, fds) = control::recv_handoff(control.as_fd()).expect("hand-off");
    let mut fds = fds.into_iter();
    let (ring, page, bell) = (
        fds.next().unwrap(),
        fds.next().unwrap(),
        fds.next().unwrap(),
    );
    // Any worker may map its consumer page writable: that is what a hostile one does.
    // SAFETY: a shared mapping of the page; the demux only ever reads it through validation.
    let mut page_map = unsafe { memmap2::MmapOptions::new().len(4096).map_mut(&page) }
        .expect("mmap of the consumer page");
    let bell_fd = bell.try_clone().expect("doorbell descriptor");
    // Taken now: attaching maps the ring and closes this descriptor.
    let ring_inode = {
        use std::os::unix::fs::MetadataExt;
        let f = std::fs::File::from(ring.try_clone().expect("ring descriptor"));
        f.metadata().map(|m| m.ino()).unwrap_or(0)
    };
    let no_spin = SpinPolicy::Adaptive {
        max: Duration::ZERO,
    };
    let mut c = Consumer::attach(ring, page, bell, h.generation, no_spin).expect("attach");
    control::send(control.as_fd(), &Message::Ready).expect("ready");
    eprintln!("fault-worker: instance {} plays {fault}", h.instance);
    let head = page_map.as_mut_ptr().cast::<u64>();
    let flag = page_map.as_mut_ptr().wrapping_add(8).cast::<u32>();
    match fault.as_str() {
        // Writes below: `page_map` is a live 4096-byte shared mapping; volatile stores are how
        // a foreign process's writes look to the demux.
        "head-ahead" => {
            // SAFETY: as above.
            unsafe { head.write_volatile(u64::MAX / 2) }
        }
        "head-backwards" => {
            drain_for(&mut c, Duration::from_secs(30), 10);
            // SAFETY: as above.
            unsafe { head.write_volatile(0) };
        }
        "stop-draining" => {}
        "die-mid-batch" => {
            drain_for(&mut c, Duration::from_secs(30), 3);
            let _ = c.drain(2, |_| {});
            std::process::abort();
        }
        "flip-wakeup" => {
            let end = Instant::now() + Duration::from_secs(3);
            let mut x = 0x9e37_79b9u32;
            while Instant::now() < end {
                let _ = c.drain(64, |_| {});
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                // SAFETY: as above.
                unsafe { flag.write_volatile(x) };
            }
        }
        "jam-doorbell" => {
            // What jammed a shared eventfd: fill it and make it blocking. The doorbell is a
            // pipe's read end now, so the write is refused and the flag is this end's alone.
            let max: u64 = 0xffff_ffff_ffff_fffe;
            let refused = nix::unistd::write(&bell_fd, &max.to_ne_bytes()).is_err();
            eprintln!("fault-worker: writing the doorbell refused: {refused}");
            let flags = OFlag::from_bits_truncate(fcntl(&bell_fd, FcntlArg::F_GETFL).unwrap());
            fcntl(&bell_fd, FcntlArg::F_SETFL(flags - OFlag::O_NONBLOCK))
                .expect("clear O_NONBLOCK");
            // SAFETY: as above.
            unsafe { flag.write_volatile(0x5eed) };
        }
        "control-flood" => {
            for _ in 0..2 {
                let sock = control.try_clone().expect("control descriptor");
                std::thread::spawn(move || loop {
                    let flags = MsgFlags::MSG_NOSIGNAL;
                    if nix::sys::socket::send(sock.as_raw_fd(), b"x", flags).is_err() {
                        std::thread::yield_now();
                    }
                });
            }
        }
        "fork-and-jam" => {
            // SAFETY: the child runs single-threaded code of its own (this process has no other
            // threads yet) and never returns into the parent's state.
            match unsafe { nix::unistd::fork() }.expect("fork") {
                nix::unistd::ForkResult::Child => {
                    let _ = nix::unistd::setsid();
                    // What a survivor does: keep its ring and doorbell, clear O_NONBLOCK on
                    // the doorbell, try to write it, drain whatever arrives. Bounded: the demux
                    // kills it long before.
                    let end = Instant::now() + Duration::from_secs(60);
                    while Instant::now() < end {
                        let flags = fcntl(&bell_fd, FcntlArg::F_GETFL).unwrap_or(0);
                        let flags = OFlag::from_bits_truncate(flags) - OFlag::O_NONBLOCK;
                        let _ = fcntl(&bell_fd, FcntlArg::F_SETFL(flags));
                        let _ = nix::unistd::write(&bell_fd, &[1u8; 8]);
                        let _ = c.drain(64, |_| {});
                        std::thread::sleep(Duration::from_millis(5));
                    }
                    std::process::exit(0);
                }
                nix::unistd::ForkResult::Parent { child } => {
                    write_report(
                        &marker,
                        &[
                            ("orphan-pid", child.to_string()),
                            ("ring-inode", ring_inode.to_string()),
                        ],
                    );
                    // The worker dies; its child lives on, detached, holding everything.
                    std::process::exit(1);
                }
            }
        }
        "take-foreign-session" => {
            // Stores two sessions (any worker may store under keys of its choosing), waits for
            // a datagram in its ring (the test sends a ClientHello offering the first ticket to
            // instance 0, then one offering the second to this instance), then takes both.
            let sessions = fds.next().expect("session socket");
            for key in [FOREIGN_TICKET, OWN_TICKET] {
                session_request(&sessions, Op::Put, &key, b"a session value");
            }
            drain_for(&mut c, Duration::from_secs(30), 1);
            let outcome = |found: Option<bool>| match found {
                Some(true) => "found".to_string(),
                Some(false) => "not-found".to_string(),
                None => "no-reply".to_string(),
            };
            let foreign = session_request(&sessions, Op::Take, &FOREIGN_TICKET, b"");
            let own = session_request(&sessions, Op::Take, &OWN_TICKET, b"");
            write_report(
                &marker,
                &[
                    ("take-foreign", outcome(foreign)),
                    ("take-own", outcome(own)),
                ],
            );
        }
        "stats-flood" => {
            let outcomes = floods::stats(&control, &marker);
            write_report(&marker, &outcomes);
        }
        "session-flood" => {
            let sessions = fds.next().expect("session socket");
            let outcomes = floods::sessions(&sessions, &marker);
            write_report(&marker, &outcomes);
            // Kept open: closing it would end the demux's session thread for this worker.
            std::mem::forget(sessions);
        }
        "linger" => {
            let mut buf = [0u8; 64];
            // Wait for SHUTDOWN (anything the demux sends), then vanish from its view.
            let _ = nix::sys::socket::recv(control.as_raw_fd(), &mut buf, MsgFlags::empty());
            // SAFETY: SIG_IGN installs no handler.
            let _ = unsafe {
                nix::sys::signal::signal(
                    nix::sys::signal::Signal::SIGTERM,
                    nix::sys::signal::SigHandler::SigIgn,
                )
            };
            drop(control);
            // Bounded: long past any grace period a test uses.
            std::thread::sleep(Duration::from_secs(120));
            return;
        }
        "spy" => {
            // A serving worker's view of processes starting beside it: every new child of the
            // demux (a sibling of a new generation, a replacement) and the demux itself (a new
            // image of it during `ringmux upgrade`) is probed from its first moments, until the
            // test creates MARKER.done (bounded: 60 s).
            let outcomes = spy(&mut c, &marker, Duration::from_secs(60));
            write_report(&marker, &outcomes);
        }
        other => panic!("unknown RINGMUX_FAULT {other:?}"),
    }
    // Stay alive (keeping the control socket open) until the demux kills us or goes away.
    let mut buf = [0u8; 256];
    while nix::sys::socket::recv(control.as_raw_fd(), &mut buf, MsgFlags::empty())
        .is_ok_and(|n| n > 0)
    {}
}

/// Probes the memory of every process that starts as a child of the demux after this one
/// began watching, and the demux's own, as fast as it can (draining its ring meanwhile), until `MARKER.done` exists or
/// `limit` passes. Opening `/proc/PID/mem` is what matters: a descriptor opened while the
/// target was open to it keeps reading after the target turned non-dumpable.
fn spy(c: &mut Consumer, marker: &str, limit: Duration) -> Vec<(&'static str, String)> {
    let demux = nix::unistd::getppid().as_raw();
    let me = std::process::id() as i32;
    let children = || -> Vec<i32> {
        let mut found = Vec::new();
        if let Ok(tasks) = std::fs::read_dir(format!("/proc/{demux}/task")) {
            for t in tasks.flatten() {
                if let Ok(text) = std::fs::read_to_string(t.path().join("children")) {
                    found.extend(
                        text.split_whitespace()
                            .filter_map(|p| p.parse::<i32>().ok()),
                    );
                }
            }
        }
        found
    };
    let known: Vec<i32> = children();
    let done = format!("{marker}.done");
    let end = Instant::now() + limit;
    // The demux's own memory, from a thread that does nothing else: a new image of it is open
    // to its user only between its `execve` and its first instructions.
    let demux_spy = {
        let done = done.clone();
        std::thread::spawn(move || {
            let mut outcome: Option<String> = None;
            let mut probes = 0u64;
            while Instant::now() < end && !std::path::Path::new(&done).exists() {
                for _ in 0..1000 {
                    let o = match std::fs::File::open(format!("/proc/{demux}/mem")) {
                        Ok(_) => "ok".to_string(),
                        Err(e) => format!(
                            "{:?}",
                            nix::errno::Errno::from_raw(e.raw_os_error().unwrap_or(0))
                        ),
                    };
                    if outcome.as_deref() != Some("ok") {
                        outcome = Some(o);
                    }
                    probes += 1;
                }
            }
            (outcome, probes)
        })
    };
    let _ = std::fs::write(format!("{marker}.watching"), b"1");
    let (mut siblings, mut sibling_open) = (Vec::new(), None);
    // A new sibling's files under /proc that its user may write while it is dumpable (right
    // after its `execve`); a descriptor opened then writes on after.
    let (mut sibling_oom, mut sibling_autogroup) = (None, None);
    let write = |path: String| std::fs::OpenOptions::new().write(true).open(path);
    let mut probes = 0u64;
    // Records the outcome of one open: "ok" sticks (the attack got through once).
    let note = |slot: &mut Option<String>, r: std::io::Result<std::fs::File>| {
        let o = match r {
            Ok(_) => "ok".to_string(),
            Err(e) => format!(
                "{:?}",
                nix::errno::Errno::from_raw(e.raw_os_error().unwrap_or(0))
            ),
        };
        if slot.as_deref() != Some("ok") {
            *slot = Some(o);
        }
    };
    while Instant::now() < end && !std::path::Path::new(&done).exists() {
        for pid in children() {
            if pid == me || known.contains(&pid) {
                continue;
            }
            if !siblings.contains(&pid) {
                siblings.push(pid);
            }
            note(
                &mut sibling_open,
                std::fs::File::open(format!("/proc/{pid}/mem")),
            );
            note(
                &mut sibling_oom,
                write(format!("/proc/{pid}/oom_score_adj")),
            );
            note(
                &mut sibling_autogroup,
                write(format!("/proc/{pid}/autogroup")),
            );
        }
        probes += 1;
        // Whatever reaches this instance meanwhile is taken, so the demux sees no stall.
        let _ = c.drain(64, |_| {});
    }
    let (demux_open, demux_probes) = demux_spy.join().unwrap_or((None, 0));
    // Its own autogroup (shared by every process of its session) and the demux's OOM score;
    // then a move into the demux's process group, or a session of its own.
    let (mut own_autogroup, mut demux_oom) = (None, None);
    note(&mut own_autogroup, write("/proc/self/autogroup".into()));
    note(
        &mut demux_oom,
        write(format!("/proc/{demux}/oom_score_adj")),
    );
    let demux_group = nix::unistd::getpgid(Some(nix::unistd::Pid::from_raw(demux)));
    let join_group = match demux_group {
        Ok(g) => match nix::unistd::setpgid(nix::unistd::Pid::from_raw(0), g) {
            Ok(()) => "ok".to_string(),
            Err(e) => format!("{e:?}"),
        },
        Err(e) => format!("getpgid: {e:?}"),
    };
    let new_session = match nix::unistd::setsid() {
        Ok(_) => "ok".to_string(),
        Err(e) => format!("{e:?}"),
    };
    vec![
        (
            "write-new-sibling-oom-score",
            sibling_oom.unwrap_or_else(|| "none".into()),
        ),
        (
            "write-new-sibling-autogroup",
            sibling_autogroup.unwrap_or_else(|| "none".into()),
        ),
        (
            "write-own-autogroup",
            own_autogroup.unwrap_or_else(|| "none".into()),
        ),
        (
            "write-demux-oom-score",
            demux_oom.unwrap_or_else(|| "none".into()),
        ),
        ("join-demux-group", join_group),
        ("new-session", new_session),
        ("new-siblings", siblings.len().to_string()),
        ("probes", probes.to_string()),
        ("demux-probes", demux_probes.to_string()),
        (
            "open-new-sibling-mem",
            sibling_open.unwrap_or_else(|| "none".into()),
        ),
        (
            "open-demux-mem",
            demux_open.unwrap_or_else(|| "none".into()),
        ),
    ]
}

/// The ticket IDs `take-foreign-session` stores: the test offers the first in a ClientHello
/// routed to instance 0, the second in one routed to the fault worker's instance.
const FOREIGN_TICKET: [u8; 32] = [0xa0; 32];
const OWN_TICKET: [u8; 32] = [0xb1; 32];

/// One request on the session socket; whether the reply said found (or stored), `None` if
/// none came within a second.
fn session_request(sock: &OwnedFd, op: Op, key: &[u8], value: &[u8]) -> Option<bool> {
    let msg = encode_request(op, 7, key, value);
    nix::sys::socket::send(sock.as_raw_fd(), &msg, MsgFlags::empty()).ok()?;
    let mut fds = [nix::poll::PollFd::new(
        sock.as_fd(),
        nix::poll::PollFlags::POLLIN,
    )];
    if nix::poll::poll(&mut fds, 1000u16).ok()? == 0 {
        return None;
    }
    let mut buf = vec![0u8; MAX_REPLY_LEN];
    let n = nix::sys::socket::recv(sock.as_raw_fd(), &mut buf, MsgFlags::empty()).ok()?;
    let (_, value) = decode_reply(&buf[..n])?;
    Some(value.is_some())
}

/// Writes `name=value` lines to `MARKER.report`, whole or not at all (a rename).
fn write_report(marker: &str, lines: &[(&str, String)]) {
    let text: String = lines.iter().map(|(k, v)| format!("{k}={v}\n")).collect();
    let tmp = format!("{marker}.report.tmp");
    std::fs::write(&tmp, text).expect("writing the report");
    std::fs::rename(&tmp, format!("{marker}.report")).expect("publishing the report");
}

/// Drains until at least `n` datagrams were seen or `limit` passes.
fn drain_for(c: &mut Consumer, limit: Duration, n: usize) {
    let end = Instant::now() + limit;
    let mut seen = 0;
    while seen < n && Instant::now() < end {
        seen += c.drain(1, |_| {}).map(|d| d.slots).unwrap_or(0);
        if seen < n {
            let _ = c.wait(Some(Duration::from_millis(50)));
        }
    }
}

/// Reads the hand-off without consuming it (MSG_PEEK), to decide whether to misbehave. (Its
/// descriptors are not in the message: the demux placed them before this program started.)
fn peek_handoff(sock: BorrowedFd<'_>) -> Option<Handoff> {
    let mut buf = vec![0u8; MAX_MESSAGE];
    let n = nix::sys::socket::recv(sock.as_raw_fd(), &mut buf, MsgFlags::MSG_PEEK).ok()?;
    Handoff::decode(buf.get(..n)?).ok()
}
