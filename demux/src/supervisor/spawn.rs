//! Starting one worker, decided apart from done. [`plan`] is a pure function of the
//! configuration, the lane and its generation, the workers' [`Template`] and what the
//! supervisor holds ([`Surroundings`]): the program and its arguments, the environment, the
//! descriptors the worker finds and in which order, its user, its confinement, the log pipes
//! it writes to. [`launch`] carries such a [`LaunchPlan`] out: it makes the sockets, pipes and
//! sealed memfd, forks, and sends the hand-off. It never decides, and the plan never opens,
//! forks or reads a clock; the supervisor (`mod.rs`) keeps the books around both.

use std::net::SocketAddr;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::sync::Arc;

use anyhow::{Context, Result};
use ringmux_proto::sites::SiteTable;
use ringmux_proto::{Handoff, IngressKind};

use super::filesystem;
use super::health::HealthTable;
use super::sandbox::{self, WorkerFilter};
use crate::config::{AccessLog, Config, Sandbox};
use crate::forward::IngressHandles;
use crate::sys::{self, ChildProcess};

/// What every worker's hand-off is made from: the message, and the site table each worker
/// gets a sealed copy of (`control-protocol.md`, "Sites").
#[derive(Clone, Debug)]
pub struct Template {
    pub handoff: Handoff,
    /// The site table, typed: serialised only as it is sealed into a worker's memfd
    /// ([`launch`]) or written into the upgrade state.
    pub sites: SiteTable,
    /// The labels of its sites, by the index a worker's report names them with.
    pub site_labels: Arc<[String]>,
    /// One rate table per instance when a site or route limits a rate
    /// (`ringmux_ring::tally`): fresh for each generation, as its rings are.
    pub rate_tables: Option<Arc<RateTables>>,
    /// The health table when a route checks its backends' health (`super::health`): fresh
    /// for each site table, as the rate tables are.
    pub health: Option<Arc<HealthTable>>,
}

impl Template {
    pub fn new(handoff: Handoff, sites: &SiteTable) -> Template {
        let rate_tables = match RateTables::needed(sites) {
            false => None,
            true => match RateTables::create(handoff.instances) {
                Ok(t) => Some(Arc::new(t)),
                Err(e) => {
                    // Each worker then counts alone (the server makes a table of its own).
                    tracing::warn!(error = %e, "no rate tables: each worker limits rates alone");
                    None
                }
            },
        };
        Template {
            handoff,
            sites: sites.clone(),
            site_labels: crate::metrics::counters::site_labels(sites),
            rate_tables,
            health: HealthTable::for_sites(sites),
        }
    }
}

/// The rate tables of a generation, one per instance, in instance order.
#[derive(Debug)]
pub struct RateTables(Vec<OwnedFd>);

impl PartialEq for RateTables {
    fn eq(&self, other: &Self) -> bool {
        std::ptr::eq(self, other)
    }
}

impl Eq for RateTables {}

impl RateTables {
    /// Whether any site or route of `sites` limits a rate.
    pub fn needed(sites: &SiteTable) -> bool {
        sites
            .sites
            .iter()
            .any(|s| s.limits.rate.is_some() || s.routes.iter().any(|r| r.limits.rate.is_some()))
    }

    /// A table per instance, all with one fresh hash key.
    fn create(instances: u8) -> std::io::Result<RateTables> {
        use std::hash::{BuildHasher, Hasher};
        let random = || {
            std::collections::hash_map::RandomState::new()
                .build_hasher()
                .finish()
        };
        let key = [random(), random()];
        let n = usize::from(instances).min(ringmux_proto::MAX_RATE_TABLES);
        let tables = (0..n)
            .map(|_| ringmux_ring::tally::create(key))
            .collect::<std::io::Result<_>>()?;
        Ok(RateTables(tables))
    }

