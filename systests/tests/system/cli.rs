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

/// `ringmux` run with `args`, which must end within `limit` (else it is killed and the test
/// fails): for files that would block a reader.
fn ringmux_within(args: &[&std::ffi::OsStr], limit: std::time::Duration) -> Output {
    let mut child = Command::new(harness::binary("ringmux"))
        .args(args)
        .env("RUST_LOG", "warn")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("running ringmux");
    let deadline = std::time::Instant::now() + limit;
    while child.try_wait().unwrap().is_none() {
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!(
                "ringmux {args:?} did not end within {limit:?}: {}",
                stderr(&out)
            );
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

/// The operator's files must be regular files of bounded size: `ringmux check` refuses a
/// FIFO nothing writes to, a device that never ends and a 2 GiB sparse file as the
/// configuration, the key file or the certificate, at once (none is read until it blocks or
/// fills the memory), naming the option and the file; and a `--root` in /proc or /sys.
#[test]
fn operator_files_that_are_no_regular_files_are_refused_at_once() {
    use std::time::Duration;
    let dir = temp_dir("ringmux-cli-files");
    let fifo = dir.path().join("fifo");
    nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
    let sparse = dir.path().join("sparse");
    std::fs::File::create(&sparse)
        .unwrap()
        .set_len(2 << 30)
        .unwrap();
    let zero = std::path::Path::new("/dev/zero");
    let limit = Duration::from_secs(30);
    for (option, path, says) in [
        ("--config", fifo.as_path(), "a FIFO, not a regular file"),
        ("--config", zero, "a character device, not a regular file"),
        (
            "--config",
            &sparse,
            "2147483648 bytes, more than the 4194304",
        ),
        ("--key-file", fifo.as_path(), "a FIFO, not a regular file"),
        ("--key-file", zero, "a character device, not a regular file"),
        (
            "--key-file",
            &sparse,
            "2147483648 bytes, more than the 1048576",
        ),
    ] {
        let out = ringmux_within(
            &["check".as_ref(), option.as_ref(), path.as_os_str()],
            limit,
        );
        let err = stderr(&out);
        assert_eq!(
            out.status.code(),
            Some(1),
            "{option} {}: {err}",
            path.display()
        );
        assert!(
            err.contains(option) && err.contains(&path.display().to_string()) && err.contains(says),
            "{option} {}: {err}",
            path.display()
        );
    }
    // The command line's certificate and key.
    let ck = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).unwrap();
    let (cert, key) = (dir.path().join("c.pem"), dir.path().join("k.pem"));
    std::fs::write(&cert, ck.cert.pem()).unwrap();
    std::fs::write(&key, ck.signing_key.serialize_pem()).unwrap();
    for (c, k, says) in [
        (fifo.as_path(), key.as_path(), "a FIFO"),
        (cert.as_path(), zero, "a character device"),
        (sparse.as_path(), key.as_path(), "2147483648 bytes"),
    ] {
        let out = ringmux_within(
            &[
                "check".as_ref(),
                "--cert".as_ref(),
                c.as_os_str(),
                "--key".as_ref(),
                k.as_os_str(),
            ],
            limit,
        );
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(1), "{err}");
        assert!(err.contains("--cert") && err.contains(says), "{err}");
    }
    // A root of pseudo files.
    for root in ["/proc", "/sys/kernel"] {
        let out = ringmux_within(&["check".as_ref(), "--root".as_ref(), root.as_ref()], limit);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(1), "{root}: {err}");
        assert!(
            err.contains(&format!("--root / RINGMUX_ROOT={root}"))
                && err.contains("a file system the kernel makes up"),
            "{root}: {err}"
        );
    }
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
