//! The health table: the demux's verdict on each backend of the routes that check their
//! backends' health, one byte per slot, written by the demux (its health checks) and read by
//! every worker. `shm-layout.md`, "Health table", is the normative layout.
//!
//! The demux creates the table ([`HealthWriter::create`]): a memfd sized, its header written,
//! mapped writable, then sealed against shrinking, growing and any later write
//! (`F_SEAL_FUTURE_WRITE`), so the descriptor it hands every worker can only be mapped
//! read-only; the demux's own mapping keeps writing. A worker maps it ([`HealthReader::attach`])
//! and checks its size, header and seals.
//!
//! A slot is one byte, loaded once by a reader: [`Verdict::from_byte`] takes any other value
//! than the ones the layout names as no verdict, so nothing the table holds can make a reader
//! do more than use or skip a backend.

use std::fs::File;
use std::io::{self, Write};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU8, Ordering};

use memmap2::{Mmap, MmapOptions, MmapRaw};
use nix::fcntl::{fcntl, FcntlArg, SealFlag};
use nix::sys::memfd::{memfd_create, MFdFlags};

/// `RMXHLTH1`, little-endian: the first word of the table.
pub const HEALTH_MAGIC: u64 = u64::from_le_bytes(*b"RMXHLTH1");
/// The layout version; an opener refuses another.
pub const HEALTH_VERSION: u32 = 1;
/// The header's size.
pub const HEALTH_HEADER_BYTES: usize = 64;
/// The most slots a table has: every backend of every route that checks health.
pub const MAX_HEALTH_SLOTS: u32 = 64 * 1024;

/// The seals a reader requires: no resize under its mapping (`SIGBUS`), no writable mapping
/// but the demux's, no change of seals.
const SEALS: SealFlag = SealFlag::F_SEAL_SHRINK
    .union(SealFlag::F_SEAL_GROW)
    .union(SealFlag::F_SEAL_FUTURE_WRITE)
    .union(SealFlag::F_SEAL_SEAL);

/// The byte size of a table of `slots` slots: the header, then a byte per slot, rounded up to
/// whole 8-byte words.
pub const fn table_bytes(slots: u32) -> usize {
    HEALTH_HEADER_BYTES + (slots as usize).div_ceil(8) * 8
}

/// The demux's verdict on one backend, as a slot holds it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Verdict {
    /// No result yet (or a value this build does not know): the worker decides alone.
    Unknown,
    /// The last `passes` probes passed.
    Up,
    /// The last `fails` probes failed: the worker leaves the backend out.
    Down,
}

impl Verdict {
    /// The slot's byte.
    pub const fn byte(self) -> u8 {
        match self {
            Verdict::Unknown => 0,
            Verdict::Up => 1,
            Verdict::Down => 2,
        }
    }

    /// What a slot's byte says; any value but 1 and 2 is no verdict.
    pub const fn from_byte(b: u8) -> Verdict {
        match b {
            1 => Verdict::Up,
            2 => Verdict::Down,
            _ => Verdict::Unknown,
        }
    }

    pub const fn as_str(self) -> &'static str {
        match self {
            Verdict::Unknown => "unknown",
            Verdict::Up => "up",
            Verdict::Down => "down",
        }
    }
}

/// Why a table cannot be made or used.
#[derive(Debug, thiserror::Error)]
pub enum HealthTableError {
    #[error("the health table: {0}")]
    Io(#[from] io::Error),
    #[error("the health table: {slots} slots, at most {MAX_HEALTH_SLOTS}")]
    TooManySlots { slots: u32 },
    #[error("the health table: {size} bytes, too small for its header or its {slots} slots")]
    Size { size: u64, slots: u32 },
    #[error("the health table: not a health table of layout version {HEALTH_VERSION}")]
    Header,
    #[error("the health table lacks seals: has {found:#x}, needs {needed:#x}")]
    Unsealed { found: i32, needed: i32 },
}

/// The demux's side: the one writable mapping of a table.
#[derive(Debug)]
pub struct HealthWriter {
    fd: OwnedFd,
    map: MmapRaw,
    slots: u32,
}

impl HealthWriter {
    /// A new table of `slots` slots, each [`Verdict::Unknown`], mapped writable and sealed so
    /// no other mapping can write it.
    pub fn create(slots: u32) -> Result<HealthWriter, HealthTableError> {
        if slots > MAX_HEALTH_SLOTS {
            return Err(HealthTableError::TooManySlots { slots });
        }
        let fd = memfd_create(
            c"ringmux-health",
            MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING,
        )
        .map_err(io::Error::from)?;
        let mut file = File::from(fd);
        let bytes = table_bytes(slots);
        file.set_len(bytes as u64)?;
        file.write_all(&header(slots))?;
        // Mapped before F_SEAL_FUTURE_WRITE: this mapping keeps writing, no later one can.
        let map = MmapOptions::new().len(bytes).map_raw(&file)?;
        fcntl(&file, FcntlArg::F_ADD_SEALS(SEALS)).map_err(io::Error::from)?;
        Ok(HealthWriter {
            fd: file.into(),
            map,
            slots,
        })
    }

