"""The store interface: what the host calls, and all it knows of the store.

The host holds a ``Store`` and nothing else of the store: per-aggregate interfaces
(``store.runs``, ``store.queue``, ``store.workers``, ...; one ``typing.Protocol`` each, in
``runs``, ``people``, ``controllers`` and ``retention``), every method ``async``. A backend implements them
(``piwf.store.sqlite`` today; PostgreSQL later); the host imports no backend: the code that
starts a host or a CLI command opens one by name (``piwf.store.api.open_store``, which
imports the backend asked for) and hands the ``Store`` over.

Conventions every method keeps:

- **Time.** One clock decides every expiry, and no comparison mixes two: the caller's, on
  both backends — every method that compares or records a time takes ``now`` (integer ms)
  from its caller, so tests inject their clock. On PostgreSQL the hosts sharing a store
  each pass their own clock, which must be kept in step (NTP); no statement reads the
  database's clock.
- **Fences.** A method acting for a claim or a lease names it: the run claim's ``token``
  (and its ``generation`` where a worker speaks for one), a reconcile claim's ``token``, the
  host lease's ``epoch`` or ``HostClaim``. A fence is part of the write it guards (a
  conditional ``UPDATE ... WHERE claim_token = ?`` checked by its row count or
  ``RETURNING``), so it holds with many writers.
- **Errors.** One hierarchy, ``piwf.errors``, the same from every backend: ``ClaimLost`` (the
  claim is no longer live; nothing was changed), ``Conflict`` (a compare-and-set lost: a
  revision, a resource version, a settings change number), ``NotFound``, ``Rejected`` (the
  request cannot be carried out as it is), ``ConstraintViolation``, ``HostAlreadyRunning``
  (``hosts.acquire_lease``), and ``StorageUnavailable`` — the retry error: the storage failed
  (I/O, busy past the timeout, read-only); nothing was changed, retry once it is healthy —
  with ``StorageFull`` under it; ``StoreError`` is the root of the store's own. Each
  method's docstring lists the refusals it means; every method may raise
  ``StorageUnavailable`` and ``StoreError``.
- **Results** are plain values, the store's types (``piwf.store.api.types``) or the
  protocol's Structs the host answers with (to become store types; see the issue).

**Units of work.** Each method is one commit by itself. Changes that must commit together
(a command and its recorded answer, a worker message's changes and its worker's previous
answer) go in one unit of work the host opens explicitly::

    async with store.transaction() as tx:
        revision = await tx.queue.fenced_revision(run_id, token, now)   # the fence
        ...                                                             # the changes, on tx
        await tx.workers.record_message(previous, its_response, now)  # the worker's answer before

``tx`` has the same aggregates as the store. Leaving the block commits; an exception
rolls everything back and propagates. No host callback runs inside a store call.

A unit of work written as a function, ``await store.run_unit(work)``, is the same
``async with store.transaction() as tx: return await work(tx)`` — on SQLite exactly
that — but lets a backend run it in one go: PostgreSQL runs the whole of it (the
``BEGIN``, every call ``work`` makes on ``tx``, the ``COMMIT``) in one thread hop
instead of a hop per call. So ``work`` must await ``tx``'s methods and nothing else (no
trio call at all: on PostgreSQL it runs in a worker thread); one that awaits anything
else fails with ``StoreError`` and commits nothing. The host answers worker messages and
commands this way.

**Cancellation.** A store call that has started is never abandoned by a cancellation: it
commits or not, and the caller learns which. PostgreSQL runs each call in a worker thread,
shielded; its units of work run one at a time per store, as SQLite's do (other hosts'
run at once). SQLite runs inline on the trio loop: its
methods never checkpoint (``async def`` wrappers of synchronous calls: no thread hop), so
a cancellation cannot land inside one, nor inside a unit of work whose body awaits only
store methods. Inside a unit of work nothing may await a real checkpoint (a sleep, I/O,
another task): other tasks would run inside the open transaction. The SQLite backend
guards the worst of it: entering a second unit of work while one is open raises
``StoreError``. A backend that goes through threads (psycopg's async API) shields its calls
so a started one finishes. What the host records in cleanup still runs under its shielded,
bounded scope.

**Durability.** ``await store.durable()`` returns once everything committed so far is
durable; the host awaits it before every answer (a client's reply, reads too; a worker's).
``store.serve`` is the store's background work (SQLite: the group commit's fsync thread);
until it has started, commits are durable one by one and ``durable()`` returns at once.

**Where backends differ** (the conformance suite tests each as the interface says):

- The host lease: SQLite keeps one lease row per state directory, taken over by the host
  that holds the directory's flock (``owner_dead``); PostgreSQL keeps one lease row per host
  (per state directory, taken over the same way), and a host's epoch, from one sequence,
  numbers it among the hosts sharing the store. A takeover's ``expire_claims_before`` and
  ``orphan_before`` end what earlier epochs of *that* row held, never another live host's.
- Time: see above.
- Wake-ups: a store shared by several hosts (PostgreSQL) tells each what the others did
  (``announce`` / ``serve_wakeups``, LISTEN/NOTIFY), so a host acts without waiting for a
  poll; polling stays the fallback. SQLite has one host per store: both do nothing.
"""

from __future__ import annotations

import importlib
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol, TypeVar

import trio

