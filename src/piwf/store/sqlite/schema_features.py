"""The tables of piwf's features past the run engine, one constant per layout that added
them: the full layout (``schema.SCHEMA_SQL``) and each migration use the same text."""

from piwf.status import FollowUpState, NotificationKind, RequestStatus, SubmissionStatus, TurnCause, TurnResolution
from piwf.store.sql.database import one_of


# Layout 6: people and agents in the loop (DESIGN.md §7). A request is opened by the node
# attempt that waits for it (its id is derived from that attempt); its resolution is
# written once, in the transaction that closes it. At most one submission of a request is
# being validated at a time (the partial unique index).
INTERACTIONS_SQL = f"""
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
  status TEXT NOT NULL CHECK (status IN ({one_of(RequestStatus)})),
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
  status TEXT NOT NULL CHECK (status IN ({one_of(SubmissionStatus)})),
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
"""

# Layout 8: delivery to sessions (DESIGN.md §8). Notifications and turns are delivered
# under short claims (claim_token is the claimId a client holds; claim_client who holds it);
# at most one unresolved turn per (run, session) (the partial unique index); a turn whose
# eligible_at is NULL was asked for by ctx.present and waits for its run to end. Follow-ups
# are ordered per run and delivered with the run's turn; updates keep the current value of
# each (type, key) of a run, its seq the id of the run event that published it.
DELIVERY_SQL = f"""
CREATE TABLE notifications (
  notification_id TEXT PRIMARY KEY,
  run_id TEXT NOT NULL REFERENCES runs(run_id),
  seq INTEGER NOT NULL,
  node_id TEXT NOT NULL,
  notification_index INTEGER NOT NULL CHECK (notification_index > 0),
  session_id TEXT NOT NULL,
  kind TEXT NOT NULL CHECK (kind IN ({one_of(NotificationKind)})),
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
  cause TEXT NOT NULL CHECK (cause IN ({one_of(TurnCause)})),
  facts_json TEXT NOT NULL,
  instructions TEXT,
  eligible_at INTEGER,
  created_at INTEGER NOT NULL,
  updated_at INTEGER NOT NULL,
  claim_token TEXT,
  claim_client TEXT,
  claim_expires_at INTEGER,
  followups_through INTEGER,
  resolution TEXT CHECK (resolution IN ({one_of(TurnResolution)})),
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
  state TEXT NOT NULL CHECK (state IN ({one_of(FollowUpState)})),
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
"""

# Layout 7: controllers (DESIGN.md §9). A resource per (project, controller, key); its
# queue row (one per resource: dedupe, back-off, the claim); its events; its effects (the
# same states and rules as a run's, keyed per spec generation); its child workflow runs.
# The effect ledger's columns (store/sqlite/ledger.py), the same in a run's effects table
# (schema.py) and a reconcile's: its status, and the claim and outcome columns after it.
EFFECT_STATUS = "status TEXT NOT NULL CHECK (status IN ('pending', 'applying', 'applied', 'rejected', 'ambiguous')),"
EFFECT_OUTCOME = """generation INTEGER NOT NULL,
  result_json TEXT,
  result_hash TEXT,
  error_json TEXT,
  created_at INTEGER NOT NULL,
  updated_at INTEGER NOT NULL,
  settled_at INTEGER,"""


CONTROLLERS_SQL = """
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
  """ + EFFECT_STATUS + """
  """ + EFFECT_OUTCOME + """
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
"""

# Layout 9: run settings (DESIGN.md §9b). One scope per run (mount path '' for now: the
# scope id is in the protocol so nested workflows can add theirs); every change is a row,
# change 0 being the settings the run started with; an attempt records the change number
# it started under (node_attempts is not rebuilt: the column is added last).
SETTINGS_SQL = """
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
"""
