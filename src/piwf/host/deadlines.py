"""The deadline timer: closes interaction requests whose deadline passed (DESIGN.md §7).

One task in the host scope. It sleeps until the nearest deadline of an idle waiting run,
or until a request is opened or goes back to waiting (``HostState.wake_deadlines``); it
never polls. Each expiry is one store transaction that closes only a request still open,
so a deadline fires exactly once however often the host crashes around it: a host that
dies before the commit leaves the request open for the next host's timer, one that dies
after it leaves it closed.
"""

from __future__ import annotations

import math

import trio

from piwf import faults
from piwf.host.state import HostState, log

RETRY_S = 1.0  # after a store error (a full disk): try again this soon, doubling up to MAX_WAIT_S
MAX_WAIT_S = 60.0  # deadlines are wall-clock times: look again at least this often (a suspend, a clock step)


async def serve_deadlines(host: HostState, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    task_status.started()
    failures = 0
    while True:
        host.wake_deadlines = trio.Event()
        try:
            wait_s = await _expire_due(host)
            failures = 0
        except Exception as exc:  # a full disk, or a bug: it costs the deadlines a delay, never the host
            failures += 1
            wait_s = min(MAX_WAIT_S, RETRY_S * 2 ** (failures - 1))
            log.warning("could not close expired requests (%s: %s); trying again in %.0f s",
                        type(exc).__name__, exc, wait_s)
        with trio.move_on_after(min(wait_s, MAX_WAIT_S)):
            await host.wake_deadlines.wait()


async def _expire_due(host: HostState) -> float:
    """Close what is due; how long until the next deadline (inf: none). A request that
    cannot be closed (a damaged record) is retried after the back-off, the others closed."""
    nearest = await host.store.interactions.next_deadline()
    if nearest is None:
        return math.inf
    if nearest > host.now():
        return (nearest - host.now()) / 1000
    faults.point("host.deadline.due")
    closed, failed = await host.store.interactions.expire_due(host.now())
    if closed:
        faults.point("host.deadline.committed")
        log.info("closed %d request(s) at their deadline: %s", len(closed), ", ".join(closed))
        host.changed()
        host.wake()
    if failed:
        raise failed[0][1]
    nearest = await host.store.interactions.next_deadline()
    return math.inf if nearest is None else max(0.0, (nearest - host.now()) / 1000)
