//! One (round, mode) measurement of a fresh ringmux with sink workers.
//!
//! **Saturated** mirrors the C reference forwarder's `drain=` mode (`--reference`): the demux is parked
//! (SIGSTOP), its socket is pre-filled with `drain` datagrams, it is resumed (SIGCONT) and
//! parked again once the queue is empty and its counter has caught up; `cycles` times. Only the
//! drains are measured, with the `data-plane` thread's `schedstat` (ns, exact) read while the
//! process is parked, so the harness's own polling, the metrics thread and the supervisor are
//! never charged to the data plane. This is the demux's capacity per core.
//!
//! **Live** sends for `warmup + seconds` at full speed (or `--rate`) and measures the
//! `seconds` in the middle: a loaded but not necessarily saturated demux, wake-ups included.
//!
//! Consumer cost is the sinks' CPU (summed over their threads, from `/proc`) over the datagrams
//! they took, between two settled scrapes, so idle spinning before sleep is charged to them,
//! as bench.c charges its consumer.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde::Serialize;

use super::datagrams::Connection;
use super::os::{self, SchedStat};
use super::ringmux::{Metrics, Ringmux, Spec};
use super::sender::{Blaster, SendShape, SendStats};

use ringmux_demux::metrics::names::{
    DATAPLANE_ALLOCATIONS as ALLOCATIONS, DOORBELLS, DROPPED, FORWARDED, RECEIVED, RECV_CALLS,
    SINK_LATENCY_P50, SINK_LATENCY_P99, SINK_LATENCY_P999, WORKER_BAD_CID as SINK_BAD_CID,
    WORKER_DATAGRAMS as SINK_IN,
};

/// Counters must be still this long before a run is read: above the sinks' 250 ms report
/// period and the demux's 100 ms gauge refresh.
const QUIET: Duration = Duration::from_millis(600);
const SETTLE_TIMEOUT: Duration = Duration::from_secs(15);
/// After a pre-fill, as bench.c: let deferred softirq work finish before the clock starts.
const FILL_SETTLE: Duration = Duration::from_millis(3);
/// SCHED_FIFO priorities bench.c uses: demux 20 (`dfifo`), consumer 10 (`cfifo`).
const DEMUX_FIFO: i32 = 20;
const SINK_FIFO: i32 = 10;

/// Which load shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Regime {
    /// Pre-fill the parked demux's socket, measure only the drain (capacity per core).
    Saturated,
    /// Send for a duration and measure the middle.
    Live,
}

/// Everything a measurement needs besides the ringmux spec.
#[derive(Clone, Debug)]
pub struct Plan {
    pub regime: Regime,
    pub shape: SendShape,
    pub size: usize,
    pub instances: u8,
    /// Live: measured seconds, after `warmup`.
    pub seconds: f64,
    pub warmup: f64,
    pub rate: Option<u64>,
    /// Saturated: datagrams per pre-fill, and pre-fills per measurement.
    pub drain: u64,
    pub cycles: u32,
    /// CPU of the sender thread, if pinning.
    pub sender_cpu: Option<usize>,
    /// SCHED_FIFO for the data plane and the sinks.
    pub fifo: bool,
    /// Consumer spin before sleeping, µs (ringmux `--spin-us`, bench.c `spin_us=`).
    pub spin_us: u32,
}

