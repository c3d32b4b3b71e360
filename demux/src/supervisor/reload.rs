//! `ringmux reload` (and SIGHUP) apart from the policy's part in it: what the next generation
//! starts with ([`next_generation`]: the command line, its configuration file and
//! certificates read again and checked as a start checks them), whether a reload would start
//! one (`ringmux reload --check`, [`check_line`]), taking it as the running configuration
//! ([`Next::apply`]), and the clients waiting for the outcome and what they are told
//! ([`Reloads`], [`Waiters`]). When the new generation starts and the old one drains is
//! [`super::policy`]'s.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use super::acme;
use super::control::{Clients, ControlServer};
use super::policy::{Action, Event, Failure, Limits, Policy, Refusal, CUT_WAIT};
use super::spawn::{worker_domain, Template};
use super::workers::Worker;
use crate::config::Config;
use crate::metrics::Counters;
use crate::sys;

/// What a reload starts the next generation with.
pub struct Next {
    pub cfg: Config,
    pub template: Template,
    /// The workers' Landlock ruleset made from it (its site roots and settings).
    pub domain: Option<sys::WorkerDomain>,
}

/// The running configuration a [`Next`] replaces, borrowed from the supervisor.
pub struct Running<'a> {
    pub cfg: &'a mut Config,
    pub template: &'a mut Template,
    pub domain: &'a mut Option<sys::WorkerDomain>,
    pub acme: Option<&'a mut acme::Relay>,
    pub policy: &'a mut Policy,
    pub counters: &'a Counters,
}

/// What a reload now would start the next generation with, beside `running` (whose
/// `template` holds the certificate made at start, kept when the command line names none);
/// `acme`: the ACME client runs. `Err` says why not: a problem of the file, or an option
/// changed that only a restart applies.
pub fn next_generation(running: &Config, template: &Template, acme: bool) -> Result<Next> {
    let (cfg, template) = next_configuration(running, template, acme)?;
    let domain = worker_domain(&cfg)?;
    Ok(Next {
        cfg,
        template,
        domain,
    })
}

/// The answer to `ringmux reload --check`: whether a reload now would start a new
/// generation ([`next_generation`]), nothing started.
pub fn check_line(running: &Config, template: &Template, acme: bool) -> String {
    let file = match &running.args.config {
        Some(path) => path.display().to_string(),
        None => "no configuration file".to_string(),
    };
    match next_generation(running, template, acme) {
        Ok(_) => format!("ok: a reload would start a new generation from {file}"),
        Err(why) => format!("error: a reload would be refused ({file}): {why:#}"),
    }
}

/// The configuration and worker template of [`next_generation`].
fn next_configuration(
    running: &Config,
    template: &Template,
    acme: bool,
) -> Result<(Config, Template)> {
    let cli = crate::config::parse()?;
    let cfg = cli.run.validate()?;
    let changed = running.restart_needed(&cfg);
    if !changed.is_empty() {
        bail!(
            "{} changed, which only a restart applies: restart ringmux for it, or undo the \
             change",
            changed.join(", ")
        );
    }
    if !acme && cfg.sites.iter().flat_map(|t| &t.sites).any(|s| s.acme) {
        bail!(
            "a site with acme = true, where none had it at start: the ACME client starts \
             with ringmux; restart ringmux for it"
        );
    }
    let sites = match &cfg.sites {
        Some(sites) => sites.clone(),
        None => {
            let cert = match (&cfg.args.cert, &cfg.args.key) {
                (Some(c), Some(k)) => crate::certs::load(c, k).context("--cert / --key")?,
                // The self-signed certificate made at start, kept.
                _ => match template.sites.sites.iter().find(|s| s.names.is_empty()) {
                    Some(s) => crate::certs::CertPem {
                        chain: s.cert_pem.clone(),
                        key: s.key_pem.clone(),
                    },
                    None => crate::certs::CertPem::self_signed()?,
                },
            };
            cfg.site_table(cert)
        }
    };
    let template = Template::new(template.handoff.clone(), &sites);
    Ok((cfg, template))
}

impl Next {
    /// Takes this as the running configuration: the next generation starts from it. The ACME
    /// relay fills its sites with the certificates it has; a new `--grace` applies to the
    /// drains under way too, a new `--max-draining` at the next activation; the access log is
    /// opened again at its path.
    pub fn apply(self, running: Running<'_>) {
        let Next {
            cfg,
            mut template,
            domain,
        } = self;
        *running.domain = domain;
        if let Some(relay) = running.acme {
            let mut table = template.sites.clone();
            relay.reconfigure(&mut table);
            template = Template::new(template.handoff, &table);
        }
        crate::metrics::counters::set_certificates(running.counters, &template.sites);
        if let Ok(mut p) = running.counters.program.write() {
            *p = cfg.worker_label();
        }
        running.policy.set_limits(Limits::new(
            cfg.ready_timeout(),
            cfg.grace(),
            cfg.max_draining(),
        ));
        *running.cfg = cfg;
        *running.template = template;
        // Every access-log line from now on goes to the path as it is now: a log rotated
        // away is closed at once.
        match running.cfg.access_log().open() {
            Ok(log) => crate::logs::access_to(log),
            Err(e) => tracing::warn!(
                error = %format!("{e:#}"),
                "the access log did not open again; its lines go to the one open"
            ),
        }
    }
}

