//! The receive loop: `recvmmsg` + GRO through quinn-udp, split every GRO train into datagrams,
//! route each with the QUIC-LB [`Router`], hand it to its instance through the forwarding mode
//! ([`Forward`]: a ring, a unix socket, or nowhere), and publish once per batch. No allocation,
//! lock or syscall per datagram beyond the receive itself (`unix` mode adds its one `sendmsg`,
//! which is the point of comparing it).
//!
//! The loop owns the producers. The supervisor talks to it through [`Control`]: it marks
//! instances up or down, asks for ring resets (a new consumer generation for a replacement
//! worker) and reads back fresh hand-off descriptors; the loop reports protocol violations and
//! stalls. Commands are looked at once per batch (one relaxed load when there are none).
//!
//! Beside the loop, the rest of the data plane: what becomes of one datagram ([`dispatch`]),
//! new connections under pressure ([`admission`]), the ClientHellos' session tickets
//! ([`tickets`]) and the forwarding modes ([`forward`]). The crate root re-exports the four
//! (`ringmux_demux::forward`, …).

pub mod admission;
pub mod coalesce;
pub mod dispatch;
pub mod forward;
pub mod tickets;

use std::io::{self, IoSliceMut};
use std::net::{IpAddr, SocketAddr};
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, Sender, SyncSender};
use std::sync::Arc;
use std::time::{Duration, Instant};

use quinn_udp::{RecvMeta, Transmit, UdpSockRef, UdpSocketState};
use ringmux_quic_lb::{RouteCache, Router};
use ringmux_ring::layout::SlotDesc;
use ringmux_ring::{encode_desc, monotonic_ns, DatagramMeta};

use crate::admission::Admission;
use crate::dataplane::coalesce::{Coalesce, Wait};
use crate::dispatch::{classify, Arrival, Disposition};
use crate::forward::{Forward, IngressHandles};
use crate::metrics::{Counters, DropReason};
use crate::sys::{self, RecvCmsg};

/// Largest datagram train one receive buffer holds (UDP GRO caps a super-datagram at 64 KiB).
const RECV_BUF: usize = 65536;
/// How often occupancy and doorbell gauges are refreshed and stalls checked.
const GAUGE_PERIOD: Duration = Duration::from_millis(100);
/// Batches at most this far apart (ns) keep the rings' `busy` word: what a consumer spins on it.
const BUSY_NS: u64 = ringmux_ring::spin::BUSY_SPIN.as_nanos() as u64;

/// What one receive brought.
enum Received {
    /// This many messages (each a datagram or a GRO train).
    Batch(usize),
    /// Nothing after a wait: a moment to refresh the gauges.
    Idle,
    /// Nothing, at once (interrupted, or an error, logged): receive again.
    Again,
}

/// A reset waiting for its ring: the lane, and where its descriptors go.
type Deferred = (u8, SyncSender<io::Result<IngressHandles>>);

/// Supervisor → data plane requests. Lanes are numbered as [`Router::lane`] numbers them.
pub enum Command {
    /// Start a new ingress generation for lane `lane` and send its descriptors back.
    Reset {
        lane: u8,
        reply: SyncSender<io::Result<IngressHandles>>,
    },
    /// From the next batch on, hash new connections to the lanes of generation slot `slot`.
    Activate { slot: u8, reply: SyncSender<()> },
    /// Lane `lane`'s worker generation is gone: close its ingress.
    Close { lane: u8 },
}

/// Data plane → supervisor events.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    /// The worker of lane `lane` broke the ring protocol or stopped draining: kill (and
    /// replace) it.
    Misbehaved { lane: u8, stalled: bool },
}

/// The lanes' up flags the supervisor and the data plane share, which the metrics read (defined
/// with the metrics, below both).
pub use crate::metrics::Liveness;

/// The channel pair and flags shared with the supervisor.
pub struct Control {
    pub commands: Receiver<Command>,
    pub pending: Arc<AtomicBool>,
    pub events: Sender<Event>,
    pub stop: Arc<AtomicBool>,
    pub liveness: Arc<Liveness>,
}

