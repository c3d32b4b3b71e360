//! control-protocol.md is normative: parse its tables and compare them with what the code
//! writes and accepts. A field, message, key or limit added on one side only fails here.

use ringmux_proto::handoff::{IngressKind, KEYS};
use ringmux_proto::message::{SITE_COLUMNS, STATS_KEYS, WORDS};
use ringmux_proto::series::{
    Series, MAX_LABELS, MAX_LABEL_KEY_LEN, MAX_LABEL_VALUE_LEN, MAX_NAME_LEN, MAX_SERIES,
};
use ringmux_proto::session::{
    Op, MAX_KEY_LEN, MAX_VALUE_LEN, REPLY_HEADER_LEN, REQUEST_HEADER_LEN,
};
use ringmux_proto::{
    CUT_WAIT, MAX_FDS, MAX_MESSAGE, MAX_SITE_TABLE, MAX_STATS, PROTOCOL_VERSION, STOPPED_WAIT,
};

fn doc() -> String {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../control-protocol.md");
    std::fs::read_to_string(path).expect("read control-protocol.md")
}

/// The rows of the tables under the `## heading` section: cells with backticks removed, the
/// header and separator rows skipped.
fn rows(heading: &str) -> Vec<Vec<String>> {
    let text = doc();
    let mut inside = false;
    let mut out = Vec::new();
    for line in text.lines() {
        if let Some(h) = line.strip_prefix("## ") {
            inside = h.trim() == heading;
            continue;
        }
        if !inside || !line.starts_with('|') {
            continue;
        }
        let cells: Vec<String> = line
            .trim_matches('|')
            .split('|')
            .map(|c| c.trim().replace('`', ""))
            .collect();
        let header = matches!(
            cells[0].as_str(),
            "key" | "message" | "op" | "limit" | "descriptor" | "series"
        );
        if header || cells[0].starts_with("---") {
            continue;
        }
        out.push(cells);
    }
    assert!(!out.is_empty(), "no table rows under '## {heading}'");
    out
}

fn first_column(heading: &str) -> Vec<String> {
    rows(heading).into_iter().map(|r| r[0].clone()).collect()
}

#[test]
fn the_version_is_the_documented_one() {
    let text = doc();
    let line = text
        .lines()
        .find_map(|l| l.strip_prefix("Protocol version: "))
        .expect("a 'Protocol version: ' line");
    assert_eq!(line.trim_matches('*'), PROTOCOL_VERSION.to_string());
}

#[test]
fn handoff_fields_match() {
    assert_eq!(first_column("Hand-off fields"), KEYS);
}

#[test]
fn descriptor_table_matches_the_counts() {
    let rows = rows("Descriptors");
    for (column, kind) in [
        (1, IngressKind::Shm),
        (2, IngressKind::Unix),
        (3, IngressKind::Reuseport),
    ] {
        let listed = rows.iter().filter(|r| !r[column].is_empty()).count();
        assert_eq!(listed, kind.fd_count() + 2, "{kind:?}");
        for (i, row) in rows.iter().enumerate() {
            let number = ringmux_proto::FIRST_HANDOFF_FD + i as i32;
            assert_eq!(
                row[0],
                number.to_string(),
                "descriptor numbers from FIRST_HANDOFF_FD"
            );
        }
        let last = rows.iter().rfind(|r| !r[column].is_empty()).unwrap();
        assert_eq!(last[column], "site table", "{kind:?}");
        assert!(rows.iter().all(|r| !r[column].contains("public")));
    }
}

#[test]
fn messages_match() {
    assert_eq!(first_column("Control messages"), WORDS);
    assert_eq!(first_column("STATS keys"), STATS_KEYS);
    let by_site: Vec<String> = SITE_COLUMNS
        .iter()
        .map(|c| format!("site<index>_{c}"))
        .collect();
    assert_eq!(first_column("STATS keys by site"), by_site);
}

