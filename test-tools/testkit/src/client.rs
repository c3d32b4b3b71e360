//! A small HTTP/3 client over quinn + h3: what `h3-probe` and the end-to-end tests use to talk
//! to ringmux workers.
//!
//! This module owns client-side TLS (trusting given roots, or any certificate through
//! [`crate::tls::AnyCertificate`]), the client endpoint, connections with or without 0-RTT, and simple
//! requests whose bodies are counted and checksummed rather than kept. It never retries: a
//! failure is returned to the caller, who counts it.

use std::fmt;
use std::io;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket};
use std::sync::Arc;

use bytes::{Buf, Bytes, BytesMut};
use h3::error::{Code, ConnectionError as H3ConnectionError, StreamError};
use http::{HeaderMap, Method, StatusCode};
use quinn::crypto::rustls::QuicClientConfig;
use quinn::ConnectionId;
use rustls::pki_types::CertificateDer;
use tokio::task::JoinHandle;

use crate::tls::AnyCertificate;

/// Errors of the client. [`ClientError::kind`] gives a short stable label for error counts.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("TLS configuration: {0}")]
    Tls(#[from] rustls::Error),
    #[error("TLS configuration unusable for QUIC: {0}")]
    QuicTls(#[from] quinn::crypto::rustls::NoInitialCipherSuite),
    #[error("socket: {0}")]
    Io(#[from] io::Error),
    #[error("cannot start connection: {0}")]
    Connect(#[from] quinn::ConnectError),
    #[error("connection: {0}")]
    Connection(#[from] quinn::ConnectionError),
    #[error("HTTP/3 connection: {0}")]
    H3Connection(#[from] H3ConnectionError),
    #[error("HTTP/3 stream: {0}")]
    Stream(#[from] StreamError),
    #[error("bad request: {0}")]
    Request(#[from] http::Error),
}

impl ClientError {
    /// The server never processed the request because it is going away: the client had its
    /// GOAWAY before sending, or the server rejected the stream (H3_REQUEST_REJECTED, sent for
    /// requests above the GOAWAY's limit). RFC 9114 §5.2: such a request may be retried on a
    /// new connection, which is what a client does when a server drains.
    pub fn refused_by_goaway(&self) -> bool {
        match self {
            ClientError::Stream(StreamError::RemoteClosing { .. }) => true,
            ClientError::Stream(StreamError::RemoteTerminate { code, .. }) => {
                *code == Code::H3_REQUEST_REJECTED
            }
            _ => false,
        }
    }

    /// Short label for error statistics (`h3-probe` JSON `errors` keys).
    pub fn kind(&self) -> &'static str {
        match self {
            ClientError::Tls(_) | ClientError::QuicTls(_) => "tls_config",
            ClientError::Io(_) => "io",
            ClientError::Connect(_) => "connect",
            ClientError::Connection(quinn::ConnectionError::TimedOut) => "timeout",
            ClientError::Connection(quinn::ConnectionError::Reset) => "stateless_reset",
            ClientError::Connection(_) => "connection",
            ClientError::H3Connection(_) => "h3_connection",
            ClientError::Stream(StreamError::RemoteTerminate { .. }) => "stream_reset",
            ClientError::Stream(StreamError::RemoteClosing { .. }) => "goaway",
            ClientError::Stream(StreamError::ConnectionError { .. }) => "h3_connection",
            ClientError::Stream(_) => "stream",
            ClientError::Request(_) => "request",
        }
    }
}

/// QUIC client configuration for HTTP/3: TLS 1.3 only, ALPN `h3`, ring provider, early data
/// enabled, and an in-memory session cache inside the config, so every connection made with
/// this config (or a clone of it) can resume a session an earlier one received.
///
/// `roots`: trust exactly these certificates. `None` accepts **any** certificate (signatures
/// are still checked, so the handshake is real); only for load tests against self-signed
/// servers.
pub fn client_config(
    roots: Option<&[CertificateDer<'static>]>,
) -> Result<quinn::ClientConfig, ClientError> {
    client_config_alpn(roots, b"h3")
}

/// [`client_config`] for another application protocol than HTTP/3 (ALPN `alpn`).
pub fn client_config_alpn(
    roots: Option<&[CertificateDer<'static>]>,
    alpn: &[u8],
) -> Result<quinn::ClientConfig, ClientError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS13])?;
    let mut tls = match roots {
        Some(roots) => {
            let mut store = rustls::RootCertStore::empty();
            for cert in roots {
                store.add(cert.clone())?;
            }
            builder.with_root_certificates(store).with_no_client_auth()
        }
        None => builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(AnyCertificate))
            .with_no_client_auth(),
    };
    tls.alpn_protocols = vec![alpn.to_vec()];
    tls.enable_early_data = true;
    // `tls.resumption` defaults to an in-memory cache of 256 sessions held by this config.
    Ok(quinn::ClientConfig::new(Arc::new(
        QuicClientConfig::try_from(tls)?,
    )))
}

/// A TLS client configuration (TLS 1.3 and 1.2, ring) that accepts **any** certificate, as
/// [`client_config`] with no roots does: for tests and load against self-signed servers.
pub(crate) fn any_certificate_tls(alpn: &[&[u8]]) -> Result<rustls::ClientConfig, ClientError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut tls = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(AnyCertificate))
        .with_no_client_auth();
    tls.alpn_protocols = alpn.iter().map(|a| a.to_vec()).collect();
    Ok(tls)
}

/// `config` with receive windows of `bytes` per stream and twice that for the connection
/// (quinn's defaults let a server send megabytes ahead of what the client reads): a client
/// that reads slowly ([`InFlight::read_body_at`]) then holds the server to its pace.
pub fn with_receive_window(mut config: quinn::ClientConfig, bytes: u32) -> quinn::ClientConfig {
    let mut transport = quinn::TransportConfig::default();
    transport.stream_receive_window(quinn::VarInt::from_u32(bytes));
    transport.receive_window(quinn::VarInt::from_u32(bytes.saturating_mul(2)));
    config.transport_config(Arc::new(transport));
    config
}

/// A client endpoint. Connections share its socket and its [`quinn::ClientConfig`] (and so
/// its session cache).
pub struct H3Client {
    endpoint: quinn::Endpoint,
    config: quinn::ClientConfig,
}

impl H3Client {
    /// A client bound to `127.0.0.1:0` or `[::1]:0` for a loopback target, to the family's
    /// wildcard address for any other (the kernel then picks the source address of the route).
    /// Must be called inside a tokio runtime.
    pub fn new(config: quinn::ClientConfig, target: SocketAddr) -> io::Result<Self> {
        let bind: SocketAddr = match (target, target.ip().is_loopback()) {
            (SocketAddr::V4(_), true) => (Ipv4Addr::LOCALHOST, 0).into(),
            (SocketAddr::V4(_), false) => (Ipv4Addr::UNSPECIFIED, 0).into(),
            (SocketAddr::V6(_), true) => (Ipv6Addr::LOCALHOST, 0).into(),
            (SocketAddr::V6(_), false) => (Ipv6Addr::UNSPECIFIED, 0).into(),
        };
        Self::with_socket(config, UdpSocket::bind(bind)?)
    }

    /// A client on an already bound socket (e.g. a wildcard address for remote targets).
    pub fn with_socket(config: quinn::ClientConfig, socket: UdpSocket) -> io::Result<Self> {
        let runtime = Arc::new(quinn::TokioRuntime);
        let mut endpoint =
            quinn::Endpoint::new(quinn::EndpointConfig::default(), None, socket, runtime)?;
        endpoint.set_default_client_config(config.clone());
        Ok(H3Client { endpoint, config })
    }

    /// Chooses the client's first DCID for new connections (e.g. to pin a connection to one
    /// worker through the demux's routing).
    pub fn set_initial_dst_cid_provider(
        &mut self,
        provider: Arc<dyn Fn() -> ConnectionId + Send + Sync>,
    ) {
        self.config.initial_dst_cid_provider(provider);
        self.endpoint.set_default_client_config(self.config.clone());
    }

    pub fn endpoint(&self) -> &quinn::Endpoint {
        &self.endpoint
    }

    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.endpoint.local_addr()
    }

    /// Moves every connection of this client to `socket` (connection migration, RFC 9000 §9).
    pub fn rebind(&self, socket: UdpSocket) -> io::Result<()> {
        self.endpoint.rebind(socket)
    }

    /// Full handshake (or 1-RTT resumption if the cache has a ticket), then HTTP/3 setup.
    pub async fn connect(
        &self,
        addr: SocketAddr,
        server_name: &str,
    ) -> Result<H3Conn, ClientError> {
        let quic = self.endpoint.connect(addr, server_name)?.await?;
        H3Conn::new(quic, server_name, addr).await
    }

    /// Connects with 0-RTT if the session cache allows it: the returned connection can send
    /// requests at once (as 0-RTT data, so only idempotent ones). Without a usable ticket this
    /// falls back to a full handshake and [`ZeroRtt::attempted`] is false.
    pub async fn connect_0rtt(
        &self,
        addr: SocketAddr,
        server_name: &str,
    ) -> Result<(H3Conn, ZeroRtt), ClientError> {
        let connecting = self.endpoint.connect(addr, server_name)?;
        match connecting.into_0rtt() {
            Ok((quic, accepted)) => {
                let conn = H3Conn::new(quic, server_name, addr).await?;
                Ok((conn, ZeroRtt(Some(accepted))))
            }
            Err(connecting) => {
                let conn = H3Conn::new(connecting.await?, server_name, addr).await?;
                Ok((conn, ZeroRtt(None)))
            }
        }
    }

    /// Closes all connections with H3_NO_ERROR and waits until the peers have been told.
    pub async fn close(&self) {
        self.endpoint.close(h3_no_error(), b"");
        self.endpoint.wait_idle().await;
    }
}

impl fmt::Debug for H3Client {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("H3Client")
            .field("local_addr", &self.endpoint.local_addr().ok())
            .finish_non_exhaustive()
    }
}

