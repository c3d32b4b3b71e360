#!/usr/bin/env python3
"""aioquic HTTP/3 client of ringmux's tests (systests/tests/system/interop/clients.rs, systests/tests/system/server/http.rs;
ringmux_testkit::aioquic says where this file is).

    aioquic_client.py HOST PORT SCENARIO [--dir DIR] [--dcid HEX] [--dcid2 HEX] [--path P]...
        [--upload-bytes N] [--bytes N] [--request SPEC]... [--server-name NAME]

Prints exactly one JSON object on stdout: {"ok": bool, "error": str|null, "bodies": [...], ...}.
Each entry of "bodies" is "PATH STATUS LENGTH FNV1A64HEX"; the Rust test checks them against
ringmux_server::http::fill_pattern, so this script holds no copy of the pattern. Large bodies
("download") are written to DIR instead. Exit status is 0 whenever the JSON was printed.

Scenarios: get, paths (GET each --path), upload (POST --upload-bytes to each --path), many
(100 requests, one connection), conns (20 parallel connections), migrate (new socket
mid-download, same CID: NAT rebinding), migrate_cid (new socket and a new CID: active
migration), keyupdate, download (--bytes, default 10 MiB, to DIR), zerortt (ticket, then early
data), requests (each --request in turn on one connection).
--dcid/--dcid2 pin the first DCID of the first/second connection (the demux routes by it).
--server-name is the TLS server name (SNI) and the :authority's host; "" sends no SNI (and
"localhost" as host). The certificate is not verified: "peer" says what the server sent,
{"subject": RFC 4514 text, "names": [DNS names]} of the leaf ("paths" and "requests").
A --path of "paths" may be https://HOST/PATH: that request's :authority is HOST.
A --request SPEC is "METHOD|PATH|name:value|name:value...": in header values, $ETAG and
$LAST_MODIFIED stand for the etag and last-modified of the first response. For each, an entry
of "responses" holds string fields: status, body_len, body_fnv (FNV-1a 64, hex), body_hex (the
first 256 KiB of the body, hex) and every response header field.
aioquic ignores stateless resets, drops datagrams from any address but the server's, and
switches both key directions at once on a key update.
"""

import argparse
import asyncio
import json
import os
import socket
import ssl
import sys
import traceback

from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.h3.connection import H3_ALPN, H3Connection
from aioquic.h3.events import DataReceived, HeadersReceived
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from aioquic.quic.events import ConnectionTerminated, StreamReset
from aioquic.quic.logger import QuicLogger
from cryptography import x509

SERVER_NAME = "localhost"
# Roots to verify the server against (--ca-certs); none: any certificate is taken.
CA_CERTS = None
SCENARIO_TIMEOUT = 60.0
FNV_OFFSET = 0xCBF29CE484222325
FNV_PRIME = 0x100000001B3
MASK = 0xFFFFFFFFFFFFFFFF
KEPT = 256 * 1024


class Response:
    def __init__(self, path, sink):
        self.path = path
        self.status = None
        self.headers = []  # (name, value) text pairs, pseudo-headers included
        self.length = 0
        self.fnv = FNV_OFFSET
        self.sink = sink  # open file for large bodies, else None (checksum instead)
        self.head = b""  # the first 4 KiB of the body, for checks of small answers
        self.kept = b""  # the first 256 KiB, for "requests" (body_hex)
        self.done = asyncio.get_running_loop().create_future()

    def data(self, chunk):
        self.length += len(chunk)
        if len(self.head) < 4096:
            self.head += chunk[: 4096 - len(self.head)]
        if len(self.kept) < KEPT:
            self.kept += chunk[: KEPT - len(self.kept)]
        if self.sink is not None:
            self.sink.write(chunk)
            return
        h = self.fnv
        for b in chunk:
            h = ((h ^ b) * FNV_PRIME) & MASK
        self.fnv = h

    def finish(self, error=None):
        if self.done.done():
            return
        if self.sink is not None:
            self.sink.close()
        if error is None:
            self.done.set_result(self)
        else:
            self.done.set_exception(RuntimeError(f"{self.path}: {error}"))

    def summary(self):
        return f"{self.path} {self.status} {self.length} {self.fnv:016x}"