    /// What the worker of `instance` is given: its own table as it is, then every other's
    /// read-only, in instance order from its own on.
    fn for_instance(&self, instance: u8) -> std::io::Result<Vec<OwnedFd>> {
        let n = self.0.len();
        let own = usize::from(instance);
        let Some(first) = self.0.get(own) else {
            return Ok(Vec::new());
        };
        let mut fds = vec![first.try_clone()?];
        for i in 1..n {
            fds.push(ringmux_ring::tally::read_only(&self.0[(own + i) % n])?);
        }
        Ok(fds)
    }
}

/// The listening TCP sockets the demux makes once and every worker accepts from.
#[derive(Debug, Default)]
pub struct TcpListeners {
    /// HTTPS (`--tcp on`): descriptor 5.
    pub https: Option<OwnedFd>,
    /// Plain HTTP, answered with redirects (`--redirect-http`): descriptor 6.
    pub redirect: Option<OwnedFd>,
}

/// What the supervisor holds that every start takes into account, as facts (the descriptors
/// and rulesets themselves go to [`launch`] in [`Held`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Surroundings {
    /// The public socket's address: a worker's own sending socket is bound to it.
    pub public: SocketAddr,
    /// The demux holds the HTTPS listener (descriptor 5) and the plain-HTTP one (6).
    pub tcp: bool,
    pub redirect: bool,
    /// Workers get an access-log pipe (`--access-log`), at their descriptor 7.
    pub access_log: bool,
    /// The workers are confined by a system-call filter (`--sandbox on` or `filter-only`).
    pub filter: bool,
    /// ... and enter a Landlock domain (`--sandbox on`, where the kernel has Landlock).
    pub landlock: bool,
    /// This process may empty a child's capability bounding set (`sys::may_drop_bounding_set`).
    pub may_drop_bounding_set: bool,
    /// The ACME relay runs: a new worker is sent the pending challenges.
    pub acme: bool,
}

/// The lane a worker starts in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Slot {
    pub lane: usize,
    pub instance: u8,
    /// Its worker generation (`Policy::lane`).
    pub generation: u64,
    /// The kind of ingress the data plane reset for it ([`ingress_kind`]).
    pub ingress: IngressKind,
}

/// A descriptor the worker finds from `ringmux_proto::FIRST_HANDOFF_FD` on, in plan order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Descriptor {
    /// Its ingress's descriptors, in `IngressHandles::hand_off` order (none under kernel
    /// steering: the lane's socket is its descriptor 4).
    Ingress,
    /// Its end of the session socket.
    Sessions,
    /// The sealed memfd with the site table's JSON.
    Sites,
}

/// The worker's descriptor 4, the socket it sends from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sending {
    /// The lane's socket of the public address's `SO_REUSEPORT` group (kernel steering): it
    /// receives on it too.
    LaneSocket,
    /// A socket of its own, bound to the public address in its `SO_REUSEPORT` group.
    Own { bind: SocketAddr, sndbuf: usize },
}

/// How the worker is confined before its program starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Confinement {
    pub filter: bool,
    pub landlock: bool,
    /// Empty every capability set of the worker.
    pub drop_capabilities: bool,
    /// Empty its bounding set too.
    pub drop_bounding_set: bool,
}

/// Everything one start of a worker is made of, decided before anything is opened.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaunchPlan<'t> {
    pub lane: usize,
    pub instance: u8,
    pub program: String,
    /// The arguments after the program.
    pub args: Vec<String>,
    /// Variables of the demux's environment the worker does not inherit.
    pub env_removed: Vec<&'static str>,
    pub env: Vec<(&'static str, String)>,
    /// The hand-off message, but for what the ingress itself says (its kind and the ring's
    /// generation: `IngressHandles::hand_off` writes those).
    pub handoff: Handoff,
    pub descriptors: Vec<Descriptor>,
    pub sending: Sending,
    /// The user and group it runs as (`--worker-user`); `None`: the demux's.
    pub user: Option<(u32, u32)>,
    pub confinement: Confinement,
    /// A pipe for its standard output and error is always made; one for its access log
    /// (descriptor 7) with this.
    pub access_log: bool,
    /// The shared listeners it gets at descriptors 5 and 6.
    pub tcp: bool,
    pub redirect: bool,
    /// What the sealed memfd holds.
    pub sites: &'t SiteTable,
    /// The generation's rate tables, placed from `ringmux_proto::RATE_TABLES_FD` on.
    pub rate_tables: Option<&'t RateTables>,
    /// The health table, placed at `ringmux_proto::HEALTH_TABLE_FD`.
    pub health: Option<&'t HealthTable>,
    /// Send it the pending ACME challenges once it has its hand-off.
    pub acme_challenges: bool,
}

