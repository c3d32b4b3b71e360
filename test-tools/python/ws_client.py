#!/usr/bin/env python3
"""WebSocket clients through ringmux's TLS-over-TCP listener, for the proxy's tunnel tests.
Each prints what it saw on stdout, one line per event, and exits 0 (1 on a failed check).

    ws_client.py echo PORT PATH N MIB   HTTP/1.1 (websockets): N text messages both ways,
                                        then one binary message of MIB MiB; "ok N MIB"
    ws_client.py h2 PORT PATH N         HTTP/2 extended CONNECT (RFC 8441, on h2): N text
                                        messages both ways; "ok N"
    ws_client.py hold PORT PATH         HTTP/1.1: opens, says "open", then waits for the end:
                                        "closed CODE" (1006: no close frame)
    ws_client.py status PORT PATH       HTTP/1.1: "status NNN" for a refused handshake, or "open"
    ws_client.py many PORT PATH N       HTTP/1.1: opens N WebSockets, says "open N", then obeys
                                        its stdin, a line at a time: "echo" sends a message on
                                        each, and says "echoed K" for the K echoed back; "wait"
                                        waits for each to be closed and says "closed CODE MS"
                                        for each (MS: when, on a monotonic clock), then exits
    ws_client.py early PORT PATH        raw: the handshake and a text frame "early" in one
                                        write, before the 101; "status NNN", then "echo TEXT"
                                        for the frame that comes back, or "closed"
    ws_client.py garbage PORT PATH      raw: the handshake and bytes that are no frame, in one
                                        write; "status NNN", then "closed" at the end, or
                                        "frame" for a frame
    ws_client.py flood PORT PATH        raw: sends 64 KiB frames and never reads; "stalled
                                        BYTES" once a write waited 2 s (or "unbounded BYTES"
                                        past 1 GiB), then holds the connection until killed

TLS is not verified (the tests' certificate is self-signed); the server name is localhost.
"""

import asyncio
import base64
import os
import socket
import ssl
import struct
import sys
import time

from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus


def tls(alpn=None):
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    if alpn:
        ctx.set_alpn_protocols(alpn)
    return ctx


def open_ws(port, path):
    return connect(
        f"wss://localhost:{port}{path}",
        ssl=tls(),
        host="127.0.0.1",
        port=port,
        server_hostname="localhost",
        max_size=None,
        compression=None,
        ping_interval=None,
        open_timeout=30,
    )


async def echo(port, path, n, mib):
    async with open_ws(port, path) as ws:
        for i in range(n):
            await ws.send(f"message {i}")
            got = await ws.recv()
            if got != f"message {i}":
                print(f"mismatch at {i}: {got!r}", flush=True)
                return 1
        big = os.urandom(mib << 20)
        await ws.send(big)
        got = await ws.recv()
        if got != big:
            print(f"binary mismatch: {len(got)} bytes back", flush=True)
            return 1
    print(f"ok {n} {mib}", flush=True)
    return 0


async def hold(port, path):
    async with open_ws(port, path) as ws:
        print("open", flush=True)
        try:
            await ws.recv()
        except ConnectionClosed as e:
            code = e.rcvd.code if e.rcvd else 1006
            print(f"closed {code}", flush=True)
            return 0
    return 1


async def status(port, path):
    try:
        async with open_ws(port, path):
            print("open", flush=True)
    except InvalidStatus as e:
        print(f"status {e.response.status_code}", flush=True)
    return 0


async def many(port, path, n):
    conns = [await open_ws(port, path) for _ in range(n)]
    print(f"open {len(conns)}", flush=True)
    loop = asyncio.get_running_loop()
    while True:
        command = (await loop.run_in_executor(None, sys.stdin.readline)).strip()
        if command == "echo":
            echoed = 0
            for i, ws in enumerate(conns):
                await ws.send(f"ping {i}")
                echoed += await ws.recv() == f"ping {i}"
            print(f"echoed {echoed}", flush=True)
        elif command == "wait":
            async def closed(ws):
                try:
                    while True:
                        await ws.recv()
                except ConnectionClosed as e:
                    code = e.rcvd.code if e.rcvd else 1006
                    return code, int(time.monotonic() * 1000)
            for code, ms in await asyncio.gather(*(closed(ws) for ws in conns)):
                print(f"closed {code} {ms}", flush=True)
            return 0
        else:
            print(f"unknown command {command!r}", flush=True)
            return 1


