//! Every system call of the demux outside quinn-udp and the ring crate, each wrapped once, on
//! `nix` where it has a wrapper. The unsafe of the demux lives here (and in the counting
//! allocator); the rest of the crate calls these safe functions.
//!
//! Kinds of error that escape: each function returns `io::Result`; `EINTR` is retried inside,
//! `WouldBlock` escapes from the non-blocking ones (named so), everything else as the kernel
//! said it.

use std::io::{self, IoSlice};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::process::Command;
use std::time::Duration;

use nix::errno::Errno;
use nix::poll::{PollFd, PollFlags, PollTimeout};
use nix::sys::signal::{SigSet, Signal};
use nix::sys::signalfd::{SfdFlags, SignalFd};
use nix::sys::socket::{self, sockopt, ControlMessage, MsgFlags};

use crate::supervisor::sandbox::WorkerFilter;

// ---------------------------------------------------------------------------------------------
// Unix sockets: the control, session and unix-ingress sockets
// ---------------------------------------------------------------------------------------------

/// A connected `SOCK_SEQPACKET` pair, both ends close-on-exec.
pub fn seqpacket_pair() -> io::Result<(OwnedFd, OwnedFd)> {
    let (a, b) = socket2::Socket::pair(
        socket2::Domain::UNIX,
        socket2::Type::SEQPACKET.cloexec(),
        None,
    )?;
    Ok((a.into(), b.into()))
}

/// Sends one packet with `fds` attached (`SCM_RIGHTS`; none for a hand-off, whose descriptors
/// are placed before exec), blocking until it is queued, without `SIGPIPE`.
pub fn send_with_fds(sock: BorrowedFd<'_>, data: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<()> {
    let raw: Vec<RawFd> = fds.iter().map(AsRawFd::as_raw_fd).collect();
    let iov = [IoSlice::new(data)];
    let cmsg = [ControlMessage::ScmRights(&raw)];
    let cmsgs: &[ControlMessage<'_>] = if raw.is_empty() { &[] } else { &cmsg };
    let n = retry(|| {
        socket::sendmsg::<()>(sock.as_raw_fd(), &iov, cmsgs, MsgFlags::MSG_NOSIGNAL, None)
    })?;
    if n != data.len() {
        return Err(io::Error::other("packet sent partially"));
    }
    Ok(())
}

/// Sends one packet without blocking and without `SIGPIPE` (`WouldBlock` escapes).
pub fn send_packet(sock: BorrowedFd<'_>, data: &[u8]) -> io::Result<()> {
    send_iov(sock, &[IoSlice::new(data)])
}

/// Sends one packet gathered from `parts`, without blocking and without `SIGPIPE`
/// (`WouldBlock` escapes). Allocates nothing: it runs on the data plane in `unix` mode.
pub fn send_iov(sock: BorrowedFd<'_>, parts: &[IoSlice<'_>]) -> io::Result<()> {
    let flags = MsgFlags::MSG_DONTWAIT | MsgFlags::MSG_NOSIGNAL;
    retry(|| socket::sendmsg::<()>(sock.as_raw_fd(), parts, &[], flags, None)).map(drop)
}

/// Receives one packet without blocking, with `MSG_TRUNC`: the result is the packet's real
/// length, which may exceed `buf.len()` (the rest was discarded). `Ok(0)`: end of file.
/// Descriptors a peer attached are not accepted: with no room for them, the kernel closes them.
pub fn recv_packet(sock: BorrowedFd<'_>, buf: &mut [u8]) -> io::Result<usize> {
    let flags = MsgFlags::MSG_DONTWAIT | MsgFlags::MSG_TRUNC;
    retry(|| socket::recv(sock.as_raw_fd(), buf, flags))
}

/// Whether an error means the peer is gone.
pub fn is_disconnect(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EPIPE | libc::ECONNRESET | libc::ENOTCONN | libc::ECONNREFUSED)
    )
}

// ---------------------------------------------------------------------------------------------
// Waiting
// ---------------------------------------------------------------------------------------------

/// Waits until one of `fds` is readable (or hung up, or in error), for at most `timeout`
/// (`None`: forever). Returns how many are. A timeout is rounded up to whole milliseconds.
pub fn poll_readable(fds: &[BorrowedFd<'_>], timeout: Option<Duration>) -> io::Result<usize> {
    Ok(poll_which(fds, timeout)?.into_iter().filter(|r| *r).count())
}

/// [`poll_readable`] for one descriptor, allocating nothing (the data plane's idle wait).
pub fn wait_readable(fd: BorrowedFd<'_>, timeout: Duration) -> io::Result<bool> {
    let timeout =
        PollTimeout::try_from(timeout.as_micros().div_ceil(1000)).unwrap_or(PollTimeout::MAX);
    let mut p = [PollFd::new(fd, PollFlags::POLLIN)];
    Ok(retry(|| nix::poll::poll(&mut p, timeout))? > 0)
}

/// Which of `fds` are readable (or hung up, or in error), after waiting at most `timeout`
/// (`None`: forever) for one to be. A timeout is rounded up to whole milliseconds.
pub fn poll_which(fds: &[BorrowedFd<'_>], timeout: Option<Duration>) -> io::Result<Vec<bool>> {
    let timeout = match timeout {
        None => PollTimeout::NONE,
        Some(t) => PollTimeout::try_from(t.as_micros().div_ceil(1000)).unwrap_or(PollTimeout::MAX),
    };
    let mut p: Vec<PollFd<'_>> = fds
        .iter()
        .map(|fd| PollFd::new(*fd, PollFlags::POLLIN))
        .collect();
    retry(|| nix::poll::poll(&mut p, timeout))?;
    Ok(p.iter()
        .map(|p| p.revents().is_some_and(|r| !r.is_empty()))
        .collect())
}

/// Waits until `fd` can be written to, for at most `timeout`; `Ok(false)` if it cannot yet.
pub fn wait_writable(fd: BorrowedFd<'_>, timeout: Duration) -> io::Result<bool> {
    let timeout =
        PollTimeout::try_from(timeout.as_micros().div_ceil(1000)).unwrap_or(PollTimeout::MAX);
    let mut p = [PollFd::new(fd, PollFlags::POLLOUT)];
    Ok(retry(|| nix::poll::poll(&mut p, timeout))? > 0)
}

// ---------------------------------------------------------------------------------------------
// Logs: the pipes of the workers' output and access logs, the demux's standard error
// ---------------------------------------------------------------------------------------------

/// Blocks every signal in the calling thread: a thread started before the demux blocks its
/// shutdown signals (to read them from a signalfd) must not be the one the kernel delivers them
/// to, which would run their default action (end the process).
pub fn block_all_signals() -> io::Result<()> {
    nix::sys::signal::pthread_sigmask(
        nix::sys::signal::SigmaskHow::SIG_BLOCK,
        Some(&SigSet::all()),
        None,
    )?;
    Ok(())
}

/// A memfd holding `bytes`, sealed against every change (write, shrink, grow, further seals),
/// close-on-exec, its offset at 0: one worker's copy of the site table. A copy of its own per
/// worker, so that no worker shares its open file description (the offset moves as it reads).
pub fn sealed_memfd(name: &std::ffi::CStr, bytes: &[u8]) -> io::Result<OwnedFd> {
    use nix::fcntl::{fcntl, FcntlArg, SealFlag};
    use nix::sys::memfd::{memfd_create, MFdFlags};
    use std::io::{Seek, Write};
    let fd = memfd_create(name, MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING)?;
    let mut file = std::fs::File::from(fd);
    file.write_all(bytes)?;
    file.rewind()?;
    fcntl(
        &file,
        FcntlArg::F_ADD_SEALS(
            SealFlag::F_SEAL_WRITE
                | SealFlag::F_SEAL_SHRINK
                | SealFlag::F_SEAL_GROW
                | SealFlag::F_SEAL_SEAL,
        ),
    )?;
    Ok(file.into())
}

/// A pipe for one worker's output or access log: `(read, write)`, both close-on-exec, the read
/// end non-blocking. The two ends are two open file descriptions: what the worker does to its
/// end (`O_NONBLOCK`, closing it) never reaches the demux's.
pub fn log_pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    let (read, write) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)?;
    rustix::io::ioctl_fionbio(&read, true)?;
    Ok((read, write))
}

