"""Worker records and answered worker messages (seed 001)."""

from __future__ import annotations


import msgspec

from piwf.errors import Conflict
from piwf.protocol import WorkerSummary
from piwf.status import ENDED, LIVE_WORKER
from piwf.wire import canonical_json
from piwf.protocol.worker import WorkerMessage, WorkerResponse, reused_id, worker_fingerprint
from piwf.store.sql.database import Database
from piwf.store.sql.base import add_event, earlier_epoch
from piwf.store.sql.database import one_of

ACTIVE = "status IN ('starting', 'running')"


def record_start(db: Database, *, worker_id: str, run_id: str, generation: int, host_epoch: int, now: int) -> None:
    with db.write():
        db.execute(
            """INSERT INTO run_workers (worker_epoch, run_id, generation, host_epoch, status, started_at)
               VALUES (?, ?, ?, ?, 'starting', ?)""",
            (worker_id, run_id, generation, host_epoch, now),
        )


def attach_process(db: Database, worker_id: str, pid: int, identity: str) -> None:
    with db.write():
        db.execute(
            "UPDATE run_workers SET pid = ?, process_start_identity = ? WHERE worker_epoch = ?",
            (pid, identity, worker_id),
        )


def mark_ready(db: Database, worker_id: str, now: int, *, pid: int | None = None, identity: str | None = None) -> None:
    db.execute(
        """UPDATE run_workers SET status = 'running', ready_at = ?, pid = COALESCE(?, pid),
                  process_start_identity = COALESCE(?, process_start_identity)
           WHERE worker_epoch = ? AND status = 'starting'""",
        (now, pid, identity, worker_id),
    )


def finish(
    db: Database, worker_id: str, run_id: str, outcome: str, now: int, *,
    exit_code: int | None = None, signal: int | None = None, diagnostic: str | None = None,
) -> bool:
    with db.write():
        db.execute(
            f"""UPDATE run_workers SET status = ?, finished_at = ?, exit_code = ?, signal = ?, diagnostic = ?
                WHERE worker_epoch = ? AND {ACTIVE}""",
            (outcome, now, exit_code, signal, diagnostic, worker_id),
        )
        if db.changes() != 1:
            return False
        add_event(db, run_id, "worker.finished",
                  {"workerEpoch": worker_id, "outcome": outcome, "exitCode": exit_code, "signal": signal}, now)
        return True


def amend_end(db: Database, worker_id: str, run_id: str, outcome: str, now: int, *, exit_code: int | None,
              signal: int | None, diagnostic: str | None) -> bool:
    """How a worker recorded as exited (with the message that ended its run, before its
    process exit) did end, when that was otherwise: its record, and an event saying so."""
    with db.write():
        db.execute(
            """UPDATE run_workers SET status = ?, finished_at = ?, exit_code = ?, signal = ?, diagnostic = ?
               WHERE worker_epoch = ? AND status = 'exited'""",
            (outcome, now, exit_code, signal, diagnostic, worker_id),
        )
        if db.changes() != 1:
            return False
        add_event(db, run_id, "worker.amended",
                  {"workerEpoch": worker_id, "outcome": outcome, "exitCode": exit_code, "signal": signal}, now)
        return True


def orphan_before(db: Database, host_epoch: int, now: int) -> list[tuple[str, int, str]]:
    """Mark orphaned the workers of dead earlier host epochs (``base.earlier_epoch``);
    returns (worker id, pid, identity) to reap. One UPDATE: what it returns is what it changed."""
    with db.write():
        rows = db.execute(
            f"""UPDATE run_workers SET status = 'orphaned', finished_at = ?
                WHERE {ACTIVE} AND {earlier_epoch(db, 'host_epoch')}
                RETURNING worker_epoch, pid, process_start_identity""",
            (now, host_epoch),
        ).fetchall()
    return sorted((epoch, pid, identity) for epoch, pid, identity in rows if pid is not None and identity)


def read_message(db: Database, message: WorkerMessage) -> WorkerResponse | None:
    """The stored answer to a repeated message id (or a rejection if its body changed)."""
    row = db.one(
        "SELECT request_fingerprint, response_json FROM worker_messages WHERE worker_epoch = ? AND message_id = ?",
        (message.workerEpoch, message.messageId),
    )
    if row is None:
        return None
    if bytes(row[0]) != worker_fingerprint(message):
        return reused_id(message)
    return msgspec.json.decode(row[1].encode(), type=WorkerResponse)




def record_message(db: Database, message: WorkerMessage, response: WorkerResponse, now: int) -> None:
    """Record an answer (the host records one with the worker's next message). Once
    recorded it stays as it was: an answer recorded by a commit whose outcome the host
    never learnt (PostgreSQL, a connection lost during COMMIT) is recorded again with the
    next message, and that is no conflict."""
    db.execute(
        """INSERT INTO worker_messages (worker_epoch, message_id, request_fingerprint, response_json, completed_at)
           VALUES (?, ?, ?, ?, ?) ON CONFLICT (worker_epoch, message_id) DO NOTHING""",
        (message.workerEpoch, message.messageId, worker_fingerprint(message),
         canonical_json(response).decode(), now),
    )


