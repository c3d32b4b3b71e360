//! [`RingSocket`]: a quinn [`AsyncUdpSocket`] whose receive side is a ringmux ingress (the shared
//! memory ring, or the baseline unix `SOCK_SEQPACKET` socket) and whose send side is the
//! worker's own sending socket (descriptor 4: bound by the demux to the public address, a member
//! of the public socket's `SO_REUSEPORT` group that never receives). Put any quinn application behind ringmux
//! by building its endpoint with `Endpoint::new_with_abstract_socket(.., Arc::new(ring_socket), ..)`.
//!
//! Receive: datagrams are copied from ring slots into quinn's buffers (quinn copies once more
//! into a `BytesMut`: the `AsyncUdpSocket` API lends it no buffer of ours). When the ring runs dry the socket keeps polling it cooperatively (returning
//! `Pending` after waking itself, so timers and sends still run) for the configured spin time,
//! then announces a sleep and waits on the doorbell pipe through tokio's reactor.
//!
//! Send: `quinn::udp::UdpSocketState::send` with GSO on the sending socket. The socket's options
//! belong to the demux and are never changed here (the send state is probed on a scratch
//! socket, see `send_state`). The descriptor is not registered with the reactor: it never
//! receives, and it is writable unless its send buffer is full, so `poll_writable` is always
//! ready unless the last send hit `EAGAIN`, after which it waits a short timer. Only
//! `WouldBlock` ever reaches quinn: any other send error ends that connection's driver (quinn
//! 0.11). Errors from `poll_recv` would kill the whole endpoint, so malformed ingress is dropped
//! and counted, never returned.

use std::fmt;
use std::future::Future;
use std::io::{self, IoSliceMut};
use std::net::SocketAddr;
use std::os::fd::{AsFd, OwnedFd};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use quinn::udp::{RecvMeta, Transmit, UdpSockRef, UdpSocketState};
use quinn::{AsyncUdpSocket, UdpPoller};

/// How long `poll_writable` backs off after a send hit `EAGAIN`.
const SEND_BACKOFF: Duration = Duration::from_micros(200);

use crate::ingress::shm::Idle;
pub use crate::ingress::{Ingress, IngressStats};
use crate::sys::AsyncReadable;

/// A quinn socket over a ringmux ingress; see the module docs.
pub struct RingSocket {
    rx: Mutex<RxState>,
    /// Readiness of the doorbell (ring) or of the unix socket, through tokio's reactor.
    rx_fd: AsyncReadable,
    tx: std::net::UdpSocket,
    tx_state: UdpSocketState,
    public_addr: SocketAddr,
    send_blocked: AtomicBool,
    stats: Arc<IngressStats>,
}

struct RxState {
    ingress: Ingress,
    idle: Idle,
}

impl RingSocket {
    /// Wraps an ingress and this process's descriptor of the public socket. Must run inside a
    /// tokio runtime (it registers the doorbell or unix socket with the reactor).
    pub fn new(ingress: Ingress, public: OwnedFd, public_addr: SocketAddr) -> io::Result<Self> {
        let rx_fd = AsyncReadable::new(ingress.wake_fd()?)?;
        let tx = std::net::UdpSocket::from(public);
        // Sends must not block. The socket is this worker's own (the demux made it, bound to
        // the public address in the group whose steering never picks it), so its flags are too.
        tx.set_nonblocking(true)?;
        let tx_state = send_state(&tx)?;
        Ok(RingSocket {
            rx: Mutex::new(RxState {
                ingress,
                idle: Idle::default(),
            }),
            rx_fd,
            tx,
            tx_state,
            public_addr,
            send_blocked: AtomicBool::new(false),
            stats: Arc::default(),
        })
    }

    /// The counters, shared.
    pub fn stats(&self) -> Arc<IngressStats> {
        self.stats.clone()
    }
}

/// quinn-udp's send state for the public socket, probed on a scratch socket of the same family.
///
/// `UdpSocketState::new` sets socket options, which a confined worker may not set on its
/// sending socket (descriptor 4): the demux set its send-side options (no fragmentation)
/// before the worker started. The state itself only records what the kernel supports (GSO
/// segments, fragmentation control), which a scratch socket tells as well.
fn send_state(public: &std::net::UdpSocket) -> io::Result<UdpSocketState> {
    use socket2::{Domain, Protocol, Socket, Type};
    let local = public.local_addr()?;
    let scratch = Socket::new(
        Domain::for_address(local),
        Type::DGRAM.cloexec(),
        Some(Protocol::UDP),
    )?;
    if local.is_ipv6() {
        scratch.set_only_v6(socket2::SockRef::from(public).only_v6()?)?;
    }
    UdpSocketState::new(UdpSockRef::from(&scratch))
}

impl fmt::Debug for RingSocket {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RingSocket")
            .field("public_addr", &self.public_addr)
            .finish_non_exhaustive()
    }
}

impl AsyncUdpSocket for RingSocket {
    fn create_io_poller(self: Arc<Self>) -> Pin<Box<dyn UdpPoller>> {
        Box::pin(SendPoller {
            socket: self,
            backoff: None,
        })
    }

