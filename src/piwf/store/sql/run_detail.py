"""One run as ``run.status`` shows it (``RunDetail``), read from one snapshot.

SQLite reads it with one statement (``DETAIL_SQL``): the run's row, its queue row and each
of its child collections (steps, workers, effects, updates) as a JSON array built by a
correlated subquery, and whether it has open requests. It needs no transaction: one
statement reads from one snapshot. Only a run that needs more (a blob-held input, output
or effect result, open requests, or a placement reason) is read again inside a read
snapshot together with what it needs. Measured in process on a completed run: 8 µs for
the statement where the ten statements it replaces (a join, six child reads, two
SQLite sorters, ``BEGIN`` and ``COMMIT``) took 60; on SQLite 3.54 through apsw a join of
the two primary-key reads costs 8 µs more than a correlated subquery of the same row, and
an ``ORDER BY`` of a few rows 6 to 12 µs more than sorting them here.

PostgreSQL reads the same RunDetail statement by statement (``_generic``) in a read
snapshot; tests/test_run_detail.py holds the two equal on SQLite.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol, cast

import msgspec

from piwf.errors import NotFound
from piwf.protocol import EffectSummary, RunDetail, RunUpdate, Step, WorkerSummary
from piwf.status import QueueStatus
from piwf.store.sql import placement, updates
from piwf.store.sql.base import RUN_COLUMNS, SUMMARY_COLUMNS, Summary, summary_fields
from piwf.store.sql.database import Database
from piwf.store.sql.effects import list_effects
from piwf.store.sql.interactions import OPEN, list_requests
from piwf.store.sql.timefmt import iso
from piwf.store.sql.workers import worker_summaries
from piwf.wire import decode_json

# The run's columns in RUN_COLUMNS order but the queue row's four (one JSON array of a
# subquery), then the detail's own, then the children, each a JSON array of arrays.
DETAIL_SQL = f"""SELECT r.run_id, r.workflow, r.status,
  (SELECT json_array(q.status, q.generation, q.hold, q.queue) FROM run_queue q WHERE q.run_id = r.run_id),
  r.paused, r.status_detail, r.revision, r.origin_session_id, r.created_at, r.updated_at, r.finished_at,
  r.project_path, r.definition_digest, r.input_json, r.input_hash, r.output_json, r.output_hash, r.error_json,
  (SELECT json_group_array(json_array(seq, started_at, node_id, status, generation, exit_name, finished_at,
     settings_change)) FROM node_attempts WHERE run_id = r.run_id),
  (SELECT json_group_array(json_array(started_at, rowid, worker_epoch, generation, pid, status, exit_code, signal,
     diagnostic)) FROM run_workers WHERE run_id = r.run_id),
  (SELECT json_group_array(json_array(created_at, effect_key, status, node_id, generation, result_json, result_hash,
     error_json)) FROM effects WHERE run_id = r.run_id),
  (SELECT json_group_array(json_array(type, key, data_json, seq, updated_at)) FROM run_updates
     WHERE run_id = r.run_id),
  EXISTS (SELECT 1 FROM interaction_requests WHERE run_id = r.run_id AND {OPEN}),
  (SELECT data_version FROM pragma_data_version)
FROM runs r WHERE r.run_id = ?"""

_arrays = msgspec.json.Decoder()
KEPT_MS = 10_000  # how long an answer is kept at most (a bound on wrapping 32-bit data versions)
KEPT_RUNS = 256  # answers kept at most (all forgotten when full)


class Kept(NamedTuple):
    """A RunDetail read when the connection's versions were ``others`` and ``own``, at ``at``."""

    others: int
    own: tuple[int, int]
    at: int
    detail: RunDetail


class _Versioned(Protocol):
    """What SQLite's Database (store/sqlite/db.py) adds for ``Kept`` answers."""

    kept: dict[str, Kept]

    def own_version(self) -> tuple[int, int] | None: ...
    def others_version(self) -> int: ...


