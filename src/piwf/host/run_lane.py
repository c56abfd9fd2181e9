"""The run lane: how runs are claimed, launched, answered and their workers' ends recorded
(the dispatcher, renewer, supervisor and pump are host/lane.py's, shared with reconciles).

The dispatcher claims runs while capacity allows, woken at once by ``run.start``,
``run.resume`` and a worker's exit (unless its last round found all there was and the
exit made nothing claimable: ``made_claimable``), with a slow poll only as a backstop
(expired claims, crash back-off). A worker's end is recorded from the reason its scope was cancelled
with, else from what the host had told it.
"""

from __future__ import annotations

import functools

import msgspec
import trio

from piwf import faults
from piwf.errors import PiwfError
from piwf.status import CRASHES, STOPPED_AS, RunStatus, StopReason, WorkerStatus
from piwf.store.api import Claim, Delay, RunLaunch, SupervisionStore, WorkerEnded
from piwf.store.api.rules import input_hash
from piwf.protocol.worker import LaunchEnvelope, Ready, WorkerMessage, WorkerResponse, parse_worker_message
from piwf.wire import LineBuffer
from piwf.host import fence, lane, time_limits
from piwf.host.lane_state import Backoff
from piwf.host.placement import serve_placement
from piwf.host.warm import WarmTicket, hear_idle
from piwf.host.state import Active, ActiveRun, Conclusion, HostState, ProcessEnd, WorkerEnd, log
from piwf.host.worker_messages import ahead_exit_code, handle

MAX_BACKOFF_MS = 60_000


