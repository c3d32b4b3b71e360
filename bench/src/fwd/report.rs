//! Per-mode summaries (median, min–max over rounds), within-round ratios, the checks against
//! the targets, the Markdown table, the JSON document and the SVG chart.
//!
//! Ratios are taken within each round (the modes of one round ran back to back under the same
//! background load) and then summarised, rather than dividing medians.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

use anyhow::{anyhow, Result};
use serde::Serialize;

use super::measure::{Regime, Round};
use super::reference::{RefRound, Variant};
use super::sender::SendShape;

/// Median, minimum and maximum of one figure over the rounds.
#[derive(Clone, Copy, Debug, Serialize, PartialEq)]
pub struct Stat {
    pub median: f64,
    pub min: f64,
    pub max: f64,
}

impl Stat {
    pub fn of(values: &[f64]) -> Option<Stat> {
        let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
        if v.is_empty() {
            return None;
        }
        v.sort_by(f64::total_cmp);
        let n = v.len();
        let median = if n % 2 == 1 {
            v[n / 2]
        } else {
            (v[n / 2 - 1] + v[n / 2]) / 2.0
        };
        Some(Stat {
            median,
            min: v[0],
            max: v[n - 1],
        })
    }

    /// Spread wider than 25 % of the median: say so next to the figure.
    pub fn wide(&self) -> bool {
        self.median > 0.0 && (self.max - self.min) / self.median > 0.25
    }
}

/// The figures of one round that are summarised, by key.
fn figures(r: &Round) -> Vec<(&'static str, Option<f64>)> {
    vec![
        ("demux_ns_per_datagram", Some(r.demux_ns_per_datagram)),
        (
            "demux_process_ns_per_datagram",
            Some(r.demux_process_ns_per_datagram),
        ),
        ("consumer_ns_per_datagram", r.consumer_ns_per_datagram),
        ("box_ns_per_delivered", r.box_ns_per_delivered),
        (
            "demux_plus_consumer_ns_per_datagram",
            r.consumer_ns_per_datagram
                .map(|c| c + r.demux_ns_per_datagram),
        ),
        ("delivered_per_s", Some(r.delivered_per_s)),
        ("offered_per_s", r.offered_per_s),
        ("doorbells_per_datagram", Some(r.doorbells_per_datagram)),
        ("recv_calls_per_datagram", Some(r.recv_calls_per_datagram)),
        ("datagrams_per_recv_call", Some(r.datagrams_per_recv_call)),
        ("sender_ns_per_datagram", Some(r.sender_ns_per_datagram)),
        (
            "allocations_per_million_datagrams",
            r.allocations_per_million_datagrams,
        ),
        ("drops", Some(r.drops_excluding_discard() as f64)),
        ("latency_p50_us", r.latency_p50_us),
        ("latency_p99_us", r.latency_p99_us),
        ("latency_p999_us", r.latency_p999_us),
    ]
}

/// `summary[mode][figure]`.
pub fn summarise(rounds: &[Round], modes: &[String]) -> BTreeMap<String, BTreeMap<String, Stat>> {
    let mut out = BTreeMap::new();
    for mode in modes {
        let rs: Vec<&Round> = rounds.iter().filter(|r| &r.mode == mode).collect();
        let mut per: BTreeMap<String, Stat> = BTreeMap::new();
        if let Some(first) = rs.first() {
            for (i, (key, _)) in figures(first).iter().enumerate() {
                let vals: Vec<f64> = rs.iter().filter_map(|r| figures(r)[i].1).collect();
                if let Some(s) = Stat::of(&vals) {
                    per.insert(key.to_string(), s);
                }
            }
        }
        out.insert(mode.clone(), per);
    }
    out
}

