//! The `[[site]]` tables of the configuration file, checked and made into the site table every
//! worker receives ([`SiteTable`]): each name well formed and in one site only, each
//! certificate read, matching its key, covering its site's names and valid now, each route as
//! the contract reads it (`ringmux_proto::route`: its path, its action and every value of it)
//! with a root the workers can read. Every problem is collected with its place, so `ringmux
//! check` shows them all.

use std::path::Path;
use std::time::SystemTime;

use ringmux_proto::sites::{Action, Limits, Route, Site, SiteTable};

use super::file::{problem, FileConfig, Located, Place, Problem, Problems, RouteDoc, SiteDoc};
use super::worker_user::WorkerUser;
use crate::certs::{covers, leaf, CertPem};

mod rules;

/// The site table of the file's `[[site]]`s; every problem found, each with its place.
/// `worker_user` is whom the workers run as (a root must be reachable by it).
pub fn build(file: &FileConfig, worker_user: Option<&WorkerUser>) -> Result<SiteTable, Problems> {
    let mut problems = Vec::new();
    let mut sites = Vec::new();
    let mut roots = SystemRoots::default();
    for doc in &file.sites {
        if let Some(site) = site(doc, worker_user, &mut roots, &mut problems) {
            sites.push(site);
        }
    }
    // A name in two sites: which certificate, which content?
    let mut owner: std::collections::HashMap<String, (usize, &Place)> = Default::default();
    for (i, doc) in file.sites.iter().enumerate() {
        for name in &doc.names {
            let key = name.value.to_ascii_lowercase();
            match owner.get(&key) {
                Some((j, first)) if *j != i => problems.push(Problem {
                    at: Some(name.at.clone()),
                    message: format!(
                        "the name {key} belongs to two sites: this one and the site at {first}; \
                         give each name to one site only"
                    ),
                }),
                Some(_) => {}
                None => {
                    owner.insert(key, (i, &name.at));
                }
            }
        }
    }
    let default_site = match &file.default_site {
        None => None,
        Some(d) => {
            let want = d.value.to_ascii_lowercase();
            let found = file
                .sites
                .iter()
                .position(|s| s.names.iter().any(|n| n.value.to_ascii_lowercase() == want));
            if found.is_none() {
                problems.push(Problem {
                    at: Some(d.at.clone()),
                    message: format!(
                        "default_site = {:?} is no site's name: name one of the names of a \
                         [[site]] (e.g. its first)",
                        d.value
                    ),
                });
            }
            found
        }
    };
    if file.sites.is_empty() && file.default_site.is_some() {
        problems.push(Problem {
            at: file.default_site.as_ref().map(|d| d.at.clone()),
            message: "default_site without any [[site]]".into(),
        });
    }
    if !problems.is_empty() {
        return Err(Problems(problems));
    }
    Ok(SiteTable {
        sites,
        default_site,
    })
}

