"""Where a run's time goes on PostgreSQL: a real `piwf serve --store URL`, N one-node runs,
and what the server saw for them (pg_stat_statements and pg_stat_database).

    python bench/profile_pg.py [N] [--cprofile] [--py-spy FILE]
    python bench/profile_pg.py [N] --dbos     # and DBOS's N workflows on the same server, counted alike
    python bench/profile_pg.py [N] --compare REV... [--rounds 3]   # each REV's host (. = this tree), in turns

Starts a throwaway PostgreSQL (fsync on, pg_stat_statements loaded), a host on a schema
of its own, warms it with one run, resets the server's counters, then starts N runs over
the socket and waits for them. Prints, per run: transactions committed, statements sent
(each a round trip), the statements by calls, and the host's CPU per run; with
``--cprofile`` the host runs under cProfile (CPU timer, the main thread) and its top functions are
printed too. With ``--compare REV...`` each commit REV (checked out into a temporary
worktree, its src/ first on the host's path; ``.`` is this tree) is measured in turns on
the one server, and the medians of each figure printed side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import pstats
import secrets
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import psutil
import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import measure_host
from piwf.client import Client
from tests.postgres_server import Server, find_bindir

SERVE = """
import cProfile, sys, time
from piwf.cli import main
profiler = cProfile.Profile(time.process_time)
profiler.enable()
try:
    main(sys.argv[2:])
finally:
    profiler.disable()
    profiler.dump_stats(sys.argv[1])
"""

# --hops: the host with PgStore.in_thread (every thread hop of a store call) counted; the
# count is written to argv[1] at exit.
HOPS = """
import sys
from piwf.store.postgres import backend
from piwf.cli import main
hops = [0]
original = backend.PgStore.in_thread

async def in_thread(self, work):
    hops[0] += 1
    return await original(self, work)

backend.PgStore.in_thread = in_thread
try:
    main(sys.argv[2:])
finally:
    with open(sys.argv[1], "w") as out:
        out.write(str(hops[0]))
"""


DBOS = """
import json, logging, sys, time
from dbos import DBOS
logging.disable(logging.INFO)
DBOS(config={"name": "bench", "system_database_url": sys.argv[1], "run_admin_server": False})

@DBOS.step()
def step(i):
    return i

@DBOS.workflow()
def workflow(i):
    return step(i)