/// Reads what is there from the non-blocking `fd` into `buf`: `Ok(0)` at the end (every write
/// end closed), `WouldBlock` when nothing is waiting.
pub fn read_some(fd: BorrowedFd<'_>, buf: &mut [u8]) -> io::Result<usize> {
    loop {
        match rustix::io::read(fd, &mut *buf) {
            Err(rustix::io::Errno::INTR) => continue,
            r => return Ok(r?),
        }
    }
}

/// Writes all of `buf` to `fd` (the demux's standard error, or the access log). A descriptor in
/// non-blocking mode that is full gets `wait` to drain once; `Err` when it still cannot take
/// the rest, or on any other error (`EPIPE`, `ENOSPC`, `EBADF`): what was not written is lost
/// and the caller counts it, and the call never blocks on a non-blocking descriptor for longer
/// than `wait`. (A blocking one blocks as the kernel makes it.)
pub fn write_all_or_fail(fd: BorrowedFd<'_>, buf: &[u8], wait: Duration) -> io::Result<()> {
    let mut done = 0;
    let mut waited = false;
    while done < buf.len() {
        match rustix::io::write(fd, &buf[done..]) {
            Ok(0) => return Err(io::Error::from(io::ErrorKind::WriteZero)),
            Ok(n) => done += n,
            Err(rustix::io::Errno::INTR) => {}
            Err(rustix::io::Errno::AGAIN) if !waited => {
                waited = true;
                wait_writable(fd, wait)?;
            }
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// An eventfd (non-blocking, close-on-exec) that wakes a thread waiting in [`poll_which`].
pub fn wake_fd() -> io::Result<OwnedFd> {
    use rustix::event::EventfdFlags;
    Ok(rustix::event::eventfd(
        0,
        EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK,
    )?)
}

/// Makes the [`wake_fd`] readable (a full counter is readable already).
pub fn wake(fd: BorrowedFd<'_>) {
    let _ = rustix::io::write(fd, &1u64.to_ne_bytes());
}

/// Makes the [`wake_fd`] unreadable again.
pub fn clear_wake(fd: BorrowedFd<'_>) {
    let mut v = [0u8; 8];
    let _ = rustix::io::read(fd, &mut v);
}

// ---------------------------------------------------------------------------------------------
// File locks: the ACME state directory's `locks/` (`acme::store`)
// ---------------------------------------------------------------------------------------------

/// A file held with an exclusive `flock(2)` lock; dropping it closes the descriptor, which
/// releases the lock (so does the process's death: a crashed node never leaves a site locked).
pub type LockedFile = nix::fcntl::Flock<std::fs::File>;

/// Takes an exclusive `flock(2)` lock on `file` without waiting (`LOCK_EX | LOCK_NB`):
/// `Ok(None)` when another open file description holds it, in this process or any other (on
/// NFS, Linux maps it to a lock of the server's, seen by every client). `EINTR` is retried;
/// other errors escape as the kernel said them.
pub fn try_lock_exclusive(file: std::fs::File) -> io::Result<Option<LockedFile>> {
    use nix::fcntl::{Flock, FlockArg};
    let mut file = file;
    loop {
        match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
            Ok(locked) => return Ok(Some(locked)),
            Err((_, Errno::EWOULDBLOCK)) => return Ok(None),
            Err((f, Errno::EINTR)) => file = f,
            Err((_, e)) => return Err(e.into()),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Socket options of the public socket
// ---------------------------------------------------------------------------------------------

/// Raises `SO_RCVBUF` (`send` false) or `SO_SNDBUF` past `net.core.*mem_max` with the `FORCE`
/// variants; fails without `CAP_NET_ADMIN`, which callers treat as "fall back to the capped size".
pub fn force_buffer(socket: BorrowedFd<'_>, send: bool, bytes: usize) -> io::Result<()> {
    let v = bytes.min(i32::MAX as usize / 2);
    if send {
        socket::setsockopt(&socket, sockopt::SndBufForce, &v)?;
    } else {
        socket::setsockopt(&socket, sockopt::RcvBufForce, &v)?;
    }
    Ok(())
}

/// A UDP socket of `addr`'s family, close-on-exec, not bound yet; dual-stack when `addr` is
/// `[::]`.
pub fn udp_socket(addr: std::net::SocketAddr) -> io::Result<socket2::Socket> {
    use socket2::{Domain, Protocol, Socket, Type};
    let s = Socket::new(
        Domain::for_address(addr),
        Type::DGRAM.cloexec(),
        Some(Protocol::UDP),
    )?;
    if addr.is_ipv6() && addr.ip().is_unspecified() {
        s.set_only_v6(false)?;
    }
    Ok(s)
}

/// The listening TCP socket of `--tcp on`: close-on-exec, `SO_REUSEADDR` (a restarted ringmux
/// binds at once past connections in TIME_WAIT), dual-stack for `[::]`, a backlog of 4096,
/// non-blocking (its file description, flags included, is shared by every worker, which may
/// never change them).
pub fn tcp_listener(addr: std::net::SocketAddr) -> io::Result<std::net::TcpListener> {
    use socket2::{Domain, Protocol, Socket, Type};
    let s = Socket::new(
        Domain::for_address(addr),
        Type::STREAM.cloexec(),
        Some(Protocol::TCP),
    )?;
    if addr.is_ipv6() && addr.ip().is_unspecified() {
        s.set_only_v6(false)?;
    }
    s.set_reuse_address(true)?;
    s.bind(&addr.into())?;
    s.listen(4096)?;
    s.set_nonblocking(true)?;
    Ok(s.into())
}

/// A worker's own sending socket: a UDP socket bound to `public`, the public socket's address
/// and port, in its `SO_REUSEPORT` group, whose steering program always picks the demux's
/// socket ([`NEVER_STEER_PROGRAM`]), so it never receives a datagram. Whatever a worker does to
/// it (a filter, `connect`, `shutdown`, receiving) touches that worker alone; the socket the
/// demux receives on never leaves the demux. Its filters are locked (`SO_LOCK_FILTER`), so not
/// even an unconfined worker can replace the group's steering program through it.
/// Non-blocking, close-on-exec, `sndbuf` bytes of send buffer.
pub fn sending_socket(public: std::net::SocketAddr, sndbuf: usize) -> io::Result<OwnedFd> {
    let s = udp_socket(public)?;
    s.set_reuse_port(true)?;
    lock_filter(s.as_fd())?;
    let _ = force_buffer(s.as_fd(), true, sndbuf);
    if s.send_buffer_size().unwrap_or(0) < sndbuf {
        let _ = s.set_send_buffer_size(sndbuf);
    }
    s.set_nonblocking(true)?;
    s.bind(&public.into())?;
    Ok(s.into())
}

/// The steering program of the public socket's `SO_REUSEPORT` group in every mode but
/// `reuseport`: `return 0`, the index of the group's first member, the demux's own socket.
pub const NEVER_STEER_PROGRAM: [libc::sock_filter; 1] = [libc::sock_filter {
    code: (libc::BPF_RET | libc::BPF_K) as u16,
    jt: 0,
    jf: 0,
    k: 0,
}];

/// Sizes a socket's receive and send buffers to at least `rcvbuf` and `sndbuf` bytes: past
/// `net.core.*mem_max` where the demux may (`CAP_NET_ADMIN`), else as far as those limits
/// allow. The receive buffer it got, as Linux reports it (twice what it grants, counting its
/// own overhead), is the caller's to check.
pub fn size_buffers(socket: &socket2::Socket, rcvbuf: usize, sndbuf: usize) {
    let _ = force_buffer(socket.as_fd(), false, rcvbuf);
    let _ = force_buffer(socket.as_fd(), true, sndbuf);
    if socket.recv_buffer_size().unwrap_or(0) < rcvbuf {
        let _ = socket.set_recv_buffer_size(rcvbuf);
    }
    if socket.send_buffer_size().unwrap_or(0) < sndbuf {
        let _ = socket.set_send_buffer_size(sndbuf);
    }
}

/// A per-datagram control message the public socket can be asked for.
#[derive(Clone, Copy, Debug)]
pub enum RecvCmsg {
    /// `IP_PKTINFO`: the destination address of IPv4 datagrams.
    Ipv4PacketInfo,
    /// `IPV6_RECVPKTINFO`: the destination address of IPv6 datagrams.
    Ipv6PacketInfo,
    /// `IP_RECVTOS`: the TOS byte (ECN) of IPv4 datagrams.
    Ipv4Tos,
    /// `IPV6_RECVTCLASS`: the traffic class (ECN) of IPv6 datagrams.
    Ipv6TrafficClass,
}

/// Turns one per-datagram control message off.
pub fn switch_off(socket: BorrowedFd<'_>, what: RecvCmsg) -> io::Result<()> {
    match what {
        RecvCmsg::Ipv4PacketInfo => socket::setsockopt(&socket, sockopt::Ipv4PacketInfo, &false),
        RecvCmsg::Ipv6PacketInfo => {
            socket::setsockopt(&socket, sockopt::Ipv6RecvPacketInfo, &false)
        }
        RecvCmsg::Ipv4Tos => socket::setsockopt(&socket, sockopt::IpRecvTos, &false),
        RecvCmsg::Ipv6TrafficClass => socket::setsockopt(&socket, sockopt::Ipv6RecvTClass, &false),
    }?;
    Ok(())
}

/// `SO_LOCK_FILTER`, which nix does not name, declared with nix's own macro: the option is then
/// set through nix's `setsockopt` like every other, its value passed by nix's `SetBool`. (The
/// macro expands to the raw call inside nix's implementation, which clippy's ban on raw calls
/// sees here.)
#[allow(clippy::disallowed_methods)]
mod lock_filter_option {
    use nix::{setsockopt_impl, sockopt_impl};
    sockopt_impl!(
        /// `SO_LOCK_FILTER`: once set, no socket filter can be attached to, detached from or
        /// replaced on the socket, by any holder of it.
        LockFilter,
        SetOnly,
        libc::SOL_SOCKET,
        libc::SO_LOCK_FILTER,
        bool
    );
}
use lock_filter_option::LockFilter;

/// `SO_LOCK_FILTER`: no socket filter can be attached to, detached from or replaced on
/// `socket` from now on, by any holder of it.
pub fn lock_filter(socket: BorrowedFd<'_>) -> io::Result<()> {
    socket::setsockopt(&socket, LockFilter, &true)?;
    Ok(())
}

/// Attaches `program`, a classic BPF program, to the `SO_REUSEPORT` group of the bound UDP
/// socket `sock` (`SO_ATTACH_REUSEPORT_CBPF`, which needs no privilege), replacing any program
/// attached before: from then on the kernel runs it on every datagram for the group and takes
/// its return value as the index of the socket to deliver to, in the order the sockets joined
/// the group; an index past the group falls back to the kernel's hash. The kernel copies the
/// program and checks it first (`EINVAL` if it refuses it, as for more than `BPF_MAXINSNS`
/// instructions).
pub fn attach_reuseport_program(
    sock: BorrowedFd<'_>,
    program: &[libc::sock_filter],
) -> io::Result<()> {
    let len = u16::try_from(program.len()).map_err(|_| io::Error::from(Errno::EINVAL))?;
    // The kernel only reads the instructions (it copies them in): the C field is not `const`.
    let fprog = libc::sock_fprog {
        len,
        filter: program.as_ptr().cast_mut(),
    };
    socket::setsockopt(&sock, sockopt::AttachReusePortCbpf, &fprog)?;
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Processes and signals
// ---------------------------------------------------------------------------------------------

/// Pins the calling thread to CPU `cpu`.
pub fn pin_to_cpu(cpu: usize) -> io::Result<()> {
    let mut set = nix::sched::CpuSet::new();
    set.set(cpu)?;
    nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set)?;
    Ok(())
}

/// What the demux arranges in a worker's process between fork and exec.
pub struct WorkerSetup<'a> {
    /// The worker's end of its control socket: descriptor 3.
    pub control: BorrowedFd<'a>,
    /// The worker's sending socket (its lane's socket under kernel steering): descriptor 4.
    pub public: BorrowedFd<'a>,
    /// The hand-off's descriptors, placed at `ringmux_proto::FIRST_HANDOFF_FD` and on, in order.
    pub handoff: &'a [BorrowedFd<'a>],
    /// The listening TCP socket every worker shares (`--tcp on`): descriptor 5.
    pub tcp: Option<BorrowedFd<'a>>,
    /// The listening socket for plain HTTP (`--redirect-http`): descriptor 6.
    pub redirect: Option<BorrowedFd<'a>>,
    /// The access log (`--access-log`): descriptor 7.
    pub access_log: Option<BorrowedFd<'a>>,
    /// The CPU to pin the process to.
    pub cpu: Option<usize>,
    /// The system-call filter to install last; `None` with `--sandbox off`.
    pub filter: Option<WorkerFilter>,
    /// Empty every capability set of the worker (ambient, inheritable, permitted, effective):
    /// a worker may hold none, whatever ringmux holds (a unit's `AmbientCapabilities=`
    /// would otherwise pass on to every worker).
    pub drop_capabilities: bool,
    /// Empty its bounding set too: for a worker that keeps the demux's user ID 0 (no user
    /// switch, which would have taken `CAP_SETPCAP` with every other capability), where the
    /// demux holds `CAP_SETPCAP`.
    pub drop_bounding_set: bool,
    /// The Landlock ruleset ([`worker_domain`]) the worker enters, in a domain of its own,
    /// just before the filter; `None` with `--sandbox off` or where the kernel has no Landlock.
    pub domain: Option<&'a WorkerDomain>,
}

/// Makes `cmd` start pinned to its CPU (when given), with the control socket as descriptor 3,
/// its sending socket as descriptor 4, the shared listeners and access log at 5 to 7 (those
/// given) and the hand-off's descriptors from 8 on, and no other descriptor past standard
/// error: every other descriptor is marked close-on-exec in the child, so nothing ringmux
/// inherited from its own parent reaches a worker. Then an empty signal mask (the demux blocks its shutdown
/// signals to read them from a signalfd; a worker must receive them), SIGKILL as its
/// parent-death signal, so whatever program it runs dies with the demux (the signal survives
/// `execve`; it fires when the spawning thread, the supervisor's, exits), a Landlock domain of
/// its own (when given) and, last, the filter. A user set on `cmd` (`Command::uid`/`gid`) is
/// switched to before all of this, so the death signal, which a change of credentials clears,
/// is armed after it.
///
/// Fails only if a descriptor cannot be duplicated (`EMFILE`); `cmd` keeps the duplicates until
/// it is dropped. In the child, a failure of any step fails the spawn with that step's error.
pub fn prepare_worker(cmd: &mut Command, setup: WorkerSetup<'_>) -> io::Result<()> {
    // Close-on-exec copies numbered 10 or higher, owned by the hook: never 3 or 4 themselves
    // (dup2 of a descriptor onto itself would leave close-on-exec set), and open for as long as
    // `cmd` can spawn. rustix, because nix's F_DUPFD_CLOEXEC hands back an unowned number.
    let control = rustix::io::fcntl_dupfd_cloexec(setup.control, 10)?;
    let public = rustix::io::fcntl_dupfd_cloexec(setup.public, 10)?;
    if setup.handoff.len() > ringmux_proto::MAX_FDS {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "more hand-off descriptors than the protocol's MAX_FDS",
        ));
    }
    // A fixed array: the hook may not allocate, and the copies must live as long as it.
    let mut handoff: [Option<OwnedFd>; ringmux_proto::MAX_FDS] = Default::default();
    for (slot, fd) in handoff.iter_mut().zip(setup.handoff) {
        *slot = Some(rustix::io::fcntl_dupfd_cloexec(fd, 10)?);
    }
    // The shared descriptors at their fixed numbers, copied after the hand-off's: their
    // copies' numbers are then above every number the hand-off's are placed at.
    let mut fixed: [(Option<OwnedFd>, RawFd); 3] = [
        (None, ringmux_proto::TCP_FD),
        (None, ringmux_proto::REDIRECT_FD),
        (None, ringmux_proto::ACCESS_LOG_FD),
    ];
    for ((slot, _), fd) in fixed
        .iter_mut()
        .zip([setup.tcp, setup.redirect, setup.access_log])
    {
        *slot = fd
            .map(|fd| rustix::io::fcntl_dupfd_cloexec(fd, 10))
            .transpose()?;
    }
    let cpu = setup.cpu;
    let drop_capabilities = setup.drop_capabilities;
    let drop_bounding = setup.drop_bounding_set;
    // Each fork runs the hook on its own copy of this memory: taking the ruleset out in one
    // child leaves it in the parent for the next spawn.
    let mut domain = setup.domain.map(WorkerDomain::copy).transpose()?;
    let mut filter = setup.filter;
    let parent = nix::unistd::getpid();
    // Runs in the child between fork and exec: only async-signal-safe calls (sched_setaffinity,
    // dup2, close_range, fcntl, setsid, prctl, sigprocmask, getpid, landlock_restrict_self, seccomp) on
    // descriptors, a mask and a filter owned by the child, and no allocation.
    let setup = move || -> io::Result<()> {
        // Pinned before exec, so whatever program runs starts on its CPU (nix's CPU set is a
        // plain bit array: no allocation here).
        if let Some(cpu) = cpu {
            pin_to_cpu(cpu)?;
        }
        dup_onto(control.as_fd(), ringmux_proto::CONTROL_FD)?;
        dup_onto(public.as_fd(), ringmux_proto::PUBLIC_FD)?;
        // Nothing past 4 reaches the program but what is placed now (dup2 clears the flag on
        // the number it places at): not even a number of the fixed ones left empty.
        close_on_exec_from(ringmux_proto::PUBLIC_FD + 1)?;
        for (fd, number) in fixed.iter() {
            if let Some(fd) = fd {
                dup_onto(fd.as_fd(), *number)?;
            }
        }
        for (number, fd) in (ringmux_proto::FIRST_HANDOFF_FD..).zip(handoff.iter().flatten()) {
            dup_onto(fd.as_fd(), number)?;
        }
        // A session of its own, so a process group of its own too: Ctrl-C at a terminal
        // (SIGINT to the foreground group) reaches the demux alone, which drains the workers,
        // and the scheduler's autogroup (one per session) is the worker's alone, so a nice
        // value it writes there weighs on no one else. The filter then refuses setsid and
        // setpgid: a worker stays in its own session and group.
        nix::unistd::setsid()?;
        nix::sys::prctl::set_pdeathsig(Signal::SIGKILL)?;
        // The demux may have died between fork and the line above: then no signal comes.
        if nix::unistd::getppid() != parent {
            return Err(io::Error::from(Errno::ESRCH));
        }
        nix::sys::signal::sigprocmask(
            nix::sys::signal::SigmaskHow::SIG_SETMASK,
            Some(&SigSet::empty()),
            None,
        )?;
        if drop_capabilities {
            drop_all_capabilities(drop_bounding)?;
        }
        if let Some(domain) = domain.take() {
            enter_domain(domain)?;
        }
        if let Some(filter) = filter.as_mut() {
            let pid = nix::unistd::getpid().as_raw() as u32;
            filter.bind_to(pid);
            for program in filter.programs() {
                match seccompiler::apply_filter(program) {
                    Ok(()) => {}
                    // Both carry the OS error, which needs no allocation to pass on.
                    Err(seccompiler::Error::Prctl(e) | seccompiler::Error::Seccomp(e)) => {
                        return Err(e)
                    }
                    Err(_) => return Err(io::Error::from(Errno::EINVAL)),
                }
            }
        }
        Ok(())
    };
    // SAFETY: `setup` makes only async-signal-safe calls and allocates nothing, as a pre-exec
    // hook must (it runs in the forked child of a multi-threaded process).
    unsafe { cmd.pre_exec(setup) };
    Ok(())
}

/// Marks every descriptor from `first` on close-on-exec (`close_range` with
/// `CLOSE_RANGE_CLOEXEC`, Linux 5.11; before that, `fcntl` on each number below the descriptor
/// limit). Async-signal-safe, for the pre-exec hook: closing them instead would also close the
/// pipe on which the child reports a failed `execve` to the parent.
fn close_on_exec_from(first: RawFd) -> io::Result<()> {
    const CLOSE_RANGE_CLOEXEC: libc::c_uint = 1 << 2;
    // SAFETY: close_range takes no memory; it only flags descriptors of this process.
    let r = unsafe {
        libc::close_range(
            first as libc::c_uint,
            libc::c_uint::MAX,
            CLOSE_RANGE_CLOEXEC as libc::c_int,
        )
    };
    if r == 0 {
        return Ok(());
    }
    match Errno::last() {
        Errno::ENOSYS | Errno::EINVAL => {}
        e => return Err(e.into()),
    }
    let limit = nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE)?.0;
    let limit = RawFd::try_from(limit).unwrap_or(RawFd::MAX);
    for fd in first..limit {
        // SAFETY: fcntl F_SETFD takes no memory; a number that is not open answers EBADF.
        unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) };
    }
    Ok(())
}

