"""The host protocol's operations (seed 000 ``handleRequest``).

Read-only operations are answered straight from the store. Every other operation is one
unit of work the host runs (``host.run_unit``): the command log's lookup, the
operation's store calls on that unit of work, and its recorded answer commit together, so
a retry is answered from the log instead of being carried out twice; what must happen
after the commit (waking the dispatcher, cancelling a run's scope, stopping the host) is
returned as ``after`` actions. Nothing inside a unit of work awaits anything but the
store's methods.

Requests arrive decoded into their operation's Struct (``piwf.protocol``), so field types
and ranges were checked by msgspec; handlers check only what depends on the world (a
directory that exists, a run in the right state). ``READS`` and ``WRITES`` map each
request type to its handler.
"""

from __future__ import annotations

import functools
import os
import secrets
from typing import Any

import msgspec
import psutil
import trio

from piwf import faults, processes
from piwf.errors import PiwfError, Rejected, Stale
from piwf.protocol import (
    AnswerDecision, CancelReceipt, CancelRun, GetHostStatus, GetRun, GetRunEvents, GetRunGraph, GetRunSteps,
    HoldReceipt, HostStatus, InteractionsPage, ListInteractions, ListRuns, PauseRun, Request, ResolveEffect,
    ResolveReceipt, ResumeRun, RunDetail, RunEventsPage, RunGraph, RunStepsPage, RunSummary, StartReceipt, StartRun,
    StopHost, StopReceipt, SubmitInteraction, UpdateInteraction, WaitReceipt, WaitRun, WorkerSummary,
)
from piwf.status import AT_REST, QueueStatus, RunStatus, StopReason, WorkerStatus
from piwf.store.api import UnitOfWork, Wakeup
from piwf.store.api.record import redact
from piwf.wire import HostResponse, Outcome, check_id, request_fingerprint
from piwf.host import controller_operations
from piwf.host import delivery
from piwf.host.delivery import WATCH_ENDS_EARLY, until_changed
from piwf.host import output, peers, retention, settings_operations
from piwf.host.catalog import WorkflowInfo
from piwf.host.operation_types import After, Reads, Writes
from piwf.host.state import HostState, log
from piwf.store.api.types import RunFilter


async def handle_request(host: HostState, request: Request) -> tuple[HostResponse, After]:
    if host.stop_requested.is_set():
        return HostResponse(request.requestId, Outcome.UNAVAILABLE, error="the host is stopping"), []
    try:
        read = READS.get(type(request))
        if read is not None:
            receipt = await read(host, request)
            await host.durable()  # it may show what another request just committed
            return HostResponse(request.requestId, Outcome.ACCEPTED, receipt=receipt), []
        return await _write(host, request)
    except PiwfError as exc:
        return HostResponse(request.requestId, Outcome(exc.outcome), error=str(exc)), []
    except Exception as exc:  # a bug must cost one request, not the host
        log.exception("%s failed", request.operation)
        return HostResponse(request.requestId, Outcome.REJECTED, error=f"internal error: {exc}"), []


async def _write(host: HostState, request: Request) -> tuple[HostResponse, After]:
    """A write request, answered from the command log when it was carried out before. A
    request whose prepare does more than read (a prune's batches, a settings validation
    worker, a controller's load) is looked up first, so a retry never runs it again; the
    others (no prepare, or a start's cached workflow inspection) are looked up by their unit
    of work alone, one hop fewer on PostgreSQL (bench/README.md, part 3), and a start whose
    prepare no longer passes (its workflow gone or changed) is answered from the log too
    (``_prepare_and_commit``)."""
    fingerprint = request_fingerprint(request)
    if WRITES[type(request)][0] is not None and type(request) not in _PREPARE_ONLY_READS:
        stored = await host.store.commands.lookup(request, fingerprint)
        if stored is not None:
            await host.durable()  # the first answer may still be waiting for its fsync
            return stored, []
    for attempt in range(1, settings_operations.REBASES + 1):  # prepared again when it went stale
        try:
            response, after, carried_out = await _prepare_and_commit(host, request, fingerprint)
            break
        except Stale:  # what it was prepared from moved before the write: prepare it again from what is now
            if WRITES[type(request)][0] is None or attempt == settings_operations.REBASES:
                raise
    await host.durable()  # an answer from the log: the first answer may still be waiting for its fsync
    if not carried_out:
        return response, []
    faults.point("host.command.committed")
    if response.outcome != Outcome.ACCEPTED:
        after = []
    host.changed()
    return response, after


