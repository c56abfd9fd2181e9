"""Delivery to sessions in the store, rule by rule, on a manual clock: notifications and
turns under delivery claims, follow-ups, live updates, run.watch reads."""

from __future__ import annotations

from pathlib import Path

import apsw
import pytest

from piwf.clock import ManualClock
from piwf.errors import ClaimLost, Conflict, NotFound, Rejected
from piwf.status import Hold, NotificationKind, TurnCause, TurnResolution
from piwf.store.sqlite import Database, delivery, interactions, queue, runs, updates
from piwf.store.sqlite.schema import APPLICATION_ID, SCHEMA_VERSION

LEASE = 30_000
DELIVERY = 10_000


def running(db: Database, clock: ManualClock, run_id: str = "r1", session: str | None = "s1",
            node: str = "n") -> tuple[str, str]:
    """A claimed run with a running attempt: (token, attempt id)."""
    runs.create_run(db, run_id=run_id, workflow="w", project_path="/p", source=b"s", digest="d", input=None,
                    origin_session_id=session, now=clock.now_ms())
    claim = queue.claim_run(db, run_id, runner_id="h", token="t-" + run_id, lease_ms=LEASE, now=clock.now_ms(),
                            epoch=1)
    assert claim is not None
    attempt_id, _ = runs.start_attempt(db, run_id, claim.token, seq=0, node=node, generation=claim.generation,
                                       now=clock.now_ms())
    return claim.token, attempt_id


def notify(db: Database, clock: ManualClock, token: str, attempt: str, index: int, text: str,
           run_id: str = "r1") -> str | None:
    with db.write():
        return delivery.notify(db, run_id, token, attempt_id=attempt, index=index, kind=NotificationKind.PROGRESS,
                               content=text, now=clock.now_ms())


def claim(db: Database, clock: ManualClock, client: str = "c1", session: str = "s1") -> tuple[str | None, str | None]:
    got = delivery.claim_notification(db, session_id=session, client_id=client, lease_ms=DELIVERY, now=clock.now_ms())
    return got.claimId, got.notification.content if got.notification else None


# --- notifications -------------------------------------------------------------------------


def test_notifications_are_claimed_and_delivered_in_order_once(db: Database, clock: ManualClock) -> None:
    token, attempt = running(db, clock)
    ids = [notify(db, clock, token, attempt, i, f"step {i}") for i in (1, 2, 3)]
    seen = []
    for _ in range(3):
        claim_id, text = claim(db, clock)
        seen.append(text)
        delivery.deliver_notification(db, notification_id=ids[len(seen) - 1], claim_id=claim_id, client_id="c1",
                                      now=clock.now_ms())
    assert seen == ["step 1", "step 2", "step 3"]
    assert claim(db, clock) == (None, None)
    assert delivery.count_undelivered(db) == 0


def test_a_retried_step_notifying_again_stores_no_second_copy(db: Database, clock: ManualClock) -> None:
    token, attempt = running(db, clock)
    first = notify(db, clock, token, attempt, 1, "hello")
    queue.park_run(db, "r1", token, clock.now_ms())  # its worker crashed: the step runs again
    again = queue.claim_run(db, "r1", runner_id="h", token="t2", lease_ms=LEASE, now=clock.now_ms(), epoch=1)
    assert again is not None
    attempt2, _ = runs.start_attempt(db, "r1", "t2", seq=0, node="n", generation=again.generation, now=clock.now_ms())
    assert notify(db, clock, "t2", attempt2, 1, "hello") == first
    assert db.scalar("SELECT COUNT(*) FROM notifications") == 1
    assert len([e for e in runs.run_events(db, "r1").events if e.type == "notification"]) == 1


