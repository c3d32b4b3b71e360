//! The benchmark sink: a worker that drains its ingress without quinn, checks that every
//! datagram's connection ID belongs to this instance, records ring latency (the demux's receive
//! timestamp to dequeue) in an hdrhistogram, and reports to the demux once a second. `fwd-bench`
//! runs the demux with sinks to measure forwarding alone.

use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::time::{Duration, Instant};

use ringmux_quic_lb::{Route, Router};
use ringmux_ring::layout::{SlotDesc, DESC_BYTES};
use ringmux_ring::{decode_desc, monotonic_ns, Consumer};

use crate::control::{self, WorkerReport};

/// Where the sink reads from.
pub enum SinkIngress {
    Ring(Consumer),
    Unix(OwnedFd),
}

struct Tally {
    received: u64,
    bad_cid: u64,
    dropped: u64,
    hist: hdrhistogram::Histogram<u64>,
}

impl Tally {
    fn record(&mut self, router: &Router, instance: u8, payload: &[u8], rx_ns: u64, now_ns: u64) {
        self.received += 1;
        if router.route(payload) != Route::Owned(instance) {
            self.bad_cid += 1;
        }
        let _ = self.hist.record(now_ns.saturating_sub(rx_ns).max(1));
    }
}

/// Runs the sink until the control socket closes or says `SHUTDOWN`.
pub fn run(ingress: SinkIngress, router: Router, instance: u8, control: OwnedFd) -> io::Result<()> {
    let mut t = Tally {
        received: 0,
        bad_cid: 0,
        dropped: 0,
        hist: hdrhistogram::Histogram::new_with_bounds(1, 60_000_000_000, 3).expect("valid bounds"),
    };
    socket2::SockRef::from(&control).set_nonblocking(true)?;
    let mut last_report = Instant::now();
    let mut buf = vec![0u8; 65536 + DESC_BYTES as usize];
    let mut ingress = ingress;
    if let SinkIngress::Unix(fd) = &ingress {
        socket2::SockRef::from(fd).set_nonblocking(false)?;
        socket2::SockRef::from(fd).set_read_timeout(Some(Duration::from_millis(100)))?;
    }
    loop {
        match &mut ingress {
            SinkIngress::Ring(c) => {
                let now = monotonic_ns();
                let d = c
                    .drain(64, |dg| {
                        t.record(&router, instance, dg.payload, dg.meta.rx_timestamp_ns, now)
                    })
                    .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
                t.dropped += d.invalid as u64;
                if d.slots == 0 {
                    c.wait(Some(Duration::from_millis(100)))
                        .map_err(|e| io::Error::other(e.to_string()))?;
                }
            }
            SinkIngress::Unix(fd) => {
                // SAFETY: recv into a live buffer of the stated length.
                let n =
                    unsafe { libc::recv(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
                if n > DESC_BYTES as isize {
                    let n = n as usize;
                    // SAFETY: the buffer holds at least a descriptor; SlotDesc is plain old data.
                    let desc: SlotDesc =
                        unsafe { buf.as_ptr().cast::<SlotDesc>().read_unaligned() };
                    let payload = &buf[DESC_BYTES as usize..n];
                    match decode_desc(&desc, u32::MAX) {
                        Ok(m) if desc.len as usize == payload.len() => t.record(
                            &router,
                            instance,
                            payload,
                            m.rx_timestamp_ns,
                            monotonic_ns(),
                        ),
                        _ => t.dropped += 1,
                    }
                } else if n == 0 {
                    return Ok(()); // the demux closed it
                }
            }
        }
        if last_report.elapsed() >= Duration::from_millis(250) {
            last_report = Instant::now();
            let r = WorkerReport {
                datagrams_in: t.received,
                datagrams_dropped: t.dropped,
                bad_cid: t.bad_cid,
                lat_p50_ns: t.hist.value_at_quantile(0.5),
                lat_p99_ns: t.hist.value_at_quantile(0.99),
                lat_p999_ns: t.hist.value_at_quantile(0.999),
                cpu_ns: cpu_ns(),
                pid: u64::from(std::process::id()),
                ..WorkerReport::default()
            };
            let _ = control::send(control.as_fd(), r.encode().as_bytes());
            let mut small = [0u8; 64];
            match control::recv_with_fds(control.as_fd(), &mut small) {
                Ok(None) => return Ok(()),
                Ok(Some((n, _))) if &small[..n] == b"SHUTDOWN" => return Ok(()),
                _ => {}
            }
        }
    }
}

/// CPU time of this process (user + system), ns.
pub fn cpu_ns() -> u64 {
    // SAFETY: a zeroed rusage is a valid out-parameter.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: valid pointer.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let t = |tv: libc::timeval| tv.tv_sec as u64 * 1_000_000_000 + tv.tv_usec as u64 * 1000;
    t(ru.ru_utime) + t(ru.ru_stime)
}
