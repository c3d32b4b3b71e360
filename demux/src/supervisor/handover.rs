//! What `ringmux upgrade` takes from the supervisor and gives to the next process image's:
//! the upgrades asked for and their answers ([`Upgrades`]), whether an upgrade may start now
//! ([`refusal`]), everything exported ([`export`]: the lanes with their running workers'
//! descriptors, [`export_lanes`], and what crosses besides descriptors, [`Exported`]), and a
//! worker handed over taken back ([`adopt`]). The state's document and its descriptors
//! as one set are `crate::upgrade`'s; the decision whether the supervisor is settled enough to
//! hand over is the policy's ([`Policy::export`]).

use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::time::Instant;

use anyhow::Result;
use ringmux_proto::sites::SiteTable;

use super::control::Clients;
use super::policy::{Policy, Unsettled};
use super::spawn::TcpListeners;
use super::workers::Worker;
use crate::forward::Lanes;
use crate::metrics::{Counters, LaneState};
use crate::sessions::SessionCache;
use crate::sys::{self, ChildProcess};
use crate::upgrade::{self, Compat, Incompatible, LanePhase, PreflightError};

/// An upgrade to carry out.
pub struct Upgrade {
    /// The binary to execute.
    pub binary: PathBuf,
    /// Control clients waiting for its outcome.
    pub clients: Vec<u64>,
}

impl Upgrade {
    /// Control client `client` (`None`: SIGUSR2) asks for an upgrade that passed its checks:
    /// it joins the one `pending`, or one to `binary` starts.
    pub fn ask(pending: &mut Option<Upgrade>, client: Option<u64>, binary: &Path) {
        match pending {
            Some(u) => u.clients.extend(client),
            None => {
                *pending = Some(Upgrade {
                    binary: binary.to_path_buf(),
                    clients: client.into_iter().collect(),
                })
            }
        }
    }
}

/// The upgrades of this process image: the `ringmux` binary on disk (what an upgrade
/// executes), and the upgrade that passed its checks, until the supervisor returns it.
pub struct Upgrades {
    pub binary: PathBuf,
    pending: Option<Upgrade>,
}

impl Upgrades {
    /// None asked for yet; an upgrade executes `binary`.
    pub fn new(binary: PathBuf) -> Upgrades {
        Upgrades {
            binary,
            pending: None,
        }
    }

    /// An upgrade asked for by control client `client` (or by SIGUSR2), `checked` by
    /// [`refusal`]: it joins the pending one or starts it ([`Upgrade::ask`]); a refused one is
    /// counted in `counters`, logged, and answered on `control`, and this demux serves on.
    pub fn ask(
        &mut self,
        client: Option<u64>,
        checked: Result<(), Refused>,
        counters: &Counters,
        control: &mut Clients,
    ) {
        match checked {
            Ok(()) => Upgrade::ask(&mut self.pending, client, &self.binary),
            Err(why) => {
                tracing::warn!(reason = %why, "upgrade refused; this demux serves on");
                counters.upgrades_failed.fetch_add(1, Ordering::Relaxed);
                control.answer(client, &format!("error: {why}; this demux serves on"));
            }
        }
    }

    /// The upgrade that passed its checks, if one did since the last look.
    pub fn take(&mut self) -> Option<Upgrade> {
        self.pending.take()
    }
}

/// The upgrade `upgrade` did not happen (`why`): counted in `counters`, logged, and its
/// clients answered on `control`; this demux serves on.
pub fn failed(upgrade: Upgrade, why: &str, counters: &Counters, control: &mut Clients) {
    counters.upgrades_failed.fetch_add(1, Ordering::Relaxed);
    tracing::error!(reason = %why, "upgrade failed; this demux serves on");
    for id in upgrade.clients {
        control.answer(id, &format!("error: {why}; this demux serves on"));
    }
}

/// What the supervisor hands over, borrowed from it for [`export`].
pub struct Handing<'a> {
    pub policy: &'a Policy,
    pub workers: &'a [Worker],
    pub control: &'a Clients,
    pub tcp: &'a TcpListeners,
    pub sessions: &'a SessionCache,
    /// The site table the workers run with.
    pub sites: &'a SiteTable,
}

/// Everything a new process image takes over from `from` for `upgrade`: its descriptors by
/// number into `fds` (the TCP listeners, the control socket with the clients of `upgrade`, and
/// a lane each, with its worker, for the data plane to add the ingress to), and the rest
/// returned. `Err` when the policy is not settled enough to hand over ([`Policy::export`]).
/// The session cache stops answering (frozen) until it is thawed (if the upgrade does not
/// happen).
pub fn export(
    from: Handing<'_>,
    upgrade: &Upgrade,
    fds: &mut upgrade::Fds<RawFd>,
) -> Result<Exported> {
    let now = Instant::now();
    let phases = from.policy.export(now)?;
    fds.lanes = export_lanes(phases, from.workers);
    if let Some((listener, answers)) = from.control.export(&upgrade.clients) {
        fds.control = Some(listener);
        fds.answers = answers;
    }
    fds.tcp = from.tcp.https.as_ref().map(AsRawFd::as_raw_fd);
    fds.redirect = from.tcp.redirect.as_ref().map(AsRawFd::as_raw_fd);
    let sessions = from
        .sessions
        .freeze(now)
        .into_iter()
        .map(crate::sessions::SessionEntry::freeze)
        .collect();
    Ok(Exported {
        active_generation: from.policy.active(),
        sites: from.sites.clone(),
        sessions,
    })
}

