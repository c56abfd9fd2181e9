"""The interaction store, transition by transition, on a manual clock."""

from __future__ import annotations

import pytest

from piwf.clock import ManualClock
from piwf.errors import Conflict, NotFound, Rejected
from piwf.protocol import ChoiceSpec, DefaultAnswer, TextInputSpec, UpdateAction
from piwf.status import WorkerStatus
from piwf.store.sqlite import Database, interactions, queue, runs, supervision
from piwf.protocol.worker import InteractionOpenPayload

LEASE = 30_000


def waiting_run(db: Database, clock: ManualClock, run_id: str = "r1", **spec: object) -> str:
    """A run whose first node opened a request; returns the request id."""
    runs.create_run(db, run_id=run_id, workflow="w", project_path="/p", source=b"s", digest="d", input=None,
                    origin_session_id=None, now=clock.now_ms())
    claim = queue.claim_run(db, run_id, runner_id="h", token="t-" + run_id, lease_ms=LEASE, now=clock.now_ms(),
                            epoch=1)
    assert claim is not None
    attempt_id, _ = runs.start_attempt(db, run_id, claim.token, seq=0, node="approve", generation=1,
                                       now=clock.now_ms())
    payload = InteractionOpenPayload(**{"attemptId": attempt_id, "kind": "decision", "title": "Go?",
                                        "choices": {"yes": ChoiceSpec("Yes"),
                                                    "why": ChoiceSpec("Because", TextInputSpec("Why?", 2, 5))},
                                        **spec})
    with db.write():
        return interactions.open_request(db, run_id, claim.token, payload, clock.now_ms())


def state(db: Database, run_id: str = "r1") -> tuple[str, str, str | None]:
    run = runs.run_summary(db, run_id)
    return run.status, run.queueStatus, run.hold


def test_opening_a_request_parks_the_run_as_waiting_and_unclaimable(db: Database, clock: ManualClock) -> None:
    request_id = waiting_run(db, clock)
    assert request_id == interactions.request_id_for("r1", db.scalar("SELECT attempt_id FROM node_attempts"))
    assert state(db) == ("waiting", "parked", "waiting")
    assert [s.status for s in runs.get_run(db, "r1").steps] == ["waiting"]
    assert queue.claim_next_run(db, runner_id="h", token="t2", lease_ms=LEASE, now=clock.now_ms(), epoch=1) is None
    assert runs.status_counts(db, clock.now_ms())["pendingInteractions"] == 1


def test_the_first_answer_wins_and_releases_the_run_once(db: Database, clock: ManualClock) -> None:
    request_id = waiting_run(db, clock)
    receipt = interactions.answer_decision(db, request_id=request_id, choice="why", text="héé", answered_by="ann",
                                           expected_revision=1, now=clock.now_ms())
    assert (receipt.choice, receipt.input, receipt.revision) == ("why", "héé", 2)  # code points, kept exactly
    assert state(db) == ("running", "parked", None)
    step = runs.get_run(db, "r1").steps[0]
    assert (step.status, step.exit) == ("accepted", "why")
    with pytest.raises(Conflict, match="another answer won"):
        interactions.answer_decision(db, request_id=request_id, choice="yes", text=None, answered_by="bob",
                                     expected_revision=None, now=clock.now_ms())
    assert runs.recounted(db, clock.now_ms())["lifecycleContradictions"] == 0


@pytest.mark.parametrize(("choice", "text", "error", "message"), [
    ("nope", None, Rejected, "not a choice"),
    ("yes", "x", Rejected, "takes no input"),
    ("why", None, Rejected, "needs input"),
    ("why", "a", Rejected, "must be 2 to 5"),
    ("why", "abcdef", Rejected, "must be 2 to 5"),
])
def test_a_bad_answer_changes_nothing(db: Database, clock: ManualClock, choice: str, text: str | None,
                                      error: type[Exception], message: str) -> None:
    request_id = waiting_run(db, clock)
    with pytest.raises(error, match=message):
        interactions.answer_decision(db, request_id=request_id, choice=choice, text=text, answered_by="a",
                                     expected_revision=None, now=clock.now_ms())
    assert state(db) == ("waiting", "parked", "waiting")
    assert interactions.get_request(db, request_id, clock.now_ms()).revision == 1


