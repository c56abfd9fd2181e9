"""The worker's side of the host pipe: one request, one answer, in order.

The protocol runs on its own pipe descriptors, so user code printing to stdout cannot
corrupt it. A reader thread watches the pipe: if the host goes away (EOF), the worker's
whole process group is killed at once: a run must never go on without its host.
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import threading
from typing import Any

from .. import faults
from ..errors import ClaimLost, PiwfError
from ..wire import MAX_WORKER_LINE, LineBuffer, WorkerMessage, WorkerResponse, decode_as, encode_line


class HostRefused(PiwfError):
    code = "hostRefused"


class Channel:
    def __init__(self, read_fd: int, write_fd: int, *, worker_epoch: str, generation: int) -> None:
        self._write_fd = write_fd
        self._answers: queue.Queue[bytes | None] = queue.Queue()
        self.worker_epoch = worker_epoch
        self.generation = generation
        self.revision = 0
        self._sent = 0
        self.children: set[int] = set()  # process groups of registered shell processes
        threading.Thread(target=self._read, args=(read_fd,), daemon=True, name="piwf-host-pipe").start()

    def _read(self, fd: int) -> None:
        buffer = LineBuffer(MAX_WORKER_LINE)
        try:
            while chunk := os.read(fd, 65536):
                for line in buffer.feed(chunk):
                    self._answers.put(line)
        finally:
            # The host is gone (or broke the protocol): nothing this process does can be
            # accepted any more, so the run's shell processes and its own group go now.
            for pgid in list(self.children):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pgid, signal.SIGKILL)
            os.killpg(os.getpgid(0), signal.SIGKILL)

    def request(self, operation: str, payload: dict[str, Any] | None = None) -> Any:
        self._sent += 1
        message = WorkerMessage(
            messageId=f"m{self._sent}", workerEpoch=self.worker_epoch, generation=self.generation,
            expectedRevision=self.revision, operation=operation, payload=payload or {},
        )
        line = encode_line(message)
        if len(line) > MAX_WORKER_LINE:
            raise HostRefused(f"{operation} message is {len(line)} bytes, over the {MAX_WORKER_LINE}-byte limit")
        _write_all(self._write_fd, line)
        faults.point("worker.message.sent")
        answer = self._answers.get()
        faults.point("worker.answer.received")
        response = decode_as(answer, WorkerResponse, "host answer")
        if response.revision is not None:
            self.revision = response.revision
        if response.outcome == "claimLost":
            raise ClaimLost(response.error or "claim lost")
        if response.outcome != "accepted":
            raise HostRefused(f"host refused {operation}: {response.error}")
        return response.result


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
