//! The engine's thread: every [`STATE_POLL_INTERVAL`] it re-reads the state directory (the
//! certificates and challenges other nodes wrote), starts the orders that are due (each under
//! its site's lock), carries out the schedule's decisions after each one, and publishes the
//! view and the status for the demux's end ([`super::Acme`]), ringing its eventfd when either
//! changed.
//!
//! It owns the sites' state; the demux's end owns nothing but the published copies. Orders and
//! renewal-information requests run as futures on the thread's one runtime, several at once.

use std::collections::{BTreeMap, BTreeSet};
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use futures_util::future::LocalBoxFuture;
use futures_util::stream::FuturesUnordered;
use futures_util::{FutureExt, StreamExt};
use instant_acme::{Account, CertificateIdentifier};
use ringmux_proto::ChallengeSet;
use rustls::pki_types::CertificateDer;
use tokio::sync::mpsc::UnboundedReceiver;
use tokio::sync::{Notify, OnceCell};

use super::challenge::{Answer, ChallengeError, ChallengeFile};
use super::https::CaClient;
use super::order::{self, Failure, Job};
use super::schedule::{Jitter, SiteSchedule, Validity, Window};
use super::store::{self, Attempt, CertRefused, Certificate, Stamp, Store};
use super::{
    AcmeSettings, AcmeSite, AcmeStatus, AcmeView, Pacing, RenewError, SiteStatus,
    STATE_POLL_INTERVAL,
};
use crate::sys::{self, LockedFile};

/// Orders run at once, at most (a CA limits new orders per account; Let's Encrypt's limit is
/// hundreds per few hours, far above this).
const MAX_ORDERS: usize = 4;
/// Tickets of [`super::Acme::renew`] remembered after they completed.
const MAX_TICKETS: usize = 1024;
/// How often renewal information is asked again after a failure to get it.
const ARI_RETRY: Duration = Duration::from_secs(3600);

/// What the engine and the demux's end share: the published view, status and tickets, and
/// the eventfd rung when they change.
pub(super) struct Shared {
    pub wake: sys::Bell,
    pub published: Mutex<Published>,
}

#[derive(Default)]
pub(super) struct Published {
    pub view: AcmeView,
    pub status: AcmeStatus,
    /// The sites as last set: [`super::Acme::renew`] finds names in them.
    pub sites: Vec<AcmeSite>,
    /// `None` while the renewal runs. Written by both ends: the demux's end adds a ticket,
    /// the engine completes it.
    pub tickets: BTreeMap<u64, Option<Result<Vec<usize>, RenewError>>>,
    pub next_ticket: u64,
}

impl Published {
    /// Forgets the oldest completed tickets beyond [`MAX_TICKETS`].
    pub fn trim_tickets(&mut self) {
        while self.tickets.len() > MAX_TICKETS {
            let Some(oldest) = self
                .tickets
                .iter()
                .find(|(_, r)| r.is_some())
                .map(|(id, _)| *id)
            else {
                break;
            };
            self.tickets.remove(&oldest);
        }
    }
}

/// From the demux's end.
pub(super) enum Command {
    SetSites(Vec<AcmeSite>),
    Renew { ticket: u64, labels: Vec<String> },
}

pub(super) struct Engine {
    settings: Arc<AcmeSettings>,
    pacing: Pacing,
    store: Arc<Store>,
    client: CaClient,
    /// The account, loaded or made by the first order (or the first renewal-information
    /// request) that needs it.
    account: Arc<OnceCell<Account>>,
    shared: Arc<Shared>,
    sites: Vec<SiteState>,
    challenges: BTreeMap<String, Seen>,
    challenges_version: u64,
    /// The last version given to a certificate.
    versions: u64,
    orders_issued: u64,
    orders_failed: u64,
    /// Challenge files read whose name no ACME site of this node has (never answered).
    foreign_challenges: u64,
    tickets: BTreeMap<u64, Ticket>,
    finished_tickets: Vec<(u64, Result<Vec<usize>, RenewError>)>,
    /// The CA's directory has no `renewalInfo` (RFC 9773 §3): renew by the third rule only.
    ari_absent: bool,
    account_loading: bool,
    account_retry: SystemTime,
    challenges_changed: Arc<Notify>,
    view_dirty: bool,
    last_status: Option<AcmeStatus>,
    /// True during [`Engine::new`] only: the one read at which a certificate without a seal
    /// (an older ringmux's) is adopted (see `seal`).
    starting: bool,
}

