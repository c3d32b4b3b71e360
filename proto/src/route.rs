//! What a route does, declared once: every kind of action ([`Action`]), each value of it a type
//! that refuses a bad input when it is deserialised (a redirect status other than 301, 302,
//! 307 or 308, a response status out of 200–599, a body too long, a header a response must not
//! carry), and [`Action::check`] for what needs more than one value. The limits are here and
//! nowhere else.
//!
//! The same declaration serves both sides. The demux reads a `[[site.route]]` of the
//! configuration file into a [`FileRoute`] (the keys as the file writes them) and makes it a
//! [`Route`] ([`Route::try_from`]); the worker reads the site table's JSON into the same types,
//! so a value the demux would refuse never reaches a server either. Checks that need the file
//! system (a root exists, the workers can read it) are the demux's; this module never touches
//! a file.
//!
//! The JSON of a route is `{"path": "/x", "action": {"KIND": {...}}}`, each value as a string
//! or a number; a field added to a kind is left out when it has its default, so a table
//! without it reads the same in a build before it (`ringmux upgrade` hands the table from one
//! build to the next and back).

use std::collections::BTreeMap;
use std::ops::RangeInclusive;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::header_field::{FieldTable, HeaderFieldError};
use crate::limits::{Burst, Cidr, FileLimits, LimitError, Limits, PrefixV4, PrefixV6, Rate};
use crate::rules::{Fallback, HeaderRules, RouteRules};
use crate::UpstreamUrl;

mod health;
mod pool;

pub use health::{ActiveHealth, HealthError};
pub use pool::{
    Backends, Balance, Balancing, BodyLimit, HealthSeconds, PassiveHealth, Retries, HEALTH_SECONDS,
    MAX_BACKENDS, MAX_FAILS, MAX_RETRIES,
};

/// The statuses a redirect may answer with (RFC 9110 §15.4): moved for good (301, 308) or for
/// now (302, 307).
pub const REDIRECT_STATUSES: [u16; 4] = [301, 302, 307, 308];

/// What a redirect answers when its route gives no status: 302, temporary (as Caddy's
/// `redir`), so a mistake is not cached by browsers for good.
pub const DEFAULT_REDIRECT_STATUS: u16 = 302;

/// The statuses a fixed response may have: a success, a redirect without its target, or an
/// error; never 1xx, which is no final answer.
pub const RESPOND_STATUSES: RangeInclusive<u16> = 200..=599;

/// The largest body of a fixed response, in bytes: every worker holds each in memory.
pub const MAX_RESPOND_BODY: usize = 64 * 1024;

/// The most header fields a fixed response may add.
pub const MAX_RESPOND_HEADERS: usize = 32;

/// A path prefix and what requests under it get.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Route {
    /// Starts with `/`. It matches a request path equal to it or continuing it after a `/`
    /// (`/api` matches `/api` and `/api/v1`, not `/apix`); `/` matches every path.
    pub path: String,
    pub action: Action,
    /// `compress = false`: its responses go as they are, never coded with gzip, brotli or
    /// zstd; `None`: as its site says (on by default). Meaningful for files and upstreams.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compress: Option<bool>,
    /// Header rules and a file route's fallback (`crate::rules`).
    #[serde(default, skip_serializing_if = "RouteRules::is_empty")]
    pub rules: RouteRules,
    /// Who may ask and how often: replaces the site's, key by key ([`Limits::over`]).
    #[serde(default, skip_serializing_if = "Limits::is_none")]
    pub limits: Limits,
}

/// What a route does.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum Action {
    /// Static files beneath `root`, the request path taken from the route's prefix on (a
    /// route `/static` with `root = "/srv/s"` serves `/static/a.css` from `/srv/s/a.css`).
    Files { root: PathBuf },
    /// The built-in server as the command line sets it up without a configuration file:
    /// files from `root` when set, else (and for names with no file) `/hello.txt` and
    /// `/bytes/N`.
    Builtin { root: Option<PathBuf> },
    /// The reverse proxy to an HTTP service, one backend or several; with `strip_prefix`,
    /// the route's prefix is taken off the path passed on. `balancing` says how requests are
    /// shared among the backends, `max_body` the largest request body passed on; over TLS,
    /// each backend is verified as `tls` says.
    Upstream {
        url: Backends,
        strip_prefix: bool,
        #[serde(default, skip_serializing_if = "Balancing::is_default")]
        balancing: Balancing,
        #[serde(default, skip_serializing_if = "BodyLimit::is_none")]
        max_body: BodyLimit,
        #[serde(default, skip_serializing_if = "UpstreamTls::is_default")]
        tls: UpstreamTls,
        /// The active health check of its backends (`health`), run by the demux.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        health: Option<ActiveHealth>,
    },
    /// A redirect to `to` with `status`, in which `{path}` stands for the request's path and
    /// `{query}` for its query (without the `?`).
    Redirect {
        to: RedirectTarget,
        status: RedirectStatus,
    },
    /// A fixed response.
    Respond(Respond),
}

