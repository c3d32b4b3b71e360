//! Third-party programs the tests run (ngtcp2's gtlsclient, curl, chromium, aioquic...): whether
//! one is installed, where it is, and running one to completion with a deadline.
//!
//! A test that needs a tool skips loudly where it is missing, except under CI (`CI` set), where
//! its absence is a failure: scripts/test.sh installs every tool named here.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

/// A program a test needs, and how to tell that it works here.
#[derive(Clone, Copy, Debug)]
pub struct Tool {
    /// What the test runs.
    pub program: &'static str,
    /// Arguments of a harmless run that exits with status 0 where the tool works.
    pub probe: &'static [&'static str],
    /// How to get it (as scripts/test.sh does).
    pub install: &'static str,
}

/// ngtcp2's HTTP/3 client (Debian's `ngtcp2-client`).
pub const GTLSCLIENT: Tool = Tool {
    program: "gtlsclient",
    probe: &["--help"],
    install: "apt-get install ngtcp2-client",
};

pub const CURL: Tool = Tool {
    program: "curl",
    probe: &["--version"],
    install: "apt-get install curl",
};

/// A browser, run headless.
pub const CHROMIUM: Tool = Tool {
    program: "chromium",
    probe: &["--version"],
    install: "apt-get install chromium",
};

/// util-linux's `setpriv`: runs a program with other credentials and capabilities.
pub const SETPRIV: Tool = Tool {
    program: "setpriv",
    probe: &["--version"],
    install: "apt-get install util-linux",
};

/// iproute2's `ip`, able to list network namespaces.
pub const IP_NETNS: Tool = Tool {
    program: "ip",
    probe: &["netns", "list"],
    install: "apt-get install iproute2",
};

pub const NFT: Tool = Tool {
    program: "nft",
    probe: &["--version"],
    install: "apt-get install nftables",
};

/// conntrack-tools, with which the cluster test clears the balancer's NAT mappings when it
/// takes a node out (a new connection from a reused source port would follow a stale one).
pub const CONNTRACK: Tool = Tool {
    program: "conntrack",
    probe: &["--version"],
    install: "apt-get install conntrack",
};

/// Python's aioquic, which `aioquic_client.py` (crate::aioquic) drives.
pub const AIOQUIC: Tool = Tool {
    program: "python3",
    probe: &["-c", "import aioquic"],
    install: "pip install aioquic",
};

/// Python's niquests, a client that follows Alt-Svc from HTTP/2 to HTTP/3.
pub const NIQUESTS: Tool = Tool {
    program: "python3",
    probe: &["-c", "import niquests"],
    install: "python3 -m pip install niquests",
};

impl Tool {
    /// Whether the probe runs and exits with status 0. `false` means the test must skip, which
    /// it says loudly on stderr.
    ///
    /// # Panics
    /// If the tool is missing and `CI` is set: there a missing tool is a failure, not a skip.
    pub fn present(&self) -> bool {
        let Tool {
            program,
            probe,
            install,
        } = *self;
        let found = std::process::Command::new(program)
            .args(probe)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !found {
            assert!(
                std::env::var_os("CI").is_none(),
                "{program} {probe:?} does not run and CI is set: {install}"
            );
            eprintln!(
                "\n*** SKIPPED: {program} {probe:?} does not run ({install}); this test did NOT \
                 run. ***\n"
            );
        }
        found
    }
}

/// The first file called `name` in a folder of `PATH`.
pub fn which(name: &str) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

/// What [`run`] collected of a finished program.
#[derive(Debug)]
pub struct Output {
    pub success: bool,
    pub stdout: String,
    pub stderr: String,
}

/// Runs `program args…` in `dir` to completion without blocking the runtime it is awaited on;
/// killed (and the test failed) after `limit`. Output goes through files in `dir`, named
/// uniquely so that runs may overlap, so that a chatty program cannot block on a full pipe.
pub async fn run(program: &str, args: &[String], dir: &Path, limit: Duration) -> Output {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let name = Path::new(program)
        .file_name()
        .map_or("tool".into(), |n| n.to_string_lossy());
    let out_path = dir.join(format!("{name}-{}-{n}.out", std::process::id()));
    let err_path = dir.join(format!("{name}-{}-{n}.err", std::process::id()));
    let create = |p: &Path| {
        std::fs::File::create(p).unwrap_or_else(|e| panic!("creating {}: {e}", p.display()))
    };
    let mut child = tokio::process::Command::new(program)
        .args(args)
        .current_dir(dir)
        .stdin(Stdio::null())
        .stdout(create(&out_path))
        .stderr(create(&err_path))
        .kill_on_drop(true)
        .spawn()
        .unwrap_or_else(|e| panic!("running {program}: {e}"));
    let read =
        |p: &Path| String::from_utf8_lossy(&std::fs::read(p).unwrap_or_default()).into_owned();
    let status = match tokio::time::timeout(limit, child.wait()).await {
        Ok(status) => status.unwrap_or_else(|e| panic!("waiting for {program}: {e}")),
        Err(_) => {
            let _ = child.kill().await;
            panic!(
                "{program} {args:?} still running after {limit:?}\n{}",
                tail(&read(&err_path), 40)
            );
        }
    };
    Output {
        success: status.success(),
        stdout: read(&out_path),
        stderr: read(&err_path),
    }
}

/// The last `lines` lines of `text`.
pub fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tool_that_exits_0_is_present_and_found_on_path() {
        let sh = Tool {
            program: "sh",
            probe: &["-c", "exit 0"],
            install: "a POSIX system",
        };
        assert!(sh.present());
        assert!(which("sh").is_some_and(|p| p.is_file()));
        assert_eq!(which("ringmux-no-such-tool"), None);
    }

    #[test]
    fn a_failing_probe_is_absent_and_under_ci_a_failure() {
        let failing = Tool {
            program: "sh",
            probe: &["-c", "exit 3"],
            install: "none: tool.rs tests a missing tool",
        };
        let missing = Tool {
            program: "ringmux-no-such-tool",
            probe: &[],
            install: "none: tool.rs tests a missing tool",
        };
        for tool in [failing, missing] {
            if std::env::var_os("CI").is_some() {
                assert!(std::panic::catch_unwind(|| tool.present()).is_err());
            } else {
                assert!(!tool.present());
            }
        }
    }

    #[tokio::test]
    async fn run_collects_status_and_both_outputs() {
        let dir = crate::temp_dir("ringmux-support-run");
        let args = [
            "-c".to_string(),
            "echo out; echo err >&2; exit 2".to_string(),
        ];
        let out = run("sh", &args, dir.path(), Duration::from_secs(30)).await;
        assert!(!out.success);
        assert_eq!(
            (out.stdout.as_str(), out.stderr.as_str()),
            ("out\n", "err\n")
        );
    }
}
