"""Run settings in the store, rule by rule, on a manual clock: a scope per run, changes as a
compare-and-set on the change number, request keys, the change each attempt started under,
and layout 8 migrating to them."""

from __future__ import annotations

from pathlib import Path

import apsw
import msgspec
import pytest

from piwf.clock import ManualClock
from piwf.engine import settings as engine_settings
from piwf.errors import Conflict, DefinitionError, NotFound, Rejected
from piwf.store.sqlite import Database, queue, runs, settings
from piwf.store.sqlite.schema import APPLICATION_ID, SCHEMA_VERSION

LEASE = 30_000


def new_run(db: Database, clock: ManualClock, run_id: str = "r1", *, with_settings: bool = True) -> str | None:
    runs.create_run(db, run_id=run_id, workflow="w", project_path="/p", source=b"s", digest="d", input=None,
                    origin_session_id=None, now=clock.now_ms())
    if not with_settings:
        return None
    return settings.ensure_scope(db, run_id, settings={"budget": 1}, mutable=["budget"], patch=None, actor_id="c",
                                 now=clock.now_ms())


def change(db: Database, clock: ManualClock, scope: str, base: int, budget: int, *, expected: int | None = None,
           key: str | None = None, run_id: str = "r1") -> tuple[int, bool]:
    receipt, adopted = settings.change_settings(
        db, run_id, scope_id=scope, base=base, expected=expected, patch={"budget": budget},
        settings={"budget": budget}, actor="client" if key is None else "controller", actor_id="c", now=clock.now_ms(),
        request_key=key)
    return receipt.changeNumber, adopted


def test_a_scope_is_made_once_with_change_0(db: Database, clock: ManualClock) -> None:
    scope = new_run(db, clock)
    assert scope is not None
    again = settings.ensure_scope(db, "r1", settings={"budget": 9}, mutable=[], patch=None, actor_id=None, now=1)
    assert again == scope
    shown = settings.get_settings(db, "r1")
    # made once; its mutable paths are the workflow's as it is now (a run resumed on an edited file)
    assert (shown.changeNumber, shown.settings, shown.mutable) == (0, {"budget": 1}, [])
    assert [(c.changeNumber, c.actor, c.patch) for c in shown.changes] == [(0, "start", {})]
    assert settings.find_scope(db, "r1", scope) == (scope, 0, {"budget": 1})


def test_changes_are_a_compare_and_set_on_the_change_number(db: Database, clock: ManualClock) -> None:
    scope = new_run(db, clock)
    assert change(db, clock, scope, 0, 5, expected=0) == (1, False)
    with pytest.raises(Conflict, match="at change 1, not 0"):
        change(db, clock, scope, 0, 6, expected=0)
    with pytest.raises(Conflict, match="changed while the patch was checked"):
        change(db, clock, scope, 0, 6)  # checked against change 0, committed after change 1
    assert change(db, clock, scope, 1, 7) == (2, False)
    assert settings.settings_at_change(db, scope, 1) == {"budget": 5}
    assert settings.get_settings(db, "r1").settings == {"budget": 7}
    with pytest.raises(NotFound):
        settings.settings_at_change(db, scope, 3)
    events = [e.type for e in runs.run_events(db, "r1").events]
    assert events.count("settings.changed") == 2


def test_a_request_key_makes_one_change_however_often_it_comes(db: Database, clock: ManualClock) -> None:
    scope = new_run(db, clock)
    assert change(db, clock, scope, 0, 5, key="k") == (1, False)
    assert change(db, clock, scope, 0, 5, key="k") == (1, True)  # stale base and all: it is the same change
    assert settings.prior_change(db, "r1", "k").changeNumber == 1
    assert settings.prior_change(db, "r1", "other") is None
    queue.cancel_run(db, "r1", clock.now_ms())
    assert change(db, clock, scope, 1, 5, key="k") == (1, True)  # a retry after the run ended still adopts
    with pytest.raises(Rejected, match="has ended"):
        change(db, clock, scope, 1, 6, key="new")


def test_refusals_change_nothing(db: Database, clock: ManualClock) -> None:
    scope = new_run(db, clock)
    new_run(db, clock, "plain", with_settings=False)
    with pytest.raises(Rejected, match="declares none"):
        settings.find_scope(db, "plain")
    with pytest.raises(NotFound):
        settings.find_scope(db, "nope")
    with pytest.raises(NotFound):
        settings.find_scope(db, "r1", "settings-other")
    with pytest.raises(Rejected, match="limit"):
        settings.change_settings(db, "r1", scope_id=scope, base=0, expected=None, patch={}, settings="x" * 70_000,
                                 actor="client", actor_id=None, now=clock.now_ms())
    assert settings.get_settings(db, "r1").changeNumber == 0


def test_each_attempt_records_the_change_it_started_under(db: Database, clock: ManualClock) -> None:
    scope = new_run(db, clock)
    new_run(db, clock, "plain", with_settings=False)
    for run_id in ("r1", "plain"):
        claim = queue.claim_run(db, run_id, runner_id="h", token="t-" + run_id, lease_ms=LEASE, now=clock.now_ms(),
                                epoch=1)
        assert claim is not None
    first, _ = runs.start_attempt(db, "r1", "t-r1", seq=0, node="a", generation=1, now=clock.now_ms())
    change(db, clock, scope, 0, 5)
    runs.accept_attempt(db, "r1", "t-r1", attempt_id=first, output=1, exit_name="next", now=clock.now_ms())
    second, _ = runs.start_attempt(db, "r1", "t-r1", seq=1, node="b", generation=1, now=clock.now_ms())
    assert settings.attempt_settings(db, "r1", first) == (0, {"budget": 1})
    assert settings.attempt_settings(db, "r1", second) == (1, {"budget": 5})
    assert [s.settingsChange for s in runs.get_run(db, "r1").steps] == [0, 1]
    plain, _ = runs.start_attempt(db, "plain", "t-plain", seq=0, node="a", generation=1, now=clock.now_ms())
    assert settings.attempt_settings(db, "plain", plain) == (None, None)
    assert runs.get_run(db, "plain").steps[0].settingsChange is None


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


def test_a_request_key_names_one_change(db: Database, clock: ManualClock) -> None:
    scope = new_run(db, clock)
    assert change(db, clock, scope, 0, 5, key="k") == (1, False)
    assert change(db, clock, scope, 1, 5, key="k") == (1, True)  # the same change again: adopted
    with pytest.raises(Conflict, match="request key 'k' was used for another settings patch"):
        change(db, clock, scope, 1, 6, key="k")
    assert settings.get_settings(db, "r1").settings == {"budget": 5}


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
