#!/usr/bin/env bash
# ringmux, nginx and Caddy, over TCP and over HTTP/3, measured side by side in one run: for each
# round, ringmux over TCP (h2load, HTTP/2), nginx over TCP (h2load, HTTP/2, as many worker
# processes as ringmux has instances), Caddy over TCP (h2load, HTTP/2), ringmux over HTTP/3
# and Caddy over HTTP/3 (h3-probe), each on the same small file and the same 1 MiB file from a
# document root, one after the other. Reports per target and file the median (min-max) over
# rounds of requests/s, latency p99 and the server's CPU per request (ringmux: its workers;
# nginx: its master and workers; Caddy: its process) and the whole box's busy CPU per request
# (every CPU, /proc/stat: the
# client, the server and the kernel), the client's own CPU per request (h3-probe: over its
# measured window, from its JSON; h2load: its whole run from GNU time, scaled by
# seconds / (seconds + the 1 s warm-up)), the ringmux/nginx and ringmux/Caddy ratios of req/s
# and of server CPU per request within each round, per transport, and ringmux's own HTTP/3
# against its HTTP/2 (CPU per request). No server writes an access log.
# --files LIST picks the files (default "small big"): tiny (1 byte), small (1 KiB), big (1 MiB),
# page (a 16 KiB HTML page of words, which ringmux compresses).
# --coding CODING (br, zstd or gzip) adds ringmux-tcp-CODING and ringmux-h3-CODING: ringmux
# again, each request with `accept-encoding: CODING` (a compressible file is then served from
# its cached compressed copy); the summary gives coded / plain within each round.
# The tiny-response shape of published HTTP/3 comparisons (64 connections x 64 streams, a tiny
# body): --connections 64 --streams 64 --files tiny; the summary gives each server's requests
# per server core-second (1 / its CPU per request).
# --no-caddy-h3 leaves Caddy's HTTP/3 out (it then serves HTTP/1.1 and HTTP/2 only);
# --no-caddy and --no-nginx leave that server out.
# --base DIR adds base-tcp and base-h3: the ringmux and ringmux-worker in DIR (a copy of
# another build's target/release) run beside this build's in every round, for an A/B of two
# builds; the summary gives this build / the base within each round.
# --h3-probe-arg ARG (repeatable) passes ARG to every h3-probe run, e.g.
# --h3-probe-arg=--task-per-stream for the client's earlier shape.
#
# Needs Debian's nghttp2-client (h2load), caddy, nginx, openssl and time (GNU time); jq for
# h3-probe's JSON. The client shares the machine with the servers: compare targets within a
# run, not across machines.
#
# Usage: bench/scripts/bench-tcp.sh [--rounds N] [--seconds S] [--connections C] [--streams M]
#          [--instances K] [--files "tiny small big"] [--out DIR] [--no-build] [--no-caddy-h3]
#          [--no-caddy] [--no-nginx] [--coding CODING] [--base DIR] [--h3-probe-arg ARG]...
set -euo pipefail
cd "$(dirname "$0")/../.."
# shellcheck source=bench/scripts/common.sh
. bench/scripts/common.sh

rounds=3
duration=8
connections=16
streams=8
instances=2
out=""
build=1
caddy_h3=1
caddy=1
nginx=1
files="small big"
coding=""
base=""
probe_args=()
while (($#)); do
  case $1 in
    --rounds) rounds=$2; shift 2 ;;
    --seconds) duration=$2; shift 2 ;;
    --connections) connections=$2; shift 2 ;;
    --streams) streams=$2; shift 2 ;;
    --instances) instances=$2; shift 2 ;;
    --files) files=$2; shift 2 ;;
    --coding) coding=$2; shift 2 ;;
    --base) base=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --no-build) build=0; shift ;;
    --no-caddy-h3) caddy_h3=0; shift ;;
    --no-caddy) caddy=0; caddy_h3=0; shift ;;
    --no-nginx) nginx=0; shift ;;
    --h3-probe-arg) probe_args+=("$2"); shift 2 ;;
    --h3-probe-arg=*) probe_args+=("${1#--h3-probe-arg=}"); shift ;;
    *) echo "bench-tcp.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
tools=(h2load openssl jq /usr/bin/time)
((caddy)) && tools+=(caddy)
((nginx)) && tools+=(nginx)
for tool in "${tools[@]}"; do
  command -v "$tool" >/dev/null || { echo "bench-tcp.sh: $tool is required (apt-get install nghttp2-client caddy nginx openssl jq time)" >&2; exit 1; }
