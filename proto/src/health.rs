//! The order of the health table's slots ([`HealthSlots`]), which the demux writes and every
//! worker reads (`shm-layout.md`, "Health table"): both sides derive it from the site table
//! with this one function, so a worker maps its route's backend to a slot with no lookup.

use crate::route::{Action, ActiveHealth, UpstreamTls};
use crate::sites::SiteTable;
use crate::UpstreamUrl;

/// One slot of the health table: a backend of a route that checks its backends' health.
#[derive(Clone, Copy, Debug)]
pub struct HealthSlot<'t> {
    /// Its index in the table.
    pub slot: u32,
    /// The site and route (indices in the site table) and the backend (in the route's list).
    pub site: usize,
    pub route: usize,
    pub backend: usize,
    pub url: &'t UpstreamUrl,
    pub tls: &'t UpstreamTls,
    pub check: &'t ActiveHealth,
}

/// The slots of the health table of `table`, in order: for each site in order, each of its
/// routes in order that has `health`, each of its backends in the route's order. A backend
/// named by two such routes has a slot in each (the demux probes it once and writes both).
pub struct HealthSlots;

impl HealthSlots {
    /// Every slot of `table`, in slot order.
    pub fn of(table: &SiteTable) -> impl Iterator<Item = HealthSlot<'_>> {
        let routes = table.sites.iter().enumerate().flat_map(|(s, site)| {
            site.routes
                .iter()
                .enumerate()
                .filter_map(move |(r, route)| match &route.action {
                    Action::Upstream {
                        url,
                        tls,
                        health: Some(check),
                        ..
                    } => Some((s, r, url, tls, check)),
                    _ => None,
                })
        });
        routes
            .flat_map(|(site, route, url, tls, check)| {
                url.urls()
                    .iter()
                    .enumerate()
                    .map(move |(backend, url)| (site, route, backend, url, tls, check))
            })
            .zip(0u32..)
            .map(
                |((site, route, backend, url, tls, check), slot)| HealthSlot {
                    slot,
                    site,
                    route,
                    backend,
                    url,
                    tls,
                    check,
                },
            )
    }

    /// How many slots `table` has.
    pub fn count(table: &SiteTable) -> u32 {
        Self::of(table).fold(0, |n, _| n + 1)
    }

    /// The first slot of each route that has one, by (site, route) index: `firsts[s][r]`.
    pub fn firsts(table: &SiteTable) -> Vec<Vec<Option<u32>>> {
        let mut firsts: Vec<Vec<Option<u32>>> = table
            .sites
            .iter()
            .map(|s| vec![None; s.routes.len()])
            .collect();
        for s in Self::of(table).filter(|s| s.backend == 0) {
            firsts[s.site][s.route] = Some(s.slot);
        }
        firsts
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_follow_sites_routes_and_backends_in_order() {
        let route = |path: &str, urls: &str, health: bool| {
            let health = match health {
                true => r#","health":{"path":"/h","interval":2,"timeout":1}"#,
                false => "",
            };
            format!(
                r#"{{"path":"{path}","action":{{"upstream":{{"url":{urls},"strip_prefix":false{health}}}}}}}"#
            )
        };
        let site = |label: &str, routes: Vec<String>| {
            format!(
                r#"{{"label":"{label}","names":[],"cert_pem":"","key_pem":"","routes":[{}]}}"#,
                routes.join(",")
            )
        };
        let two = r#"["http://127.0.0.1:1","http://127.0.0.1:2"]"#;
        let json = format!(
            r#"{{"sites":[{},{}],"default_site":null}}"#,
            site(
                "a",
                vec![
                    route("/x", two, false),
                    route("/", two, true),
                    r#"{"path":"/r","action":{"respond":{"status":200,"body":""}}}"#.into()
                ]
            ),
            site("b", vec![route("/", r#""http://127.0.0.1:1""#, true)]),
        );
        let table: SiteTable = serde_json::from_str(&json).unwrap();
        let got: Vec<_> = HealthSlots::of(&table)
            .map(|s| (s.slot, s.site, s.route, s.backend, s.url.to_string()))
            .collect();
        assert_eq!(
            got,
            [
                (0, 0, 1, 0, "http://127.0.0.1:1".to_string()),
                (1, 0, 1, 1, "http://127.0.0.1:2".to_string()),
                (2, 1, 0, 0, "http://127.0.0.1:1".to_string()),
            ]
        );
        assert_eq!(HealthSlots::count(&table), 3);
        assert_eq!(
            HealthSlots::firsts(&table),
            [vec![None, Some(0), None], vec![Some(2)]]
        );
    }
}