struct SiteState {
    site: AcmeSite,
    /// Why this site is never ordered for (a first name that cannot name files, or one that
    /// another ACME site has too).
    refused: Option<String>,
    schedule: SiteSchedule,
    /// What the site serves: the last certificate that covered its names.
    cert: Option<Certificate>,
    version: u64,
    cert_stamp: Option<(Stamp, Stamp)>,
    attempt_stamp: Option<Stamp>,
    last_error: Option<String>,
    running: bool,
    ari_at: SystemTime,
    ari_running: bool,
}

/// A challenge file as last read.
struct Seen {
    stamp: Stamp,
    expires: u64,
    answer: Option<Answer>,
}

struct Ticket {
    waiting: BTreeSet<String>,
    renewed: Vec<usize>,
    error: Option<RenewError>,
}

enum Done {
    Order {
        label: String,
        result: Result<Certificate, Failure>,
        /// Released once the outcome is written.
        lock: LockedFile,
    },
    Ari {
        label: String,
        serial: String,
        result: Result<(Window, Duration), AriError>,
    },
    Account(Result<(), Failure>),
}

enum AriError {
    Unsupported,
    Other(String),
}

enum Event {
    Command(Option<Command>),
    Done(Done),
    ChallengesChanged,
    Poll,
}

impl Engine {
    /// Reads the state directory for `sites` and publishes the first view and status, before
    /// the thread starts.
    pub fn new(
        settings: AcmeSettings,
        pacing: Pacing,
        sites: Vec<AcmeSite>,
        store: Store,
        client: CaClient,
        shared: Arc<Shared>,
    ) -> Engine {
        let mut engine = Engine {
            settings: Arc::new(settings),
            pacing,
            store: Arc::new(store),
            client,
            account: Arc::new(OnceCell::new()),
            shared,
            sites: Vec::new(),
            challenges: BTreeMap::new(),
            challenges_version: 0,
            versions: 0,
            orders_issued: 0,
            orders_failed: 0,
            foreign_challenges: 0,
            tickets: BTreeMap::new(),
            finished_tickets: Vec::new(),
            ari_absent: false,
            account_loading: false,
            account_retry: SystemTime::UNIX_EPOCH,
            challenges_changed: Arc::new(Notify::new()),
            view_dirty: true,
            last_status: None,
            starting: true,
        };
        let now = SystemTime::now();
        engine.set_sites(sites, now);
        engine.starting = false;
        engine.scan_challenges(now);
        engine.publish(now);
        engine
    }

    /// Runs until the demux's end is dropped; orders still running are dropped with it (their
    /// challenge files removed, their locks released).
    pub async fn run(mut self, mut commands: UnboundedReceiver<Command>) {
        let mut tasks: FuturesUnordered<LocalBoxFuture<'static, Done>> = FuturesUnordered::new();
        let mut poll = tokio::time::interval(STATE_POLL_INTERVAL);
        poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let changed = self.challenges_changed.clone();
        loop {
            let event = tokio::select! {
                c = commands.recv() => Event::Command(c),
                Some(done) = tasks.next(), if !tasks.is_empty() => Event::Done(done),
                _ = changed.notified() => Event::ChallengesChanged,
                _ = poll.tick() => Event::Poll,
            };
            let now = SystemTime::now();
            match event {
                Event::Command(None) => break,
                Event::Command(Some(Command::SetSites(sites))) => self.set_sites(sites, now),
                Event::Command(Some(Command::Renew { ticket, labels })) => {
                    self.renew(ticket, labels)
                }
                Event::Done(done) => self.finished(done, now),
                Event::ChallengesChanged => self.scan_challenges(now),
                Event::Poll => {
                    self.scan_challenges(now);
                    for i in 0..self.sites.len() {
                        self.refresh_site(i, now);
                    }
                }
            }
            self.start_orders(now, &mut tasks);
            self.start_ari(now, &mut tasks);
            self.publish(now);
        }
    }

