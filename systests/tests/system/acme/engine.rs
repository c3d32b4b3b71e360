//! The ACME engine (`ringmux_acme`) against a real CA: Pebble and its DNS on loopback
//! (`ringmux_testkit::pebble`), with challenge responders written here that answer from
//! the engine's view the way the workers do (HTTP-01 on a plain TCP port, TLS-ALPN-01 on a
//! rustls port offering only `acme-tls/1`).
//!
//! Every wait is on the engine's eventfd with a deadline (`wait_for`): a test that does not
//! get what it waits for fails with the engine's status and Pebble's log. Pebble refuses 5 %
//! of nonces (its default): every issuance here goes through retried `badNonce`s.
//!
//! Without Pebble installed the tests skip loudly, unless `CI` is set (scripts/test.sh installs
//! it).

use std::os::fd::BorrowedFd;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use ringmux_acme::seal::Sealer;
use ringmux_acme::{
    Acme, AcmeSettings, AcmeSite, AcmeStatus, AcmeView, ChallengeKind, Issued, STATE_POLL_INTERVAL,
};
use ringmux_proto::ChallengeSet;
use ringmux_testkit::pebble::{Pebble, PebbleConfig};
use ringmux_testkit::temp_dir;
use rustls::client::danger::ServerCertVerifier;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// An issuance against Pebble takes seconds; this bounds each wait.
const LIMIT: Duration = Duration::from_secs(90);

// ---------------------------------------------------------------------------------------------
// Tests
// ---------------------------------------------------------------------------------------------

#[test]
fn acme_issues_over_http01_a_chain_that_verifies_for_every_name() {
    let responder = Responder::start();
    let Some(pebble) = Pebble::start(responder.http_port, responder.tls_port) else {
        return;
    };
    let dir = temp_dir("ringmux-acme");
    let state = dir.path().join("acme");
    let site = site(0, &["a.test", "www.a.test"]);
    let started = Instant::now();
    let acme = Acme::start(
        settings(&state, &pebble, ChallengeKind::Http01),
        vec![site.clone()],
    )
    .unwrap();
    let (view, status) = wait_for(
        &[&acme],
        &[0],
        &responder,
        &pebble,
        "a certificate",
        |v, _| !v[0].certs.is_empty(),
    );
    let took = started.elapsed();
    eprintln!("issuance over HTTP-01 (two names, account included): {took:.2?}");
    let (index, _, issued) = &view[0].certs[0];
    assert_eq!(*index, 0);
    verify(issued, &pebble.issuer_root_pem(), &site.names);
    assert_eq!((status[0].orders_issued, status[0].orders_failed), (1, 0));
    let s = &status[0].sites[0];
    assert_eq!(s.label, "a.test");
    assert_eq!(s.not_after, Some(issued.not_after));
    assert_eq!(s.last_error, None);
    // Renewal is planned when a third of the lifetime is left.
    let life = issued.not_after.duration_since(issued.not_before).unwrap();
    let planned = s.next_attempt.expect("a next attempt");
    let third = issued.not_after - life / 3;
    assert!(
        planned == third,
        "next attempt {planned:?}, a third of the lifetime left at {third:?}"
    );
    // Both names were validated over HTTP-01, none over TLS-ALPN-01.
    assert!(responder.http_hits() >= 2, "{}", responder.http_hits());
    assert_eq!(responder.tls_hits(), 0);
    // The challenges are gone once the order is over; the files are the engine's alone.
    let (view, _) = wait_for(
        &[&acme],
        &[0],
        &responder,
        &pebble,
        "no challenge",
        |v, _| v[0].challenges == ChallengeSet::default(),
    );
    assert!(view[0].challenges_version >= 2, "published and withdrawn");
    assert_eq!(files(&state.join("challenges")), Vec::<String>::new());
    for f in [
        "account.json",
        "certs/a.test/cert.pem",
        "certs/a.test/key.pem",
    ] {
        let mode = std::fs::metadata(state.join(f))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600, "{f}");
    }
    let mode = std::fs::metadata(&state).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o700);
}

#[test]
fn acme_issues_over_tls_alpn01() {
    let responder = Responder::start();
    let Some(pebble) = Pebble::start(responder.http_port, responder.tls_port) else {
        return;
    };
    let dir = temp_dir("ringmux-acme");
    let site = site(3, &["b.test"]);
    let started = Instant::now();
    let acme = Acme::start(
        settings(&dir.path().join("acme"), &pebble, ChallengeKind::TlsAlpn01),
        vec![site.clone()],
    )
    .unwrap();
    let mut saw_tls_challenge = false;
    let (view, status) = wait_for(
        &[&acme],
        &[0],
        &responder,
        &pebble,
        "a certificate",
        |v, _| {
            saw_tls_challenge |= v[0]
                .challenges
                .tls_alpn01
                .iter()
                .any(|t| t.name == "b.test");
            assert!(v[0].challenges.http01.is_empty());
            !v[0].certs.is_empty()
        },
    );
    eprintln!(
        "issuance over TLS-ALPN-01 (one name, account included): {:.2?}",
        started.elapsed()
    );
    assert!(saw_tls_challenge);
    let (index, _, issued) = &view[0].certs[0];
    assert_eq!(*index, 3);
    verify(issued, &pebble.issuer_root_pem(), &site.names);
    assert_eq!((status[0].orders_issued, status[0].orders_failed), (1, 0));
    assert!(responder.tls_hits() >= 1, "{}", responder.tls_hits());
    assert_eq!(responder.http_hits(), 0);
}

