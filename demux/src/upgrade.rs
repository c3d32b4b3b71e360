//! `ringmux upgrade`: the demux replaces its own process image with the `ringmux` binary on disk
//! and keeps everything its workers hold on to.
//!
//! The old image stops its data plane (datagrams wait in the public socket's receive queue),
//! writes a [`State`] into a memfd, clears close-on-exec on every descriptor the state names,
//! and calls `execve` from the main thread, the thread that spawned every worker: the PID stays
//! (systemd's main PID, the workers' parent), the workers stay its children, and their death
//! signal, which fires when the thread that spawned them ends, does not fire. The new image
//! finds the state through [`STATE_ENV`], takes every descriptor back (marking it close-on-exec
//! again, so no later worker inherits it), maps the rings again (`Producer::adopt`) and carries
//! on. The workers keep their descriptors and notice nothing.
//!
//! Before any of that the old image asks the new binary, `ringmux upgrade-check`, whether it
//! speaks the same state format, worker protocol and ring layout ([`Compat`]); a binary that
//! cannot answer, or answers otherwise, is refused and the old image serves on. If the new image
//! refuses its state all the same, it executes the old binary again from a descriptor kept for
//! that ([`FALLBACK_ENV`]), which takes the state back and says why ([`REFUSED_ENV`]).

use std::ffi::{CString, OsString};
use std::fs::File;
use std::io::{self, Read, Seek, Write};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStringExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

pub use crate::forward::handover::{Ingress, IngressState};

/// The environment variable naming the state memfd in a new image.
pub const STATE_ENV: &str = "RINGMUX_UPGRADE_STATE_FD";
/// The descriptor of the binary that wrote the state, to go back to if the new one refuses it.
pub const FALLBACK_ENV: &str = "RINGMUX_UPGRADE_FALLBACK_FD";
/// Set when an image refused the state and executed the previous binary again: why.
pub const REFUSED_ENV: &str = "RINGMUX_UPGRADE_REFUSED";
/// Bumped on any change of [`State`] an older or newer image would misread.
/// 2: the public socket is the first of an `SO_REUSEPORT` group that every worker's sending
/// socket joins; an image of format 1 hands over one that nothing can join. 3: the listening
/// TCP socket (`tcp_fd`). 4: the plain-HTTP listener (`redirect_fd`).
pub const STATE_FORMAT: u32 = 4;
/// How long `ringmux upgrade-check` of the new binary may take.
pub const CHECK_TIMEOUT: Duration = Duration::from_secs(5);

/// What two images must share for one to hand over to the other.
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
pub struct Compat {
    pub state_format: u32,
    /// The worker protocol (`ringmux_proto::PROTOCOL_VERSION`): the running workers speak it.
    pub protocol: u32,
    /// The ring layout (`ringmux_ring::layout::LAYOUT_VERSION`): the running workers read it.
    pub ring_layout: u32,
}

impl Compat {
    /// This binary's.
    pub fn ours() -> Self {
        Compat {
            state_format: STATE_FORMAT,
            protocol: ringmux_proto::PROTOCOL_VERSION,
            ring_layout: ringmux_ring::layout::LAYOUT_VERSION,
        }
    }

    /// The line `ringmux upgrade-check` prints.
    pub fn line(&self) -> String {
        format!(
            "ringmux-upgrade state-format={} protocol={} ring-layout={}",
            self.state_format, self.protocol, self.ring_layout
        )
    }

    /// Parses [`Compat::line`].
    pub fn parse(line: &str) -> Option<Compat> {
        let mut words = line.split_whitespace();
        if words.next()? != "ringmux-upgrade" {
            return None;
        }
        let mut value = |key: &str| -> Option<u32> {
            words
                .next()?
                .strip_prefix(key)?
                .strip_prefix('=')?
                .parse()
                .ok()
        };
        Some(Compat {
            state_format: value("state-format")?,
            protocol: value("protocol")?,
            ring_layout: value("ring-layout")?,
        })
    }

