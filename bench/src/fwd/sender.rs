//! The load generator: many connected UDP sockets (one per impersonated connection, so many
//! source ports), sending either `sendmmsg` batches of single datagrams (`--gro off`) or UDP GSO
//! trains (`UDP_SEGMENT`, `--gro on`): one `send` carries up to 64 same-4-tuple segments, which
//! loopback delivers as one GRO super-datagram to a socket with `UDP_GRO` set (quinn-udp sets it
//! on ringmux's public socket). The same two shapes as bench.c's `snd=mmsg` and `snd=gso`.

use std::net::{SocketAddr, UdpSocket};
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use serde::Serialize;

use super::datagrams::{fill, Connection, XorShift};
use super::os;

/// `sendmmsg` batch in `--gro off` mode (bench.c's `sb`).
const MMSG_BATCH: usize = 32;
const _: () = assert!(MMSG_BATCH <= os::SENDMMSG_MAX);
/// The kernel's limit on segments per GSO send (`UDP_MAX_SEGMENTS`).
const MAX_GSO_SEGMENTS: usize = 64;
/// Largest UDP payload over IPv4.
const MAX_UDP_PAYLOAD: usize = 65_507;

/// How datagrams leave the sender.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum SendShape {
    /// `sendmmsg` of single datagrams: every datagram is its own skb, no coalescing.
    Mmsg,
    /// UDP GSO trains of one connection each: the receiver's GRO keeps them together.
    Gso,
}

/// What one sending session did.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct SendStats {
    pub datagrams: u64,
    pub calls: u64,
    pub errors: u64,
    pub cpu_ns: u64,
    pub elapsed_s: f64,
}

/// The sockets, the connections they impersonate and the datagram buffer.
pub struct Blaster {
    socks: Vec<UdpSocket>,
    conns: Vec<Connection>,
    size: usize,
    shape: SendShape,
    /// Datagrams per call: the GSO segment count or the `sendmmsg` batch.
    per_call: usize,
    buf: Vec<u8>,
    next: usize,
    seq: u64,
    rng: XorShift,
}

impl Blaster {
    /// One socket per connection, each bound to an ephemeral port on the target's loopback
    /// family and connected to `target`.
    pub fn new(
        target: SocketAddr,
        conns: Vec<Connection>,
        size: usize,
        shape: SendShape,
    ) -> Result<Self> {
        anyhow::ensure!(!conns.is_empty(), "no connections to send on");
        anyhow::ensure!(
            (64..=MAX_UDP_PAYLOAD).contains(&size),
            "--size {size}: expected 64 to {MAX_UDP_PAYLOAD}"
        );
        let per_call = match shape {
            SendShape::Mmsg => MMSG_BATCH,
            SendShape::Gso => (MAX_UDP_PAYLOAD / size).clamp(1, MAX_GSO_SEGMENTS),
        };
        let bind: SocketAddr = if target.is_ipv4() {
            "127.0.0.1:0".parse()?
        } else {
            "[::1]:0".parse()?
        };
        let mut socks = Vec::with_capacity(conns.len());
        for _ in &conns {
            let s = UdpSocket::bind(bind).context("binding a sender socket")?;
            s.connect(target)
                .with_context(|| format!("connecting a sender socket to {target}"))?;
            if shape == SendShape::Gso {
                nix::sys::socket::setsockopt(
                    &s,
                    nix::sys::socket::sockopt::UdpGsoSegment,
                    &(size as i32),
                )
                .context("UDP_SEGMENT (GSO) on the sender socket")?;
            }
            // Best effort: a large send buffer avoids blocking on skb memory.
            let _ = nix::sys::socket::setsockopt(
                &s,
                nix::sys::socket::sockopt::SndBufForce,
                &(8 << 20),
            );
            socks.push(s);
        }
        let mut buf = vec![0xab; per_call * size];
        for (i, d) in buf.chunks_mut(size).enumerate() {
            d[0] = i as u8;
        }
        Ok(Blaster {
            socks,
            conns,
            size,
            shape,
            per_call,
            buf,
            next: 0,
            seq: 0,
            rng: XorShift::new(0x9e37_79b9_7f4a_7c15),
        })
    }

    /// Datagrams one send call carries at most.
    pub fn per_call(&self) -> usize {
        self.per_call
    }

    /// Sends `n` datagrams as fast as possible (the saturated pre-fill).
    pub fn send_n(&mut self, n: u64) -> SendStats {
        let t0 = Instant::now();
        let c0 = os::thread_cpu_ns();
        let mut st = SendStats::default();
        while st.datagrams < n {
            let k = (n - st.datagrams).min(self.per_call as u64) as usize;
            self.one_call(k, &mut st);
        }
        st.cpu_ns = os::thread_cpu_ns() - c0;
        st.elapsed_s = t0.elapsed().as_secs_f64();
        st
    }

    /// Sends for `duration`, paced to `rate` datagrams/s if given, until `stop` is set.
    pub fn blast(&mut self, duration: Duration, rate: Option<u64>, stop: &AtomicBool) -> SendStats {
        let t0 = Instant::now();
        let c0 = os::thread_cpu_ns();
        let mut st = SendStats::default();
        while !stop.load(Ordering::Relaxed) {
            let elapsed = t0.elapsed();
            if elapsed >= duration {
                break;
            }
            if let Some(rate) = rate.filter(|r| *r > 0) {
                // Pacing as bench.c does: sleep when ahead of schedule.
                let due = Duration::from_secs_f64(st.datagrams as f64 / rate as f64);
                if due > elapsed {
                    std::thread::sleep(due - elapsed);
                }
            }
            self.one_call(self.per_call, &mut st);
        }
        st.cpu_ns = os::thread_cpu_ns() - c0;
        st.elapsed_s = t0.elapsed().as_secs_f64();
        st
    }

    /// One send call of `k` datagrams on the next socket in turn.
    fn one_call(&mut self, k: usize, st: &mut SendStats) {
        let i = self.next;
        self.next = (self.next + 1) % self.socks.len();
        let cid = &self.conns[i].cid;
        for d in self.buf.chunks_mut(self.size).take(k) {
            fill(d, cid, self.seq, &mut self.rng);
            self.seq += 1;
        }
        let fd = self.socks[i].as_fd();
        let r = match self.shape {
            SendShape::Gso => os::send(fd, &self.buf[..k * self.size]).map(|_| k),
            SendShape::Mmsg => os::sendmmsg(fd, &self.buf, self.size, k),
        };
        st.calls += 1;
        match r {
            Ok(sent) => st.datagrams += sent as u64,
            Err(_) => st.errors += 1,
        }
    }
}
