"""How a backend runs the aggregates' module functions: a ``Runner`` (SQLite's ``Inline``;
PostgreSQL's in ``piwf.store.postgres.runner``)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Concatenate, ParamSpec, Protocol, TypeVar

from piwf.errors import StoreError
from piwf.store.sql.database import Database

_T = TypeVar("_T")
_P = ParamSpec("_P")


class Runner(Protocol):
    """How a backend runs a module function: ``await call(function, *args)`` runs
    ``function(db, *args)`` on the backend's ``Database`` and returns what it returns."""

    async def __call__(self, function: Callable[Concatenate[Database, _P], _T], /, *args: _P.args,
                       **kwargs: _P.kwargs) -> _T: ...


class Inline:
    """SQLite's runner: the function runs at once, on the trio loop, on the one connection."""

    __slots__ = ("db",)

    def __init__(self, db: Database) -> None:
        self.db = db

    async def __call__(self, function: Callable[Concatenate[Database, _P], _T], /, *args: _P.args,
                       **kwargs: _P.kwargs) -> _T:
        return function(self.db, *args, **kwargs)


def drive(awaitable: Awaitable[_T]) -> _T:
    """Run ``store.run_unit``'s work, whose awaits are all store calls that complete at
    once (inline), to its end without an event loop; work that suspends (it awaited
    something else: a checkpoint, a lock, another task) is closed and refused."""
    steps = awaitable.__await__()
    try:
        steps.send(None)
    except StopIteration as done:
        result: _T = done.value
        return result
    steps.close()
    raise StoreError("a unit of work awaited something other than its store calls: nothing of it was committed")
