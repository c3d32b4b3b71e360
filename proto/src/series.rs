//! Labelled series of a `STATS` report: counters and gauges any worker program names itself
//! (`control-protocol.md`, "STATS series"). The contract names no feature of any server: a
//! program declares `requests{protocol=h3}` or `echo_bytes{direction=in}` and the demux
//! exposes it as `ringmux_worker_<name>_total{instance,<label>=<value>}` (a gauge without the
//! `_total`).
//!
//! On the wire a series is one token of the report, `c:NAME=N` or `c:NAME{KEY=VALUE,…}=N`
//! (`g:` for a gauge). Everything a token holds is checked here, once, for both sides: a name
//! or a label this module refuses never reaches the demux's metrics, and never needs escaping
//! in them. The number of series is bounded by each side ([`MAX_SERIES`]).

use std::fmt;

/// Most series one report carries, counters and gauges together; also the most the demux
/// keeps of one worker (those past it are dropped and counted). At the longest names and
/// labels, this many fit one report beside the fixed keys ([`crate::MAX_STATS`]).
pub const MAX_SERIES: usize = 256;

/// Longest series name, in bytes.
pub const MAX_NAME_LEN: usize = 64;

/// Most labels of one series.
pub const MAX_LABELS: usize = 4;

/// Longest label key, in bytes.
pub const MAX_LABEL_KEY_LEN: usize = 32;

/// Longest label value, in bytes.
pub const MAX_LABEL_VALUE_LEN: usize = 64;

/// `text` as a label value: `[a-z0-9_]` (letters lowered, every other byte `_`), cut at
/// [`MAX_LABEL_VALUE_LEN`] bytes. A backend's `host:port` is labelled so, by the workers and by
/// the demux's health checks alike, so their series name it the same way.
pub fn label_value(text: &str) -> String {
    text.bytes()
        .map(|b| match b.to_ascii_lowercase() {
            c @ (b'a'..=b'z' | b'0'..=b'9') => c as char,
            _ => '_',
        })
        .take(MAX_LABEL_VALUE_LEN)
        .collect()
}

/// The label every series gets from the demux, which no worker may set.
pub const RESERVED_LABEL: &str = "instance";

/// Whether a series is a counter (a total since the worker started) or a gauge (a value now).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SeriesKind {
    /// `c:` on the wire; exposed with `_total`, summed over an instance's workers.
    Counter,
    /// `g:` on the wire; exposed as it is, of the instance's newest worker.
    Gauge,
}

impl SeriesKind {
    /// The token's prefix on the wire.
    pub fn prefix(self) -> &'static str {
        match self {
            SeriesKind::Counter => "c:",
            SeriesKind::Gauge => "g:",
        }
    }
}

/// One labelled series: its kind, name and labels, each checked ([`Series::new`]), labels in
/// the order of their keys, so one series has one form.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Series {
    kind: SeriesKind,
    name: String,
    labels: Vec<(String, String)>,
}

/// Why a name or label cannot make a series.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SeriesError {
    #[error(
        "series name {0:?}: 1 to {MAX_NAME_LEN} bytes of [a-z0-9_], from a letter, not ending in _total"
    )]
    Name(String),
    #[error("label key {0:?}: 1 to {MAX_LABEL_KEY_LEN} bytes of [a-z0-9_], from a letter, not `instance`, once per series")]
    LabelKey(String),
    #[error("label value {0:?}: 1 to {MAX_LABEL_VALUE_LEN} bytes of [a-z0-9_]")]
    LabelValue(String),
    #[error("more than {MAX_LABELS} labels")]
    TooManyLabels,
    #[error("more than {MAX_SERIES} series in one report")]
    TooMany,
    #[error("{0:?} is not a series token")]
    Syntax(String),
}

impl Series {
    /// A series of `kind` named `name` with `labels` (in any order), each checked: names and
    /// label keys are 1 to [`MAX_NAME_LEN`] / [`MAX_LABEL_KEY_LEN`] bytes of `[a-z0-9_]`
    /// starting with a letter (a name does not end in `_total`, which the demux adds to a
    /// counter's); label values 1 to [`MAX_LABEL_VALUE_LEN`] bytes of `[a-z0-9_]`; at most
    /// [`MAX_LABELS`] labels, each key once, none [`RESERVED_LABEL`].
    pub fn new(
        kind: SeriesKind,
        name: &str,
        labels: &[(&str, &str)],
    ) -> Result<Series, SeriesError> {
        if !is_word(name, MAX_NAME_LEN) || name.ends_with("_total") {
            return Err(SeriesError::Name(name.into()));
        }
        if labels.len() > MAX_LABELS {
            return Err(SeriesError::TooManyLabels);
        }
        let mut checked = Vec::with_capacity(labels.len());
        for &(k, v) in labels {
            if !is_word(k, MAX_LABEL_KEY_LEN) || k == RESERVED_LABEL {
                return Err(SeriesError::LabelKey(k.into()));
            }
            if v.is_empty() || v.len() > MAX_LABEL_VALUE_LEN || !v.bytes().all(is_word_byte) {
                return Err(SeriesError::LabelValue(v.into()));
            }
            checked.push((k.to_owned(), v.to_owned()));
        }
        checked.sort();
        if checked.windows(2).any(|w| w[0].0 == w[1].0) {
            return Err(SeriesError::LabelKey(checked[0].0.clone()));
        }
        Ok(Series {
            kind,
            name: name.to_owned(),
            labels: checked,
        })
    }

