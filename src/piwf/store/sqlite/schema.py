"""The state database layout. Bump SCHEMA_VERSION and add a migration for any change."""

from piwf.status import AttemptStatus, Hold, QueueStatus, RunStatus, WorkerStatus
from piwf.store.sql.database import lifecycle_contradicts, one_of
from piwf.store.sql.listing import HELD
from piwf.store.sqlite.schema_features import (
    CONTROLLERS_SQL, DELIVERY_SQL, EFFECT_OUTCOME, EFFECT_STATUS, INTERACTIONS_SQL, SETTINGS_SQL,
)

APPLICATION_ID = 0x70697766  # "piwf"
SCHEMA_VERSION = 15


# The columns named worker_epoch (run_workers, run_processes, worker_messages and the run_processes_live index)
# hold the worker's id, a random id the host makes for each worker it starts (the protocol's workerEpoch);
# the Python code calls it worker_id. Renaming the columns needs a new layout and a migration, so they keep
# their old name until then.
RUN_WORKERS_SQL = f"""
CREATE TABLE run_workers (
  worker_epoch TEXT PRIMARY KEY,
  run_id TEXT NOT NULL,
  generation INTEGER NOT NULL,
  host_epoch INTEGER NOT NULL,
  pid INTEGER,
  process_start_identity TEXT,
  status TEXT NOT NULL CHECK (status IN ({one_of(WorkerStatus)})),
  started_at INTEGER NOT NULL,
  ready_at INTEGER,
  finished_at INTEGER,
  exit_code INTEGER,
  signal INTEGER,
  diagnostic TEXT
);
CREATE INDEX run_workers_active ON run_workers(status, host_epoch);
CREATE INDEX run_workers_run ON run_workers(run_id, started_at);
"""

# Tables whose text both the full layout and a migration use.
def _run_queue_sql(holds: str, extra: str = "") -> str:
    return f"""
CREATE TABLE run_queue (
  run_id TEXT PRIMARY KEY REFERENCES runs(run_id),
  status TEXT NOT NULL CHECK (status IN
    ('queued', 'starting', 'running', 'parked', 'done', 'failed', 'cancelled')),
  hold TEXT CHECK (hold IN ({holds})),
  runner_id TEXT,
  claim_token TEXT,
  claim_expires_at INTEGER,
  generation INTEGER NOT NULL DEFAULT 0,
  owner_epoch INTEGER,
  origin_session_id TEXT,
  error_code TEXT,
  error_message TEXT,
  created_at INTEGER NOT NULL,
  updated_at INTEGER NOT NULL,
  started_at INTEGER,
  finished_at INTEGER{extra}
);
CREATE INDEX run_queue_claimable ON run_queue(status, claim_expires_at);
-- Claims take the oldest ready run: this index hands it over without sorting the queue.
CREATE INDEX run_queue_ready ON run_queue(created_at, run_id)
  WHERE status IN ('queued', 'parked') AND hold IS NULL;
-- One active run per origin session; detached runs (no session) are exempt.
CREATE UNIQUE INDEX run_queue_session_reservation ON run_queue(origin_session_id)
  WHERE origin_session_id IS NOT NULL AND status IN ('queued', 'starting', 'running');
"""


# Layout 2's run queue (its migration copies layout-1 rows into it); layout 6 rebuilds it
# with the 'waiting' hold, keeping layout 5's crash_count as its last column.
RUN_QUEUE_SQL = _run_queue_sql("'paused', 'source', 'crashed', 'effect'")
RUN_QUEUE_V6_SQL = _run_queue_sql(one_of(Hold), ",\n  crash_count INTEGER NOT NULL DEFAULT 0")

