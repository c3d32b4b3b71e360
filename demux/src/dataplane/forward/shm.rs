//! `shm`: one shared-memory ring per instance (`ringmux_ring`, `shm-layout.md`). A datagram is
//! copied into a slot; slots are published once per receive batch; the doorbell is rung only
//! when the worker announced a sleep.
//!
//! Every new consumer generation is a whole new ring. Making one (a memfd of the region's size,
//! mapped and populated) and unmapping the old one take milliseconds, during which the data
//! plane would forward nothing for any instance; a helper thread (`Spares`) does both, with
//! one ring made ahead of time. A reset that finds none ready (a reload asks for one per
//! instance at once) answers `WouldBlock`, and the data plane asks again while it forwards.

use std::io;
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TryRecvError};

use ringmux_ring::layout::SlotDesc;
use ringmux_ring::{Producer, PushError, RingConfig};

use std::os::fd::AsRawFd;

use super::handover::{self, Ingress, IngressState};
use super::{AdoptError, Forward, Gauges, IngressHandles, Setup};
use crate::metrics::DropReason;

/// The producers of every lane's ring; a lane without a worker generation has none.
pub struct Shm {
    rings: Vec<Option<Producer>>,
    config: RingConfig,
    spares: Spares,
    shed_at: u64,
}

impl Shm {
    /// One ring per lane of the first generation, and the helper that makes the next.
    pub fn create(setup: &Setup<'_>) -> io::Result<(Self, Vec<IngressHandles>)> {
        let mut rings: Vec<Option<Producer>> = (0..setup.lanes).map(|_| None).collect();
        let mut handles = Vec::new();
        for ring in rings.iter_mut().take(usize::from(setup.instances)) {
            let p = Producer::create(setup.ring)?;
            handles.push(handles_of(&p)?);
            *ring = Some(p);
        }
        let spares = Spares::start(*setup.ring)?;
        let shed_at = setup.shed_at;
        Ok((
            Shm {
                rings,
                config: *setup.ring,
                spares,
                shed_at,
            },
            handles,
        ))
    }
}

impl Shm {
    /// The rings a previous process image of the demux handed over, one entry per lane.
    pub fn adopt(setup: &Setup<'_>, lanes: Vec<Option<Ingress>>) -> io::Result<Self> {
        AdoptError::check_count(lanes.len(), setup.lanes)?;
        let mut rings = Vec::with_capacity(setup.lanes);
        for (lane, ingress) in lanes.into_iter().enumerate() {
            rings.push(match ingress {
                None => None,
                Some(Ingress::Shm { fds, ring }) => Some(
                    Producer::adopt(setup.ring, handover::producer_fds(fds), ring)
                        .map_err(|source| AdoptError::Ring { lane, source })?,
                ),
                Some(Ingress::Unix { .. }) => {
                    return Err(AdoptError::OtherMode {
                        lane,
                        handed: "a unix socket",
                        expected: "a ring",
                    }
                    .into())
                }
            });
        }
        Ok(Shm {
            rings,
            config: *setup.ring,
            spares: Spares::start(*setup.ring)?,
            shed_at: setup.shed_at,
        })
    }
}

/// A thread that makes rings before they are needed and unmaps the ones replaced, off the data
/// plane. Bounded channels: sending allocates nothing, and a full one falls back to doing the
/// work in place.
struct Spares {
    /// Rings made ahead of time (at most one waiting).
    ready: Receiver<io::Result<Producer>>,
    /// Work for the thread.
    orders: SyncSender<Order>,
    /// A ring is ordered and not taken yet.
    ordered: bool,
}

enum Order {
    /// Make one more ring.
    Make,
    /// Unmap and close a replaced ring.
    Retire(Producer),
}

impl Spares {
    fn start(config: RingConfig) -> io::Result<Spares> {
        let (ready_tx, ready) = sync_channel(1);
        let (orders, orders_rx) = sync_channel::<Order>(4);
        std::thread::Builder::new()
            .name("ring-spares".into())
            .spawn(move || {
                // Ends when the data plane drops its `Shm` (and so the sender).
                for order in orders_rx {
                    match order {
                        Order::Make => {
                            if ready_tx.send(Producer::create(&config)).is_err() {
                                return;
                            }
                        }
                        Order::Retire(ring) => drop(ring),
                    }
                }
            })?;
        let ordered = orders.try_send(Order::Make).is_ok();
        Ok(Spares {
            ready,
            orders,
            ordered,
        })
    }