#[test]
fn acme_restart_serves_the_stored_certificate_and_renew_orders_anew() {
    let responder = Responder::start();
    let Some(pebble) = Pebble::start(responder.http_port, responder.tls_port) else {
        return;
    };
    let dir = temp_dir("ringmux-acme");
    let state = dir.path().join("acme");
    let sites = vec![site(0, &["c.test"]), site(1, &["d.test", "www.d.test"])];
    let first = Acme::start(
        settings(&state, &pebble, ChallengeKind::Http01),
        sites.clone(),
    )
    .unwrap();
    let (view, _) = wait_for(
        &[&first],
        &[0],
        &responder,
        &pebble,
        "two certificates",
        |v, _| v[0].certs.len() == 2,
    );
    let before: Vec<Issued> = view[0].certs.iter().map(|c| c.2.clone()).collect();
    drop(first);

    // A new engine on the same directory serves them from its first view, ordering nothing.
    let second = Acme::start(
        settings(&state, &pebble, ChallengeKind::Http01),
        sites.clone(),
    )
    .unwrap();
    let first_view = second.view();
    let served: Vec<Issued> = first_view.certs.iter().map(|c| c.2.clone()).collect();
    assert_eq!(served, before);
    let hits = responder.http_hits();
    watch(&second, 4 * STATE_POLL_INTERVAL, |v, s| {
        assert_eq!((s.orders_issued, s.orders_failed), (0, 0), "{s:?}");
        assert_eq!(v.certs.len(), 2);
        assert_eq!(v.challenges, ChallengeSet::default());
    });
    assert_eq!(responder.http_hits(), hits);

    // A forced renewal of one site, named by its second name.
    assert!(second
        .renew(Some("nowhere.test"))
        .unwrap_err()
        .to_string()
        .contains("nowhere.test"));
    let ticket = second.renew(Some("WWW.d.test")).unwrap();
    assert_eq!(second.renewed(ticket), None);
    let started = Instant::now();
    let (view, status) = wait_for(
        &[&second],
        &[0],
        &responder,
        &pebble,
        "the renewal",
        |_, _| second.renewed(ticket).is_some(),
    );
    eprintln!("forced renewal (account stored): {:.2?}", started.elapsed());
    assert_eq!(second.renewed(ticket), Some(Ok(vec![1])));
    assert_eq!((status[0].orders_issued, status[0].orders_failed), (1, 0));
    let renewed = &view[0].certs[1];
    assert_eq!(renewed.0, 1);
    assert_ne!(renewed.2.serial, before[1].serial);
    assert!(renewed.1 > first_view.certs[1].1, "the version is raised");
    verify(&renewed.2, &pebble.issuer_root_pem(), &sites[1].names);
    // The other site keeps its certificate.
    assert_eq!(view[0].certs[0].2, before[0]);
    assert_eq!(view[0].certs[0].1, first_view.certs[0].1);

    // Every site at once.
    let ticket = second.renew(None).unwrap();
    wait_for(
        &[&second],
        &[0],
        &responder,
        &pebble,
        "renewing all",
        |_, _| second.renewed(ticket).is_some(),
    );
    let mut renewed = second.renewed(ticket).unwrap().unwrap();
    renewed.sort();
    assert_eq!(renewed, [0, 1]);
    assert_eq!(second.status().orders_issued, 3);
}

#[test]
fn acme_set_sites_orders_for_a_new_site_moves_a_kept_one_and_forgets_a_removed_one() {
    let responder = Responder::start();
    let Some(pebble) = Pebble::start(responder.http_port, responder.tls_port) else {
        return;
    };
    let dir = temp_dir("ringmux-acme");
    let acme = Acme::start(
        settings(&dir.path().join("acme"), &pebble, ChallengeKind::Http01),
        vec![site(0, &["h.test"])],
    )
    .unwrap();
    let (view, _) = wait_for(&[&acme], &[0], &responder, &pebble, "h.test", |v, _| {
        v[0].certs.len() == 1
    });
    let (_, h_version, h_cert) = view[0].certs[0].clone();

    // A reload puts i.test first: h.test moves to index 1 (its version is raised, so that the
    // supervisor sends it under its new index), i.test is ordered.
    acme.set_sites(vec![site(0, &["i.test"]), site(1, &["h.test"])]);
    assert!(
        acme.renew(Some("i.test")).is_ok(),
        "renew knows the new names at once"
    );
    let (view, status) = wait_for(&[&acme], &[0], &responder, &pebble, "i.test", |v, _| {
        v[0].certs.len() == 2
    });
    assert_eq!(view[0].certs[0].0, 0);
    verify(
        &view[0].certs[0].2,
        &pebble.issuer_root_pem(),
        &["i.test".into()],
    );
    assert_eq!(view[0].certs[1].0, 1);
    assert_eq!(view[0].certs[1].2, h_cert);
    assert!(view[0].certs[1].1 > h_version);
    let labels: Vec<&str> = status[0].sites.iter().map(|s| s.label.as_str()).collect();
    assert_eq!(labels, ["i.test", "h.test"]);

    // Another removes h.test.
    acme.set_sites(vec![site(0, &["i.test"])]);
    assert!(acme.renew(Some("h.test")).is_err());
    let (view, status) = wait_for(
        &[&acme],
        &[0],
        &responder,
        &pebble,
        "h.test gone",
        |v, _| v[0].certs.len() == 1,
    );
    assert_eq!(view[0].certs[0].0, 0);
    assert_eq!(status[0].sites.len(), 1);
}

