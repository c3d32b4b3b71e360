//! Kernel steering against the real kernel: a `SO_REUSEPORT` group of loopback UDP sockets runs
//! the steering program, and every datagram must reach the socket the program's contract names.
//! Checked for 1 and 3 instances, new connections in generation slot 0 and 2:
//!
//! - a short header and a Handshake packet under a CID of each lane reach that lane's socket,
//!   and the router agrees that the lane owns it;
//! - 200 Initials under random 8- and 20-octet DCIDs reach the active slot's sockets, every
//!   instance gets some, and a second Initial and a 0-RTT packet under the same DCID follow the
//!   first;
//! - another node's CID, and a CID of an instance beyond the count, are treated as
//!   client-chosen;
//! - datagrams too short to be QUIC reach the active slot's first instance;
//! - nothing ever reaches socket 0, the demux's own.

use std::net::{SocketAddr, UdpSocket};
use std::os::fd::AsFd;

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use ringmux_demux::forward::steering::SteeringPlan;
use ringmux_demux::sys::attach_reuseport_program;
use ringmux_quic_lb::{QuicLbConfig, Route, Router, GENERATION_SLOTS};
use socket2::{Domain, Protocol, Socket, Type};

/// Group index of lane 0: index 0 is the demux's own socket.
const INDEX_BASE: u16 = 1;
/// How long a datagram may take to arrive on loopback before the test fails, in milliseconds.
const ARRIVAL_MS: u16 = 2000;
/// Nonce octets per CID: CIDs of 9 or 10 octets, never the length of the random DCIDs.
const NONCE_LEN: u8 = 6;

/// The QUIC v1 long-header packet types (RFC 9000 §17.2).
const INITIAL: u8 = 0b00;
const ZERO_RTT: u8 = 0b01;
const HANDSHAKE: u8 = 0b10;

#[test]
fn one_instance_new_connections_in_slot_0() {
    steer(1, 0);
}

#[test]
fn one_instance_new_connections_in_slot_2() {
    steer(1, 2);
}

#[test]
fn three_instances_new_connections_in_slot_0() {
    steer(3, 0);
}

#[test]
fn three_instances_new_connections_in_slot_2() {
    steer(3, 2);
}

fn config(node_id: &[u8], instances: u8) -> QuicLbConfig {
    QuicLbConfig {
        config_id: 2,
        node_id: node_id.to_vec(),
        instance_count: instances,
        nonce_len: NONCE_LEN,
        key: None,
    }
}

fn steer(instances: u8, active_slot: u8) {
    let node_id: &[u8] = if instances == 1 {
        &[0x3c]
    } else {
        &[0x3c, 0xa5]
    };
    let router = Router::new(&config(node_id, instances), [5; 16]).unwrap();
    let plan = SteeringPlan::new(&router, active_slot, INDEX_BASE);
    assert_eq!(
        plan.sockets(),
        1 + usize::from(GENERATION_SLOTS * instances)
    );
    let mut group = Group::bind(&plan);
    let mut random = xorshift(0x5eed ^ u64::from(instances) << 8 ^ u64::from(active_slot));
    let active_base = usize::from(INDEX_BASE) + usize::from(active_slot * instances);
    let active = active_base..active_base + usize::from(instances);

    // Every lane's own CIDs, in a short header and a Handshake packet.
    for lane in 0..router.lanes() as u8 {
        let nonce: Vec<u8> = (0..NONCE_LEN).map(|_| random() as u8).collect();
        let cid = router.cid_for_lane(lane, &nonce).unwrap();
        for datagram in [
            short(&cid, group.tail()),
            long(HANDSHAKE, &cid, group.tail()),
        ] {
            assert_eq!(router.route(&datagram), Route::Owned(lane));
            assert_eq!(
                group.deliver(&datagram),
                usize::from(INDEX_BASE) + usize::from(lane),
                "lane {lane}: {datagram:02x?}"
            );
        }
    }

    // Client-chosen DCIDs: hashed onto the active slot, the same DCID always to one socket.
    let mut per_instance = vec![0u32; usize::from(instances)];
    for i in 0..200 {
        let dcid: Vec<u8> = (0..[8, 20][i % 2]).map(|_| random() as u8).collect();
        let first = long(INITIAL, &dcid, group.tail());
        assert!(matches!(router.route(&first), Route::Hashed(_)));
        let index = group.deliver(&first);
        assert!(active.contains(&index), "Initial to {index}: {first:02x?}");
        per_instance[index - active_base] += 1;
        let mut again = group.tail();
        again.extend_from_slice(&[0x5a; 100]);
        for datagram in [
            long(INITIAL, &dcid, again),
            long(ZERO_RTT, &dcid, group.tail()),
        ] {
            assert_eq!(group.deliver(&datagram), index, "{datagram:02x?}");
        }
    }
    assert!(
        per_instance.iter().all(|&n| n > 0),
        "Initials per instance: {per_instance:?}"
    );

    // Another node's CIDs (same configuration, other node ID) and CIDs of an instance this
    // node does not have: client-chosen as far as this node is concerned.
    let other_node: Vec<u8> = node_id.iter().map(|b| b ^ 0x01).collect();
    let other = Router::new(&config(&other_node, instances), [5; 16]).unwrap();
    let wider = Router::new(&config(node_id, instances + 1), [5; 16]).unwrap();
    let foreign = (0..other.lanes() as u8)
        .map(|lane| (&other, lane))
        .chain((0..GENERATION_SLOTS).map(|slot| (&wider, wider.lane(instances, slot))));
    for (issuer, lane) in foreign {
        let nonce: Vec<u8> = (0..NONCE_LEN).map(|_| random() as u8).collect();
        let cid = issuer.cid_for_lane(lane, &nonce).unwrap();
        assert_eq!(cid[0], router.codec().first_octet());
        for datagram in [
            short(&cid, group.tail()),
            long(HANDSHAKE, &cid, group.tail()),
        ] {
            assert!(matches!(router.route(&datagram), Route::Hashed(_)));
            let index = group.deliver(&datagram);
            assert!(active.contains(&index), "to {index}: {datagram:02x?}");
        }
    }

    // Too short to be QUIC: the active slot's first instance, never socket 0.
    for runt in [
        &[][..],
        &[0x40],
        &[0x40, 1, 2, 3],
        &[0xc0, 0, 0, 0, 1, 8, 1, 2, 3],
    ] {
        assert_eq!(group.deliver(runt), active_base, "{runt:02x?}");
    }

    group.assert_all_received();
}

