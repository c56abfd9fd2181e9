"""Run settings outside the store interface: merge patches and mutable paths, declarations,
stored settings read back through a changed type, and SQLite's layout 8 migrating to them.
The store's settings operations are tested through the interface in
tests/conformance/test_settings.py."""

from __future__ import annotations

from pathlib import Path

import apsw
import msgspec
import pytest

from piwf.engine import settings as engine_settings
from piwf.errors import DefinitionError, Rejected
from piwf.store.sql import runs
from piwf.store.sqlite import Database
from piwf.store.sqlite.schema import APPLICATION_ID, SCHEMA_VERSION


def test_merge_patches_and_mutable_paths() -> None:
    assert engine_settings.merge_patch({"a": 1, "b": {"c": 2, "d": 3}}, {"b": {"c": None, "e": 4}, "f": [1]}) == {
        "a": 1, "b": {"d": 3, "e": 4}, "f": [1]}
    assert sorted(engine_settings.touched_paths({"a": 1, "b": {"c": None, "d": {}}})) == ["a", "b.c"]
    assert engine_settings.allowed("limits.max", ["limits"]) and engine_settings.allowed("budget", ["budget"])
    assert not engine_settings.allowed("limits", ["limits.max"]) and not engine_settings.allowed("budgets", ["budget"])


def test_a_bad_settings_declaration_is_refused_when_the_workflow_loads() -> None:
    import msgspec

    from piwf import Workflow, compute

    class NoDefault(msgspec.Struct):
        budget: int

    class Fine(msgspec.Struct):
        budget: int = 1

    nodes = {"a": compute(lambda ctx: None)}
    for kwargs, message in [
        ({"settings": dict}, "must be a msgspec Struct type"),
        ({"settings": NoDefault}, "needs a default"),
        ({"mutable": ["budget"]}, "mutable= needs settings="),
        ({"settings": Fine, "mutable": ["budget.x.", "budget"]}, "must be dotted field names"),
        ({"settings": Fine, "mutable": ["model"]}, "has no field 'model'"),
        ({"settings": Fine, "mutable": ["budget", "budget"]}, "named twice"),
    ]:
        with pytest.raises(DefinitionError, match=message):
            Workflow(name="w", start_at="a", nodes=nodes, **kwargs)
    plain = Workflow(name="w", start_at="a", nodes=nodes)
    tuned = Workflow(name="w", start_at="a", nodes=nodes, settings=Fine, mutable="budget")
    assert tuned.mutable == ("budget",) and plain.digest() != tuned.digest()
    assert "settings" not in plain.describe()  # a workflow without settings keeps the digest it had


@pytest.mark.parametrize("early", [False, True])
def test_a_layout_8_database_migrates_to_the_schema_a_fresh_one_has(tmp_path: Path, early: bool) -> None:
    """``early``: a layout-8 database made before layout 8 had the index of a run's turns."""
    def schema(db: Database) -> set[tuple[str, str]]:
        return set(db.execute("SELECT name, sql FROM sqlite_master WHERE name NOT LIKE 'sqlite_%'"))

    fresh = Database.open(tmp_path / "fresh.db")
    expected = schema(fresh)
    fresh.close()
    assert {"settings_scopes", "settings_changes", "node_attempts", "turns_run"} <= {name for name, _ in expected}
    path = tmp_path / "v8.db"
    conn = apsw.Connection(str(path))
    conn.execute((Path(__file__).parent / "data" / "schema_v8.sql").read_text())
    if early:
        conn.execute("DROP INDEX turns_run")
    conn.execute(f"PRAGMA application_id = {APPLICATION_ID}; PRAGMA user_version = 8")
    conn.execute("INSERT INTO runs (run_id, workflow, project_path, definition_hash, definition_digest, status, "
                 "created_at, updated_at) VALUES ('a', 'w', '/p', 'h', 'd', 'completed', 1, 1)")
    conn.execute("INSERT INTO run_queue (run_id, status, created_at, updated_at) VALUES ('a', 'done', 1, 1)")
    conn.execute("INSERT INTO node_attempts (attempt_id, run_id, seq, node_id, generation, status, started_at) "
                 "VALUES ('x', 'a', 0, 'n', 1, 'accepted', 1)")
    conn.close()
    db = Database.open(path)
    assert db.scalar("PRAGMA user_version") == SCHEMA_VERSION  # layouts 9 and 10 on the way
    assert schema(db) == expected
    assert [(s.node, s.settingsChange) for s in runs.get_run(db, "a").steps] == [("n", None)]
    assert db.scalar("PRAGMA integrity_check") == "ok"
    db.close()


def test_stored_settings_that_no_longer_fit_the_type_fail_the_node_saying_so() -> None:
    import msgspec

    from piwf import Workflow, compute
    from piwf.engine.executor import execute
    from piwf.errors import NodeFailed

    from .test_engine import RecordingJournal

    class Settings(msgspec.Struct):
        budget: int = 1

    class Journal(RecordingJournal):
        def settings(self, attempt_id: str) -> object:
            return {"budget": "five"}  # stored under an older definition of the type

    workflow = Workflow(name="w", start_at="a", nodes={"a": compute(lambda ctx: ctx.settings.budget)},
                        settings=Settings)
    journal = Journal()
    with pytest.raises(NodeFailed, match=r"Expected `int`, got `str` - at `\$.budget`"):
        execute(workflow, run_id="r", project_path="/p", input=None, accepted=[], journal=journal)
    assert [e[0] for e in journal.events] == ["start", "fail"]




class Limits(msgspec.Struct, frozen=True):
    max_items: int = 10


class Settings(msgspec.Struct):
    budget: int = 1
    limits: Limits = Limits()


def test_a_patch_that_changes_nothing_is_refused_and_an_empty_object_touches_no_path() -> None:
    assert list(engine_settings.touched_paths({"limits": {}})) == []
    with pytest.raises(Rejected, match="changes nothing"):
        engine_settings.resolve("w", Settings, ["budget"], None, {"limits": {}}, mutable_only=True)
    with pytest.raises(Rejected, match="changes nothing"):
        engine_settings.resolve("w", Settings, ["budget"], None, {}, mutable_only=True)
    assert engine_settings.resolve("w", Settings, ["budget"], None, {"budget": 3}, mutable_only=True) == {
        "budget": 3, "limits": {"max_items": 10}}
