"""The controller store on its own: resources, the deduping queue, claims, results, effects."""

from __future__ import annotations

from typing import Any

import pytest

from piwf.clock import ManualClock
from piwf.errors import ClaimLost, Conflict, NotFound, Rejected
from piwf.store.sqlite import Database
from piwf.store.sqlite import controller_effects as effects
from piwf.store.sqlite import controller_queue as cq
from piwf.store.sqlite import controllers as res

P, C = "/project", "mirror"
LEASE = 120_000


def apply(db: Database, clock: ManualClock, key: str = "a", spec: Any = None, **kw: Any) -> Any:
    return res.apply_resource(db, project=P, controller=C, key=key, spec={"text": "hi"} if spec is None else spec,
                              initial={"seed": True}, expected_version=kw.get("expected"), now=clock.now)


def claim(db: Database, clock: ManualClock, room: int = 4,
          exclude: frozenset[str] = frozenset()) -> list[cq.ControllerClaim]:
    return cq.claim_due(db, room=room, exclude=exclude, lease_ms=LEASE, now=clock.now, epoch=1)


def fenced(db: Database, clock: ManualClock, c: cq.ControllerClaim, fn: Any) -> Any:
    """A reconcile worker's message as the host carries it out: one transaction, the fence first."""
    with db.write():
        cq.fence(db, c.uid, c.token, LEASE, clock.now)
        return fn()


def start(db: Database, clock: ManualClock, c: cq.ControllerClaim) -> dict[str, Any]:
    return fenced(db, clock, c, lambda: cq.reconcile_view(db, c.uid))


def settle(db: Database, clock: ManualClock, c: cq.ControllerClaim, **kw: Any) -> str:
    args = dict(requeue_after_ms=None, settled=True, controller_status={"ok": 1}, keep_status=False,
                conditions=[{"type": "Ready", "status": "True", "reason": "Synced"}], finalizers=None)
    args.update(kw)
    return fenced(db, clock, c,
                  lambda: cq.finish_success(db, c.uid, c.token, now=clock.now, **args))


def fail(db: Database, clock: ManualClock, c: cq.ControllerClaim, delay_ms: int = 1000, permanent: bool = False) -> int:
    return fenced(db, clock, c,
                  lambda: cq.finish_failure(db, c.uid, c.token, error="boom", delay_ms=delay_ms,
                                                     permanent=permanent, now=clock.now))


def detail(db: Database, clock: ManualClock, key: str = "a") -> Any:
    return res.get_resource(db, P, C, key, clock.now)


def test_apply_creates_with_initial_status_and_generation_moves_only_with_the_spec(db: Database,
                                                                                  clock: ManualClock) -> None:
    first = apply(db, clock)
    assert (first.resourceVersion, first.generation, first.changed) == (1, 1, True)
    same = apply(db, clock)
    assert (same.resourceVersion, same.generation, same.changed) == (1, 1, False)
    changed = apply(db, clock, spec={"text": "bye"})
    assert (changed.uid, changed.resourceVersion, changed.generation) == (first.uid, 2, 2)
    got = detail(db, clock)
    assert got.status == {"observedGeneration": 0, "conditions": [], "controllerStatus": {"seed": True}}
    assert got.spec == {"text": "bye"}


def test_stale_resource_version_is_a_conflict_and_changes_nothing(db: Database, clock: ManualClock) -> None:
    apply(db, clock)
    with pytest.raises(Conflict):
        apply(db, clock, spec={"text": "other"}, expected=7)
    assert detail(db, clock).spec == {"text": "hi"}
    assert apply(db, clock, spec={"text": "other"}, expected=1).generation == 2


def test_oversized_spec_and_unknown_resource_are_refused(db: Database, clock: ManualClock) -> None:
    with pytest.raises(Rejected, match="over the"):
        apply(db, clock, spec={"x": "y" * (1024 * 1024)})
    assert res.list_resources(db, None, None) == []
    with pytest.raises(NotFound):
        res.request_reconcile(db, P, C, "nope", clock.now)


def test_a_thousand_requests_while_queued_are_one_reconcile(db: Database, clock: ManualClock) -> None:
    apply(db, clock)
    for _ in range(1000):
        res.request_reconcile(db, P, C, "a", clock.now)
    claims = claim(db, clock)
    assert len(claims) == 1
    assert claim(db, clock) == []  # never two at once


