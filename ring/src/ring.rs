//! The SPSC ring algorithm over a producer header, a consumer line and a slot array. No syscalls
//! and no mappings here (`shm.rs` owns those); this file runs unchanged under loom.
//!
//! # Ordering contract
//!
//! Indices are free-running `u64`s; slot `i` lives at `i & (slot_count - 1)`. The producer owns
//! `tail`, the consumer owns `head` and `need_wakeup`. Each side caches the other's index and
//! re-reads it only when its cached view says full (producer) or empty (consumer).
//!
//! - `SYNC: slot-publish` — the producer writes descriptors and payloads (streaming stores on
//!   x86-64, drained by `sfence`), then stores `tail` with `Release`; the consumer loads `tail`
//!   with `Acquire` before it reads any slot below it. So no slot is read before it is published.
//! - `SYNC: slot-release` — the consumer reads slots, then stores `head` with `Release`; the
//!   producer loads `head` with `Acquire` before it overwrites any slot below it. So no slot is
//!   overwritten before it is released.
//! - `SYNC: doorbell` — a store-load (Dekker) handshake. Consumer: store a non-zero sleep ticket in
//!   `need_wakeup`, `fence(SeqCst)`, load `tail`; sleep only if still empty. Producer: store `tail`,
//!   `fence(SeqCst)`, load `need_wakeup`; ring the doorbell if the ticket is non-zero and not yet
//!   rung. The two fences guarantee that at least one side sees the other's store: either the
//!   consumer sees the new tail and does not sleep, or the producer sees the ticket and rings.
//!   Tickets make it at most one doorbell per sleep; none while the consumer is awake.
//!
//! # Untrusted peers
//!
//! Every shared index is loaded once, validated, and only the local copy is used: the producer
//! requires `cached_head <= head <= published tail` (a hostile consumer can only make the producer
//! think the ring is fuller, or be reported); the consumer requires `head <= tail <= head +
//! capacity` and checks every descriptor before it hands a payload out.

use core::ptr::NonNull;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};

use crate::layout::{
    ConsumerLine, ProducerHeader, SlotDesc, DESC_BYTES, FEATURE_BUSY, FLAG_LOCAL_ADDR,
};
use crate::sync::{fence, Ordering};

/// What travels with a datagram: enough to build a quinn `RecvMeta`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DatagramMeta {
    /// The client's address.
    pub remote: SocketAddr,
    /// The local address the datagram was sent to (`IP_PKTINFO`), when known.
    pub local_ip: Option<IpAddr>,
    /// The IP header's ECN bits (0–3).
    pub ecn: u8,
    /// GRO stride; equal to the payload length for a single datagram.
    pub segment_size: u32,
    /// Receive time, `CLOCK_MONOTONIC` ns.
    pub rx_timestamp_ns: u64,
}

/// A datagram in a slot, valid until the drain call returns.
///
/// Its bytes stay in memory that another process maps, so they are never lent out as a
/// `&[u8]`: a reference promises bytes that cannot change while it lives, a promise the process
/// on the other side is not bound by. They are copied out with [`Datagram::copy_to`], the one
/// read of them, after which the copy is the consumer's own.
pub struct Datagram<'a> {
    pub meta: DatagramMeta,
    payload: *const u8,
    len: usize,
    _slot: core::marker::PhantomData<&'a ()>,
}

impl Datagram<'_> {
    /// Payload length in bytes (validated against the slot's capacity).
    #[inline]
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the payload is empty.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Copies the payload into `dst` (its first `min(len, dst.len())` bytes) and returns how
    /// many bytes were copied.
    #[inline]
    pub fn copy_to(&self, dst: &mut [u8]) -> usize {
        let n = self.len.min(dst.len());
        // SAFETY: `payload..payload + len` lies in the slot's payload area (len was validated
        // against its capacity), which stays mapped and published until the drain call that
        // made this value returns; `dst` is the caller's own memory, so the two cannot overlap.
        unsafe { core::ptr::copy_nonoverlapping(self.payload, dst.as_mut_ptr(), n) };
        n
    }

    /// A copy of the payload.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = vec![0u8; self.len];
        self.copy_to(&mut v);
        v
    }
}

impl core::fmt::Debug for Datagram<'_> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Datagram")
            .field("meta", &self.meta)
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}

/// Why [`crate::Producer::try_push`] refused a datagram. The caller counts it and moves on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PushError {
    #[error("ring full")]
    Full,
    /// A slot holds one datagram or more: `0 < segment_size <= len` (`shm-layout.md`).
    #[error("an empty datagram holds no QUIC packet and is not carried")]
    Empty,
    #[error("datagram of {len} bytes exceeds the slot payload capacity of {capacity} bytes")]
    Oversize { len: usize, capacity: usize },
    #[error(transparent)]
    Violation(#[from] ConsumerViolation),
}

/// The consumer broke the protocol: seen by the producer when it reads `head`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ConsumerViolation {
    #[error("consumer head {head} is ahead of the published tail {tail}")]
    HeadAhead { head: u64, tail: u64 },
    #[error("consumer head {head} moved backwards from {previous}")]
    HeadBackwards { head: u64, previous: u64 },
}

