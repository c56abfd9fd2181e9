"""Warm workers: idle worker processes kept between runs of a workflow that declares
``reuse_worker`` (docs/concepts.md, "Warm workers").

A run's supervision is unchanged (host/worker_process.py): what differs is where its
process comes from and where it goes. A worker whose part of a run ended with an answer
(the run done, or paused at a boundary) and that says ``worker.idle`` within the kill
grace is not stopped: once the run's registered process groups are killed and its end
recorded, the process waits here, keyed by

    (project, workflow, digest)   the digest its own ``worker.ready`` reported

(the environment is the host's, one per host). A run claimed later whose stored source
matches takes it and is handed over with ``run.next``; anything else starts a fresh one.
Any other end (a crash, a stop, a hang, a lost claim, the host stopping) stops the
process as it stops a fresh worker's: only runs that ended cleanly share a process.

An idle worker is stopped once it has waited ``IDLE_S``, when it exits or dies on its
own, when the pool is full (the oldest idle one goes) and when the host stops.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import trio

from piwf.errors import ProtocolError
from piwf.protocol.worker import LaunchEnvelope, NextRun, Ready, parse_worker_idle
from piwf.wire import LineBuffer, encode_line
from piwf.host.launcher import WorkerHandle, stop_worker

IDLE_S = 60.0  # an idle warm worker waits this long for another run, then is stopped
SWEEP_S = 1.0  # how often the idle workers are looked at
REAP_S = 5.0

WarmKey = tuple[str, str, str]  # project, workflow, digest


@dataclass(eq=False)
class WarmTicket:
    """One run's view of warm workers: what its worker may be reused for, and whether it
    said idle (``Active.warm``; set by the run lane for every run)."""

    project: str
    workflow: str
    digest: str  # the run's stored digest: a warm worker must have loaded exactly this
    reusable: bool = False  # the worker's ready said its workflow reuses workers, and loaded the run's digest
    idle: bool = False  # it said worker.idle after its part ended
    waiting: trio.CancelScope | None = None  # the supervisor's wait for the worker's exit: idle ends it too
    runs: int = 0  # how many runs its process has executed (from worker.idle)
    before: int = 0  # how many its process had executed before this run (a warm worker's, handed over)

    @property
    def key(self) -> WarmKey:
        return (self.project, self.workflow, self.digest)

    @property
    def kept_note(self) -> str:
        """The note of its worker's record once it says idle after this run, as expected
        before it does (its end is recorded ahead: host/worker_messages.py)."""
        return kept_note(self.before + 1)

    def ready(self, message: Ready) -> None:
        loaded = message.payload
        self.reusable = loaded.reuse and loaded.loadError is None and loaded.digest == self.digest


def kept_note(runs: int) -> str:
    """The note a kept-warm worker's record ends with, after ``runs`` runs of its process."""
    return f"kept warm for another run after {runs} run(s) (reuse_worker)"


@dataclass(eq=False)
class WarmWorker:
    proc: WorkerHandle
    send: trio.lowlevel.FdStream
    receive: trio.lowlevel.FdStream
    key: WarmKey
    runs: int = 0  # how many runs its process has executed (its last worker.idle's)
    since: float = field(default_factory=trio.current_time)  # idle since (trio time)


async def hear_idle(ticket: WarmTicket | None, worker_id: str, receive: trio.lowlevel.FdStream,
                    buffer: LineBuffer) -> bool:
    """After the answer that ended a worker's part: True once it said ``worker.idle`` for
    this run; False when it ends instead, or says something else. No deadline of its own:
    the supervisor's wait for the worker's exit is bounded by the kill grace from that
    answer on, and stops a worker that neither ends nor says idle by then (its scope's
    cancellation ends this read)."""
    if ticket is None or not ticket.reusable:
        return False
    lines: list[bytes] = []
    while not lines:
        chunk = await receive.receive_some(65536)
        if not chunk:
            return False
        lines = buffer.feed(chunk)
    try:
        idle = parse_worker_idle(lines[0])
    except ProtocolError:
        return False
    if idle.workerEpoch != worker_id or len(lines) > 1:
        return False
    ticket.runs, ticket.idle = idle.runs, True
    if ticket.waiting is not None:
        ticket.waiting.cancel()
    return True


