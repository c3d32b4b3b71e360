//! Shared memory: memfd creation, sizing, sealing and mapping, and the two public halves that own
//! those mappings — [`Producer`] (the demux) and [`Consumer`] (a worker). The algorithm itself is
//! in `ring.rs`; this file adds the syscalls and the checks an attacher makes before it trusts a
//! descriptor it was handed.

use crate::spin::{AdaptiveSpin, SpinPolicy};
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::ptr::NonNull;
use std::time::{Duration, Instant};

use memmap2::{MmapOptions, MmapRaw};
use nix::fcntl::{fcntl, FcntlArg, SealFlag};
use nix::sys::memfd::{memfd_create, MFdFlags};

use crate::config::RingConfig;
use crate::doorbell::{Doorbell, DoorbellReader};
use crate::layout::{
    ConsumerLine, ProducerHeader, SlotDesc, CONSUMER_PAGE_BYTES, FEATURES, LAYOUT_VERSION, MAGIC,
    SLOTS_OFFSET,
};
use crate::ring::{
    ConsumerCore, ConsumerViolation, Datagram, DatagramMeta, Drained, ProducerCore,
    ProducerViolation, PushError, Slots,
};
use crate::sync::Ordering;

/// Seals every ring memfd carries: nobody can resize it (no SIGBUS under another process), and
/// nobody can add or remove seals.
pub(crate) const BASE_SEALS: SealFlag = SealFlag::F_SEAL_SHRINK
    .union(SealFlag::F_SEAL_GROW)
    .union(SealFlag::F_SEAL_SEAL);
/// The producer region carries the same seals and no more. `F_SEAL_FUTURE_WRITE` would refuse
/// a consumer a writable mapping, but also every later one of the demux's own: a demux that
/// replaces itself (`ringmux upgrade`) maps its rings again in the new process image. A consumer
/// that writes into its own region only corrupts the datagrams it reads itself: the producer
/// never reads the region back ([`Producer::adopt`] takes its indices from its own copy).
pub(crate) const REGION_SEALS: SealFlag = BASE_SEALS;

/// Why a consumer refused the descriptors it was handed.
#[derive(Debug, thiserror::Error)]
pub enum AttachError {
    #[error("{what}: {error}")]
    Io {
        what: &'static str,
        /// The OS error (in the message, so not the error's `source`).
        error: io::Error,
    },
    #[error("the {which} memfd lacks seals: has {found:#x}, needs {needed:#x}")]
    Unsealed {
        which: &'static str,
        found: i32,
        needed: i32,
    },
    #[error("bad magic {found:#018x}: not a ringmux ring")]
    BadMagic { found: u64 },
    #[error("ring not initialised by its creator (layout version 0)")]
    NotInitialised,
    #[error("layout version {found}, this build speaks {expected}")]
    VersionMismatch { found: u32, expected: u32 },
    #[error("unknown feature bits {found:#x}")]
    UnknownFeatures { found: u32 },
    #[error("bad geometry: {0}")]
    Geometry(String),
    #[error(
        "stale generation {found}, expected {expected}: the ring was reset for another consumer"
    )]
    StaleGeneration { found: u64, expected: u64 },
}

/// Why a blocking wait ended in error.
#[derive(Debug, thiserror::Error)]
pub enum WaitError {
    #[error(transparent)]
    Violation(#[from] ProducerViolation),
    /// The OS error is in the message, so not the error's `source`.
    #[error("doorbell: {0}")]
    Io(io::Error),
}

impl From<io::Error> for WaitError {
    fn from(e: io::Error) -> Self {
        WaitError::Io(e)
    }
}

/// The descriptors a consumer needs, borrowed from the producer for hand-off (SCM_RIGHTS).
#[derive(Clone, Copy, Debug)]
pub struct ConsumerHandles<'a> {
    pub ring: BorrowedFd<'a>,
    pub page: BorrowedFd<'a>,
    pub doorbell: BorrowedFd<'a>,
    pub generation: u64,
}

