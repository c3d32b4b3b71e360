//! A broken or hostile consumer: garbage in its page makes the producer report a violation (no
//! panic, no UB); it cannot resize either memfd, cannot map or write the producer region, and a
//! store into its read-only mapping faults (checked in a child process). Attach refuses what does
//! not check out.
#![allow(clippy::multiple_unsafe_ops_per_block)] // raw calls of a process playing hostile, each block commented

mod common;

use std::fs::File;
use std::io::Write;
use std::time::Duration;

use memmap2::MmapOptions;
use ringmux_ring::{
    AttachError, Consumer, ConsumerViolation, DatagramMeta, Producer, PushError, RingConfig,
    SpinPolicy,
};

fn meta() -> DatagramMeta {
    DatagramMeta {
        remote: "127.0.0.1:1".parse().unwrap(),
        local_ip: None,
        ecn: 0,
        segment_size: 0,
        rx_timestamp_ns: 0,
    }
}

fn fill(p: &mut Producer) {
    while p.try_push(&meta(), b"x").is_ok() {}
    p.publish();
}

/// Maps the consumer page the way a hostile worker would and returns (map, head ptr, flag ptr).
fn hostile_page(p: &Producer) -> memmap2::MmapRaw {
    let f = File::from(common::dup(p.handles().page));
    MmapOptions::new().len(4096).map_raw(&f).unwrap()
}

fn poke_u64(m: &memmap2::MmapRaw, off: usize, v: u64) {
    // SAFETY: inside the 4096-byte mapping, aligned; a volatile store like a foreign process's.
    unsafe { m.as_mut_ptr().add(off).cast::<u64>().write_volatile(v) }
}

fn poke_u32(m: &memmap2::MmapRaw, off: usize, v: u32) {
    // SAFETY: as above.
    unsafe { m.as_mut_ptr().add(off).cast::<u32>().write_volatile(v) }
}

#[test]
fn head_ahead_of_tail_is_reported() {
    let (mut p, _c) = common::pair(8, 0);
    fill(&mut p);
    let m = hostile_page(&p);
    poke_u64(&m, 0, 1_000_000);
    let e = p.try_push(&meta(), b"y").unwrap_err();
    assert_eq!(
        e,
        PushError::Violation(ConsumerViolation::HeadAhead {
            head: 1_000_000,
            tail: 8
        })
    );
}

#[test]
fn head_moving_backwards_is_reported() {
    let (mut p, mut c) = common::pair(8, 0);
    fill(&mut p);
    c.drain(4, |_| {}).unwrap();
    assert_eq!(p.try_push(&meta(), b"y"), Ok(())); // sees head = 4
    fill(&mut p);
    let m = hostile_page(&p);
    poke_u64(&m, 0, 1);
    assert_eq!(
        p.try_push(&meta(), b"y"),
        Err(PushError::Violation(ConsumerViolation::HeadBackwards {
            head: 1,
            previous: 4
        }))
    );
}

#[test]
fn flipping_need_wakeup_costs_at_most_one_doorbell_per_publish() {
    let (mut p, _c) = common::pair(1024, 0);
    let m = hostile_page(&p);
    let mut publishes = 0;
    for i in 0..500u32 {
        poke_u32(&m, 8, if i % 3 == 0 { 0 } else { i });
        let _ = p.try_push(&meta(), b"z");
        p.publish();
        publishes += 1;
        // Keep draining on the hostile side so the ring never fills: head = published tail.
        poke_u64(&m, 0, p.stats().published);
    }
    let s = p.stats();
    assert!(
        s.doorbells <= publishes,
        "{} doorbells for {publishes} publishes",
        s.doorbells
    );
    assert!(
        s.doorbells > 0,
        "a sleep announced with a fresh ticket must be rung"
    );
}

