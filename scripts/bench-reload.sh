#!/usr/bin/env bash
# What a reload costs the requests that run across it: h3-probe (16 connections x 8 streams of
# /bytes/1000) against one ringmux, in interleaved rounds of two kinds, each 6 s:
#   steady  nothing else happens
#   reload  `ringmux reload` at 2 s and again at 4 s (each new generation takes the new
#           connections; the old one sends GOAWAY and drains)
# and prints req/s, p50, p99, p99.9, max and errors of each round, then the medians and the
# reload/steady ratios. Release binaries (cargo build --release --bins).
#
#   scripts/bench-reload.sh [ROUNDS]     (default 5 rounds of each kind)
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-5}
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

for r in $(seq "$rounds"); do
  probe "$tmp/steady-$r.json"
  probe "$tmp/reload-$r.json" &
  p=$!
  sleep 3 # warm-up 1 s, then 2 s into the measurement
  "$bin/ringmux" reload --control-socket "$sock" >/dev/null
  sleep 2
  "$bin/ringmux" reload --control-socket "$sock" >/dev/null
  wait "$p"
done

python3 - "$tmp" "$rounds" <<'EOF'
import json, statistics, sys
tmp, rounds = sys.argv[1], int(sys.argv[2])
rows = {k: [json.load(open(f"{tmp}/{k}-{r}.json")) for r in range(1, rounds + 1)]
        for k in ("steady", "reload")}
def f(j):
    l = j["latency_us"]
    return [j["requests_per_s"], l["p50"], l["p99"], l["p999"], l["max"], j["errors"]["total"], j.get("goaways", 0)]
names = ["req/s", "p50 us", "p99 us", "p99.9 us", "max us", "errors", "goaways"]
print(f"bench-reload: h3-probe 16 x 8 streams, /bytes/1000, {rounds} interleaved rounds of each kind")
print("| round | " + " | ".join(names) + " |")
print("|---" * (len(names) + 1) + "|")
for k in ("steady", "reload"):
    for r, j in enumerate(rows[k], 1):
        print(f"| {k} {r} | " + " | ".join(f"{v:.0f}" for v in f(j)) + " |")
med = {k: [statistics.median(f(j)[i] for j in rows[k]) for i in range(len(names))] for k in rows}
for k in ("steady", "reload"):
    print(f"| {k} median | " + " | ".join(f"{v:.0f}" for v in med[k]) + " |")
ratios = [statistics.median(f(a)[i] / max(f(b)[i], 1) for a, b in zip(rows["reload"], rows["steady"])) for i in (0, 2, 3, 4)]
print(f"reload/steady (median of per-round ratios): req/s {ratios[0]:.2f}, p99 {ratios[1]:.2f}, p99.9 {ratios[2]:.2f}, max {ratios[3]:.2f}")
EOF
