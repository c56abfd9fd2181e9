"""What the controller branch of the nursery tree keeps: its active reconciles and their
scopes, the dispatcher's wake-up, and the randomness of the back-off jitter (injectable)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import trio

from piwf.store.api import ControllerClaim

MAX_BACKOFF_MS = 60_000
BACKOFF_BASE_MS = 1_000
JITTER = 0.1  # a delay is cut by up to this fraction, so retries of many resources spread out


class ReconcileStop(StrEnum):
    """Why a reconcile's scope was cancelled."""

    CLAIM_LOST = "claimLost"
    HOST_STOPPING = "hostStopping"
    STARTUP_TIMEOUT = "startupTimeout"
    TIMEOUT = "reconcileTimeout"
    PROTOCOL = "protocolError"
    LINGERING = "lingering"


@dataclass(eq=False)
class ActiveReconcile:
    """One reconcile this host holds a claim for, with the scope that owns its worker
    (the same shape ``worker_process.run_worker`` supervises for a run)."""

    claim: ControllerClaim
    worker_epoch: str
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    ready: trio.Event = field(default_factory=trio.Event)
    conclusion: Any = None  # a worker_process Conclusion, once its result is recorded or its claim lost
    process_end: Any = None
    stop_reason: ReconcileStop | None = None
    stop_note: str = ""
    spec_generation: int = 0  # the resource generation the worker was shown
    timeout_s: float = 60.0

    @property
    def run_id(self) -> str:  # what supervision logs call it
        return f"resource {self.claim.controller}/{self.claim.key}"

    @property
    def uid(self) -> str:
        return self.claim.uid

    def stop(self, reason: ReconcileStop, note: str = "") -> None:
        if self.stop_reason is None:
            self.stop_reason, self.stop_note = reason, note
        self.scope.cancel(reason=reason.value)


@dataclass(eq=False)
class ControllerState:
    active: dict[str, ActiveReconcile] = field(default_factory=dict)
    wake_event: trio.Event = field(default_factory=trio.Event)
    random: random.Random = field(default_factory=random.Random)

    def wake(self) -> None:
        self.wake_event.set()

    def backoff_ms(self, errors_before: int) -> int:
        """``min(60 s, 1 s·2^min(n, 6))`` for the n-th failure in a row (n counted before
        it, so the first waits about 1 s), less up to 10 % jitter."""
        base = min(MAX_BACKOFF_MS, BACKOFF_BASE_MS * 2 ** min(errors_before, 6))
        return int(base * (1 - JITTER * self.random.random()))
