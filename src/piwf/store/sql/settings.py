"""Run settings (DESIGN.md §9b; seed ``ensureSettingsScope``/``findSettingsScope``/
``getSettingsScopeAtChange``): a scope per run with a change number, every change kept.

The settings themselves were checked against the workflow's type outside the host (a
throwaway process); here they are stored, compare-and-set on the change number. Each
operation is one transaction; under several writers (PostgreSQL) each write holds the
run's lock (``locks.lock_run``) before it reads, so a request key names one change and the
compare-and-set answers as on SQLite (the CAS and "not ended" are in the UPDATE as well).
"""

from __future__ import annotations

import secrets
from typing import Any

from piwf.errors import Conflict, NotFound, Rejected, Stale
from piwf.protocol import SETTINGS_LIMIT, ChangeSettingsReceipt, RunSettings, SettingsChange
from piwf.status import ENDED
from piwf.wire import canonical_json, decode_json
from piwf.store.api.types import Actor
from piwf.store.sql.database import Database
from piwf.store.sql.base import add_event
from piwf.store.sql.database import one_of
from piwf.store.sql.locks import lock_run
from piwf.store.sql.timefmt import iso

ROOT = ""  # the mount path of a run's own scope


def _json(value: Any, what: str) -> str:
    text = canonical_json(value).decode()
    if len(text.encode()) > SETTINGS_LIMIT:
        raise Rejected(f"{what}: {len(text.encode())} bytes as JSON, over the limit of {SETTINGS_LIMIT}")
    return text


def ensure_scope(db: Database, run_id: str, *, settings: Any, mutable: list[str], patch: Any, actor_id: str | None,
                 now: int) -> str:
    """The run's settings scope, made with ``settings`` as change 0 (``patch``: the
    initial settings as the start request gave them) unless it exists; its id."""
    with db.write():
        lock_run(db, run_id)
        found = db.scalar("SELECT scope_id FROM settings_scopes WHERE run_id = ? AND mount_path = ?", (run_id, ROOT))
        if found is not None:  # a run resumed on an edited workflow: its mutable paths are the file's now
            db.execute("UPDATE settings_scopes SET mutable_json = ? WHERE scope_id = ?",
                       (canonical_json(mutable).decode(), found))
            result: str = found
            return result
        scope_id = "settings-" + secrets.token_hex(8)
        stored = _json(settings, "the settings")
        db.execute("""INSERT INTO settings_scopes (scope_id, run_id, mount_path, settings_json, change_number,
                        mutable_json, created_at, updated_at) VALUES (?, ?, ?, ?, 0, ?, ?, ?)""",
                   (scope_id, run_id, ROOT, stored, canonical_json(mutable).decode(), now, now))
        db.execute("""INSERT INTO settings_changes (scope_id, change_number, actor_type, actor_id, patch_json,
                        settings_json, created_at) VALUES (?, 0, 'start', ?, ?, ?, ?)""",
                   (scope_id, actor_id, _json(patch or {}, "the settings patch"), stored, now))
        return scope_id


def find_scope(db: Database, run_id: str, scope_id: str | None = None) -> tuple[str, int, Any]:
    """(scope id, change number, settings) of the run's scope (``scope_id``: that one,
    which must be the run's); ``NotFound`` when the run has none."""
    row = db.one("""SELECT scope_id, change_number, settings_json FROM settings_scopes
                    WHERE run_id = ? AND scope_id = COALESCE(?, scope_id) AND mount_path = COALESCE(?, mount_path)""",
                 (run_id, scope_id, ROOT if scope_id is None else None))
    if row is None:
        if scope_id is not None:
            raise NotFound(f"run {run_id} has no settings scope {scope_id}")
        if db.scalar("SELECT 1 FROM runs WHERE run_id = ?", (run_id,)) is None:
            raise NotFound(f"run {run_id} not found")
        raise Rejected(f"run {run_id} has no settings: its workflow declares none (Workflow(..., settings=...))")
    return row[0], row[1], decode_json(row[2].encode())


def get_settings(db: Database, run_id: str, scope_id: str | None = None) -> RunSettings:
    with db.read():
        found, _, _ = find_scope(db, run_id, scope_id)
        mount, number, settings, mutable = db.one(
            "SELECT mount_path, change_number, settings_json, mutable_json FROM settings_scopes WHERE scope_id = ?",
            (found,))
        changes = [SettingsChange(n, actor, actor_id, decode_json(patch.encode()), iso(at))
                   for n, actor, actor_id, patch, at in db.execute(
                       """SELECT change_number, actor_type, actor_id, patch_json, created_at FROM settings_changes
                          WHERE scope_id = ? ORDER BY change_number""", (found,))]
    return RunSettings(runId=run_id, scopeId=found, mountPath=mount, changeNumber=number,
                       settings=decode_json(settings.encode()), mutable=decode_json(mutable.encode()),
                       changes=changes)


