//! Every descriptor the demux keeps for its life, in one type over how it holds them:
//! `Fds<OwnedFd>` is what a start owns, bound anew or taken from a hand-over (the only
//! difference between a first start and a start by `ringmux upgrade`); `Fds<RawFd>` is the
//! same set by number, as an old image names it in the hand-over's [`State`](super::State). As
//! pingora's `transfer_fd::Fds` keys the listeners it passes on, every descriptor here has its
//! place by name, so that nothing needs a second, mirrored set of types to cross `execve`.
//!
//! This module holds and lists descriptors; it never binds, maps or reads one.

use std::os::fd::RawFd;

use serde::{Deserialize, Serialize};

pub use crate::forward::handover::Ingress;

/// The public socket, the listeners, the control socket with the clients waiting on it, the
/// health tables, and the lanes with their workers' and ingresses' descriptors. The serialised names (`public_fd`,
/// …) are the hand-over state's since its format 4.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[serde(bound(deserialize = "F: Deserialize<'de>"))]
pub struct Fds<F> {
    /// The public UDP socket.
    #[serde(rename = "public_fd")]
    pub public: F,
    /// The metrics listener (`--metrics`).
    #[serde(rename = "metrics_fd")]
    pub metrics: Option<F>,
    /// The listening TCP socket every worker accepts from (`--tcp on`).
    #[serde(rename = "tcp_fd")]
    pub tcp: Option<F>,
    /// The listening socket for plain HTTP every worker redirects from (`--redirect-http`).
    #[serde(rename = "redirect_fd")]
    pub redirect: Option<F>,
    /// The control socket's listener (`--control-socket`, unless `off`).
    #[serde(rename = "control_fd")]
    pub control: Option<F>,
    /// Control clients waiting for the upgrade's outcome.
    #[serde(rename = "answer_fds")]
    pub answers: Vec<F>,
    /// The health tables the running workers read, newest first, by the demux's own
    /// (writable) descriptor: the new image writes their verdicts on
    /// (`crate::supervisor::health`). Absent from the document when there is none, and from an
    /// image before they were handed over (its workers' verdicts then wait for a reload).
    #[serde(default, rename = "health_fds", skip_serializing_if = "Vec::is_empty")]
    pub health: Vec<F>,
    /// One per lane, as `ringmux_quic_lb::Router::lane` numbers them; none at a first start
    /// (the forwarding mode makes the ingresses, the supervisor starts the workers).
    pub lanes: Vec<Lane<F>>,
}

/// One lane: its worker and its ingress.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct Lane<F> {
    pub generation: u64,
    pub phase: LanePhase,
    pub worker: Option<Worker<F>>,
    pub ingress: Option<Ingress<F>>,
}

/// What the lane's worker is doing.
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
pub enum LanePhase {
    Idle,
    Ready,
    Draining { elapsed_ms: u64, told: bool },
}

/// A running worker: a child of the demux, and the demux's ends of its sockets and pipes.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[serde(bound(deserialize = "F: Deserialize<'de>"))]
pub struct Worker<F> {
    pub pid: u32,
    /// The demux's end of its control socket.
    #[serde(rename = "control_fd")]
    pub control: F,
    /// The demux's end of its session socket.
    #[serde(rename = "sessions_fd")]
    pub sessions: F,
    /// The read end of its output pipe (absent from an image whose workers wrote to its
    /// standard error).
    #[serde(default, rename = "output_fd")]
    pub output: Option<F>,
    /// The read end of its access-log pipe (`--access-log`).
    #[serde(default, rename = "access_fd")]
    pub access: Option<F>,
}

impl<F> Fds<F> {
    /// The descriptors held for the demux's life, with no lanes yet (a first start).
    pub fn new(public: F) -> Self {
        Fds {
            public,
            metrics: None,
            tcp: None,
            redirect: None,
            control: None,
            answers: Vec::new(),
            health: Vec::new(),
            lanes: Vec::new(),
        }
    }

    /// Every descriptor, in the order [`Fds::try_map`] passes them.
    pub fn iter(&self) -> impl Iterator<Item = &F> {
        std::iter::once(&self.public)
            .chain(&self.metrics)
            .chain(&self.tcp)
            .chain(&self.redirect)
            .chain(&self.control)
            .chain(&self.answers)
            .chain(&self.health)
            .chain(self.lanes.iter().flat_map(Lane::iter))
    }

    /// The same set with each descriptor passed through `f` (a number taken over, say); the
    /// first error stops it, and what `f` returned before is dropped.
    pub fn try_map<G, E>(self, mut f: impl FnMut(F) -> Result<G, E>) -> Result<Fds<G>, E> {
        let f = &mut f;
        Ok(Fds {
            public: f(self.public)?,
            metrics: self.metrics.map(&mut *f).transpose()?,
            tcp: self.tcp.map(&mut *f).transpose()?,
            redirect: self.redirect.map(&mut *f).transpose()?,
            control: self.control.map(&mut *f).transpose()?,
            answers: self
                .answers
                .into_iter()
                .map(&mut *f)
                .collect::<Result<_, E>>()?,
            health: self
                .health
                .into_iter()
                .map(&mut *f)
                .collect::<Result<_, E>>()?,
            lanes: self
                .lanes
                .into_iter()
                .map(|l| l.try_map(f))
                .collect::<Result<_, E>>()?,
        })
    }
}

impl<F> Lane<F> {
    /// Every descriptor of the lane: its worker's, then its ingress's.
    pub fn iter(&self) -> impl Iterator<Item = &F> {
        self.worker
            .iter()
            .flat_map(Worker::iter)
            .chain(self.ingress.iter().flat_map(Ingress::fds))
    }

    fn try_map<G, E>(self, f: &mut impl FnMut(F) -> Result<G, E>) -> Result<Lane<G>, E> {
        Ok(Lane {
            generation: self.generation,
            phase: self.phase,
            worker: self.worker.map(|w| w.try_map(f)).transpose()?,
            ingress: self.ingress.map(|i| i.try_map(f)).transpose()?,
        })
    }
}

impl<F> Worker<F> {
    /// Every descriptor of the worker.
    pub fn iter(&self) -> impl Iterator<Item = &F> {
        [&self.control, &self.sessions]
            .into_iter()
            .chain(&self.output)
            .chain(&self.access)
    }

    fn try_map<G, E>(self, f: &mut impl FnMut(F) -> Result<G, E>) -> Result<Worker<G>, E> {
        Ok(Worker {
            pid: self.pid,
            control: f(self.control)?,
            sessions: f(self.sessions)?,
            output: self.output.map(&mut *f).transpose()?,
            access: self.access.map(&mut *f).transpose()?,
        })
    }
}

impl Fds<RawFd> {
    /// Every descriptor number.
    pub fn numbers(&self) -> Vec<RawFd> {
        self.iter().copied().collect()
    }
}
