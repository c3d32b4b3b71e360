//! How the built-in worker program (`ringmux-worker`) serves: the one declaration of these
//! options. `ringmux` flattens [`ServeArgs`] into its own command line (so each has its flag,
//! its `RINGMUX_*` variable and its key in the configuration file), and `ringmux-worker`
//! flattens the same struct into its own: the names, defaults, ranges and help are written
//! once, here. The demux passes the values it has on the worker's command line
//! ([`ServeArgs::worker_args`]), each option whatever its value, so the worker never falls
//! back on a default of its own.
//!
//! Behind the `serve-args` feature (clap), which the demux and the server turn on.

use std::collections::BTreeMap;

use clap::{Arg, ArgMatches, Args, Command};
use http::HeaderValue;

use crate::limits::Cidr;

/// The built-in worker's serving options.
#[derive(Args, Debug, Clone, PartialEq, Eq)]
pub struct ServeArgs {
    /// Largest body /bytes/N of the built-in worker serves, in bytes.
    #[arg(long, env = "RINGMUX_MAX_BYTES", value_name = "BYTES", default_value_t = 64 << 20)]
    pub max_bytes: u64,
    /// Each built-in worker's cache of small static files (of every root), in MiB (0–65536;
    /// 0: no cache). A cached file is checked against the disk at most 1 s after its last
    /// check.
    #[arg(
        long,
        env = "RINGMUX_FILE_CACHE_MB",
        value_name = "MIB",
        default_value_t = 64,
        value_parser = clap::value_parser!(u64).range(0..=65536)
    )]
    pub file_cache_mb: u64,
    /// Cache-Control sent with every static file (200, 206, 304), e.g. "public, max-age=3600".
    /// Default: none.
    #[arg(long, env = "RINGMUX_CACHE_CONTROL", value_name = "VALUE", value_parser = header_value)]
    pub cache_control: Option<HeaderValue>,
    /// Seconds the proxy waits for the upstream's response head (else 504), and between two
    /// frames of its response body (else the stream is reset); also the connect timeout
    /// (1–3600).
    #[arg(
        long,
        env = "RINGMUX_UPSTREAM_TIMEOUT",
        value_name = "SECONDS",
        default_value_t = 60,
        value_parser = clap::value_parser!(u64).range(1..=3600)
    )]
    pub upstream_timeout: u64,
    /// TCP connections each worker serves at once (HTTPS and plain HTTP each). At the cap the
    /// connection idle longest is closed to make room for a new one
    /// (ringmux_worker_tcp_errors_total{kind="evicted"}); only when none is idle is the new one
    /// closed as soon as it is accepted (kind="over_cap").
    #[arg(
        long,
        env = "RINGMUX_TCP_MAX_CONNECTIONS",
        value_name = "N",
        default_value_t = 4096,
        value_parser = clap::value_parser!(u32).range(1..)
    )]
    pub tcp_max_connections: u32,
    /// Seconds an HTTP/2 connection may stay open with no request in flight (1–3600); then
    /// the worker sends GOAWAY and closes it
    /// (ringmux_worker_tcp_errors_total{kind="idle_timeout"}). HTTP/1.1 keeps its 10 s
    /// request-head timeout, which also closes an idle keep-alive connection.
    #[arg(
        long,
        env = "RINGMUX_TCP_IDLE_TIMEOUT",
        value_name = "SECONDS",
        default_value_t = 60,
        value_parser = clap::value_parser!(u64).range(1..=3600)
    )]
    pub tcp_idle_timeout: u64,
    /// Behind a balancer that hides the client's address: the balancer's addresses (address
    /// blocks, `10.0.0.0/8` or `192.0.2.7`, comma-separated; a TOML array in the file), whose
    /// TCP connections must begin with a PROXY protocol header, version 1 or 2. The client
    /// address it names stands for the peer's everywhere: access log, allow/deny, rates,
    /// forwarded and x-forwarded-for. A connection from one of them without a valid header
    /// within 5 s is closed (ringmux_worker_proxy_protocol_refused_total{why}); one from any
    /// other address is served as it is, its bytes never read as a header. Default: none.
    /// TCP only (HTTPS and plain HTTP): QUIC carries no such header.
    #[arg(
        long,
        env = "RINGMUX_PROXY_PROTOCOL_FROM",
        value_name = "CIDRS",
        value_delimiter = ','
    )]
    pub proxy_protocol_from: Vec<Cidr>,
    /// Tunnels through the proxy (WebSockets, HTTP/1.1 upgrades) each worker holds at once
    /// (1–1000000); one more is answered 503 (ringmux_worker_tunnels_refused_total).
    #[arg(
        long,
        env = "RINGMUX_MAX_TUNNELS",
        value_name = "N",
        default_value_t = 4096,
        value_parser = clap::value_parser!(u32).range(1..=1_000_000)
    )]
    pub max_tunnels: u32,
    /// Seconds a tunnel through the proxy may go without a byte either way (1–86400); then
    /// it is closed (ringmux_worker_tunnels_closed_total{how="idle"}). nginx's 60 s
    /// (`proxy_read_timeout`) closes quiet WebSockets; Caddy has no limit.
    #[arg(
        long,
        env = "RINGMUX_TUNNEL_IDLE",
        value_name = "SECONDS",
        default_value_t = 300,
        value_parser = clap::value_parser!(u64).range(1..=86400)
    )]
    pub tunnel_idle: u64,
    /// Seconds a draining worker (a reload, a stop) keeps its tunnels through the proxy
    /// (0–86400), or off: until they end, or the drain's bound (--grace, --max-draining) cuts
    /// the worker. Then each WebSocket is sent close 1001 ("going away") at a frame boundary,
    /// both ways, and any other tunnel is closed, each at its own time within
    /// --tunnel-drain-spread (ringmux_worker_tunnels_closed_total{how="drain"}).
    #[arg(
        long,
        env = "RINGMUX_TUNNEL_DRAIN",
        value_name = "SECONDS|off",
        default_value = "off",
        value_parser = tunnel_drain
    )]
    pub tunnel_drain: TunnelDrainAfter,
    /// Seconds over which a draining worker spreads the closes of its tunnels after
    /// --tunnel-drain (0–3600): each closes at a time drawn uniformly within them, so clients
    /// do not all reconnect at once.
    #[arg(
        long,
        env = "RINGMUX_TUNNEL_DRAIN_SPREAD",
        value_name = "SECONDS",
        default_value_t = 10,
        value_parser = clap::value_parser!(u64).range(0..=3600)
    )]
    pub tunnel_drain_spread: u64,
    /// The access log's lines: ringmux (fields separated by spaces), combined (Apache's and
    /// nginx's, with referer and user agent) or json (one object per line, every field).
    #[arg(
        long,
        env = "RINGMUX_ACCESS_LOG_FORMAT",
        value_name = "FORMAT",
        value_enum,
        default_value_t = LogFormat::Ringmux
    )]
    pub access_log_format: LogFormat,
}

