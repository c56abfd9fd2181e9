"""Fences by the host's own clock (DESIGN.md §11, docs/operations.md "Several hosts"): no
work goes on past a time at which the store might already have let its claim go.

A claim expires in the store at the ``now`` of its last renewal plus its lease, and so does
the host lease. The host knows when each transaction that set one *began* (trio's clock:
monotonic, and the test's ``autojump_clock``), so it knows a time before which the store
cannot have let it go, and keeps a third of the lease as margin:

    work is vouched for until  min(its claim set at + 2/3 of the claim lease,
                                   the host lease set at + 2/3 of the host lease)

Past that, the work is stopped at once, with no grace (there is no time for one): its
worker's process group and the groups it registered are SIGKILLed (by the identity the
host read when they were registered, even while a store call of its supervisor cannot
return), its scope cancelled with ``StopReason.UNRENEWED``, and the reason is written in
the worker's record and the log. A host whose own lease is past its bound claims nothing
and, once its work has left, joins again with a new epoch (host/host.py, ``_heartbeat``).

Workers are told the same bound: the pump sends ``host.heartbeat`` lines carrying it as a
time of the machine's monotonic clock, and a worker that is not vouched for past it (a
frozen host) stops itself (worker/channel.py).

All of this applies to a store several hosts share (PostgreSQL, or ``HostConfig.fence``):
on SQLite the state directory's lock keeps any other host out while this one lives.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from typing import Any

import trio

from piwf import processes
from piwf.status import StopReason
from piwf.host.lane_state import Active
from piwf.host.state import HostState, log

FRACTION = 2 / 3  # of a lease: how long after its renewal began the host still vouches for a claim
RENEWALS = 6  # per lease: claims and the host lease are renewed every sixth of theirs


def renew_period_s(lease_ms: int) -> float:
    """How often a claim or lease of ``lease_ms`` is renewed: a sixth of it, so that two
    renewals in a row may fail (a blip of the store, a lock timeout) and the work is still
    vouched for by the one before (``FRACTION`` is four periods)."""
    return lease_ms / 1000 / RENEWALS
BEATS = 12  # heartbeats to a worker per (shortest) lease: a few missed ones do not stop it


def good_until(began: float, lease_ms: int) -> float:
    """The trio time until which a claim (or lease) set by a transaction that began at
    ``began`` is vouched for."""
    return began + lease_ms / 1000 * FRACTION


def vouched_until(host: HostState, active: Active[Any]) -> float:
    """Until when (trio time) the host vouches for ``active``'s claim: inf when not fenced."""
    if not host.fenced:
        return math.inf
    return min(active.good_until, host.lease_good_until)


def lease_good(host: HostState) -> bool:
    """Whether the host lease is within its bound (always, when not fenced)."""
    return not host.fenced or trio.current_time() < host.lease_good_until


def beat_period_s(host: HostState, lease_ms: int) -> float:
    return min(lease_ms, host.config.host_lease_ms) / 1000 / BEATS


def monotonic_ms(at: float) -> int:
    """The trio time ``at`` as the machine's monotonic clock, in ms (what a worker reads)."""
    return int((time.monotonic() + (at - trio.current_time())) * 1000)


def launch_bound(host: HostState, active: Active[Any], lease_ms: int) -> tuple[int, int]:
    """What the launch envelope says to bound a worker's wait for its host (0, 0 when not
    fenced): the claim's lease (``claimLeaseMs``), and until when the host vouches for the
    claim now (``vouchedUntilMs``), however long the worker then takes to start."""
    if not host.fenced:
        return 0, 0
    until = vouched_until(host, active)
    return lease_ms, max(1, monotonic_ms(until)) if until < math.inf else 0


def unrenewed_note(host: HostState, active: Active[Any], lease_ms: int) -> str:
    if trio.current_time() >= host.lease_good_until:
        what, lease = "the host lease", host.config.host_lease_ms
    else:
        what, lease = "its claim", lease_ms
    return (f"stopped: {what} could not be renewed for {lease * FRACTION / 1000:.3g} s of its {lease / 1000:g} s "
            "lease; stopped before it could expire in the store")


def kill_now(active: Active[Any]) -> None:
    """SIGKILL the work's worker group and the groups it registered, by the identities read
    when they started (nothing is signalled once the worker is reaped: ``active.kill`` is
    cleared first)."""
    if active.kill is not None:
        active.kill()
    for pid, identity in list(active.groups.items()):
        processes.kill_recorded_group(pid, identity)


async def serve_fence(host: HostState, works: dict[str, Active[Any]], lease_ms: int, kind: str) -> None:
    """Stop the work in ``works`` (a lane's active work) once the host no longer vouches for
    it; woken by ``host.fence_changed`` (a claim, a renewal, a new host lease) and at the
    earliest bound."""
    if not host.fenced:
        return
    while True:
        now = trio.current_time()
        for active in _past(host, works.values(), now):
            note = unrenewed_note(host, active, lease_ms)
            log.warning("%s: %s", active.label, note)
            active.unrenewed = True
            kill_now(active)
            active.stop(StopReason.UNRENEWED, note)
        bounds = [vouched_until(host, a) for a in works.values() if not a.unrenewed]
        next_at = min([now + lease_ms / 1000 / BEATS, *bounds])
        with trio.move_on_at(next_at):
            await host.fence_changed.wait()


def _past(host: HostState, works: Iterable[Active[Any]], now: float) -> list[Active[Any]]:
    return [a for a in works if not a.unrenewed and vouched_until(host, a) <= now]
