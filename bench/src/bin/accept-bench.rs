//! How workers should share a TCP port: one listening socket every worker accepts from (one
//! accept queue), or an `SO_REUSEPORT` group with a listening socket per worker (a queue each,
//! the kernel hashing each new connection to one of them). Measured side by side, in
//! interleaved rounds, on loopback:
//!
//! * **rate**: short connections (connect, one byte back, close) from `--clients` threads to
//!   `--acceptors` accepting threads, connections per second and each acceptor's share;
//! * **restart**: the same load while acceptor 0 restarts every `--restart-ms` (it is gone for
//!   `--gone-ms`, as a worker is while a new one starts): with one queue its connections wait
//!   for the others; with a group its socket closes, and the connections already hashed to its
//!   queue are reset. Failed connections are counted.
//!
//! Usage: `accept-bench [--seconds S] [--rounds N] [--acceptors K] [--clients C]
//! [--restart-ms R] [--gone-ms G]`. Prints one line per mode and round, then the medians.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Parser;
use socket2::{Domain, Socket, Type};

#[derive(Parser, Debug)]
#[command(about = "One shared accept queue against an SO_REUSEPORT group, side by side")]
struct Args {
    /// Seconds per measurement.
    #[arg(long, default_value_t = 3)]
    seconds: u64,
    /// Interleaved rounds (each runs every mode and case once).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Accepting threads (the workers).
    #[arg(long, default_value_t = 2)]
    acceptors: usize,
    /// Connecting threads.
    #[arg(long, default_value_t = 4)]
    clients: usize,
    /// In the restart case, acceptor 0 restarts this often (ms).
    #[arg(long, default_value_t = 200)]
    restart_ms: u64,
    /// ... and is gone this long each time (ms).
    #[arg(long, default_value_t = 50)]
    gone_ms: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Shared,
    Reuseport,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Shared => "shared queue",
            Mode::Reuseport => "reuseport group",
        }
    }
}

/// What one measurement came to.
#[derive(Debug, Clone)]
struct Outcome {
    per_second: f64,
    /// Each acceptor's share of the accepted connections, smallest and largest.
    share: (f64, f64),
    failed: u64,
}

/// A listening socket on `addr` (port 0: a free one), in a reuseport group when asked.
fn listener(addr: SocketAddr, reuseport: bool) -> std::io::Result<TcpListener> {
    let s = Socket::new(Domain::for_address(addr), Type::STREAM, None)?;
    s.set_reuse_address(true)?;
    if reuseport {
        s.set_reuse_port(true)?;
    }
    s.bind(&addr.into())?;
    s.listen(1024)?;
    Ok(s.into())
}

