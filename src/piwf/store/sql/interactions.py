"""People and agents in the loop (DESIGN.md §7): requests, submissions, resolutions.

A decision or ask node opens a request and its run waits: engine ``waiting``, queue
``parked`` with hold ``waiting``, its attempt ``waiting``, no claim. Every change here is
one transaction with the run's state: an answer writes the resolution, closes the request,
accepts the waiting attempt and releases the hold together, so a run goes on at most once
per request whatever crashes, and the first answer wins.
"""

from __future__ import annotations

import hashlib
import secrets
from typing import Any

import msgspec

from piwf.errors import ClaimLost, Conflict, NotFound, Rejected
from piwf.protocol import (
    AnswerReceipt, ChoiceSpec, DefaultAnswer, InteractionRequest, Resolution, SubmissionInfo, SubmitReceipt,
    UpdateAction, UpdateReceipt,
)
from piwf.status import AttemptStatus, Provenance, RequestStatus, SubmissionStatus
from piwf.wire import canonical_json, decode_json
from piwf.protocol.worker import InteractionOpenPayload, PendingSubmission
from piwf.store.sql.database import Database, atomic
from piwf.store.sql.base import LIVE, add_event, require_claim, store_update
from piwf.store.sql.database import one_of
from piwf.store.sql.timefmt import iso

OPEN = f"status IN ({one_of((RequestStatus.PENDING, RequestStatus.PRESENTING))})"
# A deadline applies to a request whose run waits idle: parked, unclaimed, and with no
# submission being validated (a value given in time is validated, however long the run
# waits for a worker; its outcome wakes the timer again).
IDLE = """r.status IN ('pending', 'presenting') AND q.status = 'parked' AND q.claim_token IS NULL
  AND NOT EXISTS (SELECT 1 FROM interaction_submissions s WHERE s.request_id = r.request_id
                  AND s.status = 'validating')"""
TIMEOUT_EXIT = "timeout"
TITLE_LIMIT = 2000


class Spec(msgspec.Struct, frozen=True, omit_defaults=True):
    """What a request asks, as stored: the worker's payload without its attempt id."""

    title: str
    choices: dict[str, ChoiceSpec] | None = None
    schema: Any = None
    default: DefaultAnswer | None = None
    timeoutExit: bool = False


def request_id_for(run_id: str, attempt_id: str) -> str:
    """Deterministic: the same attempt asking again gets the same request."""
    return "req-" + hashlib.sha256(f"{run_id}/{attempt_id}".encode()).hexdigest()[:20]


# --- opened and continued by a worker (inside its message's transaction) -----------------


@atomic
def open_request(db: Database, run_id: str, token: str, payload: InteractionOpenPayload, now: int) -> str:
    """The attempt's node waits: open (or find) its request and park the run as waiting."""
    require_claim(db, run_id, token, now)
    attempt = db.one("SELECT seq, node_id, status FROM node_attempts WHERE attempt_id = ? AND run_id = ?",
                     (payload.attemptId, run_id))
    if attempt is None or attempt[2] != AttemptStatus.RUNNING:
        raise Rejected(f"attempt {payload.attemptId} is not running")
    seq, node, _ = attempt
    request_id = request_id_for(run_id, payload.attemptId)
    spec = Spec(title=payload.title[:TITLE_LIMIT], choices=payload.choices, schema=payload.schema,
                default=payload.default, timeoutExit=payload.timeoutExit)
    workflow, session = db.one("SELECT workflow, origin_session_id FROM runs WHERE run_id = ?", (run_id,))
    db.execute(
        """INSERT INTO interaction_requests (request_id, run_id, attempt_id, seq, node_id, kind, workflow,
             origin_session_id, spec_json, deadline_at, status, created_at, updated_at)
           VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 'pending', ?, ?)""",
        (request_id, run_id, payload.attemptId, seq, node, payload.kind, workflow, session,
         canonical_json(spec).decode(), None if payload.deadlineMs is None else now + payload.deadlineMs, now, now),
    )
    db.execute("UPDATE node_attempts SET status = 'waiting' WHERE attempt_id = ?", (payload.attemptId,))
    _park_waiting(db, run_id, token, now, _waiting_for(payload.kind, request_id, spec))
    add_event(db, run_id, "waiting", {"requestId": request_id, "kind": payload.kind, "node": node}, now)
    return request_id


