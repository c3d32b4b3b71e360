//! The guide is held to the code, as `proto/tests/doc.rs` holds control-protocol.md: every
//! ringmux flag, `RINGMUX_*` variable and configuration key that README.md and the pages under
//! docs/ name must exist in `ringmux --help` (the help of every subcommand included) and in the
//! configuration file's declaration (`config::file`). A flag renamed or removed in the code, or a
//! made-up one in a page, fails here with the page and line.
//!
//! How a page is read, so write the pages this way:
//! - **Flags** are read from code only: inline code spans (`` `…` ``) and fenced blocks other
//!   than ```` ```rust ```` and ```` ```toml ````. A flag is a word `--name` (`--name=value`
//!   counts as `--name`) of a command. A span is one command; a block line is split into commands
//!   at `|`, `&&`, `||` and `;`, a `#` word starts a comment, and a line ending in `\` goes on
//!   on the next. Words are split as a shell does, so a quoted argument is one word: the flags
//!   inside `--worker-cmd '…'` belong to that program and are not read. A command's program is
//!   its first word after `NAME=value` assignments and `sudo`, `exec` or `env`; a command that
//!   starts with a flag is ringmux's (`--tcp on|off` in prose). The flags of `ringmux` (or any
//!   path ending in `/ringmux`) must be in its help; those of `launch.sh` before a `--` must be
//!   in `deploy/launch.sh`, those after it are ringmux's; those of any other program (cargo,
//!   curl, useradd, h3-probe, ringmux-worker, …) are not checked.
//! - **Variables** are read everywhere, prose included: every `RINGMUX_NAME` must be the
//!   `[env: …]` of an option in the help, or one of [`OTHER_VARIABLES`] (read by launch.sh, or
//!   set by ringmux for its workers), each checked against the place that reads it.
//! - **Keys**: a fenced block marked ```` ```toml ```` is a ringmux configuration (a Cargo
//!   manifest says so: ```` ```toml Cargo.toml ````), and so is a shell here-document written to
//!   a `*.toml` file (`cat > /etc/ringmux/ringmux.toml <<'EOF'`). It must parse, and each key is
//!   checked by its table: the top level against the settings (`setting_keys`, the command
//!   line's options) and `TABLE_KEYS`, `[acme]` against `ACME_KEYS`, `[[site]]` against
//!   `SITE_KEYS`, `[[site.route]]` against `route_keys()`, a route's `respond` against
//!   `respond_keys()`. An inline span that is one TOML assignment (`` `worker_read = ["/x"]` ``,
//!   `` `acme = true` ``) names a key of some table and must be one of them.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use clap::CommandFactory;
use ringmux_demux::config::file::{
    respond_keys, route_keys, setting_keys, ACME_KEYS, SITE_KEYS, TABLE_KEYS,
};
use ringmux_demux::config::Cli;

/// `RINGMUX_*` variables that are no option of ringmux, and a file that must name each (so a
/// variable dropped there fails here too).
const OTHER_VARIABLES: [(&str, &str); 2] = [
    // launch.sh finds the ringmux binary by it.
    ("RINGMUX_BIN", "deploy/launch.sh"),
    // ringmux sets it for its workers (`ringmux_proto::CONTROL_FD_ENV`).
    ("RINGMUX_CONTROL_FD", "proto/src/lib.rs"),
];

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// README.md and every Markdown file under docs/, as (path from the repository root, text).
fn pages() -> Vec<(String, String)> {
    let mut paths = vec![repo().join("README.md")];
    let mut dirs = vec![repo().join("docs")];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).expect("read docs/") {
            let path = entry.expect("a docs/ entry").path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "md") {
                paths.push(path);
            }
        }
    }
    paths.sort();
    let pages: Vec<(String, String)> = paths
        .into_iter()
        .map(|p| {
            let text = std::fs::read_to_string(&p).expect("read a page");
            let name = p.strip_prefix(repo()).unwrap_or(&p).display().to_string();
            (name, text)
        })
        .collect();
    assert!(pages.len() > 5, "README.md and the docs/ pages: {pages:?}");
    pages
}

/// What `ringmux --help` and every subcommand's help name: the `--flags` and the variables of
/// their `[env: …]`.
struct Help {
    flags: BTreeSet<String>,
    variables: BTreeSet<String>,
}

