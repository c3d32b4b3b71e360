//! The benchmark sink: a worker that drains its ingress without quinn, checks that every
//! datagram's connection ID belongs to this instance, records ring latency (the demux's receive
//! timestamp to dequeue) in an hdrhistogram, and reports to the demux once a second. `fwd-bench`
//! runs the demux with sinks to measure forwarding alone. Under kernel steering (`--forward
//! reuseport`) the sink drains its own socket instead (recvmmsg with GRO, as quinn would), and
//! records no latency: nothing stamped the datagrams on their way in.

use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::time::{Duration, Instant};

use ringmux_proto::{Message, WorkerReport};
use ringmux_quic_lb::{Route, Router};
use ringmux_ring::monotonic_ns;

use ringmux_worker::control;
use ringmux_worker::ingress::{recv_unix, Ingress, UnixRecv};
use ringmux_worker::{cpu_time, poll_readable};

struct Tally {
    received: u64,
    bad_cid: u64,
    dropped: u64,
    hist: hdrhistogram::Histogram<u64>,
}

impl Tally {
    fn record(&mut self, router: &Router, lane: u8, payload: &[u8], rx_ns: u64, now_ns: u64) {
        self.count(router, lane, payload);
        let _ = self.hist.record(now_ns.saturating_sub(rx_ns).max(1));
    }

    /// Counts a datagram and checks its connection ID, without a latency.
    fn count(&mut self, router: &Router, lane: u8, payload: &[u8]) {
        self.received += 1;
        if router.route(payload) != Route::Owned(lane) {
            self.bad_cid += 1;
        }
    }
}

/// What the sink drains.
// One per sink worker, made once.
#[allow(clippy::large_enum_variant)]
pub enum Source {
    /// A ring or unix ingress (the demux forwards).
    Ingress(Ingress),
    /// The worker's own socket (kernel steering).
    Socket(OwnedFd),
}

/// Bytes of a datagram the sink copies to route it: a short header's first byte and the
/// longest connection ID (20), with room to spare.
const ROUTE_PREFIX: usize = 64;

/// Runs the sink until the control socket closes or says `SHUTDOWN`.
/// `lane` is this worker's ([`Router::lane`] of its instance and generation slot).
pub fn run(source: Source, router: Router, lane: u8, control: OwnedFd) -> io::Result<()> {
    let mut t = Tally {
        received: 0,
        bad_cid: 0,
        dropped: 0,
        hist: hdrhistogram::Histogram::new_with_bounds(1, 60_000_000_000, 3).expect("valid bounds"),
    };
    socket2::SockRef::from(&control).set_nonblocking(true)?;
    let mut last_report = Instant::now();
    let mut inbox = control::Receiver::new();
    let mut buf = vec![0u8; 65536];
    let mut socket = match &source {
        Source::Socket(s) => Some(OwnSocket::new(s.as_fd())?),
        Source::Ingress(_) => None,
    };
    let mut ingress = source;
    loop {
        match &mut ingress {
            Source::Socket(s) => {
                if let Some(own) = socket.as_mut() {
                    let fd = s.as_fd();
                    match own.recv(fd, |seg| t.count(&router, lane, seg)) {
                        Ok(()) => {}
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                            poll_readable(fd, Some(Duration::from_millis(100)))?;
                        }
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                        Err(e) => return Err(e),
                    }
                }
            }
            Source::Ingress(Ingress::Ring(c)) => {
                let now = monotonic_ns();
                let d = c
                    .drain(64, |dg| {
                        // Routing reads a short header's first bytes only: copy those, as the
                        // sink always read just them (copying whole payloads would pull every
                        // slot into this core and change what the benchmark measures). A long
                        // header is checked further in, so it is copied whole.
                        let mut n = dg.copy_to(&mut buf[..ROUTE_PREFIX]);
                        if n > 0 && buf[0] & 0x80 != 0 {
                            n = dg.copy_to(&mut buf);
                        }
                        t.record(&router, lane, &buf[..n], dg.meta.rx_timestamp_ns, now)
                    })
                    .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
                t.dropped += d.invalid as u64;
                if d.slots == 0 {
                    c.wait(Some(Duration::from_millis(100)))
                        .map_err(|e| io::Error::other(e.to_string()))?;
                }
            }
            Source::Ingress(Ingress::Unix(fd)) => match recv_unix(fd.as_fd(), &mut buf) {
                Ok(UnixRecv::Datagram { meta, len }) => t.record(
                    &router,
                    lane,
                    &buf[..len],
                    meta.rx_timestamp_ns,
                    monotonic_ns(),
                ),
                Ok(UnixRecv::Dropped) => t.dropped += 1,
                Ok(UnixRecv::Closed) => return Ok(()), // the demux closed it
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    poll_readable(fd.as_fd(), Some(Duration::from_millis(100)))?;
                }
                Err(e) => return Err(e),
            },
        }
        if last_report.elapsed() >= Duration::from_millis(250) {
            last_report = Instant::now();
            let mut r = WorkerReport {
                datagrams_in: t.received,
                datagrams_dropped: t.dropped,
                cpu_ns: cpu_ns(),
                pid: u64::from(std::process::id()),
                ..WorkerReport::default()
            };
            report_sink(&mut r, &t);
            let _ = control::send_nowait(control.as_fd(), &Message::Stats(r));
            match inbox.recv(control.as_fd()) {
                Ok(None) | Ok(Some(Ok(Message::Shutdown))) => return Ok(()),
                _ => {}
            }
        }
    }
}