/// The producer broke the protocol: seen by the consumer when it reads `tail`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ProducerViolation {
    #[error("producer tail {tail} is behind the consumer head {head}")]
    TailBehind { tail: u64, head: u64 },
    #[error("producer tail {tail} is more than the capacity {capacity} ahead of head {head}")]
    TailTooFar { tail: u64, head: u64, capacity: u64 },
}

/// What one drain call did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Drained {
    /// Slots released (valid and invalid).
    pub slots: usize,
    /// Slots whose descriptor failed validation; skipped, not handed out.
    pub invalid: usize,
}

/// Why a slot was not handed out.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum InvalidSlot {
    #[error("payload length {len} exceeds the slot capacity {capacity}")]
    Length { len: u32, capacity: u32 },
    #[error("segment size {segment_size} is zero or exceeds the length {len}")]
    SegmentSize { segment_size: u32, len: u32 },
    #[error("address family {0} is neither 4 nor 6")]
    Family(u8),
    #[error("ECN bits {0} exceed 3")]
    Ecn(u8),
}

/// How many slots ahead a drain asks for the descriptor and first payload line.
const PREFETCH_AHEAD: u64 = 2;

/// Writes one slot with ordinary stores: the descriptor, then the payload.
///
/// # Safety
/// `slot` is writable for `DESC_BYTES + payload.len()` bytes and owned by the caller.
#[cfg(any(loom, not(target_arch = "x86_64")))]
unsafe fn copy_slot(slot: *mut u8, desc: &SlotDesc, payload: &[u8]) {
    // SAFETY: the slot's first `DESC_BYTES` are writable (the caller's contract).
    unsafe { slot.cast::<SlotDesc>().write_unaligned(*desc) };
    let area = slot.wrapping_add(DESC_BYTES as usize);
    // SAFETY: `payload.len()` bytes after the descriptor are writable (the caller's contract),
    // and a local payload never overlaps the shared mapping.
    unsafe { core::ptr::copy_nonoverlapping(payload.as_ptr(), area, payload.len()) };
}

/// Writes one slot (descriptor line and payload) with non-temporal stores, whole 64-byte lines
/// only: the last partial line goes out padded from a stack copy. A slot the producer writes was
/// last read by the consumer on another core, so an ordinary store first has to fetch the line
/// back (a read-for-ownership per line, 20 per 1200-byte datagram); a streaming store of a whole
/// line needs no read. Streaming stores are weakly ordered: `ProducerCore::publish` fences them
/// (`sfence`) before the tail store that publishes them.
///
/// # Safety
/// `slot` is 64-byte aligned, writable for `DESC_BYTES + payload.len()` rounded up to a multiple
/// of 64, and owned by the caller.
#[cfg(all(not(loom), target_arch = "x86_64"))]
#[inline]
unsafe fn stream_slot(slot: *mut u8, desc: &SlotDesc, payload: &[u8]) {
    use core::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};
    /// Streams the 64-byte line at `src` (any alignment) to `dst` (64-byte aligned).
    ///
    /// # Safety
    /// 64 bytes are readable at `src` and writable at `dst`.
    #[inline(always)]
    unsafe fn line(dst: *mut u8, src: *const u8) {
        let (d, s) = (dst.cast::<__m128i>(), src.cast::<__m128i>());
        for i in 0..4 {
            // SAFETY: 16 of the 64 readable bytes at `src`.
            let v = unsafe { _mm_loadu_si128(s.wrapping_add(i)) };
            // SAFETY: 16 of the 64 writable bytes at `dst`, 16-byte aligned since `dst` is 64.
            unsafe { _mm_stream_si128(d.wrapping_add(i), v) };
        }
    }
    debug_assert_eq!(slot as usize % 64, 0);
    const _: () = assert!(DESC_BYTES == 64 && size_of::<SlotDesc>() == 64);
    // SAFETY: the descriptor is 64 readable bytes; the slot's first line is the caller's.
    unsafe { line(slot, (desc as *const SlotDesc).cast()) };
    let dst = slot.wrapping_add(DESC_BYTES as usize);
    let whole = payload.len() & !63;
    let mut off = 0;
    while off < whole {
        // SAFETY: `off + 64 <= whole <= payload.len()`, and the destination line lies inside the
        // slot (the caller's contract).
        unsafe { line(dst.wrapping_add(off), payload.as_ptr().wrapping_add(off)) };
        off += 64;
    }
    let rest = &payload[whole..];
    if !rest.is_empty() {
        let mut last = [0u8; 64];
        last[..rest.len()].copy_from_slice(rest);
        // SAFETY: the payload rounded up to whole lines fits the slot (the caller's contract).
        unsafe { line(dst.wrapping_add(whole), last.as_ptr()) };
    }
}

// ---------------------------------------------------------------------------------------------
// Slot storage: raw shared memory in real builds, loom cells in the model.

