//! The health table: the demux's verdict on each backend of the routes that check their
//! backends' health, one byte per slot, written by the demux (its health checks) and read by
//! every worker. `shm-layout.md`, "Health table", is the normative layout.
//!
//! The demux creates the table ([`HealthWriter::create`]): a memfd sized, its header written,
//! sealed against shrinking, growing and any change of seals, its mode made read-only for its
//! owner and nobody else, and mapped writable through the descriptor it keeps. Every worker is
//! handed a read-only open file description of it ([`HealthWriter::read_only`]), as a worker is
//! handed its peers' rate tables (`crate::tally`): a writable mapping of it fails (`EACCES`), and
//! reopening it writable through `/proc/self/fd` fails on the mode (0400) to any process without
//! `CAP_DAC_OVERRIDE`, while the workers' filter refuses every `chmod`. The table is not sealed
//! with `F_SEAL_FUTURE_WRITE`: that seal would also refuse the demux a new writable mapping
//! after `ringmux upgrade` replaced its image, and the workers it hands over read on from the
//! table they mapped, which the new image takes over ([`HealthWriter::adopt`]) and writes.
//! A worker maps it ([`HealthReader::attach`]) and checks its size, header and seals, and that
//! it cannot write it (its description is read-only, or an older demux sealed it against every
//! writer).
//!
//! A slot is one byte, loaded once by a reader: [`Verdict::from_byte`] takes any other value
//! than the ones the layout names as no verdict, so nothing the table holds can make a reader
//! do more than use or skip a backend.

use std::fs::File;
use std::io::{self, Write};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::PermissionsExt;
use std::sync::atomic::{AtomicU8, Ordering};

use memmap2::{Mmap, MmapOptions, MmapRaw};
use nix::fcntl::{fcntl, FcntlArg, OFlag, SealFlag};
use nix::sys::memfd::{memfd_create, MFdFlags};

/// `RMXHLTH1`, little-endian: the first word of the table.
pub const HEALTH_MAGIC: u64 = u64::from_le_bytes(*b"RMXHLTH1");
/// The layout version; an opener refuses another.
pub const HEALTH_VERSION: u32 = 1;
/// The header's size.
pub const HEALTH_HEADER_BYTES: usize = 64;
/// The most slots a table has: every backend of every route that checks health.
pub const MAX_HEALTH_SLOTS: u32 = 64 * 1024;

/// The seals a reader requires: no resize under its mapping (`SIGBUS`), no change of seals.
/// That no worker writes is the description's and the mode's ([`HealthWriter::read_only`]).
const SEALS: SealFlag = SealFlag::F_SEAL_SHRINK
    .union(SealFlag::F_SEAL_GROW)
    .union(SealFlag::F_SEAL_SEAL);

/// The table's mode: read-only for its owner, nothing for anyone else.
const MODE: u32 = 0o400;

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
    /// A worker was handed a descriptor it could write the table through.
    #[error("the health table was handed over writable: a worker must get a read-only descriptor")]
    Writable,
    /// The table handed over by a previous image cannot be mapped writable again: an image that
    /// sealed it against every writer (`F_SEAL_FUTURE_WRITE`) made it, or the descriptor is
    /// read-only.
    #[error("the health table handed over cannot be written again ({0}); its workers keep the verdicts it holds until the next reload")]
    NotWritable(io::Error),
}

/// The demux's side: the one writable mapping of a table.
#[derive(Debug)]
pub struct HealthWriter {
    fd: OwnedFd,
    map: MmapRaw,
    slots: u32,
}

