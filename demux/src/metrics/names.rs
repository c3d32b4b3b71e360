//! Every metric name ringmux exposes, written once. The exposition registers these, `ringmux
//! stats` reads them, and the tests and benchmarks scrape them by these constants. Counters
//! carry the `_total` suffix of the text format (the registry adds it to the base name).

/// Datagrams received on the public socket.
pub const RECEIVED: &str = "ringmux_datagrams_received_total";
/// Receive system calls (recvmmsg) that returned data.
pub const RECV_CALLS: &str = "ringmux_recv_calls_total";
/// Heap allocations on the data-plane thread after start-up.
pub const DATAPLANE_ALLOCATIONS: &str = "ringmux_dataplane_allocations_total";
/// Datagrams not forwarded, label `reason` (a [`super::DropReason`]).
pub const DROPPED: &str = "ringmux_datagrams_dropped_total";
/// Datagrams forwarded, label `instance` (as are all the names below).
pub const FORWARDED: &str = "ringmux_datagrams_forwarded_total";
/// Doorbells rung.
pub const DOORBELLS: &str = "ringmux_doorbells_total";
/// Worker processes restarted.
pub const WORKER_RESTARTS: &str = "ringmux_worker_restarts_total";
/// Ring protocol violations and stalls detected.
pub const RING_VIOLATIONS: &str = "ringmux_ring_violations_total";
/// Forwarded datagrams discarded unread when a ring was reset.
pub const RING_DISCARDED: &str = "ringmux_ring_discarded_total";
/// HTTP/3 requests (reported by the worker).
pub const WORKER_REQUESTS: &str = "ringmux_worker_requests_total";
/// QUIC connections accepted (reported by the worker).
pub const WORKER_CONNECTIONS_ACCEPTED: &str = "ringmux_worker_connections_accepted_total";
/// Datagrams the worker dropped at ingress.
pub const WORKER_DATAGRAMS_DROPPED: &str = "ringmux_worker_datagrams_dropped_total";
/// Datagrams the worker took from its ingress.
pub const WORKER_DATAGRAMS: &str = "ringmux_worker_datagrams_total";
/// Sink mode: datagrams whose connection ID is not the instance's.
pub const WORKER_BAD_CID: &str = "ringmux_worker_bad_cid_total";
/// CPU time of the worker process.
pub const WORKER_CPU: &str = "ringmux_worker_cpu_nanoseconds_total";
/// Gauge: process ID of the current worker.
pub const WORKER_PID: &str = "ringmux_worker_pid";
/// Gauge: sink-mode ring latency, 50th percentile.
pub const SINK_LATENCY_P50: &str = "ringmux_sink_latency_p50_nanoseconds";
/// Gauge: sink-mode ring latency, 99th percentile.
pub const SINK_LATENCY_P99: &str = "ringmux_sink_latency_p99_nanoseconds";
/// Gauge: sink-mode ring latency, 99.9th percentile.
pub const SINK_LATENCY_P999: &str = "ringmux_sink_latency_p999_nanoseconds";
/// Gauge: slots published and not yet released.
pub const RING_OCCUPANCY: &str = "ringmux_ring_occupancy";
/// Gauge: open QUIC connections (reported by the worker).
pub const WORKER_CONNECTIONS: &str = "ringmux_worker_connections";
/// Gauge: 1 while the worker is serving.
pub const WORKER_UP: &str = "ringmux_worker_up";
/// Gauge: 1, labels `instance` and `program` (what the instance runs, `--worker-cmd`).
pub const WORKER_INFO: &str = "ringmux_worker_info";

/// Gauge: the worker generation new connections go to.
pub const GENERATION_ACTIVE: &str = "ringmux_worker_generation_active";
/// Gauge: 1 while a worker is up, labels `instance`, `generation` and `state` (`starting`,
/// `serving`, `draining`).
pub const GENERATION_WORKERS: &str = "ringmux_generation_workers_up";
/// Gauge: open connections (reported by the worker), labels `instance`, `generation`, `state`.
pub const GENERATION_CONNECTIONS: &str = "ringmux_generation_connections";
/// Counter: reloads, label `result` (`ok`, `failed`).
pub const RELOADS: &str = "ringmux_reloads_total";
/// Counter: upgrades of the demux itself (`ringmux upgrade`) this process went through, label
/// `result` (`ok`, `failed`: refused or failed, the demux served on).
pub const UPGRADES: &str = "ringmux_upgrades_total";
/// Gauge: the last upgrade's pause, from the old demux's last received datagram to the new
/// one's first.
pub const UPGRADE_PAUSE: &str = "ringmux_upgrade_pause_seconds";
/// Gauge: bytes that waited in the public socket's receive queue when the last upgrade's new
/// demux took it over.
pub const UPGRADE_QUEUED: &str = "ringmux_upgrade_queued_bytes";

