#!/usr/bin/env bash
# End-to-end A/B of ringmux's forwarding modes with real HTTP/3 workers: for each round, each
# mode (default: shm then unix) gets a fresh ringmux and one h3-probe run against it. Reports,
# per mode, median (min–max) over the rounds of: requests/s, latency p50/p99, errors, and the
# demux's data-plane CPU per datagram (from /proc/PID/task/TID/schedstat and
# ringmux_datagrams_received_total, read around the probe run, handshakes included) and the
# workers' CPU per request, the whole box's busy CPU per request (every CPU, /proc/stat: the
# client, the demux, the workers and the kernel's network work), and the shm/unix (and, with
# kernel steering among the modes, shm/reuseport) ratios within each round. Checks the issue's
# targets on the medians of those ratios: shm req/s >= unix, shm p99 no worse, zero errors.
# Modes: shm, unix, drop, reuseport (kernel steering; then every mode of the run gets
# --plaintext-cids, so that all route alike).
#
# The client runs on the same machine as the server: on a 2-CPU box it competes with the
# demux and the workers, so compare modes within a run, not with other machines. ringmux and
# the client each run in a session of their own (setsid): ringmux as systemd starts a service,
# the client as a remote one would be, outside ringmux's scheduler autogroup (each session is
# one, where autogroups are on: /proc/sys/kernel/sched_autogroup_enabled). Sharing the demux's
# autogroup, the client would take its CPU from the demux's share alone, since every worker has
# a session, so an autogroup, of its own.
#
# Usage: bench/scripts/bench-ab.sh [--rounds N] [--seconds S] [--connections C] [--streams S]
#          [--instances K] [--path /bytes/1024] [--modes "shm unix"] [--cpus LIST]
#          [--out DIR] [--no-build] [--bin DIR]
# --bin DIR: the ringmux, ringmux-worker and h3-probe to run (default target/release, built
# first unless --no-build), e.g. a copy of another build for an A/B of two builds.
set -euo pipefail
cd "$(dirname "$0")/../.."

rounds=3
duration=10
connections=16
streams=8
instances=2
url_path=/bytes/1024
modes="shm unix"
cpus=""
out=""
build=1
bin=target/release

while (($#)); do
  case $1 in
    --rounds) rounds=$2; shift 2 ;;
    --seconds) duration=$2; shift 2 ;;
    --connections) connections=$2; shift 2 ;;
    --streams) streams=$2; shift 2 ;;
    --instances) instances=$2; shift 2 ;;
    --path) url_path=$2; shift 2 ;;
    --modes) modes=$2; shift 2 ;;
    --cpus) cpus=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --no-build) build=0; shift ;;
    --bin) bin=$2; build=0; shift 2 ;;
    -h | --help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "bench-ab.sh: unknown argument $1 (try --help)" >&2; exit 2 ;;
  esac
done

