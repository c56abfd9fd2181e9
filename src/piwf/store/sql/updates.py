"""Live updates (``ctx.publish``) and what ``run.watch`` reads (DESIGN.md §8).

An update replaces the current value of its (type, key) on the run; each publish adds a
run event, whose id is the update's ``seq``. Run events are numbered across all runs, so
their ids are the one cursor a watcher needs: whatever changed after cursor N left an
event after N (run status changes, steps, updates, notifications, turns).

A page goes no further than the event horizon (``Database.event_horizon``): on
PostgreSQL ids are handed out at insert, so a transaction still open may yet commit an id
below one already committed; the horizon stops short of it, so a cursor never passes an
event that has not committed yet, and pages never skip, repeat or reorder one
(``piwf.store.postgres.cursors``). On SQLite there is no horizon: ids commit in order.
"""

from __future__ import annotations

from typing import Any

from piwf.errors import Rejected
from piwf.protocol import CONTENT_LIMIT, RunEvent, RunUpdate, WatchedRun, WatchEvent, WatchPage
from piwf.wire import canonical_json, decode_json
from piwf.store.sql.base import RUN_COLUMNS, require_claim, store_update, summary_fields
from piwf.store.sql.database import Database, atomic
from piwf.store.sql.interactions import list_requests
from piwf.store.sql.timefmt import iso

TYPE_LIMIT, KEY_LIMIT = 64, 128


@atomic
def publish(db: Database, run_id: str, token: str, *, attempt_id: str, type: str, key: str, data: Any,
            now: int) -> int:
    """Replace the run's (type, key) with ``data``, from the live attempt under a live claim
    (inside the worker message's transaction); returns the update's seq."""
    require_claim(db, run_id, token, now)
    if not db.one("SELECT 1 FROM node_attempts WHERE attempt_id = ? AND run_id = ? AND status = 'running'",
                  (attempt_id, run_id)):
        raise Rejected(f"attempt {attempt_id} is not running: only the live attempt may publish")
    if not 0 < len(type) <= TYPE_LIMIT or not 0 < len(key) <= KEY_LIMIT:
        raise Rejected(f"an update's type is 1 to {TYPE_LIMIT} characters and its key 1 to {KEY_LIMIT}")
    encoded = canonical_json(data).decode()
    if len(encoded.encode()) > CONTENT_LIMIT:
        raise Rejected(f"update {type}/{key} is {len(encoded.encode())} bytes as JSON; the limit is {CONTENT_LIMIT}")
    return store_update(db, run_id, type, key, data, now)


def list_updates(db: Database, run_id: str, after: int = 0, through: int | None = None) -> list[RunUpdate]:
    """The run's updates published after event ``after`` (and, with ``through``, up to it)."""
    if through is None:
        rows = db.execute("""SELECT type, key, data_json, seq, updated_at FROM run_updates
                             WHERE run_id = ? AND seq > ? ORDER BY type, key""", (run_id, after)).fetchall()
    else:
        rows = db.execute("""SELECT type, key, data_json, seq, updated_at FROM run_updates
                             WHERE run_id = ? AND seq > ? AND seq <= ? ORDER BY type, key""",
                          (run_id, after, through)).fetchall()
    return [RunUpdate(runId=run_id, type=t, key=k, data=decode_json(d.encode()), seq=s, updatedAt=iso(at) or "")
            for t, k, d, s, at in rows]


# --- run.watch --------------------------------------------------------------------------------


def last_event(db: Database, run_id: str | None = None, horizon: int | None = None) -> int:
    """The newest event id (of one run, or of all) up to the horizon (taken now when not
    given): a watch waits until it moves past its cursor."""
    if horizon is None:
        horizon = db.event_horizon()
    if horizon is not None:
        return _last_below(db, run_id, horizon)
    if run_id is None:
        newest: int = db.scalar("SELECT COALESCE(MAX(event_id), 0) FROM run_events")
        return newest
    result: int = db.scalar("SELECT COALESCE(MAX(event_id), 0) FROM run_events WHERE run_id = ?", (run_id,))
    return result


def _last_below(db: Database, run_id: str | None, horizon: int) -> int:
    if run_id is None:
        newest: int = db.scalar("SELECT COALESCE(MAX(event_id), 0) FROM run_events WHERE event_id <= ?", (horizon,))
        return newest
    result: int = db.scalar("SELECT COALESCE(MAX(event_id), 0) FROM run_events WHERE run_id = ? AND event_id <= ?",
                            (run_id, horizon))
    return result


def _bounded(where: str, params: tuple[Any, ...], horizon: int | None) -> tuple[str, tuple[Any, ...]]:
    """``where`` and ``params`` with "up to the horizon" added (nothing to add without one)."""
    if horizon is None:
        return where, params
    return f"{where} AND event_id <= ?", (*params, horizon)