    /// Why an image of `theirs` cannot take over from one of `self`, if it cannot.
    pub fn refusal(&self, theirs: &Compat) -> Option<Incompatible> {
        let differs = |what: &'static str, ours: u32, new: u32| {
            (ours != new).then_some(Incompatible { what, ours, new })
        };
        differs(
            "hand-over state format",
            self.state_format,
            theirs.state_format,
        )
        .or_else(|| differs("worker protocol version", self.protocol, theirs.protocol))
        .or_else(|| differs("ring layout version", self.ring_layout, theirs.ring_layout))
    }
}

/// Two images that differ in something a hand-over needs them to share ([`Compat`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "the new binary speaks {what} {new}, the running demux {ours}: it cannot take the running \
     workers over; restart ringmux to switch"
)]
pub struct Incompatible {
    /// What differs, in words (`worker protocol version`).
    pub what: &'static str,
    /// The running demux's.
    pub ours: u32,
    /// The new binary's.
    pub new: u32,
}

/// Why a new image cannot use the state it was handed ([`Inherited::parse`], [`State::check`],
/// [`State::take`]). Its text is what the previous binary, executed again, is told
/// ([`REFUSED_ENV`]) and passes on to whoever asked for the upgrade.
#[derive(Debug, thiserror::Error)]
pub enum Refusal {
    #[error("the hand-over state does not parse")]
    Unreadable(#[source] serde_json::Error),
    #[error(transparent)]
    Incompatible(#[from] Incompatible),
    #[error(
        "the running demux forwards with {running_forward} to {running_instances} instances, \
         this command line asks for {forward} and {instances}: keep --forward and --instances \
         for an upgrade"
    )]
    OtherConfiguration {
        running_forward: String,
        running_instances: u8,
        forward: String,
        instances: u8,
    },
    #[error("{lanes} lanes for {instances} instances")]
    LaneCount { lanes: usize, instances: u8 },
    #[error("a descriptor is named twice")]
    NamedTwice { fd: RawFd },
    #[error("descriptor {fd} is not open")]
    NotOpen { fd: RawFd },
    #[error("descriptor {fd}")]
    Untakeable {
        fd: RawFd,
        #[source]
        source: io::Error,
    },
}

impl Refusal {
    /// The refusal and its sources on one line: what [`REFUSED_ENV`] carries.
    pub fn reason(&self) -> String {
        crate::one_line(self)
    }
}

/// Why the new binary was not asked, or did not answer, what it speaks ([`preflight`]).
#[derive(Debug, thiserror::Error)]
pub enum PreflightError {
    #[error("the new binary {} does not start", binary.display())]
    NoStart {
        binary: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error(
        "the new binary {} did not answer `upgrade-check` within {timeout:?}",
        binary.display()
    )]
    NoAnswer { binary: PathBuf, timeout: Duration },
    #[error("waiting for the new binary")]
    Wait(#[source] io::Error),
    /// It exited unsuccessfully or printed no [`Compat::line`]; `said` is the last line of its
    /// standard error, if any.
    #[error(
        "the new binary {} failed `upgrade-check` ({status}){}",
        binary.display(),
        said.as_deref().map(|s| format!(": {s}")).unwrap_or_default()
    )]
    Failed {
        binary: PathBuf,
        status: ExitStatus,
        said: Option<String>,
    },
}