#[test]
fn acme_with_the_ca_down_backs_off_and_says_why() {
    let closed = closed_port();
    let dir = temp_dir("ringmux-acme");
    let settings = AcmeSettings {
        directory: format!("https://127.0.0.1:{closed}/dir"),
        email: None,
        state: dir.path().join("acme"),
        challenge: ChallengeKind::Http01,
        // Any root: the system may have none, and the CA is never reached.
        ca_roots: vec![
            rcgen::generate_simple_self_signed(vec!["x.test".to_string()])
                .unwrap()
                .cert
                .der()
                .to_vec(),
        ],
        ca_roots_file: None,
        eab: None,
        key_file: None,
    };
    let acme = Acme::start(settings, vec![site(0, &["e.test"])]).unwrap();
    let (_, status) = wait_until(&acme, "a failed order", |_, s| s.orders_failed >= 1);
    let s = &status.sites[0];
    let error = s.last_error.clone().expect("an error");
    assert!(
        error.contains(&format!("127.0.0.1:{closed}")) && error.contains("refused"),
        "{error}"
    );
    // The first retry after one minute at most, half a minute at least (jitter).
    let first = s.next_attempt.expect("a next attempt");
    let wait = first.duration_since(SystemTime::now()).unwrap();
    assert!(
        wait > Duration::from_secs(25) && wait <= Duration::from_secs(60),
        "{wait:?}"
    );
    assert_eq!(status.orders_issued, 0);

    // A forced attempt fails again: the back-off doubles.
    let ticket = acme.renew(None).unwrap();
    wait_until(&acme, "the forced attempt", |_, _| {
        acme.renewed(ticket).is_some()
    });
    let e = acme.renewed(ticket).unwrap().unwrap_err().to_string();
    assert!(e.contains("e.test") && e.contains("refused"), "{e}");
    let status = acme.status();
    assert_eq!(status.orders_failed, 2);
    let second = status.sites[0].next_attempt.expect("a next attempt");
    let wait = second.duration_since(SystemTime::now()).unwrap();
    assert!(
        wait > Duration::from_secs(55) && wait <= Duration::from_secs(120),
        "{wait:?}"
    );
    assert!(second > first, "{second:?} <= {first:?}");
    assert!(acme.view().certs.is_empty());
    // The record every node sharing the directory backs off by.
    let record =
        std::fs::read_to_string(dir.path().join("acme/certs/e.test/attempt.json")).unwrap();
    assert!(record.contains("\"failures\":2"), "{record}");
}

/// Four ACME sites at a fresh start are ordered at once, not one after another: at some moment
/// the challenges of all four are published together. An order publishes its challenges, waits
/// `order::SETTLE` (2 s) for every node to read them, then asks the CA to validate, and
/// withdraws them when it ends: orders one at a time would never show two sites' challenges
/// in one view.
#[test]
fn acme_four_sites_are_ordered_in_parallel() {
    let responder = Responder::start();
    let Some(pebble) = Pebble::start(responder.http_port, responder.tls_port) else {
        return;
    };
    let dir = temp_dir("ringmux-acme");
    let names = ["p1.test", "p2.test", "p3.test", "p4.test"];
    let sites: Vec<AcmeSite> = names
        .iter()
        .enumerate()
        .map(|(i, n)| site(i, &[*n]))
        .collect();
    let acme = Acme::start(
        settings(&dir.path().join("acme"), &pebble, ChallengeKind::Http01),
        sites,
    )
    .unwrap();
    let mut together = 0;
    let (view, status) = wait_for(
        &[&acme],
        &[0],
        &responder,
        &pebble,
        "four certificates",
        |v, _| {
            let pending: std::collections::BTreeSet<&str> = v[0]
                .challenges
                .http01
                .iter()
                .map(|h| h.name.as_str())
                .collect();
            together = together.max(pending.len());
            v[0].certs.len() == names.len()
        },
    );
    assert_eq!(
        together,
        names.len(),
        "the most sites with challenges at once"
    );
    assert_eq!((status[0].orders_issued, status[0].orders_failed), (4, 0));
    for (index, _, issued) in &view[0].certs {
        verify(
            issued,
            &pebble.issuer_root_pem(),
            &[names[*index].to_string()],
        );
    }
}

/// A failed order's back-off is kept across a restart with the same configuration (and the
/// status says when the next attempt is), forgotten when the site's names change at a reload,
/// and forgotten at a restart whose `[acme]` table changed: the operator fixed the mistake,
/// and the site is ordered at once. The back-off here is an hour, so only a forgotten one
/// lets an order run within the test's bound.
#[test]
fn acme_a_back_off_holds_across_a_restart_until_the_configuration_changes() {
    let responder = Responder::start();
    let Some(pebble) = Pebble::start(responder.http_port, responder.tls_port) else {
        return;
    };
    let dir = temp_dir("ringmux-acme");
    let state = dir.path().join("acme");
    let closed = closed_port();
    let right = settings(&state, &pebble, ChallengeKind::Http01);
    let wrong = AcmeSettings {
        directory: format!("https://127.0.0.1:{closed}/dir"),
        ..right.clone()
    };
    let hour = ringmux_acme::Pacing {
        backoff_base: Duration::from_secs(3600),
        backoff_cap: Duration::from_secs(7200),
        ..Default::default()
    };
    let one = site(0, &["f.test"]);
    {
        let acme = Acme::start_with(wrong.clone(), vec![one.clone()], hour.clone()).unwrap();
        wait_until(&acme, "a failed order", |_, s| s.orders_failed >= 1);
        // New names at a reload: the failure under the old ones does not delay an order.
        acme.set_sites(vec![site(0, &["f.test", "www.f.test"])]);
        wait_until(&acme, "an order for the new names", |_, s| {
            s.orders_failed >= 2
        });
    }
    // The same configuration again after a restart: the back-off is kept and shown.
    {
        let two_names = site(0, &["f.test", "www.f.test"]);
        let acme = Acme::start_with(wrong.clone(), vec![two_names], hour.clone()).unwrap();
        let status = acme.status();
        let s = &status.sites[0];
        let next = s.next_attempt.expect("the kept back-off");
        assert!(
            next > SystemTime::now() + Duration::from_secs(60),
            "{next:?}"
        );
        assert!(
            s.last_error
                .as_deref()
                .is_some_and(|e| e.contains("refused")),
            "{s:?}"
        );
        assert_eq!(status.orders_failed, 0, "no order at the start");
    }
    // The mistake fixed (Pebble's directory): due at once, and issued.
    let acme = Acme::start_with(right, vec![one], hour).unwrap();
    let status = acme.status();
    assert_eq!(status.sites[0].next_attempt, None, "{status:?}");
    wait_for(
        &[&acme],
        &[0],
        &responder,
        &pebble,
        "a certificate",
        |v, _| !v[0].certs.is_empty(),
    );
}

