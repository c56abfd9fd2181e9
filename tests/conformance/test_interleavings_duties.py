"""The duties every host does that must happen once (issue 21: pruning, child-run watching,
housekeeping; deadline expiry and reconcile claims are in test_interleavings_people.py),
with two stores on one PostgreSQL database as two hosts, as deterministic interleavings:
A's transaction is open, B does the same duty meanwhile, A commits. Each item is handled by
one of them, never twice, and none is lost.

PostgreSQL only: SQLite has one writer at a time and one host per database.
"""

from __future__ import annotations

from typing import Any

import pytest
import trio

from piwf.client import make_request
from piwf.clock import ManualClock
from piwf.protocol.worker import InteractionOpenPayload
from piwf.wire import HostResponse, request_fingerprint

from .controllers import C, P, detail, fenced, reconciled
from .helpers import claim, new_run
from .test_interleavings_people import two, waiting_for_a_lock  # noqa: F401 (two: a fixture)
from .test_retention import ended

pytestmark = pytest.mark.parametrize("backend", ["postgresql"], indirect=True)


async def test_two_hosts_pruning_at_once_take_different_runs_without_waiting(
        two: Any, backend: Any, clock: ManualClock) -> None:  # noqa: F811
    a, b = two
    for n in range(4):
        await ended(a, clock, f"r{n}")
    cut_off = clock.now_ms()
    async with a.transaction() as tx:
        mine = await tx.retention.prune_runs(ended_before=cut_off, now=clock.now_ms(), limit=2)
        with trio.fail_after(10):  # B does not wait for A's open batch: it takes the next runs
            theirs = await b.retention.prune_runs(ended_before=cut_off, now=clock.now_ms(), limit=2)
            nothing = await b.retention.prune_runs(ended_before=cut_off, now=clock.now_ms(), limit=2)
    assert mine.runs == ["r0", "r1"] and theirs.runs == ["r2", "r3"]
    assert nothing.runs == []  # A's are locked until it commits, and gone after: none deleted twice
    assert (await a.retention.prunable_runs(ended_before=cut_off)) == (0, [])


async def test_a_prune_that_rolls_back_leaves_its_runs_to_the_next(
        two: Any, backend: Any, clock: ManualClock) -> None:  # noqa: F811
    a, b = two
    for n in range(2):
        await ended(a, clock, f"r{n}")
    cut_off = clock.now_ms()

    class Died(Exception):
        pass

    with pytest.raises(Died):
        async with a.transaction() as tx:  # a host that dies mid-batch
            assert (await tx.retention.prune_runs(ended_before=cut_off, now=clock.now_ms())).runs == ["r0", "r1"]
            raise Died
    assert (await b.retention.prune_runs(ended_before=cut_off, now=clock.now_ms())).runs == ["r0", "r1"]


async def _child_waiting(store: Any, clock: ManualClock) -> Any:
    """A resource whose reconcile started the child run ``child`` (recorded ``running``),
    which now waits for an answer: the resource's claim."""
    c = await reconciled(store, clock)
    await new_run(store, clock, "child")
    await fenced(store, clock, c, lambda tx: tx.controller_effects.record_child(
        c.uid, "build", "w", {"n": 1}, "child", clock.now))
    got = await claim(store, clock)
    assert got is not None and got.run_id == "child"
    attempt_id, _ = await store.runs.start_attempt("child", got.token, seq=0, node="ask", generation=got.generation,
                                                   now=clock.now_ms())
    await store.interactions.open_request("child", got.token, InteractionOpenPayload(
        attemptId=attempt_id, kind="ask", title="How many?"), clock.now_ms())
    assert (await store.runs.run_summary("child")).status == "waiting"
    return c


async def test_a_child_run_synced_by_two_hosts_never_moves_back(
        two: Any, backend: Any, open_store: Any, clock: ManualClock) -> None:  # noqa: F811
    """B reads the child waiting and waits for the resource's lock; meanwhile the child ends
    and A, holding the lock, records that: B, going on, must not write its older state over
    A's (the resource would be told `waiting` after `failed`)."""
    a, b = two
    third = await open_store()
    c = await _child_waiting(a, clock)
    outcome: dict[str, Any] = {}

    async def sync_b() -> None:
        outcome["b"] = await b.controller_effects.sync_children(clock.now)

    async with trio.open_nursery() as nursery, a.transaction() as tx:
        await tx.controllers.request_reconcile(P, C, "a", clock.now)  # A holds the resource's lock
        nursery.start_soon(sync_b)
        await waiting_for_a_lock(backend)  # B has read the child waiting
        assert await third.queue.cancel_run("child", clock.now_ms(), any_claim=True)  # the child ends
        outcome["a"] = await tx.controller_effects.sync_children(clock.now)
    assert outcome["a"] == [c.uid]
    assert outcome["b"] == []  # read again under the lock: nothing left to record
    found = await a.controller_effects.find_child(c.uid, "build", "w", {"n": 1})
    assert found["state"] == "failed"
    got = await detail(a, clock)
    assert got.status["workflowRun"]["state"] == "failed"
    assert [e.type for e in got.events].count("workflow_changed") == 1


async def test_housekeeping_prunes_are_done_by_one_host_at_a_time(
        two: Any, backend: Any, clock: ManualClock) -> None:  # noqa: F811
    """The command log's prune (and delivery's, and stored worker answers'): while one host
    does it, another skips it at once instead of waiting for its deletes."""
    a, b = two
    request = make_request("run.pause", client_id="c", run_id="r1", request_id="req-1")
    async with a.transaction() as tx:
        await tx.commands.record(request, request_fingerprint(request), HostResponse(request.requestId, "accepted",
                                                                                     receipt={"n": 1}), 1, 0)
    now = clock.now_ms() + 10_000
    async with a.transaction() as tx:
        assert await tx.commands.prune(now, 1000) == 1
        with trio.fail_after(10):  # B does not wait for A's open prune: it leaves it to A
            assert await b.commands.prune(now, 1000) == 0
            assert await b.delivery.prune(now, 1000) == 0
            assert await b.workers.prune_messages() == 0
        assert await tx.delivery.prune(now, 1000) == 0
    assert await b.commands.prune(now, 1000) == 0  # done once, by A
    assert await b.commands.lookup(request, request_fingerprint(request)) is None
