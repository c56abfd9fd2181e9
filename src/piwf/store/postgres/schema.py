"""The PostgreSQL layout: the run side's tables here, the people and controller tables in
``schema_people``; created and migrated under an advisory lock, checked like SQLite's.

The tables have the names, columns and meaning of SQLite's layout 10
(``piwf.store.sqlite.schema``), in PostgreSQL's types: INTEGER → BIGINT (times are ms),
BLOB → BYTEA, AUTOINCREMENT → an identity, and every TEXT column compares bytewise
(``COLLATE "C"``, as SQLite's do, whatever the database's collation). What differs:

- ``hosts``: one lease row per host (per state directory: a restarted host takes its own
  row over), its epoch from the ``host_epochs`` sequence, so epochs number every host
  sharing the store (SQLite: the one ``host_lease`` row of its state directory).
- No ``run_counts`` table nor its triggers: every change would update one of a few hot
  rows, and hosts would serialise on them. ``host.status`` counts the runs not yet ended
  from small partial indexes, and the ended ones from ``run_ends``, a counter in 64 shards
  kept by a trigger (``piwf.store.sql.runs.status_counts``; bench/measure_pg.py).
- ``rowid`` columns where the shared SQL orders by SQLite's rowid (``run_workers`` here).

The layout has its own numbering (``LAYOUT_VERSION``), in the table ``piwf_layout``; a
schema with tables but no such row is not piwf's and is refused untouched, as is a newer
layout.
"""

from __future__ import annotations

import re

from piwf.status import AttemptStatus, Hold, QueueStatus, RunStatus, WorkerStatus
from piwf.store.postgres.cursors import EVENT_ID_COLUMN, EVENT_ID_SQL
from piwf.store.postgres.schema_people import CONTROLLERS_SQL, PEOPLE_SQL, PEOPLE_TABLES
from piwf.store.sql.database import one_of

APPLICATION = "piwf"
LAYOUT_VERSION = 3

# Layout 2 (SQLite's 14): the graph of the workflow a run executes, a blob recorded when the
# run starts or adopts a changed workflow; NULL for a run made before (``run.graph``: unknown).
GRAPH_SQL = """
ALTER TABLE runs ADD COLUMN graph_hash TEXT COLLATE "C";
CREATE INDEX runs_graph_blob ON runs(graph_hash) WHERE graph_hash IS NOT NULL;
"""

# Layout 3 (SQLite's 15): placement and named queues (store/sql/placement.py): a run's queue,
# claims by queue from run_queue_ready, the queues each host serves, and the runs a host
# could not load (its claims pass them over; a run none of the live hosts of its queue can
# load is held).
PLACEMENT_SQL = """
ALTER TABLE run_queue ADD COLUMN queue TEXT COLLATE "C" NOT NULL DEFAULT 'default';
DROP INDEX run_queue_ready;
CREATE INDEX run_queue_ready ON run_queue(queue, created_at, run_id)
  WHERE status IN ('queued', 'parked') AND hold IS NULL;
CREATE TABLE host_queues (
  host_id TEXT COLLATE "C" NOT NULL,
  queue TEXT COLLATE "C" NOT NULL,
  PRIMARY KEY (host_id, queue)
);
CREATE TABLE run_placement (
  run_id TEXT COLLATE "C" NOT NULL,
  host_id TEXT COLLATE "C" NOT NULL,
  reason TEXT COLLATE "C" NOT NULL,
  source_hash TEXT COLLATE "C",
  at BIGINT NOT NULL,
  PRIMARY KEY (run_id, host_id)
);
CREATE INDEX run_placement_host ON run_placement(host_id);
"""

# MIGRATIONS[v] takes layout v to v + 1 (in the transaction that holds the layout lock).
MIGRATIONS: dict[int, str] = {1: GRAPH_SQL, 2: PLACEMENT_SQL}

