//! `ringmux stats`: a running ringmux's metrics as a table.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use ringmux_proto::series::SeriesKind;

use super::counters::NO_SITE;
use super::{names, series, Counters, DropReason, InstanceCounters, Scrape};

/// `ringmux stats`: the metrics as a table.
pub fn table(m: &Scrape) -> String {
    let mut instances: Vec<String> = m
        .by_label(names::FORWARDED, "instance")
        .into_keys()
        .collect();
    instances.sort_by_key(|s| s.parse::<u32>().unwrap_or(u32::MAX));
    let mut out = String::new();
    let received = m.received();
    let forwarded = m.sum(names::FORWARDED);
    let dropped = m.sum(names::DROPPED);
    let _ = writeln!(
        out,
        "received {received:.0}   forwarded {forwarded:.0}   dropped {dropped:.0}"
    );
    let mut programs = m.label_values(names::WORKER_INFO, "program");
    programs.dedup();
    if !programs.is_empty() {
        let _ = writeln!(out, "workers run {}", programs.join(", "));
    }
    let _ = writeln!(out);
    // The lane counters' columns come from their table, in its order.
    let columns = || {
        InstanceCounters::TABLE
            .iter()
            .filter_map(|d| Some((d.metric, d.column?)))
    };
    let _ = write!(out, "{:>8} {:>4}", "instance", "up");
    for (_, (heading, width)) in columns() {
        let _ = write!(out, " {heading:>width$}");
    }
    let _ = writeln!(out, " {:>11} {:>12}", "connections", "requests");
    for i in &instances {
        let get = |name| m.labelled(name, "instance", i);
        let up = if get(names::WORKER_UP) > 0.0 {
            "yes"
        } else {
            "no"
        };
        let _ = write!(out, "{i:>8} {up:>4}");
        for (metric, (_, width)) in columns() {
            let _ = write!(out, " {:>width$.0}", get(metric));
        }
        let _ = writeln!(
            out,
            " {:>11.0} {:>12.0}",
            get(names::WORKER_CONNECTIONS),
            m.sum_where(names::WORKER_REQUESTS, "instance", i),
        );
    }
    generations(m, &mut out);
    certificates(m, &mut out);
    backends(m, &mut out);
    reported_series(m, &mut out);
    sites(m, &mut out);
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "admission: {}   retries {}   tokens {}",
        if m.get(names::ADMISSION_PRESSURE) > 0.0 {
            "under pressure"
        } else {
            "normal"
        },
        results(m, names::RETRIES),
        results(m, names::TOKENS),
    );
    let take = |r: &str| m.labelled(names::SESSION_TAKES, "result", r);
    let hello = |r: &str| m.labelled(names::CLIENT_HELLOS, "result", r);
    let _ = writeln!(
        out,
        "sessions: taken {:.0} hit, {:.0} miss   refused {:.0} foreign, {:.0} unbound   ClientHellos {:.0} read, {:.0} unparsed, {:.0} abandoned",
        take("hit"),
        take("miss"),
        take("foreign"),
        take("unbound"),
        hello("read"),
        hello("unparsed"),
        hello("abandoned"),
    );
    let worker_drops = |k: &str| m.sum_where(names::WORKER_MESSAGES_DROPPED, "kind", k);
    let _ = writeln!(
        out,
        "worker messages dropped past their rate: {:.0} stats, {:.0} control, {:.0} session",
        worker_drops("stats"),
        worker_drops("control"),
        worker_drops("session"),
    );
    let _ = writeln!(out);
    let _ = writeln!(out, "{:>16} {:>14}", "drop reason", "datagrams");
    for r in DropReason::ALL {
        let _ = writeln!(out, "{:>16} {:>14.0}", r.as_str(), m.dropped(r.as_str()));
    }
    out
}