def test_requests_during_a_reconcile_queue_exactly_one_more(db: Database, clock: ManualClock) -> None:
    apply(db, clock)
    [c] = claim(db, clock)
    start(db, clock, c)
    for _ in range(1000):
        res.request_reconcile(db, P, C, "a", clock.now)
    assert claim(db, clock) == []
    assert settle(db, clock, c) == "settled"
    [again] = claim(db, clock)
    start(db, clock, again)
    assert settle(db, clock, again) == "settled"
    assert claim(db, clock) == []
    assert detail(db, clock).availableAt is None


def test_settled_status_merges_conditions_keeping_transition_times(db: Database, clock: ManualClock) -> None:
    apply(db, clock)
    [c] = claim(db, clock)
    start(db, clock, c)
    settle(db, clock, c, conditions=[{"type": "Ready", "status": "True"}, {"type": "Synced", "status": "True"}])
    first = {x["type"]: x for x in detail(db, clock).status["conditions"]}
    clock.advance(5000)
    res.request_reconcile(db, P, C, "a", clock.now)
    [c] = claim(db, clock)
    start(db, clock, c)
    settle(db, clock, c, conditions=[{"type": "Ready", "status": "True", "reason": "Again"}], keep_status=True)
    got = detail(db, clock)
    now = {x["type"]: x for x in got.status["conditions"]}
    assert now["Ready"]["lastTransitionTime"] == first["Ready"]["lastTransitionTime"]
    assert now["Ready"]["reason"] == "Again" and "Synced" in now
    assert got.status["observedGeneration"] == 1 and got.status["controllerStatus"] == {"ok": 1}


def test_a_condition_type_twice_is_refused(db: Database, clock: ManualClock) -> None:
    apply(db, clock)
    [c] = claim(db, clock)
    start(db, clock, c)
    with pytest.raises(Rejected, match="twice"):
        settle(db, clock, c, conditions=[{"type": "Ready", "status": "True"}, {"type": "Ready", "status": "True"}])


def test_a_spec_change_during_a_reconcile_is_a_conflict_and_requeues_now(db: Database, clock: ManualClock) -> None:
    apply(db, clock)
    [c] = claim(db, clock)
    start(db, clock, c)
    apply(db, clock, spec={"text": "new"})
    assert settle(db, clock, c) == "conflict"
    assert detail(db, clock).status["observedGeneration"] == 0
    [c] = claim(db, clock)
    assert start(db, clock, c)["generation"] == 2


def test_failures_count_and_wait_and_a_success_resets(db: Database, clock: ManualClock) -> None:
    apply(db, clock)
    for n in (1, 2, 3):
        [c] = claim(db, clock)
        start(db, clock, c)
        assert fail(db, clock, c, delay_ms=1000 * n) == n
        assert claim(db, clock) == []
        clock.advance(1000 * n)
    [c] = claim(db, clock)
    start(db, clock, c)
    settle(db, clock, c)
    got = detail(db, clock)
    assert got.consecutiveErrors == 0 and got.lastError is None


def test_a_permanent_error_holds_until_the_spec_changes(db: Database, clock: ManualClock) -> None:
    apply(db, clock)
    [c] = claim(db, clock)
    start(db, clock, c)
    fail(db, clock, c, permanent=True)
    got = detail(db, clock)
    assert got.hold == "permanent" and got.ready == "False"
    clock.advance(3_600_000)
    assert claim(db, clock) == []
    apply(db, clock, spec={"text": "fixed"})
    assert len(claim(db, clock)) == 1


def test_a_lost_claim_is_refused_and_an_expired_one_is_claimable(db: Database, clock: ManualClock) -> None:
    apply(db, clock)
    [c] = claim(db, clock)
    clock.advance(LEASE + 1)
    with pytest.raises(ClaimLost):
        start(db, clock, c)
    [again] = claim(db, clock)
    assert again.generation == c.generation + 1
    assert cq.renew_claims(db, [(c.uid, c.token)], LEASE, clock.now) == {c.uid}
    assert cq.renew_claims(db, [(again.uid, again.token)], LEASE, clock.now) == set()


def test_takeover_makes_earlier_claims_due_at_once(db: Database, clock: ManualClock) -> None:
    apply(db, clock)
    claim(db, clock)
    assert cq.expire_claims_before(db, 2, clock.now) == 1
    [c] = cq.claim_due(db, room=1, exclude=frozenset(), lease_ms=LEASE, now=clock.now, epoch=2)
    assert detail(db, clock).consecutiveErrors == 1 and c.uid


