//! An upstream route's backends and how it shares requests among them, declared once: the
//! list of backends ([`Backends`], one URL or several), the policy that picks one
//! ([`Balance`]), how many times a request may move to another backend ([`Retries`]), when a
//! backend is taken out of the choice for failing ([`PassiveHealth`]), and the largest request
//! body the route passes on ([`BodyLimit`]).
//!
//! Each value is refused when it is read, as every value of a route is ([`super`]); the JSON
//! of a route with one backend and every default is the JSON of the builds before this
//! module (one URL as a string, the rest left out).

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::ValueError;
use crate::UpstreamUrl;

/// The most backends one upstream route may list: every worker keeps a pool of connections and
/// a few counters per backend, and reports a series per backend.
pub const MAX_BACKENDS: usize = 16;

/// The most retries a route may ask for.
pub const MAX_RETRIES: u8 = 4;

/// Bounds of [`PassiveHealth`]'s durations, in seconds.
pub const HEALTH_SECONDS: std::ops::RangeInclusive<u32> = 1..=3600;

/// The most failures [`PassiveHealth::max_fails`] may name.
pub const MAX_FAILS: u32 = 1000;

/// The backends of an upstream route: 1 to [`MAX_BACKENDS`] URLs, none twice. Written as the
/// URL alone when there is one (`upstream = "http://10.0.0.1:8080"`), as a list otherwise.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(into = "OneOrMany")]
pub struct Backends(Vec<UpstreamUrl>);

impl Backends {
    /// One backend.
    pub fn one(url: UpstreamUrl) -> Backends {
        Backends(vec![url])
    }

    /// Every backend, in the order given.
    pub fn urls(&self) -> &[UpstreamUrl] {
        &self.0
    }

    /// The first backend: the only one of a route that names one.
    pub fn first(&self) -> &UpstreamUrl {
        // Never empty: `TryFrom<OneOrMany>` and `one` are the only ways in.
        &self.0[0]
    }
}

/// How [`Backends`] is written: one URL, or a list of them.
#[derive(Serialize)]
#[serde(untagged)]
enum OneOrMany {
    One(UpstreamUrl),
    Many(Vec<UpstreamUrl>),
}

// Read by hand rather than as an untagged enum, so that a bad URL is refused saying why (an
// untagged enum only says that no form matched).
impl<'de> Deserialize<'de> for Backends {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visit;
        impl<'de> serde::de::Visitor<'de> for Visit {
            type Value = OneOrMany;

            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a URL or a list of URLs")
            }

            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<OneOrMany, E> {
                let url = v
                    .parse()
                    .map_err(|e: crate::UpstreamError| E::custom(e.why()))?;
                Ok(OneOrMany::One(url))
            }

            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<OneOrMany, A::Error> {
                let mut urls = Vec::new();
                while let Some(url) = seq.next_element()? {
                    // Bounded: a list past the bound is refused as soon as it is.
                    if urls.len() > MAX_BACKENDS {
                        return Err(serde::de::Error::custom(ValueError::Backends(
                            urls.len() + 1,
                        )));
                    }
                    urls.push(url);
                }
                Ok(OneOrMany::Many(urls))
            }
        }
        let read = d.deserialize_any(Visit)?;
        Backends::try_from(read).map_err(serde::de::Error::custom)
    }
}

impl TryFrom<OneOrMany> for Backends {
    type Error = ValueError;

    fn try_from(v: OneOrMany) -> Result<Backends, ValueError> {
        let urls = match v {
            OneOrMany::One(u) => vec![u],
            OneOrMany::Many(urls) => urls,
        };
        if urls.is_empty() || urls.len() > MAX_BACKENDS {
            return Err(ValueError::Backends(urls.len()));
        }
        for (i, u) in urls.iter().enumerate() {
            if urls[..i].contains(u) {
                return Err(ValueError::BackendTwice(u.to_string()));
            }
        }
        Ok(Backends(urls))
    }
}

impl From<Backends> for OneOrMany {
    fn from(b: Backends) -> OneOrMany {
        match <[UpstreamUrl; 1]>::try_from(b.0) {
            Ok([one]) => OneOrMany::One(one),
            Err(many) => OneOrMany::Many(many),
        }
    }
}

/// How an upstream route shares requests among its backends: each field at its default when
/// the route does not say, and left out of the JSON then.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Balancing {
    #[serde(default, skip_serializing_if = "Balance::is_default")]
    pub lb: Balance,
    #[serde(default, skip_serializing_if = "Retries::is_default")]
    pub retries: Retries,
    #[serde(default, skip_serializing_if = "PassiveHealth::is_default")]
    pub passive: PassiveHealth,
}

impl Balancing {
    pub fn is_default(&self) -> bool {
        *self == Balancing::default()
    }
}

