"""The controller aggregates (resources, their reconcile queue, their effects), as
``aggregates.py`` describes: each method calls its module through the backend's Runner."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from piwf.store.sql import controllers as _controllers
from piwf.store.sql import controller_queue as _controller_queue
from piwf.store.sql import controller_effects as _controller_effects

from piwf.store.sql.runner import Runner

if TYPE_CHECKING:
    from piwf.protocol.resources import ApplyReceipt, ResourceDetail, ResourceRef, ResourceSummary
    from piwf.store.api.types import ControllerClaim, Delay


class ControllersAggregate:
    __slots__ = ("call",)

    def __init__(self, call: Runner) -> None:
        self.call = call

    async def apply_resource(
            self, *, project: str, controller: str, key: str, spec: Any, initial: Any, expected_version: int | None,
            now: int) -> ApplyReceipt:
        return await self.call(
            _controllers.apply_resource, project=project, controller=controller, key=key, spec=spec, initial=initial,
            expected_version=expected_version, now=now)

    async def request_reconcile(self, project: str, controller: str, key: str, now: int) -> ResourceRef:
        return await self.call(_controllers.request_reconcile, project, controller, key, now)

    async def request_delete(
            self, project: str, controller: str, key: str, now: int, *, force: bool = False) -> ResourceRef:
        return await self.call(_controllers.request_delete, project, controller, key, now, force=force)

    async def get_resource(self, project: str, controller: str, key: str, now: int) -> ResourceDetail:
        return await self.call(_controllers.get_resource, project, controller, key, now)

    async def list_resources(self, project: str | None, controller: str | None) -> list[ResourceSummary]:
        return await self.call(_controllers.list_resources, project, controller)

    async def locate_uid(self, project: str, controller: str, key: str) -> str:
        return await self.call(_controllers.locate_uid, project, controller, key)

    async def status_counts(self, now: int) -> dict[str, int]:
        return await self.call(_controllers.status_counts, now)

    async def add_resource_event(self, uid: str, kind: str, payload: dict[str, Any], now: int) -> None:
        return await self.call(_controllers.add_resource_event, uid, kind, payload, now)


class ControllerQueueAggregate:
    __slots__ = ("call",)

    def __init__(self, call: Runner) -> None:
        self.call = call

    async def claim_due(
            self, *, room: int, exclude: frozenset[str], lease_ms: int, now: int, epoch: int) -> list[ControllerClaim]:
        return await self.call(
            _controller_queue.claim_due, room=room, exclude=exclude, lease_ms=lease_ms, now=now, epoch=epoch)

    async def next_due(self) -> int | None:
        return await self.call(_controller_queue.next_due)

    async def renew_claims(self, claims: list[tuple[str, str]], lease_ms: int, now: int) -> set[str]:
        return await self.call(_controller_queue.renew_claims, claims, lease_ms, now)

    async def expire_claims_before(self, epoch: int, now: int) -> int:
        return await self.call(_controller_queue.expire_claims_before, epoch, now)

    async def attach_worker(self, uid: str, token: str, pid: int, identity: str) -> None:
        return await self.call(_controller_queue.attach_worker, uid, token, pid, identity)

    async def orphaned_workers(self, epoch: int) -> list[tuple[str, int, str]]:
        return await self.call(_controller_queue.orphaned_workers, epoch)

    async def fence(self, uid: str, token: str, lease_ms: int, now: int) -> None:
        return await self.call(_controller_queue.fence, uid, token, lease_ms, now)

    async def reconcile_view(self, uid: str) -> dict[str, Any]:
        return await self.call(_controller_queue.reconcile_view, uid)

    async def finish_success(
            self, uid: str, token: str, *, requeue_after_ms: int | None, settled: bool, controller_status: Any,
            conditions: list[dict[str, Any]], finalizers: list[str] | None, keep_status: bool, now: int) -> str:
        return await self.call(
            _controller_queue.finish_success, uid, token, requeue_after_ms=requeue_after_ms, settled=settled,
            controller_status=controller_status, conditions=conditions, finalizers=finalizers,
            keep_status=keep_status, now=now)

    async def finish_failure(
            self, uid: str, token: str, *, error: str, delay_ms: Delay, permanent: bool, now: int,
            counted: bool = True) -> int:
        return await self.call(
            _controller_queue.finish_failure, uid, token, error=error, delay_ms=delay_ms, permanent=permanent,
            now=now, counted=counted)

    async def record_failure(
            self, uid: str, token: str, *, error: str, delay_ms: Delay, now: int, counted: bool = True) -> int | None:
        return await self.call(
            _controller_queue.record_failure, uid, token, error=error, delay_ms=delay_ms, now=now, counted=counted)


class ControllerEffectsAggregate:
    __slots__ = ("call",)

    def __init__(self, call: Runner) -> None:
        self.call = call

    async def reserve(
            self, uid: str, spec_generation: int, key: str, *, generation: int, observable: bool, now: int,
            kind: str | None = None, fingerprint: str | None = None,
    ) -> dict[str, Any]:
        return await self.call(
            _controller_effects.reserve, uid, spec_generation, key, generation=generation, observable=observable,
            now=now, kind=kind, fingerprint=fingerprint)

    async def begin_apply(self, uid: str, spec_generation: int, key: str, *, generation: int, now: int) -> None:
        return await self.call(
            _controller_effects.begin_apply, uid, spec_generation, key, generation=generation, now=now)

    async def settle(
            self, uid: str, spec_generation: int, key: str, *, generation: int, result: Any = None,
            error: dict[str, Any] | None = None, now: int) -> None:
        return await self.call(
            _controller_effects.settle, uid, spec_generation, key, generation=generation, result=result, error=error,
            now=now)

    async def resolve(self, uid: str, key: str, *, applied: bool, result: Any, now: int) -> dict[str, Any]:
        return await self.call(_controller_effects.resolve, uid, key, applied=applied, result=result, now=now)

    async def find_child(self, uid: str, request_key: str, workflow: str, run_input: Any) -> dict[str, Any] | None:
        return await self.call(_controller_effects.find_child, uid, request_key, workflow, run_input)

    async def record_child(
            self, uid: str, request_key: str, workflow: str, run_input: Any, run_id: str, now: int) -> dict[str, Any]:
        return await self.call(_controller_effects.record_child, uid, request_key, workflow, run_input, run_id, now)

    async def sync_children(self, now: int) -> list[str]:
        return await self.call(_controller_effects.sync_children, now)
