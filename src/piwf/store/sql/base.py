"""What every store module builds on (the bottom of the SQLite backend, above ``db``): a
run's trace (``add_event``), its revision, the claim fence, the run summary's columns.
It imports no other store module, so the aggregates' modules can all use it without
importing each other."""

from __future__ import annotations

from typing import Any

from piwf.errors import ClaimLost
from piwf.status import ACTIVE_QUEUE
from piwf.store.sql.database import Database
from piwf.store.sql.database import one_of
from piwf.store.sql.timefmt import iso
from piwf.wire import canonical_json

LIVE = f"status IN ({one_of(ACTIVE_QUEUE)})"

# The fence: a write of the claim's row that changes nothing, taken only while the claim is
# live. Being a write, it holds the row for the rest of the transaction however many
# writers there are (a read would not: the claim could move on between it and the writes).
# On PostgreSQL the UPDATE takes the row's lock until commit: every run-scoped write of a
# claim starts with it, so all writes of one run serialise on its run_queue row (the lock
# order of store/sql/locks.py: the run first).
FENCE = f"""UPDATE run_queue SET claim_token = claim_token
  WHERE run_id = ? AND claim_token = ? AND {LIVE} AND claim_expires_at > ?"""


def earlier_epoch(db: Database, column: str) -> str:
    """SQL true when the host epoch in ``column`` (a claim's or a worker's owner) is dead to
    a host taking over at epoch ``?`` (its one parameter). SQLite: every earlier epoch (one
    host per state directory, and the flock proved the last one gone). PostgreSQL: an
    earlier epoch that no host holds a lease at any more (``hosts``): the epoch this state
    directory's host held before, or one released — never another live host's."""
    if db.dialect == "sqlite":
        return f"({column} IS NULL OR {column} < ?)"
    return (f"({column} IS NULL OR ({column} < ? AND {column} NOT IN "
            "(SELECT h.epoch FROM hosts h WHERE h.token_hash IS NOT NULL AND h.epoch IS NOT NULL)))")


def add_event(db: Database, run_id: str, kind: str, payload: dict[str, Any], now: int) -> int:
    """Append to the run's trace; returns the event's id (the cursor ``run.watch`` follows)."""
    event_id: int = db.scalar(
        "INSERT INTO run_events (run_id, at, type, payload_json) VALUES (?, ?, ?, ?) RETURNING event_id",
        (run_id, now, kind, canonical_json(payload).decode()),
    )
    return event_id


def store_update(db: Database, run_id: str, type: str, key: str, data: Any, now: int) -> int:
    """Replace the run's live update (type, key) with ``data`` (checked by the caller) and
    add its ``update`` event, whose id is returned as the update's seq."""
    seq = add_event(db, run_id, "update", {"updateType": type, "key": key}, now)
    db.execute("""INSERT INTO run_updates (run_id, type, key, data_json, seq, updated_at) VALUES (?, ?, ?, ?, ?, ?)
                  ON CONFLICT (run_id, type, key) DO UPDATE SET data_json = excluded.data_json, seq = excluded.seq,
                    updated_at = excluded.updated_at""", (run_id, type, key, canonical_json(data).decode(), seq, now))
    return seq


def revision_of(db: Database, run_id: str) -> int | None:
    """The run's revision, None for an unknown run; not read again when a statement of
    this write transaction returned it and none naming a revision ran since (``revised``)."""
    known = db.revised
    if known is not None and known[0] == run_id:
        return known[1]
    revision: int | None = db.scalar("SELECT revision FROM runs WHERE run_id = ?", (run_id,))
    return revision


def revised(db: Database, run_id: str, revision: int) -> int:
    """Note ``revision``, just returned by the statement that wrote it (``Database.revised``);
    returns it."""
    if db.in_write():
        db.revised = (run_id, revision)
    return revision


def holds_claim(db: Database, run_id: str, token: str, now: int) -> bool:
    """Whether the claim is live, checked by the fence (``FENCE``): call inside the write
    transaction it guards. A fence of the same claim earlier in that transaction, with no
    statement naming run_queue since (``db.fenced``), already holds its row for the rest of
    the transaction: it is not run again."""
    claim = (run_id, token, now)
    if db.fenced == claim:
        return True
    db.execute(FENCE, claim)
    held = db.changes() == 1
    if held:
        fenced(db, claim)
    return held


def fenced(db: Database, claim: tuple[str, str, int]) -> None:
    """Note that a statement just run in the open write transaction held ``claim``'s row
    as the fence does (``Database.fenced``)."""
    if db.in_write():
        db.fenced = claim


def require_claim(db: Database, run_id: str, token: str, now: int) -> None:
    """The fence (``FENCE``), or ClaimLost."""
    if not holds_claim(db, run_id, token, now):
        raise ClaimLost(f"the claim on run {run_id} is no longer live")


def interrupt_attempts(db: Database, run_id: str, now: int) -> None:
    """A node attempt still running when its run is parked, cancelled or claimed again was
    interrupted: it will run again on the next claim."""
    db.execute("""UPDATE node_attempts SET status = 'interrupted', finished_at = ?
                  WHERE run_id = ? AND status = 'running'""", (now, run_id))


RUN_COLUMNS = """r.run_id, r.workflow, r.status, q.status, r.paused, r.status_detail, r.revision,
  r.origin_session_id, r.created_at, r.updated_at, r.finished_at, q.generation, q.hold, q.queue"""
SUMMARY_COLUMNS = 14  # how many RUN_COLUMNS names


Summary = tuple[Any, Any, Any, Any, bool, Any, Any, Any, Any, Any, Any, Any, Any, Any]


def summary_fields(row: tuple[Any, ...]) -> Summary:
    """RunSummary's fields, in its order, from a row in RUN_COLUMNS order."""
    (run_id, workflow, status, queue_status, paused, detail, rev, session, created, updated,
     finished, generation, hold, queue) = row
    return (run_id, workflow, status, queue_status, bool(paused), hold, detail, rev, session, generation,
            iso(created), iso(updated), iso(finished), queue)