/// Which backend a request goes to (`lb = "…"`). Each picks among the backends not ejected
/// ([`PassiveHealth`]), or among all when every one is.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Balance {
    /// Two backends at random, the one with fewer requests in flight in this worker ("the
    /// power of two choices", Mitzenmacher 2001): close to `least_conn`'s spread without its
    /// herding, where every worker sends its next requests to the same least loaded backend.
    #[default]
    RandomTwo,
    /// Each backend in turn.
    RoundRobin,
    /// The backend with the fewest requests in flight in this worker (the first on a tie).
    LeastConn,
    /// The backend a hash of the client's address picks, so one client keeps its backend while
    /// the set of usable backends does not change (rendezvous hashing: when one is ejected,
    /// only its clients move).
    ClientHash,
}

impl Balance {
    pub fn is_default(&self) -> bool {
        *self == Balance::default()
    }
}

/// How many times one request may go to another backend after its backend failed
/// (`retries = N`, 0 to [`MAX_RETRIES`]; 1 by default). A request is retried only when it
/// never reached a backend (the connection was refused or could not be made), or when it is
/// idempotent (RFC 9110 §9.2.2) and has no body, so a retry cannot repeat an effect. 1 by
/// default: it moves the requests of one backend that went down to another, and a request
/// costs at most two backends' time when several fail at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "u8", into = "u8")]
pub struct Retries(u8);

impl Retries {
    pub fn get(self) -> u8 {
        self.0
    }

    pub fn is_default(&self) -> bool {
        *self == Retries::default()
    }
}

impl Default for Retries {
    fn default() -> Self {
        Retries(1)
    }
}

impl TryFrom<u8> for Retries {
    type Error = ValueError;

    fn try_from(v: u8) -> Result<Self, ValueError> {
        match v <= MAX_RETRIES {
            true => Ok(Retries(v)),
            false => Err(ValueError::Retries),
        }
    }
}

impl From<Retries> for u8 {
    fn from(r: Retries) -> u8 {
        r.0
    }
}

/// When a worker stops sending to a backend for failing it (passive health): `max_fails`
/// failures (a connection that could not be made, a reset or timeout before the response, a
/// 5xx response) within `fail_window` seconds eject it for `eject_for` seconds; then it is
/// chosen again, and ejected again at its next `max_fails` failures. `max_fails = 0` never
/// ejects. Each worker keeps its own count: a backend down is ejected by every worker that
/// sends to it within the window.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PassiveHealth {
    #[serde(default = "default_max_fails")]
    pub max_fails: u32,
    #[serde(default = "default_fail_window")]
    pub fail_window: HealthSeconds,
    #[serde(default = "default_eject_for")]
    pub eject_for: HealthSeconds,
}

fn default_max_fails() -> u32 {
    PassiveHealth::default().max_fails
}

fn default_fail_window() -> HealthSeconds {
    PassiveHealth::default().fail_window
}

fn default_eject_for() -> HealthSeconds {
    PassiveHealth::default().eject_for
}

impl Default for PassiveHealth {
    /// 3 failures in 10 seconds eject for 30 seconds: one refused connection or one 5xx is not
    /// enough (a restart of the backend's own worker, one bad request), three in a row is a
    /// backend down; 30 seconds is about a restart of a typical application.
    fn default() -> Self {
        PassiveHealth {
            max_fails: 3,
            fail_window: HealthSeconds(10),
            eject_for: HealthSeconds(30),
        }
    }
}

impl PassiveHealth {
    pub fn is_default(&self) -> bool {
        *self == PassiveHealth::default()
    }

    /// Checks `max_fails`' bound (the durations check their own).
    pub fn check(&self) -> Result<(), ValueError> {
        match self.max_fails <= MAX_FAILS {
            true => Ok(()),
            false => Err(ValueError::MaxFails),
        }
    }
}

/// A duration of [`PassiveHealth`]: whole seconds within [`HEALTH_SECONDS`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "u32", into = "u32")]
pub struct HealthSeconds(u32);

impl HealthSeconds {
    pub fn duration(self) -> Duration {
        Duration::from_secs(u64::from(self.0))
    }
}

impl TryFrom<u32> for HealthSeconds {
    type Error = ValueError;

    fn try_from(v: u32) -> Result<Self, ValueError> {
        match HEALTH_SECONDS.contains(&v) {
            true => Ok(HealthSeconds(v)),
            false => Err(ValueError::HealthSeconds),
        }
    }
}

impl From<HealthSeconds> for u32 {
    fn from(s: HealthSeconds) -> u32 {
        s.0
    }
}

/// The largest request body a route passes on, in bytes (`max_body`); 0, the default, is no
/// limit. Written as a number of bytes or a string with a unit: `"10MB"` (10⁷), `"10MiB"`
/// (10 × 2²⁰), `"512KB"`, `"512KiB"`, `"1GB"`, `"1GiB"`, `"100B"`. Always written back as a
/// number.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "Size", into = "u64")]
pub struct BodyLimit(u64);

impl BodyLimit {
    /// The limit, or `None` for none.
    pub fn get(self) -> Option<u64> {
        (self.0 != 0).then_some(self.0)
    }

