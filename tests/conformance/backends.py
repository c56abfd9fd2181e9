"""The backends the conformance suite runs against: one entry per backend in BACKENDS.

A backend opens stores on one database of its own (a test's tmp_path for SQLite); every
store it opens sees the same data, as several hosts sharing one database would. Stores
take the test's clock: a ManualClock decides every expiry.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import secrets

import trio

from piwf.clock import Clock


class Backend(Protocol):
    name: str
    # The shape of the host lease (piwf.store.api: where backends differ): "directory", one
    # lease per state directory taken over by the flock's holder (owner_dead); "host", one
    # lease row per host. Tests of one shape are marked ``@pytest.mark.lease(shape)``.
    lease: str

    async def open(self, clock: Clock, database: str = "conformance") -> Any:
        """A new store on this backend's database of that name (made empty when first opened)."""

    async def close(self, store: Any) -> None: ...


class SqliteBackend:
    name = "sqlite"
    lease = "directory"

    def __init__(self, tmp_path: Path) -> None:
        self.root = tmp_path

    async def open(self, clock: Clock, database: str = "conformance") -> Any:
        from piwf.store.api import open_store

        # SQLite's clock is the caller's: its methods take ``now``
        return open_store(self.root / f"{database}.db", backend=self.name)

    async def close(self, store: Any) -> None:
        await store.close()


class PostgresBackend:
    """Stores on the session's PostgreSQL server (tests/conftest.py ``postgres``), a schema
    per test and database name; every store opened on one database shares its host lease
    row, as the hosts of one state directory do."""

    name = "postgresql"
    lease = "directory"

    def __init__(self, tmp_path: Path, postgres: Any = None) -> None:
        self.root = tmp_path
        self.postgres = postgres
        self.prefix = f"c{secrets.token_hex(5)}"

    async def open(self, clock: Clock, database: str = "conformance", directory: str | None = None) -> Any:
        """``directory``: the host's state directory (its lease row), else one per database."""
        from piwf.store.api import open_store
        from tests.conftest import pg_store_url

        url = pg_store_url(self.postgres, f"{self.prefix}_{database}")
        lease_row = directory or f"conformance-{database}"
        # PostgreSQL's clock is the caller's too (piwf.store.api: Time)
        return await trio.to_thread.run_sync(
            lambda: open_store(self.root, url=url, directory=lease_row, pool_size=4))

    async def close(self, store: Any) -> None:
        await store.close()

    async def empty(self, database: str = "conformance") -> None:
        """Every row of that database's tables deleted, its layout kept (and sequences
        restarted): a fresh store again, far cheaper than a new schema (the model test's
        examples)."""
        import psycopg
        from psycopg import sql

        from tests.conftest import pg_store_url
        from piwf.store.postgres.url import parse

        parsed = parse(pg_store_url(self.postgres, f"{self.prefix}_{database}"))

        def truncate() -> None:
            with psycopg.connect(parsed.conninfo, autocommit=True) as conn:
                tables = [row[0] for row in conn.execute(
                    "SELECT tablename FROM pg_tables WHERE schemaname = %s AND tablename <> 'piwf_layout'",
                    (parsed.schema,))]
                names = sql.SQL(", ").join(sql.Identifier(parsed.schema, table) for table in tables)
                conn.execute(sql.SQL("TRUNCATE {} RESTART IDENTITY").format(names))

        await trio.to_thread.run_sync(truncate)

    async def lock_waits(self) -> int:
        """How many of the server's connections wait for a lock now (interleaving tests)."""
        from tests.pg_probe import lock_waits

        return await trio.to_thread.run_sync(lock_waits, self.postgres.url())


BACKENDS: dict[str, type[Backend]] = {
    "sqlite": SqliteBackend,
    "postgresql": PostgresBackend,
}