class H3Client(QuicConnectionProtocol):
    """An HTTP/3 client protocol. It must not call the base quic_event_received: that floods
    "Cannot send data after FIN" at exit."""

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
                for k, v in ev.headers:
                    r.headers.append((k.decode(), v.decode("utf-8", "replace")))
                    if k == b":status":
                        r.status = int(v)
            elif isinstance(ev, DataReceived):
                r.data(ev.data)
            if getattr(ev, "stream_ended", False):
                r.finish()

    async def get(self, path, sink=None):
        return await self.start(path, sink).done

    def start(self, path, sink=None, method=b"GET", body=None, fields=()):
        """Sends the request, with the header `fields` (byte pairs) and `body`, if any; the
        returned Response's `done` resolves when the response body is in. A `path` of
        https://HOST/PATH sends HOST as the :authority."""
        sid = self._quic.get_next_available_stream_id()
        authority, target = self.authority, path
        if path.startswith("https://"):
            host, _, rest = path[len("https://"):].partition("/")
            authority, target = host.encode(), "/" + rest
        self.h3.send_headers(
            sid,
            [
                (b":method", method),
                (b":scheme", b"https"),
                (b":authority", authority),
                (b":path", target.encode()),
            ]
            + list(fields),
            end_stream=body is None,
        )
        if body is not None:
            self.h3.send_data(sid, body, end_stream=True)
        r = Response(path, sink)
        self.pending[sid] = r
        self.transmit()
        return r

    async def rebind(self, change_cid):
        """Moves the connection to a new UDP socket (new local port), optionally with a new CID."""
        loop = asyncio.get_running_loop()
        old = self._transport
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.bind(("0.0.0.0", 0))  # as open_conn's
        await loop.create_datagram_endpoint(lambda: self, sock=sock)
        old.close()  # connection_lost of the base protocol does nothing
        if change_cid:
            self.change_connection_id()
        else:
            self.ping_soon()
        return sock.getsockname()[1]

    def ping_soon(self):
        self._quic.send_ping(0)
        self.transmit()


def config(logger=None, ticket=None):
    cfg = QuicConfiguration(is_client=True, alpn_protocols=H3_ALPN, idle_timeout=20.0)
    if CA_CERTS:
        # Verify the chain against these roots and the name against SERVER_NAME.
        cfg.verify_mode = ssl.CERT_REQUIRED
        cfg.load_verify_locations(cafile=CA_CERTS)
    else:
        cfg.verify_mode = ssl.CERT_NONE
    cfg.server_name = SERVER_NAME or None
    cfg.quic_logger = logger
    if ticket is not None:
        cfg.session_ticket = ticket
    return cfg


async def open_conn(host, port, cfg, dcid=None, ticket_handler=None, wait=True):
    """Like aioquic.asyncio.client.connect, on an IPv4 socket and with an optional first DCID."""
    loop = asyncio.get_running_loop()
    conn = QuicConnection(configuration=cfg, session_ticket_handler=ticket_handler)
    if dcid is not None:
        # aioquic has no option for the client's first DCID; set it before connect() derives
        # the Initial keys from it (aioquic 1.7).
        conn._peer_cid.cid = dcid
        conn._original_destination_connection_id = dcid
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    # Any address: the route to HOST picks the source (127.0.0.1 for loopback, the
    # namespace's own address for deploy/cluster.sh's VIP).
    sock.bind(("0.0.0.0", 0))
    _, proto = await loop.create_datagram_endpoint(lambda: H3Client(conn), sock=sock)
    proto.authority = f"{SERVER_NAME or 'localhost'}:{port}".encode()
    proto.connect((host, port), transmit=wait)
    if wait:
        try:
            await proto.wait_connected()
        except ConnectionError:
            # Say why: the peer's (or our own) CONNECTION_CLOSE, e.g. 0x131 for a TLS
            # access_denied alert (RFC 9001 §4.8: 0x100 + the alert).
            closed = proto._quic._close_event
            if closed is None:
                raise
            raise ConnectionError(
                f"handshake failed: error code {closed.error_code:#x} {closed.reason_phrase}"
            ) from None
    return proto


