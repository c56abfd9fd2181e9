"""Runs: creation, operator controls, node attempts, and everything read about them."""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import Any

from piwf.errors import Conflict, ConstraintViolation, NotFound, Rejected
from piwf.protocol import EVENTS_PAGE, RunEvent, RunEventsPage, RunSummary
from piwf.wire import canonical_json, decode_json, sha256_hex
from piwf.status import DEFAULT_QUEUE, ENDED, Hold, RunStatus
from piwf.store.api.rules import STEPS_PAGE_BYTES, input_hash  # noqa: F401 (re-exported)
from piwf.store.sql.database import INLINE_JSON_LIMIT, Database
from piwf.store.sql import delivery, placement
from piwf.store.sql.interactions import count_open
from piwf.store.sql.listing import count_held
from piwf.store.sql.base import (
    SUMMARY_COLUMNS, add_event, require_claim, revised, revision_of, summary_fields,
)
from piwf.store.sql.queue import AT_REVISION, refuse_revision
from piwf.store.api.types import Definition, NewScope
from piwf.store.sql.database import lifecycle_contradicts
from piwf.store.sql.database import one_of
from piwf.store.sql.settings import ensure_scope
from piwf.store.sql.timefmt import iso
from piwf.store.sql.run_detail import _read_one, get_run  # noqa: F401 (get_run re-exported)


def create_run(
    db: Database, *, run_id: str, workflow: str, project_path: str, source: bytes, digest: str,
    input: Any, origin_session_id: str | None, now: int, start_node: str | None = None,
    settings: NewScope | None = None, graph: bytes | None = None, queue: str = DEFAULT_QUEUE,
) -> dict[str, Any]:
    """A new run, queued on ``queue``, its settings scope (``settings``) and its workflow's graph
    (``graph``: canonical JSON, a blob; ``run.graph`` reads it): every run is made here.

    Several writers (PostgreSQL): the session's lock (``lock_key("session", ...)``, the one a
    claim of a parked run of the session takes) is held from the read of the session's
    active run to the commit, so two hosts accepting ``run.start`` for one session at once
    answer one run and one Rejected; the partial unique index run_queue_session_reservation
    stays the last word. Likewise the run id's lock: a second creator of one run id waits,
    then finds it taken (Rejected), before any statement fails (a failed statement aborts
    a PostgreSQL transaction, and the host records the refusal in the same one)."""
    with db.write():
        db.lock_key("run", run_id)  # two creators of one run id: the second sees the first's row
        data = canonical_json(input)
        inline, input_hash = (data.decode(), None) if len(data) <= INLINE_JSON_LIMIT else (None, sha256_hex(data))
        definition_hash, graph_hash = _digest(source), None if graph is None else _digest(graph)
        try:  # a run id taken is refused by its row's insert (no failed statement, no read before it)
            db.execute(
                """INSERT INTO runs (run_id, workflow, project_path, definition_hash,
                     definition_digest, start_node, input_json, input_hash, status, origin_session_id,
                     created_at, updated_at, graph_hash)
                   VALUES (?, ?, ?, ?, ?, ?, ?, ?, 'queued', ?, ?, ?, ?)
                   ON CONFLICT (run_id) DO NOTHING""",
                (run_id, workflow, project_path, definition_hash, digest, start_node, inline, input_hash,
                 origin_session_id, now, now, graph_hash),
            )
        except ConstraintViolation as exc:
            raise Rejected(f"run {run_id} cannot be queued: {exc}") from exc
        if db.changes() == 0:
            raise Rejected(f"run id {run_id} is already taken")
        if origin_session_id is not None:
            db.lock_key("session", origin_session_id)
            active = db.scalar(
                """SELECT run_id FROM run_queue WHERE origin_session_id = ?
                   AND status IN ('queued', 'starting', 'running')""",
                (origin_session_id,),
            )
            if active is not None:
                raise Rejected(f"session {origin_session_id} already has an active run {active}")
        # the blobs after the session's lock, as before: its holders may be storing the same ones
        db.put_blob(source, now, definition_hash)
        if graph is not None:
            db.put_blob(graph, now, graph_hash)
        if inline is None:
            db.put_blob(data, now, input_hash)
        try:
            db.execute(
                """INSERT INTO run_queue (run_id, status, origin_session_id, created_at, updated_at, queue)
                   VALUES (?, 'queued', ?, ?, ?, ?)""",
                (run_id, origin_session_id, now, now, queue),
            )
        except ConstraintViolation as exc:
            raise Rejected(f"run {run_id} cannot be queued: {exc}") from exc
        add_event(db, run_id, "created", {"workflow": workflow}, now)
        if settings is not None:
            ensure_scope(db, run_id, settings=settings.settings, mutable=settings.mutable, patch=settings.patch,
                         actor_id=settings.actor_id, now=now)
    return {"runId": run_id, "status": RunStatus.QUEUED, "revision": 1}