/// A Landlock ruleset (Linux 5.13) from which every worker enters a domain of its own between
/// fork and exec ([`WorkerSetup::domain`]). Landlock lets a process inside a domain trace, and
/// so open the memory of (`/proc/PID/mem`), only processes in the same domain or one nested in
/// it (the kernel's `security/landlock/task.c`): a worker can reach neither a sibling, each in
/// its own domain, nor the demux, in none, from its first instruction on, whatever users they
/// run as and whether or not they are dumpable yet. Where the kernel has Landlock ABI 6 (Linux
/// 6.12), the domain is also scoped for signals and abstract Unix sockets: nothing outside it
/// can be signalled or connected to that way.
///
/// Nor may a worker open any file under `/proc` or `/sys` for writing. A process's own files
/// there (`oom_score_adj`, `autogroup`, `comm`, ...) are writable by its user, which is a
/// sibling's too, in the moments after its `execve` before it makes itself non-dumpable, and
/// a descriptor opened then writes on after; a worker left root (without capabilities) still
/// owns the demux's. The ruleset grants writing beneath every other entry of `/` (listed when
/// it is made), so every other file a worker could write before stays writable; it also
/// handles creating character and block devices, which no worker may do anyway (`CAP_MKNOD`).
///
/// Built with the `landlock` crate, best effort: a kernel before ABI 6 enforces what it knows
/// (everything but the scopes). `Ok(None)`: this kernel has no Landlock (not built, or not
/// enabled at boot).
pub fn worker_domain() -> io::Result<Option<WorkerDomain>> {
    use landlock::{
        AccessFs, PathBeneath, PathFd, Ruleset, RulesetAttr, RulesetCreatedAttr, Scope,
    };
    let mut ruleset = Ruleset::default()
        .handle_access(AccessFs::MakeChar | AccessFs::MakeBlock | AccessFs::WriteFile)
        .and_then(|r| r.scope(Scope::AbstractUnixSocket | Scope::Signal))
        .and_then(|r| r.create())
        .map_err(io::Error::other)?;
    for entry in std::fs::read_dir("/")? {
        let path = entry?.path();
        if path == std::path::Path::new("/proc") || path == std::path::Path::new("/sys") {
            continue;
        }
        // An entry that went away, or a dangling link, has nothing to grant.
        let Ok(fd) = PathFd::new(&path) else {
            continue;
        };
        ruleset = ruleset
            .add_rule(PathBeneath::new(fd, AccessFs::WriteFile))
            .map_err(io::Error::other)?;
    }
    // A ruleset holds a descriptor only where the kernel made one: with Landlock.
    let probe: Option<OwnedFd> = ruleset.try_clone()?.into();
    Ok(probe.map(|_| WorkerDomain(ruleset)))
}

