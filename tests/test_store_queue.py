"""Every run-queue transition, and every refused one (seed 003)."""

from __future__ import annotations

import pytest

from piwf.clock import ManualClock
from piwf.errors import ClaimLost, NotFound, Rejected
from piwf.store.sqlite import Database, queue, runs

LEASE = 30_000


def new_run(db: Database, clock: ManualClock, run_id: str = "r1", session: str | None = None) -> None:
    runs.create_run(db, run_id=run_id, workflow="w", project_path="/p", source=b"src", digest="d1",
                    input={"n": 1}, origin_session_id=session, now=clock.now_ms())
    clock.advance(1)


def claim(db: Database, clock: ManualClock, token: str = "t1", epoch: int = 1, **kw: object) -> queue.Claim | None:
    return queue.claim_next_run(db, runner_id="h", token=token, lease_ms=LEASE, now=clock.now_ms(), epoch=epoch, **kw)


def statuses(db: Database, run_id: str = "r1") -> tuple[str, str]:
    run = runs.get_run(db, run_id)
    return run.status, run.queueStatus


def test_new_run_is_queued(db: Database, clock: ManualClock) -> None:
    new_run(db, clock)
    assert statuses(db) == ("queued", "queued")
    assert runs.get_run(db, "r1").input == {"n": 1}


def test_claim_starts_the_run_and_bumps_generation(db: Database, clock: ManualClock) -> None:
    new_run(db, clock)
    first = claim(db, clock)
    assert first is not None and first.generation == 1
    assert statuses(db) == ("running", "starting")
    assert claim(db, clock, token="t2") is None  # a live claim is not claimable


def test_expired_claim_is_claimable_again_with_a_new_generation(db: Database, clock: ManualClock) -> None:
    new_run(db, clock)
    first = claim(db, clock)
    clock.advance(LEASE)
    second = claim(db, clock, token="t2")
    assert second is not None and second.generation == first.generation + 1
    assert not queue.verify_claim(db, "r1", "t1", clock.now_ms())
    assert queue.verify_claim(db, "r1", "t2", clock.now_ms())


def test_renew_extends_only_a_live_claim(db: Database, clock: ManualClock) -> None:
    new_run(db, clock)
    claim(db, clock)
    clock.advance(LEASE - 1)
    assert queue.renew_claim(db, "r1", "t1", LEASE, clock.now_ms())
    clock.advance(LEASE - 1)
    assert queue.verify_claim(db, "r1", "t1", clock.now_ms())
    assert not queue.renew_claim(db, "r1", "wrong", LEASE, clock.now_ms())
    clock.advance(1)
    assert not queue.renew_claim(db, "r1", "t1", LEASE, clock.now_ms())


def test_mark_running_is_fenced(db: Database, clock: ManualClock) -> None:
    new_run(db, clock)
    claim(db, clock)
    with pytest.raises(ClaimLost):
        queue.mark_running(db, "r1", "wrong", clock.now_ms())
    assert queue.mark_running(db, "r1", "t1", clock.now_ms())
    assert statuses(db) == ("running", "running")
    assert not queue.mark_running(db, "r1", "t1", clock.now_ms())  # already running


def test_park_releases_the_claim(db: Database, clock: ManualClock) -> None:
    new_run(db, clock)
    claim(db, clock)
    assert not queue.park_run(db, "r1", "wrong", clock.now_ms())
    assert queue.park_run(db, "r1", "t1", clock.now_ms())
    assert statuses(db) == ("running", "parked")
    assert not queue.park_run(db, "r1", "t1", clock.now_ms())  # no longer claimed
    again = claim(db, clock, token="t2")
    assert again is not None and again.generation == 2


def test_park_with_hold_is_not_claimed_until_resumed(db: Database, clock: ManualClock) -> None:
    new_run(db, clock)
    claim(db, clock)
    assert queue.park_run(db, "r1", "t1", clock.now_ms(), hold="source", detail="workflow source changed")
    assert runs.get_run(db, "r1").statusDetail == "workflow source changed"
    assert claim(db, clock, token="t2") is None
    runs.resume_run(db, "r1", clock.now_ms())
    assert claim(db, clock, token="t2") is not None


