"""Deadlines of requests (DESIGN.md §7): a request past its deadline, whose run waits idle,
is closed once; a decision with a default takes it, an ask or a decision without one
expires, and its node leaves through ``timeout`` or its run ends ``timed_out`` (through
the run-end cascade, ``ending.cascade``, in the same transaction)."""

from __future__ import annotations

import msgspec

from piwf.errors import PiwfError
from piwf.protocol import Resolution
from piwf.status import Provenance, QueueStatus, RequestStatus
from piwf.wire import canonical_json
from piwf.store.sql import ending
from piwf.store.sql.base import add_event
from piwf.store.sql.database import Database
from piwf.store.sql.locks import lock_run_of_request
from piwf.store.sql.interactions import (
    IDLE, TIMEOUT_EXIT, Spec, close_request, continue_attempt, reject_validating, resolve_decision,
)
from piwf.store.sql.timefmt import iso


def next_deadline(db: Database) -> int | None:
    """The nearest deadline of an open request whose run is not claimed (a request being
    validated waits for its outcome: that outcome wakes the timer again)."""
    result: int | None = db.scalar(
        f"""SELECT MIN(r.deadline_at) FROM interaction_requests r INDEXED BY interaction_requests_open
            JOIN run_queue q ON q.run_id = r.run_id WHERE {IDLE} AND r.deadline_at IS NOT NULL""")
    return result


def expire_due(db: Database, now: int) -> tuple[list[str], list[tuple[str, Exception]]]:
    """Close every open request past its deadline whose run is idle, each in its own
    transaction: a decision with a default is answered with it (provenance ``timeout``);
    otherwise the request expires and its node leaves through ``timeout`` when the graph
    has that exit, else the run ends ``timed_out``. Exactly once: each transaction closes
    only a request still open. Returns the request ids closed, and those that could not be
    (with the error; the others are closed all the same)."""
    due = db.execute(
        f"""SELECT r.request_id FROM interaction_requests r INDEXED BY interaction_requests_open
            JOIN run_queue q ON q.run_id = r.run_id WHERE {IDLE} AND r.deadline_at <= ?
            ORDER BY r.deadline_at""", (now,)).fetchall()
    closed: list[str] = []
    failed: list[tuple[str, Exception]] = []
    for (request_id,) in due:
        try:
            if _expire(db, request_id, now):
                closed.append(request_id)
        except (PiwfError, msgspec.DecodeError) as exc:  # a damaged record: the others go on
            failed.append((request_id, exc))
    return closed, failed


def _expire(db: Database, request_id: str, now: int) -> bool:
    with db.write():
        # the run's lock first (locks.py), then the read: an answer, a cancel, a claim or
        # another host's timer that got there first is seen here, not met as a Conflict
        lock_run_of_request(db, request_id)
        row = db.one(
            f"""SELECT r.run_id, r.attempt_id, r.kind, r.spec_json FROM interaction_requests r
                JOIN run_queue q ON q.run_id = r.run_id
                WHERE r.request_id = ? AND {IDLE} AND r.deadline_at <= ?""", (request_id, now))
        if row is None:  # answered, cancelled or claimed meanwhile
            return False
        run_id, attempt_id, kind, spec_json = row
        spec = msgspec.json.decode(spec_json, type=Spec)
        at = iso(now) or ""
        if kind == "decision" and spec.default is not None:
            resolve_decision(db, run_id, attempt_id, request_id, Resolution(
                provenance=Provenance.TIMEOUT, answeredBy=None, answeredAt=at, choice=spec.default.choice,
                input=spec.default.input), now)
            return True
        close_request(db, request_id, RequestStatus.EXPIRED, Resolution(provenance=Provenance.TIMEOUT, answeredBy=None,
                                                                 answeredAt=at), now)
        reject_validating(db, request_id, "the request expired", now)
        add_event(db, run_id, "request.expired", {"requestId": request_id}, now)
        if spec.timeoutExit:
            output = ({"choice": None, "input": None, "provenance": Provenance.TIMEOUT, "answeredBy": None,
                       "answeredAt": at} if kind == "decision" else None)
            continue_attempt(db, run_id, attempt_id, output, TIMEOUT_EXIT, now)
        else:
            _time_out(db, run_id, attempt_id, request_id, now)
        return True


def _time_out(db: Database, run_id: str, attempt_id: str, request_id: str, now: int) -> None:
    error = {"type": "Timeout", "message": f"request {request_id} expired with no answer"}
    db.execute("""UPDATE node_attempts SET status = 'failed', error_json = ?, finished_at = ?
                  WHERE attempt_id = ?""", (canonical_json(error).decode(), now, attempt_id))
    db.execute("""UPDATE run_queue SET status = 'failed', hold = NULL, error_code = 'Timeout', error_message = ?,
                    finished_at = ?, updated_at = ? WHERE run_id = ?""", (error["message"], now, now, run_id))
    db.execute("""UPDATE runs SET status = 'timed_out', error_json = ?, status_detail = NULL, finished_at = ?,
                    updated_at = ?, revision = revision + 1 WHERE run_id = ?""",
               (canonical_json(error).decode(), now, now, run_id))
    add_event(db, run_id, "timed_out", {"requestId": request_id}, now)
    ending.cascade(db, run_id, now, ended=QueueStatus.FAILED)
