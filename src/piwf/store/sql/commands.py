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
    """The stored answer, as ``adopted``; ``notFound`` (with why) for one whose run retention
    has deleted since (``forget_runs``)."""
    outcome, revision, receipt_json, receipt_hash, error, run_id = row
    if outcome == Outcome.NOT_FOUND:
        return HostResponse(request_id, Outcome.NOT_FOUND, error=(
            f"this request was carried out before (run {run_id}), and run {run_id} has since ended and been "
            "deleted by retention; it is not carried out again"))
    return HostResponse(
        requestId=request_id,
        outcome=Outcome.ADOPTED,
        revision=revision,
        receipt=db.get_json(receipt_json, receipt_hash),
        error=error,
    )


def forget_runs(db: Database, marks: str, run_ids: list[str]) -> set[str]:
    """Retention deletes these runs (``marks``: a ``?`` each): the answers naming them become
    ``notFound`` saying so (a retry is never carried out again); returns the blobs their
    receipts named. Call inside the transaction that deletes the runs."""
    where = f"run_id IN ({marks}) AND outcome != 'notFound'"
    receipts = {digest for (digest,) in db.execute(
        f"SELECT receipt_hash FROM host_commands WHERE {where} AND receipt_hash IS NOT NULL", run_ids)}
    # the row only shrinks (the answer's text is made when it is read): a prune grows no page
    db.execute(f"""UPDATE host_commands SET outcome = 'notFound', revision = NULL, receipt_json = NULL,
                     receipt_hash = NULL, error = NULL WHERE {where}""", run_ids)
    return receipts


def lookup(db: Database, request: CommandKey, fingerprint: bytes) -> HostResponse | None:
    """A stored response for this request (``adopted``), a ``conflict``, or None if new.

    Several writers (PostgreSQL): inside the unit of work that goes on to ``record``, the
    request id's and the key's locks are taken first (in that order, always), so a
    request carried out by two hosts at once waits for the first to commit and is then
    answered from its record (``adopted`` or ``conflict``), never carried out twice."""
    db.lock_key("request", request.requestId)
    db.lock_key("command", f"{request.clientId}\x00{request.idempotencyKey}")
    rows = db.execute(
        """SELECT request_id = ?, request_fingerprint, outcome, revision, receipt_json, receipt_hash, error, run_id
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
        return _stored_response(db, request.requestId, row[1:])
    row = rows[0][1:]
    if bytes(row[0]) != fingerprint:
        return HostResponse(
            request.requestId, Outcome.CONFLICT, error="idempotencyKey was reused with another request body"
        )
    return _stored_response(db, request.requestId, row[1:])


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
         fingerprint, request.runId or _receipt_run(response.receipt), response.outcome, response.revision,
         receipt_json, receipt_hash, response.error, epoch, now),
    )


def _receipt_run(receipt: Any) -> str | None:
    """The run a receipt names (``run.start`` makes its id when the request has none)."""
    run_id = receipt.get("runId") if isinstance(receipt, dict) else getattr(receipt, "runId", None)
    return run_id if isinstance(run_id, str) else None


def prune(db: Database, now: int, retention_ms: int = RETENTION_MS) -> int:
    """Forget the commands logged before the retention window. Several hosts (PostgreSQL):
    one at a time does it, the others skip it (a transaction-scoped lock: the next prune
    does what a host that died meanwhile rolled back)."""
    with db.write():
        if not db.try_lock_key("duty", "commands.prune"):
            return 0
        db.execute("DELETE FROM host_commands WHERE created_at < ?", (now - retention_ms,))
        return db.changes()
