"""The backends the conformance suite runs against: one entry per backend in BACKENDS.

A backend opens stores on one database of its own (a test's tmp_path for SQLite); every
store it opens sees the same data, as several hosts sharing one database would. Stores
take the test's clock: a ManualClock decides every expiry.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

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


BACKENDS: dict[str, type[Backend]] = {
    "sqlite": SqliteBackend,
}
