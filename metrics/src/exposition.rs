//! The Prometheus endpoint: the counters in the text format at `http://ADDR/metrics`.

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use prometheus_client::encoding::text::encode as encode_text;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use super::counters::{Declared, Kind, LaneState, DERIVED};
use super::{names, Counters, DropReason, InstanceCounters, Liveness};

type Labels = Vec<(String, String)>;

/// The text exposition of `c`.
pub fn encode(c: &Counters, live: &Liveness) -> String {
    let mut reg = Registry::default();
    let ld = |a: &AtomicU64| a.load(Ordering::Relaxed);
    own(&mut reg, c);
    certificates(&mut reg, c);
    backend_health(&mut reg, c);
    for (name, help, value) in [
        (
            names::DATAPLANE_ALLOCATIONS,
            "Heap allocations made on the data-plane thread after start-up (should stay flat)",
            super::counters::DATAPLANE_ALLOCATIONS.load(Ordering::Relaxed),
        ),
        (
            names::LOG_LINES_DROPPED,
            "Log lines of the demux and of its workers' output it could not write (queue full, or the write to its standard error failed)",
            super::counters::LINES_DROPPED.load(Ordering::Relaxed),
        ),
        (
            names::ACCESS_LOG_LINES_DROPPED,
            "Access-log lines the demux could not write (a failed write: a full disk)",
            super::counters::ACCESS_LINES_DROPPED.load(Ordering::Relaxed),
        ),
    ] {
        let counter = Counter::<u64>::default();
        counter.inc_by(value);
        reg.register(base(name), help, counter);
    }
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

    // The lane of each instance that new connections reach.
    let n = c.instance_count;
    let active_gen = ld(&c.active_generation);
    let active_lane = |i: usize| usize::from(ringmux_proto::generation_slot(active_gen)) * n + i;
    lanes(&mut reg, c, active_lane);
    reported(&mut reg, c);
    series(&mut reg, c, active_lane);
    sites(&mut reg, c);
    let up = Family::<Labels, Gauge<i64>>::default();
    for i in 0..n {
        up.get_or_create(&instance(i))
            .set(i64::from(live.is_up(active_lane(i))));
    }
    reg.register(
        names::WORKER_UP,
        "1 while the newest generation's worker serves",
        up,
    );
    generations(&mut reg, c, live);
    let info = Family::<Labels, Gauge<i64>>::default();
    let program = c.program.read().map(|p| p.clone()).unwrap_or_default();
    for i in 0..n {
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

/// How a metric made of a worker-reported value adds up over an instance's lanes.
#[derive(Clone, Copy)]
enum Over {
    /// A counter: the sum over every generation of the instance's workers.
    Lanes,
    /// A gauge: the sum over every generation (open connections).
    LanesNow,
}

/// The metrics made of the keys every worker reports (`STATS`, `ringmux_proto::WorkerReport`):
/// the report key, with the metric's name, help and sum. What a program reports beyond them is
/// its series, exposed by [`series`].
///
/// Each value is the worker's word, exposed as given: a worker may report anything, up to
/// 2^64 − 1. Sums over lanes saturate, so no report can overflow them (a panic in a debug
/// build), and a gauge above `i64::MAX` shows as `i64::MAX`.
const REPORTED: &[(&str, &str, Over, &str)] = &[
    (
        "connections_total",
        names::WORKER_CONNECTIONS_ACCEPTED,
        Over::Lanes,
        "QUIC connections accepted (reported by the worker)",
    ),
    (
        "connections_active",
        names::WORKER_CONNECTIONS,
        Over::LanesNow,
        "Open QUIC connections (reported by the worker)",
    ),
    (
        "datagrams_dropped",
        names::WORKER_DATAGRAMS_DROPPED,
        Over::Lanes,
        "Datagrams the worker dropped at ingress",
    ),
    (
        "datagrams_in",
        names::WORKER_DATAGRAMS,
        Over::Lanes,
        "Datagrams the worker took from its ingress",
    ),
    (
        "cpu_ns",
        names::WORKER_CPU,
        Over::Lanes,
        "CPU time used by the worker process",
    ),
];

/// Registers [`REPORTED`], summed over each instance's lanes.
fn reported(reg: &mut Registry, c: &Counters) {
    for &(key, name, over, help) in REPORTED {
        let sum = |i: usize| {
            c.lanes_of(i)
                .fold(0u64, |sum, (_, l)| sum.saturating_add(l.reported.get(key)))
        };
        match over {
            Over::Lanes => {
                let family = Family::<Labels, Counter<u64>>::default();
                for i in 0..c.instance_count {
                    family.get_or_create(&instance(i)).inc_by(sum(i));
                }
                reg.register(base(name), help, family);
            }
            Over::LanesNow => {
                let family = Family::<Labels, Gauge<i64>>::default();
                for i in 0..c.instance_count {
                    family
                        .get_or_create(&instance(i))
                        .set(i64::try_from(sum(i)).unwrap_or(i64::MAX));
                }
                reg.register(name, help, family);
            }
        }
    }
}

/// The series workers name themselves ([`super::series`]): a counter summed over every
/// generation of the instance's workers, a gauge of its newest one, each sum saturating. A
/// [`KNOWN`](super::series::KNOWN) metric is there, with its help, whether or not any worker
/// reports it; `ringmux_worker_requests_total` also gets `protocol="unknown"`, what
/// `requests_total` counts beyond the requests reported by protocol. A metric of one kind
/// hides the other kind's series of its name (each lane holds one kind per name; lanes may
/// disagree).
fn series(reg: &mut Registry, c: &Counters, active_lane: impl Fn(usize) -> usize) {
    use super::series::{self as series, KNOWN};
    use ringmux_proto::series::SeriesKind;
    use std::collections::BTreeMap;
    // By the metric's base name (one `# TYPE` line): (metric, kind, help, labels -> sum).
    type Sums = BTreeMap<Labels, u64>;
    let mut metrics: BTreeMap<String, (String, SeriesKind, &str, Sums)> = KNOWN
        .iter()
        .map(|k| {
            let entry = (k.metric.to_owned(), k.kind, k.help, Sums::new());
            (series::base(k.metric).to_owned(), entry)
        })
        .collect();
    for i in 0..c.instance_count {
        for (lane, l) in c.lanes_of(i) {
            for (s, v) in l.series.get() {
                if s.kind() == SeriesKind::Gauge && lane != active_lane(i) {
                    continue;
                }
                let metric = series::metric(&s);
                let entry = metrics
                    .entry(series::base(&metric).to_owned())
                    .or_insert_with(|| {
                        (metric.clone(), s.kind(), series::GENERIC_HELP, Sums::new())
                    });
                if entry.0 != metric || entry.1 != s.kind() {
                    continue;
                }
                let mut labels = instance(i);
                labels.extend(s.labels().iter().cloned());
                let sum = entry.3.entry(labels).or_default();
                *sum = sum.saturating_add(v);
            }
        }
        if let Some((_, _, _, requests)) = metrics.get_mut(series::base(names::WORKER_REQUESTS)) {
            let total = c.lanes_of(i).fold(0u64, |sum, (_, l)| {
                sum.saturating_add(l.reported.get("requests_total"))
            });
            let mine = instance(i);
            let known = requests
                .iter()
                .filter(|(labels, _)| labels[0] == mine[0])
                .fold(0u64, |sum, (_, v)| sum.saturating_add(*v));
            let mut labels = mine;
            labels.push(("protocol".into(), "unknown".into()));
            let unknown = requests.entry(labels).or_default();
            *unknown = unknown.saturating_add(total.saturating_sub(known));
        }
    }
    for (metric, kind, help, sums) in metrics.into_values() {
        match kind {
            SeriesKind::Counter => {
                let family = Family::<Labels, Counter<u64>>::default();
                for (labels, v) in sums {
                    family.get_or_create(&labels).inc_by(v);
                }
                reg.register(base(&metric), help, family);
            }
            SeriesKind::Gauge => {
                let family = Family::<Labels, Gauge<i64>>::default();
                for (labels, v) in sums {
                    family
                        .get_or_create(&labels)
                        .set(i64::try_from(v).unwrap_or(i64::MAX));
                }
                reg.register(metric, help, family);
            }
        }
    }
}

/// The responses by site of each instance, summed over its lanes as the other reported
/// counters are: a series per site that answered on the instance (and per status class), each
/// named by the demux's own label for the index the worker reported.
fn sites(reg: &mut Registry, c: &Counters) {
    use ringmux_proto::message::SITE_COLUMNS;
    let responses = Family::<Labels, Counter<u64>>::default();
    let misdirected = Family::<Labels, Counter<u64>>::default();
    for i in 0..c.instance_count {
        // By label: the lanes of an instance may hold generations handed different tables.
        let mut rows = std::collections::BTreeMap::<String, [u64; SITE_COLUMNS.len()]>::new();
        for (_, lane) in c.lanes_of(i) {
            for (site, row) in lane.sites.labelled(&c.site_labels) {
                let sum = rows.entry(site).or_default();
                for (s, v) in sum.iter_mut().zip(row) {
                    *s = s.saturating_add(v);
                }
            }
        }
        for (site, row) in rows {
            let mut labels = instance(i);
            labels.push(("site".into(), site));
            // The classes, then the 421s.
            let [classes @ .., misdirected_count] = row;
            misdirected.get_or_create(&labels).inc_by(misdirected_count);
            for (class, v) in SITE_COLUMNS.iter().zip(classes) {
                let mut labels = labels.clone();
                labels.push(("class".into(), (*class).into()));
                responses.get_or_create(&labels).inc_by(v);
            }
        }
    }
    reg.register(
        base(names::WORKER_SITE_RESPONSES),
        "Responses by site and status class (reported by the worker); site - is requests no site answered",
        responses,
    );
    reg.register(
        base(names::WORKER_SITE_MISDIRECTED),
        "Of the responses by site, the 421s: requests for a name the connection's certificate does not serve (reported by the worker)",
        misdirected,
    );
}

/// Each site's certificate's expiry, and the ACME orders.
fn certificates(reg: &mut Registry, c: &Counters) {
    let expiry = Family::<Labels, Gauge<i64>>::default();
    if let Ok(certs) = c.certificates.read() {
        for (site, name, not_after) in certs.iter() {
            expiry
                .get_or_create(&vec![
                    ("site".into(), site.clone()),
                    ("name".into(), name.clone()),
                ])
                .set(*not_after);
        }
    }
    reg.register(
        names::CERTIFICATE_EXPIRY,
        "When the certificate each site serves expires (notAfter), Unix time",
        expiry,
    );
    let orders = Family::<Labels, Counter<u64>>::default();
    for (result, n) in ["issued", "failed"].iter().zip(&c.acme_orders) {
        orders
            .get_or_create(&vec![("result".into(), (*result).into())])
            .inc_by(n.load(Ordering::Relaxed));
    }
    reg.register(
        base(names::ACME_ORDERS),
        "ACME certificate orders by result",
        orders,
    );
    let refused = Family::<Labels, Counter<u64>>::default();
    let files = names::ACME_STATE_FILES.iter().chain(&["foreign-challenge"]);
    for (file, n) in files.zip(&c.acme_state_refused) {
        refused
            .get_or_create(&vec![("file".into(), (*file).into())])
            .inc_by(n.load(Ordering::Relaxed));
    }
    reg.register(
        base(names::ACME_STATE_REFUSED),
        "ACME state files refused: not sealed by a demux, or a challenge for a name no ACME site of this node has",
        refused,
    );
}

/// The active health checks: each checked backend's verdict, and the probes by result.
fn backend_health(reg: &mut Registry, c: &Counters) {
    let up = Family::<Labels, Gauge<i64>>::default();
    for row in c.health.backends() {
        let value = match row.verdict {
            ringmux_health::Verdict::Up => 1,
            ringmux_health::Verdict::Down => 0,
            ringmux_health::Verdict::Unknown => continue,
        };
        up.get_or_create(&vec![
            ("site".into(), row.site),
            ("route".into(), row.route),
            ("backend".into(), row.backend),
        ])
        .set(value);
    }
    reg.register(
        names::BACKEND_UP,
        "A checked backend's verdict by its active health check: 1 up, 0 down",
        up,
    );
    let probes = Family::<Labels, Counter<u64>>::default();
    for row in c.health.probes() {
        for (outcome, n) in ringmux_health::Outcome::ALL.iter().zip(row.results) {
            probes
                .get_or_create(&vec![
                    ("backend".into(), row.backend.clone()),
                    ("path".into(), row.path.clone()),
                    ("result".into(), outcome.as_str().into()),
                ])
                .inc_by(n);
        }
    }
    reg.register(
        base(names::HEALTH_PROBES),
        "Active health probes by backend, path and result, for the box",
        probes,
    );
}

/// The worker generations: which one takes new connections, and per instance, generation and
/// state its worker's liveness and connections. A generation appears while any of its workers
/// runs.
fn generations(reg: &mut Registry, c: &Counters, live: &Liveness) {
    let ld = |a: &AtomicU64| a.load(Ordering::Relaxed);
    let active = Gauge::<i64>::default();
    active.set(i64::try_from(ld(&c.active_generation)).unwrap_or(i64::MAX));
    reg.register(
        names::GENERATION_ACTIVE,
        "The worker generation new connections go to (1 at start, one more per reload)",
        active,
    );
    let workers = Family::<Labels, Gauge<i64>>::default();
    let connections = Family::<Labels, Gauge<i64>>::default();
    let requests = Family::<Labels, Gauge<i64>>::default();
    let draining = Family::<Labels, Gauge<f64, AtomicU64>>::default();
    for (lane, l) in c.instances.iter().enumerate() {
        let state = l.lane_state();
        if state == LaneState::Idle {
            continue;
        }
        let labels = vec![
            ("instance".into(), (lane % c.instance_count).to_string()),
            ("generation".into(), ld(&l.generation).to_string()),
            ("state".into(), state.as_str().into()),
        ];
        workers
            .get_or_create(&labels)
            .inc_by(i64::from(live.is_up(lane)));
        connections
            .get_or_create(&labels)
            .inc_by(i64::try_from(l.reported.get("connections_active")).unwrap_or(0));
        requests
            .get_or_create(&labels)
            .inc_by(i64::try_from(l.reported.get("requests_active")).unwrap_or(0));
        draining
            .get_or_create(&labels)
            .set(ld(&l.draining_ms) as f64 / 1000.0);
    }
    reg.register(
        names::GENERATION_WORKERS,
        "1 while the worker of this instance and generation is up, by state (starting, serving, draining)",
        workers,
    );
    reg.register(
        names::GENERATION_CONNECTIONS,
        "Open QUIC connections of the worker of this instance and generation (reported by it)",
        connections,
    );
    reg.register(
        names::GENERATION_REQUESTS,
        "HTTP requests in flight in the worker of this instance and generation (reported by it): what a draining generation still serves",
        requests,
    );
    reg.register(
        names::GENERATION_DRAINING_SECONDS,
        "Seconds since the worker of this instance and generation began to drain (0 while it does not)",
        draining,
    );
    // Counters by `result` of the arrays by an enum: name, help, and each result's label and
    // value.
    type ByResult<'a> = (&'a str, &'a str, Vec<(&'a str, &'a AtomicU64)>);
    let takes = super::TakeResult::ALL
        .iter()
        .map(|r| (r.as_str(), &c.session_takes[*r as usize]))
        .collect();
    let by_result: [ByResult<'_>; 2] = [
        (
            names::SESSION_TAKES,
            "Workers' requests to take a TLS session by result: hit or miss (granted: the ticket's ClientHello went to that instance), foreign (refused: it went to another) or unbound (refused: no such ClientHello seen)",
            takes,
        ),
        (
            names::CLIENT_HELLOS,
            "Initials the demux read for the session tickets of their ClientHellos, by result: read (a whole ClientHello), unopened (did not open with its DCID's keys: after a Retry, a client's later Initials; garbage), unparsed (not a ClientHello that parses), abandoned (too long, or crowded out while incomplete)",
            super::counters::HELLO_RESULTS
                .iter()
                .zip(&c.client_hellos)
                .map(|(l, v)| (*l, v))
                .collect(),
        ),
    ];
    for (name, help, results) in by_result {
        let fam = Family::<Labels, Counter<u64>>::default();
        for (result, v) in results {
            fam.get_or_create(&vec![("result".into(), result.into())])
                .inc_by(ld(v));
        }
        reg.register(base(name), help, fam);
    }
}

/// The demux's own counters and gauges, from their table ([`Counters::TABLE`]): one metric for
/// each metric named there, its fields the values of its `result` label when there are several.
fn own(reg: &mut Registry, c: &Counters) {
    let ld = |a: &AtomicU64| a.load(Ordering::Relaxed);
    for first in Declared::metrics(Counters::TABLE) {
        let (name, help) = (first.metric, first.help);
        let v = ld((first.get)(c));
        match first.kind {
            Kind::Counter if first.result.is_none() => {
                let m = Counter::<u64>::default();
                m.inc_by(v);
                reg.register(base(name), help, m);
            }
            Kind::Counter => {
                let fam = Family::<Labels, Counter<u64>>::default();
                let declared = Counters::TABLE
                    .iter()
                    .filter(|d| d.metric == name)
                    .map(|d| (d.result.unwrap_or_default(), (d.get)(c)));
                let derived = DERIVED
                    .iter()
                    .filter(|d| d.metric == name)
                    .map(|d| (d.result, (d.get)(c)));
                for (result, v) in declared.chain(derived) {
                    fam.get_or_create(&vec![("result".into(), result.into())])
                        .inc_by(ld(v));
                }
                reg.register(base(name), help, fam);
            }
            Kind::Gauge | Kind::Newest => {
                let m = Gauge::<i64>::default();
                m.set(i64::try_from(v).unwrap_or(i64::MAX));
                reg.register(name, help, m);
            }
            Kind::Flag => {
                let m = Gauge::<i64>::default();
                m.set(i64::from(v != 0));
                reg.register(name, help, m);
            }
            Kind::Seconds => {
                let m = Gauge::<f64, AtomicU64>::default();
                m.set(v as f64 / 1e9);
                reg.register(name, help, m);
            }
        }
    }
}

/// Each lane's counters and gauges, from their table ([`InstanceCounters::TABLE`]), by
/// instance: summed over its lanes (every generation of its workers), or of `active_lane(i)`,
/// its lane in the newest generation. Where several fields make one metric, each is the value
/// of its `kind` label.
fn lanes(reg: &mut Registry, c: &Counters, active_lane: impl Fn(usize) -> usize) {
    let ld = |a: &AtomicU64| a.load(Ordering::Relaxed);
    for first in Declared::metrics(InstanceCounters::TABLE) {
        let value = |d: &Declared<InstanceCounters>, i: usize| -> u64 {
            match d.kind {
                Kind::Newest => c
                    .instances
                    .get(active_lane(i))
                    .map_or(0, |l| ld((d.get)(l))),
                _ => c
                    .lanes_of(i)
                    .fold(0u64, |sum, (_, l)| sum.saturating_add(ld((d.get)(l)))),
            }
        };
        let fields = InstanceCounters::TABLE
            .iter()
            .filter(|d| d.metric == first.metric);
        let labels = |d: &Declared<InstanceCounters>, i: usize| {
            let mut labels = instance(i);
            if let Some(kind) = d.result {
                labels.push(("kind".into(), kind.into()));
            }
            labels
        };
        if first.kind == Kind::Counter {
            let fam = Family::<Labels, Counter<u64>>::default();
            for d in fields {
                for i in 0..c.instance_count {
                    fam.get_or_create(&labels(d, i)).inc_by(value(d, i));
                }
            }
            reg.register(base(first.metric), first.help, fam);
        } else {
            let fam = Family::<Labels, Gauge<i64>>::default();
            for d in fields {
                for i in 0..c.instance_count {
                    fam.get_or_create(&labels(d, i))
                        .set(i64::try_from(value(d, i)).unwrap_or(i64::MAX));
                }
            }
            reg.register(first.metric, first.help, fam);
        }
    }
}

/// The name a counter is registered under: the registry adds `_total` itself.
fn base(name: &str) -> &str {
    name.strip_suffix("_total").unwrap_or(name)
}

fn instance(i: usize) -> Labels {
    vec![("instance".into(), i.to_string())]
}

/// Longest request head the endpoint reads; a scrape's is about a hundred bytes.
const MAX_HEAD: usize = 8 * 1024;

/// How long a client has to send its whole request head, and to take the reply.
const CLIENT_DEADLINE: Duration = Duration::from_secs(2);

/// Clients served at once; one more is answered 503 and closed without being read.
const MAX_CLIENTS: usize = 4;

/// Serves `GET /metrics` on `addr`: an accepting thread, and one short-lived thread per client
/// up to 4. A client gets 2 s in total for its request head of at most 8 KiB, so neither a slow
/// nor an endless client can hold the endpoint or grow the demux's memory.
pub fn serve(addr: SocketAddr, counters: Arc<Counters>, live: Arc<Liveness>) -> Result<SocketAddr> {
    serve_on(bind(addr)?, counters, live)
}

/// Binds the metrics address.
pub fn bind(addr: SocketAddr) -> Result<TcpListener> {
    TcpListener::bind(addr).with_context(|| {
        format!("binding the metrics address {addr} (--metrics / RINGMUX_METRICS)")
    })
}

/// [`serve`] on a bound listener (one a previous process image of the demux handed over).
pub fn serve_on(
    listener: TcpListener,
    counters: Arc<Counters>,
    live: Arc<Liveness>,
) -> Result<SocketAddr> {
    listener.set_nonblocking(false)?;
    let local = listener.local_addr()?;
    let active = Arc::new(AtomicUsize::new(0));
    std::thread::Builder::new()
        .name("metrics".into())
        .spawn(move || {
            for stream in listener.incoming().flatten() {
                if active.fetch_add(1, Ordering::AcqRel) >= MAX_CLIENTS {
                    active.fetch_sub(1, Ordering::AcqRel);
                    busy(stream);
                    continue;
                }
                let (counters, live, slot) = (counters.clone(), live.clone(), active.clone());
                let spawned = std::thread::Builder::new()
                    .name("metrics-client".into())
                    .spawn(move || {
                        let _ = answer(stream, &counters, &live);
                        slot.fetch_sub(1, Ordering::AcqRel);
                    });
                if spawned.is_err() {
                    // The closure (and the stream) is gone with the error; free its place.
                    active.fetch_sub(1, Ordering::AcqRel);
                }
            }
        })?;
    Ok(local)
}

/// Turns a client away without reading it or waiting on it.
fn busy(s: TcpStream) {
    let _ = s.set_nonblocking(true);
    let _ = (&s).write_all(
        b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
    );
}

/// Why a request head could not be read.
enum HeadError {
    TooLarge,
    Late,
    Io,
}

/// Reads a request head (through its empty line), at most [`MAX_HEAD`] bytes, by `deadline`.
fn read_head(s: &mut TcpStream, deadline: Instant) -> Result<Vec<u8>, HeadError> {
    let mut head = Vec::with_capacity(512);
    let mut buf = [0u8; 1024];
    loop {
        let left = deadline
            .checked_duration_since(Instant::now())
            .filter(|d| !d.is_zero())
            .ok_or(HeadError::Late)?;
        s.set_read_timeout(Some(left)).map_err(|_| HeadError::Io)?;
        let n = match s.read(&mut buf) {
            Ok(0) => return Err(HeadError::Io),
            Ok(n) => n,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                return Err(HeadError::Late)
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(_) => return Err(HeadError::Io),
        };
        // Only the new bytes and the three before them can complete the end of the head.
        let from = head.len().saturating_sub(3);
        head.extend_from_slice(&buf[..n]);
        let tail = &head[from..];
        if tail.windows(4).any(|w| w == b"\r\n\r\n") || tail.windows(2).any(|w| w == b"\n\n") {
            return Ok(head);
        }
        if head.len() > MAX_HEAD {
            return Err(HeadError::TooLarge);
        }
    }
}

fn answer(mut s: TcpStream, counters: &Counters, live: &Liveness) -> std::io::Result<()> {
    let deadline = Instant::now() + CLIENT_DEADLINE;
    s.set_write_timeout(Some(CLIENT_DEADLINE))?;
    let (status, body) = match read_head(&mut s, deadline) {
        Ok(head) => {
            let line = head.split(|b| *b == b'\n').next().unwrap_or_default();
            if line.starts_with(b"GET /metrics ") || line.starts_with(b"GET /metrics?") {
                ("200 OK", encode(counters, live))
            } else {
                ("404 Not Found", "try /metrics\n".to_string())
            }
        }
        Err(HeadError::TooLarge) => (
            "431 Request Header Fields Too Large",
            "request head too large\n".into(),
        ),
        Err(HeadError::Late) => ("408 Request Timeout", "request head too slow\n".into()),
        Err(HeadError::Io) => return Ok(()),
    };
    let response = format!(
        "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    // One write: a formatted write! would issue a syscall per piece.
    s.write_all(response.as_bytes())?;
    // Unread input would make close() reset the connection before the client has read the
    // answer (a head that was too large or too slow): stop sending, then drain briefly.
    let _ = s.shutdown(std::net::Shutdown::Write);
    let _ = s.set_read_timeout(Some(Duration::from_millis(100)));
    let mut sink = [0u8; 4096];
    let mut drained = 0usize;
    while drained < 64 * 1024 {
        match s.read(&mut sink) {
            Ok(0) | Err(_) => break,
            Ok(n) => drained += n,
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Scrape;

    fn endpoint() -> SocketAddr {
        serve(
            "127.0.0.1:0".parse().unwrap(),
            Arc::new(Counters::new(1, 4)),
            Liveness::new(4),
        )
        .expect("metrics endpoint")
    }

    /// The status line of the reply on `s` (empty if the connection closed without one).
    fn status_line(s: &mut TcpStream) -> String {
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut reply = Vec::new();
        let _ = s.take(256).read_to_end(&mut reply);
        let text = String::from_utf8_lossy(&reply);
        text.lines().next().unwrap_or("").to_string()
    }

    #[test]
    fn an_endless_request_head_is_cut_off() {
        let addr = endpoint();
        let mut s = TcpStream::connect(addr).unwrap();
        // 64 KiB without a newline; the endpoint stops reading after MAX_HEAD.
        let junk = vec![b'a'; 64 * 1024];
        let _ = s.write_all(&junk);
        assert_eq!(
            status_line(&mut s),
            "HTTP/1.1 431 Request Header Fields Too Large"
        );
        assert!(crate::fetch(addr).is_ok(), "still serving");
    }

    #[test]
    fn a_trickling_client_neither_blocks_others_nor_stays() {
        let addr = endpoint();
        let mut slow = TcpStream::connect(addr).unwrap();
        let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let trickle = {
            let mut s = slow.try_clone().unwrap();
            let done = done.clone();
            // One byte every 50 ms, never a whole line: each read succeeds, so only a deadline
            // for the whole head ends it. Bounded: at most 20 s, and stops when told.
            std::thread::spawn(move || {
                for _ in 0..400 {
                    if done.load(Ordering::Relaxed) || s.write_all(b"G").is_err() {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(50));
                }
            })
        };
        let scrape = crate::fetch(addr);
        assert!(
            scrape.is_ok(),
            "a scrape beside a trickling client: {scrape:?}"
        );
        assert_eq!(status_line(&mut slow), "HTTP/1.1 408 Request Timeout");
        done.store(true, Ordering::Relaxed);
        trickle.join().unwrap();
    }

    #[test]
    fn clients_past_the_limit_are_turned_away_at_once() {
        let addr = endpoint();
        let idle: Vec<TcpStream> = (0..MAX_CLIENTS)
            .map(|_| TcpStream::connect(addr).unwrap())
            .collect();
        // The idle ones hold every place until their deadline; the next is answered 503.
        let mut extra = TcpStream::connect(addr).unwrap();
        assert_eq!(status_line(&mut extra), "HTTP/1.1 503 Service Unavailable");
        for mut s in idle {
            assert_eq!(status_line(&mut s), "HTTP/1.1 408 Request Timeout");
        }
        // A place is given back when its thread ends, a moment after its answer went out:
        // wait for that (bounded), not for a fixed time.
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        let mut scrape = crate::fetch(addr);
        while scrape.is_err() && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
            scrape = crate::fetch(addr);
        }
        assert!(scrape.is_ok(), "places are given back: {scrape:?}");
    }

    /// Forged reports (every counter at 2^64 − 1, in two generations of one instance) are
    /// exposed saturated, not summed past `u64::MAX` (which panics in a debug build).
    #[test]
    fn forged_reports_saturate_their_sums() {
        let c = Counters::new(2, 8);
        let mut forged = ringmux_proto::WorkerReport {
            connections_active: u64::MAX,
            requests_total: u64::MAX,
            sites: [(0, [u64::MAX; 6])].into_iter().collect(),
            ..Default::default()
        };
        for (name, label) in [
            ("requests", ("protocol", "h1")),
            ("requests", ("protocol", "h2")),
            ("tcp_errors", ("kind", "over_cap")),
            ("tcp_errors", ("kind", "tls_failed")),
            ("echo_bytes", ("direction", "in")),
        ] {
            forged.set_counter(name, &[label], u64::MAX).unwrap();
        }
        forged.set_gauge("queue", &[], u64::MAX).unwrap();
        // Lanes 1 and 3: instance 1 in generation slots 0 and 1.
        for lane in [1, 3] {
            c.instances[lane].set_lane(1, LaneState::Serving, None);
            c.instances[lane].record_report(&forged, 1);
            c.instances[lane]
                .stats_dropped
                .store(u64::MAX, Ordering::Relaxed);
        }
        let m = Scrape::parse(&encode(&c, &Liveness::new(8)));
        let max = u64::MAX as f64;
        assert_eq!(m.instance(names::WORKER_CONNECTIONS, 1), i64::MAX as f64);
        assert_eq!(
            m.sum_where(names::WORKER_TCP_ERRORS, "instance", "1"),
            2.0 * max,
            "two kinds, each saturated"
        );
        let requests = |p: &str| m.sum_where(names::WORKER_REQUESTS, "protocol", p);
        assert_eq!((requests("h1"), requests("unknown")), (max, 0.0));
        assert_eq!(
            m.get("ringmux_worker_echo_bytes_total{instance=\"1\",direction=\"in\"}"),
            max
        );
        assert_eq!(
            m.get("ringmux_worker_queue{instance=\"1\"}"),
            i64::MAX as f64,
            "a gauge of the newest generation's worker"
        );
        assert_eq!(
            m.sum_where(names::WORKER_MESSAGES_DROPPED, "kind", "stats"),
            max
        );
        assert_eq!(
            m.sum_where(names::WORKER_SITE_RESPONSES, "class", "5xx"),
            max,
            "one site's row in two generations"
        );
        assert_eq!(m.sum(names::WORKER_SITE_MISDIRECTED), max);
    }

    /// After a reload changed the sites, an instance's old and new generations report by the
    /// indices of different tables: each row is named by its own worker's table, and rows of
    /// one site add up by name.
    #[test]
    fn each_generation_names_its_rows_by_its_own_table() {
        let c = Counters::new(1, 2);
        c.instances[0]
            .sites
            .start(["a.test", "b.test", "-"].map(String::from).into());
        c.instances[1]
            .sites
            .start(["b.test", "c.test", "-"].map(String::from).into());
        let mut r = ringmux_proto::WorkerReport::default();
        r.sites.insert(1, [0, 5, 0, 0, 0, 0]);
        c.instances[0].record_report(&r, c.instances[0].sites.rows_known(0));
        r.sites.insert(0, [0, 2, 0, 0, 0, 0]);
        c.instances[1].record_report(&r, c.instances[1].sites.rows_known(0));
        let m = Scrape::parse(&encode(&c, &Liveness::new(2)));
        let ok = |site: &str| {
            m.get(&format!(
                "{}{{instance=\"0\",site=\"{site}\",class=\"2xx\"}}",
                names::WORKER_SITE_RESPONSES
            ))
        };
        assert_eq!((ok("b.test"), ok("c.test"), ok("a.test")), (7.0, 5.0, 0.0));
    }

    /// Lanes that disagree on a name's kind (a counter on one instance, a gauge on another)
    /// never make one family of two types: the first kind seen holds the name.
    #[test]
    fn a_name_holds_one_kind_across_instances() {
        let c = Counters::new(2, 2);
        for lane in 0..2 {
            c.instances[lane].set_lane(1, LaneState::Serving, None);
        }
        let mut counter = ringmux_proto::WorkerReport::default();
        counter.set_counter("x", &[("k", "a")], 5).unwrap();
        c.instances[0].record_report(&counter, 0);
        let mut gauge = ringmux_proto::WorkerReport::default();
        gauge.set_gauge("x", &[("k", "b")], 7).unwrap();
        c.instances[1].record_report(&gauge, 0);
        let text = encode(&c, &Liveness::new(2));
        let m = Scrape::parse(&text);
        assert_eq!(m.get("ringmux_worker_x_total{instance=\"0\",k=\"a\"}"), 5.0);
        assert_eq!(
            text.matches("# TYPE ringmux_worker_x ").count(),
            1,
            "{text}"
        );
        assert!(!text.contains("k=\"b\""), "{text}");
    }

    #[test]
    fn every_name_is_exposed_with_its_values() {
        let mut c = Counters::new(2, 8);
        c.site_labels = vec!["a.test".into(), "-".into()];
        let mut r = ringmux_proto::WorkerReport::default();
        r.sites.insert(0, [0, 4, 0, 1, 0, 1]);
        r.sites.insert(2, [9; 6]);
        for k in super::super::series::KNOWN {
            let labels: Vec<(&str, &str)> = k.label.iter().map(|l| (*l, "x")).collect();
            r.set_series(
                ringmux_proto::series::Series::new(k.kind, k.name, &labels).unwrap(),
                1,
            )
            .unwrap();
        }
        c.instances[1].record_report(&r, c.site_labels.len());
        r.sites.insert(1, [0, 0, 0, 3, 0, 0]);
        c.instances[3].record_report(&r, c.site_labels.len());
        c.instances[1].set_lane(1, LaneState::Serving, None);
        c.received.store(10, Ordering::Relaxed);
        c.instances[1].forwarded.store(7, Ordering::Relaxed);
        c.dropped[DropReason::Malformed as usize].store(3, Ordering::Relaxed);
        *c.certificates.write().unwrap() =
            vec![("a.test".into(), "www.a.test".into(), 1_900_000_000)];
        c.acme_orders[1].store(2, Ordering::Relaxed);
        // One checked backend, up after one probe.
        let table: ringmux_proto::sites::SiteTable = serde_json::from_str(
            r#"{"sites":[{"label":"a.test","names":["a.test"],"cert_pem":"","key_pem":"","routes":[{"path":"/","action":{"upstream":{"url":"http://127.0.0.1:9","strip_prefix":false,"health":{"path":"/h","interval":2,"timeout":1}}}}]}],"default_site":null}"#,
        )
        .unwrap();
        let plan = ringmux_health::Plan::of(&table);
        let key = plan.targets[0].key.clone();
        let writer = ringmux_health::HealthWriter::create(plan.slots()).unwrap();
        c.health.feed(ringmux_health::Feed {
            table: std::sync::Arc::new(writer),
            plan,
        });
        let mut tracker = ringmux_health::Tracker::default();
        tracker.observe(true, 1, 1);
        c.health
            .observed(&key, ringmux_health::Outcome::Pass, tracker);
        let live = Liveness::new(8);
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
        assert_eq!(
            m.get(r#"ringmux_backend_up{site="a.test",route="/",backend="127_0_0_1_9"}"#),
            1.0,
            "{text}"
        );
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
        // Sites: instance 1's two generations added up, by the demux's labels; the row past
        // the table dropped and counted, once per report.
        let site = |site: &str, class: &str| {
            m.get(&format!(
                "{}{{instance=\"1\",site=\"{site}\",class=\"{class}\"}}",
                names::WORKER_SITE_RESPONSES
            ))
        };
        assert_eq!((site("a.test", "2xx"), site("a.test", "4xx")), (8.0, 2.0));
        assert_eq!((site("-", "4xx"), site("-", "2xx")), (3.0, 0.0));
        assert_eq!(m.sum(names::WORKER_SITE_RESPONSES), 13.0, "{text}");
        assert_eq!(
            m.get(&format!(
                "{}{{instance=\"1\",site=\"a.test\"}}",
                names::WORKER_SITE_MISDIRECTED
            )),
            2.0
        );
        assert_eq!(
            m.sum_where(names::WORKER_REPORT_PARTS_DROPPED, "kind", "site"),
            2.0
        );
        assert_eq!(
            m.get(&format!(
                "{}{{site=\"a.test\",name=\"www.a.test\"}}",
                names::CERTIFICATE_EXPIRY
            )),
            1_900_000_000.0
        );
        assert_eq!(m.sum_where(names::ACME_ORDERS, "result", "failed"), 2.0);
    }
}