def drain_output(stream: trio.abc.ReceiveStream | None) -> bytes:
    """What a warm worker printed that is still in its output pipe (it flushed before it
    said idle), read without waiting: the pipe stays open for its next run."""
    if not isinstance(stream, trio.lowlevel.FdStream):
        return b""
    chunks = []
    with contextlib.suppress(BlockingIOError, OSError):
        while chunk := os.read(stream.fileno(), 65536):
            chunks.append(chunk)
    return b"".join(chunks)


class WarmPool:
    """The host's idle warm workers, oldest first, at most ``room()`` of them. One task
    looks at them every ``SWEEP_S``: the ones that ended on their own or have waited
    ``IDLE_S`` are stopped (a run never waits for this: a worker that died meanwhile is
    refused at its hand-over, and the run starts a fresh one)."""

    def __init__(self) -> None:
        self._idle: OrderedDict[WarmWorker, None] = OrderedDict()
        self._nursery: trio.Nursery | None = None
        self._grace_s = 2.0
        self._deadline: Callable[[], float] = lambda: math.inf
        self.room: Callable[[], int] = lambda: 0

    def __len__(self) -> int:
        return len(self._idle)

    async def serve(self, room: Callable[[], int], grace_s: float, deadline: Callable[[], float]) -> None:
        """Watch the idle workers for the run lane's life; stop them all when it ends."""
        self.room, self._grace_s, self._deadline = room, grace_s, deadline
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                while True:
                    await trio.sleep(SWEEP_S)
                    self._sweep(trio.current_time())
        finally:
            self._nursery = None
            idle, self._idle = list(self._idle), OrderedDict()
            with trio.CancelScope(shield=True, deadline=min(trio.current_time() + grace_s + REAP_S, deadline())):
                async with trio.open_nursery() as stopping:
                    for worker in idle:
                        stopping.start_soon(self.stop, worker)

    def _sweep(self, now: float) -> None:
        for worker in [w for w in self._idle if w.proc.has_exited() or now - w.since >= IDLE_S]:
            self._drop(worker)

    def _drop(self, worker: WarmWorker) -> None:
        del self._idle[worker]
        assert self._nursery is not None
        self._nursery.start_soon(self.stop, worker)

    def take(self, ticket: WarmTicket) -> WarmWorker | None:
        """The oldest idle worker for the ticket's key, out of the pool (the ticket learns
        how many runs its process has executed)."""
        for worker in self._idle:
            if worker.key == ticket.key:
                del self._idle[worker]
                ticket.before = worker.runs
                return worker
        return None

    def keep(self, worker: WarmWorker) -> bool:
        """Keep an idle worker; False when the pool is not serving (the caller stops it)."""
        if self._nursery is None or self.room() <= 0:
            return False
        while len(self._idle) >= self.room():  # full: the oldest goes
            self._drop(next(iter(self._idle)))
        self._idle[worker] = None
        return True

    async def hand_over(self, worker: WarmWorker, envelope: Any) -> bool:
        """Give a taken warm worker its next run; False when it has gone (it is stopped,
        and the run starts a fresh worker)."""
        assert isinstance(envelope, LaunchEnvelope)
        try:
            if worker.proc.has_exited():
                raise trio.BrokenResourceError("the warm worker has exited")
            await worker.send.send_all(encode_line(NextRun(launch=envelope)))
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            await self.stop(worker)
            return False
        return True

    async def stop(self, worker: WarmWorker) -> None:
        """Stop a worker that is not (or no longer) idle here, shielded, within the grace."""
        with trio.CancelScope(shield=True,
                              deadline=min(trio.current_time() + self._grace_s + REAP_S, self._deadline())):
            await stop_worker(worker.proc, self._grace_s, exited=False)
            for stream in (worker.send, worker.receive, worker.proc.stdout):
                if stream is not None:
                    await stream.aclose()
