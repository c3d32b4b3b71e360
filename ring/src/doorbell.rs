//! The doorbell: an eventfd (`EFD_NONBLOCK | EFD_CLOEXEC`) the producer writes when the consumer
//! announced a sleep (`ring.rs`, `SYNC: doorbell`). The counter coalesces rings: one read clears
//! any number of them.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::time::Duration;

/// An eventfd shared by one producer and one consumer.
#[derive(Debug)]
pub struct Doorbell {
    fd: OwnedFd,
}

impl Doorbell {
    /// A new eventfd with a zero counter.
    pub fn new() -> io::Result<Self> {
        // SAFETY: plain syscall; the result is checked before use.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` is a fresh descriptor we own.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(Doorbell { fd })
    }

    /// Wraps a descriptor received from the producer. It is checked to be an eventfd by the first
    /// read; a wrong descriptor makes [`Doorbell::wait`] fail, never block forever.
    pub fn from_fd(fd: OwnedFd) -> Self {
        Doorbell { fd }
    }

    /// Adds one to the counter, waking a sleeper. `EAGAIN` (counter saturated: nobody has read it
    /// for 2^64 rings) means a wake-up is already pending, so it is not an error.
    pub fn ring(&self) -> io::Result<()> {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a valid u64 to our descriptor.
        let n = unsafe { libc::write(self.fd.as_raw_fd(), (&one as *const u64).cast(), 8) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::WouldBlock {
                return Err(e);
            }
        }
        Ok(())
    }

    /// Takes the eventfd back after its consumer is gone: sets `O_NONBLOCK` again (a consumer
    /// shares the file description and may have cleared it) and clears the counter (it may
    /// have filled it, which makes a write block once `O_NONBLOCK` is off). Returns how many
    /// rings the counter held. Call it only when no other process holds the eventfd any more:
    /// otherwise it can undo both at once again.
    pub fn reclaim(&self) -> io::Result<u64> {
        let fd = self.fd.as_raw_fd();
        // SAFETY: fcntl on our own descriptor.
        let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
        if flags < 0 {
            return Err(io::Error::last_os_error());
        }
        if flags & libc::O_NONBLOCK == 0 {
            // SAFETY: as above.
            if unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
                return Err(io::Error::last_os_error());
            }
        }
        self.clear()
    }

    /// Reads and clears the counter; returns how many rings it held (0 if none).
    pub fn clear(&self) -> io::Result<u64> {
        let mut v: u64 = 0;
        // SAFETY: reads 8 bytes into a valid u64 from our descriptor.
        let n = unsafe { libc::read(self.fd.as_raw_fd(), (&mut v as *mut u64).cast(), 8) };
        if n < 0 {
            let e = io::Error::last_os_error();
            return if e.kind() == io::ErrorKind::WouldBlock {
                Ok(0)
            } else {
                Err(e)
            };
        }
        Ok(v)
    }

    /// Blocks until the counter is non-zero or `timeout` passes (None: forever), then clears it.
    /// Returns whether it was rung.
    pub fn wait(&self, timeout: Option<Duration>) -> io::Result<bool> {
        use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
        let timeout = timeout.map_or(PollTimeout::NONE, |t| {
            PollTimeout::try_from(t).unwrap_or(PollTimeout::MAX)
        });
        loop {
            let mut pfd = [PollFd::new(self.fd.as_fd(), PollFlags::POLLIN)];
            match poll(&mut pfd, timeout) {
                Err(nix::errno::Errno::EINTR) => continue,
                Err(e) => return Err(e.into()),
                Ok(0) => return Ok(false),
                Ok(_) => {}
            }
            return Ok(self.clear()? > 0);
        }
    }
}

impl From<Doorbell> for OwnedFd {
    fn from(d: Doorbell) -> OwnedFd {
        d.fd
    }
}

impl AsFd for Doorbell {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}
