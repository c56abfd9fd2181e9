"""Store operations of the run dispatcher and supervisors: each one transaction."""

from __future__ import annotations

import dataclasses
import secrets

from piwf.status import CRASHES, DEFAULT_QUEUE, Hold, WorkerStatus
from piwf.store.sql import interactions, queue, workers
from piwf.store.sql.database import Database
from piwf.store.api.types import Claim, Delay, WorkerEnded


class Claimed(list[tuple[Claim, str]]):
    """What ``claim_runs`` claimed, and whether it found all the claimable runs there were
    (``exhausted``): then nothing was left claimable but what it could not take, and only
    a later commit (which wakes the dispatchers) or the passing of time makes more."""

    exhausted: bool = False


def claim_runs(db: Database, *, room: int, exclude: frozenset[str], runner_id: str, lease_ms: int, now: int,
               epoch: int, queues: tuple[str, ...] = (DEFAULT_QUEUE,)) -> Claimed:
    """Claim up to ``room`` runs of ``queues``, oldest first, none in ``exclude`` nor any
    ``runner_id`` recorded it cannot load (store/sql/placement.py), each with a fresh
    token, a worker record (its worker id) and what its worker is launched with
    (``Claim.launch``): one transaction, one commit.

    The candidates are read up to ``room`` at a time (``queue.candidates``) and taken in
    their order; a candidate that cannot be taken (another writer's, or its session's run
    taken just before) is passed over, ``queue.CANDIDATES`` of them in a row at most, as
    ``queue.claim_next_run`` does. Once the candidates read are all there are, no read
    after them finds none.

    Returns a ``Claimed``: ``exhausted`` when, on SQLite (one writer at a time, and a read
    of a write transaction sees every commit), every candidate there was was read and
    tried with room left. Never on PostgreSQL, whose candidate reads pass over rows
    another transaction holds (it may end without a commit, and so without a wake-up)."""
    taken = Claimed()
    skip = set(exclude)
    passed = 0
    with db.write():
        while len(taken) < room and passed < queue.CANDIDATES:
            wanted = room - len(taken)
            found, complete = queue.candidates(db, now=now, exclude=frozenset(skip), runner_id=runner_id,
                                               queues=queues, limit=wanted)
            tried = 0
            for _, run_id, session in found:
                if passed == queue.CANDIDATES:
                    break
                tried += 1
                skip.add(run_id)
                claim = queue.take(db, run_id, runner_id=runner_id, token=secrets.token_urlsafe(24),
                                   lease_ms=lease_ms, now=now, epoch=epoch, session=session, launch=True)
                if claim is None:
                    passed += 1
                    continue
                if session is None:
                    claim = dataclasses.replace(claim, sessionless=True)
                worker_id = secrets.token_hex(8)
                workers.record_start(db, worker_id=worker_id, run_id=claim.run_id, generation=claim.generation,
                                     host_epoch=epoch, now=now)
                taken.append((claim, worker_id))
                passed = 0  # as many again for the next claim
            if complete:
                taken.exhausted = tried == len(found) and len(taken) < room and db.dialect == "sqlite"
                break
    return taken


def end_worker(db: Database, *, worker_id: str, run_id: str, token: str, status: WorkerStatus, now: int,
               exit_code: int | None, signal: int | None, diagnostic: str | None, park: bool,
               max_crashes: int, last_output: str = "", backoff: Delay | None = None,
               answers: bool = True) -> WorkerEnded:
    """Record how a worker ended and, with ``park``, release its run's claim. A crash is
    counted on the run (durably: a run that keeps killing what runs it is held however
    often the host restarts); the ``max_crashes``-th in a row holds it with the worker's
    last output. ``backoff``: how long the parked run waits before it may be claimed again
    (``not_before``, kept with the run, so any host honours it): ms, or ms as a function
    of the crashes in a row before this one (then only after a crash not held). Once the
    run has ended, the answers stored for its ended workers are deleted (unless ``answers``
    is False: the caller knows none of the run's was stored). Returns the run's
    crashes in a row (0 when this end was no crash), whether its run waits for a person
    again (the worker was validating a submission), and the run's ``not_before``."""
    with db.write():
        workers.finish(db, worker_id, run_id, status, now, exit_code=exit_code, signal=signal,
                       diagnostic=diagnostic)
        if park and not queue.holds_token(db, run_id, token):
            # The claim is gone (its run ended or parked by the worker's own message, or it
            # moved on): each step below is fenced by the token, so none would change a thing.
            if answers:
                workers.forget_messages(db, run_id)
            return WorkerEnded(crashes=0, waiting_again=False)
        # A worker that ended while validating a submission: it is rejected and the run waits
        # again; unless its host stopped (a planned stop keeps the value: the next host validates it).
        if park and status != WorkerStatus.STOPPED and interactions.park_if_waiting(db, run_id, token, status, now):
            return WorkerEnded(crashes=0, waiting_again=True)
        crashes = 0
        if status in CRASHES:
            crashes = queue.count_crash(db, run_id, token)
        held = crashes >= max_crashes
        detail = f"worker crashed {crashes} times in a row; last output: {last_output}" if held else None
        not_before = _not_before(backoff, crashes, held, now)
        parked = park and queue.park_run(db, run_id, token, now, hold=Hold.CRASHED if held else None, detail=detail,
                                         not_before=not_before)
        if not parked and answers:  # the run has ended (or is another's): no worker of it will repeat a message
            workers.forget_messages(db, run_id)
        return WorkerEnded(crashes=crashes, waiting_again=False, not_before=not_before if parked else None)


def _not_before(backoff: Delay | None, crashes: int, held: bool, now: int) -> int | None:
    if backoff is None or held:
        return None
    if callable(backoff):
        return None if crashes == 0 else now + backoff(crashes - 1)
    return now + backoff