fn help() -> Help {
    let mut cmd = Cli::command();
    cmd.build();
    let mut texts = Vec::new();
    let mut todo = vec![cmd];
    while let Some(mut c) = todo.pop() {
        texts.push(c.render_long_help().to_string());
        todo.extend(c.get_subcommands().cloned().map(|mut s| {
            s.build();
            s
        }));
    }
    let mut help = Help {
        flags: BTreeSet::new(),
        variables: BTreeSet::new(),
    };
    for text in &texts {
        help.flags.extend(words(text, "--"));
        for at in text.match_indices("[env: ").map(|(i, _)| i + 6) {
            let name: String = text[at..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            help.variables.insert(name);
        }
    }
    assert!(help.flags.contains("--listen") && help.flags.contains("--vip"));
    assert!(help.variables.contains("RINGMUX_LISTEN"), "{texts:?}");
    help
}

/// The words of `text` that start with `prefix` followed by a letter or digit, cut where a
/// flag's or variable's characters end.
fn words(text: &str, prefix: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find(prefix) {
        let before = rest[..at].chars().next_back();
        let tail = &rest[at + prefix.len()..];
        let name: String = tail
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '-' || *c == '_' || *c == '.')
            .collect();
        let name = name.trim_end_matches(['.', '-', '_']).to_string();
        let starts_word = before.is_none_or(|c| !(c.is_ascii_alphanumeric() || c == '-'));
        if starts_word && name.starts_with(|c: char| c.is_ascii_alphanumeric()) {
            out.push(format!("{prefix}{name}"));
        }
        rest = &tail[name.len()..];
    }
    out
}

/// One thing a page names, with its place.
struct Named {
    page: String,
    line: usize,
    what: String,
}

/// The commands a page's code holds, each as its words with the line it starts on, and the
/// configurations it holds (```toml blocks and here-documents to `*.toml`), with theirs.
#[derive(Default)]
struct Code {
    commands: Vec<(usize, Vec<String>)>,
    configs: Vec<(usize, String)>,
    /// Inline spans, for the one-assignment TOML keys.
    spans: Vec<(usize, String)>,
}

fn code_of(text: &str) -> Code {
    let mut code = Code::default();
    let lines: Vec<&str> = text.lines().collect();
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i];
        let Some(info) = line.trim_start().strip_prefix("```") else {
            for span in line.split('`').skip(1).step_by(2) {
                code.spans.push((i + 1, span.to_string()));
                code.commands.push((i + 1, shell_words(span)));
            }
            i += 1;
            continue;
        };
        let start = i + 1;
        let mut end = start;
        while end < lines.len() && !lines[end].trim_start().starts_with("```") {
            end += 1;
        }
        let block = &lines[start..end];
        match info.trim() {
            "toml" => code.configs.push((start + 1, block.join("\n"))),
            i if i.starts_with("toml") || i == "rust" => {}
            _ => shell_block(start, block, &mut code),
        }
        i = end + 1;
    }
    code
}

/// A shell-like block: its commands, and the here-documents it writes to `*.toml` files.
fn shell_block(first: usize, block: &[&str], code: &mut Code) {
    let mut j = 0;
    while j < block.len() {
        let at = first + j + 1;
        let mut line = block[j].to_string();
        while line.ends_with('\\') && j + 1 < block.len() {
            line.pop();
            j += 1;
            line.push(' ');
            line.push_str(block[j]);
        }
        j += 1;
        if let Some((target, marker)) = here_document(&line) {
            let body: Vec<&str> = block[j..]
                .iter()
                .take_while(|l| l.trim() != marker)
                .copied()
                .collect();
            if target.ends_with(".toml") {
                code.configs.push((at + 1, body.join("\n")));
            }
            j += body.len() + 1;
        }
        let mut command = Vec::new();
        for word in shell_words(&line) {
            if word.starts_with('#') {
                break;
            }
            if ["|", "||", "&&", ";"].contains(&word.as_str()) {
                code.commands.push((at, std::mem::take(&mut command)));
            } else {
                command.push(word);
            }
        }
        code.commands.push((at, command));
    }
}

/// `cat > FILE <<'EOF'`: the file and the end marker.
fn here_document(line: &str) -> Option<(String, String)> {
    let (before, after) = line.split_once("<<")?;
    let marker = after.trim().trim_matches(['\'', '"', '-']).to_string();
    let target = before.rsplit_once('>')?.1.trim().to_string();
    Some((target, marker))
}

