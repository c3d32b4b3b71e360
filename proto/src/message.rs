//! Control messages after the hand-off: one `SOCK_SEQPACKET` packet each, UTF-8 text, no
//! descriptors. A zero-length packet is end-of-file on `SOCK_SEQPACKET`, so every message has at
//! least one byte.
//!
//! | message | direction | when |
//! |---|---|---|
//! | [`Message::Ready`] | worker → demux | once, when the worker serves (its endpoint exists) |
//! | [`Message::Stats`] | worker → demux | about once a second |
//! | [`Message::Shutdown`] | demux → worker | drain: stop accepting, finish requests, exit 0 |
//!
//! Either side treats a closed control socket as the peer's death. A message it does not know
//! is counted by the receiver and otherwise ignored.

/// Every control message after the hand-off.
// A `STATS` report is a few hundred bytes on the stack about once a second per worker: boxing
// it would only add an allocation.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Message {
    /// worker → demux: the worker is serving.
    Ready,
    /// worker → demux: counters of the worker.
    Stats(WorkerReport),
    /// demux → worker: drain and exit.
    Shutdown,
}

/// The first word of each message on the wire, in [`Message`] order.
pub const WORDS: [&str; 3] = ["READY", "STATS", "SHUTDOWN"];

/// A control message that is not one of [`Message`].
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum MessageError {
    #[error("unknown control message (first bytes {0:02x?})")]
    Unknown(Vec<u8>),
    #[error("malformed {word} message: {problem}")]
    Malformed { word: &'static str, problem: String },
}

impl Message {
    /// The wire form.
    pub fn encode(&self) -> Vec<u8> {
        match self {
            Message::Ready => WORDS[0].into(),
            Message::Stats(r) => r.encode().into_bytes(),
            Message::Shutdown => WORDS[2].into(),
        }
    }

    /// Parses one packet.
    pub fn decode(packet: &[u8]) -> Result<Message, MessageError> {
        let unknown = || MessageError::Unknown(packet.iter().take(16).copied().collect());
        let text = std::str::from_utf8(packet).map_err(|_| unknown())?;
        let (word, rest) = text.split_once(' ').unwrap_or((text, ""));
        match word {
            "READY" if rest.is_empty() => Ok(Message::Ready),
            "SHUTDOWN" if rest.is_empty() => Ok(Message::Shutdown),
            "STATS" => WorkerReport::decode_fields(rest).map(Message::Stats),
            _ => Err(unknown()),
        }
    }
}

/// Worker → demux statistics. Every field is a `u64`; on the wire `STATS k=v k=v …`, where
/// unknown keys are ignored and missing ones stay 0, so either side may add a counter without a
/// version bump.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WorkerReport {
    pub connections_active: u64,
    pub connections_total: u64,
    pub requests_total: u64,
    /// Requests by protocol: HTTP/1.1 and HTTP/2 over TCP, HTTP/3. A program that reports only
    /// `requests_total` leaves them 0.
    pub requests_h1: u64,
    pub requests_h2: u64,
    pub requests_h3: u64,
    pub datagrams_in: u64,
    pub datagrams_dropped: u64,
    /// Sink mode: datagrams whose connection ID does not belong to this instance.
    pub bad_cid: u64,
    /// Sink mode: ring latency (receive timestamp to dequeue), ns.
    pub lat_p50_ns: u64,
    pub lat_p99_ns: u64,
    pub lat_p999_ns: u64,
    /// Reverse proxy: upstream failures per kind (connect, reset, timeout, protocol).
    pub upstream_errors_connect: u64,
    pub upstream_errors_reset: u64,
    pub upstream_errors_timeout: u64,
    pub upstream_errors_protocol: u64,
    /// HTTPS over TCP: connections accepted, and those refused or ended for bad input or
    /// overload, per kind.
    pub tcp_connections: u64,
    pub tcp_errors_over_cap: u64,
    pub tcp_errors_tls_failed: u64,
    pub tcp_errors_tls_timeout: u64,
    pub tcp_errors_header_timeout: u64,
    pub tcp_errors_too_large: u64,
    pub tcp_errors_rapid_reset: u64,
    pub tcp_errors_protocol: u64,
    /// Access log (`--access-log`): lines written, and dropped (queue full, or the write failed).
    pub access_log_lines: u64,
    pub access_log_dropped: u64,
    /// CPU time this worker used (user + system), ns.
    pub cpu_ns: u64,
    pub pid: u64,
}

/// The keys of a `STATS` message, in the order [`WorkerReport::fields`] lists them.
pub const STATS_KEYS: [&str; 28] = [
    "connections_active",
    "connections_total",
    "requests_total",
    "requests_h1",
    "requests_h2",
    "requests_h3",
    "datagrams_in",
    "datagrams_dropped",
    "bad_cid",
    "lat_p50_ns",
    "lat_p99_ns",
    "lat_p999_ns",
    "upstream_errors_connect",
    "upstream_errors_reset",
    "upstream_errors_timeout",
    "upstream_errors_protocol",
    "tcp_connections",
    "tcp_errors_over_cap",
    "tcp_errors_tls_failed",
    "tcp_errors_tls_timeout",
    "tcp_errors_header_timeout",
    "tcp_errors_too_large",
    "tcp_errors_rapid_reset",
    "tcp_errors_protocol",
    "access_log_lines",
    "access_log_dropped",
    "cpu_ns",
    "pid",
];

