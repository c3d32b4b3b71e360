//! How the client commands (`ringmux reload`, `upgrade`, `acme renew`, `stats`, and `check`'s
//! question to the running ringmux) find the ringmux they talk to: its control socket and its
//! metrics address, each named by its flag, else its `RINGMUX_*` variable, else the
//! configuration file that ringmux runs with (`--config` / `RINGMUX_CONFIG`), else the default
//! a start has. The file is read with the parser a start uses, and only the one setting is
//! taken from it: a client command works with a file whose other settings this binary would
//! refuse.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::{CommandFactory, FromArgMatches};

use super::file;
use super::flags::{Cli, RunArgs, DEFAULT_CONTROL_SOCKET, DEFAULT_METRICS};
pub use super::flags::{ControlTarget, MetricsTarget};

impl ControlTarget {
    /// The socket to talk to: the flag's or the variable's, else the file's, else the default.
    pub fn socket(&self) -> Result<PathBuf> {
        let chosen = match &self.control_socket {
            Some(p) => p.clone(),
            None => match &self.config {
                Some(path) => PathBuf::from(from_file(
                    path,
                    "control_socket",
                    |run| &run.control_socket,
                    DEFAULT_CONTROL_SOCKET,
                )?),
                None => PathBuf::from(DEFAULT_CONTROL_SOCKET),
            },
        };
        if chosen.as_os_str() == "off" {
            bail!(
                "the control socket is off in {} (control_socket = \"off\"): send the running \
                 ringmux SIGHUP to reload (SIGUSR2 to upgrade), or give it a control socket",
                self.config
                    .as_deref()
                    .unwrap_or(Path::new("the settings"))
                    .display()
            );
        }
        Ok(chosen)
    }
}

impl MetricsTarget {
    /// The address to scrape: the flag's or the variable's, else the file's, else the default.
    pub fn address(&self) -> Result<String> {
        let chosen = match &self.metrics {
            Some(a) => a.clone(),
            None => match &self.config {
                Some(path) => from_file(path, "metrics", |run| &run.metrics, DEFAULT_METRICS)?,
                None => DEFAULT_METRICS.to_string(),
            },
        };
        if chosen == "off" {
            bail!(
                "the metrics are off in {} (metrics = \"off\"): give the running ringmux a \
                 metrics address to read them",
                self.config
                    .as_deref()
                    .unwrap_or(Path::new("the settings"))
                    .display()
            );
        }
        Ok(chosen)
    }
}

/// The value the file at `path` gives the setting `key` (a start's `pick` of its arguments),
/// parsed by the parser a start uses; `default` when the file does not set it. Only the file
/// counts here: the client's own flag and variable were looked at first.
fn from_file(
    path: &Path,
    key: &str,
    pick: impl Fn(&RunArgs) -> &String,
    default: &str,
) -> Result<String> {
    let file = file::FileConfig::read(path).map_err(anyhow::Error::new)?;
    // The file's other settings, and their problems, play no part: the running ringmux's start
    // or reload judged them, and this binary may be older or newer than it.
    let Some(setting) = file.settings.iter().find(|s| s.key == key) else {
        return Ok(default.to_string());
    };
    let flag = setting.flag.clone().unwrap_or_default();
    let cli = Cli::command()
        .try_get_matches_from(["ringmux", flag.as_str()])
        .map_err(anyhow::Error::new)
        .and_then(|m| Ok(Cli::from_arg_matches(&m)?))
        .with_context(|| format!("{}: {key}", setting.at))?;
    Ok(pick(&cli.run).clone())
}
