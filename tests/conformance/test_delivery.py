"""Delivery to a run's origin session: notifications and turns under delivery claims, and
follow-ups, on a manual clock."""

from __future__ import annotations

from typing import Any

import pytest

from piwf.clock import ManualClock
from piwf.errors import ClaimLost, Conflict, NotFound, Rejected
from piwf.protocol.worker import InteractionOpenPayload
from piwf.status import Hold, NotificationKind, TurnCause, TurnResolution

from .helpers import claim as claim_run
from .helpers import running

DELIVERY = 10_000
DAY = 24 * 3600 * 1000


async def notify(store: Any, clock: ManualClock, token: str, attempt: str, index: int, text: str,
                 run_id: str = "r1") -> str | None:
    async with store.transaction() as tx:  # inside the worker message's unit of work
        return await tx.delivery.notify(run_id, token, attempt_id=attempt, index=index,
                                        kind=NotificationKind.PROGRESS, content=text, now=clock.now_ms())


async def claim(store: Any, clock: ManualClock, client: str = "c1", session: str = "s1") -> tuple[Any, Any]:
    got = await store.delivery.claim_notification(session_id=session, client_id=client, lease_ms=DELIVERY,
                                                  now=clock.now_ms())
    return got.claimId, got.notification.content if got.notification else None


async def deliver(store: Any, clock: ManualClock, notification_id: str, claim_id: str, client: str) -> Any:
    return await store.delivery.deliver_notification(notification_id=notification_id, claim_id=claim_id,
                                                     client_id=client, now=clock.now_ms())


async def turns(store: Any, clock: ManualClock, session: str | None = None,
                run_id: str | None = None) -> list[Any]:
    return await store.delivery.list_turns(session_id=session, run_id=run_id, limit=100, now=clock.now_ms())


async def counts(store: Any, clock: ManualClock) -> tuple[int, int]:
    got = await store.runs.status_counts(clock.now_ms())
    return got["undeliveredNotifications"], got["unresolvedTurns"]


async def claim_turn(store: Any, clock: ManualClock, client: str, session: str = "s1") -> Any:
    return await store.delivery.claim_turn(session_id=session, client_id=client, lease_ms=DELIVERY,
                                           now=clock.now_ms())


async def resolve(store: Any, clock: ManualClock, got: Any, client: str,
                  resolution: TurnResolution = TurnResolution.PRESENTED, turn_id: str | None = None) -> Any:
    return await store.delivery.resolve_turn(turn_id=turn_id or got.turn.turnId, claim_id=got.claimId,
                                             client_id=client, resolution=resolution, now=clock.now_ms())


async def reclaimed(store: Any, clock: ManualClock) -> Any:
    """The run claimed again after it was parked or resumed."""
    got = await claim_run(store, clock)
    assert got is not None and got.run_id == "r1"
    return got


# --- notifications -------------------------------------------------------------------------


async def test_notifications_are_claimed_and_delivered_in_order_once(store: Any, clock: ManualClock) -> None:
    token, attempt = await running(store, clock)
    ids = [await notify(store, clock, token, attempt, i, f"step {i}") for i in (1, 2, 3)]
    assert await counts(store, clock) == (3, 0)
    listed = await store.delivery.list_notifications(session_id="s1", run_id=None, limit=10, now=clock.now_ms())
    assert [n.content for n in listed] == ["step 1", "step 2", "step 3"]  # the undelivered ones
    assert await store.delivery.list_notifications(session_id=None, run_id="r1", limit=2, now=clock.now_ms()) == \
        listed[:2]
    assert await store.delivery.list_notifications(session_id="s2", run_id=None, limit=10, now=clock.now_ms()) == []
    seen = []
    for _ in range(3):
        claim_id, text = await claim(store, clock)
        seen.append(text)
        await deliver(store, clock, ids[len(seen) - 1], claim_id, "c1")
    assert seen == ["step 1", "step 2", "step 3"]
    assert await claim(store, clock) == (None, None)
    assert await counts(store, clock) == (0, 0)
    assert await store.delivery.list_notifications(session_id="s1", run_id=None, limit=10, now=clock.now_ms()) == []