#[test]
fn acme_start_refuses_a_state_dir_open_to_others_and_a_directory_that_is_not_https() {
    let dir = temp_dir("ringmux-acme");
    let state = dir.path().join("acme");
    std::fs::create_dir(&state).unwrap();
    std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o755)).unwrap();
    let settings = AcmeSettings {
        directory: "https://127.0.0.1:1/dir".into(),
        email: None,
        state: state.clone(),
        challenge: ChallengeKind::TlsAlpn01,
        ca_roots: Vec::new(),
        ca_roots_file: None,
        eab: None,
        key_file: None,
    };
    let e = format!(
        "{:#}",
        Acme::start(settings.clone(), Vec::new()).err().unwrap()
    );
    assert!(
        e.contains(&state.display().to_string()) && e.contains("chmod 700"),
        "{e}"
    );
    for bad in ["http://ca.test/dir", "https:///dir", "https://ca.test/a b"] {
        let e = Acme::start(
            AcmeSettings {
                directory: bad.into(),
                ..settings.clone()
            },
            Vec::new(),
        )
        .err()
        .unwrap()
        .to_string();
        assert!(e.contains("https://"), "{bad}: {e}");
    }
}

#[test]
fn acme_reads_what_other_nodes_wrote_and_ignores_garbage() {
    let closed = closed_port();
    let dir = temp_dir("ringmux-acme");
    let state = dir.path().join("acme");
    let write = |path: &str, bytes: &[u8]| {
        let path = state.join(path);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, bytes).unwrap();
    };
    std::fs::create_dir_all(&state).unwrap();
    std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o700)).unwrap();
    let in_an_hour = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap()
        .as_secs()
        + 3600;
    let challenge = |token: &str, name: &str, expires: u64| {
        format!(
            r#"{{"kind":"http-01","name":"{name}","token":"{token}","key_authorization":"{token}.thumb","expires":{expires}}}"#
        )
    };
    // Another node's demux seals what it writes with the key they share (here the folder's).
    let sealer = Sealer::in_state_dir(&state).unwrap();
    let sealed = |place: &str, content: &str| sealer.seal(place, content.as_bytes());
    // Another node's pending challenge: answered here too.
    write(
        "challenges/peer-token.json",
        &sealed(
            "challenges/peer-token.json",
            &challenge("peer-token", "k.test", in_an_hour),
        ),
    );
    // Another's that outlived its order (the node died): removed.
    write(
        "challenges/stale-token.json",
        &sealed(
            "challenges/stale-token.json",
            &challenge("stale-token", "k.test", 1),
        ),
    );
    // Garbage of every kind.
    write("challenges/junk.json", b"\xff\x00{");
    write(
        "challenges/other-name.json",
        challenge("peer-token", "k.test", in_an_hour).as_bytes(),
    );
    write("challenges/..json", b"{}");
    write(
        "certs/k.test/cert.pem",
        b"-----BEGIN CERTIFICATE-----\nAAAA\n",
    );
    write("certs/k.test/key.pem", &[0u8; 100]);
    write("certs/k.test/attempt.json", b"{\"failures\":\"x\"}");
    write("account.json", b"[[[");
    std::os::unix::fs::symlink("/etc/passwd", state.join("certs/k.test/chain.pem")).unwrap();

    let settings = AcmeSettings {
        directory: format!("https://127.0.0.1:{closed}/dir"),
        email: None,
        state: state.clone(),
        challenge: ChallengeKind::Http01,
        ca_roots: vec![
            rcgen::generate_simple_self_signed(vec!["x.test".to_string()])
                .unwrap()
                .cert
                .der()
                .to_vec(),
        ],
        ca_roots_file: None,
        eab: None,
        key_file: None,
    };
    let acme = Acme::start(settings, vec![site(0, &["k.test"])]).unwrap();
    let view = acme.view();
    assert!(view.certs.is_empty());
    let tokens: Vec<&str> = view
        .challenges
        .http01
        .iter()
        .map(|h| h.token.as_str())
        .collect();
    assert_eq!(tokens, ["peer-token"]);
    assert_eq!(
        view.challenges.http01[0].key_authorization,
        "peer-token.thumb"
    );
    assert!(!state.join("challenges/stale-token.json").exists());
    // The order fails on the CA, not on the files.
    let (_, status) = wait_until(&acme, "a failed order", |_, s| s.orders_failed >= 1);
    let error = status.sites[0].last_error.clone().unwrap();
    assert!(error.contains("refused"), "{error}");

    // The peer's order ends: its challenge goes from the view within a poll or two.
    std::fs::remove_file(state.join("challenges/peer-token.json")).unwrap();
    let started = Instant::now();
    wait_until(&acme, "the peer's challenge withdrawn", |v, _| {
        v.challenges.http01.is_empty()
    });
    assert!(
        started.elapsed() < 3 * STATE_POLL_INTERVAL,
        "{:?}",
        started.elapsed()
    );
}

