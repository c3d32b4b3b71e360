//! `reuseport`: kernel steering, the alternative to a user-space demux that users weigh. Every
//! lane gets its own UDP socket bound to the public address with `SO_REUSEPORT`, and a classic
//! BPF program attached to the group ([`super::steering`]) picks the socket of each datagram
//! from its connection ID. Workers receive and send on their lane's socket; the data plane
//! receives nothing (the demux's own public socket is the group's index 0, which the program
//! never picks) and the demux only supervises.
//!
//! What it gives up against the rings, by construction: the kernel cannot decrypt a connection
//! ID (plaintext QUIC-LB CIDs only), the demux counts no datagram and sheds, retries or budgets
//! no new connection, and client-chosen DCIDs are spread by a plain function of their first
//! octets rather than a keyed hash. What it keeps: datagrams for a worker that is down wait in
//! its socket's queue for the replacement (the demux holds every lane's socket, so a socket
//! and its place in the group outlive its workers), and routing stays a pure function of the
//! CID, so migration and NAT rebinding need nothing.
//!
//! The group's order is fixed at start: the public socket first, then lane 0, 1, … Sockets
//! are never closed while the demux runs (closing one would move the group's last socket into
//! its place and misroute every lane after it).

use std::io;
use std::net::SocketAddr;
use std::os::fd::{AsFd, OwnedFd};

use ringmux_ring::layout::SlotDesc;

use super::steering::SteeringPlan;
use super::{Forward, IngressHandles, Setup};
use crate::metrics::DropReason;
use crate::sys;

/// What the group is built from: the demux's public socket (bound with `SO_REUSEPORT`, the
/// group's index 0) and the plan of the steering program.
pub struct Group {
    pub public: OwnedFd,
    pub addr: SocketAddr,
    pub plan: SteeringPlan,
    /// Buffer sizes of each lane's socket (bytes; as the public socket's).
    pub rcvbuf: usize,
    pub sndbuf: usize,
}

/// Why `ringmux upgrade` refuses this mode: a new process image cannot take a group over yet.
pub const NOT_UPGRADED: &str =
    "ringmux upgrade does not take over a --forward reuseport group yet: restart instead";

/// Every lane's socket in the group, and the program that steers to them.
pub struct Reuseport {
    group: Group,
    lanes: Vec<OwnedFd>,
    /// The program for each generation slot being the active one, made at start: a reload
    /// attaches one from the data plane, which allocates nothing.
    programs: Vec<Vec<libc::sock_filter>>,
}

impl Reuseport {
    /// Binds one socket per lane in the group after the public socket, then attaches the
    /// program with generation slot 0 active.
    pub fn create(setup: &Setup<'_>, group: Group) -> io::Result<(Self, Vec<IngressHandles>)> {
        let lanes = (0..setup.lanes)
            .map(|_| lane_socket(&group))
            .collect::<io::Result<Vec<_>>>()?;
        let programs = (0..ringmux_proto::GENERATION_SLOTS)
            .map(|slot| {
                let mut plan = group.plan.clone();
                plan.active_slot = slot;
                plan.program()
            })
            .collect();
        let r = Reuseport {
            group,
            lanes,
            programs,
        };
        r.steer(0)?;
        let handles = (0..usize::from(setup.instances))
            .map(|lane| r.handle(lane))
            .collect::<io::Result<Vec<_>>>()?;
        Ok((r, handles))
    }

    /// (Re)attaches the steering program with `slot` the generation slot new connections go
    /// to. Attaching replaces the group's program at once.
    fn steer(&self, slot: u8) -> io::Result<()> {
        let program = self
            .programs
            .get(usize::from(slot))
            .ok_or(NoSuch::Slot(slot))?;
        sys::attach_reuseport_program(self.group.public.as_fd(), program)
    }

    /// A duplicate of lane `lane`'s socket for its worker.
    fn handle(&self, lane: usize) -> io::Result<IngressHandles> {
        let sock = self.lanes.get(lane).ok_or(NoSuch::Lane(lane))?;
        Ok(IngressHandles::Reuseport(sock.try_clone()?))
    }
}

impl Forward for Reuseport {
    /// The data plane only receives what the program failed to steer (it never picks the
    /// public socket): counted, never delivered.
    #[inline]
    fn push(&mut self, _lane: usize, _desc: &SlotDesc, _payload: &[u8]) -> Result<(), DropReason> {
        Err(DropReason::Unsteered)
    }

    /// The lane's socket again: what the last worker left unread waits in its queue for the
    /// next one (datagrams of an older generation's connections get a stateless reset).
    fn reset(&mut self, lane: usize) -> io::Result<(IngressHandles, u64)> {
        Ok((self.handle(lane)?, 0))
    }

    /// Nothing to close: the socket keeps its place in the group.
    fn close(&mut self, _lane: usize) -> u64 {
        0
    }

    fn activate(&mut self, slot: u8) {
        if let Err(e) = self.steer(slot) {
            tracing::error!(slot, error = %e, "could not re-attach the steering program: new connections still reach the previous generation");
        }
    }

    fn export(
        &mut self,
        _lane: usize,
    ) -> io::Result<Option<crate::forward::handover::IngressState>> {
        Err(io::Error::new(io::ErrorKind::Unsupported, NOT_UPGRADED))
    }
}

/// A generation slot or lane the group was not made with (a caller's mistake: `InvalidInput`).
#[derive(Debug, thiserror::Error)]
enum NoSuch {
    #[error("no steering program for generation slot {0}")]
    Slot(u8),
    #[error("no lane {0}")]
    Lane(usize),
}

impl From<NoSuch> for io::Error {
    fn from(e: NoSuch) -> io::Error {
        io::Error::new(io::ErrorKind::InvalidInput, e)
    }
}

/// A UDP socket of the group: `SO_REUSEPORT`, bound to the public address, non-blocking.
fn lane_socket(group: &Group) -> io::Result<OwnedFd> {
    let s = sys::udp_socket(group.addr)?;
    s.set_reuse_port(true)?;
    // The program is attached through the public socket; none may be through a lane's.
    sys::lock_filter(s.as_fd())?;
    sys::size_buffers(&s, group.rcvbuf, group.sndbuf);
    s.set_nonblocking(true)?;
    s.bind(&group.addr.into())?;
    Ok(s.into())
}
