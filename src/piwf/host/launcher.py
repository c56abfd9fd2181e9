"""Starting worker processes: forked from a preloaded template, or spawned.

Both give the supervisor the same handle: ``pid`` (leader of the worker's own process
group), ``returncode`` (negative for a signal, as in subprocess), ``stdout`` (the worker's
output, stdout and stderr together) and ``wait()``.
"""

from __future__ import annotations

import array
import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any, Protocol

import trio
import trio_util

from .. import processes

log = logging.getLogger("piwf.host")

TEMPLATE_READY_S = 10.0
EXIT_REPORT_GRACE_S = 2.0
CLOSE_S = 10.0


@dataclass
class Launch:
    cwd: str
    env: dict[str, str]
    to_worker_r: int
    from_worker_w: int


class WorkerHandle(Protocol):
    pid: int
    returncode: int | None
    stdout: trio.abc.ReceiveStream | None

    async def wait(self) -> int: ...


class Launcher(Protocol):
    async def start(self, launch: Launch) -> WorkerHandle: ...


class SpawnLauncher:
    """``python -m piwf.worker`` as a new process: the fallback, and where fork is missing."""

    async def start(self, launch: Launch) -> WorkerHandle:
        env = {**launch.env, "PIWF_WORKER_FDS": f"{launch.to_worker_r},{launch.from_worker_w}"}
        return await trio.lowlevel.open_process(
            [sys.executable, "-m", "piwf.worker"], cwd=launch.cwd, env=env, start_new_session=True,
            pass_fds=(launch.to_worker_r, launch.from_worker_w), stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )


@dataclass(eq=False)
class ForkedWorker:
    pid: int
    stdout: trio.abc.ReceiveStream | None
    pidfd: int | None
    returncode: int | None = None
    exited: trio.Event = field(default_factory=trio.Event)
    reporter_gone: trio.Event = field(default_factory=trio.Event)  # the template died

    def report(self, status: int) -> None:
        self.returncode = os.waitstatus_to_exitcode(status)
        self.exited.set()

    async def wait(self) -> int:
        """The template reaps its children and reports their status. If the template is
        gone, the pidfd still says when the worker ended (its status is then unknown)."""
        if not self.exited.is_set():
            if self.pidfd is not None:
                await trio.lowlevel.wait_readable(self.pidfd)
                with trio.move_on_after(EXIT_REPORT_GRACE_S):
                    await trio_util.wait_any(self.exited.wait, self.reporter_gone.wait)
            else:  # no pidfd (the worker was gone before one could be opened): the report or nothing
                await trio_util.wait_any(self.exited.wait, self.reporter_gone.wait)
            if not self.exited.is_set():
                self.returncode = -9  # unknown: counted as killed
                self.exited.set()
        self.close_pidfd()
        assert self.returncode is not None
        return self.returncode

    def close_pidfd(self) -> None:
        if self.pidfd is not None:
            with contextlib.suppress(OSError):
                trio.lowlevel.notify_closing(self.pidfd)
                os.close(self.pidfd)
            self.pidfd = None


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (OSError, AttributeError):
        return None


def fork_available() -> bool:
    return sys.platform == "linux" and hasattr(os, "fork") and hasattr(os, "pidfd_open")


class ForkLauncher:
    """Forks workers from a template process that has piwf's worker modules imported."""

    def __init__(self) -> None:
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
            with trio.CancelScope(shield=True):
                await self._close()

    async def _close(self) -> None:
        """Keep reading exit reports while workers are still being stopped (their
        supervisors wait for them), then close the template."""
        assert self._sock is not None
        with trio.move_on_after(CLOSE_S):
            while self._workers and not self._failed:
                message = await self._receive()
                if not message:
                    break
                self._dispatch(message)
        if self._workers:
            log.warning("closing the fork server with %d worker(s) unreported", len(self._workers))
        self._sock.close()
        if self._process is not None:
            with trio.move_on_after(5):
                await self._process.wait()
            if self._process.returncode is None:
                self._process.kill()
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
            self._dispatch(message)
        self._fail("the fork server exited")

    async def _receive(self) -> dict[str, Any]:
        assert self._sock is not None
        try:
            data = await self._sock.recv(65536)
        except OSError:
            return {}
        return json.loads(data) if data else {}

    def _dispatch(self, message: dict[str, Any]) -> None:
        if "exited" in message:
            worker = self._workers.pop(message["exited"], None)
            if worker is not None:
                worker.report(message["status"])
            return
        pending = self._pending.pop(message["id"], None)
        pid = message.get("pid")
        if pending is None:  # its start was cancelled: nobody will run this worker
            if pid is not None:
                processes.signal_group(pid, signal.SIGKILL)
            return
        event, slot = pending
        if pid is not None:  # registered here, before any exit report can be read
            worker = ForkedWorker(pid, None, _pidfd(pid))
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
        message = json.dumps({"id": request_id, "cwd": launch.cwd, "env": launch.env}).encode()
        fds = array.array("i", [launch.to_worker_r, launch.from_worker_w, output_w])
        try:
            await self._sock.sendmsg([message], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
            await event.wait()
        except BaseException:  # cancelled: a worker forked meanwhile must not live on unowned
            self._pending.pop(request_id, None)
            if slot and isinstance(slot[0], ForkedWorker):
                processes.signal_group(slot[0].pid, signal.SIGKILL)
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
