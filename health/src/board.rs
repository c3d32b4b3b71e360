//! What the checks know, shared by their thread (which writes) and the metrics (which read):
//! the tables fed, newest first, and each target's verdict and probes counted.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use ringmux_ring::health::{HealthWriter, Verdict};

use crate::plan::{label_of, Plan, TargetKey};
use crate::probe::Outcome;
use crate::state::Tracker;

/// How many health tables the thread writes at once: the newest, and the ones before it that
/// workers started from may still read (a worker restarted after a certificate change, a
/// generation draining after a reload).
pub const MAX_FEEDS: usize = 4;

/// A health table and what to probe for it.
pub struct Feed {
    pub table: Arc<HealthWriter>,
    pub plan: Plan,
}

/// What the checks know, shared by their thread (which writes) and the metrics (which read).
#[derive(Clone, Default)]
pub struct Board(Arc<Mutex<BoardState>>);

impl std::fmt::Debug for Board {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Board").finish_non_exhaustive()
    }
}

#[derive(Default)]
struct BoardState {
    /// The tables written, newest first.
    feeds: Vec<Feed>,
    status: HashMap<TargetKey, TargetStatus>,
}

/// One slot of the newest table, for `ringmux_backend_up{site,route,backend}`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BackendRow {
    pub site: String,
    pub route: String,
    pub backend: String,
    pub verdict: Verdict,
}

/// One target of the newest plan, for `ringmux_health_probes_total{backend,path,result}`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProbeRow {
    pub backend: String,
    pub path: String,
    /// Probes by [`Outcome`], in [`Outcome::ALL`] order.
    pub results: [u64; Outcome::ALL.len()],
}

impl Board {
    /// Every slot of the newest table with its verdict.
    pub fn backends(&self) -> Vec<BackendRow> {
        let b = lock(&self.0);
        let Some(feed) = b.feeds.first() else {
            return Vec::new();
        };
        feed.plan
            .rows
            .iter()
            .map(|r| BackendRow {
                site: r.site.clone(),
                route: r.route.clone(),
                backend: r.backend.clone(),
                verdict: feed
                    .plan
                    .targets
                    .get(r.target)
                    .and_then(|t| b.status.get(&t.key))
                    .map_or(Verdict::Unknown, |s| s.verdict),
            })
            .collect()
    }

    /// Every target of the newest plan with its probes' count.
    pub fn probes(&self) -> Vec<ProbeRow> {
        let b = lock(&self.0);
        let Some(feed) = b.feeds.first() else {
            return Vec::new();
        };
        feed.plan
            .targets
            .iter()
            .map(|t| ProbeRow {
                backend: label_of(t.key.url.authority.as_str()),
                path: t.key.path.clone(),
                results: b
                    .status
                    .get(&t.key)
                    .map_or([0; Outcome::ALL.len()], |s| s.results),
            })
            .collect()
    }

    /// Adds `feed` to the tables written, the newest first, and writes every verdict known
    /// for its targets into it (a verdict carries over by its target's key).
    pub fn feed(&self, feed: Feed) {
        let mut b = lock(&self.0);
        for t in &feed.plan.targets {
            let verdict = b.status.get(&t.key).map_or(Verdict::Unknown, |s| s.verdict);
            for &slot in &t.slots {
                feed.table.set(slot, verdict);
            }
        }
        b.feeds.insert(0, feed);
        b.feeds.truncate(MAX_FEEDS);
        // What no table fed names any more is forgotten (bounded across reloads).
        let BoardState { feeds, status } = &mut *b;
        status.retain(|key, _| {
            feeds
                .iter()
                .any(|f| f.plan.targets.iter().any(|t| t.key == *key))
        });
    }

    /// The tracker `key` resumes with: its last one, if it ran before.
    pub(crate) fn tracker(&self, key: &TargetKey) -> Tracker {
        lock(&self.0)
            .status
            .get(key)
            .map_or_else(Tracker::default, |s| s.tracker)
    }