    // -----------------------------------------------------------------------------------------
    // Sites and the state directory
    // -----------------------------------------------------------------------------------------

    fn set_sites(&mut self, sites: Vec<AcmeSite>, now: SystemTime) {
        let mut old: BTreeMap<String, SiteState> = std::mem::take(&mut self.sites)
            .into_iter()
            .map(|s| (s.site.label.clone(), s))
            .collect();
        let mut labels = BTreeSet::new();
        for site in sites {
            let fresh = !old.contains_key(&site.label);
            let mut state = old.remove(&site.label).unwrap_or_else(|| SiteState {
                site: site.clone(),
                refused: None,
                schedule: SiteSchedule::default(),
                cert: None,
                version: 0,
                cert_stamp: None,
                attempt_stamp: None,
                last_error: None,
                running: false,
                ari_at: SystemTime::UNIX_EPOCH,
                ari_running: false,
            });
            state.refused = if !store::is_safe_label(&site.label) {
                Some(format!(
                    "its first name {:?} cannot name a file of the state directory",
                    site.label
                ))
            } else if !labels.insert(site.label.clone()) {
                Some(format!(
                    "another ACME site has the first name {} too",
                    site.label
                ))
            } else {
                None
            };
            if state.site.site != site.site {
                // The supervisor numbers certificates by site index: a moved site's is new.
                self.versions += 1;
                state.version = self.versions;
                self.view_dirty = true;
            }
            let names_changed = state.site.names != site.names;
            state.site = site;
            self.sites.push(state);
            let i = self.sites.len() - 1;
            if fresh {
                self.refresh_site(i, now);
            } else if names_changed {
                // A failure under the old names is not held against the new ones.
                self.sites[i].schedule.forget_failures();
                self.sites[i].last_error = None;
                self.reschedule(i, now);
            }
        }
        // Sites gone: their tickets end.
        for label in old.into_keys() {
            self.ticket_progress(&label, Err(Failure::new("no longer an ACME site")));
        }
        self.view_dirty = true;
    }

    /// Re-reads a site's files if they changed since last read: a new certificate (another
    /// node's, or one put there by hand) and another node's record of failures.
    fn refresh_site(&mut self, i: usize, now: SystemTime) {
        let site = &mut self.sites[i];
        if site.refused.is_some() {
            return;
        }
        let label = site.site.label.clone();
        let stamp = self.store.cert_stamp(&label);
        if stamp != site.cert_stamp {
            site.cert_stamp = stamp;
            if stamp.is_some() {
                match self.store.read_cert(&label) {
                    Ok(Some(cert)) => self.adopt_cert(i, cert, now),
                    Ok(None) => {}
                    // Written by a ringmux from before the seal: served from the start so
                    // that the site stays up through the upgrade, and ordered for at once as
                    // if the site had none (the back-off holds if the CA fails).
                    Err(CertRefused::Unsealed(cert)) if self.starting => {
                        tracing::warn!(
                            site = %label,
                            serial = %cert.issued.serial,
                            "ACME: the stored certificate carries no seal (written by an older \
                             ringmux, or not by a demux): served until a new one is issued, \
                             which is ordered now"
                        );
                        self.adopt_cert(i, *cert, now);
                        self.sites[i].schedule.certificate(None);
                    }
                    Err(CertRefused::Unsealed(_)) => self.store.refuse_unsealed_cert(&label),
                    // Counted and logged by the store.
                    Err(CertRefused::Forged(_)) => {}
                    // Also the moment between the two renames of a write: the next change
                    // of either file is read again.
                    Err(CertRefused::Bad(why)) => {
                        tracing::debug!(site = %label, error = %why, "ACME: stored certificate not usable")
                    }
                }
            }
        }
        let site = &mut self.sites[i];
        let stamp = self.store.attempt_stamp(&label);
        if stamp != site.attempt_stamp {
            site.attempt_stamp = stamp;
            if let (false, Some(a)) = (site.running, self.store.read_attempt(&label)) {
                let fingerprint = self.settings.fingerprint(&site.site.names);
                if !a.config.is_empty() && a.config != fingerprint {
                    // Failed under another configuration: not held against this one.
                    if self.starting {
                        tracing::info!(
                            site = %label,
                            failures = a.failures,
                            "ACME: a failed order recorded under another configuration of the \
                             site (names or [acme]) is forgotten: ordering now"
                        );
                    }
                    return;
                }
                let retry_at = store::from_unix_secs(a.retry_at);
                if self.starting && retry_at > now {
                    tracing::warn!(
                        site = %label,
                        failures = a.failures,
                        error = %a.error,
                        next_attempt = %httpdate::fmt_http_date(retry_at),
                        "ACME: the back-off of a failed order is kept from before: the next \
                         attempt waits until then; `ringmux acme renew {label}` orders now"
                    );
                }
                site.schedule.adopt(a.failures, retry_at);
                site.last_error = Some(a.error);
            }
        }
    }

