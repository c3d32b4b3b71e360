//! Load-test statistics: a latency histogram and error counts per worker task, merged at the
//! end into the report `h3-probe` prints and writes as JSON.
//!
//! Percentiles come from hdrhistogram (p50, p99, p99.9, max), never from averages.

use std::collections::BTreeMap;
use std::time::Duration;

use hdrhistogram::Histogram;
use serde::Serialize;

/// Highest latency the histogram resolves (larger values are clamped to it): 10 minutes in µs.
const MAX_LATENCY_US: u64 = 600_000_000;

/// Successful requests and their latencies, plus failed requests by kind.
#[derive(Debug, Clone)]
pub struct ProbeStats {
    latency_us: Histogram<u64>,
    requests: u64,
    errors: BTreeMap<String, u64>,
    /// Requests the server turned away unprocessed while draining (GOAWAY): moved to a new
    /// connection, not errors.
    pub goaways: u64,
}

impl Default for ProbeStats {
    fn default() -> Self {
        Self::new()
    }
}

impl ProbeStats {
    pub fn new() -> Self {
        ProbeStats {
            // 3 significant digits over 1 µs ..= 10 min: fixed bounds, cannot fail.
            latency_us: Histogram::new_with_bounds(1, MAX_LATENCY_US, 3)
                .expect("valid histogram bounds"),
            requests: 0,
            errors: BTreeMap::new(),
            goaways: 0,
        }
    }

    /// A successful request that took `latency`.
    pub fn record_ok(&mut self, latency: Duration) {
        let us = u64::try_from(latency.as_micros())
            .unwrap_or(u64::MAX)
            .max(1);
        self.latency_us.saturating_record(us);
        self.requests += 1;
    }

    /// A failed request (or connection attempt) of the given kind.
    pub fn record_error(&mut self, kind: &str) {
        *self.errors.entry(kind.to_string()).or_default() += 1;
    }

    pub fn requests(&self) -> u64 {
        self.requests
    }

    pub fn error_total(&self) -> u64 {
        self.errors.values().sum()
    }

    /// Adds `other` into `self`.
    pub fn merge(&mut self, other: &ProbeStats) {
        // Both histograms have the same bounds, so adding cannot fail; if it ever did, the
        // percentiles would miss `other`, and the counts below would still be right.
        let _ = self.latency_us.add(&other.latency_us);
        self.requests += other.requests;
        self.goaways += other.goaways;
        for (kind, n) in &other.errors {
            *self.errors.entry(kind.clone()).or_default() += n;
        }
    }

    /// The report over a measurement window of `elapsed`.
    pub fn report(&self, elapsed: Duration) -> ProbeReport {
        let secs = elapsed.as_secs_f64();
        let mut errors = self.errors.clone();
        errors.insert("total".to_string(), self.error_total());
        let q = |q| {
            if self.requests == 0 {
                0
            } else {
                self.latency_us.value_at_quantile(q)
            }
        };
        ProbeReport {
            requests: self.requests,
            goaways: self.goaways,
            requests_per_s: if secs > 0.0 {
                self.requests as f64 / secs
            } else {
                0.0
            },
            errors,
            latency_us: Latency {
                p50: q(0.5),
                p99: q(0.99),
                p999: q(0.999),
                max: if self.requests == 0 {
                    0
                } else {
                    self.latency_us.max()
                },
            },
            client_cpu_us_per_request: None,
        }
    }
}

/// One process's share of a multi-process `h3-probe` run (`--processes`): its counts and its
/// latency histogram as (value, count) pairs, so the parent can merge exact percentiles.
#[derive(Debug, Clone, Serialize, serde::Deserialize, PartialEq)]
pub struct ProbeShard {
    pub requests: u64,
    #[serde(default)]
    pub goaways: u64,
    pub errors: BTreeMap<String, u64>,
    /// Recorded latency values in µs (each bucket's highest equivalent value) and their counts.
    pub latency_us: Vec<(u64, u64)>,
    /// Length of this process's measurement window in seconds.
    pub measured_s: f64,
    /// This process's CPU time over its measurement window, seconds (every thread, user and
    /// system); absent when it was not measured.
    #[serde(default)]
    pub client_cpu_s: Option<f64>,
}

impl ProbeShard {
    pub fn new(stats: &ProbeStats, measured: Duration) -> Self {
        ProbeShard {
            requests: stats.requests,
            goaways: stats.goaways,
            errors: stats.errors.clone(),
            latency_us: stats
                .latency_us
                .iter_recorded()
                .map(|v| (v.value_iterated_to(), v.count_at_value()))
                .collect(),
            measured_s: measured.as_secs_f64(),
            client_cpu_s: None,
        }
    }

