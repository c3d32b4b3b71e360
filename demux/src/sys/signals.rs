//! Signals: the demux's shutdown, reload and upgrade signals, read from a signalfd.

use std::io;
use std::os::fd::{AsFd, BorrowedFd};

use nix::sys::signal::{SigSet, Signal};
use nix::sys::signalfd::{SfdFlags, SignalFd};

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
