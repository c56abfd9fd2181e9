"""The PostgreSQL store's own parts: opening (layout, foreign and newer schemas), URLs
without secrets, placeholders. Everything the interface promises is in tests/conformance/,
on both backends."""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import secrets

import psycopg
import pytest
import trio

from piwf.errors import SchemaError, StorageUnavailable, StoreError
from piwf.store.api import open_store
from piwf.store.postgres.db import translate
from piwf.store.postgres.schema import LAYOUT_VERSION
from piwf.store.postgres.url import Limits, parse, redact

from piwf.paths import StatePaths

from .conftest import HostProcess, pg_store_url, piwf


def admin(postgres: Any) -> psycopg.Connection[Any]:
    return psycopg.connect(postgres.url(), autocommit=True)


def fresh(name: str) -> str:
    """A schema name no earlier run used (PIWF_TEST_STORE may be a long-lived server)."""
    return f"{name}_{secrets.token_hex(4)}"


async def test_a_fresh_schema_is_created_at_the_current_layout_and_opened_again(postgres: Any,
                                                                             tmp_path: Path) -> None:
    schema = fresh("fresh_layout")
    url = pg_store_url(postgres, schema)
    store = open_store(tmp_path, url=url)
    await store.close()
    store = open_store(tmp_path, url=url)  # a second open finds the layout and changes nothing
    await store.close()
    with admin(postgres) as conn:
        assert conn.execute(f"SELECT application, version FROM {schema}.piwf_layout").fetchall() == [
            ("piwf", LAYOUT_VERSION)]


def _layout(conn: psycopg.Connection[Any], schema: str) -> tuple[list[Any], list[Any]]:
    """A schema's columns and indexes, to compare a migrated one with a fresh one."""
    columns = conn.execute("SELECT table_name, column_name, data_type, collation_name, ordinal_position FROM "
                           "information_schema.columns WHERE table_schema = %s ORDER BY 1, 5", (schema,)).fetchall()
    indexes = conn.execute("SELECT tablename, indexname, replace(indexdef, %s, '') FROM pg_indexes "
                           "WHERE schemaname = %s ORDER BY 1, 2", (schema + ".", schema)).fetchall()
    return columns, indexes


async def test_a_layout_1_schema_is_migrated_to_record_run_graphs_and_its_runs_answer_theirs_unknown(
    postgres: Any, tmp_path: Path,
) -> None:
    from piwf.store.postgres.schema import GRAPH_SQL, PLACEMENT_SQL, SCHEMA_SQL

    old, new = fresh("layout_1"), fresh("layout_now")
    store = open_store(tmp_path / "new", url=pg_store_url(postgres, new))
    await store.close()
    with admin(postgres) as conn:  # layout 1, as piwf made it before run graphs, with a run
        conn.execute(f"CREATE SCHEMA {old}")
        conn.execute(f"SET search_path TO {old}")
        conn.execute(SCHEMA_SQL.replace(GRAPH_SQL, "").replace(PLACEMENT_SQL, ""))
        conn.execute("INSERT INTO piwf_layout (id, application, version) VALUES (1, 'piwf', 1)")
        conn.execute("INSERT INTO runs (run_id, workflow, project_path, definition_hash, definition_digest, status, "
                     "created_at, updated_at) VALUES ('r', 'w', '/p', 'h', 'd', 'queued', 1, 1)")
        conn.execute("INSERT INTO run_queue (run_id, status, created_at, updated_at) VALUES ('r', 'queued', 1, 1)")
    store = open_store(tmp_path / "old", url=pg_store_url(postgres, old))
    try:
        shown = await store.runs.run_graph("r")
        assert (shown.known, shown.nodes, shown.edges) == (False, [], [])
    finally:
        await store.close()
    with admin(postgres) as conn:
        assert conn.execute(f"SELECT version FROM {old}.piwf_layout").fetchall() == [(LAYOUT_VERSION,)]
        assert _layout(conn, old) == _layout(conn, new)


