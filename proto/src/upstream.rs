//! `--upstream`: the HTTP/1.1 service ringmux's built-in worker proxies to, as the demux passes
//! it on that program's command line. Checked by the demux at start-up (so a bad value is an
//! error naming the flag) and again by the built-in worker when it parses its command line.

use http::uri::{Authority, Scheme};
use http::Uri;

/// `--upstream`: where the worker proxies to, and what is checked about it before starting.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UpstreamUrl {
    /// `HOST:PORT` (or `HOST`, port 80).
    pub authority: Authority,
}

impl std::fmt::Display for UpstreamUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "http://{}", self.authority)
    }
}

/// Why a text is not an `--upstream` URL. Each message names the text as given, and says what
/// is accepted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UpstreamError {
    /// Not a URI at all (what `http` found wrong in it, in words, follows the text).
    #[error("{given:?} is not a URL ({why}): expected http://HOST:PORT")]
    NotAUrl { given: String, why: String },
    #[error(
        "{given:?}: https upstreams are not supported; the upstream must speak plain HTTP/1.1 \
         (http://HOST:PORT)"
    )]
    Https { given: String },
    /// Another scheme, none, or no host part.
    #[error("{given:?}: expected http://HOST:PORT")]
    NotHttp { given: String },
    #[error("{given:?}: user information is not supported")]
    UserInfo { given: String },
    #[error("{given:?}: the host is empty")]
    EmptyHost { given: String },
    #[error(
        "{given:?}: a path or query is not supported; requests keep their own path \
         (http://HOST:PORT)"
    )]
    PathOrQuery { given: String },
}

impl UpstreamError {
    /// Why the text was refused, without the text: for a reader that names it itself (the
    /// configuration file's `upstream = "…": why`).
    pub fn why(&self) -> String {
        let text = self.to_string();
        let given = match self {
            UpstreamError::NotAUrl { given, .. }
            | UpstreamError::Https { given }
            | UpstreamError::NotHttp { given }
            | UpstreamError::UserInfo { given }
            | UpstreamError::EmptyHost { given }
            | UpstreamError::PathOrQuery { given } => format!("{given:?}"),
        };
        let rest = text.strip_prefix(&given).unwrap_or(&text);
        rest.strip_prefix(": ")
            .or_else(|| rest.strip_prefix(' '))
            .unwrap_or(rest)
            .to_string()
    }
}

impl std::str::FromStr for UpstreamUrl {
    type Err = UpstreamError;

    /// `http://HOST[:PORT]`, optionally with a trailing `/`. Refuses `https`, paths, queries and
    /// user information, saying why.
    fn from_str(s: &str) -> Result<Self, UpstreamError> {
        let given = || s.to_string();
        let uri: Uri = s
            .parse()
            .map_err(|e: http::uri::InvalidUri| UpstreamError::NotAUrl {
                given: given(),
                why: e.to_string(),
            })?;
        match uri.scheme() {
            Some(sch) if *sch == Scheme::HTTP => {}
            Some(sch) if *sch == Scheme::HTTPS => {
                return Err(UpstreamError::Https { given: given() })
            }
            _ => return Err(UpstreamError::NotHttp { given: given() }),
        }
        let Some(authority) = uri.authority().cloned() else {
            return Err(UpstreamError::NotHttp { given: given() });
        };
        if authority.as_str().contains('@') {
            return Err(UpstreamError::UserInfo { given: given() });
        }
        if authority.host().is_empty() {
            return Err(UpstreamError::EmptyHost { given: given() });
        }
        if !matches!(uri.path(), "" | "/") || uri.query().is_some() {
            return Err(UpstreamError::PathOrQuery { given: given() });
        }
        Ok(UpstreamUrl { authority })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn upstream_urls_are_checked() {
        let ok: UpstreamUrl = "http://127.0.0.1:8080".parse().unwrap();
        assert_eq!(ok.authority.as_str(), "127.0.0.1:8080");
        let ok: UpstreamUrl = "http://[::1]:80/".parse().unwrap();
        assert_eq!(ok.authority.port_u16(), Some(80));
        for (bad, says) in [
            ("https://example.com", "https upstreams are not supported"),
            ("127.0.0.1:8080", "expected http://HOST:PORT"),
            ("http://u:p@host:1", "user information"),
            ("http://host:1/api", "a path or query is not supported"),
            ("http://host:1/?x=1", "a path or query is not supported"),
            ("ftp://host", "expected http://HOST:PORT"),
            ("http://", "not a URL"),
        ] {
            let e = bad.parse::<UpstreamUrl>().unwrap_err().to_string();
            assert!(e.contains(says), "{bad}: {e}");
            assert!(e.contains(bad), "{bad}: the message names the value: {e}");
            let why = bad.parse::<UpstreamUrl>().unwrap_err().why();
            assert!(
                why.contains(says) && !why.contains(&format!("{bad:?}")),
                "{bad}: {why}"
            );
        }
    }

    #[test]
    fn display_round_trips() {
        let u: UpstreamUrl = "http://localhost:8080/".parse().unwrap();
        assert_eq!(u.to_string(), "http://localhost:8080");
        assert_eq!(u.to_string().parse::<UpstreamUrl>().unwrap(), u);
    }
}
