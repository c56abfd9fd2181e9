"""The worker's side of the host pipe: one request, one answer, in order (and, between
two runs of a warm worker, its ``worker.idle`` line and the host's ``run.next``).

The protocol runs on its own pipe descriptors, so user code printing to stdout cannot
corrupt it. A node may call ``ctx`` from several threads: one request and its answer are
one turn under a lock, so each answer reaches the call that asked (and says so: its
``messageId`` is the request's, else the worker stops with a protocol error).

Given the claim's lease (a store several hosts share), a reader thread is the pipe's only
reader, whatever the main thread is doing (user code runs there): it hands answers to the
call waiting for one, and keeps the host's heartbeats (``host.heartbeat``) to itself. If
the host goes away (the pipe's hang-up), or stays silent past the time its last heartbeat
vouched for the claim (a frozen host, or one that cannot renew the claim), the worker's
registered process groups and its whole own group are killed at once, even while user
code runs: a run must never go on without its host, nor past its claim. Before the first
heartbeat the claim is good until the time its launch envelope says (else a third of its
lease from the worker's start). Without a lease the main thread reads its own answers and a
thread only waits for the hang-up.
"""

from __future__ import annotations

import _thread
import contextlib
import os
import select
import signal
import sys
import threading
import time
from collections import deque
from typing import NoReturn, TypeVar

import msgspec

from piwf import faults
from piwf.errors import ClaimLost, HostRefused, ProtocolError
from piwf.wire import LineBuffer, encode_line
from piwf.protocol.worker import (
    HEARTBEAT_PREFIX, MAX_WORKER_LINE, Payload, WorkerMessage, parse_heartbeat, parse_worker_response,
)


R = TypeVar("R")


