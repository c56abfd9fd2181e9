"""The run queue state machine (seed 003): claim, renew, fence, run, park, end.

Queue status and engine status change together in one transaction so the lifecycle
projection (``lifecycle_contradictions``) always holds.
"""

from __future__ import annotations

import functools
from typing import Any

from piwf.errors import ClaimLost, Conflict, NotFound
from piwf.wire import canonical_json
from piwf.status import DEFAULT_QUEUE, QueueStatus
from piwf.store.sql import ending
from piwf.store.sql.base import (  # noqa: F401 (FENCE, holds_claim: re-exported)
    FENCE, LIVE, add_event, earlier_epoch, fenced, holds_claim, interrupt_attempts, require_claim, revised,
    revision_of,
)
from piwf.store.sql.database import Database
from piwf.store.api.rules import stored_input_hash
from piwf.store.api.types import Claim, RunLaunch
# Ready: not held, and past its crash back-off (layout 10), if any.
READY = "(q.status IN ('queued', 'parked') AND q.hold IS NULL AND (q.not_before IS NULL OR q.not_before <= :now))"
EXPIRED = """(q.status IN ('starting', 'running')
  AND q.claim_expires_at IS NOT NULL AND q.claim_expires_at <= :now)"""
CLAIMABLE = f"({READY} OR {EXPIRED})"
# A parked run of a session waits while another run of that session is active.
SESSION_FREE = """(
  q.origin_session_id IS NULL OR q.status = 'queued' OR NOT EXISTS (
    SELECT 1 FROM run_queue o WHERE o.origin_session_id = q.origin_session_id
      AND o.run_id != q.run_id AND o.status IN ('queued', 'starting', 'running')))"""



def claim_next_run(
    db: Database, *, runner_id: str, token: str, lease_ms: int, now: int, epoch: int,
    exclude: frozenset[str] = frozenset(), queues: tuple[str, ...] = (DEFAULT_QUEUE,),
) -> Claim | None:
    """Claim the oldest claimable run of ``queues`` not in ``exclude``, or None; a run with a
    submission waiting to be validated comes before the rest of the queue. Runs that
    ``runner_id`` recorded it cannot load (store/sql/placement.py) are passed over.

    Several writers (PostgreSQL): the candidates are read ``FOR UPDATE SKIP LOCKED``, so two
    hosts claiming at once take different runs instead of queueing on the same row; a
    candidate whose session another transaction is starting a run of (its session lock is
    taken) is passed over, as is one taken meanwhile (the check is in the UPDATE too)."""
    skip = set(exclude)
    with db.write():
        for _ in range(CANDIDATES):
            found, _ = candidates(db, now=now, exclude=frozenset(skip), runner_id=runner_id, queues=queues, limit=1)
            if not found:
                return None
            _, run_id, session = found[0]
            claim = take(db, run_id, runner_id=runner_id, token=token, lease_ms=lease_ms, now=now, epoch=epoch,
                         session=session)
            if claim is not None:
                return claim
            skip.add(run_id)
    return None


CANDIDATES = 8  # candidates tried by one claim before it gives up for this round
EXCLUDED_STEP = 16
Candidate = tuple[Any, str, "str | None"]  # (created_at, run id, session)


