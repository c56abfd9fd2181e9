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

import contextlib
import hashlib
import logging
from collections import deque
from collections.abc import Iterator
from typing import Any

import msgspec
import trio
import trio_util

from piwf.client import AsyncClient
from piwf.errors import HostReplied, HostUnavailable
from piwf.paths import StatePaths

POLL_MS = 30_000  # one run.watch's limit: the host answers then at the latest
RECONNECT_BACKOFF_S = (0.1, 0.2, 0.5, 1.0, 2.0)  # between tries to reach a lost host, the last repeated
KEPT = 256  # versions whose runs are remembered; a tab further behind is told "anything"
RESOURCES_POLL_S = 1.0  # how often controller.list is read while a tab shows controllers

log = logging.getLogger("piwf.ui")


class Change(msgspec.Struct, frozen=True):
    """What a tab is told: the version, the runs changed since its last (null: any may
    have), whether the host answers, and whether a controller resource changed."""

    version: int
    runs: list[str] | None
    host: bool
    resources: bool = False


class Feed:
    def __init__(self, paths: StatePaths, client_id: str) -> None:
        self.paths = paths
        self.client_id = client_id
        self.version = 0
        self.host_up = True
        self._recent: deque[tuple[int, frozenset[str] | None, bool]] = deque(maxlen=KEPT)
        self._resource_tabs = trio_util.AsyncValue(0)  # open tabs that show controllers
        self._changed = trio.Event()
        self._cursor: int | None = None  # where the watch goes on from, across reconnections
        self._attempt = 0  # tries to reach a lost host in a row

    def publish(self, runs: frozenset[str] | None, *, resources: bool = False) -> None:
        self.version += 1
        self._recent.append((self.version, runs, resources or runs is None))
        self._changed.set()
        self._changed = trio.Event()

    async def next_change(self, seen: int) -> Change:
        """The first change after version ``seen`` (waiting for one)."""
        while self.version <= seen:
            await self._changed.wait()
        runs, resources = self._since(seen)
        return Change(self.version, runs, self.host_up, resources)

    def _since(self, seen: int) -> tuple[list[str] | None, bool]:
        if not self._recent or self._recent[0][0] > seen + 1:
            return None, True  # older than what is remembered
        runs: set[str] = set()
        anything = resources = False
        for version, changed, touched_resources in self._recent:
            if version <= seen:
                continue
            resources |= touched_resources
            if changed is None:
                anything = True
            else:
                runs |= changed
        return (None if anything else sorted(runs)), resources

    @contextlib.contextmanager
    def showing_resources(self) -> Iterator[None]:
        """Held by a tab's event stream while its page shows controllers."""
        self._resource_tabs.value += 1
        try:
            yield
        finally:
            self._resource_tabs.value -= 1

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

    async def watch_resources(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """While a tab shows controllers, read ``controller.list`` every ``RESOURCES_POLL_S``
        and publish a change when what it lists differs from the last read (a host away is
        tried again at the next read: the run watch tells the tabs about it)."""
        task_status.started()
        last: bytes | None = None
        while True:
            if self._resource_tabs.value == 0:
                last = None  # nobody looked meanwhile: the next read is a new start
                await self._resource_tabs.wait_value(lambda tabs: tabs > 0)
            seen = await self._listing_digest()
            if seen is not None and last is not None and seen != last:
                self.publish(frozenset(), resources=True)
            last = seen or last
            await trio.sleep(RESOURCES_POLL_S)

    async def _listing_digest(self) -> bytes | None:
        """A digest of everything ``controller.list`` answers (None: the host did not answer)."""
        try:
            with trio.fail_after(10):
                async with AsyncClient(self.paths, client_id=f"{self.client_id}:resources") as client:
                    listing = _ok(await client.call("controller.list", payload={}))
        except (HostUnavailable, HostReplied, trio.TooSlowError, OSError):
            return None
        return hashlib.sha256(msgspec.json.encode(listing, order="sorted")).digest()


def _ok(response: Any) -> Any:
    if response.outcome not in ("accepted", "adopted"):
        raise HostReplied(response.outcome, response.error)
    return response.receipt