/// The supervisor's end of the channels to the data plane.
pub struct DataPlaneLink {
    commands: Sender<Command>,
    pending: Arc<AtomicBool>,
    events: Receiver<Event>,
    liveness: Arc<Liveness>,
}

impl DataPlaneLink {
    /// Creates both ends: the supervisor's link and the data plane's [`Control`].
    pub fn new(stop: Arc<AtomicBool>, liveness: Arc<Liveness>) -> (DataPlaneLink, Control) {
        let (commands, command_rx) = std::sync::mpsc::channel();
        let (event_tx, events) = std::sync::mpsc::channel();
        let pending = Arc::new(AtomicBool::new(false));
        let control = Control {
            commands: command_rx,
            pending: pending.clone(),
            events: event_tx,
            stop,
            liveness: liveness.clone(),
        };
        (
            DataPlaneLink {
                commands,
                pending,
                events,
                liveness,
            },
            control,
        )
    }

    /// Asks for a new ingress generation of lane `lane` (its first, for a new worker
    /// generation); its hand-off descriptors arrive on the returned receiver once the data
    /// plane has made it (within one batch or poll).
    pub fn request_reset(&self, lane: u8) -> Receiver<io::Result<IngressHandles>> {
        // Bounded: its one slot is allocated here, so the data plane's reply allocates nothing.
        let (reply, rx) = std::sync::mpsc::sync_channel(1);
        self.send(Command::Reset { lane, reply });
        rx
    }

    /// Hashes new connections to the lanes of `slot` from the next batch on; the returned
    /// receiver hears when the data plane has switched.
    pub fn activate(&self, slot: u8) -> Receiver<()> {
        let (reply, rx) = std::sync::mpsc::sync_channel(1);
        self.send(Command::Activate { slot, reply });
        rx
    }

    /// Closes lane `lane`'s ingress (its generation is gone).
    pub fn close(&self, lane: u8) {
        self.send(Command::Close { lane });
    }

    fn send(&self, cmd: Command) {
        let _ = self.commands.send(cmd);
        self.pending.store(true, Ordering::Release);
    }

    /// The flags shared with the data plane.
    pub fn liveness(&self) -> &Liveness {
        &self.liveness
    }

    /// The next misbehaviour report, if any.
    pub fn next_event(&self) -> Option<Event> {
        self.events.try_recv().ok()
    }
}

/// The demux's descriptor of the public socket, configured for receiving.
pub struct PublicSocket {
    socket: std::net::UdpSocket,
    state: UdpSocketState,
    /// The address the socket is bound to, when it is a specific one: then every datagram's
    /// destination is known without asking the kernel for it.
    fixed_local_ip: Option<IpAddr>,
}

impl PublicSocket {
    /// Configures a bound socket: quinn-udp's options (non-blocking, GRO, ECN, destination
    /// address, no fragmentation), then, when it is bound to a specific address, turns the
    /// per-datagram destination-address control message (`IP_PKTINFO` / `IPV6_RECVPKTINFO`)
    /// off again: the kernel would build one for every datagram to say what is already known.
    ///
    /// Workers never change options of this socket (they share its file description):
    /// `ringmux_worker::RingSocket` probes its send capabilities on a scratch socket.
    ///
    /// With `ecn` false it also turns the ECN control messages (`IP_RECVTOS`, and
    /// `IPV6_RECVTCLASS` on an IPv6 socket) off: datagrams then reach the workers as not-ECT.
    pub fn new(socket: std::net::UdpSocket, ecn: bool) -> io::Result<Self> {
        let state = UdpSocketState::new(UdpSockRef::from(&socket))?;
        let local = socket.local_addr()?;
        let fixed_local_ip = if local.ip().is_unspecified() {
            None
        } else {
            match local {
                SocketAddr::V4(_) => sys::switch_off(socket.as_fd(), RecvCmsg::Ipv4PacketInfo)?,
                SocketAddr::V6(_) => sys::switch_off(socket.as_fd(), RecvCmsg::Ipv6PacketInfo)?,
            }
            Some(local.ip())
        };
        if !ecn {
            if local.is_ipv6() {
                sys::switch_off(socket.as_fd(), RecvCmsg::Ipv6TrafficClass)?;
            }
            // Also on a dual-stack IPv6 socket, for its IPv4 traffic (quinn-udp sets both).
            if local.is_ipv4() || !socket2::SockRef::from(&socket).only_v6()? {
                sys::switch_off(socket.as_fd(), RecvCmsg::Ipv4Tos)?;
            }
        }
        Ok(PublicSocket {
            socket,
            state,
            fixed_local_ip,
        })
    }

