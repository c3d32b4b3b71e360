#!/usr/bin/env bash
# The HTTP/3 load client's own cost: builds (or options) of h3-probe against one ringmux
# serving a 1 KiB file from --root, in interleaved rounds. Per run: requests/s, latency p99, the
# client's CPU per request (its whole run, user and system, from GNU time) and the datagrams the
# server received per request (ringmux_datagrams_received_total). No warm-up, so every figure
# covers the same span.
#
# Usage: bench/scripts/bench-h3-client.sh [--rounds N] [--seconds S] [--connections C] [--streams M]
#          [--ringmux PATH] LABEL=PROBE[,ARG...]...
# e.g.   bench/scripts/bench-h3-client.sh before=/tmp/h3-probe-main now=target/release/h3-probe \
#          now-task-per-stream=target/release/h3-probe,--task-per-stream
# Needs openssl, curl and time (GNU time). Run as root or not; the client shares the box with
# the server, so compare runs within one invocation.
set -euo pipefail
cd "$(dirname "$0")/../.."
# shellcheck source=bench/scripts/common.sh
. bench/scripts/common.sh
rounds=3
seconds=6
connections=16
streams=8
ringmux=target/release/ringmux
probes=()
while (($#)); do
  case $1 in
    --rounds) rounds=$2; shift 2 ;;
    --seconds) seconds=$2; shift 2 ;;
    --connections) connections=$2; shift 2 ;;
    --streams) streams=$2; shift 2 ;;
    --ringmux) ringmux=$2; shift 2 ;;
    *=*) probes+=("$1"); shift ;;
    *) echo "bench-h3-client.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
((${#probes[@]})) || { echo "bench-h3-client.sh: name at least one LABEL=PROBE" >&2; exit 2; }
for tool in openssl curl /usr/bin/time; do
  command -v "$tool" >/dev/null || { echo "bench-h3-client.sh: $tool is required" >&2; exit 1; }
done
work=$(mktemp -d /tmp/ringmux-bench-h3-client.XXXXXX)
mkdir -p "$work/root"
chmod 755 "$work" "$work/root"
head -c 1024 /dev/urandom >"$work/root/small.bin"
chmod 644 "$work/root/small.bin"
self_signed "$work"
port=4442
"$ringmux" --listen "127.0.0.1:$port" --instances 2 --root "$work/root" --cert "$work/cert.pem" \
  --key "$work/key.pem" --metrics 127.0.0.1:0 --control-socket off >"$work/ringmux.log" 2>&1 &
rm_pid=$!
trap 'kill -TERM $rm_pid 2>/dev/null || true; wait $rm_pid 2>/dev/null || true; rm -rf "$work"' EXIT
for _ in $(seq 1 100); do grep -q "ringmux ready" "$work/ringmux.log" && break; sleep 0.1; done
metrics=$(grep -o 'metrics=[0-9.:]*' "$work/ringmux.log" | head -1 | cut -d= -f2)
received() { curl -s "http://$metrics/metrics" | awk '/^ringmux_datagrams_received_total /{ print $2 }'; }
echo "== h3-probe, ${connections}x$streams, ${seconds} s, no warm-up, GET /small.bin (1024 B) from --root; load $(cat /proc/loadavg)"
for round in $(seq 1 "$rounds"); do
  for probe in "${probes[@]}"; do
    label=${probe%%=*}
    IFS=, read -r -a cmd <<<"${probe#*=}"
    d0=$(received)
    /usr/bin/time -f "%U %S" -o "$work/time" "${cmd[@]}" --url "https://127.0.0.1:$port/small.bin" \
      --insecure -c "$connections" -s "$streams" -d "$seconds" --warmup 0 --expect-len 1024 >"$work/out" 2>&1
    sleep 0.3
    d1=$(received)
    n=$(awk '/^requests /{ print $2 }' "$work/out")
    e=$(awk '/^errors/{ print $2 }' "$work/out")
    p99=$(awk '/^latency/{ print $6 }' "$work/out")
    awk -v n="$n" -v e="$e" -v l="$label" -v r="$round" -v d=$((d1 - d0)) -v p99="$p99" -v s="$seconds" \
      '{ printf "round %s %-24s requests %7d errors %s req/s %6.0f p99 %6s us client CPU %5.2f us/request datagrams to server %.3f/request\n", r, l, n, e, n / s, p99, ($1 + $2) * 1e6 / n, d / n }' "$work/time"
  done
done
