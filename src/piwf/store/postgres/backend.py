"""The PostgreSQL store: a psycopg-pool of sync connections, each store call in a worker
thread.

psycopg's async API is asyncio's only; its sync API in trio's worker threads keeps the loop
free (bench/measure_pg.py compares the ways: a store call on the loop in a greenlet, its
socket waits awaited by trio, cost less CPU per call but halved a host's runs per second).

Each aggregate call runs its module function in a thread (``Threaded``), shielded: a call
that has started finishes, and its caller learns whether it committed. A call made
outside a unit of work takes a connection from the pool for itself; inside one
(``store.transaction()``, in the task that opened it) every call, on ``tx`` or on the
store, runs on the unit of work's connection, one after the other, so it joins the open
transaction as on SQLite (the first one begins it).
"""

from __future__ import annotations

import contextvars
import functools
import os
import secrets
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

import psycopg
import trio
from psycopg import sql
from psycopg_pool import ConnectionPool, PoolTimeout

from piwf.errors import StorageUnavailable, StoreError
from piwf.store.postgres import hosts, layout, peers
from piwf.store.postgres.db import PgDatabase, translate_error
from piwf.store.postgres.url import Limits, StoreUrl, parse
from piwf.store.postgres.wakeups import Wakeups, channel_for
from piwf.store.sql import peers as peer_claims
from piwf.store.sql.aggregates import Aggregates
from piwf.store.sql.runner import drive

from piwf.store.api.types import LeaseRecord

if TYPE_CHECKING:
    import outcome  # trio's own

    from piwf.store import api
    from piwf.store.api.types import HostClaim, HostRecord, PeerRemains, Wakeup
    from piwf.store.sql.database import Database

_T = TypeVar("_T")
_P = ParamSpec("_P")

# synchronous_commit per --durability: 'full' waits for the WAL flush of every commit;
# 'normal' answers before it (a server crash may lose the last commits, never corrupts).
SYNCHRONOUS_COMMIT = {"full": "on", "normal": "off"}
DIRECTORY_FILE = "store-host-id"