/// `reference_summary[mode]` for the figures of the reference's `variant`.
pub fn summarise_reference(
    refs: &[RefRound],
    variant: Variant,
) -> BTreeMap<String, BTreeMap<String, Stat>> {
    let mut out: BTreeMap<String, BTreeMap<String, Stat>> = BTreeMap::new();
    let refs: Vec<&RefRound> = refs.iter().filter(|r| r.variant == variant).collect();
    let modes: Vec<String> = refs.iter().map(|r| r.mode.clone()).collect();
    for mode in modes {
        let rs: Vec<&RefRound> = refs.iter().copied().filter(|r| r.mode == mode).collect();
        let mut per = BTreeMap::new();
        let d: Vec<f64> = rs.iter().map(|r| r.demux_ns_per_datagram).collect();
        let c: Vec<f64> = rs
            .iter()
            .filter_map(|r| r.consumer_ns_per_datagram)
            .collect();
        let b: Vec<f64> = rs.iter().filter_map(|r| r.doorbells_per_datagram).collect();
        let x: Vec<f64> = rs.iter().map(|r| r.rx_per_s).collect();
        for (k, v) in [
            ("demux_ns_per_datagram", d),
            ("consumer_ns_per_datagram", c),
            ("doorbells_per_datagram", b),
            ("rx_per_s", x),
        ] {
            if let Some(s) = Stat::of(&v) {
                per.insert(k.to_string(), s);
            }
        }
        out.insert(mode, per);
    }
    out
}

/// Within-round ratios, summarised. Against the C reference: as shipped
/// (`shm_over_reference_ring_demux`, ...) and, where it ran (`--reference-ecn`), against the
/// variant that reads every datagram's ECN bits as ringmux does (`shm_over_reference_ecn_ring_demux`,
/// ...), and what reading them costs bench.c (`reference_ecn_over_shipped_ring_demux`, ...).
pub fn ratios(rounds: &[Round], refs: &[RefRound]) -> BTreeMap<String, Stat> {
    let mut per: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    let round_ids: Vec<u32> = {
        let mut v: Vec<u32> = rounds.iter().map(|r| r.round).collect();
        v.dedup();
        v
    };
    for id in round_ids {
        let get = |m: &str| rounds.iter().find(|r| r.round == id && r.mode == m);
        let rget_variant = |m: &str, v: Variant| {
            refs.iter()
                .find(|r| r.round == id && r.mode == m && r.variant == v)
        };
        let rget = |m: &str| rget_variant(m, Variant::Shipped);
        let mut push = |k: &str, v: Option<f64>| {
            if let Some(v) = v.filter(|v| v.is_finite() && *v > 0.0) {
                per.entry(k.to_string()).or_default().push(v);
            }
        };
        let d = |r: Option<&Round>| r.map(|r| r.demux_ns_per_datagram);
        let dc = |r: Option<&Round>| {
            r.and_then(|r| {
                r.consumer_ns_per_datagram
                    .map(|c| c + r.demux_ns_per_datagram)
            })
        };
        let (shm, unix, drop) = (get("shm"), get("unix"), get("drop"));
        push("unix_over_shm_demux", div(d(unix), d(shm)));
        push("shm_over_drop_demux", div(d(shm), d(drop)));
        push("unix_over_shm_demux_plus_consumer", div(dc(unix), dc(shm)));
        let rd = |m: &str| rget(m).map(|r| r.demux_ns_per_datagram);
        push("shm_over_reference_ring_demux", div(d(shm), rd("shm")));
        push("unix_over_reference_seq_demux", div(d(unix), rd("unix")));
        push("drop_over_reference_none_demux", div(d(drop), rd("drop")));
        push("reference_seq_over_ring_demux", div(rd("unix"), rd("shm")));
        push("reference_ring_over_none_demux", div(rd("shm"), rd("drop")));
        let re = |m: &str| rget_variant(m, Variant::Ecn).map(|r| r.demux_ns_per_datagram);
        for (mode, fwd) in [("shm", "ring"), ("unix", "seq"), ("drop", "none")] {
            push(
                &format!("{mode}_over_reference_ecn_{fwd}_demux"),
                div(d(get(mode)), re(mode)),
            );
            push(
                &format!("reference_ecn_over_shipped_{fwd}_demux"),
                div(re(mode), rd(mode)),
            );
        }
        // Kernel steering against the rings: what each costs the whole box per datagram
        // delivered (live regime).
        let bx = |r: Option<&Round>| r.and_then(|r| r.box_ns_per_delivered);
        let reuseport = get("reuseport");
        push("shm_over_reuseport_box", div(bx(shm), bx(reuseport)));
        push("unix_over_reuseport_box", div(bx(unix), bx(reuseport)));
        // A load sweep labels each run `MODE@RATE`: the same ratios per offered rate.
        let mut steps: Vec<&str> = rounds
            .iter()
            .filter_map(|r| r.mode.split_once('@').map(|(_, s)| s))
            .collect();
        steps.sort();
        steps.dedup();
        for s in steps {
            let at = |m: &str| get(&format!("{m}@{s}"));
            let rat = |m: &str| rget(&format!("{m}@{s}")).map(|r| r.demux_ns_per_datagram);
            push(
                &format!("shm_over_reference_ring_demux@{s}"),
                div(d(at("shm")), rat("shm")),
            );
            push(
                &format!("shm_over_reuseport_box@{s}"),
                div(bx(at("shm")), bx(at("reuseport"))),
            );
            push(
                &format!("unix_over_shm_demux@{s}"),
                div(d(at("unix")), d(at("shm"))),
            );
        }
    }
    per.into_iter()
        .filter_map(|(k, v)| Some((k, Stat::of(&v)?)))
        .collect()
}

