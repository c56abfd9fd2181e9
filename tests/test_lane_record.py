"""Recording a worker's end: what the lane keeps when the store cannot take it in time.

The SQLite store never checkpoints inside a call, so its ends are written at once; a
backend that goes through threads can take time, and the drain deadline can pass first.
The lane then keeps the end for the dispatcher's next round instead of losing it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import trio

from piwf.host import lane
from piwf.host.lane_state import LaneState


@dataclass
class _Claim:
    key: str


@dataclass
class _End:
    active: Any


@dataclass
class _Active:
    claim: _Claim
    label: str = "run r1"


@dataclass
class _Host:
    drain_deadline: float = float("inf")


@dataclass
class _Lane:
    """The two parts of a lane that recording an end uses, with a store that takes
    ``write_s`` to answer (or refuses)."""

    host: _Host
    write_s: float
    accept: bool = True
    state: LaneState[Any, Any] = field(default_factory=LaneState)

    def key(self, claim: _Claim) -> str:
        return claim.key

    async def write_end(self, end: _End) -> bool:
        await trio.sleep(self.write_s)
        return self.accept


async def test_an_end_written_in_time_is_not_kept(autojump_clock: trio.testing.MockClock) -> None:
    work = _Lane(_Host(), write_s=0.1)
    await lane.record_end(work, _End(_Active(_Claim("r1"))))
    assert work.state.unrecorded == {}


async def test_an_end_the_store_refused_is_kept_for_the_next_round(autojump_clock: trio.testing.MockClock) -> None:
    work = _Lane(_Host(), write_s=0.1, accept=False)
    end = _End(_Active(_Claim("r1")))
    await lane.record_end(work, end)
    assert work.state.unrecorded == {"r1": end}


async def test_an_end_cut_short_by_the_drain_deadline_is_kept_even_when_cancelled(
        autojump_clock: trio.testing.MockClock) -> None:
    work = _Lane(_Host(drain_deadline=trio.current_time() + 1), write_s=60)
    end = _End(_Active(_Claim("r1")))
    with trio.CancelScope() as outer:
        outer.cancel()  # the host is stopping: the recording is shielded, bounded by the drain
        await lane.record_end(work, end)
    assert work.state.unrecorded == {"r1": end}
    assert trio.current_time() < 2  # it gave up at the drain deadline, not after the store's 60 s
