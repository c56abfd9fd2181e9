"""What only several writers can show (PostgreSQL, READ COMMITTED): the people and
controller aggregates' fences, claims and compare-and-sets under two stores on one
database, as deterministic interleavings — A's transaction has written and stays open, B
starts the same kind of write (and is seen waiting for A's lock), A commits, B goes on —
so B's answer is the one SQLite's single writer gives (store/sql/locks.py).

SQLite has one writer at a time (B would wait for A's BEGIN IMMEDIATE on the trio loop
itself): these run on PostgreSQL only.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import trio

from piwf.clock import ManualClock
from piwf.errors import Conflict, Rejected
from piwf.protocol import UpdateAction

from . import controllers as ctl
from .helpers import LEASE, new_run, running
from .test_interactions import answer, asking, submit


# Only PostgreSQL: SQLite has one writer at a time, there is no interleaving to show.
pytestmark = pytest.mark.parametrize("backend", ["postgresql"], indirect=True)


@pytest.fixture
async def two(open_store: Any) -> tuple[Any, Any]:
    """Two stores on one database: two hosts' views of it."""
    return await open_store(), await open_store()


async def waiting_for_a_lock(backend: Any, count: int = 1) -> None:
    """Until ``count`` connections of the server wait for a lock (the observable state of
    B blocked behind A's open transaction)."""
    with trio.fail_after(10):
        while await backend.lock_waits() < count:
            await trio.sleep(0.01)


async def interleave(backend: Any, first: Callable[[Any], Awaitable[Any]], a: Any,
                     second: Callable[[], Awaitable[Any]]) -> tuple[Any, Any]:
    """A runs ``first`` in a unit of work and keeps it open; B runs ``second`` meanwhile and
    is seen blocked; A commits; B's result (or the error it raised) comes back with A's."""
    outcome: dict[str, Any] = {}

    async def run_second() -> None:
        try:
            outcome["b"] = await second()
        except Exception as exc:
            outcome["b"] = exc

    async with trio.open_nursery() as nursery, a.transaction() as tx:
        outcome["a"] = await first(tx)
        nursery.start_soon(run_second)
        await waiting_for_a_lock(backend)
    return outcome["a"], outcome["b"]


# --- decisions and asks --------------------------------------------------------------------


async def test_two_answers_at_once_the_first_wins_and_the_second_is_told_so(two: Any, backend: Any,
                                                                           clock: ManualClock) -> None:
    a, b = two
    request_id, _token, _attempt = await asking(a, clock)
    won, lost = await interleave(backend, lambda tx: answer(tx, clock, request_id, by="ann"), a,
                                 lambda: answer(b, clock, request_id, by="bob"))
    assert won.choice == "yes"
    assert isinstance(lost, Conflict) and "already answered" in str(lost) and "by ann" in str(lost)
    events = [e.type for e in (await a.runs.run_events("r1", after=0, limit=100)).events]
    assert events.count("decision.answered") == 1


async def test_two_hosts_timers_at_a_deadline_close_the_request_once_and_quietly(two: Any, backend: Any,
                                                                                 clock: ManualClock) -> None:
    from piwf.protocol import DefaultAnswer

    a, b = two
    request_id, _token, _attempt = await asking(a, clock, deadlineMs=1000, default=DefaultAnswer("yes"))
    clock.advance(1000)
    closed, again = await interleave(backend, lambda tx: tx.interactions.expire_due(clock.now_ms()), a,
                                     lambda: b.interactions.expire_due(clock.now_ms()))
    assert closed == ([request_id], [])
    assert again == ([], [])  # seen closed under the run's lock: not a failure to log and retry
    events = [e.type for e in (await a.runs.run_events("r1", after=0, limit=100)).events]
    assert events.count("decision.answered") == 1


async def test_an_answer_and_a_cancel_at_once_both_hold(two: Any, backend: Any, clock: ManualClock) -> None:
    a, b = two
    request_id, _token, _attempt = await asking(a, clock)
    _, cancelled = await interleave(backend, lambda tx: answer(tx, clock, request_id), a,
                                    lambda: b.queue.cancel_run("r1", clock.now_ms()))
    assert cancelled is True  # not a Conflict from closing a request the answer closed
    found = (await a.interactions.list_requests(run_id="r1", open_only=False, now=clock.now_ms()))[0]
    assert found.status == "settled" and found.resolution.choice == "yes"
    assert (await a.runs.run_summary("r1")).status == "cancelled"


