"""Answering a reconcile worker: each message is one unit of work, opened by the fence on
the resource's claim (which renews it, as the seed does on every worker message).

The pump is the lane's (host/lane.py), as for runs; ``workflow.ensure`` may first inspect
a workflow file (in a throwaway process, outside the transaction), and a settings change
its proposal.
"""

from __future__ import annotations

import secrets
from collections.abc import Awaitable, Callable
from typing import Any

from piwf.protocol.reconcile import (
    ChildRun, ReconcileFail, ReconcileFinish, ReconcileLog, ReconcileReady, ReconcileStart, WorkflowEnsure,
)
from piwf.errors import ClaimLost, PiwfError, ProtocolError, Rejected, Stale
from piwf.store.api import UnitOfWork
from piwf.wire import check_id
from piwf.protocol.worker import (
    EffectApply, EffectReserve, EffectSettle, EffectState, Result, WorkerMessage, WorkerResponse,
)
from piwf.host import reconcile_steering, settings_operations
from piwf.host.catalog import WorkflowInfo
from piwf.host.controller_state import ActiveReconcile
from piwf.host.state import Conclusion, HostState, log

NOTHING = Result()
Outcome = tuple[Result, Conclusion | None]


async def handle(host: HostState, active: ActiveReconcile, message: WorkerMessage) -> WorkerResponse:
    if message.workerEpoch != active.worker_id or message.generation != active.claim.claim_number:
        # not its own pipe's claim: a lie, stopped by the pump as a crash (worker_messages.handle)
        raise ProtocolError(f"a message for worker {message.workerEpoch} claim {message.generation} "
                            f"on the pipe of worker {active.worker_id} claim {active.claim.claim_number}")
    try:
        for attempt in range(1, settings_operations.REBASES + 1):  # prepared again when it went stale
            try:
                response, conclusion = await _prepare_and_handle(host, active, message)
                break
            except Stale:  # what it was prepared from moved before the write: prepare it again from what is now
                if attempt == settings_operations.REBASES:
                    raise
    except ClaimLost as exc:
        active.conclusion = Conclusion.CLAIM_LOST
        return WorkerResponse(message.messageId, "claimLost", error=str(exc))
    except PiwfError as exc:
        log.warning("%s: reconcile worker %s refused: %s", active.label, message.operation, exc)
        return WorkerResponse(message.messageId, "rejected", error=str(exc))
    if isinstance(message, ReconcileReady) and conclusion is None:
        active.ready.set()
    if isinstance(message, WorkflowEnsure):
        host.wake()  # a child run may have been queued
        host.changed()  # and watchers (run.watch, run.wait) should see it
    if conclusion is not None:
        active.conclusion = conclusion
        host.controllers.wake()
    return WorkerResponse(message.messageId, "accepted", result=response)


async def _prepare_and_handle(host: HostState, active: ActiveReconcile, message: WorkerMessage) -> Outcome:
    prepared = await _prepare(host, active, message)
    handler, now = HANDLERS[type(message)], host.now()
    async with host.store.transaction() as tx:  # the fence (renewing the claim), then the handler's changes
        await tx.controller_queue.fence(active.claim.uid, active.claim.token, host.config.controller_lease_ms, now)
        return await handler(host, tx, active, message, prepared, now)


async def _prepare(host: HostState, active: ActiveReconcile, message: WorkerMessage) -> Any:
    """``workflow.ensure`` for a child not started yet: the workflow, checked outside the
    transaction (it may take a moment); a settings change: its proposal (reconcile_steering)."""
    if type(message) in reconcile_steering.HANDLERS:
        return await reconcile_steering.prepare(host, active, message)
    if not isinstance(message, WorkflowEnsure):
        return None
    payload = message.payload
    if await host.store.controller_effects.find_child(active.claim.uid, payload.requestKey, payload.workflow,
                                                      payload.input) is not None:
        return None
    return await host.catalog.inspect(active.claim.project, payload.workflow)


# --- handlers: store calls on the message's unit of work ``tx`` only ---------------------------


async def _ready(host: HostState, tx: UnitOfWork, active: ActiveReconcile, message: ReconcileReady,
                 prepared: None, now: int) -> Outcome:
    loaded = message.payload
    if loaded.loadError is not None:
        await tx.controller_queue.finish_failure(active.claim.uid, active.claim.token, permanent=False, now=now,
                                                 error=f"controller cannot load: {loaded.loadError}",
                                                 delay_ms=host.controllers.backoff_ms)
        return ReconcileStart(stop=True), Conclusion.DONE
    view = await tx.controller_queue.reconcile_view(active.claim.uid)
    active.spec_generation = view["generation"]
    active.timeout_s = loaded.timeoutS or active.timeout_s
    return ReconcileStart(resource=view), None


