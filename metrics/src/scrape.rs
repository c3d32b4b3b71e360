//! The one reader of the Prometheus text ringmux exposes: `ringmux stats`, the tests and the
//! benchmarks all scrape through [`fetch`] and [`Scrape`].

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::time::Duration;

use anyhow::{bail, Context, Result};

use super::names;

/// Largest metrics reply read: far above what any number of instances produces, so a
/// misbehaving endpoint cannot make a reader grow without bound.
pub const MAX_REPLY: u64 = 16 << 20;

/// One scrape: every sample, keyed by its series (`name{labels}` as written), and its value.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Scrape {
    pub series: BTreeMap<String, f64>,
}

impl Scrape {
    /// Parses the text format; comments, blank and malformed lines are skipped.
    pub fn parse(text: &str) -> Scrape {
        let series = text
            .lines()
            .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
            .filter_map(|l| {
                let (key, value) = l.rsplit_once(' ')?;
                Some((key.to_string(), value.parse().ok()?))
            })
            .collect();
        Scrape { series }
    }

    /// The sample of `name` without labels, 0 if absent.
    pub fn get(&self, name: &str) -> f64 {
        self.series.get(name).copied().unwrap_or(0.0)
    }

    /// The sample of `name` with the one label `label="value"`, 0 if absent.
    pub fn labelled(&self, name: &str, label: &str, value: &str) -> f64 {
        self.series
            .get(&format!("{name}{{{label}=\"{value}\"}}"))
            .copied()
            .unwrap_or(0.0)
    }

    /// The sum of the samples of `name` that carry `label="value"` among their labels (e.g. one
    /// `kind` over every instance), 0 if there are none.
    pub fn sum_where(&self, name: &str, label: &str, value: &str) -> f64 {
        let prefix = format!("{name}{{");
        let needle = format!("{label}=\"{value}\"");
        self.series
            .iter()
            .filter(|(k, _)| {
                k.strip_prefix(&prefix)
                    .is_some_and(|rest| rest.split(',').any(|l| l.trim_end_matches('}') == needle))
            })
            .map(|(_, v)| v)
            .sum()
    }

    /// The per-instance sample of `name` (summed over its other labels, e.g. `protocol`), 0 if
    /// absent.
    pub fn instance(&self, name: &str, instance: u8) -> f64 {
        self.sum_where(name, "instance", &instance.to_string())
    }

    /// `ringmux_datagrams_dropped_total{reason}`.
    pub fn dropped(&self, reason: &str) -> f64 {
        self.labelled(names::DROPPED, "reason", reason)
    }

    /// Every value of `label` among the samples of `name`, with its sample.
    pub fn by_label(&self, name: &str, label: &str) -> BTreeMap<String, f64> {
        let prefix = format!("{name}{{{label}=\"");
        self.series
            .iter()
            .filter_map(|(k, v)| {
                let rest = k.strip_prefix(&prefix)?;
                Some((rest.split('"').next()?.to_string(), *v))
            })
            .collect()
    }

    /// Every sample of `name` that has labels, with its labels as (name, value) pairs.
    pub fn samples(&self, name: &str) -> Vec<(Vec<(String, String)>, f64)> {
        let prefix = format!("{name}{{");
        self.series
            .iter()
            .filter_map(|(k, v)| {
                let labels = k.strip_prefix(&prefix)?.strip_suffix('}')?;
                let pairs = labels
                    .split(',')
                    .filter_map(|l| {
                        let (key, value) = l.split_once('=')?;
                        Some((key.to_string(), value.trim_matches('"').to_string()))
                    })
                    .collect();
                Some((pairs, *v))
            })
            .collect()
    }

    /// The values of `label` among the samples of `name`, wherever it stands among the labels.
    pub fn label_values(&self, name: &str, label: &str) -> Vec<String> {
        let needle = format!("{label}=\"");
        self.series
            .keys()
            .filter_map(|k| {
                let labels = k.strip_prefix(name)?.strip_prefix('{')?;
                let from = labels.find(&needle)? + needle.len();
                Some(labels[from..].split('"').next()?.to_string())
            })
            .collect()
    }

    /// The sum of every sample of `name`, whatever its labels.
    pub fn sum(&self, name: &str) -> f64 {
        self.series
            .iter()
            .filter(|(k, _)| {
                k.as_str() == name || k.strip_prefix(name).is_some_and(|r| r.starts_with('{'))
            })
            .map(|(_, v)| v)
            .sum()
    }