/// The slot array: `count` slots of `size` bytes.
pub(crate) struct Slots {
    #[cfg(not(loom))]
    base: NonNull<u8>,
    #[cfg(loom)]
    cells: std::sync::Arc<Vec<loom::cell::UnsafeCell<Vec<u8>>>>,
    size: usize,
    mask: u64,
}

impl Slots {
    /// # Safety
    /// `base` points to `count * size` bytes that stay mapped while this value lives; `count` is a
    /// power of two and `size` a multiple of 64 of at least `DESC_BYTES`.
    #[cfg(not(loom))]
    pub(crate) unsafe fn new(base: NonNull<u8>, count: u32, size: u32) -> Self {
        Slots {
            base,
            size: size as usize,
            mask: u64::from(count) - 1,
        }
    }

    #[cfg(loom)]
    pub(crate) fn new_model(count: u32, size: u32) -> Self {
        let cells = (0..count)
            .map(|_| loom::cell::UnsafeCell::new(vec![0u8; size as usize]))
            .collect();
        Slots {
            cells: std::sync::Arc::new(cells),
            size: size as usize,
            mask: u64::from(count) - 1,
        }
    }

    #[cfg(loom)]
    pub(crate) fn share_model(&self) -> Self {
        Slots {
            cells: self.cells.clone(),
            size: self.size,
            mask: self.mask,
        }
    }

    /// # Safety
    /// The caller owns slot `idx`: the producer, for an index in `[head, head + capacity)` that it
    /// has not published.
    unsafe fn write(&self, idx: u64, desc: &SlotDesc, payload: &[u8]) {
        debug_assert!(payload.len() + DESC_BYTES as usize <= self.size);
        #[cfg(not(loom))]
        {
            let slot = self.slot_ptr(idx);
            // SAFETY: the slot is 64-byte aligned (the mapping is page-aligned, SLOTS_OFFSET and
            // `size` are multiples of 64) and `size` is a multiple of 64, so the payload rounded
            // up to whole lines still fits in it; the caller owns the slot.
            #[cfg(target_arch = "x86_64")]
            unsafe {
                stream_slot(slot, desc, payload)
            };
            // SAFETY: as above.
            #[cfg(not(target_arch = "x86_64"))]
            unsafe {
                copy_slot(slot, desc, payload)
            };
        }
        #[cfg(loom)]
        self.cells[(idx & self.mask) as usize].with_mut(|v| {
            // SAFETY: loom checks the exclusive access this closure claims.
            let cell = unsafe { &mut *v };
            // SAFETY: the cell has `size` bytes.
            unsafe { copy_slot(cell.as_mut_ptr(), desc, payload) }
        });
    }

    /// The start of slot `idx`.
    #[cfg(not(loom))]
    #[inline(always)]
    fn slot_ptr(&self, idx: u64) -> *mut u8 {
        // SAFETY: `(idx & mask) * size` < count * size, the mapping's length (Slots::new).
        unsafe {
            self.base
                .as_ptr()
                .add((idx & self.mask) as usize * self.size)
        }
    }

    /// Starts loading slot `idx`'s descriptor and first payload line, which the consumer reads
    /// first: slots arrive by streaming stores (`stream_slot`), so they are in memory, not in
    /// any cache, and a drain asks for each a few slots ahead.
    #[inline(always)]
    fn prefetch(&self, idx: u64) {
        #[cfg(all(not(loom), target_arch = "x86_64"))]
        {
            use core::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
            let p = self.slot_ptr(idx).cast_const().cast::<i8>();
            // SAFETY: a prefetch never faults; both lines are inside the slot anyway.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(p) };
            // SAFETY: as above.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(DESC_BYTES as usize)) };
        }
        #[cfg(any(loom, not(target_arch = "x86_64")))]
        let _ = idx;
    }

    /// Copies out slot `idx`'s descriptor and hands `f` the start of its payload area (the rest
    /// of the slot, `size - DESC_BYTES` bytes), as a pointer: see [`Datagram`].
    ///
    /// # Safety
    /// Slot `idx` is published (`idx < tail` observed with Acquire) and not yet released.
    unsafe fn read<R>(&self, idx: u64, f: impl FnOnce(SlotDesc, *const u8) -> R) -> R {
        let read = |slot: *const u8| {
            // SAFETY: `slot` has `size` bytes; SlotDesc is plain old data, every bit pattern valid.
            let desc = unsafe { slot.cast::<SlotDesc>().read_unaligned() };
            // SAFETY: the payload area starts `DESC_BYTES` into the slot, inside its `size` bytes.
            let start = unsafe { slot.add(DESC_BYTES as usize) };
            f(desc, start)
        };
        #[cfg(not(loom))]
        return read(self.slot_ptr(idx));
        #[cfg(loom)]
        // SAFETY: loom checks the shared access this closure claims.
        self.cells[(idx & self.mask) as usize].with(|v| read(unsafe { (*v).as_ptr() }))
    }
}

// ---------------------------------------------------------------------------------------------

