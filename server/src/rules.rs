//! What a site and a route do around a response, whatever made it (a file, the proxy, a
//! redirect, a fixed response, ringmux's own errors) and whatever the transport: header rules
//! on the response and on the request an upstream gets, HSTS, CORS (preflights answered here)
//! and error pages. Made ready once per site and route when the router is built
//! ([`SiteRules::new`], [`RouteRules::new`]); each request gets an [`Applied`] from the router
//! (`Router::target`), which the fronts call at their one response path (`h3`, `tcp::answer`,
//! `h3::proxy`).
//!
//! HSTS goes on every response of these fronts because each is TLS (HTTP/3, and HTTPS over
//! TCP): the plain-HTTP listener (`crate::redirect`) answers on its own path and never calls
//! in here, so it never sends HSTS (RFC 6797 §7.2).

use bytes::Bytes;
use http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use ringmux_proto::rules::{self as declared, Cors, HeaderRules};

use crate::files::content_type;
use crate::reply::{Body, Reply};

/// A site's rules, ready: its header rules, its HSTS value, its CORS and its error pages.
#[derive(Debug, Default)]
pub(crate) struct SiteRules {
    headers: HeaderRules,
    hsts: Option<HeaderValue>,
    cors: Option<Cors>,
    /// Per status: content type and body.
    errors: Vec<(StatusCode, HeaderValue, Bytes)>,
}

impl SiteRules {
    pub(crate) fn new(rules: &declared::SiteRules) -> SiteRules {
        SiteRules {
            headers: rules.headers.clone(),
            hsts: rules
                .hsts
                .and_then(|h| HeaderValue::from_str(&h.value()).ok()),
            cors: rules.cors.clone(),
            errors: rules
                .errors
                .iter()
                .filter_map(|(status, page)| {
                    Some((
                        StatusCode::from_u16(status).ok()?,
                        HeaderValue::from_static(content_type(&page.file)),
                        Bytes::from(page.body.clone()),
                    ))
                })
                .collect(),
        }
    }
}

/// A route's rules, ready.
#[derive(Debug, Default)]
pub(crate) struct RouteRules {
    headers: HeaderRules,
    request_headers: HeaderRules,
    /// A file route's fallback, beneath its root.
    pub(crate) fallback: Option<String>,
}

impl RouteRules {
    pub(crate) fn new(rules: &declared::RouteRules) -> RouteRules {
        RouteRules {
            headers: rules.headers.clone(),
            request_headers: rules.request_headers.clone(),
            fallback: rules.fallback.as_ref().map(|f| f.relative().to_owned()),
        }
    }
}

/// The rules of one request: its site's and route's, and its `origin`.
#[derive(Debug, Default)]
pub(crate) struct Applied<'r> {
    site: Option<&'r SiteRules>,
    route: Option<&'r RouteRules>,
    /// The request's `origin`, when the site has CORS and allows it.
    origin: Option<HeaderValue>,
    /// Whether ringmux's own errors get the site's error pages (not a fixed response's
    /// status, which the operator chose).
    pages: bool,
    /// The prefix of the route that answers, for the access log.
    route_path: Option<&'r str>,
}

