"""A node that passed its time limit (host/lane.py stops its worker): its outcome, written
with the worker's end in one unit of work (run_lane.RunLane.write_end).

- A compute or shell node with a ``timeout`` exit leaves through it, output ``null``; the
  run is released for its next node at once.
- One without fails, and its run with it: the error says the limit. An effect the node
  was applying when it was stopped is unknown, so the run is held on it instead (as
  always: a run never ends with an effect whose outcome is unknown).
- An ask validating a submission writes nothing here: the worker's end refuses the
  submission ("worker ... before it completed validation") and the run waits again.

The worker was stopped before this runs, so nothing it sends can race it. A retry (the
store refused the first try) finds the claim released and writes nothing twice.
"""

from __future__ import annotations

from piwf.errors import ClaimLost
from piwf.status import Hold
from piwf.store.api import UnitOfWork
from piwf.host.lane_state import NodeClock
from piwf.host.state import ActiveRun, log

TIMEOUT_EXIT = "timeout"


async def record(tx: UnitOfWork, active: ActiveRun, clock: NodeClock, now: int) -> None:
    run_id, token = active.claim.run_id, active.claim.token
    if clock.validating:
        return
    try:
        await tx.queue.fenced_revision(run_id, token, now)
    except ClaimLost:  # recorded by an earlier try, or the run moved on (cancelled): nothing to add
        return
    if clock.timeout_exit:
        await tx.runs.accept_attempt(run_id, token, attempt_id=clock.attempt_id, output=None,
                                     exit_name=TIMEOUT_EXIT, now=now)
        await tx.queue.park_run(run_id, token, now)
        log.info("%s: node %s left through %s at its time limit", active.label, clock.node, TIMEOUT_EXIT)
        return
    error = {"type": "TimeLimit", "node": clock.node,
             "message": f"node {clock.node}: did not finish within {clock.limit_text}"}
    await tx.runs.fail_attempt(run_id, token, attempt_id=clock.attempt_id, error=error, now=now)
    # Effects this generation left applying are unknown now, like an earlier one's.
    ambiguous = await tx.effects.interrupted_before(run_id, active.claim.generation + 1, now)
    if ambiguous:
        await tx.queue.park_run(run_id, token, now, hold=Hold.EFFECT, detail=f"ambiguous effect {ambiguous[0]}")
    else:
        await tx.queue.fail_run(run_id, token, error, now)
