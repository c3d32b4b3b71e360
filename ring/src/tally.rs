//! Single-writer counter tables in shared memory: one per worker, written by that worker only
//! and read by every worker of its generation, so that a per-client rate limit holds for the
//! whole box (the built-in server's `limits` module decides with them). `shm-layout.md`,
//! "Rate tables", is the normative layout.
//!
//! The demux creates one table per worker ([`create`]) and hands each worker its own table's
//! descriptor as it is, and every other table's as a read-only open file description
//! ([`read_only`]): a `PROT_WRITE` shared mapping of it fails (`EACCES`), and a worker has no
//! `/proc` to reopen it writable (its Landlock domain grants none). The worker maps them
//! ([`Tallies::attach`]), which checks each one's size and header.
//!
//! A table is `slots` slots of two cells; a cell is one `u64`, `window << 32 | count`: the
//! requests the owner admitted in the window `window` (a window number, mod 2^32) for every
//! key hashed to the slot. A reader loads each cell once and uses its copy; nothing a peer
//! writes can make a reader index out of its mapping or take anything but a number from it.

use std::fs::File;
use std::io::{self, Write};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};

use memmap2::{Mmap, MmapMut, MmapOptions};

/// `RMXTALLY`, little-endian: the first word of every table.
pub const TALLY_MAGIC: u64 = u64::from_le_bytes(*b"RMXTALLY");
/// The layout version; an opener refuses another.
pub const TALLY_VERSION: u32 = 1;
/// Slots per table: 16 Ki of 16 bytes, 256 KiB a worker, whatever the number of clients.
pub const TALLY_SLOTS: u32 = 16 * 1024;
/// The header's size: one cache line pair, as the rings' lines.
pub const TALLY_HEADER_BYTES: usize = 128;
/// Cells per slot: the windows of even and odd number.
pub const CELLS_PER_SLOT: usize = 2;
/// A table's size in bytes.
pub const TALLY_BYTES: usize = TALLY_HEADER_BYTES + TALLY_SLOTS as usize * CELLS_PER_SLOT * 8;

/// The header, written by the demux before any worker maps the table.
#[repr(C)]
struct TallyHeader {
    magic: u64,
    version: u32,
    slots: u32,
    /// The key every worker of the generation hashes a client with (the same in every table).
    hash_key: [u64; 2],
    reserved: [u64; 12],
}

const _: () = assert!(std::mem::size_of::<TallyHeader>() == TALLY_HEADER_BYTES);
const _: () = assert!(std::mem::offset_of!(TallyHeader, version) == 8);
const _: () = assert!(std::mem::offset_of!(TallyHeader, slots) == 12);
const _: () = assert!(std::mem::offset_of!(TallyHeader, hash_key) == 16);

impl TallyHeader {
    fn bytes(hash_key: [u64; 2]) -> [u8; TALLY_HEADER_BYTES] {
        let mut b = [0u8; TALLY_HEADER_BYTES];
        b[0..8].copy_from_slice(&TALLY_MAGIC.to_le_bytes());
        b[8..12].copy_from_slice(&TALLY_VERSION.to_le_bytes());
        b[12..16].copy_from_slice(&TALLY_SLOTS.to_le_bytes());
        b[16..24].copy_from_slice(&hash_key[0].to_le_bytes());
        b[24..32].copy_from_slice(&hash_key[1].to_le_bytes());
        b
    }
}

/// A new table, its header written with `hash_key`, its cells zero; sized and sealed against
/// shrinking and growing (no process can truncate it under another's mapping: `SIGBUS`).
pub fn create(hash_key: [u64; 2]) -> io::Result<OwnedFd> {
    use nix::fcntl::{fcntl, FcntlArg, SealFlag};
    use nix::sys::memfd::{memfd_create, MFdFlags};
    let fd = memfd_create(
        c"ringmux-tally",
        MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING,
    )?;
    let mut file = File::from(fd);
    file.set_len(TALLY_BYTES as u64)?;
    file.write_all(&TallyHeader::bytes(hash_key))?;
    fcntl(
        &file,
        FcntlArg::F_ADD_SEALS(
            SealFlag::F_SEAL_SHRINK | SealFlag::F_SEAL_GROW | SealFlag::F_SEAL_SEAL,
        ),
    )?;
    // Read-only for its owner and nobody else: a worker that does not own the table gets a
    // read-only descriptor, and reopening that writable through `/proc/self/fd` (which Landlock
    // does not govern: the file is not on a path) is then refused (`EACCES`) to any worker of
    // another user than the demux's. The owning worker writes through the descriptor it is
    // given, opened writable before this.
    file.set_permissions(std::os::unix::fs::PermissionsExt::from_mode(0o400))?;
    Ok(file.into())
}

