"""Answering a worker: each message is one store operation, fenced by the claim token,
checked against the run revision, and recorded so a repeated message id gets the stored
answer (seed 001; the latest answer is kept in memory until the next message's unit of
work stores it: ``handle``). Messages arrive typed (``piwf.protocol.worker``): a payload that does
not fit its operation never reaches here.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import trio

from piwf import faults, processes
from piwf.errors import ClaimLost, PiwfError, ProtocolError, Rejected
from piwf.status import Hold, NotificationKind, WorkerStatus
from piwf.store.api import UnitOfWork
from piwf.store.api.rules import STEPS_PAGE_BYTES
from piwf.protocol.worker import (
    AcceptedStep, AttemptAccept, AttemptFail, AttemptStart, AttemptStartResult, EffectApply, EffectReserve,
    EffectSettle, EffectState, InteractionOpen, NotificationSend, PresentationRequest, ProcessRegister,
    ProcessUnregister, Ready, ReadyResult, Result, RunComplete, RunFail, StartedAttempt, StepsPage, StepsRead,
    SubmissionReject, UpdatePublish, WorkerMessage, WorkerResponse, reused_id, worker_fingerprint,
)
from piwf.host.lane_state import NodeClock, ProcessEnd
from piwf.host.state import ActiveRun, Conclusion, HostState, log

# A handler makes store calls only, on the message's unit of work ``tx``, and returns its
# result and, when the answer ends the worker's part, why. It awaits nothing but them.
Outcome = tuple[Result, Conclusion | None]

Handler = Callable[[HostState, UnitOfWork, ActiveRun, Any, int], Awaitable[Outcome]]
NOTHING = Result()
# What a message that ended its run (completed or failed it, not held) answers: NOTHING's
# like, told apart by identity (``handle`` stores no answer that its unit of work deletes).
RUN_ENDED = Result()


async def _ready(host: HostState, tx: UnitOfWork, active: ActiveRun, message: Ready, now: int) -> Outcome:
    """The worker has loaded its workflow: the run's input and accepted steps. A fresh
    run's first attempt is started here too, saving the worker a round trip (unless the run
    is paused: then its first start stops). A workflow that did not load, or whose digest
    is not the run's, releases the run for a host that can load it, or holds it when no
    live host of its queue can (store/sql/placement.py). Its first write is the fence: the
    unit of work runs no other before it (``handle``), and ``mark_running`` holds the claim's
    row as the fence does, or takes the fence itself (ClaimLost when the claim is gone)."""
    await tx.queue.mark_running(active.claim.run_id, active.claim.token, now)
    await tx.workers.mark_ready(active.worker_id, now, pid=active.pid, identity=active.identity)
    run_input, start, paused, digest = await tx.runs.ready_state(active.claim.run_id)
    unloadable = _source_problem(message, digest)
    if unloadable is not None:  # not here: released for a host that can (or held when none can)
        if await tx.placement.release_unloadable(active.claim.run_id, active.claim.token, host_id=host.host_id,
                                                 reason=unloadable, source_hash=message.payload.sourceHash, now=now):
            log.warning("%s: held: no live host of its queue can load its workflow (here: %s)", active.label,
                        unloadable)
        else:
            log.info("%s: released for another host: %s", active.label, unloadable)
        return ReadyResult(stop="source"), Conclusion.DONE
    # The run's first claim, and this worker's first message (one that sent attempts before
    # its ready is not trusted to have sent none): no attempt of the run exists yet (none
    # accepted, none waiting), so neither is read.
    first = active.claim.first and not active.ready.is_set() and not active.answered
    steps, more = ([], False) if first else await tx.runs.accepted_steps(active.claim.run_id, budget=STEPS_PAGE_BYTES)
    result = ReadyResult(input=run_input, steps=[AcceptedStep(**step) for step in steps], more=more)
    if not steps and start is not None and not paused and (first or await tx.interactions.waiting_attempt(
            active.claim.run_id, 0, start, now) is None):  # a first node that waits is started by the worker
        attempt_id, _, started = await tx.runs.begin_attempt(active.claim.run_id, active.claim.token, seq=0,
                                                             node=start, generation=active.claim.generation, now=now)
        change, value = await _settings(tx, active, attempt_id, started)
        result.attempt = StartedAttempt(seq=0, node=start, attemptId=attempt_id, settings=value,
                                        settingsChange=change)
    return result, None


def _source_problem(message: Ready, digest: str) -> str | None:
    loaded = message.payload
    if loaded.loadError is not None:
        return f"workflow cannot load: {loaded.loadError}"
    if loaded.digest != digest:
        return f"workflow source changed (digest {str(loaded.digest)[:19]}, run has {digest[:19]})"
    return None


async def _steps_read(host: HostState, tx: UnitOfWork, active: ActiveRun, message: StepsRead, now: int) -> Outcome:
    steps, more = await tx.runs.accepted_steps(active.claim.run_id, message.payload.afterSeq, budget=STEPS_PAGE_BYTES)
    return StepsPage(steps=[AcceptedStep(**step) for step in steps], more=more), None


async def _attempt_start(host: HostState, tx: UnitOfWork,
          active: ActiveRun, message: AttemptStart, now: int) -> Outcome:
    """Start a node's attempt; at a node waiting for its request, hand over the waiting
    attempt with the submission to validate, or (nothing to validate) park the run as
    waiting again."""
    if await tx.runs.is_paused(active.claim.run_id):
        return AttemptStartResult(stop="paused"), Conclusion.STOP
    payload = message.payload
    waiting = await tx.interactions.waiting_attempt(active.claim.run_id, payload.seq, payload.node, now)
    if waiting is not None:
        attempt_id, submission = waiting
        if submission is None:
            await tx.interactions.park_again(active.claim.run_id, active.claim.token, now)
            return AttemptStartResult(stop="waiting"), Conclusion.DONE
        change, value = await tx.settings.attempt_settings(active.claim.run_id, attempt_id)
        return AttemptStartResult(attemptId=attempt_id, submission=submission, settings=value,
                                  settingsChange=change), None
    attempt_id, _, started = await tx.runs.begin_attempt(active.claim.run_id, active.claim.token, seq=payload.seq,
                                                         node=payload.node, generation=active.claim.generation, now=now)
    change, value = await _settings(tx, active, attempt_id, started)
    return AttemptStartResult(attemptId=attempt_id, settings=value, settingsChange=change), None


async def _settings(tx: UnitOfWork, active: ActiveRun, attempt_id: str, started: int | None) -> tuple[int | None, Any]:
    """(change number, settings) of an attempt just started, whose insert found the change
    number ``started``: None, its run has no settings, and there is nothing to read."""
    if started is None:
        return None, None
    return await tx.settings.attempt_settings(active.claim.run_id, attempt_id)


async def _attempt_accept(host: HostState, tx: UnitOfWork,
          active: ActiveRun, message: AttemptAccept, now: int) -> Outcome:
    """Accept a node's output; with ``final`` (the run's last node) complete the run with it,
    in the same transaction."""
    payload = message.payload
    await tx.runs.accept_attempt(active.claim.run_id, active.claim.token, attempt_id=payload.attemptId,
                        output=payload.output, exit_name=payload.exit, now=now,
                        waiting=payload.submissionId is not None)
    if payload.submissionId is not None:
        await tx.interactions.accept_submission(active.claim.run_id, payload.submissionId, payload.output, now)
    if payload.final:
        return await _complete(host, tx, active, payload.output, now)
    return NOTHING, None


async def _attempt_fail(host: HostState, tx: UnitOfWork, active: ActiveRun, message: AttemptFail, now: int) -> Outcome:
    await tx.runs.fail_attempt(active.claim.run_id, active.claim.token, attempt_id=message.payload.attemptId,
                      error=message.payload.error, now=now)
    return NOTHING, None


async def _run_complete(host: HostState, tx: UnitOfWork, active: ActiveRun, message: RunComplete, now: int) -> Outcome:
    return await _complete(host, tx, active, message.payload.output, now)


async def _complete(host: HostState, tx: UnitOfWork, active: ActiveRun, output: Any, now: int) -> Outcome:
    if await _held_for_effects(host, tx, active, now):
        return NOTHING, Conclusion.DONE
    await tx.queue.complete_run(active.claim.run_id, active.claim.token, output, now)
    return RUN_ENDED, Conclusion.DONE


async def _run_fail(host: HostState, tx: UnitOfWork, active: ActiveRun, message: RunFail, now: int) -> Outcome:
    if await _held_for_effects(host, tx, active, now):
        return NOTHING, Conclusion.DONE
    await tx.queue.fail_run(active.claim.run_id, active.claim.token, message.payload.error, now)
    return RUN_ENDED, Conclusion.DONE


async def _held_for_effects(host: HostState, tx: UnitOfWork, active: ActiveRun, now: int) -> bool:
    """A run does not end while an effect's outcome is unknown: it is held instead. That
    includes an effect this very worker still applies (a thread of the node left in its
    ``apply()`` when the node returned or raised): the worker ends with the run, so that
    ``apply()`` is cut short too, as one of an earlier generation was."""
    ambiguous = await tx.effects.interrupted_before(active.claim.run_id, active.claim.generation + 1, now)
    if ambiguous:
        await _hold_ambiguous(host, tx, active, ambiguous[0], now)
    return bool(ambiguous)


async def _hold_ambiguous(host: HostState, tx: UnitOfWork, active: ActiveRun, key: str, now: int) -> None:
    await tx.queue.park_run(active.claim.run_id, active.claim.token, now, hold=Hold.EFFECT,
                   detail=f"ambiguous effect {key}")


# --- effects -----------------------------------------------------------------------------


async def _effect_reserve(host: HostState, tx: UnitOfWork,
          active: ActiveRun, message: EffectReserve, now: int) -> Outcome:
    payload = message.payload
    state = EffectState(**await tx.effects.reserve(active.claim.run_id, payload.key, node=payload.node,
                                          generation=active.claim.generation, observable=payload.observable,
                                          now=now))
    if state.state == "ambiguous":
        await _hold_ambiguous(host, tx, active, payload.key, now)
        return state, Conclusion.DONE
    return state, None


async def _effect_apply(host: HostState, tx: UnitOfWork, active: ActiveRun, message: EffectApply, now: int) -> Outcome:
    await tx.effects.begin_apply(active.claim.run_id, message.payload.key, generation=active.claim.generation, now=now)
    return NOTHING, None


async def _effect_settle(host: HostState, tx: UnitOfWork,
          active: ActiveRun, message: EffectSettle, now: int) -> Outcome:
    payload = message.payload
    await tx.effects.settle(active.claim.run_id, payload.key, generation=active.claim.generation,
                   result=payload.result, error=payload.error, now=now)
    return NOTHING, None


# --- processes a worker started in their own groups ---------------------------------------


async def _process_register(host: HostState, tx: UnitOfWork,
          active: ActiveRun, message: ProcessRegister, now: int) -> Outcome:
    """The host kills a registered process's group when its worker ends, so only what the
    worker itself started may be registered (seed 000): a live direct child of the worker
    that leads its own process group, not registered to another worker. Its identity is
    the host's own reading of it, not the worker's word."""
    payload = message.payload
    active.registered = True  # from now on its end reads the groups registered (this one, if it commits)
    identity = _own_group_leader(active, payload.pid)
    if identity != payload.identity:
        raise Rejected(f"process {payload.pid} is not the one the worker named (its start identity differs)")
    active.groups[payload.pid] = identity  # the fence kills it with no store to ask (host/fence.py)
    await tx.workers.register_process(worker_id=active.worker_id, run_id=active.claim.run_id, pid=payload.pid,
                             identity=identity, node=payload.node, now=now)
    return NOTHING, None


def _own_group_leader(active: ActiveRun, pid: int) -> str:
    """The start identity of ``pid``, a live child of the worker leading its own group."""
    if pid <= 0:
        raise Rejected(f"process pid must be positive, not {pid}")
    found = processes.parent_and_group(pid)
    if found is None or active.pid is None or found[0] != active.pid:
        raise Rejected(f"process {pid} is not a child of the worker (pid {active.pid})")
    if found[1] != pid:
        raise Rejected(f"process {pid} does not lead its own process group (its group is {found[1]})")
    identity = processes.identity(pid)
    if identity is None:
        raise Rejected(f"process {pid} is gone")
    return identity


async def _process_unregister(host: HostState, tx: UnitOfWork,
          active: ActiveRun, message: ProcessUnregister, now: int) -> Outcome:
    if not await tx.workers.unregister_process(active.worker_id, message.payload.pid, now):
        raise Rejected(f"process {message.payload.pid} is not registered to this worker")
    active.groups.pop(message.payload.pid, None)
    return NOTHING, None


# --- people and agents in the loop ---------------------------------------------------------


async def _interaction_open(host: HostState, tx: UnitOfWork,
          active: ActiveRun, message: InteractionOpen, now: int) -> Outcome:
    """A decision or ask node waits: the run parks as waiting and the worker's part ends."""
    await tx.interactions.open_request(active.claim.run_id, active.claim.token, message.payload, now)
    return NOTHING, Conclusion.DONE  # the deadline timer is woken once this commits (OPENS_REQUESTS)


