"""Answering a worker: each message is one store operation, fenced by the claim token,
checked against the run revision, and recorded so a repeated message id gets the stored
answer (seed 001). Messages arrive typed (``piwf.protocol.worker``): a payload that does
not fit its operation never reaches here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from piwf import faults
from piwf.errors import ClaimLost, PiwfError
from piwf.status import Hold
from piwf.store.sqlite import delivery, effects, interactions, queue, runs, settings, updates, workers
from piwf.protocol.worker import (
    AcceptedStep, AttemptAccept, AttemptFail, AttemptStart, AttemptStartResult, EffectApply, EffectReserve,
    EffectSettle, EffectState, InteractionOpen, NotificationSend, PresentationRequest, ProcessRegister,
    ProcessUnregister, Ready, ReadyResult, Result, RunComplete, RunFail, StartedAttempt, StepsPage, StepsRead,
    SubmissionReject, UpdatePublish, WorkerMessage, WorkerResponse,
)
from piwf.host.state import ActiveRun, Conclusion, HostState, log

# A handler makes store calls only, inside the message's transaction, and returns its
# result and, when the answer ends the worker's part, why.
Outcome = tuple[Result, Conclusion | None]
Handler = Callable[[HostState, ActiveRun, Any, int], Outcome]
NOTHING = Result()


def _ready(host: HostState, active: ActiveRun, message: Ready, now: int) -> Outcome:
    """The worker has loaded its workflow: the run's input and accepted steps. A fresh
    run's first attempt is started here too, saving the worker a round trip (unless the run
    is paused: then its first start stops). A workflow that did not load, or whose digest
    is not the run's, holds the run instead."""
    queue.mark_running(host.db, active.run_id, active.claim.token, now)
    workers.mark_ready(host.db, active.worker_epoch, now)
    run_input, start, paused, digest = runs.ready_state(host.db, active.run_id)
    held = _source_problem(message, digest)
    if held is not None:
        queue.park_run(host.db, active.run_id, active.claim.token, now, hold=Hold.SOURCE, detail=held[:2000])
        return ReadyResult(stop="source"), Conclusion.DONE
    steps, more = runs.accepted_steps(host.db, active.run_id, budget=runs.STEPS_PAGE_BYTES)
    result = ReadyResult(input=run_input, steps=[AcceptedStep(**step) for step in steps], more=more)
    if not steps and start is not None and not paused and interactions.waiting_attempt(
            host.db, active.run_id, 0, start, now) is None:  # a first node that waits is started by the worker
        attempt_id, _ = runs.start_attempt(host.db, active.run_id, active.claim.token, seq=0, node=start,
                                           generation=active.claim.generation, now=now)
        change, value = settings.attempt_settings(host.db, active.run_id, attempt_id)
        result.attempt = StartedAttempt(seq=0, node=start, attemptId=attempt_id, settings=value,
                                        settingsChange=change)
    return result, None


def _source_problem(message: Ready, digest: str) -> str | None:
    loaded = message.payload
    if loaded.loadError is not None:
        return f"workflow cannot load: {loaded.loadError}"
    if loaded.digest != digest:
        return (f"workflow source changed (digest {str(loaded.digest)[:19]}, run has {digest[:19]}); "
                "resume to run the new source")
    return None


def _steps_read(host: HostState, active: ActiveRun, message: StepsRead, now: int) -> Outcome:
    steps, more = runs.accepted_steps(host.db, active.run_id, message.payload.afterSeq, budget=runs.STEPS_PAGE_BYTES)
    return StepsPage(steps=[AcceptedStep(**step) for step in steps], more=more), None


def _attempt_start(host: HostState, active: ActiveRun, message: AttemptStart, now: int) -> Outcome:
    """Start a node's attempt; at a node waiting for its request, hand over the waiting
    attempt with the submission to validate, or (nothing to validate) park the run as
    waiting again."""
    if runs.is_paused(host.db, active.run_id):
        return AttemptStartResult(stop="paused"), Conclusion.STOP
    payload = message.payload
    waiting = interactions.waiting_attempt(host.db, active.run_id, payload.seq, payload.node, now)
    if waiting is not None:
        attempt_id, submission = waiting
        if submission is None:
            interactions.park_again(host.db, active.run_id, active.claim.token, now)
            return AttemptStartResult(stop="waiting"), Conclusion.DONE
        return _started(host, active, attempt_id, submission), None
    attempt_id, _ = runs.start_attempt(host.db, active.run_id, active.claim.token, seq=payload.seq,
                                       node=payload.node, generation=active.claim.generation, now=now)
    return _started(host, active, attempt_id), None