fn div(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => Some(a / b),
        _ => None,
    }
}

/// One target of the issue and whether the median meets it.
#[derive(Clone, Debug, Serialize)]
pub struct Check {
    pub target: String,
    pub value: Option<f64>,
    pub met: Option<bool>,
}

/// The targets that apply to this regime and sender shape.
pub fn checks(
    regime: Regime,
    shape: SendShape,
    ratios: &BTreeMap<String, Stat>,
    summary: &BTreeMap<String, BTreeMap<String, Stat>>,
) -> Vec<Check> {
    let r = |k: &str| ratios.get(k).map(|s| s.median);
    let mut out = Vec::new();
    let mut add = |target: &str, value: Option<f64>, ok: fn(f64) -> bool| {
        out.push(Check {
            target: target.to_string(),
            value,
            met: value.map(ok),
        });
    };
    if regime == Regime::Saturated {
        match shape {
            SendShape::Gso => {
                add(
                    "unix/shm demux >= 3.5 (GRO on)",
                    r("unix_over_shm_demux"),
                    |v| v >= 3.5,
                );
                add(
                    "shm/drop demux <= 2.6 (GRO on)",
                    r("shm_over_drop_demux"),
                    |v| v <= 2.6,
                );
                add(
                    "unix/shm demux+consumer >= 5 (GRO on)",
                    r("unix_over_shm_demux_plus_consumer"),
                    |v| v >= 5.0,
                );
            }
            SendShape::Mmsg => {
                add(
                    "unix/shm demux >= 2.0 (GRO off)",
                    r("unix_over_shm_demux"),
                    |v| v >= 2.0,
                );
                add(
                    "shm/drop demux <= 1.6 (GRO off)",
                    r("shm_over_drop_demux"),
                    |v| v <= 1.6,
                );
            }
        }
        let doorbells = summary
            .get("shm")
            .and_then(|m| m.get("doorbells_per_datagram"))
            .map(|s| s.median);
        add("shm doorbells/datagram <= 0.02", doorbells, |v| v <= 0.02);
    }
    if ratios.contains_key("shm_over_reference_ring_demux") {
        add(
            "shm demux within 1.15x of the C reference ring",
            r("shm_over_reference_ring_demux"),
            |v| v <= 1.15,
        );
        if regime == Regime::Saturated {
            add(
                "shm demux <= 1.05x the C reference ring as shipped (saturated)",
                r("shm_over_reference_ring_demux"),
                |v| v <= 1.05,
            );
        }
    }
    if regime == Regime::Saturated && ratios.contains_key("shm_over_reference_ecn_ring_demux") {
        add(
            "shm demux <= 1.05x the C reference ring reading ECN as ringmux does (saturated)",
            r("shm_over_reference_ecn_ring_demux"),
            |v| v <= 1.05,
        );
    }
    out
}

/// `235 (230–241)`, with `wide` when the spread is over 25 %.
fn fmt_stat(s: Option<&Stat>, f: fn(f64) -> String) -> String {
    match s {
        None => "—".into(),
        Some(s) => format!(
            "{} ({}–{}){}",
            f(s.median),
            f(s.min),
            f(s.max),
            if s.wide() { " wide" } else { "" }
        ),
    }
}

fn ns(v: f64) -> String {
    format!("{v:.0}")
}

fn rate(v: f64) -> String {
    if v >= 1e6 {
        format!("{:.2} M", v / 1e6)
    } else {
        format!("{:.0} k", v / 1e3)
    }
}