/// The engine trusts only what a demux sealed: files planted in the state directory (as a
/// hostile worker that could reach it would write them, by rename as the demux does) are
/// refused and counted, whatever they hold; a sealed challenge for a name no site has is never
/// answered; a certificate of an older ringmux (no seal) present at start is served once and
/// replaced by an order at once.
#[test]
fn acme_refuses_and_counts_files_no_demux_sealed() {
    let closed = closed_port();
    let dir = temp_dir("ringmux-acme");
    let state = dir.path().join("acme");
    std::fs::create_dir_all(state.join("certs/l.test")).unwrap();
    std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o700)).unwrap();
    let plant = |place: &str, bytes: &[u8]| {
        let path = state.join(place);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        let tmp = path.with_extension("planting");
        std::fs::write(&tmp, bytes).unwrap();
        std::fs::rename(&tmp, &path).unwrap();
    };
    let self_signed = |name: &str| {
        let ck = rcgen::generate_simple_self_signed(vec![name.to_string()]).unwrap();
        (ck.cert.pem(), ck.signing_key.serialize_pem())
    };
    let in_an_hour = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap()
        .as_secs()
        + 3600;
    let challenge = |token: &str, name: &str| {
        format!(
            r#"{{"kind":"http-01","name":"{name}","token":"{token}","key_authorization":"{token}.thumb","expires":{in_an_hour}}}"#
        )
    };
    // An older ringmux's certificate, there before the start.
    let (legacy_cert, legacy_key) = self_signed("l.test");
    plant("certs/l.test/key.pem", legacy_key.as_bytes());
    plant("certs/l.test/cert.pem", legacy_cert.as_bytes());

    let settings = AcmeSettings {
        directory: format!("https://127.0.0.1:{closed}/dir"),
        email: None,
        state: state.clone(),
        challenge: ChallengeKind::Http01,
        ca_roots: vec![
            rcgen::generate_simple_self_signed(vec!["x.test".to_string()])
                .unwrap()
                .cert
                .der()
                .to_vec(),
        ],
        ca_roots_file: None,
        eab: None,
        key_file: None,
    };
    let acme = Acme::start(settings, vec![site(0, &["l.test"])]).unwrap();
    // Served from the start, and ordered for at once (the CA is down: the order fails).
    let view = acme.view();
    assert_eq!(view.certs.len(), 1);
    assert_eq!(view.certs[0].2.chain_pem, legacy_cert);
    let (_, status) = wait_until(&acme, "the order replacing it", |_, s| s.orders_failed >= 1);
    assert_eq!(status.state_refused, [0; 4], "{status:#?}");

    // Planted after the start, by a worker: a certificate without a seal, and one sealed with
    // a key of its own; challenges for the site's name and another; a failure record.
    let (cert, key) = self_signed("l.test");
    plant("certs/l.test/key.pem", key.as_bytes());
    plant("certs/l.test/cert.pem", cert.as_bytes());
    let count = |f: &dyn Fn(&AcmeStatus) -> bool, what: &str| wait_until(&acme, what, |_, s| f(s));
    count(
        &|s| s.state_refused[0] >= 1,
        "the planted certificate refused",
    );
    let own = tempfile_dir_with_key();
    let forger = Sealer::in_state_dir(own.path()).unwrap();
    let (cert, key) = self_signed("l.test");
    plant(
        "certs/l.test/key.pem",
        &forger.seal("certs/l.test/key.pem", key.as_bytes()),
    );
    plant(
        "certs/l.test/cert.pem",
        &forger.seal("certs/l.test/cert.pem", cert.as_bytes()),
    );
    count(
        &|s| s.state_refused[0] >= 2,
        "the forged certificate refused",
    );
    plant(
        "challenges/plain-token.json",
        challenge("plain-token", "l.test").as_bytes(),
    );
    plant(
        "challenges/forged-token.json",
        &forger.seal(
            "challenges/forged-token.json",
            challenge("forged-token", "l.test").as_bytes(),
        ),
    );
    count(
        &|s| s.state_refused[1] >= 2,
        "the planted challenges refused",
    );
    plant(
        "certs/l.test/attempt.json",
        br#"{"failures":30,"retry_at":99999999999,"error":"planted"}"#,
    );
    count(
        &|s| s.state_refused[2] >= 1,
        "the planted failure record refused",
    );
    // A challenge sealed by a demux (another node's, sharing the key) for a name no site of
    // this node has: read, never answered.
    let ours = Sealer::in_state_dir(&state).unwrap();
    plant(
        "challenges/evil-token.json",
        &ours.seal(
            "challenges/evil-token.json",
            challenge("evil-token", "evil.test").as_bytes(),
        ),
    );
    let (view, status) = count(&|s| s.foreign_challenges >= 1, "the foreign challenge seen");
    assert!(view.challenges.http01.is_empty(), "{:?}", view.challenges);
    assert!(view.challenges.tls_alpn01.is_empty());
    // Still the first certificate; the planted record did not set the back-off.
    assert_eq!(view.certs[0].2.chain_pem, legacy_cert);
    assert!(
        status.sites[0].last_error.as_deref() != Some("planted"),
        "{status:#?}"
    );
    // And for a while after: nothing planted is ever answered or served.
    watch(&acme, 3 * STATE_POLL_INTERVAL, |v, _| {
        assert!(v.challenges.http01.is_empty());
        assert_eq!(v.certs[0].2.chain_pem, legacy_cert);
    });
}

/// A folder of the test's own, closed, for a key that is not the state directory's.
fn tempfile_dir_with_key() -> ringmux_testkit::TempDir {
    let dir = temp_dir("ringmux-acme-forger");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
    dir
}

#[test]
fn acme_a_failed_challenge_counts_and_shows_the_cas_error() {
    // Pebble validates HTTP-01 on a port where nothing listens.
    let (http_port, tls_port) = (closed_port(), closed_port());
    let Some(pebble) = Pebble::start(http_port, tls_port) else {
        return;
    };
    let dir = temp_dir("ringmux-acme");
    let state = dir.path().join("acme");
    let acme = Acme::start(
        settings(&state, &pebble, ChallengeKind::Http01),
        vec![site(0, &["f.test"])],
    )
    .unwrap();
    let started = Instant::now();
    let (view, status) = wait_until(&acme, "a failed order", |_, s| s.orders_failed >= 1);
    eprintln!("failed validation reported after {:.2?}", started.elapsed());
    assert_eq!(status.orders_issued, 0);
    assert!(view.certs.is_empty());
    let error = status.sites[0].last_error.clone().expect("an error");
    // Pebble's own words: the name, the problem type of RFC 8555 §6.7.
    assert!(
        error.contains("f.test") && error.contains("urn:ietf:params:acme:error:"),
        "{error}\n{}",
        pebble.log()
    );
    assert!(status.sites[0].next_attempt.is_some());
    // Its challenge is withdrawn.
    wait_until(&acme, "no challenge", |v, _| {
        v.challenges == ChallengeSet::default()
    });
    assert_eq!(files(&state.join("challenges")), Vec::<String>::new());
}

