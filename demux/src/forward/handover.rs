//! A lane's ingress across `ringmux upgrade`: what each mode exports (descriptor numbers and
//! state, serialised into the upgrade's state), and what the new process image takes over
//! (the same, owned). The upgrade itself (`crate::upgrade`) checks every number before it
//! takes one and never looks inside an ingress.

use std::os::fd::{OwnedFd, RawFd};

use serde::{Deserialize, Serialize};

/// A lane's ingress, as its forwarding mode exported it.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub enum IngressState {
    /// Region, consumer page, doorbell read end, doorbell write end; the producer's numbers.
    Shm {
        fds: [RawFd; 4],
        ring: ringmux_ring::ProducerState,
    },
    /// The demux's end of the socket.
    Unix { fd: RawFd },
}

/// A lane's ingress with its descriptors owned.
pub enum Ingress {
    Shm {
        fds: ringmux_ring::ProducerFds,
        ring: ringmux_ring::ProducerState,
    },
    Unix(OwnedFd),
}

impl IngressState {
    /// Appends every descriptor number the ingress names to `fds`.
    pub fn fds(&self, fds: &mut Vec<RawFd>) {
        match self {
            IngressState::Shm { fds: f, .. } => fds.extend(f),
            IngressState::Unix { fd } => fds.push(*fd),
        }
    }

    /// The ingress with its descriptors owned, each taken by `take` (which refuses a number
    /// that is not open or was taken already).
    pub fn take<E>(self, mut take: impl FnMut(RawFd) -> Result<OwnedFd, E>) -> Result<Ingress, E> {
        Ok(match self {
            IngressState::Shm { fds, ring } => Ingress::Shm {
                fds: ringmux_ring::ProducerFds {
                    region: take(fds[0])?,
                    page: take(fds[1])?,
                    doorbell_rx: take(fds[2])?,
                    doorbell_tx: take(fds[3])?,
                },
                ring,
            },
            IngressState::Unix { fd } => Ingress::Unix(take(fd)?),
        })
    }
}
