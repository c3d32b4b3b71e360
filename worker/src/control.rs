//! The control channel between the demux and one worker: a Unix `SOCK_SEQPACKET` socket, one
//! message per packet. This module owns the wire format of the hand-off and of the later
//! messages, and the SCM_RIGHTS plumbing; it is public so that someone embedding ringmux ingress
//! under their own quinn application can speak it.
//!
//! - demux → worker, first: [`Handoff`] as `key=value` lines, with the descriptors attached:
//!   the public socket; the ring's three descriptors (memfd, consumer page, doorbell) or the
//!   unix ingress socket; last, the worker's end of its session-store socket.
//! - worker → demux: `READY` once its endpoint is up; `STATS k=v …` about once a second.
//! - demux → worker: `SHUTDOWN` (drain: HTTP/3 GOAWAY, finish in-flight requests, exit 0).
//!
//! A closed control socket means the peer is gone: the demux treats it as the worker's death,
//! the worker as the demux's (it exits at once).

use std::io;
use std::mem::{size_of, MaybeUninit};
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::path::PathBuf;
use std::time::Duration;

/// Largest control message (the hand-off carries a PEM certificate chain).
pub const MAX_MESSAGE: usize = 256 * 1024;
/// Most descriptors one message carries.
pub const MAX_FDS: usize = 8;

/// How datagrams reach the worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IngressKind {
    /// The shared-memory ring: descriptors ring, consumer page, doorbell.
    Shm,
    /// One `SOCK_SEQPACKET` message per datagram (the baseline design): one descriptor.
    Unix,
}

/// Everything a worker needs to serve, sent once at start.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Handoff {
    pub instance: u8,
    pub instances: u8,
    pub generation: u64,
    pub ingress: IngressKind,
    pub spin_us: u32,
    /// The public address clients send to (the worker's `local_addr`).
    pub public_addr: SocketAddr,
    /// QUIC-LB: config rotation codepoint, node id, nonce length, encrypted or plaintext CIDs.
    pub config_id: u8,
    pub node_id: Vec<u8>,
    pub nonce_len: u8,
    pub encrypt_cids: bool,
    /// `KeySet::to_bytes()` of the shared keys.
    pub keys: Vec<u8>,
    pub cid_lifetime: Option<Duration>,
    pub root: Option<PathBuf>,
    pub max_bytes: u64,
    /// Budget of the worker's cache of small files from `root`; 0: none.
    pub file_cache_bytes: u64,
    /// `Cache-Control` for files from `root`.
    pub cache_control: Option<String>,
    pub retry: bool,
    pub idle_timeout: Duration,
    pub cpu: Option<usize>,
    pub cert_pem: String,
    pub key_pem: String,
    /// Benchmark sink: drain and count (checking each datagram's connection ID), no quinn.
    pub sink: bool,
}

/// A malformed control message.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error("control socket: {0}")]
    Io(#[from] io::Error),
    #[error("control socket closed by the peer")]
    Closed,
    #[error("hand-off field {field}: {problem}")]
    Field {
        field: &'static str,
        problem: String,
    },
    #[error("expected {expected} descriptors for {ingress:?} ingress, got {got}")]
    Descriptors {
        ingress: IngressKind,
        expected: usize,
        got: usize,
    },
}

impl Handoff {
    /// How many descriptors travel with this hand-off.
    pub fn fd_count(&self) -> usize {
        // public socket, ingress descriptors, session-store socket
        match self.ingress {
            IngressKind::Shm => 5,
            IngressKind::Unix => 3,
        }
    }

