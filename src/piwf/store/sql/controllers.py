"""Controller resources (DESIGN.md §9): apply, delete, reconcile requests, reads, events.

A resource is keyed by (project, controller, key) and has a ``uid`` that is never reused,
a ``resourceVersion`` (+1 on every write: the compare-and-set token) and a ``generation``
(+1 only when the canonical spec changes). Its queue row (``controller_queue``) lives and
dies with it; see ``store/controller_queue.py`` for claims and results.

Under several writers (PostgreSQL) every write of a resource holds its lock first — its
queue row (``locks.lock_resource``; a reconcile's fence is an UPDATE of it), or, to apply
by key, the key's lock then the row (``locks.lock_resource_key``): two applies of one new
key make one resource, and an apply and a reconcile's result never interleave (a result
always sees the ``version`` an apply bumped, so the changed spec is reconciled again).
The resourceVersion compare-and-set is in the UPDATE as well.
"""

from __future__ import annotations

import secrets
from typing import Any

import msgspec

from piwf.protocol.resources import (
    RECENT_EVENTS, ApplyReceipt, ResourceDetail, ResourceEvent, ResourceRef,
    ResourceSummary,
)
from piwf.errors import Conflict, NotFound, Rejected
from piwf.wire import canonical_json, decode_json, sha256_hex
from piwf.store.api.rules import check_json_size, check_key
from piwf.store.sql.controller_children import children
from piwf.store.sql.database import Database, atomic
from piwf.store.sql.locks import lock_resource_key
from piwf.store.sql.timefmt import iso

RESOURCE_COLUMNS = """r.uid, r.project_path, r.controller, r.resource_key, r.resource_version, r.generation,
  r.spec_json, r.spec_hash, r.status_json, r.status_hash, r.finalizers_json, r.deletion_requested_at,
  r.created_at, r.updated_at, q.available_at, q.hold, q.claim_token, q.claim_expires_at,
  q.consecutive_errors, q.last_error"""
KEPT_EVENTS = 1000  # per resource; older ones are dropped as new ones are written
FROM_RESOURCES = "controller_resources r JOIN controller_queue q ON q.uid = r.uid"


def initial_status(controller_status: Any) -> dict[str, Any]:
    return {"observedGeneration": 0, "conditions": [], "controllerStatus": controller_status}


# --- writes on behalf of clients ------------------------------------------------------------


def apply_resource(db: Database, *, project: str, controller: str, key: str, spec: Any, initial: Any,
                   expected_version: int | None, now: int) -> ApplyReceipt:
    """Create the resource, or change its spec; the same spec again writes nothing. A new
    or changed spec is queued for a reconcile (and lifts a hold after a permanent error)."""
    check_key(key)
    digest = sha256_hex(check_json_size(spec, "spec"))
    with db.write():
        lock_resource_key(db, project, controller, key)
        row = db.one("""SELECT uid, resource_version, generation, spec_digest, deletion_requested_at
                        FROM controller_resources WHERE project_path = ? AND controller = ? AND resource_key = ?""",
                     (project, controller, key))
        if row is None:
            if expected_version not in (None, 0):
                raise Conflict(f"{controller}/{key} does not exist (expected resourceVersion {expected_version})")
            return _create(db, project, controller, key, spec, digest, initial, now)
        uid, version, generation, old_digest, deleting = row
        if expected_version is not None and expected_version != version:
            raise Conflict(f"{controller}/{key} is at resourceVersion {version}, not {expected_version}")
        if deleting is not None:
            raise Rejected(f"{controller}/{key} is being deleted; apply it again once it is gone")
        if old_digest == digest:
            return ApplyReceipt(uid, version, generation, changed=False)
        spec_json, spec_hash = db.put_json(spec, now)
        db.execute("""UPDATE controller_resources SET spec_json = ?, spec_hash = ?, spec_digest = ?,
                        generation = generation + 1, resource_version = resource_version + 1, updated_at = ?
                      WHERE uid = ? AND resource_version = ? AND deletion_requested_at IS NULL""",
                   (spec_json, spec_hash, digest, now, uid, version))
        if db.changes() != 1:  # the compare-and-set is in the write: another writer changed it since the read
            raise Conflict(f"{controller}/{key} changed meanwhile (it was at resourceVersion {version})")
        db.execute("UPDATE controller_queue SET hold = NULL WHERE uid = ? AND hold = 'permanent'", (uid,))
        enqueue(db, uid, now)
        add_resource_event(db, uid, "applied", {"generation": generation + 1}, now)
        return ApplyReceipt(uid, version + 1, generation + 1, changed=True)


