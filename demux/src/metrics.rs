//! Counters for every datagram's fate and for the workers, the Prometheus endpoint that exposes
//! them, and the `ringmux stats` table. The data plane is the only writer of the datagram
//! counters (plain stores, once per receive batch); the supervisor writes the worker counters.

use std::fmt::Write as _;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// Why a datagram was not forwarded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(usize)]
pub enum DropReason {
    /// The owner's ring was full (worker not keeping up).
    RingFull,
    /// Larger than a slot's payload.
    Oversize,
    /// Not a QUIC packet by the RFC 8999 invariants.
    Malformed,
    /// The owning worker is dead or restarting.
    InstanceDown,
    /// The owning worker broke the ring protocol.
    RingViolation,
    /// unix mode: the worker's socket buffer was full.
    SocketFull,
    /// drop mode: discarded by design.
    Discarded,
}

impl DropReason {
    pub const ALL: [DropReason; 7] = [
        DropReason::RingFull,
        DropReason::Oversize,
        DropReason::Malformed,
        DropReason::InstanceDown,
        DropReason::RingViolation,
        DropReason::SocketFull,
        DropReason::Discarded,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            DropReason::RingFull => "ring_full",
            DropReason::Oversize => "oversize",
            DropReason::Malformed => "malformed",
            DropReason::InstanceDown => "instance_down",
            DropReason::RingViolation => "ring_violation",
            DropReason::SocketFull => "socket_full",
            DropReason::Discarded => "discarded",
        }
    }
}

/// Per-instance counters.
#[derive(Debug, Default)]
pub struct InstanceCounters {
    pub forwarded: AtomicU64,
    pub doorbells: AtomicU64,
    pub occupancy: AtomicU64,
    pub discarded_on_reset: AtomicU64,
    pub restarts: AtomicU64,
    pub violations: AtomicU64,
    pub connections_active: AtomicU64,
    pub connections_total: AtomicU64,
    pub requests_total: AtomicU64,
    pub worker_datagrams_in: AtomicU64,
    pub worker_datagrams_dropped: AtomicU64,
    pub worker_bad_cid: AtomicU64,
    pub worker_cpu_ns: AtomicU64,
    pub worker_pid: AtomicU64,
    pub sink_lat_p50_ns: AtomicU64,
    pub sink_lat_p99_ns: AtomicU64,
    pub sink_lat_p999_ns: AtomicU64,
    /// Set by the supervisor: the worker is up and its ring attached.
    pub alive: AtomicBool,
}

impl InstanceCounters {
    /// Stores what a worker's `STATS` message says.
    pub fn record_report(&self, r: &ringmux_proto::WorkerReport) {
        let set = |c: &AtomicU64, v: u64| c.store(v, Ordering::Relaxed);
        set(&self.connections_active, r.connections_active);
        set(&self.connections_total, r.connections_total);
        set(&self.requests_total, r.requests_total);
        set(&self.worker_datagrams_in, r.datagrams_in);
        set(&self.worker_datagrams_dropped, r.datagrams_dropped);
        set(&self.worker_bad_cid, r.bad_cid);
        set(&self.worker_cpu_ns, r.cpu_ns);
        set(&self.sink_lat_p50_ns, r.lat_p50_ns);
        set(&self.sink_lat_p99_ns, r.lat_p99_ns);
        set(&self.sink_lat_p999_ns, r.lat_p999_ns);
    }
}

/// Everything the demux counts.
#[derive(Debug)]
pub struct Counters {
    pub received: AtomicU64,
    pub recv_calls: AtomicU64,
    pub dropped: [AtomicU64; DropReason::ALL.len()],
    pub instances: Vec<InstanceCounters>,
    /// 1 + the instance whose doorbell the data plane is writing, 0 otherwise
    /// (`Producer::watch_doorbell`). The supervisor's watchdog reads it to find a jammed doorbell.
    pub ringing: Arc<AtomicU32>,
}

impl Counters {
    pub fn new(instances: u8) -> Self {
        Counters {
            received: AtomicU64::new(0),
            recv_calls: AtomicU64::new(0),
            dropped: Default::default(),
            instances: (0..instances)
                .map(|_| InstanceCounters::default())
                .collect(),
            ringing: Arc::default(),
        }
    }

