//! The sites a worker serves: the names of each, its certificate, and what each path prefix of
//! it does. The demux builds the table from its configuration (`[[site]]` in the configuration
//! file, or one default site from the command line), checks it, and hands every worker a copy
//! of its own: a sealed memfd at the hand-off's last descriptor, holding the table as JSON
//! (`control-protocol.md`, "Sites"). The worker library chooses a handshake's certificate from
//! it ([`SiteIndex::for_host`] on the SNI); the built-in server also routes each request by it.
//!
//! Names are lower-case A-labels (an IDN is written in its `xn--` form), each either exact
//! (`a.example`) or a wildcard of one label (`*.example` covers `x.example`, not
//! `x.y.example` nor `example`). Exact names win over wildcards.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

pub use crate::limits::Limits;
pub use crate::route::{Action, Route};
pub use crate::rules::SiteRules;

/// Every site a worker serves, in the configuration's order.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SiteTable {
    pub sites: Vec<Site>,
    /// The site that answers a handshake without SNI or with a name no site has, and a
    /// request for such a name on its connections: an index into `sites`. `None`: those
    /// handshakes fail (`unrecognized_name`).
    pub default_site: Option<usize>,
}

/// One site: its names, its certificate and its routes.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Site {
    /// How the site is called in logs and metrics: its first name, or `default` for the site
    /// the command line makes.
    pub label: String,
    /// Exact names and `*.` wildcards. Empty only for the site the command line makes, which
    /// is the default site and so answers every name.
    pub names: Vec<String>,
    /// PEM certificate chain, leaf first.
    pub cert_pem: String,
    /// PEM private key of the leaf.
    pub key_pem: String,
    /// The certificate comes from ACME: `cert_pem` and `key_pem` are empty until the demux
    /// sends the site's first `CERTIFICATE` (`message::SiteCertificate`), and a handshake
    /// for its names fails until then.
    #[serde(default)]
    pub acme: bool,
    /// The routes, each a path prefix and what it does; the longest matching prefix wins
    /// ([`Site::route`]).
    pub routes: Vec<Route>,
    /// Names among `names` (exact ones) that only redirect: a request for one is answered
    /// with a 301 to the same path and query on the site's first name (and the port the
    /// request named, if any), under the site's certificate ([`Site::redirects`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub redirect_names: Vec<String>,
    /// `compress = false`: no route of the site codes its responses unless it says
    /// `compress = true` itself; `None`: on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compress: Option<bool>,
    /// Header rules, HSTS, CORS and error pages of every route (`crate::rules`).
    #[serde(default, skip_serializing_if = "SiteRules::is_empty")]
    pub rules: SiteRules,
    /// Who may ask and how often, on every route that has none of its own
    /// ([`crate::limits`]).
    #[serde(default, skip_serializing_if = "Limits::is_none")]
    pub limits: Limits,
}

impl std::fmt::Debug for Site {
    // Never print key material.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Site")
            .field("label", &self.label)
            .field("names", &self.names)
            .field("routes", &self.routes)
            .finish_non_exhaustive()
    }
}

impl Site {
    /// Whether a request for `host` (a request's authority: a port, brackets, upper case
    /// and a final dot allowed) is for one of the names that only redirect.
    pub fn redirects(&self, host: &str) -> bool {
        host_is_one_of(host, &self.redirect_names)
    }

    /// The route for request path `path`, and the rest of the path after the route's prefix
    /// (starting with `/`, or empty when the path is the prefix itself).
    pub fn route<'p>(&self, path: &'p str) -> Option<(&Route, &'p str)> {
        longest_prefix(&self.routes, |r| &r.path, path)
    }
}

/// The route of `routes` (each with the prefix `prefix` gives) whose prefix matches `path`
/// and is the longest, and the rest of the path after it: [`Site::route`]'s rule, for any
/// list of routes (a worker's opened ones too).
pub fn longest_prefix<'r, 'p, R>(
    routes: &'r [R],
    prefix: impl Fn(&R) -> &str,
    path: &'p str,
) -> Option<(&'r R, &'p str)> {
    routes
        .iter()
        .filter_map(|r| Some((r, prefix_rest(prefix(r), path)?)))
        .max_by_key(|(r, _)| prefix(r).len())
}

/// What is left of `path` after `prefix` if the prefix matches it (see [`Route::path`]).
pub fn prefix_rest<'p>(prefix: &str, path: &'p str) -> Option<&'p str> {
    let prefix = prefix.strip_suffix('/').unwrap_or(prefix);
    let rest = path.strip_prefix(prefix)?;
    (rest.is_empty() || rest.starts_with('/')).then_some(rest)
}

/// The sites' names made quick to look up: exact names in one hash map, wildcards by the
/// suffix after their `*.` in another. A lookup is two hash probes at most, whatever the
/// number of sites.
#[derive(Clone, Debug, Default)]
pub struct SiteIndex {
    exact: HashMap<String, usize>,
    wildcard: HashMap<String, usize>,
    default_site: Option<usize>,
}