    /// A certificate read from the state directory: served if it covers the site's names and
    /// is valid now, and not the one served already.
    fn adopt_cert(&mut self, i: usize, cert: Certificate, now: SystemTime) {
        let site = &mut self.sites[i];
        if site.cert.as_ref().is_some_and(|c| c.issued == cert.issued) {
            return;
        }
        if let Err(why) = cert.fits(&site.site.names, now) {
            tracing::debug!(site = %site.site.label, serial = %cert.issued.serial, why = %why, "ACME: stored certificate not used");
            return;
        }
        site.schedule.certificate(Some(validity(&cert)));
        site.cert = Some(cert);
        site.last_error = None;
        self.versions += 1;
        site.version = self.versions;
        site.ari_at = SystemTime::UNIX_EPOCH;
        self.view_dirty = true;
    }

    /// The site's names changed: its certificate counts for the schedule only if it still
    /// covers them all (it is still served for the names it covers until a new one comes).
    fn reschedule(&mut self, i: usize, now: SystemTime) {
        let site = &mut self.sites[i];
        let fits = site
            .cert
            .as_ref()
            .filter(|c| c.fits(&site.site.names, now).is_ok())
            .map(validity);
        site.schedule.certificate(fits);
    }

    /// Re-reads `challenges/`: new files are read (and their answers made), changed ones
    /// read again, gone and stale ones dropped (a stale file is removed: its order is over).
    fn scan_challenges(&mut self, now: SystemTime) {
        let files = match self.store.challenge_files() {
            Ok(f) => f,
            Err(e) => {
                tracing::debug!(error = %e, "ACME: cannot list the challenges");
                return;
            }
        };
        let now_secs = store::unix_secs(now);
        let ours = self.our_names();
        let present: BTreeMap<String, Stamp> = files.into_iter().collect();
        let before = self.challenges.len();
        self.challenges
            .retain(|t, seen| present.get(t) == Some(&seen.stamp) && seen.expires > now_secs);
        let mut changed = self.challenges.len() != before;
        for (token, stamp) in present {
            if self.challenges.contains_key(&token) {
                continue;
            }
            let parsed = self
                .store
                .read_challenge(&token)
                .map_err(ChallengeError::Read)
                .and_then(|bytes| ChallengeFile::parse(&token, &bytes, now));
            let seen = match parsed {
                Ok(file) if !ours.contains(&file.name) => {
                    self.foreign_challenges += 1;
                    tracing::warn!(name = %file.name, token, "ACME: a challenge for a name no ACME site has: never answered");
                    Seen {
                        stamp,
                        expires: file.expires,
                        answer: None,
                    }
                }
                Ok(file) => Seen {
                    stamp,
                    expires: file.expires,
                    answer: file
                        .answer()
                        .inspect_err(|why| tracing::warn!(name = %file.name, error = %why, "ACME: challenge not answered"))
                        .ok(),
                },
                Err(why) => {
                    if matches!(why, ChallengeError::Stale) {
                        self.store.remove_challenge(&token);
                        continue;
                    }
                    tracing::debug!(token, error = %why, "ACME: challenge file not used");
                    // Remembered with no answer, so that it is not read again until it
                    // changes.
                    Seen {
                        stamp,
                        expires: u64::MAX,
                        answer: None,
                    }
                }
            };
            changed |= seen.answer.is_some();
            self.challenges.insert(token, seen);
        }
        if changed {
            self.challenges_version += 1;
            self.view_dirty = true;
        }
    }

