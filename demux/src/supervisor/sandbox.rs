//! What a worker process may not do: the system-call filter (seccomp) the demux installs in each
//! worker's process between fork and exec, so that it binds whatever program `--worker-cmd`
//! names. It survives `execve` and is inherited by every thread; nothing the worker does can
//! remove it (`PR_SET_NO_NEW_PRIVS` is set with it, so no set-user-ID program regains rights).
//!
//! The filter allows by default and refuses, with `EPERM`, what would let one worker reach the
//! demux, a sibling or another instance's clients. Its rules name descriptors by number, so the
//! numbers they name (3, the control socket; 4, the worker's socket) are held to their objects
//! for the life of the process and every image it executes: nothing may free, renumber or
//! replace them, and no descriptor arrives after exec at all.
//!
//! | what | refused |
//! |---|---|
//! | signals | `kill`, `tgkill`, `rt_sigqueueinfo`, `rt_tgsigqueueinfo` to any process but the worker itself (so also process groups, `-1`, the demux); `tkill` (it names a bare thread ID); `pidfd_send_signal`; `fcntl` `F_SETOWN`/`F_SETOWN_EX`/`F_SETSIG` and `ioctl` `FIOSETOWN`/`SIOCSPGRP`/`FIOASYNC` (I/O signals sent to another process) |
//! | files' modes | `chmod`, `fchmod`, `fchmodat`, `fchmodat2`: the shared tables (the rate tables) are read-only for the demux's user, which a worker of that user owns; making one writable would let it reopen a sibling's table writable through `/proc/self/fd` |
//! | other processes | `ptrace`, `process_vm_readv`/`writev`, `pidfd_getfd`, `kcmp`, `perf_event_open`, `bpf`; `setpriority`, `ioprio_set`, `sched_setaffinity`/`setscheduler`/`setparam`/`setattr`, `prlimit64` on anyone but itself |
//! | its session and process group | `setsid`, `setpgid`: the demux starts it in a session of its own (so a group and a scheduler autogroup of its own) |
//! | new processes | `fork`, `vfork`, `clone` without `CLONE_THREAD` (threads are fine), `unshare`, `setns`; `clone3` answers `ENOSYS` (its flags are in memory, which a filter cannot read), so the C library falls back to `clone` |
//! | outliving the demux, being read | `prctl` outside an allow-list ([`PRCTLS_ALLOWED`]): above all `PR_SET_PDEATHSIG` with anything but SIGKILL (0 would disarm it), `PR_SET_DUMPABLE` 1, `PR_SET_PTRACER`, `PR_SET_CHILD_SUBREAPER` |
//! | its sending socket (descriptor 4; every mode but `reuseport`) | the worker's own socket in the public address's group, which never receives: receiving on it (`read`, `readv`, `pread64`, `preadv`, `preadv2`, `recvfrom`, `recvmsg`, `recvmmsg`, `splice`, `sendfile` from it), changing it (`setsockopt`, `connect`, `bind`, `listen`, `accept`, `shutdown`), duplicating it (`dup`, `dup2`/`dup3` from it, `fcntl` `F_DUPFD`/`F_DUPFD_CLOEXEC`). None of it could reach another worker's clients any more (the socket the demux receives on never leaves the demux); it stays refused as a second wall |
//! | the shared descriptors (5, 6: the HTTPS and plain-HTTP listeners, each when held, [`Shared`]) | everything on a listener but accepting: `shutdown`, `setsockopt`, `connect`, `bind`, duplicating it, its status flags (`fcntl` `F_SETFL`, `ioctl` `FIONBIO`: clearing `O_NONBLOCK` would block the others' accepts); like 3 and 4, they are held to their numbers. Nothing else a worker holds is shared: its standard output and error and its access log (7) are pipes of its own, read by the demux |
//! | freeing or renumbering 3 and 4 | `close`, `close_range` over them (with `CLOSE_RANGE_CLOEXEC` too), `dup2`/`dup3` onto them, `fcntl` `F_SETFD`, `ioctl` `FIOCLEX`/`FIONCLEX` on them: any of these and an `execve` would free the number for a socket of the worker's own |
//! | ways around that | receiving descriptors: `recvmsg` and `recvmmsg` on anything but a lane's own UDP socket (every descriptor a worker gets is in place before exec), so descriptor 4 passed to itself over `SCM_RIGHTS` never arrives; `ioctl` outside an allow-list ([`IOCTLS_ALLOWED`]: non-blocking mode, queue sizes, terminal and interface queries); `io_uring_*` and `io_setup`/`io_submit` (operations whose descriptor is in memory); `socket(AF_PACKET)` and `SOCK_RAW` (reading the wire) |
//! | the group | on any socket: `setsockopt` of `SO_REUSEPORT` (joining the group), `SO_ATTACH_REUSEPORT_CBPF`/`_EBPF`, `SO_DETACH_REUSEPORT_BPF` (replacing the program that steers every instance's datagrams), `SO_BINDTODEVICE`/`SO_BINDTOIFINDEX` (the kernel takes a socket bound to a device out of its group, as a better match for everything arriving on that device) |
//!
//! With `--forward reuseport` ([`WorkerFilter::compile`] with `own_socket`) descriptor 4 is the
//! worker's socket of its lane in the group, which receives that lane's datagrams: receiving on
//! it (`recvmsg`/`recvmmsg` too) and its options are the worker's. Still refused on it:
//! `connect` (a connected socket in the group would take a client's datagrams from whichever
//! worker owns them), `bind`, `listen`, `accept`, `shutdown`, and duplicating or replacing it.
//!
//! A worker keeps everything else: threads, files, TCP and UDP sockets of its own, `execve`
//! (the filter goes with it). The system calls are named for this build's architecture
//! (x86_64 or aarch64); on x86_64 the x32 numbering (`__X32_SYSCALL_BIT`), which would
//! otherwise reach the same kernel functions under other numbers, answers `ENOSYS`, and any
//! other architecture's calls (32-bit `int 0x80`) kill the process.
//!
//! The filter is compiled once, in the demux, with a placeholder for the worker's PID, which
//! only the child knows; [`SyscallFilter::bind_to`] writes it in after fork without allocating.