/// The figures of one (round, mode).
#[derive(Clone, Debug, Serialize)]
pub struct Round {
    pub round: u32,
    pub mode: String,
    /// Data-plane thread CPU per datagram received in the window: the demux cost.
    pub demux_ns_per_datagram: f64,
    /// The whole ringmux process (supervisor, metrics thread too), for reference.
    pub demux_process_ns_per_datagram: f64,
    /// Sink CPU per datagram the sinks took; `None` in `drop` mode.
    pub consumer_ns_per_datagram: Option<f64>,
    /// Live: every CPU's busy time (`/proc/stat`: the sender, the demux, the sinks and the
    /// kernel's network work wherever it ran) over the settled session, per datagram the
    /// sinks took. What each mode costs the whole box, kernel steering included; `None` in
    /// `drop` mode and in the saturated regime.
    pub box_ns_per_delivered: Option<f64>,
    /// Saturated: datagrams completed (forwarded; drop mode: discarded) per second of
    /// data-plane busy time (on CPU + runnable). Live: per second of the window.
    pub delivered_per_s: f64,
    /// Live: what the sender offered per second.
    pub offered_per_s: Option<f64>,
    pub doorbells_per_datagram: f64,
    pub recv_calls_per_datagram: f64,
    pub datagrams_per_recv_call: f64,
    pub sender_ns_per_datagram: f64,
    /// Heap allocations on the data-plane thread per million datagrams received
    /// (`ringmux_dataplane_allocations_total`; `None` if this ringmux does not count them).
    pub allocations_per_million_datagrams: Option<f64>,
    /// Sink ring (or socket) latency, receive timestamp to dequeue, worst instance, µs.
    pub latency_p50_us: Option<f64>,
    pub latency_p99_us: Option<f64>,
    pub latency_p999_us: Option<f64>,
    pub received: u64,
    pub forwarded: u64,
    pub sink_received: u64,
    pub bad_cid: u64,
    /// Drops in the window by reason (`kernel_rcvbuf`: the kernel dropped at the socket);
    /// `discarded` is drop mode's by-design discard.
    pub drops: BTreeMap<String, u64>,
    pub window_s: f64,
    pub sent: SendStats,
    pub loadavg: String,
    pub notes: Vec<String>,
}

impl Round {
    /// Drops other than drop mode's by-design discard.
    pub fn drops_excluding_discard(&self) -> u64 {
        self.drops
            .iter()
            .filter(|(k, _)| k.as_str() != "discarded")
            .map(|(_, v)| v)
            .sum()
    }
}

/// Starts ringmux per `spec`, measures it per `plan`, stops it.
pub fn run(
    plan: &Plan,
    spec: &Spec,
    conns: &[Connection],
    round: u32,
    mode: &str,
) -> Result<Round> {
    let mut rm = Ringmux::start(spec)?;
    let result = measure(plan, &mut rm, conns, round, mode);
    let log = rm.log_tail();
    let stopped = rm.shutdown();
    let r = result.with_context(|| format!("{mode} round {round}; ringmux log tail:\n{log}"))?;
    stopped?;
    Ok(r)
}

fn measure(
    plan: &Plan,
    rm: &mut Ringmux,
    conns: &[Connection],
    round: u32,
    mode: &str,
) -> Result<Round> {
    let workers = rm.worker_pids(plan.instances, Duration::from_secs(15))?;
    let mut notes = Vec::new();
    if plan.fifo {
        if let Err(e) = os::set_fifo(rm.data_plane, DEMUX_FIFO) {
            notes.push(format!("SCHED_FIFO for the data plane failed: {e}"));
        }
        for w in &workers {
            if let Err(e) = os::set_fifo_process(*w, SINK_FIFO) {
                notes.push(format!("SCHED_FIFO for sink {w} failed: {e}"));
            }
        }
    }
    let mut blaster = Blaster::new(rm.listen, conns.to_vec(), plan.size, plan.shape)?;
    let mut r = match plan.regime {
        Regime::Saturated => saturated(plan, rm, &mut blaster, &workers)?,
        Regime::Live => live(plan, rm, &mut blaster, &workers)?,
    };
    r.round = round;
    r.mode = mode.to_string();
    r.notes.extend(notes);
    // Under kernel steering nothing stamps a datagram on its way in: no latency to report.
    if !["drop", "reuseport"].contains(&r.mode.as_str())
        && r.sink_received > 0
        && r.latency_p99_us.is_none()
    {
        r.notes.push(
            "sink latency gauges are 0: this ringmux does not store the sinks' lat_p* reports"
                .into(),
        );
    }
    if r.bad_cid > 0 {
        r.notes
            .push(format!("{} datagrams reached the wrong sink", r.bad_cid));
    }
    Ok(r)
}