    // -----------------------------------------------------------------------------------------
    // Orders
    // -----------------------------------------------------------------------------------------

    fn start_orders(
        &mut self,
        now: SystemTime,
        tasks: &mut FuturesUnordered<LocalBoxFuture<'static, Done>>,
    ) {
        let mut running = self.sites.iter().filter(|s| s.running).count();
        for i in 0..self.sites.len() {
            if running >= MAX_ORDERS {
                return;
            }
            let s = &self.sites[i];
            if s.refused.is_some() || s.running || !s.schedule.due(now) {
                continue;
            }
            let label = s.site.label.clone();
            let lock = match self.store.try_lock(&label) {
                Ok(Some(lock)) => lock,
                // Another node orders (or an order of ours that outlived a reload): its
                // certificate arrives by the polls.
                Ok(None) => continue,
                Err(e) => {
                    let f = Failure::new(format!(
                        "cannot take the lock {}/locks/{label}.lock: {e}",
                        self.store.root().display()
                    ));
                    self.order_failed(i, f, now);
                    continue;
                }
            };
            // Under the lock, what another node may have written just now.
            self.refresh_site(i, now);
            let s = &mut self.sites[i];
            if !s.schedule.due(now) {
                continue;
            }
            s.running = true;
            running += 1;
            let site = s.site.clone();
            tasks.push(Box::pin(self.order(site, lock)));
        }
    }

    fn order(&self, site: AcmeSite, lock: LockedFile) -> impl std::future::Future<Output = Done> {
        let settings = self.settings.clone();
        let store = self.store.clone();
        let client = self.client.clone();
        let cell = self.account.clone();
        let changed = self.challenges_changed.clone();
        let deadline = self.pacing.order_deadline;
        async move {
            let work = async {
                let account = cell
                    .get_or_try_init(|| order::account(&store, &settings, &client))
                    .await
                    .map_err(|mut f| {
                        f.retry_after = client.take_retry_after();
                        f
                    })?
                    .clone();
                let job = Job {
                    label: site.label.clone(),
                    names: site.names.clone(),
                    kind: settings.challenge,
                    store: store.clone(),
                    account,
                    client: client.clone(),
                    challenges_changed: changed,
                    settle: order::SETTLE,
                };
                order::run(&job).await
            };
            // A panic in the ACME client on what a CA sent fails this order, not the thread.
            let work = AssertUnwindSafe(work).catch_unwind();
            let result = match tokio::time::timeout(deadline, work).await {
                Ok(Ok(r)) => r,
                Ok(Err(panic)) => Err(Failure::new(format!(
                    "the ACME client failed on the CA's answer: {}",
                    panic_text(&panic)
                ))),
                Err(_) => Err(Failure::new(format!(
                    "the order took longer than {deadline:?}"
                ))),
            };
            Done::Order {
                label: site.label,
                result,
                lock,
            }
        }
    }

