"""The psycopg connection the modules of ``piwf.store.sql`` run on: placeholders, write
transactions, row counts, blobs and error translation.

The modules' SQL is written once, in SQLite's placeholder styles (``?``, ``?NNN`` and
``:name``); ``translate`` turns a statement into PostgreSQL's (``$1``...) once per SQL text,
and drops SQLite's ``INDEXED BY`` hints (PostgreSQL's planner takes none). Everything else
is SQL both engines accept (docs/architecture.md).

A statement goes to libpq itself (``Session``: prepared once per connection, then
``PQexecPrepared``), its parameters dumped and its rows loaded by psycopg's own adapters
(``psycopg.adapt.Transformer``), so values are what psycopg's cursor makes of them; the
cursor's machinery around that (its query object, prepare manager and wait loop) cost
about 20 µs of CPU per statement more (bench/README.md).

A connection is in autocommit mode: a statement outside ``write()`` or ``read()`` commits
by itself, as on SQLite. ``write()`` is ``BEGIN`` (READ COMMITTED) ... ``COMMIT``; the
locks that keep its read-then-write steps right are the modules' (each says which).
"""

from __future__ import annotations

import contextlib
import hashlib
import re
import select
from typing import Any

import psycopg
from psycopg import adapt
from psycopg import errors as pg_errors
from psycopg import pq

from piwf.errors import ConstraintViolation, SchemaError, StorageUnavailable, StoreError
from piwf.store.postgres import cursors
from piwf.store.sql.database import Blobs

DIALECT = "postgresql"

# A statement's text for PostgreSQL, and where its parameters come from: None when they are
# passed in order as given, else the key (an index into the sequence, or a name) of $1, $2...
Translated = tuple[str, tuple[int | str, ...] | None]

_TRANSLATED: dict[str, Translated] = {}
_INDEXED_BY = re.compile(r"\s+INDEXED\s+BY\s+\w+", re.IGNORECASE)
_TOKEN = re.compile(r"'(?:[^']|'')*'|\"(?:[^\"])*\"|::|\?\d+|\?|:[A-Za-z_]\w*")


def translate(sql: str) -> Translated:
    """``sql`` with PostgreSQL's placeholders, and the keys of its parameters: a bare ``?``
    is the next one in order; SQLite's ``?NNN`` is the NNNth (a bare ``?`` after one takes
    the number after the largest so far, as in SQLite) and ``:name`` the named one, each
    key given one ``$k`` however often it is used. Cached per text (the modules' statements
    are constants, or built from a few shapes)."""
    done = _TRANSLATED.get(sql)
    if done is None:
        done = _TRANSLATED[sql] = _translate(_INDEXED_BY.sub("", sql))
    return done


def _translate(sql: str) -> Translated:
    keys: dict[int | str, int] = {}  # a parameter's key -> its $k
    in_order = True  # only bare ``?``: the parameters as given
    largest = 0
    out: list[str] = []
    position = 0
    for match in _TOKEN.finditer(sql):
        out.append(sql[position:match.start()])
        position = match.end()
        token = match.group(0)
        key: int | str
        if token[0] == "?":
            if len(token) > 1:
                in_order = False
            number = int(token[1:]) if len(token) > 1 else largest + 1
            largest = max(largest, number)
            key = number - 1
        elif token[0] == ":" and token != "::":
            in_order = False
            key = token[1:]
        else:
            out.append(token)  # a quoted literal or name, or a cast
            continue
        if key not in keys:
            keys[key] = len(keys) + 1
        out.append(f"${keys[key]}")
    out.append(sql[position:])
    return "".join(out), None if in_order else tuple(keys)


