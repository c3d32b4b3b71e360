//! The attacks a confined worker must fail at: on the demux (`signal-parent`), on a sibling
//! (`signal-sibling`), by starting processes (`fork`), and on the public socket
//! (`recv-public`), on the operator's control socket (`reload`), and on the files a worker
//! must not reach (`files`). Each attempt is made for real and its outcome recorded: `ok` if the kernel
//! let it through, else the errno's name (`EPERM` is the filter's answer). Attempts that would
//! do lasting harm if they got through are undone where they can be (a stopped demux is
//! continued, a forked child exits at once), and the ones that cannot be undone (a ptrace
//! seize, a shut-down socket) are made only once the filter has shown itself (an earlier
//! attempt refused).

// An attacker makes the raw calls on purpose: several have no safe wrapper (tkill, clone3,
// io_uring_setup, io_setup), and each must reach the kernel exactly as a hostile program
// would write it.
#![allow(clippy::disallowed_methods)]

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use nix::errno::Errno;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

/// What one attack found, in order: `(attempt, outcome)`.
pub type Outcomes = Vec<(&'static str, String)>;

/// The public socket and the control socket, at their fixed descriptors.
const PUBLIC: i32 = ringmux_proto::PUBLIC_FD;
const CONTROL: i32 = ringmux_proto::CONTROL_FD;

/// Plays attack `name`; `None` if it is not one of these.
pub fn play(name: &str) -> Option<Outcomes> {
    let mut out = Outcomes::new();
    match name {
        "signal-parent" => signal_parent(&mut out),
        "signal-sibling" => signal_sibling(&mut out),
        "fork" => fork(&mut out),
        "recv-public" => recv_public(&mut out),
        "reload" => reload(&mut out),
        "steal-steering" => steal_steering(&mut out),
        "free-named" => free_named(&mut out),
        "own-socket" => own_socket(&mut out),
        "prctl" => prctl(&mut out),
        "capabilities" => capabilities(&mut out),
        "tcp-listener" => tcp_listener(&mut out),
        "log-rewrite" => log_rewrite(&mut out),
        "stderr-flood" => stderr_flood(&mut out),
        "files" => files(&mut out),
        "log-forge" => log_forge(&mut out),
        "rate-tables" => rate_tables(&mut out),
        _ => return None,
    }
    Some(out)
}

fn outcome(r: nix::Result<impl Sized>) -> String {
    match r {
        Ok(_) => "ok".into(),
        Err(e) => format!("{e:?}"),
    }
}

/// The outcome of a std call.
fn io_outcome<T>(r: io::Result<T>) -> String {
    match r {
        Ok(_) => "ok".into(),
        Err(e) => format!("{:?}", Errno::from_raw(e.raw_os_error().unwrap_or(0))),
    }
}

/// The outcome of a raw system call's return value.
fn raw(r: libc::c_long) -> String {
    if r >= 0 {
        "ok".into()
    } else {
        format!("{:?}", Errno::last())
    }
}

fn refused(out: &Outcomes, attempt: &str) -> bool {
    out.iter().any(|(a, o)| *a == attempt && o == "EPERM")
}

/// Asks the demux for a reload through its control socket (path in
/// `RINGMUX_FAULT_CONTROL_SOCKET`): records `reload-connect` and the answer line as
/// `reload-answer`.
fn reload(out: &mut Outcomes) {
    use std::io::{BufRead, Write};
    let Some(path) = std::env::var_os("RINGMUX_FAULT_CONTROL_SOCKET") else {
        out.push(("reload-connect", "no RINGMUX_FAULT_CONTROL_SOCKET".into()));
        return;
    };
    for (connect, answer, request) in [
        ("reload-connect", "reload-answer", &b"reload\n"[..]),
        ("upgrade-connect", "upgrade-answer", &b"upgrade\n"[..]),
    ] {
        let stream = match std::os::unix::net::UnixStream::connect(&path) {
            Ok(s) => s,
            Err(e) => {
                out.push((connect, io_outcome::<()>(Err(e))));
                continue;
            }
        };
        out.push((connect, "ok".into()));
        let _ = stream.set_read_timeout(Some(std::time::Duration::from_secs(10)));
        let _ = (&stream).write_all(request);
        let mut line = String::new();
        let _ = io::BufReader::new(&stream).read_line(&mut line);
        out.push((answer, line.trim().to_string()));
    }
}

fn signal_parent(out: &mut Outcomes) {
    let parent = nix::unistd::getppid();
    let stop = kill(parent, Signal::SIGSTOP);
    if stop.is_ok() {
        // Unconfined: undo it at once.
        let _ = kill(parent, Signal::SIGCONT);
    }
    out.push(("kill-parent-stop", outcome(stop)));
    // Signal 0 checks permission only, so these harm nothing if they get through.
    out.push(("kill-process-group", outcome(kill(Pid::from_raw(0), None))));
    out.push(("kill-every-process", outcome(kill(Pid::from_raw(-1), None))));
    // SAFETY: tkill passes no memory; signal 0 only checks.
    let r = unsafe { libc::syscall(libc::SYS_tkill, parent.as_raw(), 0) };
    out.push(("tkill-parent", raw(r)));
    let mut set = nix::sched::CpuSet::new();
    let _ = set.set(0);
    let pin = nix::sched::sched_getaffinity(parent)
        .and_then(|same| nix::sched::sched_setaffinity(parent, &same));
    out.push(("pin-parent", outcome(pin)));
    let who = parent.as_raw() as libc::id_t;
    // SAFETY: getpriority passes no memory.
    let prio = unsafe { libc::getpriority(libc::PRIO_PROCESS, who) };
    // SAFETY: setpriority passes no memory; the same priority changes nothing.
    let r = unsafe { libc::setpriority(libc::PRIO_PROCESS, who, prio) };
    out.push(("renice-parent", raw(r.into())));
    let mut buf = [0u8; 8];
    let local = [io::IoSliceMut::new(&mut buf)];
    let remote = [nix::sys::uio::RemoteIoVec {
        base: 0x1000,
        len: 8,
    }];
    let mut local = local;
    out.push((
        "read-parent-memory",
        outcome(nix::sys::uio::process_vm_readv(parent, &mut local, &remote)),
    ));
    let mem = std::fs::File::open(format!("/proc/{parent}/mem"));
    out.push(("open-parent-mem", io_outcome(mem)));
    // Opened for writing, not written: a worker that could would make the demux the OOM
    // killer's first choice, or lower its scheduling weight.
    for (attempt, file) in [
        ("open-parent-oom-score-adj", "oom_score_adj"),
        ("open-parent-autogroup", "autogroup"),
    ] {
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(format!("/proc/{parent}/{file}"));
        out.push((attempt, io_outcome(f)));
    }
    // A seized tracee is only released by its tracer's exit: tried once the filter has shown
    // itself.
    if refused(out, "kill-parent-stop") {
        let seize = nix::sys::ptrace::seize(parent, nix::sys::ptrace::Options::empty());
        out.push(("ptrace-parent", outcome(seize)));
    }
}

/// The other workers: processes with the same parent.
fn siblings() -> Vec<Pid> {
    let me = std::process::id();
    let parent = nix::unistd::getppid().as_raw() as u32;
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&pid| pid != me)
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|s| {
                    let rest = &s[s.rfind(')')? + 1..];
                    rest.split_ascii_whitespace().nth(1)?.parse::<u32>().ok()
                })
                == Some(parent)
        })
        .map(|pid| Pid::from_raw(pid as i32))
        .collect()
}