fn frac(v: f64) -> String {
    format!("{v:.4}")
}

fn us(v: f64) -> String {
    format!("{v:.1}")
}

fn ratio(v: f64) -> String {
    format!("{v:.2}")
}

/// The Markdown table, the ratios and the target checks.
pub fn markdown(
    modes: &[String],
    summary: &BTreeMap<String, BTreeMap<String, Stat>>,
    reference: &BTreeMap<String, BTreeMap<String, Stat>>,
    reference_ecn: &BTreeMap<String, BTreeMap<String, Stat>>,
    ratios: &BTreeMap<String, Stat>,
    checks: &[Check],
) -> String {
    let mut o = String::new();
    let _ = writeln!(
        o,
        "| mode | demux ns/datagram (median, min–max) | consumer ns/datagram | box ns/delivered | delivered/s | drops | doorbells/datagram | p99 µs |"
    );
    let _ = writeln!(o, "|---|---|---|---|---|---|---|---|");
    for mode in modes {
        let Some(m) = summary.get(mode) else { continue };
        let _ = writeln!(
            o,
            "| {mode} | {} | {} | {} | {} | {} | {} | {} |",
            fmt_stat(m.get("demux_ns_per_datagram"), ns),
            fmt_stat(m.get("consumer_ns_per_datagram"), ns),
            fmt_stat(m.get("box_ns_per_delivered"), ns),
            fmt_stat(m.get("delivered_per_s"), rate),
            fmt_stat(m.get("drops"), ns),
            fmt_stat(m.get("doorbells_per_datagram"), frac),
            fmt_stat(m.get("latency_p99_us"), us),
        );
    }
    for (variant, table) in [(Variant::Shipped, reference), (Variant::Ecn, reference_ecn)] {
        for mode in modes {
            let Some(m) = table.get(mode) else {
                continue;
            };
            reference_row(&mut o, mode, variant, m);
        }
    }
    if !ratios.is_empty() {
        let _ = writeln!(o, "\nWithin-round ratios (median, min–max):\n");
        for (k, s) in ratios {
            let _ = writeln!(o, "- {k}: {}", fmt_stat(Some(s), ratio));
        }
    }
    if !checks.is_empty() {
        let _ = writeln!(o, "\nTargets (medians):\n");
        for c in checks {
            let mark = match c.met {
                Some(true) => "met",
                Some(false) => "NOT met",
                None => "not measured",
            };
            let v = c.value.map_or("—".into(), ratio);
            let _ = writeln!(o, "- {}: {v} — {mark}", c.target);
        }
    }
    o
}

/// One C reference row of the Markdown table.
fn reference_row(o: &mut String, mode: &str, variant: Variant, m: &BTreeMap<String, Stat>) {
    let base = mode.split('@').next().unwrap_or(mode);
    let name = super::reference::fwd_for(base).unwrap_or("?");
    let _ = writeln!(
        o,
        "| C reference `{name}`{} | {} | {} | — | {} (rx/s) | — | {} | — |",
        variant.label(),
        fmt_stat(m.get("demux_ns_per_datagram"), ns),
        fmt_stat(m.get("consumer_ns_per_datagram"), ns),
        fmt_stat(m.get("rx_per_s"), rate),
        fmt_stat(m.get("doorbells_per_datagram"), frac),
    );
}

