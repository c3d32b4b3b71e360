//! The configuration file as read (`--config FILE`): its settings, each as the flag it stands
//! for, and its tables (`[[site]]`, `[[site.route]]`, `[acme]`), each value with its place,
//! and every problem found in it, placed. [`mod@super::file`] reads a file into these against
//! the command line's declaration ([`super::flags`]); the declaration holds what was read
//! ([`super::flags::RunArgs::file`]) and the checks (`super::sites`, `super::acme`) take it
//! from there. This module knows no flag, reads no file and imports no sibling.

use std::fmt;
use std::path::PathBuf;

use ringmux_proto::limits::Limits;
use ringmux_proto::route::BodyLimit;
use ringmux_proto::rules::{Cors, HeaderRules, Hsts};
use ringmux_proto::sites::Route;

/// Where something is in the file: `FILE:LINE:COLUMN`, both from 1.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Place {
    pub file: PathBuf,
    pub line: usize,
    pub column: usize,
}

impl fmt::Display for Place {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}:{}", self.file.display(), self.line, self.column)
    }
}

/// One thing wrong with the file, and where.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problem {
    pub at: Option<Place>,
    pub message: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.at {
            Some(at) => write!(f, "{at}: {}", self.message),
            None => f.write_str(&self.message),
        }
    }
}

/// Adds a problem placed at `at` (`None`: the file as a whole) to `problems`.
pub fn problem<'a>(problems: &mut Vec<Problem>, at: impl Into<Option<&'a Place>>, message: String) {
    problems.push(Problem {
        at: at.into().cloned(),
        message,
    });
}

/// Every problem found, one per line.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub struct Problems(pub Vec<Problem>);

impl fmt::Display for Problems {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, p) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str("\n")?;
            }
            write!(f, "{p}")?;
        }
        Ok(())
    }
}

/// A value of the file and where it is.
#[derive(Clone, Debug)]
pub struct Located<T> {
    pub value: T,
    pub at: Place,
}

/// A setting of the file: its key, the flags it stands for, where it is.
#[derive(Clone, Debug)]
pub struct Setting {
    pub key: String,
    /// The flag (`--key=value`, or `--key` for a switch), or none for a switch set false.
    pub flag: Option<String>,
    pub at: Place,
}

/// One `[[site]]` as written, each value with its place; checked by `super::sites`.
#[derive(Clone, Debug)]
pub struct SiteDoc {
    pub at: Place,
    pub names: Vec<Located<String>>,
    /// `redirect_names = [...]`: names answered with a redirect to the first of `names`.
    pub redirect_names: Vec<Located<String>>,
    pub cert: Option<Located<PathBuf>>,
    pub key: Option<Located<PathBuf>>,
    /// `acme = true`: the certificate comes from the `[acme]` CA instead of `cert`/`key`.
    pub acme: Option<Located<bool>>,
    /// `compress = false`: the site's responses are never coded (a route may say otherwise).
    pub compress: Option<Located<bool>>,
    /// `max_body`: the largest request body of each upstream route that sets none itself.
    pub max_body: Option<Located<BodyLimit>>,
    pub routes: Vec<RouteDoc>,
    /// `headers`, `hsts`, `cors`, `errors`.
    pub rules: SiteRulesDoc,
    /// Its limits (`allow`, `deny`, `rate`, ...: `ringmux_proto::limits::FILE_KEYS`) as the
    /// contract read them, or the problem it found.
    pub limits: Result<Limits, Problem>,
}

/// The `[acme]` table as written; checked by `super::acme`.
#[derive(Clone, Debug)]
pub struct AcmeDoc {
    pub at: Place,
    pub directory: Option<Located<String>>,
    pub email: Option<Located<String>>,
    pub state: Option<Located<PathBuf>>,
    pub challenge: Option<Located<String>>,
    pub ca_roots: Option<Located<PathBuf>>,
    pub eab_kid: Option<Located<String>>,
    pub eab_hmac_key: Option<Located<String>>,
}

/// One `[[site.route]]`: the route the contract read from it ([`FileRoute`](ringmux_proto::route::FileRoute), then
/// [`Route::try_from`]), or the problem it found, placed at the value it is about.
#[derive(Clone, Debug)]
pub struct RouteDoc {
    /// Where its `[[site.route]]` is.
    pub at: Place,
    pub route: Result<Route, Problem>,
    /// Where each key's value is, by its dotted name (`root`, `respond.status`): for the
    /// checks made later, on disk.
    pub places: Vec<(String, Place)>,
    /// `upstream_ca`, the file the demux reads into the route's `UpstreamTls::roots_pem`.
    pub upstream_ca: Option<PathBuf>,
}

impl RouteDoc {
    /// Where the value of `key` is, else where the route is.
    pub fn place_of(&self, key: &str) -> &Place {
        self.places
            .iter()
            .find(|(k, _)| k == key)
            .map_or(&self.at, |(_, at)| at)
    }
}

/// The file, read and parsed: its settings (each checked by the flag's own parser) and its
/// sites (checked when the configuration is, `super::sites`).
#[derive(Clone, Debug)]
pub struct FileConfig {
    pub path: PathBuf,
    /// What is wrong with the file's syntax, keys or settings; what could be read is kept.
    pub problems: Vec<Problem>,
    pub settings: Vec<Setting>,
    pub sites: Vec<SiteDoc>,
    pub default_site: Option<Located<String>>,
    /// The `[acme]` table, if the file has one.
    pub acme: Option<AcmeDoc>,
}

/// A site's rules as written.
#[derive(Clone, Debug, Default)]
pub struct SiteRulesDoc {
    pub headers: Option<HeaderRules>,
    pub hsts: Option<Hsts>,
    pub cors: Option<Cors>,
    /// `[site.errors]`: each status (checked) and its file (read at load).
    pub errors: Vec<(u16, Located<PathBuf>)>,
}
