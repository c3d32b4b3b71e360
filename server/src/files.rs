//! Static files under a document root, served the way a file server in front of a CDN is
//! expected to: paths that cannot leave the root, validators and conditional requests, single
//! byte ranges, and a bounded cache of small files.
//!
//! This module owns:
//! * [`DocRoot`]: the root directory, opened once (`O_PATH | O_DIRECTORY`); every file is opened
//!   relative to it with `openat2(RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS)` (`files/sys.rs`), so one
//!   system call resolves the path and refuses escapes (`..`, symlinks out of the root, magic
//!   links), with no window between a check and the open.
//! * The cache of small files, revalidated by inode, size, mtime and ctime at most
//!   [`FileOptions::revalidate`] after the last check ([`REVALIDATE_AFTER`] by default).
//! * Reads that never park the worker's (current-thread) runtime on the disk: the open, `fstat`
//!   and read run inline when the kernel can answer from its caches (`RESOLVE_CACHED`,
//!   `RWF_NOWAIT`), and move to tokio's blocking pool only when it cannot.
//! * The RFC 9110 decisions over a file's validators: [`evaluate`] (conditional requests,
//!   §13.2.2; ranges, §14) and [`content_type`].
//!
//! It never touches a stream or a connection (that is each front's) and never follows a path outside
//! its root.

mod coded;
mod sys;

pub(crate) use coded::{coded_file, Form, Variants};

use std::collections::{HashMap, VecDeque};
use std::ffi::CString;
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::{Bytes, BytesMut};
use http::{header, HeaderMap, HeaderValue, Method};

use crate::compress;

/// How long a cached file is served without looking at the disk again. An edit to a cached
/// file is visible at most this long after it (per worker process), plus the few milliseconds
/// of the coarse clock's tick (`CLOCK_MONOTONIC_COARSE`).
pub const REVALIDATE_AFTER: Duration = Duration::from_secs(1);

/// Default size of each worker's cache of small files.
pub const DEFAULT_CACHE_BYTES: u64 = 64 << 20;

/// Files up to this size are cached (and read in one piece); larger ones are streamed.
pub const MAX_CACHED_FILE: u64 = 256 << 10;

/// A file changed this recently is not cached: file timestamps are only as fine as the kernel's
/// clock tick, so a second write of the same size within one tick would keep the validators
/// and a cached copy of the first write would go undetected.
pub const SETTLE: Duration = Duration::from_secs(2);

/// Bytes charged to the cache for each entry on top of its body and key (metadata, headers).
const ENTRY_OVERHEAD: u64 = 256;

/// Settings of a [`DocRoot`].
#[derive(Debug, Clone)]
pub struct FileOptions {
    /// Budget of the small-file cache in bytes; 0 disables the cache.
    pub cache_bytes: u64,
    /// `Cache-Control` value sent with every file response (200, 206, 304); `None` sends none.
    pub cache_control: Option<HeaderValue>,
    /// See [`REVALIDATE_AFTER`]; tests set 0 (check every time) or a long time.
    pub revalidate: Duration,
    /// See [`SETTLE`]; tests set 0 to cache files they have just written.
    pub settle: Duration,
    /// Whether files of a compressible type (`crate::compress`) are sent coded to clients
    /// that accept it; `compress = false` of a site or route turns it off.
    pub compress: bool,
}

impl Default for FileOptions {
    fn default() -> Self {
        FileOptions {
            cache_bytes: DEFAULT_CACHE_BYTES,
            cache_control: None,
            revalidate: REVALIDATE_AFTER,
            settle: SETTLE,
            compress: true,
        }
    }
}

/// Why a document root cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum RootError {
    /// The OS error is in the message, so not the error's `source` (here and below).
    #[error("document root {path}: {error}")]
    Open { path: PathBuf, error: io::Error },
    #[error(
        "document root {path}: this kernel has no usable openat2 (Linux 5.6 or later is needed to \
         serve files safely): {error}; upgrade the kernel or run without --root / RINGMUX_ROOT"
    )]
    NoOpenat2 { path: PathBuf, error: io::Error },
}

/// Counters of one [`DocRoot`]. All `Relaxed`: independent statistics.
#[derive(Debug, Default)]
pub struct FileStats {
    /// Requests answered from the cache without a system call.
    pub cache_hits: AtomicU64,
    /// Cached files checked against the disk and found unchanged.
    pub revalidated: AtomicU64,
    /// Files read into the cache.
    pub cache_fills: AtomicU64,
    /// Opens or reads handed to the blocking pool because the kernel could not answer from its
    /// caches.
    pub offloaded: AtomicU64,
}

/// The cache of small files of one worker, shared by every [`DocRoot`] opened with it
/// ([`DocRoot::open_with_cache`]): one budget however many roots there are. Cheap to clone
/// (shared).
#[derive(Clone)]
pub struct FileCache {
    cache: Arc<Mutex<Cache>>,
    budget: u64,
}

impl FileCache {
    /// A cache of `budget` bytes; 0: no cache.
    pub fn new(budget: u64) -> FileCache {
        FileCache {
            cache: Arc::new(Mutex::new(Cache::new(budget))),
            budget,
        }
    }

    /// Bytes the cached files take now, with their overhead.
    pub fn used(&self) -> u64 {
        self.lock().used
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Cache> {
        // Nothing panics while holding the lock; if something ever did, the cache is still a
        // consistent map (every mutation is a single map or queue operation).
        self.cache.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl std::fmt::Debug for FileCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FileCache")
            .field("budget", &self.budget)
            .finish_non_exhaustive()
    }
}

/// The opened document root and its cache. Cheap to clone (shared).
#[derive(Clone)]
pub struct DocRoot {
    inner: Arc<Inner>,
}

struct Inner {
    dir: OwnedFd,
    path: PathBuf,
    opts: FileOptions,
    cache: FileCache,
    /// This root's number in `cache`.
    slot: usize,
    stats: FileStats,
}

impl std::fmt::Debug for DocRoot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DocRoot")
            .field("path", &self.inner.path)
            .field("opts", &self.inner.opts)
            .finish_non_exhaustive()
    }
}