_DIGESTS: dict[bytes, str] = {}  # a workflow's source and graph -> sha256_hex: the same bytes at every start
DIGESTS_CACHED, DIGEST_BYTES = 64, 64 * 1024  # entries (forgotten all at once beyond), the largest kept


def _digest(data: bytes) -> str:
    """``sha256_hex(data)``, remembered for small values (a pure function of them; a bytes
    object keeps its own hash, so the same one is looked up in a few tens of ns)."""
    known = _DIGESTS.get(data)
    if known is None:
        known = sha256_hex(data)
        if len(data) <= DIGEST_BYTES:
            if len(_DIGESTS) >= DIGESTS_CACHED:
                _DIGESTS.clear()
            _DIGESTS[data] = known
    return known


def revision(db: Database, run_id: str) -> int:
    value = revision_of(db, run_id)
    if value is None:
        raise NotFound(f"run {run_id} not found")
    return value


def check_revision(db: Database, run_id: str, expected: int | None) -> int:
    """The run's revision, if it is ``expected`` (None: any): a compare-and-set guard checked
    by a write of the run's queue row that changes nothing (``AT_REVISION``), so what it
    checked holds for the rest of the unit of work however many writers there are."""
    with db.write():
        current: int | None = db.scalar(
            f"""UPDATE run_queue SET claim_token = claim_token WHERE run_id = ? {AT_REVISION}
                RETURNING (SELECT r.revision FROM runs r WHERE r.run_id = run_queue.run_id)""",
            (run_id, expected, expected))
        if current is None:
            refuse_revision(db, run_id, expected)  # NotFound or Conflict
            raise Conflict(f"run {run_id} changed meanwhile; try again")
        return current


# The guard of an operator's hold change: a write of the run's queue row that changes
# nothing, taken only while the run has not ended and is at the revision the request
# expected (and whatever ``extra`` adds). Being a write, what it checked holds for the rest
# of the transaction however many writers there are.
HOLD_GUARD = f"""UPDATE run_queue SET claim_token = claim_token
  WHERE run_id = ? AND status NOT IN ({one_of(sorted(ENDED))}) {AT_REVISION}"""


def _guard_hold(db: Database, run_id: str, expected: int | None, extra: str = "",
                params: tuple[Any, ...] = ()) -> str | None:
    """The run's queue status if the guard (HOLD_GUARD) holds, else None."""
    result: str | None = db.scalar(f"{HOLD_GUARD} {extra} RETURNING status", (run_id, expected, expected, *params))
    return result


def _refuse_hold(db: Database, run_id: str, expected: int | None) -> None:
    """Why the guard did not hold, if the run is unknown (NotFound), at another revision
    (Conflict) or ended (Rejected), in that order."""
    refuse_revision(db, run_id, expected)
    queue_status = _queue_status(db, run_id)
    if queue_status in ENDED:
        raise Rejected(f"run {run_id} has already ended ({queue_status})")


def pause_run(db: Database, run_id: str, now: int, *, expected_revision: int | None = None) -> dict[str, Any]:
    """Hold a run: it is not claimed again, and an active worker stops at the next node boundary.
    ``expected_revision`` is a compare-and-set on the run's revision, checked by the write.

    Pause and resume change operator flags, not engine state, so the run revision (which
    fences the worker's writes) stays as it is.
    """
    with db.write():
        queue_status = _guard_hold(db, run_id, expected_revision)
        if queue_status is None:
            _refuse_hold(db, run_id, expected_revision)
            raise Conflict(f"run {run_id} changed while it was paused; try again")
        db.execute("UPDATE run_queue SET hold = COALESCE(hold, 'paused'), updated_at = ? WHERE run_id = ?",
                   (now, run_id))
        return _set_paused(db, run_id, True, queue_status, now)