def candidates(db: Database, *, now: int, exclude: frozenset[str], runner_id: str = "",
               queues: tuple[str, ...] = (DEFAULT_QUEUE,), limit: int = 1) -> tuple[list[Candidate], bool]:
    """Up to ``limit`` of the oldest claimable runs of ``queues`` not in ``exclude`` nor
    recorded unloadable by ``runner_id``, in claim order (runs with a submission being
    validated first), each once; and whether they are all there are (False: there may be
    more). A run of them may have been taken by the time it is claimed (another writer, or
    the session rule after an earlier take of the same transaction): ``take`` checks again."""
    served = sorted(set(queues))
    params: dict[str, Any] = {"now": now, "host": runner_id}
    for i, name in enumerate(served):
        params[f"q{i}"] = name
    if db.dialect != "sqlite":
        return _candidates_at_once(db, params, exclude, len(served), limit)
    # SQLite: each part is its own statement (one compound of them was measured at 4x
    # their sum). The excluded runs are left out here (a NOT IN list builds a temporary
    # index at each execution): a part that returned some of them among as many rows as it
    # was asked for is read again past them (rare: an excluded run is this host's, claimed).
    found: list[Any] = []
    complete = True
    for part in range(len(served) + 1):  # the validating runs (rank 0), then each queue's ready runs
        asked = limit
        rows = db.execute(_sqlite_parts(db, len(served), asked)[part], params).fetchall()
        if len(rows) == asked and exclude and not exclude.isdisjoint(row[1] for row in rows):
            asked += len(exclude)
            rows = db.execute(_sqlite_parts(db, len(served), asked)[part], params).fetchall()
        complete = complete and len(rows) < asked
        rank = 0 if part == 0 else 1
        found += [(rank, *row) for row in rows]
    expired = db.execute(_sqlite_parts(db, len(served), limit)[-1], params).fetchall()
    found += [(1, *row) for row in expired]
    found.sort(key=lambda row: row[:3])
    # All there are only if every part came short and no candidate read is left out by
    # the limit (the parts' rows together may be more than it).
    complete = complete and len(expired) < limit and len({row[2] for row in found} - exclude) <= limit
    return _first(found, exclude, limit), complete


def _sqlite_parts(db: Database, queues: int, limit: int) -> list[str]:
    """SQLite's candidate reads: the validating runs', each queue's ready runs', the expired
    claims' (``_candidates_sql``, built once per count of queues and limit)."""
    parts = _CANDIDATES_SQL.get((queues, limit))
    if parts is None:
        validating, readies, expired = _candidates_sql(db, "", queues, limit)
        parts = _CANDIDATES_SQL[queues, limit] = [validating, *readies, expired]
    return parts


def _candidates_at_once(db: Database, params: dict[str, Any], exclude: frozenset[str], queues: int,
                        limit: int) -> tuple[list[Candidate], bool]:
    """PostgreSQL: the parts in one round trip, each locking what it returns (the excluded
    runs are left out by the statement, so none of them is locked)."""
    # Padded to a multiple of EXCLUDED_STEP (with '', never a run id): the statements' texts
    # come in a few lengths, not one per count, and stay prepared.
    padded = [*sorted(exclude), *[""] * (-len(exclude) % EXCLUDED_STEP)]
    for i, run_id in enumerate(padded):
        params[f"x{i}"] = run_id
    key = (db.dialect, queues, limit, len(padded))
    sql = _ONE_STATEMENT.get(key)
    if sql is None:
        validating, readies, expired = _candidates_sql(db, _not_in(len(padded)), queues, limit)
        # In CTEs: FOR UPDATE is not allowed in a UNION's arm.
        parts = [("v", 0, validating), *((f"r{i}", 1, ready) for i, ready in enumerate(readies)), ("e", 1, expired)]
        union = " UNION ALL ".join(f"SELECT {rank} AS rank, created_at, run_id, origin_session_id FROM {name}"
                                   for name, rank, _ in parts)
        sql = _ONE_STATEMENT[key] = (f"WITH {', '.join(f'{name} AS ({part})' for name, _, part in parts)} "
                                     f"SELECT rank, created_at, run_id, origin_session_id FROM ({union}) c "
                                     f"ORDER BY rank, created_at, run_id LIMIT {limit:d}")
    rows = db.execute(sql, params).fetchall()
    return _first(rows, frozenset(), limit), len(rows) < limit  # fewer: every part returned all it found


def _first(rows: list[Any], exclude: frozenset[str], limit: int) -> list[Candidate]:
    """The first ``limit`` of (rank, created_at, run id, session) rows in order, each run
    once and none of ``exclude``."""
    seen = set(exclude)
    first: list[Candidate] = []
    for _, created_at, run_id, session in rows:
        if run_id not in seen and len(first) < limit:
            seen.add(run_id)
            first.append((created_at, run_id, session))
    return first