    /// The underlying socket (to duplicate its descriptor for the workers).
    pub fn socket(&self) -> &std::net::UdpSocket {
        &self.socket
    }
}

pub struct DataPlane<F> {
    public: PublicSocket,
    router: Router,
    forward: F,
    counters: Arc<Counters>,
    admission: Admission,
    batch: usize,
    stall: Duration,
    /// The first lane of the generation slot new connections go to.
    active: usize,
    /// When the last batch was received (`CLOCK_MONOTONIC`, ns).
    last_recv_ns: u64,
    /// When a previous process image received its last datagram, until this one receives its
    /// first: the upgrade's pause is the difference.
    resumed_after: Option<u64>,
    /// Receive errors logged so far (the first ten are).
    errors_logged: u32,
    /// How the loop waits once the queue is empty: the socket, or a coalescing window.
    coalesce: Coalesce,
    /// When the coalescing window the next receive follows began (ns): no datagram it takes
    /// arrived before, so it is their receive timestamp (the window's wait counts as latency).
    window_began_ns: Option<u64>,
}

/// Per-lane bookkeeping the loop keeps to itself.
#[derive(Clone, Copy)]
struct Local {
    forwarded: u64,
    up: bool,
    /// Consumed count and when it last moved (stall detection).
    consumed: u64,
    consumed_at: Instant,
    /// The consumer broke the protocol since the last reset.
    violated: bool,
    /// The supervisor was told about this generation's misbehaviour.
    reported: bool,
    /// The ingress was past `--initial-shed-at` when this batch began: new connections wait.
    crowded: bool,
}

impl<F: Forward> DataPlane<F> {
    pub fn new(
        public: PublicSocket,
        router: Router,
        forward: F,
        counters: Arc<Counters>,
        admission: Admission,
        batch: usize,
        stall: Duration,
    ) -> Self {
        DataPlane {
            public,
            router,
            forward,
            counters,
            admission,
            batch,
            stall,
            active: 0,
            last_recv_ns: 0,
            errors_logged: 0,
            resumed_after: None,
            coalesce: Coalesce::new(Duration::ZERO, batch),
            window_began_ns: None,
        }
    }

    /// After a receive that emptied the socket's queue, sleep up to `max` for more datagrams
    /// while they keep coming ([`coalesce`]; zero: always wait on the socket).
    pub fn coalescing(mut self, max: Duration) -> Self {
        self.coalesce = Coalesce::new(max, self.batch);
        self
    }

    /// Measures the pause of an upgrade from `last_recv_ns`, when the previous image received
    /// its last datagram ([`DataPlane::last_recv_ns`] there).
    pub fn resumed_after(mut self, last_recv_ns: Option<u64>) -> Self {
        self.resumed_after = last_recv_ns.filter(|&t| t > 0);
        self
    }

    /// When the last batch was received (`CLOCK_MONOTONIC`, ns; 0: none yet).
    pub fn last_recv_ns(&self) -> u64 {
        self.last_recv_ns
    }

    /// New connections go to the lanes of generation slot `slot` (a data plane taking over
    /// from a previous process image of the demux).
    pub fn with_active_slot(mut self, slot: u8) -> Self {
        self.active = usize::from(self.router.lane(0, slot));
        self
    }

