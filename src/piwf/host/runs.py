"""The run dispatcher and one supervisor per active run.

The dispatcher claims runs while capacity allows, woken at once by ``run.start``,
``run.resume`` and a worker's exit, with a slow poll only as a backstop (expired claims,
crash back-off). Each supervisor owns one cancel scope: cancelling it (run.cancel, claim
loss, host stop) stops the worker, and shielded cleanup parks whatever is left.
"""

from __future__ import annotations

import secrets

import trio

from .. import faults
from ..errors import PiwfError
from ..store import queue, runs, workers
from ..store.queue import Claim
from ..wire import LaunchEnvelope
from .state import ActiveRun, CrashRecord, HostState, Settlement, log
from .worker_process import WorkerExit, run_worker

MAX_BACKOFF_S = 60.0


async def serve_dispatcher(host: HostState, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(renew_claims, host)
        task_status.started()
        while True:
            host.wake_dispatcher = trio.Event()
            retry_settlements(host)
            for claim, worker_epoch in _claim_available(host):
                faults.point("host.claim.committed")
                active = ActiveRun(claim, worker_epoch=worker_epoch)
                host.active[claim.run_id] = active
                nursery.start_soon(supervise_run, host, active)
            with trio.move_on_after(_next_poll(host)):
                await host.wake_dispatcher.wait()


def _next_poll(host: HostState) -> float:
    """The backstop poll, or sooner when a crashed run's back-off ends."""
    now = trio.current_time()
    waits = [c.not_before - now for c in host.crashes.values() if c.not_before > now]
    return min([host.config.poll_s, *waits])


def _claim_available(host: HostState) -> list[tuple[Claim, str]]:
    """Claim runs up to capacity in one transaction (one commit for the batch), each with
    its worker record; a store error ends this round with nothing claimed."""
    room = host.config.max_workers - len(host.active)
    if room <= 0:
        return []
    now_s = trio.current_time()
    exclude = {r for r, c in host.crashes.items() if c.not_before > now_s} | set(host.active)
    claims: list[tuple[Claim, str]] = []
    try:
        with host.db.write():
            while len(claims) < room and (taken := _claim_one(host, frozenset(exclude))) is not None:
                claims.append(taken)
                exclude.add(taken[0].run_id)
    except PiwfError as exc:
        log.error("dispatcher could not claim runs: %s", exc)
        return []
    return claims


def _claim_one(host: HostState, exclude: frozenset[str]) -> tuple[Claim, str] | None:
    now = host.now()
    claim = queue.claim_next_run(host.db, runner_id=host.host_id, token=secrets.token_urlsafe(24),
                                 lease_ms=host.config.run_lease_ms, now=now, epoch=host.epoch, exclude=exclude)
    if claim is None:
        return None
    worker_epoch = secrets.token_hex(8)
    workers.record_start(host.db, worker_epoch=worker_epoch, run_id=claim.run_id, generation=claim.generation,
                         host_epoch=host.epoch, now=now)
    return claim, worker_epoch


async def supervise_run(host: HostState, active: ActiveRun) -> None:
    result: WorkerExit | None = None
    try:
        with active.scope:
            result = await _launch_contained(host, active)
    finally:
        _settle(host, active, result)  # synchronous: cancellation cannot interrupt it
        faults.point("host.run.settled")
        del host.active[active.run_id]
        host.changed()
        host.wake()


async def _launch_contained(host: HostState, active: ActiveRun) -> WorkerExit:
    """A failure supervising one run parks that run; it never takes the host down."""
    try:
        return await _launch(host, active)
    except Exception as exc:
        log.exception("run %s: supervision failed", active.run_id)
        return WorkerExit("crashed", None, None, f"supervision failed: {exc}")


async def _launch(host: HostState, active: ActiveRun) -> WorkerExit:
    workflow, project, digest, run_input, _ = runs.run_source(host.db, active.run_id)
    envelope = LaunchEnvelope(
        runId=active.run_id, generation=active.claim.generation, workerEpoch=active.worker_epoch,
        projectPath=project, workflow=workflow, definitionDigest=digest, inputHash=runs.input_hash(run_input),
    )
    log.info("run %s: claimed (generation %d)", active.run_id, active.claim.generation)
    return await run_worker(host, active, envelope, project)


async def renew_claims(host: HostState) -> None:
    """One renewer for every active run: all claims renewed in one transaction every third
    of a lease. A run whose claim is lost has its scope cancelled; a failed renewal is
    retried at the next tick (the claims stay live for two more)."""
    interval = host.config.run_lease_ms / 3000
    while True:
        await trio.sleep(interval)
        active = list(host.active.values())
        if not active:
            continue
        try:
            lost = queue.renew_claims(host.db, [(a.run_id, a.claim.token) for a in active],
                                      host.config.run_lease_ms, host.now())
        except PiwfError as exc:
            log.warning("claim renewal failed (%s); will retry", exc)
            continue
        for run in active:
            if run.run_id in lost:
                log.warning("run %s: claim lost; stopping its worker", run.run_id)
                run.stop("claimLost")


def _settle(host: HostState, active: ActiveRun, result: WorkerExit | None) -> None:
    """Record the worker's outcome and leave the run parked unless it settled. If the store
    refuses (a full disk), the settlement is kept and retried by the dispatcher."""
    # No result and no reason: the host is draining (or something failed on the way).
    outcome = active.stop_reason or (result.outcome if result else "orphaned" if host.stopping else "crashed")
    if active.settled or outcome in ("cancelled", "claimLost"):
        host.crashes.pop(active.run_id, None)
        settlement = Settlement(active, outcome, result, park=False, detail=None)
    else:
        if outcome in ("crashed", "timedOut") and result is not None:
            log.warning("run %s: worker %s (exit %s, signal %s): %s", active.run_id, outcome, result.exit_code,
                        result.signal, _last_line(result.diagnostic))
        settlement = Settlement(active, outcome, result, park=True,
                                detail=_crash_detail(host, active, outcome, result))
    if not _write_settlement(host, settlement):
        host.unsettled[active.run_id] = settlement


def retry_settlements(host: HostState) -> None:
    """Settlements the store refused before (a full disk): try them again."""
    for run_id, settlement in list(host.unsettled.items()):
        if _write_settlement(host, settlement):
            del host.unsettled[run_id]
            log.info("run %s: settled after an earlier failure", run_id)


def _write_settlement(host: HostState, settlement: Settlement) -> bool:
    active, result = settlement.active, settlement.result
    now = host.now()
    try:
        with host.db.write():
            workers.finish(host.db, active.worker_epoch, active.run_id, settlement.outcome, now,
                           exit_code=result.exit_code if result else None,
                           signal=result.signal if result else None,
                           diagnostic=(result.diagnostic or None) if result else None)
            if settlement.park and queue.park_run(host.db, active.run_id, active.claim.token, now,
                                                  hold="crashed" if settlement.detail else None,
                                                  detail=settlement.detail):
                log.info("run %s: parked after worker %s%s", active.run_id, settlement.outcome,
                         f" ({settlement.detail})" if settlement.detail else "")
    except PiwfError as exc:
        log.error("run %s: could not record the end of its worker (%s): %s; will retry", active.run_id,
                  settlement.outcome, exc)
        return False
    return True


def _crash_detail(host: HostState, active: ActiveRun, outcome: str, result: WorkerExit | None) -> str | None:
    """Back off a run whose worker keeps crashing; hold it after ``max_crashes`` in a row."""
    if outcome not in ("crashed", "timedOut"):
        return None
    record = host.crashes.get(active.run_id, CrashRecord(0, 0.0))
    backoff = min(MAX_BACKOFF_S, host.config.crash_backoff_s * 2**record.count)
    record = CrashRecord(record.count + 1, trio.current_time() + backoff)
    host.crashes[active.run_id] = record
    if record.count < host.config.max_crashes:
        return None
    host.crashes.pop(active.run_id)
    last = _last_line(result.diagnostic if result else "")
    return f"worker crashed {record.count} times in a row; last output: {last}"


def _last_line(text: str) -> str:
    return (text.strip().splitlines() or ["no output"])[-1][:300]