#[test]
fn acme_two_engines_sharing_a_state_dir_order_once_and_serve_the_same_certificate() {
    let responder = Responder::start();
    // Every order validates (no reuse of an authorization by chance).
    let Some(pebble) = Pebble::start_with(PebbleConfig {
        authz_reuse: 0,
        ..PebbleConfig::new(responder.http_port, responder.tls_port)
    }) else {
        return;
    };
    let dir = temp_dir("ringmux-acme");
    let state = dir.path().join("acme");
    let sites = vec![site(0, &["g.test", "www.g.test"])];
    let a = Acme::start(
        settings(&state, &pebble, ChallengeKind::Http01),
        sites.clone(),
    )
    .unwrap();
    // A orders first: it holds the lock once its challenges are out. Nothing answers them yet.
    wait_for(&[&a], &[], &responder, &pebble, "A's challenges", |v, _| {
        v[0].challenges.http01.len() == 2
    });
    // B, started now, has them in its first view, read from the directory; only B's view is
    // answered from, so the validation passes through B.
    let b = Acme::start(
        settings(&state, &pebble, ChallengeKind::Http01),
        sites.clone(),
    )
    .unwrap();
    assert_eq!(b.view().challenges.http01.len(), 2);
    let (views, status) = wait_for(
        &[&a, &b],
        &[1],
        &responder,
        &pebble,
        "both served",
        |v, _| v.iter().all(|v| !v.certs.is_empty()),
    );
    assert_eq!((status[0].orders_issued, status[0].orders_failed), (1, 0));
    assert_eq!((status[1].orders_issued, status[1].orders_failed), (0, 0));
    assert_eq!(views[0].certs[0].2, views[1].certs[0].2);
    assert!(responder.http_hits() >= 2);
    verify(
        &views[1].certs[0].2,
        &pebble.issuer_root_pem(),
        &sites[0].names,
    );
    // And neither orders again.
    watch(&b, 3 * STATE_POLL_INTERVAL, |_, s| {
        assert_eq!((s.orders_issued, s.orders_failed), (0, 0));
    });
    assert_eq!(a.status().orders_issued, 1);
}

#[test]
fn acme_a_ca_answering_nonsense_fails_orders_and_the_engine_lives_on() {
    let ca = FakeCa::start();
    let dir = temp_dir("ringmux-acme");
    let settings = AcmeSettings {
        directory: format!("https://127.0.0.1:{}/dir", ca.port),
        email: None,
        state: dir.path().join("acme"),
        challenge: ChallengeKind::Http01,
        ca_roots: vec![ca.root_der.clone()],
        ca_roots_file: None,
        eab: None,
        key_file: None,
    };
    let base = |port: u16| format!("https://127.0.0.1:{port}");
    let directory = |nonce: &str| {
        format!(
            r#"{{"newNonce":"{nonce}","newAccount":"{b}/acct","newOrder":"{b}/order","revokeCert":"{b}/revoke","keyChange":"{b}/key"}}"#,
            b = base(ca.port)
        )
    };
    // Each answer of the directory, and what the order's error must say.
    let cases: Vec<(String, &str)> = vec![
        (
            // Unavailable, asking for a retry later than the clock can hold.
            "HTTP/1.1 503 Service Unavailable\r\nRetry-After: 18446744073709551615\r\n\
             Content-Length: 0\r\n\r\n"
                .into(),
            "JSON",
        ),
        (ok("not json"), "JSON"),
        (ok(&"[".repeat(100_000)), "JSON"),
        (
            ok(&directory("https://127.0.0.1/no nonce")),
            "newNonce is not a URL",
        ),
        (ok(&directory(&format!("{}/nonce", base(ca.port)))), "nonce"),
        (
            // More than an answer may hold.
            format!(
                "HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n{}",
                2 << 20,
                " ".repeat(2 << 20)
            ),
            "reading the answer",
        ),
    ];
    let acme = Acme::start(settings, vec![site(0, &["j.test"])]).unwrap();
    for (n, (answer, says)) in cases.into_iter().enumerate() {
        ca.answer("/dir", &answer);
        ca.answer("/nonce", &ok(""));
        let ticket = acme.renew(None).unwrap();
        wait_until(&acme, "the order's end", |_, _| {
            acme.renewed(ticket).is_some()
        });
        let e = acme.renewed(ticket).unwrap().unwrap_err().to_string();
        assert!(e.contains(says), "case {n}: {e:?} does not say {says:?}");
        let status = acme.status();
        assert_eq!(status.orders_failed, n as u64 + 1, "{status:#?}");
        // The absurd Retry-After was not taken: the back-off is all.
        let next = status.sites[0].next_attempt.expect("a next attempt");
        let limit = SystemTime::now() + Duration::from_secs(60 << n.min(20));
        assert!(next <= limit, "case {n}: {next:?}");
    }
    assert!(acme.view().certs.is_empty());
}

// ---------------------------------------------------------------------------------------------
// What the tests share
// ---------------------------------------------------------------------------------------------

fn site(index: usize, names: &[&str]) -> AcmeSite {
    AcmeSite {
        site: index,
        label: names[0].to_string(),
        names: names.iter().map(|n| n.to_string()).collect(),
    }
}

fn settings(state: &Path, pebble: &Pebble, challenge: ChallengeKind) -> AcmeSettings {
    AcmeSettings {
        directory: pebble.directory_url(),
        email: Some("ops@ringmux.example".into()),
        state: state.to_owned(),
        challenge,
        ca_roots: vec![pebble.api_root_der()],
        ca_roots_file: None,
        eab: None,
        key_file: None,
    }
}

