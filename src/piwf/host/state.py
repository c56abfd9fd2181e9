"""What the branches of the host's nursery tree share."""

from __future__ import annotations

import dataclasses
import logging
import math
import secrets
from dataclasses import dataclass, field
from enum import Enum

import trio
import trio_util

from piwf.clock import Clock, WallClock
from piwf.paths import StatePaths
from piwf.status import StopReason, WorkerStatus
from piwf.store.api import Claim, HostClaim, Store
from piwf.host.catalog import Catalog
from piwf.host.controller_state import ControllerState
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
    worker_env: dict[str, str] = field(default_factory=dict)
    worker_start: str = "fork"  # or "spawn"
    listen_fd: int | None = None  # a listening socket passed by the service manager (LISTEN_FDS)
    notify_socket: str | None = None  # sd_notify's $NOTIFY_SOCKET: a path, or @name (abstract)
    watchdog_s: float | None = None  # the service's watchdog period ($WATCHDOG_USEC), pinged twice per period
    standby: bool = False  # wait for the host lock instead of refusing to start (piwf serve --standby)
    max_controller_workers: int = 4  # reconciles at once (DESIGN.md §9)
    controller_lease_ms: int = 120_000  # a reconcile's claim; renewed every quarter and on each worker message


class Conclusion(Enum):
    """What the host told a worker that ends its part in the run; a worker that exits
    without having been told one of these crashed, whatever its exit status."""

    DONE = "done"  # its part is done: its run completed, failed, or was parked by its own message
    STOP = "stop"  # stop at this node boundary (the run was paused)
    CLAIM_LOST = "claimLost"  # its claim moved on: nothing it writes is kept


@dataclass(frozen=True)
class ProcessEnd:
    """How a worker process ended: ``returncode`` negative for a signal, None if unknown."""

    returncode: int | None
    diagnostic: str
    started: bool = True  # False: no process was started at all

    @property
    def exit_code(self) -> int | None:
        return self.returncode if self.returncode is not None and self.returncode >= 0 else None

    @property
    def signal(self) -> int | None:
        return -self.returncode if self.returncode is not None and self.returncode < 0 else None

    def noted(self, note: str) -> ProcessEnd:
        """The same end with a line of piwf's own after what the worker printed."""
        return dataclasses.replace(self, diagnostic=f"{self.diagnostic}\n[piwf] {note}".lstrip("\n"))


@dataclass(eq=False)
class ActiveRun:
    """One run this host holds a claim on, with the scope that owns its worker.

    Stopping the run is cancelling ``scope`` with a ``StopReason``, kept with the scope
    (and given to trio, so a ``Cancelled`` says it too); the supervisor records it.
    """

    claim: Claim
    worker_epoch: str
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    ready: trio.Event = field(default_factory=trio.Event)
    answered: set[str] = field(default_factory=set)  # message ids this host answered for the worker
    conclusion: Conclusion | None = None
    process_end: ProcessEnd | None = None
    stop_reason: StopReason | None = None  # owned by ``scope``: the first reason it was cancelled with
    stop_note: str = ""  # what the worker's record should say about that reason

    @property
    def run_id(self) -> str:
        return self.claim.run_id

    def stop(self, reason: StopReason, note: str = "") -> None:
        """Cancel the run's scope: its worker is stopped and ``reason`` recorded (with
        ``note`` in its record). The first reason given wins."""
        if self.stop_reason is None:
            self.stop_reason, self.stop_note = reason, note
        self.scope.cancel(reason=reason.value)


@dataclass(eq=False)
class WorkerEnd:
    """How a worker ended and what to do with its run, kept until the store records it."""

    active: ActiveRun
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
    active: dict[str, ActiveRun] = field(default_factory=dict)
    backoff: dict[str, float] = field(default_factory=dict)  # run id -> not claimed before (trio time)
    unrecorded: dict[str, WorkerEnd] = field(default_factory=dict)  # ends the store refused (a full disk)
    connections: int = 0
    drain_deadline: float = math.inf  # set when a drain starts: every cleanup ends by then
    wake_dispatcher: trio.Event = field(default_factory=trio.Event)
    run_changed: trio_util.RepeatedEvent = field(default_factory=trio_util.RepeatedEvent)
    stop_requested: trio.Event = field(default_factory=trio.Event)
    wake_deadlines: trio.Event = field(default_factory=trio.Event)  # a request opened or went back to waiting
    controllers: ControllerState = field(default_factory=ControllerState)

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
        self.wake_dispatcher.set()

    def changed(self) -> None:
        self.run_changed.set()

    def interactions_changed(self) -> None:
        self.wake_deadlines.set()