async def test_a_cancel_then_an_answer_the_answer_is_refused(two: Any, backend: Any, clock: ManualClock) -> None:
    a, b = two
    request_id, _token, _attempt = await asking(a, clock)
    _, refused = await interleave(backend, lambda tx: tx.queue.cancel_run("r1", clock.now_ms()), a,
                                  lambda: answer(b, clock, request_id))
    assert isinstance(refused, Rejected) and "cancelled" in str(refused)


async def test_two_submissions_at_once_one_is_validated(two: Any, backend: Any, clock: ManualClock) -> None:
    a, b = two
    request_id, _token, _attempt = await asking(a, clock, kind="ask")
    first, second = await interleave(backend, lambda tx: submit(tx, clock, request_id, 1), a,
                                     lambda: submit(b, clock, request_id, 2))
    assert first.startswith("sub-")
    assert isinstance(second, Conflict) and "being validated" in str(second)


async def test_presentation_claims_at_once_one_client_presents(two: Any, backend: Any, clock: ManualClock) -> None:
    a, b = two
    request_id, _token, _attempt = await asking(a, clock)

    def present(store: Any, client: str) -> Awaitable[Any]:
        return store.interactions.update(request_id=request_id, expected_revision=1, action=UpdateAction.CLAIM,
                                         client_id=client, entry_id=None, progress=None, lease_ms=LEASE,
                                         now=clock.now_ms())

    won, lost = await interleave(backend, lambda tx: present(tx, "c1"), a, lambda: present(b, "c2"))
    assert won.presenter == "c1"
    assert isinstance(lost, Conflict)


# --- settings --------------------------------------------------------------------------------


async def with_settings(store: Any, clock: ManualClock) -> str:
    from piwf.store.api import NewScope

    await store.runs.create_run(run_id="r1", workflow="w", project_path="/p", source=b"src", digest="d1",
                                input={}, origin_session_id=None, now=clock.now_ms(),
                                settings=NewScope(settings={"n": 0}, mutable=["n"]))
    return (await store.settings.get_settings("r1")).scopeId


def change(store: Any, clock: ManualClock, scope: str, n: int, key: str | None = None) -> Awaitable[Any]:
    return store.settings.change_settings("r1", scope_id=scope, base=0, expected=None, patch={"n": n},
                                          settings={"n": n}, actor="client", actor_id="ann",
                                          now=clock.now_ms(), request_key=key)


async def test_two_settings_changes_from_one_base_the_second_is_a_conflict(two: Any, backend: Any,
                                                                          clock: ManualClock) -> None:
    a, b = two
    scope = await with_settings(a, clock)
    first, second = await interleave(backend, lambda tx: change(tx, clock, scope, 1), a,
                                     lambda: change(b, clock, scope, 2))
    assert first[0].changeNumber == 1
    assert isinstance(second, Conflict)
    assert (await a.settings.get_settings("r1")).settings == {"n": 1}


async def test_one_request_key_twice_at_once_is_one_change(two: Any, backend: Any, clock: ManualClock) -> None:
    a, b = two
    scope = await with_settings(a, clock)
    first, second = await interleave(backend, lambda tx: change(tx, clock, scope, 1, key="k"), a,
                                     lambda: change(b, clock, scope, 1, key="k"))
    assert first[1] is False and second == (first[0], True)  # the second is adopted
    assert [c.changeNumber for c in (await a.settings.get_settings("r1")).changes] == [0, 1]


# --- delivery --------------------------------------------------------------------------------


async def notified(store: Any, clock: ManualClock, run_id: str, session: str, index: int = 1) -> str:
    token, attempt_id = await running(store, clock, run_id, session=session)
    found = await store.delivery.notify(run_id, token, attempt_id=attempt_id, index=index, kind="progress",
                                        content=f"{run_id} {index}", now=clock.now_ms())
    assert found is not None
    return str(found)


