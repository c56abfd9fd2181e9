"""Group commit at ``full`` durability.

Each store operation still commits its own transaction, at once and without an fsync
(``Database.defer_sync``); whoever answers for it (a client's reply, a worker's answer)
first awaits ``durable()``. The syncer fsyncs the WAL, covering every commit made before
it started; commits made meanwhile wait for the next fsync. So messages that arrive
together share one fsync, and nothing is answered before its data is durable.

The fsync runs on a thread of its own, so the event loop never waits on the disk. The
thread is woken through a pipe and answers through another, which the loop waits on like
any descriptor: about 140 µs of CPU per fsync here, against 270 µs through
``trio.to_thread`` and 100 µs for an fsync on the loop itself (bench/README.md).

At ``normal`` durability nothing is fsynced per commit (SQLite's own meaning of it) and
``durable()`` returns at once.
"""

from __future__ import annotations

import os
import sys
import threading

import trio

from piwf import faults
from piwf.errors import StorageUnavailable
from piwf.store.sqlite.db import Database

FAILED = sys.maxsize  # the synced mark once an fsync failed: every waiter wakes and raises


class GroupCommit:
    def __init__(self, db: Database) -> None:
        self.db = db
        self.enabled = db.durability == "full"
        if self.enabled:
            db.defer_sync()
        self._synced = db.written()  # every commit up to this mark is durable
        self._syncing = self._synced  # every commit up to this mark is durable once the fsync under way returns
        self._fsynced = trio.Event()  # set after each fsync (then replaced): waiters look at the mark again
        self._wanted = trio.Event()
        self.failure: StorageUnavailable | None = None
        self.fsyncs = 0  # statistics: how many groups were synced

    async def durable(self) -> None:
        """Return once everything this connection committed so far is durable (raises
        StorageUnavailable if an fsync failed: then nothing more is ever answered as
        durable). Call it after the commit, before the answer: it covers every commit made
        before the call (checkpoints in between only make it wait for more)."""
        if not self.enabled:
            return
        target = self.db.written()
        while self._synced < target:  # (an Event, not an AsyncValue and its predicates: 4 waits a run)
            if self._syncing < target:  # no fsync under way covers it: ask for the next one
                self._wanted.set()
            await self._fsynced.wait()
        if self.failure is not None:
            raise self.failure

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The syncer: one fsync at a time, each covering every commit made before it."""
        if not self.enabled:
            task_status.started()
            return
        with _SyncThread(self.db) as thread:
            task_status.started()
            while True:
                if not self._wanted.is_set():  # idle: wait for a commit, then for this tick's others
                    await self._wanted.wait()
                    await trio.sleep(0)  # the tasks ready to run now commit first and share this fsync
                # (else commits came during the last fsync and have waited for it: sync them at once,
                # not two loop ticks later; what commits meanwhile shares the fsync after)
                self._wanted = trio.Event()
                target = self._syncing = self.db.written()
                faults.point("host.group.syncing")
                error = await thread.sync()
                if error is not None:
                    self._fail(error)
                faults.point("host.group.synced")
                self.fsyncs += 1
                self._synced = target
                self._wake()

    def _fail(self, error: OSError) -> None:
        self.failure = StorageUnavailable(f"fsync of {self.db.path}-wal failed ({error.strerror}); what was "
                                          "committed since the last fsync may be lost: restart the host")
        self._synced = FAILED
        self._wake()
        raise self.failure from error

    def _wake(self) -> None:
        fsynced, self._fsynced = self._fsynced, trio.Event()
        fsynced.set()


class _SyncThread:
    """A thread that runs ``db.sync_wal`` each time it is asked, through two pipes."""

    def __init__(self, db: Database) -> None:
        self._db = db
        self._ask_r, self._ask_w = os.pipe2(os.O_CLOEXEC)
        self._done_r, self._done_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._error: OSError | None = None
        self._thread = threading.Thread(target=self._run, name="piwf-fsync", daemon=True)

    def __enter__(self) -> _SyncThread:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self._ask_w)  # the thread reads the end, after the fsync it may be in
        self._thread.join()
        for fd in (self._ask_r, self._done_r, self._done_w):
            os.close(fd)

    async def sync(self) -> OSError | None:
        os.write(self._ask_w, b"s")
        while True:
            await trio.lowlevel.wait_readable(self._done_r)
            try:
                os.read(self._done_r, 1)
            except BlockingIOError:
                continue
            return self._error

    def _run(self) -> None:
        while os.read(self._ask_r, 1):
            try:
                self._db.sync_wal()
            except OSError as exc:
                self._error = exc
            os.write(self._done_w, b"d")