/// Per-round demux cost (left) and demux + consumer cost (right), one line per mode, the C
/// reference beside it.
pub fn svg(path: &Path, title: &str, rounds: &[Round], refs: &[RefRound]) -> Result<()> {
    use plotters::prelude::*;
    let root = SVGBackend::new(path, (1200, 480)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| anyhow!("{e:?}"))?;
    let root = root
        .titled(title, ("sans-serif", 18))
        .map_err(|e| anyhow!("{e:?}"))?;
    let (left, right) = root.split_horizontally(600);
    let color = |mode: &str, reference: bool| -> RGBColor {
        match (mode, reference) {
            ("shm", false) => RGBColor(31, 119, 180),
            ("shm", true) => RGBColor(140, 190, 230),
            ("unix", false) => RGBColor(214, 39, 40),
            ("unix", true) => RGBColor(240, 150, 150),
            (_, false) => RGBColor(60, 60, 60),
            (_, true) => RGBColor(170, 170, 170),
        }
    };
    let mut modes: Vec<String> = rounds.iter().map(|r| r.mode.clone()).collect();
    modes.dedup();
    modes.sort();
    modes.dedup();
    let panel = |area: &DrawingArea<SVGBackend, plotters::coord::Shift>,
                 caption: &str,
                 series: Vec<Line>|
     -> Result<()> {
        let xmax = rounds.iter().map(|r| r.round).max().unwrap_or(1).max(2) as f64;
        let ymax = series
            .iter()
            .flat_map(|s| s.2.iter().map(|p| p.1))
            .fold(1.0, f64::max)
            * 1.15;
        let mut chart = ChartBuilder::on(area)
            .caption(caption, ("sans-serif", 15))
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(56)
            .build_cartesian_2d(0.5..xmax + 0.5, 0.0..ymax)
            .map_err(|e| anyhow!("{e:?}"))?;
        chart
            .configure_mesh()
            .x_desc("round")
            .y_desc("ns per datagram")
            .x_labels(xmax as usize + 1)
            .x_label_formatter(&|x| format!("{x:.0}"))
            .y_label_formatter(&|y| format!("{y:.0}"))
            .draw()
            .map_err(|e| anyhow!("{e:?}"))?;
        draw_lines(&mut chart, &series)
    };
    let mut demux: Vec<Line> = Vec::new();
    let mut total: Vec<Line> = Vec::new();
    for m in &modes {
        let rs: Vec<&Round> = rounds.iter().filter(|r| &r.mode == m).collect();
        demux.push((
            format!("ringmux {m}"),
            color(m, false),
            rs.iter()
                .map(|r| (r.round as f64, r.demux_ns_per_datagram))
                .collect(),
        ));
        total.push((
            format!("ringmux {m}"),
            color(m, false),
            rs.iter()
                .filter_map(|r| {
                    Some((
                        r.round as f64,
                        r.demux_ns_per_datagram + r.consumer_ns_per_datagram?,
                    ))
                })
                .collect(),
        ));
        let fwd = super::reference::fwd_for(m).unwrap_or("?");
        for variant in [Variant::Shipped, Variant::Ecn] {
            let rr: Vec<&RefRound> = refs
                .iter()
                .filter(|r| &r.mode == m && r.variant == variant)
                .collect();
            if rr.is_empty() {
                continue;
            }
            // The variant reading ECN: the shipped one's colour, darker.
            let c = match (variant, color(m, true)) {
                (Variant::Shipped, c) => c,
                (Variant::Ecn, c) => RGBColor(c.0 / 4 * 3, c.1 / 4 * 3, c.2 / 4 * 3),
            };
            let label = format!("C reference {fwd}{}", variant.label());
            demux.push((
                label.clone(),
                c,
                rr.iter()
                    .map(|r| (r.round as f64, r.demux_ns_per_datagram))
                    .collect(),
            ));
            total.push((
                label,
                c,
                rr.iter()
                    .filter_map(|r| {
                        Some((
                            r.round as f64,
                            r.demux_ns_per_datagram + r.consumer_ns_per_datagram?,
                        ))
                    })
                    .collect(),
            ));
        }
    }
    panel(&left, "demux CPU per datagram", demux)?;
    panel(&right, "demux + consumer CPU per datagram", total)?;
    root.present().map_err(|e| anyhow!("{e:?}"))?;
    Ok(())
}