/// The workers' Landlock ruleset ([`worker_domain`]); each spawn takes a copy of it.
pub struct WorkerDomain(landlock::RulesetCreated);

impl WorkerDomain {
    /// A copy for one worker's pre-exec hook (the same ruleset, another descriptor).
    fn copy(&self) -> io::Result<landlock::RulesetCreated> {
        self.0.try_clone()
    }
}

/// Enters a new Landlock domain made of `ruleset` (after `PR_SET_NO_NEW_PRIVS`, which it sets).
/// Async-signal-safe, for the pre-exec hook: two bare system calls, and the errors it passes on
/// carry only the OS error, which needs no allocation.
fn enter_domain(ruleset: landlock::RulesetCreated) -> io::Result<()> {
    use landlock::{RestrictSelfError, RulesetError, RulesetStatus};
    match ruleset.restrict_self() {
        Ok(status) if status.ruleset != RulesetStatus::NotEnforced => Ok(()),
        // The parent saw Landlock ([`worker_domain`]): a domain that was not entered is a
        // failed spawn, not a worker without one.
        Ok(_) => Err(io::Error::from(Errno::EPERM)),
        Err(RulesetError::RestrictSelf(
            RestrictSelfError::SetNoNewPrivsCall { source, .. }
            | RestrictSelfError::RestrictSelfCall { source, .. },
        )) => Err(source),
        Err(_) => Err(io::Error::from(Errno::EINVAL)),
    }
}

