//! A program's own counters and gauges, reported to the demux in every `STATS` as labelled
//! series (`control-protocol.md`, "STATS series"), which ringmux exposes per instance as
//! `ringmux_worker_NAME_total{instance,KEY=VALUE,…}` (a gauge without `_total`): metrics of a
//! program's own with no change to ringmux. Declare one with [`Worker::counter`] or
//! [`Worker::gauge`] and count on the handle; the library reads it once a second.
//!
//! [`Worker::counter`]: crate::Worker::counter
//! [`Worker::gauge`]: crate::Worker::gauge

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use ringmux_proto::series::{Series, SeriesError, MAX_SERIES};
use ringmux_proto::WorkerReport;

/// A counter of the program's own: a total since the worker started, only ever added to.
/// Clones count into the same total. `Relaxed`: a statistic, publishing nothing.
#[derive(Clone, Debug)]
pub struct Counter(Arc<AtomicU64>);

impl Counter {
    pub fn add(&self, n: u64) {
        self.0.fetch_add(n, Ordering::Relaxed);
    }

    pub fn inc(&self) {
        self.add(1);
    }

    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// A gauge of the program's own: a value now (a queue's depth, a pool's size). Clones set the
/// same value.
#[derive(Clone, Debug)]
pub struct Gauge(Arc<AtomicU64>);

impl Gauge {
    pub fn set(&self, v: u64) {
        self.0.store(v, Ordering::Relaxed);
    }

    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// Fills the application's part of a `STATS` report; see [`crate::Worker::set_report`].
pub type ReportFn = Box<dyn Fn(&mut WorkerReport) + Send + Sync>;

/// What the library adds to each report: the declared series, then what the program's
/// [`ReportFn`] sets (over them, where both name one series).
#[derive(Default)]
pub(crate) struct Report {
    pub(crate) fill: Mutex<Option<ReportFn>>,
    series: Mutex<BTreeMap<Series, Arc<AtomicU64>>>,
}

impl Report {
    /// The value behind `series`: the one declared before, or a new one while fewer than
    /// [`MAX_SERIES`] are.
    pub(crate) fn declare(&self, series: Series) -> Result<Arc<AtomicU64>, SeriesError> {
        let mut declared = self.series.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(v) = declared.get(&series) {
            return Ok(v.clone());
        }
        if declared.len() >= MAX_SERIES {
            return Err(SeriesError::TooMany);
        }
        Ok(declared.entry(series).or_default().clone())
    }

    pub(crate) fn counter(&self, series: Series) -> Result<Counter, SeriesError> {
        self.declare(series).map(Counter)
    }

    pub(crate) fn gauge(&self, series: Series) -> Result<Gauge, SeriesError> {
        self.declare(series).map(Gauge)
    }

    /// Adds the declared series to `r`, then lets the program's [`ReportFn`] fill it.
    pub(crate) fn fill(&self, r: &mut WorkerReport) {
        for (series, v) in self.series.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            // Declared within MAX_SERIES, into a report that held none: always room.
            let _ = r.set_series(series.clone(), v.load(Ordering::Relaxed));
        }
        if let Some(f) = self.fill.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
            f(r);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn declared_series_fill_the_report_under_the_program_s_own() {
        let report = Report::default();
        let bytes = report
            .counter(Series::counter("echo_bytes", &[("direction", "in")]).unwrap())
            .unwrap();
        let again = report
            .counter(Series::counter("echo_bytes", &[("direction", "in")]).unwrap())
            .unwrap();
        bytes.add(5);
        again.inc();
        let depth = report.gauge(Series::gauge("depth", &[]).unwrap()).unwrap();
        depth.set(3);
        *report.fill.lock().unwrap() = Some(Box::new(|r: &mut WorkerReport| {
            r.set_gauge("depth", &[], 4).unwrap();
        }));
        let mut r = WorkerReport::default();
        report.fill(&mut r);
        assert_eq!(r.counter("echo_bytes", &[("direction", "in")]), Some(6));
        assert_eq!(
            r.series[&Series::gauge("depth", &[]).unwrap()],
            4,
            "the program's own fill last"
        );
        for i in 2..MAX_SERIES {
            report
                .counter(Series::counter("c", &[("i", &i.to_string())]).unwrap())
                .unwrap();
        }
        let past = report.counter(Series::counter("one_more", &[]).unwrap());
        assert_eq!(past.err(), Some(SeriesError::TooMany));
    }
}
