//! The processes and descriptors of each lane's worker ([`WorkerTable`]), and what is done to
//! them whatever the reason: hold one that started, wait for one, read what it says, kill it,
//! tell it to cut, reap it, cut them all at the end of a shutdown, kill what dead workers left
//! behind; with the books of each (its process ID in the lane's counters, whether its lane is
//! up). Whether and when is [`super::policy`]'s.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::process::ExitStatus;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, TryRecvError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ringmux_proto::message::WorkerReport;
use ringmux_proto::{Message, MessageError};

use super::policy;
use super::spawn::Launched;
use crate::budget::{self, Budget};
use crate::config::Config;
use crate::forward::{IngressHandles, Lanes};
use crate::metrics::{Counters, InstanceCounters, Liveness};
use crate::sys::{self, ChildProcess};

/// The processes and descriptors of one lane; what to do with them is the policy's.
pub struct Worker {
    pub child: Option<ChildProcess>,
    pub pidfd: Option<OwnedFd>,
    pub control: Option<OwnedFd>,
    /// A duplicate of the demux's end of the session socket, to shut it down when the worker
    /// dies: its session thread then ends, whoever still holds the worker's end.
    pub sessions: Option<OwnedFd>,
    /// A reset was requested; its descriptors arrive here.
    pub reset_reply: Option<Receiver<std::io::Result<IngressHandles>>>,
    /// Descriptors of the next generation, waiting for the restart time.
    pub handles: Option<IngressHandles>,
    /// Copies of the read ends of its output and access-log pipes (the log thread reads its
    /// own), for a new process image to read on after `ringmux upgrade`.
    pub pipes: Option<crate::logs::WorkerPipes>,
    /// How many of its control messages the supervisor reads and acts on; full again for each
    /// new worker of the lane.
    pub budget: Budget,
    /// It said it accepts no new connection (`STOPPED`, after `SHUTDOWN`).
    pub stopped: bool,
}

impl Default for Worker {
    fn default() -> Self {
        Worker {
            child: None,
            pidfd: None,
            control: None,
            sessions: None,
            reset_reply: None,
            handles: None,
            pipes: None,
            budget: Budget::new(budget::CONTROL, Instant::now()),
            stopped: false,
        }
    }
}

impl Worker {
    /// Whether its process is gone (or cannot be waited for).
    pub fn exited(&mut self) -> bool {
        match self.child.as_mut().map(|c| c.try_wait()) {
            Some(Ok(Some(_))) => true,
            Some(Ok(None)) | None => false,
            Some(Err(_)) => true,
        }
    }

    /// Sends `message` on its control socket, if it has one; a worker that cannot take it is
    /// dead or broken, which its pidfd shows.
    pub fn tell(&self, message: &Message) {
        if let Some(c) = &self.control {
            let _ = sys::send_packet(c.as_fd(), &message.encode());
        }
    }

    /// Collects its process, killed first unless it is `draining` (a draining worker closes
    /// its control socket as it exits: let it finish; otherwise the socket may close a moment
    /// before a crashing process is gone: make sure it is). Drops what the demux held of it.
    /// `None`: there was no process; else how it ended, if that could be known.
    pub fn reap(&mut self, draining: bool) -> Option<Option<ExitStatus>> {
        let mut child = self.child.take()?;
        if !draining {
            let _ = child.kill();
        }
        let status = child.wait().ok();
        self.pidfd = None;
        // The next worker of the lane starts with a full budget.
        self.budget = Budget::new(budget::CONTROL, Instant::now());
        // Whatever the worker left behind (a forked child, say) may hold the other ends: close
        // ours, so its control messages go nowhere, and shut the session socket down, so its
        // session thread ends and it can no longer reach the session cache.
        self.control = None;
        self.pipes = None;
        if let Some(s) = self.sessions.take() {
            let _ = sys::shut_down(s.as_fd());
        }
        Some(status)
    }
}

/// How often the supervisor looks for processes re-parented to the demux (descendants of a
/// worker whose parent died) when no worker died since the last look.
const ORPHAN_SWEEP: Duration = Duration::from_secs(1);

