"""Retention: ended runs deleted in batches with everything of theirs; never a run that has
not ended, nor a controller's child while its resource exists; shared values kept while used."""

from __future__ import annotations

from typing import Any

import pytest

from piwf.client import make_request
from piwf.clock import ManualClock
from piwf.errors import NotFound
from piwf.wire import HostResponse, request_fingerprint

from .controllers import C, P, fenced, reconciled
from .helpers import claim, new_run, running

BIG = {"text": "x" * 10_000}  # stored as a blob, not inline


async def ended(store: Any, clock: ManualClock, run_id: str, how: str = "completed", input: Any = None) -> None:
    """A run ended ``how``; the clock moves on a millisecond after."""
    await new_run(store, clock, run_id, input=input)
    await _end(store, clock, run_id, how)
    clock.advance(1)


async def _end(store: Any, clock: ManualClock, run_id: str, how: str) -> None:
    if how == "cancelled":
        await store.queue.cancel_run(run_id, clock.now_ms())
        return
    got = await claim(store, clock)
    assert got is not None and got.run_id == run_id
    if how == "completed":
        await store.queue.complete_run(run_id, got.token, {"out": run_id}, clock.now_ms())
    else:
        await store.queue.fail_run(run_id, got.token, {"type": "E", "message": "x"}, clock.now_ms())


async def prune_all(store: Any, clock: ManualClock, ended_before: int, limit: int = 100) -> list[str]:
    deleted: list[str] = []
    while True:
        batch = await store.retention.prune_runs(ended_before=ended_before, now=clock.now_ms(), limit=limit)
        deleted += batch.runs
        if not batch.more:
            return deleted


async def test_runs_that_ended_before_the_cut_off_go_and_no_other(store: Any, clock: ManualClock) -> None:
    for run_id, how in (("done", "completed"), ("failed", "failed"), ("cancelled", "cancelled")):
        await ended(store, clock, run_id, how)
    cut_off = clock.now_ms()
    await ended(store, clock, "later")  # ended at the cut-off: kept
    await running(store, clock, "running", session=None)
    await new_run(store, clock, "queued")
    before = await store.runs.status_counts(clock.now_ms())
    assert await store.retention.prunable_runs(ended_before=cut_off) == (3, ["done", "failed", "cancelled"])
    assert sorted(await prune_all(store, clock, cut_off)) == ["cancelled", "done", "failed"]
    for run_id in ("done", "failed", "cancelled"):
        with pytest.raises(NotFound):
            await store.runs.get_run(run_id)
        with pytest.raises(NotFound):
            await store.runs.run_events(run_id)
    assert sorted(r.runId for r in await store.runs.list_runs(limit=100)) == ["later", "queued", "running"]
    after = await store.runs.status_counts(clock.now_ms())
    assert (after["completedRuns"], after["failedRuns"], after["cancelledRuns"]) == (
        before["completedRuns"] - 1, before["failedRuns"] - 1, before["cancelledRuns"] - 1)
    assert (after["runningRuns"], after["queuedRuns"], after["lifecycleContradictions"]) == (1, 1, 0)
    assert await store.retention.prunable_runs(ended_before=clock.now_ms() + 10**9) == (1, ["later"])


async def test_a_prune_goes_in_bounded_batches(store: Any, clock: ManualClock) -> None:
    for n in range(5):
        await ended(store, clock, f"r{n}")
    first = await store.retention.prune_runs(ended_before=clock.now_ms(), now=clock.now_ms(), limit=2)
    assert (first.runs, first.more) == (["r0", "r1"], True)
    second = await store.retention.prune_runs(ended_before=clock.now_ms(), now=clock.now_ms(), limit=2)
    third = await store.retention.prune_runs(ended_before=clock.now_ms(), now=clock.now_ms(), limit=2)
    assert (second.runs, second.more, third.runs, third.more) == (["r2", "r3"], True, ["r4"], False)
    empty = await store.retention.prune_runs(ended_before=clock.now_ms(), now=clock.now_ms(), limit=2)
    assert (empty.runs, empty.blobs, empty.more) == ([], 0, False)


async def test_a_retried_run_is_not_pruned(store: Any, clock: ManualClock) -> None:
    await ended(store, clock, "r1", "failed")
    await store.runs.retry_run("r1", clock.now_ms(), actor="alice")
    assert await prune_all(store, clock, clock.now_ms() + 1) == []
    assert (await store.runs.run_summary("r1")).status == "queued"


async def test_a_controllers_child_run_stays_while_its_resource_exists(store: Any, clock: ManualClock) -> None:
    c = await reconciled(store, clock)

    async def start_child(tx: Any) -> Any:
        await tx.runs.create_run(run_id="child", workflow="w", project_path="/project", source=b"s", digest="d",
                                 input={"n": 1}, origin_session_id=None, now=clock.now)
        return await tx.controller_effects.record_child(c.uid, "build", "w", {"n": 1}, "child", clock.now)

    await fenced(store, clock, c, start_child)
    got = await claim(store, clock)
    await store.queue.complete_run("child", got.token, {"built": True}, clock.now_ms())
    clock.advance(1)
    assert await prune_all(store, clock, clock.now_ms()) == []
    child = await store.controller_effects.find_child(c.uid, "build", "w", {"n": 1})
    assert (child["runId"], child["state"], child["output"]) == ("child", "succeeded", {"built": True})
    await store.controllers.request_delete(P, C, "a", clock.now_ms(), force=True)
    assert await prune_all(store, clock, clock.now_ms()) == ["child"]


