//! More than one box (docs/operators/cluster.md): ringmux nodes that share one key file
//! behind a load balancer that routes by their QUIC-LB node IDs.
//!
//! * Two ringmux processes on loopback with one key file and different node IDs: a Retry
//!   token the first mints is accepted by the second (a relay sends the client's Initial after
//!   the Retry to the other node, as a balancer does when the first is gone).
//! * `deploy/cluster.sh test`: three nodes behind an nftables balancer made by `ringmux
//!   lb-config nftables`, in network namespaces of this machine (every packet length through
//!   the rules, connections spread, HTTPS over TCP spread and plain HTTP redirected,
//!   migration, upgrades under load, draining (a TCP download on the drained node finishes)
//!   and removal, `--retry always`, IPv6; last, certificates from ACME on several nodes: the
//!   nodes restarted with one `acme = true` site and one shared `[acme] state`, Pebble behind
//!   the VIP validating through the balancer, one order in all, and every node serving the
//!   one certificate, verified against Pebble's root over TCP and HTTP/3). Skipped, saying
//!   why, where it cannot run.

use ringmux_systests::harness;

use std::net::SocketAddr;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use harness::{bounded, check_bytes, Forward, Ringmux, SERVER_NAME};
use ringmux_demux::metrics::names;
use ringmux_quic_lb::KeySet;
use ringmux_testkit::client::{client_config, H3Client};
use ringmux_testkit::{pebble, temp_dir, tool};

const LIMIT: Duration = Duration::from_secs(90);
/// The whole namespace test: it takes under a minute.
const CLUSTER_LIMIT: Duration = Duration::from_secs(300);

/// A UDP relay between a client and two servers: every datagram from the client goes to `a`
/// until `a` answers with a Retry, then to `b`, from one socket, so both servers see the same
/// client address (a Retry token is bound to it). After the switch `a` is out of the path.
struct Relay {
    addr: SocketAddr,
    switched: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<()>,
}

impl Relay {
    async fn start(a: SocketAddr, b: SocketAddr) -> Relay {
        let front = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let back = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let addr = front.local_addr().unwrap();
        let switched = Arc::new(AtomicBool::new(false));
        let seen = switched.clone();
        let task = tokio::spawn(async move {
            let (mut up, mut down) = (vec![0u8; 65536], vec![0u8; 65536]);
            let mut client = None;
            loop {
                tokio::select! {
                    r = front.recv_from(&mut up) => {
                        let Ok((n, from)) = r else { return };
                        client = Some(from);
                        let to = if seen.load(Ordering::Relaxed) { b } else { a };
                        let _ = back.send_to(&up[..n], to).await;
                    }
                    r = back.recv_from(&mut down) => {
                        let Ok((n, from)) = r else { return };
                        // QUIC v1 Retry: long header, fixed bit, type 0b11 (RFC 9000 §17.2.5).
                        let retry = from == a && n > 0 && down[0] & 0xf0 == 0xf0;
                        if from == a && seen.load(Ordering::Relaxed) && !retry {
                            continue;
                        }
                        if retry {
                            seen.store(true, Ordering::Relaxed);
                        }
                        if let Some(c) = client {
                            let _ = front.send_to(&down[..n], c).await;
                        }
                    }
                }
            }
        });
        Relay {
            addr,
            switched,
            task,
        }
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The token key comes from the key file: node 0b opens the token node 0a's demux sealed into
/// its Retry, lets the Initial in without a Retry of its own, and its worker's quinn accepts
/// the token and serves the connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_token_of_one_node_is_taken_by_another() {
    bounded(LIMIT, async {
        let dir = temp_dir("ringmux-two-nodes");
        let key_file = dir.path().join("keys");
        KeySet::generate()
            .unwrap()
            .write_new(&key_file)
            .expect("writing the shared key file");
        let kf = key_file.to_str().unwrap();
        let node = |id: &'static str| {
            Ringmux::start(
                2,
                Forward::Shm,
                &["--node-id", id, "--retry", "always", "--key-file", kf],
            )
        };
        let (a, b) = (node("0a"), node("0b"));
        let relay = Relay::start(a.listen, b.listen).await;
        let client = H3Client::new(client_config(None).unwrap(), relay.addr).unwrap();
        let conn = client
            .connect(relay.addr, SERVER_NAME)
            .await
            .expect("connecting through the relay");
        let resp = conn.get("/bytes/5000").await.expect("GET on node 0b");
        check_bytes("node 0b, with node 0a's Retry token", &resp, 5000);
        conn.close().await.expect("clean close");
        assert!(
            relay.switched.load(Ordering::Relaxed),
            "node 0a sent no Retry"
        );

        let mb = b
            .wait_for("node 0b to report the connection", LIMIT / 3, |m| {
                m.sum(names::WORKER_CONNECTIONS_ACCEPTED) >= 1.0
            })
            .await;
        let ma = a.metrics();
        assert_eq!(ma.labelled(names::RETRIES, "result", "sent"), 1.0, "{ma}");
        assert_eq!(ma.sum(names::WORKER_CONNECTIONS_ACCEPTED), 0.0, "{ma}");
        assert!(
            mb.labelled(names::TOKENS, "result", "accepted") >= 1.0,
            "node 0b did not accept node 0a's token:\n{mb}"
        );
        assert_eq!(mb.labelled(names::TOKENS, "result", "refused"), 0.0, "{mb}");
        assert_eq!(
            mb.labelled(names::RETRIES, "result", "sent"),
            0.0,
            "node 0b sent a Retry of its own: it did not take node 0a's token\n{mb}"
        );
        assert_eq!(mb.sum(names::WORKER_CONNECTIONS_ACCEPTED), 1.0, "{mb}");
    })
    .await
}