/// Waits on the engines' eventfds until `done` holds of their views and statuses, feeding the
/// responder the challenges of the engines at `feed` (as a supervisor feeds its workers) each
/// time one wakes. Fails the test after [`LIMIT`] with the statuses and Pebble's log.
fn wait_for(
    engines: &[&Acme],
    feed: &[usize],
    responder: &Responder,
    pebble: &Pebble,
    what: &str,
    mut done: impl FnMut(&[AcmeView], &[AcmeStatus]) -> bool,
) -> (Vec<AcmeView>, Vec<AcmeStatus>) {
    let deadline = Instant::now() + LIMIT;
    loop {
        let views: Vec<AcmeView> = engines.iter().map(|e| e.view()).collect();
        let mut answers = ChallengeSet::default();
        for &i in feed {
            answers
                .http01
                .extend(views[i].challenges.http01.iter().cloned());
            answers
                .tls_alpn01
                .extend(views[i].challenges.tls_alpn01.iter().cloned());
        }
        responder.answer(answers);
        let statuses: Vec<AcmeStatus> = engines.iter().map(|e| e.status()).collect();
        if done(&views, &statuses) {
            return (views, statuses);
        }
        let left = deadline.saturating_duration_since(Instant::now());
        assert!(
            !left.is_zero(),
            "{what}: not within {LIMIT:?}\nstatus: {statuses:#?}\n{}",
            pebble.log()
        );
        let fds: Vec<BorrowedFd<'_>> = engines.iter().map(|e| e.wake_fd()).collect();
        ringmux_demux::sys::poll_readable(&fds, Some(left)).unwrap();
    }
}

/// [`wait_for`] for one engine, without a CA to show or challenges to answer.
fn wait_until(
    acme: &Acme,
    what: &str,
    mut done: impl FnMut(&AcmeView, &AcmeStatus) -> bool,
) -> (AcmeView, AcmeStatus) {
    let deadline = Instant::now() + LIMIT;
    loop {
        let view = acme.view();
        let status = acme.status();
        if done(&view, &status) {
            return (view, status);
        }
        let left = deadline.saturating_duration_since(Instant::now());
        assert!(!left.is_zero(), "{what}: not within {LIMIT:?}\n{status:#?}");
        ringmux_demux::sys::wait_readable(acme.wake_fd(), left).unwrap();
    }
}

/// Checks `each` of the engine's view and status at every change for `period`.
fn watch(acme: &Acme, period: Duration, mut each: impl FnMut(&AcmeView, &AcmeStatus)) {
    let end = Instant::now() + period;
    loop {
        each(&acme.view(), &acme.status());
        let left = end.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return;
        }
        ringmux_demux::sys::wait_readable(acme.wake_fd(), left).unwrap();
    }
}

/// The chain verifies against Pebble's issuing root for each of `names` (webpki, as a client
/// would), and not for a name it was not issued for.
fn verify(issued: &Issued, issuer_root_pem: &str, names: &[String]) {
    let root = CertificateDer::from_pem_slice(issuer_root_pem.as_bytes()).unwrap();
    let mut roots = rustls::RootCertStore::empty();
    roots.add(root).unwrap();
    let verifier = rustls::client::WebPkiServerVerifier::builder_with_provider(
        Arc::new(roots),
        Arc::new(rustls::crypto::ring::default_provider()),
    )
    .build()
    .unwrap();
    let (chain, _) = ringmux_proto::certs::parse_pem(&issued.chain_pem, &issued.key_pem).unwrap();
    assert!(chain.len() >= 2, "leaf and intermediate");
    let check = |name: &str| {
        verifier.verify_server_cert(
            &chain[0],
            &chain[1..],
            &ServerName::try_from(name.to_string()).unwrap(),
            &[],
            UnixTime::now(),
        )
    };
    for name in names {
        check(name).unwrap_or_else(|e| panic!("{name}: {e}"));
    }
    assert!(check("not-issued.test").is_err());
}

/// The names in a folder.
fn files(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// A loopback port nothing listens on (bound, then closed).
fn closed_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Answers ACME challenges as a worker does: HTTP-01 on a plain TCP port, TLS-ALPN-01 on a
/// TLS port offering only `acme-tls/1`, from the set last given to [`Responder::answer`].
struct Responder {
    http_port: u16,
    tls_port: u16,
    answers: Arc<Mutex<ChallengeSet>>,
    http_hits: Arc<AtomicUsize>,
    tls_hits: Arc<AtomicUsize>,
    _runtime: tokio::runtime::Runtime,
}

impl Responder {
    fn start() -> Responder {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let answers = Arc::new(Mutex::new(ChallengeSet::default()));
        let http_hits = Arc::new(AtomicUsize::new(0));
        let tls_hits = Arc::new(AtomicUsize::new(0));
        let (http, tls) = runtime.block_on(async {
            (
                tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap(),
                tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap(),
            )
        });
        let http_port = http.local_addr().unwrap().port();
        let tls_port = tls.local_addr().unwrap().port();
        runtime.spawn(serve_http01(http, answers.clone(), http_hits.clone()));
        runtime.spawn(serve_tls_alpn01(tls, answers.clone(), tls_hits.clone()));
        Responder {
            http_port,
            tls_port,
            answers,
            http_hits,
            tls_hits,
            _runtime: runtime,
        }
    }

    fn answer(&self, set: ChallengeSet) {
        *self.answers.lock().unwrap() = set;
    }

    /// Validation requests answered with a key authorization.
    fn http_hits(&self) -> usize {
        self.http_hits.load(Ordering::Relaxed)
    }

    /// TLS-ALPN-01 handshakes completed with a challenge certificate.
    fn tls_hits(&self) -> usize {
        self.tls_hits.load(Ordering::Relaxed)
    }
}

async fn serve_http01(
    listener: tokio::net::TcpListener,
    answers: Arc<Mutex<ChallengeSet>>,
    hits: Arc<AtomicUsize>,
) {
    while let Ok((mut conn, _)) = listener.accept().await {
        let answers = answers.clone();
        let hits = hits.clone();
        tokio::spawn(async move {
            let mut head = Vec::new();
            let mut buf = [0u8; 1024];
            while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 16 * 1024 {
                match conn.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => head.extend_from_slice(&buf[..n]),
                }
            }
            let head = String::from_utf8_lossy(&head);
            let path = head.split_whitespace().nth(1).unwrap_or("");
            let answer = path
                .strip_prefix("/.well-known/acme-challenge/")
                .and_then(|token| {
                    let set = answers.lock().unwrap();
                    set.http01
                        .iter()
                        .find(|h| h.token == token)
                        .map(|h| h.key_authorization.clone())
                });
            let response = match answer {
                Some(ka) => {
                    hits.fetch_add(1, Ordering::Relaxed);
                    format!(
                        "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {}\r\n\
                         Connection: close\r\n\r\n{ka}",
                        ka.len()
                    )
                }
                None => "HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                    .to_string(),
            };
            let _ = conn.write_all(response.as_bytes()).await;
            let _ = conn.shutdown().await;
        });
    }
}