    fn try_send(&self, transmit: &Transmit<'_>) -> io::Result<()> {
        // `send`, not `try_send`: only WouldBlock escapes; EMSGSIZE, ECONNREFUSED etc. are logged
        // and swallowed, since quinn 0.11 ends a connection's driver on any other send error.
        match self.tx_state.send(UdpSockRef::from(&self.tx), transmit) {
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                self.send_blocked.store(true, Ordering::Relaxed);
                self.stats.send_would_block.fetch_add(1, Ordering::Relaxed);
                Err(e)
            }
            r => r,
        }
    }

    fn poll_recv(
        &self,
        cx: &mut Context<'_>,
        bufs: &mut [IoSliceMut<'_>],
        meta: &mut [RecvMeta],
    ) -> Poll<io::Result<usize>> {
        let mut st = self.rx.lock().unwrap_or_else(|p| p.into_inner());
        let RxState { ingress, idle } = &mut *st;
        if idle.broken {
            return Poll::Pending;
        }
        ingress.poll_recv(idle, &self.rx_fd, &self.stats, cx, bufs, meta)
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        Ok(self.public_addr)
    }

    fn max_transmit_segments(&self) -> usize {
        self.tx_state.max_gso_segments()
    }

    fn max_receive_segments(&self) -> usize {
        1 // the demux splits GRO trains: one datagram per slot
    }

    fn may_fragment(&self) -> bool {
        self.tx_state.may_fragment()
    }
}

/// Send readiness without registering the descriptor with the reactor: ready, or a short
/// timer after a send that hit `EAGAIN` (module documentation).
struct SendPoller {
    socket: Arc<RingSocket>,
    backoff: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl fmt::Debug for SendPoller {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SendPoller").finish_non_exhaustive()
    }
}

impl UdpPoller for SendPoller {
    fn poll_writable(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.socket.send_blocked.load(Ordering::Relaxed) && self.backoff.is_none() {
            self.backoff = Some(Box::pin(tokio::time::sleep(SEND_BACKOFF)));
        }
        if let Some(sleep) = self.backoff.as_mut() {
            if sleep.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            self.backoff = None;
            self.socket.send_blocked.store(false, Ordering::Relaxed);
        }
        Poll::Ready(Ok(()))
    }
}

// `AsFd` for callers that want to inspect the egress descriptor (e.g. buffer sizes).
impl AsFd for RingSocket {
    fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.tx.as_fd()
    }
}

/// The worker's own socket of its lane (`ingress=reuseport`, kernel steering): quinn's own
/// tokio socket, receiving and sending, with the datagrams it receives counted for the
/// demux's metrics. Nothing else differs from a plain quinn endpoint.
pub struct CountingSocket {
    inner: Arc<dyn AsyncUdpSocket>,
    stats: Arc<IngressStats>,
}

impl CountingSocket {
    /// Wraps `socket` (the worker's descriptor 4). Must run inside a tokio runtime.
    pub fn new(socket: OwnedFd) -> io::Result<Self> {
        let socket = std::net::UdpSocket::from(socket);
        socket.set_nonblocking(true)?;
        let inner = quinn::Runtime::wrap_udp_socket(&quinn::TokioRuntime, socket)?;
        Ok(CountingSocket {
            inner,
            stats: Arc::default(),
        })
    }

    /// The counters, shared.
    pub fn stats(&self) -> Arc<IngressStats> {
        self.stats.clone()
    }
}

impl fmt::Debug for CountingSocket {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CountingSocket")
            .field("inner", &self.inner)
            .finish()
    }
}

impl AsyncUdpSocket for CountingSocket {
    fn create_io_poller(self: Arc<Self>) -> Pin<Box<dyn UdpPoller>> {
        self.inner.clone().create_io_poller()
    }

    fn try_send(&self, transmit: &Transmit) -> io::Result<()> {
        let sent = self.inner.try_send(transmit);
        if matches!(&sent, Err(e) if e.kind() == io::ErrorKind::WouldBlock) {
            self.stats.send_would_block.fetch_add(1, Ordering::Relaxed);
        }
        sent
    }

    fn poll_recv(
        &self,
        cx: &mut Context<'_>,
        bufs: &mut [IoSliceMut<'_>],
        meta: &mut [RecvMeta],
    ) -> Poll<io::Result<usize>> {
        let polled = self.inner.poll_recv(cx, bufs, meta);
        if let Poll::Ready(Ok(n)) = &polled {
            // A GRO train counts as the datagrams it carries.
            let datagrams: usize = meta[..*n]
                .iter()
                .map(|m| m.len.div_ceil(m.stride.max(1)))
                .sum();
            self.stats
                .received
                .fetch_add(datagrams as u64, Ordering::Relaxed);
        }
        polled
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        self.inner.local_addr()
    }

    fn max_transmit_segments(&self) -> usize {
        self.inner.max_transmit_segments()
    }

    fn max_receive_segments(&self) -> usize {
        self.inner.max_receive_segments()
    }

    fn may_fragment(&self) -> bool {
        self.inner.may_fragment()
    }
}
