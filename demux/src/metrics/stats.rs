//! `ringmux stats`: a running ringmux's metrics as a table.

use std::fmt::Write as _;

use super::{names, DropReason, Scrape};

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
        let get = |name| m.labelled(name, "instance", i);
        let _ = writeln!(
            out,
            "{:>8} {:>4} {:>14.0} {:>10.0} {:>9.0} {:>8.0} {:>11.0} {:>12.0}",
            i,
            if get(names::WORKER_UP) > 0.0 {
                "yes"
            } else {
                "no"
            },
            get(names::FORWARDED),
            get(names::DOORBELLS),
            get(names::RING_OCCUPANCY),
            get(names::WORKER_RESTARTS),
            get(names::WORKER_CONNECTIONS),
            get(names::WORKER_REQUESTS),
        );
    }
    let _ = writeln!(out);
    let _ = writeln!(out, "{:>16} {:>14}", "drop reason", "datagrams");
    for r in DropReason::ALL {
        let _ = writeln!(out, "{:>16} {:>14.0}", r.as_str(), m.dropped(r.as_str()));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::{exposition, Counters};
    use std::sync::atomic::Ordering;

    #[test]
    fn table_shows_totals_instances_and_reasons() {
        let c = Counters::new(2);
        c.received.store(10, Ordering::Relaxed);
        c.instances[1].forwarded.store(7, Ordering::Relaxed);
        let live = crate::dataplane::Liveness::new(2);
        live.set_up(1, true);
        c.dropped[DropReason::Malformed as usize].store(3, Ordering::Relaxed);
        *c.program.write().unwrap() = "/opt/app/bin/server".into();
        let t = table(&Scrape::parse(&exposition::encode(&c, &live)));
        assert!(t.contains("received 10   forwarded 7   dropped 3"), "{t}");
        assert!(t.contains("workers run /opt/app/bin/server"), "{t}");
        let row = |first: &str| {
            t.lines()
                .find(|l| l.split_whitespace().next() == Some(first))
                .unwrap_or_else(|| panic!("no row {first} in\n{t}"))
                .split_whitespace()
                .collect::<Vec<_>>()
        };
        assert_eq!(row("1")[..3], ["1", "yes", "7"]);
        assert_eq!(row("0")[..3], ["0", "no", "0"]);
        assert_eq!(row("malformed"), ["malformed", "3"]);
    }
}
