"""The controller queue (DESIGN.md §9): one row per resource, claims, and reconcile results.

    idle (available_at NULL) ──enqueue──▶ due ──claim──▶ claimed ──finish──▶ idle | due later
                                                           │  an enqueue meanwhile bumps
                                                           │  ``version``: due again at once
                                                           └─ lease expired ─▶ claimable again

A claim records the queue ``version`` it saw (``claim_version``), a random token, an
expiry and a claim number (column ``claim_generation``, +1 per claim; a reconcile worker
speaks for one). The ``resourceVersion`` its worker was shown is the compare-and-set token
of its result.
Holds (``permanent``, ``effect``) keep a row from being claimed until someone acts.
"""

from __future__ import annotations

import secrets
from typing import Any

from piwf.protocol.resources import MAX_ERROR_CHARS
from piwf.errors import ClaimLost, Rejected
from piwf.wire import canonical_json, decode_json
from piwf.store.api.rules import check_json_size
from piwf.store.sql.controllers import add_resource_event, delete_resource
from piwf.store.sql.database import Database, atomic
from piwf.store.api.types import ControllerClaim, Delay
from piwf.store.sql.timefmt import iso

MIN_REQUEUE_MS = 1000  # Result.requeue() and short requeue_after(ms): at most one pass a second
HOST_REASONS = ("PermanentError", "EffectAmbiguous")  # a Ready=False set by the host, not by the controller



def claim_due(db: Database, *, room: int, exclude: frozenset[str], lease_ms: int, now: int,
              epoch: int) -> list[ControllerClaim]:
    """Claim up to ``room`` due resources (oldest due first) that this host is not already
    reconciling; a row whose claim expired is due again."""
    if room <= 0:
        return []
    with db.write():
        rows = db.execute(
            """SELECT q.uid, r.project_path, r.controller, r.resource_key FROM controller_queue q
               JOIN controller_resources r ON r.uid = q.uid
               WHERE q.hold IS NULL AND ((q.claim_token IS NULL AND q.available_at <= ?1)
                                         OR (q.claim_token IS NOT NULL AND q.claim_expires_at <= ?1))
               ORDER BY q.available_at LIMIT ?2""", (now, room + len(exclude))).fetchall()
        claims: list[ControllerClaim] = []
        for uid, project, controller, key in rows:
            if uid in exclude or len(claims) >= room:
                continue
            token = secrets.token_hex(16)
            claim_number = db.scalar(  # still due, checked in the UPDATE: another writer may have taken it
                """UPDATE controller_queue SET claim_token = ?, claim_expires_at = ?, claim_version = version,
                     claim_generation = claim_generation + 1, claim_epoch = ?, claim_resource_version = NULL,
                     worker_pid = NULL, worker_identity = NULL, available_at = NULL, updated_at = ?
                   WHERE uid = ? AND hold IS NULL AND ((claim_token IS NULL AND available_at <= ?4)
                                                       OR (claim_token IS NOT NULL AND claim_expires_at <= ?4))
                   RETURNING claim_generation""",
                (token, now + lease_ms, epoch, now, uid))
            if claim_number is None:
                continue
            add_resource_event(db, uid, "reconcile_started", {"claim": claim_number}, now)
            claims.append(ControllerClaim(uid, token, claim_number, project, controller, key))
        return claims




def attach_worker(db: Database, uid: str, token: str, pid: int, identity: str) -> None:
    """Record the reconcile worker's process (pid and start identity) on its claim, so a
    host taking over can kill it (``orphaned_workers``)."""
    with db.write():
        db.execute("UPDATE controller_queue SET worker_pid = ?, worker_identity = ? WHERE uid = ? AND claim_token = ?",
                   (pid, identity, uid, token))


def orphaned_workers(db: Database, epoch: int) -> list[tuple[str, int, str]]:
    """(uid, pid, identity) of the reconcile workers recorded by claims of earlier hosts."""
    with db.read():
        rows = db.execute("""SELECT uid, worker_pid, worker_identity FROM controller_queue
                             WHERE claim_token IS NOT NULL AND claim_epoch < ? AND worker_pid IS NOT NULL""",
                          (epoch,)).fetchall()
    return [(uid, pid, identity) for uid, pid, identity in rows if identity]


