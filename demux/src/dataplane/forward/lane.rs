//! Lanes: what the demux forwards to and supervises. A lane is the worker of one instance in
//! one generation slot, with its ingress; a reload brings up the next slot's lanes while the
//! old ones drain. Lanes are numbered `slot * instances + instance`, as
//! `ringmux_quic_lb::Router::lane` numbers the lane a connection ID names, so lanes
//! `0..instances` are the first generation's and every array indexed by lane (the data plane's
//! ingresses, the supervisor's workers, the per-lane counters) agrees with the router. This
//! file is the only place that takes a lane number apart.

use ringmux_proto::GENERATION_SLOTS;

/// One lane, taken apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lane {
    /// Its number: the index of every per-lane array.
    pub index: usize,
    /// The instance whose worker it holds (below the instance count).
    pub instance: u8,
    /// Its generation slot (below [`GENERATION_SLOTS`]).
    pub slot: u8,
}

/// How the lanes of `instances` instances are numbered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lanes {
    instances: u8,
}

impl Lanes {
    /// The lanes of `instances` instances (at least 1; 0 is taken as 1).
    pub fn new(instances: u8) -> Lanes {
        Lanes {
            instances: instances.max(1),
        }
    }

    /// How many instances.
    pub fn instances(self) -> usize {
        usize::from(self.instances)
    }

    /// How many lanes: [`GENERATION_SLOTS`] per instance.
    pub fn count(self) -> usize {
        usize::from(GENERATION_SLOTS) * self.instances()
    }

    /// Lane number `index` taken apart. A number at or past [`Lanes::count`] is a bug of the
    /// caller; it is taken modulo the count rather than panicking.
    pub fn at(self, index: usize) -> Lane {
        let index = index % self.count();
        Lane {
            index,
            instance: (index % self.instances()) as u8,
            slot: (index / self.instances()) as u8,
        }
    }

    /// The lane of `instance` (below the instance count) in generation slot `slot` (taken
    /// modulo [`GENERATION_SLOTS`]).
    pub fn of(self, instance: u8, slot: u8) -> Lane {
        let slot = slot % GENERATION_SLOTS;
        self.at(usize::from(slot) * self.instances() + usize::from(instance))
    }

    /// Every lane, in number order.
    pub fn all(self) -> impl Iterator<Item = Lane> {
        (0..self.count()).map(move |i| self.at(i))
    }

    /// The lanes of generation slot `slot`, in instance order.
    pub fn of_slot(self, slot: u8) -> impl Iterator<Item = Lane> {
        (0..self.instances).map(move |i| self.of(i, slot))
    }

    /// The lanes of `instance`, one per generation slot, in slot order.
    pub fn of_instance(self, instance: u8) -> impl Iterator<Item = Lane> {
        (0..GENERATION_SLOTS).map(move |s| self.of(instance, s))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ringmux_quic_lb::{QuicLbConfig, Router};

    /// The numbering is the router's: the lane a connection ID routes to is the lane whose
    /// instance and slot issued it.
    #[test]
    fn lanes_are_numbered_as_the_router_numbers_them() {
        for instances in [1u8, 3, 64] {
            let mut cfg = QuicLbConfig::default_with_key([7; 16]);
            cfg.instance_count = instances;
            let router = Router::new(&cfg, [3; 16]).unwrap();
            let nonce = vec![1; usize::from(cfg.nonce_len)];
            let lanes = Lanes::new(instances);
            assert_eq!(lanes.count(), router.lanes());
            for lane in lanes.all() {
                assert_eq!(
                    usize::from(router.lane(lane.instance, lane.slot)),
                    lane.index
                );
                let cid = router.cid_for_lane(lane.index as u8, &nonce).unwrap();
                assert_eq!(router.owner(&cid), Some(lane.index as u8));
                assert_eq!(lanes.of(lane.instance, lane.slot), lane);
            }
            let first: Vec<usize> = lanes.of_slot(0).map(|l| l.index).collect();
            assert_eq!(first, (0..usize::from(instances)).collect::<Vec<_>>());
            let last = instances - 1;
            let of_last: Vec<u8> = lanes.of_instance(last).map(|l| l.slot).collect();
            assert_eq!(of_last, vec![0, 1, 2, 3]);
            assert!(lanes.of_instance(last).all(|l| l.instance == last));
        }
    }

    #[test]
    fn a_number_past_the_end_does_not_panic() {
        let lanes = Lanes::new(2);
        assert_eq!(lanes.at(8), lanes.at(0));
        assert_eq!(lanes.of(1, 5), lanes.of(1, 1));
        assert_eq!(Lanes::new(0).count(), usize::from(GENERATION_SLOTS));
    }
}
