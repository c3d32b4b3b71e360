//! Kernel steering: the classic BPF program that a `SO_REUSEPORT` group of UDP sockets runs to
//! pick, for each datagram, the socket of the lane that owns it, the in-kernel counterpart of
//! [`ringmux_quic_lb::Router::route`]. This module owns the program's logic and its encoding;
//! [`crate::sys::attach_reuseport_program`] attaches it.
//!
//! # What the kernel runs
//!
//! For a UDP group the kernel runs the program with the packet data starting at the UDP payload
//! (offset 0 is the QUIC packet's first octet) and takes its return value as the index of a
//! socket in the group, in the order the sockets joined it (bind order). An index at or past the
//! group's size makes the kernel fall back to its own hash over all sockets; a load past the end
//! of the datagram ends the program with 0. The group this program serves has
//! [`SteeringPlan::sockets`] sockets: `index_base` sockets the demux keeps for itself (index 0
//! must never normally get traffic), then one per lane, lane `l` at `index_base + l`.
//!
//! # The program's logic
//!
//! It reads the Destination Connection ID where the QUIC invariants put it (RFC 8999 §5;
//! RFC 9000 §17.2 and §17.3 for QUIC v1):
//!
//! - short header (first octet & 0x80 = 0): the DCID is the `cid_len` octets at offset 1;
//! - long header: version at 1..5, DCID length at 5, DCID at 6.
//!
//! A DCID is *ours* when it has exactly `cid_len` octets (a long header's length octet says so;
//! a short header has no other length), its first octet is the configuration's (config rotation
//! codepoint and length, draft-ietf-quic-load-balancers-21 §3), the next octets are this node's
//! ID, and the low six bits of the octet after them (the instance) are below `instances`. Then
//! the octet's top two bits are the generation slot, and the program returns
//! `index_base + slot * instances + instance`. This reads plaintext CIDs only (the draft's
//! plaintext mode, §5.4): an encrypted CID cannot be decoded by a classic BPF program.
//!
//! Every other DCID (a client's choice in Initial and 0-RTT packets, another node's or another
//! configuration's CID, an instance beyond the count) is hashed onto the active generation
//! slot: `index_base + active_slot * instances + h % instances`, where `h` is the DCID's first
//! four octets read as a big-endian number. `h` depends on the DCID alone, so every datagram of
//! one handshake (each Initial, 0-RTT packet and retransmission under the same DCID) lands on
//! the same socket. It is not the router's keyed hash: the instance the kernel picks for a
//! client-chosen DCID need not be the one the router would pick. A DCID shorter than four
//! octets is hashed together with the octets after it.
//!
//! Every load is preceded by a check of the datagram's length, so no load fails and the kernel's
//! 0 is never returned: a datagram too short to hold the four octets the hash reads (fewer than
//! 5 octets in a short header, fewer than 10 in a long one; no QUIC packet is that short) goes
//! to the active slot's first instance, `index_base + active_slot * instances`. The program
//! validates nothing past the DCID: a datagram the router calls
//! [`Route::Malformed`](ringmux_quic_lb::Route::Malformed) still lands on some lane's socket,
//! which drops it.

use libc::{
    sock_filter, BPF_A, BPF_ABS, BPF_ADD, BPF_ALU, BPF_AND, BPF_B, BPF_H, BPF_IMM, BPF_IND, BPF_JA,
    BPF_JEQ, BPF_JGE, BPF_JMP, BPF_JSET, BPF_K, BPF_LD, BPF_LDX, BPF_LEN, BPF_MEM, BPF_MISC,
    BPF_MOD, BPF_MUL, BPF_RET, BPF_RSH, BPF_ST, BPF_TAX, BPF_TXA, BPF_W, BPF_X,
};
use ringmux_quic_lb::{Mode, Router, GENERATION_SLOTS, MAX_INSTANCES, MAX_PLAINTEXT_LEN};

/// What the kernel's steering program must know.
#[derive(Clone, Debug)]
pub struct SteeringPlan {
    /// Worker instances per generation slot (`1..=64`).
    pub instances: u8,
    /// The generation slot whose lanes get client-chosen DCIDs (new connections).
    pub active_slot: u8,
    /// Length of every CID this node issues, first octet included.
    pub cid_len: u8,
    /// The first octet of every CID this node issues: config rotation codepoint and length.
    pub first_octet: u8,
    /// This node's ID, the octets after the first one.
    pub node_id: Vec<u8>,
    /// Group index of lane 0.
    pub index_base: u16,
}