# Built once each: SQLite's parts by (queues, limit); PostgreSQL's statement by (queues, limit, excluded).
_CANDIDATES_SQL: dict[tuple[int, int], list[str]] = {}
_ONE_STATEMENT: dict[tuple[str, int, int, int], str] = {}


def _candidates_sql(db: Database, not_in: str, queues: int, limit: int) -> tuple[str, list[str], str]:
    """The candidates' three reads: a validating run's, then the two halves of CLAIMABLE:
    the oldest ready runs of each queue (each read in order from run_queue_ready, by queue
    first: one ORDER BY over several queues would sort every ready run of them) and the
    runs whose claims expired (few, so they are sorted with the rest, not by the database).
    ``not_in``: the excluded runs' condition, if the statements leave them out."""
    not_in += PLACED
    lock = db.lock_rows(skip_locked=True)
    # From the few submissions being validated to their runs (CROSS JOIN: SQLite keeps this
    # order instead of scanning the ready runs; PostgreSQL plans it as an inner join).
    validating = f"""SELECT q.created_at, q.run_id, q.origin_session_id FROM interaction_submissions s
                     CROSS JOIN interaction_requests r CROSS JOIN run_queue q
                     WHERE r.request_id = s.request_id AND q.run_id = r.run_id
                       AND s.status = 'validating' AND {READY} AND {SESSION_FREE} {not_in}{_in_queues(queues)}
                     ORDER BY q.created_at, q.run_id LIMIT {limit:d}{db.lock_rows("q", skip_locked=True)}"""
    # The queue's name in a CAST: compared bare, SQLite would prepare the statement again at
    # each execution (the value bound to a parameter is matched against run_queue's partial
    # indexes' conditions when the plan is made; measured 21 µs a read against 5 µs).
    readies = [f"""SELECT q.created_at, q.run_id, q.origin_session_id FROM run_queue q INDEXED BY run_queue_ready
                   WHERE {READY} AND {SESSION_FREE} {not_in} AND q.queue = CAST(:q{i} AS TEXT)
                   ORDER BY q.created_at, q.run_id LIMIT {limit:d}{lock}""" for i in range(queues)]
    expired = (f"SELECT q.created_at, q.run_id, q.origin_session_id FROM run_queue q "
               f"WHERE {EXPIRED} AND {SESSION_FREE} {not_in}{_in_queues(queues)}{lock}")
    return validating, readies, expired


# Runs this host recorded it cannot load (``placement.release_unloadable``) are not its to claim.
PLACED = " AND NOT EXISTS (SELECT 1 FROM run_placement p WHERE p.run_id = q.run_id AND p.host_id = :host)"


@functools.cache
def _in_queues(count: int) -> str:
    return f" AND q.queue IN ({', '.join(f':q{i}' for i in range(count))})"


@functools.cache
def _not_in(count: int) -> str:
    return f" AND q.run_id NOT IN ({', '.join(f':x{i}' for i in range(count))})" if count else ""


def claim_run(
    db: Database, run_id: str, *, runner_id: str, token: str, lease_ms: int, now: int, epoch: int
) -> Claim | None:
    """Claim one named run if it is claimable."""
    with db.write():
        session = db.one(f"SELECT q.origin_session_id FROM run_queue q WHERE q.run_id = :run AND {CLAIMABLE} "
                         f"AND {SESSION_FREE}{db.lock_rows()}", {"run": run_id, "now": now})
        return None if session is None else take(db, run_id, runner_id=runner_id, token=token, lease_ms=lease_ms,
                                                 now=now, epoch=epoch, session=session[0])


# CLAIMABLE and SESSION_FREE for one row, in an UPDATE: the claim is taken only while the
# run is claimable and no other run of its session is active.
STILL_CLAIMABLE = """((status IN ('queued', 'parked') AND hold IS NULL AND (not_before IS NULL OR not_before <= ?))
  OR (status IN ('starting', 'running') AND claim_expires_at IS NOT NULL AND claim_expires_at <= ?))
  AND """ + SESSION_FREE.replace("q.", "run_queue.")
