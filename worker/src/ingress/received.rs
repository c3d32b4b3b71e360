//! What every forwarding mode hands up, whatever its transport: a datagram's receive metadata
//! as quinn takes it, and the counters of what was received, dropped and slept.

use std::sync::atomic::AtomicU64;

use quinn::udp::{EcnCodepoint, RecvMeta};
use ringmux_ring::DatagramMeta;

/// Datagram counters of one socket.
#[derive(Debug, Default)]
pub struct IngressStats {
    /// Datagrams handed to quinn.
    pub received: AtomicU64,
    /// Datagrams dropped: larger than quinn's buffer, or a descriptor that failed validation.
    pub dropped: AtomicU64,
    /// Times the socket went to sleep on its doorbell.
    pub sleeps: AtomicU64,
    /// Sends that hit `EAGAIN`.
    pub send_would_block: AtomicU64,
}

/// quinn's receive metadata of a datagram of `len` bytes the demux described with `m`.
pub(super) fn recv_meta(m: &DatagramMeta, len: usize) -> RecvMeta {
    RecvMeta {
        addr: m.remote,
        len,
        stride: len,
        ecn: EcnCodepoint::from_bits(m.ecn),
        dst_ip: m.local_ip,
    }
}