def test_a_claim_that_expires_is_claimed_again_and_a_stale_claim_is_a_conflict(
        db: Database, clock: ManualClock) -> None:
    token, attempt = running(db, clock)
    notification_id = notify(db, clock, token, attempt, 1, "hello")
    lost, _ = claim(db, clock, "crashy")
    crashed, _ = claim(db, clock, "crashy")  # the same client again: a new claim supersedes its old one
    assert crashed != lost
    with pytest.raises(Conflict, match="stale"):
        delivery.deliver_notification(db, notification_id=notification_id, claim_id=lost, client_id="crashy",
                                      now=clock.now_ms())
    assert claim(db, clock, "other") == (None, None)  # the oldest is claimed: nothing jumps the queue
    clock.advance(DELIVERY)
    fresh, text = claim(db, clock, "steady")
    assert text == "hello" and fresh != crashed
    with pytest.raises(Conflict, match="stale"):
        delivery.deliver_notification(db, notification_id=notification_id, claim_id=crashed, client_id="crashy",
                                      now=clock.now_ms())
    with pytest.raises(Conflict, match="stale"):  # the right claim id, from another client
        delivery.deliver_notification(db, notification_id=notification_id, claim_id=fresh, client_id="crashy",
                                      now=clock.now_ms())
    with pytest.raises(NotFound):
        delivery.deliver_notification(db, notification_id="ntf-nope", claim_id=fresh, client_id="steady",
                                      now=clock.now_ms())
    delivery.deliver_notification(db, notification_id=notification_id, claim_id=fresh, client_id="steady",
                                  now=clock.now_ms())
    with pytest.raises(Conflict):  # delivered: a second delivery is refused
        delivery.deliver_notification(db, notification_id=notification_id, claim_id=fresh, client_id="steady",
                                      now=clock.now_ms())


def test_bad_notifications_are_refused_and_a_detached_run_notifies_nobody(db: Database, clock: ManualClock) -> None:
    token, attempt = running(db, clock)
    with pytest.raises(Rejected, match="blank"):
        notify(db, clock, token, attempt, 1, "  \n")
    with pytest.raises(Rejected, match="limit is 65536"):
        notify(db, clock, token, attempt, 1, "é" * 40_000)
    with pytest.raises(ClaimLost):
        notify(db, clock, "stale-token", attempt, 1, "hi")
    detached_token, detached_attempt = running(db, clock, "r2", session=None)
    assert notify(db, clock, detached_token, detached_attempt, 1, "hi", run_id="r2") is None
    assert db.scalar("SELECT COUNT(*) FROM notifications") == 0


# --- turns ---------------------------------------------------------------------------------


def turns(db: Database) -> list[tuple[str, str, str | None]]:
    return [(t.cause, t.facts.status, t.instructions) for t in
            delivery.list_turns(db, session_id=None, run_id=None, limit=100, now=0)]


@pytest.mark.parametrize("end, cause", [
    (lambda db, t, now: queue.complete_run(db, "r1", t, {"ok": 1}, now), TurnCause.COMPLETED),
    (lambda db, t, now: queue.fail_run(db, "r1", t, {"type": "E", "message": "boom"}, now), TurnCause.FAILED),
    (lambda db, t, now: queue.cancel_run(db, "r1", now, token=t), TurnCause.CANCELLED),
    (lambda db, t, now: queue.park_run(db, "r1", t, now, hold=Hold.CRASHED, detail="crashed 5 times"),
     TurnCause.HELD),
])
def test_each_end_or_hold_writes_one_turn_in_its_transaction(db: Database, clock: ManualClock, end: object,
                                                             cause: TurnCause) -> None:
    token, _ = running(db, clock)
    end(db, token, clock.now_ms())  # type: ignore[operator]
    [turn] = delivery.list_turns(db, session_id="s1", run_id=None, limit=10, now=clock.now_ms())
    assert turn.cause == cause and turn.workflow == "w"
    assert delivery.count_unresolved(db) == 1


def test_an_ordinary_park_and_a_detached_run_write_no_turn(db: Database, clock: ManualClock) -> None:
    token, _ = running(db, clock)
    queue.park_run(db, "r1", token, clock.now_ms())
    detached, _ = running(db, clock, "r2", session=None)
    queue.complete_run(db, "r2", detached, None, clock.now_ms())
    assert delivery.count_unresolved(db) == 0


