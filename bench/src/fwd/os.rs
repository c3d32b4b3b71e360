//! What the harness reads from and asks of the kernel: per-thread CPU time (`schedstat`, in
//! nanoseconds, unlike the 10 ms ticks of `/proc/PID/stat`), thread states and names, the
//! public socket's queue and drop counters (`/proc/net/udp`), CPU affinity, SCHED_FIFO,
//! signals, and the load generator's sends. It never writes to `/proc` and never touches a
//! process it did not start. Every system call of the bench crate is wrapped here.

use std::cell::RefCell;
use std::io::{self, IoSlice};
use std::os::fd::{AsRawFd, BorrowedFd};
use std::time::{Duration, Instant};

use nix::sys::socket::{self, ControlMessage, MsgFlags, MultiHeaders};

/// CPU accounting of one thread from `/proc/PID/task/TID/schedstat` (kernel `sched_info`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SchedStat {
    /// Time on CPU, ns.
    pub cpu_ns: u64,
    /// Time runnable but waiting for a CPU, ns.
    pub wait_ns: u64,
}

impl std::ops::Sub for SchedStat {
    type Output = SchedStat;
    fn sub(self, o: SchedStat) -> SchedStat {
        SchedStat {
            cpu_ns: self.cpu_ns.saturating_sub(o.cpu_ns),
            wait_ns: self.wait_ns.saturating_sub(o.wait_ns),
        }
    }
}

/// `schedstat` of thread `tid` of process `pid`.
pub fn schedstat(pid: u32, tid: u32) -> io::Result<SchedStat> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/schedstat"))?;
    let mut f = s.split_ascii_whitespace().map(|v| v.parse::<u64>());
    match (f.next(), f.next()) {
        (Some(Ok(cpu_ns)), Some(Ok(wait_ns))) => Ok(SchedStat { cpu_ns, wait_ns }),
        _ => Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("/proc/{pid}/task/{tid}/schedstat: {s:?}"),
        )),
    }
}

/// Thread ids of a process.
pub fn threads(pid: u32) -> io::Result<Vec<u32>> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(format!("/proc/{pid}/task"))? {
        if let Some(tid) = e?.file_name().to_str().and_then(|s| s.parse().ok()) {
            out.push(tid);
        }
    }
    Ok(out)
}

/// On-CPU time of every thread of `pid`, summed, ns (threads that exited are not counted, so
/// take it before and after a window in which the thread set does not change).
pub fn process_cpu_ns(pid: u32) -> io::Result<u64> {
    let mut sum = 0;
    for tid in threads(pid)? {
        // A thread may exit between the listing and the read.
        if let Ok(s) = schedstat(pid, tid) {
            sum += s.cpu_ns;
        }
    }
    Ok(sum)
}

/// The thread of `pid` whose `comm` is `name` (e.g. ringmux's `data-plane`).
pub fn thread_by_name(pid: u32, name: &str) -> io::Result<Option<u32>> {
    for tid in threads(pid)? {
        if let Ok(comm) = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/comm")) {
            if comm.trim_end() == name {
                return Ok(Some(tid));
            }
        }
    }
    Ok(None)
}

/// Scheduler state letter of a thread (`R`, `S`, `T` stopped, ...), from `/proc/.../stat`.
pub fn thread_state(pid: u32, tid: u32) -> io::Result<char> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/stat"))?;
    // The command name may contain spaces and parentheses: the state follows the last ')'.
    s.rfind(')')
        .and_then(|i| s[i + 1..].trim_start().chars().next())
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "unparsable stat"))
}

/// Waits until thread `tid` is in one of `states`; false on timeout.
pub fn wait_state(pid: u32, tid: u32, states: &[char], timeout: Duration) -> io::Result<bool> {
    let deadline = Instant::now() + timeout;
    loop {
        if states.contains(&thread_state(pid, tid)?) {
            return Ok(true);
        }
        if Instant::now() >= deadline {
            return Ok(false);
        }
        std::thread::sleep(Duration::from_micros(100));
    }
}

/// A UDP socket's receive queue as `/proc/net/udp` shows it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UdpQueue {
    /// Bytes queued (truesize accounting, not payload bytes).
    pub rx_queue: u64,
    /// Datagrams the kernel dropped on this socket (receive buffer full).
    pub drops: u64,
}

