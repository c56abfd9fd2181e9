"""Placement and named queues (layout 15 on SQLite, 3 on PostgreSQL).

A run's workflow is loaded from its project path on whichever machine claims it; only the
digest is stored. A host therefore claims only runs of the queues it serves
(``host_queues``, written when it takes its lease), and the claim itself stays one
statement with SKIP LOCKED: nothing about files is known to the store. A host whose worker
finds the run's workflow missing or of another digest releases the run at once
(``release_unloadable``) and records (run, host) in ``run_placement``; its later claims pass
the run over (``queue.PLACED``), so another host of the queue takes it.

Once every live host serving the run's queue has recorded that it cannot load the run, the
run is held (hold ``source``, the reason in its status detail, as a run held for a changed
workflow always was): on SQLite, with one host, at the first failure. ``settle`` (each
host runs it at start and on every poll) holds runs that became unloadable as hosts left,
releases held ones that a live host of their queue has not tried (a host that joined or
restarted: its records are under its new id), and forgets the records of hosts that are
gone and of runs that ended. A host also forgets its own record of a run once the workflow
file at the run's path is no longer the one it recorded (``source_hash``: restored or
edited), so the run is tried there again; resuming or retrying the run forgets them all.
"""

from __future__ import annotations

from typing import Any

from piwf.errors import ClaimLost
from piwf.status import Hold
from piwf.store.sql import ending
from piwf.store.sql.base import add_event
from piwf.store.sql.database import Database
from piwf.store.sql.listing import HELD

REASON_LIMIT = 8_500  # one host's reason: a worker's load error (8,192 characters) and what it says around it
DETAIL_LIMIT = 65_536  # a run's detail: every live host's reason
HELD_PREFIX = "no live host can load its workflow"


def _hosts(db: Database) -> str:
    """The table of host leases: SQLite's one row, PostgreSQL's row per host."""
    return "host_lease" if db.dialect == "sqlite" else "hosts"


def _serving(db: Database) -> str:
    """(host id, queue) of every live host (lease not expired at ``:now``) and its queues."""
    return (f"(SELECT hq.host_id, hq.queue FROM host_queues hq JOIN {_hosts(db)} h ON h.host_id = hq.host_id "
            "WHERE h.expires_at > :now)")


def serve_queues(db: Database, host_id: str, queues: tuple[str, ...], now: int) -> None:
    """Record the queues host ``host_id`` (whose lease is taken) serves; forget the queues of
    hosts that hold no lease row any more (a host restarted takes a new id)."""
    with db.write():
        db.execute(f"DELETE FROM host_queues WHERE host_id NOT IN "
                   f"(SELECT h.host_id FROM {_hosts(db)} h WHERE h.host_id IS NOT NULL) OR host_id = ?", (host_id,))
        for queue in sorted(set(queues)):
            db.execute("INSERT INTO host_queues (host_id, queue) VALUES (?, ?) ON CONFLICT DO NOTHING",
                       (host_id, queue))


def release_unloadable(db: Database, run_id: str, token: str, *, host_id: str, reason: str,
                       source_hash: str | None, now: int) -> bool:
    """The claimed run's workflow cannot be loaded by host ``host_id`` (missing, unloadable,
    another digest): release the claim, record (run, host) with why and the hash of the file
    it saw (None: none), and hold the run if no live host of its queue is left to try it.
    Whether it was held. Raises ClaimLost (nothing changed) when the claim is gone."""
    from piwf.store.sql import queue

    with db.write():
        if not queue.park_run(db, run_id, token, now, detail=f"cannot be loaded on {host_id}: {reason}"[:DETAIL_LIMIT]):
            raise ClaimLost(f"the claim on run {run_id} is no longer live")
        db.execute("""INSERT INTO run_placement (run_id, host_id, reason, source_hash, at) VALUES (?, ?, ?, ?, ?)
                      ON CONFLICT (run_id, host_id) DO UPDATE SET reason = excluded.reason,
                        source_hash = excluded.source_hash, at = excluded.at""",
                   (run_id, host_id, reason[:REASON_LIMIT], source_hash, now))
        return bool(_hold(db, now, run_id))


# Runs at rest in the queue (not claimed, not ended).
_AT_REST = "run_queue.status IN ('queued', 'parked')"
# ... that some host has recorded it cannot load.
_RECORDED = f"{_AT_REST} AND run_queue.run_id IN (SELECT p.run_id FROM run_placement p)"


def _untried(db: Database) -> str:
    """SQL true when a live host of the run's queue has not recorded it cannot load it."""
    return f"""EXISTS (SELECT 1 FROM {_serving(db)} s WHERE s.queue = run_queue.queue AND NOT EXISTS (
      SELECT 1 FROM run_placement p WHERE p.run_id = run_queue.run_id AND p.host_id = s.host_id))"""