def _set_paused(db: Database, run_id: str, paused: bool, queue_status: str, now: int) -> dict[str, Any]:
    """The run's paused flag and status detail (a waiting run keeps saying what it waits
    for), its event, and the receipt of a pause or resume."""
    db.execute("UPDATE runs SET paused = ?, status_detail = CASE WHEN status = 'waiting' THEN status_detail "
               "ELSE ? END, updated_at = ? WHERE run_id = ?", (int(paused), "paused" if paused else None, now, run_id))
    add_event(db, run_id, "paused" if paused else "resumed", {}, now)
    return {"runId": run_id, "paused": paused, "queueStatus": queue_status}


def hold_of(db: Database, run_id: str) -> str | None:
    result: str | None = db.scalar("SELECT hold FROM run_queue WHERE run_id = ?", (run_id,))
    return result


def resume_run(db: Database, run_id: str, now: int, *, definition: Definition | None = None,
               expected_revision: int | None = None) -> dict[str, Any]:
    """Release a held run. ``definition`` (digest, source, start node, graph) replaces the run's
    workflow definition: resuming a run held because its workflow changed adopts the new
    one, only while it is held so (Conflict otherwise). ``expected_revision`` is a
    compare-and-set on the run's revision. Both are checked by the write."""
    with db.write():
        params: tuple[Any, ...]
        extra, params = "AND hold IS DISTINCT FROM ?", (Hold.EFFECT,)
        if definition is not None:
            extra, params = f"{extra} AND hold = ?", (*params, Hold.SOURCE)
        queue_status = _guard_hold(db, run_id, expected_revision, extra, params)
        if queue_status is None:
            _refuse_hold(db, run_id, expected_revision)
            if hold_of(db, run_id) == Hold.EFFECT:
                raise Rejected(f"run {run_id} is held for an ambiguous effect; "
                               "say what happened with piwf run resolve-effect")
            raise Conflict(f"run {run_id} is no longer held because its workflow changed "
                           "(resumed meanwhile); look at it again")
        if definition is not None:
            adopt_definition(db, run_id, definition, now)
        placement.forget_run(db, run_id)  # every host may try it again
        # a waiting run stays held for its answer
        db.execute("UPDATE run_queue SET hold = NULL, crash_count = 0, not_before = NULL, updated_at = ? "
                   "WHERE run_id = ? AND hold IS DISTINCT FROM 'waiting'", (now, run_id))
        return _set_paused(db, run_id, False, queue_status, now)


def adopt_definition(db: Database, run_id: str, definition: Definition | tuple[str, bytes, str | None],
                     now: int) -> None:
    """The run goes on with ``definition``: its digest, source, start node and graph (a
    definition without a graph leaves the run's graph unknown rather than the old one's)."""
    digest, source, start_node, graph = Definition(*definition)
    db.execute("UPDATE runs SET definition_digest = ?, definition_hash = ?, start_node = ?, graph_hash = ? "
               "WHERE run_id = ?", (digest, db.put_blob(source, now), start_node,
                                    None if graph is None else db.put_blob(graph, now), run_id))


def is_paused(db: Database, run_id: str) -> bool:
    return bool(db.scalar("SELECT paused FROM runs WHERE run_id = ?", (run_id,)))


def _queue_status(db: Database, run_id: str) -> str:
    status = db.scalar("SELECT status FROM run_queue WHERE run_id = ?", (run_id,))
    if status is None:
        raise NotFound(f"run {run_id} not found")
    result: str = status
    return result


# --- node attempts (written on behalf of a claim) ---------------------------------------


def start_attempt(
    db: Database, run_id: str, token: str, *, seq: int, node: str, generation: int, now: int
) -> tuple[str, int]:
    """Start a node's attempt; (its id, the run's new revision)."""
    attempt_id, revision, _ = begin_attempt(db, run_id, token, seq=seq, node=node, generation=generation, now=now)
    return attempt_id, revision


