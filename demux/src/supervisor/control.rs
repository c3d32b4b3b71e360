//! The operator's control socket: a Unix stream socket (mode 0600) on which `ringmux reload`
//! asks for a new worker generation, `ringmux upgrade` for a new demux and `ringmux acme
//! renew` for new ACME certificates, and each reads the outcome.
//!
//! The protocol is lines of text. A client sends one request line (`reload`, `reload check`,
//! `upgrade`, `acme renew` or `acme renew NAME`); the demux
//! answers with progress lines and one last line, `ok …` or `error: …`, then closes. The
//! supervisor polls the listener and its clients with its other descriptors and never blocks
//! on them: a client has 2 s and 64 bytes for its request line, and at most 8 are held at
//! once.

use std::io::{self, Read, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use crate::config::Config;

/// Longest request line: `acme renew` and a name of up to 253 characters.
const MAX_REQUEST: usize = 300;
/// How long a client has to send its request line.
const REQUEST_DEADLINE: Duration = Duration::from_secs(2);
/// Clients held at once; more are told so and closed.
const MAX_CLIENTS: usize = 8;

/// What a client asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    Reload,
    /// Whether a reload now would be refused (`ringmux check`): the configuration read and
    /// checked as a reload reads it, nothing started.
    ReloadCheck,
    Upgrade,
    /// New certificates now for the ACME site with this name, or for every ACME site.
    AcmeRenew(Option<String>),
}

impl Request {
    /// The request line.
    pub fn line(&self) -> String {
        match self {
            Request::Reload => "reload".into(),
            Request::ReloadCheck => "reload check".into(),
            Request::Upgrade => "upgrade".into(),
            Request::AcmeRenew(None) => "acme renew".into(),
            Request::AcmeRenew(Some(name)) => format!("acme renew {name}"),
        }
    }

    /// The request of `line`, if it is one.
    pub fn parse(line: &str) -> Option<Request> {
        let mut words = line.split_ascii_whitespace();
        let r = match (words.next()?, words.next(), words.next()) {
            ("reload", None, _) => Request::Reload,
            ("reload", Some("check"), None) => Request::ReloadCheck,
            ("upgrade", None, _) => Request::Upgrade,
            ("acme", Some("renew"), None) => Request::AcmeRenew(None),
            ("acme", Some("renew"), Some(name)) => Request::AcmeRenew(Some(name.to_string())),
            _ => return None,
        };
        words.next().is_none().then_some(r)
    }
}

/// A client, until it has its answer.
struct Client {
    id: u64,
    stream: UnixStream,
    buf: Vec<u8>,
    since: Instant,
    /// Its request line arrived; it waits for the answer.
    asked: bool,
}

/// The listening socket and its clients.
pub struct ControlServer {
    listener: UnixListener,
    path: PathBuf,
    clients: Vec<Client>,
    next_id: u64,
}