def test_unknown_requests_and_stale_revisions(db: Database, clock: ManualClock) -> None:
    request_id = waiting_run(db, clock)
    with pytest.raises(NotFound):
        interactions.answer_decision(db, request_id="req-x", choice="yes", text=None, answered_by="a",
                                     expected_revision=None, now=clock.now_ms())
    with pytest.raises(Conflict, match="revision 1, not 4"):
        interactions.answer_decision(db, request_id=request_id, choice="yes", text=None, answered_by="a",
                                     expected_revision=4, now=clock.now_ms())


def test_a_deadline_with_a_default_fires_exactly_once(db: Database, clock: ManualClock) -> None:
    request_id = waiting_run(db, clock, deadlineMs=2000, default=DefaultAnswer("yes"))
    assert interactions.next_deadline(db) == clock.now_ms() + 2000
    clock.advance(1999)
    assert interactions.expire_due(db, clock.now_ms()) == ([], [])
    clock.advance(1)  # at the deadline, an answer is refused and the default wins
    with pytest.raises(Rejected, match="expired"):
        interactions.answer_decision(db, request_id=request_id, choice="yes", text=None, answered_by="a",
                                     expected_revision=None, now=clock.now_ms())
    assert interactions.expire_due(db, clock.now_ms()) == ([request_id], [])
    assert interactions.expire_due(db, clock.now_ms() + 5000) == ([], [])  # once
    resolution = interactions.get_request(db, request_id, clock.now_ms()).resolution
    assert resolution is not None and (resolution.choice, resolution.provenance, resolution.answeredBy) == (
        "yes", "timeout", None)
    assert interactions.next_deadline(db) is None
    assert db.scalar("SELECT COUNT(*) FROM run_events WHERE type = 'decision.answered'") == 1


def test_no_default_and_no_timeout_exit_ends_the_run_timed_out(db: Database, clock: ManualClock) -> None:
    request_id = waiting_run(db, clock, deadlineMs=10)
    clock.advance(10)
    assert interactions.expire_due(db, clock.now_ms()) == ([request_id], [])
    assert state(db) == ("timed_out", "failed", None)
    assert interactions.get_request(db, request_id, clock.now_ms()).status == "expired"
    assert runs.recounted(db, clock.now_ms())["lifecycleContradictions"] == 0


def test_cancelling_a_waiting_run_cancels_its_request(db: Database, clock: ManualClock) -> None:
    request_id = waiting_run(db, clock)
    assert queue.cancel_run(db, "r1", clock.now_ms())
    assert interactions.get_request(db, request_id, clock.now_ms()).status == "cancelled"
    with pytest.raises(Rejected, match="cancelled"):
        interactions.answer_decision(db, request_id=request_id, choice="yes", text=None, answered_by="a",
                                     expected_revision=None, now=clock.now_ms())


def test_presentation_claims_expire(db: Database, clock: ManualClock) -> None:
    request_id = waiting_run(db, clock)

    def claim(client: str, revision: int) -> object:
        return interactions.update(db, request_id=request_id, expected_revision=revision, action=UpdateAction.CLAIM,
                                   client_id=client, entry_id=None, progress=None, lease_ms=10_000,
                                   now=clock.now_ms())
    assert claim("a", 1).presenter == "a"
    with pytest.raises(Conflict, match="presented by a"):
        claim("b", 2)
    clock.advance(10_000)  # a's claim expired: b may take it
    assert claim("b", 2).presenter == "b"


def ask_run(db: Database, clock: ManualClock, **spec: object) -> str:
    """A run waiting at an ask (seq 0, node 'q')."""
    runs.create_run(db, run_id="r1", workflow="w", project_path="/p", source=b"s", digest="d", input=None,
                    origin_session_id=None, now=clock.now_ms())
    claim = queue.claim_run(db, "r1", runner_id="h", token="t0", lease_ms=LEASE, now=clock.now_ms(), epoch=1)
    assert claim is not None
    attempt_id, _ = runs.start_attempt(db, "r1", "t0", seq=0, node="q", generation=1, now=clock.now_ms())
    payload = InteractionOpenPayload(**{"attemptId": attempt_id, "kind": "ask", "title": "How many?", **spec})
    with db.write():
        return interactions.open_request(db, "r1", "t0", payload, clock.now_ms())


