"""Every run-queue transition and every refused one (seed 003): claims, fences, ends."""

from __future__ import annotations

from typing import Any

import pytest

from piwf.clock import ManualClock
from piwf.errors import ClaimLost, NotFound, Rejected
from piwf.store.api import RunLaunch
from piwf.store.api.rules import input_hash

from .helpers import LEASE, RUNNER, claim, claims, new_run, statuses


async def test_new_run_is_queued(store: Any, clock: ManualClock) -> None:
    await new_run(store, clock)
    assert await statuses(store) == ("queued", "queued")
    assert (await store.runs.get_run("r1")).input == {"n": 1}


async def test_claim_starts_the_run_and_bumps_generation(store: Any, clock: ManualClock) -> None:
    await new_run(store, clock)
    first = await claim(store, clock)
    assert first is not None and first.generation == 1 and first.expires_at == clock.now_ms() + LEASE
    assert await statuses(store) == ("running", "starting")
    assert await claim(store, clock) is None  # a live claim is not claimable


async def test_a_claim_carries_what_its_worker_is_launched_with(store: Any, clock: ManualClock) -> None:
    """The launch (workflow, project, digest, input hash) is read in the claim's own
    transaction: the host launches the worker without reading the run again."""
    await new_run(store, clock, "r1", input={"n": 7, "s": "x"})
    await new_run(store, clock, "r2", input=[1, 2])
    big = {"text": "é" * 5000, "x": 1.5}  # kept as a blob, not in the run's row
    await new_run(store, clock, "r3", input=big)
    got = await claims(store, clock, room=3)
    assert [(c.run_id, c.launch) for c, _ in got] == [
        ("r1", RunLaunch("w", "/p", "d1", input_hash({"n": 7, "s": "x"}))),
        ("r2", RunLaunch("w", "/p", "d1", input_hash([1, 2]))),
        ("r3", RunLaunch("w", "/p", "d1", input_hash(big)))]
    await store.queue.park_run("r1", got[0][0].token, clock.now_ms())
    ((again, _),) = await claims(store, clock, room=3)  # claimed again: its run was running already
    assert (again.run_id, again.generation, again.launch) == ("r1", 2, got[0][0].launch)


async def test_expired_claim_is_claimable_again_with_a_new_generation_and_the_old_token_is_fenced_off(
        store: Any, clock: ManualClock) -> None:
    await new_run(store, clock)
    first = await claim(store, clock)
    clock.advance(LEASE)
    second = await claim(store, clock)
    assert second is not None and second.generation == first.generation + 1 and second.token != first.token
    with pytest.raises(ClaimLost):
        await store.queue.fenced_revision("r1", first.token, clock.now_ms())
    assert await store.queue.fenced_revision("r1", second.token, clock.now_ms()) == await store.runs.revision("r1")


async def test_renew_extends_only_live_claims(store: Any, clock: ManualClock) -> None:
    await new_run(store, clock)
    await new_run(store, clock, "r2")
    first = await claim(store, clock)
    other = await claim(store, clock)
    clock.advance(LEASE - 1)
    assert await store.queue.renew_claims([("r1", first.token), ("r2", "wrong")], LEASE, clock.now_ms()) == {"r2"}
    clock.advance(LEASE - 1)
    await store.queue.fenced_revision("r1", first.token, clock.now_ms())  # renewed: still live
    clock.advance(1)
    assert await store.queue.renew_claims([("r1", first.token), ("r2", other.token)], LEASE, clock.now_ms()) == {
        "r1", "r2"}
    assert await store.queue.renew_claims([], LEASE, clock.now_ms()) == set()


async def test_mark_running_is_fenced(store: Any, clock: ManualClock) -> None:
    await new_run(store, clock)
    got = await claim(store, clock)
    with pytest.raises(ClaimLost):
        await store.queue.mark_running("r1", "wrong", clock.now_ms())
    assert await statuses(store) == ("running", "starting")
    assert await store.queue.mark_running("r1", got.token, clock.now_ms())
    assert await statuses(store) == ("running", "running")
    assert not await store.queue.mark_running("r1", got.token, clock.now_ms())  # already running


