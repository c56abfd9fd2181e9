"""The Unix-socket server: NDJSON, one response per request, in order, per connection.

The peer's uid is checked (SO_PEERCRED) before any frame is read. Every wait on a client
is bounded (docs/protocol.md, "Slow clients"): between requests a connection may stay
idle for ``idle_timeout_s``; once a request's first byte has come, its whole line must
arrive within ``request_timeout_s`` (and within the 1 MiB limit, enforced while reading);
a reply must leave within ``reply_timeout_s``, or the client is taken not to read and is
disconnected. A connection is read only while none of its replies is waiting to leave,
so a client that pipelines without reading makes the host hold one reply and one read
chunk for it, never more. At the connection cap a newcomer takes the place of the
connection that has waited longest for its client; one being answered is never
displaced. A bad frame never reaches an operation and never crashes the host.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import socket
import stat
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from piwf import faults
from piwf.errors import ProtocolError, ServiceError, StateDirError
from piwf.protocol.requests import read_request
from piwf.wire import HostResponse, LineBuffer, Outcome, encode_reply
from piwf.host.delivery import WATCH_ENDS_EARLY
from piwf.host.departures import Departures
from piwf.host.operations import handle_request
from piwf.host.state import HostState, log


def check_socket_path(path: Path) -> None:
    """Refuse to start when the socket's path holds anything but a socket (a stale socket
    is replaced; anything else piwf did not put there, and does not delete)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        kind = "a directory" if stat.S_ISDIR(mode) else "a symlink" if stat.S_ISLNK(mode) else "not a socket"
        raise StateDirError(f"{path} is {kind}, not the host's socket; move it aside and start again")


LISTEN_FDS_START = 3  # SD_LISTEN_FDS_START: the first descriptor a service manager passes


def inherited_listener_fd(environ: Mapping[str, str], pid: int) -> int | None:
    """The descriptor of the socket a service manager passed (socket activation), or None.

    As sd_listen_fds(3): only when ``LISTEN_PID`` is this process (else the variables were
    meant for another); piwf serves one socket, so ``LISTEN_FDS`` must then be 1."""
    if environ.get("LISTEN_PID") != str(pid) or "LISTEN_FDS" not in environ:
        return None
    if environ["LISTEN_FDS"] != "1":
        raise ServiceError(f"LISTEN_FDS={environ['LISTEN_FDS']}: piwf serve takes exactly one socket "
                           "(ListenStream= the state directory's host/host.sock)")
    return LISTEN_FDS_START


async def open_listener(path: Path) -> Listening:
    """Bind the socket 0600 from the start (umask), replacing a stale socket file."""
    check_socket_path(path)
    path.unlink(missing_ok=True)
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o177)
    try:
        await sock.bind(str(path))
        bound = _file_id(path)
    except BaseException:
        sock.close()
        raise
    finally:
        os.umask(old_umask)
    sock.listen(128)
    return Listening(path, trio.SocketListener(sock), bound)


def _file_id(path: Path) -> tuple[int, int]:
    info = os.lstat(path)
    return info.st_dev, info.st_ino


@dataclass(eq=False)
class Listening:
    """The socket the host serves at ``path``: the one it bound (``bound``: that file's
    device and inode), or one a service manager passed (``bound`` None: never touched)."""

    path: Path
    listener: trio.SocketListener
    bound: tuple[int, int] | None = None

    def ours(self) -> bool:
        """The file at ``path`` is still the socket this host bound."""
        try:
            return self.bound is not None and _file_id(self.path) == self.bound
        except OSError:
            return False

    async def aclose(self) -> None:
        """Close the listener; unlink the socket file only while it is the one bound here
        (whatever else is at the path now, a regular file included, is left alone)."""
        await self.listener.aclose()
        if self.ours():
            self.path.unlink(missing_ok=True)