done
if ((build)); then
  echo "== cargo build --release --workspace --bins"
  cargo build --release --workspace --bins
fi
bin=target/release
work=$(mktemp -d /tmp/ringmux-bench-tcp.XXXXXX)
out=${out:-$work}
mkdir -p "$out" "$work/root"
chmod 755 "$work" "$work/root"
rm_pid=""
base_pid=""
caddy_pid=""
nginx_pid=""
cleanup() {
  for p in $rm_pid $base_pid $caddy_pid $nginx_pid; do
    kill -TERM "$p" 2>/dev/null || true
    wait "$p" 2>/dev/null || true
  done
  rm -rf "$work/root"
}
trap cleanup EXIT

for file in $files; do
  [[ $file == tiny || $file == small || $file == big || $file == page ]] || { echo "bench-tcp.sh: --files takes tiny, small, big and page, not $file" >&2; exit 2; }
done
[[ -z $coding || $coding == br || $coding == zstd || $coding == gzip ]] || { echo "bench-tcp.sh: --coding takes br, zstd or gzip, not $coding" >&2; exit 2; }
# name_of FILE: the file's name in the document root.
name_of() {
  if [[ $1 == page ]]; then echo page.html; else echo "$1.bin"; fi
}
head -c 1 /dev/urandom >"$work/root/tiny.bin"
head -c 1024 /dev/urandom >"$work/root/small.bin"
head -c 1048576 /dev/urandom >"$work/root/big.bin"
html_page "$work/root/page.html"
chmod 644 "$work/root/"*.bin
self_signed "$work"

rm_port=4440
caddy_port=4441
nginx_port=4442
base_port=4443
if [[ -n $base ]]; then
  [[ -x $base/ringmux && -x $base/ringmux-worker ]] || { echo "bench-tcp.sh: --base $base holds no ringmux and ringmux-worker" >&2; exit 2; }
fi
caddy_protocols="h1 h2"
targets="ringmux-tcp"
((nginx)) && targets="$targets nginx-tcp"
((caddy)) && targets="$targets caddy-tcp"
targets="$targets ringmux-h3"
[[ -n $coding ]] && targets="$targets ringmux-tcp-$coding ringmux-h3-$coding"
[[ -n $base ]] && targets="$targets base-tcp base-h3"
if ((caddy_h3)); then
  # Caddy's HTTP/3 (quic-go) listens on the same port over UDP; default_sni lets a client that
  # names an IP literal (h3-probe, h2load) get the certificate.
  caddy_protocols="h1 h2 h3"
  targets="$targets caddy-h3"
fi
cat >"$work/Caddyfile" <<EOF
{
	admin off
	auto_https disable_redirects
	default_sni 127.0.0.1
	servers {
		protocols $caddy_protocols
	}
}
https://127.0.0.1:$caddy_port {
	tls $work/cert.pem $work/key.pem
	root * $work/root
	file_server
}
EOF

# nginx as Debian builds it (1.22: HTTP/2 over TLS, no QUIC), one worker process per ringmux
# instance.
nginx_conf "$work" "$nginx_port" "$instances" 3072

# box_busy_ns: busy time of every CPU since boot (user, nice, system, irq, softirq, steal), ns.
box_busy_ns() {
  awk -v hz="$(getconf CLK_TCK)" '/^cpu / { printf "%.0f\n", ($2 + $3 + $4 + $7 + $8 + $9) * 1e9 / hz }' /proc/stat
}

# p99_us LOGFILE: the 99th percentile of h2load's per-request times (third column, µs).
p99_us() {
  awk '{ print $3 }' "$1" | sort -n | awk '{ a[NR] = $1 } END { i = int(NR * 0.99); if (i < 1) i = 1; print a[i] }'
}

# run_h2load PORT PATH LOG [H2LOAD-ARG...]: req/s; h2load's user and system CPU seconds in
# LOG.time.
run_h2load() {
  /usr/bin/time -f "%U %S" -o "$3.time" h2load -c "$connections" -m "$streams" -D "$duration" \
    --warm-up-time=1 --log-file="$3" "${@:4}" "https://127.0.0.1:$1$2" 2>&1 |
    awk '/^finished in/ { gsub(",", "", $4); print $4 }'
}

