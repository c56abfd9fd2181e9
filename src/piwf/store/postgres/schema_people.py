"""The PostgreSQL tables of people and agents in the loop (interactions, delivery, updates,
settings) and of controllers: the same names, columns and meaning as SQLite's layout 10
(``piwf.store.sqlite.schema_features``), in PostgreSQL's types (``schema.py`` says which).

``rowid``: the tables whose rows the shared SQL orders by SQLite's rowid (the order they
were stored in) have a column of that name here, filled from an identity.
"""

PEOPLE_SQL = """
CREATE TABLE interaction_requests (
  request_id TEXT PRIMARY KEY,
  run_id TEXT NOT NULL REFERENCES runs(run_id),
  attempt_id TEXT NOT NULL UNIQUE,
  seq BIGINT NOT NULL,
  node_id TEXT NOT NULL,
  kind TEXT NOT NULL CHECK (kind IN ('decision', 'ask')),
  workflow TEXT NOT NULL,
  origin_session_id TEXT,
  spec_json TEXT NOT NULL,
  deadline_at BIGINT,
  status TEXT NOT NULL CHECK (status IN ('pending', 'presenting', 'settled', 'expired', 'cancelled')),
  revision BIGINT NOT NULL DEFAULT 1,
  presenter TEXT,
  presenter_expires_at BIGINT,
  entry_id TEXT,
  progress TEXT,
  resolution_json TEXT,
  created_at BIGINT NOT NULL,
  updated_at BIGINT NOT NULL,
  closed_at BIGINT
);
CREATE INDEX interaction_requests_open ON interaction_requests(deadline_at)
  WHERE status IN ('pending', 'presenting');
CREATE INDEX interaction_requests_run ON interaction_requests(run_id);
CREATE INDEX interaction_requests_session ON interaction_requests(origin_session_id, status);

CREATE TABLE interaction_submissions (
  rowid BIGINT GENERATED ALWAYS AS IDENTITY,
  submission_id TEXT PRIMARY KEY,
  request_id TEXT NOT NULL REFERENCES interaction_requests(request_id),
  status TEXT NOT NULL CHECK (status IN ('validating', 'accepted', 'rejected')),
  value_json TEXT NOT NULL,
  submitted_by TEXT NOT NULL,
  session_id TEXT,
  error TEXT,
  created_at BIGINT NOT NULL,
  settled_at BIGINT
);
CREATE INDEX interaction_submissions_request ON interaction_submissions(request_id, created_at);
CREATE UNIQUE INDEX interaction_submissions_validating ON interaction_submissions(request_id)
  WHERE status = 'validating';

CREATE TABLE notifications (
  rowid BIGINT GENERATED ALWAYS AS IDENTITY,
  notification_id TEXT PRIMARY KEY,
  run_id TEXT NOT NULL REFERENCES runs(run_id),
  seq BIGINT NOT NULL,
  node_id TEXT NOT NULL,
  notification_index BIGINT NOT NULL CHECK (notification_index > 0),
  session_id TEXT NOT NULL,
  kind TEXT NOT NULL CHECK (kind IN ('progress', 'final')),
  content TEXT NOT NULL,
  created_at BIGINT NOT NULL,
  claim_token TEXT,
  claim_client TEXT,
  claim_expires_at BIGINT,
  delivered_at BIGINT,
  UNIQUE (run_id, seq, notification_index)
);
-- Delivered in the order stored (rowid): the index keeps a session's undelivered ones in it.
CREATE INDEX notifications_undelivered ON notifications(session_id) WHERE delivered_at IS NULL;

CREATE TABLE turns (
  rowid BIGINT GENERATED ALWAYS AS IDENTITY,
  turn_id TEXT PRIMARY KEY,
  run_id TEXT NOT NULL REFERENCES runs(run_id),
  session_id TEXT NOT NULL,
  workflow TEXT NOT NULL,
  cause TEXT NOT NULL CHECK (cause IN ('requested', 'completed', 'failed', 'timed_out', 'cancelled', 'held')),
  facts_json TEXT NOT NULL,
  instructions TEXT,
  eligible_at BIGINT,
  created_at BIGINT NOT NULL,
  updated_at BIGINT NOT NULL,
  claim_token TEXT,
  claim_client TEXT,
  claim_expires_at BIGINT,
  followups_through BIGINT,
  resolution TEXT CHECK (resolution IN ('presented', 'prompted', 'dismissed')),
  resolved_at BIGINT
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
  position BIGINT NOT NULL,
  state TEXT NOT NULL CHECK (state IN ('queued', 'delivered', 'removed')),
  turn_id TEXT,
  created_at BIGINT NOT NULL,
  updated_at BIGINT NOT NULL,
  UNIQUE (run_id, request_key),
  UNIQUE (run_id, position)
);

CREATE TABLE run_updates (
  run_id TEXT NOT NULL REFERENCES runs(run_id),
  type TEXT NOT NULL,
  key TEXT NOT NULL,
  data_json TEXT NOT NULL,
  seq BIGINT NOT NULL,
  updated_at BIGINT NOT NULL,
  PRIMARY KEY (run_id, type, key)
);
CREATE INDEX run_updates_seq ON run_updates(seq);

CREATE TABLE settings_scopes (
  scope_id TEXT PRIMARY KEY,
  run_id TEXT NOT NULL REFERENCES runs(run_id),
  mount_path TEXT NOT NULL DEFAULT '',
  settings_json TEXT NOT NULL,
  change_number BIGINT NOT NULL DEFAULT 0 CHECK (change_number >= 0),
  mutable_json TEXT NOT NULL DEFAULT '[]',
  created_at BIGINT NOT NULL,
  updated_at BIGINT NOT NULL,
  UNIQUE (run_id, mount_path)
);
CREATE TABLE settings_changes (
  scope_id TEXT NOT NULL REFERENCES settings_scopes(scope_id),
  change_number BIGINT NOT NULL,
  request_key TEXT,
  actor_type TEXT NOT NULL CHECK (actor_type IN ('start', 'client', 'controller')),
  actor_id TEXT,
  patch_json TEXT NOT NULL,
  settings_json TEXT NOT NULL,
  created_at BIGINT NOT NULL,
  PRIMARY KEY (scope_id, change_number),
  UNIQUE (scope_id, request_key)
);
"""