fn site(
    doc: &SiteDoc,
    user: Option<&WorkerUser>,
    roots: &mut SystemRoots,
    problems: &mut Vec<Problem>,
) -> Option<Site> {
    let before = problems.len();
    if doc.names.is_empty() {
        problem(
            problems,
            &doc.at,
            "a [[site]] needs names = [...], e.g. names = [\"example.com\", \"www.example.com\"]"
                .into(),
        );
    }
    let mut names = Vec::new();
    for n in &doc.names {
        match check_name(&n.value) {
            Ok(name) => names.push(name),
            Err(why) => problem(problems, &n.at, format!("name {:?}: {why}", n.value)),
        }
    }
    let label = names.first().cloned().unwrap_or_default();
    // Names that only redirect to the first name: served under the site's certificate, so
    // they join `names` (the certificate must cover them, ACME orders them, SNI and the name
    // checks find them) and are listed apart as well.
    let mut redirect_names = Vec::new();
    for n in &doc.redirect_names {
        let name = match check_name(&n.value) {
            Ok(name) if name.starts_with("*.") => Err(format!(
                "site {label}: redirect_names holds the wildcard {}: a redirect needs names a \
                 client can be sent from one by one; list them",
                n.value
            )),
            Ok(name) if names.contains(&name) || redirect_names.contains(&name) => Err(format!(
                "site {label}: {name} is in names or redirect_names already; give it once"
            )),
            Ok(name) => Ok(name),
            Err(why) => Err(format!("redirect_names {:?}: {why}", n.value)),
        };
        match name {
            Ok(name) => redirect_names.push(name),
            Err(why) => problem(problems, &n.at, why),
        }
    }
    names.extend(redirect_names.iter().cloned());
    let acme = doc.acme.as_ref().is_some_and(|a| a.value);
    let pem = match (&doc.cert, &doc.key) {
        _ if acme => {
            let cert_or_key = doc.cert.as_ref().or(doc.key.as_ref());
            if let Some(at) = cert_or_key.map(|c| &c.at) {
                problem(
                    problems,
                    at,
                    format!(
                        "site {label}: cert and key beside acme = true: the certificate comes \
                         from the [acme] CA; drop cert and key, or drop acme = true"
                    ),
                );
            }
            for n in doc.names.iter().chain(&doc.redirect_names) {
                if n.value.starts_with("*.") {
                    problem(
                        problems,
                        &n.at,
                        format!(
                            "site {label}: the wildcard {} with acme = true: a wildcard \
                             certificate needs the DNS-01 challenge, which ringmux does not \
                             answer; list each name, or give the site cert and key",
                            n.value
                        ),
                    );
                }
            }
            Some(CertPem {
                chain: String::new(),
                key: String::new(),
            })
        }
        (Some(cert), Some(key)) => certificate(cert, key, &names, problems),
        (None, _) => {
            problem(
                problems,
                &doc.at,
                format!(
                    "site {label}: cert = \"FILE\" (its PEM certificate chain) is missing; or \
                     acme = true for a certificate from the [acme] CA"
                ),
            );
            None
        }
        (_, None) => {
            problem(
                problems,
                &doc.at,
                format!(
                    "site {label}: key = \"FILE\" (the PEM private key of its cert) is missing"
                ),
            );
            None
        }
    };
    if doc.routes.is_empty() {
        problem(
            problems,
            &doc.at,
            format!(
                "site {label} has no [[site.route]]: give it at least one, e.g. path = \"/\" \
                 with root = \"/srv/www\""
            ),
        );
    }
    let mut routes: Vec<Route> = Vec::new();
    for r in &doc.routes {
        if let Some(mut route) = route(r, user, roots, problems) {
            inherit_max_body(&mut route, r, doc.max_body.as_ref());
            if let Some(same) = routes.iter().find(|o| o.path == route.path) {
                problem(
                    problems,
                    &r.at,
                    format!(
                        "site {label}: two routes for the path {:?}; give each path one route",
                        same.path
                    ),
                );
            }
            routes.push(route);
        }
    }
    let rules = rules::site_rules(&doc.rules, problems);
    let limits = match &doc.limits {
        Ok(limits) => limits.clone(),
        Err(refused) => {
            problems.push(refused.clone());
            Limits::default()
        }
    };
    if problems.len() > before {
        return None;
    }
    let pem = pem?;
    Some(Site {
        label,
        names,
        cert_pem: pem.chain,
        key_pem: pem.key,
        acme,
        routes,
        redirect_names,
        compress: doc.compress.as_ref().map(|c| c.value),
        rules,
        limits,
    })
}

/// The site's `max_body` on an upstream route of it that sets none itself (its own, 0
/// included, wins).
fn inherit_max_body(
    route: &mut Route,
    r: &RouteDoc,
    site: Option<&Located<ringmux_proto::route::BodyLimit>>,
) {
    let own = r.places.iter().any(|(key, _)| key == "max_body");
    if let (Some(site), false, Action::Upstream { max_body, .. }) = (site, own, &mut route.action) {
        *max_body = site.value;
    }
}

/// A site's name, lower case: an exact DNS name of A-labels, or `*.` and one.
pub fn check_name(name: &str) -> Result<String, NameError> {
    if !name.is_ascii() {
        return Err(NameError::NotAscii);
    }
    let lower = name.to_ascii_lowercase();
    let rest = lower.strip_prefix("*.").unwrap_or(&lower);
    if rest.parse::<std::net::IpAddr>().is_ok() {
        return Err(NameError::Address);
    }
    if rest.len() > 253 || rest.is_empty() {
        return Err(NameError::Length);
    }
    for label in rest.split('.') {
        let ok = !label.is_empty()
            && label.len() <= 63
            && !label.starts_with('-')
            && !label.ends_with('-')
            && label
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
        if !ok {
            return Err(if label.contains('*') {
                NameError::Wildcard
            } else {
                NameError::Label
            });
        }
    }
    if lower.starts_with("*.") && !rest.contains('.') {
        return Err(NameError::TopLevelWildcard);
    }
    Ok(lower)
}

/// Why [`check_name`] refuses a site name.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum NameError {
    #[error("write an international name as its A-labels (xn--…), as DNS holds it")]
    NotAscii,
    #[error(
        "an IP address is no site name (clients send no SNI for one); make the site the \
         default_site to answer requests by address"
    )]
    Address,
    #[error("expected a DNS name of 1 to 253 characters")]
    Length,
    #[error("expected a DNS name: a wildcard is `*.` followed by the name it covers one label of")]
    Wildcard,
    #[error(
        "expected a DNS name: labels of letters, digits and hyphens, 1 to 63 each, separated by \
         dots"
    )]
    Label,
    #[error("a wildcard of a top-level domain covers too much; name the domain")]
    TopLevelWildcard,
}