async def test_park_releases_the_claim(store: Any, clock: ManualClock) -> None:
    await new_run(store, clock)
    got = await claim(store, clock)
    assert not await store.queue.park_run("r1", "wrong", clock.now_ms())
    assert await statuses(store) == ("running", "starting")
    assert await store.queue.park_run("r1", got.token, clock.now_ms())
    assert await statuses(store) == ("running", "parked")
    assert not await store.queue.park_run("r1", got.token, clock.now_ms())  # no longer claimed
    again = await claim(store, clock)
    assert again is not None and again.generation == 2


async def test_park_with_hold_is_not_claimed_until_resumed(store: Any, clock: ManualClock) -> None:
    await new_run(store, clock)
    got = await claim(store, clock)
    assert await store.queue.park_run("r1", got.token, clock.now_ms(), hold="source", detail="workflow source changed")
    assert (await store.runs.get_run("r1")).statusDetail == "workflow source changed"
    assert await store.runs.hold_of("r1") == "source"
    assert await claim(store, clock) is None
    await store.runs.resume_run("r1", clock.now_ms())
    assert await store.runs.hold_of("r1") is None
    assert await claim(store, clock) is not None


async def test_complete_and_fail_need_the_live_token(store: Any, clock: ManualClock) -> None:
    await new_run(store, clock)
    await new_run(store, clock, "r2")
    one = await claim(store, clock)
    two = await claim(store, clock)
    with pytest.raises(ClaimLost):
        await store.queue.complete_run("r1", two.token, {"x": 1}, clock.now_ms())
    assert await statuses(store) == ("running", "starting")
    revision = await store.queue.complete_run("r1", one.token, {"x": 1}, clock.now_ms())
    assert revision == await store.runs.revision("r1")
    assert await statuses(store) == ("completed", "done")
    assert (await store.runs.get_run("r1")).output == {"x": 1}
    await store.queue.fail_run("r2", two.token, {"type": "ValueError", "message": "bad"}, clock.now_ms())
    assert await statuses(store, "r2") == ("failed", "failed")
    assert (await store.runs.get_run("r2")).error["message"] == "bad"
    with pytest.raises(ClaimLost):
        await store.queue.complete_run("r2", two.token, None, clock.now_ms())  # settled runs take no writes
    with pytest.raises(ClaimLost):
        await store.queue.fail_run("r1", one.token, {"type": "E", "message": "late"}, clock.now_ms())
    assert await statuses(store, "r2") == ("failed", "failed")


async def test_expired_claim_cannot_complete(store: Any, clock: ManualClock) -> None:
    await new_run(store, clock)
    got = await claim(store, clock)
    clock.advance(LEASE)
    with pytest.raises(ClaimLost):
        await store.queue.complete_run("r1", got.token, None, clock.now_ms())
    assert await statuses(store) == ("running", "starting")


async def test_cancel_unclaimed_runs_without_a_token(store: Any, clock: ManualClock) -> None:
    await new_run(store, clock)
    assert await store.queue.cancel_run("r1", clock.now_ms())
    assert await statuses(store) == ("cancelled", "cancelled")
    assert not await store.queue.cancel_run("r1", clock.now_ms())  # already ended


async def test_cancel_of_a_claimed_run_needs_its_token(store: Any, clock: ManualClock) -> None:
    await new_run(store, clock)
    got = await claim(store, clock)
    assert not await store.queue.cancel_run("r1", clock.now_ms())
    assert not await store.queue.cancel_run("r1", clock.now_ms(), token="wrong")
    assert await statuses(store) == ("running", "starting")
    assert await store.queue.cancel_run("r1", clock.now_ms(), token=got.token)
    assert await statuses(store) == ("cancelled", "cancelled")
    assert await claim(store, clock) is None


async def test_cancel_of_a_claimed_run_by_its_runner_needs_no_token_and_fences_the_claim(
        store: Any, clock: ManualClock) -> None:
    """The runner that holds the live claim may cancel without naming its token (a host
    whose claim committed before it took the run up); another runner may not."""
    await new_run(store, clock)
    got = await claim(store, clock)
    assert not await store.queue.cancel_run("r1", clock.now_ms(), runner_id=RUNNER + "-other")
    assert await statuses(store) == ("running", "starting")
    assert await store.queue.cancel_run("r1", clock.now_ms(), runner_id=RUNNER)
    assert await statuses(store) == ("cancelled", "cancelled")
    with pytest.raises(ClaimLost):
        await store.queue.fenced_revision("r1", got.token, clock.now_ms())


