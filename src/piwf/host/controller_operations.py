"""The ``controller.*`` operations of the host protocol (DESIGN.md §9).

``controller.apply`` first loads the controller file in a throwaway process (user code
never runs in the host): a file that fails to import or defines no ``controller`` is
refused with one line and nothing is written. The rest are store operations (a write's
on the unit of work ``operations`` opens with the command log, ``tx``); writes wake the
controller dispatcher after they commit.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any


from piwf.controllers.loader import controller_path
from piwf.errors import PiwfError, Rejected, StorageUnavailable
from piwf.protocol import (
    ApplyResource, DeleteResource, GetResource, ListResources, ReconcileResource, ResolveResourceEffect,
)
from piwf.protocol.resources import ResolveResourceEffectReceipt, ResourceDetail, ResourceSummary
from piwf.store.api import UnitOfWork
from piwf.store.api.rules import check_json_size, check_key
from piwf.wire import HostResponse, Outcome, sha256_hex
from piwf.host.isolated import Isolation
from piwf.host.operation_types import After, Reads, Writes
from piwf.host.state import HostState, log


@dataclass(frozen=True)
class ControllerInfo:
    name: str
    timeout_s: float
    initial_status: Any


class ControllerCatalog:
    """Controller files checked in a throwaway process, cached by their content hash; the
    file read and the process within the host's bounds (``isolation``, host/isolated.py)."""

    def __init__(self) -> None:
        self._cache: dict[tuple[str, str], ControllerInfo] = {}

    async def inspect(self, isolation: Isolation, project: str, name: str) -> ControllerInfo:
        try:
            path = controller_path(project, name)
            _, source = await isolation.read_user_file(path)
        except (Rejected, StorageUnavailable):
            raise
        except PiwfError as exc:
            raise Rejected(str(exc)) from exc
        except OSError as exc:
            raise Rejected(f"no controller {name!r} in {project}: {(exc.strerror or str(exc)).lower()}") from exc
        assert source is not None
        key = (str(path), sha256_hex(source))
        if key not in self._cache:
            result = await isolation.run(["piwf.controllers.loader", project, name], project,
                                         f"controller {name!r}", "loaded")
            self._cache[key] = ControllerInfo(result["name"], result["timeoutS"], result["initialStatus"])
        return self._cache[key]


CATALOG = ControllerCatalog()  # one per process: keyed by path and content, so hosts may share it


def _project(path: str) -> str:
    if not PurePosixPath(path).is_absolute():
        raise Rejected("payload.projectPath must be an absolute path")
    normal = os.path.normpath(path)
    if not os.path.isdir(normal):
        raise Rejected(f"project {normal} is not a directory")
    return normal


# --- reads ------------------------------------------------------------------------------------


async def _get(host: HostState, request: GetResource) -> ResourceDetail:
    p = request.payload
    return await host.store.controllers.get_resource(os.path.normpath(p.projectPath), p.controller, p.key, host.now())


async def _list(host: HostState, request: ListResources) -> list[ResourceSummary]:
    p = request.payload
    project = None if p.projectPath is None else os.path.normpath(p.projectPath)
    return await host.store.controllers.list_resources(project, p.controller)


# --- writes -----------------------------------------------------------------------------------


async def _prepare_apply(host: HostState, request: ApplyResource) -> ControllerInfo:
    p = request.payload
    check_key(p.key)
    check_json_size(p.spec, "spec")
    return await CATALOG.inspect(host.catalog.isolation, _project(p.projectPath), p.controller)


async def _apply(host: HostState, tx: UnitOfWork, request: ApplyResource, info: ControllerInfo,
                 after: After) -> HostResponse:
    p = request.payload
    receipt = await tx.controllers.apply_resource(
        project=_project(p.projectPath), controller=p.controller, key=p.key, spec=p.spec,
        initial=info.initial_status, expected_version=p.expectedResourceVersion, now=host.now())
    after.append(host.controllers.wake)
    return HostResponse(request.requestId, Outcome.ACCEPTED, revision=receipt.resourceVersion, receipt=receipt)


async def _delete(host: HostState, tx: UnitOfWork, request: DeleteResource, prepared: None,
                  after: After) -> HostResponse:
    p = request.payload
    ref = await tx.controllers.request_delete(os.path.normpath(p.projectPath), p.controller, p.key, host.now(),
                                              force=p.force)
    if p.force:
        log.warning("resource %s/%s in %s deleted by force: its finalizers did not run", p.controller, p.key,
                    p.projectPath)
        after.append(host.claims_changed)  # a pass running for it, here or on another host, is stopped now
    after.append(host.controllers.wake)
    return HostResponse(request.requestId, Outcome.ACCEPTED, revision=ref.resourceVersion, receipt=ref)


async def _reconcile(host: HostState, tx: UnitOfWork, request: ReconcileResource, prepared: None,
                     after: After) -> HostResponse:
    p = request.payload
    ref = await tx.controllers.request_reconcile(os.path.normpath(p.projectPath), p.controller, p.key, host.now())
    after.append(host.controllers.wake)
    return HostResponse(request.requestId, Outcome.ACCEPTED, revision=ref.resourceVersion, receipt=ref)


async def _resolve_effect(host: HostState, tx: UnitOfWork, request: ResolveResourceEffect, prepared: None,
                          after: After) -> HostResponse:
    p = request.payload
    if not p.applied and p.result is not None:
        raise Rejected("payload.result goes only with applied: true")
    uid = await tx.controllers.locate_uid(os.path.normpath(p.projectPath), p.controller, p.key)
    receipt = await tx.controller_effects.resolve(uid, p.effectKey, applied=p.applied, result=p.result,
                                                  now=host.now())
    after.append(host.controllers.wake)
    return HostResponse(request.requestId, Outcome.ACCEPTED, receipt=ResolveResourceEffectReceipt(**receipt))


async def status_counts(host: HostState) -> dict[str, int]:
    return {**await host.store.controllers.status_counts(host.now()),
            "activeControllerWorkers": len(host.controllers.active),
            "maxControllerWorkers": host.config.max_controller_workers}


READS: Reads = {GetResource: _get, ListResources: _list}
WRITES: Writes = {
    ApplyResource: (_prepare_apply, _apply),
    DeleteResource: (None, _delete),
    ReconcileResource: (None, _reconcile),
    ResolveResourceEffect: (None, _resolve_effect),
}
