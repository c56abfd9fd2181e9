"""Timestamps in receipts: ISO 8601 UTC with milliseconds."""

from __future__ import annotations

import time
from typing import overload


@overload
def iso(ms: int) -> str: ...
@overload
def iso(ms: None) -> None: ...
@overload
def iso(ms: int | None) -> str | None: ...
def iso(ms: int | None) -> str | None:
    """``2026-11-30T09:27:40.123Z``; receipts carry many, so this avoids datetime objects."""
    if ms is None:
        return None
    seconds, millis = divmod(ms, 1000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{millis:03d}Z"