/// Accepts on whatever socket `slot` holds until `stop`; answers each connection with one
/// byte and closes it. Returns when its socket is shut down and `stop` is set.
fn acceptor(slot: Arc<Mutex<Arc<TcpListener>>>, accepted: Arc<AtomicU64>, stop: Arc<AtomicBool>) {
    loop {
        let l = slot.lock().map(|l| l.clone());
        let Ok(l) = l else { return };
        match l.accept() {
            Ok((mut s, _)) => {
                let _ = s.write_all(b"x");
                accepted.fetch_add(1, Ordering::Relaxed);
            }
            Err(_) => {
                if stop.load(Ordering::Relaxed) {
                    return;
                }
                // Shut down for a restart: wait for the new socket.
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }
}

/// Connects, reads the byte and the end, until `stop`; counts successes and failures.
fn client(addr: SocketAddr, done: Arc<AtomicU64>, failed: Arc<AtomicU64>, stop: Arc<AtomicBool>) {
    let mut buf = [0u8; 8];
    while !stop.load(Ordering::Relaxed) {
        let ok = TcpStream::connect_timeout(&addr, Duration::from_secs(2)).and_then(|mut s| {
            s.set_read_timeout(Some(Duration::from_secs(2)))?;
            let mut got = 0;
            loop {
                match s.read(&mut buf)? {
                    0 => break,
                    n => got += n,
                }
            }
            if got == 1 {
                Ok(())
            } else {
                Err(std::io::Error::other("no answer"))
            }
        });
        match ok {
            Ok(()) => done.fetch_add(1, Ordering::Relaxed),
            Err(_) => failed.fetch_add(1, Ordering::Relaxed),
        };
    }
}

fn measure(args: &Args, mode: Mode, restart: bool) -> std::io::Result<Outcome> {
    let reuseport = mode == Mode::Reuseport;
    let first = Arc::new(listener("127.0.0.1:0".parse().unwrap(), reuseport)?);
    let addr = first.local_addr()?;
    let slots: Vec<Arc<Mutex<Arc<TcpListener>>>> = (0..args.acceptors)
        .map(|i| {
            let l = if i == 0 || !reuseport {
                first.clone()
            } else {
                Arc::new(listener(addr, true)?)
            };
            Ok(Arc::new(Mutex::new(l)))
        })
        .collect::<std::io::Result<_>>()?;
    let stop = Arc::new(AtomicBool::new(false));
    let accepted: Vec<Arc<AtomicU64>> = (0..args.acceptors).map(|_| Arc::default()).collect();
    let acceptors: Vec<_> = slots
        .iter()
        .zip(&accepted)
        .map(|(slot, n)| {
            let (slot, n, stop) = (slot.clone(), n.clone(), stop.clone());
            std::thread::spawn(move || acceptor(slot, n, stop))
        })
        .collect();
    let (done, failed, stop_clients) = (
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicBool::new(false)),
    );
    let clients: Vec<_> = (0..args.clients)
        .map(|_| {
            let (d, f, s) = (done.clone(), failed.clone(), stop_clients.clone());
            std::thread::spawn(move || client(addr, d, f, s))
        })
        .collect();
    let start = Instant::now();
    let end = start + Duration::from_secs(args.seconds);
    while Instant::now() < end {
        if !restart {
            std::thread::sleep(end.saturating_duration_since(Instant::now()));
            break;
        }
        std::thread::sleep(Duration::from_millis(args.restart_ms));
        // Acceptor 0 goes away for `gone_ms`. In a group its socket goes with it (and the
        // connections in its queue); with one queue the socket stays, held by the others.
        let gone = Duration::from_millis(args.gone_ms);
        if reuseport {
            let new = {
                let mut slot = slots[0].lock().unwrap();
                let old = slot.clone();
                // Wakes the acceptor out of accept; closing the last reference resets the
                // connections still queued on it.
                let _ =
                    nix::sys::socket::shutdown(old.as_raw_fd(), nix::sys::socket::Shutdown::Both);
                drop(old);
                std::thread::sleep(gone);
                let new = Arc::new(listener(addr, true)?);
                *slot = new.clone();
                new
            };
            drop(new);
        } else {
            // The acceptor stops taking connections for a while; the queue stays.
            let slot = slots[0].lock().unwrap();
            std::thread::sleep(gone);
            drop(slot);
        }
    }
    let elapsed = start.elapsed().as_secs_f64();
    stop_clients.store(true, Ordering::Relaxed);
    for c in clients {
        let _ = c.join();
    }
    stop.store(true, Ordering::Relaxed);
    for slot in &slots {
        if let Ok(l) = slot.lock() {
            let _ = nix::sys::socket::shutdown(l.as_raw_fd(), nix::sys::socket::Shutdown::Both);
        }
    }
    for a in acceptors {
        let _ = a.join();
    }
    let counts: Vec<u64> = accepted.iter().map(|a| a.load(Ordering::Relaxed)).collect();
    let total: u64 = counts.iter().sum::<u64>().max(1);
    let shares: Vec<f64> = counts.iter().map(|&c| c as f64 / total as f64).collect();
    Ok(Outcome {
        per_second: done.load(Ordering::Relaxed) as f64 / elapsed,
        share: (
            shares.iter().copied().fold(f64::INFINITY, f64::min),
            shares.iter().copied().fold(0.0, f64::max),
        ),
        failed: failed.load(Ordering::Relaxed),
    })
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    anyhow::ensure!(args.acceptors >= 2, "--acceptors must be at least 2");
    anyhow::ensure!(
        args.rounds >= 1 && args.seconds >= 1,
        "--rounds and --seconds must be at least 1"
    );
    let cases = [
        (Mode::Shared, false),
        (Mode::Reuseport, false),
        (Mode::Shared, true),
        (Mode::Reuseport, true),
    ];
    let mut results: Vec<Vec<Outcome>> = vec![Vec::new(); cases.len()];
    for round in 1..=args.rounds {
        for (i, &(mode, restart)) in cases.iter().enumerate() {
            let o = measure(&args, mode, restart)?;
            println!(
                "round {round} {:<16} {:<8} {:>9.0} conn/s  share {:.2}-{:.2}  failed {}",
                mode.name(),
                if restart { "restart" } else { "steady" },
                o.per_second,
                o.share.0,
                o.share.1,
                o.failed
            );
            results[i].push(o);
        }
    }
    println!(
        "\nmedians over {} rounds ({} acceptors, {} clients, {} s each; restart: acceptor 0 gone {} ms every {} ms)",
        args.rounds, args.acceptors, args.clients, args.seconds, args.gone_ms, args.restart_ms
    );
    println!("| mode | case | connections/s | acceptor share (min-max) | failed connections |");
    println!("|---|---|---|---|---|");
    for (i, &(mode, restart)) in cases.iter().enumerate() {
        let r = &results[i];
        println!(
            "| {} | {} | {:.0} | {:.2}-{:.2} | {:.0} |",
            mode.name(),
            if restart { "restart" } else { "steady" },
            median(r.iter().map(|o| o.per_second).collect()),
            median(r.iter().map(|o| o.share.0).collect()),
            median(r.iter().map(|o| o.share.1).collect()),
            median(r.iter().map(|o| o.failed as f64).collect()),
        );
    }
    Ok(())
}
