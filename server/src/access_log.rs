//! The access log (`ringmux --access-log PATH|stderr`): one line per request, over TCP and
//! HTTP/3, written off the request path.
//!
//! A request formats its line and hands it to a bounded queue ([`QUEUE_LINES`]); a thread of its
//! own writes what is queued, a whole number of lines per `write` and at most [`BATCH_BYTES`]
//! at once, so that the lines of the workers sharing the file (opened for appending) or
//! standard error (a pipe: writes of up to 4096 bytes are atomic) never interleave. A request
//! never waits: when the queue is full its line is dropped and counted
//! ([`AccessLog::dropped`], `ringmux_worker_access_log_dropped_total`).
//!
//! A line, fields separated by one space:
//!
//! ```text
//! 2026-12-06T01:02:03.456Z 192.0.2.7:50123 h3 GET example.com /index.html 200 5120 0.000312 1 example.com ok
//! ```
//!
//! time (UTC, milliseconds), client address and port, protocol (`h1`, `h2`, `h3`), method,
//! authority (`-` when the request named none), path with query, status (`-` when no response
//! went out: the client went away, or the exchange broke off before the head), response body
//! bytes sent, duration in seconds, instance, the site's label (`default` for the command
//! line's site, `-` for a request no site answered; [`Entry::site`] says when a line has none),
//! and last how the request ended ([`Ending`]: `ok`, or `cut:` and why). The new fields come
//! last, so a parser of older lines reads the fields before them as ever. Bytes outside
//! printable ASCII, and spaces, are written as `%XX`; an authority is cut at 256 bytes, a path
//! at 2048 and a label at 256.
//!
//! Every request has its line, a cut one too: a request whose task is dropped before it ended
//! (its connection closed, the worker told to cut) writes its line as it drops, with the
//! status and the bytes sent so far.
//!
//! The duration runs from the request head to the moment the last byte of the response left
//! the worker's hands: over HTTP/3 when the stream was finished (every byte handed to QUIC,
//! whose send buffer is bounded by the client's flow-control window), over TCP when hyper took
//! the body's last frame to write to the socket (so at most a socket send buffer, plus TLS
//! records, is still on its way); what the kernel then holds, and the client's acknowledgement,
//! are not in it (as nginx's `$request_time` ends at the last byte written to the socket).

use std::io::Write as _;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender, TrySendError};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use http::{Method, StatusCode};
use tracing::warn;

use crate::request::authority_of;

mod formats;
mod line;
pub use line::{Ending, Entry, BATCH_BYTES};
pub use ringmux_proto::serve::LogFormat;

/// Lines a worker may have waiting to be written; one more is dropped.
pub const QUEUE_LINES: usize = 16 * 1024;

/// One worker's access log: the queue and its writer thread.
#[derive(Debug)]
pub struct AccessLog {
    tx: SyncSender<String>,
    instance: u8,
    format: LogFormat,
    counts: Arc<Counts>,
    /// 0, or the [`Ending`] of every request the worker itself ends from now on
    /// ([`AccessLog::ending_all`]).
    ending_all: AtomicU8,
}

#[derive(Debug, Default)]
struct Counts {
    queued: AtomicU64,
    written: AtomicU64,
    dropped: AtomicU64,
    /// Of `dropped`, lines whose write failed.
    failed: AtomicU64,
    /// A write failed and was logged; cleared by the next that succeeds.
    failing: AtomicBool,
}

impl AccessLog {
    /// Starts the writer thread on `out` (opened for appending, or a pipe) for instance
    /// `instance`'s lines, each in `format`.
    pub fn start(
        out: std::fs::File,
        instance: u8,
        format: LogFormat,
    ) -> std::io::Result<Arc<AccessLog>> {
        let (tx, rx) = mpsc::sync_channel(QUEUE_LINES);
        let counts = Arc::new(Counts::default());
        let c = counts.clone();
        std::thread::Builder::new()
            .name("access-log".into())
            .spawn(move || write_lines(out, rx, &c))?;
        Ok(Arc::new(AccessLog {
            tx,
            instance,
            format,
            counts,
            ending_all: AtomicU8::new(0),
        }))
    }

