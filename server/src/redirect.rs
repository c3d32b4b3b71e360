//! The plain-HTTP listener (`--redirect-http`): a request is answered with a 301 to
//! `https://` with the same host and path, except the ACME HTTP-01 challenge (RFC 8555 §8.3):
//! `GET` (or `HEAD`) `/.well-known/acme-challenge/TOKEN` for a pending token of the worker's
//! [`AcmeAnswers`] (`TcpOptions::acme`) is answered 200 with its key authorization as
//! `text/plain`, before the redirect (the demux relays only the tokens of its ACME sites' names).
//!
//! Redirects go only to our names: with `[[site]]`s, a host that no site is named (exactly or by
//! a wildcard; the default site, which catches unknown names on TLS, does not make every name
//! ours) gets 421 Misdirected Request (RFC 9110 §15.5.20), never a redirect, so the listener is
//! no open redirect. The host is the request target's authority in absolute form, else `Host`
//! (RFC 9112 §3.2.2); one with user information (`a@evil.example`, which RFC 9110 §4.2.4
//! deprecates and §7.2's `Host` does not allow) gets 400. The command line's site (no
//! `[[site]]`) has no names: it answers every host on TLS, and its redirect keeps any host.
//!
//! A front on the TCP transport: connections are accepted, capped, timed out, drained and
//! closed as [`crate::tcp`] does for HTTPS (`tcp::serve_plain`); this module only answers.

use std::net::SocketAddr;
use std::sync::Arc;

use futures_util::FutureExt;
use http::{header, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Empty};
use hyper::body::Incoming;
use ringmux_worker::AcmeAnswers;
use std::sync::atomic::Ordering;
use tokio::sync::watch;
use tracing::debug;

use crate::reply::{Body, Reply};
use crate::request::authority_of;
use crate::sites::Router;
use crate::stats::ServerStats;
use crate::tcp::{body_of, serve_plain, PlainAnswer, TcpBody, TcpOptions};

/// Serves plain HTTP on `listener` (`--redirect-http`) until `shutdown`, as `tcp::serve` serves
/// HTTPS (the same connection handling and [`TcpOptions`]): every request is answered with a
/// 301 to `https://` with the same host and path, on
/// `https_port` (left out when 443). A request without a usable `host` gets 400. Counted as
/// HTTP/1.1 requests, and logged when the worker logs, under the site the host names.
pub async fn serve_redirects(
    listener: tokio::net::TcpListener,
    https_port: u16,
    sites: impl Into<Router>,
    stats: Arc<ServerStats>,
    shutdown: watch::Receiver<bool>,
    opts: TcpOptions,
) {
    let router: Router = sites.into();
    let answer: PlainAnswer = {
        let (router, stats, acme) = (router.clone(), stats.clone(), opts.acme.clone());
        Arc::new(move |remote, req| {
            let (router, stats, acme) = (router.clone(), stats.clone(), acme.clone());
            redirect(router, stats, acme, https_port, remote, req).boxed()
        })
    };
    let what = "plain HTTP (redirects)";
    serve_plain(listener, what, answer, router, stats, shutdown, opts).await;
}

/// The answer to a request on the plain-HTTP listener: the key authorization of a pending
/// HTTP-01 challenge, else a 301 to `https://HOST[:PORT]PATH`.
async fn redirect(
    router: Router,
    stats: Arc<ServerStats>,
    acme: AcmeAnswers,
    https_port: u16,
    remote: SocketAddr,
    req: Request<Incoming>,
) -> Response<TcpBody> {
    stats.requests_total.fetch_add(1, Ordering::Relaxed);
    stats.requests_h1.fetch_add(1, Ordering::Relaxed);
    let (parts, _body) = req.into_parts();
    let site = router.site_for_host(authority_of(&parts));
    let logged = router.begin_log(site, remote, "h1", &parts);
    let reply = match http01_answer(&acme, &parts) {
        Some(key_authorization) => {
            debug!(%remote, "HTTP-01 answered");
            Reply::new(StatusCode::OK, "text/plain", Body::Text(key_authorization))
        }
        None => redirect_reply(&router, &parts, https_port),
    };
    stats.count_response(site, reply.status);
    let head = parts.method == Method::HEAD;
    let bytes = if head { 0 } else { reply.body.len() };
    if let Some(l) = logged {
        l.end(Some(reply.status), bytes);
    }
    let mut resp = Response::new(if head {
        Empty::new().map_err(|never| match never {}).boxed_unsync()
    } else {
        body_of(reply.body, stats)
    });
    *resp.status_mut() = reply.status;
    *resp.headers_mut() = reply.headers;
    resp
}

/// HTTP-01 (RFC 8555 §8.3): the key authorization for `GET` or `HEAD`
/// `/.well-known/acme-challenge/TOKEN` of a pending token, whatever the host (the token alone
/// names the challenge).
fn http01_answer(acme: &AcmeAnswers, parts: &http::request::Parts) -> Option<String> {
    if parts.method != Method::GET && parts.method != Method::HEAD {
        return None;
    }
    let token = parts
        .uri
        .path()
        .strip_prefix("/.well-known/acme-challenge/")?;
    acme.http01(token)
}