def raw_handshake(port, path, then):
    """A TLS connection (HTTP/1.1) that sent a WebSocket handshake and `then` in one write,
    and the status of the response, with the bytes read after its head."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock = tls(["http/1.1"]).wrap_socket(sock, server_hostname="localhost")
    key = base64.b64encode(os.urandom(16)).decode()
    head = (
        f"GET {path} HTTP/1.1\r\nHost: localhost:{port}\r\nUpgrade: websocket\r\n"
        f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
    )
    sock.sendall(head.encode() + then)
    buf = b""
    while b"\r\n\r\n" not in buf:
        data = sock.recv(65536)
        if not data:
            return sock, None, b""
        buf += data
    head, rest = buf.split(b"\r\n\r\n", 1)
    status = head.split(b" ")[1].decode()
    print(f"status {status}", flush=True)
    return sock, status, rest


def read_frame(sock, buf):
    """The first whole frame (opcode, payload) reading on from buf, or None at the end."""
    while (parsed := unframe(buf)) is None:
        try:
            data = sock.recv(65536)
        except (ConnectionError, ssl.SSLError):
            data = b""
        if not data:
            return None
        buf += data
    return parsed[:2]


def early(port, path):
    sock, status, rest = raw_handshake(port, path, frame(0x1, b"early"))
    got = read_frame(sock, rest) if status else None
    print(f"echo {got[1].decode()}" if got else "closed", flush=True)
    return 0


def garbage(port, path):
    sock, status, rest = raw_handshake(port, path, b"GARBAGE\r\n\r\n")
    got = read_frame(sock, rest) if status else None
    print("frame" if got else "closed", flush=True)
    return 0


def flood(port, path):
    sock, status, _ = raw_handshake(port, path, b"")
    if status != "101":
        return 1
    sock.settimeout(2)
    chunk = frame(0x2, os.urandom(64 << 10))
    sent = 0
    try:
        while sent < 1 << 30:
            sock.sendall(chunk)
            sent += len(chunk)
    except (socket.timeout, ssl.SSLError):
        print(f"stalled {sent}", flush=True)
        sys.stdin.readline()
        return 0
    print(f"unbounded {sent}", flush=True)
    return 1


def frame(opcode, payload):
    """A masked client frame (RFC 6455 §5.2), FIN set."""
    mask = os.urandom(4)
    head = bytes([0x80 | opcode])
    n = len(payload)
    if n < 126:
        head += bytes([0x80 | n])
    elif n < 65536:
        head += bytes([0x80 | 126]) + struct.pack("!H", n)
    else:
        head += bytes([0x80 | 127]) + struct.pack("!Q", n)
    return head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


def unframe(buf):
    """(opcode, payload, rest) of the first whole unmasked frame of buf, or None."""
    if len(buf) < 2:
        return None
    n, at = buf[1] & 0x7F, 2
    if n == 126:
        if len(buf) < 4:
            return None
        n, at = struct.unpack("!H", buf[2:4])[0], 4
    elif n == 127:
        if len(buf) < 10:
            return None
        n, at = struct.unpack("!Q", buf[2:10])[0], 10
    if len(buf) < at + n:
        return None
    return buf[0] & 0x0F, buf[at : at + n], buf[at + n :]


def h2_connect(port, path):
    """An HTTP/2 connection (TLS, h2) that sent an extended CONNECT for a WebSocket at path:
    (sock, conn, stream), or None after saying why."""
    import h2.config
    import h2.connection
    import h2.events
    import h2.settings

    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock = tls(["h2"]).wrap_socket(sock, server_hostname="localhost")
    if sock.selected_alpn_protocol() != "h2":
        print(f"alpn {sock.selected_alpn_protocol()}", flush=True)
        return None
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    sock.sendall(conn.data_to_send())
    enabled = None
    while enabled is None:
        for event in conn.receive_data(sock.recv(65536)):
            if isinstance(event, h2.events.RemoteSettingsChanged):
                setting = event.changed_settings.get(h2.settings.SettingCodes.ENABLE_CONNECT_PROTOCOL)
                enabled = bool(setting and setting.new_value)
        sock.sendall(conn.data_to_send())
    if not enabled:
        print("no SETTINGS_ENABLE_CONNECT_PROTOCOL", flush=True)
        return None
    stream = conn.get_next_available_stream_id()
    conn.send_headers(
        stream,
        [
            (":method", "CONNECT"),
            (":protocol", "websocket"),
            (":scheme", "https"),
            (":path", path),
            (":authority", f"localhost:{port}"),
            ("sec-websocket-version", "13"),
        ],
    )
    sock.sendall(conn.data_to_send())
    return sock, conn, stream


def h2_echo(port, path, n):
    import h2.events

    opened = h2_connect(port, path)
    if opened is None:
        return 1
    sock, conn, stream = opened
    buf, status, sent, got = b"", None, 0, 0
    if n > 0:
        conn.send_data(stream, frame(0x1, b"message 0"))
        sent = 1
    sock.sendall(conn.data_to_send())
    while got < n:
        data = sock.recv(65536)
        if not data:
            print("connection closed", flush=True)
            return 1
        for event in conn.receive_data(data):
            if isinstance(event, h2.events.ResponseReceived):
                status = dict(event.headers).get(b":status")
                if status != b"200":
                    print(f"status {status.decode()}", flush=True)
                    return 1
            elif isinstance(event, h2.events.DataReceived):
                conn.acknowledge_received_data(event.flow_controlled_length, stream)
                buf += event.data
            elif isinstance(event, h2.events.StreamReset):
                print("stream reset", flush=True)
                return 1
        while (parsed := unframe(buf)) is not None:
            opcode, payload, buf = parsed
            if opcode != 0x1 or payload != f"message {got}".encode():
                print(f"mismatch at {got}: {opcode} {payload!r}", flush=True)
                return 1
            got += 1
            if sent < n:
                conn.send_data(stream, frame(0x1, f"message {sent}".encode()))
                sent += 1
        sock.sendall(conn.data_to_send())
    # The closing handshake (RFC 6455 §7.1.2): ours, then the server's close and the end of
    # the stream, before the connection goes.
    conn.send_data(stream, frame(0x8, struct.pack("!H", 1000)), end_stream=True)
    sock.sendall(conn.data_to_send())
    closed, ended = False, False
    while not (closed and ended):
        data = sock.recv(65536)
        if not data:
            print("connection closed before the closing handshake", flush=True)
            return 1
        for event in conn.receive_data(data):
            if isinstance(event, h2.events.DataReceived):
                conn.acknowledge_received_data(event.flow_controlled_length, stream)
                buf += event.data
            elif isinstance(event, h2.events.StreamEnded):
                ended = True
        while (parsed := unframe(buf)) is not None:
            opcode, payload, buf = parsed
            closed |= opcode == 0x8
        sock.sendall(conn.data_to_send())
    conn.close_connection()
    sock.sendall(conn.data_to_send())
    print(f"ok {n}", flush=True)
    return 0


def main():
    what, port, path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    if what == "echo":
        return asyncio.run(echo(port, path, int(sys.argv[4]), int(sys.argv[5])))
    if what == "h2":
        return h2_echo(port, path, int(sys.argv[4]))
    if what == "hold":
        return asyncio.run(hold(port, path))
    if what == "status":
        return asyncio.run(status(port, path))
    if what == "many":
        return asyncio.run(many(port, path, int(sys.argv[4])))
    if what == "early":
        return early(port, path)
    if what == "garbage":
        return garbage(port, path)
    if what == "flood":
        return flood(port, path)
    print(f"unknown {what}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