def test_a_later_end_rewrites_the_unresolved_turn_and_present_shows_only_on_completion(
        db: Database, clock: ManualClock) -> None:
    token, _ = running(db, clock)
    with db.write():
        delivery.request_presentation(db, "r1", token, instructions="Show the table", now=clock.now_ms())
    assert turns(db) == []  # asked for, not eligible until the run ends
    queue.park_run(db, "r1", token, clock.now_ms(), hold=Hold.CRASHED, detail="crashed")
    assert turns(db) == [("held", "running", None)]
    runs.resume_run(db, "r1", clock.now_ms())
    again = queue.claim_run(db, "r1", runner_id="h", token="t2", lease_ms=LEASE, now=clock.now_ms(), epoch=1)
    assert again is not None
    queue.complete_run(db, "r1", "t2", {"rows": 3}, clock.now_ms())
    [turn] = delivery.list_turns(db, session_id="s1", run_id="r1", limit=10, now=clock.now_ms())
    assert (turn.cause, turn.instructions, turn.facts.output) == ("completed", "Show the table", '{"rows":3}')
    assert db.scalar("SELECT COUNT(*) FROM turns") == 1


def test_a_later_end_ends_the_claim_on_the_turn_it_rewrites(db: Database, clock: ManualClock) -> None:
    token, _ = running(db, clock)
    queue.park_run(db, "r1", token, clock.now_ms(), hold=Hold.CRASHED, detail="crashed")
    held = delivery.claim_turn(db, session_id="s1", client_id="A", lease_ms=DELIVERY, now=clock.now_ms())
    assert held.turn is not None and held.turn.cause == "held"
    runs.resume_run(db, "r1", clock.now_ms())
    again = queue.claim_run(db, "r1", runner_id="h", token="t2", lease_ms=LEASE, now=clock.now_ms(), epoch=1)
    assert again is not None
    clock.advance(10)
    queue.complete_run(db, "r1", "t2", {"rows": 3}, clock.now_ms())
    with pytest.raises(Conflict, match="stale"):  # A showed "held": the end it did not show is not resolved
        delivery.resolve_turn(db, turn_id=held.turn.turnId, claim_id=held.claimId, client_id="A",
                              resolution=TurnResolution.PRESENTED, now=clock.now_ms())
    done = delivery.claim_turn(db, session_id="s1", client_id="B", lease_ms=DELIVERY, now=clock.now_ms())
    assert done.turn is not None and (done.turn.cause, done.turn.facts.status) == ("completed", "completed")
    delivery.resolve_turn(db, turn_id=done.turn.turnId, claim_id=done.claimId, client_id="B",
                          resolution=TurnResolution.PRESENTED, now=clock.now_ms())
    assert delivery.count_unresolved(db) == 0


def test_a_present_turn_of_a_run_still_going_is_not_counted_unresolved(db: Database, clock: ManualClock) -> None:
    token, _ = running(db, clock)
    with db.write():
        delivery.request_presentation(db, "r1", token, instructions="Show it", now=clock.now_ms())
    assert delivery.count_unresolved(db) == 0
    queue.complete_run(db, "r1", token, {"ok": 1}, clock.now_ms())
    assert delivery.count_unresolved(db) == 1


def test_an_effect_hold_gives_a_turn_saying_so(db: Database, clock: ManualClock) -> None:
    token, _ = running(db, clock)
    queue.park_run(db, "r1", token, clock.now_ms(), hold=Hold.EFFECT, detail="effect e1 outcome unknown")
    [turn] = delivery.list_turns(db, session_id="s1", run_id="r1", limit=10, now=clock.now_ms())
    assert (turn.cause, turn.facts.hold, turn.facts.detail) == ("held", "effect", "effect e1 outcome unknown")


def test_the_queries_of_a_runs_end_use_an_index_of_turns(db: Database, clock: ManualClock) -> None:
    """Each end of a run with a session reads the run's turns inside the write transaction:
    by an index, never by a scan of every turn ever kept."""
    for sql in (delivery.OPEN_TURN_SQL, delivery.TURNS_OF_RUN_SQL, delivery.LAST_INSTRUCTIONS_SQL,
                delivery.COUNT_UNRESOLVED_SQL):
        plan = [str(row[-1]) for row in db.execute("EXPLAIN QUERY PLAN " + sql, ("r1", "s1")[:sql.count("?")])]
        assert all(" USING " in step and "INDEX turns_" in step for step in plan if "turns" in step), (sql, plan)
        assert any("turns" in step for step in plan), (sql, plan)


