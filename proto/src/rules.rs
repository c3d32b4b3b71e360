//! What a site or a route does around its content, declared once: header rules on responses
//! and on the request an upstream gets ([`HeaderRules`]), HSTS ([`Hsts`]), CORS ([`Cors`]),
//! error pages ([`ErrorPages`]) and a single-page app's fallback ([`RouteRules::fallback`]).
//! Each value refuses a bad input when it is deserialised, so the demux (reading the
//! configuration file) and a worker (reading the site table) refuse the same values with the
//! same words; the limits are here and nowhere else.
//!
//! The configuration file writes them as:
//!
//! ```toml
//! [[site]]
//! hsts = 31536000              # or { max_age = 31536000, include_subdomains = true, preload = true }
//!   [site.headers]             # every response of the site; a route may have its own `headers`
//!   set = { "x-frame-options" = "DENY" }
//!   add = { "link" = "</a.css>; rel=preload" }
//!   remove = ["last-modified"]
//!   [site.cors]
//!   origins = ["https://app.example"]
//!   [site.errors]
//!   404 = "/srv/example/404.html"  # read by the demux, handed over in the site table
//!   [[site.route]]
//!   path = "/app"
//!   root = "/srv/example"
//!   fallback = "/app/index.html"   # beneath the route's root
//!   request_headers = { set = { "x-from" = "ringmux" } }  # upstream routes only
//! ```
//!
//! Every field here is left out of the site table's JSON when it has its default, so a table
//! without rules reads the same in a build before them (`ringmux upgrade`). This module never
//! touches a file: the demux reads the error pages ([`ErrorPage::body`]).

use std::collections::BTreeMap;

use http::{HeaderName, Method};
use serde::{Deserialize, Serialize};

use crate::header_field::{field_name, FieldTable, HeaderField, HeaderFieldError};

/// The most fields one [`HeaderRules`] may name, all of set, add and remove together.
pub const MAX_RULES: usize = 64;

/// The statuses an error page may stand for ([`ErrorPages`]).
pub const ERROR_PAGE_STATUSES: [u16; 6] = [403, 404, 500, 502, 503, 504];

/// The largest error page, in bytes: every worker holds each in memory.
pub const MAX_ERROR_PAGE: usize = 256 * 1024;

/// The `max-age` an HSTS preload list asks for at least (one year, in seconds), and so the
/// least `preload = true` takes.
pub const HSTS_PRELOAD_MIN_AGE: u64 = 31_536_000;

/// A value of a rule refused; the reader (the configuration's or the site table's) names the
/// key it is under.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RuleError {
    #[error(transparent)]
    Header(#[from] HeaderFieldError),
    #[error("{0}")]
    Hsts(&'static str),
    #[error("origin {0:?}: expected \"*\" or scheme://host[:port], e.g. \"https://app.example\"")]
    Origin(String),
    #[error("origins = [\"*\"] with credentials = true: browsers refuse it; list the origins")]
    AnyOriginWithCredentials,
    #[error("origins is empty: list the origins allowed, e.g. [\"https://app.example\"]")]
    NoOrigins,
    #[error("method {0:?}: expected a method name such as \"GET\" (RFC 9110 §9.1)")]
    Method(String),
    #[error("status {0}: error pages stand for {ERROR_PAGE_STATUSES:?}")]
    ErrorStatus(String),
    #[error("the page of {status} has {len} bytes; at most {MAX_ERROR_PAGE}")]
    ErrorPageTooLong { status: u16, len: usize },
    #[error(
        "{0:?}: expected a path beneath the route's root, starting with / and without . or \
         .. segments, e.g. \"/index.html\""
    )]
    Fallback(String),
}

/// Header rules: `set` (replacing any field of the name), `add` (one more field beside
/// those there), `remove`. Each name given once across the three, as a [`FieldTable`] reads
/// them (no pseudo-header nor [`crate::header_field::OWNED_HEADERS`]); at most [`MAX_RULES`]
/// in all.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "RawHeaderRules", into = "RawHeaderRules")]
pub struct HeaderRules {
    set: Vec<HeaderField>,
    add: Vec<HeaderField>,
    remove: Vec<HeaderName>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawHeaderRules {
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    set: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    add: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    remove: Vec<String>,
}

impl HeaderRules {
    pub fn is_empty(&self) -> bool {
        self.set.is_empty() && self.add.is_empty() && self.remove.is_empty()
    }

