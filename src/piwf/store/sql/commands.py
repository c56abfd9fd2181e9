"""The idempotent command log (seed 001 ``executeCommand``).

A state-changing request is recorded in the same transaction as its effect, keyed by
``requestId`` and by ``(clientId, idempotencyKey)``, with a fingerprint of everything but
the request id.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from piwf.wire import HostResponse, Outcome
from piwf.store.api.rules import RETENTION_MS
from piwf.store.sql.database import Database, atomic

if TYPE_CHECKING:
    from piwf.store.api.types import CommandKey


def _stored_response(db: Database, request_id: str, row: tuple[Any, ...]) -> HostResponse:
    outcome, revision, receipt_json, receipt_hash, error = row
    return HostResponse(
        requestId=request_id,
        outcome=outcome,
        revision=revision,
        receipt=db.get_json(receipt_json, receipt_hash),
        error=error,
    )


def lookup(db: Database, request: CommandKey, fingerprint: bytes) -> HostResponse | None:
    """A stored response for this request (``adopted``), a ``conflict``, or None if new.

    Several writers (PostgreSQL): inside the unit of work that goes on to ``record``, the
    request id's and the key's locks are taken first (in that order, always), so a
    request carried out by two hosts at once waits for the first to commit and is then
    answered from its record (``adopted`` or ``conflict``), never carried out twice."""
    db.lock_key("request", request.requestId)
    db.lock_key("command", f"{request.clientId}\x00{request.idempotencyKey}")
    rows = db.execute(
        """SELECT request_id = ?, request_fingerprint, outcome, revision, receipt_json, receipt_hash, error
           FROM host_commands WHERE request_id = ? OR (client_id = ? AND idempotency_key = ?)""",
        (request.requestId, request.requestId, request.clientId, request.idempotencyKey),
    ).fetchall()
    if not rows:
        return None
    by_request = [row[1:] for row in rows if row[0]]
    if by_request:
        row = by_request[0]
        if bytes(row[0]) != fingerprint:
            return HostResponse(request.requestId, Outcome.CONFLICT,
                                error="requestId was reused with another request body")
        stored = _stored_response(db, request.requestId, row[1:])
        stored.outcome = Outcome.ADOPTED
        return stored
    row = rows[0][1:]
    if bytes(row[0]) != fingerprint:
        return HostResponse(
            request.requestId, Outcome.CONFLICT, error="idempotencyKey was reused with another request body"
        )
    stored = _stored_response(db, request.requestId, row[1:])
    stored.outcome = Outcome.ADOPTED
    return stored


@atomic
def record(db: Database, request: CommandKey, fingerprint: bytes, response: HostResponse, epoch: int,
           now: int) -> None:
    """Record a write request's answer; call inside the unit of work that made its change
    (after ``lookup`` found none). A request id or key recorded meanwhile: ConstraintViolation."""
    receipt_json, receipt_hash = (None, None)
    if response.receipt is not None:
        receipt_json, receipt_hash = db.put_json(response.receipt, now)
    db.execute(
        """INSERT INTO host_commands (request_id, client_id, idempotency_key, operation,
             request_fingerprint, run_id, outcome, revision, receipt_json, receipt_hash,
             error, host_epoch, created_at)
           VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)""",
        (request.requestId, request.clientId, request.idempotencyKey, request.operation,
         fingerprint, request.runId, response.outcome, response.revision, receipt_json,
         receipt_hash, response.error, epoch, now),
    )


def prune(db: Database, now: int, retention_ms: int = RETENTION_MS) -> int:
    with db.write():
        db.execute("DELETE FROM host_commands WHERE created_at < ?", (now - retention_ms,))
        return db.changes()