/// Outcome of a 0-RTT attempt.
pub struct ZeroRtt(Option<quinn::ZeroRttAccepted>);

impl ZeroRtt {
    /// Whether 0-RTT data was sent at all (the session cache had a ticket allowing it).
    pub fn attempted(&self) -> bool {
        self.0.is_some()
    }

    /// Waits for the handshake: true if the server accepted the 0-RTT data.
    pub async fn accepted(self) -> bool {
        match self.0 {
            Some(accepted) => accepted.await,
            None => false,
        }
    }
}

/// What a request returned. The body is counted and checksummed; it is kept only on request.
#[derive(Debug, Clone)]
pub struct Response {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body_len: u64,
    /// FNV-1a 64 of the body, see [`Fnv64`].
    pub body_checksum: u64,
    pub body: Option<Bytes>,
}

/// A request whose response headers have arrived and whose body has not been read yet.
pub struct InFlight {
    head: http::Response<()>,
    stream: h3::client::RequestStream<h3_quinn::BidiStream<Bytes>, Bytes>,
}

impl InFlight {
    pub fn status(&self) -> StatusCode {
        self.head.status()
    }

    pub fn headers(&self) -> &HeaderMap {
        self.head.headers()
    }

    /// Reads the body to its end and only counts it: the status and the body's length, with
    /// neither a checksum nor a copy of the headers (what a load generator needs of each
    /// response, at the least cost per request).
    pub async fn count_body(mut self) -> Result<(StatusCode, u64), ClientError> {
        let mut len = 0u64;
        while let Some(chunk) = self.stream.recv_data().await? {
            len += chunk.remaining() as u64;
        }
        Ok((self.head.status(), len))
    }