/// Snapshot of a ring's counters as the producer sees them. Consumer-written values are
/// informational only (a hostile consumer can write anything there).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RingStats {
    pub generation: u64,
    pub published: u64,
    /// Published but not yet released (validated head; 0..=capacity).
    pub occupancy: u64,
    pub capacity: u64,
    pub doorbells: u64,
    pub consumer_sleeps: u64,
    pub consumer_invalid: u64,
}

/// The demux's half of one ring: creates the memfds, writes datagrams, rings the doorbell.
pub struct Producer {
    core: ProducerCore,
    // The mappings and descriptors the core points into; dropped after it.
    region: MmapRaw,
    region_file: File,
    page: MmapRaw,
    page_file: File,
    doorbell: Doorbell,
    config: RingConfig,
    generation: u64,
    /// Counts of the rings this one replaced, so the statistics run on across resets.
    before: Carried,
}

/// What earlier generations' rings counted.
#[derive(Clone, Copy, Debug, Default)]
struct Carried {
    published: u64,
    doorbells: u64,
}

/// A producer's own numbers, which [`Producer::export`] hands to a new process image of the
/// demux and [`Producer::adopt`] takes back: the only place they come from, since the region's
/// copy of them is in memory the consumer can write. With the `serde` feature it serialises
/// (field by field, by name).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct ProducerState {
    pub slots: u32,
    pub slot_bytes: u32,
    pub generation: u64,
    /// Slots published (the next slot to write: everything written is published first).
    pub tail: u64,
    /// The consumer's head as last validated (everything below it is released).
    pub head: u64,
    pub last_rung: u32,
    pub doorbells: u64,
    pub dropped_full: u64,
    /// What the rings this one replaced counted.
    pub carried_published: u64,
    pub carried_doorbells: u64,
}

/// A producer's descriptors, for [`Producer::adopt`]: the region and consumer page memfds and
/// both ends of the doorbell pipe.
#[derive(Debug)]
pub struct ProducerFds {
    pub region: OwnedFd,
    pub page: OwnedFd,
    pub doorbell_rx: OwnedFd,
    pub doorbell_tx: OwnedFd,
}

impl Producer {
    /// Creates a ring: `memfd_create(MFD_CLOEXEC | MFD_ALLOW_SEALING)`, size, map, initialise
    /// (layout version stored last), seal; plus the consumer page and the doorbell.
    pub fn create(config: &RingConfig) -> io::Result<Self> {
        let generation = 1;
        config
            .validate()
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        let region_bytes =
            u64::from(SLOTS_OFFSET) + u64::from(config.slots) * u64::from(config.slot_bytes);
        let region_file = memfd(c"ringmux-ring", region_bytes)?;
        // Populated up front (MAP_POPULATE): a first-touch page fault costs microseconds on
        // these VMs, and every slot page would otherwise take one on the first lap.
        let region = MmapOptions::new()
            .populate()
            .len(region_bytes as usize)
            .map_raw(&region_file)?;
        let header = header_ptr(&region);
        // SAFETY: the mapping is at least SLOTS_OFFSET bytes, page aligned, zero-filled, and not
        // yet shared with anyone.
        let h = unsafe { header.as_ref() };
        h.header.magic.store(MAGIC, Ordering::Relaxed);
        h.header.features.store(FEATURES, Ordering::Relaxed);
        h.header.slot_count.store(config.slots, Ordering::Relaxed);
        h.header
            .slot_size
            .store(config.slot_bytes, Ordering::Relaxed);
        h.header.slots_offset.store(SLOTS_OFFSET, Ordering::Relaxed);
        h.header.region_bytes.store(region_bytes, Ordering::Relaxed);
        h.header.generation.store(generation, Ordering::Relaxed);
        // Version last: an attacher that sees it sees everything above (Release/Acquire).
        h.header
            .layout_version
            .store(LAYOUT_VERSION, Ordering::Release);
        add_seals(&region_file, REGION_SEALS)?;

        let (page, page_file) = consumer_page(0)?;
        let doorbell = Doorbell::new()?;
        // SAFETY: the slot array follows the header inside `region`, which `Producer` keeps.
        let slots = unsafe { Slots::new(slots_ptr(&region), config.slots, config.slot_bytes) };
        // SAFETY: header, page and slots stay mapped while the Producer (which owns them) lives;
        // the page's head is 0 = the initial tail.
        let core = unsafe {
            ProducerCore::new(
                header,
                page_ptr(&page),
                slots,
                config.slots,
                config.slot_bytes,
            )
        };
        Ok(Producer {
            core,
            region,
            region_file,
            page,
            page_file,
            doorbell,
            config: *config,
            generation,
            before: Carried::default(),
        })
    }

