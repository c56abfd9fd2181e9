"""Answering worker messages: fencing, revisions, and stored answers."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from piwf.clock import ManualClock
from piwf.host.state import ActiveRun, Conclusion, HostState
from piwf.host import worker_messages
from piwf.paths import StatePaths
from piwf.store.sql import placement, queue, runs, workers
from piwf.store.sqlite import Database, SqliteStore
from piwf.store.sqlite.hosts import acquire_lease
from piwf.errors import ProtocolError
from piwf.wire import canonical_json
from piwf.protocol.worker import WorkerMessage, WorkerResponse, parse_worker_message

from .conftest import config

LEASE = 30_000


def handle(host: HostState, active: ActiveRun, message: WorkerMessage) -> WorkerResponse:
    """``worker_messages.handle``, driven here: on SQLite it never reaches a checkpoint."""
    answering = worker_messages.handle(host, active, message)
    try:
        answering.send(None)
    except StopIteration as done:
        return done.value
    raise AssertionError("answering a worker message awaited a checkpoint")


def new_host(tmp_path: Path) -> tuple[HostState, Database, ManualClock]:
    paths = StatePaths.resolve(tmp_path / "state")
    paths.ensure()
    clock = ManualClock()
    db = Database.open(paths.db)
    host = HostState(config(paths, run_lease_ms=LEASE), SqliteStore(db), clock)
    host.lease = acquire_lease(db, host_id=host.host_id, pid=1, identity="x", lease_ms=LEASE, now=clock.now_ms())
    placement.serve_queues(db, host.host_id, host.config.queues, clock.now_ms())
    return host, db, clock


@pytest.fixture
def setup(tmp_path: Path) -> tuple[HostState, ActiveRun, ManualClock]:
    host, db, clock = new_host(tmp_path)
    runs.create_run(db, run_id="r", workflow="w", project_path="/", source=b"", digest="d", input={"a": 1},
                    origin_session_id=None, now=clock.now_ms())
    claim = queue.claim_next_run(db, runner_id=host.host_id, token="tok", lease_ms=LEASE, now=clock.now_ms(),
                                 epoch=host.epoch)
    assert claim is not None
    workers.record_start(db, worker_id="w1", run_id="r", generation=claim.generation, host_epoch=host.epoch,
                         now=clock.now_ms())
    yield host, ActiveRun(claim, worker_id="w1"), clock
    db.close()


def message(message_id: str, operation: str, revision: int, generation: int = 1, epoch: str = "w1",
            **payload: object) -> WorkerMessage:
    """A message as the worker sends it: JSON, decoded by the host's own decoder. A ready
    worker has loaded the workflow every run here was created with (digest "d")."""
    if operation == "worker.ready" and not payload:
        payload = {"digest": "d"}
    return parse_worker_message(canonical_json({
        "messageId": message_id, "workerEpoch": epoch, "generation": generation, "expectedRevision": revision,
        "operation": operation, "payload": dict(payload)}))


def test_ready_returns_the_input_and_marks_the_run_running(setup) -> None:
    host, active, _ = setup
    response = handle(host, active, message("m1", "worker.ready", 0))
    assert response.outcome == "accepted" and (response.result.input, response.result.steps) == ({"a": 1}, [])
    assert runs.get_run(host.store.db, "r").queueStatus == "running"
    assert active.ready.is_set()


@pytest.mark.parametrize("loaded", [{"digest": "other"}, {"loadError": "SyntaxError: nope"}])
def test_a_worker_whose_workflow_changed_or_did_not_load_holds_the_run_in_its_ready(setup, loaded) -> None:
    """The only live host of the run's queue cannot load it: held at once (placement)."""
    host, active, _ = setup
    response = handle(host, active, message("m1", "worker.ready", 0, **loaded))
    assert response.outcome == "accepted" and response.result.stop == "source"
    assert active.conclusion is Conclusion.DONE
    run = runs.get_run(host.store.db, "r")
    assert (run.queueStatus, run.hold, run.steps) == ("parked", "source", [])
    assert ("changed" if "digest" in loaded else "cannot load: SyntaxError") in run.statusDetail


def test_a_repeated_message_id_gets_the_stored_answer_and_changes_nothing(setup) -> None:
    host, active, _ = setup
    ready = handle(host, active, message("m1", "worker.ready", 0))
    start = message("m2", "attempt.start", ready.revision, seq=0, node="a")
    first = handle(host, active, start)
    again = handle(host, active, start)
    assert canonical_json(first) == canonical_json(again) and first.outcome == "accepted"
    assert len(runs.get_run(host.store.db, "r").steps) == 1


