//! The demux's verdicts on the backends of one route that checks their health
//! (`ringmux_proto::route::ActiveHealth`): read from the health table the demux placed in this
//! worker (`ringmux_worker::health_table`), at the route's slots (`HealthSlots`: the route's
//! first slot, then one per backend in the route's order). The pool leaves a backend marked
//! down out of its choice; a slot with no verdict (not probed yet, or a value this build does
//! not know) leaves the worker to decide alone.

use std::sync::Arc;

use ringmux_ring::health::{HealthReader, Verdict};

/// A route's view of the health table.
#[derive(Debug, Clone)]
pub struct Verdicts {
    table: Arc<HealthReader>,
    first: u32,
}

impl Verdicts {
    /// The verdicts of a route whose first slot is `first`.
    pub fn new(table: Arc<HealthReader>, first: u32) -> Verdicts {
        Verdicts { table, first }
    }

    /// The demux's verdict on the route's backend `i` (in its order), loaded once.
    pub fn of(&self, i: usize) -> Verdict {
        let slot = u32::try_from(i)
            .ok()
            .and_then(|i| self.first.checked_add(i));
        slot.map_or(Verdict::Unknown, |s| self.table.get(s))
    }

    /// Whether backend `i` is down by the demux's check.
    pub fn down(&self, i: usize) -> bool {
        self.of(i) == Verdict::Down
    }
}
