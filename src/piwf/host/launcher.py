"""Starting worker processes: forked from a preloaded template, or spawned.

Both give the supervisor the same handle: ``pid`` (leader of the worker's own process
group), ``stdout`` (the worker's output, stdout and stderr together), and three steps
that keep a signal from ever reaching a recycled pid:

    wait_exited()   the leader has exited; it is not reaped yet, so its pid (and the
                    process group it names) cannot be handed to another process
    signal_group()  signals the group only while the leader is known unreaped
    reap()          releases the pid; returns the exit status (negative for a signal,
                    as in subprocess), or None when it cannot be known
"""

from __future__ import annotations

import array
import contextlib
import json
import logging
import math
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import trio
import trio_util

from .. import processes

log = logging.getLogger("piwf.host")

TEMPLATE_READY_S = 10.0
CLOSE_S = 10.0


@dataclass
class Launch:
    cwd: str
    env: dict[str, str]
    to_worker_r: int
    from_worker_w: int


class WorkerHandle(Protocol):
    pid: int
    stdout: trio.abc.ReceiveStream | None

    def signal_group(self, sig: int) -> bool: ...
    async def wait_exited(self) -> None: ...  # one waiting task at a time
    async def reap(self) -> int | None: ...


class Launcher(Protocol):
    async def start(self, launch: Launch) -> WorkerHandle: ...


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (OSError, AttributeError):
        return None


def _close_fd(fd: int | None) -> None:
    if fd is not None:
        with contextlib.suppress(OSError):
            trio.lowlevel.notify_closing(fd)
            os.close(fd)


@dataclass(eq=False)
class SpawnedWorker:
    """A child of the host itself. trio reaps it only in ``Process.wait()`` (reading
    ``Process.returncode`` would reap it too, so it is never read before ``reap``)."""

    process: trio.Process
    pidfd: int | None
    reaped: bool = False

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def stdout(self) -> trio.abc.ReceiveStream | None:
        return self.process.stdout

    def signal_group(self, sig: int) -> bool:
        return not self.reaped and processes.signal_group(self.pid, sig)

    async def wait_exited(self) -> None:
        if self.pidfd is None or self.reaped:
            await self.reap()
            return
        await trio.lowlevel.wait_readable(self.pidfd)

    async def reap(self) -> int | None:
        code = await self.process.wait()
        self.reaped = True
        _close_fd(self.pidfd)
        self.pidfd = None
        return code


class SpawnLauncher:
    """``python -m piwf.worker`` as a new process: the fallback, and where fork is missing."""

    async def start(self, launch: Launch) -> WorkerHandle:
        env = {**launch.env, "PIWF_WORKER_FDS": f"{launch.to_worker_r},{launch.from_worker_w}"}
        process = await trio.lowlevel.open_process(
            [sys.executable, "-m", "piwf.worker"], cwd=launch.cwd, env=env, start_new_session=True,
            pass_fds=(launch.to_worker_r, launch.from_worker_w), stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )
        return SpawnedWorker(process, _pidfd(process.pid))


@dataclass(eq=False)
class ForkedWorker:
    """A child of the template. The template reports its exit without reaping it and
    reaps it only when told (``release``): until then its pid stays taken."""

    pid: int
    stdout: trio.abc.ReceiveStream | None
    pidfd: int | None
    release: Callable[[int], Awaitable[None]]  # tells the template to reap this pid
    returncode: int | None = None
    released: bool = False
    exited: trio.Event = field(default_factory=trio.Event)
    reporter_gone: trio.Event = field(default_factory=trio.Event)  # the template died

    def report(self, returncode: int) -> None:
        self.returncode = returncode
        self.exited.set()

    def signal_group(self, sig: int) -> bool:
        if self.released:
            return False
        if not self.reporter_gone.is_set():  # held unreaped by the template until released
            return processes.signal_group(self.pid, sig)
        # The template is gone: init may reap the worker at any moment. Its pidfd names
        # exactly this process (not its group); the group's other members were started
        # after it, which is what identity-checked reaping kills.
        if self.pidfd is None:
            return False
        with contextlib.suppress(OSError):
            signal.pidfd_send_signal(self.pidfd, sig)
            return True
        return False

    async def wait_exited(self) -> None:
        if self.exited.is_set():
            return
        if self.pidfd is not None:
            await trio.lowlevel.wait_readable(self.pidfd)
        else:
            await trio_util.wait_any(self.exited.wait, self.reporter_gone.wait)

    async def reap(self) -> int | None:
        """The exit status as the template reported it; None when the template died first
        (init reaps the worker then, and its status is unknown)."""
        if not self.released:
            await trio_util.wait_any(self.exited.wait, self.reporter_gone.wait)
            if self.exited.is_set() and not self.reporter_gone.is_set():
                await self.release(self.pid)
            elif self.pidfd is not None:
                await trio.lowlevel.wait_readable(self.pidfd)
            self.released = True
            _close_fd(self.pidfd)
            self.pidfd = None
        return self.returncode


def fork_available() -> bool:
    return sys.platform == "linux" and hasattr(os, "fork") and hasattr(os, "pidfd_open")