async def watch_socket(host: HostState, listening: Listening, accept: Any) -> None:
    """Keep the host reachable: when its socket file is deleted, bind a new one at the
    path (``accept`` serves it) and close the old; when something else took the path (a
    regular file, a directory, another socket), nothing there is deleted and the host
    stops, saying why, since no client can reach it."""
    while True:
        await trio.sleep(host.config.socket_check_s)
        if listening.ours():
            continue
        try:
            mode: int | None = os.lstat(listening.path).st_mode
        except FileNotFoundError:
            mode = None
        except OSError as exc:
            log.warning("cannot look at the socket %s: %s", listening.path, exc.strerror)
            continue
        if mode is not None:
            what = "another socket" if stat.S_ISSOCK(mode) else _kind(mode)
            log.error("the host's socket %s was replaced by %s: no client can reach this host; stopping "
                      "(what is there now is left as it is)", listening.path, what)
            host.stop_requested.set()
            return
        try:
            fresh = await open_listener(listening.path)
        except (OSError, StateDirError) as exc:
            log.error("the host's socket %s was deleted and cannot be bound again (%s); stopping",
                      listening.path, exc)
            host.stop_requested.set()
            return
        old = listening.listener
        listening.listener, listening.bound = fresh.listener, fresh.bound
        accept(fresh.listener)
        await old.aclose()
        log.warning("the host's socket %s was deleted while the host ran; bound it again", listening.path)


def _kind(mode: int) -> str:
    return "a directory" if stat.S_ISDIR(mode) else "a symlink" if stat.S_ISLNK(mode) else \
        "a regular file" if stat.S_ISREG(mode) else "something that is not a socket"


def adopt_listener(fd: int, path: Path) -> Listening:
    """Serve a listening Unix stream socket bound at ``path`` by someone else (systemd's
    piwf.socket). It is never bound, chmod-ed or unlinked here: it outlives this host, and
    clients connecting while the host restarts wait in its backlog."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError as exc:
        raise ServiceError(f"descriptor {fd} from LISTEN_FDS is not a socket ({exc.strerror})") from exc
    try:
        _check_inherited(sock, path)
    except ServiceError:
        sock.detach()  # not ours to close either
        raise
    sock.set_inheritable(False)  # workers must not hold the listening socket
    sock.setblocking(False)
    return Listening(path, trio.SocketListener(trio.socket.from_stdlib_socket(sock)))


def _check_inherited(sock: socket.socket, path: Path) -> None:
    listening = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
    if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_STREAM or not listening:
        raise ServiceError(f"descriptor {sock.fileno()} from LISTEN_FDS is not a listening Unix stream socket")
    name = sock.getsockname()
    if not isinstance(name, str) or not _same_socket(name, path):
        raise ServiceError(f"the socket from LISTEN_FDS is bound at {name!r}, not at {path}: "
                           "the service's socket unit names another state directory")


def _same_socket(name: str, path: Path) -> bool:
    if name == str(path):
        return True
    try:
        return os.path.samefile(name, path)
    except OSError:
        return False


# accept() failing with these means the process or the system is out of something
# (descriptors, memory) that closing connections gives back: wait and accept again.
CAPACITY_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})
CAPACITY_BACKOFF_S = (0.05, 1.0)
READ_CHUNK = 65536
DISPLACED_NOTICE_S = 1.0  # how long a displaced connection's last line may take to leave


async def serve_socket(host: HostState, listening: Listening, *,
                       task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Accept connections for the host's life, one task each; a socket it bound itself is
    watched (``watch_socket``) and bound again if deleted."""
    connections = Connections(host.config.max_connections)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(connections.departures.serve)
        nursery.start_soon(connections.watch_deadlines)
        def accept(listener: trio.SocketListener) -> None:
            nursery.start_soon(_accept, host, connections, listener, nursery)

        accept(listening.listener)
        if listening.bound is not None:
            nursery.start_soon(watch_socket, host, listening, accept)
        task_status.started()


async def _accept(host: HostState, connections: Connections, listener: trio.SocketListener,
                  nursery: trio.Nursery) -> None:
    """Accept on ``listener`` until it is closed (replaced). Out of descriptors, it backs
    off (as ``trio.serve_listeners`` does) and says so once, not each time."""
    backoff = CAPACITY_BACKOFF_S[0]
    while True:
        try:
            stream = await listener.accept()
        except trio.ClosedResourceError:
            return
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
        nursery.start_soon(_connection, host, connections, stream)