impl Action {
    /// A proxy to the one backend `url`, every other setting at its default.
    pub fn upstream(url: UpstreamUrl, strip_prefix: bool) -> Action {
        Action::Upstream {
            url: Backends::one(url),
            strip_prefix,
            balancing: Balancing::default(),
            max_body: BodyLimit::default(),
            tls: UpstreamTls::default(),
            health: None,
        }
    }

    /// What no single value can say alone: a 204 or 304 response has no body (RFC 9110
    /// §15.3.5, §15.4.5).
    pub fn check(&self) -> Result<(), RouteError> {
        match self {
            Action::Respond(r) if matches!(r.status.get(), 204 | 304) && !r.body.is_empty() => {
                Err(RouteError::BodyNotAllowed(r.status.get()))
            }
            Action::Upstream { url, tls, .. } if !tls.is_default() => {
                match url.urls().iter().find(|u| !u.scheme.tls()) {
                    Some(clear) => Err(RouteError::TlsInTheClear(clear.to_string())),
                    None => Ok(()),
                }
            }
            Action::Files { .. }
            | Action::Builtin { .. }
            | Action::Upstream { .. }
            | Action::Redirect { .. }
            | Action::Respond(_) => Ok(()),
        }
    }
}

/// A fixed response: `respond = { status = 200, body = "ok\n", headers = { "x-a" = "b" } }`.
/// The body goes as `text/plain; charset=utf-8` unless `headers` names a `content-type`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Respond {
    /// 200 when not given.
    #[serde(default)]
    pub status: RespondStatus,
    #[serde(default)]
    pub body: RespondBody,
    /// Header fields the response carries besides its own.
    #[serde(default, skip_serializing_if = "ResponseHeaders::is_empty")]
    pub headers: ResponseHeaders,
}

impl Respond {
    /// A response of `status` with `body` and no header field of its own.
    pub fn new(status: u16, body: &str) -> Result<Respond, ValueError> {
        Ok(Respond {
            status: RespondStatus::try_from(status)?,
            body: RespondBody::try_from(body.to_string())?,
            headers: ResponseHeaders::default(),
        })
    }
}

/// A `[[site.route]]` as the configuration file writes it: the path and one action's keys
/// (`root`; `upstream` with `strip_prefix`, `lb`, `retries`, `max_fails`, `fail_window`,
/// `eject_for`, `max_body` and `health`; `redirect` and `status`; `respond`). The keys the file takes
/// are this struct's fields.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileRoute {
    pub path: Option<String>,
    pub root: Option<PathBuf>,
    pub upstream: Option<Backends>,
    pub strip_prefix: Option<bool>,
    pub lb: Option<Balance>,
    pub retries: Option<Retries>,
    pub max_fails: Option<u32>,
    pub fail_window: Option<HealthSeconds>,
    pub eject_for: Option<HealthSeconds>,
    pub max_body: Option<BodyLimit>,
    /// The active health check of the backends: `health = { path = "/healthz", interval = 5,
    /// timeout = 2 }` ([`ActiveHealth`]).
    pub health: Option<ActiveHealth>,
    /// A PEM file of the certificates a TLS upstream is verified against instead of the
    /// system's roots. The demux reads it and puts its text in [`UpstreamTls::roots_pem`]
    /// ([`Route::try_from`] leaves that to it: this module never touches a file).
    pub upstream_ca: Option<PathBuf>,
    /// The name a TLS upstream is asked for and verified against, instead of its URL's host.
    pub upstream_sni: Option<UpstreamSni>,
    pub redirect: Option<RedirectTarget>,
    pub status: Option<RedirectStatus>,
    pub respond: Option<Respond>,
    pub compress: Option<bool>,
    /// Header rules of the route's responses, after the site's (`crate::rules`).
    pub headers: Option<HeaderRules>,
    /// Header rules of the request an upstream route passes on.
    pub request_headers: Option<HeaderRules>,
    /// A `root` route's single-page-app fallback, beneath the root.
    pub fallback: Option<Fallback>,
    /// The route's limits (`crate::limits::FILE_KEYS`), as a `[[site]]` writes them too.
    pub allow: Option<Vec<Cidr>>,
    pub deny: Option<Vec<Cidr>>,
    pub rate: Option<Rate>,
    pub burst: Option<Burst>,
    pub rate_prefix_v4: Option<PrefixV4>,
    pub rate_prefix_v6: Option<PrefixV6>,
}

