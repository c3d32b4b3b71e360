//! Whom the workers run as (`--worker-user`): the user looked up, and what it may reach on
//! disk (the worker program, a root), by the owner, group and other bits. Imports no sibling.

use std::path::{Path, PathBuf};

use anyhow::{bail, Result};

/// The user workers run as (`--worker-user`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerUser {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
}

/// Why a [`WorkerUser`] may not execute the worker program ([`WorkerUser::can_execute`]).
#[derive(Debug, thiserror::Error)]
pub enum Unreachable {
    /// The program or a folder above it cannot be looked at (by ringmux itself).
    #[error("{}", path.display())]
    Unreadable {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The user has no search permission on `folder`.
    #[error("it may not enter the folder {}", folder.display())]
    ClosedFolder { folder: PathBuf },
    /// The user has no execute permission on `program`.
    #[error("{} is not executable for it", program.display())]
    NotExecutable { program: PathBuf },
}

/// Whom the workers of a ringmux that may switch users (root, or CAP_SETUID and CAP_SETGID)
/// run as, unless `--worker-user` says otherwise.
pub const DEFAULT_WORKER_USER: &str = "nobody";

/// `--worker-user self`: the workers keep ringmux's own user, asked for explicitly.
pub const SELF_WORKER_USER: &str = "self";

impl WorkerUser {
    /// `Ok` if this user may execute `program`: search permission on every folder above it and
    /// execute permission on the file itself, by the owner, group and other bits (access
    /// control lists are not read). `Err` names what is closed.
    pub fn can_execute(&self, program: &Path) -> std::result::Result<(), Unreachable> {
        self.can_reach(program, 0o1, |program| Unreachable::NotExecutable {
            program,
        })
    }

    /// `Ok` if this user may enter `folder` and every folder above it (`--root`: a worker
    /// opens the root by its path, then each file beneath it), by the same bits as
    /// [`WorkerUser::can_execute`].
    pub fn can_enter(&self, folder: &Path) -> std::result::Result<(), Unreachable> {
        self.can_reach(folder, 0o1, |folder| Unreachable::ClosedFolder { folder })
    }

    /// `Ok` if this user may enter every folder above `path` and has the permission `bits`
    /// (other's bits: 4 read, 1 execute or search) on `path` itself; else `denied(path)` or
    /// the folder that is closed.
    fn can_reach(
        &self,
        path: &Path,
        bits: u32,
        denied: impl FnOnce(PathBuf) -> Unreachable,
    ) -> std::result::Result<(), Unreachable> {
        let program = path;
        use std::os::unix::fs::MetadataExt;
        let metadata = |path: &Path| {
            std::fs::metadata(path).map_err(|source| Unreachable::Unreadable {
                path: path.to_owned(),
                source,
            })
        };
        let program = program
            .canonicalize()
            .map_err(|source| Unreachable::Unreadable {
                path: program.to_owned(),
                source,
            })?;
        let allows = |m: &std::fs::Metadata, bits: u32| {
            let mode = m.mode();
            let granted = if m.uid() == self.uid {
                mode >> 6
            } else if m.gid() == self.gid {
                mode >> 3
            } else {
                mode
            };
            granted & bits == bits
        };
        for dir in program.ancestors().skip(1) {
            if !allows(&metadata(dir)?, 0o1) {
                return Err(Unreachable::ClosedFolder {
                    folder: dir.to_owned(),
                });
            }
        }
        if !allows(&metadata(&program)?, bits) {
            return Err(denied(program));
        }
        Ok(())
    }

    /// `spec`, a user name or a numeric UID, from the user database: neither root nor
    /// ringmux's own user, and ringmux must hold CAP_SETUID and CAP_SETGID to switch to it.
    pub(super) fn look_up(spec: &str) -> Result<WorkerUser> {
        use nix::unistd::{Uid, User};
        let flag = "--worker-user / RINGMUX_WORKER_USER";
        let found = match spec.trim().parse::<u32>() {
            Ok(uid) => User::from_uid(Uid::from_raw(uid)),
            Err(_) => User::from_name(spec.trim()),
        };
        let user = match found {
            Ok(Some(u)) => u,
            Ok(None) => {
                bail!("{flag}={spec:?} is not valid: no such user (see /etc/passwd; e.g. nobody)")
            }
            Err(e) => bail!("{flag}={spec:?}: looking the user up failed: {e}"),
        };
        if user.uid.is_root() {
            bail!(
                "{flag}={spec:?} is root by another name: name an unprivileged user, e.g. \
                 nobody, or `root` itself to keep the workers root without capabilities"
            );
        }
        let me = nix::unistd::geteuid();
        if user.uid == me {
            bail!(
                "{flag}={spec:?} is ringmux's own user (UID {me}): its workers could read and \
                 write every file ringmux may but for Landlock. Name a user of the workers' own \
                 (e.g. ringmux-worker), or `self` to accept workers of ringmux's user"
            );
        }
        if !crate::sys::may_switch_user() {
            bail!(
                "{flag}={spec:?} needs ringmux to hold CAP_SETUID and CAP_SETGID (as root, or \
                 granted by its unit: AmbientCapabilities=CAP_SETUID CAP_SETGID, see \
                 deploy/ringmux.service); it is UID {me} without them. Grant them, or set \
                 {flag}=self to run the workers as ringmux's own user"
            );
        }
        Ok(WorkerUser {
            name: user.name,
            uid: user.uid.as_raw(),
            gid: user.gid.as_raw(),
        })
    }
}
