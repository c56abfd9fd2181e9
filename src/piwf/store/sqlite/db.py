"""The apsw connection: opening, layout checks, write transactions, blobs.

Writes run as explicit ``BEGIN IMMEDIATE ... COMMIT``: apsw's own IMMEDIATE transaction
mode holds the GIL through the busy timeout and freezes the trio loop (NOTES.md).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

import apsw

from piwf.errors import (ConstraintViolation, CorruptStateError, SchemaError, StorageFull, StorageUnavailable,
                      StoreError)
from piwf.store.sql.database import Blobs
from piwf.store.sqlite.schema import APPLICATION_ID, MIGRATIONS, REQUIRED_TABLES, SCHEMA_SQL, SCHEMA_VERSION

log = logging.getLogger("piwf.store")
_T = TypeVar("_T")
_P = ParamSpec("_P")
BUSY_TIMEOUT_MS = 5000
# Prepared statements kept per connection (apsw keeps 16 by default). apsw puts a statement
# back in the next slot of a ring when it is done, evicting what was there, so an entry
# lasts this many executions, not this many distinct statements: at 256 (about three runs'
# statements) the less frequent ones were compiled again, 2-3 per run
# (bench/profile_host.py counts); at 1024, 0.4.
STATEMENT_CACHE = 1024
RESET_HINT = "Move the state directory aside to start fresh, or use the piwf that created it."
DAMAGE_HINT = ("Restore it from a backup, or move the state directory aside to start fresh "
               "(sqlite3's .recover may save what is readable); nothing was written to it.")


def _vfs() -> str | None:
    """The VFS to open state databases with: SQLite's own, unless ``PIWF_POWER_CUT`` arms the
    one that simulates power loss (``powercut.py``; tests and the chaos harness only)."""
    if not os.environ.get("PIWF_POWER_CUT"):
        return None
    from piwf.store.sqlite import powercut
    powercut.armed()
    return powercut.NAME


class Database(Blobs):
    """One connection, used by one thread at a time."""

    dialect = "sqlite"

    def __init__(self, conn: apsw.Connection, path: Path) -> None:
        self.conn = conn
        self.path = path
        self._depth = 0
        self.fenced: tuple[str, str, int] | None = None  # see store/sql/database.py
        self.revised: tuple[str, int] | None = None  # likewise
        self.durability = "full"
        self.sync_deferred = False  # see defer_sync
        self._wal_fd: int | None = None  # see sync_wal
        self.file_id: tuple[int, int] | None = None  # (device, inode) of the file opened; see check_file
        self.lost: str | None = None  # what happened to that file, once a write found it gone
        self.kept: dict[str, Any] = {}  # store/sql/run_detail.py: answers kept while the file is unchanged
        self._versions = conn.cursor()  # others_version's (a cursor of its own: 2 k instructions fewer)

    # --- opening ---------------------------------------------------------------------

    @classmethod
    def open(cls, path: str | os.PathLike[str], *, durability: str = "full",
             verify: Callable[[Database], None] | None = None) -> Database:
        """Open (creating if absent) a database for writing.

        ``verify`` is called with a read-only connection to an existing database, after its
        layout is checked and before anything (a pragma, a migration) is written; what it
        raises refuses the database untouched.
        """
        path = Path(path)
        if durability not in ("full", "normal"):
            raise StoreError(f"durability must be 'full' or 'normal', not {durability!r}")
        if path.exists():
            _check_header(path)
            if verify is not None:
                _verify_readonly(path, verify)
        old_umask = os.umask(0o077)
        try:
            conn = apsw.Connection(str(path), statementcachesize=STATEMENT_CACHE, vfs=_vfs())
        finally:
            os.umask(old_umask)
        db = cls(conn, path)
        db.durability = durability
        try:
            db.file_id = _file_id(path)
            conn.setbusytimeout(BUSY_TIMEOUT_MS)
            fresh = db._is_empty()
            if not fresh:
                db._check_layout()  # before any pragma that writes: a foreign file stays untouched
            db._configure(durability)
            if fresh:
                db._create()
            else:
                db._migrate()
        except apsw.Error as exc:
            conn.close()
            raise _translate(exc, path) from exc
        except BaseException:
            conn.close()
            raise
        return db

    @classmethod
    def open_readonly(cls, path: str | os.PathLike[str], *, allow_empty: bool = False) -> Database:
        path = Path(path)
        _check_header(path)
        conn = None
        try:
            conn = apsw.Connection(str(path), flags=apsw.SQLITE_OPEN_READONLY, statementcachesize=STATEMENT_CACHE)
            conn.setbusytimeout(BUSY_TIMEOUT_MS)
            db = cls(conn, path)
            if not (allow_empty and db._is_empty()):
                db._check_layout()
        except apsw.Error as exc:
            if conn is not None:
                conn.close()
            raise _translate(exc, path) from exc
        except BaseException:
            if conn is not None:
                conn.close()
            raise
        return db

    def close(self) -> None:
        try:
            if self.sync_deferred:  # what was committed since the last group's fsync
                self.sync_wal()
        finally:
            if self._wal_fd is not None:
                os.close(self._wal_fd)
                self._wal_fd = None
            self.conn.close()

    # --- group commit -----------------------------------------------------------------

    def defer_sync(self) -> None:
        """Commit without SQLite's own fsync (``synchronous = NORMAL``): the caller makes
        commits durable by calling ``sync_wal`` (in a thread, for every commit since the
        last call at once) and answers nothing before it returns. Frames reach the WAL in
        commit order and recovery keeps a prefix of them, so one fsync of the WAL makes
        every earlier commit durable, as ``synchronous = FULL`` would have one by one
        (checkpoints still fsync the WAL and the database themselves)."""
        self.conn.execute("PRAGMA synchronous = NORMAL")
        self.sync_deferred = True

    def written(self) -> int:
        """A counter that grows with every row this connection changes (committed or
        not): what a later ``sync_wal`` must cover."""
        return self.conn.total_changes()

    def sync_wal(self) -> None:
        """fdatasync the WAL: every transaction committed before this call is durable
        when it returns. Safe from another thread while the connection commits more.

        The WAL is opened once and kept open (closed with the connection): an fsync is
        one system call, not three, each of which takes the GIL back from a busy loop.
        SQLite keeps its WAL file (truncating it at most) while this connection is open;
        were the file unlinked meanwhile, this descriptor still names the one SQLite
        writes to, where opening the path again would sync another file or none."""
        if _vfs():  # a simulated power cut (tests, the chaos harness): the VFS sees this sync too
            from piwf.store.sqlite import powercut
            vfs = powercut.armed()
            assert vfs is not None
            return vfs.sync_path(f"{self.path}-wal")
        fd = self._wal_fd
        if fd is None:
            try:
                fd = os.open(f"{self.path}-wal", os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:  # no WAL: everything is in the database file, synced by its checkpoint
                return
            self._wal_fd = fd
        os.fdatasync(fd)

    def quick_check(self) -> None:
        """SQLite's ``quick_check``: every b-tree page readable and well formed (it reads the
        whole file; it skips what ``integrity_check`` adds: index contents against tables).
        Raises CorruptStateError with its first finding."""
        try:
            finding = str(self.conn.execute("PRAGMA quick_check(1)").fetchall()[0][0])
        except apsw.Error as exc:
            raise CorruptStateError(f"{self.path} is damaged (quick_check failed: {exc}). {DAMAGE_HINT}") from exc
        if finding != "ok":
            finding = finding.replace("*** in database main ***", "").strip()
            raise CorruptStateError(f"{self.path} is damaged (quick_check: {finding}). {DAMAGE_HINT}")

    def _configure(self, durability: str) -> None:
        self.conn.execute("PRAGMA journal_mode = WAL")
        self.conn.execute(f"PRAGMA synchronous = {durability.upper()}")
        self.conn.execute("PRAGMA foreign_keys = ON")

    def _is_empty(self) -> bool:
        app_id, version = self._layout()
        return app_id == 0 and version == 0 and not self._tables()

    def _create(self) -> None:
        with self.write():
            self.conn.execute(SCHEMA_SQL)
            self.conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
            self.conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        for name in (self.path, Path(f"{self.path}-wal"), Path(f"{self.path}-shm")):
            if name.exists():
                os.chmod(name, 0o600)

    def _migrate(self) -> None:
        """Bring an older layout up to date, all steps in one transaction."""
        _, version = self._layout()
        if version == SCHEMA_VERSION:
            return
        with self.write():
            for step in range(version, SCHEMA_VERSION):
                self.conn.execute(MIGRATIONS[step])
            self.conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    def _check_layout(self) -> None:
        app_id, version = self._layout()
        if app_id != APPLICATION_ID:
            raise SchemaError(f"{self.path} is not a piwf state database (application id {app_id:#x}). {RESET_HINT}")
        if version > SCHEMA_VERSION:
            raise SchemaError(
                f"{self.path} has layout {version}, newer than this piwf understands ({SCHEMA_VERSION}). {RESET_HINT}"
            )
        if version < 1:
            raise SchemaError(f"{self.path} has an unknown layout {version}. {RESET_HINT}")
        missing = sorted(set(REQUIRED_TABLES) - self._tables())
        if missing:
            raise SchemaError(f"{self.path} is missing tables {', '.join(missing)}. {RESET_HINT}")

    def _layout(self) -> tuple[int, int]:
        app_id: Any = self.conn.execute("PRAGMA application_id").fetchall()[0][0]
        version: Any = self.conn.execute("PRAGMA user_version").fetchall()[0][0]
        return int(app_id), int(version)

    def _tables(self) -> set[str]:
        rows = self.conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
        return {name for (name,) in rows}

    # --- what changed: store/sql/run_detail.py keeps an answer while nothing did ------------

    def own_version(self) -> tuple[int, int] | None:
        """A value that changes with every commit this connection makes, and with every
        other connection's commit this connection has read past (SQLite's data version of
        the file as this connection last read it, and the rows it has changed); None while
        a transaction is open, when what it reads may not be committed. No statement, no
        system call: the commits of other connections it does not see (``others_version``)."""
        conn = self.conn
        if self._depth or conn.in_transaction:
            return None
        return conn.data_version(), conn.total_changes()

    def others_version(self) -> int:
        """``PRAGMA data_version``: changes with every commit another connection, of this
        process or any other, made since this connection last read the file (one read
        transaction of its own)."""
        try:
            (version,), = self._versions.execute("PRAGMA data_version")  # read to its end: nothing left open
        except apsw.Error as exc:
            raise _translate(exc, self.path) from exc
        return int(version)

    # --- statements -------------------------------------------------------------------

    def write(self) -> _Write:
        """A write transaction; nested calls join the outer one."""
        return _Write(self)

    def check_file(self) -> None:
        """Refuse to write (``StorageUnavailable``) when the file at ``path`` is no longer the
        one this connection has open: deleted, or replaced by another file. SQLite would
        go on writing into the open, unlinked file, and a restart would find none of it.
        One ``stat`` per write transaction; logged once, as an error."""
        if self.file_id is None:
            return
        try:
            now = _file_id(self.path)
        except FileNotFoundError:
            now = None
        except OSError:
            return  # the directory is unreadable: SQLite's own error says so when it matters
        if now == self.file_id:
            return
        if self.lost is None:
            what = "deleted" if now is None else "replaced by another file"
            self.lost = (f"the state database {self.path} was {what} while the host ran: nothing more is written "
                         f"to it. {_open_copy(self.path)}Stop the host, put the database back, and start it again")
            log.error("%s", self.lost)
        raise StorageUnavailable(f"{self.lost}; nothing was changed")

    def _rollback(self) -> None:
        # SQLite rolls some failures back by itself (SQLITE_FULL, SQLITE_IOERR): then there
        # is no transaction left to roll back.
        if not self.conn.in_transaction:
            return
        self.conn.execute("ROLLBACK")

    def in_write(self) -> bool:
        return self._depth > 0

    def read(self) -> _Read:
        """Several reads from one snapshot of the database (and one WAL read lock, not one each)."""
        return _Read(self)

    def execute(self, sql: str, params: Any = ()) -> Any:  # an apsw.Cursor; its rows are untyped SQL values
        if self.fenced is not None and "run_queue" in sql:
            self.fenced = None  # the claim's row may change: the next fence runs again
        if self.revised is not None and ("revision" in sql or "DELETE" in sql):
            self.revised = None  # a revision may change: read it again
        try:
            return self.conn.execute(sql, params)
        except apsw.Error as exc:
            raise _translate(exc, self.path) from exc

    def one(self, sql: str, params: Any = ()) -> Any:
        for row in self.execute(sql, params):
            return row
        return None

    def scalar(self, sql: str, params: Any = ()) -> Any:
        row = self.one(sql, params)
        return None if row is None else row[0]

    def changes(self) -> int:
        return self.conn.changes()

    # --- dialect: one writer at a time (BEGIN IMMEDIATE) already makes each read current ---

    def lock_rows(self, of: str | None = None, *, skip_locked: bool = False) -> str:
        return ""

    def lock_key(self, namespace: str, key: str) -> None:
        return None

    def try_lock_key(self, namespace: str, key: str) -> bool:
        return True

    def event_horizon(self) -> int | None:
        return None  # one writer at a time: event ids commit in the order they are given

    # --- blobs ------------------------------------------------------------------------



class _Write:
    """``Database.write()``. A class, not a generator: a host run enters about 35 of these
    (most of them nested), and a generator-based context manager costs 2 µs more each."""

    __slots__ = ("db", "outer")

    def __init__(self, db: Database) -> None:
        self.db = db
        self.outer = False

    def __enter__(self) -> Database:
        db = self.db
        if db._depth:
            db._depth += 1
            return db
        db.check_file()
        db.fenced = db.revised = None
        try:
            db.conn.execute("BEGIN IMMEDIATE")
        except apsw.Error as exc:
            raise _translate(exc, db.path) from exc
        db._depth = 1
        self.outer = True
        return db

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        db = self.db
        if not self.outer:
            db._depth -= 1
            return
        db._depth = 0
        db.fenced = db.revised = None
        if exc_type is not None:
            db._rollback()
            return
        try:
            db.conn.execute("COMMIT")
        except apsw.Error as error:
            db._rollback()
            raise _translate(error, db.path) from error


class _Read:
    """``Database.read()``: joins a transaction already open, else one of its own."""

    __slots__ = ("began", "db")

    def __init__(self, db: Database) -> None:
        self.db = db
        self.began = False

    def __enter__(self) -> Database:
        db = self.db
        if not (db._depth or db.conn.in_transaction):
            db.execute("BEGIN")
            self.began = True
        return db

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        if self.began and self.db.conn.in_transaction:
            self.db.conn.execute("COMMIT")


def _file_id(path: Path) -> tuple[int, int]:
    info = os.stat(path)
    return info.st_dev, info.st_ino


def _open_copy(path: Path) -> str:
    """Where this process still has the deleted database open, as advice to copy it."""
    wanted = f"{os.path.realpath(path.parent)}/{path.name} (deleted)"
    try:
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/self/fd/{fd}") == wanted:
                    return (f"Until the host stops, what it held is still readable at /proc/{os.getpid()}/fd/{fd} "
                            f"(copy it back to {path}, leaving {path.name}-wal where it is, after stopping the host's "
                            "clients and before stopping the host). ")
    except OSError:
        pass
    return ""


def _verify_readonly(path: Path, verify: Callable[[Database], None]) -> None:
    """Open ``path`` read-only, check its layout, and ``verify`` it. A read-only connection
    never checkpoints the WAL into the file, so a refused database is left byte for byte."""
    probe = Database.open_readonly(path, allow_empty=True)
    try:
        if not probe._is_empty():
            verify(probe)
    except apsw.Error as exc:
        raise _translate(exc, path) from exc
    finally:
        probe.close()


def _check_header(path: Path) -> None:
    """Refuse a file that is not SQLite before apsw can 'repair' anything."""
    try:
        with open(path, "rb") as handle:
            header = handle.read(16)
    except OSError as exc:
        raise StoreError(f"cannot read {path}: {exc.strerror}") from exc
    if header and header != b"SQLite format 3\x00":
        raise CorruptStateError(f"{path} is not a SQLite database (corrupt or foreign file). {RESET_HINT}")


def _translate(exc: apsw.Error, path: Path) -> StoreError:
    if isinstance(exc, apsw.ConstraintError):
        return ConstraintViolation(f"constraint violated: {exc}")
    if isinstance(exc, (apsw.NotADBError, apsw.CorruptError)):
        return CorruptStateError(f"{path} is corrupt: {exc}. {RESET_HINT}")
    if isinstance(exc, apsw.FullError):
        return StorageFull(f"disk full writing {path}: nothing was changed; free space and retry")
    if isinstance(exc, apsw.BusyError):
        return StorageUnavailable(f"{path} is busy (another writer held it for {BUSY_TIMEOUT_MS} ms); retry")
    if isinstance(exc, STORAGE_ERRORS):
        return StorageUnavailable(f"storage error on {path}: {exc}; the request was not carried out: "
                                  "retry once the storage is healthy")
    return StoreError(f"database error on {path}: {exc}")


# The storage under the database failed, not the request: worth retrying, never the
# client's fault (SQLITE_IOERR and its extended codes, SQLITE_CANTOPEN, SQLITE_READONLY,
# SQLITE_LOCKED, SQLITE_PROTOCOL, SQLITE_NOLFS).
STORAGE_ERRORS = (apsw.IOError, apsw.CantOpenError, apsw.ReadOnlyError, apsw.LockedError, apsw.ProtocolError,
                  apsw.NoLFSError)