async def test_a_layout_2_schema_is_migrated_to_queues_and_placement_with_its_runs_on_the_default_queue(
    postgres: Any, tmp_path: Path,
) -> None:
    from piwf.store.postgres.schema import PLACEMENT_SQL, SCHEMA_SQL

    old, new = fresh("layout_2"), fresh("layout_now")
    store = open_store(tmp_path / "new", url=pg_store_url(postgres, new))
    await store.close()
    with admin(postgres) as conn:  # layout 2, as piwf made it before named queues, with a queued run
        conn.execute(f"CREATE SCHEMA {old}")
        conn.execute(f"SET search_path TO {old}")
        conn.execute(SCHEMA_SQL.replace(PLACEMENT_SQL, ""))
        conn.execute("INSERT INTO piwf_layout (id, application, version) VALUES (1, 'piwf', 2)")
        conn.execute("INSERT INTO runs (run_id, workflow, project_path, definition_hash, definition_digest, status, "
                     "created_at, updated_at) VALUES ('r', 'w', '/p', 'h', 'd', 'queued', 1, 1)")
        conn.execute("INSERT INTO run_queue (run_id, status, created_at, updated_at) VALUES ('r', 'queued', 1, 1)")
    store = open_store(tmp_path / "old", url=pg_store_url(postgres, old))
    try:
        assert (await store.runs.run_summary("r")).queue == "default"
        assert await store.supervision.claim_runs(room=1, exclude=frozenset(), runner_id="h", lease_ms=1000, now=2,
                                                  epoch=1, queues=("other",)) == []
        ((claim, _),) = await store.supervision.claim_runs(room=1, exclude=frozenset(), runner_id="h",
                                                           lease_ms=1000, now=2, epoch=1)
        assert claim.run_id == "r"
    finally:
        await store.close()
    with admin(postgres) as conn:
        assert conn.execute(f"SELECT version FROM {old}.piwf_layout").fetchall() == [(LAYOUT_VERSION,)]
        assert _layout(conn, old) == _layout(conn, new)


async def test_a_schema_holding_other_tables_is_refused_untouched(postgres: Any, tmp_path: Path) -> None:
    schema = fresh("foreign_app")
    with admin(postgres) as conn:
        conn.execute(f"CREATE SCHEMA {schema}; CREATE TABLE {schema}.orders (id int)")
    with pytest.raises(SchemaError, match="holds tables that are not piwf's"):
        open_store(tmp_path, url=pg_store_url(postgres, schema))
    with admin(postgres) as conn:
        tables = conn.execute("SELECT table_name FROM information_schema.tables "
                              "WHERE table_schema = %s", (schema,)).fetchall()
    assert tables == [("orders",)]


async def test_a_newer_layout_is_refused_untouched(postgres: Any, tmp_path: Path) -> None:
    schema = fresh("newer_layout")
    url = pg_store_url(postgres, schema)
    await open_store(tmp_path, url=url).close()
    with admin(postgres) as conn:
        conn.execute(f"UPDATE {schema}.piwf_layout SET version = version + 1")
    with pytest.raises(SchemaError, match=f"newer than this piwf understands \\({LAYOUT_VERSION}\\)"):
        open_store(tmp_path, url=url)
    with admin(postgres) as conn:
        assert conn.execute(f"SELECT version FROM {schema}.piwf_layout").fetchone() == (LAYOUT_VERSION + 1,)


async def test_an_unreachable_server_is_unavailable_and_names_no_password(tmp_path: Path) -> None:
    url = f"postgresql://piwf:hunter2@/postgres?host={tmp_path}&port=1&schema=x"
    with pytest.raises(StorageUnavailable) as caught:
        open_store(tmp_path, url=url)
    assert "hunter2" not in str(caught.value) and "postgresql://piwf@/postgres" in str(caught.value)


def test_urls_lose_their_passwords_and_piwf_parameters() -> None:
    url = "postgresql://ann:s3cret@db.example/piwf?sslmode=require&password=other&schema=team_a&port=6432"
    parsed = parse(url)
    assert parsed.schema == "team_a" and "schema" not in parsed.conninfo and "s3cret" in parsed.conninfo
    assert parsed.redacted == "postgresql://ann@db.example/piwf?sslmode=require&schema=team_a&port=6432"
    assert "s3cret" not in redact(url) and "other" not in redact(url)
    assert parse("postgresql:///piwf?host=/run/pg").conninfo == "postgresql:///piwf?host=/run/pg"
    with pytest.raises(StoreError, match="not a plain lower-case name"):
        parse("postgresql:///piwf?schema=Bad-Name")
    with pytest.raises(StoreError, match="starts with postgresql://"):
        parse("mysql://ann:s3cret@x/db")