def _node_attempts_sql(statuses: str) -> str:
    return f"""
CREATE TABLE node_attempts (
  attempt_id TEXT PRIMARY KEY,
  run_id TEXT NOT NULL REFERENCES runs(run_id),
  seq INTEGER NOT NULL,
  node_id TEXT NOT NULL,
  generation INTEGER NOT NULL,
  status TEXT NOT NULL CHECK (status IN ({statuses})),
  exit_name TEXT,
  output_json TEXT,
  output_hash TEXT,
  error_json TEXT,
  started_at INTEGER NOT NULL,
  finished_at INTEGER
);
CREATE INDEX node_attempts_run ON node_attempts(run_id, seq);
-- An accepted step is accepted once.
CREATE UNIQUE INDEX node_attempts_accepted ON node_attempts(run_id, seq) WHERE status = 'accepted';
"""


NODE_ATTEMPTS_V6_SQL = _node_attempts_sql(one_of(AttemptStatus))  # layout 6: 'waiting' attempts

EFFECTS_AND_PROCESSES_SQL = """
CREATE TABLE effects (
  run_id TEXT NOT NULL REFERENCES runs(run_id),
  effect_key TEXT NOT NULL,
  """ + EFFECT_STATUS + """
  node_id TEXT NOT NULL,
  """ + EFFECT_OUTCOME + """
  PRIMARY KEY (run_id, effect_key)
);

-- Processes a worker started in their own process groups (shell nodes), to reap with it.
CREATE TABLE run_processes (
  worker_epoch TEXT NOT NULL,
  pid INTEGER NOT NULL,
  process_start_identity TEXT NOT NULL,
  run_id TEXT NOT NULL,
  node_id TEXT,
  status TEXT NOT NULL CHECK (status IN ('live', 'gone')),
  registered_at INTEGER NOT NULL,
  ended_at INTEGER,
  PRIMARY KEY (worker_epoch, pid)
);
CREATE INDEX run_processes_live ON run_processes(status, worker_epoch);
"""

def _add(where: str, amount: str) -> str:
    return f"UPDATE run_counts SET n = n + ({amount}) WHERE {where};\n"


def _status(table: str, row: str, sign: str) -> str:
    return _add(f"scope = '{table}.status' AND value = {row}.status", f"{sign}1".lstrip("+"))


def _contradiction(table: str, key: str, *terms: tuple[str, str]) -> str:
    """Add to the contradiction count, judging each (sign, status of this table's row)
    against the other table's row for run ``key`` as it is now (none: nothing to judge)."""
    other, alias = ("run_queue", "q") if table == "runs" else ("runs", "r")

    def judged(status: str) -> str:
        pair = (status, f"{alias}.status") if table == "runs" else (f"{alias}.status", status)
        return lifecycle_contradicts(*pair)

    delta = " ".join(f"{sign} {judged(status)}" for sign, status in terms)
    return _add("scope = 'lifecycle'",
                f"COALESCE((SELECT {delta} FROM {other} {alias} WHERE {alias}.run_id = {key}), 0)")


def _trigger(name: str, event: str, when: str, body: str) -> str:
    return f"CREATE TRIGGER {name} AFTER {event}{f' WHEN {when}' if when else ''} BEGIN\n{body}END;\n"


def _count_triggers(table: str) -> str:
    """A row arriving, leaving, changing status or moving to another run id (which only a
    hand edit does) changes the counts; nothing else fires (claim renewals, revisions)."""
    paused = table == "runs"
    return "".join((
        _trigger(f"{table}_counted_insert", f"INSERT ON {table}", "",
                 _status(table, "NEW", "+") + (_add("scope = 'runs.paused' AND NEW.paused != 0", "1") if paused else "")
                 + _contradiction(table, "NEW.run_id", ("+", "NEW.status"))),
        _trigger(f"{table}_counted_status", f"UPDATE OF status ON {table}",
                 "OLD.status IS NOT NEW.status AND OLD.run_id IS NEW.run_id",
                 _status(table, "OLD", "-") + _status(table, "NEW", "+")
                 + _contradiction(table, "NEW.run_id", ("+", "NEW.status"), ("-", "OLD.status"))),
        _trigger(f"{table}_counted_moved", f"UPDATE OF run_id ON {table}", "OLD.run_id IS NOT NEW.run_id",
                 _status(table, "OLD", "-") + _status(table, "NEW", "+")
                 + _contradiction(table, "OLD.run_id", ("-", "OLD.status"))
                 + _contradiction(table, "NEW.run_id", ("+", "NEW.status"))),
        _trigger(f"{table}_counted_delete", f"DELETE ON {table}", "",
                 _status(table, "OLD", "-")
                 + (_add("scope = 'runs.paused' AND OLD.paused != 0", "-1") if paused else "")
                 + _contradiction(table, "OLD.run_id", ("-", "OLD.status"))),
        _trigger("runs_counted_paused", "UPDATE OF paused ON runs", "(OLD.paused != 0) IS NOT (NEW.paused != 0)",
                 _add("scope = 'runs.paused'", "(NEW.paused != 0) - (OLD.paused != 0)")) if paused else "",
    ))


