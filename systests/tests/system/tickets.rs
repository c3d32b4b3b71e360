//! The demux reads the ticket IDs of the ClientHellos it forwards and binds each to the
//! instance the Initial went to (`tickets.rs`): Initials protected by rustls, whole or in
//! pieces, in order or not, coalesced; tampered, foreign and random ones bind nothing.

use std::sync::Arc;

use ringmux_demux::tickets::{Claim, HelloInspector, TicketBindings, BINDING_HOLD, MAX_HELLO};
use ringmux_testkit::client_initial::{client_hello, crypto_frame, initial_packet};

const DCID: &[u8] = &[0x83, 0x94, 0xc8, 0xf0, 0x3e, 0x51, 0x57, 0x08];
const SCID: &[u8] = &[1, 2, 3, 4, 5, 6, 7, 8];
const T: u64 = 1_000_000_000_000; // a CLOCK_MONOTONIC instant, ns
const T_S: u64 = T / 1_000_000_000;

fn inspector() -> (HelloInspector, Arc<TicketBindings>) {
    let bindings = Arc::new(TicketBindings::new());
    (HelloInspector::new(bindings.clone()), bindings)
}

fn one_initial(dcid: &[u8], identities: &[&[u8]]) -> Vec<u8> {
    let hello = client_hello(identities, 0);
    initial_packet(dcid, dcid, SCID, &[], 0, &crypto_frame(0, &hello))
}

#[test]
fn a_client_hello_in_one_initial_binds_its_identities_to_that_instance() {
    let (mut insp, b) = inspector();
    let (a, c) = ([0xa1u8; 32], [0xc3u8; 40]);
    insp.observe(&one_initial(DCID, &[&a, &c]), 1, T);
    assert_eq!(insp.stats().read, 1, "{:?}", insp.stats());
    assert_eq!(b.claim(&a, 0, T_S), Claim::Foreign);
    assert_eq!(b.claim(&[0xeeu8; 32], 1, T_S), Claim::Unbound);
    assert_eq!(b.claim(&a, 1, T_S), Claim::Granted);
    // Used up: one TAKE per ClientHello.
    assert_eq!(b.claim(&a, 1, T_S), Claim::Unbound);
    assert_eq!(b.claim(&c, 1, T_S + 9), Claim::Granted);
}

#[test]
fn a_binding_ages_out() {
    let (mut insp, b) = inspector();
    let a = [0xa1u8; 32];
    insp.observe(&one_initial(DCID, &[&a]), 0, T);
    assert_eq!(b.claim(&a, 0, T_S + BINDING_HOLD.as_secs()), Claim::Unbound);
}

#[test]
fn the_first_binding_holds_against_another_instance_until_it_ages_out() {
    let (mut insp, b) = inspector();
    let a = [0xa1u8; 32];
    insp.observe(&one_initial(DCID, &[&a]), 0, T);
    // The same ticket in another connection's Initial, to instance 1: a copy, refused.
    insp.observe(&one_initial(&[9; 8], &[&a]), 1, T + 1_000_000_000);
    assert_eq!(insp.stats().read, 2);
    assert_eq!(b.claim(&a, 1, T_S + 1), Claim::Foreign);
    // A retransmission to the same instance renews it; after the hold another may bind it.
    insp.observe(&one_initial(&[9; 8], &[&a]), 1, T + 20_000_000_000);
    assert_eq!(b.claim(&a, 0, T_S + 20), Claim::Foreign);
    assert_eq!(b.claim(&a, 1, T_S + 20), Claim::Granted);
}

#[test]
fn a_client_hello_in_pieces_out_of_order_across_datagrams_binds_once_whole() {
    let (mut insp, b) = inspector();
    let a = [0xa1u8; 32];
    // About the size of a browser's ClientHello with a post-quantum key share.
    let hello = client_hello(&[&a], 2200);
    assert!(hello.len() > 2000 && hello.len() < MAX_HELLO);
    let (p1, p2, p3) = (&hello[..900], &hello[900..1800], &hello[1800..]);
    let mut first = crypto_frame(1800, p3);
    first.extend_from_slice(&[0x01]); // PING
    first.extend(crypto_frame(900, p2));
    insp.observe(&initial_packet(DCID, DCID, SCID, &[], 0, &first), 1, T);
    assert_eq!(b.claim(&a, 1, T_S), Claim::Unbound, "bound before whole");
    // A retransmission overlapping what came, then the first piece.
    let mut second = crypto_frame(850, &hello[850..1000]);
    second.extend(crypto_frame(0, p1));
    insp.observe(&initial_packet(DCID, DCID, SCID, &[], 1, &second), 1, T);
    assert_eq!(insp.stats().read, 1, "{:?}", insp.stats());
    assert_eq!(b.claim(&a, 1, T_S), Claim::Granted);
}

