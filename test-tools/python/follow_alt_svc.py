"""Fetches URL four times in one niquests session (a third-party client that follows Alt-Svc:
the first request goes over TCP, HTTP/2; once the response named HTTP/3 in `alt-svc`, the next
ones go over QUIC). Prints one line per request: status, HTTP version (20 or 30), the alt-svc
value or '-'. Certificates are not verified (ringmux's is self-signed in the tests)."""

import sys
import warnings

import niquests

warnings.simplefilter("ignore")

with niquests.Session() as session:
    for _ in range(4):
        r = session.get(sys.argv[1], verify=False, timeout=10)
        print(r.status_code, r.http_version, r.headers.get("alt-svc") or "-", flush=True)
