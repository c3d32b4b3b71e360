//! The supervisor's side of the active health checks ([`ringmux_health`], a thread of its
//! own): each site table whose routes check their backends gets a health table
//! ([`HealthTable::for_sites`], made with the workers' template, placed in every worker it
//! starts at `ringmux_proto::HEALTH_TABLE_FD`), and the checks' thread is fed each new one
//! ([`Checks::follow`]) with what to probe for it. The thread writes the verdicts; this side
//! only hands tables over.
//!
//! Across `ringmux upgrade` the tables the running workers read go with them: the old image
//! names the tables it fed with the plan of the site table it hands over
//! ([`Checks::handed_over`]), and the new image takes them over ([`HealthTable::take_over`])
//! and feeds them as its own, so the workers it adopts read fresh verdicts on. Workers of a
//! generation still draining from a reload before read a table of another plan, which is not
//! handed over: they keep its last verdicts until they are gone.

use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::Arc;

use ringmux_health::{Board, HealthWriter, Plan, MAX_FEEDS};
use ringmux_proto::sites::SiteTable;

/// A health table and the plan its slots follow.
#[derive(Debug)]
pub struct HealthTable {
    /// The table every worker started from now on is handed.
    pub writer: Arc<HealthWriter>,
    pub plan: Plan,
    /// Older tables of the same plan that workers handed over by a previous image read,
    /// newest first: fed with the same verdicts as `writer`.
    pub handed: Vec<Arc<HealthWriter>>,
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
                handed: Vec::new(),
            })),
            Err(e) => {
                tracing::warn!(error = %e, "no health table: workers decide by passive health alone");
                None
            }
        }
    }

    /// After `ringmux upgrade`: `table` (the template's, for the site table handed over)
    /// becomes the tables the previous image handed over (`handed`, newest first, by its own
    /// descriptors), taken over so that the workers adopted with them read the verdicts this
    /// image writes; the newest is handed to every worker started from now on. A table that
    /// cannot be taken over (made by an image that sealed it against every writer, or of
    /// another size) is logged and left: its workers keep its last verdicts until the next
    /// reload.
    pub fn take_over(table: &mut Option<Arc<HealthTable>>, handed: Vec<OwnedFd>) {
        if handed.is_empty() {
            return;
        }
        let Some(ours) = table.as_ref() else {
            tracing::warn!(
                tables = handed.len(),
                "health tables handed over, but no route checks health: not taken over"
            );
            return;
        };
        let mut writers = Vec::with_capacity(handed.len());
        for fd in handed {
            match HealthWriter::adopt(fd) {
                Ok(w) if w.slots() == ours.plan.slots() => writers.push(Arc::new(w)),
                Ok(w) => tracing::warn!(
                    slots = w.slots(),
                    expected = ours.plan.slots(),
                    "a health table handed over has another size than the site table's: its \
                     workers keep its last verdicts until the next reload"
                ),
                Err(e) => {
                    tracing::warn!(error = %e, "a health table handed over is not taken over")
                }
            }
        }
        if writers.is_empty() {
            return;
        }
        let writer = writers.remove(0);
        *table = Some(Arc::new(HealthTable {
            writer,
            plan: ours.plan.clone(),
            handed: writers,
        }));
    }

    /// Every table of this one, newest first.
    fn writers(&self) -> impl DoubleEndedIterator<Item = &Arc<HealthWriter>> {
        std::iter::once(&self.writer).chain(&self.handed)
    }
}

/// The checks' thread, started with the first table to feed, and the tables fed, newest first.
pub struct Checks {
    board: Board,
    running: Option<ringmux_health::Checks>,
    fed: Vec<Arc<HealthTable>>,
}

impl Checks {
    /// No thread yet; it counts on `board` (the metrics') once started.
    pub fn new(board: Board) -> Checks {
        Checks {
            board,
            running: None,
            fed: Vec::new(),
        }
    }