    /// Applies the rules to `headers`: removals first, then `set`, then `add`.
    pub fn apply(&self, headers: &mut http::HeaderMap) {
        for name in &self.remove {
            headers.remove(name);
        }
        for f in &self.set {
            headers.insert(f.name.clone(), f.value.clone());
        }
        for f in &self.add {
            headers.append(f.name.clone(), f.value.clone());
        }
    }
}

impl TryFrom<RawHeaderRules> for HeaderRules {
    type Error = RuleError;

    fn try_from(raw: RawHeaderRules) -> Result<Self, RuleError> {
        let count = raw.set.len() + raw.add.len() + raw.remove.len();
        let mut table = FieldTable::new(count, MAX_RULES)?;
        let mut rules = HeaderRules::default();
        for (name, value) in raw.set {
            rules.set.push(table.field(&name, value)?);
        }
        for (name, value) in raw.add {
            rules.add.push(table.field(&name, value)?);
        }
        for name in raw.remove {
            rules.remove.push(table.name(&name)?);
        }
        Ok(rules)
    }
}

impl From<HeaderRules> for RawHeaderRules {
    fn from(r: HeaderRules) -> Self {
        let text = |f: &HeaderField| (f.name.to_string(), f.value_str().to_string());
        RawHeaderRules {
            set: r.set.iter().map(text).collect(),
            add: r.add.iter().map(text).collect(),
            remove: r.remove.iter().map(|n| n.to_string()).collect(),
        }
    }
}

/// `strict-transport-security` (RFC 6797 §6.1): `hsts = SECONDS`, or `{ max_age,
/// include_subdomains, preload }`. Sent only on responses over TLS.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "serde_json::Value", into = "RawHsts")]
pub struct Hsts {
    pub max_age: u64,
    pub include_subdomains: bool,
    pub preload: bool,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawHsts {
    max_age: u64,
    #[serde(default)]
    include_subdomains: bool,
    #[serde(default)]
    preload: bool,
}

impl From<Hsts> for RawHsts {
    fn from(h: Hsts) -> Self {
        RawHsts {
            max_age: h.max_age,
            include_subdomains: h.include_subdomains,
            preload: h.preload,
        }
    }
}

impl TryFrom<serde_json::Value> for Hsts {
    type Error = RuleError;

    fn try_from(v: serde_json::Value) -> Result<Self, RuleError> {
        const SHAPE: &str = "expected a max-age in seconds (e.g. 31536000) or { max_age = \
                             31536000, include_subdomains = true, preload = true }";
        let raw = match v {
            serde_json::Value::Number(n) => RawHsts {
                max_age: n.as_u64().ok_or(RuleError::Hsts(SHAPE))?,
                include_subdomains: false,
                preload: false,
            },
            v @ serde_json::Value::Object(_) => {
                serde_json::from_value(v).map_err(|_| RuleError::Hsts(SHAPE))?
            }
            _ => return Err(RuleError::Hsts(SHAPE)),
        };
        if raw.preload && !(raw.include_subdomains && raw.max_age >= HSTS_PRELOAD_MIN_AGE) {
            return Err(RuleError::Hsts(
                "preload = true needs include_subdomains = true and a max_age of at least \
                 31536000 (one year), as the preload lists require",
            ));
        }
        Ok(Hsts {
            max_age: raw.max_age,
            include_subdomains: raw.include_subdomains,
            preload: raw.preload,
        })
    }
}

impl Hsts {
    /// The field's value: `max-age=N[; includeSubDomains][; preload]`.
    pub fn value(&self) -> String {
        let mut v = format!("max-age={}", self.max_age);
        if self.include_subdomains {
            v.push_str("; includeSubDomains");
        }
        if self.preload {
            v.push_str("; preload");
        }
        v
    }
}

/// Cross-origin resource sharing (the Fetch standard's CORS protocol): which origins may read
/// the site's responses, with which methods and request fields, with credentials or not, and
/// how long a browser keeps a preflight's answer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "RawCors", into = "RawCors")]
pub struct Cors {
    /// Exact origins (`https://app.example`), lower case; empty when `any`.
    pub origins: Vec<String>,
    /// `origins = ["*"]`: every origin (never with credentials).
    pub any: bool,
    pub methods: Vec<Method>,
    pub headers: Vec<HeaderName>,
    pub credentials: bool,
    pub max_age: Option<u64>,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawCors {
    origins: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    methods: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    headers: Vec<String>,
    #[serde(default)]
    credentials: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    max_age: Option<u64>,
}

impl TryFrom<RawCors> for Cors {
    type Error = RuleError;

