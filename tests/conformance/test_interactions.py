"""Interaction requests of decision and ask nodes (DESIGN.md §7), transition by transition."""

from __future__ import annotations

from typing import Any

import pytest

from piwf.clock import ManualClock
from piwf.errors import ClaimLost, Conflict, NotFound, Rejected
from piwf.protocol import ChoiceSpec, DefaultAnswer, TextInputSpec, UpdateAction
from piwf.protocol.worker import InteractionOpenPayload
from piwf.status import WorkerStatus

from .helpers import LEASE, claim, claims, new_run


async def asking(store: Any, clock: ManualClock, run_id: str = "r1", node: str = "approve", kind: str = "decision",
                 session: str | None = None, **spec: Any) -> tuple[str, str, str]:
    """A run whose first node opened a request: (request id, the claim's token, attempt id)."""
    await new_run(store, clock, run_id, session=session)
    got = await claim(store, clock)
    attempt_id, _ = await store.runs.start_attempt(run_id, got.token, seq=0, node=node, generation=got.generation,
                                                   now=clock.now_ms())
    if kind == "decision":
        spec = {"title": "Go?", "choices": {"yes": ChoiceSpec("Yes"),
                                             "why": ChoiceSpec("Because", TextInputSpec("Why?", 2, 5))}, **spec}
    else:
        spec = {"title": "How many?", **spec}
    payload = InteractionOpenPayload(attemptId=attempt_id, kind=kind, **spec)
    request_id = await store.interactions.open_request(run_id, got.token, payload, clock.now_ms())
    return request_id, got.token, attempt_id


async def request(store: Any, clock: ManualClock, run_id: str = "r1") -> Any:
    [found] = await store.interactions.list_requests(run_id=run_id, open_only=False, now=clock.now_ms())
    return found


async def state(store: Any, run_id: str = "r1") -> tuple[str, str, str | None]:
    run = await store.runs.run_summary(run_id)
    return run.status, run.queueStatus, run.hold


async def answer(store: Any, clock: ManualClock, request_id: str, choice: str = "yes", text: str | None = None,
                 expected: int | None = None, by: str = "ann") -> Any:
    return await store.interactions.answer_decision(request_id=request_id, choice=choice, text=text, answered_by=by,
                                                    expected_revision=expected, now=clock.now_ms())


async def submit(store: Any, clock: ManualClock, request_id: str, value: Any, expected: int | None = None) -> str:
    receipt = await store.interactions.submit(request_id=request_id, value=value, session_id=None,
                                              submitted_by="ann", expected_revision=expected, now=clock.now_ms())
    return receipt.submissionId


async def test_opening_a_request_parks_the_run_as_waiting_and_unclaimable(store: Any, clock: ManualClock) -> None:
    request_id, _token, _attempt = await asking(store, clock)
    assert await state(store) == ("waiting", "parked", "waiting")
    assert [s.status for s in (await store.runs.get_run("r1")).steps] == ["waiting"]
    assert await claim(store, clock) is None
    assert (await store.runs.status_counts(clock.now_ms()))["pendingInteractions"] == 1
    found = await request(store, clock)
    assert (found.requestId, found.status, found.revision, found.nodeId) == (request_id, "pending", 1, "approve")
    assert [r.requestId for r in (await store.runs.get_run("r1", clock.now_ms())).waitingFor] == [request_id]


async def test_opening_under_a_stale_claim_is_refused(store: Any, clock: ManualClock) -> None:
    await new_run(store, clock)
    got = await claim(store, clock)
    attempt_id, _ = await store.runs.start_attempt("r1", got.token, seq=0, node="q", generation=1, now=clock.now_ms())
    payload = InteractionOpenPayload(attemptId=attempt_id, kind="ask", title="?")
    with pytest.raises(ClaimLost):
        await store.interactions.open_request("r1", "stale", payload, clock.now_ms())
    assert await state(store) == ("running", "starting", None)
    assert await store.interactions.list_requests(run_id="r1", open_only=False, now=clock.now_ms()) == []


async def test_the_first_answer_wins_and_releases_the_run_once(store: Any, clock: ManualClock) -> None:
    request_id, _, _ = await asking(store, clock)
    receipt = await answer(store, clock, request_id, "why", "héé", expected=1)
    assert (receipt.choice, receipt.input, receipt.revision) == ("why", "héé", 2)  # code points, kept exactly
    assert await state(store) == ("running", "parked", None)
    step = (await store.runs.get_run("r1")).steps[0]
    assert (step.status, step.exit) == ("accepted", "why")
    with pytest.raises(Conflict, match="another answer won"):
        await answer(store, clock, request_id, by="bob")
    assert (await store.runs.status_counts(clock.now_ms()))["lifecycleContradictions"] == 0
    assert (await request(store, clock)).resolution.answeredBy == "ann"


