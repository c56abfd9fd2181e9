"""Retention: deleting ended runs (``piwf serve --retain``, ``piwf prune``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from piwf.store.api.types import Pruned

PRUNE_BATCH = 100  # runs per transaction, at most (piwf.store.sql.retention measures it)
BLOB_SWEEP = 500  # blobs looked at per transaction by a sweep


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

    async def sweep_blobs(self, *, after: str, now: int, limit: int = BLOB_SWEEP) -> tuple[int, str | None]:
        """Delete the blobs nothing names that were not stored (or stored again) in the grace period before
        ``now``, among the ``limit`` first hashes after ``after`` in hash order, in one transaction: those left
        by other changes than a prune (a definition a retry or resume replaced, a pruned command's receipt).
        Returns how many went and the hash to go on after (None: the end)."""
