#!/usr/bin/env bash
# Profiles the ringmux demux under a blast of routable datagrams (sink workers, no quinn):
#   1. perf stat (software events: task-clock, context-switches, cpu-migrations, page-faults;
#      hardware counters are not available on these VMs) of the data-plane thread and of the
#      whole process, with task-clock per datagram;
#   2. perf record (cpu-clock sampling, call graphs) of the data-plane thread, if perf works,
#      and the top of its report;
#   3. strace -c -f of the whole demux process: syscalls per datagram by kind (recvmmsg,
#      sendmsg for unix forwarding, write = eventfd doorbells, poll = idle waits).
# Each phase gets its own blast (fwd-bench blast) and reads ringmux_datagrams_received_total
# around it. strace stops the tracee at every syscall: the demux gets far slower, so its batches
# grow; read the strace figures as "which syscalls, roughly how many", not as a rate.
#
# Usage: bench/scripts/profile.sh [--mode shm|unix|drop] [--seconds S] [--gro on|off]
#          [--instances K] [--rate PPS] [--cpus LIST] [--out DIR] [--no-build]
set -euo pipefail
cd "$(dirname "$0")/../.."

mode=shm
duration=5
gro=on
instances=1
rate=""
cpus=1,0
out=""
build=1

while (($#)); do
  case $1 in
    --mode) mode=$2; shift 2 ;;
    --seconds) duration=$2; shift 2 ;;
    --gro) gro=$2; shift 2 ;;
    --instances) instances=$2; shift 2 ;;
    --rate) rate=$2; shift 2 ;;
    --cpus) cpus=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --no-build) build=0; shift ;;
    -h | --help) sed -n '2,17p' "$0"; exit 0 ;;
    *) echo "profile.sh: unknown argument $1 (try --help)" >&2; exit 2 ;;
  esac
done

out=${out:-bench/results/profile-$mode-gro$gro-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$out"
bin=target/release
if ((build)); then
  echo "== cargo build --release --workspace --bins"
  cargo build --release --workspace --bins
fi
for b in ringmux ringmux-worker fwd-bench; do
  [[ -x $bin/$b ]] || { echo "profile.sh: $bin/$b missing (build first)" >&2; exit 1; }
done

rm_pid=""
blast_pid=""
tmp=$(mktemp -d)
cleanup() {
  rm -rf "$tmp"
  if [[ -n $blast_pid ]] && kill -0 "$blast_pid" 2>/dev/null; then kill "$blast_pid" 2>/dev/null || true; fi
  if [[ -n $rm_pid ]] && kill -0 "$rm_pid" 2>/dev/null; then
    kill -TERM "$rm_pid" 2>/dev/null || true
    wait "$rm_pid" 2>/dev/null || true
  fi
}
trap cleanup EXIT

keys=$tmp/keys # throw-away keys, never written into the results
"$bin/fwd-bench" keygen "$keys"
echo "== ringmux --forward $mode --worker-mode sink --instances $instances --cpus $cpus (load: $(cat /proc/loadavg))"
RUST_LOG=${RUST_LOG:-warn} "$bin/ringmux" --listen 127.0.0.1:0 --metrics 127.0.0.1:0 \
  --instances "$instances" --forward "$mode" --worker-mode sink --worker-bin "$bin/ringmux-worker" \
  --key-file "$keys" --cpus "$cpus" --grace 2 >"$out/ringmux.out" 2>"$out/ringmux.err" &
rm_pid=$!
for _ in $(seq 300); do
  grep -q '^ringmux ready' "$out/ringmux.out" 2>/dev/null && break
  kill -0 "$rm_pid" 2>/dev/null || { tail "$out/ringmux.err" >&2; exit 1; }
  sleep 0.1
done
ready=$(grep '^ringmux ready' "$out/ringmux.out") || { echo "ringmux not ready in 30 s" >&2; exit 1; }
listen=$(sed -n 's/.* listen=\([^ ]*\).*/\1/p' <<<"$ready")
metrics=$(sed -n 's/.* metrics=\([^ ]*\).*/\1/p' <<<"$ready")
tid=""
for t in /proc/"$rm_pid"/task/*; do
  [[ $(cat "$t/comm") == data-plane ]] && tid=${t##*/}
done
[[ -n $tid ]] || { echo "no data-plane thread in ringmux $rm_pid" >&2; exit 1; }
echo "   pid $rm_pid, data-plane thread $tid, listen $listen, metrics $metrics"

