"""A reconcile's effects and child workflow runs.

Effects follow the effect ledger (``store/sqlite/ledger.py``), as a run's do: reserve →
apply → settle; ``applying`` found by a later claim is observed (when the caller can
observe) or becomes ambiguous and holds the resource for an operator; an applied effect is
final. Unlike a run's, an effect whose ``apply()`` raised goes back to pending (a reconcile
is retried by design, so the next pass applies it again), except after ``PermanentError``:
that is stored as rejected, and raised again by later passes of the same spec generation.
They are keyed by (resource, spec generation, key): an effect is applied at most once per
generation of the spec, so a changed spec applies its effects again and a retried
reconcile of the same spec never does. Every write here is made fenced by the caller
(the fence, an UPDATE of the resource's queue row, is its lock under several writers:
``locks.py``); an operator's ``resolve`` and ``sync_children`` take that lock themselves.
"""

from __future__ import annotations

from typing import Any

from piwf.errors import Conflict, NotFound, Rejected
from piwf.wire import canonical_json, sha256_hex
from piwf.store.sql import ledger
from piwf.store.sql.controller_children import CHILD_STATE
from piwf.store.sql.controller_queue import hold_for_effect, release_effect_hold, set_workflow_run
from piwf.store.sql.controllers import add_resource_event, enqueue
from piwf.store.sql.database import Database, atomic
from piwf.store.sql.locks import lock_resource

# A reconcile's effects: their events in the resource's; an ambiguous one holds the
# resource; a failed apply() is retried (but after PermanentError).
LEDGER = ledger.Ledger(
    table="controller_effects", key_columns=("uid", "spec_generation", "effect_key"), event=add_resource_event,
    names={step: f"effect_{step}" for step in ("applying", "ambiguous", "applied", "rejected", "failed",
                                               "resolved")},
    hold=hold_for_effect, retry_failures=True, attempt="reconcile", claim="claim")


@atomic
def reserve(db: Database, uid: str, spec_generation: int, key: str, *, generation: int, observable: bool,
            now: int, kind: str | None = None, fingerprint: str | None = None) -> dict[str, Any]:
    """What ``ctx.effects.ensure(key, ...)`` must do next: ``new`` (apply it), ``applied`` /
    ``rejected`` (return or raise what is stored), ``observe``, or ``ambiguous`` (the
    resource is now held). An effect is its key, kind and request fingerprint (seed): the
    key reserved for another kind or request is a Conflict, never the other's result."""
    ident = (uid, spec_generation, key)
    _same_action(db, ident, kind, fingerprint)
    return ledger.reserve(LEDGER, db, ident, generation=generation, observable=observable, now=now,
                          columns={"kind": kind, "request_fingerprint": fingerprint})


def _same_action(db: Database, ident: ledger.Ident, kind: str | None, fingerprint: str | None) -> None:
    """Conflict unless the effect ``ident`` (if reserved) was reserved for this kind and
    request. A row made before layout 11 (no kind, no fingerprint) takes this caller's.
    Read, then written, under the reconcile's claim (its fence holds the resource's queue
    row): no other writer reserves the resource's effects meanwhile."""
    row = db.one(f"SELECT kind, request_fingerprint FROM controller_effects WHERE {LEDGER.where}", ident)
    if row is None:
        return
    stored_kind, stored_fingerprint = row
    if stored_kind is None and stored_fingerprint is None:
        db.execute(f"UPDATE controller_effects SET kind = ?, request_fingerprint = ? WHERE {LEDGER.where}",
                   (kind, fingerprint, *ident))
        return
    if stored_kind != kind:
        raise Conflict(f"effect {ident[-1]!r} conflicts: it was reserved for kind {stored_kind!r}, not {kind!r}: "
                       "a key names one action (use another key for another action)")
    if stored_fingerprint != fingerprint:
        raise Conflict(f"effect {ident[-1]!r} ({kind}) conflicts: it was reserved for another request (fingerprint "
                       f"{(stored_fingerprint or '')[:12]}, not {(fingerprint or '')[:12]}): a key names one action "
                       "(use another key for another request)")


@atomic
def begin_apply(db: Database, uid: str, spec_generation: int, key: str, *, generation: int, now: int) -> None:
    ledger.begin_apply(LEDGER, db, (uid, spec_generation, key), generation=generation, now=now)


@atomic
def settle(db: Database, uid: str, spec_generation: int, key: str, *, generation: int, result: Any = None,
           error: dict[str, Any] | None = None, now: int) -> None:
    ledger.settle(LEDGER, db, (uid, spec_generation, key), generation=generation, result=result, error=error,
                  now=now)


