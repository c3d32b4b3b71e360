#!/usr/bin/env bash
# What a reload, or an upgrade of the demux, costs the requests that run across it: h3-probe
# (16 connections x 8 streams of /bytes/1000) against one ringmux, in interleaved rounds of two
# kinds, each 6 s:
#   steady   nothing else happens
#   reload   `ringmux reload` at 2 s and again at 4 s (each new generation takes the new
#            connections; the old one sends GOAWAY and drains)
#   upgrade  `ringmux upgrade` at 2 s and again at 4 s (the demux re-executes itself and takes
#            everything over); it also reports each hand-over's pause (the old demux's last
#            received datagram to the new one's first) and the receive queue it left
# and prints req/s, p50, p99, p99.9, max and errors of each round, then the medians and the
# KIND/steady ratios. Release binaries (cargo build --release --bins).
#
#   bench/scripts/bench-reload.sh [ROUNDS] [reload|upgrade]     (default 5 rounds, reload)
set -euo pipefail
cd "$(dirname "$0")/../.."
rounds=${1:-5}
kind=${2:-reload}
[[ $kind == reload || $kind == upgrade ]] || {
  echo "bench-reload: KIND is reload or upgrade, not '$kind'" >&2
  exit 2
}
bin=target/release
for b in ringmux ringmux-worker h3-probe; do
  [[ -x $bin/$b ]] || {
    echo "bench-reload: $bin/$b is missing: cargo build --release --bins" >&2
    exit 1
  }
done
tmp=$(mktemp -d)
port=${BENCH_PORT:-4533}
metrics=127.0.0.1:${BENCH_METRICS_PORT:-9533}
sock=$tmp/control.sock
"$bin/ringmux" --listen "127.0.0.1:$port" --metrics "$metrics" --control-socket "$sock" \
  --instances 2 --grace 30 >"$tmp/ready" 2>"$tmp/ringmux.log" &
rm_pid=$!
trap 'kill "$rm_pid" 2>/dev/null; wait "$rm_pid" 2>/dev/null; rm -rf "$tmp"' EXIT
for _ in $(seq 100); do
  grep -q "ringmux ready" "$tmp/ready" 2>/dev/null && break
  sleep 0.1
done
grep -q "ringmux ready" "$tmp/ready" || {
  echo "bench-reload: ringmux did not start" >&2
  cat "$tmp/ringmux.log" >&2
  exit 1
}

probe() { # probe JSON_OUT
  "$bin/h3-probe" --url "https://127.0.0.1:$port/bytes/1000" --insecure --expect-len 1000 \
    -c 16 -s 8 --seconds 6 --warmup 1 --json "$1" >/dev/null
}

# The last upgrade's pause (s) and queued bytes, as the metrics show them.
handover() {
  python3 - "$metrics" <<'EOF'
import sys, urllib.request
text = urllib.request.urlopen(f"http://{sys.argv[1]}/metrics", timeout=5).read().decode()
v = {l.split()[0]: float(l.split()[1]) for l in text.splitlines() if l.startswith("ringmux_upgrade_")}
drops = sum(float(l.split()[1]) for l in text.splitlines() if l.startswith("ringmux_datagrams_dropped_total"))
print(v.get("ringmux_upgrade_pause_seconds", 0), int(v.get("ringmux_upgrade_queued_bytes", 0)), int(drops))
EOF
}

for r in $(seq "$rounds"); do
  probe "$tmp/steady-$r.json"
  probe "$tmp/$kind-$r.json" &
  p=$!
  sleep 3 # warm-up 1 s, then 2 s into the measurement
  "$bin/ringmux" "$kind" --control-socket "$sock" >/dev/null
  if [[ $kind == upgrade ]]; then handover >>"$tmp/handover"; fi
  sleep 2
  "$bin/ringmux" "$kind" --control-socket "$sock" >/dev/null
  if [[ $kind == upgrade ]]; then handover >>"$tmp/handover"; fi
  wait "$p"
done

python3 - "$tmp" "$rounds" "$kind" <<'EOF'
import json, os, statistics, sys
tmp, rounds, kind = sys.argv[1], int(sys.argv[2]), sys.argv[3]
rows = {k: [json.load(open(f"{tmp}/{k}-{r}.json")) for r in range(1, rounds + 1)]
        for k in ("steady", kind)}
def f(j):
    l = j["latency_us"]
    return [j["requests_per_s"], l["p50"], l["p99"], l["p999"], l["max"], j["errors"]["total"], j.get("goaways", 0)]
names = ["req/s", "p50 us", "p99 us", "p99.9 us", "max us", "errors", "goaways"]
print(f"bench-reload {kind}: h3-probe 16 x 8 streams, /bytes/1000, {rounds} interleaved rounds of each kind")
print("| round | " + " | ".join(names) + " |")
print("|---" * (len(names) + 1) + "|")
for k in ("steady", kind):
    for r, j in enumerate(rows[k], 1):
        print(f"| {k} {r} | " + " | ".join(f"{v:.0f}" for v in f(j)) + " |")
med = {k: [statistics.median(f(j)[i] for j in rows[k]) for i in range(len(names))] for k in rows}
for k in ("steady", kind):
    print(f"| {k} median | " + " | ".join(f"{v:.0f}" for v in med[k]) + " |")
ratios = [statistics.median(f(a)[i] / max(f(b)[i], 1) for a, b in zip(rows[kind], rows["steady"])) for i in (0, 2, 3, 4)]
print(f"{kind}/steady (median of per-round ratios): req/s {ratios[0]:.2f}, p99 {ratios[1]:.2f}, p99.9 {ratios[2]:.2f}, max {ratios[3]:.2f}")
if kind == "upgrade" and os.path.exists(f"{tmp}/handover"):
    h = [l.split() for l in open(f"{tmp}/handover") if l.strip()]
    pause = sorted(float(p) * 1e3 for p, _, _ in h)
    queued = sorted(int(q) for _, q, _ in h)
    drops = [int(d) for _, _, d in h]
    print(f"hand-over over {len(h)} upgrades: pause ms median {statistics.median(pause):.2f} "
          f"(min {pause[0]:.2f}, max {pause[-1]:.2f}); receive queue left, bytes (rx_queue) "
          f"median {statistics.median(queued):.0f} (max {queued[-1]}); demux drops after each: {drops}")
EOF