    pub fn is_none(&self) -> bool {
        self.0 == 0
    }

    pub fn bytes(n: u64) -> BodyLimit {
        BodyLimit(n)
    }
}

/// How a [`BodyLimit`] is written.
#[derive(Deserialize)]
#[serde(untagged)]
enum Size {
    Bytes(u64),
    Text(String),
}

/// The units a [`BodyLimit`] string may end with, longest first so `KiB` is not read as `B`.
const SIZE_UNITS: [(&str, u64); 7] = [
    ("KiB", 1 << 10),
    ("MiB", 1 << 20),
    ("GiB", 1 << 30),
    ("KB", 1_000),
    ("MB", 1_000_000),
    ("GB", 1_000_000_000),
    ("B", 1),
];

impl TryFrom<Size> for BodyLimit {
    type Error = ValueError;

    fn try_from(v: Size) -> Result<Self, ValueError> {
        let text = match v {
            Size::Bytes(n) => return Ok(BodyLimit(n)),
            Size::Text(t) => t,
        };
        let bad = || ValueError::BodyLimit(text.clone());
        let (number, scale) = SIZE_UNITS
            .iter()
            .find_map(|(unit, scale)| Some((text.trim().strip_suffix(unit)?, *scale)))
            .ok_or_else(bad)?;
        let n: u64 = number.trim().parse().map_err(|_| bad())?;
        n.checked_mul(scale).map(BodyLimit).ok_or_else(bad)
    }
}

impl From<BodyLimit> for u64 {
    fn from(b: BodyLimit) -> u64 {
        b.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read<T: for<'de> Deserialize<'de>>(json: &str) -> Result<T, String> {
        serde_json::from_str(json).map_err(|e| e.to_string())
    }

    #[test]
    fn backends_are_one_url_or_a_list_of_distinct_ones() {
        let one: Backends = read(r#""http://127.0.0.1:1""#).unwrap();
        assert_eq!(one.urls().len(), 1);
        assert_eq!(
            serde_json::to_string(&one).unwrap(),
            r#""http://127.0.0.1:1""#
        );
        let two: Backends = read(r#"["http://127.0.0.1:1", "http://127.0.0.1:2"]"#).unwrap();
        assert_eq!(
            serde_json::to_string(&two).unwrap(),
            r#"["http://127.0.0.1:1","http://127.0.0.1:2"]"#
        );
        let e = read::<Backends>("[]").unwrap_err();
        assert!(e.contains("0 backends: give 1 to 16"), "{e}");
        let many: Vec<String> = (1..=17).map(|p| format!("\"http://h:{p}\"")).collect();
        let e = read::<Backends>(&format!("[{}]", many.join(","))).unwrap_err();
        assert!(e.contains("17 backends: give 1 to 16"), "{e}");
        let e = read::<Backends>(r#"["http://h:1", "http://h:1/"]"#).unwrap_err();
        assert!(e.contains("http://h:1 is listed twice"), "{e}");
    }

    #[test]
    fn policies_retries_and_health_are_bounded() {
        assert_eq!(read::<Balance>(r#""least_conn""#), Ok(Balance::LeastConn));
        assert!(read::<Balance>(r#""fastest""#).is_err());
        assert_eq!(read::<Retries>("4").map(Retries::get), Ok(4));
        let e = read::<Retries>("5").unwrap_err();
        assert!(e.contains("retries: 0 to 4"), "{e}");
        let h: PassiveHealth = read(r#"{"max_fails": 5}"#).unwrap();
        assert_eq!(h.fail_window, PassiveHealth::default().fail_window);
        assert_eq!(h.max_fails, 5);
        let e = read::<PassiveHealth>(r#"{"eject_for": 0}"#).unwrap_err();
        assert!(e.contains("1 to 3600 seconds"), "{e}");
        let many = PassiveHealth {
            max_fails: MAX_FAILS + 1,
            ..PassiveHealth::default()
        };
        assert_eq!(many.check(), Err(ValueError::MaxFails));
    }

    #[test]
    fn body_limits_take_units() {
        for (json, bytes) in [
            ("0", 0),
            ("1024", 1024),
            (r#""10MB""#, 10_000_000),
            (r#""10MiB""#, 10 << 20),
            (r#""512 KiB""#, 512 << 10),
            (r#""1GB""#, 1_000_000_000),
            (r#""100B""#, 100),
        ] {
            let l: BodyLimit = read(json).unwrap_or_else(|e| panic!("{json}: {e}"));
            assert_eq!(u64::from(l), bytes, "{json}");
        }
        for bad in [r#""10""#, r#""ten MB""#, r#""-1MB""#, r#""99999999999GiB""#] {
            let e = read::<BodyLimit>(bad).unwrap_err();
            assert!(e.contains("expected a size in bytes"), "{bad}: {e}");
        }
        assert_eq!(serde_json::to_string(&BodyLimit(5)).unwrap(), "5");
    }
}
