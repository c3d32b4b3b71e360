//! The `[acme]` table, checked: the CA, the account's contact, the state directory, the
//! challenge type and the roots to trust for the CA's own HTTPS. The engine that uses it is
//! `ringmux_acme`.

use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;

use base64::Engine;
use ringmux_proto::sites::SiteTable;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::CertificateDer;

use super::file::{problem, AcmeDoc, FileConfig, Located, Place, Problem, Problems};
use super::flags::RunArgs;
use ringmux_acme::seal::KeyFileSecret;
use ringmux_acme::{AcmeSettings, AcmeSite, ChallengeKind, Eab, DEFAULT_STATE, LETS_ENCRYPT};

/// The ACME settings of the file's `[acme]` table (every key has a default, so a site with
/// `acme = true` needs no table), checked against `args` (the listener a challenge needs);
/// every problem found, each with its place. One step per key (or pair of keys), in the
/// table's order.
pub fn settings(file: &FileConfig, args: &RunArgs) -> Result<AcmeSettings, Problems> {
    let doc = file.acme.as_ref();
    let mut problems = Vec::new();
    // Where a problem of a key left out is placed: the table, or the first `acme = true`.
    let first_acme_site = file
        .sites
        .iter()
        .find_map(|s| s.acme.as_ref().filter(|a| a.value).map(|a| &a.at));
    let table_at = doc.map(|d| &d.at).or(first_acme_site);
    let field = |f: fn(&AcmeDoc) -> Option<&Located<String>>| doc.and_then(f);

    let directory = directory(field(|d| d.directory.as_ref()), &mut problems);
    let email = email(field(|d| d.email.as_ref()), &mut problems);
    let state = state(doc.and_then(|d| d.state.as_ref()), table_at, &mut problems);
    let challenge = challenge(
        field(|d| d.challenge.as_ref()),
        table_at,
        args,
        &mut problems,
    );
    let ca_roots = ca_roots(doc.and_then(|d| d.ca_roots.as_ref()), &mut problems);
    let eab = eab(
        field(|d| d.eab_kid.as_ref()),
        field(|d| d.eab_hmac_key.as_ref()),
        &mut problems,
    );
    let key_file = key_file(args, table_at, &mut problems);

    if !problems.is_empty() {
        return Err(Problems(problems));
    }
    Ok(AcmeSettings {
        directory,
        email,
        state,
        challenge,
        ca_roots,
        ca_roots_file: doc
            .and_then(|d| d.ca_roots.as_ref())
            .map(|r| r.value.clone()),
        eab,
        key_file,
    })
}

/// `acme.directory`: the CA's directory URL (Let's Encrypt's by default).
fn directory(d: Option<&Located<String>>, problems: &mut Vec<Problem>) -> String {
    let Some(d) = d else {
        return LETS_ENCRYPT.to_string();
    };
    let host = d
        .value
        .strip_prefix("https://")
        .map(|rest| rest.split(['/', '?', '#']).next().unwrap_or_default());
    if host.is_none_or(|h| h.is_empty()) {
        problem(
            problems,
            Some(&d.at),
            format!(
                "acme.directory = {:?}: expected the CA's directory URL, https://HOST/…, \
                 e.g. {LETS_ENCRYPT:?} (the default)",
                d.value
            ),
        );
    }
    d.value.clone()
}

/// `acme.email`: one contact address (`mailto:` optional), or none.
fn email(e: Option<&Located<String>>, problems: &mut Vec<Problem>) -> Option<String> {
    let e = e?;
    let address = e.value.strip_prefix("mailto:").unwrap_or(&e.value);
    let ok = address
        .split_once('@')
        .is_some_and(|(user, host)| !user.is_empty() && host.contains('.') && !host.contains('@'))
        && !address.chars().any(|c| c.is_whitespace() || c == ',');
    if !ok {
        problem(
            problems,
            Some(&e.at),
            format!(
                "acme.email = {:?}: expected one address, e.g. \"ops@example.com\"",
                e.value
            ),
        );
    }
    Some(address.to_string())
}

/// `acme.state`: an absolute path to a directory closed to others (it holds private keys).
fn state(
    s: Option<&Located<PathBuf>>,
    table_at: Option<&Place>,
    problems: &mut Vec<Problem>,
) -> PathBuf {
    let state = match s {
        None => PathBuf::from(DEFAULT_STATE),
        Some(s) => {
            if !s.value.is_absolute() {
                problem(
                    problems,
                    Some(&s.at),
                    format!(
                        "acme.state = {:?}: give an absolute path, e.g. {DEFAULT_STATE:?} (the \
                         default)",
                        s.value.display().to_string()
                    ),
                );
            }
            s.value.clone()
        }
    };
    let state_at = s.map(|s| &s.at).or(table_at);
    match std::fs::metadata(&state) {
        Ok(m) if !m.is_dir() => problem(
            problems,
            state_at,
            format!(
                "acme.state = {}: not a directory; name a directory (made 0700 if missing)",
                state.display()
            ),
        ),
        Ok(m) if m.permissions().mode() & 0o077 != 0 => problem(
            problems,
            state_at,
            format!(
                "acme.state = {}: open to others (mode {:o}), and it holds the account's and \
                 sites' private keys: chmod 700 {}",
                state.display(),
                m.permissions().mode() & 0o7777,
                state.display()
            ),
        ),
        _ => {}
    }
    state
}