tsv=$out/bench-tcp.tsv
printf 'round\ttarget\tfile\treq_per_s\tp99_us\tserver_us_per_request\tbox_us_per_request\tclient_us_per_request\n' >"$tsv"
echo "== ringmux and its peers over TCP and HTTP/3 [$targets]: $rounds rounds, ${connections}x$streams, ${duration}s; h3-probe args: ${probe_args[*]:-none}; load $(cat /proc/loadavg)"
for round in $(seq 1 "$rounds"); do
  "$bin/ringmux" --listen "127.0.0.1:$rm_port" --instances "$instances" --root "$work/root" \
    --cert "$work/cert.pem" --key "$work/key.pem" --metrics 127.0.0.1:0 \
    --control-socket off >"$work/ringmux.log" 2>&1 &
  rm_pid=$!
  for _ in $(seq 1 100); do grep -q "ringmux ready" "$work/ringmux.log" && break; sleep 0.1; done
  mapfile -t workers < <(pgrep -P "$rm_pid")
  base_workers=()
  if [[ -n $base ]]; then
    "$base/ringmux" --listen "127.0.0.1:$base_port" --instances "$instances" --root "$work/root" \
      --cert "$work/cert.pem" --key "$work/key.pem" --metrics 127.0.0.1:0 \
      --control-socket off >"$work/base.log" 2>&1 &
    base_pid=$!
    for _ in $(seq 1 100); do grep -q "ringmux ready" "$work/base.log" && break; sleep 0.1; done
    mapfile -t base_workers < <(pgrep -P "$base_pid")
  fi
  if ((caddy)); then
    caddy run --config "$work/Caddyfile" --adapter caddyfile >"$work/caddy.log" 2>&1 &
    caddy_pid=$!
    for _ in $(seq 1 100); do curl -sk -o /dev/null "https://127.0.0.1:$caddy_port/small.bin" && break; sleep 0.1; done
  fi
  nginx_pids=()
  if ((nginx)); then
    nginx -p "$work" -c "$work/nginx.conf" -e "$work/nginx-error.log" >"$work/nginx.log" 2>&1 &
    nginx_pid=$!
    for _ in $(seq 1 100); do curl -sk -o /dev/null "https://127.0.0.1:$nginx_port/small.bin" && break; sleep 0.1; done
    mapfile -t nginx_pids < <(pgrep -P "$nginx_pid")
    nginx_pids+=("$nginx_pid")
  fi
  for file in $files; do
    for target in $targets; do
      log=$work/$target-$file-$round.log
      extra=()
      [[ $target == ringmux-*-"$coding" && -n $coding ]] && extra=(-H "accept-encoding: $coding")
      case $target in
        ringmux-tcp) pids=("${workers[@]}"); port=$rm_port ;;
        caddy-tcp) pids=("$caddy_pid"); port=$caddy_port ;;
        nginx-tcp) pids=("${nginx_pids[@]}"); port=$nginx_port ;;
        ringmux-h3 | ringmux-h3-*) pids=("${workers[@]}"); port=$rm_port ;;
        ringmux-tcp-*) pids=("${workers[@]}"); port=$rm_port ;;
        base-tcp | base-h3) pids=("${base_workers[@]}"); port=$base_port ;;
        caddy-h3) pids=("$caddy_pid"); port=$caddy_port ;;
      esac
      c0=$(cpu_ns "${pids[@]}")
      x0=$(box_busy_ns)
      if [[ $target == *-h3 || $target == *-h3-* ]]; then
        "$bin/h3-probe" --url "https://127.0.0.1:$port/$(name_of "$file")" --insecure -c "$connections" \
          -s "$streams" -d "$duration" --warmup 1 --json "$log.json" ${extra[@]+"${extra[@]}"} \
          ${probe_args[@]+"${probe_args[@]}"} >/dev/null 2>&1
        rps=$(jq -r '.requests_per_s' "$log.json")
        p99=$(jq -r '.latency_us.p99' "$log.json")
        n=$(jq -r '.requests' "$log.json")
        client=$(jq -r '.client_cpu_us_per_request // "nan"' "$log.json")
        client=$(awk -v c="$client" 'BEGIN { if (c == "nan") print c; else printf "%.1f", c }')
      else
        rps=$(run_h2load "$port" "/$(name_of "$file")" "$log" ${extra[@]+"${extra[@]}"})
        p99=$(p99_us "$log")
        n=$(wc -l <"$log")
        client=$(awk -v n="$n" -v d="$duration" '{ if (n > 0) printf "%.1f", ($1 + $2) * d / (d + 1) / n * 1e6; else print "nan" }' "$log.time")
      fi
      x1=$(box_busy_ns)
      c1=$(cpu_ns "${pids[@]}")
      per=$(awk -v c=$((c1 - c0)) -v n="$n" 'BEGIN { if (n > 0) printf "%.1f", c / n / 1000; else print "nan" }')
      box=$(awk -v c=$((x1 - x0)) -v n="$n" 'BEGIN { if (n > 0) printf "%.1f", c / n / 1000; else print "nan" }')
      printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$round" "$target" "$file" "$rps" "$p99" "$per" "$box" "$client" >>"$tsv"
      printf 'round %s %-12s %-5s %10s req/s  p99 %8s us  server %6s us/request  box %6s us/request  client %6s us/request\n' "$round" "$target" "$file" "$rps" "$p99" "$per" "$box" "$client"
    done
  done
  for p in $rm_pid $base_pid $caddy_pid $nginx_pid; do
    kill -TERM "$p" 2>/dev/null || true
    wait "$p" 2>/dev/null || true
  done
  rm_pid=""
  base_pid=""
  caddy_pid=""
  nginx_pid=""
