"""A resource's child runs (``controller_workflows``: the runs its reconciles started with
``ctx.workflows.ensure``), each with the state a controller sees of it, read for
``controller.get``."""

from __future__ import annotations

from piwf.protocol.resources import ResourceChild
from piwf.store.sql.database import Database

# A child run's state as its controller sees it, from its run (r) and queue row (q).
CHILD_STATE = """CASE q.status WHEN 'done' THEN 'succeeded' WHEN 'failed' THEN 'failed'
  WHEN 'cancelled' THEN 'failed' ELSE CASE r.status WHEN 'waiting' THEN 'waiting' ELSE 'running' END END"""
CHILDREN_SHOWN = 100  # the newest, in controller.get


def children(db: Database, uid: str) -> list[ResourceChild]:
    """The resource's newest CHILDREN_SHOWN child runs, oldest first (read by its primary key)."""
    rows = db.execute(f"""SELECT c.request_key, c.workflow, c.run_id, {CHILD_STATE}, c.attempt, c.created_at
                          FROM controller_workflows c JOIN runs r ON r.run_id = c.run_id
                          JOIN run_queue q ON q.run_id = c.run_id WHERE c.uid = ?
                          ORDER BY c.created_at DESC, c.request_key DESC LIMIT ?""", (uid, CHILDREN_SHOWN)).fetchall()
    return [ResourceChild(requestKey=key, workflow=workflow, runId=run_id, state=state, attempt=attempt)
            for key, workflow, run_id, state, attempt, _ in reversed(rows)]