impl ControlServer {
    /// Binds `path` (mode 0600), making its folder if missing, and returns the listener for
    /// [`ControlServer::adopt`] (which removes the socket file when the server is dropped). A
    /// socket left at `path` by a demux that is gone is replaced; one that a running ringmux
    /// answers on is an error.
    pub fn listen(path: &Path) -> Result<OwnedFd> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            if !dir.exists() {
                std::fs::create_dir_all(dir)
                    .with_context(|| format!("making the folder {}", dir.display()))?;
                let _ = std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755));
            }
        }
        if path.exists() {
            if UnixStream::connect(path).is_ok() {
                bail!(
                    "another ringmux answers on {} already; give this one its own \
                     --control-socket (RINGMUX_CONTROL_SOCKET)",
                    path.display()
                );
            }
            std::fs::remove_file(path)
                .with_context(|| format!("removing the stale socket {}", path.display()))?;
        }
        let listener =
            UnixListener::bind(path).with_context(|| format!("binding {}", path.display()))?;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
            .with_context(|| format!("making {} private (0600)", path.display()))?;
        listener.set_nonblocking(true)?;
        Ok(listener.into())
    }

    /// The descriptors to poll for reading: the listener and every client still to be read.
    pub fn fds(&self) -> Vec<BorrowedFd<'_>> {
        let mut fds = vec![self.listener.as_fd()];
        fds.extend(
            self.clients
                .iter()
                .filter(|c| !c.asked)
                .map(|c| c.stream.as_fd()),
        );
        fds
    }

    /// Accepts new clients and reads request lines; returns the requests now complete, with
    /// the client's id and process ID. `refuse` names clients to turn away (a worker must not
    /// be able to reload, whatever the socket's permissions let it reach).
    pub fn poll(&mut self, now: Instant, refuse: impl Fn(u32) -> bool) -> Vec<(u64, Request)> {
        while let Ok((stream, _)) = self.listener.accept() {
            if stream.set_nonblocking(true).is_err() {
                continue;
            }
            let pid = peer_pid(&stream);
            if pid.is_none_or(&refuse) {
                let _ = (&stream).write_all(b"error: refused: not from a worker\n");
                continue;
            }
            if self.clients.len() >= MAX_CLIENTS {
                let _ = (&stream).write_all(b"error: busy: too many control clients\n");
                continue;
            }
            self.clients.push(Client {
                id: self.next_id,
                stream,
                buf: Vec::new(),
                since: now,
                asked: false,
            });
            self.next_id += 1;
        }
        let mut out = Vec::new();
        self.clients.retain_mut(|c| {
            if c.asked {
                return true;
            }
            let mut chunk = [0u8; MAX_REQUEST];
            loop {
                match c.stream.read(&mut chunk) {
                    Ok(0) => return false,
                    Ok(n) => c.buf.extend_from_slice(&chunk[..n]),
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(_) => return false,
                }
                if c.buf.len() > MAX_REQUEST {
                    break;
                }
            }
            let Some(end) = c.buf.iter().position(|&b| b == b'\n') else {
                if c.buf.len() > MAX_REQUEST || now.duration_since(c.since) > REQUEST_DEADLINE {
                    let _ = (&c.stream).write_all(b"error: no request line\n");
                    return false;
                }
                return true;
            };
            match std::str::from_utf8(&c.buf[..end])
                .ok()
                .and_then(Request::parse)
            {
                Some(r) => {
                    c.asked = true;
                    out.push((c.id, r));
                    true
                }
                None => {
                    let _ = (&c.stream).write_all(
                        b"error: unknown request (expected: reload, reload check, upgrade, acme renew \
                          [NAME])\n",
                    );
                    false
                }
            }
        });
        out
    }

    /// Sends client `id` a progress line.
    pub fn tell(&mut self, id: u64, line: &str) {
        if let Some(c) = self.clients.iter().find(|c| c.id == id) {
            write_line(&c.stream, line);
        }
    }

    /// Sends client `id` its last line and closes it.
    pub fn answer(&mut self, id: u64, line: &str) {
        if let Some(i) = self.clients.iter().position(|c| c.id == id) {
            let c = self.clients.swap_remove(i);
            write_line(&c.stream, line);
        }
    }
}

impl ControlServer {
    /// The listener's descriptor and those of the clients `ids`, for a new process image to
    /// [`ControlServer::adopt`]; they stay open here (only `execve` hands them on).
    pub fn export(&self, ids: &[u64]) -> (RawFd, Vec<RawFd>) {
        let clients = self
            .clients
            .iter()
            .filter(|c| ids.contains(&c.id))
            .map(|c| c.stream.as_raw_fd())
            .collect();
        (self.listener.as_raw_fd(), clients)
    }

    /// The server on `listener` at `path` ([`ControlServer::listen`]ed, or a previous process
    /// image's [`ControlServer::export`]ed), with the clients that wait for an answer; returns
    /// it and their ids.
    pub fn adopt(
        listener: OwnedFd,
        path: &Path,
        waiting: Vec<OwnedFd>,
    ) -> (ControlServer, Vec<u64>) {
        let listener = UnixListener::from(listener);
        let _ = listener.set_nonblocking(true);
        let mut server = ControlServer {
            listener,
            path: path.to_path_buf(),
            clients: Vec::new(),
            next_id: 1,
        };
        let mut ids = Vec::new();
        for fd in waiting {
            let stream = UnixStream::from(fd);
            let _ = stream.set_nonblocking(true);
            ids.push(server.next_id);
            server.clients.push(Client {
                id: server.next_id,
                stream,
                buf: Vec::new(),
                since: Instant::now(),
                asked: true,
            });
            server.next_id += 1;
        }
        (server, ids)
    }
}

