//! The hand-off: the first message on a worker's control socket, demux → worker, with the
//! worker's descriptors attached (`SCM_RIGHTS`). It tells the worker everything it needs to
//! serve as one instance: which instance it is, its ingress, the QUIC-LB parameters, the keys
//! every instance shares, and what every QUIC server of the deployment
//! shares with the others (its idle timeout, the `alt-svc` of the TCP side). How ringmux's own
//! built-in server serves (files, proxy, sink) is not here: the demux passes those options on
//! that program's command line (`ringmux-worker --help`), so a program of one's own never
//! receives them and adding one changes no protocol version.
//!
//! Wire form: UTF-8 text, one `key=value` line per field, `protocol=` first. Binary and free-form
//! fields (keys, node ID, paths, PEM) are hex-encoded, so no value contains `=` or a newline.
//! Every field is required; unknown keys are ignored (a newer demux may add optional ones only
//! together with a version bump, see [`crate::PROTOCOL_VERSION`]).

use std::net::SocketAddr;
use std::time::Duration;

use ringmux_ring::SpinPolicy;

use crate::PROTOCOL_VERSION;

/// How datagrams reach the worker, and so which descriptors come with the hand-off. The
/// default is the design's, the ring; the demux writes each worker's own.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum IngressKind {
    /// The shared-memory ring: three descriptors, ring memfd, consumer page, doorbell.
    #[default]
    Shm,
    /// One `SOCK_SEQPACKET` message per datagram (the baseline design): one descriptor.
    Unix,
    /// Kernel steering: the worker receives and sends on its own `SO_REUSEPORT` socket of the
    /// public address, at [`crate::PUBLIC_FD`]; the kernel's steering program picks it by
    /// connection ID. No ingress descriptor comes with the hand-off.
    Reuseport,
}

impl IngressKind {
    /// Every kind: its name on the wire and how many ingress descriptors travel with it.
    const ALL: [(IngressKind, &'static str, usize); 3] = [
        (IngressKind::Shm, "shm", 3),
        (IngressKind::Unix, "unix", 1),
        (IngressKind::Reuseport, "reuseport", 0),
    ];

    fn entry(self) -> (IngressKind, &'static str, usize) {
        Self::ALL
            .into_iter()
            .find(|e| e.0 == self)
            .unwrap_or(Self::ALL[0])
    }

    /// The name on the wire.
    pub fn as_str(self) -> &'static str {
        self.entry().1
    }

    /// How many ingress descriptors travel with a hand-off of this kind.
    pub fn fd_count(self) -> usize {
        self.entry().2
    }

    /// The kind named `name` on the wire.
    pub fn from_name(name: &str) -> Option<IngressKind> {
        Self::ALL.into_iter().find(|e| e.1 == name).map(|e| e.0)
    }
}

/// Everything a worker needs to serve, sent once at start.
///
/// Its descriptors sit at [`Handoff::fd_numbers`], in this order: the ingress descriptors
/// ([`IngressKind::fd_count`]); then the worker's end of its session-store socket; last, the
/// site table, a sealed memfd of this worker's own ([`crate::sites`]). The demux
/// placed them there before the worker program started; the message itself carries none. The
/// worker's sending socket is at [`crate::PUBLIC_FD`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Handoff {
    /// This worker's instance number, `0..instances`.
    pub instance: u8,
    pub instances: u8,
    /// The ring's consumer generation this worker attaches to.
    pub generation: u64,
    /// The worker generation this worker belongs to: 1 for the workers started with the demux,
    /// one more for each `ringmux reload`. Its connection IDs carry
    /// [`Handoff::generation_slot`], so the demux routes them to this worker and not to another
    /// generation's worker of the same instance.
    pub worker_generation: u64,
    pub ingress: IngressKind,
    /// How an idle worker polls its ring before sleeping on its doorbell (`--spin`,
    /// `--spin-us`): given as it stands to `ringmux_ring::Consumer::attach`.
    pub spin: SpinPolicy,
    /// The public address clients send to (the worker's `local_addr`).
    pub public_addr: SocketAddr,
    /// The demux's listening TCP socket is at [`crate::TCP_FD`] (HTTPS over TCP beside HTTP/3,
    /// one accept queue every worker shares); `false`: nothing is open there.
    pub tcp: bool,
    /// The demux's listening TCP socket for plain HTTP (`--redirect-http`) is at
    /// [`crate::REDIRECT_FD`]: every request there is answered with a redirect to `https://`.
    pub redirect: bool,
    /// The access log (`--access-log`), a file opened for appending or the demux's standard
    /// error, is at [`crate::ACCESS_LOG_FD`]: one line per request.
    pub access_log: bool,
    /// QUIC-LB: config rotation codepoint, node id, nonce length, encrypted or plaintext CIDs.
    pub config_id: u8,
    pub node_id: Vec<u8>,
    pub nonce_len: u8,
    pub encrypt_cids: bool,
    /// The shared keys, in `ringmux_quic_lb::KeySet::to_bytes` form.
    pub keys: Vec<u8>,
    pub cid_lifetime: Option<Duration>,
    /// The CPU the demux pinned this worker to before it started, if any.
    pub cpu: Option<usize>,
    /// QUIC idle timeout (`ringmux --idle-timeout`), which `Worker::server_config` of the
    /// worker library applies to every program's endpoint.
    pub idle_timeout: Duration,
    /// The `alt-svc` field value a worker puts on every response over TCP (`ringmux
    /// --alt-svc`: `h3=":PORT"; ma=86400` by default, with the public UDP port, or what the
    /// operator set for a balancer that maps the port); `None`: none.
    pub alt_svc: Option<String>,
}