/// A load sweep's figures by offered rate: for each rate (a row per mode, and the C
/// reference's counterpart where it ran) the medians over the rounds of the demux's cost, the
/// whole box's cost per delivered datagram, wake-ups per datagram (the demux's receives, each
/// after a wake-up at light load, and the workers' doorbells), ring latency, and what was
/// delivered.
pub fn sweep_markdown(
    modes: &[String],
    steps: &[(String, Option<u64>)],
    summary: &BTreeMap<String, BTreeMap<String, Stat>>,
    reference: &BTreeMap<String, BTreeMap<String, Stat>>,
) -> String {
    let med =
        |m: Option<&BTreeMap<String, Stat>>, k: &str| m.and_then(|m| m.get(k)).map(|s| s.median);
    let show = |v: Option<f64>, f: fn(f64) -> String| v.map_or("—".to_string(), f);
    let mut o = String::new();
    let _ = writeln!(o, "\nLoad sweep (medians over the rounds):\n");
    let _ = writeln!(
        o,
        "| offered/s | mode | demux ns/datagram | C ref. demux ns | box ns/delivered | demux wake-ups/datagram | doorbells/datagram | p50 µs | p99 µs | delivered/s |"
    );
    let _ = writeln!(o, "|---|---|---|---|---|---|---|---|---|---|");
    for (step, _) in steps {
        for mode in modes {
            let label = format!("{mode}@{step}");
            let m = summary.get(&label);
            if m.is_none() {
                continue;
            }
            let _ = writeln!(
                o,
                "| {step} | {mode} | {} | {} | {} | {} | {} | {} | {} | {} |",
                show(med(m, "demux_ns_per_datagram"), ns),
                show(med(reference.get(&label), "demux_ns_per_datagram"), ns),
                show(med(m, "box_ns_per_delivered"), ns),
                show(med(m, "recv_calls_per_datagram"), frac),
                show(med(m, "doorbells_per_datagram"), frac),
                show(med(m, "latency_p50_us"), us),
                show(med(m, "latency_p99_us"), us),
                show(med(m, "delivered_per_s"), rate),
            );
        }
    }
    o
}

/// The load sweep as a chart of four panels against the offered rate (log scale), a line per
/// mode: the demux's cost (the C reference's beside it) and the whole box's cost per delivered
/// datagram; wake-ups per datagram (the demux's receives and the workers' doorbells); ring
/// latency p50 and p99.
pub fn sweep_svg(
    path: &Path,
    title: &str,
    modes: &[String],
    steps: &[(String, Option<u64>)],
    summary: &BTreeMap<String, BTreeMap<String, Stat>>,
    reference: &BTreeMap<String, BTreeMap<String, Stat>>,
) -> Result<()> {
    use plotters::prelude::*;
    let root = SVGBackend::new(path, (1200, 900)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| anyhow!("{e:?}"))?;
    let root = root
        .titled(title, ("sans-serif", 18))
        .map_err(|e| anyhow!("{e:?}"))?;
    let areas = root.split_evenly((2, 2));
    let palette = [
        RGBColor(31, 119, 180),
        RGBColor(214, 39, 40),
        RGBColor(44, 160, 44),
        RGBColor(60, 60, 60),
    ];
    let points = |table: &BTreeMap<String, BTreeMap<String, Stat>>, mode: &str, key: &str| {
        steps
            .iter()
            .filter_map(|(step, _)| {
                let label = format!("{mode}@{step}");
                let offered = summary
                    .get(&label)
                    .and_then(|m| m.get("offered_per_s"))?
                    .median;
                let v = table.get(&label).and_then(|m| m.get(key))?.median;
                Some((offered, v))
            })
            .collect::<Vec<_>>()
    };
    let mut demux: Vec<Line> = Vec::new();
    let mut whole: Vec<Line> = Vec::new();
    let mut wakes: Vec<Line> = Vec::new();
    let mut latency: Vec<Line> = Vec::new();
    for (i, mode) in modes.iter().enumerate() {
        let c = palette[i % palette.len()];
        demux.push((
            format!("ringmux {mode}"),
            c,
            points(summary, mode, "demux_ns_per_datagram"),
        ));
        let r = points(reference, mode, "demux_ns_per_datagram");
        if !r.is_empty() {
            let name = super::reference::fwd_for(mode).unwrap_or("?");
            // The same hue, lighter.
            let light = |v: u8| v + (255 - v) / 2;
            demux.push((
                format!("C reference {name}"),
                RGBColor(light(c.0), light(c.1), light(c.2)),
                r,
            ));
        }
        whole.push((
            format!("ringmux {mode}"),
            c,
            points(summary, mode, "box_ns_per_delivered"),
        ));
        // Each of the lower panels draws two figures per mode: the first in the mode's colour,
        // the second darker.
        let dark = RGBColor(c.0 / 2, c.1 / 2, c.2 / 2);
        for (lines, figures) in [
            (
                &mut wakes,
                [
                    ("demux receives", "recv_calls_per_datagram"),
                    ("doorbells", "doorbells_per_datagram"),
                ],
            ),
            (
                &mut latency,
                [("p50", "latency_p50_us"), ("p99", "latency_p99_us")],
            ),
        ] {
            for ((name, key), colour) in figures.into_iter().zip([c, dark]) {
                lines.push((format!("{mode} {name}"), colour, points(summary, mode, key)));
            }
        }
    }
    // Modes without a figure (unix rings no doorbells, reuseport stamps no latency) draw no
    // line.
    let has_figure = |l: &Line| l.2.iter().any(|p| p.1 > 0.0);
    wakes.retain(has_figure);
    latency.retain(has_figure);
    let panel = |area: &DrawingArea<SVGBackend, plotters::coord::Shift>,
                 caption: &str,
                 y_desc: &str,
                 y_fmt: fn(f64) -> String,
                 lines: &[Line]|
     -> Result<()> {
        let pts = lines.iter().flat_map(|l| l.2.iter());
        let xmin = pts.clone().map(|p| p.0).fold(f64::MAX, f64::min).max(1.0);
        let xmax = pts.clone().map(|p| p.0).fold(1.0, f64::max).max(xmin * 2.0);
        let ymax = pts.map(|p| p.1).fold(f64::MIN_POSITIVE, f64::max) * 1.15;
        let mut chart = ChartBuilder::on(area)
            .caption(caption, ("sans-serif", 15))
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(56)
            .build_cartesian_2d((xmin / 1.3..xmax * 1.3).log_scale(), 0.0..ymax)
            .map_err(|e| anyhow!("{e:?}"))?;
        chart
            .configure_mesh()
            .x_desc("offered datagrams/s")
            .y_desc(y_desc)
            .x_label_formatter(&|x| rate(*x))
            .y_label_formatter(&|y| y_fmt(*y))
            .draw()
            .map_err(|e| anyhow!("{e:?}"))?;
        draw_lines(&mut chart, lines)
    };
    let whole_ns = |y: f64| format!("{y:.0}");
    let small = |y: f64| format!("{y:.3}");
    let (ns_y, per_y, us_y) = ("ns per datagram", "per datagram", "µs");
    panel(
        &areas[0],
        "demux data-plane CPU per datagram",
        ns_y,
        whole_ns,
        &demux,
    )?;
    panel(
        &areas[1],
        "whole box CPU per delivered datagram",
        ns_y,
        whole_ns,
        &whole,
    )?;
    panel(&areas[2], "wake-ups per datagram", per_y, small, &wakes)?;
    panel(
        &areas[3],
        "ring latency (demux receive to worker dequeue)",
        us_y,
        whole_ns,
        &latency,
    )?;
    root.present().map_err(|e| anyhow!("{e:?}"))?;
    Ok(())
}

