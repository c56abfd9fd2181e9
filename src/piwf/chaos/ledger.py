"""The outside world of the chaos harness: a ledger file that an effect appends one line to.

The workflow and the controller the harness installs import ``effect`` in their workers
(``from piwf.chaos.ledger import effect``); the harness reads the ledger back with
``entries``. It imports only the standard library.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def effect(ledger: Path, entry: str, field: str) -> tuple[Callable[[], dict[str, Any]],
                                                          Callable[[], dict[str, Any] | None]]:
    """``apply`` and ``observe`` of an effect whose outside world is the line ``entry`` of
    ``ledger``: ``apply`` appends it (synced) and answers ``{field: entry}``; ``observe``
    answers the same once the line is there, else ``None``."""

    def apply() -> dict[str, Any]:
        with ledger.open("a") as handle:
            handle.write(entry + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        time.sleep(0.01)  # a window for kills between apply and settle
        return {field: entry}

    def observe() -> dict[str, Any] | None:
        return {field: entry} if entry in entries(ledger) else None

    return apply, observe


def entries(ledger: Path) -> list[str]:
    """The ledger's lines, oldest first (none before the first effect applied)."""
    return ledger.read_text().splitlines() if ledger.exists() else []
