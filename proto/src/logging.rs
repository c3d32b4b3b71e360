//! The log set-up of the demux and of ringmux's own worker. A worker's standard error is the
//! demux's, so both write alike: `tracing` lines on stderr, filtered by `RUST_LOG` (default
//! `info`), with ANSI colours only when stderr is a terminal and `NO_COLOR` is unset (a file or
//! the journal gets plain text).

use std::io::IsTerminal;

/// Installs the global `tracing` subscriber. Call once, first thing in `main`.
pub fn init() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let colour = std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none();
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(colour)
        .init();
}
