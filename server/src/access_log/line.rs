//! ringmux's own line (`--access-log-format ringmux`, the default) and what every format
//! writes from: [`Entry`] and [`Ending`].

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::time::{Duration, SystemTime};

/// Most bytes one `write` carries (the atomic size of a pipe write, `PIPE_BUF`); every line
/// fits in one.
pub const BATCH_BYTES: usize = 4096;

pub(super) const MAX_AUTHORITY: usize = 256;
pub(super) const MAX_PATH: usize = 2048;

/// How a request ended: the line's last field.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Ending {
    /// The whole response went out.
    Ok,
    /// The worker was told to cut what it still served (`ringmux --grace` over, or its
    /// generation made room for a newer one: `--max-draining`).
    CutDrain,
    /// The client reset or stopped the stream, or closed the connection.
    CutClient,
    /// The connection timed out (no answer from the client within the idle timeout).
    CutTimeout,
    /// The worker exited for another reason (the demux went away) with the request in flight.
    CutWorkerExit,
    /// The server could not go on: reading the file failed, or it changed size while sent.
    CutError,
}

impl Ending {
    /// The word in the line.
    pub fn as_str(self) -> &'static str {
        match self {
            Ending::Ok => "ok",
            Ending::CutDrain => "cut:drain",
            Ending::CutClient => "cut:client",
            Ending::CutTimeout => "cut:timeout",
            Ending::CutWorkerExit => "cut:worker-exit",
            Ending::CutError => "cut:error",
        }
    }
}

/// What one line says.
#[derive(Debug, Clone)]
pub struct Entry<'a> {
    /// When the request head arrived.
    pub time: SystemTime,
    pub client: SocketAddr,
    /// `h1`, `h2` or `h3`.
    pub protocol: &'static str,
    pub method: &'a str,
    pub authority: Option<&'a str>,
    pub path: &'a str,
    /// `None`: no response went out.
    pub status: Option<u16>,
    pub bytes: u64,
    pub duration: Duration,
    /// The site's label; `None` (written `-`): no site answered, or the router names none.
    pub site: Option<&'a str>,
    /// How it ended.
    pub ending: Ending,
    /// The prefix of the route that answered, if one did.
    pub route: Option<&'a str>,
    /// The TLS server name of the request's connection, if any.
    pub sni: Option<&'a str>,
    pub user_agent: Option<&'a str>,
    pub referer: Option<&'a str>,
    /// A tunnel's line only (a WebSocket through the proxy): the bytes received from the
    /// client, written as one more field after the ending.
    pub received: Option<u64>,
}

/// The line of `e`, newline included.
pub(super) fn format_line(e: &Entry<'_>, instance: u8) -> String {
    let mut line = String::with_capacity(128 + e.path.len().min(MAX_PATH));
    rfc3339_millis(e.time, &mut line);
    let _ = write!(line, " {} {} ", e.client, e.protocol);
    escaped(e.method, 32, &mut line);
    line.push(' ');
    match e.authority {
        Some(a) if !a.is_empty() => escaped(a, MAX_AUTHORITY, &mut line),
        _ => line.push('-'),
    }
    line.push(' ');
    escaped(e.path, MAX_PATH, &mut line);
    match e.status {
        Some(s) => {
            let _ = write!(line, " {s}");
        }
        None => line.push_str(" -"),
    }
    let _ = write!(
        line,
        " {} {:.6} {}",
        e.bytes,
        e.duration.as_secs_f64(),
        instance
    );
    // Always a field, so every line has as many (tools split on spaces): `-` for no site.
    line.push(' ');
    match e.site {
        Some(site) => escaped(site, MAX_AUTHORITY, &mut line),
        None => line.push('-'),
    }
    line.push(' ');
    line.push_str(e.ending.as_str());
    if let Some(n) = e.received {
        let _ = write!(line, " {n}");
    }
    line.push('\n');
    line
}

