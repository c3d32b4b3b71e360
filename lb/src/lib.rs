//! `ringmux lb-config`: the configuration of a load balancer in front of several ringmux nodes.
//!
//! A node is one box running `ringmux` with its own `--node-id`; every connection ID its workers
//! issue is `first octet ‖ node ID ‖ instance byte ‖ nonce` (QUIC-LB, draft-ietf-quic-load-
//! balancers-21 §5.2, see `quic-lb/src/config.rs`). A balancer that reads the node ID sends every
//! packet of a connection to the box that holds it, also after the client moved to a new
//! address or port, which a 4-tuple hash cannot do.
//!
//! This crate owns turning a checked description of the nodes ([`NftPlan`]) into an nftables
//! ruleset ([`nftables`]) for a Linux box in front of them: a pure function, tested on its text
//! here and on real packets by `deploy/cluster.sh test`. It never runs `nft` itself and never
//! touches the network. Plaintext CIDs only: nftables reads bytes at fixed offsets and cannot
//! decrypt a CID; an encrypted configuration needs a balancer that holds the QUIC-LB key.
//!
//! The rules, for the first packet of every UDP 4-tuple to the virtual address (netfilter's
//! connection tracking NATs the later packets of a 4-tuple as it did the first, so a 4-tuple
//! stays on the node where it started):
//!
//! 1. A short header (RFC 8999 §5.2: form bit 0, the DCID from byte 1) whose DCID is one of
//!    ours (the configuration's first octet, a datagram long enough for the whole CID) goes to
//!    the node its node ID names. One that names no node here is dropped and counted: the
//!    connection is on no other node, and another node's stateless reset would end it (and
//!    make every node an oracle for the others' reset tokens, draft-21 §"Stateless Reset
//!    Oracle").
//! 2. A long header (RFC 8999 §5.1: DCID length at byte 5, the DCID from byte 6) whose DCID is
//!    one of ours (that length and first octet) goes to its node; naming no node here, it is
//!    hashed (3): an Initial after a Retry, whose token every node accepts, is served anywhere.
//! 3. Anything else (Initials and 0-RTT with a client-chosen DCID, other versions, garbage) is
//!    hashed by source address and port over the nodes that are not draining (draft-21
//!    §"Load Balancer Forwarding", its fallback "a pure function of the 4-tuple").
//!
//! TCP (on unless `--tcp off`): the VIP's port, where the nodes serve HTTPS over TCP (how a
//! browser learns of HTTP/3, from alt-svc) and an ACME CA's TLS-ALPN-01 validation connects,
//! and every `--tcp-port` (80 for the nodes' `--redirect-http` listener and HTTP-01). TCP has
//! no connection ID to read, and a TCP connection never changes its 4-tuple, so the first
//! packet of every new connection (conntrack state new: the SYN) is hashed by source address
//! and port over the nodes that are not draining, as 3 hashes UDP, and sent to that node's
//! address: the node's port for the VIP's port, the same port for another. Connection
//! tracking keeps the connection on that node to its end, and nothing else can: a drained
//! node finishes its TCP connections as long as their conntrack entries are kept (after
//! draining delete only the node's UDP mappings, `conntrack -D -p udp -r ADDR`), a removed
//! node's end when its entries are deleted (`conntrack -D -r ADDR`). A new connection from
//! a source port used before meets the hash again: conntrack starts a new entry for a SYN on
//! a closed one.

pub mod options;

use std::fmt::Write as _;
use std::net::{IpAddr, SocketAddr};

use anyhow::{bail, Context, Result};
use ringmux_quic_lb::{CidCodec, QuicLbConfig};

use crate::options::{default_nonce_len, node_id_bytes, Toggle};

/// The balancers `ringmux lb-config` configures.
#[derive(clap::Subcommand, Debug)]
pub enum Balancer {
    /// An nftables ruleset (Linux netfilter) for the box in front of the nodes: apply it with
    /// `nft -f FILE` there, with IP forwarding on and the nodes' routes to clients through that
    /// box (their replies must pass its connection tracking). QUIC: packets carrying a node's
    /// connection ID go to that node (the ID is read in clear: the nodes must run with
    /// --plaintext-cids, since nftables cannot decrypt CIDs); new connections are hashed by
    /// source address and port; a short header whose connection ID names no listed node is
    /// dropped and counted (counter unknown_node). TCP (unless --tcp off): every new
    /// connection to the VIP's port (the nodes' HTTPS listener) and to each --tcp-port is
    /// hashed by source address and port. Every 4-tuple, UDP or TCP, stays on the node where
    /// it started. One address family per ruleset (table ip or ip6): run it once per VIP.
    /// The ruleset replaces its table as a whole in one transaction: generate it again and
    /// apply it to add, drain or remove a node (connections already on a node stay there).
    Nftables(NftablesArgs),
}

