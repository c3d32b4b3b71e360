//! What ringmux's demux counts and how it is shown: [`counters`] (every datagram's fate and
//! each worker's reports), [`liveness`] (which lanes are up), [`names`] (every metric name,
//! once), [`exposition`] (the Prometheus endpoint), [`series`] (what workers report under names
//! of their own), [`scrape`] (the one reader of that text, for `ringmux stats`, tests and
//! benchmarks) and [`stats`] (the `ringmux stats` table).
//!
//! The demux's data plane, supervisor and log thread write the counters; this crate never
//! touches a ring, a worker, a file or a socket but the endpoint's and the scraper's, and knows
//! the demux only by what it counts (the demux re-exports it as `ringmux_demux::metrics`). Its
//! one dependency of its own is the Prometheus text encoder (`prometheus-client`).
#![forbid(unsafe_code)]

pub mod counters;
pub mod exposition;
pub mod liveness;
pub mod names;
pub mod scrape;
pub mod series;
pub mod stats;

pub use counters::{Counters, DropReason, InstanceCounters, LaneState, TakeResult};
pub use liveness::Liveness;
pub use scrape::{fetch, Scrape};
