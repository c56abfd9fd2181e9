"""What only the SQLite backend has: its counting triggers and its query plans. Everything
the interface promises is in tests/conformance/, run against every backend."""

from __future__ import annotations

from typing import Any

from piwf.clock import ManualClock
from piwf.store.sqlite import Database, queue, runs
from piwf.store.sqlite import controllers as res

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
