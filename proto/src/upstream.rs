//! `--upstream`: the HTTP service ringmux's built-in worker proxies to, as the demux passes
//! it on that program's command line and a route's `upstream` writes it. Checked by the demux
//! at start-up (so a bad value is an error naming the flag or key) and again by the built-in
//! worker when it parses its command line or the site table.
//!
//! The scheme says how the backend is reached ([`UpstreamScheme`]): HTTP/1.1 in the clear
//! (`http://`) or over TLS (`https://`), HTTP/2 with prior knowledge in the clear (`h2c://`,
//! RFC 9113 §3.3) or over TLS with ALPN `h2` (`h2://`, RFC 9113 §3.2). What a TLS backend is
//! verified against is the route's ([`crate::route::UpstreamTls`]).

use http::uri::Authority;
use http::Uri;

/// `--upstream`: where the worker proxies to, and what is checked about it before starting.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct UpstreamUrl {
    /// How the backend is reached.
    pub scheme: UpstreamScheme,
    /// `HOST:PORT` (or `HOST`: port 80 in the clear, 443 over TLS).
    pub authority: Authority,
}

/// How a backend is reached: the scheme of its URL.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum UpstreamScheme {
    /// HTTP/1.1 over TCP.
    Http,
    /// HTTP/1.1 over TLS.
    Https,
    /// HTTP/2 over TCP with prior knowledge (RFC 9113 §3.3): gRPC in the clear.
    H2c,
    /// HTTP/2 over TLS, ALPN `h2` (RFC 9113 §3.2).
    H2,
}

impl UpstreamScheme {
    /// Every scheme, as a URL writes it.
    pub const ALL: [(UpstreamScheme, &'static str); 4] = [
        (UpstreamScheme::Http, "http"),
        (UpstreamScheme::Https, "https"),
        (UpstreamScheme::H2c, "h2c"),
        (UpstreamScheme::H2, "h2"),
    ];

    /// The scheme as a URL writes it.
    pub fn as_str(self) -> &'static str {
        Self::ALL[self as usize].1
    }

    /// Whether the backend is reached over TLS.
    pub fn tls(self) -> bool {
        matches!(self, UpstreamScheme::Https | UpstreamScheme::H2)
    }

    /// Whether the backend speaks HTTP/2 (only).
    pub fn http2(self) -> bool {
        matches!(self, UpstreamScheme::H2c | UpstreamScheme::H2)
    }
}

impl UpstreamUrl {
    /// The host without brackets (an IPv6 address as its text), for TLS's server name.
    pub fn host(&self) -> &str {
        let host = self.authority.host();
        host.strip_prefix('[')
            .and_then(|h| h.strip_suffix(']'))
            .unwrap_or(host)
    }
}

impl std::fmt::Display for UpstreamUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}://{}", self.scheme.as_str(), self.authority)
    }
}

/// Why a text is not an `--upstream` URL. Each message names the text as given, and says what
/// is accepted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UpstreamError {
    /// Not a URI at all (what `http` found wrong in it, in words, follows the text).
    #[error("{given:?} is not a URL ({why}): expected {EXPECTED}")]
    NotAUrl { given: String, why: String },
    /// Another scheme, none, or no host part.
    #[error("{given:?}: expected {EXPECTED}")]
    Scheme { given: String },
    #[error("{given:?}: user information is not supported")]
    UserInfo { given: String },
    #[error("{given:?}: the host is empty")]
    EmptyHost { given: String },
    #[error(
        "{given:?}: a path or query is not supported; requests keep their own path \
         (SCHEME://HOST:PORT)"
    )]
    PathOrQuery { given: String },
}

/// What an upstream URL may be, in the refusals' words.
const EXPECTED: &str = "http://HOST:PORT, https://HOST:PORT, h2c://HOST:PORT (HTTP/2 in the \
                        clear) or h2://HOST:PORT (HTTP/2 over TLS)";

impl UpstreamError {
    /// Why the text was refused, without the text: for a reader that names it itself (the
    /// configuration file's `upstream = "…": why`).
    pub fn why(&self) -> String {
        let text = self.to_string();
        let given = match self {
            UpstreamError::NotAUrl { given, .. }
            | UpstreamError::Scheme { given }
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

    /// `SCHEME://HOST[:PORT]` ([`UpstreamScheme`]), optionally with a trailing `/`. Refuses
    /// other schemes, paths, queries and user information, saying why.
    fn from_str(s: &str) -> Result<Self, UpstreamError> {
        let given = || s.to_string();
        let uri: Uri = s
            .parse()
            .map_err(|e: http::uri::InvalidUri| UpstreamError::NotAUrl {
                given: given(),
                why: e.to_string(),
            })?;
        let scheme = uri
            .scheme_str()
            .and_then(|sch| {
                UpstreamScheme::ALL
                    .iter()
                    .find(|(_, name)| sch.eq_ignore_ascii_case(name))
            })
            .map(|(scheme, _)| *scheme)
            .ok_or_else(|| UpstreamError::Scheme { given: given() })?;
        let Some(authority) = uri.authority().cloned() else {
            return Err(UpstreamError::Scheme { given: given() });
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
        Ok(UpstreamUrl { scheme, authority })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn upstream_urls_are_checked() {
        let ok: UpstreamUrl = "http://127.0.0.1:8080".parse().unwrap();
        assert_eq!(ok.authority.as_str(), "127.0.0.1:8080");
        assert_eq!(ok.scheme, UpstreamScheme::Http);
        let ok: UpstreamUrl = "http://[::1]:80/".parse().unwrap();
        assert_eq!(ok.authority.port_u16(), Some(80));
        assert_eq!(ok.host(), "::1");
        for (text, scheme, tls, http2) in [
            ("https://example.com", UpstreamScheme::Https, true, false),
            ("h2c://127.0.0.1:50051", UpstreamScheme::H2c, false, true),
            ("H2://grpc.internal:443/", UpstreamScheme::H2, true, true),
        ] {
            let u: UpstreamUrl = text.parse().unwrap();
            assert_eq!(
                (u.scheme, u.scheme.tls(), u.scheme.http2()),
                (scheme, tls, http2)
            );
        }
        for (bad, says) in [
            ("127.0.0.1:8080", "expected http://HOST:PORT, https://"),
            ("http://u:p@host:1", "user information"),
            ("http://host:1/api", "a path or query is not supported"),
            ("http://host:1/?x=1", "a path or query is not supported"),
            ("ftp://host", "expected http://HOST:PORT"),
            ("h3://host", "h2://HOST:PORT (HTTP/2 over TLS)"),
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
        for (given, shown) in [
            ("http://localhost:8080/", "http://localhost:8080"),
            ("HTTPS://a.test", "https://a.test"),
            ("h2c://[::1]:9", "h2c://[::1]:9"),
            ("h2://a.test:8443", "h2://a.test:8443"),
        ] {
            let u: UpstreamUrl = given.parse().unwrap();
            assert_eq!(u.to_string(), shown);
            assert_eq!(u.to_string().parse::<UpstreamUrl>().unwrap(), u);
        }
    }
}
