"""Creating, checking and migrating piwf's schema on PostgreSQL, under an advisory lock.

Every host opening the store takes the same transaction-scoped advisory lock (keyed by the
schema's name) before it looks, so of several hosts starting at once one creates or
migrates and the others then find the layout done. The checks are SQLite's: a schema with
tables but no layout row of piwf's is refused, and so is a newer layout, in a transaction
that is rolled back — nothing is written to a schema that is refused.
"""

from __future__ import annotations

from psycopg import sql

from piwf.errors import SchemaError
from piwf.store.postgres.db import PgDatabase
from piwf.store.postgres.schema import APPLICATION, LAYOUT_VERSION, MIGRATIONS, REQUIRED_TABLES, SCHEMA_SQL

HINT = "Name another schema in the store URL (?schema=NAME), or use the piwf that created it."


def prepare(db: PgDatabase, schema: str) -> None:
    with db.write():
        _wait_for_layout_lock(db, schema)
        tables = {name for (name,) in db.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = ?", (schema,))}
        if not tables:
            _create(db, schema)
            return
        version = _check(db, schema, tables)
        for step in range(version, LAYOUT_VERSION):
            db.conn.execute(MIGRATIONS[step])
        if version != LAYOUT_VERSION:
            db.execute("UPDATE piwf_layout SET version = ? WHERE id = 1", (LAYOUT_VERSION,))


def _wait_for_layout_lock(db: PgDatabase, schema: str) -> None:
    """Wait for the host creating or migrating the layout, if one is: as long as one of its
    statements may run (``statement_timeout``, which bounds this wait too), not only the
    ``lock_timeout`` (5 s) that row locks get, so a host starting during a long migration
    waits for it rather than failing; the lock timeout is back in force for what follows."""
    lock_timeout = db.scalar("SELECT current_setting('lock_timeout')")
    db.execute("SELECT set_config('lock_timeout', '0', true)")
    db.execute("SELECT pg_advisory_xact_lock(hashtext(?))", (f"piwf.layout:{schema}",))
    db.execute("SELECT set_config('lock_timeout', ?, true)", (lock_timeout,))


def check(db: PgDatabase, schema: str) -> None:
    """The checks alone, for a reader (``piwf status``): nothing is created or migrated."""
    tables = {name for (name,) in db.execute(
        "SELECT table_name FROM information_schema.tables WHERE table_schema = ?", (schema,))}
    if not tables:
        raise SchemaError(f"schema {schema!r} of {db.where} holds no piwf store (a host creates it on its first start)")
    if _check(db, schema, tables) != LAYOUT_VERSION:
        raise SchemaError(f"schema {schema!r} of {db.where} has an older layout: start a host to migrate it")


def _create(db: PgDatabase, schema: str) -> None:
    exists = db.scalar("SELECT 1 FROM pg_namespace WHERE nspname = ?", (schema,))
    if not exists:
        db.conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
    db.conn.execute(SCHEMA_SQL)
    db.execute("INSERT INTO piwf_layout (id, application, version) VALUES (1, ?, ?)", (APPLICATION, LAYOUT_VERSION))


def _check(db: PgDatabase, schema: str, tables: set[str]) -> int:
    where = f"schema {schema!r} of {db.where}"
    if "piwf_layout" not in tables:
        raise SchemaError(f"{where} holds tables that are not piwf's (no piwf_layout table). {HINT}")
    row = db.one("SELECT application, version FROM piwf_layout WHERE id = 1")
    if row is None or row[0] != APPLICATION:
        raise SchemaError(f"{where} is not piwf's (its layout row names {row and row[0]!r}). {HINT}")
    version = int(row[1])
    if version > LAYOUT_VERSION:
        raise SchemaError(f"{where} has layout {version}, newer than this piwf understands ({LAYOUT_VERSION}). "
                          f"{HINT}")
    if version < 1:
        raise SchemaError(f"{where} has an unknown layout {version}. {HINT}")
    missing = sorted(set(REQUIRED_TABLES) - tables)
    if missing:
        raise SchemaError(f"{where} is missing tables {', '.join(missing)}. {HINT}")
    return version
