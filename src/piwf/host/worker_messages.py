"""Answering a worker: fenced by the claim token, checked against the run revision,
and recorded so a repeated message id gets the stored answer (seed 001)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .. import faults
from ..errors import ClaimLost, PiwfError, Rejected
from ..store import effects, queue, runs, workers
from ..wire import WorkerMessage, WorkerResponse
from .state import ActiveRun, Conclusion, HostState, log

# An operation returns its result and, when the answer ends the worker's part, why.
Handler = Callable[[HostState, ActiveRun, dict[str, Any], int], tuple[Any, Conclusion | None]]


def _ready(host: HostState, active: ActiveRun, payload: dict[str, Any], now: int) -> tuple[Any, Conclusion | None]:
    """The run's input and accepted steps. A fresh run's first attempt is started here too,
    saving the worker a round trip (unless the run is paused: then its first start stops)."""
    queue.mark_running(host.db, active.run_id, active.claim.token, now)
    workers.mark_ready(host.db, active.worker_epoch, now)
    run_input, start, paused = runs.ready_state(host.db, active.run_id)
    result = {"input": run_input, "steps": runs.accepted_steps(host.db, active.run_id)}
    if not result["steps"] and start is not None and not paused:
        attempt_id, _ = runs.start_attempt(host.db, active.run_id, active.claim.token, seq=0, node=start,
                                           generation=active.claim.generation, now=now)
        result["attempt"] = {"seq": 0, "node": start, "attemptId": attempt_id}
    return result, None


def _attempt_start(host: HostState, active: ActiveRun, payload: dict[str, Any], now: int) -> tuple[Any, Conclusion | None]:
    if runs.is_paused(host.db, active.run_id):
        return {"stop": "paused"}, Conclusion.STOP
    attempt_id, _ = runs.start_attempt(
        host.db, active.run_id, active.claim.token, seq=_int(payload, "seq"), node=_str(payload, "node"),
        generation=active.claim.generation, now=now,
    )
    return {"attemptId": attempt_id}, None


def _attempt_accept(host: HostState, active: ActiveRun, payload: dict[str, Any], now: int) -> tuple[Any, Conclusion | None]:
    """Accept a node's output; with ``final`` (the run's last node) complete the run with it,
    in the same transaction."""
    runs.accept_attempt(host.db, active.run_id, active.claim.token, attempt_id=_str(payload, "attemptId"),
                        output=payload.get("output"), exit_name=_str(payload, "exit"), now=now)
    if payload.get("final") is True:
        return _run_complete(host, active, payload, now)
    return {}, None


def _attempt_fail(host: HostState, active: ActiveRun, payload: dict[str, Any], now: int) -> tuple[Any, Conclusion | None]:
    runs.fail_attempt(host.db, active.run_id, active.claim.token, attempt_id=_str(payload, "attemptId"),
                      error=_dict(payload, "error"), now=now)
    return {}, None


def _run_complete(host: HostState, active: ActiveRun, payload: dict[str, Any], now: int) -> tuple[Any, Conclusion | None]:
    if _held_for_effects(host, active, now):
        return {}, Conclusion.SETTLED
    queue.complete_run(host.db, active.run_id, active.claim.token, payload.get("output"), now)
    return {}, Conclusion.SETTLED


def _run_fail(host: HostState, active: ActiveRun, payload: dict[str, Any], now: int) -> tuple[Any, Conclusion | None]:
    if _held_for_effects(host, active, now):
        return {}, Conclusion.SETTLED
    queue.fail_run(host.db, active.run_id, active.claim.token, _dict(payload, "error"), now)
    return {}, Conclusion.SETTLED


def _held_for_effects(host: HostState, active: ActiveRun, now: int) -> bool:
    """A run does not end while an effect's outcome is unknown: it is held instead."""
    ambiguous = effects.interrupted_before(host.db, active.run_id, active.claim.generation, now)
    if ambiguous:
        _hold_ambiguous(host, active, ambiguous[0], now)
    return bool(ambiguous)


def _hold_ambiguous(host: HostState, active: ActiveRun, key: str, now: int) -> None:
    queue.park_run(host.db, active.run_id, active.claim.token, now, hold="effect", detail=f"ambiguous effect {key}")


# --- effects -----------------------------------------------------------------------------


def _effect_reserve(host: HostState, active: ActiveRun, payload: dict[str, Any], now: int) -> tuple[Any, Conclusion | None]:
    key = _str(payload, "key")
    observable = payload.get("observable")
    if not isinstance(observable, bool):
        raise Rejected("worker payload field 'observable' must be true or false")
    state = effects.reserve(host.db, active.run_id, key, node=_str(payload, "node"),
                            generation=active.claim.generation, observable=observable, now=now)
    if state["state"] == "ambiguous":
        _hold_ambiguous(host, active, key, now)
        return state, Conclusion.SETTLED
    return state, None


def _effect_apply(host: HostState, active: ActiveRun, payload: dict[str, Any], now: int) -> tuple[Any, Conclusion | None]:
    effects.begin_apply(host.db, active.run_id, _str(payload, "key"), generation=active.claim.generation, now=now)
    return {}, None


