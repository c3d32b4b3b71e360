//! The sites of a worker made ready to serve: which site a request belongs to, and which route
//! of it answers. Built once, when the worker starts, from the site table
//! ([`ringmux_proto::sites::SiteTable`]) and the worker's options; shared by every front
//! (HTTP/3, HTTPS over TCP, the plain-HTTP listener), none of which it knows.
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
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use http::uri::PathAndQuery;
use http::{header, HeaderMap, HeaderValue, Method, StatusCode, Uri};
use ringmux_proto::health::HealthSlots;
use ringmux_proto::sites::{self as table, longest_prefix, Action, Route, SiteIndex, SiteTable};
use ringmux_proto::UpstreamUrl;

use crate::access_log::{AccessLog, Logged};
use crate::files::{DocRoot, FileCache, FileOptions, RootError};
use crate::limits::{Gate, GateMaker, Gates, Refusal};
use crate::proxy::health::Verdicts;
use crate::proxy::pool::{Backend, Pool};
use crate::proxy::{ConnectError, ErrorKind, Upstream, UpstreamTls};
use crate::reply::{self, Body, Reply};
use crate::request::authority_of;
use crate::rules::{Applied, RouteRules, SiteRules};
use ringmux_ring::tally::Tallies;

/// The label of the site the command line makes (`ringmux_proto::sites::Site::label`).
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
    /// The rate tables the demux handed over (`ringmux_worker::rate_tables`), if any.
    pub rate_tables: Option<Arc<Tallies>>,
    /// The health table the demux handed over (`ringmux_worker::health_table`), if any.
    pub health_table: Option<Arc<ringmux_ring::health::HealthReader>>,
}