/// A hand-off that cannot be used.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum HandoffError {
    /// The demux speaks another version of the contract.
    #[error(
        "the demux speaks control protocol version {found}, this worker version {expected}: \
         run the worker built together with this ringmux (or upgrade the worker's ringmux-worker crate)"
    )]
    VersionMismatch { found: u32, expected: u32 },
    /// A field is missing or malformed.
    #[error("hand-off field {field}: {problem}")]
    Field {
        field: &'static str,
        problem: String,
    },
}

/// Every key of the wire form, in the order [`Handoff::encode`] writes them.
pub const KEYS: [&str; 21] = [
    "protocol",
    "instance",
    "instances",
    "generation",
    "worker_generation",
    "ingress",
    "spin",
    "public_addr",
    "tcp",
    "redirect",
    "access_log",
    "config_id",
    "node_id",
    "nonce_len",
    "encrypt_cids",
    "keys",
    "cid_lifetime_ms",
    "idle_timeout_ms",
    "alt_svc",
    "cpu",
    "end",
];

impl Handoff {
    /// The generation slot of [`Handoff::worker_generation`]: `(worker_generation - 1) mod 4`,
    /// the top two bits of the server-ID byte of this worker's connection IDs
    /// (`ringmux_quic_lb::server_id_byte`).
    pub fn generation_slot(&self) -> u8 {
        generation_slot(self.worker_generation)
    }

    /// How many descriptors travel with this hand-off: the ingress descriptors, the
    /// session-store socket, the site table.
    pub fn fd_count(&self) -> usize {
        self.ingress.fd_count() + 2
    }

    /// The descriptor numbers this hand-off's descriptors sit at, in order.
    pub fn fd_numbers(&self) -> std::ops::Range<i32> {
        // At most 4 (shm): the cast cannot truncate.
        crate::FIRST_HANDOFF_FD..crate::FIRST_HANDOFF_FD + self.fd_count() as i32
    }

    /// The wire form.
    pub fn encode(&self) -> String {
        let flag = |b: bool| if b { "1" } else { "0" };
        let values: [String; KEYS.len()] = [
            PROTOCOL_VERSION.to_string(),
            self.instance.to_string(),
            self.instances.to_string(),
            self.generation.to_string(),
            self.worker_generation.to_string(),
            self.ingress.as_str().to_string(),
            spin_value(self.spin),
            self.public_addr.to_string(),
            flag(self.tcp).to_string(),
            flag(self.redirect).to_string(),
            flag(self.access_log).to_string(),
            self.config_id.to_string(),
            hex::encode(&self.node_id),
            self.nonce_len.to_string(),
            flag(self.encrypt_cids).to_string(),
            hex::encode(&self.keys),
            self.cid_lifetime.map_or(0, millis).to_string(),
            millis(self.idle_timeout).to_string(),
            hex::encode(self.alt_svc.as_deref().unwrap_or("").as_bytes()),
            self.cpu.map_or(String::new(), |c| c.to_string()),
            String::new(),
        ];
        let mut s = String::new();
        for (k, v) in KEYS.iter().zip(values) {
            s.push_str(k);
            s.push('=');
            s.push_str(&v);
            s.push('\n');
        }
        s
    }