/// The plan of the worker `cfg` starts in `slot`, from `template`, around `around`.
pub fn plan<'t>(
    cfg: &Config,
    template: &'t Template,
    around: &Surroundings,
    slot: Slot,
) -> LaunchPlan<'t> {
    let mut handoff = template.handoff.clone();
    handoff.instance = slot.instance;
    handoff.worker_generation = slot.generation;
    handoff.cpu = cfg.worker_cpu(slot.instance);
    let sending = match slot.ingress {
        IngressKind::Reuseport => Sending::LaneSocket,
        IngressKind::Shm | IngressKind::Unix => Sending::Own {
            bind: around.public,
            sndbuf: cfg.args.sndbuf,
        },
    };
    let user = cfg.worker_user.as_ref().map(|u| (u.uid, u.gid));
    let mut env = vec![
        (
            ringmux_proto::CONTROL_FD_ENV,
            ringmux_proto::CONTROL_FD.to_string(),
        ),
        (
            ringmux_proto::PUBLIC_FD_ENV,
            ringmux_proto::PUBLIC_FD.to_string(),
        ),
    ];
    if let Some(tables) = &template.rate_tables {
        env.push((ringmux_proto::RATE_TABLES_ENV, tables.0.len().to_string()));
    }
    if template.health.is_some() {
        env.push((ringmux_proto::HEALTH_TABLE_ENV, "1".to_string()));
    }
    LaunchPlan {
        lane: slot.lane,
        instance: slot.instance,
        program: cfg.worker_program().to_string(),
        args: cfg.worker_cmd[1..].to_vec(),
        // What a previous image of the demux handed this one is nothing a worker needs.
        env_removed: vec![
            crate::upgrade::STATE_ENV,
            crate::upgrade::FALLBACK_ENV,
            crate::upgrade::REFUSED_ENV,
        ],
        env,
        handoff,
        descriptors: vec![Descriptor::Ingress, Descriptor::Sessions, Descriptor::Sites],
        sending,
        user,
        confinement: Confinement {
            filter: around.filter,
            landlock: around.landlock,
            // No confined worker holds a capability: one that runs as root keeps root's user
            // ID but none of root's capabilities, and one of an unprivileged ringmux none of
            // the ambient ones it was given (CAP_NET_BIND_SERVICE in the shipped unit).
            // A worker of another user holds none either: a ringmux that is not root keeps its
            // capabilities (CAP_SETUID among them) across the switch, filter or not.
            drop_capabilities: around.filter || user.is_some(),
            drop_bounding_set: around.filter && user.is_none() && around.may_drop_bounding_set,
        },
        access_log: around.access_log,
        tcp: around.tcp,
        redirect: around.redirect,
        sites: &template.sites,
        rate_tables: template.rate_tables.as_deref(),
        health: template.health.as_deref(),
        acme_challenges: around.acme,
    }
}

/// The kind of ingress `handles` are, as the hand-off names it.
pub fn ingress_kind(handles: &IngressHandles) -> IngressKind {
    match handles {
        IngressHandles::Shm(..) => IngressKind::Shm,
        IngressHandles::Unix(_) => IngressKind::Unix,
        IngressHandles::Reuseport(_) => IngressKind::Reuseport,
    }
}

