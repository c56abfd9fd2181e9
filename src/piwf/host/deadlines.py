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

from .. import faults
from ..errors import PiwfError
from ..store import interactions
from .state import HostState, log

RETRY_S = 1.0  # after a store error (a full disk): try again this soon


async def serve_deadlines(host: HostState, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    task_status.started()
    while True:
        host.wake_deadlines = trio.Event()
        try:
            wait_s = _expire_due(host)
        except PiwfError as exc:
            log.warning("could not close expired requests (%s); will retry", exc)
            wait_s = RETRY_S
        with trio.move_on_after(wait_s):
            await host.wake_deadlines.wait()


def _expire_due(host: HostState) -> float:
    """Close what is due; how long until the next deadline (inf: none)."""
    closed = interactions.expire_due(host.db, host.now())
    if closed:
        faults.point("host.deadline.committed")
        log.info("closed %d request(s) at their deadline: %s", len(closed), ", ".join(closed))
        host.changed()
        host.wake()
    nearest = interactions.next_deadline(host.db)
    if nearest is None:
        return math.inf
    return max(0.0, (nearest - host.now()) / 1000)