async def _finish(host: HostState, tx: UnitOfWork, active: ActiveReconcile, message: ReconcileFinish,
                  prepared: None, now: int) -> Outcome:
    p = message.payload
    try:
        outcome = await tx.controller_queue.finish_success(
            active.claim.uid, active.claim.token, requeue_after_ms=p.requeueAfterMs, settled=p.settled,
            controller_status=p.status, keep_status=p.keepStatus, conditions=p.conditions, finalizers=p.finalizers,
            now=now)
    except Rejected as exc:  # a status over the limit, a malformed condition: the pass failed
        await _fail_with(host, tx, active, f"the reconcile's result was refused: {exc}", now)
        return NOTHING, Conclusion.DONE
    log.info("%s: reconcile %s", active.label, outcome)
    return NOTHING, Conclusion.DONE


async def _fail(host: HostState, tx: UnitOfWork, active: ActiveReconcile, message: ReconcileFail,
                prepared: None, now: int) -> Outcome:
    p = message.payload
    delay = p.delayMs if p.delayMs is not None else host.controllers.backoff_ms
    errors = await tx.controller_queue.finish_failure(active.claim.uid, active.claim.token, error=p.error,
                                                      delay_ms=delay, permanent=p.permanent, now=now)
    log.info("%s: reconcile failed (%d in a row)%s", active.label, errors, " permanently" if p.permanent else "")
    return NOTHING, Conclusion.DONE


async def _fail_with(host: HostState, tx: UnitOfWork, active: ActiveReconcile, error: str, now: int) -> None:
    await tx.controller_queue.finish_failure(active.claim.uid, active.claim.token, error=error,
                                             delay_ms=host.controllers.backoff_ms, permanent=False, now=now)


async def _log(host: HostState, tx: UnitOfWork, active: ActiveReconcile, message: ReconcileLog,
               prepared: None, now: int) -> Outcome:
    await tx.controllers.add_resource_event(active.claim.uid, "log", {"message": message.payload.message}, now)
    return NOTHING, None


async def _effect_reserve(host: HostState, tx: UnitOfWork, active: ActiveReconcile, message: EffectReserve,
                          prepared: None, now: int) -> Outcome:
    p = message.payload
    state = EffectState(**await tx.controller_effects.reserve(
        active.claim.uid, active.spec_generation, p.key, generation=active.claim.claim_number, observable=p.observable,
        now=now, kind=p.kind, fingerprint=p.requestFingerprint))
    return state, Conclusion.DONE if state.state == "ambiguous" else None


async def _effect_apply(host: HostState, tx: UnitOfWork, active: ActiveReconcile, message: EffectApply,
                        prepared: None, now: int) -> Outcome:
    await tx.controller_effects.begin_apply(active.claim.uid, active.spec_generation, message.payload.key,
                                            generation=active.claim.claim_number, now=now)
    return NOTHING, None


async def _effect_settle(host: HostState, tx: UnitOfWork, active: ActiveReconcile, message: EffectSettle,
                         prepared: None, now: int) -> Outcome:
    p = message.payload
    await tx.controller_effects.settle(active.claim.uid, active.spec_generation, p.key,
                                       generation=active.claim.claim_number, result=p.result, error=p.error, now=now)
    return NOTHING, None


async def _workflow_ensure(host: HostState, tx: UnitOfWork, active: ActiveReconcile, message: WorkflowEnsure,
                           info: WorkflowInfo | None, now: int) -> Outcome:
    p = message.payload
    child = await tx.controller_effects.find_child(active.claim.uid, p.requestKey, p.workflow, p.input)
    if child is None:
        if info is None:  # recorded by another pass meanwhile and gone again: cannot happen under one claim
            raise Rejected(f"workflow request {p.requestKey!r} changed under the reconcile")
        run_id = "run-" + secrets.token_hex(8)
        if p.originSessionId is not None:
            check_id(p.originSessionId, "originSessionId")
        await tx.runs.create_run(run_id=run_id, workflow=info.name, project_path=active.claim.project,
                                 source=info.source, digest=info.digest, input=p.input,
                                 origin_session_id=p.originSessionId, now=now, start_node=info.start_at,
                                 graph=info.graph,
                                 settings=settings_operations.new_scope(info, None, actor_id=active.claim.uid))
        child = await tx.controller_effects.record_child(active.claim.uid, p.requestKey, info.name, p.input, run_id,
                                                         now)
    return ChildRun(**child), None


Handler = Callable[[HostState, UnitOfWork, ActiveReconcile, Any, Any, int], Awaitable[Outcome]]


HANDLERS: dict[type[WorkerMessage], Handler] = {
    ReconcileReady: _ready,
    ReconcileFinish: _finish,
    ReconcileFail: _fail,
    ReconcileLog: _log,
    EffectReserve: _effect_reserve,
    EffectApply: _effect_apply,
    EffectSettle: _effect_settle,
    WorkflowEnsure: _workflow_ensure,
    **reconcile_steering.HANDLERS,
}
