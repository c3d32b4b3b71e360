//! The access log's other formats (`--access-log-format`): `combined`, the line of Apache and
//! nginx that GoAccess, fail2ban and log pipelines read, and `json`, one object per line with
//! every field. What comes from the client (path, authority, user agent, referer, and the
//! rest) is escaped so that no request can end a line or forge a field: `combined` writes `"`,
//! `\` and every byte outside printable ASCII as `\xHH`, as nginx does; `json` escapes as JSON
//! does (RFC 8259 §7), control characters (and DEL) as `\u00XX`.

use std::fmt::Write as _;
use std::time::SystemTime;

use super::line::{civil_from_days, rfc3339_millis, Entry, MAX_AUTHORITY, MAX_PATH};

/// The longest user agent or referer written, in bytes.
const MAX_FIELD: usize = 1024;

/// The status a line without a response says: nginx's 499 (the client closed the request).
const NO_RESPONSE: u16 = 499;

/// `e` as Apache's and nginx's combined line: `client - - [time] "METHOD PATH PROTOCOL"
/// STATUS BYTES "REFERER" "USER-AGENT"`, newline included.
pub(super) fn combined(e: &Entry<'_>) -> String {
    let mut line = String::with_capacity(160 + e.path.len().min(MAX_PATH));
    let _ = write!(line, "{} - - [", e.client.ip());
    common_log_time(e.time, &mut line);
    line.push_str("] \"");
    nginx_escaped(e.method, 32, &mut line);
    line.push(' ');
    nginx_escaped(e.path, MAX_PATH, &mut line);
    let protocol = match e.protocol {
        "h1" => "HTTP/1.1",
        "h2" => "HTTP/2.0",
        _ => "HTTP/3.0",
    };
    let status = e.status.unwrap_or(NO_RESPONSE);
    let _ = write!(line, " {protocol}\" {status} {} \"", e.bytes);
    nginx_escaped(e.referer.unwrap_or("-"), MAX_FIELD, &mut line);
    line.push_str("\" \"");
    nginx_escaped(e.user_agent.unwrap_or("-"), MAX_FIELD, &mut line);
    line.push_str("\"\n");
    line
}

/// `e` as one JSON object, newline included.
pub(super) fn json(e: &Entry<'_>, instance: u8) -> String {
    let mut line = String::with_capacity(320 + e.path.len().min(MAX_PATH));
    let (path, query) = match e.path.split_once('?') {
        Some((p, q)) => (p, Some(q)),
        None => (e.path, None),
    };
    line.push_str("{\"time\":\"");
    rfc3339_millis(e.time, &mut line);
    let _ = write!(
        line,
        "\",\"client\":\"{}\",\"protocol\":\"{}\"",
        e.client, e.protocol
    );
    let text = |key: &str, v: Option<&str>, max: usize, line: &mut String| {
        let _ = write!(line, ",\"{key}\":");
        match v {
            Some(v) => {
                line.push('"');
                json_escaped(v, max, line);
                line.push('"');
            }
            None => line.push_str("null"),
        }
    };
    text("method", Some(e.method), 32, &mut line);
    text("authority", e.authority, MAX_AUTHORITY, &mut line);
    text("path", Some(path), MAX_PATH, &mut line);
    text("query", query, MAX_PATH, &mut line);
    match e.status {
        Some(s) => {
            let _ = write!(line, ",\"status\":{s}");
        }
        None => line.push_str(",\"status\":null"),
    }
    let _ = write!(
        line,
        ",\"bytes\":{},\"duration\":{:.6}",
        e.bytes,
        e.duration.as_secs_f64()
    );
    text("site", e.site, MAX_AUTHORITY, &mut line);
    text("route", e.route, MAX_PATH, &mut line);
    text("sni", e.sni, MAX_AUTHORITY, &mut line);
    text("user_agent", e.user_agent, MAX_FIELD, &mut line);
    text("referer", e.referer, MAX_FIELD, &mut line);
    if let Some(received) = e.received {
        // A tunnel's: the bytes that came from the client (`bytes` went to it).
        let _ = write!(line, ",\"received\":{received}");
    }
    let _ = writeln!(
        line,
        ",\"instance\":{instance},\"ending\":\"{}\"}}",
        e.ending.as_str()
    );
    line
}

/// `s`, cut at `max` bytes, with `"`, `\` and bytes outside printable ASCII as `\xHH` (nginx's
/// escaping of variables in `log_format`).
fn nginx_escaped(s: &str, max: usize, out: &mut String) {
    for &b in s.as_bytes().iter().take(max) {
        if (b.is_ascii_graphic() || b == b' ') && b != b'"' && b != b'\\' {
            out.push(char::from(b));
        } else {
            let _ = write!(out, "\\x{b:02X}");
        }
    }
}

/// `s`, cut at `max` bytes (at a character's bound), escaped as a JSON string's content.
fn json_escaped(s: &str, max: usize, out: &mut String) {
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    for c in s[..end].chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c < ' ' || c == '\u{7f}' || ('\u{80}'..='\u{9f}').contains(&c) => {
                let _ = write!(out, "\\u{:04x}", u32::from(c));
            }
            '\u{2028}' | '\u{2029}' => {
                let _ = write!(out, "\\u{:04x}", u32::from(c));
            }
            c => out.push(c),
        }
    }
}

/// `t` as the common log format's `DD/Mon/YYYY:hh:mm:ss +0000` (UTC).
fn common_log_time(t: SystemTime, out: &mut String) {
    const MONTHS: [&str; 12] = [
        "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
    ];
    let secs = t
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs() as i64;
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    let (y, m, d) = civil_from_days(days);
    let month = MONTHS[(m as usize).saturating_sub(1) % 12];
    let _ = write!(
        out,
        "{d:02}/{month}/{y:04}:{:02}:{:02}:{:02} +0000",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    );
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::super::line::Ending;
    use super::*;

    fn entry<'a>(ua: &'a str) -> Entry<'a> {
        Entry {
            time: SystemTime::UNIX_EPOCH + Duration::from_millis(1_796_518_923_456),
            client: "192.0.2.7:50123".parse().unwrap(),
            protocol: "h2",
            method: "GET",
            authority: Some("example.com"),
            path: "/a?x=1",
            status: Some(200),
            bytes: 5120,
            duration: Duration::from_micros(312),
            site: Some("example.com"),
            ending: Ending::Ok,
            route: Some("/"),
            sni: Some("example.com"),
            user_agent: Some(ua),
            referer: None,
            received: None,
        }
    }

    #[test]
    fn a_combined_line_escapes_quotes_and_control_bytes_as_nginx() {
        let line = combined(&entry("a \"b\" \\c\nd"));
        assert_eq!(
            line,
            "192.0.2.7 - - [06/Dec/2026:01:02:03 +0000] \"GET /a?x=1 HTTP/2.0\" 200 5120 \
             \"-\" \"a \\x22b\\x22 \\x5Cc\\x0Ad\"\n"
        );
    }

    #[test]
    fn a_json_line_escapes_what_would_end_it() {
        let line = json(&entry("q\"\\\n\u{1}\u{2028}é"), 1);
        assert_eq!(line.matches('\n').count(), 1, "{line}");
        assert!(
            line.contains(r#""user_agent":"q\"\\\n\u0001\u2028é""#),
            "{line}"
        );
        assert!(
            line.contains(r#""path":"/a","query":"x=1","status":200"#),
            "{line}"
        );
        assert!(
            line.ends_with(",\"instance\":1,\"ending\":\"ok\"}\n"),
            "{line}"
        );
    }
}