def test_urls_carry_the_pool_size_and_time_limits_and_refuse_bad_values_in_one_line() -> None:
    default = parse("postgresql:///piwf")
    assert (default.pool_size, default.connect_timeout_s) == (8, 10)
    assert default.limits == Limits(statement_ms=30_000, lock_ms=5_000, idle_in_transaction_ms=60_000)
    given = parse("postgresql://ann:s3cret@/piwf?host=/run/pg&pool_size=3&connect_timeout=4&statement_timeout=12s"
                  "&lock_timeout=250&idle_in_transaction_session_timeout=2min&schema=a")
    assert (given.pool_size, given.connect_timeout_s) == (3, 4)
    assert given.limits == Limits(statement_ms=12_000, lock_ms=250, idle_in_transaction_ms=120_000)
    # libpq gets its own connect_timeout, none of piwf's parameters (it would refuse them)
    assert given.conninfo == "postgresql://ann:s3cret@/piwf?host=/run/pg&connect_timeout=4"
    for query, said in (("pool_size=1", "pool_size '1' in the store URL is not a whole number from 2 to 1000"),
                        ("pool_size=many", "pool_size 'many'"), ("connect_timeout=0", "connect_timeout '0'"),
                        ("lock_timeout=soon", "lock_timeout 'soon' in the store URL is not a time limit"),
                        ("statement_timeout=0", "statement_timeout '0'"),
                        ("idle_in_transaction_session_timeout=1d", "idle_in_transaction_session_timeout '1d'"),
                        ("statement_timeout=999999h", "statement_timeout '999999h'")):
        with pytest.raises(StoreError) as caught:
            parse(f"postgresql://ann:s3cret@/piwf?{query}")
        assert said in str(caught.value) and "s3cret" not in str(caught.value), caught.value
        assert "\n" not in str(caught.value)


async def test_each_pool_and_time_limit_setting_of_the_url_reaches_the_server(postgres: Any, tmp_path: Path) -> None:
    def show(store: Any) -> dict[str, str]:
        db = store.connection()
        try:
            settings = {name: db.scalar(f"SHOW {name}") for name in
                        ("statement_timeout", "lock_timeout", "idle_in_transaction_session_timeout")}
            given = db.conn.info.get_parameters()
            return {**settings, **{name: given.get(name, "") for name in ("connect_timeout", "tcp_user_timeout",
                                                                           "keepalives_idle")}}
        finally:
            store.give_back(db)

    default = open_store(tmp_path, url=pg_store_url(postgres, fresh("limits")), directory="d")
    try:
        assert show(default) == {"statement_timeout": "30s", "lock_timeout": "5s",
                                 "idle_in_transaction_session_timeout": "1min", "connect_timeout": "10",
                                 "tcp_user_timeout": "10000", "keepalives_idle": "5"}  # a silent peer: ~10 s
        assert default.pool.max_size == 8
    finally:
        await default.close()
    url = (pg_store_url(postgres, fresh("limits")) + "&pool_size=2&connect_timeout=1&statement_timeout=12s"
           "&lock_timeout=250&idle_in_transaction_session_timeout=2min&tcp_user_timeout=2500")
    store = open_store(tmp_path, url=url, directory="d")
    try:
        assert show(store) == {"statement_timeout": "12s", "lock_timeout": "250ms",
                               "idle_in_transaction_session_timeout": "2min", "connect_timeout": "1",
                               "tcp_user_timeout": "2500", "keepalives_idle": "5"}  # the URL's own wins
        held = [store.connection(), store.connection()]  # the pool's two: two sessions on the server
        with admin(postgres) as conn:
            pids = {db.conn.info.backend_pid for db in held}
            live = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = ANY(%s)", (list(pids),)).fetchone()
        assert len(pids) == 2 and live == (2,)
        with pytest.raises(StorageUnavailable, match="no connection to the PostgreSQL store"):
            store.connection()  # a third waits connect_timeout (1 s) for one, and is refused
        for db in held:
            store.give_back(db)
    finally:
        await store.close()


async def test_serve_refuses_a_bad_setting_in_the_store_url_in_one_line_without_its_password(
    paths: StatePaths, tmp_path: Path,
) -> None:
    url = f"postgresql://piwf:hunter2@/postgres?host={tmp_path}&lock_timeout=soon"
    refused = await piwf(paths, "serve", "--store", url, check=False)
    said = refused.stderr.decode()
    assert refused.returncode == 1 and "lock_timeout 'soon' in the store URL is not a time limit" in said, said
    assert "hunter2" not in said and said.strip().count("\n") == 0, said


def test_placeholders_become_postgresqls_outside_literals() -> None:
    assert translate("SELECT ?, '?', 'it''s ?', 10 % 3 FROM t INDEXED BY t_i WHERE a = ?") == (
        "SELECT $1, '?', 'it''s ?', 10 % 3 FROM t WHERE a = $2", None)
    assert translate("SELECT :now, x::int WHERE b = ':x' AND c = :now AND d = :then") == (
        "SELECT $1, x::int WHERE b = ':x' AND c = $1 AND d = $2", ("now", "then"))
    # SQLite's numbers: a bare ? after ?2 is ?3; ?1 used twice is one parameter
    assert translate("SELECT ?2, ?, ?1, ?1") == ("SELECT $1, $2, $3, $3", (1, 2, 0))


