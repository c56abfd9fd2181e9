"""Answering a worker: fenced by the claim token, checked against the run revision,
and recorded so a repeated message id gets the stored answer (seed 001)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..errors import ClaimLost, PiwfError, Rejected
from ..store import queue, runs, workers
from ..wire import WorkerMessage, WorkerResponse
from .state import ActiveRun, HostState, log

# An operation returns (result, settles the run?).
Handler = Callable[[HostState, ActiveRun, dict[str, Any], int], tuple[Any, bool]]


def _ready(host: HostState, active: ActiveRun, payload: dict[str, Any], now: int) -> tuple[Any, bool]:
    queue.mark_running(host.db, active.run_id, active.claim.token, now)
    workers.mark_ready(host.db, active.worker_epoch, now)
    _, _, _, run_input, _ = runs.run_source(host.db, active.run_id)
    return {"input": run_input, "steps": runs.accepted_steps(host.db, active.run_id)}, False


def _attempt_start(host: HostState, active: ActiveRun, payload: dict[str, Any], now: int) -> tuple[Any, bool]:
    if runs.is_paused(host.db, active.run_id):
        return {"stop": "paused"}, False
    attempt_id, _ = runs.start_attempt(
        host.db, active.run_id, active.claim.token, seq=_int(payload, "seq"), node=_str(payload, "node"),
        generation=active.claim.generation, now=now,
    )
    return {"attemptId": attempt_id}, False


def _attempt_accept(host: HostState, active: ActiveRun, payload: dict[str, Any], now: int) -> tuple[Any, bool]:
    runs.accept_attempt(host.db, active.run_id, active.claim.token, attempt_id=_str(payload, "attemptId"),
                        output=payload.get("output"), exit_name=_str(payload, "exit"), now=now)
    return {}, False


def _attempt_fail(host: HostState, active: ActiveRun, payload: dict[str, Any], now: int) -> tuple[Any, bool]:
    runs.fail_attempt(host.db, active.run_id, active.claim.token, attempt_id=_str(payload, "attemptId"),
                      error=_dict(payload, "error"), now=now)
    return {}, False


def _run_complete(host: HostState, active: ActiveRun, payload: dict[str, Any], now: int) -> tuple[Any, bool]:
    queue.complete_run(host.db, active.run_id, active.claim.token, payload.get("output"), now)
    return {}, True


def _run_fail(host: HostState, active: ActiveRun, payload: dict[str, Any], now: int) -> tuple[Any, bool]:
    queue.fail_run(host.db, active.run_id, active.claim.token, _dict(payload, "error"), now)
    return {}, True


def _run_park(host: HostState, active: ActiveRun, payload: dict[str, Any], now: int) -> tuple[Any, bool]:
    hold = _str(payload, "hold")
    if hold not in ("source",):
        raise Rejected(f"a worker cannot hold a run for {hold!r}")
    if not queue.park_run(host.db, active.run_id, active.claim.token, now, hold=hold,
                          detail=_str(payload, "reason")[:2000]):
        raise ClaimLost(f"the claim on run {active.run_id} is no longer live")
    return {}, True


HANDLERS: dict[str, Handler] = {
    "worker.ready": _ready,
    "attempt.start": _attempt_start,
    "attempt.accept": _attempt_accept,
    "attempt.fail": _attempt_fail,
    "run.complete": _run_complete,
    "run.fail": _run_fail,
    "run.park": _run_park,
}


def handle(host: HostState, active: ActiveRun, message: WorkerMessage) -> WorkerResponse:
    if message.workerEpoch != active.worker_epoch or message.generation != active.claim.generation:
        return WorkerResponse(message.messageId, "claimLost", error="worker epoch or generation is stale")
    stored = workers.read_message(host.db, message)
    if stored is not None:
        return stored
    handler = HANDLERS.get(message.operation)
    if handler is None:
        return WorkerResponse(message.messageId, "rejected", error=f"unknown worker operation {message.operation!r}")
    now = host.now()
    try:
        with host.db.write():
            queue.require_claim(host.db, active.run_id, active.claim.token, now)
            current = runs.revision(host.db, active.run_id)
            if message.operation != "worker.ready" and message.expectedRevision != current:
                raise Rejected(f"run revision conflict: expected {message.expectedRevision}, now {current}")
            result, settles = handler(host, active, message.payload, now)
            response = WorkerResponse(message.messageId, "accepted",
                                      revision=runs.revision(host.db, active.run_id), result=result)
            workers.record_message(host.db, message, response, now)
    except ClaimLost as exc:
        active.stop("claimLost")
        return WorkerResponse(message.messageId, "claimLost", error=str(exc))
    except PiwfError as exc:
        log.warning("run %s: worker %s refused: %s", active.run_id, message.operation, exc)
        return WorkerResponse(message.messageId, "rejected", error=str(exc))
    if message.operation == "worker.ready":
        active.ready.set()
    if settles:
        active.settled = True
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