    fn finished(&mut self, done: Done, now: SystemTime) {
        match done {
            Done::Order {
                label,
                result,
                lock,
            } => {
                if let Some(i) = self.sites.iter().position(|s| s.site.label == label) {
                    self.sites[i].running = false;
                    match result {
                        Ok(cert) => self.order_issued(i, cert, now),
                        Err(f) => self.order_failed(i, f, now),
                    }
                }
                drop(lock);
            }
            Done::Ari {
                label,
                serial,
                result,
            } => self.ari_finished(&label, &serial, result, now),
            Done::Account(result) => {
                self.account_loading = false;
                if let Err(why) = result {
                    tracing::debug!(error = %why, "ACME: the stored account could not be loaded");
                    self.account_retry = now.checked_add(ARI_RETRY).unwrap_or(now);
                }
            }
        }
    }

    fn order_issued(&mut self, i: usize, cert: Certificate, now: SystemTime) {
        self.orders_issued += 1;
        let s = &mut self.sites[i];
        let label = s.site.label.clone();
        self.store.remove_attempt(&label);
        s.attempt_stamp = None;
        s.cert_stamp = self.store.cert_stamp(&label);
        tracing::info!(
            site = %label,
            names = %s.site.names.join(","),
            serial = %cert.issued.serial,
            not_after = %httpdate::fmt_http_date(cert.issued.not_after),
            "ACME certificate issued"
        );
        s.schedule.issued();
        let index = s.site.site;
        self.adopt_cert(i, cert, now);
        self.ticket_progress(&label, Ok(index));
    }

    fn order_failed(&mut self, i: usize, f: Failure, now: SystemTime) {
        self.orders_failed += 1;
        let backoff = self.pacing.backoff();
        let s = &mut self.sites[i];
        let label = s.site.label.clone();
        let at = s
            .schedule
            .failed(now, f.retry_after, &backoff, Jitter::random());
        let record = Attempt {
            failures: s.schedule.failures(),
            // Rounded up: adopting the record must not bring the retry forward.
            retry_at: store::unix_secs(at).saturating_add(1),
            error: f.text.clone(),
            config: self.settings.fingerprint(&s.site.names),
        };
        if let Err(e) = self.store.write_attempt(&label, &record) {
            tracing::warn!(site = %label, error = %e, "ACME: cannot record the failure in the state directory");
        }
        s.attempt_stamp = self.store.attempt_stamp(&label);
        tracing::warn!(
            site = %label,
            names = %s.site.names.join(","),
            error = %f.text,
            failures = s.schedule.failures(),
            next_attempt = %httpdate::fmt_http_date(at),
            "ACME order failed"
        );
        s.last_error = Some(f.text.clone());
        self.ticket_progress(&label, Err(f));
    }

    // -----------------------------------------------------------------------------------------
    // Renewal information (RFC 9773)
    // -----------------------------------------------------------------------------------------

    fn start_ari(
        &mut self,
        now: SystemTime,
        tasks: &mut FuturesUnordered<LocalBoxFuture<'static, Done>>,
    ) {
        if self.ari_absent {
            return;
        }
        let Some(account) = self.account.get().cloned() else {
            // Load the stored account (never make one just for this) once a site has a
            // certificate to ask about.
            let wanted = self.sites.iter().any(|s| s.cert.is_some());
            if wanted && !self.account_loading && self.account_retry <= now {
                self.account_loading = true;
                let (cell, store, settings, client) = (
                    self.account.clone(),
                    self.store.clone(),
                    self.settings.clone(),
                    self.client.clone(),
                );
                tasks.push(Box::pin(async move {
                    let loaded = cell
                        .get_or_try_init(|| async {
                            order::stored_account(&store, &settings, &client)
                                .await?
                                .ok_or_else(|| Failure::new("no stored account"))
                        })
                        .await;
                    Done::Account(loaded.map(drop))
                }));
            }
            return;
        };
        for s in &mut self.sites {
            let Some(cert) = &s.cert else { continue };
            if s.ari_running || s.ari_at > now {
                continue;
            }
            s.ari_running = true;
            let (label, serial) = (s.site.label.clone(), cert.issued.serial.clone());
            let leaf = CertificateDer::from(cert.leaf.clone());
            let account = account.clone();
            tasks.push(Box::pin(async move {
                let ask = async {
                    let id = CertificateIdentifier::try_from(&leaf).map_err(AriError::Other)?;
                    match account.renewal_info(&id).await {
                        Ok((info, retry)) => Ok((
                            Window {
                                start: unix_time(info.suggested_window.start.unix_timestamp()),
                                end: unix_time(info.suggested_window.end.unix_timestamp()),
                            },
                            retry,
                        )),
                        Err(instant_acme::Error::Unsupported(_)) => Err(AriError::Unsupported),
                        Err(e) => Err(AriError::Other(ringmux_proto::one_line(&e))),
                    }
                };
                let result = match AssertUnwindSafe(ask).catch_unwind().await {
                    Ok(r) => r,
                    Err(panic) => Err(AriError::Other(panic_text(&panic))),
                };
                Done::Ari {
                    label,
                    serial,
                    result,
                }
            }));
        }
    }

