"""The console's one ``run.watch``: a long poll on the host that feeds every open tab.

``Feed.serve`` asks the host what changed after its cursor, again and again (no request
is sent while nothing changes), and counts a new *version* for each answer that touched
runs. Each tab's event stream (``pages.events``) waits for a version newer than the one
it sent last and is told which runs changed since (or that anything may have: ``None``),
so the number of tabs costs the host nothing. A lost host (stopped, restarting) is
waited for with a short back-off and the watch goes on from its cursor, as ``piwf
watch`` does; the tabs are told it was lost and, once it is back, that anything may have
changed.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any

import msgspec
import trio

from piwf.client import AsyncClient
from piwf.errors import HostReplied, HostUnavailable
from piwf.paths import StatePaths

POLL_MS = 30_000  # one run.watch's limit: the host answers then at the latest
RECONNECT_BACKOFF_S = (0.1, 0.2, 0.5, 1.0, 2.0)  # between tries to reach a lost host, the last repeated
KEPT = 256  # versions whose runs are remembered; a tab further behind is told "anything"

log = logging.getLogger("piwf.ui")


class Change(msgspec.Struct, frozen=True):
    """What a tab is told: the version, the runs changed since its last (null: any may
    have), and whether the host answers."""

    version: int
    runs: list[str] | None
    host: bool


class Feed:
    def __init__(self, paths: StatePaths, client_id: str) -> None:
        self.paths = paths
        self.client_id = client_id
        self.version = 0
        self.host_up = True
        self._recent: deque[tuple[int, frozenset[str] | None]] = deque(maxlen=KEPT)
        self._changed = trio.Event()
        self._cursor: int | None = None  # where the watch goes on from, across reconnections
        self._attempt = 0  # tries to reach a lost host in a row

    def publish(self, runs: frozenset[str] | None) -> None:
        self.version += 1
        self._recent.append((self.version, runs))
        self._changed.set()
        self._changed = trio.Event()

    async def next_change(self, seen: int) -> Change:
        """The first change after version ``seen`` (waiting for one)."""
        while self.version <= seen:
            await self._changed.wait()
        return Change(self.version, self._runs_since(seen), self.host_up)

    def _runs_since(self, seen: int) -> list[str] | None:
        if not self._recent or self._recent[0][0] > seen + 1:
            return None  # older than what is remembered
        runs: set[str] = set()
        for version, changed in self._recent:
            if version <= seen:
                continue
            if changed is None:
                return None
            runs |= changed
        return sorted(runs)

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Watch the host until cancelled; started once the first cursor is known (or the
        host was found missing: the feed then waits for it)."""
        client = AsyncClient(self.paths, client_id=self.client_id)
        started: list[bool] = []

        def ready() -> None:
            if not started:
                started.append(True)
                task_status.started()

        try:
            while True:
                try:
                    await self._follow(client, ready)
                except (HostUnavailable, HostReplied, trio.TooSlowError, OSError) as exc:
                    if isinstance(exc, HostReplied) and exc.outcome != "unavailable":
                        raise
                    await client.aclose()
                    if self.host_up:
                        log.warning("lost the host (%s); reconnecting", str(exc) or type(exc).__name__)
                        self.host_up = False
                        self.publish(None)
                    ready()  # pages are served, saying the host is away, rather than not at all
                    await trio.sleep(RECONNECT_BACKOFF_S[min(self._attempt, len(RECONNECT_BACKOFF_S) - 1)])
                    self._attempt += 1
        finally:
            with trio.CancelScope(shield=True):
                await client.aclose()

    async def _follow(self, client: AsyncClient, ready: Any) -> None:
        """Connect and follow the host's changes until the connection is lost (raises)."""
        await client.connect()
        cursor = self._cursor
        if cursor is None:
            cursor = self._cursor = int(_ok(await client.watch(limit=1))["cursor"])
        else:  # reachable again: make sure it answers before saying so
            _ok(await client.call("host.status"))
        if not self.host_up:
            log.warning("reconnected to the host")
            self.host_up = True
            self.publish(None)
        ready()
        self._attempt = 0
        while True:
            with trio.fail_after(POLL_MS / 1000 + 30):
                page = _ok(await client.watch(after=cursor, timeout_ms=POLL_MS, limit=500))
            cursor = self._cursor = int(page["cursor"])
            touched = frozenset([run["runId"] for run in page["runs"]] + [e["runId"] for e in page["events"]])
            if touched:
                self.publish(touched)


def _ok(response: Any) -> Any:
    if response.outcome not in ("accepted", "adopted"):
        raise HostReplied(response.outcome, response.error)
    return response.receipt
