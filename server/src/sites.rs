//! The sites of a worker made ready to serve: which site a request belongs to, and which route
//! of it answers. Built once, when the worker starts, from the site table
//! ([`ringmux_proto::sites::SiteTable`]) and the worker's options; shared by HTTP/3
//! ([`crate::http`]) and HTTPS over TCP ([`crate::tcp`]).
//!
//! * Every document root of the table is opened once ([`DocRoot`]), all of them sharing one
//!   cache of small files of the worker's budget ([`FileCache`]), and every upstream URL is
//!   parsed once into one [`Upstream`] (its pool of connections shared by the routes that name
//!   it). A route that cannot be used fails the start with an error naming its site and path.
//! * A connection's site is the one its TLS server name chooses ([`Router::connection_site`]);
//!   a request's is the one its authority chooses. When the two differ the request is answered
//!   421 (RFC 9110 §15.5.20): one site's content never goes out under another's certificate.
//! * The route is the longest prefix of the request path ([`ringmux_proto::sites::Site::route`]'s
//!   rule), chosen on the path as sent. A path whose decoded form (escapes decoded, empty, `.`
//!   and `..` segments resolved) would choose another route is refused with 400, so an escape
//!   never slips past a route meant to stop it.
//!
//! This module decides; it never reads a request body nor writes a response (the transports do).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use http::uri::PathAndQuery;
use http::{header, HeaderMap, HeaderValue, Method, StatusCode, Uri};
use ringmux_proto::sites::{prefix_rest, Action, Route, Site, SiteIndex, SiteTable};
use ringmux_proto::UpstreamUrl;

use crate::access_log::AccessLog;
use crate::files::{DocRoot, FileCache, FileOptions, RootError};
use crate::http::{self as served, Body, Reply};
use crate::proxy::{ErrorKind, Upstream};

/// The label of the site the command line makes, and of a site table's row for requests no
/// site answered is `-` ([`NO_SITE`]).
pub const COMMAND_LINE_LABEL: &str = "default";

/// How the access log and the per-site counters name a request that no site answered.
pub const NO_SITE: &str = "-";

/// What every site of a worker shares: the worker's options.
#[derive(Debug, Clone)]
pub struct RouterOptions {
    /// Largest `/bytes/N` of the built-in routes.
    pub max_bytes: u64,
    /// Every document root's options; `cache_bytes` is the budget of the one cache they share.
    pub files: FileOptions,
    /// The proxy's timeout, for every upstream.
    pub upstream_timeout: Duration,
    /// One line per request (`--access-log`).
    pub access_log: Option<Arc<AccessLog>>,
}

impl Default for RouterOptions {
    fn default() -> Self {
        RouterOptions {
            max_bytes: served::DEFAULT_MAX_BYTES,
            files: FileOptions::default(),
            upstream_timeout: crate::proxy::DEFAULT_TIMEOUT,
            access_log: None,
        }
    }
}

/// A route of the table this worker cannot serve.
#[derive(Debug, thiserror::Error)]
pub enum RouterError {
    #[error("site {site:?}, route {route:?}: {error}")]
    Root {
        site: String,
        route: String,
        error: RootError,
    },
    #[error("site {site:?}, route {route:?}: upstream {url:?}: {error}")]
    Upstream {
        site: String,
        route: String,
        url: String,
        error: ringmux_proto::UpstreamError,
    },
    #[error("site {site:?}, route {route:?}: {what}")]
    Action {
        site: String,
        route: String,
        what: String,
    },
}

/// The sites of a worker, ready to route requests. Cheap to clone (shared).
#[derive(Clone)]
pub struct Router {
    inner: Arc<Inner>,
}

struct Inner {
    sites: Vec<Served>,
    index: SiteIndex,
    max_bytes: u64,
    access_log: Option<Arc<AccessLog>>,
    /// Every distinct upstream, for its error counters.
    upstreams: Vec<Arc<Upstream>>,
    /// Every distinct document root.
    roots: Vec<DocRoot>,
    /// Whether the access log names the site (see [`crate::access_log::Entry::site`]): not when
    /// the command line's site is the only one.
    log_sites: bool,
    no_site: Arc<str>,
}

impl std::fmt::Debug for Router {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Router")
            .field("sites", &self.inner.sites.len())
            .field("upstreams", &self.inner.upstreams.len())
            .field("roots", &self.inner.roots.len())
            .finish_non_exhaustive()
    }
}