/// Whether `pid` has made itself non-dumpable: the kernel then gives the files in its
/// `/proc/PID` to root, whoever the process runs as.
fn non_dumpable(pid: Pid) -> bool {
    use std::os::unix::fs::MetadataExt;
    let owner = std::fs::metadata(format!("/proc/{pid}/mem")).map(|m| m.uid());
    let real = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            let line = s.lines().find_map(|l| l.strip_prefix("Uid:"))?;
            line.split_whitespace().next()?.parse::<u32>().ok()
        });
    matches!((owner, real), (Ok(0), Some(uid)) if uid != 0)
}

fn signal_sibling(out: &mut Outcomes) {
    // The sibling starts beside this process: give it up to 5 s to have attached (and so to
    // have protected itself), then attack whatever it is by then.
    // (As root the kernel lets us open its memory anyway: nothing to wait for.)
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    let root = nix::unistd::geteuid().is_root();
    while !root && std::time::Instant::now() < deadline && !siblings().into_iter().any(non_dumpable)
    {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let found = siblings();
    out.push(("siblings-found", found.len().to_string()));
    for sib in found {
        let mem = std::fs::File::open(format!("/proc/{sib}/mem"));
        out.push(("open-sibling-mem", io_outcome(mem)));
        out.push(("kill-sibling", outcome(kill(sib, Signal::SIGKILL))));
        // SAFETY: pidfd_open passes no memory.
        let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, sib.as_raw(), 0) };
        if pidfd >= 0 {
            // SAFETY: pidfd_send_signal with a null siginfo; the pidfd is ours, closed below.
            let r = unsafe {
                libc::syscall(
                    libc::SYS_pidfd_send_signal,
                    pidfd,
                    libc::SIGKILL,
                    std::ptr::null::<libc::siginfo_t>(),
                    0,
                )
            };
            out.push(("pidfd-signal-sibling", raw(r)));
            // SAFETY: pidfd_open returned this descriptor to us.
            drop(unsafe { OwnedFd::from_raw_fd(pidfd as i32) });
        } else {
            out.push(("pidfd-signal-sibling", raw(pidfd)));
        }
    }
}

fn fork(out: &mut Outcomes) {
    // SAFETY: the child calls only _exit, which is async-signal-safe.
    match unsafe { nix::unistd::fork() } {
        Ok(nix::unistd::ForkResult::Child) => {
            // SAFETY: _exit ends the child at once, running nothing of the parent's.
            unsafe { libc::_exit(0) }
        }
        Ok(nix::unistd::ForkResult::Parent { child }) => {
            let _ = nix::sys::wait::waitpid(child, None);
            out.push(("fork", "ok".into()));
        }
        Err(e) => out.push(("fork", format!("{e:?}"))),
    }
    let spawn = std::process::Command::new("/bin/true").status();
    out.push(("spawn", io_outcome(spawn)));
    // SAFETY: clone3 with no arguments struct: either refused, or EINVAL for its size.
    let r = unsafe { libc::syscall(libc::SYS_clone3, std::ptr::null::<u8>(), 0usize) };
    out.push(("clone3", raw(r)));
    let thread = std::thread::Builder::new().spawn(|| 7).map(|t| t.join());
    out.push((
        "thread",
        match thread {
            Ok(Ok(7)) => "ok".into(),
            Ok(_) => "panicked".into(),
            Err(e) => format!("{:?}", Errno::from_raw(e.raw_os_error().unwrap_or(0))),
        },
    ));
}

