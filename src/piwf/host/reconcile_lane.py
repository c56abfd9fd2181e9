"""The reconcile lane (DESIGN.md §9): how due resources are claimed, their reconcile
workers launched and answered, and an unreported end recorded. The dispatcher, renewer,
supervisor and pump are host/lane.py's, shared with runs.

    controller dispatcher   claims due resources while fewer than --max-controller-workers
    │                       reconcile; woken by controller.* requests, a reconcile's end and
    │                       a child run's change, with a poll (and the next due time) as backstop
    ├── claim renewer       every active claim each quarter lease; a lost one cancels its reconcile
    ├── child watcher       a child run that left `running` queues its resource again
    └── reconcile supervisor   one per reconcile, in its own scope: the worker process

Whatever ended a reconcile, its end is recorded as a failure with back-off, unless the
worker's own message recorded its result, or the claim is gone.
"""

from __future__ import annotations

import secrets

import msgspec
import trio

from piwf import faults, processes
from piwf.errors import PiwfError
from piwf.protocol.reconcile import LAUNCH_VAR, ReconcileLaunch, parse_reconcile_message
from piwf.protocol.worker import WorkerMessage, WorkerResponse
from piwf.status import StopReason
from piwf.store.api import ControllerClaim, Delay
from piwf.host import fence, lane
from piwf.host.controller_state import ActiveReconcile, ReconcileEnd
from piwf.host.reconcile_messages import handle
from piwf.host.state import Active, Conclusion, HostState, ProcessEnd, log

MIN_WAIT_S = 0.05  # the dispatcher never spins: a due row it cannot take waits this long
TIMEOUT_S = 60.0  # a reconcile's timeout until its worker says its controller's


