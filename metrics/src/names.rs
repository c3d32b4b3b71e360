//! Every metric name ringmux exposes, written once. The exposition registers these, `ringmux
//! stats` reads them, and the tests and benchmarks scrape them by these constants. Counters
//! carry the `_total` suffix of the text format (the registry adds it to the base name).
//!
//! Each name is one line of the list below, with its documentation: the constant and its place
//! in [`ALL`] come from that line.

/// Declares each name's constant and [`ALL`], in declaration order.
macro_rules! metric_names {
    ($( $(#[$doc:meta])* $name:ident = $value:literal; )+) => {
        $( $(#[$doc])* pub const $name: &str = $value; )+

        /// Every name above, in declaration order.
        pub const ALL: [&str; [$($value),+].len()] = [$($name),+];
    };
}

metric_names! {
    /// Datagrams received on the public socket.
    RECEIVED = "ringmux_datagrams_received_total";
    /// Receive system calls (recvmmsg) that returned data.
    RECV_CALLS = "ringmux_recv_calls_total";
    /// Receive coalescing windows slept (waits on a timer instead of on the socket).
    RECV_WINDOWS = "ringmux_recv_coalescing_windows_total";
    /// Heap allocations on the data-plane thread after start-up.
    DATAPLANE_ALLOCATIONS = "ringmux_dataplane_allocations_total";
    /// Datagrams not forwarded, label `reason` (a [`super::DropReason`]).
    DROPPED = "ringmux_datagrams_dropped_total";
    /// Datagrams forwarded, label `instance` (as are all the names below).
    FORWARDED = "ringmux_datagrams_forwarded_total";
    /// Doorbells rung.
    DOORBELLS = "ringmux_doorbells_total";
    /// Worker processes restarted.
    WORKER_RESTARTS = "ringmux_worker_restarts_total";
    /// Ring protocol violations and stalls detected.
    RING_VIOLATIONS = "ringmux_ring_violations_total";
    /// Forwarded datagrams discarded unread when a ring was reset.
    RING_DISCARDED = "ringmux_ring_discarded_total";
    /// HTTP/3 requests (reported by the worker).
    WORKER_REQUESTS = "ringmux_worker_requests_total";
    /// QUIC connections accepted (reported by the worker).
    WORKER_CONNECTIONS_ACCEPTED = "ringmux_worker_connections_accepted_total";
    /// Datagrams the worker dropped at ingress.
    WORKER_DATAGRAMS_DROPPED = "ringmux_worker_datagrams_dropped_total";
    /// Datagrams the worker took from its ingress.
    WORKER_DATAGRAMS = "ringmux_worker_datagrams_total";
    /// Sink mode: datagrams whose connection ID is not the instance's.
    WORKER_BAD_CID = "ringmux_worker_bad_cid_total";
    /// CPU time of the worker process.
    WORKER_CPU = "ringmux_worker_cpu_nanoseconds_total";
    /// Gauge: process ID of the current worker.
    WORKER_PID = "ringmux_worker_pid";
    /// Gauge: sink-mode ring latency, 50th percentile.
    SINK_LATENCY_P50 = "ringmux_sink_latency_p50_nanoseconds";
    /// Gauge: sink-mode ring latency, 99th percentile.
    SINK_LATENCY_P99 = "ringmux_sink_latency_p99_nanoseconds";
    /// Gauge: sink-mode ring latency, 99.9th percentile.
    SINK_LATENCY_P999 = "ringmux_sink_latency_p999_nanoseconds";
    /// Gauge: slots published and not yet released.
    RING_OCCUPANCY = "ringmux_ring_occupancy";
    /// Gauge: open QUIC connections (reported by the worker).
    WORKER_CONNECTIONS = "ringmux_worker_connections";
    /// Gauge: 1 while the worker is serving.
    WORKER_UP = "ringmux_worker_up";
    /// Gauge: 1, labels `instance` and `program` (what the instance runs, `--worker-cmd`).
    WORKER_INFO = "ringmux_worker_info";
    /// Lines of a worker's standard output and error written to ringmux's standard error.
    WORKER_LOG_LINES = "ringmux_worker_log_lines_total";
    /// Lines of a worker's standard output and error dropped: past the worker's rate.
    WORKER_LOG_LINES_DROPPED = "ringmux_worker_log_lines_dropped_total";
    /// The demux's own log lines and its workers' output lines it could not write (queue full,
    /// or the write to its standard error failed).
    LOG_LINES_DROPPED = "ringmux_log_lines_dropped_total";
    /// Access-log lines the demux could not write (a full disk, a failed write).
    ACCESS_LOG_LINES_DROPPED = "ringmux_access_log_lines_dropped_total";
    /// Counter: a worker's messages the demux read and dropped past its budget (`budget.rs`),
    /// labels `instance` and `kind` (`stats`, `control`: other control messages; `session`:
    /// session-store requests).
    WORKER_MESSAGES_DROPPED = "ringmux_worker_messages_dropped_total";

    /// Gauge: the worker generation new connections go to.
    GENERATION_ACTIVE = "ringmux_worker_generation_active";
    /// Gauge: 1 while a worker is up, labels `instance`, `generation` and `state` (`starting`,
    /// `serving`, `draining`).
    GENERATION_WORKERS = "ringmux_generation_workers_up";
    /// Gauge: open connections (reported by the worker), labels `instance`, `generation`, `state`.
    GENERATION_CONNECTIONS = "ringmux_generation_connections";
    /// Gauge: HTTP requests in flight (reported by the worker), labels `instance`,
    /// `generation`, `state`: what a draining generation still serves.
    GENERATION_REQUESTS = "ringmux_generation_requests_in_flight";
    /// Gauge: seconds since the worker began to drain (0 while it does not), labels
    /// `instance`, `generation`, `state`.
    GENERATION_DRAINING_SECONDS = "ringmux_generation_draining_seconds";
    /// Counter: workers told to cut what they still served at the end of a drain (`--grace`
    /// over, `--max-draining` reached, or a shutdown cut short).
    WORKER_CUTS = "ringmux_worker_cuts_total";
    /// Counter: reloads, label `result` (`ok`, `failed`).
    RELOADS = "ringmux_reloads_total";
    /// Counter: upgrades of the demux itself (`ringmux upgrade`) this process went through, label
    /// `result` (`ok`, `failed`: refused or failed, the demux served on).
    UPGRADES = "ringmux_upgrades_total";
    /// Gauge: the last upgrade's pause, from the old demux's last received datagram to the new
    /// one's first.
    UPGRADE_PAUSE = "ringmux_upgrade_pause_seconds";
    /// Gauge: bytes that waited in the public socket's receive queue when the last upgrade's new
    /// demux took it over.
    UPGRADE_QUEUED = "ringmux_upgrade_queued_bytes";

    /// Counter: Retries the demux answered new connections with, label `result` (`sent`, `unsent`:
    /// the public socket's send buffer was full).
    RETRIES = "ringmux_retries_total";
    /// Counter: tokens (the demux's Retry tokens, the workers' NEW_TOKEN ones) the demux checked,
    /// label `result` (`accepted`, `refused`: a Retry token for another address or expired; each
    /// refusal is also a `token_refused` drop).
    TOKENS = "ringmux_tokens_total";
    /// Gauge: 1 while the demux is under pressure (`--retry auto` sends Retries, the prefix budget
    /// applies).
    ADMISSION_PRESSURE = "ringmux_admission_pressure";

    /// Counter: workers' session TAKEs, label `result` (`hit`, `miss`: granted; `foreign`,
    /// `unbound`: refused, see `tickets.rs`).
    SESSION_TAKES = "ringmux_session_takes_total";
    /// Counter: Initials read for the tickets of their ClientHellos, label `result` (`read`,
    /// `unopened`, `unparsed`, `abandoned`; see `tickets.rs`).
    CLIENT_HELLOS = "ringmux_client_hellos_total";

    /// Counter: reverse-proxy upstream failures, labels `instance` and `kind` (`connect`, `reset`,
    /// `timeout`, `protocol`).
    WORKER_UPSTREAM_ERRORS = "ringmux_worker_upstream_errors_total";

    /// Counter: HTTPS-over-TCP connections a worker accepted, label `instance`.
    WORKER_TCP_CONNECTIONS = "ringmux_worker_tcp_connections_total";
    /// Counter: TCP connections refused or ended for bad input or overload, or closed idle,
    /// labels `instance` and `kind` (`over_cap`, `tls_failed`, `unknown_name`, `tls_timeout`,
    /// `header_timeout`, `too_large`, `rapid_reset`, `protocol`, `idle_timeout`, `evicted`,
    /// `linger_cut`).
    WORKER_TCP_ERRORS = "ringmux_worker_tcp_errors_total";

    /// Counter: access-log lines a worker wrote, label `instance`.
    WORKER_ACCESS_LOG_LINES = "ringmux_worker_access_log_lines_total";
    /// Counter: access-log lines a worker dropped (its queue was full, or the write failed), label
    /// `instance`.
    WORKER_ACCESS_LOG_DROPPED = "ringmux_worker_access_log_dropped_total";

    /// Counter: responses by site (reported by the worker), labels `instance`, `site` (the label
    /// of a site of the demux's table, `-` for requests no site answered) and `class` (`1xx` to
    /// `5xx`). A site appears once it has answered on that instance.
    WORKER_SITE_RESPONSES = "ringmux_worker_site_responses_total";
    /// Counter: of those, the 421s (misdirected requests), labels `instance` and `site`.
    WORKER_SITE_MISDIRECTED = "ringmux_worker_site_misdirected_total";
    /// Counter: parts of workers' `STATS` reports the demux dropped, labels `instance` and `kind`
    /// (`site`: a site row whose index is past the demux's table; `malformed`: a whole report
    /// that did not parse).
    WORKER_REPORT_PARTS_DROPPED = "ringmux_worker_report_parts_dropped_total";

    /// Gauge: when the certificate each site serves expires (its notAfter, Unix time in
    /// seconds), labels `site` and `name` (each name of the site; for the command line's site,
    /// the certificate's own). An ACME site appears once it has a certificate.
    CERTIFICATE_EXPIRY = "ringmux_certificate_expiry_seconds";
    /// Counter: ACME orders by `result`: `issued`, `failed`.
    ACME_ORDERS = "ringmux_acme_orders_total";
    /// Counter: files of the ACME state directory refused because no demux sealed them, label
    /// `file`: `certificate`, `challenge`, `attempt`, `account`; and `foreign-challenge`: a
    /// sealed challenge for a name no ACME site of this node has (never answered).
    ACME_STATE_REFUSED = "ringmux_acme_state_refused_total";

    /// Gauge: a checked backend's verdict by its active health check, labels `site`, `route`
    /// (its path) and `backend` (as the workers' `backend` label): 1 up, 0 down; absent until
    /// its first verdict.
    BACKEND_UP = "ringmux_backend_up";
    /// Counter: active health probes, labels `backend`, `path` and `result` (`pass`,
    /// `timeout`, `connect`, `status`, `tls`, `protocol`): one per interval per distinct
    /// backend and path, for the box.
    HEALTH_PROBES = "ringmux_health_probes_total";
}

/// The `file` labels of [`ACME_STATE_REFUSED`] for files refused for their seal, in the order
/// the ACME engine counts them; `foreign-challenge` follows them.
pub use ringmux_acme::STATE_FILES as ACME_STATE_FILES;

#[cfg(test)]
mod tests {
    /// Each name is declared once: a line copied without renaming would expose two metrics
    /// under one name.
    #[test]
    fn names_are_distinct_and_prefixed() {
        let mut seen = std::collections::BTreeSet::new();
        for name in super::ALL {
            assert!(name.starts_with("ringmux_"), "{name}");
            assert!(seen.insert(name), "{name} is declared twice");
        }
    }
}
