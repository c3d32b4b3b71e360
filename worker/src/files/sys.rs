//! The system calls of static-file serving, each wrapped once with its SAFETY argument:
//! `openat2(2)` (path resolution confined to the document root), `preadv2(2)` (reads into
//! uninitialised memory that can refuse to wait for the disk) and the coarse monotonic clock
//! the cache checks on every hit. The rest of `files` is safe code over these functions.

use std::ffi::CStr;
use std::fs::File;
use std::io;
use std::mem::MaybeUninit;
use std::os::fd::{AsRawFd, BorrowedFd};
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

/// Reads up to `max` bytes of `file` at `offset`, appended to `buf` without zeroing it first
/// (the bytes go straight into `buf`'s spare capacity). Returns how many were read; 0 at the
/// end of the file.
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
    let offset = libc::off_t::try_from(offset)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "file offset past i64::MAX"))?;
    buf.reserve(max);
    let spare = buf.spare_capacity_mut();
    let len = max.min(spare.len());
    let iov = libc::iovec {
        iov_base: spare.as_mut_ptr().cast(),
        iov_len: len,
    };
    let flags = if nowait { libc::RWF_NOWAIT } else { 0 };
    loop {
        // SAFETY: `iov` names `len` bytes of `buf`'s spare capacity, which `buf` owns and nothing
        // else touches during the call (we hold `&mut buf`); the kernel writes at most `len`
        // bytes there. `file` is open for the call.
        let n = unsafe { libc::preadv2(file.as_raw_fd(), &iov, 1, offset, flags) };
        if n >= 0 {
            let n = n as usize; // non-negative and at most `len`
                                // SAFETY: the kernel initialised the first `n <= len` bytes of the spare capacity.
            unsafe { buf.set_len(buf.len() + n) };
            return Ok(n);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// Monotonic time at the kernel's last timer tick (`CLOCK_MONOTONIC_COARSE`: a few
/// milliseconds of resolution, read from the vDSO without reading a clock source). The cache
/// asks for the time on every hit, and a second-long revalidation interval needs no finer
/// clock; `Instant::now()` showed up at 1 % of a worker's samples.
pub fn coarse_now() -> Duration {
    let mut ts = MaybeUninit::<libc::timespec>::uninit();
    // SAFETY: `ts` is valid for writes of one `timespec`, which is all clock_gettime writes.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC_COARSE, ts.as_mut_ptr()) };
    if rc != 0 {
        // Only with a kernel that lacks the clock (before 2.6.32), so every call takes this
        // path and the two time bases never mix.
        static BASE: OnceLock<Instant> = OnceLock::new();
        return BASE.get_or_init(Instant::now).elapsed();
    }
    // SAFETY: clock_gettime returned 0, so it initialised `ts`.
    let ts = unsafe { ts.assume_init() };
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}
