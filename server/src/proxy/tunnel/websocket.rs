//! The copy of a WebSocket tunnel: the bytes both ways, as a plain copy moves them (one fixed
//! buffer per direction, one read written out whole before the next: a side that stops
//! reading stops the other side's reads), with each direction's frames followed
//! ([`super::frames`]) so that the tunnel can close the WebSocket itself when it is told to
//! ([`copy`]'s `closing`): at the next frame boundary of each direction, a close frame with
//! status 1001 ("going away", RFC 6455 §7.4.1) goes to the client (unmasked) and to the
//! upstream (masked, as a client's must be), nothing more goes to either, and the copy ends
//! once each side answered with its close (RFC 6455 §7.1.2) or ended its stream.
//!
//! Over HTTP/2 (RFC 8441) the client's side is its stream: the same frames in its DATA.

use std::io;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::watch;

use super::frames::{going_away, Frames, Malformed, Sender};

/// How a WebSocket copy ended well.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Finish {
    /// Both sides ended their streams, each told to the other.
    Ended,
    /// Told to close, the tunnel closed the WebSocket (or a side ended its stream first).
    Closed,
}

/// Why a WebSocket copy failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum CopyError {
    #[error(transparent)]
    Io(#[from] io::Error),
    #[error("a malformed frame from the {from:?}: {why}")]
    Malformed { from: Sender, why: Malformed },
}

/// Copies `client` to `backend` and back, both holding a WebSocket whose frames may use
/// the reserved bits when `extensions` (an extension was negotiated). Once `closing` holds
/// `true`, closes the WebSocket as the module says. `buffer` bytes per direction.
pub(crate) async fn copy<C, B>(
    client: C,
    backend: B,
    extensions: bool,
    closing: watch::Receiver<bool>,
    buffer: usize,
) -> Result<Finish, CopyError>
where
    C: AsyncRead + AsyncWrite + Unpin,
    B: AsyncRead + AsyncWrite + Unpin,
{
    let (mut client_reads, mut client_writes) = tokio::io::split(client);
    let (mut backend_reads, mut backend_writes) = tokio::io::split(backend);
    let up = Direction {
        frames: Frames::new(Sender::Client, extensions),
        closing: closing.clone(),
        buffer,
    };
    let down = Direction {
        frames: Frames::new(Sender::Server, extensions),
        closing,
        buffer,
    };
    let (up, down) = tokio::try_join!(
        up.run(&mut client_reads, &mut backend_writes),
        down.run(&mut backend_reads, &mut client_writes),
    )?;
    Ok(match (up, down) {
        (Finish::Ended, Finish::Ended) => Finish::Ended,
        _ => Finish::Closed,
    })
}

/// One direction: from a side whose frames `frames` follows, to the other side.
struct Direction {
    frames: Frames,
    closing: watch::Receiver<bool>,
    buffer: usize,
}

impl Direction {
    /// Copies until `from` ends (then `to` is shut down), or, once told to close, until our
    /// close went to `to` (or one from `from` passed to it) and `from` sent its own.
    async fn run<R, W>(mut self, from: &mut R, to: &mut W) -> Result<Finish, CopyError>
    where
        R: AsyncRead + Unpin,
        W: AsyncWrite + Unpin,
    {
        let mut buf = vec![0u8; self.buffer].into_boxed_slice();
        // Our close went to `to`: whatever `from` sends after is read (for its close), and
        // dropped.
        let mut ours_sent = false;
        // The tunnel's end dropped the sender: it never asks any more.
        let mut unasked_for_good = false;
        loop {
            let asked = *self.closing.borrow();
            if asked {
                if self.frames.closed() {
                    // A close went to `to` (ours, or `from`'s own passed on) and `from`'s
                    // close came: this side's closing handshake is done.
                    to.shutdown().await?;
                    return Ok(Finish::Closed);
                }
                if !ours_sent && self.frames.at_boundary() {
                    self.send_ours(to).await?;
                    ours_sent = true;
                }
            }
            let n = tokio::select! {
                read = from.read(&mut buf) => read?,
                changed = self.closing.changed(), if !asked && !unasked_for_good => {
                    unasked_for_good = changed.is_err();
                    continue;
                }
            };
            // The order may have come while the read waited: what was read is after it.
            let asked = asked || *self.closing.borrow();
            if n == 0 {
                to.shutdown().await?;
                return Ok(if asked { Finish::Closed } else { Finish::Ended });
            }
            let read = &buf[..n];
            if ours_sent {
                self.read(read, false)?;
                continue;
            }
            // Told to close, what goes on ends at the next boundary; the rest comes after
            // our close, so it is dropped.
            let upto = self.read(read, asked)?;
            to.write_all(&read[..upto]).await?;
            if upto < n {
                self.send_ours(to).await?;
                ours_sent = true;
                self.read(&read[upto..], false)?;
            }
        }
    }

    /// Follows the frames of `bytes` (up to the next boundary with `stop`).
    fn read(&mut self, bytes: &[u8], stop: bool) -> Result<usize, CopyError> {
        self.frames
            .advance(bytes, stop)
            .map_err(|why| CopyError::Malformed {
                from: self.frames.sender(),
                why,
            })
    }