@pytest.mark.parametrize("lie", [{"generation": 0}, {"generation": 2}, {"epoch": "w0"}])
def test_a_message_naming_another_generation_or_worker_than_its_pipes_is_a_protocol_error(setup, lie) -> None:
    host, active, _ = setup
    with pytest.raises(ProtocolError, match="on the pipe of worker w1 generation 1"):
        handle(host, active, message("m1", "worker.ready", 0, **lie))
    assert active.conclusion is None  # not claimLost: the claim is live, the worker lied
    assert runs.get_run(host.store.db, "r").queueStatus == "starting"  # nothing was written


def test_a_stale_revision_is_rejected(setup) -> None:
    host, active, _ = setup
    ready = handle(host, active, message("m1", "worker.ready", 0))
    stale = handle(host, active, message("m2", "attempt.start", ready.revision - 1, seq=0, node="a"))
    assert stale.outcome == "rejected" and "revision conflict" in stale.error
    assert runs.get_run(host.store.db, "r").steps == []


def test_an_expired_claim_refuses_every_write_and_the_worker_is_told_so(setup) -> None:
    host, active, clock = setup
    ready = handle(host, active, message("m1", "worker.ready", 0))
    clock.advance(LEASE)
    response = handle(host, active, message("m2", "run.complete", ready.revision, output=1))
    assert response.outcome == "claimLost"
    assert active.conclusion is Conclusion.CLAIM_LOST  # told in the answer; its scope is left alone
    assert runs.get_run(host.store.db, "r").status == "running"


def test_bad_payloads_and_unknown_operations_are_protocol_errors_naming_the_field() -> None:
    with pytest.raises(ProtocolError, match=r"Expected `int` >= 0 - at `\$.payload.seq`"):
        message("m2", "attempt.start", 1, seq=-1, node="a")
    with pytest.raises(ProtocolError, match=r"Invalid value 'run.teleport' - at `\$.operation`"):
        message("m3", "run.teleport", 1)
    with pytest.raises(ProtocolError, match=r"at `\$.payload.observable`"):
        message("m4", "effect.reserve", 1, key="k", node="a", observable="yes")


def test_a_paused_run_is_told_to_stop_at_the_boundary(setup) -> None:
    host, active, clock = setup
    ready = handle(host, active, message("m1", "worker.ready", 0))
    runs.pause_run(host.store.db, "r", clock.now_ms())
    response = handle(host, active, message("m2", "attempt.start", ready.revision, seq=0, node="a"))
    assert msgspec.to_builtins(response.result) == {"stop": "paused"}
    assert runs.get_run(host.store.db, "r").steps == []


def test_a_final_accept_completes_the_run_in_the_same_step(setup) -> None:
    host, active, _ = setup
    ready = handle(host, active, message("m1", "worker.ready", 0))
    start = handle(host, active, message("m2", "attempt.start", ready.revision, seq=0, node="a"))
    done = handle(host, active, message("m3", "attempt.accept", start.revision, attemptId=start.result.attemptId,
                                        output={"x": 1}, exit="next", final=True))
    assert done.outcome == "accepted" and active.conclusion is Conclusion.DONE
    run = runs.get_run(host.store.db, "r")
    assert (run.status, run.queueStatus, run.output) == ("completed", "done", {"x": 1})
    assert [s.status for s in run.steps] == ["accepted"]


def test_a_worker_whose_steps_were_all_accepted_completes_with_run_complete(setup) -> None:
    host, active, _ = setup
    ready = handle(host, active, message("m1", "worker.ready", 0))
    start = handle(host, active, message("m2", "attempt.start", ready.revision, seq=0, node="a"))
    accepted = handle(host, active, message("m3", "attempt.accept", start.revision,
                                            attemptId=start.result.attemptId, output=1, exit="next"))
    assert runs.get_run(host.store.db, "r").status == "running"  # not final: the run goes on
    done = handle(host, active, message("m4", "run.complete", accepted.revision, output=1))
    assert done.outcome == "accepted" and runs.get_run(host.store.db, "r").status == "completed"


