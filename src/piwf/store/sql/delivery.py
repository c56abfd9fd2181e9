"""Delivery to sessions (DESIGN.md §8): notifications, turns and follow-ups.

A run's origin session hears from it at least once, under short delivery claims: a
client claims the session's oldest undelivered notification (or unresolved turn), shows
it, and delivers (resolves) it with the claim's id before the claim expires; a client
that crashes in between leaves the claim to expire, and the next claim gets the same one
again. Claims go strictly in order per session: while the oldest is claimed by someone
else, a claim gets nothing.

A turn is written in the same transaction as its run's end or hold (``turn_for_run``,
called by the store operations that end or hold a run), so a crash never leaves an ended
run without its turn, nor writes two. At most one unresolved turn per (run, session): a
later end of the same run rewrites it, and a rewrite ends any claim on it (the client
showing the old facts gets a ``conflict`` when it resolves, and the turn is claimed
again with the new ones), so an end is never lost behind a claim of an earlier one.

Under several writers (PostgreSQL) a session's stream is one transaction at a time: every
write that adds a notification or turn, makes a turn eligible, claims or resolves one
takes the session's delivery lock first (``locks.lock_delivery``, after the run's lock
when it has one). So ``rowid`` (given at insert) is the order rows committed in, and a
claim reads the session's oldest as of now: claims go strictly in order per session, on
both backends. A delivery or a resolve is a compare-and-set on the claim in its UPDATE.
"""

from __future__ import annotations

import hashlib
import secrets
from typing import Any

import msgspec

from piwf.errors import Conflict, NotFound, Rejected
from piwf.protocol import (
    CONTENT_LIMIT, DeliverReceipt, FollowUp, FollowUpPage, FollowUpReceipt, Notification, NotificationClaim,
    QueuedFollowUp, ResolveTurnReceipt, Turn, TurnClaim, TurnFacts,
)
from piwf.status import ENDED, FollowUpState, Hold, NotificationKind, RunStatus, TurnCause, TurnResolution
from piwf.wire import canonical_json, decode_json
from piwf.store.sql.database import Database, atomic
from piwf.store.sql.base import add_event, require_claim
from piwf.store.sql.locks import lock_delivery, lock_run
from piwf.store.sql.timefmt import iso

FACT_LIMIT = 4096  # each text fact (error, output, detail), in characters
ENDS = {RunStatus.COMPLETED: TurnCause.COMPLETED, RunStatus.FAILED: TurnCause.FAILED,
        RunStatus.TIMED_OUT: TurnCause.TIMED_OUT, RunStatus.CANCELLED: TurnCause.CANCELLED}
HELD_FOR_A_PERSON = frozenset({Hold.CRASHED, Hold.EFFECT, Hold.SOURCE})


def check_content(text: str, what: str) -> str:
    """Content a session is sent: not blank, at most 64 KiB as UTF-8; kept as given."""
    if not text.strip():
        raise Rejected(f"{what} is blank")
    size = len(text.encode())
    if size > CONTENT_LIMIT:
        raise Rejected(f"{what} is {size} bytes; the limit is {CONTENT_LIMIT}")
    return text


def _held_by_another(expires: int | None, holder: str | None, client_id: str, now: int) -> bool:
    """A live claim of another client. A client claiming again what it holds (it lost the
    answer, or restarted) gets a new claim, which supersedes its old one."""
    return expires is not None and expires > now and holder != client_id


# _held_by_another's negation, in an UPDATE: the claim is taken only while no other client holds it.
NOT_HELD = "(claim_expires_at IS NULL OR claim_expires_at <= ? OR claim_client = ?)"


def _new_claim_id() -> str:
    return "claim-" + secrets.token_hex(12)


def _running_attempt(db: Database, run_id: str, attempt_id: str) -> tuple[int, str]:
    row = db.one("SELECT seq, node_id FROM node_attempts WHERE attempt_id = ? AND run_id = ? AND status = 'running'",
                 (attempt_id, run_id))
    if row is None:
        raise Rejected(f"attempt {attempt_id} is not running: only the live attempt may do this")
    result: tuple[int, str] = row
    return result


def _session(db: Database, run_id: str) -> str | None:
    result: str | None = db.scalar("SELECT origin_session_id FROM runs WHERE run_id = ?", (run_id,))
    return result


# --- notifications ------------------------------------------------------------------------