def test_complete_and_fail_need_the_live_token(db: Database, clock: ManualClock) -> None:
    new_run(db, clock)
    new_run(db, clock, "r2")
    claim(db, clock)
    claim(db, clock, token="t2")
    with pytest.raises(ClaimLost):
        queue.complete_run(db, "r1", "t2", {"x": 1}, clock.now_ms())
    queue.complete_run(db, "r1", "t1", {"x": 1}, clock.now_ms())
    assert statuses(db) == ("completed", "done")
    assert runs.get_run(db, "r1").output == {"x": 1}
    queue.fail_run(db, "r2", "t2", {"type": "ValueError", "message": "bad"}, clock.now_ms())
    assert statuses(db, "r2") == ("failed", "failed")
    assert runs.get_run(db, "r2").error["message"] == "bad"
    with pytest.raises(ClaimLost):
        queue.complete_run(db, "r2", "t2", None, clock.now_ms())  # settled runs take no writes


def test_expired_claim_cannot_complete(db: Database, clock: ManualClock) -> None:
    new_run(db, clock)
    claim(db, clock)
    clock.advance(LEASE)
    with pytest.raises(ClaimLost):
        queue.complete_run(db, "r1", "t1", None, clock.now_ms())


def test_cancel_unclaimed_runs_without_a_token(db: Database, clock: ManualClock) -> None:
    new_run(db, clock)
    assert queue.cancel_run(db, "r1", clock.now_ms())
    assert statuses(db) == ("cancelled", "cancelled")
    assert not queue.cancel_run(db, "r1", clock.now_ms())  # already ended


def test_cancel_of_a_claimed_run_needs_its_token(db: Database, clock: ManualClock) -> None:
    new_run(db, clock)
    claim(db, clock)
    assert not queue.cancel_run(db, "r1", clock.now_ms())
    assert not queue.cancel_run(db, "r1", clock.now_ms(), token="wrong")
    assert queue.cancel_run(db, "r1", clock.now_ms(), token="t1")
    assert statuses(db) == ("cancelled", "cancelled")
    assert claim(db, clock, token="t2") is None


def test_cancel_a_parked_run(db: Database, clock: ManualClock) -> None:
    new_run(db, clock)
    claim(db, clock)
    queue.park_run(db, "r1", "t1", clock.now_ms())
    assert queue.cancel_run(db, "r1", clock.now_ms())


def test_one_active_run_per_origin_session(db: Database, clock: ManualClock) -> None:
    new_run(db, clock, "r1", session="s")
    with pytest.raises(Rejected, match="already has an active run r1"):
        new_run(db, clock, "r2", session="s")
    new_run(db, clock, "d1")  # detached runs are exempt
    new_run(db, clock, "d2")
    queue.cancel_run(db, "r1", clock.now_ms())
    new_run(db, clock, "r2", session="s")


def test_parked_session_run_waits_while_its_session_has_another_active_run(db: Database, clock: ManualClock) -> None:
    new_run(db, clock, "r1", session="s")
    claim(db, clock)
    queue.park_run(db, "r1", "t1", clock.now_ms())
    new_run(db, clock, "r2", session="s")  # parked runs do not hold the session
    got = claim(db, clock, token="t2")
    assert got is not None and got.run_id == "r2"
    assert claim(db, clock, token="t3") is None  # r1 waits for r2
    queue.complete_run(db, "r2", "t2", None, clock.now_ms())
    got = claim(db, clock, token="t3")
    assert got is not None and got.run_id == "r1"


def test_claims_take_the_oldest_first_and_honour_exclusions(db: Database, clock: ManualClock) -> None:
    for run_id in ("a", "b", "c"):
        new_run(db, clock, run_id)
    got = claim(db, clock, exclude=frozenset({"a"}))
    assert got is not None and got.run_id == "b"
    got = claim(db, clock, token="t2")
    assert got is not None and got.run_id == "a"


def test_takeover_expires_claims_of_earlier_epochs(db: Database, clock: ManualClock) -> None:
    new_run(db, clock)
    claim(db, clock, epoch=1)
    assert claim(db, clock, token="t2", epoch=2) is None
    assert queue.expire_claims_before(db, 2, clock.now_ms()) == ["r1"]
    got = claim(db, clock, token="t2", epoch=2)
    assert got is not None and got.generation == 2


def test_claim_interrupts_running_attempts_of_the_previous_generation(db: Database, clock: ManualClock) -> None:
    new_run(db, clock)
    claim(db, clock)
    runs.start_attempt(db, "r1", "t1", seq=0, node="a", generation=1, now=clock.now_ms())
    clock.advance(LEASE)
    claim(db, clock, token="t2")
    assert [s.status for s in runs.get_run(db, "r1").steps] == ["interrupted"]


