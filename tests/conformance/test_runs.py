"""Runs: creation, revisions, operator holds, node attempts fenced by the claim, and reads."""

from __future__ import annotations

from typing import Any

import pytest

from piwf.clock import ManualClock
from piwf.errors import ClaimLost, Conflict, NotFound, Rejected
from piwf.store.api.types import RunFilter

from .helpers import LEASE, claim, new_run, running, statuses


async def test_a_run_is_created_once(store: Any, clock: ManualClock) -> None:
    receipt = await store.runs.create_run(run_id="r1", workflow="w", project_path="/p", source=b"src", digest="d1",
                                          input={"n": 1}, origin_session_id=None, now=clock.now_ms(),
                                          start_node="second")
    assert receipt == {"runId": "r1", "status": "queued", "revision": 1}
    with pytest.raises(Rejected, match="already taken"):
        await new_run(store, clock)
    assert await store.runs.run_source("r1") == ("w", "/p", "d1", {"n": 1}, None)
    assert await store.runs.ready_state("r1") == ({"n": 1}, "second", False, "d1")
    assert [e.type for e in (await store.runs.run_events("r1")).events] == ["created"]



async def test_a_run_id_taken_is_refused_first_and_a_blob_held_input_is_stored(store: Any, clock: ManualClock) -> None:
    """A run id taken is refused as taken even when its session has an active run (the
    id's check comes first, as it did when it was a read before the insert), and nothing
    of the refused start is kept; a large input (a blob) and the source read back whole."""
    big = {"text": "x" * 5000}  # longer than INLINE_JSON_LIMIT: kept as a blob
    await store.runs.create_run(run_id="r1", workflow="w", project_path="/p", source=b"src" * 3000, digest="d1",
                                input=big, origin_session_id="s1", now=clock.now_ms())
    for session in ("s1", "s2", None):
        with pytest.raises(Rejected, match="run id r1 is already taken"):
            await store.runs.create_run(run_id="r1", workflow="w2", project_path="/q", source=b"other", digest="d2",
                                        input={"n": 2}, origin_session_id=session, now=clock.now_ms())
    assert await store.runs.run_source("r1") == ("w", "/p", "d1", big, "s1")
    assert [e.type for e in (await store.runs.run_events("r1")).events] == ["created"]
    with pytest.raises(Rejected, match="session s1 already has an active run r1"):
        await store.runs.create_run(run_id="r2", workflow="w", project_path="/p", source=b"src", digest="d1",
                                    input=None, origin_session_id="s1", now=clock.now_ms())
    with pytest.raises(NotFound):
        await store.runs.run_summary("r2")


async def test_reads_of_an_unknown_run_are_not_found(store: Any) -> None:
    for read in (store.runs.run_source, store.runs.ready_state, store.runs.get_run, store.runs.run_summary,
                 store.runs.run_events, store.runs.revision):
        with pytest.raises(NotFound):
            await read("nope")
    with pytest.raises(NotFound):
        await store.runs.check_revision("nope", None)


async def test_check_revision_is_a_compare_and_set_guard(store: Any, clock: ManualClock) -> None:
    await new_run(store, clock)
    assert await store.runs.check_revision("r1", None) == 1
    assert await store.runs.check_revision("r1", 1) == 1
    with pytest.raises(Conflict, match="revision 1, not 3"):
        await store.runs.check_revision("r1", 3)


async def test_pause_holds_and_resume_releases(store: Any, clock: ManualClock) -> None:
    await new_run(store, clock)
    assert (await store.runs.pause_run("r1", clock.now_ms()))["paused"] is True
    assert await store.runs.is_paused("r1") and await store.runs.hold_of("r1") == "paused"
    assert await claim(store, clock) is None
    assert (await store.runs.resume_run("r1", clock.now_ms()))["paused"] is False
    assert not await store.runs.is_paused("r1")
    assert await claim(store, clock) is not None


async def test_pause_keeps_the_revision_that_fences_the_worker(store: Any, clock: ManualClock) -> None:
    token, _ = await running(store, clock)
    before = await store.runs.revision("r1")
    await store.runs.pause_run("r1", clock.now_ms())
    assert await store.runs.revision("r1") == before
    assert await store.queue.fenced_revision("r1", token, clock.now_ms()) == before
    assert (await store.runs.run_summary("r1")).paused


