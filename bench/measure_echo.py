"""The floor for a round trip over a Unix socket: a bare trio server that echoes each line.

    python measure_echo.py SOCKET      # serves until killed; prints "ready" once listening

``round_trips`` times one line out and one line back with a plain blocking socket, the same
client for the echo server and for piwf's host, so their ratio compares the servers.
"""

from __future__ import annotations

import socket
import sys
import time


def round_trips(path: str, line: bytes, n: int) -> list[float]:
    """Microseconds per round trip, ``n`` sequential ones on one connection."""
    times = []
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(path)
        for _ in range(n):
            began = time.perf_counter()
            sock.sendall(line)
            reply = sock.recv(65536)
            while not reply.endswith(b"\n"):
                reply += sock.recv(65536)
            times.append((time.perf_counter() - began) * 1e6)
    return times


async def _serve(path: str) -> None:
    import trio

    async def echo(stream: trio.SocketStream) -> None:
        pending = b""
        while chunk := await stream.receive_some(65536):
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                await stream.send_all(line + b"\n")

    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    await sock.bind(path)
    sock.listen(128)
    print("ready", flush=True)
    await trio.serve_listeners(echo, [trio.SocketListener(sock)])


if __name__ == "__main__":
    import trio

    trio.run(_serve, sys.argv[1])
