//! The supervisor's side of ACME: what the engine ([`ringmux_acme`], a thread of its own)
//! publishes reaches the workers. A new or renewed certificate goes to every live worker at
//! once (`CERTIFICATE`, which swaps the one resolver both transports of a worker use) and into
//! the site table of every worker started later; the pending challenges go to every live
//! worker (`CHALLENGES`) and to each new one right after its hand-off. Workers confirm each
//! update (`APPLIED`), which is what `ringmux acme renew` waits for.

use std::collections::{BTreeSet, HashMap};
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::Result;
use ringmux_proto::message::{ChallengeSet, SiteCertificate};
use ringmux_proto::sites::SiteTable;
use ringmux_proto::Message;

use super::control::Clients;
use super::spawn::Template;
use super::workers::Worker;
use crate::config::Config;
use crate::forward::Lanes;
use crate::metrics::Counters;
use ringmux_acme::{Acme, AcmeSite, AcmeStatus, Issued, RenewError, RenewTicket};

/// How long `ringmux acme renew` waits, once the certificate is issued, for every live worker
/// to confirm it serves it, before it answers anyway (naming those that did not).
pub const APPLIED_WAIT: Duration = Duration::from_secs(10);

/// A `ringmux acme renew` under way.
struct Renewal {
    client: u64,
    ticket: RenewTicket,
    /// Once issued: the answer, and until when the workers may take to confirm.
    issued: Option<(String, Instant)>,
}

/// The engine and what was last relayed from it.
pub struct Relay {
    engine: Acme,
    /// The ACME sites as the engine was last given them.
    sites: Vec<AcmeSite>,
    /// The site table of the workers started from now on, with the certificates relayed.
    table: SiteTable,
    /// The certificate relayed last, by site label, with the engine's version of it.
    certs: HashMap<String, (u64, Issued)>,
    challenges_version: u64,
    challenges: ChallengeSet,
    /// The `seq` of the next update sent.
    next_seq: u64,
    /// Per lane: updates sent to its worker and not yet confirmed.
    pending: Vec<BTreeSet<u64>>,
    renewals: Vec<Renewal>,
}

/// What one look at the engine found to send.
#[derive(Default)]
pub struct Changes {
    /// Certificates that changed: (site index, chain, key).
    pub certs: Vec<(usize, Issued)>,
    /// The challenges changed.
    pub challenges: bool,
    /// The engine had news (a change of its view or of its status).
    pub woke: bool,
}

/// What [`Relay::forward`] did that its caller acts on.
pub struct Forwarded {
    /// A certificate changed: [`Relay::table`] has it.
    pub certs_changed: bool,
    /// The `ringmux acme renew` clients whose renewal is over, with their answer.
    pub renewals_over: Vec<(u64, String)>,
}

impl Relay {
    /// Starts the engine when `cfg` has ACME sites in `table`, and puts the certificates it
    /// has stored into `table`: a site whose certificate is stored and valid serves it from
    /// the first worker's hand-off.
    pub fn start(cfg: &Config, table: &mut SiteTable, lanes: usize) -> Result<Option<Relay>> {
        let Some(settings) = cfg.acme.clone() else {
            return Ok(None);
        };
        let sites = crate::config::acme::sites(table);
        if sites.is_empty() {
            return Ok(None);
        }
        let engine = Acme::start(settings, sites.clone())?;
        let mut relay = Relay {
            engine,
            sites,
            table: SiteTable::default(),
            certs: HashMap::new(),
            challenges_version: 0,
            challenges: ChallengeSet::default(),
            next_seq: 1,
            pending: vec![BTreeSet::new(); lanes],
            renewals: Vec::new(),
        };
        relay.table = std::mem::take(table);
        relay.look();
        *table = relay.table.clone();
        Ok(Some(relay))
    }