async def test_two_clients_claiming_a_session_at_once_one_gets_it(two: Any, backend: Any, clock: ManualClock) -> None:
    a, b = two
    notification = await notified(a, clock, "r1", "s1")

    def claim_one(store: Any, client: str) -> Awaitable[Any]:
        return store.delivery.claim_notification(session_id="s1", client_id=client, lease_ms=LEASE,
                                                 now=clock.now_ms())

    got, nothing = await interleave(backend, lambda tx: claim_one(tx, "c1"), a, lambda: claim_one(b, "c2"))
    assert got.notification.notificationId == notification
    assert nothing.claimId is None  # in order: the oldest is claimed, so nothing for c2


async def test_a_delivery_and_a_claim_after_its_expiry_at_once_deliver_once(two: Any, backend: Any,
                                                                           clock: ManualClock) -> None:
    """A delivers under its claim (open) as the claim expires; B's claim waits for the
    session's stream, then finds the notification delivered: nothing to claim, never twice."""
    a, b = two
    notification = await notified(a, clock, "r1", "s1")
    got = await a.delivery.claim_notification(session_id="s1", client_id="c1", lease_ms=1000, now=clock.now_ms())
    later = clock.now_ms() + 1000  # c1's claim has expired by then

    def deliver(tx: Any) -> Awaitable[Any]:
        return tx.delivery.deliver_notification(notification_id=notification, claim_id=got.claimId, client_id="c1",
                                                now=clock.now_ms())

    delivered, claimed = await interleave(backend, deliver, a, lambda: b.delivery.claim_notification(
        session_id="s1", client_id="c2", lease_ms=LEASE, now=later))
    assert delivered.delivered is True
    assert claimed.claimId is None  # delivered once: nothing left for c2


async def test_a_sessions_turns_are_in_the_order_they_committed(two: Any, backend: Any, clock: ManualClock) -> None:
    """Two runs of one session end at once on two hosts: the turn committed first is the
    session's first, whatever order their rows were numbered in."""
    a, b = two
    for run_id in ("r1", "r2"):  # both waiting for an answer: parked, so one session may have both
        await asking(a, clock, run_id, session="s1")
    await interleave(backend, lambda tx: tx.queue.cancel_run("r2", clock.now_ms()), a,
                     lambda: b.queue.cancel_run("r1", clock.now_ms()))
    turns = await a.delivery.list_turns(session_id="s1", run_id=None, limit=10, now=clock.now_ms())
    assert [t.runId for t in turns] == ["r2", "r1"]
    first = await a.delivery.claim_turn(session_id="s1", client_id="c", lease_ms=LEASE, now=clock.now_ms())
    assert first.turn.runId == "r2"


async def test_a_runs_end_while_its_held_turn_resolves_gets_a_turn_of_its_own(two: Any, backend: Any,
                                                                            clock: ManualClock) -> None:
    """A resolves the turn of a held run (open) as B cancels that run: B's end waits for the
    session's stream, finds the turn resolved, and writes a new one — the end is not lost
    into the resolved turn."""
    from piwf.status import Hold

    a, b = two
    token, _attempt = await running(a, clock, "r1", session="s1")
    await a.queue.park_run("r1", token, clock.now_ms(), hold=Hold.SOURCE, detail="the workflow changed")
    held = await a.delivery.claim_turn(session_id="s1", client_id="c", lease_ms=LEASE, now=clock.now_ms())
    assert held.turn.cause == "held"
    await interleave(backend, lambda tx: tx.delivery.resolve_turn(
        turn_id=held.turn.turnId, claim_id=held.claimId, client_id="c", resolution="presented", now=clock.now_ms()),
        a, lambda: b.queue.cancel_run("r1", clock.now_ms()))
    turns = await a.delivery.list_turns(session_id="s1", run_id=None, limit=10, now=clock.now_ms())
    assert [(t.runId, t.cause) for t in turns] == [("r1", "cancelled")]
    assert turns[0].turnId != held.turn.turnId