def resolve(db: Database, uid: str, key: str, *, applied: bool, result: Any, now: int) -> dict[str, Any]:
    """An operator says whether an ambiguous effect was applied; the resource's hold is
    lifted (and a reconcile queued) once none is left."""
    with db.write():
        lock_resource(db, uid)  # an operator's write: the resource's lock first, as a reconcile's fence
        spec_generation = db.scalar("""SELECT spec_generation FROM controller_effects WHERE uid = ? AND effect_key = ?
                                       AND status = 'ambiguous'""", (uid, key))
        if spec_generation is None:
            raise NotFound(f"resource {uid} has no ambiguous effect {key!r}")
        status = ledger.resolve(LEDGER, db, (uid, spec_generation, key), applied=applied, result=result, now=now)
        remaining = [k for (k,) in db.execute("SELECT effect_key FROM controller_effects WHERE uid = ? "
                                              "AND status = 'ambiguous' ORDER BY effect_key", (uid,))]
        if not remaining:
            release_effect_hold(db, uid, now)
        return {"uid": uid, "effectKey": key, "status": status, "ambiguous": remaining}


# --- child workflow runs --------------------------------------------------------------------

# A child run's state, from its queue status (seed: ensureControllerWorkflow).


def input_hash(value: Any) -> str:
    return sha256_hex(canonical_json(value))


@atomic
def find_child(db: Database, uid: str, request_key: str, workflow: str, run_input: Any) -> dict[str, Any] | None:
    """The child run recorded for ``request_key``, or None (start one). The same key with
    another workflow or input is refused."""
    row = db.one(f"""SELECT c.workflow, c.input_hash, c.run_id, {CHILD_STATE}, c.attempt,
                       r.output_json, r.output_hash
                     FROM controller_workflows c JOIN runs r ON r.run_id = c.run_id
                     JOIN run_queue q ON q.run_id = c.run_id WHERE c.uid = ? AND c.request_key = ?""",
                 (uid, request_key))
    if row is None:
        return None
    recorded, recorded_hash, run_id, state, attempt, output_json, output_hash = row
    if recorded != workflow or recorded_hash != input_hash(run_input):
        raise Rejected(f"workflow request {request_key!r} was made with another workflow or input")
    return {"requestKey": request_key, "runId": run_id, "state": state, "attempt": attempt,
            "output": db.get_json(output_json, output_hash) if state == "succeeded" else None}


@atomic
def record_child(db: Database, uid: str, request_key: str, workflow: str, run_input: Any, run_id: str,
                 now: int) -> dict[str, Any]:
    db.execute("""INSERT INTO controller_workflows (uid, request_key, input_hash, workflow, run_id, state, attempt,
                    created_at, updated_at) VALUES (?, ?, ?, ?, ?, 'running', 1, ?, ?)""",
               (uid, request_key, input_hash(run_input), workflow, run_id, now, now))
    add_resource_event(db, uid, "workflow_started", {"requestKey": request_key, "runId": run_id}, now)
    child = {"requestKey": request_key, "runId": run_id, "state": "running", "attempt": 1}
    seen = db.scalar("SELECT resource_version FROM controller_resources WHERE uid = ?", (uid,))
    if set_workflow_run(db, uid, child, now):
        # The reconcile's own write: its result still compares against what it was shown.
        db.execute("""UPDATE controller_queue SET claim_resource_version = claim_resource_version + 1
                      WHERE uid = ? AND claim_resource_version = ?""", (uid, seen))
    return {**child, "output": None}


def sync_children(db: Database, now: int) -> list[str]:
    """Child runs whose state moved on (running → waiting or ended): recorded, shown in
    their resource's ``status.workflowRun``, and the resource queued. Returns their uids."""
    if not _moved_children(db):  # the common case, read without taking the write lock
        return []
    with db.write():
        rows = sorted(_moved_children(db))  # locked in uid order: two hosts syncing never wait in a cycle
        moved = []
        for uid, request_key, run_id, attempt, _ in rows:
            lock_resource(db, uid)
            # Its state read again under the lock: another host may have synced it, to a newer
            # state than this read saw, since the read (a stale one written now would move it
            # back). Still moved, checked in the write.
            state = db.scalar(f"""SELECT {CHILD_STATE} FROM controller_workflows c JOIN runs r ON r.run_id = c.run_id
                                  JOIN run_queue q ON q.run_id = c.run_id WHERE c.uid = ? AND c.request_key = ?""",
                              (uid, request_key))
            db.execute("""UPDATE controller_workflows SET state = ?, updated_at = ? WHERE uid = ? AND request_key = ?
                            AND state IN ('running', 'waiting') AND state != ?""",
                       (state, now, uid, request_key, state))
            if state is None or db.changes() != 1:
                continue
            moved.append(uid)
            set_workflow_run(db, uid, {"requestKey": request_key, "runId": run_id, "state": state,
                                       "attempt": attempt}, now)
            add_resource_event(db, uid, "workflow_changed", {"requestKey": request_key, "state": state}, now)
            enqueue(db, uid, now)
        return moved


def _moved_children(db: Database) -> list[tuple[str, str, str, int, str]]:
    result: list[tuple[str, str, str, int, str]] = db.execute(
        f"""SELECT c.uid, c.request_key, c.run_id, c.attempt, {CHILD_STATE} FROM controller_workflows c
                          JOIN runs r ON r.run_id = c.run_id JOIN run_queue q ON q.run_id = c.run_id
                          WHERE c.state IN ('running', 'waiting') AND c.state != {CHILD_STATE}""").fetchall()
    return result
