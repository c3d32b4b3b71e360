//! The server's counters, whatever the transport: [`ServerStats`], their [`StatsSnapshot`], the
//! kinds of TCP failure they count ([`TcpErrorKind`]) and how they go into a `STATS` report.
//! Every front counts into one [`ServerStats`]; the rows by site are [`crate::sites`]'.

use std::sync::atomic::{AtomicU64, Ordering};

use http::StatusCode;

use crate::sites::SiteStats;

/// Counters of one worker's server, over every transport. All `Relaxed`: independent
/// statistics, nothing is published through them.
#[derive(Debug, Default)]
pub struct ServerStats {
    pub connections_accepted: AtomicU64,
    pub connections_active: AtomicU64,
    /// Connections whose handshake or HTTP/3 setup failed.
    pub connections_failed: AtomicU64,
    /// Retry packets sent (address validation, `h3::HttpOptions::retry`).
    pub retries_sent: AtomicU64,
    pub requests_total: AtomicU64,
    /// Requests in flight now: from the request head to the
    /// end of the response (or its abandonment).
    pub requests_active: AtomicU64,
    /// Requests that ended without a complete response: the client reset the stream or went
    /// away, or reading a file failed (the stream is then reset, not answered with 5xx).
    pub requests_failed: AtomicU64,
    pub responses_2xx: AtomicU64,
    /// 301 (directory without its slash) and 304 (not modified).
    pub responses_3xx: AtomicU64,
    pub responses_4xx: AtomicU64,
    pub responses_5xx: AtomicU64,
    /// Response body bytes handed to QUIC (or TCP).
    pub bytes_sent: AtomicU64,
    /// HTTPS over TCP (the `tcp` front): connections accepted (those closed at once over the
    /// cap included).
    pub tcp_connections: AtomicU64,
    /// TCP connections refused or ended for bad input or overload, by [`TcpErrorKind`].
    pub tcp_errors: [AtomicU64; TcpErrorKind::ALL.len()],
    /// Requests by protocol (each also counted in `requests_total`).
    pub requests_h1: AtomicU64,
    pub requests_h2: AtomicU64,
    pub requests_h3: AtomicU64,
    /// Responses per site and status class ([`SiteStats::snapshot`]); rows made when serving
    /// begins.
    pub sites: SiteStats,
}

/// A request in flight ([`ServerStats::begin_request`]).
#[derive(Debug)]
pub(crate) struct ActiveRequest(std::sync::Arc<ServerStats>);

impl Drop for ActiveRequest {
    fn drop(&mut self) {
        self.0.requests_active.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A plain copy of [`ServerStats`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StatsSnapshot {
    pub connections_accepted: u64,
    pub connections_active: u64,
    pub connections_failed: u64,
    pub retries_sent: u64,
    pub requests_total: u64,
    pub requests_failed: u64,
    pub responses_2xx: u64,
    pub responses_3xx: u64,
    pub responses_4xx: u64,
    pub responses_5xx: u64,
    pub bytes_sent: u64,
}

impl ServerStats {
    pub fn snapshot(&self) -> StatsSnapshot {
        let l = |c: &AtomicU64| c.load(Ordering::Relaxed);
        StatsSnapshot {
            connections_accepted: l(&self.connections_accepted),
            connections_active: l(&self.connections_active),
            connections_failed: l(&self.connections_failed),
            retries_sent: l(&self.retries_sent),
            requests_total: l(&self.requests_total),
            requests_failed: l(&self.requests_failed),
            responses_2xx: l(&self.responses_2xx),
            responses_3xx: l(&self.responses_3xx),
            responses_4xx: l(&self.responses_4xx),
            responses_5xx: l(&self.responses_5xx),
            bytes_sent: l(&self.bytes_sent),
        }
    }

    /// Puts this server's counters in a `STATS` report: requests and connections in the keys
    /// every worker has, the rest as this server's own series (`control-protocol.md`, "STATS
    /// series"): `requests{protocol}` (`h1`, `h2`, `h3`), `tcp_connections` and
    /// `tcp_errors{kind}` (by [`TcpErrorKind`]), every one each time, 0 or not.
    /// The rows by site are the caller's (their indices are the site table's).
    pub fn report(&self, r: &mut ringmux_proto::WorkerReport) {
        let l = |c: &AtomicU64| c.load(Ordering::Relaxed);
        r.connections_total = l(&self.connections_accepted);
        r.requests_total = l(&self.requests_total);
        r.requests_active = l(&self.requests_active);
        let by_protocol = [
            ("h1", &self.requests_h1),
            ("h2", &self.requests_h2),
            ("h3", &self.requests_h3),
        ];
        let mut series = Vec::new();
        for (protocol, c) in by_protocol {
            series.push(r.set_counter("requests", &[("protocol", protocol)], l(c)));
        }
        series.push(r.set_counter("tcp_connections", &[], l(&self.tcp_connections)));
        for kind in TcpErrorKind::ALL {
            let v = l(&self.tcp_errors[kind as usize]);
            series.push(r.set_counter("tcp_errors", &[("kind", kind.as_str())], v));
        }
        // Fixed names, held to the rules by the tests: a refusal is a bug here.
        debug_assert!(series.iter().all(Result::is_ok), "{series:?}");
    }

    /// A request begins: it is in flight ([`ServerStats::requests_active`]) until the returned
    /// guard drops.
    pub(crate) fn begin_request(self: &std::sync::Arc<Self>) -> ActiveRequest {
        self.requests_active.fetch_add(1, Ordering::Relaxed);
        ActiveRequest(self.clone())
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
    /// Every kind, in the order of [`ServerStats::tcp_errors`].
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

    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            TcpErrorKind::OverCap => "over_cap",
            TcpErrorKind::TlsFailed => "tls_failed",
            TcpErrorKind::UnknownName => "unknown_name",
            TcpErrorKind::TlsTimeout => "tls_timeout",
            TcpErrorKind::HeaderTimeout => "header_timeout",
            TcpErrorKind::TooLarge => "too_large",
            TcpErrorKind::RapidReset => "rapid_reset",
            TcpErrorKind::Protocol => "protocol",
            TcpErrorKind::IdleTimeout => "idle_timeout",
            TcpErrorKind::Evicted => "evicted",
            TcpErrorKind::LingerCut => "linger_cut",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The worker reports [`ServerStats::tcp_errors`] as the series `tcp_errors{kind}`
    /// ([`ServerStats::report`]): each kind indexes its own counter, names a label value the
    /// contract takes, and is reported even at 0.
    #[test]
    fn error_kinds_are_reported_as_series() {
        let stats = ServerStats::default();
        for (i, kind) in TcpErrorKind::ALL.into_iter().enumerate() {
            assert_eq!(kind as usize, i, "{kind:?}");
            stats.count_tcp_error(kind);
            for _ in 0..i {
                stats.count_tcp_error(kind);
            }
        }
        stats.requests_h2.store(4, Ordering::Relaxed);
        let mut r = ringmux_proto::WorkerReport::default();
        stats.report(&mut r);
        for (i, kind) in TcpErrorKind::ALL.into_iter().enumerate() {
            let got = r.counter("tcp_errors", &[("kind", kind.as_str())]);
            assert_eq!(got, Some(i as u64 + 1), "{kind:?}");
        }
        assert_eq!(r.counter("requests", &[("protocol", "h2")]), Some(4));
        assert_eq!(r.counter("requests", &[("protocol", "h1")]), Some(0));
        assert_eq!(r.counter("tcp_connections", &[]), Some(0));
        assert_eq!(r.series.len(), 3 + 1 + TcpErrorKind::ALL.len());
    }
}