    /// Readable when the engine has news.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.engine.wake_fd()
    }

    pub fn status(&self) -> AcmeStatus {
        self.engine.status()
    }

    /// The site table with every certificate relayed so far.
    pub fn table(&self) -> &SiteTable {
        &self.table
    }

    /// Sends what the engine published since the last look: a changed certificate and changed
    /// challenges to every live worker, the engine's status to the counters.
    pub fn forward(&mut self, workers: &[Worker], lanes: Lanes, counters: &Counters) -> Forwarded {
        let changes = self.look();
        if changes.woke {
            let status = self.status();
            counters.acme_orders[0].store(status.orders_issued, Ordering::Relaxed);
            counters.acme_orders[1].store(status.orders_failed, Ordering::Relaxed);
            let refused = status
                .state_refused
                .iter()
                .chain([&status.foreign_challenges]);
            for (c, n) in counters.acme_state_refused.iter().zip(refused) {
                c.store(*n, Ordering::Relaxed);
            }
        }
        if !changes.certs.is_empty() {
            crate::metrics::counters::set_certificates(counters, &self.table);
        }
        for (i, worker) in workers.iter().enumerate() {
            let Some(control) = worker.control.as_ref() else {
                continue;
            };
            let mut messages: Vec<Message> = changes
                .certs
                .iter()
                .map(|(site, issued)| self.certificate_message(i, *site, issued))
                .collect();
            if changes.challenges {
                messages.extend(self.challenges_message(i, false));
            }
            for m in messages {
                if let Err(e) = crate::sys::send_packet(control.as_fd(), &m.encode()) {
                    tracing::warn!(
                        instance = lanes.at(i).instance,
                        error = %e,
                        "could not send an ACME update to the worker"
                    );
                }
            }
        }
        Forwarded {
            certs_changed: !changes.certs.is_empty(),
            renewals_over: self.finished_renewals(Instant::now()),
        }
    }

    /// Reads the engine's view: the certificates that changed are put into the table and
    /// returned, with whether the challenges changed.
    pub fn look(&mut self) -> Changes {
        // Nothing new since the last look (the engine rings its eventfd on every change):
        // the view is not copied on every round of the supervisor.
        if !crate::sys::wait_readable(self.engine.wake_fd(), Duration::ZERO).unwrap_or(true) {
            return Changes::default();
        }
        let table = &mut self.table;
        let view = self.engine.view();
        let mut changes = Changes {
            woke: true,
            ..Changes::default()
        };
        for (site, version, issued) in view.certs {
            let Some(acme_site) = self.sites.iter().find(|s| s.site == site) else {
                continue;
            };
            if self
                .certs
                .get(&acme_site.label)
                .is_some_and(|(v, i)| *v == version && i.serial == issued.serial)
            {
                continue;
            }
            let Some(target) = table
                .sites
                .get_mut(site)
                .filter(|s| s.label == acme_site.label)
            else {
                continue;
            };
            // Never hand a worker a certificate that does not cover the site's names: a view
            // taken while the engine still had the sites before a reload could index another.
            if let Err(why) = issued.check_covers(&target.names) {
                tracing::error!(site = %target.label, error = %why, "ACME certificate not used");
                continue;
            }
            target.cert_pem = issued.chain_pem.clone();
            target.key_pem = issued.key_pem.clone();
            self.certs
                .insert(acme_site.label.clone(), (version, issued.clone()));
            changes.certs.push((site, issued));
        }
        if view.challenges_version != self.challenges_version {
            self.challenges_version = view.challenges_version;
            self.challenges = view.challenges;
            changes.challenges = true;
        }
        changes
    }

    /// Fills the ACME sites of `table` (a reload's new one) with the certificates relayed so
    /// far, by label, takes it as the table from now on, and gives the engine the new list of
    /// ACME sites.
    pub fn reconfigure(&mut self, table: &mut SiteTable) {
        for site in table.sites.iter_mut().filter(|s| s.acme) {
            if let Some((_, issued)) = self.certs.get(&site.label) {
                if issued.check_covers(&site.names).is_ok() {
                    site.cert_pem = issued.chain_pem.clone();
                    site.key_pem = issued.key_pem.clone();
                }
            }
        }
        self.table = table.clone();
        let sites = crate::config::acme::sites(table);
        if sites != self.sites {
            self.engine.set_sites(sites.clone());
            self.sites = sites;
        }
    }

    /// The message that installs `issued` as site `site`'s certificate at the worker of
    /// `lane`; recorded as pending there.
    pub fn certificate_message(&mut self, lane: usize, site: usize, issued: &Issued) -> Message {
        let seq = self.sent(lane);
        Message::Certificate(SiteCertificate {
            seq,
            site: u32::try_from(site).unwrap_or(u32::MAX),
            cert_pem: issued.chain_pem.clone(),
            key_pem: issued.key_pem.clone(),
        })
    }

    /// The message with the pending challenges for the worker of `lane` (a new worker gets it
    /// only when there are any); recorded as pending there.
    pub fn challenges_message(&mut self, lane: usize, only_if_any: bool) -> Option<Message> {
        let set = &self.challenges;
        if only_if_any && set.http01.is_empty() && set.tls_alpn01.is_empty() {
            return None;
        }
        let mut set = set.clone();
        set.seq = self.sent(lane);
        Some(Message::Challenges(set))
    }

    fn sent(&mut self, lane: usize) -> u64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        if let Some(p) = self.pending.get_mut(lane) {
            p.insert(seq);
        }
        seq
    }

    /// The worker of `lane` confirmed update `seq` (and, as it applies them in order, every
    /// earlier one).
    pub fn applied(&mut self, lane: usize, seq: u64) {
        if let Some(p) = self.pending.get_mut(lane) {
            *p = p.split_off(&seq.saturating_add(1));
        }
    }

    /// The worker of `lane` is gone: nothing of it is awaited any more.
    pub fn forget(&mut self, lane: usize) {
        if let Some(p) = self.pending.get_mut(lane) {
            p.clear();
        }
    }

    /// Lanes whose worker has not confirmed every update sent to it.
    pub fn unconfirmed(&self) -> Vec<usize> {
        (0..self.pending.len())
            .filter(|&l| !self.pending[l].is_empty())
            .collect()
    }

    /// `ringmux acme renew [NAME]` from control client `client`.
    pub fn renew(&mut self, client: u64, name: Option<&str>) -> Result<(), RenewError> {
        let ticket = self.engine.renew(name)?;
        self.renewals.push(Renewal {
            client,
            ticket,
            issued: None,
        });
        Ok(())
    }

    /// The renewals that are over: each client and its answer's last line. Called after
    /// [`Relay::look`] and the sending of what it found, so that a renewed certificate is
    /// awaited only once every worker has been sent it.
    pub fn finished_renewals(&mut self, now: Instant) -> Vec<(u64, String)> {
        let mut done = Vec::new();
        let unconfirmed = self.unconfirmed();
        let engine = &self.engine;
        let certs = &self.certs;
        let sites = &self.sites;
        self.renewals.retain_mut(|r| {
            if r.issued.is_none() {
                match engine.renewed(r.ticket) {
                    None => return true,
                    Some(Err(why)) => {
                        done.push((r.client, format!("error: the renewal failed: {why}")));
                        return false;
                    }
                    Some(Ok(renewed)) => {
                        let names: Vec<String> = renewed
                            .iter()
                            .filter_map(|i| sites.iter().find(|s| s.site == *i))
                            .map(|s| {
                                let serial = certs
                                    .get(&s.label)
                                    .map(|(_, i)| i.serial.as_str())
                                    .unwrap_or("?");
                                format!("{} (serial {serial})", s.label)
                            })
                            .collect();
                        r.issued = Some((
                            format!("ok: renewed {}", names.join(", ")),
                            now + APPLIED_WAIT,
                        ));
                    }
                }
            }
            let Some((line, until)) = &r.issued else {
                return true;
            };
            if unconfirmed.is_empty() {
                done.push((r.client, format!("{line}; every worker serves it")));
                false
            } else if now >= *until {
                done.push((
                    r.client,
                    format!(
                        "{line}; lanes {unconfirmed:?} did not confirm it within {APPLIED_WAIT:?}"
                    ),
                ));
                false
            } else {
                true
            }
        });
        done
    }
}