async def test_pause_and_resume_refuse_ended_and_unknown_runs(store: Any, clock: ManualClock) -> None:
    await new_run(store, clock)
    await store.queue.cancel_run("r1", clock.now_ms())
    with pytest.raises(Rejected):
        await store.runs.pause_run("r1", clock.now_ms())
    with pytest.raises(Rejected):
        await store.runs.resume_run("r1", clock.now_ms())
    with pytest.raises(NotFound):
        await store.runs.pause_run("nope", clock.now_ms())
    with pytest.raises(NotFound):
        await store.runs.resume_run("nope", clock.now_ms())


async def test_resuming_with_a_definition_adopts_it(store: Any, clock: ManualClock) -> None:
    await new_run(store, clock)
    got = await claim(store, clock)
    await store.queue.park_run("r1", got.token, clock.now_ms(), hold="source", detail="workflow source changed")
    await store.runs.resume_run("r1", clock.now_ms(), definition=("d2", b"new source", "other"))
    assert (await store.runs.run_source("r1"))[2] == "d2"
    assert await store.runs.ready_state("r1") == ({"n": 1}, "other", False, "d2")
    assert (await store.runs.get_run("r1")).definitionDigest == "d2"


async def test_attempts_are_fenced_and_accepted_once(store: Any, clock: ManualClock) -> None:
    await new_run(store, clock)
    got = await claim(store, clock)
    with pytest.raises(ClaimLost):
        await store.runs.start_attempt("r1", "bad", seq=0, node="a", generation=1, now=clock.now_ms())
    attempt, revision = await store.runs.start_attempt("r1", got.token, seq=0, node="a", generation=1,
                                                       now=clock.now_ms())
    assert revision == 2 == await store.runs.revision("r1")
    with pytest.raises(ClaimLost):
        await store.runs.accept_attempt("r1", "bad", attempt_id=attempt, output=1, exit_name="next",
                                        now=clock.now_ms())
    assert [s.status for s in (await store.runs.get_run("r1")).steps] == ["running"]
    big = {"big": "x" * 10_000}
    assert await store.runs.accept_attempt("r1", got.token, attempt_id=attempt, output=big, exit_name="next",
                                           now=clock.now_ms()) == 3
    with pytest.raises(Rejected, match="not running"):
        await store.runs.accept_attempt("r1", got.token, attempt_id=attempt, output=2, exit_name="next",
                                        now=clock.now_ms())
    assert await store.runs.accepted_steps("r1") == ([{"seq": 0, "node": "a", "exit": "next", "output": big}], False)
    [step] = (await store.runs.get_run("r1")).steps
    assert (step.status, step.exit, step.generation) == ("accepted", "next", 1)


async def test_a_failed_attempt_is_recorded_once_under_the_claim(store: Any, clock: ManualClock) -> None:
    token, attempt = await running(store, clock)
    error = {"type": "ValueError", "message": "bad"}
    with pytest.raises(ClaimLost):
        await store.runs.fail_attempt("r1", "bad", attempt_id=attempt, error=error, now=clock.now_ms())
    revision = await store.runs.fail_attempt("r1", token, attempt_id=attempt, error=error, now=clock.now_ms())
    assert revision == await store.runs.revision("r1")
    with pytest.raises(Rejected, match="not running"):
        await store.runs.fail_attempt("r1", token, attempt_id=attempt, error=error, now=clock.now_ms())
    assert [s.status for s in (await store.runs.get_run("r1")).steps] == ["failed"]
    assert (await store.runs.run_events("r1")).events[-1].type == "attempt.failed"


async def test_an_expired_claim_writes_no_attempt(store: Any, clock: ManualClock) -> None:
    token, attempt = await running(store, clock)
    clock.advance(LEASE)
    with pytest.raises(ClaimLost):
        await store.runs.start_attempt("r1", token, seq=1, node="b", generation=1, now=clock.now_ms())
    with pytest.raises(ClaimLost):
        await store.runs.accept_attempt("r1", token, attempt_id=attempt, output=None, exit_name=None,
                                        now=clock.now_ms())
    assert [s.status for s in (await store.runs.get_run("r1")).steps] == ["running"]