/// `s` with bytes outside printable ASCII, spaces and `%` as `%XX`, cut at `max` bytes of input.
fn escaped(s: &str, max: usize, out: &mut String) {
    for &b in s.as_bytes().iter().take(max) {
        if b.is_ascii_graphic() && b != b'%' {
            out.push(char::from(b));
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
}

/// `t` as `YYYY-MM-DDThh:mm:ss.mmmZ` (UTC).
pub(super) fn rfc3339_millis(t: SystemTime, out: &mut String) {
    let since = t.duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default();
    let secs = since.as_secs() as i64;
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    let (y, m, d) = civil_from_days(days);
    let _ = write!(
        out,
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        since.subsec_millis()
    );
}

/// The proleptic Gregorian date of `days` since 1970-01-01 (Howard Hinnant's algorithm,
/// "chrono-Compatible Low-Level Date Algorithms").
pub(super) fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates_are_gregorian() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(-1), (1969, 12, 31));
        assert_eq!(civil_from_days(11_016), (2000, 2, 29));
        assert_eq!(civil_from_days(11_017), (2000, 3, 1));
        assert_eq!(civil_from_days(20_793), (2026, 12, 6));
        let mut s = String::new();
        rfc3339_millis(
            SystemTime::UNIX_EPOCH + Duration::from_millis(1_796_518_923_456),
            &mut s,
        );
        assert_eq!(s, "2026-12-06T01:02:03.456Z");
    }

    #[test]
    fn every_control_byte_c1_as_utf8_included_is_escaped() {
        let mut out = String::new();
        // C0, DEL, U+0085 (next line) and U+009B (CSI) as UTF-8, a line separator, a newline.
        escaped("a\r\u{7f}\u{85}\u{9b}31m\u{2028}\nb", 100, &mut out);
        assert_eq!(out, "a%0D%7F%C2%85%C2%9B31m%E2%80%A8%0Ab");
        assert!(out.bytes().all(|b| b.is_ascii_graphic()), "{out}");
    }

    #[test]
    fn a_line_has_every_field_and_escapes_what_is_not_printable() {
        let e = Entry {
            time: SystemTime::UNIX_EPOCH + Duration::from_millis(1_796_518_923_456),
            client: "192.0.2.7:50123".parse().unwrap(),
            protocol: "h2",
            method: "GET",
            authority: Some("example.com"),
            path: "/a b%\u{1}/é?x=1",
            status: Some(200),
            bytes: 5120,
            duration: Duration::from_micros(312),
            site: None,
            ending: Ending::Ok,
            route: None,
            sni: None,
            user_agent: None,
            referer: None,
            received: None,
        };
        assert_eq!(
            format_line(&e, 1),
            "2026-12-06T01:02:03.456Z 192.0.2.7:50123 h2 GET example.com \
             /a%20b%25%01/%C3%A9?x=1 200 5120 0.000312 1 - ok\n"
        );
        // With sites, the label comes last, after the fields above, escaped as they are.
        let with_site = format_line(
            &Entry {
                site: Some("a b.example"),
                ..e.clone()
            },
            1,
        );
        assert_eq!(
            with_site,
            "2026-12-06T01:02:03.456Z 192.0.2.7:50123 h2 GET example.com \
             /a%20b%25%01/%C3%A9?x=1 200 5120 0.000312 1 a%20b.example ok\n"
        );
        let no_site = format_line(
            &Entry {
                site: Some("-"),
                ..e.clone()
            },
            1,
        );
        assert!(no_site.ends_with(" 0.000312 1 - ok\n"), "{no_site}");
        // A cut request says how, last.
        let cut = format_line(
            &Entry {
                status: None,
                ending: Ending::CutDrain,
                ..e.clone()
            },
            1,
        );
        assert!(cut.ends_with(" - 5120 0.000312 1 - cut:drain\n"), "{cut}");
        // A tunnel's line: the bytes from the client, after the ending.
        let tunnel = format_line(
            &Entry {
                status: Some(101),
                received: Some(77),
                ..e.clone()
            },
            1,
        );
        assert!(
            tunnel.ends_with(" 101 5120 0.000312 1 - ok 77\n"),
            "{tunnel}"
        );
        let e = Entry {
            authority: None,
            status: None,
            path: &format!("/{}", "x".repeat(5000)),
            ..e
        };
        let line = format_line(&e, 0);
        assert!(line.contains(" h2 GET - /xxx"), "{line}");
        assert!(line.ends_with(" - 5120 0.000312 0 - ok\n"), "{line}");
        assert!(line.len() < BATCH_BYTES, "{}", line.len());
    }
}
