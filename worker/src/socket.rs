//! [`RingSocket`]: a quinn [`AsyncUdpSocket`] whose receive side is a ringmux ingress (the shared
//! memory ring, or the baseline unix `SOCK_SEQPACKET` socket) and whose send side is this
//! process's own descriptor of the public UDP socket. Put any quinn application behind ringmux
//! by building its endpoint with `Endpoint::new_with_abstract_socket(.., Arc::new(ring_socket), ..)`.
//!
//! Receive: datagrams are copied from ring slots into quinn's buffers (quinn copies once more
//! into a `BytesMut`: the `AsyncUdpSocket` API lends it no buffer of ours). When the ring runs dry the socket keeps polling it cooperatively (returning
//! `Pending` after waking itself, so timers and sends still run) for the configured spin time,
//! then announces a sleep and waits on the doorbell eventfd through tokio's reactor.
//!
//! Send: `quinn::udp::UdpSocketState::send` with GSO on the public socket. The socket's options
//! belong to the demux and are never changed here (the send state is probed on a scratch
//! socket, see `send_state`). The descriptor is never registered with the reactor: every worker
//! shares the socket's file description, and a registration for writability would wake every
//! worker after any worker's send (the kernel's write-space callback wakes every waiter on the
//! shared socket). `poll_writable` is always ready unless the last
//! send hit `EAGAIN`, after which it waits a short timer. Only `WouldBlock` ever reaches quinn: any other send
//! error ends that connection's driver (quinn 0.11 `connection.rs`). Errors from `poll_recv`
//! would kill the whole endpoint, so malformed ingress is dropped and counted, never returned.

use std::fmt;
use std::future::Future;
use std::io::{self, IoSliceMut};
use std::net::SocketAddr;
use std::os::fd::{AsFd, OwnedFd};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use quinn::udp::{EcnCodepoint, RecvMeta, Transmit, UdpSockRef, UdpSocketState};
use quinn::{AsyncUdpSocket, UdpPoller};
use ringmux_ring::DatagramMeta;
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;

/// How long `poll_writable` backs off after a send hit `EAGAIN`.
const SEND_BACKOFF: Duration = Duration::from_micros(200);

pub use crate::ingress::Ingress;
use crate::ingress::{recv_unix, UnixRecv};

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

/// A quinn socket over a ringmux ingress; see the module docs.
pub struct RingSocket {
    rx: Mutex<RxState>,
    /// Readiness of the doorbell (ring) or of the unix socket, through tokio's reactor.
    rx_fd: AsyncFd<OwnedFd>,
    tx: std::net::UdpSocket,
    tx_state: UdpSocketState,
    public_addr: SocketAddr,
    send_blocked: AtomicBool,
    stats: Arc<IngressStats>,
}

struct RxState {
    ingress: Ingress,
    /// When the ring was first seen empty in this idle period.
    spin_started: Option<Instant>,
    /// A sleep is announced (`need_wakeup` set).
    sleeping: bool,
    /// Set after a producer protocol violation: the ingress is dead, wait for the supervisor.
    broken: bool,
}

