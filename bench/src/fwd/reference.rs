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

/// Which build of bench.c.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Variant {
    /// bench.c as shipped: its receive asks the kernel for no control message without GRO.
    Shipped,
    /// bench.c made to do what ringmux's receive does for ECN (`fwd-bench --reference-ecn`):
    /// `IP_RECVTOS` on its socket, a control buffer on every `recvmmsg` entry, the `IP_TOS`
    /// control message read for every datagram received and its ECN bits stored with the
    /// datagram (the ring slot's or the SEQPACKET header's `flags`, beside the worker index).
    Ecn,
}

impl Variant {
    /// How the text output names it, after "C reference".
    pub fn label(self) -> &'static str {
        match self {
            Variant::Shipped => "",
            Variant::Ecn => " +ECN",
        }
    }
}

/// One text substitution of bench.c for [`Variant::Ecn`]: what it is for, the text it expects
/// exactly once, and what replaces it.
struct Substitution {
    what: &'static str,
    from: &'static str,
    to: &'static str,
}

/// The ECN variant, as substitutions of bench.c's text. Each must find its text exactly once,
/// or the build fails naming it: a changed bench.c is compared by hand, never half-patched.
const ECN_SUBSTITUTIONS: &[Substitution] = &[
    Substitution {
        what: "the receive socket asks for the TOS byte (IP_RECVTOS), as ringmux's does with ECN on",
        from: "  if (c.gro) { int one = 1; if (setsockopt(us, SOL_UDP, UDP_GRO, &one, sizeof one)) die(\"UDP_GRO\"); }\n",
        to: "  if (c.gro) { int one = 1; if (setsockopt(us, SOL_UDP, UDP_GRO, &one, sizeof one)) die(\"UDP_GRO\"); }\n  { int one = 1; if (setsockopt(us, IPPROTO_IP, IP_RECVTOS, &one, sizeof one)) die(\"IP_RECVTOS\"); }\n",
    },
    Substitution {
        what: "every recvmmsg entry gets its 64-byte control buffer, GRO or not",
        from: "D->mm[i].msg_hdr.msg_controllen = c->gro ? 64 : 0;",
        to: "D->mm[i].msg_hdr.msg_controllen = 64;",
    },
    Substitution {
        what: "every received datagram's control messages are walked and its IP_TOS read (a datagram without one is fatal, so the variant cannot silently measure nothing)",
        from: "    if (c->gro) {
      for (struct cmsghdr *cm = CMSG_FIRSTHDR(&D->mm[i].msg_hdr); cm; cm = CMSG_NXTHDR(&D->mm[i].msg_hdr, cm))
        if (cm->cmsg_level == SOL_UDP && cm->cmsg_type == UDP_GRO) { int g; memcpy(&g, CMSG_DATA(cm), sizeof g); seg = g; }
    }
",
        to: "    uint32_t ecn = 0; int tos_seen = 0;
    for (struct cmsghdr *cm = CMSG_FIRSTHDR(&D->mm[i].msg_hdr); cm; cm = CMSG_NXTHDR(&D->mm[i].msg_hdr, cm)) {
      if (cm->cmsg_level == SOL_UDP && cm->cmsg_type == UDP_GRO) { int g; memcpy(&g, CMSG_DATA(cm), sizeof g); seg = g; }
      else if (cm->cmsg_level == IPPROTO_IP && cm->cmsg_type == IP_TOS) { unsigned char tos; memcpy(&tos, CMSG_DATA(cm), 1); ecn = tos & 3; tos_seen = 1; }
    }
    if (!tos_seen) { errno = EPROTO; die(\"ECN variant: a datagram without an IP_TOS control message\"); }
",
    },
    Substitution {
        what: "the SEQPACKET header carries the ECN bits beside the worker index",
        from: "h->len = dl; h->flags = w; h->addr = D->names[i];",
        to: "h->len = dl; h->flags = w | ecn << 16; h->addr = D->names[i];",
    },
    Substitution {
        what: "the ring slot carries the ECN bits beside the worker index",
        from: "s->len = dl; s->flags = w; s->addr = D->names[i];",
        to: "s->len = dl; s->flags = w | ecn << 16; s->addr = D->names[i];",
    },
];

/// bench.c's text with this file's `ECN_SUBSTITUTIONS` applied; an error naming the first
/// whose text is missing or not unique.
pub fn ecn_source(text: &str) -> Result<String> {
    let mut out = text.to_string();
    for s in ECN_SUBSTITUTIONS {
        match out.matches(s.from).count() {
            1 => out = out.replacen(s.from, s.to, 1),
            n => bail!(
                "bench.c: the text to change so that {} was found {n} times (expected once); \
                 this bench.c differs from the one fwd-bench knows: compare them by hand\n--- expected:\n{}",
                s.what,
                s.from
            ),
        }
    }
    Ok(out)
}

/// A built reference.
pub struct Reference {
    pub dir: PathBuf,
    pub bin: PathBuf,
    pub variant: Variant,
}

/// The `RES` line of one run, in the harness's units.
#[derive(Clone, Debug, Serialize)]
pub struct RefRound {
    pub round: u32,
    /// The ringmux mode this stands beside (`shm`, `unix`, `drop`).
    pub mode: String,
    /// bench.c's `fwd=` (`ring`, `seq`, `none`).
    pub fwd: String,
    /// As shipped, or made to read each datagram's ECN bits (`--reference-ecn`).
    pub variant: Variant,
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
    /// Copies `src` (the directory holding bench.c) into `work/reference` (the ECN variant:
    /// `work/reference-ecn`, bench.c substituted by [`ecn_source`]) and compiles it with
    /// `gcc -O2`.
    pub fn build(src: &Path, work: &Path, variant: Variant) -> Result<Reference> {
        let dir = work.join(match variant {
            Variant::Shipped => "reference",
            Variant::Ecn => "reference-ecn",
        });
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        for e in std::fs::read_dir(src).with_context(|| format!("reading {}", src.display()))? {
            let e = e?;
            if e.file_type()?.is_file() {
                std::fs::copy(e.path(), dir.join(e.file_name()))
                    .with_context(|| format!("copying {}", e.path().display()))?;
            }
        }
        if variant == Variant::Ecn {
            let c = dir.join("bench.c");
            let text =
                std::fs::read_to_string(&c).with_context(|| format!("reading {}", c.display()))?;
            let changed = ecn_source(&text).with_context(|| format!("{}", src.display()))?;
            std::fs::write(&c, changed).with_context(|| format!("writing {}", c.display()))?;
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
        Ok(Reference { dir, bin, variant })
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
        let command = match self.variant {
            Variant::Shipped => format!("./bench {}", args.join(" ")),
            Variant::Ecn => format!("./bench {}  # bench.c with ECN read", args.join(" ")),
        };
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
            variant: self.variant,
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

    /// bench.c's texts the ECN variant changes, in its order, with something between them.
    fn shipped_like() -> String {
        ECN_SUBSTITUTIONS
            .iter()
            .map(|s| format!("/* before */\n{}/* after */\n", s.from))
            .collect()
    }

    #[test]
    fn ecn_variant_changes_every_text_once() {
        let text = shipped_like();
        let ecn = ecn_source(&text).unwrap();
        for s in ECN_SUBSTITUTIONS {
            assert!(ecn.contains(s.to), "{}", s.what);
        }
        assert!(ecn.contains("IP_RECVTOS") && ecn.contains("cmsg_type == IP_TOS"));
        assert!(!ecn.contains("c->gro ? 64 : 0"));
        assert_eq!(ecn.matches("ecn << 16").count(), 2);
    }

    #[test]
    fn ecn_variant_refuses_a_text_it_does_not_know() {
        // One text missing: the error names what it was for.
        let text = shipped_like().replace(ECN_SUBSTITUTIONS[1].from, "");
        let e = ecn_source(&text).unwrap_err().to_string();
        assert!(e.contains(ECN_SUBSTITUTIONS[1].what), "{e}");
        assert!(e.contains("found 0 times"), "{e}");
        // One text twice: refused too, rather than changing both.
        let text = format!("{}{}", shipped_like(), ECN_SUBSTITUTIONS[4].from);
        let e = ecn_source(&text).unwrap_err().to_string();
        assert!(e.contains("found 2 times"), "{e}");
    }
}
