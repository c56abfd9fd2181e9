"""One worker process: started in its own process group, spoken to over its own pipes,
stopped with SIGTERM, a grace period, then SIGKILL of the whole group.

However the supervision ends (the worker exited, the run was cancelled, the claim lost,
the host stopping), the cleanup is the same and runs shielded under a deadline: stop the
group while its leader is unreaped, reap it, kill the groups it registered, and record
how the process ended in ``active.process_end``.
"""

from __future__ import annotations

import base64
import errno
import os
import signal
import weakref
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import trio
import trio_util

from piwf import processes
from piwf.errors import PiwfError
from piwf.wire import canonical_json
from piwf.host.launcher import Launch, LauncherUnavailable, WorkerHandle, stop_worker
from piwf.host.warm import WarmTicket, WarmWorker, drain_output, kept_note
from piwf.host.state import Active, HostState, ProcessEnd, log

DIAGNOSTIC_BYTES = 64 * 1024
REAP_S = 5.0  # after SIGKILL, how long reaping may take before the cleanup gives up
OUTPUT_TAIL_S = 0.5  # after the stop, how long to read what the worker printed last


class Diagnostics:
    """The last 64 KiB of a worker's stdout and stderr, and how much it printed in all (a
    ``run.output`` reader asks for what came after an offset, and waits on ``changed``)."""

    def __init__(self) -> None:
        self._chunks: deque[bytes | bytearray] = deque()
        self._size = 0
        self.total = 0  # bytes printed since the worker started
        self.complete = False  # the output reached its end: nothing more to read
        self.closed = False  # the host reads no more of it (the worker is gone)
        self.changed = trio_util.RepeatedEvent()

    def add(self, data: bytes | bytearray) -> None:
        self._chunks.append(data)
        self._size += len(data)
        self.total += len(data)
        while self._size - len(self._chunks[0]) >= DIAGNOSTIC_BYTES:
            self._size -= len(self._chunks.popleft())
        self.changed.set()

    def close(self) -> None:
        self.closed = True
        self.changed.set()

    def since(self, offset: int) -> tuple[int, bytes]:
        """Where the kept output after ``offset`` starts, and those bytes (at most 64 KiB)."""
        kept = b"".join(self._chunks)[-DIAGNOSTIC_BYTES:]
        start = max(offset, self.total - len(kept))
        return start, kept[len(kept) - (self.total - start):] if start < self.total else b""

    def text(self) -> str:
        return b"".join(self._chunks)[-DIAGNOSTIC_BYTES:].decode(errors="replace")


class Outputs:
    """The output of the workers this process runs, and of at least the last ``KEPT`` that
    ended, by worker id: what ``run.output`` reads (a follower reads a worker's last lines after it
    has exited). Worker ids are random, so the hosts of one process (tests) share it."""

    KEPT = 64

    def __init__(self) -> None:
        self._by_worker: OrderedDict[str, tuple[str | None, Diagnostics]] = OrderedDict()
        self.added = trio_util.RepeatedEvent()  # a worker's output began to be read

    def add(self, worker_id: str, run_id: str | None, diagnostics: Diagnostics) -> None:
        self._by_worker[worker_id] = (run_id, diagnostics)
        self.added.set()
        if len(self._by_worker) > 2 * self.KEPT:  # now and then, not a scan per worker
            ended = [w for w, (_, d) in self._by_worker.items() if d.closed]
            for worker in ended[:max(0, len(ended) - self.KEPT)]:
                del self._by_worker[worker]

    def get(self, worker_id: str, run_id: str) -> Diagnostics | None:
        """The output of worker ``worker_id`` of run ``run_id`` (None: not kept, or another run's)."""
        owner, diagnostics = self._by_worker.get(worker_id, (None, None))
        return diagnostics if owner == run_id else None


OUTPUTS = Outputs()