/// `ringmux lb-config nftables`: the nodes, and the QUIC-LB settings they all run with.
#[derive(clap::Args, Debug, Clone)]
pub struct NftablesArgs {
    /// The virtual address and port clients connect to, on the balancer, for QUIC (UDP) and,
    /// unless --tcp off, HTTPS over TCP: IPv4 or IPv6 (`[ADDR]:PORT`).
    #[arg(long, env = "RINGMUX_LB_VIP", value_name = "ADDR:PORT")]
    pub vip: SocketAddr,
    /// A node: its --node-id (hex, the same length for every node) and the address its ringmux
    /// listens on (UDP, and TCP for the VIP's port), of the VIP's family; the port defaults to
    /// the VIP's. Repeat for every node, or separate them with commas.
    #[arg(
        long = "node",
        env = "RINGMUX_LB_NODES",
        value_name = "ID=ADDR[:PORT]",
        value_delimiter = ',',
        required = true
    )]
    pub nodes: Vec<String>,
    /// Node IDs (of --node) that take no new connections: their connection IDs and their
    /// TCP connections still reach them, hashing (UDP and TCP) skips them. Drain a node this
    /// way before removing it from --node.
    #[arg(
        long = "drain",
        env = "RINGMUX_LB_DRAIN",
        value_name = "ID",
        value_delimiter = ','
    )]
    pub drain: Vec<String>,
    /// QUIC-LB config rotation codepoint the nodes run with (their --config-id, 0–6).
    #[arg(long, env = "RINGMUX_CONFIG_ID", default_value_t = 0)]
    pub config_id: u8,
    /// QUIC-LB nonce length the nodes run with (their --nonce-len). Default: what ringmux
    /// derives from the node-ID length (16 − node-ID length − 1, at least 4).
    #[arg(long, env = "RINGMUX_NONCE_LEN")]
    pub nonce_len: Option<u8>,
    /// Say that the nodes run with --plaintext-cids (required): nftables reads the node ID in
    /// clear and cannot decrypt encrypted CIDs.
    #[arg(long, env = "RINGMUX_PLAINTEXT_CIDS")]
    pub plaintext_cids: bool,
    /// Balance TCP too (`on`, the default): every new TCP connection to the VIP's port (the
    /// nodes' HTTPS listener, same port number as QUIC) and to each --tcp-port is hashed by
    /// source address and port over the nodes not in --drain, and stays on its node to its end.
    /// `off` when something else balances TCP: the ruleset then touches UDP only.
    #[arg(long, env = "RINGMUX_LB_TCP", value_enum, default_value = "on")]
    pub tcp: Toggle,
    /// Another TCP port of the VIP to balance beside the VIP's own, e.g. 80 for the nodes'
    /// --redirect-http listener (and ACME HTTP-01 validation); its connections go to the
    /// chosen node's address with this same port. Repeat, or separate with commas.
    #[arg(
        long = "tcp-port",
        env = "RINGMUX_LB_TCP_PORTS",
        value_name = "PORT",
        value_delimiter = ','
    )]
    pub tcp_ports: Vec<u16>,
    /// Name of the nftables table the ruleset owns (and replaces whole when applied again).
    #[arg(long, env = "RINGMUX_LB_TABLE", default_value = "ringmux")]
    pub table: String,
    /// Seed of the hash that spreads new connections (hex, up to 8 digits). Default: a fresh
    /// random one (clients then cannot aim new connections at one node by their port).
    #[arg(long, env = "RINGMUX_LB_HASH_SEED", value_name = "HEX")]
    pub hash_seed: Option<String>,
}

/// A checked balancer configuration: everything [`nftables`] needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NftPlan {
    /// nftables table name.
    pub table: String,
    /// Where clients send.
    pub vip: SocketAddr,
    /// The nodes, in the order given.
    pub nodes: Vec<NftNode>,
    /// The first octet of every CID the nodes issue (config rotation and length).
    pub first_octet: u8,
    /// Node-ID length, the same for every node.
    pub node_id_len: usize,
    /// Length of every CID the nodes issue.
    pub cid_len: usize,
    /// jhash seed.
    pub seed: u32,
    /// The TCP ports of the VIP that are balanced: the VIP's own first, then every
    /// `--tcp-port`; none with `--tcp off`.
    pub tcp_ports: Vec<u16>,
}

/// One node behind the balancer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NftNode {
    /// Its `--node-id`.
    pub id: Vec<u8>,
    /// Where its ringmux listens.
    pub addr: SocketAddr,
    /// Takes no new connections (`--drain`).
    pub draining: bool,
}

