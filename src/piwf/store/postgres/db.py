"""The psycopg connection the modules of ``piwf.store.sql`` run on: placeholders, write
transactions, row counts, blobs and error translation.

The modules' SQL is written once, in SQLite's placeholder styles (``?`` and ``:name``);
``translate`` turns a statement into psycopg's (``%s``, ``%(name)s``; a literal ``%``
doubled) once per SQL text, and drops SQLite's ``INDEXED BY`` hints (PostgreSQL's planner
takes none). Everything else is SQL both engines accept (docs/architecture.md).

A connection is in autocommit mode: a statement outside ``write()`` or ``read()`` commits
by itself, as on SQLite. ``write()`` is ``BEGIN`` (READ COMMITTED) ... ``COMMIT``; the
locks that keep its read-then-write steps right are the modules' (each says which).
"""

from __future__ import annotations

import contextlib
import hashlib
import re
from typing import Any

import psycopg
from psycopg import errors as pg_errors

from piwf.errors import ConstraintViolation, SchemaError, StorageUnavailable, StoreError
from piwf.store.postgres import cursors
from piwf.store.sql.database import Blobs

DIALECT = "postgresql"

_TRANSLATED: dict[str, tuple[str, bool]] = {}
_INDEXED_BY = re.compile(r"\s+INDEXED\s+BY\s+\w+", re.IGNORECASE)
_TOKEN = re.compile(r"'(?:[^']|'')*'|\"(?:[^\"])*\"|::|%|\?\d+|\?|:[A-Za-z_]\w*")
_NUMBERED = re.compile(r"\?\d")


def translate(sql: str) -> tuple[str, bool]:
    """``sql`` in psycopg's placeholder style, and whether it numbers its parameters
    (SQLite's ``?NNN``: then they are passed by name, ``p1``..., and a bare ``?`` after one
    takes the number after the largest so far, as in SQLite), cached per text (the modules'
    statements are constants, or built from a few shapes)."""
    done = _TRANSLATED.get(sql)
    if done is None:
        done = _TRANSLATED[sql] = _translate(_INDEXED_BY.sub("", sql))
    return done


def _translate(sql: str) -> tuple[str, bool]:
    numbered = bool(_NUMBERED.search(sql))
    largest = 0
    out: list[str] = []
    position = 0
    for match in _TOKEN.finditer(sql):
        out.append(sql[position:match.start()])
        position = match.end()
        token = match.group(0)
        if token[0] == "?":
            if not numbered:
                out.append("%s")
                continue
            number = int(token[1:]) if len(token) > 1 else largest + 1
            largest = max(largest, number)
            out.append(f"%(p{number})s")
        elif token == "%":
            out.append("%%")
        elif token[0] == ":" and token != "::":
            out.append(f"%({token[1:]})s")
        else:
            out.append(token)  # a quoted literal or name, or a cast
    out.append(sql[position:])
    return "".join(out), numbered


