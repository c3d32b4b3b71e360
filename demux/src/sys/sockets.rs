//! Sockets: the Unix `SOCK_SEQPACKET` sockets of control, sessions and `unix` ingress, the
//! public UDP socket's options and its `SO_REUSEPORT` group, the workers' sending sockets and
//! the shared TCP listener.

use std::io::{self, IoSlice};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};

use nix::errno::Errno;
use nix::sys::socket::{self, sockopt, ControlMessage, MsgFlags};

use super::retry;

/// A connected `SOCK_SEQPACKET` pair, both ends close-on-exec.
pub fn seqpacket_pair() -> io::Result<(OwnedFd, OwnedFd)> {
    let (a, b) = socket2::Socket::pair(
        socket2::Domain::UNIX,
        socket2::Type::SEQPACKET.cloexec(),
        None,
    )?;
    Ok((a.into(), b.into()))
}

/// Sends one packet with `fds` attached (`SCM_RIGHTS`; none for a hand-off, whose descriptors
/// are placed before exec), blocking until it is queued, without `SIGPIPE`.
pub fn send_with_fds(sock: BorrowedFd<'_>, data: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<()> {
    let raw: Vec<RawFd> = fds.iter().map(AsRawFd::as_raw_fd).collect();
    let iov = [IoSlice::new(data)];
    let cmsg = [ControlMessage::ScmRights(&raw)];
    let cmsgs: &[ControlMessage<'_>] = if raw.is_empty() { &[] } else { &cmsg };
    let n = retry(|| {
        socket::sendmsg::<()>(sock.as_raw_fd(), &iov, cmsgs, MsgFlags::MSG_NOSIGNAL, None)
    })?;
    if n != data.len() {
        return Err(io::Error::other("packet sent partially"));
    }
    Ok(())
}

/// Sends one packet without blocking and without `SIGPIPE` (`WouldBlock` escapes).
pub fn send_packet(sock: BorrowedFd<'_>, data: &[u8]) -> io::Result<()> {
    send_iov(sock, &[IoSlice::new(data)])
}

/// Sends one packet gathered from `parts`, without blocking and without `SIGPIPE`
/// (`WouldBlock` escapes). Allocates nothing: it runs on the data plane in `unix` mode.
pub fn send_iov(sock: BorrowedFd<'_>, parts: &[IoSlice<'_>]) -> io::Result<()> {
    let flags = MsgFlags::MSG_DONTWAIT | MsgFlags::MSG_NOSIGNAL;
    retry(|| socket::sendmsg::<()>(sock.as_raw_fd(), parts, &[], flags, None)).map(drop)
}

/// Receives one packet without blocking, with `MSG_TRUNC`: the result is the packet's real
/// length, which may exceed `buf.len()` (the rest was discarded). `Ok(0)`: end of file.
/// Descriptors a peer attached are not accepted: with no room for them, the kernel closes them.
pub fn recv_packet(sock: BorrowedFd<'_>, buf: &mut [u8]) -> io::Result<usize> {
    let flags = MsgFlags::MSG_DONTWAIT | MsgFlags::MSG_TRUNC;
    retry(|| socket::recv(sock.as_raw_fd(), buf, flags))
}

/// Whether an error means the peer is gone.
pub fn is_disconnect(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EPIPE | libc::ECONNRESET | libc::ENOTCONN | libc::ECONNREFUSED)
    )
}

/// Raises `SO_RCVBUF` (`send` false) or `SO_SNDBUF` past `net.core.*mem_max` with the `FORCE`
/// variants; fails without `CAP_NET_ADMIN`, which callers treat as "fall back to the capped size".
pub fn force_buffer(socket: BorrowedFd<'_>, send: bool, bytes: usize) -> io::Result<()> {
    let v = bytes.min(i32::MAX as usize / 2);
    if send {
        socket::setsockopt(&socket, sockopt::SndBufForce, &v)?;
    } else {
        socket::setsockopt(&socket, sockopt::RcvBufForce, &v)?;
    }
    Ok(())
}

/// A UDP socket of `addr`'s family, close-on-exec, not bound yet; dual-stack when `addr` is
/// `[::]`.
pub fn udp_socket(addr: std::net::SocketAddr) -> io::Result<socket2::Socket> {
    use socket2::{Domain, Protocol, Socket, Type};
    let s = Socket::new(
        Domain::for_address(addr),
        Type::DGRAM.cloexec(),
        Some(Protocol::UDP),
    )?;
    if addr.is_ipv6() && addr.ip().is_unspecified() {
        s.set_only_v6(false)?;
    }
    Ok(s)
}

