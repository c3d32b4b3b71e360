//! What a request names, whatever the transport: its authority, its path with another in its
//! place, and its path cleaned into a relative path under a document root. Pure functions over
//! `http` types; every front (`h3`, `tcp`, `redirect`) and the core's answers use them.
//!
//! This module imports nothing of the crate: it sits at the bottom of the server.

use std::borrow::Cow;

use http::header;

/// The authority a request names: its URI's (HTTP/2, HTTP/3 `:authority`), else its `host`
/// field (HTTP/1.1).
pub(crate) fn authority_of(parts: &http::request::Parts) -> Option<&str> {
    parts.uri.authority().map(|a| a.as_str()).or_else(|| {
        parts
            .headers
            .get(header::HOST)
            .and_then(|h| h.to_str().ok())
    })
}

/// `uri` with its path and query replaced by `path`.
pub(crate) fn with_path(uri: &http::Uri, path: http::uri::PathAndQuery) -> http::Uri {
    let mut parts = uri.clone().into_parts();
    parts.path_and_query = Some(path);
    // Only the path changed, to another that parsed: the parts make a URI again.
    http::Uri::from_parts(parts).unwrap_or_else(|_| uri.clone())
}

/// The request path as a relative path of plain components joined by `/` (`""` for the
/// root), or `None` if it could name anything outside the root or something other than the
/// client meant. Each segment is percent-decoded (RFC 3986 §2.1); `.` and empty segments are
/// dropped; `..`, and segments that decode to something holding `/`, NUL or a backslash, or to
/// invalid UTF-8, refuse the whole path.
pub(crate) fn clean_path(path: &str) -> Option<Cow<'_, str>> {
    let rest = path.strip_prefix('/')?;
    // The common case, a path that is already plain (no escapes, no empty, `.` or `..`
    // segment), is returned as it stands, without a copy.
    let trimmed = rest.strip_suffix('/').unwrap_or(rest);
    if !trimmed.contains(['%', '\0', '\\'])
        && (trimmed.is_empty()
            || trimmed
                .split('/')
                .all(|s| !s.is_empty() && s != "." && s != ".."))
    {
        return Some(Cow::Borrowed(trimmed));
    }
    decoded_path(path).map(Cow::Owned)
}

/// [`clean_path`] the long way: every segment decoded and checked, the result built anew.
fn decoded_path(path: &str) -> Option<String> {
    if !path.starts_with('/') {
        return None;
    }
    let mut rel = String::with_capacity(path.len());
    for raw in path.split('/') {
        let seg = percent_decode(raw)?;
        match &*seg {
            "" | "." => continue,
            ".." => return None,
            s if s.contains(['/', '\0', '\\']) => return None,
            _ => {}
        }
        if !rel.is_empty() {
            rel.push('/');
        }
        rel.push_str(&seg);
    }
    Some(rel)
}

/// `%XX` escapes decoded; `None` for a bad escape or a result that is not UTF-8.
fn percent_decode(s: &str) -> Option<Cow<'_, str>> {
    if !s.contains('%') {
        return Some(Cow::Borrowed(s));
    }
    let mut out = Vec::with_capacity(s.len());
    let mut bytes = s.bytes();
    while let Some(b) = bytes.next() {
        if b != b'%' {
            out.push(b);
            continue;
        }
        let hi = (bytes.next()? as char).to_digit(16)?;
        let lo = (bytes.next()? as char).to_digit(16)?;
        out.push((hi * 16 + lo) as u8);
    }
    String::from_utf8(out).ok().map(Cow::Owned)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clean_paths_taken_as_they_stand_are_what_decoding_would_give() {
        // Every path of up to four segments drawn from these, with and without a trailing
        // slash: the borrowed shortcut must agree with the long way on each.
        let parts = [
            "", ".", "..", "a", "b.txt", "%41", "%2e", "a%2Fb", "x\\y", "%",
        ];
        let mut paths = vec![String::new()];
        for _ in 0..4 {
            let longer: Vec<String> = paths
                .iter()
                .flat_map(|p| parts.iter().map(move |s| format!("{p}/{s}")))
                .collect();
            paths.extend(longer);
        }
        let mut borrowed = 0;
        for p in paths.iter().flat_map(|p| [p.clone(), format!("{p}/")]) {
            let fast = clean_path(&p);
            borrowed += usize::from(matches!(fast, Some(Cow::Borrowed(_))));
            assert_eq!(fast.as_deref(), decoded_path(&p).as_deref(), "{p:?}");
        }
        assert!(borrowed > 100, "the shortcut was taken {borrowed} times");
    }

    #[test]
    fn clean_path_refuses_escapes() {
        assert_eq!(clean_path("/a/b.txt").as_deref(), Some("a/b.txt"));
        assert_eq!(clean_path("/a//./b").as_deref(), Some("a/b"));
        assert_eq!(clean_path("/").as_deref(), Some(""));
        assert_eq!(clean_path("/sub/").as_deref(), Some("sub"));
        assert_eq!(clean_path("/my%20file.txt").as_deref(), Some("my file.txt"));
        assert_eq!(clean_path("/%2e/x").as_deref(), Some("x"));
        assert_eq!(clean_path("/caf%C3%A9").as_deref(), Some("café"));
        for bad in [
            "/../etc/passwd",
            "/a/../../b",
            "/%2e%2e/x",
            "/%2E%2E%2Fetc%2Fpasswd",
            "/..%2fetc/passwd",
            "/a%2fb",
            "/a%00",
            "/a%5c..",
            "/a%zz",
            "/a%2",
            "/%ff",
            "relative",
            "/a\\..\\b",
            "/a\0",
        ] {
            assert_eq!(clean_path(bad), None, "{bad:?}");
        }
    }
}