/// `12 sent, 0 unsent`: the samples of `metric`, one of the demux's own ([`Counters::TABLE`]),
/// by `result`, in the table's order.
fn results(m: &Scrape, metric: &str) -> String {
    Counters::results(metric)
        .map(|r| format!("{:.0} {r}", m.labelled(metric, "result", r)))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Every series the workers reported ([`series::reported_as`]), whatever program reports it
/// and whatever it is named: a line per series name with a sample that is not 0, its samples
/// by their labels (the instance's left out: counters summed over the instances, gauges the
/// largest instance's), those that are 0 left out.
fn reported_series(m: &Scrape, out: &mut String) {
    // series name -> (kind, labels -> value)
    let mut reported: BTreeMap<&str, (SeriesKind, BTreeMap<String, f64>)> = BTreeMap::new();
    for (key, &v) in &m.series {
        let (metric, labels) = key.split_once('{').unwrap_or((key, ""));
        let Some((kind, name)) = series::reported_as(metric) else {
            continue;
        };
        let labels: Vec<&str> = labels
            .trim_end_matches('}')
            .split(',')
            .filter(|l| !l.is_empty() && !l.starts_with("instance="))
            .map(|l| l.split_once('=').map_or(l, |(_, v)| v).trim_matches('"'))
            .collect();
        let (_, samples) = reported
            .entry(name)
            .or_insert_with(|| (kind, BTreeMap::new()));
        let sample = samples.entry(labels.join(",")).or_default();
        *sample = match kind {
            SeriesKind::Counter => *sample + v,
            SeriesKind::Gauge => sample.max(v),
        };
    }
    reported.retain(|_, (_, samples)| {
        samples.retain(|_, v| *v != 0.0);
        !samples.is_empty()
    });
    let _ = writeln!(out);
    if reported.is_empty() {
        let _ = writeln!(out, "reported by the workers: nothing yet");
        return;
    }
    let _ = writeln!(
        out,
        "reported by the workers (counters over every instance, gauges the largest instance's):"
    );
    let width = reported.keys().map(|n| n.len()).max().unwrap_or(0);
    for (name, (_, samples)) in &reported {
        let samples: Vec<String> = samples
            .iter()
            .map(|(labels, v)| match labels.as_str() {
                "" => format!("{v:.0}"),
                labels => format!("{v:.0} {labels}"),
            })
            .collect();
        let _ = writeln!(out, "  {name:<width$}  {}", samples.join(", "));
    }
}

/// Responses by site over every instance: a row per site that answered (the sites in label
/// order, then `-`, requests no site answered), by status class, and the 421s. Nothing when
/// no site answered yet.
fn sites(m: &Scrape, out: &mut String) {
    use ringmux_proto::message::SITE_COLUMNS;
    let label = |labels: &[(String, String)], name: &str| {
        labels
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.clone())
            .unwrap_or_default()
    };
    let (classes, misdirected) = SITE_COLUMNS.split_at(SITE_COLUMNS.len() - 1);
    // site -> the classes, then the 421s
    let mut rows: BTreeMap<String, [f64; SITE_COLUMNS.len()]> = BTreeMap::new();
    for (labels, v) in m.samples(names::WORKER_SITE_RESPONSES) {
        let class = label(&labels, "class");
        if let Some(c) = classes.iter().position(|c| *c == class) {
            rows.entry(label(&labels, "site")).or_default()[c] += v;
        }
    }
    for (labels, v) in m.samples(names::WORKER_SITE_MISDIRECTED) {
        rows.entry(label(&labels, "site")).or_default()[classes.len()] += v;
    }
    if rows.is_empty() {
        return;
    }
    let no_site = rows.remove_entry(NO_SITE);
    let width = rows.keys().map(String::len).max().unwrap_or(0).max(4);
    let _ = writeln!(out);
    let _ = write!(out, "{:>width$}", "site");
    for column in classes.iter().chain(misdirected) {
        let _ = write!(out, " {column:>10}");
    }
    let _ = writeln!(out);
    for (site, row) in rows.iter().chain(no_site.as_ref().map(|(k, v)| (k, v))) {
        let _ = write!(out, "{site:>width$}");
        for v in row {
            let _ = write!(out, " {v:>10.0}");
        }
        let _ = writeln!(out);
    }
}

