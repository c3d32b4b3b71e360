//! Control messages after the hand-off: one `SOCK_SEQPACKET` packet each, UTF-8 text, no
//! descriptors. A zero-length packet is end-of-file on `SOCK_SEQPACKET`, so every message has at
//! least one byte.
//!
//! | message | direction | when |
//! |---|---|---|
//! | [`Message::Ready`] | worker → demux | once, when the worker serves (its endpoint exists) |
//! | [`Message::Stats`] | worker → demux | about once a second |
//! | [`Message::Shutdown`] | demux → worker | drain: stop accepting, finish requests, exit 0 |
//! | [`Message::Stopped`] | worker → demux | after `SHUTDOWN`, once it accepts no new connection |
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
    /// worker → demux, after [`Message::Shutdown`]: the worker accepts no new connection (no
    /// loop of it accepts from the shared TCP listeners any more), so every connection from
    /// now on goes to another worker.
    Stopped,
}

/// The first word of each message on the wire, in [`Message`] order.
pub const WORDS: [&str; 4] = ["READY", "STATS", "SHUTDOWN", "STOPPED"];

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
            Message::Stopped => WORDS[3].into(),
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
            "STOPPED" if rest.is_empty() => Ok(Message::Stopped),
            "STATS" => WorkerReport::decode_fields(rest).map(Message::Stats),
            _ => Err(unknown()),
        }
    }
}

/// Declares [`WorkerReport`], [`STATS_KEYS`] and the field accessors from one list: a counter
/// is added by one line here (plus its row in `control-protocol.md`, "STATS keys", which
/// `tests/doc.rs` holds to [`STATS_KEYS`]).
macro_rules! worker_report {
    ($($(#[doc = $doc:literal])* $name:ident,)*) => {
        /// Worker → demux statistics. Every field is a `u64`; on the wire `STATS k=v k=v …`,
        /// where unknown keys are ignored and missing ones stay 0, so either side may add a
        /// counter without a version bump.
        #[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
        pub struct WorkerReport {
            $($(#[doc = $doc])* pub $name: u64,)*
        }

        /// The keys of a `STATS` message, in the order [`WorkerReport::fields`] lists them.
        pub const STATS_KEYS: [&str; [$(stringify!($name)),*].len()] = [$(stringify!($name)),*];

        impl WorkerReport {
            /// The fields, in [`STATS_KEYS`] order.
            pub fn fields(&self) -> [u64; STATS_KEYS.len()] {
                [$(self.$name),*]
            }

            fn field_mut(&mut self, key: &str) -> Option<&mut u64> {
                match key {
                    $(stringify!($name) => Some(&mut self.$name),)*
                    _ => None,
                }
            }
        }
    };
}

worker_report! {
    connections_active,
    connections_total,
    requests_total,
    /// Requests by protocol: HTTP/1.1 and HTTP/2 over TCP, HTTP/3. A program that reports only
    /// `requests_total` leaves them 0.
    requests_h1,
    requests_h2,
    requests_h3,
    datagrams_in,
    datagrams_dropped,
    /// Sink mode: datagrams whose connection ID does not belong to this instance.
    bad_cid,
    /// Sink mode: ring latency (receive timestamp to dequeue), ns.
    lat_p50_ns,
    lat_p99_ns,
    lat_p999_ns,
    /// Reverse proxy: upstream failures per kind (connect, reset, timeout, protocol).
    upstream_errors_connect,
    upstream_errors_reset,
    upstream_errors_timeout,
    upstream_errors_protocol,
    /// HTTPS over TCP: connections accepted, and those refused or ended for bad input or
    /// overload, or closed idle, per kind.
    tcp_connections,
    tcp_errors_over_cap,
    tcp_errors_tls_failed,
    tcp_errors_tls_timeout,
    tcp_errors_header_timeout,
    tcp_errors_too_large,
    tcp_errors_rapid_reset,
    tcp_errors_protocol,
    tcp_errors_idle_timeout,
    tcp_errors_evicted,
    tcp_errors_linger_cut,
    /// Access log (`--access-log`): lines written, and dropped (queue full, or the write failed).
    access_log_lines,
    access_log_dropped,
    /// CPU time this worker used (user + system), ns.
    cpu_ns,
    pid,
}

/// The [`STATS_KEYS`] that start with `prefix`, in order: each key's index and the rest of the
/// key after `prefix` (a metric label).
pub fn keys_with_prefix(prefix: &str) -> impl Iterator<Item = (usize, &'static str)> + '_ {
    STATS_KEYS
        .iter()
        .enumerate()
        .filter_map(move |(i, k)| Some((i, k.strip_prefix(prefix)?)))
}

impl WorkerReport {
    /// The fields whose key starts with `prefix` (`tcp_errors_`, `upstream_errors_`), in
    /// [`STATS_KEYS`] order: the rest of the key (a metric label) and the value.
    pub fn with_prefix<'a>(
        &'a self,
        prefix: &'a str,
    ) -> impl Iterator<Item = (&'static str, u64)> + 'a {
        let fields = self.fields();
        keys_with_prefix(prefix).map(move |(i, rest)| (rest, fields[i]))
    }

    /// Sets the fields whose key starts with `prefix`, in [`STATS_KEYS`] order, from `values`.
    pub fn set_with_prefix(&mut self, prefix: &str, values: impl IntoIterator<Item = u64>) {
        let keys = STATS_KEYS.iter().filter(|k| k.starts_with(prefix));
        for (k, v) in keys.zip(values) {
            if let Some(f) = self.field_mut(k) {
                *f = v;
            }
        }
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
    fn fields_by_prefix() {
        let mut r = WorkerReport::default();
        r.set_with_prefix("upstream_errors_", [1, 2, 3, 4]);
        assert_eq!(r.upstream_errors_timeout, 3);
        let got: Vec<_> = r.with_prefix("upstream_errors_").collect();
        assert_eq!(
            got,
            [
                ("connect", 1),
                ("reset", 2),
                ("timeout", 3),
                ("protocol", 4)
            ]
        );
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