from piwf.store.api.controllers import ControllerEffectsStore, ControllerQueueStore, ControllersStore
from piwf.store.api.people import DeliveryStore, InteractionsStore, SettingsStore, UpdatesStore
from piwf.store.api.retention import RetentionStore
from piwf.store.api.runs import (
    CommandsStore, EffectsStore, HostsStore, PlacementStore, QueueStore, RunsStore, SupervisionStore, WorkersStore,
)
from piwf.store.api.types import (
    Actor, Claim, CommandKey, ControllerClaim, Delay, HostClaim, HostRecord, LeaseRecord, NewScope, PeerRemains,
    Pruned, RunLaunch, Wakeup, WorkerEnded,
)

_T = TypeVar("_T")


class UnitOfWork(Protocol):
    """The aggregates, inside one open transaction (``Store.transaction``)."""

    hosts: HostsStore
    commands: CommandsStore
    runs: RunsStore
    queue: QueueStore
    supervision: SupervisionStore
    placement: PlacementStore
    workers: WorkersStore
    effects: EffectsStore
    interactions: InteractionsStore
    delivery: DeliveryStore
    updates: UpdatesStore
    settings: SettingsStore
    controllers: ControllersStore
    controller_queue: ControllerQueueStore
    controller_effects: ControllerEffectsStore
    retention: RetentionStore


class Store(UnitOfWork, Protocol):
    """A store: the aggregates (each call its own commit), units of work, durability."""

    def transaction(self) -> AbstractAsyncContextManager[UnitOfWork]:
        """A unit of work: ``async with store.transaction() as tx:`` — what is done on ``tx``
        commits together when the block ends, or not at all when it raises. Raises
        StoreError when one is open already (units of work do not nest), and
        StorageUnavailable when the transaction cannot begin."""
        ...

    async def run_unit(self, work: Callable[[UnitOfWork], Awaitable[_T]]) -> _T:
        """``await work(tx)`` as one unit of work, and what it returned: it commits when
        ``work`` returns, and nothing of it when it raises (the error propagates). ``work``
        awaits ``tx``'s methods only (PostgreSQL runs it, its begin and its commit in one
        thread hop); one that awaits anything else raises StoreError, nothing committed.
        Raises StoreError when a unit of work is open already, StorageUnavailable when the
        transaction cannot begin."""
        ...

    async def durable(self) -> None:
        """Return once everything committed so far is durable. Raises StorageUnavailable
        once an fsync failed (then nothing more is ever answered as durable)."""
        ...

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The store's background work, for a host's nursery; runs until cancelled (SQLite:
        from its start every commit waits for a shared fsync of the WAL, at ``full``
        durability). Start it once the takeover has committed."""
        ...

    def announce(self, topic: Wakeup) -> None:
        """Tell the other hosts sharing the store that ``topic`` may have work for them
        (call after the commit that made it). Never blocks and never fails: announcements
        are coalesced (at most one per topic in flight) and sent by ``serve_wakeups``; one
        lost is made up for by the other hosts' polls. SQLite: nothing (no other host)."""
        ...

    async def serve_wakeups(self, wake: Callable[[Wakeup], None], *,
                            task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Runs until cancelled: sends this host's announcements and calls ``wake(topic)``
        (on the trio loop) for each topic another host announced — and for every topic when
        announcements may have been missed (a listening connection lost and back). A
        backend without them (SQLite, or PostgreSQL in poll-only mode) just waits."""
        ...

    async def close(self) -> None:
        """Make what was committed durable and close the store. Never checkpoints on
        SQLite; call it shielded elsewhere."""
        ...


# Backends by name, each "module:function" (imported when a store is opened: nothing that
# imports the interface imports a backend). The PostgreSQL issue adds its own.
BACKENDS = {"sqlite": "piwf.store.sqlite.backend:open_store",
            "postgresql": "piwf.store.postgres.backend:open_store"}


def open_store(paths: Any, *, durability: str = "full", backend: str | None = None, url: str | None = None,
               **options: Any) -> Store:
    """Open the store of a state directory (``paths``: its ``StatePaths``): SQLite's database
    in it, or the store at ``url`` (``postgresql://...``: PostgreSQL). Each refuses a
    damaged store unwritten (CorruptStateError), a foreign, unknown or newer layout
    (SchemaError), and migrates an older one; StorageUnavailable when it cannot be reached."""
    if backend is None:
        backend = "sqlite" if url is None or url == "sqlite" else "postgresql"
    module, _, function = BACKENDS[backend].partition(":")
    if backend != "sqlite":
        options["url"] = url
    opened: Store = getattr(importlib.import_module(module), function)(paths, durability=durability, **options)
    return opened


__all__ = [
    "Actor", "Claim", "CommandKey", "CommandsStore", "ControllerClaim", "ControllerEffectsStore",
    "ControllerQueueStore", "ControllersStore", "Delay", "DeliveryStore", "EffectsStore", "HostClaim", "HostRecord",
    "HostsStore", "InteractionsStore", "LeaseRecord", "NewScope", "PeerRemains", "PlacementStore", "Pruned",
    "QueueStore", "RetentionStore", "RunLaunch", "RunsStore", "SettingsStore", "Store", "SupervisionStore",
    "UnitOfWork", "UpdatesStore", "Wakeup", "WorkerEnded", "WorkersStore", "open_store",
]
