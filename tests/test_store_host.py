"""The host lease and the command log."""

from __future__ import annotations

import pytest

from piwf.client import make_request
from piwf.clock import ManualClock
from piwf.errors import HostAlreadyRunning, Rejected
from piwf.store.sqlite import Database, commands, workers
from piwf.store.sqlite.hosts import acquire_lease, read_lease, release_lease, renew_lease
from piwf.wire import HostResponse
from piwf.protocol.worker import AttemptStart, AttemptStartPayload, WorkerResponse

LEASE = 30_000


def take(db: Database, clock: ManualClock, host: str = "h1", **kw: object):
    return acquire_lease(db, host_id=host, pid=1, identity="id", lease_ms=LEASE, now=clock.now_ms(), **kw)


def test_lease_epochs_grow_and_a_live_lease_is_refused(db: Database, clock: ManualClock) -> None:
    first = take(db, clock)
    assert first.epoch == 1
    with pytest.raises(HostAlreadyRunning, match="live piwf host"):
        take(db, clock, "h2")
    clock.advance(LEASE)
    second = take(db, clock, "h2")
    assert second.epoch == 2
    assert renew_lease(db, first, LEASE, clock.now_ms()) is None  # the old owner lost it


def test_a_proved_dead_owner_is_taken_over_at_once(db: Database, clock: ManualClock) -> None:
    take(db, clock)
    second = take(db, clock, "h2", owner_dead=True)
    assert second.epoch == 2 and read_lease(db).host_id == "h2"


def test_renew_and_release(db: Database, clock: ManualClock) -> None:
    claim = take(db, clock)
    clock.advance(LEASE - 1)
    renewed = renew_lease(db, claim, LEASE, clock.now_ms())
    assert renewed is not None and renewed.expires_at == clock.now_ms() + LEASE
    assert release_lease(db, renewed)
    assert not read_lease(db).live(clock.now_ms())
    assert not release_lease(db, renewed)


def run_op(db: Database, request, calls: list[int]) -> HostResponse:
    def operation() -> HostResponse:
        calls.append(1)
        return HostResponse(request.requestId, "accepted", receipt={"n": len(calls)})

    return commands.execute(db, request, 1, 1000, operation)


def test_repeated_request_id_is_adopted_with_the_stored_receipt(db: Database) -> None:
    calls: list[int] = []
    request = make_request("run.pause", client_id="c", run_id="r", request_id="q1")
    assert run_op(db, request, calls).outcome == "accepted"
    again = run_op(db, request, calls)
    assert (again.outcome, again.receipt, len(calls)) == ("adopted", {"n": 1}, 1)


def test_same_request_id_with_another_body_is_a_conflict(db: Database) -> None:
    calls: list[int] = []
    run_op(db, make_request("run.pause", client_id="c", run_id="r", request_id="q1"), calls)
    other = run_op(db, make_request("run.pause", client_id="c", run_id="other", request_id="q1"), calls)
    assert other.outcome == "conflict" and "requestId" in other.error and len(calls) == 1


def test_idempotency_key_adopts_a_retry_under_a_new_request_id(db: Database) -> None:
    calls: list[int] = []

    def pause(client: str, run: str, request_id: str) -> HostResponse:
        request = make_request("run.pause", client_id=client, run_id=run, request_id=request_id, idempotency_key="k")
        return run_op(db, request, calls)

    pause("c", "r", "q1")
    retry = pause("c", "r", "q2")
    assert retry.outcome == "adopted" and retry.requestId == "q2" and len(calls) == 1
    other = pause("c", "x", "q3")
    assert other.outcome == "conflict" and "idempotencyKey" in other.error
    assert pause("d", "x", "q4").outcome == "accepted"  # keys belong to one client


def test_a_refused_operation_leaves_no_log_entry(db: Database) -> None:
    request = make_request("run.pause", client_id="c", run_id="r", request_id="q1")

    def refuse() -> HostResponse:
        raise Rejected("no")

    with pytest.raises(Rejected):
        commands.execute(db, request, 1, 1000, refuse)
    assert db.scalar("SELECT COUNT(*) FROM host_commands") == 0


def test_the_log_is_pruned_after_retention(db: Database) -> None:
    run_op(db, make_request("host.stop", client_id="c", request_id="q1"), [])
    assert commands.prune(db, now=1000 + commands.RETENTION_MS - 1) == 0
    assert commands.prune(db, now=1000 + commands.RETENTION_MS + 1) == 1


def test_worker_messages_are_answered_once(db: Database) -> None:
    message = AttemptStart("m1", "w1", 1, 1, payload=AttemptStartPayload(seq=0, node="a"))
    assert workers.read_message(db, message) is None
    with db.write():
        workers.record_message(db, message, WorkerResponse("m1", "accepted", revision=2, result={"a": 1}), 5)
    stored = workers.read_message(db, message)
    assert stored is not None and stored.result == {"a": 1} and stored.revision == 2
    changed = AttemptStart("m1", "w1", 1, 1, payload=AttemptStartPayload(seq=1, node="a"))
    assert workers.read_message(db, changed).outcome == "rejected"


def test_an_expired_lease_nobody_took_is_renewed_by_its_owner(db: Database, clock: ManualClock) -> None:
    claim = take(db, clock)
    clock.advance(LEASE * 3)  # the disk was full, or the machine slept
    renewed = renew_lease(db, claim, LEASE, clock.now_ms())
    assert renewed is not None and read_lease(db).live(clock.now_ms())