impl Relay {
    /// Relays what the engine published since the last look ([`Relay::forward`]), keeps a
    /// changed certificate in `template` for every worker started later, and answers the
    /// `ringmux acme renew` clients whose renewal is over.
    pub fn relay(
        &mut self,
        workers: &[Worker],
        lanes: Lanes,
        counters: &Counters,
        template: &mut Template,
        control: &mut Clients,
    ) {
        let sent = self.forward(workers, lanes, counters);
        if sent.certs_changed {
            *template = Template::new(template.handoff.clone(), self.table());
        }
        for (client, line) in sent.renewals_over {
            control.answer(client, &line);
        }
    }
}

/// `ringmux acme renew [NAME]` from control client `client`, to `relay` (`None`: no site
/// takes its certificate from ACME): told it renews, or answered why not.
pub fn renew_request(
    relay: Option<&mut Relay>,
    client: u64,
    name: Option<String>,
    control: &mut Clients,
) {
    let refused = match relay {
        None => Some("no site takes its certificate from ACME (acme = true)".to_string()),
        Some(r) => r
            .renew(client, name.as_deref())
            .err()
            .map(|e| e.to_string()),
    };
    match refused {
        None => control.tell(client, "renewing"),
        Some(why) => control.answer(client, &format!("error: {why}")),
    }
}
