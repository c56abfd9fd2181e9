"""The SQLite backend of the store: the apsw connection (``db.py``), the schema and its
migrations, the group commit, the host lease, and ``SqliteStore`` (``backend.py``), which
implements ``piwf.store.api.Store`` with the aggregates' SQL of ``piwf.store.sql`` run on
its ``Database``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from piwf.store.sqlite.db import Database

if TYPE_CHECKING:
    from piwf.store.sqlite.backend import SqliteStore, open_store


def __getattr__(name: str) -> Any:  # the backend imports every module of this package: on first use
    if name in ("SqliteStore", "open_store"):
        from piwf.store.sqlite import backend
        return getattr(backend, name)
    raise AttributeError(name)


__all__ = ["Database", "SqliteStore", "open_store"]
