"""The idempotent command log, and the unit of work a write request is carried out in."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from piwf.client import make_request
from piwf.clock import ManualClock
from piwf.errors import ConstraintViolation, NotFound, Rejected
from piwf.wire import HostRequest, HostResponse, request_fingerprint

from .helpers import new_run

RETENTION_MS = 7 * 24 * 3600 * 1000


async def execute(store: Any, clock: ManualClock, request: HostRequest, calls: list[int],
                  fail: bool = False) -> HostResponse:
    """A write request as the host carries it out: lookup, the operation, record, one unit of work."""
    fingerprint = request_fingerprint(request)
    async with store.transaction() as tx:
        stored = await tx.commands.lookup(request, fingerprint)
        if stored is not None:
            return stored
        await tx.runs.pause_run(request.runId or "r1", clock.now_ms())
        calls.append(1)
        if fail:
            raise Rejected("refused after a change")
        response = HostResponse(request.requestId, "accepted", receipt={"n": len(calls)})
        await tx.commands.record(request, fingerprint, response, 1, clock.now_ms())
        return response


def pause(request_id: str, run_id: str = "r1", client: str = "c", **kw: Any) -> HostRequest:
    return make_request("run.pause", client_id=client, run_id=run_id, request_id=request_id, **kw)


async def test_repeated_request_id_is_adopted_with_the_stored_receipt(store: Any, clock: ManualClock) -> None:
    await new_run(store, clock)
    calls: list[int] = []
    request = pause("q1")
    assert (await execute(store, clock, request, calls)).outcome == "accepted"
    again = await execute(store, clock, request, calls)
    assert (again.outcome, again.receipt, len(calls)) == ("adopted", {"n": 1}, 1)


async def test_same_request_id_with_another_body_is_a_conflict(store: Any, clock: ManualClock) -> None:
    await new_run(store, clock)
    await new_run(store, clock, "other")
    calls: list[int] = []
    await execute(store, clock, pause("q1"), calls)
    other = await execute(store, clock, pause("q1", "other"), calls)
    assert other.outcome == "conflict" and "requestId" in other.error and len(calls) == 1
    assert not await store.runs.is_paused("other")


async def test_idempotency_key_adopts_a_retry_under_a_new_request_id(store: Any, clock: ManualClock) -> None:
    for run_id in ("r", "x"):
        await new_run(store, clock, run_id)
    calls: list[int] = []

    async def send(client: str, run: str, request_id: str) -> HostResponse:
        return await execute(store, clock, pause(request_id, run, client, idempotency_key="k"), calls)

    await send("c", "r", "q1")
    retry = await send("c", "r", "q2")
    assert retry.outcome == "adopted" and retry.requestId == "q2" and len(calls) == 1
    other = await send("c", "x", "q3")
    assert other.outcome == "conflict" and "idempotencyKey" in other.error
    assert (await send("d", "x", "q4")).outcome == "accepted"  # keys belong to one client


async def test_a_refused_operation_rolls_its_unit_of_work_back_and_leaves_no_log_entry(
        store: Any, clock: ManualClock) -> None:
    await new_run(store, clock)
    request = pause("q1")
    with pytest.raises(Rejected):
        await execute(store, clock, request, [], fail=True)
    assert not await store.runs.is_paused("r1")  # the pause inside the unit of work went with it
    assert await store.commands.lookup(request, request_fingerprint(request)) is None
    assert (await execute(store, clock, request, [])).outcome == "accepted"


async def test_a_request_id_recorded_twice_is_a_constraint_violation(store: Any, clock: ManualClock) -> None:
    request = pause("q1")
    fingerprint = request_fingerprint(request)
    response = HostResponse("q1", "accepted")
    await store.commands.record(request, fingerprint, response, 1, clock.now_ms())
    with pytest.raises(ConstraintViolation):
        await store.commands.record(request, fingerprint, response, 1, clock.now_ms())


async def test_a_unit_of_work_commits_all_its_changes_together(store: Any, clock: ManualClock) -> None:
    async with store.transaction() as tx:
        await tx.runs.create_run(run_id="a", workflow="w", project_path="/p", source=b"s", digest="d", input=None,
                                 origin_session_id=None, now=clock.now_ms())
        await tx.runs.create_run(run_id="b", workflow="w", project_path="/p", source=b"s", digest="d", input=None,
                                 origin_session_id=None, now=clock.now_ms())
    assert {r.runId for r in await store.runs.list_runs()} == {"a", "b"}
    with pytest.raises(Rejected):
        async with store.transaction() as tx:
            await tx.runs.create_run(run_id="c", workflow="w", project_path="/p", source=b"s", digest="d",
                                     input=None, origin_session_id=None, now=clock.now_ms())
            await tx.runs.create_run(run_id="a", workflow="w", project_path="/p", source=b"s", digest="d",
                                     input=None, origin_session_id=None, now=clock.now_ms())
    with pytest.raises(NotFound):
        await store.runs.get_run("c")


async def test_the_log_is_pruned_after_retention(store: Any, clock: ManualClock) -> None:
    request = make_request("host.stop", client_id="c", request_id="q1")
    fingerprint = request_fingerprint(request)
    await store.commands.record(request, fingerprint, HostResponse("q1", "accepted"), 1, 1000)
    assert await store.commands.prune(now=1000 + RETENTION_MS - 1) == 0
    assert await store.commands.lookup(request, fingerprint) is not None
    assert await store.commands.prune(now=1000 + RETENTION_MS + 1) == 1
    assert await store.commands.lookup(request, fingerprint) is None
    await store.commands.record(request, fingerprint, HostResponse("q1", "accepted"), 1, 5000)
    assert await store.commands.prune(now=5000 + 11, retention_ms=10) == 1


async def test_a_request_recorded_meanwhile_by_another_store_is_a_constraint_violation(
        store: Any, open_store: Any, clock: ManualClock) -> None:
    other = await open_store()
    request = pause("q1")
    fingerprint = request_fingerprint(request)
    assert await store.commands.lookup(request, fingerprint) is None
    assert await other.commands.lookup(request, fingerprint) is None  # both found it new
    await other.commands.record(request, fingerprint, HostResponse("q1", "accepted", receipt={"by": "other"}), 2,
                                clock.now_ms())
    with pytest.raises(ConstraintViolation):
        async with store.transaction() as tx:
            await tx.commands.record(request, fingerprint, HostResponse("q1", "accepted"), 1, clock.now_ms())
    adopted = await store.commands.lookup(request, fingerprint)
    assert (adopted.outcome, adopted.receipt) == ("adopted", {"by": "other"})


class OwnKey(msgspec.Struct):
    """A write request of neither the host's envelope nor its protocol: only what the log reads."""

    requestId: str
    clientId: str
    idempotencyKey: str
    operation: str
    runId: str | None = None
    body: int = 0


