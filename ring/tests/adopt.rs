//! A producer taken over by a new process image of the demux (`Producer::export` then
//! `Producer::adopt`): the consumer attached to the ring notices nothing, and a state that does
//! not fit the descriptors is refused.

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use ringmux_ring::{DatagramMeta, Producer, ProducerFds, ProducerState, RingConfig};

fn meta() -> DatagramMeta {
    DatagramMeta {
        remote: SocketAddr::from(([192, 0, 2, 1], 4433)),
        local_ip: None,
        ecn: 0,
        segment_size: 0,
        rx_timestamp_ns: 1,
    }
}

fn fds_of(p: &mut Producer) -> (ProducerState, ProducerFds) {
    let (state, [region, page, rx, tx]) = p.export();
    let fds = ProducerFds {
        region: common::dup(region),
        page: common::dup(page),
        doorbell_rx: common::dup(rx),
        doorbell_tx: common::dup(tx),
    };
    (state, fds)
}

fn config() -> RingConfig {
    RingConfig {
        slots: 16,
        slot_bytes: 2048,
    }
}

#[test]
fn an_adopted_ring_carries_on_where_the_old_producer_stopped() {
    let cfg = config();
    let mut p = Producer::create(&cfg).unwrap();
    let mut c = common::attach(&p, common::NO_SPIN);
    for i in 0..5u8 {
        p.try_push(&meta(), &[i; 100]).unwrap();
    }
    p.publish();
    let mut got = Vec::new();
    c.drain(2, |d| got.push(d.to_vec()[0])).unwrap();
    // Written but not published when the old image stops: export publishes it.
    p.try_push(&meta(), &[5; 100]).unwrap();
    let (state, fds) = fds_of(&mut p);
    assert_eq!(
        (state.tail, state.head),
        (6, 0),
        "the consumer's release is seen lazily"
    );
    drop(p);

    let mut q = Producer::adopt(&cfg, fds, state).unwrap();
    for i in 6..10u8 {
        q.try_push(&meta(), &[i; 100]).unwrap();
    }
    q.publish();
    c.drain(64, |d| got.push(d.to_vec()[0])).unwrap();
    assert_eq!(
        got,
        (0..10).collect::<Vec<u8>>(),
        "every datagram, in order, once"
    );
    // Laps past the old tail: slots the consumer released are reused.
    for round in 0..3u8 {
        for i in 0..12u8 {
            q.try_push(&meta(), &[round * 16 + i; 100]).unwrap();
        }
        q.publish();
        let mut n = 0;
        c.drain(64, |_| n += 1).unwrap();
        assert_eq!(n, 12);
    }
    // The doorbell: a sleeping consumer is woken by the adopted producer.
    assert!(
        c.prepare_sleep().unwrap(),
        "nothing pending: the consumer may sleep"
    );
    q.try_push(&meta(), b"wake").unwrap();
    assert!(
        q.publish(),
        "the adopted producer rings for a sleeping consumer"
    );
    assert!(c.wait(Some(Duration::from_secs(10))).unwrap(), "woken");
    let s = q.stats();
    assert_eq!(
        (s.published, s.occupancy, s.generation),
        (47, 1, 1),
        "{s:?}"
    );
}

#[test]
fn adopt_refuses_a_state_that_does_not_fit() {
    let cfg = config();
    let mut p = Producer::create(&cfg).unwrap();
    let _c = common::attach(&p, common::NO_SPIN);
    p.try_push(&meta(), b"x").unwrap();
    p.publish();
    let (state, _) = fds_of(&mut p);
    let bad_states = [
        ProducerState {
            head: state.tail + 1,
            ..state
        },
        ProducerState {
            tail: state.head + 17,
            ..state
        },
        ProducerState { slots: 32, ..state },
        ProducerState {
            generation: 0,
            ..state
        },
    ];
    for bad in bad_states {
        let (_, fds) = fds_of(&mut p);
        assert!(Producer::adopt(&cfg, fds, bad).is_err(), "{bad:?} accepted");
    }
    // The consumer page given as the region, and a doorbell made of two pipes.
    let (_, mut fds) = fds_of(&mut p);
    fds.region = common::dup(p.handles().page);
    assert!(
        Producer::adopt(&cfg, fds, state).is_err(),
        "a page as the region"
    );
    let mut other = Producer::create(&cfg).unwrap();
    let (_, other_fds) = fds_of(&mut other);
    let (_, mut fds) = fds_of(&mut p);
    fds.doorbell_tx = other_fds.doorbell_tx;
    let Err(e) = Producer::adopt(&cfg, fds, state) else {
        panic!("a doorbell of two pipes accepted");
    };
    assert!(e.to_string().contains("one pipe"), "{e}");
    // And the state as it is adopts.
    let (_, fds) = fds_of(&mut p);
    Producer::adopt(&cfg, fds, state).unwrap();
}