class PgDatabase(Blobs):
    """One psycopg connection as a ``piwf.store.sql.database.Database``; used by one thread
    at a time (a unit of work's calls hop threads one after the other, never at once)."""

    dialect = DIALECT

    __slots__ = ("_cursor", "_depth", "_rowcount", "conn", "fenced", "revised", "schema", "where")

    def __init__(self, conn: psycopg.Connection[Any], where: str, schema: str = "piwf") -> None:
        self.conn = conn
        self.where = where  # the store's URL without a password, for messages
        self.schema = schema
        self._depth = 0
        self._rowcount = 0
        # The connection's one cursor, for every statement (``_cursor_of``).
        self._cursor: psycopg.Cursor[Any] | None = None
        self.fenced: tuple[str, str, int] | None = None  # see store/sql/database.py
        self.revised: tuple[str, int] | None = None  # likewise

    # --- transactions -----------------------------------------------------------------

    def write(self) -> _Write:
        return _Write(self)

    def read(self) -> _Read:
        return _Read(self)

    def in_write(self) -> bool:
        return self._depth > 0

    def begin(self) -> None:
        self.execute("BEGIN")
        self._depth = 1
        self.fenced = self.revised = None

    def finish(self, commit: bool) -> None:
        """End the transaction ``begin`` opened. A COMMIT whose answer was lost (the
        connection broke) may or may not have committed: StorageUnavailable says so, and the
        retry finds out from the command log or its fence."""
        self._depth = 0
        self.fenced = self.revised = None
        if self.conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE:
            return
        if not commit:
            self._rollback()
            return
        if self.conn.info.transaction_status == psycopg.pq.TransactionStatus.INERROR:
            # A statement failed and its error was caught: PostgreSQL has aborted the whole
            # transaction (SQLite would have kept the rest). Never report that as committed.
            self._rollback()
            raise StoreError("a statement of this transaction failed (its error was handled), so PostgreSQL "
                             "rolled the whole transaction back: nothing of it was committed")
        try:
            self._statement("COMMIT", None)
        except psycopg.OperationalError as exc:
            raise StorageUnavailable(
                f"the connection to {self.where} was lost during COMMIT: the change may or may not have been "
                "made; retry (a retried request is answered from what was recorded)") from exc
        except psycopg.Error as exc:
            self._rollback()
            raise translate_error(exc, self.where) from exc

    def _rollback(self) -> None:
        if self.conn.closed:
            return
        with contextlib.suppress(psycopg.Error):  # the connection is gone: the server rolled back
            self._statement("ROLLBACK", None)

    # --- statements -------------------------------------------------------------------

    def execute(self, sql: str, params: Any = ()) -> Any:
        """The statement's rows, all fetched (``Rows``): the cursor is the connection's one
        (kept across checkouts), which the next statement reuses, so no result may stay on it."""
        cursor = self._run(sql, params)
        result = cursor.pgresult
        if result is None or result.status != _TUPLES_OK:
            return Rows([])
        return Rows(cursor.fetchall())

    def one(self, sql: str, params: Any = ()) -> Any:
        cursor = self._run(sql, params)
        result = cursor.pgresult
        return cursor.fetchone() if result is not None and result.status == _TUPLES_OK else None

    def _run(self, sql: str, params: Any) -> psycopg.Cursor[Any]:
        if self.fenced is not None and "run_queue" in sql:
            self.fenced = None  # the claim's row may change: the next fence runs again
        if self.revised is not None and ("revision" in sql or "DELETE" in sql):
            self.revised = None  # a revision may change: read it again
        text, numbered = translate(sql)
        if numbered:
            params = {f"p{index}": value for index, value in enumerate(params, 1)}
        try:
            cursor = self._statement(text, params or None)
        except psycopg.Error as exc:
            raise translate_error(exc, self.where) from exc
        self._rowcount = cursor.rowcount
        return cursor

    def _statement(self, text: str, params: Any) -> psycopg.Cursor[Any]:
        cursor = self._cursor
        if cursor is None:
            cursor = self._cursor = _cursor_of(self.conn)
        return cursor.execute(text, params)

    def scalar(self, sql: str, params: Any = ()) -> Any:
        row = self.one(sql, params)
        return None if row is None else row[0]

    def changes(self) -> int:
        return self._rowcount

    # --- dialect: READ COMMITTED, so a read that a write depends on locks (store/sql/locks.py) ---

    def lock_rows(self, of: str | None = None, *, skip_locked: bool = False) -> str:
        return " FOR UPDATE" + (f" OF {of}" if of else "") + (" SKIP LOCKED" if skip_locked else "")

    def lock_key(self, namespace: str, key: str) -> None:
        """A transaction-level advisory lock on (this schema, namespace, key). Outside a
        transaction there is nothing to hold it for (it would be released with the statement
        that took it): no statement is sent (``commands.lookup``'s fast path before its
        unit of work; the one in the unit of work takes it)."""
        if not self._depth:
            return
        self.execute("SELECT pg_advisory_xact_lock(?)", (self._lock_id(namespace, key),))

    def try_lock_key(self, namespace: str, key: str) -> bool:
        return bool(self.scalar("SELECT pg_try_advisory_xact_lock(?)", (self._lock_id(namespace, key),)))

    def _lock_id(self, namespace: str, key: str) -> int:
        """The advisory lock's 64-bit key: a hash of (schema, namespace, key), made here (a key
        may hold any character, NUL included, which a PostgreSQL text value may not)."""
        digest = hashlib.sha256(f"{self.schema}\x00{namespace}\x00{key}".encode()).digest()
        return int.from_bytes(digest[:8], "big", signed=True)

    def event_horizon(self) -> int | None:
        return cursors.event_horizon(self)

    # --- blobs ------------------------------------------------------------------------



