//! The configuration file (`--config FILE`, TOML): every option of the command line under the
//! name clap gives it (`--tcp-max-connections` → `tcp_max_connections`), and the `[[site]]`
//! tables. The command line's declaration ([`super::RunArgs`]) is the only list of settings:
//! a key of the file is checked against it, its value parsed by the same parser as the flag's,
//! and the file's settings reach [`super::RunArgs`] as flags placed before the command line's
//! own, so a flag or an environment variable given at start wins over the file.
//!
//! Every refusal names the file, the line and the column, and for an unknown key the nearest
//! known one.

use std::path::{Path, PathBuf};

use clap::parser::ValueSource;
use clap::{ArgAction, ArgMatches, CommandFactory};
use ringmux_proto::limits::{FileLimits, Limits, FILE_KEYS};
use ringmux_proto::route::{BodyLimit, FileRoute};
use ringmux_proto::sites::Route;
use serde::Deserialize;
use toml::de::{DeTable, DeValue};
use toml::Spanned;

use super::flags::Cli;

mod rules;
pub use rules::SITE_RULE_KEYS;

pub use super::document::{
    problem, AcmeDoc, FileConfig, Located, Place, Problem, Problems, RouteDoc, Setting, SiteDoc,
    SiteRulesDoc,
};

/// The keys a `[[site]]` takes: its own, and its limits' (`ringmux_proto::limits::FILE_KEYS`).
pub const SITE_KEYS: [&str; 18] = [
    "names",
    "redirect_names",
    "cert",
    "key",
    "acme",
    "compress",
    "max_body",
    "route",
    // The site's rules: `rules::SITE_RULE_KEYS`.
    "headers",
    "hsts",
    "cors",
    "errors",
    "allow",
    "deny",
    "rate",
    "burst",
    "rate_prefix_v4",
    "rate_prefix_v6",
];
/// The keys the `[acme]` table takes.
pub const ACME_KEYS: [&str; 7] = [
    "directory",
    "email",
    "state",
    "challenge",
    "ca_roots",
    "eab_kid",
    "eab_hmac_key",
];
/// The keys of the file that are not settings of the command line.
pub const TABLE_KEYS: [&str; 3] = ["site", "default_site", "acme"];

/// Settings of the command line that the file cannot hold.
const NOT_IN_FILE: [&str; 3] = ["config", "help", "version"];

/// Every setting the file may hold: the command line's options, by their clap IDs.
pub fn setting_keys() -> Vec<String> {
    Cli::command()
        .get_arguments()
        .map(|a| a.get_id().to_string())
        .filter(|id| !NOT_IN_FILE.contains(&id.as_str()))
        .collect()
}

impl FileConfig {
    /// Reads and parses `path`; every problem found, each with its place.
    pub fn read(path: &Path) -> Result<FileConfig, Problems> {
        let one = |message: String| Problems(vec![Problem { at: None, message }]);
        let text =
            crate::sys::read_operator_text(path, crate::sys::MAX_CONFIG_FILE).map_err(|e| {
                one(format!(
                    "--config / RINGMUX_CONFIG={}: cannot read it: {e}",
                    path.display()
                ))
            })?;
        FileConfig::parse(path, &text)
    }

    /// Parses `text`, the content of `path`.
    pub fn parse(path: &Path, text: &str) -> Result<FileConfig, Problems> {
        let mut p = Parser {
            path,
            text,
            problems: Vec::new(),
        };
        let doc = match DeTable::parse(text) {
            Ok(doc) => doc,
            Err(e) => {
                let at = e.span().map(|s| p.place(s.start));
                return Err(Problems(vec![Problem {
                    at,
                    message: format!("not valid TOML: {}", e.message().trim()),
                }]));
            }
        };
        let mut file = FileConfig {
            path: path.to_owned(),
            problems: Vec::new(),
            settings: Vec::new(),
            sites: Vec::new(),
            default_site: None,
            acme: None,
        };
        let cmd = Cli::command();
        let keys = setting_keys();
        for (key, value) in doc.get_ref() {
            let name = key.get_ref().as_ref();
            match name {
                "site" => file.sites = p.sites(value),
                "default_site" => file.default_site = p.string(value, "default_site"),
                "acme" => file.acme = p.acme(value),
                _ => {
                    let Some(arg) = keys
                        .iter()
                        .any(|k| k == name)
                        .then(|| cmd.get_arguments().find(|a| a.get_id() == name))
                        .flatten()
                    else {
                        let known: Vec<&str> =
                            keys.iter().map(String::as_str).chain(TABLE_KEYS).collect();
                        p.unknown(key, &known, "setting");
                        continue;
                    };
                    if let Some(setting) = p.setting(name, arg, value) {
                        file.settings.push(setting);
                    }
                }
            }
        }
        file.problems = p.problems;
        file.problems
            .sort_by_key(|p| p.at.as_ref().map(|a| (a.line, a.column)));
        Ok(file)
    }

