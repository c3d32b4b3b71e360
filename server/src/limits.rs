//! Per-client limits before a route answers: `allow`/`deny` lists (403) and request rates
//! (429 with `retry-after`), as a site or route declares them (`ringmux_proto::limits`).
//!
//! Each route's limits are resolved once, when the router is built (`Gate`: the route's over
//! its site's); a request's decision is a few comparisons and, for a rate, a read of every
//! worker's counts in shared memory and one write to this worker's own (`crate::limits`'s
//! rate module), no system call. This module decides; it never writes a response (the
//! transports do) and never maps memory (the table's own module does).

use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use http::{header, HeaderValue, StatusCode};
use ringmux_proto::limits::{canonical, Limits, RateLimit};
use ringmux_ring::tally::Tallies;

use crate::reply::Reply;

mod rate;

pub(crate) use rate::Share;

/// Why a request was refused before its route answered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// 403: the client is outside `allow` or inside `deny`.
    Denied,
    /// 429: the client is over its rate.
    Limited,
}

impl Refusal {
    pub const ALL: [Refusal; 2] = [Refusal::Denied, Refusal::Limited];
    /// How the `requests_refused` series labels each, in [`Refusal::ALL`] order.
    pub const LABELS: [&'static str; 2] = ["denied", "rate"];
}

/// The limits of one route (or of a site, for a request no route takes), resolved.
#[derive(Debug)]
pub(crate) struct Gate {
    limits: Limits,
    /// Its rate and the tables' slots it counts in.
    rate: Option<(RateLimit, Share)>,
}

/// Makes the gates of one site table: each rate declared (a site's, or a route's own) gets its
/// own share of the rate tables' slots, the `n`th of as many shares as the table declares
/// rates (every worker builds the same from the same table, so they count in the same
/// slots). The routes of a site that have no rate of their own count in the site's share:
/// a site's rate holds for a client over all of them together.
#[derive(Debug)]
pub(crate) struct GateMaker {
    shares: u32,
    next: u32,
}

impl GateMaker {
    /// For the rates of `table`.
    pub(crate) fn new(table: &ringmux_proto::sites::SiteTable) -> GateMaker {
        let rated: usize = (table.sites.iter())
            .map(|s| {
                let routes = s.routes.iter().filter(|r| r.limits.rate.is_some());
                usize::from(s.limits.rate.is_some()) + routes.count()
            })
            .sum();
        GateMaker {
            shares: u32::try_from(rated).unwrap_or(u32::MAX),
            next: 0,
        }
    }

    /// Whether any gate limits a rate.
    pub(crate) fn rated(&self) -> bool {
        self.shares > 0
    }

    /// The share of a site's own rate, if it has one: call once per site, in table order,
    /// before [`GateMaker::gate`] for its routes.
    pub(crate) fn site_share(&mut self, site: &Limits) -> Option<Share> {
        site.rate.map(|_| self.next_share())
    }

    fn next_share(&mut self) -> Share {
        let share = Share::of(self.next, self.shares);
        self.next += 1;
        share
    }

    /// The gate of `own` (a route's limits) over `site`'s, whose rate counts in
    /// `site_share`; `None` when nothing is limited.
    pub(crate) fn gate(
        &mut self,
        own: &Limits,
        site: &Limits,
        site_share: Option<Share>,
    ) -> Option<Gate> {
        let limits = own.over(site);
        if limits.is_none() {
            return None;
        }
        let share = match own.rate {
            Some(_) => Some(self.next_share()),
            None => site_share,
        };
        let rate = limits.rate.zip(share);
        Some(Gate { limits, rate })
    }
}

/// What every gate of a worker shares: the rate tables and the refusal counters.
#[derive(Debug, Default)]
pub(crate) struct Gates {
    refused: [AtomicU64; Refusal::ALL.len()],
    tables: Option<Arc<Tallies>>,
}

impl Gates {
    /// Gates counting rates in `tables`; with none and `rated`, in a table of this worker's
    /// own (the demux gave none: each worker then limits alone).
    pub(crate) fn new(tables: Option<Arc<Tallies>>, rated: bool) -> Gates {
        let tables = match tables {
            Some(t) => Some(t),
            None if rated => own_table(),
            None => None,
        };
        Gates {
            refused: Default::default(),
            tables,
        }
    }