async def test_values_shared_with_a_remaining_run_stay_readable(store: Any, clock: ManualClock) -> None:
    await ended(store, clock, "old", input=BIG)
    await ended(store, clock, "kept", input=BIG)  # same input and workflow source: the same stored values
    cut_off = clock.now_ms() - 1
    clock.advance(24 * 3600 * 1000)  # long past any grace period
    assert await prune_all(store, clock, cut_off) == ["old"]
    assert (await store.runs.get_run("kept", clock.now_ms())).input == BIG
    assert await store.runs.run_source("kept") == ("w", "/p", "d1", BIG, None)
    assert await prune_all(store, clock, clock.now_ms()) == ["kept"]
    await new_run(store, clock, "new", input=BIG)  # stored again after its last user went
    assert (await store.runs.get_run("new", clock.now_ms())).input == BIG


async def test_a_value_stored_again_meanwhile_is_kept(store: Any, clock: ManualClock) -> None:
    """A run inserting a value at the moment its last user is pruned: storing it again
    refreshes it, so the prune, whatever the order, leaves it for the new run."""
    await ended(store, clock, "old", input=BIG)
    clock.advance(24 * 3600 * 1000)
    await new_run(store, clock, "new", input=BIG)  # the value is stored again, then its old user goes
    assert await prune_all(store, clock, clock.now_ms() - 10**6) == ["old"]
    assert (await store.runs.get_run("new", clock.now_ms())).input == BIG


async def test_a_retried_request_naming_a_pruned_run_is_answered_not_found(store: Any, clock: ManualClock) -> None:
    await ended(store, clock, "r1")
    await ended(store, clock, "r2")
    cancel = make_request("run.cancel", client_id="c", run_id="r1", request_id="req-1")
    start = make_request("run.start", client_id="c", request_id="req-2", payload={"workflow": "w"})
    pause = make_request("run.pause", client_id="c", run_id="never", request_id="req-3")
    for request, receipt in ((cancel, {"runId": "r1"}), (start, {"runId": "r2"}), (pause, {"n": 1})):
        async with store.transaction() as tx:
            fingerprint = request_fingerprint(request)
            assert await tx.commands.lookup(request, fingerprint) is None
            await tx.commands.record(request, fingerprint, HostResponse(request.requestId, "accepted",
                                                                        receipt=receipt), 1, clock.now_ms())
    assert (await store.commands.lookup(cancel, request_fingerprint(cancel))).outcome == "adopted"
    assert sorted(await prune_all(store, clock, clock.now_ms())) == ["r1", "r2"]
    for request, run_id in ((cancel, "r1"), (start, "r2")):  # the run named by the request, or made by it
        answer = await store.commands.lookup(request, request_fingerprint(request))
        assert answer.outcome == "notFound" and answer.receipt is None
        assert f"run {run_id} has since ended and been deleted by retention" in answer.error
    other = await store.commands.lookup(pause, request_fingerprint(pause))  # no run was pruned for it
    assert (other.outcome, other.receipt) == ("adopted", {"n": 1})


async def sweep_all(store: Any, clock: ManualClock, limit: int = 2) -> int:
    deleted, after = 0, ""
    while True:
        gone, next_after = await store.retention.sweep_blobs(after=after, now=clock.now_ms(), limit=limit)
        deleted += gone
        if next_after is None:
            return deleted
        after = next_after


async def test_a_sweep_deletes_values_nothing_uses_any_more_and_keeps_the_rest(
        store: Any, clock: ManualClock) -> None:
    """Runs retried on a fixed workflow leave their old source unused: no prune finds it (the
    runs still exist), a sweep does, once past the grace period; nothing in use goes."""
    fixed = ("d2", b"fixed source " * 500, "a")
    await ended(store, clock, "r1", "failed", input=BIG)
    await new_run(store, clock, "r2", input=BIG)  # queued: the source b"src" and BIG stay in use
    await store.runs.retry_run("r1", clock.now_ms(), actor="alice", definition=fixed)
    clock.advance(24 * 3600 * 1000)
    assert await sweep_all(store, clock) == 0  # r2 still names the old source
    got = await claim(store, clock, exclude=frozenset({"r1"}))
    await store.queue.fail_run("r2", got.token, {"type": "E", "message": "x"}, clock.now_ms())
    await store.runs.retry_run("r2", clock.now_ms(), actor="alice", definition=fixed)
    assert await sweep_all(store, clock) == 1  # the old source, named by no run any more
    for run_id in ("r1", "r2"):  # every value a run still names stays readable
        assert (await store.runs.get_run(run_id, clock.now_ms())).input == BIG
        assert (await store.runs.run_source(run_id))[2:4] == ("d2", BIG)
    await new_run(store, clock, "r3", input=BIG)  # stores the old source again: in use again
    clock.advance(24 * 3600 * 1000)
    assert await sweep_all(store, clock) == 0


async def test_a_recorded_graph_stays_while_a_run_uses_it_and_goes_with_its_last_run(
    store: Any, clock: ManualClock,
) -> None:
    from .test_graph import graph_bytes

    for run_id in ("old", "kept"):  # one workflow, one graph: one blob
        await store.runs.create_run(run_id=run_id, workflow="w", project_path="/p", source=b"src", digest="d1",
                                    input={}, origin_session_id=None, now=clock.now_ms(), graph=graph_bytes("Q?"))
        await _end(store, clock, run_id, "completed")
        clock.advance(1)
    cut_off = clock.now_ms() - 1
    clock.advance(24 * 3600 * 1000)  # long past any grace period
    first = await store.retention.prune_runs(ended_before=cut_off, now=clock.now_ms(), limit=100)
    assert (first.runs, first.blobs) == (["old"], 0)  # the source and the graph are still used
    assert (await store.runs.run_graph("kept")).nodes[1].title == "Q?"
    last = await store.retention.prune_runs(ended_before=clock.now_ms(), now=clock.now_ms(), limit=100)
    assert (last.runs, last.blobs) == (["kept"], 2)  # its source and its graph
