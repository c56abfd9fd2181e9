"""Time as integer milliseconds, from an injectable clock."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now_ms(self) -> int: ...


class WallClock:
    """Production clock: wall time, so timestamps mean something to people."""

    def now_ms(self) -> int:
        return time.time_ns() // 1_000_000


class TrioClock:
    """Wall time at construction, advanced by trio's clock.

    Under ``autojump_clock`` leases expire exactly as fast as trio's sleeps advance, so
    lease logic is tested without real waiting.
    """

    def __init__(self, base_ms: int | None = None) -> None:
        import trio

        self._trio = trio
        self._base = WallClock().now_ms() if base_ms is None else base_ms
        self._start = trio.current_time()

    def now_ms(self) -> int:
        return self._base + int((self._trio.current_time() - self._start) * 1000)


class ManualClock:
    """A clock that moves only when told; for unit tests of pure store logic."""

    def __init__(self, now_ms: int = 1_700_000_000_000) -> None:
        self.now = now_ms

    def now_ms(self) -> int:
        return self.now

    def advance(self, ms: int) -> None:
        self.now += ms
