"""The sd_notify protocol: telling systemd (``Type=notify``) how the host is doing.

One AF_UNIX datagram per message to ``$NOTIFY_SOCKET`` (a path, or ``@name`` in the
abstract namespace). ``READY=1`` once the socket accepts and the takeover is done,
``STATUS=`` with what the host is doing, ``WATCHDOG=1`` every ``WATCHDOG_USEC/2`` from the
event loop (a stalled loop stops the pings, and systemd restarts the host), ``STOPPING=1``
when a drain starts. Without ``NOTIFY_SOCKET`` every send is a no-op. Sending is best
effort: a refused datagram is logged once and never stops the host.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import AsyncIterator, Mapping

import trio
import trio_util

from piwf.host.state import HostState, log

STATUS_INTERVAL_S = 5.0  # how often STATUS= is refreshed when there is no watchdog to ping


class Notifier:
    """Sends sd_notify messages to one address, or nowhere."""

    def __init__(self, address: str | None, watchdog_s: float | None = None) -> None:
        self.address = address
        self.watchdog_s = watchdog_s  # the service's WatchdogSec; pinged twice as often
        self.serving = False  # READY=1 sent
        self.stopping = False  # STOPPING=1 sent
        self._sock: socket.socket | None = None
        self._failed = False
        self._status = ""

    @classmethod
    def from_env(cls, environ: Mapping[str, str], pid: int) -> Notifier:
        """``NOTIFY_SOCKET`` and ``WATCHDOG_USEC`` (ignored when ``WATCHDOG_PID`` names
        another process), as sd_notify(3) and sd_watchdog_enabled(3) read them."""
        address = environ.get("NOTIFY_SOCKET") or None
        watchdog_s = None
        usec = environ.get("WATCHDOG_USEC", "")
        if usec.isdigit() and int(usec) > 0 and environ.get("WATCHDOG_PID", str(pid)) == str(pid):
            watchdog_s = int(usec) / 1e6
        return cls(address, watchdog_s)

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def send(self, *fields: str) -> None:
        if self.address is None or not fields:
            return
        try:
            self._socket().sendto("\n".join(fields).encode(), _sockaddr(self.address))
        except OSError as exc:  # a full queue (EAGAIN) or a gone manager: the next message may pass
            if not self._failed:
                log.warning("could not notify the service manager at %s (%s); will keep trying",
                            self.address, exc.strerror or exc)
            self._failed = True
            return
        self._failed = False

    def _socket(self) -> socket.socket:
        if self._sock is None:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.setblocking(False)  # never wait on the manager inside the event loop
        return self._sock

    def status(self, text: str, *fields: str) -> None:
        """Send ``STATUS=text`` (with ``fields``), or only ``fields`` if the text is unchanged."""
        if text != self._status:
            self._status = text
            fields = (*fields, f"STATUS={text}")
        self.send(*fields)

    def ready(self, host: HostState) -> None:
        self.serving = True
        self.status(serving_status(host), "READY=1")

    def stop(self, host: HostState) -> None:
        """``STOPPING=1``, once: a drain has started."""
        if not self.stopping:
            self.stopping = True
            self.status(f"draining: stopping {len(host.active)} worker(s), parking their runs", "STOPPING=1")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _sockaddr(address: str) -> str | bytes:
    if address.startswith("@"):  # the abstract namespace: a leading NUL instead of the @
        return b"\0" + address[1:].encode()
    return address


def serving_status(host: HostState) -> str:
    return (f"serving at epoch {host.epoch}: {len(host.active)} active run(s), "
            f"{host.connections} connection(s)")


@contextlib.asynccontextmanager
async def open_notifier(notifier: Notifier, host: HostState) -> AsyncIterator[Notifier]:
    """Ping the watchdog and refresh ``STATUS=`` for as long as the block runs: through a
    drain too, which may take the whole drain timeout. ``STOPPING=1`` goes out when a stop
    is requested (a signal, ``host.stop``, a lost lease); the host also says it, through
    ``Notifier.stop``, when its scope ends for another reason."""
    if not notifier.enabled:
        yield notifier
        return
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_serve_pings, notifier, host)
            nursery.start_soon(_stop_when_requested, notifier, host)
            yield notifier
            nursery.cancel_scope.cancel()
    finally:
        notifier.close()


async def _serve_pings(notifier: Notifier, host: HostState) -> None:
    interval = notifier.watchdog_s / 2 if notifier.watchdog_s else STATUS_INTERVAL_S
    async with contextlib.aclosing(trio_util.periodic(interval)) as ticks:
        async for _ in ticks:
            pings = ("WATCHDOG=1",) if notifier.watchdog_s else ()
            if notifier.serving and not notifier.stopping:
                notifier.status(serving_status(host), *pings)
            else:  # starting (the watchdog counts from the start) or draining: its STATUS= stands
                notifier.send(*pings)


async def _stop_when_requested(notifier: Notifier, host: HostState) -> None:
    await host.stop_requested.wait()
    notifier.stop(host)
