"""Effects: external side effects recorded before they are applied.

    pending ──apply──▶ applying ──settle──▶ applied | rejected
                          │
                          └─ found by a later generation ─▶ observed by the worker, or
                             ambiguous (run held for an operator) ─resolve─▶ applied | pending

An effect is keyed by ``(run, key)``. ``applying`` means ``apply()`` may have run: only
``observe()`` or an operator can say whether it did, so it is never applied again on a
guess. Every write here is made on behalf of a live claim, checked by the caller in the
same transaction.
"""

from __future__ import annotations

from typing import Any

from piwf.errors import NotFound, Rejected
from piwf.status import EffectStatus as E, Hold
from piwf.protocol import EffectSummary
from piwf.wire import canonical_json, decode_json
from piwf.store.sqlite.db import Database
from piwf.store.sqlite.queue import add_event



def reserve(db: Database, run_id: str, key: str, *, node: str, generation: int, observable: bool,
            now: int) -> dict[str, Any]:
    """What a node calling ``ctx.effect(key, ...)`` must do next.

    ``{"state": "new"}`` (apply it), ``"applied"``/``"rejected"`` (settled: return or raise
    the stored outcome), ``"observe"`` (an earlier attempt may have applied it: ask
    ``observe()``), or ``"ambiguous"`` (nobody can tell: the caller holds the run).
    """
    with db.write():
        row = db.one("SELECT status, generation, result_json, result_hash, error_json FROM effects "
                     "WHERE run_id = ? AND effect_key = ?", (run_id, key))
        if row is None:
            db.execute(
                """INSERT INTO effects (run_id, effect_key, status, node_id, generation, created_at, updated_at)
                   VALUES (?, ?, 'pending', ?, ?, ?, ?)""",
                (run_id, key, node, generation, now, now),
            )
            return {"state": "new"}
        status, owner, result_json, result_hash, error_json = row
        if status == E.APPLIED:
            return {"state": E.APPLIED, "result": db.get_json(result_json, result_hash)}
        if status == E.REJECTED:
            return {"state": E.REJECTED, "error": decode_json(error_json.encode())}
        if status in (E.PENDING, E.APPLYING) and owner == generation:
            raise Rejected(f"effect {key!r} is already in progress in this attempt")
        if status == E.PENDING:
            _set(db, run_id, key, E.PENDING, generation, now)
            return {"state": "new"}
        if status == E.APPLYING and observable:
            _set(db, run_id, key, E.APPLYING, generation, now)
            add_event(db, run_id, "effect.observing", {"key": key}, now)
            return {"state": "observe"}
        _mark_ambiguous(db, run_id, key, now)
        return {"state": E.AMBIGUOUS}


def begin_apply(db: Database, run_id: str, key: str, *, generation: int, now: int) -> None:
    """``pending → applying``, recorded before ``apply()`` runs. After an observation that
    found nothing applied, the effect is already ``applying`` for this generation."""
    with db.write():
        status = _status(db, run_id, key, generation)
        if status not in (E.PENDING, E.APPLYING):
            raise Rejected(f"effect {key!r} is {status}; it cannot be applied")
        _set(db, run_id, key, E.APPLYING, generation, now)
        add_event(db, run_id, "effect.applying", {"key": key}, now)


def settle(db: Database, run_id: str, key: str, *, generation: int, result: Any = None,
           error: dict[str, Any] | None = None, now: int) -> None:
    """``applying → applied`` (with its JSON result) or ``→ rejected`` (with its error)."""
    with db.write():
        status = _status(db, run_id, key, generation)
        if status != E.APPLYING:
            raise Rejected(f"effect {key!r} is {status}, not applying; it cannot be settled")
        _finish(db, run_id, key, result=result, error=error, now=now)


