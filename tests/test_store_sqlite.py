"""What only the SQLite backend has: its counting triggers and its query plans. Everything
the interface promises is in tests/conformance/, run against every backend."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from piwf.clock import ManualClock
from piwf.errors import Conflict
from piwf.protocol import ChoiceSpec
from piwf.protocol.worker import InteractionOpenPayload
from piwf.store.sql import delivery, interactions, queue, runs, supervision
from piwf.status import WorkerStatus
from piwf.store.sqlite import Database
from piwf.store.sql import controllers as res
from piwf.store.sqlite.schema import SCHEMA_VERSION

from .conftest import frozen_layout


LEASE = 30_000


def new_run(db: Database, clock: ManualClock, run_id: str) -> None:
    runs.create_run(db, run_id=run_id, workflow="w", project_path="/p", source=b"src", digest="d1",
                    input=None, origin_session_id=None, now=clock.now_ms())
    clock.advance(1)


def claim(db: Database, clock: ManualClock, token: str) -> Any:
    return queue.claim_next_run(db, runner_id="h", token=token, lease_ms=LEASE, now=clock.now_ms(), epoch=1)


def test_the_maintained_lifecycle_count_sees_a_contradiction(db: Database, clock: ManualClock) -> None:
    for run_id in ("a", "b", "c", "d"):
        new_run(db, clock, run_id)
    claim(db, clock, "t1")
    claim(db, clock, "t2")
    queue.park_run(db, "a", "t1", clock.now_ms())
    queue.complete_run(db, "b", "t2", None, clock.now_ms())
    queue.cancel_run(db, "c", clock.now_ms())
    assert runs.status_counts(db, clock.now_ms())["lifecycleContradictions"] == 0
    db.execute("UPDATE runs SET status = 'completed' WHERE run_id = 'd'")
    assert runs.status_counts(db, clock.now_ms())["lifecycleContradictions"] == 1
    assert runs.recounted(db, clock.now_ms())["lifecycleContradictions"] == 1


def test_a_resource_keeps_exactly_its_most_recent_events(db: Database, clock: ManualClock) -> None:
    def apply(key: str) -> Any:
        return res.apply_resource(db, project="/p", controller="c", key=key, spec={}, initial=None,
                                  expected_version=None, now=clock.now)

    receipt, other = apply("a"), apply("b")
    with db.write():
        for n in range(res.KEPT_EVENTS + 37):
            res.add_resource_event(db, receipt.uid, "log", {"message": str(n)}, clock.now)
            if n % 3 == 0:  # interleaved with another resource's: counted per resource
                res.add_resource_event(db, other.uid, "log", {"message": str(n)}, clock.now)

    def count(uid: str) -> int:
        return db.scalar("SELECT COUNT(*) FROM controller_events WHERE uid = ?", (uid,))

    assert count(receipt.uid) == res.KEPT_EVENTS
    assert count(other.uid) == 1 + len(range(0, res.KEPT_EVENTS + 37, 3))  # its "applied" and the logs: not pruned
    assert res.events(db, receipt.uid, 1)[0].detail == {"message": str(res.KEPT_EVENTS + 36)}
    assert res.request_delete(db, "/p", "c", "a", clock.now).deleted
    assert count(receipt.uid) == 0  # its events went with it


def test_the_queries_of_a_runs_end_use_an_index_of_turns(db: Database, clock: ManualClock) -> None:
    """Each end of a run with a session reads the run's turns inside the write transaction:
    by an index, never by a scan of every turn ever kept."""
    for sql in (delivery.OPEN_TURN_SQL, delivery.TURNS_OF_RUN_SQL, delivery.LAST_INSTRUCTIONS_SQL,
                delivery.COUNT_UNRESOLVED_SQL):
        plan = [str(row[-1]) for row in db.execute("EXPLAIN QUERY PLAN " + sql, ("r1", "s1")[:sql.count("?")])]
        assert all(" USING " in step and "INDEX turns_" in step for step in plan if "turns" in step), (sql, plan)
        assert any("turns" in step for step in plan), (sql, plan)


def test_a_layout_6_database_is_migrated_with_the_delivery_tables(tmp_path: Path) -> None:
    path = tmp_path / "v6.db"
    conn = frozen_layout(path, 6)
    conn.execute("INSERT INTO runs (run_id, workflow, project_path, definition_hash, definition_digest, status, "
                 "origin_session_id, created_at, updated_at) VALUES ('a', 'w', '/p', 'h', 'd', 'completed', 's', 1, 1)")
    conn.execute("INSERT INTO run_queue (run_id, status, created_at, updated_at) VALUES ('a', 'done', 1, 1)")
    conn.close()
    db = Database.open(path)
    assert db.scalar("PRAGMA user_version") == SCHEMA_VERSION >= 8
    counts = runs.status_counts(db, 1)
    assert (counts["completedRuns"], counts["undeliveredNotifications"], counts["unresolvedTurns"]) == (1, 0, 0)
    assert {"notifications_undelivered", "turns_unresolved", "run_updates_seq"} <= {
        name for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'index'")}
    assert runs.get_run(db, "a").updates == []
    assert db.scalar("PRAGMA integrity_check") == "ok"
    db.close()


def test_status_counts_of_a_layout_6_database_read_as_it_is(tmp_path: Path) -> None:
    """`piwf status` with no host reads the database read-only, before any migration."""
    path = tmp_path / "v6.db"
    conn = frozen_layout(path, 6)
    conn.close()
    db = Database.open_readonly(path)
    counts = runs.status_counts(db, 1)
    assert (counts["undeliveredNotifications"], counts["unresolvedTurns"]) == (0, 0)
    db.close()


def test_the_claims_update_itself_keeps_one_active_run_per_session(db: Database, clock: ManualClock) -> None:
    """SESSION_FREE is in the claim's UPDATE, not only its SELECT: a writer that found a
    parked run of a session free takes nothing once another run of that session is active.
    (Through the interface the SELECT and UPDATE share one transaction; ``take`` alone is the
    UPDATE another writer's claim would race.)"""
    runs.create_run(db, run_id="r1", workflow="w", project_path="/p", source=b"src", digest="d1",
                    input=None, origin_session_id="s", now=clock.now_ms())
    first = claim(db, clock, "t1")
    assert queue.park_run(db, "r1", first.token, clock.now_ms())
    runs.create_run(db, run_id="r2", workflow="w", project_path="/p", source=b"src", digest="d1",
                    input=None, origin_session_id="s", now=clock.now_ms())
    assert claim(db, clock, "t2").run_id == "r2"
    with db.write():
        assert queue.take(db, "r1", runner_id="h", token="t3", lease_ms=LEASE, now=clock.now_ms(), epoch=1,
                          session="s", launch=True) is None
    assert db.scalar("SELECT status FROM run_queue WHERE run_id = 'r1'") == "parked"


@contextlib.contextmanager
def _traced(db: Database) -> Iterator[list[str]]:
    """The statements ``db`` runs inside the block, whitespace folded."""
    statements: list[str] = []

    def trace(cursor: Any, sql: str, bindings: Any) -> bool:
        statements.append(" ".join(sql.split()))
        return True

    db.conn.exec_trace = trace
    try:
        yield statements
    finally:
        db.conn.exec_trace = None


def test_a_claim_round_reads_its_candidates_once_and_each_run_once(db: Database, clock: ManualClock) -> None:
    """A round with room for more runs than are claimable reads the candidates once (the
    validating runs, the oldest ready ones, the expired claims), finds them all there are,
    and reads no more; each run's launch comes back with the write that sets it running
    (no read of the run after it)."""
    for run_id in ("a", "b"):
        new_run(db, clock, run_id)
    with _traced(db) as statements:
        got = supervision.claim_runs(db, room=4, exclude=frozenset(), runner_id="h", lease_ms=LEASE,
                                     now=clock.now_ms(), epoch=1)
    assert [c.run_id for c, _ in got] == ["a", "b"]
    reads = [sql for sql in statements if sql.startswith(("SELECT", "WITH"))]
    assert len(reads) == 3 and sum("INDEXED BY run_queue_ready" in sql for sql in reads) == 1, statements
    assert sum(sql.startswith("UPDATE runs SET status = 'running'") and "RETURNING" in sql
               for sql in statements) == 2, statements


def test_a_claim_round_says_it_found_all_there_was_only_when_it_did(db: Database, clock: ManualClock) -> None:
    """``exhausted``: every claimable run was tried and room was left (the dispatcher may
    then skip the round an end would wake); not when room ran out first. ``sessionless``
    only for a run of no origin session."""
    for run_id in ("a", "b"):
        new_run(db, clock, run_id)

    def round_of(room: int) -> Any:
        return supervision.claim_runs(db, room=room, exclude=frozenset(), runner_id="h", lease_ms=LEASE,
                                      now=clock.now_ms(), epoch=1)

    full = round_of(1)
    assert len(full) == 1 and not full.exhausted  # room ran out: there may be more
    rest = round_of(4)
    assert [c.run_id for c, _ in rest] == ["b"] and rest.exhausted
    assert all(c.sessionless for c, _ in [*full, *rest])
    empty = round_of(4)
    assert not empty and empty.exhausted
    runs.create_run(db, run_id="s1", workflow="w", project_path="/p", source=b"src", digest="d1",
                    input=None, origin_session_id="s", now=clock.now_ms())
    [(of_session, _)] = round_of(4)
    assert of_session.run_id == "s1" and not of_session.sessionless


def test_a_workers_end_after_its_run_ended_releases_nothing(db: Database, clock: ManualClock) -> None:
    """A worker whose run ended by its own message (a warm worker recorded once idle) ends
    with its record, its event and its run's answers forgotten: no read of requests to
    validate, no release of a claim that is gone (each is fenced by the token)."""
    new_run(db, clock, "a")
    [(got, worker_id)] = supervision.claim_runs(db, room=1, exclude=frozenset(), runner_id="h", lease_ms=LEASE,
                                                now=clock.now_ms(), epoch=1)
    queue.complete_run(db, "a", got.token, None, clock.now_ms())
    with _traced(db) as statements:
        ended = supervision.end_worker(db, worker_id=worker_id, run_id="a", token=got.token, status=WorkerStatus.EXITED,
                                       now=clock.now_ms(), exit_code=0, signal=None, diagnostic=None, park=True,
                                       max_crashes=3, backoff=1000)
    assert ended == (0, False, None)
    assert not [sql for sql in statements if "interaction_requests" in sql or sql.startswith("UPDATE run_queue")]
    assert db.scalar("SELECT status FROM run_workers WHERE worker_epoch = ?", (worker_id,)) == "exited"


@pytest.mark.parametrize("kind", ["decision", "ask"])
def test_an_answers_expected_revision_is_compared_in_its_write(
        db: Database, clock: ManualClock, monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    """answer_decision's and submit's compare-and-set on the request's revision is in the
    write: a request changed after its read (another writer's, as a backend whose reads are
    not serialised with its writes would see) is refused with the read's message."""
    new_run(db, clock, "r1")
    got = claim(db, clock, "t1")
    attempt_id, _ = runs.start_attempt(db, "r1", got.token, seq=0, node="n", generation=got.generation,
                                       now=clock.now_ms())
    spec: dict[str, Any] = {"choices": {"yes": ChoiceSpec("Yes")}} if kind == "decision" else {}
    request_id = interactions.open_request(
        db, "r1", got.token, InteractionOpenPayload(attemptId=attempt_id, kind=kind, title="?", **spec), clock.now_ms())
    read = interactions._open_request

    def read_then_changed(*args: Any) -> Any:
        row = read(*args)
        db.execute("UPDATE interaction_requests SET revision = revision + 1 WHERE request_id = ?", (request_id,))
        return row

    monkeypatch.setattr(interactions, "_open_request", read_then_changed)
    with pytest.raises(Conflict, match=f"request {request_id} is at revision 2, not 1"):
        if kind == "decision":
            interactions.answer_decision(db, request_id=request_id, choice="yes", text=None, answered_by="ann",
                                         expected_revision=1, now=clock.now_ms())
        else:
            interactions.submit(db, request_id=request_id, value=1, session_id=None, submitted_by="ann",
                                expected_revision=1, now=clock.now_ms())
    assert db.scalar("SELECT status FROM interaction_requests WHERE request_id = ?", (request_id,)) == "pending"
    assert db.scalar("SELECT COUNT(*) FROM interaction_submissions") == 0
