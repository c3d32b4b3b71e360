//! An upstream route's active health check, declared once ([`ActiveHealth`]): the path every
//! backend of the route is asked for, how often, how long an answer may take, and how many
//! results in a row change a backend's state. The health table's slots follow the site table
//! (`crate::health`).
//!
//! `health = { path = "/healthz", interval = 5, timeout = 2 }`: durations in seconds, whole
//! or not (`timeout = 0.5`), written back to JSON as seconds. A field left out takes its
//! default; the JSON of a route without a check is the JSON before this module (the field is
//! left out).

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// The shortest `interval`, in milliseconds: one probe a second per backend at most.
pub const MIN_INTERVAL_MS: u32 = 1_000;
/// The longest `interval` and `timeout`, in milliseconds: an hour.
pub const MAX_HEALTH_MS: u32 = 3_600_000;
/// The shortest `timeout`, in milliseconds.
pub const MIN_TIMEOUT_MS: u32 = 10;
/// The most results in a row `passes` and `fails` may ask for.
pub const MAX_RESULTS_IN_A_ROW: u8 = 10;
/// The longest health `path`, in bytes.
pub const MAX_HEALTH_PATH: usize = 1024;

/// `health = { path, interval, timeout, passes, fails }` of an upstream route: every
/// `interval`, each backend is sent `GET path` (once for the box, by the demux); a response of
/// 2xx or 3xx within `timeout` is a pass, anything else (no connection, no TLS, no answer in
/// time, another status) a failure. `fails` failures in a row mark the backend down, `passes`
/// passes in a row up again (1 and 1 by default, as Caddy's `health_passes` and
/// `health_fails`). Until its first result a backend has no verdict and is used.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "HealthFields", into = "HealthFields")]
pub struct ActiveHealth {
    path: String,
    interval_ms: u32,
    timeout_ms: u32,
    passes: u8,
    fails: u8,
}

impl ActiveHealth {
    /// The path asked for: starts with `/`, printable ASCII without spaces.
    pub fn path(&self) -> &str {
        &self.path
    }

    pub fn interval(&self) -> Duration {
        Duration::from_millis(u64::from(self.interval_ms))
    }

    pub fn timeout(&self) -> Duration {
        Duration::from_millis(u64::from(self.timeout_ms))
    }

    /// Passes in a row that mark a backend up.
    pub fn passes(&self) -> u8 {
        self.passes
    }

    /// Failures in a row that mark a backend down.
    pub fn fails(&self) -> u8 {
        self.fails
    }
}

/// How [`ActiveHealth`] is written: the keys of the file's inline table, durations in seconds.
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct HealthFields {
    path: String,
    #[serde(default = "default_interval")]
    interval: f64,
    #[serde(default = "default_timeout")]
    timeout: f64,
    #[serde(default = "one", skip_serializing_if = "is_one")]
    passes: u8,
    #[serde(default = "one", skip_serializing_if = "is_one")]
    fails: u8,
}

fn default_interval() -> f64 {
    5.0
}

fn default_timeout() -> f64 {
    2.0
}

fn one() -> u8 {
    1
}

fn is_one(n: &u8) -> bool {
    *n == 1
}

/// Why a `health` table is refused: each message names the key and the value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HealthError {
    #[error(
        "health.path = {0:?}: expected a path starting with /, of printable ASCII without \
         spaces, at most {MAX_HEALTH_PATH} bytes, e.g. \"/healthz\""
    )]
    Path(String),
    #[error("health.interval = {0}: expected 1 to 3600 seconds")]
    Interval(String),
    #[error("health.timeout = {0}: expected 0.01 to 3600 seconds")]
    Timeout(String),
    #[error(
        "health.timeout = {timeout}: must be shorter than health.interval = {interval} (a probe \
         ends before the next starts)"
    )]
    TimeoutPastInterval { timeout: String, interval: String },
    #[error("health.{key} = {value}: expected 1 to {MAX_RESULTS_IN_A_ROW} results in a row")]
    InARow { key: &'static str, value: u8 },
}