    /// Publishes what is written and returns the producer's numbers and descriptors, for a new
    /// process image of the demux to [`Producer::adopt`]. The producer stays usable.
    pub fn export(&mut self) -> (ProducerState, [BorrowedFd<'_>; 4]) {
        self.core.publish();
        let core = &self.core;
        let state = ProducerState {
            slots: self.config.slots,
            slot_bytes: self.config.slot_bytes,
            generation: self.generation,
            tail: core.published_tail(),
            head: core.cached_head(),
            last_rung: core.last_rung(),
            doorbells: core.doorbells(),
            dropped_full: core.dropped_full(),
            carried_published: self.before.published,
            carried_doorbells: self.before.doorbells,
        };
        let fds = [
            self.region_file.as_fd(),
            self.page_file.as_fd(),
            self.doorbell.consumer_end(),
            self.doorbell.producer_end(),
        ];
        (state, fds)
    }

    /// Takes over a ring another process image of the demux [`Producer::export`]ed: maps the
    /// region and the consumer page again and carries on from `state`, so the consumer attached
    /// to the ring notices nothing. Checks the descriptors against `config` (seals, sizes) and
    /// `state` against the consumer's head; never reads a number from the region.
    pub fn adopt(config: &RingConfig, fds: ProducerFds, state: ProducerState) -> io::Result<Self> {
        let bad = |what: String| io::Error::new(io::ErrorKind::InvalidData, what);
        config
            .validate()
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        if (state.slots, state.slot_bytes) != (config.slots, config.slot_bytes) {
            return Err(bad(format!(
                "the ring has {} slots of {} bytes, this configuration {} of {}",
                state.slots, state.slot_bytes, config.slots, config.slot_bytes
            )));
        }
        let capacity = u64::from(config.slots);
        if state.head > state.tail || state.tail - state.head > capacity || state.generation == 0 {
            return Err(bad(format!(
                "inconsistent ring state: head {} tail {} generation {}",
                state.head, state.tail, state.generation
            )));
        }
        let region_bytes =
            u64::from(SLOTS_OFFSET) + u64::from(config.slots) * u64::from(config.slot_bytes);
        let region_file = File::from(fds.region);
        let page_file = File::from(fds.page);
        for (file, which, len) in [
            (&region_file, "ring", region_bytes),
            (&page_file, "consumer page", u64::from(CONSUMER_PAGE_BYTES)),
        ] {
            check_seals(file, which, BASE_SEALS).map_err(io::Error::other)?;
            let size = file.metadata()?.len();
            if size != len {
                return Err(bad(format!("the {which} memfd is {size} bytes, not {len}")));
            }
        }
        let region = MmapOptions::new()
            .populate()
            .len(region_bytes as usize)
            .map_raw(&region_file)?;
        let (page, _) = map_page(&page_file)?;
        let header = header_ptr(&region);
        // SAFETY: the slot array follows the header inside `region`, which `Producer` keeps.
        let slots = unsafe { Slots::new(slots_ptr(&region), config.slots, config.slot_bytes) };
        // SAFETY: header, page and slots stay mapped while the Producer (which owns them) lives;
        // the indices come from the exporting producer, checked above.
        let core = unsafe {
            ProducerCore::resume(
                header,
                page_ptr(&page),
                slots,
                config.slots,
                config.slot_bytes,
                crate::ring::Resume {
                    tail: state.tail,
                    head: state.head,
                    last_rung: state.last_rung,
                    doorbells: state.doorbells,
                    dropped_full: state.dropped_full,
                },
            )
        };
        let mut p = Producer {
            core,
            region,
            region_file,
            page,
            page_file,
            doorbell: Doorbell::from_fds(fds.doorbell_rx, fds.doorbell_tx)?,
            config: *config,
            generation: state.generation,
            before: Carried {
                published: state.carried_published,
                doorbells: state.carried_doorbells,
            },
        };
        // The consumer's head must still be where the exporter left it or beyond.
        p.core.check_consumer().map_err(io::Error::other)?;
        Ok(p)
    }

    /// Writes one datagram into the next free slot. Never blocks, never allocates. `Full` and
    /// `Oversize` are drops for the caller to count; `Violation` means the consumer broke the
    /// protocol and its ring should be reset.
    #[inline]
    pub fn try_push(&mut self, meta: &DatagramMeta, payload: &[u8]) -> Result<(), PushError> {
        if self.core.try_push(meta, payload)? {
            self.ring();
        }
        Ok(())
    }

    /// As [`Producer::try_push`] with a descriptor encoded once ([`crate::encode_desc`]) for
    /// several datagrams, e.g. the segments of one GRO train; its `len` and `segment_size` are
    /// replaced by the payload's length.
    #[inline]
    pub fn try_push_desc(&mut self, template: &SlotDesc, payload: &[u8]) -> Result<(), PushError> {
        if self.core.try_push_desc(template, payload)? {
            self.ring();
        }
        Ok(())
    }

    /// Whether at least `n` slots are written and not yet consumed: a ring filling up. Cheap
    /// while it is not (no shared memory is read unless the local view says so).
    #[inline]
    pub fn holds_at_least(&mut self, n: u64) -> bool {
        self.core.holds_at_least(n)
    }

    /// Tells the consumer whether the next publish is near: call it before [`Producer::publish`]
    /// with `true` when the receive that brought this batch filled it and came soon after the
    /// one before (more datagrams wait), `false` otherwise. A spinning consumer then keeps
    /// spinning for up to [`crate::spin::BUSY_SPIN`] instead of sleeping, so a saturated
    /// producer pays no doorbell per batch (shm-layout.md, "Doorbell protocol").
    #[inline]
    pub fn hint_busy(&mut self, busy: bool) {
        self.core.hint_busy(busy);
    }

    /// Publishes every written slot (call once per receive batch). Returns whether it rang.
    #[inline]
    pub fn publish(&mut self) -> bool {
        let rang = self.core.publish();
        if rang {
            self.ring();
        }
        rang
    }

    #[cold]
    fn ring(&self) {
        // A pipe write on the producer's own non-blocking description: EAGAIN (full) is handled
        // inside, and EBADF/EPIPE cannot come from the pipe this struct owns both ends of.
        let _ = self.doorbell.ring();
    }

    /// Starts a new consumer generation after the old consumer died or misbehaved: a whole new
    /// ring (region memfd, consumer page, doorbell pipe) with `generation + 1`, so the old
    /// consumer, or anything it forked, holds descriptors of a ring nobody writes any more and
    /// can neither read the new generation's datagrams nor hear its doorbell. Returns how many
    /// published datagrams the old consumer left unread (now discarded). Call it once the old
    /// consumer is gone.
    ///
    /// Costs what [`Producer::create`] does (one memfd of the region's size, mapped and
    /// populated: milliseconds for the default ring) plus the old ring's unmapping; a caller
    /// on a latency-sensitive thread makes the ring ahead of time elsewhere and uses
    /// [`Producer::reset_with`].
    pub fn reset(&mut self) -> io::Result<u64> {
        let spare = Self::create(&self.config)?;
        let (discarded, old) = self.reset_with(spare)?;
        drop(old);
        Ok(discarded)
    }

    /// [`Producer::reset`] onto `spare`, a ring made with [`Producer::create`] and the same
    /// configuration, never written or handed out: cheap, so that the costly parts (making a
    /// ring, unmapping one) can run on another thread. Returns the discarded count and the old
    /// ring, to be dropped wherever that is cheap. Refuses a spare of another geometry.
    pub fn reset_with(&mut self, mut spare: Producer) -> io::Result<(u64, Producer)> {
        if spare.config.slots != self.config.slots
            || spare.config.slot_bytes != self.config.slot_bytes
            || spare.header().tail.tail.load(Ordering::Relaxed) != 0
        {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "a spare ring must be fresh and of the same geometry",
            ));
        }
        spare.config = self.config;
        self.core.publish();
        let discarded = self.core.unconsumed();
        spare.generation = self.generation + 1;
        spare
            .header()
            .header
            .generation
            .store(spare.generation, Ordering::Release);
        spare.before = Carried {
            published: self.before.published + self.core.published_tail(),
            doorbells: self.before.doorbells + self.core.doorbells(),
        };
        let old = std::mem::replace(self, spare);
        Ok((discarded, old))
    }

    /// The descriptors to hand to the consumer of the current generation.
    pub fn handles(&self) -> ConsumerHandles<'_> {
        ConsumerHandles {
            ring: self.region_file.as_fd(),
            page: self.page_file.as_fd(),
            doorbell: self.doorbell.consumer_end(),
            generation: self.generation,
        }
    }

    pub fn config(&self) -> &RingConfig {
        &self.config
    }

    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// Largest payload a slot takes.
    pub fn payload_capacity(&self) -> usize {
        self.core.payload_capacity()
    }

    /// Re-reads and validates the consumer's head: `Ok(occupancy)`, or the violation.
    pub fn check_consumer(&mut self) -> Result<u64, ConsumerViolation> {
        self.core.check_consumer()
    }

    /// Counters and occupancy (re-reads and validates head).
    pub fn stats(&mut self) -> RingStats {
        let occupancy = self.core.unconsumed();
        let line = page_ptr(&self.page);
        // SAFETY: the page stays mapped while self lives.
        let c = unsafe { line.as_ref() };
        RingStats {
            generation: self.generation,
            published: self.before.published + self.core.published_tail(),
            occupancy,
            capacity: u64::from(self.config.slots),
            doorbells: self.before.doorbells + self.core.doorbells(),
            consumer_sleeps: c.sleeps.load(Ordering::Relaxed),
            consumer_invalid: c.invalid.load(Ordering::Relaxed),
        }
    }

    fn header(&self) -> &ProducerHeader {
        // SAFETY: `region` is mapped while self lives and starts with the header.
        unsafe { header_ptr(&self.region).as_ref() }
    }
}

