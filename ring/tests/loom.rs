//! Loom model of publish/drain and of the doorbell handshake at capacities 2–4.
//! Run: `RUSTFLAGS="--cfg loom" cargo test -p ringmux-ring --test loom --release`.
//! - no slot is read before it is published and none is overwritten before it is released: loom's
//!   `UnsafeCell` tracking fails the model on any unsynchronised slot access;
//! - no lost wake-up: the doorbell is a condition variable; a consumer that sleeps while data is
//!   published and nobody rings blocks forever, which loom reports as a deadlock;
//! - every datagram arrives once, in order.
#![cfg(loom)]

use loom::sync::{Arc, Condvar, Mutex};
use loom::thread;
use ringmux_ring::model::model_pair;
use ringmux_ring::PushError;

struct Bell {
    count: Mutex<u64>,
    cv: Condvar,
}

impl Bell {
    fn ring(&self) {
        *self.count.lock().unwrap() += 1;
        self.cv.notify_one();
    }
    fn wait(&self) {
        let mut c = self.count.lock().unwrap();
        while *c == 0 {
            c = self.cv.wait(c).unwrap();
        }
        *c = 0;
    }
}

fn run(capacity: u32, items: u8) {
    let mut b = loom::model::Builder::new();
    b.preemption_bound = Some(3);
    b.check(move || {
        let (mut p, mut c) = model_pair(capacity);
        let bell = Arc::new(Bell {
            count: Mutex::new(0),
            cv: Condvar::new(),
        });
        let pb = bell.clone();
        let producer = thread::spawn(move || {
            for i in 0..items {
                loop {
                    match p.try_push(i) {
                        Ok(ring) => {
                            if ring {
                                pb.ring();
                            }
                            break;
                        }
                        Err(PushError::Full) => {
                            if p.publish() {
                                pb.ring();
                            }
                            thread::yield_now();
                        }
                        Err(e) => panic!("unexpected {e}"),
                    }
                }
                if p.publish() {
                    pb.ring();
                }
            }
        });
        let mut got = Vec::new();
        while got.len() < items as usize {
            c.drain(4, &mut got).unwrap();
            if got.len() == items as usize {
                break;
            }
            if c.prepare_sleep().unwrap() {
                bell.wait();
                c.end_sleep();
            }
        }
        assert_eq!(got, (0..items).collect::<Vec<_>>());
        producer.join().unwrap();
    });
}

#[test]
fn capacity_2_three_items() {
    run(2, 3);
}

#[test]
fn capacity_4_five_items() {
    run(4, 5);
}

#[test]
fn capacity_4_two_items_doorbell_only() {
    run(4, 2);
}
