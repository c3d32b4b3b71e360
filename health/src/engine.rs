//! The checks' thread: a task per target ([`crate::plan::Target`]) probing it every interval,
//! and the reconciliation when a new plan arrives (a reload): targets kept run on with their
//! verdict, new ones start, gone ones stop. A verdict that changes is written to every table
//! fed ([`crate::Feed`]) that has a slot for its target, and to the board.

use std::collections::HashMap;

use ringmux_ring::health::Verdict;
use tokio::sync::mpsc::UnboundedReceiver;
use tokio::task::JoinHandle;
use tokio::time::MissedTickBehavior;

use crate::board::{Board, Feed};
use crate::plan::{Target, TargetKey};
use crate::probe::{Outcome, Prober};

/// What the demux's end sends the thread.
pub enum Command {
    /// Probe the plan of this table from now on, and write to it too.
    Feed(Feed),
}

/// A target's task and the check it runs.
struct Running {
    task: JoinHandle<()>,
    target: Target,
}

/// Runs until the demux's end is dropped.
pub async fn run(mut commands: UnboundedReceiver<Command>, board: Board) {
    let mut running: HashMap<TargetKey, Running> = HashMap::new();
    while let Some(Command::Feed(feed)) = commands.recv().await {
        let targets = feed.plan.targets.clone();
        board.feed(feed);
        running.retain(|key, r| {
            let kept = targets
                .iter()
                .any(|t| t.key == *key && t.check == r.target.check);
            if !kept {
                r.task.abort();
            }
            kept
        });
        for target in targets {
            if running.contains_key(&target.key) {
                continue;
            }
            let task = tokio::spawn(probe_every_interval(target.clone(), board.clone()));
            running.insert(target.key.clone(), Running { task, target });
        }
    }
    for r in running.into_values() {
        r.task.abort();
    }
}

/// Probes `target` every interval for as long as it is in the plan. Each probe is ended by
/// its timeout, which is shorter than the interval, so probes of one target never overlap and
/// a hanging backend holds one connection at most.
async fn probe_every_interval(target: Target, board: Board) {
    let key = &target.key;
    let prober = Prober::new(&key.url, &key.tls, &key.path);
    let mut ticks = tokio::time::interval(target.check.interval());
    ticks.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut tracker = board.tracker(key);
    loop {
        ticks.tick().await;
        let outcome = prober.probe(target.check.timeout()).await;
        let changed = tracker.observe(
            outcome == Outcome::Pass,
            target.check.passes(),
            target.check.fails(),
        );
        board.observed(key, outcome, tracker);
        match changed {
            Some(Verdict::Down) => tracing::warn!(
                backend = %key.url, path = %key.path, result = outcome.as_str(),
                "backend down by its health check; ringmux_backend_up 0"
            ),
            Some(_) => tracing::info!(
                backend = %key.url, path = %key.path,
                "backend up by its health check; ringmux_backend_up 1"
            ),
            None => {}
        }
    }
}
