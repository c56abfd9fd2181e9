"""One worker process: spawned in its own process group, spoken to over its own pipes,
stopped with SIGTERM, a grace period, then SIGKILL of the whole group."""

from __future__ import annotations

import base64
import os
import signal
from collections import deque
from dataclasses import dataclass

import trio

from .. import faults, processes
from ..errors import PiwfError, ProtocolError
from ..store import workers
from ..wire import (
    LaunchEnvelope,
    LineBuffer,
    MAX_WORKER_LINE,
    WORKER_EXIT_CLAIM_LOST,
    WORKER_EXIT_OK,
    canonical_json,
    encode_line,
    parse_worker_message,
)
from .launcher import Launch, WorkerHandle
from .state import ActiveRun, HostState, log
from .worker_messages import handle

DIAGNOSTIC_BYTES = 64 * 1024


@dataclass
class WorkerExit:
    outcome: str  # exited, crashed, cancelled, claimLost, timedOut, orphaned
    exit_code: int | None
    signal: int | None
    diagnostic: str


class Diagnostics:
    """The last 64 KiB of a worker's stdout and stderr."""

    def __init__(self) -> None:
        self._chunks: deque[bytes] = deque()
        self._size = 0

    def add(self, data: bytes) -> None:
        self._chunks.append(data)
        self._size += len(data)
        while self._size - len(self._chunks[0]) >= DIAGNOSTIC_BYTES:
            self._size -= len(self._chunks.popleft())

    def text(self) -> str:
        return b"".join(self._chunks)[-DIAGNOSTIC_BYTES:].decode(errors="replace")


async def run_worker(host: HostState, active: ActiveRun, envelope: LaunchEnvelope, project: str) -> WorkerExit:
    """Run the worker to its exit; on cancellation stop it, and always reap its group."""
    to_worker_r, to_worker_w = os.pipe2(os.O_CLOEXEC)
    from_worker_r, from_worker_w = os.pipe2(os.O_CLOEXEC)
    env = {**os.environ, **host.config.worker_env,
           "PIWF_WORKER_LAUNCH": base64.urlsafe_b64encode(canonical_json(envelope)).decode().rstrip("=")}
    diagnostics = Diagnostics()
    try:
        proc = await host.launcher.start(Launch(project, env, to_worker_r, from_worker_w))
    except OSError as exc:
        for fd in (to_worker_r, to_worker_w, from_worker_r, from_worker_w):
            os.close(fd)
        return WorkerExit("crashed", None, None, f"cannot start worker: {exc}")
    os.close(to_worker_r)
    os.close(from_worker_w)
    send = trio.lowlevel.FdStream(to_worker_w)
    receive = trio.lowlevel.FdStream(from_worker_r)
    try:
        workers.attach_process(host.db, envelope.workerEpoch, proc.pid, processes.identity(proc.pid) or "")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_drain, proc.stdout, diagnostics)
            nursery.start_soon(_pump, host, active, receive, send, proc)
            await proc.wait()
            nursery.cancel_scope.cancel()
    finally:  # cancelled, failed or done: the worker's whole group goes, and is reaped
        with trio.CancelScope(shield=True):
            await _stop(proc, host.config.kill_grace_s)
            reap_registered(host, workers.live_processes(host.db, [envelope.workerEpoch]))
            for stream in (send, receive, proc.stdout):
                await stream.aclose()
    return _exit(proc, diagnostics)


def reap_registered(host: HostState, rows: list[tuple[str, int, str]]) -> None:
    """Kill the process groups a worker registered (its shell nodes) and forget them."""
    for worker_epoch, pid, identity in rows:
        if processes.kill_recorded_group(pid, identity):
            log.info("killed process group %d left by worker %s", pid, worker_epoch)
    if rows:
        try:
            workers.mark_processes_gone(host.db, rows, host.now())
        except PiwfError as exc:  # they are dead; the next host retries the bookkeeping
            log.warning("could not record reaped processes: %s", exc)


def _exit(proc: WorkerHandle, diagnostics: Diagnostics) -> WorkerExit:
    code = proc.returncode
    if code is not None and code < 0:
        return WorkerExit("crashed", None, -code, diagnostics.text())
    outcome = {WORKER_EXIT_OK: "exited", WORKER_EXIT_CLAIM_LOST: "claimLost"}.get(code, "crashed")
    return WorkerExit(outcome, code, None, diagnostics.text())


async def _stop(proc: WorkerHandle, grace_s: float) -> None:
    """SIGTERM the group, wait out the grace, SIGKILL the group; then reap."""
    if proc.returncode is None:
        processes.signal_group(proc.pid, signal.SIGTERM)
        with trio.move_on_after(grace_s):
            await proc.wait()
    # Whatever the worker left in its group (shell children, their children) dies with it.
    processes.signal_group(proc.pid, signal.SIGKILL)
    await proc.wait()


async def _drain(stream: trio.abc.ReceiveStream | None, diagnostics: Diagnostics) -> None:
    if stream is None:
        return
    while chunk := await stream.receive_some(65536):
        diagnostics.add(chunk)


async def _receive(stream: trio.lowlevel.FdStream, deadline: float | None) -> bytes | None:
    """The next chunk (b"" at the end), or None if the deadline passed first."""
    if deadline is None:
        return await stream.receive_some(65536)
    with trio.move_on_at(deadline):
        return await stream.receive_some(65536)
    return None


async def _pump(host: HostState, active: ActiveRun, receive: trio.lowlevel.FdStream,
                send: trio.lowlevel.FdStream, proc: WorkerHandle) -> None:
    buffer = LineBuffer(MAX_WORKER_LINE)
    startup_deadline = trio.current_time() + host.config.worker_startup_s
    while True:
        # Until the worker reports ready, a read waits no longer than the startup timeout.
        chunk = await _receive(receive, None if active.ready.is_set() else startup_deadline)
        if chunk is None:
            log.warning("run %s: worker not ready after %s s; stopping it", active.run_id,
                        host.config.worker_startup_s)
            active.stop_reason = active.stop_reason or "timedOut"
            processes.signal_group(proc.pid, signal.SIGKILL)
            return
        if not chunk:
            return
        try:
            messages = [parse_worker_message(line) for line in buffer.feed(chunk)]
        except ProtocolError as exc:
            log.warning("run %s: worker broke the protocol (%s); stopping it", active.run_id, exc)
            processes.signal_group(proc.pid, signal.SIGKILL)
            return
        for message in messages:
            response = handle(host, active, message)
            try:
                await send.send_all(encode_line(response))
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return
            faults.point("host.worker.answered")
