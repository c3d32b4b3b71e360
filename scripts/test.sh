#!/usr/bin/env bash
# Runs every ringmux test: the workspace under cargo-nextest, then the loom model of the ring.
# On a fresh machine it first installs what the interop tests need (run as root, or have them):
# Debian's ngtcp2-client (gtlsclient), curl, chromium (a browser, run headless), util-linux
# (setpriv), nftables, conntrack and iproute2 (the three-node cluster in network namespaces,
# deploy/cluster.sh), pebble and pebble-challtestsrv (an ACME CA and its DNS, for the
# certificate tests and the cluster's last step), and PyPI's aioquic and niquests (a client
# that follows Alt-Svc from HTTP/2 to HTTP/3).
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v gtlsclient >/dev/null 2>&1 || need_apt+=(ngtcp2-client)
command -v curl >/dev/null 2>&1 || need_apt+=(curl)
command -v chromium >/dev/null 2>&1 || need_apt+=(chromium)
command -v setpriv >/dev/null 2>&1 || need_apt+=(util-linux)
command -v nft >/dev/null 2>&1 || need_apt+=(nftables)
command -v conntrack >/dev/null 2>&1 || need_apt+=(conntrack)
command -v ip >/dev/null 2>&1 || need_apt+=(iproute2)
command -v pebble >/dev/null 2>&1 || need_apt+=(pebble)
# The access log's combined format, read by a tool of its own (sites::serving::rules).
command -v goaccess >/dev/null 2>&1 || need_apt+=(goaccess)
if ((${#need_apt[@]})); then
  echo "== installing ${need_apt[*]} (apt)"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi
if ! python3 -c 'import aioquic' 2>/dev/null; then
  echo "== installing aioquic (pip)"
  python3 -m pip install -q aioquic
fi
if ! python3 -c 'import niquests' 2>/dev/null; then
  echo "== installing niquests (pip)"
  python3 -m pip install -q niquests
fi
# The proxy's WebSocket tests: the echo service and the HTTP/1.1 client (websockets), the
# HTTP/2 extended CONNECT client (h2).
if ! python3 -c 'import websockets, h2' 2>/dev/null; then
  echo "== installing websockets and h2 (pip)"
  python3 -m pip install -q websockets h2
fi
if ! cargo nextest --version >/dev/null 2>&1; then
  echo "== installing cargo-nextest"
  cargo install --locked cargo-nextest
fi

# Tests start the binaries of other packages too (ringmux-worker, h3-probe, the worker examples
# run with --worker-cmd), which a test build of their own package alone would not produce.
echo "== cargo build --workspace --bins --examples"
cargo build --workspace --bins --examples

echo "== cargo nextest run --workspace"
cargo nextest run --workspace --no-fail-fast

echo "== loom model of the ring (RUSTFLAGS=--cfg loom)"
RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom \
  cargo test -p ringmux-ring --test loom --release