/// Most control messages read from one worker per supervision round (a worker sends one STATS a
/// second; more is a flood). Over time its [`Budget`] ([`budget::CONTROL`]) bounds them.
const CONTROL_READS_PER_ROUND: usize = 16;

/// Every lane's worker, by lane (the table derefs to a slice of [`Worker`]), and what is kept
/// for them all: where their control messages are read, when to look for orphans next.
pub struct WorkerTable {
    lanes: Vec<Worker>,
    /// Where a worker's control message is read: room for the largest
    /// ([`ringmux_proto::MAX_MESSAGE`]).
    control_buf: Box<[u8]>,
    /// When to look for orphans next (sooner after a worker died).
    next_sweep: Instant,
}

/// What reading a worker's control socket found that is for the supervisor to act on (its
/// counters, `STOPPED` and malformed messages are taken care of).
#[derive(Debug, Default)]
pub struct Heard {
    /// The socket closed or broke: stop polling it (the process may still run).
    pub gone: bool,
    /// How many `READY`s it sent.
    pub ready: usize,
    /// The certificate and challenge updates it applied (`APPLIED seq`), in order.
    pub applied: Vec<u64>,
}

/// Which worker a lane holds, as its log lines name it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Named {
    pub instance: u8,
    /// Its worker generation (`Policy::lane`).
    pub generation: u64,
}

impl WorkerTable {
    /// `lanes` lanes without a worker.
    pub fn new(lanes: usize, now: Instant) -> WorkerTable {
        WorkerTable {
            lanes: (0..lanes).map(|_| Worker::default()).collect(),
            control_buf: vec![0; ringmux_proto::MAX_MESSAGE].into_boxed_slice(),
            next_sweep: now + ORPHAN_SWEEP,
        }
    }