    /// The ring made ahead of time, and orders the next. `WouldBlock` while it is still being
    /// made (a reload takes several in a row): the data plane asks again rather than stall
    /// every instance for the milliseconds one takes. Only if the thread is gone is the ring
    /// made here.
    fn take(&mut self, config: &RingConfig) -> io::Result<Producer> {
        let ring = match self.ready.try_recv() {
            Ok(made) => made,
            Err(TryRecvError::Empty) if self.ordered => {
                return Err(io::ErrorKind::WouldBlock.into());
            }
            Err(TryRecvError::Empty) => {
                // Never ordered (the queue was full): order it and come back.
                self.ordered = self.orders.try_send(Order::Make).is_ok();
                if self.ordered {
                    return Err(io::ErrorKind::WouldBlock.into());
                }
                Producer::create(config)
            }
            Err(TryRecvError::Disconnected) => Producer::create(config),
        };
        self.ordered = self.orders.try_send(Order::Make).is_ok();
        ring
    }

    /// Hands a replaced ring to the thread to unmap, or unmaps it here if the thread is busy
    /// (the refused order, ring inside, is dropped on the spot).
    fn retire(&self, ring: Producer) {
        let _ = self.orders.try_send(Order::Retire(ring));
    }
}

impl Forward for Shm {
    #[inline]
    fn push(&mut self, lane: usize, desc: &SlotDesc, payload: &[u8]) -> Result<(), DropReason> {
        let Some(ring) = &mut self.rings[lane] else {
            return Err(DropReason::InstanceDown);
        };
        match ring.try_push_desc(desc, payload) {
            Ok(()) => Ok(()),
            Err(PushError::Full) => Err(DropReason::RingFull),
            Err(PushError::Oversize { .. }) => Err(DropReason::Oversize),
            // The router refuses an empty datagram first; counted the same if one got here.
            Err(PushError::Empty) => Err(DropReason::Malformed),
            Err(PushError::Violation(e)) => {
                tracing::error!(lane, error = %e, "worker broke the ring protocol");
                Err(DropReason::RingViolation)
            }
        }
    }

    #[inline]
    fn crowded(&mut self, lane: usize) -> bool {
        let shed_at = self.shed_at;
        self.rings[lane]
            .as_mut()
            .is_some_and(|r| r.holds_at_least(shed_at))
    }

    fn publish(&mut self, busy: bool) {
        for r in self.rings.iter_mut().flatten() {
            r.hint_busy(busy);
            r.publish();
        }
    }

    fn reset(&mut self, lane: usize) -> io::Result<(IngressHandles, u64)> {
        let spare = self.spares.take(&self.config)?;
        let (ring, discarded) = match self.rings[lane].take() {
            Some(mut ring) => {
                let (discarded, old) = ring.reset_with(spare)?;
                self.spares.retire(old);
                (ring, discarded)
            }
            None => (spare, 0),
        };
        let handles = handles_of(&ring);
        self.rings[lane] = Some(ring);
        Ok((handles?, discarded))
    }

    fn close(&mut self, lane: usize) -> u64 {
        let Some(mut ring) = self.rings[lane].take() else {
            return 0;
        };
        let left = ring.stats().occupancy;
        self.spares.retire(ring);
        left
    }

    fn export(&mut self, lane: usize) -> io::Result<Option<IngressState>> {
        let Some(ring) = self.rings[lane].as_mut() else {
            return Ok(None);
        };
        let (state, fds) = ring.export();
        Ok(Some(IngressState::Shm {
            fds: fds.map(|f| f.as_raw_fd()),
            ring: state,
        }))
    }

    fn gauges(&mut self, lane: usize) -> Option<Gauges> {
        let ring = self.rings[lane].as_mut()?;
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