/// A read-only open file description of the table `fd`: what a worker that does not own it
/// gets. Opened through `/proc/self/fd` in the caller (the demux), which has `/proc`.
pub fn read_only(fd: impl AsFd) -> io::Result<OwnedFd> {
    let path = format!("/proc/self/fd/{}", fd.as_fd().as_raw_fd());
    Ok(File::open(path)?.into())
}

/// A table a worker cannot use.
#[derive(Debug, thiserror::Error)]
pub enum TallyError {
    #[error("a rate table: {0}")]
    Create(#[from] io::Error),
    #[error("rate table {index}: {source}")]
    Map { index: usize, source: io::Error },
    #[error("rate table {index}: {size} bytes, expected {TALLY_BYTES}")]
    Size { index: usize, size: u64 },
    #[error("rate table {index}: not a rate table of layout version {TALLY_VERSION}")]
    Header { index: usize },
}

/// A worker's view of every table of its generation: its own, writable, and the others',
/// read-only.
#[derive(Debug)]
pub struct Tallies {
    own: MmapMut,
    /// Every table, its own included, read-only views (the own one through `own`).
    peers: Vec<Mmap>,
    hash_key: [u64; 2],
}

impl Tallies {
    /// Maps `own` writable and every one of `peers` read-only, each checked.
    pub fn attach(own: OwnedFd, peers: Vec<OwnedFd>) -> Result<Tallies, TallyError> {
        let own_file = File::from(own);
        check_size(&own_file, 0)?;
        // SAFETY: the file is a sealed memfd of TALLY_BYTES (checked above; it cannot shrink,
        // F_SEAL_SHRINK), so every byte of the mapping stays backed. Others write nothing in
        // it (they hold read-only descriptions); the mapping is only read and written through
        // atomics (`cell`).
        let own = unsafe { MmapOptions::new().len(TALLY_BYTES).map_mut(&own_file) }
            .map_err(|source| TallyError::Map { index: 0, source })?;
        let hash_key = header_of(&own, 0)?;
        let mut maps = Vec::with_capacity(peers.len());
        for (i, fd) in peers.into_iter().enumerate() {
            let index = i + 1;
            let file = File::from(fd);
            check_size(&file, index)?;
            // SAFETY: as above (sealed, sized); the owner writes it concurrently, so it is
            // only ever read through atomic loads (`cell`), never as plain memory.
            let map = unsafe { MmapOptions::new().len(TALLY_BYTES).map(&file) }
                .map_err(|source| TallyError::Map { index, source })?;
            header_of(&map, index)?;
            maps.push(map);
        }
        Ok(Tallies {
            own,
            peers: maps,
            hash_key,
        })
    }

    /// The key clients are hashed with (from this worker's own table).
    pub fn hash_key(&self) -> [u64; 2] {
        self.hash_key
    }

    /// How many tables, this worker's included.
    pub fn tables(&self) -> usize {
        1 + self.peers.len()
    }

    /// Every cell of slot `slot` (taken modulo [`TALLY_SLOTS`]) of every table, each loaded
    /// once: `(table, cell value)`, table 0 this worker's own.
    pub fn read(&self, slot: u32, mut each: impl FnMut(usize, u64)) {
        for c in 0..CELLS_PER_SLOT {
            each(0, cell(self.own.as_ptr(), slot, c).load(Ordering::Relaxed));
        }
        for (t, map) in self.peers.iter().enumerate() {
            for c in 0..CELLS_PER_SLOT {
                // SYNC: none needed. Each cell is an independent count; a reader that sees
                // an older value decides on an older count (at most the writes of the last
                // instant are missed), which is the race the design accepts.
                each(t + 1, cell(map.as_ptr(), slot, c).load(Ordering::Relaxed));
            }
        }
    }

    /// Sets this worker's cell `c` of slot `slot` to what `update` makes of its value.
    pub fn update(&self, slot: u32, c: usize, update: impl Fn(u64) -> u64) {
        let cell = cell(self.own.as_ptr(), slot, c % CELLS_PER_SLOT);
        // Relaxed: see `read`. A loop because a worker may serve from more than one thread;
        // no other process writes this table.
        let _ = cell.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| Some(update(v)));
    }
}