async def test_a_retried_step_notifying_again_stores_no_second_copy(store: Any, clock: ManualClock) -> None:
    token, attempt = await running(store, clock)
    first = await notify(store, clock, token, attempt, 1, "hello")
    await store.queue.park_run("r1", token, clock.now_ms())  # its worker crashed: the step runs again
    again = await reclaimed(store, clock)
    attempt2, _ = await store.runs.start_attempt("r1", again.token, seq=0, node="n", generation=again.generation,
                                                 now=clock.now_ms())
    assert await notify(store, clock, again.token, attempt2, 1, "hello") == first
    assert len(await store.delivery.list_notifications(session_id="s1", run_id=None, limit=10,
                                                       now=clock.now_ms())) == 1
    assert len([e for e in (await store.runs.run_events("r1")).events if e.type == "notification"]) == 1


async def test_a_retried_step_is_matched_by_text_whatever_order_its_calls_come_in(
        store: Any, clock: ManualClock) -> None:
    """Its k-th call with a text is the k-th stored with that text; a text not stored before
    is new, numbered after the step's others."""
    token, attempt = await running(store, clock)
    a = await notify(store, clock, token, attempt, 1, "from a")
    twice = await notify(store, clock, token, attempt, 1, "again")
    await store.queue.park_run("r1", token, clock.now_ms())  # crashed part-way
    again = await reclaimed(store, clock)
    replay, _ = await store.runs.start_attempt("r1", again.token, seq=0, node="n", generation=again.generation,
                                               now=clock.now_ms())
    b = await notify(store, clock, again.token, replay, 1, "from b")  # called first this time
    assert b not in (a, twice)
    assert await notify(store, clock, again.token, replay, 1, "from a") == a
    assert await notify(store, clock, again.token, replay, 1, "again") == twice
    assert await notify(store, clock, again.token, replay, 2, "again") not in (a, twice, b)  # its second call: new
    shown = await store.delivery.list_notifications(session_id="s1", run_id=None, limit=10, now=clock.now_ms())
    assert [(n.index, n.content) for n in shown] == [(1, "from a"), (2, "again"), (3, "from b"), (4, "again")]


async def test_a_claim_that_expires_is_claimed_again_and_a_stale_claim_is_a_conflict(
        store: Any, clock: ManualClock) -> None:
    token, attempt = await running(store, clock)
    notification_id = await notify(store, clock, token, attempt, 1, "hello")
    lost, _ = await claim(store, clock, "crashy")
    crashed, _ = await claim(store, clock, "crashy")  # the same client again: a new claim supersedes its old one
    assert crashed != lost
    with pytest.raises(Conflict, match="stale"):
        await deliver(store, clock, notification_id, lost, "crashy")
    assert await claim(store, clock, "other") == (None, None)  # the oldest is claimed: nothing jumps the queue
    clock.advance(DELIVERY)
    fresh, text = await claim(store, clock, "steady")
    assert text == "hello" and fresh != crashed
    with pytest.raises(Conflict, match="stale"):
        await deliver(store, clock, notification_id, crashed, "crashy")
    with pytest.raises(Conflict, match="stale"):  # the right claim id, from another client
        await deliver(store, clock, notification_id, fresh, "crashy")
    with pytest.raises(NotFound):
        await deliver(store, clock, "ntf-nope", fresh, "steady")
    await deliver(store, clock, notification_id, fresh, "steady")
    with pytest.raises(Conflict):  # delivered: a second delivery is refused
        await deliver(store, clock, notification_id, fresh, "steady")


