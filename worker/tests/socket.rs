//! `RingSocket` and the public socket it shares with the demux.
// This test reads and sets the raw option values the demux relies on, by level and name.
#![allow(clippy::disallowed_methods)]

use std::net::{SocketAddr, UdpSocket};
use std::os::fd::{AsRawFd, OwnedFd};

use ringmux_worker::socket::{Ingress, RingSocket};

fn int_option(fd: i32, level: libc::c_int, name: libc::c_int) -> libc::c_int {
    let mut v: libc::c_int = -1;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: getsockopt into a live int with its size.
    let rc = unsafe {
        libc::getsockopt(
            fd,
            level,
            name,
            (&mut v as *mut libc::c_int).cast(),
            &mut len,
        )
    };
    assert_eq!(
        rc,
        0,
        "getsockopt({level}, {name}): {}",
        std::io::Error::last_os_error()
    );
    v
}

fn set_int_option(fd: i32, level: libc::c_int, name: libc::c_int, v: libc::c_int) {
    // SAFETY: setsockopt from a live int with its size.
    let rc = unsafe {
        libc::setsockopt(
            fd,
            level,
            name,
            (&v as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    assert_eq!(rc, 0, "setsockopt: {}", std::io::Error::last_os_error());
}

/// The options the demux receives with, as it leaves them on a socket bound to a specific
/// address: quinn-udp's set minus the per-datagram destination address.
fn options(fd: i32, v6: bool) -> Vec<libc::c_int> {
    if v6 {
        vec![
            int_option(fd, libc::IPPROTO_IPV6, libc::IPV6_RECVPKTINFO),
            int_option(fd, libc::IPPROTO_IPV6, libc::IPV6_RECVTCLASS),
            int_option(fd, libc::SOL_UDP, libc::UDP_GRO),
        ]
    } else {
        vec![
            int_option(fd, libc::IPPROTO_IP, libc::IP_PKTINFO),
            int_option(fd, libc::IPPROTO_IP, libc::IP_RECVTOS),
            int_option(fd, libc::SOL_UDP, libc::UDP_GRO),
            int_option(fd, libc::IPPROTO_IP, libc::IP_MTU_DISCOVER),
        ]
    }
}

/// A worker's `RingSocket` sends on the socket the demux made for it and set the options of
/// (a confined worker may not set any); building one must not switch on anything the demux
/// switched off.
#[tokio::test]
async fn ring_socket_leaves_the_public_socket_options_alone() {
    for (bind, v6) in [("127.0.0.1:0", false), ("[::1]:0", true)] {
        let public = match UdpSocket::bind(bind) {
            Ok(s) => s,
            // A machine without IPv6 loopback: the v4 case still ran.
            Err(e) if v6 && e.kind() == std::io::ErrorKind::AddrNotAvailable => continue,
            Err(e) => panic!("binding {bind}: {e}"),
        };
        let fd = public.as_raw_fd();
        // As the demux leaves it: GRO and ECN on, destination address off.
        set_int_option(fd, libc::SOL_UDP, libc::UDP_GRO, 1);
        if v6 {
            set_int_option(fd, libc::IPPROTO_IPV6, libc::IPV6_RECVTCLASS, 1);
        } else {
            set_int_option(fd, libc::IPPROTO_IP, libc::IP_RECVTOS, 1);
        }
        let before = options(fd, v6);
        assert_eq!(before[0], 0, "destination address should start off");

        let addr: SocketAddr = public.local_addr().unwrap();
        let dup: OwnedFd = public.try_clone().unwrap().into();
        let (ingress, _peer) = std::os::unix::net::UnixDatagram::pair().unwrap();
        let socket = RingSocket::new(Ingress::Unix(OwnedFd::from(ingress)), dup, addr)
            .expect("RingSocket::new");
        assert_eq!(
            options(fd, v6),
            before,
            "RingSocket::new changed the shared socket's options ({bind})"
        );
        drop(socket);
    }
}