/// Where a resumed producer carries on ([`ProducerCore::resume`]).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Resume {
    pub(crate) tail: u64,
    pub(crate) head: u64,
    pub(crate) last_rung: u32,
    pub(crate) doorbells: u64,
    pub(crate) dropped_full: u64,
}

/// The producer half of the algorithm.
pub(crate) struct ProducerCore {
    header: NonNull<ProducerHeader>,
    cons: NonNull<ConsumerLine>,
    slots: Slots,
    capacity: u64,
    payload_capacity: usize,
    /// Next slot to write (local, not yet visible beyond `published`).
    tail: u64,
    /// Last tail stored to shared memory.
    published: u64,
    /// Last validated head.
    cached_head: u64,
    /// The sleep ticket last rung for.
    last_rung: u32,
    doorbells: u64,
    dropped_full: u64,
    /// The ring's header has the `busy` field (feature bit [`FEATURE_BUSY`]), and what was
    /// last stored in it.
    keeps_busy: bool,
    busy: bool,
}

// SAFETY: the pointers refer to shared memory that the owner keeps mapped; all shared access is
// through atomics or through slots this half owns by the protocol.
unsafe impl Send for ProducerCore {}

impl ProducerCore {
    /// # Safety
    /// `header` and `cons` stay valid (mapped, writable) while the core lives; `slots` describes
    /// the slot array of the same ring; the consumer line's head equals the header's tail.
    pub(crate) unsafe fn new(
        header: NonNull<ProducerHeader>,
        cons: NonNull<ConsumerLine>,
        slots: Slots,
        slot_count: u32,
        slot_size: u32,
    ) -> Self {
        // SAFETY: valid per the caller's contract.
        let tail = unsafe { header.as_ref() }.tail.tail.load(Ordering::Relaxed);
        ProducerCore {
            header,
            cons,
            slots,
            capacity: u64::from(slot_count),
            payload_capacity: (slot_size - DESC_BYTES) as usize,
            tail,
            published: tail,
            cached_head: tail,
            last_rung: 0,
            doorbells: 0,
            dropped_full: 0,
            keeps_busy: keeps_busy(header),
            busy: false,
        }
    }

    /// A core that carries on where an exported one stopped ([`crate::Producer::adopt`]).
    ///
    /// # Safety
    /// As [`Self::new`], except that `at` replaces the header's tail: `at.head <= at.tail`,
    /// everything below `at.head` released by the consumer, nothing at or past `at.tail`
    /// published.
    pub(crate) unsafe fn resume(
        header: NonNull<ProducerHeader>,
        cons: NonNull<ConsumerLine>,
        slots: Slots,
        slot_count: u32,
        slot_size: u32,
        at: Resume,
    ) -> Self {
        ProducerCore {
            header,
            cons,
            slots,
            capacity: u64::from(slot_count),
            payload_capacity: (slot_size - DESC_BYTES) as usize,
            tail: at.tail,
            published: at.tail,
            cached_head: at.head,
            last_rung: at.last_rung,
            doorbells: at.doorbells,
            dropped_full: at.dropped_full,
            keeps_busy: keeps_busy(header),
            // Whatever the previous producer left there is stale: store the first hint anew.
            busy: true,
        }
    }

    /// The last tail stored to shared memory.
    pub(crate) fn published_tail(&self) -> u64 {
        self.published
    }

    /// The consumer's head as last validated.
    pub(crate) fn cached_head(&self) -> u64 {
        self.cached_head
    }

    pub(crate) fn last_rung(&self) -> u32 {
        self.last_rung
    }

    pub(crate) fn dropped_full(&self) -> u64 {
        self.dropped_full
    }

    fn header(&self) -> &ProducerHeader {
        // SAFETY: valid while self lives (ProducerCore::new).
        unsafe { self.header.as_ref() }
    }

    fn cons(&self) -> &ConsumerLine {
        // SAFETY: valid while self lives (ProducerCore::new).
        unsafe { self.cons.as_ref() }
    }

    pub(crate) fn payload_capacity(&self) -> usize {
        self.payload_capacity
    }

    pub(crate) fn doorbells(&self) -> u64 {
        self.doorbells
    }

    /// Writes one datagram into the next free slot. Returns whether the doorbell must ring (the
    /// quarter-ring auto-publish may have published).
    pub(crate) fn try_push(
        &mut self,
        meta: &DatagramMeta,
        payload: &[u8],
    ) -> Result<bool, PushError> {
        self.try_push_desc(&encode_desc(meta, payload.len() as u32), payload)
    }

