//! `ringmux-ring`: a lock-free single-producer/single-consumer datagram ring in memfd-backed
//! shared memory, with a pipe doorbell that rings only when the consumer sleeps.
//!
//! The demux creates a ring per worker ([`Producer::create`]) and hands the worker three
//! descriptors ([`Producer::handles`]); the worker attaches ([`Consumer::attach`]), which checks
//! everything it maps. `shm-layout.md` at the repository root is the normative byte layout and
//! protocol. This crate knows nothing of QUIC or sockets.
//!
//! Files: `layout.rs` (shared structs, offset asserts), `ring.rs` (the algorithm, no syscalls),
//! `shm.rs` (memfd, mmap, seals, the public halves), `doorbell.rs` (pipe), `config.rs`
//! (geometry and its bounds), `spin.rs` (how an idle consumer spins: [`SpinPolicy`]),
//! `tally.rs` (the single-writer counter tables of per-client rate limits, beside the rings),
//! `health.rs` (the demux's verdict on each checked backend, read-only to workers).
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(clippy::undocumented_unsafe_blocks)]

pub mod config;
pub mod doorbell;
#[cfg(not(loom))]
#[doc(hidden)]
pub mod fuzzing;
#[cfg(not(loom))]
pub mod health;
pub mod layout;
#[cfg_attr(loom, allow(dead_code))]
mod ring;
#[cfg(not(loom))]
mod shm;
pub mod spin;
mod sync;
#[cfg(not(loom))]
pub mod tally;

pub use config::{ConfigError, RingConfig, RingField};
pub use doorbell::{Doorbell, DoorbellReader};
pub use ring::{
    decode_desc, encode_desc, ConsumerViolation, Datagram, DatagramMeta, Drained, InvalidSlot,
    ProducerViolation, PushError,
};
#[cfg(not(loom))]
pub use shm::{
    AttachError, Consumer, ConsumerHandles, Producer, ProducerFds, ProducerState, RingStats,
    WaitError,
};
pub use spin::{AdaptiveSpin, SpinPolicy};

/// The algorithm's halves over arbitrary memory, for the loom model (`tests/loom.rs`).
#[cfg(loom)]
pub mod model;

/// `CLOCK_MONOTONIC` in nanoseconds: the clock of [`DatagramMeta::rx_timestamp_ns`], so that a
/// consumer in another process can compute ring latency (the vDSO answers it without a syscall).
/// `CLOCK_MONOTONIC` always exists, so the error branch (0) is never taken.
#[inline]
pub fn monotonic_ns() -> u64 {
    use nix::time::{clock_gettime, ClockId};
    clock_gettime(ClockId::CLOCK_MONOTONIC).map_or(0, |ts| {
        ts.tv_sec() as u64 * 1_000_000_000 + ts.tv_nsec() as u64
    })
}
