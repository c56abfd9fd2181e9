"""The shape the architecture page promises, checked against the source."""

from __future__ import annotations

import re
from pathlib import Path

from piwf.protocol.reconcile import RECONCILE_OPERATIONS
from piwf.protocol.worker import WORKER_OPERATIONS

ROOT = Path(__file__).resolve().parents[1]
HOST = sorted((ROOT / "src" / "piwf" / "host").glob("*.py"))
STORE_MODULES = ("queue", "runs", "workers", "effects", "commands", "supervision", "controllers", "controller_queue",
                 "controller_effects", "delivery", "updates", "settings")


def _host_source() -> str:
    return "\n".join(path.read_text() for path in HOST)


def test_the_host_opens_no_transaction_and_runs_no_sql() -> None:
    source = _host_source()
    for forbidden in (r"\.write\(\)", r"\.read\(\)", r"BEGIN", r"COMMIT", r"\.execute\((?!host\.db, request)",
                      r"\.scalar\(", r"\.one\(", r"SELECT |UPDATE |INSERT |DELETE "):
        found = re.findall(forbidden, source)
        assert not found, f"host/ has {forbidden!r}: every change is a named store operation"


def test_every_store_operation_the_host_calls_is_listed_on_the_architecture_page() -> None:
    source = _host_source()
    called = {f"{module}.{name}" for module, name in
              re.findall(rf"(?<![\w.])({'|'.join(STORE_MODULES)})\.([a-z_]+)\(", source)}
    imported = re.findall(r"from piwf\.store\.sqlite\.hosts import ([\w, ]+)", source)
    called |= {f"hosts.{name}" for name in (imported[0].split(", ") if imported else [])}
    page = (ROOT / "docs" / "architecture.md").read_text()
    missing = sorted(name for name in called if f"`{name}`" not in page)
    assert not missing, f"docs/architecture.md does not list: {missing}"


def test_every_worker_operation_is_in_the_protocol_reference() -> None:
    page = (ROOT / "docs" / "protocol.md").read_text()
    missing = sorted(op for op in {**WORKER_OPERATIONS, **RECONCILE_OPERATIONS} if f"`{op}`" not in page)
    assert not missing, missing
