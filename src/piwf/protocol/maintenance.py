"""The host protocol's operations on ended runs: ``run.retry`` (a failed or timed-out run
continues) and ``run.prune`` (ended runs deleted, as ``piwf serve --retain`` does).

Imported by ``piwf.protocol`` (which re-exports every name here and puts the requests in
its union); import them from there.
"""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta, Struct

from piwf.protocol.host import NoPayload, Request, RunRequest

__all__ = [
    "DEFAULT_BUDGET_MS", "MAINTENANCE_REQUESTS", "PRUNE_REQUEST_RUNS", "PruneReceipt", "PruneRuns",
    "PruneRunsPayload", "RetryReceipt", "RetryRun",
]

MAX_RETENTION_MS = 100 * 365 * 24 * 3600 * 1000
DEFAULT_BUDGET_MS = 5_000  # one run.prune answers after about this long, saying whether more remains
MAX_BUDGET_MS = 600_000
PRUNE_REQUEST_RUNS = 1000  # and after this many runs at most, whatever the budget


class PruneRunsPayload(NoPayload, frozen=True):
    olderThanMs: Annotated[int, Meta(ge=1, le=MAX_RETENTION_MS,
                                     description="delete runs that ended at least this long ago (ms)")]
    dryRun: Annotated[bool, Meta(description="count what would be deleted; delete nothing")] = False
    budgetMs: Annotated[int, Meta(ge=0, le=MAX_BUDGET_MS,
                                  description="answer after the batch that ends past this long (ms), with "
                                              "`more` if more remains (0: after one batch)")] = DEFAULT_BUDGET_MS
    sweepAfter: Annotated[str, Meta(max_length=200), Meta(description="go on with the sweep of stored values after "
                                                                      "this one: a previous receipt's "
                                                                      "`sweepAfter`")] | None = None


class RetryReceipt(Struct):
    runId: str
    status: Annotated[str, Meta(description="`queued`")]
    retriedFrom: Annotated[str, Meta(description="the status it had: `failed` or `timed_out`")]
    node: Annotated[str | None, Meta(description="the node that failed, where the run continues")]
    generation: Annotated[int, Meta(description="the run's new generation")]
    reopenedEffects: Annotated[list[str], Meta(description="effects whose apply() had raised: applied again")]
    definitionDigest: Annotated[str, Meta(description="the workflow it continues with: the file as it is now")]


class PruneReceipt(Struct):
    dryRun: bool
    endedBefore: Annotated[str, Meta(description="the cut-off: runs that ended before it")]
    runs: Annotated[int, Meta(description="runs deleted (with `dryRun`: that would be deleted now)")]
    blobs: Annotated[int, Meta(description="stored values no remaining run uses, deleted (0 with `dryRun`)")]
    runIds: Annotated[list[str], Meta(description="the oldest of those runs, at most 20")]
    more: Annotated[bool, Meta(description="more remains to delete: send the request again (with a new "
                                           "`requestId`, and `sweepAfter`) to go on")] = False
    sweepAfter: Annotated[str | None, Meta(description="where the sweep of stored values stopped (with `more`)")] = (
        None)


class RetryRun(RunRequest, tag="run.retry"):
    """Continue a failed or timed-out run as the same run from the node that failed: its
    accepted steps and applied effects are kept; it is queued with a new generation."""

    receipt_type = RetryReceipt


class PruneRuns(Request, tag="run.prune"):
    """Delete runs that ended long enough ago, in batches (never a run that has not ended, nor
    a controller's child run while its resource exists); answered after ``budgetMs`` or 1,000
    runs, with ``more`` when more remains."""

    payload: PruneRunsPayload
    receipt_type = PruneReceipt


MAINTENANCE_REQUESTS = (RetryRun, PruneRuns)