use std::collections::BTreeMap;

use seccompiler::{
    sock_filter, BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition,
    SeccompFilter, SeccompRule, TargetArch,
};

use crate::sys::SyscallFilter;

/// The descriptor at which every worker holds its sending socket.
pub const PUBLIC_FD: u64 = ringmux_proto::PUBLIC_FD as u64;

/// The descriptor of the listening TCP socket every worker shares (`--tcp on`).
pub const TCP_FD: u64 = ringmux_proto::TCP_FD as u64;
/// The descriptor of the listening socket for plain HTTP (`--redirect-http`).
pub const REDIRECT_FD: u64 = ringmux_proto::REDIRECT_FD as u64;

/// Which of the descriptors every worker shares with the others and the demux (5 and 6) a
/// worker holds. Only a descriptor held is named by the filter: otherwise its number is any
/// descriptor of the worker's own. (Descriptor 7, the access log, is a pipe of the worker's
/// own, as are its standard output and error: nothing it does to them reaches anyone else.)
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Shared {
    /// The HTTPS listener at 5 (`--tcp on`).
    pub tcp: bool,
    /// The plain-HTTP listener at 6 (`--redirect-http`).
    pub redirect: bool,
}

impl Shared {
    /// The listening sockets held.
    fn listeners(self) -> Vec<u64> {
        [(self.tcp, TCP_FD), (self.redirect, REDIRECT_FD)]
            .into_iter()
            .filter_map(|(held, fd)| held.then_some(fd))
            .collect()
    }

    /// Every shared descriptor held.
    fn fds(self) -> Vec<u64> {
        self.listeners()
    }
}

/// `ioctl` `FIONBIO`: non-blocking mode, allowed but on the shared listener.
const FIONBIO: u64 = 0x5421;

