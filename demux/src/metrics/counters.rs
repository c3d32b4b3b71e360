//! The counters: every datagram's fate ([`DropReason`]) and each instance's worker. The data
//! plane is the only writer of the datagram counters (plain stores, once per receive batch); the
//! supervisor writes the worker counters from `STATS` messages.

use std::sync::atomic::{AtomicU64, Ordering};

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
    pub connections_active: AtomicU64,
    pub connections_total: AtomicU64,
    pub requests_total: AtomicU64,
    /// Requests by protocol, in [`REQUEST_PROTOCOLS`] order.
    pub requests_by_protocol: [AtomicU64; REQUEST_PROTOCOLS.len()],
    pub worker_datagrams_in: AtomicU64,
    pub worker_datagrams_dropped: AtomicU64,
    pub worker_bad_cid: AtomicU64,
    pub worker_cpu_ns: AtomicU64,
    pub worker_pid: AtomicU64,
    pub sink_lat_p50_ns: AtomicU64,
    pub sink_lat_p99_ns: AtomicU64,
    pub sink_lat_p999_ns: AtomicU64,
    /// Reverse proxy: upstream failures per kind, in [`UPSTREAM_ERROR_KINDS`] order.
    pub upstream_errors: [AtomicU64; UPSTREAM_ERROR_KINDS.len()],
    /// HTTPS over TCP: connections accepted, and refused or ended per kind, in
    /// [`TCP_ERROR_KINDS`] order.
    pub tcp_connections: AtomicU64,
    pub tcp_errors: [AtomicU64; TCP_ERROR_KINDS.len()],
    /// Access log: lines written and dropped.
    pub access_log_lines: AtomicU64,
    pub access_log_dropped: AtomicU64,
}

/// The `protocol` labels of `ringmux_worker_requests_total`, in the order of the
/// `requests_h*` keys of a worker's `STATS`; requests a worker counted without a protocol are
/// `unknown`.
pub const REQUEST_PROTOCOLS: [&str; 3] = ["h1", "h2", "h3"];

/// The `kind` labels of `ringmux_worker_upstream_errors_total`, in the order of the
/// `upstream_errors_*` keys of a worker's `STATS`.
pub const UPSTREAM_ERROR_KINDS: [&str; 4] = ["connect", "reset", "timeout", "protocol"];

/// The `kind` labels of `ringmux_worker_tcp_errors_total`, in the order of the `tcp_errors_*`
/// keys of a worker's `STATS`.
pub const TCP_ERROR_KINDS: [&str; 7] = [
    "over_cap",
    "tls_failed",
    "tls_timeout",
    "header_timeout",
    "too_large",
    "rapid_reset",
    "protocol",
];

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
        let set = |c: &AtomicU64, v: u64| c.store(v, Ordering::Relaxed);
        set(&self.connections_active, r.connections_active);
        set(&self.connections_total, r.connections_total);
        set(&self.requests_total, r.requests_total);
        for (c, v) in
            self.requests_by_protocol
                .iter()
                .zip([r.requests_h1, r.requests_h2, r.requests_h3])
        {
            set(c, v);
        }
        set(&self.worker_datagrams_in, r.datagrams_in);
        set(&self.worker_datagrams_dropped, r.datagrams_dropped);
        set(&self.worker_bad_cid, r.bad_cid);
        set(&self.worker_cpu_ns, r.cpu_ns);
        set(&self.sink_lat_p50_ns, r.lat_p50_ns);
        set(&self.sink_lat_p99_ns, r.lat_p99_ns);
        set(&self.sink_lat_p999_ns, r.lat_p999_ns);
        for (c, (_, v)) in self
            .upstream_errors
            .iter()
            .zip(r.with_prefix("upstream_errors_"))
        {
            set(c, v);
        }
        set(&self.tcp_connections, r.tcp_connections);
        for (c, (_, v)) in self.tcp_errors.iter().zip(r.with_prefix("tcp_errors_")) {
            set(c, v);
        }
        set(&self.access_log_lines, r.access_log_lines);
        set(&self.access_log_dropped, r.access_log_dropped);
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The metric labels are the worker report's keys after their prefix, in the same order:
    /// `record_report` stores them by position.
    #[test]
    fn kind_labels_follow_the_report_keys() {
        let r = ringmux_proto::WorkerReport::default();
        let labels = |prefix| r.with_prefix(prefix).map(|(l, _)| l).collect::<Vec<_>>();
        assert_eq!(labels("tcp_errors_"), TCP_ERROR_KINDS);
        assert_eq!(labels("upstream_errors_"), UPSTREAM_ERROR_KINDS);
    }
}
