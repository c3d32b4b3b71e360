//! A hostile worker and the rate tables (`ringmux_ring::tally`, shm-layout.md "Rate tables"):
//! the worker of instance 1 (test-tools/fault-worker, `rate-tables`) tries every way to write
//! its sibling's table, handed to it read-only (a writable mapping, `pwrite`, `mprotect`,
//! `ftruncate`, making it writable by its mode with `chmod`, `fchmod`, `fchmodat` and
//! `fchmodat2`, and reopening the descriptor writable through `/proc/self/fd`, which Landlock
//! does not govern and the table's mode, read-only for the demux's user, refuses); then it
//! fills its own table with garbage before the real worker takes it over. The sibling's table
//! is never written, and the garbage changes no count: one client gets one burst, whichever
//! worker it asks.
//!
//! Twice: as the tests run (workers as nobody when root, of another user than the demux's), and
//! with ringmux run as an unprivileged user with `--worker-user self`, its workers of its own
//! user: they own the tables, so only the filter's refusal of every `chmod` and the mode keep
//! them from reopening a sibling's writable. That run needs root (to start ringmux as another
//! user), `setpriv` and Landlock, and is skipped with the reason otherwise.

use ringmux_systests::harness;

use std::time::Duration;

use harness::{bounded, Forward, Ringmux};
use ringmux_testkit::temp_dir;

use super::files::{as_unit, runnable, world_executable_copy, Credentials, RINGMUX_UID};

const LIMIT: Duration = Duration::from_secs(90);
/// The site's burst; with `rate = "1/m"` its window is 5 minutes: none turns in the test.
const BURST: usize = 5;

#[tokio::test]
async fn a_worker_cannot_write_a_siblings_rate_table_nor_count_with_garbage() {
    bounded(LIMIT, attack(None)).await
}

/// As ringmux runs with `--worker-user self`: the demux an unprivileged user (RINGMUX_UID),
/// its workers of that same user, owners of the tables.
#[tokio::test]
async fn a_worker_of_ringmuxs_own_user_cannot_write_a_siblings_rate_table() {
    let Some(setpriv) = runnable() else { return };
    bounded(LIMIT, attack(Some(&setpriv))).await
}

/// Starts ringmux with instance 1 playing the attack (as RINGMUX_UID with workers of its own
/// user, through `setpriv`, when given), and asserts every attempt refused and the counts
/// whole.
async fn attack(same_user: Option<&std::path::Path>) {
    let dir = temp_dir("ringmux-attack-rate-tables");
    let d = dir.path();
    // The workers (nobody, when the tests run as root) write the marker and report here.
    std::fs::set_permissions(d, std::os::unix::fs::PermissionsExt::from_mode(0o777)).unwrap();
    let mut params = rcgen::CertificateParams::new(vec![harness::SERVER_NAME.to_string()]).unwrap();
    params.distinguished_name = rcgen::DistinguishedName::new();
    let key = rcgen::KeyPair::generate().unwrap();
    let cert = params.self_signed(&key).unwrap();
    std::fs::write(d.join("site.pem"), cert.pem()).unwrap();
    std::fs::write(d.join("site.key"), key.serialize_pem()).unwrap();
    let config = d.join("ringmux.toml");
    let text = format!(
        r#"[[site]]
names = ["{name}"]
cert = "{d}/site.pem"
key = "{d}/site.key"
rate = "1/m"
burst = {BURST}
[[site.route]]
path = "/"
respond = {{ status = 200, body = "hi\n" }}
"#,
        name = harness::SERVER_NAME,
        d = d.display(),
    );
    std::fs::write(&config, text).unwrap();
    let mut env = [
        ("RINGMUX_FAULT", "rate-tables".to_string()),
        ("RINGMUX_FAULT_INSTANCE", "1".to_string()),
        (
            "RINGMUX_FAULT_MARKER",
            d.join("played").to_string_lossy().into_owned(),
        ),
        (
            "RINGMUX_REAL_WORKER",
            harness::worker_bin().to_string_lossy().into_owned(),
        ),
    ];
    let mut extra = vec!["--config", config.to_str().unwrap()];
    let rm = match same_user {
        None => Ringmux::start_with(
            2,
            Forward::Shm,
            &extra,
            harness::binary("ringmux-fault-worker"),
            &env,
        ),
        Some(setpriv) => {
            // Binaries every user may run; ringmux's own files its own.
            let demux = world_executable_copy(&harness::binary("ringmux"), &dir);
            let fault = world_executable_copy(&harness::binary("ringmux-fault-worker"), &dir);
            let real = world_executable_copy(&harness::worker_bin(), &dir);
            env[3].1 = real.to_string_lossy().into_owned();
            let files = temp_dir("ringmux-rate-tables-own");
            let caps = "+net_bind_service";
            let launcher = as_unit(d, setpriv, &demux, files.path(), "--clear-groups", caps);
            extra.extend(["--worker-user", "self"]);
            Ringmux::start_in(files, &launcher, 2, Forward::Shm, &extra, fault, &env)
        }
    };
    let report = harness::fault_report(d, LIMIT).await;
    if same_user.is_some() {
        for pid in rm.worker_pids().await {
            assert_eq!(
                Credentials::of(pid).uid,
                RINGMUX_UID,
                "workers of its own user"
            );
        }
    }
    let got = |attempt: &str| {
        report
            .get(attempt)
            .unwrap_or_else(|| panic!("no {attempt} in {report:?}"))
            .as_str()
    };
    assert_eq!(got("tables"), "2", "{report:?}");
    for attempt in [
        "sibling-map-writable",
        "sibling-pwrite",
        "sibling-mprotect-writable",
        "sibling-reopen-writable",
        "sibling-truncate",
    ] {
        assert_ne!(got(attempt), "ok", "{attempt}: {report:?}");
    }
    // The filter refuses every change of mode, owner of the table or not.
    for attempt in [
        "sibling-fchmod",
        "sibling-chmod-proc",
        "sibling-fchmodat",
        "sibling-fchmodat2",
    ] {
        assert_eq!(got(attempt), "EPERM", "{attempt}: {report:?}");
    }
    assert!(!report.contains_key("sibling-reopened-map-writable"));
    assert_eq!(got("sibling-map-read-only"), "ok", "{report:?}");
    assert_eq!(got("sibling-cells-nonzero"), "0", "{report:?}");
    assert_eq!(got("own-map-writable"), "ok", "{report:?}");

    // One client, over both workers: one burst in all, instance 1 counting over its
    // garbage and reading instance 0's counts.
    let mut statuses = Vec::new();
    for instance in [0u8, 1] {
        let conn = rm.connect(&rm.pinned_client(instance)).await;
        for _ in 0..BURST {
            let r = conn.get("/").await.expect("GET /");
            statuses.push((instance, r.status.as_u16()));
        }
    }
    let admitted = statuses.iter().filter(|(_, s)| *s == 200).count();
    let limited = statuses.iter().filter(|(_, s)| *s == 429).count();
    assert_eq!((admitted, limited), (BURST, BURST), "{statuses:?}");
    assert!(
        statuses.iter().all(|(i, s)| (*i == 0) == (*s == 200)),
        "instance 0 admits the burst, instance 1 then refuses: {statuses:?}"
    );
}
