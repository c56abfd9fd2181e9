"""Shared steps of the conformance tests, through the store interface only."""

from __future__ import annotations

from typing import Any

from piwf.clock import ManualClock

LEASE = 30_000
RUNNER = "h"


async def new_run(store: Any, clock: ManualClock, run_id: str = "r1", session: str | None = None,
                  input: Any = None) -> None:
    """A queued run; the clock moves on a millisecond (creation orders claims)."""
    await store.runs.create_run(run_id=run_id, workflow="w", project_path="/p", source=b"src", digest="d1",
                                input={"n": 1} if input is None else input, origin_session_id=session,
                                now=clock.now_ms())
    clock.advance(1)


async def claim(store: Any, clock: ManualClock, *, epoch: int = 1, exclude: frozenset[str] = frozenset(),
                lease_ms: int = LEASE) -> Any:
    """The oldest claimable run's claim, or None."""
    got = await claims(store, clock, room=1, epoch=epoch, exclude=exclude, lease_ms=lease_ms)
    return got[0][0] if got else None


async def claims(store: Any, clock: ManualClock, *, room: int = 1, epoch: int = 1,
                 exclude: frozenset[str] = frozenset(), lease_ms: int = LEASE) -> list[tuple[Any, str]]:
    """Up to ``room`` (claim, worker id) pairs."""
    return await store.supervision.claim_runs(room=room, exclude=exclude, runner_id=RUNNER, lease_ms=lease_ms,
                                              now=clock.now_ms(), epoch=epoch)


async def statuses(store: Any, run_id: str = "r1") -> tuple[str, str]:
    run = await store.runs.run_summary(run_id)
    return run.status, run.queueStatus


async def running(store: Any, clock: ManualClock, run_id: str = "r1", session: str | None = "s1",
                  node: str = "n") -> tuple[str, str]:
    """A claimed run with a running attempt at seq 0: (token, attempt id)."""
    await new_run(store, clock, run_id, session=session)
    others = frozenset(r.runId for r in await store.runs.list_runs(limit=1000)) - {run_id}
    got = await claim(store, clock, exclude=others)
    assert got is not None and got.run_id == run_id
    attempt_id, _ = await store.runs.start_attempt(run_id, got.token, seq=0, node=node, generation=got.generation,
                                                   now=clock.now_ms())
    return got.token, attempt_id