    /// As [`Self::try_push`] with a descriptor encoded once for many datagrams (the segments of
    /// a GRO train share their addresses and timestamp); `len` and `segment_size` are set here.
    #[inline]
    pub(crate) fn try_push_desc(
        &mut self,
        template: &SlotDesc,
        payload: &[u8],
    ) -> Result<bool, PushError> {
        // One comparison for both bounds: an empty payload wraps to usize::MAX.
        if payload.len().wrapping_sub(1) >= self.payload_capacity {
            if payload.is_empty() {
                return Err(PushError::Empty);
            }
            return Err(PushError::Oversize {
                len: payload.len(),
                capacity: self.payload_capacity,
            });
        }
        if self.tail - self.cached_head >= self.capacity {
            self.refresh_head()?;
            if self.tail - self.cached_head >= self.capacity {
                self.dropped_full += 1;
                self.header()
                    .tail
                    .dropped_full
                    .store(self.dropped_full, Ordering::Relaxed);
                return Err(PushError::Full);
            }
        }
        let desc = SlotDesc {
            len: payload.len() as u32,
            segment_size: payload.len() as u32,
            ..*template
        };
        // SAFETY: tail - cached_head < capacity and the consumer released everything below
        // cached_head (validated in refresh_head), so slot `tail` is ours.
        unsafe { self.slots.write(self.tail, &desc, payload) };
        self.tail += 1;
        // A GRO batch can carry more datagrams than the ring holds: publish every quarter ring
        // so the consumer can start before the batch ends (shm-layout.md, "slot-publish").
        if self.tail - self.published >= self.capacity / 4 {
            return Ok(self.publish());
        }
        Ok(false)
    }

    /// Tells the consumer whether the next publish is near (`TailLine::busy`): a store only
    /// when the hint changes, and none on a ring whose creator did not reserve the field.
    #[inline]
    pub(crate) fn hint_busy(&mut self, busy: bool) {
        if busy != self.busy && self.keeps_busy {
            self.busy = busy;
            self.header()
                .tail
                .busy
                .store(u64::from(busy), Ordering::Relaxed);
        }
    }

    /// Makes every written slot visible. Returns whether the caller must ring the doorbell.
    pub(crate) fn publish(&mut self) -> bool {
        if self.tail == self.published {
            return false;
        }
        // SYNC: slot-publish. The slots were written with streaming stores (`stream_slot`),
        // which a Release store does not order: the store fence drains them first.
        #[cfg(all(not(loom), target_arch = "x86_64"))]
        // SAFETY: SSE is part of x86_64.
        unsafe {
            core::arch::x86_64::_mm_sfence()
        };
        // SYNC: slot-publish. Release: the slot writes above happen-before the consumer's Acquire
        // load of this tail.
        self.header().tail.tail.store(self.tail, Ordering::Release);
        self.published = self.tail;
        // SYNC: doorbell. Orders the tail store before the need_wakeup load (store-load).
        fence(Ordering::SeqCst);
        let ticket = self.cons().need_wakeup.load(Ordering::Relaxed);
        if ticket != 0 && ticket != self.last_rung {
            self.last_rung = ticket;
            self.doorbells += 1;
            self.header()
                .tail
                .doorbells
                .store(self.doorbells, Ordering::Relaxed);
            return true;
        }
        false
    }

    /// Loads, validates and caches the consumer's head.
    fn refresh_head(&mut self) -> Result<(), ConsumerViolation> {
        // SYNC: slot-release. Acquire: the consumer's reads of slots below head happen-before our
        // overwrites of them.
        let head = self.cons().head.load(Ordering::Acquire);
        if head < self.cached_head {
            return Err(ConsumerViolation::HeadBackwards {
                head,
                previous: self.cached_head,
            });
        }
        if head > self.published {
            return Err(ConsumerViolation::HeadAhead {
                head,
                tail: self.published,
            });
        }
        self.cached_head = head;
        Ok(())
    }

    /// Re-reads and validates the consumer's head now; returns the published datagrams not yet
    /// consumed. A supervisor calls this periodically, so a hostile head is caught even while
    /// the ring never fills.
    pub(crate) fn check_consumer(&mut self) -> Result<u64, ConsumerViolation> {
        self.refresh_head()?;
        Ok(self.published - self.cached_head)
    }

    /// Whether at least `n` slots are written and not yet released by the consumer. Reads the
    /// consumer's head only when the cached view says so: a stale head can only overstate.
    #[inline]
    pub(crate) fn holds_at_least(&mut self, n: u64) -> bool {
        if self.tail - self.cached_head < n {
            return false;
        }
        // A bad head leaves the cached one: the push or the gauge read reports it.
        let _ = self.refresh_head();
        self.tail - self.cached_head >= n
    }

    /// The datagrams published but not yet consumed (after validating head), for accounting.
    pub(crate) fn unconsumed(&mut self) -> u64 {
        match self.refresh_head() {
            Ok(()) => self.published - self.cached_head,
            Err(_) => self.published - self.cached_head,
        }
    }
}

/// Whether the ring behind `header` has the `busy` field: its creator set [`FEATURE_BUSY`].
fn keeps_busy(header: NonNull<ProducerHeader>) -> bool {
    // SAFETY: the callers' contract (ProducerCore::new, ::resume): mapped while the core lives.
    let features = unsafe { header.as_ref() }
        .header
        .features
        .load(Ordering::Relaxed);
    features & FEATURE_BUSY != 0
}

/// The consumer half of the algorithm.
pub(crate) struct ConsumerCore {
    header: NonNull<ProducerHeader>,
    cons: NonNull<ConsumerLine>,
    slots: Slots,
    capacity: u64,
    payload_capacity: u32,
    head: u64,
    cached_tail: u64,
    ticket: u32,
    dequeued: u64,
    invalid: u64,
    sleeps: u64,
}

