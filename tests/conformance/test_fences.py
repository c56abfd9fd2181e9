"""Every write a run's claim fences, under a stale token: refused, and nothing changed.

The stale token is the realistic one: the claim of an earlier generation, whose lease
expired and whose run was claimed again (by this host or another). Each write is tried
with it against a run whose new claim holds a running attempt; the run, its events, the
counts, its requests and what it told its session read the same afterwards.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from piwf.clock import ManualClock
from piwf.errors import ClaimLost
from piwf.protocol.worker import InteractionOpenPayload
from piwf.status import NotificationKind

from .controllers import LEASE as CONTROLLER_LEASE
from .controllers import C, P, apply
from .controllers import claim as claim_due
from .helpers import LEASE, claim, new_run

Write = Callable[[Any, str, str, int], Awaitable[Any]]  # (store, token, live attempt id, now) -> result

REFUSED: dict[str, Write] = {
    "queue.fenced_revision": lambda s, t, a, now: s.queue.fenced_revision("r1", t, now),
    "queue.mark_running": lambda s, t, a, now: s.queue.mark_running("r1", t, now),
    "queue.complete_run": lambda s, t, a, now: s.queue.complete_run("r1", t, {"x": 1}, now),
    "queue.fail_run": lambda s, t, a, now: s.queue.fail_run("r1", t, {"type": "E", "message": "m"}, now),
    "runs.start_attempt": lambda s, t, a, now: s.runs.start_attempt("r1", t, seq=1, node="b", generation=1, now=now),
    "runs.accept_attempt": lambda s, t, a, now: s.runs.accept_attempt("r1", t, attempt_id=a, output=1,
                                                                      exit_name="next", now=now),
    "runs.fail_attempt": lambda s, t, a, now: s.runs.fail_attempt("r1", t, attempt_id=a,
                                                                  error={"type": "E", "message": "m"}, now=now),
    "interactions.open_request": lambda s, t, a, now: s.interactions.open_request(
        "r1", t, InteractionOpenPayload(attemptId=a, kind="ask", title="?"), now),
    "interactions.park_again": lambda s, t, a, now: s.interactions.park_again("r1", t, now),
    "delivery.notify": lambda s, t, a, now: s.delivery.notify("r1", t, attempt_id=a, index=1,
                                                              kind=NotificationKind.PROGRESS, content="hi", now=now),
    "delivery.request_presentation": lambda s, t, a, now: s.delivery.request_presentation(
        "r1", t, instructions="show", now=now),
    "updates.publish": lambda s, t, a, now: s.updates.publish("r1", t, attempt_id=a, type="p", key="k", data=1,
                                                              now=now),
}
# Writes that answer a stale token with a result instead of ClaimLost.
DECLINED: dict[str, tuple[Write, Any]] = {
    "queue.park_run": (lambda s, t, a, now: s.queue.park_run("r1", t, now), False),
    "queue.cancel_run": (lambda s, t, a, now: s.queue.cancel_run("r1", now, token=t), False),
    "queue.renew_claims": (lambda s, t, a, now: s.queue.renew_claims([("r1", t)], LEASE, now), {"r1"}),
}


async def stale_and_live(store: Any, clock: ManualClock) -> tuple[str, str]:
    """(the stale token, the live attempt) of a run claimed twice, in session s1."""
    await new_run(store, clock, session="s1")
    old = await claim(store, clock)
    await store.runs.start_attempt("r1", old.token, seq=0, node="a", generation=old.generation, now=clock.now_ms())
    clock.advance(LEASE)
    new = await claim(store, clock)
    attempt, _ = await store.runs.start_attempt("r1", new.token, seq=0, node="a", generation=new.generation,
                                                now=clock.now_ms())
    return old.token, attempt


async def snapshot(store: Any, clock: ManualClock) -> tuple[Any, ...]:
    now = clock.now_ms()
    return (await store.runs.get_run("r1", now), await store.runs.run_events("r1"),
            await store.runs.status_counts(now), await store.runs.accepted_steps("r1"),
            await store.interactions.list_requests(run_id="r1", open_only=False, now=now),
            await store.delivery.list_notifications(session_id="s1", run_id=None, limit=100, now=now),
            await store.delivery.list_turns(session_id="s1", run_id=None, limit=100, now=now),
            await store.updates.last_event())


@pytest.mark.parametrize("name", list(REFUSED))
async def test_a_stale_claim_is_refused_and_changes_nothing(store: Any, clock: ManualClock, name: str) -> None:
    stale, attempt = await stale_and_live(store, clock)
    before = await snapshot(store, clock)
    with pytest.raises(ClaimLost):  # alone: no unit of work to roll back what it wrote before refusing
        await REFUSED[name](store, stale, attempt, clock.now_ms())
    assert await snapshot(store, clock) == before
    with pytest.raises(ClaimLost):
        async with store.transaction() as tx:  # as the host carries it out: one unit of work
            await REFUSED[name](tx, stale, attempt, clock.now_ms())
    assert await snapshot(store, clock) == before


@pytest.mark.parametrize("name", list(DECLINED))
async def test_a_stale_claim_is_declined_and_changes_nothing(store: Any, clock: ManualClock, name: str) -> None:
    stale, attempt = await stale_and_live(store, clock)
    before = await snapshot(store, clock)
    write, declined = DECLINED[name]
    assert await write(store, stale, attempt, clock.now_ms()) == declined
    assert await snapshot(store, clock) == before


# --- a reconcile's claim ---------------------------------------------------------------------

RECONCILE: dict[str, tuple[Write, Any]] = {
    "controller_queue.fence": (lambda s, t, uid, now: s.controller_queue.fence(uid, t, CONTROLLER_LEASE, now),
                               ClaimLost),
    "controller_queue.renew_claims": (lambda s, t, uid, now: s.controller_queue.renew_claims(
        [(uid, t)], CONTROLLER_LEASE, now), {"uid"}),
    "controller_queue.attach_worker": (lambda s, t, uid, now: s.controller_queue.attach_worker(uid, t, 99, "x"),
                                       None),
    "controller_queue.record_failure": (lambda s, t, uid, now: s.controller_queue.record_failure(
        uid, t, error="late", delay_ms=0, now=now), None),
}


async def resource_snapshot(store: Any, clock: ManualClock) -> tuple[Any, ...]:
    return (await store.controllers.get_resource(P, C, "a", clock.now), await store.controllers.list_resources(P, C),
            await store.controllers.status_counts(clock.now), await store.controller_queue.next_due(),
            await store.controller_queue.orphaned_workers(9))


@pytest.mark.parametrize("name", list(RECONCILE))
async def test_a_stale_reconcile_claim_changes_nothing(store: Any, clock: ManualClock, name: str) -> None:
    await apply(store, clock)
    [old] = await claim_due(store, clock)
    clock.advance(CONTROLLER_LEASE + 1)
    [new] = await claim_due(store, clock)
    await store.controller_queue.attach_worker(new.uid, new.token, 7, "live")
    before = await resource_snapshot(store, clock)
    write, declined = RECONCILE[name]
    if declined is ClaimLost:
        with pytest.raises(ClaimLost):
            await write(store, old.token, old.uid, clock.now)
    else:
        result = await write(store, old.token, old.uid, clock.now)
        assert result == ({old.uid} if declined == {"uid"} else declined)
    assert await resource_snapshot(store, clock) == before


# --- a fence held earlier in the same transaction ----------------------------------------------


async def test_a_fence_earlier_in_the_unit_is_not_trusted_once_the_claim_moved_in_it(
        store: Any, clock: ManualClock) -> None:
    """A fence already held in a unit of work is not run again for the same claim
    (store/sql/base.py ``holds_claim``), but only while nothing has written run_queue since:
    a claim released earlier in the same unit refuses the writes after it, and the unit
    rolls back."""
    await new_run(store, clock, session="s1")
    live = await claim(store, clock)
    attempt, _ = await store.runs.start_attempt("r1", live.token, seq=0, node="a", generation=live.generation,
                                                now=clock.now_ms())
    before = await snapshot(store, clock)
    now = clock.now_ms()

    async def work(tx: Any) -> None:
        await tx.queue.fenced_revision("r1", live.token, now)
        assert await tx.queue.park_run("r1", live.token, now)  # the claim is gone within this unit
        await tx.runs.accept_attempt("r1", live.token, attempt_id=attempt, output=1, exit_name="next", now=now)

    with pytest.raises(ClaimLost):
        await store.run_unit(work)
    assert await snapshot(store, clock) == before

    async def fenced_twice(tx: Any) -> int:  # the same claim, fenced and then written: accepted
        await tx.queue.fenced_revision("r1", live.token, now)
        revision: int = await tx.runs.accept_attempt("r1", live.token, attempt_id=attempt, output=1,
                                                     exit_name="next", now=now)
        return revision

    assert await store.run_unit(fenced_twice) > before[0].revision


async def test_a_revision_returned_earlier_in_the_unit_is_read_again_once_another_write_moved_it(
        store: Any, clock: ManualClock) -> None:
    """``revision_of`` answers from the revision a write of the same unit returned
    (store/sql/base.py ``revised``) only while nothing naming a revision ran since."""
    await new_run(store, clock, session="s1")
    live = await claim(store, clock)
    now = clock.now_ms()

    async def work(tx: Any) -> tuple[int, int, int]:
        attempt, started = await tx.runs.start_attempt("r1", live.token, seq=0, node="a",
                                                       generation=live.generation, now=now)
        right_after = await tx.queue.revision_of("r1")
        await tx.interactions.open_request("r1", live.token, InteractionOpenPayload(
            attemptId=attempt, kind="ask", title="?"), now)  # moves the revision by a write of its own
        return started, right_after, await tx.queue.revision_of("r1")

    started, right_after, after_open = await store.run_unit(work)
    assert right_after == started
    assert after_open == (await store.runs.run_summary("r1")).revision > started