/// The socket bound to local `port` in `/proc/net/udp` or `/proc/net/udp6`.
pub fn udp_queue(port: u16) -> io::Result<Option<UdpQueue>> {
    for file in ["/proc/net/udp", "/proc/net/udp6"] {
        let text = match std::fs::read_to_string(file) {
            Ok(t) => t,
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => return Err(e),
        };
        if let Some(q) = parse_udp_table(&text, port) {
            return Ok(Some(q));
        }
    }
    Ok(None)
}

/// The queue and drops of the sockets bound to `port`, added up: one socket, or under kernel
/// steering every socket of the `SO_REUSEPORT` group.
fn parse_udp_table(text: &str, port: u16) -> Option<UdpQueue> {
    let want = format!("{port:04X}");
    let mut found: Option<UdpQueue> = None;
    for line in text.lines().skip(1) {
        let f: Vec<&str> = line.split_ascii_whitespace().collect();
        // sl local rem st tx:rx tr:when retrnsmt uid timeout inode ref pointer drops
        if f.len() < 13 || f[1].rsplit(':').next() != Some(want.as_str()) {
            continue;
        }
        let rx = f[4].split(':').nth(1)?;
        let q = found.get_or_insert_with(UdpQueue::default);
        q.rx_queue += u64::from_str_radix(rx, 16).ok()?;
        q.drops += f[12].parse::<u64>().ok()?;
    }
    found
}

/// Busy time of every CPU of the box since boot, ns: user, nice, system, irq, softirq and
/// steal from `/proc/stat` (idle and iowait left out), so kernel work on any CPU (the
/// network stack's softirqs included) counts wherever it ran.
pub fn box_busy_ns() -> io::Result<u64> {
    let stat = std::fs::read_to_string("/proc/stat")?;
    let line = stat
        .lines()
        .find(|l| l.starts_with("cpu "))
        .ok_or_else(|| io::Error::other("/proc/stat has no cpu line"))?;
    let f: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .map(|v| v.parse().unwrap_or(0))
        .collect();
    let get = |i: usize| f.get(i).copied().unwrap_or(0);
    // user nice system idle iowait irq softirq steal: guest time is counted in user already.
    let ticks = get(0) + get(1) + get(2) + get(5) + get(6) + get(7);
    let hz = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
        .ok()
        .flatten()
        .filter(|&h| h > 0)
        .unwrap_or(100) as u64;
    Ok(ticks.saturating_mul(1_000_000_000) / hz)
}

/// The load average line, recorded with every result (this box is shared).
pub fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

/// Number of online CPUs.
pub fn online_cpus() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Pins the calling thread to `cpu`.
pub fn pin_current(cpu: usize) -> io::Result<()> {
    set_affinity(0, cpu)
}

/// Pins thread `tid` (0: the caller) to `cpu`.
pub fn set_affinity(tid: u32, cpu: usize) -> io::Result<()> {
    let mut set = nix::sched::CpuSet::new();
    set.set(cpu)?;
    nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(tid as i32), &set)?;
    Ok(())
}

/// Puts thread `tid` in SCHED_FIFO at `priority` (root only), as bench.c does with its demux
/// (`dfifo`) and consumer (`cfifo`) so the other users of a shared box do not preempt them.
pub fn set_fifo(tid: u32, priority: i32) -> io::Result<()> {
    let p = libc::sched_param {
        sched_priority: priority,
    };
    // SAFETY: valid sched_param pointer; the kernel validates tid and priority.
    let r = unsafe { libc::sched_setscheduler(tid as libc::pid_t, libc::SCHED_FIFO, &p) };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Every thread of `pid` in SCHED_FIFO at `priority`.
pub fn set_fifo_process(pid: u32, priority: i32) -> io::Result<()> {
    for tid in threads(pid)? {
        set_fifo(tid, priority)?;
    }
    Ok(())
}

/// Sends `sig` to process `pid` (one the harness started).
pub fn signal(pid: u32, sig: libc::c_int) -> io::Result<()> {
    let sig = nix::sys::signal::Signal::try_from(sig)?;
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), sig)?;
    Ok(())
}

/// Blocks SIGINT in the calling thread, for good: a Ctrl-C stays pending and never acts. Call it
/// while the process has only this thread, and it is as if SIGINT were ignored (children
/// spawned earlier are not affected; those spawned later start with an empty mask anyway).
pub fn hold_sigint() -> io::Result<()> {
    use nix::sys::signal::{SigSet, Signal};
    let mut set = SigSet::empty();
    set.add(Signal::SIGINT);
    set.thread_block()?;
    Ok(())
}

