//! Floods of well-formed messages, what a hostile worker sends to cost the demux its time and
//! the other instances their sessions: `stats-flood` (`STATS` reports with forged counters,
//! a series under a name of the demux's own and more series than the demux keeps, on
//! the control socket, as fast as the demux takes them, until `MARKER.done` exists) and
//! `session-flood` (once `MARKER.go` exists, [`SESSION_PUTS`] session-store PUTs under keys of
//! its own, more than the whole cache holds). Each writes what it sent to `MARKER.report`.
//! Sends block while the demux does not read: the flood goes as fast as the demux lets it.

use std::os::fd::{AsRawFd, OwnedFd};
use std::path::Path;
use std::time::{Duration, Instant};

use nix::sys::socket::MsgFlags;
use ringmux_proto::series::Series;
use ringmux_proto::session::{encode_request, Op};
use ringmux_proto::{Message, WorkerReport};

/// Distinct series of each `stats-flood` report beside its `requests` and `restarts`: with those,
/// more than the demux keeps of one worker (`ringmux_proto::series::MAX_SERIES`).
pub const FORGED_SERIES: usize = 300;

/// PUTs of `session-flood`: more than the 65 536 entries the demux's cache holds in all.
pub const SESSION_PUTS: u32 = 70_000;

/// How long a flood waits for its go, or runs without being told to stop.
const LIMIT: Duration = Duration::from_secs(60);

/// `STATS` with forged counters on `control` until `MARKER.done` exists (or [`LIMIT`]); the
/// number sent, as `stats-sent`.
pub fn stats(control: &OwnedFd, marker: &str) -> Vec<(&'static str, String)> {
    // Impossible values: more connections than a u32 counts, and requests by protocol whose
    // sum overflows a u64.
    let mut report = WorkerReport {
        connections_active: u64::MAX,
        connections_total: u64::MAX,
        requests_total: u64::MAX,
        pid: u64::from(std::process::id()),
        ..WorkerReport::default()
    };
    for protocol in ["h1", "h2", "h3"] {
        let _ = report.set_counter("requests", &[("protocol", protocol)], u64::MAX);
    }
    // Series the demux must refuse: one under a name of its own metrics, and more than it
    // keeps of one worker ([`FORGED_SERIES`] past the API's bound, put in the report by hand).
    let _ = report.set_counter("restarts", &[], u64::MAX);
    for i in 0..FORGED_SERIES {
        let series = Series::counter("zz_forged", &[("i", &format!("{i:04}"))]);
        report.series.insert(series.expect("a valid series"), 1);
    }
    let forged = Message::Stats(report).encode();
    let done = format!("{marker}.done");
    let end = Instant::now() + LIMIT;
    let mut sent = 0u64;
    while Instant::now() < end {
        // The file is looked at every thousand messages: the flood is the point.
        if sent.is_multiple_of(1000) && Path::new(&done).exists() {
            break;
        }
        if nix::sys::socket::send(control.as_raw_fd(), &forged, MsgFlags::MSG_NOSIGNAL).is_err() {
            break;
        }
        sent += 1;
    }
    vec![("stats-sent", sent.to_string())]
}

/// Once `MARKER.go` exists, [`SESSION_PUTS`] PUTs of distinct keys on `sessions`, replies left
/// unread; the number sent, as `session-puts`.
pub fn sessions(sessions: &OwnedFd, marker: &str) -> Vec<(&'static str, String)> {
    let go = format!("{marker}.go");
    let end = Instant::now() + LIMIT;
    while !Path::new(&go).exists() {
        if Instant::now() >= end {
            return vec![("session-puts", "no-go".to_string())];
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let mut sent = 0u32;
    for k in 0..SESSION_PUTS {
        let mut key = [0xf1u8; 32];
        key[..4].copy_from_slice(&k.to_be_bytes());
        let request = encode_request(Op::Put, u64::from(k), &key, &[0x5a; 64]);
        if nix::sys::socket::send(sessions.as_raw_fd(), &request, MsgFlags::MSG_NOSIGNAL).is_err() {
            break;
        }
        sent += 1;
    }
    vec![("session-puts", sent.to_string())]
}