def _park_waiting(db: Database, run_id: str, token: str, now: int, detail: str, *,
                  expired_too: bool = False) -> None:
    """Release the run's claim; it waits (hold ``waiting``) until an answer releases it.
    The claim is checked by the release itself: ClaimLost (nothing changed) unless it is
    live (``expired_too``: or expired, still this token's)."""
    expiry = "" if expired_too else " AND claim_expires_at > ?"
    db.execute(
        f"""UPDATE run_queue SET status = 'parked', runner_id = NULL, claim_token = NULL,
              claim_expires_at = NULL, hold = 'waiting', updated_at = ?
            WHERE run_id = ? AND claim_token = ? AND {LIVE}{expiry}""",
        (now, run_id, token) if expired_too else (now, run_id, token, now),
    )
    if db.changes() != 1:
        raise ClaimLost(f"the claim on run {run_id} is no longer live")
    db.execute("""UPDATE node_attempts SET status = 'interrupted', finished_at = ?
                  WHERE run_id = ? AND status = 'running'""", (now, run_id))
    db.execute("""UPDATE runs SET status = 'waiting', status_detail = ?, revision = revision + 1, updated_at = ?
                  WHERE run_id = ?""", (detail, now, run_id))


@atomic
def waiting_attempt(db: Database, run_id: str, seq: int, node: str,
                    now: int) -> tuple[str, PendingSubmission | None] | None:
    """The attempt at ``seq`` waiting for its request, and the submission to validate (if
    any); None when no attempt waits there. A waiting attempt of another node (the run
    resumed on a changed workflow) is given up: its request cancelled, its submission
    rejected saying why, so nothing submitted to it becomes another node's output."""
    row = db.one(
        """SELECT a.attempt_id, r.request_id, a.node_id FROM node_attempts a
           JOIN interaction_requests r ON r.attempt_id = a.attempt_id
           WHERE a.run_id = ? AND a.seq = ? AND a.status = 'waiting'""",
        (run_id, seq),
    )
    if row is None:
        return None
    attempt_id, request_id, waiting_node = row
    if waiting_node != node:
        reason = f"the workflow changed: step {seq} is now {node!r}, not {waiting_node!r}"
        close_open(db, run_id, now, reason)
        add_event(db, run_id, "request.cancelled", {"requestId": request_id, "reason": reason}, now)
        return None
    submission = db.one("""SELECT submission_id, value_json FROM interaction_submissions
                           WHERE request_id = ? AND status = 'validating'""", (request_id,))
    pending = None if submission is None else PendingSubmission(submission[0], decode_json(submission[1].encode()))
    return attempt_id, pending


@atomic
def park_again(db: Database, run_id: str, token: str, now: int) -> None:
    """A worker reached a waiting node with nothing to validate: the run waits again."""
    _park_waiting(db, run_id, token, now, _detail(db, run_id))


@atomic
def accept_submission(db: Database, run_id: str, submission_id: str, value: Any, now: int) -> None:
    """The validated value became the node's output (accepted in this transaction): settle."""
    request_id = _validating_request(db, run_id, submission_id)
    db.execute("UPDATE interaction_submissions SET status = 'accepted', settled_at = ? WHERE submission_id = ?",
               (now, submission_id))
    submitted_by = db.scalar("SELECT submitted_by FROM interaction_submissions WHERE submission_id = ?",
                             (submission_id,))
    close_request(db, request_id, RequestStatus.SETTLED, Resolution(
        provenance=Provenance.HUMAN, answeredBy=submitted_by, answeredAt=iso(now) or "", value=value,
        submissionId=submission_id), now)
    add_event(db, run_id, "submission.accepted", {"requestId": request_id, "submissionId": submission_id}, now)


@atomic
def reject_submission(db: Database, run_id: str, token: str, submission_id: str, error: str, now: int) -> None:
    """The value did not fit: the request is open again with the reason, the run waits."""
    request_id = _validating_request(db, run_id, submission_id)
    _park_waiting(db, run_id, token, now, f"submission rejected: {error[:300]}")  # the fence first
    _reject(db, submission_id, error, now)
    add_event(db, run_id, "submission.rejected", {"requestId": request_id, "submissionId": submission_id,
                                                  "error": error[:500]}, now)


