"""A run's effect ledger: reserve, apply, settle, observe, ambiguity and its resolution,
each write fenced to the claim generation that made it."""

from __future__ import annotations

from typing import Any

import pytest

from piwf.clock import ManualClock
from piwf.errors import NotFound, Rejected

from .helpers import claim, new_run


async def reserve(store: Any, clock: ManualClock, generation: int, *, key: str = "k",
                  observable: bool = False) -> dict[str, Any]:
    return await store.effects.reserve("r1", key, node="n", generation=generation, observable=observable,
                                       now=clock.now_ms())


async def status(store: Any, key: str = "k") -> str:
    return {e.key: e.status for e in (await store.runs.get_run("r1")).effects}[key]


async def begin(store: Any, clock: ManualClock, generation: int, key: str = "k") -> None:
    await store.effects.begin_apply("r1", key, generation=generation, now=clock.now_ms())


async def test_an_effect_is_reserved_applied_and_settled_then_returned_without_applying(
        store: Any, clock: ManualClock) -> None:
    await new_run(store, clock)
    assert await reserve(store, clock, 1) == {"state": "new"}
    assert await status(store) == "pending"
    await begin(store, clock, 1)
    assert await status(store) == "applying"
    await store.effects.settle("r1", "k", generation=1, result={"id": 7}, now=clock.now_ms())
    assert await reserve(store, clock, 2) == {"state": "applied", "result": {"id": 7}}
    assert await status(store) == "applied"


async def test_a_rejected_effect_returns_its_error_and_is_never_applied_again(store: Any, clock: ManualClock) -> None:
    await new_run(store, clock)
    await reserve(store, clock, 1)
    await begin(store, clock, 1)
    await store.effects.settle("r1", "k", generation=1, error={"type": "IOError", "message": "no"},
                               now=clock.now_ms())
    assert await reserve(store, clock, 2) == {"state": "rejected", "error": {"type": "IOError", "message": "no"}}
    with pytest.raises(Rejected, match="is rejected; it cannot be applied"):
        await begin(store, clock, 1)
    assert await status(store) == "rejected"


async def test_a_pending_effect_of_an_earlier_generation_is_simply_applied(store: Any, clock: ManualClock) -> None:
    await new_run(store, clock)
    await reserve(store, clock, 1)  # the worker died before apply() started
    assert await reserve(store, clock, 2) == {"state": "new"}
    await begin(store, clock, 2)
    assert await status(store) == "applying"


async def test_an_interrupted_apply_is_observed_when_observable_else_ambiguous(store: Any,
                                                                               clock: ManualClock) -> None:
    await new_run(store, clock)
    await reserve(store, clock, 1)
    await begin(store, clock, 1)
    assert await reserve(store, clock, 2, observable=True) == {"state": "observe"}
    assert await status(store) == "applying"  # still unknown until the observation settles it
    assert await reserve(store, clock, 3, observable=False) == {"state": "ambiguous"}
    assert await status(store) == "ambiguous"
    assert await reserve(store, clock, 4, observable=True) == {"state": "ambiguous"}  # only an operator decides now


async def test_observed_not_applied_applies_again_in_the_same_generation(store: Any, clock: ManualClock) -> None:
    await new_run(store, clock)
    await reserve(store, clock, 1)
    await begin(store, clock, 1)
    await reserve(store, clock, 2, observable=True)
    await begin(store, clock, 2)
    await store.effects.settle("r1", "k", generation=2, result=1, now=clock.now_ms())
    assert await status(store) == "applied"


async def test_writes_for_another_generation_are_refused_and_change_nothing(store: Any, clock: ManualClock) -> None:
    await new_run(store, clock)
    await reserve(store, clock, 1)
    with pytest.raises(Rejected, match="generation 1, not 2"):
        await begin(store, clock, 2)
    with pytest.raises(Rejected, match="in progress in this attempt"):
        await reserve(store, clock, 1)
    with pytest.raises(Rejected, match="not applying"):
        await store.effects.settle("r1", "k", generation=1, result=None, now=clock.now_ms())
    with pytest.raises(Rejected, match="never reserved"):
        await store.effects.settle("r1", "other", generation=1, result=None, now=clock.now_ms())
    assert await status(store) == "pending"
    await begin(store, clock, 1)
    with pytest.raises(Rejected):
        await store.effects.settle("r1", "k", generation=2, result=None, now=clock.now_ms())
    assert await status(store) == "applying"


