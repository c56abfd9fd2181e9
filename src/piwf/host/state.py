"""What the branches of the host's nursery tree share."""

from __future__ import annotations

import contextvars
import functools
import logging
import math
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

import trio
import trio_util

from piwf.clock import Clock, WallClock
from piwf.errors import PiwfError
from piwf.paths import StatePaths
from piwf.status import DEFAULT_QUEUE, WorkerStatus
from piwf.store.api import Claim, HostClaim, Store, UnitOfWork, Wakeup
from piwf.store.api.rules import RETENTION_MS
from piwf.host.catalog import Catalog
from piwf.host.controller_state import ControllerState
from piwf.host.lane_state import Active, Conclusion, End, LaneState, NodeClock, ProcessEnd
from piwf.host.launcher import Launcher, SpawnLauncher
from piwf.host.warm import WarmPool

log = logging.getLogger("piwf.host")


@dataclass(frozen=True)
class HostConfig:
    state_dir: StatePaths
    max_workers: int = 4
    queues: tuple[str, ...] = (DEFAULT_QUEUE,)  # the named queues whose runs this host claims (piwf serve --queue)
    durability: str = "full"
    store_url: str | None = None  # a postgresql:// URL (piwf serve --store); None: the state directory's SQLite
    store_listen: bool = True  # False: poll-only, no LISTEN (piwf serve --poll-only, for poolers in transaction mode)
    host_lease_ms: int = 30_000
    run_lease_ms: int = 30_000
    presentation_lease_ms: int = 10_000  # a client presenting an interaction request holds it this long
    delivery_lease_ms: int = 10_000  # a client delivering a notification or a turn holds it this long
    poll_s: float = 2.0
    worker_startup_s: float = 15.0
    kill_grace_s: float = 2.0
    drain_timeout_s: float = 15.0
    crash_backoff_s: float = 0.5
    node_time_limit_s: float | None = None  # every node's attempt at most this long (piwf serve --node-time-limit)
    max_crashes: int = 5
    idle_timeout_s: float = 300.0  # a connection between requests
    request_timeout_s: float = 10.0  # a request line, from its first byte to its newline
    reply_timeout_s: float = 10.0  # a reply, to leave: a client that does not read is disconnected
    max_connections: int = 64
    socket_check_s: float = 1.0  # between looks at the socket's path: a deleted socket is bound again
    worker_env: dict[str, str] = field(default_factory=dict)
    worker_start: str = "fork"  # or "spawn"
    worker_nice: int = 10  # a run's worker executes its nodes this much nicer than the host (piwf serve --worker-nice)
    listen_fd: int | None = None  # a listening socket passed by the service manager (LISTEN_FDS)
    notify_socket: str | None = None  # sd_notify's $NOTIFY_SOCKET: a path, or @name (abstract)
    watchdog_s: float | None = None  # the service's watchdog period ($WATCHDOG_USEC), pinged twice per period
    standby: bool = False  # wait for the host lock instead of refusing to start (piwf serve --standby)
    max_controller_workers: int = 4  # reconciles at once (DESIGN.md §9)
    controller_lease_ms: int = 120_000  # a reconcile's claim; renewed every quarter and on each worker message
    retain_ms: int | None = None  # piwf serve --retain: ended runs are deleted this long after they ended
    command_retention_ms: int = RETENTION_MS  # logged commands (a retry within it is answered from the log)
    prune_interval_s: float = 3600.0  # how often the command log (and what was delivered) is pruned
    fence: bool | None = None  # stop work whose claim could not be renewed in time (host/fence.py); None: on a
    #                            store several hosts share (PostgreSQL)


ActiveRun = Active[Claim]


class Changes:
    """A count of changes, and a wait for the next one: ``wait(after=n)`` returns once the
    count has passed ``n``, so a change between reading the count and waiting is not lost."""

    __slots__ = ("_event", "count")

    def __init__(self) -> None:
        self.count = 0
        self._event = trio.Event()

    def set(self) -> None:
        self.count += 1
        self._event.set()
        self._event = trio.Event()

    async def wait(self, after: int | None = None) -> None:
        """Until the count passes ``after`` (default: the count now, i.e. the next change)."""
        after = self.count if after is None else after
        while self.count <= after:
            await self._event.wait()


@dataclass(eq=False)
class WorkerEnd(End[Claim]):
    """How a run's worker ended and what to do with its run, kept until the store records it."""

    status: WorkerStatus
    process: ProcessEnd
    park: bool
    over_limit: NodeClock | None = None  # stopped at its node's time limit: the node's outcome is recorded too
    amend: bool = False  # recorded with the message that ended its run, ended otherwise than presumed there