# Answers are kept while a worker of the run could repeat a message id. Once the run has
# ended (its queue row is final) and a worker's end is recorded, that worker never sends
# again: its run's claim is gone, and it was reaped (or is killed on takeover).
ENDED_RUN_WORKER = f"""SELECT w.worker_epoch FROM run_workers w JOIN run_queue q ON q.run_id = w.run_id
  WHERE w.status NOT IN ({one_of(LIVE_WORKER)}) AND q.status IN ({one_of(ENDED)})"""


def forget_messages(db: Database, run_id: str) -> int:
    """Delete the answers stored for the ended workers of ``run_id`` once the run has ended;
    nothing while it has not. Returns how many were deleted."""
    # The run id in a CAST: compared bare, SQLite would prepare the statement again at each
    # execution (a parameter is matched against run_queue's partial indexes' conditions).
    db.execute(f"""DELETE FROM worker_messages WHERE worker_epoch IN ({ENDED_RUN_WORKER}
                     AND w.run_id = CAST(? AS TEXT))""", (run_id,))
    return db.changes()


def prune_messages(db: Database, batch: int = 500) -> int:
    """Delete the answers of up to ``batch`` ended workers of ended runs (those
    ``forget_messages`` missed: runs that ended while no worker of theirs was recorded
    ending, and answers stored before layout 4). Returns how many answers were deleted;
    call again until it returns 0 (0 too while another host sharing the store does it)."""
    with db.write():
        if not db.try_lock_key("duty", "workers.prune_messages"):
            return 0
        db.execute(f"""DELETE FROM worker_messages WHERE worker_epoch IN (
                         {ENDED_RUN_WORKER} AND w.worker_epoch IN (SELECT DISTINCT worker_epoch FROM worker_messages)
                         LIMIT ?)""", (batch,))
        return db.changes()


def worker_summaries(db: Database, run_id: str) -> list[WorkerSummary]:
    rows = sorted(db.execute(  # sorted here: see runs._step_summaries
        """SELECT started_at, rowid, worker_epoch, generation, pid, status, exit_code, signal, diagnostic
           FROM run_workers WHERE run_id = ?""",
        (run_id,),
    ), key=lambda row: (row[0], row[1]))
    return [WorkerSummary(w, g, p, s, c, sig, d) for _, _, w, g, p, s, c, sig, d in rows]


# --- processes a worker registered (shell nodes in their own process groups) ------------------


def register_process(db: Database, *, worker_id: str, run_id: str, pid: int, identity: str,
                     node: str | None, now: int) -> None:
    """Record a process group the worker started; Conflict when that very process (pid and
    start identity) is registered live to another worker (seed 000)."""
    with db.write():
        db.lock_key("process", f"{pid} {identity}")  # several writers: one registration of a process at a time
        owner = db.scalar(
            """SELECT worker_epoch FROM run_processes
               WHERE status = 'live' AND pid = ? AND process_start_identity = ? AND worker_epoch <> ?""",
            (pid, identity, worker_id))
        if owner is not None:
            raise Conflict(f"process {pid} is already registered to another worker ({owner})")
        db.execute(
            """INSERT INTO run_processes
                 (worker_epoch, pid, process_start_identity, run_id, node_id, status, registered_at)
               VALUES (?, ?, ?, ?, ?, 'live', ?)
               ON CONFLICT (worker_epoch, pid) DO UPDATE SET
                 process_start_identity = excluded.process_start_identity, run_id = excluded.run_id,
                 node_id = excluded.node_id, status = 'live', registered_at = excluded.registered_at,
                 ended_at = NULL""",
            (worker_id, pid, identity, run_id, node, now),
        )


def unregister_process(db: Database, worker_id: str, pid: int, now: int) -> bool:
    """Whether ``pid`` was registered live to this worker (it is gone now)."""
    db.execute("""UPDATE run_processes SET status = 'gone', ended_at = ?
                  WHERE worker_epoch = ? AND pid = ? AND status = 'live'""", (now, worker_id, pid))
    return db.changes() == 1


def live_processes(db: Database, worker_ids: list[str]) -> list[tuple[str, int, str]]:
    """(worker id, pid, identity) of registered processes not yet known to be gone."""
    if not worker_ids:
        return []
    marks = ", ".join("?" * len(worker_ids))
    rows = db.execute(
        f"""SELECT worker_epoch, pid, process_start_identity FROM run_processes
            WHERE status = 'live' AND worker_epoch IN ({marks})""",
        worker_ids,
    )
    return list(rows)


def orphaned_processes(db: Database, host_epoch: int) -> list[tuple[str, int, str]]:
    """Registered processes of workers started by dead earlier host epochs, still marked live."""
    rows = db.execute(
        f"""SELECT p.worker_epoch, p.pid, p.process_start_identity FROM run_processes p
           JOIN run_workers w ON w.worker_epoch = p.worker_epoch
           WHERE p.status = 'live' AND {earlier_epoch(db, 'w.host_epoch')}""",
        (host_epoch,),
    )
    return list(rows)


def mark_processes_gone(db: Database, rows: list[tuple[str, int, str]], now: int) -> None:
    with db.write():
        for worker_id, pid, _ in rows:
            unregister_process(db, worker_id, pid, now)