impl Default for RouterOptions {
    fn default() -> Self {
        RouterOptions {
            max_bytes: reply::DEFAULT_MAX_BYTES,
            files: FileOptions::default(),
            upstream_timeout: crate::proxy::DEFAULT_TIMEOUT,
            access_log: None,
            rate_tables: None,
            health_table: None,
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
    #[error("site {site:?}, route {route:?}: upstream {error}")]
    Upstream {
        site: String,
        route: String,
        error: Box<ConnectError>,
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
    /// Every distinct backend, for its series.
    backends: Vec<Arc<Backend>>,
    /// Every distinct document root.
    roots: Vec<DocRoot>,
    /// Whether the access log names the site (see [`crate::access_log::Entry::site`]): not when
    /// the command line's site is the only one.
    log_sites: bool,
    no_site: Arc<str>,
    /// Per-client limits' counters (`crate::limits`).
    gates: Gates,
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
    /// Where its names that only redirect send requests: its first name, when it has such
    /// names.
    home: Option<String>,
    /// Its names that only redirect (`table::Site::redirect_names`).
    redirect_names: Vec<String>,
    /// Its header rules, HSTS, CORS and error pages.
    rules: SiteRules,
    /// Its limits, for a request no route takes.
    gate: Option<Gate>,
}

/// A route with what it does, opened.
struct Routed {
    prefix: String,
    handler: Handler,
    /// Its header rules and fallback.
    rules: RouteRules,
    /// Its limits over its site's.
    gate: Option<Gate>,
}

/// What a route does, with its root opened or its upstream made.
enum Handler {
    Files(DocRoot),
    Builtin(Option<DocRoot>),
    Upstream {
        upstream: Arc<Pool>,
        strip_prefix: bool,
        /// Text responses are coded for clients that accept it (`crate::compress`).
        compress: bool,
    },
    Redirect {
        to: String,
        status: StatusCode,
    },
    /// The reply's parts, made once: [`Opener::handler`] puts every field of the route's
    /// `respond` in them.
    Respond {
        status: StatusCode,
        headers: HeaderMap,
        body: Bytes,
    },
}

/// What the routes of a table open, each once: their document roots (sharing one cache) and
/// their upstreams (one pool of connections per URL).
struct Opener<'o> {
    opts: &'o RouterOptions,
    cache: FileCache,
    /// By path and whether the route compresses.
    roots: HashMap<(PathBuf, bool), DocRoot>,
    upstreams: HashMap<(UpstreamUrl, UpstreamTls), Arc<Backend>>,
}

/// Why a route's handler cannot be made: its root, on disk, or its upstream's TLS settings.
#[derive(Debug, thiserror::Error)]
enum OpenError {
    #[error(transparent)]
    Root(#[from] RootError),
    #[error(transparent)]
    Upstream(#[from] Box<ConnectError>),
}

impl Opener<'_> {
    /// The handler of `action`, one arm per kind. Every value was checked when the table was
    /// read (`ringmux_proto::route`); only a root can fail here, on disk, or an upstream's
    /// certificates. `compress`: the route's and its site's `compress` (on unless one says
    /// false).
    ///
    /// `first_slot`: the route's first slot of the health table when it checks health
    /// (`HealthSlots::firsts`).
    fn handler(
        &mut self,
        action: &Action,
        compress: bool,
        first_slot: Option<u32>,
    ) -> Result<Handler, OpenError> {
        Ok(match action {
            Action::Files { root } => Handler::Files(self.root(root, compress)?),
            Action::Builtin { root } => Handler::Builtin(match root {
                Some(root) => Some(self.root(root, compress)?),
                None => None,
            }),
            Action::Upstream {
                url,
                strip_prefix,
                balancing,
                max_body,
                tls,
                ..
            } => {
                let backends = url
                    .urls()
                    .iter()
                    .map(|u| self.upstream(u, tls))
                    .collect::<Result<Vec<_>, _>>()?;
                let mut pool = Pool::new(backends, *balancing, *max_body);
                if let (Some(first), Some(table)) = (first_slot, &self.opts.health_table) {
                    pool = pool.checked(Verdicts::new(table.clone(), first));
                }
                Handler::Upstream {
                    upstream: Arc::new(pool),
                    strip_prefix: *strip_prefix,
                    compress,
                }
            }
            Action::Redirect { to, status } => Handler::Redirect {
                to: to.as_str().to_owned(),
                status: status_code(status.get()),
            },
            Action::Respond(r) => {
                let body = Bytes::from(r.body.as_str().to_owned());
                let mut headers = HeaderMap::with_capacity(2);
                headers.insert(
                    header::CONTENT_TYPE,
                    HeaderValue::from_static("text/plain; charset=utf-8"),
                );
                headers.insert(header::CONTENT_LENGTH, HeaderValue::from(body.len()));
                // Each was checked when read (`ResponseHeaders`); a `content-type` replaces ours.
                for (name, value) in r.headers.iter() {
                    if let (Ok(n), Ok(v)) = (
                        http::HeaderName::from_bytes(name.as_bytes()),
                        HeaderValue::from_str(value),
                    ) {
                        headers.insert(n, v);
                    }
                }
                Handler::Respond {
                    status: status_code(r.status.get()),
                    headers,
                    body,
                }
            }
        })
    }

    fn root(&mut self, path: &Path, compress: bool) -> Result<DocRoot, RootError> {
        let compress = compress && self.opts.files.compress;
        let key = (path.to_path_buf(), compress);
        if let Some(root) = self.roots.get(&key) {
            return Ok(root.clone());
        }
        let opts = FileOptions {
            compress,
            ..self.opts.files.clone()
        };
        let root = DocRoot::open_with_cache(path, opts, &self.cache)?;
        self.roots.insert(key, root.clone());
        Ok(root)
    }

    /// One client per URL and TLS settings: routes that name the same backend alike share
    /// its connections (and its health).
    fn upstream(
        &mut self,
        url: &UpstreamUrl,
        tls: &UpstreamTls,
    ) -> Result<Arc<Backend>, OpenError> {
        let key = (url.clone(), tls.clone());
        if let Some(u) = self.upstreams.get(&key) {
            return Ok(u.clone());
        }
        let made = Upstream::new(url, tls, self.opts.upstream_timeout).map_err(Box::new)?;
        let backend = Arc::new(Backend::new(Arc::new(made)));
        self.upstreams.insert(key, backend.clone());
        Ok(backend)
    }
}

/// A status the route's declaration has checked (a redirect's, a response's: 200 to 599).
fn status_code(code: u16) -> StatusCode {
    StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
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
    /// 301 to the site's first name: the request names one of the site's names that only
    /// redirect (`redirect_names`), with `port` if it named one other than 443.
    Redirect { site: usize, port: Option<u16> },
}

impl Choice {
    /// The site that answers, in logs and counters: the request's, else (421, 400) that of its
    /// connection, `connection`.
    pub fn answering(self, connection: Option<usize>) -> Option<usize> {
        match self {
            Choice::Site(s) | Choice::Redirect { site: s, .. } => Some(s),
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
        upstream: &'a Arc<Pool>,
        path: Option<PathAndQuery>,
        /// The route codes text responses (`crate::compress::ProxyCoding`).
        compress: bool,
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
    /// A file route's fallback (beneath its root) for a path with no file and no extension.
    fallback: Option<&'a str>,
}

impl Lookup<'_> {
    pub(crate) async fn reply(self, method: &Method, headers: &HeaderMap) -> Reply {
        if self.files_only {
            let Some(root) = self.root else {
                return not_found();
            };
            let reply = reply::files(root, method, headers, self.path, self.rest).await;
            match self.fallback {
                Some(fallback)
                    if reply.status == StatusCode::NOT_FOUND && no_extension(self.rest) =>
                {
                    reply::fallback(root, method, headers, fallback).await
                }
                _ => reply,
            }
        } else {
            reply::builtin(
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
        let mut opener = Opener {
            opts,
            cache: FileCache::new(opts.files.cache_bytes),
            roots: HashMap::new(),
            upstreams: HashMap::new(),
        };
        let mut gates = GateMaker::new(table);
        let first_slots = HealthSlots::firsts(table);
        let mut sites = Vec::with_capacity(table.sites.len());
        for (s, site) in table.sites.iter().enumerate() {
            let site_share = gates.site_share(&site.limits);
            let mut routes = Vec::with_capacity(site.routes.len());
            for (r, route) in site.routes.iter().enumerate() {
                let first_slot = first_slots.get(s).and_then(|f| f.get(r)).copied().flatten();
                let handler = route
                    .check()
                    .map_err(|e| RouterError::Action {
                        site: site.label.clone(),
                        route: route.path.clone(),
                        what: e.to_string(),
                    })
                    .and_then(|()| {
                        let compress = route.compress.or(site.compress).unwrap_or(true);
                        opener
                            .handler(&route.action, compress, first_slot)
                            .map_err(|e| {
                                let (site, route) = (site.label.clone(), route.path.clone());
                                match e {
                                    OpenError::Root(error) => {
                                        RouterError::Root { site, route, error }
                                    }
                                    OpenError::Upstream(error) => {
                                        RouterError::Upstream { site, route, error }
                                    }
                                }
                            })
                    })?;
                routes.push(Routed {
                    prefix: route.path.clone(),
                    handler,
                    rules: RouteRules::new(&route.rules),
                    gate: gates.gate(&route.limits, &site.limits, site_share),
                });
            }
            sites.push(Served {
                label: Arc::from(site.label.as_str()),
                routes,
                home: (!site.redirect_names.is_empty())
                    .then(|| site.names.first().cloned())
                    .flatten(),
                redirect_names: site.redirect_names.clone(),
                rules: SiteRules::new(&site.rules),
                gate: gates.gate(&Default::default(), &site.limits, site_share),
            });
        }
        let (roots, upstreams) = (opener.roots, opener.upstreams);
        let log_sites = true;
        Ok(Router {
            inner: Arc::new(Inner {
                sites,
                index: SiteIndex::new(table),
                max_bytes: opts.max_bytes,
                access_log: opts.access_log.clone(),
                upstreams: upstreams.values().map(|b| b.upstream().clone()).collect(),
                backends: upstreams.into_values().collect(),
                roots: roots.into_values().collect(),
                log_sites,
                no_site: Arc::from(NO_SITE),
                gates: Gates::new(opts.rate_tables.clone(), gates.rated()),
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
        let authority = authority_of(parts);
        let site = match authority {
            Some(authority) => self.inner.index.for_host(Some(authority)),
            None => connection,
        };
        match site {
            Some(s) if Some(s) == connection => match (authority, self.inner.sites.get(s)) {
                (Some(a), Some(served))
                    if served.home.is_some()
                        && table::host_is_one_of(a, &served.redirect_names) =>
                {
                    Choice::Redirect {
                        site: s,
                        port: port_of(a).filter(|&p| p != 443),
                    }
                }
                _ => Choice::Site(s),
            },
            _ => Choice::Misdirected,
        }
    }

    /// The site of a request on a connection without TLS (the plain-HTTP redirects): the one
    /// its authority names, else the default site.
    pub fn site_for_host(&self, host: Option<&str>) -> Option<usize> {
        self.inner.index.for_host(host)
    }

    /// The site one of whose names is `host` (exactly, or by a wildcard), never the default
    /// site: `None` for a host no site is named.
    pub fn site_named(&self, host: &str) -> Option<usize> {
        self.inner.index.named(host)
    }

    /// Whether the sites have names (`[[site]]`); false for the command line's one site,
    /// which answers every host.
    pub fn has_names(&self) -> bool {
        self.inner.index.has_names()
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

    /// Puts every backend's series in `r` ([`crate::proxy::pool::report`]).
    pub fn report_backends(&self, r: &mut ringmux_proto::WorkerReport) {
        crate::proxy::pool::report(self.inner.backends.iter(), r);
    }

    /// Whether any route proxies.
    pub fn proxies(&self) -> bool {
        !self.inner.upstreams.is_empty()
    }

    pub(crate) fn access_log(&self) -> Option<&Arc<AccessLog>> {
        self.inner.access_log.as_ref()
    }

    /// Begins the access-log line of `parts` from `client` over `protocol`, answered by `site`,
    /// if the worker logs.
    pub(crate) fn begin_log(
        &self,
        site: Option<usize>,
        client: SocketAddr,
        protocol: &'static str,
        parts: &http::request::Parts,
    ) -> Option<Logged> {
        let log = self.access_log()?;
        Some(Logged::begin(
            log,
            self.log_label(site),
            client,
            protocol,
            parts,
        ))
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

    /// What a `method` request for `uri` with `headers` from `client` gets, its site chosen as
    /// `choice`: refused by its route's limits (`crate::limits`), else [`Router::target`];
    /// with the rules its response goes through either way.
    pub(crate) fn target_for<'r: 'a, 'a>(
        &'r self,
        choice: Choice,
        method: &Method,
        headers: &HeaderMap,
        uri: &'a Uri,
        client: IpAddr,
    ) -> (Target<'a>, Applied<'r>) {
        let refused = self.refusal(choice, uri, client);
        let (target, rules) = self.target(choice, method, headers, uri);
        match refused {
            Some(refused) => (Target::reply(refused), rules),
            None => (target, rules),
        }
    }

    /// The refusal of a request for `uri` from `client` by the limits of its route (of its
    /// site, when no route takes it), if any.
    fn refusal(&self, choice: Choice, uri: &Uri, client: IpAddr) -> Option<Reply> {
        let Choice::Site(site) = choice else {
            return None;
        };
        let served = self.inner.sites.get(site)?;
        let gate = match served.route(uri.path()) {
            Ok(Some((routed, _))) => routed.gate.as_ref(),
            Ok(None) | Err(AmbiguousPath) => served.gate.as_ref(),
        }?;
        self.inner.gates.check(gate, client)
    }

    /// Requests refused by limits, in [`Refusal::ALL`] order.
    pub fn refused(&self) -> [u64; Refusal::ALL.len()] {
        self.inner.gates.refused()
    }

    /// What a `method` request for `uri` with `headers` gets, its site chosen as `choice`, and
    /// the rules of its site and route that its response goes through
    /// ([`crate::rules::Applied`]); a CORS preflight is answered here.
    pub(crate) fn target<'r: 'a, 'a>(
        &'r self,
        choice: Choice,
        method: &Method,
        headers: &HeaderMap,
        uri: &'a Uri,
    ) -> (Target<'a>, Applied<'r>) {
        let site = match choice {
            Choice::Site(site) => site,
            Choice::Misdirected => return (Target::reply(misdirected()), Applied::default()),
            Choice::NoHost => return (Target::reply(no_host()), Applied::default()),
            Choice::Redirect { site, port } => {
                let served = self.inner.sites.get(site);
                let home = served.and_then(|s| s.home.as_deref());
                let applied = served.map_or_else(Applied::default, |s| {
                    Applied::new(&s.rules, None, headers, true)
                });
                let reply = match home {
                    Some(home) => to_home(home, port, uri),
                    None => not_found(),
                };
                return (Target::reply(reply), applied);
            }
        };
        let Some(served) = self.inner.sites.get(site) else {
            return (Target::reply(not_found()), Applied::default());
        };
        let path = uri.path();
        let site_only = || Applied::new(&served.rules, None, headers, true);
        let (routed, rest) = match served.route(path) {
            Ok(Some(found)) => found,
            Ok(None) => return (Target::reply(not_found()), site_only()),
            Err(AmbiguousPath) => {
                let bad = Reply::text(StatusCode::BAD_REQUEST, b"bad path\n");
                return (Target::reply(bad), site_only());
            }
        };
        let fixed = matches!(routed.handler, Handler::Respond { .. });
        let applied = Applied::new(&served.rules, Some(&routed.rules), headers, !fixed)
            .on_route(&routed.prefix);
        if let Some(preflight) = applied.preflight(method, headers) {
            return (Target::reply(preflight), applied);
        }
        (self.handle(routed, method, path, rest, uri), applied)
    }

    /// What `routed` does with a `method` request for `uri` (`path` beneath its prefix:
    /// `rest`).
    fn handle<'a>(
        &'a self,
        routed: &'a Routed,
        method: &Method,
        path: &'a str,
        rest: &'a str,
        uri: &'a Uri,
    ) -> Target<'a> {
        let safe = method == Method::GET || method == Method::HEAD;
        match &routed.handler {
            Handler::Upstream {
                upstream,
                strip_prefix,
                compress,
            } => Target::Proxy {
                upstream,
                path: strip_prefix.then(|| stripped(rest, uri.query())).flatten(),
                compress: *compress,
            },
            Handler::Redirect { to, status } => Target::reply(redirect(to, *status, uri)),
            Handler::Respond {
                status,
                headers,
                body,
            } => Target::reply(Reply {
                status: *status,
                headers: headers.clone(),
                body: Body::Memory(body.clone()),
            }),
            Handler::Files(root) if safe => Target::Local(Local::Get(Lookup {
                root: Some(root),
                files_only: true,
                max_bytes: self.inner.max_bytes,
                path,
                rest,
                fallback: routed.rules.fallback.as_deref(),
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
                fallback: None,
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
        longest_prefix(&self.routes, |r| &r.prefix, path)
    }
}

/// Whether the last segment of `path` has no extension (a single-page app's route, not a
/// missing asset).
fn no_extension(path: &str) -> bool {
    !path.rsplit('/').next().unwrap_or(path).contains('.')
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

/// The 301 of a name that only redirects: `https://HOME[:PORT]` and the request's path and
/// query.
fn to_home(home: &str, port: Option<u16>, uri: &Uri) -> Reply {
    let path = uri.path_and_query().map_or("/", |p| p.as_str());
    let path = if path.starts_with('/') { path } else { "/" };
    let location = match port {
        Some(port) => format!("https://{home}:{port}{path}"),
        None => format!("https://{home}{path}"),
    };
    redirect(
        &location,
        StatusCode::MOVED_PERMANENTLY,
        &Uri::from_static("/"),
    )
}

/// The port of an authority (`host:port`, `[v6]:port`), if it names one.
fn port_of(authority: &str) -> Option<u16> {
    let (host, port) = authority.rsplit_once(':')?;
    if host.contains(':') && !host.ends_with(']') {
        return None; // a bare IPv6 address, no port
    }
    port.parse().ok()
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
        (Some(url), _) => Action::upstream(url.clone(), false),
        (None, Some(root)) => Action::Builtin {
            root: Some(root.to_path_buf()),
        },
        (None, None) => return table,
    };
    let routes = vec![Route {
        compress: None,
        path: "/".into(),
        action,
        rules: Default::default(),
        limits: Default::default(),
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
            compress: None,
            path: "/".into(),
            action: Action::Builtin { root: None },
            rules: Default::default(),
            limits: Default::default(),
        }])],
        default_site: Some(0),
    }
}

fn command_line_site(routes: Vec<Route>) -> table::Site {
    table::Site {
        label: COMMAND_LINE_LABEL.into(),
        names: Vec::new(),
        // The server never reads these: the worker library chooses certificates.
        cert_pem: String::new(),
        key_pem: String::new(),
        acme: false,
        routes,
        redirect_names: Vec::new(),
        compress: None,
        rules: Default::default(),
        limits: Default::default(),
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

impl SiteCounts {
    /// The row as a `STATS` report carries it: the classes, then the 421s
    /// (`ringmux_proto::message::SITE_COLUMNS`).
    pub fn report_row(&self) -> ringmux_proto::message::SiteRow {
        let mut row = ringmux_proto::message::SiteRow::default();
        let [classes @ .., misdirected] = &mut row;
        *classes = self.responses;
        *misdirected = self.misdirected;
        row
    }
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

/// One site answering every host, as the command line sets it up without a site table: what
/// each front (`h3::serve`, `tcp::serve`) serves when given one ([`Router::from`]), for tests
/// and programs embedding the server. The worker program serves a [`Router`] over its site table,
/// whose built-in and upstream routes answer as this describes.
///
/// * `GET`/`HEAD` of a regular file under `root` (if set; [`crate::files`]), with
///   `content-type` from the extension, `ETag`, `Last-Modified`, `Accept-Ranges` and the
///   configured `Cache-Control`; conditional requests (304, 412) and one byte range (206, 416)
///   per RFC 9110. A path ending in `/` serves that directory's `index.html`; a directory
///   named without the slash is redirected (301) to the path with it. Request paths are
///   percent-decoded one segment at a time; a segment that is `..` or decodes to something
///   holding `/`, NUL or a backslash, or to invalid UTF-8, is refused with 400. Symlinks are
///   followed only while they stay beneath `root` (relative targets; absolute ones are refused).
/// * Built-ins, when `root` has no file of that name: `/hello.txt` ([`HELLO_BODY`](crate::reply::HELLO_BODY)) and
///   `/bytes/N`: N bytes of [`fill_pattern`](crate::reply::fill_pattern), N ≤ `max_bytes` (400 otherwise).
/// * `POST /echo-len`: reads the whole request body and answers with its length in decimal.
/// * Any other method: 405 (after reading the request body).
#[derive(Debug, Clone)]
pub struct Site {
    pub root: Option<DocRoot>,
    pub max_bytes: u64,
    /// Proxy every request to this upstream instead ([`crate::proxy`]); `root` and the
    /// built-ins are then not used.
    pub upstream: Option<Arc<Upstream>>,
    /// One line per request, over TCP and HTTP/3 (`--access-log`).
    pub access_log: Option<Arc<AccessLog>>,
}

impl Default for Site {
    fn default() -> Self {
        Site {
            root: None,
            max_bytes: reply::DEFAULT_MAX_BYTES,
            upstream: None,
            access_log: None,
        }
    }
}

/// One site answering every host, as [`Site`] describes it: the built-in routes
/// (files from its root, then the built-ins) or its upstream.
impl From<&Site> for Router {
    fn from(site: &Site) -> Router {
        let backend = site
            .upstream
            .as_ref()
            .map(|u| Arc::new(Backend::new(u.clone())));
        let handler = match &backend {
            Some(backend) => Handler::Upstream {
                upstream: Arc::new(Pool::new(
                    vec![backend.clone()],
                    Default::default(),
                    Default::default(),
                )),
                strip_prefix: false,
                compress: true,
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
                        rules: RouteRules::default(),
                        gate: None,
                    }],
                    home: None,
                    redirect_names: Vec::new(),
                    rules: Default::default(),
                    gate: None,
                }],
                index: SiteIndex::new(&command_line_table()),
                max_bytes: site.max_bytes,
                access_log: site.access_log.clone(),
                upstreams: site.upstream.iter().cloned().collect(),
                backends: backend.into_iter().collect(),
                roots: site.root.iter().cloned().collect(),
                log_sites: false,
                no_site: Arc::from(NO_SITE),
                gates: Gates::default(),
            }),
        }
    }
}

impl From<Arc<Site>> for Router {
    fn from(site: Arc<Site>) -> Router {
        Router::from(&*site)
    }
}

impl From<Site> for Router {
    fn from(site: Site) -> Router {
        Router::from(&site)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn route(path: &str, action: Action) -> Route {
        Route {
            compress: None,
            path: path.into(),
            action,
            rules: Default::default(),
            limits: Default::default(),
        }
    }

    fn respond(body: &str) -> Action {
        respond_with(200, body)
    }

    fn respond_with(status: u16, body: &str) -> Action {
        Action::Respond(ringmux_proto::route::Respond::new(status, body).unwrap())
    }

    fn upstream(url: &str, strip_prefix: bool) -> Action {
        Action::upstream(url.parse().unwrap(), strip_prefix)
    }

    fn redirect(to: &str, status: u16) -> Action {
        Action::Redirect {
            to: to.to_string().try_into().unwrap(),
            status: status.try_into().unwrap(),
        }
    }

    fn site(label: &str, names: &[&str], routes: Vec<Route>) -> table::Site {
        table::Site {
            label: label.into(),
            names: names.iter().map(|n| n.to_string()).collect(),
            cert_pem: String::new(),
            key_pem: String::new(),
            acme: false,
            redirect_names: Vec::new(),
            compress: None,
            rules: Default::default(),
            routes,
            limits: Default::default(),
        }
    }

    /// Two named sites (one with a wildcard) and, if `default`, the second as default.
    fn table(default: Option<usize>) -> SiteTable {
        SiteTable {
            sites: vec![
                site(
                    "a.test",
                    &["a.test"],
                    vec![
                        route("/", respond("root")),
                        route("/api", respond("api")),
                        route("/api/v2/", respond("v2")),
                        route("/admin", respond_with(403, "no\n")),
                        route("/old", redirect("https://n.test{path}?{query}", 308)),
                        route("/up", upstream("http://127.0.0.1:9", true)),
                        route("/up-whole", upstream("http://127.0.0.1:9", false)),
                    ],
                ),
                site(
                    "b.test",
                    &["b.test", "*.w.test"],
                    vec![route("/x", respond("x"))],
                ),
            ],
            default_site: default,
        }
    }

    fn router(t: &SiteTable) -> Router {
        Router::new(t, &RouterOptions::default()).expect("a router")
    }

    fn uri(s: &str) -> Uri {
        s.parse().unwrap()
    }

    /// What `GET path` on site 0 gets, in short: the reply's status and body, the proxy's path.
    fn at(r: &Router, method: Method, path: &str) -> String {
        let u = uri(path);
        match r.target(Choice::Site(0), &method, &HeaderMap::new(), &u).0 {
            Target::Proxy { upstream, path, .. } => format!(
                "proxy {} {}",
                upstream.first().authority(),
                path.as_ref().map_or("-", |p| p.as_str())
            ),
            Target::Local(Local::Reply(reply)) => {
                let body = match reply.body {
                    Body::Memory(b) => String::from_utf8_lossy(&b).into_owned(),
                    Body::Static(b) => String::from_utf8_lossy(b).into_owned(),
                    Body::Empty => String::new(),
                    _ => "?".into(),
                };
                let location = reply
                    .headers
                    .get(header::LOCATION)
                    .map(|l| format!(" -> {}", l.to_str().unwrap()))
                    .unwrap_or_default();
                format!("{} {}{location}", reply.status.as_u16(), body.trim_end())
            }
            Target::Local(Local::Get(l)) => format!("get {} {}", l.path, l.rest),
            Target::Local(Local::EchoLen) => "echo-len".into(),
        }
    }

    #[test]
    fn the_longest_prefix_wins_across_route_kinds() {
        let r = router(&table(None));
        for (path, want) in [
            ("/", "200 root"),
            ("/apix", "200 root"),
            ("/api", "200 api"),
            ("/api/", "200 api"),
            ("/api/v1", "200 api"),
            ("/api/v2", "200 v2"),
            ("/api/v2/z", "200 v2"),
            ("/admin/x", "403 no"),
            ("/old/p", "308  -> https://n.test/old/p"),
            ("/up/x", "proxy 127.0.0.1:9 /x"),
            ("/up-whole/x?q=1", "proxy 127.0.0.1:9 -"),
        ] {
            assert_eq!(at(&r, Method::GET, path), want, "{path}");
        }
        // Fixed responses and redirects answer any method.
        assert_eq!(at(&r, Method::DELETE, "/admin"), "403 no");
        assert_eq!(at(&r, Method::POST, "/api/v2/"), "200 v2");
        // No route: 404.
        let b = Router::new(&table(None), &RouterOptions::default()).unwrap();
        let u = uri("/y");
        assert!(matches!(
            b.target(Choice::Site(1), &Method::GET, &HeaderMap::new(), &u)
                .0,
            Target::Local(Local::Reply(Reply {
                status: StatusCode::NOT_FOUND,
                ..
            }))
        ));
    }

    /// The opened routes choose as [`Site::route`] does on the table's.
    #[test]
    fn the_router_chooses_as_the_table_does() {
        let t = table(None);
        let r = router(&t);
        for path in [
            "/",
            "/a",
            "/api",
            "/api/",
            "/api/v2",
            "/api/v2/",
            "/api/v2/x",
            "/apix",
            "/admin",
            "/adminx",
            "/old/",
            "/up",
            "/up/x",
            "/up-whole",
            "/up-whole/y",
            "/upx",
        ] {
            let want = t.sites[0]
                .route(path)
                .map(|(r, rest)| (r.path.clone(), rest));
            let got = r.inner.sites[0]
                .route(path)
                .unwrap()
                .map(|(r, rest)| (r.prefix.clone(), rest));
            assert_eq!(got, want, "{path}");
        }
    }

    /// A fixed response carries the route's header fields; its `content-type` replaces the
    /// default one, and the length is the body's.
    #[test]
    fn a_fixed_response_carries_its_header_fields() {
        let mut respond = ringmux_proto::route::Respond::new(201, "{}").unwrap();
        respond.headers = [("x-a", "b"), ("Content-Type", "application/json")]
            .map(|(n, v)| (n.to_string(), v.to_string()))
            .into_iter()
            .collect::<std::collections::BTreeMap<_, _>>()
            .try_into()
            .unwrap();
        let t = SiteTable {
            sites: vec![site(
                "s",
                &["s.test"],
                vec![route("/", Action::Respond(respond))],
            )],
            default_site: None,
        };
        let r = router(&t);
        let u = uri("/");
        let Target::Local(Local::Reply(reply)) = r
            .target(Choice::Site(0), &Method::GET, &HeaderMap::new(), &u)
            .0
        else {
            panic!("a fixed response is a reply");
        };
        let h = |n: &str| {
            reply
                .headers
                .get(n)
                .map(|v| v.to_str().unwrap().to_string())
        };
        assert_eq!(reply.status, StatusCode::CREATED);
        assert_eq!(h("x-a").as_deref(), Some("b"));
        assert_eq!(h("content-type").as_deref(), Some("application/json"));
        assert_eq!(h("content-length").as_deref(), Some("2"));
        assert_eq!(reply.headers.len(), 3);
    }

    #[test]
    fn strip_prefix_passes_the_rest_and_the_query() {
        let r = router(&table(None));
        assert_eq!(at(&r, Method::GET, "/up/x?q=1"), "proxy 127.0.0.1:9 /x?q=1");
        assert_eq!(at(&r, Method::POST, "/up"), "proxy 127.0.0.1:9 /");
        assert_eq!(at(&r, Method::GET, "/up?q=1"), "proxy 127.0.0.1:9 /?q=1");
        assert_eq!(at(&r, Method::GET, "/up/"), "proxy 127.0.0.1:9 /");
        assert_eq!(at(&r, Method::GET, "/up/a/b/"), "proxy 127.0.0.1:9 /a/b/");
    }

    #[test]
    fn redirects_fill_in_path_and_query() {
        let r = router(&table(None));
        assert_eq!(
            at(&r, Method::GET, "/old/a?x=1&y=2"),
            "308  -> https://n.test/old/a?x=1&y=2"
        );
        // No query: the `?` left at the end goes.
        assert_eq!(at(&r, Method::GET, "/old"), "308  -> https://n.test/old");
        assert_eq!(at(&r, Method::PUT, "/old/"), "308  -> https://n.test/old/");
    }

    #[test]
    fn an_escape_that_would_choose_another_route_is_refused() {
        let r = router(&table(None));
        for path in [
            "/%61dmin",    // decodes to /admin, sent as a path of "/"
            "//admin",     // an empty segment dropped
            "/x/../admin", // a dot segment resolved
            "/./admin",
            "/api/%2e%2e/admin",
            "/a/%2E%2E/admin",
            "/../admin", // above the root
        ] {
            assert_eq!(at(&r, Method::GET, path), "400 bad path", "{path}");
        }
        // Escapes that keep the route are served.
        assert_eq!(at(&r, Method::GET, "/api/a%20b"), "200 api");
        assert_eq!(at(&r, Method::GET, "/api/x/../y"), "200 api");
        assert_eq!(
            at(&r, Method::GET, "/up/group%2Fproject"),
            "proxy 127.0.0.1:9 /group%2Fproject"
        );
        // One route only: nothing to confuse, the path goes on as sent (today's proxy).
        let one = router(&with_command_line(
            command_line_table(),
            None,
            Some(&"http://127.0.0.1:9".parse().unwrap()),
        ));
        assert_eq!(at(&one, Method::GET, "/../x"), "proxy 127.0.0.1:9 -");
        assert_eq!(decoded_path("/a/./b//c/../d/").as_deref(), Some("/a/b/d/"));
        assert_eq!(decoded_path("/a/..").as_deref(), Some("/"));
        assert_eq!(decoded_path("/%zz%2").as_deref(), Some("/%zz%2"));
    }

    #[test]
    fn builtin_and_file_routes_are_lookups_beneath_their_prefix() {
        let tmp = ringmux_testkit::temp_dir("ringmux-sites-lookup");
        let t = SiteTable {
            sites: vec![site(
                "s",
                &[],
                vec![
                    route("/", Action::Builtin { root: None }),
                    route(
                        "/static/",
                        Action::Files {
                            root: tmp.path().into(),
                        },
                    ),
                ],
            )],
            default_site: Some(0),
        };
        let r = router(&t);
        assert_eq!(
            at(&r, Method::GET, "/hello.txt"),
            "get /hello.txt /hello.txt"
        );
        assert_eq!(
            at(&r, Method::HEAD, "/static/a.css"),
            "get /static/a.css /a.css"
        );
        assert_eq!(at(&r, Method::GET, "/static"), "get /static ");
        assert_eq!(at(&r, Method::POST, "/echo-len"), "echo-len");
        assert_eq!(
            at(&r, Method::POST, "/static/echo-len"),
            "405 method not allowed"
        );
        assert_eq!(at(&r, Method::PUT, "/x"), "405 method not allowed");
        let u = uri("/static/a");
        let Target::Local(Local::Reply(reply)) = r
            .target(Choice::Site(0), &Method::PUT, &HeaderMap::new(), &u)
            .0
        else {
            panic!("a reply");
        };
        assert_eq!(reply.headers[header::ALLOW], "GET, HEAD");
    }

    fn parts(version: http::Version, uri: &str, hosts: &[&str]) -> http::request::Parts {
        let mut b = http::Request::builder().version(version).uri(uri);
        for h in hosts {
            b = b.header(header::HOST, *h);
        }
        b.body(()).unwrap().into_parts().0
    }

    /// A site's names that only redirect get a 301 to its first name, the path, the query and
    /// a port other than 443 kept, on every transport's request form; its other names are
    /// served as before.
    #[test]
    fn names_that_only_redirect_go_to_the_first_name() {
        use http::Version;
        let mut t = table(None);
        t.sites[0].names.push("www.a.test".into());
        t.sites[0].redirect_names.push("www.a.test".into());
        let r = router(&t);
        let a = r.connection_site(Some("www.a.test"));
        assert_eq!(a, Some(0), "the redirect name has the site's certificate");
        let h2 = |authority: &str| {
            parts(
                Version::HTTP_2,
                &format!("https://{authority}/p/q?x=1&y"),
                &[],
            )
        };
        let h1 = |host: &str| parts(Version::HTTP_11, "/p/q?x=1&y", &[host]);
        for (req, http11, port) in [
            (h2("www.a.test"), false, None),
            (h2("WWW.A.TEST.:443"), false, None),
            (h2("www.a.test:8443"), false, Some(8443)),
            (h1("www.a.test:8443"), true, Some(8443)),
        ] {
            let choice = r.choose(a, &req, http11);
            assert_eq!(choice, Choice::Redirect { site: 0, port }, "{:?}", req.uri);
            assert_eq!(choice.answering(a), Some(0));
            let Target::Local(Local::Reply(reply)) = r
                .target(choice, &Method::GET, &HeaderMap::new(), &req.uri)
                .0
            else {
                panic!("a redirect is a reply");
            };
            assert_eq!(reply.status, StatusCode::MOVED_PERMANENTLY);
            let want = match port {
                Some(p) => format!("https://a.test:{p}/p/q?x=1&y"),
                None => "https://a.test/p/q?x=1&y".to_string(),
            };
            assert_eq!(reply.headers[header::LOCATION], want.as_str());
        }
        // The first name is served, on the same connection too.
        assert_eq!(r.choose(a, &h2("a.test"), false), Choice::Site(0));
    }

    #[test]
    fn a_request_for_another_sites_host_is_misdirected() {
        use http::Version;
        let r = router(&table(None));
        let a = r.connection_site(Some("a.test"));
        assert_eq!(a, Some(0));
        let h2 = |authority: &str| parts(Version::HTTP_2, &format!("https://{authority}/"), &[]);
        assert_eq!(r.choose(a, &h2("a.test"), false), Choice::Site(0));
        assert_eq!(r.choose(a, &h2("A.TEST:443"), false), Choice::Site(0));
        assert_eq!(r.choose(a, &h2("b.test"), false), Choice::Misdirected);
        assert_eq!(r.choose(a, &h2("q.w.test"), false), Choice::Misdirected);
        assert_eq!(
            r.choose(a, &h2("c.test"), false),
            Choice::Misdirected,
            "no site, no default"
        );
        // The wildcard's connection serves its names.
        let w = r.connection_site(Some("q.w.test"));
        assert_eq!(w, Some(1));
        assert_eq!(r.choose(w, &h2("b.test"), false), Choice::Site(1));
        assert_eq!(r.choose(w, &h2("a.test"), false), Choice::Misdirected);
        // No authority and no host (h2, h3): the connection's site.
        let bare = parts(Version::HTTP_2, "/", &[]);
        assert_eq!(r.choose(a, &bare, false), Choice::Site(0));
        assert_eq!(r.choose(None, &bare, false), Choice::Misdirected);
        // HTTP/1.1 needs one host.
        let h1 = |hosts: &[&str]| parts(Version::HTTP_11, "/", hosts);
        assert_eq!(r.choose(a, &h1(&[]), true), Choice::NoHost);
        assert_eq!(
            r.choose(a, &h1(&["a.test", "a.test"]), true),
            Choice::NoHost
        );
        assert_eq!(r.choose(a, &h1(&["a.test"]), true), Choice::Site(0));
        assert_eq!(r.choose(a, &h1(&["b.test"]), true), Choice::Misdirected);
        // HTTP/1.0 may go without.
        assert_eq!(
            r.choose(a, &parts(Version::HTTP_10, "/", &[]), true),
            Choice::Site(0)
        );
        // With a default site, an unknown name is the default's.
        let d = router(&table(Some(1)));
        let none = d.connection_site(None);
        assert_eq!(none, Some(1));
        assert_eq!(d.choose(none, &h2("c.test"), false), Choice::Site(1));
        assert_eq!(d.choose(none, &h2("192.0.2.1:443"), false), Choice::Site(1));
        assert_eq!(d.choose(none, &h2("a.test"), false), Choice::Misdirected);
        assert_eq!(Choice::Misdirected.answering(Some(1)), Some(1));
    }

    #[test]
    fn the_command_line_site_answers_every_host() {
        let r = router(&command_line_table());
        for sni in [None, Some("a.test"), Some("localhost"), Some("127.0.0.1")] {
            let conn = r.connection_site(sni);
            assert_eq!(conn, Some(0), "{sni:?}");
            for authority in ["x.test", "localhost:4433", "[::1]:443"] {
                let p = parts(http::Version::HTTP_2, &format!("https://{authority}/"), &[]);
                assert_eq!(r.choose(conn, &p, false), Choice::Site(0), "{authority}");
            }
        }
        assert_eq!(r.log_label(Some(0)).as_deref(), Some("default"));
        assert_eq!(router(&table(None)).log_label(None).as_deref(), Some("-"));
        assert_eq!(
            router(&table(None)).log_label(Some(1)).as_deref(),
            Some("b.test")
        );
    }

    #[test]
    fn the_workers_own_root_or_upstream_sets_the_command_line_site() {
        let url: UpstreamUrl = "http://127.0.0.1:8080".parse().unwrap();
        let dir = std::path::Path::new("/srv/www");
        // Without either: the table as it is.
        assert_eq!(with_command_line(table(None), None, None), table(None));
        // The command line's site gets the route, replacing its own.
        let mut t = table(None);
        t.sites
            .push(site("default", &[], vec![route("/x", respond("x"))]));
        let t = with_command_line(t, Some(dir), None);
        assert_eq!(t.sites.len(), 3);
        assert_eq!(
            t.sites[2].routes,
            vec![route(
                "/",
                Action::Builtin {
                    root: Some(dir.into())
                }
            )]
        );
        assert_eq!(t.default_site, None, "left as it was");
        // No such site: one is made, the default.
        let t = with_command_line(table(Some(0)), None, Some(&url));
        assert_eq!(t.sites.len(), 3);
        assert_eq!(t.default_site, Some(2));
        assert!(t.sites[2].names.is_empty());
        assert_eq!(
            t.sites[2].routes,
            vec![route("/", upstream("http://127.0.0.1:8080", false))]
        );
    }

    #[test]
    fn a_route_that_cannot_be_served_fails_the_start_naming_site_and_route() {
        let bad = |action: Action| {
            let t = SiteTable {
                sites: vec![site(
                    "shop",
                    &["shop.test"],
                    vec![route("/", respond("ok")), route("/bad", action)],
                )],
                default_site: None,
            };
            Router::new(&t, &RouterOptions::default())
                .unwrap_err()
                .to_string()
        };
        for (action, says) in [
            (
                Action::Files {
                    root: "/nonexistent/ringmux".into(),
                },
                "/nonexistent/ringmux",
            ),
            (
                Action::Builtin {
                    root: Some("/nonexistent/r2".into()),
                },
                "/nonexistent/r2",
            ),
            (respond_with(204, "x"), "a 204 response has no body"),
        ] {
            let e = bad(action);
            assert!(e.contains("site \"shop\", route \"/bad\""), "{e}");
            assert!(e.contains(says), "{e}");
        }
    }

    #[test]
    fn roots_and_upstreams_are_opened_once() {
        let tmp = ringmux_testkit::temp_dir("ringmux-sites-once");
        let files = || Action::Files {
            root: tmp.path().into(),
        };
        let up = || upstream("http://127.0.0.1:9", false);
        let t = SiteTable {
            sites: (0..3)
                .map(|i| {
                    let name = format!("s{i}.test");
                    site(
                        &name,
                        &[&name],
                        vec![route("/", files()), route("/a", up()), route("/b", files())],
                    )
                })
                .collect(),
            default_site: None,
        };
        let r = router(&t);
        assert_eq!((r.inner.roots.len(), r.inner.upstreams.len()), (1, 1));
        assert!(r.proxies());
    }

    #[test]
    fn responses_are_counted_per_site_and_class() {
        let r = router(&table(None));
        let stats = SiteStats::default();
        stats.count(Some(0), StatusCode::OK);
        stats.init(&r);
        for (site, status) in [
            (Some(0), StatusCode::OK),
            (Some(0), StatusCode::MISDIRECTED_REQUEST),
            (Some(1), StatusCode::BAD_GATEWAY),
            (Some(1), StatusCode::SWITCHING_PROTOCOLS),
            (None, StatusCode::MISDIRECTED_REQUEST),
            (Some(9), StatusCode::NOT_FOUND),
        ] {
            stats.count(site, status);
        }
        let rows = stats.snapshot();
        let row = |label: &str, responses, misdirected| SiteCounts {
            label: label.into(),
            responses,
            misdirected,
        };
        assert_eq!(
            rows,
            [
                row("a.test", [0, 1, 0, 1, 0], 1),
                row("b.test", [1, 0, 0, 0, 1], 0),
                row("-", [0, 0, 0, 2, 0], 1),
            ]
        );
        assert_eq!(rows[0].report_row(), [0, 1, 0, 1, 0, 1]);
    }
}
