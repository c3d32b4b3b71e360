//! Every line ringmux writes to its standard error, and every line its workers write, goes
//! through one thread of the demux, the log thread. It owns what this module is for:
//!
//! * **The demux's own lines** (`tracing`) are queued, never written by the thread that logs
//!   them: a full queue drops the line and counts it (`ringmux_log_lines_dropped_total`), and a
//!   write that fails (`EAGAIN` on a standard error someone made non-blocking, `EPIPE`, a full
//!   disk, a closed descriptor) loses that write's lines, counted the same way. No thread of the
//!   demux blocks on, or dies of, a log write.
//! * **Each worker's standard output and error** are a pipe of its own, not the demux's
//!   standard error: the worker can do what it likes to its end (`O_NONBLOCK`, a flood, closing
//!   it) and reaches nothing of the demux's or a sibling's. The thread reads each pipe, cuts
//!   lines at [`MAX_LINE`] bytes, replaces control characters and invalid UTF-8 ([`clean`]),
//!   prefixes `[instance N] ` and
//!   writes them to ringmux's standard error within each worker's budget ([`OUTPUT`]); the
//!   excess is read and dropped, counted per instance
//!   (`ringmux_worker_log_lines_dropped_total`). A worker past its budget is read at most every
//!   20 ms, so a flood costs the demux a bounded share of a core.
//! * **Each worker's access log** (`--access-log`, its descriptor 7) is a pipe of its own too:
//!   the thread appends its lines to the file (opened by the demux, appending) or to standard
//!   error, cut and cleaned as the output is: one line per newline the worker wrote, so a
//!   worker cannot break a line of another's. On standard error each access line carries its
//!   `[instance N] ` prefix too: every line there that does not start with one is the
//!   demux's own. No worker holds the file, so none can rewrite it, whatever it calls; a worker past
//!   its budget ([`ACCESS`]) is not read until the budget refills, and its own bounded queue
//!   then drops and counts its lines (`ringmux_worker_access_log_dropped_total`). A line the
//!   demux could not write (a full disk) is counted in `ringmux_access_log_lines_dropped_total`.
//!
//! Across `ringmux upgrade` the pipes' read ends pass to the new image with the rest of the
//! workers' descriptors ([`park`] first stops the reading, so no line read is lost in between).

use std::collections::VecDeque;
use std::io::{self, Write};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::Ordering;
use std::sync::mpsc;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use crate::budget::{Bucket, Budget, Limits, Rate, Verdict};
use crate::metrics::counters::{ACCESS_LINES_DROPPED as ACCESS_DROPPED, LINES_DROPPED};
use crate::metrics::Counters;
use crate::sys;

/// The longest line a worker's output passes on whole; the rest of a longer line is dropped and
/// what passes ends with [`CUT_MARK`].
pub const MAX_LINE: usize = 8 * 1024;
/// The longest access-log line passed on whole (a request head may be 64 KiB, escaped).
pub const MAX_ACCESS_LINE: usize = 256 * 1024;
/// Ends a line that was cut at its maximum length.
pub const CUT_MARK: &[u8] = b" [cut]";
/// How many lines of each worker's output pass to ringmux's standard error (`serve`: 200 a
/// second after a burst of 2 000), how many more are read and dropped (`drop`), and how long a
/// worker past both waits before its pipe is read again (`pause`): so a flood costs the
/// demux at most a read of 64 KiB every 20 ms.
pub const OUTPUT: Limits = Limits {
    serve: Rate {
        per_second: 200,
        burst: 2000,
    },
    drop: Rate {
        per_second: 10_000,
        burst: 10_000,
    },
    pause: Duration::from_millis(20),
};
/// KiB a second of each worker's access log (far past what a worker can serve: a line is
/// about 100 bytes), after a burst of 8 MiB. A worker past it is not read until its budget
/// refills.
pub const ACCESS: Rate = Rate {
    per_second: 64 * 1024,
    burst: 8 * 1024,
};
/// Most lines of the demux's own waiting to be written; past it a line is dropped.
const QUEUE_LINES: usize = 4096;
/// Most bytes read from one pipe at a time.
const READ_SIZE: usize = 64 * 1024;
/// How long a write to a non-blocking, full standard error waits before its lines are dropped.
const WRITE_WAIT: Duration = Duration::from_millis(20);

/// The log thread's queue, once [`start`] ran.
static SHARED: OnceLock<Arc<Shared>> = OnceLock::new();

