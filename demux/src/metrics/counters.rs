//! The counters: every datagram's fate ([`DropReason`]) and each instance's worker. The data
//! plane is the only writer of the datagram counters (plain stores, once per receive batch); the
//! supervisor writes the worker counters from `STATS` messages.

use std::sync::atomic::{AtomicU64, Ordering};

use ringmux_proto::message::{keys_with_prefix, STATS_KEYS};

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

/// Per-lane counters: one instance's worker in one generation slot (lane `slot * instances +
/// instance`). The metrics sum them per instance and per worker generation.
#[derive(Debug, Default)]
pub struct InstanceCounters {
    /// The worker generation holding the lane (0: none), and its [`LaneState`].
    pub generation: AtomicU64,
    pub state: AtomicU64,
    pub forwarded: AtomicU64,
    pub doorbells: AtomicU64,
    pub occupancy: AtomicU64,
    pub discarded_on_reset: AtomicU64,
    pub restarts: AtomicU64,
    pub violations: AtomicU64,
    /// What the lane's worker last reported (`STATS`), by [`ringmux_proto::message::STATS_KEYS`].
    pub reported: Reported,
    pub worker_pid: AtomicU64,
}

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

    /// The keys that start with `prefix`, each with the rest of the key (a metric label) and
    /// its value, in [`STATS_KEYS`] order.
    pub fn with_prefix<'a>(
        &'a self,
        prefix: &'a str,
    ) -> impl Iterator<Item = (&'static str, u64)> + 'a {
        keys_with_prefix(prefix).map(|(i, rest)| (rest, self.0[i].load(Ordering::Relaxed)))
    }
}

impl InstanceCounters {
    /// Records which generation holds the lane and what its worker does.
    pub fn set_lane(&self, generation: u64, state: LaneState) {
        self.generation.store(generation, Ordering::Relaxed);
        self.state.store(state as u64, Ordering::Relaxed);
    }

    /// The lane's [`LaneState`].
    pub fn lane_state(&self) -> LaneState {
        LaneState::from_code(self.state.load(Ordering::Relaxed))
    }

    /// Stores what a worker's `STATS` message says.
    pub fn record_report(&self, r: &ringmux_proto::WorkerReport) {
        for (c, v) in self.reported.0.iter().zip(r.fields()) {
            c.store(v, Ordering::Relaxed);
        }
    }
}

/// Everything the demux counts.
#[derive(Debug)]
pub struct Counters {
    pub received: AtomicU64,
    pub recv_calls: AtomicU64,
    pub dropped: [AtomicU64; DropReason::ALL.len()],
    /// One entry per lane; lane `l` belongs to instance `l % instance_count`.
    pub instances: Vec<InstanceCounters>,
    pub instance_count: usize,
    /// The worker generation new connections go to.
    pub active_generation: AtomicU64,
    /// Reloads that finished (a new generation serves) and that failed (the old one serves on).
    pub reloads: AtomicU64,
    pub reloads_failed: AtomicU64,
    /// Upgrades of the demux itself (`ringmux upgrade`) this process went through, and those
    /// refused or failed (the demux serves on).
    pub upgrades: AtomicU64,
    pub upgrades_failed: AtomicU64,
    /// The last upgrade's pause: from the old image's last received datagram to this one's
    /// first (ns), and the bytes waiting in the public socket's receive queue when this image
    /// took it over (the deepest the queue got: nobody read it meanwhile).
    pub upgrade_pause_ns: AtomicU64,
    pub upgrade_queued_bytes: AtomicU64,
    /// Admission (`admission.rs`): Retries sent and not sent (the socket's send buffer was
    /// full), Retry or NEW_TOKEN tokens the demux accepted, and 1 while under pressure.
    pub retries_sent: AtomicU64,
    pub retries_unsent: AtomicU64,
    pub tokens_accepted: AtomicU64,
    pub under_pressure: AtomicU64,
    /// Workers' session TAKEs by [`crate::sessions::TakeResult`] (the session threads add).
    pub session_takes: [AtomicU64; crate::sessions::TakeResult::ALL.len()],
    /// What the data plane's ClientHello inspector counted, by `HelloStats::LABELS`
    /// (`tickets.rs`; the data plane stores).
    pub client_hellos: [AtomicU64; crate::tickets::HelloStats::LABELS.len()],
    /// The program the instances run (`--worker-cmd`), for `ringmux_worker_info`.
    pub program: std::sync::RwLock<String>,
}