impl NftablesArgs {
    /// Checks the arguments; every refusal names the option, the value and what would work.
    pub fn validate(&self) -> Result<NftPlan> {
        if !self.plaintext_cids {
            bail!(
                "--plaintext-cids / RINGMUX_PLAINTEXT_CIDS is not set: the rules read the node ID \
                 in clear, so every node must run ringmux with --plaintext-cids (encrypted CIDs \
                 need a balancer that holds the QUIC-LB key, which nftables cannot be). Run the \
                 nodes with --plaintext-cids and pass it here too"
            );
        }
        if !valid_name(&self.table) {
            bail!(
                "--table / RINGMUX_LB_TABLE={:?} is not valid: expected a letter, then letters, \
                 digits or _ (at most 64), e.g. ringmux",
                self.table
            );
        }
        let seed = match &self.hash_seed {
            Some(hex) => u32::from_str_radix(hex.trim().trim_start_matches("0x"), 16)
                .ok()
                .with_context(|| {
                    format!(
                        "--hash-seed / RINGMUX_LB_HASH_SEED={hex:?} is not valid: expected up to \
                         8 hex digits, e.g. 5eed1234"
                    )
                })?,
            None => {
                let mut b = [0u8; 4];
                // getrandom's error is a code with no source to keep (its std traits are off).
                getrandom::fill(&mut b)
                    .map_err(|e| anyhow::anyhow!("a random --hash-seed: {e}"))?;
                u32::from_be_bytes(b)
            }
        };
        let mut nodes: Vec<NftNode> = Vec::with_capacity(self.nodes.len());
        for spec in &self.nodes {
            let node = parse_node(spec, self.vip)?;
            if let Some(first) = nodes.first() {
                if first.id.len() != node.id.len() {
                    bail!(
                        "--node {spec:?}: its node ID is {} bytes, the first node's ({}) is {}: \
                         every node behind one balancer needs a node ID of the same length (the \
                         rules read that many bytes of every CID)",
                        node.id.len(),
                        hex::encode(&first.id),
                        first.id.len()
                    );
                }
            }
            if nodes.iter().any(|n| n.id == node.id) {
                bail!(
                    "--node {spec:?}: node ID {} is given twice; every node needs its own",
                    hex::encode(&node.id)
                );
            }
            nodes.push(node);
        }
        let Some(node_id_len) = nodes.first().map(|n| n.id.len()) else {
            bail!("no --node given: name every node as --node ID=ADDR, e.g. --node 0a=10.0.0.2");
        };
        for d in &self.drain {
            let id = node_id_bytes(d);
            let Some(node) = nodes.iter_mut().find(|n| Some(&n.id) == id.as_ref()) else {
                bail!(
                    "--drain / RINGMUX_LB_DRAIN={d:?} names no --node: give the node ID of one \
                     of the nodes (hex, as in --node ID=ADDR)"
                );
            };
            node.draining = true;
        }
        if nodes.iter().all(|n| n.draining) {
            bail!(
                "--drain names every node: new connections would have nowhere to go; keep at \
                 least one node out of --drain"
            );
        }
        let tcp_ports = self.tcp_ports()?;
        let nonce_len = self
            .nonce_len
            .unwrap_or_else(|| default_nonce_len(node_id_len));
        let lb = QuicLbConfig {
            config_id: self.config_id,
            node_id: nodes[0].id.clone(),
            instance_count: 1,
            nonce_len,
            key: None,
        };
        lb.validate().context(
            "the nodes' QUIC-LB configuration (--config-id, --nonce-len, the node-ID length of \
             --node) is not one ringmux runs with",
        )?;
        let codec = CidCodec::new(
            lb.config_id,
            lb.server_id_len(),
            usize::from(lb.nonce_len),
            None,
        )
        .context("the nodes' QUIC-LB configuration")?;
        Ok(NftPlan {
            table: self.table.clone(),
            vip: self.vip,
            nodes,
            first_octet: codec.first_octet(),
            node_id_len,
            cid_len: codec.cid_len(),
            seed,
            tcp_ports,
        })
    }

    /// The TCP ports to balance: the VIP's, then `--tcp-port` in the order given.
    fn tcp_ports(&self) -> Result<Vec<u16>> {
        if self.tcp == Toggle::Off {
            if let Some(p) = self.tcp_ports.first() {
                bail!(
                    "--tcp-port / RINGMUX_LB_TCP_PORTS={p} is given but --tcp / RINGMUX_LB_TCP \
                     is off: drop --tcp-port (with --tcp off another balancer has TCP), or \
                     --tcp on to balance TCP here"
                );
            }
            return Ok(Vec::new());
        }
        let mut ports = vec![self.vip.port()];
        for &p in &self.tcp_ports {
            if p == 0 {
                bail!(
                    "--tcp-port / RINGMUX_LB_TCP_PORTS=0 is not valid: give a TCP port the \
                     nodes listen on, e.g. 80 for their --redirect-http"
                );
            }
            if p == self.vip.port() {
                bail!(
                    "--tcp-port {p} is the port of --vip {}, which is balanced over TCP \
                     already (to the nodes' ports): drop it",
                    self.vip
                );
            }
            if ports.contains(&p) {
                bail!("--tcp-port {p} is given twice; give every port once");
            }
            ports.push(p);
        }
        Ok(ports)
    }
}

/// One `--node ID=ADDR[:PORT]`, the port defaulting to the VIP's.
fn parse_node(spec: &str, vip: SocketAddr) -> Result<NftNode> {
    let Some((id, addr)) = spec.split_once('=') else {
        bail!(
            "--node / RINGMUX_LB_NODES={spec:?} is not valid: expected ID=ADDR[:PORT], e.g. \
             0a=10.0.0.2 or 0a=[fd00::2]:443"
        );
    };
    let id = node_id_bytes(id).with_context(|| {
        format!(
            "--node {spec:?}: node ID {id:?} is not valid: expected hex bytes as the node's \
             --node-id, e.g. 0a or 0x0102030405060708"
        )
    })?;
    let addr = addr.trim();
    let addr = match addr.parse::<SocketAddr>() {
        Ok(a) => a,
        Err(_) => match addr.trim_matches(['[', ']']).parse::<IpAddr>() {
            Ok(ip) => SocketAddr::new(ip, vip.port()),
            Err(_) => bail!(
                "--node {spec:?}: address {addr:?} is not valid: expected ADDR or ADDR:PORT, \
                 e.g. 10.0.0.2, 10.0.0.2:443 or [fd00::2]:443"
            ),
        },
    };
    if addr.is_ipv4() != vip.is_ipv4() {
        bail!(
            "--node {spec:?}: address {addr} is not of the family of --vip {vip}: the ruleset \
             translates addresses of one family (run lb-config once per family, each with its \
             VIP and the nodes' addresses of that family)"
        );
    }
    if addr.port() == 0 {
        bail!("--node {spec:?}: port 0 is not valid: give the port the node's ringmux listens on");
    }
    Ok(NftNode {
        id,
        addr,
        draining: false,
    })
}

/// An nftables identifier we are sure of: a letter, then letters, digits or `_`.
fn valid_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphabetic())
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
        && name.len() <= 64
}