@atomic
def notify(db: Database, run_id: str, token: str, *, attempt_id: str, index: int, kind: NotificationKind,
           content: str, now: int) -> str | None:
    """Store a notification for the run's origin session (inside the worker message's
    transaction): the ``index``-th call of the attempt with this ``kind`` and ``content``.
    Idempotent per (run, step, kind, content, index): a retried node notifying again finds
    the copy an earlier attempt stored, whatever order its threads call in (a text it had
    not sent is new). Stored ones are numbered 1, 2, ... per step in the order stored.
    None for a detached run (nobody hears)."""
    require_claim(db, run_id, token, now)
    seq, node = _running_attempt(db, run_id, attempt_id)
    check_content(content, "a notification")
    session = _session(db, run_id)
    if session is None:
        return None
    lock_delivery(db, session)  # the run's notifications are stored one at a time
    stored = db.one("""SELECT notification_id FROM notifications WHERE run_id = ? AND seq = ? AND kind = ?
                         AND content = ? ORDER BY notification_index LIMIT 1 OFFSET ?""",
                    (run_id, seq, kind, content, index - 1))
    if stored is not None:
        return str(stored[0])
    number = db.scalar("SELECT COALESCE(MAX(notification_index), 0) + 1 FROM notifications WHERE run_id = ? "
                       "AND seq = ?", (run_id, seq))
    index = int(number)
    notification_id = "ntf-" + hashlib.sha256(f"{run_id}/{seq}/{index}".encode()).hexdigest()[:20]
    db.execute(
        """INSERT INTO notifications (notification_id, run_id, seq, node_id, notification_index, session_id, kind,
             content, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING""",
        (notification_id, run_id, seq, node, index, session, kind, content, now))
    if db.changes():
        add_event(db, run_id, "notification", {"notificationId": notification_id, "kind": kind,
                                                     "index": index}, now)
    return notification_id


NOTIFICATION_COLUMNS = """n.notification_id, n.run_id, r.workflow, n.node_id, n.notification_index, n.session_id,
  n.kind, n.content, n.created_at, n.claim_expires_at, n.delivered_at"""


def _notification(row: tuple[Any, ...], now: int) -> Notification:
    (notification_id, run_id, workflow, node, index, session, kind, content, created, expires, delivered) = row
    live = expires if expires is not None and expires > now and delivered is None else None
    return Notification(notificationId=notification_id, runId=run_id, workflow=workflow, nodeId=node, index=index,
                        sessionId=session, kind=kind, content=content, createdAt=iso(created) or "",
                        claimExpiresAt=iso(live), deliveredAt=iso(delivered))


def claim_notification(db: Database, *, session_id: str, client_id: str, lease_ms: int,
                       now: int) -> NotificationClaim:
    """The session's oldest undelivered notification, claimed for ``lease_ms``; nothing
    while it is claimed by someone else."""
    with db.write():
        lock_delivery(db, session_id)
        row = db.one(f"""SELECT {NOTIFICATION_COLUMNS}, n.claim_client FROM notifications n
                         INDEXED BY notifications_undelivered JOIN runs r ON r.run_id = n.run_id
                         WHERE n.session_id = ? AND n.delivered_at IS NULL ORDER BY n.rowid LIMIT 1""",
                     (session_id,))
        if row is None or _held_by_another(row[9], row[11], client_id, now):
            return NotificationClaim(claimId=None, notification=None)
        claim_id = _new_claim_id()
        db.execute(f"""UPDATE notifications SET claim_token = ?, claim_client = ?, claim_expires_at = ?
                       WHERE notification_id = ? AND delivered_at IS NULL AND {NOT_HELD}""",
                   (claim_id, client_id, now + lease_ms, row[0], now, client_id))
        if db.changes() != 1:  # the check is in the write: another client claimed it first
            return NotificationClaim(claimId=None, notification=None)
        return NotificationClaim(claimId=claim_id, notification=_notification((*row[:9], now + lease_ms, None), now))


