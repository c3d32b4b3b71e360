//! Which forwarding mode runs: the `--forward` option ([`ForwardMode`], what each mode answers
//! to the rest of the demux) and building it ([`start`], [`adopt`]). The one place that names
//! every mode's type, so that the interface they share ([`Forward`], in the parent) depends on
//! none of them.

use std::io;

use super::{drop, reuseport, shm, steering, unix};
use super::{Forward, IngressHandles, Setup};

/// How the demux hands datagrams to workers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum ForwardMode {
    /// Shared-memory rings with pipe doorbells (the design).
    Shm,
    /// One `sendmsg` per datagram on a unix SOCK_SEQPACKET socket (the baseline it replaces).
    Unix,
    /// Receive and route, then discard: the floor benchmarks compare against.
    Drop,
    /// Kernel steering: each worker receives on its own `SO_REUSEPORT` socket, a classic BPF
    /// program picks it by connection ID; the demux only supervises. Needs `--plaintext-cids`.
    Reuseport,
}

/// What differs per mode outside the data plane, asked of the mode rather than found by
/// comparing it: the supervisor, the sandbox, the upgrade and the start-up read these, and a
/// new mode answers them here.
impl ForwardMode {
    /// Whether each worker receives its own datagrams on its own socket in the public
    /// address's `SO_REUSEPORT` group (the kernel steers), rather than the demux receiving
    /// every datagram on the public socket. The worker's sandbox then lets it receive on its
    /// descriptor 4, and the public socket keeps no steering program of the demux's own.
    pub fn workers_receive(self) -> bool {
        self == ForwardMode::Reuseport
    }

    /// Whether the demux sees every connection's first datagrams, so that it can inspect
    /// ClientHellos (session-ticket bindings) and answer with Retries.
    pub fn demux_sees_handshakes(self) -> bool {
        !self.workers_receive()
    }

    /// Why `ringmux upgrade` never hands this mode's lanes to a new process image, if it
    /// does not.
    pub fn upgrade_refusal(self) -> Option<&'static str> {
        match self {
            ForwardMode::Shm | ForwardMode::Unix => None,
            ForwardMode::Drop => Some("--forward drop (a benchmark mode) is never upgraded"),
            ForwardMode::Reuseport => Some(reuseport::NOT_UPGRADED),
        }
    }
}

/// Something that runs with any forwarding mode: `start` calls it with the mode the
/// configuration names, so the data plane is compiled once per mode.
pub trait WithForward {
    type Output;
    fn run<F: Forward>(self, forward: F, handles: Vec<IngressHandles>) -> Self::Output;
}

/// Builds the forwarding mode `mode` from the ingresses a previous process image of the demux
/// handed over (one entry per lane), and runs `with` on it (with no new handles).
pub fn adopt<W: WithForward>(
    mode: ForwardMode,
    setup: Setup<'_>,
    lanes: Vec<Option<crate::forward::handover::Ingress>>,
    with: W,
) -> io::Result<W::Output> {
    Ok(match mode {
        ForwardMode::Shm => with.run(shm::Shm::adopt(&setup, lanes)?, Vec::new()),
        ForwardMode::Unix => with.run(unix::Unix::adopt(&setup, lanes)?, Vec::new()),
        ForwardMode::Drop => with.run(drop::Discard::adopt(&setup, lanes)?, Vec::new()),
        ForwardMode::Reuseport => {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                reuseport::NOT_UPGRADED,
            ))
        }
    })
}

/// Builds the forwarding mode `mode` with the first generation's ingresses (one per instance),
/// and runs `with` on it.
pub fn start<W: WithForward>(
    mode: ForwardMode,
    mut setup: Setup<'_>,
    with: W,
) -> io::Result<W::Output> {
    // The lanes' sockets of kernel steering join the public socket's group, after it; every
    // other mode closes the duplicate here.
    let group = match (mode, setup.public.take()) {
        (ForwardMode::Reuseport, Some(public)) => Some(reuseport::Group {
            addr: socket2::SockRef::from(&public.socket)
                .local_addr()?
                .as_socket()
                .ok_or_else(|| io::Error::other("the public socket has no IP address"))?,
            public: public.socket,
            plan: steering::SteeringPlan::new(&public.router, 0, 1),
            rcvbuf: public.rcvbuf,
            sndbuf: public.sndbuf,
        }),
        _ => None,
    };
    Ok(match mode {
        ForwardMode::Shm => {
            let (f, h) = shm::Shm::create(&setup)?;
            with.run(f, h)
        }
        ForwardMode::Unix => {
            let (f, h) = unix::Unix::create(&setup)?;
            with.run(f, h)
        }
        ForwardMode::Drop => {
            let (f, h) = drop::Discard::create(&setup)?;
            with.run(f, h)
        }
        ForwardMode::Reuseport => {
            let group = group.ok_or_else(|| {
                io::Error::new(
                    io::ErrorKind::InvalidInput,
                    "reuseport mode without the public socket",
                )
            })?;
            let (f, h) = reuseport::Reuseport::create(&setup, group)?;
            with.run(f, h)
        }
    })
}