    fn ari_finished(
        &mut self,
        label: &str,
        serial: &str,
        result: Result<(Window, Duration), AriError>,
        now: SystemTime,
    ) {
        let Some(s) = self.sites.iter_mut().find(|s| s.site.label == label) else {
            return;
        };
        s.ari_running = false;
        let current = s.cert.as_ref().is_some_and(|c| c.issued.serial == serial);
        match result {
            Ok((window, retry)) => {
                if current {
                    s.schedule.renewal_window(window, Jitter::random());
                }
                // As the CA asks (its Retry-After), within a minute and a day.
                let retry = retry.clamp(Duration::from_secs(60), Duration::from_secs(86_400));
                s.ari_at = now.checked_add(retry).unwrap_or(now);
            }
            Err(AriError::Unsupported) => {
                tracing::info!(
                    directory = %self.settings.directory,
                    "ACME: the CA offers no renewal information (ARI): renewing when a third of a certificate's lifetime is left"
                );
                self.ari_absent = true;
            }
            Err(AriError::Other(why)) => {
                tracing::debug!(site = %label, error = %why, "ACME: no renewal information");
                s.ari_at = now.checked_add(ARI_RETRY).unwrap_or(now);
            }
        }
    }

    // -----------------------------------------------------------------------------------------
    // Forced renewals
    // -----------------------------------------------------------------------------------------

    fn renew(&mut self, ticket: u64, labels: Vec<String>) {
        let mut t = Ticket {
            waiting: BTreeSet::new(),
            renewed: Vec::new(),
            error: None,
        };
        for label in labels {
            match self.sites.iter_mut().find(|s| s.site.label == label) {
                Some(s) if s.refused.is_none() => {
                    s.schedule.force();
                    t.waiting.insert(label);
                }
                Some(s) => {
                    t.error.get_or_insert(RenewError::Site {
                        reason: s.refused.clone().unwrap_or_default(),
                        label,
                    });
                }
                None => {
                    t.error.get_or_insert(RenewError::Site {
                        label,
                        reason: "no longer an ACME site".into(),
                    });
                }
            }
        }
        if t.waiting.is_empty() {
            self.finished_tickets.push((ticket, t.result()));
        } else {
            self.tickets.insert(ticket, t);
        }
    }

    fn ticket_progress(&mut self, label: &str, outcome: Result<usize, Failure>) {
        let mut done = Vec::new();
        for (id, t) in &mut self.tickets {
            if !t.waiting.remove(label) {
                continue;
            }
            match &outcome {
                Ok(site) => t.renewed.push(*site),
                Err(why) => {
                    t.error.get_or_insert(RenewError::Site {
                        label: label.to_owned(),
                        reason: why.text.clone(),
                    });
                }
            }
            if t.waiting.is_empty() {
                done.push(*id);
            }
        }
        for id in done {
            if let Some(t) = self.tickets.remove(&id) {
                self.finished_tickets.push((id, t.result()));
            }
        }
    }

    // -----------------------------------------------------------------------------------------
    // Publishing
    // -----------------------------------------------------------------------------------------

