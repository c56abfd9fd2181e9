"""What a supervision lane holds (host/lane.py): its active work, each with the scope that
owns its worker, and the ends the store refused, kept until they are recorded.

A lane is runs or reconciles; the types here are the same for both, parameterised by the
claim (a run's ``Claim``, a resource's ``ControllerClaim``).
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Generic, Protocol, TypeVar

import trio

from piwf.status import StopReason


class WorkClaim(Protocol):
    """What the lane needs of a claim: the token its writes name, a label. (Each lane's own
    code reads the claim's number: a run's ``Claim.generation``, a reconcile's
    ``ControllerClaim.claim_number``.)"""

    @property
    def token(self) -> str: ...

    @property
    def label(self) -> str: ...


C = TypeVar("C", bound=WorkClaim)


class Conclusion(Enum):
    """What the host told a worker that ends its part; a worker that exits without having
    been told one of these crashed, whatever its exit status."""

    DONE = "done"  # its part is done: its run ended or was parked by its own message; its reconcile reported
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


@dataclass(frozen=True)
class NodeClock:
    """A node whose attempt runs under a time limit, enforced by the pump."""

    attempt_id: str
    node: str
    limit_s: float
    timeout_exit: bool  # at the limit the node leaves through `timeout` (else it fails)
    validating: bool  # an ask's submission is being validated: at the limit it is refused
    deadline: float  # trio time
    by_host: bool = False  # the host's limit (serve --node-time-limit), shorter than the node's own

    @property
    def limit_text(self) -> str:
        return f"{'the host' if self.by_host else 'its'} time limit of {self.limit_s:g} s"


@dataclass(eq=False)
class Active(Generic[C]):
    """One piece of work this host holds a claim on (a run, or a resource's reconcile),
    with the scope that owns its worker.

    Stopping it is cancelling ``scope`` with a ``StopReason``, kept with the scope (and
    given to trio, so a ``Cancelled`` says it too); the supervisor records it.
    """

    claim: C
    worker_id: str
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    ready: trio.Event = field(default_factory=trio.Event)
    answered: set[str] = field(default_factory=set)  # message ids this host answered for the worker
    last_answer: Any = None  # a run's latest (message, answer), stored with its next (host/worker_messages.py)
    conclusion: Conclusion | None = None
    process_end: ProcessEnd | None = None
    stop_reason: StopReason | None = None  # owned by ``scope``: the first reason it was cancelled with
    stop_note: str = ""  # what the worker's record should say about that reason
    pid: int | None = None  # the worker process, once started
    identity: str = ""  # its start identity (a run's is recorded with its worker.ready)
    registered: bool = False  # it asked to register a process group: its end looks for groups to kill
    limits: dict[str, Any] = field(default_factory=dict)  # node -> its time limit (a run's NodeLimit)
    node_clock: NodeClock | None = None  # the attempt running under a time limit, if any
    timeout_s: float | None = None  # once ready, how long the worker may take (a reconcile's controller timeout)
    spec_generation: int = 0  # a reconcile: the resource generation its worker was shown
    warm: Any = None  # a run: its WarmTicket (host/warm.py), what a warm worker may serve
    output: Any = None  # its Diagnostics (host/worker_process.py): what it printed so far
    end_recorded: str | None = None  # a run's: recorded with the message that ended its run, with this output
    run_ended: bool = False  # a run's: that message completed or failed it (host/worker_messages.py)
    good_until: float = math.inf  # trio time until which its claim is vouched for (host/fence.py)
    unrenewed: bool = False  # stopped by the fence: its claim could not be renewed in time
    kill: Callable[[], object] | None = None  # SIGKILL its worker's group, while the worker is unreaped
    groups: dict[int, str] = field(default_factory=dict)  # process groups it registered: pid -> identity

    @property
    def label(self) -> str:
        """What logs call it: ``run <id>``, ``resource <controller>/<key>``."""
        return self.claim.label

    def stop(self, reason: StopReason, note: str = "") -> None:
        """Cancel the scope: the worker is stopped and ``reason`` recorded (with ``note`` in
        its record). The first reason given wins."""
        if self.stop_reason is None:
            self.stop_reason, self.stop_note = reason, note
        self.scope.cancel(reason=reason.value)


@dataclass(eq=False)
class End(Generic[C]):
    """A worker's end as its lane records it; kept until the store takes it."""

    active: Active[C]


E = TypeVar("E", bound="End[Any]")


@dataclass(eq=False)
class LaneState(Generic[C, E]):
    """A lane's active work by key (run id, resource uid), the ends the store refused
    (retried each dispatcher round), and the dispatcher's wake-up."""

    active: dict[str, Active[C]] = field(default_factory=dict)
    unrecorded: dict[str, E] = field(default_factory=dict)
    wake_event: trio.Event = field(default_factory=trio.Event)
    # also called by wake(): tells the other hosts sharing the store (HostState sets it)
    announce: Callable[[], None] | None = None
    # Stops of work whose claim committed while the dispatcher had not yet taken it up (its
    # claim round still awaiting the store): applied as it does, at the end of that round.
    early_stops: dict[str, StopReason] = field(default_factory=dict)
    # Set to have the claim renewer look now (a client ended claimed work, maybe on another host).
    recheck: trio.Event = field(default_factory=trio.Event)

    def stop(self, key: str, reason: StopReason) -> None:
        """Stop the active work of ``key``; or, if it is not active here yet, as soon as the
        claim round in flight takes it up (a stop for work of no claim is forgotten then)."""
        active = self.active.get(key)
        if active is not None:
            active.stop(reason)
        else:
            self.early_stops[key] = reason

    def wake(self) -> None:
        """Wake this lane's dispatcher, and the other hosts' (work may be theirs to take)."""
        self.wake_event.set()
        if self.announce is not None:
            self.announce()

    def check_claims(self) -> None:
        """Renew (and so check) every claim now: work whose claim is gone is stopped."""
        self.recheck.set()

    def woken(self) -> None:
        """Another host announced work: wake the dispatcher only (announcing it again
        would echo between the hosts)."""
        self.wake_event.set()


@dataclass(frozen=True)
class Backoff:
    """The one back-off policy of both lanes: ``base_ms·2^min(n, max_exponent)`` for a
    failure after ``n`` in a row, at most ``max_ms``, less up to ``jitter`` of it (drawn
    from ``random``, so the retries of many spread out)."""

    base_ms: float
    max_ms: int = 60_000
    max_exponent: int = 62
    jitter: float = 0.0
    random: random.Random | None = None

    def delay_ms(self, failures_before: int) -> int:
        delay = min(self.max_ms, self.base_ms * 2 ** min(failures_before, self.max_exponent))
        if self.jitter and self.random is not None:
            delay *= 1 - self.jitter * self.random.random()
        return int(delay)