@dataclass(eq=False)
class Connection:
    """One client connection, as the connection cap sees it."""

    waiting_since: float  # when the host last began to wait for this client's next request
    departures: Departures  # watches the client while it is in a long poll
    # The connection's one scope (``_serve_lines``), with no deadline of its own: while the
    # host waits for the client's bytes it is ``reading``, and is cancelled when the wait
    # passes ``deadline`` (``Connections.watch_deadlines``) or the connection is displaced;
    # nothing cancels it otherwise, so nothing cancels an answer.
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    reading: trio.CancelScope | None = None
    deadline: float = math.inf  # the read deadline of the wait in progress
    request_since: float | None = None  # when the request being received began to arrive
    long_poll: trio.CancelScope | None = None  # set while it answers a long poll: displacing ends it early
    long_poll_since: float = 0.0
    displaced: bool = False
    closed: trio.Event = field(default_factory=trio.Event)

    def is_displaced(self) -> bool:
        return self.displaced

    def displace(self) -> None:
        """Close this connection to make room: at once if it waits for its client; a long
        poll first answers with what it has (a normal reply), then the connection closes."""
        self.displaced = True
        if self.reading is not None:
            self.reading.cancel()
        if self.long_poll is not None:
            self.long_poll.cancel()


class Connections:
    """The connections one host serves, at most ``cap``. At the cap a newcomer displaces
    the connection that has waited longest: for its client (idle, or trickling a request),
    or in a long poll (``run.watch``, ``run.wait``: it answers at once with what it has,
    then its connection closes), so long polls never lock out ``status``, ``stop`` or any
    short request; only when every connection is answering a short request is the
    newcomer refused."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self._open: set[Connection] = set()
        self.departures = Departures()  # the clients of the long polls in progress
        self._next_deadline = math.inf  # no wait's read deadline is earlier (watch_deadlines)
        self._watcher: trio.CancelScope | None = None  # watch_deadlines' sleep, until _next_deadline

    def wait_for_client(self, connection: Connection, deadline: float) -> None:
        """``connection`` waits for its client's bytes until ``deadline``: two attributes
        and a comparison, where setting its scope's deadline cost trio's deadline setter
        twice a request (set and cleared, about 28 k instructions: bench/README.md)."""
        connection.deadline = deadline
        connection.reading = connection.scope
        if deadline < self._next_deadline:
            self._next_deadline = deadline
            if deadline <= trio.current_time():
                connection.scope.cancel()  # passed already: as a scope's deadline in the past would
            elif self._watcher is not None:
                self._watcher.deadline = deadline

    async def watch_deadlines(self) -> None:
        """Cancel each connection whose wait for its client passed its read deadline,
        waking at the earliest one (a wait that comes later with an earlier deadline
        wakes it sooner: ``wait_for_client``)."""
        while True:
            with trio.CancelScope(deadline=self._next_deadline) as self._watcher:
                await trio.sleep_forever()
            self._watcher = None
            now, earliest = trio.current_time(), math.inf
            for connection in self._open:
                if connection.reading is None:
                    continue
                if connection.deadline <= now:
                    connection.reading.cancel()
                else:
                    earliest = min(earliest, connection.deadline)
            self._next_deadline = earliest

    async def admit(self, connection: Connection) -> bool:
        while len(self._open) >= self.cap:
            longest = self._to_displace()
            if longest is None:
                return False
            longest.displace()
            await longest.closed.wait()  # within DISPLACED_NOTICE_S: it only says why, then closes
        self._open.add(connection)
        return True

    def _to_displace(self) -> Connection | None:
        """The connection waiting longest: for its client (idle, or trickling a request)
        or, in a long poll, for a change. One being answered otherwise is never chosen."""
        waiting = [(c.waiting_since, c) for c in self._open if c.reading is not None and not c.displaced]
        waiting += [(c.long_poll_since, c) for c in self._open if c.long_poll is not None and not c.displaced]
        return min(waiting, key=lambda pair: pair[0])[1] if waiting else None

    def remove(self, connection: Connection) -> None:
        self._open.discard(connection)
        connection.closed.set()


async def _connection(host: HostState, connections: Connections, stream: trio.SocketStream) -> None:
    async with stream:
        if not _peer_is_us(stream):
            log.warning("refused a connection from another user")
            return
        connection = Connection(trio.current_time(), connections.departures)
        try:
            if not await connections.admit(connection):
                await _refuse(host, stream, Outcome.UNAVAILABLE, f"the host serves at most {connections.cap} "
                              "connections and is answering a request on each; retry later")
                return
            host.connections += 1
            try:
                await _serve_lines(host, connections, connection, stream)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass  # the client went away; its in-flight request was already committed or not
            finally:
                host.connections -= 1
        finally:
            connections.remove(connection)


async def _serve_lines(host: HostState, connections: Connections, connection: Connection,
                       stream: trio.SocketStream) -> None:
    with connection.scope:
        await _lines(host, connections, connection, stream)
    if not connection.scope.cancel_called:
        return
    if connection.displaced:  # while it waited for its client
        await _refuse(host, stream, Outcome.UNAVAILABLE, _displaced(host), timeout=DISPLACED_NOTICE_S)
    else:  # the read deadline passed
        await _refuse(host, stream, Outcome.REJECTED, _timed_out(host, connection.request_since))


async def _lines(host: HostState, connections: Connections, connection: Connection,
                 stream: trio.SocketStream) -> None:
    """Answer the client's lines until it closes its end, a line is refused, or (the
    connection's scope cancelled) the read deadline passes or a newcomer displaces it."""
    buffer = LineBuffer()
    while True:
        chunk = await _receive(connections, connection, stream,
                               _read_deadline(host, connection, connection.request_since))
        if not chunk:  # its end closed, or (None) the deadline passed as the chunk came
            return
        try:
            lines = buffer.feed(chunk)
        except ProtocolError as exc:
            await _refuse(host, stream, Outcome.REJECTED, str(exc))
            return
        for i, line in enumerate(lines):
            if not await _answer(host, connection, stream, line, behind=i + 1 < len(lines) or bool(buffer.pending)):
                return
            if connection.is_displaced():  # a long poll answered early to make room: its connection goes
                return
        if lines:
            connection.waiting_since = trio.current_time()
        connection.request_since = _request_since(buffer, bool(lines), connection.request_since)