// SAFETY: as for ProducerCore.
unsafe impl Send for ConsumerCore {}

impl ConsumerCore {
    /// # Safety
    /// `header` (readable) and `cons` (writable) stay valid while the core lives and `slots`
    /// describes the same ring's slot array.
    pub(crate) unsafe fn new(
        header: NonNull<ProducerHeader>,
        cons: NonNull<ConsumerLine>,
        slots: Slots,
        slot_count: u32,
        slot_size: u32,
    ) -> Self {
        // SAFETY: valid per the caller's contract. The head was written by the producer before
        // the page was handed over; it is validated against tail on the first refresh.
        let head = unsafe { cons.as_ref() }.head.load(Ordering::Relaxed);
        ConsumerCore {
            header,
            cons,
            slots,
            capacity: u64::from(slot_count),
            payload_capacity: slot_size - DESC_BYTES,
            head,
            cached_tail: head,
            ticket: 0,
            dequeued: 0,
            invalid: 0,
            sleeps: 0,
        }
    }

    fn header(&self) -> &ProducerHeader {
        // SAFETY: valid while self lives (ConsumerCore::new).
        unsafe { self.header.as_ref() }
    }

    fn cons(&self) -> &ConsumerLine {
        // SAFETY: valid while self lives (ConsumerCore::new).
        unsafe { self.cons.as_ref() }
    }

    /// Loads, validates and caches the producer's tail.
    fn refresh_tail(&mut self) -> Result<u64, ProducerViolation> {
        // SYNC: slot-publish. Acquire pairs with the producer's Release store of tail.
        let tail = self.header().tail.tail.load(Ordering::Acquire);
        if tail < self.head {
            return Err(ProducerViolation::TailBehind {
                tail,
                head: self.head,
            });
        }
        if tail - self.head > self.capacity {
            return Err(ProducerViolation::TailTooFar {
                tail,
                head: self.head,
                capacity: self.capacity,
            });
        }
        self.cached_tail = tail;
        Ok(tail - self.head)
    }

    /// Datagrams ready now (re-reads tail only when the cached view is empty).
    pub(crate) fn available(&mut self) -> Result<u64, ProducerViolation> {
        if self.cached_tail != self.head {
            return Ok(self.cached_tail - self.head);
        }
        self.refresh_tail()
    }

