"""Fixtures of the conformance suite: a store per backend, seen only through its interface.

``store`` is a real store of each backend in BACKENDS (parametrised: adding a backend is
one entry there), on the test's ManualClock ``clock``, wrapped in a Recording that lets
through only what the interface declares and records each method called. The last test of
the session (test_interface_coverage.py) fails if some interface method was never called,
when the conformance suite ran as a whole; ``WHOLE`` says whether it did.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from piwf.clock import Clock, ManualClock

from .backends import BACKENDS, Backend
from .recording import COVERAGE, Recording

HERE = Path(__file__).parent
COVERAGE_CHECK = "test_interface_coverage.py"
WHOLE = pytest.StashKey[bool]()
_DESELECTED = pytest.StashKey[bool]()

OpenStore = Callable[..., Awaitable[Any]]


@pytest.fixture(params=sorted(BACKENDS))
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    """Each backend in turn; a test marked ``lease(shape)`` only where the host lease has that shape."""
    if request.param == "postgresql":
        chosen = BACKENDS[request.param](tmp_path, request.getfixturevalue("postgres"))
    else:
        chosen = BACKENDS[request.param](tmp_path)
    marker = request.node.get_closest_marker("lease")
    if marker is not None and marker.args[0] != chosen.lease:
        pytest.skip(f"the {chosen.name} backend's host lease is of the {chosen.lease!r} shape")
    yield chosen
    chosen.release()  # after open_store's teardown (it depends on this): its stores are closed


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
async def open_store(backend: Backend, clock: ManualClock) -> AsyncIterator[OpenStore]:
    """Opens another store on the same database (another host's view of it), or on another
    ``database`` of the backend's (empty when first opened); the test's clock unless given
    one. Stores still open at the end are closed."""
    from .interface import store_protocol

    opened: list[Any] = []
    record = COVERAGE.recorder(backend.name)

    async def open_one(on: Clock | None = None, database: str = "conformance") -> Any:
        real = await backend.open(clock if on is None else on, database)
        opened.append(real)
        return Recording(real, store_protocol(), record)

    yield open_one
    for real in reversed(opened):
        await backend.close(real)


@pytest.fixture
async def store(open_store: OpenStore) -> Any:
    return await open_store()


# --- was the suite run as a whole? --------------------------------------------------------


def _inside(path: Path) -> bool:
    return path == HERE or HERE in path.parents


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_DESELECTED] = False
    config.addinivalue_line("markers", "lease(shape): a conformance test of one shape of the host lease "
                                       "('directory' or 'host'; see piwf.store.api)")


def pytest_deselected(items: list[pytest.Item]) -> None:
    for item in items:
        if _inside(item.path):
            item.config.stash[_DESELECTED] = True


def _selects_part_of_a_file(config: pytest.Config) -> bool:
    """A test named on the command line (``file.py::test``) inside the suite."""
    for arg in config.args:
        path, sep, _ = arg.partition("::")
        if sep and _inside((config.invocation_params.dir / path).resolve()):
            return True
    return False


def pytest_itemcollected(item: pytest.Item) -> None:
    """Under pytest-xdist (``--dist loadgroup``) the whole suite runs in one worker, so that
    its last test sees what every other one called."""
    if _inside(item.path):
        item.add_marker(pytest.mark.xdist_group("conformance"))


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The coverage check runs last; it checks only when every conformance test was selected."""
    mine = [item for item in items if _inside(item.path)]
    if not mine:
        return
    checks = [item for item in mine if item.path.name == COVERAGE_CHECK]
    for item in checks:
        items.remove(item)
    items.extend(checks)
    on_disk = {path.resolve() for path in HERE.rglob("test_*.py")}
    collected = {item.path.resolve() for item in mine}
    config.stash[WHOLE] = (collected == on_disk and not config.stash.get(_DESELECTED, False)
                           and not _selects_part_of_a_file(config))