/// Under kernel steering (`--forward reuseport`) descriptor 4 is the worker's own socket in
/// the group: it may receive on it, but not take other instances' datagrams by replacing the
/// group's steering program, joining the group with another socket, connecting its socket to
/// a client's address, or swapping the descriptor for one the rules do not cover.
fn steal_steering(out: &mut Outcomes) {
    let mut buf = [0u8; 2048];
    // SAFETY: a buffer of ours and its length.
    let r = unsafe {
        libc::recv(
            PUBLIC,
            buf.as_mut_ptr().cast(),
            buf.len(),
            libc::MSG_DONTWAIT,
        )
    };
    out.push(("receive-own-socket", raw(r as libc::c_long)));
    // A program that sends everything to the group's second socket.
    let mut steal = [libc::sock_filter {
        code: (libc::BPF_RET | libc::BPF_K) as u16,
        jt: 0,
        jf: 0,
        k: 1,
    }];
    let prog = libc::sock_fprog {
        len: 1,
        filter: steal.as_mut_ptr(),
    };
    let setsockopt = |fd: i32, name: i32, value: *const libc::c_void, len: usize| {
        // SAFETY: `value` points at `len` bytes that live across the call.
        raw(
            unsafe { libc::setsockopt(fd, libc::SOL_SOCKET, name, value, len as libc::socklen_t) }
                as libc::c_long,
        )
    };
    out.push((
        "attach-program",
        setsockopt(
            PUBLIC,
            libc::SO_ATTACH_REUSEPORT_CBPF,
            (&prog as *const libc::sock_fprog).cast(),
            std::mem::size_of::<libc::sock_fprog>(),
        ),
    ));
    const SO_DETACH_REUSEPORT_BPF: i32 = 68;
    let zero: libc::c_int = 0;
    out.push((
        "detach-program",
        setsockopt(
            PUBLIC,
            SO_DETACH_REUSEPORT_BPF,
            (&zero as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>(),
        ),
    ));
    let one: libc::c_int = 1;
    let other = std::net::UdpSocket::bind("127.0.0.1:0").map(OwnedFd::from);
    let join = match &other {
        Ok(s) => setsockopt(
            s.as_raw_fd(),
            libc::SO_REUSEPORT,
            (&one as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>(),
        ),
        Err(e) => format!("no socket: {e}"),
    };
    out.push(("join-group", join));
    let victim = nix::sys::socket::SockaddrIn::new(127, 0, 0, 1, 9);
    out.push((
        "connect-own-socket",
        outcome(nix::sys::socket::connect(PUBLIC, &victim)),
    ));
    if refused(out, "connect-own-socket") {
        if let Ok(s) = &other {
            // SAFETY: both descriptors are open; refused, this changes nothing.
            let r = unsafe { libc::dup2(s.as_raw_fd(), PUBLIC) };
            out.push(("replace-own-socket", raw(r as libc::c_long)));
        }
        // SAFETY: closing a descriptor number; refused, nothing is closed.
        let r = unsafe { libc::close(PUBLIC) };
        out.push(("close-own-socket", raw(r as libc::c_long)));
    }
}

fn recv_public(out: &mut Outcomes) {
    let mut buf = [0u8; 2048];
    // Non-blocking first: if the filter were missing, this would take one datagram at most.
    // SAFETY: a buffer of ours and its length.
    let r = unsafe {
        libc::recv(
            PUBLIC,
            buf.as_mut_ptr().cast(),
            buf.len(),
            libc::MSG_DONTWAIT,
        )
    };
    out.push(("recv-public", raw(r as libc::c_long)));
    if !refused(out, "recv-public") {
        // Unconfined: the blocking calls below could wait for ever, and the rest would harm
        // the demux's socket. The outcome above is what a test looks at.
        return;
    }
    // SAFETY: as above, for each call: our buffer and its length, or no memory at all.
    let r = unsafe { libc::read(PUBLIC, buf.as_mut_ptr().cast(), buf.len()) };
    out.push(("read-public", raw(r as libc::c_long)));
    let mut iov = [io::IoSliceMut::new(&mut buf)];
    let r = nix::sys::socket::recvmsg::<()>(
        PUBLIC,
        &mut iov,
        None,
        nix::sys::socket::MsgFlags::MSG_DONTWAIT,
    );
    out.push(("recvmsg-public", outcome(r.map(|m| m.bytes))));
    // SAFETY: recvmmsg with no message vector: refused, or 0 messages.
    let r = unsafe {
        libc::syscall(
            libc::SYS_recvmmsg,
            PUBLIC,
            std::ptr::null::<libc::mmsghdr>(),
            0,
            libc::MSG_DONTWAIT,
            std::ptr::null::<libc::timespec>(),
        )
    };
    out.push(("recvmmsg-public", raw(r)));
    // SAFETY: dup family: no memory.
    let r = unsafe { libc::dup(PUBLIC) };
    out.push(("dup-public", raw(r.into())));
    // SAFETY: as above.
    let r = unsafe { libc::dup2(PUBLIC, 100) };
    out.push(("dup2-public", raw(r.into())));
    // SAFETY: as above.
    let r = unsafe { libc::fcntl(PUBLIC, libc::F_DUPFD_CLOEXEC, 10) };
    out.push(("fcntl-dupfd-public", raw(r.into())));
    out.push(("pass-public-to-itself", pass_to_itself()));
    // SAFETY: io_uring_setup with a zeroed parameter block of ours.
    let r = unsafe {
        let mut params = [0u8; 120];
        libc::syscall(libc::SYS_io_uring_setup, 8, params.as_mut_ptr())
    };
    out.push(("io-uring", raw(r)));
    // SAFETY: io_setup with a context word of ours.
    let r = unsafe {
        let mut ctx: libc::c_ulong = 0;
        libc::syscall(libc::SYS_io_setup, 8, &mut ctx as *mut libc::c_ulong)
    };
    out.push(("linux-aio", raw(r)));
    // SAFETY: socket creation passes no memory; a created socket is closed at once.
    let r = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW, 0) };
    out.push(("packet-socket", raw(r.into())));
    close_if_made(r);
    // SAFETY: as above.
    let r = unsafe { libc::socket(libc::AF_INET, libc::SOCK_RAW, libc::IPPROTO_UDP) };
    out.push(("raw-socket", raw(r.into())));
    close_if_made(r);
    // Harmful if they got through; the filter has shown itself above.
    let opt: libc::c_int = 4096;
    // SAFETY: an int option of ours and its size.
    let r = unsafe {
        libc::setsockopt(
            PUBLIC,
            libc::SOL_SOCKET,
            libc::SO_RCVBUF,
            (&opt as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    out.push(("setsockopt-public", raw(r.into())));
    // SAFETY: fcntl F_SETFL passes no memory.
    let r = unsafe { libc::fcntl(PUBLIC, libc::F_SETFL, 0) };
    out.push(("clear-nonblock-public", raw(r.into())));
    // SAFETY: shutdown passes no memory.
    let r = unsafe { libc::shutdown(PUBLIC, libc::SHUT_RD) };
    out.push(("shutdown-public", raw(r.into())));
    let to = nix::sys::socket::SockaddrIn::new(127, 0, 0, 1, 9);
    out.push((
        "connect-public",
        outcome(nix::sys::socket::connect(PUBLIC, &to)),
    ));
    // SAFETY: close passes no memory.
    let r = unsafe { libc::close(CONTROL) };
    out.push(("close-control", raw(r.into())));
}

fn close_if_made(fd: libc::c_int) {
    if fd >= 0 {
        // SAFETY: the socket call above just returned this descriptor to us.
        drop(unsafe { OwnedFd::from_raw_fd(fd) });
    }
}

/// Sends descriptor 4 to itself over a socket pair: sending works, receiving a descriptor is
/// what the filter refuses. Returns the outcome of the receive.
fn pass_to_itself() -> String {
    use nix::sys::socket::{
        recvmsg, sendmsg, socketpair, AddressFamily, ControlMessage, MsgFlags, SockFlag, SockType,
    };
    let Ok((a, b)) = socketpair(
        AddressFamily::Unix,
        SockType::Datagram,
        None,
        SockFlag::SOCK_CLOEXEC,
    ) else {
        return format!("socketpair {:?}", Errno::last());
    };
    let fds = [PUBLIC];
    let iov = [io::IoSlice::new(b"x")];
    if let Err(e) = sendmsg::<()>(
        a.as_raw_fd(),
        &iov,
        &[ControlMessage::ScmRights(&fds)],
        MsgFlags::empty(),
        None,
    ) {
        return format!("sendmsg {e:?}");
    }
    let mut buf = [0u8; 8];
    let mut iov = [io::IoSliceMut::new(&mut buf)];
    let mut cmsg = nix::cmsg_space!([i32; 1]);
    match recvmsg::<()>(
        b.as_raw_fd(),
        &mut iov,
        Some(&mut cmsg),
        MsgFlags::MSG_DONTWAIT | MsgFlags::MSG_CMSG_CLOEXEC,
    ) {
        Ok(msg) => {
            for c in msg.cmsgs().into_iter().flatten() {
                if let nix::sys::socket::ControlMessageOwned::ScmRights(got) = c {
                    for fd in got {
                        // SAFETY: the kernel installed this descriptor for us.
                        drop(unsafe { OwnedFd::from_raw_fd(fd) });
                    }
                }
            }
            "ok".into()
        }
        Err(e) => format!("{e:?}"),
    }
}

/// `ioctl` requests the attacks use (include/uapi/asm-generic/ioctls.h, linux/sockios.h).
const FIOCLEX: libc::c_ulong = 0x5451;
const FIONCLEX: libc::c_ulong = 0x5450;
const FIONBIO: libc::c_ulong = 0x5421;
const FIOASYNC: libc::c_ulong = 0x5452;
const SIOCSIFFLAGS: libc::c_ulong = 0x8914;

/// Set, in the image `free-named` executes, to the number of its copy of the control socket.
pub const RENUMBERED_ENV: &str = "RINGMUX_FAULT_RENUMBERED";

/// Tries every way to free, renumber or replace descriptors 3 and 4, the numbers the filter's
/// rules name: once free across an `execve`, a socket of the worker's own takes the number and
/// the rules bind it instead. If any way works, the attack goes on in a new image of this
/// program ([`renumbered`]). Also checks the `ioctl` allow-list on the worker's own
/// descriptors.
fn free_named(out: &mut Outcomes) {
    // SAFETY: fcntl F_DUPFD takes no memory; a copy of the control socket is harmless itself.
    let copy = unsafe { libc::fcntl(CONTROL, libc::F_DUPFD, 10) };
    out.push(("copy-control", raw(copy.into())));
    out.push(("copy-control-fd", copy.to_string()));
    const CLOSE_RANGE_CLOEXEC: libc::c_uint = 1 << 2;
    for (fd, names) in [
        (
            CONTROL,
            [
                "fioclex-control",
                "fionclex-control",
                "setfd-cloexec-control",
                "close-range-cloexec-control",
                "dup3-cloexec-onto-control",
            ],
        ),
        (
            PUBLIC,
            [
                "fioclex-public",
                "fionclex-public",
                "setfd-cloexec-public",
                "close-range-cloexec-public",
                "dup3-cloexec-onto-public",
            ],
        ),
    ] {
        // SAFETY: each call takes descriptors and flags only.
        let r = unsafe { libc::ioctl(fd, FIOCLEX) };
        out.push((names[0], raw(r.into())));
        // SAFETY: as above.
        let r = unsafe { libc::ioctl(fd, FIONCLEX) };
        out.push((names[1], raw(r.into())));
        // SAFETY: as above.
        let r = unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) };
        out.push((names[2], raw(r.into())));
        // SAFETY: as above.
        let r = unsafe {
            libc::syscall(
                libc::SYS_close_range,
                fd as libc::c_uint,
                fd as libc::c_uint,
                CLOSE_RANGE_CLOEXEC,
            )
        };
        out.push((names[3], raw(r)));
        // SAFETY: as above.
        let r = unsafe { libc::dup3(copy.max(0), fd, libc::O_CLOEXEC) };
        out.push((names[4], raw(r.into())));
    }
    // The allow-list on descriptors of the worker's own: non-blocking mode and close-on-exec
    // pass; asynchronous I/O (signals) and interface changes do not.
    let (a, b) = match nix::unistd::pipe() {
        Ok(p) => p,
        Err(e) => {
            out.push(("pipe", format!("{e:?}")));
            return;
        }
    };
    let on: libc::c_int = 1;
    // SAFETY: FIONBIO and FIOASYNC read an int of ours; FIOCLEX takes nothing.
    let r = unsafe { libc::ioctl(a.as_raw_fd(), FIONBIO, &on) };
    out.push(("fionbio-own", raw(r.into())));
    // SAFETY: as above.
    let r = unsafe { libc::ioctl(b.as_raw_fd(), FIOCLEX) };
    out.push(("fioclex-own", raw(r.into())));
    // SAFETY: as above.
    let r = unsafe { libc::ioctl(a.as_raw_fd(), FIOASYNC, &on) };
    out.push(("fioasync-own", raw(r.into())));
    let req = [0u8; 40];
    // SAFETY: a zeroed `struct ifreq` of ours (an empty interface name: refused either way).
    let r = unsafe { libc::ioctl(PUBLIC, SIOCSIFFLAGS, req.as_ptr()) };
    out.push(("siocsifflags", raw(r.into())));
}

/// Whether `free-named` freed descriptor 3 or 4 by any way: the attack then goes on in a new
/// image of this program (whose caller marks 3 close-on-exec for certain and executes it).
pub fn freed_a_named_descriptor(out: &Outcomes) -> bool {
    out.iter().any(|(a, o)| {
        (a.ends_with("-control") || a.ends_with("-public")) && !a.starts_with("copy-") && o == "ok"
    })
}

/// The second image of `free-named`: number 3 is free. A socket pair takes it, descriptor 4
/// goes in one end and comes out of "3", the number the filter lets receive descriptors, as a
/// new number no rule names. With that copy: a locked drop-all filter and a `connect`, which
/// on the demux's own socket would blind the whole box. Returns the outcomes; the caller
/// hands the control socket back as `control` and executes the real worker.
pub fn renumbered(out: &mut Outcomes) {
    use nix::sys::socket::{
        recvmsg, sendmsg, socketpair, AddressFamily, ControlMessage, ControlMessageOwned, MsgFlags,
        SockFlag, SockType,
    };
    let Ok((a, b)) = socketpair(
        AddressFamily::Unix,
        SockType::Datagram,
        None,
        SockFlag::SOCK_CLOEXEC,
    ) else {
        out.push(("stage2-socketpair", format!("{:?}", Errno::last())));
        return;
    };
    out.push((
        "stage2-pair-at",
        a.as_raw_fd().min(b.as_raw_fd()).to_string(),
    ));
    let (three, other) = if a.as_raw_fd() == CONTROL {
        (a, b)
    } else {
        (b, a)
    };
    let fds = [PUBLIC];
    let iov = [io::IoSlice::new(b"x")];
    let sent = sendmsg::<()>(
        other.as_raw_fd(),
        &iov,
        &[ControlMessage::ScmRights(&fds)],
        MsgFlags::empty(),
        None,
    );
    out.push(("stage2-send-public", outcome(sent)));
    let mut buf = [0u8; 8];
    let mut iov = [io::IoSliceMut::new(&mut buf)];
    let mut cmsg = nix::cmsg_space!([i32; 1]);
    let got = recvmsg::<()>(
        three.as_raw_fd(),
        &mut iov,
        Some(&mut cmsg),
        MsgFlags::MSG_DONTWAIT,
    )
    .map(|m| {
        m.cmsgs().into_iter().flatten().find_map(|c| match c {
            ControlMessageOwned::ScmRights(fds) => fds.first().copied(),
            _ => None,
        })
    });
    let copy = match got {
        Ok(Some(fd)) => fd,
        Ok(None) => {
            out.push(("stage2-copy-public", "no descriptor".into()));
            return;
        }
        Err(e) => {
            out.push(("stage2-copy-public", format!("{e:?}")));
            return;
        }
    };
    out.push(("stage2-copy-public", "ok".into()));
    blind(out, copy, "stage2");
}

/// Attaches the one-instruction classic BPF program `return k` to `fd` as socket option
/// `option` (`SO_ATTACH_FILTER`, `SO_ATTACH_REUSEPORT_CBPF`); setsockopt's return value.
fn attach_return(fd: i32, option: libc::c_int, k: u32) -> libc::c_int {
    let program = [libc::sock_filter {
        code: (libc::BPF_RET | libc::BPF_K) as u16,
        jt: 0,
        jf: 0,
        k,
    }];
    let prog = libc::sock_fprog {
        len: 1,
        filter: program.as_ptr().cast_mut(),
    };
    // SAFETY: a program of ours and its descriptor block; the kernel copies both in.
    unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            option,
            (&prog as *const libc::sock_fprog).cast(),
            std::mem::size_of::<libc::sock_fprog>() as libc::socklen_t,
        )
    }
}