/// Everything a new image takes over. Descriptor numbers are open in the new image (their
/// close-on-exec flag cleared by the old one).
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct State {
    pub compat: Compat,
    /// `--forward` of the old image: the new one must run the same mode.
    pub forward: String,
    pub instances: u8,
    /// The shared keys (`KeySet::to_bytes`), hex.
    pub keys: String,
    /// The site table's JSON, certificates and keys included.
    pub sites: String,
    pub public_fd: RawFd,
    pub metrics_fd: Option<RawFd>,
    /// The listening TCP socket every worker accepts from (`--tcp on`).
    pub tcp_fd: Option<RawFd>,
    /// The listening socket for plain HTTP every worker redirects from (`--redirect-http`).
    pub redirect_fd: Option<RawFd>,
    pub control_fd: Option<RawFd>,
    /// Control clients waiting for the upgrade's outcome.
    pub answer_fds: Vec<RawFd>,
    pub active_generation: u64,
    pub counters: CounterState,
    pub sessions: Vec<SessionEntry>,
    pub lanes: Vec<LaneState>,
    /// When the old image received its last datagram (`CLOCK_MONOTONIC`, ns): the new one
    /// measures the hand-over's pause from it.
    pub last_recv_ns: u64,
    /// The old image's command line, byte for byte: what an image going back to the old binary
    /// runs it with (the new binary may have been a wrapper that changed its own).
    pub argv: Vec<Vec<u8>>,
    /// Where the `ringmux` binary is on disk, bytes: what the next upgrade executes (an image
    /// that went back to the old binary runs a deleted file, whose path says so).
    pub binary: Vec<u8>,
}

/// The counters that run on across images (what workers report comes again within a second),
/// by key: `Counters::snapshot` writes every counter of the tables in `metrics/counters.rs`, so
/// a counter added there runs on with no change here. The positional fields after them are the
/// previous release's form, which an image of that release writes and reads alone: read when
/// the keyed ones are absent, and written too.
#[derive(Serialize, Deserialize, Debug, Clone, Default, PartialEq, Eq)]
pub struct CounterState {
    /// The demux's own counters (`Counters::TABLE`), by field name.
    #[serde(default)]
    pub totals: std::collections::BTreeMap<String, u64>,
    /// Datagrams dropped, by reason (`DropReason::as_str`).
    #[serde(default)]
    pub drops: std::collections::BTreeMap<String, u64>,
    /// Per lane: its counters (`InstanceCounters::TABLE`), by field name.
    #[serde(default)]
    pub per_lane: Vec<std::collections::BTreeMap<String, u64>>,
    #[serde(default)]
    pub received: u64,
    #[serde(default)]
    pub recv_calls: u64,
    /// In `DropReason::ALL`'s order.
    #[serde(default)]
    pub dropped: Vec<u64>,
    #[serde(default)]
    pub reloads: u64,
    #[serde(default)]
    pub reloads_failed: u64,
    #[serde(default)]
    pub upgrades: u64,
    #[serde(default)]
    pub upgrades_failed: u64,
    /// Per lane: forwarded, doorbells, discarded_on_reset, restarts, violations.
    #[serde(default)]
    pub lanes: Vec<[u64; 5]>,
    /// Retries sent and unsent, tokens accepted (absent from an image without admission).
    #[serde(default)]
    pub admission: [u64; 3],
}

/// One entry of the session cache.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct SessionEntry {
    /// Hex.
    pub key: String,
    pub value: String,
    /// How old it was when handed over.
    pub age_ms: u64,
    /// The instance that stored it, charged to its quota of the cache; absent from an image
    /// from before quotas (such an entry is held to the global limits alone), and an image from
    /// before quotas ignores it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instance: Option<u8>,
}

/// One lane: its worker and its ingress.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct LaneState {
    pub generation: u64,
    pub phase: LanePhase,
    pub worker: Option<WorkerState>,
    pub ingress: Option<IngressState>,
}

/// What the lane's worker is doing.
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
pub enum LanePhase {
    Idle,
    Ready,
    Draining { elapsed_ms: u64, told: bool },
}

/// A running worker: a child of the demux.
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkerState {
    pub pid: u32,
    /// The demux's end of its control socket.
    pub control_fd: RawFd,
    /// The demux's end of its session socket.
    pub sessions_fd: RawFd,
    /// The read end of its output pipe (absent from an image whose workers wrote to its
    /// standard error).
    #[serde(default)]
    pub output_fd: Option<RawFd>,
    /// The read end of its access-log pipe (`--access-log`).
    #[serde(default)]
    pub access_fd: Option<RawFd>,
}

