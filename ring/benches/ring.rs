//! Pure ring benchmark across two processes pinned to two cores (the same measurement as the
//! C reference forwarder's `bench ring` mode, so the two compare; bench/RESULTS.md): throughput of 1200-byte messages published in batches of 32,
//! one-way latency (hdrhistogram) with the consumer spinning and with it sleeping on the eventfd,
//! and doorbells per message at saturation with the default spin.
//!
//! `cargo bench -p ringmux-ring --bench ring [-- --seconds 2 --mode all|tput|lat-spin|lat-sleep|lat-sleep-read|reset]`
//! (`reset`, not part of `all`: the time `Producer::reset` takes, a new ring per generation;
//! `lat-sleep-read`, not part of `all`: `lat-sleep` with the consumer asleep in a blocking `read`
//! of the doorbell, as the C reference sleeps, instead of `poll`: what the wait itself costs)
//! Prints one `RES …` line per run, comparable with the C reference's.

use std::io::{BufRead, BufReader};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use ringmux_ring::{
    monotonic_ns as now_ns, Consumer, DatagramMeta, Producer, PushError, RingConfig, SpinPolicy,
};

const MSG: usize = 1200;
const BATCH: usize = 32;
const END: u64 = u64::MAX;

fn cpu_ns() -> u64 {
    // SAFETY: zeroed rusage is a valid out-parameter.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: valid pointer.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let t = |tv: libc::timeval| tv.tv_sec as u64 * 1_000_000_000 + tv.tv_usec as u64 * 1000;
    t(ru.ru_utime) + t(ru.ru_stime)
}

fn pin_and_prioritise(core: usize) {
    if let Some(ids) = core_affinity::get_core_ids() {
        if let Some(id) = ids.get(core % ids.len()) {
            core_affinity::set_for_current(*id);
        }
    }
    // SCHED_FIFO like the C reference, when allowed (root); otherwise keep the default.
    // RINGMUX_BENCH_NO_FIFO=1 keeps the normal scheduler (RT throttling shows up as ms tails).
    if std::env::var_os("RINGMUX_BENCH_NO_FIFO").is_some() {
        return;
    }
    let p = libc::sched_param { sched_priority: 10 };
    // SAFETY: valid sched_param for this thread.
    unsafe { libc::sched_setscheduler(0, libc::SCHED_FIFO, &p) };
}

fn meta(ts: u64) -> DatagramMeta {
    DatagramMeta {
        remote: "127.0.0.1:4433".parse().unwrap(),
        local_ip: None,
        ecn: 0,
        segment_size: 0,
        rx_timestamp_ns: ts,
    }
}

