"""Retention: ended runs deleted with everything of theirs, and the blobs no one uses.

A run is deleted once it ended (engine and queue status both ended) before a cut-off, and
only if no controller follows it as a child (a ``controller_workflows`` row, which goes
only with its resource: ``ensure`` must keep finding the child it started). One call
deletes at most ``limit`` runs in one transaction, so a host prunes in bounded batches and
serves in between. The command log keeps its own window: the answers naming a pruned run
are turned into ``notFound`` saying the run was deleted (``commands.forget_runs``), so a
retried request is answered so and never carried out again.

Blobs are content-addressed and shared (a workflow's source by all its runs), so a run's
blobs are candidates only: each is deleted in a write that checks no row anywhere refers
to it and that it was not stored or reused within ``BLOB_GRACE_MS`` — ``put_blob`` refreshes
an older blob's ``created_at`` when it is stored again (at most every ``BLOB_TOUCH_MS``), so
a blob a run is inserting at that moment is never deleted under it, even when storing the
blob and the row that refers to it are two transactions, and (PostgreSQL) the delete waits
for the refresh's row lock and sees it.
"""

from __future__ import annotations

from piwf.status import ENDED, RunStatus
from piwf.store.api.retention import BLOB_SWEEP, PRUNE_BATCH
from piwf.store.api.rules import BLOB_GRACE_MS
from piwf.store.api.types import Pruned
from piwf.store.sql import commands
from piwf.store.sql.database import Database, one_of

_ENDED_RUN = one_of(sorted((RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.TIMED_OUT, RunStatus.CANCELLED)))

# Runs that may be deleted: ended before the cut-off, followed by no controller.
_PRUNABLE_WHERE = f"""r.finished_at IS NOT NULL AND r.finished_at < ? AND r.status IN ({_ENDED_RUN})
  AND NOT EXISTS (SELECT 1 FROM controller_workflows c WHERE c.run_id = r.run_id)"""
_PRUNABLE = f"FROM runs r WHERE {_PRUNABLE_WHERE}"

# The guard, in the write that deletes: the queue row goes only while its run is still ended
# (a retry meanwhile requeued it) and still followed by no controller.
_TAKE = f"""DELETE FROM run_queue WHERE run_id IN ({{ids}}) AND status IN ({one_of(sorted(ENDED))})
  AND NOT EXISTS (SELECT 1 FROM controller_workflows c WHERE c.run_id = run_queue.run_id)
  AND (SELECT r.status FROM runs r WHERE r.run_id = run_queue.run_id) IN ({_ENDED_RUN})
  RETURNING run_id"""

# Everything of the runs, children first (foreign keys): (table, the condition naming them).
_OWN_ROWS = (
    ("worker_messages", "worker_epoch IN (SELECT w.worker_epoch FROM run_workers w WHERE w.run_id IN ({ids}))"),
    ("run_processes", "run_id IN ({ids})"),
    ("run_placement", "run_id IN ({ids})"),
    ("run_workers", "run_id IN ({ids})"),
    ("interaction_submissions",
     "request_id IN (SELECT i.request_id FROM interaction_requests i WHERE i.run_id IN ({ids}))"),
    ("interaction_requests", "run_id IN ({ids})"),
    ("notifications", "run_id IN ({ids})"),
    ("followups", "run_id IN ({ids})"),
    ("turns", "run_id IN ({ids})"),
    ("run_updates", "run_id IN ({ids})"),
    ("settings_changes", "scope_id IN (SELECT s.scope_id FROM settings_scopes s WHERE s.run_id IN ({ids}))"),
    ("settings_scopes", "run_id IN ({ids})"),
    ("effects", "run_id IN ({ids})"),
    ("node_attempts", "run_id IN ({ids})"),
    ("run_events", "run_id IN ({ids})"),
    ("runs", "run_id IN ({ids})"),
)

# Every column that names a blob: a blob is deleted only when none of them does.
BLOB_REFERENCES = (
    ("runs", "definition_hash"), ("runs", "input_hash"), ("runs", "output_hash"),
    ("node_attempts", "output_hash"), ("effects", "result_hash"), ("host_commands", "receipt_hash"),
    ("controller_resources", "spec_hash"), ("controller_resources", "status_hash"),
    ("controller_effects", "result_hash"), ("runs", "graph_hash"),
)
# The blobs of a run's own rows (those it may have been the last to use).
_RUN_BLOBS = (
    "SELECT DISTINCT definition_hash FROM runs WHERE run_id IN ({ids})",
    "SELECT DISTINCT graph_hash FROM runs WHERE run_id IN ({ids}) AND graph_hash IS NOT NULL",
    "SELECT input_hash FROM runs WHERE run_id IN ({ids}) AND input_hash IS NOT NULL",
    "SELECT output_hash FROM runs WHERE run_id IN ({ids}) AND output_hash IS NOT NULL",
    "SELECT output_hash FROM node_attempts WHERE run_id IN ({ids}) AND output_hash IS NOT NULL",
    "SELECT result_hash FROM effects WHERE run_id IN ({ids}) AND result_hash IS NOT NULL",
)
_UNUSED_BLOB = "DELETE FROM blobs WHERE hash = ? AND created_at < ? " + "".join(
    f"AND NOT EXISTS (SELECT 1 FROM {table} WHERE {column} = blobs.hash) " for table, column in BLOB_REFERENCES)


