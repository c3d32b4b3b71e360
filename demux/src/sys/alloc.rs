//! A counting global allocator: every allocation made on the data-plane thread is counted, so
//! the claim "the receive loop allocates nothing per datagram" is a number
//! (`ringmux_dataplane_allocations_total`, compared with datagrams received) rather than a hope.
//! Other threads are not counted. The cost is one thread-local flag test per allocation. The
//! count is the metrics' ([`DATAPLANE_ALLOCATIONS`]).

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::Ordering;

use ringmux_metrics::counters::DATAPLANE_ALLOCATIONS;

pub struct CountingAlloc;

thread_local! {
    static COUNTED: Cell<bool> = const { Cell::new(false) };
}

/// Marks the calling thread as the data plane: its allocations are counted from now on.
pub fn count_this_thread() {
    COUNTED.with(|c| c.set(true));
}

/// Allocations (including reallocations) made on the data-plane thread so far.
pub fn dataplane_allocations() -> u64 {
    DATAPLANE_ALLOCATIONS.load(Ordering::Relaxed)
}

fn note() {
    // `try_with`: during thread teardown the flag may be gone; such allocations are not ours.
    if COUNTED.try_with(|c| c.get()).unwrap_or(false) {
        DATAPLANE_ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
    }
}

// SAFETY: every method forwards to the system allocator unchanged; counting has no effect on
// the memory handed out. `alloc_zeroed` and `realloc` keep GlobalAlloc's defaults, which go
// through `alloc` and `dealloc` (so they are counted too); only the data-plane thread, which
// allocates nothing after start-up, would notice the extra copy of a default `realloc`.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note();
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { System.dealloc(ptr, layout) }
    }
}
