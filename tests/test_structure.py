"""The shape the architecture page promises, checked against the source."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest

from piwf.protocol.reconcile import RECONCILE_OPERATIONS
from piwf.protocol.worker import WORKER_OPERATIONS

ROOT = Path(__file__).resolve().parents[1]
HOST = sorted((ROOT / "src" / "piwf" / "host").glob("*.py"))
STORE_MODULES = ("hosts", "queue", "runs", "workers", "effects", "commands", "supervision", "controllers",
                 "controller_queue", "controller_effects", "delivery", "updates", "interactions", "settings",
                 "retention", "placement")


def _host_source() -> str:
    return "\n".join(path.read_text() for path in HOST)


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def test_the_host_runs_no_sql_and_opens_no_transaction_but_a_unit_of_work() -> None:
    source = _host_source()
    for forbidden in (r"\.write\(\)", r"\.read\(\)", r"BEGIN", r"COMMIT", r"\.execute\(",
                      r"\.scalar\(", r"\.one\(", r"SELECT |UPDATE |INSERT |DELETE "):
        found = re.findall(forbidden, source)
        assert not found, f"host/ has {forbidden!r}: every change is a named store operation"


def test_the_host_depends_on_the_store_interface_only() -> None:
    """host/ imports no apsw and no backend (``piwf.store.sqlite``), names no ``Database``,
    and reaches the store through ``host.store`` (``piwf.store.api``)."""
    for path in HOST:
        imported = _imports(path)
        backend = sorted(name for name in imported if name.split(".")[0] == "apsw"
                         or (name.startswith("piwf.store") and not name.startswith("piwf.store.api")))
        assert not backend, f"host/{path.name} imports {backend}: host/ depends on piwf.store.api only"
        source = path.read_text()
        assert not re.search(r"\bDatabase\b|\bhost\.db\b|\.db\.", source), f"host/{path.name} holds the database"


# What reads a database server's own clock (PostgreSQL's and SQLite's time functions).
SERVER_CLOCK = re.compile(r"\bnow\s*\(\s*\)|current_timestamp|current_date|current_time|clock_timestamp|"
                          r"statement_timestamp|transaction_timestamp|localtimestamp|localtime|timeofday|"
                          r"julianday|strftime\s*\(\s*'%s|unixepoch|'now'", re.IGNORECASE)


def test_no_store_statement_reads_the_database_servers_clock() -> None:
    """One clock: every expiry (host leases, claims, delivery and presentation leases,
    deadlines) is judged by the ``now`` its caller passes in, never by the server's time
    beside it (docs/operations.md, "One clock")."""
    for path in sorted((ROOT / "src" / "piwf" / "store").rglob("*.py")):
        found = [m.group(0) for m in SERVER_CLOCK.finditer(path.read_text())]
        assert not found, f"{path.relative_to(ROOT)} reads the server's clock ({found[0]!r}): take the caller's now"


@pytest.mark.parametrize("backend_name", ["sqlite", "postgres"])
def test_every_store_interface_method_is_implemented_by_each_backend_as_declared(backend_name: str) -> None:
    """The shared aggregates (piwf.store.sql.aggregates, ``<Name>Aggregate``) and each
    backend's own (``Sqlite<Interface>``, ``Pg<Interface>``: the hosts lease)."""
    import importlib

    from piwf.store import api
    from piwf.store.sql import aggregates

    backend = importlib.import_module(f"piwf.store.{backend_name}.backend")
    prefix, store_class = ("Sqlite", "SqliteStore") if backend_name == "sqlite" else ("Pg", "PgStore")
    store = getattr(backend, store_class).__new__(getattr(backend, store_class))
    for name in api.UnitOfWork.__annotations__:
        interface = getattr(api, inspect.get_annotations(api.UnitOfWork, eval_str=True)[name].__name__)
        shared = f"{interface.__name__.removesuffix('Store')}Aggregate"
        implementation = getattr(aggregates, shared, None) or getattr(backend, f"{prefix}{interface.__name__}")
        for method, declared in inspect.getmembers(interface, inspect.isfunction):
            if method.startswith("_"):
                continue
            implemented = getattr(implementation, method, None)
            assert implemented is not None, f"{implementation.__name__} lacks {method}"
            assert inspect.iscoroutinefunction(implemented), f"{implementation.__name__}.{method} is not async"
            assert inspect.signature(implemented) == inspect.signature(declared), f"{name}.{method}"
    for method in ("transaction", "durable", "serve", "close", "announce", "serve_wakeups"):
        assert callable(getattr(store, method, None)), method


def test_every_store_operation_the_host_calls_is_listed_on_the_architecture_page() -> None:
    source = _host_source()
    called = {f"{module}.{name}" for module, name in
              re.findall(rf"(?:(?<![\w.])|(?<=store\.)|(?<=tx\.))({'|'.join(STORE_MODULES)})\.([a-z_]+)\(", source)}
    page = (ROOT / "docs" / "architecture.md").read_text()
    missing = sorted(name for name in called if f"`{name}`" not in page)
    assert not missing, f"docs/architecture.md does not list: {missing}"


def test_every_worker_operation_is_in_the_protocol_reference() -> None:
    page = (ROOT / "docs" / "protocol.md").read_text()
    missing = sorted(op for op in {**WORKER_OPERATIONS, **RECONCILE_OPERATIONS} if f"`{op}`" not in page)
    assert not missing, missing
