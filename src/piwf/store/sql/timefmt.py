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
    """``2026-11-30T09:27:40.123Z``; receipts carry many, so this avoids datetime objects,
    and formats each second once (``_SECONDS``: a run's times mostly share a few)."""
    if ms is None:
        return None
    seconds, millis = divmod(ms, 1000)
    prefix = _SECONDS.get(seconds)
    if prefix is None:
        if len(_SECONDS) >= SECONDS_KEPT:
            _SECONDS.clear()
        prefix = _SECONDS[seconds] = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds))
    return prefix + _MILLIS[millis]


# Each second's formatted text, as ``time.strftime`` made it: a pure function's results,
# so nothing here can go stale; cleared whole when full (a dict, safe across threads).
SECONDS_KEPT = 4096
_SECONDS: dict[int, str] = {}
_MILLIS = tuple(f".{millis:03d}Z" for millis in range(1000))