/// Drops every capability of the calling thread: the bounding set when `bounding` (bit by bit,
/// up to the kernel's last one; it needs `CAP_SETPCAP`), the ambient and inheritable sets, then
/// the permitted and effective ones. A process running as root keeps its user ID but can no
/// longer trace other processes (`CAP_SYS_PTRACE`: the non-dumpable demux's `/proc/PID/mem`
/// stays closed), override file permissions, open raw sockets or bind privileged ports. No
/// `execve` gives any back: under `PR_SET_NO_NEW_PRIVS`, which the filter sets, an `execve`
/// never grants more than the permitted set it had, and the bounding set is a second wall.
/// Async-signal-safe (bare `prctl` and `capset`), for the pre-exec hook.
fn drop_all_capabilities(bounding: bool) -> io::Result<()> {
    use rustix::thread::{CapabilitySet, CapabilitySets};
    for cap in (0..64).take_while(|_| bounding) {
        let cap = CapabilitySet::from_bits_retain(1u64 << cap);
        match rustix::thread::capability_is_in_bounding_set(cap) {
            // Dropping needs CAP_SETPCAP, which a demux running as root without capabilities
            // (a container, a unit with an empty CapabilityBoundingSet=) does not have: drop
            // only what is there.
            Ok(true) => rustix::thread::remove_capability_from_bounding_set(cap)?,
            Ok(false) => {}
            // Past the kernel's last capability.
            Err(rustix::io::Errno::INVAL) => break,
            Err(e) => return Err(e.into()),
        }
    }
    rustix::thread::clear_ambient_capability_set()?;
    let none = CapabilitySet::empty();
    rustix::thread::set_capabilities(
        None,
        CapabilitySets {
            effective: none,
            permitted: none,
            inheritable: none,
        },
    )?;
    Ok(())
}

