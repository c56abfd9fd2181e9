"""Clients in a long poll (``run.watch``, ``run.wait``), watched for leaving by one task for
all of them: their sockets in an epoll set of the server's own, which that task waits on.

A long poll is answered in its connection's own task; while it waits, the watcher is what
notices its client: the client closing its end (or resetting it) cancels the poll's
``gone`` scope (nothing is answered, the connection closes); a next request pipelined
behind the poll (bytes to read) cancels its ``ends_early`` scope (it answers at once with
what it has, and the bytes stay for the connection to read). Each socket is armed once
(``EPOLLONESHOT``): after either, it is not watched again for that poll. A poll costs two
``epoll_ctl`` calls, not a nursery and two tasks.
"""

from __future__ import annotations

import array
import fcntl
import select
import termios

import trio

_ARMED = select.EPOLLIN | select.EPOLLRDHUP | select.EPOLLONESHOT


class Departures:
    """The sockets of the long polls in progress, by descriptor."""

    def __init__(self) -> None:
        self._epoll = select.epoll()
        self._polls: dict[int, tuple[trio.CancelScope, trio.CancelScope]] = {}

    def watch(self, fd: int, gone: trio.CancelScope, ends_early: trio.CancelScope) -> None:
        """Watch the socket ``fd`` until ``forget(fd)``. Once the server has ended (the
        host stops: its watcher is cancelled with the connections), the poll ends at once."""
        if self._epoll.closed:
            gone.cancel()
        else:
            self._epoll.register(fd, _ARMED)
        self._polls[fd] = (gone, ends_early)

    def forget(self, fd: int) -> None:
        """The poll ended (before its socket closes: the descriptor may be reused after)."""
        del self._polls[fd]
        if not self._epoll.closed:  # closed when the server ended first (its tasks are cancelled together)
            self._epoll.unregister(fd)

    async def serve(self) -> None:
        """Wait for any watched client to send or leave, for the server's life."""
        try:
            while True:
                await trio.lowlevel.wait_readable(self._epoll.fileno())
                for fd, _events in self._epoll.poll(0):
                    self._woken(fd)
        finally:
            self._epoll.close()

    def _woken(self, fd: int) -> None:
        poll = self._polls.get(fd)
        if poll is None:
            return
        gone, ends_early = poll
        if _readable_bytes(fd):
            ends_early.cancel()  # a next request: answer with what there is
        else:
            gone.cancel()  # readable with nothing to read: the end of the stream, or reset by the peer


def _readable_bytes(fd: int) -> int:
    """How many bytes wait to be read on the socket (FIONREAD, without reading them)."""
    count = array.array("i", [0])
    try:
        fcntl.ioctl(fd, termios.FIONREAD, count, True)
    except OSError:
        return 0
    return count[0]
