-- The full layout 3 (piwf before run_counts), for migration tests.
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
CREATE INDEX runs_created ON runs(created_at);


CREATE TABLE run_queue (
  run_id TEXT PRIMARY KEY REFERENCES runs(run_id),
  status TEXT NOT NULL CHECK (status IN
    ('queued', 'starting', 'running', 'parked', 'done', 'failed', 'cancelled')),
  hold TEXT CHECK (hold IN ('paused', 'source', 'crashed', 'effect')),
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
  finished_at INTEGER
);
CREATE INDEX run_queue_claimable ON run_queue(status, claim_expires_at);
-- Claims take the oldest ready run: this index hands it over without sorting the queue.
CREATE INDEX run_queue_ready ON run_queue(created_at, run_id)
  WHERE status IN ('queued', 'parked') AND hold IS NULL;
-- One active run per origin session; detached runs (no session) are exempt.
CREATE UNIQUE INDEX run_queue_session_reservation ON run_queue(origin_session_id)
  WHERE origin_session_id IS NOT NULL AND status IN ('queued', 'starting', 'running');

CREATE TABLE node_attempts (
  attempt_id TEXT PRIMARY KEY,
  run_id TEXT NOT NULL REFERENCES runs(run_id),
  seq INTEGER NOT NULL,
  node_id TEXT NOT NULL,
  generation INTEGER NOT NULL,
  status TEXT NOT NULL CHECK (status IN ('running', 'accepted', 'failed', 'interrupted')),
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

CREATE TABLE run_events (
  event_id INTEGER PRIMARY KEY AUTOINCREMENT,
  run_id TEXT NOT NULL,
  at INTEGER NOT NULL,
  type TEXT NOT NULL,
  payload_json TEXT NOT NULL
);
CREATE INDEX run_events_run ON run_events(run_id, event_id);


CREATE TABLE run_workers (
  worker_epoch TEXT PRIMARY KEY,
  run_id TEXT NOT NULL,
  generation INTEGER NOT NULL,
  host_epoch INTEGER NOT NULL,
  pid INTEGER,
  process_start_identity TEXT,
  status TEXT NOT NULL CHECK (status IN ('starting', 'running', 'exited', 'crashed', 'timedOut', 'cancelled', 'claimLost', 'stopped', 'orphaned')),
  started_at INTEGER NOT NULL,
  ready_at INTEGER,
  finished_at INTEGER,
  exit_code INTEGER,
  signal INTEGER,
  diagnostic TEXT
);
CREATE INDEX run_workers_active ON run_workers(status, host_epoch);
CREATE INDEX run_workers_run ON run_workers(run_id, started_at);

CREATE TABLE worker_messages (
  worker_epoch TEXT NOT NULL,
  message_id TEXT NOT NULL,
  request_fingerprint BLOB NOT NULL,
  response_json TEXT NOT NULL,
  completed_at INTEGER NOT NULL,
  PRIMARY KEY (worker_epoch, message_id)
);

CREATE TABLE effects (
  run_id TEXT NOT NULL REFERENCES runs(run_id),
  effect_key TEXT NOT NULL,
  status TEXT NOT NULL CHECK (status IN ('pending', 'applying', 'applied', 'rejected', 'ambiguous')),
  node_id TEXT NOT NULL,
  generation INTEGER NOT NULL,
  result_json TEXT,
  result_hash TEXT,
  error_json TEXT,
  created_at INTEGER NOT NULL,
  updated_at INTEGER NOT NULL,
  settled_at INTEGER,
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