/// A worker's half of one ring: validates what it was handed, drains slots, sleeps on the
/// doorbell when idle.
pub struct Consumer {
    core: ConsumerCore,
    _region: MmapRaw,
    _page: MmapRaw,
    doorbell: DoorbellReader,
    generation: u64,
    spin: AdaptiveSpin,
    payload_capacity: usize,
}

impl Consumer {
    /// Attaches to a ring from received descriptors: checks seals, size, magic, version, features,
    /// geometry and generation; maps the producer region read-only and only the consumer page
    /// read-write. An idle consumer spins by `spin` before it sleeps ([`Consumer::wait`]).
    pub fn attach(
        ring: OwnedFd,
        page: OwnedFd,
        doorbell: OwnedFd,
        generation: u64,
        spin: SpinPolicy,
    ) -> Result<Self, AttachError> {
        let ring = File::from(ring);
        let page = File::from(page);
        check_seals(&ring, "ring", REGION_SEALS)?;
        check_seals(&page, "consumer page", BASE_SEALS)?;
        let size = ring
            .metadata()
            .map_err(|error| AttachError::Io {
                what: "fstat ring",
                error,
            })?
            .len();
        if size < u64::from(SLOTS_OFFSET) {
            return Err(AttachError::Geometry(format!(
                "ring memfd is {size} bytes, smaller than its header"
            )));
        }
        // The header alone first: a memfd of any size is mapped whole (and populated) only once
        // its header says that size is this ring's. The geometry is copied out of it here and
        // used from the copy; the mapping below is never asked again.
        let head = MmapOptions::new()
            .len(SLOTS_OFFSET as usize)
            .map_raw_read_only(&ring)
            .map_err(|error| AttachError::Io {
                what: "mmap ring header read-only",
                error,
            })?;
        // SAFETY: the mapping holds exactly the header and the seals keep the memfd from
        // shrinking under it.
        let geometry = validate_header(unsafe { header_ptr(&head).as_ref() }, size, generation)?;
        drop(head);
        // Populated for the same reason as the producer's mapping: no faults on the first lap.
        let region = MmapOptions::new()
            .populate()
            .len(size as usize)
            .map_raw_read_only(&ring)
            .map_err(|error| AttachError::Io {
                what: "mmap ring read-only",
                error,
            })?;
        let header = header_ptr(&region);

        let page_size = page
            .metadata()
            .map_err(|error| AttachError::Io {
                what: "fstat consumer page",
                error,
            })?
            .len();
        if page_size != u64::from(CONSUMER_PAGE_BYTES) {
            return Err(AttachError::Geometry(format!(
                "consumer page is {page_size} bytes, expected {CONSUMER_PAGE_BYTES}"
            )));
        }
        let page_map = MmapOptions::new()
            .len(page_size as usize)
            .map_raw(&page)
            .map_err(|error| AttachError::Io {
                what: "mmap consumer page",
                error,
            })?;
        let line = page_ptr(&page_map);
        // SAFETY: the page is mapped read-write, sealed against shrinking.
        unsafe { line.as_ref() }
            .generation
            .store(generation, Ordering::Relaxed);
        let (slots_n, slot_size) = geometry;
        // SAFETY: slot array bounds were checked against the mapping size in validate_header.
        let slots = unsafe { Slots::new(slots_ptr(&region), slots_n, slot_size) };
        // SAFETY: region and page are kept in the Consumer for as long as the core lives.
        let core = unsafe { ConsumerCore::new(header, line, slots, slots_n, slot_size) };
        Ok(Consumer {
            core,
            _region: region,
            _page: page_map,
            doorbell: DoorbellReader::from_fd(doorbell),
            generation,
            spin: AdaptiveSpin::new(spin),
            payload_capacity: (slot_size - crate::layout::DESC_BYTES) as usize,
        })
    }

