//! The worker's end of its control socket: receiving the hand-off, sending `READY` and `STATS`,
//! reading `SHUTDOWN`. The messages themselves are [`ringmux_proto`]'s; this module only moves
//! them over the socket.

use std::io;
use std::os::fd::{BorrowedFd, OwnedFd};

use ringmux_proto::{Handoff, HandoffError, Message, MessageError, MAX_FDS, MAX_MESSAGE};

use crate::sys;

/// Why the hand-off could not be received.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error("control socket: {0}")]
    Io(#[from] io::Error),
    #[error("control socket closed by the demux before the hand-off")]
    Closed,
    #[error(transparent)]
    Handoff(#[from] HandoffError),
}

/// Blocks for the hand-off and checks it and its descriptors. On any error every descriptor
/// that arrived is closed.
pub fn recv_handoff(sock: BorrowedFd<'_>) -> Result<(Handoff, Vec<OwnedFd>), ControlError> {
    let mut buf = vec![0u8; MAX_MESSAGE];
    let (n, fds) = sys::recv_with_fds(sock, &mut buf, MAX_FDS)?.ok_or(ControlError::Closed)?;
    let h = Handoff::decode(&buf[..n])?;
    h.check_fds(fds.len())?;
    Ok((h, fds))
}

/// Sends one message. On a non-blocking socket a full queue is `WouldBlock`.
pub fn send(sock: BorrowedFd<'_>, message: &Message) -> io::Result<()> {
    send_blocking(sock, message, false)
}

/// Sends one message, never waiting for room: `WouldBlock` when the demux is not reading.
pub fn send_nowait(sock: BorrowedFd<'_>, message: &Message) -> io::Result<()> {
    send_blocking(sock, message, true)
}

fn send_blocking(sock: BorrowedFd<'_>, message: &Message, dontwait: bool) -> io::Result<()> {
    sys::send_packet(sock, &message.encode(), dontwait)
}

/// Receives one message without blocking: `Ok(None)` when the demux closed the socket,
/// `WouldBlock` when nothing is queued, `Ok(Some(Err(_)))` for a message this worker does not
/// know (the caller ignores it).
pub fn recv(sock: BorrowedFd<'_>) -> io::Result<Option<Result<Message, MessageError>>> {
    let mut buf = [0u8; 256];
    let n = sys::recv_packet(sock, &mut buf, true)?;
    match buf.get(..n) {
        _ if n == 0 => Ok(None),
        Some(packet) => Ok(Some(Message::decode(packet))),
        // Longer than any message the demux sends: not one of ours.
        None => Ok(Some(Err(MessageError::Unknown(buf[..16].to_vec())))),
    }
}