def get_run(db: Database, run_id: str, now: int = 0) -> RunDetail:
    """One run with its steps, workers, effects, open requests and updates, read from one
    snapshot (``now``: 0 leaves out the placement reason and every presenter lease). On
    SQLite the answer may be one given before, unchanged since (``Kept``): callers must
    not change what it holds."""
    if db.dialect != "sqlite":
        return _generic(db, run_id, now)
    versioned = cast(_Versioned, db)
    kept = _kept(versioned, run_id, now)
    if kept is not None:
        return kept
    row = _detail_row(db, run_id)
    if _needs_more(row, now):
        with db.read():  # what it needs besides, from the snapshot the run is read from again
            return _detail(db, _detail_row(db, run_id), now)
    own = versioned.own_version()  # right after the read: what it saw, not later
    detail = _detail(db, row, now)
    if now and own is not None:
        if len(versioned.kept) >= KEPT_RUNS:
            versioned.kept.clear()
        versioned.kept[run_id] = Kept(row[_DATA_VERSION], own, now, detail)
    return detail


def _kept(db: _Versioned, run_id: str, now: int) -> RunDetail | None:
    """The answer kept for ``run_id`` if nothing was committed since it was read; it
    depends on no time (it needed no placement reason and has no open request), so ``now``
    only bounds its age."""
    kept = db.kept.get(run_id)
    if kept is None or not 0 <= now - kept.at < KEPT_MS:
        return None
    if db.own_version() != kept.own or db.others_version() != kept.others:
        return None
    return kept.detail


def _detail_row(db: Database, run_id: str, sql: str = DETAIL_SQL) -> tuple[Any, ...]:
    """The row of ``sql`` (DETAIL_SQL's first columns), the queue row's columns in
    RUN_COLUMNS order."""
    row = db.one(sql, (run_id,))
    if row is None or row[3] is None:
        raise NotFound(f"run {run_id} not found")
    status, generation, hold, queue = _arrays.decode(row[3])  # the queue row's
    return (*row[:3], status, *row[4:11], generation, hold, queue, *row[11:])


# Indexes into a _detail_row: RUN_COLUMNS (SUMMARY_COLUMNS of them), the detail's columns,
# then the children.
_INPUT, _OUTPUT, _EFFECTS, _OPEN_REQUESTS, _DATA_VERSION = 16, 18, 23, 25, 26


def _needs_more(row: tuple[Any, ...], now: int) -> bool:
    """The run needs statements besides DETAIL_SQL: a blob-held input or output, an effect
    whose result is a blob, open requests, or a placement reason (a run ready to be
    claimed, unheld)."""
    if (row[_INPUT] is None and row[_INPUT + 1] is not None) or (row[_OUTPUT] is None and row[_OUTPUT + 1] is not None):
        return True
    if row[_OPEN_REQUESTS] or (row[_EFFECTS] != "[]" and _blob_results(row[_EFFECTS])):
        return True
    queue_status, hold = row[3], row[12]
    return now != 0 and hold is None and queue_status in (QueueStatus.QUEUED, QueueStatus.PARKED)


def _blob_results(effects: str) -> bool:
    return any(result is None and digest is not None for *_, result, digest, _ in _arrays.decode(effects))


def _detail(db: Database, row: tuple[Any, ...], now: int) -> RunDetail:
    run_id = row[0]
    summary = summary_fields(row[:SUMMARY_COLUMNS])
    project, digest, input_json, input_hash, output_json, output_hash, error_json = row[SUMMARY_COLUMNS:21]
    steps, workers, effects, published, open_requests = row[21:_DATA_VERSION]
    return RunDetail(
        *summary, projectPath=project, definitionDigest=digest,
        placement=_placement(db, summary, now),
        input=db.get_json(input_json, input_hash),
        output=db.get_json(output_json, output_hash),
        error=None if error_json is None else decode_json(error_json.encode()),
        steps=_steps(steps), workers=_workers(workers), effects=_effects(db, effects),
        waitingFor=list_requests(db, run_id=run_id, now=now) if open_requests else [],
        updates=_updates(run_id, published),
    )


def _by_first_two(rows: list[list[Any]]) -> list[list[Any]]:
    return sorted(rows, key=lambda row: (row[0], row[1])) if len(rows) > 1 else rows


def _steps(text: str) -> list[Step]:
    rows = _by_first_two(_arrays.decode(text))
    return [Step(seq, node, status, gen, exit_name, iso(started), iso(finished), change)
            for seq, started, node, status, gen, exit_name, finished, change in rows]