def _hold(db: Database, now: int, run_id: str | None = None) -> list[str]:
    """Hold the runs (or run ``run_id``) that every live host of their queue (one at least)
    has recorded it cannot load; their ids. Read from the records (few), through the queue's
    primary key, not from the queue's ready runs (many)."""
    only = "AND run_id = :run" if run_id is not None else ""
    held = [row[0] for row in db.execute(
        f"""UPDATE run_queue INDEXED BY sqlite_autoindex_run_queue_1 SET hold = '{Hold.SOURCE}', updated_at = :now
            WHERE hold IS NULL AND {_RECORDED} {only}
              AND EXISTS (SELECT 1 FROM {_serving(db)} s WHERE s.queue = run_queue.queue)
              AND NOT {_untried(db)}
            RETURNING run_id""", {"now": now, "run": run_id}).fetchall()]
    for run in held:
        detail = why_held(db, run, now)
        db.execute("UPDATE runs SET status_detail = ?, updated_at = ? WHERE run_id = ?", (detail, now, run))
        add_event(db, run, "held", {"reason": detail}, now)
        ending.cascade(db, run, now)  # held for a person: its session's turn
    return sorted(held)


def why_held(db: Database, run_id: str, now: int) -> str:
    """The reason of a run no live host can load: each live host's record of it."""
    rows = db.execute(f"""SELECT p.host_id, p.reason FROM run_placement p
                          WHERE p.run_id = :run AND p.host_id IN (SELECT s.host_id FROM {_serving(db)} s)
                          ORDER BY p.host_id""", {"run": run_id, "now": now}).fetchall()
    return f"{HELD_PREFIX}: " + "; ".join(f"{host}: {reason}" for host, reason in rows)[:DETAIL_LIMIT]


def _release(db: Database, now: int) -> list[str]:
    """Release the runs held for their workflow (through the index of held runs: the
    same ``HELD`` term) that a live host of their queue has not
    tried (back to paused if they were paused meanwhile); their ids. A run held so before
    layout 15 (no records) is tried once by each live host of its queue: only a host that
    finds the file with the run's digest goes on with it, the others record it."""
    released = [row[0] for row in db.execute(
        f"""UPDATE run_queue SET updated_at = :now,
              hold = CASE WHEN (SELECT r.paused FROM runs r WHERE r.run_id = run_queue.run_id) != 0
                          THEN '{Hold.PAUSED}' ELSE NULL END
            WHERE hold = '{Hold.SOURCE}' AND {HELD} AND {_AT_REST} AND {_untried(db)}
            RETURNING run_id""", {"now": now}).fetchall()]
    for run in released:
        db.execute("UPDATE runs SET status_detail = CASE WHEN paused != 0 THEN 'paused' ELSE NULL END, "
                   "updated_at = ? WHERE run_id = ?", (now, run))
        add_event(db, run, "released", {"reason": "a live host of its queue has not tried to load it yet"}, now)
    return sorted(released)


def settle(db: Database, now: int) -> list[str]:
    """Release held runs a live host of their queue may load, hold those none can, and forget
    the records of hosts gone and of runs ended; the ids of the runs released (to claim)."""
    with db.write():
        released = _release(db, now)
        _hold(db, now)
        db.execute(f"DELETE FROM run_placement WHERE host_id NOT IN "
                   f"(SELECT h.host_id FROM {_hosts(db)} h WHERE h.host_id IS NOT NULL)")
        db.execute("""DELETE FROM run_placement WHERE NOT EXISTS (SELECT 1 FROM run_queue q
                        WHERE q.run_id = run_placement.run_id
                          AND q.status IN ('queued', 'starting', 'running', 'parked'))""")
        return released


def own_records(db: Database, host_id: str) -> list[tuple[str, str, str, str | None]]:
    """(run id, project path, workflow, source hash) of each run host ``host_id`` recorded it
    cannot load."""
    return [(run, project, workflow, digest) for run, project, workflow, digest in db.execute(
        """SELECT p.run_id, r.project_path, r.workflow, p.source_hash FROM run_placement p
           JOIN runs r ON r.run_id = p.run_id WHERE p.host_id = ? ORDER BY p.run_id""", (host_id,)).fetchall()]


def forget(db: Database, host_id: str, run_ids: list[str]) -> int:
    """Forget host ``host_id``'s records of ``run_ids`` (its file changed: it tries them again)."""
    with db.write():
        gone = 0
        for run_id in run_ids:
            db.execute("DELETE FROM run_placement WHERE run_id = ? AND host_id = ?", (run_id, host_id))
            gone += db.changes()
        return gone


def forget_run(db: Database, run_id: str) -> None:
    """Every host tries the run again (it was resumed or retried: its workflow may have changed)."""
    db.execute("DELETE FROM run_placement WHERE run_id = ?", (run_id,))


def waiting_because(db: Database, run_id: str, queue: str, now: int) -> str | None:
    """Why a run that is ready to be claimed is not being claimed, if the store can tell: no
    live host serves its queue, or some live hosts of it cannot load it."""
    serving = [host for (host,) in db.execute(f"SELECT s.host_id FROM {_serving(db)} s WHERE s.queue = :queue",
                                                  {"queue": queue, "now": now}).fetchall()]
    if not serving:
        return f"no live host serves queue {queue!r}"
    rows: list[Any] = db.execute(
        "SELECT host_id, reason FROM run_placement WHERE run_id = ? ORDER BY host_id", (run_id,)).fetchall()
    unable = [(host, reason) for host, reason in rows if host in serving]
    if not unable:
        return None
    return (f"{len(unable)} of {len(serving)} live hosts of queue {queue!r} cannot load its workflow: "
            + "; ".join(f"{host}: {reason}" for host, reason in unable))[:DETAIL_LIMIT]
