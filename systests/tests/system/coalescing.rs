//! The demux's receive coalescing (`demux/src/dataplane/coalesce.rs`): a steady flow is taken
//! in coalescing windows (one wake-up for many datagrams) and every datagram still reaches its
//! instance; `--recv-coalesce-us 0` turns it off, and the demux then waits on its socket only.

use std::net::UdpSocket;
use std::time::{Duration, Instant};

use ringmux_demux::metrics::names;
use ringmux_systests::harness::{Forward, Ringmux};

/// Milliseconds the flow lasts: past the first trial of coalescing (a second after the first
/// datagram, for 20 ms).
const FLOW_MS: u64 = 1_500;
/// Datagrams sent each millisecond: 40 000/s, ten a window, on any machine a socket keeps up
/// with (the demux takes each millisecond's in one wake-up or two).
const PER_MS: usize = 40;

/// A short-header datagram of 100 bytes the demux routes to instance 0.
fn datagram(rm: &Ringmux) -> Vec<u8> {
    let mut d = vec![0x40u8];
    d.extend_from_slice(&rm.dcid_for(0, 8));
    d.resize(100, 0x5a);
    d
}

/// Sends [`PER_MS`] short-header datagrams routed to instance 0 every millisecond for
/// [`FLOW_MS`] (a steady flow from one sender, paced by sleeping between the bursts), waits
/// (bounded) until the demux has taken and accounted for all of them, and returns how many
/// coalescing windows it slept meanwhile, how many datagrams it forwarded, and how many were
/// sent.
async fn a_flow(rm: &Ringmux) -> (f64, f64, usize) {
    let before = rm.metrics();
    let datagram = datagram(rm);
    let socket = UdpSocket::bind("127.0.0.1:0").unwrap();
    let start = Instant::now();
    let mut sent = 0;
    for tick in 1..=FLOW_MS {
        for _ in 0..PER_MS {
            socket.send_to(&datagram, rm.listen).unwrap();
            sent += 1;
        }
        let next = start + Duration::from_millis(tick);
        if let Some(wait) = next.checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
    }
    let want = before.get(names::RECEIVED) + sent as f64;
    let after = rm
        .wait_for(
            "every datagram of the flow received and accounted for",
            Duration::from_secs(20),
            |m| m.get(names::RECEIVED) >= want && m.balanced(),
        )
        .await;
    (
        after.get(names::RECV_WINDOWS) - before.get(names::RECV_WINDOWS),
        after.instance(names::FORWARDED, 0) - before.instance(names::FORWARDED, 0),
        sent,
    )
}

#[tokio::test]
async fn a_steady_flow_is_taken_in_coalescing_windows_and_reaches_its_instance() {
    let rm = Ringmux::start(1, Forward::Shm, &[]);
    let (windows, forwarded, sent) = a_flow(&rm).await;
    assert!(
        windows >= 1.0,
        "no coalescing window during the flow\n{}",
        rm.metrics()
    );
    // Nothing is lost to the windows: every datagram is forwarded or counted as a drop (the
    // ring's room, which `balanced` accounts for).
    let m = rm.metrics();
    assert_eq!(
        forwarded + m.sum(names::DROPPED),
        sent as f64,
        "forwarded {forwarded}\n{m}"
    );
    // The flow over, a lone datagram wakes the demux from its socket, and is taken.
    let before = m.instance(names::FORWARDED, 0);
    let socket = UdpSocket::bind("127.0.0.1:0").unwrap();
    socket.send_to(&datagram(&rm), rm.listen).unwrap();
    let after = rm
        .wait_for(
            "the lone datagram forwarded",
            Duration::from_secs(10),
            |m| m.instance(names::FORWARDED, 0) > before,
        )
        .await;
    assert_eq!(after.instance(names::FORWARDED, 0) - before, 1.0);
}

#[tokio::test]
async fn without_coalescing_the_demux_waits_on_its_socket_only() {
    let rm = Ringmux::start(1, Forward::Shm, &["--recv-coalesce-us", "0"]);
    let (windows, forwarded, _) = a_flow(&rm).await;
    assert_eq!(windows, 0.0, "{}", rm.metrics());
    assert!(forwarded > 0.0, "{}", rm.metrics());
}
