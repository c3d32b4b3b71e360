//! The rate tables the demux placed in this process (`ringmux_proto::RATE_TABLES_FD` on, as
//! many as `ringmux_proto::RATE_TABLES_ENV` says) when a site limits a rate: this worker's
//! own, writable, then every other worker's, read-only (`ringmux_ring::tally`).

use ringmux_proto::{MAX_RATE_TABLES, RATE_TABLES_ENV, RATE_TABLES_FD};
use ringmux_ring::tally::{Tallies, TallyError};

/// Why the rate tables cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum RateTablesError {
    #[error("{RATE_TABLES_ENV}={0:?}: expected 1 to {MAX_RATE_TABLES}")]
    Count(String),
    #[error("the rate tables: {0}")]
    Adopt(#[from] std::io::Error),
    #[error(transparent)]
    Table(#[from] TallyError),
}

/// This process's rate tables, mapped; `None` when the demux gave none. Takes the
/// descriptors: call it once.
pub fn inherited() -> Result<Option<Tallies>, RateTablesError> {
    let Ok(count) = std::env::var(RATE_TABLES_ENV) else {
        return Ok(None);
    };
    let n = match count.parse::<usize>() {
        Ok(n) if (1..=MAX_RATE_TABLES).contains(&n) => n,
        _ => return Err(RateTablesError::Count(count)),
    };
    // At most MAX_RATE_TABLES (64): the casts cannot truncate.
    let mut fds = (0..n as i32)
        .map(|i| crate::sys::adopt_inherited(RATE_TABLES_FD + i, true))
        .collect::<std::io::Result<Vec<_>>>()?;
    let own = fds.remove(0);
    Ok(Some(Tallies::attach(own, fds)?))
}
