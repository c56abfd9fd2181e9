"""A controller resource's effect ledger (fenced by the claim generation and the spec
generation) and the child runs its reconciles start."""

from __future__ import annotations

from typing import Any

import pytest

from piwf.clock import ManualClock
from piwf.errors import Conflict, NotFound, Rejected

from .controllers import apply, claim, detail, fail, fenced, reconciled, start
from .helpers import claim as claim_run


async def effect(store: Any, clock: ManualClock, c: Any, gen: int, key: str, step: str, **kw: Any) -> Any:
    """One effect call of the reconcile holding ``c``, in its fenced unit of work."""
    def call(tx: Any) -> Any:
        ledger = tx.controller_effects
        if step == "reserve":
            return ledger.reserve(c.uid, gen, key, generation=c.claim_number, observable=kw.get("observable", False),
                                  now=clock.now, kind=kw.get("kind"), fingerprint=kw.get("fingerprint"))
        if step == "begin":
            return ledger.begin_apply(c.uid, gen, key, generation=c.claim_number, now=clock.now)
        return ledger.settle(c.uid, gen, key, generation=c.claim_number, now=clock.now, **kw)

    return await fenced(store, clock, c, call)


async def test_effects_apply_once_per_spec_generation_and_ambiguity_holds(store: Any, clock: ManualClock) -> None:
    await apply(store, clock)
    [c] = await claim(store, clock)
    gen = (await start(store, clock, c))["generation"]
    assert await effect(store, clock, c, gen, "w", "reserve") == {"state": "new"}
    with pytest.raises(Rejected, match="in progress"):
        await effect(store, clock, c, gen, "w", "reserve")
    await effect(store, clock, c, gen, "w", "begin")
    await effect(store, clock, c, gen, "w", "settle", result={"n": 1})
    assert await effect(store, clock, c, gen, "w", "reserve") == {"state": "applied", "result": {"n": 1}}
    # left applying by a reconcile whose host died: no observe -> ambiguous, the resource held
    await effect(store, clock, c, gen, "x", "reserve")
    await effect(store, clock, c, gen, "x", "begin")
    await store.controller_queue.expire_claims_before(2, clock.now)
    [c] = await claim(store, clock, room=1, epoch=2)
    await start(store, clock, c)
    assert await effect(store, clock, c, gen, "x", "reserve") == {"state": "ambiguous"}
    assert (await detail(store, clock)).hold == "effect"
    assert (await store.controllers.status_counts(clock.now))["ambiguousControllerEffects"] == 1
    with pytest.raises(NotFound):
        await store.controller_effects.resolve(c.uid, "nope", applied=True, result=None, now=clock.now)
    assert (await store.controller_effects.resolve(c.uid, "x", applied=True, result=None,
                                                   now=clock.now))["ambiguous"] == []
    got = await detail(store, clock)
    assert got.hold is None and got.availableAt is not None
    assert (await store.controllers.status_counts(clock.now))["ambiguousControllerEffects"] == 0


async def test_an_effect_is_its_key_kind_and_request(store: Any, clock: ManualClock) -> None:
    """Seed: a key reused for another action (kind or request fingerprint) is a conflict,
    not the other action's stored result; the same action gets its result."""
    c = await reconciled(store, clock)
    write, other = "a" * 64, "b" * 64
    assert await effect(store, clock, c, 1, "w", "reserve", kind="write", fingerprint=write) == {"state": "new"}
    await effect(store, clock, c, 1, "w", "begin")
    await effect(store, clock, c, 1, "w", "settle", result={"n": 1})
    assert await effect(store, clock, c, 1, "w", "reserve", kind="write", fingerprint=write) == {
        "state": "applied", "result": {"n": 1}}
    with pytest.raises(Conflict, match="reserved for kind 'write', not 'delete'"):
        await effect(store, clock, c, 1, "w", "reserve", kind="delete", fingerprint=write)
    with pytest.raises(Conflict, match="reserved for another request"):
        await effect(store, clock, c, 1, "w", "reserve", kind="write", fingerprint=other)
    with pytest.raises(Conflict):  # a caller naming no action is another action too
        await effect(store, clock, c, 1, "w", "reserve")
    assert await effect(store, clock, c, 1, "w", "reserve", kind="write", fingerprint=write) == {
        "state": "applied", "result": {"n": 1}}  # the refusals changed nothing
    # a pending effect is the same: its key, reserved again for another action, is refused
    assert await effect(store, clock, c, 1, "p", "reserve", kind="write", fingerprint=write) == {"state": "new"}
    with pytest.raises(Conflict):
        await effect(store, clock, c, 1, "p", "reserve", kind="write", fingerprint=other)


