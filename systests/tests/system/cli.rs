//! The command line's errors as an operator reads them: `ringmux new-key-file` and a bad
//! `--key-file`, run as processes. Each error line names what is wrong and says why once
//! (ringmux prints an error with its causes, so a cause that were also the message's would
//! appear twice).

use std::process::{Command, Output};

use ringmux_quic_lb::KeySet;
use ringmux_systests::harness;
use ringmux_testkit::temp_dir;

fn ringmux(args: &[&std::ffi::OsStr]) -> Output {
    Command::new(harness::binary("ringmux"))
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .expect("running ringmux")
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn new_key_file_writes_a_private_file_once_and_refuses_to_replace_it() {
    use std::os::unix::fs::PermissionsExt;
    let dir = temp_dir("ringmux-cli-keys");
    let path = dir.path().join("keys");
    let out = ringmux(&["new-key-file".as_ref(), path.as_os_str()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "{mode:o}");
    let keys = KeySet::load(&path).expect("a key file ringmux loads");

    let out = ringmux(&["new-key-file".as_ref(), path.as_os_str()]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains(&path.display().to_string()), "{err}");
    assert_eq!(err.matches("File exists").count(), 1, "{err}");
    assert_eq!(KeySet::load(&path).unwrap(), keys, "the file was replaced");
}

#[test]
fn a_missing_key_file_is_named_with_its_reason_once() {
    let dir = temp_dir("ringmux-cli-missing");
    let path = dir.path().join("absent");
    let out = ringmux(&[
        "--listen".as_ref(),
        "127.0.0.1:0".as_ref(),
        "--key-file".as_ref(),
        path.as_os_str(),
    ]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("--key-file") && err.contains(&path.display().to_string()),
        "{err}"
    );
    assert_eq!(err.matches("No such file or directory").count(), 1, "{err}");
}

/// As root, ringmux refuses to start with a `--root` its workers' user cannot enter, naming
/// the folder and the user, rather than printing its ready line and watching every worker
/// fail on "Permission denied".
#[test]
fn a_root_the_workers_cannot_reach_is_refused_at_start() {
    use std::os::unix::fs::PermissionsExt;
    if !nix::unistd::geteuid().is_root() {
        eprintln!("skipped: needs root (ringmux runs its workers as nobody only as root)");
        return;
    }
    let dir = temp_dir("ringmux-cli-root");
    let closed = dir.path().join("closed");
    let site = closed.join("site");
    std::fs::create_dir_all(&site).unwrap();
    std::fs::set_permissions(&closed, std::fs::Permissions::from_mode(0o700)).unwrap();
    let keys = dir.path().join("keys");
    KeySet::generate().unwrap().write_new(&keys).unwrap();
    // A worker program every user may execute, so that the root is what is refused.
    let out = ringmux(&[
        "--listen".as_ref(),
        "127.0.0.1:0".as_ref(),
        "--key-file".as_ref(),
        keys.as_os_str(),
        "--worker-user".as_ref(),
        "nobody".as_ref(),
        "--worker-bin".as_ref(),
        "/bin/true".as_ref(),
        "--root".as_ref(),
        site.as_os_str(),
    ]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("--root") && err.contains(&site.display().to_string()),
        "{err}"
    );
    assert!(
        err.contains("nobody") && err.contains(&closed.display().to_string()),
        "the user and the closed folder: {err}"
    );
    assert!(
        !String::from_utf8_lossy(&out.stdout).contains("ringmux ready"),
        "it must not start"
    );
}

/// `ringmux check` warns when the workers keep ringmux's own user (`--worker-user self`),
/// and refuses a `--worker-read` path that does not exist, naming it.
#[test]
fn check_warns_of_workers_of_ringmuxs_own_user_and_checks_what_they_may_read() {
    let check = |more: &[&str]| {
        let mut args: Vec<&std::ffi::OsStr> = ["check", "--worker-bin", "/bin/true"]
            .iter()
            .map(|a| a.as_ref())
            .collect();
        args.extend(more.iter().map(|a| std::ffi::OsStr::new(*a)));
        ringmux(&args)
    };
    let out = check(&["--worker-user", "self"]);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert_eq!(out.status.code(), Some(0), "{text}{}", stderr(&out));
    assert!(
        text.lines()
            .any(|l| l.starts_with("warning: ") && l.contains("self")),
        "{text}"
    );
    assert!(text.contains("configuration OK"), "{text}");
    let out = check(&["--worker-user", "self", "--worker-read", "/no/such/thing"]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("--worker-read / RINGMUX_WORKER_READ=/no/such/thing"),
        "{err}"
    );
}
