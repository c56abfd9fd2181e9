"""The run dispatcher and one supervisor per active run.

The dispatcher claims runs while capacity allows, woken at once by ``run.start``,
``run.resume`` and a worker's exit, with a slow poll only as a backstop (expired claims,
crash back-off). Each supervisor owns one cancel scope: cancelling it with a
``StopReason`` (run.cancel, claim loss, a startup timeout) stops the worker; a
cancellation from outside (the host stopping) reaches it too. Either way the reason
arrives with the ``Cancelled``, and the worker's end is recorded from it.
"""

from __future__ import annotations

import contextlib

import trio
import trio_util

from piwf import faults
from piwf.errors import PiwfError
from piwf.status import CRASHES, STOPPED_AS, StopReason, WorkerStatus
from piwf.store.api import Claim
from piwf.store.api.rules import input_hash
from piwf.protocol.worker import LaunchEnvelope
from piwf.host.state import ActiveRun, Conclusion, HostState, ProcessEnd, WorkerEnd, log
from piwf.host.worker_process import cleanup_scope, run_worker

MAX_BACKOFF_S = 60.0
RECORD_S = 5.0  # how long recording a worker's end may take, shielded


async def serve_dispatcher(host: HostState, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(renew_claims, host)
        task_status.started()
        while True:
            host.wake_dispatcher = trio.Event()
            await retry_unrecorded(host)
            for claim, worker_epoch in await _claim_available(host):
                faults.point("host.claim.committed")
                active = ActiveRun(claim, worker_epoch=worker_epoch)
                host.active[claim.run_id] = active
                nursery.start_soon(supervise_run, host, active)
            with trio.move_on_after(_next_poll(host)):
                await host.wake_dispatcher.wait()


def _next_poll(host: HostState) -> float:
    """The backstop poll, or sooner when a crashed run's back-off ends."""
    now = trio.current_time()
    waits = [not_before - now for not_before in host.backoff.values() if not_before > now]
    return min([host.config.poll_s, *waits])


async def _claim_available(host: HostState) -> list[tuple[Claim, str]]:
    """Claim runs up to capacity in one store operation; a store error ends this round
    with nothing claimed."""
    room = host.config.max_workers - len(host.active)
    if room <= 0:
        return []
    now_s = trio.current_time()
    exclude = frozenset({r for r, not_before in host.backoff.items() if not_before > now_s} | set(host.active))
    try:
        return await host.store.supervision.claim_runs(room=room, exclude=exclude, runner_id=host.host_id,
                                                       lease_ms=host.config.run_lease_ms, now=host.now(),
                                                       epoch=host.epoch)
    except PiwfError as exc:
        log.error("dispatcher could not claim runs: %s", exc)
        return []


async def supervise_run(host: HostState, active: ActiveRun) -> None:
    cancelled = False
    try:
        with active.scope:
            try:
                await _launch_contained(host, active)
            except* trio.Cancelled:  # it goes on unwinding; its reason is the scope's
                cancelled = True
                raise
    finally:
        # Stopped with a reason by piwf (kept by the run's scope: trio hands a task the
        # reason of its innermost cancelled scope, which may be a nursery's), or by a
        # cancellation from outside: the host is stopping.
        stopped_by = active.stop_reason or (StopReason.HOST_STOPPING if cancelled else None)
        with cleanup_scope(host, RECORD_S):  # shielded: cancellation cannot interrupt it
            await _record_end(host, _worker_end(host, active, stopped_by))
        faults.point("host.worker.recorded")
        del host.active[active.run_id]
        host.changed()
        host.wake()


async def _launch_contained(host: HostState, active: ActiveRun) -> None:
    """A failure supervising one run parks that run; it never takes the host down."""
    try:
        await _launch(host, active)
    except* Exception as failed:  # a cancellation in the same group goes on unwinding
        log.error("run %s: supervision failed", active.run_id, exc_info=failed)
        end = active.process_end or ProcessEnd(None, "")
        active.process_end = end.noted(f"supervision failed: {failed.exceptions[0]!r}")


async def _launch(host: HostState, active: ActiveRun) -> None:
    workflow, project, digest, run_input, _ = await host.store.runs.run_source(active.run_id)
    envelope = LaunchEnvelope(
        runId=active.run_id, generation=active.claim.generation, workerEpoch=active.worker_epoch,
        projectPath=project, workflow=workflow, definitionDigest=digest, inputHash=input_hash(run_input),
    )
    log.info("run %s: claimed (generation %d)", active.run_id, active.claim.generation)
    await run_worker(host, active, envelope, project)


async def renew_claims(host: HostState) -> None:
    """One renewer for every active run: all claims renewed in one transaction every third
    of a lease. A run whose claim is lost has its scope cancelled; a failed renewal is
    retried at the next tick (the claims stay live for two more)."""
    async with contextlib.aclosing(trio_util.periodic(host.config.run_lease_ms / 3000)) as ticks:
        async for _ in ticks:
            active = list(host.active.values())
            if not active:
                continue
            try:
                lost = await host.store.queue.renew_claims([(a.run_id, a.claim.token) for a in active],
                                                           host.config.run_lease_ms, host.now())
            except PiwfError as exc:
                log.warning("claim renewal failed (%s); will retry", exc)
                continue
            for run in active:
                # A worker whose own message ended or parked its run released the claim.
                if run.run_id in lost and run.conclusion is None:
                    log.warning("run %s: claim lost; stopping its worker", run.run_id)
                    run.stop(StopReason.CLAIM_LOST)


def _worker_status(active: ActiveRun, stopped_by: StopReason | None) -> WorkerStatus:
    """Why the worker ended: the reason its scope was cancelled with; else what the host
    had told it; a worker that ended untold crashed, whatever its exit status."""
    if stopped_by is not None:
        return STOPPED_AS[stopped_by]
    if active.process_end is not None and not active.process_end.started:
        return WorkerStatus.NOT_STARTED
    if active.conclusion is Conclusion.CLAIM_LOST:
        return WorkerStatus.CLAIM_LOST
    return WorkerStatus.EXITED if active.conclusion is not None else WorkerStatus.CRASHED


def _worker_end(host: HostState, active: ActiveRun, stopped_by: StopReason | None) -> WorkerEnd:
    """The worker's record, and the run parked unless its claim is gone (cancelled, lost)."""
    status = _worker_status(active, stopped_by)
    process = active.process_end or ProcessEnd(None, "")
    if stopped_by is not None and active.stop_note:  # why piwf stopped it, where people look
        process = process.noted(active.stop_note)
    if status in CRASHES:
        log.warning("run %s: worker %s (exit %s, signal %s): %s", active.run_id, status, process.exit_code,
                    process.signal, _last_line(process.diagnostic))
    park = status not in (WorkerStatus.CANCELLED, WorkerStatus.CLAIM_LOST)
    return WorkerEnd(active, status, process, park=park)


async def _record_end(host: HostState, end: WorkerEnd) -> None:
    if not await _write_end(host, end):
        host.unrecorded[end.active.run_id] = end


async def retry_unrecorded(host: HostState) -> None:
    """Worker ends the store refused before (a full disk): try them again."""
    for run_id, end in list(host.unrecorded.items()):
        if await _write_end(host, end):
            del host.unrecorded[run_id]
            log.info("run %s: recorded the end of its worker after an earlier failure", run_id)


async def _write_end(host: HostState, end: WorkerEnd) -> bool:
    active, process = end.active, end.process
    try:
        ended = await host.store.supervision.end_worker(
            worker_epoch=active.worker_epoch, run_id=active.run_id, token=active.claim.token,
            status=end.status, now=host.now(), exit_code=process.exit_code, signal=process.signal,
            diagnostic=process.diagnostic or None, park=end.park, max_crashes=host.config.max_crashes,
            last_output=_last_line(process.diagnostic))
    except PiwfError as exc:
        log.error("run %s: could not record the end of its worker (%s): %s; will retry", active.run_id,
                  end.status, exc)
        return False
    _back_off(host, active.run_id, ended.crashes, end.status)
    if ended.waiting_again:
        host.interactions_changed()
    return True


def _back_off(host: HostState, run_id: str, crashes: int, status: WorkerStatus) -> None:
    """A run whose worker crashed is claimed again after a back-off that doubles with each
    crash in a row (the store counts them, and holds the run after ``max_crashes``); one
    whose worker could not even start waits the first back-off, uncounted."""
    if status is WorkerStatus.NOT_STARTED:
        host.backoff[run_id] = trio.current_time() + host.config.crash_backoff_s
        return
    if crashes == 0:
        host.backoff.pop(run_id, None)
        return
    if crashes >= host.config.max_crashes:
        log.warning("run %s: held after %d crashes in a row", run_id, crashes)
        host.backoff.pop(run_id, None)
        return
    delay = min(MAX_BACKOFF_S, host.config.crash_backoff_s * 2 ** (crashes - 1))
    host.backoff[run_id] = trio.current_time() + delay
    log.info("run %s: parked after a crash; claimed again in %.1f s", run_id, delay)


def _last_line(text: str) -> str:
    return (text.strip().splitlines() or ["no output"])[-1][:300]