/// The sockets of one `SO_REUSEPORT` group on loopback, index `i` bound `i`-th, and the client
/// socket that sends to them.
struct Group {
    sockets: Vec<UdpSocket>,
    client: UdpSocket,
    sent: u64,
}

impl Group {
    /// Binds `plan.sockets()` non-blocking sockets to one loopback port and attaches the
    /// plan's program to the first.
    fn bind(plan: &SteeringPlan) -> Self {
        let mut addr: SocketAddr = "127.0.0.1:0".parse().unwrap();
        let mut sockets = Vec::new();
        for _ in 0..plan.sockets() {
            let s = Socket::new(Domain::IPV4, Type::DGRAM, Some(Protocol::UDP)).unwrap();
            s.set_reuse_port(true).unwrap();
            s.set_nonblocking(true).unwrap();
            s.bind(&addr.into()).unwrap();
            addr = s.local_addr().unwrap().as_socket().unwrap();
            sockets.push(UdpSocket::from(s));
        }
        attach_reuseport_program(sockets[0].as_fd(), &plan.program()).unwrap();
        let client = UdpSocket::bind("127.0.0.1:0").unwrap();
        client.connect(addr).unwrap();
        Group {
            sockets,
            client,
            sent: 0,
        }
    }

    /// A datagram's payload after its header, unique to it (a sequence number).
    fn tail(&mut self) -> Vec<u8> {
        self.sent += 1;
        let mut tail = self.sent.to_be_bytes().to_vec();
        tail.extend_from_slice(&[0xee; 24]);
        tail
    }

    /// Sends `datagram` and answers the index of the one socket it reached (failing if none
    /// did within [`ARRIVAL_MS`], or socket 0 did, or another datagram is waiting too).
    fn deliver(&self, datagram: &[u8]) -> usize {
        assert_eq!(self.client.send(datagram).unwrap(), datagram.len());
        let ready = self.ready(PollTimeout::from(ARRIVAL_MS));
        assert_eq!(
            ready.len(),
            1,
            "ready sockets {ready:?} for {datagram:02x?}"
        );
        let index = ready[0];
        let mut buf = [0u8; 2048];
        let n = self.sockets[index].recv(&mut buf).unwrap();
        assert_eq!(
            &buf[..n],
            datagram,
            "socket {index} received another datagram"
        );
        assert_ne!(index, 0, "the demux's own socket got {datagram:02x?}");
        index
    }

    /// The sockets with a datagram waiting, after waiting at most `timeout` for one.
    fn ready(&self, timeout: PollTimeout) -> Vec<usize> {
        let mut fds: Vec<PollFd<'_>> = self
            .sockets
            .iter()
            .map(|s| PollFd::new(s.as_fd(), PollFlags::POLLIN))
            .collect();
        let n = poll(&mut fds, timeout).unwrap();
        assert!(n > 0, "no socket received a datagram");
        fds.iter()
            .enumerate()
            .filter(|(_, p)| p.revents().is_some_and(|r| r.contains(PollFlags::POLLIN)))
            .map(|(i, _)| i)
            .collect()
    }

    /// Nothing is left in any socket.
    fn assert_all_received(&self) {
        let mut fds: Vec<PollFd<'_>> = self
            .sockets
            .iter()
            .map(|s| PollFd::new(s.as_fd(), PollFlags::POLLIN))
            .collect();
        assert_eq!(poll(&mut fds, PollTimeout::ZERO).unwrap(), 0);
    }
}

/// A short-header packet (RFC 9000 §17.3.1): first octet with the fixed bit, DCID, the rest.
fn short(dcid: &[u8], tail: Vec<u8>) -> Vec<u8> {
    let mut d = vec![0x40 | 0x01];
    d.extend_from_slice(dcid);
    d.extend(tail);
    d
}

/// A QUIC v1 long-header packet of type `kind` (RFC 9000 §17.2): version 1, `dcid`, an 8-octet
/// SCID, an empty token for an Initial, and a Length covering `tail`.
fn long(kind: u8, dcid: &[u8], tail: Vec<u8>) -> Vec<u8> {
    let mut d = vec![0xc0 | kind << 4 | 0x01, 0, 0, 0, 1, dcid.len() as u8];
    d.extend_from_slice(dcid);
    d.push(8);
    d.extend_from_slice(&[0x77; 8]);
    if kind == INITIAL {
        d.push(0);
    }
    let length = u16::try_from(tail.len()).unwrap();
    assert!(length < 1 << 14);
    d.extend_from_slice(&(0x4000 | length).to_be_bytes());
    d.extend(tail);
    d
}

/// A deterministic pseudo-random sequence: a failure replays the same datagrams.
fn xorshift(seed: u64) -> impl FnMut() -> u64 {
    let mut x = seed | 1;
    move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    }
}
