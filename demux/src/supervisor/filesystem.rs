//! What a worker may reach of the file system: the allow-list its Landlock domain grants
//! ([`crate::sys::worker_domain`] enforces it). Decided here from the configuration; nothing
//! here opens a file but to see whether a system path exists.
//!
//! | granted | beneath |
//! |---|---|
//! | read and execute | the worker program (`--worker-bin` or `--worker-cmd`'s program), the loader and shared libraries ([`LIBRARIES`]), `--worker-read` |
//! | read | every site root (`--root`, every `root` of every `[[site.route]]`), the system files the C library reads ([`SYSTEM_FILES`]) |
//! | everything (write, create, remove, rename) | `--worker-write` |
//!
//! Nothing else: not the configuration file, certificates or keys (the demux reads them and
//! hands them over), not the ACME state, not `--key-file`, not `/proc` or `/sys` (a worker's
//! own `/proc/self` files too: nothing the worker library or the built-in server needs), not
//! `/dev` (a worker's standard input is `/dev/null` opened by the demux; randomness comes
//! from `getrandom`). Measured with `strace -f -e trace=%file` on the built-in worker serving
//! files and proxying, and on `worker/examples/`.

use std::path::{Path, PathBuf};

use ringmux_proto::sites::Action;

use crate::config::Config;
use crate::sys::FsAccess;

/// Where the dynamic loader and the shared libraries a program links are (read and execute):
/// the loader's path is fixed in each program (`/lib64/ld-linux-x86-64.so.2`,
/// `/lib/ld-linux-aarch64.so.1`), and the libraries are found through `/etc/ld.so.cache` in
/// these folders (or their `usr/` twins, where `/lib` is a link to `/usr/lib`). Those missing
/// on this system are left out.
pub const LIBRARIES: [&str; 6] = [
    "/lib",
    "/lib64",
    "/usr/lib",
    "/usr/lib64",
    "/usr/local/lib",
    "/etc/ld.so.cache",
];

/// System files the C library reads on a worker's behalf (read only): name resolution for an
/// upstream named by host name (`getaddrinfo`: the switch, hosts, resolver, address
/// preferences). Public on any system; those missing are left out.
pub const SYSTEM_FILES: [&str; 5] = [
    "/etc/nsswitch.conf",
    "/etc/hosts",
    "/etc/resolv.conf",
    "/etc/host.conf",
    "/etc/gai.conf",
];

/// The allow-list of the workers `cfg` starts.
pub fn allow_list(cfg: &Config) -> FsAccess {
    let existing = |paths: &[&str]| -> Vec<PathBuf> {
        paths
            .iter()
            .map(PathBuf::from)
            .filter(|p| p.exists())
            .collect()
    };
    let mut run = vec![PathBuf::from(cfg.worker_program())];
    run.extend(existing(&LIBRARIES));
    run.extend(cfg.args.worker_read.iter().cloned());
    let mut read = site_roots(cfg);
    read.extend(existing(&SYSTEM_FILES));
    FsAccess {
        run,
        read,
        write: cfg.args.worker_write.clone(),
    }
}

/// Every folder a site serves files from: `--root` without sites, else every route's.
fn site_roots(cfg: &Config) -> Vec<PathBuf> {
    let mut roots: Vec<PathBuf> = match &cfg.sites {
        None => cfg.args.root.iter().cloned().collect(),
        Some(table) => table
            .sites
            .iter()
            .flat_map(|s| &s.routes)
            .filter_map(|r| match &r.action {
                Action::Files { root } | Action::Builtin { root: Some(root) } => Some(root.clone()),
                _ => None,
            })
            .collect(),
    };
    roots.sort();
    roots.dedup();
    roots
}

/// Whether `path` is beneath one of `granted` (tests and `ringmux check` use it to say what a
/// worker may reach).
pub fn beneath(path: &Path, granted: &[PathBuf]) -> bool {
    granted.iter().any(|g| path.starts_with(g))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A checked configuration whose worker program is /bin/true.
    fn config(args: &[&str]) -> Config {
        let mut argv = vec!["ringmux", "--worker-bin", "/bin/true"];
        argv.extend_from_slice(args);
        crate::config::parse_from(argv.into_iter().map(Into::into).collect())
            .expect("a valid command line")
            .run
            .validate()
            .expect("a valid configuration")
    }

    #[test]
    fn the_default_grants_the_program_and_libraries_and_writes_nowhere() {
        let cfg = config(&["--worker-user", "self"]);
        let a = allow_list(&cfg);
        assert_eq!(a.run[0], PathBuf::from(cfg.worker_program()));
        assert!(beneath(
            Path::new("/usr/lib/x86_64-linux-gnu/libc.so.6"),
            &a.run
        ));
        assert!(a.write.is_empty(), "{a:?}");
        for secret in [
            "/etc/shadow",
            "/var/lib/ringmux/acme/account.json",
            "/proc/1/mem",
        ] {
            assert!(!beneath(Path::new(secret), &a.run), "{secret}");
            assert!(!beneath(Path::new(secret), &a.read), "{secret}");
        }
    }

    #[test]
    fn the_root_is_read_only_and_the_settings_add_what_they_name() {
        let dir = std::env::temp_dir();
        let root = dir.to_string_lossy().into_owned();
        let cfg = config(&[
            "--worker-user",
            "self",
            "--root",
            &root,
            "--worker-read",
            "/usr/share,/etc/ssl",
            "--worker-write",
            &root,
        ]);
        let a = allow_list(&cfg);
        assert!(a.read.contains(&dir), "{a:?}");
        assert!(!beneath(&dir, &a.run), "{a:?}");
        assert!(a.run.contains(&PathBuf::from("/usr/share")), "{a:?}");
        assert!(a.run.contains(&PathBuf::from("/etc/ssl")), "{a:?}");
        assert_eq!(a.write, vec![dir]);
    }
}