impl NftPlan {
    /// `ip` or `ip6`: the family of the table and of every address in it.
    pub fn family(&self) -> &'static str {
        if self.vip.is_ipv4() {
            "ip"
        } else {
            "ip6"
        }
    }

    /// Shortest UDP payload of a short header that holds one of our CIDs whole.
    pub fn short_min_payload(&self) -> usize {
        1 + self.cid_len
    }

    /// Shortest UDP payload of a long header that holds one of our CIDs whole and the SCID
    /// length octet after it.
    pub fn long_min_payload(&self) -> usize {
        6 + self.cid_len + 1
    }

    /// The nodes new connections are hashed over, in order.
    pub fn hashed_nodes(&self) -> impl Iterator<Item = &NftNode> {
        self.nodes.iter().filter(|n| !n.draining)
    }
}

impl NftNode {
    /// The name of its chains and counters: `cid_ID` (sent to it by a CID), `hash_ID` (hashed
    /// to it), `tcp_ID` (its TCP connections).
    fn label(&self) -> String {
        hex::encode(&self.id)
    }

    /// Where a new TCP connection to the VIP's `port` goes on this node: its address for the
    /// VIP's own port (where its HTTPS listener is, beside QUIC), else its IP with `port`.
    fn tcp_addr(&self, port: u16, vip: SocketAddr) -> SocketAddr {
        if port == vip.port() {
            self.addr
        } else {
            SocketAddr::new(self.addr.ip(), port)
        }
    }
}

/// `addr` as nftables writes a NAT target.
fn nat_target(addr: SocketAddr) -> String {
    match addr {
        SocketAddr::V4(a) => a.to_string(),
        SocketAddr::V6(a) => format!("[{}]:{}", a.ip(), a.port()),
    }
}

/// Bit offset of UDP payload byte `n` in nftables' raw payload expression `@th,OFFSET,LEN`
/// (offsets count from the transport header; the UDP header is 8 bytes).
const fn payload_bit(n: usize) -> usize {
    (8 + n) * 8
}

/// `writeln!` to a String, which cannot fail.
macro_rules! out {
    ($o:expr, $($arg:tt)*) => { let _ = writeln!($o, $($arg)*); };
}

/// The nftables ruleset for `plan` (`nft -f`): its own table, deleted and made again in one
/// transaction, with a NAT chain at prerouting. Module docs say what the rules do; one step
/// per part, in the file's order.
pub fn nftables(plan: &NftPlan) -> String {
    let mut o = String::new();
    nft_header(&mut o, plan);
    nft_nodes(&mut o, plan);
    nft_prerouting(&mut o, plan);
    nft_quic(&mut o, plan);
    nft_tcp_new(&mut o, plan);
    out!(o, "}}");
    o
}

/// The VIP's address, without its port.
fn vip_ip(plan: &NftPlan) -> String {
    match plan.vip {
        SocketAddr::V4(a) => a.ip().to_string(),
        SocketAddr::V6(a) => a.ip().to_string(),
    }
}

/// The TCP ports balanced, as text.
fn tcp_ports(plan: &NftPlan) -> Vec<String> {
    plan.tcp_ports.iter().map(u16::to_string).collect()
}

/// The comment that opens the file: how to apply it, what the nodes must share, what the
/// rules do.
fn nft_header(o: &mut String, plan: &NftPlan) {
    let (fam, table) = (plan.family(), &plan.table);
    let (first, cid_len) = (plan.first_octet, plan.cid_len);
    let (vip_ip, vip_port, tcp_ports) = (vip_ip(plan), plan.vip.port(), tcp_ports(plan));
    out!(o, "#!/usr/sbin/nft -f");
    out!(
        o,
        "# ringmux lb-config nftables (ringmux {}): the balancer in front of {} ringmux node(s).",
        env!("CARGO_PKG_VERSION"),
        plan.nodes.len()
    );
    out!(
        o,
        "# Apply with `nft -f FILE`: one transaction that replaces table {fam} {table} whole;"
    );
    out!(
        o,
        "# generate and apply again to add, drain or remove a node (connection tracking keeps"
    );
    out!(
        o,
        "# every 4-tuple on the node where it started). Needs IP forwarding on this box, and the"
    );
    out!(
        o,
        "# nodes' replies routed back through it (it rewrites their source to {}).",
        plan.vip
    );
    out!(o, "#");
    out!(
        o,
        "# PLAINTEXT CIDs ONLY: every node runs ringmux with --plaintext-cids, the same"
    );
    out!(
        o,
        "# --config-id and --nonce-len, the same --key-file, and its own --node-id of"
    );
    out!(o,
        "# {} byte(s). Their CIDs are {cid_len} bytes: first octet {first:#04x}, node ID (bytes 1 to {}),",
        plan.node_id_len,
        plan.node_id_len
    );
    out!(o, "# the instance byte, the nonce. Encrypted CIDs need a balancer that holds the QUIC-LB key.");
    out!(o, "#");
    out!(
        o,
        "# For the first packet of each UDP 4-tuple to {}:",
        plan.vip
    );
    out!(
        o,
        "#  1. short header with one of our CIDs: to the node its node ID names; naming no node"
    );
    out!(
        o,
        "#     here: dropped, counted by counter unknown_node (no other node has the connection,"
    );
    out!(o, "#     and its stateless reset would end it);");
    out!(
        o,
        "#  2. long header with one of our CIDs: to its node; naming no node here: hashed (3);"
    );
    out!(
        o,
        "#  3. anything else (new connections' Initials, garbage): hashed by source address and"
    );
    out!(o, "#     port over the nodes not draining.");
    out!(
        o,
        "# Counters cid_ID and hash_ID count the 4-tuples each node got by 1-2 and by 3."
    );
    out!(o, "#");
    if plan.tcp_ports.is_empty() {
        out!(o, "# TCP: not balanced here (--tcp off).");
    } else {
        out!(o,
            "# TCP to {vip_ip} port(s) {}: every new connection is hashed by source address and port",
            tcp_ports.join(", ")
        );
        out!(o, "# over the nodes not draining, to the node's address (port {vip_port}: the node's port;");
        out!(
            o,
            "# another: the same port), and stays there to its end; counter tcp_ID counts them."
        );
    }
}