    /// The flags of the file's settings that neither the command line nor the environment
    /// set (`matches`, the command line parsed): those win over the file.
    pub fn flags(&self, matches: &ArgMatches) -> Vec<String> {
        self.settings
            .iter()
            .filter(|s| {
                !matches!(
                    matches.value_source(&s.key),
                    Some(ValueSource::CommandLine | ValueSource::EnvVariable)
                )
            })
            .filter_map(|s| s.flag.clone())
            .collect()
    }

    /// Where the file sets the option whose flag is `--flag`, if it does.
    pub fn place_of_flag(&self, flag: &str) -> Option<&Setting> {
        self.settings
            .iter()
            .find(|s| format!("--{}", s.key.replace('_', "-")) == flag)
    }
}

struct Parser<'a> {
    path: &'a Path,
    text: &'a str,
    problems: Vec<Problem>,
}

type Value<'i> = Spanned<DeValue<'i>>;
type Span = std::ops::Range<usize>;

impl Parser<'_> {
    /// The place of byte `offset` of the file.
    fn place(&self, offset: usize) -> Place {
        // A byte offset inside a character (an error's span may point there) counts from the
        // character's start.
        let mut offset = offset.min(self.text.len());
        while !self.text.is_char_boundary(offset) {
            offset -= 1;
        }
        let before = &self.text[..offset];
        let line = before.matches('\n').count() + 1;
        let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
        Place {
            file: self.path.to_owned(),
            line,
            column,
        }
    }

    fn at<T>(&self, v: &Spanned<T>) -> Place {
        self.place(v.span().start)
    }

    fn problem(&mut self, at: Place, message: String) {
        self.problems.push(Problem {
            at: Some(at),
            message,
        });
    }

    /// An unknown key of a `what`, with the nearest of `known`.
    fn unknown(&mut self, key: &Spanned<std::borrow::Cow<'_, str>>, known: &[&str], what: &str) {
        let name = key.get_ref().as_ref();
        let nearest = known
            .iter()
            .map(|k| (strsim::jaro_winkler(name, k), *k))
            .max_by(|a, b| a.0.total_cmp(&b.0))
            .filter(|(score, _)| *score > 0.7)
            .map(|(_, k)| format!("; did you mean `{k}`?"))
            .unwrap_or_default();
        let at = self.at(key);
        self.problem(at, format!("unknown {what} `{name}`{nearest}"));
    }

    /// A setting of the command line: its value as the flag takes it, checked by the flag's
    /// own parser.
    fn setting(&mut self, key: &str, arg: &clap::Arg, value: &Value<'_>) -> Option<Setting> {
        let at = self.at(value);
        let long = arg.get_long().unwrap_or(key);
        let switch = matches!(arg.get_action(), ArgAction::SetTrue);
        let on_off = arg
            .get_possible_values()
            .iter()
            .any(|v| v.get_name() == "on");
        let text = match value.get_ref() {
            DeValue::Boolean(b) if switch => {
                return Some(Setting {
                    key: key.to_owned(),
                    flag: b.then(|| format!("--{long}")),
                    at,
                });
            }
            DeValue::Boolean(b) if on_off => (if *b { "on" } else { "off" }).to_owned(),
            DeValue::String(s) if !switch => s.to_string(),
            DeValue::Integer(i) if !switch => integer(i.as_str(), i.radix())?.to_string(),
            DeValue::Float(f) if !switch => f.as_str().to_owned(),
            DeValue::Array(items) if !switch && arg.get_value_delimiter().is_some() => {
                let mut parts = Vec::new();
                for item in items {
                    match item.get_ref() {
                        DeValue::Integer(i) => {
                            parts.push(integer(i.as_str(), i.radix())?.to_string())
                        }
                        DeValue::String(s) => parts.push(s.to_string()),
                        other => {
                            let at = self.at(item);
                            self.problem(
                                at,
                                format!(
                                    "{key}: expected numbers or strings, not {}",
                                    other.type_str()
                                ),
                            );
                            return None;
                        }
                    }
                }
                parts.join(",")
            }
            other => {
                let expected = if switch {
                    "true or false"
                } else if on_off {
                    "\"on\", \"off\", true or false"
                } else {
                    "a string or a number"
                };
                self.problem(
                    at,
                    format!("{key}: expected {expected}, not {}", other.type_str()),
                );
                return None;
            }
        };
        let flag = format!("--{long}={text}");
        // The flag's own parser, alone: its range, its possible values.
        if let Err(e) = Cli::command().try_get_matches_from(["ringmux", flag.as_str()]) {
            let why = e.render().to_string();
            // clap's first line: "error: invalid value 'V' for '--flag <V>': why".
            let why = why.lines().next().unwrap_or_default();
            let why = why
                .rsplit("': ")
                .next()
                .unwrap_or(why)
                .trim_start_matches("error: ");
            let shown = self.text.get(value.span()).unwrap_or(&text);
            self.problem(at, format!("{key} = {shown} is not valid: {why}"));
            return None;
        }
        Some(Setting {
            key: key.to_owned(),
            flag: Some(flag),
            at,
        })
    }

    fn string(&mut self, value: &Value<'_>, what: &str) -> Option<Located<String>> {
        match value.get_ref() {
            DeValue::String(s) => Some(Located {
                value: s.to_string(),
                at: self.at(value),
            }),
            other => {
                let at = self.at(value);
                self.problem(
                    at,
                    format!("{what}: expected a string, not {}", other.type_str()),
                );
                None
            }
        }
    }

    fn path(&mut self, value: &Value<'_>, what: &str) -> Option<Located<PathBuf>> {
        self.string(value, what).map(|s| Located {
            value: PathBuf::from(s.value),
            at: s.at,
        })
    }

    /// A site's `max_body`, read as a route's is ([`BodyLimit`]).
    fn body_limit(&mut self, value: &Value<'_>) -> Option<Located<BodyLimit>> {
        let at = self.at(value);
        match BodyLimit::deserialize(toml::de::ValueDeserializer::from(value.clone())) {
            Ok(limit) => Some(Located { value: limit, at }),
            Err(e) => {
                self.problem(at, format!("max_body: {}", e.message()));
                None
            }
        }
    }

    fn boolean(&mut self, value: &Value<'_>, what: &str) -> Option<Located<bool>> {
        match value.get_ref() {
            DeValue::Boolean(b) => Some(Located {
                value: *b,
                at: self.at(value),
            }),
            other => {
                let at = self.at(value);
                self.problem(
                    at,
                    format!("{what}: expected true or false, not {}", other.type_str()),
                );
                None
            }
        }
    }

    /// The tables of an array of tables (`[[site]]`, `[[site.route]]`).
    fn tables<'v, 'i>(
        &mut self,
        value: &'v Value<'i>,
        what: &str,
    ) -> Vec<(Place, Span, &'v DeTable<'i>)> {
        let items: Vec<&Value<'i>> = match value.get_ref() {
            DeValue::Array(items) => items.iter().collect(),
            DeValue::Table(_) => vec![value],
            other => {
                let at = self.at(value);
                self.problem(
                    at,
                    format!(
                        "{what}: expected [[{what}]] tables, not {}",
                        other.type_str()
                    ),
                );
                return Vec::new();
            }
        };
        let mut tables = Vec::new();
        for item in items {
            match item.get_ref() {
                DeValue::Table(t) => tables.push((self.at(item), item.span(), t)),
                other => {
                    let at = self.at(item);
                    self.problem(
                        at,
                        format!("{what}: expected a table, not {}", other.type_str()),
                    );
                }
            }
        }
        tables
    }

    fn sites(&mut self, value: &Value<'_>) -> Vec<SiteDoc> {
        let mut sites = Vec::new();
        for (at, span, table) in self.tables(value, "site") {
            let mut site = SiteDoc {
                at,
                names: Vec::new(),
                redirect_names: Vec::new(),
                cert: None,
                key: None,
                acme: None,
                compress: None,
                max_body: None,
                routes: Vec::new(),
                rules: SiteRulesDoc::default(),
                limits: Ok(Limits::default()),
            };
            let mut limits = DeTable::new();
            for (k, v) in table {
                match k.get_ref().as_ref() {
                    key if FILE_KEYS.contains(&key) => drop(limits.insert(k.clone(), v.clone())),
                    "names" => site.names = self.names(v, "names"),
                    "redirect_names" => site.redirect_names = self.names(v, "redirect_names"),
                    "cert" => site.cert = self.path(v, "cert"),
                    "key" => site.key = self.path(v, "key"),
                    "acme" => site.acme = self.boolean(v, "acme"),
                    "compress" => site.compress = self.boolean(v, "compress"),
                    "max_body" => site.max_body = self.body_limit(v),
                    "route" => {
                        for (at, span, route) in self.tables(v, "site.route") {
                            let r = self.route(at, span, route);
                            site.routes.push(r);
                        }
                    }
                    key if SITE_RULE_KEYS.contains(&key) => self.site_rule(k, v, &mut site.rules),
                    _ => self.unknown(k, &SITE_KEYS, "key of [[site]]"),
                }
            }
            site.limits = self.limits(&site.at, span, limits);
            sites.push(site);
        }
        sites
    }

    /// A site's limit keys (`limits`, the table at `span` without its other keys), read by
    /// the contract's declaration ([`FileLimits`]).
    fn limits(&self, at: &Place, span: Span, limits: DeTable<'_>) -> Result<Limits, Problem> {
        let mut places = Vec::new();
        self.places(&limits, "", &mut places);
        let value = Spanned::new(span, DeValue::Table(limits.clone()));
        let file = FileLimits::deserialize(toml::de::ValueDeserializer::from(value))
            .map_err(|e| self.refusal(&limits, at, &e))?;
        Limits::try_from(file).map_err(|e| {
            let place = e.key().and_then(|k| places.iter().find(|(p, _)| p == k));
            Problem {
                at: Some(place.map_or(at, |(_, p)| p).clone()),
                message: e.to_string(),
            }
        })
    }

    /// A list of names (`names`, `redirect_names`), each with its place.
    fn names(&mut self, v: &Value<'_>, key: &str) -> Vec<Located<String>> {
        let DeValue::Array(items) = v.get_ref() else {
            let at = self.at(v);
            self.problem(
                at,
                format!(
                    "{key}: expected a list of names, e.g. [\"example.com\", \
                     \"www.example.com\"], not {}",
                    v.get_ref().type_str()
                ),
            );
            return Vec::new();
        };
        items
            .iter()
            .filter_map(|item| self.string(item, key))
            .collect()
    }

    fn acme(&mut self, value: &Value<'_>) -> Option<AcmeDoc> {
        let at = self.at(value);
        let DeValue::Table(table) = value.get_ref() else {
            self.problem(
                at,
                format!(
                    "acme: expected an [acme] table, not {}",
                    value.get_ref().type_str()
                ),
            );
            return None;
        };
        let mut doc = AcmeDoc {
            at,
            directory: None,
            email: None,
            state: None,
            challenge: None,
            ca_roots: None,
            eab_kid: None,
            eab_hmac_key: None,
        };
        for (k, v) in table {
            match k.get_ref().as_ref() {
                "directory" => doc.directory = self.string(v, "acme.directory"),
                "email" => doc.email = self.string(v, "acme.email"),
                "state" => doc.state = self.path(v, "acme.state"),
                "challenge" => doc.challenge = self.string(v, "acme.challenge"),
                "ca_roots" => doc.ca_roots = self.path(v, "acme.ca_roots"),
                "eab_kid" => doc.eab_kid = self.string(v, "acme.eab_kid"),
                "eab_hmac_key" => doc.eab_hmac_key = self.string(v, "acme.eab_hmac_key"),
                _ => self.unknown(k, &ACME_KEYS, "key of [acme]"),
            }
        }
        Some(doc)
    }

    /// A `[[site.route]]` (the table `table`, at `span`), read by the contract's declaration;
    /// an unknown key is named with the nearest known one, and left out.
    fn route(&mut self, at: Place, span: Span, table: &DeTable<'_>) -> RouteDoc {
        let keys = fields::<FileRoute>();
        let mut known = DeTable::new();
        for (k, v) in table {
            match keys.contains(&k.get_ref().as_ref()) {
                true => drop(known.insert(k.clone(), v.clone())),
                false => self.unknown(k, keys, "key of [[site.route]]"),
            }
        }
        let mut places = Vec::new();
        self.places(&known, "", &mut places);
        let value = Spanned::new(span, DeValue::Table(known.clone()));
        let read = FileRoute::deserialize(toml::de::ValueDeserializer::from(value));
        let upstream_ca = read.as_ref().ok().and_then(|f| f.upstream_ca.clone());
        let route = match read {
            Err(e) => Err(self.refusal(&known, &at, &e)),
            Ok(file) => Route::try_from(file).map_err(|e| {
                let place = e.key().and_then(|k| places.iter().find(|(p, _)| p == k));
                Problem {
                    at: Some(place.map_or(&at, |(_, p)| p).clone()),
                    message: e.to_string(),
                }
            }),
        };
        RouteDoc {
            at,
            route,
            places,
            upstream_ca,
        }
    }

    /// Where each value of `table` is, by its dotted key under `prefix`, tables within.
    fn places(&self, table: &DeTable<'_>, prefix: &str, out: &mut Vec<(String, Place)>) {
        for (k, v) in table {
            let key = format!("{prefix}{}", k.get_ref());
            if let DeValue::Table(inner) = v.get_ref() {
                self.places(inner, &format!("{key}."), out);
            }
            out.push((key, self.at(v)));
        }
    }

    /// A value of `table` refused by the contract (`e`, placed at the value, or at the
    /// table `at` for the whole): `KEY = VALUE: why` (`KEY: why` for a table or a list).
    fn refusal(&self, table: &DeTable<'_>, at: &Place, e: &toml::de::Error) -> Problem {
        let Some(span) = e.span() else {
            return Problem {
                at: Some(at.clone()),
                message: e.message().to_string(),
            };
        };
        let mut key = String::new();
        let mut value = None;
        let mut inner = Some(table);
        while let Some(t) = inner.take() {
            let Some((k, v)) = t.iter().find(|(_, v)| v.span().contains(&span.start)) else {
                break;
            };
            key = if key.is_empty() {
                k.get_ref().to_string()
            } else {
                format!("{key}.{}", k.get_ref())
            };
            value = Some(v);
            if let DeValue::Table(t) = v.get_ref() {
                inner = Some(t);
            }
        }
        let message = match value.map(|v| (v.get_ref(), self.text.get(v.span()))) {
            Some((DeValue::Table(_) | DeValue::Array(_), _)) | Some((_, None)) => {
                format!("{key}: {}", e.message())
            }
            Some((_, Some(shown))) => format!("{key} = {shown}: {}", e.message()),
            None => e.message().to_string(),
        };
        Problem {
            at: Some(self.place(span.start)),
            message,
        }
    }
}