/// One site: its label and its routes.
struct Served {
    label: Arc<str>,
    routes: Vec<Routed>,
}

/// A route with what it does, opened.
struct Routed {
    prefix: String,
    handler: Handler,
}

/// What a route does, with its root opened or its upstream made.
enum Handler {
    Files(DocRoot),
    Builtin(Option<DocRoot>),
    Upstream {
        upstream: Arc<Upstream>,
        strip_prefix: bool,
    },
    Redirect {
        to: String,
        status: StatusCode,
    },
    Respond {
        status: StatusCode,
        body: Bytes,
    },
}

/// Which site answers a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Choice {
    /// This site of the table.
    Site(usize),
    /// 421: the request names a site other than its connection's, or one no site has.
    Misdirected,
    /// 400: an HTTP/1.1 request without exactly one `host` (RFC 9112 §3.2).
    NoHost,
}

impl Choice {
    /// The site that answers, in logs and counters: the request's, else (421, 400) that of its
    /// connection, `connection`.
    pub fn answering(self, connection: Option<usize>) -> Option<usize> {
        match self {
            Choice::Site(s) => Some(s),
            Choice::Misdirected | Choice::NoHost => connection,
        }
    }
}

/// What a request gets from its route, before the transport reads its body or answers.
pub(crate) enum Target<'a> {
    /// Answered by this worker.
    Local(Local<'a>),
    /// Passed to the upstream, with this path and query instead of the request's when set.
    Proxy {
        upstream: &'a Arc<Upstream>,
        path: Option<PathAndQuery>,
    },
}

/// A request this worker answers itself.
pub(crate) enum Local<'a> {
    /// This reply, whatever the method (the transport reads the request body first).
    Reply(Reply),
    /// A GET or HEAD of a file or a built-in: [`Lookup::reply`].
    Get(Lookup<'a>),
    /// `POST /echo-len` of a built-in route: its body's length.
    EchoLen,
}

impl Target<'_> {
    fn reply(r: Reply) -> Self {
        Target::Local(Local::Reply(r))
    }
}

/// A GET or HEAD answered from a document root or the built-ins.
pub(crate) struct Lookup<'a> {
    root: Option<&'a DocRoot>,
    /// Only files, no built-ins.
    files_only: bool,
    max_bytes: u64,
    /// The request path, for redirect locations.
    path: &'a str,
    /// The path beneath the route's prefix.
    rest: &'a str,
}

impl Lookup<'_> {
    pub(crate) async fn reply(self, method: &Method, headers: &HeaderMap) -> Reply {
        if self.files_only {
            let Some(root) = self.root else {
                return not_found();
            };
            served::files(root, method, headers, self.path, self.rest).await
        } else {
            served::builtin(
                self.root,
                self.max_bytes,
                method,
                headers,
                self.path,
                self.rest,
            )
            .await
        }
    }
}