def begin_attempt(
    db: Database, run_id: str, token: str, *, seq: int, node: str, generation: int, now: int
) -> tuple[str, int, int | None]:
    """``start_attempt``, and the settings change the attempt started under (None: its run
    has no settings, so ``settings.attempt_settings`` would find none), from its insert."""
    with db.write():
        require_claim(db, run_id, token, now)
        attempt_id = secrets.token_hex(8)
        change: int | None = db.scalar(
            """INSERT INTO node_attempts (attempt_id, run_id, seq, node_id, generation, status, started_at,
                 settings_change)
               VALUES (?, ?, ?, ?, ?, 'running', ?,
                 (SELECT change_number FROM settings_scopes WHERE run_id = ? AND mount_path = ''))
               RETURNING settings_change""",
            (attempt_id, run_id, seq, node, generation, now, run_id),
        )
        add_event(db, run_id, "attempt.started", {"node": node, "seq": seq, "attemptId": attempt_id}, now)
        return attempt_id, _bump(db, run_id, now), change


def accept_attempt(
    db: Database, run_id: str, token: str, *, attempt_id: str, output: Any, exit_name: str | None, now: int,
    waiting: bool = False,
) -> int:
    """Accept a running attempt's output (``waiting``: a waiting attempt's, whose
    request's submission was validated as ``output``)."""
    with db.write():
        require_claim(db, run_id, token, now)
        inline, digest = db.put_json(output, now)
        node = db.scalar(
            """UPDATE node_attempts SET status = 'accepted', output_json = ?, output_hash = ?,
                 exit_name = ?, finished_at = ?
               WHERE attempt_id = ? AND run_id = ? AND status = ? RETURNING node_id""",
            (inline, digest, exit_name, now, attempt_id, run_id, "waiting" if waiting else "running"),
        )
        if node is None:
            raise Rejected(f"attempt {attempt_id} is not {'waiting' if waiting else 'running'}")
        add_event(db, run_id, "attempt.accepted", {"node": node, "attemptId": attempt_id, "exit": exit_name}, now)
        return _bump(db, run_id, now)


def fail_attempt(db: Database, run_id: str, token: str, *, attempt_id: str, error: dict[str, Any], now: int) -> int:
    with db.write():
        require_claim(db, run_id, token, now)
        db.execute(
            """UPDATE node_attempts SET status = 'failed', error_json = ?, finished_at = ?
               WHERE attempt_id = ? AND run_id = ? AND status = 'running'""",
            (canonical_json(error).decode(), now, attempt_id, run_id),
        )
        if db.changes() != 1:
            raise Rejected(f"attempt {attempt_id} is not running")
        add_event(db, run_id, "attempt.failed", {"attemptId": attempt_id, "error": error.get("message")}, now)
        return _bump(db, run_id, now)


def _bump(db: Database, run_id: str, now: int) -> int:
    result: int = db.scalar(
        "UPDATE runs SET revision = revision + 1, updated_at = ? WHERE run_id = ? RETURNING revision", (now, run_id))
    return revised(db, run_id, result)




def accepted_steps(db: Database, run_id: str, after_seq: int = -1,
                   budget: int | None = None) -> tuple[list[dict[str, Any]], bool]:
    """Accepted steps after ``after_seq``, in order, whose outputs add up to at most
    ``budget`` bytes (always at least one); and whether more remain."""
    rows = db.execute(
        """SELECT seq, node_id, exit_name, output_json, output_hash,
             COALESCE(length(output_json), (SELECT length(content) FROM blobs WHERE hash = output_hash), 0)
           FROM node_attempts WHERE run_id = ? AND status = 'accepted' AND seq > ? ORDER BY seq""",
        (run_id, after_seq),
    )
    steps: list[dict[str, Any]] = []
    used = 0
    for seq, node, exit_name, inline, digest, size in rows:
        if budget is not None and steps and used + size > budget:
            return steps, True
        used += size
        steps.append({"seq": seq, "node": node, "exit": exit_name, "output": db.get_json(inline, digest)})
    return steps, False


# --- reads -------------------------------------------------------------------------------

def run_summary(db: Database, run_id: str) -> RunSummary:
    """The status fields of one run, without its input, output or steps."""
    return RunSummary(*summary_fields(_read_one(db, run_id)[:SUMMARY_COLUMNS]))