class PgStore(Aggregates):
    """``piwf.store.api.Store`` on PostgreSQL (one schema of one database)."""

    def __init__(self, pool: ConnectionPool[Any], url: StoreUrl, directory: str, *, listen: bool = True) -> None:
        self.pool = pool
        self.url = url
        self.where = url.redacted
        self.current: contextvars.ContextVar[_UnitOfWork | None] = contextvars.ContextVar("unit_of_work", default=None)
        # Set only in the worker thread of a ``run_unit``: its connection, which calls use at once.
        self.inline: contextvars.ContextVar[PgDatabase | None] = contextvars.ContextVar("inline", default=None)
        self.limiter = trio.CapacityLimiter(pool.max_size)
        # One unit of work at a time per store (per host), as on SQLite, where a unit of work
        # is atomic to the host's other tasks: the host's code is written to that. Hosts
        # sharing the store still run theirs at once; calls outside one need no turn.
        self.turn = trio.Lock()
        self.call = Threaded(self)
        super().__init__(self.call)
        self.hosts: api.HostsStore = PgHostsStore(self.call, directory)
        self.wakeups = Wakeups(self._connect_autocommit, channel_for(url.schema), listen=listen)

    def transaction(self) -> _UnitOfWork:
        return _UnitOfWork(self)

    async def run_unit(self, work: Callable[[api.UnitOfWork], Awaitable[_T]]) -> _T:
        """The whole unit of work in one thread hop (``_unit_in_thread``), in its turn."""
        if self.current.get() is not None or self.inline.get() is not None:
            raise StoreError("a unit of work is open already: units of work do not nest")
        async with self.turn:
            return await self.in_thread(functools.partial(self._unit_in_thread, work))

    def _unit_in_thread(self, work: Callable[[api.UnitOfWork], Awaitable[_T]]) -> _T:
        """In the worker thread: a connection, ``BEGIN``, ``work`` driven to its end with
        every call inline on that connection, then ``COMMIT`` (``ROLLBACK`` when it raised)."""
        db = self.connection()
        try:
            db.begin()
            token = self.inline.set(db)
            try:
                result = drive(work(self))
            finally:
                self.inline.reset(token)
        except BaseException:
            try:
                db.finish(commit=False)
            finally:
                self.give_back(db)
            raise
        try:
            db.finish(commit=True)
        finally:
            self.give_back(db)
        return result

    async def durable(self) -> None:
        return  # a commit is as durable as synchronous_commit made it when it returned

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        await trio.sleep_forever()

    def announce(self, topic: Wakeup) -> None:
        self.wakeups.announce(topic)

    async def serve_wakeups(self, wake: Callable[[Wakeup], None], *,
                            task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        await self.wakeups.serve(wake, task_status=task_status)

    def _connect_autocommit(self) -> psycopg.Connection[Any]:
        conn = psycopg.connect(self.url.conninfo, autocommit=True, **self.url.connect_kwargs)
        conn.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(self.url.schema)))
        return conn

    async def close(self) -> None:
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(self.wakeups.flush)  # what a stopping host released
            await trio.to_thread.run_sync(self.pool.close)

    def connection(self) -> PgDatabase:
        """A connection from the pool (``give_back`` returns it). StorageUnavailable when
        none comes within the pool's timeout (the server is down or every one is busy)."""
        try:
            conn = self.pool.getconn()
        except PoolTimeout as exc:
            raise StorageUnavailable(f"no connection to the PostgreSQL store {self.where}: {exc}; retry") from exc
        return PgDatabase(conn, self.where, self.url.schema)

    def give_back(self, db: PgDatabase) -> None:
        self.pool.putconn(db.conn)

    def on_own_connection(self, function: Callable[..., _T], args: Any, kwargs: Any) -> _T:
        db = self.connection()
        try:
            return function(db, *args, **kwargs)
        finally:
            self.give_back(db)

    async def in_thread(self, work: Callable[[], _T]) -> _T:
        """``work`` in a worker thread of trio's cache, at most the pool's size at once; once
        started it finishes (a cancellation waits for it, then comes at the caller's next
        checkpoint, as in a shielded scope). ``trio.lowlevel.start_thread_soon`` itself:
        ``trio.to_thread.run_sync``'s own machinery (its thread names, cancel scope and
        limiter bookkeeping) cost 40 to 70 µs of CPU more per call here (bench/measure_pg.py)."""
        async with self.limiter:
            task, token = trio.lowlevel.current_task(), trio.lowlevel.current_trio_token()
            run = contextvars.copy_context().run

            def deliver(result: outcome.Outcome[_T]) -> None:  # in the worker thread
                token.run_sync_soon(trio.lowlevel.reschedule, task, result)

            trio.lowlevel.start_thread_soon(lambda: run(work), deliver)
            done: _T = await trio.lowlevel.wait_task_rescheduled(lambda _: trio.lowlevel.Abort.FAILED)
        return done


class Threaded:
    """PostgreSQL's runner: the function runs in a worker thread, on the connection of the
    unit of work this task has open, else on one of its own from the pool."""

    __slots__ = ("store",)

    def __init__(self, store: PgStore) -> None:
        self.store = store

    async def __call__(self, function: Callable[Concatenate[Database, _P], _T], /, *args: _P.args,
                       **kwargs: _P.kwargs) -> _T:
        store = self.store
        db = store.inline.get()
        if db is not None:  # in the worker thread of a run_unit: on its connection, at once
            return function(db, *args, **kwargs)
        unit = store.current.get()
        if unit is not None:
            return await store.in_thread(lambda: unit.run(function, args, kwargs))
        return await store.in_thread(lambda: store.on_own_connection(function, args, kwargs))


