//! Starting a worker: what the demux arranges in the worker's process between fork and exec
//! (its descriptors at their fixed numbers, its session, its parent-death signal, its
//! confinement). The unsafe of the demux's system calls lives here: the pre-exec hook and the
//! two raw calls no safe wrapper offers in a forked child.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::process::Command;

use nix::errno::Errno;
use nix::sys::signal::{SigSet, Signal};

use super::confine::{drop_all_capabilities, enter_domain};
use super::{pin_to_cpu, SyscallFilter, WorkerDomain};

/// What the demux arranges in a worker's process between fork and exec.
pub struct WorkerSetup<'a> {
    /// The worker's end of its control socket: descriptor 3.
    pub control: BorrowedFd<'a>,
    /// The worker's sending socket (its lane's socket under kernel steering): descriptor 4.
    pub public: BorrowedFd<'a>,
    /// The hand-off's descriptors, placed at `ringmux_proto::FIRST_HANDOFF_FD` and on, in order.
    pub handoff: &'a [BorrowedFd<'a>],
    /// The rate tables, placed at `ringmux_proto::RATE_TABLES_FD` and on, in order.
    pub rate_tables: &'a [BorrowedFd<'a>],
    /// The health table, placed at `ringmux_proto::HEALTH_TABLE_FD`.
    pub health: Option<BorrowedFd<'a>>,
    /// The listening TCP socket every worker shares (`--tcp on`): descriptor 5.
    pub tcp: Option<BorrowedFd<'a>>,
    /// The listening socket for plain HTTP (`--redirect-http`): descriptor 6.
    pub redirect: Option<BorrowedFd<'a>>,
    /// The access log (`--access-log`): descriptor 7.
    pub access_log: Option<BorrowedFd<'a>>,
    /// The CPU to pin the process to.
    pub cpu: Option<usize>,
    /// The system-call filter to install last; `None` with `--sandbox off`.
    pub filter: Option<SyscallFilter>,
    /// Empty every capability set of the worker (ambient, inheritable, permitted, effective):
    /// a worker may hold none, whatever ringmux holds (a unit's `AmbientCapabilities=`
    /// would otherwise pass on to every worker).
    pub drop_capabilities: bool,
    /// Empty its bounding set too: for a worker that keeps the demux's user ID 0 (no user
    /// switch, which would have taken `CAP_SETPCAP` with every other capability), where the
    /// demux holds `CAP_SETPCAP`.
    pub drop_bounding_set: bool,
    /// The worker runs as another user (`Command::uid`): check, before anything else, that it
    /// kept no supplementary group of ringmux's (std empties them with `setgroups` as it
    /// switches, and lets a refusal pass silently).
    pub switched_user: bool,
    /// The Landlock ruleset ([`worker_domain`](super::worker_domain)) the worker enters, in a
    /// domain of its own, just before the filter; `None` with `--sandbox off` or where the
    /// kernel has no Landlock.
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
/// is armed after it, and the worker must have been left no supplementary group.
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
    if setup.rate_tables.len() > ringmux_proto::MAX_RATE_TABLES {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "more rate tables than the protocol's MAX_RATE_TABLES",
        ));
    }
    // Copies above every number they are placed at, so placing one never closes another's
    // copy.
    let above = ringmux_proto::RATE_TABLES_FD + ringmux_proto::MAX_RATE_TABLES as RawFd;
    let mut tables: [Option<OwnedFd>; ringmux_proto::MAX_RATE_TABLES] =
        std::array::from_fn(|_| None);
    for (slot, fd) in tables.iter_mut().zip(setup.rate_tables) {
        *slot = Some(rustix::io::fcntl_dupfd_cloexec(fd, above)?);
    }
    // Above every number anything is placed at, the health table's own included.
    let health = setup
        .health
        .map(|fd| rustix::io::fcntl_dupfd_cloexec(fd, ringmux_proto::HEALTH_TABLE_FD + 1))
        .transpose()?;
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
    let switched_user = setup.switched_user;
    // Each fork runs the hook on its own copy of this memory: taking the ruleset out in one
    // child leaves it in the parent for the next spawn.
    let mut domain = setup.domain.map(WorkerDomain::copy).transpose()?;
    let mut filter = setup.filter;
    let parent = nix::unistd::getpid();
    // Runs in the child between fork and exec: only async-signal-safe calls (sched_setaffinity,
    // dup2, close_range, fcntl, setsid, prctl, sigprocmask, getpid, landlock_restrict_self, seccomp) on
    // descriptors, a mask and a filter owned by the child, and no allocation.
    let setup = move || -> io::Result<()> {
        if switched_user && supplementary_groups() != 0 {
            return Err(io::Error::from(Errno::EPERM));
        }
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
        for (number, fd) in (ringmux_proto::RATE_TABLES_FD..).zip(tables.iter().flatten()) {
            dup_onto(fd.as_fd(), number)?;
        }
        if let Some(fd) = &health {
            dup_onto(fd.as_fd(), ringmux_proto::HEALTH_TABLE_FD)?;
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
            filter.install()?;
        }
        Ok(())
    };
    // SAFETY: `setup` makes only async-signal-safe calls and allocates nothing, as a pre-exec
    // hook must (it runs in the forked child of a multi-threaded process).
    unsafe { cmd.pre_exec(setup) };
    Ok(())
}

/// How many supplementary groups the calling process has (`getgroups` with an empty list;
/// -1 if it fails). Async-signal-safe, for the pre-exec hook.
fn supplementary_groups() -> libc::c_int {
    // SAFETY: with a size of 0, getgroups writes nothing through the (null) list; it only
    // counts.
    unsafe { libc::getgroups(0, std::ptr::null_mut()) }
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
