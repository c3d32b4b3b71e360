#!/usr/bin/env bash
# WebSocket echo throughput through the proxy's tunnels, side by side in one run: for each
# round, in turn, a client (Python `websockets`, C-accelerated masking) echoes binary messages
# of --message-kib KiB over --connections connections for --seconds seconds
#
#   direct    straight to the echo service (test-tools/python/ws_upstream.py, plain ws://)
#   ringmux   through ringmux's TLS-over-TCP listener (`--upstream` to the echo service)
#   caddy     through Caddy's `reverse_proxy` to the same service, TLS as ringmux
#
# and reports the median (min–max) over rounds of MB/s (payload bytes echoed back, each way
# counted once) and the proxy's CPU per MB (ringmux: its workers; Caddy: its process), and the
# ratios ringmux / direct, caddy / direct and ringmux / caddy within each round. The client and
# the echo service are Python and share the box's CPUs with the proxy: read the proxies' CPU
# per MB beside the MB/s.
#
# Usage: bench/scripts/bench-ws.sh [--rounds N] [--seconds S] [--connections C]
#          [--message-kib K] [--no-caddy] [--out DIR] [--no-build]
# Needs caddy, openssl and Python's `websockets` (pip install websockets).
set -euo pipefail
cd "$(dirname "$0")/../.."
# shellcheck source=bench/scripts/common.sh
. bench/scripts/common.sh

rounds=3
seconds=8
connections=4
message_kib=64
caddy=1
out=""
build=1
while (($#)); do
  case $1 in
    --rounds) rounds=$2; shift 2 ;;
    --seconds) seconds=$2; shift 2 ;;
    --connections) connections=$2; shift 2 ;;
    --message-kib) message_kib=$2; shift 2 ;;
    --no-caddy) caddy=0; shift ;;
    --out) out=$2; shift 2 ;;
    --no-build) build=0; shift ;;
    *) echo "bench-ws.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
python3 -c 'import websockets' 2>/dev/null || { echo "bench-ws.sh: Python's websockets is required (pip install websockets)" >&2; exit 1; }
((caddy)) && { command -v caddy >/dev/null || { echo "bench-ws.sh: caddy is required (apt-get install caddy), or --no-caddy" >&2; exit 1; }; }
if ((build)); then
  cargo build --release -p ringmux-demux -p ringmux-server --bins
fi
bin=target/release
work=$(mktemp -d /tmp/ringmux-bench-ws.XXXXXX)
out=${out:-$work}
mkdir -p "$out"
pids=()
cleanup() {
  for p in "${pids[@]}"; do
    kill -TERM "$p" 2>/dev/null || true
    wait "$p" 2>/dev/null || true
  done
}
trap cleanup EXIT
self_signed "$work"

python3 test-tools/python/ws_upstream.py 0 >"$work/upstream.out" 2>&1 &
pids+=($!)
upstream_pid=$!
for _ in $(seq 1 100); do grep -q '^listening' "$work/upstream.out" && break; sleep 0.1; done
upstream_port=$(awk '/^listening/ { print $2 }' "$work/upstream.out")
[[ -n $upstream_port ]] || { echo "bench-ws.sh: the echo service did not start: $(cat "$work/upstream.out")" >&2; exit 1; }
rm_port=4480
caddy_port=4481
cat >"$work/Caddyfile" <<EOF
{
	admin off
	auto_https disable_redirects
	default_sni localhost
	servers {
		protocols h1
	}
}
https://localhost:$caddy_port {
	tls $work/cert.pem $work/key.pem
	reverse_proxy 127.0.0.1:$upstream_port
}
EOF

cat >"$work/client.py" <<'PY'
import asyncio, os, ssl, sys, time
from websockets.asyncio.client import connect

url, conns, kib, seconds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
ctx = None
if url.startswith("wss:"):
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE

async def one(deadline, counts):
    payload = os.urandom(kib << 10)
    async with connect(url, ssl=ctx, max_size=None, compression=None, ping_interval=None,
                       open_timeout=30) as ws:
        while time.monotonic() < deadline:
            await ws.send(payload)
            got = await ws.recv()
            if len(got) != len(payload):
                raise SystemExit(f"echo of {len(payload)} bytes came back as {len(got)}")
            counts[0] += len(got)

async def main():
    counts = [0]
    start = time.monotonic()
    await asyncio.gather(*(one(start + seconds, counts) for _ in range(conns)))
    print(counts[0], time.monotonic() - start)

asyncio.run(main())
PY