def _workers(text: str) -> list[WorkerSummary]:
    rows = _by_first_two(_arrays.decode(text))
    return [WorkerSummary(w, g, p, s, c, sig, d) for _, _, w, g, p, s, c, sig, d in rows]


def _effects(db: Database, text: str) -> list[EffectSummary]:
    if text == "[]":
        return []
    rows = _by_first_two(_arrays.decode(text))  # (created_at, key): unique
    return [
        EffectSummary(key, status, node, generation, db.get_json(result_json, result_hash),
                      None if error_json is None else decode_json(error_json.encode()))
        for _, key, status, node, generation, result_json, result_hash, error_json in rows
    ]


def _updates(run_id: str, text: str) -> list[RunUpdate]:
    if text == "[]":
        return []
    # by type and key, as SQLite's BINARY collation orders them (UTF-8 bytes: code points)
    rows = _by_first_two(_arrays.decode(text))
    return [RunUpdate(runId=run_id, type=t, key=k, data=decode_json(d.encode()), seq=s, updatedAt=iso(at) or "")
            for t, k, d, s, at in rows]


def _generic(db: Database, run_id: str, now: int) -> RunDetail:
    """get_run statement by statement, in one read snapshot (PostgreSQL)."""
    with db.read():
        row = _read_one(db, run_id, ", project_path, definition_digest, input_json, input_hash, output_json, "
                                    "output_hash, error_json")
        project, digest, input_json, input_hash, output_json, output_hash, error_json = row[SUMMARY_COLUMNS:]
        summary = summary_fields(row[:SUMMARY_COLUMNS])
        return RunDetail(
            *summary, projectPath=project, definitionDigest=digest,
            placement=_placement(db, summary, now),
            input=db.get_json(input_json, input_hash),
            output=db.get_json(output_json, output_hash),
            error=None if error_json is None else decode_json(error_json.encode()),
            steps=_step_summaries(db, run_id), workers=worker_summaries(db, run_id), effects=list_effects(db, run_id),
            waitingFor=list_requests(db, run_id=run_id, now=now), updates=updates.list_updates(db, run_id),
        )


def _read_one(db: Database, run_id: str, extra: str = "") -> tuple[Any, ...]:
    """One run's row in RUN_COLUMNS order, then ``extra`` columns of ``runs``: one statement
    (one snapshot). SQLite reads the queue row by a correlated subquery, not a join (see
    the module's docstring: 2.4 µs against 9); on PostgreSQL the join is one round trip."""
    if db.dialect != "sqlite":
        joined = db.one(f"SELECT {RUN_COLUMNS}{extra.replace(', ', ', r.')} FROM runs r "
                        "JOIN run_queue q ON q.run_id = r.run_id WHERE r.run_id = ?", (run_id,))
        if joined is None:
            raise NotFound(f"run {run_id} not found")
        return tuple(joined)
    return _detail_row(db, run_id, f"""SELECT run_id, workflow, status, (SELECT json_array(q.status,
      q.generation, q.hold, q.queue) FROM run_queue q WHERE q.run_id = runs.run_id), paused, status_detail, revision,
      origin_session_id, created_at, updated_at, finished_at{extra} FROM runs WHERE run_id = ?""")


def _placement(db: Database, summary: Summary, now: int) -> str | None:
    """Why a run ready to be claimed is not (store/sql/placement.py), read only for such a run."""
    run_id, queue_status, hold, queue = summary[0], summary[3], summary[5], summary[-1]
    if queue_status not in (QueueStatus.QUEUED, QueueStatus.PARKED) or hold is not None or now == 0:
        return None
    return placement.waiting_because(db, run_id, queue, now)


def _step_summaries(db: Database, run_id: str) -> list[Step]:
    # Sorted here, not by SQLite: for one run's few rows its sorter costs more than the
    # query itself (measured 5 µs a call), and every run.status pays it.
    rows = sorted(db.execute(
        """SELECT seq, started_at, node_id, status, generation, exit_name, finished_at, settings_change
           FROM node_attempts WHERE run_id = ?""",
        (run_id,),
    ), key=lambda row: (row[0], row[1]))
    return [
        Step(seq, node, status, gen, exit_name, iso(started), iso(finished), change)
        for seq, started, node, status, gen, exit_name, finished, change in rows
    ]
