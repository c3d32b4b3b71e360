//! The atomics the ring algorithm uses: `core`'s in real builds, loom's under `--cfg loom`, so that
//! `ring.rs` runs unchanged inside the loom model checker (tokio's `src/loom`, crossbeam's
//! `primitive` module do the same).

#[cfg(not(loom))]
pub(crate) use core::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};
