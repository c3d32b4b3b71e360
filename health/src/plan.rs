//! What to probe for a site table, sans I/O: each distinct backend and path once
//! ([`Target`]), with the health-table slots its verdict goes to and the routes that name it.

use std::collections::HashMap;

use ringmux_proto::health::HealthSlots;
use ringmux_proto::route::{ActiveHealth, UpstreamTls};
use ringmux_proto::sites::SiteTable;
use ringmux_proto::UpstreamUrl;

/// Which backend is probed and how it is asked: what a verdict belongs to, and what carries
/// it from one site table to the next.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct TargetKey {
    pub url: UpstreamUrl,
    /// How a TLS backend is verified (part of what it is: the same URL verified otherwise is
    /// another check).
    pub tls: UpstreamTls,
    pub path: String,
}

/// One distinct backend and path to probe, and where its verdict goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Target {
    pub key: TargetKey,
    /// The check of the first route (in table order) that names it: its interval, timeout,
    /// passes and fails.
    pub check: ActiveHealth,
    /// The slots of the table that hold its verdict, ascending.
    pub slots: Vec<u32>,
}

/// A slot as the metrics name it: the site's label, the route's path, the backend's label.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SlotRow {
    pub site: String,
    pub route: String,
    pub backend: String,
    /// Index into [`Plan::targets`].
    pub target: usize,
}

/// What a site table asks to probe.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    pub targets: Vec<Target>,
    /// Every slot, in slot order.
    pub rows: Vec<SlotRow>,
}

impl Plan {
    /// The targets of `table`: one per distinct (backend, TLS settings, path) over every route
    /// with `health`, in the order of their first slot.
    pub fn of(table: &SiteTable) -> Plan {
        let mut plan = Plan::default();
        let mut index: HashMap<TargetKey, usize> = HashMap::new();
        for s in HealthSlots::of(table) {
            let key = TargetKey {
                url: s.url.clone(),
                tls: s.tls.clone(),
                path: s.check.path().to_owned(),
            };
            let target = *index.entry(key.clone()).or_insert_with(|| {
                plan.targets.push(Target {
                    key,
                    check: s.check.clone(),
                    slots: Vec::new(),
                });
                plan.targets.len() - 1
            });
            plan.targets[target].slots.push(s.slot);
            plan.rows.push(SlotRow {
                site: table.sites[s.site].label.clone(),
                route: table.sites[s.site].routes[s.route].path.clone(),
                backend: label_of(s.url.authority.as_str()),
                target,
            });
        }
        plan
    }

    /// How many slots its table needs.
    pub fn slots(&self) -> u32 {
        u32::try_from(self.rows.len()).unwrap_or(u32::MAX)
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }
}

/// `authority` as a label value, as the workers' `backend` label writes it.
pub fn label_of(authority: &str) -> String {
    ringmux_proto::series::label_value(authority)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(routes: &[(&str, &str, Option<&str>)]) -> SiteTable {
        let routes: Vec<String> = routes
            .iter()
            .map(|(path, urls, check)| {
                let health = match check {
                    Some(p) => format!(r#","health":{{"path":"{p}","interval":2,"timeout":1}}"#),
                    None => String::new(),
                };
                format!(
                    r#"{{"path":"{path}","action":{{"upstream":{{"url":{urls},"strip_prefix":false{health}}}}}}}"#
                )
            })
            .collect();
        let json = format!(
            r#"{{"sites":[{{"label":"a.test","names":["a.test"],"cert_pem":"","key_pem":"","routes":[{}]}}],"default_site":null}}"#,
            routes.join(",")
        );
        serde_json::from_str(&json).unwrap()
    }

    #[test]
    fn a_backend_and_path_in_two_routes_is_probed_once() {
        let two = r#"["http://127.0.0.1:1","http://127.0.0.1:2"]"#;
        let t = table(&[
            ("/a", two, Some("/healthz")),
            ("/b", r#""http://127.0.0.1:2""#, Some("/healthz")),
            ("/c", r#""http://127.0.0.1:2""#, Some("/other")),
            ("/d", two, None),
        ]);
        let plan = Plan::of(&t);
        let got: Vec<_> = plan
            .targets
            .iter()
            .map(|t| (t.key.url.to_string(), t.key.path.as_str(), t.slots.clone()))
            .collect();
        assert_eq!(
            got,
            [
                ("http://127.0.0.1:1".to_string(), "/healthz", vec![0]),
                ("http://127.0.0.1:2".to_string(), "/healthz", vec![1, 2]),
                ("http://127.0.0.1:2".to_string(), "/other", vec![3]),
            ]
        );
        assert_eq!(plan.slots(), 4);
        let rows: Vec<_> = plan
            .rows
            .iter()
            .map(|r| (r.route.as_str(), r.backend.as_str(), r.target))
            .collect();
        assert_eq!(
            rows,
            [
                ("/a", "127_0_0_1_1", 0),
                ("/a", "127_0_0_1_2", 1),
                ("/b", "127_0_0_1_2", 1),
                ("/c", "127_0_0_1_2", 2),
            ]
        );
        assert!(Plan::of(&table(&[("/d", two, None)])).is_empty());
    }
}