impl State {
    /// Every descriptor number the state names.
    pub fn fds(&self) -> Vec<RawFd> {
        let mut fds = vec![self.public_fd];
        fds.extend(self.metrics_fd);
        fds.extend(self.tcp_fd);
        fds.extend(self.redirect_fd);
        fds.extend(self.control_fd);
        fds.extend(&self.answer_fds);
        for lane in &self.lanes {
            if let Some(w) = &lane.worker {
                fds.extend([w.control_fd, w.sessions_fd]);
                fds.extend(w.output_fd);
                fds.extend(w.access_fd);
            }
            if let Some(ingress) = &lane.ingress {
                ingress.fds(&mut fds);
            }
        }
        fds
    }

    /// Checks what a new image can check before it touches a descriptor: the format, the mode
    /// and instances it runs, and that every descriptor is open and named once.
    pub fn check(&self, forward: &str, instances: u8) -> Result<(), Refusal> {
        if let Some(why) = self.compat.refusal(&Compat::ours()) {
            return Err(why.into());
        }
        if self.forward != forward || self.instances != instances {
            return Err(Refusal::OtherConfiguration {
                running_forward: self.forward.clone(),
                running_instances: self.instances,
                forward: forward.to_string(),
                instances,
            });
        }
        let lanes = usize::from(instances) * usize::from(ringmux_proto::GENERATION_SLOTS);
        if self.lanes.len() != lanes {
            return Err(Refusal::LaneCount {
                lanes: self.lanes.len(),
                instances,
            });
        }
        let mut fds = self.fds();
        fds.sort_unstable();
        if let Some(w) = fds.windows(2).find(|w| w[0] == w[1]) {
            return Err(Refusal::NamedTwice { fd: w[0] });
        }
        for fd in fds {
            if fd < 3 || !ringmux_inherit::is_open(fd) {
                return Err(Refusal::NotOpen { fd });
            }
        }
        Ok(())
    }
}

/// A [`State`] whose descriptors this image owns now (each close-on-exec again).
pub struct Taken {
    pub keys: String,
    pub sites: String,
    pub public: OwnedFd,
    pub metrics: Option<OwnedFd>,
    pub tcp: Option<OwnedFd>,
    pub redirect: Option<OwnedFd>,
    pub control: Option<OwnedFd>,
    pub answers: Vec<OwnedFd>,
    pub active_generation: u64,
    pub counters: CounterState,
    pub sessions: Vec<SessionEntry>,
    pub lanes: Vec<TakenLane>,
    pub last_recv_ns: u64,
    pub binary: std::path::PathBuf,
}

/// A lane of a [`Taken`] state.
pub struct TakenLane {
    pub generation: u64,
    pub phase: LanePhase,
    pub worker: Option<TakenWorker>,
    pub ingress: Option<Ingress>,
}

/// A running worker of a [`Taken`] state.
pub struct TakenWorker {
    pub pid: u32,
    pub control: OwnedFd,
    pub sessions: OwnedFd,
    pub output: Option<OwnedFd>,
    pub access: Option<OwnedFd>,
}