/// The consumer's end of the doorbell is a file description of its own: it cannot write the
/// pipe, and clearing `O_NONBLOCK` on its end never makes the producer's writes block, even with
/// the pipe full. After a reset, the old end sees none of the new generation's rings.
#[test]
fn a_consumer_cannot_jam_the_doorbell() {
    use nix::fcntl::{fcntl, FcntlArg, OFlag};

    let (mut p, _c) = common::pair(1024, 0);
    let theirs = common::dup(p.handles().doorbell);
    assert!(
        nix::unistd::write(&theirs, &[1u8; 8]).is_err(),
        "the read end is not writable"
    );
    let flags = OFlag::from_bits_retain(fcntl(&theirs, FcntlArg::F_GETFL).unwrap());
    fcntl(&theirs, FcntlArg::F_SETFL(flags - OFlag::O_NONBLOCK)).unwrap();
    let m = hostile_page(&p);
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    let producer = std::thread::spawn(move || {
        // Announce a sleep (a fresh ticket) before every publish: each one rings, far past
        // the pipe's 64 KiB.
        let mut rang = 0u32;
        for i in 1..=100_000u32 {
            poke_u32(&m, 8, i);
            p.try_push(&meta(), b"wake").unwrap();
            rang += u32::from(p.publish());
            // Keep the ring from filling: play a consumer that takes everything.
            poke_u64(&m, 0, p.stats().published);
        }
        done_tx.send(rang).unwrap();
        p
    });
    // A hang detector only: 100 000 non-blocking writes take milliseconds.
    let rang = done_rx
        .recv_timeout(Duration::from_secs(60))
        .expect("a doorbell write blocked");
    assert_eq!(rang, 100_000, "every announced sleep was rung");
    let mut p = producer.join().unwrap();

    // A fresh pipe per generation: the old end hears nothing of the new one.
    fcntl(&theirs, FcntlArg::F_SETFL(flags)).unwrap();
    while nix::unistd::read(&theirs, &mut [0u8; 4096]).is_ok_and(|n| n > 0) {}
    p.reset().unwrap();
    let new = common::dup(p.handles().doorbell);
    let m = hostile_page(&p);
    poke_u32(&m, 8, 1_000_001);
    p.try_push(&meta(), b"wake").unwrap();
    assert!(p.publish(), "rang the new generation");
    // The producer dropped the old pipe: its read end is at end of file, with no ring in it.
    assert_eq!(
        nix::unistd::read(&theirs, &mut [0u8; 8]),
        Ok(0),
        "the old end hears nothing"
    );
    assert_eq!(nix::unistd::read(&new, &mut [0u8; 8]), Ok(1));
}

/// A consumer that lives on after its ring was reset (a worker's forked child, say) holds a ring
/// nobody writes any more: every generation is a new memfd, so it reads none of the
/// replacement's datagrams, even through the descriptors it kept.
#[test]
fn a_replaced_consumer_reads_nothing_of_the_next_generation() {
    use std::os::unix::fs::MetadataExt;
    let inode =
        |fd: std::os::fd::BorrowedFd<'_>| File::from(common::dup(fd)).metadata().unwrap().ino();
    let (mut p, mut old) = common::pair(64, 0);
    let old_ring = inode(p.handles().ring);
    let old_page = inode(p.handles().page);
    p.try_push(&meta(), b"first generation").unwrap();
    p.publish();
    assert_eq!(old.drain(16, |_| {}).unwrap().slots, 1);
    assert_eq!(p.reset().unwrap(), 0);
    let h = p.handles();
    assert_eq!(h.generation, 2);
    assert_ne!(inode(h.ring), old_ring, "the same region memfd after reset");
    assert_ne!(
        inode(h.page),
        old_page,
        "the same consumer page after reset"
    );
    let mut new = common::attach(&p, common::NO_SPIN);
    for _ in 0..10 {
        p.try_push(&meta(), b"second generation").unwrap();
    }
    p.publish();
    assert_eq!(
        old.available().unwrap(),
        0,
        "the old consumer sees new datagrams"
    );
    let mut copied = Vec::new();
    let got = new.drain(16, |d| copied.push(d.to_vec())).unwrap().slots;
    assert_eq!(got, 10);
    assert!(copied.iter().all(|d| d == b"second generation"));
    // The counters run on across generations.
    assert_eq!(p.stats().published, 11);
}