/// Why the policy refused to start a reload, in words.
pub fn refusal_line(refusal: &Refusal) -> String {
    match refusal {
        Refusal::Starting { generation } => format!(
            "a reload is under way (generation {generation} is starting); run it again once \
             that one is done"
        ),
        Refusal::ShuttingDown => "ringmux is shutting down".to_string(),
    }
}

/// Why the new generation's worker of `instance` failed, in words; `program`: what it runs,
/// `start_error`: why starting it failed last.
pub fn failure_line(
    why: Failure,
    instance: usize,
    program: &str,
    ready_timeout: Duration,
    start_error: Option<&str>,
) -> String {
    match why {
        Failure::Exited => format!(
            "instance {instance}'s new worker ({program}) exited before it reported READY (see \
             its log)"
        ),
        Failure::NotReady => format!(
            "instance {instance}'s new worker ({program}) did not report READY within \
             {ready_timeout:?} (--ready-timeout)"
        ),
        Failure::StartFailed => format!(
            "instance {instance}'s new worker could not be started: {}",
            start_error.unwrap_or_default()
        ),
        Failure::Shutdown => "a shutdown came first".to_string(),
    }
}

/// What the clients of a reload that waits for `draining`'s slot are told meanwhile.
pub fn waits_line(generation: u64, draining: u64) -> String {
    format!(
        "waiting: generation {generation} needs the connection-ID slot of generation \
         {draining}, the oldest draining one, which is cut and given {CUT_WAIT:?} to write its \
         logs and exit"
    )
}

/// The reloads' books: the control clients waiting on the reload under way ([`Waiters`]),
/// and why each lane's worker failed to start last, for the answer of a reload that failed of
/// it.
pub struct Reloads {
    pub waiters: Waiters,
    start_errors: Vec<Option<String>>,
}

/// What [`Reloads`] reads to answer, borrowed from the supervisor.
pub struct Books<'a> {
    pub cfg: &'a Config,
    pub policy: &'a Policy,
    pub counters: &'a Counters,
    pub workers: &'a [Worker],
    pub control: &'a mut Clients,
}

impl Reloads {
    /// The books of `lanes` lanes, no reload under way.
    pub fn new(lanes: usize) -> Reloads {
        Reloads {
            waiters: Waiters::default(),
            start_errors: vec![None; lanes],
        }
    }

    /// A reload asked for by control client `client` (or by SIGHUP): reads the command
    /// line's configuration file and certificates again, checked as a start checks them
    /// ([`next_generation`]), then lets the policy start the next generation with them, which
    /// becomes the `running` one. Refusals are counted, logged and answered on `control` at
    /// once, and the running configuration serves on; the client of a reload that goes ahead
    /// waits for its outcome. What the policy answers.
    pub fn request(
        &mut self,
        client: Option<u64>,
        running: Running<'_>,
        control: &mut Clients,
    ) -> Vec<Action> {
        let acme = running.acme.is_some();
        let next = match next_generation(running.cfg, running.template, acme) {
            Ok(next) => next,
            Err(why) => {
                tracing::error!(error = format!("{why:#}"), "reload refused");
                running
                    .counters
                    .reloads_failed
                    .fetch_add(1, Ordering::Relaxed);
                let active = running.policy.active();
                let line = format!("error: {why:#}; generation {active} serves on");
                control.answer(client, &line);
                return Vec::new();
            }
        };
        let actions = running.policy.on(Instant::now(), Event::Reload);
        if let Some(Action::ReloadRefused(r)) = actions.first() {
            let why = refusal_line(r);
            tracing::warn!(reason = %why, "reload refused");
            control.answer(client, &format!("error: {why}"));
            return Vec::new();
        }
        // The next generation starts from these.
        next.apply(running);
        self.waiters.join(control.server(), client);
        actions
    }

    /// Lane `lane`'s worker started (`None`), or why starting it failed.
    pub fn started(&mut self, lane: usize, error: Option<String>) {
        self.start_errors[lane] = error;
    }

