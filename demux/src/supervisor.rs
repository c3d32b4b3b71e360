//! Worker supervision: spawns `ringmux-worker` processes as direct children, hands each its
//! descriptors and configuration over a control socket, notices a death at once (pidfd and the
//! control socket closing), resets the dead instance's ring and starts a replacement with
//! back-off, and runs the graceful shutdown on SIGTERM/SIGINT. Other instances never notice.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::process::{Child, Command as Process, Stdio};
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, TryRecvError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use nix::sys::signalfd::SignalFd;
use ringmux_proto::{Handoff, Message};
use ringmux_ring::doorbell::Doorbell;

use crate::config::Config;
use crate::dataplane::{DataPlaneLink, Event};
use crate::forward::IngressHandles;
use crate::metrics::Counters;
use crate::sys;

/// Back-off bounds for restarting a crashing worker.
const BACKOFF_MIN: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(5);
/// A worker that ran this long before dying is not in a crash loop.
const HEALTHY_UPTIME: Duration = Duration::from_secs(10);
/// How long the data plane may sit in one doorbell write before the watchdog calls it jammed.
/// A write to a non-blocking eventfd takes microseconds; only a hostile worker (counter filled,
/// `O_NONBLOCK` cleared on the shared file description) can make it block.
const DOORBELL_JAM: Duration = Duration::from_millis(250);

struct Worker {
    child: Option<Child>,
    pidfd: Option<OwnedFd>,
    control: Option<OwnedFd>,
    ready: bool,
    started: Instant,
    backoff: Duration,
    crashes: u32,
    /// A reset was requested; its descriptors arrive here.
    reset_reply: Option<Receiver<std::io::Result<IngressHandles>>>,
    /// Descriptors waiting for the restart time.
    handles: Option<IngressHandles>,
    restart_at: Option<Instant>,
    /// Asked to drain (shutdown).
    draining: bool,
}

pub struct Supervisor {
    cfg: Config,
    template: Handoff,
    public: OwnedFd,
    counters: Arc<Counters>,
    link: DataPlaneLink,
    signals: SignalFd,
    workers: Vec<Worker>,
    sessions: crate::sessions::Sessions,
    /// The supervisor's own descriptor of each instance's doorbell (shm), to reclaim it.
    doorbells: Vec<Option<Doorbell>>,
    /// The watchdog's last view of the data plane: (`ringing`, `recv_calls`), and since when.
    doorbell_watch: ((u32, u64), Instant),
}

impl Supervisor {
    pub fn new(
        cfg: Config,
        template: Handoff,
        public: OwnedFd,
        counters: Arc<Counters>,
        link: DataPlaneLink,
        signals: SignalFd,
    ) -> Self {
        let workers = (0..cfg.instances)
            .map(|_| Worker {
                child: None,
                pidfd: None,
                control: None,
                ready: false,
                started: Instant::now(),
                backoff: BACKOFF_MIN,
                crashes: 0,
                reset_reply: None,
                handles: None,
                restart_at: None,
                draining: false,
            })
            .collect();
        Supervisor {
            cfg,
            template,
            public,
            counters,
            link,
            signals,
            workers,
            sessions: crate::sessions::Sessions::new(),
            doorbells: Vec::new(),
            doorbell_watch: ((0, 0), Instant::now()),
        }
    }

