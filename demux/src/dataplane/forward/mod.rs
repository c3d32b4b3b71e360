//! Forwarding modes: how a routed datagram reaches its instance. Each mode is one file behind
//! one interface, [`Forward`]; the data plane is generic over it, so a mode's `push` is
//! inlined into the receive loop and costs nothing for being behind a trait.
//!
//! | mode | file | a datagram becomes | ingress handed to the worker |
//! |---|---|---|---|
//! | `shm` | [`shm`] | a ring slot, published once per batch | ring memfd, consumer page, doorbell |
//! | `unix` | [`unix`] | one `sendmsg` on a `SOCK_SEQPACKET` socket (the baseline) | the socket's other end |
//! | `drop` | [`drop`](mod@drop) | nothing: routed and discarded (the benchmarks' floor) | an idle ring |
//! | `reuseport` | [`reuseport`] | nothing: the kernel steers each datagram to its lane's socket ([`steering`]) | its lane's `SO_REUSEPORT` socket, as descriptor 4 |
//!
//! Everything that differs per mode lives here, on the mode's types: the data plane's side
//! ([`Forward`]), what the rest of the demux asks of it ([`ForwardMode`], the `--forward` option: does it
//! upgrade, does the demux see handshakes, do workers receive on their own sockets), what a
//! worker is handed ([`IngressHandles::hand_off`]), what crosses `ringmux upgrade`
//! ([`handover`]), and how lanes are numbered ([`lane`]). Adding a mode: a file here
//! implementing [`Forward`], a variant of [`ForwardMode`] answered in its impl, one line
//! in [`start`] (and [`adopt`] if it upgrades), its `ringmux_proto::IngressKind` on the wire and
//! its reader in the worker's `ingress/`.

pub mod drop;
pub mod handover;
pub mod lane;
mod mode;
pub mod reuseport;
pub mod shm;
pub mod steering;
pub mod unix;

use std::io;
use std::os::fd::OwnedFd;

use ringmux_proto::{Handoff, IngressKind};
use ringmux_ring::layout::SlotDesc;
use ringmux_ring::RingConfig;

use crate::metrics::DropReason;
pub use lane::{Lane, Lanes};
pub use mode::{adopt, start, ForwardMode, WithForward};

/// One forwarding mode, as the data plane drives it. It forwards to *lanes*: one per instance
/// and worker generation slot, numbered `slot * instances + instance`
/// (`ringmux_quic_lb::Router::lane`), so `0..instances` are the first generation's. A lane has
/// an ingress from its first [`Forward::reset`] (the first generation's from the start) until
/// [`Forward::close`]; pushing to one without is [`DropReason::InstanceDown`].
pub trait Forward: Send + 'static {
    /// Whether datagrams reach workers at all (`drop` discards every one, so a worker that is
    /// down changes nothing: its datagrams count as discarded, not as `instance_down`).
    const DELIVERS: bool = true;

    /// Hands one datagram (its slot descriptor and payload) to lane `lane`, or says why
    /// not. [`DropReason::RingViolation`] means the worker broke the ring protocol: the data
    /// plane stops forwarding to it until the next [`Forward::reset`].
    fn push(&mut self, lane: usize, desc: &SlotDesc, payload: &[u8]) -> Result<(), DropReason>;

    /// Whether lane `lane`'s ingress is too full to admit new connections (the occupancy
    /// threshold of [`Setup::shed_at`]). Modes without an occupancy never are.
    #[inline]
    fn crowded(&mut self, _lane: usize) -> bool {
        false
    }

    /// Makes everything pushed since the last call visible to the workers. Called once per
    /// receive batch, and before the data plane stops. `busy`: the receive that brought this
    /// batch filled it and came soon after the one before, so the next publish is near (a
    /// ring's consumer then spins for it rather than sleep, `ringmux_ring::spin::BUSY_SPIN`).
    fn publish(&mut self, _busy: bool) {}

    /// Starts a new generation of lane `lane`'s ingress for a replacement worker: whatever
    /// the old worker left unread is discarded (returned as a count) and the new worker's
    /// descriptors come back.
    fn reset(&mut self, lane: usize) -> io::Result<(IngressHandles, u64)>;

    /// Closes lane `lane`'s ingress when its generation is gone (its memory returns), and says
    /// how many datagrams were left unread in it.
    fn close(&mut self, lane: usize) -> u64;

    /// Lane `lane`'s ingress for a new process image of the demux (`ringmux upgrade`): its
    /// state and descriptor numbers, which stay owned here until `execve` hands them on.
    /// `None`: the lane has no ingress.
    fn export(&mut self, lane: usize)
        -> io::Result<Option<crate::forward::handover::IngressState>>;

    /// New connections go to the lanes of generation slot `slot` from now on (a reload). Only
    /// a mode that steers without the data plane needs to hear of it.
    fn activate(&mut self, _slot: u8) {}

    /// The gauges of lane `lane`'s ingress, when the mode has any (rings do).
    fn gauges(&mut self, _lane: usize) -> Option<Gauges> {
        None
    }
}

