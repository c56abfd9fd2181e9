"""The PostgreSQL store measured: how a call reaches psycopg from trio, the store path of a
run against a raw SKIP LOCKED claim and against SQLite, and host.status at many runs.

    python bench/measure_pg.py [--runs N] [--calls N] [--status-runs N] [--e2e N [--e2e-rounds R]] [--json]

Starts a throwaway PostgreSQL (tests/postgres_server.py; fsync on, as a server would run)
unless PIWF_TEST_STORE names one. Every figure is from this one run on this machine.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import secrets
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from piwf.clock import ManualClock
from piwf.store.api import open_store
from piwf.store.postgres.schema import SCHEMA_SQL
from piwf.store.sql import runs as sql_runs
from tests.postgres_server import start_server

LEASE = 30_000


# --- how a call reaches psycopg ----------------------------------------------------------------


class DedicatedThread:
    """One thread per connection, fed through a queue, answering through the trio token."""

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self.conn = conn
        self.jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.token = trio.lowlevel.current_trio_token()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while (job := self.jobs.get()) is not None:
            function, done = job
            result = function(self.conn)
            self.token.run_sync_soon(done, result)

    async def call(self, function: Callable[[Any], Any]) -> Any:
        event, box = trio.Event(), []

        def done(result: Any) -> None:
            box.append(result)
            event.set()

        self.jobs.put((function, done))
        await event.wait()
        return box[0]

    def close(self) -> None:
        self.jobs.put(None)


def select_one(conn: psycopg.Connection[Any]) -> Any:
    return conn.execute("SELECT 1").fetchone()


async def per_call(url: str, calls: int, rounds: int = 3) -> dict[str, str]:
    """µs per `SELECT 1`, wall and CPU (this process's), each way in turn for ``rounds``
    rounds (medians): inline on the loop (the floor: it blocks every other task), the
    store's hop (``PgStore.in_thread``: trio.lowlevel.start_thread_soon), trio.to_thread.run_sync
    in a shielded scope (the store's hop before), on the loop in a greenlet whose socket
    waits trio awaits (bench/green_calls.py), a dedicated thread per connection, and
    pipeline mode with no answer awaited (a lower bound)."""
    import types

    from piwf.store.postgres.backend import PgStore

    try:  # greenlet comes with DBOS's SQLAlchemy here; without it that way is left out
        import green_calls as green
    except ImportError:
        green = None
    conn = (psycopg.Connection if green is None else green.GreenConnection).connect(url, autocommit=True)
    store = types.SimpleNamespace(limiter=trio.CapacityLimiter(8))
    dedicated = DedicatedThread(conn)

    async def shielded() -> None:
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(select_one, conn, limiter=store.limiter)

    async def inline() -> None:
        select_one(conn)

    async def pipeline() -> None:
        with conn.pipeline():
            for _ in range(calls):
                conn.execute("SELECT 1")

    ways: dict[str, Callable[[], Any]] = {
        "inline on the loop (blocks it: the floor)": inline,
        "the store's hop (trio.lowlevel.start_thread_soon)": lambda: PgStore.in_thread(store, lambda: select_one(conn)),
        "trio.to_thread.run_sync, shielded (the store's before)": shielded,
        "a dedicated thread per connection": lambda: dedicated.call(select_one),
    }
    if green is not None:
        ways["on the loop in a greenlet (bench/green_calls.py)"] = lambda: green.run(lambda: select_one(conn))
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in [*ways, "pipeline, no answer awaited"]}
    for _ in range(rounds):
        for name, way in ways.items():
            wall, cpu = time.perf_counter(), time.process_time()
            for _ in range(calls):
                await way()
            samples[name].append(((time.perf_counter() - wall) / calls * 1e6,
                                  (time.process_time() - cpu) / calls * 1e6))
        wall, cpu = time.perf_counter(), time.process_time()
        await pipeline()
        samples["pipeline, no answer awaited"].append(((time.perf_counter() - wall) / calls * 1e6,
                                                       (time.process_time() - cpu) / calls * 1e6))
    dedicated.close()
    conn.close()
    return {name: f"{statistics.median(w for w, _ in got):7.1f} wall {statistics.median(c for _, c in got):7.1f} CPU"
            for name, got in samples.items()}


# --- the store path of a run ---------------------------------------------------------------------


async def store_path(store: Any, runs: int, clock: ManualClock) -> float:
    """claim + running + complete per second, each transition its own transaction (as the host)."""
    for i in range(runs):
        await store.runs.create_run(run_id=f"r{i:06d}", workflow="w", project_path="/p", source=b"s", digest="d",
                                    input={}, origin_session_id=None, now=clock.now_ms())
        clock.advance(1)
    start = time.perf_counter()
    for _ in range(runs):
        ((claim, _worker),) = await store.supervision.claim_runs(room=1, exclude=frozenset(), runner_id="h",
                                                                 lease_ms=LEASE, now=clock.now_ms(), epoch=1)
        await store.queue.mark_running(claim.run_id, claim.token, clock.now_ms())
        await store.queue.complete_run(claim.run_id, claim.token, {"ok": True}, clock.now_ms())
    return runs / (time.perf_counter() - start)


def raw_claims(url: str, schema: str, runs: int) -> float:
    """The limit: bare SKIP LOCKED claim + complete on the same schema, one transaction each."""
    conn = psycopg.connect(url, autocommit=True)
    conn.execute(f"SET search_path TO {schema}")
    now = 1
    conn.execute("INSERT INTO runs (run_id, workflow, project_path, definition_hash, definition_digest, status, "
                 "created_at, updated_at) SELECT 'x' || g, 'w', '/p', 'h', 'd', 'queued', g, g "
                 "FROM generate_series(1, %s) g", (runs,))
    conn.execute("INSERT INTO run_queue (run_id, status, created_at, updated_at) "
                 "SELECT 'x' || g, 'queued', g, g FROM generate_series(1, %s) g", (runs,))
    start = time.perf_counter()
    for _ in range(runs):
        with conn.transaction():
            run_id = conn.execute("SELECT run_id FROM run_queue WHERE status IN ('queued', 'parked') AND hold IS NULL "
                                  "ORDER BY created_at, run_id LIMIT 1 FOR UPDATE SKIP LOCKED").fetchone()[0]
            conn.execute("UPDATE run_queue SET status = 'starting', claim_token = %s, claim_expires_at = %s "
                         "WHERE run_id = %s", (secrets.token_hex(8), now + LEASE, run_id))
        with conn.transaction():
            conn.execute("UPDATE run_queue SET status = 'done', claim_token = NULL WHERE run_id = %s", (run_id,))
            conn.execute("UPDATE runs SET status = 'completed' WHERE run_id = %s", (run_id,))
    conn.close()
    return runs / (time.perf_counter() - start)


# --- host.status at many runs ------------------------------------------------------------------------


def status_at(url: str, schema: str, count: int) -> dict[str, float]:
    """ms per `runs.status_counts` with ``count`` ended runs and a few active ones stored."""
    from piwf.store.postgres.db import PgDatabase

    conn = psycopg.connect(url, autocommit=True)
    conn.execute(f"CREATE SCHEMA {schema}; SET search_path TO {schema}")
    conn.execute(SCHEMA_SQL)
    conn.execute("INSERT INTO runs (run_id, workflow, project_path, definition_hash, definition_digest, status, "
                 "created_at, updated_at) SELECT 'x' || g, 'w', '/p', 'h', 'd', "
                 "CASE WHEN g %% 1000 = 0 THEN 'queued' WHEN g %% 10 = 0 THEN 'failed' ELSE 'completed' END, g, g "
                 "FROM generate_series(1, %s) g", (count,))
    conn.execute("INSERT INTO run_queue (run_id, status, created_at, updated_at) SELECT run_id, "
                 "CASE status WHEN 'queued' THEN 'queued' WHEN 'failed' THEN 'failed' ELSE 'done' END, 1, 1 "
                 "FROM runs")
    conn.execute("VACUUM ANALYZE runs")
    conn.execute("VACUUM ANALYZE run_queue")
    db = PgDatabase(conn, "bench", schema)
    sql_runs.status_counts(db, 1)  # warm
    rounds = 20
    start = time.perf_counter()
    for _ in range(rounds):
        counts = sql_runs.status_counts(db, 1)
    elapsed = (time.perf_counter() - start) / rounds * 1000
    assert counts["completedRuns"] + counts["failedRuns"] + counts["queuedRuns"] == count
    conn.execute(f"DROP SCHEMA {schema} CASCADE")
    conn.close()
    return {f"status_counts at {count} runs (ms)": elapsed}


def _dbos(base: str, n: int) -> float | str:
    """DBOS's figure (bench/measure_peers.py, in a child process) on a database of its own."""
    import subprocess

    database = f"dbos_{secrets.token_hex(4)}"
    with psycopg.connect(base, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {database}")
    url = base.replace("postgresql://", "postgresql+psycopg://").replace("/postgres?", f"/{database}?")
    done = subprocess.run([sys.executable, str(Path(__file__).parent / "measure_peers.py"), "dbos", str(n),
                           tempfile.mkdtemp(), url], capture_output=True, text=True)
    if done.returncode != 0:
        return f"not measured: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode}"
    per_s: float = json.loads(done.stdout)["per_s"]
    return per_s


async def main_async(args: argparse.Namespace, base: str) -> dict[str, Any]:
    result: dict[str, Any] = {"per call (µs: wall, this process's CPU)": await per_call(base, args.calls)}
    clock = ManualClock()
    schema = f"bench_{secrets.token_hex(4)}"
    url = f"{base}{'&' if '?' in base else '?'}schema={schema}"
    root = Path(tempfile.mkdtemp())
    store = await trio.to_thread.run_sync(lambda: open_store(root, url=url, directory="bench", listen=False))
    result["claim+running+complete per s"] = {"piwf on PostgreSQL": await store_path(store, args.runs, clock)}
    await store.close()
    raw_schema = f"bench_{secrets.token_hex(4)}"
    await trio.to_thread.run_sync(
        lambda: open_store(root, url=f"{base}{'&' if '?' in base else '?'}schema={raw_schema}", directory="raw",
                           listen=False).pool.close())
    result["claim+running+complete per s"]["raw SKIP LOCKED claim + complete"] = raw_claims(base, raw_schema,
                                                                                          args.runs)
    sqlite = open_store(root / "state.db")
    result["claim+running+complete per s"]["piwf on SQLite (full)"] = await store_path(sqlite, args.runs, clock)
    await sqlite.close()
    result["host.status"] = status_at(base, f"bench_{secrets.token_hex(4)}", args.status_runs)
    path = result["claim+running+complete per s"]
    path["piwf on PostgreSQL / raw limit"] = path["piwf on PostgreSQL"] / path["raw SKIP LOCKED claim + complete"]
    path["piwf on PostgreSQL / piwf on SQLite"] = path["piwf on PostgreSQL"] / path["piwf on SQLite (full)"]
    if args.e2e:
        result["end to end (piwf serve --max-workers 8, one-node runs; DBOS: one-step workflows)"] = (
            await trio.to_thread.run_sync(end_to_end, base, args.e2e, args.e2e_rounds))
    return result


# Issue 20's goal is one host end to end; this row says its worker mode (issue 24).
WARM = "piwf on PostgreSQL, warm workers (reuse_worker=True)"


def end_to_end(base: str, n: int, rounds: int) -> dict[str, float | str]:
    """N runs on each side, in ``rounds`` rounds whose order turns (the machine's load falls
    on all alike); medians."""
    import measure_host

    def piwf_on(extra: tuple[str, ...], workflow: str = "noop") -> tuple[float, float]:
        figures = measure_host.end_to_end("full", 8, n, extra=extra, workflow=workflow)
        return figures["per_s"], figures["host_cpu_ms_per_run"]

    def store() -> tuple[str, ...]:
        return ("--store", f"{base}{'&' if '?' in base else '?'}schema=bench_{secrets.token_hex(4)}")

    sides: dict[str, Callable[[], tuple[float, float] | float | str]] = {
        "piwf on PostgreSQL": lambda: piwf_on(store()),
        WARM: lambda: piwf_on(store(), "noop_warm"),
        "piwf on SQLite (full)": lambda: piwf_on(()),
        "DBOS on the same PostgreSQL server": lambda: _dbos(base, n),
    }
    got: dict[str, list[Any]] = {side: [] for side in sides}
    order = list(sides)
    for round_ in range(rounds):
        for side in order[round_ % len(order):] + order[:round_ % len(order)]:
            got[side].append(sides[side]())
    if any(isinstance(value, str) for value in got["DBOS on the same PostgreSQL server"]):
        dbos: float | str = next(v for v in got["DBOS on the same PostgreSQL server"] if isinstance(v, str))
    else:
        dbos = statistics.median(got["DBOS on the same PostgreSQL server"])
    pg = statistics.median(rate for rate, _ in got["piwf on PostgreSQL"])
    warm = statistics.median(rate for rate, _ in got[WARM])
    sqlite = statistics.median(rate for rate, _ in got["piwf on SQLite (full)"])
    figures: dict[str, float | str] = {
        "piwf on PostgreSQL (a fresh process per run), runs/s": pg, f"{WARM}, runs/s": warm,
        "piwf on SQLite (full), runs/s": sqlite,
        "DBOS on the same PostgreSQL server, runs/s": dbos,
        "piwf on PostgreSQL: host CPU ms per run": statistics.median(c for _, c in got["piwf on PostgreSQL"]),
        f"{WARM}: host CPU ms per run": statistics.median(c for _, c in got[WARM]),
        "piwf on SQLite: host CPU ms per run": statistics.median(c for _, c in got["piwf on SQLite (full)"]),
        "rounds": float(rounds),
    }
    if isinstance(dbos, float):
        figures["piwf on PostgreSQL / DBOS"] = pg / dbos
        figures[f"{WARM} / DBOS"] = warm / dbos
        figures["piwf on SQLite / DBOS"] = sqlite / dbos
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=500)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--status-runs", type=int, default=100_000)
    parser.add_argument("--e2e", type=int, default=0, metavar="N",
                        help="also N runs end to end through a real piwf serve on each store, and DBOS")
    parser.add_argument("--e2e-rounds", type=int, default=3, metavar="N")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    server = None
    base = os.environ.get("PIWF_TEST_STORE")
    if not base:
        server = start_server(fsync=True)
        if server is None:
            raise SystemExit("no PostgreSQL here: apt-get install postgresql, or set PIWF_TEST_STORE")
        base = server.url()
    try:
        result = trio.run(main_async, args, base)
    finally:
        if server is not None:
            server.stop("fast")
            server.remove()
    if args.json:
        print(json.dumps(result, indent=2))
        return
    for section, figures in result.items():
        print(section)
        for name, value in figures.items():
            print(f"  {name:60s} {value:10.2f}" if isinstance(value, float) else f"  {name:60s} {value}")


if __name__ == "__main__":
    main()
