#!/usr/bin/env bash
# deploy/cluster.sh up|test|down [--bin DIR]: three ringmux nodes behind an nftables balancer
# made by `ringmux lb-config nftables`, all on this machine in network namespaces
# (docs/operators/cluster.md). Needs root, iproute2 (`ip netns`), nftables, and for `test`
# gtlsclient (ngtcp2-client), conntrack, curl, python3 with aioquic, and pebble (with
# pebble-challtestsrv).
#
#   rmx-client 10.77.0.2, fd77::2 ──veth── rmx-lb 10.77.0.1 = the VIP, fd77::1 = the IPv6 VIP
#                                          │  nftables: QUIC by CID to its node, new UDP 4-tuples
#                                          │  and new TCP connections (443, 80) hashed
#                            ┌──veth───────┼──────veth──┬──────veth──┐
#                  rmx-n1 10.77.1.2    rmx-n2 10.77.2.2     rmx-n3 10.77.3.2   (fd77:N::2)
#
# Each node runs DIR/ringmux (default target/debug) on [::]:443, QUIC and HTTPS over TCP, with
# plain-HTTP redirects on [::]:80 (--redirect-http), its own 8-byte --node-id, --plaintext-cids
# and one shared key file; its default route goes back through rmx-lb, whose connection
# tracking gives the replies the VIP's address. The rules balance UDP 443 and TCP 443 and 80
# (lb-config's --tcp-port 80). Addresses exist only inside these namespaces. The ACME CA of
# test step 9, Pebble, listens in rmx-client on 10.77.0.2 (ports 14000 and 15000): the nodes
# reach it through rmx-lb, and it reaches them as a client does, through the VIP.
#
#   up    clean up leftovers, then build the namespaces, start the nodes, apply the rules
#   test  up (nodes with --retry always), then: every packet length through the rules, 60+
#         connections spread over the nodes, 30 HTTPS connections over TCP spread likewise and
#         plain HTTP redirected, a NEW_TOKEN token of one node taken by another, active
#         migration and NAT rebinding, `ringmux upgrade` of a node under load, a drained node
#         (no new connection, QUIC or TCP, and a TCP download it was serving finishes) and a
#         removed one, IPv6 (QUIC and TCP); last, several nodes with one name: Pebble (an
#         ACME CA) and its DNS server in rmx-client, every name at the VIP, and the nodes
#         restarted with --config: one site, cluster.test, `acme = true` over TLS-ALPN-01, one
#         [acme] state folder for all three. One order in all (the node holding the site's
#         lock), the CA's validation answered by whichever nodes the balancer sends it to,
#         every node serving the one certificate: 30 HTTPS connections spread over the nodes
#         and HTTP/3 (aioquic), each verifying the chain against Pebble's root and the name,
#         all see one serial. Then down (also on failure; it stops Pebble too). Exit 0 only if
#         all passed.
#   down  stop the nodes, delete the namespaces and the state folder
#
# Every wait polls for an outcome with a bound; nothing sleeps in its place.
set -euo pipefail
cd "$(dirname "$0")/.."