def run_source(db: Database, run_id: str) -> tuple[str, str, str, Any, str | None]:
    """(workflow, project path, digest, input, origin session) for launching a worker."""
    row = db.one(
        """SELECT workflow, project_path, definition_digest, input_json, input_hash, origin_session_id
           FROM runs WHERE run_id = ?""",
        (run_id,),
    )
    if row is None:
        raise NotFound(f"run {run_id} not found")
    workflow, project, digest, inline, digest_input, session = row
    return workflow, project, digest, db.get_json(inline, digest_input), session


def ready_state(db: Database, run_id: str) -> tuple[Any, str | None, bool, str]:
    """(input, start node, paused, definition digest) for a worker reporting ready, from one
    read of the run. The start node is the one its workflow named when the run was created."""
    row = db.one("SELECT input_json, input_hash, start_node, paused, definition_digest FROM runs WHERE run_id = ?",
                 (run_id,))
    if row is None:
        raise NotFound(f"run {run_id} not found")
    inline, digest, start, paused, definition = row
    return db.get_json(inline, digest), start, bool(paused), definition


def run_events(db: Database, run_id: str, after: int = 0, limit: int = EVENTS_PAGE) -> RunEventsPage:
    """Events after ``after``, at most ``limit``; ``nextAfter`` set when more remain."""
    with db.read():
        revision(db, run_id)  # NotFound for an unknown run
        rows = db.execute(
            """SELECT event_id, at, type, payload_json FROM run_events
               WHERE run_id = ? AND event_id > ? ORDER BY event_id LIMIT ?""",
            (run_id, after, limit + 1),
        ).fetchall()
    events = [RunEvent(event_id, iso(at), kind, **decode_json(payload.encode()))
              for event_id, at, kind, payload in rows[:limit]]
    return RunEventsPage(events=events, nextAfter=events[-1].eventId if len(rows) > limit else None)


# Every run whose engine and queue statuses do not go together, counted the slow way: what
# the maintained ('lifecycle', 'contradictions') count must always equal.
LIFECYCLE_CONTRADICTIONS = f"""SELECT COUNT(*) FROM runs r JOIN run_queue q ON q.run_id = r.run_id
WHERE {lifecycle_contradicts('r.status', 'q.status', 'FALSE')}"""


def status_counts(db: Database, now: int) -> dict[str, int]:
    """Run counts for host.status, from one snapshot. On SQLite they cost the same however
    many runs have ever been stored: the counts are kept as runs change (layout 4,
    RUN_COUNTS_SQL), and expired claims are found through run_queue's (status,
    claim_expires_at) index. PostgreSQL keeps no such rows (every change would update one of
    a few hot rows, and hosts would serialise on them): it counts from its indexes."""
    if db.dialect != "sqlite":
        return _counted_from_indexes(db, now)
    with db.read():
        counts = {(scope, value): n for scope, value, n in db.execute("SELECT scope, value, n FROM run_counts")}
        expired = db.scalar(
            """SELECT COUNT(*) FROM run_queue INDEXED BY run_queue_claimable
               WHERE status IN ('starting', 'running') AND claim_expires_at <= ?""", (now,))
        _needing_someone(db, counts)
    return _status_fields(counts.get, int(expired))


# PostgreSQL: the contradictions among the runs not yet ended on either side (an ended
# pair would need a scan of every run; the statements that end runs end both together).
UNENDED_CONTRADICTIONS = f"""SELECT COUNT(*) FROM run_queue q JOIN runs r ON r.run_id = q.run_id
WHERE q.status IN ('queued', 'starting', 'running', 'parked')
  AND {lifecycle_contradicts('r.status', 'q.status', 'FALSE')}"""


