"""SQLite's one-statement ``get_run`` (store/sql/run_detail.py) against the statement by
statement read PostgreSQL uses (``_generic``), on the same database at each stage of a run
that has every part a RunDetail shows: blob-held input and results, several steps,
workers, effects and updates (in an order their insertion does not give), an open request,
a placement reason, an output and an error."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from piwf.clock import ManualClock
from piwf.errors import NotFound
from piwf.protocol import ChoiceSpec
from piwf.protocol.worker import InteractionOpenPayload
from piwf.status import WorkerStatus
from piwf.store.sql import effects, interactions, queue, run_detail, runs, supervision, updates
from piwf.store.sql.timefmt import iso
from piwf.store.sqlite import Database

LEASE = 30_000
BIG = {"text": "x" * 5000}  # longer than INLINE_JSON_LIMIT: kept as a blob


def same(db: Database, run_id: str, now: int) -> Any:
    """Both reads of the run, which must be equal field for field and byte for byte."""
    fast, generic = run_detail.get_run(db, run_id, now), run_detail._generic(db, run_id, now)
    assert fast == generic
    assert msgspec.json.encode(fast) == msgspec.json.encode(generic)
    return fast


def new_run(db: Database, clock: ManualClock, run_id: str, input: Any) -> None:
    runs.create_run(db, run_id=run_id, workflow="w", project_path="/p", source=b"src", digest="d1", input=input,
                    origin_session_id=None, now=clock.now_ms())
    clock.advance(1)


def claimed(db: Database, clock: ManualClock) -> tuple[Any, str]:
    [(got, worker_id)] = supervision.claim_runs(db, room=1, exclude=frozenset(), runner_id="h", lease_ms=LEASE,
                                                now=clock.now_ms(), epoch=1)
    return got, worker_id


def test_the_one_statement_read_equals_the_generic_one_at_every_stage(db: Database, clock: ManualClock) -> None:
    new_run(db, clock, "r1", BIG)
    new_run(db, clock, "r2", {"n": 1})
    queued = same(db, "r1", clock.now_ms())
    assert queued.input == BIG and queued.placement is not None  # no live host serves its queue
    assert same(db, "r1", 0).placement is None

    got, worker_id = claimed(db, clock)
    first, _ = runs.start_attempt(db, "r1", got.token, seq=0, node="a", generation=got.generation, now=clock.now_ms())
    runs.fail_attempt(db, "r1", got.token, attempt_id=first, error={"message": "no"}, now=clock.now_ms())
    for key in ("z", "b"):  # the same created_at: ordered by key
        effects.reserve(db, "r1", key, node="a", generation=got.generation, observable=True, now=clock.now_ms())
    clock.advance(1)
    effects.reserve(db, "r1", "a", node="a", generation=got.generation, observable=True, now=clock.now_ms())
    for key, result in (("z", BIG), ("b", {"ok": 1})):
        effects.begin_apply(db, "r1", key, generation=got.generation, now=clock.now_ms())
        effects.settle(db, "r1", key, generation=got.generation, result=result, now=clock.now_ms())
    effects.begin_apply(db, "r1", "a", generation=got.generation, now=clock.now_ms())
    effects.settle(db, "r1", "a", generation=got.generation, error={"message": "refused"}, now=clock.now_ms())
    second, _ = runs.start_attempt(db, "r1", got.token, seq=0, node="a", generation=got.generation,
                                   now=clock.now_ms())
    for type_, key in (("t2", "k"), ("t1", "é"), ("t1", "z"), ("t1", "A")):
        updates.publish(db, "r1", got.token, attempt_id=second, type=type_, key=key, data={"at": [type_, key]},
                        now=clock.now_ms())
    clock.advance(1)
    running = same(db, "r1", clock.now_ms())
    assert [(u.type, u.key) for u in running.updates] == [("t1", "A"), ("t1", "z"), ("t1", "é"), ("t2", "k")]
    assert [e.key for e in running.effects] == ["b", "z", "a"] and running.effects[1].result == BIG
    assert [s.status for s in running.steps] == ["failed", "running"]

    runs.accept_attempt(db, "r1", got.token, attempt_id=second, output={"x": 1}, exit_name="next", now=clock.now_ms())
    asking, _ = runs.start_attempt(db, "r1", got.token, seq=1, node="ask", generation=got.generation,
                                   now=clock.now_ms())
    payload = InteractionOpenPayload(attemptId=asking, kind="decision", title="Go?", choices={"yes": ChoiceSpec("Yes")})
    interactions.open_request(db, "r1", got.token, payload, clock.now_ms())
    waiting = same(db, "r1", clock.now_ms())
    assert waiting.status == "waiting" and [r.nodeId for r in waiting.waitingFor] == ["ask"]

    supervision.end_worker(db, worker_id=worker_id, run_id="r1", token=got.token, status=WorkerStatus.EXITED,
                           now=clock.now_ms(), exit_code=0, signal=None, diagnostic="bye", park=True, max_crashes=3)
    clock.advance(1)
    other, _ = claimed(db, clock)  # r2, then r1 is answered and claimed again
    queue.fail_run(db, "r2", other.token, {"message": "bad", "type": "E"}, clock.now_ms())
    assert same(db, "r2", clock.now_ms()).error == {"message": "bad", "type": "E"}
    request_id = waiting.waitingFor[0].requestId
    interactions.answer_decision(db, request_id=request_id, choice="yes", text=None, answered_by="ann",
                                 expected_revision=None, now=clock.now_ms())
    again, _ = claimed(db, clock)
    queue.complete_run(db, "r1", again.token, BIG, clock.now_ms())
    done = same(db, "r1", clock.now_ms())
    assert done.output == BIG and len(done.workers) == 2 and done.waitingFor == []


def test_a_run_with_nothing_in_blobs_is_read_by_the_one_statement_alone(db: Database, clock: ManualClock) -> None:
    new_run(db, clock, "r1", {"n": 1})
    got, _ = claimed(db, clock)
    attempt, _ = runs.start_attempt(db, "r1", got.token, seq=0, node="a", generation=got.generation,
                                    now=clock.now_ms())
    for key in ("k2", "k1"):
        effects.reserve(db, "r1", key, node="a", generation=got.generation, observable=True, now=clock.now_ms())
        effects.begin_apply(db, "r1", key, generation=got.generation, now=clock.now_ms())
        effects.settle(db, "r1", key, generation=got.generation, result={"key": key}, now=clock.now_ms())
        updates.publish(db, "r1", got.token, attempt_id=attempt, type="t", key=key, data=[key], now=clock.now_ms())
    runs.accept_attempt(db, "r1", got.token, attempt_id=attempt, output=None, exit_name="next", now=clock.now_ms())
    queue.complete_run(db, "r1", got.token, {"done": True}, clock.now_ms())
    assert not run_detail._needs_more(run_detail._detail_row(db, "r1"), clock.now_ms())
    done = same(db, "r1", clock.now_ms())
    assert [e.key for e in done.effects] == ["k1", "k2"] and [u.key for u in done.updates] == ["k1", "k2"]


def test_an_unknown_run_is_not_found_either_way(db: Database) -> None:
    for read in (run_detail.get_run, run_detail._generic):
        with pytest.raises(NotFound):
            read(db, "nope", 1)


@pytest.mark.parametrize("ms", [0, 999, 1000, 1_700_000_000_123, 1_700_000_000_999, 253_402_300_799_999])
def test_times_read_as_strftime_makes_them(ms: int) -> None:
    import time

    expected = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ms // 1000)) + f".{ms % 1000:03d}Z"
    assert iso(ms) == iso(ms) == expected


def claimed_run(db: Database, clock: ManualClock) -> Any:
    """A claimed run (not ready to be claimed: no placement reason), its claim."""
    new_run(db, clock, "r1", {"n": 1})
    got, _ = claimed(db, clock)
    return got


def steps_of(db: Database, now: int) -> list[str]:
    return [s.status for s in run_detail.get_run(db, "r1", now).steps]


def test_an_answer_is_kept_while_nothing_is_committed(db: Database, clock: ManualClock) -> None:
    claimed_run(db, clock)
    now = clock.now_ms()
    first = run_detail.get_run(db, "r1", now)
    assert run_detail.get_run(db, "r1", now + 1) is first  # given again, not read again
    assert run_detail.get_run(db, "r1", now + run_detail.KEPT_MS) is not first  # too old: read again
    assert run_detail.get_run(db, "r1", 0) is not first  # no time given: nothing is kept


def test_a_kept_answer_is_read_again_after_this_connections_commit(db: Database, clock: ManualClock) -> None:
    got = claimed_run(db, clock)
    assert steps_of(db, clock.now_ms()) == []
    runs.start_attempt(db, "r1", got.token, seq=0, node="a", generation=got.generation, now=clock.now_ms())
    assert steps_of(db, clock.now_ms()) == ["running"]


def test_a_kept_answer_is_read_again_after_another_connections_commit(db: Database, clock: ManualClock) -> None:
    got = claimed_run(db, clock)
    assert steps_of(db, clock.now_ms()) == []
    other = Database.open(db.path)  # another connection, as another process's would be
    try:
        runs.start_attempt(other, "r1", got.token, seq=0, node="a", generation=got.generation, now=clock.now_ms())
    finally:
        other.close()
    assert steps_of(db, clock.now_ms()) == ["running"]
    other = Database.open(db.path)
    try:
        new_run(other, clock, "r2", {"n": 2})  # a commit elsewhere, to another run: read again, then kept
    finally:
        other.close()
    fresh = run_detail.get_run(db, "r1", clock.now_ms())
    assert run_detail.get_run(db, "r1", clock.now_ms()) is fresh


def test_nothing_read_inside_a_transaction_is_kept_or_given(db: Database, clock: ManualClock) -> None:
    got = claimed_run(db, clock)
    before = run_detail.get_run(db, "r1", clock.now_ms())
    with pytest.raises(RuntimeError), db.write():
        runs.start_attempt(db, "r1", got.token, seq=0, node="a", generation=got.generation, now=clock.now_ms())
        assert steps_of(db, clock.now_ms()) == ["running"]  # what this transaction wrote, not the kept answer
        raise RuntimeError("rolled back")
    after = run_detail.get_run(db, "r1", clock.now_ms())
    assert after.steps == [] and after == before


def test_an_answer_that_depends_on_the_time_is_not_kept(db: Database, clock: ManualClock) -> None:
    new_run(db, clock, "r1", {"n": 1})  # queued: its placement reason is read at the time given
    assert run_detail.get_run(db, "r1", clock.now_ms()).placement is not None
    assert "r1" not in db.kept
