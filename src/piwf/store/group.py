"""Group commit at ``full`` durability.

Each store operation still commits its own transaction, at once and without an fsync
(``Database.defer_sync``); whoever answers for it (a client's reply, a worker's answer)
first awaits ``durable()``. One syncer task fsyncs the WAL in a thread, covering every
commit made before it started; commits made meanwhile wait for the next fsync. So
messages that arrive together share one fsync, the event loop never waits on the disk,
and nothing is answered before its data is durable.

At ``normal`` durability nothing is fsynced per commit (SQLite's own meaning of it) and
``durable()`` returns at once.
"""

from __future__ import annotations

import sys

import trio
import trio_util

from .. import faults
from ..errors import StorageUnavailable
from .db import Database

FAILED = sys.maxsize  # the synced mark once an fsync failed: every waiter wakes and raises


class GroupCommit:
    def __init__(self, db: Database) -> None:
        self.db = db
        self.enabled = db.durability == "full"
        if self.enabled:
            db.defer_sync()
        self._synced = trio_util.AsyncValue(db.written())
        self._wanted = trio.Event()
        self.failure: StorageUnavailable | None = None
        self.fsyncs = 0  # statistics: how many groups were synced

    async def durable(self) -> None:
        """Return once everything this connection committed so far is durable (raises
        StorageUnavailable if an fsync failed: then nothing more is ever answered as
        durable). Call it with no checkpoint between the commit and this call."""
        if not self.enabled:
            return
        target = self.db.written()
        if self._synced.value < target:
            self._wanted.set()
            await self._synced.wait_value(lambda synced: synced >= target)
        if self.failure is not None:
            raise self.failure

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The syncer: one fsync at a time, each covering every commit made before it."""
        task_status.started()
        if not self.enabled:
            return
        while True:
            await self._wanted.wait()
            self._wanted = trio.Event()
            target = self.db.written()
            faults.point("host.group.syncing")
            try:
                await trio.to_thread.run_sync(self.db.sync_wal)
            except OSError as exc:
                self.failure = StorageUnavailable(f"fsync of {self.db.path}-wal failed ({exc.strerror}); what was "
                                                  "committed since the last fsync may be lost: restart the host")
                self._synced.value = FAILED
                raise self.failure from exc
            faults.point("host.group.synced")
            self.fsyncs += 1
            self._synced.value = target