def _create(db: Database, project: str, controller: str, key: str, spec: Any, digest: str, initial: Any,
            now: int) -> ApplyReceipt:
    uid = "res-" + secrets.token_hex(8)
    spec_json, spec_hash = db.put_json(spec, now)
    status_json, status_hash = db.put_json(initial_status(initial), now)
    db.execute("""INSERT INTO controller_resources (uid, project_path, controller, resource_key, resource_version,
                    generation, spec_json, spec_hash, spec_digest, status_json, status_hash, created_at, updated_at)
                  VALUES (?, ?, ?, ?, 1, 1, ?, ?, ?, ?, ?, ?, ?)""",
               (uid, project, controller, key, spec_json, spec_hash, digest, status_json, status_hash, now, now))
    db.execute("INSERT INTO controller_queue (uid, available_at, version, updated_at) VALUES (?, ?, 1, ?)",
               (uid, now, now))
    add_resource_event(db, uid, "applied", {"generation": 1}, now)
    return ApplyReceipt(uid, 1, 1, changed=True)


def request_reconcile(db: Database, project: str, controller: str, key: str, now: int) -> ResourceRef:
    """Queue a reconcile. Deduplicated: however many arrive while one is queued, one runs;
    while one runs, one more runs after it. An operator's request lifts a permanent-error
    hold too."""
    with db.write():
        lock_resource_key(db, project, controller, key)
        uid, version, _ = _locate(db, project, controller, key)
        db.execute("UPDATE controller_queue SET hold = NULL WHERE uid = ? AND hold = 'permanent'", (uid,))
        enqueue(db, uid, now)
        return ResourceRef(uid, version, deleted=False)


def request_delete(db: Database, project: str, controller: str, key: str, now: int, *,
                   force: bool = False) -> ResourceRef:
    """Set the deletion timestamp (once) and queue a reconcile, which must clear the
    finalizers; a resource without finalizers that no reconcile holds goes at once.
    ``force``: the resource goes now, finalizers and all, without a reconcile (a pass
    running for it loses its claim; nothing it writes afterwards is kept)."""
    with db.write():
        lock_resource_key(db, project, controller, key)
        uid, version, deleting = _locate(db, project, controller, key)
        if force:
            delete_resource(db, uid, now)
            return ResourceRef(uid, version, deleted=True)
        finalizers = decode_json(db.scalar("SELECT finalizers_json FROM controller_resources WHERE uid = ?",
                                           (uid,)).encode())
        # no reconcile holds it: checked by a write of its queue row, which holds until the commit
        db.execute("""UPDATE controller_queue SET claim_token = claim_token
                      WHERE uid = ? AND (claim_token IS NULL OR claim_expires_at <= ?)""", (uid, now))
        claimed = db.changes() != 1
        if not finalizers and not claimed:
            delete_resource(db, uid, now)
            return ResourceRef(uid, version, deleted=True)
        if deleting is None:
            db.execute("""UPDATE controller_resources SET deletion_requested_at = ?,
                            resource_version = resource_version + 1, updated_at = ? WHERE uid = ?""", (now, now, uid))
            db.execute("UPDATE controller_queue SET hold = NULL WHERE uid = ? AND hold = 'permanent'", (uid,))
            add_resource_event(db, uid, "deletion_requested", {}, now)
            version += 1
        enqueue(db, uid, now)
        return ResourceRef(uid, version, deleted=False)


def delete_resource(db: Database, uid: str, now: int) -> None:
    """Remove the resource with its queue row, effects and child-run records (cascade)
    and its events (nothing can read them once the resource is gone). Its child runs
    are runs like any other: they are left to finish."""
    db.execute("DELETE FROM controller_resources WHERE uid = ?", (uid,))
    db.execute("DELETE FROM controller_events WHERE uid = ?", (uid,))


def enqueue(db: Database, uid: str, now: int, at: int | None = None) -> None:
    """One row per resource: a request while one is queued moves it earlier at most; a
    request while a reconcile runs bumps ``version``, so the finish queues it once more."""
    at = now if at is None else at
    db.execute("""UPDATE controller_queue SET available_at = CASE WHEN available_at < ? THEN available_at ELSE ? END,
                    version = version + 1, updated_at = ? WHERE uid = ?""", (at, at, now, uid))


def _locate(db: Database, project: str, controller: str, key: str) -> tuple[str, int, int | None]:
    row = db.one("""SELECT uid, resource_version, deletion_requested_at FROM controller_resources
                    WHERE project_path = ? AND controller = ? AND resource_key = ?""", (project, controller, key))
    if row is None:
        raise NotFound(f"no resource {controller}/{key} in {project}")
    result: tuple[str, int, int | None] = row
    return result


def locate_uid(db: Database, project: str, controller: str, key: str) -> str:
    return _locate(db, project, controller, key)[0]


# --- events ---------------------------------------------------------------------------------