/// Counter: Retries the demux answered new connections with, label `result` (`sent`, `unsent`:
/// the public socket's send buffer was full).
pub const RETRIES: &str = "ringmux_retries_total";
/// Counter: tokens (the demux's Retry tokens, the workers' NEW_TOKEN ones) the demux checked,
/// label `result` (`accepted`, `refused`: a Retry token for another address or expired; each
/// refusal is also a `token_refused` drop).
pub const TOKENS: &str = "ringmux_tokens_total";
/// Gauge: 1 while the demux is under pressure (`--retry auto` sends Retries, the prefix budget
/// applies).
pub const ADMISSION_PRESSURE: &str = "ringmux_admission_pressure";

/// Counter: workers' session TAKEs, label `result` (`hit`, `miss`: granted; `foreign`,
/// `unbound`: refused, see `tickets.rs`).
pub const SESSION_TAKES: &str = "ringmux_session_takes_total";
/// Counter: Initials read for the tickets of their ClientHellos, label `result` (`read`,
/// `unopened`, `unparsed`, `abandoned`; see `tickets.rs`).
pub const CLIENT_HELLOS: &str = "ringmux_client_hellos_total";

/// Counter: reverse-proxy upstream failures, labels `instance` and `kind` (`connect`, `reset`,
/// `timeout`, `protocol`).
pub const WORKER_UPSTREAM_ERRORS: &str = "ringmux_worker_upstream_errors_total";

/// Counter: HTTPS-over-TCP connections a worker accepted, label `instance`.
pub const WORKER_TCP_CONNECTIONS: &str = "ringmux_worker_tcp_connections_total";
/// Counter: TCP connections refused or ended for bad input or overload, labels `instance` and
/// `kind` (`over_cap`, `tls_failed`, `tls_timeout`, `header_timeout`, `too_large`,
/// `rapid_reset`, `protocol`).
pub const WORKER_TCP_ERRORS: &str = "ringmux_worker_tcp_errors_total";

/// Counters: access-log lines a worker wrote, and dropped (its queue was full, or the write
/// failed), label `instance`.
pub const WORKER_ACCESS_LOG_LINES: &str = "ringmux_worker_access_log_lines_total";
pub const WORKER_ACCESS_LOG_DROPPED: &str = "ringmux_worker_access_log_dropped_total";

/// Every name above.
pub const ALL: [&str; 40] = [
    RECEIVED,
    RECV_CALLS,
    DATAPLANE_ALLOCATIONS,
    DROPPED,
    FORWARDED,
    DOORBELLS,
    WORKER_RESTARTS,
    RING_VIOLATIONS,
    RING_DISCARDED,
    WORKER_REQUESTS,
    WORKER_CONNECTIONS_ACCEPTED,
    WORKER_DATAGRAMS_DROPPED,
    WORKER_DATAGRAMS,
    WORKER_BAD_CID,
    WORKER_CPU,
    WORKER_PID,
    SINK_LATENCY_P50,
    SINK_LATENCY_P99,
    SINK_LATENCY_P999,
    RING_OCCUPANCY,
    WORKER_CONNECTIONS,
    WORKER_UP,
    WORKER_INFO,
    WORKER_UPSTREAM_ERRORS,
    WORKER_TCP_CONNECTIONS,
    WORKER_TCP_ERRORS,
    WORKER_ACCESS_LOG_LINES,
    WORKER_ACCESS_LOG_DROPPED,
    GENERATION_ACTIVE,
    GENERATION_WORKERS,
    GENERATION_CONNECTIONS,
    RELOADS,
    UPGRADES,
    UPGRADE_PAUSE,
    UPGRADE_QUEUED,
    RETRIES,
    TOKENS,
    ADMISSION_PRESSURE,
    SESSION_TAKES,
    CLIENT_HELLOS,
];
