"""Named queues and placement (PlacementStore; store/sql/placement.py): a host claims only
runs of its queues; a run it claimed and could not load is released and passed over by its
later claims; one that no live host of its queue can load is held with the reason, and goes
on once a host may try it again (its file changed there, or the run was resumed)."""

from __future__ import annotations

from typing import Any

from piwf.clock import ManualClock
from piwf.store.api.types import Definition, RunFilter

from .helpers import LEASE, RUNNER, claim, new_run

UNLOADABLE = "workflow source changed (digest d2, run has d1)"


async def serve(store: Any, clock: ManualClock, queues: tuple[str, ...] = ("default",)) -> None:
    """The store's host: RUNNER holds the lease and serves ``queues``."""
    await store.hosts.acquire_lease(host_id=RUNNER, pid=1, identity="id", lease_ms=LEASE, now=clock.now_ms())
    await store.placement.serve_queues(RUNNER, queues, clock.now_ms())


async def release(store: Any, clock: ManualClock, run_id: str = "r1", runner: str = RUNNER) -> bool:
    got = await store.supervision.claim_runs(room=1, exclude=frozenset(), runner_id=runner, lease_ms=LEASE,
                                             now=clock.now_ms(), epoch=1)
    assert got and got[0][0].run_id == run_id
    return bool(await store.placement.release_unloadable(run_id, got[0][0].token, host_id=runner,
                                                         reason=UNLOADABLE, source_hash="abc", now=clock.now_ms()))


async def test_a_host_claims_only_runs_of_the_queues_it_serves(store: Any, clock: ManualClock) -> None:
    await store.runs.create_run(run_id="gpu-1", workflow="w", project_path="/p", source=b"s", digest="d1", input={},
                                origin_session_id=None, now=clock.now_ms(), queue="gpu")
    clock.advance(1)
    await new_run(store, clock, "plain")
    assert (await store.runs.run_summary("gpu-1")).queue == "gpu"
    assert (await store.runs.run_summary("plain")).queue == "default"
    now = clock.now_ms()
    got = await store.supervision.claim_runs(room=5, exclude=frozenset(), runner_id=RUNNER, lease_ms=LEASE, now=now,
                                             epoch=1, queues=("cpu",))
    assert got == []
    got = await store.supervision.claim_runs(room=5, exclude=frozenset(), runner_id=RUNNER, lease_ms=LEASE, now=now,
                                             epoch=1)
    assert [c.run_id for c, _ in got] == ["plain"]
    got = await store.supervision.claim_runs(room=5, exclude=frozenset(), runner_id=RUNNER, lease_ms=LEASE, now=now,
                                             epoch=1, queues=("gpu", "default"))
    assert [c.run_id for c, _ in got] == ["gpu-1"]


async def test_a_host_serving_several_queues_claims_the_oldest_of_all_first(store: Any, clock: ManualClock) -> None:
    """Read per queue, in each queue's index order: the oldest over all of them still wins."""
    for run_id, queue in (("a1", "a"), ("b1", "b"), ("a2", "a"), ("c1", "c"), ("b2", "b")):
        await store.runs.create_run(run_id=run_id, workflow="w", project_path="/p", source=b"s", digest="d1",
                                    input={}, origin_session_id=None, now=clock.now_ms(), queue=queue)
        clock.advance(1)
    claimed = []
    for _ in range(4):
        got = await store.supervision.claim_runs(room=1, exclude=frozenset(), runner_id=RUNNER, lease_ms=LEASE,
                                                 now=clock.now_ms(), epoch=1, queues=("b", "a"))
        claimed += [c.run_id for c, _ in got]
    assert claimed == ["a1", "b1", "a2", "b2"]  # c1 is no queue of this host's


async def test_a_run_released_as_unloadable_is_passed_over_by_that_host_only(store: Any, clock: ManualClock) -> None:
    await new_run(store, clock)
    # No live host serves the queue: nobody is known to be left to try, so it is not held.
    assert not await release(store, clock)
    run = await store.runs.run_summary("r1")
    assert (run.queueStatus, run.hold) == ("parked", None) and "cannot be loaded on h" in run.statusDetail
    assert await claim(store, clock) is None  # RUNNER's claims pass it over
    got = await store.supervision.claim_runs(room=1, exclude=frozenset(), runner_id="h2", lease_ms=LEASE,
                                             now=clock.now_ms(), epoch=1)
    assert [c.run_id for c, _ in got] == ["r1"]


async def test_a_run_no_live_host_can_load_is_held_and_goes_on_once_its_file_changed(
        store: Any, clock: ManualClock) -> None:
    await serve(store, clock)
    await new_run(store, clock)
    assert await release(store, clock)  # the only live host of its queue: held at once
    run = await store.runs.run_summary("r1")
    assert run.hold == "source" and run.statusDetail == f"no live host can load its workflow: h: {UNLOADABLE}"
    assert [r.runId for r in await store.runs.list_runs(where=RunFilter(held=True))] == ["r1"]
    assert await store.placement.settle(clock.now_ms()) == []  # still none to try it
    assert await claim(store, clock) is None
    assert await store.placement.own_records(RUNNER) == [("r1", "/p", "w", "abc")]
    assert await store.placement.forget(RUNNER, ["r1"]) == 1  # its file is another one now
    assert await store.placement.settle(clock.now_ms()) == ["r1"]
    run = await store.runs.run_summary("r1")
    assert (run.hold, run.statusDetail) == (None, None)
    got = await claim(store, clock)
    assert got is not None and got.run_id == "r1"


async def test_resuming_a_held_run_lets_every_host_try_it_again(store: Any, clock: ManualClock) -> None:
    await serve(store, clock)
    await new_run(store, clock)
    assert await release(store, clock)
    await store.runs.resume_run("r1", clock.now_ms(), definition=Definition("d2", b"src2", None, None))
    assert await store.placement.own_records(RUNNER) == []
    got = await claim(store, clock)
    assert got is not None and got.run_id == "r1"


async def test_a_run_paused_while_held_stays_paused_when_released(store: Any, clock: ManualClock) -> None:
    await serve(store, clock)
    await new_run(store, clock)
    assert await release(store, clock)
    await store.runs.pause_run("r1", clock.now_ms())
    await store.placement.forget(RUNNER, ["r1"])
    assert await store.placement.settle(clock.now_ms()) == ["r1"]
    run = await store.runs.run_summary("r1")
    assert (run.hold, run.paused) == ("paused", True)
    assert await claim(store, clock) is None