impl State {
    /// [`State::check`]s the state, then takes every descriptor it names. On an error nothing
    /// was taken.
    pub fn take(self, forward: &str, instances: u8) -> Result<Taken, Refusal> {
        self.check(forward, instances)?;
        let take = |fd: RawFd| -> Result<OwnedFd, Refusal> {
            ringmux_inherit::adopt(fd, true).map_err(|e| Refusal::Untakeable {
                fd,
                source: e.into(),
            })
        };
        let lanes = self
            .lanes
            .into_iter()
            .map(|l| {
                let worker = l
                    .worker
                    .map(|w| -> Result<TakenWorker, Refusal> {
                        Ok(TakenWorker {
                            pid: w.pid,
                            control: take(w.control_fd)?,
                            sessions: take(w.sessions_fd)?,
                            output: w.output_fd.map(take).transpose()?,
                            access: w.access_fd.map(take).transpose()?,
                        })
                    })
                    .transpose()?;
                let ingress = l.ingress.map(|i| i.take(&take)).transpose()?;
                Ok(TakenLane {
                    generation: l.generation,
                    phase: l.phase,
                    worker,
                    ingress,
                })
            })
            .collect::<Result<Vec<_>, Refusal>>()?;
        Ok(Taken {
            keys: self.keys,
            sites: self.sites,
            public: take(self.public_fd)?,
            metrics: self.metrics_fd.map(take).transpose()?,
            tcp: self.tcp_fd.map(take).transpose()?,
            redirect: self.redirect_fd.map(take).transpose()?,
            control: self.control_fd.map(take).transpose()?,
            answers: self
                .answer_fds
                .into_iter()
                .map(take)
                .collect::<Result<_, _>>()?,
            active_generation: self.active_generation,
            counters: self.counters,
            sessions: self.sessions,
            lanes,
            last_recv_ns: self.last_recv_ns,
            binary: OsString::from_vec(self.binary).into(),
        })
    }
}

/// What a previous image left, if this image was started by an upgrade.
pub struct Inherited {
    /// The state document as written (to go back with, should this image refuse it).
    pub raw: Vec<u8>,
    /// Why the image after this binary refused the state and executed this one again.
    pub refused: Option<String>,
}

impl Inherited {
    /// The state.
    pub fn parse(&self) -> Result<State, Refusal> {
        serde_json::from_slice(&self.raw).map_err(Refusal::Unreadable)
    }
}

/// The state a previous image left, if this image was started by an upgrade.
pub fn inherited() -> Option<Result<Inherited>> {
    let raw = std::env::var(STATE_ENV).ok()?;
    Some(read_inherited(&raw))
}

fn read_inherited(raw: &str) -> Result<Inherited> {
    let fd: RawFd = raw
        .parse()
        .with_context(|| format!("{STATE_ENV}={raw} is not a descriptor number"))?;
    // The previous image put the state memfd at this number for this image.
    let mut file =
        File::from(ringmux_inherit::adopt(fd, true).with_context(|| format!("{STATE_ENV}={raw}"))?);
    let mut bytes = Vec::new();
    file.rewind()?;
    file.take(64 << 20)
        .read_to_end(&mut bytes)
        .context("reading the hand-over state")?;
    Ok(Inherited {
        raw: bytes,
        refused: std::env::var(REFUSED_ENV).ok(),
    })
}

/// The new image, as the old one runs it: the binary and what it says it speaks.
pub fn preflight(binary: &Path) -> Result<Compat, PreflightError> {
    let mut child = Command::new(binary)
        .arg("upgrade-check")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|source| PreflightError::NoStart {
            binary: binary.to_owned(),
            source,
        })?;
    let deadline = Instant::now() + CHECK_TIMEOUT;
    let status = loop {
        match child.try_wait() {
            Ok(Some(s)) => break s,
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(5)),
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(PreflightError::NoAnswer {
                    binary: binary.to_owned(),
                    timeout: CHECK_TIMEOUT,
                });
            }
            Err(e) => return Err(PreflightError::Wait(e)),
        }
    };
    let mut out = String::new();
    let mut err = String::new();
    if let Some(mut o) = child.stdout.take() {
        let _ = (&mut o).take(4096).read_to_string(&mut out);
    }
    if let Some(mut e) = child.stderr.take() {
        let _ = (&mut e).take(4096).read_to_string(&mut err);
    }
    let theirs = out.lines().find_map(Compat::parse);
    match theirs {
        Some(c) if status.success() => Ok(c),
        _ => Err(PreflightError::Failed {
            binary: binary.to_owned(),
            status,
            said: err.trim().lines().last().map(str::to_string),
        }),
    }
}

