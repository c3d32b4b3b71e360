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
//!
//! The descriptors that cross are one set, [`Fds`] (`fds.rs`), by number in the document
//! ([`State`], `state.rs`) and owned once taken: a start by `ringmux upgrade` differs from a
//! first start only in that it takes that set rather than binding it.

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

mod fds;
mod state;

pub use fds::{Fds, Ingress, Lane, LanePhase, Worker};
pub use state::State;

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

/// What a previous image left, if this image was started by an upgrade.
pub struct Inherited {
    /// The state document as written (to go back with, should this image refuse it).
    pub raw: Vec<u8>,
    /// Why the image after this binary refused the state and executed this one again.
    pub refused: Option<String>,
}

impl Inherited {
    /// The state.
    pub fn parse(&self) -> Result<State<RawFd>, Refusal> {
        serde_json::from_slice(&self.raw).map_err(Refusal::Unreadable)
    }

    /// The state, its descriptors taken ([`State::take`]) and the previous binary's
    /// descriptor closed, for an image running `forward` with `instances`. A state this image
    /// cannot use sends it back to the previous binary, which serves on and says why: this
    /// returns only if that failed.
    pub fn take(&self, forward: &str, instances: u8) -> Result<State<OwnedFd>> {
        let state = self
            .parse()
            .and_then(|s| s.take(forward, instances))
            .map_err(|refusal| self.go_back(refusal))?;
        forget_fallback();
        Ok(state)
    }

    /// Executes the previous binary again, refusing the state for `refusal`; the error says
    /// why that failed.
    fn go_back(&self, refusal: Refusal) -> anyhow::Error {
        let why = refusal.reason();
        if self.refused.is_some() {
            // Already the previous binary, gone back to: no further back.
            return anyhow::anyhow!("the hand-over state was refused twice: {why}");
        }
        tracing::error!(reason = %why, "refusing the hand-over; going back to the previous binary");
        anyhow::Error::new(go_back(self, &why)).context(format!(
            "refusing the hand-over ({why}); going back to the previous binary failed"
        ))
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
pub fn exec(binary: &Path, state: &State<RawFd>) -> io::Error {
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
            sites: Default::default(),
            fds: Fds {
                lanes: vec![
                    Lane {
                        generation: 0,
                        phase: LanePhase::Idle,
                        worker: None,
                        ingress: None,
                    };
                    lanes
                ],
                ..Fds::new(fd)
            },
            active_generation: 1,
            counters: Default::default(),
            sessions: vec![],
            last_recv_ns: 0,
            argv: vec![],
            binary: vec![],
        };
        let refused = |s: &State<RawFd>, forward: &str, instances: u8| {
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
        state.fds.metrics = Some(fd);
        assert!(matches!(
            state.check("shm", 1),
            Err(Refusal::NamedTwice { fd: twice }) if twice == fd
        ));
        assert!(refused(&state, "shm", 1).contains("twice"));
        state.fds.metrics = Some(1 << 20);
        assert!(refused(&state, "shm", 1).contains(&format!("descriptor {} is not open", 1 << 20)));
        state.fds.metrics = None;
        state.compat.ring_layout += 1;
        assert!(refused(&state, "shm", 1).contains("ring layout"));
    }

    /// The document keeps the names and shape an image of state format 4 wrote before its
    /// descriptors were one generic set: either image reads what the other writes.
    #[test]
    fn the_document_keeps_the_format_4_names() {
        let ours = Compat::ours();
        let written = serde_json::json!({
            "compat": {
                "state_format": ours.state_format,
                "protocol": ours.protocol,
                "ring_layout": ours.ring_layout,
            },
            "forward": "unix", "instances": 1, "keys": "00",
            "sites": r#"{"sites":[],"default_site":null}"#,
            "public_fd": 3, "metrics_fd": null, "tcp_fd": 7, "redirect_fd": null,
            "control_fd": 8, "answer_fds": [9],
            "active_generation": 2,
            "sessions": [{"key": "0a", "value": "0b", "age_ms": 5}],
            "lanes": [
                {
                    "generation": 2, "phase": "Ready",
                    "worker": {
                        "pid": 42, "control_fd": 10, "sessions_fd": 11,
                        "output_fd": 12, "access_fd": null,
                    },
                    "ingress": {"Unix": {"fd": 13}},
                },
                {
                    "generation": 1, "phase": {"Draining": {"elapsed_ms": 3, "told": true}},
                    "worker": null, "ingress": null,
                },
            ],
            "last_recv_ns": 5, "argv": [[114]], "binary": [47],
        });
        let mut with_counters = written.clone();
        with_counters["counters"] = serde_json::json!({});
        let state: State<RawFd> = serde_json::from_value(with_counters).unwrap();
        assert_eq!(state.fds(), [3, 7, 8, 9, 10, 11, 12, 13]);
        assert_eq!(state.fds.lanes[0].worker.as_ref().unwrap().pid, 42);
        let mut again = serde_json::to_value(&state).unwrap();
        again.as_object_mut().unwrap().remove("counters");
        assert_eq!(again, written);
    }

    /// The site table crosses typed, as the JSON string an image of state format 4 wrote and
    /// reads; a string that is no site table refuses the state (the upgrade goes back).
    #[test]
    fn the_site_table_crosses_as_its_json_text() {
        let table = ringmux_proto::sites::SiteTable {
            sites: vec![],
            default_site: None,
        };
        let state = |sites: serde_json::Value| {
            let ours = Compat::ours();
            serde_json::json!({
                "compat": {
                    "state_format": ours.state_format,
                    "protocol": ours.protocol,
                    "ring_layout": ours.ring_layout,
                },
                "forward": "unix", "instances": 1, "keys": "00", "sites": sites,
                "public_fd": 3, "metrics_fd": null, "tcp_fd": null, "redirect_fd": null,
                "control_fd": null, "answer_fds": [], "active_generation": 1, "counters": {}, "sessions": [],
                "lanes": [], "last_recv_ns": 0, "argv": [], "binary": [],
            })
        };
        let read: State<RawFd> =
            serde_json::from_value(state(table.to_json().into())).expect("a format-4 state");
        assert_eq!(read.sites, table);
        assert_eq!(
            serde_json::to_value(&read).unwrap()["sites"],
            serde_json::Value::String(table.to_json())
        );
        for bad in [
            serde_json::json!("{}"),
            serde_json::json!(r#"{"sites":[],"default_site":3}"#),
            serde_json::json!({"sites": [], "default_site": null}),
        ] {
            let raw = serde_json::to_vec(&state(bad.clone())).unwrap();
            let inherited = Inherited { raw, refused: None };
            let why = inherited
                .parse()
                .expect_err("read a bad site table")
                .reason();
            assert!(
                why.starts_with("the hand-over state does not parse"),
                "{bad}: {why}"
            );
        }
    }
}