# Layout 4: run counts kept as runs change, so host.status reads a few rows instead of
# counting every run ever stored. SQLite triggers keep them, so no statement (piwf's own,
# or one typed into the sqlite3 shell) can change a run without counting it. Rows:
# ('runs.status', s) and ('run_queue.status', s) per status word, ('runs.paused', 'paused'),
# and ('lifecycle', 'contradictions'): runs whose two statuses do not go together, kept
# exactly over all runs (each change re-judges the one run it touches).
# A later layout that rebuilds runs or run_queue (rename, copy, drop) must drop these
# triggers first and create them again after; ADD COLUMN leaves them as they are.
RUN_COUNTS_SQL = f"""
CREATE TABLE run_counts (
  scope TEXT NOT NULL,
  value TEXT NOT NULL,
  n INTEGER NOT NULL,
  PRIMARY KEY (scope, value)
) WITHOUT ROWID;
INSERT INTO run_counts (scope, value, n) VALUES
  {", ".join(f"('runs.status', '{s}', 0)" for s in RunStatus)},
  {", ".join(f"('run_queue.status', '{s}', 0)" for s in QueueStatus)},
  ('runs.paused', 'paused', 0), ('lifecycle', 'contradictions', 0);
UPDATE run_counts SET n = (SELECT COUNT(*) FROM runs WHERE status = run_counts.value) WHERE scope = 'runs.status';
UPDATE run_counts SET n = (SELECT COUNT(*) FROM run_queue WHERE status = run_counts.value)
  WHERE scope = 'run_queue.status';
UPDATE run_counts SET n = (SELECT COUNT(*) FROM runs WHERE paused != 0) WHERE scope = 'runs.paused';
UPDATE run_counts SET n = (SELECT COUNT(*) FROM runs r JOIN run_queue q ON q.run_id = r.run_id
  WHERE {lifecycle_contradicts('r.status', 'q.status')}) WHERE scope = 'lifecycle';
""" + _count_triggers("runs") + _count_triggers("run_queue")


# Layout 5: consecutive crashes, counted where the run is claimed (run_queue keeps the
# column order of layout 2 so its migration can copy rows with SELECT *).
CRASH_COUNT_SQL = """
ALTER TABLE run_queue ADD COLUMN crash_count INTEGER NOT NULL DEFAULT 0;
"""

# Layout 10: a crashed run's back-off, kept where the run is claimed (so a host that starts
# later honours it too): claims skip a ready run before ``not_before`` (ms). A fresh
# database adds the column the same way, so both keep one CREATE TABLE text.
NOT_BEFORE_SQL = """
ALTER TABLE run_queue ADD COLUMN not_before INTEGER;
"""

# Layout 11: effects whose outcome is unknown are counted (host.status ambiguousEffects)
# through partial indexes, so the count reads only them; a reconcile's effect records the
# action it was reserved for (kind, and a fingerprint of its request: a key reused for
# another action is a conflict; NULL in a row made before layout 11: the first reserve
# after it records them). A fresh database adds them the same way.
EFFECT_IDENTITY_SQL = """
CREATE INDEX effects_ambiguous ON effects(run_id) WHERE status = 'ambiguous';
CREATE INDEX controller_effects_ambiguous ON controller_effects(uid) WHERE status = 'ambiguous';
ALTER TABLE controller_effects ADD COLUMN kind TEXT;
ALTER TABLE controller_effects ADD COLUMN request_fingerprint TEXT;
"""

