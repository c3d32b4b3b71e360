//! A small HTTPS-over-TCP client for the tests: one TLS connection (TLS 1.3 or 1.2, any
//! certificate accepted, as [`crate::client::client_config`] without roots), HTTP/1.1 or
//! HTTP/2 chosen by ALPN, requests sent with hyper's connection-level client. Bodies stream
//! both ways, trailers included, so the tests can check what ringmux passes on over TCP.

use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::combinators::UnsyncBoxBody;
use hyper::body::Incoming;
use hyper::client::conn::{http1, http2};
use hyper_util::rt::{TokioExecutor, TokioIo};
use rustls::pki_types::ServerName;

use crate::client::{any_certificate_tls, ClientError};

/// A request body.
pub type ClientBody = UnsyncBoxBody<Bytes, Box<dyn std::error::Error + Send + Sync>>;

/// Which HTTP version to offer (the only one in ALPN).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Version {
    Http1,
    Http2,
}

/// One TLS connection and its request sender.
pub struct TcpConn {
    sender: Sender,
    local: SocketAddr,
}

enum Sender {
    H1(http1::SendRequest<ClientBody>),
    H2(http2::SendRequest<ClientBody>),
}

/// Errors of [`TcpConn`].
#[derive(Debug, thiserror::Error)]
pub enum TcpError {
    #[error("{0}")]
    Client(#[from] ClientError),
    #[error("TCP or TLS: {0}")]
    Io(#[from] std::io::Error),
    #[error("HTTP: {0}")]
    Http(#[from] hyper::Error),
    #[error("ALPN chose {0:?}, not what was offered")]
    Alpn(Option<Vec<u8>>),
}

/// A TLS connection to `addr` (as `localhost`, any certificate) on which ALPN chose `alpn`,
/// for a test that speaks the protocol itself.
pub async fn tls_connect(addr: SocketAddr, alpn: &[u8]) -> Result<TlsStream, TcpError> {
    let tls = any_certificate_tls(&[alpn])?;
    let tcp = tokio::net::TcpStream::connect(addr).await?;
    tcp.set_nodelay(true)?;
    let name = ServerName::try_from("localhost").expect("a valid DNS name");
    let stream = tokio_rustls::TlsConnector::from(Arc::new(tls))
        .connect(name, tcp)
        .await?;
    let chosen = stream.get_ref().1.alpn_protocol().map(<[u8]>::to_vec);
    if chosen.as_deref() != Some(alpn) {
        return Err(TcpError::Alpn(chosen));
    }
    Ok(stream)
}

/// A client's TLS stream over TCP.
pub type TlsStream = tokio_rustls::client::TlsStream<tokio::net::TcpStream>;

impl TcpConn {
    /// Connects to `addr` as `localhost` and offers only `version`.
    pub async fn connect(addr: SocketAddr, version: Version) -> Result<TcpConn, TcpError> {
        let alpn: &[u8] = match version {
            Version::Http1 => b"http/1.1",
            Version::Http2 => b"h2",
        };
        let stream = tls_connect(addr, alpn).await?;
        let local = stream.get_ref().0.local_addr()?;
        let io = TokioIo::new(stream);
        let sender = match version {
            Version::Http1 => {
                let (sender, conn) = http1::handshake(io).await?;
                tokio::spawn(conn);
                Sender::H1(sender)
            }
            Version::Http2 => {
                let (sender, conn) = http2::handshake(TokioExecutor::new(), io).await?;
                tokio::spawn(conn);
                Sender::H2(sender)
            }
        };
        Ok(TcpConn { sender, local })
    }

    /// The connection's local address (what the server sees as the peer).
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// Sends `request` (its URI a path, or a full `https://` URI for HTTP/2's `:authority`)
    /// and returns the response head with its streaming body.
    pub async fn send(
        &mut self,
        request: Request<ClientBody>,
    ) -> Result<Response<Incoming>, TcpError> {
        Ok(match &mut self.sender {
            Sender::H1(s) => {
                s.ready().await?;
                s.send_request(request).await?
            }
            Sender::H2(s) => {
                s.ready().await?;
                s.send_request(request).await?
            }
        })
    }
}