usage() {
  echo "usage: $0 up|test|down [--bin DIR] [--retry auto|always|never]" >&2
  exit 2
}
(($# >= 1)) || usage
CMD=$1
shift
BIN=${RINGMUX_CLUSTER_BIN:-target/debug}
RETRY=auto
while (($#)); do
  case $1 in
    --bin) BIN=${2:?--bin needs a folder}; shift 2 ;;
    --retry) RETRY=${2:?--retry needs a mode}; shift 2 ;;
    *) usage ;;
  esac
done
BIN=$(cd "$BIN" && pwd)
STATE=${RMX_CLUSTER_DIR:-/tmp/rmx-cluster}
NS_CLIENT=rmx-client
NS_LB=rmx-lb
NODES=(1 2 3)
# 8-byte node IDs ("ringmux" and the node's number): what AWS NLB's QuicServerId would hold.
node_id() { printf '72696e676d7578%02x' "$1"; }
VIP=10.77.0.1
VIP6=fd77::1
PORT=443
HTTP_PORT=80
TABLE=ringmux
URL="https://$VIP:$PORT"

say() { echo "== cluster: $*"; }
fail() {
  echo "cluster: FAILED: $*" >&2
  exit 1
}
in_ns() {
  local ns=$1
  shift
  ip netns exec "$ns" "$@"
}

# ---------------------------------------------------------------------------------------------
# down / up

down() {
  local ns pid
  stop_pebble
  for n in "${NODES[@]}"; do
    if [[ -f $STATE/n$n.pid ]]; then
      pid=$(cat "$STATE/n$n.pid")
      # Only our own demux: the process whose command line is the ringmux we started.
      if [[ -r /proc/$pid/cmdline ]] && tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q -- "--node-id $(node_id "$n")"; then
        kill "$pid" 2>/dev/null || true
      fi
    fi
  done
  for ns in "$NS_CLIENT" "$NS_LB" "${NODES[@]/#/rmx-n}"; do
    if ip netns list | grep -qw "^$ns"; then
      # Whatever is left inside our namespaces is ours (the demuxes' workers, a client).
      for pid in $(ip netns pids "$ns" 2>/dev/null); do
        kill -9 "$pid" 2>/dev/null || true
      done
      ip netns del "$ns"
    fi
  done
  rm -rf "$STATE"
}

# Polls `$@` until it succeeds, at most $1 tries of 100 ms: a bound, not a delay.
poll() {
  local tries=$1
  shift
  local i
  for ((i = 0; i < tries; i++)); do
    if "$@"; then return 0; fi
    sleep 0.1
  done
  return 1
}

link() { # link NS_A IF_A ADDR_A NS_B IF_B ADDR_B ADDR6_A ADDR6_B
  ip link add "$2" netns "$1" type veth peer name "$5" netns "$4"
  in_ns "$1" ip addr add "$3/24" dev "$2"
  in_ns "$4" ip addr add "$6/24" dev "$5"
  in_ns "$1" ip -6 addr add "$7/64" dev "$2" nodad
  in_ns "$4" ip -6 addr add "$8/64" dev "$5" nodad
  in_ns "$1" ip link set "$2" up
  in_ns "$4" ip link set "$5" up
}

# The ruleset for the nodes given as arguments (numbers), plus lb-config options after `--`.
ruleset() {
  local args=(lb-config nftables --plaintext-cids --vip "$VIP:$PORT" --tcp-port "$HTTP_PORT"
    --table "$TABLE")
  while (($#)) && [[ $1 != -- ]]; do
    args+=(--node "$(node_id "$1")=10.77.$1.2")
    shift
  done
  (($#)) && shift
  "$BIN/ringmux" "${args[@]}" "$@"
}
ruleset6() {
  local args=(lb-config nftables --plaintext-cids --vip "[$VIP6]:$PORT" --tcp-port "$HTTP_PORT"
    --table "$TABLE")
  for n in "${NODES[@]}"; do args+=(--node "$(node_id "$n")=fd77:$n::2"); done
  "$BIN/ringmux" "${args[@]}"
}
apply() { # apply FILE
  in_ns "$NS_LB" nft -f "$1" || fail "nft -f $1 refused the ruleset"
}

# forget_node N [udp]: the balancer's NAT mappings to node N deleted (with udp, its UDP ones
# only). The rules pick a node for a flow's first packet only; later packets of that 4-tuple
# follow its conntrack entry (up to 120 s after its last packet), so a new QUIC connection from
# a source port an earlier one to node N used would still reach node N after it was drained or
# removed. Without the mappings, every packet meets the rules again: a QUIC connection of node
# N keeps reaching it by its connection IDs. A TCP connection has nothing else to reach its
# node by: a drained node's are kept (udp), to finish there; a removed node's go.
forget_node() {
  local proto=()
  [[ ${2:-} == udp ]] && proto=(-p udp)
  in_ns "$NS_LB" conntrack -D "${proto[@]}" -r "10.77.$1.2" >/dev/null 2>&1 || true
  in_ns "$NS_LB" conntrack -D -f ipv6 "${proto[@]}" -r "fd77:$1::2" >/dev/null 2>&1 || true
}

up() {
  [[ -x $BIN/ringmux && -x $BIN/ringmux-worker ]] ||
    fail "$BIN/ringmux and ringmux-worker are missing: cargo build --workspace --bins, or --bin DIR"
  say "cleaning leftovers"
  down
  mkdir -p "$STATE"
  chmod 700 "$STATE"
  "$BIN/ringmux" new-key-file "$STATE/keys"

  say "namespaces $NS_CLIENT, $NS_LB, rmx-n1..3 and their veth pairs"
  for ns in "$NS_CLIENT" "$NS_LB" "${NODES[@]/#/rmx-n}"; do
    ip netns add "$ns"
    in_ns "$ns" ip link set lo up
  done
  link "$NS_CLIENT" c0 10.77.0.2 "$NS_LB" c0 "$VIP" fd77::2 "$VIP6"
  in_ns "$NS_CLIENT" ip route add default via "$VIP"
  in_ns "$NS_CLIENT" ip -6 route add default via "$VIP6"
  for n in "${NODES[@]}"; do
    link "rmx-n$n" lb0 "10.77.$n.2" "$NS_LB" "n$n" "10.77.$n.1" "fd77:$n::2" "fd77:$n::1"
    in_ns "rmx-n$n" ip route add default via "10.77.$n.1"
    in_ns "rmx-n$n" ip -6 route add default via "fd77:$n::1"
  done
  in_ns "$NS_LB" sysctl -q -w net.ipv4.ip_forward=1 net.ipv6.conf.all.forwarding=1
  # Clients' own ports from 32768 up: the packet sweeps pick theirs below.
  in_ns "$NS_CLIENT" sysctl -q -w net.ipv4.ip_local_port_range="32768 60999"

  say "rules: ringmux lb-config nftables (IPv4 and IPv6)"
  ruleset "${NODES[@]}" >"$STATE/rules.nft"
  ruleset6 >"$STATE/rules6.nft"
  apply "$STATE/rules.nft"
  apply "$STATE/rules6.nft"

  # As root ringmux runs its workers as nobody, who must reach the worker binary.
  USER_ARGS=()
  if ! setpriv --reuid=65534 --regid=65534 --clear-groups -- test -x "$BIN/ringmux-worker" 2>/dev/null; then
    echo "note: $BIN/ringmux-worker is not executable by nobody: workers run as root (--worker-user root)"
    USER_ARGS=(--worker-user root)
  fi
  for n in "${NODES[@]}"; do start_node "$n"; done
  for n in "${NODES[@]}"; do node_ready "$n"; done
  say "up: VIP $URL (QUIC and TCP), http://$VIP:$HTTP_PORT and the same on [$VIP6]; state in $STATE"
}

# Starts node $1's ringmux in its namespace with the flags every node has, and the options
# given after $1 (--config FILE); its output in $STATE/n$1.log, its pid in $STATE/n$1.pid.
start_node() { # start_node N [OPTION...]
  local n=$1
  shift
  say "node $n: ringmux --node-id $(node_id "$n") --retry $RETRY${*:+ $*}"
  mkdir -p "$STATE/n$n"
  # Not in_ns, a function, which would run in a subshell of its own: $! is ringmux's pid.
  ip netns exec "rmx-n$n" env RUST_LOG="${RUST_LOG:-info}" NO_COLOR=1 "$BIN/ringmux" \
    --listen "[::]:$PORT" --redirect-http "[::]:$HTTP_PORT" --instances 2 \
    --node-id "$(node_id "$n")" --plaintext-cids --key-file "$STATE/keys" \
    --retry "$RETRY" --metrics 127.0.0.1:9433 \
    --control-socket "$STATE/n$n/control.sock" "${USER_ARGS[@]}" "$@" \
    </dev/null >"$STATE/n$n.log" 2>&1 &
  echo $! >"$STATE/n$n.pid"
  # Stopped by stop_node or down: no job notice of its end.
  disown
}
node_ready() { # node_ready N
  poll 300 grep -q "^ringmux ready" "$STATE/n$1.log" ||
    { tail -n 30 "$STATE/n$1.log" >&2; fail "node $1 did not get ready within 30 s"; }
}
# Stops node $1's ringmux (SIGTERM: its workers drain) and waits until nothing runs in its
# namespace any more, so that a new one can take its ports; its log is kept as n$1.log.N.
stop_node() { # stop_node N
  local n=$1 pid
  pid=$(cat "$STATE/n$n.pid")
  kill "$pid" 2>/dev/null || true
  poll 300 ns_empty "rmx-n$n" || fail "node $n's ringmux (pid $pid) did not exit within 30 s of SIGTERM"
  local k=0
  while [[ -e $STATE/n$n.log.$k ]]; do k=$((k + 1)); done
  mv "$STATE/n$n.log" "$STATE/n$n.log.$k"
}
ns_empty() { [[ -z $(ip netns pids "$1") ]]; }

# ---------------------------------------------------------------------------------------------
# The ACME CA of test step 9: Pebble (Let's Encrypt's test CA, Debian's `pebble`) and its DNS
# server pebble-challtestsrv, in the client namespace: the CA is outside, behind the VIP like
# any client. The DNS server answers every name with the VIP, so Pebble's validator connects
# to the VIP's port 443 (TLS-ALPN-01) through the balancer, to whichever node it picks. The
# nodes reach Pebble's API at 10.77.0.2 by their default route through rmx-lb. (As
# test-tools/testkit/src/pebble.rs starts them on loopback for systests/tests/system/acme/issuance.rs.)

PEBBLE=$STATE/pebble
PEBBLE_ADDR=10.77.0.2
PEBBLE_DIRECTORY="https://$PEBBLE_ADDR:14000/dir"
PEBBLE_MANAGEMENT="https://$PEBBLE_ADDR:15000"
ACME_SITE=cluster.test

# A root and, under it, the certificate of Pebble's own HTTPS (ACME API and management) for
# its address: python3 -c "$API_CERTIFICATE" DIR ADDRESS writes DIR/api-root.pem (what the
# nodes' [acme] ca_roots trusts), api-cert.pem and api-key.pem. (cryptography comes with
# aioquic; openssl may be missing.)
API_CERTIFICATE='
import datetime, ipaddress, sys
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

out, address = sys.argv[1], sys.argv[2]
now = datetime.datetime.now(datetime.timezone.utc)

def named(cn):
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

def usage(ca):
    return x509.KeyUsage(digital_signature=True, content_commitment=False,
                         key_encipherment=False, data_encipherment=False, key_agreement=False,
                         key_cert_sign=ca, crl_sign=ca, encipher_only=False,
                         decipher_only=False)

def made(subject, issuer, key, signer, ca):
    b = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer)
         .public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(now - datetime.timedelta(hours=1))
         .not_valid_after(now + datetime.timedelta(days=2))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
         .add_extension(usage(ca), critical=True))
    if not ca:
        b = (b.add_extension(x509.SubjectAlternativeName(
                 [x509.IPAddress(ipaddress.ip_address(address))]), critical=False)
             .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]),
                            critical=False))
    return b.sign(signer, hashes.SHA256())

def write(name, data):
    with open(out + "/" + name, "wb") as f:
        f.write(data)

