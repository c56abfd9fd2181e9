"""One supervision lane, for runs and for reconciles: a dispatcher, a claim renewer, one
supervisor per claimed piece of work, its worker's message pump, and the recording of its
end. What differs between the two is a ``Lane`` (host/run_lane.py, host/reconcile_lane.py).

    dispatcher     claims work while its lane has room, woken at once by the events that
    │              free room or queue work (not by a run's end that the last round shows
    │              could not make any claimable), with a poll as backstop; each round
    │              first retries the ends the store refused
    ├── claim renewer   every active claim, one transaction per tick; a lost one cancels
    │                   that work's scope with reason claimLost
    ├── fence           on a shared store: work whose claim (or the host lease) could not be
    │                   renewed in time is killed before it can expire (host/fence.py)
    └── supervisor      one per claim, in its own cancel scope: the worker process
                        (host/worker_process.py) and its message pump

Stopping work is cancelling its scope with a ``StopReason``; a cancellation from outside
means the host is stopping. Either way the reason arrives with the ``Cancelled``, and
the supervisor records the end under a shielded, bounded scope, so cancellation cannot
interrupt the record; an end the store refused (a full disk) is kept and retried.
"""

from __future__ import annotations

import functools
import math
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Generic

import msgspec
import trio

from piwf.errors import PiwfError, ProtocolError
from piwf.protocol.worker import MAX_WORKER_LINE, HostHeartbeat, WorkerMessage, WorkerResponse
from piwf.status import StopReason
from piwf.wire import LineBuffer, encode_line
from piwf.host import fence
from piwf.host.lane_state import Active, C, Conclusion, E, LaneState, NodeClock, ProcessEnd
from piwf.host.state import HostState, log
from piwf.host.worker_process import Bound, cleanup_scope, receive_before, run_worker, send_answer

RECORD_S = 5.0  # how long recording a worker's end may take, shielded


class Lane(ABC, Generic[C, E]):
    """What one kind of work (runs, reconciles) does its own way; the loops are below."""

    kind: str  # what the work is called in logs: "run", "reconcile"
    loads: str  # what its worker loads before it reports ready: "workflow", "controller"
    launch_var: str  # the environment variable its launch envelope travels in

    def __init__(self, host: HostState, state: LaneState[C, E]) -> None:
        self.host, self.state = host, state

    @abstractmethod
    def key(self, claim: C) -> str:
        """The work's key in ``state.active`` (a run id, a resource uid)."""

    @abstractmethod
    def room(self) -> int:
        """How much more work may be claimed now."""

    @abstractmethod
    async def claim(self, room: int) -> list[Active[C]]:
        """Claim up to ``room`` (> 0) pieces of work none of which is active here; a store
        error ends the round with nothing claimed (logged)."""

    @abstractmethod
    def claimed(self) -> None:
        """A claim committed, before its supervisor starts (its fault point)."""

    @abstractmethod
    async def next_wait(self) -> float:
        """How long the dispatcher may sleep when nothing wakes it."""

    @property
    @abstractmethod
    def renew_period_s(self) -> float: ...

    @property
    @abstractmethod
    def lease_ms(self) -> int:
        """How long a claim lives in the store after it is taken or renewed."""

    @abstractmethod
    async def renew(self, claims: list[tuple[str, str]]) -> set[str]:
        """Renew the (key, token) claims in one transaction; the keys whose claim was lost."""

    @abstractmethod
    async def envelope(self, active: Active[C]) -> tuple[msgspec.Struct, str]:
        """The launch envelope of its worker and the project it runs in."""

    @abstractmethod
    async def attach(self, active: Active[C], pid: int, identity: str) -> None:
        """Record the started worker's pid and start identity."""

    @abstractmethod
    def parse(self, line: bytes) -> WorkerMessage: ...

    @abstractmethod
    async def handle(self, active: Active[C], message: WorkerMessage) -> WorkerResponse:
        """Answer one message (one unit of work fenced by the claim)."""

    @abstractmethod
    def answered(self) -> None:
        """An answer was written to the worker (its fault point)."""

    @abstractmethod
    def end_of(self, active: Active[C], stopped_by: StopReason | None) -> E | None:
        """What to record of the work's end; None: nothing (its worker recorded it)."""

    @abstractmethod
    async def write_end(self, end: E) -> bool:
        """Record an end; False when the store refused it (logged): it is retried."""

    @abstractmethod
    def recorded(self, active: Active[C]) -> None:
        """The end was recorded (its fault point), before the work leaves ``state.active``."""

    async def lost_reasons(self, keys: list[str]) -> dict[str, StopReason]:
        """Why the claims of ``keys`` are gone, where it is not simply lost (``claimLost``):
        a run cancelled by a client, say, through another host."""
        return {}

    def left(self, active: Active[C]) -> None:
        """The work left ``state.active`` (its dispatcher is woken already, if need be)."""

    # The last claim round found all the claimable work there was and took it with room
    # left (``claim`` sets it; False unless it knows): until something commits more work
    # (and wakes the dispatcher) or time passes (its next_wait), a round finds nothing.
    exhausted: bool = False

    def made_claimable(self, active: Active[C], end: E | None) -> bool:
        """Whether the work's end (``end``: what was recorded of it, None: nothing) may have
        made work claimable (itself, or work that waited on it). True unless the lane knows."""
        return True

    async def went_idle(self, active: Active[C], receive: trio.lowlevel.FdStream, buffer: LineBuffer) -> bool:
        """After the answer that ended its part: True when the worker said it waits for more
        work instead of ending (a warm worker, host/warm.py). No other lane keeps workers.
        It needs no deadline: the worker has the kill grace to end or say idle, and the
        supervisor stops it after that."""
        return False


