//! The C reference forwarder (`bench.c` in the directory given to `fwd-bench --reference`), built from a copy in a temporary
//! directory (the shared tree is read-only) and run in the same alternation as ringmux, so
//! each round compares ringmux with the machine's limit under the same load.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use serde::Serialize;

use super::measure::{Plan, Regime};
use super::sender::SendShape;

/// A built reference.
pub struct Reference {
    pub dir: PathBuf,
    pub bin: PathBuf,
}

/// The `RES` line of one run, in the harness's units.
#[derive(Clone, Debug, Serialize)]
pub struct RefRound {
    pub round: u32,
    /// The ringmux mode this stands beside (`shm`, `unix`, `drop`).
    pub mode: String,
    /// bench.c's `fwd=` (`ring`, `seq`, `none`).
    pub fwd: String,
    pub demux_ns_per_datagram: f64,
    pub consumer_ns_per_datagram: Option<f64>,
    pub doorbells_per_datagram: Option<f64>,
    pub rx_per_s: f64,
    pub ok: bool,
    pub command: String,
    /// Every `key=value` of the `RES` line.
    pub raw: BTreeMap<String, String>,
}

/// bench.c's name for a ringmux mode.
pub fn fwd_for(mode: &str) -> Option<&'static str> {
    match mode {
        "shm" => Some("ring"),
        "unix" => Some("seq"),
        "drop" => Some("none"),
        _ => None,
    }
}

impl Reference {
    /// Copies `src` (the directory holding bench.c) into `work/reference` and compiles it
    /// with `gcc -O2`.
    pub fn build(src: &Path, work: &Path) -> Result<Reference> {
        let dir = work.join("reference");
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        for e in std::fs::read_dir(src).with_context(|| format!("reading {}", src.display()))? {
            let e = e?;
            if e.file_type()?.is_file() {
                std::fs::copy(e.path(), dir.join(e.file_name()))
                    .with_context(|| format!("copying {}", e.path().display()))?;
            }
        }
        let bin = dir.join("bench");
        let out = Command::new("gcc")
            .current_dir(&dir)
            .args(["-O2", "-Wall", "-o", "bench", "bench.c"])
            .output()
            .context("running gcc (is it installed?)")?;
        if !out.status.success() {
            bail!(
                "gcc -O2 -o bench bench.c failed in {}:\n{}",
                dir.display(),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(Reference { dir, bin })
    }

    /// The arguments mirroring `plan` for ringmux mode `mode`.
    pub fn args(plan: &Plan, mode: &str) -> Option<Vec<String>> {
        let fwd = fwd_for(mode)?;
        let (snd, gro) = match plan.shape {
            SendShape::Gso => ("gso", 1),
            SendShape::Mmsg => ("mmsg", 0),
        };
        let mut a = vec![
            "udp".to_string(),
            format!("fwd={fwd}"),
            format!("snd={snd}"),
            "rb=32".into(),
            format!("gro={gro}"),
        ];
        if fwd == "ring" {
            a.push("slots=4096".into());
            a.push(format!("spin_us={}", plan.spin_us));
        }
        match plan.regime {
            Regime::Saturated => {
                a.push(format!("drain={}", plan.drain));
                a.push(format!("cycles={}", plan.cycles));
            }
            Regime::Live => {
                a.push(format!("dur={}", plan.seconds));
                if let Some(r) = plan.rate {
                    a.push(format!("rate={r}"));
                }
            }
        }
        Some(a)
    }

    /// Runs the reference for `mode` and parses its `RES` line.
    pub fn run(&self, plan: &Plan, mode: &str, round: u32) -> Result<Option<RefRound>> {
        let Some(args) = Self::args(plan, mode) else {
            return Ok(None);
        };
        let command = format!("./bench {}", args.join(" "));
        let mut child = Command::new(&self.bin)
            .current_dir(&self.dir)
            .args(&args)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .with_context(|| format!("starting {command}"))?;
        // bench.c bounds its own waits; this only guards against a hang.
        let limit = Duration::from_secs(180 + plan.seconds as u64);
        let started = std::time::Instant::now();
        while child.try_wait()?.is_none() {
            if started.elapsed() > limit {
                let _ = child.kill();
                let _ = child.wait();
                bail!("{command} ran longer than {limit:?}; killed");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let out = child.wait_with_output()?;
        let stdout = String::from_utf8_lossy(&out.stdout);
        let Some(line) = stdout.lines().find(|l| l.starts_with("RES ")) else {
            bail!(
                "{command} printed no RES line (status {}):\n{}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            );
        };
        let raw = parse_res(line);
        let num = |k: &str| raw.get(k).and_then(|v| v.parse::<f64>().ok());
        Ok(Some(RefRound {
            round,
            mode: mode.to_string(),
            fwd: fwd_for(mode).unwrap_or_default().to_string(),
            demux_ns_per_datagram: num("d_us").context("RES line without d_us")? * 1e3,
            consumer_ns_per_datagram: num("c_us").map(|v| v * 1e3),
            doorbells_per_datagram: num("doorbell_per_dgram"),
            rx_per_s: num("rx_pps").unwrap_or(0.0),
            ok: raw.get("ok").map(String::as_str) == Some("1"),
            command,
            raw,
        }))
    }
}

/// `RES k=v k=v ...` → map.
pub fn parse_res(line: &str) -> BTreeMap<String, String> {
    line.split_ascii_whitespace()
        .skip(1)
        .filter_map(|kv| {
            let (k, v) = kv.split_once('=')?;
            Some((k.to_string(), v.to_string()))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn res_line() {
        let m = parse_res("RES kind=udp mode=drain fwd=ring ok=1 d_us=0.2360 c_us=0.0860");
        assert_eq!(m["fwd"], "ring");
        assert_eq!(m["d_us"], "0.2360");
        assert_eq!(m.len(), 6);
    }
}
