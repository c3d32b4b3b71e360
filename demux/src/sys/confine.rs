//! Confinement: the system-call filter and the Landlock domain a worker enters before exec, its
//! capabilities dropped, and the demux's own hardening (`prctl`).

use std::io;
use std::os::fd::OwnedFd;

use nix::errno::Errno;
use seccompiler::{sock_filter, BpfProgram};

/// A system-call filter (seccomp) compiled for a worker's process: classic BPF programs to
/// install in order, last of all before exec
/// ([`WorkerSetup::filter`](super::WorkerSetup::filter)). One constant in them, above any PID,
/// stands for the worker's own PID, which only the child knows: the child writes it in
/// ([`SyscallFilter::bind_to`]) without allocating. What the programs refuse is decided above
/// this module (`supervisor::sandbox` compiles them); this type only carries them to the child
/// and installs them there.
#[derive(Clone, Debug)]
pub struct SyscallFilter {
    programs: Vec<BpfProgram>,
    /// The placeholder for the worker's PID.
    self_pid: u32,
}

impl SyscallFilter {
    /// `programs`, in the order they are to be installed, in which every instruction whose
    /// constant is `self_pid` stands for the worker's own PID.
    pub fn new(programs: Vec<BpfProgram>, self_pid: u32) -> Self {
        SyscallFilter { programs, self_pid }
    }

    /// Writes the worker's own PID into the filter. Runs in the forked child (no allocation,
    /// no lock): call it once, with the child's PID, before installing.
    pub fn bind_to(&mut self, pid: u32) {
        for insn in self.programs.iter_mut().flatten() {
            if insn.k == self.self_pid {
                insn.k = pid;
            }
        }
    }

    /// The programs to install, in order.
    pub fn programs(&self) -> impl Iterator<Item = &[sock_filter]> {
        self.programs.iter().map(Vec::as_slice)
    }

    /// Binds the filter to the calling process and installs every program, in order
    /// (`PR_SET_NO_NEW_PRIVS` with the first). Async-signal-safe, for the pre-exec hook: bare
    /// system calls, and the errors it passes on carry only the OS error.
    pub(super) fn install(&mut self) -> io::Result<()> {
        let pid = nix::unistd::getpid().as_raw() as u32;
        self.bind_to(pid);
        for program in self.programs() {
            match seccompiler::apply_filter(program) {
                Ok(()) => {}
                // Both carry the OS error, which needs no allocation to pass on.
                Err(seccompiler::Error::Prctl(e) | seccompiler::Error::Seccomp(e)) => {
                    return Err(e)
                }
                Err(_) => return Err(io::Error::from(Errno::EINVAL)),
            }
        }
        Ok(())
    }
}

/// What a worker may reach of the file system, beneath each path (a folder and everything in
/// it, or a file): the allow-list of its Landlock domain ([`worker_domain`]). Nothing else is
/// granted: a path in none of the lists can be neither read, written, executed, created,
/// removed nor renamed into or out of by the worker. (Landlock checks a path when it is
/// opened: descriptors the worker is handed, its pipes, sockets and memfds, are not paths.)
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FsAccess {
    /// Read and execute: the program, its loader and shared libraries, `worker_read`.
    pub run: Vec<std::path::PathBuf>,
    /// Read only: the site roots and the few system files the worker's libraries read.
    pub read: Vec<std::path::PathBuf>,
    /// Every right (read, write, truncate, create, remove, rename): `worker_write`.
    pub write: Vec<std::path::PathBuf>,
}

/// The file-system rights a Landlock ABI older than this kernel's leaves unhandled, and so
/// granted everywhere ([`landlock_gaps`]).
const GAPS: [(u8, &str); 5] = [
    (
        2,
        "renaming or linking a file into another folder (ABI 2, Linux 5.19; before it, \
         always refused)",
    ),
    (3, "truncating a file (ABI 3, Linux 6.2)"),
    (5, "ioctl on a device file (ABI 5, Linux 6.10)"),
    (
        6,
        "the signal and abstract-socket scopes (ABI 6, Linux 6.12): a worker may signal or \
         connect to an abstract Unix socket outside its domain, within what the system-call \
         filter allows",
    ),
    (
        9,
        "connecting to a Unix socket by its path (ABI 9, Linux 7.1): file permissions alone \
         keep a worker from ringmux's control socket",
    ),
];

/// Which Landlock ABI this kernel has, as far as the allow-list uses it: `None` without
/// Landlock (not built, or not enabled at boot), else the newest of the ABIs that bring
/// file-system rights or scopes (1, 2, 3, 5, 6, 9) whose every right and scope it knows (a
/// kernel of ABI 7 or 8 says 6: they add neither). Probed by asking for each ABI's rights as a
/// hard requirement (a ruleset made and dropped per ABI): no raw system call here.
pub fn landlock_abi() -> Option<u8> {
    use landlock::{Access, AccessFs, CompatLevel, Compatible, Ruleset, RulesetAttr, Scope, ABI};
    let supports = |abi: ABI| {
        let ruleset = Ruleset::default()
            .set_compatibility(CompatLevel::HardRequirement)
            .handle_access(AccessFs::from_all(abi));
        let ruleset = match abi >= ABI::V6 {
            true => ruleset.and_then(|r| r.scope(Scope::from_all(abi))),
            false => ruleset,
        };
        ruleset.and_then(|r| r.create()).is_ok()
    };
    let mut found = None;
    for (level, abi) in [
        (1, ABI::V1),
        (2, ABI::V2),
        (3, ABI::V3),
        (5, ABI::V5),
        (6, ABI::V6),
        (9, ABI::V9),
    ] {
        if !supports(abi) {
            break;
        }
        found = Some(level);
    }
    found
}

