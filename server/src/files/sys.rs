//! The system calls of static-file serving, each wrapped once: `openat2(2)` (path resolution
//! confined to the document root), `preadv2(2)` (reads that can refuse to wait for the disk,
//! straight into a buffer's uninitialised capacity: the one `unsafe` here) and the coarse
//! monotonic clock the cache checks on every hit. The other two go through `nix`; the rest of
//! `files` is safe code over these functions.

use std::ffi::CStr;
use std::fs::File;
use std::io;
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

/// Reads up to `max` bytes of `file` at `offset`, appended to `buf`: the kernel writes straight
/// into `buf`'s spare capacity, which is never zeroed first (zeroing a fresh 64 KiB chunk cost
/// 7 % of a worker's time sending a 1 MiB file over TCP). Returns how many were read; 0 at the
/// end of the file. On an error `buf` is as it was.
///
/// With `nowait` (`RWF_NOWAIT`, Linux 4.14) the read fails with `WouldBlock` (`EAGAIN`) instead
/// of waiting for the disk when the data is not in the page cache, and may return fewer bytes
/// than are left when only part is cached. A file system that does not support it fails with
/// `EOPNOTSUPP` (`Unsupported`). `EINTR` is retried.
// rustix's preadv2 takes initialised buffers only (`IoSliceMut`); libc's reads into the spare
// capacity.
#[allow(unsafe_code, clippy::disallowed_methods)]
pub fn read_at(
    file: &File,
    buf: &mut BytesMut,
    offset: u64,
    max: usize,
    nowait: bool,
) -> io::Result<usize> {
    use std::os::fd::AsRawFd;
    let Ok(offset) = libc::off_t::try_from(offset) else {
        // preadv2 takes a signed offset (and -1 means "the current position").
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "file offset past i64::MAX",
        ));
    };
    let flags = if nowait { libc::RWF_NOWAIT } else { 0 };
    buf.reserve(max);
    let spare = &mut buf.spare_capacity_mut()[..max];
    let iov = libc::iovec {
        iov_base: spare.as_mut_ptr().cast(),
        iov_len: spare.len(),
    };
    let n = loop {
        // SAFETY: `iov` describes `max` bytes of `buf`'s spare capacity, allocated (reserved
        // above) and not aliased while `buf` is borrowed mutably here; the kernel only writes
        // to it, at most `iov_len` bytes, and `file` is an open descriptor for the call.
        let r = unsafe { libc::preadv2(file.as_raw_fd(), &iov, 1, offset, flags) };
        match usize::try_from(r) {
            Ok(n) => break n.min(max),
            Err(_) => {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
        }
    };
    let len = buf.len() + n;
    // SAFETY: the kernel initialised the first `n` bytes of the spare capacity (`n` is what
    // preadv2 returned, at most `max`, which `reserve` made room for).
    unsafe { buf.set_len(len) };
    Ok(n)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_append_what_the_file_holds_and_stop_at_its_end() {
        let dir = ringmux_testkit::temp_dir("ringmux-read-at");
        let path = dir.path().join("f");
        let content: Vec<u8> = (0..=255u8).cycle().take(100_000).collect();
        std::fs::write(&path, &content).unwrap();
        let file = File::open(&path).unwrap();

        let mut buf = BytesMut::from(&b"head"[..]);
        let mut offset = 0u64;
        for _ in 0..10 {
            let n = read_at(&file, &mut buf, offset, 30_000, false).unwrap();
            if n == 0 {
                break;
            }
            offset += n as u64;
        }
        assert_eq!(offset, content.len() as u64);
        assert_eq!(&buf[..4], b"head");
        assert_eq!(&buf[4..], &content[..]);

        // At the end: nothing read, nothing appended.
        assert_eq!(read_at(&file, &mut buf, offset, 4096, false).unwrap(), 0);
        assert_eq!(buf.len(), 4 + content.len());
        // An offset preadv2 cannot take is refused, the buffer untouched.
        let e = read_at(&file, &mut buf, u64::MAX, 16, false).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
        assert_eq!(buf.len(), 4 + content.len());
    }
}
