#!/usr/bin/env python3
"""A WebSocket echo service on the `websockets` library, to put behind `ringmux --upstream` in
tests of the proxy's tunnels.

    ws_upstream.py [PORT]

Listens on 127.0.0.1:PORT (0 or absent: any free port) and prints "listening PORT" on stdout
once it accepts connections. Runs until killed. Paths:

    /echo       a WebSocket that sends every message back as it came (no size limit)
    /unasked    101 Switching Protocols to any request, WebSocket handshake or not
    /refuse     403, no WebSocket
"""

import asyncio
import sys

from websockets.asyncio.server import serve
from websockets.datastructures import Headers
from websockets.http11 import Response


async def echo(ws):
    async for message in ws:
        await ws.send(message)


def process_request(connection, request):
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