/// `acme.challenge`: which challenge, and the listener it is answered on must be there.
fn challenge(
    c: Option<&Located<String>>,
    table_at: Option<&Place>,
    args: &RunArgs,
    problems: &mut Vec<Problem>,
) -> ChallengeKind {
    let challenge = match c {
        None => ChallengeKind::TlsAlpn01,
        Some(c) => match c.value.as_str() {
            "tls-alpn-01" => ChallengeKind::TlsAlpn01,
            "http-01" => ChallengeKind::Http01,
            other => {
                problem(
                    problems,
                    Some(&c.at),
                    format!(
                        "acme.challenge = {other:?}: expected \"tls-alpn-01\" (the default: on \
                         the TCP listener) or \"http-01\" (on redirect_http)"
                    ),
                );
                ChallengeKind::TlsAlpn01
            }
        },
    };
    let challenge_at = c.map(|c| &c.at).or(table_at);
    match challenge {
        ChallengeKind::TlsAlpn01 if !args.tcp_on() => problem(
            problems,
            challenge_at,
            "acme.challenge = \"tls-alpn-01\" is answered on the TCP listener, but tcp is off: \
             drop tcp = \"off\", or use challenge = \"http-01\" with redirect_http"
                .into(),
        ),
        ChallengeKind::Http01 if args.plain_http().is_none() => problem(
            problems,
            challenge_at,
            "acme.challenge = \"http-01\" is answered on the plain-HTTP listener: set \
             redirect_http = \"0.0.0.0:80\" (port 80 for a public CA), or listen on port 443 \
             without redirect_http = \"off\" (port 80 is then served by itself)"
                .into(),
        ),
        _ => {}
    }
    challenge
}

/// `acme.ca_roots`: a PEM file of the roots to trust for the CA's HTTPS (DER each), or none.
fn ca_roots(r: Option<&Located<PathBuf>>, problems: &mut Vec<Problem>) -> Vec<Vec<u8>> {
    let Some(r) = r else {
        return Vec::new();
    };
    let read = crate::sys::read_operator_file(&r.value, crate::sys::MAX_PEM_FILE);
    match read.map(|f| CertificateDer::pem_slice_iter(&f.bytes).collect::<Result<Vec<_>, _>>()) {
        Err(e) => problem(
            problems,
            Some(&r.at),
            format!("acme.ca_roots = {}: cannot read it: {e}", r.value.display()),
        ),
        Ok(Err(e)) => problem(
            problems,
            Some(&r.at),
            format!(
                "acme.ca_roots = {}: not PEM certificates: {e}",
                r.value.display()
            ),
        ),
        Ok(Ok(certs)) if certs.is_empty() => problem(
            problems,
            Some(&r.at),
            format!(
                "acme.ca_roots = {}: no CERTIFICATE in it; give a PEM file of the roots to \
                 trust for the CA's HTTPS",
                r.value.display()
            ),
        ),
        Ok(Ok(certs)) => return certs.into_iter().map(|c| c.to_vec()).collect(),
    }
    Vec::new()
}

/// `acme.eab_kid` and `acme.eab_hmac_key`: the external account binding, both or neither.
fn eab(
    kid: Option<&Located<String>>,
    key: Option<&Located<String>>,
    problems: &mut Vec<Problem>,
) -> Option<Eab> {
    match (kid, key) {
        (None, None) => None,
        (Some(kid), Some(key)) => {
            match base64::engine::general_purpose::URL_SAFE_NO_PAD
                .decode(key.value.trim_end_matches('='))
            {
                Ok(hmac_key) if !hmac_key.is_empty() => Some(Eab {
                    kid: kid.value.clone(),
                    hmac_key,
                }),
                _ => {
                    problem(
                        problems,
                        Some(&key.at),
                        "acme.eab_hmac_key: expected the MAC key the CA gave, in base64url".into(),
                    );
                    None
                }
            }
        }
        (Some(one), None) | (None, Some(one)) => {
            problem(
                problems,
                Some(&one.at),
                "acme.eab_kid and acme.eab_hmac_key go together (external account binding): \
                 give both, as the CA gave them, or neither"
                    .into(),
            );
            None
        }
    }
}

/// The key file's secret the state's seals are derived from: the demux reads it, the engine
/// never.
fn key_file(
    args: &RunArgs,
    table_at: Option<&Place>,
    problems: &mut Vec<Problem>,
) -> Option<KeyFileSecret> {
    let path = args.key_file.as_ref()?;
    match crate::certs::load_key_file(path) {
        Ok(keys) => Some(KeyFileSecret::new(path.clone(), keys.to_bytes())),
        Err(e) => {
            problem(
                problems,
                table_at,
                format!("key_file: {e} (the ACME state's seals are derived from it)"),
            );
            None
        }
    }
}

/// The sites of `table` whose certificates come from ACME.
pub fn sites(table: &SiteTable) -> Vec<AcmeSite> {
    table
        .sites
        .iter()
        .enumerate()
        .filter(|(_, s)| s.acme)
        .map(|(i, s)| AcmeSite {
            site: i,
            label: s.label.clone(),
            names: s.names.clone(),
        })
        .collect()
}

/// Whether two checked `[acme]` tables say the same (a reload cannot change it: the engine
/// keeps its account and state directory for its life).
pub fn same(a: Option<&AcmeSettings>, b: Option<&AcmeSettings>) -> bool {
    match (a, b) {
        (None, None) => true,
        (Some(a), Some(b)) => {
            let eab =
                |s: &AcmeSettings| s.eab.as_ref().map(|e| (e.kid.clone(), e.hmac_key.clone()));
            a.directory == b.directory
                && a.email == b.email
                && a.state == b.state
                && a.challenge == b.challenge
                && a.ca_roots == b.ca_roots
                && eab(a) == eab(b)
                && a.key_file == b.key_file
        }
        _ => false,
    }
}
