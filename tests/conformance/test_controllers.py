"""Controller resources, their deduplicating queue, claims and reconcile results."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from piwf.clock import ManualClock
from piwf.errors import ClaimLost, Conflict, NotFound, Rejected

from .controllers import (C, LEASE, MIN_REQUEUE_MS, P, apply, claim, detail, fail, fenced, reconciled, settle,
                          start)


async def test_apply_creates_with_initial_status_and_generation_moves_only_with_the_spec(
        store: Any, clock: ManualClock) -> None:
    first = await apply(store, clock)
    assert (first.resourceVersion, first.generation, first.changed) == (1, 1, True)
    same = await apply(store, clock)
    assert (same.resourceVersion, same.generation, same.changed) == (1, 1, False)
    changed = await apply(store, clock, spec={"text": "bye"})
    assert (changed.uid, changed.resourceVersion, changed.generation) == (first.uid, 2, 2)
    got = await detail(store, clock)
    assert got.status == {"observedGeneration": 0, "conditions": [], "controllerStatus": {"seed": True}}
    assert got.spec == {"text": "bye"}
    assert await store.controllers.locate_uid(P, C, "a") == first.uid
    with pytest.raises(NotFound):
        await store.controllers.locate_uid(P, C, "nope")


async def test_stale_resource_version_is_a_conflict_and_changes_nothing(store: Any, clock: ManualClock) -> None:
    await apply(store, clock)
    with pytest.raises(Conflict):
        await apply(store, clock, spec={"text": "other"}, expected=7)
    assert (await detail(store, clock)).spec == {"text": "hi"}
    assert (await apply(store, clock, spec={"text": "other"}, expected=1)).generation == 2


async def test_oversized_spec_bad_keys_and_unknown_resources_are_refused(store: Any, clock: ManualClock) -> None:
    with pytest.raises(Rejected, match="over the"):
        await apply(store, clock, spec={"x": "y" * (1024 * 1024)})
    for key in ("a\nb", "tab\there", "\x1b[31mred", "bidi\u202e", ""):
        with pytest.raises(Rejected, match="key must be"):
            await apply(store, clock, key=key)
    assert await store.controllers.list_resources(None, None) == []
    assert (await apply(store, clock, key="ok key ü")).changed
    for call in (store.controllers.request_reconcile, store.controllers.request_delete,
                 store.controllers.get_resource):
        with pytest.raises(NotFound):
            await call(P, C, "nope", clock.now)


async def test_resources_are_listed_by_project_and_controller(store: Any, clock: ManualClock) -> None:
    await apply(store, clock, "a")
    await apply(store, clock, "b")
    await store.controllers.apply_resource(project="/other", controller=C, key="c", spec={}, initial=None,
                                           expected_version=None, now=clock.now)
    assert sorted(r.key for r in await store.controllers.list_resources(None, None)) == ["a", "b", "c"]
    assert sorted(r.key for r in await store.controllers.list_resources(P, C)) == ["a", "b"]
    assert [r.key for r in await store.controllers.list_resources("/other", None)] == ["c"]
    assert await store.controllers.list_resources(P, "another") == []


async def test_a_thousand_requests_while_queued_are_one_reconcile(store: Any, clock: ManualClock) -> None:
    await apply(store, clock)
    for _ in range(1000):
        await store.controllers.request_reconcile(P, C, "a", clock.now)
    assert len(await claim(store, clock)) == 1
    assert await claim(store, clock) == []  # never two at once


async def test_requests_during_a_reconcile_queue_exactly_one_more(store: Any, clock: ManualClock) -> None:
    c = await reconciled(store, clock)
    for _ in range(1000):
        await store.controllers.request_reconcile(P, C, "a", clock.now)
    assert await claim(store, clock) == []
    assert await settle(store, clock, c) == "settled"
    [again] = await claim(store, clock)
    await start(store, clock, again)
    assert await settle(store, clock, again) == "settled"
    assert await claim(store, clock) == []
    assert (await detail(store, clock)).availableAt is None


async def test_the_next_due_time_and_the_counts_follow_the_queue(store: Any, clock: ManualClock) -> None:
    assert await store.controller_queue.next_due() is None
    await apply(store, clock)
    assert await store.controller_queue.next_due() == clock.now
    assert await store.controllers.status_counts(clock.now) == {"pendingControllers": 1, "heldControllers": 0,
                                                                "ambiguousControllerEffects": 0}
    [c] = await claim(store, clock)
    assert await store.controller_queue.next_due() == clock.now + LEASE  # its claim's expiry
    await start(store, clock, c)
    await fail(store, clock, c, delay_ms=5000)
    assert await store.controller_queue.next_due() == clock.now + 5000
    clock.advance(5000)
    [c] = await claim(store, clock)
    await start(store, clock, c)
    await fail(store, clock, c, permanent=True)
    assert await store.controller_queue.next_due() is None
    assert await store.controllers.status_counts(clock.now) == {"pendingControllers": 0, "heldControllers": 1,
                                                                "ambiguousControllerEffects": 0}


async def test_settled_status_merges_conditions_keeping_transition_times(store: Any, clock: ManualClock) -> None:
    c = await reconciled(store, clock)
    await settle(store, clock, c, conditions=[{"type": "Ready", "status": "True"},
                                              {"type": "Synced", "status": "True"}])
    first = {x["type"]: x for x in (await detail(store, clock)).status["conditions"]}
    clock.advance(5000)
    await store.controllers.request_reconcile(P, C, "a", clock.now)
    [c] = await claim(store, clock)
    await start(store, clock, c)
    await settle(store, clock, c, conditions=[{"type": "Ready", "status": "True", "reason": "Again"}], keep_status=True)
    got = await detail(store, clock)
    now = {x["type"]: x for x in got.status["conditions"]}
    assert now["Ready"]["lastTransitionTime"] == first["Ready"]["lastTransitionTime"]
    assert now["Ready"]["reason"] == "Again" and "Synced" in now
    assert got.status["observedGeneration"] == 1 and got.status["controllerStatus"] == {"ok": 1}


async def test_an_identical_status_write_keeps_the_resource_version(store: Any, clock: ManualClock) -> None:
    """Seed, DESIGN §9: resourceVersion moves with every write that changes something; a
    pass that settles with the stored status (and finalizers) changes nothing."""
    c = await reconciled(store, clock)
    assert await settle(store, clock, c) == "settled"
    first = await detail(store, clock)
    assert first.resourceVersion == 2  # the initial status was replaced

    async def again(**kw: Any) -> Any:
        clock.advance(5000)
        await store.controllers.request_reconcile(P, C, "a", clock.now)
        [c] = await claim(store, clock)
        await start(store, clock, c)
        assert await settle(store, clock, c, **kw) == "settled"  # its compare-and-set still held
        return await detail(store, clock)

    same = await again()
    assert (same.resourceVersion, same.status) == (first.resourceVersion, first.status)
    kept = await again(keep_status=True, conditions=[], finalizers=None)
    assert kept.resourceVersion == first.resourceVersion
    changed = await again(controller_status={"ok": 2})
    assert changed.resourceVersion == first.resourceVersion + 1 and changed.status["controllerStatus"] == {"ok": 2}
    finalized = await again(controller_status={"ok": 2}, finalizers=["f"])
    assert finalized.resourceVersion == changed.resourceVersion + 1 and finalized.finalizers == ["f"]
    flipped = await again(controller_status={"ok": 2}, conditions=[{"type": "Ready", "status": "False"}])
    assert flipped.resourceVersion == finalized.resourceVersion + 1


async def test_a_condition_type_twice_is_refused(store: Any, clock: ManualClock) -> None:
    c = await reconciled(store, clock)
    with pytest.raises(Rejected, match="twice"):
        await settle(store, clock, c, conditions=[{"type": "Ready", "status": "True"},
                                                  {"type": "Ready", "status": "True"}])
    assert (await detail(store, clock)).status["observedGeneration"] == 0


async def test_a_spec_change_during_a_reconcile_is_a_conflict_and_requeues_now(store: Any, clock: ManualClock) -> None:
    c = await reconciled(store, clock)
    await apply(store, clock, spec={"text": "new"})
    assert await settle(store, clock, c) == "conflict"
    assert (await detail(store, clock)).status["observedGeneration"] == 0
    [c] = await claim(store, clock)
    assert (await start(store, clock, c))["generation"] == 2


async def test_failures_count_and_wait_and_a_success_resets(store: Any, clock: ManualClock) -> None:
    await apply(store, clock)
    for n in (1, 2, 3):
        [c] = await claim(store, clock)
        await start(store, clock, c)
        assert await fail(store, clock, c, delay_ms=1000 * n) == n
        assert await claim(store, clock) == []
        clock.advance(1000 * n)
    [c] = await claim(store, clock)
    await start(store, clock, c)
    await settle(store, clock, c)
    got = await detail(store, clock)
    assert got.consecutiveErrors == 0 and got.lastError is None


async def test_a_delay_may_be_a_function_of_the_failures_before(store: Any, clock: ManualClock) -> None:
    await apply(store, clock)
    seen = []
    for n in (1, 2):
        [c] = await claim(store, clock)
        await start(store, clock, c)
        await fail(store, clock, c, delay_ms=lambda before: seen.append(before) or 100 * (before + 1))
        clock.advance(100 * n)
    assert seen == [0, 1]
    assert len(await claim(store, clock)) == 1


async def test_a_permanent_error_holds_until_the_spec_changes(store: Any, clock: ManualClock) -> None:
    c = await reconciled(store, clock)
    await fail(store, clock, c, permanent=True)
    got = await detail(store, clock)
    assert got.hold == "permanent" and got.ready == "False"
    clock.advance(3_600_000)
    assert await claim(store, clock) == []
    await apply(store, clock, spec={"text": "fixed"})
    assert len(await claim(store, clock)) == 1


async def test_a_permanent_error_with_an_event_during_the_pass_is_reconciled_again(
        store: Any, clock: ManualClock) -> None:
    c = await reconciled(store, clock)
    await store.controllers.request_reconcile(P, C, "a", clock.now)  # arrives during the pass
    await fail(store, clock, c, permanent=True)
    got = await detail(store, clock)
    assert got.hold is None and got.availableAt is not None and got.ready != "False"
    assert len(await claim(store, clock)) == 1


async def test_a_successful_pass_clears_the_hosts_ready_false(store: Any, clock: ManualClock) -> None:
    c = await reconciled(store, clock)
    await fail(store, clock, c, permanent=True)
    assert (await detail(store, clock)).ready == "False"
    await apply(store, clock, spec={"text": "fixed"})
    [c] = await claim(store, clock)
    await start(store, clock, c)
    await settle(store, clock, c, conditions=[{"type": "Synced", "status": "True"}])  # returns no Ready of its own
    got = await detail(store, clock)
    assert got.ready is None and [x["type"] for x in got.status["conditions"]] == ["Synced"]


async def test_a_lost_claim_is_refused_and_an_expired_one_is_claimable(store: Any, clock: ManualClock) -> None:
    await apply(store, clock)
    [c] = await claim(store, clock)
    clock.advance(LEASE + 1)
    with pytest.raises(ClaimLost):
        await start(store, clock, c)
    [again] = await claim(store, clock)
    assert again.claim_number == c.claim_number + 1 and again.token != c.token
    with pytest.raises(ClaimLost):
        await settle(store, clock, c)
    assert await store.controller_queue.renew_claims([(c.uid, c.token)], LEASE, clock.now) == {c.uid}
    assert await store.controller_queue.renew_claims([(again.uid, again.token)], LEASE, clock.now) == set()
    clock.advance(LEASE - 1)
    await start(store, clock, again)  # renewed: still live


async def test_a_reconcile_that_never_reported_is_recorded_as_a_failure_under_its_claim(
        store: Any, clock: ManualClock) -> None:
    c = await reconciled(store, clock)
    assert await store.controller_queue.record_failure(c.uid, c.token, error="crashed", delay_ms=0,
                                                       now=clock.now) == 1
    got = await detail(store, clock)
    assert got.consecutiveErrors == 1 and "crashed" in got.lastError
    assert await store.controller_queue.record_failure(c.uid, c.token, error="again", delay_ms=0,
                                                       now=clock.now) is None  # the claim went with it
    [c] = await claim(store, clock)
    assert await store.controller_queue.record_failure(c.uid, c.token, error="not started", delay_ms=0,
                                                       now=clock.now, counted=False) == 1  # not the resource's fault
    assert (await detail(store, clock)).consecutiveErrors == 1


async def test_takeover_makes_earlier_claims_due_at_once_and_names_the_workers_to_kill(
        store: Any, clock: ManualClock) -> None:
    await apply(store, clock)
    [c] = await claim(store, clock)
    await store.controller_queue.attach_worker(c.uid, c.token, 4242, "boot:4242:1")
    await store.controller_queue.attach_worker(c.uid, "stale", 1, "x")  # fenced: changes nothing
    assert await store.controller_queue.orphaned_workers(2) == [(c.uid, 4242, "boot:4242:1")]
    assert await store.controller_queue.orphaned_workers(1) == []  # this host's own
    assert await store.controller_queue.expire_claims_before(2, clock.now) == 1
    assert await store.controller_queue.orphaned_workers(2) == []
    [event] = [e for e in (await detail(store, clock)).events if e.type == "reconcile_failed"]
    assert event.detail["error"] == "interrupted: its host died"
    [again] = await claim(store, clock, epoch=2)
    assert (await detail(store, clock)).consecutiveErrors == 1 and again.uid == c.uid
    with pytest.raises(ClaimLost):
        await start(store, clock, c)


async def test_delete_waits_for_finalizers_then_removes(store: Any, clock: ManualClock) -> None:
    c = await reconciled(store, clock)
    await settle(store, clock, c, finalizers=["mirror/file"])
    ref = await store.controllers.request_delete(P, C, "a", clock.now)
    assert not ref.deleted and (await detail(store, clock)).deletionTimestamp is not None
    [c] = await claim(store, clock)
    view = await start(store, clock, c)
    assert view["deletionTimestamp"] is not None and view["finalizers"] == ["mirror/file"]
    assert await settle(store, clock, c, finalizers=[]) == "deleted"
    with pytest.raises(NotFound):
        await detail(store, clock)
    receipt = await apply(store, clock)  # the key is free again: a new resource, its events its own
    assert receipt.uid != c.uid and [e.type for e in (await detail(store, clock)).events] == ["applied"]


async def test_delete_without_finalizers_is_immediate(store: Any, clock: ManualClock) -> None:
    await apply(store, clock)
    assert (await store.controllers.request_delete(P, C, "a", clock.now)).deleted
    assert await store.controllers.list_resources(P, C) == []


async def test_a_requeuing_resource_without_finalizers_is_deleted(store: Any, clock: ManualClock) -> None:
    c = await reconciled(store, clock)
    assert not (await store.controllers.request_delete(P, C, "a", clock.now)).deleted  # a pass holds it
    assert await settle(store, clock, c, settled=False, requeue_after_ms=0) == "conflict"
    [c] = await claim(store, clock)
    await start(store, clock, c)
    assert await settle(store, clock, c, settled=False, requeue_after_ms=0) == "deleted"
    assert await store.controllers.list_resources(None, None) == []


async def test_a_requeue_waits_at_least_a_second(store: Any, clock: ManualClock) -> None:
    c = await reconciled(store, clock)
    assert await settle(store, clock, c, settled=False, requeue_after_ms=0) == "requeued"
    assert await claim(store, clock) == []
    clock.advance(MIN_REQUEUE_MS)
    [c] = await claim(store, clock)
    await start(store, clock, c)
    assert await settle(store, clock, c, settled=False, requeue_after_ms=5000) == "requeued"
    clock.advance(MIN_REQUEUE_MS)
    assert await claim(store, clock) == []


async def test_force_delete_removes_a_resource_with_finalizers_and_its_running_pass_loses_its_claim(
        store: Any, clock: ManualClock) -> None:
    c = await reconciled(store, clock)
    await settle(store, clock, c, finalizers=["mirror/file"])
    await store.controllers.request_reconcile(P, C, "a", clock.now)
    [c] = await claim(store, clock)
    assert (await store.controllers.request_delete(P, C, "a", clock.now, force=True)).deleted
    assert await store.controllers.list_resources(None, None) == []
    with pytest.raises(ClaimLost):
        await start(store, clock, c)


async def test_a_resource_shows_its_most_recent_events(store: Any, clock: ManualClock) -> None:
    receipt = await apply(store, clock)
    other = await apply(store, clock, key="b")
    async with store.transaction() as tx:
        for n in range(50):
            await tx.controllers.add_resource_event(receipt.uid, "log", {"message": str(n)}, clock.now)
        await tx.controllers.add_resource_event(other.uid, "log", {"message": "b's"}, clock.now)
    events = (await detail(store, clock)).events
    assert events[-1].detail == {"message": "49"} and all(e.type == "log" for e in events)
    assert [int(e.detail["message"]) for e in events] == list(range(50 - len(events), 50))  # in order, newest last
    assert [e.type for e in (await detail(store, clock, "b")).events] == ["applied", "log"]


async def test_a_fenced_message_under_a_lost_claim_writes_nothing(store: Any, clock: ManualClock) -> None:
    c = await reconciled(store, clock)
    clock.advance(LEASE + 1)
    with pytest.raises(ClaimLost):
        await fenced(store, clock, c, lambda tx: tx.controllers.add_resource_event(c.uid, "log", {}, clock.now))
    assert "log" not in [e.type for e in (await detail(store, clock)).events]


async def test_two_stores_never_reconcile_one_resource_at_once(store: Any, open_store: Any,
                                                               clock: ManualClock) -> None:
    other = await open_store()  # another host's store
    await apply(store, clock, "a")
    await apply(store, clock, "b")
    [mine] = await claim(store, clock, room=1)
    [theirs] = await claim(other, clock, room=4)
    assert {mine.key, theirs.key} == {"a", "b"}
    assert await claim(other, clock) == await claim(store, clock) == []
    await start(other, clock, theirs)
    assert await settle(other, clock, theirs) == "settled"
    with pytest.raises(ClaimLost):
        await settle(other, clock, dataclasses.replace(mine, token=theirs.token))  # the token proves the claim
    await start(store, clock, mine)
    assert await settle(store, clock, mine) == "settled"