def resolve(db: Database, run_id: str, key: str, *, applied: bool, result: Any, now: int) -> dict[str, Any]:
    """An operator says whether an ambiguous effect was applied; the run's effect hold is
    released once no ambiguous effect is left."""
    with db.write():
        status = db.scalar("SELECT status FROM effects WHERE run_id = ? AND effect_key = ?", (run_id, key))
        if status is None:
            raise NotFound(f"run {run_id} has no effect {key!r}")
        if status != E.AMBIGUOUS:
            raise Rejected(f"effect {key!r} is {status}, not ambiguous; only an ambiguous effect is resolved")
        if applied:
            _finish(db, run_id, key, result=result, error=None, now=now)
        else:
            _set(db, run_id, key, E.PENDING, None, now)
        add_event(db, run_id, "effect.resolved", {"key": key, "applied": applied}, now)
        remaining = ambiguous_keys(db, run_id)
        if not remaining:  # released; a run paused meanwhile stays held as paused
            paused = bool(db.scalar("SELECT paused FROM runs WHERE run_id = ?", (run_id,)))
            db.execute("UPDATE run_queue SET hold = ?, updated_at = ? WHERE run_id = ? AND hold = 'effect'",
                       (Hold.PAUSED if paused else None, now, run_id))
            db.execute("UPDATE runs SET status_detail = ?, updated_at = ? WHERE run_id = ?",
                       (Hold.PAUSED if paused else None, now, run_id))
        return {"runId": run_id, "key": key, "status": E.APPLIED if applied else E.PENDING,
                "ambiguous": remaining}


def interrupted_before(db: Database, run_id: str, generation: int, now: int) -> list[str]:
    """Mark ambiguous the effects an earlier generation left ``applying``.

    Called before a run settles: an effect whose node was not reached again must not be
    forgotten when the run ends. Returns every ambiguous key of the run.
    """
    with db.write():
        rows = db.execute("SELECT effect_key, status, generation FROM effects WHERE run_id = ? "
                          "AND status IN ('applying', 'ambiguous') ORDER BY created_at, effect_key",
                          (run_id,)).fetchall()
        for key, status, owner in rows:
            if status == E.APPLYING and owner < generation:
                _mark_ambiguous(db, run_id, key, now)
        return [key for key, status, owner in rows if status == E.AMBIGUOUS or owner < generation]


def ambiguous_keys(db: Database, run_id: str) -> list[str]:
    rows = db.execute("SELECT effect_key FROM effects WHERE run_id = ? AND status = 'ambiguous' "
                      "ORDER BY created_at, effect_key", (run_id,))
    return [key for (key,) in rows]


def list_effects(db: Database, run_id: str) -> list[EffectSummary]:
    # A run has few effects: sorting them here costs less than SQLite's sorter (see runs.py).
    rows = sorted(db.execute(
        """SELECT created_at, effect_key, status, node_id, generation, result_json, result_hash, error_json
           FROM effects WHERE run_id = ?""",
        (run_id,),
    ))
    return [
        EffectSummary(key, status, node, generation, db.get_json(result_json, result_hash),
                      None if error_json is None else decode_json(error_json.encode()))
        for _, key, status, node, generation, result_json, result_hash, error_json in rows
    ]


def _status(db: Database, run_id: str, key: str, generation: int) -> str:
    row = db.one("SELECT status, generation FROM effects WHERE run_id = ? AND effect_key = ?", (run_id, key))
    if row is None:
        raise Rejected(f"effect {key!r} was never reserved")
    if row[1] != generation:
        raise Rejected(f"effect {key!r} belongs to generation {row[1]}, not {generation}")
    return row[0]


def _set(db: Database, run_id: str, key: str, status: str, generation: int | None, now: int) -> None:
    db.execute(
        """UPDATE effects SET status = ?, generation = COALESCE(?, generation), updated_at = ?
           WHERE run_id = ? AND effect_key = ?""",
        (status, generation, now, run_id, key),
    )


def _mark_ambiguous(db: Database, run_id: str, key: str, now: int) -> None:
    _set(db, run_id, key, E.AMBIGUOUS, None, now)
    add_event(db, run_id, "effect.ambiguous", {"key": key}, now)


def _finish(db: Database, run_id: str, key: str, *, result: Any, error: dict[str, Any] | None, now: int) -> None:
    inline, digest = (None, None) if error is not None else db.put_json(result, now)
    db.execute(
        """UPDATE effects SET status = ?, result_json = ?, result_hash = ?, error_json = ?,
             updated_at = ?, settled_at = ? WHERE run_id = ? AND effect_key = ?""",
        (E.REJECTED if error is not None else E.APPLIED, inline, digest,
         None if error is None else canonical_json(error).decode(), now, now, run_id, key),
    )
    add_event(db, run_id, "effect.rejected" if error is not None else "effect.applied", {"key": key}, now)