/// Replaces this process image with `binary`, handing it `state` and running it with
/// `state.argv`. Returns only if `execve` failed: then every descriptor is close-on-exec again
/// and the caller carries on.
pub fn exec(binary: &Path, state: &State) -> io::Error {
    let bytes = match serde_json::to_vec(state) {
        Ok(b) => b,
        Err(e) => return io::Error::other(e),
    };
    match exec_inner(binary, &bytes, &state.fds(), &state.argv, None) {
        Ok(never) => match never {},
        Err(e) => e,
    }
}

/// What [`exec`] does; `refused`, when set, marks an image going back to the previous binary.
fn exec_inner(
    binary: &Path,
    state: &[u8],
    fds: &[RawFd],
    argv: &[Vec<u8>],
    back: Option<(&OwnedFd, &str)>,
) -> io::Result<std::convert::Infallible> {
    let memfd = nix::sys::memfd::memfd_create(
        c"ringmux-upgrade-state",
        nix::sys::memfd::MFdFlags::MFD_CLOEXEC,
    )?;
    let mut file = File::from(memfd);
    file.write_all(state)?;
    file.rewind()?;
    // The binary running now, for the new image to go back to.
    let fallback = match back {
        Some(_) => None,
        None => Some(File::open("/proc/self/exe")?),
    };
    let mut env: Vec<(OsString, OsString)> = std::env::vars_os()
        .filter(|(k, _)| k != STATE_ENV && k != FALLBACK_ENV && k != REFUSED_ENV)
        .collect();
    env.push((STATE_ENV.into(), file.as_raw_fd().to_string().into()));
    if let Some(f) = &fallback {
        env.push((FALLBACK_ENV.into(), f.as_raw_fd().to_string().into()));
    }
    if let Some((_, why)) = back {
        env.push((REFUSED_ENV.into(), why.into()));
    }
    let cstr = |s: OsString| CString::new(s.into_vec()).map_err(io::Error::other);
    let argv: Vec<CString> = if argv.is_empty() {
        std::env::args_os().map(cstr).collect::<io::Result<_>>()?
    } else {
        argv.iter()
            .map(|a| CString::new(a.clone()).map_err(io::Error::other))
            .collect::<io::Result<_>>()?
    };
    let envp: Vec<CString> = env
        .into_iter()
        .map(|(k, v)| {
            let mut kv = k;
            kv.push("=");
            kv.push(v);
            cstr(kv)
        })
        .collect::<io::Result<_>>()?;
    let mut open: Vec<RawFd> = fds.to_vec();
    open.push(file.as_raw_fd());
    open.extend(fallback.as_ref().map(|f| f.as_raw_fd()));
    for &fd in &open {
        ringmux_inherit::set_inherited(fd, true)?;
    }
    let err = match back {
        Some((old, _)) => nix::unistd::fexecve(old, &argv, &envp),
        None => {
            let path = cstr(binary.as_os_str().to_owned())?;
            nix::unistd::execve(&path, &argv, &envp)
        }
    };
    let err = match err {
        Ok(never) => match never {},
        Err(e) => io::Error::from(e),
    };
    for &fd in &open {
        let _ = ringmux_inherit::set_inherited(fd, false);
    }
    Err(err)
}