/// The table (deleted and made again), its counters, the node-ID map and each node's chains.
fn nft_nodes(o: &mut String, plan: &NftPlan) {
    let (fam, table) = (plan.family(), &plan.table);
    let id_bits = plan.node_id_len * 8;
    out!(o, "table {fam} {table}");
    out!(o, "delete table {fam} {table}");
    out!(o, "table {fam} {table} {{");
    out!(o, "\tcounter unknown_node {{");
    out!(o, "\t}}");
    for n in &plan.nodes {
        let l = n.label();
        out!(o, "\tcounter cid_{l} {{");
        out!(o, "\t}}");
        out!(o, "\tcounter hash_{l} {{");
        out!(o, "\t}}");
        if !plan.tcp_ports.is_empty() {
            out!(o, "\tcounter tcp_{l} {{");
            out!(o, "\t}}");
        }
    }
    out!(o, "");
    out!(
        o,
        "\t# Node ID -> that node; draining nodes too (their connections go on)."
    );
    out!(o, "\tmap cid_node {{");
    out!(o, "\t\ttypeof @th,{},{id_bits} : verdict", payload_bit(2));
    let elements: Vec<String> = plan
        .nodes
        .iter()
        .map(|n| format!("0x{} : goto cid_{}", n.label(), n.label()))
        .collect();
    out!(o, "\t\telements = {{ {} }}", elements.join(", "));
    out!(o, "\t}}");
    for n in &plan.nodes {
        let l = n.label();
        let drain = if n.draining { " (draining)" } else { "" };
        out!(o, "");
        out!(o, "\t# Node {l}{drain}.");
        out!(o, "\tchain cid_{l} {{");
        out!(
            o,
            "\t\tmeta l4proto udp counter name \"cid_{l}\" dnat to {}",
            nat_target(n.addr)
        );
        out!(o, "\t}}");
        out!(o, "\tchain hash_{l} {{");
        out!(
            o,
            "\t\tmeta l4proto udp counter name \"hash_{l}\" dnat to {}",
            nat_target(n.addr)
        );
        out!(o, "\t}}");
        if !plan.tcp_ports.is_empty() {
            out!(o, "\tchain tcp_{l} {{");
            for &port in &plan.tcp_ports {
                out!(
                    o,
                    "\t\ttcp dport {port} counter name \"tcp_{l}\" dnat to {}",
                    nat_target(n.tcp_addr(port, plan.vip))
                );
            }
            out!(o, "\t}}");
        }
    }
}

/// The NAT hook: UDP to the VIP goes to `quic`, new TCP connections to `tcp_new`.
fn nft_prerouting(o: &mut String, plan: &NftPlan) {
    let fam = plan.family();
    let (vip_ip, vip_port, tcp_ports) = (vip_ip(plan), plan.vip.port(), tcp_ports(plan));
    out!(o, "");
    out!(o, "\tchain prerouting {{");
    out!(
        o,
        "\t\ttype nat hook prerouting priority dstnat; policy accept;"
    );
    out!(o, "\t\t{fam} daddr {vip_ip} udp dport {vip_port} jump quic");
    match tcp_ports.as_slice() {
        [] => {}
        [one] => {
            out!(
                o,
                "\t\t{fam} daddr {vip_ip} tcp dport {one} ct state new jump tcp_new"
            );
        }
        many => {
            out!(
                o,
                "\t\t{fam} daddr {vip_ip} tcp dport {{ {} }} ct state new jump tcp_new",
                many.join(", ")
            );
        }
    }
    out!(o, "\t}}");
}

/// The `quic` chain: by the node ID in the CID, else hashed.
fn nft_quic(o: &mut String, plan: &NftPlan) {
    let fam = plan.family();
    let id_bits = plan.node_id_len * 8;
    let (first, cid_len) = (plan.first_octet, plan.cid_len);
    let hashed: Vec<&NftNode> = plan.hashed_nodes().collect();
    out!(o, "");
    out!(o, "\tchain quic {{");
    out!(o,
        "\t\t# 1. Short header (form bit 0), first CID octet {first:#04x} at byte 1, node ID from byte 2."
    );
    let short_guard = format!(
        "udp length >= {} @th,{},1 0 @th,{},8 {first:#04x}",
        8 + plan.short_min_payload(),
        payload_bit(0),
        payload_bit(1),
    );
    out!(
        o,
        "\t\t{short_guard} @th,{},{id_bits} vmap @cid_node",
        payload_bit(2)
    );
    out!(o, "\t\t{short_guard} counter name \"unknown_node\" drop");
    out!(o,
        "\t\t# 2. Long header (form bit 1), DCID length {cid_len} at byte 5, first CID octet at byte 6,"
    );
    out!(o, "\t\t#    node ID from byte 7.");
    out!(o,
        "\t\tudp length >= {} @th,{},1 1 @th,{},8 {cid_len} @th,{},8 {first:#04x} @th,{},{id_bits} vmap @cid_node",
        8 + plan.long_min_payload(),
        payload_bit(0),
        payload_bit(5),
        payload_bit(6),
        payload_bit(7),
    );
    out!(
        o,
        "\t\t# 3. Everything else: hashed by source address and port."
    );
    let buckets: Vec<String> = hashed
        .iter()
        .enumerate()
        .map(|(i, n)| format!("{i} : goto hash_{}", n.label()))
        .collect();
    out!(
        o,
        "\t\tjhash {fam} saddr . udp sport mod {} seed {:#010x} vmap {{ {} }}",
        hashed.len(),
        plan.seed,
        buckets.join(", ")
    );
    out!(o, "\t}}");
}