    /// Reads the body to its end (counted and checksummed; kept if `keep_body`).
    pub async fn read_body(self, keep_body: bool) -> Result<Response, ClientError> {
        self.read_body_paced(None, keep_body).await
    }

    /// Reads the body as [`InFlight::read_body`] does, but no faster than `bytes_per_s` on
    /// average: after each chunk it waits until the bytes read so far are due at that rate, as
    /// curl's `--limit-rate` does. On a connection with small receive windows
    /// ([`with_receive_window`]) the server can then send no faster than this reads.
    pub async fn read_body_at(
        self,
        bytes_per_s: u64,
        keep_body: bool,
    ) -> Result<Response, ClientError> {
        self.read_body_paced(Some(bytes_per_s.max(1)), keep_body)
            .await
    }

    async fn read_body_paced(
        mut self,
        bytes_per_s: Option<u64>,
        keep_body: bool,
    ) -> Result<Response, ClientError> {
        let mut sum = Fnv64::new();
        let mut len = 0u64;
        let mut kept = keep_body.then(BytesMut::new);
        let start = tokio::time::Instant::now();
        while let Some(mut chunk) = self.stream.recv_data().await? {
            if let Some(rate) = bytes_per_s {
                let due = (len + chunk.remaining() as u64) as f64 / rate as f64;
                tokio::time::sleep_until(start + std::time::Duration::from_secs_f64(due)).await;
            }
            while chunk.has_remaining() {
                let part = chunk.chunk();
                let n = part.len();
                sum.update(part);
                len += n as u64;
                if let Some(k) = kept.as_mut() {
                    k.extend_from_slice(part);
                }
                chunk.advance(n);
            }
        }
        Ok(Response {
            status: self.head.status(),
            headers: self.head.headers().clone(),
            body_len: len,
            body_checksum: sum.finish(),
            body: kept.map(BytesMut::freeze),
        })
    }
}

