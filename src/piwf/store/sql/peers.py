"""What one host holds, by its epoch: the counts ``piwf status`` lists per host, and the
clean-up after a host on the same machine was proved dead (``HostsStore.take_over_peer``:
the lease row's part is the backend's, ``store/postgres/peers.py``).

Both dialects: every statement names the dead epoch itself, never "every earlier one", so a
host cleaning up after a peer touches nothing of any other host.
"""

from __future__ import annotations

from piwf.store.sql.base import LIVE
from piwf.store.sql.controllers import add_resource_event
from piwf.store.sql.database import Database

DEAD_HOST = "interrupted: its host died"


def activity(db: Database, epochs: list[int], now: int) -> dict[int, tuple[int, int]]:
    """(runs, reconciles) with a live claim held by each of ``epochs``."""
    if not epochs:
        return {}
    marks = ", ".join("?" * len(epochs))
    counts = {epoch: [0, 0] for epoch in epochs}
    for epoch, count in db.execute(
            f"""SELECT owner_epoch, COUNT(*) FROM run_queue
                WHERE {LIVE} AND claim_expires_at > ? AND owner_epoch IN ({marks}) GROUP BY owner_epoch""",
            (now, *epochs)):
        counts[epoch][0] = count
    for epoch, count in db.execute(
            f"""SELECT claim_epoch, COUNT(*) FROM controller_queue
                WHERE claim_token IS NOT NULL AND claim_expires_at > ? AND claim_epoch IN ({marks})
                GROUP BY claim_epoch""", (now, *epochs)):
        counts[epoch][1] = count
    return {epoch: (runs, reconciles) for epoch, (runs, reconciles) in counts.items()}


def active_workers(db: Database, epoch: int) -> list[tuple[str, int, str]]:
    """(worker id, pid, identity) of the run workers of host ``epoch`` still recorded active."""
    rows = db.execute("""SELECT worker_epoch, pid, process_start_identity FROM run_workers
                         WHERE status IN ('starting', 'running') AND host_epoch = ?""", (epoch,)).fetchall()
    return sorted((worker, pid, identity) for worker, pid, identity in rows if pid is not None and identity)


def registered_processes(db: Database, epoch: int) -> list[tuple[str, int, str]]:
    """The process groups the workers of host ``epoch`` registered, still marked live."""
    return list(db.execute(
        """SELECT p.worker_epoch, p.pid, p.process_start_identity FROM run_processes p
           JOIN run_workers w ON w.worker_epoch = p.worker_epoch
           WHERE p.status = 'live' AND w.host_epoch = ?""", (epoch,)))


def reconcilers(db: Database, epoch: int) -> list[tuple[str, int, str]]:
    """(uid, pid, identity) of the reconcile workers host ``epoch``'s claims recorded."""
    rows = db.execute("""SELECT uid, worker_pid, worker_identity FROM controller_queue
                         WHERE claim_token IS NOT NULL AND claim_epoch = ? AND worker_pid IS NOT NULL""", (epoch,))
    return [(uid, pid, identity) for uid, pid, identity in rows if identity]


def expire_claims(db: Database, epoch: int, now: int) -> tuple[list[str], int]:
    """The claims of dead host ``epoch`` end now: its runs are claimable at once, its
    reconciles due at once (each counted as an error, as on a takeover of one's own
    directory), and its workers still recorded active are orphaned (the caller killed
    them). Returns the runs' ids and the reconciles' count."""
    with db.write():
        db.execute("""UPDATE run_workers SET status = 'orphaned', finished_at = ?
                      WHERE status IN ('starting', 'running') AND host_epoch = ?""", (now, epoch))
        run_ids = sorted(run_id for (run_id,) in db.execute(
            f"""UPDATE run_queue SET claim_expires_at = ?
                WHERE {LIVE} AND owner_epoch = ? AND claim_expires_at > ? RETURNING run_id""",
            (now, epoch, now)).fetchall())
        uids = sorted(uid for (uid,) in db.execute(
            """UPDATE controller_queue SET claim_token = NULL, claim_expires_at = NULL, available_at = ?,
                 consecutive_errors = consecutive_errors + 1, updated_at = ?, last_error = ?
               WHERE claim_token IS NOT NULL AND claim_epoch = ? RETURNING uid""",
            (now, now, DEAD_HOST, epoch)).fetchall())
        for uid in uids:
            add_resource_event(db, uid, "reconcile_failed", {"error": DEAD_HOST, "delayMs": 0, "permanent": False},
                               now)
    return run_ids, len(uids)
