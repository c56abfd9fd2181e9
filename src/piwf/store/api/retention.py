"""Retention: deleting ended runs (``piwf serve --retain``, ``piwf prune``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from piwf.store.api.types import Pruned

PRUNE_BATCH = 100  # runs per transaction, at most (piwf.store.sql.retention measures it)


class RetentionStore(Protocol):
    """Ended runs deleted with their steps, events, workers, requests, notifications, turns,
    follow-ups, updates and settings, and the blobs no remaining row uses. Never a run that
    has not ended (engine and queue status both ended, checked by the deleting write: a run
    retried meanwhile stays), nor a controller's child run while its resource exists. The
    command log is kept: it answers a retried request naming a pruned run.
    """

    async def prune_runs(self, *, ended_before: int, now: int, limit: int = PRUNE_BATCH) -> Pruned:
        """Delete up to ``limit`` of the runs ended before ``ended_before`` (ms), oldest first, in one
        transaction, and the blobs they were the last to use that were not stored (or stored again) in the
        grace period before ``now`` (``rules.BLOB_GRACE_MS``). Call again while ``more``."""

    async def prunable_runs(self, *, ended_before: int, sample: int = 20) -> tuple[int, list[str]]:
        """How many runs ``prune_runs`` would delete (from one snapshot), and the ids of the ``sample`` oldest."""