class PgDatabase(Blobs):
    """One psycopg connection as a ``piwf.store.sql.database.Database``; used by one thread
    at a time (a unit of work's calls hop threads one after the other, never at once)."""

    dialect = DIALECT

    __slots__ = ("_begin", "_depth", "_rowcount", "_session", "conn", "fenced", "revised", "schema", "where")

    def __init__(self, conn: psycopg.Connection[Any], where: str, schema: str = "piwf") -> None:
        self.conn = conn
        self.where = where  # the store's URL without a password, for messages
        self.schema = schema
        self._depth = 0
        self._rowcount = 0
        # A BEGIN not sent yet: it goes with the transaction's first statement (``begin``).
        self._begin: bytes | None = None
        # The connection's statements and adapters, for every statement (``session_of``).
        self._session: Session | None = None
        self.fenced: tuple[str, str, int] | None = None  # see store/sql/database.py
        self.revised: tuple[str, int] | None = None  # likewise

    # --- transactions -----------------------------------------------------------------

    def write(self) -> _Write:
        return _Write(self)

    def read(self) -> _Read:
        return _Read(self)

    def in_write(self) -> bool:
        return self._depth > 0

    def begin(self, statement: bytes = b"BEGIN") -> None:
        """Open a transaction. Its ``BEGIN`` is sent with its first statement, in one round
        trip (``Session.run``): the transaction is the same (READ COMMITTED takes each
        statement's snapshot as it starts, REPEATABLE READ at its first statement; a
        ``BEGIN`` takes none), and one with no statement sends nothing."""
        self._begin = statement
        self._depth = 1
        self.fenced = self.revised = None

    def finish(self, commit: bool) -> None:
        """End the transaction ``begin`` opened. A COMMIT whose answer was lost (the
        connection broke) may or may not have committed: StorageUnavailable says so, and the
        retry finds out from the command log or its fence."""
        self._depth = 0
        self.fenced = self.revised = None
        self._begin = None  # not sent: no statement was, nothing to end
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
            self._statement("COMMIT", ())
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
            self._statement("ROLLBACK", ())

    # --- statements -------------------------------------------------------------------

    def execute(self, sql: str, params: Any = ()) -> Any:
        """The statement's rows, all fetched (``Rows``)."""
        return Rows(self._run(sql, params))

    def one(self, sql: str, params: Any = ()) -> Any:
        rows = self._run(sql, params)
        return rows[0] if rows else None

    def _run(self, sql: str, params: Any) -> list[Any]:
        if self.fenced is not None and "run_queue" in sql:
            self.fenced = None  # the claim's row may change: the next fence runs again
        if self.revised is not None and ("revision" in sql or "DELETE" in sql):
            self.revised = None  # a revision may change: read it again
        text, keys = translate(sql)
        if keys is not None:
            params = [params[key] for key in keys]
        try:
            return self._statement(text, params)
        except psycopg.Error as exc:
            raise translate_error(exc, self.where) from exc

    def _statement(self, text: str, params: Any) -> list[Any]:
        session = self._session
        if session is None:
            session = self._session = session_of(self.conn)
        begin = self._begin
        try:
            rows, self._rowcount = session.run(text, params, begin)
        except BaseException:
            # A statement refused before anything reached the server (a value psycopg cannot
            # dump) leaves its transaction's BEGIN still to send; once sent, it is begun.
            if begin is not None and (self.conn.closed
                                      or self.conn.info.transaction_status != pq.TransactionStatus.IDLE):
                self._begin = None
            raise
        self._begin = None
        return rows

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



_TUPLES_OK = pq.ExecStatus.TUPLES_OK
_COMMAND_OK = pq.ExecStatus.COMMAND_OK
_EMPTY_QUERY = pq.ExecStatus.EMPTY_QUERY
_FATAL_ERROR = pq.ExecStatus.FATAL_ERROR
_PIPELINE_SYNC = pq.ExecStatus.PIPELINE_SYNC
_BAD = pq.ConnStatus.BAD
_SQLSTATE = pq.DiagnosticField.SQLSTATE
_AUTO = adapt.PyFormat.AUTO
_SESSION = "_piwf_session"
# Statements kept prepared per connection; past that many, a new text is sent unprepared
# (a text built with a varying number of placeholders would otherwise grow the set forever).
PREPARED_MAX = 400


def session_of(conn: psycopg.Connection[Any]) -> Session:
    """The ``Session`` of ``conn``, kept with the connection across the pool's checkouts
    (its prepared statements live as long as the server's session)."""
    session: Session | None = getattr(conn, _SESSION, None)
    if session is None:
        session = Session(conn)
        setattr(conn, _SESSION, session)
    return session


