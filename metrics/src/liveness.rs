//! Which lanes are up: a flag per lane, written by the supervisor and the data plane, read by
//! them and by the exposition ([`names::WORKER_UP`](super::names::WORKER_UP)). Here, below all
//! three, so that the metrics need not reach into the data plane for it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// What the supervisor and the data plane tell each other about each lane without a
/// message: whether it is up (set by the supervisor when the worker is ready, cleared by either
/// when it dies or misbehaves). The metrics read it too.
#[derive(Debug)]
pub struct Liveness {
    up: Box<[AtomicBool]>,
}

impl Liveness {
    /// `lanes` lanes, all down.
    pub fn new(lanes: usize) -> Arc<Self> {
        Arc::new(Liveness {
            up: (0..lanes).map(|_| AtomicBool::new(false)).collect(),
        })
    }

    /// Marks instance `i` up or down. Release: a worker marked up has attached to its ring.
    pub fn set_up(&self, i: usize, up: bool) {
        self.up[i].store(up, Ordering::Release);
    }

    /// Whether instance `i` is up. Relaxed: the data plane reads it once per batch and only
    /// decides whether to push; pushing to a ring whose worker is not attached yet is harmless.
    pub fn is_up(&self, i: usize) -> bool {
        self.up[i].load(Ordering::Relaxed)
    }
}