fn check_size(file: &File, index: usize) -> Result<(), TallyError> {
    let size = file
        .metadata()
        .map_err(|source| TallyError::Map { index, source })?
        .len();
    match size == TALLY_BYTES as u64 {
        true => Ok(()),
        false => Err(TallyError::Size { index, size }),
    }
}

/// The hash key of the mapped table `map` if its header is a table's of this layout.
fn header_of(map: &[u8], index: usize) -> Result<[u64; 2], TallyError> {
    let word = |at: usize| {
        let mut b = [0u8; 8];
        b.copy_from_slice(&map[at..at + 8]);
        u64::from_le_bytes(b)
    };
    let ok = word(0) == TALLY_MAGIC
        && word(8) == u64::from(TALLY_VERSION) | (u64::from(TALLY_SLOTS) << 32);
    match ok {
        true => Ok([word(16), word(24)]),
        false => Err(TallyError::Header { index }),
    }
}

/// Cell `c` of slot `slot` (modulo [`TALLY_SLOTS`]) of the table mapped at `base`.
fn cell<'m>(base: *const u8, slot: u32, c: usize) -> &'m AtomicU64 {
    let index = (slot % TALLY_SLOTS) as usize * CELLS_PER_SLOT + c % CELLS_PER_SLOT;
    // The offset is below TALLY_BYTES: the index is below TALLY_SLOTS * CELLS_PER_SLOT by the
    // moduli above.
    let at = base.wrapping_add(TALLY_HEADER_BYTES + index * 8) as *const AtomicU64;
    // SAFETY: `base` is a live mapping of TALLY_BYTES (checked at attach), page-aligned, so
    // the header and every 8-byte cell after it are aligned for AtomicU64, and `at` lies
    // within it (above). The reference lives no longer than `Tallies`, which owns the mapping.
    unsafe { &*at }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_owner_writes_and_every_reader_sees_it() {
        let key = [1, 2];
        let tables: Vec<OwnedFd> = (0..2).map(|_| create(key).unwrap()).collect();
        let ro = |t: &OwnedFd| read_only(t).unwrap();
        let w0 = Tallies::attach(tables[0].try_clone().unwrap(), vec![ro(&tables[1])]).unwrap();
        let w1 = Tallies::attach(tables[1].try_clone().unwrap(), vec![ro(&tables[0])]).unwrap();
        assert_eq!((w0.hash_key(), w0.tables()), (key, 2));
        w0.update(7, 1, |v| v + 5);
        let mut seen = Vec::new();
        w1.read(7 + TALLY_SLOTS, |t, v| seen.push((t, v)));
        assert_eq!(seen, [(0, 0), (0, 0), (1, 0), (1, 5)]);
    }

    /// A worker holding another's table cannot write it: not through a writable mapping, not
    /// through `write`, not by turning its read-only mapping writable.
    #[test]
    fn a_peer_cannot_write_anothers_table() {
        let table = create([0, 0]).unwrap();
        let ro = File::from(read_only(&table).unwrap());
        // SAFETY: a test of refusal; the mapping, if made, is dropped unused.
        let writable = unsafe { MmapOptions::new().len(TALLY_BYTES).map_mut(&ro) };
        assert_eq!(
            writable.unwrap_err().kind(),
            io::ErrorKind::PermissionDenied
        );
        assert!((&ro).write_all(&[1]).is_err());
        // SAFETY: as above.
        let map = unsafe { MmapOptions::new().len(TALLY_BYTES).map(&ro) }.unwrap();
        assert!(map.make_mut().is_err(), "mprotect to writable is refused");
        assert!(
            ro.set_len(0).is_err(),
            "nor truncated (sealed, and read-only)"
        );
    }

    #[test]
    fn a_wrong_table_is_refused() {
        let short =
            nix::sys::memfd::memfd_create(c"x", nix::sys::memfd::MFdFlags::empty()).unwrap();
        File::from(short.try_clone().unwrap())
            .set_len(TALLY_BYTES as u64)
            .unwrap();
        let e = Tallies::attach(short, vec![]).unwrap_err();
        assert!(matches!(e, TallyError::Header { index: 0 }), "{e}");
    }
}