impl SteeringPlan {
    /// The plan for the data plane's `router`, sending new connections to `active_slot`'s lanes
    /// and numbering lane 0's socket `index_base`.
    ///
    /// # Panics
    ///
    /// If the router's CIDs are encrypted (a classic BPF program reads plaintext CIDs only; the
    /// demux's configuration refuses kernel steering without plaintext CIDs) or `active_slot` is
    /// not below [`GENERATION_SLOTS`].
    pub fn new(router: &Router, active_slot: u8, index_base: u16) -> Self {
        let codec = router.codec();
        assert_eq!(
            codec.mode(),
            Mode::Plaintext,
            "kernel steering reads plaintext CIDs only"
        );
        assert!(
            active_slot < GENERATION_SLOTS,
            "generation slot {active_slot} does not exist"
        );
        // A plaintext CID is `first octet ‖ node ID ‖ instance octet ‖ nonce`, readable as is:
        // the node ID is the router's, cut out of one of its CIDs.
        let node_id_len = codec.server_id_len() - 1;
        let nonce = [0u8; MAX_PLAINTEXT_LEN];
        let cid = router
            .cid_for_lane(0, &nonce[..codec.nonce_len()])
            .expect("every router has lane 0, and the nonce has the codec's length");
        Self {
            instances: router.instance_count(),
            active_slot,
            // At most 20 (MAX_CID_LEN).
            cid_len: cid.len() as u8,
            first_octet: codec.first_octet(),
            node_id: cid[1..1 + node_id_len].to_vec(),
            index_base,
        }
    }

    /// The group's size the program expects: `index_base` sockets, then one per lane
    /// ([`GENERATION_SLOTS`] × `instances`).
    pub fn sockets(&self) -> usize {
        usize::from(self.index_base) + usize::from(GENERATION_SLOTS) * usize::from(self.instances)
    }

    /// The classic BPF program (see the module documentation), for
    /// [`crate::sys::attach_reuseport_program`].
    pub fn program(&self) -> Vec<sock_filter> {
        use Label::*;
        let cid_len = u32::from(self.cid_len);
        let instances = u32::from(self.instances.clamp(1, MAX_INSTANCES));
        let lane0 = u32::from(self.index_base);
        let active = lane0 + u32::from(self.active_slot) * instances;
        // Where the DCID starts (RFC 8999 §5.1 and §5.2) and, for the hash, the shortest
        // datagram that holds its first four octets.
        const SHORT_DCID: u32 = 1;
        const LONG_DCID: u32 = 6;
        const HASHED_OCTETS: u32 = 4;

        let mut a = Assembler::default();
        a.op(BPF_LD | BPF_W | BPF_LEN, 0);
        a.op(BPF_MISC | BPF_TAX, 0); // X = length
        a.jump(BPF_JEQ, 0, Some(Runt), None);
        a.op(BPF_LD | BPF_B | BPF_ABS, 0);
        a.jump(BPF_JSET, 0x80, Some(LongHeader), None);

        // Short header: the DCID has the configured length by definition.
        a.op(BPF_MISC | BPF_TXA, 0);
        a.jump(BPF_JGE, SHORT_DCID + cid_len, Some(ShortOwnable), None);
        a.jump(
            BPF_JGE,
            SHORT_DCID + HASHED_OCTETS,
            Some(ShortHashed),
            Some(Runt),
        );
        a.place(ShortOwnable);
        a.op(BPF_LDX | BPF_W | BPF_IMM, SHORT_DCID);
        a.goto(Ownable);
        a.place(ShortHashed);
        a.op(BPF_LDX | BPF_W | BPF_IMM, SHORT_DCID);
        a.goto(Hashed);

        // Long header: the DCID's length octet must say `cid_len` too.
        a.place(LongHeader);
        a.op(BPF_MISC | BPF_TXA, 0);
        a.jump(BPF_JGE, LONG_DCID + cid_len, Some(LongOwnable), None);
        a.jump(
            BPF_JGE,
            LONG_DCID + HASHED_OCTETS,
            Some(LongHashed),
            Some(Runt),
        );
        a.place(LongOwnable);
        a.op(BPF_LD | BPF_B | BPF_ABS, LONG_DCID - 1);
        a.jump(BPF_JEQ, cid_len, None, Some(LongHashed));
        a.op(BPF_LDX | BPF_W | BPF_IMM, LONG_DCID);
        a.goto(Ownable);
        a.place(LongHashed);
        a.op(BPF_LDX | BPF_W | BPF_IMM, LONG_DCID);
        a.goto(Hashed);

        // X = the DCID's offset; the datagram holds all `cid_len` octets of it.
        a.place(Ownable);
        a.op(BPF_LD | BPF_B | BPF_IND, 0);
        a.jump(BPF_JEQ, u32::from(self.first_octet), None, Some(Hashed));
        let mut at = 0;
        while at < self.node_id.len() {
            let rest = &self.node_id[at..];
            let (size, width) = match rest.len() {
                4.. => (BPF_W, 4),
                2..=3 => (BPF_H, 2),
                _ => (BPF_B, 1),
            };
            let value = rest[..width]
                .iter()
                .fold(0u32, |v, &b| v << 8 | u32::from(b));
            a.op(BPF_LD | size | BPF_IND, 1 + at as u32);
            a.jump(BPF_JEQ, value, None, Some(Hashed));
            at += width;
        }
        // The instance octet: `slot << 6 | instance`.
        a.op(BPF_LD | BPF_B | BPF_IND, 1 + self.node_id.len() as u32);
        a.op(BPF_ST, 0);
        a.op(BPF_ALU | BPF_AND | BPF_K, u32::from(MAX_INSTANCES - 1));
        a.jump(BPF_JGE, instances, Some(Hashed), None);
        a.op(BPF_MISC | BPF_TAX, 0); // X = instance
        a.op(BPF_LD | BPF_MEM, 0);
        a.op(BPF_ALU | BPF_RSH | BPF_K, 6);
        a.op(BPF_ALU | BPF_MUL | BPF_K, instances);
        a.op(BPF_ALU | BPF_ADD | BPF_X, 0);
        a.op(BPF_ALU | BPF_ADD | BPF_K, lane0);
        a.op(BPF_RET | BPF_A, 0);

        // X = the DCID's offset; the datagram holds at least four octets from there.
        a.place(Hashed);
        a.op(BPF_LD | BPF_W | BPF_IND, 0);
        a.op(BPF_ALU | BPF_MOD | BPF_K, instances);
        a.op(BPF_ALU | BPF_ADD | BPF_K, active);
        a.op(BPF_RET | BPF_A, 0);

        a.place(Runt);
        a.op(BPF_RET | BPF_K, active);
        a.finish()
    }
}

