//! The graceful close of a TCP connection (see the module documentation of `tcp`): TLS
//! `close_notify` and the write side shut, then the client's input read and thrown away, within
//! bounds; and how a stream lent to hyper comes back to be closed so ([`lend`]).

use std::io;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::oneshot;
use tokio::time::{Duration, Instant};

use super::sys;

/// How long a graceful close waits for a client that went quiet (nginx's `lingering_timeout`
/// is the same), unless what was sent is still arriving.
const LINGER_QUIET: Duration = Duration::from_secs(5);
/// The longest a graceful close takes in all (nginx's `lingering_time`).
const LINGER_TIME: Duration = Duration::from_secs(30);
/// The most a graceful close reads and throws away.
const LINGER_BYTES: u64 = 1 << 20;

/// A connection's byte stream: TLS over TCP, or TCP itself (the plain-HTTP redirects).
pub(super) trait Transport: AsyncRead + AsyncWrite + Unpin + Send + 'static {
    /// The TCP socket under it (what TLS still held is dropped: call it once `shutdown` sent
    /// `close_notify`).
    fn into_tcp(self) -> TcpStream;
}

impl Transport for TcpStream {
    fn into_tcp(self) -> TcpStream {
        self
    }
}

impl Transport for tokio_rustls::server::TlsStream<TcpStream> {
    fn into_tcp(self) -> TcpStream {
        self.into_inner().0
    }
}

/// Closes a connection without losing what was sent on it: TLS `close_notify` and the write
/// side shut (the FIN goes after everything written), then what the client still sends is read
/// and thrown away until it closes its side. It ends earlier once the client has been quiet for
/// [`LINGER_QUIET`] and everything sent has arrived (nothing is left to lose), or stopped
/// taking it (no progress in that time); and at [`LINGER_TIME`] or [`LINGER_BYTES`] in any
/// case. `Err` says why it was cut short while the client could still lose data.
pub(super) async fn close_gracefully<T: Transport>(mut io: T) -> Result<(), &'static str> {
    let deadline = Instant::now() + LINGER_TIME;
    // A no-op if hyper closed the write side already (it does when it ends a connection
    // itself); waits while the send buffer is full, which is the client's to drain.
    match tokio::time::timeout_at(deadline, io.shutdown()).await {
        Ok(Ok(())) => {}
        // A reset or a broken pipe: nothing more can be delivered.
        Ok(Err(_)) => return Ok(()),
        Err(_) => return Err("the client took nothing in time to send close_notify"),
    }
    let mut tcp = io.into_tcp();
    let mut unacknowledged = sys::unacknowledged_bytes(&tcp).unwrap_or(0);
    let mut discarded = 0u64;
    let mut buf = [0u8; 1024];
    loop {
        let now = Instant::now();
        if now >= deadline {
            return match sys::unacknowledged_bytes(&tcp).unwrap_or(0) {
                0 => Ok(()),
                _ => Err("the client was still receiving when the time was up"),
            };
        }
        let quiet_until = (now + LINGER_QUIET).min(deadline);
        match tokio::time::timeout_at(quiet_until, tcp.read(&mut buf)).await {
            // The client closed its side (or reset): it has everything it will read.
            Ok(Ok(0)) | Ok(Err(_)) => return Ok(()),
            Ok(Ok(n)) => {
                discarded += n as u64;
                if discarded > LINGER_BYTES {
                    return Err("the client kept sending");
                }
            }
            Err(_) => {
                let left = sys::unacknowledged_bytes(&tcp).unwrap_or(0);
                if left == 0 {
                    // Everything sent has arrived: a reset now loses the client nothing.
                    return Ok(());
                }
                if left >= unacknowledged && Instant::now() < deadline {
                    return Err("the client stopped taking what was sent");
                }
                unacknowledged = left;
            }
        }
    }
}

