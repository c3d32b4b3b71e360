//! The ring algorithm over heap memory with loom atomics and cells, for the loom model in
//! `tests/loom.rs` (`RUSTFLAGS="--cfg loom" cargo test -p ringmux-ring --test loom --release`).
//! Only built under `--cfg loom`; it never maps shared memory.

use std::ptr::NonNull;
use std::sync::Arc;

use crate::layout::{ConsumerLine, HeaderLine, ProducerHeader, TailLine};
use crate::ring::{ConsumerCore, DatagramMeta, ProducerCore, ProducerViolation, PushError, Slots};
use crate::sync::{AtomicU32, AtomicU64};

/// Smallest legal slot (descriptor + 1216 payload bytes).
const SLOT: u32 = 1280;

struct Memory {
    header: Box<ProducerHeader>,
    cons: Box<ConsumerLine>,
}

// SAFETY: every field is a loom atomic; the cores only access them through `&`.
unsafe impl Send for Memory {}
// SAFETY: as above.
unsafe impl Sync for Memory {}

/// Producer half of a model ring.
pub struct ModelProducer {
    core: ProducerCore,
    _mem: Arc<Memory>,
}

/// Consumer half of a model ring.
pub struct ModelConsumer {
    core: ConsumerCore,
    _mem: Arc<Memory>,
}

/// A ring of `slots` slots in loom-tracked memory.
pub fn model_pair(slots: u32) -> (ModelProducer, ModelConsumer) {
    let u64s = || AtomicU64::new(0);
    let header = Box::new(ProducerHeader {
        header: HeaderLine {
            magic: u64s(),
            layout_version: AtomicU32::new(0),
            features: AtomicU32::new(0),
            slot_count: AtomicU32::new(slots),
            slot_size: AtomicU32::new(SLOT),
            slots_offset: AtomicU32::new(0),
            reserved0: AtomicU32::new(0),
            region_bytes: u64s(),
            generation: u64s(),
            reserved: std::array::from_fn(|_| u64s()),
        },
        tail: TailLine {
            tail: u64s(),
            doorbells: u64s(),
            dropped_full: u64s(),
            busy: u64s(),
            reserved: std::array::from_fn(|_| u64s()),
        },
    });
    let cons = Box::new(ConsumerLine {
        head: u64s(),
        need_wakeup: AtomicU32::new(0),
        reserved0: AtomicU32::new(0),
        generation: u64s(),
        dequeued: u64s(),
        sleeps: u64s(),
        invalid: u64s(),
        reserved: std::array::from_fn(|_| u64s()),
    });
    let mem = Arc::new(Memory { header, cons });
    let h = NonNull::from(&*mem.header);
    let c = NonNull::from(&*mem.cons);
    let slots_p = Slots::new_model(slots, SLOT);
    let slots_c = slots_p.share_model();
    // SAFETY: `mem` is kept alive by both halves; head == tail == 0.
    let p = unsafe { ProducerCore::new(h, c, slots_p, slots, SLOT) };
    // SAFETY: as above.
    let q = unsafe { ConsumerCore::new(h, c, slots_c, slots, SLOT) };
    (
        ModelProducer {
            core: p,
            _mem: mem.clone(),
        },
        ModelConsumer { core: q, _mem: mem },
    )
}

fn meta() -> DatagramMeta {
    DatagramMeta {
        remote: "127.0.0.1:1".parse().expect("literal"),
        local_ip: None,
        ecn: 0,
        segment_size: 0,
        rx_timestamp_ns: 0,
    }
}

impl ModelProducer {
    /// Pushes a one-byte datagram; `Ok(true)` means the doorbell must ring.
    pub fn try_push(&mut self, byte: u8) -> Result<bool, PushError> {
        self.core.try_push(&meta(), &[byte])
    }
    /// Publishes; `true` means the doorbell must ring.
    pub fn publish(&mut self) -> bool {
        self.core.publish()
    }
}

impl ModelConsumer {
    /// Drains up to `max` one-byte datagrams into `out`.
    pub fn drain(&mut self, max: usize, out: &mut Vec<u8>) -> Result<usize, ProducerViolation> {
        Ok(self
            .core
            .drain(max, |d| {
                let mut b = [0u8; 1];
                d.copy_to(&mut b);
                out.push(b[0])
            })?
            .slots)
    }
    pub fn prepare_sleep(&mut self) -> Result<bool, ProducerViolation> {
        self.core.prepare_sleep()
    }
    pub fn end_sleep(&mut self) {
        self.core.end_sleep()
    }
}