impl TryFrom<FileRoute> for Route {
    type Error = RouteError;

    fn try_from(f: FileRoute) -> Result<Route, RouteError> {
        let path = f.path.ok_or(RouteError::NoPath)?;
        let kinds = [
            f.root.is_some(),
            f.upstream.is_some(),
            f.redirect.is_some(),
            f.respond.is_some(),
        ];
        if kinds.iter().filter(|k| **k).count() != 1 {
            return Err(RouteError::Actions);
        }
        if f.upstream.is_none() {
            let upstream_keys = [
                ("strip_prefix", f.strip_prefix.is_some()),
                ("lb", f.lb.is_some()),
                ("retries", f.retries.is_some()),
                ("max_fails", f.max_fails.is_some()),
                ("fail_window", f.fail_window.is_some()),
                ("eject_for", f.eject_for.is_some()),
                ("max_body", f.max_body.is_some()),
                ("health", f.health.is_some()),
            ];
            if let Some((key, _)) = upstream_keys.iter().find(|(_, given)| *given) {
                return Err(RouteError::UpstreamKeyAlone(key));
            }
        }
        for (given, key) in [
            (f.upstream_ca.is_some(), "upstream_ca"),
            (f.upstream_sni.is_some(), "upstream_sni"),
        ] {
            let clear = |b: &Backends| b.urls().iter().find(|u| !u.scheme.tls()).cloned();
            match &f.upstream {
                _ if !given => {}
                None => return Err(RouteError::UpstreamKeyAlone(key)),
                Some(backends) => {
                    if let Some(url) = clear(backends) {
                        return Err(RouteError::UpstreamKeyInTheClear {
                            key,
                            url: url.to_string(),
                        });
                    }
                }
            }
        }
        if f.status.is_some() && f.redirect.is_none() {
            return Err(RouteError::StatusAlone);
        }
        if f.request_headers.is_some() && f.upstream.is_none() {
            return Err(RouteError::RequestHeadersAlone);
        }
        if f.fallback.is_some() && f.root.is_none() {
            return Err(RouteError::FallbackAlone);
        }
        let rules = RouteRules {
            headers: f.headers.unwrap_or_default(),
            request_headers: f.request_headers.unwrap_or_default(),
            fallback: f.fallback,
        };
        let action = if let Some(root) = f.root {
            Action::Files { root }
        } else if let Some(url) = f.upstream {
            let default = PassiveHealth::default();
            let passive = PassiveHealth {
                max_fails: f.max_fails.unwrap_or(default.max_fails),
                fail_window: f.fail_window.unwrap_or(default.fail_window),
                eject_for: f.eject_for.unwrap_or(default.eject_for),
            };
            passive.check().map_err(RouteError::MaxFails)?;
            Action::Upstream {
                url,
                strip_prefix: f.strip_prefix.unwrap_or(false),
                balancing: Balancing {
                    lb: f.lb.unwrap_or_default(),
                    retries: f.retries.unwrap_or_default(),
                    passive,
                },
                max_body: f.max_body.unwrap_or_default(),
                tls: UpstreamTls {
                    roots_pem: String::new(),
                    sni: f.upstream_sni,
                },
                health: f.health,
            }
        } else if let Some(to) = f.redirect {
            Action::Redirect {
                to,
                status: f.status.unwrap_or_default(),
            }
        } else {
            Action::Respond(f.respond.ok_or(RouteError::Actions)?)
        };
        let limits = Limits::try_from(FileLimits {
            allow: f.allow,
            deny: f.deny,
            rate: f.rate,
            burst: f.burst,
            rate_prefix_v4: f.rate_prefix_v4,
            rate_prefix_v6: f.rate_prefix_v6,
        })?;
        let route = Route {
            path,
            action,
            compress: f.compress,
            rules,
            limits,
        };
        route.check()?;
        Ok(route)
    }
}

