//! The accept loop of one listener: it takes connections from the queue every worker shares,
//! holds them to the cap ([`Registry`]), spawns each one's task ([`Conn`]) and, on drain,
//! stops accepting and waits for its connections to end. It never reads or writes a
//! connection. The listeners' entry points, [`serve`] and [`serve_plain`], start it.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use tokio::sync::watch;
use tokio::task::JoinSet;
use tracing::{debug, info};

use super::conn::Conn;
use super::registry::{Admission, Registry};
use super::{Kind, PlainAnswer, TcpErrorKind, TcpOptions};
use crate::sites::Router;
use crate::stats::ServerStats;

/// Serves HTTPS over TCP on `listener` until `shutdown` becomes `true` (or its sender is
/// dropped), then drains: see the module documentation.
pub async fn serve(
    listener: tokio::net::TcpListener,
    tls: Arc<rustls::ServerConfig>,
    sites: impl Into<Router>,
    stats: Arc<ServerStats>,
    shutdown: watch::Receiver<bool>,
    opts: TcpOptions,
) {
    let https = Kind::Https(tokio_rustls::TlsAcceptor::from(tls));
    serve_connections(listener, https, sites.into(), stats, shutdown, opts).await;
}

/// Serves plain HTTP/1.1 on `listener` until `shutdown`, as [`serve`] serves HTTPS (the same
/// accepting, cap, timeouts, drain and graceful close), each request answered by `answer`.
/// `what` names the listener in the log. The plain-HTTP listener (`crate::redirect`) runs on it.
pub(crate) async fn serve_plain(
    listener: tokio::net::TcpListener,
    what: &'static str,
    answer: PlainAnswer,
    router: Router,
    stats: Arc<ServerStats>,
    shutdown: watch::Receiver<bool>,
    opts: TcpOptions,
) {
    let plain = Kind::Plain { what, answer };
    serve_connections(listener, plain, router, stats, shutdown, opts).await;
}

/// Serves the connections of `listener` as `kind` until `shutdown`, then drains: see the
/// module documentation of `tcp`.
async fn serve_connections(
    listener: tokio::net::TcpListener,
    kind: Kind,
    router: Router,
    stats: Arc<ServerStats>,
    mut shutdown: watch::Receiver<bool>,
    opts: TcpOptions,
) {
    stats.sites.init(&router);
    let what = kind.name();
    let mut opts = opts;
    let accepting = opts.accepting.take();
    let opts = Arc::new(opts);
    let mut connections = JoinSet::new();
    let mut registry = Registry::new();
    let mut stopping = *shutdown.borrow_and_update();
    while !stopping {
        tokio::select! {
            changed = shutdown.changed() => {
                stopping = changed.is_err() || *shutdown.borrow_and_update();
            }
            accepted = listener.accept() => {
                let (stream, remote) = match accepted {
                    Ok(a) => a,
                    // Another worker took it first (one queue, many acceptors), or a
                    // connection reset before it was accepted: nothing to do.
                    Err(e) => {
                        debug!(error = %e, "TCP accept");
                        continue;
                    }
                };
                stats.tcp_connections.fetch_add(1, Ordering::Relaxed);
                match registry.admit(opts.max_connections) {
                    Admission::Room => {}
                    Admission::MadeRoom => stats.count_tcp_error(TcpErrorKind::Evicted),
                    Admission::Full => {
                        stats.count_tcp_error(TcpErrorKind::OverCap);
                        drop(stream);
                        continue;
                    }
                }
                let tracked = registry.next();
                let conn = Conn {
                    kind: kind.clone(),
                    router: router.clone(),
                    stats: stats.clone(),
                    shutdown: shutdown.clone(),
                    opts: opts.clone(),
                    tracked: tracked.clone(),
                };
                let task = connections.spawn(conn.run(stream, remote));
                registry.insert(task.id(), tracked);
            }
            Some(joined) = connections.join_next_with_id(), if !connections.is_empty() => {
                registry.remove(match joined {
                    Ok((id, ())) => id,
                    Err(e) => e.id(),
                });
            }
        }
    }
    // This worker takes no more connections; the queue stays with the others and the demux.
    drop(listener);
    drop(accepting);
    info!(
        connections = connections.len(),
        "{what} stopping: no more accepts, draining"
    );
    while connections.join_next().await.is_some() {}
    // The proxy's tunnels outlive their HTTP/1.1 connections' tasks.
    opts.tunnels.all_closed().await;
    info!("{what} stopped");
}