impl Router {
    /// Opens every root and makes every upstream of `table`.
    pub fn new(table: &SiteTable, opts: &RouterOptions) -> Result<Router, RouterError> {
        let cache = FileCache::new(opts.files.cache_bytes);
        let mut roots: HashMap<PathBuf, DocRoot> = HashMap::new();
        let mut upstreams: HashMap<String, Arc<Upstream>> = HashMap::new();
        let mut sites = Vec::with_capacity(table.sites.len());
        for site in &table.sites {
            let mut routes = Vec::with_capacity(site.routes.len());
            for route in &site.routes {
                let fail = |what: String| RouterError::Action {
                    site: site.label.clone(),
                    route: route.path.clone(),
                    what,
                };
                if !route.path.starts_with('/') {
                    return Err(fail("the path does not start with /".into()));
                }
                let mut open = |path: &PathBuf| -> Result<DocRoot, RouterError> {
                    if let Some(root) = roots.get(path) {
                        return Ok(root.clone());
                    }
                    let root = DocRoot::open_with_cache(path, opts.files.clone(), &cache).map_err(
                        |error| RouterError::Root {
                            site: site.label.clone(),
                            route: route.path.clone(),
                            error,
                        },
                    )?;
                    roots.insert(path.clone(), root.clone());
                    Ok(root)
                };
                let handler = match &route.action {
                    Action::Files { root } => Handler::Files(open(root)?),
                    Action::Builtin { root } => Handler::Builtin(match root {
                        Some(root) => Some(open(root)?),
                        None => None,
                    }),
                    Action::Upstream { url, strip_prefix } => {
                        let upstream = match upstreams.get(url) {
                            Some(u) => u.clone(),
                            None => {
                                let parsed: UpstreamUrl =
                                    url.parse().map_err(|error| RouterError::Upstream {
                                        site: site.label.clone(),
                                        route: route.path.clone(),
                                        url: url.clone(),
                                        error,
                                    })?;
                                let u = Arc::new(Upstream::new(&parsed, opts.upstream_timeout));
                                upstreams.insert(url.clone(), u.clone());
                                u
                            }
                        };
                        Handler::Upstream {
                            upstream,
                            strip_prefix: *strip_prefix,
                        }
                    }
                    Action::Redirect { to, status } => {
                        if !matches!(status, 301 | 302 | 307 | 308) {
                            return Err(fail(format!(
                                "redirect status {status} is not 301, 302, 307 or 308"
                            )));
                        }
                        if HeaderValue::from_str(to).is_err() {
                            return Err(fail(format!(
                                "redirect target {to:?} is not a header value"
                            )));
                        }
                        Handler::Redirect {
                            to: to.clone(),
                            status: StatusCode::from_u16(*status)
                                .map_err(|e| fail(e.to_string()))?,
                        }
                    }
                    Action::Respond { status: code, body } => {
                        let status = match StatusCode::from_u16(*code) {
                            Ok(s) if (200..=599).contains(code) => s,
                            _ => {
                                return Err(fail(format!(
                                    "response status {code} is not between 200 and 599"
                                )))
                            }
                        };
                        if matches!(*code, 204 | 304) && !body.is_empty() {
                            return Err(fail(format!("a {code} response has no body")));
                        }
                        Handler::Respond {
                            status,
                            body: Bytes::from(body.clone()),
                        }
                    }
                };
                routes.push(Routed {
                    prefix: route.path.clone(),
                    handler,
                });
            }
            sites.push(Served {
                label: Arc::from(site.label.as_str()),
                routes,
            });
        }
        let log_sites = !(table.sites.len() == 1 && table.sites[0].names.is_empty());
        Ok(Router {
            inner: Arc::new(Inner {
                sites,
                index: SiteIndex::new(table),
                max_bytes: opts.max_bytes,
                access_log: opts.access_log.clone(),
                upstreams: upstreams.into_values().collect(),
                roots: roots.into_values().collect(),
                log_sites,
                no_site: Arc::from(NO_SITE),
            }),
        })
    }

    /// The site of a connection whose TLS server name is `sni`.
    pub fn connection_site(&self, sni: Option<&str>) -> Option<usize> {
        self.inner.index.for_host(sni)
    }

    /// The site of a request on a connection of site `connection` (`None` for a connection of no
    /// site) with `parts`; `http11` for an HTTP/1.1 request, which must carry one `host`.
    pub fn choose(
        &self,
        connection: Option<usize>,
        parts: &http::request::Parts,
        http11: bool,
    ) -> Choice {
        if http11 && parts.version == http::Version::HTTP_11 {
            let mut hosts = parts.headers.get_all(header::HOST).iter();
            let one = hosts.next().is_some_and(|h| h.to_str().is_ok()) && hosts.next().is_none();
            if !one {
                return Choice::NoHost;
            }
        }
        let site = match served::authority_of(parts) {
            Some(authority) => self.inner.index.for_host(Some(authority)),
            None => connection,
        };
        match site {
            Some(s) if Some(s) == connection => Choice::Site(s),
            _ => Choice::Misdirected,
        }
    }

    /// The site of a request on a connection without TLS (the plain-HTTP redirects): the one
    /// its authority names, else the default site.
    pub fn site_for_host(&self, host: Option<&str>) -> Option<usize> {
        self.inner.index.for_host(host)
    }

    /// The sites' labels, in the table's order.
    pub fn labels(&self) -> impl Iterator<Item = &str> {
        self.inner.sites.iter().map(|s| &*s.label)
    }

    /// Errors of every upstream, summed per kind in [`ErrorKind::ALL`] order.
    pub fn upstream_errors(&self) -> [u64; ErrorKind::ALL.len()] {
        let mut sum = [0; ErrorKind::ALL.len()];
        for u in &self.inner.upstreams {
            for (s, e) in sum.iter_mut().zip(u.errors()) {
                *s += e;
            }
        }
        sum
    }

    /// Whether any route proxies.
    pub fn proxies(&self) -> bool {
        !self.inner.upstreams.is_empty()
    }