/// What a ring shows of its consumer, read every gauge period.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Gauges {
    /// Slots published and not yet consumed.
    pub occupancy: u64,
    /// Doorbells rung since the ring was created.
    pub doorbells: u64,
    /// Slots published since the ring was created.
    pub published: u64,
    /// The consumer broke the ring protocol: what it did.
    pub violation: Option<String>,
}

/// Descriptors for a (re)started worker's ingress, in hand-off order.
pub enum IngressHandles {
    /// Ring memfd, consumer page, doorbell; the consumer generation to attach.
    Shm([OwnedFd; 3], u64),
    /// The worker's end of its `SOCK_SEQPACKET` socket.
    Unix(OwnedFd),
    /// The lane's socket in the public address's `SO_REUSEPORT` group: the worker's
    /// descriptor 4, in place of the demux's public socket.
    Reuseport(OwnedFd),
}

impl IngressHandles {
    /// Writes into the worker's hand-off `h` what it says of these descriptors (their kind,
    /// the ring's consumer generation), appends those handed after the control socket to
    /// `fds`, in hand-off order, and returns the one that becomes the worker's descriptor 4 in
    /// place of the public socket, if any.
    pub fn hand_off(self, h: &mut Handoff, fds: &mut Vec<OwnedFd>) -> Option<OwnedFd> {
        match self {
            IngressHandles::Shm([region, page, doorbell], generation) => {
                h.ingress = IngressKind::Shm;
                h.generation = generation;
                fds.extend([region, page, doorbell]);
                None
            }
            IngressHandles::Unix(socket) => {
                h.ingress = IngressKind::Unix;
                fds.push(socket);
                None
            }
            IngressHandles::Reuseport(socket) => {
                h.ingress = IngressKind::Reuseport;
                Some(socket)
            }
        }
    }
}

/// Why the ingresses a previous process image of the demux handed over do not fit this one
/// (`adopt` of a mode). As an [`io::Error`] its kind is `InvalidData`, or the kind of the
/// source for a ring that cannot be mapped again.
#[derive(Debug, thiserror::Error)]
pub enum AdoptError {
    #[error("{handed} lanes handed over, {expected} expected")]
    LaneCount { handed: usize, expected: usize },
    /// The lane's ingress is of another mode than this image runs.
    #[error("lane {lane} was handed {handed}, not {expected}")]
    OtherMode {
        lane: usize,
        handed: &'static str,
        expected: &'static str,
    },
    #[error("lane {lane}'s ring")]
    Ring {
        lane: usize,
        #[source]
        source: io::Error,
    },
}

impl AdoptError {
    /// Checks that `handed` lanes came for a mode of `expected` lanes.
    pub fn check_count(handed: usize, expected: usize) -> Result<(), AdoptError> {
        if handed == expected {
            Ok(())
        } else {
            Err(AdoptError::LaneCount { handed, expected })
        }
    }
}

impl From<AdoptError> for io::Error {
    fn from(e: AdoptError) -> io::Error {
        let kind = match &e {
            AdoptError::Ring { source, .. } => source.kind(),
            AdoptError::LaneCount { .. } | AdoptError::OtherMode { .. } => {
                io::ErrorKind::InvalidData
            }
        };
        io::Error::new(kind, e)
    }
}

/// What every mode is built from.
pub struct Setup<'a> {
    pub instances: u8,
    /// Lanes in all (instances × generation slots).
    pub lanes: usize,
    pub ring: &'a RingConfig,
    /// Occupancy (slots) from which a ring admits no new connections (`--initial-shed-at`);
    /// `u64::MAX`: never.
    pub shed_at: u64,
    /// The public socket, for a mode whose lanes join its group (`ForwardMode::workers_receive`;
    /// `None` for every other mode).
    pub public: Option<Public>,
}

/// The public socket (a duplicate) and what a lane's socket in its `SO_REUSEPORT` group is
/// made like.
pub struct Public {
    pub socket: OwnedFd,
    pub router: ringmux_quic_lb::Router,
    /// Buffer sizes of each lane's socket (bytes; as the public socket's).
    pub rcvbuf: usize,
    pub sndbuf: usize,
}