    /// Parses the wire form: the protocol version first, then every field, each checked.
    pub fn decode(message: &[u8]) -> Result<Self, HandoffError> {
        let text = std::str::from_utf8(message).map_err(|_| field("message", "not UTF-8"))?;
        let get = |k: &'static str| -> Result<&str, HandoffError> {
            text.lines()
                .find_map(|l| l.strip_prefix(k).and_then(|r| r.strip_prefix('=')))
                .ok_or_else(|| field(k, "missing"))
        };
        let found: u32 = num("protocol", get("protocol")?)?;
        if found != PROTOCOL_VERSION {
            return Err(HandoffError::VersionMismatch {
                found,
                expected: PROTOCOL_VERSION,
            });
        }
        // The last line: a message cut short anywhere is refused as a whole.
        get("end")?;
        let bytes = |k: &'static str| -> Result<Vec<u8>, HandoffError> {
            hex::decode(get(k)?).map_err(|_| field(k, "bad hex"))
        };
        let string = |k: &'static str| -> Result<String, HandoffError> {
            String::from_utf8(bytes(k)?).map_err(|_| field(k, "not UTF-8"))
        };
        let flag = |k: &'static str| -> Result<bool, HandoffError> {
            match get(k)? {
                "1" => Ok(true),
                "0" => Ok(false),
                other => Err(field(k, format!("expected 0 or 1, got {other:?}"))),
            }
        };
        let lifetime: u64 = num("cid_lifetime_ms", get("cid_lifetime_ms")?)?;
        let cpu = get("cpu")?;
        let instance: u8 = num("instance", get("instance")?)?;
        let instances: u8 = num("instances", get("instances")?)?;
        if instance >= instances {
            return Err(field(
                "instance",
                format!("{instance} is not below instances={instances}"),
            ));
        }
        Ok(Handoff {
            instance,
            instances,
            generation: num("generation", get("generation")?)?,
            worker_generation: match num("worker_generation", get("worker_generation")?)? {
                0 => return Err(field("worker_generation", "0: generations start at 1")),
                g => g,
            },
            ingress: {
                let name = get("ingress")?;
                IngressKind::from_name(name)
                    .ok_or_else(|| field("ingress", format!("unknown {name:?}")))?
            },
            spin: parse_spin(get("spin")?)?,
            public_addr: num("public_addr", get("public_addr")?)?,
            tcp: flag("tcp")?,
            redirect: flag("redirect")?,
            access_log: flag("access_log")?,
            config_id: num("config_id", get("config_id")?)?,
            node_id: bytes("node_id")?,
            nonce_len: num("nonce_len", get("nonce_len")?)?,
            encrypt_cids: flag("encrypt_cids")?,
            keys: bytes("keys")?,
            cid_lifetime: (lifetime > 0).then(|| Duration::from_millis(lifetime)),
            cpu: if cpu.is_empty() {
                None
            } else {
                Some(num("cpu", cpu)?)
            },
            idle_timeout: Duration::from_millis(num("idle_timeout_ms", get("idle_timeout_ms")?)?),
            alt_svc: Some(string("alt_svc")?).filter(|v| !v.is_empty()),
        })
    }
}

/// The wire form of `spin`: `fixed:US` or `adaptive:US`, the (longest) spin in µs.
fn spin_value(spin: SpinPolicy) -> String {
    let mode = if spin.adapts() { "adaptive" } else { "fixed" };
    // At most `SpinPolicy::MAX_US` when made by `from_micros`; a longer one is written as the
    // longest the field holds, which the worker refuses.
    let us = u32::try_from(spin.max().as_micros()).unwrap_or(u32::MAX);
    format!("{mode}:{us}")
}

