//! Per-client limits of a site or a route, declared once: who may ask at all (`allow`, `deny`:
//! lists of address blocks, answered 403), and how often (`rate`, `burst`, answered 429 with
//! `retry-after`). Each value is a type that refuses a bad input when it is deserialised, so
//! the demux (reading `[[site]]` and `[[site.route]]` of the configuration file through
//! [`FileLimits`]) and a worker (reading the site table's JSON) accept the same values.
//!
//! A route's limits replace its site's, key by key: a route with `rate` has its own rate
//! whatever the site's; one with `allow` or `deny` its own lists ([`Limits::over`]).
//!
//! How a worker counts a rate across every worker of the box is the built-in server's (its
//! `limits` module); this module only says what the limit is.

use std::fmt;
use std::net::IpAddr;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// The most address blocks one `allow` or `deny` list holds: each request of the site or
/// route compares its client's address with each block.
pub const MAX_BLOCKS: usize = 1024;

/// The largest `burst`: the most requests one client may make at once.
pub const MAX_BURST: u32 = 1_000_000;

/// The prefix lengths a rate is keyed by when none is given: one IPv4 address, one IPv6
/// `/64` (what one subscriber gets, RFC 6177: a client holds a whole `/64`).
pub const DEFAULT_PREFIX_V4: u8 = 32;
pub const DEFAULT_PREFIX_V6: u8 = 64;

/// The limits of a site or a route; all empty by default (no limit). Its JSON leaves out
/// every field at its default, so a table without limits reads the same in builds before
/// them.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Limits {
    /// When not empty, only clients within one of these blocks are served; the others get
    /// 403.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub allow: Vec<Cidr>,
    /// Clients within one of these blocks get 403 (checked after `allow`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub deny: Vec<Cidr>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate: Option<RateLimit>,
}

impl Limits {
    /// No limit at all.
    pub fn is_none(&self) -> bool {
        self == &Limits::default()
    }

    /// These limits (a route's) over `site`'s: each key given here replaces the site's.
    pub fn over(&self, site: &Limits) -> Limits {
        let lists = self.allow.is_empty() && self.deny.is_empty();
        Limits {
            allow: if lists { &site.allow } else { &self.allow }.clone(),
            deny: if lists { &site.deny } else { &self.deny }.clone(),
            rate: self.rate.or(site.rate),
        }
    }

    /// Whether a client at `addr` may ask at all: within `allow` (when given) and not
    /// within `deny`.
    pub fn admits(&self, addr: IpAddr) -> bool {
        let addr = canonical(addr);
        (self.allow.is_empty() || self.allow.iter().any(|b| b.contains(addr)))
            && !self.deny.iter().any(|b| b.contains(addr))
    }
}

/// An IPv4-mapped IPv6 address (`::ffff:a.b.c.d`, as a dual-stack socket reports an IPv4
/// client) as the IPv4 address it is; any other address as it is.
pub fn canonical(addr: IpAddr) -> IpAddr {
    match addr {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4),
        v4 => v4,
    }
}

/// A request rate with its burst, and how clients are told apart: every address within one
/// block of `prefix_v4` (IPv4) or `prefix_v6` (IPv6) bits is one client.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RateLimit {
    pub rate: Rate,
    /// The most requests a client may make at once; in the long run it gets `rate`.
    pub burst: Burst,
    pub prefix_v4: PrefixV4,
    pub prefix_v6: PrefixV6,
}

impl RateLimit {
    /// The window the burst is counted over, in milliseconds: `burst` requests at `rate`
    /// (at least 1 ms).
    pub fn window_ms(&self) -> u64 {
        let period_ms = self.rate.per.millis();
        (u64::from(self.burst.get()) * period_ms / u64::from(self.rate.count)).max(1)
    }
}

/// A request rate: `count` requests per second (`"20/s"`), minute (`"20/m"`) or hour
/// (`"20/h"`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Rate {
    pub count: u32,
    pub per: Per,
}

/// The period of a [`Rate`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Per {
    Second,
    Minute,
    Hour,
}

impl Per {
    fn millis(self) -> u64 {
        match self {
            Per::Second => 1_000,
            Per::Minute => 60_000,
            Per::Hour => 3_600_000,
        }
    }

    fn letter(self) -> char {
        match self {
            Per::Second => 's',
            Per::Minute => 'm',
            Per::Hour => 'h',
        }
    }
}

impl TryFrom<String> for Rate {
    type Error = LimitError;

