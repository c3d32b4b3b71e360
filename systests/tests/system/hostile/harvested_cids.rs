//! Address validation holds for the demux's own connection IDs (issue #30 item 3). Every Retry
//! the demux sends tells its SCID, one of our CIDs, to whoever asked; under `--retry always` a
//! token-less Initial to such a CID must get a Retry like any other, never a worker's
//! handshake, so that an attacker who harvested one CID cannot open connections from addresses
//! it does not hold. The Initials here are real: ClientHellos written by rustls' QUIC client,
//! protected with rustls' Initial keys (`ringmux_testkit::client_initial`), which a worker's quinn
//! would answer with its ServerHello.

use ringmux_demux::metrics::names;
use std::net::UdpSocket;
use std::sync::Arc;
use std::time::Duration;

use harness::{bounded, check_bytes, hex, Forward, Metrics, Ringmux, SERVER_NAME};
use quinn::ConnectionId;
use ringmux_systests::harness;
use ringmux_testkit::client_initial::{crypto_frame, initial_packet};
use ringmux_testkit::tool;

const LIMIT: Duration = Duration::from_secs(120);
/// Fresh source ports that send Initials to the harvested CID.
const PORTS: usize = 20;

/// A client's first Initial as rustls' QUIC client writes it (TLS 1.3, ALPN h3, transport
/// parameters with `initial_source_connection_id` = `scid`, RFC 9000 §7.3), to `dcid`
/// without a token.
fn real_initial(dcid: &[u8], scid: &[u8]) -> Vec<u8> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .expect("TLS 1.3")
        // The server's certificate is never looked at: only the first flight is sent.
        .with_root_certificates(rustls::RootCertStore::empty())
        .with_no_client_auth();
    config.alpn_protocols = vec![b"h3".to_vec()];
    // RFC 9000 §18.2: initial_source_connection_id (0x0f).
    let mut params = vec![0x0f, scid.len() as u8];
    params.extend_from_slice(scid);
    let name = rustls::pki_types::ServerName::try_from(SERVER_NAME).expect("a server name");
    let mut tls = rustls::quic::ClientConnection::new(
        Arc::new(config),
        rustls::quic::Version::V1,
        name,
        params,
    )
    .expect("a QUIC client");
    let mut hello = Vec::new();
    tls.write_hs(&mut hello);
    assert_eq!(hello.first(), Some(&1), "a ClientHello");
    initial_packet(dcid, dcid, scid, &[], 0, &crypto_frame(0, &hello))
}

/// The long-header packet type of a QUIC v1 datagram (RFC 9000 §17.2): Initial, 0-RTT,
/// Handshake or Retry.
fn packet_type(p: &[u8]) -> &'static str {
    match p.first() {
        Some(b) if b & 0x80 == 0 => "short-header",
        Some(b) => ["Initial", "0-RTT", "Handshake", "Retry"][usize::from((b >> 4) & 3)],
        None => "empty",
    }
}

/// The SCID and token of a QUIC v1 Retry sent to `dcid` (RFC 9000 §17.2.5); panics, naming
/// `what`, on anything else.
fn parse_retry(what: &str, p: &[u8], dcid: &[u8]) -> (Vec<u8>, Vec<u8>) {
    assert_eq!(
        packet_type(p),
        "Retry",
        "{what}: answered by a datagram of {} octets starting with a packet of type {}, not \
         by a Retry: a worker began a handshake",
        p.len(),
        packet_type(p)
    );
    assert_eq!(&p[1..5], &[0, 0, 0, 1], "{what}: not QUIC v1");
    let dl = usize::from(p[5]);
    assert_eq!(&p[6..6 + dl], dcid, "{what}: a Retry for another client");
    let sl = usize::from(p[6 + dl]);
    let scid = p[7 + dl..7 + dl + sl].to_vec();
    let token = p[7 + dl + sl..p.len() - 16].to_vec();
    assert!(!token.is_empty(), "{what}: a Retry without a token");
    (scid, token)
}

/// A UDP socket on a fresh loopback port whose receives wait at most 5 s.
fn fresh_socket() -> UdpSocket {
    let s = UdpSocket::bind("127.0.0.1:0").unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s
}

/// Sends `initial` from `sock` and returns the first datagram that comes back (within 5 s).
fn exchange(what: &str, rm: &Ringmux, sock: &UdpSocket, initial: &[u8]) -> Vec<u8> {
    sock.send_to(initial, rm.listen).unwrap();
    let mut buf = [0u8; 2048];
    let (n, from) = sock
        .recv_from(&mut buf)
        .unwrap_or_else(|e| panic!("{what}: no answer within 5 s: {e}"));
    assert_eq!(from, rm.listen, "{what}");
    buf[..n].to_vec()
}

fn forwarded(m: &Metrics, instances: u8) -> f64 {
    (0..instances)
        .map(|i| m.instance(names::FORWARDED, i))
        .sum()
}

fn retries_sent(m: &Metrics) -> f64 {
    m.labelled(names::RETRIES, "result", "sent")
}