    /// Adds what a supervision round polls of the workers to `fds`: each pidfd, and each
    /// control socket its worker's budget lets be read `now`; `timeout` is cut to when the
    /// next of the others may be read.
    pub fn poll_fds<'a>(
        &'a mut self,
        now: Instant,
        timeout: &mut Duration,
        fds: &mut Vec<BorrowedFd<'a>>,
    ) {
        for w in self.lanes.iter_mut() {
            fds.extend(w.pidfd.as_ref().map(|p| p.as_fd()));
            // A worker that spent its budget is not listened to until it may be read again:
            // its flood waits in its own socket instead of waking this loop (its death still
            // shows on its pidfd).
            match w.budget.read_after(now) {
                None => fds.extend(w.control.as_ref().map(|c| c.as_fd())),
                Some(at) if w.control.is_some() => {
                    *timeout = (*timeout).min(at.saturating_duration_since(now));
                }
                Some(_) => {}
            }
        }
    }

    /// Whether `pid` is one of the workers' processes.
    pub fn runs(&self, pid: u32) -> bool {
        self.lanes
            .iter()
            .any(|w| w.child.as_ref().map(ChildProcess::id) == Some(pid))
    }

    /// Reads pending control messages of lane `i`'s worker, recording its counters in
    /// `counters`.
    ///
    /// At most `CONTROL_READS_PER_ROUND` messages, and no more than its [`Budget`] allows: a
    /// worker that floods its socket gets no more of the supervisor's time than that, and every
    /// other duty still comes round. Messages past the budget's serve rate are dropped unparsed
    /// and counted; `READY` is acted on all the same (it spends, so a flood of it is bounded
    /// too).
    pub fn read(&mut self, i: usize, counters: &Counters) -> Heard {
        let mut heard = Heard::default();
        let buf = &mut self.control_buf;
        let w = &mut self.lanes[i];
        for _ in 0..CONTROL_READS_PER_ROUND {
            let Some(control) = w.control.as_ref() else {
                break;
            };
            if w.budget.read_after(Instant::now()).is_some() {
                break;
            }
            let n = match sys::recv_packet(control.as_fd(), buf) {
                Ok(0) => {
                    heard.gone = true;
                    break;
                }
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(_) => {
                    heard.gone = true;
                    break;
                }
            };
            let ic = &counters.instances[i];
            let packet = &buf[..n.min(buf.len())];
            let ready = packet == ringmux_proto::message::WORDS[0].as_bytes();
            if w.budget.spend(Instant::now()) == budget::Verdict::Drop && !ready {
                budget::MessageKind::of_control(packet).count_dropped(ic);
                continue;
            }
            // An oversized packet (longer than the buffer) is ignored.
            match buf.get(..n).map_or(Report::Ignored, Report::of) {
                Report::Ready => heard.ready += 1,
                Report::Stats(r) => {
                    ic.record_report(&r, ic.sites.rows_known(counters.site_labels.len()))
                }
                Report::Stopped => w.stopped = true,
                Report::Malformed => {
                    ic.reports_malformed.fetch_add(1, Ordering::Relaxed);
                }
                Report::Applied(seq) => heard.applied.push(seq),
                Report::Ignored => {}
            }
        }
        heard
    }

    /// Lane `l`'s worker that just started (`started`), held from now on: its process ID in
    /// the lane's `counters`, and its totals started again from 0 (it reports only the sites it
    /// answered, by the indices of the table it was handed: `site_labels`'s); `challenges`, the
    /// ACME challenges pending now, sent to it at once. Returns the demux's end of its session
    /// socket, to serve.
    pub fn started(
        &mut self,
        l: usize,
        started: Launched,
        counters: &InstanceCounters,
        site_labels: Arc<[String]>,
        challenges: Option<Message>,
    ) -> OwnedFd {
        let pid = started.child.id();
        counters.worker_pid.store(u64::from(pid), Ordering::Relaxed);
        counters.sites.start(site_labels);
        counters.series.clear();
        tracing::info!(
            instance = started.handoff.instance,
            pid,
            generation = started.handoff.worker_generation,
            ring_generation = started.handoff.generation,
            "worker started"
        );
        if let Some(m) = challenges {
            let _ = sys::send_packet(started.control.as_fd(), &m.encode());
        }
        let w = &mut self.lanes[l];
        *w = Worker {
            child: Some(started.child),
            pidfd: started.pidfd,
            control: Some(started.control),
            sessions: Some(started.sessions_dup),
            pipes: Some(started.pipes),
            stopped: false,
            ..std::mem::take(w)
        };
        started.sessions
    }

    /// Lane `l`'s running worker `worker`, handed over by a previous process image (process
    /// `pid`), held from now on: its process ID in the lane's `counters`, its lane up unless
    /// the lane is `idle`.
    pub fn adopted(
        &mut self,
        l: usize,
        worker: Worker,
        pid: u32,
        idle: bool,
        counters: &InstanceCounters,
        liveness: &Liveness,
    ) {
        counters.worker_pid.store(u64::from(pid), Ordering::Relaxed);
        if !idle {
            liveness.set_up(l, true);
        }
        self.lanes[l] = worker;
    }

    /// Kills lane `i`'s worker (`who`), saying why when it is news.
    pub fn kill(&mut self, i: usize, why: policy::Why, who: Named, cfg: &Config) {
        log_kill(why, who, cfg);
        if let Some(c) = self.lanes[i].child.as_mut() {
            let _ = c.kill();
        }
    }

    /// Tells lane `i`'s worker (`who`, draining for `age`) to cut (`CUT`): the end of its
    /// drain, counted in the lane's `counters`. The policy kills it if it is still there
    /// [`policy::CUT_WAIT`] later.
    pub fn cut(
        &mut self,
        i: usize,
        why: policy::Why,
        who: Named,
        age: Option<Duration>,
        cfg: &Config,
        counters: &InstanceCounters,
    ) {
        log_cut(why, who, age, cfg);
        counters.cuts.fetch_add(1, Ordering::Relaxed);
        self.lanes[i].tell(&Message::Cut);
    }

    /// Collects the process of lane `i`'s dead worker (`who`, [`Worker::reap`]), `draining` or
    /// not: its lane down and its process ID gone from `liveness` and `counters`; says how it
    /// ended, and looks for what it left behind.
    pub fn reap(
        &mut self,
        i: usize,
        draining: bool,
        who: Named,
        counters: &InstanceCounters,
        liveness: &Liveness,
    ) {
        liveness.set_up(i, false);
        counters.worker_pid.store(0, Ordering::Relaxed);
        let Some(status) = self.lanes[i].reap(draining) else {
            return;
        };
        let Named {
            instance,
            generation,
        } = who;
        if draining {
            tracing::info!(instance, generation, ?status, "worker exited");
        } else {
            tracing::warn!(instance, generation, ?status, "worker process ended");
        }
        // Its descendants are re-parented to the demux now (or as their parents die): look for
        // them at once, and again each round while any turn up.
        self.kill_orphans();
    }

    /// Whether it is time to look for orphans again.
    pub fn sweep_due(&self, now: Instant) -> bool {
        now >= self.next_sweep
    }

    /// Kills the processes dead workers left behind ([`kill_orphans`]); looks again next
    /// round while any turn up.
    pub fn kill_orphans(&mut self) {
        let found = kill_orphans(&self.lanes);
        self.next_sweep = Instant::now()
            + if found > 0 {
                // Their own children are re-parented as they die: next round.
                Duration::ZERO
            } else {
                ORPHAN_SWEEP
            };
    }

    /// Takes lane `i`'s new descriptors once the data plane has reset its ingress: `Ok(true)`
    /// when they came now.
    pub fn collect_reset(&mut self, i: usize) -> anyhow::Result<bool> {
        let w = &mut self.lanes[i];
        let Some(rx) = &w.reset_reply else {
            return Ok(false);
        };
        match rx.try_recv() {
            Ok(Ok(h)) => {
                w.handles = Some(h);
                w.reset_reply = None;
                Ok(true)
            }
            Ok(Err(e)) => anyhow::bail!("resetting the ring of instance {i}: {e}"),
            Err(TryRecvError::Empty) => Ok(false),
            Err(TryRecvError::Disconnected) => anyhow::bail!("the data plane stopped"),
        }
    }
}