    /// The worker is about to end every request in flight (told to cut: [`Ending::CutDrain`];
    /// exiting for another reason: [`Ending::CutWorkerExit`]): each one's line says `how`,
    /// whatever else broke it off as it went. The first reason given stays.
    pub fn ending_all(&self, how: Ending) {
        let _ = self.ending_all.compare_exchange(
            0,
            how as u8 + 1,
            Ordering::Relaxed,
            Ordering::Relaxed,
        );
    }

    /// How a request that broke off ended: as [`AccessLog::ending_all`] said, or `otherwise`.
    pub fn cut_as(&self, otherwise: Ending) -> Ending {
        match self.ending_all.load(Ordering::Relaxed) {
            0 => otherwise,
            v => [
                Ending::Ok,
                Ending::CutDrain,
                Ending::CutClient,
                Ending::CutTimeout,
                Ending::CutWorkerExit,
                Ending::CutError,
            ]
            .get(usize::from(v - 1))
            .copied()
            .unwrap_or(otherwise),
        }
    }

    /// Queues the line of `e`; drops and counts it if the queue is full.
    pub fn record(&self, e: &Entry<'_>) {
        let line = match self.format {
            LogFormat::Ringmux => line::format_line(e, self.instance),
            LogFormat::Combined => formats::combined(e),
            LogFormat::Json => formats::json(e, self.instance),
        };
        match self.tx.try_send(line) {
            Ok(()) => {
                self.counts.queued.fetch_add(1, Ordering::Relaxed);
            }
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
                self.counts.dropped.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Lines written so far.
    pub fn written(&self) -> u64 {
        self.counts.written.load(Ordering::Relaxed)
    }

    /// Lines dropped so far: the queue was full, or writing them failed.
    pub fn dropped(&self) -> u64 {
        self.counts.dropped.load(Ordering::Relaxed)
    }

    /// Waits up to `limit` for the lines queued so far to be written (or dropped): for a
    /// worker about to exit.
    pub fn flush(&self, limit: Duration) {
        let deadline = Instant::now() + limit;
        let queued = self.counts.queued.load(Ordering::Relaxed);
        while Instant::now() < deadline {
            let done = self.counts.written.load(Ordering::Relaxed) + self.counts.failed_writes();
            if done >= queued {
                return;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

impl Counts {
    /// Lines taken from the queue whose write failed (counted in `dropped` with the full
    /// queue's; told apart here by what is left).
    fn failed_writes(&self) -> u64 {
        self.failed.load(Ordering::Relaxed)
    }
}

/// The writer thread: until every sender is gone, takes what is queued and writes it in
/// batches of whole lines.
fn write_lines(mut out: std::fs::File, rx: Receiver<String>, counts: &Counts) {
    let mut batch = String::with_capacity(BATCH_BYTES);
    let mut lines = 0u64;
    while let Ok(first) = rx.recv() {
        batch.push_str(&first);
        lines += 1;
        while let Ok(line) = rx.try_recv() {
            if batch.len() + line.len() > BATCH_BYTES {
                write_batch(&mut out, &batch, lines, counts);
                batch.clear();
                lines = 0;
            }
            batch.push_str(&line);
            lines += 1;
        }
        write_batch(&mut out, &batch, lines, counts);
        batch.clear();
        lines = 0;
    }
}

fn write_batch(out: &mut std::fs::File, batch: &str, lines: u64, counts: &Counts) {
    match out.write_all(batch.as_bytes()) {
        Ok(()) => {
            counts.written.fetch_add(lines, Ordering::Relaxed);
            counts.failing.store(false, Ordering::Relaxed);
        }
        Err(e) => {
            counts.dropped.fetch_add(lines, Ordering::Relaxed);
            counts.failed.fetch_add(lines, Ordering::Relaxed);
            if !counts.failing.swap(true, Ordering::Relaxed) {
                warn!(error = %e, "writing the access log failed; its lines are counted as dropped until a write succeeds");
            }
        }
    }
}

/// A request's access-log line, begun when its head arrived (`Router::begin_log`): written by
/// [`Logged::finish`] (or `end`, `end_as`), or as it drops if nothing ended it (its task was dropped: a cut), with the
/// status and bytes noted so far.
pub(crate) struct Logged {
    log: Arc<AccessLog>,
    /// The site's label, or `-`; `None`: the line names no site (`Router::log_label`).
    site: Option<Arc<str>>,
    time: SystemTime,
    start: Instant,
    client: SocketAddr,
    protocol: &'static str,
    method: Method,
    authority: Option<String>,
    path: String,
    user_agent: Option<String>,
    referer: Option<String>,
    /// The route's prefix and the connection's server name ([`Logged::note`]).
    route: Option<String>,
    sni: Option<Arc<str>>,
    /// The status of the head sent, if one was.
    status: Option<StatusCode>,
    /// Body bytes sent so far.
    bytes: u64,
    /// Written already.
    done: bool,
    /// A tunnel's bytes from the client ([`Logged::end_tunnel`]).
    received: Option<u64>,
}

impl Logged {
    /// Begins the line of `parts` from `client` over `protocol` in `log`, naming the site
    /// labelled `site`.
    pub(crate) fn begin(
        log: &Arc<AccessLog>,
        site: Option<Arc<str>>,
        client: SocketAddr,
        protocol: &'static str,
        parts: &http::request::Parts,
    ) -> Logged {
        let authority = authority_of(parts).map(str::to_owned);
        // Captured only for the formats that write them.
        let field = |name: http::header::HeaderName| {
            let wanted = log.format != LogFormat::Ringmux;
            let v = parts.headers.get(name).filter(|_| wanted)?;
            Some(String::from_utf8_lossy(v.as_bytes()).into_owned())
        };
        Logged {
            log: log.clone(),
            site,
            time: SystemTime::now(),
            start: Instant::now(),
            client,
            protocol,
            method: parts.method.clone(),
            authority,
            path: parts
                .uri
                .path_and_query()
                .map_or_else(|| parts.uri.path().to_owned(), |p| p.as_str().to_owned()),
            user_agent: field(http::header::USER_AGENT),
            referer: field(http::header::REFERER),
            route: None,
            sni: None,
            status: None,
            bytes: 0,
            done: false,
            received: None,
        }
    }

    /// The route that answers (its prefix) and the connection's TLS server name.
    pub(crate) fn note(&mut self, route: Option<&str>, sni: impl FnOnce() -> Option<Arc<str>>) {
        if self.log.format != LogFormat::Ringmux {
            self.route = route.map(str::to_owned);
            self.sni = sni();
        }
    }

    /// The response head with `status` went out.
    pub(crate) fn head_sent(&mut self, status: StatusCode) {
        self.status = Some(status);
    }

    /// `n` more body bytes went out.
    pub(crate) fn body_sent(&mut self, n: u64) {
        self.bytes += n;
    }

    /// Writes the line of a request answered whole: `status` (`None`: no response went out)
    /// and the body bytes sent.
    pub(crate) fn end(self, status: Option<StatusCode>, bytes: u64) {
        self.end_as(status, bytes, Ending::Ok);
    }

    /// Writes the line with the status and bytes noted ([`Logged::head_sent`],
    /// [`Logged::body_sent`]): ended as `ending` says, or, for a request that broke off, as
    /// the worker said it ends them all ([`AccessLog::cut_as`]).
    pub(crate) fn finish(mut self, ending: Ending) {
        self.write(ending);
    }

    /// [`Logged::finish`] with the status and bytes given (`status` `None`: no response went
    /// out), as an exchange that counts them itself (the proxy's) knows them.
    pub(crate) fn end_as(mut self, status: Option<StatusCode>, bytes: u64, ending: Ending) {
        self.status = status;
        self.bytes = bytes;
        self.write(ending);
    }

    /// Writes a tunnel's line: `status` (101, or 200 over HTTP/2), the bytes sent to the
    /// client (`down`) and received from it (`up`, the line's last field).
    pub(crate) fn end_tunnel(mut self, status: StatusCode, down: u64, up: u64, ending: Ending) {
        self.received = Some(up);
        self.end_as(Some(status), down, ending);
    }

    fn write(&mut self, ending: Ending) {
        if std::mem::replace(&mut self.done, true) {
            return;
        }
        let ending = match ending {
            Ending::Ok => Ending::Ok,
            cut => self.log.cut_as(cut),
        };
        self.log.record(&Entry {
            time: self.time,
            client: self.client,
            protocol: self.protocol,
            method: self.method.as_str(),
            authority: self.authority.as_deref(),
            path: &self.path,
            status: self.status.map(|s| s.as_u16()),
            bytes: self.bytes,
            duration: self.start.elapsed(),
            site: self.site.as_deref(),
            ending,
            route: self.route.as_deref(),
            sni: self.sni.as_deref(),
            user_agent: self.user_agent.as_deref(),
            referer: self.referer.as_deref(),
            received: self.received,
        });
    }
}

impl Drop for Logged {
    /// A request nothing ended: its task was dropped with its connection (the client went
    /// away) or with the worker's server (a cut): logged as such.
    fn drop(&mut self) {
        self.write(Ending::CutClient);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_are_written_whole_and_a_full_queue_drops_and_counts() {
        let dir = ringmux_testkit::temp_dir("ringmux-access-log");
        let path = dir.path().join("access.log");
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .unwrap();
        let log = AccessLog::start(file, 3, LogFormat::Ringmux).unwrap();
        let e = Entry {
            time: SystemTime::now(),
            client: "[2001:db8::1]:443".parse().unwrap(),
            protocol: "h3",
            method: "GET",
            authority: Some("localhost"),
            path: "/hello.txt",
            status: Some(200),
            bytes: 19,
            duration: Duration::from_millis(1),
            site: None,
            ending: Ending::Ok,
            route: None,
            sni: None,
            user_agent: None,
            referer: None,
            received: None,
        };
        let n = 3 * QUEUE_LINES as u64;
        for _ in 0..n {
            log.record(&e);
        }
        log.flush(Duration::from_secs(30));
        let (written, dropped) = (log.written(), log.dropped());
        assert_eq!(written + dropped, n, "every line written or counted");
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(text.lines().count() as u64, written);
        assert!(text
            .lines()
            .all(|l| l.ends_with(" h3 GET localhost /hello.txt 200 19 0.001000 3 - ok")));
    }

    #[test]
    fn a_request_nothing_ended_is_logged_as_cut_with_what_went_out() {
        let dir = ringmux_testkit::temp_dir("ringmux-access-log-cut");
        let path = dir.path().join("access.log");
        let file = std::fs::File::create(&path).unwrap();
        let log = AccessLog::start(file, 0, LogFormat::Ringmux).unwrap();
        let parts = http::Request::get("https://localhost/big")
            .body(())
            .unwrap()
            .into_parts()
            .0;
        let client: SocketAddr = "127.0.0.1:9".parse().unwrap();
        // Ended: ok, with what went out.
        let mut l = Logged::begin(&log, None, client, "h2", &parts);
        l.head_sent(StatusCode::OK);
        l.body_sent(10);
        l.finish(Ending::Ok);
        // Dropped half way: the client's doing, unless the worker cuts.
        let mut l = Logged::begin(&log, None, client, "h1", &parts);
        l.head_sent(StatusCode::OK);
        l.body_sent(7);
        drop(l);
        log.ending_all(Ending::CutDrain);
        let mut l = Logged::begin(&log, Some("-".into()), client, "h3", &parts);
        l.body_sent(3);
        l.finish(Ending::CutClient);
        // Even a request that went out whole stays ok.
        Logged::begin(&log, None, client, "h3", &parts).end(None, 0);
        log.flush(Duration::from_secs(30));
        let text = std::fs::read_to_string(&path).unwrap();
        let ends: Vec<String> = text
            .lines()
            .map(|l| {
                let f: Vec<&str> = l.split(' ').collect();
                format!("{} {} {} {}", f[2], f[6], f[7], f[f.len() - 1])
            })
            .collect();
        assert_eq!(
            ends,
            [
                "h2 200 10 ok",
                "h1 200 7 cut:client",
                "h3 - 3 cut:drain",
                "h3 - 0 ok"
            ]
        );
    }
}