/// Counters of a window, from two scrapes.
struct Window {
    received: u64,
    recv_calls: u64,
    forwarded: u64,
    /// What the sinks reported taking (each reports every 250 ms, so a window's count is
    /// that coarse): the delivered count under kernel steering, where the demux sees nothing.
    sink: u64,
    drops: BTreeMap<String, u64>,
}

impl Window {
    fn between(a: &Metrics, b: &Metrics) -> Window {
        let d = |n: &str| (b.sum(n) - a.sum(n)).max(0.0) as u64;
        let before = a.by_label(DROPPED, "reason");
        let drops = b
            .by_label(DROPPED, "reason")
            .into_iter()
            .map(|(k, v)| {
                let v0 = before.get(&k).copied().unwrap_or(0.0);
                (k, (v - v0).max(0.0) as u64)
            })
            .filter(|(_, v)| *v > 0)
            .collect();
        Window {
            received: d(RECEIVED),
            recv_calls: d(RECV_CALLS),
            forwarded: d(FORWARDED),
            sink: d(SINK_IN),
            drops,
        }
    }
}

fn workers_cpu_ns(workers: &[u32]) -> Result<u64> {
    workers.iter().try_fold(0u64, |acc, w| {
        Ok(acc + os::process_cpu_ns(*w).with_context(|| format!("reading sink {w} CPU time"))?)
    })
}

/// Runs `f` on a fresh thread pinned to `cpu` (the sender must not share the harness's CPU
/// by accident).
fn on_cpu<T: Send>(cpu: Option<usize>, f: impl FnOnce() -> T + Send) -> T {
    std::thread::scope(|s| {
        s.spawn(|| {
            if let Some(c) = cpu {
                let _ = os::pin_current(c);
            }
            f()
        })
        .join()
        .expect("sender thread panicked")
    })
}

/// One pre-fill and drain. Precondition and postcondition: the demux is parked and
/// `*received` is its received counter.
struct Cycle {
    data_plane: SchedStat,
    process_ns: u64,
    kernel_drops: u64,
    sent: SendStats,
}

fn cycle(
    plan: &Plan,
    rm: &mut Ringmux,
    blaster: &mut Blaster,
    received: &mut u64,
) -> Result<Cycle> {
    let port = rm.listen.port();
    let q0 = os::udp_queue(port)?.unwrap_or_default();
    let sent = on_cpu(plan.sender_cpu, || blaster.send_n(plan.drain));
    std::thread::sleep(FILL_SETTLE);
    let q1 = os::udp_queue(port)?.unwrap_or_default();
    let kernel_drops = q1.drops.saturating_sub(q0.drops);
    let target = *received + sent.datagrams.saturating_sub(kernel_drops);
    let dp0 = os::schedstat(rm.pid, rm.data_plane)?;
    let p0 = os::process_cpu_ns(rm.pid)?;
    rm.resume()?;
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        std::thread::sleep(Duration::from_micros(200));
        let q = os::udp_queue(port)?.unwrap_or_default();
        // Drained: nothing queued and the data plane asleep in poll (it never sleeps elsewhere).
        if q.rx_queue == 0 && os::thread_state(rm.pid, rm.data_plane)? == 'S' {
            let now = rm.scrape()?.sum(RECEIVED) as u64;
            if now >= target {
                *received = now;
                break;
            }
        }
        if Instant::now() > deadline {
            bail!(
                "the demux did not drain {} datagrams in 20 s (queue {} bytes)",
                plan.drain,
                q.rx_queue
            );
        }
    }
    rm.park()?;
    Ok(Cycle {
        data_plane: os::schedstat(rm.pid, rm.data_plane)? - dp0,
        process_ns: os::process_cpu_ns(rm.pid)?.saturating_sub(p0),
        kernel_drops,
        sent,
    })
}