    /// Hands up to `max` datagrams to `f` (borrowed views, valid inside the call), then releases
    /// their slots with one head store. Slots with invalid descriptors are skipped and counted.
    #[inline]
    pub fn drain(
        &mut self,
        max: usize,
        f: impl FnMut(Datagram<'_>),
    ) -> Result<Drained, ProducerViolation> {
        self.core.drain(max, f)
    }

    /// Datagrams ready now.
    #[inline]
    pub fn available(&mut self) -> Result<u64, ProducerViolation> {
        self.core.available()
    }

    /// Blocks until data is ready: spins for the spin budget ([`AdaptiveSpin`]), then announces
    /// a sleep and waits on the doorbell (at most `timeout`). Returns whether data is ready.
    pub fn wait(&mut self, timeout: Option<Duration>) -> Result<bool, WaitError> {
        if self.core.available()? > 0 {
            return Ok(true);
        }
        let start = Instant::now();
        let mut spins = 0u32;
        loop {
            // One tail load and one PAUSE per iteration: a PAUSE costs ~40-140 cycles, so more
            // of them between looks only delays the pick-up (measured: p50 latency doubled with
            // 32). The clock is read every 64 looks.
            if self.core.available()? > 0 {
                if self.spin.adapts() {
                    self.spin.idle_ended(start.elapsed());
                }
                return Ok(true);
            }
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(64) && !self.spins_on(start.elapsed()) {
                break;
            }
            std::hint::spin_loop();
        }
        if !self.prepare_sleep()? {
            return Ok(true);
        }
        let waited = self.doorbell.rung(timeout);
        self.core.end_sleep();
        waited?;
        let ready = self.core.available()? > 0;
        if ready && self.spin.adapts() {
            self.spin.idle_ended(start.elapsed());
        }
        Ok(ready)
    }

    /// Step one of an asynchronous sleep (for a runtime that polls [`Consumer::doorbell_fd`]):
    /// takes whatever earlier sleeps left rung, then announces this one; `Ok(false)` means data
    /// arrived and the caller should drain instead.
    ///
    /// Clearing here rather than on waking keeps the read off the wake-up's path: a woken
    /// consumer goes straight to its ring (the sleeping consumer's one-way latency fell 14 %,
    /// bench/RESULTS.md). Nothing rung for this sleep is lost: the producer rings only after it
    /// saw the announcement, which comes after the clear; a late ring of an earlier sleep only
    /// makes the next wait return at once.
    pub fn prepare_sleep(&mut self) -> Result<bool, ProducerViolation> {
        let _ = self.doorbell.clear();
        self.core.prepare_sleep()
    }

    /// Step two: after the doorbell fd became readable (or the caller gave up waiting). The
    /// doorbell stays readable until the next [`Consumer::prepare_sleep`] clears it.
    pub fn end_sleep(&mut self) {
        self.core.end_sleep();
    }

    /// The doorbell's read end, to register with an event loop (readable = rung).
    pub fn doorbell_fd(&self) -> BorrowedFd<'_> {
        self.doorbell.as_fd()
    }

    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// The spin budget of the next idle period.
    pub fn spin(&self) -> Duration {
        self.spin.budget()
    }

