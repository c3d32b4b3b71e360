//! The byte layout of the shared memory, as `#[repr(C)]` structs. `shm-layout.md` at the root of the
//! repository is normative; every offset below has a `const` assert that matches its table, and the
//! test `layout_doc` parses the document and compares it with [`FIELDS`].
//!
//! Two memfds make one ring:
//! - the **producer region** (written only by the demux, which never reads it back; the worker
//!   maps it read-only): [`HeaderLine`], [`TailLine`], reserved bytes up to
//!   [`SLOTS_OFFSET`], then `slot_count` slots of `slot_size` bytes, each a [`SlotDesc`] followed by
//!   the payload;
//! - the **consumer page** (written only by the worker): [`ConsumerLine`].
//!
//! Only fixed-width fields, no pointers, no `usize`, no `bool`: the two sides are separate
//! processes and the consumer may be hostile.

use crate::sync::{AtomicU32, AtomicU64};

/// `b"RINGMUX\x01"` read as a little-endian `u64`.
pub const MAGIC: u64 = u64::from_le_bytes(*b"RINGMUX\x01");
/// Bumped on any change to this file that an older peer would misread.
pub const LAYOUT_VERSION: u32 = 1;
/// Feature bits the creator sets; an attacher refuses unknown ones.
pub const FEATURES: u32 = FEATURE_BUSY;
/// Feature bit: the producer keeps [`TailLine::busy`] (older producers leave it zero).
pub const FEATURE_BUSY: u32 = 1;
/// Offset of slot 0 in the producer region: one page, so the header never shares a page with data.
pub const SLOTS_OFFSET: u32 = 4096;
/// Size of the consumer page memfd.
pub const CONSUMER_PAGE_BYTES: u32 = 4096;
/// Size of a slot descriptor; the payload starts right after it.
pub const DESC_BYTES: u32 = 64;
/// The cache-line pair both sides keep apart (adjacent-line prefetch makes 64 too little).
pub const LINE_BYTES: usize = 128;

/// First line of the producer region: identity and geometry. Written by the creator before the
/// memfd is handed out (`layout_version` last, `Release`); `generation` again on every reset.
#[repr(C, align(128))]
pub struct HeaderLine {
    pub magic: AtomicU64,
    pub layout_version: AtomicU32,
    pub features: AtomicU32,
    pub slot_count: AtomicU32,
    pub slot_size: AtomicU32,
    pub slots_offset: AtomicU32,
    pub reserved0: AtomicU32,
    pub region_bytes: AtomicU64,
    pub generation: AtomicU64,
    pub reserved: [AtomicU64; 10],
}

/// Second line of the producer region: the published tail and producer counters.
#[repr(C, align(128))]
pub struct TailLine {
    /// Free-running count of slots published; slot index is `tail & (slot_count - 1)`.
    pub tail: AtomicU64,
    /// Doorbells rung (doorbell pipe writes), for observability.
    pub doorbells: AtomicU64,
    /// Datagrams refused because the ring was full.
    pub dropped_full: AtomicU64,
    /// 1 while the producer receives full batches close together, so that its next publish is
    /// at most [`crate::spin::BUSY_SPIN`] away; 0 otherwise. A hint for the consumer's spin,
    /// never needed for correctness.
    pub busy: AtomicU64,
    pub reserved: [AtomicU64; 12],
}

/// The producer region's first page.
#[repr(C)]
pub struct ProducerHeader {
    pub header: HeaderLine,
    pub tail: TailLine,
}

/// The consumer page: the only shared memory the worker can write.
#[repr(C, align(128))]
pub struct ConsumerLine {
    /// Free-running count of slots released; the producer may reuse every slot below it.
    pub head: AtomicU64,
    /// Sleep ticket: 0 while the consumer is awake, otherwise the non-zero number of the sleep it
    /// is about to take. The producer rings once per ticket.
    pub need_wakeup: AtomicU32,
    pub reserved0: AtomicU32,
    /// The generation the consumer attached to.
    pub generation: AtomicU64,
    /// Slots consumed (valid or not).
    pub dequeued: AtomicU64,
    /// Times the consumer went to sleep on the doorbell.
    pub sleeps: AtomicU64,
    /// Slots whose descriptor failed validation and were skipped.
    pub invalid: AtomicU64,
    pub reserved: [AtomicU64; 10],
}

