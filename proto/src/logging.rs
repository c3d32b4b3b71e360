//! The log set-up of the demux and of ringmux's own worker: `tracing` lines filtered by
//! `RUST_LOG` (default `info`), with ANSI colours only when standard error is a terminal and
//! `NO_COLOR` is unset (a pipe, a file or the journal gets plain text). A worker writes to its
//! standard error, a pipe of its own that the demux reads; the demux queues its lines for a
//! thread of its own that writes them. Neither ever panics or stops because a line could not
//! be written: the subscriber's own report of a failed write (which would print to standard
//! error, and panic if that failed too) is off.

use std::io::IsTerminal;

use tracing_subscriber::fmt::MakeWriter;

/// Installs the global `tracing` subscriber, writing to standard error. Call once, first thing
/// in `main`.
pub fn init() {
    init_with(std::io::stderr);
}

/// As [`init`], writing each line to what `writer` makes.
pub fn init_with<W>(writer: W)
where
    W: for<'w> MakeWriter<'w> + Send + Sync + 'static,
{
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let colour = std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none();
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(writer)
        .with_ansi(colour)
        .log_internal_errors(false)
        .init();
}