/// `seconds` in milliseconds if within `min_ms..=MAX_HEALTH_MS`.
fn millis(seconds: f64, min_ms: u32) -> Option<u32> {
    let ms = seconds * 1000.0;
    let ok = ms.is_finite() && ms >= f64::from(min_ms) && ms <= f64::from(MAX_HEALTH_MS);
    // In range (checked): the cast neither truncates past u32 nor takes a NaN.
    ok.then(|| ms.round() as u32)
}

impl TryFrom<HealthFields> for ActiveHealth {
    type Error = HealthError;

    fn try_from(f: HealthFields) -> Result<Self, HealthError> {
        let path_ok = f.path.starts_with('/')
            && f.path.len() <= MAX_HEALTH_PATH
            && f.path.bytes().all(|b| b.is_ascii_graphic());
        if !path_ok {
            return Err(HealthError::Path(f.path));
        }
        let interval_ms = millis(f.interval, MIN_INTERVAL_MS)
            .ok_or_else(|| HealthError::Interval(f.interval.to_string()))?;
        let timeout_ms = millis(f.timeout, MIN_TIMEOUT_MS)
            .ok_or_else(|| HealthError::Timeout(f.timeout.to_string()))?;
        if timeout_ms >= interval_ms {
            return Err(HealthError::TimeoutPastInterval {
                timeout: f.timeout.to_string(),
                interval: f.interval.to_string(),
            });
        }
        for (key, value) in [("passes", f.passes), ("fails", f.fails)] {
            if !(1..=MAX_RESULTS_IN_A_ROW).contains(&value) {
                return Err(HealthError::InARow { key, value });
            }
        }
        Ok(ActiveHealth {
            path: f.path,
            interval_ms,
            timeout_ms,
            passes: f.passes,
            fails: f.fails,
        })
    }
}

impl From<ActiveHealth> for HealthFields {
    fn from(h: ActiveHealth) -> HealthFields {
        HealthFields {
            path: h.path,
            interval: f64::from(h.interval_ms) / 1000.0,
            timeout: f64::from(h.timeout_ms) / 1000.0,
            passes: h.passes,
            fails: h.fails,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(json: &str) -> Result<ActiveHealth, String> {
        serde_json::from_str(json).map_err(|e| e.to_string())
    }

    #[test]
    fn a_check_takes_its_defaults_and_is_written_back_in_seconds() {
        let h = read(r#"{"path": "/healthz"}"#).unwrap();
        assert_eq!(
            (h.interval(), h.timeout(), h.passes(), h.fails()),
            (Duration::from_secs(5), Duration::from_secs(2), 1, 1)
        );
        let json = serde_json::to_string(&h).unwrap();
        assert_eq!(json, r#"{"path":"/healthz","interval":5.0,"timeout":2.0}"#);
        assert_eq!(read(&json).unwrap(), h);
        let fast = read(r#"{"path": "/h", "interval": 1, "timeout": 0.25, "fails": 3}"#).unwrap();
        assert_eq!(fast.timeout(), Duration::from_millis(250));
        assert_eq!(read(&serde_json::to_string(&fast).unwrap()).unwrap(), fast);
    }

    #[test]
    fn bad_values_are_refused_naming_the_key_and_value() {
        for (json, says) in [
            (r#"{"path": "healthz"}"#, "health.path = \"healthz\""),
            (r#"{"path": "/a b"}"#, "health.path = \"/a b\""),
            (
                r#"{"path": "/h", "interval": 0.5}"#,
                "health.interval = 0.5",
            ),
            (
                r#"{"path": "/h", "interval": 4000}"#,
                "health.interval = 4000",
            ),
            (
                r#"{"path": "/h", "timeout": 0}"#,
                "health.timeout = 0: expected",
            ),
            (
                r#"{"path": "/h", "interval": 2, "timeout": 2}"#,
                "health.timeout = 2: must be shorter than health.interval = 2",
            ),
            (r#"{"path": "/h", "passes": 0}"#, "health.passes = 0"),
            (r#"{"path": "/h", "fails": 11}"#, "health.fails = 11"),
            (r#"{"path": "/h", "every": 1}"#, "unknown field `every`"),
        ] {
            let e = read(json).unwrap_err();
            assert!(e.contains(says), "{json}: {e}");
        }
    }
}