    /// The descriptor every worker is handed.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    pub fn slots(&self) -> u32 {
        self.slots
    }

    /// Stores `verdict` in slot `slot` (one past the table is ignored).
    pub fn set(&self, slot: u32, verdict: Verdict) {
        if slot >= self.slots {
            return;
        }
        // SYNC: none needed. Each slot is an independent byte; a reader that loads the value
        // before the store uses the previous verdict, which the design accepts.
        slot_at(self.map.as_ptr(), slot).store(verdict.byte(), Ordering::Relaxed);
    }

    /// The verdict in slot `slot` (as [`HealthReader::get`]).
    pub fn get(&self, slot: u32) -> Verdict {
        match slot < self.slots {
            true => Verdict::from_byte(slot_at(self.map.as_ptr(), slot).load(Ordering::Relaxed)),
            false => Verdict::Unknown,
        }
    }
}

/// A worker's side: a read-only mapping of the demux's table.
#[derive(Debug)]
pub struct HealthReader {
    map: Mmap,
    slots: u32,
}

impl HealthReader {
    /// Maps `fd` read-only after checking its seals, size and header.
    pub fn attach(fd: OwnedFd) -> Result<HealthReader, HealthTableError> {
        let file = File::from(fd);
        let found = fcntl(&file, FcntlArg::F_GET_SEALS).map_err(io::Error::from)?;
        if found & SEALS.bits() != SEALS.bits() {
            return Err(HealthTableError::Unsealed {
                found,
                needed: SEALS.bits(),
            });
        }
        let size = file.metadata()?.len();
        if size < HEALTH_HEADER_BYTES as u64 {
            return Err(HealthTableError::Size { size, slots: 0 });
        }
        // SAFETY: the memfd is sealed against shrinking (checked above), so every byte of a
        // mapping of its current size stays backed; the demux writes it concurrently, so it
        // is only read through atomic loads (`slot_at`) past the header, which the demux
        // wrote before handing the descriptor over and never again.
        let map = unsafe { MmapOptions::new().len(size as usize).map(&file) }?;
        let slots = header_slots(&map).ok_or(HealthTableError::Header)?;
        if slots > MAX_HEALTH_SLOTS || (table_bytes(slots) as u64) > size {
            return Err(HealthTableError::Size { size, slots });
        }
        Ok(HealthReader { map, slots })
    }

    pub fn slots(&self) -> u32 {
        self.slots
    }

    /// The verdict in slot `slot`, loaded once; [`Verdict::Unknown`] past the table.
    pub fn get(&self, slot: u32) -> Verdict {
        match slot < self.slots {
            // SYNC: none needed (see `HealthWriter::set`).
            true => Verdict::from_byte(slot_at(self.map.as_ptr(), slot).load(Ordering::Relaxed)),
            false => Verdict::Unknown,
        }
    }
}

/// The header of a table of `slots` slots.
fn header(slots: u32) -> [u8; HEALTH_HEADER_BYTES] {
    let mut b = [0u8; HEALTH_HEADER_BYTES];
    b[0..8].copy_from_slice(&HEALTH_MAGIC.to_le_bytes());
    b[8..12].copy_from_slice(&HEALTH_VERSION.to_le_bytes());
    b[12..16].copy_from_slice(&slots.to_le_bytes());
    b
}

