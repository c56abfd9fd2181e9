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

    def release(self) -> None:
        """The test is over (its stores are closed): what it held may serve the next test."""


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

    def release(self) -> None:
        return None  # a test's databases are files in its tmp_path


# Schemas of finished tests, for the next ones (per server): making a schema's tables costs
# ~0.3 s here, emptying one ~0.05 s, and the suite opens hundreds.
_FREE_SCHEMAS: dict[str, list[str]] = {}


class PostgresBackend:
    """Stores on the session's PostgreSQL server (tests/conftest.py ``postgres``), a schema
    per test and database name; every store opened on one database shares its host lease
    row, as the hosts of one state directory do. A schema is made for the test, or is one an
    earlier test used, emptied (every row deleted, sequences restarted, the layout kept);
    ``release`` gives the test's schemas back once its stores are closed."""

    name = "postgresql"
    lease = "directory"

    def __init__(self, tmp_path: Path, postgres: Any = None) -> None:
        self.root = tmp_path
        self.postgres = postgres
        self.prefix = f"c{secrets.token_hex(5)}"
        self.schemas: dict[str, str] = {}  # database name -> its schema
        self.open_stores = 0
        self.free = _FREE_SCHEMAS.setdefault(postgres.url() if postgres is not None else "", [])

    async def open(self, clock: Clock, database: str = "conformance", directory: str | None = None) -> Any:
        """``directory``: the host's state directory (its lease row), else one per database."""
        from piwf.store.api import open_store

        url = await self._url(database)
        lease_row = directory or f"conformance-{database}"
        # PostgreSQL's clock is the caller's too (piwf.store.api: Time)
        store = await trio.to_thread.run_sync(
            lambda: open_store(self.root, url=url, directory=lease_row, pool_size=4))
        self.open_stores += 1
        return store

    async def close(self, store: Any) -> None:
        await store.close()
        self.open_stores -= 1

    async def _url(self, database: str) -> str:
        from tests.conftest import pg_store_url
        from tests.pg_probe import empty_schema

        if database not in self.schemas:
            if self.free:
                schema = self.free.pop()
                await trio.to_thread.run_sync(empty_schema, pg_store_url(self.postgres, schema))
            else:
                schema = f"{self.prefix}_{database}"
            self.schemas[database] = schema
        return pg_store_url(self.postgres, self.schemas[database])

    def release(self) -> None:
        """The test is over: its schemas are the next tests' (unless a store of it is still
        open, then they are left alone)."""
        if self.open_stores == 0:
            self.free.extend(self.schemas.values())
        self.schemas = {}

    async def empty(self, database: str = "conformance") -> None:
        """A fresh store again on that database (the model test's examples)."""
        from tests.pg_probe import empty_schema

        await trio.to_thread.run_sync(empty_schema, await self._url(database))

    async def lock_waits(self) -> int:
        """How many of the server's connections wait for a lock now (interleaving tests)."""
        from tests.pg_probe import lock_waits

        return await trio.to_thread.run_sync(lock_waits, self.postgres.url())


BACKENDS: dict[str, type[Backend]] = {
    "sqlite": SqliteBackend,
    "postgresql": PostgresBackend,
}