    fn try_from(v: String) -> Result<Rate, LimitError> {
        let bad = || LimitError::Rate(v.clone());
        let (count, per) = v.split_once('/').ok_or_else(bad)?;
        let count: u32 = count.trim().parse().map_err(|_| bad())?;
        let per = match per.trim() {
            "s" => Per::Second,
            "m" => Per::Minute,
            "h" => Per::Hour,
            _ => return Err(bad()),
        };
        if count == 0 || count > MAX_BURST {
            return Err(bad());
        }
        Ok(Rate { count, per })
    }
}

impl From<Rate> for String {
    fn from(r: Rate) -> String {
        format!("{}/{}", r.count, r.per.letter())
    }
}

/// A burst: 1 to [`MAX_BURST`] requests.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "u64", into = "u64")]
pub struct Burst(u32);

impl Burst {
    pub fn get(self) -> u32 {
        self.0
    }
}

impl TryFrom<u64> for Burst {
    type Error = LimitError;

    fn try_from(v: u64) -> Result<Burst, LimitError> {
        match u32::try_from(v) {
            Ok(b) if (1..=MAX_BURST).contains(&b) => Ok(Burst(b)),
            _ => Err(LimitError::Burst(v)),
        }
    }
}

impl From<Burst> for u64 {
    fn from(b: Burst) -> u64 {
        b.0.into()
    }
}

/// How many leading bits of an address make one client, for one family: a length type per
/// family so each refuses what its family cannot have.
macro_rules! prefix_type {
    ($name:ident, $max:literal, $default:expr, $what:literal) => {
        #[doc = concat!("The leading bits of an ", $what, " address that make one client: 1 to ", $max, ".")]
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
        #[serde(try_from = "u64", into = "u64")]
        pub struct $name(u8);

        impl $name {
            pub fn get(self) -> u8 {
                self.0
            }
        }

        impl Default for $name {
            fn default() -> Self {
                $name($default)
            }
        }

        impl TryFrom<u64> for $name {
            type Error = LimitError;

            fn try_from(v: u64) -> Result<Self, LimitError> {
                match u8::try_from(v) {
                    Ok(p) if (1..=$max).contains(&p) => Ok($name(p)),
                    _ => Err(LimitError::Prefix { what: $what, max: $max, value: v }),
                }
            }
        }

        impl From<$name> for u64 {
            fn from(p: $name) -> u64 {
                p.0.into()
            }
        }
    };
}

prefix_type!(PrefixV4, 32, DEFAULT_PREFIX_V4, "IPv4");
prefix_type!(PrefixV6, 128, DEFAULT_PREFIX_V6, "IPv6");

/// A block of addresses: `203.0.113.0/24`, `2001:db8::/32`, or one address (`192.0.2.7`,
/// all of its bits). Bits beyond the prefix must be zero, so a block reads as what it holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Cidr {
    addr: IpAddr,
    len: u8,
}

impl Cidr {
    /// Whether `addr` is within the block (an IPv4-mapped IPv6 address as its IPv4 one).
    pub fn contains(&self, addr: IpAddr) -> bool {
        match (self.addr, canonical(addr)) {
            (IpAddr::V4(net), IpAddr::V4(a)) => {
                masked(u32::from(a).into(), 32, self.len) == u32::from(net).into()
            }
            (IpAddr::V6(net), IpAddr::V6(a)) => masked(a.into(), 128, self.len) == net.into(),
            _ => false,
        }
    }
}

/// The leading `len` of the `bits` bits of `v`, the rest zero.
fn masked(v: u128, bits: u8, len: u8) -> u128 {
    match len {
        0 => 0,
        _ => v & (u128::MAX << (bits - len.min(bits))),
    }
}

impl FromStr for Cidr {
    type Err = LimitError;

    fn from_str(s: &str) -> Result<Cidr, LimitError> {
        let bad = |why| LimitError::Cidr {
            value: s.to_string(),
            why,
        };
        let (addr, len) = match s.split_once('/') {
            Some((a, l)) => (a, Some(l)),
            None => (s, None),
        };
        let addr: IpAddr = addr.parse().map_err(|_| {
            bad(if len.is_some() {
                "expected an IPv4 or IPv6 address before the /"
            } else {
                "expected an IPv4 or IPv6 address, or a block such as 203.0.113.0/24"
            })
        })?;
        let bits = if addr.is_ipv4() { 32 } else { 128 };
        let len = match len {
            None => bits,
            Some(l) => match l.parse::<u8>() {
                Ok(l) if l <= bits => l,
                _ => return Err(bad("the prefix length is 0 to 32 (IPv4) or 128 (IPv6)")),
            },
        };
        let whole: u128 = match addr {
            IpAddr::V4(a) => u32::from(a).into(),
            IpAddr::V6(a) => a.into(),
        };
        if masked(whole, bits, len) != whole {
            return Err(bad(
                "bits are set beyond the prefix: write the block's first address (e.g. \
                 203.0.113.0/24)",
            ));
        }
        Ok(Cidr { addr, len })
    }
}

