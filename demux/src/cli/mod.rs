//! The command line: `ringmux`'s options and configuration file ([`config`]). Private: the
//! crate root re-exports it as `ringmux_demux::config`, beside `ringmux lb-config` and the
//! option values both command lines parse, which are the crate `ringmux-lb`
//! (`ringmux_demux::{lbconfig, options}`).

pub mod config;