def test_delete_waits_for_finalizers_then_removes(db: Database, clock: ManualClock) -> None:
    apply(db, clock)
    [c] = claim(db, clock)
    start(db, clock, c)
    settle(db, clock, c, finalizers=["mirror/file"])
    ref = res.request_delete(db, P, C, "a", clock.now)
    assert not ref.deleted and detail(db, clock).deletionTimestamp is not None
    [c] = claim(db, clock)
    view = start(db, clock, c)
    assert view["deletionTimestamp"] is not None and view["finalizers"] == ["mirror/file"]
    assert settle(db, clock, c, finalizers=[]) == "deleted"
    with pytest.raises(NotFound):
        detail(db, clock)
    assert db.scalar("SELECT COUNT(*) FROM controller_events WHERE uid = ?", (c.uid,)) == 0  # its events went too


def test_delete_without_finalizers_is_immediate(db: Database, clock: ManualClock) -> None:
    apply(db, clock)
    assert res.request_delete(db, P, C, "a", clock.now).deleted
    assert res.list_resources(db, P, C) == []


def test_effects_apply_once_per_spec_generation_and_ambiguity_holds(db: Database, clock: ManualClock) -> None:
    apply(db, clock)
    [c] = claim(db, clock)
    view = start(db, clock, c)
    gen = view["generation"]

    def run(fn: Any) -> Any:
        return fenced(db, clock, c, fn)

    assert run(lambda: effects.reserve(db, c.uid, gen, "w", generation=c.generation, observable=False,
                                       now=clock.now)) == {"state": "new"}
    run(lambda: effects.begin_apply(db, c.uid, gen, "w", generation=c.generation, now=clock.now))
    run(lambda: effects.settle(db, c.uid, gen, "w", generation=c.generation, result={"n": 1}, now=clock.now))
    assert run(lambda: effects.reserve(db, c.uid, gen, "w", generation=c.generation, observable=False,
                                       now=clock.now)) == {"state": "applied", "result": {"n": 1}}
    # left applying by a reconcile whose host died: no observe -> ambiguous, the resource held
    run(lambda: effects.reserve(db, c.uid, gen, "x", generation=c.generation, observable=False, now=clock.now))
    run(lambda: effects.begin_apply(db, c.uid, gen, "x", generation=c.generation, now=clock.now))
    cq.expire_claims_before(db, 2, clock.now)
    [c] = cq.claim_due(db, room=1, exclude=frozenset(), lease_ms=LEASE, now=clock.now, epoch=2)
    start(db, clock, c)
    state = run(lambda: effects.reserve(db, c.uid, gen, "x", generation=c.generation, observable=False,
                                        now=clock.now))
    assert state == {"state": "ambiguous"}
    assert detail(db, clock).hold == "effect"
    assert effects.resolve(db, c.uid, "x", applied=True, result=None, now=clock.now)["ambiguous"] == []
    got = detail(db, clock)
    assert got.hold is None and got.availableAt is not None


def test_a_resource_keeps_exactly_its_most_recent_events(db: Database, clock: ManualClock) -> None:
    receipt = apply(db, clock)
    other = apply(db, clock, key="b")
    with db.write():
        for n in range(res.KEPT_EVENTS + 37):
            res.add_resource_event(db, receipt.uid, "log", {"message": str(n)}, clock.now)
            if n % 3 == 0:  # interleaved with another resource's: counted per resource
                res.add_resource_event(db, other.uid, "log", {"message": str(n)}, clock.now)

    def count(uid: str) -> int:
        return db.scalar("SELECT COUNT(*) FROM controller_events WHERE uid = ?", (uid,))

    assert count(receipt.uid) == res.KEPT_EVENTS
    assert count(other.uid) == 1 + len(range(0, res.KEPT_EVENTS + 37, 3))  # its "applied" and the logs: not pruned
    assert res.events(db, receipt.uid, 1)[0].detail == {"message": str(res.KEPT_EVENTS + 36)}


def test_keys_must_be_printable(db: Database, clock: ManualClock) -> None:
    for key in ("a\nb", "tab\there", "\x1b[31mred", "bidi\u202e", ""):
        with pytest.raises(Rejected, match="key must be"):
            apply(db, clock, key=key)
    assert res.list_resources(db, None, None) == []
    assert apply(db, clock, key="ok key ü").changed


def test_a_permanent_error_with_an_event_during_the_pass_is_reconciled_again(db: Database,
                                                                             clock: ManualClock) -> None:
    apply(db, clock)
    [c] = claim(db, clock)
    start(db, clock, c)
    res.request_reconcile(db, P, C, "a", clock.now)  # arrives during the pass
    fail(db, clock, c, permanent=True)
    got = detail(db, clock)
    assert got.hold is None and got.availableAt is not None and got.ready != "False"
    assert len(claim(db, clock)) == 1