    pub fn dropped_total(&self) -> u64 {
        self.dropped.iter().map(|d| d.load(Ordering::Relaxed)).sum()
    }

    pub fn forwarded_total(&self) -> u64 {
        self.instances
            .iter()
            .map(|i| i.forwarded.load(Ordering::Relaxed))
            .sum()
    }

    /// The Prometheus text exposition.
    pub fn encode(&self) -> String {
        let mut reg = Registry::default();
        let c = |v: u64| {
            let m = Counter::<u64>::default();
            m.inc_by(v);
            m
        };
        reg.register(
            "ringmux_datagrams_received",
            "Datagrams received on the public socket",
            c(self.received.load(Ordering::Relaxed)),
        );
        reg.register(
            "ringmux_recv_calls",
            "Receive system calls (recvmmsg) that returned data",
            c(self.recv_calls.load(Ordering::Relaxed)),
        );
        reg.register(
            "ringmux_dataplane_allocations",
            "Heap allocations made on the data-plane thread after start-up (should stay flat)",
            c(crate::alloc::dataplane_allocations()),
        );
        let dropped = Family::<Vec<(String, String)>, Counter<u64>>::default();
        for r in DropReason::ALL {
            dropped
                .get_or_create(&vec![("reason".into(), r.as_str().into())])
                .inc_by(self.dropped[r as usize].load(Ordering::Relaxed));
        }
        reg.register(
            "ringmux_datagrams_dropped",
            "Datagrams not forwarded, by reason",
            dropped,
        );
        type Fam = Family<Vec<(String, String)>, Counter<u64>>;
        type GFam = Family<Vec<(String, String)>, Gauge<i64>>;
        let per =
            |name: &str, help: &str, f: &dyn Fn(&InstanceCounters) -> u64, reg: &mut Registry| {
                let fam = Fam::default();
                for (i, ic) in self.instances.iter().enumerate() {
                    fam.get_or_create(&vec![("instance".into(), i.to_string())])
                        .inc_by(f(ic));
                }
                reg.register(name, help, fam);
            };
        let gauge =
            |name: &str, help: &str, f: &dyn Fn(&InstanceCounters) -> u64, reg: &mut Registry| {
                let fam = GFam::default();
                for (i, ic) in self.instances.iter().enumerate() {
                    fam.get_or_create(&vec![("instance".into(), i.to_string())])
                        .set(f(ic) as i64);
                }
                reg.register(name, help, fam);
            };
        let ld = |a: &AtomicU64| a.load(Ordering::Relaxed);
        per(
            "ringmux_datagrams_forwarded",
            "Datagrams forwarded to an instance",
            &|i| ld(&i.forwarded),
            &mut reg,
        );
        per(
            "ringmux_doorbells",
            "Doorbells rung (eventfd writes) per instance",
            &|i| ld(&i.doorbells),
            &mut reg,
        );
        per(
            "ringmux_worker_restarts",
            "Worker processes restarted",
            &|i| ld(&i.restarts),
            &mut reg,
        );
        per(
            "ringmux_ring_violations",
            "Ring protocol violations and stalls detected",
            &|i| ld(&i.violations),
            &mut reg,
        );
        per(
            "ringmux_ring_discarded",
            "Forwarded datagrams discarded unread when a ring was reset",
            &|i| ld(&i.discarded_on_reset),
            &mut reg,
        );
        per(
            "ringmux_worker_requests",
            "HTTP/3 requests served (reported by the worker)",
            &|i| ld(&i.requests_total),
            &mut reg,
        );
        per(
            "ringmux_worker_connections_accepted",
            "QUIC connections accepted (reported by the worker)",
            &|i| ld(&i.connections_total),
            &mut reg,
        );
        per(
            "ringmux_worker_datagrams_dropped",
            "Datagrams the worker dropped at ingress",
            &|i| ld(&i.worker_datagrams_dropped),
            &mut reg,
        );
        per(
            "ringmux_worker_datagrams",
            "Datagrams the worker took from its ingress",
            &|i| ld(&i.worker_datagrams_in),
            &mut reg,
        );
        per(
            "ringmux_worker_bad_cid",
            "Sink mode: datagrams whose connection ID is not the instance's",
            &|i| ld(&i.worker_bad_cid),
            &mut reg,
        );
        per(
            "ringmux_worker_cpu_nanoseconds",
            "CPU time used by the worker process",
            &|i| ld(&i.worker_cpu_ns),
            &mut reg,
        );
        gauge(
            "ringmux_worker_pid",
            "Process id of the current worker",
            &|i| ld(&i.worker_pid),
            &mut reg,
        );
        gauge(
            "ringmux_sink_latency_p50_nanoseconds",
            "Sink mode: ring latency p50 (receive to dequeue)",
            &|i| ld(&i.sink_lat_p50_ns),
            &mut reg,
        );
        gauge(
            "ringmux_sink_latency_p99_nanoseconds",
            "Sink mode: ring latency p99",
            &|i| ld(&i.sink_lat_p99_ns),
            &mut reg,
        );
        gauge(
            "ringmux_sink_latency_p999_nanoseconds",
            "Sink mode: ring latency p99.9",
            &|i| ld(&i.sink_lat_p999_ns),
            &mut reg,
        );
        gauge(
            "ringmux_ring_occupancy",
            "Slots published and not yet released",
            &|i| ld(&i.occupancy),
            &mut reg,
        );
        gauge(
            "ringmux_worker_connections",
            "Open QUIC connections (reported by the worker)",
            &|i| ld(&i.connections_active),
            &mut reg,
        );
        gauge(
            "ringmux_worker_up",
            "1 while the worker is serving",
            &|i| i.alive.load(Ordering::Relaxed) as u64,
            &mut reg,
        );
        let mut out = String::new();
        let _ = encode(&mut out, &reg);
        out
    }
}

