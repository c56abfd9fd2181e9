"""Retry: a failed or timed-out run queued again as the same run, keeping what it did."""

from __future__ import annotations

from typing import Any

import pytest

from piwf.clock import ManualClock
from piwf.errors import Conflict, NotFound, Rejected

from .controllers import fenced, reconciled
from .helpers import claim, new_run, running, statuses


async def failed(store: Any, clock: ManualClock, run_id: str = "r1", session: str | None = "s1") -> str:
    """A run with an accepted step 0 ("a"), then failed at step 1 ("b"): its last claim's token."""
    token, attempt = await running(store, clock, run_id, session=session, node="a")
    await store.runs.accept_attempt(run_id, token, attempt_id=attempt, output={"a": 1}, exit_name="next",
                                    now=clock.now_ms())
    second, _ = await store.runs.start_attempt(run_id, token, seq=1, node="b", generation=1, now=clock.now_ms())
    error = {"type": "ValueError", "message": "the fuse was lit"}
    await store.runs.fail_attempt(run_id, token, attempt_id=second, error=error, now=clock.now_ms())
    await store.queue.fail_run(run_id, token, error, clock.now_ms())
    return token


async def test_a_failed_run_is_queued_again_keeping_its_accepted_steps(store: Any, clock: ManualClock) -> None:
    await failed(store, clock)
    before = await store.runs.get_run("r1", clock.now_ms())
    receipt = await store.runs.retry_run("r1", clock.now_ms(), actor="alice")
    assert receipt == {"runId": "r1", "status": "queued", "retriedFrom": "failed", "node": "b",
                       "generation": before.generation + 1, "revision": before.revision + 1, "reopenedEffects": [],
                       "definitionDigest": "d1"}
    after = await store.runs.get_run("r1", clock.now_ms())
    assert (after.status, after.queueStatus, after.error, after.finishedAt) == ("queued", "queued", None, None)
    steps, more = await store.runs.accepted_steps("r1")
    assert [(s["seq"], s["node"], s["output"]) for s in steps] == [(0, "a", {"a": 1})] and not more
    event = (await store.runs.run_events("r1")).events[-1]
    assert (event.type, event.by, event.retriedFrom, event.node) == ("retried", "alice", "failed", "b")
    got = await claim(store, clock)  # claimable at once, with a generation newer than the retry's
    assert got is not None and got.run_id == "r1" and got.generation == receipt["generation"] + 1
    started, _ = await store.runs.start_attempt("r1", got.token, seq=1, node="b", generation=got.generation,
                                                now=clock.now_ms())
    assert started and await statuses(store) == ("running", "starting")


async def test_a_retried_run_adopts_the_workflow_it_is_given(store: Any, clock: ManualClock) -> None:
    await failed(store, clock)
    receipt = await store.runs.retry_run("r1", clock.now_ms(), actor="alice", definition=("d2", b"fixed", "a"))
    assert receipt["definitionDigest"] == "d2"
    assert await store.runs.ready_state("r1") == ({"n": 1}, "a", False, "d2")
    assert (await store.runs.run_source("r1"))[2] == "d2"


async def test_the_old_claim_stays_dead_after_a_retry(store: Any, clock: ManualClock) -> None:
    token = await failed(store, clock)
    await store.runs.retry_run("r1", clock.now_ms(), actor="alice")
    from piwf.errors import ClaimLost

    with pytest.raises(ClaimLost):
        await store.queue.fenced_revision("r1", token, clock.now_ms())


@pytest.mark.parametrize("end", ["completed", "cancelled", "running", "queued"])
async def test_only_a_failed_or_timed_out_run_is_retried(store: Any, clock: ManualClock, end: str) -> None:
    if end == "queued":
        await new_run(store, clock)
    else:
        token, _ = await running(store, clock)
        if end == "completed":
            await store.queue.complete_run("r1", token, {"ok": True}, clock.now_ms())
        elif end == "cancelled":
            await store.queue.cancel_run("r1", clock.now_ms(), token=token)
    before = await store.runs.get_run("r1", clock.now_ms())
    with pytest.raises(Rejected, match=f"run r1 is {end}: only a failed or timed-out run can be retried"):
        await store.runs.retry_run("r1", clock.now_ms(), actor="alice")
    after = await store.runs.get_run("r1", clock.now_ms())
    assert (after.status, after.queueStatus, after.revision, after.generation) == (
        before.status, before.queueStatus, before.revision, before.generation)