impl Route {
    /// The route whole: its path a prefix (starting with `/`, no query nor fragment) and
    /// [`Action::check`].
    pub fn check(&self) -> Result<(), RouteError> {
        if !self.path.starts_with('/') || self.path.contains(['?', '#']) {
            return Err(RouteError::Path(self.path.clone()));
        }
        if !self.rules.request_headers.is_empty() && !matches!(self.action, Action::Upstream { .. })
        {
            return Err(RouteError::RequestHeadersAlone);
        }
        if self.rules.fallback.is_some() && !matches!(self.action, Action::Files { .. }) {
            return Err(RouteError::FallbackAlone);
        }
        self.limits.check()?;
        self.action.check()
    }
}

/// A route that cannot be, as a whole; [`RouteError::key`] names the key it is about.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RouteError {
    #[error("a [[site.route]] needs path = \"/PREFIX\"")]
    NoPath,
    #[error("path {0:?}: expected a path prefix starting with /, e.g. \"/api\"")]
    Path(String),
    #[error(
        "a [[site.route]] takes one action: root = DIR, upstream = URL, redirect = URL, or \
         respond = {{ status = N, body = \"...\" }}"
    )]
    Actions,
    #[error("{0} goes with upstream only")]
    UpstreamKeyAlone(&'static str),
    #[error("max_fails: {0}")]
    MaxFails(ValueError),
    #[error(
        "status goes with redirect (respond takes its own: respond = {{ status = N, body = \
         \"...\" }})"
    )]
    StatusAlone,
    #[error("a {0} response has no body: drop body, or give another status")]
    BodyNotAllowed(u16),
    #[error(
        "{key} goes with a TLS upstream (https:// or h2://), and upstream = {url:?} is in the \
         clear"
    )]
    UpstreamKeyInTheClear { key: &'static str, url: String },
    #[error(
        "upstream = {0:?} is in the clear: it has no certificates to verify nor a server name"
    )]
    TlsInTheClear(String),
    #[error("request_headers goes with upstream only: only a proxied request goes further")]
    RequestHeadersAlone,
    #[error("fallback goes with root only: it names a file beneath the route's root")]
    FallbackAlone,
    #[error(transparent)]
    Limit(#[from] LimitError),
}

impl RouteError {
    /// The key of a [`FileRoute`] (dotted inside a table: `respond.body`) whose value is
    /// wrong; `None` for the route as a whole.
    pub fn key(&self) -> Option<&'static str> {
        match self {
            RouteError::NoPath | RouteError::Actions => None,
            RouteError::Path(_) => Some("path"),
            RouteError::UpstreamKeyAlone(key) => Some(key),
            RouteError::MaxFails(_) => Some("max_fails"),
            RouteError::StatusAlone => Some("status"),
            RouteError::BodyNotAllowed(_) => Some("respond.body"),
            RouteError::UpstreamKeyInTheClear { key, .. } => Some(key),
            RouteError::TlsInTheClear(_) => Some("upstream"),
            RouteError::RequestHeadersAlone => Some("request_headers"),
            RouteError::FallbackAlone => Some("fallback"),
            RouteError::Limit(e) => e.key(),
        }
    }
}

/// A value of a route refused. The message says what is expected, not the value itself: the
/// reader (the configuration's or the site table's) names the key and the value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ValueError {
    #[error("a redirect is 301, 302, 307 or 308")]
    RedirectStatus,
    #[error("expected a URL of printable ASCII, e.g. \"https://example.com{{path}}\"")]
    RedirectTarget,
    #[error("expected a status of {} to {}", RESPOND_STATUSES.start(), RESPOND_STATUSES.end())]
    RespondStatus,
    #[error("a body of {0} bytes; at most {MAX_RESPOND_BODY}")]
    BodyTooLong(usize),
    #[error(transparent)]
    Header(#[from] HeaderFieldError),
    #[error("{0}")]
    Upstream(String),
    #[error("{0} backends: give 1 to {MAX_BACKENDS}")]
    Backends(usize),
    #[error("{0} is listed twice; give each backend once")]
    BackendTwice(String),
    #[error("retries: 0 to {MAX_RETRIES}")]
    Retries,
    #[error("expected {} to {} seconds", HEALTH_SECONDS.start(), HEALTH_SECONDS.end())]
    HealthSeconds,
    #[error("expected 0 (never eject) to {MAX_FAILS} failures")]
    MaxFails,
    #[error(
        "{0:?}: expected a size in bytes, as a number (1048576) or with a unit (\"10MB\", \"10MiB\", \"512KiB\", \"1GB\"); 0 for no limit"
    )]
    BodyLimit(String),
    #[error(
        "expected a DNS name (letters, digits, hyphens and dots) or an IP address, e.g. \
         \"api.internal\""
    )]
    ServerName,
}