RUNS_SQL = f"""
CREATE TABLE blobs (
  hash TEXT PRIMARY KEY,
  content BYTEA NOT NULL,
  created_at BIGINT NOT NULL
);

CREATE SEQUENCE host_epochs;
-- One row per host: ``directory`` names its state directory (a random id the host keeps
-- there), so a host restarted on the same directory takes its own row over.
CREATE TABLE hosts (
  directory TEXT PRIMARY KEY,
  epoch BIGINT UNIQUE,
  host_id TEXT,
  token_hash BYTEA,
  boot_id TEXT,
  pid BIGINT,
  process_start_identity TEXT,
  started_at BIGINT,
  heartbeat_at BIGINT,
  expires_at BIGINT
);

CREATE TABLE host_commands (
  request_id TEXT PRIMARY KEY,
  client_id TEXT NOT NULL,
  idempotency_key TEXT NOT NULL,
  operation TEXT NOT NULL,
  request_fingerprint BYTEA NOT NULL,
  run_id TEXT,
  outcome TEXT NOT NULL,
  revision BIGINT,
  receipt_json TEXT,
  receipt_hash TEXT,
  error TEXT,
  host_epoch BIGINT NOT NULL,
  created_at BIGINT NOT NULL,
  UNIQUE (client_id, idempotency_key)
);
CREATE INDEX host_commands_created ON host_commands(created_at);

CREATE TABLE runs (
  run_id TEXT PRIMARY KEY,
  workflow TEXT NOT NULL,
  project_path TEXT NOT NULL,
  definition_hash TEXT NOT NULL,
  definition_digest TEXT NOT NULL,
  start_node TEXT,
  input_json TEXT,
  input_hash TEXT,
  status TEXT NOT NULL CHECK (status IN ({one_of(RunStatus)})),
  paused BIGINT NOT NULL DEFAULT 0,
  status_detail TEXT,
  output_json TEXT,
  output_hash TEXT,
  error_json TEXT,
  revision BIGINT NOT NULL DEFAULT 1,
  origin_session_id TEXT,
  created_at BIGINT NOT NULL,
  updated_at BIGINT NOT NULL,
  finished_at BIGINT
);
CREATE INDEX runs_created ON runs(created_at, run_id);
-- host.status counts the runs not yet ended from these small partial indexes, and the
-- ended ones from run_ends (below).
CREATE INDEX runs_unended ON runs(status) WHERE status IN ('queued', 'running', 'waiting');
CREATE INDEX runs_paused ON runs(paused) WHERE paused != 0;

-- Ended runs counted per engine status, in 64 shards (a run's shard from its id), kept by
-- a trigger: each end adds 1 to one row of 192, so hosts ending runs at once seldom wait
-- for one another, and host.status sums 192 rows however many runs are stored.
CREATE TABLE run_ends (
  shard INTEGER NOT NULL,
  status TEXT NOT NULL,
  n BIGINT NOT NULL DEFAULT 0,
  PRIMARY KEY (shard, status)
);
CREATE FUNCTION piwf_count_run_end() RETURNS trigger LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
BEGIN
  IF TG_OP IN ('UPDATE', 'DELETE') AND OLD.status IN ('completed', 'failed', 'timed_out', 'cancelled') THEN
    UPDATE run_ends SET n = n - 1 WHERE shard = hashtext(OLD.run_id) & 63 AND status = OLD.status;
  END IF;
  IF TG_OP IN ('UPDATE', 'INSERT') AND NEW.status IN ('completed', 'failed', 'timed_out', 'cancelled') THEN
    INSERT INTO run_ends (shard, status, n) VALUES (hashtext(NEW.run_id) & 63, NEW.status, 1)
      ON CONFLICT (shard, status) DO UPDATE SET n = run_ends.n + 1;
  END IF;
  RETURN NULL;
END
$$;
CREATE TRIGGER runs_count_ends AFTER INSERT OR DELETE OR UPDATE OF status, run_id ON runs
  FOR EACH ROW EXECUTE FUNCTION piwf_count_run_end();

CREATE TABLE run_queue (
  run_id TEXT PRIMARY KEY REFERENCES runs(run_id),
  status TEXT NOT NULL CHECK (status IN ({one_of(QueueStatus)})),
  hold TEXT CHECK (hold IN ({one_of(Hold)})),
  runner_id TEXT,
  claim_token TEXT,
  claim_expires_at BIGINT,
  generation BIGINT NOT NULL DEFAULT 0,
  owner_epoch BIGINT,
  origin_session_id TEXT,
  error_code TEXT,
  error_message TEXT,
  created_at BIGINT NOT NULL,
  updated_at BIGINT NOT NULL,
  started_at BIGINT,
  finished_at BIGINT,
  crash_count BIGINT NOT NULL DEFAULT 0,
  not_before BIGINT
) WITH (fillfactor = 70, autovacuum_vacuum_scale_factor = 0.02);
-- A run's queue row is updated in place over and over (the claim, each renewal, the fence
-- of every worker message): room in its page lets PostgreSQL do it there (HOT), and it is
-- vacuumed at 2 % dead rows.
CREATE INDEX run_queue_claimable ON run_queue(status, claim_expires_at);
-- host.status counts the queue rows not yet ended from it.
CREATE INDEX run_queue_unended ON run_queue(status) WHERE status IN ('queued', 'starting', 'running', 'parked');
-- Claims take the oldest ready run: this index hands it over without sorting the queue.
CREATE INDEX run_queue_ready ON run_queue(created_at, run_id)
  WHERE status IN ('queued', 'parked') AND hold IS NULL;
-- One active run per origin session; detached runs (no session) are exempt.
CREATE UNIQUE INDEX run_queue_session_reservation ON run_queue(origin_session_id)
  WHERE origin_session_id IS NOT NULL AND status IN ('queued', 'starting', 'running');
-- A session's runs, for the session rule's checks (queue.SESSION_FREE).
CREATE INDEX run_queue_session ON run_queue(origin_session_id) WHERE origin_session_id IS NOT NULL;

CREATE TABLE node_attempts (
  attempt_id TEXT PRIMARY KEY,
  run_id TEXT NOT NULL REFERENCES runs(run_id),
  seq BIGINT NOT NULL,
  node_id TEXT NOT NULL,
  generation BIGINT NOT NULL,
  status TEXT NOT NULL CHECK (status IN ({one_of(AttemptStatus)})),
  exit_name TEXT,
  output_json TEXT,
  output_hash TEXT,
  error_json TEXT,
  started_at BIGINT NOT NULL,
  finished_at BIGINT,
  settings_change BIGINT
);
CREATE INDEX node_attempts_run ON node_attempts(run_id, seq);
-- An accepted step is accepted once.
CREATE UNIQUE INDEX node_attempts_accepted ON node_attempts(run_id, seq) WHERE status = 'accepted';

-- Its ids are given in commit order as readers see them: store/postgres/cursors.py.
CREATE TABLE run_events (
  {EVENT_ID_COLUMN},
  run_id TEXT NOT NULL,
  at BIGINT NOT NULL,
  type TEXT NOT NULL,
  payload_json TEXT NOT NULL
);
CREATE INDEX run_events_run ON run_events(run_id, event_id);

-- worker_epoch holds the worker's id (as in SQLite's layout).
CREATE TABLE run_workers (
  rowid BIGINT GENERATED ALWAYS AS IDENTITY,
  worker_epoch TEXT PRIMARY KEY,
  run_id TEXT NOT NULL,
  generation BIGINT NOT NULL,
  host_epoch BIGINT NOT NULL,
  pid BIGINT,
  process_start_identity TEXT,
  status TEXT NOT NULL CHECK (status IN ({one_of(WorkerStatus)})),
  started_at BIGINT NOT NULL,
  ready_at BIGINT,
  finished_at BIGINT,
  exit_code BIGINT,
  signal BIGINT,
  diagnostic TEXT
);
CREATE INDEX run_workers_active ON run_workers(status, host_epoch);
CREATE INDEX run_workers_run ON run_workers(run_id, started_at);

CREATE TABLE worker_messages (
  worker_epoch TEXT NOT NULL,
  message_id TEXT NOT NULL,
  request_fingerprint BYTEA NOT NULL,
  response_json TEXT NOT NULL,
  completed_at BIGINT NOT NULL,
  PRIMARY KEY (worker_epoch, message_id)
);

CREATE TABLE effects (
  run_id TEXT NOT NULL REFERENCES runs(run_id),
  effect_key TEXT NOT NULL,
  status TEXT NOT NULL CHECK (status IN ('pending', 'applying', 'applied', 'rejected', 'ambiguous')),
  node_id TEXT NOT NULL,
  generation BIGINT NOT NULL,
  result_json TEXT,
  result_hash TEXT,
  error_json TEXT,
  created_at BIGINT NOT NULL,
  updated_at BIGINT NOT NULL,
  settled_at BIGINT,
  PRIMARY KEY (run_id, effect_key)
);

-- Processes a worker started in their own process groups (shell nodes), to reap with it.
CREATE TABLE run_processes (
  worker_epoch TEXT NOT NULL,
  pid BIGINT NOT NULL,
  process_start_identity TEXT NOT NULL,
  run_id TEXT NOT NULL,
  node_id TEXT,
  status TEXT NOT NULL CHECK (status IN ('live', 'gone')),
  registered_at BIGINT NOT NULL,
  ended_at BIGINT,
  PRIMARY KEY (worker_epoch, pid)
);
CREATE INDEX run_processes_live ON run_processes(status, worker_epoch);

-- The run tables' indexes of SQLite's coming layouts 11 and 12 (ambiguous effects; the
-- blobs a row uses, for pruning; ended runs; run listings), so PostgreSQL has them when
-- those land. PostgreSQL's planner takes no hint: they are used when they help.
CREATE INDEX effects_ambiguous ON effects(run_id) WHERE status = 'ambiguous';
CREATE INDEX runs_ended ON runs(finished_at) WHERE finished_at IS NOT NULL;
CREATE INDEX runs_definition_blob ON runs(definition_hash);
CREATE INDEX runs_input_blob ON runs(input_hash) WHERE input_hash IS NOT NULL;
CREATE INDEX runs_output_blob ON runs(output_hash) WHERE output_hash IS NOT NULL;
CREATE INDEX node_attempts_output_blob ON node_attempts(output_hash) WHERE output_hash IS NOT NULL;
CREATE INDEX effects_result_blob ON effects(result_hash) WHERE result_hash IS NOT NULL;
CREATE INDEX host_commands_receipt_blob ON host_commands(receipt_hash) WHERE receipt_hash IS NOT NULL;
CREATE INDEX host_commands_run ON host_commands(run_id) WHERE run_id IS NOT NULL;
CREATE INDEX runs_by_status ON runs(status, created_at, run_id);
CREATE INDEX runs_by_workflow ON runs(workflow, created_at, run_id);
CREATE INDEX runs_by_session ON runs(origin_session_id, created_at, run_id) WHERE origin_session_id IS NOT NULL;
"""

LAYOUT_SQL = """
CREATE TABLE piwf_layout (
  id INTEGER PRIMARY KEY CHECK (id = 1),
  application TEXT NOT NULL,
  version INTEGER NOT NULL
);
"""


def _bytewise(sql: str) -> str:
    """Every TEXT column of ``sql`` compares bytewise (``COLLATE "C"``)."""
    return re.sub(r"(\n  \w+ TEXT)\b", r'\1 COLLATE "C"', sql)


SCHEMA_SQL = (EVENT_ID_SQL + _bytewise(RUNS_SQL + PEOPLE_SQL + CONTROLLERS_SQL) + GRAPH_SQL + PLACEMENT_SQL
              + LAYOUT_SQL)

# Tables every layout has; a schema missing one is incomplete, not old.
REQUIRED_TABLES = ("piwf_layout", "blobs", "hosts", "host_commands", "runs", "run_queue", "node_attempts",
                   "run_events", "run_workers", "worker_messages", *PEOPLE_TABLES)
