"""``run.output``: what a live worker prints, after an offset, long-polling for more.

The host keeps the last 64 KiB of each worker's output while it runs (and of the last
workers that ended: ``worker_process.OUTPUTS``); a reader sends the offset it has seen
and is answered with what came after it, or waits (``timeoutMs``) until something does
or the worker ends.
"""

from __future__ import annotations

import trio

from piwf.host.delivery import WATCH_ENDS_EARLY
from piwf.host.operation_types import Reads
from piwf.host.state import HostState
from piwf.host.worker_process import OUTPUTS, Diagnostics
from piwf.protocol import GetRunOutput, RunOutput


async def _run_output(host: HostState, request: GetRunOutput) -> RunOutput:
    payload = request.payload
    await host.store.runs.revision(request.runId)  # notFound for an unknown run
    worker, output = _find(host, request.runId, payload.workerEpoch)
    with WATCH_ENDS_EARLY.get() or trio.CancelScope(), trio.move_on_after(payload.timeoutMs / 1000):
        while output is None and _starting(host, request.runId, worker):  # its output is not read yet
            await OUTPUTS.added.wait()
            worker, output = _find(host, request.runId, worker)
        while output is not None and not output.closed and output.total <= payload.after:
            await output.changed.wait()
    if output is None:
        live = _starting(host, request.runId, worker)
        return RunOutput(workerEpoch=worker, live=live, offset=payload.after, next=payload.after, dropped=0, text="")
    after = min(payload.after, output.total)
    start, data = output.since(after)
    return RunOutput(workerEpoch=worker, live=not output.closed, offset=start, next=start + len(data),
                     dropped=start - after, text=data.decode(errors="replace"))


def _starting(host: HostState, run_id: str, worker: str | None) -> bool:
    """Whether ``worker`` is the run's worker here, started but not yet read."""
    active = host.active.get(run_id)
    return worker is not None and active is not None and active.worker_id == worker


def _find(host: HostState, run_id: str, worker: str | None) -> tuple[str | None, Diagnostics | None]:
    """The worker asked for (else the run's live one here) and its output, if kept."""
    if worker is None:
        active = host.active.get(run_id)
        worker = active.worker_id if active is not None else None
    return worker, (OUTPUTS.get(worker, run_id) if worker is not None else None)


READS: Reads = {GetRunOutput: _run_output}