async def test_a_followup_removed_while_its_turn_resolves_is_one_or_the_other(two: Any, backend: Any,
                                                                              clock: ManualClock) -> None:
    a, b = two
    await new_run(a, clock, "r1", session="s1")
    queued = await a.delivery.queue_followup(run_id="r1", request_key="k", prompt="more", now=clock.now_ms())
    await a.queue.cancel_run("r1", clock.now_ms())
    turn = await a.delivery.claim_turn(session_id="s1", client_id="c", lease_ms=LEASE, now=clock.now_ms())
    resolved, removal = await interleave(
        backend, lambda tx: tx.delivery.resolve_turn(turn_id=turn.turn.turnId, claim_id=turn.claimId, client_id="c",
                                                     resolution="presented", now=clock.now_ms()), a,
        lambda: b.delivery.remove_followup(run_id="r1", followup_id=queued.followUpId, now=clock.now_ms()))
    assert resolved.followUpsDelivered == 1
    assert isinstance(removal, Rejected) and "already delivered" in str(removal)


# --- controllers -----------------------------------------------------------------------------


async def test_two_applies_of_a_new_key_make_one_resource(two: Any, backend: Any, clock: ManualClock) -> None:
    a, b = two
    made, again = await interleave(backend, lambda tx: ctl.apply(tx, clock, "k", {"x": 1}), a,
                                   lambda: ctl.apply(b, clock, "k", {"x": 1}))
    assert made.changed is True
    assert again.uid == made.uid and again.changed is False  # not a ConstraintViolation


async def test_claims_from_two_hosts_skip_each_others_rows(two: Any, backend: Any, clock: ManualClock) -> None:
    a, b = two
    for key in ("k1", "k2"):
        await ctl.apply(a, clock, key)
    clock.advance(1)
    async with a.transaction() as tx:
        mine = await ctl.claim(tx, clock, room=1)
        with trio.fail_after(10):  # B does not wait for A's open claim: it takes the other row
            theirs = await ctl.claim(b, clock, room=2)
    assert len(mine) == 1 and len(theirs) == 1 and mine[0].uid != theirs[0].uid


async def test_an_apply_during_a_reconcile_result_queues_it_again(two: Any, backend: Any, clock: ManualClock) -> None:
    """The result's transaction holds the resource; an apply waits for it, then bumps the
    queue version the result did not see: the new spec is reconciled once more."""
    a, b = two
    await ctl.apply(a, clock, "k", {"x": 1})
    clock.advance(1)
    [c] = await ctl.claim(a, clock)
    await ctl.start(a, clock, c)
    result, applied = await interleave(
        backend, lambda tx: settle_in(tx, clock, c), a, lambda: ctl.apply(b, clock, "k", {"x": 2}))
    assert result == "settled" and applied.changed is True
    assert (await ctl.detail(a, clock, "k")).availableAt is not None  # due again, for generation 2


async def settle_in(tx: Any, clock: ManualClock, c: Any) -> str:
    """A reconcile's last message, in the unit of work ``tx``: the fence, then its result."""
    await tx.controller_queue.fence(c.uid, c.token, ctl.LEASE, clock.now)
    result: str = await tx.controller_queue.finish_success(
        c.uid, c.token, requeue_after_ms=None, settled=True, controller_status={"ok": 1}, keep_status=False,
        conditions=[], finalizers=None, now=clock.now)
    return result


async def test_an_apply_at_a_resource_version_twice_at_once_the_second_is_a_conflict(
        two: Any, backend: Any, clock: ManualClock) -> None:
    a, b = two
    await ctl.apply(a, clock, "k", {"x": 1})
    first, second = await interleave(backend, lambda tx: ctl.apply(tx, clock, "k", {"x": 2}, expected=1), a,
                                     lambda: ctl.apply(b, clock, "k", {"x": 3}, expected=1))
    assert first.resourceVersion == 2
    assert isinstance(second, Conflict) and "resourceVersion 2, not 1" in str(second)


