#!/usr/bin/env bash
# What sites cost (issue #41): three configurations side by side in one run, rounds interleaved,
# each round one `bench/scripts/bench-ab.sh` run of the shm mode (h3-probe 16 x 8, GET /bytes/1024):
#   old    the previous build (--old DIR), the command line's one site, the built-in /bytes/N
#   new    this build, the same command line
#   files  this build, the command line's site with --root (GET of a 1024-byte file)
#   sites  this build, a configuration file of --sites sites x 3 names (each with its own
#          certificate and the same root), the requests reaching the last site as default_site
#          (h3-probe asks by address: no SNI): a miss in both hash maps, then the default
# "files" against "sites" is the request path's cost of many sites; "old" against "new" the cost
# of the site table for one site. Then the handshake rate: h3-probe opening --handshakes
# connections of one request each, with one certificate and with --certs certificates loaded
# (each its own site), rounds interleaved; reported as connections per second of wall time.
#
# Usage: bench/scripts/bench-sites.sh --old DIR [--rounds N] [--seconds S] [--sites N] [--certs N]
#          [--handshakes N] [--out DIR]
# DIR holds ringmux, ringmux-worker and h3-probe of the build to compare with; this build is
# target/release (built first). Needs openssl (certificates) and jq.
set -euo pipefail
cd "$(dirname "$0")/../.."

old=""
rounds=3
seconds=8
sites=100
certs=1000
handshakes=400
out=""
while (($#)); do
  case $1 in
    --old) old=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --seconds) seconds=$2; shift 2 ;;
    --sites) sites=$2; shift 2 ;;
    --certs) certs=$2; shift 2 ;;
    --handshakes) handshakes=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    -h | --help) sed -n '2,19p' "$0"; exit 0 ;;
    *) echo "bench-sites.sh: unknown argument $1 (try --help)" >&2; exit 2 ;;
  esac