    /// The largest per-instance sample of `name`.
    pub fn max(&self, name: &str) -> f64 {
        self.by_label(name, "instance")
            .values()
            .copied()
            .fold(0.0, f64::max)
    }

    /// Datagrams received.
    pub fn received(&self) -> f64 {
        self.get(names::RECEIVED)
    }

    /// Whether every datagram received is accounted for: `received == Σ forwarded + Σ dropped`
    /// (true at any quiet moment).
    pub fn balanced(&self) -> bool {
        self.received() == self.sum(names::FORWARDED) + self.sum(names::DROPPED)
    }
}

impl std::fmt::Display for Scrape {
    /// One `series value` line each, the sink latency gauges left out.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (k, v) in &self.series {
            if !k.contains("sink_latency") {
                writeln!(f, "  {k} {v}")?;
            }
        }
        Ok(())
    }
}

/// `GET /metrics` from a running ringmux at `addr` (`HOST:PORT`), read up to [`MAX_REPLY`].
pub fn fetch(addr: impl ToSocketAddrs + std::fmt::Display) -> Result<Scrape> {
    let to: SocketAddr = addr
        .to_socket_addrs()
        .with_context(|| format!("metrics address {addr}"))?
        .next()
        .with_context(|| format!("metrics address {addr} resolves to nothing"))?;
    let mut s = TcpStream::connect_timeout(&to, Duration::from_secs(5)).with_context(|| {
        format!(
            "connecting to the metrics address {addr}; is ringmux running with --metrics {addr}?"
        )
    })?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    // One write: the endpoint answers as soon as it has the request head and closes; a request
    // written in pieces could meet a closed socket.
    let request = format!("GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    s.write_all(request.as_bytes())
        .with_context(|| format!("requesting metrics from {addr}"))?;
    let mut text = String::new();
    s.take(MAX_REPLY)
        .read_to_string(&mut text)
        .with_context(|| format!("reading metrics from {addr}"))?;
    let Some((head, body)) = text.split_once("\r\n\r\n") else {
        bail!("malformed HTTP response from the metrics address {addr}");
    };
    if !head.starts_with("HTTP/1.1 200") {
        bail!(
            "the metrics address {addr} answered {:?}",
            head.lines().next().unwrap_or("")
        );
    }
    Ok(Scrape::parse(body))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_prometheus_text() {
        let m = Scrape::parse(
            "# HELP x y\nringmux_datagrams_received_total 12\n\
             ringmux_datagrams_dropped_total{reason=\"ring_full\"} 3\n\
             ringmux_datagrams_dropped_total{reason=\"oversize\"} 4\n\
             ringmux_datagrams_forwarded_total{instance=\"0\"} 5\n\
             ringmux_worker_pid{instance=\"0\"} 77\n\
             ringmux_worker_pid{instance=\"1\"} 78\nnot a sample\n# EOF\n",
        );
        assert_eq!(m.received(), 12.0);
        assert_eq!(m.sum(names::DROPPED), 7.0);
        assert_eq!(m.dropped("oversize"), 4.0);
        assert_eq!(m.instance(names::WORKER_PID, 1), 78.0);
        assert_eq!(m.by_label(names::DROPPED, "reason")["ring_full"], 3.0);
        assert_eq!(m.max(names::WORKER_PID), 78.0);
        assert_eq!(m.sum("ringmux_datagrams"), 0.0);
        assert!(m.balanced());
    }

    #[test]
    fn sums_one_label_value_over_the_other_labels() {
        let m = Scrape::parse(
            "ringmux_worker_upstream_errors_total{instance=\"0\",kind=\"reset\"} 2\n\
             ringmux_worker_upstream_errors_total{instance=\"1\",kind=\"reset\"} 3\n\
             ringmux_worker_upstream_errors_total{instance=\"1\",kind=\"timeout\"} 5\n\
             ringmux_worker_upstream_errors_total{kind=\"timeouts\",instance=\"1\"} 7\n",
        );
        let name = names::WORKER_UPSTREAM_ERRORS;
        assert_eq!(m.sum_where(name, "kind", "reset"), 5.0);
        assert_eq!(m.sum_where(name, "kind", "timeout"), 5.0);
        assert_eq!(m.sum_where(name, "instance", "1"), 15.0);
        assert_eq!(m.sum_where(name, "kind", "connect"), 0.0);
    }
}
