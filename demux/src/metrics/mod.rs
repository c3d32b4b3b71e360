//! What the demux counts and how it is shown: [`counters`] (every datagram's fate and each
//! worker's reports), [`liveness`] (which lanes are up), [`names`] (every metric name, once),
//! [`exposition`] (the Prometheus endpoint), [`series`] (what workers report under names of
//! their own), [`scrape`] (the one reader of that text, for `ringmux stats`, tests and
//! benchmarks) and [`stats`] (the `ringmux stats` table).

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