def test_ready_starts_a_fresh_runs_first_attempt(tmp_path: Path) -> None:
    host, db, clock = new_host(tmp_path)
    for run_id, paused in (("fresh", False), ("paused", True)):
        runs.create_run(db, run_id=run_id, workflow="w", project_path="/", source=b"", digest="d", input={},
                        origin_session_id=None, now=clock.now_ms(), start_node="first")
        if paused:
            runs.pause_run(db, run_id, clock.now_ms())
            runs.resume_run(db, run_id, clock.now_ms())  # claimable again, then paused while claimed
        claim = queue.claim_run(db, run_id, runner_id=host.host_id, token=run_id, lease_ms=LEASE,
                                now=clock.now_ms(), epoch=host.epoch)
        assert claim is not None
        if paused:
            runs.pause_run(db, run_id, clock.now_ms())
        workers.record_start(db, worker_id=run_id, run_id=run_id, generation=claim.generation,
                             host_epoch=host.epoch, now=clock.now_ms())
        ready = handle(host, ActiveRun(claim, worker_id=run_id), message("m1", "worker.ready", 0, epoch=run_id))
        steps = runs.get_run(db, run_id).steps
        if paused:  # a paused run starts nothing: its worker's first start is told to stop
            assert ready.result.attempt is None and steps == []
        else:
            assert ready.result.attempt.node == "first" and ready.result.attempt.seq == 0
            assert [(s.node, s.status) for s in steps] == [("first", "running")]
            assert ready.revision == runs.revision(db, run_id)
    db.close()


def test_a_second_ready_under_the_first_claim_reads_the_steps_accepted_since(tmp_path: Path) -> None:
    """A run's first claim reads neither accepted nor waiting attempts at ready (there are
    none yet); a worker that says ready again after a step was accepted is answered from
    the store: the step, and no attempt started again."""
    host, db, clock = new_host(tmp_path)
    runs.create_run(db, run_id="r", workflow="w", project_path="/", source=b"", digest="d", input={},
                    origin_session_id=None, now=clock.now_ms(), start_node="first")
    claim = queue.claim_run(db, "r", runner_id=host.host_id, token="tok", lease_ms=LEASE, now=clock.now_ms(),
                            epoch=host.epoch)
    assert claim is not None and claim.first
    workers.record_start(db, worker_id="w1", run_id="r", generation=claim.generation, host_epoch=host.epoch,
                         now=clock.now_ms())
    active = ActiveRun(claim, worker_id="w1")
    ready = handle(host, active, message("m1", "worker.ready", 0))
    attempt = ready.result.attempt
    accepted = handle(host, active, message("m2", "attempt.accept", ready.revision, attemptId=attempt.attemptId,
                                            output=1, exit="next"))
    again = handle(host, active, message("m3", "worker.ready", accepted.revision))
    assert again.outcome == "accepted" and [s.node for s in again.result.steps] == ["first"]
    assert again.result.attempt is None
    assert [(s.node, s.status) for s in runs.get_run(db, "r").steps] == [("first", "accepted")]
    db.close()


def test_a_ready_after_attempts_under_the_first_claim_reads_what_they_accepted(tmp_path: Path) -> None:
    """A worker that starts and accepts an attempt before its ready (piwf's own never does)
    is not taken at its word: its ready reads the step accepted, and starts nothing again."""
    host, db, clock = new_host(tmp_path)
    runs.create_run(db, run_id="r", workflow="w", project_path="/", source=b"", digest="d", input={},
                    origin_session_id=None, now=clock.now_ms(), start_node="first")
    claim = queue.claim_run(db, "r", runner_id=host.host_id, token="tok", lease_ms=LEASE, now=clock.now_ms(),
                            epoch=host.epoch)
    assert claim is not None and claim.first
    workers.record_start(db, worker_id="w1", run_id="r", generation=claim.generation, host_epoch=host.epoch,
                         now=clock.now_ms())
    active = ActiveRun(claim, worker_id="w1")
    started = handle(host, active, message("m1", "attempt.start", runs.revision(db, "r"), seq=0, node="first"))
    accepted = handle(host, active, message("m2", "attempt.accept", started.revision,
                                            attemptId=started.result.attemptId, output=1, exit="next"))
    ready = handle(host, active, message("m3", "worker.ready", accepted.revision))
    assert ready.outcome == "accepted" and [s.node for s in ready.result.steps] == ["first"]
    assert ready.result.attempt is None
    assert [(s.node, s.status) for s in runs.get_run(db, "r").steps] == [("first", "accepted")]
    db.close()