def _started(host: HostState, active: ActiveRun, attempt_id: str, submission: Any = None) -> AttemptStartResult:
    """An attempt to run, with the settings (and their change number) it started under."""
    change, value = settings.attempt_settings(host.db, active.run_id, attempt_id)
    return AttemptStartResult(attemptId=attempt_id, submission=submission, settings=value, settingsChange=change)


def _attempt_accept(host: HostState, active: ActiveRun, message: AttemptAccept, now: int) -> Outcome:
    """Accept a node's output; with ``final`` (the run's last node) complete the run with it,
    in the same transaction."""
    payload = message.payload
    runs.accept_attempt(host.db, active.run_id, active.claim.token, attempt_id=payload.attemptId,
                        output=payload.output, exit_name=payload.exit, now=now,
                        waiting=payload.submissionId is not None)
    if payload.submissionId is not None:
        interactions.accept_submission(host.db, active.run_id, payload.submissionId, payload.output, now)
    if payload.final:
        return _complete(host, active, payload.output, now)
    return NOTHING, None


def _attempt_fail(host: HostState, active: ActiveRun, message: AttemptFail, now: int) -> Outcome:
    runs.fail_attempt(host.db, active.run_id, active.claim.token, attempt_id=message.payload.attemptId,
                      error=message.payload.error, now=now)
    return NOTHING, None


def _run_complete(host: HostState, active: ActiveRun, message: RunComplete, now: int) -> Outcome:
    return _complete(host, active, message.payload.output, now)


def _complete(host: HostState, active: ActiveRun, output: Any, now: int) -> Outcome:
    if not _held_for_effects(host, active, now):
        queue.complete_run(host.db, active.run_id, active.claim.token, output, now)
    return NOTHING, Conclusion.DONE


def _run_fail(host: HostState, active: ActiveRun, message: RunFail, now: int) -> Outcome:
    if not _held_for_effects(host, active, now):
        queue.fail_run(host.db, active.run_id, active.claim.token, message.payload.error, now)
    return NOTHING, Conclusion.DONE


def _held_for_effects(host: HostState, active: ActiveRun, now: int) -> bool:
    """A run does not end while an effect's outcome is unknown: it is held instead."""
    ambiguous = effects.interrupted_before(host.db, active.run_id, active.claim.generation, now)
    if ambiguous:
        _hold_ambiguous(host, active, ambiguous[0], now)
    return bool(ambiguous)


def _hold_ambiguous(host: HostState, active: ActiveRun, key: str, now: int) -> None:
    queue.park_run(host.db, active.run_id, active.claim.token, now, hold=Hold.EFFECT,
                   detail=f"ambiguous effect {key}")


# --- effects -----------------------------------------------------------------------------


def _effect_reserve(host: HostState, active: ActiveRun, message: EffectReserve, now: int) -> Outcome:
    payload = message.payload
    state = EffectState(**effects.reserve(host.db, active.run_id, payload.key, node=payload.node,
                                          generation=active.claim.generation, observable=payload.observable,
                                          now=now))
    if state.state == "ambiguous":
        _hold_ambiguous(host, active, payload.key, now)
        return state, Conclusion.DONE
    return state, None


def _effect_apply(host: HostState, active: ActiveRun, message: EffectApply, now: int) -> Outcome:
    effects.begin_apply(host.db, active.run_id, message.payload.key, generation=active.claim.generation, now=now)
    return NOTHING, None


def _effect_settle(host: HostState, active: ActiveRun, message: EffectSettle, now: int) -> Outcome:
    payload = message.payload
    effects.settle(host.db, active.run_id, payload.key, generation=active.claim.generation,
                   result=payload.result, error=payload.error, now=now)
    return NOTHING, None


# --- processes a worker started in their own groups ---------------------------------------


def _process_register(host: HostState, active: ActiveRun, message: ProcessRegister, now: int) -> Outcome:
    payload = message.payload
    workers.register_process(host.db, worker_epoch=active.worker_epoch, run_id=active.run_id, pid=payload.pid,
                             identity=payload.identity, node=payload.node, now=now)
    return NOTHING, None