impl SiteIndex {
    /// The index of `table`. A name given twice keeps its first site (the demux refuses such
    /// a table before it is built: [`SiteTable::duplicate_names`]).
    pub fn new(table: &SiteTable) -> SiteIndex {
        let mut index = SiteIndex {
            default_site: table.default_site.filter(|&d| d < table.sites.len()),
            ..SiteIndex::default()
        };
        for (i, site) in table.sites.iter().enumerate() {
            for name in &site.names {
                let name = name.to_ascii_lowercase();
                match name.strip_prefix("*.") {
                    Some(suffix) => index.wildcard.entry(suffix.to_string()).or_insert(i),
                    None => index.exact.entry(name).or_insert(i),
                };
            }
        }
        index
    }

    /// An index of no names, whose default site is `site`: the same site for every host.
    pub fn catch_all(site: usize) -> SiteIndex {
        SiteIndex {
            default_site: Some(site),
            ..SiteIndex::default()
        }
    }

    /// The site named `host` exactly, else by a wildcard, else none.
    pub fn named(&self, host: &str) -> Option<usize> {
        let host = normalise_host(host)?;
        let host = host.as_ref();
        if let Some(&i) = self.exact.get(host) {
            return Some(i);
        }
        let (_, parent) = host.split_once('.')?;
        self.wildcard.get(parent).copied()
    }

    /// The site for `host` ([`SiteIndex::named`]), else the default site; `None` for no
    /// host either.
    pub fn for_host(&self, host: Option<&str>) -> Option<usize> {
        host.and_then(|h| self.named(h)).or(self.default_site)
    }

    /// The default site, if any.
    pub fn default_site(&self) -> Option<usize> {
        self.default_site
    }

    /// Whether any site has a name (exact or wildcard): false only for the command line's
    /// site, which answers every host.
    pub fn has_names(&self) -> bool {
        !self.exact.is_empty() || !self.wildcard.is_empty()
    }
}

/// Whether `host` (a request's authority: a port, brackets, upper case and a final dot
/// allowed) is one of the exact, lower-case `names`.
pub fn host_is_one_of(host: &str, names: &[String]) -> bool {
    !names.is_empty()
        && normalise_host(host).is_some_and(|h| names.iter().any(|n| n.as_str() == h.as_ref()))
}

/// `host` as the index holds names: without a port, brackets or a final dot, lower case.
/// `None` for an empty host.
fn normalise_host(host: &str) -> Option<std::borrow::Cow<'_, str>> {
    let host = if let Some(v6) = host.strip_prefix('[') {
        v6.split(']').next().unwrap_or(v6)
    } else if host.matches(':').count() == 1 {
        host.split(':').next().unwrap_or(host)
    } else {
        host
    };
    let host = host.strip_suffix('.').unwrap_or(host);
    if host.is_empty() {
        return None;
    }
    Some(if host.bytes().any(|b| b.is_ascii_uppercase()) {
        std::borrow::Cow::Owned(host.to_ascii_lowercase())
    } else {
        std::borrow::Cow::Borrowed(host)
    })
}

impl SiteTable {
    /// The JSON a worker receives.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("a site table is always JSON")
    }

    /// The table a worker received, checked: a default site that exists, and every route
    /// whole ([`Route::check`]; each value was checked as it was read).
    pub fn from_json(text: &[u8]) -> Result<SiteTable, SitesError> {
        let table: SiteTable =
            serde_json::from_slice(text).map_err(|e| SitesError(e.to_string()))?;
        if let Some(d) = table.default_site {
            if d >= table.sites.len() {
                return Err(SitesError(format!(
                    "default_site {d} is not one of the {} sites",
                    table.sites.len()
                )));
            }
        }
        for site in &table.sites {
            site.limits
                .check()
                .map_err(|e| SitesError(format!("site {}: {e}", site.label)))?;
            for r in &site.routes {
                r.check().map_err(|e| {
                    SitesError(format!("site {}: route {:?}: {e}", site.label, r.path))
                })?;
            }
            if let Some(n) = site.redirect_names.iter().find(|n| !site.names.contains(n)) {
                return Err(SitesError(format!(
                    "site {}: redirect name {n:?} is not one of its names",
                    site.label
                )));
            }
        }
        Ok(table)
    }

    /// Every name that belongs to more than one site (compared without case), with the
    /// labels of the first two sites that have it.
    pub fn duplicate_names(&self) -> Vec<(String, String, String)> {
        let mut seen: HashMap<String, usize> = HashMap::new();
        let mut dups = Vec::new();
        for (i, site) in self.sites.iter().enumerate() {
            for name in &site.names {
                let name = name.to_ascii_lowercase();
                match seen.get(&name) {
                    Some(&first) if first != i => dups.push((
                        name.clone(),
                        self.sites[first].label.clone(),
                        site.label.clone(),
                    )),
                    Some(_) => {}
                    None => {
                        seen.insert(name, i);
                    }
                }
            }
        }
        dups
    }
}