/// The descriptor at the start of every slot. Written by the producer before `tail` publishes
/// the slot; read by the consumer after it observed that `tail`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SlotDesc {
    /// Payload bytes after the descriptor; at most `slot_size - DESC_BYTES`.
    pub len: u32,
    /// GRO segment size: `len` for a single datagram, the stride of a kept-together train.
    pub segment_size: u32,
    /// 4 or 6: the family of `remote_addr` (and `local_addr` when present).
    pub family: u8,
    /// The two ECN bits of the IP header (RFC 3168): 0 not-ECT, 1 ECT(1), 2 ECT(0), 3 CE.
    pub ecn: u8,
    /// Bit 0: `local_addr` is present.
    pub flags: u8,
    pub reserved0: u8,
    /// Remote (client) port, host byte order.
    pub remote_port: u16,
    pub reserved1: u16,
    /// Remote address: 4 bytes for IPv4 (rest zero) or 16 for IPv6, network byte order.
    pub remote_addr: [u8; 16],
    /// Local (destination) address the datagram was sent to, as `remote_addr`.
    pub local_addr: [u8; 16],
    /// Receive time, `CLOCK_MONOTONIC` nanoseconds.
    pub rx_timestamp_ns: u64,
    /// IPv6 scope id of the remote address (0 for IPv4).
    pub remote_scope_id: u32,
    pub reserved2: u32,
}

impl SlotDesc {
    /// The descriptor's bytes as they lie at the start of a slot. The unix ingress framing
    /// sends exactly these bytes before the payload.
    pub fn as_bytes(&self) -> &[u8; DESC_BYTES as usize] {
        // SAFETY: `SlotDesc` is `repr(C)` and exactly `DESC_BYTES` long with no padding (the
        // const asserts below, and `FIELDS` tiling the struct, `tests/layout_doc.rs`), so all
        // of its bytes are initialised; a byte array has alignment 1.
        unsafe { &*(self as *const SlotDesc).cast::<[u8; DESC_BYTES as usize]>() }
    }

    /// A descriptor from its bytes. Any bit pattern is a `SlotDesc`; whether it makes sense is
    /// for `decode_desc` to say.
    pub fn from_bytes(bytes: &[u8; DESC_BYTES as usize]) -> SlotDesc {
        // SAFETY: the array is exactly `size_of::<SlotDesc>()` bytes (asserted below), every
        // field is an integer or byte array (any bit pattern is valid), and the read is
        // unaligned.
        unsafe { bytes.as_ptr().cast::<SlotDesc>().read_unaligned() }
    }
}

/// `SlotDesc::flags` bit: `local_addr` is meaningful.
pub const FLAG_LOCAL_ADDR: u8 = 1;

/// One row of the layout table: which struct, which field, where, how wide.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FieldInfo {
    pub region: &'static str,
    pub field: &'static str,
    pub offset: usize,
    pub size: usize,
}

#[cfg(not(loom))]
macro_rules! fields {
    ($( $region:literal, $base:expr, $ty:ty, $field:ident, $fty:ty; )*) => {
        /// Every field of the shared layout with its absolute offset in its memfd (the producer
        /// region, the consumer page) or in its slot (the descriptor). Compared with shm-layout.md.
        pub const FIELDS: &[FieldInfo] = &[
            $( FieldInfo { region: $region, field: stringify!($field),
                offset: $base + core::mem::offset_of!($ty, $field),
                size: core::mem::size_of::<$fty>() }, )*
        ];
    };
}

#[cfg(not(loom))]
fields! {
    "producer", 0, HeaderLine, magic, u64;
    "producer", 0, HeaderLine, layout_version, u32;
    "producer", 0, HeaderLine, features, u32;
    "producer", 0, HeaderLine, slot_count, u32;
    "producer", 0, HeaderLine, slot_size, u32;
    "producer", 0, HeaderLine, slots_offset, u32;
    "producer", 0, HeaderLine, reserved0, u32;
    "producer", 0, HeaderLine, region_bytes, u64;
    "producer", 0, HeaderLine, generation, u64;
    "producer", 0, HeaderLine, reserved, [u64; 10];
    "producer", LINE_BYTES, TailLine, tail, u64;
    "producer", LINE_BYTES, TailLine, doorbells, u64;
    "producer", LINE_BYTES, TailLine, dropped_full, u64;
    "producer", LINE_BYTES, TailLine, busy, u64;
    "producer", LINE_BYTES, TailLine, reserved, [u64; 12];
    "consumer", 0, ConsumerLine, head, u64;
    "consumer", 0, ConsumerLine, need_wakeup, u32;
    "consumer", 0, ConsumerLine, reserved0, u32;
    "consumer", 0, ConsumerLine, generation, u64;
    "consumer", 0, ConsumerLine, dequeued, u64;
    "consumer", 0, ConsumerLine, sleeps, u64;
    "consumer", 0, ConsumerLine, invalid, u64;
    "consumer", 0, ConsumerLine, reserved, [u64; 10];
    "slot", 0, SlotDesc, len, u32;
    "slot", 0, SlotDesc, segment_size, u32;
    "slot", 0, SlotDesc, family, u8;
    "slot", 0, SlotDesc, ecn, u8;
    "slot", 0, SlotDesc, flags, u8;
    "slot", 0, SlotDesc, reserved0, u8;
    "slot", 0, SlotDesc, remote_port, u16;
    "slot", 0, SlotDesc, reserved1, u16;
    "slot", 0, SlotDesc, remote_addr, [u8; 16];
    "slot", 0, SlotDesc, local_addr, [u8; 16];
    "slot", 0, SlotDesc, rx_timestamp_ns, u64;
    "slot", 0, SlotDesc, remote_scope_id, u32;
    "slot", 0, SlotDesc, reserved2, u32;
}