    /// Back into statistics (histogram values land in the same buckets they came from).
    pub fn stats(&self) -> ProbeStats {
        let mut s = ProbeStats::new();
        for &(v, n) in &self.latency_us {
            let _ = s.latency_us.record_n(v.clamp(1, MAX_LATENCY_US), n);
        }
        s.requests = self.requests;
        s.goaways = self.goaways;
        s.errors = self.errors.clone();
        s
    }
}

/// What `h3-probe --json` writes.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ProbeReport {
    /// Successful requests in the measurement window (after warm-up).
    pub requests: u64,
    pub requests_per_s: f64,
    /// Requests a draining server turned away unprocessed (GOAWAY), retried on a new
    /// connection; not failures.
    pub goaways: u64,
    /// Failures by kind, plus `total`.
    pub errors: BTreeMap<String, u64>,
    pub latency_us: Latency,
    /// The client's own CPU time over the measurement window (every thread of every h3-probe
    /// process, user and system) per request counted in it, successes and errors, µs; absent
    /// when not measured.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub client_cpu_us_per_request: Option<f64>,
}

impl ProbeReport {
    /// With the client's CPU time over the measurement window.
    pub fn with_client_cpu(mut self, cpu: Duration) -> Self {
        let counted = self.requests + self.errors.get("total").copied().unwrap_or(0);
        self.client_cpu_us_per_request =
            (counted > 0).then(|| cpu.as_secs_f64() * 1e6 / counted as f64);
        self
    }
}

/// Latency percentiles in microseconds.
#[derive(Debug, Clone, Copy, Serialize, PartialEq, Eq)]
pub struct Latency {
    pub p50: u64,
    pub p99: u64,
    pub p999: u64,
    pub max: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_merge_to_the_same_report() {
        let mut a = ProbeStats::new();
        let mut b = ProbeStats::new();
        for i in 1..=5000u64 {
            a.record_ok(Duration::from_micros(i * 7));
            b.record_ok(Duration::from_micros(100_000 + i));
        }
        b.record_error("reset");
        let mut whole = a.clone();
        whole.merge(&b);
        let d = Duration::from_secs(2);
        let mut merged = ProbeShard::new(&a, d).stats();
        let json = serde_json::to_string(&ProbeShard::new(&b, d)).unwrap();
        let back: ProbeShard = serde_json::from_str(&json).unwrap();
        merged.merge(&back.stats());
        assert_eq!(merged.report(d), whole.report(d));
        assert_eq!(merged.requests(), 10_000);
        assert_eq!(merged.error_total(), 1);
    }

    #[test]
    fn report_shape() {
        let mut a = ProbeStats::new();
        let mut b = ProbeStats::new();
        for i in 1..=1000u64 {
            a.record_ok(Duration::from_micros(i));
        }
        b.record_error("timeout");
        b.record_error("timeout");
        b.record_error("status_404");
        b.goaways = 2;
        a.merge(&b);
        let r = a.report(Duration::from_secs(2));
        assert_eq!(r.requests, 1000);
        assert_eq!(r.requests_per_s, 500.0);
        assert_eq!(r.errors["total"], 3);
        assert_eq!(r.errors["timeout"], 2);
        assert!(
            (499..=501).contains(&r.latency_us.p50),
            "{:?}",
            r.latency_us
        );
        assert_eq!(r.latency_us.max, 1000);
        let json = serde_json::to_value(&r).unwrap();
        let keys: Vec<_> = json.as_object().unwrap().keys().cloned().collect();
        assert_eq!(keys.len(), 5);
        assert_eq!(r.goaways, 2, "goaways are counted apart from errors");
        for k in [
            "requests",
            "requests_per_s",
            "goaways",
            "errors",
            "latency_us",
        ] {
            assert!(json.get(k).is_some(), "{k}");
        }
        for k in ["p50", "p99", "p999", "max"] {
            assert!(json["latency_us"].get(k).is_some(), "{k}");
        }
        // The client's CPU per request, over successes and errors alike, when measured.
        let r = r.with_client_cpu(Duration::from_millis(10));
        assert_eq!(r.client_cpu_us_per_request, Some(10_000.0 / 1003.0));
        let json = serde_json::to_value(&r).unwrap();
        assert!(json.get("client_cpu_us_per_request").is_some());
        let none = ProbeStats::new().report(Duration::from_secs(1));
        assert_eq!(
            none.with_client_cpu(Duration::from_secs(1))
                .client_cpu_us_per_request,
            None
        );
    }
}