async def serve_dispatcher(host: HostState, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    also = [functools.partial(_serve_warm, host), functools.partial(serve_placement, host)]
    await lane.serve(RunLane(host), also=also, task_status=task_status)


async def _serve_warm(host: HostState) -> None:
    """The idle warm workers (host/warm.py): at most as many as the host may run at once."""
    await host.warm.serve(lambda: host.config.max_workers, host.config.kill_grace_s, lambda: host.drain_deadline)


class RunLane(lane.Lane[Claim, WorkerEnd]):
    kind, loads, launch_var = "run", "workflow", "PIWF_WORKER_LAUNCH"

    def __init__(self, host: HostState) -> None:
        super().__init__(host, host.runs)
        # A crashed run waits base·2^(n-1) after its n-th crash in a row, at most 60 s.
        self.backoff = Backoff(base_ms=host.config.crash_backoff_s * 1000, max_ms=MAX_BACKOFF_MS)
        self.backoff_ends: list[float] = []  # trio times when runs this host parked may be claimed again

    def key(self, claim: Claim) -> str:
        return claim.run_id

    def room(self) -> int:
        return self.host.config.max_workers - len(self.state.active)

    async def claim(self, room: int) -> list[ActiveRun]:
        """Claim runs up to capacity in one store operation."""
        host = self.host
        try:
            claimed = await host.store.supervision.claim_runs(
                room=room, exclude=frozenset(host.active), runner_id=host.host_id, lease_ms=host.config.run_lease_ms,
                now=host.now(), epoch=host.epoch, queues=host.config.queues)
        except PiwfError as exc:
            log.error("dispatcher could not claim runs: %s", exc)
            return []
        self.exhausted = getattr(claimed, "exhausted", False) and len(claimed) < room
        return [Active(claim, worker_id=worker_id) for claim, worker_id in claimed]

    def claimed(self) -> None:
        faults.point("host.claim.committed")

    async def next_wait(self) -> float:
        """The backstop poll, or sooner when the back-off of a run this host parked ends
        (the store keeps the back-off; this is only when to look again)."""
        now = trio.current_time()
        self.backoff_ends = [end for end in self.backoff_ends if end > now]
        return min([self.host.config.poll_s, *(end - now for end in self.backoff_ends)])

    @property
    def renew_period_s(self) -> float:
        return fence.renew_period_s(self.host.config.run_lease_ms)

    @property
    def lease_ms(self) -> int:
        return self.host.config.run_lease_ms

    async def renew(self, claims: list[tuple[str, str]]) -> set[str]:
        return await self.host.store.queue.renew_claims(claims, self.host.config.run_lease_ms, self.host.now())

    async def lost_reasons(self, keys: list[str]) -> dict[str, StopReason]:
        """A run cancelled through another host (its claim ended with it) is stopped as
        cancelled, as a cancel through this host stops it."""
        reasons = {}
        for run_id in keys:
            try:
                cancelled = (await self.host.store.runs.run_summary(run_id)).status == RunStatus.CANCELLED
            except PiwfError:  # gone (pruned) or unreadable: a claim lost, as it is
                continue
            if cancelled:
                reasons[run_id] = StopReason.CANCELLED
        return reasons

    async def envelope(self, active: ActiveRun) -> tuple[msgspec.Struct, str]:
        run_id = active.claim.run_id
        launch = active.claim.launch
        if launch is None:  # a claim not from claim_runs: read what its worker is launched with
            workflow, project, digest, run_input, _ = await self.host.store.runs.run_source(run_id)
            launch = RunLaunch(workflow, project, digest, input_hash(run_input))
        project = launch.project_path
        lease_ms, until_ms = fence.launch_bound(self.host, active, self.lease_ms)
        envelope = LaunchEnvelope(
            runId=run_id, generation=active.claim.generation, workerEpoch=active.worker_id, projectPath=project,
            workflow=launch.workflow, definitionDigest=launch.definition_digest, inputHash=launch.input_hash,
            nice=self.host.config.worker_nice, claimLeaseMs=lease_ms, vouchedUntilMs=until_ms,
        )
        log.info("run %s: claimed (generation %d)", run_id, active.claim.generation)
        active.warm = WarmTicket(project, launch.workflow, launch.definition_digest)
        return envelope, project

    async def attach(self, active: ActiveRun, pid: int, identity: str) -> None:
        """Kept for ``worker.ready``'s transaction, which records it (one write less per run).
        Until then a host that dies leaves no pid for the next to kill the worker by: the
        worker's watcher thread, started before it loads anything of the workflow's, kills
        its process group as soon as its host's end of the pipe closes (worker/channel.py)."""
        active.identity = identity

    def parse(self, line: bytes) -> WorkerMessage:
        return parse_worker_message(line)

    async def handle(self, active: ActiveRun, message: WorkerMessage) -> WorkerResponse:
        if isinstance(message, Ready) and active.warm is not None:
            active.warm.ready(message)  # whether this worker may be kept warm after the run
        return await handle(self.host, active, message)

    async def went_idle(self, active: ActiveRun, receive: trio.lowlevel.FdStream, buffer: LineBuffer) -> bool:
        return await hear_idle(active.warm, active.worker_id, receive, buffer)

    def answered(self) -> None:
        faults.point("host.worker.answered")

    def end_of(self, active: ActiveRun, stopped_by: StopReason | None) -> WorkerEnd | None:
        """The worker's record, and the run parked unless its claim is gone (cancelled, lost)."""
        status = _worker_status(active, stopped_by)
        process = active.process_end or ProcessEnd(None, "")
        if stopped_by is not None and active.stop_note:  # why piwf stopped it, where people look
            process = process.noted(active.stop_note)
        if status in CRASHES:
            log.warning("%s: worker %s (exit %s, signal %s): %s", active.label, status, process.exit_code,
                        process.signal, _last_line(process.diagnostic))
        if active.end_recorded is not None:  # with the message that ended its run (worker_messages)
            expected = (WorkerStatus.EXITED, ahead_exit_code(active), active.end_recorded)
            if (status, process.returncode, process.diagnostic) == expected:
                return None  # it ended as recorded
            return WorkerEnd(active, status, process, park=False, amend=True)
        park = status not in (WorkerStatus.CANCELLED, WorkerStatus.CLAIM_LOST)
        over = active.node_clock if stopped_by is StopReason.NODE_TIME_LIMIT else None
        return WorkerEnd(active, status, process, park=park, over_limit=over)

    async def write_end(self, end: WorkerEnd) -> bool:
        host, active = self.host, end.active
        now = host.now()
        try:
            if end.amend:
                process = end.process
                await host.store.workers.amend_end(
                    worker_id=active.worker_id, run_id=active.claim.run_id, status=end.status, now=now,
                    exit_code=process.exit_code, signal=process.signal, diagnostic=process.diagnostic or None)
                return True
            if end.status is WorkerStatus.CLAIM_LOST and (await self.lost_reasons([active.claim.run_id])):
                end.status = WorkerStatus.CANCELLED  # its claim ended with the run, cancelled through another host
            if end.over_limit is None:
                ended = await self._end_worker(host.store.supervision, end, now)
            else:
                async with host.store.transaction() as tx:  # the node's outcome and the worker's end, together
                    await time_limits.record(tx, active, end.over_limit, now)
                    ended = await self._end_worker(tx.supervision, end, now)
        except PiwfError as exc:
            log.error("%s: could not record the end of its worker (%s): %s; will retry", active.label,
                      end.status, exc)
            return False
        if ended.crashes >= host.config.max_crashes:
            log.warning("%s: held after %d crashes in a row", active.label, ended.crashes)
        if ended.not_before is not None:
            delay = (ended.not_before - now) / 1000
            self.backoff_ends.append(trio.current_time() + delay)
            if ended.crashes:
                log.info("%s: parked after a crash; claimed again in %.1f s", active.label, delay)
        if ended.waiting_again:
            host.interactions_changed()
        return True

    async def _end_worker(self, supervision: SupervisionStore, end: WorkerEnd, now: int) -> WorkerEnded:
        active, process = end.active, end.process
        return await supervision.end_worker(
            worker_id=active.worker_id, run_id=active.claim.run_id, token=active.claim.token,
            status=end.status, now=now, exit_code=process.exit_code, signal=process.signal,
            diagnostic=process.diagnostic or None, park=end.park, max_crashes=self.host.config.max_crashes,
            last_output=_last_line(process.diagnostic), backoff=self._backoff(end))

    def _backoff(self, end: WorkerEnd) -> Delay | None:
        """A run whose worker crashed is claimed again after a back-off that doubles with
        each crash in a row (the store counts them, and holds the run after ``max_crashes``);
        one whose worker could not even start waits the first back-off, uncounted; one
        stopped at a node's time limit goes on at once (its node's outcome is recorded)."""
        status = end.status
        if end.over_limit is not None:
            return None
        if status is WorkerStatus.NOT_STARTED:
            return int(self.backoff.base_ms)
        return self.backoff.delay_ms if status in CRASHES else None

    def recorded(self, active: ActiveRun) -> None:
        faults.point("host.worker.recorded")

    def made_claimable(self, active: ActiveRun, end: WorkerEnd | None) -> bool:
        """False only for a run of no origin session that its own message ended (completed
        or failed), its worker's end recorded with it as it was: its end changed nothing
        in the queue (no session's next run waits on it, and it is never claimed again)."""
        return not (active.run_ended and active.claim.sessionless and end is None)

    def left(self, active: ActiveRun) -> None:
        self.host.changed()


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


def _last_line(text: str) -> str:
    return (text.strip().splitlines() or ["no output"])[-1][:300]
