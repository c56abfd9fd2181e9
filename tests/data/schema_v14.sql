-- piwf state layout 14, as created by piwf before named queues and placement (for the migration test):
-- layout 13 and run graphs

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


CREATE TABLE run_queue (
  run_id TEXT PRIMARY KEY REFERENCES runs(run_id),
  status TEXT NOT NULL CHECK (status IN
    ('queued', 'starting', 'running', 'parked', 'done', 'failed', 'cancelled')),
  hold TEXT CHECK (hold IN ('paused', 'source', 'crashed', 'effect', 'waiting')),
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
  finished_at INTEGER,
  crash_count INTEGER NOT NULL DEFAULT 0
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
  status TEXT NOT NULL CHECK (status IN ('running', 'waiting', 'accepted', 'failed', 'interrupted')),
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
  status TEXT NOT NULL CHECK (status IN ('starting', 'running', 'exited', 'crashed', 'timedOut', 'cancelled', 'claimLost', 'stopped', 'orphaned', 'notStarted')),
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

CREATE TABLE run_counts (
  scope TEXT NOT NULL,
  value TEXT NOT NULL,
  n INTEGER NOT NULL,
  PRIMARY KEY (scope, value)
) WITHOUT ROWID;
INSERT INTO run_counts (scope, value, n) VALUES
  ('runs.status', 'queued', 0), ('runs.status', 'running', 0), ('runs.status', 'waiting', 0), ('runs.status', 'completed', 0), ('runs.status', 'failed', 0), ('runs.status', 'timed_out', 0), ('runs.status', 'cancelled', 0),
  ('run_queue.status', 'queued', 0), ('run_queue.status', 'starting', 0), ('run_queue.status', 'running', 0), ('run_queue.status', 'parked', 0), ('run_queue.status', 'done', 0), ('run_queue.status', 'failed', 0), ('run_queue.status', 'cancelled', 0),
  ('runs.paused', 'paused', 0), ('lifecycle', 'contradictions', 0);
UPDATE run_counts SET n = (SELECT COUNT(*) FROM runs WHERE status = run_counts.value) WHERE scope = 'runs.status';
UPDATE run_counts SET n = (SELECT COUNT(*) FROM run_queue WHERE status = run_counts.value)
  WHERE scope = 'run_queue.status';
UPDATE run_counts SET n = (SELECT COUNT(*) FROM runs WHERE paused != 0) WHERE scope = 'runs.paused';
UPDATE run_counts SET n = (SELECT COUNT(*) FROM runs r JOIN run_queue q ON q.run_id = r.run_id
  WHERE (NOT CASE r.status WHEN 'queued' THEN q.status = 'queued'
  WHEN 'running' THEN q.status = 'starting' OR q.status = 'running' OR q.status = 'parked'
  WHEN 'waiting' THEN q.status = 'parked' WHEN 'completed' THEN q.status = 'done'
  WHEN 'failed' THEN q.status = 'failed' WHEN 'timed_out' THEN q.status = 'failed'
  WHEN 'cancelled' THEN q.status = 'cancelled' ELSE 0 END)) WHERE scope = 'lifecycle';
CREATE TRIGGER runs_counted_insert AFTER INSERT ON runs BEGIN
UPDATE run_counts SET n = n + (1) WHERE scope = 'runs.status' AND value = NEW.status;
UPDATE run_counts SET n = n + (1) WHERE scope = 'runs.paused' AND NEW.paused != 0;
UPDATE run_counts SET n = n + (COALESCE((SELECT + (NOT CASE NEW.status WHEN 'queued' THEN q.status = 'queued'
  WHEN 'running' THEN q.status = 'starting' OR q.status = 'running' OR q.status = 'parked'
  WHEN 'waiting' THEN q.status = 'parked' WHEN 'completed' THEN q.status = 'done'
  WHEN 'failed' THEN q.status = 'failed' WHEN 'timed_out' THEN q.status = 'failed'
  WHEN 'cancelled' THEN q.status = 'cancelled' ELSE 0 END) FROM run_queue q WHERE q.run_id = NEW.run_id), 0)) WHERE scope = 'lifecycle';
END;
CREATE TRIGGER runs_counted_status AFTER UPDATE OF status ON runs WHEN OLD.status IS NOT NEW.status AND OLD.run_id IS NEW.run_id BEGIN
UPDATE run_counts SET n = n + (-1) WHERE scope = 'runs.status' AND value = OLD.status;
UPDATE run_counts SET n = n + (1) WHERE scope = 'runs.status' AND value = NEW.status;
UPDATE run_counts SET n = n + (COALESCE((SELECT + (NOT CASE NEW.status WHEN 'queued' THEN q.status = 'queued'
  WHEN 'running' THEN q.status = 'starting' OR q.status = 'running' OR q.status = 'parked'
  WHEN 'waiting' THEN q.status = 'parked' WHEN 'completed' THEN q.status = 'done'
  WHEN 'failed' THEN q.status = 'failed' WHEN 'timed_out' THEN q.status = 'failed'
  WHEN 'cancelled' THEN q.status = 'cancelled' ELSE 0 END) - (NOT CASE OLD.status WHEN 'queued' THEN q.status = 'queued'
  WHEN 'running' THEN q.status = 'starting' OR q.status = 'running' OR q.status = 'parked'
  WHEN 'waiting' THEN q.status = 'parked' WHEN 'completed' THEN q.status = 'done'
  WHEN 'failed' THEN q.status = 'failed' WHEN 'timed_out' THEN q.status = 'failed'
  WHEN 'cancelled' THEN q.status = 'cancelled' ELSE 0 END) FROM run_queue q WHERE q.run_id = NEW.run_id), 0)) WHERE scope = 'lifecycle';
END;
CREATE TRIGGER runs_counted_moved AFTER UPDATE OF run_id ON runs WHEN OLD.run_id IS NOT NEW.run_id BEGIN
UPDATE run_counts SET n = n + (-1) WHERE scope = 'runs.status' AND value = OLD.status;
UPDATE run_counts SET n = n + (1) WHERE scope = 'runs.status' AND value = NEW.status;
UPDATE run_counts SET n = n + (COALESCE((SELECT - (NOT CASE OLD.status WHEN 'queued' THEN q.status = 'queued'
  WHEN 'running' THEN q.status = 'starting' OR q.status = 'running' OR q.status = 'parked'
  WHEN 'waiting' THEN q.status = 'parked' WHEN 'completed' THEN q.status = 'done'
  WHEN 'failed' THEN q.status = 'failed' WHEN 'timed_out' THEN q.status = 'failed'
  WHEN 'cancelled' THEN q.status = 'cancelled' ELSE 0 END) FROM run_queue q WHERE q.run_id = OLD.run_id), 0)) WHERE scope = 'lifecycle';
UPDATE run_counts SET n = n + (COALESCE((SELECT + (NOT CASE NEW.status WHEN 'queued' THEN q.status = 'queued'
  WHEN 'running' THEN q.status = 'starting' OR q.status = 'running' OR q.status = 'parked'
  WHEN 'waiting' THEN q.status = 'parked' WHEN 'completed' THEN q.status = 'done'
  WHEN 'failed' THEN q.status = 'failed' WHEN 'timed_out' THEN q.status = 'failed'
  WHEN 'cancelled' THEN q.status = 'cancelled' ELSE 0 END) FROM run_queue q WHERE q.run_id = NEW.run_id), 0)) WHERE scope = 'lifecycle';
END;
CREATE TRIGGER runs_counted_delete AFTER DELETE ON runs BEGIN
UPDATE run_counts SET n = n + (-1) WHERE scope = 'runs.status' AND value = OLD.status;
UPDATE run_counts SET n = n + (-1) WHERE scope = 'runs.paused' AND OLD.paused != 0;
UPDATE run_counts SET n = n + (COALESCE((SELECT - (NOT CASE OLD.status WHEN 'queued' THEN q.status = 'queued'
  WHEN 'running' THEN q.status = 'starting' OR q.status = 'running' OR q.status = 'parked'
  WHEN 'waiting' THEN q.status = 'parked' WHEN 'completed' THEN q.status = 'done'
  WHEN 'failed' THEN q.status = 'failed' WHEN 'timed_out' THEN q.status = 'failed'
  WHEN 'cancelled' THEN q.status = 'cancelled' ELSE 0 END) FROM run_queue q WHERE q.run_id = OLD.run_id), 0)) WHERE scope = 'lifecycle';
END;
CREATE TRIGGER runs_counted_paused AFTER UPDATE OF paused ON runs WHEN (OLD.paused != 0) IS NOT (NEW.paused != 0) BEGIN
UPDATE run_counts SET n = n + ((NEW.paused != 0) - (OLD.paused != 0)) WHERE scope = 'runs.paused';
END;
CREATE TRIGGER run_queue_counted_insert AFTER INSERT ON run_queue BEGIN
UPDATE run_counts SET n = n + (1) WHERE scope = 'run_queue.status' AND value = NEW.status;
UPDATE run_counts SET n = n + (COALESCE((SELECT + (NOT CASE r.status WHEN 'queued' THEN NEW.status = 'queued'
  WHEN 'running' THEN NEW.status = 'starting' OR NEW.status = 'running' OR NEW.status = 'parked'
  WHEN 'waiting' THEN NEW.status = 'parked' WHEN 'completed' THEN NEW.status = 'done'
  WHEN 'failed' THEN NEW.status = 'failed' WHEN 'timed_out' THEN NEW.status = 'failed'
  WHEN 'cancelled' THEN NEW.status = 'cancelled' ELSE 0 END) FROM runs r WHERE r.run_id = NEW.run_id), 0)) WHERE scope = 'lifecycle';
END;
CREATE TRIGGER run_queue_counted_status AFTER UPDATE OF status ON run_queue WHEN OLD.status IS NOT NEW.status AND OLD.run_id IS NEW.run_id BEGIN
UPDATE run_counts SET n = n + (-1) WHERE scope = 'run_queue.status' AND value = OLD.status;
UPDATE run_counts SET n = n + (1) WHERE scope = 'run_queue.status' AND value = NEW.status;
UPDATE run_counts SET n = n + (COALESCE((SELECT + (NOT CASE r.status WHEN 'queued' THEN NEW.status = 'queued'
  WHEN 'running' THEN NEW.status = 'starting' OR NEW.status = 'running' OR NEW.status = 'parked'
  WHEN 'waiting' THEN NEW.status = 'parked' WHEN 'completed' THEN NEW.status = 'done'
  WHEN 'failed' THEN NEW.status = 'failed' WHEN 'timed_out' THEN NEW.status = 'failed'
  WHEN 'cancelled' THEN NEW.status = 'cancelled' ELSE 0 END) - (NOT CASE r.status WHEN 'queued' THEN OLD.status = 'queued'
  WHEN 'running' THEN OLD.status = 'starting' OR OLD.status = 'running' OR OLD.status = 'parked'
  WHEN 'waiting' THEN OLD.status = 'parked' WHEN 'completed' THEN OLD.status = 'done'
  WHEN 'failed' THEN OLD.status = 'failed' WHEN 'timed_out' THEN OLD.status = 'failed'
  WHEN 'cancelled' THEN OLD.status = 'cancelled' ELSE 0 END) FROM runs r WHERE r.run_id = NEW.run_id), 0)) WHERE scope = 'lifecycle';
END;
CREATE TRIGGER run_queue_counted_moved AFTER UPDATE OF run_id ON run_queue WHEN OLD.run_id IS NOT NEW.run_id BEGIN
UPDATE run_counts SET n = n + (-1) WHERE scope = 'run_queue.status' AND value = OLD.status;
UPDATE run_counts SET n = n + (1) WHERE scope = 'run_queue.status' AND value = NEW.status;
UPDATE run_counts SET n = n + (COALESCE((SELECT - (NOT CASE r.status WHEN 'queued' THEN OLD.status = 'queued'
  WHEN 'running' THEN OLD.status = 'starting' OR OLD.status = 'running' OR OLD.status = 'parked'
  WHEN 'waiting' THEN OLD.status = 'parked' WHEN 'completed' THEN OLD.status = 'done'
  WHEN 'failed' THEN OLD.status = 'failed' WHEN 'timed_out' THEN OLD.status = 'failed'
  WHEN 'cancelled' THEN OLD.status = 'cancelled' ELSE 0 END) FROM runs r WHERE r.run_id = OLD.run_id), 0)) WHERE scope = 'lifecycle';
UPDATE run_counts SET n = n + (COALESCE((SELECT + (NOT CASE r.status WHEN 'queued' THEN NEW.status = 'queued'
  WHEN 'running' THEN NEW.status = 'starting' OR NEW.status = 'running' OR NEW.status = 'parked'
  WHEN 'waiting' THEN NEW.status = 'parked' WHEN 'completed' THEN NEW.status = 'done'
  WHEN 'failed' THEN NEW.status = 'failed' WHEN 'timed_out' THEN NEW.status = 'failed'
  WHEN 'cancelled' THEN NEW.status = 'cancelled' ELSE 0 END) FROM runs r WHERE r.run_id = NEW.run_id), 0)) WHERE scope = 'lifecycle';
END;
CREATE TRIGGER run_queue_counted_delete AFTER DELETE ON run_queue BEGIN
UPDATE run_counts SET n = n + (-1) WHERE scope = 'run_queue.status' AND value = OLD.status;
UPDATE run_counts SET n = n + (COALESCE((SELECT - (NOT CASE r.status WHEN 'queued' THEN OLD.status = 'queued'
  WHEN 'running' THEN OLD.status = 'starting' OR OLD.status = 'running' OR OLD.status = 'parked'
  WHEN 'waiting' THEN OLD.status = 'parked' WHEN 'completed' THEN OLD.status = 'done'
  WHEN 'failed' THEN OLD.status = 'failed' WHEN 'timed_out' THEN OLD.status = 'failed'
  WHEN 'cancelled' THEN OLD.status = 'cancelled' ELSE 0 END) FROM runs r WHERE r.run_id = OLD.run_id), 0)) WHERE scope = 'lifecycle';
END;

CREATE TABLE interaction_requests (
  request_id TEXT PRIMARY KEY,
  run_id TEXT NOT NULL REFERENCES runs(run_id),
  attempt_id TEXT NOT NULL UNIQUE,
  seq INTEGER NOT NULL,
  node_id TEXT NOT NULL,
  kind TEXT NOT NULL CHECK (kind IN ('decision', 'ask')),
  workflow TEXT NOT NULL,
  origin_session_id TEXT,
  spec_json TEXT NOT NULL,
  deadline_at INTEGER,
  status TEXT NOT NULL CHECK (status IN ('pending', 'presenting', 'settled', 'expired', 'cancelled')),
  revision INTEGER NOT NULL DEFAULT 1,
  presenter TEXT,
  presenter_expires_at INTEGER,
  entry_id TEXT,
  progress TEXT,
  resolution_json TEXT,
  created_at INTEGER NOT NULL,
  updated_at INTEGER NOT NULL,
  closed_at INTEGER
);
CREATE INDEX interaction_requests_open ON interaction_requests(deadline_at)
  WHERE status IN ('pending', 'presenting');
CREATE INDEX interaction_requests_run ON interaction_requests(run_id);
CREATE INDEX interaction_requests_session ON interaction_requests(origin_session_id, status);

CREATE TABLE interaction_submissions (
  submission_id TEXT PRIMARY KEY,
  request_id TEXT NOT NULL REFERENCES interaction_requests(request_id),
  status TEXT NOT NULL CHECK (status IN ('validating', 'accepted', 'rejected')),
  value_json TEXT NOT NULL,
  submitted_by TEXT NOT NULL,
  session_id TEXT,
  error TEXT,
  created_at INTEGER NOT NULL,
  settled_at INTEGER
);
CREATE INDEX interaction_submissions_request ON interaction_submissions(request_id, created_at);
CREATE UNIQUE INDEX interaction_submissions_validating ON interaction_submissions(request_id)
  WHERE status = 'validating';

CREATE TABLE controller_resources (
  uid TEXT PRIMARY KEY,
  project_path TEXT NOT NULL,
  controller TEXT NOT NULL,
  resource_key TEXT NOT NULL,
  resource_version INTEGER NOT NULL,
  generation INTEGER NOT NULL,
  spec_json TEXT,
  spec_hash TEXT,
  spec_digest TEXT NOT NULL,
  status_json TEXT,
  status_hash TEXT,
  finalizers_json TEXT NOT NULL DEFAULT '[]',
  deletion_requested_at INTEGER,
  created_at INTEGER NOT NULL,
  updated_at INTEGER NOT NULL,
  UNIQUE (project_path, controller, resource_key)
);

CREATE TABLE controller_queue (
  uid TEXT PRIMARY KEY REFERENCES controller_resources(uid) ON DELETE CASCADE,
  available_at INTEGER,
  version INTEGER NOT NULL DEFAULT 0,
  hold TEXT CHECK (hold IN ('permanent', 'effect')),
  claim_token TEXT,
  claim_expires_at INTEGER,
  claim_version INTEGER,
  claim_resource_version INTEGER,
  claim_generation INTEGER NOT NULL DEFAULT 0,
  claim_epoch INTEGER,
  worker_pid INTEGER,
  worker_identity TEXT,
  consecutive_errors INTEGER NOT NULL DEFAULT 0,
  last_error TEXT,
  updated_at INTEGER NOT NULL
);
CREATE INDEX controller_queue_due ON controller_queue(available_at) WHERE available_at IS NOT NULL AND hold IS NULL;

CREATE TABLE controller_events (
  event_id INTEGER PRIMARY KEY AUTOINCREMENT,
  uid TEXT NOT NULL,
  at INTEGER NOT NULL,
  type TEXT NOT NULL,
  payload_json TEXT NOT NULL
);
CREATE INDEX controller_events_uid ON controller_events(uid, event_id);

CREATE TABLE controller_effects (
  uid TEXT NOT NULL REFERENCES controller_resources(uid) ON DELETE CASCADE,
  spec_generation INTEGER NOT NULL,
  effect_key TEXT NOT NULL,
  status TEXT NOT NULL CHECK (status IN ('pending', 'applying', 'applied', 'rejected', 'ambiguous')),
  generation INTEGER NOT NULL,
  result_json TEXT,
  result_hash TEXT,
  error_json TEXT,
  created_at INTEGER NOT NULL,
  updated_at INTEGER NOT NULL,
  settled_at INTEGER,
  PRIMARY KEY (uid, spec_generation, effect_key)
);

CREATE TABLE controller_workflows (
  uid TEXT NOT NULL REFERENCES controller_resources(uid) ON DELETE CASCADE,
  request_key TEXT NOT NULL,
  input_hash TEXT NOT NULL,
  workflow TEXT NOT NULL,
  run_id TEXT NOT NULL REFERENCES runs(run_id),
  state TEXT NOT NULL CHECK (state IN ('running', 'waiting', 'succeeded', 'failed')),
  attempt INTEGER NOT NULL DEFAULT 1,
  created_at INTEGER NOT NULL,
  updated_at INTEGER NOT NULL,
  PRIMARY KEY (uid, request_key)
);
CREATE INDEX controller_workflows_live ON controller_workflows(state) WHERE state IN ('running', 'waiting');

CREATE TABLE notifications (
  notification_id TEXT PRIMARY KEY,
  run_id TEXT NOT NULL REFERENCES runs(run_id),
  seq INTEGER NOT NULL,
  node_id TEXT NOT NULL,
  notification_index INTEGER NOT NULL CHECK (notification_index > 0),
  session_id TEXT NOT NULL,
  kind TEXT NOT NULL CHECK (kind IN ('progress', 'final')),
  content TEXT NOT NULL,
  created_at INTEGER NOT NULL,
  claim_token TEXT,
  claim_client TEXT,
  claim_expires_at INTEGER,
  delivered_at INTEGER,
  UNIQUE (run_id, seq, notification_index)
);
-- Delivered in the order stored (rowid): the index keeps a session's undelivered ones in it.
CREATE INDEX notifications_undelivered ON notifications(session_id) WHERE delivered_at IS NULL;

CREATE TABLE turns (
  turn_id TEXT PRIMARY KEY,
  run_id TEXT NOT NULL REFERENCES runs(run_id),
  session_id TEXT NOT NULL,
  workflow TEXT NOT NULL,
  cause TEXT NOT NULL CHECK (cause IN ('requested', 'completed', 'failed', 'timed_out', 'cancelled', 'held')),
  facts_json TEXT NOT NULL,
  instructions TEXT,
  eligible_at INTEGER,
  created_at INTEGER NOT NULL,
  updated_at INTEGER NOT NULL,
  claim_token TEXT,
  claim_client TEXT,
  claim_expires_at INTEGER,
  followups_through INTEGER,
  resolution TEXT CHECK (resolution IN ('presented', 'prompted', 'dismissed')),
  resolved_at INTEGER
);
CREATE UNIQUE INDEX turns_unresolved ON turns(run_id, session_id) WHERE resolved_at IS NULL;
CREATE INDEX turns_eligible ON turns(session_id, eligible_at) WHERE resolved_at IS NULL;
-- A run's turns, resolved or not: each end of a run with a session reads them (turn_for_run).
CREATE INDEX turns_run ON turns(run_id);

CREATE TABLE followups (
  followup_id TEXT PRIMARY KEY,
  run_id TEXT NOT NULL REFERENCES runs(run_id),
  request_key TEXT NOT NULL,
  prompt TEXT NOT NULL,
  position INTEGER NOT NULL,
  state TEXT NOT NULL CHECK (state IN ('queued', 'delivered', 'removed')),
  turn_id TEXT,
  created_at INTEGER NOT NULL,
  updated_at INTEGER NOT NULL,
  UNIQUE (run_id, request_key),
  UNIQUE (run_id, position)
);

CREATE TABLE run_updates (
  run_id TEXT NOT NULL REFERENCES runs(run_id),
  type TEXT NOT NULL,
  key TEXT NOT NULL,
  data_json TEXT NOT NULL,
  seq INTEGER NOT NULL,
  updated_at INTEGER NOT NULL,
  PRIMARY KEY (run_id, type, key)
);
CREATE INDEX run_updates_seq ON run_updates(seq);

CREATE TABLE settings_scopes (
  scope_id TEXT PRIMARY KEY,
  run_id TEXT NOT NULL REFERENCES runs(run_id),
  mount_path TEXT NOT NULL DEFAULT '',
  settings_json TEXT NOT NULL,
  change_number INTEGER NOT NULL DEFAULT 0 CHECK (change_number >= 0),
  mutable_json TEXT NOT NULL DEFAULT '[]',
  created_at INTEGER NOT NULL,
  updated_at INTEGER NOT NULL,
  UNIQUE (run_id, mount_path)
);
CREATE TABLE settings_changes (
  scope_id TEXT NOT NULL REFERENCES settings_scopes(scope_id),
  change_number INTEGER NOT NULL,
  request_key TEXT,
  actor_type TEXT NOT NULL CHECK (actor_type IN ('start', 'client', 'controller')),
  actor_id TEXT,
  patch_json TEXT NOT NULL,
  settings_json TEXT NOT NULL,
  created_at INTEGER NOT NULL,
  PRIMARY KEY (scope_id, change_number),
  UNIQUE (scope_id, request_key)
);
ALTER TABLE node_attempts ADD COLUMN settings_change INTEGER;

ALTER TABLE run_queue ADD COLUMN not_before INTEGER;

CREATE INDEX effects_ambiguous ON effects(run_id) WHERE status = 'ambiguous';
CREATE INDEX controller_effects_ambiguous ON controller_effects(uid) WHERE status = 'ambiguous';
ALTER TABLE controller_effects ADD COLUMN kind TEXT;
ALTER TABLE controller_effects ADD COLUMN request_fingerprint TEXT;

CREATE INDEX runs_listing ON runs(created_at, run_id);
CREATE INDEX runs_by_status ON runs(status, created_at, run_id);
CREATE INDEX runs_by_workflow ON runs(workflow, created_at, run_id);
CREATE INDEX runs_by_session ON runs(origin_session_id, created_at, run_id) WHERE origin_session_id IS NOT NULL;
CREATE INDEX run_queue_held ON run_queue(status, run_id) WHERE hold IN ('crashed', 'effect', 'source');

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

ALTER TABLE runs ADD COLUMN graph_hash TEXT;
CREATE INDEX runs_graph_blob ON runs(graph_hash) WHERE graph_hash IS NOT NULL;