/// Stands for the worker's own PID in a compiled filter until [`SyscallFilter::bind_to`]
/// replaces it. Above the kernel's largest PID (`PID_MAX_LIMIT`, 2^22), so it matches no
/// process, and no other constant of the filter has this value (a test checks).
const SELF_PID: u32 = 0x7e57_0001;
const _: () = assert!(
    SELF_PID > 1 << 22,
    "the placeholder must exceed PID_MAX_LIMIT"
);

/// `ioctl` requests that set and clear close-on-exec: refused on the descriptors the rules name.
const FIOCLEX: u64 = 0x5451;
const FIONCLEX: u64 = 0x5450;

/// The `ioctl` requests a worker may make, and why (any other answers `EPERM`).
pub const IOCTLS_ALLOWED: &[(u64, &str)] = &[
    (
        FIONBIO,
        "FIONBIO: non-blocking mode (std, mio), but on the shared TCP listener",
    ),
    (0x541B, "FIONREAD / SIOCINQ: bytes waiting"),
    (0x5411, "TIOCOUTQ / SIOCOUTQ: bytes not yet sent"),
    (0x5401, "TCGETS: isatty"),
    (0x5413, "TIOCGWINSZ: terminal size"),
    (
        FIOCLEX,
        "FIOCLEX: close-on-exec, except on the descriptors the rules name",
    ),
    (FIONCLEX, "FIONCLEX: likewise"),
    (0x8906, "SIOCGSTAMP: a datagram's receive time"),
    (0x8907, "SIOCGSTAMPNS: likewise"),
    (0x8910, "SIOCGIFNAME: an interface's name"),
    (0x8912, "SIOCGIFCONF: the interfaces"),
    (0x8913, "SIOCGIFFLAGS: an interface's flags"),
    (0x8915, "SIOCGIFADDR: an interface's address"),
    (0x8921, "SIOCGIFMTU: an interface's MTU"),
    (
        0x8933,
        "SIOCGIFINDEX: an interface's index (if_nametoindex)",
    ),
];

/// The `prctl` options a worker may use, and why (any other answers `EPERM`).
/// `PR_SET_PDEATHSIG` and `PR_SET_DUMPABLE` only with the values the demux and the worker
/// library set (SIGKILL; 0), so the worker still dies with the demux and stays non-dumpable.
pub const PRCTLS_ALLOWED: &[(u64, &str)] = &[
    (1, "PR_SET_PDEATHSIG: SIGKILL only"),
    (2, "PR_GET_PDEATHSIG"),
    (3, "PR_GET_DUMPABLE"),
    (4, "PR_SET_DUMPABLE: 0 only"),
    (7, "PR_GET_KEEPCAPS"),
    (15, "PR_SET_NAME: thread names"),
    (16, "PR_GET_NAME"),
    (21, "PR_GET_SECCOMP"),
    (23, "PR_CAPBSET_READ"),
    (29, "PR_SET_TIMERSLACK: its own timers"),
    (30, "PR_GET_TIMERSLACK"),
    (38, "PR_SET_NO_NEW_PRIVS (already set)"),
    (39, "PR_GET_NO_NEW_PRIVS"),
    (40, "PR_GET_TID_ADDRESS"),
    (41, "PR_SET_THP_DISABLE: its own memory"),
    (42, "PR_GET_THP_DISABLE"),
    (
        47,
        "PR_CAP_AMBIENT: reading, or clearing (it has no capability to raise)",
    ),
    (0x5356_4d41, "PR_SET_VMA: names of its own mappings (glibc)"),
];
const PR_SET_PDEATHSIG: u64 = 1;
const PR_SET_DUMPABLE: u64 = 4;

/// A compiled worker filter: the system-call layer's [`SyscallFilter`], plain BPF that
/// `sys::prepare_worker` installs in the child without knowing what it refuses; what it
/// refuses is this module's ([`WorkerFilter::compile`]). Its programs: the refusals (`EPERM`),
/// then the `ENOSYS` answers for `clone3` and the x32 numbering.
pub type WorkerFilter = SyscallFilter;