    /// Whether an idle period that began `elapsed` ago spins on: within the spin budget, or
    /// while the producer says its next publish is near ([`AdaptiveSpin::spins_on`]).
    #[inline]
    pub fn spins_on(&mut self, elapsed: Duration) -> bool {
        let busy = self.core.producer_busy();
        self.spin.spins_on(elapsed, busy)
    }

    /// The spin budget, for a caller that spins and sleeps itself (an async runtime's poll):
    /// tell it what each idle period came to.
    pub fn spin_mut(&mut self) -> &mut AdaptiveSpin {
        &mut self.spin
    }

    pub fn payload_capacity(&self) -> usize {
        self.payload_capacity
    }
}

/// Checks the header an attacher reads: magic, version, features, geometry against the file
/// size, generation. Returns `(slot_count, slot_size)`.
fn validate_header(
    h: &ProducerHeader,
    size: u64,
    generation: u64,
) -> Result<(u32, u32), AttachError> {
    // Acquire pairs with the creator's Release store of the version (stored last).
    let version = h.header.layout_version.load(Ordering::Acquire);
    let magic = h.header.magic.load(Ordering::Relaxed);
    if magic != MAGIC {
        return Err(AttachError::BadMagic { found: magic });
    }
    if version == 0 {
        return Err(AttachError::NotInitialised);
    }
    if version != LAYOUT_VERSION {
        return Err(AttachError::VersionMismatch {
            found: version,
            expected: LAYOUT_VERSION,
        });
    }
    let features = h.header.features.load(Ordering::Relaxed);
    if features & !FEATURES != 0 {
        return Err(AttachError::UnknownFeatures { found: features });
    }
    let slots = h.header.slot_count.load(Ordering::Relaxed);
    let slot_size = h.header.slot_size.load(Ordering::Relaxed);
    let offset = h.header.slots_offset.load(Ordering::Relaxed);
    let declared = h.header.region_bytes.load(Ordering::Relaxed);
    let cfg = RingConfig {
        slots,
        slot_bytes: slot_size,
    };
    cfg.validate()
        .map_err(|e| AttachError::Geometry(e.to_string()))?;
    let expected = u64::from(SLOTS_OFFSET) + u64::from(slots) * u64::from(slot_size);
    if offset != SLOTS_OFFSET || declared != expected || size != expected {
        return Err(AttachError::Geometry(format!(
            "slots at {offset} (expected {SLOTS_OFFSET}), {slots} slots of {slot_size} bytes need {expected} bytes; header declares {declared}, memfd has {size}"
        )));
    }
    let found = h.header.generation.load(Ordering::Acquire);
    if found != generation {
        return Err(AttachError::StaleGeneration {
            found,
            expected: generation,
        });
    }
    Ok((slots, slot_size))
}

