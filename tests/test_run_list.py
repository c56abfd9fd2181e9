"""`piwf run list` (issue 23, points 5-6): a validated `--status`, filters by workflow,
session, time and held, a header row, a cursor to the next page, each filter read from an
index; held runs shown as held (with what releases them) in `run list`, `run show`,
`piwf watch`, and counted by `piwf status`."""

from __future__ import annotations

import json
import shlex
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio

from piwf.host.host import Host
from piwf.host.state import HostState
from piwf.paths import StatePaths
from piwf.store.api.types import RunFilter
from piwf.store.sql import listing
from piwf.store.sqlite import Database
from piwf.store.sqlite.schema import LISTING_LAYOUT, SCHEMA_VERSION

from .conftest import config, frozen_layout, piwf, write_workflow
from .test_cli_wait import CRASHES


@pytest.fixture
async def fast_host(paths: StatePaths, nursery: trio.Nursery) -> AsyncIterator[HostState]:
    state = await nursery.start(Host(config(paths, crash_backoff_s=0.01, max_crashes=2)).serve)
    yield state
    state.stop_requested.set()


async def text(paths: StatePaths, *args: str) -> str:
    return (await piwf(paths, *args)).stdout.decode()


async def as_json(paths: StatePaths, *args: str) -> Any:
    return json.loads((await piwf(paths, *args, "--json")).stdout)


async def test_run_list_filters_pages_and_shows_held_runs(fast_host: HostState, paths: StatePaths,
                                                          project: Path) -> None:
    bogus = await piwf(paths, "run", "list", "--status", "bogus", check=False)
    assert bogus.returncode == 2  # before: "no runs", exit 0
    assert b"invalid choice: 'bogus' (choose from 'queued', 'running', 'waiting'" in bogus.stderr
    for args, code, line in ((["--since", "soon"], 2, "'soon' is neither a duration (30m, 2h, 7d) nor a date"),
                             (["--after", "run-gone"], 6, "notFound: run run-gone not found"),
                             (["--limit", "1001"], 2, "must be at most 1000")):
        refused = await piwf(paths, "run", "list", *args, check=False)
        assert (refused.returncode, refused.stdout) == (code, b"")
        assert line.encode() in refused.stderr and refused.stderr.count(b"\n") == 1
    write_workflow(project, "crashes", CRASHES)
    greets = [(await text(paths, "run", "start", "greet", "--project", str(project), "--wait")).split()[0]
              for _ in range(4)]
    mine = (await text(paths, "run", "start", "greet", "--project", str(project), "--session", "s1",
                       "--wait")).split()[0]
    crashed = (await piwf(paths, "run", "start", "crashes", "--project", str(project), "--wait",
                          check=False)).stdout.decode().split()[0]

    listed = (await text(paths, "run", "list")).splitlines()
    assert listed[0].split() == ["RUN", "WORKFLOW", "STATE", "QUEUE", "CREATED"]
    assert listed[1].split()[:4] == [crashed, "crashes", "held", "(crashed)"]  # before: "running parked"
    assert f"{crashed} is held (crashed): see piwf run logs {crashed}, fix the cause, then piwf run resume " \
           f"{crashed}" in listed
    assert [r["runId"] for r in await as_json(paths, "run", "list", "--held")] == [crashed]
    assert [r["runId"] for r in await as_json(paths, "run", "list", "--workflow", "greet", "--status",
                                              "completed")] == [mine, *reversed(greets)]
    assert [r["runId"] for r in await as_json(paths, "run", "list", "--session", "s1")] == [mine]
    assert len(await as_json(paths, "run", "list", "--since", "1h")) == 6
    assert (await text(paths, "run", "list", "--since", "2999-01-01T00:00:00Z")) == "no runs\n"

    # Page by page, each page's last line the command that shows the next: every run once.
    seen: list[str] = []
    command = ["run", "list", "--limit", "2", "--workflow", "greet", "--since", "1h"]
    while True:
        page = (await text(paths, *command)).splitlines()
        seen += [line.split()[0] for line in page[1:] if line.startswith("run-")]
        if not page[-1].startswith("more: "):
            break
        command = shlex.split(page[-1].removeprefix("more: "))[1:]  # without "piwf"
        assert command[-2] == "--after" and "--workflow" in command and "--limit" in command
    assert seen == [mine, *reversed(greets)]

    shown = await text(paths, "run", "show", crashed)
    assert "status:   held (crashed): running / parked" in shown
    assert f"release:  see piwf run logs {crashed}, fix the cause, then piwf run resume {crashed}" in shown
    status = await text(paths, "status")
    assert "held:      1 held — piwf run list --held" in status
    assert (await as_json(paths, "status"))["heldRuns"] == 1
    watched = await text(paths, "watch", crashed, "--once")
    assert "held (crashed)" in watched and "held: someone must act" in watched
    assert f"piwf run resume {crashed}" in watched


