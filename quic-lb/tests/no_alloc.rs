//! `Router::route` must not allocate: a counting global allocator watches this thread while it
//! routes owned short headers (single-pass, four-pass, plaintext), client Initials and
//! malformed datagrams.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use ringmux_quic_lb::{CidGenerator, ConnectionIdGenerator, QuicLbConfig, Route, Router};

struct Counting;

thread_local! {
    static WATCHING: Cell<bool> = const { Cell::new(false) };
    static ALLOCATIONS: Cell<usize> = const { Cell::new(0) };
}

// SAFETY: every method forwards to `System` unchanged; the thread-local bookkeeping uses
// const-initialised `Cell`s, which never allocate.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if WATCHING.with(Cell::get) {
            ALLOCATIONS.with(|c| c.set(c.get() + 1));
        }
        // SAFETY: same contract as our caller's.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `System.alloc` with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if WATCHING.with(Cell::get) {
            ALLOCATIONS.with(|c| c.set(c.get() + 1));
        }
        // SAFETY: same contract as our caller's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

#[test]
fn route_does_not_allocate() {
    let mut single = QuicLbConfig::default_with_key([4; 16]);
    single.instance_count = 4;
    let mut four = single.clone();
    four.nonce_len = 7;
    let mut plain = single.clone();
    plain.key = None;

    let mut datagrams = Vec::new();
    let mut routers = Vec::new();
    for config in [single, four, plain] {
        let mut generator = CidGenerator::new(&config, 3, None).unwrap();
        let mut d = vec![0x40];
        d.extend_from_slice(&generator.generate_cid());
        d.resize(100, 0);
        datagrams.push(d);
        routers.push(Router::new(&config, [5; 16]).unwrap());
    }
    let mut initial = vec![0xc0, 0, 0, 0, 1, 20];
    initial.extend_from_slice(&[0x99; 20]);
    initial.extend_from_slice(&[0, 0, 0x40, 0x20]);
    initial.resize(initial.len() + 0x20, 0);
    datagrams.push(initial);
    datagrams.push(vec![0xc0, 0, 0, 0, 1, 30]);
    datagrams.push(Vec::new());

    let mut routes = [Route::Hashed(0); 18];
    WATCHING.with(|w| w.set(true));
    let mut n = 0;
    for router in &routers {
        for d in &datagrams {
            routes[n] = router.route(d);
            n += 1;
        }
    }
    WATCHING.with(|w| w.set(false));
    assert_eq!(ALLOCATIONS.with(Cell::get), 0, "route() allocated");
    // Each router owns exactly its own generator's CID.
    assert_eq!(routes[0], Route::Owned(3));
    assert_eq!(routes[7], Route::Owned(3));
    assert_eq!(routes[14], Route::Owned(3));
}
