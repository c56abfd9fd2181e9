"""What the interleaving tests observe of a PostgreSQL server besides the store: how many
connections wait for a lock (``pg_stat_activity``), so a test knows B is blocked behind A.
Test instrumentation, not a way into the store: the conformance suite still reaches the
store only through its interface."""

from __future__ import annotations

import psycopg


def lock_waits(url: str) -> int:
    """Connections of the server at ``url`` waiting for a lock now."""
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'").fetchone()
        return int(row[0]) if row else 0