/// The listening TCP socket of `--tcp on`: close-on-exec, `SO_REUSEADDR` (a restarted ringmux
/// binds at once past connections in TIME_WAIT), dual-stack for `[::]`, a backlog of 4096,
/// non-blocking (its file description, flags included, is shared by every worker, which may
/// never change them).
pub fn tcp_listener(addr: std::net::SocketAddr) -> io::Result<std::net::TcpListener> {
    use socket2::{Domain, Protocol, Socket, Type};
    let s = Socket::new(
        Domain::for_address(addr),
        Type::STREAM.cloexec(),
        Some(Protocol::TCP),
    )?;
    if addr.is_ipv6() && addr.ip().is_unspecified() {
        s.set_only_v6(false)?;
    }
    s.set_reuse_address(true)?;
    s.bind(&addr.into())?;
    s.listen(4096)?;
    s.set_nonblocking(true)?;
    Ok(s.into())
}

/// A worker's own sending socket: a UDP socket bound to `public`, the public socket's address
/// and port, in its `SO_REUSEPORT` group, whose steering program always picks the demux's
/// socket ([`NEVER_STEER_PROGRAM`]), so it never receives a datagram. Whatever a worker does to
/// it (a filter, `connect`, `shutdown`, receiving) touches that worker alone; the socket the
/// demux receives on never leaves the demux. Its filters are locked (`SO_LOCK_FILTER`), so not
/// even an unconfined worker can replace the group's steering program through it.
/// Non-blocking, close-on-exec, `sndbuf` bytes of send buffer.
pub fn sending_socket(public: std::net::SocketAddr, sndbuf: usize) -> io::Result<OwnedFd> {
    let s = udp_socket(public)?;
    s.set_reuse_port(true)?;
    lock_filter(s.as_fd())?;
    let _ = force_buffer(s.as_fd(), true, sndbuf);
    if s.send_buffer_size().unwrap_or(0) < sndbuf {
        let _ = s.set_send_buffer_size(sndbuf);
    }
    s.set_nonblocking(true)?;
    s.bind(&public.into())?;
    Ok(s.into())
}

/// The steering program of the public socket's `SO_REUSEPORT` group in every mode but
/// `reuseport`: `return 0`, the index of the group's first member, the demux's own socket.
pub const NEVER_STEER_PROGRAM: [libc::sock_filter; 1] = [libc::sock_filter {
    code: (libc::BPF_RET | libc::BPF_K) as u16,
    jt: 0,
    jf: 0,
    k: 0,
}];

/// Sizes a socket's receive and send buffers to at least `rcvbuf` and `sndbuf` bytes: past
/// `net.core.*mem_max` where the demux may (`CAP_NET_ADMIN`), else as far as those limits
/// allow. The receive buffer it got, as Linux reports it (twice what it grants, counting its
/// own overhead), is the caller's to check.
pub fn size_buffers(socket: &socket2::Socket, rcvbuf: usize, sndbuf: usize) {
    let _ = force_buffer(socket.as_fd(), false, rcvbuf);
    let _ = force_buffer(socket.as_fd(), true, sndbuf);
    if socket.recv_buffer_size().unwrap_or(0) < rcvbuf {
        let _ = socket.set_recv_buffer_size(rcvbuf);
    }
    if socket.send_buffer_size().unwrap_or(0) < sndbuf {
        let _ = socket.set_send_buffer_size(sndbuf);
    }
}

/// A per-datagram control message the public socket can be asked for.
#[derive(Clone, Copy, Debug)]
pub enum RecvCmsg {
    /// `IP_PKTINFO`: the destination address of IPv4 datagrams.
    Ipv4PacketInfo,
    /// `IPV6_RECVPKTINFO`: the destination address of IPv6 datagrams.
    Ipv6PacketInfo,
    /// `IP_RECVTOS`: the TOS byte (ECN) of IPv4 datagrams.
    Ipv4Tos,
    /// `IPV6_RECVTCLASS`: the traffic class (ECN) of IPv6 datagrams.
    Ipv6TrafficClass,
}

/// Turns one per-datagram control message off.
pub fn switch_off(socket: BorrowedFd<'_>, what: RecvCmsg) -> io::Result<()> {
    match what {
        RecvCmsg::Ipv4PacketInfo => socket::setsockopt(&socket, sockopt::Ipv4PacketInfo, &false),
        RecvCmsg::Ipv6PacketInfo => {
            socket::setsockopt(&socket, sockopt::Ipv6RecvPacketInfo, &false)
        }
        RecvCmsg::Ipv4Tos => socket::setsockopt(&socket, sockopt::IpRecvTos, &false),
        RecvCmsg::Ipv6TrafficClass => socket::setsockopt(&socket, sockopt::Ipv6RecvTClass, &false),
    }?;
    Ok(())
}

/// `SO_LOCK_FILTER`, which nix does not name, declared with nix's own macro: the option is then
/// set through nix's `setsockopt` like every other, its value passed by nix's `SetBool`. (The
/// macro expands to the raw call inside nix's implementation, which clippy's ban on raw calls
/// sees here.)
#[allow(clippy::disallowed_methods)]
mod lock_filter_option {
    use nix::{setsockopt_impl, sockopt_impl};
    sockopt_impl!(
        /// `SO_LOCK_FILTER`: once set, no socket filter can be attached to, detached from or
        /// replaced on the socket, by any holder of it.
        LockFilter,
        SetOnly,
        libc::SOL_SOCKET,
        libc::SO_LOCK_FILTER,
        bool
    );
}
use lock_filter_option::LockFilter;

