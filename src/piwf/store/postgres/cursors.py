"""Cursors in commit order on PostgreSQL: ``run.watch`` never skips, repeats or reorders
an event that committed after a later-numbered one.

A run event's id comes from a sequence when it is inserted, not when it commits: a
transaction may hold id 10 uncommitted while another commits id 11. A reader that took 11
and moved its cursor past it would never see 10. SQLite has one writer at a time, so ids
commit in order there; here the readers stop short of the oldest id a transaction still
open may commit (the *horizon*), and a page never goes past it.

How the horizon is known, without a hot row or a lock every writer waits on:

- a writer's first event in a transaction first takes a *floor* from the sequence and
  holds a shared advisory lock named by it until the transaction ends (``piwf_event_id``,
  the DEFAULT of ``run_events.event_id``); every id it then takes is above its floor.
  Shared locks never wait for one another, so writers never wait for this;
- a reader reads, in this order: the sequence's last value L, then the smallest floor F
  still locked (``pg_locks``), then (in a new snapshot) the events up to min(L, F).

Why that is safe: an id at or below L was taken before the reader looked; the
transaction that took it had locked its floor (below the id) before. If it was still
open when ``pg_locks`` was read, F is below its ids; if not, it had committed (or rolled
back) before the reader's snapshot, which therefore shows it. A transaction that locks
its floor after ``pg_locks`` was read takes its ids after L was read: above L.

The locks live in the two-key advisory space (PostgreSQL keeps it apart from one-key
locks): key 1 is this schema's base (``piwf_event_lock_base``) plus the floor's high
bits, key 2 its low 31 bits. Another lock that happened to share a key could only make a
reader wait a little longer, never skip. The sequence must not cache values per session
(``CACHE 1``, the default): its last value is then the last one handed out.
"""

from __future__ import annotations

from typing import Any

# Created with the run tables, before run_events (whose event_id defaults to piwf_event_id()).
EVENT_ID_SQL = """
CREATE SEQUENCE run_events_event_id_seq AS BIGINT CACHE 1;
CREATE FUNCTION piwf_event_lock_base() RETURNS integer LANGUAGE sql STABLE SET search_path FROM CURRENT AS $$
  SELECT ((hashtext(current_schema()) & 32767) << 16)
$$;
CREATE FUNCTION piwf_event_id() RETURNS bigint LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
DECLARE
  first bigint;
BEGIN
  IF COALESCE(current_setting('piwf.event_floor', true), '') = '' THEN
    first := nextval('run_events_event_id_seq');
    PERFORM pg_advisory_xact_lock_shared(piwf_event_lock_base() + (first >> 31)::integer,
                                         (first & 2147483647)::integer);
    PERFORM set_config('piwf.event_floor', first::text, true);
  END IF;
  RETURN nextval('run_events_event_id_seq');
END
$$;
"""

# The column, for the run tables' DDL: `event_id BIGINT PRIMARY KEY DEFAULT piwf_event_id()`.
EVENT_ID_COLUMN = "event_id BIGINT PRIMARY KEY DEFAULT piwf_event_id()"

LAST_VALUE_SQL = """SELECT CASE WHEN is_called THEN last_value ELSE last_value - 1 END
  FROM run_events_event_id_seq"""
OLDEST_FLOOR_SQL = """SELECT MIN(((l.classid::bigint - b.base) << 31) + l.objid::bigint)
  FROM pg_locks l, (SELECT piwf_event_lock_base()::bigint AS base) b
  WHERE l.locktype = 'advisory' AND l.objsubid = 2 AND l.granted
    AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
    AND l.classid::bigint >= b.base AND l.classid::bigint < b.base + 65536"""


def event_horizon(db: Any) -> int:
    """The highest event id a reader may go up to: every event at or below it that will
    ever commit has. Call outside a transaction (before the snapshot the events are read
    from), each statement on its own, in this order."""
    last: int = db.scalar(LAST_VALUE_SQL)
    floor: int | None = db.scalar(OLDEST_FLOOR_SQL)
    return last if floor is None else min(last, floor)
