//! What a worker can reach of the file system, from its first instruction (docs/security.md): the fault worker's `files` attack (test-tools/fault-worker) reads the
//! ACME account key and a site key, plants a certificate and a challenge in the ACME state
//! folder, reads files outside every root, changes a site root and writes anywhere else. Each
//! attempt must be refused, in every mode ringmux runs in: as root (workers as nobody), as an
//! unprivileged user the way deploy/ringmux.service runs it (CAP_SETUID and CAP_SETGID
//! ambient, workers as another user), and with `--worker-user self` (workers of ringmux's own
//! user: Landlock alone refuses). A control run without Landlock shows the attempts are real.
//! Needs root (to start ringmux as other users) and util-linux's `setpriv`; skipped otherwise.

use std::collections::HashMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use ringmux_systests::harness::{self, bounded, Forward, Ringmux};
use ringmux_testkit::{temp_dir, tool, TempDir};

/// The user ID ringmux runs as when not root: any unprivileged ID but nobody's.
pub(super) const RINGMUX_UID: u32 = 65533;
/// nobody: the workers' user where ringmux may switch users.
const NOBODY_UID: u32 = 65534;

/// The attempts that must be refused, in every confined mode.
const REFUSED: [&str; 21] = [
    "read-account-key",
    "read-site-key",
    "read-site-cert",
    "list-state",
    "plant-cert-open-for-writing",
    "plant-cert-create",
    "plant-cert-rename",
    "write-challenge",
    "write-state",
    "read-config",
    "read-shadow",
    "read-etc-passwd",
    "root-create",
    "root-open-for-writing",
    "root-rename",
    "root-mkdir",
    "root-remove",
    "write-tmp",
    "write-dev-shm",
    "write-cwd",
    "write-beside-state",
];

/// How ringmux is started.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Mode {
    /// As root: workers as nobody.
    Root,
    /// As an unprivileged user with CAP_NET_BIND_SERVICE, CAP_SETUID and CAP_SETGID ambient,
    /// as deploy/ringmux.service starts it: workers as nobody.
    Unit,
    /// As an unprivileged user with CAP_NET_BIND_SERVICE alone and `--worker-user self`.
    SameUser,
    /// As [`Mode::SameUser`] with `--sandbox filter-only`: no Landlock, the control.
    NoLandlock,
}

/// Everything the attack aims at, in a folder no worker may write (the test's reports and
/// binaries are elsewhere).
struct Targets {
    site: TempDir,
    /// Outside every root and setting: a file every user may read, by its mode.
    secrets: TempDir,
}

impl Targets {
    /// A site root with `index.html`, the ACME state folder (owned by `owner`, 0700, as the
    /// demux makes it) with an account key, a site's key and certificate and a challenge
    /// folder, the configuration file (owned by `owner`, 0600) naming them, and a
    /// shadow-like file, 0644, in a folder of its own.
    fn new(owner: u32) -> Targets {
        let site = temp_dir("ringmux-files-site");
        let secrets = temp_dir("ringmux-files-secrets");
        let d = site.path();
        std::fs::create_dir(d.join("a")).unwrap();
        std::fs::write(d.join("a/index.html"), "index\n").unwrap();
        let state = d.join("state");
        let certs = state.join("certs/a.test");
        std::fs::create_dir_all(&certs).unwrap();
        std::fs::create_dir_all(state.join("challenges")).unwrap();
        std::fs::write(state.join("account.json"), r#"{"key_pkcs8":"secret"}"#).unwrap();
        std::fs::write(certs.join("key.pem"), "-----BEGIN PRIVATE KEY-----\n").unwrap();
        std::fs::write(certs.join("cert.pem"), "-----BEGIN CERTIFICATE-----\n").unwrap();
        // Nothing listens here: the engine keeps failing to order, and serves on.
        let closed = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        std::fs::write(
            d.join("ringmux.toml"),
            format!(
                r#"[acme]
directory = "https://127.0.0.1:{closed}/dir"
state = "{state}"

[[site]]
names = ["a.test"]
acme = true
  [[site.route]]
  path = "/"
  root = "{d}/a"
"#,
                state = state.display(),
                d = d.display()
            ),
        )
        .unwrap();
        std::fs::write(secrets.path().join("shadow"), "root:$6$secret:::\n").unwrap();
        std::fs::set_permissions(
            secrets.path().join("shadow"),
            std::fs::Permissions::from_mode(0o644),
        )
        .unwrap();
        for entry in walk(&state) {
            std::os::unix::fs::chown(&entry, Some(owner), Some(owner)).unwrap();
        }
        std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o700)).unwrap();
        std::os::unix::fs::chown(d.join("ringmux.toml"), Some(owner), Some(owner)).unwrap();
        std::fs::set_permissions(
            d.join("ringmux.toml"),
            std::fs::Permissions::from_mode(0o600),
        )
        .unwrap();
        Targets { site, secrets }
    }

    fn config(&self) -> PathBuf {
        self.site.path().join("ringmux.toml")
    }

    fn state(&self) -> PathBuf {
        self.site.path().join("state")
    }

    /// The environment that points the attack at them.
    fn env(&self) -> Vec<(&'static str, String)> {
        let s = |p: PathBuf| p.to_string_lossy().into_owned();
        vec![
            ("RINGMUX_FAULT_STATE", s(self.state())),
            ("RINGMUX_FAULT_SITE", "a.test".into()),
            ("RINGMUX_FAULT_ROOT", s(self.site.path().join("a"))),
            ("RINGMUX_FAULT_CONFIG", s(self.config())),
            (
                "RINGMUX_FAULT_SHADOW",
                s(self.secrets.path().join("shadow")),
            ),
        ]
    }
}