/// The certificate chain and key of a site, checked: readable, the key matching the leaf, the
/// leaf covering every name and valid now.
fn certificate(
    cert: &Located<std::path::PathBuf>,
    key: &Located<std::path::PathBuf>,
    names: &[String],
    problems: &mut Vec<Problem>,
) -> Option<CertPem> {
    let pem = match crate::certs::load(&cert.value, &key.value) {
        Ok(p) => p,
        Err(e) => {
            problem(problems, &cert.at, e.to_string());
            return None;
        }
    };
    let (chain, private) = match pem.parse() {
        Ok(d) => d,
        Err(e) => {
            problem(problems, &cert.at, e.to_string());
            return None;
        }
    };
    let provider = rustls::crypto::ring::default_provider();
    if let Err(e) = rustls::sign::CertifiedKey::from_der(chain.clone(), private, &provider) {
        problem(
            problems,
            &key.at,
            format!(
                "the key {} does not go with the certificate {}: {e}",
                key.value.display(),
                cert.value.display()
            ),
        );
        return None;
    }
    match leaf(&chain[0]) {
        Err(why) => problem(
            problems,
            &cert.at,
            format!("the certificate {}: {why}", cert.value.display()),
        ),
        Ok(leaf) => {
            let now = SystemTime::now();
            if leaf.not_after < now {
                problem(
                    problems,
                    &cert.at,
                    format!(
                        "the certificate {} expired on {}: renew it",
                        cert.value.display(),
                        leaf.not_after_text
                    ),
                );
            } else if leaf.not_before > now {
                problem(
                    problems,
                    &cert.at,
                    format!(
                        "the certificate {} is not valid before {}",
                        cert.value.display(),
                        leaf.not_before_text
                    ),
                );
            }
            for name in names {
                if !covers(&leaf.names, name) {
                    problem(
                        problems,
                        &cert.at,
                        format!(
                            "the certificate {} does not cover the site's name {name} (it \
                             covers {}): use a certificate for every name of the site",
                            cert.value.display(),
                            leaf.names.join(", ")
                        ),
                    );
                }
            }
        }
    }
    Some(pem)
}

/// A route the contract read ([`RouteDoc::route`]), and what only the disk can tell of it:
/// a root the workers can read; a TLS upstream's certificates to trust, read here.
fn route(
    r: &RouteDoc,
    user: Option<&WorkerUser>,
    roots: &mut SystemRoots,
    problems: &mut Vec<Problem>,
) -> Option<Route> {
    let mut route = match &r.route {
        Ok(route) => route.clone(),
        Err(refused) => {
            problems.push(refused.clone());
            return None;
        }
    };
    match &mut route.action {
        Action::Files { root } => {
            check_root(root, r.place_of("root"), user, problems)?;
            if let Some(fallback) = &route.rules.fallback {
                rules::check_fallback(root, fallback, r.place_of("fallback"), problems);
            }
        }
        Action::Upstream { url, tls, .. } if url.urls().iter().any(|u| u.scheme.tls()) => {
            let read = match &r.upstream_ca {
                Some(ca) => crate::certs::load_upstream_ca(ca).map_err(|e| {
                    let at = r.place_of("upstream_ca");
                    (at, format!("upstream_ca = {}: {e}", ca.display()))
                }),
                None => roots.get().map_err(|e| {
                    let at = r.place_of("upstream");
                    let tls = url.urls().iter().find(|u| u.scheme.tls());
                    let named = tls.map(ToString::to_string).unwrap_or_default();
                    (at, format!("upstream = \"{named}\": {e}"))
                }),
            };
            match read {
                Ok(pem) => tls.roots_pem = pem,
                Err((at, message)) => {
                    problem(problems, at, message);
                    return None;
                }
            }
        }
        Action::Builtin { .. }
        | Action::Upstream { .. }
        | Action::Redirect { .. }
        | Action::Respond(_) => {}
    }
    Some(route)
}

/// The system's roots, read once per build and only if a TLS upstream without `upstream_ca`
/// needs them.
#[derive(Default)]
struct SystemRoots(Option<Result<String, std::sync::Arc<crate::certs::TrustError>>>);

impl SystemRoots {
    fn get(&mut self) -> Result<String, std::sync::Arc<crate::certs::TrustError>> {
        self.0
            .get_or_insert_with(|| crate::certs::system_roots_pem().map_err(std::sync::Arc::new))
            .clone()
    }
}

/// A route's root: a folder the demux can list and the workers' user can enter; `None`
/// (and the problem) if not.
fn check_root(
    dir: &Path,
    at: &Place,
    user: Option<&WorkerUser>,
    problems: &mut Vec<Problem>,
) -> Option<()> {
    let before = problems.len();
    check_root_at(dir, at, user, problems);
    (problems.len() == before).then_some(())
}

