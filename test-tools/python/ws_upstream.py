#!/usr/bin/env python3
"""A WebSocket echo service on the `websockets` library, to put behind `ringmux --upstream` in
tests of the proxy's tunnels.

    ws_upstream.py [PORT]

Listens on 127.0.0.1:PORT (0 or absent: any free port) and prints "listening PORT" on stdout
once it accepts connections. Runs until killed. Paths:

    /echo       a WebSocket that sends every message back as it came (no size limit); the
                close code it received at its end is kept for /closes
    /closes     200, the close codes /echo received so far, separated by spaces
    /reset      a WebSocket that resets its TCP connection (RST) once its first message came
    /unasked    101 Switching Protocols to any request, WebSocket handshake or not
    /refuse     403, no WebSocket
"""

import asyncio
import socket
import struct
import sys

from websockets.asyncio.server import serve
from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Response

# The close code each /echo connection received (1006: none), in the order they ended.
closes = []


async def echo(ws):
    if ws.request.path == "/reset":
        await ws.recv()
        sock = ws.transport.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        ws.transport.abort()
        return
    try:
        async for message in ws:
            await ws.send(message)
    except ConnectionClosed:
        pass
    closes.append(ws.close_code if ws.close_code is not None else 1006)


def process_request(connection, request):
    if request.path == "/closes":
        return connection.respond(200, " ".join(str(c) for c in closes) + "\n")
    if request.path == "/unasked":
        headers = Headers([("Upgrade", "websocket"), ("Connection", "Upgrade")])
        return Response(101, "Switching Protocols", headers, b"")
    if request.path == "/refuse":
        return connection.respond(403, "no WebSocket here\n")
    return None


async def main():
    port = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    async with serve(
        echo,
        "127.0.0.1",
        port,
        process_request=process_request,
        max_size=None,
        compression=None,
        ping_interval=None,
    ) as server:
        port = server.sockets[0].getsockname()[1]
        print(f"listening {port}", flush=True)
        await asyncio.Future()


if __name__ == "__main__":
    asyncio.run(main())