impl HealthWriter {
    /// A new table of `slots` slots, each [`Verdict::Unknown`], mapped writable through the
    /// demux's descriptor; sealed and made read-only so that no other descriptor can write it.
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
        fcntl(&file, FcntlArg::F_ADD_SEALS(SEALS)).map_err(io::Error::from)?;
        file.set_permissions(std::fs::Permissions::from_mode(MODE))?;
        let map = MmapOptions::new().len(bytes).map_raw(&file)?;
        Ok(HealthWriter {
            fd: file.into(),
            map,
            slots,
        })
    }

    /// Takes over the table `fd` that a previous image of the demux created and handed over
    /// (its own descriptor, as [`HealthWriter::fd`] gave it): checked as a worker checks it,
    /// then mapped writable again, so that the workers reading it get verdicts on.
    pub fn adopt(fd: OwnedFd) -> Result<HealthWriter, HealthTableError> {
        use std::os::unix::fs::FileExt;
        let file = File::from(fd);
        check_seals(&file)?;
        let size = file.metadata()?.len();
        let mut head = [0u8; HEALTH_HEADER_BYTES];
        file.read_exact_at(&mut head, 0)
            .map_err(|_| HealthTableError::Size { size, slots: 0 })?;
        let slots = header_slots(&head).ok_or(HealthTableError::Header)?;
        if slots > MAX_HEALTH_SLOTS || (table_bytes(slots) as u64) > size {
            return Err(HealthTableError::Size { size, slots });
        }
        // Mapped writable: refused when the table is sealed against every new writer.
        let map = MmapOptions::new()
            .len(table_bytes(slots))
            .map_raw(&file)
            .map_err(HealthTableError::NotWritable)?;
        Ok(HealthWriter {
            fd: file.into(),
            map,
            slots,
        })
    }

    /// The demux's own descriptor, writable: what a new image of the demux takes over
    /// ([`HealthWriter::adopt`]); never a worker's.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// A read-only open file description of the table: what every worker is handed. Opened
    /// through `/proc/self/fd` in the caller (the demux), which has `/proc`.
    pub fn read_only(&self) -> io::Result<OwnedFd> {
        crate::tally::read_only(&self.fd)
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
    /// Maps `fd` read-only after checking its seals, size and header, and that it cannot
    /// write the table through `fd`.
    pub fn attach(fd: OwnedFd) -> Result<HealthReader, HealthTableError> {
        let file = File::from(fd);
        let seals = check_seals(&file)?;
        let flags = fcntl(&file, FcntlArg::F_GETFL).map_err(io::Error::from)?;
        let read_only = OFlag::from_bits_truncate(flags) & OFlag::O_ACCMODE == OFlag::O_RDONLY;
        // A demux of a build before the table was handed over read-only sealed it against
        // every writer instead: that one is as safe to read.
        if !read_only && seals & SealFlag::F_SEAL_FUTURE_WRITE.bits() == 0 {
            return Err(HealthTableError::Writable);
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

/// Checks that `file` has the seals every table has; returns every seal it has.
fn check_seals(file: &File) -> Result<i32, HealthTableError> {
    let found = fcntl(file, FcntlArg::F_GET_SEALS).map_err(io::Error::from)?;
    if found & SEALS.bits() != SEALS.bits() {
        return Err(HealthTableError::Unsealed {
            found,
            needed: SEALS.bits(),
        });
    }
    Ok(found)
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
        HealthReader::attach(w.read_only().unwrap()).unwrap()
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
    /// through `write`, not by turning its read-only mapping writable, nor resize it; and its
    /// mode lets no process without `CAP_DAC_OVERRIDE` reopen it writable.
    #[test]
    fn a_worker_cannot_write_the_table() {
        let w = HealthWriter::create(8).unwrap();
        let file = File::from(w.read_only().unwrap());
        // SAFETY: a test of refusal; the mapping, if made, is dropped unused.
        let writable = unsafe { MmapOptions::new().len(table_bytes(8)).map_mut(&file) };
        assert!(writable.is_err(), "a writable shared mapping is refused");
        assert!((&file).write_all(&[1]).is_err());
        // SAFETY: as above.
        let map = unsafe { MmapOptions::new().len(table_bytes(8)).map(&file) }.unwrap();
        assert!(map.make_mut().is_err(), "mprotect to writable is refused");
        assert!(file.set_len(0).is_err());
        assert_eq!(file.metadata().unwrap().permissions().mode() & 0o777, MODE);
        w.set(0, Verdict::Up);
        assert_eq!(reader_of(&w).get(0), Verdict::Up, "the demux still writes");
    }

    /// A worker refuses a descriptor it could write the table through.
    #[test]
    fn a_writable_descriptor_is_refused_by_a_worker() {
        let w = HealthWriter::create(2).unwrap();
        let e = HealthReader::attach(w.fd().try_clone_to_owned().unwrap()).unwrap_err();
        assert!(matches!(e, HealthTableError::Writable), "{e}");
    }

    /// What a new image of the demux does after `ringmux upgrade`: it takes the table over by
    /// the descriptor the old one kept, and its writes reach the workers that mapped it before.
    #[test]
    fn a_new_image_takes_a_table_over_and_its_readers_see_its_writes() {
        let old = HealthWriter::create(3).unwrap();
        let worker = reader_of(&old);
        old.set(0, Verdict::Up);
        let new = HealthWriter::adopt(old.fd().try_clone_to_owned().unwrap()).unwrap();
        drop(old);
        assert_eq!((new.slots(), new.get(0)), (3, Verdict::Up));
        new.set(1, Verdict::Down);
        assert_eq!(worker.get(1), Verdict::Down);
        // Nor a read-only descriptor, nor one that is no table.
        let e = HealthWriter::adopt(new.read_only().unwrap()).unwrap_err();
        assert!(matches!(e, HealthTableError::NotWritable(_)), "{e}");
        let plain = memfd_create(c"x", MFdFlags::empty()).unwrap();
        let e = HealthWriter::adopt(plain).unwrap_err();
        assert!(matches!(e, HealthTableError::Unsealed { .. }), "{e}");
    }

    /// A table as builds before [`HealthWriter::adopt`] made it: sealed against every writer
    /// too, and handed to workers by the demux's own descriptor.
    fn table_sealed_against_every_writer(slots: u32) -> OwnedFd {
        let fd = memfd_create(c"old", MFdFlags::MFD_ALLOW_SEALING).unwrap();
        let mut file = File::from(fd);
        file.set_len(table_bytes(slots) as u64).unwrap();
        file.write_all(&header(slots)).unwrap();
        let seals = SEALS | SealFlag::F_SEAL_FUTURE_WRITE;
        fcntl(&file, FcntlArg::F_ADD_SEALS(seals)).unwrap();
        file.into()
    }

    /// Across an upgrade from such a build: its workers' table cannot be taken over (they keep
    /// its verdicts until the next reload, as before), and a worker of this build still reads
    /// a table that such a demux hands it.
    #[test]
    fn a_table_sealed_against_every_writer_is_read_but_not_taken_over() {
        let fd = table_sealed_against_every_writer(4);
        let reader = HealthReader::attach(fd.try_clone().unwrap()).unwrap();
        assert_eq!(reader.slots(), 4);
        let e = HealthWriter::adopt(fd).unwrap_err();
        assert!(matches!(e, HealthTableError::NotWritable(_)), "{e}");
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
