//! The command line's errors as an operator reads them: `ringmux new-key-file` and a bad
//! `--key-file`, run as processes. Each error line names what is wrong and says why once
//! (ringmux prints an error with its causes, so a cause that were also the message's would
//! appear twice).

use std::process::{Command, Output};

use ringmux_quic_lb::KeySet;
use ringmux_test_support::{harness, temp_dir};

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
