#!/usr/bin/env python3
"""A flood of new QUIC connections: real QUIC v1 Initials (aioquic ClientHellos, each with its
own random DCID, padded to 1200 bytes as clients do), sent at a fixed rate from many source
ports, never followed up (no Retry, no handshake). For ringmux's admission tests and
bench/scripts/bench-flood.sh.

    initial-flood.py HOST PORT --count N [--unique K] [--rate R] [--ports P] [--source IP]
                     [--cache FILE]

--rate 0 sends as fast as it can. --unique K makes K distinct Initials and sends them in turn
(default: every one distinct). --cache keeps the generated Initials in FILE (made if
missing), since making one costs aioquic a TLS ClientHello (about 0.3 ms). Prints one JSON
line: {"sent": N, "seconds": S, "rate": R, "errors": E}.
"""

import argparse
import json
import os
import socket
import ssl
import struct
import sys
import time

from aioquic.h3.connection import H3_ALPN
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection


def make_initials(count, host, port):
    out = []
    for _ in range(count):
        cfg = QuicConfiguration(is_client=True, alpn_protocols=H3_ALPN)
        cfg.verify_mode = ssl.CERT_NONE
        cfg.server_name = "localhost"
        conn = QuicConnection(configuration=cfg)
        conn.connect((host, port), now=time.monotonic())
        datagrams = conn.datagrams_to_send(now=time.monotonic())
        out.append(datagrams[0][0])
    return out


def load(args):
    if args.cache and os.path.exists(args.cache):
        data = open(args.cache, "rb").read()
        initials, at = [], 0
        while at + 2 <= len(data) and len(initials) < args.unique:
            (n,) = struct.unpack_from("!H", data, at)
            initials.append(data[at + 2 : at + 2 + n])
            at += 2 + n
        if len(initials) >= args.unique:
            return initials
    initials = make_initials(args.unique, args.host, args.port)
    if args.cache:
        with open(args.cache, "wb") as f:
            for p in initials:
                f.write(struct.pack("!H", len(p)) + p)
    return initials


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("host")
    ap.add_argument("port", type=int)
    ap.add_argument("--count", type=int, required=True, help="Initials to send")
    ap.add_argument("--unique", type=int, help="distinct Initials to make (default: --count)")
    ap.add_argument("--rate", type=float, default=0, help="Initials per second (0: at once)")
    ap.add_argument("--ports", type=int, default=256, help="source ports to spread over")
    ap.add_argument("--source", default="127.0.0.1", help="source address")
    ap.add_argument("--cache", help="file that keeps the generated Initials")
    args = ap.parse_args()
    args.unique = min(args.unique or args.count, args.count)
    if args.count < 1 or args.unique < 1 or args.ports < 1 or args.rate < 0:
        sys.exit("initial-flood: --count, --unique and --ports must be at least 1, --rate at least 0")
    initials = load(args)
    socks = []
    for _ in range(args.ports):
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.bind((args.source, 0))
        s.setblocking(False)
        socks.append(s)
    dest = (args.host, args.port)
    sent = errors = 0
    start = time.monotonic()
    for i in range(args.count):
        p = initials[i % len(initials)]
        if args.rate > 0:
            due = start + i / args.rate
            delay = due - time.monotonic()
            if delay > 0.001:
                time.sleep(delay)
        try:
            socks[i % len(socks)].sendto(p, dest)
            sent += 1
        except OSError:
            errors += 1
    seconds = time.monotonic() - start
    print(json.dumps({"sent": sent, "seconds": round(seconds, 3),
                      "rate": round(sent / max(seconds, 1e-9)), "errors": errors}))


if __name__ == "__main__":
    main()