TAKE = f"""UPDATE run_queue SET status = 'starting', runner_id = ?, claim_token = ?,
      claim_expires_at = ?, generation = generation + 1, owner_epoch = ?,
      started_at = COALESCE(started_at, ?), updated_at = ?
    WHERE run_id = ? AND {STILL_CLAIMABLE} RETURNING generation"""
# A waiting run is claimed once a submission to it awaits validation: the run is running again.
RUNNING = "UPDATE runs SET status = 'running', updated_at = ? WHERE run_id = ? AND status IN ('queued', 'waiting')"
# What a claimed run's worker is launched with (``RunLaunch``).
LAUNCH = "workflow, project_path, definition_digest, input_json, input_hash"


def take(db: Database, run_id: str, *, runner_id: str, token: str, lease_ms: int, now: int, epoch: int,
         session: str | None, launch: bool = False) -> Claim | None:
    """Claim the run found claimable; the check is in the UPDATE too (None: another writer
    took it first, or the session rule no longer lets it run). A run of a session is
    claimed under the session's lock (the one ``runs.create_run`` takes), not waited for:
    held elsewhere, the run is passed over, so the one-active-run rule holds where a parked
    run is claimed again. With ``launch``, the claim carries what its worker is launched
    with (``Claim.launch``), returned by the write of the run's row when there is one."""
    if session is not None and not db.try_lock_key("session", session):
        return None
    generation = db.scalar(TAKE, (runner_id, token, now + lease_ms, epoch, now, now, run_id, now, now))
    if generation is None:
        return None
    source = None
    if not launch:
        db.execute(RUNNING, (now, run_id))
    elif (source := db.one(f"{RUNNING} RETURNING {LAUNCH}", (now, run_id))) is None:  # it was running already
        source = db.one(f"SELECT {LAUNCH} FROM runs WHERE run_id = ?", (run_id,))
        if source is None:
            raise NotFound(f"run {run_id} not found")
    claim = Claim(run_id, token, generation, now + lease_ms, None if source is None else RunLaunch(
        source[0], source[1], source[2], stored_input_hash(source[3], source[4])))
    if not claim.first:  # whatever a previous generation left running
        interrupt_attempts(db, run_id, now)
    add_event(db, run_id, "claimed", {"generation": generation, "epoch": epoch}, now)
    return claim


def renew_claim(db: Database, run_id: str, token: str, lease_ms: int, now: int) -> bool:
    with db.write():
        db.execute(
            f"""UPDATE run_queue SET claim_expires_at = ?
                WHERE run_id = ? AND claim_token = ? AND {LIVE} AND claim_expires_at > ?""",
            (now + lease_ms, run_id, token, now),
        )
        return db.changes() == 1


def renew_claims(db: Database, claims: list[tuple[str, str]], lease_ms: int, now: int) -> set[str]:
    """Renew many live claims in one transaction; returns the run ids whose claim was lost."""
    lost = set()
    with db.write():
        for run_id, token in claims:
            if not renew_claim(db, run_id, token, lease_ms, now):
                lost.add(run_id)
    return lost


def fenced_revision(db: Database, run_id: str, token: str, now: int) -> int:
    """The run's revision under its live claim, fenced (``FENCE``); ClaimLost otherwise."""
    revision = db.scalar(f"{FENCE} RETURNING (SELECT revision FROM runs r WHERE r.run_id = run_queue.run_id)",
                         (run_id, token, now))
    if revision is None:
        raise ClaimLost(f"the claim on run {run_id} is no longer live")
    fenced(db, (run_id, token, now))
    result: int = revision
    return result


def mark_running(db: Database, run_id: str, token: str, now: int) -> bool:
    """``starting → running``; False if it was running already. Fenced by the claim."""
    with db.write():
        db.execute(
            """UPDATE run_queue SET status = 'running', updated_at = ?
               WHERE run_id = ? AND claim_token = ? AND status = 'starting' AND claim_expires_at > ?""",
            (now, run_id, token, now),
        )
        if db.changes() == 1:  # the claim is live, and its row written: as the fence does
            fenced(db, (run_id, token, now))
            return True
        require_claim(db, run_id, token, now)
        return False