def next_due(db: Database) -> int | None:
    """When the next row becomes claimable (ms), or None when none will by itself."""
    due = db.scalar("""SELECT MIN(CASE WHEN claim_token IS NULL THEN available_at ELSE claim_expires_at END)
                       FROM controller_queue WHERE hold IS NULL
                         AND (available_at IS NOT NULL OR claim_token IS NOT NULL)""")
    result: int | None = due
    return result


def renew_claims(db: Database, claims: list[tuple[str, str]], lease_ms: int, now: int) -> set[str]:
    """Renew live claims; returns the uids whose claim was lost (expired, or taken)."""
    lost = set()
    with db.write():
        for uid, token in claims:
            db.execute("""UPDATE controller_queue SET claim_expires_at = ? WHERE uid = ? AND claim_token = ?
                            AND claim_expires_at > ?""", (now + lease_ms, uid, token, now))
            if db.changes() != 1:
                lost.add(uid)
    return lost


def fence(db: Database, uid: str, token: str, lease_ms: int, now: int) -> None:
    """Inside a worker message's transaction: the claim is live (else ClaimLost), and the
    message renews it."""
    db.execute("""UPDATE controller_queue SET claim_expires_at = ? WHERE uid = ? AND claim_token = ?
                    AND claim_expires_at > ?""", (now + lease_ms, uid, token, now))
    if db.changes() != 1:
        raise ClaimLost(f"the claim on resource {uid} is no longer held")


@atomic
def reconcile_view(db: Database, uid: str) -> dict[str, Any]:
    """What a reconcile starts from; the ``resourceVersion`` shown becomes the claim's
    compare-and-set token. Call fenced."""
    row = db.one("""SELECT resource_key, controller, spec_json, spec_hash, status_json, status_hash, generation,
                      resource_version, finalizers_json, deletion_requested_at
                    FROM controller_resources WHERE uid = ?""",
                 (uid,))
    if row is None:
        raise ClaimLost(f"resource {uid} is gone")
    key, controller, spec_json, spec_hash, status_json, status_hash, generation, version, finalizers, deleting = row
    db.execute("UPDATE controller_queue SET claim_resource_version = ? WHERE uid = ?", (version, uid))
    return {"uid": uid, "key": key, "controller": controller, "spec": db.get_json(spec_json, spec_hash),
            "status": db.get_json(status_json, status_hash), "generation": generation, "resourceVersion": version,
            "finalizers": decode_json(finalizers.encode()), "deletionTimestamp": iso(deleting)}


# --- results --------------------------------------------------------------------------------


@atomic
def finish_success(db: Database, uid: str, token: str, *, requeue_after_ms: int | None, settled: bool,
                   controller_status: Any, conditions: list[dict[str, Any]], finalizers: list[str] | None,
                   keep_status: bool, now: int) -> str:
    """Record a reconcile's result: 'settled', 'requeued', 'deleted', or 'conflict' (the
    resource changed after its worker read it: nothing written but the requeue). Call fenced."""
    claim_version, seen_version, version = _claim(db, uid)
    row = db.one("""SELECT resource_version, generation, status_json, status_hash, finalizers_json,
                      deletion_requested_at FROM controller_resources WHERE uid = ?""", (uid,))
    assert row is not None
    current, generation, status_json, status_hash, old_finalizers, deleting = row
    if current != seen_version:
        add_resource_event(db, uid, "reconcile_conflict", {"resourceVersion": current, "seen": seen_version}, now)
        _release(db, uid, now, now)
        return "conflict"
    status = dict(db.get_json(status_json, status_hash) or {})
    if not keep_status:
        status["controllerStatus"] = controller_status
    status["observedGeneration"] = generation
    # A successful pass clears a Ready=False the host set (it does not set one itself).
    stored = [c for c in status.get("conditions", [])
              if not (c.get("type") == "Ready" and c.get("status") == "False" and c.get("reason") in HOST_REASONS)]
    status["conditions"] = merge_conditions(stored, conditions, generation, now)
    kept = decode_json(old_finalizers.encode()) if finalizers is None else finalizers
    _write_status(db, uid, status, kept, now)
    if deleting is not None and not kept:  # settled or requeued: nothing is left to wait for
        delete_resource(db, uid, now)
        return "deleted"
    due = None if settled else now + max(MIN_REQUEUE_MS, requeue_after_ms or 0)
    if version > claim_version:  # an event arrived during the reconcile: once more, now
        due = now
    _release(db, uid, now, due, errors=0, last_error=None)
    add_resource_event(db, uid, "reconcile_finished", {"result": "settled" if settled else "requeue",
                                              "generation": generation}, now)
    return "settled" if settled else "requeued"