    pub(crate) fn access_log(&self) -> Option<&Arc<AccessLog>> {
        self.inner.access_log.as_ref()
    }

    /// What the access log writes for site `site`: `None` when it names no site.
    pub(crate) fn log_label(&self, site: Option<usize>) -> Option<Arc<str>> {
        if !self.inner.log_sites {
            return None;
        }
        Some(match site.and_then(|s| self.inner.sites.get(s)) {
            Some(s) => s.label.clone(),
            None => self.inner.no_site.clone(),
        })
    }

    /// What a `method` request for `uri` gets, its site chosen as `choice`.
    pub(crate) fn target<'a>(
        &'a self,
        choice: Choice,
        method: &Method,
        uri: &'a Uri,
    ) -> Target<'a> {
        let site = match choice {
            Choice::Site(site) => site,
            Choice::Misdirected => return Target::reply(misdirected()),
            Choice::NoHost => return Target::reply(no_host()),
        };
        let Some(served) = self.inner.sites.get(site) else {
            return Target::reply(not_found());
        };
        let path = uri.path();
        let (routed, rest) = match served.route(path) {
            Ok(Some(found)) => found,
            Ok(None) => return Target::reply(not_found()),
            Err(AmbiguousPath) => {
                return Target::reply(Reply::text(StatusCode::BAD_REQUEST, b"bad path\n"))
            }
        };
        let safe = method == Method::GET || method == Method::HEAD;
        match &routed.handler {
            Handler::Upstream {
                upstream,
                strip_prefix,
            } => Target::Proxy {
                upstream,
                path: strip_prefix.then(|| stripped(rest, uri.query())).flatten(),
            },
            Handler::Redirect { to, status } => Target::reply(redirect(to, *status, uri)),
            Handler::Respond { status, body } => Target::reply(Reply::new(
                *status,
                "text/plain; charset=utf-8",
                Body::Memory(body.clone()),
            )),
            Handler::Files(root) if safe => Target::Local(Local::Get(Lookup {
                root: Some(root),
                files_only: true,
                max_bytes: self.inner.max_bytes,
                path,
                rest,
            })),
            Handler::Files(_) => Target::reply(not_allowed("GET, HEAD")),
            Handler::Builtin(_) if method == Method::POST && rest == "/echo-len" => {
                Target::Local(Local::EchoLen)
            }
            Handler::Builtin(root) if safe => Target::Local(Local::Get(Lookup {
                root: root.as_ref(),
                files_only: false,
                max_bytes: self.inner.max_bytes,
                path,
                rest,
            })),
            Handler::Builtin(_) => Target::reply(not_allowed("GET, HEAD, POST")),
        }
    }
}

/// A request path whose decoded form chooses another route than the path as sent.
#[derive(Debug, PartialEq, Eq)]
struct AmbiguousPath;

impl Served {
    /// The route of `path` and the rest of it beneath the route's prefix.
    fn route<'p>(&self, path: &'p str) -> Result<Option<(&Routed, &'p str)>, AmbiguousPath> {
        if !path.starts_with('/') {
            // `*` (OPTIONS) or no path (CONNECT): only a route of the whole site takes it.
            return Ok(self
                .routes
                .iter()
                .find(|r| r.prefix == "/")
                .map(|r| (r, path)));
        }
        let found = self.longest(path);
        if self.routes.len() > 1 && needs_decoding(path) {
            // One route cannot be told from another; with several, compare the decoded path's.
            let decoded = decoded_path(path).ok_or(AmbiguousPath)?;
            let other = self.longest(&decoded).map(|(r, _)| r as *const Routed);
            if found.map(|(r, _)| r as *const Routed) != other {
                return Err(AmbiguousPath);
            }
        }
        Ok(found)
    }

    /// [`Site::route`]'s rule over the opened routes.
    fn longest<'p>(&self, path: &'p str) -> Option<(&Routed, &'p str)> {
        self.routes
            .iter()
            .filter_map(|r| Some((r, prefix_rest(&r.prefix, path)?)))
            .max_by_key(|(r, _)| r.prefix.len())
    }
}

/// Whether `path` holds an escape, an empty segment or a dot segment.
fn needs_decoding(path: &str) -> bool {
    path.contains('%') || path.contains("//") || path.split('/').any(|s| s == "." || s == "..")
}