def park_run(db: Database, run_id: str, token: str, now: int, *,
             hold: str | None = None, detail: str | None = None, not_before: int | None = None) -> bool:
    """Release a live claim, leaving the run for the next claim (not before ``not_before``,
    ms, when given: a crash's back-off).

    With ``hold`` ('source', 'crashed') the run is not claimed again until resumed, and
    ``detail`` says why; a run paused meanwhile stays held as paused.
    """
    with db.write():
        db.execute(
            f"""UPDATE run_queue SET status = 'parked', runner_id = NULL, claim_token = NULL,
                  claim_expires_at = NULL, hold = COALESCE(hold, ?), not_before = ?, updated_at = ?
                WHERE run_id = ? AND claim_token = ? AND {LIVE}""",
            (hold, not_before, now, run_id, token),
        )
        if db.changes() != 1:
            return False
        interrupt_attempts(db, run_id, now)
        if detail is not None:
            db.execute("UPDATE runs SET status_detail = ?, updated_at = ? WHERE run_id = ?", (detail, now, run_id))
        add_event(db, run_id, "parked", {} if detail is None else {"reason": detail}, now)
        if hold is not None:  # held for a person
            ending.cascade(db, run_id, now)
        return True


def holds_token(db: Database, run_id: str, token: str) -> bool:
    """Whether the run's queue row still names the claim ``token`` (live or expired). A
    token is never given again: once this is False it stays so."""
    return db.one("SELECT 1 FROM run_queue WHERE run_id = ? AND claim_token = ?", (run_id, token)) is not None


def count_crash(db: Database, run_id: str, token: str) -> int:
    """One more crash in a row for a run still claimed with ``token``; the new count (0 when
    the claim is gone)."""
    return db.scalar("UPDATE run_queue SET crash_count = crash_count + 1 "
                     "WHERE run_id = ? AND claim_token = ? RETURNING crash_count", (run_id, token)) or 0


def complete_run(db: Database, run_id: str, token: str, output: Any, now: int) -> int:
    """Settle a run as completed; returns its new revision."""
    with db.write():
        _end_claimed(db, run_id, token, QueueStatus.DONE, now)
        inline, digest = db.put_json(output, now)
        revision = revised(db, run_id, db.scalar(
            """UPDATE runs SET status = 'completed', output_json = ?, output_hash = ?,
                 status_detail = NULL, finished_at = ?, updated_at = ?, revision = revision + 1
               WHERE run_id = ? RETURNING revision""",
            (inline, digest, now, now, run_id),
        ))
        add_event(db, run_id, "completed", {}, now)
        ending.cascade(db, run_id, now, ended=QueueStatus.DONE)
        return revision


def fail_run(db: Database, run_id: str, token: str, error: dict[str, Any], now: int) -> int:
    with db.write():
        _end_claimed(db, run_id, token, QueueStatus.FAILED, now, error)
        revision = revised(db, run_id, db.scalar(
            """UPDATE runs SET status = 'failed', error_json = ?, status_detail = NULL,
                 finished_at = ?, updated_at = ?, revision = revision + 1 WHERE run_id = ? RETURNING revision""",
            (canonical_json(error).decode(), now, now, run_id),
        ))
        add_event(db, run_id, "failed", {"error": error.get("message")}, now)
        ending.cascade(db, run_id, now, ended=QueueStatus.FAILED)
        return revision


def _end_claimed(db: Database, run_id: str, token: str, status: str, now: int,
                    error: dict[str, Any] | None = None) -> None:
    """Settle the queue row only while the claim is live: the fence is in the UPDATE."""
    if not _end_queue_row(db, run_id, status, now, error,
                          fence=(f"AND claim_token = ? AND {LIVE} AND claim_expires_at > ?", (token, now))):
        raise ClaimLost(f"the claim on run {run_id} is no longer live")