/// The keys a `[[site.route]]` takes: the fields of its declaration (`FileRoute`).
pub fn route_keys() -> &'static [&'static str] {
    fields::<FileRoute>()
}

/// The keys a route's `respond` table takes: the fields of its declaration.
pub fn respond_keys() -> &'static [&'static str] {
    fields::<ringmux_proto::route::Respond>()
}

/// The field names of the struct `T` deserialises from: the keys its table takes, declared
/// once, by its `Deserialize` (which hands them to `deserialize_struct`).
fn fields<'de, T: Deserialize<'de>>() -> &'static [&'static str] {
    struct Fields<'f>(&'f mut &'static [&'static str]);
    impl<'de> serde::Deserializer<'de> for Fields<'_> {
        type Error = serde::de::value::Error;
        fn deserialize_any<V: serde::de::Visitor<'de>>(
            self,
            _: V,
        ) -> Result<V::Value, Self::Error> {
            Err(serde::de::Error::custom("not a struct"))
        }
        fn deserialize_struct<V: serde::de::Visitor<'de>>(
            self,
            _: &'static str,
            fields: &'static [&'static str],
            _: V,
        ) -> Result<V::Value, Self::Error> {
            *self.0 = fields;
            Err(serde::de::Error::custom("fields taken"))
        }
        serde::forward_to_deserialize_any! {
            bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes
            byte_buf option unit unit_struct newtype_struct seq tuple tuple_struct map enum
            identifier ignored_any
        }
    }
    let mut fields: &'static [&'static str] = &[];
    let _ = T::deserialize(Fields(&mut fields));
    fields
}

