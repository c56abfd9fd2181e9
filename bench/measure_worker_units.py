"""CPU of the host's two worker-message units of a fresh one-node run (`worker.ready`,
which starts the first attempt, and the final `attempt.accept`, which completes the run
and records the worker's end), in process on a real SQLite file (``normal``), with no
worker process and no loop: ``worker_messages.handle`` driven as
tests/test_worker_messages.py drives it (on SQLite it never awaits a checkpoint).

    python bench/measure_worker_units.py [N] [--rounds R] [--setup-only]

Prints the statements per run of the two units and their CPU (``time.process_time``) per
run, median of R rounds of N runs. The script uses only ``handle`` and the store's module
functions, so it runs against another tree too: put that tree's ``src`` first on
PYTHONPATH, and alternate the two to compare them. ``--setup-only`` does all but the two
units (each run's creation, claim and worker record): under callgrind, what to take off
to count the units' own instructions.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from piwf.clock import ManualClock
from piwf.host import worker_messages
from piwf.host.state import ActiveRun, HostConfig, HostState
from piwf.paths import StatePaths
from piwf.protocol.worker import WorkerMessage, WorkerResponse, parse_worker_message
from piwf.store.sql import placement, queue, runs, workers
from piwf.store.sqlite import Database, SqliteStore
from piwf.store.sqlite.hosts import acquire_lease
from piwf.wire import canonical_json

LEASE = 60_000


def _handle(host: HostState, active: ActiveRun, message: WorkerMessage) -> WorkerResponse:
    answering = worker_messages.handle(host, active, message)
    try:
        answering.send(None)
    except StopIteration as done:
        response: WorkerResponse = done.value
        return response
    raise AssertionError("answering a worker message awaited a checkpoint")


def _message(mid: str, operation: str, revision: int, epoch: str, **payload: Any) -> WorkerMessage:
    return parse_worker_message(canonical_json({"messageId": mid, "workerEpoch": epoch, "generation": 1,
                                                "expectedRevision": revision, "operation": operation,
                                                "payload": payload}))


def one_round(root: Path, n: int, units: bool = True) -> tuple[float, float]:
    """(CPU ms per run of the two units, statements per run)."""
    paths = StatePaths.resolve(root / "state")
    paths.ensure()
    clock = ManualClock()
    db = Database.open(paths.db)
    db.conn.execute("PRAGMA synchronous = NORMAL")
    host = HostState(HostConfig(paths, run_lease_ms=LEASE), SqliteStore(db), clock)
    host.lease = acquire_lease(db, host_id=host.host_id, pid=1, identity="x", lease_ms=LEASE, now=clock.now_ms())
    placement.serve_queues(db, host.host_id, host.config.queues, clock.now_ms())
    statements = 0

    def count(cursor: Any, sql: str, bindings: Any) -> bool:
        nonlocal statements
        statements += 1
        return True

    spent = 0.0
    for i in range(n):
        run_id, epoch = f"r{i}", f"w{i}"
        runs.create_run(db, run_id=run_id, workflow="noop", project_path="/", source=b"", digest="d", input={},
                        origin_session_id=None, now=clock.now_ms(), start_node="only")
        claim = queue.claim_run(db, run_id, runner_id=host.host_id, token=f"t{i}", lease_ms=LEASE,
                                now=clock.now_ms(), epoch=host.epoch)
        assert claim is not None
        workers.record_start(db, worker_id=epoch, run_id=run_id, generation=claim.generation,
                             host_epoch=host.epoch, now=clock.now_ms())
        active = ActiveRun(claim, worker_id=epoch)
        ready_line = _message("m1", "worker.ready", 0, epoch, digest="d")
        if not units:
            continue
        db.conn.exec_trace = count
        began = time.process_time()
        ready = _handle(host, active, ready_line)
        final = _message("m2", "attempt.accept", ready.revision or 0, epoch, exit="next", output={}, final=True,
                         attemptId=ready.result.attempt.attemptId)
        done = _handle(host, active, final)
        spent += time.process_time() - began
        db.conn.exec_trace = None
        assert done.outcome == "accepted", done
        clock.advance(1)
    db.close()
    return spent / n * 1000, statements / n


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("n", type=int, nargs="?", default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--setup-only", action="store_true")
    args = parser.parse_args()
    results = []
    for _ in range(args.rounds):
        with tempfile.TemporaryDirectory() as tmp:
            results.append(one_round(Path(tmp), args.n, units=not args.setup_only))
    print(json.dumps({"cpu_ms_per_run": statistics.median(r[0] for r in results),
                      "rounds_cpu_ms": [round(r[0], 4) for r in results],
                      "statements_per_run": results[0][1], "n": args.n}))


if __name__ == "__main__":
    main()
