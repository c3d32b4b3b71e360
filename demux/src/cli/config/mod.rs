//! `ringmux` command line: every option has a `RINGMUX_*` environment twin, documented in
//! `--help`, and a key of the same name in the configuration file (`--config`, [`mod@file`]).
//! [`parse`] reads the command line and the file; [`RunArgs::validate`] turns the arguments into
//! a checked [`Config`]; every refusal names the option, its variable, the value and what is
//! accepted, and the file's place when the file set it.
//!
//! The children, each on the ones before it: [`mod@document`] (the file as read), [`flags`]
//! (the declaration of the command line, holding the file), [`worker_user`], [`mod@file`]
//! (the file read against the declaration), [`running`] (where the client commands find the
//! running ringmux), [`sites`] and [`acme`] (the file's tables checked), [`resolve`] (the
//! whole checked into a [`Config`]). This module reads the command line and the file
//! ([`parse`]) and names every child's public items; no child imports it but for tests.

pub mod acme;
pub mod document;
pub mod file;
pub mod flags;
pub mod resolve;
pub mod running;
pub mod sites;
pub mod worker_user;

pub use crate::forward::ForwardMode;
pub use crate::options::{default_nonce_len, node_id_bytes, Toggle};
pub use flags::{
    AcmeCommand, Cli, Command, Grace, PlainHttp, RedirectHttp, RingArgs, RunArgs, Sandbox,
    SpinMode, WorkerMode, DEFAULT_CONTROL_SOCKET, DEFAULT_METRICS,
};
pub use resolve::{AccessLog, Config, RELOADABLE};
pub use worker_user::{Unreachable, WorkerUser, DEFAULT_WORKER_USER, SELF_WORKER_USER};

use anyhow::Result;

/// The command line, with the configuration file's settings (`--config`) placed before its
/// own flags, so that a flag or an environment variable wins over the file. Exits with clap's
/// message on a bad command line (as `Cli::parse` does); a configuration file that does not
/// parse is an error naming each problem's place.
pub fn parse() -> Result<Cli> {
    parse_from(std::env::args_os().collect())
}

/// [`parse`] of `argv`. A bad command line is a [`clap::Error`] (the caller exits with it, as
/// `Cli::parse` would); a configuration file that does not parse is an error naming each
/// problem's place.
pub fn parse_from(argv: Vec<std::ffi::OsString>) -> Result<Cli> {
    use clap::{CommandFactory, FromArgMatches};
    let matches = Cli::command()
        .try_get_matches_from(argv.clone())
        .map_err(named_variable)?;
    let mut cli = Cli::from_arg_matches(&matches)?;
    let (run, run_matches, insert_at) = match &cli.command {
        None => (&cli.run, &matches, 1),
        Some(Command::Check { run, .. }) => {
            let at = argv
                .iter()
                .skip(1)
                .position(|a| a == "check")
                .map_or(1, |i| i + 2);
            (
                &**run,
                matches.subcommand_matches("check").unwrap_or(&matches),
                at,
            )
        }
        Some(_) => return Ok(cli),
    };
    let Some(path) = run.config.clone() else {
        let raw = ringmux_proto::serve::raw_values(run_matches);
        if let Some(run) = run_args(&mut cli) {
            run.raw = raw;
        }
        return Ok(cli);
    };
    let file = file::FileConfig::read(&path).map_err(anyhow::Error::new)?;
    // `ringmux check` goes on, to show what else is wrong.
    if !file.problems.is_empty() && cli.command.is_none() {
        return Err(file::Problems(file.problems).into());
    }
    let flags = file.flags(run_matches);
    let mut argv = argv;
    let at = insert_at.min(argv.len());
    argv.splice(at..at, flags.into_iter().map(std::ffi::OsString::from));
    let matches = Cli::command().try_get_matches_from(argv).map_err(|e| {
        let why = e.render().to_string();
        anyhow::anyhow!(
            "the settings of {} and the command line do not go together: {}",
            path.display(),
            why.lines()
                .next()
                .unwrap_or_default()
                .trim_start_matches("error: ")
        )
    })?;
    let mut cli = Cli::from_arg_matches(&matches)?;
    let raw =
        ringmux_proto::serve::raw_values(matches.subcommand_matches("check").unwrap_or(&matches));
    if let Some(run) = run_args(&mut cli) {
        run.file = Some(std::sync::Arc::new(file));
        run.raw = raw;
    }
    Ok(cli)
}

/// A bad value of an option, named with its environment variable too (clap's message names
/// only the flag, though the value may have come from the variable); any other clap error as
/// it is (help, version, usage), for the caller to exit with.
fn named_variable(e: clap::Error) -> anyhow::Error {
    use clap::error::{ContextKind, ContextValue, ErrorKind};
    use clap::CommandFactory;
    if !matches!(
        e.kind(),
        ErrorKind::ValueValidation | ErrorKind::InvalidValue
    ) {
        return e.into();
    }
    let Some(ContextValue::String(arg)) = e.get(ContextKind::InvalidArg) else {
        return e.into();
    };
    let long = arg
        .split_whitespace()
        .next()
        .unwrap_or_default()
        .trim_start_matches("--");
    let cmd = Cli::command();
    let Some(env) = cmd
        .get_arguments()
        .find(|a| a.get_long() == Some(long))
        .and_then(|a| a.get_env())
    else {
        return e.into();
    };
    let value = match e.get(ContextKind::InvalidValue) {
        Some(ContextValue::String(v)) => v.clone(),
        _ => String::new(),
    };
    let why = e.render().to_string();
    let why = why.lines().next().unwrap_or_default();
    let why = why.rsplit(": ").next().unwrap_or(why);
    anyhow::anyhow!(
        "--{long} / {}={value} is not valid: {why}",
        env.to_string_lossy()
    )
}

/// The options of a start (`ringmux` alone, or `ringmux check`).
fn run_args(cli: &mut Cli) -> Option<&mut RunArgs> {
    match &mut cli.command {
        None => Some(&mut cli.run),
        Some(Command::Check { run, .. }) => Some(&mut **run),
        Some(_) => None,
    }
}
