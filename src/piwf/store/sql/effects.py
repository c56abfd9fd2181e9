"""A run's effects: external side effects recorded before they are applied.

The state machine is the effect ledger's (``store/sqlite/ledger.py``), keyed here by
``(run, key)``; its events go to the run's trace. An effect found ambiguous holds the run
(the caller does that, hold ``effect``) until an operator resolves it. Every write here is
made on behalf of a live claim, checked by the caller in the same transaction.
"""

from __future__ import annotations

from typing import Any

from piwf.errors import NotFound, Rejected
from piwf.status import EffectStatus as E, Hold
from piwf.protocol import EffectSummary
from piwf.wire import decode_json
from piwf.store.sql import ledger
from piwf.store.sql.database import Database
from piwf.store.sql.base import add_event
from piwf.store.sql.locks import lock_run

# A run's effects: keyed by (run, key), its events in the run's trace; an ambiguous effect
# is held by the caller (the run, hold 'effect'); a failed apply() is rejected.
LEDGER = ledger.Ledger(
    table="effects", key_columns=("run_id", "effect_key"), event=add_event,
    names={step: f"effect.{step}" for step in ("observing", "applying", "ambiguous", "applied", "rejected",
                                               "resolved")})


def reserve(db: Database, run_id: str, key: str, *, node: str, generation: int, observable: bool,
            now: int) -> dict[str, Any]:
    """What a node calling ``ctx.effect(key, ...)`` must do next (``ledger.reserve``);
    ``"ambiguous"``: the caller holds the run."""
    with db.write():
        return ledger.reserve(LEDGER, db, (run_id, key), generation=generation, observable=observable, now=now,
                              columns={"node_id": node})


def begin_apply(db: Database, run_id: str, key: str, *, generation: int, now: int) -> None:
    with db.write():
        ledger.begin_apply(LEDGER, db, (run_id, key), generation=generation, now=now)


def settle(db: Database, run_id: str, key: str, *, generation: int, result: Any = None,
           error: dict[str, Any] | None = None, now: int) -> None:
    """``applying → applied`` (with its JSON result) or ``→ rejected`` (with its error)."""
    with db.write():
        ledger.settle(LEDGER, db, (run_id, key), generation=generation, result=result, error=error, now=now)


def resolve(db: Database, run_id: str, key: str, *, applied: bool, result: Any, now: int) -> dict[str, Any]:
    """An operator says whether an ambiguous effect was applied; the run's effect hold is
    released once no ambiguous effect is left. The run's lock is taken first (``lock_run``):
    two operators resolving at once are answered in turn."""
    with db.write():
        lock_run(db, run_id)
        status = db.scalar("SELECT status FROM effects WHERE run_id = ? AND effect_key = ?", (run_id, key))
        if status is None:
            raise NotFound(f"run {run_id} has no effect {key!r}")
        if status != E.AMBIGUOUS:
            raise Rejected(f"effect {key!r} is {status}, not ambiguous; only an ambiguous effect is resolved")
        status = ledger.resolve(LEDGER, db, (run_id, key), applied=applied, result=result, now=now)
        remaining = ambiguous_keys(db, run_id)
        if not remaining:  # released; a run paused meanwhile stays held as paused
            paused = bool(db.scalar("SELECT paused FROM runs WHERE run_id = ?", (run_id,)))
            db.execute("UPDATE run_queue SET hold = ?, updated_at = ? WHERE run_id = ? AND hold = 'effect'",
                       (Hold.PAUSED if paused else None, now, run_id))
            db.execute("UPDATE runs SET status_detail = ?, updated_at = ? WHERE run_id = ?",
                       (Hold.PAUSED if paused else None, now, run_id))
        return {"runId": run_id, "key": key, "status": status, "ambiguous": remaining}


def interrupted_before(db: Database, run_id: str, generation: int, now: int) -> list[str]:
    """Mark ambiguous the effects an earlier generation left ``applying``.

    Called before a run settles: an effect whose node was not reached again must not be
    forgotten when the run ends. Returns every ambiguous key of the run.
    """
    with db.write():
        # CAST: a bare parameter here made SQLite prepare the read again at each execution
        # (matched against effects' partial indexes' conditions): 8.3 µs against 3.6.
        rows = db.execute("SELECT effect_key, status, generation FROM effects WHERE run_id = CAST(? AS TEXT) "
                          "AND status IN ('applying', 'ambiguous') ORDER BY created_at, effect_key",
                          (run_id,)).fetchall()
        for key, status, owner in rows:
            if status == E.APPLYING and owner < generation:
                ledger.mark_ambiguous(LEDGER, db, (run_id, key), now)
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