    /// Hands up to `max` datagrams to `f`, then releases their slots with one head store.
    pub(crate) fn drain(
        &mut self,
        max: usize,
        mut f: impl FnMut(Datagram<'_>),
    ) -> Result<Drained, ProducerViolation> {
        // Re-read tail only when the cached view cannot fill the request (AF_XDP's
        // `xsk_cons_nb_avail` does the same): one shared load per call at most.
        let mut ready = self.cached_tail - self.head;
        if ready < max as u64 {
            ready = self.refresh_tail()?;
        }
        let n = ready.min(max as u64);
        if n == 0 {
            return Ok(Drained::default());
        }
        let mut invalid = 0;
        for i in 0..n {
            if i + PREFETCH_AHEAD < n {
                self.slots.prefetch(self.head + i + PREFETCH_AHEAD);
            }
            let cap = self.payload_capacity;
            // SAFETY: head + i < cached_tail, validated and observed with Acquire; not released.
            let ok = unsafe {
                self.slots
                    .read(self.head + i, |desc, area| match decode_desc(&desc, cap) {
                        Ok(meta) => {
                            // decode_desc checked len <= cap, the payload area's size.
                            f(Datagram {
                                meta,
                                payload: area,
                                len: desc.len as usize,
                                _slot: core::marker::PhantomData,
                            });
                            true
                        }
                        Err(_) => false,
                    })
            };
            if !ok {
                invalid += 1;
            }
        }
        self.head += n;
        // SYNC: slot-release. Release: our slot reads happen-before the producer's reuse.
        self.cons().head.store(self.head, Ordering::Release);
        self.dequeued += n;
        self.cons().dequeued.store(self.dequeued, Ordering::Relaxed);
        if invalid > 0 {
            self.invalid += invalid as u64;
            self.cons().invalid.store(self.invalid, Ordering::Relaxed);
        }
        Ok(Drained {
            slots: n as usize,
            invalid,
        })
    }

    /// Whether the producer says its next publish is near (`TailLine::busy`). Any value is
    /// harmless: it only lengthens a spin, by at most [`crate::spin::BUSY_SPIN`].
    #[inline]
    pub(crate) fn producer_busy(&self) -> bool {
        self.header().tail.busy.load(Ordering::Relaxed) != 0
    }

    /// Announces a sleep. Returns `Ok(true)` if the ring is still empty after the announcement,
    /// so the caller may block on the doorbell (and must call [`Self::end_sleep`] after); `Ok(false)`
    /// if data arrived, in which case the announcement is already withdrawn.
    pub(crate) fn prepare_sleep(&mut self) -> Result<bool, ProducerViolation> {
        self.ticket = self.ticket.wrapping_add(1).max(1);
        self.cons()
            .need_wakeup
            .store(self.ticket, Ordering::Relaxed);
        // SYNC: doorbell. Orders the ticket store before the tail load (store-load).
        fence(Ordering::SeqCst);
        if self.refresh_tail()? != 0 {
            self.cons().need_wakeup.store(0, Ordering::Relaxed);
            return Ok(false);
        }
        self.sleeps += 1;
        self.cons().sleeps.store(self.sleeps, Ordering::Relaxed);
        Ok(true)
    }

    /// Withdraws the sleep announcement after a wake-up (or a timeout).
    pub(crate) fn end_sleep(&mut self) {
        self.cons().need_wakeup.store(0, Ordering::Relaxed);
    }
}

/// Builds the slot descriptor for a datagram of `len` bytes (also the header of a `unix`-mode
/// forwarded datagram).
///
/// Called once per received message on the demux's hot path: it builds each field whole (an
/// address is one 16-byte value, never bytes patched into a zeroed array, which costs
/// store-forwarding stalls) and is inlined into the caller.
#[inline]
pub fn encode_desc(meta: &DatagramMeta, len: u32) -> SlotDesc {
    let (family, remote_addr, remote_scope_id) = match meta.remote {
        SocketAddr::V4(a) => (4, v4_bytes(*a.ip()), 0),
        SocketAddr::V6(a) => (6, a.ip().octets(), a.scope_id()),
    };
    let (flags, local_addr) = match meta.local_ip {
        // A v4 destination on a dual-stack socket: keep the families consistent.
        Some(IpAddr::V4(ip)) if family == 6 => (FLAG_LOCAL_ADDR, ip.to_ipv6_mapped().octets()),
        Some(IpAddr::V4(ip)) => (FLAG_LOCAL_ADDR, v4_bytes(ip)),
        Some(IpAddr::V6(ip)) => (FLAG_LOCAL_ADDR, ip.octets()),
        None => (0, [0; 16]),
    };
    SlotDesc {
        len,
        segment_size: if meta.segment_size == 0 || meta.segment_size > len {
            len
        } else {
            meta.segment_size
        },
        family,
        ecn: meta.ecn & 3,
        flags,
        reserved0: 0,
        remote_port: meta.remote.port(),
        reserved1: 0,
        remote_addr,
        local_addr,
        rx_timestamp_ns: meta.rx_timestamp_ns,
        remote_scope_id,
        reserved2: 0,
    }
}

/// An IPv4 address in a 16-byte address field: its four octets first, the rest zero.
#[inline]
fn v4_bytes(ip: Ipv4Addr) -> [u8; 16] {
    ((ip.to_bits() as u128) << 96).to_be_bytes()
}

/// Validates a descriptor copied out of shared memory and turns it into metadata.
pub fn decode_desc(d: &SlotDesc, payload_capacity: u32) -> Result<DatagramMeta, InvalidSlot> {
    if d.len > payload_capacity {
        return Err(InvalidSlot::Length {
            len: d.len,
            capacity: payload_capacity,
        });
    }
    if d.segment_size == 0 || d.segment_size > d.len {
        return Err(InvalidSlot::SegmentSize {
            segment_size: d.segment_size,
            len: d.len,
        });
    }
    if d.ecn > 3 {
        return Err(InvalidSlot::Ecn(d.ecn));
    }
    let local = d.flags & FLAG_LOCAL_ADDR != 0;
    let (remote, local_ip) = match d.family {
        4 => {
            let ip = Ipv4Addr::new(
                d.remote_addr[0],
                d.remote_addr[1],
                d.remote_addr[2],
                d.remote_addr[3],
            );
            let l = Ipv4Addr::new(
                d.local_addr[0],
                d.local_addr[1],
                d.local_addr[2],
                d.local_addr[3],
            );
            (
                SocketAddr::V4(SocketAddrV4::new(ip, d.remote_port)),
                local.then_some(IpAddr::V4(l)),
            )
        }
        6 => {
            let ip = Ipv6Addr::from(d.remote_addr);
            let l = Ipv6Addr::from(d.local_addr);
            (
                SocketAddr::V6(SocketAddrV6::new(ip, d.remote_port, 0, d.remote_scope_id)),
                local.then_some(IpAddr::V6(l)),
            )
        }
        f => return Err(InvalidSlot::Family(f)),
    };
    Ok(DatagramMeta {
        remote,
        local_ip,
        ecn: d.ecn,
        segment_size: d.segment_size,
        rx_timestamp_ns: d.rx_timestamp_ns,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every payload length lands whole in its slot and nothing outside it changes: the
    /// streaming copy writes whole lines, the last one padded, and must stop at the slot's end.
    #[cfg(not(loom))]
    #[test]
    fn a_slot_write_of_any_length_stays_inside_its_slot() {
        const SIZE: usize = 1280;
        const COUNT: usize = 4;
        #[repr(C, align(4096))]
        struct Region([u8; COUNT * SIZE]);
        let mut region = Box::new(Region([0xEE; COUNT * SIZE]));
        let base = NonNull::new(region.0.as_mut_ptr()).unwrap();
        // SAFETY: the box holds COUNT slots of SIZE bytes and outlives `slots`.
        let slots = unsafe { Slots::new(base, COUNT as u32, SIZE as u32) };
        let meta = DatagramMeta {
            remote: "192.0.2.1:443".parse().unwrap(),
            local_ip: None,
            ecn: 1,
            segment_size: 0,
            rx_timestamp_ns: 9,
        };
        for len in 1..=SIZE - DESC_BYTES as usize {
            let payload: Vec<u8> = (0..len).map(|i| (i * 7 + len) as u8 | 1).collect();
            let desc = encode_desc(&meta, len as u32);
            // SAFETY: single-threaded; slot 1 is inside the region.
            unsafe { slots.write(1, &desc, &payload) };
            // Read back through the same pointer the writes went through.
            // SAFETY: the region's COUNT * SIZE bytes, initialised, not written meanwhile.
            let r = unsafe { std::slice::from_raw_parts(base.as_ptr(), COUNT * SIZE) };
            for other in [0, 2, 3] {
                assert!(
                    r[other * SIZE..(other + 1) * SIZE]
                        .iter()
                        .all(|&b| b == 0xEE),
                    "slot {other} touched at len {len}"
                );
            }
            assert_eq!(
                &r[SIZE..SIZE + 64],
                desc.as_bytes(),
                "descriptor at len {len}"
            );
            assert_eq!(
                &r[SIZE + 64..SIZE + 64 + len],
                &payload[..],
                "payload at len {len}"
            );
            // SAFETY: as above.
            let back = unsafe { slots.read(1, |d, _| d) };
            assert_eq!(decode_desc(&back, 1216).unwrap().remote, meta.remote);
        }
        drop(region);
    }

    #[test]
    fn descriptor_round_trips_both_families() {
        for (remote, local) in [
            (
                "127.0.0.1:4433".parse::<SocketAddr>().unwrap(),
                Some("127.0.0.2".parse().unwrap()),
            ),
            ("[::1]:9".parse().unwrap(), Some("::2".parse().unwrap())),
            ("[fe80::1%3]:443".parse().unwrap(), None),
        ] {
            let meta = DatagramMeta {
                remote,
                local_ip: local,
                ecn: 2,
                segment_size: 1200,
                rx_timestamp_ns: 77,
            };
            let d = encode_desc(&meta, 1200);
            assert_eq!(decode_desc(&d, 1984).unwrap(), meta);
        }
    }

    #[test]
    fn descriptor_bytes_follow_the_layout() {
        let meta = DatagramMeta {
            remote: "10.1.2.3:4433".parse().unwrap(),
            local_ip: Some("192.0.2.7".parse().unwrap()),
            ecn: 7,
            segment_size: 0,
            rx_timestamp_ns: 5,
        };
        let d = encode_desc(&meta, 64);
        assert_eq!(
            d.remote_addr,
            [10, 1, 2, 3, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]
        );
        assert_eq!(d.local_addr[..4], [192, 0, 2, 7]);
        assert!(d.local_addr[4..].iter().all(|&b| b == 0));
        assert_eq!(
            (d.family, d.flags, d.ecn, d.segment_size),
            (4, FLAG_LOCAL_ADDR, 3, 64)
        );
        // A v4 destination on a dual-stack socket is stored v4-mapped, as the v6 remote.
        let dual = DatagramMeta {
            remote: "[::ffff:10.1.2.3]:4433".parse().unwrap(),
            ..meta
        };
        let d = encode_desc(&dual, 64);
        assert_eq!(d.family, 6);
        assert_eq!(
            d.local_addr,
            "::ffff:192.0.2.7".parse::<Ipv6Addr>().unwrap().octets()
        );
    }

    #[test]
    fn hostile_descriptors_are_refused() {
        let meta = DatagramMeta {
            remote: "127.0.0.1:1".parse().unwrap(),
            local_ip: None,
            ecn: 0,
            segment_size: 0,
            rx_timestamp_ns: 0,
        };
        let good = encode_desc(&meta, 100);
        assert_eq!(good.segment_size, 100);
        assert!(decode_desc(&SlotDesc { len: 2000, ..good }, 1984).is_err());
        assert!(decode_desc(
            &SlotDesc {
                segment_size: 0,
                ..good
            },
            1984
        )
        .is_err());
        assert!(decode_desc(
            &SlotDesc {
                segment_size: 101,
                ..good
            },
            1984
        )
        .is_err());
        // `0 < segment_size <= len`, also for an empty datagram.
        assert!(decode_desc(
            &SlotDesc {
                len: 0,
                segment_size: 0,
                ..good
            },
            1984
        )
        .is_err());
        assert!(decode_desc(&SlotDesc { family: 5, ..good }, 1984).is_err());
        assert!(decode_desc(&SlotDesc { ecn: 9, ..good }, 1984).is_err());
    }
}