def _request_since(buffer: LineBuffer, answered: bool, since: float | None) -> float | None:
    """When the partial line in ``buffer`` began to arrive: now if it follows lines just
    answered (the host was busy meanwhile), else when its first chunk came."""
    if not buffer.pending:
        return None
    return trio.current_time() if answered or since is None else since


def _read_deadline(host: HostState, connection: Connection, request_since: float | None) -> float:
    if request_since is None:
        return connection.waiting_since + host.config.idle_timeout_s
    return request_since + host.config.request_timeout_s


def _timed_out(host: HostState, request_since: float | None) -> str:
    if request_since is None:
        return f"connection idle for more than {host.config.idle_timeout_s:g} s"
    return f"request not complete {host.config.request_timeout_s:g} s after its first byte"


def _displaced(host: HostState) -> str:
    return (f"connection closed to make room for a new one: the host serves at most "
            f"{host.config.max_connections} connections and this one had waited longest for a request")


async def _receive(connections: Connections, connection: Connection, stream: trio.SocketStream,
                   deadline: float) -> bytes | None:
    """The next chunk (b"" at the end), under the connection's scope, cancelled when the
    read deadline passes; None if the scope was cancelled (the deadline passed, or the
    connection was displaced) as the chunk came: the chunk is then not answered. Once this
    returns, nothing cancels the scope: nothing cancels an answer."""
    connections.wait_for_client(connection, deadline)
    try:
        chunk = await _read_chunk(stream.socket)
    finally:
        connection.reading = None
    return None if connection.scope.cancel_called else chunk


async def _read_chunk(sock: trio.socket.SocketType) -> bytes:
    while True:
        await trio.lowlevel.wait_readable(sock)  # a checkpoint: the deadline and displacement end it
        try:
            return os.read(sock.fileno(), READ_CHUNK)  # trio's sockets are non-blocking
        except BlockingIOError:
            continue  # readable, and read meanwhile: wait again
        except OSError as exc:  # reset by the peer: what receive_some raises for it
            raise trio.BrokenResourceError(f"the client went away: {exc}") from exc