class Channel:
    def __init__(self, read_fd: int, write_fd: int, *, worker_id: str, generation: int,
                 lease_ms: int = 0, until_ms: int = 0) -> None:
        self._read_fd = read_fd
        self._write_fd = write_fd
        self._buffer = LineBuffer(MAX_WORKER_LINE)
        self._lines: deque[bytes] = deque()
        self._broken: ProtocolError | None = None  # what the reader found wrong with the host's lines
        self._arrived = threading.Condition()
        self.worker_id = worker_id
        self.generation = generation
        self.revision = 0
        self._sent = 0
        self._turn = threading.Lock()  # one request and its answer at a time, whichever thread asks
        self.children: set[int] = set()  # process groups of registered shell processes
        self.vouched_until: float | None = None  # monotonic seconds; None: no bound (idle, or no lease given)
        self.arm(lease_ms, until_ms)
        # With no lease (a store only this host uses) the main thread reads its answers itself, as
        # fast as it can, and the thread only hears the hang-up; with one, the thread reads it all.
        self._reader = lease_ms > 0
        # Not threading.Thread.start(), which waits until the new thread has run: on cores
        # other processes keep busy that wait is the longest part of a fresh worker's start
        # (3-6 ms). The thread exists once this returns and the hang-up it polls for stays
        # signalled, so a host gone before it first runs is heard all the same.
        _thread.start_new_thread(self._read if self._reader else self._watch, ())

    def arm(self, lease_ms: int, until_ms: int = 0) -> None:
        """A claim of ``lease_ms`` begins (the worker's start, a warm worker's next run):
        vouched for until ``until_ms`` (the launch envelope's), else for a third of the
        lease, until the host's first heartbeat says more."""
        if lease_ms <= 0:
            self.vouched_until = None
        else:
            self.vouched_until = until_ms / 1000 if until_ms else time.monotonic() + lease_ms / 3000

    def _read(self) -> None:
        """The pipe's one reader: answers go to ``_lines``, heartbeats move ``vouched_until``;
        the hang-up, or the host's silence past ``vouched_until``, ends the process."""
        poller = select.poll()
        poller.register(self._read_fd, select.POLLIN)
        while True:
            until = self.vouched_until
            wait_ms = None if until is None else max(0, int((until - time.monotonic()) * 1000) + 1)
            if poller.poll(wait_ms):
                try:
                    chunk = os.read(self._read_fd, 65536)
                except OSError:
                    chunk = b""
                if not chunk:
                    self._host_gone()
                self._take(chunk)
            until = self.vouched_until  # after what was read: a stale heartbeat vouches for nothing now
            if until is not None and time.monotonic() >= until:
                self._host_silent()

    def _watch(self) -> None:
        """Wait for the host's end of the pipe to close (the main thread reads the answers)."""
        poller = select.poll()
        poller.register(self._read_fd, 0)  # no events asked: only hang-up and errors wake it
        while True:
            for _, event in poller.poll():
                if event & (select.POLLHUP | select.POLLERR | select.POLLNVAL):
                    self._host_gone()

    def _take(self, chunk: bytes) -> None:
        try:
            lines = self._buffer.feed(chunk)
            for line in lines:
                if line.startswith(HEARTBEAT_PREFIX):
                    self.vouched_until = parse_heartbeat(line).untilMs / 1000
            answers = [line for line in lines if not line.startswith(HEARTBEAT_PREFIX)]
        except ProtocolError as exc:
            with self._arrived:
                self._broken = exc
                self._arrived.notify_all()
            return
        if answers:
            with self._arrived:
                self._lines.extend(answers)
                self._arrived.notify_all()

    def _host_silent(self) -> NoReturn:
        print("piwf worker: the host has not vouched for this worker's claim in time (frozen, or unable to "
              "renew it); stopping its processes", file=sys.stderr, flush=True)
        self._host_gone()

    def _host_gone(self) -> NoReturn:
        """Nothing this process does can be accepted any more: the run's shell processes
        and its own process group go now."""
        for pgid in list(self.children):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
        os.killpg(os.getpgid(0), signal.SIGKILL)
        raise AssertionError("unreachable")

    def _next_answer(self) -> bytes:
        if not self._reader:
            while not self._lines:
                chunk = os.read(self._read_fd, 65536)
                if not chunk:
                    self._host_gone()
                lines = self._buffer.feed(chunk)
                self._lines.extend(line for line in lines if not line.startswith(HEARTBEAT_PREFIX))
            return self._lines.popleft()
        with self._arrived:
            while not self._lines:
                if self._broken is not None:
                    raise self._broken
                self._arrived.wait()
            return self._lines.popleft()

    def rebind(self, worker_id: str, generation: int, lease_ms: int = 0, until_ms: int = 0) -> None:
        """A warm worker's next run: its messages carry that run's claim from here on."""
        with self._turn:
            self.worker_id, self.generation, self.revision = worker_id, generation, 0
            self.children.clear()
            self.arm(lease_ms, until_ms)

    def tell(self, message: msgspec.Struct, *, idle: bool = False) -> None:
        """Send one line that is not a request (a warm worker's ``worker.idle``); ``idle``:
        the worker holds no claim from now on, so the host's silence bounds nothing."""
        with self._turn:
            if idle:
                self.vouched_until = None
            _write_all(self._write_fd, encode_line(message))

    def next_line(self) -> bytes:
        """The host's next line, whatever it is (a warm worker waiting for its next run);
        the host's hang-up ends the process, as during a run."""
        with self._turn:
            return self._next_answer()

    def request(self, kind: type[WorkerMessage], payload: Payload | None = None, result: type[R] | None = None) -> R:
        """Send one message of ``kind`` and wait for its answer; its result converted to
        ``result`` when given. ClaimLost or HostRefused when the host did not accept it.
        Safe from any thread: the turn's lock covers the request, its answer and the
        revision the answer carries (the next request expects it)."""
        fields = {} if payload is None else {"payload": payload}
        with self._turn:
            self._sent += 1
            message = kind(messageId=f"m{self._sent}", workerEpoch=self.worker_id, generation=self.generation,
                           expectedRevision=self.revision, **fields)
            line = encode_line(message)
            if len(line) > MAX_WORKER_LINE:
                raise HostRefused(f"{message.operation} message is {len(line)} bytes, "
                                  f"over the {MAX_WORKER_LINE}-byte limit")
            _write_all(self._write_fd, line)
            faults.point("worker.message.sent")
            answer = self._next_answer()
            faults.point("worker.answer.received")
            response = parse_worker_response(answer)
            if response.messageId != message.messageId:
                raise ProtocolError(f"the host answered {response.messageId} to {message.messageId}")
            if response.revision is not None:
                self.revision = response.revision
        if response.outcome == "claimLost":
            raise ClaimLost(response.error or "claim lost")
        if response.outcome != "accepted":
            raise HostRefused(f"host refused {message.operation}: {response.error}")
        return response.result if result is None else msgspec.convert(response.result, result)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
