//! `unix`: the design ringmux replaces, kept to measure against: one `sendmsg` per datagram on
//! a `SOCK_SEQPACKET` socket per instance, the 64-byte slot descriptor then the payload (the
//! framing of `control-protocol.md`, decoded by `ringmux_worker::ingress::recv_unix`).

use std::io::{self, IoSlice};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};

use ringmux_ring::layout::SlotDesc;

use super::handover::{Ingress, IngressState};
use super::{AdoptError, Forward, IngressHandles, Setup};
use crate::metrics::DropReason;
use crate::sys;

/// The demux's end of every lane's socket; a lane without a worker generation has none.
pub struct Unix {
    sockets: Vec<Option<OwnedFd>>,
}

impl Unix {
    /// One socket pair per lane of the first generation.
    pub fn create(setup: &Setup<'_>) -> io::Result<(Self, Vec<IngressHandles>)> {
        let mut sockets: Vec<Option<OwnedFd>> = (0..setup.lanes).map(|_| None).collect();
        let mut handles = Vec::new();
        for socket in sockets.iter_mut().take(usize::from(setup.instances)) {
            let (ours, theirs) = pair()?;
            *socket = Some(ours);
            handles.push(IngressHandles::Unix(theirs));
        }
        Ok((Unix { sockets }, handles))
    }

    /// The sockets a previous process image of the demux handed over, one entry per lane.
    pub fn adopt(setup: &Setup<'_>, lanes: Vec<Option<Ingress>>) -> io::Result<Self> {
        AdoptError::check_count(lanes.len(), setup.lanes)?;
        let sockets = lanes
            .into_iter()
            .enumerate()
            .map(|(lane, ingress)| match ingress {
                None => Ok(None),
                Some(Ingress::Unix { fd }) => {
                    socket2::SockRef::from(&fd).set_nonblocking(true)?;
                    Ok(Some(fd))
                }
                Some(Ingress::Shm { .. }) => Err(AdoptError::OtherMode {
                    lane,
                    handed: "a ring",
                    expected: "a unix socket",
                }
                .into()),
            })
            .collect::<io::Result<_>>()?;
        Ok(Unix { sockets })
    }
}

impl Forward for Unix {
    #[inline]
    fn push(&mut self, lane: usize, desc: &SlotDesc, payload: &[u8]) -> Result<(), DropReason> {
        let desc = SlotDesc {
            len: payload.len() as u32,
            segment_size: payload.len() as u32,
            ..*desc
        };
        let Some(socket) = &self.sockets[lane] else {
            return Err(DropReason::InstanceDown);
        };
        let parts = [IoSlice::new(desc.as_bytes()), IoSlice::new(payload)];
        match sys::send_iov(socket.as_fd(), &parts) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Err(DropReason::SocketFull),
            Err(e) if e.raw_os_error() == Some(libc::EMSGSIZE) => Err(DropReason::Oversize),
            Err(_) => Err(DropReason::InstanceDown),
        }
    }

    fn reset(&mut self, lane: usize) -> io::Result<(IngressHandles, u64)> {
        // A fresh pair: whatever the dead worker left queued goes with the old one.
        let (ours, theirs) = pair()?;
        self.sockets[lane] = Some(ours);
        Ok((IngressHandles::Unix(theirs), 0))
    }

    fn close(&mut self, lane: usize) -> u64 {
        self.sockets[lane] = None;
        0
    }

    fn export(&mut self, lane: usize) -> io::Result<Option<IngressState>> {
        Ok(self.sockets[lane]
            .as_ref()
            .map(|s| IngressState::Unix { fd: s.as_raw_fd() }))
    }
}

/// A `SOCK_SEQPACKET` pair for one instance: (demux end, worker end), with deep buffers so the
/// baseline is not penalised by a small default.
fn pair() -> io::Result<(OwnedFd, OwnedFd)> {
    let (ours, theirs) = sys::seqpacket_pair()?;
    let _ = socket2::SockRef::from(&ours).set_send_buffer_size(8 << 20);
    let _ = socket2::SockRef::from(&theirs).set_recv_buffer_size(8 << 20);
    Ok((ours, theirs))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lanes_handed_over_for_another_count_are_refused_as_invalid_data() {
        let ring = ringmux_ring::RingConfig::default();
        let setup = Setup {
            instances: 1,
            lanes: 4,
            ring: &ring,
            shed_at: u64::MAX,
            public: None,
        };
        let Err(e) = Unix::adopt(&setup, (0..2).map(|_| None).collect()) else {
            panic!("two lanes adopted where four are expected");
        };
        assert_eq!(e.kind(), io::ErrorKind::InvalidData);
        assert_eq!(e.to_string(), "2 lanes handed over, 4 expected");
        assert!(Unix::adopt(&setup, (0..4).map(|_| None).collect()).is_ok());
    }
}