async def close(proto):
    proto.close()
    await proto.wait_closed()
    proto._transport.close()


def peer(proto):
    """What the server's leaf certificate says of itself."""
    cert = proto._quic.tls._peer_certificate
    if cert is None:
        return None
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName)
        names = san.value.get_values_for_type(x509.DNSName)
    except x509.ExtensionNotFound:
        names = []
    return {
        "subject": cert.subject.rfc4514_string(),
        "names": names,
        "serial": f"{cert.serial_number:x}",
    }


def events(logger, name):
    out = []
    for trace in logger.to_dict()["traces"]:
        for ev in trace["events"]:
            if ev["name"] == name:
                out.append(ev)
    return out


async def scenario(args, result):
    host, port = args.host, args.port
    dcid = bytes.fromhex(args.dcid) if args.dcid else None
    bodies = result["bodies"]
    if args.scenario == "get":
        p = await open_conn(host, port, config(), dcid)
        bodies.append((await p.get("/hello.txt")).summary())
        bodies.append((await p.get("/bytes/12345")).summary())
        await close(p)
    elif args.scenario == "paths":
        # GET each --path on one connection; the bodies' first bytes go to "texts".
        p = await open_conn(host, port, config(), dcid)
        result["peer"] = peer(p)
        result["texts"] = []
        result["headers"] = []
        for path in args.path:
            r = await p.get(path)
            bodies.append(r.summary())
            result["texts"].append(r.head.decode("utf-8", "replace"))
            result["headers"].append(dict(r.headers))
        await close(p)
    elif args.scenario == "upload":
        # POST --upload-bytes bytes (byte i = i * 7 % 253) to each --path; answers in "texts".
        p = await open_conn(host, port, config(), dcid)
        body = bytes(i * 7 % 253 for i in range(args.upload_bytes))
        result["texts"] = []
        for path in args.path:
            r = await p.start(path, method=b"POST", body=body).done
            bodies.append(r.summary())
            result["texts"].append(r.head.decode("utf-8", "replace"))
        await close(p)
    elif args.scenario == "many":
        p = await open_conn(host, port, config(), dcid)
        rs = await asyncio.gather(*(p.get(f"/bytes/{(i * 1013) % 20011}") for i in range(100)))
        bodies.extend(r.summary() for r in rs)
        await close(p)
    elif args.scenario == "conns":

        async def one(i):
            p = await open_conn(host, port, config())
            r = await p.get(f"/bytes/{1000 + i * 997}")
            await close(p)
            return r.summary()

        bodies.extend(await asyncio.gather(*(one(i) for i in range(20))))
    elif args.scenario in ("migrate", "migrate_cid"):
        p = await open_conn(host, port, config(), dcid)
        before = p._transport.get_extra_info("sockname")[1]
        n = 8 << 20
        r = p.start(f"/bytes/{n}")
        while r.length < (1 << 20) and not r.done.done():
            await asyncio.sleep(0.001)
        result["moved_at"] = r.length
        result["moved_before_end"] = not r.done.done()
        result["port_before"] = before
        result["port_after"] = await p.rebind(args.scenario == "migrate_cid")
        bodies.append((await r.done).summary())
        bodies.append((await p.get("/bytes/4321")).summary())
        await close(p)
    elif args.scenario == "keyupdate":
        logger = QuicLogger()
        p = await open_conn(host, port, config(logger), dcid)
        bodies.append((await p.get("/bytes/100000")).summary())
        p.request_key_update()
        bodies.append((await p.get("/bytes/200000")).summary())
        p.request_key_update()
        bodies.append((await p.get("/bytes/300000")).summary())
        await close(p)
        result["key_updated_events"] = len(events(logger, "security:key_updated"))
    elif args.scenario == "download":
        p = await open_conn(host, port, config(), dcid)
        n = args.bytes
        r = await p.get(f"/bytes/{n}", sink=open(os.path.join(args.dir, str(n)), "wb"))
        bodies.append(r.summary())
        await close(p)
    elif args.scenario == "zerortt":
        tickets = []
        p = await open_conn(host, port, config(), dcid, ticket_handler=tickets.append)
        bodies.append((await p.get("/bytes/100")).summary())
        await close(p)
        if not tickets:
            raise RuntimeError("no session ticket after the first connection")
        result["tickets"] = len(tickets)
        logger = QuicLogger()
        dcid2 = bytes.fromhex(args.dcid2) if args.dcid2 else None
        p = await open_conn(host, port, config(logger, tickets[-1]), dcid2, wait=False)
        bodies.append((await p.get("/bytes/3000")).summary())
        # wait_connected() only fires for a handshake still to come, so poll the state.
        while not p._quic._handshake_complete:
            await asyncio.sleep(0.005)
        result["session_resumed"] = bool(p._quic.tls.session_resumed)
        result["early_data_accepted"] = bool(p._quic.tls.early_data_accepted)
        result["sent_0rtt_packets"] = sum(
            1
            for ev in events(logger, "transport:packet_sent")
            if ev["data"]["header"]["packet_type"] == "0RTT"
        )
        await close(p)
    elif args.scenario == "requests":
        p = await open_conn(host, port, config(), dcid)
        result["peer"] = peer(p)
        result["responses"] = []
        first = {}
        for spec in args.request:
            method, path, *fields = spec.split("|")
            pairs = []
            for f in fields:
                name, value = f.split(":", 1)
                for var, key in (("$ETAG", "etag"), ("$LAST_MODIFIED", "last-modified")):
                    value = value.replace(var, first.get(key, ""))
                pairs.append((name.strip().lower().encode(), value.strip().encode()))
            r = await p.start(path, method=method.encode(), fields=pairs).done
            headers = dict(r.headers)
            if not first:
                first = headers
            entry = {k: v for k, v in r.headers if not k.startswith(":")}
            entry.update(
                status=headers.get(":status", ""),
                body_len=str(r.length),
                body_fnv=f"{r.fnv:016x}",
                body_hex=r.kept.hex(),
            )
            result["responses"].append(entry)
        await close(p)
    else:
        raise RuntimeError(f"unknown scenario {args.scenario}")