/// What a [`launch`] uses that the supervisor holds: the shared listeners and the rulesets.
pub struct Held<'a> {
    pub tcp: &'a TcpListeners,
    pub filter: Option<&'a WorkerFilter>,
    pub domain: Option<&'a sys::WorkerDomain>,
}

/// What the supervisor keeps for every worker's start, made once (the Landlock ruleset again
/// at each reload): the public address, the TCP listeners, the access log, the confinement.
/// [`Launcher::start`] plans a lane's start ([`plan`]) and carries the plan out ([`launch`]).
pub struct Launcher {
    /// The public socket's address: every worker's sending socket is bound to it.
    pub public: SocketAddr,
    /// The listening TCP sockets every worker accepts from, at its descriptors 5 (`--tcp on`)
    /// and 6 (`--redirect-http`).
    pub tcp: TcpListeners,
    /// Whether workers get an access-log pipe (`--access-log`), at their descriptor 7. The
    /// log thread writes what comes through it; the file is opened again at every reload.
    pub access_log: bool,
    /// The workers' system-call filter; `None` with `--sandbox off`.
    pub filter: Option<WorkerFilter>,
    /// The Landlock ruleset each worker enters a domain of; `None` with `--sandbox off` or
    /// where the kernel has no Landlock.
    pub domain: Option<sys::WorkerDomain>,
}

impl Launcher {
    /// What the workers of `cfg` start with beside `public` and `tcp`: their filter and
    /// Landlock ruleset made (a right this kernel's Landlock leaves every worker is warned of).
    pub fn new(cfg: &Config, public: SocketAddr, tcp: TcpListeners) -> Result<Launcher> {
        let filter = worker_filter(cfg, tcp.redirect.is_some())?;
        let domain = worker_domain(cfg)?;
        if domain.is_some() {
            let abi = sys::landlock_abi().unwrap_or(0);
            for gap in sys::landlock_gaps(abi) {
                tracing::warn!(
                    landlock_abi = abi,
                    "this kernel's Landlock leaves one right to every worker: {gap}"
                );
            }
        }
        Ok(Launcher {
            public,
            tcp,
            access_log: cfg.access_log() != AccessLog::Off,
            filter,
            domain,
        })
    }

    /// Starts `slot`'s worker on `handles` as [`plan`] plans it from `cfg` and `template`
    /// (`acme`: the ACME relay runs); with whether it is to be sent the pending challenges.
    pub fn start(
        &self,
        cfg: &Config,
        template: &Template,
        slot: Slot,
        acme: bool,
        handles: IngressHandles,
    ) -> Result<(Launched, bool)> {
        let around = Surroundings {
            public: self.public,
            tcp: self.tcp.https.is_some(),
            redirect: self.tcp.redirect.is_some(),
            access_log: self.access_log,
            filter: self.filter.is_some(),
            landlock: self.domain.is_some(),
            may_drop_bounding_set: sys::may_drop_bounding_set(),
            acme,
        };
        let plan = plan(cfg, template, &around, slot);
        let held = Held {
            tcp: &self.tcp,
            filter: self.filter.as_ref(),
            domain: self.domain.as_ref(),
        };
        Ok((launch(&plan, handles, held)?, plan.acme_challenges))
    }
}

/// A worker started: its process and the demux's ends of what it was given.
pub struct Launched {
    pub child: ChildProcess,
    pub pidfd: Option<OwnedFd>,
    /// The demux's end of its control socket.
    pub control: OwnedFd,
    /// The demux's end of its session socket, to serve, and a duplicate of it to shut down
    /// when the worker dies.
    pub sessions: OwnedFd,
    pub sessions_dup: OwnedFd,
    /// Copies of the read ends of its log pipes (the log thread reads its own).
    pub pipes: crate::logs::WorkerPipes,
    /// The hand-off it was sent.
    pub handoff: Handoff,
}

