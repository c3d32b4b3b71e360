//! The series workers name themselves in their `STATS` reports (`control-protocol.md`, "STATS
//! series"): which metric each becomes, which the demux refuses, and what a lane keeps of them.
//!
//! A counter `c:NAME{…}` is `ringmux_worker_NAME_total{instance,…}` and a gauge `g:NAME{…}` is
//! `ringmux_worker_NAME{instance,…}`, for any program. [`KNOWN`] only adds the help of the
//! series the built-in server reports, and the label each must carry; it names no metric of its
//! own but the sink's latency gauges, kept under the names the benchmarks read. A series whose
//! metric would be one the demux exposes of its own ([`names::ALL`]) is refused, so no worker
//! can forge or break one of those.

use std::collections::BTreeMap;
use std::sync::Mutex;

use ringmux_proto::series::{Series, SeriesKind, MAX_SERIES};

use super::names;

/// A series the demux describes: the built-in server's, under the names operators use.
#[derive(Clone, Copy, Debug)]
pub struct Known {
    pub kind: SeriesKind,
    pub name: &'static str,
    /// The one label key it carries, or none.
    pub label: Option<&'static str>,
    /// Its metric: the generic name but for the sink's gauges.
    pub metric: &'static str,
    pub help: &'static str,
}

/// The series of the built-in server (`control-protocol.md`, "STATS series"): their metrics
/// are exposed, with this help, whether or not a worker reports them.
pub const KNOWN: &[Known] = &[
    Known {
        kind: SeriesKind::Counter,
        name: "requests",
        label: Some("protocol"),
        metric: names::WORKER_REQUESTS,
        help: "HTTP requests served, by protocol: h1 and h2 over TCP, h3; unknown for a program \
               that reports no protocol (reported by the worker)",
    },
    Known {
        kind: SeriesKind::Counter,
        name: "upstream_errors",
        label: Some("kind"),
        metric: names::WORKER_UPSTREAM_ERRORS,
        help: "Reverse proxy (--upstream): upstream failures by kind (reported by the worker)",
    },
    Known {
        kind: SeriesKind::Counter,
        name: "tcp_connections",
        label: None,
        metric: names::WORKER_TCP_CONNECTIONS,
        help: "HTTPS over TCP: connections accepted (reported by the worker)",
    },
    Known {
        kind: SeriesKind::Counter,
        name: "tcp_errors",
        label: Some("kind"),
        metric: names::WORKER_TCP_ERRORS,
        help: "HTTPS over TCP: connections refused or ended for bad input or overload, or closed \
               idle, by kind (reported by the worker)",
    },
    Known {
        kind: SeriesKind::Counter,
        name: "access_log_lines",
        label: None,
        metric: names::WORKER_ACCESS_LOG_LINES,
        help: "Access log (--access-log): lines written (reported by the worker)",
    },
    Known {
        kind: SeriesKind::Counter,
        name: "access_log_dropped",
        label: None,
        metric: names::WORKER_ACCESS_LOG_DROPPED,
        help: "Access log (--access-log): lines dropped, the worker's queue full or the write \
               failed (reported by the worker)",
    },
    Known {
        kind: SeriesKind::Counter,
        name: "bad_cid",
        label: None,
        metric: names::WORKER_BAD_CID,
        help: "Sink mode: datagrams whose connection ID is not the instance's",
    },
    Known {
        kind: SeriesKind::Gauge,
        name: "sink_latency_p50_nanoseconds",
        label: None,
        metric: names::SINK_LATENCY_P50,
        help: "Sink mode: ring latency p50 (receive to dequeue)",
    },
    Known {
        kind: SeriesKind::Gauge,
        name: "sink_latency_p99_nanoseconds",
        label: None,
        metric: names::SINK_LATENCY_P99,
        help: "Sink mode: ring latency p99",
    },
    Known {
        kind: SeriesKind::Gauge,
        name: "sink_latency_p999_nanoseconds",
        label: None,
        metric: names::SINK_LATENCY_P999,
        help: "Sink mode: ring latency p99.9",
    },
];

/// The help of a series nobody described.
pub const GENERIC_HELP: &str = "Reported by the worker (a series of its STATS)";

/// The [`KNOWN`] entry of `series`'s kind and name.
pub fn known(series: &Series) -> Option<&'static Known> {
    KNOWN
        .iter()
        .find(|k| k.kind == series.kind() && k.name == series.name())
}

/// The metric `series` is exposed as: `ringmux_worker_NAME_total` for a counter,
/// `ringmux_worker_NAME` for a gauge, or its [`KNOWN`] name.
pub fn metric(series: &Series) -> String {
    if let Some(k) = known(series) {
        return k.metric.to_owned();
    }
    match series.kind() {
        SeriesKind::Counter => format!("ringmux_worker_{}_total", series.name()),
        SeriesKind::Gauge => format!("ringmux_worker_{}", series.name()),
    }
}

/// The kind and series name of `metric`, a metric of the exposition, if workers report it: a
/// [`KNOWN`] one, or one of the generic rule (`ringmux_worker_NAME_total`, a counter;
/// `ringmux_worker_NAME`, a gauge) that is none of the demux's own ([`names::ALL`]). What
/// `ringmux stats` shows of the workers' series, whatever they are named.
pub fn reported_as(metric: &str) -> Option<(SeriesKind, &str)> {
    if let Some(k) = KNOWN.iter().find(|k| k.metric == metric) {
        return Some((k.kind, k.name));
    }
    let name = metric.strip_prefix("ringmux_worker_")?;
    if names::ALL.iter().any(|n| base(n) == base(metric)) {
        return None;
    }
    Some(match name.strip_suffix("_total") {
        Some(name) => (SeriesKind::Counter, name),
        None => (SeriesKind::Gauge, name),
    })
}