/// `HOST:PORT` for `:authority`, an IPv6 address in brackets (RFC 3986 §3.2.2): `::1` and 443
/// make `[::1]:443`.
fn authority(host: &str, port: u16) -> String {
    if host.parse::<std::net::Ipv6Addr>().is_ok() {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// An HTTP/3 connection. Request methods take `&self`, so one connection can carry many
/// concurrent requests (each is its own stream).
pub struct H3Conn {
    quic: quinn::Connection,
    send: h3::client::SendRequest<h3_quinn::OpenStreams, Bytes>,
    driver: Driver,
    authority: String,
}

impl H3Conn {
    async fn new(
        quic: quinn::Connection,
        server_name: &str,
        addr: SocketAddr,
    ) -> Result<Self, ClientError> {
        let (mut driver, send) = h3::client::new(h3_quinn::Connection::new(quic.clone())).await?;
        // The driver handles the control stream and QPACK; it ends when the connection closes.
        let driver = Driver(tokio::spawn(async move {
            std::future::poll_fn(|cx| driver.poll_close(cx)).await
        }));
        Ok(H3Conn {
            quic,
            send,
            driver,
            authority: authority(server_name, addr.port()),
        })
    }

    /// The QUIC connection (stats, RTT, close reason, ...).
    /// Whether the server closed the connection with H3_NO_ERROR: it drained (GOAWAY) and
    /// closed once every request it had accepted was answered and delivered, so a request
    /// still waiting on this connection was never processed and may be retried on a new one
    /// (RFC 9114 §5.2).
    pub fn closed_gracefully(&self) -> bool {
        matches!(
            self.quic().close_reason(),
            Some(quinn::ConnectionError::ApplicationClosed(c))
                if c.error_code == quinn::VarInt::from_u32(0x100)
        )
    }

    pub fn quic(&self) -> &quinn::Connection {
        &self.quic
    }

    /// `https://AUTHORITY/path` on this connection, for [`H3Conn::get_len`]: made once and
    /// cloned for each request (a clone shares its bytes), where [`H3Conn::get`] formats and
    /// parses it every time.
    pub fn uri(&self, path: &str) -> Result<http::Uri, ClientError> {
        format!("https://{}{}", self.authority, path)
            .parse()
            .map_err(|e| ClientError::Request(http::Error::from(e)))
    }

    /// `GET uri` (made by [`H3Conn::uri`]), the body read to its end and counted: the status
    /// and the body's length ([`InFlight::count_body`]).
    pub async fn get_len(&self, uri: &http::Uri) -> Result<(StatusCode, u64), ClientError> {
        self.get_len_with(uri, &http::HeaderMap::new()).await
    }

    /// [`H3Conn::get_len`] with `headers` added to the request (e.g. `accept-encoding`).
    pub async fn get_len_with(
        &self,
        uri: &http::Uri,
        headers: &http::HeaderMap,
    ) -> Result<(StatusCode, u64), ClientError> {
        let mut req = http::Request::new(());
        *req.uri_mut() = uri.clone();
        if !headers.is_empty() {
            req.headers_mut().extend(headers.clone());
        }
        self.send_head(req, None).await?.count_body().await
    }

    /// `GET path`, body counted and checksummed.
    pub async fn get(&self, path: &str) -> Result<Response, ClientError> {
        self.request(Method::GET, path, None, false).await
    }

    /// `GET path`, keeping the body.
    pub async fn get_body(&self, path: &str) -> Result<Response, ClientError> {
        self.request(Method::GET, path, None, true).await
    }

    /// `method path` with an optional request body, reading the whole response.
    pub async fn request(
        &self,
        method: Method,
        path: &str,
        body: Option<Bytes>,
        keep_body: bool,
    ) -> Result<Response, ClientError> {
        self.start(method, path, body)
            .await?
            .read_body(keep_body)
            .await
    }

    /// Sends `request` with no body (its URI holds the path, as for [`H3Conn::open`]; its
    /// headers go as they are) and returns once the response headers are in.
    pub async fn start_request(&self, request: http::Request<()>) -> Result<InFlight, ClientError> {
        let request = self.absolute(request)?;
        self.send_head(request, None).await
    }

    /// Sends `method path` (and the request body, if any) and returns once the response
    /// headers are in; the body is read with [`InFlight::read_body`].
    pub async fn start(
        &self,
        method: Method,
        path: &str,
        body: Option<Bytes>,
    ) -> Result<InFlight, ClientError> {
        let req = http::Request::builder()
            .method(method)
            .uri(format!("https://{}{}", self.authority, path))
            .body(())?;
        self.send_head(req, body).await
    }

    /// Sends `req` (its URI absolute, this connection's authority) and the request body, if
    /// any, and returns once the response headers are in.
    async fn send_head(
        &self,
        req: http::Request<()>,
        body: Option<Bytes>,
    ) -> Result<InFlight, ClientError> {
        let mut send = self.send.clone();
        let mut stream = send.send_request(req).await?;
        if let Some(body) = body {
            stream.send_data(body).await?;
        }
        match stream.finish().await {
            Ok(()) => {}
            // A server that has already answered may have stopped our request side
            // (STOP_SENDING 0, as quinn does for a stream dropped before its FIN was read);
            // the response can still be complete.
            Err(StreamError::RemoteTerminate { .. }) => {}
            Err(e) => return Err(e.into()),
        }
        let head = stream.recv_response().await?;
        Ok(InFlight { head, stream })
    }

    /// Sends the head of `request` (its URI holds the path; scheme and authority are this
    /// connection's) and returns the raw stream: the caller sends the body, trailers or a
    /// reset, and reads the response.
    pub async fn open(
        &self,
        request: http::Request<()>,
    ) -> Result<h3::client::RequestStream<h3_quinn::BidiStream<Bytes>, Bytes>, ClientError> {
        let request = self.absolute(request)?;
        let mut send = self.send.clone();
        Ok(send.send_request(request).await?)
    }

    /// `request` with its URI made absolute: this connection's scheme and authority, its path.
    fn absolute(&self, request: http::Request<()>) -> Result<http::Request<()>, ClientError> {
        let (mut parts, ()) = request.into_parts();
        let path = parts
            .uri
            .path_and_query()
            .map_or("/", |p| p.as_str())
            .to_owned();
        parts.uri = format!("https://{}{}", self.authority, path)
            .parse()
            .map_err(http::Error::from)?;
        Ok(http::Request::from_parts(parts, ()))
    }

    /// Closes the connection with H3_NO_ERROR and waits until it is closed. Returns an error
    /// if the connection had already failed.
    pub async fn close(self) -> Result<(), ClientError> {
        let H3Conn {
            send, mut driver, ..
        } = self;
        // Dropping the last request sender makes h3 close the connection with H3_NO_ERROR.
        drop(send);
        let err = match (&mut driver.0).await {
            Ok(err) => err,
            Err(join) => return Err(io::Error::other(join.to_string()).into()),
        };
        if err.is_h3_no_error() {
            Ok(())
        } else {
            Err(err.into())
        }
    }
}

impl fmt::Debug for H3Conn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("H3Conn")
            .field("remote", &self.quic.remote_address())
            .field("authority", &self.authority)
            .finish_non_exhaustive()
    }
}

