"""Worker records, their answered messages, the processes they registered, and how a
worker's end is recorded (SupervisionStore.end_worker)."""

from __future__ import annotations

from typing import Any

import pytest

from piwf.clock import ManualClock
from piwf.errors import ClaimLost, Conflict, Rejected
from piwf.protocol.worker import AttemptStart, AttemptStartPayload, WorkerResponse
from piwf.status import WorkerStatus

from .helpers import LEASE, claim, claims, new_run, statuses


async def claimed(store: Any, clock: ManualClock, run_id: str = "r1", epoch: int = 1) -> tuple[Any, str]:
    """A new run claimed by host ``epoch``: (claim, worker id)."""
    await new_run(store, clock, run_id)
    [(got, worker)] = await claims(store, clock, epoch=epoch)
    assert got.run_id == run_id
    return got, worker


def start(worker: str, message_id: str = "m1", seq: int = 0) -> AttemptStart:
    return AttemptStart(message_id, worker, 1, 1, payload=AttemptStartPayload(seq=seq, node="a"))


async def end(store: Any, clock: ManualClock, got: Any, worker: str, status: WorkerStatus, *, park: bool = True,
              max_crashes: int = 3, output: str = "") -> Any:
    return await store.supervision.end_worker(worker_id=worker, run_id=got.run_id, token=got.token,
                                              status=status, now=clock.now_ms(), exit_code=None, signal=9,
                                              diagnostic=None, park=park, max_crashes=max_crashes,
                                              last_output=output)


async def worker_statuses(store: Any, run_id: str = "r1") -> list[str]:
    return [w.status for w in (await store.runs.get_run(run_id)).workers]


async def answer(store: Any, clock: ManualClock, got: Any, message: AttemptStart) -> WorkerResponse:
    """A worker message as the host carries it out: one unit of work, fenced, replayed from the log."""
    async with store.transaction() as tx:
        stored = await tx.workers.read_message(message)
        if stored is not None:
            return stored
        current = await tx.queue.fenced_revision(got.run_id, got.token, clock.now_ms())
        if message.expectedRevision != current:
            raise Rejected(f"run revision conflict: expected {message.expectedRevision}, now {current}")
        attempt, revision = await tx.runs.start_attempt(got.run_id, got.token, seq=message.payload.seq,
                                                        node=message.payload.node, generation=got.generation,
                                                        now=clock.now_ms())
        response = WorkerResponse(message.messageId, "accepted", revision=revision, result={"attemptId": attempt})
        await tx.workers.record_message(message, response, clock.now_ms())
        return response


async def test_a_worker_message_is_answered_once_and_a_reused_id_with_another_body_is_refused(
        store: Any, clock: ManualClock) -> None:
    got, worker = await claimed(store, clock)
    assert await store.workers.read_message(start(worker)) is None
    first = await answer(store, clock, got, start(worker))
    assert first.outcome == "accepted" and first.revision == 2
    again = await answer(store, clock, got, start(worker))
    assert again == first  # from the log: no second attempt
    assert len((await store.runs.get_run("r1")).steps) == 1
    changed = await store.workers.read_message(start(worker, seq=1))
    assert changed is not None and changed.outcome == "rejected" and "another body" in changed.error
    assert await store.workers.read_message(start("other-worker")) is None  # ids are per worker


async def test_an_answer_recorded_again_keeps_the_first(store: Any, clock: ManualClock) -> None:
    """The host records an answer with the worker's next message: after a commit whose
    outcome it never learnt, it records the same answer again, which is no conflict."""
    got, worker = await claimed(store, clock)
    first = await answer(store, clock, got, start(worker))
    again = WorkerResponse(first.messageId, "accepted", revision=99, result={"attemptId": "other"})
    async with store.transaction() as tx:
        await tx.workers.record_message(start(worker), again, clock.now_ms())
    assert await store.workers.read_message(start(worker)) == first


async def test_a_message_under_a_lost_claim_changes_nothing_and_is_not_recorded(store: Any,
                                                                                 clock: ManualClock) -> None:
    got, worker = await claimed(store, clock)
    clock.advance(LEASE)
    with pytest.raises(ClaimLost):
        await answer(store, clock, got, start(worker))
    assert (await store.runs.get_run("r1")).steps == []
    assert await store.workers.read_message(start(worker)) is None


async def test_a_worker_is_ready_once_and_its_process_attached(store: Any, clock: ManualClock) -> None:
    got, worker = await claimed(store, clock)
    assert await worker_statuses(store) == ["starting"]
    await store.workers.attach_process(worker, 4242, "boot:4242")
    await store.workers.mark_ready(worker, clock.now_ms())
    await store.workers.mark_ready(worker, clock.now_ms())
    [summary] = (await store.runs.get_run("r1")).workers
    assert (summary.status, summary.pid, summary.generation) == ("running", 4242, got.generation)


