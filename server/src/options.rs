//! The command line of the built-in worker program, `ringmux-worker`: how it serves. Its
//! serving options are [`ServeArgs`], declared once for ringmux and this program: ringmux
//! passes its values of them on this program's command line when it runs the built-in worker
//! (`--worker-bin`), and never to a program of `--worker-cmd`. What it serves (the sites, their
//! certificates and routes) and what every worker program needs (keys, QUIC idle timeout,
//! `alt-svc`) come in the hand-off instead, through the `ringmux-worker` library.
//!
//! `--root` and `--upstream` are this program's own: for `ringmux --worker-cmd 'ringmux-worker
//! --root DIR'`, they replace the routes of the command line's site.

use std::path::PathBuf;
use std::time::Duration;

use ringmux_proto::serve::ServeArgs;
use ringmux_proto::UpstreamUrl;

use crate::files::FileOptions;

/// ringmux's built-in worker: HTTP/3, and HTTPS over TCP beside it, serving static files or
/// proxying to an HTTP/1.1 service. ringmux starts one per instance, never by hand, and passes
/// it these options from its own of the same names; everything else (sockets, keys,
/// certificate) comes over its control socket (RINGMUX_CONTROL_FD).
#[derive(clap::Parser, Debug, Clone, PartialEq, Eq)]
#[command(name = "ringmux-worker", version)]
pub struct Options {
    /// Document root for static files of the command line's site, in place of the routes
    /// ringmux handed over (which carry ringmux's own --root).
    #[arg(long, value_name = "DIR", conflicts_with = "upstream")]
    pub root: Option<PathBuf>,
    /// Reverse proxy of the command line's site: pass every request to this HTTP service
    /// (`http://HOST:PORT`, `h2c://HOST:PORT`), in place of the routes ringmux handed over.
    /// Not with --root. A TLS one (`https://`, `h2://`) goes to ringmux's own --upstream, which
    /// hands the roots it is verified against over: this program reads no file for them.
    #[arg(long, value_name = "URL", value_parser = upstream_url)]
    pub upstream: Option<UpstreamUrl>,
    /// How it serves: the options ringmux declares with it and passes on its command line.
    #[command(flatten)]
    pub serve: ServeArgs,
    /// Benchmark sink: drain the ingress and count, checking each datagram's connection ID,
    /// without QUIC. ringmux passes it with --worker-mode sink.
    #[arg(long)]
    pub sink: bool,
}

impl Options {
    /// What [`crate::files::DocRoot`] is opened with.
    pub fn file_options(&self) -> FileOptions {
        FileOptions {
            cache_bytes: self.serve.file_cache_mb << 20,
            cache_control: self.serve.cache_control.clone(),
            ..FileOptions::default()
        }
    }

    /// How long the proxy waits for its upstream.
    pub fn upstream_timeout(&self) -> Duration {
        Duration::from_secs(self.serve.upstream_timeout)
    }

    /// How long an HTTP/2 connection may stay idle.
    pub fn tcp_idle_timeout(&self) -> Duration {
        Duration::from_secs(self.serve.tcp_idle_timeout)
    }

    /// When a draining worker closes its tunnels (`--tunnel-drain`), if it does.
    pub fn tunnel_drain(&self) -> Option<crate::proxy::TunnelDrain> {
        self.serve
            .tunnel_drain
            .0
            .map(|after| crate::proxy::TunnelDrain {
                after: Duration::from_secs(after),
                spread: Duration::from_secs(self.serve.tunnel_drain_spread),
            })
    }
}