    /// The reply refusing a request from `client` through `gate`, or `None` to serve it.
    pub(crate) fn check(&self, gate: &Gate, client: IpAddr) -> Option<Reply> {
        let client = canonical(client);
        if !gate.limits.admits(client) {
            self.count(Refusal::Denied);
            return Some(Reply::text(StatusCode::FORBIDDEN, b"forbidden\n"));
        }
        let ((limit, share), tables) = (gate.rate.as_ref()?, self.tables.as_ref()?);
        let slot = rate::slot(tables.hash_key(), *share, limit, client);
        let now_ms = ringmux_ring::monotonic_ns() / 1_000_000;
        let retry = rate::admit(tables, slot, limit, now_ms).err()?;
        self.count(Refusal::Limited);
        let mut reply = Reply::text(StatusCode::TOO_MANY_REQUESTS, b"too many requests\n");
        reply
            .headers
            .insert(header::RETRY_AFTER, HeaderValue::from(retry));
        Some(reply)
    }

    fn count(&self, why: Refusal) {
        // Relaxed: a statistic, nothing is published through it.
        self.refused[why as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// Requests refused so far, in [`Refusal::ALL`] order.
    pub(crate) fn refused(&self) -> [u64; Refusal::ALL.len()] {
        [0, 1].map(|i| self.refused[i].load(Ordering::Relaxed))
    }
}

/// A rate table of this worker alone, for when the demux handed none.
fn own_table() -> Option<Arc<Tallies>> {
    use std::hash::{BuildHasher, Hasher};
    let random = || {
        std::collections::hash_map::RandomState::new()
            .build_hasher()
            .finish()
    };
    let made = ringmux_ring::tally::create([random(), random()])
        .map_err(ringmux_ring::tally::TallyError::from)
        .and_then(|fd| Tallies::attach(fd, Vec::new()));
    match made {
        Ok(t) => {
            tracing::warn!("no rate tables from the demux: this worker limits rates alone");
            Some(Arc::new(t))
        }
        Err(e) => {
            tracing::error!(error = %e, "no rate table: rates are not limited");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(allow: &[&str], deny: &[&str]) -> Limits {
        Limits {
            allow: allow.iter().map(|c| c.parse().unwrap()).collect(),
            deny: deny.iter().map(|c| c.parse().unwrap()).collect(),
            rate: None,
        }
    }

    #[test]
    fn denied_clients_get_403_and_are_counted() {
        let gates = Gates::default();
        let mut make = GateMaker::new(&Default::default());
        let site = limits(&[], &["127.0.0.2"]);
        assert!(make
            .gate(&Limits::default(), &Limits::default(), None)
            .is_none());
        let gate = make.gate(&Limits::default(), &site, None).unwrap();
        assert!(gates.check(&gate, "127.0.0.1".parse().unwrap()).is_none());
        let r = gates
            .check(&gate, "::ffff:127.0.0.2".parse().unwrap())
            .unwrap();
        assert_eq!(r.status, StatusCode::FORBIDDEN);
        let only = make
            .gate(&limits(&["10.0.0.0/8"], &[]), &site, None)
            .unwrap();
        assert!(gates.check(&only, "127.0.0.1".parse().unwrap()).is_some());
        assert!(gates.check(&only, "10.9.9.9".parse().unwrap()).is_none());
        assert_eq!(gates.refused(), [2, 0]);
    }

    #[test]
    fn over_the_rate_gets_429_with_retry_after() {
        let table = ringmux_ring::tally::create([5, 6]).unwrap();
        let gates = Gates::new(
            Some(Arc::new(Tallies::attach(table, vec![]).unwrap())),
            true,
        );
        let rated = Limits::try_from(ringmux_proto::limits::FileLimits {
            rate: Some("1/m".to_string().try_into().unwrap()),
            burst: Some(3u64.try_into().unwrap()),
            ..Default::default()
        })
        .unwrap();
        let mut make = GateMaker { shares: 1, next: 0 };
        let gate = make.gate(&rated, &Limits::default(), None).unwrap();
        let client: IpAddr = "198.51.100.7".parse().unwrap();
        let answers: Vec<_> = (0..5).map(|_| gates.check(&gate, client)).collect();
        assert!(answers[..3].iter().all(Option::is_none));
        let r = answers[4].as_ref().unwrap();
        assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
        let retry: u64 = r.headers[header::RETRY_AFTER]
            .to_str()
            .unwrap()
            .parse()
            .unwrap();
        // At most the rest of this 3-minute window and a third of the next.
        assert!((1..=240).contains(&retry), "{retry}");
        assert_eq!(gates.refused(), [0, 2]);
    }
}
