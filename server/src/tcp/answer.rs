//! One request over TCP, answered through the paths HTTP/3 takes: the router, then the
//! files, the built-ins or the proxy's exchange, plus `alt-svc`; counted by protocol, response
//! class and body bytes.

use std::io;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use http::{header, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Empty};
use hyper::body::Incoming;

use super::body::body_of;
use super::TcpBody;
use crate::access_log::Logged;
use crate::proxy::{ClientGone, Exchange, Upstream};
use crate::reply::{Body, Reply};
use crate::request::with_path;
use crate::rules::Applied;
use crate::sites::{Local, Router, Target};
use crate::stats::ServerStats;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// What a request over TCP needs of its connection.
pub(super) struct Connection {
    pub(super) router: Router,
    /// The connection's site, by its TLS server name.
    pub(super) site: Option<usize>,
    /// That name, for the access log.
    pub(super) sni: Option<Arc<str>>,
    pub(super) stats: Arc<ServerStats>,
    pub(super) alt_svc: Option<HeaderValue>,
    pub(super) remote: SocketAddr,
}

/// Answers one request over TCP through the paths HTTP/3 takes (the router, then the files,
/// the built-ins or the proxy's `Upstream::exchange`), plus `alt-svc`.
pub(super) async fn handle(
    conn: Connection,
    req: Request<Incoming>,
) -> (Response<TcpBody>, Option<Logged>) {
    let stats = &conn.stats;
    stats.requests_total.fetch_add(1, Ordering::Relaxed);
    let http1 = req.version() != http::Version::HTTP_2;
    let protocol = if http1 {
        stats.requests_h1.fetch_add(1, Ordering::Relaxed);
        "h1"
    } else {
        stats.requests_h2.fetch_add(1, Ordering::Relaxed);
        "h2"
    };
    let (mut parts, body) = req.into_parts();
    let choice = conn.router.choose(conn.site, &parts, http1);
    let site = choice.answering(conn.site);
    let mut logged = conn.router.begin_log(site, conn.remote, protocol, &parts);
    let (target, rules) = conn
        .router
        .target(choice, &parts.method, &parts.headers, &parts.uri);
    if let Some(l) = logged.as_mut() {
        l.note(rules.route_path(), || conn.sni.clone());
    }
    let mut resp = match target {
        Target::Proxy { upstream, path } => {
            let upstream = upstream.clone();
            if let Some(path) = path {
                parts.uri = with_path(&parts.uri, path);
            }
            rules.request(&mut parts.headers);
            let req = Request::from_parts(parts, body);
            proxy(&upstream, site, stats, conn.remote, req, &rules).await
        }
        Target::Local(local) => {
            let reply = local_reply(local, &parts.method, &parts.headers, body).await;
            respond(rules.error_page(reply), site, stats, &parts.method)
        }
    };
    rules.response(resp.headers_mut());
    if let Some(v) = conn.alt_svc {
        resp.headers_mut().insert(header::ALT_SVC, v);
    }
    (resp, logged)
}

/// Passes a request to the upstream: the proxy's one path, fed hyper's request body.
async fn proxy(
    upstream: &Arc<Upstream>,
    site: Option<usize>,
    stats: &Arc<ServerStats>,
    remote: SocketAddr,
    req: Request<Incoming>,
    rules: &Applied<'_>,
) -> Response<TcpBody> {
    let (parts, body) = req.into_parts();
    let body = body
        .map_err(|e| BoxError::from(ClientGone(Box::new(e))))
        .boxed_unsync();
    match upstream
        .exchange(Request::from_parts(parts, body), remote, false)
        .await
    {
        Exchange::Response(resp) => {
            stats.count_response(site, resp.status());
            let stats = stats.clone();
            resp.map(|body| {
                body.map_frame(move |frame| {
                    if let Some(data) = frame.data_ref() {
                        let n = data.len() as u64;
                        stats.bytes_sent.fetch_add(n, Ordering::Relaxed);
                    }
                    frame
                })
                // Counted already; hyper resets the HTTP/2 stream, or closes the HTTP/1.1
                // connection, rather than ending the body short.
                .map_err(io::Error::other)
                .boxed_unsync()
            })
        }
        Exchange::Reply(status, text) => {
            let method = Method::GET;
            respond(rules.own_error(status, text), site, stats, &method)
        }
        Exchange::ClientGone => {
            stats.requests_failed.fetch_add(1, Ordering::Relaxed);
            // hyper sends nothing for a request whose client is gone; the status is moot.
            let mut resp =
                Response::new(Empty::new().map_err(|never| match never {}).boxed_unsync());
            *resp.status_mut() = StatusCode::BAD_REQUEST;
            resp
        }
    }
}

/// The reply to a request this worker answers itself, as HTTP/3 makes it.
async fn local_reply(
    local: Local<'_>,
    method: &Method,
    headers: &http::HeaderMap,
    body: Incoming,
) -> Reply {
    match local {
        Local::EchoLen => match count_body(body).await {
            Ok(n) => Reply::new(StatusCode::OK, "text/plain", Body::Text(format!("{n}\n"))),
            Err(_) => Reply::text(StatusCode::BAD_REQUEST, b"request body broke off\n"),
        },
        Local::Get(lookup) => lookup.reply(method, headers).await,
        Local::Reply(reply) => reply,
    }
}

/// `reply` as hyper's response, counted (no body for a HEAD).
fn respond(
    reply: Reply,
    site: Option<usize>,
    stats: &Arc<ServerStats>,
    method: &Method,
) -> Response<TcpBody> {
    stats.count_response(site, reply.status);
    let mut resp = Response::new(if method == Method::HEAD {
        Empty::new().map_err(|never| match never {}).boxed_unsync()
    } else {
        body_of(reply.body, stats.clone())
    });
    *resp.status_mut() = reply.status;
    *resp.headers_mut() = reply.headers;
    resp
}

/// Reads a request body to its end, counting its bytes (never holding it).
async fn count_body(mut body: Incoming) -> Result<u64, hyper::Error> {
    let mut n = 0u64;
    while let Some(frame) = body.frame().await {
        if let Some(data) = frame?.data_ref() {
            n += data.len() as u64;
        }
    }
    Ok(n)
}