async def test_bad_notifications_are_refused_and_a_detached_run_notifies_nobody(store: Any,
                                                                                clock: ManualClock) -> None:
    token, attempt = await running(store, clock)
    with pytest.raises(Rejected, match="blank"):
        await notify(store, clock, token, attempt, 1, "  \n")
    with pytest.raises(Rejected, match="limit is 65536"):
        await notify(store, clock, token, attempt, 1, "é" * 40_000)
    with pytest.raises(ClaimLost):
        await notify(store, clock, "stale-token", attempt, 1, "hi")
    detached_token, detached_attempt = await running(store, clock, "r2", session=None)
    assert await notify(store, clock, detached_token, detached_attempt, 1, "hi", run_id="r2") is None
    assert await store.delivery.list_notifications(session_id=None, run_id=None, limit=10, now=clock.now_ms()) == []


# --- turns ---------------------------------------------------------------------------------


@pytest.mark.parametrize("end, cause", [
    (lambda s, t, now: s.queue.complete_run("r1", t, {"ok": 1}, now), TurnCause.COMPLETED),
    (lambda s, t, now: s.queue.fail_run("r1", t, {"type": "E", "message": "boom"}, now), TurnCause.FAILED),
    (lambda s, t, now: s.queue.cancel_run("r1", now, token=t), TurnCause.CANCELLED),
    (lambda s, t, now: s.queue.park_run("r1", t, now, hold=Hold.CRASHED, detail="crashed 5 times"), TurnCause.HELD),
])
async def test_each_end_or_hold_writes_one_turn_in_its_transaction(store: Any, clock: ManualClock, end: Any,
                                                                   cause: TurnCause) -> None:
    token, _ = await running(store, clock)
    await end(store, token, clock.now_ms())
    [turn] = await turns(store, clock, session="s1")
    assert turn.cause == cause and turn.workflow == "w"
    assert await counts(store, clock) == (0, 1)


async def test_an_ordinary_park_and_a_detached_run_write_no_turn(store: Any, clock: ManualClock) -> None:
    token, _ = await running(store, clock)
    await store.queue.park_run("r1", token, clock.now_ms())
    detached, _ = await running(store, clock, "r2", session=None)
    await store.queue.complete_run("r2", detached, None, clock.now_ms())
    assert await counts(store, clock) == (0, 0) and await turns(store, clock) == []


async def test_a_later_end_rewrites_the_unresolved_turn_and_present_shows_only_on_completion(
        store: Any, clock: ManualClock) -> None:
    token, _ = await running(store, clock)
    async with store.transaction() as tx:
        await tx.delivery.request_presentation("r1", token, instructions="Show the table", now=clock.now_ms())
    assert await turns(store, clock) == []  # asked for, not eligible until the run ends
    await store.queue.park_run("r1", token, clock.now_ms(), hold=Hold.CRASHED, detail="crashed")
    assert [(t.cause, t.facts.status, t.instructions) for t in await turns(store, clock)] == [
        ("held", "running", None)]
    await store.runs.resume_run("r1", clock.now_ms())
    again = await reclaimed(store, clock)
    await store.queue.complete_run("r1", again.token, {"rows": 3}, clock.now_ms())
    [turn] = await turns(store, clock, session="s1", run_id="r1")
    assert (turn.cause, turn.instructions, turn.facts.output) == ("completed", "Show the table", '{"rows":3}')
    assert len(await turns(store, clock)) == 1


async def test_presentation_is_fenced_and_a_detached_run_presents_to_nobody(store: Any, clock: ManualClock) -> None:
    await running(store, clock)
    with pytest.raises(ClaimLost):
        await store.delivery.request_presentation("r1", "stale", instructions="x", now=clock.now_ms())
    detached, _ = await running(store, clock, "r2", session=None)
    assert await store.delivery.request_presentation("r2", detached, instructions="x", now=clock.now_ms()) is None


