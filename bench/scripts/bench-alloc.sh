#!/usr/bin/env bash
# Heap allocations per HTTP/3 response in a worker, counted exactly: uprobes on the C library's
# malloc, calloc and realloc (which Rust's system allocator calls), read with `perf stat` on the
# worker process. One ringmux instance serves a built-in response (/hello.txt) and a 1 KiB file
# from --root; for each path h3-probe makes a short and a long run on fresh connections, and
# the difference between the two runs' counts over the difference in requests is what one
# request costs, without the handshakes and connection set-up both runs share.
#
# Needs root (uprobes) and perf (Debian: linux-perf). Adds the three probes if they are
# missing and removes the ones it added.
#
# Usage: bench/scripts/bench-alloc.sh [--requests N] [--paths "/hello.txt /small.bin"]
#          [--connections C] [--streams S] [--bin DIR | --no-build]
set -euo pipefail
cd "$(dirname "$0")/../.."

requests=20000
paths="/hello.txt /small.bin"
connections=4
streams=8
bin=target/release
build=1
while (($#)); do
  case $1 in
    --requests) requests=$2; shift 2 ;;
    --paths) paths=$2; shift 2 ;;
    --connections) connections=$2; shift 2 ;;
    --streams) streams=$2; shift 2 ;;
    --bin) bin=$2; build=0; shift 2 ;;
    --no-build) build=0; shift ;;
    *) echo "bench-alloc.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
command -v perf >/dev/null || { echo "bench-alloc.sh: perf is required (apt-get install linux-perf)" >&2; exit 1; }
command -v jq >/dev/null || { echo "bench-alloc.sh: jq is required (apt-get install jq)" >&2; exit 1; }
((requests >= 100)) || { echo "bench-alloc.sh: --requests $requests: give at least 100" >&2; exit 2; }
if ((build)); then
  cargo build --release -p ringmux-demux -p ringmux-server -p ringmux-bench --bins
fi

libc=$(ldd "$bin/ringmux-worker" | awk '/libc\.so/ { print $3 }')
[[ -r $libc ]] || { echo "bench-alloc.sh: cannot find the C library ringmux-worker links" >&2; exit 1; }
added=()
for fn in malloc calloc realloc; do
  if ! perf probe -l 2>/dev/null | grep -q "probe_libc:$fn "; then
    perf probe -q -x "$libc" "$fn" || { echo "bench-alloc.sh: perf probe $fn failed (root? uprobes?)" >&2; exit 1; }
    added+=("probe_libc:$fn")
  fi
done

work=$(mktemp -d /tmp/ringmux-bench-alloc.XXXXXX)
rm_pid=""
cleanup() {
  [[ -n $rm_pid ]] && { kill -TERM "$rm_pid" 2>/dev/null || true; wait "$rm_pid" 2>/dev/null || true; }
  for p in "${added[@]}"; do perf probe -q -d "$p" || true; done
  rm -rf "$work"
}
trap cleanup EXIT
mkdir -p "$work/root"
head -c 1024 /dev/urandom >"$work/root/small.bin"
chmod -R a+rX "$work"

RUST_LOG=warn "$bin/ringmux" --listen 127.0.0.1:0 --instances 1 --root "$work/root" --tcp off \
  --metrics off --control-socket off --worker-bin "$bin/ringmux-worker" >"$work/ringmux.out" 2>"$work/ringmux.err" &
rm_pid=$!
for _ in $(seq 300); do
  grep -q '^ringmux ready' "$work/ringmux.out" 2>/dev/null && break
  kill -0 "$rm_pid" 2>/dev/null || { echo "ringmux exited:" >&2; tail "$work/ringmux.err" >&2; exit 1; }
  sleep 0.1
done
listen=$(sed -n 's/^ringmux ready.* listen=\([^ ]*\).*/\1/p' "$work/ringmux.out")
[[ -n $listen ]] || { echo "ringmux not ready in 30 s" >&2; exit 1; }
worker=$(pgrep -P "$rm_pid" -f ringmux-worker | head -1)
[[ -n $worker ]] || { echo "no worker process under ringmux $rm_pid" >&2; exit 1; }

# count PATH N: "requests malloc calloc realloc" of one h3-probe run of N requests.
count() {
  local stat=$work/stat.txt json=$work/probe.json perf_pid
  perf stat -x, -e probe_libc:malloc,probe_libc:calloc,probe_libc:realloc -p "$worker" -o "$stat" &
  perf_pid=$!
  # perf stat attaches before it writes anything; the file appears once it counts.
  for _ in $(seq 100); do [[ -e $stat ]] && break; sleep 0.05; done
  "$bin/h3-probe" --url "https://$listen$1" --insecure -c "$connections" -s "$streams" \
    -n "$2" -d 600 --json "$json" >/dev/null 2>&1 || true
  kill -INT "$perf_pid"
  wait "$perf_pid" || true
  printf '%s %s\n' "$(jq -r '.requests' "$json")" \
    "$(awk -F, '/probe_libc:malloc/ { m = $1 } /probe_libc:calloc/ { c = $1 } /probe_libc:realloc/ { r = $1 } END { print m, c, r }' "$stat")"
}

echo "== allocations per response: worker $worker, ${connections}x$streams, $requests requests (minus a run of $((requests / 10)))"
printf '| path | malloc | calloc | realloc | all |\n|---|---|---|---|---|\n'
for path in $paths; do
  count "$path" 200 >/dev/null # warm caches (file cache, session tickets)
  read -r n1 m1 c1 r1 < <(count "$path" $((requests / 10)))
  read -r n2 m2 c2 r2 < <(count "$path" "$requests")
  awk -v p="$path" -v n=$((n2 - n1)) -v m=$((m2 - m1)) -v c=$((c2 - c1)) -v r=$((r2 - r1)) \
    'BEGIN { if (n <= 0) { print "| " p " | no requests counted | | | |"; exit }
             printf "| %s | %.1f | %.1f | %.1f | %.1f |\n", p, m / n, c / n, r / n, (m + c + r) / n }'
done