/// A metric's name without the `_total` of a counter: what the text format's `# TYPE` line
/// names, so two metrics of one base would be one family of two types.
pub fn base(metric: &str) -> &str {
    metric.strip_suffix("_total").unwrap_or(metric)
}

/// Whether the demux takes `series`: a [`KNOWN`] one with its label, or one whose metric is
/// none of the demux's own names.
pub fn admitted(series: &Series) -> bool {
    if let Some(k) = known(series) {
        let keys: Vec<&str> = series.labels().iter().map(|(k, _)| k.as_str()).collect();
        return keys == k.label.as_slice();
    }
    let metric = metric(series);
    !names::ALL.iter().any(|n| base(n) == base(&metric))
}

/// What a lane's worker last reported of its series, at most [`MAX_SERIES`] of them: the
/// first the demux took, a series left out of a later report keeping its value.
#[derive(Debug, Default)]
pub struct LaneSeries(Mutex<BTreeMap<Series, u64>>);

impl LaneSeries {
    /// A copy of the series.
    pub fn get(&self) -> BTreeMap<Series, u64> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Forgets every series: a new worker of the lane counts from 0.
    pub fn clear(&self) {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clear();
    }

    /// Takes the series of a report: those [`admitted`], of a name no series of the other kind
    /// holds, while fewer than [`MAX_SERIES`] are held. Returns how many it dropped.
    pub fn update(&self, report: &BTreeMap<Series, u64>) -> u64 {
        let mut held = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let mut dropped = 0;
        for (series, &v) in report {
            if let Some(old) = held.get_mut(series) {
                *old = v;
                continue;
            }
            let other_kind = held
                .keys()
                .any(|h| h.name() == series.name() && h.kind() != series.kind());
            if held.len() >= MAX_SERIES || other_kind || !admitted(series) {
                dropped += 1;
                continue;
            }
            held.insert(series.clone(), v);
        }
        dropped
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The built-in server's counters keep the generic names (the table adds only help and a
    /// label); every known metric is one of [`names::ALL`].
    #[test]
    fn known_counters_follow_the_generic_rule() {
        for k in KNOWN {
            assert!(names::ALL.contains(&k.metric), "{}", k.metric);
            let labels: Vec<(&str, &str)> = k.label.iter().map(|l| (*l, "x")).collect();
            let s = Series::new(k.kind, k.name, &labels).unwrap();
            assert!(admitted(&s), "{}", k.name);
            if k.kind == SeriesKind::Counter {
                assert_eq!(k.metric, format!("ringmux_worker_{}_total", k.name));
            }
        }
    }

    /// Every metric a series becomes names its series back; none of the demux's own does.
    #[test]
    fn metrics_name_their_series_back() {
        for s in [
            Series::counter("echo_bytes", &[("direction", "in")]).unwrap(),
            Series::gauge("queue_depth", &[]).unwrap(),
            Series::counter("requests", &[("protocol", "h3")]).unwrap(),
            Series::gauge("sink_latency_p50_nanoseconds", &[]).unwrap(),
        ] {
            assert_eq!(reported_as(&metric(&s)), Some((s.kind(), s.name())), "{s}");
        }
        for own in names::ALL {
            if KNOWN.iter().all(|k| k.metric != own) {
                assert_eq!(reported_as(own), None, "{own}");
            }
        }
    }

    #[test]
    fn the_demux_own_names_are_refused() {
        let c = |n: &str, l: &[(&str, &str)]| admitted(&Series::counter(n, l).unwrap());
        let g = |n: &str| admitted(&Series::gauge(n, &[]).unwrap());
        assert!(c("echo_bytes", &[("direction", "in")]));
        assert!(g("queue_depth"));
        // The demux's own metrics, under either kind.
        for name in [
            "restarts",
            "connections",
            "pid",
            "up",
            "datagrams",
            "cpu_nanoseconds",
        ] {
            assert!(!c(name, &[]) && !g(name), "{name}");
        }
        // A known series under the other kind, or without its label, or with another.
        assert!(!g("requests") && !g("tcp_errors"));
        assert!(!c("requests", &[]));
        assert!(!c("requests", &[("protocol", "h3"), ("x", "y")]));
        assert!(c("requests", &[("protocol", "h3")]));
    }

    /// At most `MAX_SERIES` per lane, the first taken; a name holds one kind; refused and
    /// excess series are counted once per report; values update; a new worker starts empty.
    #[test]
    fn a_lane_holds_a_bounded_set() {
        let lane = LaneSeries::default();
        let mut report = BTreeMap::new();
        for i in 0..MAX_SERIES + 10 {
            let s = Series::counter("flood", &[("i", &format!("{i:04}"))]).unwrap();
            report.insert(s, 1);
        }
        report.insert(Series::gauge("flood", &[]).unwrap(), 1);
        report.insert(Series::counter("restarts", &[]).unwrap(), 1);
        assert_eq!(lane.update(&report), 12);
        assert_eq!(lane.get().len(), MAX_SERIES);
        let first = Series::counter("flood", &[("i", "0000")]).unwrap();
        assert_eq!(lane.update(&[(first.clone(), 9)].into()), 0);
        assert_eq!(lane.get()[&first], 9);
        let new = Series::counter("other", &[]).unwrap();
        assert_eq!(lane.update(&[(new, 1)].into()), 1, "full");
        lane.clear();
        assert!(lane.get().is_empty());
    }
}