    /// The public socket's descriptor number and every lane's ingress, for a new process image
    /// (`ringmux upgrade`); call it once [`DataPlane::run`] has returned. Everything stays
    /// owned here.
    pub fn export(
        &mut self,
    ) -> io::Result<(
        std::os::fd::RawFd,
        Vec<Option<crate::forward::handover::IngressState>>,
    )> {
        use std::os::fd::AsRawFd;
        self.forward.publish(false);
        let lanes = (0..self.router.lanes())
            .map(|l| self.forward.export(l))
            .collect::<io::Result<_>>()?;
        Ok((self.public.socket.as_raw_fd(), lanes))
    }

    /// Runs until `control.stop` is set, then hands itself and `control` back (to run again,
    /// or to be exported for an upgrade). The counters go on from what they hold.
    pub fn run(mut self, control: Control) -> (Self, Control) {
        let mut active = self.active;
        let mut storage = vec![0u8; RECV_BUF * self.batch];
        let mut iovs: Vec<IoSliceMut<'_>> =
            storage.chunks_mut(RECV_BUF).map(IoSliceMut::new).collect();
        let fixed_local_ip = self.public.fixed_local_ip;
        let mut metas = vec![RecvMeta::default(); self.batch];
        // Resets waiting for their ring (at most one per lane), and the round's copy.
        let mut deferred = Vec::with_capacity(self.router.lanes());
        let mut retry = Vec::with_capacity(self.router.lanes());
        let now = Instant::now();
        let (mut local, mut received, mut recv_calls, mut dropped) = self.resume_counting(now);
        self.enter_loop();
        let mut last_gauges = now;
        let mut last_gauges_ns = monotonic_ns();
        // The last receive returned fewer messages than it had room for, and how many it
        // returned.
        let mut queue_empty = false;
        let mut found = 0usize;

        while !control.stop.load(Ordering::Relaxed) {
            self.take_commands(&control, &mut local, &mut active, &mut deferred, &mut retry);
            for (i, l) in local.iter_mut().enumerate() {
                l.up = !l.violated && control.liveness.is_up(i);
            }
            // A deferred reset waits for a ring being made: look again soon.
            let wait = if deferred.is_empty() {
                GAUGE_PERIOD
            } else {
                Duration::from_millis(1)
            };
            let n = match self.receive(&mut iovs, &mut metas, &mut queue_empty, found, wait) {
                Received::Batch(n) => n,
                Received::Idle => {
                    self.refresh_gauges(&mut local, &control, &mut last_gauges);
                    continue;
                }
                Received::Again => continue,
            };
            recv_calls += 1;
            let ts = monotonic_ns();
            // Datagrams a coalescing window gathered are stamped with its beginning.
            let rx_ns = self.window_began_ns.take().unwrap_or(ts);
            // Saturated: this receive filled its batch (more wait in the socket) and came
            // soon after the one before, so the next publish is near.
            let busy = !queue_empty && ts.saturating_sub(self.last_recv_ns) <= BUSY_NS;
            self.begin_batch(&mut local, ts);
            // Routes are remembered within one batch only: a reset or restart between batches
            // can never see a stale entry (routing is pure anyway).
            let mut cache = RouteCache::new(&self.router);
            for (meta, iov) in metas.iter().zip(iovs.iter()).take(n) {
                let data = &iov[..meta.len.min(iov.len())];
                let stride = if meta.stride == 0 {
                    data.len().max(1)
                } else {
                    meta.stride
                };
                // Segments of a train share addresses, ECN and timestamp: encode once.
                let desc = encode_desc(
                    &DatagramMeta {
                        remote: meta.addr,
                        local_ip: meta.dst_ip.or(fixed_local_ip),
                        ecn: meta.ecn.map_or(0, |e| e as u8),
                        segment_size: 0,
                        rx_timestamp_ns: rx_ns,
                    },
                    0,
                );
                if data.is_empty() {
                    // `chunks` yields nothing for an empty datagram: count it here.
                    received += 1;
                    dropped[DropReason::Malformed as usize] += 1;
                    continue;
                }
                // Each GRO segment is routed on its own: one train can carry several DCIDs.
                for seg in data.chunks(stride) {
                    received += 1;
                    let arrival = Arrival {
                        bytes: seg,
                        remote: meta.addr,
                        now_ns: ts,
                    };
                    let disposition = classify(
                        &self.router,
                        &mut cache,
                        &mut self.admission,
                        arrival,
                        active,
                        |lane| local[lane].crowded,
                    );
                    let reason = match disposition {
                        Disposition::Forward { lane } => {
                            match self.push(&mut local[lane], lane, &desc, seg) {
                                Ok(()) => continue,
                                Err(reason) => reason,
                            }
                        }
                        Disposition::Drop(reason) => reason,
                        Disposition::Retry => {
                            self.send_retry(meta.addr, meta.dst_ip.or(fixed_local_ip));
                            DropReason::Retry
                        }
                    };
                    dropped[reason as usize] += 1;
                }
            }
            self.forward.publish(busy);
            // Arrivals are counted in messages: a GRO train came as one, and woke one wake-up.
            found = n;
            self.coalesce.received(ts, n);
            self.publish_counters(received, recv_calls, &dropped, &local, ts);
            // Reuses the batch's receive timestamp: no second clock read per batch.
            if ts.saturating_sub(last_gauges_ns) >= GAUGE_PERIOD.as_nanos() as u64 {
                last_gauges_ns = ts;
                self.refresh_gauges(&mut local, &control, &mut last_gauges);
            }
        }
        self.leave_loop(active, &mut deferred);
        (self, control)
    }

