//! Where a worker's datagrams come from: one file per forwarding mode, the counterpart of the
//! demux's `forward/`.
//!
//! * [`shm`]: the shared-memory ring (`shm-layout.md`), drained with `ringmux_ring::Consumer`.
//! * [`unix`]: the baseline, one `SOCK_SEQPACKET` message per datagram, and the one decoder
//!   of its framing.
//!
//! [`crate::socket::RingSocket`] (quinn) and [`crate::Worker::into_raw`] (a worker without quinn,
//! such as ringmux's benchmark sink) read from an
//! [`Ingress`].

mod received;
pub mod shm;
pub mod unix;

use std::io::{self, IoSliceMut};
use std::os::fd::OwnedFd;
use std::task::{Context, Poll};

use quinn::udp::RecvMeta;
use ringmux_ring::Consumer;
use tokio::io::unix::AsyncFd;

pub use received::IngressStats;
pub use unix::{recv_unix, UnixRecv};

/// Where datagrams come from.
// One per worker, made once: the ring consumer's size never moves in the hot path.
#[allow(clippy::large_enum_variant)]
pub enum Ingress {
    /// The shared-memory ring.
    Ring(Consumer),
    /// One `SOCK_SEQPACKET` message per datagram: a 64-byte slot descriptor, then the payload.
    Unix(OwnedFd),
}

impl Ingress {
    /// The descriptor whose readability wakes a reader: the doorbell of a ring, the socket
    /// itself for the unix ingress.
    pub(crate) fn wake_fd(&self) -> io::Result<OwnedFd> {
        match self {
            Ingress::Ring(c) => c.doorbell_fd().try_clone_to_owned(),
            Ingress::Unix(fd) => {
                socket2::SockRef::from(fd).set_nonblocking(true)?;
                fd.try_clone()
            }
        }
    }

    /// Fills quinn's buffers from this ingress; see each mode's `poll_recv`. `wake` is
    /// [`Ingress::wake_fd`] registered with tokio's reactor.
    pub(crate) fn poll_recv(
        &mut self,
        idle: &mut shm::Idle,
        wake: &AsyncFd<OwnedFd>,
        stats: &IngressStats,
        cx: &mut Context<'_>,
        bufs: &mut [IoSliceMut<'_>],
        meta: &mut [RecvMeta],
    ) -> Poll<io::Result<usize>> {
        match self {
            Ingress::Ring(consumer) => shm::poll_recv(consumer, idle, wake, stats, cx, bufs, meta),
            Ingress::Unix(_) => unix::poll_recv(wake, stats, cx, bufs, meta),
        }
    }
}
