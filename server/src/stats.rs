//! The server's counters, whatever the transport, each declared once: [`ServerStats`]'s table
//! gives a counter's field, where a `STATS` report carries it (a key every worker has, or a
//! series of this server's own, `control-protocol.md`, "STATS series") and its help, and
//! [`Reporting::fill`] reports every line of it, so no counter is counted and never reported.
//! The table also declares what the server counts elsewhere (the access log, the proxy's
//! upstreams). The kinds of TCP failure are [`TcpErrorKind`]; the rows by site are
//! [`crate::sites`]'.
//!
//! The request path only adds to atomics (`Relaxed`: independent statistics, nothing is
//! published through them); the report reads them about once a second.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use http::StatusCode;
use ringmux_proto::WorkerReport;

use crate::access_log::AccessLog;
use crate::limits::Refusal;
use crate::proxy::{ErrorKind as ProxyErrorKind, TunnelCounters, TunnelEnd};
use crate::sites::{Router, SiteStats};

/// Where a counter goes in a `STATS` report.
#[derive(Clone, Copy, Debug)]
pub enum Reported {
    /// A key every worker reports (`ringmux_proto::message::STATS_KEYS`), and the report's
    /// field for it.
    Key(&'static str, fn(&mut WorkerReport) -> &mut u64),
    /// A counter series of this server's own: its name and labels.
    Counter(&'static str, Labels),
}

/// The labels of a series of [`Reported::Counter`].
#[derive(Clone, Copy, Debug)]
pub enum Labels {
    None,
    /// One label, always the same value.
    One(&'static str, &'static str),
    /// One label whose values each name a counter of the line, in order (`TcpErrorKind`).
    Each(&'static str, &'static [&'static str]),
}

impl Labels {
    /// How many counters a line of these labels has.
    pub fn count(&self) -> usize {
        match self {
            Labels::None | Labels::One(..) => 1,
            Labels::Each(_, values) => values.len(),
        }
    }

    /// The label of the line's `i`th counter, if it has one.
    pub fn get(&self, i: usize) -> Option<(&'static str, &'static str)> {
        match *self {
            Labels::None => None,
            Labels::One(k, v) => Some((k, v)),
            Labels::Each(k, values) => Some((k, values.get(i)?)),
        }
    }
}

/// Where a line's counters are counted.
#[derive(Clone, Copy, Debug)]
pub enum Source {
    /// Fields of [`ServerStats`]: one atomic, or one per label value.
    Own(fn(&ServerStats) -> &[AtomicU64]),
    /// Elsewhere in the server: the line's `i`th counter, read from the parts it reports.
    Elsewhere(fn(&Reporting, usize) -> u64),
}

/// One line of [`ServerStats::TABLE`].
#[derive(Clone, Copy, Debug)]
pub struct Declared {
    /// The field of [`ServerStats`], or the name of what is counted elsewhere.
    pub field: &'static str,
    pub reported: Reported,
    pub help: &'static str,
    pub source: Source,
}

impl Declared {
    /// How many counters the line has (one per label value).
    pub fn count(&self) -> usize {
        match self.reported {
            Reported::Key(..) => 1,
            Reported::Counter(_, labels) => labels.count(),
        }
    }

    /// The value of the line's `i`th counter.
    pub fn value(&self, from: &Reporting, i: usize) -> u64 {
        match self.source {
            Source::Own(get) => get(&from.stats)
                .get(i)
                .map_or(0, |c| c.load(Ordering::Relaxed)),
            Source::Elsewhere(get) => get(from, i),
        }
    }
}

/// The field type of a line: one counter, or one per value of the enum it is counted by.
macro_rules! counter_type {
    () => {
        AtomicU64
    };
    ($by:ident) => {
        [AtomicU64; $by::ALL.len()]
    };
}

/// A line's atomics as a slice.
macro_rules! counters_of {
    ($s:ident . $field:ident) => {
        std::slice::from_ref(&$s.$field)
    };
    ($s:ident . $field:ident, $by:ident) => {
        &$s.$field[..]
    };
}

/// Where a line goes in a report: `key(FIELD)`, `counter("NAME")`,
/// `counter("NAME", "KEY" = "VALUE")`, or `counter("NAME", "KEY" by ENUM)` (a counter per
/// value of `ENUM::LABELS`, in `ENUM::ALL` order).
macro_rules! reported {
    (key($k:ident)) => {
        Reported::Key(stringify!($k), |r: &mut WorkerReport| &mut r.$k)
    };
    (counter($n:literal)) => {
        Reported::Counter($n, Labels::None)
    };
    (counter($n:literal, $k:literal = $v:literal)) => {
        Reported::Counter($n, Labels::One($k, $v))
    };
    (counter($n:literal, $k:literal by $by:ident)) => {
        Reported::Counter($n, Labels::Each($k, &$by::LABELS))
    };
}

/// Declares [`ServerStats`] and its `TABLE` from one list: a field per line (its help is the
/// field's documentation), and what the server counts elsewhere. A line:
///
/// ```text
/// field[ENUM]: key(FIELD) | counter("NAME"[, "KEY" = "VALUE" | , "KEY" by ENUM]), help "...";
/// ```
///
/// and under `elsewhere`, the same with `, from |reporting, i| value` instead of a field.
macro_rules! server_counters {
    (
        $(#[$meta:meta])*
        pub struct $name:ident {
            $( $(#[$fixed_meta:meta])* pub $fixed:ident : $fixed_ty:ty, )*
        }
        counters {
            $(
                $field:ident $([$by:ident])? : $how:ident $args:tt, help $help:literal;
            )+
        }
        elsewhere {
            $(
                $other:ident : $ohow:ident $oargs:tt, help $ohelp:literal, from $get:expr;
            )*
        }
    ) => {
        $(#[$meta])*
        pub struct $name {
            $( #[doc = $help] pub $field: counter_type!($($by)?), )+
            $( $(#[$fixed_meta])* pub $fixed: $fixed_ty, )*
        }

        impl $name {
            /// Every counter the server reports, one line each, in the order of the report.
            pub const TABLE: &'static [Declared] = &[
                $(
                    Declared {
                        field: stringify!($field),
                        reported: reported!($how $args),
                        help: $help,
                        source: Source::Own(|s: &$name| counters_of!(s.$field $(, $by)?)),
                    },
                )+
                $(
                    Declared {
                        field: stringify!($other),
                        reported: reported!($ohow $oargs),
                        help: $ohelp,
                        source: Source::Elsewhere($get),
                    },
                )*
            ];
        }
    };
}

server_counters! {
    /// Counters of one worker's server, over every transport.
    #[derive(Debug, Default)]
    pub struct ServerStats {
        /// Responses per site and status class ([`SiteStats::snapshot`]); rows made when
        /// serving begins.
        pub sites: SiteStats,
    }
    counters {
        connections_accepted: key(connections_total),
            help "HTTP/3 connections accepted (the report's `connections_total`)";
        connections_failed: counter("connections_failed"),
            help "HTTP/3 connections whose handshake or HTTP/3 setup failed";
        retries_sent: counter("retries_sent"),
            help "Retry packets sent (address validation, `h3::HttpOptions::retry`; under ringmux the demux sends them)";
        requests_total: key(requests_total),
            help "Requests received, whatever the protocol";
        requests_active: key(requests_active),
            help "Requests in flight now: from the request head to the end of the response (or its abandonment)";
        requests_failed: counter("requests_failed"),
            help "Requests that ended without a complete response: the client reset the stream or went away, or reading a file failed (the stream is then reset, not answered with 5xx)";
        requests_h1: counter("requests", "protocol" = "h1"),
            help "Requests over HTTP/1.1 (each also in `requests_total`)";
        requests_h2: counter("requests", "protocol" = "h2"),
            help "Requests over HTTP/2";
        requests_h3: counter("requests", "protocol" = "h3"),
            help "Requests over HTTP/3";
        responses_2xx: counter("responses", "class" = "2xx"),
            help "Responses by status class, over every site";
        responses_3xx: counter("responses", "class" = "3xx"),
            help "301 (directory without its slash), 304 (not modified), redirects";
        responses_4xx: counter("responses", "class" = "4xx"),
            help "Responses 4xx";
        responses_5xx: counter("responses", "class" = "5xx"),
            help "Responses 5xx";
        bytes_sent: counter("bytes_sent"),
            help "Response body bytes handed to QUIC or TCP";
        tcp_connections: counter("tcp_connections"),
            help "HTTPS over TCP: connections accepted (those closed at once over the cap included)";
        quic_unknown_name: counter("quic_errors", "kind" = "unknown_name"),
            help "HTTP/3 handshakes refused for their server name (no site has it, or none was sent, and there is no default site): the TLS alert unrecognized_name; not counted in `connections_failed`";
        tcp_errors[TcpErrorKind]: counter("tcp_errors", "kind" by TcpErrorKind),
            help "TCP connections refused or ended for bad input or overload, or closed idle, by `TcpErrorKind`";
        proxy_protocol_refused[ProxyRefusal]: counter("proxy_protocol_refused", "why" by ProxyRefusal),
            help "TCP connections from a `--proxy-protocol-from` source closed without a valid PROXY header, by `ProxyRefusal`";
        tunnels_opened: counter("tunnels_opened"),
            help "Reverse proxy: tunnels (WebSockets, HTTP/1.1 upgrades) whose both sides switched protocols";
        tunnels_closed[TunnelEnd]: counter("tunnels_closed", "how" by TunnelEnd),
            help "Reverse proxy: tunnels ended, by `TunnelEnd` (those that never opened too)";
        tunnels_refused: counter("tunnels_refused"),
            help "Reverse proxy: tunnels refused with 503, the worker at `--max-tunnels`";
        tunnel_bytes_up: counter("tunnel_bytes", "direction" = "up"),
            help "Reverse proxy: tunnel bytes from clients to upstreams";
        tunnel_bytes_down: counter("tunnel_bytes", "direction" = "down"),
            help "Reverse proxy: tunnel bytes from upstreams to clients";
    }
    elsewhere {
        upstream_errors: counter("upstream_errors", "kind" by ProxyErrorKind),
            help "Reverse proxy: upstream failures by kind, over every upstream",
            from |r: &Reporting, i| r.router.upstream_errors().get(i).copied().unwrap_or(0);
        requests_refused: counter("requests_refused", "reason" by Refusal),
            help "Requests refused by a site's or route's limits before their route answered: `denied` (403, `allow`/`deny`), `rate` (429, over `rate`)",
            from |r: &Reporting, i| r.router.refused().get(i).copied().unwrap_or(0);
        access_log_lines: counter("access_log_lines"),
            help "Access-log lines written",
            from |r: &Reporting, _| r.access_log.as_ref().map_or(0, |l| l.written());
        access_log_dropped: counter("access_log_dropped"),
            help "Access-log lines dropped: the queue was full, or the write failed",
            from |r: &Reporting, _| r.access_log.as_ref().map_or(0, |l| l.dropped());
    }
}

/// What a report is filled from: the server's counters and the parts that count elsewhere.
/// [`Reporting::fill`] is what the worker library calls for each `STATS`.
#[derive(Clone, Debug)]
pub struct Reporting {
    pub stats: Arc<ServerStats>,
    pub router: Router,
    pub access_log: Option<Arc<AccessLog>>,
}

impl Reporting {
    /// Puts every line of [`ServerStats::TABLE`] in `r`, every series each time, 0 or not (as
    /// every key was before they were series), then the rows by site that are not all 0:
    /// the site table's sites in its order, then no site's, the indices the demux knows them
    /// by (`control-protocol.md`, "STATS keys by site").
    pub fn fill(&self, r: &mut WorkerReport) {
        for line in ServerStats::TABLE {
            for i in 0..line.count() {
                let v = line.value(self, i);
                match line.reported {
                    Reported::Key(_, field) => *field(r) = v,
                    Reported::Counter(name, labels) => {
                        let label = labels.get(i);
                        let set = r.set_counter(name, label.as_slice(), v);
                        // Fixed names, held to the rules by the tests: a refusal is a bug here.
                        debug_assert!(set.is_ok(), "{name}: {set:?}");
                    }
                }
            }
        }
        self.router.report_backends(r);
        for (site, row) in (0u32..).zip(self.stats.sites.snapshot()) {
            let row = row.report_row();
            if row.iter().any(|v| *v != 0) {
                r.sites.insert(site, row);
            }
        }
    }
}

/// A request in flight ([`ServerStats::begin_request`]).
#[derive(Debug)]
pub(crate) struct ActiveRequest(Arc<ServerStats>);

impl Drop for ActiveRequest {
    fn drop(&mut self) {
        self.0.requests_active.fetch_sub(1, Ordering::Relaxed);
    }
}

impl ServerStats {
    /// A request begins: it is in flight ([`ServerStats::requests_active`]) until the returned
    /// guard drops.
    pub(crate) fn begin_request(self: &Arc<Self>) -> ActiveRequest {
        self.requests_active.fetch_add(1, Ordering::Relaxed);
        ActiveRequest(self.clone())
    }

    pub(crate) fn count_proxy_refusal(&self, why: ProxyRefusal) {
        self.proxy_protocol_refused[why as usize].fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn count_tcp_error(&self, kind: TcpErrorKind) {
        self.tcp_errors[kind as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a response of site `site` (`None`: of no site), by class, for the site too.
    pub(crate) fn count_response(&self, site: Option<usize>, status: StatusCode) {
        self.sites.count(site, status);
        let c = match status.as_u16() {
            200..=299 => &self.responses_2xx,
            300..=399 => &self.responses_3xx,
            400..=499 => &self.responses_4xx,
            500..=599 => &self.responses_5xx,
            _ => return,
        };
        c.fetch_add(1, Ordering::Relaxed);
    }
}

impl TunnelCounters for ServerStats {
    fn opened(&self) {
        self.tunnels_opened.fetch_add(1, Ordering::Relaxed);
    }

    fn refused(&self) {
        self.tunnels_refused.fetch_add(1, Ordering::Relaxed);
    }

    fn closed(&self, how: TunnelEnd) {
        self.tunnels_closed[how as usize].fetch_add(1, Ordering::Relaxed);
    }

    fn moved(&self, up: bool, n: u64) {
        let c = if up {
            &self.tunnel_bytes_up
        } else {
            &self.tunnel_bytes_down
        };
        c.fetch_add(n, Ordering::Relaxed);
    }
}

/// Why a TCP connection was refused or ended early, for
/// `ringmux_worker_tcp_errors_total{kind}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TcpErrorKind {
    /// Closed at accept: this worker serves `TcpOptions::max_connections` already.
    OverCap,
    /// The TLS handshake failed (garbage instead of TLS, a client that gave up).
    TlsFailed,
    /// The ClientHello named no site of this server (or none, without a default site):
    /// refused with the `unrecognized_name` alert (RFC 6066 §3) before any certificate.
    UnknownName,
    /// The TLS handshake did not finish within `TcpOptions::handshake_timeout`.
    TlsTimeout,
    /// An HTTP/1.1 request head did not arrive within `TcpOptions::header_timeout`.
    HeaderTimeout,
    /// An HTTP/1.1 request head larger than `TcpOptions::max_header_bytes` (answered 431).
    TooLarge,
    /// An HTTP/2 client that reset or provoked too many streams (rapid reset): its connection
    /// was closed with GOAWAY `ENHANCE_YOUR_CALM`.
    RapidReset,
    /// Any other HTTP/1.1 or HTTP/2 protocol violation that ended the connection.
    Protocol,
    /// An HTTP/2 connection without a request in flight for `TcpOptions::idle_timeout`: sent
    /// GOAWAY and closed.
    IdleTimeout,
    /// An idle connection closed to make room for a new one at
    /// `TcpOptions::max_connections`.
    Evicted,
    /// A graceful close cut short by its bound (`close_gracefully`): the client had stopped
    /// taking what was sent, or kept sending, and may have lost the end of a response.
    LingerCut,
}

impl TcpErrorKind {
    /// Every kind, in the order of [`ServerStats::tcp_errors`]: `ALL[k as usize] == k`.
    pub const ALL: [TcpErrorKind; 11] = [
        TcpErrorKind::OverCap,
        TcpErrorKind::TlsFailed,
        TcpErrorKind::UnknownName,
        TcpErrorKind::TlsTimeout,
        TcpErrorKind::HeaderTimeout,
        TcpErrorKind::TooLarge,
        TcpErrorKind::RapidReset,
        TcpErrorKind::Protocol,
        TcpErrorKind::IdleTimeout,
        TcpErrorKind::Evicted,
        TcpErrorKind::LingerCut,
    ];

    /// The metric labels, in [`TcpErrorKind::ALL`] order.
    pub const LABELS: [&'static str; Self::ALL.len()] = [
        "over_cap",
        "tls_failed",
        "unknown_name",
        "tls_timeout",
        "header_timeout",
        "too_large",
        "rapid_reset",
        "protocol",
        "idle_timeout",
        "evicted",
        "linger_cut",
    ];

    /// The metric label.
    pub fn as_str(self) -> &'static str {
        Self::LABELS[self as usize]
    }
}

/// Why a connection from a source of `--proxy-protocol-from` was closed before its PROXY
/// header was read whole (`crate::tcp`'s PROXY protocol), for
/// `ringmux_worker_proxy_protocol_refused_total{why}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ProxyRefusal {
    /// Its first bytes are no PROXY header's (neither `PROXY ` nor version 2's signature).
    #[error("no PROXY header")]
    Missing,
    /// A PROXY header that breaks the protocol (a bad address, port, version or command).
    #[error("a malformed PROXY header")]
    Malformed,
    /// A header longer than its bound: 107 bytes (version 1), 16 + 1024 (version 2).
    #[error("a PROXY header over its bound")]
    Oversize,
    /// The header was not complete within `TcpOptions::proxy_header_timeout`.
    #[error("no whole PROXY header in time")]
    Timeout,
    /// The connection ended (or failed) before the header was complete.
    #[error("the connection ended within its PROXY header")]
    Closed,
}

impl ProxyRefusal {
    /// Every reason, in the order of [`ServerStats::proxy_protocol_refused`]:
    /// `ALL[r as usize] == r`.
    pub const ALL: [ProxyRefusal; 5] = [
        ProxyRefusal::Missing,
        ProxyRefusal::Malformed,
        ProxyRefusal::Oversize,
        ProxyRefusal::Timeout,
        ProxyRefusal::Closed,
    ];

    /// The metric labels, in [`ProxyRefusal::ALL`] order.
    pub const LABELS: [&'static str; Self::ALL.len()] =
        ["missing", "malformed", "oversize", "timeout", "closed"];

    /// The metric label.
    pub fn as_str(self) -> &'static str {
        Self::LABELS[self as usize]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ringmux_proto::message::STATS_KEYS;

    fn reporting(stats: ServerStats) -> Reporting {
        Reporting {
            stats: Arc::new(stats),
            router: Router::from(crate::sites::Site::default()),
            access_log: None,
        }
    }

    /// A distinct value for the `i`th counter of line `line`.
    fn distinct(line: usize, i: usize) -> u64 {
        (line as u64 + 1) * 100 + i as u64 + 1
    }

    /// Every counter the table declares is in the report, with its own value, and nothing
    /// else is: a line declared and not reported, or reported from another line's counter,
    /// fails here. What is counted elsewhere is there too (0 here: no upstream, no log).
    #[test]
    fn every_declared_counter_is_reported_with_its_value() {
        let stats = ServerStats::default();
        for (l, line) in ServerStats::TABLE.iter().enumerate() {
            if let Source::Own(get) = line.source {
                assert_eq!(get(&stats).len(), line.count(), "{}", line.field);
                for (i, c) in get(&stats).iter().enumerate() {
                    c.store(distinct(l, i), Ordering::Relaxed);
                }
            }
        }
        let mut r = WorkerReport::default();
        reporting(stats).fill(&mut r);
        let mut series = 0;
        for (l, line) in ServerStats::TABLE.iter().enumerate() {
            assert!(!line.help.is_empty(), "{}", line.field);
            for i in 0..line.count() {
                let want = match line.source {
                    Source::Own(_) => distinct(l, i),
                    Source::Elsewhere(_) => 0,
                };
                let got = match line.reported {
                    Reported::Key(key, _) => {
                        let at = STATS_KEYS.iter().position(|k| *k == key);
                        at.map(|at| r.fields()[at])
                    }
                    Reported::Counter(name, labels) => {
                        series += 1;
                        r.counter(name, labels.get(i).as_slice())
                    }
                };
                assert_eq!(got, Some(want), "{} [{i}]", line.field);
            }
        }
        assert_eq!(r.series.len(), series, "{:?}", r.series);
        // Fields of the table only: names are not declared twice.
        let mut fields: Vec<_> = ServerStats::TABLE.iter().map(|l| l.field).collect();
        fields.sort();
        fields.dedup();
        assert_eq!(fields.len(), ServerStats::TABLE.len());
    }

    /// Each kind indexes its own counter and names a label value the contract takes.
    #[test]
    fn error_kinds_index_their_counters() {
        let stats = ServerStats::default();
        for (i, kind) in TcpErrorKind::ALL.into_iter().enumerate() {
            assert_eq!(kind as usize, i, "{kind:?}");
            for _ in 0..=i {
                stats.count_tcp_error(kind);
            }
        }
        let mut r = WorkerReport::default();
        reporting(stats).fill(&mut r);
        for (i, kind) in TcpErrorKind::ALL.into_iter().enumerate() {
            let got = r.counter("tcp_errors", &[("kind", kind.as_str())]);
            assert_eq!(got, Some(i as u64 + 1), "{kind:?}");
        }
    }

    /// Each PROXY refusal indexes its own counter and names a label value the contract takes.
    #[test]
    fn proxy_refusals_index_their_counters() {
        let stats = ServerStats::default();
        for (i, why) in ProxyRefusal::ALL.into_iter().enumerate() {
            assert_eq!(why as usize, i, "{why:?}");
            for _ in 0..=i {
                stats.count_proxy_refusal(why);
            }
        }
        let mut r = WorkerReport::default();
        reporting(stats).fill(&mut r);
        for (i, why) in ProxyRefusal::ALL.into_iter().enumerate() {
            let got = r.counter("proxy_protocol_refused", &[("why", why.as_str())]);
            assert_eq!(got, Some(i as u64 + 1), "{why:?}");
        }
    }

    /// What the server reports reaches the demux's metrics: every series of the table, through
    /// the wire and the demux's exposition, under `ringmux_worker_NAME_total{instance,…}`
    /// with its value, whether or not the demux knows its name.
    #[test]
    fn every_declared_series_reaches_the_exposition() {
        use ringmux_demux::metrics::{exposition, Counters, Liveness, Scrape};
        use ringmux_proto::Message;
        let stats = ServerStats::default();
        for (l, line) in ServerStats::TABLE.iter().enumerate() {
            if let Source::Own(get) = line.source {
                for (i, c) in get(&stats).iter().enumerate() {
                    c.store(distinct(l, i), Ordering::Relaxed);
                }
            }
        }
        let mut r = WorkerReport::default();
        reporting(stats).fill(&mut r);
        let Ok(Message::Stats(r)) = Message::decode(&Message::Stats(r).encode()) else {
            panic!("the report does not round-trip");
        };
        let counters = Counters::new(1, 2);
        counters.instances[0].record_report(&r, 0);
        let m = Scrape::parse(&exposition::encode(&counters, &Liveness::new(2)));
        for (l, line) in ServerStats::TABLE.iter().enumerate() {
            let Reported::Counter(name, labels) = line.reported else {
                continue;
            };
            for i in 0..line.count() {
                let mut key = format!("ringmux_worker_{name}_total{{instance=\"0\"");
                if let Some((k, v)) = labels.get(i) {
                    key.push_str(&format!(",{k}=\"{v}\""));
                }
                key.push('}');
                let want = match line.source {
                    Source::Own(_) => distinct(l, i),
                    Source::Elsewhere(_) => 0,
                };
                assert_eq!(m.series.get(&key), Some(&(want as f64)), "{key}");
            }
        }
    }
}
