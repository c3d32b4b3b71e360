#!/usr/bin/env bash
# Memory as connections grow: the servers' resident memory per open connection, each connection
# with one 1 KiB request in flight at a time. For each round, in turn: ringmux over HTTP/3
# (h3-probe -c N -s 1), ringmux over TCP (h2load -c N -m 1, HTTP/2 over TLS 1.3) and nginx over
# TCP (the same h2load run; one worker process per ringmux instance, as bench-tcp.sh sets it
# up). Each target gets a fresh server; its processes' RSS (VmRSS of every worker; nginx: its
# master and workers) is read once the server is idle and ready (the base), then every 0.5 s
# while the client runs, with the connections open at that moment (over TCP, `ss` counts the
# established ones on the server's port; over HTTP/3, the workers' `ringmux_worker_connections`
# gauges). Each sample of the second half of the run, less the base, over the connections open
# then, is a figure of memory per connection; the median of those is the run's. The summary gives the median (min-max) over rounds and ringmux HTTP/3 / TCP and
# ringmux / nginx over TCP within each round. Memory does not depend on the CPU's other load,
# so this runs beside builds without harm to its figures (the client's rate does).
#
# --base DIR adds base-h3 and base-tcp: the ringmux and ringmux-worker in DIR (another build's
# target/release), for an A/B of two builds.
#
# Needs h2load (nghttp2-client), nginx, openssl, jq, curl and ss (iproute2); raises the open-files limit to fit N.
#
# Usage: bench/scripts/bench-conns.sh [--connections N] [--rounds R] [--seconds S]
#          [--instances K] [--no-nginx] [--base DIR] [--out DIR] [--no-build]
set -euo pipefail
cd "$(dirname "$0")/../.."
# shellcheck source=bench/scripts/common.sh
. bench/scripts/common.sh

connections=2000
rounds=3
duration=12
instances=2
nginx=1
base=""
out=""
build=1
while (($#)); do
  case $1 in
    --connections) connections=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --seconds) duration=$2; shift 2 ;;
    --instances) instances=$2; shift 2 ;;
    --no-nginx) nginx=0; shift ;;
    --base) base=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --no-build) build=0; shift ;;
    *) echo "bench-conns.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
((duration >= 4)) || { echo "bench-conns.sh: --seconds $duration: give at least 4" >&2; exit 2; }
tools=(h2load openssl jq)
((nginx)) && tools+=(nginx)
for tool in "${tools[@]}"; do
  command -v "$tool" >/dev/null || { echo "bench-conns.sh: $tool is required (apt-get install nghttp2-client nginx openssl jq)" >&2; exit 1; }
done
if [[ -n $base ]]; then
  [[ -x $base/ringmux && -x $base/ringmux-worker ]] || { echo "bench-conns.sh: --base $base holds no ringmux and ringmux-worker" >&2; exit 2; }
fi
ulimit -n $((connections * 2 + 1024)) 2>/dev/null || { echo "bench-conns.sh: cannot raise the open-files limit to $((connections * 2 + 1024))" >&2; exit 1; }
if ((build)); then
  cargo build --release --workspace --bins
fi
bin=target/release
work=$(mktemp -d /tmp/ringmux-bench-conns.XXXXXX)
out=${out:-$work}
mkdir -p "$out" "$work/root"
chmod 755 "$work" "$work/root"
server_pid=""
cleanup() {
  [[ -n $server_pid ]] && { kill -TERM "$server_pid" 2>/dev/null || true; wait "$server_pid" 2>/dev/null || true; }
  rm -rf "$work/root"
}
trap cleanup EXIT
head -c 1024 /dev/urandom >"$work/root/small.bin"
chmod 644 "$work/root/small.bin"
self_signed "$work"
port=4470
nginx_conf "$work" "$port" "$instances" "$connections"

# rss_kb PID...: the processes' resident memory, KiB.
rss_kb() {
  local s=0 p v
  for p in "$@"; do
    v=$(awk '/^VmRSS:/ { print $2 }' "/proc/$p/status" 2>/dev/null || true)
    s=$((s + ${v:-0}))
  done
  echo "$s"
}

# open_tcp: established TCP connections to the server's port.
open_tcp() {
  ss -Htn state established "( sport = :$port )" | wc -l
}

# open_quic URL: the workers' open QUIC connections, from ringmux's metrics at URL.
open_quic() {
  curl -s "$1" | awk '/^ringmux_worker_connections[{ ]/ { s += $NF } END { print s + 0 }'
}

# start TARGET: starts the target's server; sets server_pid and pids (the processes measured).
start() {
  local dir=$bin
  [[ $1 == base-* ]] && dir=$base
  if [[ $1 == nginx-tcp ]]; then
    nginx -p "$work" -c "$work/nginx.conf" -e "$work/nginx-error.log" >"$work/nginx.log" 2>&1 &
    server_pid=$!
    for _ in $(seq 1 100); do curl -sk -o /dev/null "https://127.0.0.1:$port/small.bin" && break; sleep 0.1; done
    mapfile -t pids < <(pgrep -P "$server_pid")
    pids+=("$server_pid")
  else
    "$dir/ringmux" --listen "127.0.0.1:$port" --instances "$instances" --root "$work/root" \
      --cert "$work/cert.pem" --key "$work/key.pem" --metrics 127.0.0.1:0 \
      --control-socket off >"$work/ringmux.log" 2>&1 &
    server_pid=$!
    for _ in $(seq 1 100); do grep -q "ringmux ready" "$work/ringmux.log" && break; sleep 0.1; done
    mapfile -t pids < <(pgrep -P "$server_pid")
    metrics="http://$(sed -n 's/.*ringmux ready.* metrics=\([^ ]*\).*/\1/p' "$work/ringmux.log" | head -1)/metrics"
    # One request over each transport first, so that neither the base nor the run pays for
    # the first request's lazy set-up (file cache, TLS and QUIC state created on first use).
    curl -sk -o /dev/null "https://127.0.0.1:$port/small.bin" || true
    "$bin/h3-probe" --url "https://127.0.0.1:$port/small.bin" --insecure -n "$instances" >/dev/null 2>&1 || true
  fi
}