/// A spare ring made elsewhere must be fresh and of the same geometry.
#[test]
fn reset_with_takes_only_a_fresh_ring_of_the_same_geometry() {
    let (mut p, _c) = common::pair(64, 0);
    let cfg = *p.config();
    let other = Producer::create(&RingConfig { slots: 128, ..cfg }).unwrap();
    assert!(p.reset_with(other).is_err());
    let mut used = Producer::create(&cfg).unwrap();
    used.try_push(&meta(), b"x").unwrap();
    used.publish();
    assert!(p.reset_with(used).is_err());
    assert_eq!(p.generation(), 1, "a refused spare changed nothing");
    p.try_push(&meta(), b"unread").unwrap();
    let (discarded, old) = p.reset_with(Producer::create(&cfg).unwrap()).unwrap();
    assert_eq!((discarded, old.generation(), p.generation()), (1, 1, 2));
    assert_eq!(p.handles().generation, 2);
}

#[test]
fn garbage_head_and_flag_never_panic_the_producer() {
    let (mut p, _c) = common::pair(16, 0);
    let m = hostile_page(&p);
    let mut x = 0x1234_5678_9abc_def0u64;
    let mut violations = 0;
    for _ in 0..10_000 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        poke_u64(&m, 0, x);
        poke_u32(&m, 8, (x >> 32) as u32);
        match p.try_push(&meta(), b"g") {
            Err(PushError::Violation(_)) => violations += 1,
            Ok(()) | Err(PushError::Full) => {}
            Err(e) => panic!("{e}"),
        }
        p.publish();
    }
    assert!(violations > 0);
    // After a reset the producer works again with a fresh consumer page.
    p.reset().unwrap();
    let mut c = common::attach(&p, common::NO_SPIN);
    p.try_push(&meta(), b"after").unwrap();
    p.publish();
    let mut got = Vec::new();
    c.drain(8, |d| got.push(d.to_vec())).unwrap();
    assert_eq!(got, vec![b"after".to_vec()]);
}

#[test]
fn consumer_cannot_resize_the_memfds_or_change_their_seals() {
    let (p, _c) = common::pair(8, 0);
    let ring = File::from(common::dup(p.handles().ring));
    let page = File::from(common::dup(p.handles().page));
    assert!(
        ring.set_len(4096).is_err(),
        "ftruncate (shrink) of the ring must fail"
    );
    assert!(
        ring.set_len(1 << 30).is_err(),
        "ftruncate (grow) of the ring must fail"
    );
    assert!(
        page.set_len(0).is_err(),
        "ftruncate of the consumer page must fail"
    );
    // SAFETY: fcntl on our own descriptor; adding seals must be impossible (F_SEAL_SEAL).
    let r = unsafe {
        libc::fcntl(
            std::os::fd::AsRawFd::as_raw_fd(&ring),
            libc::F_ADD_SEALS,
            libc::F_SEAL_WRITE,
        )
    };
    assert!(r < 0, "adding seals must fail once F_SEAL_SEAL is set");
}

/// The region carries no write seal (a demux that replaces itself maps it writable again), so
/// a hostile consumer can scribble over its header, tail line and slots. It only spoils what
/// it reads itself: the producer never reads the region back, neither while it runs nor when a
/// new process image adopts the ring.
#[test]
fn a_consumer_scribbling_on_its_region_misleads_only_itself() {
    let (mut p, mut c) = common::pair(8, 0);
    for i in 0..3u8 {
        p.try_push(&meta(), &[i; 10]).unwrap();
    }
    p.publish();
    let ring = File::from(common::dup(p.handles().ring));
    let len = ring.metadata().unwrap().len() as usize;
    let map = MmapOptions::new().len(len).map_raw(&ring).unwrap();
    // SAFETY: our own mapping of `len` bytes; the producer writes none of it until the next
    // push, after this loop.
    unsafe { std::ptr::write_bytes(map.as_mut_ptr(), 0xa5, len) };
    (&ring).write_all(b"garbage").unwrap();
    let s = p.stats();
    assert_eq!((s.published, s.occupancy), (3, 3), "{s:?}");
    // Its own datagrams are spoilt: the consumer counts them invalid (or refuses the header).
    let mut good = 0;
    let _ = c.drain(8, |_| good += 1);
    assert_eq!(
        good, 0,
        "the consumer read slots it overwrote as valid datagrams"
    );
    // The producer goes on from its own indices, and so does an adopted copy of it.
    let (state, _) = p.export();
    assert_eq!((state.tail, state.generation), (3, 1));
}