async def _prepare_and_commit(host: HostState, request: Request,
                              fingerprint: bytes) -> tuple[HostResponse, After, bool]:
    """The response, what to do after it, and whether this call carried the request out
    (False: answered from the command log, ``adopted`` or ``conflict``)."""
    prepare, apply = WRITES[type(request)]
    try:
        prepared = await prepare(host, request) if prepare else None
    except PiwfError:
        stored = await host.store.commands.lookup(request, fingerprint)  # a retry of one carried out before?
        if stored is None:
            raise
        return stored, [], False
    after: After = []
    carried_out = False

    async def unit(tx: UnitOfWork) -> HostResponse:  # store calls only (run_unit: one hop on PostgreSQL)
        nonlocal carried_out
        now = host.now()
        response = await tx.commands.lookup(request, fingerprint)  # a retry, or answered while prepare awaited
        if response is None:
            response = await apply(host, tx, request, prepared, after)
            await tx.commands.record(request, fingerprint, response, host.epoch, now)
            carried_out = True
        return response

    response = await host.run_unit(unit)
    return response, after, carried_out


# --- reads ---------------------------------------------------------------------------------


async def _host_status(host: HostState, request: GetHostStatus) -> HostStatus:
    return await status_receipt(host)


_HOST_PROCESS = psutil.Process()


async def status_receipt(host: HostState) -> HostStatus:
    now = host.now()
    lease = await host.store.hosts.read_lease()
    return msgspec.convert({  # from three sources: the lease, the host, the run counts
        "state": "running" if lease.live(now) else "stale",
        **lease.as_json(now),
        "stateDir": str(host.config.state_dir.root),
        "socketAvailable": True,  # this answer came over it
        "activeWorkers": len(host.active),
        "maxWorkers": host.config.max_workers,
        "durability": host.config.durability,
        "store": None if host.config.store_url is None else redact(host.config.store_url),
        "connectedClients": host.connections,
        "hostRssBytes": _HOST_PROCESS.memory_info().rss,
        **await host.store.runs.status_counts(now),
        **await controller_operations.status_counts(host),
        "hosts": await peers.live_hosts(host),
        "queues": list(host.config.queues),
    }, HostStatus)


async def _run_status(host: HostState, request: GetRun) -> RunDetail:
    return _live_workers(host, await host.store.runs.get_run(request.runId, host.now()))


def _live_workers(host: HostState, run: RunDetail) -> RunDetail:
    """The record of the run's live worker, as this host sees it now: stopped when it is
    SIGSTOPped (it holds its slot, making no progress, until it is continued or its node's
    time limit stops it); still running when its end was written ahead with the message
    that ended its run (run_lane.end_of) but its process has not ended yet."""
    active = host.active.get(run.runId)
    if active is None or active.pid is None:
        return run
    stopped = processes.is_stopped(active.pid)
    ahead = active.end_recorded is not None and active.process_end is None
    if not (stopped or ahead):
        return run

    def live(worker: WorkerSummary) -> WorkerSummary:
        if worker.workerEpoch != active.worker_id:
            return worker
        if ahead:
            worker = msgspec.structs.replace(worker, status=WorkerStatus.RUNNING, exitCode=None, signal=None)
        return msgspec.structs.replace(worker, stopped=stopped)

    return msgspec.structs.replace(run, workers=[live(worker) for worker in run.workers])