tsv=$out/bench-conns.tsv
printf 'round\ttarget\tconnections\tbase_kib\tloaded_kib\topen\tbytes_per_connection\trequests\n' >"$tsv"
targets="ringmux-h3 ringmux-tcp"
((nginx)) && targets="$targets nginx-tcp"
[[ -n $base ]] && targets="$targets base-h3 base-tcp"
echo "== memory per connection [$targets]: $rounds rounds, $connections connections x 1 stream, ${duration}s; load $(cat /proc/loadavg)"
for round in $(seq 1 "$rounds"); do
  for target in $targets; do
    start "$target"
    base_kib=$(rss_kb "${pids[@]}")
    log=$work/$target-$round
    if [[ $target == *-h3 ]]; then
      "$bin/h3-probe" --url "https://127.0.0.1:$port/small.bin" --insecure -c "$connections" -s 1 \
        -d "$duration" --timeout 30 --json "$log.json" >/dev/null 2>&1 &
    else
      h2load -c "$connections" -m 1 -D "$duration" "https://127.0.0.1:$port/small.bin" >"$log.txt" 2>&1 &
    fi
    client=$!
    samples=()
    opens=()
    pers=()
    t0=$(date +%s%N)
    while kill -0 "$client" 2>/dev/null; do
      sleep 0.5
      now=$(date +%s%N)
      # The second half of the run: every connection is open by then.
      if ((now - t0 > duration * 500000000 && now - t0 < duration * 1000000000)); then
        rss=$(rss_kb "${pids[@]}")
        if [[ $target == *-h3 ]]; then open=$(open_quic "$metrics"); else open=$(open_tcp); fi
        if ((open > 0)); then
          samples+=("$rss")
          opens+=("$open")
          pers+=("$(awk -v l="$rss" -v b="$base_kib" -v n="$open" 'BEGIN { printf "%.0f", (l - b) * 1024 / n }')")
        fi
      fi
    done
    wait "$client" || true
    if [[ $target == *-h3 ]]; then
      requests=$(jq -r '.requests' "$log.json" 2>/dev/null || echo 0)
    else
      requests=$(awk '/^requests:/ { print $4 }' "$log.txt")
    fi
    median() { sort -n | awk '{ a[NR] = $1 } END { print (NR ? a[int((NR + 1) / 2)] : "nan") }'; }
    loaded=$(printf '%s\n' "${samples[@]}" | median)
    open=$(printf '%s\n' "${opens[@]}" | median)
    per=$(printf '%s\n' "${pers[@]}" | median)
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$round" "$target" "$connections" "$base_kib" "$loaded" "$open" "$per" "$requests" >>"$tsv"
    printf 'round %s %-11s base %8s KiB  loaded %8s KiB  open %5s  %7s bytes per connection  (%s requests, %s samples)\n' \
      "$round" "$target" "$base_kib" "$loaded" "$open" "$per" "$requests" "${#samples[@]}"
    kill -TERM "$server_pid" 2>/dev/null || true
    wait "$server_pid" 2>/dev/null || true
    server_pid=""
  done
done

python3 - "$tsv" <<'PY'
import csv, statistics, sys
rows = list(csv.DictReader(open(sys.argv[1]), delimiter="\t"))
targets = [t for t in ("ringmux-h3", "ringmux-tcp", "nginx-tcp", "base-h3", "base-tcp") if any(r["target"] == t for r in rows)]
print("| target | connections | open | base KiB | loaded KiB | bytes per open connection |")
print("|---|---|---|---|---|---|")
for t in targets:
    sel = [r for r in rows if r["target"] == t]
    cell = lambda k: "%.0f (%.0f–%.0f)" % (statistics.median(float(r[k]) for r in sel), min(float(r[k]) for r in sel), max(float(r[k]) for r in sel))
    print(f"| {t} | {sel[0]['connections']} | {cell('open')} | {cell('base_kib')} | {cell('loaded_kib')} | {cell('bytes_per_connection')} |")
def ratio(a, b):
    out = []
    for rnd in sorted({r["round"] for r in rows}):
        get = lambda t: next(float(r["bytes_per_connection"]) for r in rows if r["round"] == rnd and r["target"] == t)
        out.append(get(a) / get(b) if get(b) > 0 else float("nan"))
    return f"median {statistics.median(out):.2f} ({min(out):.2f}–{max(out):.2f})"
for a, b, what in (("ringmux-h3", "ringmux-tcp", "ringmux HTTP/3 / TCP"), ("ringmux-tcp", "nginx-tcp", "ringmux / nginx over TCP"),
                   ("ringmux-h3", "base-h3", "this build / the base over HTTP/3"), ("ringmux-tcp", "base-tcp", "this build / the base over TCP")):
    if a in targets and b in targets:
        print(f"- {what}: bytes per connection {ratio(a, b)}")
PY