async def test_cancel_through_any_host_ends_another_runners_live_claim(store: Any, clock: ManualClock) -> None:
    """``any_claim``: an operator's cancel through a host that does not hold the claim ends
    the run and the claim with it (the holder's next write, or renewal, finds it gone)."""
    await new_run(store, clock)
    got = await claim(store, clock)
    assert await store.queue.cancel_run("r1", clock.now_ms(), any_claim=True)
    assert await statuses(store) == ("cancelled", "cancelled")
    with pytest.raises(ClaimLost):
        await store.queue.fenced_revision("r1", got.token, clock.now_ms())
    assert await store.queue.renew_claims([("r1", got.token)], 30_000, clock.now_ms()) == {"r1"}
    assert not await store.queue.cancel_run("r1", clock.now_ms(), any_claim=True)  # ended already


async def test_cancel_of_a_run_whose_claim_expired_needs_no_token_and_fences_the_old_one(
        store: Any, clock: ManualClock) -> None:
    await new_run(store, clock)
    got = await claim(store, clock)
    clock.advance(LEASE - 1)
    assert not await store.queue.cancel_run("r1", clock.now_ms())  # still live: only its token
    clock.advance(1)
    assert await store.queue.cancel_run("r1", clock.now_ms())  # nobody holds it now
    assert await statuses(store) == ("cancelled", "cancelled")
    with pytest.raises(ClaimLost):
        await store.queue.fenced_revision("r1", got.token, clock.now_ms())


async def test_cancel_a_parked_run(store: Any, clock: ManualClock) -> None:
    await new_run(store, clock)
    got = await claim(store, clock)
    await store.queue.park_run("r1", got.token, clock.now_ms())
    assert await store.queue.cancel_run("r1", clock.now_ms())


async def test_one_active_run_per_origin_session(store: Any, clock: ManualClock) -> None:
    await new_run(store, clock, "r1", session="s")
    with pytest.raises(Rejected, match="already has an active run r1"):
        await new_run(store, clock, "r2", session="s")
    await new_run(store, clock, "d1")  # detached runs are exempt
    await new_run(store, clock, "d2")
    await store.queue.cancel_run("r1", clock.now_ms())
    await new_run(store, clock, "r2", session="s")


async def test_parked_session_run_waits_while_its_session_has_another_active_run(
        store: Any, clock: ManualClock) -> None:
    await new_run(store, clock, "r1", session="s")
    first = await claim(store, clock)
    await store.queue.park_run("r1", first.token, clock.now_ms())
    await new_run(store, clock, "r2", session="s")  # parked runs do not hold the session
    got = await claim(store, clock)
    assert got is not None and got.run_id == "r2"
    assert await claim(store, clock) is None  # r1 waits for r2
    await store.queue.complete_run("r2", got.token, None, clock.now_ms())
    got = await claim(store, clock)
    assert got is not None and got.run_id == "r1"


async def test_one_claim_round_takes_one_run_of_a_session_and_goes_on_past_the_other(
        store: Any, clock: ManualClock) -> None:
    """Two parked runs of a session are both free until one is claimed: a round that claims
    several runs takes the older and passes over the other (the session rule, checked in
    each claim's write), and goes on to the runs after it, oldest first."""
    await new_run(store, clock, "s1", session="s")
    await store.queue.park_run("s1", (await claim(store, clock)).token, clock.now_ms())
    await new_run(store, clock, "s2", session="s")  # parked runs do not hold the session
    await store.queue.park_run("s2", (await claim(store, clock)).token, clock.now_ms())
    for run_id in ("d1", "d2"):
        await new_run(store, clock, run_id)
    got = await claims(store, clock, room=3)
    assert [c.run_id for c, _ in got] == ["s1", "d1", "d2"]
    assert await statuses(store, "s2") == ("running", "parked")
    assert await claims(store, clock, room=3) == []  # s2 waits for s1
    await store.queue.complete_run("s1", got[0][0].token, None, clock.now_ms())
    assert [c.run_id for c, _ in await claims(store, clock, room=3)] == ["s2"]