async def _run_list(host: HostState, request: ListRuns) -> list[RunSummary]:
    given = request.payload
    where = RunFilter(status=given.status, workflow=given.workflow, session=given.originSessionId, since=given.since,
                      held=given.held, after=given.after)
    return await host.store.runs.list_runs(given.limit, where=where)


async def _run_events(host: HostState, request: GetRunEvents) -> RunEventsPage:
    return await host.store.runs.run_events(request.runId, request.payload.after, request.payload.limit)


async def _run_graph(host: HostState, request: GetRunGraph) -> RunGraph:
    return await host.store.runs.run_graph(request.runId)


async def _run_steps(host: HostState, request: GetRunSteps) -> RunStepsPage:
    return await host.store.runs.run_steps(request.runId, request.payload.offset, request.payload.limit)


async def _run_wait(host: HostState, request: WaitRun) -> WaitReceipt:
    """Block until the run ends, waits, or is held (paused, parked with a reason), and
    this host has recorded how its worker ended: the receipt never shows a run at rest
    beside a worker still `running`."""
    run_id = request.runId
    if run_id not in host.active:  # a run at rest already (a client waiting after the fact): one read
        run = await host.store.runs.get_run(run_id, host.now())
        if _settled(host, run):
            return WaitReceipt(**msgspec.structs.asdict(run), atRest=True)
    with WATCH_ENDS_EARLY.get() or trio.CancelScope(), trio.move_on_after(request.payload.timeoutMs / 1000):
        # asked again on every change, and when a run leaves host.active
        await until_changed(host, lambda: _summary_settled(host, run_id))
    run = _live_workers(host, await host.store.runs.get_run(run_id, host.now()))
    return WaitReceipt(**msgspec.structs.asdict(run), atRest=_settled(host, run))


async def _summary_settled(host: HostState, run_id: str) -> bool:
    if run_id in host.active:  # not at rest while this host supervises it: no read
        return False
    return _settled(host, await host.store.runs.run_summary(run_id))


def _settled(host: HostState, run: RunSummary) -> bool:
    return at_rest(run) and run.runId not in host.active


def at_rest(run: RunSummary) -> bool:
    """Ended, waiting, or held and not running: nothing will happen without someone acting."""
    held = run.hold is not None and run.queueStatus in (QueueStatus.QUEUED, QueueStatus.PARKED)
    return run.status in AT_REST or held


# --- writes --------------------------------------------------------------------------------


async def _host_stop(host: HostState, tx: UnitOfWork, request: StopHost, prepared: None, after: After) -> HostResponse:
    after.append(host.stop_requested.set)
    return HostResponse(request.requestId, Outcome.ACCEPTED, receipt=StopReceipt(stopping=True))


async def _prepare_start(host: HostState, request: StartRun) -> tuple[WorkflowInfo, Any]:
    payload = request.payload
    project = payload.projectPath
    if not project.startswith("/"):  # PurePosixPath(project).is_absolute(), without making one
        raise Rejected("payload.projectPath must be an absolute path")
    if not os.path.isdir(project):
        raise Rejected(f"project {project} is not a directory")
    for key in ("originSessionId", "definitionDigest"):
        if getattr(payload, key) is not None:
            check_id(getattr(payload, key), f"payload.{key}")
    info = await host.catalog.inspect(project, payload.workflow)
    expected = payload.definitionDigest
    if expected is not None and expected != info.digest:
        raise Rejected(f"workflow {payload.workflow} changed: its digest is {info.digest}, not {expected}")
    return info, await settings_operations.initial_settings(host, payload, info)