/// The filter could not be built for this machine.
#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    #[error(
        "confining workers needs x86_64 or aarch64; this is {0}. Run with --sandbox off \
         (RINGMUX_SANDBOX=off) to start unconfined workers"
    )]
    Architecture(&'static str),
    /// The compiler's error is in the message, so not the error's `source`.
    #[error("compiling the worker's system-call filter: {0}")]
    Compile(seccompiler::BackendError),
}

impl From<seccompiler::BackendError> for SandboxError {
    fn from(e: seccompiler::BackendError) -> Self {
        SandboxError::Compile(e)
    }
}

impl WorkerFilter {
    /// Compiles the filter for the architecture this demux runs on. `own_socket`: descriptor
    /// 4 is the worker's own socket (`--forward reuseport`), not the demux's public socket.
    /// `shared`: which of the descriptors 5 to 7 every worker shares it holds.
    pub fn compile(own_socket: bool, shared: Shared) -> Result<Self, SandboxError> {
        let arch = match std::env::consts::ARCH {
            "x86_64" => TargetArch::x86_64,
            "aarch64" => TargetArch::aarch64,
            other => return Err(SandboxError::Architecture(other)),
        };
        let refusals = SeccompFilter::new(
            refusals(own_socket, shared)?,
            SeccompAction::Allow,
            SeccompAction::Errno(libc::EPERM as u32),
            arch,
        )?;
        Ok(SyscallFilter::new(
            vec![refusals.try_into()?, enosys_program()],
            SELF_PID,
        ))
    }
}

/// Argument `arg` (32 bits) compared with `value`.
fn arg32(arg: u8, op: SeccompCmpOp, value: u64) -> SeccompCondition {
    // Only fails for an argument index above 5; every call below names 0 to 2.
    SeccompCondition::new(arg, SeccompCmpArgLen::Dword, op, value).expect("argument 0 to 5")
}

/// A rule of conditions that must all hold.
fn all(conditions: Vec<SeccompCondition>) -> Result<SeccompRule, seccompiler::BackendError> {
    SeccompRule::new(conditions)
}

/// Refused whatever the arguments: a rule with no condition.
fn always() -> Vec<SeccompRule> {
    Vec::new()
}

/// Syscall number → rules (any rule matching refuses; no rule at all refuses always).
type Refusals = BTreeMap<i64, Vec<SeccompRule>>;

/// The descriptor numbers the rules protect.
struct Fds {
    /// The worker has a lane socket of its own (kernel steering) rather than an ingress.
    own_socket: bool,
    held: Shared,
    /// Nothing may duplicate, reconfigure or shut down these: 4, and those at 5 to 7 it holds
    /// (the listeners, whose file description, options and accept queue every worker shares,
    /// and the access log, whose file description and file every worker shares).
    shared: Vec<u64>,
    /// These stay what the demux made them for the life of the process and every image it
    /// executes: 3, 4 and the held ones.
    kept: Vec<u64>,
}

/// Every refusal of the filter, by what it protects.
fn refusals(own_socket: bool, held: Shared) -> Result<Refusals, seccompiler::BackendError> {
    let fds = Fds {
        own_socket,
        held,
        shared: std::iter::once(PUBLIC_FD).chain(held.fds()).collect(),
        kept: [ringmux_proto::CONTROL_FD as u64, PUBLIC_FD]
            .into_iter()
            .chain(held.fds())
            .collect(),
    };
    let mut r = Refusals::new();
    other_processes(&mut r)?;
    sockets(&mut r, &fds)?;
    descriptors(&mut r, &fds)?;
    process_settings(&mut r)?;
    Ok(r)
}

/// `arg` (32 bits) is not the caller's PID (0 stands for the caller where the call allows it).
fn not_self(arg: u8) -> SeccompCondition {
    arg32(arg, SeccompCmpOp::Ne, u64::from(SELF_PID))
}