/// The places in the program a jump names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Label {
    /// The first octet says long header.
    LongHeader,
    /// A short header long enough for a whole CID of ours.
    ShortOwnable,
    /// A short header long enough for the hash only.
    ShortHashed,
    /// A long header long enough for a whole CID of ours after the DCID length octet.
    LongOwnable,
    /// A long header whose DCID is hashed.
    LongHashed,
    /// X holds the offset of a DCID of our length: check that it is ours.
    Ownable,
    /// X holds the offset of a DCID that is not ours: hash it onto the active slot.
    Hashed,
    /// Too short to read four DCID octets from.
    Runt,
}

/// One instruction whose jump targets may still be labels (`None`: the next instruction).
struct Pending {
    code: u32,
    k: u32,
    taken: Option<Label>,
    not_taken: Option<Label>,
}

/// Builds a classic BPF program with forward jumps to labels, resolved into the 8-bit
/// relative offsets of conditional jumps (and the 32-bit one of `ja`) by [`Assembler::finish`].
#[derive(Default)]
struct Assembler {
    code: Vec<Pending>,
    labels: Vec<(Label, usize)>,
}

impl Assembler {
    /// An instruction that does not jump.
    fn op(&mut self, code: u32, k: u32) {
        self.code.push(Pending {
            code,
            k,
            taken: None,
            not_taken: None,
        });
    }

    /// `if A <op> k goto taken else goto not_taken` (`BPF_JMP | op | BPF_K`).
    fn jump(&mut self, op: u32, k: u32, taken: Option<Label>, not_taken: Option<Label>) {
        self.code.push(Pending {
            code: BPF_JMP | op | BPF_K,
            k,
            taken,
            not_taken,
        });
    }

    /// `goto to` (`BPF_JMP | BPF_JA`).
    fn goto(&mut self, to: Label) {
        self.code.push(Pending {
            code: BPF_JMP | BPF_JA,
            k: 0,
            taken: Some(to),
            not_taken: None,
        });
    }

    /// Names the next instruction.
    fn place(&mut self, label: Label) {
        self.labels.push((label, self.code.len()));
    }