async def _run_start(host: HostState, tx: UnitOfWork, request: StartRun, prepared: tuple[WorkflowInfo, Any],
                     after: After) -> HostResponse:
    run_id = request.runId or "run-" + secrets.token_hex(8)
    payload = request.payload
    info, initial = prepared
    now = host.now()
    await tx.runs.create_run(
        run_id=run_id, workflow=info.name, project_path=payload.projectPath, source=info.source,
        digest=info.digest, input=payload.input, origin_session_id=payload.originSessionId,
        now=now, start_node=info.start_at, graph=info.graph, queue=payload.queue,
        settings=settings_operations.new_scope(info, initial, patch=payload.settings, actor_id=request.clientId),
    )
    after.append(host.wake)
    return HostResponse(request.requestId, Outcome.ACCEPTED, revision=1,
                        receipt=StartReceipt(runId=run_id, workflow=info.name, status=RunStatus.QUEUED,
                                             definitionDigest=info.digest))


async def _run_cancel(host: HostState, tx: UnitOfWork, request: CancelRun, prepared: None,
                      after: After) -> HostResponse:
    run_id, expected = request.runId, request.expectedRevision  # its compare-and-set is in the store's write
    # Whoever holds its claim: this host (its worker's, or one whose commit the dispatcher
    # has not taken up yet), another host sharing the store, or nobody (queued, parked).
    if not await tx.queue.cancel_run(run_id, host.now(), any_claim=True, expected_revision=expected):
        run = await tx.runs.run_summary(run_id)
        raise Rejected(f"run {run_id} cannot be cancelled: it is {run.status} ({run.queueStatus})")
    # Its worker stopped here, or, not active here yet, as soon as the dispatcher takes it
    # up; a worker on another host is stopped by that host, told by Wakeup.CLAIMS.
    after.append(lambda: host.runs.stop(run_id, StopReason.CANCELLED))
    after.append(functools.partial(host.store.announce, Wakeup.CLAIMS))
    after.append(host.wake)  # a run of its session may be claimable now (a run's end may not wake a round)
    return HostResponse(request.requestId, Outcome.ACCEPTED, revision=await tx.runs.revision(run_id),
                        receipt=CancelReceipt(runId=run_id, status="cancelled"))


async def _run_pause(host: HostState, tx: UnitOfWork, request: PauseRun, prepared: None,
                     after: After) -> HostResponse:
    run_id = request.runId
    receipt = HoldReceipt(**await tx.runs.pause_run(run_id, host.now(), expected_revision=request.expectedRevision))
    return HostResponse(request.requestId, Outcome.ACCEPTED, revision=await tx.runs.revision(run_id),
                        receipt=receipt)


async def _prepare_resume(host: HostState, request: ResumeRun) -> WorkflowInfo | None:
    """A run held because its workflow changed resumes on the workflow as it is now."""
    run_id = request.runId
    if await host.store.runs.hold_of(run_id) != "source":
        return None
    workflow, project, _, _, _ = await host.store.runs.run_source(run_id)
    return await host.catalog.inspect(project, workflow)


async def _run_resume(host: HostState, tx: UnitOfWork, request: ResumeRun, info: WorkflowInfo | None,
                      after: After) -> HostResponse:
    run_id = request.runId
    definition = None if info is None else info.definition()
    receipt = HoldReceipt(**await tx.runs.resume_run(run_id, host.now(), definition=definition,
                                                     expected_revision=request.expectedRevision))
    if info is not None:  # the workflow as it is now may declare settings the run did not have
        await settings_operations.start_scope(tx, run_id, info, None, actor_id=request.clientId, now=host.now())
    after.append(host.wake)
    return HostResponse(request.requestId, Outcome.ACCEPTED, revision=await tx.runs.revision(run_id),
                        receipt=receipt)