async def test_an_effect_begun_while_its_claim_expires_is_found_applying_by_the_next_claim(
        two: Any, backend: Any, clock: ManualClock) -> None:
    """A's reconcile begins applying an effect in an open transaction as its claim expires;
    B's claim skips the locked row instead of waiting or stealing it mid-write, then, after
    A's commit, takes it and finds the effect applying: ambiguous (held), never applied twice."""
    a, b = two
    await ctl.apply(a, clock, "k")
    [c] = await ctl.claim(a, clock)
    gen = (await ctl.start(a, clock, c))["generation"]
    await ctl.fenced(a, clock, c, lambda tx: tx.controller_effects.reserve(
        c.uid, gen, "w", generation=c.claim_number, observable=False, now=clock.now))
    async with a.transaction() as tx:
        await tx.controller_queue.fence(c.uid, c.token, ctl.LEASE, clock.now)
        await tx.controller_effects.begin_apply(c.uid, gen, "w", generation=c.claim_number, now=clock.now)
        later = ManualClock(clock.now + ctl.LEASE * 2)  # A's claim has expired by B's clock
        with trio.fail_after(10):
            assert await ctl.claim(b, later) == []  # the row is locked: skipped, not waited for
    [taken] = await ctl.claim(b, later, epoch=2)
    await ctl.start(b, later, taken)
    found = await ctl.fenced(b, later, taken, lambda tx: tx.controller_effects.reserve(
        taken.uid, gen, "w", generation=taken.claim_number, observable=False, now=later.now))
    assert found == {"state": "ambiguous"}
    assert (await ctl.detail(b, later, "k")).hold == "effect"


async def test_a_hosts_takeover_expires_only_its_own_earlier_reconciles(two: Any, backend: Any,
                                                                         clock: ManualClock) -> None:
    """Host B restarting (a new epoch, above live host A's) expires B's old reconcile claim,
    never A's, and names only B's old workers to kill."""
    a, _ = two
    b = await backend.open(clock, directory="another-host")  # another state directory on the same store
    try:
        lease_a = await a.hosts.acquire_lease(host_id="ha", pid=1, identity="i", lease_ms=LEASE, now=clock.now)
        for key in ("k1", "k2"):
            await ctl.apply(a, clock, key)
        clock.advance(1)
        [ours] = await ctl.claim(a, clock, room=1, epoch=lease_a.epoch)
        await a.controller_queue.attach_worker(ours.uid, ours.token, 111, "a-identity")
        old_b = await b.hosts.acquire_lease(host_id="hb", pid=2, identity="i", lease_ms=LEASE, now=clock.now)
        [theirs] = await ctl.claim(b, clock, room=1, epoch=old_b.epoch)
        await b.controller_queue.attach_worker(theirs.uid, theirs.token, 222, "b-identity")
        restarted = await b.hosts.acquire_lease(host_id="hb2", pid=3, identity="i", lease_ms=LEASE, now=clock.now,
                                                owner_dead=True)
        assert restarted.epoch > old_b.epoch > lease_a.epoch
        assert await b.controller_queue.orphaned_workers(restarted.epoch) == [(theirs.uid, 222, "b-identity")]
        assert await b.controller_queue.expire_claims_before(restarted.epoch, clock.now) == 1
        await ctl.fenced(a, clock, ours, lambda tx: tx.controller_queue.reconcile_view(ours.uid))  # A's holds
    finally:
        await backend.close(b)


# --- run.watch under out-of-order commits ------------------------------------------------------


async def test_watch_never_passes_an_event_still_uncommitted(two: Any, backend: Any, clock: ManualClock) -> None:
    """A holds an event (lower id) uncommitted while B commits one (higher id): a page stops
    before A's; once A commits, the next page has both, in order, none skipped or repeated."""
    a, b = two
    token1, attempt1 = await running(a, clock, "r1", session="s1")
    token2, attempt2 = await running(a, clock, "r2", session="s2")
    start = (await a.updates.snapshot(run_id=None, limit=1, now=clock.now_ms())).cursor
    seen: list[int] = []
    async with a.transaction() as tx:
        low = await tx.updates.publish("r1", token1, attempt_id=attempt1, type="t", key="k", data=1,
                                       now=clock.now_ms())
        high = await b.updates.publish("r2", token2, attempt_id=attempt2, type="t", key="k", data=2,
                                       now=clock.now_ms())
        assert low < high
        page = await b.updates.changes(after=start, run_id=None, limit=100, now=clock.now_ms())
        assert page.cursor < low and [e.event.eventId for e in page.events if e.event.eventId >= low] == []
        seen += [e.event.eventId for e in page.events]
    page = await b.updates.changes(after=page.cursor, run_id=None, limit=100, now=clock.now_ms())
    seen += [e.event.eventId for e in page.events]
    assert low in seen and high in seen and seen == sorted(set(seen))