class PgHostsStore:
    __slots__ = ("call", "directory")

    def __init__(self, call: Threaded, directory: str) -> None:
        self.call = call
        self.directory = directory

    async def read_lease(self) -> LeaseRecord:
        return await self.call(hosts.read_lease, self.directory)

    async def acquire_lease(
            self, *, host_id: str, pid: int, identity: str, lease_ms: int, now: int, owner_dead: bool = False,
    ) -> HostClaim:
        return await self.call(hosts.acquire_lease, self.directory, host_id=host_id, pid=pid, identity=identity,
                               lease_ms=lease_ms, now=now, owner_dead=owner_dead)

    async def renew_lease(self, claim: HostClaim, lease_ms: int, now: int) -> HostClaim | None:
        return await self.call(hosts.renew_lease, self.directory, claim, lease_ms, now)

    async def release_lease(self, claim: HostClaim) -> bool:
        return await self.call(hosts.release_lease, self.directory, claim)

    async def live_hosts(self, now: int) -> list[HostRecord]:
        return await self.call(peers.live_hosts, now)

    async def peers(self) -> list[HostRecord]:
        return await self.call(peers.others, self.directory)

    async def record_standby(self, *, pid: int, identity: str, lease_ms: int, now: int) -> None:
        return await self.call(peers.record_standby, self.directory, pid=pid, identity=identity, lease_ms=lease_ms,
                               now=now)

    async def forget_standby(self, pid: int) -> None:
        return await self.call(peers.forget_standby, self.directory, pid)

    async def take_over_peer(self, peer: HostRecord, now: int) -> PeerRemains | None:
        return await self.call(peers.take_over, peer, now)

    async def expire_peer_claims(self, epoch: int, now: int) -> tuple[list[str], int]:
        return await self.call(peer_claims.expire_claims, epoch, now)


class _UnitOfWork:
    """``PgStore.transaction()``: one connection from the pool for the whole body, in a
    transaction; the store itself is ``tx`` (its calls, in this task, join it). The
    connection is taken and the transaction begun by the first call, in that call's thread
    hop (one hop fewer per unit of work); a body that makes no call takes none."""

    __slots__ = ("db", "store", "token")

    def __init__(self, store: PgStore) -> None:
        self.store = store
        self.db: PgDatabase | None = None
        self.token: contextvars.Token[_UnitOfWork | None] | None = None

    async def __aenter__(self) -> PgStore:
        store = self.store
        if store.current.get() is not None:
            raise StoreError("a unit of work is open already: units of work do not nest")
        await store.turn.acquire()
        self.token = store.current.set(self)
        return store

    def run(self, function: Callable[..., _T], args: Any, kwargs: Any) -> _T:
        """``function`` on the unit of work's connection (in a worker thread), which the
        first call takes from the pool and begins the transaction on."""
        db = self.db
        if db is None:
            store = self.store
            db = store.connection()
            try:
                db.begin()
            except BaseException:
                store.give_back(db)
                raise
            self.db = db
        return function(db, *args, **kwargs)

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> bool:
        store, db = self.store, self.db
        assert self.token is not None
        store.current.reset(self.token)
        if db is None:  # no call was made: nothing was begun
            store.turn.release()
            return False

        def finish() -> None:
            try:
                db.finish(commit=exc_type is None)
            finally:
                store.give_back(db)

        try:
            await store.in_thread(finish)
        finally:
            store.turn.release()
        return False


def _configure(schema: str, durability: str, limits: Limits) -> Callable[[psycopg.Connection[Any]], None]:
    settings = sql.SQL(
        "SET search_path TO {schema}; SET statement_timeout = {statement}; SET lock_timeout = {lock}; "
        "SET idle_in_transaction_session_timeout = {idle}; SET synchronous_commit = {sync}").format(
        schema=sql.Identifier(schema), statement=limits.statement_ms, lock=limits.lock_ms,
        idle=limits.idle_in_transaction_ms, sync=sql.Literal(SYNCHRONOUS_COMMIT[durability]))

    def configure(conn: psycopg.Connection[Any]) -> None:
        conn.autocommit = True
        conn.execute(settings)

    return configure