done
[[ -n $old ]] || { echo "bench-sites.sh: --old DIR is required (a copy of the previous build)" >&2; exit 2; }
command -v openssl >/dev/null || { echo "bench-sites.sh: openssl is required" >&2; exit 1; }
out=${out:-bench/results/sites-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$out"
new=target/release
cargo build --release --workspace --bins

work=$(mktemp -d /tmp/ringmux-bench-sites.XXXXXX)
trap 'rm -rf "$work"' EXIT
chmod 755 "$work"
mkdir -p "$work/root/bytes"
head -c 1024 /dev/urandom >"$work/root/bytes/1024"
chmod -R a+rX "$work/root"

# config N FILE: N sites of 3 names each, own certificates, the last one the default.
config() {
  local n=$1 file=$2 i
  mkdir -p "$work/certs"
  : >"$file"
  echo "default_site = \"s$((n - 1)).bench.test\"" >>"$file"
  for ((i = 0; i < n; i++)); do
    if [[ ! -f $work/certs/$i.pem ]]; then
      openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 30 \
        -keyout "$work/certs/$i.key" -out "$work/certs/$i.pem" -subj "/CN=s$i.bench.test" \
        -addext "subjectAltName=DNS:s$i.bench.test,DNS:www.s$i.bench.test,DNS:*.u$i.bench.test" \
        2>/dev/null
    fi
    cat >>"$file" <<EOF
[[site]]
names = ["s$i.bench.test", "www.s$i.bench.test", "*.u$i.bench.test"]
cert = "$work/certs/$i.pem"
key = "$work/certs/$i.key"
[[site.route]]
path = "/"
root = "$work/root"
EOF
  done
  "$new/ringmux" check --config "$file" >/dev/null
}
config "$sites" "$work/sites.toml"

# run NAME BIN [ENV...]: one bench-ab round of the shm mode, its row kept as NAME.
tsv=$out/rounds.tsv
printf 'round\tconfig\treq_per_s\tp50_us\tp99_us\terrors\tworker_us_per_request\tbox_us_per_request\n' >"$tsv"
run() {
  local name=$1 bin=$2 round=$3
  shift 3
  env "$@" bench/scripts/bench-ab.sh --bin "$bin" --modes shm --rounds 1 --seconds "$seconds" \
    --out "$out/$name-$round" >"$out/$name-$round.txt" 2>&1
  awk -F'\t' -v r="$round" -v n="$name" 'NR == 2 { printf "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", r, n, $3, $4, $5, $6, $9, $13 }' \
    "$out/$name-$round/rounds.tsv" >>"$tsv"
  tail -n 1 "$tsv"
}
echo "== request path: old, new, files, sites ($sites sites x 3 names); $rounds rounds of ${seconds}s"
for ((r = 1; r <= rounds; r++)); do
  run old "$old" "$r"
  run new "$new" "$r"
  run files "$new" "$r" RINGMUX_ROOT="$work/root"
  run sites "$new" "$r" RINGMUX_CONFIG="$work/sites.toml"
done

# handshakes CONFIG: connections per second of wall time for --handshakes connections of one
# request each, against a ringmux with that configuration file.
config 1 "$work/one.toml"
config "$certs" "$work/many.toml"
hs=$out/handshakes.tsv
printf 'round\tcerts\tconnections\tseconds\tconnections_per_s\terrors\n' >"$hs"
handshake_round() {
  local round=$1 n=$2 file=$3 log=$out/handshakes-$2-$1
  RUST_LOG=warn setsid "$new/ringmux" --config "$file" --listen 127.0.0.1:0 --metrics off \
    --control-socket off --worker-bin "$new/ringmux-worker" --grace 2 >"$log.out" 2>"$log.err" &
  local pid=$! i ready=""
  for i in $(seq 600); do
    ready=$(grep '^ringmux ready' "$log.out" 2>/dev/null) && break
    kill -0 "$pid" 2>/dev/null || { tail "$log.err" >&2; exit 1; }
    sleep 0.1
  done
  [[ -n $ready ]] || { echo "ringmux not ready" >&2; exit 1; }
  local listen t0 t1
  listen=$(sed -n 's/.* listen=\([^ ]*\).*/\1/p' <<<"$ready")
  t0=$(date +%s.%N)
  setsid --wait "$new/h3-probe" --url "https://$listen/bytes/1024" --connections "$handshakes" \
    --streams 1 --requests "$handshakes" --seconds 60 --insecure --json "$log.json" >"$log.txt" 2>&1 || true
  t1=$(date +%s.%N)
  kill -TERM "$pid"
  wait "$pid" || true
  awk -v r="$round" -v n="$n" -v c="$handshakes" -v a="$t0" -v b="$t1" -v e="$(jq -r '.errors.total // 0' "$log.json")" \
    'BEGIN { printf "%s\t%s\t%s\t%.3f\t%.0f\t%s\n", r, n, c, b - a, c / (b - a), e }' >>"$hs"
  tail -n 1 "$hs"
}
echo "== handshakes: $handshakes connections of one request, 1 and $certs certificates loaded"
for ((r = 1; r <= rounds; r++)); do
  handshake_round "$r" 1 "$work/one.toml"
  handshake_round "$r" "$certs" "$work/many.toml"
done

median() { sort -g | awk '{ v[NR] = $1 } END { m = (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2; printf "%.6g", m }'; }
col() { awk -F'\t' -v n="$1" -v c="$2" 'NR > 1 && $2 == n { print $c }' "$3" | median; }
{
  echo
  echo "Sites, side by side ($rounds rounds interleaved; medians)"
  echo
  echo "| config | req/s | p99 µs | worker µs/request | box µs/request |"
  echo "|---|---|---|---|---|"
  for c in old new files sites; do
    echo "| $c | $(col "$c" 3 "$tsv") | $(col "$c" 5 "$tsv") | $(col "$c" 7 "$tsv") | $(col "$c" 8 "$tsv") |"
  done
  echo
  echo "| certificates loaded | connections/s (one request each) |"
  echo "|---|---|"
  for n in 1 "$certs"; do
    echo "| $n | $(col "$n" 5 "$hs") |"
  done
} | tee "$out/summary.md"
