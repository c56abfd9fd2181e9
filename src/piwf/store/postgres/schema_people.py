"""PostgreSQL's tables of the people and controller aggregates: the same names, columns
and meaning as SQLite's (``piwf.store.sqlite.schema_features``, layout 10), in
PostgreSQL's types (times in ms and counters are BIGINT).

Two differences, both so that the shared SQL of ``piwf.store.sql`` runs unchanged:

- ``rowid``: SQLite's implicit row number orders a session's notifications and turns and a
  request's submissions; here those tables have a column of that name, an identity. The
  order it gives is the order rows committed in because every insert into a session's
  stream holds the session's delivery lock (``piwf.store.sql.locks.lock_delivery``).
- ``controller_events.event_id`` is an identity (SQLite's AUTOINCREMENT): a resource's
  events are written under its lock, so per resource they are in commit order.

The rows updated in place again and again (a resource's queue row at every claim, renewal
and result; a request, notification or turn at each claim) leave room in their pages
(``fillfactor``) so PostgreSQL updates them there (HOT, no index entries), and are vacuumed
sooner than the default (docs/operations.md, PostgreSQL: vacuum).

Run after the run tables (they reference ``runs``), in the transaction (and under the
advisory lock) that creates the layout.
"""

from piwf.status import FollowUpState, NotificationKind, RequestStatus, SubmissionStatus, TurnCause, TurnResolution
from piwf.store.sql.database import one_of

INTERACTIONS_SQL = f"""
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
  status TEXT NOT NULL CHECK (status IN ({one_of(RequestStatus)})),
  revision BIGINT NOT NULL DEFAULT 1,
  presenter TEXT,
  presenter_expires_at BIGINT,
  entry_id TEXT,
  progress TEXT,
  resolution_json TEXT,
  created_at BIGINT NOT NULL,
  updated_at BIGINT NOT NULL,
  closed_at BIGINT
) WITH (fillfactor = 90);
CREATE INDEX interaction_requests_open ON interaction_requests(deadline_at)
  WHERE status IN ('pending', 'presenting');
CREATE INDEX interaction_requests_run ON interaction_requests(run_id);
CREATE INDEX interaction_requests_session ON interaction_requests(origin_session_id, status);

CREATE TABLE interaction_submissions (
  submission_id TEXT PRIMARY KEY,
  request_id TEXT NOT NULL REFERENCES interaction_requests(request_id),
  status TEXT NOT NULL CHECK (status IN ({one_of(SubmissionStatus)})),
  value_json TEXT NOT NULL,
  submitted_by TEXT NOT NULL,
  session_id TEXT,
  error TEXT,
  created_at BIGINT NOT NULL,
  settled_at BIGINT,
  rowid BIGINT GENERATED ALWAYS AS IDENTITY
);
CREATE INDEX interaction_submissions_request ON interaction_submissions(request_id, created_at);
CREATE UNIQUE INDEX interaction_submissions_validating ON interaction_submissions(request_id)
  WHERE status = 'validating';
"""

