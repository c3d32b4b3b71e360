//! `fwd-bench`: ringmux's forwarding cost, ring (`shm`) vs Unix socket (`unix`) vs
//! receive-only (`drop`), in alternating rounds, each against a fresh `ringmux --worker-mode
//! sink`; optionally beside the C reference forwarder (`--reference DIR`). Prints a Markdown
//! table, within-round ratios and the targets; writes JSON and an SVG chart.
//!
//! `fwd-bench blast` only sends and `fwd-bench keygen` writes a key file (for
//! bench/scripts/profile.sh).

use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand, ValueEnum};
use ringmux_bench::fwd::datagrams;
use ringmux_bench::fwd::measure::{self, Plan, Regime, Round};
use ringmux_bench::fwd::os;
use ringmux_bench::fwd::reference::{RefRound, Reference, Variant};
use ringmux_bench::fwd::report;
use ringmux_bench::fwd::ringmux::Spec;
use ringmux_bench::fwd::sender::{Blaster, SendShape};
use ringmux_quic_lb::KeySet;
use serde::Serialize;

/// ringmux forwarding benchmark: shm vs unix vs drop in alternating rounds.
///
/// Saturated (default) mirrors the C reference forwarder's drain mode: the demux is parked with
/// SIGSTOP, its socket pre-filled with --drain datagrams, resumed, and only the drains are
/// measured (data-plane thread CPU from /proc/PID/task/TID/schedstat), --cycles times. Live
/// sends for --warmup + --seconds and measures the --seconds.
#[derive(Debug, Parser)]
#[command(name = "fwd-bench", version, args_conflicts_with_subcommands = true)]
struct Cli {
    #[command(subcommand)]
    command: Option<Cmd>,
    #[command(flatten)]
    run: RunArgs,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Only send routable datagrams at a running ringmux (for profiling).
    Blast(BlastArgs),
    /// Write a fresh ringmux key file (mode 0600) for `ringmux --key-file` and `blast`.
    Keygen {
        /// The file to create (must not exist).
        path: PathBuf,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
enum OnOff {
    On,
    Off,
}

#[derive(Debug, Args)]
struct RunArgs {
    /// Forwarding modes, run in this order within each round.
    #[arg(long, value_delimiter = ',', default_value = "shm,unix,drop")]
    modes: Vec<String>,
    /// saturated: pre-fill then drain (capacity per core); live: timed blast.
    #[arg(long, value_enum, default_value = "saturated")]
    regime: Regime,
    /// on: the sender uses UDP GSO trains, which the demux receives coalesced (GRO);
    /// off: sendmmsg of single datagrams, nothing to coalesce.
    #[arg(long, value_enum, default_value = "on")]
    gro: OnOff,
    /// Rounds; each round runs every mode once (A B C A B C ...).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=1000))]
    rounds: u32,
    /// Live: measured seconds per (round, mode).
    #[arg(long, default_value_t = 3.0)]
    seconds: f64,
    /// Live: seconds of sending before the measurement starts.
    #[arg(long, default_value_t = 0.5)]
    warmup: f64,
    /// Sink workers (ringmux --instances). bench.c has one consumer.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u8).range(1..=255))]
    instances: u8,
    /// UDP payload bytes per datagram.
    #[arg(long, default_value_t = 1200)]
    size: usize,
    /// Live: offered datagrams/s (default: as fast as the sender goes).
    #[arg(long)]
    rate: Option<u64>,
    /// Saturated: datagrams per pre-fill (bench.c drain=).
    #[arg(long, default_value_t = 16384)]
    drain: u64,
    /// Saturated: pre-fills per measurement (bench.c cycles=).
    #[arg(long, default_value_t = 60)]
    cycles: u32,
    /// Sender sockets (source ports), one impersonated connection each.
    #[arg(long, default_value_t = 64)]
    sockets: usize,
    /// ringmux --rcvbuf (forced past rmem_max as root): must hold a whole pre-fill.
    #[arg(long, default_value_t = 256 << 20)]
    rcvbuf: usize,
    /// ringmux --cpus (data plane first, then sinks). Default on 2+ CPUs: 1,0 (bench.c's
    /// layout: demux on CPU 1, consumer on CPU 0).
    #[arg(long)]
    cpus: Option<String>,
    /// Sender CPU. Default: the demux's CPU when saturated (it only runs while the demux is
    /// parked, as bench.c), a sink CPU when live.
    #[arg(long)]
    sender_cpu: Option<usize>,
    /// Do not pin anything.
    #[arg(long)]
    no_pin: bool,
    /// SCHED_FIFO for the data plane (20) and the sinks (10), as bench.c (dfifo, cfifo).
    #[arg(long, value_enum, default_value = "on")]
    fifo: OnOff,
    /// Consumer spin before sleeping, µs: ringmux --spin-us and bench.c spin_us=, so both
    /// sides spin alike (ringmux's default is 50, bench.c's 10).
    #[arg(long, default_value_t = 50)]
    spin_us: u32,
    /// Extra ringmux argument (repeatable), e.g. --ringmux-arg=--ring-slots=8192.
    #[arg(long = "ringmux-arg", allow_hyphen_values = true)]
    ringmux_args: Vec<String>,
    /// Write every round, the summary, the ratios and the target checks as JSON.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Write a chart of the per-round figures (with --sweep: cost against offered load).
    #[arg(long)]
    svg: Option<PathBuf>,
    /// Live regime: a load sweep over these offered rates (datagrams/s, e.g.
    /// 10000,30000,100000,300000,1000000; `max` for as fast as the sender goes). Each round
    /// runs every rate, and each rate every mode (and the C reference) in turn; results are
    /// labelled `MODE@RATE`.
    #[arg(long, value_delimiter = ',')]
    sweep: Vec<String>,
    /// Directory holding the C reference bench.c (a C reference forwarder kept outside this repository): build
    /// a copy and run it beside each mode in the same alternation.
    #[arg(long)]
    reference: Option<PathBuf>,
    /// With --reference: also build bench.c made to read every datagram's ECN bits as ringmux
    /// does with --ecn on (IP_RECVTOS on its socket, a control buffer on every recvmmsg entry,
    /// the IP_TOS control message read per datagram and its ECN bits stored with the datagram
    /// in the ring slot or SEQPACKET header), by checked substitutions of a copy of its text,
    /// and run it beside each mode too: ratios against both, like for like and as shipped.
    #[arg(long, requires = "reference")]
    reference_ecn: bool,
    /// The ringmux binary. Default: next to this executable.
    #[arg(long)]
    ringmux: Option<PathBuf>,
    /// The ringmux-worker binary. Default: next to the ringmux binary.
    #[arg(long)]
    worker: Option<PathBuf>,
    /// Keep the temporary directory (ringmux logs, key file, reference build).
    #[arg(long)]
    keep_temp: bool,
    /// Run over IPv6: ringmux listens on `[::1]` and the sender sends from `[::1]` (default:
    /// 127.0.0.1). The C reference binds IPv4 only, so not with --reference.
    #[arg(long)]
    ipv6: bool,
}

#[derive(Debug, Args)]
struct BlastArgs {
    /// ringmux's public address.
    #[arg(long)]
    target: SocketAddr,
    /// The key file ringmux was started with (--key-file).
    #[arg(long)]
    key_file: PathBuf,
    /// ringmux --instances.
    #[arg(long, default_value_t = 1)]
    instances: u8,
    #[arg(long, default_value_t = 5.0)]
    seconds: f64,
    #[arg(long, value_enum, default_value = "on")]
    gro: OnOff,
    #[arg(long, default_value_t = 1200)]
    size: usize,
    #[arg(long)]
    rate: Option<u64>,
    #[arg(long, default_value_t = 64)]
    sockets: usize,
    /// Pin the sender to this CPU.
    #[arg(long)]
    cpu: Option<usize>,
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let r = match cli.command {
        Some(Cmd::Blast(b)) => blast(b),
        Some(Cmd::Keygen { path }) => datagrams::write_key_file(&path).map(|_| ()),
        None => run(cli.run),
    };
    match r {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("fwd-bench: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn shape(gro: OnOff) -> SendShape {
    match gro {
        OnOff::On => SendShape::Gso,
        OnOff::Off => SendShape::Mmsg,
    }
}

fn blast(a: BlastArgs) -> Result<()> {
    let keys = KeySet::load(&a.key_file).context("--key-file")?;
    let conns = datagrams::connections(&keys, a.instances, a.sockets, false)?;
    let mut b = Blaster::new(a.target, conns, a.size, shape(a.gro))?;
    if let Some(c) = a.cpu {
        os::pin_current(c).with_context(|| format!("pinning to CPU {c}"))?;
    }
    let st = b.blast(
        Duration::from_secs_f64(a.seconds),
        a.rate,
        &AtomicBool::new(false),
    );
    println!(
        "blast sent={} calls={} errors={} seconds={:.3} rate={:.0} sender_ns_per_datagram={:.1}",
        st.datagrams,
        st.calls,
        st.errors,
        st.elapsed_s,
        st.datagrams as f64 / st.elapsed_s.max(1e-9),
        st.cpu_ns as f64 / st.datagrams.max(1) as f64
    );
    Ok(())
}

/// The JSON document.
#[derive(Serialize)]
struct Document<'a> {
    tool: &'static str,
    command: String,
    started_unix_s: u64,
    regime: Regime,
    gro: OnOff,
    sender: SendShape,
    modes: &'a [String],
    rounds_requested: u32,
    instances: u8,
    size: usize,
    drain: u64,
    cycles: u32,
    seconds: f64,
    rate: Option<u64>,
    spin_us: u32,
    cpus: Option<String>,
    sender_cpu: Option<usize>,
    fifo: OnOff,
    online_cpus: usize,
    loadavg_start: String,
    loadavg_end: String,
    rounds: &'a [Round],
    reference_rounds: &'a [RefRound],
    summary:
        &'a std::collections::BTreeMap<String, std::collections::BTreeMap<String, report::Stat>>,
    reference_summary:
        &'a std::collections::BTreeMap<String, std::collections::BTreeMap<String, report::Stat>>,
    /// The reference reading ECN (`--reference-ecn`), by mode; empty without it.
    reference_ecn_summary:
        &'a std::collections::BTreeMap<String, std::collections::BTreeMap<String, report::Stat>>,
    ratios: &'a std::collections::BTreeMap<String, report::Stat>,
    checks: &'a [report::Check],
    table_markdown: &'a str,
}

fn run(a: RunArgs) -> Result<()> {
    if a.ipv6 && a.reference.is_some() {
        bail!("--ipv6 with --reference: the C reference forwarder binds IPv4 only; drop one of the two");
    }
    for m in &a.modes {
        if !["shm", "unix", "drop", "reuseport"].contains(&m.as_str()) {
            bail!("--modes: {m:?} is not one of shm, unix, drop, reuseport");
        }
    }
    // Kernel steering reads plaintext connection IDs: then every mode of the run gets them,
    // so that all route the same datagrams at the same cost.
    let plaintext = a.modes.iter().any(|m| m == "reuseport");
    // The offered rates: one step without --sweep (the --rate given, if any).
    let steps: Vec<(String, Option<u64>)> = if a.sweep.is_empty() {
        vec![(String::new(), a.rate)]
    } else {
        if !matches!(a.regime, Regime::Live) {
            bail!("--sweep needs --regime live: the saturated regime has no offered rate");
        }
        a.sweep
            .iter()
            .map(|s| match s.as_str() {
                "max" => Ok(("max".to_string(), None)),
                n => n
                    .parse::<u64>()
                    .ok()
                    .filter(|&r| r > 0)
                    .map(|r| (n.to_string(), Some(r)))
                    .ok_or_else(|| {
                        anyhow::anyhow!("--sweep: {n:?} is not a rate (datagrams/s, or max)")
                    }),
            })
            .collect::<Result<_>>()?
    };
    let labelled = |mode: &str, step: &str| {
        if step.is_empty() {
            mode.to_string()
        } else {
            format!("{mode}@{step}")
        }
    };
    let labels: Vec<String> = steps
        .iter()
        .flat_map(|(step, _)| a.modes.iter().map(|m| labelled(m, step)))
        .collect();
    if plaintext && matches!(a.regime, Regime::Saturated) {
        bail!(
            "--modes reuseport runs in --regime live only: the saturated regime parks the demux \
             and fills its socket, and under kernel steering the demux receives nothing"
        );
    }
    let ringmux = match &a.ringmux {
        Some(p) => p.clone(),
        None => std::env::current_exe()?.with_file_name("ringmux"),
    };
    let worker = a
        .worker
        .clone()
        .unwrap_or_else(|| ringmux.with_file_name("ringmux-worker"));
    for p in [&ringmux, &worker] {
        if !p.is_file() {
            bail!(
                "{} not found: cargo build --release --workspace --bins, or pass --ringmux/--worker",
                p.display()
            );
        }
    }
    let pin = !a.no_pin && os::online_cpus() >= 2;
    let cpus = a.cpus.clone().or_else(|| pin.then(|| "1,0".to_string()));
    let cpu_list: Vec<usize> = cpus
        .as_deref()
        .unwrap_or("")
        .split(',')
        .filter_map(|c| c.trim().parse().ok())
        .collect();
    let sender_cpu = a.sender_cpu.or_else(|| {
        if !pin {
            return None;
        }
        match a.regime {
            Regime::Saturated => cpu_list.first().copied(),
            Regime::Live => cpu_list.get(1).or(cpu_list.first()).copied(),
        }
    });
    let root = nix::unistd::geteuid().is_root();
    let fifo = a.fifo == OnOff::On && root;
    if a.fifo == OnOff::On && !root {
        eprintln!("fwd-bench: not root: SCHED_FIFO and --rcvbuf forcing are unavailable");
    }

    // Open to others (0755) as the folders of the tests are: a run as root starts its
    // workers as nobody.
    let tmp_dir = tempfile::Builder::new()
        .prefix("fwd-bench-")
        .permissions(std::os::unix::fs::PermissionsExt::from_mode(0o755))
        .tempdir()
        .context("creating a temporary folder")?;
    let tmp = tmp_dir.path().to_owned();
    let key_file = tmp.join("keys");
    let keys = datagrams::write_key_file(&key_file)?;
    let conns = datagrams::connections(&keys, a.instances, a.sockets, plaintext)?;
    // The C reference as shipped and, with --reference-ecn, reading ECN.
    let mut references = Vec::new();
    if let Some(dir) = &a.reference {
        eprintln!("== building the C reference from {}", dir.display());
        references.push(Reference::build(dir, &tmp, Variant::Shipped)?);
        if a.reference_ecn {
            eprintln!("== building the C reference reading ECN (a substituted copy of bench.c)");
            references.push(Reference::build(dir, &tmp, Variant::Ecn)?);
        }
    }
    let mut plan = Plan {
        regime: a.regime,
        shape: shape(a.gro),
        size: a.size,
        instances: a.instances,
        seconds: a.seconds,
        warmup: a.warmup,
        rate: a.rate,
        drain: a.drain,
        cycles: a.cycles,
        sender_cpu,
        fifo,
        spin_us: a.spin_us,
    };
    let loadavg_start = os::loadavg();
    let started = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    eprintln!(
        "== fwd-bench {:?} gro={:?} modes={} rounds={} instances={} cpus={} sender_cpu={:?} fifo={} load: {}",
        a.regime,
        a.gro,
        a.modes.join(","),
        a.rounds,
        a.instances,
        cpus.as_deref().unwrap_or("unpinned"),
        sender_cpu,
        fifo,
        loadavg_start
    );

    let mut rounds = Vec::new();
    let mut refs = Vec::new();
    for round in 1..=a.rounds {
        for (step, rate) in &steps {
            plan.rate = *rate;
            for mode in &a.modes {
                let spec = Spec {
                    ringmux: ringmux.clone(),
                    worker: worker.clone(),
                    instances: a.instances,
                    forward: mode.clone(),
                    worker_mode: "sink".into(),
                    rcvbuf: a.rcvbuf,
                    cpus: cpus.clone(),
                    key_file: key_file.clone(),
                    loopback: if a.ipv6 {
                        Ipv6Addr::LOCALHOST.into()
                    } else {
                        Ipv4Addr::LOCALHOST.into()
                    },
                    log: tmp.join(format!("ringmux-{mode}-{round}.log")),
                    extra: [
                        vec!["--spin-us".to_string(), a.spin_us.to_string()],
                        plaintext
                            .then(|| "--plaintext-cids".to_string())
                            .into_iter()
                            .collect(),
                        a.ringmux_args.clone(),
                    ]
                    .concat(),
                };
                let mut r = measure::run(&plan, &spec, &conns, round, mode)?;
                r.mode = labelled(mode, step);
                print_round(&r);
                rounds.push(r);
                // The two builds of the reference alternate which runs first, so neither
                // always follows ringmux.
                let mut order: Vec<&Reference> = references.iter().collect();
                if round % 2 == 0 {
                    order.reverse();
                }
                for reference in order {
                    if let Some(mut rr) = reference.run(&plan, mode, round)? {
                        rr.mode = labelled(mode, step);
                        eprintln!(
                        "round {round} C reference {:>4}{}: demux {:7.1} ns/datagram  consumer {}  rx {:.2} M/s  ok={}",
                        rr.fwd,
                        rr.variant.label(),
                        rr.demux_ns_per_datagram,
                        rr.consumer_ns_per_datagram
                            .map_or("—".into(), |c| format!("{c:.1} ns")),
                        rr.rx_per_s / 1e6,
                        rr.ok
                    );
                        refs.push(rr);
                    }
                }
            }
        }
    }

    let summary = report::summarise(&rounds, &labels);
    let reference_summary = report::summarise_reference(&refs, Variant::Shipped);
    let reference_ecn_summary = report::summarise_reference(&refs, Variant::Ecn);
    let ratios = report::ratios(&rounds, &refs);
    let checks = report::checks(a.regime, plan.shape, &ratios, &summary);
    let mut table = report::markdown(
        &labels,
        &summary,
        &reference_summary,
        &reference_ecn_summary,
        &ratios,
        &checks,
    );
    if !a.sweep.is_empty() {
        table.push_str(&report::sweep_markdown(
            &a.modes,
            &steps,
            &summary,
            &reference_summary,
        ));
    }
    let loadavg_end = os::loadavg();
    println!(
        "\nfwd-bench {:?}, GRO {:?} ({} sender), {} rounds, {} instance(s), {} B; load before: {}; after: {}\n",
        a.regime,
        a.gro,
        match plan.shape {
            SendShape::Gso => "GSO",
            SendShape::Mmsg => "sendmmsg",
        },
        a.rounds,
        a.instances,
        a.size,
        loadavg_start,
        loadavg_end
    );
    print!("{table}");
    // Each distinct note once, with the (round, mode)s it came from.
    let mut notes: Vec<(String, Vec<String>)> = Vec::new();
    for r in &rounds {
        for n in &r.notes {
            let at = format!("{} {}", r.round, r.mode);
            match notes.iter_mut().find(|(m, _)| m == n) {
                Some((_, v)) => v.push(at),
                None => notes.push((n.clone(), vec![at])),
            }
        }
    }
    for (n, at) in notes {
        println!("note ({}): {n}", at.join(", "));
    }

    if let Some(path) = &a.json {
        let doc = Document {
            tool: "fwd-bench",
            command: std::env::args().collect::<Vec<_>>().join(" "),
            started_unix_s: started,
            regime: a.regime,
            gro: a.gro,
            sender: plan.shape,
            modes: &a.modes,
            rounds_requested: a.rounds,
            instances: a.instances,
            size: a.size,
            drain: a.drain,
            cycles: a.cycles,
            seconds: a.seconds,
            rate: a.rate,
            spin_us: a.spin_us,
            cpus: cpus.clone(),
            sender_cpu,
            fifo: if fifo { OnOff::On } else { OnOff::Off },
            online_cpus: os::online_cpus(),
            loadavg_start,
            loadavg_end,
            rounds: &rounds,
            reference_rounds: &refs,
            summary: &summary,
            reference_summary: &reference_summary,
            reference_ecn_summary: &reference_ecn_summary,
            ratios: &ratios,
            checks: &checks,
            table_markdown: &table,
        };
        write_parent(path)?;
        std::fs::write(path, serde_json::to_string_pretty(&doc)? + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
        eprintln!("== wrote {}", path.display());
    }
    if let Some(path) = &a.svg {
        write_parent(path)?;
        let title = format!(
            "ringmux fwd-bench: {:?}, GRO {:?}, {} B, {} instance(s)",
            a.regime, a.gro, a.size, a.instances
        );
        if a.sweep.is_empty() {
            report::svg(path, &title, &rounds, &refs)?;
        } else {
            report::sweep_svg(path, &title, &a.modes, &steps, &summary, &reference_summary)?;
        }
        eprintln!("== wrote {}", path.display());
    }
    if a.keep_temp {
        eprintln!("== kept {}", tmp_dir.keep().display());
    }
    Ok(())
}

fn write_parent(path: &Path) -> Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    Ok(())
}

fn print_round(r: &Round) {
    eprintln!(
        "round {} ringmux {:>4}: demux {:7.1} ns/datagram (process {:.1})  consumer {}  delivered {:.2} M/s{}  drops {}  doorbells/datagram {:.5}  datagrams/recv {:.1}  allocs/Mdgram {}  p99 {}  bad_cid {}",
        r.round,
        r.mode,
        r.demux_ns_per_datagram,
        r.demux_process_ns_per_datagram,
        r.consumer_ns_per_datagram
            .map_or("—".into(), |c| format!("{c:.1} ns")),
        r.delivered_per_s / 1e6,
        r.offered_per_s
            .map_or(String::new(), |o| format!(" (offered {:.2} M/s)", o / 1e6)),
        r.drops_excluding_discard(),
        r.doorbells_per_datagram,
        r.datagrams_per_recv_call,
        r.allocations_per_million_datagrams
            .map_or("—".into(), |a| format!("{a:.1}")),
        r.latency_p99_us
            .map_or("—".into(), |v| format!("{v:.1} µs")),
        r.bad_cid
    );
}