fn shell_words(text: &str) -> Vec<String> {
    shlex::split(text).unwrap_or_else(|| text.split_whitespace().map(String::from).collect())
}

/// The flags of `command` that belong to ringmux, and those that belong to launch.sh.
fn flags_of(command: &[String]) -> (Vec<String>, Vec<String>) {
    let mut args = command
        .iter()
        .map(|w| w.trim_start_matches('('))
        .skip_while(|w| {
            ["sudo", "exec", "env"].contains(w)
                || w.split_once('=').is_some_and(|(name, _)| {
                    !name.is_empty()
                        && name
                            .chars()
                            .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')
                })
        })
        .peekable();
    let Some(program) = args.peek().map(|w| w.to_string()) else {
        return (vec![], vec![]);
    };
    let flag = |w: &str| {
        let name = w.split('=').next().unwrap_or(w);
        (name.len() > 2 && words_flag(name)).then(|| name.to_string())
    };
    let rest: Vec<&str> = if program.starts_with("--") {
        args.collect()
    } else {
        args.skip(1).collect()
    };
    let base = program.rsplit('/').next().unwrap_or(&program);
    if program.starts_with("--") || base == "ringmux" {
        (rest.iter().filter_map(|w| flag(w)).collect(), vec![])
    } else if base == "launch.sh" {
        let split = rest.iter().position(|w| *w == "--").unwrap_or(rest.len());
        let ringmux = rest[split..].iter().filter_map(|w| flag(w)).collect();
        let launch = rest[..split].iter().filter_map(|w| flag(w)).collect();
        (ringmux, launch)
    } else {
        (vec![], vec![])
    }
}

fn words_flag(word: &str) -> bool {
    word.strip_prefix("--").is_some_and(|name| {
        name.starts_with(|c: char| c.is_ascii_lowercase())
            && name
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
    })
}

/// Every key of a configuration that is not one of its table's, as `table.key`.
fn unknown_keys(config: &toml::Table) -> Vec<String> {
    let settings = setting_keys();
    let mut bad = Vec::new();
    let mut check = |table: &toml::Table, known: &[&str], at: &str| {
        for key in table.keys() {
            if !known.contains(&key.as_str()) {
                bad.push(format!("{at}{key}"));
            }
        }
    };
    let top: Vec<&str> = settings
        .iter()
        .map(String::as_str)
        .chain(TABLE_KEYS)
        .collect();
    check(config, &top, "");
    if let Some(acme) = config.get("acme").and_then(|a| a.as_table()) {
        check(acme, &ACME_KEYS, "[acme] ");
    }
    let tables = |v: Option<&toml::Value>| -> Vec<toml::Table> {
        v.and_then(|v| v.as_array())
            .map(|a| a.iter().filter_map(|t| t.as_table().cloned()).collect())
            .unwrap_or_default()
    };
    for site in tables(config.get("site")) {
        check(&site, &SITE_KEYS, "[[site]] ");
        for route in tables(site.get("route")) {
            check(&route, route_keys(), "[[site.route]] ");
            if let Some(respond) = route.get("respond").and_then(|r| r.as_table()) {
                check(respond, respond_keys(), "respond ");
            }
        }
    }
    bad
}