async def test_accepted_steps_come_in_pages_of_a_budget(store: Any, clock: ManualClock) -> None:
    await new_run(store, clock)
    got = await claim(store, clock)
    for seq in range(3):
        attempt, _ = await store.runs.start_attempt("r1", got.token, seq=seq, node=f"n{seq}", generation=1,
                                                    now=clock.now_ms())
        await store.runs.accept_attempt("r1", got.token, attempt_id=attempt, output="x" * 100, exit_name=None,
                                        now=clock.now_ms())
    page, more = await store.runs.accepted_steps("r1", budget=250)
    assert [s["seq"] for s in page] == [0, 1] and more
    page, more = await store.runs.accepted_steps("r1", after_seq=1, budget=250)
    assert [s["seq"] for s in page] == [2] and not more
    page, more = await store.runs.accepted_steps("r1", budget=1)  # always at least one
    assert [s["seq"] for s in page] == [0] and more


async def test_runs_are_listed_newest_first_and_by_status(store: Any, clock: ManualClock) -> None:
    for run_id in ("a", "b", "c"):
        await new_run(store, clock, run_id)
    await store.queue.cancel_run("b", clock.now_ms())
    assert [r.runId for r in await store.runs.list_runs()] == ["c", "b", "a"]
    assert [r.runId for r in await store.runs.list_runs(limit=2)] == ["c", "b"]
    assert [r.runId for r in await store.runs.list_runs(status="cancelled")] == ["b"]
    summary = await store.runs.run_summary("a")
    assert (summary.runId, summary.workflow, summary.status, summary.revision) == ("a", "w", "queued", 1)


async def test_runs_are_listed_by_workflow_session_time_and_held_a_page_at_a_time(
        store: Any, clock: ManualClock) -> None:
    start = clock.now_ms()
    for run_id, workflow, session in (("a", "w", "s1"), ("b", "v", None), ("c", "w", None), ("d", "v", "s1"),
                                      ("e", "w", "s2")):
        await store.runs.create_run(run_id=run_id, workflow=workflow, project_path="/p", source=b"src",
                                    digest="d1", input={}, origin_session_id=session, now=clock.now_ms())
        clock.advance(10)
        if session is not None:  # one active run per session: end it before the next one's
            await store.queue.cancel_run(run_id, clock.now_ms())

    async def ids(limit: int = 50, **where: Any) -> list[str]:
        return [r.runId for r in await store.runs.list_runs(limit, where=RunFilter(**where))]

    assert await ids(workflow="w") == ["e", "c", "a"]
    assert await ids(session="s1") == ["d", "a"]
    assert await ids(since=start + 20) == ["e", "d", "c"]  # created at or after
    assert await ids(workflow="v", since=start + 20) == ["d"]
    assert await ids(status="cancelled", workflow="w") == ["e", "a"]
    assert await ids(workflow="nope") == []
    # The cursor: the last run shown; the next page starts after it, filters kept.
    assert await ids(2) == ["e", "d"]
    assert await ids(2, after="d") == ["c", "b"]
    assert await ids(2, after="b") == ["a"]
    assert await ids(2, workflow="w", after="e") == ["c", "a"]
    with pytest.raises(NotFound, match="run gone not found"):
        await ids(after="gone")
    # Held for a person: not paused, not waiting, not between crashes.
    got = await claim(store, clock)
    assert got is not None and got.run_id == "b"
    await store.queue.park_run("b", got.token, clock.now_ms(), hold="crashed", detail="crashed 5 times")
    await store.runs.pause_run("c", clock.now_ms())
    assert await ids(held=True) == ["b"]
    assert await ids(held=True, workflow="w") == []
    assert (await store.runs.status_counts(clock.now_ms()))["heldRuns"] == 1