CONTROLLERS_SQL = """
CREATE TABLE controller_resources (
  uid TEXT PRIMARY KEY,
  project_path TEXT NOT NULL,
  controller TEXT NOT NULL,
  resource_key TEXT NOT NULL,
  resource_version BIGINT NOT NULL,
  generation BIGINT NOT NULL,
  spec_json TEXT,
  spec_hash TEXT,
  spec_digest TEXT NOT NULL,
  status_json TEXT,
  status_hash TEXT,
  finalizers_json TEXT NOT NULL DEFAULT '[]',
  deletion_requested_at BIGINT,
  created_at BIGINT NOT NULL,
  updated_at BIGINT NOT NULL,
  UNIQUE (project_path, controller, resource_key)
);

CREATE TABLE controller_queue (
  uid TEXT PRIMARY KEY REFERENCES controller_resources(uid) ON DELETE CASCADE,
  available_at BIGINT,
  version BIGINT NOT NULL DEFAULT 0,
  hold TEXT CHECK (hold IN ('permanent', 'effect')),
  claim_token TEXT,
  claim_expires_at BIGINT,
  claim_version BIGINT,
  claim_resource_version BIGINT,
  claim_generation BIGINT NOT NULL DEFAULT 0,
  claim_epoch BIGINT,
  worker_pid BIGINT,
  worker_identity TEXT,
  consecutive_errors BIGINT NOT NULL DEFAULT 0,
  last_error TEXT,
  updated_at BIGINT NOT NULL
);
CREATE INDEX controller_queue_due ON controller_queue(available_at) WHERE available_at IS NOT NULL AND hold IS NULL;

CREATE TABLE controller_events (
  event_id BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
  uid TEXT NOT NULL,
  at BIGINT NOT NULL,
  type TEXT NOT NULL,
  payload_json TEXT NOT NULL
);
CREATE INDEX controller_events_uid ON controller_events(uid, event_id);

CREATE TABLE controller_effects (
  uid TEXT NOT NULL REFERENCES controller_resources(uid) ON DELETE CASCADE,
  spec_generation BIGINT NOT NULL,
  effect_key TEXT NOT NULL,
  status TEXT NOT NULL CHECK (status IN ('pending', 'applying', 'applied', 'rejected', 'ambiguous')),
  generation BIGINT NOT NULL,
  result_json TEXT,
  result_hash TEXT,
  error_json TEXT,
  created_at BIGINT NOT NULL,
  updated_at BIGINT NOT NULL,
  settled_at BIGINT,
  PRIMARY KEY (uid, spec_generation, effect_key)
);

CREATE TABLE controller_workflows (
  uid TEXT NOT NULL REFERENCES controller_resources(uid) ON DELETE CASCADE,
  request_key TEXT NOT NULL,
  input_hash TEXT NOT NULL,
  workflow TEXT NOT NULL,
  run_id TEXT NOT NULL REFERENCES runs(run_id),
  state TEXT NOT NULL CHECK (state IN ('running', 'waiting', 'succeeded', 'failed')),
  attempt BIGINT NOT NULL DEFAULT 1,
  created_at BIGINT NOT NULL,
  updated_at BIGINT NOT NULL,
  PRIMARY KEY (uid, request_key)
);
CREATE INDEX controller_workflows_live ON controller_workflows(state) WHERE state IN ('running', 'waiting');
"""