@pytest.mark.parametrize(("choice", "text", "message"), [
    ("nope", None, "not a choice"),
    ("yes", "x", "takes no input"),
    ("why", None, "needs input"),
    ("why", "a", "must be 2 to 5"),
    ("why", "abcdef", "must be 2 to 5"),
])
async def test_a_bad_answer_changes_nothing(store: Any, clock: ManualClock, choice: str, text: str | None,
                                            message: str) -> None:
    request_id, _, _ = await asking(store, clock)
    with pytest.raises(Rejected, match=message):
        await answer(store, clock, request_id, choice, text)
    assert await state(store) == ("waiting", "parked", "waiting")
    assert (await request(store, clock)).revision == 1


async def test_unknown_requests_and_stale_revisions(store: Any, clock: ManualClock) -> None:
    request_id, _, _ = await asking(store, clock)
    with pytest.raises(NotFound):
        await answer(store, clock, "req-x")
    with pytest.raises(Conflict, match="revision 1, not 4"):
        await answer(store, clock, request_id, expected=4)
    with pytest.raises(NotFound):
        await submit(store, clock, "req-x", 1)
    with pytest.raises(NotFound):
        await store.interactions.list_requests(run_id="nope", now=clock.now_ms())
    assert await state(store) == ("waiting", "parked", "waiting")


async def test_a_deadline_with_a_default_fires_exactly_once(store: Any, clock: ManualClock) -> None:
    request_id, _, _ = await asking(store, clock, deadlineMs=2000, default=DefaultAnswer("yes"))
    assert await store.interactions.next_deadline() == clock.now_ms() + 2000
    clock.advance(1999)
    assert await store.interactions.expire_due(clock.now_ms()) == ([], [])
    clock.advance(1)  # at the deadline, an answer is refused and the default wins
    with pytest.raises(Rejected, match="expired"):
        await answer(store, clock, request_id)
    assert await store.interactions.expire_due(clock.now_ms()) == ([request_id], [])
    assert await store.interactions.expire_due(clock.now_ms() + 5000) == ([], [])  # once
    resolution = (await request(store, clock)).resolution
    assert resolution is not None and (resolution.choice, resolution.provenance, resolution.answeredBy) == (
        "yes", "timeout", None)
    assert await store.interactions.next_deadline() is None
    assert [e.type for e in (await store.runs.run_events("r1")).events].count("decision.answered") == 1


async def test_no_default_and_no_timeout_exit_ends_the_run_timed_out(store: Any, clock: ManualClock) -> None:
    request_id, _, _ = await asking(store, clock, deadlineMs=10)
    clock.advance(10)
    assert await store.interactions.expire_due(clock.now_ms()) == ([request_id], [])
    assert await state(store) == ("timed_out", "failed", None)
    assert (await request(store, clock)).status == "expired"
    assert (await store.runs.status_counts(clock.now_ms()))["lifecycleContradictions"] == 0


async def test_cancelling_a_waiting_run_cancels_its_request(store: Any, clock: ManualClock) -> None:
    request_id, _, _ = await asking(store, clock)
    assert await store.queue.cancel_run("r1", clock.now_ms())
    assert (await request(store, clock)).status == "cancelled"
    assert await store.interactions.list_requests(run_id="r1", now=clock.now_ms()) == []  # open only
    with pytest.raises(Rejected, match="cancelled"):
        await answer(store, clock, request_id)


