"""The effect state machine in the store: reserve, apply, settle, observe, ambiguity, resolution."""

from __future__ import annotations

import pytest

from piwf.clock import ManualClock
from piwf.errors import NotFound, Rejected
from piwf.store.sqlite import Database, effects, queue, runs

from .test_store_queue import claim, new_run


def reserve(db: Database, clock: ManualClock, generation: int, *, key: str = "k", observable: bool = False) -> dict:
    return effects.reserve(db, "r1", key, node="n", generation=generation, observable=observable,
                           now=clock.now_ms())


def status(db: Database, key: str = "k") -> str:
    return {e.key: e.status for e in effects.list_effects(db, "r1")}[key]


def test_an_effect_is_reserved_applied_and_settled_then_returned_without_applying(
    db: Database, clock: ManualClock
) -> None:
    new_run(db, clock)
    assert reserve(db, clock, 1) == {"state": "new"}
    assert status(db) == "pending"
    effects.begin_apply(db, "r1", "k", generation=1, now=clock.now_ms())
    assert status(db) == "applying"
    effects.settle(db, "r1", "k", generation=1, result={"id": 7}, now=clock.now_ms())
    assert reserve(db, clock, 2) == {"state": "applied", "result": {"id": 7}}
    assert status(db) == "applied"


def test_a_rejected_effect_returns_its_error_and_is_never_applied_again(db: Database, clock: ManualClock) -> None:
    new_run(db, clock)
    reserve(db, clock, 1)
    effects.begin_apply(db, "r1", "k", generation=1, now=clock.now_ms())
    effects.settle(db, "r1", "k", generation=1, error={"type": "IOError", "message": "no"}, now=clock.now_ms())
    assert reserve(db, clock, 2) == {"state": "rejected", "error": {"type": "IOError", "message": "no"}}
    with pytest.raises(Rejected, match="is rejected; it cannot be applied"):
        effects.begin_apply(db, "r1", "k", generation=1, now=clock.now_ms())


def test_a_pending_effect_of_an_earlier_generation_is_simply_applied(db: Database, clock: ManualClock) -> None:
    new_run(db, clock)
    reserve(db, clock, 1)  # the worker died before apply() started
    assert reserve(db, clock, 2) == {"state": "new"}
    effects.begin_apply(db, "r1", "k", generation=2, now=clock.now_ms())


def test_an_interrupted_apply_is_observed_when_observable_else_ambiguous(db: Database, clock: ManualClock) -> None:
    new_run(db, clock)
    reserve(db, clock, 1)
    effects.begin_apply(db, "r1", "k", generation=1, now=clock.now_ms())
    assert reserve(db, clock, 2, observable=True) == {"state": "observe"}
    assert status(db) == "applying"  # still unknown until the observation settles it
    assert reserve(db, clock, 3, observable=False) == {"state": "ambiguous"}
    assert status(db) == "ambiguous"
    assert reserve(db, clock, 4, observable=True) == {"state": "ambiguous"}  # only an operator decides now


def test_observed_not_applied_applies_again_in_the_same_generation(db: Database, clock: ManualClock) -> None:
    new_run(db, clock)
    reserve(db, clock, 1)
    effects.begin_apply(db, "r1", "k", generation=1, now=clock.now_ms())
    reserve(db, clock, 2, observable=True)
    effects.begin_apply(db, "r1", "k", generation=2, now=clock.now_ms())
    effects.settle(db, "r1", "k", generation=2, result=1, now=clock.now_ms())
    assert status(db) == "applied"


def test_writes_for_another_generation_are_refused(db: Database, clock: ManualClock) -> None:
    new_run(db, clock)
    reserve(db, clock, 1)
    with pytest.raises(Rejected, match="generation 1, not 2"):
        effects.begin_apply(db, "r1", "k", generation=2, now=clock.now_ms())
    with pytest.raises(Rejected, match="in progress in this attempt"):
        reserve(db, clock, 1)
    with pytest.raises(Rejected, match="not applying"):
        effects.settle(db, "r1", "k", generation=1, result=None, now=clock.now_ms())
    with pytest.raises(Rejected, match="never reserved"):
        effects.settle(db, "r1", "other", generation=1, result=None, now=clock.now_ms())


def _held_ambiguous(db: Database, clock: ManualClock, keys: tuple[str, ...] = ("k",)) -> None:
    new_run(db, clock)
    first = claim(db, clock)
    assert first is not None
    for key in keys:
        reserve(db, clock, 1, key=key)
        effects.begin_apply(db, "r1", key, generation=1, now=clock.now_ms())
    queue.park_run(db, "r1", "t1", clock.now_ms())  # the worker crashed
    claim(db, clock, token="t2")
    assert effects.interrupted_before(db, "r1", 2, clock.now_ms()) == list(keys)
    assert queue.park_run(db, "r1", "t2", clock.now_ms(), hold="effect", detail=f"ambiguous effect {keys[0]}")


def test_resolving_the_last_ambiguous_effect_releases_the_run(db: Database, clock: ManualClock) -> None:
    _held_ambiguous(db, clock, ("a", "b"))
    assert claim(db, clock, token="t3") is None  # held
    with pytest.raises(Rejected, match="resolve-effect"):
        runs.resume_run(db, "r1", clock.now_ms())
    receipt = effects.resolve(db, "r1", "a", applied=True, result={"ok": 1}, now=clock.now_ms())
    assert receipt["ambiguous"] == ["b"] and runs.hold_of(db, "r1") == "effect"
    effects.resolve(db, "r1", "b", applied=False, result=None, now=clock.now_ms())
    assert runs.hold_of(db, "r1") is None and runs.get_run(db, "r1").statusDetail is None
    assert (status(db, "a"), status(db, "b")) == ("applied", "pending")
    third = claim(db, clock, token="t3")
    assert third is not None
    assert reserve(db, clock, third.generation, key="a") == {"state": "applied", "result": {"ok": 1}}
    assert reserve(db, clock, third.generation, key="b") == {"state": "new"}


def test_a_run_paused_while_ambiguous_stays_paused_after_resolution(db: Database, clock: ManualClock) -> None:
    _held_ambiguous(db, clock)
    runs.pause_run(db, "r1", clock.now_ms())
    effects.resolve(db, "r1", "k", applied=True, result=None, now=clock.now_ms())
    assert runs.hold_of(db, "r1") == "paused"
    assert claim(db, clock, token="t3") is None


def test_only_an_ambiguous_effect_can_be_resolved(db: Database, clock: ManualClock) -> None:
    new_run(db, clock)
    reserve(db, clock, 1)
    with pytest.raises(Rejected, match="is pending, not ambiguous"):
        effects.resolve(db, "r1", "k", applied=True, result=None, now=clock.now_ms())
    with pytest.raises(NotFound):
        effects.resolve(db, "r1", "missing", applied=True, result=None, now=clock.now_ms())


def test_large_results_go_to_blobs_and_come_back(db: Database, clock: ManualClock) -> None:
    new_run(db, clock)
    reserve(db, clock, 1)
    effects.begin_apply(db, "r1", "k", generation=1, now=clock.now_ms())
    big = {"text": "x" * 10_000}
    effects.settle(db, "r1", "k", generation=1, result=big, now=clock.now_ms())
    assert reserve(db, clock, 2) == {"state": "applied", "result": big}
