"""What only several writers can show (PostgreSQL, READ COMMITTED), for the run side: two
stores on one database (two hosts), in deterministic interleavings — A's unit of work has
read or written and stays open, B acts meanwhile (and is seen waiting for A's lock where
it must wait), A commits, B goes on — so B's answer is the one SQLite's single writer gives.

SQLite has one writer at a time: these run on PostgreSQL only (``pytestmark``).
"""

from __future__ import annotations

from typing import Any

import pytest
import trio

from piwf.clock import ManualClock
from piwf.errors import ClaimLost, ConstraintViolation, Rejected, StoreError
from piwf.client import make_request
from piwf.wire import HostResponse, Outcome

from .helpers import LEASE, RUNNER, claim, claims, new_run, statuses
from .test_interleavings_people import interleave, waiting_for_a_lock

BIG = b"x" * 10_000  # a workflow source stored as a blob (over the inline limit)


# Only PostgreSQL: SQLite has one writer at a time, there is no interleaving to show.
pytestmark = pytest.mark.parametrize("backend", ["postgresql"], indirect=True)


@pytest.fixture
async def two(open_store: Any) -> tuple[Any, Any]:
    """Two stores on one database: two hosts' views of it."""
    return await open_store(), await open_store()


async def test_two_hosts_claiming_at_once_take_different_runs_without_waiting(two: Any, clock: ManualClock) -> None:
    a, b = two
    for run_id in ("r1", "r2"):
        await new_run(a, clock, run_id)
    async with a.transaction() as tx:
        first = await claims(tx, clock, room=1)
        with trio.fail_after(5):  # B skips A's locked row (SKIP LOCKED): it neither waits nor fails
            second = await claims(b, clock, room=1)
    assert [c.run_id for c, _ in first] == ["r1"] and [c.run_id for c, _ in second] == ["r2"]
    assert await claims(b, clock, room=2) == []


async def test_a_fence_holds_the_run_against_a_takeover_until_its_write_commits(two: Any, clock: ManualClock) -> None:
    a, b = two
    await new_run(a, clock)
    mine = await claim(a, clock)
    assert mine is not None
    clock.advance(LEASE - 1)
    async with a.transaction() as tx:
        await tx.queue.fenced_revision("r1", mine.token, clock.now_ms())
        clock.advance(2)  # the claim expires while A's fenced unit of work is open
        assert await claims(b, clock, epoch=2) == []  # the fenced row is locked: B passes it over
        await tx.runs.start_attempt("r1", mine.token, seq=0, node="n", generation=mine.generation,
                                    now=clock.now_ms() - 2)
    taken = await claim(b, clock, epoch=2)  # once A committed, the expired claim is B's
    assert taken is not None and taken.generation == mine.generation + 1
    with pytest.raises(ClaimLost):
        await a.queue.fenced_revision("r1", mine.token, clock.now_ms())


async def test_two_hosts_starting_a_run_of_one_session_at_once_make_one(two: Any, backend: Any,
                                                                       clock: ManualClock) -> None:
    a, b = two
    made, refused = await interleave(backend, lambda tx: new_run(tx, clock, "r1", session="s1"), a,
                                     lambda: new_run(b, clock, "r2", session="s1"))
    assert made is None
    assert isinstance(refused, Rejected) and "session s1 already has an active run r1" in str(refused)
    assert await statuses(a, "r1") == ("queued", "queued")


async def test_a_parked_run_is_not_claimed_again_while_its_session_starts_another(two: Any,
                                                                                clock: ManualClock) -> None:
    a, b = two
    await new_run(a, clock, "r1", session="s1")
    got = await claim(a, clock)
    assert got is not None and await a.queue.park_run("r1", got.token, clock.now_ms())
    async with a.transaction() as tx:  # A starts r2 of the session, not yet committed
        await new_run(tx, clock, "r2", session="s1")
        with trio.fail_after(5):  # B would claim r1 again: the session's lock says wait, so it passes it over
            assert await claims(b, clock, room=2) == []
    taken = await claims(b, clock, room=2)
    assert [c.run_id for c, _ in taken] == ["r2"]  # r1 waits for r2 to end
    assert (await b.runs.run_summary("r1")).queueStatus == "parked"


async def test_one_request_carried_out_by_two_hosts_is_recorded_once_and_adopted(two: Any, backend: Any,
                                                                               clock: ManualClock) -> None:
    a, b = two
    request = make_request("run.pause", client_id="c1", run_id="r1", request_id="q1")
    answer = HostResponse(requestId="q1", outcome=Outcome.ACCEPTED, receipt={"runId": "r1"}, revision=1)

    async def first(tx: Any) -> Any:
        assert await tx.commands.lookup(request, b"f") is None
        await new_run(tx, clock, "r1")
        await tx.commands.record(request, b"f", answer, 1, clock.now_ms())

    async def second() -> Any:
        async with b.transaction() as tx:
            return await tx.commands.lookup(request, b"f")  # waits for A's record, then finds it

    _, adopted = await interleave(backend, first, a, second)
    assert adopted.outcome == Outcome.ADOPTED and adopted.receipt == {"runId": "r1"}


