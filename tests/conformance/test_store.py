"""The store as a whole: units of work, durability, its background work, closing."""

from __future__ import annotations

from typing import Any

import pytest
import trio

from piwf.clock import ManualClock
from piwf.errors import NotFound, StoreError

from .helpers import new_run


async def test_what_was_committed_is_there_after_close_and_reopen(store: Any, open_store: Any,
                                                                  clock: ManualClock) -> None:
    await new_run(store, clock)
    await store.durable()  # before serve: commits are durable one by one
    await store.close()
    reopened = await open_store()
    assert (await reopened.runs.run_summary("r1")).status == "queued"


async def test_commits_are_durable_through_the_stores_background_work(store: Any, open_store: Any,
                                                                      clock: ManualClock) -> None:
    async with trio.open_nursery() as nursery:
        await nursery.start(store.serve)
        for run_id in ("a", "b", "c"):
            await new_run(store, clock, run_id)
        await store.durable()
        other = await open_store()
        assert [r.runId for r in await other.runs.list_runs()] == ["c", "b", "a"]
        nursery.cancel_scope.cancel()
    await store.durable()
    await store.close()


async def test_units_of_work_do_not_nest(store: Any, clock: ManualClock) -> None:
    async with store.transaction() as tx:
        with pytest.raises(StoreError):
            async with store.transaction():
                pass
        await tx.runs.create_run(run_id="r1", workflow="w", project_path="/p", source=b"s", digest="d",
                                 input=None, origin_session_id=None, now=clock.now_ms())
    assert (await store.runs.run_summary("r1")).status == "queued"  # the outer one committed
    async with store.transaction():  # and another may open now
        pass


async def test_a_unit_of_work_run_as_a_function_commits_together_and_returns_its_value(
        store: Any, open_store: Any, clock: ManualClock) -> None:
    other = await open_store()

    async def work(tx: Any) -> tuple[str, ...]:
        for run_id in ("a", "b"):
            await tx.runs.create_run(run_id=run_id, workflow="w", project_path="/p", source=b"s", digest="d",
                                     input=None, origin_session_id=None, now=clock.now_ms())
        return tuple(r.runId for r in await tx.runs.list_runs())  # its own writes, seen in it

    assert sorted(await store.run_unit(work)) == ["a", "b"]
    assert sorted(r.runId for r in await other.runs.list_runs()) == ["a", "b"]


async def test_a_unit_of_work_run_as_a_function_that_raises_commits_nothing(store: Any, clock: ManualClock) -> None:
    async def work(tx: Any) -> None:
        await tx.runs.create_run(run_id="r1", workflow="w", project_path="/p", source=b"s", digest="d", input=None,
                                 origin_session_id=None, now=clock.now_ms())
        await tx.runs.run_summary("nope")  # NotFound, after a write

    with pytest.raises(NotFound):
        await store.run_unit(work)
    with pytest.raises(NotFound):
        await store.runs.run_summary("r1")
    await new_run(store, clock)  # the store goes on
    assert (await store.runs.run_summary("r1")).status == "queued"


async def test_a_unit_of_work_run_as_a_function_may_await_only_its_store_calls(store: Any,
                                                                              clock: ManualClock) -> None:
    async def work(tx: Any) -> None:
        await tx.runs.create_run(run_id="r1", workflow="w", project_path="/p", source=b"s", digest="d", input=None,
                                 origin_session_id=None, now=clock.now_ms())
        await trio.lowlevel.cancel_shielded_checkpoint()  # suspends: other tasks would run inside it

    with pytest.raises(StoreError):
        await store.run_unit(work)
    with pytest.raises(NotFound):
        await store.runs.run_summary("r1")


async def test_a_unit_of_work_run_as_a_function_does_not_nest(store: Any) -> None:
    async def work(tx: Any) -> None:
        return None

    async with store.transaction():
        with pytest.raises(StoreError):
            await store.run_unit(work)
    assert await store.run_unit(work) is None


async def test_another_store_sees_a_unit_of_work_only_once_it_committed(store: Any, open_store: Any,
                                                                         clock: ManualClock) -> None:
    other = await open_store()
    async with store.transaction() as tx:
        await tx.runs.create_run(run_id="r1", workflow="w", project_path="/p", source=b"s", digest="d", input=None,
                                 origin_session_id=None, now=clock.now_ms())
        with pytest.raises(NotFound):
            await other.runs.run_summary("r1")
    assert (await other.runs.run_summary("r1")).status == "queued"


async def test_a_cancelled_caller_learns_whether_its_call_committed(store: Any, clock: ManualClock) -> None:
    receipt = None
    with trio.CancelScope() as scope:
        scope.cancel()  # already cancelled as the call starts: it commits or not, never half
        receipt = await store.runs.create_run(run_id="r1", workflow="w", project_path="/p", source=b"s", digest="d",
                                              input=None, origin_session_id=None, now=clock.now_ms())
    try:
        await store.runs.run_summary("r1")
        committed = True
    except NotFound:
        committed = False
    assert committed == (receipt is not None)


async def test_an_announcement_wakes_the_other_stores_listeners_not_its_own(backend: Any, open_store: Any,
                                                                           nursery: trio.Nursery) -> None:
    """PostgreSQL: what one store announces reaches every other store's ``serve_wakeups``
    (and not its own: it skips what it sent). SQLite (one host per store): announcing does
    nothing and ``serve_wakeups`` only waits, until cancelled."""
    from piwf.store.api import Wakeup

    a, b = await open_store(), await open_store()
    heard_a: list[Wakeup] = []
    heard_b: list[Wakeup] = []
    await nursery.start(a.serve_wakeups, heard_a.append)
    await nursery.start(b.serve_wakeups, heard_b.append)
    heard_a.clear()  # once listening, every topic is woken once (what was missed meanwhile)
    heard_b.clear()
    a.announce(Wakeup.RUNS)
    if backend.name == "sqlite":
        assert heard_b == []
        return
    with trio.fail_after(10):
        while Wakeup.RUNS not in heard_b:
            await trio.sleep(0.01)
        b.announce(Wakeup.CHANGES)  # sent after A's RUNS: A hears its own RUNS (and skips it) first
        while Wakeup.CHANGES not in heard_a:
            await trio.sleep(0.01)
    assert Wakeup.RUNS not in heard_a and Wakeup.CHANGES not in heard_b
