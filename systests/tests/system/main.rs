//! ringmux's system tests, one binary with a module per topic. Most start real processes: a
//! whole ringmux (through [`ringmux_systests::harness`]), its built-in workers, third-party
//! clients and tools (which `scripts/test.sh` installs); the rest run the server, the demux's
//! ACME engine or its session cache in-process against real sockets and a real CA. Every
//! binary they start is found next to this test executable, so `cargo build --workspace --bins
//! --examples` comes first (`scripts/test.sh` does it).

/// Certificates from ACME: the engine against Pebble, whole ringmux processes ordering them,
/// the server answering challenges.
mod acme {
    mod challenges;
    mod engine;
    mod issuance;
}
/// A real browser (headless Chromium) over HTTPS on TCP and over HTTP/3.
mod browser;
/// The command line's errors as an operator reads them.
mod cli;
/// Several nodes behind a load balancer, in network namespaces (`deploy/cluster.sh test`).
mod cluster;
/// The demux's receive coalescing under a steady flow.
mod coalescing;
/// Drains with no clock: slow downloads across reloads and upgrades, `--grace` and
/// `--max-draining`, every request in the access log.
mod drain;
/// WebSockets through the proxy over HTTP/1.1 and HTTP/2: echo, the cap, the idle timeout,
/// an unasked 101, their counters and access-log lines.
mod tunnel;
/// Hostile and broken workers, floods, faults, harvested connection IDs.
mod hostile {
    mod faults;
    mod files;
    mod floods;
    mod harvested_cids;
    mod rate_tables;
    mod workers;
}
/// Third-party HTTP/3 clients, the project's own client, and programs built on the worker
/// library; `ringmux upgrade` is among the third-party clients' scenarios.
mod interop {
    mod clients;
    mod examples;
    mod quinn;
}
/// Active health checks: a backend down by its check gets no request, one probe per interval
/// for the box, a health endpoint that hangs.
mod health;
/// Several backends behind one route: balancing, health, retries, `max_body`.
mod pool;
/// The reverse proxy in front of real HTTP/1.1 services.
mod proxy;
/// The PROXY protocol on the TCP listener: a balancer's header names the client.
mod proxy_protocol;
/// The built-in server's library on loopback: HTTP/3, sites over TCP, the shared session store.
mod server {
    mod http;
    mod sessions;
    mod sites;
}
/// Several sites on one port, and their metrics.
mod sites {
    mod compress;
    mod metrics;
    mod serving;
}
/// HTTPS over TCP beside HTTP/3 on the same port.
mod tcp;
/// The demux's binding of session tickets to instances.
mod tickets;
/// TLS and HTTP/2 upstreams: a private CA, SNI, gRPC's trailers over HTTP/2 and HTTP/3.
mod upstream_tls;
