#!/usr/bin/env bash
# What a flood of new connections costs the connections already running, with the demux's
# admission control off and on. Two ringmux side by side (2 instances, shm each):
#   off  --retry never --initial-shed-at 100 --prefix-budget 0 (every Initial reaches a worker)
#   on   the defaults (--retry auto, --initial-shed-at 50, --prefix-budget 100)
# Each round runs, for each flood rate (none, 1000, 5000, 10000 Initials/s) and each side in
# turn: h3-probe (8 connections x 4 streams of /hello.txt, 1 s warm-up, 8 s measured) and, from
# 2 s into the measurement, 3 s of real Initials (bench/initial-flood.py: aioquic ClientHellos,
# each with its own random DCID, from 256 source ports of 127.0.1.1, never followed up), and
# 5 new connections made one after another by a fresh h3-probe each (one GET; success and wall
# time, process start included). Prints every round, then medians per rate and side.
# Release binaries (cargo build --release --bins); python3 with aioquic.
#
#   bench/scripts/bench-flood.sh [ROUNDS]     (default 3)
set -euo pipefail
cd "$(dirname "$0")/../.."
rounds=${1:-3}
bin=target/release
for b in ringmux ringmux-worker h3-probe; do
  [[ -x $bin/$b ]] || {
    echo "bench-flood: $bin/$b is missing: cargo build --release --bins" >&2
    exit 1
  }
done
python3 -c 'import aioquic' 2>/dev/null || {
  echo "bench-flood: python3 cannot import aioquic: pip install aioquic" >&2
  exit 1
}
tmp=$(mktemp -d)
pids=()
trap 'kill "${pids[@]}" 2>/dev/null; wait 2>/dev/null; rm -rf "$tmp"' EXIT

declare -A port=([off]=4633 [on]=4634) metrics=([off]=127.0.0.1:9633 [on]=127.0.0.1:9634)
declare -A flags=([off]="--retry never --initial-shed-at 100 --prefix-budget 0" [on]="")
for side in off on; do
  # shellcheck disable=SC2086 # the flags are words
  "$bin/ringmux" --listen "127.0.0.1:${port[$side]}" --metrics "${metrics[$side]}" \
    --control-socket off --instances 2 ${flags[$side]} >"$tmp/ready-$side" 2>"$tmp/ringmux-$side.log" &
  pids+=($!)
done
for side in off on; do
  for _ in $(seq 100); do
    grep -q "ringmux ready" "$tmp/ready-$side" 2>/dev/null && break
    sleep 0.1
  done
  grep -q "ringmux ready" "$tmp/ready-$side" || {
    echo "bench-flood: ringmux ($side) did not start" >&2
    cat "$tmp/ringmux-$side.log" >&2
    exit 1
  }
done

echo "== making 30000 Initials with aioquic (once)" >&2
python3 bench/initial-flood.py 127.0.0.1 9 --count 30000 --rate 0 --cache "$tmp/initials" \
  --source 127.0.1.1 >/dev/null

drops() { # METRICS_ADDR -> "retry initial_shed prefix_budget ring_full other"
  python3 - "$1" <<'EOF'
import sys, urllib.request
text = urllib.request.urlopen(f"http://{sys.argv[1]}/metrics", timeout=5).read().decode()
d = {}
for l in text.splitlines():
    if l.startswith("ringmux_datagrams_dropped_total{"):
        d[l.split('reason="')[1].split('"')[0]] = float(l.split()[-1])
named = ["retry", "initial_shed", "prefix_budget", "ring_full"]
print(*[int(d.get(k, 0)) for k in named], int(sum(v for k, v in d.items() if k not in named)))
EOF
}