def _validating_request(db: Database, run_id: str, submission_id: str) -> str:
    request_id = db.scalar(
        """SELECT s.request_id FROM interaction_submissions s JOIN interaction_requests r
             ON r.request_id = s.request_id
           WHERE s.submission_id = ? AND r.run_id = ? AND s.status = 'validating'""",
        (submission_id, run_id))
    if request_id is None:
        raise Rejected(f"submission {submission_id} is not being validated")
    result: str = request_id
    return result


def _reject(db: Database, submission_id: str, error: str, now: int) -> None:
    db.execute("""UPDATE interaction_submissions SET status = 'rejected', error = ?, settled_at = ?
                  WHERE submission_id = ?""", (error[:8192], now, submission_id))


def park_if_waiting(db: Database, run_id: str, token: str, worker_status: str, now: int) -> bool:
    """A worker ended while its run had an open request (it was validating a submission):
    that submission is rejected and the run waits again. False when no request is open, or
    the run was paused (the submission stays, validated once the run is resumed)."""
    request_id = db.scalar(f"SELECT request_id FROM interaction_requests WHERE run_id = ? AND {OPEN}", (run_id,))
    if request_id is None or db.scalar("SELECT paused FROM runs WHERE run_id = ?", (run_id,)):
        return False
    # the claim is still this worker's (expired or not): fenced by a write of its row
    db.execute(f"UPDATE run_queue SET claim_token = claim_token WHERE run_id = ? AND claim_token = ? AND {LIVE}",
               (run_id, token))
    if db.changes() != 1:
        return False
    for (submission_id,) in db.execute("""SELECT submission_id FROM interaction_submissions
                                          WHERE request_id = ? AND status = 'validating'""",
                                       (request_id,)).fetchall():
        _reject(db, submission_id, f"the worker validating it ended ({worker_status}) before it completed "
                                   "validation; submit again", now)
        add_event(db, run_id, "submission.rejected", {"requestId": request_id, "submissionId": submission_id}, now)
    _park_waiting(db, run_id, token, now, _detail(db, run_id), expired_too=True)
    return True


def _detail(db: Database, run_id: str) -> str:
    row = db.one(f"SELECT request_id, kind, spec_json FROM interaction_requests WHERE run_id = ? AND {OPEN}",
                 (run_id,))
    if row is None:
        return "waiting"
    return _waiting_for(row[1], row[0], msgspec.json.decode(row[2], type=Spec))


def _waiting_for(kind: str, request_id: str, spec: Spec) -> str:
    """A waiting run's status detail."""
    return f"waiting for {kind} {request_id}: {spec.title[:200]}"


# --- answered by clients ------------------------------------------------------------------


def _open_request(db: Database, request_id: str, kind: str, expected_revision: int | None,
                  now: int) -> tuple[Any, ...]:
    row = db.one("""SELECT run_id, attempt_id, kind, status, revision, deadline_at, spec_json, origin_session_id
                    FROM interaction_requests WHERE request_id = ?""", (request_id,))
    if row is None:
        raise NotFound(f"request {request_id} not found")
    _, _, actual_kind, status, revision, deadline, _, _ = row
    if actual_kind != kind:
        verb = "piwf decide (decision.answer)" if actual_kind == "decision" else "piwf answer (interaction.submit)"
        raise Rejected(f"request {request_id} is {'a decision' if actual_kind == 'decision' else 'an ask'}: "
                       f"answer it with {verb}")
    if deadline is not None and now >= deadline:  # whatever closed it: an answer this late is refused
        raise Rejected(f"request {request_id} expired at {iso(deadline)}{_how_closed(db, request_id, status)}")
    if status == RequestStatus.SETTLED and kind == "decision":
        winner = _resolution(db, request_id)
        raise Conflict(f"decision {request_id} was already answered: another answer won "
                       f"({winner.choice if winner else '?'} by {winner.answeredBy if winner else '?'})")
    if status not in (RequestStatus.PENDING, RequestStatus.PRESENTING):
        raise Rejected(f"request {request_id} is {status}: it takes no more answers")
    refuse_revision(request_id, revision, expected_revision)  # early, in the order refusals are given
    result: tuple[Any, ...] = row
    return result


# In a write of interaction_requests: the request is at the revision a client expected
# (? IS NULL: any). The compare-and-set is the write's; _open_request's read only refuses early.
AT_REVISION = "(? IS NULL OR revision = ?)"


def refuse_revision(request_id: str, revision: int | None, expected_revision: int | None) -> None:
    if expected_revision is not None and expected_revision != revision:
        raise Conflict(f"request {request_id} is at revision {revision}, not {expected_revision}")