/// Other processes: signals, tracing, scheduling and limits of anything but the worker
/// itself; new processes; the kernel interfaces a worker has no use for.
fn other_processes(r: &mut Refusals) -> Result<(), seccompiler::BackendError> {
    use SeccompCmpOp::{MaskedEq, Ne};
    let not_zero = |arg| arg32(arg, Ne, 0);
    // Signals: to the worker itself only. `kill(0)` (its process group) and `kill(-1)` are
    // "not self" too.
    r.insert(libc::SYS_kill, vec![all(vec![not_self(0)])?]);
    r.insert(libc::SYS_tgkill, vec![all(vec![not_self(0)])?]);
    r.insert(libc::SYS_rt_sigqueueinfo, vec![all(vec![not_self(0)])?]);
    r.insert(libc::SYS_rt_tgsigqueueinfo, vec![all(vec![not_self(0)])?]);
    for nr in [
        libc::SYS_tkill,
        libc::SYS_pidfd_send_signal,
        libc::SYS_pidfd_getfd,
        libc::SYS_ptrace,
        libc::SYS_process_vm_readv,
        libc::SYS_process_vm_writev,
        libc::SYS_kcmp,
        libc::SYS_perf_event_open,
        libc::SYS_bpf,
        libc::SYS_unshare,
        libc::SYS_setns,
        // Its session and process group are its own from the start (the demux's pre-exec
        // hook); joining the demux's or a sibling's group would put it in reach of the signals
        // sent to that group, and a new session would give it an autogroup again.
        libc::SYS_setsid,
        libc::SYS_setpgid,
        libc::SYS_io_uring_setup,
        libc::SYS_io_uring_enter,
        libc::SYS_io_uring_register,
        libc::SYS_io_setup,
        libc::SYS_io_submit,
        // Changing a file's mode: a worker of the demux's own user owns the shared tables the
        // demux hands it (the rate tables, read-only for that user), and making one writable
        // would let it reopen a sibling's table writable through /proc/self/fd.
        libc::SYS_fchmod,
        libc::SYS_fchmodat,
        libc::SYS_fchmodat2,
        #[cfg(target_arch = "x86_64")]
        libc::SYS_chmod,
        #[cfg(target_arch = "x86_64")]
        libc::SYS_fork,
        #[cfg(target_arch = "x86_64")]
        libc::SYS_vfork,
    ] {
        r.insert(nr, always());
    }
    // Scheduling and limits of other processes (a PID of 0 means the caller).
    for nr in [
        libc::SYS_sched_setaffinity,
        libc::SYS_sched_setscheduler,
        libc::SYS_sched_setparam,
        libc::SYS_sched_setattr,
        libc::SYS_prlimit64,
    ] {
        r.insert(nr, vec![all(vec![not_zero(0), not_self(0)])?]);
    }
    // setpriority(which, who) and ioprio_set(which, who): a process (which = 0, resp. 1), and
    // that process the caller.
    r.insert(
        libc::SYS_setpriority,
        vec![
            all(vec![arg32(0, Ne, libc::PRIO_PROCESS as u64)])?,
            all(vec![not_zero(1), not_self(1)])?,
        ],
    );
    const IOPRIO_WHO_PROCESS: u64 = 1;
    r.insert(
        libc::SYS_ioprio_set,
        vec![
            all(vec![arg32(0, Ne, IOPRIO_WHO_PROCESS)])?,
            all(vec![not_zero(1), not_self(1)])?,
        ],
    );
    // New processes: a clone that is not a thread of this process.
    r.insert(
        libc::SYS_clone,
        vec![all(vec![arg32(0, MaskedEq(libc::CLONE_THREAD as u64), 0)])?],
    );
    Ok(())
}