# --- the dispatcher and the claim renewer ---------------------------------------------------


async def serve(lane: Lane[Any, Any], *, also: Sequence[Callable[[], Awaitable[None]]] = (),
                task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """The lane's dispatcher, with its claim renewer and the tasks in ``also`` beside it."""
    state, host = lane.state, lane.host
    async with trio.open_nursery() as nursery:
        nursery.start_soon(renew_claims, lane)
        nursery.start_soon(fence.serve_fence, host, state.active, lane.lease_ms, lane.kind)
        for task in also:
            nursery.start_soon(task)
        task_status.started()
        while True:
            state.wake_event = trio.Event()
            lane.exhausted = False  # until this round's claim says so
            await retry_unrecorded(lane)
            room = lane.room() if fence.lease_good(host) else 0  # a host past its lease's bound claims nothing
            began = trio.current_time()  # the claims' expiry is this transaction's now + the lease
            for active in await lane.claim(room) if room > 0 else []:
                lane.claimed()
                active.good_until = fence.good_until(began, lane.lease_ms)
                key = lane.key(active.claim)
                state.active[key] = active
                if (early := state.early_stops.pop(key, None)) is not None:
                    active.stop(early)  # stopped while its claim was committed and not yet here
                nursery.start_soon(supervise, lane, active)
            state.early_stops.clear()  # any left were for no claim of this round's
            with trio.move_on_after(await lane.next_wait()):
                await state.wake_event.wait()
                # Woken for new work while full (a run.start on a busy host): the end that frees
                # room wakes it again. The backstop deadline above still holds.
                while lane.room() <= 0 and not state.unrecorded:
                    lane.exhausted = False  # work is waiting for room: the end that frees some wakes it
                    state.wake_event = trio.Event()
                    await state.wake_event.wait()


async def renew_claims(lane: Lane[Any, Any]) -> None:
    """One renewer for all of a lane's work: every claim renewed in one transaction each
    tick, and at once when ``state.recheck`` is set (a client ended claimed work, on this
    host or another: ``HostState.claims_changed``, ``Wakeup.CLAIMS``). Work whose claim is
    lost has its scope cancelled; a failed renewal is retried at the next tick (two may
    fail in a row before the fence stops the work: ``fence.renew_period_s``). A host that
    does not listen (``--poll-only``) hears no ``Wakeup.CLAIMS``: it ticks at least every
    poll, so a cancel sent through another host reaches its worker within one."""
    state = lane.state
    config = lane.host.config
    period = lane.renew_period_s if config.store_listen else min(lane.renew_period_s, config.poll_s)
    next_tick = trio.current_time()
    while True:
        with trio.move_on_at(next_tick):
            await state.recheck.wait()
        state.recheck = trio.Event()  # set again during the renewal: one more at once
        if trio.current_time() >= next_tick:
            next_tick = trio.current_time() + period
        await _renew(lane)


async def _renew(lane: Lane[Any, Any]) -> None:
    active = list(lane.state.active.values())
    if not active:
        return
    began = trio.current_time()  # the renewed expiry is this transaction's now + the lease
    try:
        lost = await lane.renew([(lane.key(work.claim), work.claim.token) for work in active])
    except PiwfError as exc:
        log.warning("%s claim renewal failed (%s); will retry", lane.kind, exc)
        return
    for work in active:
        if lane.key(work.claim) not in lost:
            work.good_until = max(work.good_until, fence.good_until(began, lane.lease_ms))
    lane.host.fence_changed.set()
    # A worker whose own message ended its part released the claim.
    gone = [work for work in active
            if lane.key(work.claim) in lost and work.conclusion is None and work.stop_reason is None]
    if not gone:
        return
    reasons = await lane.lost_reasons([lane.key(work.claim) for work in gone])
    for work in gone:
        reason = reasons.get(lane.key(work.claim), StopReason.CLAIM_LOST)
        if reason is StopReason.CLAIM_LOST:
            log.warning("%s: claim lost; stopping its worker", work.label)
        else:  # a client's request, through another host: as expected as one through this one
            log.info("%s: %s through another host; stopping its worker", work.label, reason.value)
        work.stop(reason)


# --- one supervisor per claim -----------------------------------------------------------------


async def supervise(lane: Lane[C, Any], active: Active[C]) -> None:
    cancelled = False
    try:
        with active.scope:
            try:
                await _launch_contained(lane, active)
            except* trio.Cancelled:  # it goes on unwinding; its reason is the scope's
                cancelled = True
                raise
    finally:
        # Stopped with a reason by piwf (kept by the work's scope: trio hands a task the
        # reason of its innermost cancelled scope, which may be a nursery's), or by a
        # cancellation from outside: the host is stopping.
        stopped_by = active.stop_reason or (StopReason.HOST_STOPPING if cancelled else None)
        end = lane.end_of(active, stopped_by)
        await record_end(lane, end)
        lane.recorded(active)
        del lane.state.active[lane.key(active.claim)]
        lane.left(active)
        _freed(lane, active, end)


def _freed(lane: Lane[C, E], active: Active[C], end: E | None) -> None:
    """The work left: wake the dispatcher (its room, and maybe work, changed), unless its
    last round found all the work there was with room left and this end made none
    claimable, so a round now could find nothing (an empty claim transaction per warm run,
    whose next run.start comes after its end). The other hosts are told all the same."""
    state = lane.state
    if lane.exhausted and not lane.made_claimable(active, end) and lane.key(active.claim) not in state.unrecorded:
        if state.announce is not None:
            state.announce()
        return
    state.wake()


async def _launch_contained(lane: Lane[C, Any], active: Active[C]) -> None:
    """A failure supervising one piece of work ends it (as a crash); it never takes the
    host down."""
    try:
        envelope, project = await lane.envelope(active)
        await run_worker(lane.host, active, envelope, project, launch_var=lane.launch_var,
                         pump=functools.partial(pump, lane, active), attach=functools.partial(lane.attach, active))
    except* Exception as failed:  # a cancellation in the same group goes on unwinding
        log.error("%s: supervision failed", active.label, exc_info=failed)
        end = active.process_end or ProcessEnd(None, "")
        active.process_end = end.noted(f"supervision failed: {failed.exceptions[0]!r}")


# --- the message pump ---------------------------------------------------------------------


async def pump(lane: Lane[C, Any], active: Active[C], receive: trio.lowlevel.FdStream,
               send: trio.lowlevel.FdStream, bound: Bound) -> None:
    """Read the worker's messages, answer each once its commit is durable. The worker is
    stopped if it is not ready within the startup timeout; once ready, a read waits no
    longer than the work's own timeout, if it has one, nor than the time limit of the node
    it runs (a worker that cannot answer, SIGSTOPped say, is stopped all the same).
    After the answer that ended its part the pump reads nothing more (but a warm worker's
    ``worker.idle``), and the worker has the kill grace to end. The startup timeout and
    the kill grace bound the supervisor's wait for the worker's exit (``bound``), so the
    pump's reads need no deadline of their own then."""
    try:
        await _pump(lane, active, receive, send, bound)
    finally:
        if active.stop_reason is None and active.conclusion is None:
            # It can no longer be talked to (its pipe closed, an answer or a heartbeat could
            # not be sent): it has the kill grace to end, as after its last answer.
            bound(trio.current_time() + lane.host.config.kill_grace_s, functools.partial(_hung_up, active))


async def _pump(lane: Lane[C, Any], active: Active[C], receive: trio.lowlevel.FdStream,
                send: trio.lowlevel.FdStream, bound: Bound) -> None:
    host = lane.host
    buffer = LineBuffer(MAX_WORKER_LINE)
    startup_at = trio.current_time() + host.config.worker_startup_s
    not_ready = functools.partial(_not_ready, lane, active)
    bound(startup_at, not_ready)
    deadline: float | None = None  # once ready, the work's own timeout
    beat_at = trio.current_time() if host.fenced else None  # the first heartbeat at once
    while True:
        clock = active.node_clock
        chunk = await receive_before(receive, _earliest(deadline, None if clock is None else clock.deadline, beat_at))
        if chunk is None:
            now = trio.current_time()
            if clock is not None and now >= clock.deadline:
                _over_time_limit(active, clock)
            elif beat_at is not None and (deadline is None or now < deadline):  # not a timeout: a heartbeat
                if await _beat(send, host, active):
                    beat_at = now + fence.beat_period_s(host, lane.lease_ms)
                    continue
            else:
                _timed_out(lane, active)
            return
        if not chunk:
            return
        try:
            messages = [lane.parse(line) for line in buffer.feed(chunk)]
        except ProtocolError as exc:
            _broke_protocol(active, exc)
            return
        for message in messages:
            was_ready = active.ready.is_set()
            if not was_ready:  # the host's own handling of a ready in time is not the worker's to pay
                bound(math.inf, _unbounded)
            try:
                response = await lane.handle(active, message)
            except ProtocolError as exc:  # a message that is not its own pipe's claim
                _broke_protocol(active, exc)
                return
            if not active.ready.is_set():
                bound(startup_at, not_ready)  # the same deadline again (at once, if it has passed)
            await host.durable()  # group commit: no answer before its commit's fsync
            if not was_ready and active.ready.is_set():
                deadline = None if active.timeout_s is None else trio.current_time() + active.timeout_s
            try:
                await send_answer(send, encode_line(response))
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return
            lane.answered()
            if active.conclusion is not None:
                bound(trio.current_time() + host.config.kill_grace_s, functools.partial(_lingered, lane, active))
                await lane.went_idle(active, receive, buffer)
                return


async def _beat(send: trio.lowlevel.FdStream, host: HostState, active: Active[Any]) -> bool:
    """Tell the worker until when its claim is vouched for; False once it cannot be told."""
    until = fence.vouched_until(host, active)
    if until <= trio.current_time():
        return True  # the fence is stopping it
    try:
        await send.send_all(encode_line(HostHeartbeat(untilMs=fence.monotonic_ms(until))))
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        return False
    return True


def _earliest(*deadlines: float | None) -> float | None:
    return min((d for d in deadlines if d is not None), default=None)


def _over_time_limit(active: Active[Any], clock: NodeClock) -> None:
    note = f"node {clock.node} did not finish within {clock.limit_text}"
    log.warning("%s: %s; stopping its worker", active.label, note)
    active.stop(StopReason.NODE_TIME_LIMIT, note)


def _broke_protocol(active: Active[Any], exc: ProtocolError) -> None:
    """A crash: counted, backed off, and the work held after too many in a row."""
    log.warning("%s: worker broke the protocol (%s); stopping it", active.label, exc)
    active.stop(StopReason.PROTOCOL, f"broke the worker protocol: {exc}")


def _timed_out(lane: Lane[C, Any], active: Active[C]) -> None:
    note = f"{lane.kind} did not finish within its timeout of {active.timeout_s:g} s"
    log.warning("%s: worker %s; stopping it", active.label, note)
    active.stop(StopReason.RECONCILE_TIMEOUT, note)


def _not_ready(lane: Lane[C, Any], active: Active[C]) -> None:
    note = f"not ready after {lane.host.config.worker_startup_s:g} s (loading its {lane.loads} included)"
    log.warning("%s: worker %s; stopping it", active.label, note)
    active.stop(StopReason.STARTUP_TIMEOUT, note)


def _lingered(lane: Lane[C, Any], active: Active[C]) -> None:
    """A worker told its part is over did not end (nor say idle) within the kill grace:
    it is stopped (and counted as misbehaving, unless its claim was lost)."""
    assert active.conclusion is not None
    told = active.conclusion.value
    grace = lane.host.config.kill_grace_s
    log.warning("%s: worker did not end after being told %s; stopping it", active.label, told)
    lost = active.conclusion is Conclusion.CLAIM_LOST
    active.stop(StopReason.CLAIM_LOST if lost else StopReason.LINGERING,
                f"did not end within {grace:g} s of being told {told}")


def _hung_up(active: Active[Any]) -> None:
    log.warning("%s: worker stopped talking to the host without ending; stopping it", active.label)
    active.stop(StopReason.PROTOCOL, "closed or stopped reading its pipe to the host without ending")


def _unbounded() -> None:
    raise AssertionError("no bound: nothing expires")


# --- ends ---------------------------------------------------------------------------------


async def record_end(lane: Lane[Any, E], end: E | None) -> None:
    """Record a worker's end, shielded and bounded; one the store refused, or that the
    deadline cut short (the drain's), is kept and retried each dispatcher round. A retry
    is safe: the store records an end once, fenced by the worker and the claim."""
    if end is None:
        return
    written = False
    with cleanup_scope(lane.host, RECORD_S) as scope:  # shielded: cancellation cannot interrupt it
        written = await lane.write_end(end)
    if not written:
        if scope.cancelled_caught:
            log.error("%s: the end of its worker was not recorded in time; will retry", end.active.label)
        lane.state.unrecorded[lane.key(end.active.claim)] = end


async def retry_unrecorded(lane: Lane[Any, Any]) -> None:
    """Ends the store refused before (a full disk): try them again."""
    for key, end in list(lane.state.unrecorded.items()):
        if await lane.write_end(end):
            del lane.state.unrecorded[key]
            log.info("%s: recorded the end of its worker after an earlier failure", end.active.label)