class ForkLauncher:
    """Forks workers from a template process that has piwf's worker modules imported."""

    def __init__(self, drain_deadline: Callable[[], float] = lambda: math.inf) -> None:
        self._drain_deadline = drain_deadline  # closing the template ends by then, too
        self._sock: trio.socket.SocketType | None = None
        self._process: trio.Process | None = None
        self._ready = trio.Event()
        self._failed: str | None = None
        self._next_id = 0
        self._pending: dict[int, tuple[trio.Event, list[Any]]] = {}
        self._workers: dict[int, ForkedWorker] = {}
        self._fallback = SpawnLauncher()

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the template for the host's life; on failure, fall back to spawning."""
        host_end, template_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._process = await trio.lowlevel.open_process(
                [sys.executable, "-m", "piwf.worker.forkserver"], start_new_session=True,
                pass_fds=(template_end.fileno(),), stdin=subprocess.DEVNULL,
                env={**os.environ, "PIWF_FORKSERVER_FD": str(template_end.fileno())},
            )
        except OSError as exc:
            self._fail(f"cannot start the fork server: {exc}")
            task_status.started()
            return
        finally:
            template_end.close()
        self._sock = trio.socket.from_stdlib_socket(host_end)
        task_status.started()
        try:
            await self._read_replies()
        finally:
            deadline = min(trio.current_time() + CLOSE_S, self._drain_deadline())
            with trio.CancelScope(shield=True, deadline=deadline):
                await self._close()
            await self._kill_template()

    async def _close(self) -> None:
        """Keep reading exit reports while workers are still being stopped (their
        supervisors wait for them), then close the template; all within CLOSE_S."""
        assert self._sock is not None
        with trio.move_on_after(CLOSE_S / 2):
            while self._workers and not self._failed:
                message = await self._receive()
                if not message:
                    break
                await self._dispatch(message)
        if self._workers:
            log.warning("closing the fork server with %d worker(s) unreported", len(self._workers))
        self._sock.close()
        if self._process is not None:
            await self._process.wait()  # it exits when its socket closes

    async def _kill_template(self) -> None:
        """A template that did not exit in time (stopped, stuck) is killed and reaped."""
        if self._sock is not None:
            self._sock.close()
        if self._process is not None and self._process.returncode is None:
            self._process.kill()
            with trio.CancelScope(shield=True, deadline=trio.current_time() + CLOSE_S):
                await self._process.wait()

    async def _read_replies(self) -> None:
        assert self._sock is not None
        with trio.move_on_after(TEMPLATE_READY_S) as waiting:
            message = await self._receive()
            if message.get("ready"):
                self._ready.set()
        if waiting.cancelled_caught or not self._ready.is_set():
            self._fail("the fork server did not start")
            return
        while message := await self._receive():
            await self._dispatch(message)
        self._fail("the fork server exited")

    async def _receive(self) -> dict[str, Any]:
        assert self._sock is not None
        try:
            data = await self._sock.recv(65536)
        except OSError:
            return {}
        return json.loads(data) if data else {}

    async def _send(self, message: dict[str, Any], fds: array.array[int] | None = None) -> None:
        assert self._sock is not None
        ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)] if fds is not None else []
        await self._sock.sendmsg([json.dumps(message).encode()], ancillary)

    async def _release(self, pid: int) -> None:
        """Tell the template to reap ``pid``: from here on its pid may be reused."""
        with contextlib.suppress(OSError):
            await self._send({"reap": pid})

    async def _dispatch(self, message: dict[str, Any]) -> None:
        if "exited" in message:
            worker = self._workers.pop(message["exited"], None)
            if worker is not None:
                worker.report(message["returncode"])
            else:  # nobody runs this worker (its start was cancelled): reap it now
                await self._release(message["exited"])
            return
        pending = self._pending.pop(message["id"], None)
        pid = message.get("pid")
        if pending is None:  # its start was cancelled: nobody will run this worker
            if pid is not None:
                processes.signal_group(pid, signal.SIGKILL)  # unreaped until its exit report is answered
            return
        event, slot = pending
        if pid is not None:  # registered here, before any exit report can be read
            worker = ForkedWorker(pid, None, _pidfd(pid), self._release)
            self._workers[pid] = worker
            slot.append(worker)
        else:
            slot.append(message.get("error", "fork server error"))
        event.set()

    def _fail(self, reason: str) -> None:
        if self._failed is None:
            log.warning("%s; starting workers with plain spawn", reason)
        self._failed = reason
        self._ready.set()
        for worker in self._workers.values():
            worker.reporter_gone.set()
        for event, slot in self._pending.values():
            slot.append(reason)
            event.set()
        self._pending.clear()

    async def start(self, launch: Launch) -> WorkerHandle:
        await self._ready.wait()
        if self._failed is not None or self._sock is None:
            return await self._fallback.start(launch)
        output_r, output_w = os.pipe2(os.O_CLOEXEC)
        self._next_id += 1
        request_id = self._next_id
        event, slot = trio.Event(), list[Any]()
        self._pending[request_id] = (event, slot)
        fds = array.array("i", [launch.to_worker_r, launch.from_worker_w, output_w])
        try:
            await self._send({"id": request_id, "cwd": launch.cwd, "env": launch.env}, fds)
            await event.wait()
        except BaseException:  # cancelled: a worker forked meanwhile must not live on unowned
            self._pending.pop(request_id, None)
            if slot and isinstance(slot[0], ForkedWorker):
                slot[0].signal_group(signal.SIGKILL)
                self._workers.pop(slot[0].pid, None)  # its exit report is answered with a reap
                _close_fd(slot[0].pidfd)
            os.close(output_r)
            raise
        finally:
            os.close(output_w)
        result = slot[0]
        if isinstance(result, str):
            os.close(output_r)
            raise OSError(result)
        result.stdout = trio.lowlevel.FdStream(output_r)
        return result
