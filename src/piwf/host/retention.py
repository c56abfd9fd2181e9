"""Ended runs, on the host: ``run.retry`` (a failed or timed-out run continues) and
retention — ``run.prune`` once, and ``piwf serve --retain DUR`` on a timer.

Pruning goes in batches (``RetentionStore.prune_runs``: a bounded transaction each) with a
checkpoint between them, so a host with 100,000 runs to delete keeps serving while it does.
``run.prune`` does its batches in its ``prepare`` step (outside the command log's unit of
work, which then records the totals): a retried request is answered from the log; one
carried out twice (a crash between the batches and the record) only deletes what is due.
It answers after its ``budgetMs`` (or 1,000 runs) with ``more`` when more remains, so no
request outlasts its client's timeout: ``piwf prune`` asks again until nothing remains.
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import NamedTuple

import trio
import trio_util

from piwf.errors import PiwfError
from piwf.protocol import PRUNE_REQUEST_RUNS, PruneReceipt, PruneRuns, RetryReceipt, RetryRun
from piwf.status import UNSUCCESSFUL, RunStatus
from piwf.store.api import UnitOfWork
from piwf.wire import HostResponse, Outcome
from piwf.host import settings_operations
from piwf.host.catalog import WorkflowInfo
from piwf.host.operation_types import After, Writes
from piwf.host.state import HostState, log

SAMPLE = 20  # run ids a prune's receipt names
SWEEP_INTERVAL_S = 600.0  # --retain looks at every blob this often at most


def retention_interval_s(retain_ms: int) -> float:
    """How often ``--retain`` looks for runs due: every minute, more often for a short retention."""
    return min(60.0, max(0.05, retain_ms / 10_000))


class Pruning(NamedTuple):
    """What a prune did: runs and blobs deleted, the first run ids, and whether more remains
    (the budget passed first; ``sweep_after``: where the sweep of blobs goes on)."""

    runs: int
    blobs: int
    sample: list[str]
    more: bool = False
    sweep_after: str | None = None


async def prune(host: HostState, older_than_ms: int, *, until: float = math.inf,
                most: int | None = None) -> Pruning:
    """Delete every run that ended ``older_than_ms`` ago or more, in batches, letting the
    host serve between them; stop after the batch that ends past ``until`` (trio time) or
    reaches ``most`` runs, with ``more`` if more remains."""
    ended_before = host.now() - older_than_ms
    runs = blobs = 0
    sample: list[str] = []
    while True:
        batch = await host.store.retention.prune_runs(ended_before=ended_before, now=host.now())
        runs += len(batch.runs)
        blobs += batch.blobs
        sample += batch.runs[:SAMPLE - len(sample)]
        if batch.runs:
            host.changed()
        if not (batch.more and batch.runs):
            return Pruning(runs, blobs, sample)
        if trio.current_time() >= until or (most is not None and runs >= most):
            return Pruning(runs, blobs, sample, more=True)
        await trio.sleep(0)  # a checkpoint: requests and workers are served between batches


async def sweep(host: HostState, *, after: str = "", until: float = math.inf) -> tuple[int, str | None]:
    """Every blob nothing uses any more, past the grace period, in batches with a checkpoint
    between them: those no prune of a run found (a replaced definition, a pruned receipt).
    Stops after the batch that ends past ``until``: (deleted, the hash to go on after, or
    None once all were looked at)."""
    deleted = 0
    while True:
        gone, next_after = await host.store.retention.sweep_blobs(after=after, now=host.now())
        deleted += gone
        if next_after is None or trio.current_time() >= until:
            return deleted, next_after
        after = next_after
        await trio.sleep(0)


async def serve_retention(host: HostState, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """``--retain``: prune at start and then every ``retention_interval_s``; and sweep unused
    blobs at start and then every ``SWEEP_INTERVAL_S`` at most."""
    task_status.started()
    retain_ms = host.config.retain_ms
    if retain_ms is None:
        return
    swept_at = -math.inf
    async with contextlib.aclosing(trio_util.periodic(retention_interval_s(retain_ms))) as ticks:
        async for _ in ticks:
            try:
                runs, blobs, _, _, _ = await prune(host, retain_ms)
                if trio.current_time() - swept_at >= SWEEP_INTERVAL_S:
                    swept_at = trio.current_time()
                    blobs += (await sweep(host))[0]
            except PiwfError as exc:
                log.warning("could not delete ended runs past the retention: %s", exc)
                continue
            if runs or blobs:
                log.info("deleted %d run(s) that ended over %s ago, and %d unused blob(s)", runs,
                         describe_ms(retain_ms), blobs)


def describe_ms(ms: int) -> str:
    for unit, size in (("d", 86_400_000), ("h", 3_600_000), ("m", 60_000), ("s", 1000)):
        if ms >= size and ms % size == 0:
            return f"{ms // size}{unit}"
    return f"{ms}ms"


async def _prepare_prune(host: HostState, request: PruneRuns) -> PruneReceipt:
    payload = request.payload
    ended_before = host.now() - payload.olderThanMs
    at = _iso(ended_before)
    if payload.dryRun:
        count, ids = await host.store.retention.prunable_runs(ended_before=ended_before, sample=SAMPLE)
        return PruneReceipt(dryRun=True, endedBefore=at, runs=count, blobs=0, runIds=ids)
    until = trio.current_time() + payload.budgetMs / 1000
    done = await prune(host, payload.olderThanMs, until=until, most=PRUNE_REQUEST_RUNS)
    blobs, sweep_after = done.blobs, payload.sweepAfter
    if not done.more:  # the runs first, then the blobs nothing uses, from where the last request stopped
        swept, sweep_after = await sweep(host, after=sweep_after or "", until=until)
        blobs += swept
    return PruneReceipt(dryRun=False, endedBefore=at, runs=done.runs, blobs=blobs, runIds=done.sample,
                        more=done.more or sweep_after is not None, sweepAfter=sweep_after)


async def _run_prune(host: HostState, tx: UnitOfWork, request: PruneRuns, receipt: PruneReceipt,
                     after: After) -> HostResponse:
    return HostResponse(request.requestId, Outcome.ACCEPTED, receipt=receipt)


async def _prepare_retry(host: HostState, request: RetryRun) -> WorkflowInfo | None:
    """The run continues with its workflow as it is now (a retry usually follows a fix);
    one that no longer loads is refused with the reason, and the run stays as it was. A run
    that cannot be retried is refused by the store, for its status (None: nothing loaded)."""
    if (await host.store.runs.run_summary(request.runId)).status not in UNSUCCESSFUL - {RunStatus.CANCELLED}:
        return None
    workflow, project, _, _, _ = await host.store.runs.run_source(request.runId)
    return await host.catalog.inspect(project, workflow)


async def _run_retry(host: HostState, tx: UnitOfWork, request: RetryRun, info: WorkflowInfo | None,
                     after: After) -> HostResponse:
    now = host.now()
    done = await tx.runs.retry_run(request.runId, now, actor=request.clientId,
                                   expected_revision=request.expectedRevision,
                                   definition=None if info is None else info.definition())
    if info is not None:  # the workflow as it is now may declare settings the run did not have
        await settings_operations.start_scope(tx, request.runId, info, None, actor_id=request.clientId, now=now)
    after.append(host.wake)
    return HostResponse(request.requestId, Outcome.ACCEPTED, revision=done["revision"], receipt=RetryReceipt(
        runId=done["runId"], status=done["status"], retriedFrom=done["retriedFrom"], node=done["node"],
        generation=done["generation"], reopenedEffects=done["reopenedEffects"],
        definitionDigest=done["definitionDigest"]))


def _iso(ms: int) -> str:
    """As receipts write times: ``2026-11-30T09:27:40.123Z``."""
    seconds, millis = divmod(ms, 1000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{millis:03d}Z"


WRITES: Writes = {
    RetryRun: (_prepare_retry, _run_retry),
    PruneRuns: (_prepare_prune, _run_prune),
}