fn main() {
    if let Ok(mode) = std::env::var("RINGMUX_BENCH_CONSUMER") {
        consumer(&mode);
        return;
    }
    let args: Vec<String> = std::env::args().collect();
    let arg = |k: &str| {
        args.iter()
            .position(|a| a == k)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let seconds: f64 = arg("--seconds").map_or(2.0, |s| s.parse().expect("--seconds"));
    let mode = arg("--mode").unwrap_or_else(|| "all".into());
    let modes: Vec<&str> = if mode == "all" {
        vec!["tput", "lat-spin", "lat-sleep"]
    } else {
        vec![mode.as_str()]
    };
    for m in modes {
        if m == "reset" {
            reset(seconds);
        } else {
            run(m, seconds);
        }
    }
}

/// What a new consumer generation costs the producer's thread (the demux's data plane, which
/// carries out resets): `Producer::reset` of a default-sized ring, which creates, maps and
/// populates a whole new ring and unmaps the old one; and `Producer::reset_with` a ring made
/// beforehand, the old one dropped afterwards, both off the clock (what the demux does, with a
/// helper thread for the two).
fn reset(seconds: f64) {
    let cfg = RingConfig::default();
    let mut p = Producer::create(&cfg).expect("create ring");
    for with_spare in [false, true] {
        let mut hist = hdrhistogram::Histogram::<u64>::new(3).unwrap();
        let end = Instant::now() + Duration::from_secs_f64(seconds);
        while Instant::now() < end {
            let _ = p.try_push(&meta(0), &[0u8; MSG]);
            p.publish();
            if with_spare {
                let spare = Producer::create(&cfg).expect("create ring");
                let t = Instant::now();
                let (_, old) = p.reset_with(spare).expect("reset_with");
                hist.record(t.elapsed().as_nanos() as u64).unwrap();
                drop(old);
            } else {
                let t = Instant::now();
                p.reset().expect("reset");
                hist.record(t.elapsed().as_nanos() as u64).unwrap();
            }
        }
        println!(
            "RES kind=ring impl=ringmux mode={} slots={} slot_bytes={} resets={} p50_us={:.1} p99_us={:.1} max_us={:.1}",
            if with_spare { "reset-with-spare" } else { "reset" },
            cfg.slots,
            cfg.slot_bytes,
            hist.len(),
            hist.value_at_quantile(0.5) as f64 / 1000.0,
            hist.value_at_quantile(0.99) as f64 / 1000.0,
            hist.max() as f64 / 1000.0
        );
    }
}

fn run(mode: &str, seconds: f64) {
    let spin_us = match mode {
        "lat-spin" => 1_000_000,
        "lat-sleep" | "lat-sleep-read" => 0,
        _ => SpinPolicy::DEFAULT_US,
    };
    let cfg = RingConfig::default();
    let mut p = Producer::create(&cfg).expect("create ring");
    let h = p.handles();
    let fds = [
        h.ring.as_raw_fd(),
        h.page.as_raw_fd(),
        h.doorbell.as_raw_fd(),
    ];
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.env("RINGMUX_BENCH_CONSUMER", mode)
        .env("RINGMUX_BENCH_GEN", h.generation.to_string())
        .env("RINGMUX_BENCH_SPIN", spin_us.to_string())
        .stdout(Stdio::piped());
    let setup = move || {
        for (i, fd) in fds.iter().enumerate() {
            // SAFETY: fcntl on a descriptor open in the child; no memory is passed.
            let high = unsafe { libc::fcntl(*fd, libc::F_DUPFD_CLOEXEC, 10) };
            // SAFETY: dup2 of an open descriptor; no memory is passed.
            if high < 0 || unsafe { libc::dup2(high, 3 + i as i32) } < 0 {
                return Err(std::io::Error::last_os_error());
            }
        }
        Ok(())
    };
    // SAFETY: `setup` makes only async-signal-safe calls (fcntl, dup2) between fork and exec.
    unsafe { cmd.pre_exec(setup) };
    let mut child = cmd.spawn().expect("spawn consumer");
    pin_and_prioritise(0);
    let payload = [0x5au8; MSG];
    let warm = Duration::from_millis(300);
    let total = warm + Duration::from_secs_f64(seconds);
    let start = Instant::now();
    let (mut sent, mut sent_measured, mut bells0, mut cpu0) = (0u64, 0u64, 0u64, 0u64);
    let mut measuring = false;
    let mut next = now_ns();
    while start.elapsed() < total {
        if !measuring && start.elapsed() >= warm {
            measuring = true;
            bells0 = p.stats().doorbells;
            cpu0 = cpu_ns();
            sent_measured = sent;
        }
        let batch = if mode == "tput" { BATCH } else { 1 };
        if mode != "tput" {
            while now_ns() < next {
                std::hint::spin_loop();
            }
            next += 20_000;
        }
        for _ in 0..batch {
            let ts = if mode == "tput" { 0 } else { now_ns() };
            loop {
                match p.try_push(&meta(ts), &payload) {
                    Ok(()) => break,
                    Err(PushError::Full) => std::hint::spin_loop(),
                    Err(e) => panic!("{e}"),
                }
            }
        }
        p.publish();
        sent += batch as u64;
    }
    let n = sent - sent_measured;
    let p_cpu = cpu_ns() - cpu0;
    let bells = p.stats().doorbells - bells0;
    loop {
        match p.try_push(&meta(END), b"end") {
            Ok(()) => break,
            Err(PushError::Full) => std::hint::spin_loop(),
            Err(e) => panic!("{e}"),
        }
    }
    p.publish();
    let out = BufReader::new(child.stdout.take().unwrap());
    let line = out
        .lines()
        .map_while(Result::ok)
        .find(|l| l.starts_with("CONSUMER"))
        .unwrap_or_default();
    let _ = child.wait();
    println!(
        "RES kind=ring impl=ringmux mode={mode} pub={} spin_us={spin_us} slots={} p_cpu_ns={:.2} doorbell_per_msg={:.5} {}",
        if mode == "tput" { BATCH } else { 1 },
        cfg.slots,
        p_cpu as f64 / n as f64,
        bells as f64 / n as f64,
        line.trim_start_matches("CONSUMER ")
    );
}

fn consumer(mode: &str) {
    pin_and_prioritise(1);
    let generation = std::env::var("RINGMUX_BENCH_GEN").unwrap().parse().unwrap();
    let spin: u64 = std::env::var("RINGMUX_BENCH_SPIN")
        .unwrap()
        .parse()
        .unwrap();
    let max = Duration::from_micros(spin);
    let take = |fd| {
        // SAFETY: the parent placed the ring's descriptors at 3, 4, 5 for this process, and
        // each is taken once.
        unsafe { OwnedFd::from_raw_fd(fd) }
    };
    let (r, pg, b) = (take(3), take(4), take(5));
    let mut c =
        Consumer::attach(r, pg, b, generation, SpinPolicy::Adaptive { max }).expect("attach");
    let mut hist = hdrhistogram::Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3).unwrap();
    // The C reference's measure: per look that found data, the newest message only. A late
    // wake-up shows there as one short latency (the newest message arrived just before it), so
    // this reads lower than `hist`, which counts every message.
    let mut newest = hist.clone();
    let mut buf = [0u8; 2048];
    let (mut count, mut done) = (0u64, false);
    let (mut first, mut cpu0) = (None::<Instant>, 0u64);
    let lat = mode != "tput";
    let warm = Duration::from_millis(300);
    let mut measured_from = 0u64;
    let mut started_measuring = false;
    while !done {
        // Like the C reference: the clock is read as soon as the wait sees data, before the
        // consumer decodes or copies anything.
        let seen = if lat { now_ns() } else { 0 };
        let mut newest_ts = None;
        let d = c
            .drain(if lat { 4096 } else { BATCH }, |dg| {
                if dg.meta.rx_timestamp_ns == END {
                    done = true;
                    return;
                }
                if lat && started_measuring {
                    let _ = hist.record(seen.saturating_sub(dg.meta.rx_timestamp_ns).max(1));
                    newest_ts = Some(dg.meta.rx_timestamp_ns);
                }
                dg.copy_to(&mut buf);
                count += 1;
            })
            .expect("violation");
        if let Some(ts) = newest_ts {
            let _ = newest.record(seen.saturating_sub(ts).max(1));
        }
        if first.is_none() && d.slots > 0 {
            first = Some(Instant::now());
        }
        if let Some(f) = first {
            if !started_measuring && f.elapsed() >= warm {
                started_measuring = true;
                measured_from = count;
                cpu0 = cpu_ns();
                first = Some(Instant::now());
            }
        }
        if d.slots == 0 && !done {
            if mode == "lat-sleep-read" {
                sleep_in_read(&mut c);
            } else {
                c.wait(Some(Duration::from_secs(1))).expect("wait");
            }
        }
    }
    let el = first.map_or(0.0, |f| f.elapsed().as_secs_f64());
    let n = (count - measured_from) as f64;
    print!(
        "CONSUMER msgs_per_s={:.0} ns_per_msg={:.2} c_cpu_ns={:.2}",
        n / el,
        el / n * 1e9,
        (cpu_ns() - cpu0) as f64 / n
    );
    if lat {
        print!(
            " lat_p50_ns={} lat_p99_ns={} lat_p999_ns={} lat_max_ns={} nlat={}",
            hist.value_at_quantile(0.5),
            hist.value_at_quantile(0.99),
            hist.value_at_quantile(0.999),
            hist.max(),
            hist.len()
        );
        print!(
            " newest_p50_ns={} newest_p99_ns={} newest_p999_ns={} newest_max_ns={} nnewest={}",
            newest.value_at_quantile(0.5),
            newest.value_at_quantile(0.99),
            newest.value_at_quantile(0.999),
            newest.max(),
            newest.len()
        );
    }
    println!();
}

