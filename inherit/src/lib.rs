//! `ringmux-inherit`: the one place ringmux takes ownership of a descriptor by its number.
//!
//! A ringmux process receives descriptors across `execve` by number: a worker its control and
//! public sockets (`RINGMUX_CONTROL_FD`, `RINGMUX_PUBLIC_FD`), its hand-off's descriptors and
//! the shared listeners at fixed numbers; a demux started by `ringmux upgrade` its state memfd,
//! the previous binary and every socket and ring the state names. Turning such a number into
//! an [`OwnedFd`] is where I/O safety can break: two owners of one number close it twice, and
//! the second close may hit an unrelated descriptor that reused the number. So every such
//! number goes through [`adopt`], which
//!
//! * refuses the standard streams (0, 1, 2), which the process never inherits from ringmux;
//! * refuses a number that is not open;
//! * refuses to take a number a second time in one process (unless it was given back unclosed,
//!   [`give_back`]): whether the first owner still holds it or closed it and the number now
//!   holds something this process opened since, somebody else owns it;
//! * marks the descriptor close-on-exec when asked, so that no program the process runs later
//!   inherits it.
//!
//! The numbers come from the process that started this one, which placed them for this
//! process alone (the environment variable or the hand-off names them). That is what makes
//! taking them sound, and what callers state: nothing else in this process opened them.
//! [`set_inherited`] is the other direction: it clears close-on-exec on numbers this process
//! owns, just before it executes the next image that inherits them.

use std::collections::BTreeSet;
use std::io;
use std::os::fd::{FromRawFd, IntoRawFd, OwnedFd, RawFd};
use std::sync::Mutex;

/// Why a number was not taken.
#[derive(Debug, thiserror::Error)]
pub enum InheritError {
    /// 0, 1 and 2 are the standard streams, never a descriptor ringmux hands on.
    #[error("descriptor {0} is a standard stream, not one ringmux hands on")]
    StandardStream(RawFd),
    #[error("descriptor {0} is not open")]
    NotOpen(RawFd),
    /// The number was taken already in this process.
    #[error("descriptor {0} was taken already in this process")]
    TakenTwice(RawFd),
    #[error("descriptor {fd}: setting close-on-exec: {error}")]
    Flags {
        fd: RawFd,
        /// The OS error (in the message, so not the error's `source`).
        error: io::Error,
    },
}

impl From<InheritError> for io::Error {
    fn from(e: InheritError) -> io::Error {
        let kind = match &e {
            InheritError::Flags { error, .. } => error.kind(),
            _ => io::ErrorKind::InvalidData,
        };
        io::Error::new(kind, e)
    }
}

/// The numbers taken and not given back.
static TAKEN: Mutex<BTreeSet<RawFd>> = Mutex::new(BTreeSet::new());

/// Takes ownership of inherited descriptor `fd` (see the crate's documentation for what is
/// checked); with `close_on_exec`, marks it so. On an error nothing was taken and the number
/// is left as it was.
pub fn adopt(fd: RawFd, close_on_exec: bool) -> Result<OwnedFd, InheritError> {
    if (0..=2).contains(&fd) {
        return Err(InheritError::StandardStream(fd));
    }
    if !is_open(fd) {
        return Err(InheritError::NotOpen(fd));
    }
    let mut taken = TAKEN.lock().unwrap_or_else(|p| p.into_inner());
    if taken.contains(&fd) {
        return Err(InheritError::TakenTwice(fd));
    }
    if close_on_exec {
        set_flags(fd, libc::FD_CLOEXEC).map_err(|error| InheritError::Flags { fd, error })?;
    }
    taken.insert(fd);
    // SAFETY: `fd` is open (`is_open` found it) and owned by nothing else in this process: the
    // process that started this one placed it here for this process alone, and `TAKEN` makes
    // this the only time this process takes it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Gives back a descriptor [`adopt`] took, unclosed, as if it had never been taken (a caller
/// that found it was not what it expected). Returns its number.
pub fn give_back(fd: OwnedFd) -> RawFd {
    let raw = fd.into_raw_fd();
    let mut taken = TAKEN.lock().unwrap_or_else(|p| p.into_inner());
    taken.remove(&raw);
    raw
}

/// Whether a descriptor of number `fd` is open in this process (without taking it).
pub fn is_open(fd: RawFd) -> bool {
    fd >= 0 && fcntl(fd, libc::F_GETFD, 0) >= 0
}

/// Clears (`inherited`) or sets close-on-exec on descriptor number `fd`, which this process
/// owns: what it does to the numbers it hands to the next image just before `execve`, and
/// undoes if that fails.
pub fn set_inherited(fd: RawFd, inherited: bool) -> io::Result<()> {
    set_flags(fd, if inherited { 0 } else { libc::FD_CLOEXEC })
}

fn set_flags(fd: RawFd, flags: libc::c_int) -> io::Result<()> {
    if fcntl(fd, libc::F_SETFD, flags) < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// `fcntl` on a bare number, for the commands that take an int (F_GETFD, F_SETFD).
fn fcntl(fd: RawFd, cmd: libc::c_int, arg: libc::c_int) -> libc::c_int {
    // SAFETY: F_GETFD and F_SETFD read and write no memory; a number that is not open is EBADF.
    unsafe { libc::fcntl(fd, cmd, arg) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    fn fresh() -> RawFd {
        std::fs::File::open("/dev/null").unwrap().into_raw_fd()
    }

    fn cloexec(fd: RawFd) -> bool {
        fcntl(fd, libc::F_GETFD, 0) & libc::FD_CLOEXEC != 0
    }

    #[test]
    fn an_open_number_is_taken_once_and_marked_close_on_exec() {
        let raw = fresh();
        set_inherited(raw, true).unwrap();
        assert!(!cloexec(raw));
        let fd = adopt(raw, true).unwrap();
        assert_eq!(fd.as_raw_fd(), raw);
        assert!(cloexec(raw));
        assert!(matches!(adopt(raw, true), Err(InheritError::TakenTwice(n)) if n == raw));
        // Given back, it can be taken again, and keeps its flags when not asked.
        let raw = give_back(fd);
        set_inherited(raw, true).unwrap();
        let fd = adopt(raw, false).unwrap();
        assert!(!cloexec(raw));
        drop(fd);
        assert!(!is_open(raw));
    }

    #[test]
    fn standard_streams_and_closed_numbers_are_refused() {
        for n in 0..=2 {
            assert!(matches!(
                adopt(n, false),
                Err(InheritError::StandardStream(_))
            ));
        }
        let raw = fresh();
        drop(adopt(raw, true).unwrap());
        let e = adopt(raw, true).unwrap_err();
        assert!(matches!(e, InheritError::NotOpen(n) if n == raw), "{e}");
        assert_eq!(io::Error::from(e).kind(), io::ErrorKind::InvalidData);
        assert!(!is_open(-1));
    }

    /// A number taken once is not taken again, even when it holds another file by then (it
    /// was replaced or closed and reused): that file belongs to whatever put it there.
    #[test]
    fn a_number_is_taken_once_whatever_it_holds_later() {
        let dir = std::fs::File::open("/").unwrap();
        let mut first = adopt(fresh(), true).unwrap();
        let raw = first.as_raw_fd();
        // Another file at the same number, still owned by `first`, then let go unclosed.
        rustix::io::dup2(&dir, &mut first).unwrap();
        assert_eq!(first.into_raw_fd(), raw);
        assert!(is_open(raw));
        assert!(matches!(adopt(raw, true), Err(InheritError::TakenTwice(n)) if n == raw));
    }
}