async def _answer(host: HostState, connection: Connection, stream: trio.SocketStream, line: bytes, *,
                  behind: bool = False) -> bool:
    """Answer one line (``behind``: more of the client's bytes were read after it); False
    closes the connection (no request id could be read, or the reply did not leave in time)."""
    try:
        request = read_request(line)
    except ProtocolError as exc:
        sent = await _send(host, stream, HostResponse(exc.request_id or "", Outcome.REJECTED, error=str(exc)))
        return sent and exc.request_id is not None
    response, after = await _handle(host, connection, stream, request, behind)
    try:
        sent = await _send(host, stream, response, schedule=behind)
        if sent:
            faults.point("host.reply.sent")
    finally:  # committed is committed: a client gone before the reply changes nothing
        for action in after:
            action()
    return sent


async def _handle(host: HostState, connection: Connection, stream: trio.SocketStream, request: Any,
                  behind: bool = False) -> tuple[HostResponse, Any]:
    """Answer ``request``; a long poll (``run.watch``, ``run.wait``) is given up, and the
    connection closed, as soon as its client goes away instead of when its timeout ends,
    and answered at once with what it has when the client's next request is behind it or
    when a newcomer needs its connection slot."""
    if not request.long_poll:
        return await handle_request(host, request)
    ends_early = trio.CancelScope()
    if behind or connection.displaced:
        ends_early.cancel()
    connection.long_poll, connection.long_poll_since = ends_early, trio.current_time()
    try:
        return await _long_poll(host, connection.departures, stream, request, ends_early)
    finally:
        connection.long_poll = None


async def _long_poll(host: HostState, departures: Departures, stream: trio.SocketStream, request: Any,
                     ends_early: trio.CancelScope) -> tuple[HostResponse, Any]:
    """The long poll, in the connection's own task; ``departures`` watches its client
    meanwhile: its leaving cancels ``gone``, its next request ``ends_early``."""
    gone = trio.CancelScope()
    fd = stream.socket.fileno()
    departures.watch(fd, gone, ends_early)
    token = WATCH_ENDS_EARLY.set(ends_early)
    try:
        with gone:
            return await handle_request(host, request)
    finally:
        WATCH_ENDS_EARLY.reset(token)
        departures.forget(fd)
    raise trio.BrokenResourceError("the client went away during a long poll")


async def _send(host: HostState, stream: trio.SocketStream, response: HostResponse,
                timeout: float | None = None, *, schedule: bool = True) -> bool:
    """Send one reply; False if the client did not take it within the reply timeout.

    A reply the socket takes whole at once (nearly every one: the client reads as it
    waits) has met its deadline without one being set; only the rest of a longer one is
    sent under the deadline. The checkpoints are trio's own socket send's: cancelled
    before any byte leaves, never after, and a schedule point either way (a client
    pipelining requests does not hold the loop) but for a whole reply sent with
    ``schedule`` False: the connection's next step is then to wait for its client
    (``_read_chunk``), a schedule point of its own, so a second one here would only cost a
    turn of trio's loop per request."""
    data = encode_reply(response)
    await trio.lowlevel.checkpoint_if_cancelled()
    try:
        sent = os.write(stream.socket.fileno(), data)  # trio's sockets are non-blocking
    except BlockingIOError:
        sent = 0
    except OSError as exc:  # reset, a broken pipe: what send_all raises for them
        raise trio.BrokenResourceError(f"the client went away: {exc}") from exc
    if sent == len(data):
        if schedule:
            await trio.lowlevel.cancel_shielded_checkpoint()
        return True
    timeout = host.config.reply_timeout_s if timeout is None else timeout
    with trio.move_on_after(timeout):
        await stream.send_all(data[sent:])
        return True
    log.warning("closed a connection whose client did not read its reply within %g s", timeout)
    return False


async def _refuse(host: HostState, stream: trio.SocketStream, outcome: Outcome, error: str,
                  timeout: float | None = None) -> None:
    """Say why the connection is being closed, if the client will take it."""
    with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
        await _send(host, stream, HostResponse("", outcome, error=error), timeout)


def _peer_is_us(stream: trio.SocketStream) -> bool:
    creds = stream.socket.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return int(uid) == os.getuid()
