"""Worker process handles, and starting workers where no fork server can run.

On Linux workers are started by a template process (``fork_launcher.ForkLauncher``);
``SpawnLauncher`` (the host as the worker's parent) is only for platforms without
``fork`` and pidfds. Both give the supervisor the same handle: ``pid`` (leader of the
worker's own process group), ``stdout`` (the worker's output, stdout and stderr together), and three steps
that keep a signal from ever reaching a recycled pid:

    wait_exited()   the leader has exited; it is not reaped yet, so its pid (and the
                    process group it names) cannot be handed to another process
    signal_group()  signals the group only while the leader is known unreaped
    reap()          releases the pid; returns the exit status (negative for a signal,
                    as in subprocess), or None when it cannot be known
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

import trio

from piwf import processes


@dataclass
class Launch:
    cwd: str
    env: dict[str, str]
    to_worker_r: int
    from_worker_w: int


class LauncherUnavailable(OSError):
    """No worker could be started because the launcher itself was not ready (the fork
    server was being started again): not the run's fault, and not counted as its crash."""


class WorkerHandle(Protocol):
    identity: str | None  # boot id, pid and start time, read once while it was unreaped

    @property
    def pid(self) -> int: ...
    @property
    def stdout(self) -> trio.abc.ReceiveStream | None: ...

    def signal_group(self, sig: int) -> bool: ...
    def has_exited(self) -> bool: ...  # without waiting: the leader has exited (reaped or not)
    async def wait_exited(self) -> None: ...  # one waiting task at a time
    async def reap(self) -> int | None: ...


class Launcher(Protocol):
    async def start(self, launch: Launch) -> WorkerHandle: ...


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (OSError, AttributeError):
        return None


def _readable(fd: int) -> bool:
    """A pidfd polls readable once its process has exited."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(0))


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
    identity: str | None = None
    reaped: bool = False

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def stdout(self) -> trio.abc.ReceiveStream | None:
        return self.process.stdout

    def signal_group(self, sig: int) -> bool:
        return not self.reaped and processes.signal_group(self.pid, sig)

    def has_exited(self) -> bool:
        return self.reaped or (self.pidfd is not None and _readable(self.pidfd))

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
        return SpawnedWorker(process, _pidfd(process.pid), processes.identity(process.pid))


@dataclass(eq=False)
class ForkedWorker:
    """A child of the template. The template reports its exit without reaping it and
    reaps it only when told (``release``): until then its pid stays taken."""

    pid: int
    stdout: trio.abc.ReceiveStream | None
    pidfd: int | None
    release: Callable[[int], Awaitable[None]]  # tells the template to reap this pid
    identity: str | None = None  # boot id, pid and start time, read while it was unreaped
    returncode: int | None = None
    released: bool = False
    abandoned: bool = False  # nobody will reap it through this handle: its exit report reaps it
    exited: trio.Event = field(default_factory=trio.Event)
    reporter_gone: trio.Event = field(default_factory=trio.Event)  # the template died
    settled: trio.Event = field(default_factory=trio.Event)  # either of the two: one event to wait on, not two

    def report(self, returncode: int) -> None:
        self.returncode = returncode
        self.exited.set()
        self.settled.set()

    def template_gone(self) -> None:
        self.reporter_gone.set()
        self.settled.set()

    def signal_group(self, sig: int) -> bool:
        if self.released:
            return False
        if not self.reporter_gone.is_set():  # held unreaped by the template until released
            return processes.signal_group(self.pid, sig)
        # The template is gone: init may reap the worker at any moment. Its pidfd names
        # exactly this process; the rest of its group is found by the leader's recorded
        # identity (members started after it), never by a bare process group id.
        sent = False
        if self.pidfd is not None:
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(self.pidfd, sig)
                sent = True
        if sig == signal.SIGKILL and self.identity is not None:
            sent = processes.kill_recorded_group(self.pid, self.identity) or sent
        return sent

    def has_exited(self) -> bool:
        return self.exited.is_set() or self.released or (self.pidfd is not None and _readable(self.pidfd))

    async def wait_exited(self) -> None:
        """Through the pidfd, not the template's report: a template stopped by a node (it
        is the worker's parent) must not keep a worker's exit from being seen."""
        if self.exited.is_set():
            return
        if self.pidfd is not None:
            await trio.lowlevel.wait_readable(self.pidfd)
        else:
            await self.settled.wait()

    async def reap(self) -> int | None:
        """The exit status as the template reported it; None when the template died first
        (init reaps the worker then, and its status is unknown)."""
        if self.released:
            return self.returncode
        try:
            await self.settled.wait()
            if self.exited.is_set() and not self.reporter_gone.is_set():
                await self.release(self.pid)
            elif self.pidfd is not None:
                await trio.lowlevel.wait_readable(self.pidfd)
            self.released = True
        finally:
            if not self.released:  # given up (a cleanup deadline): the exit report reaps it
                self.abandon()
            _close_fd(self.pidfd)
            self.pidfd = None
        return self.returncode

    def abandon(self) -> None:
        self.abandoned = True
        _close_fd(self.pidfd)
        self.pidfd = None


async def stop_worker(proc: WorkerHandle, grace_s: float, exited: bool) -> int | None:
    """SIGTERM the group, wait out the grace, SIGKILL the group; then reap. The group is
    signalled only while its leader is unreaped, so its id cannot name another group."""
    try:
        if not exited:
            proc.signal_group(signal.SIGTERM)
            with trio.move_on_after(grace_s):
                await proc.wait_exited()
    finally:  # even when the cleanup's deadline ends the grace early
        # Whatever the worker left in its group (its children, their children) dies with it.
        proc.signal_group(signal.SIGKILL)
    return await proc.reap()


def fork_available() -> bool:
    return sys.platform == "linux" and hasattr(os, "fork") and hasattr(os, "pidfd_open")
