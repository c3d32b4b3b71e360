//! The shared-memory ring as a quinn socket's receive side: drain into quinn's buffers, spin
//! while idle, then sleep on the doorbell (`shm-layout.md`, "Doorbell").

use std::io::{self, IoSliceMut};
use std::os::fd::OwnedFd;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll};
use std::time::Instant;

use quinn::udp::RecvMeta;
use ringmux_ring::Consumer;
use tokio::io::unix::AsyncFd;

use super::received::{recv_meta, IngressStats};

/// The ring's idle bookkeeping between polls.
#[derive(Debug, Default)]
pub(crate) struct Idle {
    /// When the ring was first seen empty in this idle period.
    spin_started: Option<Instant>,
    /// A sleep is announced (`need_wakeup` set).
    sleeping: bool,
    /// Set after a producer protocol violation: the ingress is dead, wait for the supervisor.
    pub(crate) broken: bool,
}

/// Fills `bufs` from the ring. When it runs dry it keeps polling cooperatively (returning
/// `Pending` after waking itself, so timers and sends still run) for the consumer's spin time,
/// then announces a sleep and waits on the doorbell through tokio's reactor (`bell`).
pub(crate) fn poll_recv(
    consumer: &mut Consumer,
    st: &mut Idle,
    bell: &AsyncFd<OwnedFd>,
    stats: &IngressStats,
    cx: &mut Context<'_>,
    bufs: &mut [IoSliceMut<'_>],
    meta: &mut [RecvMeta],
) -> Poll<io::Result<usize>> {
    loop {
        let mut n = 0;
        let mut dropped = 0u64;
        let max = bufs.len().min(meta.len());
        let drained = consumer.drain(max, |d| {
            let buf = &mut bufs[n];
            if d.len() > buf.len() {
                dropped += 1;
                return;
            }
            let len = d.copy_to(buf);
            meta[n] = recv_meta(&d.meta, len);
            n += 1;
        });
        let drained = match drained {
            Ok(d) => d,
            Err(e) => {
                // The demux is the trusted side; a violation means its memory is corrupt.
                // Stop reading (an error here would kill every connection) and let the
                // supervisor notice through the control socket.
                tracing::error!(error = %e, "ring protocol violation by the producer; ingress stopped");
                st.broken = true;
                return Poll::Pending;
            }
        };
        dropped += drained.invalid as u64;
        if dropped > 0 {
            stats.dropped.fetch_add(dropped, Ordering::Relaxed);
        }
        if drained.slots > 0 {
            // The idle period (spin, and sleep if any) ends with this datagram.
            if let Some(started) = st.spin_started.take() {
                if consumer.spin_mut().adapts() {
                    consumer.spin_mut().idle_ended(started.elapsed());
                }
            }
            if st.sleeping {
                st.sleeping = false;
                consumer.end_sleep();
            }
            if n > 0 {
                stats.received.fetch_add(n as u64, Ordering::Relaxed);
                return Poll::Ready(Ok(n));
            }
            continue; // everything drained was dropped: look again
        }
        if st.sleeping {
            match bell.poll_read_ready(cx) {
                Poll::Ready(Ok(mut guard)) => {
                    guard.clear_ready();
                    st.sleeping = false;
                    consumer.end_sleep();
                    if !consumer.spin_mut().adapts() {
                        // The fixed spin starts again after every wake-up, the datagram-less
                        // ones included. Those are mostly the reactor reporting a ring that a
                        // drain already answered; the fresh spin then catches the next
                        // datagram of a request/response exchange that a sleep would have
                        // waited for (one request at a time: 0.97 doorbells per datagram
                        // without it, bench/RESULTS.md).
                        st.spin_started = Some(Instant::now());
                    }
                    // With the adaptive spin, the idle period goes on until a datagram is
                    // drained, so that its length is measured whole.
                    continue;
                }
                Poll::Ready(Err(e)) => {
                    tracing::error!(error = %e, "doorbell registration failed");
                    st.broken = true;
                    return Poll::Pending;
                }
                Poll::Pending => return Poll::Pending,
            }
        }
        let now = Instant::now();
        let started = *st.spin_started.get_or_insert(now);
        // Within the spin budget, or on while the demux says its next batch is near.
        if consumer.spins_on(now.duration_since(started)) {
            // Cooperative spin: let the runtime run timers and sends, then poll again.
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        match consumer.prepare_sleep() {
            Ok(true) => {
                st.sleeping = true;
                stats.sleeps.fetch_add(1, Ordering::Relaxed);
            }
            Ok(false) => {}
            Err(e) => {
                tracing::error!(error = %e, "ring protocol violation by the producer; ingress stopped");
                st.broken = true;
                return Poll::Pending;
            }
        }
    }
}