    /// Starts every worker with its initial descriptors and waits until all report ready.
    pub fn start_all(&mut self, handles: Vec<IngressHandles>) -> Result<()> {
        self.doorbells = handles
            .iter()
            .map(|h| match h {
                IngressHandles::Shm([_, _, bell], _) => {
                    bell.try_clone().map(|fd| Some(Doorbell::from_fd(fd)))
                }
                IngressHandles::Unix(_) => Ok(None),
            })
            .collect::<std::io::Result<_>>()
            .context("keeping a descriptor of each doorbell")?;
        for (i, h) in handles.into_iter().enumerate() {
            self.spawn(i as u8, h)
                .with_context(|| format!("starting worker {i}"))?;
        }
        // Wait for every instance to report READY. One that dies or stays silent is logged,
        // replaced and retried with back-off like any later death; only a program of which no
        // instance at all becomes ready in time stops the demux (nothing could serve).
        let deadline = Instant::now() + self.cfg.ready_timeout();
        while self.workers.iter().any(|w| !w.ready) && Instant::now() < deadline {
            let fds: Vec<BorrowedFd<'_>> = self
                .workers
                .iter()
                .filter_map(|w| w.control.as_ref().map(|c| c.as_fd()))
                .collect();
            let _ = sys::poll_readable(&fds, Some(Duration::from_millis(100)));
            for i in 0..self.workers.len() {
                self.check_worker(i, false)?;
            }
        }
        let ready = self.workers.iter().filter(|w| w.ready).count();
        if ready == 0 {
            bail!(
                "no instance of the worker program {} reported READY within {:?} \
                 (--ready-timeout); a worker must call ringmux_worker::Worker::attach and create \
                 its endpoint. See its log above",
                self.cfg.worker_program(),
                self.cfg.ready_timeout()
            );
        }
        tracing::info!(
            ready,
            instances = self.workers.len(),
            program = self.cfg.worker_program(),
            "workers ready"
        );
        Ok(())
    }

    /// Supervises until a shutdown signal, then drains. Returns when every worker is gone.
    pub fn run(&mut self) -> Result<()> {
        let mut shutdown_deadline: Option<Instant> = None;
        loop {
            let mut fds = vec![sys::signal_fd(&self.signals)];
            for w in &self.workers {
                fds.extend(w.pidfd.as_ref().map(|p| p.as_fd()));
                fds.extend(w.control.as_ref().map(|c| c.as_fd()));
            }
            let _ = sys::poll_readable(&fds, Some(Duration::from_millis(50)));
            drop(fds);

            if let Some(sig) = sys::read_signal(&self.signals) {
                if shutdown_deadline.is_none() {
                    tracing::info!(signal = sig, grace = ?self.cfg.grace(), "shutting down: draining workers");
                    shutdown_deadline = Some(Instant::now() + self.cfg.grace());
                    for w in self.workers.iter_mut() {
                        w.draining = true;
                        w.restart_at = None;
                        if let Some(c) = &w.control {
                            let _ = sys::send_packet(c.as_fd(), &Message::Shutdown.encode());
                        }
                    }
                } else {
                    tracing::warn!(signal = sig, "second signal: stopping now");
                    shutdown_deadline = Some(Instant::now());
                }
            }
            while let Some(Event::Misbehaved { instance, stalled }) = self.link.next_event() {
                let w = &mut self.workers[instance as usize];
                tracing::error!(instance, stalled, "killing misbehaving worker");
                if let Some(c) = w.child.as_mut() {
                    let _ = c.kill();
                }
            }
            self.watch_doorbells(shutdown_deadline.is_some());
            for i in 0..self.workers.len() {
                self.check_worker(i, shutdown_deadline.is_some())?;
            }
            if let Some(deadline) = shutdown_deadline {
                if self.workers.iter().all(|w| w.child.is_none()) {
                    tracing::info!("all workers exited");
                    return Ok(());
                }
                if Instant::now() >= deadline {
                    for (i, w) in self.workers.iter_mut().enumerate() {
                        if let Some(mut c) = w.child.take() {
                            tracing::warn!(instance = i, "grace period over: killing worker");
                            let _ = c.kill();
                            let _ = c.wait();
                        }
                    }
                    return Ok(());
                }
            }
        }
    }

    /// One supervision step for worker `i`: its messages, the READY deadline, its death, its
    /// pending restart.
    fn check_worker(&mut self, i: usize, shutting_down: bool) -> Result<()> {
        let w = &mut self.workers[i];
        if !w.ready && w.child.is_some() && w.started.elapsed() > self.cfg.ready_timeout() {
            tracing::error!(
                instance = i,
                program = self.cfg.worker_program(),
                timeout = ?self.cfg.ready_timeout(),
                "worker did not report READY in time (a worker must call Worker::attach and \
                 create its endpoint); killing it"
            );
            if let Some(c) = w.child.as_mut() {
                let _ = c.kill();
            }
        }
        let gone = self.read_control(i) == Liveness::Gone || self.exited(i);
        if gone && self.workers[i].child.is_some() {
            self.on_death(i, shutting_down);
        }
        self.progress_restart(i)
    }