async def test_presentation_claims_expire_and_need_the_current_revision(store: Any, clock: ManualClock) -> None:
    request_id, _, _ = await asking(store, clock)

    async def update(client: str, revision: int, action: UpdateAction = UpdateAction.CLAIM, **kw: Any) -> Any:
        return await store.interactions.update(request_id=request_id, expected_revision=revision, action=action,
                                               client_id=client, entry_id=kw.get("entry"),
                                               progress=kw.get("progress"), lease_ms=10_000, now=clock.now_ms())

    first = await update("a", 1)
    assert first.presenter == "a"
    with pytest.raises(Conflict, match="presented by a"):
        await update("b", first.revision)
    with pytest.raises(Conflict):
        await update("a", 1)  # stale revision
    clock.advance(10_000)  # a's claim expired: b may take it
    taken = await update("b", first.revision)
    assert taken.presenter == "b"
    with pytest.raises(Rejected, match="needs entryId"):
        await update("b", taken.revision, UpdateAction.PRESENTED)
    shown = await update("b", taken.revision, UpdateAction.PRESENTED, entry="e1")
    assert shown.revision > taken.revision and (await request(store, clock)).entryId == "e1"
    with pytest.raises(Conflict, match="presented as e1"):
        await update("c", shown.revision, UpdateAction.PRESENTED, entry="e2")
    with pytest.raises(Rejected, match="needs progress"):
        await update("b", shown.revision, UpdateAction.PROGRESS)
    moved = await update("b", shown.revision, UpdateAction.PROGRESS, progress="2 of 3 read")
    assert moved.revision == shown.revision and (await request(store, clock)).progress == "2 of 3 read"
    await answer(store, clock, request_id)
    with pytest.raises(Rejected):  # settled: no presentation
        await update("b", moved.revision + 1, UpdateAction.CLAIM)
    with pytest.raises(NotFound):
        await store.interactions.update(request_id="req-x", expected_revision=1, action=UpdateAction.CLAIM,
                                        client_id="a", entry_id=None, progress=None, lease_ms=1, now=clock.now_ms())


async def test_presented_ends_presentation_claiming(store: Any, clock: ManualClock) -> None:
    """Seed: a request once presented stays ``presenting`` with no presenter, and nobody
    (its presenter included, its claim long expired) claims it to show it again."""
    request_id, _, _ = await asking(store, clock)

    async def update(client: str, revision: int, action: UpdateAction, entry: str | None = None) -> Any:
        return await store.interactions.update(request_id=request_id, expected_revision=revision, action=action,
                                               client_id=client, entry_id=entry, progress=None, lease_ms=10_000,
                                               now=clock.now_ms())

    claimed = await update("a", 1, UpdateAction.CLAIM)
    shown = await update("a", claimed.revision, UpdateAction.PRESENTED, entry="e1")
    assert (shown.status, shown.presenter, shown.presenterExpiresAt) == ("presenting", None, None)
    listed = await request(store, clock)
    assert (listed.status, listed.presenter, listed.entryId, listed.revision) == (
        "presenting", None, "e1", shown.revision)
    clock.advance(60_000)
    for client in ("b", "a"):
        with pytest.raises(Conflict, match="presented as e1; its presentation is over"):
            await update(client, shown.revision, UpdateAction.CLAIM)
    assert (await request(store, clock)).revision == shown.revision  # the refusals changed nothing
    again = await update("b", shown.revision, UpdateAction.PRESENTED, entry="e1")  # the same entry: fine
    assert again.revision == shown.revision + 1
    presented_unclaimed, _, _ = await asking(store, clock, "r2")  # presented without a claim first
    done = await store.interactions.update(request_id=presented_unclaimed, expected_revision=1,
                                           action=UpdateAction.PRESENTED, client_id="c", entry_id="e9",
                                           progress=None, lease_ms=10_000, now=clock.now_ms())
    assert done.status == "presenting"
    with pytest.raises(Conflict, match="presentation is over"):
        await store.interactions.update(request_id=presented_unclaimed, expected_revision=done.revision,
                                        action=UpdateAction.CLAIM, client_id="c", entry_id=None, progress=None,
                                        lease_ms=10_000, now=clock.now_ms())
    assert (await answer(store, clock, request_id, expected=again.revision)).choice == "yes"  # still answerable


async def test_progress_is_a_run_update_of_the_waiting_attempt(store: Any, clock: ManualClock) -> None:
    """Seed: progress is published as a run update (seen by run.watch), needs the current
    revision and does not bump it; progress for an attempt that no longer waits is stale."""
    request_id, _, _ = await asking(store, clock)
    before = await store.updates.last_event("r1")

    async def progress(text: str, revision: int = 1) -> Any:
        return await store.interactions.update(request_id=request_id, expected_revision=revision,
                                               action=UpdateAction.PROGRESS, client_id="a", entry_id=None,
                                               progress=text, lease_ms=10_000, now=clock.now_ms())

    first = await progress("1 of 3")
    second = await progress("2 of 3")
    assert (first.revision, second.revision) == (1, 1) and second.updateSeq > first.updateSeq > before
    page = await store.updates.changes(after=before, run_id="r1", limit=10, now=clock.now_ms())
    [update] = page.updates
    assert (update.type, update.key, update.data, update.seq) == (
        "interaction.progress", request_id, {"requestId": request_id, "nodeId": "approve", "progress": "2 of 3"},
        second.updateSeq)
    assert [e.event.type for e in page.events] == ["update", "update"]
    assert (await request(store, clock)).progress == "2 of 3"
    with pytest.raises(Conflict, match="at revision 1, not 0"):
        await progress("x", revision=0)
    await store.queue.cancel_run("r1", clock.now_ms())  # the attempt no longer waits
    with pytest.raises(Rejected, match="cancelled"):
        await progress("3 of 3", revision=2)
    assert [u.data["progress"] for u in
            (await store.updates.changes(after=before, run_id="r1", limit=10, now=clock.now_ms())).updates] == [
        "2 of 3"]


