"""Operating several real hosts on one PostgreSQL store: `piwf stop` on one hands its run,
its reconcile and its place in the host list to the others at once (its lease is an hour
and a reconcile's claim 120 s, so nothing but the release explains it); hosts started at
once on a fresh schema, or on an older layout, wait for the one that creates or migrates
it (longer than the lock timeout) and all serve; an upgrade: a host of the next layout
(tests/newer_piwf.py) migrates the store, the older host stops with the layout error
(exit 4) after parking its run, which the newer host finishes exactly once, and an older
host started after that is refused."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from piwf.errors import ExitCode
from piwf.paths import StatePaths
from piwf.store.postgres.schema import LAYOUT_VERSION

from .conftest import HostProcess, pg_store_url, piwf, wait_for
from .test_controllers import ctl, get, ready, write_controller
from .test_controllers_failures import SLOW, event_types
from .test_lifecycle import call, start, step_states
from .test_peers import hosts, status_of
from .test_store_postgres import admin, fresh

ROOT = Path(__file__).resolve().parent.parent


async def wait_run(paths: StatePaths, run_id: str) -> dict[str, Any]:
    return dict(await call(paths, "run.wait", run_id=run_id, payload={"timeoutMs": 30_000}))


@contextlib.asynccontextmanager
async def newer_host(tmp_path: Path, name: str, *extra: str, paths: StatePaths | None = None,
                     ) -> AsyncIterator[HostProcess]:
    """A host of the next piwf (one layout ahead), on ``paths`` (default: a state directory
    of its own), stopped at the end."""
    process = HostProcess(paths or StatePaths.resolve(tmp_path / f"state-{name}"), tmp_path / f"host-{name}.log",
                          *extra, env={"PYTHONPATH": str(ROOT)}, module="tests.newer_piwf")
    try:
        yield process
    finally:
        if process.proc is not None and process.proc.returncode is None:
            process.signal(signal.SIGTERM)
            with contextlib.suppress(Exception):
                await process.wait(10)
            process.kill_group()
            await process.proc.wait()


async def test_piwf_stop_on_one_host_hands_its_run_reconcile_and_lease_to_the_others_at_once(
    postgres: Any, project: Path, tmp_path: Path,
) -> None:
    serve = ("--store", pg_store_url(postgres), "--lease", "3600")  # no expiry within the test
    async with hosts(tmp_path, "a", "b", a=serve, b=serve) as h:
        a, b = h["a"], h["b"]
        await a.start()
        run_id = await start(a.paths, project, "gated")
        await wait_for(lambda: (project / "wait.log").exists())  # 'once' accepted, 'wait' running on a
        write_controller(project, "slow", SLOW)
        await ctl(a.paths, "apply", project, "slow", "r", spec={})
        await wait_for(lambda: _effect_applied(a.paths, project))  # its reconcile (a 120 s claim) waits on a
        await b.start()
        assert len((await status_of(b.paths))["hosts"]) == 2

        stopped = await piwf(a.paths, "stop")
        assert "stopped" in stopped.stdout.decode()
        assert await a.wait() == 0
        [row] = (await status_of(b.paths))["hosts"]  # a's lease released, not left to expire
        assert row["this"] and row["pid"] == b.proc.pid  # type: ignore[union-attr]
        (project / "gate").touch()
        done = await wait_run(b.paths, run_id)  # a parked it: claimed by b at once
        assert done["status"] == "completed", done
        assert (project / "once.log").read_text().splitlines() == [run_id]  # its accepted step was not redone
        assert step_states(done) == [("once", "accepted"), ("wait", "interrupted"), ("wait", "accepted"),
                                     ("done", "accepted")]
        await wait_for(lambda: _ready_on(b.paths, project))  # a queued the reconcile again: b took it up
        assert _reconciles_started(project) == 2
        assert (project / "ledger.txt").read_text().split() == ["r"]  # its effect applied once


def _reconciles_started(project: Path) -> int:
    trace = project / "trace.txt"
    return trace.read_text().count("start") if trace.exists() else 0


async def _effect_applied(paths: StatePaths, project: Path) -> bool:
    """Applied and recorded: a stop mid-apply would leave it ambiguous (another test's case)."""
    got = await get(paths, project, "slow", "r")
    return bool(got and event_types(got, "effect_applied"))


async def _ready_on(paths: StatePaths, project: Path) -> bool:
    return ready(await get(paths, project, "slow", "r"))


def _waiting_for_the_layout(postgres: Any, longer_than_s: float) -> int:
    """How many sessions have waited on the layout's advisory lock for longer than that."""
    with admin(postgres) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND wait_event = 'advisory' "
            "AND query LIKE '%%pg_advisory_xact_lock(hashtext%%' AND now() - query_start > make_interval(secs => %s)",
            (longer_than_s,)).fetchone()
    return int(row[0]) if row else 0


def _all_running(processes: dict[str, HostProcess]) -> bool:
    for process in processes.values():
        if process.proc is not None and process.proc.returncode is not None:
            raise AssertionError(f"host exited with {process.proc.returncode}: {process.log.read_text()[-600:]}")
    return True