    fn publish(&mut self, now: SystemTime) {
        let status = self.status(now);
        let status_changed = self.last_status.as_ref() != Some(&status);
        if !self.view_dirty && !status_changed && self.finished_tickets.is_empty() {
            return;
        }
        let view = self.view_dirty.then(|| self.view());
        {
            let mut p = match self.shared.published.lock() {
                Ok(p) => p,
                Err(poisoned) => poisoned.into_inner(),
            };
            if let Some(view) = view {
                p.view = view;
            }
            p.status = status.clone();
            for (id, result) in self.finished_tickets.drain(..) {
                p.tickets.insert(id, Some(result));
            }
            p.trim_tickets();
        }
        self.view_dirty = false;
        self.last_status = Some(status);
        self.shared.wake.ring();
    }

    fn view(&self) -> AcmeView {
        let mut certs: Vec<_> = self
            .sites
            .iter()
            .filter_map(|s| {
                s.cert
                    .as_ref()
                    .map(|c| (s.site.site, s.version, c.issued.clone()))
            })
            .collect();
        certs.sort_by_key(|(site, _, _)| *site);
        // Only challenges for a name of one of this node's ACME sites reach the workers: a
        // sealed file for another name (another node's configuration) is never answered here.
        let ours = self.our_names();
        let mut challenges = ChallengeSet::default();
        for seen in self.challenges.values() {
            match &seen.answer {
                Some(Answer::Http01(h)) if ours.contains(h.name.as_str()) => {
                    challenges.http01.push(h.clone())
                }
                Some(Answer::TlsAlpn01(t)) if ours.contains(t.name.as_str()) => {
                    challenges.tls_alpn01.push(t.clone())
                }
                _ => {}
            }
        }
        AcmeView {
            certs,
            challenges_version: self.challenges_version,
            challenges,
        }
    }

    /// Every name of the ACME sites that are ordered for, lower case.
    fn our_names(&self) -> BTreeSet<String> {
        self.sites
            .iter()
            .filter(|s| s.refused.is_none())
            .flat_map(|s| s.site.names.iter().map(|n| n.to_ascii_lowercase()))
            .collect()
    }

    fn status(&self, now: SystemTime) -> AcmeStatus {
        AcmeStatus {
            orders_issued: self.orders_issued,
            orders_failed: self.orders_failed,
            state_refused: self.store.refused(),
            foreign_challenges: self.foreign_challenges,
            sites: self
                .sites
                .iter()
                .map(|s| SiteStatus {
                    label: s.site.label.clone(),
                    names: s.site.names.clone(),
                    not_after: s.cert.as_ref().map(|c| c.issued.not_after),
                    last_error: s.refused.clone().or_else(|| s.last_error.clone()),
                    // None while an order runs or is about to.
                    next_attempt: match s.schedule.next_attempt() {
                        t if s.refused.is_none() && !s.running && t > now => Some(t),
                        _ => None,
                    },
                })
                .collect(),
        }
    }
}

impl Ticket {
    fn result(self) -> Result<Vec<usize>, RenewError> {
        match self.error {
            Some(e) => Err(e),
            None => Ok(self.renewed),
        }
    }
}

impl Pacing {
    fn backoff(&self) -> super::schedule::Backoff {
        super::schedule::Backoff {
            base: self.backoff_base,
            cap: self.backoff_cap,
            ..Default::default()
        }
    }
}

fn validity(c: &Certificate) -> Validity {
    Validity {
        not_before: c.issued.not_before,
        not_after: c.issued.not_after,
    }
}

/// What a panic said.
fn panic_text(panic: &Box<dyn std::any::Any + Send>) -> String {
    match (panic.downcast_ref::<&str>(), panic.downcast_ref::<String>()) {
        (Some(s), _) => s.to_string(),
        (_, Some(s)) => s.clone(),
        _ => "a panic".into(),
    }
}

/// Seconds since the epoch from a CA (negative: the epoch).
fn unix_time(secs: i64) -> SystemTime {
    store::from_unix_secs(u64::try_from(secs).unwrap_or(0))
}