async def test_a_run_with_a_submission_to_validate_is_claimed_before_older_runs(
        store: Any, clock: ManualClock) -> None:
    """Seed: runs with a validating submission are served first (a person waits on them)."""
    await new_run(store, clock, "r0")
    older = await claim(store, clock)
    request_id, _, _ = await asking(store, clock, "r1", kind="ask")
    assert await store.queue.park_run("r0", older.token, clock.now_ms())  # ready again, and older than r1
    await new_run(store, clock, "r2")
    assert await claim(store, clock, exclude=frozenset({"r0", "r1", "r2"})) is None
    await submit(store, clock, request_id, 3)
    assert (await claim(store, clock)).run_id == "r1"
    assert [c.run_id for c, _ in await claims(store, clock, room=3)] == ["r0", "r2"]


async def test_requests_are_listed_by_session_and_run(store: Any, clock: ManualClock) -> None:
    first, _, _ = await asking(store, clock, "r1", session="s1")
    second, _, _ = await asking(store, clock, "r2", session="s2")
    listed = await store.interactions.list_requests(now=clock.now_ms())
    assert [r.requestId for r in listed] == [first, second]
    assert [r.requestId for r in await store.interactions.list_requests(session_id="s2", now=clock.now_ms())] == [
        second]
    assert [r.requestId for r in await store.interactions.list_requests(limit=1, now=clock.now_ms())] == [first]


async def validating(store: Any, clock: ManualClock, **spec: Any) -> tuple[str, str, Any, str]:
    """An ask with a submission whose run was claimed to validate it: (request, submission, claim, worker)."""
    request_id, _, _ = await asking(store, clock, node="q", kind="ask", **spec)
    submission = await submit(store, clock, request_id, 5)
    assert await state(store) == ("waiting", "parked", None)  # released to the dispatcher
    [(got, worker)] = await claims(store, clock)
    return request_id, submission, got, worker


async def test_a_validated_submission_becomes_the_nodes_output(store: Any, clock: ManualClock) -> None:
    _request_id, submission, got, _ = await validating(store, clock)
    found = await store.interactions.waiting_attempt("r1", 0, "q", clock.now_ms())
    assert found is not None and found[1] is not None and (found[1].submissionId, found[1].value) == (submission, 5)
    async with store.transaction() as tx:
        await tx.runs.accept_attempt("r1", got.token, attempt_id=found[0], output=5, exit_name="next",
                                     now=clock.now_ms(), waiting=True)
        await tx.interactions.accept_submission("r1", submission, 5, clock.now_ms())
    done = await request(store, clock)
    assert (done.status, done.resolution.value, done.lastSubmission.status) == ("settled", 5, "accepted")
    assert await store.runs.accepted_steps("r1") == ([{"seq": 0, "node": "q", "exit": "next", "output": 5}], False)
    with pytest.raises(Rejected, match="not being validated"):
        await store.interactions.accept_submission("r1", submission, 5, clock.now_ms())
    assert await store.interactions.waiting_attempt("r1", 0, "q", clock.now_ms()) is None


async def test_a_rejected_submission_opens_the_request_again(store: Any, clock: ManualClock) -> None:
    request_id, submission, got, _ = await validating(store, clock)
    with pytest.raises(Rejected, match="not being validated"):
        await store.interactions.reject_submission("r1", got.token, "sub-x", "no", clock.now_ms())
    await store.interactions.reject_submission("r1", got.token, submission, "must be even", clock.now_ms())
    again = await request(store, clock)
    assert again.status == "pending" and again.lastSubmission.status == "rejected"
    assert "must be even" in again.lastSubmission.error
    assert await state(store) == ("waiting", "parked", "waiting")
    assert await claim(store, clock) is None
    await submit(store, clock, request_id, 6)
    assert await claim(store, clock) is not None


async def test_a_worker_with_nothing_to_validate_parks_the_run_waiting_again(store: Any, clock: ManualClock) -> None:
    request_id, _token, _ = await asking(store, clock, node="q", kind="ask")
    await submit(store, clock, request_id, 5)
    got = await claim(store, clock)
    await store.interactions.park_again("r1", got.token, clock.now_ms())
    assert await state(store) == ("waiting", "parked", "waiting")
    assert await claim(store, clock) is None