/// `--tunnel-drain`: seconds, or `None` for off.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TunnelDrainAfter(pub Option<u64>);

/// The longest `--tunnel-drain`, a day (as `--tunnel-idle`'s).
pub const MAX_TUNNEL_DRAIN: u64 = 86400;

/// A `--tunnel-drain` that is none.
#[derive(Debug, thiserror::Error)]
#[error("{0:?} is not a number of seconds from 0 to 86400, nor off")]
pub struct NotATunnelDrain(String);

/// `--tunnel-drain`'s value: `off` (or `none`), or seconds from 0 to [`MAX_TUNNEL_DRAIN`].
fn tunnel_drain(v: &str) -> Result<TunnelDrainAfter, NotATunnelDrain> {
    let t = v.trim();
    if t.eq_ignore_ascii_case("off") || t.eq_ignore_ascii_case("none") {
        return Ok(TunnelDrainAfter(None));
    }
    match t.parse::<u64>() {
        Ok(n) if n <= MAX_TUNNEL_DRAIN => Ok(TunnelDrainAfter(Some(n))),
        _ => Err(NotATunnelDrain(v.to_string())),
    }
}

/// How the access log writes a line.
#[derive(clap::ValueEnum, Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum LogFormat {
    /// ringmux's own line, fields separated by spaces.
    #[default]
    Ringmux,
    /// The combined format of Apache and nginx (GoAccess's `COMBINED`).
    Combined,
    /// One JSON object per line.
    Json,
}

impl ServeArgs {
    /// The declared options, as clap sees them.
    pub fn declared() -> Vec<Arg> {
        ServeArgs::augment_args(Command::new("serve"))
            .get_arguments()
            .cloned()
            .collect()
    }

    /// The worker's arguments for these options: `--name=value` for each one that has a value
    /// (given, from its variable or a configuration file, or its default), as it was given;
    /// `raw` holds every option's values by clap ID, as [`raw_values`] collects them from a
    /// command line that flattens [`ServeArgs`].
    pub fn worker_args(raw: &BTreeMap<String, Vec<String>>) -> Vec<String> {
        Self::declared()
            .iter()
            .flat_map(|arg| {
                let id = arg.get_id().as_str();
                let long = arg.get_long().unwrap_or(id).to_owned();
                raw.get(id)
                    .into_iter()
                    .flatten()
                    .map(move |v| format!("--{long}={v}"))
            })
            .collect()
    }
}

/// Every option's values of `matches` (given, from a variable, or defaults), by clap ID.
pub fn raw_values(matches: &ArgMatches) -> BTreeMap<String, Vec<String>> {
    matches
        .ids()
        .filter_map(|id| {
            let values = matches.try_get_raw(id.as_str()).ok().flatten()?;
            Some((
                id.to_string(),
                values.map(|v| v.to_string_lossy().into_owned()).collect(),
            ))
        })
        .collect()
}

/// A header field value that is not one.
#[derive(Debug, thiserror::Error)]
#[error("{0:?} is not a header value: expected printable ASCII, e.g. \"public, max-age=3600\"")]
pub struct NotAHeaderValue(String);

/// A header field value: printable ASCII, spaces and tabs (RFC 9110 §5.5), not blank.
fn header_value(v: &str) -> Result<HeaderValue, NotAHeaderValue> {
    match HeaderValue::from_str(v) {
        Ok(h)
            if !v.trim().is_empty()
                && v.bytes().all(|b| b == b'\t' || (0x20..0x7f).contains(&b)) =>
        {
            Ok(h)
        }
        _ => Err(NotAHeaderValue(v.to_string())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tunnel_drain_takes_seconds_or_off() {
        assert_eq!(tunnel_drain("off").unwrap(), TunnelDrainAfter(None));
        assert_eq!(tunnel_drain("None").unwrap(), TunnelDrainAfter(None));
        assert_eq!(tunnel_drain("0").unwrap(), TunnelDrainAfter(Some(0)));
        assert_eq!(tunnel_drain(" 30 ").unwrap(), TunnelDrainAfter(Some(30)));
        for bad in ["86401", "-1", "soon", ""] {
            let e = tunnel_drain(bad).unwrap_err().to_string();
            assert!(e.contains(&format!("{bad:?}")) && e.contains("off"), "{e}");
        }
    }
}
