//! The aioquic HTTP/3 client of the tests: `aioquic_client.py`, beside this crate's
//! Cargo.toml, run by python3 (installed: [`crate::tool::AIOQUIC`]). Its usage is in its
//! docstring; whatever the scenario, its last line on stdout is one JSON object,
//! `{"ok": bool, "error": str|null, "scenario": str, "bodies": [...], ...}`.

use std::path::{Path, PathBuf};

pub use serde_json::Value as Json;

/// Where the script is.
pub fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("aioquic_client.py")
}

/// The script's JSON result: the last line of its `stdout`. `None` if there is none or it is
/// not a JSON object.
pub fn result(stdout: &str) -> Option<Json> {
    let json: Json = serde_json::from_str(stdout.lines().last()?).ok()?;
    json.is_object().then_some(json)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_script_is_where_its_path_says() {
        assert!(script().is_file(), "{}", script().display());
    }

    #[test]
    fn the_result_is_the_last_line() {
        let out = "noise\n{\"ok\": true, \"bodies\": [\"/a 200 1 00\"]}\n";
        let json = result(out).expect("a result");
        assert_eq!(json["ok"], Json::Bool(true));
        assert_eq!(json["bodies"][0], "/a 200 1 00");
        assert_eq!(result("{\"ok\": true}\nnot json\n"), None);
        assert_eq!(result(""), None);
        assert_eq!(result("[1]"), None);
    }
}