/// Sockets: none that reads the wire; on the public socket (or the lane's own) no receive,
/// change or copy; on every socket, no move within the public socket's group.
fn sockets(r: &mut Refusals, fds: &Fds) -> Result<(), seccompiler::BackendError> {
    use SeccompCmpOp::{Eq, MaskedEq, Ne};
    let own_socket = fds.own_socket;
    let on_public = |arg| arg32(arg, Eq, PUBLIC_FD);
    let listeners = fds.held.listeners();
    let shared = fds.shared.as_slice();
    // Sockets that would read the wire.
    const SOCK_TYPE_MASK: u64 = 0xf;
    r.insert(
        libc::SYS_socket,
        vec![
            all(vec![arg32(0, Eq, libc::AF_PACKET as u64)])?,
            all(vec![arg32(
                1,
                MaskedEq(SOCK_TYPE_MASK),
                libc::SOCK_RAW as u64,
            )])?,
        ],
    );
    // The public socket: receive, change, duplicate. A socket of its own (reuseport): change
    // its place in the group, duplicate.
    let receive: &[i64] = if own_socket {
        &[]
    } else {
        &[
            libc::SYS_read,
            libc::SYS_readv,
            libc::SYS_pread64,
            libc::SYS_preadv,
            libc::SYS_preadv2,
            libc::SYS_recvfrom,
            libc::SYS_splice,
        ]
    };
    for &nr in receive {
        r.insert(nr, vec![all(vec![on_public(0)])?]);
    }
    // setsockopt(fd, level, name): on the public socket anything; on any socket, joining a
    // reuseport group or changing its steering program (include/uapi/asm-generic/socket.h,
    // the same numbers on x86_64 and aarch64).
    // Binding a socket of the group to a device takes it out of the group (the kernel rehashes
    // it) as a better match than the group for datagrams arriving on that device: they would
    // all go to it.
    const SO_BINDTODEVICE: u64 = 25;
    const SO_BINDTOIFINDEX: u64 = 62;
    const SO_REUSEPORT: u64 = 15;
    const SO_ATTACH_REUSEPORT_CBPF: u64 = 51;
    const SO_ATTACH_REUSEPORT_EBPF: u64 = 52;
    const SO_DETACH_REUSEPORT_BPF: u64 = 68;
    let mut setsockopt = Vec::new();
    if !own_socket {
        setsockopt.push(all(vec![on_public(0)])?);
    }
    for &fd in &listeners {
        setsockopt.push(all(vec![arg32(0, Eq, fd)])?);
    }
    for name in [
        SO_BINDTODEVICE,
        SO_BINDTOIFINDEX,
        SO_REUSEPORT,
        SO_ATTACH_REUSEPORT_CBPF,
        SO_ATTACH_REUSEPORT_EBPF,
        SO_DETACH_REUSEPORT_BPF,
    ] {
        setsockopt.push(all(vec![
            arg32(1, Eq, libc::SOL_SOCKET as u64),
            arg32(2, Eq, name),
        ])?);
    }
    r.insert(libc::SYS_setsockopt, setsockopt);
    for nr in [
        libc::SYS_connect,
        libc::SYS_bind,
        libc::SYS_shutdown,
        libc::SYS_dup,
    ] {
        let rules = shared
            .iter()
            .map(|&fd| all(vec![arg32(0, Eq, fd)]))
            .collect::<Result<Vec<_>, _>>()?;
        r.insert(nr, rules);
    }
    for nr in [libc::SYS_accept, libc::SYS_accept4] {
        r.insert(nr, vec![all(vec![on_public(0)])?]);
    }
    // A worker listens nowhere: it serves what it accepts from the demux's listener.
    r.insert(libc::SYS_listen, always());
    // Descriptors arrive only with `recvmsg`/`recvmmsg` (SCM_RIGHTS), and none ever needs to:
    // the demux places every descriptor a worker gets before exec. So both are refused, but on
    // a lane's own UDP socket (kernel steering), which carries no descriptors, and a copy of
    // descriptor 4 sent over a socket pair of the worker's own never arrives under a new
    // number. Descriptors 3 and 4 stay what the demux made them for the life of the process
    // and every image it executes: they cannot be closed, replaced, or marked close-on-exec
    // (`fcntl`, `ioctl`, `close_range`, `dup3`), after which an `execve` would free the number
    // for a socket of the worker's own and every rule below would bind that socket instead.
    for nr in [libc::SYS_recvmsg, libc::SYS_recvmmsg] {
        let rules = if own_socket {
            vec![all(vec![arg32(0, Ne, PUBLIC_FD)])?]
        } else {
            always()
        };
        r.insert(nr, rules);
    }
    // sendfile(out, in): from the public socket.
    r.insert(libc::SYS_sendfile, vec![all(vec![on_public(1)])?]);
    Ok(())
}