def test_a_timed_out_run_gets_its_turn_with_the_deadline_expiry(db: Database, clock: ManualClock) -> None:
    token, attempt = running(db, clock)
    from piwf.protocol.worker import InteractionOpenPayload

    with db.write():
        interactions.open_request(db, "r1", token, InteractionOpenPayload(
            attemptId=attempt, kind="ask", title="Why?", deadlineMs=1000), clock.now_ms())
    clock.advance(1000)
    assert len(interactions.expire_due(db, clock.now_ms())[0]) == 1
    assert turns(db) == [("timed_out", "timed_out", None)]


def test_turns_are_claimed_in_order_and_resolved_once_with_their_follow_ups(db: Database, clock: ManualClock) -> None:
    token, _ = running(db, clock)
    first = delivery.queue_followup(db, run_id="r1", request_key="k1", prompt="and then?", now=clock.now_ms())
    assert (first.order, first.adopted) == (1, False)
    assert delivery.queue_followup(db, run_id="r1", request_key="k1", prompt="and then?", now=1).adopted
    with pytest.raises(Conflict, match="another prompt"):
        delivery.queue_followup(db, run_id="r1", request_key="k1", prompt="other", now=1)
    queue.fail_run(db, "r1", token, {"type": "E", "message": "boom"}, clock.now_ms())
    got = delivery.claim_turn(db, session_id="s1", client_id="c1", lease_ms=DELIVERY, now=clock.now_ms())
    assert got.turn is not None and got.turn.facts.error == "boom"
    assert [f.prompt for f in got.turn.followUps] == ["and then?"]
    assert delivery.claim_turn(db, session_id="s1", client_id="c2", lease_ms=DELIVERY, now=clock.now_ms()).turn is None
    late = delivery.queue_followup(db, run_id="r1", request_key="k2", prompt="late", now=clock.now_ms())
    with pytest.raises(Conflict, match="stale"):
        delivery.resolve_turn(db, turn_id=got.turn.turnId, claim_id=got.claimId, client_id="c2",
                              resolution=TurnResolution.PRESENTED, now=clock.now_ms())
    done = delivery.resolve_turn(db, turn_id=got.turn.turnId, claim_id=got.claimId, client_id="c1",
                                 resolution=TurnResolution.PRESENTED, now=clock.now_ms())
    assert done.followUpsDelivered == 1  # the late one was not in the claim: it gets a turn of its own
    assert db.scalar("SELECT state FROM followups WHERE followup_id = ?", (late.followUpId,)) == "queued"
    with pytest.raises(Conflict):
        delivery.resolve_turn(db, turn_id=got.turn.turnId, claim_id=got.claimId, client_id="c1",
                              resolution=TurnResolution.PRESENTED, now=clock.now_ms())
    again = delivery.claim_turn(db, session_id="s1", client_id="c2", lease_ms=DELIVERY, now=clock.now_ms())
    assert again.turn is not None and again.turn.turnId != got.turn.turnId
    assert (again.turn.cause, [f.prompt for f in again.turn.followUps]) == ("failed", ["late"])
    assert delivery.resolve_turn(db, turn_id=again.turn.turnId, claim_id=again.claimId, client_id="c2",
                                 resolution=TurnResolution.PROMPTED, now=clock.now_ms()).followUpsDelivered == 1
    assert delivery.count_unresolved(db) == 0
    with pytest.raises(Rejected, match="already delivered"):
        delivery.remove_followup(db, run_id="r1", followup_id=late.followUpId, now=clock.now_ms())
    with pytest.raises(Rejected, match="no turn is left"):
        delivery.queue_followup(db, run_id="r1", request_key="k3", prompt="too late", now=clock.now_ms())
    with pytest.raises(NotFound):
        delivery.queue_followup(db, run_id="nope", request_key="k", prompt="p", now=1)


# --- updates and run.watch reads --------------------------------------------------------------


def test_an_update_replaces_its_value_only_from_the_live_attempt(db: Database, clock: ManualClock) -> None:
    token, attempt = running(db, clock)
    with db.write():
        first = updates.publish(db, "r1", token, attempt_id=attempt, type="progress", key="rows", data=1, now=1)
        second = updates.publish(db, "r1", token, attempt_id=attempt, type="progress", key="rows", data=2, now=2)
    [update] = runs.get_run(db, "r1").updates
    assert (update.data, update.seq) == (2, second) and second > first
    with pytest.raises(Rejected, match="limit is 65536"), db.write():
        updates.publish(db, "r1", token, attempt_id=attempt, type="t", key="k", data="x" * 70_000, now=3)
    with pytest.raises(Rejected, match="not running"), db.write():
        updates.publish(db, "r1", token, attempt_id="gone", type="t", key="k", data=1, now=3)
    page = updates.changes(db, after=first, run_id=None, limit=100, now=3)
    assert [u.data for u in page.updates] == [2] and page.runs[0].currentNode == "n"
    assert page.cursor == updates.last_event(db) and not page.more
    snap = updates.snapshot(db, run_id=None, limit=2, now=3)
    assert [r.runId for r in snap.runs] == ["r1"] and len(snap.events) == 2 and snap.cursor == page.cursor