def deliver_notification(db: Database, *, notification_id: str, claim_id: str, client_id: str,
                         now: int) -> DeliverReceipt:
    """Delivered, under a live claim this client holds; anything else is a ``conflict``."""
    with db.write():  # the claim's check is in the UPDATE (a compare-and-set on the claim)
        db.execute("""UPDATE notifications SET delivered_at = ?, claim_token = NULL, claim_client = NULL,
                        claim_expires_at = NULL
                      WHERE notification_id = ? AND delivered_at IS NULL AND claim_token = ? AND claim_client = ?
                        AND claim_expires_at > ?""", (now, notification_id, claim_id, client_id, now))
        if db.changes() != 1:
            if db.one("SELECT 1 FROM notifications WHERE notification_id = ?", (notification_id,)) is None:
                raise NotFound(f"notification {notification_id} not found")
            raise Conflict(f"the delivery claim {claim_id} on notification {notification_id} is stale "
                           "(expired, superseded, another client's, or already delivered)")
        return DeliverReceipt(notificationId=notification_id, delivered=True)


def list_notifications(db: Database, *, session_id: str | None, run_id: str | None, limit: int,
                       now: int) -> list[Notification]:
    where, params = _filters(session_id, run_id, "n")
    rows = db.execute(f"""SELECT {NOTIFICATION_COLUMNS} FROM notifications n JOIN runs r ON r.run_id = n.run_id
                          WHERE n.delivered_at IS NULL {where} ORDER BY n.rowid LIMIT ?""",
                      (*params, limit)).fetchall()
    return [_notification(row, now) for row in rows]


def _filters(session_id: str | None, run_id: str | None, alias: str) -> tuple[str, tuple[str, ...]]:
    params: tuple[str, ...]
    where, params = "", ()
    if session_id is not None:
        where, params = f"AND {alias}.session_id = ?", (session_id,)
    if run_id is not None:
        where, params = f"{where} AND {alias}.run_id = ?", (*params, run_id)
    return where, params


def count_undelivered(db: Database) -> int:
    result: int = db.scalar("SELECT COUNT(*) FROM notifications WHERE delivered_at IS NULL")
    return result


# --- turns ----------------------------------------------------------------------------------


def turn_for_run(db: Database, run_id: str, now: int) -> str | None:
    """Call in the transaction that ended or held the run: its session's turn, written or
    (while one is unresolved) rewritten with the cause and facts of now. None when the run
    has no origin session or is not ended or held for a person."""
    # CAST: a bare parameter (carried over to run_queue by the join) made SQLite prepare the
    # read again at each execution, for run_queue's partial indexes: 9.3 µs against 5.6.
    row = db.one("""SELECT r.status, r.origin_session_id, q.hold FROM runs r JOIN run_queue q ON q.run_id = r.run_id
                    WHERE r.run_id = CAST(? AS TEXT)""", (run_id,))
    if row is None or row[1] is None:
        return None
    status, session, hold = row
    cause = ENDS.get(status) or (TurnCause.HELD if hold in HELD_FOR_A_PERSON else None)
    if cause is None:
        return None
    lock_delivery(db, session)
    return _write_turn(db, run_id, session, cause, now, eligible=True)


@atomic
def request_presentation(db: Database, run_id: str, token: str, *, instructions: str, now: int) -> str | None:
    """``ctx.present``: the run's turn carries ``instructions`` when the run completes (the
    turn waits, not eligible, until the run ends). None for a detached run."""
    require_claim(db, run_id, token, now)
    check_content(instructions, "presentation instructions")
    session = _session(db, run_id)
    if session is None:
        return None
    lock_delivery(db, session)
    turn_id = _write_turn(db, run_id, session, TurnCause.REQUESTED, now, eligible=False)
    db.execute("UPDATE turns SET instructions = ? WHERE turn_id = ?", (instructions, turn_id))
    return turn_id


# What an end of a run reads of its turns inside its write transaction: by index turns_run
# (or turns_unresolved), never a scan of every turn kept (tests check the plans).
OPEN_TURN_SQL = "SELECT turn_id, cause FROM turns WHERE run_id = ? AND session_id = ? AND resolved_at IS NULL"
TURNS_OF_RUN_SQL = "SELECT COUNT(*) FROM turns WHERE run_id = ? AND session_id = ?"
# A session's latest eligible turn still unresolved (by index turns_eligible): a turn made
# eligible after it (under the session's delivery lock) is not dated before it, whatever
# the clock of the host that writes it says (another host's, or one stepped back).
LATEST_ELIGIBLE_SQL = "SELECT MAX(eligible_at) FROM turns WHERE session_id = ? AND resolved_at IS NULL"
LAST_INSTRUCTIONS_SQL = ("SELECT instructions FROM turns WHERE run_id = ? AND instructions IS NOT NULL "
                         "ORDER BY rowid DESC LIMIT 1")