/// What blinds a box through a copy of its receiving socket: a drop-all socket filter, locked,
/// then a `connect` to an address nobody sends from.
fn blind(out: &mut Outcomes, fd: i32, prefix: &'static str) {
    // A socket filter that returns 0 drops every datagram.
    let r = attach_return(fd, libc::SO_ATTACH_FILTER, 0);
    out.push((leak(prefix, "-filter"), raw(r.into())));
    let on: libc::c_int = 1;
    // SAFETY: an int option of ours.
    let r = unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_LOCK_FILTER,
            (&on as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    out.push((leak(prefix, "-lock-filter"), raw(r.into())));
    let to = nix::sys::socket::SockaddrIn::new(127, 0, 0, 1, 9);
    out.push((
        leak(prefix, "-connect"),
        outcome(nix::sys::socket::connect(fd, &to)),
    ));
}

/// `prefix` ‖ `what`, for a report key (a handful per run).
fn leak(prefix: &str, what: &str) -> &'static str {
    Box::leak(format!("{prefix}{what}").into_boxed_str())
}

/// Descriptor 4 is the worker's own sending socket: whatever it does to it touches itself
/// alone. Receives for a while (datagrams for other instances must never arrive: the test
/// sends them meanwhile), then blinds it as it would blind the demux's socket, and tries to
/// take it out of the group by binding it to a device. The test runs this unconfined too.
fn own_socket(out: &mut Outcomes) {
    let receiving = std::env::var("RINGMUX_FAULT_MARKER")
        .map(|m| format!("{m}.receiving"))
        .unwrap_or_default();
    let _ = std::fs::write(&receiving, b"1");
    let mut got = 0u64;
    let mut last = String::from("none");
    let end = std::time::Instant::now() + std::time::Duration::from_secs(3);
    let mut buf = [0u8; 2048];
    while std::time::Instant::now() < end {
        // SAFETY: our buffer and its length.
        let r = unsafe {
            libc::recv(
                PUBLIC,
                buf.as_mut_ptr().cast(),
                buf.len(),
                libc::MSG_DONTWAIT,
            )
        };
        if r >= 0 {
            got += 1;
        } else {
            last = format!("{:?}", Errno::last());
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }
    out.push(("received-on-own-socket", got.to_string()));
    out.push(("last-receive", last));
    // Replacing the group's steering program through it would take every datagram.
    let r = attach_return(PUBLIC, libc::SO_ATTACH_REUSEPORT_CBPF, 1);
    out.push(("own-socket-steer", raw(r.into())));
    blind(out, PUBLIC, "own-socket");
    // SAFETY: shutdown passes no memory.
    let r = unsafe { libc::shutdown(PUBLIC, libc::SHUT_RD) };
    out.push(("own-socket-shutdown", raw(r.into())));
    if std::env::var_os("RINGMUX_FAULT_UNCONFINED").is_none() {
        // Unconfined this would work, and take the socket out of the group as a better match
        // for everything arriving on loopback: only tried where the filter is expected.
        let dev = b"lo\0";
        // SAFETY: a NUL-terminated name of ours and its length.
        let r = unsafe {
            libc::setsockopt(
                PUBLIC,
                libc::SOL_SOCKET,
                libc::SO_BINDTODEVICE,
                dev.as_ptr().cast(),
                dev.len() as libc::socklen_t,
            )
        };
        out.push(("own-socket-bind-device", raw(r.into())));
        let other = std::net::UdpSocket::bind("127.0.0.1:0").map(OwnedFd::from);
        out.push((
            "other-socket-bind-device",
            match other {
                // SAFETY: as above, on a socket of ours.
                Ok(s) => raw(unsafe {
                    libc::setsockopt(
                        s.as_raw_fd(),
                        libc::SOL_SOCKET,
                        libc::SO_BINDTODEVICE,
                        dev.as_ptr().cast(),
                        dev.len() as libc::socklen_t,
                    )
                }
                .into()),
                Err(e) => format!("no socket: {e}"),
            },
        ));
    }
}

/// The parent-death signal and the rest of `prctl`: a worker must die with the demux and stay
/// non-dumpable, whatever it asks.
fn prctl(out: &mut Outcomes) {
    // SAFETY: each prctl below passes integers only (PR_GET_PDEATHSIG an int of ours).
    let r = unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, 0) };
    out.push(("pdeathsig-off", raw(r.into())));
    // SAFETY: as above.
    let r = unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) };
    out.push(("pdeathsig-term", raw(r.into())));
    let mut sig: libc::c_int = 0;
    // SAFETY: as above.
    let r = unsafe { libc::prctl(libc::PR_GET_PDEATHSIG, &mut sig as *mut libc::c_int) };
    out.push((
        "pdeathsig-now",
        if r == 0 {
            sig.to_string()
        } else {
            raw(r.into())
        },
    ));
    // SAFETY: as above.
    let r = unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 1) };
    out.push(("dumpable-on", raw(r.into())));
    // SAFETY: as above.
    let r = unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0) };
    out.push(("dumpable-off", raw(r.into())));
    // SAFETY: as above.
    let r = unsafe { libc::prctl(libc::PR_SET_PTRACER, libc::PR_SET_PTRACER_ANY) };
    out.push(("ptracer-any", raw(r.into())));
    // SAFETY: as above.
    let r = unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1) };
    out.push(("subreaper", raw(r.into())));
    // SAFETY: as above.
    let r = unsafe { libc::prctl(libc::PR_SET_NAME, c"attacker".as_ptr()) };
    out.push(("set-name", raw(r.into())));
    // A descriptor ringmux inherited from its own parent (the test names its number).
    if let Some(fd) = std::env::var("RINGMUX_FAULT_INHERITED")
        .ok()
        .and_then(|v| v.parse::<i32>().ok())
    {
        // SAFETY: F_GETFD takes no memory.
        let r = unsafe { libc::fcntl(fd, libc::F_GETFD) };
        out.push(("inherited-open", raw(r.into())));
    }
}