# Layout 13: retention (store/sql/retention.py). Ended runs are found by when they ended;
# a blob is deleted only when no column naming blobs names it, each checked by an index
# (partial where the column is mostly NULL: values inline); a controller's child runs are
# found by run id, and so are the logged commands that name a run (their answers say it
# was deleted).
RETENTION_SQL = """
CREATE INDEX runs_ended ON runs(finished_at) WHERE finished_at IS NOT NULL;
CREATE INDEX runs_definition_blob ON runs(definition_hash);
CREATE INDEX runs_input_blob ON runs(input_hash) WHERE input_hash IS NOT NULL;
CREATE INDEX runs_output_blob ON runs(output_hash) WHERE output_hash IS NOT NULL;
CREATE INDEX node_attempts_output_blob ON node_attempts(output_hash) WHERE output_hash IS NOT NULL;
CREATE INDEX effects_result_blob ON effects(result_hash) WHERE result_hash IS NOT NULL;
CREATE INDEX host_commands_receipt_blob ON host_commands(receipt_hash) WHERE receipt_hash IS NOT NULL;
CREATE INDEX controller_resources_spec_blob ON controller_resources(spec_hash) WHERE spec_hash IS NOT NULL;
CREATE INDEX controller_resources_status_blob ON controller_resources(status_hash) WHERE status_hash IS NOT NULL;
CREATE INDEX controller_effects_result_blob ON controller_effects(result_hash) WHERE result_hash IS NOT NULL;
CREATE INDEX controller_workflows_run ON controller_workflows(run_id);
CREATE INDEX host_commands_run ON host_commands(run_id) WHERE run_id IS NOT NULL;
"""

# Layout 14: the graph of the workflow a run executes (protocol WorkflowGraph, canonical
# JSON in ``blobs``), recorded when the run starts or adopts a changed workflow; NULL for a
# run made before layout 14 (``run.graph`` answers it as unknown). Its blob is a user for
# retention, found through the partial index. A fresh database adds it the same way.
GRAPH_SQL = """
ALTER TABLE runs ADD COLUMN graph_hash TEXT;
CREATE INDEX runs_graph_blob ON runs(graph_hash) WHERE graph_hash IS NOT NULL;
"""

# Layout 15: placement and named queues (store/sql/placement.py). A run has a queue (runs made
# before are on 'default'), and claims read the oldest ready run of a queue from
# run_queue_ready, now by queue first. A host records the queues it serves (host_queues) and,
# for a run it claimed and could not load, that it cannot (run_placement): its later claims
# pass the run over, and once every live host serving the run's queue has said so the run is
# held. A fresh database adds them the same way.
PLACEMENT_SQL = """
ALTER TABLE run_queue ADD COLUMN queue TEXT NOT NULL DEFAULT 'default';
DROP INDEX run_queue_ready;
CREATE INDEX run_queue_ready ON run_queue(queue, created_at, run_id)
  WHERE status IN ('queued', 'parked') AND hold IS NULL;
CREATE TABLE host_queues (
  host_id TEXT NOT NULL,
  queue TEXT NOT NULL,
  PRIMARY KEY (host_id, queue)
);
CREATE TABLE run_placement (
  run_id TEXT NOT NULL,
  host_id TEXT NOT NULL,
  reason TEXT NOT NULL,
  source_hash TEXT,
  at INTEGER NOT NULL,
  PRIMARY KEY (run_id, host_id)
);
CREATE INDEX run_placement_host ON run_placement(host_id);
"""

COUNTED_TRIGGERS = [f"{table}_counted_{event}" for table in ("runs", "run_queue")
                    for event in ("insert", "status", "moved", "delete")] + ["runs_counted_paused"]