_T = TypeVar("_T")
_UNIT_NOW: contextvars.ContextVar[int | None] = contextvars.ContextVar("unit_now", default=None)


@dataclass(eq=False)
class HostState:
    config: HostConfig
    store: Store
    clock: Clock = field(default_factory=WallClock)
    host_id: str = field(default_factory=lambda: "host-" + secrets.token_hex(6))
    lease: HostClaim | None = None
    catalog: Catalog = field(default_factory=Catalog)
    launcher: Launcher = field(default_factory=SpawnLauncher)
    runs: LaneState[Claim, WorkerEnd] = field(default_factory=LaneState)  # the run lane: active runs, ...
    warm: WarmPool = field(default_factory=WarmPool)  # idle warm workers (reuse_worker), kept by the run lane
    connections: int = 0
    drain_deadline: float = math.inf  # set when a drain starts: every cleanup ends by then
    run_changed: Changes = field(default_factory=lambda: Changes())
    stop_requested: trio.Event = field(default_factory=trio.Event)
    stopped_on: PiwfError | None = None  # why the host stopped itself, raised once it has drained (its exit code)
    wake_deadlines: trio.Event = field(default_factory=trio.Event)  # a request opened or went back to waiting
    controllers: ControllerState = field(default_factory=ControllerState)
    lease_good_until: float = math.inf  # trio time until which the host lease is vouched for (host/fence.py)
    fence_changed: trio_util.RepeatedEvent = field(default_factory=trio_util.RepeatedEvent)

    @property
    def fenced(self) -> bool:
        """Whether work is stopped once its claim could not be renewed in time: on a store
        other hosts share (another could claim the work once its claim expires)."""
        fence = self.config.fence
        return self.config.store_url is not None if fence is None else fence

    @property
    def active(self) -> dict[str, ActiveRun]:
        """The runs this host supervises, by run id."""
        return self.runs.active

    @property
    def epoch(self) -> int:
        assert self.lease is not None
        return self.lease.epoch

    def now(self) -> int:
        frozen = _UNIT_NOW.get()
        return self.clock.now_ms() if frozen is None else frozen

    async def run_unit(self, work: Callable[[UnitOfWork], Awaitable[_T]]) -> _T:
        """``store.run_unit(work)`` with the time read once, as it starts: every ``now()``
        in ``work`` is that (on PostgreSQL ``work`` runs in a worker thread, where a clock
        tied to trio's, as tests use, cannot be read)."""
        token = _UNIT_NOW.set(self.clock.now_ms())
        try:
            return await self.store.run_unit(work)
        finally:
            _UNIT_NOW.reset(token)

    async def durable(self) -> None:
        """Return once everything committed so far is durable: before any answer."""
        await self.store.durable()

    def __post_init__(self) -> None:
        self.runs.announce = functools.partial(self.store.announce, Wakeup.RUNS)
        self.controllers.announce = functools.partial(self.store.announce, Wakeup.CONTROLLERS)

    def wake(self) -> None:
        """Wake the run dispatcher (and the other hosts sharing the store)."""
        self.runs.wake()

    def changed(self) -> None:
        """Wake the watchers (run.watch, run.wait) here and on the other hosts."""
        self.run_changed.set()
        self.store.announce(Wakeup.CHANGES)

    def interactions_changed(self) -> None:
        self.wake_deadlines.set()
        self.store.announce(Wakeup.DEADLINES)

    def claims_changed(self) -> None:
        """A claimed run (or resource) was ended by a client, whichever host holds its claim:
        that host checks its claims now instead of at its next renewal, and stops the work
        whose claim is gone (host/lane.py ``renew_claims``)."""
        self.runs.check_claims()
        self.controllers.check_claims()
        self.store.announce(Wakeup.CLAIMS)

    def woken(self, topic: Wakeup) -> None:
        """Another host sharing the store announced ``topic``: wake what acts on it here,
        without announcing it again."""
        if topic is Wakeup.RUNS:
            self.runs.woken()
        elif topic is Wakeup.CONTROLLERS:
            self.controllers.woken()
        elif topic is Wakeup.CHANGES:
            self.run_changed.set()
        elif topic is Wakeup.CLAIMS:
            self.runs.check_claims()
            self.controllers.check_claims()
        else:
            self.wake_deadlines.set()


__all__ = ["Active", "ActiveRun", "Conclusion", "HostConfig", "HostState", "ProcessEnd", "WorkerEnd", "log"]