def _write_turn(db: Database, run_id: str, session: str, cause: TurnCause, now: int, *, eligible: bool) -> str:
    facts = canonical_json(_facts(db, run_id)).decode()
    # never before the session's latest: claims follow the order turns became eligible in
    since = max(now, db.scalar(LATEST_ELIGIBLE_SQL, (session,)) or 0) if eligible else None
    existing = db.one(OPEN_TURN_SQL, (run_id, session))
    if existing is not None:
        turn_id = existing[0]
        kept = existing[1] if cause is TurnCause.REQUESTED else cause  # a request does not undo an end
        # What a claim handed out is no longer what the turn says: the claim ends (its
        # resolve is a conflict) and the turn, with its follow-ups, is claimed afresh.
        db.execute("""UPDATE turns SET cause = ?, facts_json = ?, updated_at = ?,
                        eligible_at = CASE WHEN ? THEN COALESCE(eligible_at, ?) ELSE eligible_at END,
                        claim_token = NULL, claim_client = NULL, claim_expires_at = NULL, followups_through = NULL
                      WHERE turn_id = ?""", (kept, facts, now, eligible, since, turn_id))
    else:
        n = db.scalar(TURNS_OF_RUN_SQL, (run_id, session))
        turn_id = "turn-" + hashlib.sha256(f"{run_id}/{session}/{n}".encode()).hexdigest()[:20]
        db.execute(f"""INSERT INTO turns (turn_id, run_id, session_id, workflow, cause, facts_json, instructions,
                        eligible_at, created_at, updated_at)
                      VALUES (?, ?, ?, (SELECT workflow FROM runs WHERE run_id = ?), ?, ?,
                        ({LAST_INSTRUCTIONS_SQL}), ?, ?, ?)""",
                   (turn_id, run_id, session, run_id, cause, facts, run_id, since, now, now))
    if eligible:
        add_event(db, run_id, "turn", {"turnId": turn_id, "cause": cause}, now)
    result: str = turn_id
    return result


def _facts(db: Database, run_id: str) -> TurnFacts:
    workflow, status, error_json, output_json, output_hash, detail, hold = db.one(
        """SELECT r.workflow, r.status, r.error_json, r.output_json, r.output_hash, r.status_detail, q.hold
           FROM runs r JOIN run_queue q ON q.run_id = r.run_id WHERE r.run_id = ?""", (run_id,))
    error = None if error_json is None else decode_json(error_json.encode()).get("message")
    output = None
    if status == RunStatus.COMPLETED:
        output = canonical_json(db.get_json(output_json, output_hash)).decode()[:FACT_LIMIT]
    return TurnFacts(workflow=workflow, status=status, error=None if error is None else str(error)[:FACT_LIMIT],
                     output=output, hold=hold if hold in HELD_FOR_A_PERSON else None,
                     detail=None if detail is None else detail[:FACT_LIMIT])


TURN_COLUMNS = """t.turn_id, t.run_id, t.workflow, t.session_id, t.cause, t.facts_json, t.instructions, t.eligible_at,
  t.claim_expires_at, t.resolution, t.created_at, t.updated_at, t.followups_through"""


def _turn(db: Database, row: tuple[Any, ...], now: int, through: int | None = None) -> Turn:
    (turn_id, run_id, workflow, session, cause, facts, instructions, eligible, expires, resolution, created,
     updated, stored_through) = row
    through = stored_through if through is None else through
    followups = [] if through is None else _followups(db, run_id, through)
    return Turn(turnId=turn_id, runId=run_id, workflow=workflow, sessionId=session, cause=cause,
                facts=msgspec.json.decode(facts, type=TurnFacts),
                instructions=instructions if cause == TurnCause.COMPLETED else None, followUps=followups,
                eligibleAt=iso(eligible), claimExpiresAt=iso(expires if (expires or 0) > now else None),
                resolution=resolution, createdAt=iso(created) or "", updatedAt=iso(updated) or "")


