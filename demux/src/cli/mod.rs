//! The command line: `ringmux`'s options and configuration file ([`config`]), the option values
//! both command lines parse ([`options`]) and `ringmux lb-config` ([`lbconfig`]). Private: the
//! crate root re-exports the three as `ringmux_demux::{config, lbconfig, options}`.

pub mod config;
pub mod lbconfig;
pub mod options;
