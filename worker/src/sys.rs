//! Every system call of the worker library outside quinn-udp, the ring crate and `files`, each
//! wrapped once, on `nix` where it has a wrapper (on `rustix` where only it owns what the
//! kernel hands back). The rest of the crate calls these safe functions.
//!
//! Kinds of error that escape: each function returns `io::Result`; `EINTR` is retried inside,
//! `WouldBlock` escapes from the non-blocking ones (named so), everything else as the kernel
//! said it.

use std::io::{self, IoSliceMut};
use std::ops::Deref;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
use std::time::Duration;

use nix::errno::Errno;
use nix::poll::{PollFd, PollFlags, PollTimeout};
use nix::sys::socket::{self, MsgFlags};
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;

/// Takes ownership of descriptor `fd`, which ringmux placed in this process before its
/// program started (a hand-off descriptor), and with `close_on_exec` marks it so, so that no
/// program this process executes later inherits it. `InvalidData` if no descriptor of that
/// number is open, or if this process took it already (`ringmux_inherit::adopt`).
pub fn adopt_inherited(fd: std::os::fd::RawFd, close_on_exec: bool) -> io::Result<OwnedFd> {
    ringmux_inherit::adopt(fd, close_on_exec).map_err(|e| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("descriptor {fd} of the hand-off: {e}"),
        )
    })
}

/// Sends one packet on a `SOCK_SEQPACKET` socket, without `SIGPIPE`; `dontwait`: without
/// blocking either (`WouldBlock` escapes).
pub fn send_packet(sock: BorrowedFd<'_>, data: &[u8], dontwait: bool) -> io::Result<()> {
    let mut flags = MsgFlags::MSG_NOSIGNAL;
    if dontwait {
        flags |= MsgFlags::MSG_DONTWAIT;
    }
    let n = retry(|| socket::send(sock.as_raw_fd(), data, flags))?;
    if n != data.len() {
        return Err(io::Error::other("packet sent partially"));
    }
    Ok(())
}

/// Receives one packet with `MSG_TRUNC`: the result is the packet's real length, which may
/// exceed `buf.len()` (the rest was discarded). `Ok(0)`: end of file. `dontwait`: without
/// blocking (`WouldBlock` escapes).
pub fn recv_packet(sock: BorrowedFd<'_>, buf: &mut [u8], dontwait: bool) -> io::Result<usize> {
    let mut flags = MsgFlags::MSG_TRUNC;
    if dontwait {
        flags |= MsgFlags::MSG_DONTWAIT;
    }
    retry(|| socket::recv(sock.as_raw_fd(), buf, flags))
}

/// What [`recv_frame`] read.
pub enum Frame {
    /// A packet of `len` bytes in all, split over the head and the body buffers.
    Packet { len: usize },
    /// The packet did not fit the buffers (it was cut).
    Truncated,
    /// End of file: the peer closed the socket.
    Closed,
}

/// Receives one packet of a `SOCK_SEQPACKET` socket into two buffers: its first `head.len()`
/// bytes, then the rest (the unix ingress framing: descriptor, payload). `WouldBlock` escapes
/// when the socket is non-blocking (the ingress socket is).
///
/// `readv`, not `recvmsg`: a confined worker may call `recvmsg` on its control socket only
/// (the demux's system-call filter, `control-protocol.md` "Confinement"), which is what keeps
/// it from receiving descriptors. A packet longer than both buffers spills into a third,
/// one-byte buffer: that is how a cut packet is told from one that fits exactly.
pub fn recv_frame(sock: BorrowedFd<'_>, head: &mut [u8], body: &mut [u8]) -> io::Result<Frame> {
    let fits = head.len() + body.len();
    let mut spill = [0u8; 1];
    let mut iov = [
        IoSliceMut::new(head),
        IoSliceMut::new(body),
        IoSliceMut::new(&mut spill),
    ];
    let bytes = retry(|| nix::sys::uio::readv(sock, &mut iov))?;
    Ok(if bytes == 0 {
        Frame::Closed
    } else if bytes > fits {
        Frame::Truncated
    } else {
        Frame::Packet { len: bytes }
    })
}