def _how_closed(db: Database, request_id: str, status: str) -> str:
    resolution = _resolution(db, request_id)
    if status == RequestStatus.SETTLED and resolution is not None:
        by = "its default" if resolution.provenance == Provenance.TIMEOUT else resolution.answeredBy
        return f"; it was resolved as {resolution.choice} by {by}"
    return ""


def answer_decision(db: Database, *, request_id: str, choice: str, text: str | None, answered_by: str,
                    expected_revision: int | None, now: int) -> AnswerReceipt:
    """The first answer wins: resolution, request settled, attempt accepted with the answer
    as its output and the choice as its exit, and the run released, in one transaction."""
    with db.write():
        run_id, attempt_id, _, _, revision, _, spec_json, _ = _open_request(db, request_id, "decision",
                                                                            expected_revision, now)
        spec = msgspec.json.decode(spec_json, type=Spec)
        text = check_answer(spec, choice, text)
        resolution = Resolution(provenance=Provenance.HUMAN, answeredBy=answered_by, answeredAt=iso(now) or "",
                                choice=choice, input=text)
        resolve_decision(db, run_id, attempt_id, request_id, resolution, now, expected_revision=expected_revision)
        return AnswerReceipt(requestId=request_id, runId=run_id, choice=choice, input=text,
                             provenance=Provenance.HUMAN, revision=revision + 1)


def check_answer(spec: Spec, choice: str, text: str | None) -> str | None:
    """The answer's text (``""`` for a choice whose text may be empty and was left out);
    Rejected unless ``choice`` (with ``text``) is a valid answer to the decision."""
    choices = spec.choices or {}
    if choice not in choices:
        raise Rejected(f"{choice!r} is not a choice; the choices are {', '.join(choices)}")
    wanted = choices[choice].input
    if wanted is None:
        if text is not None:
            raise Rejected(f"choice {choice!r} takes no input")
        return None
    if text is None and wanted.minLength == 0:
        text = ""
    if text is None:
        raise Rejected(f"choice {choice!r} needs input: {wanted.prompt}")
    if not wanted.minLength <= len(text) <= wanted.maxLength:
        raise Rejected(f"input for {choice!r} is {len(text)} characters; it must be "
                       f"{wanted.minLength} to {wanted.maxLength}")
    return text


def resolve_decision(db: Database, run_id: str, attempt_id: str, request_id: str, resolution: Resolution,
                      now: int, *, expected_revision: int | None = None) -> None:
    output = {"choice": resolution.choice, "input": resolution.input, "provenance": resolution.provenance,
              "answeredBy": resolution.answeredBy, "answeredAt": resolution.answeredAt}
    close_request(db, request_id, RequestStatus.SETTLED, resolution, now, expected_revision=expected_revision)
    continue_attempt(db, run_id, attempt_id, output, resolution.choice or TIMEOUT_EXIT, now)
    add_event(db, run_id, "decision.answered", {"requestId": request_id, "choice": resolution.choice,
                                                "provenance": resolution.provenance}, now)


def close_request(db: Database, request_id: str, status: RequestStatus, resolution: Resolution | None,
                  now: int, *, expected_revision: int | None = None) -> None:
    """Close an open request; with ``expected_revision``, only at that revision (the
    compare-and-set is in the UPDATE)."""
    db.execute(
        f"""UPDATE interaction_requests SET status = ?, resolution_json = ?, presenter = NULL,
              presenter_expires_at = NULL, revision = revision + 1, closed_at = ?, updated_at = ?
            WHERE request_id = ? AND {OPEN} AND {AT_REVISION}""",
        (status, None if resolution is None else canonical_json(resolution).decode(), now, now, request_id,
         expected_revision, expected_revision),
    )
    if db.changes() != 1:
        _refuse_write(db, request_id, expected_revision)
        raise Conflict(f"request {request_id} was closed meanwhile")


def _refuse_write(db: Database, request_id: str, expected_revision: int | None) -> None:
    """After a write guarded by OPEN and AT_REVISION changed nothing: Conflict, with the
    read's message, if the revision is why."""
    refuse_revision(request_id, db.scalar("SELECT revision FROM interaction_requests WHERE request_id = ?",
                                          (request_id,)), expected_revision)