/// What a path under the root names.
#[derive(Debug)]
pub enum Lookup {
    File(StaticFile),
    /// A directory: the caller redirects to the path with a trailing slash or answers 404.
    Directory,
    /// Nothing there, not a regular file, or outside the root.
    NotFound,
    /// The worker may not read it (`EACCES`).
    Forbidden,
}

/// A regular file found under the root.
#[derive(Debug, Clone)]
pub struct StaticFile {
    pub meta: Arc<FileMeta>,
    pub content: Content,
    /// Whether this version is in the cache, so that coded copies of it may be kept beside it
    /// (`DocRoot::charge`).
    pub cached: bool,
}

/// Where a file's bytes are.
#[derive(Debug, Clone)]
pub enum Content {
    /// The whole file, read at lookup (cached or small).
    Memory(Bytes),
    /// An open descriptor: read with [`DocRoot::read_chunk`].
    Disk(Arc<File>),
}

/// A file's metadata as HTTP sends it.
#[derive(Debug)]
pub struct FileMeta {
    pub len: u64,
    /// Strong entity tag from mtime and size (RFC 9110 §8.8.3), quoted.
    pub etag: HeaderValue,
    pub last_modified: HeaderValue,
    /// `Last-Modified` in Unix seconds (never later than when the file was looked up).
    pub modified_secs: u64,
    pub content_type: &'static str,
    /// The header fields of a 200 response, built once per file version: Content-Type,
    /// Content-Length, ETag, Last-Modified, Accept-Ranges and the configured Cache-Control,
    /// and `vary: accept-encoding` when `compressible`.
    pub headers: HeaderMap,
    /// Whether clients that accept a coding get this file coded: its root compresses, its type
    /// is worth it and it is at least [`compress::MIN_LENGTH`] long.
    pub compressible: bool,
    /// Per coding (`Coding::index`), what a cached version is sent as, decided at its first
    /// request in that coding (`compress::files`).
    pub(crate) variants: Variants,
}

/// What identifies one version of a file: any change of these drops the cached copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Identity {
    dev: u64,
    ino: u64,
    len: u64,
    mtime_ns: i128,
    ctime_ns: i128,
}

impl Identity {
    fn of(md: &std::fs::Metadata) -> Identity {
        Identity {
            dev: md.dev(),
            ino: md.ino(),
            len: md.len(),
            mtime_ns: i128::from(md.mtime()) * 1_000_000_000 + i128::from(md.mtime_nsec()),
            ctime_ns: i128::from(md.ctime()) * 1_000_000_000 + i128::from(md.ctime_nsec()),
        }
    }
}

impl DocRoot {
    /// Opens `path` as the document root (`O_PATH | O_DIRECTORY`) and checks that the kernel
    /// has `openat2` with the flags every lookup uses.
    /// The root has a cache of its own of `opts.cache_bytes`.
    pub fn open(path: &Path, opts: FileOptions) -> Result<DocRoot, RootError> {
        let cache = FileCache::new(opts.cache_bytes);
        DocRoot::open_with_cache(path, opts, &cache)
    }

