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

pub mod shm;
pub mod unix;

use std::io::{self, IoSliceMut};
use std::os::fd::OwnedFd;
use std::sync::atomic::AtomicU64;
use std::task::{Context, Poll};

use quinn::udp::{EcnCodepoint, RecvMeta};
use ringmux_proto::{Handoff, IngressKind};
use ringmux_ring::{Consumer, DatagramMeta};
use tokio::io::unix::AsyncFd;

pub use unix::{recv_unix, UnixRecv};

use crate::attach::AttachError;

/// Where datagrams come from.
// One per worker, made once: the ring consumer's size never moves in the hot path.
#[allow(clippy::large_enum_variant)]
pub enum Ingress {
    /// The shared-memory ring.
    Ring(Consumer),
    /// One `SOCK_SEQPACKET` message per datagram: a 64-byte slot descriptor, then the payload.
    Unix(OwnedFd),
}

/// Datagram counters of one socket.
#[derive(Debug, Default)]
pub struct IngressStats {
    /// Datagrams handed to quinn.
    pub received: AtomicU64,
    /// Datagrams dropped: larger than quinn's buffer, or a descriptor that failed validation.
    pub dropped: AtomicU64,
    /// Times the socket went to sleep on its doorbell.
    pub sleeps: AtomicU64,
    /// Sends that hit `EAGAIN`.
    pub send_would_block: AtomicU64,
}

impl Ingress {
    /// The ingress hand-off `h` describes, built from its descriptors: `next` gives them in
    /// hand-off order, naming the one it wants. `None`: the worker receives on its own socket
    /// (descriptor 4) and has no ingress.
    pub(crate) fn from_handoff(
        h: &Handoff,
        mut next: impl FnMut(&'static str) -> Result<OwnedFd, AttachError>,
    ) -> Result<Option<Ingress>, AttachError> {
        Ok(match h.ingress {
            IngressKind::Reuseport => None,
            IngressKind::Shm => {
                let (ring, page, bell) = (next("ring")?, next("page")?, next("doorbell")?);
                let consumer =
                    Consumer::attach(ring, page, bell, h.generation, h.spin).map_err(|e| {
                        AttachError::Handoff {
                            what: "ring",
                            problem: e.to_string(),
                        }
                    })?;
                Some(Ingress::Ring(consumer))
            }
            IngressKind::Unix => Some(Ingress::Unix(next("unix ingress socket")?)),
        })
    }

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

fn recv_meta(m: &DatagramMeta, len: usize) -> RecvMeta {
    RecvMeta {
        addr: m.remote,
        len,
        stride: len,
        ecn: EcnCodepoint::from_bits(m.ecn),
        dst_ip: m.local_ip,
    }
}