def continue_attempt(db: Database, run_id: str, attempt_id: str, output: Any, exit_name: str, now: int) -> None:
    """The waiting attempt is accepted with ``output``; the run may be claimed again (held
    as paused if it was paused while it waited)."""
    inline, digest = db.put_json(output, now)
    db.execute("""UPDATE node_attempts SET status = 'accepted', output_json = ?, output_hash = ?, exit_name = ?,
                    finished_at = ? WHERE attempt_id = ? AND status = 'waiting'""",
               (inline, digest, exit_name, now, attempt_id))
    if db.changes() != 1:
        raise Conflict(f"attempt {attempt_id} of run {run_id} is no longer waiting")
    _release(db, run_id, now)
    add_event(db, run_id, "attempt.accepted", {"attemptId": attempt_id, "exit": exit_name}, now)


def _unhold(db: Database, run_id: str, now: int) -> None:
    """Lift a waiting run's hold so the dispatcher claims it (held as paused if it was
    paused while it waited)."""
    db.execute("""UPDATE run_queue SET hold = CASE WHEN (SELECT paused FROM runs WHERE run_id = ?) != 0
                    THEN 'paused' ELSE NULL END, updated_at = ?
                  WHERE run_id = ? AND status = 'parked' AND hold = 'waiting'""", (run_id, now, run_id))


def _release(db: Database, run_id: str, now: int) -> None:
    """Make a waiting run claimable; its engine status is running again."""
    _unhold(db, run_id, now)
    db.execute("""UPDATE runs SET status = 'running', status_detail = CASE WHEN paused != 0 THEN 'paused' END,
                    revision = revision + 1, updated_at = ? WHERE run_id = ? AND status = 'waiting'""",
               (now, run_id))


def submit(db: Database, *, request_id: str, value: Any, session_id: str | None, submitted_by: str,
           expected_revision: int | None, now: int) -> SubmitReceipt:
    """A value for an ask, to be validated by the workflow in a worker: the run is
    released to the dispatcher, which claims it and starts that worker."""
    with db.write():
        run_id, _, _, _, _, _, _, origin = _open_request(db, request_id, "ask", expected_revision, now)
        if db.scalar("SELECT paused FROM runs WHERE run_id = ?", (run_id,)):
            raise Rejected(f"run {run_id} is paused: a value is validated by the running workflow; "
                           f"resume the run (piwf run resume {run_id}), then submit")
        if origin is not None and session_id != origin:
            raise Rejected(f"request {request_id} belongs to session {origin}; submit with that sessionId")
        if db.one("SELECT 1 FROM interaction_submissions WHERE request_id = ? AND status = 'validating'",
                  (request_id,)):
            raise Conflict(f"a submission to {request_id} is being validated; wait for its outcome")
        submission_id = "sub-" + secrets.token_hex(8)
        db.execute(  # only while the request is open at the expected revision: the compare-and-set is here
            f"""INSERT INTO interaction_submissions (submission_id, request_id, status, value_json, submitted_by,
                 session_id, created_at) SELECT ?, ?, 'validating', ?, ?, ?, ?
                 WHERE EXISTS (SELECT 1 FROM interaction_requests WHERE request_id = ? AND {OPEN} AND {AT_REVISION})""",
            (submission_id, request_id, canonical_json(value).decode(), submitted_by, session_id, now,
             request_id, expected_revision, expected_revision),
        )
        if db.changes() != 1:
            _refuse_write(db, request_id, expected_revision)
            raise Conflict(f"request {request_id} was closed meanwhile")
        _unhold(db, run_id, now)  # the dispatcher claims it, and a worker validates the value
        add_event(db, run_id, "submission.received", {"requestId": request_id, "submissionId": submission_id}, now)
        return SubmitReceipt(requestId=request_id, runId=run_id, submissionId=submission_id,
                             status=SubmissionStatus.VALIDATING)