out=${out:-bench/results/ab-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$out"

if ((build)); then
  echo "== cargo build --release --workspace --bins"
  cargo build --release --workspace --bins
fi
for b in ringmux ringmux-worker h3-probe; do
  [[ -x $bin/$b ]] || { echo "bench-ab.sh: $bin/$b missing (build first)" >&2; exit 1; }
done
command -v jq >/dev/null || { echo "bench-ab.sh: jq is required" >&2; exit 1; }

rm_pid=""
cleanup() {
  if [[ -n $rm_pid ]] && kill -0 "$rm_pid" 2>/dev/null; then
    kill -TERM "$rm_pid" 2>/dev/null || true
    wait "$rm_pid" 2>/dev/null || true
  fi
}
trap cleanup EXIT

# metric NAME: sum of every series of NAME from the running ringmux.
metric() {
  curl -sf "http://$metrics/metrics" |
    awk -v n="$1" '$1 == n || index($1, n "{") == 1 { s += $2 } END { printf "%.0f\n", s }'
}
# proc_cpu_ns PID: on-CPU ns of every thread of PID.
proc_cpu_ns() {
  local s=0 t v
  for t in /proc/"$1"/task/*/schedstat; do
    read -r v _ <"$t" 2>/dev/null || continue
    s=$((s + v))
  done
  echo "$s"
}
# workers_cpu_ns: on-CPU ns of every worker process.
workers_cpu_ns() {
  local s=0 p
  for p in $(curl -sf "http://$metrics/metrics" | awk '/^ringmux_worker_pid\{/ { print $2 }'); do
    [[ $p == 0 ]] && continue
    s=$((s + $(proc_cpu_ns "$p")))
  done
  echo "$s"
}
# box_busy_ns: busy time of every CPU since boot (user, nice, system, irq, softirq, steal).
box_busy_ns() {
  awk -v hz="$(getconf CLK_TCK)" '/^cpu / { printf "%.0f\n", ($2 + $3 + $4 + $7 + $8 + $9) * 1e9 / hz }' /proc/stat
}
# summary VALUES...: "median (min–max)" of numbers.
summary() {
  printf '%s\n' "$@" | sort -g | awk '
    { v[NR] = $1 }
    END {
      if (NR == 0) { print "—"; exit }
      m = (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2
      printf "%.6g (%.6g–%.6g)\n", m, v[1], v[NR]
    }'
}
median() { summary "$@" | awk '{ print $1 }'; }

tsv=$out/rounds.tsv
printf 'round\tmode\treq_per_s\tp50_us\tp99_us\terrors\tdemux_ns_per_datagram\tprocess_ns_per_datagram\tworker_us_per_request\tdoorbells_per_datagram\tdatagrams\tloadavg\tbox_us_per_request\tp999_us\n' >"$tsv"
plaintext=()
[[ " $modes " == *" reuseport "* ]] && plaintext=(--plaintext-cids)
echo "== A/B: modes [$modes], $rounds rounds, $connections connections x $streams streams, ${duration}s, $instances instances, $url_path; load: $(cat /proc/loadavg)"

for ((round = 1; round <= rounds; round++)); do
  for mode in $modes; do
    log=$out/ringmux-$mode-$round
    args=(--listen 127.0.0.1:0 --metrics 127.0.0.1:0 --instances "$instances" --forward "$mode"
      --worker-bin "$bin/ringmux-worker" --grace 2 "${plaintext[@]}")
    [[ -n $cpus ]] && args+=(--cpus "$cpus")
    RUST_LOG=${RUST_LOG:-warn} setsid "$bin/ringmux" "${args[@]}" >"$log.out" 2>"$log.err" &
    rm_pid=$!
    for _ in $(seq 300); do
      grep -q '^ringmux ready' "$log.out" 2>/dev/null && break
      kill -0 "$rm_pid" 2>/dev/null || { echo "ringmux exited:" >&2; tail "$log.err" >&2; exit 1; }
      sleep 0.1
    done
    ready=$(grep '^ringmux ready' "$log.out") || { echo "ringmux not ready in 30 s" >&2; exit 1; }
    listen=$(sed -n 's/.* listen=\([^ ]*\).*/\1/p' <<<"$ready")
    metrics=$(sed -n 's/.* metrics=\([^ ]*\).*/\1/p' <<<"$ready")
    tid=""
    for t in /proc/"$rm_pid"/task/*; do
      [[ $(cat "$t/comm") == data-plane ]] && tid=${t##*/}
    done
    [[ -n $tid ]] || { echo "no data-plane thread in ringmux $rm_pid" >&2; exit 1; }
    sleep 0.5 # workers report their pids within 250 ms

    read -r dp0 _ <"/proc/$rm_pid/task/$tid/schedstat"
    p0=$(proc_cpu_ns "$rm_pid")
    w0=$(workers_cpu_ns)
    r0=$(metric ringmux_datagrams_received_total)
    b0=$(metric ringmux_doorbells_total)
    x0=$(box_busy_ns)
    json=$out/probe-$mode-$round.json
    setsid --wait "$bin/h3-probe" --url "https://$listen$url_path" --connections "$connections" \
      --streams "$streams" --seconds "$duration" --warmup 1 --insecure --json "$json" \
      >"$out/probe-$mode-$round.txt" 2>&1 || true
    x1=$(box_busy_ns)
    read -r dp1 _ <"/proc/$rm_pid/task/$tid/schedstat"
    p1=$(proc_cpu_ns "$rm_pid")
    w1=$(workers_cpu_ns)
    sleep 0.2 # the doorbell gauge is refreshed every 100 ms
    r1=$(metric ringmux_datagrams_received_total)
    b1=$(metric ringmux_doorbells_total)
    kill -TERM "$rm_pid"
    wait "$rm_pid" || true
    rm_pid=""

    if [[ ! -s $json ]]; then
      echo "round $round $mode: h3-probe wrote no report; see $out/probe-$mode-$round.txt" >&2
      rps=0 p50=0 p99=0 p999=0 errors=1 requests=0
    else
      rps=$(jq -r '.requests_per_s' "$json")
      p50=$(jq -r '.latency_us.p50' "$json")
      p99=$(jq -r '.latency_us.p99' "$json")
      p999=$(jq -r '.latency_us.p999' "$json")
      errors=$(jq -r '.errors.total // 0' "$json")
      requests=$(jq -r '.requests' "$json")
    fi
    dg=$((r1 - r0))
    dns=$(awk -v c=$((dp1 - dp0)) -v d="$dg" 'BEGIN { printf "%.1f", d ? c / d : 0 }')
    pns=$(awk -v c=$((p1 - p0)) -v d="$dg" 'BEGIN { printf "%.1f", d ? c / d : 0 }')
    dpd=$(awk -v b=$((b1 - b0)) -v d="$dg" 'BEGIN { printf "%.4f", d ? b / d : 0 }')
    wus=$(awk -v c=$((w1 - w0)) -v r="$requests" 'BEGIN { printf "%.2f", r ? c / r / 1000 : 0 }')
    bus=$(awk -v c=$((x1 - x0)) -v r="$requests" 'BEGIN { printf "%.2f", r ? c / r / 1000 : 0 }')
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$round" "$mode" "$rps" "$p50" "$p99" \
      "$errors" "$dns" "$pns" "$wus" "$dpd" "$dg" "$(cut -d' ' -f1-3 /proc/loadavg)" "$bus" "$p999" >>"$tsv"
    printf 'round %d %-4s: %8.0f req/s  p50 %6s us  p99 %6s us  p99.9 %6s us  errors %s  demux %6s ns/datagram (process %s)  workers %s us/request  box %s us/request  doorbells/datagram %s  %s datagrams\n' \
      "$round" "$mode" "$rps" "$p50" "$p99" "$p999" "$errors" "$dns" "$pns" "$wus" "$bus" "$dpd" "$dg"
  done
done

col() { awk -F'\t' -v m="$1" -v c="$2" 'NR > 1 && $2 == m { print $c }' "$tsv"; }
{
  echo
  echo "End-to-end A/B ($rounds rounds, $connections x $streams, ${duration}s, $instances instances, $url_path; load after: $(cat /proc/loadavg))"
  echo
  echo "| mode | req/s | p50 µs | p99 µs | p99.9 µs | errors | demux ns/datagram | process ns/datagram | worker µs/request | box µs/request | doorbells/datagram |"
  echo "|---|---|---|---|---|---|---|---|---|---|---|"
  for mode in $modes; do
    # shellcheck disable=SC2046 # one number per line, split on purpose
    echo "| $mode | $(summary $(col "$mode" 3)) | $(summary $(col "$mode" 4)) | $(summary $(col "$mode" 5)) | $(summary $(col "$mode" 14)) | $(summary $(col "$mode" 6)) | $(summary $(col "$mode" 7)) | $(summary $(col "$mode" 8)) | $(summary $(col "$mode" 9)) | $(summary $(col "$mode" 13)) | $(summary $(col "$mode" 10)) |"
  done
} | tee "$out/summary.md"

# ratios COLUMN [OTHER]: shm/OTHER (default unix) of COLUMN within each round (the rounds
# interleave the modes, so a ratio inside one round cancels the drift between rounds that
# medians per mode keep).
ratios() {
  awk -F'\t' -v c="$1" -v o="${2:-unix}" 'NR > 1 { v[$1 "/" $2] = $c; r[$1] = 1 }
    END { for (k in r) if ((k "/shm") in v && (k "/" o) in v && v[k "/" o] > 0)
      printf "%.3f\n", v[k "/shm"] / v[k "/" o] }' "$tsv"
}

if [[ " $modes " == *" shm "* && " $modes " == *" reuseport "* ]]; then
  # shellcheck disable=SC2046 # one number per line, split on purpose
  printf '\nWithin-round ratios shm/reuseport (median, min–max): req/s %s, p99 %s, p99.9 %s, box µs/request %s\n' \
    "$(summary $(ratios 3 reuseport))" "$(summary $(ratios 5 reuseport))" "$(summary $(ratios 14 reuseport))" "$(summary $(ratios 13 reuseport))" |
    tee -a "$out/summary.md"
fi

if [[ " $modes " == *" shm "* && " $modes " == *" unix "* ]]; then
  # shellcheck disable=SC2046 # one number per line, split on purpose
  {
    r_rps=$(median $(ratios 3)); r_p99=$(median $(ratios 5))
    errs=$(awk -F'\t' 'NR > 1 { s += $6 } END { print s + 0 }' "$tsv")
    ratio_line="Within-round ratios shm/unix (median, min–max): req/s $(summary $(ratios 3)), p99 $(summary $(ratios 5)), demux ns/datagram $(summary $(ratios 7))"
  }
  printf '\n%s\n' "$ratio_line" | tee -a "$out/summary.md"
  verdict() { if awk "BEGIN { exit !($2) }"; then echo "- $1: met"; else echo "- $1: NOT met"; fi; }
  {
    echo
    echo "Targets (medians of the within-round ratios):"
    verdict "shm req/s at least unix req/s (ratio $r_rps >= 1)" "$r_rps >= 1"
    verdict "shm p99 no worse than unix p99 (ratio $r_p99 <= 1)" "$r_p99 <= 1"
    verdict "zero errors (saw $errs)" "$errs == 0"
  } | tee -a "$out/summary.md"
fi
echo "== per-round figures in $tsv, probe reports in $out/"