/// `path` with its escapes decoded (bytes that are not UTF-8 replaced), then its empty and `.`
/// segments dropped and its `..` segments resolved (RFC 3986 §5.2.4), a final `/` kept; `None`
/// if a `..` would climb above the root.
fn decoded_path(path: &str) -> Option<String> {
    let decoded = percent_decode_lossy(path);
    let mut segments: Vec<&str> = Vec::new();
    for s in decoded.split('/') {
        match s {
            "" | "." => {}
            ".." => {
                segments.pop()?;
            }
            s => segments.push(s),
        }
    }
    let mut out = String::with_capacity(decoded.len());
    for s in &segments {
        out.push('/');
        out.push_str(s);
    }
    if out.is_empty() || decoded.ends_with('/') || decoded.ends_with("/.") {
        out.push('/');
    }
    Some(out)
}

/// `%XX` escapes decoded; a bad escape is kept as it stands.
fn percent_decode_lossy(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = |c: u8| (c as char).to_digit(16);
        if b[i] == b'%' && i + 2 < b.len() {
            if let (Some(hi), Some(lo)) = (hex(b[i + 1]), hex(b[i + 2])) {
                out.push((hi * 16 + lo) as u8);
                i += 3;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The path and query passed upstream by a route with `strip_prefix`: the rest beneath the
/// prefix (`/` for none) and the query.
fn stripped(rest: &str, query: Option<&str>) -> Option<PathAndQuery> {
    let rest = if rest.is_empty() { "/" } else { rest };
    let pq = match query {
        Some(q) => format!("{rest}?{q}"),
        None => rest.to_owned(),
    };
    // Both parts come from a parsed URI, so this parses; if not, the path is passed whole.
    PathAndQuery::try_from(pq).ok()
}

/// The redirect of a route: `to` with `{path}` and `{query}` filled in from `uri`, empty body.
fn redirect(to: &str, status: StatusCode, uri: &Uri) -> Reply {
    let mut location = to
        .replace("{path}", uri.path())
        .replace("{query}", uri.query().unwrap_or(""));
    if location.ends_with('?') {
        location.pop();
    }
    let mut headers = HeaderMap::with_capacity(2);
    match HeaderValue::from_str(&location) {
        // The target was checked at start and the request's path and query are visible ASCII.
        Ok(v) => headers.insert(header::LOCATION, v),
        Err(_) => return Reply::text(StatusCode::BAD_REQUEST, b"bad path\n"),
    };
    headers.insert(header::CONTENT_LENGTH, HeaderValue::from_static("0"));
    Reply {
        status,
        headers,
        body: Body::Empty,
    }
}

fn not_found() -> Reply {
    Reply::text(StatusCode::NOT_FOUND, b"not found\n")
}

fn not_allowed(allow: &'static str) -> Reply {
    let mut r = Reply::text(StatusCode::METHOD_NOT_ALLOWED, b"method not allowed\n");
    r.headers
        .insert(header::ALLOW, HeaderValue::from_static(allow));
    r
}

/// The reply to a misdirected request (RFC 9110 §15.5.20).
fn misdirected() -> Reply {
    Reply::text(
        StatusCode::MISDIRECTED_REQUEST,
        b"this connection does not serve that host\n",
    )
}

/// The reply to an HTTP/1.1 request without one `host` (RFC 9112 §3.2).
fn no_host() -> Reply {
    Reply::text(StatusCode::BAD_REQUEST, b"a request needs one host field\n")
}

/// `table` with the worker's own `--root` or `--upstream` applied: when either is given, it
/// replaces the routes of the command line's site (the one without names), or, if the table
/// has none, becomes a new such site, the default. Without either, `table` as it is.
pub fn with_command_line(
    mut table: SiteTable,
    root: Option<&std::path::Path>,
    upstream: Option<&UpstreamUrl>,
) -> SiteTable {
    let action = match (upstream, root) {
        (Some(url), _) => Action::Upstream {
            url: url.to_string(),
            strip_prefix: false,
        },
        (None, Some(root)) => Action::Builtin {
            root: Some(root.to_path_buf()),
        },
        (None, None) => return table,
    };
    let routes = vec![Route {
        path: "/".into(),
        action,
    }];
    match table.sites.iter_mut().position(|s| s.names.is_empty()) {
        Some(i) => table.sites[i].routes = routes,
        None => {
            table.sites.push(command_line_site(routes));
            table.default_site = Some(table.sites.len() - 1);
        }
    }
    table
}

/// The table the command line makes without a configuration file: one default site, without
/// names, of the built-in routes (`with_command_line` then sets its root or upstream).
pub fn command_line_table() -> SiteTable {
    SiteTable {
        sites: vec![command_line_site(vec![Route {
            path: "/".into(),
            action: Action::Builtin { root: None },
        }])],
        default_site: Some(0),
    }
}

fn command_line_site(routes: Vec<Route>) -> Site {
    Site {
        label: COMMAND_LINE_LABEL.into(),
        names: Vec::new(),
        // The server never reads these: the worker library chooses certificates.
        cert_pem: String::new(),
        key_pem: String::new(),
        routes,
    }
}

// ---------------------------------------------------------------------------------------------
// Counters

/// Status classes counted per site: 1xx to 5xx.
const CLASSES: usize = 5;

/// Responses per site and status class, one row per site of the table and one for requests no
/// site answered ([`NO_SITE`]): bounded by the table. All `Relaxed`: independent statistics.
#[derive(Debug, Default)]
pub struct SiteStats {
    rows: OnceLock<Box<[SiteRow]>>,
}

#[derive(Debug)]
struct SiteRow {
    label: Arc<str>,
    classes: [AtomicU64; CLASSES],
    misdirected: AtomicU64,
}

/// One row of [`SiteStats`], copied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SiteCounts {
    pub label: String,
    /// Responses by status class: 1xx, 2xx, 3xx, 4xx, 5xx.
    pub responses: [u64; CLASSES],
    /// Of the 4xx, the 421s: requests for a host the connection does not serve.
    pub misdirected: u64,
}

impl SiteStats {
    /// Makes the rows for `router`'s sites; the first router given decides them.
    pub(crate) fn init(&self, router: &Router) {
        self.rows.get_or_init(|| {
            router
                .inner
                .sites
                .iter()
                .map(|s| s.label.clone())
                .chain([router.inner.no_site.clone()])
                .map(|label| SiteRow {
                    label,
                    classes: Default::default(),
                    misdirected: AtomicU64::new(0),
                })
                .collect()
        });
    }

    /// Counts a response of `site` (`None`: no site's) with `status`.
    pub(crate) fn count(&self, site: Option<usize>, status: StatusCode) {
        let Some(rows) = self.rows.get() else { return };
        let Some(last) = rows.len().checked_sub(1) else {
            return;
        };
        let row = &rows[site.filter(|&s| s < last).unwrap_or(last)];
        let class = usize::from(status.as_u16() / 100).wrapping_sub(1);
        if let Some(c) = row.classes.get(class) {
            c.fetch_add(1, Ordering::Relaxed);
        }
        if status == StatusCode::MISDIRECTED_REQUEST {
            row.misdirected.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Every row, the table's sites first, then [`NO_SITE`]'s. Empty before serving began.
    pub fn snapshot(&self) -> Vec<SiteCounts> {
        let Some(rows) = self.rows.get() else {
            return Vec::new();
        };
        rows.iter()
            .map(|r| SiteCounts {
                label: r.label.to_string(),
                responses: std::array::from_fn(|i| r.classes[i].load(Ordering::Relaxed)),
                misdirected: r.misdirected.load(Ordering::Relaxed),
            })
            .collect()
    }
}

/// One site answering every host, as [`crate::http::Site`] describes it: the built-in routes
/// (files from its root, then the built-ins) or its upstream.
impl From<&served::Site> for Router {
    fn from(site: &served::Site) -> Router {
        let handler = match &site.upstream {
            Some(upstream) => Handler::Upstream {
                upstream: upstream.clone(),
                strip_prefix: false,
            },
            None => Handler::Builtin(site.root.clone()),
        };
        Router {
            inner: Arc::new(Inner {
                sites: vec![Served {
                    label: Arc::from(COMMAND_LINE_LABEL),
                    routes: vec![Routed {
                        prefix: "/".into(),
                        handler,
                    }],
                }],
                index: SiteIndex::new(&command_line_table()),
                max_bytes: site.max_bytes,
                access_log: site.access_log.clone(),
                upstreams: site.upstream.iter().cloned().collect(),
                roots: site.root.iter().cloned().collect(),
                log_sites: false,
                no_site: Arc::from(NO_SITE),
            }),
        }
    }
}

impl From<Arc<served::Site>> for Router {
    fn from(site: Arc<served::Site>) -> Router {
        Router::from(&*site)
    }
}

impl From<served::Site> for Router {
    fn from(site: served::Site) -> Router {
        Router::from(&site)
    }
}