    /// The wire form: `key=value` lines; binary fields in hex.
    pub fn encode(&self) -> String {
        let mut s = String::new();
        let mut kv = |k: &str, v: &str| {
            s.push_str(k);
            s.push('=');
            s.push_str(v);
            s.push('\n');
        };
        kv("instance", &self.instance.to_string());
        kv("instances", &self.instances.to_string());
        kv("generation", &self.generation.to_string());
        kv(
            "ingress",
            match self.ingress {
                IngressKind::Shm => "shm",
                IngressKind::Unix => "unix",
            },
        );
        kv("spin_us", &self.spin_us.to_string());
        kv("public_addr", &self.public_addr.to_string());
        kv("config_id", &self.config_id.to_string());
        kv("node_id", &hex::encode(&self.node_id));
        kv("nonce_len", &self.nonce_len.to_string());
        kv("encrypt_cids", if self.encrypt_cids { "1" } else { "0" });
        kv("keys", &hex::encode(&self.keys));
        kv(
            "cid_lifetime_ms",
            &self
                .cid_lifetime
                .map_or(0, |d| d.as_millis() as u64)
                .to_string(),
        );
        kv(
            "root",
            &hex::encode(
                self.root
                    .as_ref()
                    .map_or(&[][..], |p| p.as_os_str().as_encoded_bytes()),
            ),
        );
        kv("max_bytes", &self.max_bytes.to_string());
        kv("file_cache_bytes", &self.file_cache_bytes.to_string());
        kv(
            "cache_control",
            &hex::encode(self.cache_control.as_deref().unwrap_or("")),
        );
        kv("retry", if self.retry { "1" } else { "0" });
        kv(
            "idle_timeout_ms",
            &(self.idle_timeout.as_millis() as u64).to_string(),
        );
        kv("cpu", &self.cpu.map_or(String::new(), |c| c.to_string()));
        kv("cert_pem", &hex::encode(self.cert_pem.as_bytes()));
        kv("key_pem", &hex::encode(self.key_pem.as_bytes()));
        kv("sink", if self.sink { "1" } else { "0" });
        s
    }

    /// Parses the wire form; every field must be present and well formed.
    pub fn decode(text: &str) -> Result<Self, ControlError> {
        let get = |k: &'static str| -> Result<&str, ControlError> {
            text.lines()
                .find_map(|l| l.strip_prefix(k).and_then(|r| r.strip_prefix('=')))
                .ok_or(ControlError::Field {
                    field: k,
                    problem: "missing".into(),
                })
        };
        fn num<T: std::str::FromStr>(k: &'static str, v: &str) -> Result<T, ControlError> {
            v.parse().map_err(|_| ControlError::Field {
                field: k,
                problem: format!("bad number {v:?}"),
            })
        }
        let bytes = |k: &'static str| -> Result<Vec<u8>, ControlError> {
            hex::decode(get(k)?).ok().ok_or(ControlError::Field {
                field: k,
                problem: "bad hex".into(),
            })
        };
        let string = |k: &'static str| -> Result<String, ControlError> {
            String::from_utf8(bytes(k)?).map_err(|_| ControlError::Field {
                field: k,
                problem: "not UTF-8".into(),
            })
        };
        let flag = |k: &'static str| -> Result<bool, ControlError> { Ok(get(k)? == "1") };
        let root = bytes("root")?;
        let lifetime: u64 = num("cid_lifetime_ms", get("cid_lifetime_ms")?)?;
        let cpu = get("cpu")?;
        let cache_control = string("cache_control")?;
        Ok(Handoff {
            instance: num("instance", get("instance")?)?,
            instances: num("instances", get("instances")?)?,
            generation: num("generation", get("generation")?)?,
            ingress: match get("ingress")? {
                "shm" => IngressKind::Shm,
                "unix" => IngressKind::Unix,
                other => {
                    return Err(ControlError::Field {
                        field: "ingress",
                        problem: format!("unknown {other:?}"),
                    })
                }
            },
            spin_us: num("spin_us", get("spin_us")?)?,
            public_addr: num("public_addr", get("public_addr")?)?,
            config_id: num("config_id", get("config_id")?)?,
            node_id: bytes("node_id")?,
            nonce_len: num("nonce_len", get("nonce_len")?)?,
            encrypt_cids: flag("encrypt_cids")?,
            keys: bytes("keys")?,
            cid_lifetime: (lifetime > 0).then(|| Duration::from_millis(lifetime)),
            root: (!root.is_empty()).then(|| {
                use std::os::unix::ffi::OsStringExt;
                PathBuf::from(std::ffi::OsString::from_vec(root))
            }),
            max_bytes: num("max_bytes", get("max_bytes")?)?,
            file_cache_bytes: num("file_cache_bytes", get("file_cache_bytes")?)?,
            cache_control: (!cache_control.is_empty()).then_some(cache_control),
            retry: flag("retry")?,
            idle_timeout: Duration::from_millis(num("idle_timeout_ms", get("idle_timeout_ms")?)?),
            cpu: if cpu.is_empty() {
                None
            } else {
                Some(num("cpu", cpu)?)
            },
            cert_pem: string("cert_pem")?,
            key_pem: string("key_pem")?,
            sink: flag("sink")?,
        })
    }
}