impl TryFrom<String> for Cidr {
    type Error = LimitError;

    fn try_from(v: String) -> Result<Cidr, LimitError> {
        v.parse()
    }
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.len)
    }
}

impl From<Cidr> for String {
    fn from(c: Cidr) -> String {
        c.to_string()
    }
}

/// The limit keys of a `[[site]]` or a `[[site.route]]` as the configuration file writes
/// them; each value checked as it is read ([`Limits::try_from`] checks the rest).
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileLimits {
    pub allow: Option<Vec<Cidr>>,
    pub deny: Option<Vec<Cidr>>,
    pub rate: Option<Rate>,
    pub burst: Option<Burst>,
    pub rate_prefix_v4: Option<PrefixV4>,
    pub rate_prefix_v6: Option<PrefixV6>,
}

/// The keys [`FileLimits`] takes, in a `[[site]]` and a `[[site.route]]` alike.
pub const FILE_KEYS: [&str; 6] = [
    "allow",
    "deny",
    "rate",
    "burst",
    "rate_prefix_v4",
    "rate_prefix_v6",
];

impl TryFrom<FileLimits> for Limits {
    type Error = LimitError;

    fn try_from(f: FileLimits) -> Result<Limits, LimitError> {
        let rate = match f.rate {
            Some(rate) => Some(RateLimit {
                rate,
                // A burst of one period's requests when none is given: `20/s` lets 20 in at
                // once.
                burst: f.burst.unwrap_or(Burst(rate.count)),
                prefix_v4: f.rate_prefix_v4.unwrap_or_default(),
                prefix_v6: f.rate_prefix_v6.unwrap_or_default(),
            }),
            None if f.burst.is_some() => return Err(LimitError::WithoutRate("burst")),
            None if f.rate_prefix_v4.is_some() => {
                return Err(LimitError::WithoutRate("rate_prefix_v4"))
            }
            None if f.rate_prefix_v6.is_some() => {
                return Err(LimitError::WithoutRate("rate_prefix_v6"))
            }
            None => None,
        };
        let limits = Limits {
            allow: f.allow.unwrap_or_default(),
            deny: f.deny.unwrap_or_default(),
            rate,
        };
        limits.check()?;
        Ok(limits)
    }
}

impl Limits {
    /// What no single value can say alone: lists of at most [`MAX_BLOCKS`].
    pub fn check(&self) -> Result<(), LimitError> {
        for (key, list) in [("allow", &self.allow), ("deny", &self.deny)] {
            if list.len() > MAX_BLOCKS {
                return Err(LimitError::TooManyBlocks { key, n: list.len() });
            }
        }
        Ok(())
    }
}