    /// Tells the clients of a reload that succeeded (`ringmux reload`) once every worker of
    /// the replaced generation has said it accepts no new connection (`STOPPED`) or is gone,
    /// or at the latest after [`ringmux_proto::STOPPED_WAIT`] ([`Waiters::answer`]).
    pub fn answer(&mut self, books: &mut Books<'_>, now: Instant) {
        let Some(replaced) = self.waiters.replaced() else {
            return;
        };
        let lanes = books.policy.lanes_of(replaced);
        let stopped = books.workers[lanes]
            .iter()
            .all(|w| w.stopped || w.child.is_none());
        self.waiters.answer(books.control.server(), now, stopped);
    }

    /// Logs how a reload went (the policy's `action`) and tells whoever asked for it.
    pub fn report(&mut self, action: Action, books: &mut Books<'_>) {
        match action {
            Action::Reloaded {
                generation,
                replaced: old,
            } => {
                books.counters.reloads.fetch_add(1, Ordering::Relaxed);
                tracing::info!(generation, draining = old, "reload done");
                // Answered once the replaced workers accept no new connection.
                self.waiters.done(generation, old, Instant::now());
                self.answer(books, Instant::now());
            }
            Action::ReloadFailed {
                generation,
                instance,
                why,
            } => {
                books
                    .counters
                    .reloads_failed
                    .fetch_add(1, Ordering::Relaxed);
                let lane = books.policy.lanes_of(generation).start + instance;
                let why = failure_line(
                    why,
                    instance,
                    books.cfg.worker_program(),
                    books.cfg.ready_timeout(),
                    self.start_errors[lane].as_deref(),
                );
                let active = books.policy.active();
                tracing::error!(generation, reason = %why, serving = active, "reload failed");
                self.waiters.tell(
                    books.control.server(),
                    &format!(
                        "error: generation {generation} abandoned: {why}; generation {active} \
                         serves on"
                    ),
                    true,
                );
            }
            Action::ReloadWaits {
                generation,
                draining,
            } => {
                tracing::info!(
                    generation,
                    draining,
                    "reload waits for a generation to drain"
                );
                self.waiters.tell(
                    books.control.server(),
                    &waits_line(generation, draining),
                    false,
                );
            }
            _ => {}
        }
    }
}

/// The control clients waiting for the outcome of the reload under way, and the answer to a
/// reload that succeeded, held until the workers it replaced stopped accepting.
#[derive(Default)]
pub struct Waiters {
    clients: Vec<u64>,
    answer: Option<Answer>,
}

struct Answer {
    line: String,
    /// The generation replaced.
    replaced: u64,
    /// Answered by then whatever the workers said.
    until: Instant,
}

impl Waiters {
    /// `client` waits for the reload just started; the clients of an earlier one get their
    /// answer first.
    pub fn join(&mut self, control: Option<&mut ControlServer>, client: Option<u64>) {
        if let Some(pending) = self.answer.take() {
            self.tell(control, &pending.line, true);
        }
        self.clients.extend(client);
    }

    /// Tells every waiting client `line`; the last line closes them.
    pub fn tell(&mut self, control: Option<&mut ControlServer>, line: &str, last: bool) {
        let Some(c) = control else {
            return;
        };
        if last {
            for id in self.clients.drain(..) {
                c.answer(id, line);
            }
        } else {
            for &id in &self.clients {
                c.tell(id, line);
            }
        }
    }

    /// The reload to `generation` is done and `replaced` drains: its clients are answered
    /// once the replaced workers accept no new connection ([`Waiters::answer`]), or at the
    /// latest [`ringmux_proto::STOPPED_WAIT`] after `now`.
    pub fn done(&mut self, generation: u64, replaced: u64, now: Instant) {
        self.answer = Some(Answer {
            line: format!("ok generation={generation} (generation {replaced} drains)"),
            replaced,
            until: now + ringmux_proto::STOPPED_WAIT,
        });
    }

    /// The generation replaced by the reload whose answer waits, if one does.
    pub fn replaced(&self) -> Option<u64> {
        self.answer.as_ref().map(|a| a.replaced)
    }

    /// When the answer that waits is due at the latest.
    pub fn due(&self) -> Option<Instant> {
        self.answer.as_ref().map(|a| a.until)
    }

    /// Answers the reload that succeeded if its replaced workers have `stopped` accepting
    /// (each said `STOPPED` or is gone), or once it is due: so that a connection made after
    /// the answer reaches the new generation.
    pub fn answer(&mut self, control: Option<&mut ControlServer>, now: Instant, stopped: bool) {
        let Some(pending) = &self.answer else {
            return;
        };
        if !stopped && now < pending.until {
            return;
        }
        if !stopped {
            tracing::info!(
                generation = pending.replaced,
                "a replaced worker did not say it stopped accepting; answering the reload anyway"
            );
        }
        if let Some(pending) = self.answer.take() {
            self.tell(control, &pending.line, true);
        }
    }
}