/// Waits until `fd` is readable (or hung up, or in error: the next read says which), for at
/// most `timeout` (`None`: forever). `Ok(false)`: timed out. A timeout is rounded up to whole
/// milliseconds, so a short remainder waits instead of spinning.
pub fn poll_readable(fd: BorrowedFd<'_>, timeout: Option<Duration>) -> io::Result<bool> {
    let timeout = match timeout {
        None => PollTimeout::NONE,
        Some(t) => {
            let ms = t.as_micros().div_ceil(1000);
            PollTimeout::try_from(ms).unwrap_or(PollTimeout::MAX)
        }
    };
    let mut fds = [PollFd::new(fd, PollFlags::POLLIN)];
    Ok(retry(|| nix::poll::poll(&mut fds, timeout))? > 0)
}

/// CPU time this process has used, user and system.
pub fn cpu_time() -> Duration {
    use nix::sys::resource::{getrusage, UsageWho};
    let Ok(u) = getrusage(UsageWho::RUSAGE_SELF) else {
        return Duration::ZERO;
    };
    let d = |tv: nix::sys::time::TimeVal| {
        Duration::new(
            tv.tv_sec().max(0) as u64,
            (tv.tv_usec().max(0) as u32) * 1000,
        )
    };
    d(u.user_time()) + d(u.system_time())
}

/// Asks the kernel to SIGKILL this process when its parent (the demux) exits, and checks that
/// the parent is still there (the death signal only fires for a parent alive at this call).
/// Makes this process non-dumpable (`PR_SET_DUMPABLE` 0): no other process of its user, a
/// sibling worker above all, may `ptrace` it or open its `/proc/PID/mem`, where its TLS keys and
/// its clients' data are. (The kernel makes every program dumpable again at `execve`, so the
/// demux cannot do this for it.) It leaves no core dump either.
pub fn make_non_dumpable() -> io::Result<()> {
    nix::sys::prctl::set_dumpable(false)?;
    Ok(())
}

pub fn die_with_parent() -> io::Result<()> {
    nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL)?;
    if nix::unistd::getppid().as_raw() == 1 {
        return Err(io::Error::other(
            "the demux exited before this worker started",
        ));
    }
    Ok(())
}

pub use nix::sys::socket::SockType;

/// The type of socket `fd` is (`SO_TYPE`); `None` if it is no socket.
pub fn socket_type(fd: BorrowedFd<'_>) -> Option<SockType> {
    socket::getsockopt(&fd, socket::sockopt::SockType).ok()
}

/// A descriptor registered with tokio's reactor for readability (the doorbell, the unix
/// ingress socket, the control socket), owned until dropped. It lends the [`AsyncFd`] out only
/// by shared reference: nothing can take the descriptor out, close it or swap it while it is
/// registered.
#[derive(Debug)]
pub struct AsyncReadable(AsyncFd<OwnedFd>);

impl AsyncReadable {
    /// Registers `fd`. Must run inside a tokio runtime.
    pub fn new(fd: OwnedFd) -> io::Result<Self> {
        // SAFETY: what `register_with_interest` asks of the descriptor holds for an `OwnedFd`
        // kept inside this type: it is open (an `OwnedFd` always is), `as_raw_fd` reads a field
        // that never changes, and it stays open and the same until the `AsyncFd` is dropped,
        // because this type owns the `AsyncFd` and hands out only `&AsyncFd` (no `get_mut`, no
        // `into_inner`).
        let fd = unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) }?;
        Ok(AsyncReadable(fd))
    }
}

impl Deref for AsyncReadable {
    type Target = AsyncFd<OwnedFd>;

    fn deref(&self) -> &AsyncFd<OwnedFd> {
        &self.0
    }
}