/// What the workers' domains leave unhandled with Landlock ABI `abi` (from
/// [`landlock_abi`]): each a right or scope that older ABIs do not know, described for the
/// log.
pub fn landlock_gaps(abi: u8) -> impl Iterator<Item = &'static str> {
    GAPS.into_iter()
        .filter(move |(since, _)| abi < *since)
        .map(|(_, what)| what)
}

/// A Landlock ruleset (Linux 5.13) from which every worker enters a domain of its own between
/// fork and exec ([`WorkerSetup::domain`](super::WorkerSetup::domain)).
///
/// The file system is an allow-list: the ruleset handles every file-system access right the
/// kernel's ABI knows (reading files and listing folders, executing, writing, truncating,
/// creating and removing each kind of file, renaming or linking across folders, device
/// ioctls) and grants them only beneath the paths of `access`. So a worker reads its program,
/// libraries and site roots and nothing else (no key, no configuration, no ACME state, no
/// other process's `/proc` files), and writes nowhere but `access.write`, whatever user it
/// runs as. Best effort: an older ABI enforces what it knows ([`landlock_gaps`] says what
/// is left).
///
/// Landlock also lets a process inside a domain trace, and so open the memory of
/// (`/proc/PID/mem`), only processes in the same domain or one nested in it (the kernel's
/// `security/landlock/task.c`): a worker can reach neither a sibling, each in its own domain,
/// nor the demux, in none, from its first instruction on, whatever users they run as and
/// whether or not they are dumpable yet. Where the kernel has Landlock ABI 6 (Linux 6.12),
/// the domain is also scoped for signals and abstract Unix sockets: nothing outside it can be
/// signalled or connected to that way.
///
/// A path of `access` that cannot be opened fails with its name. `Ok(None)`: this kernel has
/// no Landlock.
pub fn worker_domain(access: &FsAccess) -> io::Result<Option<WorkerDomain>> {
    use landlock::{
        Access, AccessFs, PathBeneath, PathFd, Ruleset, RulesetAttr, RulesetCreatedAttr, Scope, ABI,
    };
    // The newest ABI the crate knows, best effort: the crate keeps what the kernel knows.
    let all = AccessFs::from_all(ABI::V10);
    let run = AccessFs::from_read(ABI::V10);
    let read = AccessFs::ReadFile | AccessFs::ReadDir;
    let mut ruleset = Ruleset::default()
        .handle_access(all)
        .and_then(|r| r.scope(Scope::AbstractUnixSocket | Scope::Signal))
        .and_then(|r| r.create())
        .map_err(io::Error::other)?;
    let lists = [
        (&access.run, run),
        (&access.read, read),
        (&access.write, all),
    ];
    for (paths, rights) in lists {
        for path in paths {
            let fd = PathFd::new(path).map_err(|e| {
                io::Error::other(format!(
                    "{}: cannot open it for the workers' Landlock rules: {e}",
                    path.display()
                ))
            })?;
            // On a file, the crate keeps the rights a file can have (best effort).
            ruleset = ruleset
                .add_rule(PathBeneath::new(fd, rights))
                .map_err(io::Error::other)?;
        }
    }
    // A ruleset holds a descriptor only where the kernel made one: with Landlock.
    let probe: Option<OwnedFd> = ruleset.try_clone()?.into();
    Ok(probe.map(|_| WorkerDomain(ruleset)))
}

/// The workers' Landlock ruleset ([`worker_domain`]); each spawn takes a copy of it.
pub struct WorkerDomain(landlock::RulesetCreated);

impl WorkerDomain {
    /// A copy for one worker's pre-exec hook (the same ruleset, another descriptor).
    pub(super) fn copy(&self) -> io::Result<landlock::RulesetCreated> {
        self.0.try_clone()
    }
}

/// Enters a new Landlock domain made of `ruleset` (after `PR_SET_NO_NEW_PRIVS`, which it sets).
/// Async-signal-safe, for the pre-exec hook: two bare system calls, and the errors it passes on
/// carry only the OS error, which needs no allocation.
pub(super) fn enter_domain(ruleset: landlock::RulesetCreated) -> io::Result<()> {
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
pub(super) fn drop_all_capabilities(bounding: bool) -> io::Result<()> {
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

/// Whether this process holds `CAP_SETPCAP` (may empty a child's bounding set).
pub fn may_drop_bounding_set() -> bool {
    rustix::thread::capabilities(None)
        .is_ok_and(|c| c.effective.contains(rustix::thread::CapabilitySet::SETPCAP))
}

/// Whether this process can start workers as another user: it holds `CAP_SETUID` and
/// `CAP_SETGID` in its effective set, as root or not (a unit's `AmbientCapabilities=`).
/// Switching, the child also empties its supplementary groups (`CAP_SETGID`), and a
/// worker that was not root keeps the capabilities across the switch: the pre-exec hook
/// drops every one of them.
pub fn may_switch_user() -> bool {
    use rustix::thread::CapabilitySet;
    rustix::thread::capabilities(None).is_ok_and(|c| {
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

#[cfg(test)]
mod tests {
    use super::*;

    /// nextest runs each test in a process of its own, so this changes nothing else.
    #[test]
    fn the_demux_is_made_non_dumpable_and_a_subreaper() {
        assert!(nix::sys::prctl::get_dumpable().unwrap());
        harden_demux().unwrap();
        assert!(!nix::sys::prctl::get_dumpable().unwrap());
        assert!(nix::sys::prctl::get_child_subreaper().unwrap());
    }
}