/// A TOML integer's text (digits and underscores, after any `0x`/`0o`/`0b`) in `radix`.
fn integer(text: &str, radix: u32) -> Option<i64> {
    let digits: String = text.chars().filter(|c| *c != '_').collect();
    let digits = digits
        .strip_prefix("0x")
        .or_else(|| digits.strip_prefix("0o"))
        .or_else(|| digits.strip_prefix("0b"))
        .unwrap_or(&digits);
    i64::from_str_radix(digits, radix).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    const EXAMPLE: &str = include_str!("../../../../examples/ringmux.toml");

    /// `examples/ringmux.toml` with every commented `# key = …` line of a setting made live:
    /// its defaults and examples, which must all be valid.
    fn example_uncommented() -> String {
        let keys = setting_keys();
        // The settings, not the commented sample site after them.
        let settings = EXAMPLE.split("# ---- Sites").next().unwrap_or_default();
        settings
            .lines()
            .map(|l| match l.strip_prefix("# ") {
                Some(rest) if keys.iter().any(|k| rest.starts_with(&format!("{k} = "))) => rest,
                _ => l,
            })
            .collect::<Vec<_>>()
            .join("\n")
    }

    #[test]
    fn the_example_names_every_setting_and_parses() {
        for key in setting_keys() {
            let line = format!("# {key} = ");
            assert!(
                EXAMPLE
                    .split("# ---- Sites")
                    .next()
                    .unwrap_or_default()
                    .lines()
                    .any(|l| l.starts_with(&line)),
                "examples/ringmux.toml has no line `{line}…` before its sites: add the setting, its \
                 default and one line on what it does"
            );
        }
        let file = FileConfig::parse(Path::new("ringmux.toml"), EXAMPLE).unwrap();
        assert!(file.problems.is_empty(), "{:?}", file.problems);
        let all = example_uncommented();
        let file = FileConfig::parse(Path::new("ringmux.toml"), &all).unwrap();
        assert!(file.problems.is_empty(), "{:?}", file.problems);
        assert_eq!(file.settings.len(), setting_keys().len());
    }

    #[test]
    fn unknown_keys_and_bad_values_are_placed() {
        let text = "listen = \"127.0.0.1:0\"\ntcp_max_conections = 5\ninstances = \"x\"\n[[site]]\nnames = [\"a.test\"]\ncrt = \"/a\"\n[[site.route]]\npath = \"/\"\nrot = \"/srv\"\n";
        let file = FileConfig::parse(Path::new("f.toml"), text).unwrap();
        let got: Vec<String> = file.problems.iter().map(|p| p.to_string()).collect();
        assert_eq!(got.len(), 4, "{got:?}");
        assert!(
            got[0].starts_with("f.toml:2:1: unknown setting `tcp_max_conections`")
                && got[0].ends_with("did you mean `tcp_max_connections`?"),
            "{got:?}"
        );
        assert!(
            got[1].starts_with("f.toml:3:13: instances = \"x\" is not valid"),
            "{got:?}"
        );
        assert!(
            got[2].starts_with("f.toml:6:1: unknown key of [[site]] `crt`"),
            "{got:?}"
        );
        assert!(got[2].ends_with("did you mean `cert`?"), "{got:?}");
        assert!(
            got[3].starts_with("f.toml:9:1: unknown key of [[site.route]] `rot`"),
            "{got:?}"
        );
        let bad = FileConfig::parse(Path::new("f.toml"), "listen = [").unwrap_err();
        assert!(bad.to_string().starts_with("f.toml:1:"), "{bad}");
        // Errors inside or after characters of several bytes are placed, not a panic.
        for text in [
            "ä = 1",
            "listen = \"ä",
            "# ü\nx = ä",
            "\u{1F600}\u{1F600} = [\n",
        ] {
            match FileConfig::parse(Path::new("f.toml"), text) {
                Ok(f) => assert!(!f.problems.is_empty(), "{text:?}"),
                Err(e) => assert!(e.to_string().starts_with("f.toml:"), "{text:?}: {e}"),
            }
        }
    }

    /// A route's bad value is refused by the contract's declaration, named with its key and
    /// value at its line and column; a route as a whole at its `[[site.route]]`.
    #[test]
    fn a_routes_bad_values_are_placed() {
        let route = |body: &str| {
            let text = format!("[[site]]\nnames = [\"a.test\"]\n[[site.route]]\n{body}");
            let file = FileConfig::parse(Path::new("f.toml"), &text).unwrap();
            let doc = &file.sites[0].routes[0];
            match &doc.route {
                Ok(r) => panic!("{body:?} was taken: {r:?}"),
                Err(p) => (file.problems.clone(), p.to_string()),
            }
        };
        for (body, want) in [
            (
                "path = \"/old\"\nredirect = \"https://b.test/\"\nstatus = 300\n",
                "f.toml:6:10: status = 300: a redirect is 301, 302, 307 or 308",
            ),
            (
                "path = \"/hi\"\nrespond = { status = 99, body = \"x\" }\n",
                "f.toml:5:22: respond.status = 99: expected a status of 200 to 599",
            ),
            (
                "path = \"/hi\"\nrespond = { status = 204, body = \"x\" }\n",
                "f.toml:5:34: a 204 response has no body",
            ),
            (
                "path = \"/hi\"\nrespond = { body = \"ok\", headers = { \"x a\" = \"b\" } }\n",
                "f.toml:5:36: respond.headers: \"x a\" is not a header field name",
            ),
            (
                "path = \"/hi\"\nrespond = { headers = { \"Content-Length\" = \"3\" } }\n",
                "f.toml:5:23: respond.headers: content-length: ringmux owns this field (the \
                 server sets it from the body)",
            ),
            (
                "path = \"/api\"\nupstream = \"ftp://127.0.0.1:9\"\n",
                "f.toml:5:12: upstream = \"ftp://127.0.0.1:9\": expected http://HOST:PORT, \
                 https://HOST:PORT, h2c://HOST:PORT (HTTP/2 in the clear) or h2://HOST:PORT \
                 (HTTP/2 over TLS)",
            ),
            (
                "path = \"/api\"\nupstream = \"http://127.0.0.1:9\"\nupstream_ca = \"/ca.pem\"\n",
                "f.toml:6:15: upstream_ca goes with a TLS upstream (https:// or h2://), and \
                 upstream = \"http://127.0.0.1:9\" is in the clear",
            ),
            (
                "path = \"/api\"\nupstream = \"h2://127.0.0.1:9\"\nupstream_sni = \"a b\"\n",
                "f.toml:6:16: upstream_sni = \"a b\": expected a DNS name",
            ),
            (
                "path = \"/api\"\nupstream = \"http://127.0.0.1:9\"\nhealth = { path = \"/h\", interval = 2, timeout = 3 }\n",
                "f.toml:6:10: health: health.timeout = 3: must be shorter than health.interval = 2",
            ),
            (
                "path = \"/api\"\nupstream = \"http://127.0.0.1:9\"\nhealth = { path = \"h\" }\n",
                "f.toml:6:10: health: health.path = \"h\": expected a path starting with /",
            ),
            (
                "path = \"/x\"\nroot = \"/srv\"\nhealth = { path = \"/h\" }\n",
                "f.toml:6:10: health goes with upstream only",
            ),
            (
                "path = \"/x\"\nroot = \"/srv\"\nstrip_prefix = true\n",
                "f.toml:6:16: strip_prefix goes with upstream only",
            ),
            (
                "path = \"x\"\nroot = \"/srv\"\n",
                "f.toml:4:8: path \"x\": expected a path prefix starting with /",
            ),
            (
                "path = \"/x\"\nroot = \"/srv\"\nredirect = \"https://b.test/\"\n",
                "f.toml:3:1: a [[site.route]] takes one action",
            ),
            (
                "path = \"/x\"\nrespond = { stauts = 200 }\n",
                "f.toml:5:13: respond: unknown field `stauts`, expected one of `status`, \
                 `body`, `headers`",
            ),
            (
                "path = \"/x\"\nstatus = \"x\"\nredirect = \"https://b.test/\"\n",
                "f.toml:5:10: status = \"x\": invalid type: string \"x\"",
            ),
        ] {
            let (file_problems, got) = route(body);
            assert!(file_problems.is_empty(), "{body:?}: {file_problems:?}");
            assert!(
                got.starts_with(want),
                "{body:?}:\n  want {want}\n  got  {got}"
            );
        }
        // An unknown key is named with the nearest one and left out; the rest is read.
        let text = "[[site]]\nnames = [\"a.test\"]\n[[site.route]]\npath = \"/\"\nrot = \"/srv\"\n\
                    respond = {}\n";
        let file = FileConfig::parse(Path::new("f.toml"), text).unwrap();
        assert_eq!(file.problems.len(), 1, "{:?}", file.problems);
        assert!(file.sites[0].routes[0].route.is_ok());
        assert_eq!(file.sites[0].routes[0].place_of("respond").line, 6);
    }

    #[test]
    fn bad_limits_are_placed_and_named() {
        let site = |keys: &str| {
            let text = format!("[[site]]\nnames = [\"a.test\"]\n{keys}");
            let file = FileConfig::parse(Path::new("f.toml"), &text).unwrap();
            assert!(file.problems.is_empty(), "{keys:?}: {:?}", file.problems);
            file.sites[0].limits.clone().map_err(|p| p.to_string())
        };
        // (keys, the line the problem is placed at, what it says)
        for (keys, line, says) in [
            (
                "deny = [\"10.0.0.0/8\", \"203.0.113.1/24\"]\n",
                "f.toml:3:",
                "deny: \"203.0.113.1/24\": bits are set beyond the prefix",
            ),
            (
                "allow = [\"localhost\"]\n",
                "f.toml:3:",
                "allow: \"localhost\": expected an IPv4 or IPv6 address",
            ),
            (
                "rate = \"5/d\"\n",
                "f.toml:3:",
                "rate = \"5/d\": expected requests per",
            ),
            ("burst = 10\n", "f.toml:3:", "burst goes with rate"),
            (
                "rate = \"5/s\"\nburst = 0\n",
                "f.toml:4:",
                "burst = 0: expected 1 to",
            ),
            (
                "rate = \"5/s\"\nrate_prefix_v6 = 129\n",
                "f.toml:4:",
                "129: expected an IPv6 prefix length of 1 to 128 bits",
            ),
        ] {
            let got = site(keys).unwrap_err();
            assert!(
                got.starts_with(line) && got.contains(says),
                "{keys:?}:\n  want {line}…{says}\n  got  {got}"
            );
        }
        let l = site("deny = [\"10.0.0.0/8\"]\nrate = \"5/s\"\nburst = 10\n").unwrap();
        assert_eq!((l.deny.len(), l.rate.map(|r| r.burst.get())), (1, Some(10)));
        let text = "[[site]]\nnames = [\"a.test\"]\n[[site.route]]\npath = \"/\"\nroot = \"/s\"\n\
                    rate = \"2/m\"\nallow = [\"::1\"]\n";
        let file = FileConfig::parse(Path::new("f.toml"), text).unwrap();
        let route = file.sites[0].routes[0].route.as_ref().unwrap();
        assert_eq!(route.limits.allow[0].to_string(), "::1/128");
    }

    #[test]
    fn the_keys_of_a_route_are_its_declarations_fields() {
        assert_eq!(
            fields::<FileRoute>(),
            [
                "path",
                "root",
                "upstream",
                "strip_prefix",
                "lb",
                "retries",
                "max_fails",
                "fail_window",
                "eject_for",
                "max_body",
                "health",
                "upstream_ca",
                "upstream_sni",
                "redirect",
                "status",
                "respond",
                "compress",
                "headers",
                "request_headers",
                "fallback",
                "allow",
                "deny",
                "rate",
                "burst",
                "rate_prefix_v4",
                "rate_prefix_v6"
            ]
        );
        assert_eq!(fields::<ringmux_proto::limits::FileLimits>(), FILE_KEYS);
        assert!(FILE_KEYS.iter().all(|k| SITE_KEYS.contains(k)));
        assert_eq!(
            fields::<ringmux_proto::route::Respond>(),
            ["status", "body", "headers"]
        );
    }

    proptest::proptest! {
        /// Whatever the file holds, parsing it places a problem or succeeds: never a panic.
        #[test]
        fn any_text_parses_or_is_refused(text in "\\PC*") {
            let _ = FileConfig::parse(Path::new("f.toml"), &text);
        }

        /// The example, cut anywhere and with any text put in there.
        #[test]
        fn the_example_cut_and_spliced(at in 0..EXAMPLE.len(), insert in "\\PC{0,8}") {
            let mut at = at;
            while !EXAMPLE.is_char_boundary(at) {
                at -= 1;
            }
            let text = format!("{}{insert}{}", &EXAMPLE[..at], &EXAMPLE[at..]);
            let _ = FileConfig::parse(Path::new("f.toml"), &text);
        }
    }
}
