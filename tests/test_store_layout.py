"""Opening the state database: new, foreign, newer, corrupt; and file modes."""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

import apsw
import pytest

from piwf.errors import CorruptStateError, SchemaError, StoreError
from piwf.store.sqlite import Database
from piwf.store.sqlite.schema import APPLICATION_ID, SCHEMA_VERSION


from .conftest import frozen_layout


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_new_database_has_application_id_version_and_private_mode(tmp_path: Path) -> None:
    db = Database.open(tmp_path / "state.db")
    assert db.scalar("PRAGMA application_id") == APPLICATION_ID
    assert db.scalar("PRAGMA user_version") == SCHEMA_VERSION
    db.close()
    assert stat.S_IMODE(os.stat(tmp_path / "state.db").st_mode) == 0o600
    Database.open(tmp_path / "state.db").close()  # reopens cleanly


def test_foreign_sqlite_database_is_refused_and_untouched(tmp_path: Path) -> None:
    path = tmp_path / "other.db"
    conn = apsw.Connection(str(path))
    conn.execute("CREATE TABLE notes(x); INSERT INTO notes VALUES (1)")
    conn.close()
    before = digest(path)
    with pytest.raises(SchemaError, match="not a piwf state database"):
        Database.open(path)
    assert digest(path) == before