async def test_a_claim_round_over_several_queues_goes_on_past_a_run_it_passes_over(
        store: Any, clock: ManualClock) -> None:
    """Two parked runs of one session in two queues and a free run in a third, a round
    with room for two: the older of the session's is taken, the other passed over (the
    session rule), and the free run still taken in the same round (the candidates read
    were more than the room, so the round reads again rather than stop)."""
    async def queued(run_id: str, queue: str, session: str | None = None) -> None:
        await store.runs.create_run(run_id=run_id, workflow="w", project_path="/p", source=b"src", digest="d1",
                                    input={"n": 1}, origin_session_id=session, now=clock.now_ms(), queue=queue)
        clock.advance(1)

    async def round_of(room: int, *queues: str) -> list[str]:
        got = await store.supervision.claim_runs(room=room, exclude=frozenset(), runner_id=RUNNER, lease_ms=LEASE,
                                                 now=clock.now_ms(), epoch=1, queues=queues)
        return [c.run_id for c, _ in got]

    for run_id, queue in (("s1", "qa"), ("s2", "qb")):
        await queued(run_id, queue, session="s")
        [taken] = await store.supervision.claim_runs(room=1, exclude=frozenset(), runner_id=RUNNER, lease_ms=LEASE,
                                                     now=clock.now_ms(), epoch=1, queues=(queue,))
        await store.queue.park_run(run_id, taken[0].token, clock.now_ms())
    await queued("c1", "qc")
    assert await round_of(2, "qa", "qb", "qc") == ["s1", "c1"]
    assert await statuses(store, "s2") == ("running", "parked")


async def test_claims_take_the_oldest_first_and_honour_exclusions(store: Any, clock: ManualClock) -> None:
    for run_id in ("a", "b", "c"):
        await new_run(store, clock, run_id)
    got = await claim(store, clock, exclude=frozenset({"a"}))
    assert got is not None and got.run_id == "b"
    got = await claim(store, clock)
    assert got is not None and got.run_id == "a"


async def test_many_claimed_at_once_each_get_a_token_and_a_worker(store: Any, clock: ManualClock) -> None:
    for run_id in ("a", "b", "c", "d"):
        await new_run(store, clock, run_id)
    got = await claims(store, clock, room=3, exclude=frozenset({"b"}))
    assert [c.run_id for c, _ in got] == ["a", "c", "d"]
    assert len({c.token for c, _ in got}) == len({w for _, w in got}) == 3
    assert [w.status for w in (await store.runs.get_run("a")).workers] == ["starting"]
    assert [c.run_id for c, _ in await claims(store, clock, room=3)] == ["b"]
    assert await claims(store, clock, room=3) == []


async def test_many_excluded_runs_do_not_hide_a_claimable_one(store: Any, clock: ManualClock) -> None:
    for i in range(40):
        await new_run(store, clock, f"r{i:02}")
    got = await claim(store, clock, exclude=frozenset(f"r{i:02}" for i in range(39)))
    assert got is not None and got.run_id == "r39"


async def test_takeover_expires_claims_of_earlier_epochs(store: Any, clock: ManualClock) -> None:
    await new_run(store, clock)
    first = await claim(store, clock, epoch=1)
    assert await claim(store, clock, epoch=2) is None
    assert await store.queue.expire_claims_before(2, clock.now_ms()) == ["r1"]
    got = await claim(store, clock, epoch=2)
    assert got is not None and got.generation == 2
    with pytest.raises(ClaimLost):
        await store.queue.mark_running("r1", first.token, clock.now_ms())


async def test_claim_interrupts_running_attempts_of_the_previous_generation(store: Any, clock: ManualClock) -> None:
    await new_run(store, clock)
    got = await claim(store, clock)
    await store.runs.start_attempt("r1", got.token, seq=0, node="a", generation=1, now=clock.now_ms())
    clock.advance(LEASE)
    await claim(store, clock)
    assert [s.status for s in (await store.runs.get_run("r1")).steps] == ["interrupted"]


