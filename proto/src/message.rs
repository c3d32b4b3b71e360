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
//! | [`Message::Certificate`] | demux → worker | an ACME site's certificate, new or renewed |
//! | [`Message::Challenges`] | demux → worker | every pending ACME challenge (replaces the last set) |
//! | [`Message::Applied`] | worker → demux | the `CERTIFICATE` or `CHALLENGES` of that `seq` is in use |
//!
//! Either side treats a closed control socket as the peer's death. A message it does not know
//! is counted by the receiver and otherwise ignored.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Every control message after the hand-off.
// A `STATS` report is a few hundred bytes on the stack about once a second per worker: boxing
// it would only add an allocation.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug, PartialEq, Eq)]
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
    /// demux → worker: the certificate an ACME site serves from now on, on QUIC and TCP
    /// alike; answered with [`Message::Applied`] once it does.
    Certificate(SiteCertificate),
    /// demux → worker: every ACME challenge pending now; the set replaces the one before.
    /// Answered with [`Message::Applied`].
    Challenges(ChallengeSet),
    /// worker → demux: the [`Message::Certificate`] or [`Message::Challenges`] with this
    /// `seq` is in use.
    Applied(u64),
}

/// The first word of each message on the wire, in [`Message`] order.
pub const WORDS: [&str; 7] = [
    "READY",
    "STATS",
    "SHUTDOWN",
    "STOPPED",
    "CERTIFICATE",
    "CHALLENGES",
    "APPLIED",
];

/// The certificate of the ACME site at index `site` of the site table
/// (`sites::SiteTable::sites`), new or renewed. On the wire `CERTIFICATE {json}`.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SiteCertificate {
    /// Numbers every update the demux sends this worker; [`Message::Applied`] names it.
    pub seq: u64,
    pub site: u32,
    /// PEM chain, leaf first.
    pub cert_pem: String,
    /// PEM private key of the leaf.
    pub key_pem: String,
}

impl std::fmt::Debug for SiteCertificate {
    // Never print key material.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SiteCertificate")
            .field("seq", &self.seq)
            .field("site", &self.site)
            .finish_non_exhaustive()
    }
}

/// Every ACME challenge pending now (RFC 8555 §8), answered over TCP only, never over QUIC.
/// On the wire `CHALLENGES {json}`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChallengeSet {
    /// As [`SiteCertificate::seq`].
    pub seq: u64,
    /// HTTP-01: `GET /.well-known/acme-challenge/TOKEN` on the plain-HTTP listener answers
    /// the key authorization, before any redirect.
    pub http01: Vec<Http01>,
    /// TLS-ALPN-01 (RFC 8737): a TLS handshake on the TCP listener for `name` offering only
    /// the ALPN `acme-tls/1` gets this certificate, and the connection ends after it.
    pub tls_alpn01: Vec<TlsAlpn01>,
}

/// One pending HTTP-01 challenge.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Http01 {
    /// The name under validation (for logs; the token alone selects the answer).
    pub name: String,
    /// The challenge's token: base64url, no padding.
    pub token: String,
    /// What the request for the token is answered with (`text/plain`).
    pub key_authorization: String,
}

/// One pending TLS-ALPN-01 challenge.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsAlpn01 {
    /// The name under validation, lower case: the SNI the CA sends.
    pub name: String,
    /// PEM of the self-signed certificate for `name` with the critical `acmeIdentifier`
    /// extension (OID 1.3.6.1.5.5.7.1.31) holding the SHA-256 of the key authorization.
    pub cert_pem: String,
    /// PEM of its private key.
    pub key_pem: String,
}

impl std::fmt::Debug for TlsAlpn01 {
    // Never print key material.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsAlpn01")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

/// The ALPN protocol of TLS-ALPN-01 (RFC 8737 §6.2).
pub const ACME_TLS_ALPN: &[u8] = b"acme-tls/1";

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
            Message::Certificate(c) => json_message(WORDS[4], c),
            Message::Challenges(c) => json_message(WORDS[5], c),
            Message::Applied(seq) => format!("{} {seq}", WORDS[6]).into_bytes(),
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
            "CERTIFICATE" => json_body(WORDS[4], rest).map(Message::Certificate),
            "CHALLENGES" => json_body(WORDS[5], rest).map(Message::Challenges),
            "APPLIED" => rest
                .parse()
                .map(Message::Applied)
                .map_err(|_| MessageError::Malformed {
                    word: WORDS[6],
                    problem: format!("{rest:?} is not a sequence number"),
                }),
            _ => Err(unknown()),
        }
    }
}

/// `WORD {json}`.
fn json_message(word: &str, body: &impl Serialize) -> Vec<u8> {
    let mut out = format!("{word} ").into_bytes();
    // Serialising these plain structs of strings and numbers cannot fail.
    serde_json::to_writer(&mut out, body).expect("a control message serialises");
    out
}