def update(db: Database, *, request_id: str, expected_revision: int, action: UpdateAction, client_id: str,
           entry_id: str | None, progress: str | None, lease_ms: int, now: int) -> UpdateReceipt:
    """Presentation claims and progress (seed rules): ``claim`` needs the current revision
    and a request pending, or presenting by the same client or with an expired claim, and
    not yet presented; ``presented`` ends presentation claiming (the request stays
    ``presenting``, with no presenter); ``progress`` needs the current revision and the
    request's attempt still waiting, and is published as a run update."""
    with db.write():
        row = db.one("""SELECT status, revision, presenter, presenter_expires_at, entry_id
                        FROM interaction_requests WHERE request_id = ?""", (request_id,))
        if row is None:
            raise NotFound(f"request {request_id} not found")
        status, revision, presenter, expires, entry = row
        if status not in (RequestStatus.PENDING, RequestStatus.PRESENTING):
            raise Rejected(f"request {request_id} is {status}")
        if expected_revision != revision:
            raise Conflict(f"request {request_id} is at revision {revision}, not {expected_revision}")
        if action is UpdateAction.PROGRESS:
            return _progress(db, request_id, revision, progress, now)
        if action is UpdateAction.CLAIM:
            if entry is not None:  # presented: nobody claims (and shows) it again
                raise Conflict(f"request {request_id} was presented as {entry}; its presentation is over")
            if status == RequestStatus.PRESENTING and presenter != client_id and (expires or 0) > now:
                raise Conflict(f"request {request_id} is being presented by {presenter}")
            sets: tuple[str, tuple[Any, ...]] = ("status = 'presenting', presenter = ?, presenter_expires_at = ?",
                                                 (client_id, now + lease_ms))
            guard: tuple[str, tuple[Any, ...]] = ("entry_id IS NULL", ())
        else:
            if entry_id is None:
                raise Rejected("action presented needs entryId")
            if entry is not None and entry != entry_id:
                raise Conflict(f"request {request_id} was presented as {entry}")
            sets = ("status = 'presenting', presenter = NULL, presenter_expires_at = NULL, entry_id = ?",
                    (entry_id,))
            guard = ("(entry_id IS NULL OR entry_id = ?)", (entry_id,))
        return _apply_update(db, request_id, revision, sets, guard, now)


def _apply_update(db: Database, request_id: str, revision: int, sets: tuple[str, tuple[Any, ...]],
                  guard: tuple[str, tuple[Any, ...]], now: int) -> UpdateReceipt:
    """The update, a compare-and-set on the revision checked (the request still open, and
    ``guard`` still holding)."""
    row = db.one(f"""UPDATE interaction_requests SET {sets[0]}, revision = revision + 1, updated_at = ?
                     WHERE request_id = ? AND revision = ? AND {OPEN} AND {guard[0]}
                     RETURNING status, revision, presenter, presenter_expires_at""",
                 (*sets[1], now, request_id, revision, *guard[1]))
    if row is None:
        raise Conflict(f"request {request_id} changed meanwhile (it was at revision {revision})")
    status, revision, presenter, expires = row
    return UpdateReceipt(requestId=request_id, status=status, revision=revision, presenter=presenter,
                         presenterExpiresAt=iso(expires))


PROGRESS_UPDATE = "interaction.progress"  # the run update's type; its key is the request id


def _progress(db: Database, request_id: str, revision: int, progress: str | None, now: int) -> UpdateReceipt:
    """Progress on a request is a run update (type ``interaction.progress``, keyed by the
    request): published, seen by ``run.watch``, kept on the request for the inbox. Only
    while the request's attempt still waits (a stale attempt is a conflict); the request's
    revision is the compare-and-set token and is not bumped (seed)."""
    if progress is None:
        raise Rejected("action progress needs progress")
    row = db.one(f"""UPDATE interaction_requests SET progress = ?, updated_at = ?
                     WHERE request_id = ? AND revision = ? AND {OPEN} AND EXISTS (
                       SELECT 1 FROM node_attempts a WHERE a.attempt_id = interaction_requests.attempt_id
                         AND a.status = 'waiting')
                     RETURNING run_id, node_id, status, presenter, presenter_expires_at""",
                 (progress, now, request_id, revision))
    if row is None:
        raise Conflict(f"request {request_id} is stale: its attempt no longer waits (or it changed meanwhile)")
    run_id, node, status, presenter, expires = row
    seq = store_update(db, run_id, PROGRESS_UPDATE, request_id,
                       {"requestId": request_id, "nodeId": node, "progress": progress}, now)
    return UpdateReceipt(requestId=request_id, status=status, revision=revision, presenter=presenter,
                         presenterExpiresAt=iso(expires), updateSeq=seq)


# --- deadlines and cancellation --------------------------------------------------------------


def reject_validating(db: Database, request_id: str, error: str, now: int) -> None:
    db.execute("""UPDATE interaction_submissions SET status = 'rejected', error = ?, settled_at = ?
                  WHERE request_id = ? AND status = 'validating'""", (error, now, request_id))