/// The `tcp_new` chain, when TCP is balanced: a new connection hashed over the nodes not
/// draining.
fn nft_tcp_new(o: &mut String, plan: &NftPlan) {
    let fam = plan.family();
    let hashed: Vec<&NftNode> = plan.hashed_nodes().collect();
    if !plan.tcp_ports.is_empty() {
        // The same node set and seed as the UDP hash; conntrack keeps every later packet of
        // the connection, and only the first meets this chain.
        let buckets: Vec<String> = hashed
            .iter()
            .enumerate()
            .map(|(i, n)| format!("{i} : goto tcp_{}", n.label()))
            .collect();
        out!(o, "");
        out!(o, "\tchain tcp_new {{");
        out!(
            o,
            "\t\t# A new TCP connection: hashed by source address and port."
        );
        out!(
            o,
            "\t\tjhash {fam} saddr . tcp sport mod {} seed {:#010x} vmap {{ {} }}",
            hashed.len(),
            plan.seed,
            buckets.join(", ")
        );
        out!(o, "\t}}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(subcommand)]
        balancer: Balancer,
    }

    fn args(extra: &[&str]) -> NftablesArgs {
        let mut argv = vec!["lb-config", "nftables"];
        argv.extend_from_slice(extra);
        match Cli::try_parse_from(argv).unwrap_or_else(|e| panic!("{extra:?}: {e}")) {
            Cli {
                balancer: Balancer::Nftables(a),
            } => a,
        }
    }

    fn plan(extra: &[&str]) -> Result<NftPlan> {
        let mut all = vec!["--plaintext-cids"];
        if !extra.contains(&"--hash-seed") {
            all.extend(["--hash-seed", "5eed"]);
        }
        all.extend_from_slice(extra);
        args(&all).validate()
    }

    fn refused(extra: &[&str]) -> String {
        format!("{:#}", plan(extra).expect_err("accepted"))
    }

    const THREE: [&str; 8] = [
        "--vip",
        "10.77.0.1:443",
        "--node",
        "0a01=10.77.1.2",
        "--node",
        "0a02=10.77.2.2:4433",
        "--node",
        "0a03=10.77.3.2",
    ];

    #[test]
    fn three_nodes_route_by_their_two_byte_ids() {
        let p = plan(&THREE).unwrap();
        // Node ID 2 bytes, instance byte, default nonce 16 - 3 = 13: CIDs of 17 bytes, first
        // octet config 0 and 16 bytes to follow.
        assert_eq!((p.node_id_len, p.cid_len, p.first_octet), (2, 17, 0x10));
        let text = nftables(&p);
        for want in [
            "table ip ringmux\ndelete table ip ringmux\ntable ip ringmux {",
            "typeof @th,80,16 : verdict",
            "elements = { 0x0a01 : goto cid_0a01, 0x0a02 : goto cid_0a02, 0x0a03 : goto cid_0a03 }",
            "chain cid_0a02 {\n\t\tmeta l4proto udp counter name \"cid_0a02\" dnat to 10.77.2.2:4433",
            "chain hash_0a01 {\n\t\tmeta l4proto udp counter name \"hash_0a01\" dnat to 10.77.1.2:443",
            "ip daddr 10.77.0.1 udp dport 443 jump quic",
            // Short: 8 + 1 + 17 bytes, form bit at payload bit 0 (64), first octet at byte 1.
            "udp length >= 26 @th,64,1 0 @th,72,8 0x10 @th,80,16 vmap @cid_node",
            "udp length >= 26 @th,64,1 0 @th,72,8 0x10 counter name \"unknown_node\" drop",
            // Long: 8 + 6 + 17 + 1; DCID length at byte 5 (bit 104), CID at byte 6 (112).
            "udp length >= 32 @th,64,1 1 @th,104,8 17 @th,112,8 0x10 @th,120,16 vmap @cid_node",
            "jhash ip saddr . udp sport mod 3 seed 0x00005eed vmap { 0 : goto hash_0a01, 1 : goto hash_0a02, 2 : goto hash_0a03 }",
            "PLAINTEXT CIDs ONLY",
        ] {
            assert!(text.contains(want), "no {want:?} in\n{text}");
        }
        // The drop comes after the map lookup that would have routed it, the hash last.
        let at = |s: &str| text.find(s).unwrap();
        let drop = at("counter name \"unknown_node\" drop");
        assert!(at("vmap @cid_node") < drop && drop < at("jhash ip saddr"));
    }

    /// The offsets and widths for node IDs of every length ringmux nodes can have behind an
    /// nftables balancer, computed here from the packet layout, not from the generator.
    #[test]
    fn node_ids_of_1_to_14_bytes_read_their_bytes() {
        for len in 1..=14usize {
            let id = "ab".repeat(len);
            let p = plan(&[
                "--vip",
                "192.0.2.1:443",
                "--node",
                &format!("{id}=192.0.2.10"),
            ])
            .unwrap_or_else(|e| panic!("{len} bytes: {e:#}"));
            let nonce = if len <= 11 { 16 - len - 1 } else { 4 };
            let cid = 1 + len + 1 + nonce;
            assert_eq!(p.cid_len, cid, "{len}");
            assert_eq!(usize::from(p.first_octet), cid - 1, "config 0: length only");
            let text = nftables(&p);
            let bits = len * 8;
            for want in [
                format!("typeof @th,80,{bits} : verdict"),
                format!("elements = {{ 0x{id} : goto cid_{id} }}"),
                format!("udp length >= {} @th,64,1 0 @th,72,8 {:#04x} @th,80,{bits} vmap", 9 + cid, cid - 1),
                format!(
                    "udp length >= {} @th,64,1 1 @th,104,8 {cid} @th,112,8 {:#04x} @th,120,{bits} vmap",
                    15 + cid,
                    cid - 1
                ),
            ] {
                assert!(text.contains(&want), "{len} bytes: no {want:?} in\n{text}");
            }
        }
    }

    #[test]
    fn config_id_and_nonce_shape_the_first_octet() {
        let p = plan(&[
            "--vip",
            "10.0.0.1:443",
            "--node",
            "0102030405060708=10.0.0.2",
            "--config-id",
            "2",
            "--nonce-len",
            "4",
        ])
        .unwrap();
        // 1 + 8 + 1 + 4 = 14 bytes; first octet 0b010 << 5 | 13.
        assert_eq!((p.cid_len, p.first_octet), (14, 0x4d));
        assert!(nftables(&p).contains("@th,72,8 0x4d @th,80,64 vmap"));
        // An 8-byte ID written as NLB does, 0x and 16 hex digits.
        let p = plan(&[
            "--vip",
            "10.0.0.1:443",
            "--node",
            "0x0102030405060708=10.0.0.2",
        ])
        .unwrap();
        assert_eq!(p.nodes[0].id, [1, 2, 3, 4, 5, 6, 7, 8]);
    }

    #[test]
    fn a_draining_node_keeps_its_cids_and_gets_no_hash() {
        let mut a = THREE.to_vec();
        a.extend(["--drain", "0a02"]);
        let text = nftables(&plan(&a).unwrap());
        assert!(text.contains("0x0a02 : goto cid_0a02"), "{text}");
        assert!(
            text.contains("mod 2 seed 0x00005eed vmap { 0 : goto hash_0a01, 1 : goto hash_0a03 }")
        );
        assert!(text.contains("# Node 0a02 (draining)."));
    }

    #[test]
    fn tcp_to_the_vip_port_is_hashed_by_default() {
        let text = nftables(&plan(&THREE).unwrap());
        for want in [
            "counter tcp_0a01 {",
            // The VIP's port goes to the node's port, as QUIC does.
            "chain tcp_0a02 {\n\t\ttcp dport 443 counter name \"tcp_0a02\" dnat to 10.77.2.2:4433\n\t}",
            "chain tcp_0a03 {\n\t\ttcp dport 443 counter name \"tcp_0a03\" dnat to 10.77.3.2:443\n\t}",
            // Only new connections meet the hash; conntrack carries the rest.
            "ip daddr 10.77.0.1 tcp dport 443 ct state new jump tcp_new",
            "chain tcp_new {",
            "jhash ip saddr . tcp sport mod 3 seed 0x00005eed vmap { 0 : goto tcp_0a01, 1 : goto tcp_0a02, 2 : goto tcp_0a03 }",
            "# TCP to 10.77.0.1 port(s) 443:",
        ] {
            assert!(text.contains(want), "no {want:?} in\n{text}");
        }
        assert!(!text.contains("tcp dport 80"), "{text}");
        // The UDP rules are as they were without TCP.
        assert!(text.contains("ip daddr 10.77.0.1 udp dport 443 jump quic\n"));
    }

    #[test]
    fn tcp_ports_go_to_the_same_port_and_skip_a_draining_node() {
        let mut a = THREE.to_vec();
        a.extend(["--tcp-port", "80", "--tcp-port", "8080", "--drain", "0a02"]);
        let p = plan(&a).unwrap();
        assert_eq!(p.tcp_ports, [443, 80, 8080]);
        let text = nftables(&p);
        for want in [
            "ip daddr 10.77.0.1 tcp dport { 443, 80, 8080 } ct state new jump tcp_new",
            // Node 0a02 listens on 4433 for the VIP's 443; port 80 is 80 on every node.
            "chain tcp_0a02 {\n\t\ttcp dport 443 counter name \"tcp_0a02\" dnat to 10.77.2.2:4433\n\t\ttcp dport 80 counter name \"tcp_0a02\" dnat to 10.77.2.2:80\n\t\ttcp dport 8080 counter name \"tcp_0a02\" dnat to 10.77.2.2:8080\n\t}",
            "tcp dport 80 counter name \"tcp_0a01\" dnat to 10.77.1.2:80",
            // Draining: the same node set as the UDP hash.
            "jhash ip saddr . udp sport mod 2 seed 0x00005eed vmap { 0 : goto hash_0a01, 1 : goto hash_0a03 }",
            "jhash ip saddr . tcp sport mod 2 seed 0x00005eed vmap { 0 : goto tcp_0a01, 1 : goto tcp_0a03 }",
        ] {
            assert!(text.contains(want), "no {want:?} in\n{text}");
        }
        // Given by the variable, comma-separated, as --node is.
        let mut a = THREE.to_vec();
        a.extend(["--tcp-port", "80,8080"]);
        assert_eq!(plan(&a).unwrap().tcp_ports, [443, 80, 8080]);
    }

    #[test]
    fn tcp_off_leaves_the_ruleset_udp_only() {
        let mut a = THREE.to_vec();
        a.extend(["--tcp", "off"]);
        let p = plan(&a).unwrap();
        assert!(p.tcp_ports.is_empty());
        let text = nftables(&p);
        for absent in [
            "tcp dport",
            "tcp sport",
            "tcp_new",
            "counter tcp_",
            "chain tcp_",
        ] {
            assert!(!text.contains(absent), "{absent:?} in\n{text}");
        }
        assert!(text.contains("# TCP: not balanced here (--tcp off)."));
        // Everything else as with TCP on.
        let on = nftables(&plan(&THREE).unwrap());
        let quic = |t: &str| {
            let from = &t[t.find("\tchain quic {").unwrap()..];
            from[..from.find("\n\t}\n").unwrap()].to_string()
        };
        assert!(quic(&text).contains("jhash ip saddr . udp sport mod 3"));
        assert_eq!(quic(&text), quic(&on));
    }

    #[test]
    fn ipv6_uses_ip6_everywhere() {
        let p = plan(&[
            "--vip",
            "[fd77::1]:443",
            "--node",
            "01=fd77:1::2",
            "--node",
            "02=[fd77:2::2]:8443",
        ])
        .unwrap();
        let text = nftables(&p);
        for want in [
            "table ip6 ringmux {",
            "ip6 daddr fd77::1 udp dport 443 jump quic",
            "dnat to [fd77:1::2]:443",
            "dnat to [fd77:2::2]:8443",
            "jhash ip6 saddr . udp sport mod 2",
            "ip6 daddr fd77::1 tcp dport 443 ct state new jump tcp_new",
            "tcp dport 443 counter name \"tcp_02\" dnat to [fd77:2::2]:8443",
            "jhash ip6 saddr . tcp sport mod 2",
        ] {
            assert!(text.contains(want), "no {want:?} in\n{text}");
        }
        assert!(!text.contains(" ip saddr") && !text.contains("table ip "));
    }

    #[test]
    fn a_random_seed_by_default() {
        let a = args(&[
            "--plaintext-cids",
            "--vip",
            "10.0.0.1:1",
            "--node",
            "01=10.0.0.2",
        ]);
        let seeds: std::collections::HashSet<u32> =
            (0..4).map(|_| a.validate().unwrap().seed).collect();
        assert!(seeds.len() > 1, "{seeds:?}");
    }

    #[test]
    fn refusals_name_the_value_and_the_fix() {
        let base = ["--vip", "10.0.0.1:443"];
        let with = |more: &[&'static str]| -> Vec<&'static str> {
            let mut v = base.to_vec();
            v.extend_from_slice(more);
            v
        };
        for (a, wants) in [
            (with(&["--node", "0a"]), &["0a", "ID=ADDR"][..]),
            (with(&["--node", "zz=10.0.0.2"]), &["zz", "hex"]),
            (with(&["--node", "=10.0.0.2"]), &["node ID", "hex"]),
            (with(&["--node", "0a=nowhere"]), &["nowhere", "ADDR:PORT"]),
            (
                with(&["--node", "0a=[fd00::2]:443"]),
                &["fd00::2", "family"],
            ),
            (with(&["--node", "0a=10.0.0.2:0"]), &["port 0"]),
            (
                with(&["--node", "0a=10.0.0.2", "--node", "0a0b=10.0.0.3"]),
                &["0a0b", "2 bytes", "same length"],
            ),
            (
                with(&["--node", "0a=10.0.0.2", "--node", "0A=10.0.0.3"]),
                &["0a", "twice"],
            ),
            (
                with(&["--node", "0a=10.0.0.2", "--drain", "0b"]),
                &["0b", "--drain", "names no --node"],
            ),
            (
                with(&["--node", "0a=10.0.0.2", "--drain", "0a"]),
                &["every node"],
            ),
            (
                with(&["--node", "0a=10.0.0.2", "--config-id", "7"]),
                &["--config-id", "config_id = 7"],
            ),
            (
                with(&["--node", "0a=10.0.0.2", "--nonce-len", "3"]),
                &["--nonce-len", "nonce_len = 3"],
            ),
            (
                with(&["--node", "0102030405060708090a0b0c0d0e0f=10.0.0.2"]),
                &["node_id is 15 bytes", "1..=14"],
            ),
            (
                with(&["--node", "0a=10.0.0.2", "--table", "1bad"]),
                &["--table", "1bad"],
            ),
            (
                with(&["--node", "0a=10.0.0.2", "--hash-seed", "xyz"]),
                &["--hash-seed", "xyz"],
            ),
            (
                with(&["--node", "0a=10.0.0.2", "--tcp", "off", "--tcp-port", "80"]),
                &["--tcp-port", "80", "--tcp", "off"],
            ),
            (
                with(&["--node", "0a=10.0.0.2", "--tcp-port", "0"]),
                &["--tcp-port", "=0", "--redirect-http"],
            ),
            (
                with(&["--node", "0a=10.0.0.2", "--tcp-port", "443"]),
                &["--tcp-port 443", "--vip 10.0.0.1:443", "already"],
            ),
            (
                with(&["--node", "0a=10.0.0.2", "--tcp-port", "80,80"]),
                &["--tcp-port 80", "twice"],
            ),
        ] {
            let e = refused(&a);
            for w in wants {
                assert!(e.contains(w), "{a:?}: {e:?} does not name {w:?}");
            }
        }
        let e = format!(
            "{:#}",
            args(&["--vip", "10.0.0.1:443", "--node", "0a=10.0.0.2"])
                .validate()
                .unwrap_err()
        );
        assert!(
            e.contains("--plaintext-cids") && e.contains("encrypted"),
            "{e}"
        );
    }
}
