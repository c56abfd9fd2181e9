"""Reconcile worker messages that steer the runs a resource started (DESIGN.md §9b):
``ctx.workflows.change_settings``, ``queue_follow_up`` and ``remove_follow_up``.

Part of the host ↔ reconcile worker protocol (``piwf.protocol.reconcile`` puts them in
its union); each is idempotent by its request key, and refused for a run the resource did
not start.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from piwf.protocol.worker import Count, Payload, Result, Text, WorkerMessage


class ChangeSettingsPayload(Payload, frozen=True):
    runId: Text
    requestKey: Annotated[str, msgspec.Meta(min_length=1, max_length=512)]
    patch: dict[str, Any]
    expectedChangeNumber: Count | None = None
    scopeId: str | None = None


class QueueFollowUpPayload(Payload, frozen=True):
    runId: Text
    requestKey: Annotated[str, msgspec.Meta(min_length=1, max_length=512)]
    prompt: Text


class RemoveFollowUpPayload(Payload, frozen=True):
    runId: Text
    followUpId: Text


class WorkflowChangeSettings(WorkerMessage, tag="workflow.changeSettings"):
    payload: ChangeSettingsPayload


class WorkflowQueueFollowUp(WorkerMessage, tag="workflow.queueFollowUp"):
    payload: QueueFollowUpPayload


class WorkflowRemoveFollowUp(WorkerMessage, tag="workflow.removeFollowUp"):
    payload: RemoveFollowUpPayload


STEERING_MESSAGES = (WorkflowChangeSettings, WorkflowQueueFollowUp, WorkflowRemoveFollowUp)


class SettingsChanged(Result):
    runId: str
    scopeId: str
    changeNumber: int
    settings: Any
    adopted: bool


class FollowUpQueued(Result):
    runId: str
    followUpId: str
    order: int
    state: str
    adopted: bool
