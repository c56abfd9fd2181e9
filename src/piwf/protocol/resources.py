"""Controllers on the wire: the payloads and receipts of ``controller.*`` (DESIGN.md §9).

Part of the host protocol (``piwf.protocol`` holds the request types and imports these):
msgspec, the standard library and ``piwf.protocol.host``'s ``NoPayload``, the base of every
payload, so a request's ``payload`` field narrows the envelope's.
"""

from __future__ import annotations

from typing import Annotated, Any

from msgspec import Meta, Struct

from piwf.protocol.host import NoPayload

MAX_SPEC_BYTES = 1024 * 1024  # a spec, and a status, as canonical JSON
MAX_KEY_BYTES = 512
MAX_ERROR_CHARS = 8192
RECENT_EVENTS = 20

ControllerName = Annotated[str, Meta(min_length=1, max_length=128, description="the controller's name (its file)")]
ResourceKey = Annotated[str, Meta(min_length=1, description="the resource's key (at most 512 bytes)")]
Project = Annotated[str, Meta(description="absolute path of the project holding `.piwf/controllers/`")]


# Which resource: the payload of `controller.get` and `controller.reconcile`, and the first
# fields (base first, so in this order on the wire) of every payload that names one resource.
class ResourcePayload(NoPayload, frozen=True):
    projectPath: Project
    controller: ControllerName
    key: ResourceKey


class ApplyResourcePayload(ResourcePayload, frozen=True):
    spec: Annotated[Any, Meta(description="what is wanted: any JSON, at most 1 MiB")]
    expectedResourceVersion: Annotated[int, Meta(ge=0)] | None = None  # refused as a `conflict` when stale


class DeleteResourcePayload(ResourcePayload, frozen=True):
    force: Annotated[bool, Meta(description="remove the resource and its finalizers now, without a reconcile "
                                            "(for a controller that is gone); nothing is cleaned up")] = False


class ListResourcesPayload(NoPayload, frozen=True):
    projectPath: Annotated[str | None, Meta(description="only this project's resources")] = None
    controller: Annotated[str | None, Meta(description="only this controller's resources")] = None


class ResolveResourceEffectPayload(ResourcePayload, frozen=True):
    effectKey: Annotated[str, Meta(min_length=1, description="the ambiguous effect's key")]
    applied: Annotated[bool, Meta(description="whether the effect was applied")]
    result: Annotated[Any, Meta(description="its result (JSON), only with `applied: true`")] = None


# --- receipts -------------------------------------------------------------------------------


class ApplyReceipt(Struct):
    uid: str
    resourceVersion: int
    generation: int
    changed: Annotated[bool, Meta(description="false when the spec was already this one (nothing written)")]


class ResourceRef(Struct):
    uid: str
    resourceVersion: int
    deleted: Annotated[bool, Meta(description="`controller.delete`: the resource is gone already (no finalizers)")]


class ResourceEvent(Struct, omit_defaults=True):
    eventId: int
    at: str
    type: Annotated[str, Meta(description="`applied`, `reconcile_started`, `reconcile_finished`, `reconcile_failed`, "
                                          "`reconcile_conflict`, `deletion_requested`, `effect_failed`, `log`, ...")]
    detail: dict[str, Any] = {}


class ResourceSummary(Struct):
    uid: str
    projectPath: str
    controller: str
    key: str
    resourceVersion: int
    generation: int
    observedGeneration: int
    ready: Annotated[str | None, Meta(description="the `Ready` condition's status, if any")]
    deletionTimestamp: str | None
    consecutiveErrors: int
    availableAt: Annotated[str | None, Meta(description="next reconcile due; null when none is queued")]
    hold: Annotated[str | None, Meta(description="`permanent` (until the spec changes) or `effect` (ambiguous)")]


class ResourceChild(Struct):
    """A run a reconcile of the resource started (`ctx.workflows.ensure`)."""

    requestKey: Annotated[str, Meta(description="the key the reconcile asked with")]
    workflow: str
    runId: str
    state: Annotated[str, Meta(description="as the controller sees it: `running`, `waiting`, `succeeded`, `failed`")]
    attempt: Annotated[int, Meta(description="runs started for the key (a failed one is started again)")]


class ResourceDetail(ResourceSummary):
    spec: Any
    status: Annotated[dict[str, Any], Meta(description="`observedGeneration`, `conditions`, `controllerStatus`, "
                                                       "`workflowRun`")]
    finalizers: list[str]
    reconciling: bool
    lastError: str | None
    createdAt: str
    updatedAt: str
    events: Annotated[list[ResourceEvent], Meta(description="the most recent events, oldest first")]
    children: Annotated[list[ResourceChild], Meta(description="its child runs (the newest 100), oldest first")] = []


class ResolveResourceEffectReceipt(Struct):
    uid: str
    effectKey: str
    status: str
    ambiguous: list[str]