/// The capabilities this worker holds (the sets of `/proc/self/status`, hexadecimal), and one
/// use of `CAP_NET_BIND_SERVICE`, the capability the shipped unit gives ringmux: binding a
/// privileged TCP port.
fn capabilities(out: &mut Outcomes) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    for (attempt, key) in [
        ("cap-effective", "CapEff:"),
        ("cap-permitted", "CapPrm:"),
        ("cap-inheritable", "CapInh:"),
        ("cap-ambient", "CapAmb:"),
    ] {
        let value = status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .map_or_else(|| "missing".to_string(), |v| v.trim().to_string());
        out.push((attempt, value));
    }
    // Port 81 on loopback: nothing of the tests listens there.
    let bind = std::net::TcpListener::bind("127.0.0.1:81");
    out.push(("bind-privileged-port", io_outcome(bind)));
}

/// The shared listening TCP socket at descriptor 5 (`--tcp on`): accepting is allowed, and
/// nothing else that would touch the other workers' accept queue or file description; nor may a
/// worker listen anywhere.
fn tcp_listener(out: &mut Outcomes) {
    const TCP: i32 = ringmux_proto::TCP_FD;
    // SAFETY: accept4 with no address buffer; a connection accepted by mistake is closed.
    let r = unsafe {
        libc::accept4(
            TCP,
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
        )
    };
    out.push(("accept", raw(r.into())));
    close_if_made(r);
    let off: libc::c_int = 0;
    let size = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // Each outcome is read right after its call (errno is the last call's).
    let mut attempt = |name: &'static str, call: &dyn Fn() -> libc::c_long| {
        let r = call();
        out.push((name, raw(r)));
    };
    // SAFETY: descriptors and integers, or an int of ours and its size.
    attempt("listener-setsockopt", &|| unsafe {
        libc::setsockopt(
            TCP,
            libc::SOL_SOCKET,
            libc::SO_RCVBUF,
            (&off as *const libc::c_int).cast(),
            size,
        )
        .into()
    });
    // SAFETY: descriptors and integers, or an int of ours and its size.
    attempt("listener-clear-nonblock", &|| unsafe {
        libc::fcntl(TCP, libc::F_SETFL, 0).into()
    });
    // SAFETY: descriptors and integers, or an int of ours and its size.
    attempt("listener-fionbio", &|| unsafe {
        libc::ioctl(TCP, FIONBIO, &off).into()
    });
    // SAFETY: descriptors and integers, or an int of ours and its size.
    attempt("listener-dup", &|| unsafe { libc::dup(TCP).into() });
    // SAFETY: descriptors and integers, or an int of ours and its size.
    attempt("listener-dupfd", &|| unsafe {
        libc::fcntl(TCP, libc::F_DUPFD_CLOEXEC, 10).into()
    });
    // SAFETY: descriptors and integers, or an int of ours and its size.
    attempt("listener-cloexec", &|| unsafe {
        libc::ioctl(TCP, FIOCLEX).into()
    });
    // SAFETY: descriptors and integers, or an int of ours and its size.
    attempt("listener-listen", &|| unsafe {
        libc::listen(TCP, 1).into()
    });
    // SAFETY: descriptors and integers, or an int of ours and its size.
    attempt("listener-shutdown", &|| unsafe {
        libc::shutdown(TCP, libc::SHUT_RDWR).into()
    });
    // SAFETY: descriptors and integers, or an int of ours and its size.
    attempt("listener-close", &|| unsafe { libc::close(TCP).into() });
    // The plain-HTTP listener (`--redirect-http`), when held: shared like the HTTPS listener.
    const REDIRECT: i32 = ringmux_proto::REDIRECT_FD;
    // SAFETY: descriptors and integers.
    attempt("redirect-shutdown", &|| unsafe {
        libc::shutdown(REDIRECT, libc::SHUT_RDWR).into()
    });
    // SAFETY: descriptors and integers.
    attempt("redirect-clear-nonblock", &|| unsafe {
        libc::fcntl(REDIRECT, libc::F_SETFL, 0).into()
    });
    // SAFETY: descriptors and integers.
    attempt("redirect-dup", &|| unsafe { libc::dup(REDIRECT).into() });
    // A listener of its own: std binds, then listens.
    out.push((
        "listen-elsewhere",
        io_outcome(std::net::TcpListener::bind("127.0.0.1:0")),
    ));
}