impl<'r> Applied<'r> {
    /// The rules of a request to `site` (and `route`, if one was found) with `headers`.
    pub(crate) fn new(
        site: &'r SiteRules,
        route: Option<&'r RouteRules>,
        headers: &HeaderMap,
        pages: bool,
    ) -> Applied<'r> {
        let origin = site.cors.as_ref().and_then(|cors| {
            let origin = headers.get(header::ORIGIN)?;
            cors.allows(origin.as_bytes()).then(|| origin.clone())
        });
        Applied {
            site: Some(site),
            route,
            origin,
            pages,
            route_path: None,
        }
    }

    /// These rules, for the route of prefix `path`.
    pub(crate) fn on_route(self, path: &'r str) -> Applied<'r> {
        Applied {
            route_path: Some(path),
            ..self
        }
    }

    /// The prefix of the route that answers, if one does.
    pub(crate) fn route_path(&self) -> Option<&'r str> {
        self.route_path
    }

    /// The answer to a CORS preflight (an `OPTIONS` with `origin` and
    /// `access-control-request-method`) from an allowed origin: 204 with the allowed methods
    /// and fields. `None` for any other request.
    pub(crate) fn preflight(&self, method: &Method, headers: &HeaderMap) -> Option<Reply> {
        let cors = self.site?.cors.as_ref()?;
        let origin = self.origin.as_ref()?;
        if method != Method::OPTIONS || !headers.contains_key(header::ACCESS_CONTROL_REQUEST_METHOD)
        {
            return None;
        }
        let mut h = HeaderMap::with_capacity(8);
        allow_origin(cors, origin, &mut h);
        let methods = join(cors.methods.iter().map(|m| m.as_str()));
        if let Ok(v) = HeaderValue::from_str(&methods) {
            h.insert(header::ACCESS_CONTROL_ALLOW_METHODS, v);
        }
        if !cors.headers.is_empty() {
            let fields = join(cors.headers.iter().map(|n| n.as_str()));
            if let Ok(v) = HeaderValue::from_str(&fields) {
                h.insert(header::ACCESS_CONTROL_ALLOW_HEADERS, v);
            }
        }
        if let Some(age) = cors.max_age {
            h.insert(header::ACCESS_CONTROL_MAX_AGE, HeaderValue::from(age));
        }
        h.insert(header::CONTENT_LENGTH, HeaderValue::from_static("0"));
        Some(Reply {
            status: StatusCode::NO_CONTENT,
            headers: h,
            body: Body::Empty,
        })
    }

    /// The response's fields after the rules: the site's header rules, the route's, HSTS,
    /// and CORS for an allowed origin.
    pub(crate) fn response(&self, headers: &mut HeaderMap) {
        let Some(site) = self.site else {
            return;
        };
        site.headers.apply(headers);
        if let Some(route) = self.route {
            route.headers.apply(headers);
        }
        if let Some(hsts) = &site.hsts {
            headers.insert(header::STRICT_TRANSPORT_SECURITY, hsts.clone());
        }
        if let (Some(cors), Some(origin)) = (&site.cors, &self.origin) {
            allow_origin(cors, origin, headers);
        }
    }

    /// The fields of the request an upstream route passes on, after its rules.
    pub(crate) fn request(&self, headers: &mut HeaderMap) {
        if let Some(route) = self.route {
            route.request_headers.apply(headers);
        }
    }

    /// `reply`, its body the site's error page if it has one for its status.
    pub(crate) fn error_page(&self, reply: Reply) -> Reply {
        if !self.pages || !(reply.status.is_client_error() || reply.status.is_server_error()) {
            return reply;
        }
        let Some(page) = self.page(reply.status) else {
            return reply;
        };
        page
    }

    /// ringmux's own answer of `status` with `text` (the proxy's 502 or 504), or the site's
    /// page for it.
    pub(crate) fn own_error(&self, status: StatusCode, text: &'static [u8]) -> Reply {
        self.page(status)
            .unwrap_or_else(|| Reply::text(status, text))
    }

    fn page(&self, status: StatusCode) -> Option<Reply> {
        let (_, kind, body) = self.site?.errors.iter().find(|(s, _, _)| *s == status)?;
        let mut h = HeaderMap::with_capacity(4);
        h.insert(header::CONTENT_TYPE, kind.clone());
        h.insert(header::CONTENT_LENGTH, HeaderValue::from(body.len()));
        h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
        Some(Reply {
            status,
            headers: h,
            body: Body::Memory(body.clone()),
        })
    }
}

/// `access-control-allow-origin` (the origin itself, or `*` for any origin without
/// credentials), `vary: origin` when the answer depends on it, and
/// `access-control-allow-credentials`.
fn allow_origin(cors: &Cors, origin: &HeaderValue, h: &mut HeaderMap) {
    if cors.any && !cors.credentials {
        h.insert(
            header::ACCESS_CONTROL_ALLOW_ORIGIN,
            HeaderValue::from_static("*"),
        );
        return;
    }
    h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, origin.clone());
    if !h.get_all(header::VARY).iter().any(|v| v == "origin") {
        h.append(header::VARY, HeaderValue::from_static("origin"));
    }
    if cors.credentials {
        h.insert(
            header::ACCESS_CONTROL_ALLOW_CREDENTIALS,
            HeaderValue::from_static("true"),
        );
    }
}