def _counted_from_indexes(db: Database, now: int) -> dict[str, int]:
    """status_counts on PostgreSQL, which keeps no run_counts rows: the runs not yet ended
    counted through small partial indexes, the ended ones summed from ``run_ends`` (64
    shards per status, kept by a trigger). Cost: the active runs, not all runs."""
    with db.read():
        counts = {("run_queue.status", s): n for s, n in db.execute(
            "SELECT status, COUNT(*) FROM run_queue WHERE status IN ('queued', 'starting', 'running', 'parked') "
            "GROUP BY status")}
        counts |= {("runs.status", s): n for s, n in db.execute(
            "SELECT status, COUNT(*) FROM runs WHERE status IN ('queued', 'running', 'waiting') GROUP BY status")}
        counts |= {("runs.status", s): int(n) for s, n in db.execute(
            "SELECT status, SUM(n) FROM run_ends GROUP BY status")}
        counts[("runs.paused", "paused")] = db.scalar("SELECT COUNT(*) FROM runs WHERE paused != 0")
        counts[("lifecycle", "contradictions")] = db.scalar(UNENDED_CONTRADICTIONS)
        expired = db.scalar("""SELECT COUNT(*) FROM run_queue WHERE status IN ('starting', 'running')
                               AND claim_expires_at <= ?""", (now,))
        _needing_someone(db, counts)
    return _status_fields(counts.get, int(expired))


def _needing_someone(db: Database, counts: dict[tuple[str, str], int]) -> None:
    """The counts every backend reads the same way, from small indexes: held runs, open
    requests, ambiguous effects, what waits for delivery."""
    counts[("runs", "held")] = count_held(db)
    counts[("interactions", "open")] = count_open(db)
    counts[("effects", "ambiguous")] = db.scalar(AMBIGUOUS_EFFECTS)
    _delivery_counts(db, counts)


def recounted(db: Database, now: int) -> dict[str, int]:
    """status_counts counted from every run (slow; for checking the maintained counts)."""
    with db.read():
        counts = {("runs.status", s): n for s, n in db.execute("SELECT status, COUNT(*) FROM runs GROUP BY status")}
        counts |= {("run_queue.status", s): n
                   for s, n in db.execute("SELECT status, COUNT(*) FROM run_queue GROUP BY status")}
        counts[("runs.paused", "paused")] = db.scalar("SELECT COUNT(*) FROM runs WHERE paused != 0")
        counts[("lifecycle", "contradictions")] = db.scalar(LIFECYCLE_CONTRADICTIONS)
        expired = db.scalar("""SELECT COUNT(*) FROM run_queue WHERE status IN ('starting', 'running')
                               AND claim_expires_at <= ?""", (now,))
        _needing_someone(db, counts)
    return _status_fields(counts.get, int(expired))


# Effects whose outcome nobody knows, each holding its run for an operator (layout 11's
# partial index effects_ambiguous finds them without reading the others).
AMBIGUOUS_EFFECTS = "SELECT COUNT(*) FROM effects WHERE status = 'ambiguous'"


def _delivery_counts(db: Database, counts: dict[tuple[str, str], int]) -> None:
    """Notifications and turns (layout 7), but 0 for an older layout read as it is
    (``piwf status`` with no host, before a newer piwf has migrated the database)."""
    if db.dialect == "sqlite" and db.scalar("PRAGMA user_version") < DELIVERY_LAYOUT:
        return
    counts[("notifications", "undelivered")] = delivery.count_undelivered(db)
    counts[("turns", "unresolved")] = delivery.count_unresolved(db)


DELIVERY_LAYOUT = 7


def _status_fields(count: Callable[[tuple[str, str]], int | None], expired: int) -> dict[str, int]:
    def total(scope: str, *values: str) -> int:
        return sum(count((scope, value)) or 0 for value in values)

    return {
        "queuedRuns": total("run_queue.status", "queued"),
        "runningRuns": total("run_queue.status", "starting", "running"),
        "parkedRuns": total("run_queue.status", "parked"),
        "waitingRuns": total("runs.status", "waiting"),
        "pausedRuns": total("runs.paused", "paused"),
        "heldRuns": total("runs", "held"),
        "completedRuns": total("runs.status", "completed"),
        "failedRuns": total("runs.status", "failed", "timed_out"),
        "cancelledRuns": total("runs.status", "cancelled"),
        "expiredClaims": expired,
        "pendingInteractions": total("interactions", "open"),
        "ambiguousEffects": total("effects", "ambiguous"),
        "undeliveredNotifications": total("notifications", "undelivered"),
        "unresolvedTurns": total("turns", "unresolved"),
        "lifecycleContradictions": total("lifecycle", "contradictions"),
    }