def test_a_worker_that_cannot_load_the_run_releases_it_for_another_host_while_one_may(tmp_path: Path) -> None:
    """Another live host of the run's queue has not tried it: the run is released, not held,
    and recorded as not loadable here (this host's claims pass it over)."""
    host, db, clock = new_host(tmp_path)
    db.execute("INSERT INTO host_queues (host_id, queue) VALUES ('other', 'default')")
    db.execute("UPDATE host_lease SET host_id = 'other'")  # the other host's lease, as SQLite keeps one
    runs.create_run(db, run_id="r", workflow="w", project_path="/", source=b"", digest="d", input={},
                    origin_session_id=None, now=clock.now_ms())
    claim = queue.claim_next_run(db, runner_id=host.host_id, token="tok", lease_ms=LEASE, now=clock.now_ms(),
                                 epoch=host.epoch)
    assert claim is not None
    workers.record_start(db, worker_id="w1", run_id="r", generation=claim.generation, host_epoch=host.epoch,
                         now=clock.now_ms())
    response = handle(host, ActiveRun(claim, worker_id="w1"),
                      message("m1", "worker.ready", 0, digest="other", sourceHash="ab" * 32))
    assert response.outcome == "accepted" and response.result.stop == "source"
    run = runs.get_run(db, "r")
    assert (run.queueStatus, run.hold) == ("parked", None) and "cannot be loaded on host-" in run.statusDetail
    assert placement.own_records(db, host.host_id) == [("r", "/", "w", "ab" * 32)]
    assert queue.claim_next_run(db, runner_id=host.host_id, token="t2", lease_ms=LEASE, now=clock.now_ms(),
                                epoch=host.epoch) is None
    db.close()


def test_a_ready_under_a_lost_claim_is_told_so_and_writes_nothing(setup) -> None:
    """A ready has no fence of its own: its first write (starting → running) is it."""
    host, active, clock = setup
    clock.advance(LEASE)
    response = handle(host, active, message("m1", "worker.ready", 0))
    assert response.outcome == "claimLost" and active.conclusion is Conclusion.CLAIM_LOST
    run = runs.get_run(host.store.db, "r")
    assert (run.queueStatus, run.steps, [w.status for w in run.workers]) == ("starting", [], ["starting"])


def _stored_answers(host: HostState) -> list[str]:
    return [mid for (mid,) in host.store.db.execute("SELECT message_id FROM worker_messages ORDER BY message_id")]


def test_a_fresh_one_node_run_stores_no_answer_and_its_repeats_are_answered_all_the_same(tmp_path: Path) -> None:
    """An answer is stored with the worker's next message (kept with its pipe until then);
    the one that ends the run comes with the worker's end, which deletes its stored
    answers: a fresh one-node run stores none. Repeats get the same answers and change
    nothing; a reused id with another body is refused."""
    host, db, clock = new_host(tmp_path)
    runs.create_run(db, run_id="r", workflow="w", project_path="/", source=b"", digest="d", input={},
                    origin_session_id=None, now=clock.now_ms(), start_node="first")
    claim = queue.claim_run(db, "r", runner_id=host.host_id, token="tok", lease_ms=LEASE, now=clock.now_ms(),
                            epoch=host.epoch)
    assert claim is not None
    workers.record_start(db, worker_id="w1", run_id="r", generation=claim.generation, host_epoch=host.epoch,
                         now=clock.now_ms())
    active = ActiveRun(claim, worker_id="w1")
    written: list[str] = []
    db.conn.exec_trace = lambda cursor, sql, bindings: written.append(sql) or True
    ready = handle(host, active, message("m1", "worker.ready", 0))
    assert canonical_json(handle(host, active, message("m1", "worker.ready", 0))) == canonical_json(ready)
    assert handle(host, active, message("m1", "worker.ready", 0, digest="other")).error == (
        "messageId was reused with another body")
    final = message("m2", "attempt.accept", ready.revision, attemptId=ready.result.attempt.attemptId,
                    output={"x": 1}, exit="next", final=True)
    done = handle(host, active, final)
    assert done.outcome == "accepted" and active.conclusion is Conclusion.DONE
    assert canonical_json(handle(host, active, final)) == canonical_json(done)
    db.conn.exec_trace = None
    assert not [sql for sql in written if "worker_messages" in sql]  # none stored, none looked for
    run = runs.get_run(db, "r")
    assert (run.status, run.output, [s.status for s in run.steps]) == ("completed", {"x": 1}, ["accepted"])
    assert [w.status for w in run.workers] == ["exited"]
    db.close()


