//! Several sites end to end: ringmux started with a configuration file of two `[[site]]`s
//! (certificates made by the test), HTTP/3 requests to each and one for another site's name on
//! a connection of the first (421), then the responses by site as the demux exposes them
//! (`ringmux_worker_site_responses_total`, `ringmux_worker_site_misdirected_total`) and as
//! `ringmux stats` shows them.

use ringmux_systests::harness;

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::Duration;

use harness::{binary, bounded, Forward, Ringmux};
use http::StatusCode;
use ringmux_demux::metrics::{names, Scrape};

const LIMIT: Duration = Duration::from_secs(60);

/// A self-signed certificate for `name` and its key, written beside `config` as `NAME.pem`
/// and `NAME.key`, readable by others (the demux reads them; as root its workers run as
/// nobody, though they never open these). Returns the two paths.
fn certificate(dir: &Path, name: &str) -> (String, String) {
    let made = rcgen::generate_simple_self_signed(vec![name.to_string()])
        .unwrap_or_else(|e| panic!("a certificate for {name}: {e}"));
    let (cert, key) = (
        dir.join(format!("{name}.pem")),
        dir.join(format!("{name}.key")),
    );
    for (path, text) in [
        (&cert, made.cert.pem()),
        (&key, made.signing_key.serialize_pem()),
    ] {
        std::fs::write(path, text).unwrap_or_else(|e| panic!("writing {path:?}: {e}"));
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o644)).unwrap();
    }
    (cert.display().to_string(), key.display().to_string())
}

/// Two sites, `a.test` and `b.test`, each answering `/` with 200 and its name; `b.test` also
/// `/gone` with 410.
fn two_sites(dir: &Path) -> String {
    let (a_cert, a_key) = certificate(dir, "a.test");
    let (b_cert, b_key) = certificate(dir, "b.test");
    let config = dir.join("ringmux.toml");
    let text = format!(
        r#"listen = "127.0.0.1:0"
instances = 1

[[site]]
names = ["a.test"]
cert = "{a_cert}"
key = "{a_key}"
[[site.route]]
path = "/"
respond = {{ status = 200, body = "a\n" }}

[[site]]
names = ["b.test"]
cert = "{b_cert}"
key = "{b_key}"
[[site.route]]
path = "/"
respond = {{ status = 200, body = "b\n" }}
[[site.route]]
path = "/gone"
respond = {{ status = 410, body = "gone\n" }}
"#
    );
    std::fs::write(&config, text).unwrap();
    config.display().to_string()
}

/// The sample of `name` with exactly these labels, in the exposition's order.
fn sample(m: &Scrape, name: &str, labels: &[(&str, &str)]) -> f64 {
    let labels: Vec<String> = labels.iter().map(|(k, v)| format!("{k}=\"{v}\"")).collect();
    m.get(&format!("{name}{{{}}}", labels.join(",")))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_are_counted_by_site() {
    let dir = ringmux_testkit::temp_dir("ringmux-sites");
    let config = two_sites(dir.path());
    let rm = Ringmux::start(1, Forward::Shm, &["--config", &config]);
    bounded(LIMIT, async {
        let client = rm.client();
        let a = client
            .connect(rm.listen, "a.test")
            .await
            .expect("connecting as a.test");
        for _ in 0..3 {
            let r = a.get_body("/").await.expect("GET a.test/");
            assert_eq!(
                (r.status, r.body.as_deref()),
                (StatusCode::OK, Some(&b"a\n"[..]))
            );
        }
        // b.test's name on a.test's connection (and certificate): misdirected.
        let elsewhere = "https://b.test/".parse().unwrap();
        let (status, _) = a.get_len(&elsewhere).await.expect("GET b.test/ on a.test");
        assert_eq!(status, StatusCode::MISDIRECTED_REQUEST);
        let b = client
            .connect(rm.listen, "b.test")
            .await
            .expect("connecting as b.test");
        let r = b.get_body("/").await.expect("GET b.test/");
        assert_eq!(
            (r.status, r.body.as_deref()),
            (StatusCode::OK, Some(&b"b\n"[..]))
        );
        let r = b.get_body("/gone").await.expect("GET b.test/gone");
        assert_eq!(r.status, StatusCode::GONE);

        let responses = names::WORKER_SITE_RESPONSES;
        let of = |m: &Scrape, site: &str, class: &str| {
            sample(
                m,
                responses,
                &[("instance", "0"), ("site", site), ("class", class)],
            )
        };
        // Workers report about once a second.
        let m = rm
            .wait_for("six responses by site", Duration::from_secs(10), |m| {
                m.sum(responses) >= 6.0
            })
            .await;
        assert_eq!(m.sum(responses), 6.0, "{m}");
        // The 421 is the connection's site's: the one whose certificate it went out under.
        assert_eq!(
            (of(&m, "a.test", "2xx"), of(&m, "a.test", "4xx")),
            (3.0, 1.0),
            "{m}"
        );
        assert_eq!(
            (of(&m, "b.test", "2xx"), of(&m, "b.test", "4xx")),
            (1.0, 1.0),
            "{m}"
        );
        let misdirected = |site| {
            sample(
                &m,
                names::WORKER_SITE_MISDIRECTED,
                &[("instance", "0"), ("site", site)],
            )
        };
        assert_eq!(
            (misdirected("a.test"), misdirected("b.test")),
            (1.0, 0.0),
            "{m}"
        );
        // Every request chose a site: no row of no site.
        assert_eq!(m.sum_where(responses, "site", "-"), 0.0, "{m}");
        assert_eq!(m.sum(names::WORKER_REPORT_PARTS_DROPPED), 0.0, "{m}");

        // `ringmux stats`: a row per site that answered.
        let out = tokio::process::Command::new(binary("ringmux"))
            .args(["stats", "--metrics", &rm.metrics.to_string()])
            .kill_on_drop(true)
            .output()
            .await
            .expect("running ringmux stats");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{text}");
        let rows: Vec<Vec<&str>> = text
            .lines()
            .skip_while(|l| l.split_whitespace().next() != Some("site"))
            .take_while(|l| !l.trim().is_empty())
            .map(|l| l.split_whitespace().collect())
            .collect();
        assert_eq!(
            rows,
            [
                vec!["site", "1xx", "2xx", "3xx", "4xx", "5xx", "421"],
                vec!["a.test", "0", "3", "0", "1", "0", "1"],
                vec!["b.test", "0", "1", "0", "1", "0", "0"],
            ],
            "{text}"
        );
    })
    .await;
}
