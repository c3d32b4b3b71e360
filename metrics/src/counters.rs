//! The counters: every datagram's fate ([`DropReason`]), the demux's own counters and gauges,
//! and each lane's. The data plane is the only writer of the datagram counters (plain stores,
//! once per receive batch); the supervisor writes the worker counters from `STATS` messages.
//!
//! Each of the demux's own counters is declared once, as one line of a table
//! ([`Counters::TABLE`], [`InstanceCounters::TABLE`]): the line makes the field, and the
//! exposition (name, help, type, `result` label), the columns and `result` words of `ringmux
//! stats` and the snapshot carried across `ringmux upgrade` ([`Counters::snapshot`]) are read
//! from the table. Adding a counter is its line plus its use; a counter under a metric name
//! nothing used before also takes that name's line in [`names`], the one list
//! of names the tests and benchmarks scrape by. (What workers report is declared in
//! `exposition.rs`'s table of reported metrics.)

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use ringmux_proto::message::{SiteRow, STATS_KEYS};

use super::names;

/// Defines [`DropReason`] from one list: the enum, `ALL` (in declaration order, so
/// `ALL[r as usize] == r` for every reason) and the metric label of each.
macro_rules! drop_reasons {
    ($( $(#[$doc:meta])* $variant:ident => $label:literal, )+) => {
        /// Why a datagram was not forwarded.
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        #[repr(usize)]
        pub enum DropReason {
            $( $(#[$doc])* $variant, )+
        }

        impl DropReason {
            /// Every reason, in declaration order: `ALL[r as usize] == r`.
            pub const ALL: [DropReason; [$($label),+].len()] = [$(DropReason::$variant),+];

            /// The `reason` label of `ringmux_datagrams_dropped_total`.
            pub fn as_str(self) -> &'static str {
                match self {
                    $(DropReason::$variant => $label,)+
                }
            }
        }
    };
}

drop_reasons! {
    /// The owner's ring was full (worker not keeping up).
    RingFull => "ring_full",
    /// Larger than a slot's payload.
    Oversize => "oversize",
    /// Not a QUIC packet by the RFC 8999 invariants.
    Malformed => "malformed",
    /// The owning worker is dead or restarting.
    InstanceDown => "instance_down",
    /// The owning worker broke the ring protocol.
    RingViolation => "ring_violation",
    /// unix mode: the worker's socket buffer was full.
    SocketFull => "socket_full",
    /// drop mode: discarded by design.
    Discarded => "discarded",
    /// A new connection's packet (Initial, or 0-RTT of a connection no instance owns yet) for
    /// a ring past `--initial-shed-at`: room kept for the connections already running.
    InitialShed => "initial_shed",
    /// A new connection's first Initial the demux answered with a Retry itself (`--retry`):
    /// the client comes back with a token (`ringmux_retries_total` says which were sent).
    Retry => "retry",
    /// An Initial carrying a Retry token of ours that does not fit (another address, expired):
    /// the worker would refuse the connection.
    TokenRefused => "token_refused",
    /// A new connection's packet from a source prefix past its budget while under pressure
    /// (`--prefix-budget`).
    PrefixBudget => "prefix_budget",
    /// reuseport mode: a datagram the kernel's steering program left to the demux's own
    /// socket (it never should): not delivered.
    Unsteered => "unsteered",
}

// The data plane indexes its drop counters with `reason as usize`: every index must be the
// reason's place in `ALL`, checked at compile time.
const _: () = {
    let mut i = 0;
    while i < DropReason::ALL.len() {
        assert!(DropReason::ALL[i] as usize == i);
        i += 1;
    }
};

/// What a lane's worker is doing, for the metrics.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u64)]
pub enum LaneState {
    /// No worker generation holds the lane.
    Idle = 0,
    /// Its worker was started and has not reported READY (or is being replaced).
    Starting = 1,
    /// It serves; new connections reach it when its generation is the active one.
    Serving = 2,
    /// It was asked to drain: it keeps its connections and takes no new ones.
    Draining = 3,
}

impl LaneState {
    /// The `state` label.
    pub fn as_str(self) -> &'static str {
        match self {
            LaneState::Idle => "idle",
            LaneState::Starting => "starting",
            LaneState::Serving => "serving",
            LaneState::Draining => "draining",
        }
    }

    fn from_code(v: u64) -> LaneState {
        match v {
            1 => LaneState::Starting,
            2 => LaneState::Serving,
            3 => LaneState::Draining,
            _ => LaneState::Idle,
        }
    }
}

/// How a line of a table of counters is exposed, and whether it runs on across an upgrade.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// A counter (`_total`): it only grows, and runs on across `ringmux upgrade`. A lane's is
    /// summed over the lanes of its instance (every generation of its workers).
    Counter,
    /// A gauge of the value as it is; a lane's is summed over the lanes of its instance.
    Gauge,
    /// A gauge of 1 while the value is not 0.
    Flag,
    /// A gauge in seconds of a value kept in nanoseconds.
    Seconds,
    /// A lane's gauge, of its instance's lane in the newest generation only.
    Newest,
}

/// One line of a table of counters ([`Counters::TABLE`], [`InstanceCounters::TABLE`]): a field,
/// the metric it is exposed as, and what `ringmux stats` shows of it.
#[derive(Clone, Copy, Debug)]
pub struct Declared<T: 'static> {
    /// The field's name, and its key in the upgrade snapshot.
    pub key: &'static str,
    /// The metric ([`super::names`]).
    pub metric: &'static str,
    pub kind: Kind,
    /// The value of the metric's label where several fields make one metric: `result` in
    /// [`Counters::TABLE`], `kind` in [`InstanceCounters::TABLE`] (beside `instance`).
    pub result: Option<&'static str>,
    /// The metric's help: on the first line of a metric, empty on the others.
    pub help: &'static str,
    /// A lane counter's column in the table of instances of `ringmux stats`: heading, width.
    pub column: Option<(&'static str, usize)>,
    /// The field.
    pub get: fn(&T) -> &AtomicU64,
}

impl<T> Declared<T> {
    /// Whether it runs on across `ringmux upgrade` (a counter does, a gauge does not).
    pub fn runs_on(&self) -> bool {
        self.kind == Kind::Counter
    }

    /// The first line of each metric of `table`, in order: one per metric to register.
    pub fn metrics(table: &'static [Declared<T>]) -> impl Iterator<Item = &'static Declared<T>> {
        table
            .iter()
            .enumerate()
            .filter(|(i, d)| !table[..*i].iter().any(|e| e.metric == d.metric))
            .map(|(_, d)| d)
    }
}

/// `$some` if given, else `$none`.
macro_rules! given_or {
    ([$some:expr] $none:expr) => {
        $some
    };
    ([] $none:expr) => {
        $none
    };
}

/// Declares a struct of counters from its table: an `AtomicU64` field for each line, beside the
/// struct's other fields, and `TABLE`, its lines as [`Declared`] values in their order. A line:
///
/// ```text
/// field: Kind(METRIC[, "result"])[, help "..."][, column("heading", width)];
/// ```
///
/// `METRIC` names a constant of [`super::names`]; the help goes on a metric's first line.
macro_rules! counter_table {
    (
        $(#[$meta:meta])*
        pub struct $name:ident {
            $( $(#[$fixed_meta:meta])* pub $fixed:ident : $fixed_ty:ty, )*
        }
        table {
            $(
                $(#[$doc:meta])*
                $field:ident : $kind:ident ( $metric:ident $(, $result:literal)? )
                $(, help $help:literal)?
                $(, column ( $heading:literal, $width:literal ))? ;
            )+
        }
    ) => {
        $(#[$meta])*
        pub struct $name {
            $( $(#[$doc])* pub $field: AtomicU64, )+
            $( $(#[$fixed_meta])* pub $fixed: $fixed_ty, )*
        }

        impl $name {
            /// Its counters, one line each, in the order of the exposition.
            pub const TABLE: &'static [Declared<$name>] = &[
                $(
                    Declared {
                        key: stringify!($field),
                        metric: names::$metric,
                        kind: Kind::$kind,
                        result: given_or!([$(Some($result))?] None),
                        help: given_or!([$($help)?] ""),
                        column: given_or!([$(Some(($heading, $width)))?] None),
                        get: |c: &$name| &c.$field,
                    },
                )+
            ];
        }
    };
}

/// Lines not written: the demux's own (queue full or write failed) and workers' output lines
/// whose write failed (`ringmux_log_lines_dropped_total`; the log thread, `logs.rs`, adds).
pub static LINES_DROPPED: AtomicU64 = AtomicU64::new(0);
/// Access-log lines the demux could not write (`ringmux_access_log_lines_dropped_total`; the
/// log thread adds).
pub static ACCESS_LINES_DROPPED: AtomicU64 = AtomicU64::new(0);
/// Heap allocations made on the data-plane thread (`ringmux_dataplane_allocations_total`; the
/// demux's counting allocator adds).
pub static DATAPLANE_ALLOCATIONS: AtomicU64 = AtomicU64::new(0);

/// What became of a worker's TAKE, the `result` label of `ringmux_session_takes_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(usize)]
pub enum TakeResult {
    /// Granted, and the session was there.
    Hit,
    /// Granted, and it was not (already taken, evicted, expired, never stored).
    Miss,
    /// Refused: the ticket's ClientHello went to another instance.
    Foreign,
    /// Refused: the demux saw no ClientHello with the ticket in the last few seconds.
    Unbound,
}

impl TakeResult {
    /// Every result, in declaration order: `ALL[r as usize] == r`.
    pub const ALL: [TakeResult; 4] = [
        TakeResult::Hit,
        TakeResult::Miss,
        TakeResult::Foreign,
        TakeResult::Unbound,
    ];

    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            TakeResult::Hit => "hit",
            TakeResult::Miss => "miss",
            TakeResult::Foreign => "foreign",
            TakeResult::Unbound => "unbound",
        }
    }
}

/// The `result` labels of `ringmux_client_hellos_total`, in the order of the data plane's
/// ClientHello inspector's counts (`tickets::HelloStats::values`).
pub const HELLO_RESULTS: [&str; 4] = ["read", "unopened", "unparsed", "abandoned"];

counter_table! {
    /// Per-lane counters: one instance's worker in one generation slot (lane `slot * instances +
    /// instance`). The metrics sum them per instance and per worker generation.
    #[derive(Debug, Default)]
    pub struct InstanceCounters {
        /// The worker generation holding the lane (0: none), and its [`LaneState`].
        pub generation: AtomicU64,
        pub state: AtomicU64,
        /// Milliseconds since the lane's worker began to drain (0: it does not).
        pub draining_ms: AtomicU64,
        /// What the lane's worker last reported (`STATS`), by [`ringmux_proto::message::STATS_KEYS`].
        pub reported: Reported,
        /// What the lane's worker last reported of each site ([`SiteRows`]).
        pub sites: SiteRows,
        /// The series the lane's worker last reported ([`super::series`]).
        pub series: super::series::LaneSeries,
    }
    table {
        forwarded: Counter(FORWARDED), help "Datagrams forwarded to an instance",
            column("forwarded", 14);
        doorbells: Counter(DOORBELLS), help "Doorbells rung (doorbell pipe writes) per instance",
            column("doorbells", 10);
        occupancy: Gauge(RING_OCCUPANCY), help "Slots published and not yet released",
            column("occupancy", 9);
        restarts: Counter(WORKER_RESTARTS), help "Worker processes restarted",
            column("restarts", 8);
        cuts: Counter(WORKER_CUTS),
            help "Workers told to cut what they still served at the end of a drain (--grace over, --max-draining reached, or a shutdown cut short)";
        violations: Counter(RING_VIOLATIONS), help "Ring protocol violations and stalls detected";
        discarded_on_reset: Counter(RING_DISCARDED),
            help "Forwarded datagrams discarded unread when a ring was reset";
        /// Lines of the lane's worker's standard output and error written to ringmux's, and
        /// dropped past its rate (`logs.rs`; the log thread adds).
        log_lines: Counter(WORKER_LOG_LINES),
            help "Lines of a worker's standard output and error written to ringmux's standard error";
        log_lines_dropped: Counter(WORKER_LOG_LINES_DROPPED),
            help "Lines of a worker's standard output and error dropped: past the worker's rate";
        /// The lane's worker process (0: none).
        worker_pid: Newest(WORKER_PID), help "Process id of the newest generation's worker";
        /// Messages of the lane's worker read past its budget (`budget.rs`) and dropped:
        /// `STATS` reports, other control messages, session-store requests.
        stats_dropped: Counter(WORKER_MESSAGES_DROPPED, "stats"),
            help "A worker's messages read past its rate limit and dropped, by kind: stats (STATS reports), control (other control messages), session (session-store requests)";
        control_dropped: Counter(WORKER_MESSAGES_DROPPED, "control");
        session_dropped: Counter(WORKER_MESSAGES_DROPPED, "session");
        /// Parts of the lane's worker's `STATS` reports dropped: site rows past the demux's
        /// table ([`InstanceCounters::record_report`]), reports that did not parse, and series
        /// refused or past the bound ([`super::series::LaneSeries::update`]).
        site_rows_dropped: Counter(WORKER_REPORT_PARTS_DROPPED, "site"),
            help "Parts of a worker's STATS reports the demux dropped, by kind: site (a site row whose index is past the demux's site table), malformed (a whole report that did not parse), series (a labelled series past the bound, or under a name of the demux's own)";
        reports_malformed: Counter(WORKER_REPORT_PARTS_DROPPED, "malformed");
        series_dropped: Counter(WORKER_REPORT_PARTS_DROPPED, "series");
    }
}

counter_table! {
    /// Everything the demux counts: its own counters and gauges (the table), the drops by
    /// reason, each lane's counters, workers' session TAKEs and the ClientHello inspector's
    /// counts.
    #[derive(Debug, Default)]
    pub struct Counters {
        /// Datagrams not forwarded, by [`DropReason`].
        pub dropped: [AtomicU64; DropReason::ALL.len()],
        /// One entry per lane; lane `l` belongs to instance `l % instance_count`.
        pub instances: Vec<InstanceCounters>,
        pub instance_count: usize,
        /// The worker generation new connections go to (the upgrade state carries it apart).
        pub active_generation: AtomicU64,
        /// Workers' session TAKEs by [`TakeResult`] (the session threads add).
        pub session_takes: [AtomicU64; TakeResult::ALL.len()],
        /// What the data plane's ClientHello inspector counted, by [`HELLO_RESULTS`]
        /// (`tickets.rs`'s `HelloStats`; the data plane stores).
        pub client_hellos: [AtomicU64; HELLO_RESULTS.len()],
        /// The program the instances run (`--worker-cmd`), for `ringmux_worker_info`.
        pub program: std::sync::RwLock<String>,
        /// The labels of the site table's sites, in its order, then [`NO_SITE`]: what a site
        /// index of a report names ([`Counters::with_sites`]).
        pub site_labels: Vec<String>,
        /// Each site's certificate's expiry: (site, name, notAfter in Unix seconds), as
        /// [`set_certificates`] last found them.
        pub certificates: std::sync::RwLock<Vec<(String, String, i64)>>,
        /// ACME orders issued and failed ([`names::ACME_ORDERS`]), as the engine counted them.
        pub acme_orders: [AtomicU64; 2],
        /// ACME state files refused ([`names::ACME_STATE_REFUSED`]), by
        /// [`names::ACME_STATE_FILES`] then `foreign-challenge`, as the engine counted them.
        pub acme_state_refused: [AtomicU64; names::ACME_STATE_FILES.len() + 1],
        /// The active health checks' verdicts and probes ([`names::BACKEND_UP`],
        /// [`names::HEALTH_PROBES`]), as their thread counts them.
        pub health: ringmux_health::Board,
    }
    table {
        received: Counter(RECEIVED), help "Datagrams received on the public socket";
        recv_calls: Counter(RECV_CALLS), help "Receive system calls (recvmmsg) that returned data";
        recv_windows: Counter(RECV_WINDOWS),
            help "Receive coalescing windows: waits on a timer for more datagrams instead of on the socket (--recv-coalesce-us)";
        /// Reloads that finished (a new generation serves) and that failed (the old one serves
        /// on).
        reloads: Counter(RELOADS, "ok"),
            help "Reloads (new worker generations) by result: ok, or failed (the old one serves on)";
        reloads_failed: Counter(RELOADS, "failed");
        /// Upgrades of the demux itself (`ringmux upgrade`) this process went through, and
        /// those refused or failed (the demux serves on).
        upgrades: Counter(UPGRADES, "ok"),
            help "Upgrades of the demux itself by result: ok, or failed (the old demux serves on)";
        upgrades_failed: Counter(UPGRADES, "failed");
        /// The last upgrade's pause: from the old image's last received datagram to this one's
        /// first (ns).
        upgrade_pause_ns: Seconds(UPGRADE_PAUSE),
            help "The last upgrade's pause: from the old demux's last received datagram to the new one's first";
        /// The bytes waiting in the public socket's receive queue when this image took it over
        /// (the deepest the queue got: nobody read it meanwhile).
        upgrade_queued_bytes: Gauge(UPGRADE_QUEUED),
            help "Bytes waiting in the public socket's receive queue when the last upgrade's new demux took it over";
        /// Admission (`admission.rs`): Retries sent and not sent (the socket's send buffer was
        /// full).
        retries_sent: Counter(RETRIES, "sent"),
            help "Retries the demux answered new connections with, by result: sent, or unsent (send buffer full)";
        retries_unsent: Counter(RETRIES, "unsent");
        /// Retry or NEW_TOKEN tokens the demux accepted (the refused are a drop reason).
        tokens_accepted: Counter(TOKENS, "accepted"),
            help "Address-validation tokens the demux checked, by result: accepted, or refused (a Retry token for another address, or expired)";
        /// 1 while under pressure.
        under_pressure: Flag(ADMISSION_PRESSURE),
            help "1 while the demux is under pressure: --retry auto sends Retries, the prefix budget applies";
    }
}

/// A sample of a metric of [`Counters::TABLE`] that no field of the table holds.
#[derive(Clone, Copy, Debug)]
pub struct Derived {
    pub metric: &'static str,
    /// Its `result` label.
    pub result: &'static str,
    /// The counter that holds it.
    pub get: fn(&Counters) -> &AtomicU64,
}

/// The samples of the table's metrics that no field of the table holds: the tokens refused
/// are the `token_refused` drops.
pub const DERIVED: [Derived; 1] = [Derived {
    metric: names::TOKENS,
    result: "refused",
    get: |c: &Counters| &c.dropped[DropReason::TokenRefused as usize],
}];

/// A worker's last report, one counter per [`ringmux_proto::message::STATS_KEYS`] entry, stored whole
/// (a worker reports totals). The metrics built from it are declared once, in
/// `exposition.rs`'s table of reported metrics.
#[derive(Debug)]
pub struct Reported([AtomicU64; STATS_KEYS.len()]);

impl Default for Reported {
    fn default() -> Self {
        Reported(std::array::from_fn(|_| AtomicU64::new(0)))
    }
}

impl Reported {
    /// The value of `key` (0 for a key the report does not have).
    pub fn get(&self, key: &str) -> u64 {
        STATS_KEYS
            .iter()
            .position(|k| *k == key)
            .map_or(0, |i| self.0[i].load(Ordering::Relaxed))
    }

    /// Sets `key` (nothing for a key the report does not have), as a report would.
    pub fn set(&self, key: &str, v: u64) {
        if let Some(i) = STATS_KEYS.iter().position(|k| *k == key) {
            self.0[i].store(v, Ordering::Relaxed);
        }
    }
}

/// How the metrics name the row of requests no site answered (the row after the table's).
pub const NO_SITE: &str = "-";

/// A lane's responses by site, as its worker last reported them (`control-protocol.md`, "STATS
/// keys by site"): a row per site index below the number the demux knows, so no worker grows
/// it past the demux's own table. Only rows a worker reported are held.
#[derive(Debug, Default)]
pub struct SiteRows(Mutex<LaneSites>);

/// A lane's site rows and the labels of the site table its worker was handed.
#[derive(Debug, Default)]
struct LaneSites {
    /// `None`: the demux's first table ([`Counters::site_labels`]), for a worker this image of
    /// the demux did not start.
    labels: Option<std::sync::Arc<[String]>>,
    rows: BTreeMap<u32, SiteRow>,
}

impl SiteRows {
    /// A copy of the rows, by site index.
    pub fn get(&self) -> BTreeMap<u32, SiteRow> {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .rows
            .clone()
    }

    /// The rows by the label of their site, `fallback` naming them for a worker whose table
    /// this image of the demux did not hand over.
    pub fn labelled(&self, fallback: &[String]) -> Vec<(String, SiteRow)> {
        let held = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let labels = held.labels.as_deref().unwrap_or(fallback);
        held.rows
            .iter()
            .map(|(&site, row)| {
                let label = usize::try_from(site)
                    .ok()
                    .and_then(|i| labels.get(i))
                    .map_or(NO_SITE, String::as_str);
                (label.to_owned(), *row)
            })
            .collect()
    }

    /// Forgets every row: a new worker of the lane counts from 0.
    pub fn clear(&self) {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .rows
            .clear();
    }

    /// A new worker of the lane, handed the site table named by `labels` (its sites, then the
    /// row of no site): its rows count from 0 and are named by those labels, whatever the
    /// table of the lane's other generations.
    pub fn start(&self, labels: std::sync::Arc<[String]>) {
        let mut held = self.0.lock().unwrap_or_else(|e| e.into_inner());
        held.rows.clear();
        held.labels = Some(labels);
    }

    /// How many rows a report of the lane's worker may carry: its table's sites and the row
    /// of no site (`fallback` for a worker this image of the demux did not start).
    pub fn rows_known(&self, fallback: usize) -> usize {
        let held = self.0.lock().unwrap_or_else(|e| e.into_inner());
        held.labels.as_ref().map_or(fallback, |l| l.len())
    }

    /// Takes the rows of `report` whose index is below `rows`; a row the report does not carry
    /// keeps its value. Returns how many rows it dropped.
    fn update(&self, report: &BTreeMap<u32, SiteRow>, rows: usize) -> u64 {
        let mut held = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let mut dropped = 0;
        for (&site, row) in report {
            if usize::try_from(site).is_ok_and(|s| s < rows) {
                held.rows.insert(site, *row);
            } else {
                dropped += 1;
            }
        }
        dropped
    }
}

impl InstanceCounters {
    /// Records which generation holds the lane, what its worker does, and how long it has
    /// drained (`None`: it does not).
    pub fn set_lane(
        &self,
        generation: u64,
        state: LaneState,
        draining: Option<std::time::Duration>,
    ) {
        self.generation.store(generation, Ordering::Relaxed);
        self.state.store(state as u64, Ordering::Relaxed);
        let ms = draining.map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        self.draining_ms.store(ms, Ordering::Relaxed);
    }

    /// The lane's [`LaneState`].
    pub fn lane_state(&self) -> LaneState {
        LaneState::from_code(self.state.load(Ordering::Relaxed))
    }

    /// Stores what a worker's `STATS` message says: its counters whole, its site rows of
    /// the `sites` the demux knows (the table's and the row of no site, [`Counters::site_labels`]),
    /// and its series within their bound; a row past them, and a series refused, are dropped
    /// and counted.
    pub fn record_report(&self, r: &ringmux_proto::WorkerReport, sites: usize) {
        for (c, v) in self.reported.0.iter().zip(r.fields()) {
            c.store(v, Ordering::Relaxed);
        }
        let dropped = self.sites.update(&r.sites, sites);
        self.site_rows_dropped.fetch_add(dropped, Ordering::Relaxed);
        let dropped = self.series.update(&r.series);
        self.series_dropped.fetch_add(dropped, Ordering::Relaxed);
    }
}

/// The labels of a report's site rows for `table`: its sites in order, then the row of no
/// site.
pub fn site_labels(table: &ringmux_proto::sites::SiteTable) -> std::sync::Arc<[String]> {
    table
        .sites
        .iter()
        .map(|s| s.label.clone())
        .chain(std::iter::once(NO_SITE.to_owned()))
        .collect()
}

/// Records the expiry of every site's certificate in `table` for
/// [`names::CERTIFICATE_EXPIRY`]; a site without one (an ACME site before its first) is left out.
pub fn set_certificates(c: &Counters, table: &ringmux_proto::sites::SiteTable) {
    use rustls::pki_types::pem::PemObject;
    let mut rows = Vec::new();
    for site in &table.sites {
        let Some(Ok(der)) =
            rustls::pki_types::CertificateDer::pem_slice_iter(site.cert_pem.as_bytes()).next()
        else {
            continue;
        };
        let Ok(leaf) = ringmux_proto::x509::leaf(&der) else {
            continue;
        };
        let not_after = leaf
            .not_after
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX));
        let names = if site.names.is_empty() {
            &leaf.names
        } else {
            &site.names
        };
        for name in names {
            rows.push((site.label.clone(), name.clone(), not_after));
        }
    }
    if let Ok(mut certs) = c.certificates.write() {
        *certs = rows;
    }
}

impl Counters {
    /// Counters for `instances` instances in `lanes` lanes (a multiple of `instances`).
    pub fn new(instances: u8, lanes: usize) -> Self {
        Counters {
            instances: (0..lanes).map(|_| InstanceCounters::default()).collect(),
            instance_count: usize::from(instances).max(1),
            active_generation: AtomicU64::new(1),
            ..Default::default()
        }
    }

    /// Names the sites of `table`, in its order, for the site indices of workers' reports.
    pub fn with_sites(mut self, table: &ringmux_proto::sites::SiteTable) -> Self {
        self.site_labels = site_labels(table).to_vec();
        self
    }

    /// The values of the `result` label of `metric`, one of the table's, in their order.
    pub fn results(metric: &str) -> impl Iterator<Item = &'static str> + '_ {
        let declared = Self::TABLE
            .iter()
            .filter(move |d| d.metric == metric)
            .filter_map(|d| d.result);
        let derived = DERIVED
            .iter()
            .filter(move |d| d.metric == metric)
            .map(|d| d.result);
        declared.chain(derived)
    }

    /// The lanes of instance `i` (one per generation slot).
    pub fn lanes_of(&self, i: usize) -> impl Iterator<Item = (usize, &InstanceCounters)> {
        self.instances
            .iter()
            .enumerate()
            .skip(i)
            .step_by(self.instance_count)
    }

    /// What runs on across a demux upgrade: every counter of the tables, by its key, and the
    /// drops by reason; also in the previous release's positional form.
    pub fn snapshot(&self) -> CounterSnapshot {
        let ld = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let mut s = CounterSnapshot {
            totals: keyed(Self::TABLE, self),
            drops: DropReason::ALL
                .iter()
                .map(|r| (r.as_str().to_string(), ld(&self.dropped[*r as usize])))
                .collect(),
            per_lane: self
                .instances
                .iter()
                .map(|l| keyed(InstanceCounters::TABLE, l))
                .collect(),
            ..Default::default()
        };
        legacy::write(&mut s);
        s
    }

    /// Takes over what a previous process image counted ([`Counters::snapshot`], or the
    /// previous release's positional form); entries it did not have stay 0.
    pub fn restore(&self, s: &CounterSnapshot) {
        let s = legacy::read(s);
        let set = |c: &AtomicU64, v: Option<&u64>| {
            if let Some(v) = v {
                c.store(*v, Ordering::Relaxed);
            }
        };
        for d in Self::TABLE.iter().filter(|d| d.runs_on()) {
            set((d.get)(self), s.totals.get(d.key));
        }
        for r in DropReason::ALL {
            set(&self.dropped[r as usize], s.drops.get(r.as_str()));
        }
        for (l, values) in self.instances.iter().zip(&s.per_lane) {
            for d in InstanceCounters::TABLE.iter().filter(|d| d.runs_on()) {
                set((d.get)(l), values.get(d.key));
            }
        }
    }

    /// Counts one session TAKE (any session thread).
    pub fn count_take(&self, result: TakeResult) {
        self.session_takes[result as usize].fetch_add(1, Ordering::Relaxed);
    }

    pub fn dropped_total(&self) -> u64 {
        self.dropped.iter().map(|d| d.load(Ordering::Relaxed)).sum()
    }

    pub fn forwarded_total(&self) -> u64 {
        self.instances
            .iter()
            .map(|i| i.forwarded.load(Ordering::Relaxed))
            .sum()
    }
}

/// What runs on across `ringmux upgrade` of the counters (what workers report comes again
/// within a second), by key: [`Counters::snapshot`] writes every counter of the tables, so a
/// counter added there runs on with no change here; the upgrade's state carries it as it is.
/// The positional fields after them are the previous release's form, which an image of that
/// release writes and reads alone: read when the keyed ones are absent, and written too.
#[derive(serde::Serialize, serde::Deserialize, Debug, Clone, Default, PartialEq, Eq)]
pub struct CounterSnapshot {
    /// The demux's own counters (`Counters::TABLE`), by field name.
    #[serde(default)]
    pub totals: BTreeMap<String, u64>,
    /// Datagrams dropped, by reason (`DropReason::as_str`).
    #[serde(default)]
    pub drops: BTreeMap<String, u64>,
    /// Per lane: its counters (`InstanceCounters::TABLE`), by field name.
    #[serde(default)]
    pub per_lane: Vec<BTreeMap<String, u64>>,
    #[serde(default)]
    pub received: u64,
    #[serde(default)]
    pub recv_calls: u64,
    /// In `DropReason::ALL`'s order.
    #[serde(default)]
    pub dropped: Vec<u64>,
    #[serde(default)]
    pub reloads: u64,
    #[serde(default)]
    pub reloads_failed: u64,
    #[serde(default)]
    pub upgrades: u64,
    #[serde(default)]
    pub upgrades_failed: u64,
    /// Per lane: forwarded, doorbells, discarded_on_reset, restarts, violations.
    #[serde(default)]
    pub lanes: Vec<[u64; 5]>,
    /// Retries sent and unsent, tokens accepted (absent from an image without admission).
    #[serde(default)]
    pub admission: [u64; 3],
}

/// The counters of `table` that run on across an upgrade, by key.
fn keyed<T>(table: &'static [Declared<T>], of: &T) -> BTreeMap<String, u64> {
    table
        .iter()
        .filter(|d| d.runs_on())
        .map(|d| (d.key.to_string(), (d.get)(of).load(Ordering::Relaxed)))
        .collect()
}

/// The previous release's positional form of [`CounterSnapshot`] (named totals, `dropped` in
/// [`DropReason::ALL`]'s order, five counters per lane, three of admission), frozen at that
/// release's counters: an image of it wrote only this form and reads only this form, so this
/// image reads it from one, and writes it too, so that one can take over from this.
mod legacy {
    use super::*;

    const LANE: [&str; 5] = [
        "forwarded",
        "doorbells",
        "discarded_on_reset",
        "restarts",
        "violations",
    ];
    const ADMISSION: [&str; 3] = ["retries_sent", "retries_unsent", "tokens_accepted"];

    /// The named totals, by key.
    fn totals(s: &mut CounterSnapshot) -> [(&'static str, &mut u64); 6] {
        [
            ("received", &mut s.received),
            ("recv_calls", &mut s.recv_calls),
            ("reloads", &mut s.reloads),
            ("reloads_failed", &mut s.reloads_failed),
            ("upgrades", &mut s.upgrades),
            ("upgrades_failed", &mut s.upgrades_failed),
        ]
    }

    /// Fills the positional form from the keyed one.
    pub(super) fn write(s: &mut CounterSnapshot) {
        let (totals_by_key, drops, per_lane) = (s.totals.clone(), &s.drops, &s.per_lane);
        let get = |m: &BTreeMap<String, u64>, k: &str| m.get(k).copied().unwrap_or(0);
        s.dropped = DropReason::ALL
            .iter()
            .map(|r| get(drops, r.as_str()))
            .collect();
        s.lanes = per_lane.iter().map(|l| LANE.map(|k| get(l, k))).collect();
        s.admission = ADMISSION.map(|k| get(&totals_by_key, k));
        for (k, v) in totals(s) {
            *v = get(&totals_by_key, k);
        }
    }

    /// The keyed form of `s`: its positional fields, with its keyed ones over them.
    pub(super) fn read(s: &CounterSnapshot) -> CounterSnapshot {
        let mut positional = s.clone();
        let mut keyed = CounterSnapshot::default();
        for (k, v) in totals(&mut positional) {
            keyed.totals.insert(k.to_string(), *v);
        }
        for (k, v) in ADMISSION.iter().zip(s.admission) {
            keyed.totals.insert(k.to_string(), v);
        }
        for (r, v) in DropReason::ALL.iter().zip(&s.dropped) {
            keyed.drops.insert(r.as_str().to_string(), *v);
        }
        keyed.per_lane = s
            .lanes
            .iter()
            .map(|l| {
                LANE.iter()
                    .zip(l)
                    .map(|(k, v)| (k.to_string(), *v))
                    .collect()
            })
            .collect();
        keyed.totals.extend(s.totals.clone());
        keyed.drops.extend(s.drops.clone());
        for (i, lane) in s.per_lane.iter().enumerate() {
            if keyed.per_lane.len() <= i {
                keyed.per_lane.push(BTreeMap::new());
            }
            keyed.per_lane[i].extend(lane.clone());
        }
        keyed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every counter of both tables at a distinct value, and every drop; gauges too.
    fn numbered(c: &Counters) {
        let mut v = 0;
        let mut next = || {
            v += 7;
            v
        };
        for d in Counters::TABLE {
            (d.get)(c).store(next(), Ordering::Relaxed);
        }
        for d in &c.dropped {
            d.store(next(), Ordering::Relaxed);
        }
        for l in &c.instances {
            for d in InstanceCounters::TABLE {
                (d.get)(l).store(next(), Ordering::Relaxed);
            }
        }
    }

    #[test]
    fn tables_are_well_formed() {
        fn check<T>(table: &'static [Declared<T>], derived: usize, keys: &mut Vec<&str>) {
            for first in Declared::metrics(table) {
                assert!(names::ALL.contains(&first.metric), "{}", first.metric);
                let lines: Vec<_> = table.iter().filter(|d| d.metric == first.metric).collect();
                assert!(
                    !first.help.is_empty(),
                    "{}: help on its first line",
                    first.metric
                );
                for d in &lines[1..] {
                    assert_eq!(d.help, "", "{}: help once", d.key);
                }
                for d in &lines {
                    assert_eq!(d.kind, first.kind, "{}: one kind per metric", d.key);
                    let derived = DERIVED[..derived]
                        .iter()
                        .filter(|e| e.metric == d.metric)
                        .count();
                    assert_eq!(
                        d.result.is_some(),
                        lines.len() + derived > 1,
                        "{}: a `result` label where several fields make a metric",
                        d.key
                    );
                }
                if first.result.is_some() {
                    assert_eq!(first.kind, Kind::Counter, "{}", first.metric);
                }
            }
            for d in table {
                assert!(!keys.contains(&d.key), "{} twice", d.key);
                keys.push(d.key);
            }
        }
        let mut keys = Vec::new();
        check(Counters::TABLE, DERIVED.len(), &mut keys);
        let mut lane_keys = Vec::new();
        check(InstanceCounters::TABLE, 0, &mut lane_keys);
        for d in InstanceCounters::TABLE
            .iter()
            .filter(|d| d.result.is_some())
        {
            assert_eq!(
                d.kind,
                Kind::Counter,
                "{}: a `kind` label on counters",
                d.key
            );
            assert!(d.column.is_none(), "{}: no column of one kind", d.key);
        }
        for d in Counters::TABLE {
            assert!(d.column.is_none() && d.kind != Kind::Newest, "{}", d.key);
        }
        for e in DERIVED {
            assert!(Counters::TABLE
                .iter()
                .any(|d| d.metric == e.metric && d.result.is_some()));
            assert!(Counters::results(e.metric).any(|r| r == e.result));
        }
        assert_eq!(
            Counters::results(names::TOKENS).collect::<Vec<_>>(),
            ["accepted", "refused"]
        );
    }

    /// A snapshot restores into fresh counters: every counter by its key, the drops by reason;
    /// the gauges stay 0.
    #[test]
    fn a_snapshot_restores_every_counter_and_no_gauge() {
        let c = Counters::new(2, 8);
        numbered(&c);
        let json = serde_json::to_string(&c.snapshot()).unwrap();
        let back = Counters::new(2, 8);
        back.restore(&serde_json::from_str(&json).unwrap());
        let ld = |a: &AtomicU64| a.load(Ordering::Relaxed);
        for d in Counters::TABLE {
            let want = if d.runs_on() { ld((d.get)(&c)) } else { 0 };
            assert_eq!(ld((d.get)(&back)), want, "{}", d.key);
        }
        for (a, b) in c.dropped.iter().zip(&back.dropped) {
            assert_eq!(ld(a), ld(b));
        }
        for (a, b) in c.instances.iter().zip(&back.instances) {
            for d in InstanceCounters::TABLE {
                let want = if d.runs_on() { ld((d.get)(a)) } else { 0 };
                assert_eq!(ld((d.get)(b)), want, "{}", d.key);
            }
        }
        assert_eq!(back.forwarded_total(), c.forwarded_total());
        assert_ne!(back.forwarded_total(), 0);
    }

    /// The counters of an image of the previous release, which wrote them by position only,
    /// restore into this one's by name.
    #[test]
    fn an_old_positional_counter_state_restores_into_the_new_counters() {
        let old = r#"{
            "received": 14, "recv_calls": 21,
            "dropped": [98, 105, 112, 119, 126, 133, 140, 147, 154, 161, 168, 175],
            "reloads": 28, "reloads_failed": 35, "upgrades": 42, "upgrades_failed": 49,
            "lanes": [[238, 245, 259, 266, 273], [301, 308, 322, 329, 336]],
            "admission": [70, 77, 84]
        }"#;
        let state: CounterSnapshot = serde_json::from_str(old).unwrap();
        let c = Counters::new(1, 2);
        c.restore(&state);
        let ld = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let totals = [
            (&c.received, 14),
            (&c.recv_calls, 21),
            (&c.reloads, 28),
            (&c.reloads_failed, 35),
            (&c.upgrades, 42),
            (&c.upgrades_failed, 49),
            (&c.retries_sent, 70),
            (&c.retries_unsent, 77),
            (&c.tokens_accepted, 84),
        ];
        for (i, (counter, want)) in totals.into_iter().enumerate() {
            assert_eq!(ld(counter), want, "total {i}");
        }
        assert_eq!(ld(&c.dropped[DropReason::RingFull as usize]), 98);
        assert_eq!(ld(&c.dropped[DropReason::Unsteered as usize]), 175);
        let l = &c.instances[1];
        assert_eq!(
            [
                &l.forwarded,
                &l.doorbells,
                &l.discarded_on_reset,
                &l.restarts,
                &l.violations
            ]
            .map(ld),
            [301, 308, 322, 329, 336]
        );
        assert_eq!(ld(&c.instances[0].forwarded), 238);
        // Without the admission part (an image from before admission): those stay 0.
        let older = old.replace(",\n            \"admission\": [70, 77, 84]", "");
        assert!(!older.contains("admission"));
        let c = Counters::new(1, 2);
        c.restore(&serde_json::from_str(&older).unwrap());
        assert_eq!(ld(&c.retries_sent), 0);
        assert_eq!(ld(&c.received), 14);
    }

    /// What this image writes, an image of the previous release reads (a downgrade): its
    /// positional form, with the same values.
    #[test]
    fn an_image_of_the_previous_release_reads_the_snapshot() {
        /// `CounterState` as the previous release declared it.
        #[derive(serde::Deserialize)]
        struct Previous {
            received: u64,
            recv_calls: u64,
            dropped: Vec<u64>,
            reloads: u64,
            reloads_failed: u64,
            upgrades: u64,
            upgrades_failed: u64,
            lanes: Vec<[u64; 5]>,
            #[serde(default)]
            admission: [u64; 3],
        }
        let c = Counters::new(2, 4);
        numbered(&c);
        let json = serde_json::to_string(&c.snapshot()).unwrap();
        let p: Previous = serde_json::from_str(&json).unwrap();
        let ld = |a: &AtomicU64| a.load(Ordering::Relaxed);
        assert_eq!(
            [
                p.received,
                p.recv_calls,
                p.reloads,
                p.reloads_failed,
                p.upgrades,
                p.upgrades_failed
            ],
            [
                &c.received,
                &c.recv_calls,
                &c.reloads,
                &c.reloads_failed,
                &c.upgrades,
                &c.upgrades_failed
            ]
            .map(ld)
        );
        assert_eq!(
            p.admission,
            [&c.retries_sent, &c.retries_unsent, &c.tokens_accepted].map(ld)
        );
        assert_eq!(p.dropped, c.dropped.iter().map(ld).collect::<Vec<_>>());
        for (want, l) in p.lanes.iter().zip(&c.instances) {
            let got = [
                &l.forwarded,
                &l.doorbells,
                &l.discarded_on_reset,
                &l.restarts,
                &l.violations,
            ]
            .map(ld);
            assert_eq!(*want, got);
        }
        assert_eq!(p.lanes.len(), 4);
    }

    /// What a hostile worker may send of sites: an index past the demux's table (`u32::MAX`
    /// included, what an index too long to read becomes) and more rows than the table has.
    /// Only rows of the table's sites and of no site are kept, the others counted; a later
    /// report leaves the rows it does not carry as they were; a new worker starts from none.
    #[test]
    fn site_rows_are_bounded_by_the_demux_table() {
        let lane = InstanceCounters::default();
        let ld = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let mut r = ringmux_proto::WorkerReport::default();
        for site in (0..10_000).chain([u32::MAX]) {
            r.sites.insert(site, [u64::from(site), 1, 2, 3, 4, 5]);
        }
        lane.record_report(&r, 3);
        let held = lane.sites.get();
        assert_eq!(held.keys().copied().collect::<Vec<_>>(), [0, 1, 2]);
        assert_eq!(held[&2], [2, 1, 2, 3, 4, 5]);
        assert_eq!(ld(&lane.site_rows_dropped), 10_001 - 3);
        let mut later = ringmux_proto::WorkerReport::default();
        later.sites.insert(1, [0, 9, 0, 0, 0, 0]);
        later.sites.insert(3, [0; 6]);
        lane.record_report(&later, 3);
        let held = lane.sites.get();
        assert_eq!(
            (held[&0], held[&1]),
            ([0, 1, 2, 3, 4, 5], [0, 9, 0, 0, 0, 0])
        );
        assert_eq!(ld(&lane.site_rows_dropped), 10_001 - 3 + 1);
        // With no site table at all (a demux that names none), every row is dropped.
        lane.sites.clear();
        lane.record_report(&r, 0);
        assert!(lane.sites.get().is_empty());
    }

    #[test]
    fn site_labels_name_the_table_then_no_site() {
        let table: ringmux_proto::sites::SiteTable = serde_json::from_str(
            r#"{"sites": [{"label": "a.test", "names": ["a.test"], "cert_pem": "", "key_pem": "",
                "routes": []}], "default_site": null}"#,
        )
        .unwrap();
        let c = Counters::new(1, 4).with_sites(&table);
        assert_eq!(c.site_labels, ["a.test", NO_SITE]);
    }
}