tsv=$out/bench-ws.tsv
printf 'round\ttarget\tmb_per_s\tproxy_ms_per_mb\n' >"$tsv"
targets="direct ringmux"
((caddy)) && targets="$targets caddy"
echo "== WebSocket echo [$targets]: $rounds rounds, $connections connections x ${message_kib} KiB messages, ${seconds}s; load $(cat /proc/loadavg)"
for round in $(seq 1 "$rounds"); do
  "$bin/ringmux" --listen "127.0.0.1:$rm_port" --instances 2 --upstream "http://127.0.0.1:$upstream_port" \
    --cert "$work/cert.pem" --key "$work/key.pem" --metrics 127.0.0.1:0 --control-socket off \
    >"$work/ringmux.log" 2>&1 &
  rm_pid=$!
  pids+=("$rm_pid")
  for _ in $(seq 1 100); do grep -q "ringmux ready" "$work/ringmux.log" && break; sleep 0.1; done
  mapfile -t workers < <(pgrep -P "$rm_pid")
  if ((caddy)); then
    caddy run --config "$work/Caddyfile" --adapter caddyfile >"$work/caddy.log" 2>&1 &
    caddy_pid=$!
    pids+=("$caddy_pid")
    for _ in $(seq 1 100); do curl -sk -o /dev/null "https://localhost:$caddy_port/" && break; sleep 0.1; done
  fi
  for target in $targets; do
    case $target in
      direct) url="ws://127.0.0.1:$upstream_port/echo"; measured=() ;;
      ringmux) url="wss://localhost:$rm_port/echo"; measured=("${workers[@]}") ;;
      caddy) url="wss://localhost:$caddy_port/echo"; measured=("$caddy_pid") ;;
    esac
    c0=$(cpu_ns "${measured[@]}")
    read -r bytes elapsed < <(python3 "$work/client.py" "$url" "$connections" "$message_kib" "$seconds")
    c1=$(cpu_ns "${measured[@]}")
    mbs=$(awk -v b="$bytes" -v e="$elapsed" 'BEGIN { printf "%.1f", b / e / 1e6 }')
    per=$(awk -v c=$((c1 - c0)) -v b="$bytes" -v m=${#measured[@]} 'BEGIN { if (m == 0 || b == 0) print "nan"; else printf "%.2f", c / 1e6 / (b / 1e6) }')
    printf '%s\t%s\t%s\t%s\n' "$round" "$target" "$mbs" "$per" >>"$tsv"
    printf 'round %s %-8s %9s MB/s  proxy %6s ms CPU per MB\n' "$round" "$target" "$mbs" "$per"
  done
  kill -TERM "$rm_pid" 2>/dev/null || true
  wait "$rm_pid" 2>/dev/null || true
  if ((caddy)); then
    kill -TERM "$caddy_pid" 2>/dev/null || true
    wait "$caddy_pid" 2>/dev/null || true
  fi
done
kill -TERM "$upstream_pid" 2>/dev/null || true

python3 - "$tsv" <<'PY'
import csv, statistics, sys
rows = list(csv.DictReader(open(sys.argv[1]), delimiter="\t"))
f = lambda v: float(v) if v != "nan" else float("nan")
targets = [t for t in ("direct", "ringmux", "caddy") if any(r["target"] == t for r in rows)]
print("| target | MB/s | proxy ms CPU per MB |")
print("|---|---|---|")
for t in targets:
    sel = [r for r in rows if r["target"] == t]
    cell = lambda k: "%.1f (%.1f–%.1f)" % (statistics.median(f(r[k]) for r in sel), min(f(r[k]) for r in sel), max(f(r[k]) for r in sel))
    print(f"| {t} | {cell('mb_per_s')} | {cell('proxy_ms_per_mb')} |")
def ratio(a, b, key):
    out = []
    for rnd in sorted({r["round"] for r in rows}):
        get = lambda t: next(f(r[key]) for r in rows if r["round"] == rnd and r["target"] == t)
        out.append(get(a) / get(b))
    return f"median {statistics.median(out):.2f} ({min(out):.2f}–{max(out):.2f})"
for a, b in (("ringmux", "direct"), ("caddy", "direct"), ("ringmux", "caddy")):
    if a in targets and b in targets:
        extra = f"; proxy CPU per MB {ratio(a, b, 'proxy_ms_per_mb')}" if b != "direct" else ""
        print(f"- {a} / {b}: MB/s {ratio(a, b, 'mb_per_s')}{extra}")
PY
