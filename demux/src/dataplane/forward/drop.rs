//! `drop`: route every datagram, then discard it. The floor the benchmarks compare against:
//! receiving and routing without handing anything over. Workers still get (idle) rings so that
//! supervision is the same as in `shm`.

use std::io;

use ringmux_ring::layout::SlotDesc;

use super::shm::Shm;
use super::{Forward, IngressHandles, Setup};
use crate::metrics::DropReason;

/// Idle rings, never pushed to. (Not `Drop`: that name would shadow the prelude's trait.)
pub struct Discard {
    idle: Shm,
}

impl Discard {
    pub fn create(setup: &Setup<'_>) -> io::Result<(Self, Vec<IngressHandles>)> {
        let (idle, handles) = Shm::create(setup)?;
        Ok((Discard { idle }, handles))
    }

    /// The idle rings a previous process image of the demux handed over.
    pub fn adopt(
        setup: &Setup<'_>,
        lanes: Vec<Option<crate::forward::handover::Ingress>>,
    ) -> io::Result<Self> {
        Ok(Discard {
            idle: Shm::adopt(setup, lanes)?,
        })
    }
}

impl Forward for Discard {
    const DELIVERS: bool = false;

    #[inline]
    fn push(&mut self, _lane: usize, _desc: &SlotDesc, _payload: &[u8]) -> Result<(), DropReason> {
        Err(DropReason::Discarded)
    }

    fn reset(&mut self, lane: usize) -> io::Result<(IngressHandles, u64)> {
        self.idle.reset(lane)
    }

    fn close(&mut self, lane: usize) -> u64 {
        self.idle.close(lane)
    }

    fn export(
        &mut self,
        lane: usize,
    ) -> io::Result<Option<crate::forward::handover::IngressState>> {
        self.idle.export(lane)
    }
}