impl Counters {
    /// Counters for `instances` instances in `lanes` lanes (a multiple of `instances`).
    pub fn new(instances: u8, lanes: usize) -> Self {
        Counters {
            received: AtomicU64::new(0),
            recv_calls: AtomicU64::new(0),
            dropped: Default::default(),
            instances: (0..lanes).map(|_| InstanceCounters::default()).collect(),
            instance_count: usize::from(instances).max(1),
            active_generation: AtomicU64::new(1),
            reloads: AtomicU64::new(0),
            reloads_failed: AtomicU64::new(0),
            upgrades: AtomicU64::new(0),
            upgrades_failed: AtomicU64::new(0),
            upgrade_pause_ns: AtomicU64::new(0),
            upgrade_queued_bytes: AtomicU64::new(0),
            retries_sent: AtomicU64::new(0),
            retries_unsent: AtomicU64::new(0),
            tokens_accepted: AtomicU64::new(0),
            under_pressure: AtomicU64::new(0),
            session_takes: Default::default(),
            client_hellos: Default::default(),
            program: Default::default(),
        }
    }

    /// The lanes of instance `i` (one per generation slot).
    pub fn lanes_of(&self, i: usize) -> impl Iterator<Item = (usize, &InstanceCounters)> {
        self.instances
            .iter()
            .enumerate()
            .skip(i)
            .step_by(self.instance_count)
    }

    /// What runs on across a demux upgrade.
    pub fn snapshot(&self) -> crate::upgrade::CounterState {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        crate::upgrade::CounterState {
            received: get(&self.received),
            recv_calls: get(&self.recv_calls),
            dropped: self.dropped.iter().map(get).collect(),
            reloads: get(&self.reloads),
            reloads_failed: get(&self.reloads_failed),
            upgrades: get(&self.upgrades),
            upgrades_failed: get(&self.upgrades_failed),
            lanes: self
                .instances
                .iter()
                .map(|l| {
                    [
                        get(&l.forwarded),
                        get(&l.doorbells),
                        get(&l.discarded_on_reset),
                        get(&l.restarts),
                        get(&l.violations),
                    ]
                })
                .collect(),
            admission: [
                get(&self.retries_sent),
                get(&self.retries_unsent),
                get(&self.tokens_accepted),
            ],
        }
    }

    /// Takes over what a previous process image counted ([`Counters::snapshot`]); entries it
    /// did not have stay 0.
    pub fn restore(&self, s: &crate::upgrade::CounterState) {
        let set = |c: &AtomicU64, v: u64| c.store(v, Ordering::Relaxed);
        set(&self.received, s.received);
        set(&self.recv_calls, s.recv_calls);
        for (c, v) in self.dropped.iter().zip(&s.dropped) {
            set(c, *v);
        }
        set(&self.reloads, s.reloads);
        set(&self.reloads_failed, s.reloads_failed);
        set(&self.upgrades, s.upgrades);
        set(&self.upgrades_failed, s.upgrades_failed);
        set(&self.retries_sent, s.admission[0]);
        set(&self.retries_unsent, s.admission[1]);
        set(&self.tokens_accepted, s.admission[2]);
        for (l, v) in self.instances.iter().zip(&s.lanes) {
            set(&l.forwarded, v[0]);
            set(&l.doorbells, v[1]);
            set(&l.discarded_on_reset, v[2]);
            set(&l.restarts, v[3]);
            set(&l.violations, v[4]);
        }
    }

    /// Counts one session TAKE (any session thread).
    pub fn count_take(&self, result: crate::sessions::TakeResult) {
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