# 6: the 'waiting' hold and attempt status (CHECK lists: run_queue and node_attempts are
# rebuilt; the run-count triggers, which name both tables, are dropped first and made again
# after), and the interaction tables.
REBUILD_FOR_WAITING_SQL = "".join(f"DROP TRIGGER {name};\n" for name in COUNTED_TRIGGERS) + """
ALTER TABLE run_queue RENAME TO run_queue_v5;
DROP INDEX run_queue_claimable;
DROP INDEX run_queue_ready;
DROP INDEX run_queue_session_reservation;
""" + RUN_QUEUE_V6_SQL + """
INSERT INTO run_queue SELECT * FROM run_queue_v5;
DROP TABLE run_queue_v5;
ALTER TABLE node_attempts RENAME TO node_attempts_v5;
DROP INDEX node_attempts_run;
DROP INDEX node_attempts_accepted;
""" + NODE_ATTEMPTS_V6_SQL + """
INSERT INTO node_attempts SELECT * FROM node_attempts_v5;
DROP TABLE node_attempts_v5;
""" + _count_triggers("runs") + _count_triggers("run_queue") + INTERACTIONS_SQL


# `run.list` pages read from an index in order, whatever the filter (store/sql/listing.py).
LISTING_LAYOUT = 12
LISTING_SQL = f"""
CREATE INDEX runs_listing ON runs(created_at, run_id);
CREATE INDEX runs_by_status ON runs(status, created_at, run_id);
CREATE INDEX runs_by_workflow ON runs(workflow, created_at, run_id);
CREATE INDEX runs_by_session ON runs(origin_session_id, created_at, run_id) WHERE origin_session_id IS NOT NULL;
CREATE INDEX run_queue_held ON run_queue(status, run_id) WHERE {HELD};
"""

SCHEMA_SQL = """
CREATE TABLE blobs (
  hash TEXT PRIMARY KEY,
  content BLOB NOT NULL,
  created_at INTEGER NOT NULL
);

CREATE TABLE host_lease (
  id INTEGER PRIMARY KEY CHECK (id = 1),
  epoch INTEGER NOT NULL,
  host_id TEXT,
  token_hash BLOB,
  pid INTEGER,
  process_start_identity TEXT,
  started_at INTEGER,
  heartbeat_at INTEGER,
  expires_at INTEGER
);
INSERT INTO host_lease (id, epoch) VALUES (1, 0);

CREATE TABLE host_commands (
  request_id TEXT PRIMARY KEY,
  client_id TEXT NOT NULL,
  idempotency_key TEXT NOT NULL,
  operation TEXT NOT NULL,
  request_fingerprint BLOB NOT NULL,
  run_id TEXT,
  outcome TEXT NOT NULL,
  revision INTEGER,
  receipt_json TEXT,
  receipt_hash TEXT,
  error TEXT,
  host_epoch INTEGER NOT NULL,
  created_at INTEGER NOT NULL,
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
  status TEXT NOT NULL CHECK (status IN
    ('queued', 'running', 'waiting', 'completed', 'failed', 'timed_out', 'cancelled')),
  paused INTEGER NOT NULL DEFAULT 0,
  status_detail TEXT,
  output_json TEXT,
  output_hash TEXT,
  error_json TEXT,
  revision INTEGER NOT NULL DEFAULT 1,
  origin_session_id TEXT,
  created_at INTEGER NOT NULL,
  updated_at INTEGER NOT NULL,
  finished_at INTEGER
);

""" + RUN_QUEUE_V6_SQL + """
""" + NODE_ATTEMPTS_V6_SQL + """
CREATE TABLE run_events (
  event_id INTEGER PRIMARY KEY AUTOINCREMENT,
  run_id TEXT NOT NULL,
  at INTEGER NOT NULL,
  type TEXT NOT NULL,
  payload_json TEXT NOT NULL
);
CREATE INDEX run_events_run ON run_events(run_id, event_id);

""" + RUN_WORKERS_SQL + """
CREATE TABLE worker_messages (
  worker_epoch TEXT NOT NULL,
  message_id TEXT NOT NULL,
  request_fingerprint BLOB NOT NULL,
  response_json TEXT NOT NULL,
  completed_at INTEGER NOT NULL,
  PRIMARY KEY (worker_epoch, message_id)
);
""" + EFFECTS_AND_PROCESSES_SQL + RUN_COUNTS_SQL + INTERACTIONS_SQL + CONTROLLERS_SQL + DELIVERY_SQL + SETTINGS_SQL \
    + NOT_BEFORE_SQL + EFFECT_IDENTITY_SQL + LISTING_SQL + RETENTION_SQL + GRAPH_SQL + PLACEMENT_SQL



