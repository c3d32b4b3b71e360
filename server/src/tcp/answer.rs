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
use super::registry::Tracked;
use super::TcpBody;
use crate::access_log::Logged;
use crate::compress::ProxyCoding;
use crate::proxy::pool::Pool;
use crate::proxy::{Ask, ClientGone, ClientSide, Exchange, Opened, TunnelOptions};
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
    /// The connection as its listener sees it: a tunnel keeps a request in flight on it.
    pub(super) tracked: Arc<Tracked>,
    pub(super) tunnels: Arc<TunnelOptions>,
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
    let (target, rules) = conn.router.target_for(
        choice,
        &parts.method,
        &parts.headers,
        &parts.uri,
        conn.remote.ip(),
    );
    if let Some(l) = logged.as_mut() {
        l.note(rules.route_path(), || conn.sni.clone());
    }
    let mut resp = match target {
        Target::Proxy {
            upstream,
            path,
            compress,
        } => {
            let upstream = upstream.clone();
            if let Some(path) = path {
                parts.uri = with_path(&parts.uri, path);
            }
            let ask = Ask::of(&parts);
            // What the client accepts, before the route's rules change the request.
            let coding = ProxyCoding::of(&parts.method, &parts.headers, compress);
            rules.request(&mut parts.headers);
            match ask {
                Some(ask) => tunnel(&conn, &upstream, site, parts, ask, &mut logged, &rules).await,
                None => {
                    let req = Request::from_parts(parts, body);
                    proxy(&upstream, site, stats, conn.remote, req, coding, &rules).await
                }
            }
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

/// Opens a tunnel through the upstream for the request head `parts` that asked `ask`: its
/// 101 (200 over HTTP/2) with the tunnel running from then on, holding the request's
/// access-log line (taken from `logged`) and a request in flight on the connection; or the
/// upstream's answer when it did not switch.
async fn tunnel(
    conn: &Connection,
    pool: &Arc<Pool>,
    site: Option<usize>,
    mut parts: http::request::Parts,
    ask: Ask,
    logged: &mut Option<Logged>,
    rules: &Applied<'_>,
) -> Response<TcpBody> {
    let Some(upgrade) = parts.extensions.remove::<hyper::upgrade::OnUpgrade>() else {
        // hyper gives every request its pending upgrade; none is a bug, not the client's.
        return reply(
            site,
            &conn.stats,
            StatusCode::INTERNAL_SERVER_ERROR,
            b"no upgrade\n",
        );
    };
    let client = ClientSide {
        upgrade,
        stats: conn.stats.clone(),
        tunnels: conn.tunnels.clone(),
        hold: Box::new(conn.tracked.begin(&conn.stats)),
    };
    match pool.tunnel(parts, ask, conn.remote, client, logged).await {
        Opened::Head(head) => {
            conn.stats.count_response(site, head.status);
            Response::from_parts(
                head,
                Empty::new().map_err(|never| match never {}).boxed_unsync(),
            )
        }
        Opened::Exchange(exchange) => answer(exchange, site, &conn.stats, ProxyCoding::NONE, rules),
    }
}

/// Passes a request to the upstream: the proxy's one path, fed hyper's request body.
async fn proxy(
    upstream: &Arc<Pool>,
    site: Option<usize>,
    stats: &Arc<ServerStats>,
    remote: SocketAddr,
    req: Request<Incoming>,
    coding: ProxyCoding,
    rules: &Applied<'_>,
) -> Response<TcpBody> {
    let (parts, body) = req.into_parts();
    let body = body
        .map_err(|e| BoxError::from(ClientGone(Box::new(e))))
        .boxed_unsync();
    let exchange = upstream
        .exchange(Request::from_parts(parts, body), remote, false)
        .await;
    answer(exchange, site, stats, coding, rules)
}

/// The response of what an exchange with the upstream came to.
fn answer(
    exchange: Exchange,
    site: Option<usize>,
    stats: &Arc<ServerStats>,
    coding: ProxyCoding,
    rules: &Applied<'_>,
) -> Response<TcpBody> {
    match exchange {
        Exchange::Response(resp) => {
            stats.count_response(site, resp.status());
            let stats = stats.clone();
            let (mut head, body) = resp.into_parts();
            let body = coding.apply(&mut head, body);
            Response::from_parts(head, body).map(|body| {
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

/// Our short `text/plain` reply with `status`.
fn reply(
    site: Option<usize>,
    stats: &Arc<ServerStats>,
    status: StatusCode,
    text: &'static [u8],
) -> Response<TcpBody> {
    stats.count_response(site, status);
    let reply = Reply::text(status, text);
    let mut resp = Response::new(body_of(reply.body, stats.clone()));
    *resp.status_mut() = reply.status;
    *resp.headers_mut() = reply.headers;
    resp
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
