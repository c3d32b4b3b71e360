//! Files and pipes: the operator's files (configuration, certificates, keys, CA roots), read
//! whole only when they are regular files of bounded size; the file system a folder lives on;
//! the sealed memfd of a worker's site table, the pipes of the workers' output and access logs,
//! and writes to the demux's standard error.

use std::io::{self, Read};
use std::os::fd::{BorrowedFd, OwnedFd};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::Path;
use std::time::Duration;

use super::wait_writable;

/// The most bytes of a certificate chain, private key, CA roots or key file (a chain is a few
/// KiB).
pub const MAX_PEM_FILE: u64 = 1 << 20;
/// The most bytes of the configuration file.
pub const MAX_CONFIG_FILE: u64 = 4 << 20;

/// An operator's file, read whole.
#[derive(Debug)]
pub struct OperatorFile {
    pub bytes: Vec<u8>,
    /// Its metadata, as `fstat(2)` gave it on the descriptor read (mode, owner).
    pub metadata: std::fs::Metadata,
}

/// Reads the operator's file at `path` (following symbolic links: certificates are often links
/// into a folder a tool renews) only if it is a regular file of at most `limit` bytes. It is
/// opened with `O_NONBLOCK`, so that opening a FIFO with no writer returns at once, then
/// `fstat`ed: anything but a regular file (a FIFO, a device such as `/dev/zero`, a socket, a
/// folder) and a file larger than `limit` (a 2 GiB sparse file too) are refused before a byte
/// is read, and the read stops at `limit` should the file grow meanwhile. The error's message
/// says what the file is or how large, not its path (the caller names it, and what it is for).
pub fn read_operator_file(path: &Path, limit: u64) -> io::Result<OperatorFile> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC | libc::O_NOCTTY)
        .open(path)?;
    let metadata = file.metadata()?;
    let kind = metadata.file_type();
    let what = if kind.is_file() {
        None
    } else if kind.is_fifo() {
        Some("a FIFO")
    } else if kind.is_char_device() {
        Some("a character device")
    } else if kind.is_block_device() {
        Some("a block device")
    } else if kind.is_socket() {
        Some("a socket")
    } else if kind.is_dir() {
        Some("a folder")
    } else {
        Some("not a plain file")
    };
    if let Some(what) = what {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{what}, not a regular file; name the file itself"),
        ));
    }
    if metadata.len() > limit {
        return Err(too_large(metadata.len(), limit));
    }
    let mut bytes = Vec::with_capacity(usize::try_from(metadata.len()).unwrap_or(0));
    file.take(limit + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > limit {
        return Err(too_large(bytes.len() as u64, limit));
    }
    Ok(OperatorFile { bytes, metadata })
}

/// [`read_operator_file`] as UTF-8 text.
pub fn read_operator_text(path: &Path, limit: u64) -> io::Result<String> {
    String::from_utf8(read_operator_file(path, limit)?.bytes)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "not UTF-8 text"))
}

fn too_large(len: u64, limit: u64) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidInput,
        format!("{len} bytes, more than the {limit} such a file may have"),
    )
}

/// The name of the pseudo file system `path` lives on (proc, sysfs, debugfs, cgroup, …: files
/// the kernel makes up, which no site may serve), or `None` for a file system of files.
/// Judged by `statfs(2)`'s `f_type`; `devtmpfs` reports itself as tmpfs, so a path on the
/// file system of `/dev` itself (after symbolic links; not `/dev/shm`, a tmpfs of its own)
/// counts as `devtmpfs` too.
pub fn pseudo_file_system(path: &Path) -> io::Result<Option<&'static str>> {
    const PSEUDO: [(i64, &str); 17] = [
        (0x9fa0, "proc"),
        (0x6265_6572, "sysfs"),
        (0x6462_6720, "debugfs"),
        (0x7472_6163, "tracefs"),
        (0x7363_6673, "securityfs"),
        (0x0027_e0eb, "cgroup"),
        (0x6367_7270, "cgroup2"),
        (0xcafe_4a11, "bpf"),
        (0x1cd1, "devpts"),
        (0x6165_676c, "pstore"),
        (0xde5e_81e4, "efivarfs"),
        (0x6265_6570, "configfs"),
        (0x6573_5543, "fusectl"),
        (0x1980_0202, "mqueue"),
        (0x4249_4e4d, "binfmt_misc"),
        (0xf97c_ff8c, "selinuxfs"),
        (0x6e73_6673, "nsfs"),
    ];
    use std::os::unix::fs::MetadataExt;
    let canonical = std::fs::canonicalize(path)?;
    if canonical.starts_with("/dev")
        && std::fs::metadata(&canonical)?.dev() == std::fs::metadata("/dev")?.dev()
    {
        return Ok(Some("devtmpfs"));
    }
    let kind = nix::sys::statfs::statfs(&canonical)?.filesystem_type().0 as i64;
    Ok(PSEUDO
        .iter()
        .find(|(magic, _)| *magic == kind)
        .map(|(_, name)| *name))
}

