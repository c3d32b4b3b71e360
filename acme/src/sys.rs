//! What the engine asks of the kernel besides sockets: the state directory's file locks and the
//! eventfd that tells the demux's supervisor a new view is published.

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use nix::errno::Errno;

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

/// An eventfd (non-blocking, close-on-exec) the engine rings when it publishes; the supervisor
/// polls it with its other descriptors.
pub struct Bell(OwnedFd);

impl Bell {
    pub fn new() -> io::Result<Bell> {
        use rustix::event::EventfdFlags;
        let fd = rustix::event::eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)?;
        Ok(Bell(fd))
    }

    /// Makes it readable (a full counter is readable already).
    pub fn ring(&self) {
        let _ = rustix::io::write(&self.0, &1u64.to_ne_bytes());
    }

    /// Makes it unreadable again.
    pub fn clear(&self) {
        let mut v = [0u8; 8];
        let _ = rustix::io::read(&self.0, &mut v);
    }
}

impl AsFd for Bell {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.0.as_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lock_is_held_once_until_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.lock");
        let open = || std::fs::File::create(&path).unwrap();
        let held = try_lock_exclusive(open()).unwrap().expect("free");
        assert!(try_lock_exclusive(open()).unwrap().is_none());
        drop(held);
        assert!(try_lock_exclusive(open()).unwrap().is_some());
    }

    #[test]
    fn the_bell_is_readable_after_a_ring_until_cleared() {
        let bell = Bell::new().unwrap();
        let readable = |b: &Bell| {
            let mut v = [0u8; 8];
            let n = rustix::io::read(b, &mut v);
            if let Ok(8) = n {
                b.ring(); // put it back
                true
            } else {
                false
            }
        };
        assert!(!readable(&bell));
        bell.ring();
        assert!(readable(&bell));
        bell.clear();
        assert!(!readable(&bell));
    }
}