received() {
  curl -sf "http://$metrics/metrics" | awk '$1 == "ringmux_datagrams_received_total" { printf "%.0f\n", $2 }'
}
# The sender on the last CPU of --cpus (a sink CPU), as fwd-bench --regime live does.
sender_cpu=${cpus##*,}
blast() {
  local extra=()
  [[ -n $rate ]] && extra=(--rate "$rate")
  "$bin/fwd-bench" blast --target "$listen" --key-file "$keys" --instances "$instances" \
    --gro "$gro" --seconds "$1" --cpu "$sender_cpu" "${extra[@]}" >>"$out/blast.txt" &
  blast_pid=$!
  sleep 0.5 # let the blast reach steady state before measuring
}
blast_done() { wait "$blast_pid" || true; blast_pid=""; }
per_dgram() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.4g", b ? a / b : 0 }'; }

summary=$out/summary.txt
: >"$summary"
note() { echo "$*" | tee -a "$summary"; }
note "profile: mode=$mode gro=$gro instances=$instances rate=${rate:-max} ${duration}s per phase; load before: $(cat /proc/loadavg)"

# 1. perf stat
if command -v perf >/dev/null; then
  events=task-clock,context-switches,cpu-migrations,page-faults
  blast $((duration + 1))
  r0=$(received)
  perf stat -x, -e "$events" -t "$tid" -o "$out/perf-stat-data-plane.csv" -- sleep "$duration" &
  ps1=$!
  perf stat -e "$events" -p "$rm_pid" -o "$out/perf-stat-process.txt" -- sleep "$duration"
  wait "$ps1"
  r1=$(received)
  blast_done
  dg=$((r1 - r0))
  tc_ms=$(awk -F, '$3 == "task-clock" { print $1 }' "$out/perf-stat-data-plane.csv")
  cs=$(awk -F, '$3 == "context-switches" { print $1 }' "$out/perf-stat-data-plane.csv")
  note ""
  note "## perf stat ($dg datagrams received in ${duration}s)"
  note "data-plane thread: task-clock ${tc_ms} ms = $(per_dgram "$(awk -v m="$tc_ms" 'BEGIN { print m * 1e6 }')" "$dg") ns/datagram; context switches $cs = $(per_dgram "$cs" "$dg")/datagram"
  note "whole process (perf stat -p):"
  grep -E 'task-clock|context-switches|cpu-migrations|page-faults' "$out/perf-stat-process.txt" | tee -a "$summary"
else
  note "perf not installed: skipping perf stat and perf record"
fi

# 2. perf record
if command -v perf >/dev/null; then
  blast $((duration + 1))
  if perf record -e cpu-clock -F 1999 -g -t "$tid" -o "$out/perf.data" -- sleep "$duration" \
    >"$out/perf-record.log" 2>&1; then
    blast_done
    perf report -i "$out/perf.data" --stdio --no-children --percent-limit 1.5 \
      --sort symbol 2>/dev/null | grep -v '^$' | head -60 >"$out/perf-report.txt" || true
    note ""
    note "## perf record (cpu-clock, data-plane thread): top symbols, full report in $out/perf-report.txt"
    grep -E '^ +[0-9.]+%' "$out/perf-report.txt" | head -15 | tee -a "$summary"
  else
    blast_done
    note "perf record failed: see $out/perf-record.log"
  fi
fi

# 3. strace -c -f
if command -v strace >/dev/null; then
  blast $((duration + 1))
  r0=$(received)
  timeout -s INT "$duration" strace -c -f -p "$rm_pid" -o "$out/strace.txt" || true
  r1=$(received)
  blast_done
  dg=$((r1 - r0))
  note ""
  note "## strace -c -f -p $rm_pid: syscalls per datagram ($dg datagrams while traced)"
  awk -v d="$dg" '
    $NF ~ /^(recvmmsg|recvmsg|sendmsg|sendmmsg|write|writev|poll|ppoll|epoll_wait|futex|read)$/ {
      # % time, seconds, usecs/call, calls, [errors], syscall
      calls = $4; errors = (NF == 6) ? $5 : 0
      printf "  %-12s %10d calls (%d errors)  %.5f per datagram\n", $NF, calls, errors, d ? calls / d : 0
    }' "$out/strace.txt" | tee -a "$summary"
  note "  (write = eventfd doorbells from the data plane, plus a few from the metrics thread answering"
  note "   this script; sendmsg = unix-mode forwarding; poll = the data plane going idle)"
else
  note "strace not installed: skipping the syscall census"
fi
note ""
note "load after: $(cat /proc/loadavg); outputs in $out/"
