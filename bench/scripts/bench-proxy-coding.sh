#!/usr/bin/env bash
# Compression on the fly through the proxy (issue #54, item 6): ringmux's reverse proxy
# (`--upstream`) beside Caddy's `reverse_proxy` with `encode`, both in front of the same backend
# (Debian's nginx over HTTP/1.1 on loopback, one worker process, serving a 16 KiB HTML page of
# words, uncompressed), the same client and the same requests, each asking for one coding with
# `accept-encoding`. For each round, in turn (even rounds in the reverse order, so that a drift
# in load cancels within pairs), every (server, transport, coding): ringmux over HTTP/3
# (h3-probe) and TCP (h2load, HTTP/2), Caddy the same; codings identity (none asked), br, zstd
# and gzip for ringmux, identity, zstd and gzip for Caddy (Debian's Caddy 2.6 has no brotli
# encoder: asked for br alone it answers identity, so that pair is left out). Both servers
# use their own default level (ringmux: its on-the-fly level; Caddy: zstd's default and gzip
# 5). Reports per target the median (min-max) over rounds of req/s, p99, the server's CPU per
# request (ringmux: its workers; Caddy: its process) and the backend's, and the body's size
# in each coding (one request with curl before the rounds, which also checks that each server
# answers each coding with that `content-encoding`); then ringmux / Caddy within each round per
# transport and coding, and each server's coded / identity.
#
# Usage: bench/scripts/bench-proxy-coding.sh [--rounds N] [--seconds S] [--connections C]
#          [--streams M] [--instances K] [--transports "h3 tcp"] [--codings "identity br zstd gzip"]
#          [--out DIR] [--no-build]
# Needs h2load (nghttp2-client), caddy, nginx, curl (with brotli and zstd), openssl and jq.
set -euo pipefail
cd "$(dirname "$0")/../.."
# shellcheck source=bench/scripts/common.sh
. bench/scripts/common.sh

rounds=5
duration=5
connections=16
streams=8
instances=2
transports="h3 tcp"
codings="identity br zstd gzip"
out=""
build=1
while (($#)); do
  case $1 in
    --rounds) rounds=$2; shift 2 ;;
    --seconds) duration=$2; shift 2 ;;
    --connections) connections=$2; shift 2 ;;
    --streams) streams=$2; shift 2 ;;
    --instances) instances=$2; shift 2 ;;
    --transports) transports=$2; shift 2 ;;
    --codings) codings=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --no-build) build=0; shift ;;
    -h | --help) sed -n '2,21p' "$0"; exit 0 ;;
    *) echo "bench-proxy-coding.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
for tool in h2load caddy nginx curl openssl jq; do
  command -v "$tool" >/dev/null || { echo "bench-proxy-coding.sh: $tool is required (apt-get install nghttp2-client caddy nginx curl openssl jq)" >&2; exit 1; }
done
for t in $transports; do
  [[ $t == h3 || $t == tcp ]] || { echo "bench-proxy-coding.sh: --transports takes h3 and tcp, not $t" >&2; exit 2; }
done
for c in $codings; do
  [[ $c == identity || $c == br || $c == zstd || $c == gzip ]] || { echo "bench-proxy-coding.sh: --codings takes identity, br, zstd and gzip, not $c" >&2; exit 2; }
done
if ((build)); then
  cargo build --release -p ringmux-demux -p ringmux-server -p ringmux-bench --bins
fi
bin=target/release
work=$(mktemp -d /tmp/ringmux-bench-proxy-coding.XXXXXX)
out=${out:-$work}
mkdir -p "$out" "$work/root" "$work/nginx"
chmod 755 "$work" "$work/root"
pids=()
stop() {
  local p
  for p in "${pids[@]}"; do
    kill -TERM "$p" 2>/dev/null || true
    wait "$p" 2>/dev/null || true
  done
  pids=()
}
trap 'stop; rm -rf "$work/root"' EXIT
html_page "$work/root/page.html"
chmod 644 "$work/root/page.html"
page_len=$(stat -c %s "$work/root/page.html")
self_signed "$work"

backend_port=4460
rm_port=4461
caddy_port=4462
# The backend: nginx, HTTP/1.1 in the clear, no compression of its own (gzip is off by default).
cat >"$work/nginx.conf" <<CONF
worker_processes 1;
daemon off;
pid $work/nginx.pid;
error_log $work/nginx-error.log warn;
events {
	worker_connections 4096;
}
http {
	access_log off;
	include /etc/nginx/mime.types;
	default_type application/octet-stream;
	keepalive_requests 1000000;
	client_body_temp_path $work/nginx/body;
	proxy_temp_path $work/nginx/proxy;
	fastcgi_temp_path $work/nginx/fastcgi;
	uwsgi_temp_path $work/nginx/uwsgi;
	scgi_temp_path $work/nginx/scgi;
	server {
		listen 127.0.0.1:$backend_port;
		root $work/root;
	}
}
CONF
cat >"$work/Caddyfile" <<EOF
{
	admin off
	auto_https disable_redirects
	default_sni 127.0.0.1
	servers {
		protocols h1 h2 h3
	}
}
https://127.0.0.1:$caddy_port {
	tls $work/cert.pem $work/key.pem
	encode zstd gzip
	reverse_proxy 127.0.0.1:$backend_port
}
EOF

