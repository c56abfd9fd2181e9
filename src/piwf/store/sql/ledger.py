"""The effect ledger: one state machine for a run's effects and a reconcile's.

    pending ──begin_apply──▶ applying ──settle──▶ applied | rejected
                                │
                                └─ found by a later claim ─▶ observe (the caller can ask
                                   ``observe()``), or ambiguous (held for an operator)
                                   ─resolve─▶ applied | pending

An effect is recorded before it is applied, so an ``applying`` one is never applied again
on a guess. What differs between the two users is described by a ``Ledger``: its table and
key columns (a run's effects are keyed by (run, key), a reconcile's by (resource, spec
generation, key)), the event writer and event names, what an ambiguous effect holds, and
whether a failed ``apply()`` is retried (a reconcile's is, but after ``PermanentError``).
``store/sqlite/effects.py`` and ``store/sqlite/controller_effects.py`` each define one and
keep their aggregate's own operations (the interface keeps its two aggregates: their keys,
refusals and receipts differ, and each is what its caller names). Every write here is made
on behalf of a live claim, fenced by the caller in the same transaction.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from piwf.errors import Rejected
from piwf.status import EffectStatus as E
from piwf.store.sql.database import Database
from piwf.wire import canonical_json, decode_json

Ident = tuple[Any, ...]  # the key columns' values, owner first, effect key last


@dataclass(frozen=True)
class Ledger:
    table: str
    key_columns: tuple[str, ...]
    # (db, owner, event type, payload, now): the owner's trace
    event: Callable[[Database, str, str, dict[str, Any], int], object]
    # a step (observing, applying, ambiguous, applied, rejected, failed, resolved) -> its
    # event type; a step not named is not recorded
    names: Mapping[str, str]
    # what else an effect found ambiguous does (owner, key), besides its event
    hold: Callable[[Database, str, str, int], object] | None = None
    retry_failures: bool = False  # apply() raised (not PermanentError): pending again
    attempt: str = "attempt"  # what a claim's pass is called in refusals
    claim: str = "generation"  # what a claim's number is called in refusals

    @property
    def where(self) -> str:
        return " AND ".join(f"{column} = ?" for column in self.key_columns)

    def record(self, db: Database, ident: Ident, step: str, now: int, **payload: Any) -> None:
        if step in self.names:
            self.event(db, ident[0], self.names[step], {"key": ident[-1], **payload}, now)


def reserve(ledger: Ledger, db: Database, ident: Ident, *, generation: int, observable: bool, now: int,
            columns: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """What a caller of ``effect(key, ...)`` must do next: ``{"state": "new"}`` (apply
    it), ``applied`` / ``rejected`` (return or raise what is stored), ``observe`` (an
    earlier claim may have applied it), or ``ambiguous`` (nobody can tell: held).
    ``columns``: more columns of a new row (a run's effect names its node)."""
    row = db.one(f"SELECT status, generation, result_json, result_hash, error_json FROM {ledger.table} "
                 f"WHERE {ledger.where}", ident)
    if row is None:
        extra = dict(columns or {})
        names = ", ".join((*ledger.key_columns, *extra))
        marks = ", ".join("?" * (len(ident) + len(extra)))
        db.execute(f"""INSERT INTO {ledger.table} ({names}, status, generation, created_at, updated_at)
                       VALUES ({marks}, 'pending', ?, ?, ?)""", (*ident, *extra.values(), generation, now, now))
        return {"state": "new"}
    status, owner, result_json, result_hash, error_json = row
    if status == E.APPLIED:
        return {"state": E.APPLIED, "result": db.get_json(result_json, result_hash)}
    if status == E.REJECTED:
        return {"state": E.REJECTED, "error": decode_json(error_json.encode())}
    if status in (E.PENDING, E.APPLYING) and owner == generation:
        raise Rejected(f"effect {ident[-1]!r} is already in progress in this {ledger.attempt}")
    if status == E.PENDING:
        set_status(ledger, db, ident, E.PENDING, generation, now)
        return {"state": "new"}
    if status == E.APPLYING and observable:
        set_status(ledger, db, ident, E.APPLYING, generation, now)
        ledger.record(db, ident, "observing", now)
        return {"state": "observe"}
    mark_ambiguous(ledger, db, ident, now)
    if ledger.hold is not None:
        ledger.hold(db, ident[0], ident[-1], now)
    return {"state": E.AMBIGUOUS}


def begin_apply(ledger: Ledger, db: Database, ident: Ident, *, generation: int, now: int) -> None:
    """``pending → applying``, recorded before ``apply()`` runs. After an observation that
    found nothing applied, the effect is already ``applying`` for this claim."""
    status = _status(ledger, db, ident, generation)
    if status not in (E.PENDING, E.APPLYING):
        raise Rejected(f"effect {ident[-1]!r} is {status}; it cannot be applied")
    set_status(ledger, db, ident, E.APPLYING, generation, now)
    ledger.record(db, ident, "applying", now)


def settle(ledger: Ledger, db: Database, ident: Ident, *, generation: int, result: Any,
           error: dict[str, Any] | None, now: int) -> None:
    """``applying → applied`` (with its JSON result) or ``→ rejected`` (with its error); a
    ledger that retries failures puts an effect whose ``apply()`` raised back to pending
    (but after ``PermanentError``)."""
    status = _status(ledger, db, ident, generation)
    if status != E.APPLYING:
        raise Rejected(f"effect {ident[-1]!r} is {status}, not applying; it cannot be settled")
    if ledger.retry_failures and error is not None and error.get("type") != "PermanentError":
        # apply() raised: it did not take effect as far as anyone can tell; the next pass
        # (or this one, if it calls ensure again) applies it afresh.
        db.execute(f"UPDATE {ledger.table} SET status = 'pending', generation = 0, updated_at = ? "
                   f"WHERE {ledger.where}", (now, *ident))
        ledger.record(db, ident, "failed", now, error=_error_line(error))
        return
    finish(ledger, db, ident, result=result, error=error, now=now)


def resolve(ledger: Ledger, db: Database, ident: Ident, *, applied: bool, result: Any, now: int) -> str:
    """An operator says whether an ambiguous effect was applied: applied (with ``result``)
    or pending again. Returns the new status; the caller lifts its hold."""
    if applied:
        finish(ledger, db, ident, result=result, error=None, now=now)
    else:
        set_status(ledger, db, ident, E.PENDING, None, now)
    ledger.record(db, ident, "resolved", now, applied=applied)
    return E.APPLIED if applied else E.PENDING


def mark_ambiguous(ledger: Ledger, db: Database, ident: Ident, now: int) -> None:
    set_status(ledger, db, ident, E.AMBIGUOUS, None, now)
    ledger.record(db, ident, "ambiguous", now)


def set_status(ledger: Ledger, db: Database, ident: Ident, status: str, generation: int | None, now: int) -> None:
    db.execute(f"""UPDATE {ledger.table} SET status = ?, generation = COALESCE(?, generation), updated_at = ?
                   WHERE {ledger.where}""", (status, generation, now, *ident))


def finish(ledger: Ledger, db: Database, ident: Ident, *, result: Any, error: dict[str, Any] | None,
           now: int) -> None:
    inline, digest = (None, None) if error is not None else db.put_json(result, now)
    db.execute(f"""UPDATE {ledger.table} SET status = ?, result_json = ?, result_hash = ?, error_json = ?,
                     updated_at = ?, settled_at = ? WHERE {ledger.where}""",
               (E.REJECTED if error is not None else E.APPLIED, inline, digest,
                None if error is None else canonical_json(error).decode(), now, now, *ident))
    ledger.record(db, ident, "rejected" if error is not None else "applied", now)


def _status(ledger: Ledger, db: Database, ident: Ident, generation: int) -> str:
    row = db.one(f"SELECT status, generation FROM {ledger.table} WHERE {ledger.where}", ident)
    if row is None:
        raise Rejected(f"effect {ident[-1]!r} was never reserved")
    if row[1] != generation:
        raise Rejected(f"effect {ident[-1]!r} belongs to {ledger.claim} {row[1]}, not {generation}")
    status: str = row[0]
    return status


def _error_line(error: dict[str, Any]) -> str:
    message = str(error.get("message") or "").splitlines()
    return f"{error.get('type')}: {message[0] if message else ''}"[:500]