    /// A counter ([`Series::new`]).
    pub fn counter(name: &str, labels: &[(&str, &str)]) -> Result<Series, SeriesError> {
        Series::new(SeriesKind::Counter, name, labels)
    }

    /// A gauge ([`Series::new`]).
    pub fn gauge(name: &str, labels: &[(&str, &str)]) -> Result<Series, SeriesError> {
        Series::new(SeriesKind::Gauge, name, labels)
    }

    pub fn kind(&self) -> SeriesKind {
        self.kind
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// The labels, in the order of their keys.
    pub fn labels(&self) -> &[(String, String)] {
        &self.labels
    }

    /// Parses the key of a series token (`c:NAME{K=V,…}`, without its `=N`): `None` when
    /// `key` is not a series' (no `c:` or `g:` prefix: another key of the report), an error
    /// when it is one that does not hold.
    pub fn parse_key(key: &str) -> Option<Result<Series, SeriesError>> {
        let (kind, rest) = if let Some(rest) = key.strip_prefix("c:") {
            (SeriesKind::Counter, rest)
        } else if let Some(rest) = key.strip_prefix("g:") {
            (SeriesKind::Gauge, rest)
        } else {
            return None;
        };
        Some(parse_series(kind, rest).map_err(|e| match e {
            SeriesError::Syntax(_) => SeriesError::Syntax(key.chars().take(80).collect()),
            e => e,
        }))
    }
}

/// The wire form of the token's key: `c:NAME` or `c:NAME{K=V,…}`.
impl fmt::Display for Series {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{}", self.kind.prefix(), self.name)?;
        for (i, (k, v)) in self.labels.iter().enumerate() {
            let open = if i == 0 { "{" } else { "," };
            write!(f, "{open}{k}={v}")?;
        }
        if !self.labels.is_empty() {
            f.write_str("}")?;
        }
        Ok(())
    }
}

/// `NAME` or `NAME{K=V,…}`, with at least one label between braces.
fn parse_series(kind: SeriesKind, text: &str) -> Result<Series, SeriesError> {
    let syntax = || SeriesError::Syntax(String::new());
    let Some((name, labels)) = text.split_once('{') else {
        return Series::new(kind, text, &[]);
    };
    let labels = labels.strip_suffix('}').ok_or_else(syntax)?;
    let mut pairs = Vec::new();
    for pair in labels.split(',') {
        if pairs.len() == MAX_LABELS {
            return Err(SeriesError::TooManyLabels);
        }
        pairs.push(pair.split_once('=').ok_or_else(syntax)?);
    }
    Series::new(kind, name, &pairs)
}

fn is_word_byte(b: u8) -> bool {
    b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_'
}

/// 1 to `max` bytes of `[a-z0-9_]`, from a letter.
fn is_word(s: &str, max: usize) -> bool {
    s.len() <= max
        && s.as_bytes().first().is_some_and(u8::is_ascii_lowercase)
        && s.bytes().all(is_word_byte)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_labels_are_checked() {
        let ok = Series::counter("echo_bytes", &[("direction", "in")]).unwrap();
        assert_eq!(ok.to_string(), "c:echo_bytes{direction=in}");
        let sorted = Series::gauge("x", &[("b", "2"), ("a", "1")]).unwrap();
        assert_eq!(sorted.to_string(), "g:x{a=1,b=2}");
        assert_eq!(Series::counter("n9", &[]).unwrap().to_string(), "c:n9");
        let long = "a".repeat(MAX_NAME_LEN + 1);
        for bad in [
            "",
            "9a",
            "_a",
            "A",
            "a-b",
            "a b",
            "a}",
            "a_total",
            long.as_str(),
        ] {
            assert_eq!(
                Series::counter(bad, &[]),
                Err(SeriesError::Name(bad.into())),
                "{bad}"
            );
        }
        for key in ["", "instance", "K", "a=b", "_x"] {
            assert!(matches!(
                Series::counter("n", &[(key, "v")]),
                Err(SeriesError::LabelKey(_))
            ));
        }
        for value in ["", "V", "a b", "a,b", "\"", "a}"] {
            assert!(matches!(
                Series::counter("n", &[("k", value)]),
                Err(SeriesError::LabelValue(_))
            ));
        }
        assert!(matches!(
            Series::counter("n", &[("k", "1"), ("k", "2")]),
            Err(SeriesError::LabelKey(_))
        ));
        let five = [("a", "1"), ("b", "1"), ("c", "1"), ("d", "1"), ("e", "1")];
        assert_eq!(Series::counter("n", &five), Err(SeriesError::TooManyLabels));
    }

    #[test]
    fn keys_parse_back() {
        for s in [
            Series::counter("a", &[]).unwrap(),
            Series::gauge("lat", &[("q", "p50")]).unwrap(),
            Series::counter("r", &[("a", "1"), ("b", "2"), ("c", "3"), ("d", "4")]).unwrap(),
        ] {
            assert_eq!(Series::parse_key(&s.to_string()), Some(Ok(s)));
        }
        assert_eq!(Series::parse_key("pid"), None);
        assert_eq!(Series::parse_key("site0_2xx"), None);
        for bad in [
            "c:",
            "c:a{",
            "c:a{}",
            "c:a{k}",
            "c:a{k=v",
            "c:a{k=v,}",
            "g:a{k=v}x",
            "c:a{k=v,k=w}",
        ] {
            assert!(matches!(Series::parse_key(bad), Some(Err(_))), "{bad}");
        }
    }
}