def claim_turn(db: Database, *, session_id: str, client_id: str, lease_ms: int, now: int) -> TurnClaim:
    """The session's oldest unresolved eligible turn, claimed for ``lease_ms``, with its
    run's queued follow-ups (those it is resolved with); nothing while it is claimed by
    someone else or its run has notifications not yet delivered."""
    with db.write():
        lock_delivery(db, session_id)
        row = db.one(f"""SELECT {TURN_COLUMNS}, t.claim_client FROM turns t INDEXED BY turns_eligible
                         WHERE t.session_id = ? AND t.resolved_at IS NULL AND t.eligible_at IS NOT NULL
                         ORDER BY t.eligible_at, t.rowid LIMIT 1""", (session_id,))
        if row is None or _held_by_another(row[8], row[13], client_id, now) or _undelivered(db, row[1], session_id):
            return TurnClaim(claimId=None, turn=None)
        claim_id = _new_claim_id()
        through = db.scalar("SELECT COALESCE(MAX(position), 0) FROM followups WHERE run_id = ? AND state = 'queued'",
                            (row[1],))
        db.execute(f"""UPDATE turns SET claim_token = ?, claim_client = ?, claim_expires_at = ?, followups_through = ?
                       WHERE turn_id = ? AND resolved_at IS NULL AND {NOT_HELD}""",
                   (claim_id, client_id, now + lease_ms, through, row[0], now, client_id))
        if db.changes() != 1:  # the check is in the write: another client claimed it first
            return TurnClaim(claimId=None, turn=None)
        return TurnClaim(claimId=claim_id, turn=_turn(db, (*row[:8], now + lease_ms, *row[9:12], through), now))


def _undelivered(db: Database, run_id: str, session_id: str) -> bool:
    """A run's turn comes after its notifications: it waits while one is undelivered."""
    return db.one("""SELECT 1 FROM notifications INDEXED BY notifications_undelivered
                     WHERE session_id = ? AND run_id = ? AND delivered_at IS NULL LIMIT 1""",
                  (session_id, run_id)) is not None


def resolve_turn(db: Database, *, turn_id: str, claim_id: str, client_id: str, resolution: TurnResolution,
                 now: int) -> ResolveTurnReceipt:
    """Resolved under a live claim this client holds (anything else is a ``conflict``); the
    follow-ups the claim handed over are delivered with it."""
    with db.write():  # the claim's check is in the UPDATE (a compare-and-set on the claim)
        _lock_stream_of_turn(db, turn_id)  # a late follow-up's turn is written here (below)
        row = db.one("""UPDATE turns SET resolution = ?, resolved_at = ?, claim_token = NULL, claim_client = NULL,
                          claim_expires_at = NULL, updated_at = ?
                        WHERE turn_id = ? AND resolved_at IS NULL AND claim_token = ? AND claim_client = ?
                          AND claim_expires_at > ?
                        RETURNING run_id, followups_through""",
                     (resolution, now, now, turn_id, claim_id, client_id, now))
        if row is None:
            if db.one("SELECT 1 FROM turns WHERE turn_id = ?", (turn_id,)) is None:
                raise NotFound(f"turn {turn_id} not found")
            raise Conflict(f"the claim {claim_id} on turn {turn_id} is stale "
                           "(expired, superseded, another client's, or already resolved)")
        run_id, through = row
        db.execute("""UPDATE followups SET state = 'delivered', turn_id = ?, updated_at = ?
                      WHERE run_id = ? AND state = 'queued' AND position <= ?""", (turn_id, now, run_id, through or 0))
        delivered = db.changes()
        add_event(db, run_id, "turn.resolved", {"turnId": turn_id, "outcome": resolution}, now)
        _carry_late_followups(db, run_id, turn_id, now)
        return ResolveTurnReceipt(turnId=turn_id, resolution=resolution, followUpsDelivered=delivered)


def _lock_stream_of_turn(db: Database, turn_id: str) -> None:
    """A resolve writes its run's trace (so the run's lock, first) and may write a turn
    (so the session's stream). A turn's run and session never change: a plain read finds them."""
    if db.lock_rows():
        row = db.one("SELECT run_id, session_id FROM turns WHERE turn_id = ?", (turn_id,))
        if row is not None:
            lock_run(db, row[0])
            lock_delivery(db, row[1])


def _carry_late_followups(db: Database, run_id: str, resolved_turn: str, now: int) -> None:
    """Follow-ups queued after the claim of an ended run's last turn (too late for it, and
    accepted because that turn was still unresolved) get a fresh turn of their own, with
    the same cause and the facts of now; a run still going carries them with its next."""
    if db.scalar("SELECT status FROM run_queue WHERE run_id = ?", (run_id,)) not in ENDED:
        return
    if db.one("SELECT 1 FROM followups WHERE run_id = ? AND state = 'queued' LIMIT 1", (run_id,)) is None:
        return
    cause, session = db.one("SELECT cause, session_id FROM turns WHERE turn_id = ?", (resolved_turn,))
    _write_turn(db, run_id, session, TurnCause(cause), now, eligible=True)