    fn spawn(&mut self, i: u8, handles: IngressHandles) -> Result<()> {
        let (ours, theirs) = sys::seqpacket_pair()?;
        let (sess_ours, sess_theirs) = sys::seqpacket_pair()?;
        let mut h = self.template.clone();
        h.instance = i;
        h.cpu = self.cfg.worker_cpu(i);
        h.ingress = handles.kind();
        let mut fds: Vec<OwnedFd> = vec![self.public.try_clone()?];
        match handles {
            IngressHandles::Shm([r, p, b], generation) => {
                h.generation = generation;
                fds.extend([r, p, b]);
            }
            IngressHandles::Unix(u) => fds.push(u),
        }
        fds.push(sess_theirs);
        let mut cmd = Process::new(self.cfg.worker_program());
        cmd.args(&self.cfg.worker_cmd[1..]);
        cmd.env(ringmux_proto::CONTROL_FD_ENV, "3")
            .stdin(Stdio::null());
        sys::pass_control_socket(&mut cmd, theirs.as_fd());
        let child = cmd
            .spawn()
            .with_context(|| format!("spawning {}", self.cfg.worker_program()))?;
        drop(theirs);
        let pidfd = sys::pidfd_open(child.id()).ok();
        let borrowed: Vec<BorrowedFd<'_>> = fds.iter().map(|f| f.as_fd()).collect();
        sys::send_with_fds(ours.as_fd(), h.encode().as_bytes(), &borrowed)
            .context("sending the hand-off")?;
        drop(fds);
        self.sessions.serve(i, sess_ours);
        self.counters.instances[i as usize]
            .worker_pid
            .store(u64::from(child.id()), Ordering::Relaxed);
        let w = &mut self.workers[i as usize];
        tracing::info!(
            instance = i,
            pid = child.id(),
            generation = h.generation,
            "worker started"
        );
        w.child = Some(child);
        w.pidfd = pidfd;
        w.control = Some(ours);
        w.ready = false;
        w.started = Instant::now();
        Ok(())
    }

    /// Reads pending control messages of worker `i`.
    fn read_control(&mut self, i: usize) -> Liveness {
        let mut buf = [0u8; 1024];
        loop {
            let Some(control) = self.workers[i].control.as_ref() else {
                return Liveness::Alive;
            };
            let n = match sys::recv_packet(control.as_fd(), &mut buf) {
                Ok(0) => return Liveness::Gone,
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Liveness::Alive,
                Err(_) => return Liveness::Gone,
            };
            let ic = &self.counters.instances[i];
            match buf.get(..n).map(Message::decode) {
                Some(Ok(Message::Ready)) => {
                    self.workers[i].ready = true;
                    ic.alive.store(true, Ordering::Release);
                    tracing::info!(instance = i, "worker ready");
                }
                Some(Ok(Message::Stats(r))) => ic.record_report(&r),
                // SHUTDOWN goes the other way; unknown or oversized messages are ignored.
                Some(Ok(Message::Shutdown) | Err(_)) | None => {}
            }
        }
    }

    /// The watchdog for jammed doorbells: the data plane stuck in one instance's doorbell write
    /// (the `ringing` marker unchanged and no receive completed) for [`DOORBELL_JAM`] means the
    /// worker filled its eventfd and made it blocking. Killing the worker and reclaiming the
    /// eventfd (in `on_death`) releases the write; the ring is then reset as after any death.
    fn watch_doorbells(&mut self, shutting_down: bool) {
        let now = Instant::now();
        let view = (
            self.counters.ringing.load(Ordering::Relaxed),
            self.counters.recv_calls.load(Ordering::Relaxed),
        );
        if view.0 == 0 || view != self.doorbell_watch.0 {
            self.doorbell_watch = (view, now);
            return;
        }
        if now.duration_since(self.doorbell_watch.1) < DOORBELL_JAM {
            return;
        }
        self.doorbell_watch.1 = now;
        let i = (view.0 - 1) as usize;
        if i >= self.workers.len() {
            return;
        }
        tracing::error!(
            instance = i,
            "the data plane is blocked writing this worker's doorbell (eventfd filled and made blocking); killing the worker"
        );
        self.counters.instances[i]
            .violations
            .fetch_add(1, Ordering::Relaxed);
        if let Some(c) = self.workers[i].child.as_mut() {
            // Killed here even while shutting down: it will not drain.
            let _ = c.kill();
            self.on_death(i, shutting_down);
        } else if let Some(Some(bell)) = self.doorbells.get(i) {
            // Already gone (and reclaimed then), yet still jammed: reclaim again.
            let _ = bell.reclaim();
        }
    }