    /// [`DocRoot::open`] with the cache `cache`, which other roots may share; its budget
    /// stands for `opts.cache_bytes`.
    pub fn open_with_cache(
        path: &Path,
        opts: FileOptions,
        cache: &FileCache,
    ) -> Result<DocRoot, RootError> {
        let dir = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC)
            .open(path)
            .map_err(|error| RootError::Open {
                path: path.to_path_buf(),
                error,
            })?;
        let dir = OwnedFd::from(dir);
        // The probe opens the root itself ("."), which RESOLVE_BENEATH allows.
        if let Err(error) = sys::open_beneath(dir.as_fd(), c".", false) {
            let no_openat2 = matches!(
                error.raw_os_error(),
                Some(libc::ENOSYS | libc::E2BIG | libc::EINVAL)
            );
            let path = path.to_path_buf();
            return Err(if no_openat2 {
                RootError::NoOpenat2 { path, error }
            } else {
                RootError::Open { path, error }
            });
        }
        let slot = cache.lock().add_root();
        Ok(DocRoot {
            inner: Arc::new(Inner {
                dir,
                path: path.to_path_buf(),
                opts,
                cache: cache.clone(),
                slot,
                stats: FileStats::default(),
            }),
        })
    }

    pub fn path(&self) -> &Path {
        &self.inner.path
    }

    pub fn options(&self) -> &FileOptions {
        &self.inner.opts
    }

    pub fn stats(&self) -> &FileStats {
        &self.inner.stats
    }

    /// Looks up `rel`, a relative path of plain components joined by `/` (no `.`, `..` or
    /// empty components: [`crate::request`] cleans request paths first), `""` for the root.
    pub async fn lookup(&self, rel: &str) -> io::Result<Lookup> {
        let inner = &self.inner;
        let stale = match self.cached(rel) {
            Cached::Fresh(entry) => {
                inner.stats.cache_hits.fetch_add(1, Ordering::Relaxed);
                return Ok(Lookup::File(entry.file()));
            }
            Cached::Stale(entry) => Some(entry),
            Cached::Miss => None,
        };
        let file = match self.open_file(rel).await {
            Ok(f) => f,
            Err(e) => {
                if stale.is_some() {
                    self.cache().remove(self.inner.slot, rel);
                }
                return match e.raw_os_error() {
                    // Missing; a path component is a file; the path leaves the root (EXDEV);
                    // a magic link or a symlink loop (ELOOP); a name too long.
                    Some(
                        libc::ENOENT
                        | libc::ENOTDIR
                        | libc::EXDEV
                        | libc::ELOOP
                        | libc::ENAMETOOLONG,
                    ) => Ok(Lookup::NotFound),
                    Some(libc::EACCES | libc::EPERM) => Ok(Lookup::Forbidden),
                    _ => Err(e),
                };
            }
        };
        // fstat on an open descriptor: the inode is in memory, this never waits on the disk.
        let md = file.metadata()?;
        if md.is_dir() {
            return Ok(Lookup::Directory);
        }
        if !md.is_file() {
            return Ok(Lookup::NotFound);
        }
        let id = Identity::of(&md);
        if let Some(entry) = stale {
            if entry.id == id {
                self.cache().touch(self.inner.slot, rel, &entry);
                inner.stats.revalidated.fetch_add(1, Ordering::Relaxed);
                return Ok(Lookup::File(entry.file()));
            }
            self.cache().remove(self.inner.slot, rel);
        }
        let meta = Arc::new(file_meta(rel, &md, SystemTime::now(), &inner.opts));
        let file = Arc::new(file);
        let cacheable = id.len <= MAX_CACHED_FILE.min(inner.cache.budget / 4);
        if !cacheable {
            return Ok(Lookup::File(StaticFile {
                meta,
                content: Content::Disk(file),
                cached: false,
            }));
        }
        let body = self.read_whole(&file, id.len).await?;
        // A write during the read may have torn what we read: serve it (as any file server
        // would) but do not cache it. The identity from before the read would match it.
        let unchanged = Identity::of(&file.metadata()?) == id;
        let mut cached = false;
        if unchanged && changed_before(&md, SystemTime::now(), inner.opts.settle) {
            let entry = Arc::new(Entry {
                id,
                meta: meta.clone(),
                body: body.clone(),
            });
            cached = self.cache().insert(self.inner.slot, rel, entry);
            inner.stats.cache_fills.fetch_add(1, Ordering::Relaxed);
        }
        Ok(Lookup::File(StaticFile {
            meta,
            content: Content::Memory(body),
            cached,
        }))
    }

    /// Reads up to `max` bytes of `file` at `offset` into a fresh buffer. Returns
    /// an empty buffer at the end of the file. Inline when the data is in the page cache,
    /// otherwise on the blocking pool.
    pub async fn read_chunk(&self, file: &Arc<File>, offset: u64, max: usize) -> io::Result<Bytes> {
        let buf = BytesMut::with_capacity(max);
        let (buf, _) = self.read_into(file, buf, offset, max).await?;
        Ok(buf.freeze())
    }

    /// Reads exactly `len` bytes from the start of `file`.
    async fn read_whole(&self, file: &Arc<File>, len: u64) -> io::Result<Bytes> {
        let len = usize::try_from(len).map_err(io::Error::other)?;
        let mut buf = BytesMut::with_capacity(len);
        while buf.len() < len {
            let want = len - buf.len();
            let offset = buf.len() as u64;
            let n;
            (buf, n) = self.read_into(file, buf, offset, want).await?;
            if n == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!(
                        "file shrank while being read ({} of {len} bytes)",
                        buf.len()
                    ),
                ));
            }
        }
        Ok(buf.freeze())
    }

    async fn read_into(
        &self,
        file: &Arc<File>,
        mut buf: BytesMut,
        offset: u64,
        max: usize,
    ) -> io::Result<(BytesMut, usize)> {
        match sys::read_at(file, &mut buf, offset, max, true) {
            Ok(n) => Ok((buf, n)),
            Err(e) if needs_blocking(&e) => {
                self.inner.stats.offloaded.fetch_add(1, Ordering::Relaxed);
                read_blocking(file.clone(), buf, offset, max).await
            }
            Err(e) => Err(e),
        }
    }

    /// Opens `rel` beneath the root: inline if the path resolves from the kernel's caches,
    /// else on the blocking pool.
    async fn open_file(&self, rel: &str) -> io::Result<File> {
        let path = if rel.is_empty() {
            c".".to_owned()
        } else {
            CString::new(rel).map_err(|_| io::Error::from_raw_os_error(libc::ENOENT))?
        };
        match sys::open_beneath(self.inner.dir.as_fd(), &path, true) {
            Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => {
                self.inner.stats.offloaded.fetch_add(1, Ordering::Relaxed);
                open_blocking(self.inner.clone(), path).await
            }
            other => other,
        }
    }

    /// Charges `bytes` (a coded copy of the version `meta` of `rel`, kept in its
    /// [`FileMeta::variants`]) to the cache entry of that version, evicting others if the
    /// budget needs it. Nothing if that version is no longer cached: the copy then lives only
    /// as long as the requests that hold it.
    pub(crate) fn charge(&self, rel: &str, meta: &Arc<FileMeta>, bytes: u64) {
        self.cache().charge(self.inner.slot, rel, meta, bytes);
    }

    fn cached(&self, rel: &str) -> Cached {
        if self.inner.cache.budget == 0 {
            return Cached::Miss;
        }
        let (slot, revalidate) = (self.inner.slot, self.inner.opts.revalidate);
        self.cache().get(slot, rel, sys::coarse_now(), revalidate)
    }

    fn cache(&self) -> std::sync::MutexGuard<'_, Cache> {
        self.inner.cache.lock()
    }
}

/// The read of [`DocRoot::read_into`] on the blocking pool, allowed to wait for the disk.
async fn read_blocking(
    file: Arc<File>,
    mut buf: BytesMut,
    offset: u64,
    max: usize,
) -> io::Result<(BytesMut, usize)> {
    tokio::task::spawn_blocking(move || {
        let n = sys::read_at(&file, &mut buf, offset, max, false)?;
        Ok((buf, n))
    })
    .await
    .map_err(io::Error::other)?
}

/// The open of [`DocRoot::open_file`] on the blocking pool, allowed to read directories from
/// the disk (no `RESOLVE_CACHED`).
async fn open_blocking(inner: Arc<Inner>, path: CString) -> io::Result<File> {
    tokio::task::spawn_blocking(move || sys::open_beneath(inner.dir.as_fd(), &path, false))
        .await
        .map_err(io::Error::other)?
}

/// `EAGAIN` from `RWF_NOWAIT` (data not in the page cache) or a file system without it.
fn needs_blocking(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EAGAIN | libc::EOPNOTSUPP))
}

/// Whether both mtime and ctime lie at least `settle` before `now`.
fn changed_before(md: &std::fs::Metadata, now: SystemTime, settle: Duration) -> bool {
    if settle.is_zero() {
        return true;
    }
    let Some(limit) = now.checked_sub(settle) else {
        return false;
    };
    let limit = limit
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64);
    md.mtime() < limit && md.ctime() < limit
}