/// One line of a chart: its label, its colour and its points (x, ns per datagram).
type Line = (String, plotters::style::RGBColor, Vec<(f64, f64)>);

/// Draws `lines` (label, colour, points) on `chart`, each a line with its points marked, and
/// their legend: what both charts, per round and per offered rate, draw on their own axes.
fn draw_lines<'a, DB, X, Y>(
    chart: &mut plotters::chart::ChartContext<
        'a,
        DB,
        plotters::coord::cartesian::Cartesian2d<X, Y>,
    >,
    lines: &[Line],
) -> Result<()>
where
    DB: plotters::prelude::DrawingBackend + 'a,
    X: plotters::coord::ranged1d::Ranged<ValueType = f64>,
    Y: plotters::coord::ranged1d::Ranged<ValueType = f64>,
{
    use plotters::prelude::*;
    for (label, c, pts) in lines {
        if pts.is_empty() {
            continue;
        }
        let c = *c;
        chart
            .draw_series(LineSeries::new(pts.clone(), c.stroke_width(2)))
            .map_err(|e| anyhow!("{e:?}"))?
            .label(label.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], c.stroke_width(2)));
        chart
            .draw_series(pts.iter().map(|p| Circle::new(*p, 3, c.filled())))
            .map_err(|e| anyhow!("{e:?}"))?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperRight)
        .draw()
        .map_err(|e| anyhow!("{e:?}"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_median_min_max() {
        let s = Stat::of(&[3.0, 1.0, 2.0, 10.0]).unwrap();
        assert_eq!(
            s,
            Stat {
                median: 2.5,
                min: 1.0,
                max: 10.0
            }
        );
        assert!(s.wide());
        assert_eq!(Stat::of(&[]), None);
        assert_eq!(Stat::of(&[5.0]).unwrap().median, 5.0);
    }
}