/// What a worker may do to its access log (descriptor 7) and its standard error (2): write
/// lines, and nothing that would reach a line another process wrote. Tries a line of its own,
/// then positional writes that ignore `O_APPEND` (`pwrite64`, `pwritev2` with
/// `RWF_NOAPPEND`), cutting the file short, clearing `O_APPEND` and writing at offset 0 through
/// `lseek`, on both.
fn log_rewrite(out: &mut Outcomes) {
    const LOG: i32 = ringmux_proto::ACCESS_LOG_FD;
    let line = b"a line from the fault worker\n";
    let over = b"OVERWRITTEN BY THE FAULT WORKER\n";
    // SAFETY: a buffer of ours and its length.
    let r = unsafe { libc::write(LOG, line.as_ptr().cast(), line.len()) };
    out.push(("log-write", raw(r as libc::c_long)));
    for (fd, prefix) in [(LOG, "log-"), (libc::STDERR_FILENO, "stderr-")] {
        // SAFETY: a buffer of ours and its length, at offset 0.
        let r = unsafe { libc::pwrite(fd, over.as_ptr().cast(), over.len(), 0) };
        out.push((leak(prefix, "pwrite"), raw(r as libc::c_long)));
        let iov = libc::iovec {
            iov_base: over.as_ptr() as *mut libc::c_void,
            iov_len: over.len(),
        };
        const RWF_NOAPPEND: libc::c_long = 0x20;
        // SAFETY: one iovec of ours; offset 0 (low and high words), flags.
        let r = unsafe {
            libc::syscall(
                libc::SYS_pwritev2,
                fd as libc::c_long,
                &iov as *const libc::iovec,
                1 as libc::c_long,
                0 as libc::c_long,
                0 as libc::c_long,
                RWF_NOAPPEND,
            )
        };
        out.push((leak(prefix, "pwritev2-noappend"), raw(r)));
        // SAFETY: descriptors and integers.
        let r = unsafe { libc::ftruncate(fd, 0) };
        out.push((leak(prefix, "truncate"), raw(r.into())));
        // SAFETY: descriptors and integers.
        let r = unsafe { libc::fcntl(fd, libc::F_SETFL, 0) };
        out.push((leak(prefix, "clear-append"), raw(r.into())));
        // SAFETY: descriptors and integers.
        let r = unsafe { libc::lseek(fd, 0, libc::SEEK_SET) };
        out.push((leak(prefix, "seek"), raw(r as libc::c_long)));
        if r == 0 {
            // SAFETY: a buffer of ours and its length.
            let w = unsafe { libc::write(fd, over.as_ptr().cast(), over.len()) };
            out.push((leak(prefix, "write-at-0"), raw(w as libc::c_long)));
        }
    }
}

/// Lines a flood writes: ten times a worker's burst of log lines.
const FLOOD_LINES: usize = 20_000;