    /// Feeds `table` (the template's) to the thread if it is not the one fed last; starts the
    /// thread for the first.
    pub fn follow(&mut self, table: Option<&Arc<HealthTable>>) {
        let Some(table) = table else {
            return;
        };
        if self.fed.first().is_some_and(|f| Arc::ptr_eq(f, table)) {
            return;
        }
        self.fed.insert(0, table.clone());
        self.fed.truncate(MAX_FEEDS);
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
            // The oldest first: the thread keeps the newest MAX_FEEDS tables it was fed.
            for w in table.writers().rev() {
                c.feed(w.clone(), table.plan.clone());
            }
        }
    }

    /// What `ringmux upgrade` hands over: the demux's descriptor of `table` (the template's)
    /// and of every table fed with its plan (the site table handed over), newest first and
    /// each once, at most [`MAX_FEEDS`]. The numbers stay open as long as this is not dropped or fed again.
    pub fn handed_over(&self, table: Option<&Arc<HealthTable>>) -> Vec<RawFd> {
        let Some(table) = table else {
            return Vec::new();
        };
        let mut fds: Vec<RawFd> = Vec::new();
        let same_plan = self.fed.iter().filter(|f| f.plan == table.plan);
        for w in std::iter::once(table)
            .chain(same_plan)
            .flat_map(|f| f.writers())
        {
            let fd = w.fd().as_raw_fd();
            if !fds.contains(&fd) && fds.len() < MAX_FEEDS {
                fds.push(fd);
            }
        }
        fds
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ringmux_health::Verdict;
    use ringmux_ring::health::HealthReader;

    fn sites(urls: &str) -> SiteTable {
        let json = format!(
            r#"{{"sites":[{{"label":"a.test","names":["a.test"],"cert_pem":"","key_pem":"","routes":[{{"path":"/","action":{{"upstream":{{"url":{urls},"strip_prefix":false,"health":{{"path":"/h","interval":2,"timeout":1}}}}}}}}]}}],"default_site":null}}"#
        );
        SiteTable::from_json(json.as_bytes()).unwrap()
    }

    /// What `ringmux upgrade` does with the tables: the old image names the tables of the site
    /// table it hands over (not those of another plan), and the new image takes them over and
    /// writes into what the old image's workers read.
    #[test]
    fn tables_handed_over_are_written_on_by_the_new_image() {
        let two = sites(r#"["http://127.0.0.1:1","http://127.0.0.1:2"]"#);
        let older = HealthTable::for_sites(&two).unwrap();
        let other = HealthTable::for_sites(&sites(r#"["http://127.0.0.1:3"]"#)).unwrap();
        let current = HealthTable::for_sites(&two).unwrap();
        let mut checks = Checks::new(Board::default());
        checks.fed = vec![other.clone(), older.clone()];
        let fds = checks.handed_over(Some(&current));
        let fd_of = |t: &HealthTable| t.writer.fd().as_raw_fd();
        assert_eq!(fds, vec![fd_of(&current), fd_of(&older)]);
        // Workers of the old image, each reading its table.
        let reads = |t: &HealthTable| HealthReader::attach(t.writer.read_only().unwrap()).unwrap();
        let (worker, older_worker) = (reads(&current), reads(&older));
        // The new image (the descriptors cross `execve` as they are; duplicates here).
        let mut ours = HealthTable::for_sites(&two);
        let handed = [&current, &older]
            .map(|t| t.writer.fd().try_clone_to_owned().unwrap())
            .into();
        HealthTable::take_over(&mut ours, handed);
        let ours = ours.unwrap();
        let writers: Vec<_> = ours.writers().collect();
        assert_eq!(writers.len(), 2);
        for w in writers {
            w.set(1, Verdict::Down);
        }
        assert_eq!(worker.get(1), Verdict::Down);
        assert_eq!(older_worker.get(1), Verdict::Down);
        // A worker the new image starts reads the table the adopted ones read.
        let started = HealthReader::attach(ours.writer.read_only().unwrap()).unwrap();
        ours.writer.set(0, Verdict::Up);
        assert_eq!((started.get(0), worker.get(0)), (Verdict::Up, Verdict::Up));
    }

    /// A table that cannot be taken over leaves the new image's own.
    #[test]
    fn a_table_not_taken_over_leaves_the_new_images_own() {
        let two = sites(r#"["http://127.0.0.1:1","http://127.0.0.1:2"]"#);
        let one = HealthTable::for_sites(&sites(r#"["http://127.0.0.1:3"]"#)).unwrap();
        let mut ours = HealthTable::for_sites(&two);
        let fresh = ours.clone().unwrap();
        let handed = vec![one.writer.fd().try_clone_to_owned().unwrap()];
        HealthTable::take_over(&mut ours, handed);
        assert!(
            Arc::ptr_eq(&ours.unwrap(), &fresh),
            "another size: not taken"
        );
    }
}