async def test_a_later_end_ends_the_claim_on_the_turn_it_rewrites(store: Any, clock: ManualClock) -> None:
    token, _ = await running(store, clock)
    await store.queue.park_run("r1", token, clock.now_ms(), hold=Hold.CRASHED, detail="crashed")
    held = await claim_turn(store, clock, "A")
    assert held.turn is not None and held.turn.cause == "held"
    await store.runs.resume_run("r1", clock.now_ms())
    again = await reclaimed(store, clock)
    clock.advance(10)
    await store.queue.complete_run("r1", again.token, {"rows": 3}, clock.now_ms())
    with pytest.raises(Conflict, match="stale"):  # A showed "held": the end it did not show is not resolved
        await resolve(store, clock, held, "A")
    done = await claim_turn(store, clock, "B")
    assert done.turn is not None and (done.turn.cause, done.turn.facts.status) == ("completed", "completed")
    await resolve(store, clock, done, "B")
    assert await counts(store, clock) == (0, 0)


async def test_a_present_turn_of_a_run_still_going_is_not_counted_unresolved(store: Any, clock: ManualClock) -> None:
    token, _ = await running(store, clock)
    await store.delivery.request_presentation("r1", token, instructions="Show it", now=clock.now_ms())
    assert await counts(store, clock) == (0, 0)
    await store.queue.complete_run("r1", token, {"ok": 1}, clock.now_ms())
    assert await counts(store, clock) == (0, 1)


async def test_an_effect_hold_gives_a_turn_saying_so(store: Any, clock: ManualClock) -> None:
    token, _ = await running(store, clock)
    await store.queue.park_run("r1", token, clock.now_ms(), hold=Hold.EFFECT, detail="effect e1 outcome unknown")
    [turn] = await turns(store, clock, session="s1", run_id="r1")
    assert (turn.cause, turn.facts.hold, turn.facts.detail) == ("held", "effect", "effect e1 outcome unknown")


async def test_a_timed_out_run_gets_its_turn_with_the_deadline_expiry(store: Any, clock: ManualClock) -> None:
    token, attempt = await running(store, clock)
    await store.interactions.open_request("r1", token, InteractionOpenPayload(
        attemptId=attempt, kind="ask", title="Why?", deadlineMs=1000), clock.now_ms())
    clock.advance(1000)
    assert len((await store.interactions.expire_due(clock.now_ms()))[0]) == 1
    assert [(t.cause, t.facts.status) for t in await turns(store, clock)] == [("timed_out", "timed_out")]


async def test_a_turn_waits_for_its_runs_notifications(store: Any, clock: ManualClock) -> None:
    token, attempt = await running(store, clock)
    notification_id = await notify(store, clock, token, attempt, 1, "first")
    await store.queue.complete_run("r1", token, None, clock.now_ms())
    assert (await claim_turn(store, clock, "c1")).turn is None  # its notification comes first
    claim_id, _ = await claim(store, clock)
    await deliver(store, clock, notification_id, claim_id, "c1")
    assert (await claim_turn(store, clock, "c1")).turn is not None