/// A limit refused; [`LimitError::key`] names the key it is about.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LimitError {
    #[error(
        "rate = {0:?}: expected requests per second, minute or hour, 1 to {MAX_BURST}, e.g. \
         \"20/s\" or \"100/m\""
    )]
    Rate(String),
    #[error("burst = {0}: expected 1 to {MAX_BURST} requests")]
    Burst(u64),
    #[error("{value}: expected an {what} prefix length of 1 to {max} bits")]
    Prefix {
        what: &'static str,
        max: u8,
        value: u64,
    },
    #[error("{value:?}: {why}")]
    Cidr { value: String, why: &'static str },
    #[error("{0} goes with rate = \"N/s\" only")]
    WithoutRate(&'static str),
    #[error("{key} holds {n} blocks; at most {MAX_BLOCKS}")]
    TooManyBlocks { key: &'static str, n: usize },
}

impl LimitError {
    /// The key whose value is wrong, when the error alone says it.
    pub fn key(&self) -> Option<&'static str> {
        match self {
            LimitError::Rate(_) => Some("rate"),
            LimitError::Burst(_) => Some("burst"),
            LimitError::WithoutRate(k) => Some(k),
            LimitError::TooManyBlocks { key, .. } => Some(key),
            LimitError::Prefix { .. } | LimitError::Cidr { .. } => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cidr(s: &str) -> Cidr {
        s.parse().unwrap_or_else(|e| panic!("{s}: {e}"))
    }

    #[test]
    fn blocks_hold_their_addresses_and_no_others() {
        let b = cidr("203.0.113.0/24");
        assert!(b.contains("203.0.113.9".parse().unwrap()));
        assert!(b.contains("::ffff:203.0.113.9".parse().unwrap()));
        assert!(!b.contains("203.0.114.1".parse().unwrap()));
        assert!(!b.contains("2001:db8::1".parse().unwrap()));
        let v6 = cidr("2001:db8::/32");
        assert!(v6.contains("2001:db8:ffff::1".parse().unwrap()));
        assert!(!v6.contains("2001:db9::1".parse().unwrap()));
        assert!(cidr("0.0.0.0/0").contains("198.51.100.1".parse().unwrap()));
        assert!(cidr("127.0.0.2").contains("127.0.0.2".parse().unwrap()));
        assert!(!cidr("127.0.0.2").contains("127.0.0.1".parse().unwrap()));
        assert_eq!(cidr("127.0.0.2").to_string(), "127.0.0.2/32");
    }

    #[test]
    fn bad_blocks_say_why() {
        for (bad, says) in [
            ("203.0.113.1/24", "bits are set beyond the prefix"),
            ("203.0.113.0/33", "the prefix length is 0 to 32"),
            (
                "example.com/8",
                "expected an IPv4 or IPv6 address before the /",
            ),
            ("localhost", "address, or a block such as 203.0.113.0/24"),
            ("10.0.0.0/x", "the prefix length"),
        ] {
            let e = bad.parse::<Cidr>().unwrap_err().to_string();
            assert!(
                e.starts_with(&format!("{bad:?}: ")) && e.contains(says),
                "{e}"
            );
        }
    }

    #[test]
    fn rates_read_and_write_the_same() {
        for (text, count, per) in [("20/s", 20, Per::Second), ("5/m", 5, Per::Minute)] {
            let r = Rate::try_from(text.to_string()).unwrap();
            assert_eq!((r.count, r.per), (count, per));
            assert_eq!(String::from(r), text);
        }
        for bad in ["0/s", "20", "20/d", "x/s", "-1/s"] {
            let e = Rate::try_from(bad.to_string()).unwrap_err();
            assert_eq!(e.key(), Some("rate"), "{bad}");
        }
    }

    #[test]
    fn a_file_limit_is_checked_whole() {
        let read = |toml_like: FileLimits| Limits::try_from(toml_like);
        let rate = Rate::try_from("5/s".to_string()).unwrap();
        let l = read(FileLimits {
            rate: Some(rate),
            ..FileLimits::default()
        })
        .unwrap();
        let r = l.rate.unwrap();
        assert_eq!(
            (r.burst.get(), r.prefix_v4.get(), r.prefix_v6.get()),
            (5, 32, 64)
        );
        assert_eq!(r.window_ms(), 1000);
        let e = read(FileLimits {
            burst: Some(Burst(3)),
            ..FileLimits::default()
        })
        .unwrap_err();
        assert_eq!(e.key(), Some("burst"));
        assert!(Burst::try_from(0).is_err() && PrefixV4::try_from(33).is_err());
        assert!(PrefixV6::try_from(128).is_ok());
    }

    #[test]
    fn a_route_replaces_its_sites_limits_key_by_key() {
        let site = Limits {
            deny: vec![cidr("10.0.0.0/8")],
            ..Limits::default()
        };
        let route = Limits::default();
        assert_eq!(route.over(&site), site);
        let own = Limits {
            allow: vec![cidr("192.0.2.0/24")],
            ..Limits::default()
        };
        assert_eq!(own.over(&site).deny, vec![]);
        assert!(!site.admits("10.1.2.3".parse().unwrap()));
        assert!(site.admits("11.1.2.3".parse().unwrap()));
        assert!(own.admits("192.0.2.1".parse().unwrap()));
        assert!(!own.admits("192.0.3.1".parse().unwrap()));
    }

    #[test]
    fn no_limits_write_no_json() {
        assert_eq!(serde_json::to_string(&Limits::default()).unwrap(), "{}");
        let l: Limits = serde_json::from_str(
            r#"{"deny":["10.0.0.0/8"],"rate":{"rate":"5/s","burst":10,"prefix_v4":32,"prefix_v6":64}}"#,
        )
        .unwrap();
        assert_eq!(l.rate.unwrap().window_ms(), 2000);
        assert!(serde_json::from_str::<Limits>(r#"{"deny":["10.0.0.1/8"]}"#).is_err());
    }
}
