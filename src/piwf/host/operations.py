"""The host protocol's operations (seed 000 ``handleRequest``).

Read-only operations are answered straight from the store. Every other operation runs
inside the command log's transaction, so a retry is answered from the log instead of
being carried out twice; what must happen after the commit (waking the dispatcher,
cancelling a run's scope, stopping the host) is returned as ``after`` actions.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Awaitable, Callable
from pathlib import PurePosixPath
from typing import Any

import trio

from .. import faults
from ..errors import PiwfError, Rejected
from ..store import commands, effects, queue, runs, workers
from ..store.hosts import read_lease
from ..wire import HostRequest, HostResponse, check_id, request_fingerprint
from .catalog import WorkflowInfo
from .state import HostState, log

After = list[Callable[[], None]]
WAIT_LIMIT_MS = 600_000
SETTLED = ("completed", "failed", "timed_out", "cancelled", "waiting")


async def handle_request(host: HostState, request: HostRequest) -> tuple[HostResponse, After]:
    if host.stop_requested.is_set():
        return HostResponse(request.requestId, "unavailable", error="the host is stopping"), []
    try:
        if request.operation in READS:
            receipt = await READS[request.operation](host, request)
            return HostResponse(request.requestId, "accepted", receipt=receipt), []
        if request.operation in WRITES:
            return await _write(host, request)
        known = ", ".join(sorted({*READS, *WRITES}))
        raise Rejected(f"unknown operation {request.operation!r}; known: {known}")
    except PiwfError as exc:
        return HostResponse(request.requestId, exc.outcome, error=str(exc)), []
    except Exception as exc:  # a bug must cost one request, not the host
        log.exception("%s failed", request.operation)
        return HostResponse(request.requestId, "rejected", error=f"internal error: {exc}"), []


async def _write(host: HostState, request: HostRequest) -> tuple[HostResponse, After]:
    stored = commands.lookup(host.db, request, request_fingerprint(request))
    if stored is not None:
        return stored, []
    prepare, apply = WRITES[request.operation]
    prepared = await prepare(host, request) if prepare else None
    after: After = []
    response = commands.execute(host.db, request, host.epoch, host.now(),
                                lambda: apply(host, request, prepared, after))
    faults.point("host.command.committed")
    if response.outcome != "accepted":
        after = []
    host.changed()
    return response, after


# --- reads ---------------------------------------------------------------------------------


async def _host_status(host: HostState, request: HostRequest) -> Any:
    return status_receipt(host)


def status_receipt(host: HostState) -> dict[str, Any]:
    now = host.now()
    lease = read_lease(host.db)
    return {
        "state": "running" if lease.live(now) else "stale",
        **lease.as_json(now),
        "stateDir": str(host.config.state_dir.root),
        "socketAvailable": True,  # this answer came over it
        "activeWorkers": len(host.active),
        "maxWorkers": host.config.max_workers,
        "durability": host.config.durability,
        "connectedClients": host.connections,
        **runs.status_counts(host.db, now),
    }


async def _run_status(host: HostState, request: HostRequest) -> Any:
    return run_receipt(host, _run_id(request))


def run_receipt(host: HostState, run_id: str) -> dict[str, Any]:
    with host.db.read():
        run = runs.get_run(host.db, run_id)
        run["workers"] = workers.worker_summaries(host.db, run_id)
        run["effects"] = effects.list_effects(host.db, run_id)
    return run


async def _run_list(host: HostState, request: HostRequest) -> Any:
    _only(request, "limit", "status")
    limit = request.payload.get("limit", 50)
    if not isinstance(limit, int) or isinstance(limit, bool) or not 1 <= limit <= 1000:
        raise Rejected("payload.limit must be an integer from 1 to 1000")
    status = request.payload.get("status")
    if status is not None and not isinstance(status, str):
        raise Rejected("payload.status must be text")
    return runs.list_runs(host.db, limit, status)


async def _run_events(host: HostState, request: HostRequest) -> Any:
    _only(request, "after")
    after = request.payload.get("after", 0)
    if not isinstance(after, int) or isinstance(after, bool) or after < 0:
        raise Rejected("payload.after must be a non-negative integer")
    return runs.run_events(host.db, _run_id(request), after)


async def _run_wait(host: HostState, request: HostRequest) -> Any:
    """Block until the run ends, waits, or is held (paused, parked with a reason)."""
    _only(request, "timeoutMs")
    timeout_ms = request.payload.get("timeoutMs", WAIT_LIMIT_MS)
    if not isinstance(timeout_ms, int) or isinstance(timeout_ms, bool) or not 0 <= timeout_ms <= WAIT_LIMIT_MS:
        raise Rejected(f"payload.timeoutMs must be an integer from 0 to {WAIT_LIMIT_MS}")
    run_id = _run_id(request)
    with trio.move_on_after(timeout_ms / 1000):
        while not at_rest(runs.run_summary(host.db, run_id)):
            await host.run_changed.wait()
    receipt = run_receipt(host, run_id)
    receipt["atRest"] = at_rest(receipt)
    return receipt


def at_rest(run: dict[str, Any]) -> bool:
    """Ended, waiting, or held and not running: nothing will happen without someone acting."""
    held = run["hold"] is not None and run["queueStatus"] in ("queued", "parked")
    return run["status"] in SETTLED or held


# --- writes --------------------------------------------------------------------------------


def _host_stop(host: HostState, request: HostRequest, prepared: None, after: After) -> HostResponse:
    after.append(host.stop_requested.set)
    return HostResponse(request.requestId, "accepted", receipt={"stopping": True})


START_FIELDS = ("workflow", "projectPath", "input", "originSessionId", "definitionDigest")


async def _prepare_start(host: HostState, request: HostRequest) -> WorkflowInfo:
    payload = request.payload
    _only(request, *START_FIELDS)
    workflow = payload.get("workflow")
    if not isinstance(workflow, str) or not workflow:
        raise Rejected("payload.workflow must be a workflow name")
    project = payload.get("projectPath")
    if not isinstance(project, str) or not PurePosixPath(project).is_absolute():
        raise Rejected("payload.projectPath must be an absolute path")
    if not os.path.isdir(project):
        raise Rejected(f"project {project} is not a directory")
    for key in ("originSessionId", "definitionDigest"):
        if key in payload and payload[key] is not None:
            if not isinstance(payload[key], str):
                raise Rejected(f"payload.{key} must be text")
            check_id(payload[key], f"payload.{key}")
    info = await host.catalog.inspect(project, workflow)
    expected = payload.get("definitionDigest")
    if expected is not None and expected != info.digest:
        raise Rejected(f"workflow {workflow} changed: its digest is {info.digest}, not {expected}")
    return info


def _run_start(host: HostState, request: HostRequest, info: WorkflowInfo, after: After) -> HostResponse:
    run_id = request.runId or "run-" + secrets.token_hex(8)
    payload = request.payload
    runs.create_run(
        host.db, run_id=run_id, workflow=info.name, project_path=payload["projectPath"], source=info.source,
        digest=info.digest, input=payload.get("input", {}), origin_session_id=payload.get("originSessionId"),
        now=host.now(), start_node=info.start_at,
    )
    after.append(host.wake)
    return HostResponse(request.requestId, "accepted", revision=1,
                        receipt={"runId": run_id, "workflow": info.name, "status": "queued",
                                 "definitionDigest": info.digest})


def _run_cancel(host: HostState, request: HostRequest, prepared: None, after: After) -> HostResponse:
    run_id = _run_id(request)
    _check_revision(host, request)
    active = host.active.get(run_id)
    now = host.now()
    if active is not None and queue.cancel_run(host.db, run_id, now, token=active.claim.token):
        after.append(lambda: active.stop("cancelled"))
    elif not queue.cancel_run(host.db, run_id, now):
        run = runs.get_run(host.db, run_id)
        raise Rejected(f"run {run_id} cannot be cancelled: it is {run['status']} ({run['queueStatus']})")
    return HostResponse(request.requestId, "accepted", revision=runs.revision(host.db, run_id),
                        receipt={"runId": run_id, "status": "cancelled"})


def _run_pause(host: HostState, request: HostRequest, prepared: None, after: After) -> HostResponse:
    run_id = _run_id(request)
    _check_revision(host, request)
    receipt = runs.pause_run(host.db, run_id, host.now())
    return HostResponse(request.requestId, "accepted", revision=runs.revision(host.db, run_id), receipt=receipt)


async def _prepare_resume(host: HostState, request: HostRequest) -> WorkflowInfo | None:
    """A run held because its workflow changed resumes on the workflow as it is now."""
    run_id = _run_id(request)
    if runs.hold_of(host.db, run_id) != "source":
        return None
    workflow, project, _, _, _ = runs.run_source(host.db, run_id)
    return await host.catalog.inspect(project, workflow)


def _run_resume(host: HostState, request: HostRequest, info: WorkflowInfo | None, after: After) -> HostResponse:
    run_id = _run_id(request)
    _check_revision(host, request)
    definition = None if info is None else (info.digest, info.source, info.start_at)
    receipt = runs.resume_run(host.db, run_id, host.now(), definition=definition)
    host.crashes.pop(run_id, None)
    after.append(host.wake)
    return HostResponse(request.requestId, "accepted", revision=runs.revision(host.db, run_id), receipt=receipt)


def _effect_resolve(host: HostState, request: HostRequest, prepared: None, after: After) -> HostResponse:
    run_id = _run_id(request)
    _only(request, "key", "applied", "result")
    key, applied = request.payload.get("key"), request.payload.get("applied")
    if not isinstance(key, str) or not key:
        raise Rejected("payload.key must be the effect's key")
    if not isinstance(applied, bool):
        raise Rejected("payload.applied must be true or false")
    if not applied and request.payload.get("result") is not None:
        raise Rejected("payload.result goes only with applied: true")
    runs.revision(host.db, run_id)  # notFound for an unknown run
    receipt = effects.resolve(host.db, run_id, key, applied=applied, result=request.payload.get("result"),
                              now=host.now())
    after.append(host.wake)
    return HostResponse(request.requestId, "accepted", revision=runs.revision(host.db, run_id), receipt=receipt)


# --- helpers -------------------------------------------------------------------------------


def _run_id(request: HostRequest) -> str:
    if request.runId is None:
        raise Rejected(f"{request.operation} needs a runId")
    return request.runId


def _check_revision(host: HostState, request: HostRequest) -> None:
    runs.check_revision(host.db, _run_id(request), request.expectedRevision)


def _only(request: HostRequest, *allowed: str) -> None:
    extra = sorted(set(request.payload) - set(allowed))
    if extra:
        raise Rejected(f"{request.operation} payload has unknown field(s): {', '.join(extra)}")


Read = Callable[[HostState, HostRequest], Awaitable[Any]]
Prepare = Callable[[HostState, HostRequest], Awaitable[Any]] | None
Apply = Callable[[HostState, HostRequest, Any, After], HostResponse]

READS: dict[str, Read] = {
    "host.status": _host_status,
    "run.status": _run_status,
    "run.list": _run_list,
    "run.events": _run_events,
    "run.wait": _run_wait,
}
WRITES: dict[str, tuple[Prepare, Apply]] = {
    "host.stop": (None, _host_stop),
    "run.start": (_prepare_start, _run_start),
    "run.cancel": (None, _run_cancel),
    "run.pause": (None, _run_pause),
    "run.resume": (_prepare_resume, _run_resume),
    "effect.resolve": (None, _effect_resolve),
}