def read_status(root: Path, url: str, now: int) -> tuple[LeaseRecord, dict[str, int], str, list[HostRecord]]:
    """For ``piwf status`` with no host: the state directory's lease, the run counts, the
    store's URL without password and the live hosts sharing it, read on one connection;
    nothing is written."""
    from piwf.store.sql import runs

    parsed = parse(url)
    try:
        with psycopg.connect(parsed.conninfo, **parsed.connect_kwargs) as conn:
            _configure(parsed.schema, "full", parsed.limits)(conn)
            db = PgDatabase(conn, parsed.redacted, parsed.schema)
            layout.check(db, parsed.schema)
            try:
                directory = (root / DIRECTORY_FILE).read_text().strip()
            except FileNotFoundError:
                directory = ""  # no host of this state directory has used the store yet
            return (hosts.read_lease(db, directory), runs.status_counts(db, now), parsed.redacted,
                    peers.live_hosts(db, now))
    except psycopg.Error as exc:
        raise _connect_error(exc, parsed.redacted) from exc


def _connect_error(exc: psycopg.Error, where: str) -> StoreError:
    if isinstance(exc, psycopg.OperationalError) and not exc.sqlstate:
        reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else "no answer"
        return StorageUnavailable(f"cannot connect to the PostgreSQL store {where}: {reason}")
    return translate_error(exc, where)


def directory_id(root: Path) -> str:
    """The id this state directory's host keeps its lease row under (made on first use)."""
    path = root / DIRECTORY_FILE
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        pass
    value = "dir-" + secrets.token_hex(8)
    root.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".tmp")
    temporary.write_text(value + "\n")
    os.replace(temporary, path)
    return value


def open_store(paths: Any, *, durability: str = "full", url: str, directory: str | None = None,
               pool_size: int | None = None, listen: bool = True, limits: Limits | None = None,
               migrate: bool = True) -> PgStore:
    """Open the PostgreSQL store at ``url`` for the host of state directory ``paths``
    (``directory``: its lease row's id, else kept in the state directory). Creates the
    schema's tables when it has none, migrates an older layout, and refuses a schema that is
    not piwf's or is of a newer layout, untouched (SchemaError); StorageUnavailable when the
    server cannot be reached. ``pool_size`` and ``limits``: the URL's (``pool_size=``,
    ``statement_timeout=``...: url.py) unless given. ``listen=False``: poll-only mode (no
    LISTEN: for a pooler in transaction mode; wake-ups are still sent). ``migrate=False``:
    the layout is checked only (an older one is refused, SchemaError), for a standby that
    records itself while it waits: only a host that takes its lease migrates the store."""
    if durability not in SYNCHRONOUS_COMMIT:
        raise StoreError(f"durability must be 'full' or 'normal', not {durability!r}")
    parsed = parse(url)
    if directory is None:
        directory = directory_id(Path(getattr(paths, "root", paths)))
    configure = _configure(parsed.schema, durability, limits or parsed.limits)
    timeout = parsed.connect_timeout_s
    try:  # one connection first: a server that cannot be reached is said at once, with libpq's reason
        with psycopg.connect(parsed.conninfo, **parsed.connect_kwargs) as conn:
            configure(conn)
            (layout.prepare if migrate else layout.check)(PgDatabase(conn, parsed.redacted, parsed.schema),
                                                          parsed.schema)
    except psycopg.Error as exc:
        raise _connect_error(exc, parsed.redacted) from exc
    pool: ConnectionPool[Any] = ConnectionPool(
        parsed.conninfo, min_size=1, max_size=pool_size or parsed.pool_size, open=False, timeout=timeout,
        configure=configure, kwargs=parsed.connect_kwargs, name="piwf")
    try:
        pool.open(wait=True, timeout=timeout)
    except PoolTimeout as exc:
        pool.close()
        raise StorageUnavailable(f"cannot connect to the PostgreSQL store {parsed.redacted} "
                                 f"within {timeout} s; is the server running?") from exc
    return PgStore(pool, parsed, directory, listen=listen)


if TYPE_CHECKING:  # the type checker proves PgStore implements the interface
    def _implements(store: PgStore) -> api.Store:
        return store
