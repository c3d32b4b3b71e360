//! Files and pipes: the sealed memfd of a worker's site table, the pipes of the workers' output
//! and access logs, writes to the demux's standard error, and the ACME state directory's file
//! locks (`acme::store`).

use std::io;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::time::Duration;

use nix::errno::Errno;

use super::wait_writable;

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