def close_open(db: Database, run_id: str, now: int, reason: str) -> list[str]:
    """Cancel the run's open requests (its waiting attempts interrupted, a submission being
    validated rejected with ``reason``), so a later answer is refused; a settled request
    stays settled. Called when the run ends however it ends, in that transaction."""
    rows = db.execute(f"SELECT request_id FROM interaction_requests WHERE run_id = ? AND {OPEN}",
                      (run_id,)).fetchall()
    for (request_id,) in rows:
        close_request(db, request_id, RequestStatus.CANCELLED, None, now)
        reject_validating(db, request_id, reason, now)
    db.execute("""UPDATE node_attempts SET status = 'interrupted', finished_at = ?
                  WHERE run_id = ? AND status = 'waiting'""", (now, run_id))
    return [request_id for (request_id,) in rows]


# --- reads ---------------------------------------------------------------------------------

REQUEST_COLUMNS = """r.request_id, r.kind, r.run_id, r.workflow, r.node_id, r.origin_session_id, r.spec_json,
  r.deadline_at, r.status, r.revision, r.presenter, r.presenter_expires_at, r.entry_id, r.progress,
  r.resolution_json, r.created_at"""


def list_requests(db: Database, *, session_id: str | None = None, run_id: str | None = None,
                  open_only: bool = True, limit: int = 100, now: int) -> list[InteractionRequest]:
    where, params = [], []
    if open_only:
        where.append(f"r.{OPEN}")
    if session_id is not None:
        where.append("r.origin_session_id = ?")
        params.append(session_id)
    if run_id is not None:
        where.append("r.run_id = ?")
        params.append(run_id)
    clause = f"WHERE {' AND '.join(where)}" if where else ""
    with db.read():
        if run_id is not None and not db.one("SELECT 1 FROM runs WHERE run_id = ?", (run_id,)):
            raise NotFound(f"run {run_id} not found")
        rows = db.execute(f"""SELECT {REQUEST_COLUMNS} FROM interaction_requests r {clause}
                              ORDER BY r.created_at, r.request_id LIMIT ?""", (*params, limit)).fetchall()
        return [_request(db, row, now) for row in rows]


def get_request(db: Database, request_id: str, now: int) -> InteractionRequest:
    row = db.one(f"SELECT {REQUEST_COLUMNS} FROM interaction_requests r WHERE r.request_id = ?", (request_id,))
    if row is None:
        raise NotFound(f"request {request_id} not found")
    return _request(db, row, now)


def _request(db: Database, row: tuple[Any, ...], now: int) -> InteractionRequest:
    (request_id, kind, run_id, workflow, node, session, spec_json, deadline, status, revision, presenter,
     expires, entry, progress, resolution, created) = row
    spec = msgspec.json.decode(spec_json, type=Spec)
    live = presenter if status == RequestStatus.PRESENTING and (expires or 0) > now else None
    return InteractionRequest(
        requestId=request_id, kind=kind, runId=run_id, workflow=workflow, nodeId=node, originSessionId=session,
        title=spec.title, choices=spec.choices, schema=spec.schema, deadline=iso(deadline), default=spec.default,
        timeoutExit=spec.timeoutExit, status=status, revision=revision, presenter=live,
        presenterExpiresAt=iso(expires) if live else None, entryId=entry, progress=progress,
        lastSubmission=_last_submission(db, request_id),
        resolution=None if resolution is None else msgspec.json.decode(resolution, type=Resolution),
        createdAt=iso(created) or "")


def _last_submission(db: Database, request_id: str) -> SubmissionInfo | None:
    row = db.one("""SELECT submission_id, status, error, submitted_by, created_at FROM interaction_submissions
                    WHERE request_id = ? ORDER BY created_at DESC, rowid DESC LIMIT 1""", (request_id,))
    if row is None:
        return None
    submission_id, status, error, by, at = row
    return SubmissionInfo(submissionId=submission_id, status=status, error=error, submittedBy=by,
                          submittedAt=iso(at) or "")


def _resolution(db: Database, request_id: str) -> Resolution | None:
    text = db.scalar("SELECT resolution_json FROM interaction_requests WHERE request_id = ?", (request_id,))
    return None if text is None else msgspec.json.decode(text, type=Resolution)


def count_open(db: Database) -> int:
    result: int = db.scalar(
        f"SELECT COUNT(*) FROM interaction_requests INDEXED BY interaction_requests_open WHERE {OPEN}")
    return result