/// `deploy/cluster.sh test`, bounded; its output is printed. Skipped, saying why, when not
/// root or when network namespaces cannot be made; under CI a missing tool fails instead
/// (`scripts/test.sh` installs them).
#[test]
fn three_nodes_behind_an_nftables_balancer() {
    if !nix::unistd::geteuid().is_root() {
        skip("not root: network namespaces and nftables need root");
        return;
    }
    let tools = [
        tool::IP_NETNS,
        tool::NFT,
        tool::CONNTRACK,
        tool::GTLSCLIENT,
        tool::CURL,
        tool::AIOQUIC,
        pebble::PEBBLE,
        pebble::PEBBLE_CHALLTESTSRV,
    ];
    for tool in tools {
        if !tool.present() {
            return;
        }
    }
    let probe = format!("rmx-probe-{}", std::process::id());
    match Command::new("ip").args(["netns", "add", &probe]).output() {
        Ok(o) if o.status.success() => {
            let _ = Command::new("ip").args(["netns", "del", &probe]).status();
        }
        Ok(o) => {
            skip(&format!(
                "cannot create a network namespace here (`ip netns add` says: {})",
                String::from_utf8_lossy(&o.stderr).trim()
            ));
            return;
        }
        Err(e) => {
            skip(&format!("cannot run `ip netns add`: {e}"));
            return;
        }
    }

    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let ringmux = harness::binary("ringmux");
    let bin = ringmux.parent().expect("the folder of the binaries");
    let out = temp_dir("ringmux-cluster");
    let log_path = out.path().join("cluster.log");
    let log = std::fs::File::create(&log_path).unwrap();
    let mut child = Command::new(root.join("deploy/cluster.sh"))
        .args(["test", "--bin"])
        .arg(bin)
        .env("RMX_CLUSTER_DIR", out.path().join("state"))
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .expect("starting deploy/cluster.sh");
    let deadline = Instant::now() + CLUSTER_LIMIT;
    let status = loop {
        if let Some(status) = child.try_wait().expect("waitpid") {
            break Some(status);
        }
        if Instant::now() >= deadline {
            break None;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let status = status.unwrap_or_else(|| {
        // SIGTERM: the script's trap takes the namespaces down; then make sure.
        let pid = nix::unistd::Pid::from_raw(child.id() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        let until = Instant::now() + Duration::from_secs(30);
        while child.try_wait().ok().flatten().is_none() && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(200));
        }
        let _ = child.kill();
        let _ = child.wait();
        let _ = Command::new(root.join("deploy/cluster.sh"))
            .arg("down")
            .env("RMX_CLUSTER_DIR", out.path().join("state"))
            .status();
        panic!(
            "deploy/cluster.sh test did not finish within {CLUSTER_LIMIT:?}:\n{}",
            std::fs::read_to_string(&log_path).unwrap_or_default()
        )
    });
    let text = std::fs::read_to_string(&log_path).unwrap_or_default();
    println!("{text}");
    assert!(
        status.success(),
        "deploy/cluster.sh test failed ({status}):\n{text}"
    );
    assert!(
        text.contains("== cluster: all passed"),
        "no closing line:\n{text}"
    );
}

fn skip(why: &str) {
    eprintln!("\n*** SKIPPED: {why}; this test did NOT run. ***\n");
}