impl WorkerReport {
    /// The fields, in [`STATS_KEYS`] order.
    pub fn fields(&self) -> [u64; STATS_KEYS.len()] {
        [
            self.connections_active,
            self.connections_total,
            self.requests_total,
            self.requests_h1,
            self.requests_h2,
            self.requests_h3,
            self.datagrams_in,
            self.datagrams_dropped,
            self.bad_cid,
            self.lat_p50_ns,
            self.lat_p99_ns,
            self.lat_p999_ns,
            self.upstream_errors_connect,
            self.upstream_errors_reset,
            self.upstream_errors_timeout,
            self.upstream_errors_protocol,
            self.tcp_connections,
            self.tcp_errors_over_cap,
            self.tcp_errors_tls_failed,
            self.tcp_errors_tls_timeout,
            self.tcp_errors_header_timeout,
            self.tcp_errors_too_large,
            self.tcp_errors_rapid_reset,
            self.tcp_errors_protocol,
            self.access_log_lines,
            self.access_log_dropped,
            self.cpu_ns,
            self.pid,
        ]
    }

    fn field_mut(&mut self, key: &str) -> Option<&mut u64> {
        Some(match key {
            "connections_active" => &mut self.connections_active,
            "connections_total" => &mut self.connections_total,
            "requests_total" => &mut self.requests_total,
            "requests_h1" => &mut self.requests_h1,
            "requests_h2" => &mut self.requests_h2,
            "requests_h3" => &mut self.requests_h3,
            "datagrams_in" => &mut self.datagrams_in,
            "datagrams_dropped" => &mut self.datagrams_dropped,
            "bad_cid" => &mut self.bad_cid,
            "lat_p50_ns" => &mut self.lat_p50_ns,
            "lat_p99_ns" => &mut self.lat_p99_ns,
            "lat_p999_ns" => &mut self.lat_p999_ns,
            "upstream_errors_connect" => &mut self.upstream_errors_connect,
            "upstream_errors_reset" => &mut self.upstream_errors_reset,
            "upstream_errors_timeout" => &mut self.upstream_errors_timeout,
            "upstream_errors_protocol" => &mut self.upstream_errors_protocol,
            "tcp_connections" => &mut self.tcp_connections,
            "tcp_errors_over_cap" => &mut self.tcp_errors_over_cap,
            "tcp_errors_tls_failed" => &mut self.tcp_errors_tls_failed,
            "tcp_errors_tls_timeout" => &mut self.tcp_errors_tls_timeout,
            "tcp_errors_header_timeout" => &mut self.tcp_errors_header_timeout,
            "tcp_errors_too_large" => &mut self.tcp_errors_too_large,
            "tcp_errors_rapid_reset" => &mut self.tcp_errors_rapid_reset,
            "tcp_errors_protocol" => &mut self.tcp_errors_protocol,
            "access_log_lines" => &mut self.access_log_lines,
            "access_log_dropped" => &mut self.access_log_dropped,
            "cpu_ns" => &mut self.cpu_ns,
            "pid" => &mut self.pid,
            _ => return None,
        })
    }

    fn encode(&self) -> String {
        let mut s = String::from(WORDS[1]);
        for (k, v) in STATS_KEYS.iter().zip(self.fields()) {
            s.push(' ');
            s.push_str(k);
            s.push('=');
            s.push_str(&v.to_string());
        }
        s
    }

    fn decode_fields(rest: &str) -> Result<Self, MessageError> {
        let bad = |problem: String| MessageError::Malformed {
            word: WORDS[1],
            problem,
        };
        let mut r = WorkerReport::default();
        for kv in rest.split_whitespace() {
            let (k, v) = kv
                .split_once('=')
                .ok_or_else(|| bad(format!("{kv:?} is not key=value")))?;
            let v: u64 = v
                .parse()
                .map_err(|_| bad(format!("{k}={v:?} is not a number")))?;
            if let Some(f) = r.field_mut(k) {
                *f = v;
            }
        }
        Ok(r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report() -> WorkerReport {
        let mut r = WorkerReport::default();
        for (i, k) in STATS_KEYS.iter().enumerate() {
            *r.field_mut(k).unwrap() = i as u64 + 1;
        }
        r
    }

    #[test]
    fn messages_round_trip() {
        for m in [Message::Ready, Message::Shutdown, Message::Stats(report())] {
            assert_eq!(Message::decode(&m.encode()), Ok(m));
        }
        assert_eq!(report().fields(), std::array::from_fn(|i| i as u64 + 1));
    }

    #[test]
    fn stats_ignores_unknown_keys_and_refuses_bad_numbers() {
        let m = Message::decode(b"STATS pid=5 future_counter=9").unwrap();
        assert_eq!(
            m,
            Message::Stats(WorkerReport {
                pid: 5,
                ..WorkerReport::default()
            })
        );
        assert!(matches!(
            Message::decode(b"STATS pid=-1"),
            Err(MessageError::Malformed { .. })
        ));
        assert!(matches!(
            Message::decode(b"STATS pid"),
            Err(MessageError::Malformed { .. })
        ));
    }

    #[test]
    fn unknown_messages_are_errors() {
        for p in [&b"NOPE"[..], b"READY now", b"", b"\xff\xfe", b"ready"] {
            assert!(
                matches!(Message::decode(p), Err(MessageError::Unknown(_))),
                "{p:?}"
            );
        }
    }
}