impl Drop for ControlServer {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// The supervisor's side of the control socket: the server, unless `--control-socket off`,
/// and the clients of the upgrade that made this process image, waiting for its outcome.
/// Without a server, every answer goes nowhere.
#[derive(Default)]
pub struct Clients {
    server: Option<ControlServer>,
    upgrade: Vec<u64>,
}

impl Clients {
    /// The clients on `control` (a listener, and the clients of the upgrade handed over) at
    /// `path`; none with `None`.
    pub fn adopt(control: Option<(OwnedFd, Vec<OwnedFd>)>, path: &Path) -> Clients {
        match control {
            Some((listener, waiting)) => {
                let (server, upgrade) = ControlServer::adopt(listener, path, waiting);
                Clients {
                    server: Some(server),
                    upgrade,
                }
            }
            None => Clients::default(),
        }
    }

    /// The server, if there is one.
    pub fn server(&mut self) -> Option<&mut ControlServer> {
        self.server.as_mut()
    }

    /// The descriptors to poll ([`ControlServer::fds`]).
    pub fn fds(&self) -> Vec<BorrowedFd<'_>> {
        self.server
            .as_ref()
            .map(ControlServer::fds)
            .unwrap_or_default()
    }

    /// The requests now complete ([`ControlServer::poll`]).
    pub fn poll(&mut self, now: Instant, refuse: impl Fn(u32) -> bool) -> Vec<(u64, Request)> {
        match self.server.as_mut() {
            Some(s) => s.poll(now, refuse),
            None => Vec::new(),
        }
    }

    /// Sends client `id` a progress line.
    pub fn tell(&mut self, id: u64, line: &str) {
        if let Some(s) = self.server.as_mut() {
            s.tell(id, line);
        }
    }

    /// Sends client `id`, if any (`None`: the request came by a signal), its last line.
    pub fn answer(&mut self, id: impl Into<Option<u64>>, line: &str) {
        if let (Some(id), Some(s)) = (id.into(), self.server.as_mut()) {
            s.answer(id, line);
        }
    }

    /// Tells the clients of the upgrade that made this process image `line`, and closes them.
    pub fn answer_upgrade(&mut self, line: &str) {
        for id in std::mem::take(&mut self.upgrade) {
            self.answer(id, line);
        }
    }

    /// The listener's descriptor and those of the clients `ids`, if there is a server
    /// ([`ControlServer::export`]).
    pub fn export(&self, ids: &[u64]) -> Option<(RawFd, Vec<RawFd>)> {
        self.server.as_ref().map(|s| s.export(ids))
    }
}

/// Writes one line without waiting: a client that does not read loses what does not fit.
fn write_line(stream: &UnixStream, line: &str) {
    let mut s = stream;
    let _ = s.write_all(format!("{line}\n").as_bytes());
}

/// The connecting process's ID (`SO_PEERCRED`).
fn peer_pid(stream: &UnixStream) -> Option<u32> {
    let cred =
        nix::sys::socket::getsockopt(stream, nix::sys::socket::sockopt::PeerCredentials).ok()?;
    u32::try_from(cred.pid()).ok()
}

/// `ringmux reload` and `ringmux upgrade`: asks the ringmux at `path` for `request` and prints
/// what it says. `Ok` once it answered `ok`; an error with its reason otherwise.
pub fn request(path: &Path, request: &Request, timeout: Duration) -> Result<()> {
    let last = exchange(path, request, timeout, |line| {
        // The control client's own output: closed early, it stops (no panic).
        writeln!(io::stdout(), "{line}").context("writing the answer")
    })?;
    if last.starts_with("ok") {
        Ok(())
    } else if let Some(reason) = last.strip_prefix("error: ") {
        bail!("{} failed: {reason}", request.line())
    } else {
        bail!("ringmux closed the control socket without an answer")
    }
}

