//! ringmux's test kit: what the workspace's tests and benchmarks share, written once.
//! [`temp_dir`], a temporary folder removed when dropped; [`tool`], the third-party programs
//! tests run (whether one is installed, running one with a deadline); the clients: [`client`]
//! (HTTP/3 over quinn and h3) and [`tcp_client`] (HTTPS over TCP, HTTP/1.1 or HTTP/2), which
//! take any certificate through the one verifier of [`tls`], [`aioquic`] (the Python client),
//! [`curl`] (Debian's, over TCP), [`client_initial`] (client Initial packets with chosen
//! ClientHellos); [`upstream`], an HTTP/1.1 service to put behind the proxy; [`pebble`], an
//! ACME test CA and its DNS on loopback. Tests and benchmarks only; nothing here is part of a
//! deployment.
//!
//! It depends on no ringmux crate, so every crate's own tests may use it (the demux's and the
//! server's take their temporary folders here, the worker's its verifier) without a cycle; the
//! harness that runs a whole ringmux, which reads the demux's metrics, is the system tests'
//! (`systests/`).

pub mod aioquic;
pub mod client;
pub mod client_initial;
pub mod curl;
pub mod pebble;
pub mod tcp_client;
pub mod tls;
pub mod tool;
pub mod upstream;

/// A temporary folder, removed on drop (also when a test panics): the `tempfile` crate's.
pub use tempfile::TempDir;

/// A new folder under the system's temporary folder, its name `prefix` and random characters
/// (so tests running at once, in one process or several, never share one), open to others
/// (0755): the workers of a test run as root run as nobody, and read and execute what the test
/// puts there.
///
/// # Panics
/// If it cannot be created: the test cannot run.
pub fn temp_dir(prefix: &str) -> TempDir {
    use std::os::unix::fs::PermissionsExt;
    tempfile::Builder::new()
        .prefix(&format!("{prefix}-"))
        .permissions(std::fs::Permissions::from_mode(0o755))
        .tempdir()
        .unwrap_or_else(|e| panic!("creating a temporary folder {prefix}-*: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn folders_are_distinct_open_to_others_and_removed_on_drop() {
        let a = temp_dir("ringmux-support");
        let b = temp_dir("ringmux-support");
        assert_ne!(a.path(), b.path());
        assert!(a.path().is_dir() && b.path().is_dir());
        let mode = std::fs::metadata(a.path()).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o755, "{mode:o}");
        std::fs::write(a.path().join("f"), b"x").unwrap();
        let kept = a.path().to_owned();
        drop(a);
        assert!(!kept.exists());
    }
}
