//! Debian's curl over HTTPS on TCP, for the tests that look at what a real client got: the
//! status, the HTTP version, the leaf certificate (curl's `-w '%{certs}'`), the response's
//! header section and its body. curl must be installed ([`crate::tool::CURL`]).

use std::path::Path;
use std::time::Duration;

use crate::tool;

/// How curl reaches the server: by a name (the TLS server name; `--resolve` sends it to
/// loopback) or by the address (then curl sends no server name).
#[derive(Clone, Copy, Debug)]
pub enum Reach<'a> {
    Name(&'a str),
    Address,
}

/// What one curl run got.
#[derive(Debug)]
pub struct Got {
    pub status: u16,
    /// `%{http_version}`: "1.1" or "2".
    pub version: String,
    /// The leaf certificate's `Subject:` as curl prints it, without the field's name (the
    /// first certificate curl lists is the leaf).
    pub subject: Option<String>,
    /// The leaf certificate's `Serial Number:` as curl prints it, without the field's name.
    pub serial: Option<String>,
    /// The response's header section, names lower-case.
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl Got {
    /// The value of the header `name` (lower-case), the first if there are several.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

/// curl `path` on loopback `port`, reaching it as `reach`, trusting `cacert` (`None`: any
/// certificate), with `args` (`--http1.1`, `--http2`, `-H`, ...), its files in `dir`, for at
/// most `limit`: what it got, or its standard error if it failed.
///
/// # Panics
/// If curl succeeded and printed no status, or its files cannot be made or read.
pub async fn get(
    dir: &Path,
    port: u16,
    reach: Reach<'_>,
    cacert: Option<&Path>,
    args: &[&str],
    path: &str,
    limit: Duration,
) -> Result<Got, String> {
    let files = tempfile::Builder::new()
        .prefix("curl-")
        .tempdir_in(dir)
        .expect("a folder for curl's files");
    let head = files.path().join("head");
    let body = files.path().join("body");
    let mut all: Vec<String> = [
        "-sS",
        "--max-time",
        "20",
        "-w",
        "%{http_code} %{http_version}\\n%{certs}",
        "-D",
    ]
    .map(String::from)
    .to_vec();
    all.push(head.to_string_lossy().into_owned());
    all.push("-o".into());
    all.push(body.to_string_lossy().into_owned());
    match cacert {
        Some(c) => all.extend(["--cacert".to_string(), c.to_string_lossy().into_owned()]),
        None => all.push("-k".into()),
    }
    let url = match reach {
        Reach::Name(name) => {
            all.extend(["--resolve".into(), format!("{name}:{port}:127.0.0.1")]);
            format!("https://{name}:{port}{path}")
        }
        Reach::Address => format!("https://127.0.0.1:{port}{path}"),
    };
    all.extend(args.iter().map(|a| a.to_string()));
    all.push(url);
    let out = tool::run("curl", &all, dir, limit).await;
    if !out.success {
        return Err(out.stderr);
    }
    let mut lines = out.stdout.lines();
    let (status, version) = lines
        .next()
        .and_then(|l| l.split_once(' '))
        .unwrap_or_else(|| panic!("curl {all:?}: no status in {:?}", out.stdout));
    let certs: Vec<&str> = lines.collect();
    let field = |name: &str| {
        certs
            .iter()
            .find_map(|l| l.strip_prefix(name))
            .map(str::to_string)
    };
    let text = std::fs::read_to_string(&head).expect("curl's header dump");
    let headers = text
        .lines()
        .skip(1)
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    Ok(Got {
        status: status.parse().expect("a status"),
        version: version.to_string(),
        subject: field("Subject:"),
        serial: field("Serial Number:"),
        headers,
        body: std::fs::read_to_string(&body).unwrap_or_default(),
    })
}
