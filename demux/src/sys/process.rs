//! Processes: pinning to a CPU, the demux's children (found in `/proc`), killing and reaping
//! them, and pidfds.

use std::io;
use std::os::fd::OwnedFd;

use nix::errno::Errno;
use nix::sys::signal::Signal;

/// Pins the calling thread to CPU `cpu`.
pub fn pin_to_cpu(cpu: usize) -> io::Result<()> {
    let mut set = nix::sched::CpuSet::new();
    set.set(cpu)?;
    nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set)?;
    Ok(())
}

/// Sets the calling thread's timer slack to `slack` (`PR_SET_TIMERSLACK`): how much later than
/// asked the kernel may end its sleeps, to fire them with other timers. The default, 50 µs,
/// would stretch a receive-coalescing window of 250 µs by a fifth.
pub fn set_timer_slack(slack: std::time::Duration) -> io::Result<()> {
    let ns =
        nix::libc::c_ulong::try_from(slack.as_nanos().max(1)).unwrap_or(nix::libc::c_ulong::MAX);
    nix::sys::prctl::set_timerslack(ns)?;
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

#[cfg(test)]
mod tests {
    use std::os::fd::AsFd;
    use std::process::Command;
    use std::time::Duration;

    use super::*;
    use crate::sys::wait_readable;

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
}