/// Runs `f` again while it fails with `EINTR`.
fn retry<T>(mut f: impl FnMut() -> nix::Result<T>) -> io::Result<T> {
    loop {
        match f() {
            Err(Errno::EINTR) => continue,
            r => return r.map_err(io::Error::from),
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::os::fd::AsFd;

    /// A connected `SOCK_SEQPACKET` pair, as the demux makes them.
    pub(crate) fn seqpacket_pair() -> (OwnedFd, OwnedFd) {
        let (a, b) = socket2::Socket::pair(
            socket2::Domain::UNIX,
            socket2::Type::SEQPACKET.cloexec(),
            None,
        )
        .unwrap();
        (a.into(), b.into())
    }

    #[test]
    fn a_message_longer_than_the_buffer_says_its_length() {
        let (a, b) = seqpacket_pair();
        let mut buf = [0u8; 10];
        send_packet(a.as_fd(), &[7; 100], false).unwrap();
        assert_eq!(recv_packet(b.as_fd(), &mut buf, true).unwrap(), 100);
        assert_eq!(
            recv_packet(b.as_fd(), &mut buf, true).unwrap_err().kind(),
            io::ErrorKind::WouldBlock
        );
        drop(a);
        assert_eq!(recv_packet(b.as_fd(), &mut buf, true).unwrap(), 0);
    }

    #[test]
    fn an_inherited_descriptor_is_adopted_close_on_exec_and_a_closed_one_refused() {
        let (a, _b) = seqpacket_pair();
        let raw = std::os::fd::IntoRawFd::into_raw_fd(nix::unistd::dup(&a).unwrap());
        let adopted = adopt_inherited(raw, true).unwrap();
        let flags = nix::fcntl::fcntl(&adopted, nix::fcntl::FcntlArg::F_GETFD).unwrap();
        assert!(
            nix::fcntl::FdFlag::from_bits_truncate(flags).contains(nix::fcntl::FdFlag::FD_CLOEXEC)
        );
        assert_eq!(socket_type(adopted.as_fd()), Some(SockType::SeqPacket));
        drop(adopted);
        let e = adopt_inherited(raw, true).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData, "{e}");
    }

    #[test]
    fn frames_split_over_head_and_body() {
        let (a, b) = seqpacket_pair();
        send_packet(a.as_fd(), b"0123456789", false).unwrap();
        let (mut head, mut body) = ([0u8; 4], [0u8; 8]);
        assert!(matches!(
            recv_frame(b.as_fd(), &mut head, &mut body).unwrap(),
            Frame::Packet { len: 10 }
        ));
        assert_eq!((&head, &body[..6]), (b"0123", &b"456789"[..]));
        send_packet(a.as_fd(), &[1; 20], false).unwrap();
        assert!(matches!(
            recv_frame(b.as_fd(), &mut head, &mut body).unwrap(),
            Frame::Truncated
        ));
        // Exactly as long as both buffers: whole, not cut.
        send_packet(a.as_fd(), &[2; 12], false).unwrap();
        assert!(matches!(
            recv_frame(b.as_fd(), &mut head, &mut body).unwrap(),
            Frame::Packet { len: 12 }
        ));
        send_packet(a.as_fd(), &[3; 13], false).unwrap();
        assert!(matches!(
            recv_frame(b.as_fd(), &mut head, &mut body).unwrap(),
            Frame::Truncated
        ));
        assert!(!poll_readable(b.as_fd(), Some(Duration::from_millis(1))).unwrap());
        drop(a);
        assert!(poll_readable(b.as_fd(), Some(Duration::from_secs(5))).unwrap());
        assert!(matches!(
            recv_frame(b.as_fd(), &mut head, &mut body).unwrap(),
            Frame::Closed
        ));
    }

    #[test]
    fn cpu_time_moves() {
        let t0 = cpu_time();
        let mut x = 0u64;
        let until = std::time::Instant::now() + Duration::from_millis(20);
        while std::time::Instant::now() < until {
            x = x.wrapping_mul(31).wrapping_add(1);
        }
        std::hint::black_box(x);
        assert!(cpu_time() > t0);
    }
}