/// A redirect's status: one of [`REDIRECT_STATUSES`]; [`DEFAULT_REDIRECT_STATUS`] by default.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "u16", into = "u16")]
pub struct RedirectStatus(u16);

impl RedirectStatus {
    pub fn get(self) -> u16 {
        self.0
    }
}

impl Default for RedirectStatus {
    fn default() -> Self {
        RedirectStatus(DEFAULT_REDIRECT_STATUS)
    }
}

impl TryFrom<u16> for RedirectStatus {
    type Error = ValueError;

    fn try_from(v: u16) -> Result<Self, ValueError> {
        match REDIRECT_STATUSES.contains(&v) {
            true => Ok(RedirectStatus(v)),
            false => Err(ValueError::RedirectStatus),
        }
    }
}

impl From<RedirectStatus> for u16 {
    fn from(s: RedirectStatus) -> u16 {
        s.0
    }
}

/// A redirect's target: not empty, printable ASCII without spaces (a `location` value once
/// `{path}` and `{query}` are filled in from a request, whose path and query are such too).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct RedirectTarget(String);

impl RedirectTarget {
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl TryFrom<String> for RedirectTarget {
    type Error = ValueError;

    fn try_from(v: String) -> Result<Self, ValueError> {
        match !v.is_empty() && v.bytes().all(|b| (0x21..0x7f).contains(&b)) {
            true => Ok(RedirectTarget(v)),
            false => Err(ValueError::RedirectTarget),
        }
    }
}

impl From<RedirectTarget> for String {
    fn from(t: RedirectTarget) -> String {
        t.0
    }
}

/// A fixed response's status: within [`RESPOND_STATUSES`]; 200 by default.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "u16", into = "u16")]
pub struct RespondStatus(u16);

impl RespondStatus {
    pub fn get(self) -> u16 {
        self.0
    }
}

impl Default for RespondStatus {
    fn default() -> Self {
        RespondStatus(200)
    }
}

impl TryFrom<u16> for RespondStatus {
    type Error = ValueError;

    fn try_from(v: u16) -> Result<Self, ValueError> {
        match RESPOND_STATUSES.contains(&v) {
            true => Ok(RespondStatus(v)),
            false => Err(ValueError::RespondStatus),
        }
    }
}

impl From<RespondStatus> for u16 {
    fn from(s: RespondStatus) -> u16 {
        s.0
    }
}

/// A fixed response's body: at most [`MAX_RESPOND_BODY`] bytes.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct RespondBody(String);

impl RespondBody {
    pub fn as_str(&self) -> &str {
        &self.0
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl TryFrom<String> for RespondBody {
    type Error = ValueError;

    fn try_from(v: String) -> Result<Self, ValueError> {
        match v.len() <= MAX_RESPOND_BODY {
            true => Ok(RespondBody(v)),
            false => Err(ValueError::BodyTooLong(v.len())),
        }
    }
}

impl From<RespondBody> for String {
    fn from(b: RespondBody) -> String {
        b.0
    }
}

/// Header fields a response carries besides its own, each given once as a [`FieldTable`]
/// reads them (no pseudo-header nor [`crate::header_field::OWNED_HEADERS`]), names lower
/// case; at most [`MAX_RESPOND_HEADERS`].
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(
    try_from = "BTreeMap<String, String>",
    into = "BTreeMap<String, String>"
)]
pub struct ResponseHeaders(BTreeMap<String, String>);

impl ResponseHeaders {
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Each field, name (lower case) and value, by name.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &str)> {
        self.0.iter().map(|(n, v)| (n.as_str(), v.as_str()))
    }
}

impl TryFrom<BTreeMap<String, String>> for ResponseHeaders {
    type Error = ValueError;

    fn try_from(given: BTreeMap<String, String>) -> Result<Self, ValueError> {
        let mut table = FieldTable::new(given.len(), MAX_RESPOND_HEADERS)?;
        let mut fields = BTreeMap::new();
        for (name, value) in given {
            let field = table.field(&name, value)?;
            fields.insert(field.name.to_string(), field.value_str().to_string());
        }
        Ok(ResponseHeaders(fields))
    }
}

impl From<ResponseHeaders> for BTreeMap<String, String> {
    fn from(h: ResponseHeaders) -> Self {
        h.0
    }
}

/// How a route's TLS upstream (`https://`, `h2://`) is verified: against `roots_pem`, and for
/// the name `sni` or else its URL's host (an IP address is sent as no SNI, RFC 6066 §3, and
/// verified as an IP address of the certificate). Empty for an upstream in the clear.
#[derive(Clone, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UpstreamTls {
    /// PEM certificates to trust: the route's `upstream_ca`, else the system's roots, as the
    /// demux read them (a worker reads no file for them).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub roots_pem: String,
    /// `upstream_sni`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sni: Option<UpstreamSni>,
}