# up URL LOG PID: waits until URL answers (or the process PID ends).
up() {
  for _ in $(seq 300); do
    curl -sk -o /dev/null "$1" && return 0
    kill -0 "$3" 2>/dev/null || { echo "bench-proxy-coding.sh: the server ended:" >&2; tail "$2" >&2; exit 1; }
    sleep 0.1
  done
  echo "bench-proxy-coding.sh: $1 does not answer" >&2
  exit 1
}

# start: the backend, ringmux and Caddy; sets backend_pids, rm_workers and caddy_pid.
start() {
  nginx -p "$work" -c "$work/nginx.conf" -e "$work/nginx-error.log" >"$work/nginx.log" 2>&1 &
  local backend=$!
  pids+=("$backend")
  up "http://127.0.0.1:$backend_port/page.html" "$work/nginx-error.log" "$backend"
  mapfile -t backend_pids < <(pgrep -P "$backend")
  backend_pids+=("$backend")
  RUST_LOG=warn "$bin/ringmux" --listen "127.0.0.1:$rm_port" --instances "$instances" \
    --cert "$work/cert.pem" --key "$work/key.pem" --upstream "http://127.0.0.1:$backend_port" \
    --metrics off --control-socket off --worker-bin "$bin/ringmux-worker" --grace 2 \
    >"$work/ringmux.out" 2>"$work/ringmux.err" &
  local rm=$!
  pids+=("$rm")
  up "https://127.0.0.1:$rm_port/page.html" "$work/ringmux.err" "$rm"
  mapfile -t rm_workers < <(pgrep -P "$rm")
  caddy run --config "$work/Caddyfile" --adapter caddyfile >"$work/caddy.log" 2>&1 &
  caddy_pid=$!
  pids+=("$caddy_pid")
  up "https://127.0.0.1:$caddy_port/page.html" "$work/caddy.log" "$caddy_pid"
}

# The targets: server-transport-coding, Caddy without br.
targets=""
for t in $transports; do
  for c in $codings; do
    targets="$targets ringmux-$t-$c"
    [[ $c == br ]] || targets="$targets caddy-$t-$c"
  done
done
# shellcheck disable=SC2086 # one word per target
reversed=$(printf '%s\n' $targets | tac | xargs)

# Each server's body in each coding: its size, and that it is that coding.
start
sizes=$out/sizes.tsv
printf 'server\tcoding\tbytes\n' >"$sizes"
for server in ringmux caddy; do
  port=$rm_port
  [[ $server == caddy ]] && port=$caddy_port
  for c in $codings; do
    [[ $server == caddy && $c == br ]] && continue
    hdr=()
    [[ $c == identity ]] || hdr=(-H "accept-encoding: $c")
    head=$(curl -sk --http2 ${hdr[@]+"${hdr[@]}"} -D - -o "$work/body" "https://127.0.0.1:$port/page.html")
    got=$(awk 'tolower($1) == "content-encoding:" { gsub("\r", "", $2); print $2 }' <<<"$head")
    want=$c
    [[ $c == identity ]] && want=""
    [[ $got == "$want" ]] || { echo "bench-proxy-coding.sh: $server answered accept-encoding $c with content-encoding '${got}'" >&2; exit 1; }
    printf '%s\t%s\t%s\n' "$server" "$c" "$(stat -c %s "$work/body")" >>"$sizes"
  done
done
stop