class Pipes:
    """The two protocol pipes of one worker, each descriptor closed exactly once whatever
    happens: the child's ends once it has them, the host's when their streams close."""

    def __init__(self) -> None:
        self.to_worker_r, self.to_worker_w = os.pipe2(os.O_CLOEXEC)
        self.from_worker_r, self.from_worker_w = os.pipe2(os.O_CLOEXEC)
        self._open = {self.to_worker_r, self.to_worker_w, self.from_worker_r, self.from_worker_w}

    def __enter__(self) -> Pipes:
        return self

    def __exit__(self, *exc: object) -> None:
        for fd in self._open:
            os.close(fd)
        self._open.clear()

    def close_child_ends(self) -> None:
        for fd in (self.to_worker_r, self.from_worker_w):
            self._open.discard(fd)
            os.close(fd)

    def streams(self) -> tuple[trio.lowlevel.FdStream, trio.lowlevel.FdStream]:
        """(send, receive): the streams own the host's ends from here on."""
        self._open.difference_update({self.to_worker_w, self.from_worker_r})
        return trio.lowlevel.FdStream(self.to_worker_w), trio.lowlevel.FdStream(self.from_worker_r)


_BASE_ENV: weakref.WeakKeyDictionary[HostState, dict[str, str]] = weakref.WeakKeyDictionary()


def _base_env(host: HostState) -> dict[str, str]:
    """The host's environment with the configured worker variables, built once per host
    (reading ``os.environ`` decodes every variable: 17 µs a run)."""
    env = _BASE_ENV.get(host)
    if env is None:
        env = _BASE_ENV[host] = {**os.environ, **host.config.worker_env}
    return env


def cleanup_scope(host: HostState, budget_s: float) -> trio.CancelScope:
    """A shielded scope for cleanup that must run even when cancelled, with a deadline:
    ``budget_s`` from now, and never past the host's drain deadline."""
    return trio.CancelScope(shield=True, deadline=min(trio.current_time() + budget_s, host.drain_deadline))


# bound(when, expire): unless it has exited (or said idle) by ``when`` (math.inf: never), the worker is
# stopped by ``expire()``; the pump's (its startup timeout, the kill grace once told its part is over)
Bound = Callable[[float, Callable[[], None]], None]
Pump = Callable[[trio.lowlevel.FdStream, trio.lowlevel.FdStream, Bound], Awaitable[None]]  # (receive, send, bound)
Attach = Callable[[int, str], Awaitable[None]]  # record the started worker's pid and start identity


async def run_worker(host: HostState, active: Active[Any], envelope: msgspec.Struct, project: str, *,
                     launch_var: str, pump: Pump, attach: Attach) -> None:
    """Run the worker to its exit (or, a warm one, until it says idle); on cancellation
    stop it. ``active.process_end`` says how the process ended, whichever way this
    returns. The worker's lane (host/lane.py) gives its launch variable, its message pump
    and how its pid is recorded."""
    ticket: WarmTicket | None = active.warm
    warm_worker = host.warm.take(ticket) if ticket is not None else None
    if warm_worker is not None and await host.warm.hand_over(warm_worker, envelope):
        await _supervise_process(host, active, warm_worker.proc, warm_worker.send, warm_worker.receive, pump, attach)
        return
    if ticket is not None:
        ticket.before = 0  # a fresh process (the idle one, if any, died before it took the run)
    env = {**_base_env(host),
           launch_var: base64.urlsafe_b64encode(canonical_json(envelope)).decode().rstrip("=")}
    with Pipes() as pipes:
        try:
            proc = await host.launcher.start(Launch(project, env, pipes.to_worker_r, pipes.from_worker_w))
        except LauncherUnavailable as exc:  # not the run's fault: it waits and is claimed again
            active.process_end = ProcessEnd(None, f"cannot start worker: {exc}", started=False)
            return
        except OSError as exc:  # this run's start failed (its project is gone): a crash
            active.process_end = ProcessEnd(None, f"cannot start worker: {exc}")
            return
        pipes.close_child_ends()
        send, receive = pipes.streams()
    await _supervise_process(host, active, proc, send, receive, pump, attach)