async def _submission_reject(host: HostState, tx: UnitOfWork,
          active: ActiveRun, message: SubmissionReject, now: int) -> Outcome:
    payload = message.payload
    await tx.interactions.reject_submission(active.claim.run_id, active.claim.token, payload.submissionId,
                                   payload.error, now)
    return NOTHING, Conclusion.DONE


# --- delivery to sessions ---------------------------------------------------------------------


async def _notification_send(host: HostState, tx: UnitOfWork,
          active: ActiveRun, message: NotificationSend, now: int) -> Outcome:
    payload = message.payload
    await tx.delivery.notify(active.claim.run_id, active.claim.token, attempt_id=payload.attemptId,
                             index=payload.index, kind=NotificationKind(payload.kind), content=payload.content, now=now)
    return NOTHING, None


async def _presentation_request(host: HostState, tx: UnitOfWork,
          active: ActiveRun, message: PresentationRequest, now: int) -> Outcome:
    await tx.delivery.request_presentation(active.claim.run_id, active.claim.token,
                                  instructions=message.payload.instructions, now=now)
    return NOTHING, None


async def _update_publish(host: HostState, tx: UnitOfWork,
          active: ActiveRun, message: UpdatePublish, now: int) -> Outcome:
    payload = message.payload
    await tx.updates.publish(active.claim.run_id, active.claim.token, attempt_id=payload.attemptId, type=payload.type,
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
# Operations after which a request waits (opened, or open again): its deadline is kept.
OPENS_REQUESTS = frozenset({InteractionOpen, SubmissionReject})


def _ends_run(message: WorkerMessage) -> bool:
    """The message completes or fails the run (unless an effect holds it)."""
    return isinstance(message, (RunComplete, RunFail)) or (isinstance(message, AttemptAccept) and message.payload.final)


# A node's attempt ends with these: its time limit (if it has one) no longer runs.
ENDS_NODE = (AttemptAccept, AttemptFail, RunComplete, RunFail, InteractionOpen, SubmissionReject)


def _clock_node(host: HostState, active: ActiveRun, message: WorkerMessage, result: Result) -> None:
    """Keep the clock of the attempt that runs under a time limit: started with the
    attempt (by ``worker.ready`` for a fresh run's first node, else ``attempt.start``),
    stopped by the message that ends it. The pump stops the worker at its deadline."""
    if isinstance(message, Ready):
        active.limits = dict(message.payload.limits)
        if isinstance(result, ReadyResult) and result.attempt is not None:
            _start_clock(host, active, result.attempt.attemptId, result.attempt.node, validating=False)
    elif isinstance(message, AttemptStart) and isinstance(result, AttemptStartResult) and result.attemptId:
        _start_clock(host, active, result.attemptId, message.payload.node, validating=result.submission is not None)
    elif isinstance(message, ENDS_NODE):
        active.node_clock = None


def _start_clock(host: HostState, active: ActiveRun, attempt_id: str, node: str, *, validating: bool) -> None:
    """The node's own limit, or the host's (``serve --node-time-limit``) when that is shorter."""
    limit = active.limits.get(node)
    own = None if limit is None or limit.ms is None else limit.ms / 1000
    seconds = min((s for s in (own, host.config.node_time_limit_s) if s is not None), default=None)
    active.node_clock = None if seconds is None else NodeClock(
        attempt_id, node, seconds, limit is not None and limit.timeoutExit, validating, trio.current_time() + seconds,
        by_host=seconds != own)


def _last_answer(active: ActiveRun, message: WorkerMessage) -> WorkerResponse | None:
    """The answer to a repeat of the worker's latest answered message, which is stored only
    with its next one (or never, when none comes): kept here meanwhile, with the worker's
    pipe (only its own worker can repeat it, and only while this host is its host)."""
    last = active.last_answer
    if last is None or last[0].messageId != message.messageId:
        return None
    answered: WorkerResponse = last[1]
    return answered if worker_fingerprint(last[0]) == worker_fingerprint(message) else reused_id(message)


def _answers_stored(active: ActiveRun) -> bool:
    """Whether any answer to a worker of the run may be stored: each committed unit but the
    one ending the run stores the answer before it, so this worker stored some once two of
    its messages were answered; and a run claimed before may have had other workers."""
    return not active.claim.first or len(active.answered) >= 2


def ahead_exit_code(active: ActiveRun) -> int | None:
    """The exit code a worker's end is recorded with ahead, with the message that ended its
    run: 0, or none for one that may be kept warm (it is expected to say idle)."""
    return None if active.warm is not None and active.warm.reusable else 0


def ahead_diagnostic(active: ActiveRun) -> str:
    """What the worker's record says ahead: what it printed so far, and a kept worker's note."""
    printed = active.output.text() if active.output is not None else ""
    if active.warm is None or not active.warm.reusable:
        return printed
    return ProcessEnd(None, printed).noted(active.warm.kept_note).diagnostic


async def handle(host: HostState, active: ActiveRun, message: WorkerMessage) -> WorkerResponse:
    """Answer one message of the worker, in one unit of work with its changes. Its answer
    is kept in ``active.last_answer`` and stored (``workers.record_message``) in the unit
    of work of the worker's next message: only the worker can repeat a message id, on its
    pipe, while this host is its host, and it sends one message at a time. The unit that
    ends a worker's run also records the worker's end (a warm one's as it will be once idle), which deletes its stored
    answers (the run has ended): it stores none, so a fresh one-node run stores none at
    all. A repeat is answered from either, or refused when its body changed."""
    if message.workerEpoch != active.worker_id or message.generation != active.claim.generation:
        # Each worker has a pipe of its own: a stale worker's messages come on its own pipe,
        # with its own claim, and the store's fence refuses them (claimLost). One that names
        # another worker or generation than its pipe's lies: the pump stops it as a crash.
        raise ProtocolError(f"a message for worker {message.workerEpoch} generation {message.generation} "
                            f"on the pipe of worker {active.worker_id} generation {active.claim.generation}")
    if message.messageId in active.answered:  # a repeat gets the stored answer (new ids skip the lookup)
        stored = _last_answer(active, message) or await host.store.workers.read_message(message)
        if stored is not None:
            return stored
    # A worker told its run has ended exits, or (one that may be kept warm) says idle: its
    # end is recorded in the same unit of work (one transaction per run less), as it will
    # be, with what it printed so far and exit code 0, or no exit code and the note a kept
    # worker's record has; one that then ends otherwise has its record amended (run_lane.end_of).
    ends = _ends_run(message)
    printed = ahead_diagnostic(active) if ends else ""

    async def answer(tx: UnitOfWork) -> tuple[WorkerResponse, Result, Conclusion | None]:
        """One unit of work: the fence (the live claim and the run revision), the revision
        check, the handler's changes, the worker's previous answer recorded (and the
        worker's end, when its run ended); nothing of it if any raises. It awaits store
        calls only (``run_unit``: on PostgreSQL one thread hop for all)."""
        kind, now = type(message), host.now()
        current = None  # a ready is not checked against a revision, and its handler's first write fences it
        if kind is not Ready:
            current = await tx.queue.fenced_revision(active.claim.run_id, active.claim.token, now)
            if message.expectedRevision != current:
                raise Rejected(f"run revision conflict: expected {message.expectedRevision}, now {current}")
        result, conclusion = await HANDLERS[kind](host, tx, active, message, now)
        revision = await tx.queue.revision_of(active.claim.run_id) if kind in REVISING else current
        response = WorkerResponse(message.messageId, "accepted", revision=revision, result=result)
        if active.last_answer is not None and not (ends and result is RUN_ENDED):  # else the worker's end,
            previous, answered = active.last_answer                                 # below, would delete it
            await tx.workers.record_message(previous, answered, now)
        if ends and conclusion is Conclusion.DONE:
            await tx.supervision.end_worker(
                worker_id=active.worker_id, run_id=active.claim.run_id, token=active.claim.token,
                status=WorkerStatus.EXITED, now=now, exit_code=ahead_exit_code(active), signal=None,
                diagnostic=printed or None, park=False,
                max_crashes=host.config.max_crashes, answers=_answers_stored(active))
        return response, result, conclusion

    kind = type(message)
    try:
        response, result, conclusion = await host.run_unit(answer)
        active.answered.add(message.messageId)
        active.last_answer = (message, response)  # nothing awaited since the commit: kept as surely as committed
        if ends and conclusion is Conclusion.DONE:
            active.end_recorded = printed
            active.run_ended = result is RUN_ENDED
        faults.point("host.worker.committed")
    except ClaimLost as exc:  # the answer is sent; the worker ends on it (see lane._lingered)
        active.conclusion = Conclusion.CLAIM_LOST
        return WorkerResponse(message.messageId, "claimLost", error=str(exc))
    except PiwfError as exc:
        log.warning("run %s: worker %s refused: %s", active.claim.run_id, message.operation, exc)
        return WorkerResponse(message.messageId, "rejected", error=str(exc))
    if kind is Ready:
        active.ready.set()
    _clock_node(host, active, message, result)
    if conclusion is not None:
        active.conclusion = conclusion
    if kind in OPENS_REQUESTS:  # after the commit: a timer reading before it (another connection) would miss it
        host.interactions_changed()
    host.changed()
    return response