newcomers() { # PORT OUT: 5 new connections, one after another: "ok ms" lines
  for _ in 1 2 3 4 5; do
    local t0 t1 ok=1
    t0=$(date +%s%N)
    "$bin/h3-probe" --url "https://127.0.0.1:$1/hello.txt" --insecure -c 1 -s 1 -n 1 \
      --seconds 10 --timeout 10 >/dev/null 2>&1 || ok=0
    t1=$(date +%s%N)
    echo "$ok $(((t1 - t0) / 1000000))" >>"$2"
  done
}

for r in $(seq "$rounds"); do
  for rate in 0 1000 5000 10000; do
    for side in off on; do
      tag=$side-$rate-$r
      before=$(drops "${metrics[$side]}")
      "$bin/h3-probe" --url "https://127.0.0.1:${port[$side]}/hello.txt" --insecure \
        -c 8 -s 4 --seconds 8 --warmup 1 --json "$tmp/$tag.json" >/dev/null &
      probe=$!
      sleep 3 # warm-up 1 s, then 2 s into the measurement
      if ((rate > 0)); then
        python3 bench/initial-flood.py 127.0.0.1 "${port[$side]}" --count $((rate * 3)) \
          --rate "$rate" --cache "$tmp/initials" --source 127.0.1.1 >"$tmp/$tag.flood" &
        flood=$!
      fi
      sleep 0.5
      newcomers "${port[$side]}" "$tmp/$tag.new"
      if ((rate > 0)); then wait "$flood"; fi
      wait "$probe"
      echo "$before $(drops "${metrics[$side]}")" >"$tmp/$tag.drops"
    done
  done
done

python3 - "$tmp" "$rounds" <<'EOF'
import json, statistics, sys
tmp, rounds = sys.argv[1], int(sys.argv[2])
rates, sides = [0, 1000, 5000, 10000], ["off", "on"]
def row(side, rate, r):
    tag = f"{tmp}/{side}-{rate}-{r}"
    j = json.load(open(f"{tag}.json"))
    l = j["latency_us"]
    new = [tuple(map(int, x.split())) for x in open(f"{tag}.new") if x.strip()]
    ok = [ms for good, ms in new if good]
    d = list(map(int, open(f"{tag}.drops").read().split()))
    delta = [b - a for a, b in zip(d[:5], d[5:])]
    return [j["requests_per_s"], l["p50"], l["p99"], l["p999"], l["max"], j["errors"]["total"],
            len(ok), statistics.median(ok) if ok else float("nan"), max(ok) if ok else float("nan"),
            *delta]
names = ["req/s", "p50 us", "p99 us", "p99.9 us", "max us", "errors", "new ok/5", "new median ms",
         "new max ms", "retry", "initial_shed", "prefix_budget", "ring_full", "other drops"]
print(f"bench-flood: h3-probe 8 x 4 streams of /hello.txt, 8 s; 3 s floods of aioquic Initials; "
      f"{rounds} interleaved rounds")
print("| admission | flood/s | round | " + " | ".join(names) + " |")
print("|---" * (len(names) + 3) + "|")
rows = {(s, rate): [row(s, rate, r) for r in range(1, rounds + 1)] for s in sides for rate in rates}
for rate in rates:
    for s in sides:
        for r, v in enumerate(rows[(s, rate)], 1):
            print(f"| {s} | {rate} | {r} | " + " | ".join(f"{x:.0f}" for x in v) + " |")
print()
print("| admission | flood/s | " + " | ".join(f"{n} (median)" for n in names) + " |")
print("|---" * (len(names) + 2) + "|")
for rate in rates:
    for s in sides:
        med = [statistics.median(v[i] for v in rows[(s, rate)]) for i in range(len(names))]
        print(f"| {s} | {rate} | " + " | ".join(f"{x:.0f}" for x in med) + " |")
base = {s: statistics.median(v[3] for v in rows[(s, 0)]) for s in sides}
for rate in rates[1:]:
    print(f"flood {rate}/s: p99.9 over no flood (same side, medians): "
          + ", ".join(f"{s} {statistics.median(v[3] for v in rows[(s, rate)]) / max(base[s], 1):.2f}" for s in sides))
EOF