# Tables every known layout has; a database missing one is incomplete, not old.
REQUIRED_TABLES = (
    "blobs", "host_lease", "host_commands", "runs", "run_queue",
    "node_attempts", "run_events", "run_workers", "worker_messages",
)

# MIGRATIONS[v] takes a database from layout v to v + 1, inside one write transaction.
MIGRATIONS = {
    # 2: effects, the child-process registry, the 'effect' hold (SQLite cannot alter a
    # CHECK constraint, so run_queue is rebuilt), indexes for claims and for a run's workers.
    1: """
CREATE INDEX run_workers_run ON run_workers(run_id, started_at);
ALTER TABLE runs ADD COLUMN start_node TEXT;
ALTER TABLE run_queue RENAME TO run_queue_v1;
DROP INDEX run_queue_claimable;
DROP INDEX run_queue_session_reservation;
""" + RUN_QUEUE_SQL + """
INSERT INTO run_queue SELECT * FROM run_queue_v1;
DROP TABLE run_queue_v1;
""" + EFFECTS_AND_PROCESSES_SQL,
    # 3: a worker stopped because its host stopped is 'stopped' (it was 'orphaned', which
    # now means only "found live by a later host"); rebuilt for the new CHECK list.
    2: """
ALTER TABLE run_workers RENAME TO run_workers_v2;
DROP INDEX run_workers_active;
DROP INDEX run_workers_run;
""" + RUN_WORKERS_SQL + """
INSERT INTO run_workers SELECT * FROM run_workers_v2;
DROP TABLE run_workers_v2;
""",
    # 4: maintained run counts (and their triggers), filled from the runs already stored.
    3: RUN_COUNTS_SQL,
    # 5: crashes in a row are counted in the run's queue row, so a run that keeps killing
    # what runs it is held however often the host restarts.
    4: CRASH_COUNT_SQL,
    5: REBUILD_FOR_WAITING_SQL,
    # 7: controllers: resources, their queue, events, effects and child runs.
    6: CONTROLLERS_SQL,
    # 8: notifications, turns, follow-ups and live updates (new tables only).
    7: DELIVERY_SQL,
    # 9: run settings: scopes, their changes, the change number each attempt started under;
    # and the index of a run's turns, for a layout-8 database made before layout 8 had it.
    8: "CREATE INDEX IF NOT EXISTS turns_run ON turns(run_id);\n" + SETTINGS_SQL,
    # 10: a crashed run's back-off (run_queue.not_before), durable.
    9: NOT_BEFORE_SQL,
    # 11: ambiguous effects found by partial indexes; a reconcile effect's kind and request fingerprint.
    10: EFFECT_IDENTITY_SQL,
    # 12: indexes for run listings by status, workflow, session, time and held
    # (runs_listing, on (created_at, run_id), takes the place of runs_created).
    LISTING_LAYOUT - 1: "DROP INDEX runs_created;\n" + LISTING_SQL,
    # 13: retention: the indexes that find ended runs, a child run's controller and logged commands, and a
    # blob's users.
    12: RETENTION_SQL,
    # 14: the run's workflow graph (runs.graph_hash).
    13: GRAPH_SQL,
    # 15: placement and named queues (run_queue.queue, host_queues, run_placement).
    14: PLACEMENT_SQL,
}
