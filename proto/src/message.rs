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
//! | [`Message::Cut`] | demux → worker | the drain is over: end every request, log each, exit |
//!
//! Either side treats a closed control socket as the peer's death. A message it does not know
//! is counted by the receiver and otherwise ignored.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

pub use crate::series::{Series, SeriesError, SeriesKind, MAX_SERIES};

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
    /// demux → worker, after [`Message::Shutdown`]: the drain is over (its grace period
    /// ended, or its generation must make room for a new one). The worker ends every request
    /// it still serves, writes their access-log lines (cut ones say so), and exits; the demux
    /// kills it if it is still there a few seconds later.
    Cut,
}

/// The first word of each message on the wire, in [`Message`] order.
pub const WORDS: [&str; 8] = [
    "READY",
    "STATS",
    "SHUTDOWN",
    "STOPPED",
    "CERTIFICATE",
    "CHALLENGES",
    "APPLIED",
    "CUT",
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
            Message::Cut => WORDS[7].into(),
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
            "CUT" if rest.is_empty() => Ok(Message::Cut),
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
        /// Worker → demux statistics: what every worker has (connections, requests,
        /// datagrams, CPU, pid), each a `u64`, then its responses by site and its own labelled
        /// series. On the wire `STATS k=v k=v …`, where unknown keys are ignored and missing
        /// ones stay 0, so either side may add a key without a version bump.
        #[derive(Clone, Debug, Default, PartialEq, Eq)]
        pub struct WorkerReport {
            $($(#[doc = $doc])* pub $name: u64,)*
            /// Responses per site, by the site's index in the site table the demux handed over
            /// (`sites::SiteTable::sites`; the index one past the last site is the row of
            /// requests no site answered): keys `site<index>_<column>` ([`SITE_COLUMNS`]).
            /// Totals since the worker started; a row left out of a report keeps the value the
            /// demux had for it (see [`WorkerReport::encode_rotating`]).
            pub sites: BTreeMap<u32, SiteRow>,
            /// The program's own labelled counters and gauges ([`Series`]), keys `c:…` and
            /// `g:…` (`control-protocol.md`, "STATS series"). Set them with
            /// [`WorkerReport::set_counter`] and [`WorkerReport::set_gauge`], which hold them to
            /// [`MAX_SERIES`]; a report sends as many as fit [`MAX_STATS`](crate::MAX_STATS)
            /// (all of them, within that bound).
            pub series: BTreeMap<Series, u64>,
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
    /// Requests received since start, whatever the protocol; a program may break them down
    /// by a labelled counter `requests{protocol=…}`.
    requests_total,
    datagrams_in,
    datagrams_dropped,
    /// CPU time this worker used (user + system), ns.
    cpu_ns,
    pid,
    /// Requests in flight now: received and not yet answered to their end (a draining
    /// worker's are what its drain waits for).
    requests_active,
}

impl WorkerReport {
    /// Sets the counter `name{labels}` ([`Series::new`] says what a name and labels may be):
    /// a total since the worker started. Refused past [`MAX_SERIES`] series.
    pub fn set_counter(
        &mut self,
        name: &str,
        labels: &[(&str, &str)],
        value: u64,
    ) -> Result<(), SeriesError> {
        self.set_series(Series::counter(name, labels)?, value)
    }

    /// Sets the gauge `name{labels}`: a value now. As [`WorkerReport::set_counter`].
    pub fn set_gauge(
        &mut self,
        name: &str,
        labels: &[(&str, &str)],
        value: u64,
    ) -> Result<(), SeriesError> {
        self.set_series(Series::gauge(name, labels)?, value)
    }

    /// Sets `series`. Refused past [`MAX_SERIES`] series.
    pub fn set_series(&mut self, series: Series, value: u64) -> Result<(), SeriesError> {
        if self.series.len() >= MAX_SERIES && !self.series.contains_key(&series) {
            return Err(SeriesError::TooMany);
        }
        self.series.insert(series, value);
        Ok(())
    }

    /// The value of the counter `name{labels}`, if the report has it.
    pub fn counter(&self, name: &str, labels: &[(&str, &str)]) -> Option<u64> {
        self.series
            .get(&Series::counter(name, labels).ok()?)
            .copied()
    }

    /// The wire form with every site row that fits: [`WorkerReport::encode_rotating`] from
    /// site 0.
    fn encode(&self) -> String {
        self.encode_rotating(0).0
    }

    /// The wire form, at most [`MAX_STATS`](crate::MAX_STATS) bytes: every `u64` field, then
    /// the series, as many as fit (every one of [`MAX_SERIES`] does), then the site rows from index `first` on, wrapping round to the rows before it, each row's
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
        let mut token = String::new();
        for (series, &v) in &self.series {
            token.clear();
            push_key(&mut token, format_args!("{series}"), v);
            if s.len() + token.len() > crate::MAX_STATS {
                break;
            }
            s.push_str(&token);
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
            // A series' key holds `=` between its braces; no value does.
            let (k, v) = kv
                .rsplit_once('=')
                .ok_or_else(|| bad(format!("{kv:?} is not key=value")))?;
            let v: u64 = v
                .parse()
                .map_err(|_| bad(format!("{k}={v:?} is not a number")))?;
            if let Some(f) = r.field_mut(k) {
                *f = v;
            } else if let Some((site, column)) = site_key(k) {
                r.sites.entry(site).or_default()[column] = v;
            } else if let Some(series) = Series::parse_key(k) {
                let series = series.map_err(|e| bad(e.to_string()))?;
                // However many the report holds: the receiver bounds what it keeps.
                r.series.insert(series, v);
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
        for m in [
            Message::Ready,
            Message::Shutdown,
            Message::Cut,
            Message::Stats(report()),
        ] {
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
    fn series_round_trip_before_the_site_rows() {
        let mut r = report();
        r.set_counter("requests", &[("protocol", "h3")], 7).unwrap();
        r.set_counter("echo_bytes", &[("direction", "in")], u64::MAX)
            .unwrap();
        r.set_gauge("sink_latency_p50_nanoseconds", &[], 3).unwrap();
        r.sites.insert(0, [0, 1, 0, 0, 0, 0]);
        let text = String::from_utf8(Message::Stats(r.clone()).encode()).unwrap();
        assert!(
            text.ends_with(&format!(
                " c:echo_bytes{{direction=in}}={} c:requests{{protocol=h3}}=7 \
                 g:sink_latency_p50_nanoseconds=3 site0_2xx=1",
                u64::MAX
            )),
            "{text}"
        );
        assert_eq!(
            Message::decode(text.as_bytes()),
            Ok(Message::Stats(r.clone()))
        );
        assert_eq!(r.counter("requests", &[("protocol", "h3")]), Some(7));
        assert_eq!(r.counter("requests", &[("protocol", "h2")]), None);
    }

    /// A report holds at most `MAX_SERIES` series, and that many of the longest fit one
    /// report beside the fixed keys, with room for site rows after them.
    #[test]
    fn series_are_bounded_and_the_longest_fit() {
        use crate::series::*;
        let mut r = report();
        let name = |i: usize| format!("{:a<width$}", format!("s{i}_"), width = MAX_NAME_LEN);
        let key = |k: usize| format!("{:k<width$}", format!("k{k}"), width = MAX_LABEL_KEY_LEN);
        let value = "v".repeat(MAX_LABEL_VALUE_LEN);
        let keys: Vec<String> = (0..MAX_LABELS).map(key).collect();
        let labels: Vec<(&str, &str)> = keys.iter().map(|k| (k.as_str(), value.as_str())).collect();
        for i in 0..MAX_SERIES {
            r.set_counter(&name(i), &labels, u64::MAX).unwrap();
        }
        assert_eq!(r.set_gauge("one_more", &[], 1), Err(SeriesError::TooMany));
        r.set_counter(&name(0), &labels, 1).unwrap();
        for site in 0..10_000 {
            r.sites.insert(site, [u64::MAX; SITE_COLUMNS.len()]);
        }
        let (text, next) = r.encode_rotating(0);
        assert!(text.len() <= crate::MAX_STATS);
        assert!(next > 10, "room for rows after the series: {next}");
        let Ok(Message::Stats(back)) = Message::decode(text.as_bytes()) else {
            panic!("does not decode");
        };
        assert_eq!(back.series, r.series);
        // Past the bound (a report built by hand): whole tokens that fit, never past MAX_STATS.
        for i in MAX_SERIES..4 * MAX_SERIES {
            r.series
                .insert(Series::counter(&name(i), &labels).unwrap(), 1);
        }
        let (text, _) = r.encode_rotating(0);
        assert!(text.len() <= crate::MAX_STATS);
        assert!(Message::decode(text.as_bytes()).is_ok());
    }

    /// Series a worker may forge: a token whose series does not hold refuses the report whole
    /// (as a value that is not a `u64` does); a key with an unknown prefix is ignored.
    #[test]
    fn hostile_series_refuse_the_report() {
        for bad in [
            "STATS c:A=1",
            "STATS c:a{instance=0}=1",
            "STATS c:a{k=V}=1",
            "STATS c:a{k=\"v\"}=1",
            "STATS c:a{k=v}=x",
            "STATS c:a{k=v=1",
            "STATS c:a{a=1,b=1,c=1,d=1,e=1}=1",
            "STATS g:=1",
            "STATS c:a_total=1",
        ] {
            assert!(
                matches!(
                    Message::decode(bad.as_bytes()),
                    Err(MessageError::Malformed { .. })
                ),
                "{bad}"
            );
        }
        let Ok(Message::Stats(r)) = Message::decode(b"STATS x:a{k=v}=1 c:a{k=v}=1 c:a{k=v}=2")
        else {
            panic!()
        };
        assert_eq!(r.series.len(), 1);
        assert_eq!(r.counter("a", &[("k", "v")]), Some(2));
    }

    mod properties {
        use super::*;
        use proptest::prelude::*;

        /// Tokens near the grammar: series keys of the report's alphabet and its delimiters.
        fn token() -> impl Strategy<Value = String> {
            prop_oneof![
                "[cgx]:[a-z_A-Z0-9{},=]{0,40}=[0-9]{1,3}",
                "[cgx]:[a-z]{1,8}\\{[a-z]{1,4}=[a-z0-9_]{1,6}(,[a-z]{1,4}=[a-z0-9_]{1,6}){0,5}\\}=[0-9]{1,20}",
                "site[0-9]{1,12}_[0-9x]{3}=[0-9]{1,20}",
                "(pid|cpu_ns|requests_total)=[0-9]{1,21}",
                "[ -~]{0,30}",
            ]
        }

        proptest! {
            /// Whatever a worker sends, decoding never panics; a report that decodes holds
            /// only series that hold, and encodes to a report that decodes to itself.
            #[test]
            fn any_stats_decode_safely(tokens in proptest::collection::vec(token(), 0..30)) {
                let text = format!("STATS {}", tokens.join(" "));
                if let Ok(Message::Stats(r)) = Message::decode(text.as_bytes()) {
                    for s in r.series.keys() {
                        prop_assert_eq!(Series::parse_key(&s.to_string()), Some(Ok(s.clone())));
                    }
                    if r.series.len() <= MAX_SERIES {
                        let Ok(Message::Stats(again)) = Message::decode(&Message::Stats(r.clone()).encode()) else {
                            panic!("a report that decoded once encodes to one that decodes");
                        };
                        prop_assert_eq!((again.fields(), again.series), (r.fields(), r.series));
                    }
                }
            }

            #[test]
            fn any_bytes_decode_without_panic(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
                let mut packet = b"STATS ".to_vec();
                packet.extend(bytes);
                let _ = Message::decode(&packet);
            }

            /// Series made through the API round-trip, whatever their values.
            #[test]
            fn series_round_trip(
                series in proptest::collection::btree_map(
                    ("[a-z][a-z0-9_]{0,10}", proptest::collection::btree_map("[a-z][a-z0-9_]{0,5}", "[a-z0-9_]{1,8}", 0..=4), any::<bool>()),
                    any::<u64>(),
                    0..40,
                )
            ) {
                let mut r = WorkerReport::default();
                for ((name, labels, gauge), v) in series {
                    let labels: Vec<(&str, &str)> = labels.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
                    let set = if gauge { r.set_gauge(&name, &labels, v) } else { r.set_counter(&name, &labels, v) };
                    // Names the rules refuse (`_total`, `instance`) are refused, not sent.
                    if set.is_err() {
                        continue;
                    }
                }
                prop_assert_eq!(Message::decode(&Message::Stats(r.clone()).encode()), Ok(Message::Stats(r)));
            }
        }
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