/// Serves `GET /metrics` on `addr` from a background thread.
pub fn serve(addr: SocketAddr, counters: Arc<Counters>) -> Result<SocketAddr> {
    let listener = TcpListener::bind(addr).with_context(|| {
        format!("binding the metrics address {addr} (--metrics / RINGMUX_METRICS)")
    })?;
    let local = listener.local_addr()?;
    std::thread::Builder::new()
        .name("metrics".into())
        .spawn(move || {
            for stream in listener.incoming().flatten() {
                let _ = answer(stream, &counters);
            }
        })?;
    Ok(local)
}

fn answer(mut s: TcpStream, counters: &Counters) -> std::io::Result<()> {
    s.set_read_timeout(Some(Duration::from_secs(2)))?;
    let mut line = String::new();
    let mut reader = BufReader::new(&mut s);
    reader.read_line(&mut line)?;
    // Read the rest of the request head: closing with unread input would reset the connection
    // before the client has read the answer.
    let mut header = String::new();
    while reader.read_line(&mut header)? > 2 {
        header.clear();
    }
    let (status, body) = if line.starts_with("GET /metrics ") || line.starts_with("GET /metrics?") {
        ("200 OK", counters.encode())
    } else {
        ("404 Not Found", "try /metrics\n".to_string())
    };
    let response = format!(
        "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    // One write: a formatted write! would issue a syscall per piece.
    s.write_all(response.as_bytes())
}

/// Fetches the metrics text from a running ringmux.
pub fn fetch(addr: &str) -> Result<String> {
    let mut s = TcpStream::connect(addr).with_context(|| {
        format!(
            "connecting to the metrics address {addr}; is ringmux running with --metrics {addr}?"
        )
    })?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    let request = format!("GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    s.write_all(request.as_bytes())?;
    let mut text = String::new();
    s.read_to_string(&mut text)?;
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .context("malformed HTTP response")?;
    Ok(body)
}

/// One sample of the text format: name, labels, value.
pub type Sample = (String, Vec<(String, String)>, f64);

/// Parses the samples of a Prometheus text exposition (comments skipped).
pub fn parse_samples(text: &str) -> Vec<Sample> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| {
            let (head, value) = l.rsplit_once(' ')?;
            let value: f64 = value.parse().ok()?;
            let (name, labels) = match head.split_once('{') {
                Some((n, rest)) => {
                    let inner = rest.trim_end_matches('}');
                    let labels = inner
                        .split(',')
                        .filter_map(|kv| {
                            let (k, v) = kv.split_once('=')?;
                            Some((k.to_string(), v.trim_matches('"').to_string()))
                        })
                        .collect();
                    (n.to_string(), labels)
                }
                None => (head.to_string(), Vec::new()),
            };
            Some((name, labels, value))
        })
        .collect()
}

