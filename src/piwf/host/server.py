"""The Unix-socket server: NDJSON, one response per request, in order, per connection.

The peer's uid is checked (SO_PEERCRED) before any frame is read; the 1 MiB line limit
is enforced while reading; idle connections time out; the number of connections is
capped. A bad frame never reaches an operation and never crashes the host.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import struct
from pathlib import Path

import trio

from .. import faults
from ..errors import ProtocolError
from ..wire import HostResponse, LineBuffer, encode_line, read_request
from .operations import handle_request
from .state import HostState, log


async def open_listener(path: Path) -> trio.SocketListener:
    """Bind the socket 0600 from the start (umask), replacing a stale socket file."""
    path.unlink(missing_ok=True)
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o177)
    try:
        await sock.bind(str(path))
    finally:
        os.umask(old_umask)
    sock.listen(128)
    return trio.SocketListener(sock)


# accept() failing with these means the process or the system is out of something
# (descriptors, memory) that closing connections gives back: wait and accept again.
CAPACITY_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})
CAPACITY_BACKOFF_S = (0.05, 1.0)


async def serve_socket(host: HostState, listener: trio.SocketListener, *,
                       task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Accept connections for the host's life, one task each. Out of descriptors, it
    backs off (as ``trio.serve_listeners`` does) and says so once, not each time."""
    async with trio.open_nursery() as nursery:
        task_status.started()
        backoff = CAPACITY_BACKOFF_S[0]
        while True:
            try:
                stream = await listener.accept()
            except OSError as exc:
                if exc.errno not in CAPACITY_ERRNOS:
                    raise
                if backoff == CAPACITY_BACKOFF_S[0]:
                    log.warning("cannot accept connections (%s); retrying while connections close",
                                os.strerror(exc.errno))
                await trio.sleep(backoff)
                backoff = min(backoff * 2, CAPACITY_BACKOFF_S[1])
                continue
            if backoff != CAPACITY_BACKOFF_S[0]:
                log.info("accepting connections again")
                backoff = CAPACITY_BACKOFF_S[0]
            nursery.start_soon(_connection, host, stream)


async def _connection(host: HostState, stream: trio.SocketStream) -> None:
    async with stream:
        if not _peer_is_us(stream):
            log.warning("refused a connection from another user")
            return
        if host.connections >= host.config.max_connections:
            await _refuse(stream, "unavailable", f"the host serves at most {host.config.max_connections} connections")
            return
        host.connections += 1
        try:
            await _serve_lines(host, stream)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the client went away; its in-flight request was already committed or not
        finally:
            host.connections -= 1


async def _serve_lines(host: HostState, stream: trio.SocketStream) -> None:
    buffer = LineBuffer()
    while True:
        chunk: bytes | None = None
        with trio.move_on_after(host.config.idle_timeout_s):
            chunk = await stream.receive_some(65536)
        if chunk is None:
            await _refuse(stream, "rejected", "connection idle for too long")
            return
        if not chunk:
            return
        try:
            lines = buffer.feed(chunk)
        except ProtocolError as exc:
            await _refuse(stream, "rejected", str(exc))
            return
        for line in lines:
            if not await _answer(host, stream, line):
                return


async def _answer(host: HostState, stream: trio.SocketStream, line: bytes) -> bool:
    """Answer one line; False closes the connection (no request id could be read)."""
    try:
        request = read_request(line)
    except ProtocolError as exc:
        await _refuse(stream, "rejected", str(exc), exc.request_id or "")
        return exc.request_id is not None
    response, after = await handle_request(host, request)
    try:
        await stream.send_all(encode_line(response))
        faults.point("host.reply.sent")
    finally:  # committed is committed: a client gone before the reply changes nothing
        for action in after:
            action()
    return True


async def _refuse(stream: trio.SocketStream, outcome: str, error: str, request_id: str = "") -> None:
    with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
        await stream.send_all(encode_line(HostResponse(request_id, outcome, error=error)))


def _peer_is_us(stream: trio.SocketStream) -> bool:
    creds = stream.socket.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return uid == os.getuid()
