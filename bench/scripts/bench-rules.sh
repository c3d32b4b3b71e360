#!/usr/bin/env bash
# What a site's rules cost (issue #54, item 6): the same 1 KiB file (/bytes/1024 beneath the
# route's root) from two ringmux servers running side by side, one whose site has nothing
# around its content (plain) and one whose site has ten header rules (six `set`, two `add`,
# two `remove`), `hsts`, a `[site.cors]` table and a `rate` with its `burst` (rules), over
# HTTP/3 (h3-probe) and over TCP (h2load, HTTP/2). Every request of every target carries an
# `origin` the CORS table lists, so the rules server does its CORS work on each request and
# both servers see the same requests. The rate (1 000 000 a second, burst 1 000 000: every
# request comes from 127.0.0.1, one client) is set far above what this box can ask, so the
# limit is looked up and counted on every request but never refuses one: a round with any
# 429 (or any other status than 2xx) is reported as FAILED and the script exits 1.
# A third server (short) has the same rules with one-byte values under three-letter names
# (`hsts = 1`): rules as many, far fewer bytes added to each response, which tells the rules'
# own work from the cost of the bigger responses they make.
#
# Each round starts the servers afresh (2 instances each), then runs plain-h3, rules-h3,
# short-h3, plain-tcp, rules-tcp, short-tcp (even rounds in the reverse order, so a drift in
# load cancels within pairs). Reported per target: the median (min-max) over rounds of req/s,
# p99, the workers' CPU per request and the response's header bytes (HTTP/2, decoded); then
# rules / plain and short / plain within each round, per transport. Before the first round one
# request over TCP checks that the rules server's answer carries the fields (and lacks the
# removed ones) and that the plain server's does not.
#
# Usage: bench/scripts/bench-rules.sh [--rounds N] [--seconds S] [--connections C] [--streams M]
#          [--instances K] [--out DIR] [--no-build]
# Needs h2load (nghttp2-client), curl, openssl and jq.
set -euo pipefail
cd "$(dirname "$0")/../.."
# shellcheck source=bench/scripts/common.sh
. bench/scripts/common.sh

rounds=5
duration=8
connections=16
streams=8
instances=2
out=""
build=1
while (($#)); do
  case $1 in
    --rounds) rounds=$2; shift 2 ;;
    --seconds) duration=$2; shift 2 ;;
    --connections) connections=$2; shift 2 ;;
    --streams) streams=$2; shift 2 ;;
    --instances) instances=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --no-build) build=0; shift ;;
    -h | --help) sed -n '2,23p' "$0"; exit 0 ;;
    *) echo "bench-rules.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
for tool in h2load curl openssl jq; do
  command -v "$tool" >/dev/null || { echo "bench-rules.sh: $tool is required (apt-get install nghttp2-client curl openssl jq)" >&2; exit 1; }
done
if ((build)); then
  cargo build --release -p ringmux-demux -p ringmux-server -p ringmux-bench --bins
fi
bin=target/release
work=$(mktemp -d /tmp/ringmux-bench-rules.XXXXXX)
out=${out:-$work}
mkdir -p "$out" "$work/root/bytes"
chmod 755 "$work" "$work/root" "$work/root/bytes"
pids=()
cleanup() {
  stop
  rm -rf "$work/root"
}
trap cleanup EXIT
head -c 1024 /dev/urandom >"$work/root/bytes/1024"
chmod 644 "$work/root/bytes/1024"
self_signed "$work"
origin=https://app.bench.test