fn file_meta(rel: &str, md: &std::fs::Metadata, now: SystemTime, opts: &FileOptions) -> FileMeta {
    let len = md.len();
    // RFC 9110 §8.8.2.1: a Last-Modified later than the response's time is replaced by it.
    let now_secs = now.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let modified_secs = u64::try_from(md.mtime()).unwrap_or(0).min(now_secs);
    let modified = UNIX_EPOCH + Duration::from_secs(modified_secs);
    let etag = HeaderValue::from_str(&etag(md.mtime(), md.mtime_nsec(), len))
        .unwrap_or(HeaderValue::from_static("\"0\""));
    // An HTTP date is ASCII: always a valid header value.
    let last_modified = HeaderValue::from_str(&httpdate::fmt_http_date(modified))
        .unwrap_or(HeaderValue::from_static("Thu, 01 Jan 1970 00:00:00 GMT"));
    let content_type = content_type(rel);
    let mut headers = HeaderMap::with_capacity(8);
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    headers.insert(header::CONTENT_LENGTH, HeaderValue::from(len));
    headers.insert(header::ETAG, etag.clone());
    headers.insert(header::LAST_MODIFIED, last_modified.clone());
    headers.insert(header::ACCEPT_RANGES, HeaderValue::from_static("bytes"));
    if let Some(cc) = &opts.cache_control {
        headers.insert(header::CACHE_CONTROL, cc.clone());
    }
    let compressible =
        opts.compress && len >= compress::MIN_LENGTH && compress::compressible(content_type);
    if compressible {
        // RFC 9110 §12.5.5: every response whose form depends on accept-encoding says so,
        // the plain ones too, or a shared cache would hand a coded body to anyone.
        headers.insert(header::VARY, HeaderValue::from_static("accept-encoding"));
    }
    FileMeta {
        len,
        etag,
        last_modified,
        modified_secs,
        content_type,
        headers,
        compressible,
        variants: Variants::default(),
    }
}

/// A strong entity tag for the file version with this mtime and size: 64 bits of FNV-1a over
/// them, base64url, quoted (13 bytes). The same deployed file (same mtime and size) gets the
/// same tag on every worker and every box; the nanoseconds make a same-second, same-size edit
/// a new tag. Short on purpose: QPACK sends it Huffman-coded on every response.
fn etag(mtime_secs: i64, mtime_nsec: i64, len: u64) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let bytes = [
        mtime_secs.to_le_bytes(),
        mtime_nsec.to_le_bytes(),
        len.to_le_bytes(),
    ];
    for b in bytes.iter().flatten() {
        h = (h ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3);
    }
    const B64URL: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let mut tag = String::with_capacity(13);
    tag.push('"');
    // 64 bits and two zero bits make 11 groups of 6, most significant first.
    let v = u128::from(h) << 2;
    for i in 0..11 {
        tag.push(B64URL[((v >> (60 - 6 * i)) & 63) as usize] as char);
    }
    tag.push('"');
    tag
}

// ---------------------------------------------------------------------------------------------
// The cache

/// One cached file.
#[derive(Debug)]
struct Entry {
    id: Identity,
    meta: Arc<FileMeta>,
    body: Bytes,
}

impl Entry {
    fn file(&self) -> StaticFile {
        StaticFile {
            meta: self.meta.clone(),
            content: Content::Memory(self.body.clone()),
            cached: true,
        }
    }
}

enum Cached {
    Fresh(Arc<Entry>),
    Stale(Arc<Entry>),
    Miss,
}

struct Slot {
    entry: Arc<Entry>,
    /// [`sys::coarse_now`] when the entry was last read or checked against the disk.
    checked: Duration,
    /// CLOCK's reference bit: set by a hit, cleared when the hand passes.
    referenced: bool,
    /// Distinguishes this slot from an earlier one of the same key still queued in `clock`.
    generation: u64,
    cost: u64,
}

/// A byte-bounded map from (root, relative path) to file, evicted by CLOCK (second chance):
/// cheap on a hit (set one bit), and a file read once by a crawler goes before files read all
/// the time. One map per root, so that a lookup needs no key built from the root's and the
/// path's; one budget and one clock over all of them.
struct Cache {
    budget: u64,
    used: u64,
    next_generation: u64,
    /// Per root ([`Cache::add_root`]): relative path to slot.
    roots: Vec<HashMap<String, Slot>>,
    /// The clock's hand walks this queue: (root, key, generation) in insertion order.
    clock: VecDeque<(usize, String, u64)>,
}

impl Cache {
    fn new(budget: u64) -> Cache {
        Cache {
            budget,
            used: 0,
            next_generation: 0,
            roots: Vec::new(),
            clock: VecDeque::new(),
        }
    }

    /// A new root's number.
    fn add_root(&mut self) -> usize {
        self.roots.push(HashMap::new());
        self.roots.len() - 1
    }

    /// Files cached, over every root.
    fn len(&self) -> usize {
        self.roots.iter().map(HashMap::len).sum()
    }

    fn get(&mut self, root: usize, key: &str, now: Duration, revalidate: Duration) -> Cached {
        match self.roots.get_mut(root).and_then(|m| m.get_mut(key)) {
            Some(slot) if now.saturating_sub(slot.checked) < revalidate => {
                slot.referenced = true;
                Cached::Fresh(slot.entry.clone())
            }
            Some(slot) => Cached::Stale(slot.entry.clone()),
            None => Cached::Miss,
        }
    }

    /// Marks `entry`, if it is still the one cached under `key`, as checked now.
    fn touch(&mut self, root: usize, key: &str, entry: &Arc<Entry>) {
        if let Some(slot) = self.roots.get_mut(root).and_then(|m| m.get_mut(key)) {
            if Arc::ptr_eq(&slot.entry, entry) {
                slot.checked = sys::coarse_now();
                slot.referenced = true;
            }
        }
    }

    fn remove(&mut self, root: usize, key: &str) {
        if let Some(slot) = self.roots.get_mut(root).and_then(|m| m.remove(key)) {
            self.used -= slot.cost;
        }
    }

    /// Caches `entry` under `key`; whether it did (not if larger than the whole budget).
    fn insert(&mut self, root: usize, key: &str, entry: Arc<Entry>) -> bool {
        if root >= self.roots.len() {
            return false;
        }
        self.remove(root, key);
        let cost = entry.body.len() as u64 + key.len() as u64 + ENTRY_OVERHEAD;
        if cost > self.budget {
            return false;
        }
        self.evict_until_fits(cost);
        let generation = self.next_generation;
        self.next_generation += 1;
        self.roots[root].insert(
            key.to_owned(),
            Slot {
                entry,
                checked: sys::coarse_now(),
                referenced: false,
                generation,
                cost,
            },
        );
        self.used += cost;
        self.clock.push_back((root, key.to_owned(), generation));
        // Removed keys stay queued until the hand reaches them; without evictions the queue
        // would only grow, so drop them once they outnumber the live ones.
        if self.clock.len() > 2 * self.len() + 64 {
            let roots = &self.roots;
            self.clock
                .retain(|(r, k, g)| roots[*r].get(k).is_some_and(|s| s.generation == *g));
        }
        true
    }