// The offsets of shm-layout.md, one assert each. Loom's atomics are larger than the real ones, so
// the asserts hold only in real builds (the model never maps shared memory).
#[cfg(not(loom))]
mod asserts {
    use super::*;
    use core::mem::{align_of, offset_of, size_of};

    const _: () = assert!(size_of::<HeaderLine>() == 128 && align_of::<HeaderLine>() == 128);
    const _: () = assert!(offset_of!(HeaderLine, magic) == 0);
    const _: () = assert!(offset_of!(HeaderLine, layout_version) == 8);
    const _: () = assert!(offset_of!(HeaderLine, features) == 12);
    const _: () = assert!(offset_of!(HeaderLine, slot_count) == 16);
    const _: () = assert!(offset_of!(HeaderLine, slot_size) == 20);
    const _: () = assert!(offset_of!(HeaderLine, slots_offset) == 24);
    const _: () = assert!(offset_of!(HeaderLine, reserved0) == 28);
    const _: () = assert!(offset_of!(HeaderLine, region_bytes) == 32);
    const _: () = assert!(offset_of!(HeaderLine, generation) == 40);
    const _: () = assert!(offset_of!(HeaderLine, reserved) == 48);

    const _: () = assert!(size_of::<TailLine>() == 128);
    const _: () = assert!(offset_of!(ProducerHeader, tail) == 128);
    const _: () = assert!(offset_of!(TailLine, tail) == 0);
    const _: () = assert!(offset_of!(TailLine, doorbells) == 8);
    const _: () = assert!(offset_of!(TailLine, dropped_full) == 16);
    const _: () = assert!(offset_of!(TailLine, busy) == 24);
    const _: () = assert!(offset_of!(TailLine, reserved) == 32);
    const _: () = assert!(size_of::<ProducerHeader>() <= SLOTS_OFFSET as usize);

    const _: () = assert!(size_of::<ConsumerLine>() == 128);
    const _: () = assert!(size_of::<ConsumerLine>() <= CONSUMER_PAGE_BYTES as usize);
    const _: () = assert!(offset_of!(ConsumerLine, head) == 0);
    const _: () = assert!(offset_of!(ConsumerLine, need_wakeup) == 8);
    const _: () = assert!(offset_of!(ConsumerLine, reserved0) == 12);
    const _: () = assert!(offset_of!(ConsumerLine, generation) == 16);
    const _: () = assert!(offset_of!(ConsumerLine, dequeued) == 24);
    const _: () = assert!(offset_of!(ConsumerLine, sleeps) == 32);
    const _: () = assert!(offset_of!(ConsumerLine, invalid) == 40);
    const _: () = assert!(offset_of!(ConsumerLine, reserved) == 48);

    const _: () = assert!(size_of::<SlotDesc>() == DESC_BYTES as usize);
    const _: () = assert!(offset_of!(SlotDesc, len) == 0);
    const _: () = assert!(offset_of!(SlotDesc, segment_size) == 4);
    const _: () = assert!(offset_of!(SlotDesc, family) == 8);
    const _: () = assert!(offset_of!(SlotDesc, ecn) == 9);
    const _: () = assert!(offset_of!(SlotDesc, flags) == 10);
    const _: () = assert!(offset_of!(SlotDesc, reserved0) == 11);
    const _: () = assert!(offset_of!(SlotDesc, remote_port) == 12);
    const _: () = assert!(offset_of!(SlotDesc, reserved1) == 14);
    const _: () = assert!(offset_of!(SlotDesc, remote_addr) == 16);
    const _: () = assert!(offset_of!(SlotDesc, local_addr) == 32);
    const _: () = assert!(offset_of!(SlotDesc, rx_timestamp_ns) == 48);
    const _: () = assert!(offset_of!(SlotDesc, remote_scope_id) == 56);
    const _: () = assert!(offset_of!(SlotDesc, reserved2) == 60);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slot_descriptor_bytes_round_trip_in_field_order() {
        let d = SlotDesc {
            len: 0x0403_0201,
            segment_size: 0x0807_0605,
            family: 6,
            ecn: 2,
            flags: FLAG_LOCAL_ADDR,
            remote_port: 0x1234,
            remote_addr: [0xaa; 16],
            local_addr: [0xbb; 16],
            rx_timestamp_ns: u64::MAX - 1,
            remote_scope_id: 7,
            ..SlotDesc::default()
        };
        let b = d.as_bytes();
        assert_eq!(&b[..4], &0x0403_0201u32.to_ne_bytes());
        assert_eq!(b[8], 6);
        assert_eq!(&b[16..32], &[0xaa; 16]);
        assert_eq!(&b[48..56], &(u64::MAX - 1).to_ne_bytes());
        assert_eq!(SlotDesc::from_bytes(b), d);
    }
}
