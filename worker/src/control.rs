//! The worker's end of its control socket: receiving the hand-off, sending `READY`, `STATS`,
//! `STOPPED` and `APPLIED`, reading `SHUTDOWN`, `CERTIFICATE` and `CHALLENGES`. The messages
//! themselves are [`ringmux_proto`]'s; this module only moves them over the socket.

use std::io;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};

use ringmux_proto::{Handoff, HandoffError, Message, MessageError, WorkerReport, MAX_MESSAGE};

use crate::sys;

/// Why the hand-off could not be received.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    /// The OS error is in the message, so not the error's `source`.
    #[error("control socket: {0}")]
    Io(io::Error),
    #[error("control socket closed by the demux before the hand-off")]
    Closed,
    #[error(transparent)]
    Handoff(#[from] HandoffError),
}

impl From<io::Error> for ControlError {
    fn from(e: io::Error) -> Self {
        ControlError::Io(e)
    }
}

/// Blocks for the hand-off, checks it, and takes its descriptors from the numbers where the
/// demux placed them before this program started ([`Handoff::fd_numbers`]; the message carries
/// none). Once per process: a second call is refused before it touches a descriptor.
pub fn recv_handoff(sock: BorrowedFd<'_>) -> Result<(Handoff, Vec<OwnedFd>), ControlError> {
    let mut buf = vec![0u8; MAX_MESSAGE];
    let n = sys::recv_packet(sock, &mut buf, false)?;
    if n == 0 {
        return Err(ControlError::Closed);
    }
    let Some(message) = buf.get(..n) else {
        return Err(ControlError::Io(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("a hand-off of {n} bytes, more than MAX_MESSAGE ({MAX_MESSAGE})"),
        )));
    };
    let h = Handoff::decode(message)?;
    if HANDOFF_TAKEN.swap(true, Ordering::AcqRel) {
        return Err(ControlError::Io(io::Error::other(
            "the hand-off's descriptors were taken by an earlier call in this process",
        )));
    }
    let fds = h
        .fd_numbers()
        .map(|fd| sys::adopt_inherited(fd, true))
        .collect::<io::Result<Vec<_>>>()?;
    Ok((h, fds))
}

/// Set by the first [`recv_handoff`] that takes the hand-off's descriptors.
static HANDOFF_TAKEN: AtomicBool = AtomicBool::new(false);

/// Sends one message. On a non-blocking socket a full queue is `WouldBlock`.
pub fn send(sock: BorrowedFd<'_>, message: &Message) -> io::Result<()> {
    send_blocking(sock, message, false)
}

/// Sends one message, never waiting for room: `WouldBlock` when the demux is not reading.
pub fn send_nowait(sock: BorrowedFd<'_>, message: &Message) -> io::Result<()> {
    send_blocking(sock, message, true)
}

/// Sends a `STATS` report, never waiting, its site rows from index `first` on
/// ([`WorkerReport::encode_rotating`]: as many as a report holds). Returns the index the next
/// report starts at; when the send fails, the caller keeps `first`, so the rows left out wait
/// for no longer than they would have.
pub fn send_stats_nowait(
    sock: BorrowedFd<'_>,
    report: &WorkerReport,
    first: u32,
) -> io::Result<u32> {
    let (text, next) = report.encode_rotating(first);
    sys::send_packet(sock, text.as_bytes(), true)?;
    Ok(next)
}

fn send_blocking(sock: BorrowedFd<'_>, message: &Message, dontwait: bool) -> io::Result<()> {
    sys::send_packet(sock, &message.encode(), dontwait)
}

/// Receives the demux's messages, one packet at a time, into one buffer of [`MAX_MESSAGE`]
/// bytes made once (a `CERTIFICATE` carries a whole chain and key).
pub struct Receiver {
    buf: Box<[u8]>,
}

impl Default for Receiver {
    fn default() -> Self {
        Receiver::new()
    }
}

impl std::fmt::Debug for Receiver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Receiver").finish_non_exhaustive()
    }
}

impl Receiver {
    pub fn new() -> Receiver {
        Receiver {
            buf: vec![0u8; MAX_MESSAGE].into_boxed_slice(),
        }
    }

    /// Receives one message without blocking: `Ok(None)` when the demux closed the socket,
    /// `WouldBlock` when nothing is queued, `Ok(Some(Err(_)))` for a message this worker
    /// does not know or one longer than [`MAX_MESSAGE`] (the caller ignores it).
    pub fn recv(
        &mut self,
        sock: BorrowedFd<'_>,
    ) -> io::Result<Option<Result<Message, MessageError>>> {
        let n = sys::recv_packet(sock, &mut self.buf, true)?;
        match self.buf.get(..n) {
            _ if n == 0 => Ok(None),
            Some(packet) => Ok(Some(Message::decode(packet))),
            // Longer than any message the demux sends: not one of ours.
            None => Ok(Some(Err(MessageError::Unknown(self.buf[..16].to_vec())))),
        }
    }
}