    /// Writes our close frame to the other side: masked for the upstream, with a fresh key
    /// (RFC 6455 §5.3).
    async fn send_ours<W: AsyncWrite + Unpin>(&self, to: &mut W) -> io::Result<()> {
        let receiver = match self.frames.sender() {
            Sender::Client => Sender::Server,
            Sender::Server => Sender::Client,
        };
        let mut key = [0u8; 4];
        // The system's generator failing leaves a fixed key: the frame is still well formed,
        // and ours carries nothing a key must hide.
        let _ = ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut key);
        let (frame, len) = going_away(receiver, key);
        to.write_all(&frame[..len]).await?;
        to.flush().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{duplex, DuplexStream};

    /// A frame as `sender` writes it, FIN set, masked with a zero key for a client.
    fn frame(sender: Sender, opcode: u8, payload: &[u8]) -> Vec<u8> {
        let mut f = vec![0x80 | opcode];
        match sender {
            Sender::Client => {
                f.push(0x80 | payload.len() as u8);
                f.extend_from_slice(&[0; 4]);
            }
            Sender::Server => f.push(payload.len() as u8),
        }
        f.extend_from_slice(payload);
        f
    }

    async fn read_exactly(side: &mut DuplexStream, n: usize) -> Vec<u8> {
        let mut got = vec![0; n];
        side.read_exact(&mut got).await.unwrap();
        got
    }

    /// A tunnel between two in-memory pipes.
    struct Pipes {
        /// The client's end.
        client: DuplexStream,
        /// The backend's end.
        backend: DuplexStream,
        closing: watch::Sender<bool>,
        copy: tokio::task::JoinHandle<Result<Finish, CopyError>>,
    }

    fn tunnel() -> Pipes {
        let (client, proxy_client) = duplex(64);
        let (backend, proxy_backend) = duplex(64);
        let (closing, told) = watch::channel(false);
        let copy = tokio::spawn(copy(proxy_client, proxy_backend, false, told, 16));
        Pipes {
            client,
            backend,
            closing,
            copy,
        }
    }

    #[tokio::test]
    async fn frames_pass_and_the_ends_end_the_copy() {
        let Pipes {
            mut client,
            mut backend,
            copy: task,
            ..
        } = tunnel();
        let hello = frame(Sender::Client, 0x1, b"hello, through a 16-byte buffer");
        client.write_all(&hello).await.unwrap();
        assert_eq!(read_exactly(&mut backend, hello.len()).await, hello);
        let back = frame(Sender::Server, 0x1, b"and back again, in pieces");
        backend.write_all(&back).await.unwrap();
        assert_eq!(read_exactly(&mut client, back.len()).await, back);
        drop(client);
        drop(backend);
        assert_eq!(task.await.unwrap().unwrap(), Finish::Ended);
    }

    #[tokio::test]
    async fn told_to_close_each_side_gets_1001_at_a_frame_boundary() {
        let Pipes {
            mut client,
            mut backend,
            closing: tx,
            copy: task,
        } = tunnel();
        // Half a frame each way, then the order to close: each frame is finished first.
        let up = frame(Sender::Client, 0x2, &[1; 20]);
        let down = frame(Sender::Server, 0x2, &[2; 20]);
        client.write_all(&up[..10]).await.unwrap();
        backend.write_all(&down[..10]).await.unwrap();
        assert_eq!(read_exactly(&mut backend, 10).await, up[..10]);
        assert_eq!(read_exactly(&mut client, 10).await, down[..10]);
        tx.send(true).unwrap();
        // The rest of each frame and one more after it, which comes after the close.
        let after_up = frame(Sender::Client, 0x1, b"late");
        client
            .write_all(&[&up[10..], &after_up[..]].concat())
            .await
            .unwrap();
        let after_down = frame(Sender::Server, 0x1, b"late");
        backend
            .write_all(&[&down[10..], &after_down[..]].concat())
            .await
            .unwrap();
        let got = read_exactly(&mut backend, up.len() - 10 + 8).await;
        assert_eq!(got[..up.len() - 10], up[10..]);
        let close = &got[up.len() - 10..];
        assert_eq!(close[..2], [0x88, 0x82], "{close:?}");
        assert_eq!([close[6] ^ close[2], close[7] ^ close[3]], [0x03, 0xe9]);
        let got = read_exactly(&mut client, down.len() - 10 + 4).await;
        assert_eq!(got[..down.len() - 10], down[10..]);
        assert_eq!(got[down.len() - 10..], [0x88, 2, 0x03, 0xe9]);
        // Each side answers with its close: the copy ends, each side's stream shut.
        client
            .write_all(&frame(Sender::Client, 0x8, &1001u16.to_be_bytes()))
            .await
            .unwrap();
        backend
            .write_all(&frame(Sender::Server, 0x8, &1001u16.to_be_bytes()))
            .await
            .unwrap();
        assert_eq!(task.await.unwrap().unwrap(), Finish::Closed);
        let mut rest = Vec::new();
        client.read_to_end(&mut rest).await.unwrap();
        backend.read_to_end(&mut rest).await.unwrap();
        assert!(rest.is_empty(), "nothing after the closes: {rest:?}");
    }

    #[tokio::test]
    async fn a_malformed_frame_ends_the_copy() {
        let Pipes {
            mut client,
            copy: task,
            ..
        } = tunnel();
        // Not masked, from a client.
        client.write_all(&[0x81, 0x01, b'x']).await.unwrap();
        let e = task.await.unwrap().unwrap_err();
        assert!(
            matches!(
                e,
                CopyError::Malformed {
                    from: Sender::Client,
                    ..
                }
            ),
            "{e}"
        );
    }
}