impl std::fmt::Debug for UpstreamTls {
    // The system's roots are some 200 KB of PEM: say how much, not what.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UpstreamTls")
            .field("roots_pem_bytes", &self.roots_pem.len())
            .field("sni", &self.sni)
            .finish()
    }
}

impl UpstreamTls {
    /// Nothing set: an upstream in the clear.
    pub fn is_default(&self) -> bool {
        self.roots_pem.is_empty() && self.sni.is_none()
    }
}

/// `upstream_sni`: a DNS name (lower case, labels of letters, digits, hyphens and
/// underscores, at most 253 characters) or an IP address.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct UpstreamSni(String);

impl UpstreamSni {
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl TryFrom<String> for UpstreamSni {
    type Error = ValueError;

    fn try_from(v: String) -> Result<Self, ValueError> {
        if v.parse::<std::net::IpAddr>().is_ok() {
            return Ok(UpstreamSni(v));
        }
        let name = v.strip_suffix('.').unwrap_or(&v).to_ascii_lowercase();
        let label_ok = |l: &str| {
            (1..=63).contains(&l.len())
                && !l.starts_with('-')
                && !l.ends_with('-')
                && l.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        };
        match name.len() <= 253 && name.split('.').all(label_ok) {
            true => Ok(UpstreamSni(name)),
            false => Err(ValueError::ServerName),
        }
    }
}

impl From<UpstreamSni> for String {
    fn from(s: UpstreamSni) -> String {
        s.0
    }
}

// An upstream is written as its URL; a bad one is refused saying why, the reader naming it.
impl Serialize for UpstreamUrl {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for UpstreamUrl {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        text.parse()
            .map_err(|e: crate::UpstreamError| serde::de::Error::custom(e.why()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `json` read as `T`: its value, or the message of its refusal.
    fn read<T: for<'de> Deserialize<'de>>(json: &str) -> Result<T, String> {
        serde_json::from_str(json).map_err(|e| e.to_string())
    }

    #[test]
    fn statuses_out_of_their_range_are_refused() {
        assert_eq!(read::<RedirectStatus>("308").unwrap().get(), 308);
        let e = read::<RedirectStatus>("300").unwrap_err();
        assert!(e.contains("a redirect is 301, 302, 307 or 308"), "{e}");
        assert_eq!(read::<RespondStatus>("599").unwrap().get(), 599);
        for bad in ["199", "600", "0"] {
            let e = read::<RespondStatus>(bad).unwrap_err();
            assert!(e.contains("expected a status of 200 to 599"), "{bad}: {e}");
        }
        assert!(read::<RespondStatus>("70000").is_err());
    }

    #[test]
    fn bodies_targets_and_upstreams_are_bounded() {
        let long = format!("\"{}\"", "x".repeat(MAX_RESPOND_BODY + 1));
        let e = read::<RespondBody>(&long).unwrap_err();
        assert!(e.contains("a body of 65537 bytes; at most 65536"), "{e}");
        assert!(read::<RespondBody>(&format!("\"{}\"", "x".repeat(MAX_RESPOND_BODY))).is_ok());
        for bad in [
            "\"\"",
            "\"https://a.test/a b\"",
            "\"https://a.test/\\u00e9\"",
        ] {
            let e = read::<RedirectTarget>(bad).unwrap_err();
            assert!(e.contains("printable ASCII"), "{bad}: {e}");
        }
        let e = read::<UpstreamUrl>("\"ftp://127.0.0.1:9\"").unwrap_err();
        assert!(e.starts_with("expected http://HOST:PORT, https://"), "{e}");
        for good in ["\"api.internal\"", "\"10.0.0.1\"", "\"::1\"", "\"A.Test.\""] {
            assert!(read::<UpstreamSni>(good).is_ok(), "{good}");
        }
        assert_eq!(
            read::<UpstreamSni>("\"A.Test.\"").unwrap().as_str(),
            "a.test"
        );
        for bad in [
            "\"\"",
            "\"a b\"",
            "\"-a.test\"",
            "\"a..test\"",
            "\"*.a.test\"",
        ] {
            let e = read::<UpstreamSni>(bad).unwrap_err();
            assert!(e.contains("expected a DNS name"), "{bad}: {e}");
        }
    }

    #[test]
    fn bad_and_forbidden_header_fields_are_refused_by_name() {
        let ok: Respond =
            read(r#"{"status": 200, "body": "ok", "headers": {"X-A": "b", "cache-control": "no-store"}}"#)
                .unwrap();
        let got: Vec<_> = ok.headers.iter().collect();
        assert_eq!(got, [("cache-control", "no-store"), ("x-a", "b")]);
        for (headers, says) in [
            (r#"{"x a": "b"}"#, "\"x a\" is not a header field name"),
            (r#"{"": "b"}"#, "\"\" is not a header field name"),
            (r#"{":status": "200"}"#, "\":status\" is a pseudo-header"),
            (
                r#"{"Content-Length": "3"}"#,
                "content-length: ringmux owns this field (the server sets it",
            ),
            (
                r#"{"transfer-encoding": "chunked"}"#,
                "transfer-encoding: ringmux owns this field (a hop-by-hop field",
            ),
            (
                r#"{"connection": "close"}"#,
                "connection: ringmux owns this field",
            ),
            (
                r#"{"x-a": "b\nc"}"#,
                "x-a = \"b\\nc\": expected a header field value",
            ),
            (r#"{"X-A": "b", "x-a": "c"}"#, "x-a is given twice"),
        ] {
            let e = read::<Respond>(&format!(r#"{{"headers": {headers}}}"#)).unwrap_err();
            assert!(e.contains(says), "{headers}: {e}");
        }
        let many: BTreeMap<String, String> = (0..=MAX_RESPOND_HEADERS)
            .map(|i| (format!("x-{i}"), "v".into()))
            .collect();
        assert_eq!(
            ResponseHeaders::try_from(many),
            Err(ValueError::Header(HeaderFieldError::TooMany {
                count: MAX_RESPOND_HEADERS + 1,
                most: MAX_RESPOND_HEADERS
            }))
        );
    }

    #[test]
    fn a_file_route_takes_one_action_and_its_own_keys() {
        let route = |f: FileRoute| Route::try_from(f);
        let path = || Some("/x".to_string());
        let respond = || Some(Respond::new(200, "x").unwrap());
        assert_eq!(route(FileRoute::default()), Err(RouteError::NoPath));
        let two = FileRoute {
            path: path(),
            respond: respond(),
            root: Some("/srv".into()),
            ..FileRoute::default()
        };
        assert_eq!(route(two), Err(RouteError::Actions));
        let strip = FileRoute {
            path: path(),
            respond: respond(),
            strip_prefix: Some(true),
            ..FileRoute::default()
        };
        assert_eq!(route(strip).unwrap_err().key(), Some("strip_prefix"));
        let lb = FileRoute {
            path: path(),
            respond: respond(),
            lb: Some(Balance::RoundRobin),
            ..FileRoute::default()
        };
        let e = route(lb).unwrap_err();
        assert_eq!(
            (e.key(), e.to_string()),
            (Some("lb"), "lb goes with upstream only".to_string())
        );
        let pool = FileRoute {
            path: path(),
            upstream: Some(Backends::one("http://127.0.0.1:9".parse().unwrap())),
            retries: Some(Retries::try_from(2).unwrap()),
            max_fails: Some(5),
            max_body: Some(BodyLimit::bytes(10)),
            ..FileRoute::default()
        };
        let Action::Upstream {
            balancing,
            max_body,
            ..
        } = route(pool).unwrap().action
        else {
            unreachable!("an upstream route")
        };
        assert_eq!(
            (
                balancing.retries.get(),
                balancing.passive.max_fails,
                max_body.get()
            ),
            (2, 5, Some(10))
        );
        let no_body = FileRoute {
            path: path(),
            respond: Some(Respond::new(204, "x").unwrap()),
            ..FileRoute::default()
        };
        let e = route(no_body).unwrap_err();
        assert_eq!(
            (
                e.key(),
                e.to_string().starts_with("a 204 response has no body")
            ),
            (Some("respond.body"), true)
        );
        let upstream = |url: &str| Some(Backends::one(url.parse::<UpstreamUrl>().unwrap()));
        let sni = || Some(UpstreamSni::try_from("b.test".to_string()).unwrap());
        let alone = FileRoute {
            path: path(),
            respond: respond(),
            upstream_ca: Some("/etc/ca.pem".into()),
            ..FileRoute::default()
        };
        assert_eq!(
            route(alone),
            Err(RouteError::UpstreamKeyAlone("upstream_ca"))
        );
        let clear = FileRoute {
            path: path(),
            upstream: upstream("h2c://127.0.0.1:9"),
            upstream_sni: sni(),
            ..FileRoute::default()
        };
        let e = route(clear).unwrap_err();
        assert_eq!(e.key(), Some("upstream_sni"));
        assert!(e.to_string().contains("h2c://127.0.0.1:9"), "{e}");
        let tls = FileRoute {
            path: path(),
            upstream: upstream("https://127.0.0.1:9"),
            upstream_ca: Some("/etc/ca.pem".into()),
            upstream_sni: sni(),
            ..FileRoute::default()
        };
        let Action::Upstream { tls, .. } = route(tls).unwrap().action else {
            unreachable!("an upstream route")
        };
        // The demux reads the file; the declaration carries the name only.
        assert_eq!((tls.roots_pem.as_str(), tls.sni), ("", sni()));
        let bad_path = FileRoute {
            path: Some("/x?y".into()),
            respond: respond(),
            ..FileRoute::default()
        };
        assert_eq!(route(bad_path).unwrap_err().key(), Some("path"));
        let redirect = FileRoute {
            path: path(),
            redirect: Some(RedirectTarget::try_from("https://b.test/".to_string()).unwrap()),
            ..FileRoute::default()
        };
        assert!(matches!(
            route(redirect).unwrap().action,
            Action::Redirect { status, .. } if status.get() == DEFAULT_REDIRECT_STATUS
        ));
    }

    /// The JSON of every kind as builds before the declaration wrote it reads the same, and a
    /// table without response headers is written as they wrote it (an upgrade hands the table
    /// over both ways).
    #[test]
    fn the_wire_shape_of_every_kind_is_kept() {
        let before = [
            r#"{"path":"/","action":{"files":{"root":"/srv"}}}"#,
            r#"{"path":"/","action":{"builtin":{"root":null}}}"#,
            r#"{"path":"/api","action":{"upstream":{"url":"http://127.0.0.1:9","strip_prefix":true}}}"#,
            r#"{"path":"/old","action":{"redirect":{"to":"https://b.test{path}","status":301}}}"#,
            r#"{"path":"/hi","action":{"respond":{"status":200,"body":"hi\n"}}}"#,
        ];
        for json in before {
            let route: Route = read(json).unwrap_or_else(|e| panic!("{json}: {e}"));
            assert_eq!(serde_json::to_string(&route).unwrap(), json);
        }
        let tls = r#"{"path":"/g","action":{"upstream":{"url":"h2://g.test:443","strip_prefix":false,"tls":{"roots_pem":"PEM","sni":"g.internal"}}}}"#;
        let route: Route = read(tls).unwrap();
        assert_eq!(serde_json::to_string(&route).unwrap(), tls);
        let clear = r#"{"path":"/g","action":{"upstream":{"url":"h2c://g.test:80","strip_prefix":false,"tls":{"sni":"g.internal"}}}}"#;
        let e = read::<Route>(clear).unwrap().check().unwrap_err();
        assert!(e.to_string().contains("is in the clear"), "{e}");
        let mut route: Route = read(before[4]).unwrap();
        let Action::Respond(r) = &mut route.action else {
            unreachable!("a respond route")
        };
        r.headers = read(r#"{"x-a":"b"}"#).unwrap();
        let json = serde_json::to_string(&route).unwrap();
        assert!(json.contains(r#""headers":{"x-a":"b"}"#), "{json}");
        assert_eq!(read::<Route>(&json).unwrap(), route);
        // Several backends and settings away from their defaults are written, and read back.
        let pool = r#"{"path":"/","action":{"upstream":{"url":["http://127.0.0.1:9","http://127.0.0.1:10"],"strip_prefix":false,"balancing":{"lb":"client_hash","retries":0,"passive":{"max_fails":1,"fail_window":10,"eject_for":5}},"max_body":100}}}"#;
        let route: Route = read(pool).unwrap();
        assert_eq!(serde_json::to_string(&route).unwrap(), pool);
        // An active health check is written in seconds, and read back.
        let checked = r#"{"path":"/","action":{"upstream":{"url":"http://127.0.0.1:9","strip_prefix":false,"health":{"path":"/healthz","interval":5.0,"timeout":0.5}}}}"#;
        let route: Route = read(checked).unwrap();
        assert_eq!(serde_json::to_string(&route).unwrap(), checked);
    }
}