root_key = ec.generate_private_key(ec.SECP256R1())
root_name = named("ringmux cluster.sh: Pebble API root")
root = made(root_name, root_name, root_key, root_key, True)
key = ec.generate_private_key(ec.SECP256R1())
leaf = made(named("Pebble at " + address), root_name, key, root_key, False)
write("api-root.pem", root.public_bytes(serialization.Encoding.PEM))
write("api-cert.pem", leaf.public_bytes(serialization.Encoding.PEM))
write("api-key.pem", key.private_bytes(serialization.Encoding.PEM,
                                       serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
'

# Starts pebble-challtestsrv and Pebble in the client namespace and waits until Pebble's API
# answers there and from every node; writes Pebble's issuing root (GET /roots/0 of its
# management interface, new with every start) to $PEBBLE/issuer.pem.
start_pebble() {
  if ! command -v pebble >/dev/null || ! command -v pebble-challtestsrv >/dev/null; then
    fail "pebble or pebble-challtestsrv is missing (apt-get install pebble)"
  fi
  mkdir -p "$PEBBLE"
  python3 -c "$API_CERTIFICATE" "$PEBBLE" "$PEBBLE_ADDR" ||
    fail "python3's cryptography could not make Pebble's API certificate"
  cat >"$PEBBLE/pebble.json" <<EOF
{
  "pebble": {
    "listenAddress": "$PEBBLE_ADDR:14000",
    "managementListenAddress": "$PEBBLE_ADDR:15000",
    "certificate": "$PEBBLE/api-cert.pem",
    "privateKey": "$PEBBLE/api-key.pem",
    "httpPort": $HTTP_PORT,
    "tlsPort": $PORT,
    "ocspResponderURL": "",
    "externalAccountBindingRequired": false
  }
}
EOF
  say "Pebble's DNS server: every name is $VIP (the VIP), no AAAA"
  ip netns exec "$NS_CLIENT" pebble-challtestsrv -defaultIPv4 "$VIP" -defaultIPv6 "" \
    -dns01 127.0.0.1:8053 -http01 "" -https01 "" -tlsalpn01 "" -management 127.0.0.1:8055 \
    </dev/null >"$PEBBLE/challtestsrv.log" 2>&1 &
  echo $! >"$PEBBLE/challtestsrv.pid"
  disown
  say "Pebble: ACME at $PEBBLE_DIRECTORY, validating on the VIP's TCP $PORT and $HTTP_PORT"
  # No sleep before each validation (Pebble's default waits up to 15 s at random).
  ip netns exec "$NS_CLIENT" env PEBBLE_VA_NOSLEEP=1 pebble -config "$PEBBLE/pebble.json" \
    -dnsserver 127.0.0.1:8053 </dev/null >"$PEBBLE/pebble.log" 2>&1 &
  echo $! >"$PEBBLE/pebble.pid"
  disown
  poll 300 pebble_answers "$NS_CLIENT" ||
    { tail -n 20 "$PEBBLE/pebble.log" "$PEBBLE/challtestsrv.log" >&2; fail "Pebble did not answer at $PEBBLE_DIRECTORY within 30 s"; }
  for n in "${NODES[@]}"; do
    pebble_answers "rmx-n$n" ||
      fail "node $n cannot reach Pebble at $PEBBLE_DIRECTORY (its route goes through $NS_LB)"
  done
  in_ns "$NS_CLIENT" curl -sSf --max-time 5 --cacert "$PEBBLE/api-root.pem" \
    -o "$PEBBLE/issuer.pem" "$PEBBLE_MANAGEMENT/roots/0" ||
    fail "Pebble's management interface did not give its issuing root ($PEBBLE_MANAGEMENT/roots/0)"
  grep -q "BEGIN CERTIFICATE" "$PEBBLE/issuer.pem" ||
    fail "$PEBBLE_MANAGEMENT/roots/0 is not a certificate: $(head -c 200 "$PEBBLE/issuer.pem")"
  echo "Pebble answers in $NS_CLIENT and from every node; its issuing root is in $PEBBLE/issuer.pem"
}
# Whether Pebble's directory answers from namespace $1, over HTTPS verified by the API root.
pebble_answers() {
  in_ns "$1" curl -sf --max-time 2 --cacert "$PEBBLE/api-root.pem" -o /dev/null "$PEBBLE_DIRECTORY"
}
# Stops Pebble and its DNS server, if they are ours (down removes their files with $STATE).
stop_pebble() {
  local name pid
  for name in pebble challtestsrv; do
    [[ -f $PEBBLE/$name.pid ]] || continue
    pid=$(cat "$PEBBLE/$name.pid")
    if [[ -r /proc/$pid/cmdline ]] && tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q '^pebble'; then
      kill "$pid" 2>/dev/null || true
    fi
  done
}

# ---------------------------------------------------------------------------------------------
# test

# The sum of a metric's samples whose line starts with $2 on node $1.
metric() {
  in_ns "rmx-n$1" curl -sf --max-time 5 http://127.0.0.1:9433/metrics |
    awk -v m="$2" 'index($0, m) == 1 { s += $NF } END { printf "%d\n", s }'
}
accepted() { metric "$1" 'ringmux_worker_connections_accepted_total{'; }
accepted_all() { for n in "${NODES[@]}"; do accepted "$n"; done | paste -sd' '; }
# TCP connections the nodes' workers accepted, HTTPS and plain HTTP (names.rs
# WORKER_TCP_CONNECTIONS), as accepted_all counts QUIC ones.
tcp_all() {
  for n in "${NODES[@]}"; do metric "$n" 'ringmux_worker_tcp_connections_total'; done | paste -sd' '
}
# Field $1 of the space-separated counts $2 (node $1's).
nth() { cut -d' ' -f"$1" <<<"$2"; }
# The sum of the space-separated counts $1.
sum_of() {
  local s=0 c
  for c in $1; do s=$((s + c)); done
  echo "$s"
}
# The balancer's counters $1_ID (cid, hash, tcp) of every node, in table ip or ip6 ($2, default
# ip), space-separated; 0 for a node the table has no counter for (removed).
lb_counts() { # lb_counts PREFIX [ip|ip6]
  local ids=() n
  for n in "${NODES[@]}"; do ids+=("$1_$(node_id "$n")"); done
  in_ns "$NS_LB" nft -j list counters table "${2:-ip}" "$TABLE" |
    python3 -c '
import json, sys
c = {o["counter"]["name"]: o["counter"]["packets"] for o in json.load(sys.stdin)["nftables"] if "counter" in o}
print(" ".join(str(c.get(n, 0)) for n in sys.argv[1:]))' "${ids[@]}"
}
# Whether the balancer's $1 counters differ from the counts $2.
lb_moved() { [[ $(lb_counts "$1") != "$2" ]]; }
# A balancer counter's packets.
counter() {
  in_ns "$NS_LB" nft -j list counter ip "$TABLE" "$1" |
    python3 -c 'import json,sys; print([o["counter"]["packets"] for o in json.load(sys.stdin)["nftables"] if "counter" in o][0])'
}

# One HTTPS request over a new TCP connection from the client namespace (curl; the nodes' own
# self-signed certificate, so unchecked): prints the status and the HTTP version.
https_get() { # https_get URL
  in_ns "$NS_CLIENT" curl -skg --http2 --max-time 5 -o /dev/null -w '%{http_code} %{http_version}' "$1"
}
# One plain-HTTP request to HOST:80 (the nodes' --redirect-http): prints the status and the
# Location.
http_get() { # http_get HOST
  in_ns "$NS_CLIENT" curl -sg --max-time 5 -o /dev/null -w '%{http_code} %{redirect_url}' \
    "http://$1:$HTTP_PORT/hello.txt?q=1"
}

# One gtlsclient run from the client namespace; its log in $STATE/gtls.log (or $GTLS_LOG).
# The request's URL is https://VIP:PORT/PATH, or $GTLS_URL (its authority is the request's
# host, the connection still goes to the VIP).
gtls() {
  local host=$VIP
  if [[ $1 == -6 ]]; then host=$VIP6; shift; fi
  local path=$1
  shift
  local url="https://$host:$PORT$path"
  [[ $host == *:* ]] && url="https://[$host]:$PORT$path"
  url=${GTLS_URL:-$url}
  in_ns "$NS_CLIENT" gtlsclient --exit-on-all-streams-close --no-quic-dump --no-http-dump \
    --timeout=10s --handshake-timeout=5s "$@" "$host" "$PORT" "$url" >"${GTLS_LOG:-$STATE/gtls.log}" 2>&1 || true
}
# gtlsclient exits 0 even on a handshake timeout: success is read from its log. $1 requests
# (default 1), in log $2.
gtls_ok() {
  local want=${1:-1} log=${2:-$STATE/gtls.log}
  (($(grep -c '\[:status: 200\]' "$log") == want)) &&
    (($(grep -c 'closed with error code 256' "$log") == want)) &&
    ! grep -q 'ERR_' "$log"
}
gtls_must() { # gtls_must WHAT ARGS...
  local what=$1
  shift
  gtls "$@"
  gtls_ok || { tail -n 30 "$STATE/gtls.log" >&2; fail "$what: the request did not complete"; }
}

# A QUIC connection by aioquic that waits for the server's NEW_TOKEN token and prints it as
# hex: python3 -c "$TOKEN_CLIENT" HOST PORT [TOKEN_HEX to present in its first Initial].
# (gtlsclient 0.12's --token-file cannot read back the file it writes.)
TOKEN_CLIENT='
import asyncio, ssl, sys
from aioquic.asyncio import connect
from aioquic.h3.connection import H3_ALPN
from aioquic.quic.configuration import QuicConfiguration

async def main(host, port, token):
    got = []
    cfg = QuicConfiguration(is_client=True, alpn_protocols=H3_ALPN, server_name="localhost",
                            verify_mode=ssl.CERT_NONE)
    if token:
        cfg.token = bytes.fromhex(token)
    async with connect(host, port, configuration=cfg, token_handler=got.append) as conn:
        await conn.ping()
        for _ in range(100):  # the token comes after the handshake: at most 2 s
            if got:
                break
            await asyncio.sleep(0.02)
    if not got:
        sys.exit("no NEW_TOKEN token within 2 s of the handshake")
    print(got[-1].hex())

asyncio.run(asyncio.wait_for(main(sys.argv[1], int(sys.argv[2]), (sys.argv[3:] or [""])[0]), 15))
'

# Every UDP payload length from 0 up through the rules: short and long headers with each
# node's CID, with an unknown node ID, long headers whose DCID length octet lies, and garbage.
# Each probe comes from a port of its own, counted up from $1 below the client's ephemeral
# range (a new 4-tuple, so it meets the rules, not a conntrack entry), and must move exactly the balancer counter that the packet layout says:
# cid_ID of its node, unknown_node, or one hash_ID.
sweep() { # sweep FIRST_PORT UNKNOWN_ID DRAINING_NODE|0 NODES_IN_MAP...
  local first_port=$1 unknown=$2 draining=$3
  shift 3
  local ids=() n
  for n in "$@"; do ids+=("$(node_id "$n")"); done
  local all=()
  for n in "${NODES[@]}"; do all+=("$(node_id "$n")"); done
  in_ns "$NS_CLIENT" python3 - "$VIP" "$PORT" "$NS_LB" "$TABLE" "$first_port" "$unknown" "$(node_id "$draining")" \
    "$(IFS=,; echo "${ids[*]}")" "$(IFS=,; echo "${all[*]}")" <<'PY'
import json, os, socket, subprocess, sys, time

vip, port, lb_ns, table = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
next_port, unknown, draining = int(sys.argv[5]), bytes.fromhex(sys.argv[6]), sys.argv[7]
in_map = [bytes.fromhex(i) for i in sys.argv[8].split(",")]
probe_ids = [bytes.fromhex(i) for i in sys.argv[9].split(",")]
id_len = len(in_map[0])
nonce = 16 - id_len - 1 if id_len <= 11 else 4   # ringmux's default --nonce-len
cid_len = 1 + id_len + 1 + nonce
first = cid_len - 1                                 # config 0, self-described length

def counters():
    out = subprocess.run(["ip", "netns", "exec", lb_ns, "nft", "-j", "list", "counters",
                          "table", "ip", table], check=True, capture_output=True).stdout
    return {o["counter"]["name"]: o["counter"]["packets"]
            for o in json.loads(out)["nftables"] if "counter" in o}

def cid(node):
    return bytes([first]) + node + b"\x05" + os.urandom(nonce)

def short(node):
    return bytes([0x40 | (os.urandom(1)[0] & 0x3f)]) + cid(node) + os.urandom(24)

def long(node, dcid_len_octet=None):
    d = cid(node)
    n = len(d) if dcid_len_octet is None else dcid_len_octet
    return b"\xc0\x00\x00\x00\x01" + bytes([n]) + d + b"\x08" + os.urandom(8) + os.urandom(16)

def expected(p):
    """What the rules must do with payload p, from the packet layout alone."""
    if len(p) >= 1 + cid_len and p[0] & 0x80 == 0 and p[1] == first:
        node = p[2:2 + id_len]
        return "cid_" + node.hex() if node in in_map else "unknown_node"
    if len(p) >= 7 + cid_len and p[0] & 0x80 and p[5] == cid_len and p[6] == first:
        node = p[7:7 + id_len]
        if node in in_map:
            return "cid_" + node.hex()
    return "hash"

templates = []
for node in probe_ids + [unknown]:
    templates += [("short " + node.hex(), short(node)), ("long " + node.hex(), long(node))]
for lie in (cid_len - 1, cid_len + 1, 20, 0):
    templates.append(("long, DCID length octet %d" % lie, long(probe_ids[0], lie)))
templates.append(("garbage", os.urandom(64)))

top = 7 + cid_len + 8
socks, seen, checked = [], {}, 0
before = counters()
for name, full in templates:
    for length in range(0, top + 1):
        p = full[:length]
        want = expected(p)
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.bind(("0.0.0.0", next_port))
        next_port += 1
        socks.append(s)
        s.sendto(p, (vip, port))
        deadline = time.monotonic() + 5
        while True:
            now = counters()
            moved = {k: now[k] - before.get(k, 0) for k in now if now[k] != before.get(k, 0)}
            if sum(moved.values()) >= 1 or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        before = now
        got = list(moved)[0] if len(moved) == 1 else None
        ok = (got is not None and moved[got] == 1 and
              (got == want or (want == "hash" and got.startswith("hash_")
                               and got != "hash_" + draining)))
        if not ok:
            sys.exit("sweep: %s cut to %d bytes (%s): expected %s, counters moved %s"
                     % (name, length, p.hex(), want, moved or "none within 5 s"))
        seen[want] = seen.get(want, 0) + 1
        checked += 1
for s in socks:
    s.close()
print("sweep: %d probes (%d templates x lengths 0..%d) each met the rule its layout asks: %s"
      % (checked, len(templates), top, ", ".join("%s %d" % kv for kv in sorted(seen.items()))))
PY
}

# The nodes' accepted connections, QUIC (accepted_all, the default) or TCP (tcp_all) as $3
# says (workers report their counters once a second): polls until they add up to $1 more than
# the space-separated counts in $2, then prints the counts.
settled() { # settled MORE BEFORE [accepted_all|tcp_all]
  poll 50 adds_up "$1" "$2" "${3:-accepted_all}" ||
    fail "the nodes' accepted connections (${3:-accepted_all}) did not add up to $1 more than ($2) within 5 s: ($NOW)"
  echo "$NOW"
}
# Whether the nodes' accepted connections (NOW, by $3) are $1 more in all than the counts in $2.
adds_up() {
  NOW=$($3)
  local sum=0 n
  for n in "${NODES[@]}"; do
    sum=$((sum + $(cut -d' ' -f"$n" <<<"$NOW") - $(cut -d' ' -f"$n" <<<"$2")))
  done
  ((sum == $1))
}
# Which node took the one connection between counts $1 and $2.
took() {
  local n
  for n in "${NODES[@]}"; do
    if (($(cut -d' ' -f"$n" <<<"$2") > $(cut -d' ' -f"$n" <<<"$1"))); then echo "$n"; fi
  done
}

# Runs gtlsclient connections, $1 first, then 10 more at a time until every node in $4..
# got at least $3 new ones (at most $2 in all); each must complete, and the nodes must count
# exactly that many. Sets SPREAD to the per-node counts.
spread() { # spread MIN MAX_TOTAL PER_NODE_MIN NODES...
  local min=$1 max=$2 per=$3
  shift 3
  local nodes=("$@") n i=0 batch=$min before now low
  before=$(accepted_all)
  while :; do
    local j
    for ((j = 0; j < batch; j++)); do
      i=$((i + 1))
      gtls_must "connection $i" /hello.txt
    done
    now=$(settled "$i" "$before")
    low=0
    for n in "${nodes[@]}"; do
      (($(cut -d' ' -f"$n" <<<"$now") - $(cut -d' ' -f"$n" <<<"$before") >= per)) || low=1
    done
    ((low == 1 && i + 10 <= max)) || break
    batch=10
  done
  SPREAD=""
  for n in "${NODES[@]}"; do
    SPREAD+=" node$n=$(($(cut -d' ' -f"$n" <<<"$now") - $(cut -d' ' -f"$n" <<<"$before")))"
  done
  echo "$i connections:$SPREAD"
  ((low == 0)) || fail "some node got fewer than $per of $i connections:$SPREAD"
}

# HTTPS over TCP: $1 new connections to the VIP (a curl each), each a 200 over HTTP/2. Every
# node in $3.. must get at least $2 of them and every other node none, by the balancer's tcp_ID
# counters and by the nodes' own counts alike. Sets SPREAD to the per-node counts.
tcp_spread() { # tcp_spread COUNT PER_NODE_MIN NODES...
  local total=$1 per=$2
  shift 2
  local want=" $* " before after lb0 lb1 n i got mine sent
  before=$(tcp_all)
  lb0=$(lb_counts tcp)
  for ((i = 1; i <= total; i++)); do
    got=$(https_get "$URL/hello.txt") || fail "HTTPS connection $i over TCP to $URL failed (curl $?)"
    [[ $got == "200 2" ]] || fail "HTTPS connection $i over TCP: got '$got', not 200 over HTTP/2"
  done
  after=$(settled "$total" "$before" tcp_all)
  lb1=$(lb_counts tcp)
  SPREAD=""
  for n in "${NODES[@]}"; do
    mine=$(($(nth "$n" "$after") - $(nth "$n" "$before")))
    sent=$(($(nth "$n" "$lb1") - $(nth "$n" "$lb0")))
    SPREAD+=" node$n=$mine"
    ((mine == sent)) || fail "node $n accepted $mine TCP connections, the balancer sent it $sent"
  done
  echo "$total HTTPS connections over TCP:$SPREAD"
  for n in "${NODES[@]}"; do
    mine=$(($(nth "$n" "$after") - $(nth "$n" "$before")))
    if [[ $want == *" $n "* ]]; then
      ((mine >= per)) || fail "node $n got fewer than $per of $total TCP connections:$SPREAD"
    else
      ((mine == 0)) || fail "node $n got TCP connections it should not have:$SPREAD"
    fi
  done
}

# Step 9's configuration: one site, cluster.test, whose certificate comes from Pebble over
# TLS-ALPN-01, its state in one folder shared by the three nodes (the nodes' other options
# stay on their command lines, which win over the file).
write_acme_config() {
  cat >"$STATE/acme.toml" <<EOF
default_site = "$ACME_SITE"

[acme]
directory = "$PEBBLE_DIRECTORY"
email = "ops@$ACME_SITE"
state = "$STATE/acme"
challenge = "tls-alpn-01"
ca_roots = "$PEBBLE/api-root.pem"

[[site]]
names = ["$ACME_SITE"]
acme = true

  [[site.route]]
  path = "/"
  respond = { status = 200, body = "cluster\n" }
EOF
}
# The sum over the nodes of the samples of metric lines starting with $1.
metric_all() {
  local n s=0
  for n in "${NODES[@]}"; do s=$((s + $(metric "$n" "$1"))); done
  echo "$s"
}
# Whether every node's metrics show the ACME site's certificate (its expiry).
certified() {
  local n
  for n in "${NODES[@]}"; do
    (($(metric "$n" "ringmux_certificate_expiry_seconds{site=\"$ACME_SITE\"") > 0)) || return 1
  done
}
# Whether node $1's log has at least $3 lines matching $2 (its workers' log lines are there).
logged() { (($(grep -c -- "$2" "$STATE/n$1.log" || true) >= $3)); }
# Milliseconds since $1, an $EPOCHREALTIME.
ms_since() {
  local now=${EPOCHREALTIME//[.,]/} then=${1//[.,]/}
  echo $(((now - then) / 1000))
}
# The leaf's serial from curl's %{certs} ($1): lower-case hex, no colons or leading zeros
# (as aioquic_client.py prints it).
leaf_serial() {
  local line
  line=$(grep -m1 '^Serial Number:' <<<"$1") || return 1
  line=$(tr -cd '0-9a-fA-F' <<<"${line#Serial Number:}" | tr 'A-F' 'a-f')
  while [[ $line == 0?* ]]; do line=${line#0}; done
  echo "${line:-0}"
}

# One HTTPS request to https://cluster.test/ over a new TCP connection from the client
# namespace, by its name at the VIP, the chain verified against Pebble's issuing root (no -k):
# must be a 200 with the route's body; prints the leaf's serial.
acme_https_get() { # acme_https_get WHAT
  local out body rest
  out=$(in_ns "$NS_CLIENT" curl -sS --http2 --max-time 10 --cacert "$PEBBLE/issuer.pem" \
    --resolve "$ACME_SITE:$PORT:$VIP" -w '~~~%{http_code}\n%{certs}' "https://$ACME_SITE/") ||
    fail "$1: curl https://$ACME_SITE/ at $VIP failed, or the chain did not verify (curl $?)"
  body=${out%%~~~*}
  rest=${out#*~~~}
  [[ ${rest%%$'\n'*} == 200 && $body == $'cluster\n' ]] ||
    fail "$1: https://$ACME_SITE/ answered ${rest%%$'\n'*} with '$body', not 200 'cluster'"
  leaf_serial "$rest" || fail "$1: curl's %{certs} has no Serial Number: ${rest:0:300}"
}
# One HTTP/3 request to https://cluster.test/ at the VIP by aioquic (test-tools/testkit/
# aioquic_client.py), the chain verified against Pebble's issuing root and the name: must be a
# 200 with the route's body; prints the leaf's serial.
acme_h3_get() { # acme_h3_get WHAT
  local out
  out=$(in_ns "$NS_CLIENT" python3 test-tools/testkit/aioquic_client.py "$VIP" "$PORT" paths \
    --server-name "$ACME_SITE" --ca-certs "$PEBBLE/issuer.pem" --path /) ||
    fail "$1: aioquic_client.py failed: $(tail -n 5 <<<"$out")"
  tail -n 1 <<<"$out" | python3 -c '
import json, sys
j = json.load(sys.stdin)
if not j.get("ok"):
    sys.exit("%s: aioquic: %s" % (sys.argv[1], j.get("error")))
status, text = j["bodies"][0].split(" ")[1], j["texts"][0]
if status != "200" or text != "cluster\n":
    sys.exit("%s: HTTP/3 answered %s with %r, not 200 cluster" % (sys.argv[1], status, text))
print(j["peer"]["serial"].lstrip("0") or "0")' "$1" || fail "$1 over HTTP/3 failed"
}

# Connections of 4 requests each, one after the other, until $STATE/stop exists (at most 300):
# one line ok or FAIL each in $STATE/load$1.results.
load_loop() {
  local k=$1 i
  for ((i = 0; i < 300; i++)); do
    [[ -e $STATE/stop ]] && break
    GTLS_LOG=$STATE/load$k.log gtls /hello.txt -n 4
    if gtls_ok 4 "$STATE/load$k.log"; then
      echo ok
    else
      echo FAIL
      cp "$STATE/load$k.log" "$STATE/load$k.fail.$i"
    fi
  done >"$STATE/load$k.results"
}
# Whether every load loop has finished 2 connections.
loads_running() {
  local k
  for k in 1 2 3 4; do
    [[ -f $STATE/load$k.results ]] && (($(wc -l <"$STATE/load$k.results") >= 2)) || return 1
  done
}
# Whether node $1 has served more requests than $2.
serves_more() { (($(metric "$1" 'ringmux_worker_requests_total{') > $2)); }

# Whether every node's TCP connections (tcp_all, NOW) grew since the counts $1 by at least as
# many as the balancer sent it between its tcp_ID counts $2 and $3.
tcp_counted() { # tcp_counted BEFORE LB_BEFORE LB_AFTER
  NOW=$(tcp_all)
  local n
  for n in "${NODES[@]}"; do
    (($(nth "$n" "$NOW") - $(nth "$n" "$1") >= $(nth "$n" "$3") - $(nth "$n" "$2"))) || return 1
  done
}

# Step 9: several nodes, one name. The nodes restarted with one ACME site and one state folder
# for all three; Pebble outside, behind the VIP. One node orders (it holds the site's lock),
# every node answers the pending challenge (the CA's validation reaches whichever node the
# balancer picks) and serves the one certificate.
several_nodes_one_name() {
  local n i t0 ms lb0 lb1 tcp0 quic0 issued failed ordered="" validated="" spread serial
  local serials=()
  start_pebble
  write_acme_config
  say "restarting the nodes with --config $STATE/acme.toml (state $STATE/acme, shared)"
  lb0=$(lb_counts tcp)
  for n in "${NODES[@]}"; do stop_node "$n"; done
  for n in "${NODES[@]}"; do start_node "$n" --config "$STATE/acme.toml"; done
  for n in "${NODES[@]}"; do node_ready "$n"; done
  t0=$EPOCHREALTIME
  for ((i = 0; ; i++)); do
    certified && break
    failed=$(metric_all 'ringmux_acme_orders_total{result="failed"}')
    if ((failed > 0)); then
      grep -h 'ACME' "$STATE"/n?.log | tail -n 20 >&2
      fail "$failed ACME order(s) failed before every node served $ACME_SITE's certificate"
    fi
    ((i < 900)) || fail "not every node served a certificate for $ACME_SITE within 90 s"
    sleep 0.1
  done
  ms=$(ms_since "$t0")
  # Every worker of every node was sent the pending challenge, and now the certificate (they
  # log both; a worker confirms each update before the next).
  for n in "${NODES[@]}"; do
    logged "$n" 'ACME challenges in use.*tls_alpn01=1' 2 ||
      fail "node $n's workers did not both get the pending TLS-ALPN-01 challenge (their log: $(grep -c 'ACME challenges in use' "$STATE/n$n.log") challenge sets)"
    poll 50 logged "$n" 'serving a new certificate from ACME' 2 ||
      fail "node $n's two workers did not both take the certificate within 5 s of its metrics"
  done
  issued=""
  for n in "${NODES[@]}"; do
    i=$(metric "$n" 'ringmux_acme_orders_total{result="issued"}')
    issued+=" node$n=$i"
    ((i == 0)) || ordered+=" $n"
  done
  # The only TCP connections to the VIP since the restart: Pebble's validation. It validates
  # from 3 "perspectives", a new connection each (so each hashed anew), and fails the
  # challenge if any fails: each node that got one answered the challenge.
  local by_others=0
  lb1=$(lb_counts tcp)
  for n in "${NODES[@]}"; do
    i=$(($(nth "$n" "$lb1") - $(nth "$n" "$lb0")))
    validated+=" node$n=$i"
    [[ " $ordered " == *" $n "* ]] || by_others=$((by_others + i))
  done
  (($(metric_all 'ringmux_acme_orders_total{result="issued"}') == 1)) ||
    fail "the nodes made more than one order, or none, for one site:$issued"
  echo "every node serves $ACME_SITE's certificate, $ms ms after they were ready; orders issued:$issued"
  echo "node$ordered ordered (it held locks/$ACME_SITE.lock); Pebble's validation connections reached$validated:"
  echo "  $by_others of them answered by nodes that did not order, from the shared challenges/"
  echo "both workers of every node had the challenge in use, and now serve the certificate"

  say "9b. 30 HTTPS connections to https://$ACME_SITE/, each verified against Pebble's issuing root"
  tcp0=$(tcp_all)
  lb0=$(lb_counts tcp)
  for ((i = 1; i <= 30; i++)); do
    serial=$(acme_https_get "HTTPS connection $i") || exit 1
    serials+=("$serial")
  done
  lb1=$(lb_counts tcp)
  poll 50 tcp_counted "$tcp0" "$lb0" "$lb1" ||
    fail "the nodes did not count the TCP connections the balancer sent them within 5 s: ($tcp0) -> ($NOW), balancer ($lb0) -> ($lb1)"
  spread=""
  for n in "${NODES[@]}"; do
    i=$(($(nth "$n" "$lb1") - $(nth "$n" "$lb0")))
    spread+=" node$n=$i"
    ((i >= 1)) || fail "node $n got none of the 30 HTTPS connections:$spread"
  done
  (($(sum_of "$lb1") - $(sum_of "$lb0") == 30)) ||
    fail "the balancer sent $(($(sum_of "$lb1") - $(sum_of "$lb0"))) TCP connections for 30:$spread"
  [[ $(printf '%s\n' "${serials[@]}" | sort -u | wc -l) == 1 ]] ||
    fail "the nodes served different certificates: serials $(printf '%s\n' "${serials[@]}" | sort | uniq -c | paste -sd' ')"
  echo "30 HTTPS connections, chain and name verified, 200 'cluster':$spread; one leaf, serial ${serials[0]}"

  say "9c. HTTP/3 to $ACME_SITE at the VIP: aioquic verifying the chain, and gtlsclient"
  quic0=$(accepted_all)
  for ((i = 1; i <= 6; i++)); do
    serial=$(acme_h3_get "HTTP/3 connection $i") || exit 1
    [[ $serial == "${serials[0]}" ]] ||
      fail "HTTP/3 connection $i was served serial $serial, TCP serial ${serials[0]}"
  done
  # gtlsclient 0.12 verifies no certificate (it has no option for roots): it shows HTTP/3 to
  # the name through the balancer, aioquic above the chain.
  for ((i = 1; i <= 3; i++)); do
    GTLS_URL="https://$ACME_SITE/" gtls_must "gtlsclient connection $i to $ACME_SITE" / --sni="$ACME_SITE"
  done
  local quic1
  quic1=$(settled 9 "$quic0")
  spread=""
  for n in "${NODES[@]}"; do spread+=" node$n=$(($(nth "$n" "$quic1") - $(nth "$n" "$quic0")))"; done
  echo "6 HTTP/3 connections by aioquic, chain and name verified, serial ${serials[0]}, and 3 by gtlsclient:$spread"

  failed=$(metric_all 'ringmux_acme_orders_total{result="failed"}')
  (($(metric_all 'ringmux_acme_orders_total{result="issued"}') == 1 && failed == 0)) ||
    fail "orders after the requests: $(metric_all 'ringmux_acme_orders_total{result="issued"}') issued, $failed failed"
  local stored
  stored=$(find "$STATE/acme/certs" -mindepth 1 -maxdepth 1 -printf '%f\n' | paste -sd' ')
  [[ $stored == "$ACME_SITE" ]] ||
    fail "the shared state holds certificates for '$stored', not $ACME_SITE alone"
  [[ -z $(find "$STATE/acme/challenges" -name '*.json') ]] ||
    fail "challenge files are left in $STATE/acme/challenges after the order"
  echo "one order in all (none failed); the shared state holds one certificate and no challenge"
}

run_test() {
  command -v gtlsclient >/dev/null || fail "gtlsclient is missing (apt-get install ngtcp2-client)"
  command -v conntrack >/dev/null || fail "conntrack is missing (apt-get install conntrack)"
  command -v curl >/dev/null || fail "curl is missing"
  RETRY=always
  up
  local t0=$SECONDS

  say "1. every packet length through the rules"
  sweep 10000 "$(node_id 9)" 0 "${NODES[@]}"

  say "2. 60 connections (more until each node has 10, at most 150) over the three nodes"
  spread 60 150 10 "${NODES[@]}"
  local n retries=() tokens=()
  for n in "${NODES[@]}"; do
    retries+=("$(metric "$n" 'ringmux_retries_total{result="sent"}')")
    tokens+=("$(metric "$n" 'ringmux_tokens_total{result="accepted"}')")
    ((retries[-1] >= 10 && tokens[-1] >= 10)) ||
      fail "--retry always: node $n sent ${retries[-1]} Retries and accepted ${tokens[-1]} tokens for its 10+ connections"
  done
  echo "--retry always on every node: Retries sent ${retries[*]}, their tokens accepted ${tokens[*]}"

  say "3. HTTPS over TCP (30 connections) and plain HTTP over the nodes, through the balancer"
  local tcp0 got headers
  tcp0=$(tcp_all)
  headers=$(in_ns "$NS_CLIENT" curl -sk --http2 --max-time 5 -D - -o /dev/null "$URL/hello.txt") ||
    fail "HTTPS over TCP to $URL failed"
  grep -qi "^alt-svc: h3=\":$PORT\"" <<<"$headers" ||
    fail "HTTPS over TCP: no alt-svc h3=\":$PORT\" (how a browser finds HTTP/3) in: $headers"
  for ((i = 0; i < 3; i++)); do
    got=$(http_get "$VIP") || fail "plain HTTP to $VIP:$HTTP_PORT failed (curl $?)"
    [[ $got == "301 https://$VIP/hello.txt?q=1" ]] ||
      fail "plain HTTP to $VIP:$HTTP_PORT: got '$got', not a 301 to https://$VIP/hello.txt?q=1"
  done
  settled 4 "$tcp0" tcp_all >/dev/null
  echo "HTTPS over TCP carries alt-svc h3=\":$PORT\"; plain HTTP to $VIP:$HTTP_PORT gets 301 to https://$VIP/"
  tcp_spread 30 1 "${NODES[@]}"

  say "4. a NEW_TOKEN token from one node taken by another (shared token key, no Retry)"
  python3 -c 'import aioquic' 2>/dev/null || fail "python3's aioquic is missing (pip install aioquic)"
  local before after first crossed="" i token r0=() t0s=()
  before=$(accepted_all)
  token=$(in_ns "$NS_CLIENT" python3 -c "$TOKEN_CLIENT" "$VIP" "$PORT") ||
    fail "aioquic's first connection failed or got no NEW_TOKEN token"
  after=$(settled 1 "$before")
  first=$(took "$before" "$after")
  for ((i = 0; i < 20; i++)); do
    r0=() t0s=()
    for n in "${NODES[@]}"; do
      r0+=("$(metric "$n" 'ringmux_retries_total{result="sent"}')")
      t0s+=("$(metric "$n" 'ringmux_tokens_total{result="accepted"}')")
    done
    before=$(accepted_all)
    in_ns "$NS_CLIENT" python3 -c "$TOKEN_CLIENT" "$VIP" "$PORT" "$token" >/dev/null ||
      fail "aioquic's connection with the saved token failed"
    after=$(settled 1 "$before")
    n=$(took "$before" "$after")
    ((n != first)) || continue
    local r1 t1
    r1=$(metric "$n" 'ringmux_retries_total{result="sent"}')
    t1=$(metric "$n" 'ringmux_tokens_total{result="accepted"}')
    ((r1 == r0[n - 1] && t1 > t0s[n - 1])) ||
      fail "node $n took a connection with node $first's token but sent $((r1 - r0[n - 1])) Retries, accepted $((t1 - t0s[n - 1])) tokens"
    crossed=$n
    break
  done
  [[ -n $crossed ]] || fail "20 connections with the token all landed on node $first"
  echo "a NEW_TOKEN token node $first issued was accepted by node $crossed, which sent no Retry"

  say "5. active migration and NAT rebinding through the balancer"
  local cid_before cid_after
  # Workers report their counts about once a second: the two connections here must be counted
  # before step 6 takes its baseline, or one of them would count as one of step 6's and leave
  # one of step 6's to be counted in step 7.
  before=$(accepted_all)
  for mode in migration rebinding; do
    local extra=(--change-local-addr=100ms --delay-stream=300ms --download="$STATE/dl")
    [[ $mode == rebinding ]] && extra+=(--nat-rebinding)
    rm -rf "$STATE/dl"
    mkdir -p "$STATE/dl"
    cid_before=0
    for n in "${NODES[@]}"; do cid_before=$((cid_before + $(counter "cid_$(node_id "$n")"))); done
    gtls_must "$mode" /bytes/2000000 "${extra[@]}"
    grep -q "Local address is now" "$STATE/gtls.log" || fail "$mode: gtlsclient did not change its address"
    [[ $(stat -c %s "$STATE/dl/2000000") == 2000000 ]] || fail "$mode: the download is not 2000000 bytes"
    cid_after=0
    for n in "${NODES[@]}"; do cid_after=$((cid_after + $(counter "cid_$(node_id "$n")"))); done
    ((cid_after > cid_before)) || fail "$mode: no new 4-tuple was routed by its CID"
    echo "$mode: 2000000 bytes after the address change; $((cid_after - cid_before)) new 4-tuple(s) routed by CID"
  done
  settled 2 "$before" >/dev/null

  say "6. ringmux upgrade of every node, one after the other, under load"
  rm -f "$STATE/stop"
  local k pids=() load_before
  load_before=$(accepted_all)
  for k in 1 2 3 4; do
    load_loop "$k" &
    pids+=($!)
  done
  mkdir -p "$STATE/big"
  GTLS_LOG=$STATE/big.log gtls /bytes/40000000 --download="$STATE/big" &
  pids+=($!)
  poll 100 loads_running || fail "the load did not get going within 10 s"
  local served
  for n in "${NODES[@]}"; do
    in_ns "rmx-n$n" "$BIN/ringmux" upgrade --control-socket "$STATE/n$n/control.sock" --timeout 30 ||
      fail "ringmux upgrade of node $n failed"
    [[ $(metric "$n" 'ringmux_upgrades_total') -ge 1 ]] || fail "node $n counts no upgrade"
    served=$(metric "$n" 'ringmux_worker_requests_total{')
    poll 50 serves_more "$n" "$served" || fail "node $n served no request within 5 s of its upgrade"
  done
  touch "$STATE/stop"
  for pid in "${pids[@]}"; do wait "$pid"; done
  local ok fails
  ok=$(cat "$STATE"/load*.results | grep -c '^ok' || true)
  fails=$(cat "$STATE"/load*.results | grep -c '^FAIL' || true)
  ((fails == 0)) || { tail -n 20 "$STATE"/load*.fail.* >&2; fail "$fails of $((ok + fails)) connections under the upgrades failed"; }
  if ! gtls_ok 1 "$STATE/big.log" || [[ $(stat -c %s "$STATE/big/40000000") != 40000000 ]]; then
    tail -n 20 "$STATE/big.log" >&2
    fail "the 40 MB download across the upgrades did not complete"
  fi
  settled $((ok + 1)) "$load_before" >/dev/null
  echo "3 nodes upgraded under load: $ok connections of 4 requests each and a 40 MB download, none failed"

  say "7. node 3 draining, then removed: no new connections (QUIC, TCP), its CIDs first kept, then dropped"
  # A TCP connection has no CID to find its node by: a drained node keeps its connections by
  # their conntrack entries alone. Downloads at 1 MiB/s (10 s each) are started one after
  # another until the balancer sends one to node 3, which must then finish across the drain.
  local slow=() on3="" lb tcp0
  tcp0=$(tcp_all)
  for ((i = 0; i < 20; i++)); do
    lb=$(lb_counts tcp)
    (exec ip netns exec "$NS_CLIENT" curl -sk --http2 --max-time 60 --limit-rate 1M \
      -o "$STATE/slow$i" "$URL/bytes/10000000") &
    slow+=($!)
    poll 50 lb_moved tcp "$lb" || fail "the balancer sent TCP download $i nowhere within 5 s"
    if (($(nth 3 "$(lb_counts tcp)") > $(nth 3 "$lb"))); then
      on3=$i
      break
    fi
  done
  [[ -n $on3 ]] || fail "none of 20 TCP downloads went to node 3"
  # Counted by their nodes before the baselines below.
  settled "${#slow[@]}" "$tcp0" tcp_all >/dev/null
  # Under --retry always every new connection's first Initial is answered with a Retry by the
  # demux it reached, which counts it at once: node 3's Retries decide. (The nodes' accepted
  # counts come from their workers' reports, about once a second: one reported late can be
  # counted in the wrong round while another is not counted yet.)
  local retries3
  retries3=$(metric 3 'ringmux_retries_total{result="sent"}')
  ruleset "${NODES[@]}" -- --drain "$(node_id 3)" >"$STATE/rules-drain.nft"
  apply "$STATE/rules-drain.nft"
  forget_node 3 udp
  kill -0 "${slow[on3]}" 2>/dev/null ||
    fail "node 3's TCP download ended before the drain (see $STATE/slow$on3): it shows nothing"
  spread 20 20 0 1 2
  [[ $(metric 3 'ringmux_retries_total{result="sent"}') == "$retries3" ]] ||
    fail "drained node 3 took new connections (it sent Retries):$SPREAD"
  tcp_spread 30 1 1 2
  sweep 12000 "$(node_id 9)" 3 "${NODES[@]}"
  wait "${slow[on3]}" || fail "node 3's TCP download, in flight at the drain, failed (curl $?)"
  [[ $(stat -c %s "$STATE/slow$on3") == 10000000 ]] ||
    fail "node 3's TCP download, in flight at the drain, has $(stat -c %s "$STATE/slow$on3") bytes, not 10000000"
  echo "drained node 3 finished its TCP download of 10000000 bytes, in flight at the drain"
  for pid in "${slow[@]}"; do wait "$pid" || fail "a TCP download of step 7 failed (curl $?)"; done
  ruleset 1 2 >"$STATE/rules-removed.nft"
  apply "$STATE/rules-removed.nft"
  forget_node 3
  retries3=$(metric 3 'ringmux_retries_total{result="sent"}')
  spread 20 20 0 1 2
  [[ $(metric 3 'ringmux_retries_total{result="sent"}') == "$retries3" ]] ||
    fail "removed node 3 took new connections (it sent Retries):$SPREAD"
  tcp_spread 10 1 1 2
  sweep 14000 "$(node_id 9)" 0 1 2
  apply "$STATE/rules.nft"

  say "8. IPv6 through the ip6 table, QUIC and TCP"
  local v6=0
  for ((i = 0; i < 6; i++)); do
    gtls_must "IPv6 connection $i" -6 /hello.txt
    v6=$((v6 + 1))
  done
  local hashed6 tcp6
  hashed6=$(sum_of "$(lb_counts hash ip6)")
  ((hashed6 >= v6)) || fail "$v6 IPv6 connections completed but the ip6 table hashed $hashed6 4-tuples"
  tcp6=$(sum_of "$(lb_counts tcp ip6)")
  for ((i = 0; i < 3; i++)); do
    got=$(https_get "https://[$VIP6]:$PORT/hello.txt") || fail "HTTPS over TCP to [$VIP6]:$PORT failed (curl $?)"
    [[ $got == "200 2" ]] || fail "HTTPS over TCP to [$VIP6]:$PORT: got '$got', not 200 over HTTP/2"
  done
  got=$(http_get "[$VIP6]") || fail "plain HTTP to [$VIP6]:$HTTP_PORT failed (curl $?)"
  [[ $got == "301 https://[$VIP6]/hello.txt?q=1" ]] ||
    fail "plain HTTP to [$VIP6]:$HTTP_PORT: got '$got', not a 301 to https://[$VIP6]/hello.txt?q=1"
  tcp6=$(($(sum_of "$(lb_counts tcp ip6)") - tcp6))
  ((tcp6 == 4)) || fail "4 IPv6 TCP connections completed but the ip6 table hashed $tcp6"
  echo "IPv6: $v6 QUIC connections through [$VIP6]:$PORT, $hashed6 4-tuples hashed by the ip6 table;"
  echo "      3 HTTPS over TCP and a plain-HTTP redirect, $tcp6 TCP connections hashed by it"

  say "9. several nodes, one name: a certificate from ACME (Pebble behind the VIP), one order"
  several_nodes_one_name

  say "all passed in $((SECONDS - t0)) s (after up)"
}

# After `test`, passed or not: the nodes' last log lines on failure, then down.
on_exit() {
  local status=$?
  if ((status != 0)); then
    for n in "${NODES[@]}"; do
      [[ -f $STATE/n$n.log ]] || continue
      echo "--- node $n log (last 20 lines)"
      tail -n 20 "$STATE/n$n.log"
    done >&2
    if [[ -f $PEBBLE/pebble.log ]]; then
      echo "--- Pebble's log (last 20 lines)"
      tail -n 20 "$PEBBLE/pebble.log"
    fi >&2
  fi
  down
  exit "$status"
}

case $CMD in
  up)
    [[ $(id -u) == 0 ]] || fail "needs root (network namespaces, nftables)"
    up
    ;;
  down)
    [[ $(id -u) == 0 ]] || fail "needs root (network namespaces)"
    say "down"
    down
    ;;
  test)
    [[ $(id -u) == 0 ]] || fail "needs root (network namespaces, nftables)"
    trap on_exit EXIT
    trap 'exit 143' TERM INT
    run_test
    ;;
  *) usage ;;
esac