    /// Adds `bytes` to the cost of `key`'s entry if it still holds the version `meta`, then
    /// evicts until the budget holds again (perhaps that entry itself).
    fn charge(&mut self, root: usize, key: &str, meta: &Arc<FileMeta>, bytes: u64) {
        let Some(slot) = self.roots.get_mut(root).and_then(|m| m.get_mut(key)) else {
            return;
        };
        if !Arc::ptr_eq(&slot.entry.meta, meta) {
            return;
        }
        slot.cost += bytes;
        self.used += bytes;
        self.evict_until_fits(0);
    }

    fn evict_until_fits(&mut self, cost: u64) {
        // Each entry is passed at most twice (the first pass clears its bit), so this ends.
        while self.used + cost > self.budget {
            let Some((root, key, generation)) = self.clock.pop_front() else {
                return;
            };
            let map = &mut self.roots[root];
            let Some(slot) = map.get_mut(&key) else {
                continue;
            };
            if slot.generation != generation {
                continue;
            }
            if slot.referenced {
                slot.referenced = false;
                self.clock.push_back((root, key, generation));
            } else {
                self.used -= slot.cost;
                map.remove(&key);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// RFC 9110: conditional requests and ranges

/// How to answer a `GET`/`HEAD` of a file, from its validators and the request's headers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// 200 with the whole file.
    Full,
    /// 206 with bytes `start..start + len` (one range).
    Partial { start: u64, len: u64 },
    /// 304 (RFC 9110 §15.4.5).
    NotModified,
    /// 412 (§15.5.13).
    PreconditionFailed,
    /// 416 with `Content-Range: bytes */LEN` (§15.5.17).
    RangeNotSatisfiable,
}

/// RFC 9110 §13.2.2's order: If-Match, else If-Unmodified-Since (412 when false); then
/// If-None-Match, else If-Modified-Since (304 for GET/HEAD when false); then Range (GET only,
/// §14.2) subject to If-Range (§13.1.5).
pub fn evaluate(method: &Method, headers: &HeaderMap, meta: &FileMeta) -> Decision {
    let get_or_head = method == Method::GET || method == Method::HEAD;
    let etag = meta.etag.as_bytes();
    if headers.contains_key(header::IF_MATCH) {
        // §13.1.1: strong comparison; "*" matches any current representation.
        if !tag_list_matches(headers, header::IF_MATCH, etag, false) {
            return Decision::PreconditionFailed;
        }
    } else if let Some(date) = date_header(headers, header::IF_UNMODIFIED_SINCE) {
        // §13.1.4
        if meta.modified_secs > date {
            return Decision::PreconditionFailed;
        }
    }
    if headers.contains_key(header::IF_NONE_MATCH) {
        // §13.1.2: weak comparison.
        if tag_list_matches(headers, header::IF_NONE_MATCH, etag, true) {
            return if get_or_head {
                Decision::NotModified
            } else {
                Decision::PreconditionFailed
            };
        }
    } else if get_or_head {
        // §13.1.3: only without If-None-Match, only for GET and HEAD.
        if let Some(date) = date_header(headers, header::IF_MODIFIED_SINCE) {
            if meta.modified_secs <= date {
                return Decision::NotModified;
            }
        }
    }
    if method != Method::GET {
        return Decision::Full;
    }
    let Some(range) = headers.get(header::RANGE) else {
        return Decision::Full;
    };
    if let Some(if_range) = headers.get(header::IF_RANGE) {
        if !if_range_matches(if_range, meta) {
            return Decision::Full;
        }
    }
    match parse_range(range.as_bytes(), meta.len) {
        RangeSpec::Ignore => Decision::Full,
        RangeSpec::Unsatisfiable => Decision::RangeNotSatisfiable,
        RangeSpec::Bytes { start, len } => Decision::Partial { start, len },
    }
}

/// A `Range` header for a representation of `len` bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RangeSpec {
    /// Not a single valid `bytes` range: serve the whole file (§14.2 lets a server ignore
    /// Range; we do so for other units, bad syntax and several ranges).
    Ignore,
    /// §14.1.1: no range overlaps the representation.
    Unsatisfiable,
    Bytes {
        start: u64,
        len: u64,
    },
}

/// Parses `bytes=first-last`, `bytes=first-` or `bytes=-suffix` (RFC 9110 §14.1.2), one range.
pub fn parse_range(value: &[u8], len: u64) -> RangeSpec {
    let Ok(value) = std::str::from_utf8(value) else {
        return RangeSpec::Ignore;
    };
    let value = value.trim();
    let Some((unit, set)) = value.split_once('=') else {
        return RangeSpec::Ignore;
    };
    if !unit.trim().eq_ignore_ascii_case("bytes") {
        return RangeSpec::Ignore;
    }
    let set = set.trim();
    if set.contains(',') {
        return RangeSpec::Ignore;
    }
    let Some((first, last)) = set.split_once('-') else {
        return RangeSpec::Ignore;
    };
    let (first, last) = (first.trim(), last.trim());
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    // A number too large for u64 is still a valid number: saturate.
    let num = |s: &str| s.parse::<u64>().unwrap_or(u64::MAX);
    if first.is_empty() {
        // suffix-range: the last N bytes
        if !digits(last) {
            return RangeSpec::Ignore;
        }
        let n = num(last).min(len);
        if n == 0 {
            return RangeSpec::Unsatisfiable;
        }
        return RangeSpec::Bytes {
            start: len - n,
            len: n,
        };
    }
    if !digits(first) || !(last.is_empty() || digits(last)) {
        return RangeSpec::Ignore;
    }
    let start = num(first);
    let end = if last.is_empty() { u64::MAX } else { num(last) };
    if end < start {
        return RangeSpec::Ignore; // §14.1.1: invalid
    }
    if start >= len {
        return RangeSpec::Unsatisfiable;
    }
    let end = end.min(len - 1);
    RangeSpec::Bytes {
        start,
        len: end - start + 1,
    }
}

/// §13.1.5: an entity tag matches by strong comparison; a date only if it is exactly the
/// Last-Modified date.
fn if_range_matches(value: &HeaderValue, meta: &FileMeta) -> bool {
    let v = value.as_bytes();
    if v.first() == Some(&b'"') || v.starts_with(b"W/") {
        return !v.starts_with(b"W/") && v == meta.etag.as_bytes();
    }
    value
        .to_str()
        .ok()
        .and_then(|s| httpdate::parse_http_date(s).ok())
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .is_some_and(|d| d.as_secs() == meta.modified_secs)
}

/// Whether any `name` field (`*` or a list of entity tags) matches `etag`. Weak comparison
/// ignores `W/` on both sides; strong comparison never matches a weak tag (§8.8.3.2).
fn tag_list_matches(
    headers: &HeaderMap,
    name: header::HeaderName,
    etag: &[u8],
    weak: bool,
) -> bool {
    for value in headers.get_all(name) {
        let mut rest = value.as_bytes();
        loop {
            while let Some((&c, tail)) = rest.split_first() {
                if c == b',' || c == b' ' || c == b'\t' {
                    rest = tail;
                } else {
                    break;
                }
            }
            if rest.is_empty() {
                break;
            }
            if rest[0] == b'*' {
                return true;
            }
            let is_weak = rest.starts_with(b"W/");
            if is_weak {
                rest = &rest[2..];
            }
            // An entity-tag is a quoted opaque string; anything else ends the parse.
            if rest.first() != Some(&b'"') {
                break;
            }
            let Some(close) = rest[1..].iter().position(|&b| b == b'"') else {
                break;
            };
            let tag = &rest[..close + 2];
            if tag == etag && (weak || !is_weak) {
                return true;
            }
            rest = &rest[close + 2..];
        }
    }
    false
}

/// An HTTP-date header (any of the three formats of RFC 9110 §5.6.7) in Unix seconds; `None`
/// if absent or not a date (then the condition is ignored, §13.1.3/§13.1.4).
fn date_header(headers: &HeaderMap, name: header::HeaderName) -> Option<u64> {
    let s = headers.get(name)?.to_str().ok()?;
    let t = httpdate::parse_http_date(s).ok()?;
    Some(t.duration_since(UNIX_EPOCH).ok()?.as_secs())
}

/// `Content-Type` from the file name's extension; `application/octet-stream` otherwise. Where
/// the QPACK static table (RFC 9204 Appendix A) has the type, the value is spelled exactly as
/// there, so it is sent as a one-byte index rather than a Huffman-coded literal.
pub fn content_type(path: &str) -> &'static str {
    let name = path.rsplit('/').next().unwrap_or(path);
    let Some((_, ext)) = name.rsplit_once('.') else {
        return "application/octet-stream";
    };
    let ext = ext.to_ascii_lowercase();
    match ext.as_str() {
        "html" | "htm" => "text/html; charset=utf-8",
        // RFC 9204 Appendix A, index 54: one byte on the wire instead of a literal.
        "txt" | "text" => "text/plain;charset=utf-8",
        "md" => "text/markdown; charset=utf-8",
        "csv" => "text/csv; charset=utf-8",
        "css" => "text/css", // index 51; CSS is read as UTF-8 by default
        "js" | "mjs" => "text/javascript; charset=utf-8",
        "json" | "map" => "application/json",
        "webmanifest" => "application/manifest+json",
        "xml" => "application/xml",
        "svg" => "image/svg+xml",
        "png" => "image/png",
        "jpg" | "jpeg" => "image/jpeg",
        "gif" => "image/gif",
        "webp" => "image/webp",
        "avif" => "image/avif",
        "ico" => "image/x-icon",
        "woff" => "font/woff",
        "woff2" => "font/woff2",
        "ttf" => "font/ttf",
        "otf" => "font/otf",
        "mp4" => "video/mp4",
        "webm" => "video/webm",
        "mp3" => "audio/mpeg",
        "ogg" => "audio/ogg",
        "wav" => "audio/wav",
        "wasm" => "application/wasm",
        "pdf" => "application/pdf",
        "zip" => "application/zip",
        "gz" => "application/gzip",
        _ => "application/octet-stream",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ETAG: &str = "\"5f5e100.0-a\"";
    /// Last-Modified of `meta()`: 100000000 s = Sat, 03 Mar 1973 09:46:40 GMT.
    const MODIFIED: &str = "Sat, 03 Mar 1973 09:46:40 GMT";

    fn meta(len: u64) -> FileMeta {
        FileMeta {
            len,
            etag: HeaderValue::from_static(ETAG),
            last_modified: HeaderValue::from_static(MODIFIED),
            modified_secs: 100_000_000,
            content_type: "text/plain",
            headers: HeaderMap::new(),
            compressible: false,
            variants: Variants::default(),
        }
    }

    fn headers(fields: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in fields {
            h.append(*k, HeaderValue::from_static(v));
        }
        h
    }

    #[test]
    fn ranges_follow_rfc_9110_14_1() {
        use RangeSpec::*;
        let b = |start, len| Bytes { start, len };
        for (value, len, want) in [
            ("bytes=0-4", 10, b(0, 5)),
            ("bytes=5-", 10, b(5, 5)),
            ("bytes=-3", 10, b(7, 3)),
            ("bytes=-30", 10, b(0, 10)),
            ("bytes=9-9", 10, b(9, 1)),
            ("bytes=0-99999999999999999999999", 10, b(0, 10)),
            ("Bytes = 2-3 ", 10, b(2, 2)),
            ("bytes=10-", 10, Unsatisfiable),
            ("bytes=99999999999999999999999-", 10, Unsatisfiable),
            ("bytes=-0", 10, Unsatisfiable),
            ("bytes=0-", 0, Unsatisfiable),
            ("bytes=-5", 0, Unsatisfiable),
            ("bytes=3-1", 10, Ignore),
            ("bytes=0-1,3-4", 10, Ignore),
            ("items=0-1", 10, Ignore),
            ("bytes=a-b", 10, Ignore),
            ("bytes=-", 10, Ignore),
            ("bytes=1", 10, Ignore),
            ("bytes=+1-2", 10, Ignore),
            ("", 10, Ignore),
        ] {
            assert_eq!(
                parse_range(value.as_bytes(), len),
                want,
                "{value:?} of {len}"
            );
        }
    }

    #[test]
    fn conditional_requests_follow_rfc_9110_13_2_2() {
        use Decision::*;
        let m = meta(10);
        let later = "Sun, 04 Mar 1973 00:00:00 GMT";
        let earlier = "Fri, 02 Mar 1973 00:00:00 GMT";
        let get = Method::GET;
        for (fields, method, want) in [
            (&[][..], &get, Full),
            (&[("if-none-match", ETAG)][..], &get, NotModified),
            (&[("if-none-match", ETAG)], &Method::HEAD, NotModified),
            (&[("if-none-match", "W/\"5f5e100.0-a\"")], &get, NotModified),
            (
                &[("if-none-match", "\"x\", \"5f5e100.0-a\"")],
                &get,
                NotModified,
            ),
            (
                &[("if-none-match", "\"x\""), ("if-none-match", ETAG)],
                &get,
                NotModified,
            ),
            (&[("if-none-match", "*")], &get, NotModified),
            (&[("if-none-match", "\"other\"")], &get, Full),
            (&[("if-none-match", "5f5e100.0-a")], &get, Full), // unquoted: not a tag
            (&[("if-modified-since", MODIFIED)], &get, NotModified),
            (&[("if-modified-since", later)], &get, NotModified),
            (&[("if-modified-since", earlier)], &get, Full),
            (&[("if-modified-since", "yesterday")], &get, Full),
            // If-None-Match wins over If-Modified-Since (§13.1.3).
            (
                &[("if-none-match", "\"other\""), ("if-modified-since", later)],
                &get,
                Full,
            ),
            (&[("if-match", ETAG)], &get, Full),
            (&[("if-match", "*")], &get, Full),
            (&[("if-match", "\"other\"")], &get, PreconditionFailed),
            (
                &[("if-match", "W/\"5f5e100.0-a\"")],
                &get,
                PreconditionFailed,
            ), // strong only
            (
                &[("if-unmodified-since", earlier)],
                &get,
                PreconditionFailed,
            ),
            (&[("if-unmodified-since", MODIFIED)], &get, Full),
            // If-Match wins over If-Unmodified-Since (§13.1.4).
            (
                &[("if-match", ETAG), ("if-unmodified-since", earlier)],
                &get,
                Full,
            ),
            (
                &[("range", "bytes=0-1")],
                &get,
                Partial { start: 0, len: 2 },
            ),
            (&[("range", "bytes=0-1")], &Method::HEAD, Full),
            (&[("range", "bytes=20-")], &get, RangeNotSatisfiable),
            (
                &[("range", "bytes=0-1"), ("if-range", ETAG)],
                &get,
                Partial { start: 0, len: 2 },
            ),
            (
                &[("range", "bytes=0-1"), ("if-range", "\"other\"")],
                &get,
                Full,
            ),
            (
                &[("range", "bytes=0-1"), ("if-range", "W/\"5f5e100.0-a\"")],
                &get,
                Full,
            ),
            (
                &[("range", "bytes=0-1"), ("if-range", MODIFIED)],
                &get,
                Partial { start: 0, len: 2 },
            ),
            (&[("range", "bytes=0-1"), ("if-range", later)], &get, Full),
            // A 304 comes before the range is looked at.
            (
                &[("range", "bytes=0-1"), ("if-none-match", ETAG)],
                &get,
                NotModified,
            ),
        ] {
            assert_eq!(
                evaluate(method, &headers(fields), &m),
                want,
                "{method} {fields:?}"
            );
        }
    }

    #[test]
    fn etags_are_short_stable_and_change_with_the_version() {
        let a = etag(1_700_000_000, 5, 10);
        assert_eq!(a.len(), 13);
        assert!(a.starts_with('"') && a.ends_with('"'));
        assert!(a[1..12]
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_'));
        assert_eq!(a, etag(1_700_000_000, 5, 10));
        assert_ne!(a, etag(1_700_000_000, 6, 10));
        assert_ne!(a, etag(1_700_000_001, 5, 10));
        assert_ne!(a, etag(1_700_000_000, 5, 11));
        // Pinned: every version of ringmux must compute the same tag for the same file, or a
        // restart would turn every client's cached copy into a full download.
        assert_eq!(etag(0, 0, 0), "\"gdI_1wA8IwU\"");
    }

    #[test]
    fn content_types_by_extension() {
        assert_eq!(content_type("index.html"), "text/html; charset=utf-8");
        assert_eq!(content_type("a/b/STYLE.CSS"), "text/css");
        assert_eq!(content_type("notes.txt"), "text/plain;charset=utf-8");
        assert_eq!(content_type("app.mjs"), "text/javascript; charset=utf-8");
        assert_eq!(content_type("f.woff2"), "font/woff2");
        assert_eq!(content_type("x.tar.gz"), "application/gzip");
        assert_eq!(content_type("dir.d/README"), "application/octet-stream");
        assert_eq!(content_type(".hidden"), "application/octet-stream");
    }

    fn entry(len: usize) -> Arc<Entry> {
        Arc::new(Entry {
            id: Identity {
                dev: 0,
                ino: 0,
                len: len as u64,
                mtime_ns: 0,
                ctime_ns: 0,
            },
            meta: Arc::new(meta(len as u64)),
            body: Bytes::from(vec![0; len]),
        })
    }

    #[test]
    fn cache_stays_within_budget_and_gives_hits_a_second_chance() {
        // Each entry costs 1000 + 1 + ENTRY_OVERHEAD bytes: three fit, over two roots.
        let cost = 1000 + 1 + ENTRY_OVERHEAD;
        let mut c = Cache::new(3 * cost);
        let (r0, r1) = (c.add_root(), c.add_root());
        let long = Duration::from_secs(3600);
        let now = sys::coarse_now();
        for (r, k) in [(r0, "a"), (r1, "b"), (r0, "c")] {
            c.insert(r, k, entry(1000));
        }
        assert_eq!(c.used, 3 * cost);
        assert!(
            matches!(c.get(r1, "a", now, long), Cached::Miss),
            "roots apart"
        );
        // "a" is used; inserting "d" evicts the oldest unused one, "b" of the other root.
        assert!(matches!(c.get(r0, "a", now, long), Cached::Fresh(_)));
        c.insert(r0, "d", entry(1000));
        assert_eq!(c.used, 3 * cost);
        assert!(matches!(c.get(r1, "b", now, long), Cached::Miss));
        for k in ["a", "c", "d"] {
            assert!(matches!(c.get(r0, k, now, long), Cached::Fresh(_)), "{k}");
        }
        // Larger than the whole budget: not cached, nothing evicted.
        c.insert(r1, "e", entry(10_000));
        assert!(matches!(c.get(r1, "e", now, long), Cached::Miss));
        assert_eq!(c.len(), 3);
        // Past the revalidation interval an entry is stale, not gone.
        let later = now + long + Duration::from_secs(1);
        assert!(matches!(c.get(r0, "a", later, long), Cached::Stale(_)));
        c.remove(r0, "a");
        assert_eq!(c.used, 2 * cost);
        // A root the cache does not know is never cached into.
        c.insert(7, "x", entry(1));
        assert!(matches!(c.get(7, "x", now, long), Cached::Miss));
    }

    /// Roots opened with one [`FileCache`] share its budget: files of both fill it, and never
    /// past it.
    #[tokio::test]
    async fn roots_share_one_cache_budget() {
        let tmp = ringmux_testkit::temp_dir("ringmux-files-shared");
        let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
        for dir in [&a, &b] {
            std::fs::create_dir_all(dir).unwrap();
            for i in 0..8 {
                std::fs::write(dir.join(format!("{i}.txt")), vec![b'x'; 10_000]).unwrap();
            }
        }
        let opts = FileOptions {
            settle: Duration::ZERO,
            revalidate: Duration::from_secs(3600),
            ..FileOptions::default()
        };
        let budget = 6 * (10_000 + 5 + ENTRY_OVERHEAD);
        let cache = FileCache::new(budget);
        let ra = DocRoot::open_with_cache(&a, opts.clone(), &cache).unwrap();
        let rb = DocRoot::open_with_cache(&b, opts, &cache).unwrap();
        for i in 0..8 {
            for root in [&ra, &rb] {
                assert!(matches!(
                    root.lookup(&format!("{i}.txt")).await.unwrap(),
                    Lookup::File(_)
                ));
            }
        }
        assert_eq!(cache.used(), budget, "full, not past it");
        let fills = |r: &DocRoot| r.stats().cache_fills.load(Ordering::Relaxed);
        assert_eq!((fills(&ra), fills(&rb)), (8, 8));
        // The last file of each root is still there: a hit without a system call.
        for root in [&ra, &rb] {
            root.lookup("7.txt").await.unwrap();
            assert_eq!(root.stats().cache_hits.load(Ordering::Relaxed), 1);
        }
    }

    /// The blocking-pool halves of opens and reads, which run when the kernel cannot answer
    /// from its caches (a cold page cache does not reliably make `RWF_NOWAIT` fail, so they are
    /// driven directly here).
    #[tokio::test]
    async fn blocking_fallbacks_open_beneath_and_read_whole() {
        let tmp = ringmux_testkit::temp_dir("ringmux-files-unit");
        let dir = tmp.path().to_path_buf();
        std::fs::create_dir_all(dir.join("sub")).unwrap();
        let data: Vec<u8> = (0..200_000u32).map(|i| (i % 253) as u8).collect();
        std::fs::write(dir.join("sub/f.bin"), &data).unwrap();
        std::os::unix::fs::symlink("/etc/hostname", dir.join("abs")).unwrap();
        let root = DocRoot::open(&dir, FileOptions::default()).unwrap();

        let file = open_blocking(root.inner.clone(), c"sub/f.bin".to_owned())
            .await
            .unwrap();
        let file = Arc::new(file);
        let (buf, n) = read_blocking(file.clone(), BytesMut::new(), 1000, 150_000)
            .await
            .unwrap();
        assert!(n > 0 && n <= 150_000, "{n}");
        assert_eq!(&buf[..], &data[1000..1000 + n]);
        let (_, n) = read_blocking(file, BytesMut::new(), 200_000, 10)
            .await
            .unwrap();
        assert_eq!(n, 0, "read at the end of the file");
        for escape in [c"abs", c"../x", c"sub/../../x"] {
            let e = open_blocking(root.inner.clone(), escape.to_owned())
                .await
                .unwrap_err();
            assert_eq!(e.raw_os_error(), Some(libc::EXDEV), "{escape:?}: {e}");
        }
        assert!(needs_blocking(&io::Error::from_raw_os_error(libc::EAGAIN)));
        assert!(needs_blocking(&io::Error::from_raw_os_error(
            libc::EOPNOTSUPP
        )));
        assert!(!needs_blocking(&io::Error::from_raw_os_error(libc::EIO)));
    }

    #[test]
    fn a_bad_root_is_refused_with_its_path_named() {
        let missing = Path::new("/nonexistent/ringmux-root");
        let e = DocRoot::open(missing, FileOptions::default()).unwrap_err();
        assert!(matches!(e, RootError::Open { .. }), "{e:?}");
        assert!(e.to_string().contains("/nonexistent/ringmux-root"), "{e}");
        // A file is not a directory (O_DIRECTORY): ENOTDIR, named.
        let tmp = ringmux_testkit::temp_dir("ringmux-root-file");
        let file = tmp.path().join("f");
        std::fs::write(&file, b"x").unwrap();
        let e = DocRoot::open(&file, FileOptions::default()).unwrap_err();
        assert!(e.to_string().contains(&*file.to_string_lossy()), "{e}");
        assert!(
            matches!(&e, RootError::Open { error, .. } if error.raw_os_error() == Some(libc::ENOTDIR)),
            "{e:?}"
        );
    }

    #[test]
    fn cache_queue_does_not_grow_with_replacements() {
        let mut c = Cache::new(1 << 30);
        let r = c.add_root();
        for _ in 0..10_000 {
            c.insert(r, "k", entry(1));
            c.remove(r, "k");
        }
        c.insert(r, "k", entry(1));
        assert!(c.clock.len() <= 2 * c.len() + 65, "{}", c.clock.len());
    }
}
