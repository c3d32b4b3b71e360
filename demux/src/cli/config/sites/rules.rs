//! What only the disk can tell of a site's rules: each error page read (by the demux, at
//! check, load and reload: the workers get its bytes in the site table and read no file for
//! it), and a file route's fallback a file beneath its root.

use std::path::Path;

use ringmux_proto::rules::{ErrorPage, ErrorPages, Fallback, SiteRules, MAX_ERROR_PAGE};

use super::super::file::{problem, Place, Problem, SiteRulesDoc};

/// The site table's rules of `doc`, every error page read; a page that cannot be read is a
/// problem naming its key.
pub(super) fn site_rules(doc: &SiteRulesDoc, problems: &mut Vec<Problem>) -> SiteRules {
    let mut errors = ErrorPages::default();
    for (status, file) in &doc.errors {
        let key = format!(
            "site.errors.{status} = {:?}",
            file.value.display().to_string()
        );
        let read = crate::sys::read_operator_text(&file.value, MAX_ERROR_PAGE as u64);
        let body = match read {
            Ok(body) => body,
            Err(e) => {
                problem(
                    problems,
                    &file.at,
                    format!(
                        "{key}: the error page cannot be read ({e}); name a UTF-8 file of at \
                         most {MAX_ERROR_PAGE} bytes the demux can read"
                    ),
                );
                continue;
            }
        };
        let page = ErrorPage {
            file: file.value.display().to_string(),
            body,
        };
        if let Err(e) = errors.insert(&status.to_string(), page) {
            problem(problems, &file.at, format!("{key}: {e}"));
        }
    }
    SiteRules {
        headers: doc.headers.clone().unwrap_or_default(),
        hsts: doc.hsts,
        cors: doc.cors.clone(),
        errors,
    }
}

/// A file route's fallback: a regular file beneath `root`, symbolic links resolved.
pub(super) fn check_fallback(
    root: &Path,
    fallback: &Fallback,
    at: &Place,
    problems: &mut Vec<Problem>,
) {
    let path = root.join(fallback.relative());
    let beneath = match (root.canonicalize(), path.canonicalize()) {
        (Ok(root), Ok(file)) => file.starts_with(&root) && file.is_file(),
        _ => false,
    };
    if !beneath {
        problem(
            problems,
            at,
            format!(
                "fallback = {:?}: {} is no file beneath the route's root {}; name a file \
                 beneath it, e.g. \"/index.html\"",
                fallback.as_str(),
                path.display(),
                root.display()
            ),
        );
    }
}