    fn exited(&mut self, i: usize) -> bool {
        match self.workers[i].child.as_mut().map(|c| c.try_wait()) {
            Some(Ok(Some(_))) => true,
            Some(Ok(None)) | None => false,
            Some(Err(_)) => true,
        }
    }

    fn on_death(&mut self, i: usize, shutting_down: bool) {
        let ic = &self.counters.instances[i];
        ic.alive.store(false, Ordering::Release);
        ic.worker_pid.store(0, Ordering::Relaxed);
        let w = &mut self.workers[i];
        let mut child = w.child.take().expect("caller checked");
        // A draining worker closes its control socket as it exits: let it finish. Otherwise the
        // socket may close a moment before a crashing process is gone: make sure it is.
        if !(shutting_down || w.draining) {
            let _ = child.kill();
        }
        let status = child.wait().ok();
        // The worker is gone and cannot touch its eventfd any more: undo whatever it did to it
        // (a filled counter and a cleared O_NONBLOCK would block the data plane's next doorbell
        // write, or release one blocked now).
        if let Some(Some(bell)) = self.doorbells.get(i) {
            if let Err(e) = bell.reclaim() {
                tracing::warn!(instance = i, error = %e, "reclaiming the doorbell failed");
            }
        }
        let w = &mut self.workers[i];
        let was_ready = w.ready;
        w.pidfd = None;
        w.control = None;
        w.ready = false;
        if shutting_down || w.draining {
            tracing::info!(instance = i, ?status, "worker exited");
            return;
        }
        let uptime = w.started.elapsed();
        if uptime >= HEALTHY_UPTIME {
            w.backoff = BACKOFF_MIN;
            w.crashes = 0;
        } else {
            w.crashes += 1;
        }
        let program = self.cfg.worker_program();
        if w.crashes >= 3 {
            tracing::warn!(instance = i, program, ?status, crashes = w.crashes, backoff = ?w.backoff, "worker is crash-looping; restarts throttled");
        } else if !was_ready {
            tracing::warn!(
                instance = i,
                program,
                ?status,
                ?uptime,
                "worker exited before it reported READY; restarting"
            );
        } else {
            tracing::warn!(
                instance = i,
                program,
                ?status,
                ?uptime,
                "worker died; restarting"
            );
        }
        w.restart_at = Some(
            Instant::now()
                + if w.crashes == 0 {
                    Duration::ZERO
                } else {
                    w.backoff
                },
        );
        w.backoff = (w.backoff * 2).min(BACKOFF_MAX);
        w.reset_reply = Some(self.link.request_reset(i as u8));
    }

    fn progress_restart(&mut self, i: usize) -> Result<()> {
        let w = &mut self.workers[i];
        if let Some(rx) = &w.reset_reply {
            match rx.try_recv() {
                Ok(Ok(h)) => {
                    w.handles = Some(h);
                    w.reset_reply = None;
                }
                Ok(Err(e)) => bail!("resetting the ring of instance {i}: {e}"),
                Err(TryRecvError::Empty) => {}
                Err(TryRecvError::Disconnected) => bail!("the data plane stopped"),
            }
        }
        let due = w.restart_at.is_some_and(|t| Instant::now() >= t);
        if due && w.handles.is_some() && !w.draining {
            let h = w.handles.take().expect("checked");
            w.restart_at = None;
            self.counters.instances[i]
                .restarts
                .fetch_add(1, Ordering::Relaxed);
            if let Err(e) = self.spawn(i as u8, h) {
                tracing::error!(instance = i, error = %format!("{e:#}"), "restart failed; retrying");
                let w = &mut self.workers[i];
                w.restart_at = Some(Instant::now() + w.backoff);
                w.backoff = (w.backoff * 2).min(BACKOFF_MAX);
                w.reset_reply = Some(self.link.request_reset(i as u8));
            }
        }
        Ok(())
    }
}

#[derive(PartialEq, Eq)]
enum Liveness {
    Alive,
    Gone,
}