/// The h3 connection driver task, aborted when its [`H3Conn`] is dropped without
/// [`H3Conn::close`] (it would otherwise live as long as the QUIC connection).
struct Driver(JoinHandle<H3ConnectionError>);

impl Drop for Driver {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// FNV-1a 64-bit: a cheap, order-sensitive body checksum (not cryptographic).
#[derive(Debug, Clone, Copy)]
pub struct Fnv64(u64);

impl Default for Fnv64 {
    fn default() -> Self {
        Self::new()
    }
}

impl Fnv64 {
    pub fn new() -> Self {
        Fnv64(0xcbf2_9ce4_8422_2325)
    }

    pub fn update(&mut self, data: &[u8]) {
        for b in data {
            self.0 ^= u64::from(*b);
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }

    pub fn finish(&self) -> u64 {
        self.0
    }
}

fn h3_no_error() -> quinn::VarInt {
    // H3_NO_ERROR is 0x100, well within the VarInt range.
    quinn::VarInt::from_u32(Code::H3_NO_ERROR.value() as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_ipv6_authority_is_bracketed() {
        assert_eq!(authority("::1", 4433), "[::1]:4433");
        assert_eq!(authority("127.0.0.1", 4433), "127.0.0.1:4433");
        assert_eq!(authority("localhost", 443), "localhost:443");
        let uri: http::Uri = format!("https://{}/hello.txt", authority("2001:db8::1", 8443))
            .parse()
            .unwrap();
        assert_eq!(uri.port_u16(), Some(8443));
    }

    #[test]
    fn fnv_vectors() {
        let h = |s: &[u8]| {
            let mut f = Fnv64::new();
            f.update(s);
            f.finish()
        };
        assert_eq!(h(b""), 0xcbf29ce484222325);
        assert_eq!(h(b"a"), 0xaf63dc4c8601ec8c);
        assert_eq!(h(b"foobar"), 0x85944171f73967e8);
    }
}