async def main():
    global SERVER_NAME, CA_CERTS
    ap = argparse.ArgumentParser()
    ap.add_argument("host")
    ap.add_argument("port", type=int)
    ap.add_argument("scenario")
    ap.add_argument("--dir", default=".")
    ap.add_argument("--dcid")
    ap.add_argument("--dcid2")
    ap.add_argument("--path", action="append", default=[])
    ap.add_argument("--upload-bytes", type=int, default=0)
    ap.add_argument("--bytes", type=int, default=10 << 20, help="download: body size")
    ap.add_argument("--request", action="append", default=[], help="requests: one request")
    ap.add_argument("--server-name", default=SERVER_NAME, help='SNI and host; "": no SNI')
    ap.add_argument("--ca-certs", help="verify the server's chain against these PEM roots")
    args = ap.parse_args()
    SERVER_NAME = args.server_name
    CA_CERTS = args.ca_certs
    result = {"ok": False, "error": None, "scenario": args.scenario, "bodies": []}
    try:
        await asyncio.wait_for(scenario(args, result), SCENARIO_TIMEOUT)
        result["ok"] = True
    except BaseException as e:  # report everything, including the timeout
        result["error"] = f"{type(e).__name__}: {e}"
        traceback.print_exc(file=sys.stderr)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
