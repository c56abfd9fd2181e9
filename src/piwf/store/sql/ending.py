"""The run-end cascade: what follows, in the same transaction, when a run ends or is held
for a person. Every path that ends a run (``queue.complete_run``, ``fail_run``,
``cancel_run``, a deadline's timeout in ``deadlines``) or holds it (``queue.park_run`` with
a hold) calls ``cascade``; this module sits above the aggregates' modules it reaches into
(interactions, delivery) and below the ones that end runs.

Two consequences of an end are not here, on purpose: the answers stored for the run's
workers are forgotten when the last worker ends (``supervision.end_worker``: a live worker
may still repeat the message that ended the run, and is answered from them), and a child
run of a controller is synced by the host's watch of run changes
(``controller_effects.sync_children``, one indexed query for all of them), so that a run
with no controller pays nothing for it.
"""

from __future__ import annotations

from piwf.store.sql import delivery
from piwf.store.sql.database import Database
from piwf.store.sql.interactions import close_open


def cascade(db: Database, run_id: str, now: int, *, ended: str | None = None) -> None:
    """A run ended (``ended``: its queue status) or was held for a person: the requests it
    waited on are closed (a later answer is refused, nothing is left pending for a run that
    will never take it) when it ended, and its origin session's turn is written."""
    # An open request always has its attempt waiting: one indexed look-up for every other run.
    if ended is not None and db.one("SELECT 1 FROM node_attempts WHERE run_id = ? AND status = 'waiting' LIMIT 1",
                                    (run_id,)):
        close_open(db, run_id, now, f"the run ended ({ended})")
    delivery.turn_for_run(db, run_id, now)