async fn serve_tls_alpn01(
    listener: tokio::net::TcpListener,
    answers: Arc<Mutex<ChallengeSet>>,
    hits: Arc<AtomicUsize>,
) {
    let mut config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_no_client_auth()
    .with_cert_resolver(Arc::new(ChallengeCerts(answers)));
    config.alpn_protocols = vec![ringmux_proto::message::ACME_TLS_ALPN.to_vec()];
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    while let Ok((conn, _)) = listener.accept().await {
        let acceptor = acceptor.clone();
        let hits = hits.clone();
        tokio::spawn(async move {
            // The handshake is the answer (RFC 8737 §3); no data follows.
            match acceptor.accept(conn).await {
                Ok(_) => {
                    hits.fetch_add(1, Ordering::Relaxed);
                }
                Err(e) => eprintln!("the TLS-ALPN-01 responder's handshake failed: {e}"),
            }
        });
    }
}

/// Picks the TLS-ALPN-01 certificate by SNI.
#[derive(Debug)]
struct ChallengeCerts(Arc<Mutex<ChallengeSet>>);

impl rustls::server::ResolvesServerCert for ChallengeCerts {
    fn resolve(
        &self,
        hello: rustls::server::ClientHello<'_>,
    ) -> Option<Arc<rustls::sign::CertifiedKey>> {
        let name = hello.server_name()?.to_ascii_lowercase();
        let set = self.0.lock().unwrap();
        let t = set.tls_alpn01.iter().find(|t| t.name == name)?;
        let (chain, key) = ringmux_proto::certs::parse_pem(&t.cert_pem, &t.key_pem).ok()?;
        // Not `CertifiedKey::from_der`: its check that key and certificate match parses the
        // certificate with webpki, which refuses the critical acmeIdentifier extension it does
        // not know (UnsupportedCriticalExtension). A worker must build it this way too.
        let key = rustls::crypto::ring::default_provider()
            .key_provider
            .load_private_key(key)
            .ok()?;
        Some(Arc::new(rustls::sign::CertifiedKey::new(chain, key)))
    }
}

/// A raw HTTP/1.1 200 with `body`.
fn ok(body: &str) -> String {
    format!(
        "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
}

/// An HTTPS server on 127.0.0.1 answering each path with the raw response last set for it
/// (404 otherwise), then closing: a CA that says whatever the test wants.
struct FakeCa {
    port: u16,
    root_der: Vec<u8>,
    answers: Arc<Mutex<std::collections::HashMap<String, String>>>,
    _runtime: tokio::runtime::Runtime,
}

impl FakeCa {
    fn start() -> FakeCa {
        let made = rcgen::generate_simple_self_signed(vec!["127.0.0.1".to_string()]).unwrap();
        let root_der = made.cert.der().to_vec();
        let key =
            rustls::pki_types::PrivateKeyDer::try_from(made.signing_key.serialize_der()).unwrap();
        let config = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(vec![made.cert.der().clone()], key)
        .unwrap();
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let listener = runtime
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .unwrap();
        let port = listener.local_addr().unwrap().port();
        let answers = Arc::new(Mutex::new(
            std::collections::HashMap::<String, String>::new(),
        ));
        let table = answers.clone();
        runtime.spawn(async move {
            while let Ok((conn, _)) = listener.accept().await {
                let (acceptor, table) = (acceptor.clone(), table.clone());
                tokio::spawn(async move {
                    let Ok(mut tls) = acceptor.accept(conn).await else {
                        return;
                    };
                    let mut head = Vec::new();
                    let mut buf = [0u8; 4096];
                    while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 1 << 16 {
                        match tls.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => head.extend_from_slice(&buf[..n]),
                        }
                    }
                    let text = String::from_utf8_lossy(&head).into_owned();
                    let path = text.split_whitespace().nth(1).unwrap_or("").to_string();
                    let answer = table
                        .lock()
                        .unwrap()
                        .get(&path)
                        .cloned()
                        .unwrap_or_else(|| {
                            "HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n".into()
                        });
                    let answer = answer.replacen("\r\n", "\r\nConnection: close\r\n", 1);
                    let _ = tls.write_all(answer.as_bytes()).await;
                    let _ = tls.shutdown().await;
                });
            }
        });
        FakeCa {
            port,
            root_der,
            answers,
            _runtime: runtime,
        }
    }

    fn answer(&self, path: &str, raw: &str) {
        self.answers
            .lock()
            .unwrap()
            .insert(path.to_string(), raw.to_string());
    }
}