    /// What the loop does once it has its buffers, before its first receive: from here on
    /// every allocation on this thread is counted (ringmux_dataplane_allocations_total), and
    /// coalescing windows end when asked. Once per run, kept out of the loop's code.
    #[cold]
    #[inline(never)]
    fn enter_loop(&self) {
        crate::alloc::count_this_thread();
        if !self.coalesce.max().is_zero() {
            // Windows end when asked, not up to 50 µs later.
            if let Err(e) = sys::set_timer_slack(Duration::from_micros(1)) {
                tracing::warn!(error = %e, "could not shorten the data plane's timer slack");
            }
        }
    }

    /// What the loop does once stopped: the final publish, so nothing written stays
    /// invisible; the active slot kept for the next run; and every reset still waiting for
    /// its ring answered (the supervisor asks again).
    #[cold]
    #[inline(never)]
    fn leave_loop(&mut self, active: usize, deferred: &mut Vec<Deferred>) {
        self.forward.publish(false);
        self.active = active;
        for (_, reply) in deferred.drain(..) {
            let _ = reply.send(Err(io::ErrorKind::Interrupted.into()));
        }
    }

    /// Carries out one command. A reset whose new ingress is not ready yet (the mode says
    /// `WouldBlock`) waits in `deferred` and is tried again each round.
    fn execute(
        &mut self,
        cmd: Command,
        local: &mut [Local],
        active: &mut usize,
        deferred: &mut Vec<Deferred>,
    ) {
        match cmd {
            Command::Activate { slot, reply } => {
                *active = usize::from(self.router.lane(0, slot));
                self.forward.activate(slot);
                let _ = reply.send(());
            }
            Command::Close { lane } => {
                let i = lane as usize;
                let left = self.forward.close(i);
                let c = &self.counters.instances[i];
                c.discarded_on_reset.fetch_add(left, Ordering::Relaxed);
                c.occupancy.store(0, Ordering::Relaxed);
                local[i].reported = false;
                local[i].violated = false;
            }
            Command::Reset { lane, reply } => {
                let i = lane as usize;
                let result = self.forward.reset(i);
                if matches!(&result, Err(e) if e.kind() == io::ErrorKind::WouldBlock) {
                    // Its ring is still being made off this thread: again next round.
                    deferred.push((lane, reply));
                    return;
                }
                let result = result.map(|(handles, discarded)| {
                    let c = &self.counters.instances[i];
                    c.discarded_on_reset.fetch_add(discarded, Ordering::Relaxed);
                    handles
                });
                local[i].reported = false;
                local[i].violated = false;
                local[i].consumed_at = Instant::now();
                let _ = reply.send(result);
            }
        }
    }

