"""The SQLite store: one apsw connection, used inline on the trio loop.

``open_store`` opens the state database (refusing a damaged one unwritten) and returns a
``SqliteStore``; its aggregates (``aggregates.py``) call the module functions of this
package on its ``Database``. A unit of work is one ``BEGIN IMMEDIATE ... COMMIT``; the
functions called inside it join it (``Database.write`` nests).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, TypeVar

import trio

from piwf.errors import StoreError
from piwf.store.sqlite import hosts
from piwf.store.sql.aggregates import Aggregates
from piwf.store.sql.runner import Inline, drive
from piwf.store.sqlite.db import Database, _Write
from piwf.store.sqlite.group import GroupCommit

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from piwf.store import api
    from piwf.store.api.types import Wakeup
    from piwf.store.api.types import HostClaim, HostRecord, LeaseRecord, PeerRemains

_T = TypeVar("_T")


class SqliteStore(Aggregates):
    """``piwf.store.api.Store`` on one SQLite database. ``db`` is the backend's own (tests
    use it); the host must not. Its aggregates run their functions inline (``Inline``)."""

    def __init__(self, db: Database) -> None:
        super().__init__(Inline(db))
        self.db = db
        self.hosts: api.HostsStore = SqliteHostsStore(db)
        self.group: GroupCommit | None = None  # set by serve: from then on commits share fsyncs
        self.in_unit_of_work = False

    def transaction(self) -> _UnitOfWork:
        return _UnitOfWork(self)

    async def run_unit(self, work: Callable[[api.UnitOfWork], Awaitable[_T]]) -> _T:
        async with _UnitOfWork(self) as tx:  # driven here, as PostgreSQL drives it in its thread
            result = drive(work(tx))
        return result

    async def durable(self) -> None:
        if self.group is not None:
            await self.group.durable()

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        if self.group is None:
            self.group = GroupCommit(self.db)
        await self.group.serve(task_status=task_status)

    def announce(self, topic: Wakeup) -> None:
        return None  # one host per SQLite store: nobody else to tell

    async def serve_wakeups(self, wake: Callable[[Wakeup], None], *,
                            task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        await trio.sleep_forever()

    async def close(self) -> None:
        self.db.close()

    @property
    def fsyncs(self) -> int:
        """Statistics: how many groups of commits were fsynced."""
        return 0 if self.group is None else self.group.fsyncs


class SqliteHostsStore:
    __slots__ = ("db",)

    def __init__(self, db: Database) -> None:
        self.db = db

    async def read_lease(self) -> LeaseRecord:
        return hosts.read_lease(self.db)

    async def acquire_lease(
            self, *, host_id: str, pid: int, identity: str, lease_ms: int, now: int, owner_dead: bool = False,
    ) -> HostClaim:
        return hosts.acquire_lease(
            self.db, host_id=host_id, pid=pid, identity=identity, lease_ms=lease_ms, now=now, owner_dead=owner_dead)

    async def renew_lease(self, claim: HostClaim, lease_ms: int, now: int) -> HostClaim | None:
        return hosts.renew_lease(self.db, claim, lease_ms, now)

    async def release_lease(self, claim: HostClaim) -> bool:
        return hosts.release_lease(self.db, claim)

    async def live_hosts(self, now: int) -> list[HostRecord]:
        return hosts.live_hosts(self.db, now)

    async def peers(self) -> list[HostRecord]:
        return []  # one host per state directory, and its database is its own

    async def record_standby(self, *, pid: int, identity: str, lease_ms: int, now: int) -> None:
        return None  # its standbys are files in the state directory (host/standby-PID.json)

    async def forget_standby(self, pid: int) -> None:
        return None

    async def take_over_peer(self, peer: HostRecord, now: int) -> PeerRemains | None:
        return None

    async def expire_peer_claims(self, epoch: int, now: int) -> tuple[list[str], int]:
        return [], 0


class _UnitOfWork:
    """``SqliteStore.transaction()``: the store itself is the unit of work's ``tx`` (its
    aggregates' calls join the open transaction). A class, not a generator: one per worker
    message."""

    __slots__ = ("store", "write")

    def __init__(self, store: SqliteStore) -> None:
        self.store = store
        self.write: _Write | None = None

    async def __aenter__(self) -> SqliteStore:
        store = self.store
        if store.in_unit_of_work:
            raise StoreError("a unit of work is open already: units of work do not nest, and nothing awaits "
                             "a checkpoint inside one")
        self.write = write = store.db.write()
        write.__enter__()
        store.in_unit_of_work = True
        return store

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> bool:
        self.store.in_unit_of_work = False
        assert self.write is not None
        self.write.__exit__(exc_type, exc, tb)
        return False


def open_store(paths: Any, *, durability: str = "full") -> SqliteStore:
    """Open (creating if absent) the state database for a host: ``paths`` is the state
    directory's ``StatePaths`` (its ``db``) or the database's path. After an unclean stop
    the file is checked read-only first (``hosts.open_state``)."""
    path: str | os.PathLike[str] = getattr(paths, "db", paths)
    return SqliteStore(hosts.open_state(path, durability=durability))


if TYPE_CHECKING:  # the type checker proves SqliteStore implements the interface
    def _implements(store: SqliteStore) -> api.Store:
        return store