/// Called by a new image that cannot use the state it was given (before it took any of its
/// descriptors): executes the previous binary again with the same state, and `why`. Returns
/// only if that failed too.
pub fn go_back(inherited: &Inherited, why: &str) -> io::Error {
    let Some(fd) = std::env::var(FALLBACK_ENV)
        .ok()
        .and_then(|v| v.parse::<RawFd>().ok())
        .and_then(|fd| ringmux_inherit::adopt(fd, false).ok())
    else {
        return io::Error::other("no previous binary to go back to");
    };
    // The previous image opened its binary at this number for this.
    let old = fd;
    // The descriptors stay as the previous image left them (close-on-exec cleared); if the
    // state does not parse, the previous binary finds them all the same.
    let (fds, argv) = inherited
        .parse()
        .map(|s| (s.fds(), s.argv))
        .unwrap_or_default();
    match exec_inner(
        Path::new(""),
        &inherited.raw,
        &fds,
        &argv,
        Some((&old, why)),
    ) {
        Ok(never) => match never {},
        Err(e) => e,
    }
}

/// This image's command line, for [`State::argv`].
pub fn argv() -> Vec<Vec<u8>> {
    std::env::args_os().map(OsStringExt::into_vec).collect()
}

/// Closes the previous binary's descriptor once the state is taken.
pub fn forget_fallback() {
    if let Some(fd) = std::env::var(FALLBACK_ENV)
        .ok()
        .and_then(|v| v.parse::<RawFd>().ok())
    {
        // Opened for this image by the previous one, as in `go_back`.
        drop(ringmux_inherit::adopt(fd, false));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_check_line_round_trips_and_names_what_differs() {
        let ours = Compat::ours();
        assert_eq!(Compat::parse(&ours.line()), Some(ours));
        assert_eq!(Compat::parse("ringmux 0.1.0"), None);
        assert_eq!(Compat::parse("ringmux-upgrade state-format=x"), None);
        assert_eq!(ours.refusal(&ours), None);
        let newer = Compat {
            protocol: ours.protocol + 1,
            ..ours
        };
        let why = ours.refusal(&newer).unwrap().to_string();
        assert!(why.contains("worker protocol version"), "{why}");
        assert!(why.contains("restart"), "{why}");
    }

    #[test]
    fn a_state_naming_a_closed_or_repeated_descriptor_is_refused() {
        let f = File::open("/proc/self/exe").unwrap();
        let fd = f.as_raw_fd();
        let lanes = 4;
        let mut state = State {
            compat: Compat::ours(),
            forward: "shm".into(),
            instances: 1,
            keys: String::new(),
            sites: String::new(),
            public_fd: fd,
            metrics_fd: None,
            tcp_fd: None,
            redirect_fd: None,
            control_fd: None,
            answer_fds: vec![],
            active_generation: 1,
            counters: CounterState::default(),
            sessions: vec![],
            lanes: vec![
                LaneState {
                    generation: 0,
                    phase: LanePhase::Idle,
                    worker: None,
                    ingress: None,
                };
                lanes
            ],
            last_recv_ns: 0,
            argv: vec![],
            binary: vec![],
        };
        let refused = |s: &State, forward: &str, instances: u8| {
            s.check(forward, instances)
                .expect_err("a bad state was accepted")
                .reason()
        };
        assert!(state.check("shm", 1).is_ok());
        let garbled = Inherited {
            raw: b"{".to_vec(),
            refused: None,
        };
        let why = garbled
            .parse()
            .expect_err("parsed a truncated state")
            .reason();
        assert!(
            why.starts_with("the hand-over state does not parse: "),
            "{why}"
        );
        assert!(refused(&state, "unix", 1).contains("--forward"));
        assert!(refused(&state, "shm", 2).contains("--instances"));
        state.metrics_fd = Some(fd);
        assert!(matches!(
            state.check("shm", 1),
            Err(Refusal::NamedTwice { fd: twice }) if twice == fd
        ));
        assert!(refused(&state, "shm", 1).contains("twice"));
        state.metrics_fd = Some(1 << 20);
        assert!(refused(&state, "shm", 1).contains(&format!("descriptor {} is not open", 1 << 20)));
        state.metrics_fd = None;
        state.compat.ring_layout += 1;
        assert!(refused(&state, "shm", 1).contains("ring layout"));
    }
}