DBOS.launch()
workflow(-1)
print("ready", flush=True)
sys.stdin.readline()
began = time.perf_counter()
handles = [DBOS.start_workflow(workflow, i) for i in range(int(sys.argv[2]))]
assert [h.get_result() for h in handles] == list(range(int(sys.argv[2])))
print(json.dumps({"seconds": time.perf_counter() - began}), flush=True)
DBOS.destroy()
"""


def start_server() -> Server:
    bindir = find_bindir()
    if bindir is None:
        raise SystemExit("no PostgreSQL here: apt-get install postgresql")
    server = Server(bindir, fsync=True)
    server.init()
    with (server.data / "postgresql.conf").open("a") as conf:
        conf.write("shared_preload_libraries = 'pg_stat_statements'\n"
                   "pg_stat_statements.track = top\npg_stat_statements.track_utility = on\n")
    server.start()
    return server


def counters(conn: psycopg.Connection[Any], database: str = "postgres") -> tuple[int, int]:
    row = conn.execute("SELECT xact_commit, xact_rollback FROM pg_stat_database WHERE datname = %s",
                       (database,)).fetchone()
    return int(row[0]), int(row[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("n", type=int, nargs="?", default=200)
    parser.add_argument("--cprofile", action="store_true")
    parser.add_argument("--hops", action="store_true", help="count the host's thread hops (store calls) per run")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--py-spy", metavar="FILE", help="sample the host's threads holding the GIL with py-spy "
                        "into FILE (collapsed stacks) while the runs go")
    parser.add_argument("--compare", metavar="REV", nargs="+", help="measure each REV (. is this tree), in turns")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--dbos", action="store_true", help="also DBOS's N one-step workflows on the same server, "
                        "counted the same way")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # the server and worktrees are removed on the way out
    server = start_server()
    try:
        if args.compare:
            compare(server, args)
        else:
            figures = measure(server, ROOT / "src", args)
            print(json.dumps(figures, indent=2) if args.json else report(figures, args))
        if args.dbos:
            figures = measure_dbos(server, args)
            print(json.dumps(figures, indent=2) if args.json else "DBOS: " + report(figures, args))
    finally:
        server.stop("fast")
        server.remove()


ROOT = Path(__file__).resolve().parents[1]
FIGURES = ("runs_per_s", "host_cpu_ms_per_run", "commits_per_run", "statements_per_run", "statements_per_run_no_tx",
           "server_ms_per_run", "context_switches_per_run")
_TRANSACTION = re.compile(r"\s*(BEGIN|COMMIT|ROLLBACK|START TRANSACTION)\b", re.IGNORECASE)
HOPS_FIGURE = ("hops_per_run",)
MAIN_FIGURE = ("main_thread_cpu_ms_per_run",)


def compare(server: Server, args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="piwf-compare-pg-") as tmp:
        trees: dict[str, Path] = {}
        for index, rev in enumerate(args.compare):
            if rev == ".":
                trees["this tree"] = ROOT
                continue
            trees[rev] = Path(tmp) / f"rev{index}"
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(trees[rev]), rev], check=True,
                           capture_output=True)
        try:
            samples: dict[str, list[dict[str, float]]] = {side: [] for side in trees}
            for round_ in range(args.rounds):
                order = list(trees.items())
                for side, tree in order[round_ % len(order):] + order[:round_ % len(order)]:
                    figures = measure(server, tree / "src", args)
                    samples[side].append({f: figures[f] for f in FIGURES + MAIN_FIGURE + HOPS_FIGURE if f in figures})
                    print(f"round {round_ + 1}/{args.rounds} {side}: {samples[side][-1]}", file=sys.stderr)
        finally:
            for tree in trees.values():
                if tree != ROOT:
                    subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)
    shown = FIGURES + MAIN_FIGURE + (HOPS_FIGURE if args.hops else ())
    medians = {side: {f: statistics.median(s[f] for s in runs) for f in shown} for side, runs in samples.items()}
    print(f"{args.n} runs per round, {args.rounds} rounds (in turns), medians")
    print(f"  {'':26s}" + "".join(f" {side[:12]:>12s}" for side in trees))
    for f in shown:
        print(f"  {f:26s}" + "".join(f" {medians[side][f]:12.2f}" for side in trees))


def measure(server: Server, src: Path, args: argparse.Namespace) -> dict[str, Any]:
    """N runs through a host whose piwf is imported from ``src``; what the server counted."""
    base = server.url()
    admin = psycopg.connect(base, autocommit=True)
    admin.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
    url = f"{base}&schema=prof_{secrets.token_hex(4)}"
    env = {**os.environ, "PYTHONPATH": str(src)}
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
            sys.executable, "-c", HOPS, str(root / "hops"), *serve] if args.hops else [
            sys.executable, "-m", "piwf", *serve]
        host = subprocess.Popen(command, stderr=subprocess.DEVNULL, env=env)
        try:
            measure_host._wait_serving(paths, host)
            figures = drive(host, paths, project, admin, args)
        finally:
            host.send_signal(signal.SIGTERM)
            host.wait(timeout=60)
        if args.hops:  # the whole life of the host, its start, warm-up run and stop included
            figures["hops_per_run"] = int((root / "hops").read_text()) / (args.n + 1)
        if args.cprofile:
            figures["profile"] = str(out)
            stats = pstats.Stats(str(out))
            stats.sort_stats("tottime").print_stats(args.top)
            stats.sort_stats("cumulative").print_stats("piwf", args.top)
    admin.close()
    return figures


def measure_dbos(server: Server, args: argparse.Namespace) -> dict[str, Any]:
    """DBOS's N workflows (start_workflow, then each result) on a database of its own on
    the same server; the server's counts of that database, from after DBOS's own set-up."""
    database = f"dbos_{secrets.token_hex(4)}"
    admin = psycopg.connect(server.url(), autocommit=True)
    admin.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
    admin.execute(f"CREATE DATABASE {database}")
    url = server.url(database).replace("postgresql://", "postgresql+psycopg://")
    child = subprocess.Popen([sys.executable, "-c", DBOS, url, str(args.n)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    assert child.stdin is not None and child.stdout is not None
    try:
        if child.stdout.readline().strip() != "ready":
            raise SystemExit("DBOS did not start")
        admin.execute("SELECT pg_stat_statements_reset()")
        admin.execute("SELECT pg_stat_reset()")
        time.sleep(0.6)
        before = counters(admin, database)
        process = psutil.Process(child.pid)
        cpu = process.cpu_times()
        child.stdin.write("go\n")
        child.stdin.flush()
        seconds = json.loads(child.stdout.readline())["seconds"]
        cpu_after = process.cpu_times()
    finally:
        child.wait(timeout=120)
    time.sleep(0.6)
    after = counters(admin, database)
    rows = admin.execute(
        "SELECT calls, total_exec_time, regexp_replace(left(query, 110), '\\s+', ' ', 'g') FROM pg_stat_statements "
        "WHERE dbid = (SELECT oid FROM pg_database WHERE datname = %s) ORDER BY calls DESC", (database,)).fetchall()
    admin.close()
    return figures_of(args.n, seconds, cpu, cpu_after, None, None, before, after, rows)


def drive(host: subprocess.Popen[bytes], paths: Any, project: Path, admin: psycopg.Connection[Any],
          args: argparse.Namespace) -> dict[str, Any]:
    payload = {"workflow": "noop", "projectPath": str(project)}
    process = psutil.Process(host.pid)
    with Client(paths, timeout=120) as client:
        warm = client.call("run.start", payload=payload).receipt["runId"]
        client.call("run.wait", run_id=warm)
        admin.execute("SELECT pg_stat_statements_reset()")
        admin.execute("SELECT pg_stat_reset()")
        time.sleep(0.6)  # the statistics collector's flush of the reset (PostgreSQL 15: ~0.5 s)
        before = counters(admin)
        spy = None if not args.py_spy else subprocess.Popen(
            ["py-spy", "record", "--pid", str(host.pid), "--format", "raw", "--rate", "250", "--nonblocking",
             # PIWF_SPY_ALL=1: every thread's samples, not only the GIL holder's
             *([] if os.environ.get("PIWF_SPY_ALL") else ["--gil"]), "--threads", "--output", args.py_spy],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        cpu, switches, main = process.cpu_times(), process.num_ctx_switches(), _main_thread_s(process)
        began = time.perf_counter()
        ids = [client.call("run.start", payload=payload).receipt["runId"] for _ in range(args.n)]
        for run_id in ids:
            client.call("run.wait", run_id=run_id)
        elapsed = time.perf_counter() - began
        cpu_after, switched, main_after = process.cpu_times(), process.num_ctx_switches(), _main_thread_s(process)
        if spy is not None:
            spy.send_signal(signal.SIGINT)
            spy.wait(timeout=60)
    time.sleep(0.6)
    after = counters(admin)
    rows = admin.execute(
        "SELECT calls, total_exec_time, regexp_replace(left(query, 110), '\\s+', ' ', 'g') "
        "FROM pg_stat_statements WHERE query NOT LIKE '%pg_stat%' ORDER BY calls DESC").fetchall()
    figures = figures_of(args.n, elapsed, cpu, cpu_after, switches, switched, before, after, rows)
    figures["main_thread_cpu_ms_per_run"] = (main_after - main) * 1000 / args.n
    return figures


def _main_thread_s(process: psutil.Process) -> float:
    """The CPU time of the host's main thread (the trio loop; its thread id is the pid);
    the rest of the host's CPU is its other threads' (the store's worker threads)."""
    return next(t.user_time + t.system_time for t in process.threads() if t.id == process.pid)


def figures_of(n: int, elapsed: float, cpu: Any, cpu_after: Any, switches: Any, switched: Any,
               before: tuple[int, int], after: tuple[int, int], rows: list[Any]) -> dict[str, Any]:
    return {
        "n": n, "seconds": elapsed, "runs_per_s": n / elapsed,
        "host_cpu_ms_per_run": (cpu_after.user + cpu_after.system - cpu.user - cpu.system) * 1000 / n,
        "host_user_ms_per_run": (cpu_after.user - cpu.user) * 1000 / n,
        "context_switches_per_run": 0.0 if switches is None else (
            switched.voluntary + switched.involuntary - switches.voluntary - switches.involuntary) / n,
        "commits_per_run": (after[0] - before[0]) / n, "rollbacks_per_run": (after[1] - before[1]) / n,
        "statements_per_run": sum(row[0] for row in rows) / n,
        # BEGIN, COMMIT, ROLLBACK left out: pg_stat_statements counts them when sent as simple
        # queries, not when psycopg sent them prepared (as 75019a9's store did after 5 uses)
        "statements_per_run_no_tx": sum(row[0] for row in rows if not _TRANSACTION.match(row[2])) / n,
        "server_ms_per_run": sum(row[1] for row in rows) / n,
        "statements": [(calls / n, total / max(calls, 1) * 1000, text) for calls, total, text in rows],
    }


def report(f: dict[str, Any], args: argparse.Namespace) -> str:
    hops = f" {f['hops_per_run']:.1f} thread hops per run (the host's life / runs + 1);" if "hops_per_run" in f else ""
    lines = [f"{f['n']} runs in {f['seconds']:.2f} s = {f['runs_per_s']:.1f} runs/s; host CPU "
             f"{f['host_cpu_ms_per_run']:.2f} ms per run (user {f['host_user_ms_per_run']:.2f}), "
             f"{f['context_switches_per_run']:.1f} context switches per run;{hops}"
             f" the main thread's CPU {f.get('main_thread_cpu_ms_per_run', 0):.2f} ms per run",
             f"per run: {f['commits_per_run']:.2f} commits, {f['rollbacks_per_run']:.2f} rollbacks, "
             f"{f['statements_per_run']:.2f} statements (each a round trip); server time "
             f"{f['server_ms_per_run']:.2f} ms per run",
             "  per run     mean  statement"]
    lines += [f"  {calls:7.2f} {mean:7.1f} µs  {text}" for calls, mean, text in f["statements"][:args.top]]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