/// Whether gtlsclient (Debian `ngtcp2-client`, installed by scripts/test.sh) can run here.
fn have_gtlsclient() -> bool {
    tool::GTLSCLIENT.present()
}

/// A client harvests a CID from the demux's Retry; token-less real Initials to it from 20
/// fresh source ports all get Retries (never a worker's Initial or Handshake), none reaches a
/// worker, and the metrics count them. Clients whose first Initial goes to that CID (ngtcp2's
/// gtlsclient and quinn) are then served through a Retry whose token carries our CID as the
/// original DCID, which quinn accepts and the clients check (RFC 9000 §7.3).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_less_initials_to_a_harvested_cid_get_retries_under_retry_always() {
    bounded(LIMIT, async {
        let rm = Ringmux::start(2, Forward::Shm, &["--retry", "always"]);

        // The harvest: a real first Initial to a DCID of the client's, answered by a Retry.
        let harvester = fresh_socket();
        let scid = harness::random_bytes(8);
        let odcid = harness::random_bytes(8);
        assert_eq!(rm.router.owner(&odcid), None, "an 8-byte DCID is nobody's");
        let reply = exchange("the harvest", &rm, &harvester, &real_initial(&odcid, &scid));
        let (harvested, _) = parse_retry("the harvest", &reply, &scid);
        assert!(
            rm.router.owner(&harvested).is_some(),
            "the Retry's SCID is not one of our CIDs"
        );
        let before = rm
            .wait_for(
                "the harvest's Retry counted",
                Duration::from_secs(10),
                |m| m.balanced() && retries_sent(m) == 1.0,
            )
            .await;

        // The attack: token-less real Initials to the harvested CID from fresh ports.
        let mut sockets = Vec::new();
        for i in 0..PORTS {
            let what = format!("port {i}");
            let sock = fresh_socket();
            let scid = harness::random_bytes(8);
            let reply = exchange(&what, &rm, &sock, &real_initial(&harvested, &scid));
            let (cid, _) = parse_retry(&what, &reply, &scid);
            assert_ne!(cid, harvested, "{what}: RFC 9000 §17.2.5.1");
            assert!(rm.router.owner(&cid).is_some(), "{what}: {}", hex(&cid));
            sockets.push(sock);
        }
        let n = 1.0 + PORTS as f64;
        let m = rm
            .wait_for("every Retry counted", Duration::from_secs(10), |m| {
                m.balanced() && retries_sent(m) == n
            })
            .await;
        assert_eq!(m.dropped("retry"), n, "{m}");
        assert_eq!(m.labelled(names::RETRIES, "result", "unsent"), 0.0, "{m}");
        assert_eq!(
            forwarded(&m, rm.instances),
            forwarded(&before, rm.instances),
            "an Initial to the harvested CID reached a worker:\n{m}"
        );
        assert_eq!(m.labelled(names::TOKENS, "result", "accepted"), 0.0, "{m}");
        // Nothing else came back: whatever is queued now is another Retry at most.
        for (i, sock) in sockets.iter().enumerate() {
            sock.set_nonblocking(true).unwrap();
            let mut buf = [0u8; 2048];
            while let Ok(n) = sock.recv(&mut buf) {
                assert_eq!(packet_type(&buf[..n]), "Retry", "port {i}: a late answer");
            }
        }

        // Real clients whose first Initial goes to the harvested CID: a Retry, then served.
        if have_gtlsclient() {
            let log = harness::gtls_get(&rm, &harvested, "/bytes/777").await;
            let lines: Vec<&str> = log.lines().collect();
            let tail = lines[lines.len().saturating_sub(40)..].join("\n");
            assert!(
                log.lines()
                    .any(|l| l.contains("pkt rx") && l.contains("type=Retry")),
                "gtlsclient received no Retry (last lines):\n{tail}"
            );
            assert!(
                log.contains("[:status: 200]") && !log.contains("ERR_"),
                "gtlsclient was not served (last lines):\n{tail}"
            );
            let tokens = |m: &Metrics| m.labelled(names::TOKENS, "result", "accepted");
            rm.wait_for("gtlsclient's Retry counted", Duration::from_secs(10), |m| {
                retries_sent(m) == n + 1.0 && tokens(m) >= 1.0
            })
            .await;
        }
        let mut client = rm.client();
        let cid = harvested.clone();
        client.set_initial_dst_cid_provider(Arc::new(move || ConnectionId::new(&cid)));
        let conn = rm.connect(&client).await;
        let resp = conn
            .get("/bytes/5000")
            .await
            .expect("GET through the Retry");
        check_bytes("quinn to the harvested CID", &resp, 5000);
        let m = rm.metrics();
        assert!(
            retries_sent(&m) >= n + 1.0 && m.labelled(names::TOKENS, "result", "accepted") >= 1.0,
            "the clients did not come through a Retry:\n{m}"
        );
        assert_eq!(m.dropped("token_refused"), 0.0, "{m}");
    })
    .await
}
