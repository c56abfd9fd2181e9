"""What the aggregates' SQL runs on: a ``Database`` (the backend's connection), and the
helpers that build SQL text shared by the schema and the statements."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar

from piwf.errors import StoreError
from piwf.store.api.rules import BLOB_TOUCH_MS
from piwf.wire import canonical_json, decode_json, sha256_hex

_T = TypeVar("_T")
_P = ParamSpec("_P")


class Database(Protocol):
    """A connection the statements of ``piwf.store.sql`` run on (``piwf.store.sqlite.db``,
    ``piwf.store.postgres.db``). ``dialect`` ('sqlite', 'postgresql') is for the few places
    whose SQL differs between the two (each says why); everything else is SQL both accept."""

    dialect: str
    # The claim (run id, token, now) the fence (store/sql/base.py ``FENCE``) held in the open
    # write transaction, while no statement naming run_queue has run since: a later fence of
    # the same claim at the same ``now`` in that transaction is already part of its write.
    # The backend resets it when a transaction begins or ends, and on any statement that
    # names run_queue.
    fenced: tuple[str, str, int] | None
    # A run's revision (run id, revision) as the last statement that wrote it in the open
    # write transaction returned it, while no statement naming a revision has run since
    # (``revision_of`` answers from it). Reset as ``fenced`` is, and on any statement that
    # names a revision or deletes.
    revised: tuple[str, int] | None

    def write(self) -> AbstractContextManager[Any]:
        """A write transaction; nested calls join the outer one."""
        ...

    def read(self) -> AbstractContextManager[Any]:
        """Several reads from one snapshot."""
        ...

    def in_write(self) -> bool:
        """A transaction (``write``) is open."""
        ...

    def execute(self, sql: str, params: Any = ()) -> Any: ...  # a cursor: iterable rows, fetchall()
    def one(self, sql: str, params: Any = ()) -> Any: ...
    def scalar(self, sql: str, params: Any = ()) -> Any: ...
    def changes(self) -> int:
        """Rows changed by the last statement."""
        ...

    def put_json(self, value: Any, now: int) -> tuple[str | None, str | None]:
        """Store a JSON value: inline when small, else as a blob. Returns (inline, hash)."""
        ...

    def put_blob(self, data: bytes, now: int, digest: str | None = None) -> str:
        """Store bytes as a blob (``PUT_BLOB``: a blob stored again is refreshed, so retention keeps it)."""
        ...

    def get_json(self, inline: str | None, digest: str | None) -> Any: ...
    def get_blob(self, digest: str) -> bytes: ...

    # --- what differs between dialects (store/sql/locks.py says how the modules use them) ---
    # Where one writer at a time makes every read of a write transaction current (SQLite),
    # each is empty or does nothing; on PostgreSQL (READ COMMITTED) they lock.

    def lock_rows(self, of: str | None = None, *, skip_locked: bool = False) -> str:
        """A clause that ends a SELECT whose rows the transaction goes on to write:
        ``""`` on SQLite; ``" FOR UPDATE [OF of] [SKIP LOCKED]"`` on PostgreSQL."""
        ...

    def lock_key(self, namespace: str, key: str) -> None:
        """Hold a lock on (namespace, key) until the transaction ends (a row that may not
        exist yet, a session's stream): nothing on SQLite; a transaction-level advisory
        lock on PostgreSQL."""
        ...

    def try_lock_key(self, namespace: str, key: str) -> bool:
        """``lock_key`` without waiting: whether the lock is held now (True on SQLite)."""
        ...

    def event_horizon(self) -> int | None:
        """The highest run event id a reader may go up to, every event at or below it being
        committed (or never to be): None on SQLite, whose ids commit in order; on
        PostgreSQL ``piwf.store.postgres.cursors.event_horizon``. Call before the read."""
        ...


# Storing a blob (hash, content, now, now - BLOB_TOUCH_MS): new, or one stored before whose
# created_at is refreshed once it is older than BLOB_TOUCH_MS (rules.py), so retention, which
# deletes only unused blobs older than BLOB_GRACE_MS, never deletes one being stored again.
PUT_BLOB = """INSERT INTO blobs (hash, content, created_at) VALUES (?, ?, ?)
  ON CONFLICT (hash) DO UPDATE SET created_at = excluded.created_at WHERE blobs.created_at < ?"""


INLINE_JSON_LIMIT = 4096  # a JSON value this long or shorter is kept in its row, a longer one as a blob


class Blobs:
    """Content-addressed values, the same on every backend (a mixin over its ``execute``
    and ``scalar``)."""

    def execute(self, sql: str, params: Any = ()) -> Any: ...
    def scalar(self, sql: str, params: Any = ()) -> Any: ...

    def put_json(self, value: Any, now: int) -> tuple[str | None, str | None]:
        """Store a JSON value: inline when small, else in ``blobs``. Returns (inline, hash)."""
        data = canonical_json(value)
        if len(data) <= INLINE_JSON_LIMIT:
            return data.decode(), None
        return None, self.put_blob(data, now)

    def put_blob(self, data: bytes, now: int, digest: str | None = None) -> str:
        """``PUT_BLOB``: two writers storing one blob at once store it once; one stored again
        is refreshed, so retention keeps it. ``digest``: ``sha256_hex(data)``, when known."""
        digest = digest or sha256_hex(data)
        self.execute(PUT_BLOB, (digest, data, now, now - BLOB_TOUCH_MS))
        return digest

    def get_json(self, inline: str | None, digest: str | None) -> Any:
        if inline is not None:
            return decode_json(inline.encode())
        if digest is None:
            return None
        return decode_json(self.get_blob(digest))

    def get_blob(self, digest: str) -> bytes:
        content = self.scalar("SELECT content FROM blobs WHERE hash = ?", (digest,))
        if content is None:
            raise StoreError(f"blob {digest} is missing")
        return bytes(content)


def atomic(function: Callable[Concatenate[Any, _P], _T]) -> Callable[Concatenate[Any, _P], _T]:
    """A store operation of several statements as one transaction when called by itself
    (inside a unit of work it joins that one, as ``Database.write`` does)."""
    @functools.wraps(function)
    def in_one_transaction(db: Any, /, *args: _P.args, **kwargs: _P.kwargs) -> _T:
        with db.write():
            result = function(db, *args, **kwargs)
        return result
    return in_one_transaction


def one_of(values: Iterable[str]) -> str:
    """A CHECK list from a status enum, so the schema allows exactly its words."""
    return ", ".join(f"'{value}'" for value in values)


def lifecycle_contradicts(run: str, queue: str, otherwise: str = "0") -> str:
    """1 when engine status ``run`` and queue status ``queue`` do not go together (the
    lifecycle projection, docs/concepts.md), else 0. A CASE, not IN lists: in a trigger a
    constant IN list builds a temporary index each time it runs (claims measured 2x slower).
    ``otherwise``: the unknown statuses' value — '0' in SQLite's triggers (their text is
    part of every layout since 4), 'FALSE' in a query PostgreSQL runs too (a CASE of
    booleans)."""
    return f"""(NOT CASE {run} WHEN 'queued' THEN {queue} = 'queued'
  WHEN 'running' THEN {queue} = 'starting' OR {queue} = 'running' OR {queue} = 'parked'
  WHEN 'waiting' THEN {queue} = 'parked' WHEN 'completed' THEN {queue} = 'done'
  WHEN 'failed' THEN {queue} = 'failed' WHEN 'timed_out' THEN {queue} = 'failed'
  WHEN 'cancelled' THEN {queue} = 'cancelled' ELSE {otherwise} END)"""