def _layout_2(postgres: Any, schema: str) -> None:
    """A schema as piwf made it before named queues (PostgreSQL layout 2)."""
    from piwf.store.postgres.schema import PLACEMENT_SQL, SCHEMA_SQL

    with admin(postgres) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
        conn.execute(f"SET search_path TO {schema}")
        conn.execute(SCHEMA_SQL.replace(PLACEMENT_SQL, ""))
        conn.execute("INSERT INTO piwf_layout (id, application, version) VALUES (1, 'piwf', 2)")


@pytest.mark.parametrize("layout", ["fresh", "layout 2"])
async def test_hosts_started_at_once_wait_for_the_one_creating_or_migrating_the_layout_and_all_serve(
    postgres: Any, project: Path, tmp_path: Path, layout: str,
) -> None:
    schema = fresh("started_at_once")
    if layout == "layout 2":
        _layout_2(postgres, schema)
    serve = ("--store", pg_store_url(postgres, schema) + "&lock_timeout=1s")
    async with hosts(tmp_path, "a", "b", "c", a=serve, b=serve, c=serve) as h:
        with psycopg.connect(postgres.url()) as holder:  # as a host creating the layout would, for a while
            holder.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (f"piwf.layout:{schema}",))
            for process in h.values():
                await process.start(wait=False)
            # all three wait, past their 1 s lock timeout (the wait is bounded by the statement timeout)
            await wait_for(lambda: _all_running(h) and _waiting_for_the_layout(postgres, 2.0) == 3, timeout=60,
                           interval=0.1)
            holder.commit()  # the lock goes with the transaction: one host creates, the others find it made
        for process in h.values():
            await wait_for(process.answers, timeout=30)
        status = await status_of(h["a"].paths)
        assert len(status["hosts"]) == 3
        run_ids = {name: await start(process.paths, project, "greet") for name, process in h.items()}
        for name, run_id in run_ids.items():
            assert (await wait_run(h[name].paths, run_id))["status"] == "completed"
    with admin(postgres) as conn:
        assert conn.execute(f"SELECT application, version FROM {schema}.piwf_layout").fetchall() == [
            ("piwf", LAYOUT_VERSION)]


async def test_an_upgrade_the_newer_host_migrates_the_older_stops_with_the_layout_error_and_nothing_is_lost(
    postgres: Any, project: Path, tmp_path: Path,
) -> None:
    schema = fresh("upgraded")
    url = pg_store_url(postgres, schema)
    async with hosts(tmp_path, "old", "late", old=("--store", url, "--lease", "3"), late=("--store", url)) as h, \
            newer_host(tmp_path, "new", "--store", url) as new:
        old = h["old"]
        await old.start()
        run_id = await start(old.paths, project, "gated")
        await wait_for(lambda: (project / "wait.log").exists())  # running on the older host

        await new.start()  # migrates to the next layout as it opens the store
        assert await old.wait(30) == ExitCode.SCHEMA  # at its next renewal (a third of its lease)
        said = old.log.read_text()
        assert (f"the store was migrated to layout {LAYOUT_VERSION + 1} by a newer piwf; this one knows "
                f"{LAYOUT_VERSION} and stops: upgrade it") in said
        assert "stopped" in said  # it drained: its run parked, its lease released

        (project / "gate").touch()
        done = await wait_run(new.paths, run_id)
        assert done["status"] == "completed", done
        assert (project / "once.log").read_text().splitlines() == [run_id]  # 'once' ran exactly once
        assert [row["pid"] for row in (await status_of(new.paths))["hosts"]] == [new.proc.pid]  # type: ignore

        late = await h["late"].start(wait=False)  # an older host started now is refused, the store untouched
        assert await late.wait(30) == ExitCode.SCHEMA
        assert f"has layout {LAYOUT_VERSION + 1}, newer than this piwf understands ({LAYOUT_VERSION})" in \
            late.log.read_text()
    with admin(postgres) as conn:
        assert conn.execute(f"SELECT version FROM {schema}.piwf_layout").fetchall() == [(LAYOUT_VERSION + 1,)]


async def test_a_newer_standby_waits_without_migrating_and_migrates_once_it_is_the_host(
    postgres: Any, project: Path, tmp_path: Path,
) -> None:
    """A standby of the next piwf beside a live older host: migrating while it only waits
    would stop every older host; it stands by unrecorded, and migrates once it takes over."""
    schema = fresh("standby")
    url = pg_store_url(postgres, schema)
    async with hosts(tmp_path, "old", old=("--store", url)) as h:
        old = h["old"]
        await old.start()
        async with newer_host(tmp_path, "spare", "--store", url, "--standby", paths=old.paths) as spare:
            await spare.start(wait=False)
            await wait_for(lambda: spare.log.exists() and "standing by unrecorded" in spare.log.read_text())
            assert "older layout" in spare.log.read_text()
            with admin(postgres) as conn:  # untouched, and the older host serves on
                assert conn.execute(f"SELECT version FROM {schema}.piwf_layout").fetchall() == [(LAYOUT_VERSION,)]
            run_id = await start(old.paths, project, "greet")
            assert (await wait_run(old.paths, run_id))["status"] == "completed"
            old.signal(signal.SIGTERM)
            assert await old.wait(30) == 0

            async def migrated() -> bool:
                with admin(postgres) as conn:
                    return conn.execute(f"SELECT version FROM {schema}.piwf_layout").fetchall() == [
                        (LAYOUT_VERSION + 1,)]
            await wait_for(migrated, timeout=30)  # the standby took the lock, became the host, migrated