/// `dir` and everything beneath it.
fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut all = vec![dir.to_owned()];
    let mut i = 0;
    while i < all.len() {
        if all[i].is_dir() {
            let mut more: Vec<PathBuf> = std::fs::read_dir(&all[i])
                .unwrap()
                .map(|e| e.unwrap().path())
                .collect();
            all.append(&mut more);
        }
        i += 1;
    }
    all
}

/// `bin` in `dir`, executable by anyone.
pub(super) fn world_executable_copy(bin: &Path, dir: &TempDir) -> PathBuf {
    let to = dir.path().join(bin.file_name().expect("a file name"));
    std::fs::copy(bin, &to).expect("copying a binary");
    std::fs::set_permissions(&to, std::fs::Permissions::from_mode(0o755)).unwrap();
    to
}

/// A script in `dir` that starts `demux` as RINGMUX_UID with `caps` ambient and `groups` (a
/// `setpriv` option), as systemd's User= and AmbientCapabilities= start it; `files` (its own
/// folder) made its own first.
pub(super) fn as_unit(
    dir: &Path,
    setpriv: &Path,
    demux: &Path,
    files: &Path,
    groups: &str,
    caps: &str,
) -> PathBuf {
    let wrapper = dir.join("as-unit");
    std::fs::write(
        &wrapper,
        format!(
            "#!/bin/sh\nchown -R {RINGMUX_UID}:{RINGMUX_UID} '{files}'\nexec \
             '{setpriv}' --reuid={RINGMUX_UID} --regid={RINGMUX_UID} {groups} \
             --inh-caps={caps} --ambient-caps={caps} '{demux}' \"$@\"\n",
            files = files.display(),
            setpriv = setpriv.display(),
            demux = demux.display(),
        ),
    )
    .unwrap();
    std::fs::set_permissions(&wrapper, std::fs::Permissions::from_mode(0o755)).unwrap();
    wrapper
}

/// What a worker runs with, from `/proc/PID/status`.
#[derive(Debug)]
pub(super) struct Credentials {
    /// Its effective user ID.
    pub(super) uid: u32,
    /// Its supplementary groups, as the file lists them.
    groups: String,
    /// Its effective, permitted and ambient capability sets, hexadecimal.
    caps: [String; 3],
}

impl Credentials {
    pub(super) fn of(pid: u32) -> Credentials {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        let field = |name: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .unwrap_or_else(|| panic!("{name} in {status}"))
                .trim()
                .to_string()
        };
        Credentials {
            uid: field("Uid:")
                .split_whitespace()
                .nth(1)
                .and_then(|v| v.parse().ok())
                .expect("effective uid"),
            groups: field("Groups:"),
            caps: [field("CapEff:"), field("CapPrm:"), field("CapAmb:")],
        }
    }

    /// Asserts: user `uid`, no supplementary group, no capability.
    fn assert_alone(&self, uid: u32) {
        assert_eq!(self.uid, uid, "{self:?}");
        assert_eq!(self.groups, "", "{self:?}");
        for set in &self.caps {
            assert_eq!(set, "0000000000000000", "{self:?}");
        }
    }
}