/// The worker generations: each one's state, workers up, connections, requests in flight and
/// (a draining one's) how long it has drained, its oldest worker's.
fn generations(m: &Scrape, out: &mut String) {
    // (generation, state) -> (workers up, connections, requests, seconds draining)
    let mut rows: std::collections::BTreeMap<(u64, String), (f64, f64, f64, f64)> =
        Default::default();
    let key = |labels: &[(String, String)]| {
        let get = |k: &str| {
            labels
                .iter()
                .find(|(n, _)| n == k)
                .map(|(_, v)| v.clone())
                .unwrap_or_default()
        };
        (get("generation").parse::<u64>().unwrap_or(0), get("state"))
    };
    for (labels, v) in m.samples(names::GENERATION_WORKERS) {
        rows.entry(key(&labels)).or_default().0 += v;
    }
    for (labels, v) in m.samples(names::GENERATION_CONNECTIONS) {
        rows.entry(key(&labels)).or_default().1 += v;
    }
    for (labels, v) in m.samples(names::GENERATION_REQUESTS) {
        rows.entry(key(&labels)).or_default().2 += v;
    }
    for (labels, v) in m.samples(names::GENERATION_DRAINING_SECONDS) {
        let row = rows.entry(key(&labels)).or_default();
        row.3 = row.3.max(v);
    }
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "new connections go to generation {:.0}   reloads {}   upgrades {}",
        m.get(names::GENERATION_ACTIVE),
        results(m, names::RELOADS),
        results(m, names::UPGRADES),
    );
    let _ = writeln!(
        out,
        "{:>10} {:>9} {:>10} {:>11} {:>8} {:>12}",
        "generation", "state", "workers up", "connections", "requests", "drained for"
    );
    for ((generation, state), (up, conns, requests, secs)) in rows.iter().rev() {
        let age = match state.as_str() {
            "draining" => format!("{secs:.0} s"),
            _ => "-".into(),
        };
        let _ = writeln!(
            out,
            "{generation:>10} {state:>9} {up:>10.0} {conns:>11.0} {requests:>8.0} {age:>12}"
        );
    }
}

/// Each certificate's days left, by site and name, and the ACME orders.
fn certificates(m: &Scrape, out: &mut String) {
    let samples = m.samples(names::CERTIFICATE_EXPIRY);
    if samples.is_empty() {
        return;
    }
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64());
    let label = |labels: &[(String, String)], key: &str| {
        labels
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.clone())
            .unwrap_or_default()
    };
    let rows: Vec<String> = samples
        .iter()
        .map(|(labels, not_after)| {
            let days = ((not_after - now) / 86_400.0).floor();
            format!(
                "{} ({}) {days:.0} days",
                label(labels, "name"),
                label(labels, "site")
            )
        })
        .collect();
    let _ = writeln!(out, "certificates: {}", rows.join(", "));
    let orders = |r: &str| m.sum_where(names::ACME_ORDERS, "result", r);
    if orders("issued") + orders("failed") > 0.0 {
        let _ = writeln!(
            out,
            "ACME orders: issued {:.0}   failed {:.0}",
            orders("issued"),
            orders("failed")
        );
    }
}