async def test_runs_created_in_the_same_millisecond_are_paged_by_id(store: Any, clock: ManualClock) -> None:
    for run_id in ("r3", "r1", "r2"):
        await store.runs.create_run(run_id=run_id, workflow="w", project_path="/p", source=b"src", digest="d1",
                                    input={}, origin_session_id=None, now=clock.now_ms())
    pages = [[r.runId for r in await store.runs.list_runs(1, where=RunFilter(after=after))]
             for after in (None, "r3", "r2", "r1")]
    assert pages == [["r3"], ["r2"], ["r1"], []]


async def test_events_come_in_pages(store: Any, clock: ManualClock) -> None:
    await new_run(store, clock)
    await store.runs.pause_run("r1", clock.now_ms())
    await store.runs.resume_run("r1", clock.now_ms())
    first = await store.runs.run_events("r1", limit=2)
    assert [e.type for e in first.events] == ["created", "paused"] and first.nextAfter is not None
    rest = await store.runs.run_events("r1", after=first.nextAfter, limit=2)
    assert [e.type for e in rest.events] == ["resumed"] and rest.nextAfter is None


async def test_status_counts_follow_every_transition(store: Any, clock: ManualClock) -> None:
    for run_id in ("a", "b", "c", "d", "e"):
        await new_run(store, clock, run_id)
    one = await claim(store, clock)
    two = await claim(store, clock)
    three = await claim(store, clock)
    await store.queue.park_run("a", one.token, clock.now_ms())
    await store.queue.complete_run("b", two.token, None, clock.now_ms())
    await store.queue.cancel_run("d", clock.now_ms())
    await store.runs.pause_run("e", clock.now_ms())
    counts = await store.runs.status_counts(clock.now_ms())
    assert {k: counts[k] for k in ("queuedRuns", "runningRuns", "parkedRuns", "pausedRuns", "completedRuns",
                                   "cancelledRuns", "expiredClaims", "lifecycleContradictions")} == {
        "queuedRuns": 1, "runningRuns": 1, "parkedRuns": 1, "pausedRuns": 1, "completedRuns": 1,
        "cancelledRuns": 1, "expiredClaims": 0, "lifecycleContradictions": 0}
    clock.advance(LEASE)
    assert (await store.runs.status_counts(clock.now_ms()))["expiredClaims"] == 1
    with pytest.raises(ClaimLost):  # the expired claim writes no end
        await store.queue.fail_run("c", three.token, {"type": "E", "message": "m"}, clock.now_ms())
    assert await statuses(store, "c") == ("running", "starting")


async def test_pause_resume_and_cancel_compare_and_set_the_revision(store: Any, clock: ManualClock) -> None:
    await new_run(store, clock)
    with pytest.raises(Conflict):
        await store.runs.pause_run("r1", clock.now_ms(), expected_revision=9)
    assert not await store.runs.is_paused("r1")
    await store.runs.pause_run("r1", clock.now_ms(), expected_revision=1)
    with pytest.raises(Conflict):
        await store.runs.resume_run("r1", clock.now_ms(), expected_revision=9)
    assert await store.runs.is_paused("r1")
    await store.runs.resume_run("r1", clock.now_ms(), expected_revision=1)
    with pytest.raises(Conflict):
        await store.queue.cancel_run("r1", clock.now_ms(), expected_revision=9)
    assert await statuses(store) == ("queued", "queued")
    with pytest.raises(NotFound):
        await store.queue.cancel_run("nope", clock.now_ms())
    assert await store.queue.cancel_run("r1", clock.now_ms(), expected_revision=await store.runs.revision("r1"))
    with pytest.raises(Rejected):  # ended: refused after the revision is found right
        await store.runs.pause_run("r1", clock.now_ms(), expected_revision=await store.runs.revision("r1"))


async def test_a_resume_that_adopts_a_definition_needs_the_source_hold_still_there(store: Any,
                                                                                   clock: ManualClock) -> None:
    await new_run(store, clock)
    got = await claim(store, clock)
    await store.queue.park_run("r1", got.token, clock.now_ms(), hold="source", detail="workflow source changed")
    await store.runs.resume_run("r1", clock.now_ms())  # someone resumed it meanwhile, on its old definition
    with pytest.raises(Conflict):
        await store.runs.resume_run("r1", clock.now_ms(), definition=("d2", b"new", None))
    assert (await store.runs.run_source("r1"))[2] == "d1"
