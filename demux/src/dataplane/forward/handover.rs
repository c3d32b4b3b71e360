//! A lane's ingress across `ringmux upgrade`: what each mode exports and what the new process
//! image takes over are one type, [`Ingress`], over how its descriptors are held: by number
//! (`Ingress<RawFd>`, [`IngressState`], serialised into the upgrade's state) or owned
//! (`Ingress<OwnedFd>`, what a mode's `adopt` maps again). The upgrade (`crate::upgrade`)
//! checks every number before it takes one and never looks inside an ingress.

use std::os::fd::{OwnedFd, RawFd};

use serde::{Deserialize, Serialize};

/// A lane's ingress, as its forwarding mode exported it; its descriptors are `F`s.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub enum Ingress<F = OwnedFd> {
    /// Region, consumer page, doorbell read end, doorbell write end; the producer's numbers.
    Shm {
        fds: [F; 4],
        ring: ringmux_ring::ProducerState,
    },
    /// The demux's end of the socket.
    Unix { fd: F },
}

/// A lane's ingress by descriptor number, as a mode exports it and the state names it.
pub type IngressState = Ingress<RawFd>;

impl<F> Ingress<F> {
    /// Every descriptor of the ingress.
    pub fn fds(&self) -> impl Iterator<Item = &F> {
        let (ring, socket) = match self {
            Ingress::Shm { fds, .. } => (Some(fds), None),
            Ingress::Unix { fd } => (None, Some(fd)),
        };
        ring.into_iter().flatten().chain(socket)
    }

    /// The same ingress with each descriptor passed through `f` (taking a number over, say),
    /// in the order [`Ingress::fds`] lists them; the first error stops it.
    pub fn try_map<G, E>(self, f: &mut impl FnMut(F) -> Result<G, E>) -> Result<Ingress<G>, E> {
        Ok(match self {
            Ingress::Shm {
                fds: [region, page, rx, tx],
                ring,
            } => Ingress::Shm {
                fds: [f(region)?, f(page)?, f(rx)?, f(tx)?],
                ring,
            },
            Ingress::Unix { fd } => Ingress::Unix { fd: f(fd)? },
        })
    }
}

/// A ring's descriptors in [`Ingress::Shm`]'s order, as `Producer::adopt` takes them.
pub fn producer_fds(
    [region, page, doorbell_rx, doorbell_tx]: [OwnedFd; 4],
) -> ringmux_ring::ProducerFds {
    ringmux_ring::ProducerFds {
        region,
        page,
        doorbell_rx,
        doorbell_tx,
    }
}