def _fill(db: Database, count: int) -> None:
    """``count`` ended runs of three workflows, a few held and with sessions, written
    straight into the tables (the query plans, not the write path, are under test)."""
    with db.write():
        for i in range(count):
            run_id, held, failed = f"run-{i:016x}", i % 500 == 3, i % 100 == 7
            db.execute("""INSERT INTO runs (run_id, workflow, project_path, definition_hash, definition_digest,
                            status, origin_session_id, created_at, updated_at)
                          VALUES (?, ?, '/p', 'h', 'd', ?, ?, ?, ?)""",
                       (run_id, ("a", "b", "c")[i % 3], "running" if held else "failed" if failed else "completed",
                        f"s{i % 7}" if i % 5 == 0 else None, 1_000 + i, 1_000 + i))
            db.execute("INSERT INTO run_queue (run_id, status, hold, created_at, updated_at) VALUES (?, ?, ?, ?, ?)",
                       (run_id, "parked" if held else "failed" if failed else "done", "crashed" if held else None,
                        1_000 + i, 1_000 + i))


@pytest.mark.parametrize(("where", "index"), [
    (RunFilter(), "runs_listing"),
    (RunFilter(status="failed"), "runs_by_status"),
    (RunFilter(workflow="b"), "runs_by_workflow"),
    (RunFilter(session="s3"), "runs_by_session"),
    (RunFilter(since=3_000), "runs_listing"),
    (RunFilter(after="run-0000000000000100"), "runs_listing"),
    (RunFilter(workflow="b", after="run-0000000000000100"), "runs_by_workflow"),
    (RunFilter(held=True), "run_queue_held"),
])
def test_every_run_list_filter_reads_an_index_in_order(tmp_path: Path, where: RunFilter, index: str) -> None:
    """At 100,000 runs a page must not scan or sort the runs: its plan reads the filter's
    index in the listing's order, and only the held runs (few) are sorted."""
    db = Database.open(tmp_path / "state.db")
    _fill(db, 3_000)
    sql, params = listing.statement(db, 50, None, where)
    plan = [row[-1] for row in db.execute("EXPLAIN QUERY PLAN " + sql, params)]
    assert any(f"USING INDEX {index}" in step or f"USING COVERING INDEX {index}" in step for step in plan), plan
    assert not any(step.startswith("SCAN") and "USING" not in step for step in plan), plan  # no full scan
    assert where.held or not any("TEMP B-TREE" in step for step in plan), plan  # read in order, not sorted
    rows = db.execute(sql, params).fetchall()
    assert 0 < len(rows) <= 50
    db.close()


async def test_status_with_no_host_counts_the_held_runs(paths: StatePaths) -> None:
    """`piwf status` reads the state database when no host serves it: held runs counted too."""
    from piwf.store.sql import queue, runs

    paths.root.mkdir(mode=0o700)
    db = Database.open(paths.db)
    for run_id in ("held", "paused"):
        runs.create_run(db, run_id=run_id, workflow="w", project_path="/p", source=b"s", digest="d", input={},
                        origin_session_id=None, now=1)
    claim = queue.claim_run(db, "held", runner_id="h", token="t", lease_ms=1_000, now=2, epoch=1)
    assert claim is not None
    queue.park_run(db, "held", "t", 3, hold="crashed", detail="worker crashed 5 times in a row")
    runs.pause_run(db, "paused", 3)
    db.close()
    status = await text(paths, "status")
    assert "host:      stopped" in status and "held:      1 held — piwf run list --held" in status


def test_a_layout_10_database_gains_the_run_listing_indexes_as_a_fresh_one_has_them(tmp_path: Path) -> None:
    """Layout 11 indexes run listings by status, workflow, session, time and held
    (runs_listing takes runs_created's place); the runs stay, and the schema is a fresh one's."""
    def schema(db: Database) -> set[tuple[str, str]]:
        return set(db.execute("SELECT name, sql FROM sqlite_master WHERE name NOT LIKE 'sqlite_%'"))

    fresh = Database.open(tmp_path / "fresh.db")
    expected = schema(fresh)
    fresh.close()
    path = tmp_path / "v10.db"
    conn = frozen_layout(path, 10)
    conn.execute("INSERT INTO runs (run_id, workflow, project_path, definition_hash, definition_digest, status, "
                 "created_at, updated_at) VALUES ('r', 'w', '/p', 'h', 'd', 'running', 1, 1)")
    conn.execute("INSERT INTO run_queue (run_id, status, hold, created_at, updated_at) "
                 "VALUES ('r', 'parked', 'crashed', 1, 1)")
    conn.close()
    db = Database.open(path)
    assert db.scalar("PRAGMA user_version") == SCHEMA_VERSION >= LISTING_LAYOUT
    assert schema(db) == expected
    assert [r.runId for r in listing.list_runs(db, where=RunFilter(held=True, workflow="w"))] == ["r"]
    assert db.scalar("PRAGMA integrity_check") == "ok"
    db.close()
