"""The worker's side of the host pipe: one request, one answer, in order (and, between
two runs of a warm worker, its ``worker.idle`` line and the host's ``run.next``).

The protocol runs on its own pipe descriptors, so user code printing to stdout cannot
corrupt it. A node may call ``ctx`` from several threads: one request and its answer are
one turn under a lock, so each answer reaches the call that asked (and says so: its
``messageId`` is the request's, else the worker stops with a protocol error). A watcher
thread waits for the pipe's hang-up: if the host goes away, the worker's whole process
group is killed at once, even while user code runs: a run must never go on without its
host.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import threading
from typing import NoReturn, TypeVar

import msgspec

from piwf import faults
from piwf.errors import ClaimLost, HostRefused, ProtocolError
from piwf.wire import LineBuffer, encode_line
from piwf.protocol.worker import MAX_WORKER_LINE, Payload, WorkerMessage, parse_worker_response


R = TypeVar("R")


class Channel:
    def __init__(self, read_fd: int, write_fd: int, *, worker_id: str, generation: int) -> None:
        self._read_fd = read_fd
        self._write_fd = write_fd
        self._buffer = LineBuffer(MAX_WORKER_LINE)
        self._lines: list[bytes] = []
        self.worker_id = worker_id
        self.generation = generation
        self.revision = 0
        self._sent = 0
        self._turn = threading.Lock()  # one request and its answer at a time, whichever thread asks
        self.children: set[int] = set()  # process groups of registered shell processes
        threading.Thread(target=self._watch, daemon=True, name="piwf-host-watch").start()

    def _watch(self) -> None:
        """Wait for the host's end of the pipe to close, whatever the main thread is doing
        (answers are read by the main thread; this one only hears the hang-up)."""
        poller = select.poll()
        poller.register(self._read_fd, 0)  # no events asked: only hang-up and errors wake it
        while True:
            for _, event in poller.poll():
                if event & (select.POLLHUP | select.POLLERR | select.POLLNVAL):
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
        while not self._lines:
            chunk = os.read(self._read_fd, 65536)
            if not chunk:
                self._host_gone()
            self._lines.extend(self._buffer.feed(chunk))
        return self._lines.pop(0)

    def rebind(self, worker_id: str, generation: int) -> None:
        """A warm worker's next run: its messages carry that run's claim from here on."""
        with self._turn:
            self.worker_id, self.generation, self.revision = worker_id, generation, 0
            self.children.clear()

    def tell(self, message: msgspec.Struct) -> None:
        """Send one line that is not a request (a warm worker's ``worker.idle``)."""
        with self._turn:
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