#[test]
fn attach_refuses_stale_generation_and_bad_descriptors() {
    let cfg = RingConfig {
        slots: 8,
        slot_bytes: 2048,
    };
    let mut p = Producer::create(&cfg).unwrap();
    let old = p.handles().generation;
    p.reset().unwrap();
    let h = p.handles();
    let e = Consumer::attach(
        common::dup(h.ring),
        common::dup(h.page),
        common::dup(h.doorbell),
        old,
        SpinPolicy::Adaptive {
            max: Duration::ZERO,
        },
    )
    .err()
    .unwrap();
    assert!(
        matches!(
            e,
            AttachError::StaleGeneration {
                found: 2,
                expected: 1
            }
        ),
        "{e}"
    );

    // A page handed as the ring: sealed alike, but no ring header.
    let e = Consumer::attach(
        common::dup(h.page),
        common::dup(h.page),
        common::dup(h.doorbell),
        2,
        SpinPolicy::Adaptive {
            max: Duration::ZERO,
        },
    )
    .err()
    .unwrap();
    assert!(matches!(e, AttachError::BadMagic { found: 0 }), "{e}");

    // A plain file is not a memfd.
    let f = File::open("/proc/self/status").unwrap();
    let e = Consumer::attach(
        f.into(),
        common::dup(h.page),
        common::dup(h.doorbell),
        2,
        SpinPolicy::Adaptive {
            max: Duration::ZERO,
        },
    )
    .err()
    .unwrap();
    assert!(matches!(e, AttachError::Io { .. }), "{e}");
}

/// A memfd whose header is garbage is refused after mapping the header alone: the rest of it
/// (here 256 MiB, sparse) is never mapped, let alone populated.
#[test]
fn attach_checks_the_header_before_mapping_the_region() {
    use nix::fcntl::{fcntl, FcntlArg, SealFlag};
    use nix::sys::memfd::{memfd_create, MFdFlags};
    use std::os::unix::fs::MetadataExt;
    let fd = memfd_create(
        c"hostile-ring",
        MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING,
    )
    .unwrap();
    let mut f = File::from(fd);
    f.set_len(256 << 20).unwrap();
    f.write_all(&[0xa5; 4096]).unwrap();
    fcntl(
        &f,
        FcntlArg::F_ADD_SEALS(
            SealFlag::F_SEAL_SHRINK
                | SealFlag::F_SEAL_GROW
                | SealFlag::F_SEAL_FUTURE_WRITE
                | SealFlag::F_SEAL_SEAL,
        ),
    )
    .unwrap();
    let ring = common::dup(std::os::fd::AsFd::as_fd(&f));
    let cfg = RingConfig {
        slots: 8,
        slot_bytes: 2048,
    };
    let p = Producer::create(&cfg).unwrap();
    let h = p.handles();
    let e = Consumer::attach(
        ring,
        common::dup(h.page),
        common::dup(h.doorbell),
        1,
        SpinPolicy::Adaptive {
            max: Duration::ZERO,
        },
    )
    .err()
    .unwrap();
    assert!(matches!(e, AttachError::BadMagic { .. }), "{e}");
    let resident = f.metadata().unwrap().blocks() * 512;
    assert!(
        resident < 1 << 20,
        "{resident} bytes of the hostile memfd were populated before its header was checked"
    );
}