/// The example the section gives holds: 1 000 sites and their row of no site, every column at
/// 10⁹, fit one report.
#[test]
fn a_thousand_sites_fit_one_report() {
    let mut r = ringmux_proto::WorkerReport::default();
    for site in 0..=1000 {
        r.sites.insert(site, [1_000_000_000; SITE_COLUMNS.len()]);
    }
    let (text, next) = r.encode_rotating(0);
    assert_eq!(next, 0, "every row fits");
    assert!(
        text.len() <= MAX_STATS && text.len() < 145_000,
        "{}",
        text.len()
    );
}

/// The limits of "STATS series" are the code's, and each series the built-in server's table
/// names is one the rules accept, written as the section says.
#[test]
fn series_limits_and_examples_match() {
    let rows = rows("STATS series");
    let limits: Vec<(String, String)> = rows
        .iter()
        .filter(|r| r[0].starts_with("MAX_"))
        .map(|r| (r[0].clone(), r[1].clone()))
        .collect();
    let code = [
        ("MAX_SERIES", MAX_SERIES),
        ("MAX_NAME_LEN", MAX_NAME_LEN),
        ("MAX_LABELS", MAX_LABELS),
        ("MAX_LABEL_KEY_LEN", MAX_LABEL_KEY_LEN),
        ("MAX_LABEL_VALUE_LEN", MAX_LABEL_VALUE_LEN),
    ]
    .map(|(k, v)| (k.to_string(), v.to_string()));
    assert_eq!(limits, code);
    let examples: Vec<&str> = rows
        .iter()
        .filter(|r| !r[0].starts_with("MAX_"))
        .map(|r| r[0].split(',').next().unwrap())
        .collect();
    assert_eq!(examples.len(), 16, "{examples:?}");
    for key in examples {
        let key = key.replace("…", "x");
        let parsed = Series::parse_key(&key).unwrap_or_else(|| panic!("{key}: not a series"));
        assert_eq!(parsed.map(|s| s.to_string()), Ok(key.clone()));
    }
}

#[test]
fn session_ops_and_limits_match() {
    let rows = rows("Session store");
    let ops: Vec<(String, String)> = rows
        .iter()
        .filter(|r| r.len() == 3)
        .map(|r| (r[0].clone(), r[1].clone()))
        .collect();
    let expected: Vec<(String, String)> = Op::ALL
        .iter()
        .map(|op| (op.name().to_string(), (*op as u8).to_string()))
        .collect();
    assert_eq!(ops, expected);
    let limits: Vec<(String, String)> = rows
        .iter()
        .filter(|r| r.len() == 2)
        .map(|r| (r[0].clone(), r[1].clone()))
        .collect();
    let code = [
        ("MAX_KEY_LEN", MAX_KEY_LEN),
        ("MAX_VALUE_LEN", MAX_VALUE_LEN),
        ("REQUEST_HEADER_LEN", REQUEST_HEADER_LEN),
        ("REPLY_HEADER_LEN", REPLY_HEADER_LEN),
    ]
    .map(|(k, v)| (k.to_string(), v.to_string()));
    assert_eq!(limits, code);
}

#[test]
fn message_limits_match() {
    let limits: Vec<(String, String)> = rows("Limits")
        .into_iter()
        .map(|r| (r[0].clone(), r[1].clone()))
        .collect();
    assert_eq!(
        limits,
        [
            ("MAX_MESSAGE", MAX_MESSAGE.to_string()),
            ("MAX_STATS", MAX_STATS.to_string()),
            ("MAX_FDS", MAX_FDS.to_string()),
            ("MAX_SITE_TABLE", MAX_SITE_TABLE.to_string()),
            ("STOPPED_WAIT", format!("{} s", STOPPED_WAIT.as_secs())),
            ("CUT_WAIT", format!("{} s", CUT_WAIT.as_secs())),
        ]
        .map(|(k, v)| (k.to_string(), v))
    );
}
