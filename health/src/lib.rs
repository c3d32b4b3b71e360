//! Active health checks of upstream backends: each backend a route checks (`health = { path,
//! interval, timeout }`, `ringmux_proto::route::ActiveHealth`) is probed once per interval for
//! the box, and its verdict published to every worker through the health table
//! (`ringmux_ring::health`), so every worker agrees and a backend gets one probe per interval
//! whatever the number of workers.
//!
//! # Where it runs
//!
//! On a thread of its own in the demux ([`Checks::start`]), with its own current-thread tokio
//! runtime: never on the receive thread nor the supervisor's, never in a worker (workers are
//! confined and decide nothing for each other). The demux hands it each new health table with
//! what to probe for it ([`Checks::feed`], a [`Plan`] of the site table); the thread writes
//! every verdict into the tables it was fed, and counts every probe on the [`Board`] the
//! metrics read.
//!
//! * `plan`: the targets of a site table, each distinct backend and path once, sans I/O.
//! * `state`: a target's verdict from its results in a row, sans I/O.
//! * `probe`: one probe over the backend's protocol, cut by its timeout.
//! * `engine`: the thread's tasks, one per target, and the reconciliation of a new plan.
//!
//! Nothing here may panic on what a backend answers: a probe's every end is an [`Outcome`].

mod board;
mod engine;
mod plan;
mod probe;
mod state;

pub use board::{BackendRow, Board, Feed, ProbeRow, MAX_FEEDS};
pub use plan::{label_of, Plan, SlotRow, Target, TargetKey};
pub use probe::Outcome;
pub use ringmux_ring::health::{HealthTableError, HealthWriter, Verdict};
pub use state::Tracker;

use std::sync::Arc;

use engine::Command;

/// The checks' thread, and the demux's end of it. Dropping it stops the thread and every
/// probe.
pub struct Checks {
    commands: Option<tokio::sync::mpsc::UnboundedSender<Command>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Checks {
    /// Starts the thread, which counts on `board`.
    pub fn start(board: Board) -> std::io::Result<Checks> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let (commands, receiver) = tokio::sync::mpsc::unbounded_channel();
        let thread = std::thread::Builder::new()
            .name("ringmux-health".into())
            .spawn(move || runtime.block_on(engine::run(receiver, board)))?;
        Ok(Checks {
            commands: Some(commands),
            thread: Some(thread),
        })
    }

    /// Probes `plan` from now on (targets of the plans before it that it still names keep
    /// their verdict), and writes every verdict into `table` too.
    pub fn feed(&self, table: Arc<HealthWriter>, plan: Plan) {
        if let Some(c) = &self.commands {
            // A send fails only when the thread is gone (it panicked): nothing to feed then.
            let _ = c.send(Command::Feed(Feed { table, plan }));
        }
    }
}

impl Drop for Checks {
    fn drop(&mut self) {
        // The thread ends when its channel closes.
        self.commands.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