# In a write of run_queue: the run is at the revision a request expected (NULL: any; the
# CAST gives PostgreSQL the parameter's type).
AT_REVISION = ("AND (CAST(? AS BIGINT) IS NULL OR "
               "(SELECT r.revision FROM runs r WHERE r.run_id = run_queue.run_id) = ?)")


def refuse_revision(db: Database, run_id: str, expected: int | None) -> None:
    """After a write guarded by AT_REVISION changed nothing, say why if the revision is the
    reason: NotFound for an unknown run, Conflict for one not at ``expected``."""
    current = revision_of(db, run_id)
    if current is None:
        raise NotFound(f"run {run_id} not found")
    if expected is not None and expected != current:
        raise Conflict(f"run {run_id} is at revision {current}, not {expected}")


def cancel_run(db: Database, run_id: str, now: int, *, token: str | None = None, runner_id: str | None = None,
               any_claim: bool = False, expected_revision: int | None = None) -> bool:
    """Cancel a run. Without a token only runs no live claim holds can be cancelled
    (queued, parked, or claimed with the claim expired: nobody may write for them, and a
    worker still going finds its claim gone), and with ``runner_id`` also a run whose live
    claim that runner holds (whatever its token: a claim its host has committed and not yet
    taken up); with ``any_claim`` a run whose live claim any runner holds (an operator's
    cancel through any host: the claim ends with the run, so its worker's next write is
    refused, and its host stops it when it learns of it). ``expected_revision``, a
    compare-and-set on the run's revision, is checked in the same UPDATE (NotFound, Conflict)."""
    with db.write():
        unclaimed = f"status IN ('queued', 'parked') OR ({LIVE} AND claim_expires_at <= ?)"
        where, params = ((f"AND claim_token = ? AND {LIVE}", (token,)) if token
                         else (f"AND (status IN ('queued', 'parked') OR {LIVE})", ()) if any_claim
                         else (f"AND ({unclaimed} OR ({LIVE} AND runner_id = ?))", (now, runner_id)) if runner_id
                         else (f"AND ({unclaimed})", (now,)))
        fence = (f"{where} {AT_REVISION}", (*params, expected_revision, expected_revision))
        if not _end_queue_row(db, run_id, QueueStatus.CANCELLED, now, fence=fence):  # the fence is in the UPDATE
            refuse_revision(db, run_id, expected_revision)
            return False
        db.execute(
            """UPDATE runs SET status = 'cancelled', status_detail = NULL, finished_at = ?,
                 updated_at = ?, revision = revision + 1 WHERE run_id = ?""",
            (now, now, run_id),
        )
        interrupt_attempts(db, run_id, now)
        add_event(db, run_id, "cancelled", {}, now)
        ending.cascade(db, run_id, now, ended=QueueStatus.CANCELLED)
        return True


def _end_queue_row(db: Database, run_id: str, status: str, now: int, error: dict[str, Any] | None = None,
                  fence: tuple[str, tuple[Any, ...]] = ("", ())) -> bool:
    """End the queue row (where ``fence`` holds); whether it did. The caller ends the run
    and calls ``ending.cascade`` in the same transaction."""
    db.execute(
        f"""UPDATE run_queue SET status = ?, runner_id = NULL, claim_token = NULL,
              claim_expires_at = NULL, hold = NULL, error_code = ?, error_message = ?,
              finished_at = ?, updated_at = ?
            WHERE run_id = ? {fence[0]}""",
        (status, error and error.get("type"), error and str(error.get("message", ""))[:2048], now, now, run_id,
         *fence[1]),
    )
    return db.changes() == 1


def expire_claims_before(db: Database, epoch: int, now: int) -> list[str]:
    """On takeover: claims held by dead earlier epochs (``base.earlier_epoch``) are dead;
    make their runs claimable now. One UPDATE: what it returns is what it changed."""
    with db.write():
        rows = db.execute(
            f"""UPDATE run_queue SET claim_expires_at = ?
                WHERE {LIVE} AND {earlier_epoch(db, 'owner_epoch')} RETURNING run_id""",
            (now, epoch),
        ).fetchall()
        return sorted(run_id for (run_id,) in rows)