impl std::ops::Deref for WorkerTable {
    type Target = [Worker];

    fn deref(&self) -> &[Worker] {
        &self.lanes
    }
}

impl std::ops::DerefMut for WorkerTable {
    fn deref_mut(&mut self) -> &mut [Worker] {
        &mut self.lanes
    }
}

/// Kills every child of the demux that is not one of `workers`: descendants of workers,
/// re-parented to the demux (a child subreaper) when their parent died, however they
/// detached themselves (`setsid`, a new process group). They would otherwise keep what a
/// dead worker held: its ring, its doorbell, the public socket. Returns how many it found.
pub fn kill_orphans(workers: &[Worker]) -> usize {
    let pids: Vec<u32> = workers
        .iter()
        .filter_map(|w| w.child.as_ref().map(ChildProcess::id))
        .collect();
    let mut found = 0;
    for pid in sys::children().unwrap_or_default() {
        if pids.contains(&pid) {
            continue;
        }
        found += 1;
        tracing::warn!(pid, "killing a process left behind by a dead worker");
        sys::kill_and_reap(pid);
    }
    found
}

/// The end of a shutdown cut short (its grace period over, or a second signal): every
/// worker still there is told to cut, given [`policy::CUT_WAIT`] to write its access-log
/// lines and exit, and killed after that.
pub fn cut_all(workers: &mut [Worker], counters: &Counters, lanes: Lanes) {
    let mut told = 0;
    for (i, w) in workers.iter().enumerate() {
        if w.child.is_some() {
            told += 1;
            counters.instances[i].cuts.fetch_add(1, Ordering::Relaxed);
            w.tell(&Message::Cut);
        }
    }
    if told > 0 {
        tracing::warn!(
            workers = told,
            "cutting what the workers still serve; each writes its access log and exits"
        );
    }
    let deadline = Instant::now() + policy::CUT_WAIT;
    loop {
        for w in workers.iter_mut() {
            if w.child.is_some() && w.exited() {
                if let Some(mut c) = w.child.take() {
                    let _ = c.wait();
                }
            }
        }
        let now = Instant::now();
        if workers.iter().all(|w| w.child.is_none()) || now >= deadline {
            break;
        }
        let fds: Vec<BorrowedFd<'_>> = workers
            .iter()
            .filter_map(|w| w.pidfd.as_ref().map(|p| p.as_fd()))
            .collect();
        let wait = deadline
            .saturating_duration_since(now)
            .min(Duration::from_millis(50));
        let _ = sys::poll_readable(&fds, Some(wait));
    }
    for (i, w) in workers.iter_mut().enumerate() {
        if let Some(mut c) = w.child.take() {
            tracing::warn!(
                instance = lanes.at(i).instance,
                "a worker told to cut did not exit in time: killing it"
            );
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// What one packet from a worker's control socket tells the supervisor.
#[derive(Debug)]
pub enum Report {
    /// `READY`: its endpoint is up.
    Ready,
    /// Its counters.
    Stats(WorkerReport),
    /// `STOPPED`: it accepts no new connection.
    Stopped,
    /// `APPLIED seq`: it took the certificate or challenge update `seq`.
    Applied(u64),
    /// A known message whose fields do not parse (counted).
    Malformed,
    /// A message that goes the other way (SHUTDOWN, CUT, CERTIFICATE, CHALLENGES), an unknown
    /// one or an oversized one.
    Ignored,
}

impl Report {
    /// Decodes `packet`; never fails, whatever a worker sends.
    pub fn of(packet: &[u8]) -> Report {
        match Message::decode(packet) {
            Ok(Message::Ready) => Report::Ready,
            Ok(Message::Stats(r)) => Report::Stats(r),
            Ok(Message::Stopped) => Report::Stopped,
            Ok(Message::Applied(seq)) => Report::Applied(seq),
            Err(MessageError::Malformed { .. }) => Report::Malformed,
            Ok(
                Message::Shutdown | Message::Cut | Message::Certificate(_) | Message::Challenges(_),
            )
            | Err(_) => Report::Ignored,
        }
    }
}

/// Logs why the worker `who` is killed, when that is news: the other reasons were logged when
/// they were decided.
fn log_kill(why: policy::Why, who: Named, cfg: &Config) {
    let Named {
        instance,
        generation,
    } = who;
    match why {
        policy::Why::NotReady => tracing::error!(
            instance,
            program = cfg.worker_program(),
            timeout = ?cfg.ready_timeout(),
            "worker did not report READY in time (a worker must call \
             Worker::attach and create its endpoint); killing it"
        ),
        policy::Why::CutIgnored => tracing::warn!(
            instance,
            generation,
            wait = ?policy::CUT_WAIT,
            "a worker told to cut did not exit in time: killing it"
        ),
        policy::Why::Abandoned => {
            tracing::info!(instance, "stopping a worker of the abandoned generation")
        }
        policy::Why::Misbehaved | policy::Why::GraceOver | policy::Why::TooManyDraining => {}
    }
}

/// Logs why the worker `who` is told to cut what it serves, draining for `age`.
fn log_cut(why: policy::Why, who: Named, age: Option<Duration>, cfg: &Config) {
    let Named {
        instance,
        generation,
    } = who;
    match why {
        policy::Why::GraceOver => tracing::warn!(
            instance,
            generation,
            grace = ?cfg.grace(),
            "replaced worker still serving at the end of --grace: cutting what it serves"
        ),
        _ => tracing::warn!(
            instance,
            generation,
            draining_for = ?age,
            max_draining = cfg.max_draining(),
            "the oldest draining generation makes room for a new one \
             (--max-draining): cutting what its worker serves"
        ),
    }
}

/// Logs a worker's death as the policy judged it.
pub fn log_death(d: &policy::Death, program: &str) {
    let (i, uptime, restart_in) = (d.instance, d.uptime, d.restart_in);
    if d.crashes >= 3 {
        tracing::warn!(
            instance = i,
            program,
            crashes = d.crashes,
            ?restart_in,
            "worker is crash-looping; restarts throttled"
        );
    } else if !d.was_ready {
        tracing::warn!(
            instance = i,
            program,
            ?uptime,
            "worker exited before it reported READY; restarting"
        );
    } else {
        tracing::warn!(instance = i, program, ?uptime, "worker died; restarting");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_a_worker_says_is_heard_and_a_closed_socket_is_gone() {
        let (ours, theirs) = sys::seqpacket_pair().unwrap();
        let ours = socket2::Socket::from(ours);
        ours.set_nonblocking(true).unwrap();
        let mut table = WorkerTable::new(2, Instant::now());
        table[1].control = Some(ours.into());
        let counters = Counters::new(1, 2);
        for m in [
            Message::Ready,
            Message::Stopped,
            Message::Applied(3),
            Message::Ready,
        ] {
            sys::send_packet(theirs.as_fd(), &m.encode()).unwrap();
        }
        sys::send_packet(theirs.as_fd(), b"APPLIED x").unwrap();
        let heard = table.read(1, &counters);
        assert_eq!(
            (heard.gone, heard.ready, heard.applied),
            (false, 2, vec![3])
        );
        assert!(table[1].stopped && !table[0].stopped);
        assert_eq!(
            counters.instances[1]
                .reports_malformed
                .load(Ordering::Relaxed),
            1
        );
        // Nothing more to read: still there.
        assert!(!table.read(1, &counters).gone);
        drop(theirs);
        assert!(table.read(1, &counters).gone);
        // A lane without a control socket has nothing to say.
        assert_eq!(table.read(0, &counters).ready, 0);
    }

    #[test]
    fn a_cut_is_told_and_counted_for_its_lane_only() {
        let (ours, theirs) = sys::seqpacket_pair().unwrap();
        let mut table = WorkerTable::new(2, Instant::now());
        table[1].control = Some(ours);
        let counters = Counters::new(1, 2);
        let who = Named {
            instance: 0,
            generation: 3,
        };
        let age = Some(Duration::from_secs(1));
        let argv = ["ringmux", "--worker-cmd", "/bin/true"]
            .map(Into::into)
            .to_vec();
        let cfg = crate::config::parse_from(argv).unwrap().run.validate();
        let cfg = cfg.expect("a valid configuration");
        let why = policy::Why::GraceOver;
        table.cut(1, why, who, age, &cfg, &counters.instances[1]);
        let mut buf = [0; 64];
        let n = sys::recv_packet(theirs.as_fd(), &mut buf).unwrap();
        assert!(matches!(Message::decode(&buf[..n]), Ok(Message::Cut)));
        let cuts = |l: usize| counters.instances[l].cuts.load(Ordering::Relaxed);
        assert_eq!((cuts(0), cuts(1)), (0, 1));
        // Killing a lane without a process does nothing.
        table.kill(0, policy::Why::NotReady, who, &cfg);
    }

    #[test]
    fn a_worker_held_then_reaped_leaves_its_lane_down_and_without_a_pid() {
        let counters = Counters::new(1, 2);
        let liveness = Liveness::new(2);
        let mut table = WorkerTable::new(2, Instant::now());
        let (control, _theirs) = sys::seqpacket_pair().unwrap();
        let worker = Worker {
            control: Some(control),
            ..Worker::default()
        };
        let ic = &counters.instances[1];
        table.adopted(1, worker, 4242, false, ic, &liveness);
        assert!(liveness.is_up(1) && !liveness.is_up(0));
        assert_eq!(ic.worker_pid.load(Ordering::Relaxed), 4242);
        assert!(table[1].control.is_some());
        // An idle lane's worker is held but its lane stays down.
        table.adopted(
            0,
            Worker::default(),
            7,
            true,
            &counters.instances[0],
            &liveness,
        );
        assert!(!liveness.is_up(0));
        let who = Named {
            instance: 0,
            generation: 1,
        };
        table.reap(1, false, who, ic, &liveness);
        assert!(!liveness.is_up(1));
        assert_eq!(ic.worker_pid.load(Ordering::Relaxed), 0);
    }
}