async def _effect_resolve(host: HostState, tx: UnitOfWork, request: ResolveEffect, prepared: None,
                          after: After) -> HostResponse:
    run_id, payload = request.runId, request.payload
    if not payload.applied and payload.result is not None:
        raise Rejected("payload.result goes only with applied: true")
    await tx.runs.revision(run_id)  # notFound for an unknown run
    receipt = ResolveReceipt(**await tx.effects.resolve(run_id, payload.key, applied=payload.applied,
                                                        result=payload.result, now=host.now()))
    after.append(host.wake)
    return HostResponse(request.requestId, Outcome.ACCEPTED, revision=await tx.runs.revision(run_id),
                        receipt=receipt)


# --- people and agents in the loop ----------------------------------------------------------


async def _interaction_list(host: HostState, request: ListInteractions) -> InteractionsPage:
    payload = request.payload
    return InteractionsPage(requests=await host.store.interactions.list_requests(
        session_id=payload.sessionId, run_id=payload.runId, open_only=payload.open, limit=payload.limit,
        now=host.now()))


async def _interaction_update(host: HostState, tx: UnitOfWork, request: UpdateInteraction, prepared: None,
                              after: After) -> HostResponse:
    payload = request.payload
    receipt = await tx.interactions.update(
        request_id=payload.requestId, expected_revision=payload.expectedRevision, action=payload.action,
        client_id=request.clientId, entry_id=payload.entryId, progress=payload.progress,
        lease_ms=host.config.presentation_lease_ms, now=host.now())
    return HostResponse(request.requestId, Outcome.ACCEPTED, receipt=receipt)


async def _interaction_submit(host: HostState, tx: UnitOfWork, request: SubmitInteraction, prepared: None,
                              after: After) -> HostResponse:
    payload = request.payload
    if payload.sessionId is not None:
        check_id(payload.sessionId, "payload.sessionId")
    receipt = await tx.interactions.submit(
        request_id=payload.requestId, value=payload.value, session_id=payload.sessionId,
        submitted_by=request.clientId, expected_revision=payload.expectedRevision, now=host.now())
    after.append(host.wake)
    return HostResponse(request.requestId, Outcome.ACCEPTED, receipt=receipt)


async def _decision_answer(host: HostState, tx: UnitOfWork, request: AnswerDecision, prepared: None,
                          after: After) -> HostResponse:
    payload = request.payload
    receipt = await tx.interactions.answer_decision(
        request_id=payload.requestId, choice=payload.choice, text=payload.input,
        answered_by=request.clientId, expected_revision=payload.expectedRevision, now=host.now())
    after.append(host.wake)
    return HostResponse(request.requestId, Outcome.ACCEPTED, receipt=receipt)


# Handlers by request type (their shapes: operation_types); every type in
# protocol.AnyRequest has one (tests check it).
READS: Reads = {
    GetHostStatus: _host_status,
    GetRun: _run_status,
    ListRuns: _run_list,
    GetRunEvents: _run_events,
    GetRunGraph: _run_graph,
    GetRunSteps: _run_steps,
    WaitRun: _run_wait,
    ListInteractions: _interaction_list,
    **delivery.READS,
}
# Writes whose prepare only reads (a start's workflow, inspected once by the catalog): a
# retry may prepare again, and its unit of work's lookup answers it (``_write``).
_PREPARE_ONLY_READS: frozenset[type[Request]] = frozenset({StartRun})
WRITES: Writes = {
    StopHost: (None, _host_stop),
    StartRun: (_prepare_start, _run_start),
    CancelRun: (None, _run_cancel),
    PauseRun: (None, _run_pause),
    ResumeRun: (_prepare_resume, _run_resume),
    ResolveEffect: (None, _effect_resolve),
    UpdateInteraction: (None, _interaction_update),
    SubmitInteraction: (None, _interaction_submit),
    AnswerDecision: (None, _decision_answer),
    **delivery.WRITES,
}
READS.update(controller_operations.READS)
WRITES.update(controller_operations.WRITES)
READS.update(settings_operations.READS)
READS.update(output.READS)
WRITES.update(settings_operations.WRITES)
WRITES.update(retention.WRITES)
