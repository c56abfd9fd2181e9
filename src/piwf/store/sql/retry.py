"""Retry: a failed or timed-out run continues, as the same run, from the node that failed.

Nothing of what the run did is undone or done again: its accepted steps stay (the next
worker replays them and runs on from the node that failed), its applied effects keep their
recorded results, its closed requests stay closed (a decision that timed out is not
reopened: the node asks anew). What a retry changes: the run and its queue row are queued
again (engine ``queued``, queue ``queued``, a new generation, no error, no end), its
effects whose ``apply()`` raised (``rejected``) are pending again (a retry is the operator
saying the cause is fixed), a controller following it as a child sees it running again,
and its trace records who retried it. The run adopts the workflow as it is now when the caller
passes it (a retry usually follows a fix). Every condition is checked by the write itself.
"""

from __future__ import annotations

from typing import Any

from piwf.errors import ConstraintViolation, Rejected
from piwf.status import RunStatus
from piwf.store.sql import placement
from piwf.store.sql.base import add_event
from piwf.store.sql.controller_queue import set_workflow_run
from piwf.store.sql.controllers import add_resource_event, enqueue
from piwf.store.sql.database import Database
from piwf.store.sql.queue import AT_REVISION, refuse_revision
from piwf.store.sql.runs import adopt_definition
from piwf.store.api.types import Definition

# The guard and the queue row's change in one write: only a failed row whose run failed or
# timed out, at the revision the request expected, goes back to the queue.
_REQUEUE = f"""UPDATE run_queue SET status = 'queued', runner_id = NULL, claim_token = NULL,
    claim_expires_at = NULL, hold = NULL, error_code = NULL, error_message = NULL, finished_at = NULL,
    crash_count = 0, not_before = NULL, generation = generation + 1, updated_at = ?
  WHERE run_id = ? AND status = 'failed'
    AND (SELECT r.status FROM runs r WHERE r.run_id = run_queue.run_id) IN ('failed', 'timed_out') {AT_REVISION}
  RETURNING generation, (SELECT r.status FROM runs r WHERE r.run_id = run_queue.run_id)"""


def retry_run(db: Database, run_id: str, now: int, *, actor: str, expected_revision: int | None = None,
              definition: Definition | None = None) -> dict[str, Any]:
    """Queue a failed or timed-out run again (see the module); ``definition`` (digest, source,
    start node, graph): the workflow as it is now, which the run adopts (the fix is often in it).
    Raises NotFound, Conflict (another revision), Rejected (any other status; its session has
    another active run)."""
    with db.write():
        # Read first: after a failed statement PostgreSQL runs nothing more in the transaction.
        # The session's lock is the one run creation and claims take (several writers).
        session = db.scalar("SELECT origin_session_id FROM runs WHERE run_id = ?", (run_id,))
        if session is not None:
            db.lock_key("session", session)
        try:
            requeued = db.one(_REQUEUE, (now, run_id, expected_revision, expected_revision))
        except ConstraintViolation:  # the session's one active run (run_queue_session_reservation)
            raise Rejected(f"run {run_id} cannot be retried now: its session {session} has another active "
                           "run; retry it once that one ends") from None
        if requeued is None:
            refuse_revision(db, run_id, expected_revision)  # NotFound, Conflict
            status = db.scalar("SELECT status FROM runs WHERE run_id = ?", (run_id,))
            raise Rejected(f"run {run_id} is {status}: only a failed or timed-out run can be retried"
                           + _why_not(status))
        generation, previous = requeued
        node = db.scalar("""SELECT node_id FROM node_attempts WHERE run_id = ? AND status = 'failed'
                            ORDER BY seq DESC, started_at DESC LIMIT 1""", (run_id,))
        revision = db.scalar("""UPDATE runs SET status = 'queued', status_detail = NULL, output_json = NULL,
                                  output_hash = NULL, error_json = NULL, finished_at = NULL, updated_at = ?,
                                  revision = revision + 1 WHERE run_id = ? RETURNING revision""", (now, run_id))
        if definition is not None:
            adopt_definition(db, run_id, definition, now)
        placement.forget_run(db, run_id)  # every host may try it again
        reopened = [key for (key,) in db.execute(
            """UPDATE effects SET status = 'pending', error_json = NULL, settled_at = NULL, updated_at = ?
               WHERE run_id = ? AND status = 'rejected' RETURNING effect_key""", (now, run_id))]
        _follow_again(db, run_id, now)
        effects = sorted(reopened)
        add_event(db, run_id, "retried", {"by": actor, "retriedFrom": previous, "generation": generation,
                                          "reopenedEffects": effects, "node": node} if node is not None else
                  {"by": actor, "retriedFrom": previous, "generation": generation, "reopenedEffects": effects}, now)
        return {"runId": run_id, "status": RunStatus.QUEUED, "retriedFrom": previous, "node": node,
                "generation": generation, "revision": revision, "reopenedEffects": effects,
                "definitionDigest": db.scalar("SELECT definition_digest FROM runs WHERE run_id = ?", (run_id,))}


def _follow_again(db: Database, run_id: str, now: int) -> None:
    """A controller whose child run this is sees it running again (and reconciles)."""
    for uid, request_key, attempt in db.execute(
            """UPDATE controller_workflows SET state = 'running', updated_at = ?
               WHERE run_id = ? AND state = 'failed' RETURNING uid, request_key, attempt""", (now, run_id)).fetchall():
        set_workflow_run(db, uid, {"requestKey": request_key, "runId": run_id, "state": "running",
                                   "attempt": attempt}, now)
        add_resource_event(db, uid, "workflow_changed", {"requestKey": request_key, "state": "running",
                                                         "retried": True}, now)
        enqueue(db, uid, now)


def _why_not(status: str | None) -> str:
    if status == RunStatus.COMPLETED:
        return " (it completed)"
    if status == RunStatus.CANCELLED:
        return " (a cancelled run stays cancelled: start a new one)"
    if status in (RunStatus.QUEUED, RunStatus.RUNNING, RunStatus.WAITING):
        return " (it has not ended: cancel it first, or wait for it)"
    return ""
