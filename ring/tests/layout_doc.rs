//! shm-layout.md is normative: parse its three field tables and compare them, row by row, with
//! the offsets and sizes the code computes (`ringmux_ring::layout::FIELDS`).

use ringmux_ring::layout::{FieldInfo, FIELDS};

fn doc_fields() -> Vec<FieldInfo> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../shm-layout.md");
    let text = std::fs::read_to_string(path).expect("read shm-layout.md");
    let mut region = None;
    let mut out = Vec::new();
    for line in text.lines() {
        if let Some(h) = line.strip_prefix("## ") {
            region = match h.trim() {
                "Producer region" => Some("producer"),
                "Consumer page" => Some("consumer"),
                "Slot descriptor" => Some("slot"),
                _ => None,
            };
            continue;
        }
        let Some(region) = region else { continue };
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        if cells.len() < 6 {
            continue;
        }
        let (Ok(offset), Ok(size)) = (cells[1].parse::<usize>(), cells[2].parse::<usize>()) else {
            continue;
        };
        // The field name may leak a static lifetime: tests only.
        let field: &'static str = Box::leak(cells[4].to_string().into_boxed_str());
        out.push(FieldInfo {
            region,
            field,
            offset,
            size,
        });
    }
    out
}

#[test]
fn document_and_code_agree() {
    let doc = doc_fields();
    assert!(
        doc.len() >= 30,
        "parsed only {} rows from shm-layout.md",
        doc.len()
    );
    for f in FIELDS {
        assert!(
            doc.contains(f),
            "code field {f:?} is missing or different in shm-layout.md"
        );
    }
    for d in &doc {
        assert!(
            FIELDS.contains(d),
            "shm-layout.md row {d:?} does not match the code"
        );
    }
}

#[test]
fn rows_tile_each_line_without_gaps() {
    for region in ["producer", "consumer", "slot"] {
        let mut rows: Vec<_> = FIELDS.iter().filter(|f| f.region == region).collect();
        rows.sort_by_key(|f| f.offset);
        for w in rows.windows(2) {
            assert_eq!(
                w[0].offset + w[0].size,
                w[1].offset,
                "gap or overlap after {:?}",
                w[0]
            );
        }
    }
}