async def test_the_revision_is_fenced_and_read_without_a_claim(store: Any, clock: ManualClock) -> None:
    assert await store.queue.revision_of("nope") is None
    await new_run(store, clock)
    assert await store.queue.revision_of("r1") == await store.runs.revision("r1") == 1
    with pytest.raises(ClaimLost):
        await store.queue.fenced_revision("r1", "no-claim", clock.now_ms())
    with pytest.raises(NotFound):
        await store.runs.revision("nope")


async def test_two_stores_on_one_database_never_hold_one_run_at_once(store: Any, open_store: Any,
                                                                     clock: ManualClock) -> None:
    other = await open_store()  # another host's store
    await new_run(store, clock, "a")
    await new_run(store, clock, "b")
    mine = await claim(store, clock, epoch=1)
    theirs = await claim(other, clock, epoch=1)
    assert (mine.run_id, theirs.run_id) == ("a", "b")
    assert await claim(other, clock, epoch=2) is None
    assert await other.queue.expire_claims_before(2, clock.now_ms()) == ["a", "b"]  # a takeover, through the other
    taken = await claim(other, clock, epoch=2)
    with pytest.raises(ClaimLost):
        await store.queue.complete_run(taken.run_id, mine.token, None, clock.now_ms())
    await other.queue.complete_run(taken.run_id, taken.token, {"by": "other"}, clock.now_ms())
    assert (await store.runs.get_run(taken.run_id)).output == {"by": "other"}


async def test_a_crash_back_off_is_kept_with_the_run_and_claims_skip_it_until_it_ends(
        store: Any, clock: ManualClock) -> None:
    from piwf.status import WorkerStatus

    async def crash() -> Any:
        """Claim the run and record its worker's crash, with a back-off doubling per crash."""
        got = await claims(store, clock)
        assert [c.run_id for c, _ in got] == ["r1"]
        (claimed, worker_id), = got
        return await store.supervision.end_worker(
            worker_id=worker_id, run_id="r1", token=claimed.token, status=WorkerStatus.CRASHED,
            now=clock.now_ms(), exit_code=1, signal=None, diagnostic=None, park=True, max_crashes=3,
            backoff=lambda before: 1000 * 2 ** before)

    await new_run(store, clock)
    first = await crash()
    assert (first.crashes, first.not_before) == (1, clock.now_ms() + 1000)
    clock.advance(999)
    assert await claim(store, clock) is None  # within the back-off: no host claims it
    clock.advance(1)
    second = await crash()  # the back-off doubles
    assert (second.crashes, second.not_before) == (2, clock.now_ms() + 2000)
    await store.runs.resume_run("r1", clock.now_ms())  # an operator's resume lifts it
    assert await claim(store, clock) is not None


async def test_expiry_is_judged_by_the_callers_clock_never_the_servers(open_store: Any, clock: ManualClock) -> None:
    """The suite's clock is in 2023 and this one in 2100: were the database server's own
    clock (today) judging any expiry, every claim and lease made in 2023 would be expired at
    once and one made in 2100 never, and these would fail (docs/operations.md, "One clock")."""
    for now in (clock, ManualClock(4_102_444_800_000)):  # 2023-11-14, 2100-01-01
        store = await open_store(now, database=f"clock{now.now_ms()}")
        await new_run(store, now)
        got = await claim(store, now)
        lease = await store.hosts.acquire_lease(host_id="h1", pid=1, identity="i", lease_ms=LEASE, now=now.now_ms())
        now.advance(LEASE - 1)
        assert await claim(store, now, epoch=2) is None  # still live by the caller's clock
        assert await store.hosts.renew_lease(lease, LEASE, now.now_ms() - 1) is not None
        now.advance(LEASE)
        taken = await claim(store, now, epoch=2)  # expired by the caller's clock: taken over
        assert got is not None and taken is not None and taken.generation == got.generation + 1
        again = await store.hosts.acquire_lease(host_id="h2", pid=2, identity="j", lease_ms=LEASE, now=now.now_ms())
        assert again.epoch > lease.epoch  # the renewed lease expired by the caller's clock too