def prunable_runs(db: Database, *, ended_before: int, sample: int = 20) -> tuple[int, list[str]]:
    """How many runs a prune would delete now, and the ids of the ``sample`` oldest."""
    with db.read():
        count: int = db.scalar(f"SELECT COUNT(*) {_PRUNABLE}", (ended_before,))
        ids = [run_id for (run_id,) in db.execute(
            f"SELECT r.run_id {_PRUNABLE} ORDER BY r.finished_at, r.run_id LIMIT ?", (ended_before, sample))]
    return count, ids


def prune_runs(db: Database, *, ended_before: int, now: int, limit: int = PRUNE_BATCH) -> Pruned:
    """Delete up to ``limit`` of the oldest prunable runs (see the module) in one transaction,
    and the blobs they were the last to use. ``more``: prunable runs remain. A statement per
    table for the whole batch (the run ids as parameters).

    Several hosts pruning at once (PostgreSQL) take different runs: the batch's queue rows
    (each run's lock, locks.py) are locked as they are read, skipping those another
    transaction holds (another host's batch, a retry), so no host waits for another's batch
    and none deletes a run twice; a host that dies mid-batch leaves its runs to the next
    prune, its transaction rolled back."""
    with db.write():
        ids = [run_id for (run_id,) in db.execute(
            f"""SELECT r.run_id FROM runs r JOIN run_queue q ON q.run_id = r.run_id WHERE {_PRUNABLE_WHERE}
                ORDER BY r.finished_at, r.run_id LIMIT ?{db.lock_rows("q", skip_locked=True)}""",
            (ended_before, limit))]
        if not ids:
            return Pruned(runs=[], blobs=0, more=False)
        marks = ", ".join("?" * len(ids))
        # retried, or adopted by a controller, meanwhile: kept (the guard is in the delete)
        taken = {run_id for (run_id,) in db.execute(_TAKE.format(ids=marks), ids)}
        deleted = [run_id for run_id in ids if run_id in taken]
        if not deleted:
            return Pruned(runs=[], blobs=0, more=_more(db, ended_before))
        marks = ", ".join("?" * len(deleted))
        candidates = {digest for query in _RUN_BLOBS for (digest,) in db.execute(query.format(ids=marks), deleted)}
        candidates |= commands.forget_runs(db, marks, deleted)
        for table, condition in _OWN_ROWS:
            db.execute(f"DELETE FROM {table} WHERE {condition.format(ids=marks)}", deleted)
        more = _more(db, ended_before)
        blobs = 0
        for digest in sorted(candidates):
            db.execute(_UNUSED_BLOB, (digest, now - BLOB_GRACE_MS))
            blobs += db.changes()
    return Pruned(runs=deleted, blobs=blobs, more=more)


def _more(db: Database, ended_before: int) -> bool:
    """Whether prunable runs remain, this batch's gone (looked at after its deletes, so no
    run beyond the batch is locked for it)."""
    return db.one(f"SELECT 1 {_PRUNABLE} LIMIT 1", (ended_before,)) is not None


def sweep_blobs(db: Database, *, after: str, now: int, limit: int = BLOB_SWEEP) -> tuple[int, str | None]:
    """Delete the unused blobs past the grace period among the ``limit`` first hashes after
    ``after`` (in hash order), in one transaction: those no run's prune found, such as a
    workflow source a retry or resume replaced, or a pruned command's receipt. Returns how
    many were deleted and the hash to go on after (None: the end was reached)."""
    with db.write():
        hashes = [digest for (digest,) in db.execute(
            "SELECT hash FROM blobs WHERE hash > ? ORDER BY hash LIMIT ?", (after, limit))]
        deleted = 0
        for digest in hashes:
            db.execute(_UNUSED_BLOB, (digest, now - BLOB_GRACE_MS))
            deleted += db.changes()
    return deleted, hashes[-1] if len(hashes) == limit else None