async def test_the_log_takes_a_command_key_not_the_hosts_requests(store: Any, clock: ManualClock) -> None:
    """The interface names a CommandKey (ids, operation, run), not the host protocol's
    request types; any request with those is logged and replayed."""
    from piwf.store.api import CommandsStore, types

    for method in (CommandsStore.lookup, CommandsStore.record):  # annotations are strings (PEP 563)
        assert method.__annotations__["request"] == "CommandKey", method
    assert {"requestId", "clientId", "idempotencyKey", "operation", "runId"} <= set(vars(types.CommandKey))
    await new_run(store, clock)
    request = OwnKey("q1", "c", "k", "run.pause", "r1")
    fingerprint = request_fingerprint(request)
    async with store.transaction() as tx:
        assert await tx.commands.lookup(request, fingerprint) is None
        await tx.commands.record(request, fingerprint, HostResponse("q1", "accepted", receipt={"n": 1}), 1,
                                 clock.now_ms())
    again = await store.commands.lookup(OwnKey("q2", "c", "k", "run.pause", "r1"), fingerprint)
    assert again is not None and (again.outcome, again.receipt) == ("adopted", {"n": 1})
    other = OwnKey("q3", "c", "k", "run.pause", "r1", body=1)
    refused = await store.commands.lookup(other, request_fingerprint(other))
    assert refused is not None and refused.outcome == "conflict"