/// The sink's own series (`control-protocol.md`, "STATS series"): the datagrams that were
/// not this instance's, and the ring latency's percentiles, which the demux exposes as
/// `ringmux_worker_bad_cid_total` and `ringmux_sink_latency_p50_nanoseconds` (…).
fn report_sink(r: &mut WorkerReport, t: &Tally) {
    let series = [
        r.set_counter("bad_cid", &[], t.bad_cid),
        r.set_gauge(
            "sink_latency_p50_nanoseconds",
            &[],
            t.hist.value_at_quantile(0.5),
        ),
        r.set_gauge(
            "sink_latency_p99_nanoseconds",
            &[],
            t.hist.value_at_quantile(0.99),
        ),
        r.set_gauge(
            "sink_latency_p999_nanoseconds",
            &[],
            t.hist.value_at_quantile(0.999),
        ),
    ];
    // Names checked by the tests: a refusal would be a typo here.
    debug_assert!(series.iter().all(Result::is_ok), "{series:?}");
}

/// Receiving in batches on the worker's own socket, as quinn-udp does for a quinn endpoint
/// (recvmmsg, GRO).
struct OwnSocket {
    state: quinn::udp::UdpSocketState,
    bufs: Vec<Vec<u8>>,
    metas: Vec<quinn::udp::RecvMeta>,
}

impl OwnSocket {
    fn new(sock: std::os::fd::BorrowedFd<'_>) -> io::Result<Self> {
        let state = quinn::udp::UdpSocketState::new(quinn::udp::UdpSockRef::from(&sock))?;
        let n = quinn::udp::BATCH_SIZE;
        Ok(OwnSocket {
            state,
            bufs: vec![vec![0u8; 65536]; n],
            metas: vec![quinn::udp::RecvMeta::default(); n],
        })
    }

    /// One batch: every datagram (each GRO segment) to `each`.
    fn recv(
        &mut self,
        sock: std::os::fd::BorrowedFd<'_>,
        mut each: impl FnMut(&[u8]),
    ) -> io::Result<()> {
        let mut iovs: Vec<std::io::IoSliceMut<'_>> = self
            .bufs
            .iter_mut()
            .map(|b| std::io::IoSliceMut::new(b))
            .collect();
        let n = self.state.recv(
            quinn::udp::UdpSockRef::from(&sock),
            &mut iovs,
            &mut self.metas,
        )?;
        for (meta, buf) in self.metas.iter().zip(&self.bufs).take(n) {
            let data = &buf[..meta.len.min(buf.len())];
            for seg in data.chunks(meta.stride.max(1)) {
                each(seg);
            }
        }
        Ok(())
    }
}

/// CPU time of this process (user + system), ns.
pub fn cpu_ns() -> u64 {
    u64::try_from(cpu_time().as_nanos()).unwrap_or(u64::MAX)
}