#[test]
fn coalesced_initials_are_read_and_what_follows_them_is_not() {
    let (mut insp, b) = inspector();
    let a = [0xa1u8; 32];
    let hello = client_hello(&[&a], 0);
    let mid = hello.len() / 2;
    let mut datagram = initial_packet(DCID, DCID, SCID, &[], 0, &crypto_frame(0, &hello[..mid]));
    datagram.extend(initial_packet(
        DCID,
        DCID,
        SCID,
        &[],
        1,
        &crypto_frame(mid as u64, &hello[mid..]),
    ));
    // A 0-RTT packet's header and junk after it.
    datagram.extend_from_slice(&[0xd1, 0, 0, 0, 1, 8]);
    datagram.extend_from_slice(&[0x77; 100]);
    insp.observe(&datagram, 0, T);
    assert_eq!(insp.stats().read, 1, "{:?}", insp.stats());
    assert_eq!(b.claim(&a, 0, T_S), Claim::Granted);
}

#[test]
fn the_initial_after_a_retry_is_read_with_its_new_dcid() {
    let (mut insp, b) = inspector();
    let a = [0xa1u8; 32];
    let retry_scid = [0x42u8; 17];
    let hello = client_hello(&[&a], 0);
    let p = initial_packet(
        &retry_scid,
        &retry_scid,
        SCID,
        b"a token",
        2,
        &crypto_frame(0, &hello),
    );
    insp.observe(&p, 1, T);
    assert_eq!(b.claim(&a, 1, T_S), Claim::Granted);
}

#[test]
fn tampered_or_foreign_initials_bind_nothing_and_are_counted() {
    let (mut insp, b) = inspector();
    let a = [0xa1u8; 32];
    let mut p = one_initial(DCID, &[&a]);
    let last = p.len() - 1;
    p[last] ^= 1; // the tag
    insp.observe(&p, 0, T);
    // Protected with the keys of another DCID (a client's later Initial, after the server
    // chose its CID): does not open with this one's.
    let hello = client_hello(&[&a], 0);
    insp.observe(
        &initial_packet(&[7; 8], DCID, SCID, &[], 0, &crypto_frame(0, &hello)),
        0,
        T,
    );
    assert_eq!(insp.stats().unopened, 2, "{:?}", insp.stats());
    assert_eq!(insp.stats().read, 0);
    assert_eq!(b.claim(&a, 0, T_S), Claim::Unbound);
}

#[test]
fn a_client_hello_too_long_or_crowded_out_is_abandoned() {
    let (mut insp, b) = inspector();
    let a = [0xa1u8; 32];
    let hello = client_hello(&[&a], MAX_HELLO);
    insp.observe(
        &initial_packet(DCID, DCID, SCID, &[], 0, &crypto_frame(0, &hello[..1000])),
        0,
        T,
    );
    assert_eq!(insp.stats().abandoned, 1, "{:?}", insp.stats());
    // The first half of one ClientHello, then as many others' first halves as there are
    // places: the first is given up, and its second half alone binds nothing.
    let hello = client_hello(&[&a], 0);
    let mid = hello.len() / 2;
    insp.observe(
        &initial_packet(DCID, DCID, SCID, &[], 0, &crypto_frame(0, &hello[..mid])),
        0,
        T,
    );
    for i in 0..ringmux_demux::tickets::PENDING_HELLOS {
        let dcid = [i as u8, 0xfe, 1, 2, 3, 4, 5, 6];
        insp.observe(
            &initial_packet(&dcid, &dcid, SCID, &[], 0, &crypto_frame(0, &hello[..mid])),
            0,
            T,
        );
    }
    let rest = crypto_frame(mid as u64, &hello[mid..]);
    insp.observe(&initial_packet(DCID, DCID, SCID, &[], 1, &rest), 0, T);
    assert_eq!(b.claim(&a, 0, T_S), Claim::Unbound);
    assert!(insp.stats().abandoned >= 2, "{:?}", insp.stats());
}

#[test]
fn no_input_panics() {
    let (mut insp, _) = inspector();
    let a = [0xa1u8; 32];
    let real = one_initial(DCID, &[&a]);
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    for i in 0..20_000 {
        let mut d = if i % 2 == 0 {
            real.clone()
        } else {
            (0..(next() % 1500) as usize)
                .map(|_| next() as u8)
                .collect()
        };
        if !d.is_empty() {
            for _ in 0..(next() % 4) {
                let at = (next() as usize) % d.len();
                d[at] = next() as u8;
            }
            let cut = (next() as usize) % (d.len() + 1);
            d.truncate(cut.max(d.len() / 2));
            if i % 3 == 0 && !d.is_empty() {
                d[0] = 0xc0; // keep it an Initial
            }
        }
        insp.observe(&d, (i % 3) as u8, T);
    }
}