def _process_unregister(host: HostState, active: ActiveRun, message: ProcessUnregister, now: int) -> Outcome:
    workers.unregister_process(host.db, active.worker_epoch, message.payload.pid, now)
    return NOTHING, None


# --- people and agents in the loop ---------------------------------------------------------


def _interaction_open(host: HostState, active: ActiveRun, message: InteractionOpen, now: int) -> Outcome:
    """A decision or ask node waits: the run parks as waiting and the worker's part ends."""
    interactions.open_request(host.db, active.run_id, active.claim.token, message.payload, now)
    host.interactions_changed()
    return NOTHING, Conclusion.DONE


def _submission_reject(host: HostState, active: ActiveRun, message: SubmissionReject, now: int) -> Outcome:
    payload = message.payload
    interactions.reject_submission(host.db, active.run_id, active.claim.token, payload.submissionId,
                                   payload.error, now)
    host.interactions_changed()
    return NOTHING, Conclusion.DONE


# --- delivery to sessions ---------------------------------------------------------------------


def _notification_send(host: HostState, active: ActiveRun, message: NotificationSend, now: int) -> Outcome:
    payload = message.payload
    delivery.notify(host.db, active.run_id, active.claim.token, attempt_id=payload.attemptId, index=payload.index,
                    kind=payload.kind, content=payload.content, now=now)
    return NOTHING, None


def _presentation_request(host: HostState, active: ActiveRun, message: PresentationRequest, now: int) -> Outcome:
    delivery.request_presentation(host.db, active.run_id, active.claim.token,
                                  instructions=message.payload.instructions, now=now)
    return NOTHING, None


def _update_publish(host: HostState, active: ActiveRun, message: UpdatePublish, now: int) -> Outcome:
    payload = message.payload
    updates.publish(host.db, active.run_id, active.claim.token, attempt_id=payload.attemptId, type=payload.type,
                    key=payload.key, data=payload.data, now=now)
    return NOTHING, None


HANDLERS: dict[type[WorkerMessage], Handler] = {
    Ready: _ready,
    StepsRead: _steps_read,
    AttemptStart: _attempt_start,
    AttemptAccept: _attempt_accept,
    AttemptFail: _attempt_fail,
    RunComplete: _run_complete,
    RunFail: _run_fail,
    EffectReserve: _effect_reserve,
    EffectApply: _effect_apply,
    EffectSettle: _effect_settle,
    ProcessRegister: _process_register,
    ProcessUnregister: _process_unregister,
    InteractionOpen: _interaction_open,
    SubmissionReject: _submission_reject,
    NotificationSend: _notification_send,
    PresentationRequest: _presentation_request,
    UpdatePublish: _update_publish,
}
# Operations that may change the run revision; the others leave it as it was.
REVISING = frozenset({Ready, AttemptStart, AttemptAccept, AttemptFail, RunComplete, RunFail, InteractionOpen,
                      SubmissionReject})


def handle(host: HostState, active: ActiveRun, message: WorkerMessage) -> WorkerResponse:
    if message.workerEpoch != active.worker_epoch or message.generation != active.claim.generation:
        active.conclusion = Conclusion.CLAIM_LOST
        return WorkerResponse(message.messageId, "claimLost", error="worker epoch or generation is stale")
    if message.messageId in active.answered:  # a repeat gets the stored answer (new ids skip the lookup)
        stored = workers.read_message(host.db, message)
        if stored is not None:
            return stored
    kind, handler, now = type(message), HANDLERS[type(message)], host.now()
    try:
        response, conclusion = workers.answer(
            host.db, message, run_id=active.run_id, token=active.claim.token, now=now,
            check_revision=kind is not Ready, revises=kind in REVISING,
            apply=lambda: handler(host, active, message, now))
        active.answered.add(message.messageId)
        faults.point("host.worker.committed")
    except ClaimLost as exc:  # the answer is sent; the worker ends on it (see worker_process._let_it_end)
        active.conclusion = Conclusion.CLAIM_LOST
        return WorkerResponse(message.messageId, "claimLost", error=str(exc))
    except PiwfError as exc:
        log.warning("run %s: worker %s refused: %s", active.run_id, message.operation, exc)
        return WorkerResponse(message.messageId, "rejected", error=str(exc))
    if kind is Ready:
        active.ready.set()
    if conclusion is not None:
        active.conclusion = conclusion
    host.changed()
    return response
