# shellcheck shell=bash
# What the benchmark scripts share; each sources it (`. bench/scripts/common.sh` from the
# repository's root).

# cpu_ns PID...: on-CPU ns of every thread of the processes (/proc/PID/task/*/schedstat).
cpu_ns() {
  local s=0 p t v
  for p in "$@"; do
    for t in /proc/"$p"/task/*/schedstat; do
      read -r v _ <"$t" 2>/dev/null || continue
      s=$((s + v))
    done
  done
  echo "$s"
}

# self_signed DIR: DIR/cert.pem and DIR/key.pem, a P-256 certificate for 127.0.0.1 and
# localhost, readable by the workers' user.
self_signed() {
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 2 \
    -subj /CN=127.0.0.1 -addext subjectAltName=IP:127.0.0.1,DNS:localhost \
    -keyout "$1/key.pem" -out "$1/cert.pem" 2>/dev/null
  chmod 644 "$1/key.pem" "$1/cert.pem"
}

# nginx_conf WORK PORT WORKERS CONNECTIONS: WORK/nginx.conf, Debian's nginx set up as a
# benchmark would be: WORKERS worker processes, room for CONNECTIONS connections, sendfile, no
# access log, HTTP/2 over TLS 1.3 only (as ringmux) on 127.0.0.1:PORT with WORK/cert.pem,
# serving WORK/root; keep-alive long enough for a whole run.
nginx_conf() {
  local work=$1 port=$2 workers=$3 connections=$4
  mkdir -p "$work/nginx"
  cat >"$work/nginx.conf" <<CONF
worker_processes $workers;
worker_rlimit_nofile $((connections * 2 + 1024));
daemon off;
pid $work/nginx.pid;
error_log $work/nginx-error.log warn;
events {
	worker_connections $((connections + 1024));
}
http {
	access_log off;
	default_type application/octet-stream;
	sendfile on;
	tcp_nopush on;
	keepalive_requests 1000000;
	client_body_temp_path $work/nginx/body;
	proxy_temp_path $work/nginx/proxy;
	fastcgi_temp_path $work/nginx/fastcgi;
	uwsgi_temp_path $work/nginx/uwsgi;
	scgi_temp_path $work/nginx/scgi;
	server {
		listen 127.0.0.1:$port ssl http2;
		ssl_certificate $work/cert.pem;
		ssl_certificate_key $work/key.pem;
		ssl_protocols TLSv1.3;
		root $work/root;
	}
}
CONF
}

# html_page FILE: a 16 KiB HTML page of words (the same every time), a compressible body.
html_page() {
  python3 - "$1" <<'PY'
import random, sys
rng = random.Random(7)
words = ["ringmux", "quic", "worker", "datagram", "stream", "server", "header", "the", "of", "and",
         "request", "response", "a", "to", "connection", "reload", "site", "route", "file", "proxy"]
out = ["<!doctype html><html><head><title>page</title></head><body>"]
size = len(out[0])
while size < 16 * 1024 - 32:
    p = "<p>" + " ".join(rng.choice(words) for _ in range(rng.randint(8, 30))) + ".</p>\n"
    out.append(p)
    size += len(p)
out.append("</body></html>\n")
open(sys.argv[1], "w").write("".join(out))
PY
}