fn saturated(
    plan: &Plan,
    rm: &mut Ringmux,
    blaster: &mut Blaster,
    workers: &[u32],
) -> Result<Round> {
    let load = os::loadavg();
    // One unmeasured cycle: page faults in the receive buffers and the rings.
    let mut received = rm.scrape()?.sum(RECEIVED) as u64;
    rm.park()?;
    cycle(plan, rm, blaster, &mut received)?;
    rm.resume()?;
    let m0 = rm.settle(QUIET, SETTLE_TIMEOUT)?;
    let w0 = workers_cpu_ns(workers)?;
    received = m0.sum(RECEIVED) as u64;
    rm.park()?;
    let mut dp = SchedStat::default();
    let mut process_ns = 0;
    let mut kernel_drops = 0;
    let mut sent = SendStats::default();
    for _ in 0..plan.cycles {
        let c = cycle(plan, rm, blaster, &mut received)?;
        dp.cpu_ns += c.data_plane.cpu_ns;
        dp.wait_ns += c.data_plane.wait_ns;
        process_ns += c.process_ns;
        kernel_drops += c.kernel_drops;
        sent.datagrams += c.sent.datagrams;
        sent.calls += c.sent.calls;
        sent.errors += c.sent.errors;
        sent.cpu_ns += c.sent.cpu_ns;
        sent.elapsed_s += c.sent.elapsed_s;
    }
    rm.resume()?;
    let m1 = rm.settle(QUIET, SETTLE_TIMEOUT)?;
    let w1 = workers_cpu_ns(workers)?;
    let mut w = Window::between(&m0, &m1);
    if kernel_drops > 0 {
        w.drops.insert("kernel_rcvbuf".into(), kernel_drops);
    }
    let busy_s = (dp.cpu_ns + dp.wait_ns) as f64 / 1e9;
    Ok(finish(
        &m0,
        &m1,
        Taken {
            w,
            data_plane_ns: dp.cpu_ns,
            process_ns,
            sink_ns: w1.saturating_sub(w0),
            seconds: busy_s,
            offered_per_s: None,
            sent,
            loadavg: load,
        },
    ))
}

fn live(plan: &Plan, rm: &mut Ringmux, blaster: &mut Blaster, workers: &[u32]) -> Result<Round> {
    let load = os::loadavg();
    let port = rm.listen.port();
    let m_start = rm.settle(QUIET, SETTLE_TIMEOUT)?;
    let w0 = workers_cpu_ns(workers)?;
    let box0 = os::box_busy_ns()?;
    let stop = AtomicBool::new(false);
    let total = Duration::from_secs_f64(plan.warmup + plan.seconds + 1.0);
    let (sent, a, b) = std::thread::scope(|s| -> Result<_> {
        let sender = s.spawn(|| {
            if let Some(c) = plan.sender_cpu {
                let _ = os::pin_current(c);
            }
            blaster.blast(total, plan.rate, &stop)
        });
        let snap = || -> Result<(Instant, SchedStat, u64, u64, Metrics)> {
            let dp = os::schedstat(rm.pid, rm.data_plane)?;
            let p = os::process_cpu_ns(rm.pid)?;
            let q = os::udp_queue(port)?.unwrap_or_default();
            let m = rm.scrape()?;
            Ok((Instant::now(), dp, p, q.drops, m))
        };
        std::thread::sleep(Duration::from_secs_f64(plan.warmup));
        let a = snap();
        std::thread::sleep(Duration::from_secs_f64(plan.seconds));
        let b = snap();
        stop.store(true, Ordering::Relaxed);
        let sent = sender.join().expect("sender thread panicked");
        Ok((sent, a?, b?))
    })?;
    let m_end = rm.settle(QUIET, SETTLE_TIMEOUT)?;
    let w1 = workers_cpu_ns(workers)?;
    let box_ns = os::box_busy_ns()?.saturating_sub(box0);
    let (ta, dpa, pa, ka, ma) = a;
    let (tb, dpb, pb, kb, mb) = b;
    let window_s = (tb - ta).as_secs_f64();
    let mut w = Window::between(&ma, &mb);
    if kb > ka {
        w.drops.insert("kernel_rcvbuf".into(), kb - ka);
    }
    let offered = sent.datagrams as f64 / sent.elapsed_s.max(1e-9);
    let mut r = finish(
        &m_start,
        &m_end,
        Taken {
            w,
            data_plane_ns: (dpb - dpa).cpu_ns,
            process_ns: pb.saturating_sub(pa),
            sink_ns: w1.saturating_sub(w0),
            seconds: window_s,
            offered_per_s: Some(offered),
            sent,
            loadavg: load,
        },
    );
    r.box_ns_per_delivered = (r.sink_received > 0).then(|| box_ns as f64 / r.sink_received as f64);
    Ok(r)
}