/// What the supervisor hands to a new process image besides its descriptors.
pub struct Exported {
    pub active_generation: u64,
    /// The site table the workers run with (serialised into the upgrade state).
    pub sites: SiteTable,
    pub sessions: Vec<crate::sessions::SessionEntry>,
}

/// Why an upgrade is refused; the running demux serves on.
#[derive(Debug, thiserror::Error)]
pub enum Refused {
    /// The forwarding mode is never upgraded.
    #[error("{0}")]
    Mode(&'static str),
    #[error(transparent)]
    Unsettled(#[from] Unsettled),
    #[error(
        "instance {instance}'s worker (generation {generation}) is exiting; run the upgrade \
         again in a moment"
    )]
    Exiting { instance: u8, generation: u64 },
    /// The new binary did not say what it speaks.
    #[error("{}", ringmux_proto::one_line(.0))]
    Preflight(#[from] PreflightError),
    #[error(transparent)]
    Incompatible(#[from] Incompatible),
}

/// Whether an upgrade to `binary` may go ahead now: refused unless the forwarding mode hands
/// over, the supervisor is settled (`policy`), no worker is half gone, and the new binary
/// speaks what the running workers speak (`ringmux upgrade-check`, run here).
pub fn refusal(
    forward: crate::config::ForwardMode,
    policy: &Policy,
    workers: &[Worker],
    lanes: Lanes,
    binary: &std::path::Path,
) -> Result<(), Refused> {
    if let Some(why) = forward.upgrade_refusal() {
        return Err(Refused::Mode(why));
    }
    policy.export(Instant::now())?;
    let half_gone = workers.iter().enumerate().find(|(l, w)| {
        policy.lane(*l).1 != LaneState::Idle
            && (w.child.is_none() || w.control.is_none() || w.sessions.is_none())
    });
    if let Some((l, _)) = half_gone {
        return Err(Refused::Exiting {
            instance: lanes.at(l).instance,
            generation: policy.lane(l).0,
        });
    }
    tracing::info!(binary = %binary.display(), "upgrade: checking the new binary");
    let theirs = upgrade::preflight(binary)?;
    match Compat::ours().refusal(&theirs) {
        Some(why) => Err(why.into()),
        None => Ok(()),
    }
}

/// Every lane, by the policy's `phases`, with its running worker's descriptors by number: what
/// the data plane adds each lane's ingress to.
pub fn export_lanes(
    phases: Vec<(u64, LanePhase)>,
    workers: &[Worker],
) -> Vec<upgrade::Lane<RawFd>> {
    phases
        .into_iter()
        .zip(workers)
        .map(|((generation, phase), w)| {
            let worker = match (&w.child, &w.control, &w.sessions) {
                (Some(c), Some(control), Some(sessions)) => Some(upgrade::Worker {
                    pid: c.id(),
                    control: control.as_raw_fd(),
                    sessions: sessions.as_raw_fd(),
                    output: w.pipes.as_ref().map(|p| p.output.as_raw_fd()),
                    access: w
                        .pipes
                        .as_ref()
                        .and_then(|p| p.access.as_ref().map(|a| a.as_raw_fd())),
                }),
                _ => None,
            };
            upgrade::Lane {
                generation,
                phase,
                worker,
                ingress: None,
            }
        })
        .collect()
}

/// A running worker handed over by a previous process image, in lane `lane` of `instance`:
/// the [`Worker`] that holds it from now on, and the demux's end of its session socket to
/// serve. Its output (and access log) are read on from where the old image stopped; a worker
/// of an image that kept no pipes writes to the demux's standard error still.
pub fn adopt(lane: usize, instance: u8, w: upgrade::Worker<OwnedFd>) -> Result<(Worker, OwnedFd)> {
    let pidfd = sys::pidfd_open(w.pid).ok();
    let sessions = w.sessions.try_clone()?;
    let _ = socket2::SockRef::from(&w.control).set_nonblocking(true);
    let pipes = match w.output {
        Some(output) => {
            let pipes = crate::logs::WorkerPipes {
                output: output.try_clone()?,
                access: w.access.as_ref().map(OwnedFd::try_clone).transpose()?,
            };
            crate::logs::watch(
                lane,
                instance,
                crate::logs::WorkerPipes {
                    output,
                    access: w.access,
                },
            );
            Some(pipes)
        }
        None => None,
    };
    let worker = Worker {
        child: Some(ChildProcess::from_pid(w.pid)),
        pidfd,
        control: Some(w.control),
        sessions: Some(sessions),
        pipes,
        ..Worker::default()
    };
    Ok((worker, w.sessions))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_upgrade_asked_for_again_gathers_its_clients() {
        let mut pending = None;
        Upgrade::ask(&mut pending, None, Path::new("/usr/bin/ringmux"));
        Upgrade::ask(&mut pending, Some(4), Path::new("/elsewhere"));
        Upgrade::ask(&mut pending, None, Path::new("/elsewhere"));
        Upgrade::ask(&mut pending, Some(9), Path::new("/elsewhere"));
        let u = pending.expect("an upgrade");
        assert_eq!(
            (u.binary, u.clients),
            (PathBuf::from("/usr/bin/ringmux"), vec![4, 9])
        );
        let mut asked = None;
        Upgrade::ask(&mut asked, Some(2), Path::new("/b"));
        assert_eq!(asked.map(|u| u.clients), Some(vec![2]));
    }
}
