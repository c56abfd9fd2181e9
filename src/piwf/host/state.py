"""What the branches of the host's nursery tree share."""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass, field
from typing import Any

import trio
import trio_util

from ..clock import Clock, WallClock
from ..paths import StatePaths
from ..store import Database
from ..store.hosts import HostClaim
from ..store.queue import Claim
from .catalog import Catalog
from .launcher import Launcher, SpawnLauncher

log = logging.getLogger("piwf.host")


@dataclass(frozen=True)
class HostConfig:
    state_dir: StatePaths
    max_workers: int = 4
    durability: str = "full"
    host_lease_ms: int = 30_000
    run_lease_ms: int = 30_000
    poll_s: float = 2.0
    worker_startup_s: float = 15.0
    kill_grace_s: float = 2.0
    crash_backoff_s: float = 0.5
    max_crashes: int = 5
    idle_timeout_s: float = 300.0
    max_connections: int = 64
    worker_env: dict[str, str] = field(default_factory=dict)
    worker_start: str = "fork"  # or "spawn"


@dataclass(eq=False)
class ActiveRun:
    """One run this host holds a claim on, with the scope that owns its worker."""

    claim: Claim
    worker_epoch: str
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    settled: bool = False
    stop_reason: str | None = None
    ready: trio.Event = field(default_factory=trio.Event)
    answered: set[str] = field(default_factory=set)  # message ids this host answered for the worker

    @property
    def run_id(self) -> str:
        return self.claim.run_id

    def stop(self, reason: str) -> None:
        """Cancel the run's scope: its worker is stopped and its outcome recorded."""
        if self.stop_reason is None:
            self.stop_reason = reason
        self.scope.cancel()


@dataclass(eq=False)
class Settlement:
    """How a worker ended and what to do with its run, kept until the store records it."""

    active: ActiveRun
    outcome: str
    result: Any  # WorkerExit | None
    park: bool
    detail: str | None


@dataclass(eq=False)
class CrashRecord:
    count: int
    not_before: float


@dataclass(eq=False)
class HostState:
    config: HostConfig
    db: Database
    clock: Clock = field(default_factory=WallClock)
    host_id: str = field(default_factory=lambda: "host-" + secrets.token_hex(6))
    lease: HostClaim | None = None
    catalog: Catalog = field(default_factory=Catalog)
    launcher: Launcher = field(default_factory=SpawnLauncher)
    active: dict[str, ActiveRun] = field(default_factory=dict)
    crashes: dict[str, CrashRecord] = field(default_factory=dict)
    unsettled: dict[str, Settlement] = field(default_factory=dict)
    connections: int = 0
    serving: bool = False
    stopping: bool = False
    wake_dispatcher: trio.Event = field(default_factory=trio.Event)
    run_changed: trio_util.RepeatedEvent = field(default_factory=trio_util.RepeatedEvent)
    stop_requested: trio.Event = field(default_factory=trio.Event)

    @property
    def epoch(self) -> int:
        assert self.lease is not None
        return self.lease.epoch

    def now(self) -> int:
        return self.clock.now_ms()

    def wake(self) -> None:
        self.wake_dispatcher.set()

    def changed(self) -> None:
        self.run_changed.set()
