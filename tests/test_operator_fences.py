"""An operator's run.cancel, run.pause and run.resume: the revision they expect, and the
hold a resume on a changed workflow relies on, are checked by the store's write itself
(not read first), and a refused one changes nothing."""

from __future__ import annotations

import pytest

from piwf.clock import ManualClock
from piwf.errors import Conflict, NotFound, Rejected
from piwf.store.sql import queue, runs
from piwf.store.sqlite import Database

LEASE = 30_000


def new_run(db: Database, clock: ManualClock, run_id: str = "r1") -> None:
    runs.create_run(db, run_id=run_id, workflow="w", project_path="/p", source=b"src", digest="d1",
                    input={"n": 1}, origin_session_id=None, now=clock.now_ms())
    clock.advance(1)


def claim(db: Database, clock: ManualClock, token: str = "t1") -> queue.Claim:
    got = queue.claim_next_run(db, runner_id="h", token=token, lease_ms=LEASE, now=clock.now_ms(), epoch=1)
    assert got is not None
    return got


def test_cancel_at_another_revision_is_a_conflict_and_changes_nothing(db: Database, clock: ManualClock) -> None:
    new_run(db, clock)
    with pytest.raises(Conflict, match="at revision 1, not 7"):
        queue.cancel_run(db, "r1", clock.now_ms(), expected_revision=7)
    got = claim(db, clock)
    with pytest.raises(Conflict, match="at revision 1, not 7"):
        queue.cancel_run(db, "r1", clock.now_ms(), token=got.token, expected_revision=7)
    assert runs.get_run(db, "r1").queueStatus == "starting"
    assert queue.cancel_run(db, "r1", clock.now_ms(), token=got.token, expected_revision=1)
    assert runs.get_run(db, "r1").status == "cancelled"


def test_cancel_of_an_unknown_run_is_not_found(db: Database, clock: ManualClock) -> None:
    with pytest.raises(NotFound):
        queue.cancel_run(db, "nope", clock.now_ms())


def test_a_run_that_cannot_be_cancelled_so_is_refused_by_the_answer_not_an_error(db: Database,
                                                                                 clock: ManualClock) -> None:
    new_run(db, clock)
    claim(db, clock)
    assert not queue.cancel_run(db, "r1", clock.now_ms(), expected_revision=1)  # claimed: only its token cancels
    assert not queue.cancel_run(db, "r1", clock.now_ms(), token="wrong", expected_revision=1)


def test_pause_and_resume_check_the_revision_in_their_write(db: Database, clock: ManualClock) -> None:
    new_run(db, clock)
    with pytest.raises(Conflict, match="not 2"):
        runs.pause_run(db, "r1", clock.now_ms(), expected_revision=2)
    assert runs.hold_of(db, "r1") is None and not runs.is_paused(db, "r1")
    assert runs.pause_run(db, "r1", clock.now_ms(), expected_revision=1)["paused"] is True
    with pytest.raises(Conflict, match="not 2"):
        runs.resume_run(db, "r1", clock.now_ms(), expected_revision=2)
    assert runs.hold_of(db, "r1") == "paused"
    assert runs.resume_run(db, "r1", clock.now_ms(), expected_revision=1)["paused"] is False


def test_refusals_keep_their_order_unknown_then_revision_then_ended(db: Database, clock: ManualClock) -> None:
    with pytest.raises(NotFound):
        runs.pause_run(db, "nope", clock.now_ms(), expected_revision=1)
    new_run(db, clock)
    queue.cancel_run(db, "r1", clock.now_ms())
    with pytest.raises(Conflict):
        runs.pause_run(db, "r1", clock.now_ms(), expected_revision=1)  # cancelling made it revision 2
    with pytest.raises(Rejected, match="already ended"):
        runs.pause_run(db, "r1", clock.now_ms(), expected_revision=2)
    with pytest.raises(Rejected, match="already ended"):
        runs.resume_run(db, "r1", clock.now_ms())


def test_a_new_definition_is_adopted_only_while_the_run_is_held_for_its_changed_workflow(
        db: Database, clock: ManualClock) -> None:
    new_run(db, clock)
    got = claim(db, clock)
    queue.park_run(db, "r1", got.token, clock.now_ms(), hold="source", detail="workflow source changed")
    runs.resume_run(db, "r1", clock.now_ms(), definition=("d2", b"new source", "a"))  # the first resume wins
    assert runs.run_source(db, "r1")[2] == "d2"
    claim(db, clock, token="t2")  # the run goes on, on the new definition
    with pytest.raises(Conflict, match="no longer held because its workflow changed"):
        runs.resume_run(db, "r1", clock.now_ms(), definition=("d3", b"newer source", "b"))
    assert runs.run_source(db, "r1")[2] == "d2"  # a second resume prepared meanwhile changed nothing
