#!/usr/bin/env bash
# The reverse proxy (`ringmux --upstream`) beside the built-in responses, side by side in one
# run. Each (round, case) starts a fresh ringmux (2 instances, shm) and one h3-probe against it
# (16 connections x 8 streams by default, 1 s warm-up, body length checked). Cases:
#
#   builtin   the built-in /hello.txt (19 bytes)
#   proxy     /hello (20 bytes) through --upstream to http1-upstream (hyper, one thread)
#   bytes1m   the built-in /bytes/1048576
#   proxy1m   /bytes/1048576 through --upstream
#
# Odd rounds run the cases in that order, even rounds reversed (ABBA), so a drift in load
# cancels within pairs. Reported per case: median (min–max) over rounds of req/s, p50, p99,
# errors, the workers' and the upstream's CPU per request (all threads' on-CPU time from
# /proc/PID/task/*/schedstat over the probe run, scaled to the counted requests); then the
# within-round ratios proxy/builtin and proxy1m/bytes1m. Client, workers and upstream share the
# machine's CPUs: compare cases within a run, not with other machines.
#
# --base DIR adds base-proxy and base-proxy1m: the same cases with the ringmux and ringmux-worker
# in DIR (a copy of another build's target/release), for an A/B of the proxy's request path
# between two builds; the summary gives this build / the base within each round.
#
# Usage: bench/scripts/bench-proxy.sh [--rounds N] [--seconds S] [--connections C] [--streams S]
#          [--cases "builtin proxy bytes1m proxy1m"] [--base DIR] [--out DIR] [--no-build]
set -euo pipefail
cd "$(dirname "$0")/../.."
# shellcheck source=bench/scripts/common.sh
. bench/scripts/common.sh

rounds=5
secs=6
connections=16
streams=8
cases="builtin proxy bytes1m proxy1m"
out=""
base=""
build=1
while (($#)); do
  case $1 in
    --rounds) rounds=$2; shift 2 ;;
    --seconds) secs=$2; shift 2 ;;
    --connections) connections=$2; shift 2 ;;
    --streams) streams=$2; shift 2 ;;
    --cases) cases=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --base) base=$2; shift 2 ;;
    --no-build) build=0; shift ;;
    -h | --help) sed -n '2,24p' "$0"; exit 0 ;;
    *) echo "bench-proxy.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
for tool in jq awk; do
  command -v "$tool" >/dev/null || { echo "bench-proxy.sh: needs $tool (apt-get install $tool)" >&2; exit 2; }
done
if [[ -n $base ]]; then
  [[ -x $base/ringmux && -x $base/ringmux-worker ]] || { echo "bench-proxy.sh: --base $base holds no ringmux and ringmux-worker" >&2; exit 2; }
  for c in proxy proxy1m; do [[ " $cases " == *" $c "* ]] && cases="$cases base-$c"; done
fi
target=${CARGO_TARGET_DIR:-target}
bin=$target/release
if ((build)); then
  cargo build --release -p ringmux-demux -p ringmux-server -p ringmux-bench --bins
fi
out=${out:-$(mktemp -d /tmp/bench-proxy.XXXXXX)}
mkdir -p "$out"
echo "results in $out"

# One upstream for the whole run, so every proxy case meets the same service.
"$bin/http1-upstream" --listen 127.0.0.1:0 >"$out/upstream.out" 2>&1 &
upstream=$!
trap 'kill "$upstream" 2>/dev/null || true' EXIT
for _ in $(seq 100); do grep -q '^http1-upstream listening' "$out/upstream.out" && break; sleep 0.1; done
upstream_url=$(sed -n 's/^http1-upstream listening on \(.*\)$/\1/p' "$out/upstream.out")
[[ -n $upstream_url ]] || { echo "http1-upstream did not start:" >&2; cat "$out/upstream.out" >&2; exit 1; }