async def test_a_value_submitted_in_time_is_validated_however_late_a_worker_comes(store: Any,
                                                                                 clock: ManualClock) -> None:
    request_id, _, _ = await asking(store, clock, node="q", kind="ask", deadlineMs=1000)
    await submit(store, clock, request_id, 5)
    clock.advance(5000)  # no worker came for it before the deadline
    assert await store.interactions.next_deadline() is None
    assert await store.interactions.expire_due(clock.now_ms()) == ([], [])
    assert await claim(store, clock) is not None
    found = await store.interactions.waiting_attempt("r1", 0, "q", clock.now_ms())
    assert found is not None and found[1] is not None and found[1].value == 5


async def test_a_run_that_ends_closes_its_open_request(store: Any, clock: ManualClock) -> None:
    _request_id, submission, got, _ = await validating(store, clock)
    await store.queue.fail_run("r1", got.token, {"type": "DefinitionError", "message": "graph changed"},
                               clock.now_ms())
    closed = await request(store, clock)
    assert closed.status == "cancelled" and closed.lastSubmission is not None
    assert (closed.lastSubmission.submissionId, closed.lastSubmission.status) == (submission, "rejected")
    assert (await store.runs.status_counts(clock.now_ms()))["pendingInteractions"] == 0
    assert [s.status for s in (await store.runs.get_run("r1")).steps] == ["interrupted"]


async def test_a_waiting_node_replaced_by_a_changed_workflow_gives_its_request_up(store: Any,
                                                                               clock: ManualClock) -> None:
    await validating(store, clock)
    async with store.transaction() as tx:
        assert await tx.interactions.waiting_attempt("r1", 0, "renamed", clock.now_ms()) is None
    closed = await request(store, clock)
    assert closed.status == "cancelled" and closed.lastSubmission is not None
    assert "step 0 is now 'renamed'" in (closed.lastSubmission.error or "")


@pytest.mark.parametrize(("status", "paused", "kept"), [
    (WorkerStatus.CRASHED, False, False),  # rejected: the person submits again
    (WorkerStatus.STOPPED, False, True),  # the host stopped: the next host validates it
    (WorkerStatus.EXITED, True, True),  # paused meanwhile: validated once resumed
])
async def test_a_worker_ending_while_validating(store: Any, clock: ManualClock, status: WorkerStatus, paused: bool,
                                                kept: bool) -> None:
    _, _, got, worker = await validating(store, clock)
    if paused:
        await store.runs.pause_run("r1", clock.now_ms())
    ended = await store.supervision.end_worker(worker_id=worker, run_id="r1", token=got.token, status=status,
                                               now=clock.now_ms(), exit_code=None, signal=9, diagnostic=None,
                                               park=True, max_crashes=5)
    assert ended.waiting_again is not kept
    last = (await request(store, clock)).lastSubmission
    assert last is not None and last.status == ("validating" if kept else "rejected")
    run = await store.runs.run_summary("r1")
    assert (run.status, run.queueStatus) == (("running", "parked") if kept else ("waiting", "parked"))
    assert (await store.runs.status_counts(clock.now_ms()))["lifecycleContradictions"] == 0


async def test_a_submission_needs_the_current_revision_and_an_open_request(store: Any, clock: ManualClock) -> None:
    request_id, _, _ = await asking(store, clock, node="q", kind="ask")
    with pytest.raises(Conflict):
        await submit(store, clock, request_id, 1, expected=9)
    await submit(store, clock, request_id, 1, expected=1)
    with pytest.raises((Conflict, Rejected)):
        await submit(store, clock, request_id, 2)  # one is being validated


async def test_stale_claims_change_nothing_of_a_waiting_run(store: Any, clock: ManualClock) -> None:
    _request_id, submission, got, _ = await validating(store, clock)
    before = await store.runs.get_run("r1")
    with pytest.raises(ClaimLost):
        await store.interactions.park_again("r1", "stale", clock.now_ms())
    with pytest.raises(ClaimLost):
        await store.interactions.reject_submission("r1", "stale", submission, "no", clock.now_ms())
    after = await store.runs.get_run("r1")
    assert (after.status, after.queueStatus, after.revision) == (before.status, before.queueStatus, before.revision)
    assert (await request(store, clock)).lastSubmission.status == "validating"
    clock.advance(LEASE)
    with pytest.raises(ClaimLost):
        await store.interactions.park_again("r1", got.token, clock.now_ms())