/// A memfd holding `bytes`, sealed against every change (write, shrink, grow, further seals),
/// close-on-exec, its offset at 0: one worker's copy of the site table. A copy of its own per
/// worker, so that no worker shares its open file description (the offset moves as it reads).
pub fn sealed_memfd(name: &std::ffi::CStr, bytes: &[u8]) -> io::Result<OwnedFd> {
    use nix::fcntl::{fcntl, FcntlArg, SealFlag};
    use nix::sys::memfd::{memfd_create, MFdFlags};
    use std::io::{Seek, Write};
    let fd = memfd_create(name, MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING)?;
    let mut file = std::fs::File::from(fd);
    file.write_all(bytes)?;
    file.rewind()?;
    fcntl(
        &file,
        FcntlArg::F_ADD_SEALS(
            SealFlag::F_SEAL_WRITE
                | SealFlag::F_SEAL_SHRINK
                | SealFlag::F_SEAL_GROW
                | SealFlag::F_SEAL_SEAL,
        ),
    )?;
    Ok(file.into())
}

/// A pipe for one worker's output or access log: `(read, write)`, both close-on-exec, the read
/// end non-blocking. The two ends are two open file descriptions: what the worker does to its
/// end (`O_NONBLOCK`, closing it) never reaches the demux's.
pub fn log_pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    let (read, write) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)?;
    rustix::io::ioctl_fionbio(&read, true)?;
    Ok((read, write))
}

/// Reads what is there from the non-blocking `fd` into `buf`: `Ok(0)` at the end (every write
/// end closed), `WouldBlock` when nothing is waiting.
pub fn read_some(fd: BorrowedFd<'_>, buf: &mut [u8]) -> io::Result<usize> {
    loop {
        match rustix::io::read(fd, &mut *buf) {
            Err(rustix::io::Errno::INTR) => continue,
            r => return Ok(r?),
        }
    }
}

/// Writes all of `buf` to `fd` (the demux's standard error, or the access log). A descriptor in
/// non-blocking mode that is full gets `wait` to drain once; `Err` when it still cannot take
/// the rest, or on any other error (`EPIPE`, `ENOSPC`, `EBADF`): what was not written is lost
/// and the caller counts it, and the call never blocks on a non-blocking descriptor for longer
/// than `wait`. (A blocking one blocks as the kernel makes it.)
pub fn write_all_or_fail(fd: BorrowedFd<'_>, buf: &[u8], wait: Duration) -> io::Result<()> {
    let mut done = 0;
    let mut waited = false;
    while done < buf.len() {
        match rustix::io::write(fd, &buf[done..]) {
            Ok(0) => return Err(io::Error::from(io::ErrorKind::WriteZero)),
            Ok(n) => done += n,
            Err(rustix::io::Errno::INTR) => {}
            Err(rustix::io::Errno::AGAIN) if !waited => {
                waited = true;
                wait_writable(fd, wait)?;
            }
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    #[test]
    fn only_regular_files_of_bounded_size_are_read() {
        let dir = tempfile::tempdir().unwrap();
        let plain = dir.path().join("plain.pem");
        std::fs::write(&plain, b"pem").unwrap();
        assert_eq!(read_operator_file(&plain, 3).unwrap().bytes, b"pem");
        // Through a symbolic link: as the file.
        let link = dir.path().join("link.pem");
        std::os::unix::fs::symlink(&plain, &link).unwrap();
        assert_eq!(read_operator_text(&link, 3).unwrap(), "pem");
        // One byte too many.
        let e = read_operator_file(&plain, 2).unwrap_err().to_string();
        assert!(e.contains("3 bytes") && e.contains("2"), "{e}");
        // A 2 GiB sparse file: refused by its size, without reading it.
        let sparse = dir.path().join("sparse");
        std::fs::File::create(&sparse)
            .unwrap()
            .set_len(2 << 30)
            .unwrap();
        let e = read_operator_file(&sparse, MAX_PEM_FILE)
            .unwrap_err()
            .to_string();
        assert!(e.contains("2147483648 bytes"), "{e}");
        // A FIFO with no writer: refused at once (the open does not wait for a writer).
        let fifo = dir.path().join("fifo");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        let start = Instant::now();
        let e = read_operator_file(&fifo, MAX_PEM_FILE)
            .unwrap_err()
            .to_string();
        assert!(e.contains("FIFO"), "{e}");
        assert!(start.elapsed() < Duration::from_secs(5));
        // Devices and folders.
        let e = read_operator_file(Path::new("/dev/zero"), MAX_PEM_FILE)
            .unwrap_err()
            .to_string();
        assert!(e.contains("character device"), "{e}");
        let e = read_operator_file(dir.path(), MAX_PEM_FILE)
            .unwrap_err()
            .to_string();
        assert!(e.contains("folder"), "{e}");
        // Not UTF-8, as text.
        std::fs::write(&plain, b"\xff").unwrap();
        assert!(read_operator_text(&plain, 10).is_err());
    }

    #[test]
    fn pseudo_file_systems_are_named() {
        assert_eq!(
            pseudo_file_system(Path::new("/proc")).unwrap(),
            Some("proc")
        );
        assert_eq!(
            pseudo_file_system(Path::new("/proc/self")).unwrap(),
            Some("proc")
        );
        assert_eq!(
            pseudo_file_system(Path::new("/sys")).unwrap(),
            Some("sysfs")
        );
        assert_eq!(
            pseudo_file_system(Path::new("/dev")).unwrap(),
            Some("devtmpfs")
        );
        // /dev/shm is a tmpfs of files of its own.
        if Path::new("/dev/shm").is_dir() {
            assert_eq!(pseudo_file_system(Path::new("/dev/shm")).unwrap(), None);
        }
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(pseudo_file_system(dir.path()).unwrap(), None);
        // A link to /proc is judged by where it leads.
        let link = dir.path().join("p");
        std::os::unix::fs::symlink("/proc", &link).unwrap();
        assert_eq!(pseudo_file_system(&link).unwrap(), Some("proc"));
    }
}
