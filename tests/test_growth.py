"""What the database keeps does not grow with every run ever stored (issue 14, item 11):
stored worker answers go once their run has ended, and host.status reads maintained
counts that stay exact through every change to runs and run_queue."""

from __future__ import annotations

import tempfile
from pathlib import Path

import apsw
from hypothesis import example, given, settings
from hypothesis import strategies as st

from piwf.paths import StatePaths
from piwf.status import QueueStatus, RunStatus
from piwf.store.sql import queue, runs, workers
from piwf.store.sqlite import Database
from piwf.protocol.worker import WorkerResponse, parse_worker_message
from piwf.wire import canonical_json

from .conftest import wait_for
from .test_lifecycle import _running_worker, call, run_status, start

# --- stored worker answers ----------------------------------------------------------------


def stored_answers(paths: StatePaths, run_id: str) -> int:
    db = Database.open_readonly(paths.db)
    try:
        return db.scalar("""SELECT COUNT(*) FROM worker_messages WHERE worker_epoch IN
                            (SELECT worker_epoch FROM run_workers WHERE run_id = ?)""", (run_id,))
    finally:
        db.close()


async def workers_ended(paths: StatePaths, run_id: str) -> bool:
    return all(w["status"] not in ("starting", "running") for w in (await run_status(paths, run_id))["workers"])


async def test_an_ended_runs_stored_worker_answers_are_deleted_when_its_worker_ends(
    host: object, paths: StatePaths, project: Path
) -> None:
    completed = await start(paths, project, "greet")
    await wait_for(lambda: _status_is(paths, completed, "completed"))
    await wait_for(lambda: workers_ended(paths, completed))
    assert stored_answers(paths, completed) == 0

    cancelled = await start(paths, project, "gated")  # blocks in its second node until told
    await wait_for(lambda: _running_worker(paths, cancelled))
    await wait_for(lambda: (project / "wait.log").exists())
    assert stored_answers(paths, cancelled) > 0  # kept while the run is live
    await call(paths, "run.cancel", run_id=cancelled)
    await wait_for(lambda: workers_ended(paths, cancelled))
    assert stored_answers(paths, cancelled) == 0


async def _status_is(paths: StatePaths, run_id: str, status: str) -> bool:
    return (await run_status(paths, run_id))["status"] == status


def _answer(db: Database, run_id: str, token: str, worker_id: str, message_id: str, now: int) -> None:
    message = parse_worker_message(canonical_json({
        "messageId": message_id, "workerEpoch": worker_id, "generation": 1, "expectedRevision": 0,
        "operation": "worker.ready", "payload": {}}))
    with db.write():  # as the host answers it: the fence, then the recorded answer
        revision = queue.fenced_revision(db, run_id, token, now)
        workers.record_message(db, message, WorkerResponse(message_id, "accepted", revision=revision), now)


def _claimed_run_with_a_worker(db: Database, run_id: str, now: int) -> str:
    runs.create_run(db, run_id=run_id, workflow="w", project_path="/", source=b"", digest="d", input=None,
                    origin_session_id=None, now=now)
    claim = queue.claim_run(db, run_id, runner_id="h", token=f"t-{run_id}", lease_ms=60_000, now=now, epoch=1)
    assert claim is not None
    workers.record_start(db, worker_id=f"w-{run_id}", run_id=run_id, generation=1, host_epoch=1, now=now)
    _answer(db, run_id, claim.token, f"w-{run_id}", "m1", now)
    return claim.token


def test_the_backstop_prunes_only_ended_workers_of_ended_runs(db: Database) -> None:
    """Runs that ended without their worker's end pruning them (a host that died between
    the two, answers stored before layout 4) are pruned by workers.prune_messages."""
    ended = _claimed_run_with_a_worker(db, "ended", 1)
    queue.complete_run(db, "ended", ended, {"ok": True}, 2)
    workers.orphan_before(db, 2, 3)  # a later host found its worker and ended it
    _claimed_run_with_a_worker(db, "live", 1)
    racing = _claimed_run_with_a_worker(db, "racing", 1)  # ended; its worker's end not yet recorded
    queue.complete_run(db, "racing", racing, {"ok": True}, 4)

    assert workers.prune_messages(db, batch=1) == 1
    assert workers.prune_messages(db) == 0
    left = {epoch for (epoch,) in db.execute("SELECT worker_epoch FROM worker_messages")}
    assert left == {"w-live", "w-racing"}


