//! Fuzz target: arbitrary bytes as a received datagram through `Router::route` for the
//! single-pass, four-pass and plaintext configurations, plus `CidGenerator::validate` on them.
//! The invariants live in `tests/support/router_harness.rs`, which `cargo test` also runs over
//! `corpus/router/`.
#![no_main]

#[path = "../../tests/support/router_harness.rs"]
mod harness;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    harness::exercise(data);
});
