//! The Prometheus endpoint: the counters in the text format at `http://ADDR/metrics`.

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use prometheus_client::encoding::text::encode as encode_text;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use super::counters::UPSTREAM_ERROR_KINDS;
use super::{names, Counters, DropReason, InstanceCounters};
use crate::dataplane::Liveness;

type Labels = Vec<(String, String)>;

/// The text exposition of `c`.
pub fn encode(c: &Counters, live: &Liveness) -> String {
    let mut reg = Registry::default();
    let ld = |a: &AtomicU64| a.load(Ordering::Relaxed);
    let counter = |reg: &mut Registry, name: &str, help: &str, v: u64| {
        let m = Counter::<u64>::default();
        m.inc_by(v);
        reg.register(base(name), help, m);
    };
    counter(
        &mut reg,
        names::RECEIVED,
        "Datagrams received on the public socket",
        ld(&c.received),
    );
    counter(
        &mut reg,
        names::RECV_CALLS,
        "Receive system calls (recvmmsg) that returned data",
        ld(&c.recv_calls),
    );
    counter(
        &mut reg,
        names::DATAPLANE_ALLOCATIONS,
        "Heap allocations made on the data-plane thread after start-up (should stay flat)",
        crate::alloc::dataplane_allocations(),
    );
    let dropped = Family::<Labels, Counter<u64>>::default();
    for r in DropReason::ALL {
        dropped
            .get_or_create(&vec![("reason".into(), r.as_str().into())])
            .inc_by(ld(&c.dropped[r as usize]));
    }
    reg.register(
        base(names::DROPPED),
        "Datagrams not forwarded, by reason",
        dropped,
    );

    type Get = fn(&InstanceCounters) -> u64;
    let per_instance: [(&str, &str, Get); 11] = [
        (
            names::FORWARDED,
            "Datagrams forwarded to an instance",
            |i| i.forwarded.load(Ordering::Relaxed),
        ),
        (
            names::DOORBELLS,
            "Doorbells rung (eventfd writes) per instance",
            |i| i.doorbells.load(Ordering::Relaxed),
        ),
        (names::WORKER_RESTARTS, "Worker processes restarted", |i| {
            i.restarts.load(Ordering::Relaxed)
        }),
        (
            names::RING_VIOLATIONS,
            "Ring protocol violations and stalls detected",
            |i| i.violations.load(Ordering::Relaxed),
        ),
        (
            names::RING_DISCARDED,
            "Forwarded datagrams discarded unread when a ring was reset",
            |i| i.discarded_on_reset.load(Ordering::Relaxed),
        ),
        (
            names::WORKER_REQUESTS,
            "HTTP/3 requests served (reported by the worker)",
            |i| i.requests_total.load(Ordering::Relaxed),
        ),
        (
            names::WORKER_CONNECTIONS_ACCEPTED,
            "QUIC connections accepted (reported by the worker)",
            |i| i.connections_total.load(Ordering::Relaxed),
        ),
        (
            names::WORKER_DATAGRAMS_DROPPED,
            "Datagrams the worker dropped at ingress",
            |i| i.worker_datagrams_dropped.load(Ordering::Relaxed),
        ),
        (
            names::WORKER_DATAGRAMS,
            "Datagrams the worker took from its ingress",
            |i| i.worker_datagrams_in.load(Ordering::Relaxed),
        ),
        (
            names::WORKER_BAD_CID,
            "Sink mode: datagrams whose connection ID is not the instance's",
            |i| i.worker_bad_cid.load(Ordering::Relaxed),
        ),
        (
            names::WORKER_CPU,
            "CPU time used by the worker process",
            |i| i.worker_cpu_ns.load(Ordering::Relaxed),
        ),
    ];
    for (name, help, get) in per_instance {
        let fam = Family::<Labels, Counter<u64>>::default();
        for (i, ic) in c.instances.iter().enumerate() {
            fam.get_or_create(&instance(i)).inc_by(get(ic));
        }
        reg.register(base(name), help, fam);
    }

    let gauges: [(&str, &str, Get); 6] = [
        (names::WORKER_PID, "Process id of the current worker", |i| {
            i.worker_pid.load(Ordering::Relaxed)
        }),
        (
            names::SINK_LATENCY_P50,
            "Sink mode: ring latency p50 (receive to dequeue)",
            |i| i.sink_lat_p50_ns.load(Ordering::Relaxed),
        ),
        (
            names::SINK_LATENCY_P99,
            "Sink mode: ring latency p99",
            |i| i.sink_lat_p99_ns.load(Ordering::Relaxed),
        ),
        (
            names::SINK_LATENCY_P999,
            "Sink mode: ring latency p99.9",
            |i| i.sink_lat_p999_ns.load(Ordering::Relaxed),
        ),
        (
            names::RING_OCCUPANCY,
            "Slots published and not yet released",
            |i| i.occupancy.load(Ordering::Relaxed),
        ),
        (
            names::WORKER_CONNECTIONS,
            "Open QUIC connections (reported by the worker)",
            |i| i.connections_active.load(Ordering::Relaxed),
        ),
    ];
    for (name, help, get) in gauges {
        let fam = Family::<Labels, Gauge<i64>>::default();
        for (i, ic) in c.instances.iter().enumerate() {
            fam.get_or_create(&instance(i))
                .set(i64::try_from(get(ic)).unwrap_or(i64::MAX));
        }
        reg.register(name, help, fam);
    }
    let upstream = Family::<Labels, Counter<u64>>::default();
    for (i, ic) in c.instances.iter().enumerate() {
        for (kind, v) in UPSTREAM_ERROR_KINDS.iter().zip(&ic.upstream_errors) {
            let mut labels = instance(i);
            labels.push(("kind".into(), (*kind).into()));
            upstream.get_or_create(&labels).inc_by(ld(v));
        }
    }
    reg.register(
        base(names::WORKER_UPSTREAM_ERRORS),
        "Reverse proxy (--upstream): upstream failures by kind (reported by the worker)",
        upstream,
    );
    let up = Family::<Labels, Gauge<i64>>::default();
    for i in 0..c.instances.len() {
        up.get_or_create(&instance(i)).set(i64::from(live.is_up(i)));
    }
    reg.register(names::WORKER_UP, "1 while the worker is serving", up);
    let info = Family::<Labels, Gauge<i64>>::default();
    let program = c.program.read().map(|p| p.clone()).unwrap_or_default();
    for i in 0..c.instances.len() {
        let mut labels = instance(i);
        labels.push(("program".into(), program.clone()));
        info.get_or_create(&labels).set(1);
    }
    reg.register(
        names::WORKER_INFO,
        "What each instance runs (--worker-cmd): always 1",
        info,
    );
    let mut out = String::new();
    let _ = encode_text(&mut out, &reg);
    out
}

