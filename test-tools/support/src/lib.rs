//! What the workspace's test binaries share, written once: [`TempDir`], a temporary folder
//! removed when dropped; [`tool`], the third-party programs tests run (whether one is
//! installed, running one with a deadline); [`aioquic`], the Python client the demux's and the
//! server's tests drive; [`client_initial`], client Initial packets with chosen ClientHellos;
//! [`harness`], a real ringmux on loopback and what the end-to-end tests
//! check it with. A dev-dependency only; nothing here is part of a deployment.

pub mod aioquic;
pub mod client_initial;
pub mod harness;
pub mod tool;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};

/// A folder under the system's temporary folder, removed on drop (also when a test panics).
/// Its name holds `prefix`, the process ID and a per-process sequence number, so tests running
/// at once, in one process or several, never share one; a folder left by an earlier process of
/// the same ID is emptied first.
pub struct TempDir(PathBuf);

impl TempDir {
    /// Creates the folder.
    ///
    /// # Panics
    /// If it cannot be created: the test cannot run.
    pub fn new(prefix: &str) -> TempDir {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let path = std::env::temp_dir().join(format!("{prefix}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&path);
        if let Err(e) = std::fs::create_dir_all(&path) {
            panic!("creating the temporary folder {}: {e}", path.display());
        }
        TempDir(path)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn folders_are_distinct_and_removed_on_drop() {
        let a = TempDir::new("ringmux-support");
        let b = TempDir::new("ringmux-support");
        assert_ne!(a.path(), b.path());
        assert!(a.path().is_dir() && b.path().is_dir());
        std::fs::write(a.path().join("f"), b"x").unwrap();
        let kept = a.path().to_owned();
        drop(a);
        assert!(!kept.exists());
    }
}