async def test_a_blob_two_runs_store_at_once_is_stored_once(two: Any, backend: Any, clock: ManualClock) -> None:
    a, b = two

    async def create(store: Any, run_id: str) -> Any:
        return await store.runs.create_run(run_id=run_id, workflow="w", project_path="/p", source=BIG,
                                           digest="d1", input={}, origin_session_id=None, now=clock.now_ms())

    _, second = await interleave(backend, lambda tx: create(tx, "r1"), a, lambda: create(b, "r2"))
    assert second["runId"] == "r2"
    for store, run_id in ((a, "r1"), (b, "r2")):
        assert (await store.runs.run_source(run_id))[2] == "d1"


async def test_a_blob_whose_first_writer_rolled_back_is_stored_by_the_second(two: Any, backend: Any,
                                                                            clock: ManualClock) -> None:
    a, b = two
    outcome: dict[str, Any] = {}

    async def second() -> None:
        outcome["b"] = await b.runs.create_run(run_id="r2", workflow="w", project_path="/p", source=BIG,
                                               digest="d1", input={}, origin_session_id=None, now=clock.now_ms())

    async with trio.open_nursery() as nursery:  # waits for B once A has rolled back
        with pytest.raises(RuntimeError, match="A gives up"):
            async with a.transaction() as tx:
                await tx.runs.create_run(run_id="r1", workflow="w", project_path="/p", source=BIG, digest="d1",
                                         input={}, origin_session_id=None, now=clock.now_ms())
                nursery.start_soon(second)
                await waiting_for_a_lock(backend)
                raise RuntimeError("A gives up")
    assert outcome["b"]["runId"] == "r2" and (await b.runs.run_source("r2"))[0] == "w"


async def test_takeover_expires_only_the_claims_of_its_own_earlier_epoch(two: Any, backend: Any,
                                                                        clock: ManualClock) -> None:
    a, _ = two
    b = await backend.open(clock, directory="another-host")  # another state directory on the same store
    lease_a = await a.hosts.acquire_lease(host_id="ha", pid=1, identity="i", lease_ms=LEASE, now=clock.now_ms())
    await new_run(a, clock, "r1")
    await new_run(a, clock, "r2")
    ours = await claim(a, clock, epoch=lease_a.epoch)
    assert ours is not None and ours.run_id == "r1"
    # B is another host (another state directory) that restarts: epoch above A's, A still alive
    other = await b.hosts.acquire_lease(host_id="hb", pid=2, identity="i", lease_ms=LEASE, now=clock.now_ms())
    theirs = await b.supervision.claim_runs(room=1, exclude=frozenset(), runner_id=RUNNER, lease_ms=LEASE,
                                            now=clock.now_ms(), epoch=other.epoch)
    restarted = await b.hosts.acquire_lease(host_id="hb2", pid=3, identity="i", lease_ms=LEASE,
                                            now=clock.now_ms(), owner_dead=True)
    assert restarted.epoch > other.epoch > lease_a.epoch
    assert await b.queue.expire_claims_before(restarted.epoch, clock.now_ms()) == [theirs[0][0].run_id]
    await a.queue.fenced_revision("r1", ours.token, clock.now_ms())  # A's claim is still live
    await backend.close(b)


async def test_two_hosts_creating_one_run_id_at_once_make_it_once(two: Any, backend: Any,
                                                                 clock: ManualClock) -> None:
    a, b = two
    _, refused = await interleave(backend, lambda tx: new_run(tx, clock, "r1"), a, lambda: new_run(b, clock, "r1"))
    assert isinstance(refused, Rejected) and "run id r1 is already taken" in str(refused)


async def test_a_unit_of_work_whose_failed_statement_was_handled_commits_nothing(two: Any,
                                                                                clock: ManualClock) -> None:
    a, _ = two
    request = make_request("run.pause", client_id="c1", run_id="r1", request_id="q1")
    answer = HostResponse(requestId="q1", outcome=Outcome.ACCEPTED)
    with pytest.raises(StoreError, match="nothing of it was committed"):
        async with a.transaction() as tx:
            await tx.commands.record(request, b"f", answer, 1, clock.now_ms())
            with pytest.raises(ConstraintViolation):  # PostgreSQL aborts the transaction here
                await tx.commands.record(request, b"f", answer, 1, clock.now_ms())
    assert await a.commands.lookup(request, b"f") is None