/// The 301 to `https://HOST[:PORT]PATH` for a request of `parts`, on `https_port` (left out
/// when 443); 400 without a usable host or with user information in it; 421 for a host no
/// site of `router` is named, when its sites have names.
fn redirect_reply(router: &Router, parts: &http::request::Parts, https_port: u16) -> Reply {
    let raw = authority_of(parts);
    if raw.is_some_and(|h| h.contains('@')) {
        return Reply::text(
            StatusCode::BAD_REQUEST,
            b"a host with user information is not redirected\n",
        );
    }
    let host = raw.and_then(|h| h.parse::<http::uri::Authority>().ok());
    if let Some(h) = &host {
        if router.has_names() && router.site_named(h.as_str()).is_none() {
            return Reply::text(
                StatusCode::MISDIRECTED_REQUEST,
                b"no site here has that name\n",
            );
        }
    }
    let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    let location = host.and_then(|host| {
        let port = if https_port == 443 {
            String::new()
        } else {
            format!(":{https_port}")
        };
        HeaderValue::from_str(&format!("https://{}{port}{path}", host.host())).ok()
    });
    match location {
        Some(location) => {
            let mut r = Reply::text(StatusCode::MOVED_PERMANENTLY, b"moved to https\n");
            r.headers.insert(header::LOCATION, location);
            r
        }
        None => Reply::text(
            StatusCode::BAD_REQUEST,
            b"a host is needed to redirect to https\n",
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ringmux_proto::sites::{Site, SiteTable};

    fn router(names: &[&[&str]], default_site: Option<usize>) -> Router {
        let sites = names
            .iter()
            .enumerate()
            .map(|(i, names)| Site {
                label: format!("s{i}"),
                names: names.iter().map(|n| n.to_string()).collect(),
                cert_pem: String::new(),
                key_pem: String::new(),
                acme: false,
                routes: Vec::new(),
                redirect_names: Vec::new(),
                compress: None,
                rules: Default::default(),
                limits: Default::default(),
            })
            .collect();
        let table = SiteTable {
            sites,
            default_site,
        };
        Router::new(&table, &crate::sites::RouterOptions::default()).expect("a router")
    }

    /// The status and `location` of the answer to `target` with `host`.
    fn answer(router: &Router, target: &str, host: Option<&str>) -> (u16, Option<String>) {
        let mut req = Request::builder().uri(target);
        if let Some(h) = host {
            req = req.header(header::HOST, h);
        }
        let (parts, ()) = req.body(()).unwrap().into_parts();
        let r = redirect_reply(router, &parts, 8443);
        let location = r
            .headers
            .get(header::LOCATION)
            .map(|l| l.to_str().unwrap().to_owned());
        (r.status.as_u16(), location)
    }

    #[test]
    fn with_sites_only_their_names_are_redirected() {
        // The second site is the default: it catches unknown names on TLS, not here.
        let r = router(&[&["a.test"], &["b.test", "*.w.test"]], Some(1));
        for (host, to) in [
            ("a.test", "a.test"),
            ("A.TEST", "A.TEST"),
            ("a.test.", "a.test."),
            ("a.test:8080", "a.test"),
            ("x.w.test", "x.w.test"),
        ] {
            assert_eq!(
                answer(&r, "/p?q=1", Some(host)),
                (301, Some(format!("https://{to}:8443/p?q=1"))),
                "{host}"
            );
        }
        for host in [
            "evil.example",
            "evil.example:80",
            "w.test",
            "a.test.evil.example",
        ] {
            assert_eq!(answer(&r, "/", Some(host)), (421, None), "{host}");
        }
        // The absolute form's authority is the host (RFC 9112 §3.2.2), whatever `Host` says.
        assert_eq!(
            answer(&r, "http://evil.example/x", Some("a.test")),
            (421, None)
        );
        assert_eq!(answer(&r, "http://a.test/x", Some("evil.example")).0, 301);
        // User information: 400, in either place.
        for (target, host) in [
            ("/", "a@evil.example"),
            ("/", "a.test@evil.example"),
            ("http://a.test@evil.example/", "a.test"),
            ("http://u:p@a.test/", "a.test"),
        ] {
            assert_eq!(
                answer(&r, target, Some(host)),
                (400, None),
                "{target} {host}"
            );
        }
        // No host at all.
        assert_eq!(answer(&r, "/", None), (400, None));
    }

    #[test]
    fn the_command_line_site_redirects_any_host_but_not_user_information() {
        let r = router(&[&[]], Some(0));
        assert_eq!(
            answer(&r, "/p", Some("example.com:8080")),
            (301, Some("https://example.com:8443/p".into()))
        );
        assert_eq!(answer(&r, "/", Some("a@example.com")), (400, None));
    }
}