/// Where access-log lines go.
#[derive(Debug)]
pub enum AccessOut {
    /// Nowhere (`--access-log off`).
    Off,
    /// ringmux's standard error.
    Stderr,
    /// A file the demux opened for appending.
    File(OwnedFd),
}

/// The read ends of one worker's pipes.
#[derive(Debug)]
pub struct WorkerPipes {
    /// Its standard output and error.
    pub output: OwnedFd,
    /// Its access log (`--access-log`).
    pub access: Option<OwnedFd>,
}

/// Starts the log thread and makes it the writer of every `tracing` line of this process
/// (filtered by `RUST_LOG`, default `info`; colours only on a terminal without `NO_COLOR`).
/// Call once, first thing in `main`.
pub fn start() -> io::Result<()> {
    let shared = Arc::new(Shared {
        queue: Mutex::new(Queue::default()),
        wake: sys::wake_fd()?,
    });
    let thread = Arc::clone(&shared);
    std::thread::Builder::new()
        .name("log".into())
        .spawn(move || Writer::new(thread).run())?;
    let _ = SHARED.set(shared);
    ringmux_proto::logging::init_with(Queued);
    Ok(())
}

/// Reads `pipes` of the worker of `lane` (instance `instance`) until their writers are gone.
pub fn watch(lane: usize, instance: u8, pipes: WorkerPipes) {
    send(Item::Watch(lane, instance, pipes));
}

/// Access-log lines go to `out` from now on (the previous file is closed).
pub fn access_to(out: AccessOut) {
    send(Item::Access(out));
}

/// The counters the per-instance counts go to.
pub fn count_into(counters: Arc<Counters>) {
    send(Item::Counters(counters));
}

/// Waits, at most `limit`, until every line queued before the call was written.
pub fn flush(limit: Duration) {
    let (tx, rx) = mpsc::channel();
    send(Item::Flush(tx));
    let _ = rx.recv_timeout(limit);
}

/// Stops reading the workers' pipes, after writing every whole line read so far and the part
/// of a line still waiting: for `ringmux upgrade`, whose new image reads them on. Waits at most
/// `limit` for the thread to stop; the reading goes on when the returned guard is dropped (the
/// upgrade failed), or never (the image was replaced).
pub fn park(limit: Duration) -> Parked {
    let (tx, rx) = mpsc::channel();
    send(Item::Park(tx));
    let _ = rx.recv_timeout(limit);
    Parked(())
}

/// Reading the workers' pipes is stopped while this lives ([`park`]).
#[must_use = "the reading goes on when this is dropped"]
pub struct Parked(());

impl Drop for Parked {
    fn drop(&mut self) {
        send(Item::Unpark);
    }
}

fn send(item: Item) {
    if let Some(s) = SHARED.get() {
        s.push(item);
    }
}

/// The `tracing` writer of the demux: each event's line is queued for the log thread.
struct Queued;

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Queued {
    type Writer = QueuedLine;

    fn make_writer(&'a self) -> QueuedLine {
        QueuedLine(Vec::new())
    }
}

/// One event's line, queued when dropped.
struct QueuedLine(Vec<u8>);