def test_a_layout_6_database_is_migrated_with_the_delivery_tables(tmp_path: Path) -> None:
    path = tmp_path / "v6.db"
    conn = apsw.Connection(str(path))
    conn.execute((Path(__file__).parent / "data" / "schema_v6.sql").read_text())
    conn.execute(f"PRAGMA application_id = {APPLICATION_ID}; PRAGMA user_version = 6")
    conn.execute("INSERT INTO runs (run_id, workflow, project_path, definition_hash, definition_digest, status, "
                 "origin_session_id, created_at, updated_at) VALUES ('a', 'w', '/p', 'h', 'd', 'completed', 's', 1, 1)")
    conn.execute("INSERT INTO run_queue (run_id, status, created_at, updated_at) VALUES ('a', 'done', 1, 1)")
    conn.close()
    db = Database.open(path)
    assert db.scalar("PRAGMA user_version") == SCHEMA_VERSION >= 8
    counts = runs.status_counts(db, 1)
    assert (counts["completedRuns"], counts["undeliveredNotifications"], counts["unresolvedTurns"]) == (1, 0, 0)
    assert {"notifications_undelivered", "turns_unresolved", "run_updates_seq"} <= {
        name for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'index'")}
    assert runs.get_run(db, "a").updates == []
    assert db.scalar("PRAGMA integrity_check") == "ok"
    db.close()


def test_status_counts_of_a_layout_6_database_read_as_it_is(tmp_path: Path) -> None:
    """`piwf status` with no host reads the database read-only, before any migration."""
    path = tmp_path / "v6.db"
    conn = apsw.Connection(str(path))
    conn.execute((Path(__file__).parent / "data" / "schema_v6.sql").read_text())
    conn.execute(f"PRAGMA application_id = {APPLICATION_ID}; PRAGMA user_version = 6")
    conn.close()
    db = Database.open_readonly(path)
    counts = runs.status_counts(db, 1)
    assert (counts["undeliveredNotifications"], counts["unresolvedTurns"]) == (0, 0)
    db.close()


def test_pruning_forgets_what_was_delivered_to_the_sessions_of_ended_runs_only(
        db: Database, clock: ManualClock) -> None:
    token, attempt = running(db, clock)
    notification_id = notify(db, clock, token, attempt, 1, "still going")
    claim_id, _ = claim(db, clock)
    delivery.deliver_notification(db, notification_id=notification_id, claim_id=claim_id, client_id="c1",
                                  now=clock.now_ms())
    clock.advance(10 * DAY)
    assert delivery.prune(db, clock.now_ms(), 7 * DAY) == 0  # its run goes on: a retried node must find it
    again = queue.claim_run(db, "r1", runner_id="h", token="t2", lease_ms=LEASE, now=clock.now_ms(), epoch=1)
    assert again is not None
    queue.complete_run(db, "r1", "t2", None, clock.now_ms())
    got = delivery.claim_turn(db, session_id="s1", client_id="c1", lease_ms=DELIVERY, now=clock.now_ms())
    assert got.turn is not None and got.claimId is not None
    delivery.resolve_turn(db, turn_id=got.turn.turnId, claim_id=got.claimId, client_id="c1",
                          resolution=TurnResolution.DISMISSED, now=clock.now_ms())
    assert delivery.prune(db, clock.now_ms(), 7 * DAY) == 1  # the notification; the turn is recent
    clock.advance(8 * DAY)
    assert delivery.prune(db, clock.now_ms(), 7 * DAY) == 1
    assert db.scalar("SELECT COUNT(*) FROM notifications") == db.scalar("SELECT COUNT(*) FROM turns") == 0


DAY = 24 * 3600 * 1000