# config NAME PORT RULES: WORK/NAME.toml, one site (the default, so that clients asking by
# address reach it) serving WORK/root on 127.0.0.1:PORT, with RULES in its [[site]] table.
config() {
  cat >"$work/$1.toml" <<EOF
listen = "127.0.0.1:$2"
instances = $instances
default_site = "localhost"

[[site]]
names = ["localhost"]
cert = "$work/cert.pem"
key = "$work/key.pem"
$3
  [[site.route]]
  path = "/"
  root = "$work/root"
EOF
  "$bin/ringmux" check --config "$work/$1.toml" >/dev/null
}
plain_port=4450
rules_port=4451
config plain "$plain_port" ""
# The rate limit and the CORS table of both rules servers.
rate='rate = "1000000/s"
burst = 1000000'
cors="  [site.cors]
  origins = [\"$origin\"]
  methods = [\"GET\", \"POST\"]
  headers = [\"content-type\"]
  credentials = false
  max_age = 600"
# Ten header rules: six set, two added, two removed.
config rules "$rules_port" "hsts = { max_age = 31536000, include_subdomains = true }
$rate
  [site.headers]
  set = { \"x-frame-options\" = \"DENY\", \"content-security-policy\" = \"default-src 'self'\", \"x-content-type-options\" = \"nosniff\", \"referrer-policy\" = \"strict-origin-when-cross-origin\", \"permissions-policy\" = \"geolocation=()\", \"cross-origin-opener-policy\" = \"same-origin\" }
  add = { \"link\" = \"</a.css>; rel=preload\", \"x-served-by\" = \"bench\" }
  remove = [\"last-modified\", \"accept-ranges\"]
$cors"
config short 4452 "hsts = 1
$rate
  [site.headers]
  set = { \"x-a\" = \"1\", \"x-b\" = \"1\", \"x-c\" = \"1\", \"x-d\" = \"1\", \"x-e\" = \"1\", \"x-f\" = \"1\" }
  add = { \"x-g\" = \"1\", \"x-h\" = \"1\" }
  remove = [\"last-modified\", \"accept-ranges\"]
$cors"

# start NAME: starts the NAME server; sets NAME_pid and NAME_workers.
start() {
  RUST_LOG=warn "$bin/ringmux" --config "$work/$1.toml" --metrics off --control-socket off \
    --worker-bin "$bin/ringmux-worker" --grace 2 >"$work/$1.out" 2>"$work/$1.err" &
  local pid=$!
  pids+=("$pid")
  for _ in $(seq 300); do
    grep -q '^ringmux ready' "$work/$1.out" 2>/dev/null && break
    kill -0 "$pid" 2>/dev/null || { echo "bench-rules.sh: ringmux ($1) ended:" >&2; tail "$work/$1.err" >&2; exit 1; }
    sleep 0.1
  done
  grep -q '^ringmux ready' "$work/$1.out" || { echo "bench-rules.sh: ringmux ($1) not ready" >&2; exit 1; }
  printf -v "$1_pid" '%s' "$pid"
  local found=()
  for _ in $(seq 100); do
    mapfile -t found < <(pgrep -P "$pid")
    ((${#found[@]} >= instances)) && break
    sleep 0.1
  done
  ((${#found[@]} >= instances)) || { echo "bench-rules.sh: ringmux ($1) has ${#found[@]} workers, not $instances" >&2; exit 1; }
  mapfile -t "$1_workers" < <(printf '%s\n' "${found[@]}")
}

# stop: stops every server started.
stop() {
  local p
  for p in "${pids[@]}"; do
    kill -TERM "$p" 2>/dev/null || true
    wait "$p" 2>/dev/null || true
  done
  pids=()
}

# The rules are in force on the rules server only.
check_fields() {
  local head
  head=$(curl -sk --http2 -D - -o /dev/null -H "origin: $origin" "https://127.0.0.1:$2/bytes/1024")
  local want=$1 field
  for field in x-frame-options content-security-policy x-content-type-options referrer-policy \
    permissions-policy cross-origin-opener-policy link x-served-by strict-transport-security \
    access-control-allow-origin; do
    if grep -qi "^$field:" <<<"$head"; then
      ((want)) || { echo "bench-rules.sh: the plain server sent $field" >&2; exit 1; }
    else
      ((!want)) || { echo "bench-rules.sh: the rules server sent no $field" >&2; exit 1; }
    fi
  done
  for field in last-modified accept-ranges; do
    if grep -qi "^$field:" <<<"$head"; then
      ((!want)) || { echo "bench-rules.sh: the rules server sent $field, which it removes" >&2; exit 1; }
    fi
  done
}
short_port=4452
start plain
start rules
start short
check_fields 0 "$plain_port"
check_fields 1 "$rules_port"
# Each server's response header bytes (HTTP/2, decoded), for the summary.
for name in plain rules short; do
  port_var=${name}_port
  curl -sk --http2 -o /dev/null -w '%{size_header}\n' -H "origin: $origin" "https://127.0.0.1:${!port_var}/bytes/1024" >"$work/$name.header-bytes"
done
stop

tsv=$out/bench-rules.tsv
printf 'round\ttarget\treq_per_s\tp99_us\tworker_us_per_request\trefused\tother_errors\n' >"$tsv"
targets="plain-h3 rules-h3 short-h3 plain-tcp rules-tcp short-tcp"
# shellcheck disable=SC2086 # one word per target
reversed=$(printf '%s\n' $targets | tac | xargs)
failed=0
echo "== rules against none [$targets]: $rounds rounds, ${connections}x$streams, ${duration}s; load $(cat /proc/loadavg)"
for round in $(seq 1 "$rounds"); do
  start plain
  start rules
  start short
  order=$targets
  ((round % 2 == 0)) && order=$reversed
  for target in $order; do
    log=$work/$target-$round
    case $target in
      plain-*) port=$plain_port workers=("${plain_workers[@]}") ;;
      rules-*) port=$rules_port workers=("${rules_workers[@]}") ;;
      short-*) port=$short_port workers=("${short_workers[@]}") ;;
    esac
    c0=$(cpu_ns "${workers[@]}")
    if [[ $target == *-h3 ]]; then
      "$bin/h3-probe" --url "https://127.0.0.1:$port/bytes/1024" --insecure -c "$connections" \
        -s "$streams" -d "$duration" --warmup 1 --expect-len 1024 -H "origin: $origin" \
        --json "$log.json" >"$log.txt" 2>&1 || true
      c1=$(cpu_ns "${workers[@]}")
      rps=$(jq -r '.requests_per_s' "$log.json")
      p99=$(jq -r '.latency_us.p99' "$log.json")
      n=$(jq -r '.requests' "$log.json")
      refused=$(jq -r '.errors.status_429 // 0' "$log.json")
      other=$(jq -r '(.errors.total // 0) - (.errors.status_429 // 0)' "$log.json")
      # The CPU reading includes the warm-up second, whose requests the probe does not count.
      n_cpu=$(awk -v n="$n" -v d="$duration" 'BEGIN { printf "%.0f", n * (d + 1) / d }')
    else
      h2load -c "$connections" -m "$streams" -D "$duration" --warm-up-time=1 \
        -H "origin: $origin" --log-file="$log.log" "https://127.0.0.1:$port/bytes/1024" >"$log.txt" 2>&1 || true
      c1=$(cpu_ns "${workers[@]}")
      rps=$(awk '/^finished in/ { gsub(",", "", $4); print $4 }' "$log.txt")
      p99=$(awk '{ print $3 }' "$log.log" | sort -n | awk '{ a[NR] = $1 } END { i = int(NR * 0.99); if (i < 1) i = 1; print a[i] }')
      n=$(wc -l <"$log.log")
      # h2load's log lists each request with its status (second column; 0 for the few still
      # in flight when the run ends, which are no error).
      refused=$(awk '$2 == 429' "$log.log" | wc -l)
      other=$(awk '$2 != 0 && $2 != 429 && ($2 < 200 || $2 > 299)' "$log.log" | wc -l)
      other=$((other + $(awk '/^requests:/ { print $12 + $14 }' "$log.txt")))
      n_cpu=$(awk -v n="$n" -v d="$duration" 'BEGIN { printf "%.0f", n * (d + 1) / d }')
    fi
    per=$(awk -v c=$((c1 - c0)) -v n="$n_cpu" 'BEGIN { if (n > 0) printf "%.2f", c / n / 1000; else print "nan" }')
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$round" "$target" "$rps" "$p99" "$per" "$refused" "$other" >>"$tsv"
    printf 'round %s %-9s %10s req/s  p99 %7s us  workers %6s us/request  429s %s  other errors %s\n' \
      "$round" "$target" "$rps" "$p99" "$per" "$refused" "$other"
    if ((refused > 0 || other > 0)); then
      echo "round $round $target FAILED: $refused requests refused with 429, $other other errors"
      failed=1
    fi
  done
  stop
done

python3 - "$tsv" "$work" <<'PY' | tee "$out/summary.md"
import csv, statistics, sys
rows = list(csv.DictReader(open(sys.argv[1]), delimiter="\t"))
def f(v):
    try:
        return float(v)
    except ValueError:
        return float("nan")
def cell(vals, fmt):
    return (fmt + " (" + fmt + "–" + fmt + ")") % (statistics.median(vals), min(vals), max(vals))
heads = {n: open(f"{sys.argv[2]}/{n}.header-bytes").read().strip() for n in ("plain", "rules", "short")}
print("| target | response header bytes | req/s | p99 µs | workers' µs/request | 429s |")
print("|---|---|---|---|---|---|")
for t in ("plain-h3", "rules-h3", "short-h3", "plain-tcp", "rules-tcp", "short-tcp"):
    sel = [r for r in rows if r["target"] == t]
    print(f"| {t} | {heads[t.split('-')[0]]} | {cell([f(r['req_per_s']) for r in sel], '%.0f')} | {cell([f(r['p99_us']) for r in sel], '%.0f')} "
          f"| {cell([f(r['worker_us_per_request']) for r in sel], '%.2f')} | {sum(int(r['refused']) for r in sel)} |")
print()
for transport, what in (("h3", "HTTP/3"), ("tcp", "TCP (HTTP/2)")):
    for config in ("rules", "short"):
        out = {}
        for key in ("req_per_s", "p99_us", "worker_us_per_request"):
            vals = []
            for rnd in sorted({r["round"] for r in rows}, key=int):
                get = lambda t: next(f(r[key]) for r in rows if r["round"] == rnd and r["target"] == t)
                vals.append(get(f"{config}-{transport}") / get(f"plain-{transport}"))
            out[key] = cell(vals, "%.3f")
        print(f"- {what}, {config} / plain within rounds: req/s {out['req_per_s']}, p99 {out['p99_us']}, "
              f"workers' CPU per request {out['worker_us_per_request']}")
PY
if ((failed)); then
  echo "bench-rules.sh: some rounds FAILED (429s or errors): see above" >&2
  exit 1
fi
