//! The plain-HTTP listener (`--redirect-http`): every request is answered with a 301 to
//! `https://` with the same host and path, except the ACME HTTP-01 challenge (RFC 8555 §8.3):
//! `GET` (or `HEAD`) `/.well-known/acme-challenge/TOKEN` for a pending token of the worker's
//! [`AcmeAnswers`] (`TcpOptions::acme`) is answered 200 with its key authorization as
//! `text/plain`, before the redirect.
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
        None => redirect_reply(&parts, https_port),
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
/// when 443); 400 without a usable host.
fn redirect_reply(parts: &http::request::Parts, https_port: u16) -> Reply {
    let host = authority_of(parts).and_then(|h| h.parse::<http::uri::Authority>().ok());
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
