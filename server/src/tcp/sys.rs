//! The one system call of the TCP side that tokio does not make for it: how much of what was
//! written to a socket the peer has not acknowledged yet, which decides how long a graceful
//! close waits (`super::close_gracefully`). The rest of `tcp` is safe code over tokio.

use std::io;
use std::os::fd::AsFd;

/// Bytes written to the TCP socket `sock` that its peer has not acknowledged yet, sent or not
/// (`ioctl(SIOCOUTQ)`, tcp(7)); 0 once everything arrived.
///
/// Errors that escape: `EBADF`, `ENOTTY` (not a socket), `EINVAL` (a listening socket);
/// `EPERM` under a system-call filter that refuses the request (ringmux's allows it).
pub fn unacknowledged_bytes(sock: impl AsFd) -> io::Result<usize> {
    use rustix::ioctl::{ioctl, Getter, Opcode};
    // SIOCOUTQ is TIOCOUTQ's number (linux/sockios.h); the kernel writes an int.
    const SIOCOUTQ: Opcode = libc::TIOCOUTQ as Opcode;
    // SAFETY: SIOCOUTQ is a getter whose argument is a pointer to an `int` the kernel fills
    // (tcp(7), "ioctls"), which is what `Getter<_, c_int>` passes.
    let getter = unsafe { Getter::<SIOCOUTQ, libc::c_int>::new() };
    // SAFETY: `getter` was built for this request and output type above; `sock` is borrowed
    // for the call, so the descriptor is open.
    let n = unsafe { ioctl(sock, getter) }?;
    Ok(usize::try_from(n).unwrap_or(0))
}