@atomic
def add_resource_event(db: Database, uid: str, kind: str, payload: dict[str, Any], now: int) -> None:
    """Record an event; a resource keeps its last ``KEPT_EVENTS`` exactly (one requeued
    every second for a year must not fill the disk). Event ids only grow, so a resource
    whose oldest event is fewer than ``KEPT_EVENTS`` ids back cannot have too many: the
    common case costs one index lookup."""
    event_id = db.scalar("INSERT INTO controller_events (uid, at, type, payload_json) VALUES (?, ?, ?, ?) "
                         "RETURNING event_id", (uid, now, kind, canonical_json(payload).decode()))
    oldest = db.scalar("SELECT MIN(event_id) FROM controller_events WHERE uid = ?", (uid,))
    if event_id - oldest >= KEPT_EVENTS:
        db.execute("""DELETE FROM controller_events WHERE uid = ? AND event_id <= (SELECT event_id
                        FROM controller_events WHERE uid = ? ORDER BY event_id DESC LIMIT 1 OFFSET ?)""",
                   (uid, uid, KEPT_EVENTS))


def events(db: Database, uid: str, limit: int = RECENT_EVENTS) -> list[ResourceEvent]:
    rows = db.execute("""SELECT event_id, at, type, payload_json FROM controller_events WHERE uid = ?
                         ORDER BY event_id DESC LIMIT ?""", (uid, limit)).fetchall()
    return [ResourceEvent(event_id, iso(at) or "", kind, decode_json(payload.encode()))
            for event_id, at, kind, payload in reversed(rows)]


# --- reads ----------------------------------------------------------------------------------


def get_resource(db: Database, project: str, controller: str, key: str, now: int) -> ResourceDetail:
    with db.read():
        row = db.one(f"""SELECT {RESOURCE_COLUMNS} FROM {FROM_RESOURCES}
                         WHERE r.project_path = ? AND r.controller = ? AND r.resource_key = ?""",
                     (project, controller, key))
        if row is None:
            raise NotFound(f"no resource {controller}/{key} in {project}")
        return _detail(db, row, now)


def list_resources(db: Database, project: str | None, controller: str | None) -> list[ResourceSummary]:
    with db.read():
        rows = db.execute(f"""SELECT {RESOURCE_COLUMNS} FROM {FROM_RESOURCES}
                              WHERE r.project_path = COALESCE(?, r.project_path)
                                AND r.controller = COALESCE(?, r.controller)
                              ORDER BY r.project_path, r.controller, r.resource_key""",
                          (project, controller)).fetchall()
        return [_summary(db, row) for row in rows]


def status_counts(db: Database, now: int) -> dict[str, int]:
    pending = db.scalar("""SELECT COUNT(*) FROM controller_queue WHERE available_at IS NOT NULL AND hold IS NULL""")
    held = db.scalar("SELECT COUNT(*) FROM controller_queue WHERE hold IS NOT NULL")
    ambiguous = db.scalar("SELECT COUNT(*) FROM controller_effects WHERE status = 'ambiguous'")
    return {"pendingControllers": pending, "heldControllers": held, "ambiguousControllerEffects": ambiguous}


def _fields(db: Database, row: tuple[Any, ...]) -> dict[str, Any]:
    (uid, project, controller, key, version, generation, spec_json, spec_hash, status_json, status_hash,
     finalizers, deleting, created, updated, available, hold, _token, _expires, errors, last_error) = row
    status = db.get_json(status_json, status_hash) or {}
    ready = next((c.get("status") for c in status.get("conditions", []) if c.get("type") == "Ready"), None)
    return dict(uid=uid, projectPath=project, controller=controller, key=key, resourceVersion=version,
                generation=generation, observedGeneration=status.get("observedGeneration", 0), ready=ready,
                deletionTimestamp=iso(deleting), consecutiveErrors=errors, availableAt=iso(available), hold=hold,
                spec=(spec_json, spec_hash), status=status, finalizers=finalizers, lastError=last_error,
                createdAt=iso(created), updatedAt=iso(updated))


def _summary(db: Database, row: tuple[Any, ...]) -> ResourceSummary:
    fields = _fields(db, row)
    names = ResourceSummary.__struct_fields__
    return ResourceSummary(**{name: fields[name] for name in names})


def _detail(db: Database, row: tuple[Any, ...], now: int) -> ResourceDetail:
    fields = _fields(db, row)
    fields["spec"] = db.get_json(*fields["spec"])
    fields["finalizers"] = decode_json(fields["finalizers"].encode())
    token, expires = row[16], row[17]
    fields["reconciling"] = token is not None and expires is not None and expires > now
    fields["events"] = events(db, fields["uid"])
    fields["children"] = children(db, fields["uid"])
    return msgspec.convert(fields, ResourceDetail)