/// The slot count of the header at the start of `map`, if it is a table's of this layout.
fn header_slots(map: &[u8]) -> Option<u32> {
    let at = |from: usize, to: usize| map.get(from..to);
    let magic = u64::from_le_bytes(at(0, 8)?.try_into().ok()?);
    let version = u32::from_le_bytes(at(8, 12)?.try_into().ok()?);
    let slots = u32::from_le_bytes(at(12, 16)?.try_into().ok()?);
    (magic == HEALTH_MAGIC && version == HEALTH_VERSION).then_some(slots)
}

/// Slot `slot` of the table mapped at `base`; the caller has checked `slot` is below the
/// table's slot count.
fn slot_at<'m>(base: *const u8, slot: u32) -> &'m AtomicU8 {
    let at = base.wrapping_add(HEALTH_HEADER_BYTES + slot as usize);
    // SAFETY: `base` is a live mapping of at least `table_bytes(slots)` bytes (checked at
    // create and attach) and `slot < slots` (the callers' check), so `at` lies within it; an
    // AtomicU8 has alignment 1. The reference lives no longer than the writer or reader that
    // owns the mapping.
    unsafe { &*(at as *const AtomicU8) }
}

// The table's size, as shm-layout.md gives it.
const _: () = assert!(table_bytes(0) == HEALTH_HEADER_BYTES);
const _: () = assert!(table_bytes(1) == HEALTH_HEADER_BYTES + 8);

#[cfg(test)]
mod tests {
    use super::*;

    fn reader_of(w: &HealthWriter) -> HealthReader {
        HealthReader::attach(w.fd().try_clone_to_owned().unwrap()).unwrap()
    }

    #[test]
    fn the_demux_writes_and_a_worker_reads() {
        let w = HealthWriter::create(3).unwrap();
        let r = reader_of(&w);
        assert_eq!(r.slots(), 3);
        assert_eq!(r.get(0), Verdict::Unknown);
        w.set(1, Verdict::Down);
        w.set(2, Verdict::Up);
        w.set(3, Verdict::Down);
        assert_eq!(
            (r.get(0), r.get(1), r.get(2), r.get(3)),
            (
                Verdict::Unknown,
                Verdict::Down,
                Verdict::Up,
                Verdict::Unknown
            )
        );
        assert_eq!(w.get(1), Verdict::Down);
    }

    #[test]
    fn unknown_bytes_are_no_verdict() {
        for b in 0..=255u8 {
            let v = Verdict::from_byte(b);
            assert_eq!(v != Verdict::Unknown, b == 1 || b == 2, "{b}");
            if v != Verdict::Unknown {
                assert_eq!(v.byte(), b);
            }
        }
    }

    /// A worker holding the table cannot write it: not through a writable mapping, not
    /// through `write`, not by turning its read-only mapping writable, nor resize it.
    #[test]
    fn a_worker_cannot_write_the_table() {
        let w = HealthWriter::create(8).unwrap();
        let file = File::from(w.fd().try_clone_to_owned().unwrap());
        // SAFETY: a test of refusal; the mapping, if made, is dropped unused.
        let writable = unsafe { MmapOptions::new().len(table_bytes(8)).map_mut(&file) };
        assert!(writable.is_err(), "a writable shared mapping is refused");
        assert!((&file).write_all(&[1]).is_err());
        // SAFETY: as above.
        let map = unsafe { MmapOptions::new().len(table_bytes(8)).map(&file) }.unwrap();
        assert!(map.make_mut().is_err(), "mprotect to writable is refused");
        assert!(file.set_len(0).is_err());
        w.set(0, Verdict::Up);
        assert_eq!(reader_of(&w).get(0), Verdict::Up, "the demux still writes");
    }

    #[test]
    fn a_wrong_or_unsealed_table_is_refused() {
        let plain = memfd_create(c"x", MFdFlags::empty()).unwrap();
        File::from(plain.try_clone().unwrap())
            .set_len(table_bytes(4) as u64)
            .unwrap();
        let e = HealthReader::attach(plain).unwrap_err();
        assert!(matches!(e, HealthTableError::Unsealed { .. }), "{e}");
        assert!(matches!(
            HealthWriter::create(MAX_HEALTH_SLOTS + 1),
            Err(HealthTableError::TooManySlots { .. })
        ));
    }
}
