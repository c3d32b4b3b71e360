//! The system calls of static-file serving, each wrapped once: `openat2(2)` (path resolution
//! confined to the document root), `preadv2(2)` (reads that can refuse to wait for the disk) and
//! the coarse monotonic clock the cache checks on every hit. All three go through `nix` or
//! `rustix`; the rest of `files` is safe code over these functions.

use std::ffi::CStr;
use std::fs::File;
use std::io::{self, IoSliceMut};
use std::os::fd::BorrowedFd;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use bytes::BytesMut;

/// Opens `path`, relative to the directory `dir`, read-only, with one `openat2(2)` call that
/// both resolves the path and refuses to leave `dir`:
///
/// * `RESOLVE_BENEATH`: `..` above `dir`, absolute paths and any symlink (absolute, or relative
///   and climbing out) whose target is not beneath `dir` fail with `EXDEV`. The kernel checks
///   this during the one walk that also opens the file, so swapping a symlink between the check
///   and the open is impossible: there is no separate check.
/// * `RESOLVE_NO_MAGICLINKS`: `/proc/*/fd`-style links fail with `ELOOP`.
/// * `cached_only` adds `RESOLVE_CACHED`: fail with `EAGAIN` rather than read a directory from
///   the disk, so the caller can retry on a blocking thread.
/// * `O_NONBLOCK`: opening a FIFO under the root does not block; `O_NOCTTY`: a terminal device
///   never becomes our controlling terminal. Neither changes reads of regular files.
///
/// Errors that escape: `ENOENT`, `ENOTDIR`, `EXDEV`, `ELOOP`, `EACCES`, `ENAMETOOLONG`,
/// `EAGAIN` (only with `cached_only`), `ENOSYS` (kernel older than 5.6; `E2BIG`/`EINVAL` on
/// kernels that know openat2 but not one of the flags), `EMFILE`/`ENFILE`. `EINTR` is retried.
pub fn open_beneath(dir: BorrowedFd<'_>, path: &CStr, cached_only: bool) -> io::Result<File> {
    use nix::fcntl::{openat2, OFlag, OpenHow, ResolveFlag};
    let mut resolve = ResolveFlag::RESOLVE_BENEATH | ResolveFlag::RESOLVE_NO_MAGICLINKS;
    if cached_only {
        // nix names no RESOLVE_CACHED (Linux 5.12); the kernel's bit is libc's.
        resolve |= ResolveFlag::from_bits_retain(libc::RESOLVE_CACHED);
    }
    let how = OpenHow::new()
        .flags(OFlag::O_RDONLY | OFlag::O_CLOEXEC | OFlag::O_NOCTTY | OFlag::O_NONBLOCK)
        .resolve(resolve);
    loop {
        match openat2(dir, path, how) {
            Ok(fd) => return Ok(File::from(fd)),
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => return Err(e.into()),
        }
    }
}

/// Reads up to `max` bytes of `file` at `offset`, appended to `buf` (the bytes go straight into
/// `buf`'s spare capacity, zeroed first: the safe read takes initialised memory). Returns how
/// many were read; 0 at the end of the file. On an error `buf` is as it was.
///
/// With `nowait` (`RWF_NOWAIT`, Linux 4.14) the read fails with `WouldBlock` (`EAGAIN`) instead
/// of waiting for the disk when the data is not in the page cache, and may return fewer bytes
/// than are left when only part is cached. A file system that does not support it fails with
/// `EOPNOTSUPP` (`Unsupported`). `EINTR` is retried.
pub fn read_at(
    file: &File,
    buf: &mut BytesMut,
    offset: u64,
    max: usize,
    nowait: bool,
) -> io::Result<usize> {
    use rustix::io::{preadv2, Errno, ReadWriteFlags};
    if i64::try_from(offset).is_err() {
        // preadv2 takes a signed offset (rustix's u64::MAX even means "the current position").
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "file offset past i64::MAX",
        ));
    }
    let flags = if nowait {
        ReadWriteFlags::NOWAIT
    } else {
        ReadWriteFlags::empty()
    };
    let start = buf.len();
    buf.resize(start + max, 0);
    let result = loop {
        match preadv2(
            file,
            &mut [IoSliceMut::new(&mut buf[start..])],
            offset,
            flags,
        ) {
            Err(Errno::INTR) => continue,
            r => break r,
        }
    };
    // The kernel wrote at most `max` bytes; keep only those.
    let n = result.as_ref().map_or(0, |n| *n);
    buf.truncate(start + n);
    result.map_err(io::Error::from)
}

/// Monotonic time at the kernel's last timer tick (`CLOCK_MONOTONIC_COARSE`: a few
/// milliseconds of resolution, read from the vDSO without reading a clock source). The cache
/// asks for the time on every hit, and a second-long revalidation interval needs no finer
/// clock; `Instant::now()` showed up at 1 % of a worker's samples.
pub fn coarse_now() -> Duration {
    use nix::time::{clock_gettime, ClockId};
    match clock_gettime(ClockId::CLOCK_MONOTONIC_COARSE) {
        Ok(ts) => Duration::new(ts.tv_sec() as u64, ts.tv_nsec() as u32),
        Err(_) => {
            // Only with a kernel that lacks the clock (before 2.6.32), so every call takes this
            // path and the two time bases never mix.
            static BASE: OnceLock<Instant> = OnceLock::new();
            BASE.get_or_init(Instant::now).elapsed()
        }
    }
}