tsv=$out/rounds.tsv
printf 'round\tcase\treq_per_s\tp50_us\tp99_us\terrors\tworker_us_per_req\tupstream_us_per_req\n' >"$tsv"
# shellcheck disable=SC2086 # one word per case
reversed=$(printf "%s\n" $cases | tac | xargs)
for ((r = 1; r <= rounds; r++)); do
  order=$cases
  ((r % 2 == 0)) && order=$reversed
  for c in $order; do
    rm=$bin
    [[ $c == base-* ]] && rm=$base
    args=(--listen 127.0.0.1:0 --metrics 127.0.0.1:0 --instances 2 --forward shm --grace 2
      --worker-bin "$rm/ringmux-worker")
    case ${c#base-} in
      builtin) path=/hello.txt len=19 ;;
      proxy) path=/hello len=20 args+=(--upstream "$upstream_url") ;;
      bytes1m) path=/bytes/1048576 len=1048576 ;;
      proxy1m) path=/bytes/1048576 len=1048576 args+=(--upstream "$upstream_url") ;;
      *) echo "unknown case $c" >&2; exit 2 ;;
    esac
    RUST_LOG=warn "$rm/ringmux" "${args[@]}" >"$out/rm-$c-$r.out" 2>"$out/rm-$c-$r.err" &
    pid=$!
    for _ in $(seq 300); do grep -q '^ringmux ready' "$out/rm-$c-$r.out" && break; sleep 0.1; done
    listen=$(sed -n 's/.* listen=\([^ ]*\).*/\1/p' "$out/rm-$c-$r.out")
    sleep 0.3
    mapfile -t workers < <(pgrep -P "$pid")
    w0=$(cpu_ns "${workers[@]}")
    u0=$(cpu_ns "$upstream")
    j=$out/probe-$c-$r.json
    "$bin/h3-probe" --url "https://$listen$path" --connections "$connections" --streams "$streams" \
      --seconds "$secs" --warmup 1 --insecure --expect-len "$len" --json "$j" \
      >"$out/probe-$c-$r.txt" 2>&1 || true
    w1=$(cpu_ns "${workers[@]}")
    u1=$(cpu_ns "$upstream")
    kill -TERM "$pid"
    wait "$pid" || true
    n=$(jq -r .requests "$j")
    # The CPU readings include the warm-up second's requests, which the probe does not count.
    per() { awk -v c="$1" -v n="$n" -v s="$secs" 'BEGIN { printf "%.2f", n ? c / (n * (s + 1) / s) / 1000 : 0 }'; }
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$r" "$c" "$(jq -r .requests_per_s "$j")" \
      "$(jq -r .latency_us.p50 "$j")" "$(jq -r .latency_us.p99 "$j")" "$(jq -r '.errors.total // 0' "$j")" \
      "$(per $((w1 - w0)))" "$(per $((u1 - u0)))" | tee -a "$tsv"
  done
done

summary() {
  sort -g | awk '{ v[NR] = $1 } END { if (!NR) { print "—"; exit }
    m = (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2
    f = (v[NR] >= 1000) ? "%.0f (%.0f–%.0f)\n" : "%.4g (%.4g–%.4g)\n"; printf f, m, v[1], v[NR] }'
}
col() { awk -F'\t' -v c="$1" -v k="$2" 'NR > 1 && $2 == c { print $k }' "$tsv"; }
ratio() {
  awk -F'\t' -v a="$1" -v b="$2" -v k="$3" 'NR > 1 { v[$1 "/" $2] = $k; r[$1] = 1 }
    END { for (i in r) if ((i "/" a) in v && (i "/" b) in v && v[i "/" b] > 0) printf "%.3f\n", v[i "/" a] / v[i "/" b] }' "$tsv"
}
{
  echo "| case | req/s | p50 µs | p99 µs | errors | worker CPU µs/request | upstream CPU µs/request |"
  echo "|---|---|---|---|---|---|---|"
  for c in $cases; do
    echo "| $c | $(col "$c" 3 | summary) | $(col "$c" 4 | summary) | $(col "$c" 5 | summary) | $(col "$c" 6 | summary) | $(col "$c" 7 | summary) | $(col "$c" 8 | summary) |"
  done
  echo
  echo "Within-round ratios, median (min–max):"
  echo "- proxy/builtin: req/s $(ratio proxy builtin 3 | summary), p50 $(ratio proxy builtin 4 | summary), p99 $(ratio proxy builtin 5 | summary), worker CPU/request $(ratio proxy builtin 7 | summary)"
  echo "- proxy1m/bytes1m: req/s $(ratio proxy1m bytes1m 3 | summary), p50 $(ratio proxy1m bytes1m 4 | summary), p99 $(ratio proxy1m bytes1m 5 | summary), worker CPU/request $(ratio proxy1m bytes1m 7 | summary)"
  if [[ -n $base ]]; then
    for c in proxy proxy1m; do
      [[ " $cases " == *" base-$c "* ]] || continue
      echo "- $c, this build / the base: req/s $(ratio "$c" "base-$c" 3 | summary), p99 $(ratio "$c" "base-$c" 5 | summary), worker CPU/request $(ratio "$c" "base-$c" 7 | summary)"
    done
  fi
} | tee "$out/summary.md"