DELIVERY_SQL = f"""
CREATE TABLE notifications (
  notification_id TEXT PRIMARY KEY,
  run_id TEXT NOT NULL REFERENCES runs(run_id),
  seq BIGINT NOT NULL,
  node_id TEXT NOT NULL,
  notification_index BIGINT NOT NULL CHECK (notification_index > 0),
  session_id TEXT NOT NULL,
  kind TEXT NOT NULL CHECK (kind IN ({one_of(NotificationKind)})),
  content TEXT NOT NULL,
  created_at BIGINT NOT NULL,
  claim_token TEXT,
  claim_client TEXT,
  claim_expires_at BIGINT,
  delivered_at BIGINT,
  rowid BIGINT GENERATED ALWAYS AS IDENTITY,
  UNIQUE (run_id, seq, notification_index)
) WITH (fillfactor = 90);
-- A session's undelivered ones in the order stored (rowid: SQLite's index keeps that order by itself).
CREATE INDEX notifications_undelivered ON notifications(session_id, rowid) WHERE delivered_at IS NULL;
CREATE INDEX notifications_run ON notifications(run_id);

CREATE TABLE turns (
  turn_id TEXT PRIMARY KEY,
  run_id TEXT NOT NULL REFERENCES runs(run_id),
  session_id TEXT NOT NULL,
  workflow TEXT NOT NULL,
  cause TEXT NOT NULL CHECK (cause IN ({one_of(TurnCause)})),
  facts_json TEXT NOT NULL,
  instructions TEXT,
  eligible_at BIGINT,
  created_at BIGINT NOT NULL,
  updated_at BIGINT NOT NULL,
  claim_token TEXT,
  claim_client TEXT,
  claim_expires_at BIGINT,
  followups_through BIGINT,
  resolution TEXT CHECK (resolution IN ({one_of(TurnResolution)})),
  resolved_at BIGINT,
  rowid BIGINT GENERATED ALWAYS AS IDENTITY
) WITH (fillfactor = 90);
CREATE UNIQUE INDEX turns_unresolved ON turns(run_id, session_id) WHERE resolved_at IS NULL;
CREATE INDEX turns_eligible ON turns(session_id, eligible_at, rowid) WHERE resolved_at IS NULL;
CREATE INDEX turns_run ON turns(run_id);

CREATE TABLE followups (
  followup_id TEXT PRIMARY KEY,
  run_id TEXT NOT NULL REFERENCES runs(run_id),
  request_key TEXT NOT NULL,
  prompt TEXT NOT NULL,
  position BIGINT NOT NULL,
  state TEXT NOT NULL CHECK (state IN ({one_of(FollowUpState)})),
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
"""

EFFECT_COLUMNS = """status TEXT NOT NULL CHECK (status IN ('pending', 'applying', 'applied', 'rejected', 'ambiguous')),
  generation BIGINT NOT NULL,
  result_json TEXT,
  result_hash TEXT,
  error_json TEXT,
  created_at BIGINT NOT NULL,
  updated_at BIGINT NOT NULL,
  settled_at BIGINT,"""

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
CREATE INDEX controller_resources_spec_blob ON controller_resources(spec_hash) WHERE spec_hash IS NOT NULL;
CREATE INDEX controller_resources_status_blob ON controller_resources(status_hash) WHERE status_hash IS NOT NULL;

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
) WITH (fillfactor = 70, autovacuum_vacuum_scale_factor = 0.02);
CREATE INDEX controller_queue_due ON controller_queue(available_at) WHERE available_at IS NOT NULL AND hold IS NULL;
CREATE INDEX controller_queue_claimed ON controller_queue(claim_expires_at) WHERE claim_token IS NOT NULL;

CREATE TABLE controller_events (
  event_id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
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
  """ + EFFECT_COLUMNS + """
  kind TEXT,
  request_fingerprint TEXT,
  PRIMARY KEY (uid, spec_generation, effect_key)
);
-- SQLite's layout 11 (branches holes-c, term-b): ambiguous effects counted through a
-- partial index; a blob's users found by index (retention).
CREATE INDEX controller_effects_ambiguous ON controller_effects(uid) WHERE status = 'ambiguous';
CREATE INDEX controller_effects_result_blob ON controller_effects(result_hash) WHERE result_hash IS NOT NULL;

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
CREATE INDEX controller_workflows_run ON controller_workflows(run_id);
"""

# node_attempts.settings_change is the run tables' (node_attempts is created with it).
SETTINGS_SQL = """
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

# In the order to create them, after the run tables (``schema.SCHEMA_SQL``): people and
# agents in the loop, then controllers.
PEOPLE_SQL = INTERACTIONS_SQL + DELIVERY_SQL + SETTINGS_SQL

# The tables above: the layout check's list of what a piwf schema must have.
PEOPLE_TABLES = (
    "interaction_requests", "interaction_submissions", "notifications", "turns", "followups", "run_updates",
    "controller_resources", "controller_queue", "controller_events", "controller_effects", "controller_workflows",
    "settings_scopes", "settings_changes",
)