_TUPLES_OK = psycopg.pq.ExecStatus.TUPLES_OK
_CURSOR = "_piwf_cursor"


def _cursor_of(conn: psycopg.Connection[Any]) -> psycopg.Cursor[Any]:
    """The one cursor every statement on ``conn`` goes through, kept with the connection
    across the pool's checkouts: ``conn.execute`` made a cursor per statement, 40 % of
    psycopg's CPU for a one-row statement (bench/README.md, part 3). A connection is used
    by one thread at a time, and every result is fetched before the next statement."""
    cursor: psycopg.Cursor[Any] | None = getattr(conn, _CURSOR, None)
    if cursor is None or cursor.closed:
        cursor = conn.cursor()
        setattr(conn, _CURSOR, cursor)
    return cursor


class Rows:
    """A statement's rows, fetched: what ``PgDatabase.execute`` returns (a cursor's reading
    side: iteration, ``fetchone``, ``fetchall``, each going on from where the last stopped)."""

    __slots__ = ("at", "rows")

    def __init__(self, rows: list[Any]) -> None:
        self.rows = rows
        self.at = 0

    def fetchone(self) -> Any:
        at = self.at
        if at >= len(self.rows):
            return None
        self.at = at + 1
        return self.rows[at]

    def fetchall(self) -> list[Any]:
        rest = self.rows[self.at:] if self.at else self.rows
        self.at = len(self.rows)
        return rest

    def __iter__(self) -> Any:
        return iter(self.fetchall())


class _Write:
    """``PgDatabase.write()``: ``BEGIN ... COMMIT``; nested calls join the outer one."""

    __slots__ = ("db", "outer")

    def __init__(self, db: PgDatabase) -> None:
        self.db = db
        self.outer = False

    def __enter__(self) -> PgDatabase:
        db = self.db
        if db._depth:
            db._depth += 1
            return db
        db.begin()
        self.outer = True
        return db

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        if not self.outer:
            self.db._depth -= 1
            return
        self.db.finish(commit=exc_type is None)


class _Read:
    """``PgDatabase.read()``: joins a transaction already open, else reads from one
    snapshot (REPEATABLE READ, read only)."""

    __slots__ = ("db", "outer")

    def __init__(self, db: PgDatabase) -> None:
        self.db = db
        self.outer = False

    def __enter__(self) -> PgDatabase:
        db = self.db
        if not db._depth:
            db.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
            db._depth = 1
            self.outer = True
        return db

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        if self.outer:
            self.db.finish(commit=exc_type is None)


# SQLSTATE classes that say the server or the connection failed, not the request: the
# retry error (08 connection, 53 resources, 57 operator intervention incl. statement and
# lock time limits, 58 system, 40 serialization and deadlocks), and two states: 55P03 lock
# not available, 25P03 the session ended by idle_in_transaction_session_timeout.
_RETRY_CLASSES = ("08", "53", "57", "58", "40")
_RETRY_STATES = ("55P03", "25P03")


def translate_error(exc: psycopg.Error, where: str) -> StoreError:
    """The store's error for a psycopg one. The message names the store without a password
    (``where``) and the server's own text (which never holds the connection's password)."""
    state = exc.sqlstate or ""
    text = (exc.diag.message_primary or str(exc)).strip() if exc.diag else str(exc).strip()
    if isinstance(exc, pg_errors.IntegrityError):
        return ConstraintViolation(f"constraint violated: {text}")
    if isinstance(exc, psycopg.OperationalError) and not state:  # no answer from the server at all
        return StorageUnavailable(f"the PostgreSQL store {where} is unavailable; the request was not carried out: "
                                  "retry once it is back")
    if state.startswith(_RETRY_CLASSES) or state in _RETRY_STATES:
        return StorageUnavailable(f"the PostgreSQL store {where} refused for now ({text}); "
                                  "the request was not carried out: retry")
    if state in ("42P01", "42703"):  # undefined table or column: not the layout this piwf knows
        return SchemaError(f"the PostgreSQL store {where} does not have the layout this piwf expects ({text})")
    return StoreError(f"database error on {where}: {text}")