/// A site table a worker cannot use.
#[derive(Debug, thiserror::Error)]
#[error("the site table: {0}")]
pub struct SitesError(String);

#[cfg(test)]
mod tests {
    use super::*;

    fn site(label: &str, names: &[&str], routes: &[&str]) -> Site {
        Site {
            label: label.into(),
            names: names.iter().map(|n| n.to_string()).collect(),
            cert_pem: String::new(),
            key_pem: String::new(),
            acme: false,
            redirect_names: Vec::new(),
            compress: None,
            rules: SiteRules::default(),
            limits: Limits::default(),
            routes: routes
                .iter()
                .map(|p| Route {
                    compress: None,
                    path: p.to_string(),
                    action: Action::Respond(crate::route::Respond::new(200, p).unwrap()),
                    rules: Default::default(),
                    limits: Limits::default(),
                })
                .collect(),
        }
    }

    fn table(default_site: Option<usize>) -> SiteTable {
        SiteTable {
            sites: vec![
                site("a.test", &["a.test", "www.a.test"], &["/"]),
                site("b.test", &["b.test"], &["/"]),
                site("*.w.test", &["*.w.test"], &["/"]),
                site("x.w.test", &["x.w.test"], &["/"]),
            ],
            default_site,
        }
    }

    #[test]
    fn exact_names_before_wildcards_of_one_label() {
        let idx = SiteIndex::new(&table(None));
        assert_eq!(idx.named("a.test"), Some(0));
        assert_eq!(idx.named("WWW.A.Test"), Some(0));
        assert_eq!(idx.named("a.test:4433"), Some(0));
        assert_eq!(idx.named("a.test."), Some(0));
        assert_eq!(idx.named("y.w.test"), Some(2));
        assert_eq!(
            idx.named("x.w.test"),
            Some(3),
            "exact wins over the wildcard"
        );
        assert_eq!(
            idx.named("w.test"),
            None,
            "a wildcard does not cover its parent"
        );
        assert_eq!(idx.named("a.b.w.test"), None, "one label only");
        assert_eq!(idx.named("c.test"), None);
        assert_eq!(idx.named("[::1]:443"), None);
        assert_eq!(idx.named(""), None);
    }

    #[test]
    fn the_default_site_answers_the_rest() {
        let idx = SiteIndex::new(&table(Some(1)));
        assert_eq!(idx.for_host(Some("c.test")), Some(1));
        assert_eq!(idx.for_host(None), Some(1));
        assert_eq!(idx.for_host(Some("a.test")), Some(0));
        let none = SiteIndex::new(&table(None));
        assert_eq!(none.for_host(Some("c.test")), None);
        assert_eq!(none.for_host(None), None);
    }

    #[test]
    fn the_longest_prefix_wins_at_segment_bounds() {
        let s = site("s", &["s"], &["/", "/api", "/api/v2/", "/static"]);
        let at = |p: &'static str| s.route(p).map(|(r, rest)| (r.path.clone(), rest));
        let want = |p: &str, rest: &'static str| Some((p.to_string(), rest));
        assert_eq!(at("/"), want("/", "/"));
        assert_eq!(at("/index.html"), want("/", "/index.html"));
        assert_eq!(at("/api"), want("/api", ""));
        assert_eq!(at("/api/x"), want("/api", "/x"));
        assert_eq!(at("/apix"), want("/", "/apix"));
        assert_eq!(at("/api/v2/y"), want("/api/v2/", "/y"));
        assert_eq!(at("/api/v2"), want("/api/v2/", ""));
        let no_root = site("s", &["s"], &["/api"]);
        assert!(no_root.route("/other").is_none());
    }

    #[test]
    fn the_table_round_trips_and_is_checked() {
        let t = table(Some(0));
        assert_eq!(SiteTable::from_json(t.to_json().as_bytes()).unwrap(), t);
        let mut bad = table(Some(4));
        let e = SiteTable::from_json(bad.to_json().as_bytes()).unwrap_err();
        assert!(e.to_string().contains("default_site 4"), "{e}");
        bad.default_site = None;
        bad.sites[1].routes[0].path = "api".into();
        let e = SiteTable::from_json(bad.to_json().as_bytes()).unwrap_err();
        assert!(e.to_string().contains("\"api\""), "{e}");
        assert!(SiteTable::from_json(b"{\"sites\":[],\"default_site\":null,\"x\":1}").is_err());
    }

    #[test]
    fn duplicate_names_are_found() {
        let mut t = table(None);
        assert!(t.duplicate_names().is_empty());
        t.sites[1].names.push("WWW.a.test".into());
        assert_eq!(
            t.duplicate_names(),
            vec![("www.a.test".into(), "a.test".into(), "b.test".into())]
        );
    }
}