def list_turns(db: Database, *, session_id: str | None, run_id: str | None, limit: int, now: int) -> list[Turn]:
    where, params = _filters(session_id, run_id, "t")
    rows = db.execute(f"""SELECT {TURN_COLUMNS} FROM turns t WHERE t.resolved_at IS NULL
                          AND t.eligible_at IS NOT NULL {where} ORDER BY t.eligible_at, t.rowid LIMIT ?""",
                      (*params, limit)).fetchall()
    return [_turn(db, row, now, through=1 << 62) for row in rows]


COUNT_UNRESOLVED_SQL = "SELECT COUNT(*) FROM turns WHERE resolved_at IS NULL AND eligible_at IS NOT NULL"


def count_unresolved(db: Database) -> int:
    """Turns waiting for a session: eligible and unresolved (a ``ctx.present`` turn of a
    run still going is not one yet)."""
    result: int = db.scalar(COUNT_UNRESOLVED_SQL)
    return result


# --- follow-ups -------------------------------------------------------------------------------


def queue_followup(db: Database, *, run_id: str, request_key: str, prompt: str, now: int) -> FollowUpReceipt:
    """Queue ``prompt`` for the run's origin session, after the run's earlier follow-ups;
    the same ``request_key`` with the same prompt is the same follow-up (``adopted``)."""
    with db.write():
        lock_run(db, run_id)  # the same key twice, and positions one after another
        run = db.one("SELECT origin_session_id FROM runs WHERE run_id = ?", (run_id,))
        if run is None:
            raise NotFound(f"run {run_id} not found")
        check_content(prompt, "a follow-up prompt")
        existing = db.one("SELECT followup_id, prompt, position, state FROM followups WHERE run_id = ? "
                          "AND request_key = ?", (run_id, request_key))
        if existing is not None:
            if existing[1] != prompt:
                raise Conflict(f"follow-up {request_key!r} of run {run_id} was queued with another prompt")
            return FollowUpReceipt(followUpId=existing[0], runId=run_id, order=existing[2], state=existing[3],
                                   adopted=True)
        if run[0] is None:
            raise Rejected(f"run {run_id} has no origin session to follow up with")
        if _turns_over(db, run_id, run[0]):
            raise Rejected(f"run {run_id} has ended and its turn was resolved: no turn is left to deliver with")
        followup_id = "fup-" + secrets.token_hex(8)
        position = db.scalar("SELECT COALESCE(MAX(position), 0) + 1 FROM followups WHERE run_id = ?", (run_id,))
        db.execute("""INSERT INTO followups (followup_id, run_id, request_key, prompt, position, state, created_at,
                        updated_at) VALUES (?, ?, ?, ?, ?, 'queued', ?, ?)""",
                   (followup_id, run_id, request_key, prompt, position, now, now))
        add_event(db, run_id, "followup.queued", {"followUpId": followup_id}, now)
        return FollowUpReceipt(followUpId=followup_id, runId=run_id, order=position, state=FollowUpState.QUEUED,
                               adopted=False)


def _turns_over(db: Database, run_id: str, session: str) -> bool:
    """The run has ended and no turn of it is left unresolved: nothing would carry a follow-up."""
    ended = db.scalar("SELECT status FROM run_queue WHERE run_id = ?", (run_id,)) in ENDED
    open_turn = db.one("SELECT 1 FROM turns WHERE run_id = ? AND session_id = ? AND resolved_at IS NULL",
                       (run_id, session))
    return ended and open_turn is None