/// Sleeps as the C reference's consumer does: in a blocking `read` of the doorbell, so the
/// wake-up returns straight from it. A worker cannot (its doorbell stays non-blocking for its
/// event loop and is waited on with `poll`/epoll); this mode measures what that difference costs.
/// Both `fcntl`s come before the sleep, off the wake-up's path.
fn sleep_in_read(c: &mut Consumer) {
    use nix::fcntl::{fcntl, FcntlArg, OFlag};
    let set_blocking = |c: &Consumer, blocking: bool| {
        let fd = c.doorbell_fd();
        let flags = fcntl(fd, FcntlArg::F_GETFL).expect("F_GETFL");
        let mut flags = OFlag::from_bits_truncate(flags);
        flags.set(OFlag::O_NONBLOCK, !blocking);
        fcntl(fd, FcntlArg::F_SETFL(flags)).expect("F_SETFL");
    };
    // prepare_sleep clears the doorbell with a read that must not block.
    set_blocking(c, false);
    if !c.prepare_sleep().expect("violation") {
        return;
    }
    set_blocking(c, true);
    // The producer rings for this sleep (it saw the announcement) on its next publish, the END
    // message's included, so the read returns.
    let _ = nix::unistd::read(c.doorbell_fd(), &mut [0u8; 8]);
    c.end_sleep();
}