def test_a_repeated_message_id_of_a_live_run_still_gets_its_stored_answer(db: Database) -> None:
    _claimed_run_with_a_worker(db, "r", 1)
    assert workers.prune_messages(db) == 0
    repeat = parse_worker_message(canonical_json({
        "messageId": "m1", "workerEpoch": "w-r", "generation": 1, "expectedRevision": 0,
        "operation": "worker.ready", "payload": {}}))
    assert isinstance(workers.read_message(db, repeat), WorkerResponse)


# --- maintained counts ----------------------------------------------------------------------

RUN_STATUSES = [str(s) for s in RunStatus]
QUEUE_STATUSES = [str(s) for s in QueueStatus]

# Hand edits: any status on either side, pause flags, rows added and removed, run ids moved.
EDITS = st.one_of(
    st.tuples(st.just("run_status"), st.integers(0, 3), st.sampled_from(RUN_STATUSES)),
    st.tuples(st.just("queue_status"), st.integers(0, 3), st.sampled_from(QUEUE_STATUSES)),
    st.tuples(st.just("paused"), st.integers(0, 3), st.integers(0, 2)),
    st.tuples(st.just("delete_queue"), st.integers(0, 5), st.none()),
    st.tuples(st.just("delete_run"), st.integers(0, 5), st.none()),
    st.tuples(st.just("insert"), st.integers(0, 5), st.sampled_from(QUEUE_STATUSES)),
    st.tuples(st.just("rename_run"), st.integers(0, 5), st.integers(0, 5)),
)


def _edit(conn: apsw.Connection, edit: tuple[str, int, object]) -> None:
    kind, i, value = edit
    run_id = f"r{i}"
    statements = {
        "run_status": ("UPDATE runs SET status = ? WHERE run_id = ?", (value, run_id)),
        "queue_status": ("UPDATE run_queue SET status = ? WHERE run_id = ?", (value, run_id)),
        "paused": ("UPDATE runs SET paused = ? WHERE run_id = ?", (value, run_id)),
        "delete_queue": ("DELETE FROM run_queue WHERE run_id = ?", (run_id,)),
        "delete_run": ("DELETE FROM runs WHERE run_id = ?", (run_id,)),
        "insert": ("""INSERT OR IGNORE INTO run_queue (run_id, status, created_at, updated_at)
                      VALUES (?, ?, 0, 0)""", (run_id, value)),
        "rename_run": ("UPDATE OR IGNORE runs SET run_id = ? WHERE run_id = ?", (f"r{value}", run_id)),
    }
    conn.execute(*statements[kind])


@settings(max_examples=150, deadline=None)
@given(st.lists(EDITS, max_size=30))
@example([("run_status", 0, "completed"), ("run_status", 0, "queued")])  # a contradiction made, then mended
@example([("queue_status", 1, "done"), ("rename_run", 1, 4), ("insert", 1, "queued"), ("delete_run", 4, None)])
def test_counts_stay_exact_through_any_edit_even_by_hand(edits: list[tuple[str, int, object]]) -> None:
    """Whatever changes runs or run_queue (piwf or the sqlite3 shell), the counts kept by
    triggers equal a full count, contradictions included."""
    with tempfile.TemporaryDirectory() as tmp:
        db = Database.open(Path(tmp) / "counts.db", durability="normal")
        for i in range(4):
            runs.create_run(db, run_id=f"r{i}", workflow="w", project_path="/", source=b"", digest="d", input=None,
                            origin_session_id=None, now=i)
        db.execute("PRAGMA foreign_keys = OFF")  # a hand edit need not respect them
        for edit in edits:
            _edit(db.conn, edit)
            assert runs.status_counts(db, 10) == runs.recounted(db, 10), edit
        db.close()