/// Lends `io` to hyper: the [`HandBack`] hyper owns, and where `io` comes back when hyper drops
/// it, so the connection's task can still close it gracefully.
pub(super) fn lend<T>(io: T) -> (HandBack<T>, oneshot::Receiver<T>) {
    let (tx, rx) = oneshot::channel();
    (
        HandBack {
            io: Some(io),
            back: Some(tx),
        },
        rx,
    )
}

/// A stream lent to hyper (see [`lend`]); reads and writes pass straight through.
pub(super) struct HandBack<T> {
    /// `None` only inside `drop`.
    io: Option<T>,
    back: Option<oneshot::Sender<T>>,
}

impl<T> Drop for HandBack<T> {
    fn drop(&mut self) {
        if let (Some(io), Some(back)) = (self.io.take(), self.back.take()) {
            // The receiver gone (its task ended): the stream closes here, as it used to.
            let _ = back.send(io);
        }
    }
}

impl<T> HandBack<T> {
    fn io(&mut self) -> io::Result<std::pin::Pin<&mut T>>
    where
        T: Unpin,
    {
        match self.io.as_mut() {
            Some(io) => Ok(std::pin::Pin::new(io)),
            None => Err(io::Error::from(io::ErrorKind::NotConnected)),
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for HandBack<T> {
    fn poll_read(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> std::task::Poll<io::Result<()>> {
        match self.get_mut().io() {
            Ok(io) => io.poll_read(cx, buf),
            Err(e) => std::task::Poll::Ready(Err(e)),
        }
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for HandBack<T> {
    fn poll_write(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<io::Result<usize>> {
        match self.get_mut().io() {
            Ok(io) => io.poll_write(cx, buf),
            Err(e) => std::task::Poll::Ready(Err(e)),
        }
    }

    fn poll_write_vectored(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> std::task::Poll<io::Result<usize>> {
        match self.get_mut().io() {
            Ok(io) => io.poll_write_vectored(cx, bufs),
            Err(e) => std::task::Poll::Ready(Err(e)),
        }
    }

    fn is_write_vectored(&self) -> bool {
        self.io.as_ref().is_some_and(|io| io.is_write_vectored())
    }

    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<io::Result<()>> {
        match self.get_mut().io() {
            Ok(io) => io.poll_flush(cx),
            Err(e) => std::task::Poll::Ready(Err(e)),
        }
    }

    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<io::Result<()>> {
        match self.get_mut().io() {
            Ok(io) => io.poll_shutdown(cx),
            Err(e) => std::task::Poll::Ready(Err(e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The server writes more than the client has read and closes; the client reads on and
    /// sends a byte after each read, as an HTTP/2 client sends WINDOW_UPDATE. Closed gracefully,
    /// the socket takes those bytes rather than answering them with a reset, so the client gets
    /// every byte and then the end of the stream.
    #[tokio::test]
    async fn a_graceful_close_delivers_everything_to_a_client_still_talking() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let mut client = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (mut server, _) = listener.accept().await.unwrap();
        // Far more than the socket buffers hold: the server's last write returns while much
        // of it is still on its way.
        let payload: Vec<u8> = (0..16u32 << 20).map(|i| (i % 251) as u8).collect();
        let sent = payload.clone();
        let server = tokio::spawn(async move {
            server.write_all(&sent).await.unwrap();
            close_gracefully(server).await
        });
        let mut got = Vec::with_capacity(payload.len());
        let mut buf = vec![0u8; 64 << 10];
        let end = loop {
            match client.read(&mut buf).await {
                Ok(0) => break Ok(()),
                Ok(n) => {
                    got.extend_from_slice(&buf[..n]);
                    if let Err(e) = client.write_all(b"w").await {
                        break Err(e);
                    }
                }
                Err(e) => break Err(e),
            }
        };
        assert!(
            got == payload,
            "{} of {} bytes, then {end:?}",
            got.len(),
            payload.len()
        );
        assert!(end.is_ok(), "{end:?}");
        drop(client);
        assert_eq!(server.await.unwrap(), Ok(()));
    }
}