/// What one measured window took, as [`finish`] turns it into a [`Round`].
struct Taken {
    /// The counters' differences over the window.
    w: Window,
    /// CPU time of the data-plane thread, of the whole demux process, and of the sinks, ns.
    data_plane_ns: u64,
    process_ns: u64,
    sink_ns: u64,
    /// How long the window was (live) or the data plane was busy (saturated), seconds.
    seconds: f64,
    offered_per_s: Option<f64>,
    sent: SendStats,
    loadavg: String,
}

/// Turns raw counts into a [`Round`]. `session0`/`session1` are settled scrapes around the
/// whole session (doorbells, sink counts, latency); `taken` is the measured window.
fn finish(session0: &Metrics, session1: &Metrics, taken: Taken) -> Round {
    let Taken {
        w,
        data_plane_ns,
        process_ns,
        sink_ns,
        seconds,
        offered_per_s,
        sent,
        loadavg,
    } = taken;
    let per = |num: f64, den: u64| if den == 0 { 0.0 } else { num / den as f64 };
    let s = |n: &str| (session1.sum(n) - session0.sum(n)).max(0.0) as u64;
    let sink_received = s(SINK_IN);
    let session_received = s(RECEIVED);
    let drop_mode = w.drops.contains_key("discarded");
    let completed = if drop_mode {
        w.drops.get("discarded").copied().unwrap_or(0)
    } else if w.received == 0 {
        // Kernel steering: the workers took the datagrams straight from their sockets.
        w.sink
    } else {
        w.forwarded
    };
    // Zero means the sinks' latency never reached the metrics (see `notes`).
    let lat = |name: &str| {
        let v = session1.max(name);
        (!drop_mode && sink_received > 0 && v > 0.0).then(|| v / 1e3)
    };
    let allocs = session1
        .series
        .contains_key(ALLOCATIONS)
        .then(|| per(s(ALLOCATIONS) as f64 * 1e6, session_received));
    Round {
        round: 0,
        mode: String::new(),
        demux_ns_per_datagram: per(data_plane_ns as f64, w.received),
        demux_process_ns_per_datagram: per(process_ns as f64, w.received),
        consumer_ns_per_datagram: (!drop_mode && sink_received > 0)
            .then(|| per(sink_ns as f64, sink_received)),
        box_ns_per_delivered: None,
        delivered_per_s: if seconds > 0.0 {
            completed as f64 / seconds
        } else {
            0.0
        },
        offered_per_s,
        doorbells_per_datagram: per(s(DOORBELLS) as f64, session_received),
        recv_calls_per_datagram: per(w.recv_calls as f64, w.received),
        datagrams_per_recv_call: per(w.received as f64, w.recv_calls),
        sender_ns_per_datagram: per(sent.cpu_ns as f64, sent.datagrams),
        allocations_per_million_datagrams: allocs,
        latency_p50_us: lat(SINK_LATENCY_P50),
        latency_p99_us: lat(SINK_LATENCY_P99),
        latency_p999_us: lat(SINK_LATENCY_P999),
        received: w.received,
        forwarded: w.forwarded,
        sink_received,
        bad_cid: s(SINK_BAD_CID),
        drops: w.drops,
        window_s: seconds,
        sent,
        loadavg,
        notes: Vec::new(),
    }
}