def test_newer_layout_is_refused_and_untouched(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    Database.open(path).close()
    conn = apsw.Connection(str(path))
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    conn.close()
    before = digest(path)
    with pytest.raises(SchemaError, match="newer than this piwf understands"):
        Database.open(path)
    assert digest(path) == before


def test_missing_tables_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    Database.open(path).close()
    conn = apsw.Connection(str(path))
    conn.execute("DROP TABLE run_events")
    conn.close()
    with pytest.raises(SchemaError, match="missing tables run_events"):
        Database.open(path)


def test_garbage_file_is_refused_as_corrupt_and_never_rewritten(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    path.write_bytes(b"this is not a database at all" * 100)
    before = digest(path)
    with pytest.raises(CorruptStateError) as info:
        Database.open(path)
    assert info.value.exit_code == 3
    assert digest(path) == before


def test_blobs_are_content_addressed(tmp_path: Path) -> None:
    db = Database.open(tmp_path / "state.db")
    big = {"text": "y" * 10_000}
    inline, first = db.put_json(big, 1)
    _, second = db.put_json(big, 2)
    assert inline is None and first == second
    assert db.scalar("SELECT COUNT(*) FROM blobs") == 1
    assert db.get_json(None, first) == big
    assert db.put_json({"small": 1}, 3) == ('{"small":1}', None)
    db.close()


def test_durability_sets_sqlite_synchronous(tmp_path: Path) -> None:
    full = Database.open(tmp_path / "a.db")
    normal = Database.open(tmp_path / "b.db", durability="normal")
    assert (full.scalar("PRAGMA synchronous"), normal.scalar("PRAGMA synchronous")) == (2, 1)
    assert full.scalar("PRAGMA journal_mode") == "wal"
    full.close()
    normal.close()
    with pytest.raises(StoreError, match="durability must be"):
        Database.open(tmp_path / "c.db", durability="sometimes")


def test_a_layout_1_database_is_migrated_with_its_runs_intact(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    conn = frozen_layout(path, 1)
    conn.execute("INSERT INTO runs (run_id, workflow, project_path, definition_hash, definition_digest, status, "
                 "created_at, updated_at) VALUES ('r1', 'w', '/p', 'h', 'd', 'running', 1, 1)")
    conn.execute("INSERT INTO run_queue (run_id, status, hold, generation, created_at, updated_at) "
                 "VALUES ('r1', 'parked', 'crashed', 3, 1, 1)")
    conn.close()
    db = Database.open(path)
    assert db.scalar("PRAGMA user_version") == SCHEMA_VERSION
    assert db.one("SELECT status, hold, generation FROM run_queue WHERE run_id = 'r1'") == ("parked", "crashed", 3)
    db.execute("UPDATE run_queue SET hold = 'effect' WHERE run_id = 'r1'")  # the new hold is allowed
    assert db.scalar("SELECT count(*) FROM effects") == 0
    assert {"run_queue_claimable", "run_queue_session_reservation"} <= {
        name for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'index'")}
    assert db.scalar("PRAGMA integrity_check") == "ok"
    db.close()


def test_a_layout_3_database_is_migrated_with_its_run_counts_filled(tmp_path: Path) -> None:
    """Layout 4 counts runs as they change; the migration counts the runs already there,
    contradictions and paused runs included, in the same transaction."""
    from piwf.store.sql import runs

    path = tmp_path / "v3.db"
    conn = frozen_layout(path, 3)
    stored = [("a", "completed", "done", 0), ("b", "completed", "done", 0), ("c", "running", "parked", 1),
              ("d", "queued", "queued", 0), ("e", "cancelled", "cancelled", 1), ("f", "failed", "done", 0)]
    for run_id, status, queue_status, paused in stored:
        conn.execute("INSERT INTO runs (run_id, workflow, project_path, definition_hash, definition_digest, status, "
                     "paused, created_at, updated_at) VALUES (?, 'w', '/p', 'h', 'd', ?, ?, 1, 1)",
                     (run_id, status, paused))
        conn.execute("INSERT INTO run_queue (run_id, status, created_at, updated_at) VALUES (?, ?, 1, 1)",
                     (run_id, queue_status))
    conn.close()
    db = Database.open(path)
    assert db.scalar("PRAGMA user_version") == SCHEMA_VERSION
    assert db.scalar("SELECT crash_count FROM run_queue WHERE run_id = 'c'") == 0  # layout 5 too
    counts = runs.status_counts(db, 1)
    assert counts == runs.recounted(db, 1)
    assert (counts["completedRuns"], counts["pausedRuns"], counts["lifecycleContradictions"]) == (2, 2, 1)
    db.execute("UPDATE run_queue SET status = 'failed' WHERE run_id = 'f'")  # counted from now on
    assert runs.status_counts(db, 1)["lifecycleContradictions"] == 0
    assert db.scalar("PRAGMA integrity_check") == "ok"
    db.close()


def test_a_layout_5_database_is_migrated_keeping_runs_steps_and_counts(tmp_path: Path) -> None:
    """Layout 6 rebuilds run_queue and node_attempts (new CHECK lists) under the run-count
    triggers; rows, counts and indexes come through, and the new words are allowed."""
    from piwf.store.sql import runs

    path = tmp_path / "v5.db"
    conn = frozen_layout(path, 5)
    for run_id, status, queue_status in [("a", "completed", "done"), ("b", "running", "parked"),
                                         ("c", "queued", "queued")]:
        conn.execute("INSERT INTO runs (run_id, workflow, project_path, definition_hash, definition_digest, status, "
                     "created_at, updated_at) VALUES (?, 'w', '/p', 'h', 'd', ?, 1, 1)", (run_id, status))
        conn.execute("INSERT INTO run_queue (run_id, status, created_at, updated_at, crash_count) "
                     "VALUES (?, ?, 1, 1, 2)", (run_id, queue_status))
    conn.execute("INSERT INTO node_attempts (attempt_id, run_id, seq, node_id, generation, status, started_at) "
                 "VALUES ('x', 'a', 0, 'n', 1, 'accepted', 1)")
    conn.close()
    db = Database.open(path)
    assert db.scalar("PRAGMA user_version") == SCHEMA_VERSION
    assert db.scalar("SELECT crash_count FROM run_queue WHERE run_id = 'b'") == 2
    assert db.scalar("SELECT status FROM node_attempts WHERE attempt_id = 'x'") == "accepted"
    counts = runs.status_counts(db, 1)
    assert counts == runs.recounted(db, 1) and counts["completedRuns"] == 1 and counts["queuedRuns"] == 1
    with db.write():  # the new words, counted by the triggers made again
        db.execute("UPDATE run_queue SET hold = 'waiting' WHERE run_id = 'b'")
        db.execute("UPDATE runs SET status = 'waiting' WHERE run_id = 'b'")
        db.execute("UPDATE node_attempts SET status = 'waiting' WHERE attempt_id = 'x'")
    assert runs.status_counts(db, 1)["waitingRuns"] == 1 == runs.recounted(db, 1)["waitingRuns"]
    assert runs.status_counts(db, 1)["lifecycleContradictions"] == 0
    assert {"run_queue_ready", "node_attempts_accepted", "interaction_submissions_validating"} <= {
        name for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'index'")}
    assert db.scalar("PRAGMA integrity_check") == "ok"
    db.close()


def test_a_layout_6_database_gains_the_controller_tables_as_a_fresh_one_has_them(tmp_path: Path) -> None:
    def controller_schema(db: Database) -> set[tuple[str, str]]:
        return set(db.execute("SELECT name, sql FROM sqlite_master WHERE name LIKE 'controller%'"))

    fresh = Database.open(tmp_path / "fresh.db")
    expected = controller_schema(fresh)
    fresh.close()
    assert {name for name, _ in expected} >= {"controller_resources", "controller_queue", "controller_events",
                                              "controller_effects", "controller_workflows"}
    path = tmp_path / "v6.db"
    conn = frozen_layout(path, 6)
    conn.close()
    db = Database.open(path)
    assert db.scalar("PRAGMA user_version") == SCHEMA_VERSION
    assert controller_schema(db) == expected
    assert db.scalar("PRAGMA integrity_check") == "ok"
    db.close()


def test_a_layout_9_database_gains_the_crash_back_off_as_a_fresh_one_has_it(tmp_path: Path) -> None:
    """Layout 10 keeps a crashed run's back-off with the run (run_queue.not_before); a
    parked run of layout 9 has none and is claimable at once, and the schema is a fresh one's."""
    from piwf.store.sql import queue

    def schema(db: Database) -> set[tuple[str, str]]:
        return set(db.execute("SELECT name, sql FROM sqlite_master WHERE name NOT LIKE 'sqlite_%'"))

    fresh = Database.open(tmp_path / "fresh.db")
    expected = schema(fresh)
    fresh.close()
    path = tmp_path / "v9.db"
    conn = frozen_layout(path, 9)
    conn.execute("INSERT INTO runs (run_id, workflow, project_path, definition_hash, definition_digest, status, "
                 "created_at, updated_at) VALUES ('r', 'w', '/p', 'h', 'd', 'running', 1, 1)")
    conn.execute("INSERT INTO run_queue (run_id, status, crash_count, created_at, updated_at) "
                 "VALUES ('r', 'parked', 2, 1, 1)")
    conn.close()
    db = Database.open(path)
    assert db.scalar("PRAGMA user_version") == SCHEMA_VERSION
    assert schema(db) == expected
    assert db.one("SELECT crash_count, not_before FROM run_queue WHERE run_id = 'r'") == (2, None)
    claim = queue.claim_next_run(db, runner_id="h", token="t", lease_ms=1000, now=2, epoch=1)
    assert claim is not None and claim.run_id == "r"
    assert db.scalar("PRAGMA integrity_check") == "ok"
    db.close()


def test_a_layout_10_database_gains_effect_identity_and_counts_its_ambiguous_effects(tmp_path: Path) -> None:
    """Layout 11: partial indexes find ambiguous effects (host.status counts them), and a
    reconcile's effect records its kind and request fingerprint; an effect reserved before
    (neither recorded) takes the first reserve's, and the schema is a fresh one's."""
    from piwf.errors import Conflict
    from piwf.store.sql import controller_effects, runs

    def schema(db: Database) -> set[tuple[str, str]]:
        return set(db.execute("SELECT name, sql FROM sqlite_master WHERE name NOT LIKE 'sqlite_%'"))

    fresh = Database.open(tmp_path / "fresh.db")
    expected = schema(fresh)
    fresh.close()
    path = tmp_path / "v10.db"
    conn = frozen_layout(path, 10)
    conn.execute("INSERT INTO runs (run_id, workflow, project_path, definition_hash, definition_digest, status, "
                 "created_at, updated_at) VALUES ('r', 'w', '/p', 'h', 'd', 'running', 1, 1)")
    conn.execute("INSERT INTO effects (run_id, effect_key, status, generation, node_id, created_at, updated_at) "
                 "VALUES ('r', 'k', 'ambiguous', 1, 'n', 1, 1)")
    conn.execute("INSERT INTO controller_resources (uid, project_path, controller, resource_key, resource_version, "
                 "generation, spec_json, spec_digest, status_json, created_at, updated_at) "
                 "VALUES ('u', '/p', 'c', 'k', 1, 1, '{}', 'd', '{}', 1, 1)")
    conn.execute("INSERT INTO controller_effects (uid, spec_generation, effect_key, status, generation, result_json, "
                 "created_at, updated_at, settled_at) VALUES ('u', 1, 'w', 'applied', 1, '{\"n\":1}', 1, 1, 1)")
    conn.close()
    db = Database.open(path)
    assert db.scalar("PRAGMA user_version") == SCHEMA_VERSION >= 11
    assert schema(db) == expected
    assert runs.status_counts(db, 2)["ambiguousEffects"] == 1
    plan = " ".join(str(row[-1]) for row in db.execute("EXPLAIN QUERY PLAN " + runs.AMBIGUOUS_EFFECTS))
    assert "effects_ambiguous" in plan, plan
    fp = "c" * 64
    got = controller_effects.reserve(db, "u", 1, "w", generation=2, observable=False, now=2, kind="write",
                                     fingerprint=fp)
    assert got == {"state": "applied", "result": {"n": 1}}  # the old row took the first identity given
    with pytest.raises(Conflict):
        controller_effects.reserve(db, "u", 1, "w", generation=2, observable=False, now=2, kind="delete",
                                   fingerprint=fp)
    assert db.scalar("PRAGMA integrity_check") == "ok"
    db.close()


def test_a_layout_12_database_gains_the_retention_indexes_as_a_fresh_one_has_them(tmp_path: Path) -> None:
    """Layout 13 adds the indexes retention reads (ended runs, a blob's users, a child run's
    controller, the logged commands of a run); a layout-12 database keeps its runs and ends
    with a fresh one's schema."""
    def schema(db: Database) -> set[tuple[str, str]]:
        return set(db.execute("SELECT name, sql FROM sqlite_master WHERE name NOT LIKE 'sqlite_%'"))

    fresh = Database.open(tmp_path / "fresh.db")
    expected = schema(fresh)
    fresh.close()
    assert {"runs_ended", "runs_definition_blob", "controller_workflows_run", "host_commands_run"} <= {
        name for name, _ in expected}
    path = tmp_path / "v12.db"
    conn = frozen_layout(path, 12)
    conn.execute("INSERT INTO runs (run_id, workflow, project_path, definition_hash, definition_digest, status, "
                 "created_at, updated_at, finished_at) VALUES ('r', 'w', '/p', 'h', 'd', 'completed', 1, 1, 1)")
    conn.execute("INSERT INTO run_queue (run_id, status, created_at, updated_at) VALUES ('r', 'done', 1, 1)")
    conn.close()
    db = Database.open(path)
    assert db.scalar("PRAGMA user_version") == SCHEMA_VERSION >= 13
    assert schema(db) == expected
    assert db.one("SELECT status, finished_at FROM runs WHERE run_id = 'r'") == ("completed", 1)
    assert db.scalar("PRAGMA integrity_check") == "ok"
    db.close()


def test_a_layout_13_database_gains_run_graphs_and_its_runs_answer_theirs_unknown(tmp_path: Path) -> None:
    """Layout 14 records the graph of a run's workflow (runs.graph_hash and its index, a
    blob user for retention); a run made before answers ``run.graph`` as unknown, with the
    nodes its path went through, and the schema ends as a fresh one's."""
    from piwf.store.sql import graph

    def schema(db: Database) -> set[tuple[str, str]]:
        return set(db.execute("SELECT name, sql FROM sqlite_master WHERE name NOT LIKE 'sqlite_%'"))

    fresh = Database.open(tmp_path / "fresh.db")
    expected = schema(fresh)
    fresh.close()
    assert "runs_graph_blob" in {name for name, _ in expected}
    path = tmp_path / "v13.db"
    conn = frozen_layout(path, 13)
    conn.execute("INSERT INTO runs (run_id, workflow, project_path, definition_hash, definition_digest, status, "
                 "created_at, updated_at) VALUES ('r', 'w', '/p', 'h', 'd', 'running', 1, 1)")
    conn.execute("INSERT INTO run_queue (run_id, status, created_at, updated_at) VALUES ('r', 'running', 1, 1)")
    conn.execute("INSERT INTO node_attempts (attempt_id, run_id, seq, node_id, generation, status, exit_name, "
                 "started_at) VALUES ('a1', 'r', 0, 'first', 1, 'accepted', 'next', 1)")
    conn.close()
    db = Database.open(path)
    assert db.scalar("PRAGMA user_version") == SCHEMA_VERSION >= 14
    assert schema(db) == expected
    shown = graph.run_graph(db, "r")
    assert (shown.known, shown.edges, [(n.id, n.kind, n.state) for n in shown.nodes]) == (
        False, [], [("first", "unknown", "accepted")])
    assert db.scalar("PRAGMA integrity_check") == "ok"
    db.close()


def test_a_layout_14_database_gains_queues_and_placement_with_its_runs_on_the_default_queue(
        tmp_path: Path) -> None:
    """Layout 15 puts each run on a named queue (runs made before are on 'default'), claims
    by queue first from run_queue_ready, and adds the queues hosts serve and the runs a host
    cannot load; the schema ends as a fresh one's."""
    from piwf.store.sql import queue, runs

    def schema(db: Database) -> set[tuple[str, str]]:
        return set(db.execute("SELECT name, sql FROM sqlite_master WHERE name NOT LIKE 'sqlite_%'"))

    fresh = Database.open(tmp_path / "fresh.db")
    expected = schema(fresh)
    fresh.close()
    assert {"host_queues", "run_placement"} <= {name for name, _ in expected}
    path = tmp_path / "v14.db"
    conn = frozen_layout(path, 14)
    conn.execute("INSERT INTO runs (run_id, workflow, project_path, definition_hash, definition_digest, status, "
                 "created_at, updated_at) VALUES ('r', 'w', '/p', 'h', 'd', 'queued', 1, 1)")
    conn.execute("INSERT INTO run_queue (run_id, status, created_at, updated_at) VALUES ('r', 'queued', 1, 1)")
    conn.close()
    db = Database.open(path)
    assert db.scalar("PRAGMA user_version") == SCHEMA_VERSION >= 15
    assert schema(db) == expected
    assert runs.run_summary(db, "r").queue == "default"
    assert queue.claim_next_run(db, runner_id="h", token="t", lease_ms=1000, now=2, epoch=1, queues=("gpu",)) is None
    claim = queue.claim_next_run(db, runner_id="h", token="t", lease_ms=1000, now=2, epoch=1)
    assert claim is not None and claim.run_id == "r"
    assert db.scalar("PRAGMA integrity_check") == "ok"
    db.close()