/// Each checked backend's verdict by its active health check, with its probes.
fn backends(m: &Scrape, out: &mut String) {
    let samples = m.samples(names::BACKEND_UP);
    if samples.is_empty() {
        return;
    }
    let label = |labels: &[(String, String)], key: &str| {
        labels
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.clone())
            .unwrap_or_default()
    };
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "{:>24} {:>16} {:>24} {:>6} {:>8} {:>8}",
        "backend", "site", "route", "state", "probes", "failed"
    );
    for (labels, up) in &samples {
        let backend = label(labels, "backend");
        let probes = m.sum_where(names::HEALTH_PROBES, "backend", &backend);
        let passed = m
            .samples(names::HEALTH_PROBES)
            .iter()
            .filter(|(l, _)| label(l, "backend") == backend && label(l, "result") == "pass")
            .map(|(_, v)| v)
            .sum::<f64>();
        let state = if *up > 0.0 { "up" } else { "down" };
        let _ = writeln!(
            out,
            "{:>24} {:>16} {:>24} {state:>6} {probes:>8.0} {:>8.0}",
            backend,
            label(labels, "site"),
            label(labels, "route"),
            probes - passed,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::counters::LaneState;
    use crate::{exposition, Counters};
    use ringmux_proto::series::Series;
    use std::sync::atomic::Ordering;

    #[test]
    fn table_shows_totals_instances_and_reasons() {
        let c = Counters::new(2, 8);
        c.received.store(10, Ordering::Relaxed);
        c.instances[1].forwarded.store(7, Ordering::Relaxed);
        let live = crate::Liveness::new(8);
        live.set_up(1, true);
        // Generation 1 drains in lanes 0 and 1 (one worker up, 5 connections); generation 2
        // serves in lanes 2 and 3 (slot 1), instance 0's worker also forwarded 4 datagrams.
        // Generation 1's workers drained for 12.4 s and 30 s, and still serve 3 requests.
        let secs = |s: f64| Some(std::time::Duration::from_secs_f64(s));
        c.instances[0].set_lane(1, LaneState::Draining, secs(12.4));
        c.instances[1].set_lane(1, LaneState::Draining, secs(30.0));
        c.instances[1].reported.set("connections_active", 5);
        c.instances[1].reported.set("requests_active", 3);
        c.instances[2].set_lane(2, LaneState::Serving, None);
        c.instances[3].set_lane(2, LaneState::Serving, None);
        c.instances[3].reported.set("requests_active", 2);
        c.instances[2].forwarded.store(4, Ordering::Relaxed);
        live.set_up(2, true);
        live.set_up(3, true);
        c.active_generation.store(2, Ordering::Relaxed);
        c.reloads.store(1, Ordering::Relaxed);
        c.dropped[DropReason::Malformed as usize].store(3, Ordering::Relaxed);
        c.retries_sent.store(6, Ordering::Relaxed);
        c.tokens_accepted.store(5, Ordering::Relaxed);
        c.dropped[DropReason::TokenRefused as usize].store(1, Ordering::Relaxed);
        c.under_pressure.store(1, Ordering::Relaxed);
        c.count_take(crate::TakeResult::Hit);
        c.count_take(crate::TakeResult::Hit);
        c.count_take(crate::TakeResult::Foreign);
        c.client_hellos[0].store(9, Ordering::Relaxed);
        // Instance 1's session requests past their rate, in two of its lanes.
        c.instances[1].session_dropped.store(2, Ordering::Relaxed);
        c.instances[3].session_dropped.store(5, Ordering::Relaxed);
        c.instances[0].stats_dropped.store(1, Ordering::Relaxed);
        *c.program.write().unwrap() = "/opt/app/bin/server".into();
        let t = table(&Scrape::parse(&exposition::encode(&c, &live)));
        assert!(t.contains("received 10   forwarded 11   dropped 4"), "{t}");
        assert!(
            t.contains(
                "admission: under pressure   retries 6 sent, 0 unsent   tokens 5 accepted, 1 refused"
            ),
            "{t}"
        );
        assert!(t.contains("workers run /opt/app/bin/server"), "{t}");
        assert!(
            t.contains("worker messages dropped past their rate: 1 stats, 0 control, 7 session"),
            "{t}"
        );
        assert!(
            t.contains("sessions: taken 2 hit, 0 miss   refused 1 foreign, 0 unbound   ClientHellos 9 read, 0 unparsed, 0 abandoned"),
            "{t}"
        );
        let row = |first: &str| {
            t.lines()
                .find(|l| l.split_whitespace().next() == Some(first))
                .unwrap_or_else(|| panic!("no row {first} in\n{t}"))
                .split_whitespace()
                .collect::<Vec<_>>()
        };
        // Instances: the newest generation's worker is up; forwarded adds up every lane.
        assert_eq!(row("1")[..3], ["1", "yes", "7"]);
        assert_eq!(row("0")[..3], ["0", "yes", "4"]);
        assert!(
            t.contains(
                "new connections go to generation 2   reloads 1 ok, 0 failed   upgrades 0 ok"
            ),
            "{t}"
        );
        assert_eq!(row("2")[..6], ["2", "serving", "2", "0", "2", "-"]);
        let drain = t
            .lines()
            .find(|l| l.contains("draining"))
            .unwrap_or_else(|| panic!("no draining row in\n{t}"));
        assert_eq!(
            drain.split_whitespace().collect::<Vec<_>>(),
            ["1", "draining", "1", "5", "3", "30", "s"]
        );
        assert_eq!(row("malformed"), ["malformed", "3"]);
        assert_eq!(row("token_refused"), ["token_refused", "1"]);
    }

    /// The workers' series by their own names and labels, whatever they are (the demux knows
    /// `tcp_errors` and `requests`, not `echo_bytes` nor `queue_depth`): counters summed over
    /// the instances and their generations, gauges the largest instance's; samples at 0 and
    /// series all 0 left out.
    #[test]
    fn table_shows_every_series_workers_report() {
        let c = Counters::new(2, 4);
        let report = |series: &[(Series, u64)], requests_total| ringmux_proto::WorkerReport {
            series: series.iter().cloned().collect(),
            requests_total,
            ..Default::default()
        };
        let counter = |n: &str, l: &[(&str, &str)]| Series::counter(n, l).unwrap();
        let gauge = |n: &str| Series::gauge(n, &[]).unwrap();
        c.instances[0].record_report(
            &report(
                &[
                    (counter("echo_bytes", &[("direction", "in")]), 5),
                    (counter("echo_bytes", &[("direction", "out")]), 0),
                    (counter("tcp_errors", &[("kind", "tls_failed")]), 2),
                    (counter("requests", &[("protocol", "h3")]), 4),
                    (gauge("queue_depth"), 3),
                    (counter("quiet", &[]), 0),
                ],
                4,
            ),
            0,
        );
        c.instances[1].record_report(
            &report(
                &[
                    (counter("echo_bytes", &[("direction", "in")]), 6),
                    (counter("tcp_errors", &[("kind", "tls_failed")]), 1),
                    (gauge("queue_depth"), 9),
                ],
                2,
            ),
            0,
        );
        // Instance 0's worker of the other generation: its counters add up.
        c.instances[2].record_report(&report(&[(counter("bytes_sent", &[]), 7)], 0), 0);
        let live = crate::Liveness::new(4);
        let t = table(&Scrape::parse(&exposition::encode(&c, &live)));
        let section: Vec<&str> = t
            .lines()
            .skip_while(|l| !l.starts_with("reported by the workers"))
            .skip(1)
            .take_while(|l| !l.is_empty())
            .map(str::trim)
            .collect();
        assert_eq!(
            section,
            [
                "bytes_sent   7",
                "echo_bytes   11 in",
                "queue_depth  9",
                "requests     4 h3, 2 unknown",
                "tcp_errors   3 tls_failed",
            ],
            "{t}"
        );
        let t = table(&Scrape::parse(&exposition::encode(
            &Counters::new(1, 2),
            &crate::Liveness::new(2),
        )));
        assert!(t.contains("reported by the workers: nothing yet"), "{t}");
    }

    /// A row per site that answered, summed over instances and their generations, named by the
    /// demux's labels; the row of no site last; nothing of a site that never answered.
    #[test]
    fn table_shows_each_checked_backends_state_and_probes() {
        let c = Counters::new(1, 4);
        let table_json = r#"{"sites":[{"label":"a.test","names":["a.test"],"cert_pem":"","key_pem":"","routes":[{"path":"/api","action":{"upstream":{"url":["http://127.0.0.1:8","http://127.0.0.1:9"],"strip_prefix":false,"health":{"path":"/h","interval":2,"timeout":1}}}}]}],"default_site":null}"#;
        let sites: ringmux_proto::sites::SiteTable = serde_json::from_str(table_json).unwrap();
        let plan = ringmux_health::Plan::of(&sites);
        let keys: Vec<_> = plan.targets.iter().map(|t| t.key.clone()).collect();
        let writer = ringmux_health::HealthWriter::create(plan.slots()).unwrap();
        c.health.feed(ringmux_health::Feed {
            table: std::sync::Arc::new(writer),
            plan,
        });
        let mut t = ringmux_health::Tracker::default();
        t.observe(true, 1, 1);
        c.health
            .observed(&keys[0], ringmux_health::Outcome::Pass, t);
        let mut t = ringmux_health::Tracker::default();
        t.observe(false, 1, 1);
        c.health
            .observed(&keys[1], ringmux_health::Outcome::Timeout, t);
        c.health
            .observed(&keys[1], ringmux_health::Outcome::Connect, t);
        let live = crate::Liveness::new(4);
        let out = table(&Scrape::parse(&exposition::encode(&c, &live)));
        let rows: Vec<Vec<&str>> = out
            .lines()
            .filter(|l| l.contains("127_0_0_1_"))
            .map(|l| l.split_whitespace().collect())
            .collect();
        assert_eq!(
            rows,
            [
                vec!["127_0_0_1_8", "a.test", "/api", "up", "1", "0"],
                vec!["127_0_0_1_9", "a.test", "/api", "down", "2", "2"],
            ],
            "{out}"
        );
    }

    #[test]
    fn table_shows_responses_by_site() {
        let mut c = Counters::new(2, 8);
        c.site_labels = ["b.test", "a.test", "quiet.test", "-"]
            .map(String::from)
            .to_vec();
        let report = |rows: &[(u32, [u64; 6])]| ringmux_proto::WorkerReport {
            sites: rows.iter().copied().collect(),
            ..Default::default()
        };
        // Instance 0 in two generations (lanes 0 and 2), instance 1 in one.
        c.instances[0].record_report(&report(&[(0, [0, 5, 1, 0, 0, 0])]), 4);
        c.instances[2].record_report(&report(&[(0, [0, 2, 0, 1, 0, 1])]), 4);
        c.instances[1].record_report(
            &report(&[(1, [1, 7, 0, 0, 3, 0]), (3, [0, 0, 0, 2, 0, 2])]),
            4,
        );
        let live = crate::Liveness::new(8);
        let t = table(&Scrape::parse(&exposition::encode(&c, &live)));
        let lines: Vec<Vec<&str>> = t
            .lines()
            .skip_while(|l| l.split_whitespace().next() != Some("site"))
            .take_while(|l| !l.is_empty())
            .map(|l| l.split_whitespace().collect())
            .collect();
        assert_eq!(
            lines,
            [
                vec!["site", "1xx", "2xx", "3xx", "4xx", "5xx", "421"],
                vec!["a.test", "1", "7", "0", "0", "3", "0"],
                vec!["b.test", "0", "7", "1", "1", "0", "1"],
                vec!["-", "0", "0", "0", "2", "0", "2"],
            ],
            "{t}"
        );
        // Without any site's responses, no section.
        let t = table(&Scrape::parse(&exposition::encode(
            &Counters::new(1, 4),
            &live,
        )));
        assert!(
            !t.lines().any(|l| l.trim_start().starts_with("site ")),
            "{t}"
        );
    }
}
