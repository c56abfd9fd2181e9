"""The host protocol's controller operations (DESIGN.md §9): ``controller.apply|get|list|
delete|reconcile|resolve``; their payloads and receipts are in ``piwf.protocol.resources``.

Imported by ``piwf.protocol`` (which re-exports every name here and puts the requests in
its union); import them from there.
"""

from __future__ import annotations

from piwf.protocol.resources import (
    ApplyReceipt, ApplyResourcePayload, DeleteResourcePayload, ListResourcesPayload, ResolveResourceEffectPayload,
    ResolveResourceEffectReceipt, ResourceDetail, ResourcePayload, ResourceRef, ResourceSummary,
)
from piwf.protocol.host import Request

__all__ = ["ApplyResource", "DeleteResource", "GetResource", "ListResources", "ReconcileResource",
           "ResolveResourceEffect"]


class ApplyResource(Request, tag="controller.apply"):
    """Create a resource or change its spec (a new spec queues a reconcile; the same spec
    again changes nothing). The controller file must load."""

    payload: ApplyResourcePayload
    receipt_type = ApplyReceipt


class GetResource(Request, tag="controller.get"):
    """One resource: spec, status, conditions, finalizers, its queue row and recent events."""

    payload: ResourcePayload
    is_read = True
    receipt_type = ResourceDetail


class ListResources(Request, tag="controller.list"):
    """Resource summaries, by project, controller and key."""

    payload: ListResourcesPayload = ListResourcesPayload()
    is_read = True
    receipt_type = list[ResourceSummary]


class DeleteResource(Request, tag="controller.delete"):
    """Request deletion: the next reconcile sees `deletionTimestamp` and must clear the
    finalizers; a resource without finalizers is removed at once, and so is any with
    `force: true` (its finalizers are not run)."""

    payload: DeleteResourcePayload
    receipt_type = ResourceRef


class ReconcileResource(Request, tag="controller.reconcile"):
    """Queue a reconcile (deduplicated; lifts a permanent-error hold)."""

    payload: ResourcePayload
    receipt_type = ResourceRef


class ResolveResourceEffect(Request, tag="controller.resolve"):
    """Say whether a reconcile's ambiguous effect was applied; the resource is reconciled again."""

    payload: ResolveResourceEffectPayload
    receipt_type = ResolveResourceEffectReceipt
