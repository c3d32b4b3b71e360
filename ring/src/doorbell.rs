//! The doorbell: a pipe the producer writes one byte into when the consumer announced a sleep
//! (`ring.rs`, `SYNC: doorbell`); the consumer sleeps until its end is readable.
//!
//! Why a pipe and not an eventfd: an eventfd is one file description shared by both sides, so a
//! consumer could fill its counter and clear `O_NONBLOCK` on it, and the producer's next write
//! would block. A pipe's two ends are two file descriptions. The producer keeps the write end,
//! non-blocking on a description the consumer never receives; the consumer gets only the read
//! end, and whatever it does to that (clear `O_NONBLOCK`, never read, close it) cannot make a
//! write block: a full pipe answers `EAGAIN`, which means a wake-up is already pending.
//! Each consumer generation gets a fresh pipe ([`crate::Producer::reset`]), so an old consumer
//! (or anything it forked) keeps no way to the new one's doorbell.

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::time::Duration;

use nix::errno::Errno;
use nix::fcntl::OFlag;

/// The producer's doorbell: the pipe's write end, and its read end until it is handed out.
#[derive(Debug)]
pub struct Doorbell {
    tx: OwnedFd,
    rx: OwnedFd,
}

impl Doorbell {
    /// A new, empty pipe, both ends `O_NONBLOCK | O_CLOEXEC`.
    pub fn new() -> io::Result<Self> {
        let (rx, tx) = nix::unistd::pipe2(OFlag::O_NONBLOCK | OFlag::O_CLOEXEC)?;
        Ok(Doorbell { tx, rx })
    }

    /// A doorbell from the two ends of an existing pipe (a producer taken over by a new
    /// process image of the demux): both are made non-blocking and close-on-exec again, and the
    /// pair is checked to be one pipe.
    pub fn from_fds(rx: OwnedFd, tx: OwnedFd) -> io::Result<Self> {
        use nix::fcntl::{fcntl, FcntlArg, FdFlag};
        use nix::sys::stat::fstat;
        for fd in [&rx, &tx] {
            fcntl(fd, FcntlArg::F_SETFL(OFlag::O_NONBLOCK))?;
            fcntl(fd, FcntlArg::F_SETFD(FdFlag::FD_CLOEXEC))?;
        }
        let (r, t) = (fstat(&rx)?, fstat(&tx)?);
        let fifo = |m: nix::libc::mode_t| m & nix::libc::S_IFMT == nix::libc::S_IFIFO;
        if !fifo(r.st_mode) || !fifo(t.st_mode) || r.st_ino != t.st_ino || r.st_dev != t.st_dev {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "the doorbell descriptors are not the two ends of one pipe",
            ));
        }
        Ok(Doorbell { tx, rx })
    }

    /// The write end (the producer's own), for a hand-over to a new process image.
    pub fn producer_end(&self) -> BorrowedFd<'_> {
        self.tx.as_fd()
    }

    /// Wakes the consumer. `EAGAIN` (the pipe is full: the consumer has not read 64 KiB of
    /// rings) means a wake-up is already pending, so it is not an error.
    ///
    /// One `write(2)` of one byte and nothing else: it runs on the producer's data path.
    #[inline]
    pub fn ring(&self) -> io::Result<()> {
        match nix::unistd::write(&self.tx, &[1]) {
            Ok(_) | Err(Errno::EAGAIN) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// The read end, to hand to the consumer (it is duplicated into the consumer's process).
    pub fn consumer_end(&self) -> BorrowedFd<'_> {
        self.rx.as_fd()
    }
}

/// The consumer's doorbell: the pipe's read end.
#[derive(Debug)]
pub struct DoorbellReader {
    fd: OwnedFd,
}

/// Bytes [`DoorbellReader::clear`] reads at most: any number of pending rings is one wake-up, so
/// a bounded read is enough; a pipe left non-empty only makes the next sleep end at once.
const CLEAR_BYTES: usize = 256;

impl DoorbellReader {
    /// Wraps a descriptor received from the producer. A wrong descriptor makes
    /// [`DoorbellReader::rung`] fail, never block forever.
    pub fn from_fd(fd: OwnedFd) -> Self {
        DoorbellReader { fd }
    }

    /// Reads pending rings (at most 256); returns how many it read (0 if none).
    ///
    /// One `read(2)` and nothing else: the consumer calls it before each sleep announcement.
    #[inline]
    pub fn clear(&self) -> io::Result<u64> {
        let mut v = [0u8; CLEAR_BYTES];
        match nix::unistd::read(&self.fd, &mut v) {
            Ok(n) => Ok(n as u64),
            Err(Errno::EAGAIN) => Ok(0),
            Err(e) => Err(e.into()),
        }
    }

    /// Blocks until rung or until `timeout` passes (None: forever), without clearing: whether
    /// it is rung (readable). A closed write end (the producer is gone) ends the wait too.
    pub fn rung(&self, timeout: Option<Duration>) -> io::Result<bool> {
        use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
        let timeout = timeout.map_or(PollTimeout::NONE, |t| {
            PollTimeout::try_from(t).unwrap_or(PollTimeout::MAX)
        });
        loop {
            let mut pfd = [PollFd::new(self.fd.as_fd(), PollFlags::POLLIN)];
            match poll(&mut pfd, timeout) {
                Err(Errno::EINTR) => continue,
                Err(e) => return Err(e.into()),
                Ok(n) => return Ok(n > 0),
            }
        }
    }
}

impl From<DoorbellReader> for OwnedFd {
    fn from(d: DoorbellReader) -> OwnedFd {
        d.fd
    }
}

impl AsFd for DoorbellReader {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}