    fn try_from(raw: RawCors) -> Result<Self, RuleError> {
        if raw.origins.is_empty() {
            return Err(RuleError::NoOrigins);
        }
        let any = raw.origins.iter().any(|o| o == "*");
        if any && raw.credentials {
            return Err(RuleError::AnyOriginWithCredentials);
        }
        let mut origins = Vec::new();
        for o in raw.origins.iter().filter(|o| *o != "*") {
            origins.push(origin(o).ok_or_else(|| RuleError::Origin(o.clone()))?);
        }
        let methods = if raw.methods.is_empty() {
            vec![Method::GET, Method::HEAD, Method::POST]
        } else {
            let mut methods = Vec::new();
            for m in &raw.methods {
                let parsed =
                    Method::from_bytes(m.as_bytes()).map_err(|_| RuleError::Method(m.clone()))?;
                methods.push(parsed);
            }
            methods
        };
        let mut headers = Vec::new();
        for h in &raw.headers {
            headers.push(field_name(h)?);
        }
        Ok(Cors {
            origins: if any { Vec::new() } else { origins },
            any,
            methods,
            headers,
            credentials: raw.credentials,
            max_age: raw.max_age,
        })
    }
}

impl From<Cors> for RawCors {
    fn from(c: Cors) -> Self {
        RawCors {
            origins: if c.any { vec!["*".into()] } else { c.origins },
            methods: c.methods.iter().map(|m| m.to_string()).collect(),
            headers: c.headers.iter().map(|h| h.to_string()).collect(),
            credentials: c.credentials,
            max_age: c.max_age,
        }
    }
}

/// `text` as a serialised origin (`scheme://host[:port]`, no path), lower case.
fn origin(text: &str) -> Option<String> {
    let lower = text.to_ascii_lowercase();
    let (scheme, rest) = lower.split_once("://")?;
    let scheme_ok = !scheme.is_empty()
        && scheme
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"+-.".contains(&b));
    let host_ok = !rest.is_empty()
        && rest
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-.:[]_".contains(&b));
    (scheme_ok && host_ok).then_some(lower)
}

impl Cors {
    /// Whether `origin` (a request's `origin` field) may read responses.
    pub fn allows(&self, origin: &[u8]) -> bool {
        self.any
            || self
                .origins
                .iter()
                .any(|o| o.as_bytes().eq_ignore_ascii_case(origin))
    }
}

/// Error pages of a site, by status: ringmux's own errors and the proxy's 502 and 504 are
/// answered with the page instead of their short text, keeping their status. The demux reads
/// each file at load and reload and hands its bytes over here; a worker reads no file for
/// them.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(
    try_from = "BTreeMap<String, ErrorPage>",
    into = "BTreeMap<String, ErrorPage>"
)]
pub struct ErrorPages(BTreeMap<u16, ErrorPage>);

/// One error page: the file it was read from (its extension gives the content type) and its
/// text.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ErrorPage {
    pub file: String,
    pub body: String,
}

impl ErrorPages {
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The page of `status`, if any.
    pub fn get(&self, status: u16) -> Option<&ErrorPage> {
        self.0.get(&status)
    }

    /// Each page by status.
    pub fn iter(&self) -> impl Iterator<Item = (u16, &ErrorPage)> {
        self.0.iter().map(|(s, p)| (*s, p))
    }

    /// The page of `status` (one of [`ERROR_PAGE_STATUSES`], written as the file writes the
    /// key) with `page`, checked.
    pub fn insert(&mut self, status: &str, page: ErrorPage) -> Result<(), RuleError> {
        let code = error_status(status)?;
        if page.body.len() > MAX_ERROR_PAGE {
            return Err(RuleError::ErrorPageTooLong {
                status: code,
                len: page.body.len(),
            });
        }
        self.0.insert(code, page);
        Ok(())
    }
}

/// `text` as a status an error page may stand for.
pub fn error_status(text: &str) -> Result<u16, RuleError> {
    text.parse::<u16>()
        .ok()
        .filter(|s| ERROR_PAGE_STATUSES.contains(s))
        .ok_or_else(|| RuleError::ErrorStatus(text.to_string()))
}

impl TryFrom<BTreeMap<String, ErrorPage>> for ErrorPages {
    type Error = RuleError;

