"""Run settings: a scope per run, changes as a compare-and-set on the change number,
request keys, and the change each attempt started under."""

from __future__ import annotations

from typing import Any

import pytest

from piwf.clock import ManualClock
from piwf.errors import Conflict, NotFound, Rejected

from .helpers import claim


async def new_run(store: Any, clock: ManualClock, run_id: str = "r1", *, with_settings: bool = True) -> str | None:
    await store.runs.create_run(run_id=run_id, workflow="w", project_path="/p", source=b"s", digest="d", input=None,
                                origin_session_id=None, now=clock.now_ms())
    clock.advance(1)
    if not with_settings:
        return None
    return await store.settings.ensure_scope(run_id, settings={"budget": 1}, mutable=["budget"], patch=None,
                                             actor_id="c", now=clock.now_ms())


async def change(store: Any, clock: ManualClock, scope: str, base: int, budget: int, *, expected: int | None = None,
                 key: str | None = None, run_id: str = "r1") -> tuple[int, bool]:
    receipt, adopted = await store.settings.change_settings(
        run_id, scope_id=scope, base=base, expected=expected, patch={"budget": budget}, settings={"budget": budget},
        actor="client" if key is None else "controller", actor_id="c", now=clock.now_ms(), request_key=key)
    return receipt.changeNumber, adopted


async def test_a_scope_is_made_once_with_change_0(store: Any, clock: ManualClock) -> None:
    scope = await new_run(store, clock)
    assert scope is not None
    again = await store.settings.ensure_scope("r1", settings={"budget": 9}, mutable=[], patch=None, actor_id=None,
                                              now=1)
    assert again == scope
    shown = await store.settings.get_settings("r1")
    # made once; its mutable paths are the workflow's as it is now (a run resumed on an edited file)
    assert (shown.changeNumber, shown.settings, shown.mutable) == (0, {"budget": 1}, [])
    assert [(c.changeNumber, c.actor, c.patch) for c in shown.changes] == [(0, "start", {})]
    assert await store.settings.find_scope("r1", scope) == (scope, 0, {"budget": 1})
    assert await store.settings.find_scope("r1") == (scope, 0, {"budget": 1})
    assert (await store.settings.get_settings("r1", scope)).changeNumber == 0


async def test_changes_are_a_compare_and_set_on_the_change_number(store: Any, clock: ManualClock) -> None:
    scope = await new_run(store, clock)
    assert await change(store, clock, scope, 0, 5, expected=0) == (1, False)
    with pytest.raises(Conflict, match="at change 1, not 0"):
        await change(store, clock, scope, 0, 6, expected=0)
    with pytest.raises(Conflict, match="changed while the patch was checked"):
        await change(store, clock, scope, 0, 6)  # checked against change 0, committed after change 1
    assert (await store.settings.get_settings("r1")).settings == {"budget": 5}
    assert await change(store, clock, scope, 1, 7) == (2, False)
    shown = await store.settings.get_settings("r1")
    assert shown.settings == {"budget": 7} and [c.changeNumber for c in shown.changes] == [0, 1, 2]
    events = [e.type for e in (await store.runs.run_events("r1")).events]
    assert events.count("settings.changed") == 2


async def test_a_request_key_makes_one_change_however_often_it_comes(store: Any, clock: ManualClock) -> None:
    scope = await new_run(store, clock)
    assert await change(store, clock, scope, 0, 5, key="k") == (1, False)
    assert await change(store, clock, scope, 0, 5, key="k") == (1, True)  # stale base and all: it is the same change
    assert (await store.settings.prior_change("r1", "k")).changeNumber == 1
    assert (await store.settings.prior_change("r1", "k", scope, {"budget": 5})).changeNumber == 1
    assert await store.settings.prior_change("r1", "other") is None
    await store.queue.cancel_run("r1", clock.now_ms())
    assert await change(store, clock, scope, 1, 5, key="k") == (1, True)  # a retry after the run ended still adopts
    with pytest.raises(Rejected, match="has ended"):
        await change(store, clock, scope, 1, 6, key="new")


async def test_a_request_key_names_one_change(store: Any, clock: ManualClock) -> None:
    scope = await new_run(store, clock)
    assert await change(store, clock, scope, 0, 5, key="k") == (1, False)
    assert await change(store, clock, scope, 1, 5, key="k") == (1, True)  # the same change again: adopted
    with pytest.raises(Conflict, match="request key 'k' was used for another settings patch"):
        await change(store, clock, scope, 1, 6, key="k")
    with pytest.raises(Conflict):
        await store.settings.prior_change("r1", "k", scope, {"budget": 6})
    assert (await store.settings.get_settings("r1")).settings == {"budget": 5}


async def test_refusals_change_nothing(store: Any, clock: ManualClock) -> None:
    scope = await new_run(store, clock)
    await new_run(store, clock, "plain", with_settings=False)
    with pytest.raises(Rejected, match="declares none"):
        await store.settings.find_scope("plain")
    with pytest.raises(NotFound):
        await store.settings.find_scope("nope")
    with pytest.raises(NotFound):
        await store.settings.find_scope("r1", "settings-other")
    with pytest.raises(NotFound):
        await store.settings.get_settings("nope")
    with pytest.raises(Rejected, match="limit"):
        await store.settings.change_settings("r1", scope_id=scope, base=0, expected=None, patch={},
                                             settings="x" * 70_000, actor="client", actor_id=None, now=clock.now_ms())
    with pytest.raises((NotFound, Rejected)):
        await store.settings.change_settings("plain", scope_id=scope, base=0, expected=None, patch={"budget": 2},
                                             settings={"budget": 2}, actor="client", actor_id=None,
                                             now=clock.now_ms())
    assert (await store.settings.get_settings("r1")).changeNumber == 0


async def test_each_attempt_records_the_change_it_started_under(store: Any, clock: ManualClock) -> None:
    scope = await new_run(store, clock)
    await new_run(store, clock, "plain", with_settings=False)
    one = await claim(store, clock)
    two = await claim(store, clock)
    assert (one.run_id, two.run_id) == ("r1", "plain")
    first, _ = await store.runs.start_attempt("r1", one.token, seq=0, node="a", generation=1, now=clock.now_ms())
    await change(store, clock, scope, 0, 5)
    await store.runs.accept_attempt("r1", one.token, attempt_id=first, output=1, exit_name="next", now=clock.now_ms())
    # begin_attempt: start_attempt, and the change number its insert recorded (what the host
    # answers a worker with, reading the settings only when there is one)
    second, revision, started = await store.runs.begin_attempt("r1", one.token, seq=1, node="b", generation=1,
                                                               now=clock.now_ms())
    assert (started, revision) == (1, await store.queue.revision_of("r1"))
    assert await store.settings.attempt_settings("r1", first) == (0, {"budget": 1})
    assert await store.settings.attempt_settings("r1", second) == (1, {"budget": 5})
    assert [s.settingsChange for s in (await store.runs.get_run("r1")).steps] == [0, 1]
    plain, _, started = await store.runs.begin_attempt("plain", two.token, seq=0, node="a", generation=1,
                                                       now=clock.now_ms())
    assert started is None
    assert await store.settings.attempt_settings("plain", plain) == (None, None)
    assert (await store.runs.get_run("plain")).steps[0].settingsChange is None
