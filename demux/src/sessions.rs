//! The demux's half of the cross-instance TLS session store: one shared, bounded, single-use
//! cache ([`SessionCache`]) and one thread per worker answering its session socket. Workers
//! store the sessions they issue tickets for and take them back on resumption, so 0-RTT works
//! whichever instance a resumed connection lands on (see `ringmux_worker::sessions`).

use std::os::fd::OwnedFd;
use std::sync::Arc;

use ringmux_worker::sessions::SessionCache;

/// Serves every worker's session requests from one cache.
pub struct Sessions {
    cache: Arc<SessionCache>,
}

impl Sessions {
    pub fn new() -> Self {
        Sessions {
            cache: Arc::new(SessionCache::new()),
        }
    }

    /// Serves instance `i`'s session socket on its own thread until the worker closes it
    /// (exits or dies); a malformed request is counted and answered with nothing.
    pub fn serve(&self, instance: u8, sock: OwnedFd) {
        let cache = self.cache.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("sessions-{instance}"))
            .spawn(move || {
                if let Err(e) = cache.serve_worker(sock) {
                    tracing::warn!(instance, error = %e, "session socket failed");
                }
            });
        if let Err(e) = spawned {
            // Without the thread the worker's lookups time out: resumption degrades to full
            // handshakes, nothing else breaks.
            tracing::error!(instance, error = %e, "could not start the session thread");
        }
    }
}