def test_an_answer_is_stored_with_the_next_message_and_a_repeat_of_either_gets_it(setup) -> None:
    host, active, _ = setup
    ready = handle(host, active, message("m1", "worker.ready", 0))
    assert _stored_answers(host) == []  # kept with the worker's pipe
    start = message("m2", "attempt.start", ready.revision, seq=0, node="a")
    started = handle(host, active, start)
    assert _stored_answers(host) == ["m1"]
    for repeat, first in ((message("m1", "worker.ready", 0), ready), (start, started)):
        assert canonical_json(handle(host, active, repeat)) == canonical_json(first)
    assert handle(host, active, message("m1", "worker.ready", 0, digest="other")).outcome == "rejected"
    rejected = handle(host, active, message("m3", "attempt.start", 0, seq=1, node="b"))  # a stale revision
    assert rejected.outcome == "rejected" and _stored_answers(host) == ["m1"]  # its unit rolled back: m2 waits
    accepted = handle(host, active, message("m4", "attempt.accept", started.revision,
                                            attemptId=started.result.attemptId, output=1, exit="next"))
    assert _stored_answers(host) == ["m1", "m2"]
    assert len(runs.get_run(host.store.db, "r").steps) == 1
    handle(host, active, message("m5", "run.complete", accepted.revision, output=1))  # ends the run, and the worker:
    assert _stored_answers(host) == []  # what it stored goes with it


def test_a_final_accept_held_by_an_effect_keeps_the_answers_for_a_repeat(setup) -> None:
    """A run held for an effect whose outcome is unknown has not ended: the unit of the
    message that held it stores the answer before as any other, and a repeat of it gets
    its answer."""
    host, active, _ = setup
    ready = handle(host, active, message("m1", "worker.ready", 0))
    start = handle(host, active, message("m2", "attempt.start", ready.revision, seq=0, node="a"))
    reserved = handle(host, active, message("m3", "effect.reserve", start.revision, key="k", node="a",
                                            observable=False))
    applying = handle(host, active, message("m4", "effect.apply", reserved.revision, key="k"))
    assert (reserved.result.state, applying.outcome) == ("new", "accepted")
    final = message("m5", "attempt.accept", applying.revision, attemptId=start.result.attemptId, output=1,
                    exit="next", final=True)
    held = handle(host, active, final)
    assert held.outcome == "accepted" and active.conclusion is Conclusion.DONE
    run = runs.get_run(host.store.db, "r")
    assert (run.queueStatus, run.hold) == ("parked", "effect")
    # the run has not ended: the answer before is stored in this unit (as any other), this one is kept
    assert _stored_answers(host) == ["m1", "m2", "m3", "m4"]
    assert canonical_json(handle(host, active, final)) == canonical_json(held)


def test_the_answers_stored_for_a_run_go_when_the_message_that_ends_it_is_answered(tmp_path: Path) -> None:
    """Those its worker stored, and those of a worker of an earlier claim (its crash left
    them: the run had not ended), though the last worker stored none of its own."""
    host, db, clock = new_host(tmp_path)
    runs.create_run(db, run_id="r", workflow="w", project_path="/", source=b"", digest="d", input={},
                    origin_session_id=None, now=clock.now_ms(), start_node="first")
    for generation, worker in ((1, "w1"), (2, "w2")):
        claim = queue.claim_run(db, "r", runner_id=host.host_id, token=worker, lease_ms=LEASE, now=clock.now_ms(),
                                epoch=host.epoch)
        assert claim is not None and claim.generation == generation
        workers.record_start(db, worker_id=worker, run_id="r", generation=generation, host_epoch=host.epoch,
                             now=clock.now_ms())
        active = ActiveRun(claim, worker_id=worker)
        ready = handle(host, active, message("m1", "worker.ready", 0, generation=generation, epoch=worker))
        if generation == 1:  # a crash after two answers: the first is stored
            handle(host, active, message("m2", "steps.read", ready.revision, generation=1, epoch=worker, afterSeq=0))
            assert _stored_answers(host) == ["m1"]
            queue.park_run(db, "r", claim.token, clock.now_ms())
            workers.finish(db, worker, "r", "crashed", clock.now_ms())
            continue
        done = handle(host, active, message("m2", "attempt.accept", ready.revision, generation=2, epoch=worker,
                                            attemptId=ready.result.attempt.attemptId, output=1, exit="next",
                                            final=True))
        assert done.outcome == "accepted" and _stored_answers(host) == []  # w1's too, though w2 stored none
    assert runs.get_run(db, "r").status == "completed"
    db.close()
