//! The supervisor's side of the active health checks ([`ringmux_health`], a thread of its
//! own): each site table whose routes check their backends gets a health table
//! ([`HealthTable::for_sites`], made with the workers' template, placed in every worker it
//! starts at `ringmux_proto::HEALTH_TABLE_FD`), and the checks' thread is fed each new one
//! ([`Checks::follow`]) with what to probe for it. The thread writes the verdicts; this side
//! only hands tables over.

use std::sync::Arc;

use ringmux_health::{Board, HealthWriter, Plan};
use ringmux_proto::sites::SiteTable;

/// A health table and the plan its slots follow.
#[derive(Debug)]
pub struct HealthTable {
    pub writer: Arc<HealthWriter>,
    pub plan: Plan,
}

// One table is equal only to itself (a launch plan compares the tables it names).
impl PartialEq for HealthTable {
    fn eq(&self, other: &Self) -> bool {
        std::ptr::eq(self, other)
    }
}

impl Eq for HealthTable {}

impl HealthTable {
    /// The table of `sites`: `None` when no route checks health, or when the table cannot
    /// be made (logged: every worker then decides by passive health alone).
    pub fn for_sites(sites: &SiteTable) -> Option<Arc<HealthTable>> {
        let plan = Plan::of(sites);
        if plan.is_empty() {
            return None;
        }
        match HealthWriter::create(plan.slots()) {
            Ok(writer) => Some(Arc::new(HealthTable {
                writer: Arc::new(writer),
                plan,
            })),
            Err(e) => {
                tracing::warn!(error = %e, "no health table: workers decide by passive health alone");
                None
            }
        }
    }
}

/// The checks' thread, started with the first table to feed, and the table fed last.
pub struct Checks {
    board: Board,
    running: Option<ringmux_health::Checks>,
    fed: Option<Arc<HealthTable>>,
}

impl Checks {
    /// No thread yet; it counts on `board` (the metrics') once started.
    pub fn new(board: Board) -> Checks {
        Checks {
            board,
            running: None,
            fed: None,
        }
    }

    /// Feeds `table` (the template's) to the thread if it is not the one fed last; starts the
    /// thread for the first.
    pub fn follow(&mut self, table: Option<&Arc<HealthTable>>) {
        let Some(table) = table else {
            return;
        };
        if self.fed.as_ref().is_some_and(|f| Arc::ptr_eq(f, table)) {
            return;
        }
        self.fed = Some(table.clone());
        if self.running.is_none() {
            match ringmux_health::Checks::start(self.board.clone()) {
                Ok(c) => self.running = Some(c),
                Err(e) => {
                    tracing::warn!(error = %e, "the health checks' thread did not start: no active health checks");
                    return;
                }
            }
        }
        if let Some(c) = &self.running {
            c.feed(table.writer.clone(), table.plan.clone());
        }
    }
}