async def test_a_worker_is_ready_with_its_process_in_one_write(store: Any, clock: ManualClock) -> None:
    _, worker = await claimed(store, clock)
    await store.workers.mark_ready(worker, clock.now_ms(), pid=4242, identity="boot:4242")
    await store.workers.mark_ready(worker, clock.now_ms(), pid=1, identity="boot:1")  # once only
    [summary] = (await store.runs.get_run("r1")).workers
    assert (summary.status, summary.pid) == ("running", 4242)
    assert await store.workers.orphan_before(2, clock.now_ms()) == [(worker, 4242, "boot:4242")]


async def test_takeover_orphans_the_workers_of_earlier_hosts(store: Any, clock: ManualClock) -> None:
    _, old = await claimed(store, clock, "r1", epoch=1)
    await claimed(store, clock, "r2", epoch=1)  # its worker never attached a process
    await store.workers.attach_process(old, 4242, "boot:4242")
    assert await store.workers.orphan_before(1, clock.now_ms()) == []
    assert await store.workers.orphan_before(2, clock.now_ms()) == [(old, 4242, "boot:4242")]
    assert await worker_statuses(store, "r1") == await worker_statuses(store, "r2") == ["orphaned"]
    assert await store.workers.orphan_before(2, clock.now_ms()) == []  # once


async def test_registered_processes_are_tracked_until_gone(store: Any, clock: ManualClock) -> None:
    _, worker = await claimed(store, clock)
    for pid in (10, 11, 12):
        await store.workers.register_process(worker_id=worker, run_id="r1", pid=pid, identity=f"id{pid}",
                                             node="sh", now=clock.now_ms())
    assert await store.workers.unregister_process(worker, 10, clock.now_ms())
    assert not await store.workers.unregister_process(worker, 10, clock.now_ms())  # gone already
    assert not await store.workers.unregister_process("other", 11, clock.now_ms())  # not its own
    assert sorted(await store.workers.live_processes([worker])) == [(worker, 11, "id11"), (worker, 12, "id12")]
    assert await store.workers.live_processes([]) == []
    assert await store.workers.live_processes(["other"]) == []
    assert await store.workers.orphaned_processes(1) == []  # this host's own
    assert sorted(await store.workers.orphaned_processes(2)) == [(worker, 11, "id11"), (worker, 12, "id12")]
    await store.workers.mark_processes_gone([(worker, 11, "id11")], clock.now_ms())
    assert await store.workers.live_processes([worker]) == [(worker, 12, "id12")]
    assert await store.workers.orphaned_processes(2) == [(worker, 12, "id12")]


async def test_a_process_live_under_one_worker_cannot_be_registered_to_another(store: Any,
                                                                              clock: ManualClock) -> None:
    _, first = await claimed(store, clock)
    _, second = await claimed(store, clock, "r2")
    await store.workers.register_process(worker_id=first, run_id="r1", pid=10, identity="id10", node="sh",
                                         now=clock.now_ms())
    with pytest.raises(Conflict, match=f"process 10 is already registered to another worker \\({first}\\)"):
        await store.workers.register_process(worker_id=second, run_id="r2", pid=10, identity="id10", node="sh",
                                             now=clock.now_ms())
    # the same pid as another process (reused), or once the first is gone, is another matter
    await store.workers.register_process(worker_id=second, run_id="r2", pid=10, identity="id10-later",
                                         node="sh", now=clock.now_ms())
    await store.workers.mark_processes_gone([(first, 10, "id10")], clock.now_ms())
    await store.workers.register_process(worker_id=second, run_id="r2", pid=10, identity="id10", node="sh",
                                         now=clock.now_ms())  # registered again: the newer identity is kept
    assert await store.workers.live_processes([first]) == []
    assert await store.workers.live_processes([second]) == [(second, 10, "id10")]


async def test_answers_of_ended_workers_of_ended_runs_are_pruned(store: Any, clock: ManualClock) -> None:
    got, worker = await claimed(store, clock)
    await answer(store, clock, got, start(worker))
    assert await store.workers.prune_messages() == 0  # its run goes on: the worker may repeat the message
    await store.queue.complete_run("r1", got.token, None, clock.now_ms())
    assert await store.workers.prune_messages() == 0  # its worker has not ended
    await store.workers.orphan_before(2, clock.now_ms())  # ended without its end recorded
    assert await store.workers.prune_messages(batch=10) == 1
    assert await store.workers.prune_messages() == 0
    assert await store.workers.read_message(start(worker)) is None