/// Descriptors 3, 4 and the held ones: not closed, replaced, copied, re-flagged or cut short.
fn descriptors(r: &mut Refusals, fds: &Fds) -> Result<(), seccompiler::BackendError> {
    use SeccompCmpOp::{Eq, Ne};
    let (held, shared, kept) = (fds.held, fds.shared.as_slice(), fds.kept.as_slice());
    let mut close = Vec::new();
    let mut close_range = Vec::new();
    for &fd in kept {
        close.push(all(vec![arg32(0, Eq, fd)])?);
        close_range.push(all(vec![
            arg32(0, SeccompCmpOp::Le, fd),
            arg32(1, SeccompCmpOp::Ge, fd),
        ])?);
    }
    r.insert(libc::SYS_close, close);
    r.insert(libc::SYS_close_range, close_range);
    #[cfg(target_arch = "x86_64")]
    let dup2 = [libc::SYS_dup2, libc::SYS_dup3];
    #[cfg(not(target_arch = "x86_64"))]
    let dup2 = [libc::SYS_dup3];
    for nr in dup2 {
        let mut rules = shared
            .iter()
            .map(|&fd| all(vec![arg32(0, Eq, fd)]))
            .collect::<Result<Vec<_>, _>>()?;
        for &fd in kept {
            rules.push(all(vec![arg32(1, Eq, fd)])?);
        }
        r.insert(nr, rules);
    }
    // fcntl: duplicating or re-flagging descriptor 4; close-on-exec on 3; I/O signals to another
    // process (for any descriptor).
    // include/uapi/asm-generic/fcntl.h and sockios.h; the same on x86_64 and aarch64.
    const F_SETSIG: u64 = 10;
    const F_SETOWN_EX: u64 = 15;
    let mut fcntl = vec![
        all(vec![arg32(1, Eq, libc::F_SETOWN as u64)])?,
        all(vec![arg32(1, Eq, F_SETOWN_EX)])?,
        all(vec![arg32(1, Eq, F_SETSIG)])?,
    ];
    for &fd in shared {
        for cmd in [libc::F_DUPFD, libc::F_DUPFD_CLOEXEC] {
            fcntl.push(all(vec![arg32(0, Eq, fd), arg32(1, Eq, cmd as u64)])?);
        }
    }
    for fd in held.fds() {
        // Their status flags are every worker's and the demux's: clearing O_NONBLOCK would
        // make the others' accepts block, clearing O_APPEND the others' lines overwrite.
        fcntl.push(all(vec![
            arg32(0, Eq, fd),
            arg32(1, Eq, libc::F_SETFL as u64),
        ])?);
    }
    for &fd in kept {
        fcntl.push(all(vec![
            arg32(0, Eq, fd),
            arg32(1, Eq, libc::F_SETFD as u64),
        ])?);
    }
    r.insert(libc::SYS_fcntl, fcntl);
    // ioctl: an allow-list of requests (the command is 32 bits, as the kernel reads it), since
    // a request can do almost anything to a descriptor: `FIOCLEX` on descriptor 3 would free
    // its number across an `execve` for a socket of the worker's own, and `FIOASYNC`,
    // `FIOSETOWN`, `SIOCSPGRP` send I/O signals to other processes. What stays is what a
    // Rust runtime, its TLS and HTTP stacks and a terminal check ask (include/uapi/asm-generic/
    // ioctls.h and linux/sockios.h, the same numbers on x86_64 and aarch64).
    let mut ioctl = vec![all(IOCTLS_ALLOWED
        .iter()
        .map(|&(request, _)| arg32(1, Ne, request))
        .collect())?];
    for &fd in kept {
        for request in [FIOCLEX, FIONCLEX] {
            ioctl.push(all(vec![arg32(0, Eq, fd), arg32(1, Eq, request)])?);
        }
    }
    for fd in held.fds() {
        ioctl.push(all(vec![arg32(0, Eq, fd), arg32(1, Eq, FIONBIO)])?);
    }
    r.insert(libc::SYS_ioctl, ioctl);
    Ok(())
}