fn check_root_at(dir: &Path, at: &Place, user: Option<&WorkerUser>, problems: &mut Vec<Problem>) {
    if !dir.is_absolute() {
        problem(
            problems,
            at,
            format!("root = {}: expected an absolute path", dir.display()),
        );
        return;
    }
    if !dir.is_dir() {
        problem(
            problems,
            at,
            format!("root = {}: not a directory", dir.display()),
        );
        return;
    }
    if let Err(e) = std::fs::read_dir(dir) {
        problem(
            problems,
            at,
            format!("root = {}: the folder cannot be read ({e})", dir.display()),
        );
        return;
    }
    if let Ok(Some(fs)) = crate::sys::pseudo_file_system(dir) {
        problem(
            problems,
            at,
            format!(
                "root = {}: on {fs}, a file system the kernel makes up (its files are the \
                 system's state, not a site's); name a folder of files",
                dir.display()
            ),
        );
        return;
    }
    if let Some(user) = user {
        if let Err(why) = user.can_enter(dir) {
            problem(
                problems,
                at,
                format!(
                    "root = {} cannot be reached by user {} (UID {}), whom the workers run as: \
                     {}. Let that user enter it and every folder above it, and read the files \
                     (e.g. chmod o+rx)",
                    dir.display(),
                    user.name,
                    user.uid,
                    crate::one_line(&why)
                ),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sites_max_body_goes_to_its_upstream_routes_that_set_none() {
        let up = "upstream = [\"http://127.0.0.1:9\"]";
        let text = format!(
            "[[site]]\nnames = [\"a.test\"]\nmax_body = \"1KiB\"\n\
             [[site.route]]\npath = \"/\"\n{up}\n\
             [[site.route]]\npath = \"/own\"\n{up}\nmax_body = 5\n\
             [[site.route]]\npath = \"/none\"\n{up}\nmax_body = 0\n\
             [[site.route]]\npath = \"/ok\"\nrespond = {{ status = 200 }}\n"
        );
        let file = FileConfig::parse(Path::new("f.toml"), &text).unwrap();
        assert!(file.problems.is_empty(), "{:?}", file.problems);
        let site = &file.sites[0];
        let limits: Vec<Option<u64>> = site
            .routes
            .iter()
            .map(|r| {
                let mut route = r.route.clone().unwrap();
                inherit_max_body(&mut route, r, site.max_body.as_ref());
                match route.action {
                    Action::Upstream { max_body, .. } => max_body.get(),
                    _ => Some(u64::MAX),
                }
            })
            .collect();
        assert_eq!(limits, [Some(1024), Some(5), None, Some(u64::MAX)]);

        let bad = "[[site]]\nnames = [\"a.test\"]\nmax_body = \"lots\"\n";
        let file = FileConfig::parse(Path::new("f.toml"), bad).unwrap();
        let got: Vec<String> = file.problems.iter().map(ToString::to_string).collect();
        assert!(
            got.len() == 1
                && got[0].starts_with("f.toml:3:12: max_body: ")
                && got[0].contains("lots"),
            "{got:?}"
        );
    }

    #[test]
    fn name_refusals_say_why_in_their_words() {
        let why = |name: &str| check_name(name).unwrap_err().to_string();
        assert_eq!(
            why("bücher.example"),
            "write an international name as its A-labels (xn--…), as DNS holds it"
        );
        assert_eq!(
            why("192.0.2.1"),
            "an IP address is no site name (clients send no SNI for one); make the site the \
             default_site to answer requests by address"
        );
        assert_eq!(why(""), "expected a DNS name of 1 to 253 characters");
        assert_eq!(
            why("a.*.example"),
            "expected a DNS name: a wildcard is `*.` followed by the name it covers one label of"
        );
        assert_eq!(
            why("a..example"),
            "expected a DNS name: labels of letters, digits and hyphens, 1 to 63 each, separated \
             by dots"
        );
        assert_eq!(
            why("*.com"),
            "a wildcard of a top-level domain covers too much; name the domain"
        );
    }

    #[test]
    fn names_are_dns_names_or_one_label_wildcards() {
        assert_eq!(check_name("A.Example").unwrap(), "a.example");
        assert_eq!(check_name("*.w.test").unwrap(), "*.w.test");
        assert_eq!(
            check_name("xn--bcher-kva.example").unwrap(),
            "xn--bcher-kva.example"
        );
        for bad in [
            "bücher.example",
            "a..b",
            "*.com",
            "a.*.b",
            "-a.b",
            "",
            "127.0.0.1",
            "a b",
        ] {
            assert!(check_name(bad).is_err(), "{bad}");
        }
    }
}
