"""The controller dispatcher and one supervisor per active reconcile (DESIGN.md §9).

    controller dispatcher   claims due resources while fewer than --max-controller-workers
    │                       reconcile; woken by controller.* requests, a reconcile's end and
    │                       a child run's change, with a poll (and the next due time) as backstop
    ├── claim renewer       every active claim each quarter lease; a lost one cancels its reconcile
    ├── child watcher       a child run that left `running` queues its resource again
    └── reconcile supervisor   one per reconcile, in its own scope: the worker process

The same cancel-scope rules as runs (``host/runs.py``): stopping a reconcile is cancelling
its scope with a ``ReconcileStop``; whatever ended it, the supervisor records the end
under a shielded scope (a failure with back-off, unless the worker's own message recorded its
result, or the claim is gone), so cancellation cannot interrupt the record.
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Callable

import trio
import trio_util

from piwf import faults, processes
from piwf.protocol.reconcile import LAUNCH_VAR, ReconcileLaunch
from piwf.errors import PiwfError
from piwf.store.api import ControllerClaim
from piwf.host.controller_state import ActiveReconcile, ReconcileStop
from piwf.host.reconcile_messages import pump
from piwf.host.state import Conclusion, HostState, ProcessEnd, log
from piwf.host.worker_process import cleanup_scope, run_worker

MIN_WAIT_S = 0.05  # the dispatcher never spins: a due row it cannot take waits this long
RECORD_S = 5.0  # how long recording a reconcile's end may take, shielded


async def serve_controllers(host: HostState, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    await _take_over(host)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_renew_claims, host)
        nursery.start_soon(_watch_children, host)
        task_status.started()
        state = host.controllers
        while True:
            state.wake_event = trio.Event()
            for claim in await _claim_due(host):
                faults.point("host.reconcile.claimed")
                active = ActiveReconcile(claim, worker_epoch="cw-" + secrets.token_hex(8))
                state.active[claim.uid] = active
                nursery.start_soon(supervise_reconcile, host, active)
            with trio.move_on_after(await _next_wait(host)):
                await state.wake_event.wait()


async def _take_over(host: HostState) -> None:
    """Reconciles an earlier host was running are due at once. Their workers normally
    died with it (a worker whose host pipe closes kills its own process group); one that
    did not is killed here, by the pid and start identity its claim recorded, before its
    resource can be claimed again, so two passes of one resource never overlap."""
    try:
        for uid, pid, identity in await host.store.controller_queue.orphaned_workers(host.epoch):
            if processes.kill_recorded_group(pid, identity):
                log.info("killed the orphaned reconcile worker of %s (pid %d)", uid, pid)
        expired = await host.store.controller_queue.expire_claims_before(host.epoch, host.now())
    except PiwfError as exc:
        log.error("could not release the reconciles of earlier hosts: %s", exc)
        return
    if expired:
        log.info("%d reconcile(s) interrupted by an earlier host queued again", expired)


async def _claim_due(host: HostState) -> list[ControllerClaim]:
    state = host.controllers
    room = host.config.max_controller_workers - len(state.active)
    try:
        return await host.store.controller_queue.claim_due(room=room, exclude=frozenset(state.active),
                                                           lease_ms=host.config.controller_lease_ms, now=host.now(),
                                                           epoch=host.epoch)
    except PiwfError as exc:
        log.error("controller dispatcher could not claim: %s", exc)
        return []


async def _next_wait(host: HostState) -> float:
    if len(host.controllers.active) >= host.config.max_controller_workers:
        return host.config.poll_s  # a reconcile's end wakes the dispatcher
    try:
        due = await host.store.controller_queue.next_due()
    except PiwfError:
        return host.config.poll_s
    if due is None:
        return host.config.poll_s
    return min(host.config.poll_s, max(MIN_WAIT_S, (due - host.now()) / 1000))


async def supervise_reconcile(host: HostState, active: ActiveReconcile) -> None:
    cancelled = False
    try:
        with active.scope:
            try:
                await _launch_contained(host, active)
            except* trio.Cancelled:
                cancelled = True
                raise
    finally:
        stopped_by = active.stop_reason or (ReconcileStop.HOST_STOPPING if cancelled else None)
        with cleanup_scope(host, RECORD_S):  # shielded: cancellation cannot interrupt it
            await _record_end(host, active, stopped_by)
        faults.point("host.reconcile.recorded")
        del host.controllers.active[active.uid]
        host.controllers.wake()


async def _launch_contained(host: HostState, active: ActiveReconcile) -> None:
    try:
        claim = active.claim
        launch = ReconcileLaunch(uid=claim.uid, generation=claim.generation, workerEpoch=active.worker_epoch,
                                 projectPath=claim.project, controller=claim.controller)
        log.info("%s: reconciling (claim %d)", active.run_id, claim.generation)
        async def attach(pid: int, identity: str) -> None:
            await host.store.controller_queue.attach_worker(claim.uid, claim.token, pid, identity)

        await run_worker(host, active, launch, claim.project, launch_var=LAUNCH_VAR, pump=pump,  # type: ignore[arg-type]
                         attach=attach)
    except* Exception as failed:
        log.error("%s: supervision failed", active.run_id, exc_info=failed)
        end = active.process_end or ProcessEnd(None, "")
        active.process_end = end.noted(f"supervision failed: {failed.exceptions[0]!r}")


async def _record_end(host: HostState, active: ActiveReconcile, stopped_by: ReconcileStop | None) -> None:
    """A reconcile that recorded its own result, or lost its claim, needs nothing more. Any
    other end is a failure with back-off; a host stop queues it again at once (still
    counted, as in the seed)."""
    if active.conclusion is not None or stopped_by is ReconcileStop.CLAIM_LOST:
        return
    error = _why(active, stopped_by)
    delay: int | Callable[[int], int] = host.controllers.backoff_ms
    not_started = stopped_by is None and active.process_end is not None and not active.process_end.started
    if stopped_by is ReconcileStop.HOST_STOPPING:
        delay = 0
    elif not_started:  # the fork server was being started again: wait a moment, uncounted
        delay = int(host.config.crash_backoff_s * 1000)
    try:
        errors = await host.store.controller_queue.record_failure(
            active.uid, active.claim.token, error=error, delay_ms=delay, now=host.now(), counted=not not_started)
    except PiwfError as exc:  # the claim expires and the resource is claimed again
        log.error("%s: could not record the end of its reconcile: %s", active.run_id, exc)
        return
    if errors is not None:
        log.warning("%s: reconcile failed (%d in a row): %s", active.run_id, errors, error.splitlines()[0])


def _why(active: ActiveReconcile, stopped_by: ReconcileStop | None) -> str:
    process = active.process_end or ProcessEnd(None, "")
    if stopped_by is ReconcileStop.HOST_STOPPING:
        return "interrupted: the host stopped during the reconcile"
    if stopped_by is not None:
        return f"{stopped_by.value}: {active.stop_note}"
    if not process.started:
        return f"the reconcile worker could not start: {process.diagnostic.strip()[-500:]}"
    tail = (process.diagnostic.strip().splitlines() or ["no output"])[-1][:500]
    return (f"the reconcile worker ended without a result (exit {process.exit_code}, signal {process.signal}): "
            f"{tail}")


async def _renew_claims(host: HostState) -> None:
    period = host.config.controller_lease_ms / 4000
    async with contextlib.aclosing(trio_util.periodic(period)) as ticks:
        async for _ in ticks:
            active = list(host.controllers.active.values())
            if not active:
                continue
            try:
                lost = await host.store.controller_queue.renew_claims([(a.uid, a.claim.token) for a in active],
                                                                      host.config.controller_lease_ms, host.now())
            except PiwfError as exc:
                log.warning("reconcile claim renewal failed (%s); will retry", exc)
                continue
            for reconcile in active:
                if reconcile.uid in lost and reconcile.conclusion is None:
                    log.warning("%s: claim lost; stopping its reconcile", reconcile.run_id)
                    reconcile.stop(ReconcileStop.CLAIM_LOST, "the claim on the resource was lost")


async def _watch_children(host: HostState) -> None:
    """Child runs started by ``ctx.workflows.ensure``: each change of any run is a chance
    that one left `running`; the check is one indexed query."""
    while True:
        try:
            moved = await host.store.controller_effects.sync_children(host.now())
        except PiwfError as exc:
            log.warning("could not check child runs: %s", exc)
            moved = []
        if moved:
            host.controllers.wake()
        with trio.move_on_after(host.config.poll_s):
            await host.run_changed.wait()


__all__ = ["Conclusion", "serve_controllers", "supervise_reconcile"]