/// `SO_LOCK_FILTER`: no socket filter can be attached to, detached from or replaced on
/// `socket` from now on, by any holder of it.
pub fn lock_filter(socket: BorrowedFd<'_>) -> io::Result<()> {
    socket::setsockopt(&socket, LockFilter, &true)?;
    Ok(())
}

/// Attaches `program`, a classic BPF program, to the `SO_REUSEPORT` group of the bound UDP
/// socket `sock` (`SO_ATTACH_REUSEPORT_CBPF`, which needs no privilege), replacing any program
/// attached before: from then on the kernel runs it on every datagram for the group and takes
/// its return value as the index of the socket to deliver to, in the order the sockets joined
/// the group; an index past the group falls back to the kernel's hash. The kernel copies the
/// program and checks it first (`EINVAL` if it refuses it, as for more than `BPF_MAXINSNS`
/// instructions).
pub fn attach_reuseport_program(
    sock: BorrowedFd<'_>,
    program: &[libc::sock_filter],
) -> io::Result<()> {
    let len = u16::try_from(program.len()).map_err(|_| io::Error::from(Errno::EINVAL))?;
    // The kernel only reads the instructions (it copies them in): the C field is not `const`.
    let fprog = libc::sock_fprog {
        len,
        filter: program.as_ptr().cast_mut(),
    };
    socket::setsockopt(&sock, sockopt::AttachReusePortCbpf, &fprog)?;
    Ok(())
}

/// Bytes waiting in a UDP socket's receive queue (`rx_queue` of its line in `/proc/net/udp` or
/// `/proc/net/udp6`, found by the socket's inode).
pub fn queued_bytes(socket: BorrowedFd<'_>) -> Option<u64> {
    let inode = nix::sys::stat::fstat(socket).ok()?.st_ino;
    for table in ["/proc/net/udp", "/proc/net/udp6"] {
        let Ok(text) = std::fs::read_to_string(table) else {
            continue;
        };
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            // sl local rem st tx_queue:rx_queue tr:tm retrnsmt uid timeout inode ...
            if f.get(9).and_then(|i| i.parse::<u64>().ok()) == Some(inode) {
                let rx = f.get(4)?.split(':').nth(1)?;
                return u64::from_str_radix(rx, 16).ok();
            }
        }
    }
    None
}

/// `shutdown(SHUT_RDWR)` on a socket: every holder of it (and of its peer) sees it closed,
/// whichever descriptors of it still exist.
pub fn shut_down(sock: BorrowedFd<'_>) -> io::Result<()> {
    socket::shutdown(sock.as_raw_fd(), socket::Shutdown::Both)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::sys::{poll_readable, wait_readable};

    #[test]
    fn packets_and_descriptors_cross_a_pair() {
        let (a, b) = seqpacket_pair().unwrap();
        let (x, _y) = seqpacket_pair().unwrap();
        send_with_fds(a.as_fd(), b"hello", &[x.as_fd()]).unwrap();
        // The demux never accepts descriptors: they are closed by the kernel, the data comes.
        let mut buf = [0u8; 16];
        assert_eq!(recv_packet(b.as_fd(), &mut buf).unwrap(), 5);
        assert_eq!(&buf[..5], b"hello");
        send_iov(a.as_fd(), &[IoSlice::new(b"ab"), IoSlice::new(b"cd")]).unwrap();
        assert_eq!(recv_packet(b.as_fd(), &mut buf).unwrap(), 4);
        assert_eq!(&buf[..4], b"abcd");
        assert_eq!(
            recv_packet(b.as_fd(), &mut buf).unwrap_err().kind(),
            io::ErrorKind::WouldBlock
        );
        assert!(!wait_readable(b.as_fd(), Duration::from_millis(1)).unwrap());
        drop(a);
        assert_eq!(
            poll_readable(&[b.as_fd()], Some(Duration::from_secs(5))).unwrap(),
            1
        );
        assert_eq!(recv_packet(b.as_fd(), &mut buf).unwrap(), 0);
        let e = send_packet(b.as_fd(), b"x").unwrap_err();
        assert!(is_disconnect(&e), "{e}");
    }

    #[test]
    fn received_packet_cmsgs_can_be_switched_off() {
        let s = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        for what in [RecvCmsg::Ipv4PacketInfo, RecvCmsg::Ipv4Tos] {
            switch_off(s.as_fd(), what).unwrap();
        }
        let s6 = std::net::UdpSocket::bind("[::1]:0").unwrap();
        for what in [RecvCmsg::Ipv6PacketInfo, RecvCmsg::Ipv6TrafficClass] {
            switch_off(s6.as_fd(), what).unwrap();
        }
    }
}