    /// One receive, waiting first when the last one came back short (the queue empty then,
    /// after `found` messages): for a coalescing window while datagrams keep coming, else in
    /// `poll` for at most `wait`.
    fn receive(
        &mut self,
        iovs: &mut [IoSliceMut<'_>],
        metas: &mut [RecvMeta],
        queue_empty: &mut bool,
        found: usize,
        wait: Duration,
    ) -> Received {
        if std::mem::take(queue_empty) {
            match self.coalesce.next_wait(found) {
                Wait::Window(window) => {
                    // Nobody waits on the socket meanwhile: arrivals wake no one.
                    self.window_began_ns = Some(monotonic_ns());
                    std::thread::sleep(window);
                    self.counters.recv_windows.fetch_add(1, Ordering::Relaxed);
                }
                // Sleep in poll straight away (it returns at once if datagrams came
                // meanwhile) instead of paying for a receive that finds nothing: at light
                // load, where each wake-up brings one batch, that is one system call of three
                // per wake-up.
                Wait::Socket => {
                    if !sys::wait_readable(self.public.socket.as_fd(), wait).unwrap_or(true) {
                        return Received::Idle;
                    }
                }
            }
        }
        match self
            .public
            .state
            .recv(UdpSockRef::from(&self.public.socket), iovs, metas)
        {
            Ok(n) => {
                *queue_empty = n < iovs.len();
                Received::Batch(n)
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                if self.window_began_ns.take().is_some() {
                    // A window that brought nothing: the flow stopped; back to the socket.
                    self.coalesce.received(monotonic_ns(), 0);
                }
                let _ = sys::wait_readable(self.public.socket.as_fd(), wait);
                Received::Idle
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => Received::Again,
            Err(e) => {
                if self.errors_logged < 10 {
                    tracing::warn!(error = %e, "receive failed");
                    self.errors_logged += 1;
                }
                Received::Again
            }
        }
    }

    /// What a batch received at `now_ns` starts with: the upgrade pause (the first batch of a
    /// new image), and which rings are crowded. Once per batch, not per datagram: a batch can
    /// overshoot the threshold by its own size, and the rest of the ring still takes what
    /// established connections send. A crowded ring is pressure for the whole box: new
    /// connections to any instance then meet a Retry first.
    fn begin_batch(&mut self, local: &mut [Local], now_ns: u64) {
        if let Some(before) = self.resumed_after.take() {
            self.counters
                .upgrade_pause_ns
                .store(now_ns.saturating_sub(before), Ordering::Relaxed);
        }
        self.last_recv_ns = now_ns;
        let mut any_crowded = false;
        for (i, l) in local.iter_mut().enumerate() {
            l.crowded = self.forward.crowded(i);
            any_crowded |= l.crowded;
        }
        if any_crowded {
            self.admission.crowded(now_ns);
        }
    }

    /// Pushes a datagram [`classify`] forwarded to `lane`, unless its worker is down.
    #[inline]
    fn push(
        &mut self,
        l: &mut Local,
        lane: usize,
        desc: &SlotDesc,
        seg: &[u8],
    ) -> Result<(), DropReason> {
        if F::DELIVERS && !l.up {
            return Err(DropReason::InstanceDown);
        }
        match self.forward.push(lane, desc, seg) {
            Ok(()) => {
                l.forwarded += 1;
                Ok(())
            }
            Err(DropReason::RingViolation) => {
                // Stop pushing at once; the supervisor hears of it at the next gauge refresh.
                l.violated = true;
                l.up = false;
                Err(DropReason::RingViolation)
            }
            Err(reason) => Err(reason),
        }
    }

    /// The loop's per-lane state and its running totals, taken up from the counters (which
    /// go on from what a previous run or process image counted).
    fn resume_counting(
        &mut self,
        now: Instant,
    ) -> (Vec<Local>, u64, u64, [u64; DropReason::ALL.len()]) {
        let mut local = vec![
            Local {
                forwarded: 0,
                up: false,
                consumed: 0,
                consumed_at: now,
                violated: false,
                reported: false,
                crowded: false,
            };
            self.router.lanes()
        ];
        for (i, l) in local.iter_mut().enumerate() {
            l.forwarded = self.counters.instances[i].forwarded.load(Ordering::Relaxed);
        }
        let received = self.counters.received.load(Ordering::Relaxed);
        let recv_calls = self.counters.recv_calls.load(Ordering::Relaxed);
        let mut dropped = [0u64; DropReason::ALL.len()];
        for (d, c) in dropped.iter_mut().zip(&self.counters.dropped) {
            *d = c.load(Ordering::Relaxed);
        }
        self.admission.stats = crate::admission::Stats {
            retries_sent: self.counters.retries_sent.load(Ordering::Relaxed),
            retries_unsent: self.counters.retries_unsent.load(Ordering::Relaxed),
            tokens_accepted: self.counters.tokens_accepted.load(Ordering::Relaxed),
        };
        (local, received, recv_calls, dropped)
    }

    /// Carries out the supervisor's commands, if any came (one relaxed load when none did),
    /// and tries again the resets that wait for their ring.
    fn take_commands(
        &mut self,
        control: &Control,
        local: &mut [Local],
        active: &mut usize,
        deferred: &mut Vec<Deferred>,
        retry: &mut Vec<Deferred>,
    ) {
        // A plain load first: the swap (a locked instruction) only when there is work.
        if control.pending.load(Ordering::Relaxed) && control.pending.swap(false, Ordering::Acquire)
        {
            while let Ok(cmd) = control.commands.try_recv() {
                self.execute(cmd, local, active, deferred);
            }
        }
        if !deferred.is_empty() {
            std::mem::swap(retry, deferred);
            for (lane, reply) in retry.drain(..) {
                self.execute(Command::Reset { lane, reply }, local, active, deferred);
            }
        }
    }

    /// Publishes the batch's totals: single writer, plain stores.
    fn publish_counters(
        &self,
        received: u64,
        recv_calls: u64,
        dropped: &[u64],
        local: &[Local],
        now_ns: u64,
    ) {
        self.counters.received.store(received, Ordering::Relaxed);
        self.counters
            .recv_calls
            .store(recv_calls, Ordering::Relaxed);
        for (c, d) in self.counters.dropped.iter().zip(dropped) {
            c.store(*d, Ordering::Relaxed);
        }
        for (c, l) in self.counters.instances.iter().zip(local) {
            c.forwarded.store(l.forwarded, Ordering::Relaxed);
        }
        self.publish_admission(now_ns);
    }

    /// Answers `to` with the admission's Retry, from `src_ip` (counted sent, or unsent when
    /// the socket's send buffer is full).
    fn send_retry(&mut self, to: SocketAddr, src_ip: Option<IpAddr>) {
        let retry = Transmit {
            destination: to,
            ecn: None,
            contents: self.admission.retry_packet(),
            segment_size: None,
            src_ip,
        };
        let sock = UdpSockRef::from(&self.public.socket);
        match self.public.state.send(sock, &retry) {
            Ok(()) => self.admission.stats.retries_sent += 1,
            Err(_) => self.admission.stats.retries_unsent += 1,
        }
    }

    /// Publishes what admission counted, and whether it is under pressure at `now_ns`.
    fn publish_admission(&self, now_ns: u64) {
        let st = &self.admission.stats;
        let c = &self.counters;
        c.retries_sent.store(st.retries_sent, Ordering::Relaxed);
        c.retries_unsent.store(st.retries_unsent, Ordering::Relaxed);
        c.tokens_accepted
            .store(st.tokens_accepted, Ordering::Relaxed);
        let hellos = self.admission.hello_stats();
        for (c, v) in c.client_hellos.iter().zip(hellos.values()) {
            c.store(v, Ordering::Relaxed);
        }
        c.under_pressure.store(
            u64::from(self.admission.under_pressure(now_ns)),
            Ordering::Relaxed,
        );
    }

    /// Occupancy and doorbell gauges; stall and violation reports.
    fn refresh_gauges(&mut self, local: &mut [Local], control: &Control, last: &mut Instant) {
        *last = Instant::now();
        // Pressure ends while nothing arrives too.
        self.publish_admission(monotonic_ns());
        for (i, l) in local.iter_mut().enumerate() {
            let Some(s) = self.forward.gauges(i) else {
                continue;
            };
            if let Some(e) = &s.violation {
                if !l.violated {
                    tracing::error!(lane = i, error = %e, "worker broke the ring protocol");
                }
                l.violated = true;
            }
            let c = &self.counters.instances[i];
            c.occupancy.store(s.occupancy, Ordering::Relaxed);
            c.doorbells.store(s.doorbells, Ordering::Relaxed);
            let consumed = s.published - s.occupancy;
            if consumed != l.consumed || s.occupancy == 0 {
                l.consumed = consumed;
                l.consumed_at = *last;
            }
            let stalled =
                l.up && s.occupancy > 0 && last.duration_since(l.consumed_at) >= self.stall;
            if (stalled || l.violated) && !l.reported {
                if stalled {
                    tracing::error!(
                        lane = i,
                        occupancy = s.occupancy,
                        "worker stopped draining its ring"
                    );
                }
                l.reported = true;
                c.violations.fetch_add(1, Ordering::Relaxed);
                control.liveness.set_up(i, false);
                l.up = false;
                let _ = control.events.send(Event::Misbehaved {
                    lane: i as u8,
                    stalled,
                });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use quinn_udp::EcnCodepoint;

    /// Sends one datagram marked ECT(0) to `public` and receives it the way the data plane does.
    fn mark_and_receive(public: &PublicSocket) -> RecvMeta {
        let client = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        socket2::SockRef::from(&client).set_tos_v4(2).unwrap(); // ECT(0)
        let to = public.socket.local_addr().unwrap();
        client
            .send_to(b"\x40ecn", ("127.0.0.1", to.port()))
            .unwrap();
        let mut buf = vec![0u8; 2048];
        let mut iovs = [IoSliceMut::new(&mut buf)];
        let mut metas = [RecvMeta::default()];
        for _ in 0..1000 {
            match public
                .state
                .recv(UdpSockRef::from(&public.socket), &mut iovs, &mut metas)
            {
                Ok(1) => return metas[0],
                Ok(_) => unreachable!("one buffer"),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    let _ = sys::wait_readable(public.socket.as_fd(), Duration::from_millis(10));
                }
                Err(e) => panic!("recv: {e}"),
            }
        }
        panic!("the datagram never arrived");
    }

    /// What the kernel is asked for: ECN unless `--ecn off`; the destination address only on a
    /// wildcard bind (a specific one is filled in from the bound address).
    #[test]
    fn public_socket_cmsgs_follow_bind_and_ecn() {
        let specific =
            PublicSocket::new(std::net::UdpSocket::bind("127.0.0.1:0").unwrap(), true).unwrap();
        let m = mark_and_receive(&specific);
        assert_eq!(m.ecn, Some(EcnCodepoint::Ect0));
        assert_eq!(m.dst_ip, None, "no destination cmsg on a specific bind");
        assert_eq!(specific.fixed_local_ip, Some("127.0.0.1".parse().unwrap()));

        let wildcard =
            PublicSocket::new(std::net::UdpSocket::bind("0.0.0.0:0").unwrap(), true).unwrap();
        let m = mark_and_receive(&wildcard);
        assert_eq!(m.ecn, Some(EcnCodepoint::Ect0));
        assert_eq!(m.dst_ip, Some("127.0.0.1".parse().unwrap()));
        assert_eq!(wildcard.fixed_local_ip, None);

        let no_ecn =
            PublicSocket::new(std::net::UdpSocket::bind("127.0.0.1:0").unwrap(), false).unwrap();
        let m = mark_and_receive(&no_ecn);
        assert_eq!(m.ecn, None, "--ecn off: no TOS cmsg");
    }
}