pub(crate) fn memfd(name: &std::ffi::CStr, len: u64) -> io::Result<File> {
    let fd = memfd_create(name, MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING)?;
    let file = File::from(fd);
    file.set_len(len)?;
    Ok(file)
}

/// A zeroed, sealed consumer page whose head starts at `head`.
fn consumer_page(head: u64) -> io::Result<(MmapRaw, File)> {
    let file = memfd(c"ringmux-consumer", u64::from(CONSUMER_PAGE_BYTES))?;
    let map = MmapOptions::new()
        .len(CONSUMER_PAGE_BYTES as usize)
        .map_raw(&file)?;
    // SAFETY: fresh page-sized mapping, not yet shared.
    unsafe { page_ptr(&map).as_ref() }
        .head
        .store(head, Ordering::Relaxed);
    add_seals(&file, BASE_SEALS)?;
    Ok((map, file))
}

/// Maps an existing consumer page read-write (the producer reads it; the worker writes it).
fn map_page(file: &File) -> io::Result<(MmapRaw, ())> {
    let map = MmapOptions::new()
        .len(CONSUMER_PAGE_BYTES as usize)
        .map_raw(file)?;
    Ok((map, ()))
}

pub(crate) fn add_seals(file: &File, seals: SealFlag) -> io::Result<()> {
    fcntl(file, FcntlArg::F_ADD_SEALS(seals))?;
    Ok(())
}

fn check_seals(file: &File, which: &'static str, needed: SealFlag) -> Result<(), AttachError> {
    let found = fcntl(file, FcntlArg::F_GET_SEALS).map_err(|e| AttachError::Io {
        what: "F_GET_SEALS (is it a memfd?)",
        error: e.into(),
    })?;
    let needed = needed.bits();
    if found & needed != needed {
        return Err(AttachError::Unsealed {
            which,
            found,
            needed,
        });
    }
    Ok(())
}

fn header_ptr(map: &MmapRaw) -> NonNull<ProducerHeader> {
    NonNull::new(map.as_mut_ptr().cast()).expect("mmap never returns null")
}

fn page_ptr(map: &MmapRaw) -> NonNull<ConsumerLine> {
    NonNull::new(map.as_mut_ptr().cast()).expect("mmap never returns null")
}

fn slots_ptr(map: &MmapRaw) -> NonNull<u8> {
    // SAFETY: callers checked the mapping is larger than SLOTS_OFFSET.
    NonNull::new(unsafe { map.as_mut_ptr().add(SLOTS_OFFSET as usize) }).expect("non-null")
}