async def test_turns_are_claimed_in_order_and_resolved_once_with_their_follow_ups(store: Any,
                                                                                 clock: ManualClock) -> None:
    token, _ = await running(store, clock)
    first = await store.delivery.queue_followup(run_id="r1", request_key="k1", prompt="and then?", now=clock.now_ms())
    assert (first.order, first.adopted) == (1, False)
    assert (await store.delivery.queue_followup(run_id="r1", request_key="k1", prompt="and then?", now=1)).adopted
    with pytest.raises(Conflict, match="another prompt"):
        await store.delivery.queue_followup(run_id="r1", request_key="k1", prompt="other", now=1)
    await store.queue.fail_run("r1", token, {"type": "E", "message": "boom"}, clock.now_ms())
    got = await claim_turn(store, clock, "c1")
    assert got.turn is not None and got.turn.facts.error == "boom"
    assert [f.prompt for f in got.turn.followUps] == ["and then?"]
    assert (await claim_turn(store, clock, "c2")).turn is None
    late = await store.delivery.queue_followup(run_id="r1", request_key="k2", prompt="late", now=clock.now_ms())
    with pytest.raises(Conflict, match="stale"):
        await resolve(store, clock, got, "c2")
    with pytest.raises(NotFound):
        await resolve(store, clock, got, "c1", turn_id="turn-nope")
    done = await resolve(store, clock, got, "c1")
    assert done.followUpsDelivered == 1  # the late one was not in the claim: it gets a turn of its own
    with pytest.raises(Conflict):
        await resolve(store, clock, got, "c1")
    again = await claim_turn(store, clock, "c2")
    assert again.turn is not None and again.turn.turnId != got.turn.turnId
    assert (again.turn.cause, [f.prompt for f in again.turn.followUps]) == ("failed", ["late"])
    assert (await resolve(store, clock, again, "c2", TurnResolution.PROMPTED)).followUpsDelivered == 1
    assert await counts(store, clock) == (0, 0)
    with pytest.raises(Rejected, match="already delivered"):
        await store.delivery.remove_followup(run_id="r1", followup_id=late.followUpId, now=clock.now_ms())
    with pytest.raises(Rejected, match="no turn is left"):
        await store.delivery.queue_followup(run_id="r1", request_key="k3", prompt="too late", now=clock.now_ms())
    with pytest.raises(NotFound):
        await store.delivery.queue_followup(run_id="nope", request_key="k", prompt="p", now=1)


async def test_a_queued_follow_up_can_be_removed_once(store: Any, clock: ManualClock) -> None:
    token, _ = await running(store, clock)
    queued = await store.delivery.queue_followup(run_id="r1", request_key="k1", prompt="p", now=clock.now_ms())
    removed = await store.delivery.remove_followup(run_id="r1", followup_id=queued.followUpId, now=clock.now_ms())
    assert removed.followUpId == queued.followUpId
    assert (removed.state, removed.adopted) == ("removed", False)
    again = await store.delivery.remove_followup(run_id="r1", followup_id=queued.followUpId, now=clock.now_ms())
    assert (again.state, again.adopted) == ("removed", True)  # a repeated removal is answered the same
    with pytest.raises(NotFound):
        await store.delivery.remove_followup(run_id="r1", followup_id="fu-nope", now=clock.now_ms())
    await store.queue.complete_run("r1", token, None, clock.now_ms())
    got = await claim_turn(store, clock, "c1")
    assert got.turn is not None and got.turn.followUps == []


async def test_pruning_forgets_what_was_delivered_to_the_sessions_of_ended_runs_only(
        store: Any, clock: ManualClock) -> None:
    token, attempt = await running(store, clock)
    notification_id = await notify(store, clock, token, attempt, 1, "still going")
    claim_id, _ = await claim(store, clock)
    await deliver(store, clock, notification_id, claim_id, "c1")
    clock.advance(10 * DAY)
    assert await store.delivery.prune(clock.now_ms(), 7 * DAY) == 0  # its run goes on: a retried node must find it
    again = await reclaimed(store, clock)
    await store.queue.complete_run("r1", again.token, None, clock.now_ms())
    got = await claim_turn(store, clock, "c1")
    assert got.turn is not None and got.claimId is not None
    await resolve(store, clock, got, "c1", TurnResolution.DISMISSED)
    assert await store.delivery.prune(clock.now_ms(), 7 * DAY) == 1  # the notification; the turn is recent
    clock.advance(8 * DAY)
    assert await store.delivery.prune(clock.now_ms(), 7 * DAY) == 1
    assert await turns(store, clock) == []
    assert await store.delivery.list_notifications(session_id=None, run_id=None, limit=10, now=clock.now_ms()) == []