async def _supervise_process(host: HostState, active: Active[Any], proc: WorkerHandle,
                             send: trio.lowlevel.FdStream, receive: trio.lowlevel.FdStream, pump: Pump,
                             attach: Attach) -> None:
    diagnostics = Diagnostics()
    # run.output reads it while the worker runs, and just after (a run's: a reconcile has no run id)
    OUTPUTS.add(active.worker_id, getattr(active.claim, "run_id", None), diagnostics)
    ticket: WarmTicket | None = active.warm
    exited = kept = False
    active.output = diagnostics
    try:
        active.pid = proc.pid
        active.kill = lambda: proc.signal_group(signal.SIGKILL)  # the fence's (host/fence.py): until it is reaped
        await attach(proc.pid, proc.identity or "")
        expire: list[Callable[[], None]] = []
        async with trio.open_nursery() as nursery:
            # The nursery's scope is the wait for the worker's exit: a warm worker's
            # worker.idle ends it too, and so does the pump's ``bound`` passing.
            waiting = nursery.cancel_scope
            if ticket is not None:
                ticket.waiting = waiting

            def bound(when: float, expired: Callable[[], None]) -> None:
                if not waiting.cancel_called:  # once passed (or ended by idle), it stays as it was
                    waiting.deadline = when
                    expire[:] = [expired]

            nursery.start_soon(_read_output, proc.stdout, diagnostics)
            nursery.start_soon(pump, receive, send, bound)
            await proc.wait_exited()
            exited = True
            if nursery.child_tasks:  # the pump has usually returned, and the output reached its end
                waiting.cancel()
        idle = not exited and ticket is not None and ticket.idle
        if not (exited or idle):  # the pump's bound passed
            exited = proc.has_exited()
            if not exited:
                expire[0]()
        kept = idle and active.stop_reason is None
    finally:  # cancelled, failed or done: the worker's whole group goes, and is reaped
        if kept:
            assert ticket is not None
            await _keep_warm(host, active, ticket, WarmWorker(proc, send, receive, ticket.key, ticket.runs),
                             diagnostics)
        else:
            await _end_process(host, active, proc, (send, receive, proc.stdout), diagnostics, exited)


async def _keep_warm(host: HostState, active: Active[Any], ticket: WarmTicket, worker: WarmWorker,
                     diagnostics: Diagnostics) -> None:
    """A warm worker said idle: what the run registered goes, then the process waits in the
    pool for another run (or is stopped, when the pool cannot keep it)."""
    active.kill = None
    if tail := drain_output(worker.proc.stdout):
        diagnostics.add(tail)
    diagnostics.complete = True
    diagnostics.close()
    active.process_end = ProcessEnd(None, diagnostics.text()).noted(kept_note(ticket.runs))
    if active.registered:  # only a worker's own register message records a group of it
        with cleanup_scope(host, REAP_S):
            await _reap_groups_of(host, active.worker_id)
    if not host.warm.keep(worker):
        await host.warm.stop(worker)


async def _end_process(host: HostState, active: Active[Any], proc: WorkerHandle,
                       streams: tuple[trio.abc.AsyncResource | None, ...], diagnostics: Diagnostics,
                       exited: bool) -> None:
    """Stop the worker's group (unless it has exited), reap it, read what it printed last,
    record how it ended, kill the groups it registered and close its streams."""
    returncode = None
    active.kill = None  # reaped from here on: its pid may name another process
    grace = 0 if active.unrenewed else host.config.kill_grace_s  # past the fence there is no time for one
    with cleanup_scope(host, host.config.kill_grace_s + REAP_S) as cleanup:
        returncode = await stop_worker(proc, grace, exited)
        if not diagnostics.complete:  # what it printed last, before it was stopped
            with trio.move_on_after(OUTPUT_TAIL_S):
                await _read_output(proc.stdout, diagnostics, pace_s=0)
    diagnostics.close()
    end = ProcessEnd(returncode, diagnostics.text())
    if cleanup.cancelled_caught and returncode is None:
        log.warning("%s: worker pid %d not reaped before the cleanup deadline", active.label, proc.pid)
        end = end.noted("the worker was not reaped before the cleanup deadline; its exit status is unknown")
    elif returncode is None:
        end = end.noted("the fork server that started the worker died first; its exit status is unknown")
    active.process_end = end
    try:
        if active.registered:  # only a worker's own register message records a group of it
            with cleanup_scope(host, REAP_S):
                await _reap_groups_of(host, active.worker_id)
    finally:
        await _close_streams(host, streams)