    fn try_from(given: BTreeMap<String, ErrorPage>) -> Result<Self, RuleError> {
        let mut pages = ErrorPages::default();
        for (status, page) in given {
            pages.insert(&status, page)?;
        }
        Ok(pages)
    }
}

impl From<ErrorPages> for BTreeMap<String, ErrorPage> {
    fn from(p: ErrorPages) -> Self {
        p.0.into_iter().map(|(s, p)| (s.to_string(), p)).collect()
    }
}

/// What a site does around its routes, in the site table ([`crate::sites::Site::rules`]).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SiteRules {
    #[serde(default, skip_serializing_if = "HeaderRules::is_empty")]
    pub headers: HeaderRules,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hsts: Option<Hsts>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cors: Option<Cors>,
    #[serde(default, skip_serializing_if = "ErrorPages::is_empty")]
    pub errors: ErrorPages,
}

impl SiteRules {
    pub fn is_empty(&self) -> bool {
        *self == SiteRules::default()
    }
}

/// What a route does around its action ([`crate::route::Route::rules`]): header rules of its
/// responses (after the site's), of the request its upstream gets, and a file route's
/// fallback.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteRules {
    #[serde(default, skip_serializing_if = "HeaderRules::is_empty")]
    pub headers: HeaderRules,
    #[serde(default, skip_serializing_if = "HeaderRules::is_empty")]
    pub request_headers: HeaderRules,
    /// A file route's single-page-app fallback: a GET or HEAD of a path with no file and no
    /// extension gets this file (a path beneath the route's root) with 200.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fallback: Option<Fallback>,
}

impl RouteRules {
    pub fn is_empty(&self) -> bool {
        *self == RouteRules::default()
    }
}

/// A fallback file: `/` then segments, none empty, `.` or `..`, of printable ASCII.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Fallback(String);