async def test_turns_keep_the_order_they_became_eligible_in_whatever_the_writers_clock(
        open_store: Any, clock: ManualClock) -> None:
    """Two hosts end two runs of one session, the second one's clock 10 s behind: its turn
    still comes after the first's (a clock stepped back on one host is the same case)."""
    from .test_interactions import asking

    ahead = await open_store()
    behind_clock = ManualClock(clock.now_ms() - 10_000)
    behind = await open_store(on=behind_clock)
    for run_id in ("r1", "r2"):  # both waiting for an answer: parked, so one session may have both
        await asking(ahead, clock, run_id, session="s1")
    await ahead.queue.cancel_run("r2", clock.now_ms())
    await behind.queue.cancel_run("r1", behind_clock.now_ms())
    turns = await ahead.delivery.list_turns(session_id="s1", run_id=None, limit=10, now=clock.now_ms())
    assert [t.runId for t in turns] == ["r2", "r1"]
    first = await ahead.delivery.claim_turn(session_id="s1", client_id="c", lease_ms=30_000, now=clock.now_ms())
    assert first.turn.runId == "r2"


async def test_the_queued_follow_ups_are_listed_in_the_order_their_session_gets_them(
        store: Any, clock: ManualClock) -> None:
    """A run's in their order, the runs by their first one queued; a session's, a run's or
    all; removed by their own id (a run given must be theirs)."""
    from .helpers import new_run

    done, _ = await running(store, clock, "r2")  # ended, its turn not yet resolved: it still takes follow-ups
    await store.queue.complete_run("r2", done, None, clock.now_ms())
    await running(store, clock, "r1")  # the session's active run
    await new_run(store, clock, "r3", session="s2")

    async def queue(run_id: str, key: str) -> str:
        clock.advance(1)
        receipt = await store.delivery.queue_followup(run_id=run_id, request_key=key, prompt=f"say {key}",
                                                      now=clock.now_ms())
        return str(receipt.followUpId)

    async def listed(session: str | None = None, run_id: str | None = None, limit: int = 100) -> Any:
        return await store.delivery.list_followups(session_id=session, run_id=run_id, limit=limit,
                                                   now=clock.now_ms())

    b1, a1, b2, c1 = [await queue(run, key) for run, key in (("r2", "b1"), ("r1", "a1"), ("r2", "b2"),
                                                             ("r3", "c1"))]
    page = await listed("s1")
    assert [(f.followUpId, f.runId, f.order, f.sessionId, f.prompt) for f in page.followUps] == [
        (b1, "r2", 1, "s1", "say b1"), (b2, "r2", 2, "s1", "say b2"), (a1, "r1", 1, "s1", "say a1")]
    assert not page.more and not any(f.handedOut for f in page.followUps)
    assert [f.followUpId for f in (await listed(run_id="r1")).followUps] == [a1]
    assert [f.followUpId for f in (await listed("s2")).followUps] == [c1]
    first = await listed(limit=2)
    assert ([f.followUpId for f in first.followUps], first.more) == ([b1, b2], True)
    with pytest.raises(NotFound, match="run nope"):
        await listed(run_id="nope")
    with pytest.raises(NotFound, match=f"follow-up {b2} of run r1"):  # not r1's
        await store.delivery.remove_followup(run_id="r1", followup_id=b2, now=clock.now_ms())
    with pytest.raises(NotFound, match="follow-up fup-nope not found"):
        await store.delivery.remove_followup(run_id=None, followup_id="fup-nope", now=clock.now_ms())
    removed = await store.delivery.remove_followup(run_id=None, followup_id=b1, now=clock.now_ms())
    assert (removed.followUpId, removed.runId, removed.state) == (b1, "r2", "removed")
    assert [f.followUpId for f in (await listed("s1")).followUps] == [a1, b2]  # r2's first is now b2, after a1
    got = await claim_turn(store, clock, "c1")  # r2's turn, with what r2 has queued
    assert (got.turn.runId, [f.followUpId for f in got.turn.followUps]) == ("r2", [b2])
    assert [(f.followUpId, f.handedOut) for f in (await listed("s1")).followUps] == [(a1, False), (b2, True)]
    await resolve(store, clock, got, "c1")
    assert [f.followUpId for f in (await listed("s1")).followUps] == [a1]  # delivered: no longer queued
