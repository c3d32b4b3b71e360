//! `ringmux-fault-worker`: a test tool, not part of a deployment. Given to `ringmux` as
//! `--worker-bin`, it behaves as a broken or hostile worker for one instance, once, and as the
//! real worker otherwise, so tests can check that the demux survives, counts, resets the ring
//! and restarts the worker while the other instances carry on.
//!
//! Environment (inherited from the demux):
//! - `RINGMUX_REAL_WORKER`: path of the real `ringmux-worker` (exec'd for every other case);
//! - `RINGMUX_FAULT`: `head-ahead` (writes a head far beyond the tail), `head-backwards`
//!   (consumes, then moves head back), `stop-draining` (attaches, reports ready, never drains),
//!   `die-mid-batch` (reads part of a batch, then aborts), `flip-wakeup` (drains, but flips
//!   `need_wakeup` wildly), `jam-doorbell` (fills its eventfd's counter to the maximum, clears
//!   `O_NONBLOCK` on the file description it shares with the demux and announces a sleep, so
//!   that the demux's next doorbell write would block);
//! - `RINGMUX_FAULT_INSTANCE`: the instance to break (default 1);
//! - `RINGMUX_FAULT_MARKER`: a file created when the fault is played; if it exists, behave.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::time::{Duration, Instant};

use ringmux_ring::Consumer;
use ringmux_worker::control::{self, Handoff};

fn main() {
    let control_fd: i32 = std::env::var("RINGMUX_CONTROL_FD")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3);
    let fault = std::env::var("RINGMUX_FAULT").unwrap_or_default();
    let target: u8 = std::env::var("RINGMUX_FAULT_INSTANCE")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    let marker =
        std::env::var("RINGMUX_FAULT_MARKER").unwrap_or_else(|_| "/nonexistent/marker".into());
    // SAFETY: the demux handed us this descriptor.
    let control = unsafe { BorrowedFd::borrow_raw(control_fd) };
    let handoff = peek_handoff(control);
    let ours = handoff.as_ref().is_some_and(|h| h.instance == target);
    if !ours || std::path::Path::new(&marker).exists() || fault.is_empty() {
        let real = std::env::var("RINGMUX_REAL_WORKER")
            .expect("RINGMUX_REAL_WORKER must name the real worker");
        let e = std::process::Command::new(real).exec();
        panic!("exec of the real worker failed: {e}");
    }
    let _ = std::fs::write(&marker, fault.as_bytes());
    // SAFETY: as above; from here on this process owns the control socket.
    let control = unsafe { OwnedFd::from_raw_fd(control_fd) };
    let (h, fds) = control::recv_handoff(control.as_fd()).expect("hand-off");
    let mut fds = fds.into_iter();
    let _public = fds.next();
    let (ring, page, bell) = (
        fds.next().unwrap(),
        fds.next().unwrap(),
        fds.next().unwrap(),
    );
    let page_map = map_rw(page.try_clone().unwrap());
    let bell_fd = bell.as_raw_fd();
    let mut c = Consumer::attach(ring, page, bell, h.generation, Duration::ZERO).expect("attach");
    control::send(control.as_fd(), b"READY").expect("ready");
    eprintln!("fault-worker: instance {} plays {fault}", h.instance);
    let head = page_map.cast::<u64>();
    let flag = page_map.wrapping_add(8).cast::<u32>();
    match fault.as_str() {
        // Writes below: `page_map` is a live 4096-byte shared mapping; volatile stores are how
        // a foreign process's writes look to the demux.
        "head-ahead" => {
            // SAFETY: as above.
            unsafe { head.write_volatile(u64::MAX / 2) }
        }
        "head-backwards" => {
            drain_for(&mut c, Duration::from_secs(30), 10);
            // SAFETY: as above.
            unsafe { head.write_volatile(0) };
        }
        "stop-draining" => {}
        "die-mid-batch" => {
            drain_for(&mut c, Duration::from_secs(30), 3);
            let _ = c.drain(2, |_| {});
            std::process::abort();
        }
        "flip-wakeup" => {
            let end = Instant::now() + Duration::from_secs(3);
            let mut x = 0x9e37_79b9u32;
            while Instant::now() < end {
                let _ = c.drain(64, |_| {});
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                // SAFETY: as above.
                unsafe { flag.write_volatile(x) };
            }
        }
        "jam-doorbell" => {
            let max: u64 = 0xffff_ffff_ffff_fffe;
            // SAFETY: an 8-byte write from a live u64, then fcntl, on the doorbell we were given
            // (the Consumer keeps it open).
            unsafe {
                assert_eq!(libc::write(bell_fd, (&max as *const u64).cast(), 8), 8);
                let flags = libc::fcntl(bell_fd, libc::F_GETFL);
                assert_eq!(
                    libc::fcntl(bell_fd, libc::F_SETFL, flags & !libc::O_NONBLOCK),
                    0
                );
            }
            // SAFETY: as above.
            unsafe { flag.write_volatile(0x5eed) };
        }
        other => panic!("unknown RINGMUX_FAULT {other:?}"),
    }
    // Stay alive (keeping the control socket open) until the demux kills us or goes away.
    let mut buf = [0u8; 256];
    let _ = socket2::SockRef::from(&control).set_nonblocking(false);
    while let Ok(Some(_)) = control::recv_with_fds(control.as_fd(), &mut buf) {}
}

/// Drains until at least `n` datagrams were seen or `limit` passes.
fn drain_for(c: &mut Consumer, limit: Duration, n: usize) {
    let end = Instant::now() + limit;
    let mut seen = 0;
    while seen < n && Instant::now() < end {
        seen += c.drain(1, |_| {}).map(|d| d.slots).unwrap_or(0);
        if seen < n {
            let _ = c.wait(Some(Duration::from_millis(50)));
        }
    }
}

/// Reads the hand-off without consuming it (MSG_PEEK), to decide whether to misbehave.
fn peek_handoff(sock: BorrowedFd<'_>) -> Option<Handoff> {
    let mut buf = vec![0u8; control::MAX_MESSAGE];
    let mut cbuf = [0u64; 16];
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: a zeroed msghdr is valid; it points at live buffers.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    msg.msg_controllen = std::mem::size_of_val(&cbuf);
    // SAFETY: msg describes live buffers. Peeked descriptors arrive close-on-exec and are
    // closed below.
    let n = unsafe {
        libc::recvmsg(
            sock.as_raw_fd(),
            &mut msg,
            libc::MSG_PEEK | libc::MSG_CMSG_CLOEXEC,
        )
    };
    // SAFETY: walking the control buffer the kernel filled.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let count = ((*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize) / 4;
                let data = libc::CMSG_DATA(c).cast::<i32>();
                for i in 0..count {
                    libc::close(data.add(i).read_unaligned());
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    if n <= 0 {
        return None;
    }
    Handoff::decode(std::str::from_utf8(&buf[..n as usize]).ok()?).ok()
}

/// Maps a consumer page read-write, as any worker may.
fn map_rw(page: OwnedFd) -> *mut u8 {
    // SAFETY: mapping 4096 bytes of a descriptor we own; checked below.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            4096,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            page.as_raw_fd(),
            0,
        )
    };
    assert_ne!(p, libc::MAP_FAILED, "mmap of the consumer page");
    p.cast()
}
