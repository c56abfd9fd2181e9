"""Run settings (DESIGN.md §9b): ``workflow.settings``, ``workflow.changeSettings``, and
the settings scope a new run starts with.

A patch is checked against the workflow's own settings type in a throwaway process
(``Catalog.resolve_settings``), never in the host, with the workflow file as it is now:
its digest must still be the run's. The store then commits the result as a
compare-and-set on the change number the check started from.
"""

from __future__ import annotations

from typing import Any

from piwf.errors import Conflict, Rejected
from piwf.protocol import SETTINGS_LIMIT, ChangeSettings, GetSettings, RunSettings, StartRunPayload
from piwf.status import ENDED
from piwf.store.api import NewScope, UnitOfWork
from piwf.wire import HostResponse, Outcome, canonical_json
from piwf.host.catalog import WorkflowInfo
from piwf.host.operation_types import After, Reads, Writes
from piwf.host.state import HostState


# --- a new run's scope -------------------------------------------------------------------------


async def initial_settings(host: HostState, payload: StartRunPayload, info: WorkflowInfo) -> Any:
    """The settings a run of ``info`` starts with: its defaults, with ``payload.settings``
    merged in and checked against the type (any path may be given at the start)."""
    if info.settings is None:
        if payload.settings is not None:
            raise Rejected(f"workflow {info.name} declares no settings; payload.settings cannot be given")
        return None
    if payload.settings is None:
        return info.settings["defaults"]
    _check_size(payload.settings)
    digest, value = await host.catalog.resolve_settings(payload.projectPath, info.name, current=None,
                                                        patch=payload.settings, mutable_only=False)
    if digest != info.digest:
        raise Rejected(f"workflow {info.name} changed while its settings were checked; start again")
    return value


def new_scope(info: WorkflowInfo, initial: Any, *, patch: Any = None, actor_id: str | None = None) -> NewScope | None:
    """A new run's settings scope, made with it (``runs.create_run(settings=...)``); None for
    a workflow without settings."""
    if info.settings is None:
        return None
    return NewScope(settings=initial if initial is not None else info.settings["defaults"],
                    mutable=list(info.settings["mutable"]), patch=patch, actor_id=actor_id)


async def start_scope(tx: UnitOfWork, run_id: str, info: WorkflowInfo, initial: Any, *, patch: Any = None,
                      actor_id: str | None = None, now: int) -> None:
    """The run's settings scope as ``info`` declares it, unless it exists (a resumed run's
    mutable paths are the workflow's now)."""
    scope = new_scope(info, initial, patch=patch, actor_id=actor_id)
    if scope is not None:
        await tx.settings.ensure_scope(run_id, settings=scope.settings, mutable=scope.mutable, patch=scope.patch,
                                       actor_id=scope.actor_id, now=now)


def _check_size(patch: Any) -> None:
    size = len(canonical_json(patch))
    if size > SETTINGS_LIMIT:
        raise Rejected(f"the settings patch is {size} bytes as JSON; the limit is {SETTINGS_LIMIT}")


# --- operations ----------------------------------------------------------------------------------


async def _get_settings(host: HostState, request: GetSettings) -> RunSettings:
    return await host.store.settings.get_settings(request.runId, request.payload.scopeId)


REBASES = 3  # a change moved under a waiting check (or before its write: errors.Stale): checked again, this many times


class _Moved(Exception):
    """The scope's change number moved while a check waited for a throwaway process."""


async def proposal(host: HostState, run_id: str, patch: Any, *, scope_id: str | None = None,
                   expected: int | None = None) -> tuple[str, int, Any]:
    """(scope id, change number checked from, settings after ``patch``): the patch checked
    in a throwaway process against the run's workflow, which must not have changed.

    What can be refused is refused before a process is started: an ended run, a stale
    ``expected``, and a change number that moved while the check waited for a process
    slot (then the check starts again from the new settings, or, with ``expected``, is a
    conflict), so concurrent changes do not each spawn a process only to conflict."""
    _check_size(patch)
    store = host.store
    workflow, project, digest, _, _ = await store.runs.run_source(run_id)
    status = (await store.runs.run_summary(run_id)).queueStatus
    if status in ENDED:
        raise Rejected(f"run {run_id} has ended ({status}): its settings can no longer change")
    for _ in range(REBASES):
        scope, change, current = await store.settings.find_scope(run_id, scope_id)
        if expected is not None and expected != change:
            raise Conflict(f"the settings of run {run_id} are at change {change}, not {expected}")

        async def unmoved(scope: str = scope, change: int = change) -> None:
            _, now_at, _ = await store.settings.find_scope(run_id, scope)
            if now_at != change:
                raise _Moved

        try:
            checked, value = await host.catalog.resolve_settings(project, workflow, current=current, patch=patch,
                                                                 mutable_only=True, check=unmoved)
        except _Moved:
            continue
        if checked != digest:
            raise Rejected(f"workflow {workflow} changed since run {run_id} started (digest {checked[:19]}, the run "
                           f"has {digest[:19]}): its settings cannot be checked against the run's type")
        return scope, change, value
    raise Conflict(f"the settings of run {run_id} changed {REBASES} times while this change waited to be checked; "
                   "send it again")


async def _prepare_change(host: HostState, request: ChangeSettings) -> tuple[str, int, Any]:
    payload = request.payload
    return await proposal(host, request.runId, payload.patch, scope_id=payload.scopeId,
                          expected=payload.expectedChangeNumber)


async def _change_settings(host: HostState, tx: UnitOfWork, request: ChangeSettings,
                           prepared: tuple[str, int, Any], after: After) -> HostResponse:
    scope, base, value = prepared
    payload = request.payload
    receipt, _ = await tx.settings.change_settings(
        request.runId, scope_id=scope, base=base, expected=payload.expectedChangeNumber, patch=payload.patch,
        settings=value, actor="client", actor_id=request.clientId, now=host.now())
    return HostResponse(request.requestId, Outcome.ACCEPTED, revision=await tx.runs.revision(request.runId),
                        receipt=receipt)


READS: Reads = {GetSettings: _get_settings}
WRITES: Writes = {ChangeSettings: (_prepare_change, _change_settings)}
