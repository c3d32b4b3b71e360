#!/usr/bin/env python3
"""aioquic HTTP/3 client for the static-file tests in server/tests/http.rs.

    aioquic_files.py HOST PORT REQUEST...

Each REQUEST is "METHOD|PATH|name:value|name:value...". They run one after the other on one
connection. In header values, $ETAG and $LAST_MODIFIED stand for the etag and last-modified
of the first response. For each request one line goes to stdout, tab-separated name=value
fields: status, body_len, body_fnv (FNV-1a 64, hex), then every response header field
(name=value). A last line "done" says the script finished. Errors go to stderr and the exit
status is 1. aioquic drops datagrams from any address but the server's and ignores stateless
resets.
"""

import asyncio
import socket
import ssl
import sys

from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.h3.connection import H3_ALPN, H3Connection
from aioquic.h3.events import DataReceived, HeadersReceived
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from aioquic.quic.events import ConnectionTerminated, StreamReset

TIMEOUT = 30.0
FNV_OFFSET = 0xCBF29CE484222325
FNV_PRIME = 0x100000001B3
MASK = 0xFFFFFFFFFFFFFFFF


class Response:
    def __init__(self):
        self.headers = []
        self.length = 0
        self.fnv = FNV_OFFSET
        self.done = asyncio.get_running_loop().create_future()

    def finish(self, error=None):
        if self.done.done():
            return
        if error is None:
            self.done.set_result(self)
        else:
            self.done.set_exception(RuntimeError(error))


class Client(QuicConnectionProtocol):
    """It must not call the base quic_event_received: that floods "Cannot send data after FIN"
    at exit."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.h3 = H3Connection(self._quic)
        self.pending = {}
        self.authority = b""

    def quic_event_received(self, event):
        if isinstance(event, ConnectionTerminated):
            for r in self.pending.values():
                r.finish(f"connection terminated: {event.error_code} {event.reason_phrase}")
            return
        if isinstance(event, StreamReset) and event.stream_id in self.pending:
            self.pending[event.stream_id].finish(f"stream reset {event.error_code}")
            return
        for ev in self.h3.handle_event(event):
            r = self.pending.get(getattr(ev, "stream_id", None))
            if r is None:
                continue
            if isinstance(ev, HeadersReceived):
                r.headers.extend((k.decode(), v.decode()) for k, v in ev.headers)
            elif isinstance(ev, DataReceived):
                r.length += len(ev.data)
                h = r.fnv
                for b in ev.data:
                    h = ((h ^ b) * FNV_PRIME) & MASK
                r.fnv = h
            if getattr(ev, "stream_ended", False):
                r.finish()

    async def request(self, method, path, fields):
        sid = self._quic.get_next_available_stream_id()
        headers = [
            (b":method", method.encode()),
            (b":scheme", b"https"),
            (b":authority", self.authority),
            (b":path", path.encode()),
        ] + [(k.encode(), v.encode()) for k, v in fields]
        self.h3.send_headers(sid, headers, end_stream=True)
        r = Response()
        self.pending[sid] = r
        self.transmit()
        return await r.done


async def main(host, port, requests):
    cfg = QuicConfiguration(is_client=True, alpn_protocols=H3_ALPN, idle_timeout=20.0)
    cfg.verify_mode = ssl.CERT_NONE
    cfg.server_name = "localhost"
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    _, proto = await loop.create_datagram_endpoint(
        lambda: Client(QuicConnection(configuration=cfg)), sock=sock
    )
    proto.authority = f"localhost:{port}".encode()
    proto.connect((host, port))
    await proto.wait_connected()
    first = {}
    for spec in requests:
        method, path, *fields = spec.split("|")
        pairs = []
        for f in fields:
            name, value = f.split(":", 1)
            for var, key in (("$ETAG", "etag"), ("$LAST_MODIFIED", "last-modified")):
                value = value.replace(var, first.get(key, ""))
            pairs.append((name.strip().lower(), value.strip()))
        r = await proto.request(method, path, pairs)
        hdrs = dict(r.headers)
        if not first:
            first = hdrs
        out = [f"status={hdrs.get(':status', '')}", f"body_len={r.length}", f"body_fnv={r.fnv:016x}"]
        out += [f"{k}={v}" for k, v in r.headers if not k.startswith(":")]
        print("\t".join(out), flush=True)
    proto.close()
    await proto.wait_closed()
    print("done", flush=True)


if __name__ == "__main__":
    try:
        asyncio.run(asyncio.wait_for(main(sys.argv[1], int(sys.argv[2]), sys.argv[3:]), TIMEOUT))
    except Exception as e:  # noqa: BLE001 - report any failure as text for the Rust test
        print(f"aioquic_files.py: {type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(1)
