"""The recording proxy itself, on a small interface of its own."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Protocol

import pytest

from .recording import Coverage, Recording, interface_methods, protocols_of


class Counter(Protocol):
    async def add(self, n: int) -> int: ...

    def peek(self) -> int: ...


class Unit(Protocol):
    counter: Counter

    async def note(self, text: str) -> None: ...


class Toy(Protocol):
    counter: Counter

    @property
    def unit_of_work(self) -> Unit: ...

    def transaction(self) -> AbstractAsyncContextManager[Unit]: ...

    async def never_called(self) -> None: ...


class RealCounter:
    def __init__(self) -> None:
        self.n = 0
        self.secret = "backend detail"

    async def add(self, n: int) -> int:
        self.n += n
        return self.n

    def peek(self) -> int:
        return self.n


class RealUnit:
    def __init__(self, counter: RealCounter) -> None:
        self.counter = counter
        self.notes: list[str] = []

    async def note(self, text: str) -> None:
        self.notes.append(text)


class RealToy:
    def __init__(self) -> None:
        self.counter = RealCounter()
        self.unit_of_work = RealUnit(self.counter)
        self.db = "a concrete database"

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[RealUnit]:
        yield self.unit_of_work

    async def never_called(self) -> None:
        raise AssertionError


def toy() -> tuple[Toy, Coverage]:
    coverage = Coverage()
    return Recording(RealToy(), Toy, coverage.recorder("toy")), coverage  # type: ignore[return-value]


def test_the_interface_is_every_method_its_protocols_declare() -> None:
    import sys

    found = {p.__name__ for p in protocols_of([sys.modules[__name__]])}
    assert found == {"Counter", "Unit", "Toy"}
    assert interface_methods([Counter, Unit, Toy]) == {
        ("Counter", "add"), ("Counter", "peek"), ("Unit", "note"), ("Toy", "transaction"), ("Toy", "never_called")}


async def test_calls_through_attributes_properties_and_transactions_are_recorded() -> None:
    store, coverage = toy()
    assert await store.counter.add(2) == 2
    assert store.unit_of_work.counter.peek() == 2
    async with store.transaction() as unit:
        await unit.note("hi")
        assert await unit.counter.add(1) == 3
    assert coverage.calls["toy"] == {("Counter", "add"), ("Counter", "peek"), ("Toy", "transaction"),
                                     ("Unit", "note")}
    required = interface_methods([Counter, Unit, Toy])
    assert coverage.missing(required) == {"toy": [("Toy", "never_called")]}


async def test_what_the_interface_does_not_declare_is_out_of_reach() -> None:
    store, _ = toy()
    with pytest.raises(AttributeError, match="not part of the store interface Toy"):
        store.db  # noqa: B018
    with pytest.raises(AttributeError, match="not part of the store interface Counter"):
        store.counter.secret  # noqa: B018
    with pytest.raises(AttributeError, match="through its interface"):
        store.counter = None  # type: ignore[misc]


async def test_a_call_that_raises_is_still_recorded() -> None:
    store, coverage = toy()
    with pytest.raises(AssertionError):
        await store.never_called()
    assert coverage.calls["toy"] == {("Toy", "never_called")}


def test_a_backend_never_exercised_is_not_reported() -> None:
    coverage = Coverage()
    coverage.recorder("postgres")
    assert coverage.missing({("Toy", "transaction")}) == {}


def test_the_suite_reaches_no_backend() -> None:
    """Conformance tests import no backend, no database driver and no SQL module: only
    backends.py opens stores, and only through piwf.store.api.open_store."""
    import ast
    from pathlib import Path

    forbidden = ("apsw", "sqlite3", "psycopg", "piwf.store.sqlite", "piwf.store.postgres")
    offending = []
    for path in sorted(Path(__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            for name in names:
                store_module = name.startswith("piwf.store") and not name.startswith("piwf.store.api")
                if name.startswith(forbidden) or store_module:
                    offending.append(f"{path.name}: {name}")
    assert offending == []