def test_a_successful_pass_clears_the_hosts_ready_false(db: Database, clock: ManualClock) -> None:
    apply(db, clock)
    [c] = claim(db, clock)
    start(db, clock, c)
    fail(db, clock, c, permanent=True)
    assert detail(db, clock).ready == "False"
    apply(db, clock, spec={"text": "fixed"})
    [c] = claim(db, clock)
    start(db, clock, c)
    settle(db, clock, c, conditions=[{"type": "Synced", "status": "True"}])  # returns no Ready of its own
    got = detail(db, clock)
    assert got.ready is None and [x["type"] for x in got.status["conditions"]] == ["Synced"]


def test_a_requeuing_resource_without_finalizers_is_deleted(db: Database, clock: ManualClock) -> None:
    apply(db, clock)
    [c] = claim(db, clock)
    start(db, clock, c)
    assert not res.request_delete(db, P, C, "a", clock.now).deleted  # a pass holds it
    assert settle(db, clock, c, settled=False, requeue_after_ms=0) == "conflict"
    [c] = claim(db, clock)
    start(db, clock, c)
    assert settle(db, clock, c, settled=False, requeue_after_ms=0) == "deleted"
    assert res.list_resources(db, None, None) == []


def test_a_requeue_waits_at_least_a_second(db: Database, clock: ManualClock) -> None:
    apply(db, clock)
    [c] = claim(db, clock)
    start(db, clock, c)
    assert settle(db, clock, c, settled=False, requeue_after_ms=0) == "requeued"
    assert claim(db, clock) == []
    clock.advance(cq.MIN_REQUEUE_MS)
    [c] = claim(db, clock)
    start(db, clock, c)
    assert settle(db, clock, c, settled=False, requeue_after_ms=5000) == "requeued"
    clock.advance(cq.MIN_REQUEUE_MS)
    assert claim(db, clock) == []


def test_force_delete_removes_a_resource_with_finalizers_and_its_running_pass_loses_its_claim(
        db: Database, clock: ManualClock) -> None:
    apply(db, clock)
    [c] = claim(db, clock)
    start(db, clock, c)
    settle(db, clock, c, finalizers=["mirror/file"])
    res.request_reconcile(db, P, C, "a", clock.now)
    [c] = claim(db, clock)
    assert res.request_delete(db, P, C, "a", clock.now, force=True).deleted
    assert res.list_resources(db, None, None) == []
    with pytest.raises(ClaimLost):
        start(db, clock, c)


def test_an_effect_whose_apply_raised_is_applied_again_but_a_permanent_error_is_kept(
        db: Database, clock: ManualClock) -> None:
    apply(db, clock)
    [c] = claim(db, clock)
    gen = start(db, clock, c)["generation"]

    def run(fn: Any) -> Any:
        return fenced(db, clock, c, fn)

    def attempt(key: str, error: dict[str, Any]) -> None:
        assert run(lambda: effects.reserve(db, c.uid, gen, key, generation=c.generation, observable=False,
                                           now=clock.now)) == {"state": "new"}
        run(lambda: effects.begin_apply(db, c.uid, gen, key, generation=c.generation, now=clock.now))
        run(lambda: effects.settle(db, c.uid, gen, key, generation=c.generation, error=error, now=clock.now))

    attempt("flaky", {"type": "TemporaryError", "message": "not yet"})
    attempt("flaky", {"type": "ValueError", "message": "again"})  # the same pass may try again, so may the next
    attempt("doomed", {"type": "PermanentError", "message": "never"})
    assert run(lambda: effects.reserve(db, c.uid, gen, "doomed", generation=c.generation, observable=False,
                                       now=clock.now))["state"] == "rejected"
    fail(db, clock, c)
    clock.advance(1000)
    [c] = claim(db, clock)
    start(db, clock, c)
    assert run(lambda: effects.reserve(db, c.uid, gen, "flaky", generation=c.generation, observable=False,
                                       now=clock.now)) == {"state": "new"}
    assert res.count_events(db, c.uid, "effect_failed") == 2


def test_takeover_names_the_workers_to_kill_and_leaves_an_event(db: Database, clock: ManualClock) -> None:
    apply(db, clock)
    [c] = claim(db, clock)
    cq.attach_worker(db, c.uid, c.token, 4242, "boot:4242:1")
    assert cq.orphaned_workers(db, 2) == [(c.uid, 4242, "boot:4242:1")]
    assert cq.orphaned_workers(db, 1) == []  # this host's own
    assert cq.expire_claims_before(db, 2, clock.now) == 1
    assert cq.orphaned_workers(db, 2) == []
    [event] = [e for e in detail(db, clock).events if e.type == "reconcile_failed"]
    assert event.detail["error"] == "interrupted: its host died"