/// Starts ringmux in `mode` with instance 1 playing the `files` attack, and returns its report
/// once written, with the workers' credentials.
async fn attack(mode: Mode, setpriv: &Path) -> (HashMap<String, String>, Vec<Credentials>) {
    let owner = match mode {
        Mode::Root => 0,
        _ => RINGMUX_UID,
    };
    let targets = Targets::new(owner);
    // The marker, the report and the binaries: the one folder the workers may write
    // (the harness grants it, --worker-write), open to every user.
    let dir = temp_dir("ringmux-files");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
    let demux = world_executable_copy(&harness::binary("ringmux"), &dir);
    let fault = world_executable_copy(&harness::binary("ringmux-fault-worker"), &dir);
    let real = world_executable_copy(&harness::worker_bin(), &dir);
    let mut env = vec![
        ("RINGMUX_FAULT", "files".to_string()),
        ("RINGMUX_FAULT_INSTANCE", "1".to_string()),
        (
            "RINGMUX_FAULT_MARKER",
            dir.path().join("played").to_string_lossy().into_owned(),
        ),
        ("RINGMUX_REAL_WORKER", real.to_string_lossy().into_owned()),
    ];
    env.extend(targets.env());
    let config = targets.config().to_string_lossy().into_owned();
    let mut extra = vec!["--config", config.as_str()];
    let files = temp_dir("ringmux-files-own");
    let caps = match mode {
        Mode::Root => None,
        Mode::Unit => Some("+net_bind_service,+setuid,+setgid"),
        Mode::SameUser | Mode::NoLandlock => Some("+net_bind_service"),
    };
    match mode {
        Mode::SameUser => extra.extend(["--worker-user", "self"]),
        Mode::NoLandlock => extra.extend(["--worker-user", "self", "--sandbox", "filter-only"]),
        Mode::Root | Mode::Unit => {}
    }
    // The unit's ringmux in a supplementary group, which its workers must not keep.
    let groups = match mode {
        Mode::Unit => "--groups=4",
        _ => "--clear-groups",
    };
    let launcher = match caps {
        None => demux,
        Some(caps) => as_unit(dir.path(), setpriv, &demux, files.path(), groups, caps),
    };
    let rm = Ringmux::start_in(files, &launcher, 2, Forward::Shm, &extra, fault, &env);
    let report = harness::fault_report(dir.path(), Duration::from_secs(30)).await;
    if mode == Mode::Unit {
        // The demux does hold the group and the capabilities its workers must not keep.
        let demux = Credentials::of(rm.pid);
        assert_eq!(
            (demux.uid, demux.groups.as_str()),
            (RINGMUX_UID, "4"),
            "{demux:?}"
        );
        assert_ne!(demux.caps[0], "0000000000000000", "{demux:?}");
    }
    let credentials = rm
        .worker_pids()
        .await
        .into_iter()
        .map(Credentials::of)
        .collect();
    // The attack's files are still where they were: what was refused was refused, not missed.
    for f in [
        "account.json",
        "certs/a.test/key.pem",
        "certs/a.test/cert.pem",
    ] {
        let text = std::fs::read_to_string(targets.state().join(f)).unwrap();
        assert!(text.len() > 10, "{f}: {text:?}");
    }
    (report, credentials)
}

/// Asserts every attempt of [`REFUSED`] refused by the kernel (`EACCES`, or `EXDEV` for a
/// rename Landlock refuses), and the site root read.
fn assert_refused(mode: Mode, report: &HashMap<String, String>) {
    for attempt in REFUSED {
        let got = report.get(attempt).map(String::as_str);
        assert!(
            matches!(got, Some("EACCES" | "EPERM" | "EXDEV")),
            "{mode:?}: {attempt} was not refused: {got:?}; whole report: {report:?}"
        );
    }
    assert_eq!(
        report.get("root-read").map(String::as_str),
        Some("ok"),
        "{mode:?}: the site root must stay readable; whole report: {report:?}"
    );
}

/// Whether this test can run here: root, setpriv and Landlock.
pub(super) fn runnable() -> Option<PathBuf> {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("skipped: starting ringmux as other users needs root");
        return None;
    }
    if !tool::SETPRIV.present() {
        return None;
    }
    if ringmux_demux::sys::landlock_abi().is_none() {
        eprintln!("skipped: this kernel has no Landlock, so ringmux refuses to start confined");
        return None;
    }
    tool::which("setpriv")
}

#[tokio::test]
async fn a_worker_of_a_root_ringmux_reaches_no_file_it_does_not_need() {
    let Some(setpriv) = runnable() else { return };
    bounded(Duration::from_secs(60), async {
        let (report, workers) = attack(Mode::Root, &setpriv).await;
        assert_refused(Mode::Root, &report);
        for worker in &workers {
            worker.assert_alone(NOBODY_UID);
        }
    })
    .await;
}

#[tokio::test]
async fn a_worker_of_ringmux_run_as_the_unit_runs_it_reaches_no_file_it_does_not_need() {
    let Some(setpriv) = runnable() else { return };
    bounded(Duration::from_secs(60), async {
        let (report, workers) = attack(Mode::Unit, &setpriv).await;
        assert_refused(Mode::Unit, &report);
        for worker in &workers {
            worker.assert_alone(NOBODY_UID);
        }
    })
    .await;
}

#[tokio::test]
async fn a_worker_of_ringmuxs_own_user_reaches_no_file_it_does_not_need() {
    let Some(setpriv) = runnable() else { return };
    bounded(Duration::from_secs(60), async {
        let (report, workers) = attack(Mode::SameUser, &setpriv).await;
        assert_refused(Mode::SameUser, &report);
        for worker in &workers {
            worker.assert_alone(RINGMUX_UID);
        }
    })
    .await;
}

/// The control: without Landlock, a worker of ringmux's own user reads the account key and
/// plants a challenge. The refusals above are the allow-list's.
#[tokio::test]
async fn without_landlock_a_worker_of_ringmuxs_own_user_reads_the_account_key() {
    let Some(setpriv) = runnable() else { return };
    bounded(Duration::from_secs(60), async {
        let (report, _) = attack(Mode::NoLandlock, &setpriv).await;
        for attempt in [
            "read-account-key",
            "read-site-key",
            "write-challenge",
            "read-shadow",
        ] {
            assert_eq!(
                report.get(attempt).map(String::as_str),
                Some("ok"),
                "{attempt}; whole report: {report:?}"
            );
        }
    })
    .await;
}