def _effect_settle(host: HostState, active: ActiveRun, payload: dict[str, Any], now: int) -> tuple[Any, Conclusion | None]:
    error = payload.get("error")
    if error is not None and not isinstance(error, dict):
        raise Rejected("worker payload field 'error' must be an object")
    effects.settle(host.db, active.run_id, _str(payload, "key"), generation=active.claim.generation,
                   result=payload.get("result"), error=error, now=now)
    return {}, None


# --- processes a worker started in their own groups ---------------------------------------


def _process_register(host: HostState, active: ActiveRun, payload: dict[str, Any], now: int) -> tuple[Any, Conclusion | None]:
    workers.register_process(host.db, worker_epoch=active.worker_epoch, run_id=active.run_id,
                             pid=_int(payload, "pid"), identity=_str(payload, "identity"),
                             node=payload.get("node") if isinstance(payload.get("node"), str) else None, now=now)
    return {}, None


def _process_unregister(host: HostState, active: ActiveRun, payload: dict[str, Any], now: int) -> tuple[Any, Conclusion | None]:
    workers.unregister_process(host.db, active.worker_epoch, _int(payload, "pid"), now)
    return {}, None


def _run_park(host: HostState, active: ActiveRun, payload: dict[str, Any], now: int) -> tuple[Any, Conclusion | None]:
    hold = _str(payload, "hold")
    if hold not in ("source",):
        raise Rejected(f"a worker cannot hold a run for {hold!r}")
    if not queue.park_run(host.db, active.run_id, active.claim.token, now, hold=hold,
                          detail=_str(payload, "reason")[:2000]):
        raise ClaimLost(f"the claim on run {active.run_id} is no longer live")
    return {}, Conclusion.SETTLED


# Operations that may change the run revision; the others leave it as it was.
REVISING = frozenset({"worker.ready", "attempt.start", "attempt.accept", "attempt.fail", "run.complete", "run.fail"})

HANDLERS: dict[str, Handler] = {
    "worker.ready": _ready,
    "attempt.start": _attempt_start,
    "attempt.accept": _attempt_accept,
    "attempt.fail": _attempt_fail,
    "run.complete": _run_complete,
    "run.fail": _run_fail,
    "run.park": _run_park,
    "effect.reserve": _effect_reserve,
    "effect.apply": _effect_apply,
    "effect.settle": _effect_settle,
    "process.register": _process_register,
    "process.unregister": _process_unregister,
}


def handle(host: HostState, active: ActiveRun, message: WorkerMessage) -> WorkerResponse:
    if message.workerEpoch != active.worker_epoch or message.generation != active.claim.generation:
        active.conclusion = Conclusion.CLAIM_LOST
        return WorkerResponse(message.messageId, "claimLost", error="worker epoch or generation is stale")
    if message.messageId in active.answered:  # a repeat gets the stored answer (new ids skip the lookup)
        stored = workers.read_message(host.db, message)
        if stored is not None:
            return stored
    handler = HANDLERS.get(message.operation)
    if handler is None:
        return WorkerResponse(message.messageId, "rejected", error=f"unknown worker operation {message.operation!r}")
    now = host.now()
    try:
        with host.db.write():
            current = queue.fenced_revision(host.db, active.run_id, active.claim.token, now)
            if message.operation != "worker.ready" and message.expectedRevision != current:
                raise Rejected(f"run revision conflict: expected {message.expectedRevision}, now {current}")
            result, conclusion = handler(host, active, message.payload, now)
            if message.operation in REVISING:
                current = runs.revision(host.db, active.run_id)
            response = WorkerResponse(message.messageId, "accepted", revision=current, result=result)
            workers.record_message(host.db, message, response, now)
        active.answered.add(message.messageId)
        faults.point("host.worker.committed")
    except ClaimLost as exc:  # the answer is sent; the worker ends on it (see worker_process._let_it_end)
        active.conclusion = Conclusion.CLAIM_LOST
        return WorkerResponse(message.messageId, "claimLost", error=str(exc))
    except PiwfError as exc:
        log.warning("run %s: worker %s refused: %s", active.run_id, message.operation, exc)
        return WorkerResponse(message.messageId, "rejected", error=str(exc))
    if message.operation == "worker.ready":
        active.ready.set()
    if conclusion is not None:
        active.conclusion = conclusion
    host.changed()
    return response


def _str(payload: dict[str, Any], key: str) -> str:
    value = payload.get(key)
    if not isinstance(value, str) or not value:
        raise Rejected(f"worker payload field {key!r} must be non-empty text")
    return value


def _int(payload: dict[str, Any], key: str) -> int:
    value = payload.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise Rejected(f"worker payload field {key!r} must be a non-negative integer")
    return value


def _dict(payload: dict[str, Any], key: str) -> dict[str, Any]:
    value = payload.get(key)
    if not isinstance(value, dict):
        raise Rejected(f"worker payload field {key!r} must be an object")
    return value
