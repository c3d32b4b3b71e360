//! The doorbell: an eventfd (`EFD_NONBLOCK | EFD_CLOEXEC`) the producer writes when the consumer
//! announced a sleep (`ring.rs`, `SYNC: doorbell`). The counter coalesces rings: one read clears
//! any number of them.

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::time::Duration;

use nix::errno::Errno;
use nix::fcntl::{fcntl, FcntlArg, OFlag};
use nix::sys::eventfd::{EfdFlags, EventFd};

/// An eventfd shared by one producer and one consumer.
#[derive(Debug)]
pub struct Doorbell {
    fd: OwnedFd,
}

impl Doorbell {
    /// A new eventfd with a zero counter.
    pub fn new() -> io::Result<Self> {
        let fd = EventFd::from_value_and_flags(0, EfdFlags::EFD_NONBLOCK | EfdFlags::EFD_CLOEXEC)?;
        Ok(Doorbell { fd: fd.into() })
    }

    /// Wraps a descriptor received from the producer. It is checked to be an eventfd by the first
    /// read; a wrong descriptor makes [`Doorbell::wait`] fail, never block forever.
    pub fn from_fd(fd: OwnedFd) -> Self {
        Doorbell { fd }
    }

    /// Adds one to the counter, waking a sleeper. `EAGAIN` (counter saturated: nobody has read it
    /// for 2^64 rings) means a wake-up is already pending, so it is not an error.
    ///
    /// One `write(2)` of 8 bytes and nothing else: it runs on the producer's data path.
    #[inline]
    pub fn ring(&self) -> io::Result<()> {
        match nix::unistd::write(&self.fd, &1u64.to_ne_bytes()) {
            Ok(_) | Err(Errno::EAGAIN) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// Takes the eventfd back after its consumer is gone: sets `O_NONBLOCK` again (a consumer
    /// shares the file description and may have cleared it) and clears the counter (it may
    /// have filled it, which makes a write block once `O_NONBLOCK` is off). Returns how many
    /// rings the counter held. Call it only when no other process holds the eventfd any more:
    /// otherwise it can undo both at once again.
    pub fn reclaim(&self) -> io::Result<u64> {
        let flags = OFlag::from_bits_retain(fcntl(&self.fd, FcntlArg::F_GETFL)?);
        if !flags.contains(OFlag::O_NONBLOCK) {
            fcntl(&self.fd, FcntlArg::F_SETFL(flags | OFlag::O_NONBLOCK))?;
        }
        self.clear()
    }

    /// Reads and clears the counter; returns how many rings it held (0 if none).
    ///
    /// One `read(2)` of 8 bytes and nothing else: it runs on the consumer's wake-up path.
    #[inline]
    pub fn clear(&self) -> io::Result<u64> {
        let mut v = [0u8; 8];
        match nix::unistd::read(&self.fd, &mut v) {
            Ok(_) => Ok(u64::from_ne_bytes(v)),
            Err(Errno::EAGAIN) => Ok(0),
            Err(e) => Err(e.into()),
        }
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
