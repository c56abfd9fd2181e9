"""What the branches of the host's nursery tree share."""

from __future__ import annotations

import logging
import math
import secrets
from dataclasses import dataclass, field

import trio
import trio_util

from piwf.clock import Clock, WallClock
from piwf.paths import StatePaths
from piwf.status import WorkerStatus
from piwf.store.api import Claim, HostClaim, Store
from piwf.host.catalog import Catalog
from piwf.host.controller_state import ControllerState
from piwf.host.lane_state import Active, Conclusion, End, LaneState, ProcessEnd
from piwf.host.launcher import Launcher, SpawnLauncher

log = logging.getLogger("piwf.host")


@dataclass(frozen=True)
class HostConfig:
    state_dir: StatePaths
    max_workers: int = 4
    durability: str = "full"
    host_lease_ms: int = 30_000
    run_lease_ms: int = 30_000
    presentation_lease_ms: int = 10_000  # a client presenting an interaction request holds it this long
    delivery_lease_ms: int = 10_000  # a client delivering a notification or a turn holds it this long
    poll_s: float = 2.0
    worker_startup_s: float = 15.0
    kill_grace_s: float = 2.0
    drain_timeout_s: float = 15.0
    crash_backoff_s: float = 0.5
    max_crashes: int = 5
    idle_timeout_s: float = 300.0  # a connection between requests
    request_timeout_s: float = 10.0  # a request line, from its first byte to its newline
    reply_timeout_s: float = 10.0  # a reply, to leave: a client that does not read is disconnected
    max_connections: int = 64
    socket_check_s: float = 1.0  # between looks at the socket's path: a deleted socket is bound again
    worker_env: dict[str, str] = field(default_factory=dict)
    worker_start: str = "fork"  # or "spawn"
    listen_fd: int | None = None  # a listening socket passed by the service manager (LISTEN_FDS)
    notify_socket: str | None = None  # sd_notify's $NOTIFY_SOCKET: a path, or @name (abstract)
    watchdog_s: float | None = None  # the service's watchdog period ($WATCHDOG_USEC), pinged twice per period
    standby: bool = False  # wait for the host lock instead of refusing to start (piwf serve --standby)
    max_controller_workers: int = 4  # reconciles at once (DESIGN.md §9)
    controller_lease_ms: int = 120_000  # a reconcile's claim; renewed every quarter and on each worker message


ActiveRun = Active[Claim]


@dataclass(eq=False)
class WorkerEnd(End[Claim]):
    """How a run's worker ended and what to do with its run, kept until the store records it."""

    status: WorkerStatus
    process: ProcessEnd
    park: bool


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
    connections: int = 0
    drain_deadline: float = math.inf  # set when a drain starts: every cleanup ends by then
    run_changed: trio_util.RepeatedEvent = field(default_factory=trio_util.RepeatedEvent)
    stop_requested: trio.Event = field(default_factory=trio.Event)
    wake_deadlines: trio.Event = field(default_factory=trio.Event)  # a request opened or went back to waiting
    controllers: ControllerState = field(default_factory=ControllerState)

    @property
    def active(self) -> dict[str, ActiveRun]:
        """The runs this host supervises, by run id."""
        return self.runs.active

    @property
    def epoch(self) -> int:
        assert self.lease is not None
        return self.lease.epoch

    def now(self) -> int:
        return self.clock.now_ms()

    async def durable(self) -> None:
        """Return once everything committed so far is durable: before any answer."""
        await self.store.durable()

    def wake(self) -> None:
        """Wake the run dispatcher."""
        self.runs.wake()

    def changed(self) -> None:
        self.run_changed.set()

    def interactions_changed(self) -> None:
        self.wake_deadlines.set()


__all__ = ["Active", "ActiveRun", "Conclusion", "HostConfig", "HostState", "ProcessEnd", "WorkerEnd", "log"]
