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

/// A second ringmux on the UDP address of a running one is refused at start, naming the
/// address, in every forwarding mode: the public socket's `SO_REUSEPORT` would otherwise let it
/// join the first one's group, say it is ready and receive nothing (with `--tcp off` no TCP
/// listener fails first).
#[test]
fn a_second_ringmux_on_a_busy_udp_port_is_refused() {
    use harness::{Forward, Ringmux};
    for forward in [Forward::Shm, Forward::Unix, Forward::Reuseport] {
        let first = Ringmux::start(1, forward, &["--tcp", "off"]);
        let listen = first.listen.to_string();
        let dir = temp_dir("ringmux-cli-busy");
        let control = dir.path().join("control.sock");
        let mut args = vec![
            "--listen",
            &listen,
            "--tcp",
            "off",
            "--forward",
            forward.as_arg(),
            "--metrics",
            "127.0.0.1:0",
            "--control-socket",
            control.to_str().expect("a UTF-8 path"),
            // Refused before any worker starts: any program every user may run.
            "--worker-bin",
            "/bin/true",
        ];
        if !nix::unistd::geteuid().is_root() {
            args.extend(["--worker-user", "self"]);
        }
        if forward == Forward::Reuseport {
            args.push("--plaintext-cids");
        }
        let out = harness::until_exit(&args);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(1), "{forward:?}: {err}");
        assert!(
            err.contains(&format!("UDP {listen}")) && err.contains("in use already"),
            "{forward:?}: {err}"
        );
        // The first one serves on.
        let up = first
            .metrics()
            .sum(ringmux_demux::metrics::names::WORKER_UP);
        assert_eq!(up, 1.0, "{forward:?}: the first ringmux's worker");
    }
}

/// Runs `ringmux ARGS` as a client command, bounded, with none of the variables that would name
/// the running ringmux: what it finds, it finds through the file. Exit status and output.
async fn client(args: &[&str]) -> (bool, String) {
    let out = tokio::process::Command::new(harness::binary("ringmux"))
        .args(args)
        .env_remove("RINGMUX_CONTROL_SOCKET")
        .env_remove("RINGMUX_METRICS")
        .env_remove("RINGMUX_CONFIG")
        .env("RUST_LOG", "warn")
        .kill_on_drop(true)
        .output();
    let out = harness::bounded(std::time::Duration::from_secs(60), out)
        .await
        .expect("running ringmux");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// `reload`, `stats`, `acme renew` and `check` take the running ringmux's file: they find its
/// control socket and metrics address there; a flag still wins; and `check` warns when the
/// running ringmux would refuse the file as a restart-only change.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_client_commands_find_the_running_ringmux_through_its_file() {
    use harness::{Forward, Ringmux};
    let dir = temp_dir("ringmux-cli-file");
    let file = dir.path().join("ringmux.toml");
    let control = dir.path().join("control.sock");
    // `check` asks whether the workers' user may run the worker program: one every user may
    // run (the running ringmux's --worker-bin, from the harness, wins over the file); not as
    // root, the workers keep ringmux's user.
    let user = match nix::unistd::geteuid().is_root() {
        true => "worker_bin = \"/bin/true\"\n",
        false => "worker_bin = \"/bin/true\"\nworker_user = \"self\"\n",
    };
    let settings = |tcp: &str| {
        format!(
            "control_socket = {control:?}\nmetrics = \"{{METRICS}}\"\ntcp = \"{tcp}\"\n{user}",
            control = control.to_str().expect("a UTF-8 path"),
        )
    };
    // The metrics address is known once ringmux runs: the file names port 0 until then, and the
    // running ringmux's command line (the harness's --metrics) wins over it anyway.
    std::fs::write(&file, settings("off").replace("{METRICS}", "127.0.0.1:0")).unwrap();
    let file_arg = file.to_str().expect("a UTF-8 path");
    let rm = Ringmux::start(
        1,
        Forward::Shm,
        &[
            "--config",
            file_arg,
            "--control-socket",
            control.to_str().unwrap(),
        ],
    );
    let metrics = rm.metrics.to_string();
    std::fs::write(&file, settings("off").replace("{METRICS}", &metrics)).unwrap();

    let (ok, out) = client(&["reload", "--config", file_arg]).await;
    assert!(ok && out.contains("ok"), "reload --config: {out}");
    let (ok, out) = client(&["stats", "--config", file_arg]).await;
    assert!(ok && out.contains("instance"), "stats --config: {out}");
    // The running ringmux answers (it has no [acme] table): the file named its socket.
    let (ok, out) = client(&["acme", "renew", "--config", file_arg]).await;
    assert!(
        !ok && !out.contains("connecting to"),
        "acme renew --config: {out}"
    );
    // An explicit flag wins over the file.
    let elsewhere = dir.path().join("elsewhere.sock");
    let elsewhere = elsewhere.to_str().unwrap();
    let (ok, out) = client(&[
        "reload",
        "--config",
        file_arg,
        "--control-socket",
        elsewhere,
    ])
    .await;
    assert!(
        !ok && out.contains("connecting to") && out.contains(elsewhere),
        "the flag: {out}"
    );

    let (ok, out) = client(&["check", "--config", file_arg]).await;
    assert!(
        ok && out.contains("a reload would start a new generation") && !out.contains("warning"),
        "check, nothing changed: {out}"
    );
    // TCP on: a change only a restart applies.
    std::fs::write(&file, settings("on").replace("{METRICS}", &metrics)).unwrap();
    let (ok, out) = client(&["check", "--config", file_arg]).await;
    assert!(ok, "the file itself is fine for a start: {out}");
    assert!(
        out.contains("warning: the ringmux running on") && out.contains("tcp (--tcp)"),
        "check, tcp changed: {out}"
    );
    let (ok, out) = client(&["reload", "--config", file_arg]).await;
    assert!(
        !ok && out.contains("tcp (--tcp)"),
        "the reload it warned of: {out}"
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