async def test_retry_checks_the_run_and_its_revision(store: Any, clock: ManualClock) -> None:
    with pytest.raises(NotFound):
        await store.runs.retry_run("nope", clock.now_ms(), actor="alice")
    await failed(store, clock)
    revision = await store.runs.revision("r1")
    with pytest.raises(Conflict):
        await store.runs.retry_run("r1", clock.now_ms(), actor="alice", expected_revision=revision - 1)
    assert await statuses(store) == ("failed", "failed")
    await store.runs.retry_run("r1", clock.now_ms(), actor="alice", expected_revision=revision)
    assert await statuses(store) == ("queued", "queued")
    with pytest.raises(Rejected, match="is queued"):  # a second retry of the same run
        await store.runs.retry_run("r1", clock.now_ms(), actor="alice")


async def test_a_retry_waits_for_its_sessions_other_active_run(store: Any, clock: ManualClock) -> None:
    await failed(store, clock, session="s1")
    await new_run(store, clock, "r2", session="s1")
    with pytest.raises(Rejected, match="session s1 has another active run"):
        await store.runs.retry_run("r1", clock.now_ms(), actor="alice")
    assert await statuses(store) == ("failed", "failed")
    await store.queue.cancel_run("r2", clock.now_ms())
    await store.runs.retry_run("r1", clock.now_ms(), actor="alice")
    assert await statuses(store) == ("queued", "queued")


async def test_applied_effects_keep_their_results_and_rejected_ones_are_pending_again(
        store: Any, clock: ManualClock) -> None:
    token, attempt = await running(store, clock, node="a")
    now = clock.now_ms()
    for key in ("paid", "mailed"):
        assert (await store.effects.reserve("r1", key, node="a", generation=1, observable=False, now=now))
        await store.effects.begin_apply("r1", key, generation=1, now=now)
    await store.effects.settle("r1", "paid", generation=1, result={"receipt": 7}, now=now)
    await store.effects.settle("r1", "mailed", generation=1, error={"type": "OSError", "message": "down"}, now=now)
    error = {"type": "EffectRejected", "message": "mailed"}
    await store.runs.fail_attempt("r1", token, attempt_id=attempt, error=error, now=now)
    await store.queue.fail_run("r1", token, error, now)
    receipt = await store.runs.retry_run("r1", clock.now_ms(), actor="alice")
    assert receipt["reopenedEffects"] == ["mailed"]
    got = await claim(store, clock)
    assert got is not None
    paid = await store.effects.reserve("r1", "paid", node="a", generation=got.generation, observable=False,
                                       now=clock.now_ms())
    assert (paid["state"], paid["result"]) == ("applied", {"receipt": 7})  # never applied again
    mailed = await store.effects.reserve("r1", "mailed", node="a", generation=got.generation, observable=False,
                                         now=clock.now_ms())
    assert mailed["state"] == "new"


async def test_a_controllers_child_run_is_followed_again_once_retried(store: Any, clock: ManualClock) -> None:
    c = await reconciled(store, clock)

    async def start_child(tx: Any) -> Any:
        await tx.runs.create_run(run_id="child", workflow="w", project_path="/project", source=b"s", digest="d",
                                 input={"n": 1}, origin_session_id=None, now=clock.now)
        return await tx.controller_effects.record_child(c.uid, "build", "w", {"n": 1}, "child", clock.now)

    await fenced(store, clock, c, start_child)
    run = await claim(store, clock)
    await store.queue.fail_run("child", run.token, {"type": "E", "message": "x"}, clock.now_ms())
    assert await store.controller_effects.sync_children(clock.now_ms()) == [c.uid]
    assert (await store.controller_effects.find_child(c.uid, "build", "w", {"n": 1}))["state"] == "failed"
    await store.runs.retry_run("child", clock.now_ms(), actor="alice")
    assert (await store.controller_effects.find_child(c.uid, "build", "w", {"n": 1}))["state"] == "running"
    run = await claim(store, clock)
    await store.queue.complete_run("child", run.token, {"built": True}, clock.now_ms())
    assert await store.controller_effects.sync_children(clock.now_ms()) == [c.uid]  # its end is seen again
    assert (await store.controller_effects.find_child(c.uid, "build", "w", {"n": 1}))["state"] == "succeeded"