/// Carries `plan` out on the ingress `handles`: makes its sockets, pipes and sealed memfd,
/// starts the program with its descriptors in place, hands their read ends to the log thread
/// and sends the hand-off. An error before the process exists leaves nothing behind; once it
/// exists nothing fails (a hand-off that cannot be sent kills it, and its death is handled
/// like any other).
pub fn launch(plan: &LaunchPlan<'_>, handles: IngressHandles, held: Held<'_>) -> Result<Launched> {
    let (ours, theirs) = sys::seqpacket_pair()?;
    let (sess_ours, sess_theirs) = sys::seqpacket_pair()?;
    // Before the process exists: nothing may fail between its start and its supervision.
    let sessions_dup = sess_ours.try_clone()?;
    let mut h = plan.handoff.clone();
    let mut fds: Vec<OwnedFd> = Vec::new();
    let mut own_socket = None;
    let mut sess_theirs = Some(sess_theirs);
    let mut handles = Some(handles);
    for d in &plan.descriptors {
        match d {
            Descriptor::Ingress => {
                if let Some(handles) = handles.take() {
                    // Descriptor 4 when the worker receives on its own socket.
                    own_socket = handles.hand_off(&mut h, &mut fds);
                }
            }
            Descriptor::Sessions => fds.extend(sess_theirs.take()),
            Descriptor::Sites => fds.push(
                sys::sealed_memfd(c"ringmux-sites", plan.sites.to_json().as_bytes())
                    .context("a memfd for the site table")?,
            ),
        }
    }
    let mut cmd = Command::new(&plan.program);
    cmd.args(&plan.args);
    for var in &plan.env_removed {
        cmd.env_remove(var);
    }
    for (var, value) in &plan.env {
        cmd.env(var, value);
    }
    cmd.stdin(Stdio::null());
    // Its standard output and error: a pipe of its own that the log thread reads, never
    // the demux's own standard error (which the worker could make non-blocking, fill, or
    // truncate); likewise its access log at descriptor 7.
    let (output, output_end) = sys::log_pipe().context("a pipe for the worker's output")?;
    cmd.stdout(Stdio::from(output_end.try_clone()?))
        .stderr(Stdio::from(output_end));
    let (access, access_end) = match plan.access_log {
        true => {
            let (r, w) = sys::log_pipe().context("a pipe for the worker's access log")?;
            (Some(r), Some(w))
        }
        false => (None, None),
    };
    let pipes = crate::logs::WorkerPipes {
        output: output.try_clone()?,
        access: access.as_ref().map(OwnedFd::try_clone).transpose()?,
    };
    if let Some((uid, gid)) = plan.user {
        // std switches user (and drops supplementary groups) before the pre-exec hook.
        cmd.uid(uid).gid(gid);
    }
    let socket = match (own_socket, plan.sending) {
        (Some(s), _) => s,
        (None, Sending::LaneSocket) => {
            anyhow::bail!("the lane's ingress brought no socket of its own to send from")
        }
        (None, Sending::Own { bind, sndbuf }) => sending_socket(bind, sndbuf)?,
    };
    let handoff: Vec<BorrowedFd<'_>> = fds.iter().map(|f| f.as_fd()).collect();
    let tables = match plan.rate_tables {
        Some(t) => t
            .for_instance(plan.instance)
            .context("the worker's rate tables")?,
        None => Vec::new(),
    };
    let rate_tables: Vec<BorrowedFd<'_>> = tables.iter().map(|f| f.as_fd()).collect();
    // A read-only description: the demux's own descriptor of the table is writable.
    let health = plan.health.map(|h| h.writer.read_only());
    let health = health.transpose().context("the worker's health table")?;
    let setup = sys::WorkerSetup {
        control: theirs.as_fd(),
        public: socket.as_fd(),
        handoff: &handoff,
        rate_tables: &rate_tables,
        health: health.as_ref().map(|f| f.as_fd()),
        tcp: held
            .tcp
            .https
            .as_ref()
            .filter(|_| plan.tcp)
            .map(|t| t.as_fd()),
        redirect: held
            .tcp
            .redirect
            .as_ref()
            .filter(|_| plan.redirect)
            .map(|t| t.as_fd()),
        access_log: access_end.as_ref().map(|t| t.as_fd()),
        domain: held.domain.filter(|_| plan.confinement.landlock),
        switched_user: plan.user.is_some(),
        cpu: h.cpu,
        filter: held.filter.filter(|_| plan.confinement.filter).cloned(),
        drop_capabilities: plan.confinement.drop_capabilities,
        drop_bounding_set: plan.confinement.drop_bounding_set,
    };
    sys::prepare_worker(&mut cmd, setup)
        .context("duplicating the worker's control and public sockets")?;
    let child = cmd
        .spawn()
        .with_context(|| format!("spawning {}", plan.program))?;
    // Known by its PID from here on: whichever image of the demux runs, it reaps it.
    let child = ChildProcess::from_pid(child.id());
    // The worker holds the only copies of its end now (`cmd` held one for the hook), and
    // of its pipes' write ends: once it is gone, the log thread reads their end.
    drop(cmd);
    drop(theirs);
    drop(access_end);
    crate::logs::watch(
        plan.lane,
        plan.instance,
        crate::logs::WorkerPipes { output, access },
    );
    let pidfd = sys::pidfd_open(child.id()).ok();
    // The descriptors are in place already (from FIRST_HANDOFF_FD on): the message alone.
    drop(handoff);
    if let Err(e) = sys::send_with_fds(ours.as_fd(), h.encode().as_bytes(), &[]) {
        // Most likely the program exited at once and closed its end. Either way it cannot
        // serve: make sure it is gone, and let its death be handled like any other (a crash,
        // or a new generation that failed to start).
        tracing::warn!(instance = plan.instance, error = %e, "could not send the hand-off; the worker exited at once?");
        let _ = child.kill();
    }
    drop(fds);
    Ok(Launched {
        child,
        pidfd,
        control: ours,
        sessions: sess_ours,
        sessions_dup,
        pipes,
        handoff: h,
    })
}