async def _close_streams(host: HostState, streams: tuple[trio.abc.AsyncResource | None, ...]) -> None:
    """Close the worker's pipes: at once (a pipe's close does not wait), any other stream
    under a shielded deadline."""
    others = []
    for stream in streams:
        if isinstance(stream, trio.lowlevel.FdStream):
            stream.close()
        elif stream is not None:
            others.append(stream)
    if others:
        with cleanup_scope(host, 1):
            for stream in others:
                await stream.aclose()


async def _reap_groups_of(host: HostState, worker_id: str) -> None:
    """Kill the process groups the worker registered; a store that cannot say which
    leaves them to the next host's takeover (they are recorded live), and says so."""
    try:
        rows = await host.store.workers.live_processes([worker_id])
    except PiwfError as exc:
        log.warning("could not read the process groups worker %s registered: %s", worker_id, exc)
        return
    await reap_registered(host, rows)


async def reap_registered(host: HostState, rows: list[tuple[str, int, str]]) -> None:
    """Kill the process groups a worker registered (its shell nodes) and forget them."""
    for worker_id, pid, identity in rows:
        if processes.kill_recorded_group(pid, identity):
            log.info("killed process group %d left by worker %s", pid, worker_id)
    if rows:
        try:
            await host.store.workers.mark_processes_gone(rows, host.now())
        except PiwfError as exc:  # they are dead; the next host retries the bookkeeping
            log.warning("could not record reaped processes: %s", exc)


OUTPUT_READ = 65536  # bytes of a worker's stdout/stderr per read
OUTPUT_PACE_S = 0.01  # at least this long between two reads of one worker's output


async def _read_output(stream: trio.abc.ReceiveStream | None, diagnostics: Diagnostics,
                       pace_s: float = OUTPUT_PACE_S) -> None:
    """Keep the tail of what the worker prints. Reads are paced (at most one per
    ``pace_s``, 64 KiB each): a node printing as fast as it can waits on its full pipe
    instead of spinning the host, which wakes for it at most 100 times a second."""
    if stream is None:
        return
    try:
        while chunk := await stream.receive_some(OUTPUT_READ):
            diagnostics.add(chunk)
            if pace_s:
                await trio.sleep(pace_s)
    except (trio.ClosedResourceError, trio.BrokenResourceError):
        return
    diagnostics.complete = True


async def send_answer(stream: trio.lowlevel.FdStream, data: bytes) -> None:
    """Send ``data`` on the worker's pipe. What the pipe takes at once (an answer nearly
    always is: the worker waits for it) is written without trio's schedule point before
    it, since the pump's next read is one; the rest is sent as ``send_all`` sends it."""
    try:
        sent = os.write(stream.fileno(), data)
    except BlockingIOError:
        sent = 0
    except OSError as exc:
        if exc.errno == errno.EBADF:
            raise trio.ClosedResourceError("the worker's pipe was closed") from None
        raise trio.BrokenResourceError(f"the worker's pipe broke: {exc}") from exc
    if sent < len(data):
        await stream.send_all(data[sent:])


async def receive_before(stream: trio.lowlevel.FdStream, deadline: float | None) -> bytes | None:
    """The next chunk (b"" at the end), or None if the deadline passed first."""
    if deadline is None:
        return await stream.receive_some(65536)
    with trio.move_on_at(deadline):
        return await stream.receive_some(65536)
    return None