/// One `send(2)` of `buf` on connected socket `fd` (a GSO train when `UDP_SEGMENT` is set).
pub fn send(fd: BorrowedFd<'_>, buf: &[u8]) -> io::Result<usize> {
    Ok(socket::send(fd.as_raw_fd(), buf, MsgFlags::empty())?)
}

/// Most datagrams one [`sendmmsg`] call sends.
pub const SENDMMSG_MAX: usize = 64;

thread_local! {
    /// The message headers of [`sendmmsg`], allocated once per sending thread.
    static MMSG_HEADERS: RefCell<MultiHeaders<()>> =
        RefCell::new(MultiHeaders::preallocate(SENDMMSG_MAX, None));
}

/// One `sendmmsg(2)` of the first `k` (at most [`SENDMMSG_MAX`]) `size`-byte datagrams of
/// `buf` on connected socket `fd`, one datagram per message; returns how many the kernel took.
/// Allocates nothing after a thread's first call.
pub fn sendmmsg(fd: BorrowedFd<'_>, buf: &[u8], size: usize, k: usize) -> io::Result<usize> {
    let k = k.min(SENDMMSG_MAX).min(buf.len() / size.max(1));
    let mut iovs = [[IoSlice::new(&[])]; SENDMMSG_MAX];
    for (v, d) in iovs.iter_mut().zip(buf.chunks_exact(size.max(1))).take(k) {
        *v = [IoSlice::new(d)];
    }
    let addrs = [None::<()>; SENDMMSG_MAX];
    let cmsgs: [ControlMessage<'_>; 0] = [];
    MMSG_HEADERS.with_borrow_mut(|headers| {
        let sent = socket::sendmmsg(
            fd.as_raw_fd(),
            headers,
            &iovs[..k],
            addrs,
            cmsgs,
            MsgFlags::empty(),
        )?;
        Ok(sent.count())
    })
}

/// CPU time of the calling thread, ns (`CLOCK_THREAD_CPUTIME_ID`).
pub fn thread_cpu_ns() -> u64 {
    use nix::time::{clock_gettime, ClockId};
    clock_gettime(ClockId::CLOCK_THREAD_CPUTIME_ID).map_or(0, |ts| {
        ts.tv_sec() as u64 * 1_000_000_000 + ts.tv_nsec() as u64
    })
}

/// CPU time of the calling process, every thread, user and system, ns
/// (`CLOCK_PROCESS_CPUTIME_ID`).
pub fn own_process_cpu_ns() -> u64 {
    use nix::time::{clock_gettime, ClockId};
    clock_gettime(ClockId::CLOCK_PROCESS_CPUTIME_ID).map_or(0, |ts| {
        ts.tv_sec() as u64 * 1_000_000_000 + ts.tv_nsec() as u64
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn udp_table_line() {
        let t = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode ref pointer drops\n\
                 1234: 0100007F:A0B1 00000000:0000 07 00000000:0001F400 00:00000000 00000000     0        0 99 2 0000000000000000 17\n";
        assert_eq!(
            parse_udp_table(t, 0xa0b1),
            Some(UdpQueue {
                rx_queue: 0x1f400,
                drops: 17
            })
        );
        assert_eq!(parse_udp_table(t, 0xa0b2), None);
    }

    #[test]
    fn sendmmsg_sends_one_datagram_per_message_and_reuses_its_headers() {
        use std::os::fd::AsFd;
        let rx = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        rx.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let tx = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        tx.connect(rx.local_addr().unwrap()).unwrap();
        let buf: Vec<u8> = (0..5u8).flat_map(|i| [i; 100]).collect();
        for k in [99, 3] {
            let sent = sendmmsg(tx.as_fd(), &buf, 100, k).unwrap();
            assert_eq!(sent, k.min(5));
            for i in 0..sent {
                let mut b = [0u8; 200];
                let n = rx.recv(&mut b).unwrap();
                assert_eq!(&b[..n], &[i as u8; 100][..]);
            }
        }
    }

    #[test]
    fn own_threads_are_visible() {
        let pid = std::process::id();
        assert!(!threads(pid).unwrap().is_empty());
        assert!(process_cpu_ns(pid).unwrap() > 0);
        let tid = nix::unistd::gettid().as_raw() as u32;
        assert_eq!(thread_state(pid, tid).unwrap(), 'R');
    }
}
