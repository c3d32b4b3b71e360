//! `shm`: one shared-memory ring per instance (`ringmux_ring`, `shm-layout.md`). A datagram is
//! copied into a slot; slots are published once per receive batch; the doorbell is rung only
//! when the worker announced a sleep.

use std::io;

use ringmux_ring::layout::SlotDesc;
use ringmux_ring::{Producer, PushError};

use super::{Forward, Gauges, IngressHandles, Setup};
use crate::metrics::DropReason;

/// The producers of every instance's ring.
pub struct Shm {
    rings: Vec<Producer>,
}

impl Shm {
    /// One ring per instance.
    pub fn create(setup: &Setup<'_>) -> io::Result<(Self, Vec<IngressHandles>)> {
        let mut rings = Vec::new();
        let mut handles = Vec::new();
        for _ in 0..setup.instances {
            let p = Producer::create(setup.ring).map_err(io::Error::other)?;
            handles.push(handles_of(&p)?);
            rings.push(p);
        }
        Ok((Shm { rings }, handles))
    }
}

impl Forward for Shm {
    #[inline]
    fn push(&mut self, inst: usize, desc: &SlotDesc, payload: &[u8]) -> Result<(), DropReason> {
        match self.rings[inst].try_push_desc(desc, payload) {
            Ok(()) => Ok(()),
            Err(PushError::Full) => Err(DropReason::RingFull),
            Err(PushError::Oversize { .. }) => Err(DropReason::Oversize),
            // The router refuses an empty datagram first; counted the same if one got here.
            Err(PushError::Empty) => Err(DropReason::Malformed),
            Err(PushError::Violation(e)) => {
                tracing::error!(instance = inst, error = %e, "worker broke the ring protocol");
                Err(DropReason::RingViolation)
            }
        }
    }

    fn publish(&mut self) {
        for r in &mut self.rings {
            r.publish();
        }
    }

    fn reset(&mut self, inst: usize) -> io::Result<(IngressHandles, u64)> {
        let ring = &mut self.rings[inst];
        let discarded = ring.reset()?;
        Ok((handles_of(ring)?, discarded))
    }

    fn gauges(&mut self, inst: usize) -> Option<Gauges> {
        let ring = &mut self.rings[inst];
        let violation = ring.check_consumer().err().map(|e| e.to_string());
        let s = ring.stats();
        Some(Gauges {
            occupancy: s.occupancy,
            doorbells: s.doorbells,
            published: s.published,
            violation,
        })
    }
}

/// Duplicates a ring's consumer descriptors for a hand-off.
fn handles_of(p: &Producer) -> io::Result<IngressHandles> {
    let h = p.handles();
    Ok(IngressHandles::Shm(
        [
            h.ring.try_clone_to_owned()?,
            h.page.try_clone_to_owned()?,
            h.doorbell.try_clone_to_owned()?,
        ],
        h.generation,
    ))
}