async def test_a_workers_end_parks_its_run_and_forgets_its_answers_once_the_run_ended(
        store: Any, clock: ManualClock) -> None:
    got, worker = await claimed(store, clock)
    await answer(store, clock, got, start(worker))
    ended = await end(store, clock, got, worker, WorkerStatus.EXITED)
    assert (ended.crashes, ended.waiting_again) == (0, False)
    assert await statuses(store) == ("running", "parked") and await worker_statuses(store) == ["exited"]
    assert await store.workers.read_message(start(worker)) is not None  # the run goes on
    again, second = (await claims(store, clock))[0]
    await store.queue.complete_run("r1", again.token, None, clock.now_ms())
    await end(store, clock, again, second, WorkerStatus.EXITED)
    assert await store.workers.read_message(start(worker)) is None  # the run ended: nobody repeats it
    assert await worker_statuses(store) == ["exited", "exited"]


async def test_crashes_in_a_row_hold_the_run_with_the_last_output(store: Any, clock: ManualClock) -> None:
    await new_run(store, clock)
    for n in (1, 2, 3):
        [(got, worker)] = await claims(store, clock)
        ended = await end(store, clock, got, worker, WorkerStatus.CRASHED, output=f"trace {n}")
        assert ended.crashes == n
    assert await store.runs.hold_of("r1") == "crashed"
    assert "crashed 3 times in a row; last output: trace 3" in (await store.runs.get_run("r1")).statusDetail
    assert await claim(store, clock) is None
    await store.runs.resume_run("r1", clock.now_ms())  # the operator's resume starts the count again
    [(got, worker)] = await claims(store, clock)
    assert (await end(store, clock, got, worker, WorkerStatus.TIMED_OUT)).crashes == 1
    assert await store.runs.hold_of("r1") is None


async def test_an_end_without_park_or_under_a_lost_claim_leaves_the_run_alone(store: Any,
                                                                              clock: ManualClock) -> None:
    got, worker = await claimed(store, clock)
    await end(store, clock, got, worker, WorkerStatus.STOPPED, park=False)
    assert await statuses(store) == ("running", "starting") and await worker_statuses(store) == ["stopped"]
    clock.advance(LEASE)
    [(fresh, _)] = await claims(store, clock)
    ended = await end(store, clock, got, worker, WorkerStatus.CRASHED)  # the stale claim: counted on nothing
    assert ended.crashes == 0
    await store.queue.fenced_revision("r1", fresh.token, clock.now_ms())  # the new claim stands


async def test_an_end_recorded_with_its_runs_end_is_amended_once_when_it_ended_otherwise(
        store: Any, clock: ManualClock) -> None:
    got, worker = await claimed(store, clock)
    await store.queue.mark_running("r1", got.token, clock.now_ms())
    assert await store.workers.amend_end(worker_id=worker, run_id="r1", status=WorkerStatus.CRASHED,
                                         now=clock.now_ms(), exit_code=None, signal=9, diagnostic="x") is False
    async with store.transaction() as tx:  # the run's end and its worker's, exit code 0 presumed
        await tx.queue.complete_run("r1", got.token, {"ok": True}, clock.now_ms())
        await tx.supervision.end_worker(worker_id=worker, run_id="r1", token=got.token, status=WorkerStatus.EXITED,
                                        now=clock.now_ms(), exit_code=0, signal=None, diagnostic=None, park=False,
                                        max_crashes=3)
    [recorded] = (await store.runs.get_run("r1")).workers
    assert (recorded.status, recorded.exitCode) == ("exited", 0)
    clock.advance(5)
    assert await store.workers.amend_end(worker_id=worker, run_id="r1", status=WorkerStatus.CRASHED,
                                         now=clock.now_ms(), exit_code=None, signal=9, diagnostic="killed") is True
    assert await store.workers.amend_end(worker_id=worker, run_id="r1", status=WorkerStatus.EXITED,
                                         now=clock.now_ms(), exit_code=0, signal=None, diagnostic=None) is False
    run = await store.runs.get_run("r1")
    [amended] = run.workers
    assert (amended.status, amended.exitCode, amended.signal, amended.diagnostic) == ("crashed", None, 9, "killed")
    assert run.status == "completed"  # the run's end stands
    events = (await store.runs.run_events("r1")).events
    assert [e.type for e in events][-2:] == ["worker.finished", "worker.amended"]
    last = events[-1]
    assert (last.workerEpoch, last.outcome, last.exitCode, last.signal) == (worker, "crashed", None, 9)
