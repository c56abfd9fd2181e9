"""What only the SQLite backend has: its counting triggers and its query plans. Everything
the interface promises is in tests/conformance/, run against every backend."""

from __future__ import annotations

from typing import Any

from piwf.clock import ManualClock
from piwf.store.sqlite import Database, queue, runs

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