/// Sends one message with descriptors attached (SCM_RIGHTS).
pub fn send_with_fds(sock: BorrowedFd<'_>, data: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<()> {
    assert!(
        fds.len() <= MAX_FDS,
        "at most {MAX_FDS} descriptors per message"
    );
    let raw: Vec<RawFd> = fds.iter().map(|f| f.as_raw_fd()).collect();
    let mut iov = libc::iovec {
        iov_base: data.as_ptr() as *mut _,
        iov_len: data.len(),
    };
    let mut cbuf = [0u64; 16]; // 128 bytes, aligned: room for MAX_FDS descriptors
                               // SAFETY: a zeroed msghdr is valid; pointers below refer to live locals.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if !raw.is_empty() {
        // SAFETY: CMSG_SPACE is a pure computation.
        let space = unsafe { libc::CMSG_SPACE((raw.len() * size_of::<RawFd>()) as u32) } as usize;
        msg.msg_control = cbuf.as_mut_ptr().cast();
        msg.msg_controllen = space;
        // SAFETY: msg_control points to `space` <= 128 writable bytes; CMSG_FIRSTHDR is non-null.
        unsafe {
            let c = libc::CMSG_FIRSTHDR(&msg);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN((raw.len() * size_of::<RawFd>()) as u32) as usize;
            std::ptr::copy_nonoverlapping(
                raw.as_ptr(),
                libc::CMSG_DATA(c).cast::<RawFd>(),
                raw.len(),
            );
        }
    }
    loop {
        // SAFETY: msg is fully initialised above.
        let n = unsafe { libc::sendmsg(sock.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
        if n >= 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// Sends one message without descriptors.
pub fn send(sock: BorrowedFd<'_>, data: &[u8]) -> io::Result<()> {
    send_with_fds(sock, data, &[])
}

/// Receives one message and any descriptors attached (they arrive with `O_CLOEXEC`). Returns
/// `Ok(None)` for an orderly close; `WouldBlock` on a non-blocking socket with nothing queued.
pub fn recv_with_fds(
    sock: BorrowedFd<'_>,
    buf: &mut [u8],
) -> io::Result<Option<(usize, Vec<OwnedFd>)>> {
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    let mut cbuf = [MaybeUninit::<u64>::uninit(); 16];
    // SAFETY: a zeroed msghdr is valid.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    msg.msg_controllen = size_of::<[u64; 16]>();
    let n = loop {
        // SAFETY: msg points to live buffers of the stated sizes.
        let n = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
        if n >= 0 {
            break n as usize;
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    };
    let mut fds = Vec::new();
    // SAFETY: walking the control buffer the kernel filled, within msg_controllen.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let bytes = (*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize;
                let data = libc::CMSG_DATA(c).cast::<RawFd>();
                for i in 0..bytes / size_of::<RawFd>() {
                    fds.push(OwnedFd::from_raw_fd(data.add(i).read_unaligned()));
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    if msg.msg_flags & (libc::MSG_TRUNC | libc::MSG_CTRUNC) != 0 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "control message truncated",
        ));
    }
    if n == 0 && fds.is_empty() {
        return Ok(None);
    }
    Ok(Some((n, fds)))
}

/// Worker side: blocks for the hand-off and checks its descriptors.
pub fn recv_handoff(sock: BorrowedFd<'_>) -> Result<(Handoff, Vec<OwnedFd>), ControlError> {
    let mut buf = vec![0u8; MAX_MESSAGE];
    let (n, fds) = recv_with_fds(sock, &mut buf)?.ok_or(ControlError::Closed)?;
    let text = std::str::from_utf8(&buf[..n]).map_err(|_| ControlError::Field {
        field: "message",
        problem: "not UTF-8".into(),
    })?;
    let h = Handoff::decode(text)?;
    if fds.len() != h.fd_count() {
        return Err(ControlError::Descriptors {
            ingress: h.ingress,
            expected: h.fd_count(),
            got: fds.len(),
        });
    }
    Ok((h, fds))
}

/// Worker → demux statistics, sent about once a second.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WorkerReport {
    pub connections_active: u64,
    pub connections_total: u64,
    pub requests_total: u64,
    pub datagrams_in: u64,
    pub datagrams_dropped: u64,
    /// Sink mode: datagrams whose connection ID does not belong to this instance.
    pub bad_cid: u64,
    /// Sink mode: ring latency (receive timestamp to dequeue), ns.
    pub lat_p50_ns: u64,
    pub lat_p99_ns: u64,
    pub lat_p999_ns: u64,
    /// CPU time this worker used (user + system), ns.
    pub cpu_ns: u64,
    pub pid: u64,
}

impl WorkerReport {
    pub fn encode(&self) -> String {
        format!(
            "STATS connections_active={} connections_total={} requests_total={} datagrams_in={} datagrams_dropped={} bad_cid={} lat_p50_ns={} lat_p99_ns={} lat_p999_ns={} cpu_ns={} pid={}",
            self.connections_active,
            self.connections_total,
            self.requests_total,
            self.datagrams_in,
            self.datagrams_dropped,
            self.bad_cid,
            self.lat_p50_ns,
            self.lat_p99_ns,
            self.lat_p999_ns,
            self.cpu_ns,
            self.pid,
        )
    }

    /// Parses a `STATS` line; unknown keys are ignored, missing ones stay 0.
    pub fn decode(line: &str) -> Option<Self> {
        let rest = line.strip_prefix("STATS")?;
        let mut r = WorkerReport::default();
        for kv in rest.split_whitespace() {
            let (k, v) = kv.split_once('=')?;
            let v: u64 = v.parse().ok()?;
            match k {
                "connections_active" => r.connections_active = v,
                "connections_total" => r.connections_total = v,
                "requests_total" => r.requests_total = v,
                "datagrams_in" => r.datagrams_in = v,
                "datagrams_dropped" => r.datagrams_dropped = v,
                "bad_cid" => r.bad_cid = v,
                "lat_p50_ns" => r.lat_p50_ns = v,
                "lat_p99_ns" => r.lat_p99_ns = v,
                "lat_p999_ns" => r.lat_p999_ns = v,
                "cpu_ns" => r.cpu_ns = v,
                "pid" => r.pid = v,
                _ => {}
            }
        }
        Some(r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;
    use std::os::unix::net::UnixDatagram;

    fn sample() -> Handoff {
        Handoff {
            instance: 3,
            instances: 4,
            generation: 7,
            ingress: IngressKind::Shm,
            spin_us: 50,
            public_addr: "[::]:4433".parse().unwrap(),
            config_id: 1,
            node_id: vec![0xab],
            nonce_len: 14,
            encrypt_cids: true,
            keys: vec![1, 2, 3, 255],
            cid_lifetime: Some(Duration::from_secs(600)),
            root: Some("/srv/www dir".into()),
            max_bytes: 1 << 26,
            file_cache_bytes: 64 << 20,
            cache_control: Some("public, max-age=60".into()),
            retry: false,
            idle_timeout: Duration::from_secs(30),
            cpu: Some(1),
            cert_pem: "-----BEGIN CERTIFICATE-----\nabc\n".into(),
            key_pem: "key\n".into(),
            sink: false,
        }
    }

    #[test]
    fn handoff_round_trips() {
        let h = sample();
        assert_eq!(Handoff::decode(&h.encode()).unwrap(), h);
        let h2 = Handoff {
            root: None,
            cpu: None,
            cid_lifetime: None,
            cache_control: None,
            ingress: IngressKind::Unix,
            ..h
        };
        assert_eq!(Handoff::decode(&h2.encode()).unwrap(), h2);
    }

    #[test]
    fn bad_fields_are_named() {
        let text = sample().encode().replace("instance=3", "instance=300");
        let e = Handoff::decode(&text).unwrap_err().to_string();
        assert!(e.contains("instance"), "{e}");
        let text = sample()
            .encode()
            .replace("ingress=shm", "ingress=carrier-pigeon");
        assert!(Handoff::decode(&text)
            .unwrap_err()
            .to_string()
            .contains("ingress"));
    }

    #[test]
    fn descriptors_travel_with_the_message() {
        let (a, b) = UnixDatagram::pair().unwrap();
        let (x, _y) = UnixDatagram::pair().unwrap();
        send_with_fds(a.as_fd(), b"hello", &[x.as_fd(), x.as_fd()]).unwrap();
        let mut buf = [0u8; 64];
        let (n, fds) = recv_with_fds(b.as_fd(), &mut buf).unwrap().unwrap();
        assert_eq!(&buf[..n], b"hello");
        assert_eq!(fds.len(), 2);
        assert_ne!(fds[0].as_raw_fd(), x.as_raw_fd());
    }

    #[test]
    fn report_round_trips() {
        let r = WorkerReport {
            connections_active: 1,
            connections_total: 2,
            requests_total: 3,
            datagrams_in: 4,
            datagrams_dropped: 5,
            bad_cid: 6,
            lat_p50_ns: 7,
            lat_p99_ns: 8,
            lat_p999_ns: 9,
            cpu_ns: 10,
            pid: 11,
        };
        assert_eq!(WorkerReport::decode(&r.encode()), Some(r));
        assert_eq!(WorkerReport::decode("NOPE"), None);
    }
}