fn upstream_url(v: &str) -> Result<UpstreamUrl, ringmux_proto::UpstreamError> {
    v.parse()
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    /// The built-in worker's options as ringmux passes them for the ringmux command line
    /// `args` (its worker program is /bin/true: only the arguments matter here).
    fn passed_by_ringmux(args: &[&str]) -> Options {
        let mut argv = vec!["ringmux", "--worker-bin", "/bin/true"];
        argv.extend_from_slice(args);
        let cfg = ringmux_demux::config::parse_from(argv.into_iter().map(Into::into).collect())
            .expect("a ringmux command line")
            .run
            .validate()
            .expect("a valid ringmux command line");
        assert_eq!(cfg.worker_cmd[0], "/bin/true");
        let worker_argv =
            std::iter::once("ringmux-worker").chain(cfg.worker_cmd[1..].iter().map(String::as_str));
        Options::try_parse_from(worker_argv)
            .expect("the built-in worker accepts what ringmux passes")
    }

    #[test]
    fn ringmux_defaults_are_the_workers() {
        assert_eq!(
            passed_by_ringmux(&[]),
            Options::parse_from(["ringmux-worker"])
        );
    }

    /// ringmux checks these options itself, to refuse a bad value at start with its own
    /// variable's name; the worker checks them again on its command line. At each edge of each
    /// range both accept the value or both refuse it.
    #[test]
    fn ringmux_and_the_worker_accept_the_same_ranges() {
        let edges: [(&str, &[&str]); 6] = [
            ("--file-cache-mb", &["0", "65536", "65537"]),
            ("--upstream-timeout", &["0", "1", "3600", "3601"]),
            ("--tcp-max-connections", &["0", "1", "4294967295"]),
            ("--tcp-idle-timeout", &["0", "1", "3600", "3601"]),
            ("--tunnel-drain", &["off", "0", "86400", "86401", "soon"]),
            ("--tunnel-drain-spread", &["0", "3600", "3601"]),
        ];
        for (option, values) in edges {
            for value in values {
                let ringmux = ringmux_demux::config::parse_from(
                    ["ringmux", "--worker-bin", "/bin/true", option, value]
                        .map(Into::into)
                        .to_vec(),
                )
                .ok()
                .and_then(|cli| cli.run.validate().ok())
                .is_some();
                let worker = Options::try_parse_from(["ringmux-worker", option, value]).is_ok();
                assert_eq!(
                    ringmux, worker,
                    "{option} {value}: ringmux {ringmux}, worker {worker}"
                );
            }
        }
    }

    #[test]
    fn every_option_arrives_as_ringmux_was_given_it() {
        let root = std::env::temp_dir();
        let o = passed_by_ringmux(&[
            "--root",
            root.to_str().unwrap(),
            "--max-bytes",
            "1234",
            "--file-cache-mb",
            "3",
            "--cache-control",
            "public, max-age=60",
            "--tcp-max-connections",
            "7",
            "--tcp-idle-timeout",
            "5",
            "--proxy-protocol-from",
            "10.0.0.0/8,192.0.2.7",
            "--tunnel-drain",
            "30",
            "--tunnel-drain-spread",
            "4",
            "--worker-mode",
            "sink",
        ]);
        // --root and --upstream reach the workers in the site table, not on this command line.
        assert_eq!(o.root, None);
        assert_eq!(o.serve.max_bytes, 1234);
        assert_eq!(o.serve.file_cache_mb, 3);
        assert_eq!(
            o.serve.cache_control.as_ref().unwrap(),
            "public, max-age=60"
        );
        assert_eq!(o.serve.tcp_max_connections, 7);
        assert_eq!(o.tcp_idle_timeout(), Duration::from_secs(5));
        let blocks: Vec<String> = o
            .serve
            .proxy_protocol_from
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(blocks, ["10.0.0.0/8", "192.0.2.7/32"]);
        assert_eq!(
            o.tunnel_drain(),
            Some(crate::proxy::TunnelDrain {
                after: Duration::from_secs(30),
                spread: Duration::from_secs(4),
            })
        );
        assert!(o.sink);
        let o = passed_by_ringmux(&[
            "--upstream",
            "http://127.0.0.1:8080",
            "--upstream-timeout",
            "9",
        ]);
        assert_eq!(o.upstream, None);
        assert_eq!(o.upstream_timeout(), Duration::from_secs(9));
        assert_eq!(o.tunnel_drain(), None, "off by default");
        assert!(!o.sink);
    }

    #[test]
    fn bad_values_are_refused_naming_the_option() {
        for (args, named) in [
            (&["--file-cache-mb", "65537"][..], "--file-cache-mb"),
            (&["--upstream-timeout", "0"], "--upstream-timeout"),
            (&["--tcp-max-connections", "0"], "--tcp-max-connections"),
            (&["--tcp-idle-timeout", "0"], "--tcp-idle-timeout"),
            (&["--tunnel-drain", "soon"], "--tunnel-drain"),
            (&["--cache-control", " "], "--cache-control"),
            (
                &["--proxy-protocol-from", "10.0.0.1/8"],
                "--proxy-protocol-from",
            ),
            (&["--proxy-protocol-from", "lb"], "--proxy-protocol-from"),
            (&["--upstream", "ftp://x:1"], "--upstream"),
            (&["--root", "/", "--upstream", "http://x:1"], "--root"),
        ] {
            let argv = std::iter::once(&"ringmux-worker").chain(args);
            let e = Options::try_parse_from(argv).unwrap_err().to_string();
            assert!(e.contains(named), "{args:?}: {e}");
        }
    }
}