fn join<'s>(items: impl Iterator<Item = &'s str>) -> String {
    items.collect::<Vec<_>>().join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The rules `json` of a site, read as a worker reads its table.
    fn site(json: &str) -> SiteRules {
        let table = format!(
            r#"{{"sites": [{{"label": "s", "names": [], "cert_pem": "", "key_pem": "",
                "routes": [], "rules": {json}}}], "default_site": null}}"#
        );
        let table = ringmux_proto::sites::SiteTable::from_json(table.as_bytes()).unwrap();
        SiteRules::new(&table.sites[0].rules)
    }

    fn request(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        pairs
            .iter()
            .map(|(n, v)| {
                (
                    http::HeaderName::from_static(n),
                    HeaderValue::from_static(v),
                )
            })
            .collect()
    }

    #[test]
    fn rules_hsts_and_cors_go_on_the_response() {
        let s = site(
            r#"{"headers": {"set": {"x-frame-options": "DENY"}, "remove": ["server"]},
                "hsts": {"max_age": 600}, "cors": {"origins": ["https://a.example"], "credentials": true}}"#,
        );
        let from_a = request(&[("origin", "https://a.example")]);
        let mut h = request(&[("server", "x")]);
        Applied::new(&s, None, &from_a, true).response(&mut h);
        assert_eq!(h["x-frame-options"], "DENY");
        assert!(!h.contains_key("server"));
        assert_eq!(h["strict-transport-security"], "max-age=600");
        assert_eq!(h["access-control-allow-origin"], "https://a.example");
        assert_eq!(h["access-control-allow-credentials"], "true");
        assert_eq!(h["vary"], "origin");
        let mut other = HeaderMap::new();
        let from_b = request(&[("origin", "https://b.example")]);
        Applied::new(&s, None, &from_b, true).response(&mut other);
        assert!(!other.contains_key("access-control-allow-origin"));
    }

    #[test]
    fn a_preflight_from_an_allowed_origin_gets_204() {
        let s = site(
            r#"{"cors": {"origins": ["https://a.example"], "methods": ["GET", "PUT"],
                "headers": ["content-type"], "max_age": 600}}"#,
        );
        let pre = request(&[
            ("origin", "https://a.example"),
            ("access-control-request-method", "PUT"),
        ]);
        let r = Applied::new(&s, None, &pre, true)
            .preflight(&Method::OPTIONS, &pre)
            .expect("a preflight");
        assert_eq!(r.status, StatusCode::NO_CONTENT);
        assert_eq!(r.headers["access-control-allow-methods"], "GET, PUT");
        assert_eq!(r.headers["access-control-allow-headers"], "content-type");
        assert_eq!(r.headers["access-control-max-age"], "600");
        let evil = request(&[
            ("origin", "https://b.example"),
            ("access-control-request-method", "PUT"),
        ]);
        let a = Applied::new(&s, None, &evil, true);
        assert!(a.preflight(&Method::OPTIONS, &evil).is_none());
        let plain = Applied::new(&s, None, &pre, true);
        assert!(plain.preflight(&Method::GET, &pre).is_none());
    }

    #[test]
    fn error_pages_keep_the_status_and_are_not_stored() {
        let s = site(r#"{"errors": {"404": {"file": "/e/404.html", "body": "<p>gone</p>"}}}"#);
        let a = Applied::new(&s, None, &HeaderMap::new(), true);
        let r = a.error_page(Reply::text(StatusCode::NOT_FOUND, b"not found\n"));
        assert_eq!(r.status, StatusCode::NOT_FOUND);
        assert_eq!(r.headers["cache-control"], "no-store");
        assert_eq!(r.headers["content-type"], "text/html; charset=utf-8");
        assert!(matches!(r.body, Body::Memory(ref b) if b == "<p>gone</p>"));
        let other = a.error_page(Reply::text(StatusCode::FORBIDDEN, b"no\n"));
        assert!(!other.headers.contains_key("cache-control"));
        let fixed = Applied::new(&s, None, &HeaderMap::new(), false);
        let r = fixed.error_page(Reply::text(StatusCode::NOT_FOUND, b"mine\n"));
        assert!(matches!(r.body, Body::Static(b"mine\n")));
    }
}