/// Everything the pages name that the code does not have, and how much was checked.
fn problems() -> (Vec<String>, [usize; 3]) {
    let help = help();
    let launch = std::fs::read_to_string(repo().join("deploy/launch.sh")).expect("launch.sh");
    let settings = setting_keys();
    let all_keys: BTreeSet<&str> = settings
        .iter()
        .map(String::as_str)
        .chain(TABLE_KEYS)
        .chain(SITE_KEYS)
        .chain(ACME_KEYS)
        .chain(route_keys().iter().copied())
        .chain(respond_keys().iter().copied())
        .collect();
    let mut problems = Vec::new();
    let mut checked = [0; 3];
    for (page, text) in pages() {
        let code = code_of(&text);
        let mut flags = Vec::new();
        for (line, command) in &code.commands {
            let (ringmux, launch_sh) = flags_of(command);
            flags.extend(ringmux.into_iter().map(|what| Named {
                page: page.clone(),
                line: *line,
                what,
            }));
            for f in launch_sh {
                if !words(&launch, "--").contains(&f) {
                    problems.push(format!(
                        "{page}:{line}: `launch.sh {f}` is not an option of deploy/launch.sh"
                    ));
                }
            }
        }
        for named in flags {
            checked[0] += 1;
            if !help.flags.contains(&named.what) {
                problems.push(format!(
                    "{}:{}: `{}` is not an option of `ringmux --help` nor of any subcommand's",
                    named.page, named.line, named.what
                ));
            }
        }
        for (n, line) in text.lines().enumerate() {
            for var in words(line, "RINGMUX_") {
                checked[1] += 1;
                let other = OTHER_VARIABLES.iter().find(|(v, _)| *v == var);
                let known = match other {
                    Some((_, file)) => std::fs::read_to_string(repo().join(file))
                        .is_ok_and(|t| t.contains(var.as_str())),
                    None => help.variables.contains(&var),
                };
                if !known {
                    problems.push(format!(
                        "{page}:{}: `{var}` is no option's variable in `ringmux --help` (nor one of OTHER_VARIABLES)",
                        n + 1
                    ));
                }
            }
        }
        for (line, config) in &code.configs {
            match config.parse::<toml::Table>() {
                Err(e) => problems.push(format!(
                    "{page}:{line}: a ```toml block that does not parse (a Cargo manifest is marked ```toml Cargo.toml): {e}"
                )),
                Ok(table) => {
                    checked[2] += 1;
                    for key in unknown_keys(&table) {
                        problems.push(format!("{page}:{line}: unknown configuration key {key}"));
                    }
                }
            }
        }
        for (line, span) in &code.spans {
            let Some((key, _)) = span.split_once(" = ") else {
                continue;
            };
            let assignment = key.chars().all(|c| c.is_ascii_lowercase() || c == '_');
            let Ok(table) = span.parse::<toml::Table>() else {
                continue;
            };
            if assignment && table.len() == 1 {
                checked[2] += 1;
                if !all_keys.contains(key) {
                    problems.push(format!(
                        "{page}:{line}: `{span}`: unknown configuration key `{key}`"
                    ));
                }
            }
        }
    }
    (problems, checked)
}

#[test]
fn every_flag_variable_and_key_the_guide_names_exists() {
    let (problems, [flags, variables, configs]) = problems();
    println!("read {flags} flags, {variables} variables, {configs} configurations and assignments");
    assert!(
        problems.is_empty(),
        "the guide names what the code does not have:\n{}",
        problems.join("\n")
    );
    // The pages name over a hundred flags and variables each: a reader that finds few is
    // broken, not the guide right.
    assert!(flags > 100, "only {flags} flags read");
    assert!(variables > 100, "only {variables} variables read");
    assert!(
        configs > 5,
        "only {configs} configurations and assignments read"
    );
}

#[test]
fn the_reader_finds_what_it_must() {
    let code = code_of(
        "a `--tcp on|off` and `cargo build --release`.\n\n```\nsudo deploy/launch.sh --dry-run -- --listen '[::]:443' --worker-cmd 'x --y'\nRINGMUX_NODE_ID=01 ringmux --node-id 01 \\\n  --plaintext-cids | grep --count x # --not-this\ncat > /etc/r.toml <<'EOF'\nlisten = \"[::]:443\"\nEOF\n```\n\n```toml Cargo.toml\n[dependencies]\n```\n",
    );
    let mut ringmux = Vec::new();
    let mut launch = Vec::new();
    for (_, c) in &code.commands {
        let (r, l) = flags_of(c);
        ringmux.extend(r);
        launch.extend(l);
    }
    assert_eq!(
        ringmux,
        [
            "--tcp",
            "--listen",
            "--worker-cmd",
            "--node-id",
            "--plaintext-cids"
        ]
    );
    assert_eq!(launch, ["--dry-run"]);
    assert_eq!(code.configs.len(), 1);
    let table: toml::Table = code.configs[0].1.parse().unwrap();
    assert!(unknown_keys(&table).is_empty());
    let bad: toml::Table = "lisen = 1\n[[site]]\nname = 1\n[[site.route]]\nrespond = { stat = 1 }"
        .parse()
        .unwrap();
    assert_eq!(
        unknown_keys(&bad),
        ["lisen", "[[site]] name", "respond stat"]
    );
    assert_eq!(
        words("a RINGMUX_X_Y, RINGMUX_* b", "RINGMUX_"),
        ["RINGMUX_X_Y"]
    );
}