impl RingSocket {
    /// Wraps an ingress and this process's descriptor of the public socket. Must run inside a
    /// tokio runtime (it registers the doorbell or unix socket with the reactor).
    pub fn new(ingress: Ingress, public: OwnedFd, public_addr: SocketAddr) -> io::Result<Self> {
        let rx_raw = match &ingress {
            Ingress::Ring(c) => c.doorbell_fd().try_clone_to_owned()?,
            Ingress::Unix(fd) => {
                set_nonblocking(fd)?;
                fd.try_clone()?
            }
        };
        // SAFETY: `rx_raw` is an owned, open descriptor that the AsyncFd keeps for its lifetime.
        let rx_fd = unsafe { AsyncFd::register_with_interest(rx_raw, Interest::READABLE) }
            .map_err(io::Error::from)?;
        let tx = std::net::UdpSocket::from(public);
        // Sends must not block; the demux set this already on the file description we share.
        tx.set_nonblocking(true)?;
        let tx_state = send_state(&tx)?;
        Ok(RingSocket {
            rx: Mutex::new(RxState {
                ingress,
                spin_started: None,
                sleeping: false,
                broken: false,
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

    fn poll_ring(
        &self,
        st: &mut RxState,
        cx: &mut Context<'_>,
        bufs: &mut [IoSliceMut<'_>],
        meta: &mut [RecvMeta],
    ) -> Poll<io::Result<usize>> {
        loop {
            let Ingress::Ring(consumer) = &mut st.ingress else {
                unreachable!("poll_ring on a ring")
            };
            let spin = consumer.spin();
            let mut n = 0;
            let mut dropped = 0u64;
            let max = bufs.len().min(meta.len());
            let drained = consumer.drain(max, |d| {
                let buf = &mut bufs[n];
                if d.payload.len() > buf.len() {
                    dropped += 1;
                    return;
                }
                buf[..d.payload.len()].copy_from_slice(d.payload);
                meta[n] = recv_meta(&d.meta, d.payload.len());
                n += 1;
            });
            let drained = match drained {
                Ok(d) => d,
                Err(e) => {
                    // The demux is the trusted side; a violation means its memory is corrupt.
                    // Stop reading (an error here would kill every connection) and let the
                    // supervisor notice through the control socket.
                    tracing::error!(error = %e, "ring protocol violation by the producer; ingress stopped");
                    st.broken = true;
                    return Poll::Pending;
                }
            };
            dropped += drained.invalid as u64;
            if dropped > 0 {
                self.stats.dropped.fetch_add(dropped, Ordering::Relaxed);
            }
            if drained.slots > 0 {
                st.spin_started = None;
                if st.sleeping {
                    st.sleeping = false;
                    consumer.end_sleep();
                }
                if n > 0 {
                    self.stats.received.fetch_add(n as u64, Ordering::Relaxed);
                    return Poll::Ready(Ok(n));
                }
                continue; // everything drained was dropped: look again
            }
            if st.sleeping {
                match self.rx_fd.poll_read_ready(cx) {
                    Poll::Ready(Ok(mut guard)) => {
                        guard.clear_ready();
                        st.sleeping = false;
                        consumer.end_sleep();
                        st.spin_started = Some(Instant::now());
                        continue;
                    }
                    Poll::Ready(Err(e)) => {
                        tracing::error!(error = %e, "doorbell registration failed");
                        st.broken = true;
                        return Poll::Pending;
                    }
                    Poll::Pending => return Poll::Pending,
                }
            }
            let now = Instant::now();
            let started = *st.spin_started.get_or_insert(now);
            if now.duration_since(started) < spin {
                // Cooperative spin: let the runtime run timers and sends, then poll again.
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
            match consumer.prepare_sleep() {
                Ok(true) => {
                    st.sleeping = true;
                    self.stats.sleeps.fetch_add(1, Ordering::Relaxed);
                }
                Ok(false) => {}
                Err(e) => {
                    tracing::error!(error = %e, "ring protocol violation by the producer; ingress stopped");
                    st.broken = true;
                    return Poll::Pending;
                }
            }
        }
    }

    fn poll_unix(
        &self,
        cx: &mut Context<'_>,
        bufs: &mut [IoSliceMut<'_>],
        meta: &mut [RecvMeta],
    ) -> Poll<io::Result<usize>> {
        loop {
            let mut guard = match self.rx_fd.poll_read_ready(cx) {
                Poll::Ready(Ok(g)) => g,
                Poll::Ready(Err(e)) => {
                    tracing::error!(error = %e, "unix ingress registration failed");
                    return Poll::Pending;
                }
                Poll::Pending => return Poll::Pending,
            };
            let fd = self.rx_fd.get_ref().as_fd();
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
                self.stats.dropped.fetch_add(dropped, Ordering::Relaxed);
            }
            if n > 0 {
                self.stats.received.fetch_add(n as u64, Ordering::Relaxed);
                return Poll::Ready(Ok(n));
            }
            if closed {
                // The demux is gone; the control socket tells the worker to exit.
                return Poll::Pending;
            }
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

/// quinn-udp's send state for the public socket, probed on a scratch socket of the same family.
///
/// `UdpSocketState::new` sets socket options, and the public socket's options belong to the
/// demux: this descriptor shares its file description (a passed descriptor shares options and
/// `O_NONBLOCK` with the original), so options set here would
/// change how the demux receives (it turns the per-datagram destination address off when it is
/// bound to a specific address, for example). The state itself only records what the kernel
/// supports (GSO segments, fragmentation control), which a scratch socket tells as well; the
/// demux has already set the public socket's send-side options (no fragmentation).
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

fn set_nonblocking(fd: &OwnedFd) -> io::Result<()> {
    socket2::SockRef::from(fd).set_nonblocking(true)
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
        // and swallowed so that quinn never freezes a connection over them (G3).
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
        if st.broken {
            return Poll::Pending;
        }
        match st.ingress {
            Ingress::Ring(_) => self.poll_ring(&mut st, cx, bufs, meta),
            Ingress::Unix(_) => {
                drop(st);
                self.poll_unix(cx, bufs, meta)
            }
        }
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

/// Send readiness without registering the shared descriptor (G2).
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