/// The name a counter is registered under: the registry adds `_total` itself.
fn base(name: &str) -> &str {
    name.strip_suffix("_total").unwrap_or(name)
}

fn instance(i: usize) -> Labels {
    vec![("instance".into(), i.to_string())]
}

/// Serves `GET /metrics` on `addr` from a background thread.
pub fn serve(addr: SocketAddr, counters: Arc<Counters>, live: Arc<Liveness>) -> Result<SocketAddr> {
    let listener = TcpListener::bind(addr).with_context(|| {
        format!("binding the metrics address {addr} (--metrics / RINGMUX_METRICS)")
    })?;
    let local = listener.local_addr()?;
    std::thread::Builder::new()
        .name("metrics".into())
        .spawn(move || {
            for stream in listener.incoming().flatten() {
                let _ = answer(stream, &counters, &live);
            }
        })?;
    Ok(local)
}

fn answer(mut s: TcpStream, counters: &Counters, live: &Liveness) -> std::io::Result<()> {
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
        ("200 OK", encode(counters, live))
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::Scrape;

    #[test]
    fn every_name_is_exposed_with_its_values() {
        let c = Counters::new(2);
        c.received.store(10, Ordering::Relaxed);
        c.instances[1].forwarded.store(7, Ordering::Relaxed);
        c.dropped[DropReason::Malformed as usize].store(3, Ordering::Relaxed);
        let live = Liveness::new(2);
        live.set_up(1, true);
        let text = encode(&c, &live);
        let m = Scrape::parse(&text);
        for name in names::ALL {
            assert!(
                m.series
                    .keys()
                    .any(|k| k == name || k.starts_with(&format!("{name}{{"))),
                "{name} missing from\n{text}"
            );
        }
        assert_eq!(m.received(), 10.0);
        assert_eq!(m.instance(names::FORWARDED, 1), 7.0);
        assert_eq!(m.dropped("malformed"), 3.0);
        assert_eq!(
            (
                m.instance(names::WORKER_UP, 0),
                m.instance(names::WORKER_UP, 1)
            ),
            (0.0, 1.0)
        );
        assert_eq!(
            m.by_label(names::DROPPED, "reason").len(),
            DropReason::ALL.len()
        );
    }
}