class Session:
    """A connection's statements, each prepared on the server at its first use (one named
    statement per text and parameter types, as psycopg keys its own; the prepare goes in
    the same round trip as that first execution), then sent with ``PQexecPrepared``
    through the connection's ``pgconn``: a blocking libpq call, which releases the GIL
    while it waits. Values go through psycopg's adapters for this
    connection (``Transformer``): parameters dumped as psycopg's cursor dumps them
    (``%s``: text, or binary for bytes), rows loaded from text results. Used by one
    thread at a time (the connection's), and every result is loaded before the next
    statement. A statement with no parameters (``BEGIN``, ``COMMIT``...) goes as a simple
    query."""

    __slots__ = ("encoding", "pgconn", "prepared", "transformer")

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self.pgconn = conn.pgconn
        self.encoding = conn.info.encoding
        self.transformer = adapt.Transformer(conn)
        self.prepared: dict[tuple[str, tuple[int, ...]], bytes] = {}

    def run(self, text: str, params: Any, begin: bytes | None = None) -> tuple[list[Any], int]:
        """The rows ``text`` returned (none for a command) and its row count (psycopg's
        ``rowcount``: rows returned, else rows changed, else -1); psycopg's error for a
        failed one (OperationalError when libpq says the connection failed). ``begin``: a
        ``BEGIN`` to send first, pipelined with the statement (one round trip; a statement
        without parameters, or one past ``PREPARED_MAX``, sends it on its own first)."""
        result = self._result(text, params, begin)
        status = result.status
        if status == _TUPLES_OK:
            tx = self.transformer
            tx.set_pgresult(result)
            count = result.ntuples
            return tx.load_rows(0, count, tuple), count
        if status in (_COMMAND_OK, _EMPTY_QUERY):
            changed = result.command_tuples
            return [], -1 if changed is None else changed
        raise self._error(result)

    def _result(self, text: str, params: Any, begin: bytes | None) -> pq.abc.PGresult:
        pgconn, tx = self.pgconn, self.transformer
        if not params:  # BEGIN, COMMIT...: a simple query, the statement in one message
            if begin is not None:
                self._simple(begin)
            return pgconn.exec_(text.encode(self.encoding))
        values = tx.dump_sequence(params, [_AUTO] * len(params))
        key = (text, tx.types or ())
        name = self.prepared.get(key)
        if name is None and len(self.prepared) < PREPARED_MAX:  # its first use here: prepared on the way
            return self._pipelined(begin, key, f"piwf_{len(self.prepared)}".encode(), values, tx.formats)
        if name is not None and begin is not None:
            return self._pipelined(begin, None, name, values, tx.formats)
        if begin is not None:
            self._simple(begin)
        if name is None:  # PREPARED_MAX are: this one goes unprepared
            return pgconn.exec_params(text.encode(self.encoding), values, tx.types, tx.formats)
        # libpq takes None as NULL (the stub says bytes only; psycopg's cursor passes None too)
        return pgconn.exec_prepared(name, values, tx.formats)  # type: ignore[arg-type]

    def _simple(self, statement: bytes) -> None:
        result = self.pgconn.exec_(statement)
        if result.status != _COMMAND_OK:
            raise self._error(result)

    def _pipelined(self, begin: bytes | None, prepare: tuple[str, tuple[int, ...]] | None, name: bytes,
                   values: Any, formats: Any) -> pq.abc.PGresult:
        """In one round trip (libpq's pipeline mode): ``begin`` (if any), the statement
        ``prepare`` prepared as ``name`` (if given: its first use), then ``name`` executed;
        the statement's result. The socket is awaited in ``select.poll`` (which releases
        the GIL; libpq's blocking read in pipeline mode would hold it). A failure of the
        connection on the way closes it (the server rolls back what it began): the pool
        then drops it."""
        pgconn = self.pgconn
        expected = 1 + (begin is not None) + (prepare is not None)
        pgconn.enter_pipeline_mode()
        try:
            if begin is not None:
                pgconn.send_query_params(begin, None)
            if prepare is not None:
                pgconn.send_prepare(name, prepare[0].encode(self.encoding), prepare[1] or None)
            pgconn.send_query_prepared(name, values, formats)
            pgconn.pipeline_sync()
            while pgconn.flush():
                self._wait(select.POLLOUT)
            results = self._pipeline_results(expected)
            pgconn.exit_pipeline_mode()
        except BaseException:
            pgconn.finish()
            raise
        *before, result = results
        if prepare is not None and before[-1].status == _COMMAND_OK:
            self.prepared[prepare] = name  # it exists on the server now, whatever came of its use
        for step in before:  # a failed BEGIN or prepare: what came after it was not run
            if step.status != _COMMAND_OK:
                raise self._error(step)
        return result

    def _pipeline_results(self, expected: int) -> list[pq.abc.PGresult]:
        """The ``expected`` results of the pipeline up to its sync."""
        pgconn = self.pgconn
        results: list[pq.abc.PGresult] = []
        ends = 0
        while True:
            while pgconn.is_busy():
                self._wait(select.POLLIN)
                pgconn.consume_input()
            result = pgconn.get_result()
            if result is None:  # the end of one command's results, or of the connection
                ends += 1
                if ends > expected or pgconn.status == _BAD:
                    raise psycopg.OperationalError(
                        pgconn.get_error_message(self.encoding).strip() or "the connection was lost")
                continue
            if result.status == _PIPELINE_SYNC:
                break
            results.append(result)
        if len(results) != expected:
            raise psycopg.OperationalError(f"{len(results)} results in a pipeline of {expected}")
        return results

    def _wait(self, events: int) -> None:
        poll = select.poll()
        poll.register(self.pgconn.socket, events | select.POLLERR | select.POLLHUP)
        poll.poll()

    def _error(self, result: pq.abc.PGresult) -> psycopg.Error:
        if result.status == _FATAL_ERROR and result.error_field(_SQLSTATE):
            return pg_errors.error_from_result(result, encoding=self.encoding)
        # No SQLSTATE: libpq's own error (the connection failed), as psycopg raises it.
        message = result.get_error_message(self.encoding) or self.pgconn.get_error_message(self.encoding)
        return psycopg.OperationalError(message.strip() or f"unexpected result status {result.status}")


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
            db.begin(b"BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
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
