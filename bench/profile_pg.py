"""Where a run's time goes on PostgreSQL: a real `piwf serve --store URL`, N one-node runs,
and what the server saw for them (pg_stat_statements and pg_stat_database).

    python bench/profile_pg.py [N] [--cprofile]

Starts a throwaway PostgreSQL (fsync on, pg_stat_statements loaded), a host on a schema
of its own, warms it with one run, resets the server's counters, then starts N runs over
the socket and waits for them. Prints, per run: transactions committed, statements sent
(each a round trip), the statements by calls, and the host's CPU per run; with
``--cprofile`` the host runs under cProfile (wall-clock timer) and its top functions are
printed too.
"""

from __future__ import annotations

import argparse
import pstats
import secrets
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import measure_host
from piwf.client import Client
from tests.postgres_server import Server, find_bindir

SERVE = """
import cProfile, sys, time
from piwf.cli import main
profiler = cProfile.Profile(time.perf_counter)
profiler.enable()
try:
    main(sys.argv[2:])
finally:
    profiler.disable()
    profiler.dump_stats(sys.argv[1])
"""


def start_server() -> Server:
    bindir = find_bindir()
    if bindir is None:
        raise SystemExit("no PostgreSQL here: apt-get install postgresql")
    server = Server(bindir, fsync=True)
    server.init()
    with (server.data / "postgresql.conf").open("a") as conf:
        conf.write("shared_preload_libraries = 'pg_stat_statements'\npg_stat_statements.track = top\npg_stat_statements.track_utility = on\n")
    server.start()
    return server


def counters(conn: psycopg.Connection) -> tuple[int, int]:
    row = conn.execute("SELECT xact_commit, xact_rollback FROM pg_stat_database WHERE datname = 'postgres'").fetchone()
    return int(row[0]), int(row[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("n", type=int, nargs="?", default=200)
    parser.add_argument("--cprofile", action="store_true")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--py-spy", metavar="FILE", help="sample the host's threads (on CPU) with py-spy into FILE "
                        "(collapsed stacks) while the runs go")
    args = parser.parse_args()
    server = start_server()
    try:
        run(server, args)
    finally:
        server.stop("fast")
        server.remove()


def run(server: Server, args: argparse.Namespace) -> None:
    base = server.url()
    admin = psycopg.connect(base, autocommit=True)
    admin.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
    url = f"{base}&schema=prof_{secrets.token_hex(4)}"
    with tempfile.TemporaryDirectory(prefix="piwf-profile-pg-") as tmp:
        root = Path(tmp)
        project = root / "project"
        (project / ".piwf" / "workflows").mkdir(parents=True)
        (project / ".piwf" / "workflows" / "noop.py").write_text(textwrap.dedent(measure_host.NOOP))
        paths = measure_host.StatePaths.resolve(root / "state")
        out = root / "host.prof"
        serve = ["serve", "--state-dir", str(paths.root), "--durability", "full", "--max-workers", "8",
                 "--store", url]
        command = [sys.executable, "-c", SERVE, str(out), *serve] if args.cprofile else [
            sys.executable, "-m", "piwf", *serve]
        host = subprocess.Popen(command, stderr=subprocess.DEVNULL)
        try:
            measure_host._wait_serving(paths, host)
            payload = {"workflow": "noop", "projectPath": str(project)}
            with Client(paths, timeout=120) as client:
                warm = client.call("run.start", payload=payload).receipt["runId"]
                client.call("run.wait", run_id=warm)
                admin.execute("SELECT pg_stat_statements_reset()")
                admin.execute("SELECT pg_stat_reset()")
                time.sleep(0.6)  # the statistics collector's flush of the reset (PostgreSQL 15: ~0.5 s)
                before = counters(admin)
                spy = None if not args.py_spy else subprocess.Popen(
                    ["py-spy", "record", "--pid", str(host.pid), "--format", "raw", "--rate", "250", "--nonblocking", "--gil",
                     "--output", args.py_spy], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                cpu = measure_host._cpu_s(host.pid)
                began = time.perf_counter()
                ids = [client.call("run.start", payload=payload).receipt["runId"] for _ in range(args.n)]
                for run_id in ids:
                    client.call("run.wait", run_id=run_id)
                elapsed = time.perf_counter() - began
                cpu = measure_host._cpu_s(host.pid) - cpu
                if spy is not None:
                    spy.send_signal(signal.SIGINT)
                    spy.wait(timeout=60)
            time.sleep(0.6)
            after = counters(admin)
            rows = admin.execute(
                "SELECT calls, total_exec_time, regexp_replace(left(query, 110), '\\s+', ' ', 'g') "
                "FROM pg_stat_statements WHERE query NOT LIKE '%pg_stat%' ORDER BY calls DESC").fetchall()
        finally:
            host.send_signal(signal.SIGTERM)
            host.wait(timeout=60)
        n = args.n
        statements = sum(row[0] for row in rows)
        print(f"{n} runs in {elapsed:.2f} s = {n / elapsed:.1f} runs/s; host CPU {cpu * 1000 / n:.2f} ms per run")
        print(f"per run: {(after[0] - before[0]) / n:.2f} commits, {(after[1] - before[1]) / n:.2f} rollbacks, "
              f"{statements / n:.2f} statements (round trips); server time "
              f"{sum(row[1] for row in rows) / n:.2f} ms per run")
        for calls, total, text in rows[:args.top]:
            print(f"  {calls / n:7.2f}  {total / max(calls, 1) * 1000:8.1f} µs  {text}")
        if args.cprofile:
            stats = pstats.Stats(str(out))
            stats.sort_stats("tottime").print_stats(args.top)
            stats.sort_stats("cumulative").print_stats("piwf", args.top)


if __name__ == "__main__":
    main()