@atomic
def finish_failure(db: Database, uid: str, token: str, *, error: str, delay_ms: Delay, permanent: bool,
                   now: int, counted: bool = True) -> int:
    """Record a failed reconcile: the error, the count in a row, and the next attempt
    after ``delay_ms`` (at once if an event arrived meanwhile). A permanent error sets
    ``Ready=False`` and holds the resource until its spec changes, unless the resource or
    a request moved on during the pass: then it is reconciled again at once. Returns the count."""
    claim_version, seen_version, version = _claim(db, uid)
    current = db.scalar("SELECT resource_version FROM controller_resources WHERE uid = ?", (uid,))
    error = error[:MAX_ERROR_CHARS]
    errors = db.scalar("SELECT consecutive_errors + ? FROM controller_queue WHERE uid = ?", (int(counted), uid))
    if callable(delay_ms):
        delay_ms = delay_ms(errors - int(counted))
    moved = version > claim_version or seen_version != current
    if permanent and not moved:
        _set_condition(db, uid, {"type": "Ready", "status": "False", "reason": "PermanentError",
                                 "message": error[:1024]}, now)
        _release(db, uid, now, None, errors=errors, last_error=error, hold="permanent")
    else:
        due = now if version > claim_version or (permanent and moved) else now + delay_ms
        _release(db, uid, now, due, errors=errors, last_error=error)
    add_resource_event(db, uid, "reconcile_failed", {"error": error[:500], "delayMs": None if permanent else delay_ms,
                                            "permanent": permanent, "consecutiveErrors": errors}, now)
    result: int = errors
    return result


def record_failure(db: Database, uid: str, token: str, *, error: str, delay_ms: Delay, now: int,
                   counted: bool = True) -> int | None:
    """A reconcile that ended without reporting (crash, timeout, host stop), recorded by
    the host after its worker is gone; None when the claim was lost meanwhile. Not
    ``counted``: its worker could not even start (not the resource's fault)."""
    with db.write():
        # the fence: a write of the claim's row, so it holds for the rest of the transaction
        db.execute("UPDATE controller_queue SET claim_token = claim_token WHERE uid = ? AND claim_token = ?",
                   (uid, token))
        if db.changes() != 1:
            return None
        return finish_failure(db, uid, token, error=error, delay_ms=delay_ms, permanent=False, now=now,
                              counted=counted)


def hold_for_effect(db: Database, uid: str, key: str, now: int) -> None:
    """An effect's outcome is unknown: the resource waits for an operator."""
    _set_condition(db, uid, {"type": "Ready", "status": "False", "reason": "EffectAmbiguous",
                             "message": f"effect {key!r} may or may not have been applied; "
                                        "resolve it with `piwf controller resolve-effect`"}, now)
    _release(db, uid, now, None, hold="effect", last_error=f"ambiguous effect {key}")
    add_resource_event(db, uid, "effect_ambiguous", {"key": key}, now)


def release_effect_hold(db: Database, uid: str, now: int) -> None:
    db.execute("UPDATE controller_queue SET hold = NULL WHERE uid = ? AND hold = 'effect'", (uid,))
    if db.changes():
        db.execute("UPDATE controller_queue SET available_at = ?, version = version + 1 WHERE uid = ?", (now, uid))


def expire_claims_before(db: Database, epoch: int, now: int) -> int:
    """On takeover: reconciles an earlier host was running are due again at once, each
    counted as an error (their workers died with that host, or were killed by the caller)."""
    with db.write():
        uids = [uid for (uid,) in db.execute("SELECT uid FROM controller_queue WHERE claim_token IS NOT NULL "
                                             "AND claim_epoch < ?", (epoch,))]
        db.execute("""UPDATE controller_queue SET claim_token = NULL, claim_expires_at = NULL, available_at = ?,
                        consecutive_errors = consecutive_errors + 1, updated_at = ?,
                        last_error = 'interrupted: its host died'
                      WHERE claim_token IS NOT NULL AND claim_epoch < ?""", (now, now, epoch))
        for uid in uids:
            add_resource_event(db, uid, "reconcile_failed", {"error": "interrupted: its host died", "delayMs": 0,
                                                             "permanent": False}, now)
        return len(uids)


