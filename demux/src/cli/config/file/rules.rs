//! A `[[site]]`'s rules as the file writes them: `headers`, `hsts`, `cors` (each read by its
//! declaration in `ringmux_proto::rules`, a refusal placed at its value and naming its key),
//! and `errors`, a status and a file per line, which `super::super::sites` reads.

use std::path::PathBuf;

use ringmux_proto::rules;
use serde::Deserialize;
use toml::de::{DeTable, DeValue};
use toml::Spanned;

use super::{Located, Parser, SiteRulesDoc, Value};

/// The keys of a `[[site]]` this module reads.
pub const SITE_RULE_KEYS: [&str; 4] = ["headers", "hsts", "cors", "errors"];

impl Parser<'_> {
    /// Reads the site key `key` (one of [`SITE_RULE_KEYS`]) into `doc`.
    pub(super) fn site_rule(
        &mut self,
        key: &Spanned<std::borrow::Cow<'_, str>>,
        v: &Value<'_>,
        doc: &mut SiteRulesDoc,
    ) {
        match key.get_ref().as_ref() {
            "headers" => doc.headers = self.declared(key, v),
            "hsts" => doc.hsts = self.declared(key, v),
            "cors" => doc.cors = self.declared(key, v),
            _ => doc.errors = self.errors(v),
        }
    }

    /// The value `v` of `key`, read by its declaration; a refusal is a problem naming
    /// `site.KEY`.
    fn declared<T: for<'de> Deserialize<'de>>(
        &mut self,
        key: &Spanned<std::borrow::Cow<'_, str>>,
        v: &Value<'_>,
    ) -> Option<T> {
        match T::deserialize(toml::de::ValueDeserializer::from(v.clone())) {
            Ok(t) => Some(t),
            Err(e) => {
                let mut one = DeTable::new();
                one.insert(key.clone(), v.clone());
                let mut problem = self.refusal(&one, &self.at(v), &e);
                let name = key.get_ref().as_ref();
                if !problem.message.starts_with(name) {
                    problem.message = format!("{name}: {}", problem.message);
                }
                problem.message = format!("site.{}", problem.message);
                self.problems.push(problem);
                None
            }
        }
    }

    /// `[site.errors]`: `STATUS = "FILE"` lines.
    fn errors(&mut self, v: &Value<'_>) -> Vec<(u16, Located<PathBuf>)> {
        let DeValue::Table(table) = v.get_ref() else {
            let at = self.at(v);
            self.problem(
                at,
                format!(
                    "site.errors: expected a table of statuses and files, e.g. {{ 404 = \
                     \"/srv/www/404.html\" }}, not {}",
                    v.get_ref().type_str()
                ),
            );
            return Vec::new();
        };
        let mut pages = Vec::new();
        for (k, file) in table {
            let what = format!("site.errors.{}", k.get_ref());
            let status = match rules::error_status(k.get_ref()) {
                Ok(s) => s,
                Err(e) => {
                    let at = self.at(k);
                    self.problem(at, format!("{what}: {e}"));
                    continue;
                }
            };
            if let Some(path) = self.path(file, &what) {
                pages.push((status, path));
            }
        }
        pages
    }
}