async def serve_controllers(host: HostState, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    await _take_over(host)
    await lane.serve(ReconcileLane(host), also=[lambda: _watch_children(host)], task_status=task_status)


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


class ReconcileLane(lane.Lane[ControllerClaim, ReconcileEnd]):
    kind, loads, launch_var = "reconcile", "controller", LAUNCH_VAR

    def __init__(self, host: HostState) -> None:
        super().__init__(host, host.controllers)

    def key(self, claim: ControllerClaim) -> str:
        return claim.uid

    def room(self) -> int:
        return self.host.config.max_controller_workers - len(self.state.active)

    async def claim(self, room: int) -> list[ActiveReconcile]:
        host = self.host
        try:
            claimed = await host.store.controller_queue.claim_due(
                room=room, exclude=frozenset(self.state.active), lease_ms=host.config.controller_lease_ms,
                now=host.now(), epoch=host.epoch)
        except PiwfError as exc:
            log.error("controller dispatcher could not claim: %s", exc)
            return []
        return [Active(claim, worker_id="cw-" + secrets.token_hex(8), timeout_s=TIMEOUT_S) for claim in claimed]

    def claimed(self) -> None:
        faults.point("host.reconcile.claimed")

    async def next_wait(self) -> float:
        host = self.host
        if self.room() <= 0:
            return host.config.poll_s  # a reconcile's end wakes the dispatcher
        try:
            due = await host.store.controller_queue.next_due()
        except PiwfError:
            return host.config.poll_s
        if due is None:
            return host.config.poll_s
        return min(host.config.poll_s, max(MIN_WAIT_S, (due - host.now()) / 1000))

    @property
    def renew_period_s(self) -> float:
        return fence.renew_period_s(self.host.config.controller_lease_ms)

    @property
    def lease_ms(self) -> int:
        return self.host.config.controller_lease_ms

    async def renew(self, claims: list[tuple[str, str]]) -> set[str]:
        host = self.host
        return await host.store.controller_queue.renew_claims(claims, host.config.controller_lease_ms, host.now())

    async def envelope(self, active: ActiveReconcile) -> tuple[msgspec.Struct, str]:
        claim = active.claim
        log.info("%s: reconciling (claim %d)", active.label, claim.claim_number)
        lease_ms, until_ms = fence.launch_bound(self.host, active, self.lease_ms)
        return ReconcileLaunch(uid=claim.uid, generation=claim.claim_number, workerEpoch=active.worker_id,
                               projectPath=claim.project, controller=claim.controller,
                               claimLeaseMs=lease_ms, vouchedUntilMs=until_ms), claim.project

    async def attach(self, active: ActiveReconcile, pid: int, identity: str) -> None:
        await self.host.store.controller_queue.attach_worker(active.claim.uid, active.claim.token, pid, identity)

    def parse(self, line: bytes) -> WorkerMessage:
        return parse_reconcile_message(line)

    async def handle(self, active: ActiveReconcile, message: WorkerMessage) -> WorkerResponse:
        return await handle(self.host, active, message)

    def answered(self) -> None:
        faults.point("host.reconcile.answered")

    def end_of(self, active: ActiveReconcile, stopped_by: StopReason | None) -> ReconcileEnd | None:
        """A reconcile that recorded its own result, or lost its claim, needs nothing more. Any
        other end is a failure with back-off; a host stop queues it again at once (still
        counted, as in the seed)."""
        if active.conclusion is not None or stopped_by is StopReason.CLAIM_LOST:
            return None
        delay: Delay = self.host.controllers.backoff_ms
        not_started = stopped_by is None and active.process_end is not None and not active.process_end.started
        if stopped_by is StopReason.HOST_STOPPING:
            delay = 0
        elif not_started:  # the fork server was being started again: wait a moment, uncounted
            delay = int(self.host.config.crash_backoff_s * 1000)
        return ReconcileEnd(active, _why(active, stopped_by), delay, counted=not not_started)

    async def write_end(self, end: ReconcileEnd) -> bool:
        active = end.active
        try:
            errors = await self.host.store.controller_queue.record_failure(
                active.claim.uid, active.claim.token, error=end.error, delay_ms=end.delay_ms, now=self.host.now(),
                counted=end.counted)
        except PiwfError as exc:
            log.error("%s: could not record the end of its reconcile: %s; will retry", active.label, exc)
            return False
        if errors is not None:  # None: the claim was lost meanwhile, and the failure with it
            log.warning("%s: reconcile failed (%d in a row): %s", active.label, errors, end.error.splitlines()[0])
        return True

    def recorded(self, active: ActiveReconcile) -> None:
        faults.point("host.reconcile.recorded")


def _why(active: ActiveReconcile, stopped_by: StopReason | None) -> str:
    process = active.process_end or ProcessEnd(None, "")
    if stopped_by is StopReason.HOST_STOPPING:
        return "interrupted: the host stopped during the reconcile"
    if stopped_by is not None:
        return f"{stopped_by.value}: {active.stop_note}"
    if not process.started:
        return f"the reconcile worker could not start: {process.diagnostic.strip()[-500:]}"
    tail = (process.diagnostic.strip().splitlines() or ["no output"])[-1][:500]
    return (f"the reconcile worker ended without a result (exit {process.exit_code}, signal {process.signal}): "
            f"{tail}")


CHILDREN_SYNC_S = 0.25  # the changes of runs within this long share one check of the child runs


async def _watch_children(host: HostState) -> None:
    """Child runs started by ``ctx.workflows.ensure``: each change of any run is a chance
    that one left `running`; the check is one indexed query, made within
    ``CHILDREN_SYNC_S`` of a change (the changes of that window share it: a busy host
    changes runs several times per run, and most hosts have no child run at all), and
    every ``poll_s`` as a backstop. A change during a check is seen by the next one."""
    while True:
        seen = host.run_changed.count
        try:
            moved = await host.store.controller_effects.sync_children(host.now())
        except PiwfError as exc:
            log.warning("could not check child runs: %s", exc)
            moved = []
        if moved:
            host.controllers.wake()
        with trio.move_on_after(host.config.poll_s):
            await host.run_changed.wait(after=seen)
            await trio.sleep(CHILDREN_SYNC_S)


__all__ = ["Conclusion", "ReconcileLane", "serve_controllers"]