done

python3 - "$tsv" <<'PY'
import csv, statistics, sys
rows = list(csv.DictReader(open(sys.argv[1]), delimiter="\t"))
def f(v):
    try:
        return float(v)
    except ValueError:
        return float("nan")
files = [f for f in ("tiny", "small", "big", "page") if any(r["file"] == f for r in rows)]
coded = sorted({r["target"] for r in rows if r["target"].startswith("ringmux-") and r["target"].count("-") == 2})
print("| target | file | req/s | p99 µs | server µs/request | server requests per core-second | box µs/request | client µs/request |")
print("|---|---|---|---|---|---|---|---|")
for file in files:
    for target in ("ringmux-tcp", "base-tcp", "nginx-tcp", "caddy-tcp", "ringmux-h3", "base-h3", "caddy-h3", *coded):
        sel = [r for r in rows if r["target"] == target and r["file"] == file]
        if not sel:
            continue
        cell = lambda k: "%.0f (%.0f–%.0f)" % (statistics.median(f(r[k]) for r in sel), min(f(r[k]) for r in sel), max(f(r[k]) for r in sel))
        cellf = lambda k: "%.1f (%.1f–%.1f)" % (statistics.median(f(r[k]) for r in sel), min(f(r[k]) for r in sel), max(f(r[k]) for r in sel))
        per_core = statistics.median(1e6 / f(r["server_us_per_request"]) for r in sel if f(r["server_us_per_request"]) > 0)
        print(f"| {target} | {file} | {cell('req_per_s')} | {cell('p99_us')} | {cellf('server_us_per_request')} | {per_core:.0f} | {cellf('box_us_per_request')} | {cellf('client_us_per_request')} |")
targets = {r["target"] for r in rows}
def ratios(ours, theirs, file, key):
    out = []
    for rnd in sorted({r["round"] for r in rows}):
        get = lambda t: next(f(r[key]) for r in rows if r["round"] == rnd and r["target"] == t and r["file"] == file)
        out.append(get(ours) / get(theirs) if get(theirs) > 0 else float("nan"))
    return f"median {statistics.median(out):.2f} ({min(out):.2f}–{max(out):.2f})"
for ours, theirs, what in (
    ("ringmux-tcp", "nginx-tcp", "ringmux / nginx over TCP"),
    ("ringmux-tcp", "caddy-tcp", "ringmux / Caddy over TCP"),
    ("ringmux-h3", "caddy-h3", "ringmux / Caddy over HTTP/3"),
    ("ringmux-h3", "ringmux-tcp", "ringmux's HTTP/3 / its HTTP/2"),
    ("ringmux-tcp", "base-tcp", "this build / the base over TCP"),
    ("ringmux-h3", "base-h3", "this build / the base over HTTP/3"),
    *((c, c.rsplit("-", 1)[0], f"ringmux {c.rsplit('-', 1)[1]} / plain over {'HTTP/3' if '-h3-' in c else 'TCP'}") for c in coded),
):
    if theirs not in targets or ours not in targets:
        continue
    for file in files:
        print(f"- {file}: {what}: req/s {ratios(ours, theirs, file, 'req_per_s')}; server CPU per request {ratios(ours, theirs, file, 'server_us_per_request')}")
PY
