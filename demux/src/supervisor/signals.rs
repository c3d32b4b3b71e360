//! The signals the supervisor acts on, told apart ([`Signal::of`]) and logged: SIGHUP reloads,
//! SIGUSR2 upgrades, any other it receives (SIGTERM, SIGINT) starts the shutdown, and a second
//! one cuts it. What is done about one is the loop's and the policy's.

use std::time::Duration;

/// What a signal asks the supervisor for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Signal {
    /// SIGHUP: a reload, as `ringmux reload` asks for one.
    Reload,
    /// SIGUSR2: an upgrade, as `ringmux upgrade` asks for one.
    Upgrade,
    /// Any other: the shutdown; `second` when one is under way already (it is cut now).
    Stop { signal: i32, second: bool },
}

impl Signal {
    /// What `signal` asks for, a shutdown being under way (`shutting_down`) or not.
    pub fn of(signal: i32, shutting_down: bool) -> Signal {
        match signal {
            libc::SIGHUP => Signal::Reload,
            libc::SIGUSR2 => Signal::Upgrade,
            _ => Signal::Stop {
                signal,
                second: shutting_down,
            },
        }
    }

    /// Says what it starts; `grace`: how long a drain may take (`--grace`), if that is bounded.
    pub fn log(self, grace: Option<Duration>) {
        match (self, grace) {
            (Signal::Reload, _) => tracing::info!("SIGHUP: reloading"),
            (Signal::Upgrade, _) => tracing::info!("SIGUSR2: upgrading"),
            (Signal::Stop { signal, second: true }, _) => {
                tracing::warn!(signal, "second signal: stopping now")
            }
            (Signal::Stop { signal, .. }, Some(grace)) => tracing::info!(signal, ?grace, "shutting down: draining workers (what they still serve at the end of --grace is cut; a second signal cuts it now)"),
            (Signal::Stop { signal, .. }, None) => tracing::info!(signal, "shutting down: draining workers until every request in flight is done (no --grace; a second signal cuts them now)"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hup_reloads_usr2_upgrades_and_the_rest_stop_then_cut() {
        assert_eq!(Signal::of(libc::SIGHUP, false), Signal::Reload);
        assert_eq!(Signal::of(libc::SIGHUP, true), Signal::Reload);
        assert_eq!(Signal::of(libc::SIGUSR2, false), Signal::Upgrade);
        for signal in [libc::SIGTERM, libc::SIGINT] {
            let first = Signal::of(signal, false);
            assert_eq!(
                first,
                Signal::Stop {
                    signal,
                    second: false
                }
            );
            let second = Signal::of(signal, true);
            assert_eq!(
                second,
                Signal::Stop {
                    signal,
                    second: true
                }
            );
        }
    }
}