async def test_an_interrupted_observable_effect_is_observed(store: Any, clock: ManualClock) -> None:
    c = await reconciled(store, clock)
    await effect(store, clock, c, 1, "o", "reserve")
    await effect(store, clock, c, 1, "o", "begin")
    await store.controller_queue.expire_claims_before(2, clock.now)
    [c] = await claim(store, clock, epoch=2)
    await start(store, clock, c)
    assert await effect(store, clock, c, 1, "o", "reserve", observable=True) == {"state": "observe"}
    await effect(store, clock, c, 1, "o", "begin")  # observed not applied: apply again
    await effect(store, clock, c, 1, "o", "settle", result=2)
    assert await effect(store, clock, c, 1, "o", "reserve") == {"state": "applied", "result": 2}


async def test_a_new_spec_generation_starts_a_new_ledger(store: Any, clock: ManualClock) -> None:
    c = await reconciled(store, clock)
    await effect(store, clock, c, 1, "k", "reserve")
    await effect(store, clock, c, 1, "k", "begin")
    await effect(store, clock, c, 1, "k", "settle", result="old")
    assert await effect(store, clock, c, 2, "k", "reserve") == {"state": "new"}


async def test_an_effect_whose_apply_raised_is_applied_again_but_a_permanent_error_is_kept(
        store: Any, clock: ManualClock) -> None:
    await apply(store, clock)
    [c] = await claim(store, clock)
    gen = (await start(store, clock, c))["generation"]

    async def attempt(key: str, error: dict[str, Any]) -> None:
        assert await effect(store, clock, c, gen, key, "reserve") == {"state": "new"}
        await effect(store, clock, c, gen, key, "begin")
        await effect(store, clock, c, gen, key, "settle", error=error)

    await attempt("flaky", {"type": "TemporaryError", "message": "not yet"})
    await attempt("flaky", {"type": "ValueError", "message": "again"})  # the same pass may try again, so may the next
    await attempt("doomed", {"type": "PermanentError", "message": "never"})
    assert (await effect(store, clock, c, gen, "doomed", "reserve"))["state"] == "rejected"
    with pytest.raises(Rejected):
        await effect(store, clock, c, gen, "doomed", "begin")
    await fail(store, clock, c)
    clock.advance(1000)
    [c] = await claim(store, clock)
    await start(store, clock, c)
    assert await effect(store, clock, c, gen, "flaky", "reserve") == {"state": "new"}
    assert [e.type for e in (await detail(store, clock)).events].count("effect_failed") == 2


async def test_settling_what_is_not_applying_is_refused(store: Any, clock: ManualClock) -> None:
    c = await reconciled(store, clock)
    with pytest.raises(Rejected):
        await effect(store, clock, c, 1, "never", "settle", result=None)
    await effect(store, clock, c, 1, "k", "reserve")
    with pytest.raises(Rejected):
        await effect(store, clock, c, 1, "k", "settle", result=None)  # pending, not applying


async def test_a_child_run_is_recorded_once_per_request_key_and_followed(store: Any, clock: ManualClock) -> None:
    c = await reconciled(store, clock)
    ledger = store.controller_effects
    assert await ledger.find_child(c.uid, "build", "w", {"n": 1}) is None

    async def start_child(tx: Any) -> Any:
        await tx.runs.create_run(run_id="child", workflow="w", project_path="/project", source=b"s", digest="d",
                                 input={"n": 1}, origin_session_id=None, now=clock.now)
        return await tx.controller_effects.record_child(c.uid, "build", "w", {"n": 1}, "child", clock.now)

    child = await fenced(store, clock, c, start_child)
    assert (child["runId"], child["state"], child["output"]) == ("child", "running", None)
    assert (await ledger.find_child(c.uid, "build", "w", {"n": 1}))["state"] == "running"
    with pytest.raises(Rejected, match="another workflow or input"):
        await ledger.find_child(c.uid, "build", "w", {"n": 2})
    with pytest.raises(Rejected, match="another workflow or input"):
        await ledger.find_child(c.uid, "build", "other", {"n": 1})
    assert await store.settings.started_by(c.uid, "child")
    assert not await store.settings.started_by(c.uid, "stranger")
    assert await ledger.sync_children(clock.now) == []  # nothing moved
    run = await claim_run(store, clock)
    assert run.run_id == "child"
    await store.queue.complete_run("child", run.token, {"built": True}, clock.now)
    assert await ledger.sync_children(clock.now) == [c.uid]
    assert await ledger.sync_children(clock.now) == []  # recorded once
    found = await ledger.find_child(c.uid, "build", "w", {"n": 1})
    assert (found["state"], found["output"]) == ("succeeded", {"built": True})
    got = await detail(store, clock)
    assert got.status["workflowRun"]["state"] == "succeeded" and got.availableAt is not None
    assert [(c.requestKey, c.workflow, c.runId, c.state, c.attempt) for c in got.children] == [
        ("build", "w", "child", "succeeded", 1)]  # controller.get lists its child runs