/// The worker's own process settings that protect it: an allow-list of `prctl` options.
fn process_settings(r: &mut Refusals) -> Result<(), seccompiler::BackendError> {
    use SeccompCmpOp::{Eq, Ne};
    // prctl: an allow-list of options. Above all `PR_SET_PDEATHSIG` with anything but SIGKILL
    // (0 disarms it: the worker would outlive a killed demux, holding its socket) and
    // `PR_SET_DUMPABLE` 1 (its memory open to any process of its user again).
    r.insert(
        libc::SYS_prctl,
        vec![
            all(PRCTLS_ALLOWED
                .iter()
                .map(|&(option, _)| arg32(0, Ne, option))
                .collect())?,
            all(vec![
                arg32(0, Eq, PR_SET_PDEATHSIG),
                arg32(1, Ne, libc::SIGKILL as u64),
            ])?,
            all(vec![arg32(0, Eq, PR_SET_DUMPABLE), arg32(1, Ne, 0)])?,
        ],
    );
    Ok(())
}

/// `clone3` → `ENOSYS` (glibc then uses `clone`, whose flags the refusals can read); on x86_64
/// every x32 system call → `ENOSYS`. The architecture itself is checked by the refusals'
/// program, installed first, which kills on a mismatch.
fn enosys_program() -> BpfProgram {
    use libc::{BPF_ABS, BPF_JEQ, BPF_JGE, BPF_JMP, BPF_K, BPF_LD, BPF_RET, BPF_W};
    let stmt = |code: u32, k: u32| sock_filter {
        code: code as u16,
        jt: 0,
        jf: 0,
        k,
    };
    let jump = |code: u32, k: u32, jt: u8, jf: u8| sock_filter {
        code: code as u16,
        jt,
        jf,
        k,
    };
    let enosys = libc::SECCOMP_RET_ERRNO | libc::ENOSYS as u32;
    // `struct seccomp_data`: `nr` at offset 0.
    let mut p = vec![stmt(BPF_LD | BPF_W | BPF_ABS, 0)];
    if cfg!(target_arch = "x86_64") {
        const X32_SYSCALL_BIT: u32 = 0x4000_0000;
        p.push(jump(BPF_JMP | BPF_JGE | BPF_K, X32_SYSCALL_BIT, 2, 0));
    }
    p.push(jump(
        BPF_JMP | BPF_JEQ | BPF_K,
        libc::SYS_clone3 as u32,
        1,
        0,
    ));
    p.push(stmt(BPF_RET | BPF_K, libc::SECCOMP_RET_ALLOW));
    p.push(stmt(BPF_RET | BPF_K, enosys));
    p
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_placeholder_is_no_other_constant_and_is_replaced() {
        for own_socket in [false, true] {
            for tcp in [false, true] {
                let shared = Shared { tcp, redirect: tcp };
                placeholder_replaced(own_socket, shared);
            }
        }
    }

    fn placeholder_replaced(own_socket: bool, shared: Shared) {
        let compiled = WorkerFilter::compile(own_socket, shared).unwrap();
        // Instructions that carry the placeholder: one per "not self" condition.
        let count = |f: &WorkerFilter, k| f.programs().flatten().filter(|i| i.k == k).count();
        let placeholders = count(&compiled, SELF_PID);
        // kill, tgkill, rt_sigqueueinfo, rt_tgsigqueueinfo, 5 scheduling calls,
        // setpriority, ioprio_set.
        assert_eq!(placeholders, 11);
        let mut bound = compiled.clone();
        bound.bind_to(4242);
        assert_eq!(count(&bound, SELF_PID), 0);
        assert!(count(&bound, 4242) >= placeholders);
        // Nothing else changed.
        let same = compiled
            .programs()
            .flatten()
            .zip(bound.programs().flatten())
            .filter(|(a, b)| a != b)
            .count();
        assert_eq!(same, placeholders);
    }
}