/// [`spin_value`] read back, the spin checked against `SpinPolicy::MAX_US`.
fn parse_spin(v: &str) -> Result<SpinPolicy, HandoffError> {
    let (mode, us) = v.split_once(':').ok_or_else(|| {
        field(
            "spin",
            format!("expected fixed:US or adaptive:US, got {v:?}"),
        )
    })?;
    let adaptive = match mode {
        "fixed" => false,
        "adaptive" => true,
        other => return Err(field("spin", format!("unknown mode {other:?}"))),
    };
    SpinPolicy::from_micros(num("spin", us)?, adaptive).map_err(|e| field("spin", e.to_string()))
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// The generation slot of worker generation `generation` (which starts at 1): its CIDs carry
/// it, so four generations in a row own distinct CIDs.
pub fn generation_slot(generation: u64) -> u8 {
    (generation.wrapping_sub(1) % u64::from(GENERATION_SLOTS)) as u8
}

/// Worker generations whose connection IDs the demux tells apart (the server-ID byte's top
/// two bits): up to this many generations of one instance can hold connections at once.
pub const GENERATION_SLOTS: u8 = 4;

fn field(field: &'static str, problem: impl Into<String>) -> HandoffError {
    HandoffError::Field {
        field,
        problem: problem.into(),
    }
}

fn num<T: std::str::FromStr>(k: &'static str, v: &str) -> Result<T, HandoffError> {
    v.parse().map_err(|_| field(k, format!("bad value {v:?}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A hand-off with every field set to something other than its default.
    pub(crate) fn sample() -> Handoff {
        Handoff {
            instance: 3,
            instances: 4,
            generation: 7,
            worker_generation: 6,
            ingress: IngressKind::Shm,
            spin: SpinPolicy::Adaptive {
                max: Duration::from_micros(50),
            },
            public_addr: "[::]:4433".parse().unwrap(),
            tcp: true,
            redirect: true,
            access_log: false,
            config_id: 1,
            node_id: vec![0xab],
            nonce_len: 14,
            encrypt_cids: true,
            keys: vec![1, 2, 3, 255],
            cid_lifetime: Some(Duration::from_secs(600)),
            cpu: Some(1),
            idle_timeout: Duration::from_secs(30),
            alt_svc: Some("h3=\":4433\"; ma=86400".into()),
        }
    }

    #[test]
    fn round_trips() {
        let h = sample();
        assert_eq!(Handoff::decode(h.encode().as_bytes()).unwrap(), h);
        let h2 = Handoff {
            cpu: None,
            cid_lifetime: None,
            ingress: IngressKind::Unix,
            alt_svc: None,
            spin: SpinPolicy::Fixed(Duration::ZERO),
            ..h
        };
        assert_eq!(Handoff::decode(h2.encode().as_bytes()).unwrap(), h2);
    }

    #[test]
    fn every_key_is_written_once_in_order() {
        let text = sample().encode();
        let keys: Vec<&str> = text.lines().map(|l| l.split_once('=').unwrap().0).collect();
        assert_eq!(keys, KEYS);
    }

    #[test]
    fn another_version_is_refused_before_anything_else() {
        let text = sample()
            .encode()
            .replace(
                &format!("protocol={PROTOCOL_VERSION}\n"),
                &format!("protocol={}\n", PROTOCOL_VERSION + 1),
            )
            .replace("instance=3", "instance=oops");
        assert_eq!(
            Handoff::decode(text.as_bytes()),
            Err(HandoffError::VersionMismatch {
                found: PROTOCOL_VERSION + 1,
                expected: PROTOCOL_VERSION
            })
        );
        let e = Handoff::decode(b"instance=1\n").unwrap_err();
        assert!(e.to_string().contains("protocol"), "{e}");
    }

    #[test]
    fn bad_fields_are_named() {
        let cases = [
            ("instance=3", "instance=300", "instance"),
            ("instance=3", "instance=4", "instance"),
            ("ingress=shm", "ingress=carrier-pigeon", "ingress"),
            ("tcp=1", "tcp=yes", "tcp"),
            (
                "idle_timeout_ms=30000",
                "idle_timeout_ms=-1",
                "idle_timeout_ms",
            ),
            ("keys=010203ff", "keys=0g", "keys"),
            ("spin=adaptive:50", "spin=adaptive:2000000", "spin"),
            ("spin=adaptive:50", "spin=sometimes:50", "spin"),
            ("spin=adaptive:50", "spin=50", "spin"),
            ("end=\n", "", "end"),
        ];
        for (from, to, name) in cases {
            let text = sample().encode().replace(from, to);
            let e = Handoff::decode(text.as_bytes()).unwrap_err();
            assert!(
                matches!(&e, HandoffError::Field { field, .. } if *field == name),
                "{from} -> {to}: {e}"
            );
        }
        assert!(Handoff::decode(&[0xff, 0xfe]).is_err());
    }

    #[test]
    fn descriptor_count_follows_the_ingress() {
        let h = sample();
        assert_eq!(h.fd_count(), 5);
        assert_eq!(h.fd_numbers(), 8..13);
        assert!(h.fd_count() <= crate::MAX_FDS);
        let u = Handoff {
            ingress: IngressKind::Unix,
            ..h
        };
        assert_eq!(u.fd_count(), 3);
        assert_eq!(u.fd_numbers(), 8..11);
    }
}