tsv=$out/bench-proxy-coding.tsv
printf 'round\ttarget\treq_per_s\tp99_us\tserver_us_per_request\tbackend_us_per_request\terrors\n' >"$tsv"
echo "== proxy coding, ringmux and Caddy in front of nginx [$targets ]: $rounds rounds, ${connections}x$streams, ${duration}s, a $page_len-byte page; load $(cat /proc/loadavg)"
for round in $(seq 1 "$rounds"); do
  start
  order=$targets
  ((round % 2 == 0)) && order=$reversed
  for target in $order; do
    IFS=- read -r server transport coding <<<"$target"
    if [[ $server == ringmux ]]; then port=$rm_port server_pids=("${rm_workers[@]}"); else port=$caddy_port server_pids=("$caddy_pid"); fi
    hdr=()
    [[ $coding == identity ]] || hdr=(-H "accept-encoding: $coding")
    log=$work/$target-$round
    s0=$(cpu_ns "${server_pids[@]}")
    b0=$(cpu_ns "${backend_pids[@]}")
    if [[ $transport == h3 ]]; then
      expect=()
      [[ $coding == identity ]] && expect=(--expect-len "$page_len")
      "$bin/h3-probe" --url "https://127.0.0.1:$port/page.html" --insecure -c "$connections" -s "$streams" \
        -d "$duration" --warmup 1 ${hdr[@]+"${hdr[@]}"} ${expect[@]+"${expect[@]}"} --json "$log.json" >"$log.txt" 2>&1 || true
      rps=$(jq -r '.requests_per_s' "$log.json")
      p99=$(jq -r '.latency_us.p99' "$log.json")
      n=$(jq -r '.requests' "$log.json")
      errors=$(jq -r '.errors.total // 0' "$log.json")
    else
      h2load -c "$connections" -m "$streams" -D "$duration" --warm-up-time=1 ${hdr[@]+"${hdr[@]}"} \
        --log-file="$log.log" "https://127.0.0.1:$port/page.html" >"$log.txt" 2>&1 || true
      rps=$(awk '/^finished in/ { gsub(",", "", $4); print $4 }' "$log.txt")
      p99=$(awk '{ print $3 }' "$log.log" | sort -n | awk '{ a[NR] = $1 } END { i = int(NR * 0.99); if (i < 1) i = 1; print a[i] }')
      n=$(wc -l <"$log.log")
      # h2load's log lists each request with its status (0 for those still in flight when the
      # run ends, which are no error); failures without a status are in its summary.
      errors=$(awk '$2 != 0 && ($2 < 200 || $2 > 299)' "$log.log" | wc -l)
      errors=$((errors + $(awk '/^requests:/ { print $12 + $14 }' "$log.txt")))
    fi
    s1=$(cpu_ns "${server_pids[@]}")
    b1=$(cpu_ns "${backend_pids[@]}")
    # The CPU readings include the warm-up second, whose requests neither client counts.
    per() { awk -v c="$1" -v n="$n" -v d="$duration" 'BEGIN { if (n > 0) printf "%.2f", c / (n * (d + 1) / d) / 1000; else print "nan" }'; }
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$round" "$target" "$rps" "$p99" "$(per $((s1 - s0)))" "$(per $((b1 - b0)))" "$errors" >>"$tsv"
    printf 'round %s %-22s %9s req/s  p99 %7s us  server %7s us/request  backend %6s us/request  errors %s\n' \
      "$round" "$target" "$rps" "$p99" "$(per $((s1 - s0)))" "$(per $((b1 - b0)))" "$errors"
  done
  stop
done

python3 - "$tsv" "$sizes" <<'PY' | tee "$out/summary.md"
import csv, statistics, sys
rows = list(csv.DictReader(open(sys.argv[1]), delimiter="\t"))
sizes = {(r["server"], r["coding"]): r["bytes"] for r in csv.DictReader(open(sys.argv[2]), delimiter="\t")}
def f(v):
    try:
        return float(v)
    except ValueError:
        return float("nan")
def cell(vals, fmt):
    return (fmt + " (" + fmt + "–" + fmt + ")") % (statistics.median(vals), min(vals), max(vals))
targets = list(dict.fromkeys(r["target"] for r in rows if r["round"] == "1"))
print("| target | body bytes | req/s | p99 µs | server µs/request | backend µs/request | errors |")
print("|---|---|---|---|---|---|---|")
for t in targets:
    sel = [r for r in rows if r["target"] == t]
    server, _, coding = t.split("-")
    print(f"| {t} | {sizes.get((server, coding), '?')} | {cell([f(r['req_per_s']) for r in sel], '%.0f')} "
          f"| {cell([f(r['p99_us']) for r in sel], '%.0f')} | {cell([f(r['server_us_per_request']) for r in sel], '%.1f')} "
          f"| {cell([f(r['backend_us_per_request']) for r in sel], '%.1f')} | {sum(int(f(r['errors'])) for r in sel)} |")
print()
def ratio(a, b, key):
    vals = []
    for rnd in sorted({r["round"] for r in rows}, key=int):
        get = lambda t: next((f(r[key]) for r in rows if r["round"] == rnd and r["target"] == t), float("nan"))
        if get(b) > 0:
            vals.append(get(a) / get(b))
    return cell(vals, "%.2f") if vals else "—"
names = {t.split("-", 1)[1] for t in targets}
for rest in sorted(names):
    if f"ringmux-{rest}" in targets and f"caddy-{rest}" in targets:
        print(f"- {rest}: ringmux / Caddy within rounds: req/s {ratio(f'ringmux-{rest}', f'caddy-{rest}', 'req_per_s')}, "
              f"server CPU per request {ratio(f'ringmux-{rest}', f'caddy-{rest}', 'server_us_per_request')}")
for t in targets:
    server, transport, coding = t.split("-")
    plain = f"{server}-{transport}-identity"
    if coding != "identity" and plain in targets:
        print(f"- {t} / identity within rounds: req/s {ratio(t, plain, 'req_per_s')}, "
              f"server CPU per request {ratio(t, plain, 'server_us_per_request')}")
PY