/// The JSON body of a `word` message.
fn json_body<T: serde::de::DeserializeOwned>(
    word: &'static str,
    rest: &str,
) -> Result<T, MessageError> {
    serde_json::from_str(rest).map_err(|e| MessageError::Malformed {
        word,
        problem: e.to_string(),
    })
}

/// Declares [`WorkerReport`], [`STATS_KEYS`] and the field accessors from one list: a counter
/// is added by one line here (plus its row in `control-protocol.md`, "STATS keys", which
/// `tests/doc.rs` holds to [`STATS_KEYS`]).
macro_rules! worker_report {
    ($($(#[doc = $doc:literal])* $name:ident,)*) => {
        /// Worker → demux statistics. Every field but [`WorkerReport::sites`] is a `u64`; on
        /// the wire `STATS k=v k=v …`, where unknown keys are ignored and missing ones stay 0,
        /// so either side may add a counter without a version bump.
        #[derive(Clone, Debug, Default, PartialEq, Eq)]
        pub struct WorkerReport {
            $($(#[doc = $doc])* pub $name: u64,)*
            /// Responses per site, by the site's index in the site table the demux handed over
            /// (`sites::SiteTable::sites`; the index one past the last site is the row of
            /// requests no site answered): keys `site<index>_<column>` ([`SITE_COLUMNS`]).
            /// Totals since the worker started; a row left out of a report keeps the value the
            /// demux had for it (see [`WorkerReport::encode_rotating`]).
            pub sites: BTreeMap<u32, SiteRow>,
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

    /// The wire form with every site row that fits: [`WorkerReport::encode_rotating`] from
    /// site 0.
    fn encode(&self) -> String {
        self.encode_rotating(0).0
    }

    /// The wire form, at most [`MAX_STATS`](crate::MAX_STATS) bytes: every `u64` field, then
    /// the site rows from index `first` on, wrapping round to the rows before it, each row's
    /// numbers that are not 0, as many whole rows as fit. Also the index to start the next
    /// report at: the first row left out, or `first` when every row fits. A worker with more
    /// sites than one report holds passes that back each time, so every row is sent in turn;
    /// a row left out keeps its last value at the demux, and as values are totals, the next
    /// report that carries it is right again.
    pub fn encode_rotating(&self, first: u32) -> (String, u32) {
        let mut s = String::from(WORDS[1]);
        for (k, v) in STATS_KEYS.iter().zip(self.fields()) {
            push_key(&mut s, format_args!("{k}"), v);
        }
        let rows = self.sites.range(first..).chain(self.sites.range(..first));
        let mut row_text = String::new();
        for (&site, row) in rows {
            row_text.clear();
            for (column, &v) in SITE_COLUMNS.iter().zip(row).filter(|(_, v)| **v != 0) {
                push_key(&mut row_text, format_args!("site{site}_{column}"), v);
            }
            if s.len() + row_text.len() > crate::MAX_STATS {
                return (s, site);
            }
            s.push_str(&row_text);
        }
        (s, first)
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
            } else if let Some((site, column)) = site_key(k) {
                r.sites.entry(site).or_default()[column] = v;
            }
        }
        Ok(r)
    }
}

/// The columns of a site's row, in order: responses by status class (`1xx` to `5xx`), then
/// `421`, the 4xx that were misdirected requests (RFC 9110 §15.5.20).
pub const SITE_COLUMNS: [&str; 6] = ["1xx", "2xx", "3xx", "4xx", "5xx", "421"];

/// One site's numbers in a report, in [`SITE_COLUMNS`] order.
pub type SiteRow = [u64; SITE_COLUMNS.len()];

/// The site and column of a key `site<index>_<column>`; `None` for any other key (one of a
/// column this build does not know is ignored, as unknown keys are). An index past `u32`
/// reads as `u32::MAX`, which no site table reaches: the receiver drops it as out of range.
fn site_key(key: &str) -> Option<(u32, usize)> {
    let (index, column) = key.strip_prefix("site")?.split_once('_')?;
    if index.is_empty() || !index.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let column = SITE_COLUMNS.iter().position(|c| *c == column)?;
    Some((index.parse().unwrap_or(u32::MAX), column))
}

/// Appends ` key=value`.
fn push_key(s: &mut String, key: std::fmt::Arguments<'_>, v: u64) {
    use std::fmt::Write as _;
    let _ = write!(s, " {key}={v}");
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
    fn acme_messages_round_trip() {
        let messages = [
            Message::Certificate(SiteCertificate {
                seq: 7,
                site: 2,
                cert_pem: "-----BEGIN CERTIFICATE-----\n…".into(),
                key_pem: "key \" with quote".into(),
            }),
            Message::Challenges(ChallengeSet {
                seq: 8,
                http01: vec![Http01 {
                    name: "a.example".into(),
                    token: "tok_-en".into(),
                    key_authorization: "tok_-en.thumb".into(),
                }],
                tls_alpn01: vec![TlsAlpn01 {
                    name: "b.example".into(),
                    cert_pem: "c".into(),
                    key_pem: "k".into(),
                }],
            }),
            Message::Challenges(ChallengeSet::default()),
            Message::Applied(u64::MAX),
        ];
        for m in messages {
            assert_eq!(Message::decode(&m.encode()), Ok(m.clone()), "{m:?}");
        }
        for bad in [
            &b"APPLIED"[..],
            b"APPLIED -1",
            b"APPLIED 1 2",
            b"CERTIFICATE",
            b"CERTIFICATE {}",
            b"CERTIFICATE {\"seq\":1,\"site\":0,\"cert_pem\":\"\",\"key_pem\":\"\",\"x\":1}",
            b"CHALLENGES [",
        ] {
            assert!(
                matches!(Message::decode(bad), Err(MessageError::Malformed { .. })),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
        let debug = format!(
            "{:?}",
            SiteCertificate {
                seq: 1,
                site: 0,
                cert_pem: String::new(),
                key_pem: "SECRET".into()
            }
        );
        assert!(!debug.contains("SECRET"), "{debug}");
    }

    #[test]
    fn messages_round_trip() {
        for m in [Message::Ready, Message::Shutdown, Message::Stats(report())] {
            assert_eq!(Message::decode(&m.encode()), Ok(m));
        }
        assert_eq!(report().fields(), std::array::from_fn(|i| i as u64 + 1));
    }

    #[test]
    fn site_rows_round_trip_and_leave_zeros_out() {
        let mut r = report();
        r.sites.insert(0, [0, 7, 0, 2, 0, 1]);
        r.sites.insert(3, [1, 0, 0, 0, 9, 0]);
        let text = String::from_utf8(Message::Stats(r.clone()).encode()).unwrap();
        assert!(
            text.ends_with(" site0_2xx=7 site0_4xx=2 site0_421=1 site3_1xx=1 site3_5xx=9"),
            "{text}"
        );
        assert_eq!(Message::decode(text.as_bytes()), Ok(Message::Stats(r)));
    }

    /// Keys a worker may forge: an index past `u32` reads as `u32::MAX` (out of every table),
    /// a column this build does not know and a key that only looks like a site's are ignored,
    /// a value that is not a `u64` refuses the report whole.
    #[test]
    fn hostile_site_keys() {
        let decoded = |text: &str| match Message::decode(text.as_bytes()) {
            Ok(Message::Stats(r)) => r.sites,
            other => panic!("{text}: {other:?}"),
        };
        let sites = decoded(
            "STATS site99999999999999999999999_2xx=5 site4294967296_1xx=1 site1_6xx=3 \
             site_2xx=4 siteX_2xx=4 site-1_2xx=4 site+1_2xx=4 site1_2xx=8 site1_2xx=9",
        );
        assert_eq!(
            sites.into_iter().collect::<Vec<_>>(),
            [(1, [0, 9, 0, 0, 0, 0]), (u32::MAX, [1, 5, 0, 0, 0, 0])]
        );
        for bad in [
            "STATS site0_2xx=-1",
            "STATS site0_2xx=1.5",
            "STATS site0_2xx=18446744073709551616",
            "STATS site0_2xx=",
            "STATS site0_2xx",
        ] {
            assert!(
                matches!(
                    Message::decode(bad.as_bytes()),
                    Err(MessageError::Malformed { .. })
                ),
                "{bad}"
            );
        }
    }

    /// More rows than one report holds: each report stays within `MAX_STATS`, carries whole
    /// rows, and passing back where it stopped sends every row in turn.
    #[test]
    fn site_rows_past_the_limit_rotate() {
        let mut r = report();
        for site in 0..10_000 {
            r.sites.insert(site, [u64::MAX; SITE_COLUMNS.len()]);
        }
        let (mut seen, mut first, mut reports) = (BTreeMap::new(), 0, 0);
        while seen.len() < r.sites.len() {
            let (text, next) = r.encode_rotating(first);
            assert!(text.len() <= crate::MAX_STATS);
            let Ok(Message::Stats(back)) = Message::decode(text.as_bytes()) else {
                panic!("a report that does not decode");
            };
            assert_eq!(back.fields(), r.fields());
            assert!(back.sites.contains_key(&first), "starts at {first}");
            assert_ne!(next, first, "progress");
            for (site, row) in back.sites {
                assert_eq!(row, r.sites[&site], "whole rows");
                seen.insert(site, row);
            }
            first = next;
            reports += 1;
        }
        // About 2 MB of rows in 160 KiB reports: each one full but for less than a row.
        assert!((13..=14).contains(&reports), "{reports}");
        // Rows that fit are sent whole every time, and the next report starts where this one did.
        r.sites.retain(|site, _| *site < 3);
        let (text, next) = r.encode_rotating(2);
        assert_eq!(next, 2);
        assert!(
            text.ends_with(&format!("site1_421={}", u64::MAX)),
            "wraps round"
        );
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
