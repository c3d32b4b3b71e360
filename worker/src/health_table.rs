//! The health table the demux placed in this process (`ringmux_proto::HEALTH_TABLE_FD`, when
//! `ringmux_proto::HEALTH_TABLE_ENV` says so) when a route checks its backends' health: the
//! demux's verdict on each backend, mapped read-only (`ringmux_ring::health`).

use ringmux_proto::{HEALTH_TABLE_ENV, HEALTH_TABLE_FD};
use ringmux_ring::health::{HealthReader, HealthTableError};

/// Why the health table cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum HealthTableUseError {
    #[error("{HEALTH_TABLE_ENV}={0:?}: expected 1")]
    Flag(String),
    #[error("the health table: {0}")]
    Adopt(#[from] std::io::Error),
    #[error(transparent)]
    Table(#[from] HealthTableError),
}

/// This process's health table, mapped; `None` when the demux gave none. Takes the
/// descriptor: call it once.
pub fn inherited() -> Result<Option<HealthReader>, HealthTableUseError> {
    let Ok(flag) = std::env::var(HEALTH_TABLE_ENV) else {
        return Ok(None);
    };
    if flag != "1" {
        return Err(HealthTableUseError::Flag(flag));
    }
    let fd = crate::sys::adopt_inherited(HEALTH_TABLE_FD, true)?;
    Ok(Some(HealthReader::attach(fd)?))
}