    /// Resolves the labels. Panics on a label never placed, a backward jump or one too far for
    /// its field: mistakes in [`SteeringPlan::program`], whose shape does not depend on the
    /// plan's values beyond the node ID's length.
    fn finish(self) -> Vec<sock_filter> {
        let offset = |from: usize, to: Option<Label>| -> u32 {
            let Some(to) = to else { return 0 };
            let &(_, at) = self
                .labels
                .iter()
                .find(|(l, _)| *l == to)
                .unwrap_or_else(|| panic!("label {to:?} never placed"));
            assert!(at > from, "jump from {from} back to {to:?} at {at}");
            (at - from - 1) as u32
        };
        let short = |from: usize, to: Option<Label>| -> u8 {
            u8::try_from(offset(from, to)).expect("a conditional jump within 255 instructions")
        };
        self.code
            .iter()
            .enumerate()
            .map(|(i, p)| {
                if p.code == BPF_JMP | BPF_JA {
                    sock_filter {
                        code: p.code as u16,
                        jt: 0,
                        jf: 0,
                        k: offset(i, p.taken),
                    }
                } else {
                    sock_filter {
                        code: p.code as u16,
                        jt: short(i, p.taken),
                        jf: short(i, p.not_taken),
                        k: p.k,
                    }
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ringmux_quic_lb::{QuicLbConfig, Route};

    fn router(node_id: &[u8], instances: u8, nonce_len: u8) -> Router {
        let config = QuicLbConfig {
            config_id: 1,
            node_id: node_id.to_vec(),
            instance_count: instances,
            nonce_len,
            key: None,
        };
        Router::new(&config, [3; 16]).unwrap()
    }

    /// What the kernel checks of a classic program (`bpf_check_classic`) and more: length,
    /// every jump forward and inside, a return last, scratch memory written before read.
    fn assert_within_kernel_limits(p: &[sock_filter]) {
        assert!(!p.is_empty() && p.len() <= libc::BPF_MAXINSNS as usize);
        let last = p.last().unwrap();
        assert_eq!(u32::from(last.code) & 0x07, BPF_RET, "last is a return");
        for (i, insn) in p.iter().enumerate() {
            let code = u32::from(insn.code);
            if code & 0x07 != BPF_JMP {
                continue;
            }
            let targets: Vec<usize> = if code == BPF_JMP | BPF_JA {
                vec![i + 1 + insn.k as usize]
            } else {
                vec![i + 1 + usize::from(insn.jt), i + 1 + usize::from(insn.jf)]
            };
            for t in targets {
                assert!(t < p.len(), "jump at {i} lands outside, at {t}");
            }
        }
        if let Some(first_read) = p.iter().position(|i| u32::from(i.code) == BPF_LD | BPF_MEM) {
            let first_write = p.iter().position(|i| u32::from(i.code) == BPF_ST).unwrap();
            assert!(first_write < first_read);
        }
    }

    /// A classic BPF interpreter for the instructions the program uses, with the kernel's
    /// answer (0) to a load past the end.
    fn run(p: &[sock_filter], data: &[u8]) -> u32 {
        let (mut a, mut x, mut mem, mut pc) = (0u32, 0u32, [0u32; 16], 0usize);
        let load = |at: u32, width: usize| -> Option<u32> {
            let at = at as usize;
            let bytes = data.get(at..at + width)?;
            Some(bytes.iter().fold(0u32, |v, &b| v << 8 | u32::from(b)))
        };
        loop {
            let i = p[pc];
            let code = u32::from(i.code);
            pc += 1;
            let width = match code & 0x18 {
                BPF_W => 4,
                BPF_H => 2,
                _ => 1,
            };
            match code {
                c if c == BPF_LD | BPF_W | BPF_LEN => a = data.len() as u32,
                c if c & 0x07 == BPF_LD && c & 0xe0 == BPF_ABS => match load(i.k, width) {
                    Some(v) => a = v,
                    None => return 0,
                },
                c if c & 0x07 == BPF_LD && c & 0xe0 == BPF_IND => match load(x + i.k, width) {
                    Some(v) => a = v,
                    None => return 0,
                },
                c if c == BPF_LD | BPF_MEM => a = mem[i.k as usize],
                c if c == BPF_LDX | BPF_W | BPF_IMM => x = i.k,
                c if c == BPF_ST => mem[i.k as usize] = a,
                c if c == BPF_MISC | BPF_TAX => x = a,
                c if c == BPF_MISC | BPF_TXA => a = x,
                c if c == BPF_ALU | BPF_AND | BPF_K => a &= i.k,
                c if c == BPF_ALU | BPF_RSH | BPF_K => a >>= i.k,
                c if c == BPF_ALU | BPF_MUL | BPF_K => a = a.wrapping_mul(i.k),
                c if c == BPF_ALU | BPF_ADD | BPF_K => a = a.wrapping_add(i.k),
                c if c == BPF_ALU | BPF_ADD | BPF_X => a = a.wrapping_add(x),
                c if c == BPF_ALU | BPF_MOD | BPF_K => a %= i.k,
                c if c == BPF_JMP | BPF_JA => pc += i.k as usize,
                c if c & 0x07 == BPF_JMP => {
                    let taken = match code & 0xf0 {
                        BPF_JEQ => a == i.k,
                        BPF_JGE => a >= i.k,
                        BPF_JSET => a & i.k != 0,
                        _ => panic!("jump {code:#x}"),
                    };
                    pc += usize::from(if taken { i.jt } else { i.jf });
                }
                c if c == BPF_RET | BPF_A => return a,
                c if c == BPF_RET | BPF_K => return i.k,
                _ => panic!("instruction {code:#x} at {}", pc - 1),
            }
        }
    }

    #[test]
    fn the_program_stays_within_the_kernels_limits() {
        for node_id_len in 1..=ringmux_quic_lb::MAX_NODE_ID_LEN {
            for instances in [1, 3, MAX_INSTANCES] {
                let node_id: Vec<u8> = (0..node_id_len as u8).map(|i| 0xa0 + i).collect();
                let r = router(&node_id, instances, 4);
                let plan = SteeringPlan::new(&r, GENERATION_SLOTS - 1, 1);
                assert_eq!(plan.node_id, node_id);
                assert_eq!(usize::from(plan.cid_len), r.cid_len());
                assert_within_kernel_limits(&plan.program());
            }
        }
    }

    #[test]
    #[should_panic(expected = "plaintext CIDs only")]
    fn encrypted_cids_have_no_plan() {
        let mut config = QuicLbConfig::default_with_key([1; 16]);
        config.instance_count = 2;
        let encrypted = Router::new(&config, [3; 16]).unwrap();
        SteeringPlan::new(&encrypted, 0, 1);
    }

    #[test]
    fn the_group_holds_the_base_and_every_lane() {
        let plan = SteeringPlan::new(&router(&[7], 2, 6), 0, 1);
        assert_eq!(plan.sockets(), 1 + 4 * 2);
    }

    /// The program against the router, on every lane's CIDs, other nodes' CIDs, random
    /// datagrams and every truncation of them: an owned route gives that lane's socket, anything
    /// else a socket of the active slot, and nothing ever a socket below `index_base`.
    #[test]
    fn the_program_agrees_with_the_router() {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut random = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for (node_id, instances, slot) in [(&[0x5c][..], 1, 0), (&[1, 2, 3, 4, 5][..], 3, 2)] {
            let r = router(node_id, instances, 5);
            let other = router(&[0x77; 5][..node_id.len()], instances, 5);
            let plan = SteeringPlan::new(&r, slot, 2);
            let program = plan.program();
            let base = 2 + u32::from(slot) * u32::from(instances);
            let active = base..base + u32::from(instances);
            let mut datagrams = Vec::new();
            for lane in 0..r.lanes() as u8 {
                let nonce: Vec<u8> = (0..5).map(|_| random() as u8).collect();
                for router in [&r, &other] {
                    let cid = router.cid_for_lane(lane, &nonce).unwrap();
                    let mut short = vec![0x40 | (random() as u8 & 0x3f)];
                    short.extend_from_slice(&cid);
                    short.extend_from_slice(&[0x11; 24]);
                    let mut long = vec![0xe0, 0, 0, 0, 1, cid.len() as u8];
                    long.extend_from_slice(&cid);
                    long.extend_from_slice(&[0, 0x18]);
                    long.extend_from_slice(&[0x22; 24]);
                    datagrams.extend([short, long]);
                }
            }
            for _ in 0..200 {
                let len = random() as usize % 48;
                datagrams.push((0..len).map(|_| random() as u8).collect());
            }
            for d in &datagrams {
                for cut in 0..=d.len() {
                    let d = &d[..cut];
                    let index = run(&program, d);
                    match r.route(d) {
                        Route::Owned(lane) => {
                            assert_eq!(index, 2 + u32::from(lane), "{d:02x?}")
                        }
                        Route::Hashed(_) => assert!(active.contains(&index), "{d:02x?}"),
                        Route::Malformed(_) => assert!(
                            (2..plan.sockets() as u32).contains(&index),
                            "{index} for {d:02x?}"
                        ),
                    }
                }
            }
        }
    }
}