def prior_change(db: Database, run_id: str, request_key: str, scope_id: str | None = None,
                 patch: Any = None) -> ChangeSettingsReceipt | None:
    """The change made earlier under ``request_key`` (a controller's retry), if any; a
    ``conflict`` when that change was another patch (a request key names one change)."""
    with db.read():
        found, _, _ = find_scope(db, run_id, scope_id)
        row = db.one("SELECT change_number, settings_json, patch_json FROM settings_changes "
                     "WHERE scope_id = ? AND request_key = ?", (found, request_key))
    if row is None:
        return None
    if patch is not None and canonical_json(patch).decode() != row[2]:
        raise Conflict(f"request key {request_key!r} was used for another settings patch (change {row[0]})")
    return ChangeSettingsReceipt(runId=run_id, scopeId=found, changeNumber=row[0],
                                 settings=decode_json(row[1].encode()))


def change_settings(db: Database, run_id: str, *, scope_id: str, base: int, expected: int | None, patch: Any,
                    settings: Any, actor: Actor, actor_id: str | None, now: int,
                    request_key: str | None = None) -> tuple[ChangeSettingsReceipt, bool]:
    """Commit ``settings`` (``patch`` applied to the scope's settings at change ``base``,
    checked outside the host) as the next change: a compare-and-set on the change number.
    Returns (receipt, adopted): ``request_key`` seen before returns that change, adopted."""
    with db.write():
        lock_run(db, run_id)
        status = db.scalar("SELECT status FROM run_queue WHERE run_id = ?", (run_id,))
        if status is None:
            raise NotFound(f"run {run_id} not found")
        if request_key is not None:
            prior = prior_change(db, run_id, request_key, scope_id, patch)
            if prior is not None:
                return prior, True
        if status in ENDED:
            raise Rejected(f"run {run_id} has ended ({status}): its settings can no longer change")
        found, current, _ = find_scope(db, run_id, scope_id)
        if expected is not None and expected != current:
            raise Conflict(f"the settings of run {run_id} are at change {current}, not {expected}")
        if base != current:  # without `expected`, the host checks the patch again on these settings
            raise Stale(f"the settings of run {run_id} changed while the patch was checked "
                        f"(now at change {current}); try again")
        stored = _json(settings, "the settings")
        number = current + 1
        # The compare-and-set on the change number and "the run has not ended" are in the write
        # (the reads above only say why a request is refused).
        db.execute(f"""UPDATE settings_scopes SET settings_json = ?, change_number = ?, updated_at = ?
                       WHERE scope_id = ? AND change_number = ? AND {NOT_ENDED}""",
                   (stored, number, now, found, current, run_id))
        if db.changes() != 1:
            _refuse_change(db, run_id)
        db.execute("""INSERT INTO settings_changes (scope_id, change_number, request_key, actor_type, actor_id,
                        patch_json, settings_json, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)""",
                   (found, number, request_key, actor, actor_id, _json(patch, "the settings patch"), stored, now))
        add_event(db, run_id, "settings.changed", {"changeNumber": number}, now)
    return ChangeSettingsReceipt(runId=run_id, scopeId=found, changeNumber=number, settings=settings), False


# In a write of a run's settings: its run (the last parameter) has not ended.
NOT_ENDED = f"(SELECT q.status FROM run_queue q WHERE q.run_id = ?) NOT IN ({one_of(sorted(ENDED))})"


def _refuse_change(db: Database, run_id: str) -> None:
    """Why a settings write changed nothing: the run ended (Rejected), or another writer
    changed the settings since they were read (Conflict)."""
    status = db.scalar("SELECT status FROM run_queue WHERE run_id = ?", (run_id,))
    if status in ENDED:
        raise Rejected(f"run {run_id} has ended ({status}): its settings can no longer change")
    raise Stale(f"the settings of run {run_id} changed while the patch was checked; try again")


def attempt_settings(db: Database, run_id: str, attempt_id: str) -> tuple[int | None, Any]:
    """(change number, settings) an attempt started under; (None, None) for a run without settings."""
    row = db.one("""SELECT a.settings_change, c.settings_json FROM node_attempts a
                    JOIN settings_scopes s ON s.run_id = a.run_id AND s.mount_path = ''
                    JOIN settings_changes c ON c.scope_id = s.scope_id AND c.change_number = a.settings_change
                    WHERE a.attempt_id = ? AND a.run_id = ?""", (attempt_id, run_id))
    if row is None:
        return None, None
    return row[0], decode_json(row[1].encode())


def started_by(db: Database, uid: str, run_id: str) -> bool:
    """Whether the controller resource ``uid`` started run ``run_id`` (``ctx.workflows.ensure``)."""
    return db.one("SELECT 1 FROM controller_workflows WHERE uid = ? AND run_id = ?", (uid, run_id)) is not None
