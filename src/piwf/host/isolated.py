"""The host's own bounded resources for user files: reading a project's workflow or
controller file, and the throwaway processes that import it (user code never runs in
the host).

``read_user_file`` reads only a regular file of at most ``SOURCE_LIMIT`` bytes: it is
opened without blocking (a FIFO cannot hold a thread), refused with what it is (a FIFO, a
device, a directory, too large) before a byte is read, and read in a worker thread under
a time limit (a hung file system costs one abandoned thread, never the event loop or the
drain). The thread is the host's own reader (``_ReaderThread``) when it is idle, else one of
trio's: a hop to a thread kept for this and woken through a pipe costs a fraction of a
``trio.to_thread`` hop, and ``run.start`` reads its workflow file (or its stat) every time.

``Isolation.run`` starts ``python -m MODULE ARGS`` in a throwaway process: at most
``ISOLATED_AT_ONCE`` at a time per host, at most ``ISOLATED_WAITING`` more waiting for a
slot (beyond that the request is refused as ``unavailable`` before anything is spawned);
its result channel (stdout) is read up to ``RESULT_LIMIT`` and only the last
``DIAGNOSTIC_BYTES`` of its stderr are kept; the process group is killed at the time
limit or when the host stops.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import outcome
import trio

from piwf.errors import PiwfError, Rejected, StorageUnavailable
from piwf.wire import decode_json

SOURCE_LIMIT = 4 * 1024 * 1024  # a workflow or controller file
READ_TIMEOUT_S = 5.0  # reading one such file, on a file system that may hang
FILE_READERS = 4  # trio threads reading user files at once, per host (beside its own reader thread)
INSPECT_TIMEOUT_S = 30
ISOLATED_AT_ONCE = 4  # throwaway processes at once, per host
ISOLATED_WAITING = 64  # requests waiting for one; more are refused (unavailable) before spawning
RESULT_LIMIT = 8 * 1024 * 1024  # a throwaway process's one JSON result line
DIAGNOSTIC_BYTES = 64 * 1024  # of its stderr, the tail kept
REASON_LIMIT = 8192  # characters of its last stderr line, in the refusal
REAP_S = 2.0


class Busy(PiwfError):
    """Too many throwaway processes are running or waiting: refused before spawning."""

    code = "busy"
    outcome = "unavailable"


# A regular file's (mtime_ns, ctime_ns, size, inode) as read: while one ``os.stat`` finds
# them unchanged, the file is not opened or read again. ctime cannot be set back (``touch
# -r``, ``cp -p`` and ``rsync -t`` set mtime), so a rewrite that keeps mtime and size is
# still seen; and a file changed less than RECENT_NS before it was read gets no key (it is
# read again next time): a second write within one tick of the file system's clock (a
# jiffy, or 1-2 s on coarse file systems) could give it the same times again.
StatKey = tuple[int, int, int, int]
RECENT_NS = 2_000_000_000


def describe(mode: int) -> str:
    """What a file that is not a regular file is, in words."""
    for test, what in ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return what
    return "not a regular file"


def _key(info: os.stat_result) -> StatKey:
    return info.st_mtime_ns, info.st_ctime_ns, info.st_size, info.st_ino


def _read_bounded(path: Path, limit: int, known: StatKey | None) -> tuple[StatKey | None, bytes | None]:
    """(stat key, contents), contents None when the key is ``known`` (then one ``stat``,
    which opens nothing); the key None when the file changed too recently to be known by
    it. Raises ``Rejected`` for anything but a regular file of at most ``limit`` bytes;
    ``OSError`` as it comes."""
    if known is not None:
        info = os.stat(path)
        if stat.S_ISREG(info.st_mode) and _key(info) == known:
            return known, None
    began = time.time_ns()
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise Rejected(f"{path} is {describe(info.st_mode)}, not a regular file: it is not read")
        if info.st_size > limit:
            raise Rejected(f"{path} is {info.st_size} bytes; a workflow or controller file is at most {limit}")
        key: StatKey | None = _key(info)
        if key == known:
            return key, None
        if max(info.st_mtime_ns, info.st_ctime_ns) > began - RECENT_NS:
            key = None
        chunks, size = [], 0
        while chunk := os.read(fd, min(limit + 1 - size, 1 << 20)):
            chunks.append(chunk)
            size += len(chunk)
            if size > limit:
                raise Rejected(f"{path} grew past {limit} bytes while it was read; a workflow or controller "
                               f"file is at most {limit}")
        return key, b"".join(chunks)
    finally:
        os.close(fd)


class _ReaderThread:
    """A thread kept for reading user files, asked and answering through one socket pair,
    whose end the loop waits on like any descriptor (as the group commit's syncer waits on
    its pipe, store/sqlite/group.py). One read at a time: ``busy`` while one is in it, and
    while one whose caller gave up (a hung file system) is still in it; reads that find it
    busy go to trio's threads. Made with its host's Isolation (two descriptors for the
    host's life), it ends when that is collected."""

    def __init__(self) -> None:
        self._loop_end, self._thread_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._loop_end.setblocking(False)
        self._lock = threading.Lock()
        self._job: Callable[[], Any] | None = None
        self._result: outcome.Outcome[Any] | None = None
        self._finished = False  # the job in it has returned and said so on the socket
        self._abandoned = False  # its caller gave up: the thread frees itself when the job returns
        self.busy = False
        threading.Thread(target=self._run, name="piwf-files", daemon=True).start()

    def close(self) -> None:
        self._loop_end.close()  # the thread sees the end after the job it may be in, and closes its own

    async def call(self, job: Callable[[], Any]) -> Any:
        assert not self.busy
        self.busy, self._job, self._finished = True, job, False
        self._loop_end.send(b"r")
        try:
            while True:
                await trio.lowlevel.wait_readable(self._loop_end)
                try:
                    self._loop_end.recv(1)
                    break
                except BlockingIOError:
                    continue
        except BaseException:  # cancelled (the read's time limit): leave the job to finish on its own
            with self._lock:
                if self._finished:  # it just did: its word is on the socket
                    self._loop_end.recv(1)
                    self.busy = False
                else:
                    self._abandoned = True
            raise
        result, self._result, self.busy = self._result, None, False
        assert result is not None
        return result.unwrap()

    def _run(self) -> None:
        with self._thread_end, contextlib.suppress(OSError):  # OSError: the host end closed meanwhile
            while self._thread_end.recv(1):
                job = self._job
                assert job is not None
                self._result = outcome.capture(job)
                with self._lock:
                    self._finished = True
                    if self._abandoned:
                        self._abandoned, self._result, self.busy = False, None, False
                    else:
                        self._thread_end.send(b"d")


@dataclass
class Isolation:
    """One host's bounds on reading user files and on throwaway processes."""

    at_once: int = ISOLATED_AT_ONCE
    waiting_max: int = ISOLATED_WAITING
    _readers: trio.CapacityLimiter | None = None
    _slots: trio.CapacityLimiter | None = None

    def __post_init__(self) -> None:
        self._reader = reader = _ReaderThread()
        weakref.finalize(self, reader.close)
    waiting: int = 0
    running: int = 0
    started: int = 0  # throwaway processes started, over the host's life
    peak: int = 0  # the most that ran at once

    def _limiters(self) -> tuple[trio.CapacityLimiter, trio.CapacityLimiter]:
        if self._readers is None or self._slots is None:  # made in the host's trio run, on first use
            self._readers, self._slots = trio.CapacityLimiter(FILE_READERS), trio.CapacityLimiter(self.at_once)
        return self._readers, self._slots

    async def read_user_file(self, path: Path, known: StatKey | None = None,
                             limit: int = SOURCE_LIMIT) -> tuple[StatKey | None, bytes | None]:
        """``_read_bounded`` in a thread, within READ_TIMEOUT_S (then ``unavailable``)."""
        readers, _ = self._limiters()
        with trio.move_on_after(READ_TIMEOUT_S):
            if not self._reader.busy:
                return await self._reader.call(lambda: _read_bounded(path, limit, known))  # type: ignore[no-any-return]
            return await trio.to_thread.run_sync(_read_bounded, path, limit, known, limiter=readers,
                                                 abandon_on_cancel=True)
        raise StorageUnavailable(f"reading {path} took over {READ_TIMEOUT_S:g} s (a hung file system?); "
                                 "retry once it answers")

    async def run(self, module_args: list[str], project: str, what: str, verb: str, stdin: bytes = b"",
                  check: Callable[[], Awaitable[None]] | None = None) -> dict[str, Any]:
        """``python -m MODULE ARGS`` in a throwaway process in ``project``, within
        INSPECT_TIMEOUT_S: the one JSON line it prints last, or ``Rejected`` saying why
        ``what`` could not be ``verb``. ``check`` (awaitable) runs once a slot is free,
        just before spawning: what it raises refuses the request without a process."""
        _, slots = self._limiters()
        if slots.borrowed_tokens >= slots.total_tokens and self.waiting >= self.waiting_max:
            raise Busy(f"the host is already running {self.running} and queueing {self.waiting} throwaway "
                       f"processes (workflow and controller checks); {what} was not {verb}: retry shortly")
        self.waiting += 1
        try:
            await slots.acquire()
        finally:
            self.waiting -= 1
        try:
            if check is not None:
                await check()
            self.running += 1
            self.started += 1
            self.peak = max(self.peak, self.running)
            try:
                status, out, err, timed_out = await _run(module_args, project, stdin)
            finally:
                self.running -= 1
        finally:
            slots.release()
        return _result(what, verb, status, out, err, timed_out)


async def _run(module_args: list[str], project: str, stdin: bytes) -> tuple[int | None, bytes, bytes, bool]:
    """(exit status, stdout up to RESULT_LIMIT + 1 bytes, stderr's tail, timed out).

    The process's group is killed once its leader has exited (or at the time limit, or
    when the host stops), and always before the leader is reaped, so the group id cannot
    name another group: nothing it started in the background outlives it."""
    try:
        proc = await trio.lowlevel.open_process(
            [sys.executable, "-m", *module_args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, cwd=Path(project), start_new_session=True)
    except OSError as exc:
        raise Rejected(f"cannot start a process to check the file: {exc}") from None
    pidfd = os.pidfd_open(proc.pid)  # readable once the leader exits; it stays unreaped until proc.wait()
    out, err = bytearray(), bytearray()
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_feed, proc.stdin, stdin)
            nursery.start_soon(_collect, proc.stdout, out, RESULT_LIMIT + 1, False)
            nursery.start_soon(_collect, proc.stderr, err, DIAGNOSTIC_BYTES, True)
            with trio.move_on_after(INSPECT_TIMEOUT_S) as limit:
                await trio.lowlevel.wait_readable(pidfd)
            _kill_group(proc.pid)  # its pipes end once the group is gone (bounded: one that left it may hold them)
            nursery.cancel_scope.deadline = trio.current_time() + REAP_S
    finally:  # done, timed out, cancelled (the host stops): nothing of it is left running
        with trio.CancelScope(shield=True):
            _kill_group(proc.pid)
            with trio.move_on_after(REAP_S):
                await proc.wait()
            os.close(pidfd)
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                if stream is not None:
                    await stream.aclose()
    return proc.returncode, bytes(out), bytes(err), limit.cancelled_caught


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


async def _feed(stream: Any, data: bytes) -> None:
    try:
        if data:
            await stream.send_all(data)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass
    finally:
        await stream.aclose()


async def _collect(stream: Any, into: bytearray, limit: int, tail: bool) -> None:
    """Read ``stream`` to its end, keeping its first ``limit`` bytes (``tail``: its last)."""
    try:
        while chunk := await stream.receive_some(65536):
            if tail:
                into += chunk
                del into[:-limit]
            elif len(into) < limit:
                into += chunk[:limit - len(into)]
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass


def _result(what: str, verb: str, status: int | None, out: bytes, err: bytes, timed_out: bool) -> dict[str, Any]:
    if timed_out:
        raise Rejected(f"{what} took over {INSPECT_TIMEOUT_S} s to load")
    if len(out) > RESULT_LIMIT:
        raise Rejected(f"{what} could not be {verb}: its result is over {RESULT_LIMIT} bytes")
    try:
        result: dict[str, Any] = decode_json(out.strip().splitlines()[-1])
    except (PiwfError, IndexError):
        tail = err.decode(errors="replace").strip().splitlines()[-1:] or [f"no output (exit status {status})"]
        line = tail[0] if len(tail[0]) <= REASON_LIMIT else tail[0][-REASON_LIMIT:] + " (its last characters)"
        raise Rejected(f"{what} could not be {verb}: {line}") from None
    if not isinstance(result, dict):
        raise Rejected(f"{what} could not be {verb}: its result is not a JSON object")
    if "error" in result:
        raise Rejected(result["error"])
    return result