/// Makes descriptor number `target` a copy of `fd` (in a forked child: whatever `target` was,
/// a close-on-exec copy of one of the demux's descriptors, is replaced, as exec would have
/// closed it anyway).
fn dup_onto(fd: BorrowedFd<'_>, target: RawFd) -> io::Result<()> {
    // No safe wrapper can target a bare number: nix's and rustix's dup2 want it as an
    // `OwnedFd`, which nothing in the child is, and nix's `dup2_raw` turns a failure into an
    // `OwnedFd` of -1.
    // SAFETY: dup2 passes no memory; `fd` is open (borrowed) and `target` is a valid number.
    if unsafe { libc::dup2(fd.as_raw_fd(), target) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Whether this process holds `CAP_SETPCAP` (may empty a child's bounding set).
pub fn may_drop_bounding_set() -> bool {
    rustix::thread::capabilities(None)
        .is_ok_and(|c| c.effective.contains(rustix::thread::CapabilitySet::SETPCAP))
}

/// Whether this process can start workers as another user: it runs as root with
/// `CAP_SETUID` and `CAP_SETGID` in its effective set.
pub fn may_switch_user() -> bool {
    use rustix::thread::CapabilitySet;
    nix::unistd::geteuid().is_root()
        && rustix::thread::capabilities(None).is_ok_and(|c| {
            c.effective
                .contains(CapabilitySet::SETUID | CapabilitySet::SETGID)
        })
}

/// Makes this process non-dumpable (`PR_SET_DUMPABLE` 0): no process of the same user may
/// `ptrace` it or open its `/proc/PID/mem`.
pub fn make_non_dumpable() -> io::Result<()> {
    nix::sys::prctl::set_dumpable(false)?;
    Ok(())
}

/// Makes the demux non-dumpable (`PR_SET_DUMPABLE` 0: no process of the same user may
/// `ptrace` it or open its `/proc/PID/mem`, and it leaves no core dump) and a child subreaper
/// (`PR_SET_CHILD_SUBREAPER`: a descendant whose parent dies becomes the demux's child instead
/// of init's, so the demux can find and kill it).
pub fn harden_demux() -> io::Result<()> {
    nix::sys::prctl::set_dumpable(false)?;
    nix::sys::prctl::set_child_subreaper(true)?;
    Ok(())
}

/// The PIDs of the calling process's children, living or not yet reaped: from each thread's
/// `/proc/self/task/TID/children` (a child is listed under the thread that is its parent), or,
/// on a kernel without those files (`CONFIG_PROC_CHILDREN`), from every `/proc/PID/stat`.
pub fn children() -> io::Result<Vec<u32>> {
    let mut found = Vec::new();
    let mut listed = false;
    for task in std::fs::read_dir("/proc/self/task")? {
        match std::fs::read_to_string(task?.path().join("children")) {
            Ok(text) => {
                listed = true;
                found.extend(
                    text.split_ascii_whitespace()
                        .filter_map(|p| p.parse::<u32>().ok()),
                );
            }
            // The thread ended since the listing, or the kernel has no such file.
            Err(_) => continue,
        }
    }
    if !listed {
        return children_from_stat();
    }
    found.sort_unstable();
    found.dedup();
    Ok(found)
}

/// [`children`] the slow way: the processes whose `/proc/PID/stat` names this one as parent.
fn children_from_stat() -> io::Result<Vec<u32>> {
    let me = std::process::id();
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc")? {
        let Some(pid) = entry?
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        // Gone since the listing, or not readable: not a child we could kill anyway.
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        if parent_in_stat(&stat) == Some(me) {
            found.push(pid);
        }
    }
    Ok(found)
}

/// The parent PID in a `/proc/PID/stat` line: `pid (comm) state ppid …`, where `comm` may
/// hold spaces and parentheses, so the fields are counted from the last `)`.
fn parent_in_stat(stat: &str) -> Option<u32> {
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_ascii_whitespace().nth(1)?.parse().ok()
}

/// SIGKILL to child `pid`, then reaps it if it is already gone (otherwise a later call does:
/// a child's PID cannot be reused before it is reaped, so killing it again is safe).
pub fn kill_and_reap(pid: u32) {
    let Ok(raw) = i32::try_from(pid) else {
        return;
    };
    let pid = nix::unistd::Pid::from_raw(raw);
    let _ = nix::sys::signal::kill(pid, Signal::SIGKILL);
    let _ = nix::sys::wait::waitpid(pid, Some(nix::sys::wait::WaitPidFlag::WNOHANG));
}

/// A child process known by its PID alone, unlike `std::process::Child`: a new process image
/// of the demux (`ringmux upgrade`) supervises the workers the old one started, which are still
/// its children. The PID cannot be reused while the child is unreaped, and only this process
/// reaps it, so signalling it by PID is safe until [`ChildProcess::wait`] or
/// [`ChildProcess::try_wait`] returned its status.
#[derive(Debug)]
pub struct ChildProcess {
    pid: u32,
    /// The status once reaped (by either wait).
    status: Option<std::process::ExitStatus>,
}

impl ChildProcess {
    /// The child `pid`, started by this process or by an earlier image of it.
    pub fn from_pid(pid: u32) -> Self {
        ChildProcess { pid, status: None }
    }

    pub fn id(&self) -> u32 {
        self.pid
    }

    /// SIGKILL (nothing once it is reaped: its PID may be another process's by then).
    pub fn kill(&self) -> io::Result<()> {
        if self.status.is_some() {
            return Ok(());
        }
        let pid = nix::unistd::Pid::from_raw(i32::try_from(self.pid).map_err(io::Error::other)?);
        nix::sys::signal::kill(pid, Signal::SIGKILL)?;
        Ok(())
    }

    /// Its exit status if it has ended (and reaps it), `None` while it runs.
    pub fn try_wait(&mut self) -> io::Result<Option<std::process::ExitStatus>> {
        if self.status.is_none() {
            self.status = self.waitpid(rustix::process::WaitOptions::NOHANG)?;
        }
        Ok(self.status)
    }

    /// Waits for it to end and reaps it.
    pub fn wait(&mut self) -> io::Result<std::process::ExitStatus> {
        if let Some(s) = self.status {
            return Ok(s);
        }
        loop {
            match self.waitpid(rustix::process::WaitOptions::empty()) {
                Ok(Some(s)) => {
                    self.status = Some(s);
                    return Ok(s);
                }
                Ok(None) => continue,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
        }
    }

    fn waitpid(
        &self,
        flags: rustix::process::WaitOptions,
    ) -> io::Result<Option<std::process::ExitStatus>> {
        use std::os::unix::process::ExitStatusExt;
        let pid = i32::try_from(self.pid)
            .ok()
            .and_then(rustix::process::Pid::from_raw)
            .ok_or_else(|| io::Error::from(Errno::EINVAL))?;
        Ok(rustix::process::waitpid(Some(pid), flags)?
            .map(|(_, status)| std::process::ExitStatus::from_raw(status.as_raw())))
    }
}

/// Bytes waiting in a UDP socket's receive queue (`rx_queue` of its line in `/proc/net/udp` or
/// `/proc/net/udp6`, found by the socket's inode).
pub fn queued_bytes(socket: BorrowedFd<'_>) -> Option<u64> {
    let inode = nix::sys::stat::fstat(socket).ok()?.st_ino;
    for table in ["/proc/net/udp", "/proc/net/udp6"] {
        let Ok(text) = std::fs::read_to_string(table) else {
            continue;
        };
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            // sl local rem st tx_queue:rx_queue tr:tm retrnsmt uid timeout inode ...
            if f.get(9).and_then(|i| i.parse::<u64>().ok()) == Some(inode) {
                let rx = f.get(4)?.split(':').nth(1)?;
                return u64::from_str_radix(rx, 16).ok();
            }
        }
    }
    None
}

/// `shutdown(SHUT_RDWR)` on a socket: every holder of it (and of its peer) sees it closed,
/// whichever descriptors of it still exist.
pub fn shut_down(sock: BorrowedFd<'_>) -> io::Result<()> {
    socket::shutdown(sock.as_raw_fd(), socket::Shutdown::Both)?;
    Ok(())
}

/// A pidfd of process `pid` (Linux 5.3): readable once the process has exited.
pub fn pidfd_open(pid: u32) -> io::Result<OwnedFd> {
    let pid = i32::try_from(pid)
        .ok()
        .and_then(rustix::process::Pid::from_raw)
        .ok_or_else(|| io::Error::from(Errno::EINVAL))?;
    Ok(rustix::process::pidfd_open(
        pid,
        rustix::process::PidfdFlags::empty(),
    )?)
}

/// The shutdown signals (SIGTERM, SIGINT), the reload signal (SIGHUP) and the upgrade signal
/// (SIGUSR2) as a non-blocking
/// signalfd. Blocks them in this
/// thread and in the threads it spawns later: call before spawning any thread.
pub fn shutdown_signals() -> io::Result<SignalFd> {
    let mut set = SigSet::empty();
    set.add(Signal::SIGTERM);
    set.add(Signal::SIGINT);
    // Reload, and upgrade (`ringmux upgrade`).
    set.add(Signal::SIGHUP);
    set.add(Signal::SIGUSR2);
    // Block first: between the two steps a signal then waits for the signalfd instead of
    // killing the process with the default action.
    // Blocked, a signal is queued for the signalfd even where its disposition is "ignore"
    // (as a shell starts background jobs with SIGINT, and nohup with SIGHUP): the kernel
    // discards an ignored signal only if it is not blocked. So the dispositions stay as they
    // came, and the workers inherit them as any program's children would.
    set.thread_block()?;
    Ok(SignalFd::with_flags(
        &set,
        SfdFlags::SFD_NONBLOCK | SfdFlags::SFD_CLOEXEC,
    )?)
}

/// The next pending signal of `fd`, if any.
pub fn read_signal(fd: &SignalFd) -> Option<i32> {
    fd.read_signal()
        .ok()
        .flatten()
        .map(|info| info.ssi_signo as i32)
}

/// A signalfd as a plain descriptor, for polling.
pub fn signal_fd(fd: &SignalFd) -> BorrowedFd<'_> {
    fd.as_fd()
}

/// Runs `f` again while it fails with `EINTR`.
fn retry<T>(mut f: impl FnMut() -> nix::Result<T>) -> io::Result<T> {
    loop {
        match f() {
            Err(Errno::EINTR) => continue,
            r => return r.map_err(io::Error::from),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packets_and_descriptors_cross_a_pair() {
        let (a, b) = seqpacket_pair().unwrap();
        let (x, _y) = seqpacket_pair().unwrap();
        send_with_fds(a.as_fd(), b"hello", &[x.as_fd()]).unwrap();
        // The demux never accepts descriptors: they are closed by the kernel, the data comes.
        let mut buf = [0u8; 16];
        assert_eq!(recv_packet(b.as_fd(), &mut buf).unwrap(), 5);
        assert_eq!(&buf[..5], b"hello");
        send_iov(a.as_fd(), &[IoSlice::new(b"ab"), IoSlice::new(b"cd")]).unwrap();
        assert_eq!(recv_packet(b.as_fd(), &mut buf).unwrap(), 4);
        assert_eq!(&buf[..4], b"abcd");
        assert_eq!(
            recv_packet(b.as_fd(), &mut buf).unwrap_err().kind(),
            io::ErrorKind::WouldBlock
        );
        assert!(!wait_readable(b.as_fd(), Duration::from_millis(1)).unwrap());
        drop(a);
        assert_eq!(
            poll_readable(&[b.as_fd()], Some(Duration::from_secs(5))).unwrap(),
            1
        );
        assert_eq!(recv_packet(b.as_fd(), &mut buf).unwrap(), 0);
        let e = send_packet(b.as_fd(), b"x").unwrap_err();
        assert!(is_disconnect(&e), "{e}");
    }

    /// nextest runs each test in a process of its own, so this changes nothing else.
    #[test]
    fn the_demux_is_made_non_dumpable_and_a_subreaper() {
        assert!(nix::sys::prctl::get_dumpable().unwrap());
        harden_demux().unwrap();
        assert!(!nix::sys::prctl::get_dumpable().unwrap());
        assert!(nix::sys::prctl::get_child_subreaper().unwrap());
    }

    #[test]
    fn parent_pid_is_read_past_any_command_name() {
        assert_eq!(parent_in_stat("42 (ringmux) S 7 42 42 0"), Some(7));
        assert_eq!(parent_in_stat("42 (a) b (c) R 9 1"), Some(9));
        assert_eq!(parent_in_stat("42 (x"), None);
        let mut child = Command::new("sleep").arg("30").spawn().unwrap();
        assert!(children().unwrap().contains(&child.id()));
        assert!(children_from_stat().unwrap().contains(&child.id()));
        kill_and_reap(child.id());
        // Reaped by kill_and_reap or not yet dead: wait settles it either way.
        let _ = child.wait();
        assert!(!children().unwrap().contains(&child.id()));
    }

    #[test]
    fn pidfd_becomes_readable_when_the_process_exits() {
        let mut child = Command::new("true").spawn().unwrap();
        let fd = pidfd_open(child.id()).unwrap();
        assert!(wait_readable(fd.as_fd(), Duration::from_secs(10)).unwrap());
        child.wait().unwrap();
    }

    #[test]
    fn received_packet_cmsgs_can_be_switched_off() {
        let s = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        for what in [RecvCmsg::Ipv4PacketInfo, RecvCmsg::Ipv4Tos] {
            switch_off(s.as_fd(), what).unwrap();
        }
        let s6 = std::net::UdpSocket::bind("[::1]:0").unwrap();
        for what in [RecvCmsg::Ipv6PacketInfo, RecvCmsg::Ipv6TrafficClass] {
            switch_off(s6.as_fd(), what).unwrap();
        }
    }
}
