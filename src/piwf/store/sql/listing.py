"""Runs listed (``run.list``): newest first, narrowed by status, workflow, origin session,
creation time and held, a page at a time after a cursor (the last run shown).

Every filter has an index (``schema.LISTING_LAYOUT``: ``runs_by_status``, ``runs_by_workflow``,
``runs_by_session``, ``runs_listing``, ``run_queue_held``), so a page is read from an
index in order, without sorting or scanning the runs, at 100,000 runs as at 100
(tests/test_run_list.py checks the query plans). Portable SQL: the PostgreSQL backend runs
the same statements, with the same indexes.
"""

from __future__ import annotations

from typing import Any

from piwf.errors import NotFound
from piwf.protocol import RunSummary
from piwf.status import Hold, QueueStatus
from piwf.store.api.types import RunFilter
from piwf.store.sql.base import RUN_COLUMNS, summary_fields
from piwf.store.sql.database import Database, one_of

# Held for a person: only someone acting releases such a run. The index of held runs has
# exactly this condition (a partial index is used only for a query that repeats it).
HELD_HOLDS = (Hold.CRASHED, Hold.EFFECT, Hold.SOURCE)
HELD = f"hold IN ({one_of(HELD_HOLDS)})"
AT_REST_QUEUE = f"status IN ({one_of((QueueStatus.QUEUED, QueueStatus.PARKED))})"


def list_runs(db: Database, limit: int = 50, status: str | None = None,
              where: RunFilter | None = None) -> list[RunSummary]:
    with db.read():
        rows = db.execute(*statement(db, limit, status, where)).fetchall()
    return [RunSummary(*summary_fields(row)) for row in rows]


def statement(db: Database, limit: int = 50, status: str | None = None,
              where: RunFilter | None = None) -> tuple[str, tuple[Any, ...]]:
    """The SELECT of a page and its parameters (a test reads its query plan)."""
    where = where or RunFilter()
    terms, params = _terms(db, where, status or where.status)
    return (f"""SELECT {RUN_COLUMNS} FROM runs r JOIN run_queue q ON q.run_id = r.run_id
                {('WHERE ' + ' AND '.join(terms)) if terms else ''}
                ORDER BY r.created_at DESC, r.run_id DESC LIMIT ?""", (*params, limit))


def _terms(db: Database, where: RunFilter, status: str | None) -> tuple[list[str], list[Any]]:
    terms: list[str] = []
    params: list[Any] = []
    for column, value in (("r.status", status), ("r.workflow", where.workflow),
                          ("r.origin_session_id", where.session)):
        if value is not None:
            terms.append(f"{column} = ?")
            params.append(value)
    if where.since is not None:
        terms.append("r.created_at >= ?")
        params.append(where.since)
    if where.held:  # through the index of held runs: few of them, however many runs there are
        terms.append(f"r.run_id IN (SELECT run_id FROM run_queue WHERE {HELD} AND {AT_REST_QUEUE})")
    if where.after is not None:
        created = db.scalar("SELECT created_at FROM runs WHERE run_id = ?", (where.after,))
        if created is None:
            raise NotFound(f"run {where.after} not found (the cursor names the last run shown)")
        terms.append("r.created_at <= ? AND (r.created_at < ? OR r.run_id < ?)")
        params += [created, created, where.after]
    return terms, params


def count_held(db: Database) -> int:
    """Runs held for a person, through the index of held runs."""
    count: int = db.scalar(f"SELECT COUNT(*) FROM run_queue WHERE {HELD} AND {AT_REST_QUEUE}")
    return count
