#!/usr/bin/env python3
"""An HTTP/1.1 service on Python's http.server, to put behind `ringmux --upstream` in tests.

    http1_upstream.py [PORT]

Listens on 127.0.0.1:PORT (0 or absent: any free port) and prints "listening PORT" on stdout
once it accepts connections. Runs until killed. Paths (the same as ringmux_testkit::upstream):

    GET /hello             "hello from upstream (python)\n"
    GET /bytes/N           N bytes, byte i = i % 251, with content-length
    GET /headers           "METHOD PATH\n" then "name: value\n" per request header
    GET /text/N[?ce=C][&cc=V]  N bytes of text/html, "<p>line I of the upstream's text</p>\n"
                           for I = 0, 1, ... cut at N; with content-encoding: C and
                           cache-control: V when given (the body stays that text)
    POST|PUT /sha256       "METHOD LEN SHA256HEX\n" of the request body (content-length or chunked)
"""

import hashlib
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

CHUNK = 64 * 1024
PATTERN = bytes(i % 251 for i in range(251 * 261))  # 65511 bytes, a whole number of periods


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):
        pass

    def reply(self, status, body, ctype="text/plain"):
        self.send_response(status)
        self.send_header("content-type", ctype)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def do_HEAD(self):
        self.do_GET()

    def do_GET(self):
        if self.path == "/hello":
            return self.reply(200, b"hello from upstream (python)\n")
        if self.path == "/headers":
            lines = [f"{self.command} {self.path}"]
            lines += [f"{k.lower()}: {v}" for k, v in self.headers.items()]
            return self.reply(200, ("\n".join(lines) + "\n").encode())
        if self.path.startswith("/text/"):
            return self.text()
        if self.path.startswith("/bytes/"):
            try:
                n = int(self.path[len("/bytes/"):])
            except ValueError:
                return self.reply(400, b"bad length\n")
            self.send_response(200)
            self.send_header("content-type", "application/octet-stream")
            self.send_header("content-length", str(n))
            self.end_headers()
            if self.command == "HEAD":
                return
            sent = 0
            while sent < n:
                start = sent % 251
                k = min(n - sent, len(PATTERN) - start)
                self.wfile.write(PATTERN[start:start + k])
                sent += k
            return
        self.reply(404, b"not found\n")

    def text(self):
        path, _, query = self.path.partition("?")
        params = dict(p.split("=", 1) for p in query.split("&") if "=" in p)
        try:
            n = int(path[len("/text/"):])
        except ValueError:
            return self.reply(400, b"bad length\n")
        body = bytearray()
        i = 0
        while len(body) < n:
            body += b"<p>line %d of the upstream's text</p>\n" % i
            i += 1
        body = bytes(body[:n])
        self.send_response(200)
        self.send_header("content-type", "text/html; charset=utf-8")
        self.send_header("content-length", str(n))
        if "ce" in params:
            self.send_header("content-encoding", params["ce"])
        if "cc" in params:
            self.send_header("cache-control", params["cc"])
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def body_chunks(self):
        if self.headers.get("transfer-encoding", "").lower() == "chunked":
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    # Trailer section, then the empty line.
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return
                yield from self.exactly(size)
                self.rfile.readline()
        else:
            yield from self.exactly(int(self.headers.get("content-length", "0")))

    def exactly(self, left):
        """The next `left` body bytes, in pieces of at most CHUNK."""
        while left:
            data = self.rfile.read(min(left, CHUNK))
            if not data:
                raise ConnectionError("body broke off")
            left -= len(data)
            yield data

    def do_POST(self):
        if self.path != "/sha256":
            for _ in self.body_chunks():
                pass
            return self.reply(404, b"not found\n")
        h = hashlib.sha256()
        n = 0
        for data in self.body_chunks():
            h.update(data)
            n += len(data)
        self.reply(200, f"{self.command} {n} {h.hexdigest()}\n".encode())

    do_PUT = do_POST


def main():
    port = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    server.daemon_threads = True
    print(f"listening {server.server_address[1]}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
