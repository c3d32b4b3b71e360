//! Fuzz target: arbitrary bytes as a ring's shared memory (header, consumer page, slots) through
//! `Consumer::attach` and `Consumer::drain`. The harness is `ringmux_ring::fuzzing`; `cargo test`
//! replays `corpus/consumer/` through the same function (`ring/tests/fuzz_corpus.rs`).
//! Run: `cd ring/fuzz && RUSTC_BOOTSTRAP=1 cargo fuzz run consumer -- -max_total_time=300`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    ringmux_ring::fuzzing::consume_arbitrary(data);
});