def remove_followup(db: Database, *, run_id: str | None, followup_id: str, now: int) -> FollowUpReceipt:
    """Take back a queued follow-up, found by its id; ``run_id``, when given, must be its run."""
    with db.write():
        if run_id is None:  # a follow-up never moves to another run: read outside the run's lock
            run_id = db.scalar("SELECT run_id FROM followups WHERE followup_id = ?", (followup_id,))
            if run_id is None:
                raise NotFound(f"follow-up {followup_id} not found")
        lock_run(db, run_id)
        row = db.one("SELECT request_key, position, state FROM followups WHERE followup_id = ? AND run_id = ?",
                     (followup_id, run_id))
        if row is None:
            raise NotFound(f"follow-up {followup_id} of run {run_id} not found")
        _, position, state = row
        if state == FollowUpState.DELIVERED:
            raise Rejected(f"follow-up {followup_id} was already delivered")
        if state == FollowUpState.QUEUED:
            # still queued, checked in the write: a turn's resolve (which holds the session's
            # stream, not the run) may have delivered it since the read
            db.execute("UPDATE followups SET state = 'removed', updated_at = ? WHERE followup_id = ? "
                       "AND state = 'queued'", (now, followup_id))
            if db.changes() != 1:
                raise Rejected(f"follow-up {followup_id} was already delivered")
            add_event(db, run_id, "followup.removed", {"followUpId": followup_id}, now)
        return FollowUpReceipt(followUpId=followup_id, runId=run_id, order=position, state=FollowUpState.REMOVED,
                               adopted=state == FollowUpState.REMOVED)


_QUEUED = """SELECT f.followup_id, f.run_id, f.request_key, f.prompt, f.position, r.origin_session_id,
  f.created_at, EXISTS (SELECT 1 FROM turns t WHERE t.run_id = f.run_id AND t.resolved_at IS NULL
    AND t.claim_token IS NOT NULL AND t.claim_expires_at > ? AND t.followups_through >= f.position)
FROM followups f JOIN runs r ON r.run_id = f.run_id
WHERE f.state = 'queued' {where}
ORDER BY (SELECT MIN(g.created_at) FROM followups g WHERE g.run_id = f.run_id AND g.state = 'queued'), f.run_id,
  f.position
LIMIT ?"""


def list_followups(db: Database, *, session_id: str | None, run_id: str | None, limit: int,
                   now: int) -> FollowUpPage:
    """The follow-ups still queued (of the session's runs, of the run, or all) in the order
    their session gets them: a run's by position, the runs by their first one queued."""
    where, params = "", list[Any]([now])
    if session_id is not None:
        where, params = "AND r.origin_session_id = ?", [*params, session_id]
    if run_id is not None:
        where, params = f"{where} AND f.run_id = ?", [*params, run_id]
    with db.read():
        if run_id is not None and db.one("SELECT 1 FROM runs WHERE run_id = ?", (run_id,)) is None:
            raise NotFound(f"run {run_id} not found")
        rows = db.execute(_QUEUED.format(where=where), (*params, limit + 1)).fetchall()
    return FollowUpPage(followUps=[
        QueuedFollowUp(followUpId=f, runId=r, requestKey=k, prompt=p, order=o, state=FollowUpState.QUEUED,
                       sessionId=session, createdAt=iso(created) or "", handedOut=bool(handed))
        for f, r, k, p, o, session, created, handed in rows[:limit]], more=len(rows) > limit)


def _followups(db: Database, run_id: str, through: int) -> list[FollowUp]:
    rows = db.execute("""SELECT followup_id, request_key, prompt, position, state FROM followups
                         WHERE run_id = ? AND state = 'queued' AND position <= ? ORDER BY position""",
                      (run_id, through)).fetchall()
    return [FollowUp(followUpId=f, runId=run_id, requestKey=k, prompt=p, order=o, state=s) for f, k, p, o, s in rows]


# --- pruning ----------------------------------------------------------------------------------


def prune(db: Database, now: int, retention_ms: int) -> int:
    """Forget what was delivered (notifications), resolved (turns) or delivered or removed
    (follow-ups) longer than ``retention_ms`` ago, of runs that have ended: nothing of a
    run still going is forgotten, so a node retried later still finds the notification it
    stored. Returns the rows deleted."""
    before = now - retention_ms
    ended = "run_id IN (SELECT run_id FROM run_queue WHERE status IN ('done', 'failed', 'cancelled'))"
    with db.write():
        if not db.try_lock_key("duty", "delivery.prune"):  # another host is at it (commands.prune)
            return 0
        db.execute(f"DELETE FROM notifications WHERE delivered_at < ? AND {ended}", (before,))
        deleted = db.changes()
        db.execute(f"DELETE FROM turns WHERE resolved_at < ? AND {ended}", (before,))
        deleted += db.changes()
        db.execute(f"DELETE FROM followups WHERE state != 'queued' AND updated_at < ? AND {ended}", (before,))
        return deleted + db.changes()