/// `ringmux stats`: the metrics as a table.
pub fn stats_table(text: &str) -> String {
    let samples = parse_samples(text);
    let get = |name: &str, label: Option<(&str, &str)>| -> f64 {
        samples
            .iter()
            .filter(|(n, l, _)| {
                n == name && label.is_none_or(|(k, v)| l.iter().any(|(a, b)| a == k && b == v))
            })
            .map(|(_, _, v)| v)
            .sum()
    };
    let mut instances: Vec<String> = samples
        .iter()
        .filter(|(n, _, _)| n == "ringmux_datagrams_forwarded_total")
        .filter_map(|(_, l, _)| {
            l.iter()
                .find(|(k, _)| k == "instance")
                .map(|(_, v)| v.clone())
        })
        .collect();
    instances.sort_by_key(|s| s.parse::<u32>().unwrap_or(u32::MAX));
    instances.dedup();
    let mut out = String::new();
    let received = get("ringmux_datagrams_received_total", None);
    let forwarded = get("ringmux_datagrams_forwarded_total", None);
    let dropped = get("ringmux_datagrams_dropped_total", None);
    let _ = writeln!(
        out,
        "received {received:.0}   forwarded {forwarded:.0}   dropped {dropped:.0}"
    );
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "{:>8} {:>4} {:>14} {:>10} {:>9} {:>8} {:>11} {:>12}",
        "instance",
        "up",
        "forwarded",
        "doorbells",
        "occupancy",
        "restarts",
        "connections",
        "requests"
    );
    for i in &instances {
        let l = Some(("instance", i.as_str()));
        let _ = writeln!(
            out,
            "{:>8} {:>4} {:>14.0} {:>10.0} {:>9.0} {:>8.0} {:>11.0} {:>12.0}",
            i,
            if get("ringmux_worker_up", l) > 0.0 {
                "yes"
            } else {
                "no"
            },
            get("ringmux_datagrams_forwarded_total", l),
            get("ringmux_doorbells_total", l),
            get("ringmux_ring_occupancy", l),
            get("ringmux_worker_restarts_total", l),
            get("ringmux_worker_connections", l),
            get("ringmux_worker_requests_total", l),
        );
    }
    let _ = writeln!(out);
    let _ = writeln!(out, "{:>16} {:>14}", "drop reason", "datagrams");
    for r in DropReason::ALL {
        let _ = writeln!(
            out,
            "{:>16} {:>14.0}",
            r.as_str(),
            get(
                "ringmux_datagrams_dropped_total",
                Some(("reason", r.as_str()))
            )
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exposition_names_and_table() {
        let c = Counters::new(2);
        c.received.store(10, Ordering::Relaxed);
        c.instances[1].forwarded.store(7, Ordering::Relaxed);
        c.dropped[DropReason::Malformed as usize].store(3, Ordering::Relaxed);
        let text = c.encode();
        assert!(
            text.contains("ringmux_datagrams_received_total 10"),
            "{text}"
        );
        assert!(
            text.contains("ringmux_datagrams_forwarded_total{instance=\"1\"} 7"),
            "{text}"
        );
        assert!(
            text.contains("ringmux_datagrams_dropped_total{reason=\"malformed\"} 3"),
            "{text}"
        );
        let table = stats_table(&text);
        assert!(
            table.contains("received 10   forwarded 7   dropped 3"),
            "{table}"
        );
        assert!(
            table
                .lines()
                .any(|l| l.trim_start().starts_with("malformed") && l.trim_end().ends_with('3')),
            "{table}"
        );
    }
}