async def test_a_password_never_reaches_a_log_status_record_or_error(
    postgres: Any, host_process: Callable[..., HostProcess], paths: StatePaths, project: Path, tmp_path: Path,
) -> None:
    secret = "hunter2-" + secrets.token_hex(4)  # the test server trusts any password: libpq sends it all the same
    url = pg_store_url(postgres, fresh("secret")).replace("postgresql://piwf@", f"postgresql://piwf:{secret}@")
    host = await host_process(env={"PIWF_STORE": url}).start()
    await piwf(paths, "run", "start", "greet", "--project", str(project), "--wait")
    running = json.loads((await piwf(paths, "status", "--json")).stdout)
    assert running["state"] == "running" and running["store"] == redact(url) and running["completedRuns"] == 1
    host.signal(signal.SIGTERM)
    assert await host.wait() == 0
    stopped = json.loads((await piwf(paths, "status", "--json")).stdout)  # found from what the host recorded
    assert stopped["state"] == "stopped" and stopped["store"] == redact(url) and stopped["completedRuns"] == 1
    # A state directory no host has used, and PIWF_STORE naming the store (with its password)
    other = await trio.run_process([sys.executable, "-m", "piwf", "status", "--json", "--state-dir",
                                    str(tmp_path / "other")], capture_stdout=True, capture_stderr=True,
                                   env={**os.environ, "PIWF_STORE": url}, check=False)
    elsewhere = json.loads(other.stdout)
    assert (elsewhere["state"], elsewhere["store"], elsewhere["completedRuns"]) == ("stopped", redact(url), 1)
    refused = await piwf(paths, "serve", "--store", url.replace("port=", "port=1"), check=False)
    assert refused.returncode != 0 and b"cannot connect to the PostgreSQL store" in refused.stderr
    seen = [(tmp_path / "host.log").read_bytes(), json.dumps(running).encode(), json.dumps(stopped).encode(),
            refused.stdout + refused.stderr, other.stdout + other.stderr] + [
        p.read_bytes() for p in paths.root.rglob("*") if p.is_file()]
    assert seen and not [text for text in seen if secret.encode() in text]


async def test_a_host_stops_when_another_migrates_the_store_past_its_layout(
    postgres: Any, paths: StatePaths, nursery: Any, caplog: pytest.LogCaptureFixture,
) -> None:
    from piwf.host.host import Host

    from .conftest import config, wait_for

    schema = fresh("migrated_under")
    host = Host(config(paths, store_url=pg_store_url(postgres, schema), host_lease_ms=300))
    raised: list[SchemaError] = []

    async def serve(task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            await host.serve(task_status=task_status)
        except SchemaError as exc:  # once drained, the host stops with it (`piwf serve` exits 4)
            raised.append(exc)

    state = await nursery.start(serve)
    with admin(postgres) as conn:  # a newer piwf's host migrated the shared store
        conn.execute(f"UPDATE {schema}.piwf_layout SET version = version + 1")
    await wait_for(state.stop_requested.is_set, timeout=10)  # at its next renewal, within 100 ms
    said = (f"the store was migrated to layout {LAYOUT_VERSION + 1} by a newer piwf; this one knows {LAYOUT_VERSION} "
            "and stops")
    assert said in caplog.text
    await wait_for(lambda: raised, timeout=10)
    assert said in str(raised[0])


async def test_ended_runs_are_counted_from_shards_that_follow_every_change_hand_edits_too(
    postgres: Any, tmp_path: Path,
) -> None:
    schema = fresh("ended_counts")
    store = open_store(tmp_path, url=pg_store_url(postgres, schema), directory="d", listen=False)
    for index in range(40):
        run_id = f"r{index}"
        await store.runs.create_run(run_id=run_id, workflow="w", project_path="/p", source=b"s", digest="d",
                                    input={}, origin_session_id=None, now=index)
        if index % 4 == 0:
            await store.queue.cancel_run(run_id, index)
    with admin(postgres) as conn:  # an edit by hand is counted too (the trigger, not piwf's code)
        conn.execute(f"UPDATE {schema}.runs SET status = 'completed' WHERE run_id IN ('r0', 'r1')")
        shards = conn.execute(f"SELECT count(DISTINCT shard) FROM {schema}.run_ends").fetchone()
    counts = await store.runs.status_counts(100)
    assert (counts["cancelledRuns"], counts["completedRuns"], counts["queuedRuns"]) == (9, 2, 39 - 9)
    assert shards is not None and shards[0] > 1  # spread over shards, not one hot row
    await store.close()


def test_without_postgresql_a_test_skips_saying_how_to_run_it_and_fails_in_ci() -> None:
    from .conftest import no_postgres

    with pytest.raises(pytest.skip.Exception, match="apt-get install postgresql"):
        no_postgres({})
    with pytest.raises(pytest.fail.Exception, match="CI=true and no PostgreSQL"):
        no_postgres({"CI": "true"})
