//! Waiting: `poll(2)` on one descriptor or several, and the eventfd that wakes a waiting thread.

use std::io;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::time::Duration;

use nix::poll::{PollFd, PollFlags, PollTimeout};

use super::retry;

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
