//! The baseline ingress: one `SOCK_SEQPACKET` message per datagram, the 64-byte slot
//! descriptor of `shm-layout.md` then the payload (`control-protocol.md`, "Descriptors"). The one
//! decoder of that framing ([`recv_unix`]), and the quinn socket's receive side over it.

use std::io::{self, IoSliceMut};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::Ordering;
use std::task::{Context, Poll};

use quinn::udp::RecvMeta;
use ringmux_ring::layout::{SlotDesc, DESC_BYTES};
use ringmux_ring::{decode_desc, DatagramMeta};
use tokio::io::unix::AsyncFd;

use super::received::{recv_meta, IngressStats};
use crate::sys::{self, Frame};

/// What one [`recv_unix`] read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UnixRecv {
    /// A datagram of `len` bytes, now at the start of the payload buffer.
    Datagram { meta: DatagramMeta, len: usize },
    /// A message that was not a valid datagram (too long for the buffer, too short for a
    /// descriptor, a descriptor that fails validation or disagrees with the length): dropped.
    Dropped,
    /// The demux closed the socket.
    Closed,
}

/// Reads one message of the unix ingress without blocking: the descriptor into a local, the
/// payload straight into `payload`. `WouldBlock` escapes. The descriptor comes from the demux
/// (trusted) but is validated like a ring slot's all the same.
pub fn recv_unix(fd: BorrowedFd<'_>, payload: &mut [u8]) -> io::Result<UnixRecv> {
    let mut desc = [0u8; DESC_BYTES as usize];
    let len = match sys::recv_frame(fd, &mut desc, payload)? {
        Frame::Closed => return Ok(UnixRecv::Closed),
        Frame::Truncated => return Ok(UnixRecv::Dropped),
        Frame::Packet { len } => len,
    };
    let Some(len) = len.checked_sub(desc.len()) else {
        return Ok(UnixRecv::Dropped);
    };
    let d = SlotDesc::from_bytes(&desc);
    match decode_desc(&d, u32::MAX) {
        Ok(meta) if d.len as usize == len => Ok(UnixRecv::Datagram { meta, len }),
        _ => Ok(UnixRecv::Dropped),
    }
}

/// Fills `bufs` from the unix ingress socket (`sock`, registered with tokio's reactor), one
/// message per datagram.
pub(crate) fn poll_recv(
    sock: &AsyncFd<OwnedFd>,
    stats: &IngressStats,
    cx: &mut Context<'_>,
    bufs: &mut [IoSliceMut<'_>],
    meta: &mut [RecvMeta],
) -> Poll<io::Result<usize>> {
    loop {
        let mut guard = match sock.poll_read_ready(cx) {
            Poll::Ready(Ok(g)) => g,
            Poll::Ready(Err(e)) => {
                tracing::error!(error = %e, "unix ingress registration failed");
                return Poll::Pending;
            }
            Poll::Pending => return Poll::Pending,
        };
        let fd = sock.get_ref().as_fd();
        let max = bufs.len().min(meta.len());
        let mut n = 0;
        let mut dropped = 0;
        let mut closed = false;
        while n < max {
            match recv_unix(fd, &mut bufs[n]) {
                Ok(UnixRecv::Datagram { meta: m, len }) => {
                    meta[n] = recv_meta(&m, len);
                    n += 1;
                }
                Ok(UnixRecv::Dropped) => dropped += 1,
                Ok(UnixRecv::Closed) => {
                    closed = true;
                    break;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    guard.clear_ready();
                    break;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "unix ingress receive failed");
                    guard.clear_ready();
                    break;
                }
            }
        }
        if dropped > 0 {
            stats.dropped.fetch_add(dropped, Ordering::Relaxed);
        }
        if n > 0 {
            stats.received.fetch_add(n as u64, Ordering::Relaxed);
            return Poll::Ready(Ok(n));
        }
        if closed {
            // The demux is gone; the control socket tells the worker to exit.
            return Poll::Pending;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ringmux_ring::{encode_desc, monotonic_ns};
    use std::os::fd::AsFd;

    fn frame(desc: &SlotDesc, payload: &[u8]) -> Vec<u8> {
        let mut m = desc.as_bytes().to_vec();
        m.extend_from_slice(payload);
        m
    }

    #[test]
    fn datagrams_decode_and_bad_frames_are_dropped() {
        let (a, b) = crate::sys::tests::seqpacket_pair();
        // As the ingress socket is (`Ingress::wake_fd`).
        socket2::SockRef::from(&b).set_nonblocking(true).unwrap();
        let meta = DatagramMeta {
            remote: "192.0.2.7:4433".parse().unwrap(),
            local_ip: Some("127.0.0.1".parse().unwrap()),
            ecn: 2,
            segment_size: 0,
            rx_timestamp_ns: monotonic_ns(),
        };
        let good = encode_desc(&meta, 5);
        let send = |m: &[u8]| sys::send_packet(a.as_fd(), m, false).unwrap();
        send(&frame(&good, b"hello"));
        send(&frame(&good, b"hell")); // length disagrees with the descriptor
        send(&good.as_bytes()[..10]); // shorter than a descriptor
        send(&frame(&encode_desc(&meta, 40), &[1; 40])); // longer than the buffer
        let mut buf = [0u8; 16];
        match recv_unix(b.as_fd(), &mut buf).unwrap() {
            UnixRecv::Datagram { meta: m, len } => {
                assert_eq!((len, &buf[..5]), (5, &b"hello"[..]));
                assert_eq!(
                    (m.remote, m.local_ip, m.ecn),
                    (meta.remote, meta.local_ip, 2)
                );
            }
            other => panic!("{other:?}"),
        }
        for _ in 0..3 {
            assert_eq!(recv_unix(b.as_fd(), &mut buf).unwrap(), UnixRecv::Dropped);
        }
        assert_eq!(
            recv_unix(b.as_fd(), &mut buf).unwrap_err().kind(),
            io::ErrorKind::WouldBlock
        );
        drop(a);
        assert_eq!(recv_unix(b.as_fd(), &mut buf).unwrap(), UnixRecv::Closed);
    }
}
