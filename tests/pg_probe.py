"""What the interleaving tests observe of a PostgreSQL server besides the store: how many
connections wait for a lock (``pg_stat_activity``), so a test knows B is blocked behind A;
and a schema emptied for the next test (the conformance backend reuses them). Test
instrumentation, not a way into the store: the conformance suite still reaches the store
only through its interface."""

from __future__ import annotations

import psycopg
from psycopg import sql

from piwf.store.postgres.url import parse


def lock_waits(url: str) -> int:
    """Connections of the server at ``url`` waiting for a lock now."""
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'").fetchone()
        return int(row[0]) if row else 0


def empty_schema(url: str) -> None:
    """Every row of the store's tables deleted (its layout kept) and its sequences
    restarted, in one transaction; triggers (the run counters) and foreign keys are off
    meanwhile (``session_replication_role``: the tests' server role is a superuser; on one
    that is not, ``TRUNCATE`` does it, more slowly). A schema without tables yet is left
    alone (its first store makes them)."""
    parsed = parse(url)
    with psycopg.connect(parsed.conninfo) as conn:
        tables = [sql.Identifier(parsed.schema, row[0]) for row in conn.execute(
            "SELECT tablename FROM pg_tables WHERE schemaname = %s AND tablename <> 'piwf_layout'", (parsed.schema,))]
        if not tables:
            return
        try:
            conn.execute("SET LOCAL session_replication_role = replica")
            conn.execute(sql.SQL("; ").join(sql.SQL("DELETE FROM {}").format(table) for table in tables))
        except psycopg.errors.InsufficientPrivilege:
            conn.rollback()
            conn.execute(sql.SQL("TRUNCATE {}").format(sql.SQL(", ").join(tables)))
        conn.execute("SELECT setval(format('%%I.%%I', schemaname, sequencename), start_value, false) "
                     "FROM pg_sequences WHERE schemaname = %s", (parsed.schema,))