impl Write for QueuedLine {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Drop for QueuedLine {
    fn drop(&mut self) {
        if self.0.is_empty() {
            return;
        }
        match SHARED.get() {
            Some(s) => s.push(Item::Line(std::mem::take(&mut self.0))),
            None => {
                LINES_DROPPED.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

/// What the thread is asked to do, in order.
enum Item {
    Line(Vec<u8>),
    Watch(usize, u8, WorkerPipes),
    Access(AccessOut),
    Counters(Arc<Counters>),
    Flush(mpsc::Sender<()>),
    Park(mpsc::Sender<()>),
    Unpark,
}

#[derive(Default)]
struct Queue {
    items: VecDeque<Item>,
    /// Of `items`, lines.
    lines: usize,
}

struct Shared {
    queue: Mutex<Queue>,
    /// Readable while `queue` has items.
    wake: OwnedFd,
}

impl Shared {
    fn push(&self, item: Item) {
        {
            let Ok(mut q) = self.queue.lock() else {
                return;
            };
            if matches!(item, Item::Line(_)) {
                if q.lines >= QUEUE_LINES {
                    LINES_DROPPED.fetch_add(1, Ordering::Relaxed);
                    return;
                }
                q.lines += 1;
            }
            q.items.push_back(item);
        }
        sys::wake(self.wake.as_fd());
    }

    fn take(&self) -> VecDeque<Item> {
        sys::clear_wake(self.wake.as_fd());
        match self.queue.lock() {
            Ok(mut q) => {
                q.lines = 0;
                std::mem::take(&mut q.items)
            }
            Err(_) => VecDeque::new(),
        }
    }
}

/// Which pipe of a worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stream {
    Output,
    Access,
}

/// One pipe being read.
struct Source {
    lane: usize,
    stream: Stream,
    fd: OwnedFd,
    /// `[instance N] `, for output lines.
    prefix: Vec<u8>,
    /// The line read so far.
    line: Vec<u8>,
    /// The line being read was cut: what is left of it up to its newline is skipped.
    skipping: bool,
    pace: Pace,
    /// Not read before then (past its budget).
    resume: Option<Instant>,
}

/// How much of a pipe the thread reads: lines of output, KiB of access log.
enum Pace {
    Output(Budget),
    Access(Bucket),
}

/// What one round counted, per lane.
#[derive(Default)]
struct Tally {
    written: u64,
    dropped: u64,
}

impl Source {
    fn new(lane: usize, instance: u8, stream: Stream, fd: OwnedFd, now: Instant) -> Self {
        let pace = match stream {
            Stream::Output => Pace::Output(Budget::new(OUTPUT, now)),
            Stream::Access => Pace::Access(Bucket::new(ACCESS, now)),
        };
        Source {
            lane,
            stream,
            fd,
            prefix: format!("[instance {instance}] ").into_bytes(),
            line: Vec::new(),
            skipping: false,
            pace,
            resume: None,
        }
    }

    fn max_line(&self) -> usize {
        match self.stream {
            Stream::Output => MAX_LINE,
            Stream::Access => MAX_ACCESS_LINE,
        }
    }

    /// Splits `chunk` into lines, each ended, cut or passed to `out` (the output lines only
    /// while the budget lasts; the others are counted in `tally`). `to_stderr`: access lines
    /// go to standard error, and are prefixed as output lines are.
    fn take_in(
        &mut self,
        chunk: &[u8],
        now: Instant,
        to_stderr: bool,
        out: &mut Vec<u8>,
        tally: &mut Tally,
    ) {
        let max = self.max_line();
        for piece in chunk.split_inclusive(|&b| b == b'\n') {
            let ended = piece.last() == Some(&b'\n');
            let body = if ended {
                &piece[..piece.len() - 1]
            } else {
                piece
            };
            if self.skipping {
                self.skipping = !ended;
                continue;
            }
            let room = max - self.line.len();
            if body.len() > room {
                self.line.extend_from_slice(&body[..room]);
                self.end_line(true, now, to_stderr, out, tally);
                self.skipping = !ended;
                continue;
            }
            self.line.extend_from_slice(body);
            if ended {
                self.end_line(false, now, to_stderr, out, tally);
            }
        }
    }

    /// Passes the line read so far to `out`, or drops it (over the budget). Every line that
    /// goes to standard error (`to_stderr` for an access line) starts with the prefix.
    fn end_line(
        &mut self,
        cut: bool,
        now: Instant,
        to_stderr: bool,
        out: &mut Vec<u8>,
        tally: &mut Tally,
    ) {
        if let Pace::Output(budget) = &mut self.pace {
            if budget.spend(now) == Verdict::Drop {
                tally.dropped += 1;
                self.line.clear();
                return;
            }
        }
        if self.stream == Stream::Output || to_stderr {
            out.extend_from_slice(&self.prefix);
        }
        clean(&self.line, out);
        if cut {
            out.extend_from_slice(CUT_MARK);
        }
        out.push(b'\n');
        tally.written += 1;
        self.line.clear();
    }

    /// After a read of `n` bytes: when to read again, if not as soon as there is more.
    fn pace(&mut self, n: usize, now: Instant) {
        self.resume = match &mut self.pace {
            Pace::Output(budget) => budget.read_after(now),
            Pace::Access(bucket) => {
                let kib = u32::try_from(n.div_ceil(1024)).unwrap_or(u32::MAX);
                bucket.charge_n(now, kib);
                bucket.conforms_after(now)
            }
        };
    }
}

/// Appends `line` to `out` as a log line may carry it: tabs and printable characters as they
/// are (UTF-8 included); as `?`, each control character — C0 (escape sequences of a terminal,
/// carriage returns), DEL and C1 (U+0080–U+009F, such as U+009B, an 8-bit CSI, and U+0085, a
/// next line) — the line and paragraph separators U+2028 and U+2029 and the bidirectional
/// embeddings, overrides and isolates (U+202A–U+202E, U+2066–U+2069), which could make a line
/// look like another; and each byte that is not part of valid UTF-8 (a raw 0x80–0x9F is an
/// 8-bit C1 control to a terminal that reads Latin-1). So what a worker wrote comes out as
/// valid UTF-8, one line, showing what it holds.
pub fn clean(line: &[u8], out: &mut Vec<u8>) {
    for chunk in line.utf8_chunks() {
        let valid = chunk.valid();
        if valid
            .bytes()
            .all(|b| b == b'\t' || (0x20..0x7f).contains(&b))
        {
            out.extend_from_slice(valid.as_bytes());
        } else {
            for c in valid.chars() {
                if c == '\t' || !is_unsafe_char(c) {
                    let mut utf8 = [0u8; 4];
                    out.extend_from_slice(c.encode_utf8(&mut utf8).as_bytes());
                } else {
                    out.push(b'?');
                }
            }
        }
        out.extend(std::iter::repeat_n(b'?', chunk.invalid().len()));
    }
}

/// Whether `c` may not appear as itself in a log line (see [`clean`]).
fn is_unsafe_char(c: char) -> bool {
    c.is_control()
        || matches!(c, '\u{2028}' | '\u{2029}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
}

/// The log thread.
struct Writer {
    shared: Arc<Shared>,
    sources: Vec<Source>,
    access: AccessOut,
    counters: Option<Arc<Counters>>,
    parked: bool,
    buf: Vec<u8>,
}

impl Writer {
    fn new(shared: Arc<Shared>) -> Self {
        Writer {
            shared,
            sources: Vec::new(),
            access: AccessOut::Off,
            counters: None,
            parked: false,
            buf: vec![0; READ_SIZE],
        }
    }

    fn run(mut self) {
        // Started before the demux blocks its shutdown signals: they must not land here.
        let _ = sys::block_all_signals();
        loop {
            let now = Instant::now();
            // The pipes to read now: every one not paused, unless parked.
            let ready: Vec<usize> = if self.parked {
                Vec::new()
            } else {
                (0..self.sources.len())
                    .filter(|&i| self.sources[i].resume.is_none_or(|t| t <= now))
                    .collect()
            };
            let timeout = self
                .sources
                .iter()
                .filter_map(|s| s.resume)
                .filter(|_| !self.parked)
                .min()
                .map(|t| t.saturating_duration_since(now));
            let mut fds: Vec<BorrowedFd<'_>> = vec![self.shared.wake.as_fd()];
            fds.extend(ready.iter().map(|&i| self.sources[i].fd.as_fd()));
            let Ok(which) = sys::poll_which(&fds, timeout) else {
                continue;
            };
            drop(fds);
            if which[0] {
                for item in self.shared.take() {
                    self.carry_out(item);
                }
            }
            let readable: Vec<usize> = ready
                .iter()
                .zip(&which[1..])
                .filter(|(_, r)| **r)
                .map(|(&i, _)| i)
                .collect();
            self.read(&readable);
        }
    }

    fn carry_out(&mut self, item: Item) {
        match item {
            Item::Line(line) => {
                if write_stderr(&line).is_err() {
                    LINES_DROPPED.fetch_add(1, Ordering::Relaxed);
                }
            }
            Item::Watch(lane, instance, pipes) => {
                let now = Instant::now();
                self.sources.push(Source::new(
                    lane,
                    instance,
                    Stream::Output,
                    pipes.output,
                    now,
                ));
                if let Some(access) = pipes.access {
                    self.sources
                        .push(Source::new(lane, instance, Stream::Access, access, now));
                }
            }
            Item::Access(out) => self.access = out,
            Item::Counters(c) => self.counters = Some(c),
            Item::Flush(done) => {
                let _ = done.send(());
            }
            Item::Park(done) => {
                // What was read of a line so far goes out now: the next image reads on from
                // the pipe, after it.
                let (mut out, mut access) = (Vec::new(), Vec::new());
                let now = Instant::now();
                let to_stderr = matches!(self.access, AccessOut::Stderr);
                for s in &mut self.sources {
                    if !s.line.is_empty() {
                        let mut tally = Tally::default();
                        let target = match s.stream {
                            Stream::Output => &mut out,
                            Stream::Access => &mut access,
                        };
                        s.end_line(false, now, to_stderr, target, &mut tally);
                    }
                }
                self.write_out(&out, &access);
                self.parked = true;
                let _ = done.send(());
            }
            Item::Unpark => self.parked = false,
        }
    }

    /// Reads each of `sources` once, passes on the lines and drops the pipes whose writers
    /// are gone.
    fn read(&mut self, sources: &[usize]) {
        let now = Instant::now();
        let (mut out, mut access) = (Vec::new(), Vec::new());
        let mut gone = Vec::new();
        let to_stderr = matches!(self.access, AccessOut::Stderr);
        for &i in sources {
            let s = &mut self.sources[i];
            let mut tally = Tally::default();
            match sys::read_some(s.fd.as_fd(), &mut self.buf) {
                Ok(0) => {
                    if !s.line.is_empty() {
                        let target = match s.stream {
                            Stream::Output => &mut out,
                            Stream::Access => &mut access,
                        };
                        s.end_line(false, now, to_stderr, target, &mut tally);
                    }
                    gone.push(i);
                }
                Ok(n) => {
                    let target = match s.stream {
                        Stream::Output => &mut out,
                        Stream::Access => &mut access,
                    };
                    s.take_in(&self.buf[..n], now, to_stderr, target, &mut tally);
                    s.pace(n, now);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(_) => gone.push(i),
            }
            if s.stream == Stream::Output {
                if let Some(c) = self.counters.as_ref().and_then(|c| c.instances.get(s.lane)) {
                    c.log_lines.fetch_add(tally.written, Ordering::Relaxed);
                    c.log_lines_dropped
                        .fetch_add(tally.dropped, Ordering::Relaxed);
                }
            }
        }
        for i in gone.into_iter().rev() {
            self.sources.swap_remove(i);
        }
        self.write_out(&out, &access);
    }

    /// Writes output lines to standard error and access-log lines where they go, counting the
    /// lines of a write that failed.
    fn write_out(&mut self, out: &[u8], access: &[u8]) {
        let lines = |b: &[u8]| b.iter().filter(|&&c| c == b'\n').count() as u64;
        if !out.is_empty() && write_stderr(out).is_err() {
            LINES_DROPPED.fetch_add(lines(out), Ordering::Relaxed);
        }
        if access.is_empty() {
            return;
        }
        let written = match &self.access {
            AccessOut::Off => Ok(()),
            AccessOut::Stderr => write_stderr(access),
            AccessOut::File(f) => sys::write_all_or_fail(f.as_fd(), access, WRITE_WAIT),
        };
        if written.is_err() {
            ACCESS_DROPPED.fetch_add(lines(access), Ordering::Relaxed);
        }
    }
}

fn write_stderr(buf: &[u8]) -> io::Result<()> {
    sys::write_all_or_fail(io::stderr().as_fd(), buf, WRITE_WAIT)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn source(stream: Stream, now: Instant) -> Source {
        let (read, _) = sys::log_pipe().unwrap();
        Source::new(3, 1, stream, read, now)
    }

    #[test]
    fn output_lines_are_prefixed_cut_cleaned_and_whole_across_reads() {
        let now = Instant::now();
        let mut s = source(Stream::Output, now);
        let (mut out, mut tally) = (Vec::new(), Tally::default());
        s.take_in(b"one\ntw", now, false, &mut out, &mut tally);
        s.take_in(b"o\x1b[31m\r\n", now, false, &mut out, &mut tally);
        let long = vec![b'x'; MAX_LINE + 10];
        s.take_in(&long, now, false, &mut out, &mut tally);
        s.take_in(b"yyy\nlast\n", now, false, &mut out, &mut tally);
        let text = String::from_utf8(out).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0], "[instance 1] one");
        assert_eq!(lines[1], "[instance 1] two?[31m?");
        assert_eq!(
            lines[2],
            format!("[instance 1] {}{}", "x".repeat(MAX_LINE), " [cut]")
        );
        assert_eq!(lines[3], "[instance 1] last");
        assert_eq!(lines.len(), 4);
        assert_eq!((tally.written, tally.dropped), (4, 0));
    }

    #[test]
    fn control_characters_c1_included_and_invalid_utf8_become_question_marks() {
        let cleaned = |b: &[u8]| {
            let mut out = Vec::new();
            clean(b, &mut out);
            String::from_utf8(out).expect("always UTF-8")
        };
        assert_eq!(
            cleaned(b"plain\ttab \xc3\xa9t\xc3\xa9 \xe2\x82\xac"),
            "plain\ttab été €"
        );
        // C0, DEL, C1 as UTF-8 (U+0080, U+0085, U+009B, U+009F), raw C1 bytes.
        assert_eq!(cleaned(b"a\x1b[2Jb\x7fc\x00d\x08"), "a?[2Jb?c?d?");
        assert_eq!(cleaned(b"\xc2\x80\xc2\x85x\xc2\x9b31m\xc2\x9f"), "??x?31m?");
        assert_eq!(cleaned(b"\x85\x9b31m\x80\x9f"), "??31m??");
        // U+00A0 is past C1: kept.
        assert_eq!(cleaned(b"\xc2\xa0"), "\u{a0}");
        // Separators and bidirectional controls.
        assert_eq!(
            cleaned("x\u{2028}y\u{2029}z\u{202e}w\u{2066}v".as_bytes()),
            "x?y?z?w?v"
        );
        // Invalid UTF-8: each byte that is not part of a character.
        assert_eq!(cleaned(b"\xff\xfeok\xc3"), "??ok?");
        assert_eq!(cleaned(b"\xed\xa0\x80"), "???");
    }

    #[test]
    fn output_past_its_budget_is_dropped_and_counted_then_paused() {
        let now = Instant::now();
        let mut s = source(Stream::Output, now);
        let (mut out, mut tally) = (Vec::new(), Tally::default());
        let burst = OUTPUT.serve.burst as usize;
        let flood = b"line\n".repeat(burst + 50);
        s.take_in(&flood, now, false, &mut out, &mut tally);
        s.pace(flood.len(), now);
        assert_eq!((tally.written, tally.dropped), (burst as u64, 50));
        assert_eq!(
            s.resume, None,
            "read on while dropping is within its budget"
        );
        // Far past what it may read and drop: the pipe waits, at least the pause.
        let flood = b"line\n".repeat(2 * OUTPUT.drop.burst as usize);
        let mut tally = Tally::default();
        s.take_in(&flood, now, false, &mut out, &mut tally);
        s.pace(flood.len(), now);
        assert_eq!(tally.written, 0);
        let resume = s.resume.expect("paused past its budget");
        assert!(resume >= now + OUTPUT.pause, "{:?}", resume - now);
        // Later the rate's worth passes again.
        let later = resume + Duration::from_secs(1);
        let mut tally = Tally::default();
        s.take_in(&b"line\n".repeat(burst), later, false, &mut out, &mut tally);
        assert!(
            tally.written >= u64::from(OUTPUT.serve.per_second),
            "{}",
            tally.written
        );
    }

    #[test]
    fn access_lines_pass_unprefixed_to_a_file_and_a_flood_waits_for_its_budget() {
        let now = Instant::now();
        let mut s = source(Stream::Access, now);
        let (mut out, mut tally) = (Vec::new(), Tally::default());
        s.take_in(b"2026 a b\n2026 c", now, false, &mut out, &mut tally);
        s.pace(15, now);
        assert_eq!(out, b"2026 a b\n");
        // A line with a carriage return or a C1 next-line cannot pass for two.
        let mut out = Vec::new();
        s.take_in(
            b"\n2026 x\r2026 y\xc2\x852026 z\n",
            now,
            false,
            &mut out,
            &mut tally,
        );
        assert_eq!(out, b"2026 c\n2026 x?2026 y?2026 z\n");
        assert_eq!(s.resume, None);
        // To standard error, each line carries its instance, as output lines do.
        let mut out = Vec::new();
        s.take_in(b"2026 d\nWARN forged\n", now, true, &mut out, &mut tally);
        assert_eq!(out, b"[instance 1] 2026 d\n[instance 1] WARN forged\n");
        // 1 MiB past the burst, at 64 MiB a second: about 16 ms.
        s.pace((ACCESS.burst as usize + 1024) * 1024, now);
        let wait = s.resume.expect("paused past its budget") - now;
        assert!(
            wait > Duration::from_millis(15) && wait < Duration::from_millis(17),
            "{wait:?}"
        );
    }
}