/// A worker's own sending socket on `bind`.
fn sending_socket(bind: SocketAddr, sndbuf: usize) -> Result<OwnedFd> {
    let s = sys::sending_socket(bind, sndbuf)
        .with_context(|| format!("a sending socket on {bind} for the worker"))?;
    // The send-side options quinn-udp gives any socket (no fragmentation, so path MTU
    // discovery works), as on the public socket: the worker's library leaves them as it
    // finds them.
    quinn_udp::UdpSocketState::new(quinn_udp::UdpSockRef::from(&s))
        .context("quinn-udp's options on the worker's sending socket")?;
    Ok(s)
}

/// The system-call filter the workers `cfg` starts are confined by; `None` with
/// `--sandbox off`. `redirect`: the demux holds a plain-HTTP listener for them.
pub fn worker_filter(cfg: &Config, redirect: bool) -> Result<Option<WorkerFilter>> {
    Ok(match cfg.args.sandbox {
        Sandbox::On | Sandbox::FilterOnly => Some(WorkerFilter::compile(
            cfg.args.forward.workers_receive(),
            sandbox::Shared {
                tcp: cfg.args.tcp_on(),
                redirect,
            },
        )?),
        Sandbox::Off => None,
    })
}

/// The Landlock ruleset the workers `cfg` starts enter a domain of each: its allow-list
/// ([`filesystem::allow_list`]), with `--sandbox on`; `None` otherwise. Fails where the kernel
/// has no Landlock (the configuration's check refuses that first) or a path of the list
/// cannot be opened.
pub fn worker_domain(cfg: &Config) -> Result<Option<sys::WorkerDomain>> {
    if cfg.args.sandbox != Sandbox::On {
        return Ok(None);
    }
    let access = filesystem::allow_list(cfg);
    let domain = sys::worker_domain(&access)
        .context("creating the workers' Landlock ruleset")?
        .context(
            "this kernel has no Landlock: set --sandbox / RINGMUX_SANDBOX=filter-only to run \
             the workers under the system-call filter alone",
        )?;
    tracing::info!(
        read_execute = ?access.run,
        read = ?access.read,
        write = ?access.write,
        "workers enter Landlock domains of their own: the file system beyond these is closed to them"
    );
    Ok(Some(domain))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use ringmux_proto::sites::Site;

    use super::*;
    use crate::config::WorkerUser;

    /// A checked configuration whose workers run `/bin/true --flag x` as ringmux's user.
    fn config(args: &[&str]) -> Config {
        let mut argv = vec![
            "ringmux",
            "--worker-cmd",
            "/bin/true --flag x",
            "--worker-user",
            "self",
        ];
        argv.extend_from_slice(args);
        crate::config::parse_from(argv.into_iter().map(Into::into).collect())
            .expect("a valid command line")
            .run
            .validate()
            .expect("a valid configuration")
    }

    fn template() -> Template {
        let handoff = Handoff {
            instance: 0,
            instances: 2,
            generation: 1,
            worker_generation: 1,
            ingress: IngressKind::default(),
            spin: Default::default(),
            public_addr: "127.0.0.1:4433".parse().unwrap(),
            tcp: false,
            redirect: false,
            access_log: false,
            config_id: 0,
            node_id: vec![1],
            nonce_len: 12,
            encrypt_cids: true,
            keys: vec![7; 4],
            cid_lifetime: None,
            cpu: None,
            idle_timeout: Duration::from_secs(30),
            alt_svc: None,
        };
        let site = Site {
            label: "example".into(),
            names: vec!["example.test".into()],
            redirect_names: vec![],
            compress: None,
            rules: Default::default(),
            cert_pem: String::new(),
            key_pem: String::new(),
            acme: false,
            routes: vec![],
            limits: Default::default(),
        };
        let sites = SiteTable {
            sites: vec![site],
            default_site: Some(0),
        };
        Template::new(handoff, &sites)
    }

    /// A plain demux: no listeners, no access log, no sandbox, no ACME.
    fn around() -> Surroundings {
        Surroundings {
            public: "127.0.0.1:4433".parse().unwrap(),
            tcp: false,
            redirect: false,
            access_log: false,
            filter: false,
            landlock: false,
            may_drop_bounding_set: true,
            acme: false,
        }
    }

    fn slot(lane: usize, instance: u8, generation: u64, ingress: IngressKind) -> Slot {
        Slot {
            lane,
            instance,
            generation,
            ingress,
        }
    }

    #[test]
    fn a_worker_runs_the_program_with_its_arguments_and_none_of_the_upgrade_variables() {
        let (cfg, t) = (config(&[]), template());
        let p = plan(&cfg, &t, &around(), slot(0, 0, 1, IngressKind::Shm));
        assert_eq!(p.program, "/bin/true");
        assert_eq!(p.args, ["--flag", "x"]);
        for var in [
            crate::upgrade::STATE_ENV,
            crate::upgrade::FALLBACK_ENV,
            crate::upgrade::REFUSED_ENV,
        ] {
            assert!(p.env_removed.contains(&var), "{var} is passed on");
        }
        assert_eq!(
            p.env,
            [
                (
                    ringmux_proto::CONTROL_FD_ENV,
                    ringmux_proto::CONTROL_FD.to_string()
                ),
                (
                    ringmux_proto::PUBLIC_FD_ENV,
                    ringmux_proto::PUBLIC_FD.to_string()
                ),
            ]
        );
        assert_eq!(p.user, None);
    }

    #[test]
    fn the_hand_off_names_the_instance_its_generation_and_cpu_and_the_ingress_comes_first() {
        let cfg = config(&["--instances", "2", "--cpus", "0,5,6"]);
        let t = template();
        // Lane 3 is instance 1 of generation slot 1 (generation 2).
        let p = plan(&cfg, &t, &around(), slot(3, 1, 2, IngressKind::Unix));
        assert_eq!((p.lane, p.instance), (3, 1));
        assert_eq!(p.handoff.instance, 1);
        assert_eq!(p.handoff.worker_generation, 2);
        // The first CPU is the demux's; the workers share the rest round the instances.
        assert_eq!(p.handoff.cpu, Some(6));
        assert_eq!(
            Handoff {
                instance: 0,
                worker_generation: 1,
                cpu: None,
                ..p.handoff.clone()
            },
            t.handoff,
            "the plan changed more of the template than the worker's own fields"
        );
        assert_eq!(
            p.descriptors,
            [Descriptor::Ingress, Descriptor::Sessions, Descriptor::Sites]
        );
        assert_eq!(p.sites, &t.sites);
    }

    #[test]
    fn a_worker_sends_from_its_lanes_socket_under_kernel_steering_else_from_its_own() {
        let cfg = config(&["--sndbuf", "65536"]);
        let t = template();
        let a = around();
        for kind in [IngressKind::Shm, IngressKind::Unix] {
            let p = plan(&cfg, &t, &a, slot(0, 0, 1, kind));
            assert_eq!(
                p.sending,
                Sending::Own {
                    bind: a.public,
                    sndbuf: 65536
                }
            );
        }
        let p = plan(&cfg, &t, &a, slot(0, 0, 1, IngressKind::Reuseport));
        assert_eq!(p.sending, Sending::LaneSocket);
    }

    #[test]
    fn log_pipes_listeners_and_acme_follow_what_the_demux_holds() {
        let (cfg, t) = (config(&[]), template());
        let p = plan(&cfg, &t, &around(), slot(0, 0, 1, IngressKind::Shm));
        assert!(!p.access_log && !p.tcp && !p.redirect && !p.acme_challenges);
        let all = Surroundings {
            tcp: true,
            redirect: true,
            access_log: true,
            acme: true,
            ..around()
        };
        let p = plan(&cfg, &t, &all, slot(0, 0, 1, IngressKind::Shm));
        assert!(p.access_log && p.tcp && p.redirect && p.acme_challenges);
    }

    #[test]
    fn a_confined_worker_or_one_of_another_user_holds_no_capability() {
        let t = template();
        let open = config(&[]);
        let p = plan(&open, &t, &around(), slot(0, 0, 1, IngressKind::Shm));
        assert_eq!(
            p.confinement,
            Confinement {
                filter: false,
                landlock: false,
                drop_capabilities: false,
                drop_bounding_set: false,
            }
        );
        let sandboxed = Surroundings {
            filter: true,
            landlock: true,
            ..around()
        };
        let p = plan(&open, &t, &sandboxed, slot(0, 0, 1, IngressKind::Shm));
        assert_eq!(
            p.confinement,
            Confinement {
                filter: true,
                landlock: true,
                drop_capabilities: true,
                drop_bounding_set: true,
            }
        );
        // Its bounding set only where this process may empty it.
        let no_setpcap = Surroundings {
            may_drop_bounding_set: false,
            ..sandboxed
        };
        let p = plan(&open, &t, &no_setpcap, slot(0, 0, 1, IngressKind::Shm));
        assert!(p.confinement.drop_capabilities && !p.confinement.drop_bounding_set);
        // Another user: no capability, filter or not; the bounding set went with the switch.
        let mut other = config(&[]);
        other.worker_user = Some(WorkerUser {
            name: "someone".into(),
            uid: 4242,
            gid: 4343,
        });
        for a in [around(), sandboxed] {
            let p = plan(&other, &t, &a, slot(0, 0, 1, IngressKind::Shm));
            assert_eq!(p.user, Some((4242, 4343)));
            assert!(p.confinement.drop_capabilities);
            assert!(!p.confinement.drop_bounding_set);
        }
    }
}
