"""Run updates (``ctx.publish``) and the ``run.watch`` pages."""

from __future__ import annotations

from typing import Any

import pytest

from piwf.clock import ManualClock
from piwf.errors import ClaimLost, Rejected

from .helpers import new_run, running


async def publish(store: Any, token: str, attempt: str, data: Any, *, run_id: str = "r1", type: str = "progress",
                  key: str = "rows", now: int = 1) -> int:
    async with store.transaction() as tx:  # inside the worker message's unit of work
        return await tx.updates.publish(run_id, token, attempt_id=attempt, type=type, key=key, data=data, now=now)


async def test_an_update_replaces_its_value_only_from_the_live_attempt(store: Any, clock: ManualClock) -> None:
    token, attempt = await running(store, clock)
    first = await publish(store, token, attempt, 1, now=1)
    second = await publish(store, token, attempt, 2, now=2)
    [update] = (await store.runs.get_run("r1")).updates
    assert (update.data, update.seq) == (2, second) and second > first
    with pytest.raises(Rejected, match="limit is 65536"):
        await publish(store, token, attempt, "x" * 70_000, type="t", key="k", now=3)
    with pytest.raises(Rejected, match="not running"):
        await publish(store, token, "gone", 1, type="t", key="k", now=3)
    with pytest.raises(Rejected):
        await publish(store, token, attempt, 1, type="", key="k", now=3)
    with pytest.raises(ClaimLost):
        await publish(store, "stale", attempt, 3, now=3)
    assert [u.data for u in (await store.runs.get_run("r1")).updates] == [2]


async def test_watch_pages_show_what_changed_after_a_cursor(store: Any, clock: ManualClock) -> None:
    token, attempt = await running(store, clock)
    first = await publish(store, token, attempt, 1, now=1)
    await publish(store, token, attempt, 2, now=2)
    page = await store.updates.changes(after=first, run_id=None, limit=100, now=3)
    assert [u.data for u in page.updates] == [2] and page.runs[0].currentNode == "n"
    assert page.cursor == await store.updates.last_event() == await store.updates.last_event("r1")
    assert not page.more
    snap = await store.updates.snapshot(run_id=None, limit=2, now=3)
    assert [r.runId for r in snap.runs] == ["r1"] and len(snap.events) == 2 and snap.cursor == page.cursor
    assert (await store.updates.changes(after=page.cursor, run_id=None, limit=100, now=3)).updates == []
    short = await store.updates.changes(after=0, run_id="r1", limit=1, now=3)
    assert short.more and len(short.events) == 1


async def test_the_cursor_of_one_run_and_of_all(store: Any, clock: ManualClock) -> None:
    assert await store.updates.last_event() == 0
    await new_run(store, clock, "a")
    after_a = await store.updates.last_event()
    await new_run(store, clock, "b")
    assert await store.updates.last_event("a") == after_a < await store.updates.last_event("b")
    assert await store.updates.last_event() == await store.updates.last_event("b")
    snap = await store.updates.snapshot(run_id="a", limit=10, now=clock.now_ms())
    assert [r.runId for r in snap.runs] == ["a"]
    # an unknown run watches nothing (the host answers notFound from runs.revision first)
    nothing = await store.updates.snapshot(run_id="nope", limit=10, now=clock.now_ms())
    assert (nothing.runs, nothing.events) == ([], [])
    assert (await store.updates.changes(after=0, run_id="nope", limit=10, now=clock.now_ms())).events == []


async def test_a_snapshot_pages_the_active_runs_oldest_first(store: Any, clock: ManualClock) -> None:
    for n in range(5):
        await new_run(store, clock, run_id=f"r{n}")
    clock.advance(-3)  # two runs created at one millisecond: the run id breaks the tie
    await new_run(store, clock, run_id="r2b")
    seen, after = [], None
    while True:
        page = await store.updates.snapshot(run_id=None, limit=2, now=clock.now_ms(), runs_after=after)
        assert len(page.runs) <= 2
        seen += [r.runId for r in page.runs]
        after = page.nextRunsAfter
        if after is None:
            break
    assert seen == ["r0", "r1", "r2", "r2b", "r3", "r4"]
    with pytest.raises(Rejected, match="runsAfter"):
        await store.updates.snapshot(run_id=None, limit=2, now=clock.now_ms(), runs_after="nope")
