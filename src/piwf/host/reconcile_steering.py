"""A reconcile steering the runs its resource started (DESIGN.md §9b; seed
``changeControllerWorkflowSettings``, ``queueFollowUp``/``removeFollowUp``):
``workflow.changeSettings``, ``workflow.queueFollowUp``, ``workflow.removeFollowUp``.

Each is refused for a run the resource did not start. A settings change is checked like a
client's (a throwaway process, outside the transaction) unless its request key already
made a change, which is answered again (``adopted``); a follow-up's request key is the
delivery store's own. A handler's store calls go on ``tx``, the unit of work the
reconcile pump opened for the message (fenced by the resource's claim).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from piwf.protocol.steering import (
    FollowUpQueued, SettingsChanged, WorkflowChangeSettings, WorkflowQueueFollowUp, WorkflowRemoveFollowUp,
)
from piwf.errors import Rejected
from piwf.protocol import ChangeSettingsReceipt, FollowUpReceipt
from piwf.store.api import SettingsStore, UnitOfWork
from piwf.protocol.worker import Result, WorkerMessage
from piwf.host import settings_operations
from piwf.host.controller_state import ActiveReconcile
from piwf.host.state import Conclusion, HostState

Outcome = tuple[Result, Conclusion | None]


async def _check_owned(settings: SettingsStore, active: ActiveReconcile, run_id: str) -> None:
    if not await settings.started_by(active.claim.uid, run_id):
        raise Rejected(f"run {run_id} was not started by this resource (ctx.workflows.ensure): "
                       "a controller steers only its own runs")


async def prepare(host: HostState, active: ActiveReconcile, message: WorkerMessage) -> Any:
    """A settings change's proposal, checked outside the transaction (or the change its
    request key already made)."""
    if not isinstance(message, WorkflowChangeSettings):
        return None
    p = message.payload
    await _check_owned(host.store.settings, active, p.runId)
    prior = await host.store.settings.prior_change(p.runId, p.requestKey, p.scopeId, p.patch)
    if prior is not None:
        return prior
    return await settings_operations.proposal(host, p.runId, p.patch, scope_id=p.scopeId,
                                              expected=p.expectedChangeNumber)


async def _change_settings(host: HostState, tx: UnitOfWork, active: ActiveReconcile, message: WorkflowChangeSettings,
                           prepared: Any, now: int) -> Outcome:
    p = message.payload
    await _check_owned(tx.settings, active, p.runId)
    if isinstance(prepared, ChangeSettingsReceipt):
        receipt, adopted = prepared, True
    else:
        scope, base, value = prepared
        receipt, adopted = await tx.settings.change_settings(
            p.runId, scope_id=scope, base=base, expected=p.expectedChangeNumber, patch=p.patch,
            settings=value, actor="controller", actor_id=active.claim.uid, request_key=p.requestKey, now=now)
    return SettingsChanged(**msgspec.structs.asdict(receipt), adopted=adopted), None


def _follow_up(receipt: FollowUpReceipt) -> FollowUpQueued:
    return FollowUpQueued(runId=receipt.runId, followUpId=receipt.followUpId, order=receipt.order,
                          state=str(receipt.state), adopted=receipt.adopted)


async def _queue_follow_up(host: HostState, tx: UnitOfWork, active: ActiveReconcile, message: WorkflowQueueFollowUp,
                           prepared: None, now: int) -> Outcome:
    p = message.payload
    await _check_owned(tx.settings, active, p.runId)
    return _follow_up(await tx.delivery.queue_followup(run_id=p.runId, request_key=p.requestKey, prompt=p.prompt,
                                                       now=now)), None


async def _remove_follow_up(host: HostState, tx: UnitOfWork, active: ActiveReconcile,
                            message: WorkflowRemoveFollowUp, prepared: None, now: int) -> Outcome:
    p = message.payload
    await _check_owned(tx.settings, active, p.runId)
    return _follow_up(await tx.delivery.remove_followup(run_id=p.runId, followup_id=p.followUpId, now=now)), None


Handler = Callable[[HostState, UnitOfWork, ActiveReconcile, Any, Any, int], Awaitable[Outcome]]
HANDLERS: dict[type[WorkerMessage], Handler] = {
    WorkflowChangeSettings: _change_settings,
    WorkflowQueueFollowUp: _queue_follow_up,
    WorkflowRemoveFollowUp: _remove_follow_up,
}