/// Asks the ringmux at `path` for `request` and returns its last line (`ok …` or `error: …`,
/// empty when it closed without one), passing every line to `each` as it arrives.
pub fn exchange(
    path: &Path,
    request: &Request,
    timeout: Duration,
    mut each: impl FnMut(&str) -> Result<()>,
) -> Result<String> {
    let mut stream = UnixStream::connect(path).with_context(|| {
        format!(
            "connecting to {} (is ringmux running with this --control-socket / \
             RINGMUX_CONTROL_SOCKET?)",
            path.display()
        )
    })?;
    stream.set_read_timeout(Some(timeout))?;
    stream.write_all(format!("{}\n", request.line()).as_bytes())?;
    let mut last = String::new();
    let mut reader = io::BufReader::new(stream);
    loop {
        let mut line = String::new();
        match io::BufRead::read_line(&mut reader, &mut line) {
            Ok(0) => break,
            Ok(_) => {
                let line = line.trim_end().to_string();
                each(&line)?;
                last = line;
            }
            Err(e)
                if e.kind() == io::ErrorKind::WouldBlock || e.kind() == io::ErrorKind::TimedOut =>
            {
                bail!("no answer from {} within {timeout:?}", path.display())
            }
            Err(e) => return Err(e).context("reading the answer"),
        }
    }
    Ok(last)
}

/// Binds `--control-socket`, unless it is `off`, for the supervisor's `Parts::control`; the
/// default path failing only warns.
pub fn bind(cfg: &Config) -> Result<Option<OwnedFd>> {
    let control = match cfg.args.control_socket.as_str() {
        "off" => None,
        path => match ControlServer::listen(Path::new(path)) {
            Ok(c) => Some(c),
            // Without root the default folder cannot be made: say so, and serve on.
            Err(e) if cfg.args.control_socket == crate::config::DEFAULT_CONTROL_SOCKET => {
                tracing::warn!(
                    error = %format!("{e:#}"),
                    "no control socket: `ringmux reload` cannot reach this ringmux (SIGHUP \
                     still reloads); give --control-socket / RINGMUX_CONTROL_SOCKET a path \
                     you may write, or off"
                );
                None
            }
            Err(e) => {
                return Err(e.context("--control-socket / RINGMUX_CONTROL_SOCKET"));
            }
        },
    };
    Ok(control)
}

#[cfg(test)]
mod tests {
    use super::{Clients, ControlServer, Request};

    /// Every request's line parses back to it; anything else, a word more or less included,
    /// is no request.
    #[test]
    fn request_lines_round_trip_and_nothing_else_parses() {
        for r in [
            Request::Reload,
            Request::ReloadCheck,
            Request::Upgrade,
            Request::AcmeRenew(None),
            Request::AcmeRenew(Some("example.com".into())),
        ] {
            assert_eq!(Request::parse(&r.line()), Some(r.clone()), "{r:?}");
        }
        for line in [
            "",
            "reload now",
            "reload check please",
            "check",
            "acme",
            "acme renew a b",
        ] {
            assert_eq!(Request::parse(line), None, "{line:?}");
        }
    }

    /// The clients of the upgrade that made this image get its last line, once; without a
    /// server, answers go nowhere.
    #[test]
    fn the_upgrades_clients_are_answered_once() {
        use std::io::Read;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("control.sock");
        let listener = ControlServer::listen(&path).unwrap();
        let (waiting, mut client) = std::os::unix::net::UnixStream::pair().unwrap();
        let mut clients = Clients::adopt(Some((listener, vec![waiting.into()])), &path);
        assert_eq!(clients.fds().len(), 1, "the listener; the client has asked");
        clients.answer_upgrade("ok upgraded");
        clients.answer_upgrade("again");
        let mut got = String::new();
        client.read_to_string(&mut got).unwrap();
        assert_eq!(got, "ok upgraded\n");
        let mut none = Clients::adopt(None, &path);
        none.answer(Some(1), "nowhere");
        assert!(none.fds().is_empty() && none.server().is_none());
    }
}