/// Makes its standard error non-blocking and floods it (what made a shared standard error
/// fail the demux's next log write with `EAGAIN`): [`FLOOD_LINES`] lines, the 101st of 100 KiB,
/// as fast as it can, for at most 5 s. Records how many lines went out.
fn stderr_flood(out: &mut Outcomes) {
    let fd = libc::STDERR_FILENO;
    // SAFETY: descriptors and integers.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    // SAFETY: descriptors and integers.
    let r = unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) };
    out.push(("stderr-nonblock", raw(r.into())));
    let mut long = vec![b'L'; 100 * 1024];
    long.push(b'\n');
    let end = std::time::Instant::now() + std::time::Duration::from_secs(5);
    let (mut written, mut again) = (0usize, 0u64);
    let mut line = 0usize;
    while line <= FLOOD_LINES && std::time::Instant::now() < end {
        let text;
        // The long line early, while the demux still passes lines on (it cuts it).
        let bytes: &[u8] = if line == 100 {
            &long
        } else {
            text = format!("fault-worker flood line {line:06} \x1b[31mred\x1b[0m\n");
            text.as_bytes()
        };
        // SAFETY: a buffer of ours and its length.
        let w = unsafe { libc::write(fd, bytes.as_ptr().cast(), bytes.len()) };
        if w < 0 {
            again += 1;
            std::thread::yield_now();
            continue;
        }
        written += 1;
        line += 1;
    }
    out.push(("flood-lines", written.to_string()));
    out.push(("flood-eagain", again.to_string()));
}

/// What a worker must neither read nor write, from its first instruction: the ACME state of
/// the folder `RINGMUX_FAULT_STATE` (the account key, the key of site `RINGMUX_FAULT_SITE`,
/// a certificate planted by writing, creating or renaming into `certs/SITE/`, a challenge
/// written into `challenges/`), files outside every root (`RINGMUX_FAULT_CONFIG`,
/// `RINGMUX_FAULT_SHADOW`, `/etc/passwd`), changes inside the site root `RINGMUX_FAULT_ROOT`
/// (which holds `index.html`, readable: `root-read` is the one attempt that must succeed), and
/// writing anywhere else (`/tmp`, `/dev/shm`, the working folder, beside the state). A file
/// to rename is prepared beside the marker (`RINGMUX_FAULT_MARKER`), the one place the test
/// lets a worker write. Whatever got through is undone where it can be.
fn files(out: &mut Outcomes) {
    use std::fs::{self, OpenOptions};
    use std::path::PathBuf;
    let var = |name: &str| PathBuf::from(std::env::var_os(name).unwrap_or_default());
    let state = var("RINGMUX_FAULT_STATE");
    let site = std::env::var("RINGMUX_FAULT_SITE").unwrap_or_default();
    let root = var("RINGMUX_FAULT_ROOT");
    let marker = var("RINGMUX_FAULT_MARKER");
    let certs = state.join("certs").join(&site);
    let read = |path: PathBuf| io_outcome(fs::read(path));
    let create = |path: PathBuf| {
        let r = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&path)
            .and_then(|mut f| std::io::Write::write_all(&mut f, b"planted\n"));
        if r.is_ok() {
            let _ = fs::remove_file(&path);
        }
        io_outcome(r)
    };
    // Keys and the account.
    out.push(("read-account-key", read(state.join("account.json"))));
    out.push(("read-site-key", read(certs.join("key.pem"))));
    out.push(("read-site-cert", read(certs.join("cert.pem"))));
    out.push(("list-state", io_outcome(fs::read_dir(&state).map(|_| ()))));
    // A certificate of the worker's own, as the demux writes one: by rename, or in place.
    out.push((
        "plant-cert-open-for-writing",
        io_outcome(OpenOptions::new().write(true).open(certs.join("cert.pem"))),
    ));
    out.push(("plant-cert-create", create(certs.join("planted.pem"))));
    let staged = marker.with_extension("planted");
    let rename = fs::write(&staged, b"-----BEGIN CERTIFICATE-----\n")
        .and_then(|()| fs::rename(&staged, certs.join("cert.pem")));
    let _ = fs::remove_file(&staged);
    out.push(("plant-cert-rename", io_outcome(rename)));
    out.push((
        "write-challenge",
        create(state.join("challenges").join("evil-token.json")),
    ));
    out.push(("write-state", create(state.join("evil.json"))));
    // Files outside every root.
    out.push(("read-config", read(var("RINGMUX_FAULT_CONFIG"))));
    out.push(("read-shadow", read(var("RINGMUX_FAULT_SHADOW"))));
    out.push(("read-etc-passwd", read(PathBuf::from("/etc/passwd"))));
    // The site root: readable, not changeable.
    out.push(("root-read", read(root.join("index.html"))));
    out.push(("root-create", create(root.join("planted.html"))));
    out.push((
        "root-open-for-writing",
        io_outcome(OpenOptions::new().write(true).open(root.join("index.html"))),
    ));
    let moved = fs::rename(root.join("index.html"), root.join("moved.html"));
    if moved.is_ok() {
        let _ = fs::rename(root.join("moved.html"), root.join("index.html"));
    }
    out.push(("root-rename", io_outcome(moved)));
    let made = fs::create_dir(root.join("sub"));
    if made.is_ok() {
        let _ = fs::remove_dir(root.join("sub"));
    }
    out.push(("root-mkdir", io_outcome(made)));
    // Last: a removal cannot be undone.
    out.push((
        "root-remove",
        io_outcome(fs::remove_file(root.join("index.html"))),
    ));
    // Anywhere else.
    let name = format!("ringmux-fault-{}", std::process::id());
    out.push(("write-tmp", create(PathBuf::from("/tmp").join(&name))));
    out.push((
        "write-dev-shm",
        create(PathBuf::from("/dev/shm").join(&name)),
    ));
    out.push(("write-cwd", create(PathBuf::from(&name))));
    if let Some(beside) = state.parent() {
        out.push(("write-beside-state", create(beside.join(&name))));
    }
}

/// Lines that would pass for the demux's own, or break a line in two on a terminal, written to
/// standard error (2) and the access log (7): each carries `forged-by-worker`; a demux log
/// line's shape, a carriage return, C1 controls as UTF-8 (U+0085 next line, U+009B CSI) and
/// as raw bytes (0x85, 0x9B), a Unicode line separator, invalid UTF-8. Records each write.
fn log_forge(out: &mut Outcomes) {
    const LOG: i32 = ringmux_proto::ACCESS_LOG_FD;
    let lines: [&[u8]; 5] = [
        b"2026-12-07T00:00:00.000000Z  WARN ringmux: forged-by-worker demux line\n",
        b"forged-by-worker cr\r2026-12-07T00:00:00.000000Z  INFO ringmux: after a CR\n",
        b"forged-by-worker c1-utf8 \xc2\x85 INFO next line \xc2\x9b31m csi\n",
        b"forged-by-worker c1-raw \x85 INFO next line \x9b31m csi\n",
        b"forged-by-worker ls \xe2\x80\xa8 INFO separator \xff\xfe end\n",
    ];
    for (fd, name) in [(libc::STDERR_FILENO, "forge-stderr"), (LOG, "forge-log")] {
        let mut result = 0;
        for line in lines {
            // SAFETY: a buffer of ours and its length.
            let r = unsafe { libc::write(fd, line.as_ptr().cast(), line.len()) };
            if r < 0 {
                result = r as libc::c_long;
            }
        }
        out.push((name, raw(result)));
    }
}