async def held_ambiguous(store: Any, clock: ManualClock, keys: tuple[str, ...] = ("k",)) -> None:
    await new_run(store, clock)
    first = await claim(store, clock)
    for key in keys:
        await reserve(store, clock, 1, key=key)
        await begin(store, clock, 1, key)
    await store.queue.park_run("r1", first.token, clock.now_ms())  # the worker crashed
    second = await claim(store, clock)
    assert await store.effects.interrupted_before("r1", 2, clock.now_ms()) == list(keys)
    assert await store.effects.interrupted_before("r1", 2, clock.now_ms()) == list(keys)  # every ambiguous key
    assert {await status(store, key) for key in keys} == {"ambiguous"}
    assert await store.queue.park_run("r1", second.token, clock.now_ms(), hold="effect",
                                      detail=f"ambiguous effect {keys[0]}")


async def test_interrupted_before_leaves_the_current_generation_alone(store: Any, clock: ManualClock) -> None:
    await new_run(store, clock)
    await reserve(store, clock, 2)
    await begin(store, clock, 2)
    assert await store.effects.interrupted_before("r1", 2, clock.now_ms()) == []
    assert await status(store) == "applying"


async def test_resolving_the_last_ambiguous_effect_releases_the_run(store: Any, clock: ManualClock) -> None:
    await held_ambiguous(store, clock, ("a", "b"))
    assert (await store.runs.status_counts(clock.now_ms()))["ambiguousEffects"] == 2  # seed: host.status counts them
    assert await claim(store, clock) is None  # held
    with pytest.raises(Rejected, match="resolve-effect"):
        await store.runs.resume_run("r1", clock.now_ms())
    receipt = await store.effects.resolve("r1", "a", applied=True, result={"ok": 1}, now=clock.now_ms())
    assert receipt["ambiguous"] == ["b"] and await store.runs.hold_of("r1") == "effect"
    assert (await store.runs.status_counts(clock.now_ms()))["ambiguousEffects"] == 1
    await store.effects.resolve("r1", "b", applied=False, result=None, now=clock.now_ms())
    assert await store.runs.hold_of("r1") is None and (await store.runs.get_run("r1")).statusDetail is None
    assert (await store.runs.status_counts(clock.now_ms()))["ambiguousEffects"] == 0
    assert (await status(store, "a"), await status(store, "b")) == ("applied", "pending")
    third = await claim(store, clock)
    assert third is not None
    assert await reserve(store, clock, third.generation, key="a") == {"state": "applied", "result": {"ok": 1}}
    assert await reserve(store, clock, third.generation, key="b") == {"state": "new"}


async def test_a_run_paused_while_ambiguous_stays_paused_after_resolution(store: Any, clock: ManualClock) -> None:
    await held_ambiguous(store, clock)
    await store.runs.pause_run("r1", clock.now_ms())
    await store.effects.resolve("r1", "k", applied=True, result=None, now=clock.now_ms())
    assert await store.runs.hold_of("r1") == "paused"
    assert await claim(store, clock) is None


async def test_only_an_ambiguous_effect_can_be_resolved(store: Any, clock: ManualClock) -> None:
    await new_run(store, clock)
    await reserve(store, clock, 1)
    with pytest.raises(Rejected, match="is pending, not ambiguous"):
        await store.effects.resolve("r1", "k", applied=True, result=None, now=clock.now_ms())
    with pytest.raises(NotFound):
        await store.effects.resolve("r1", "missing", applied=True, result=None, now=clock.now_ms())
    assert await status(store) == "pending"


async def test_large_results_are_kept_whole(store: Any, clock: ManualClock) -> None:
    await new_run(store, clock)
    await reserve(store, clock, 1)
    await begin(store, clock, 1)
    big = {"text": "x" * 10_000}
    await store.effects.settle("r1", "k", generation=1, result=big, now=clock.now_ms())
    assert await reserve(store, clock, 2) == {"state": "applied", "result": big}