impl Fallback {
    /// The path beneath the root, without its leading `/`.
    pub fn relative(&self) -> &str {
        &self.0[1..]
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl TryFrom<String> for Fallback {
    type Error = RuleError;

    fn try_from(v: String) -> Result<Self, RuleError> {
        let ok = v.len() > 1
            && v.starts_with('/')
            && v[1..]
                .split('/')
                .all(|s| !s.is_empty() && s != "." && s != "..")
            && v.bytes().all(|b| (0x21..0x7f).contains(&b) && b != b'\\');
        match ok {
            true => Ok(Fallback(v)),
            false => Err(RuleError::Fallback(v)),
        }
    }
}

impl From<Fallback> for String {
    fn from(f: Fallback) -> String {
        f.0
    }
}

#[cfg(test)]
mod tests {
    use http::HeaderValue;

    use super::*;

    fn read<T: for<'de> Deserialize<'de>>(json: &str) -> Result<T, String> {
        serde_json::from_str(json).map_err(|e| e.to_string())
    }

    #[test]
    fn header_rules_refuse_owned_and_bad_fields_by_name() {
        let ok: HeaderRules =
            read(r#"{"set": {"X-Frame-Options": "DENY"}, "add": {"link": "</a>"}, "remove": ["server"]}"#)
                .unwrap();
        let mut h = http::HeaderMap::new();
        h.insert("server", HeaderValue::from_static("x"));
        h.insert("link", HeaderValue::from_static("</b>"));
        ok.apply(&mut h);
        assert!(!h.contains_key("server"));
        assert_eq!(h["x-frame-options"], "DENY");
        assert_eq!(h.get_all("link").iter().count(), 2);
        for (json, says) in [
            (
                r#"{"set": {"alt-svc": "x"}}"#,
                "alt-svc: ringmux owns this field",
            ),
            (
                r#"{"remove": ["Forwarded"]}"#,
                "forwarded: ringmux owns this field",
            ),
            (r#"{"remove": ["connection"]}"#, "connection: ringmux owns"),
            (
                r#"{"set": {"content-length": "1"}}"#,
                "content-length: ringmux owns",
            ),
            (
                r#"{"set": {":status": "1"}}"#,
                "\":status\" is a pseudo-header",
            ),
            (
                r#"{"set": {"a b": "1"}}"#,
                "\"a b\" is not a header field name",
            ),
            (r#"{"set": {"x-a": "b\nc"}}"#, "x-a = \"b\\nc\": expected"),
            (
                r#"{"set": {"x-a": "b"}, "remove": ["X-A"]}"#,
                "x-a is given twice",
            ),
            (r#"{"sett": {}}"#, "unknown field `sett`"),
        ] {
            let e = read::<HeaderRules>(json).unwrap_err();
            assert!(e.contains(says), "{json}: {e}");
        }
        let back = serde_json::to_string(&ok).unwrap();
        assert_eq!(read::<HeaderRules>(&back).unwrap(), ok);
    }

    #[test]
    fn hsts_takes_seconds_or_a_table_and_checks_preload() {
        assert_eq!(
            read::<Hsts>("31536000").unwrap().value(),
            "max-age=31536000"
        );
        let full: Hsts =
            read(r#"{"max_age": 31536000, "include_subdomains": true, "preload": true}"#).unwrap();
        assert_eq!(full.value(), "max-age=31536000; includeSubDomains; preload");
        assert_eq!(
            read::<Hsts>(&serde_json::to_string(&full).unwrap()).unwrap(),
            full
        );
        for bad in ["-1", "\"1y\"", "1.5", r#"{"max_age": 1, "x": 2}"#] {
            let e = read::<Hsts>(bad).unwrap_err();
            assert!(e.contains("expected a max-age in seconds"), "{bad}: {e}");
        }
        let e = read::<Hsts>(r#"{"max_age": 600, "include_subdomains": true, "preload": true}"#)
            .unwrap_err();
        assert!(e.contains("preload = true needs"), "{e}");
    }

    #[test]
    fn cors_refuses_any_origin_with_credentials() {
        let c: Cors = read(r#"{"origins": ["https://App.example"], "credentials": true}"#).unwrap();
        assert!(c.allows(b"https://app.example"));
        assert!(!c.allows(b"https://evil.example"));
        assert_eq!(c.methods, [Method::GET, Method::HEAD, Method::POST]);
        assert_eq!(
            read::<Cors>(&serde_json::to_string(&c).unwrap()).unwrap(),
            c
        );
        let any: Cors = read(r#"{"origins": ["*"]}"#).unwrap();
        assert!(any.allows(b"https://x.example"));
        for (json, says) in [
            (
                r#"{"origins": ["*"], "credentials": true}"#,
                "origins = [\"*\"] with credentials",
            ),
            (r#"{"origins": []}"#, "origins is empty"),
            (r#"{"origins": ["app.example"]}"#, "origin \"app.example\""),
            (
                r#"{"origins": ["*"], "methods": ["G T"]}"#,
                "method \"G T\"",
            ),
            (
                r#"{"origins": ["*"], "headers": ["a b"]}"#,
                "\"a b\" is not a header",
            ),
        ] {
            let e = read::<Cors>(json).unwrap_err();
            assert!(e.contains(says), "{json}: {e}");
        }
    }

    #[test]
    fn error_pages_take_their_statuses_only() {
        let page = r#"{"file": "/e/404.html", "body": "<p>no</p>"}"#;
        let p: ErrorPages = read(&format!(r#"{{"404": {page}}}"#)).unwrap();
        assert_eq!(p.get(404).unwrap().body, "<p>no</p>");
        let e = read::<ErrorPages>(&format!(r#"{{"418": {page}}}"#)).unwrap_err();
        assert!(e.contains("status 418: error pages stand for"), "{e}");
        let mut big = ErrorPages::default();
        let long = ErrorPage {
            file: "x.html".into(),
            body: "x".repeat(MAX_ERROR_PAGE + 1),
        };
        assert!(matches!(
            big.insert("502", long),
            Err(RuleError::ErrorPageTooLong { status: 502, .. })
        ));
    }

    #[test]
    fn a_fallback_stays_beneath_its_root() {
        assert_eq!(
            read::<Fallback>("\"/app/index.html\"").unwrap().relative(),
            "app/index.html"
        );
        for bad in [
            "\"index.html\"",
            "\"/\"",
            "\"/../x\"",
            "\"/a//b\"",
            "\"/a/./b\"",
            "\"/a b\"",
        ] {
            let e = read::<Fallback>(bad).unwrap_err();
            assert!(
                e.contains("expected a path beneath the route's root"),
                "{bad}: {e}"
            );
        }
    }

    #[test]
    fn default_rules_are_left_out() {
        assert_eq!(serde_json::to_string(&SiteRules::default()).unwrap(), "{}");
        assert_eq!(serde_json::to_string(&RouteRules::default()).unwrap(), "{}");
    }
}