/// The rate tables (`ringmux_ring::tally`, shm-layout.md "Rate tables"): its sibling's table,
/// handed over as a read-only open file description (descriptor `RATE_TABLES_FD + 1`), cannot
/// be written by any way in: a writable shared mapping, `pwrite`, `mprotect` of a read-only
/// mapping to writable, making it writable by its mode (`chmod` in every form: a worker of the
/// demux's own user owns it), a writable reopen through `/proc/self/fd`, truncation. What the
/// sibling's cells hold after those attempts is recorded (`sibling-cells-nonzero`). Then this
/// worker's own table (`RATE_TABLES_FD`) is filled with garbage: every cell a count of
/// `u32::MAX` in a window far from any the workers count in, as a torn or stale write would
/// leave it, before the real worker takes the table over.
fn rate_tables(out: &mut Outcomes) {
    use ringmux_ring::tally::{TALLY_BYTES, TALLY_HEADER_BYTES};
    const OWN: i32 = ringmux_proto::RATE_TABLES_FD;
    const SIBLING: i32 = OWN + 1;
    let tables = std::env::var(ringmux_proto::RATE_TABLES_ENV).unwrap_or_default();
    out.push(("tables", tables));
    let map = |fd: i32, prot: libc::c_int| {
        // SAFETY: a new shared mapping of a descriptor; nothing is overwritten (address NULL),
        // and every mapping made here is unmapped by `unmap`.
        unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                TALLY_BYTES,
                prot,
                libc::MAP_SHARED,
                fd,
                0,
            )
        }
    };
    let unmap = |p: *mut libc::c_void| {
        // SAFETY: `p` is a mapping of TALLY_BYTES made by `map`, no longer used.
        unsafe { libc::munmap(p, TALLY_BYTES) };
    };
    let rw = libc::PROT_READ | libc::PROT_WRITE;
    let p = map(SIBLING, rw);
    out.push(("sibling-map-writable", mapped(p)));
    if p != libc::MAP_FAILED {
        unmap(p);
    }
    let garbage = u64::MAX.to_ne_bytes();
    // SAFETY: writes 8 bytes from a local buffer.
    let r = unsafe {
        libc::pwrite(
            SIBLING,
            garbage.as_ptr().cast(),
            8,
            TALLY_HEADER_BYTES as libc::off_t,
        )
    };
    out.push(("sibling-pwrite", raw(r as libc::c_long)));
    let p = map(SIBLING, libc::PROT_READ);
    out.push(("sibling-map-read-only", mapped(p)));
    if p != libc::MAP_FAILED {
        // SAFETY: changes the protection of our own mapping of TALLY_BYTES.
        let r = unsafe { libc::mprotect(p, TALLY_BYTES, rw) };
        out.push(("sibling-mprotect-writable", raw(r.into())));
        let cells = (TALLY_HEADER_BYTES..TALLY_BYTES).step_by(8);
        // SAFETY: every offset is within the mapping of TALLY_BYTES and 8-byte aligned (the
        // mapping is page-aligned); read volatile, as the sibling may be writing.
        let base = p.cast::<u8>();
        let nonzero = cells
            .filter(|&at| {
                // SAFETY: `at` is within the mapping (above).
                let cell = unsafe { base.add(at) }.cast::<u64>();
                // SAFETY: a readable, aligned u64 of the mapping (above).
                unsafe { cell.read_volatile() != 0 }
            })
            .count();
        out.push(("sibling-cells-nonzero", nonzero.to_string()));
        unmap(p);
    }
    let path = format!("/proc/self/fd/{SIBLING}\0");
    sibling_chmod(SIBLING, &path, out);
    // SAFETY: a NUL-terminated path; a descriptor opened by mistake is closed.
    let fd = unsafe { libc::open(path.as_ptr().cast(), libc::O_RDWR | libc::O_CLOEXEC) };
    out.push(("sibling-reopen-writable", raw(fd.into())));
    if fd >= 0 {
        let p = map(fd, rw);
        out.push(("sibling-reopened-map-writable", mapped(p)));
        if p != libc::MAP_FAILED {
            unmap(p);
        }
    }
    close_if_made(fd);
    // SAFETY: integers only.
    let r = unsafe { libc::ftruncate(SIBLING, 0) };
    out.push(("sibling-truncate", raw(r.into())));

    let p = map(OWN, rw);
    out.push(("own-map-writable", mapped(p)));
    if p != libc::MAP_FAILED {
        for (i, at) in (TALLY_HEADER_BYTES..TALLY_BYTES).step_by(8).enumerate() {
            let window = 0x8000_0000u64 | i as u64;
            // SAFETY: within our own writable mapping of TALLY_BYTES.
            let cell = unsafe { p.cast::<u8>().add(at) }.cast::<u64>();
            // SAFETY: a writable u64 of our own mapping, 8-byte aligned (the mapping is
            // page-aligned and `at` a multiple of 8).
            unsafe { cell.write_volatile(window << 32 | u64::from(u32::MAX)) };
        }
        unmap(p);
    }
}

/// Tries to make the sibling's table (descriptor `fd`, reached through `/proc/self/fd` as
/// `path`, NUL-terminated) writable for its owner, each way the kernel offers: what a worker
/// of the demux's own user, which owns the table, would do before reopening it writable. The
/// workers' filter refuses all four (`EPERM`); a worker of another user is not the owner.
fn sibling_chmod(fd: libc::c_int, path: &str, out: &mut Outcomes) {
    let mode: libc::mode_t = 0o600;
    // SAFETY: integers only.
    let r = unsafe { libc::fchmod(fd, mode) };
    out.push(("sibling-fchmod", raw(r.into())));
    // SAFETY: `path` is NUL-terminated.
    let r = unsafe { libc::chmod(path.as_ptr().cast(), mode) };
    out.push(("sibling-chmod-proc", raw(r.into())));
    // SAFETY: as above; AT_FDCWD with an absolute path.
    let r = unsafe { libc::fchmodat(libc::AT_FDCWD, path.as_ptr().cast(), mode, 0) };
    out.push(("sibling-fchmodat", raw(r.into())));
    // fchmodat2 (Linux 6.6) on the descriptor itself (AT_EMPTY_PATH), through the raw call:
    // libc has no wrapper on every target.
    // SAFETY: a NUL-terminated empty path and integers.
    let r = unsafe {
        libc::syscall(
            libc::SYS_fchmodat2,
            fd,
            c"".as_ptr(),
            mode,
            libc::AT_EMPTY_PATH,
        )
    };
    out.push(("sibling-fchmodat2", raw(r)));
}

/// The outcome of an `mmap`.
fn mapped(p: *mut libc::c_void) -> String {
    match p == libc::MAP_FAILED {
        true => format!("{:?}", Errno::last()),
        false => "ok".into(),
    }
}
