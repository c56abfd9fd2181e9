"""The locks that make a read-then-write of the people and controller aggregates safe
under several writers (PostgreSQL, READ COMMITTED), where SQLite's one writer at a time
(BEGIN IMMEDIATE) made it so by itself.

Each aggregate has one row that every write transaction on it locks first; a transaction
holding it reads what it then writes as of now, as under SQLite:

- a run: its ``run_queue`` row. Writes fenced by a claim lock it by the fence (``base.FENCE``,
  an UPDATE of that row); a client's write (an answer, a submission, a settings change)
  locks it with ``lock_run`` before it reads.
- a controller resource: its ``controller_queue`` row (``lock_resource``; a reconcile's
  fence and claims are UPDATEs of it); a resource that does not exist yet: the key lock
  on (project, controller, key) (``lock_resource_key``).
- a session's delivery stream (notifications and turns, in order): the key lock
  ``("delivery", session)`` (``lock_delivery``), taken after the run's lock and before any
  notification or turn row.

Always in that order — run, then resource, then a session's stream, then the rows
themselves — so two transactions never wait for each other in a cycle. On SQLite each
function does nothing (``Database.lock_rows()`` is empty): no statement, no cost.
"""

from __future__ import annotations

from piwf.store.sql.database import Database
from piwf.wire import canonical_json


def lock_run(db: Database, run_id: str) -> None:
    """Lock the run (its queue row) for the rest of the transaction; nothing if it does not exist."""
    clause = db.lock_rows()
    if clause:
        db.execute(f"SELECT 1 FROM run_queue WHERE run_id = ?{clause}", (run_id,))


def lock_run_of_request(db: Database, request_id: str) -> None:
    """Lock the run a request belongs to (a request's run never changes, so a plain read finds it)."""
    if db.lock_rows():
        run_id = db.scalar("SELECT run_id FROM interaction_requests WHERE request_id = ?", (request_id,))
        if run_id is not None:
            lock_run(db, run_id)


def lock_resource(db: Database, uid: str) -> None:
    """Lock the controller resource (its queue row) for the rest of the transaction."""
    clause = db.lock_rows()
    if clause:
        db.execute(f"SELECT 1 FROM controller_queue WHERE uid = ?{clause}", (uid,))


def lock_resource_key(db: Database, project: str, controller: str, key: str) -> None:
    """Lock a resource's key, whether or not a resource has it yet (two applies creating
    the same one), then the resource itself if it exists."""
    if not db.lock_rows():
        return
    db.lock_key("resource", canonical_json([project, controller, key]).decode())
    uid = db.scalar("SELECT uid FROM controller_resources WHERE project_path = ? AND controller = ? "
                    "AND resource_key = ?", (project, controller, key))
    if uid is not None:
        lock_resource(db, uid)


def lock_delivery(db: Database, session_id: str) -> None:
    """Lock a session's delivery stream: its notifications and turns are written, made
    eligible and claimed one transaction at a time, so their order (``rowid``) is the
    order they committed in and a claim sees every one stored before it."""
    db.lock_key("delivery", session_id)