def test_attempts_are_fenced_and_accepted_once(db: Database, clock: ManualClock) -> None:
    new_run(db, clock)
    claim(db, clock)
    attempt, revision = runs.start_attempt(db, "r1", "t1", seq=0, node="a", generation=1, now=clock.now_ms())
    assert revision == 2
    with pytest.raises(ClaimLost):
        runs.accept_attempt(db, "r1", "bad", attempt_id=attempt, output=1, exit_name="next", now=clock.now_ms())
    runs.accept_attempt(db, "r1", "t1", attempt_id=attempt, output={"big": "x" * 10_000}, exit_name="next",
                        now=clock.now_ms())
    with pytest.raises(Rejected):
        runs.accept_attempt(db, "r1", "t1", attempt_id=attempt, output=2, exit_name="next", now=clock.now_ms())
    assert runs.accepted_steps(db, "r1") == ([{"seq": 0, "node": "a", "exit": "next", "output": {"big": "x" * 10_000}}],
                                             False)


def test_pause_holds_and_resume_releases(db: Database, clock: ManualClock) -> None:
    new_run(db, clock)
    runs.pause_run(db, "r1", clock.now_ms())
    assert runs.is_paused(db, "r1")
    assert claim(db, clock) is None
    runs.resume_run(db, "r1", clock.now_ms())
    assert claim(db, clock) is not None


def test_pause_and_resume_refuse_ended_and_unknown_runs(db: Database, clock: ManualClock) -> None:
    new_run(db, clock)
    queue.cancel_run(db, "r1", clock.now_ms())
    with pytest.raises(Rejected):
        runs.pause_run(db, "r1", clock.now_ms())
    with pytest.raises(Rejected):
        runs.resume_run(db, "r1", clock.now_ms())
    with pytest.raises(NotFound):
        runs.pause_run(db, "nope", clock.now_ms())


def test_duplicate_run_id_is_rejected(db: Database, clock: ManualClock) -> None:
    new_run(db, clock)
    with pytest.raises(Rejected, match="already taken"):
        new_run(db, clock)


def test_lifecycle_never_contradicts(db: Database, clock: ManualClock) -> None:
    for run_id in ("a", "b", "c", "d"):
        new_run(db, clock, run_id)
    claim(db, clock)
    claim(db, clock, token="t2")
    queue.park_run(db, "a", "t1", clock.now_ms())
    queue.complete_run(db, "b", "t2", None, clock.now_ms())
    queue.cancel_run(db, "c", clock.now_ms())
    assert runs.status_counts(db, clock.now_ms())["lifecycleContradictions"] == 0
    db.execute("UPDATE runs SET status = 'completed' WHERE run_id = 'd'")
    assert runs.status_counts(db, clock.now_ms())["lifecycleContradictions"] == 1


def test_many_excluded_runs_do_not_hide_a_claimable_one(db: Database, clock: ManualClock) -> None:
    for i in range(40):
        new_run(db, clock, f"r{i:02}")
    got = claim(db, clock, exclude=frozenset(f"r{i:02}" for i in range(39)))
    assert got is not None and got.run_id == "r39"


def test_a_crash_back_off_is_kept_with_the_run_and_claims_skip_it_until_it_ends(db: Database,
                                                                                 clock: ManualClock) -> None:
    from piwf.status import WorkerStatus
    from piwf.store.api import WorkerEnded
    from piwf.store.sqlite import supervision

    def end(status: WorkerStatus) -> WorkerEnded:
        """Claim the run and record its worker's end, with a back-off doubling per crash."""
        records = supervision.claim_runs(db, room=1, exclude=frozenset(), runner_id="h", lease_ms=LEASE,
                                         now=clock.now_ms(), epoch=1)
        assert [c.run_id for c, _ in records] == ["r1"]
        ended = supervision.end_worker(db, worker_epoch=records[0][1], run_id="r1", token=records[0][0].token,
                                       status=status, now=clock.now_ms(), exit_code=1, signal=None, diagnostic=None,
                                       park=True, max_crashes=3, backoff=lambda before: 1000 * 2 ** before)
        return ended

    new_run(db, clock)
    first = end(WorkerStatus.CRASHED)
    assert (first.crashes, first.not_before) == (1, clock.now_ms() + 1000)
    clock.advance(999)
    assert claim(db, clock) is None  # within the back-off: no host claims it
    clock.advance(1)
    second = end(WorkerStatus.CRASHED)  # the back-off doubles
    assert (second.crashes, second.not_before) == (2, clock.now_ms() + 2000)
    runs.resume_run(db, "r1", clock.now_ms())  # an operator's resume lifts it
    assert claim(db, clock, token="t3") is not None