    /// One probe of `key` ended with `outcome`, leaving `tracker`: counted, and its verdict
    /// written to every table fed that has a slot for it.
    pub fn observed(&self, key: &TargetKey, outcome: Outcome, tracker: Tracker) {
        let mut b = lock(&self.0);
        let status = b.status.entry(key.clone()).or_default();
        status.results[outcome as usize] += 1;
        status.tracker = tracker;
        status.verdict = tracker.verdict();
        let verdict = status.verdict;
        for feed in &b.feeds {
            for t in feed.plan.targets.iter().filter(|t| t.key == *key) {
                for &slot in &t.slots {
                    feed.table.set(slot, verdict);
                }
            }
        }
    }
}

/// A lock whose holders never panic while holding it; a poisoned one is taken as it is.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// What is known of one target.
#[derive(Clone, Copy, Debug)]
pub(crate) struct TargetStatus {
    verdict: Verdict,
    tracker: Tracker,
    /// Probes by [`Outcome`], in [`Outcome::ALL`] order.
    results: [u64; Outcome::ALL.len()],
}

impl Default for TargetStatus {
    fn default() -> Self {
        TargetStatus {
            verdict: Verdict::Unknown,
            tracker: Tracker::default(),
            results: [0; Outcome::ALL.len()],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ringmux_proto::sites::SiteTable;

    fn table(urls: &str) -> SiteTable {
        let json = format!(
            r#"{{"sites":[{{"label":"a.test","names":["a.test"],"cert_pem":"","key_pem":"","routes":[{{"path":"/","action":{{"upstream":{{"url":{urls},"strip_prefix":false,"health":{{"path":"/h","interval":2,"timeout":1}}}}}}}}]}}],"default_site":null}}"#
        );
        serde_json::from_str(&json).unwrap()
    }

    fn feed(board: &Board, urls: &str) -> (Arc<HealthWriter>, Plan) {
        let plan = Plan::of(&table(urls));
        let writer = Arc::new(HealthWriter::create(plan.slots()).unwrap());
        board.feed(Feed {
            table: writer.clone(),
            plan: plan.clone(),
        });
        (writer, plan)
    }

    #[test]
    fn verdicts_reach_every_table_fed_and_carry_over_by_key() {
        let board = Board::default();
        let (old, plan) = feed(&board, r#"["http://127.0.0.1:1","http://127.0.0.1:2"]"#);
        let down = &plan.targets[1].key;
        let mut t = board.tracker(down);
        assert_eq!(t.observe(false, 1, 1), Some(Verdict::Down));
        board.observed(down, Outcome::Timeout, t);
        assert_eq!((old.get(0), old.get(1)), (Verdict::Unknown, Verdict::Down));
        // A new table where the backend is the first: its verdict is there at once.
        let (new, _) = feed(&board, r#"["http://127.0.0.1:2","http://127.0.0.1:3"]"#);
        assert_eq!((new.get(0), new.get(1)), (Verdict::Down, Verdict::Unknown));
        let mut t = board.tracker(down);
        assert_eq!(t.observe(true, 1, 1), Some(Verdict::Up));
        board.observed(down, Outcome::Pass, t);
        assert_eq!(
            (old.get(1), new.get(0)),
            (Verdict::Up, Verdict::Up),
            "both fed"
        );
        let rows = board.backends();
        assert_eq!(rows.len(), 2);
        assert_eq!(
            (rows[0].backend.as_str(), rows[0].verdict),
            ("127_0_0_1_2", Verdict::Up)
        );
        let probes = board.probes();
        assert_eq!(probes[0].results[Outcome::Pass as usize], 1);
        assert_eq!(probes[0].results[Outcome::Timeout as usize], 1);
        // Past MAX_FEEDS tables, the oldest is no longer written, and what no table names is
        // forgotten.
        for _ in 0..MAX_FEEDS {
            feed(&board, r#""http://127.0.0.1:3""#);
        }
        assert_eq!(board.tracker(down), Tracker::default());
    }
}
