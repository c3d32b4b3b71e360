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

/// A Landlock ruleset (Linux 5.13) from which every worker enters a domain of its own between
/// fork and exec ([`WorkerSetup::domain`](super::WorkerSetup::domain)). Landlock lets a
/// process inside a domain trace, and so open the memory of (`/proc/PID/mem`), only processes
/// in the same domain or one nested in it (the kernel's `security/landlock/task.c`): a worker
/// can reach neither a sibling, each in its own domain, nor the demux, in none, from its first
/// instruction on, whatever users they run as and whether or not they are dumpable yet. Where
/// the kernel has Landlock ABI 6 (Linux 6.12), the domain is also scoped for signals and
/// abstract Unix sockets: nothing outside it can be signalled or connected to that way.
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