# --- helpers --------------------------------------------------------------------------------


def _claim(db: Database, uid: str) -> tuple[int, int | None, int]:
    row = db.one("SELECT claim_version, claim_resource_version, version FROM controller_queue WHERE uid = ?", (uid,))
    assert row is not None
    result: tuple[int, int | None, int] = row
    return result


def _release(db: Database, uid: str, now: int, due: int | None, *, errors: int | None = None,
             last_error: str | bool | None = False, hold: str | None = None) -> None:
    db.execute("""UPDATE controller_queue SET claim_token = NULL, claim_expires_at = NULL, available_at = ?,
                    worker_pid = NULL, worker_identity = NULL, consecutive_errors = COALESCE(?, consecutive_errors),
                    last_error = CASE WHEN ? THEN ? ELSE last_error END, hold = COALESCE(?, hold), updated_at = ?
                  WHERE uid = ?""", (due, errors, last_error is not False, last_error or None, hold, now, uid))


# The stored status and finalizers are these (a JSON value is stored canonically, either
# inline or by hash, so equal values have equal columns).
SAME_STATUS = """COALESCE(status_json, '') = COALESCE(?, '') AND COALESCE(status_hash, '') = COALESCE(?, '')
  AND finalizers_json = ?"""


def _write_status(db: Database, uid: str, status: dict[str, Any], finalizers: list[str], now: int) -> bool:
    """Write the status and finalizers, bumping resourceVersion, unless they are the stored
    ones: an identical write changes nothing, not even the version (seed; DESIGN §9).
    Whether it wrote; the comparison is the UPDATE's own."""
    check_json_size(status, "status")
    status_json, status_hash = db.put_json(status, now)
    encoded = canonical_json(finalizers).decode()
    db.execute(f"""UPDATE controller_resources SET status_json = ?, status_hash = ?, finalizers_json = ?,
                     resource_version = resource_version + 1, updated_at = ?
                   WHERE uid = ? AND NOT ({SAME_STATUS})""",
               (status_json, status_hash, encoded, now, uid, status_json, status_hash, encoded))
    return db.changes() == 1


def _set_condition(db: Database, uid: str, condition: dict[str, Any], now: int) -> None:
    row = db.one("""SELECT status_json, status_hash, generation, finalizers_json FROM controller_resources
                    WHERE uid = ?""", (uid,))
    assert row is not None
    status = dict(db.get_json(row[0], row[1]) or {})
    status["conditions"] = merge_conditions(status.get("conditions", []), [condition], row[2], now)
    _write_status(db, uid, status, decode_json(row[3].encode()), now)


def set_workflow_run(db: Database, uid: str, workflow_run: dict[str, Any], now: int) -> bool:
    """Show the child run in ``status.workflowRun``; whether that changed the resource."""
    row = db.one("SELECT status_json, status_hash, finalizers_json FROM controller_resources WHERE uid = ?", (uid,))
    if row is None:
        return False
    status = dict(db.get_json(row[0], row[1]) or {})
    status["workflowRun"] = workflow_run
    return _write_status(db, uid, status, decode_json(row[2].encode()), now)


def merge_conditions(old: list[dict[str, Any]], new: list[dict[str, Any]], generation: int,
                     now: int) -> list[dict[str, Any]]:
    """Conditions by type: a returned one replaces the stored one of its type, keeping its
    ``lastTransitionTime`` when its status did not change; the others are kept."""
    merged = {c["type"]: c for c in old}
    seen: set[str] = set()
    for condition in new:
        kind = condition.get("type")
        if not isinstance(kind, str) or not kind:
            raise Rejected(f"a condition needs a `type` (text): {condition!r}"[:300])
        if kind in seen:
            raise Rejected(f"condition type {kind!r} was returned twice")
        seen.add(kind)
        status = condition.get("status")
        if status not in ("True", "False", "Unknown"):
            raise Rejected(f"condition {kind!r}: status must be 'True', 'False' or 'Unknown', not {status!r}")
        before = merged.get(kind)
        changed = before is None or before.get("status") != status
        since = iso(now) if before is None or changed else before.get("lastTransitionTime")
        merged[kind] = {**condition, "observedGeneration": generation, "lastTransitionTime": since}
    return sorted(merged.values(), key=lambda c: c["type"])