ACTIVE = "status IN ('queued', 'starting', 'running', 'parked')"


def snapshot(db: Database, *, run_id: str | None, limit: int, now: int, runs_after: str | None = None) -> WatchPage:
    """Now: the active runs (or ``run_id``), oldest first, at most ``limit`` of them after
    the run ``runs_after`` (a page: ``nextRunsAfter`` names where the next one starts),
    with all their updates and open requests, and the latest ``limit`` events."""
    horizon = db.event_horizon()  # before the snapshot the page is read from
    with db.read():
        more: str | None = None
        if run_id is not None:
            queue_status = db.scalar("SELECT status FROM run_queue WHERE run_id = ?", (run_id,))
            run_ids = [] if queue_status is None else [run_id]
        else:
            run_ids = _active_page(db, runs_after, limit + 1)
            if len(run_ids) > limit:
                run_ids = run_ids[:limit]
                more = run_ids[-1]
        where, params = _bounded("WHERE run_id = ?" if run_id is not None else "WHERE 1 = 1",
                                 (run_id,) if run_id is not None else (), horizon)
        rows = db.execute(f"""SELECT event_id, run_id, at, type, payload_json FROM run_events {where}
                              ORDER BY event_id DESC LIMIT ?""", (*params, limit)).fetchall()
        cursor = last_event(db, None, horizon)
        page = _page(db, cursor, run_ids, list(reversed(rows)), after=0, more=False, now=now, horizon=horizon)
        page.nextRunsAfter = more
        return page


def _active_page(db: Database, runs_after: str | None, limit: int) -> list[str]:
    """Up to ``limit`` active runs in (created_at, run_id) order, after the run ``runs_after``
    (which need not be active any more; an unknown one is refused)."""
    if runs_after is None:
        rows = db.execute(f"SELECT run_id FROM run_queue WHERE {ACTIVE} ORDER BY created_at, run_id LIMIT ?",
                          (limit,))
        return [r for (r,) in rows]
    created = db.scalar("SELECT created_at FROM run_queue WHERE run_id = ?", (runs_after,))
    if created is None:
        raise Rejected(f"payload.runsAfter: no run {runs_after!r}")
    rows = db.execute(f"""SELECT run_id FROM run_queue WHERE {ACTIVE}
                            AND (created_at > ? OR (created_at = ? AND run_id > ?))
                          ORDER BY created_at, run_id LIMIT ?""", (created, created, runs_after, limit))
    return [r for (r,) in rows]


def changes(db: Database, *, after: int, run_id: str | None, limit: int, now: int) -> WatchPage:
    """What changed after ``after``: the next ``limit`` events, the runs they touched with
    their updates published since, and those runs' open requests."""
    horizon = db.event_horizon()  # before the snapshot the page is read from
    with db.read():
        where, params = _bounded("AND run_id = ?" if run_id is not None else "",
                                 (run_id,) if run_id is not None else (), horizon)
        rows = db.execute(f"""SELECT event_id, run_id, at, type, payload_json FROM run_events
                              WHERE event_id > ? {where} ORDER BY event_id LIMIT ?""",
                          (after, *params, limit + 1)).fetchall()
        more = len(rows) > limit
        rows = rows[:limit]
        cursor = rows[-1][0] if more else max(after, last_event(db, None, horizon))
        run_ids = list(dict.fromkeys(row[1] for row in rows))
        return _page(db, cursor, run_ids, rows, after=after, more=more, now=now, horizon=horizon)


def _page(db: Database, cursor: int, run_ids: list[str], rows: list[tuple[Any, ...]], *, after: int, more: bool,
          now: int, horizon: int | None) -> WatchPage:
    watched = [_watched(db, run_id) for run_id in run_ids]
    return WatchPage(
        cursor=cursor, runs=[run for run in watched if run is not None],
        updates=[update for run_id in run_ids for update in list_updates(db, run_id, after, horizon)],
        events=[WatchEvent(runId=r, event=RunEvent(event_id, iso(at) or "", kind, **decode_json(payload.encode())))
                for event_id, r, at, kind, payload in rows],
        requests=[request for run_id in run_ids for request in list_requests(db, run_id=run_id, now=now)],
        more=more)


def _watched(db: Database, run_id: str) -> WatchedRun | None:
    row = db.one(f"SELECT {RUN_COLUMNS} FROM runs r JOIN run_queue q ON q.run_id = r.run_id WHERE r.run_id = ?",
                 (run_id,))
    if row is None:
        return None
    node = db.scalar("SELECT node_id FROM node_attempts WHERE run_id = ? ORDER BY seq DESC, started_at DESC LIMIT 1",
                     (run_id,))
    return WatchedRun(*summary_fields(row), currentNode=node)