def submit(db: Database, clock: ManualClock, request_id: str, value: object) -> str:
    return interactions.submit(db, request_id=request_id, value=value, session_id=None, submitted_by="ann",
                               expected_revision=None, now=clock.now_ms()).submissionId


def test_a_value_submitted_in_time_is_validated_however_late_a_worker_comes(db: Database,
                                                                           clock: ManualClock) -> None:
    request_id = ask_run(db, clock, deadlineMs=1000)
    submit(db, clock, request_id, 5)
    clock.advance(5000)  # no worker came for it before the deadline
    assert interactions.next_deadline(db) is None
    assert interactions.expire_due(db, clock.now_ms()) == ([], [])
    claim = queue.claim_run(db, "r1", runner_id="h", token="t1", lease_ms=LEASE, now=clock.now_ms(), epoch=1)
    assert claim is not None
    found = interactions.waiting_attempt(db, "r1", 0, "q", clock.now_ms())
    assert found is not None and found[1] is not None and found[1].value == 5


def test_a_run_that_ends_closes_its_open_request(db: Database, clock: ManualClock) -> None:
    request_id = ask_run(db, clock)
    submission = submit(db, clock, request_id, 5)
    claim = queue.claim_run(db, "r1", runner_id="h", token="t1", lease_ms=LEASE, now=clock.now_ms(), epoch=1)
    assert claim is not None
    queue.fail_run(db, "r1", "t1", {"type": "DefinitionError", "message": "graph changed"}, clock.now_ms())
    request = interactions.get_request(db, request_id, clock.now_ms())
    assert request.status == "cancelled" and request.lastSubmission is not None
    assert (request.lastSubmission.submissionId, request.lastSubmission.status) == (submission, "rejected")
    assert runs.status_counts(db, clock.now_ms())["pendingInteractions"] == 0
    assert [s.status for s in runs.get_run(db, "r1").steps] == ["interrupted"]


def test_a_waiting_node_replaced_by_a_changed_workflow_gives_its_request_up(db: Database,
                                                                             clock: ManualClock) -> None:
    request_id = ask_run(db, clock)
    submit(db, clock, request_id, 5)
    assert queue.claim_run(db, "r1", runner_id="h", token="t1", lease_ms=LEASE, now=clock.now_ms(), epoch=1)
    with db.write():
        assert interactions.waiting_attempt(db, "r1", 0, "renamed", clock.now_ms()) is None
    request = interactions.get_request(db, request_id, clock.now_ms())
    assert request.status == "cancelled" and request.lastSubmission is not None
    assert "step 0 is now 'renamed'" in (request.lastSubmission.error or "")


@pytest.mark.parametrize(("status", "paused", "kept"), [
    (WorkerStatus.CRASHED, False, False),  # rejected: the person submits again
    (WorkerStatus.STOPPED, False, True),  # the host stopped: the next host validates it
    (WorkerStatus.EXITED, True, True),  # paused meanwhile: validated once resumed
])
def test_a_worker_ending_while_validating(db: Database, clock: ManualClock, status: WorkerStatus, paused: bool,
                                          kept: bool) -> None:
    request_id = ask_run(db, clock)
    submit(db, clock, request_id, 5)
    supervision.claim_runs(db, room=1, exclude=frozenset(), runner_id="h", lease_ms=LEASE, now=clock.now_ms(),
                           epoch=1)
    token, = db.one("SELECT claim_token FROM run_queue WHERE run_id = 'r1'")
    epoch, = db.one("SELECT worker_epoch FROM run_workers WHERE run_id = 'r1' AND status = 'starting'")
    if paused:
        runs.pause_run(db, "r1", clock.now_ms())
    supervision.end_worker(db, worker_epoch=epoch, run_id="r1", token=token, status=status, now=clock.now_ms(),
                           exit_code=None, signal=9, diagnostic=None, park=True, max_crashes=5)
    last = interactions.get_request(db, request_id, clock.now_ms()).lastSubmission
    assert last is not None and last.status == ("validating" if kept else "rejected")
    run = runs.run_summary(db, "r1")
    assert (run.status, run.queueStatus) == (("running", "parked") if kept else ("waiting", "parked"))
    assert runs.recounted(db, clock.now_ms())["lifecycleContradictions"] == 0
