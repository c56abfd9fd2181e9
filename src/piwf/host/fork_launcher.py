"""Workers started by a template process, so that no worker is ever a child of the host.

The template (``python -m piwf.worker.forkserver``) has piwf's worker modules imported and
no user code. For each run it forks a child that runs the worker (``--worker-start
fork``), or forks and execs a fresh interpreter (``spawn``). Either way the worker's parent
is the template: a node that signals its parent hits the template, never the host. When
the template dies the host starts another (backing off if it keeps dying); the workers of
the dead one run on, and are watched through their pidfds.
"""

from __future__ import annotations

import array
import contextlib
import logging
import math
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable

import msgspec
import trio
import trio_util

from piwf import processes
from piwf.protocol.worker import (
    Exited, Fork, Forked, ForkFailed, Reap, TemplateMessage, TemplateReady, from_template,
)
from piwf.host.launcher import ForkedWorker, Launch, LauncherUnavailable, WorkerHandle, _pidfd

log = logging.getLogger("piwf.host")

TEMPLATE_READY_S = 10.0  # a template must say ready by then; a start waits no longer for one
CLOSE_S = 10.0
RESTART_S = (0.1, 5.0)  # back-off between template restarts: first, most


class ForkLauncher:
    def __init__(self, drain_deadline: Callable[[], float] = lambda: math.inf, *, exec_worker: bool = False) -> None:
        self._drain_deadline = drain_deadline  # closing the template ends by then, too
        self._exec = exec_worker
        self._sock: trio.socket.SocketType | None = None
        self._raw: socket.socket | None = None  # the same socket, for a send that does not wait (_send)
        self._process: trio.Process | None = None
        self._up = trio_util.AsyncBool(False)  # a template is ready to fork
        self._next_id = 0
        # starts waiting for the template's answer, oldest first, each with the time by which it is due
        self._pending: dict[int, tuple[trio.Event, list[ForkedWorker | OSError], float]] = {}
        self._watchdog: trio.CancelScope | None = None  # the reader's scope: its deadline is the oldest start's
        self._workers: dict[int, ForkedWorker] = {}

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Keep a template running for the host's life, restarting it when it dies."""
        task_status.started()
        delay = RESTART_S[0]
        try:
            while True:
                began = trio.current_time()
                reason = await self._serve_template()
                delay = RESTART_S[0] if trio.current_time() - began > RESTART_S[1] else min(delay * 2, RESTART_S[1])
                log.warning("%s; starting another in %.1f s", reason, delay)
                await trio.sleep(delay)
        finally:
            self._up.value = False  # no start from now on: none would be answered, nor failed
            self._fail_pending("the fork server is closing")
            deadline = min(trio.current_time() + CLOSE_S, self._drain_deadline())
            with trio.CancelScope(shield=True, deadline=deadline):
                await self._close()
            await self._kill_template()

    async def _serve_template(self) -> str:
        """Start a template and serve it until it dies; returns why it is gone."""
        host_end, template_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._process = await trio.lowlevel.open_process(
                [sys.executable, "-m", "piwf.worker.forkserver"], start_new_session=True,
                pass_fds=(template_end.fileno(),), stdin=subprocess.DEVNULL,
                env={**os.environ, "PIWF_FORKSERVER_FD": str(template_end.fileno())},
            )
        except OSError as exc:
            host_end.close()
            return f"cannot start the fork server: {exc}"
        finally:
            template_end.close()
        self._sock, self._raw = trio.socket.from_stdlib_socket(host_end), host_end
        reason = await self._read_replies()
        await self._retire(reason)
        return reason

    async def _read_replies(self) -> str:
        with trio.move_on_after(TEMPLATE_READY_S):
            if isinstance(await self._receive(), TemplateReady):
                self._up.value = True
        if not self._up.value:
            return "the fork server did not start"
        # One scope for all the starts waiting for an answer (not one per start), whose
        # deadline is never later than the oldest one's due time: a start sets it when
        # none is set, and nothing moves it when an answer comes. When it passes, a
        # template that has left a start unanswered that long (stopped or stuck: a node
        # may SIGSTOP its parent) is killed, its starts fail (LauncherUnavailable, by
        # ``_retire``) and another template is started; else (its starts were answered)
        # it watches the ones still waiting, if any.
        while True:
            with trio.CancelScope(deadline=self._oldest_due()) as watchdog:
                self._watchdog = watchdog
                try:
                    while (message := await self._receive()) is not None:
                        await self._dispatch(message)
                    return "the fork server exited"
                finally:
                    self._watchdog = None
            if self._oldest_due() <= trio.current_time():
                reason = f"the fork server did not answer within {TEMPLATE_READY_S:g} s"
                self._abandon_template(reason)
                return reason

    def _oldest_due(self) -> float:
        """When the oldest start waiting for an answer is due (math.inf: none waits)."""
        return next(iter(self._pending.values()))[2] if self._pending else math.inf

    def _abandon_template(self, reason: str) -> None:
        """Kill a template that does not answer: its end is read as its exit, and another
        is started."""
        log.warning("%s; killing it", reason)
        self._up.value = False
        if self._process is not None and self._process.returncode is None:
            self._process.kill()

    async def _retire(self, reason: str) -> None:
        """The template is gone: its workers are watched through their pidfds (init reaps
        them now), starts waiting on it fail, and its process is reaped."""
        self._up.value = False
        for worker in self._workers.values():
            worker.template_gone()
        self._workers.clear()
        self._fail_pending(reason)
        await self._kill_template()
        self._sock = self._raw = self._process = None

    def _fail_pending(self, reason: str) -> None:
        for event, slot, _ in self._pending.values():
            slot.append(LauncherUnavailable(reason))
            event.set()
        self._pending.clear()

    async def _close(self) -> None:
        """At host exit: keep reading exit reports while workers are still being stopped
        (their supervisors wait for them), then close the template."""
        if self._sock is None:
            return
        with trio.move_on_after(CLOSE_S / 2):
            while any(not worker.exited.is_set() for worker in self._workers.values()):
                message = await self._receive()
                if message is None:
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

    async def _receive(self) -> TemplateMessage | None:
        """The template's next message; None once it has gone. Read once the socket is
        readable (its answers come after the host has waited: a read first would find
        nothing), straight from the socket (non-blocking: trio's)."""
        assert self._raw is not None
        while True:
            try:
                await trio.lowlevel.wait_readable(self._raw)
                data = self._raw.recv(65536)
            except BlockingIOError:
                continue  # readable, and read meanwhile
            except (OSError, trio.ClosedResourceError):
                return None
            return from_template.decode(data) if data else None

    async def _send(self, message: TemplateMessage, fds: array.array[int] | None = None) -> None:
        if self._sock is None:
            raise LauncherUnavailable("the fork server is not running")
        ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)] if fds is not None else []
        data = [msgspec.json.encode(message)]
        await trio.lowlevel.checkpoint_if_cancelled()  # cancelled: nothing is sent, as trio's sendmsg
        if self._raw is not None:  # non-blocking (trio's): sent at once unless the socket is full
            with contextlib.suppress(BlockingIOError):
                self._raw.sendmsg(data, ancillary)
                return
        await self._sock.sendmsg(data, ancillary)

    async def _release(self, pid: int) -> None:
        """Tell the template to reap ``pid``: from here on its pid may be reused."""
        self._workers.pop(pid, None)
        with contextlib.suppress(OSError):
            await self._send(Reap(pid=pid))

    async def _dispatch(self, message: TemplateMessage) -> None:
        if isinstance(message, Exited):
            worker = self._workers.get(message.pid)
            if worker is not None and not worker.abandoned:  # kept until released: see _retire
                worker.report(message.returncode)
            else:  # nobody waits for this worker (its start or its reaping was given up): reap it now
                # shielded (the watchdog passing must not lose a reap), bounded (a stuck template)
                with trio.CancelScope(shield=True, deadline=trio.current_time() + TEMPLATE_READY_S):
                    await self._release(message.pid)
            return
        if not isinstance(message, (Forked, ForkFailed)):
            return
        pending = self._pending.pop(message.id, None)
        pid = message.pid if isinstance(message, Forked) else None
        if pending is None:  # its start was cancelled: nobody will run this worker
            if pid is not None:
                processes.signal_group(pid, signal.SIGKILL)  # unreaped until its exit report is answered
            return
        event, slot, _ = pending
        if pid is not None:  # registered here, before any exit report can be read
            worker = ForkedWorker(pid, None, _pidfd(pid), self._release, identity=processes.identity(pid))
            self._workers[pid] = worker
            slot.append(worker)
        else:
            assert isinstance(message, ForkFailed)
            slot.append(OSError(message.error))  # the template's own refusal (a missing cwd)
        event.set()

    async def start(self, launch: Launch) -> WorkerHandle:
        if not self._up.value:  # a template is being started: wait for it (no scope when one is up)
            with trio.move_on_after(TEMPLATE_READY_S):
                await self._up.wait_value(True)
        if not self._up.value:
            raise LauncherUnavailable("the fork server is not running (it is being restarted)")
        output_r, output_w = os.pipe2(os.O_CLOEXEC)
        self._next_id += 1
        request_id = self._next_id
        event, slot = trio.Event(), list[ForkedWorker | OSError]()
        due = trio.current_time() + TEMPLATE_READY_S
        self._pending[request_id] = (event, slot, due)
        if self._watchdog is not None and self._watchdog.deadline == math.inf:
            self._watchdog.deadline = due  # the watchdog's is the earliest: each later start is due later
        fds = array.array("i", [launch.to_worker_r, launch.from_worker_w, output_w])
        try:
            try:
                await self._send(Fork(id=request_id, cwd=launch.cwd, env=launch.env, execWorker=self._exec), fds)
            except OSError as exc:  # it died just now: the next template will start the worker
                raise LauncherUnavailable(f"the fork server is gone: {exc}") from exc
            await event.wait()  # bounded: the reader's watchdog (_read_replies) fails it after TEMPLATE_READY_S
        except BaseException:  # cancelled: a worker forked meanwhile must not live on unowned
            self._pending.pop(request_id, None)
            if slot and isinstance(slot[0], ForkedWorker):
                slot[0].signal_group(signal.SIGKILL)
                slot[0].abandon()  # its exit report is answered with a reap
            os.close(output_r)
            raise
        finally:
            os.close(output_w)
        result = slot[0]
        if isinstance(result, OSError):  # refused, or the template died meanwhile (LauncherUnavailable)
            os.close(output_r)
            raise result
        result.stdout = trio.lowlevel.FdStream(output_r)
        return result
