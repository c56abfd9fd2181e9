"""Where the host's CPU goes: a real `piwf serve` under cProfile, driven by one client.

    python bench/profile_host.py e2e [N]       # N one-node runs started, then waited for
    python bench/profile_host.py status [N]    # N sequential run.status of one run
    python bench/profile_host.py counts [N]    # the shape of a run: tasks, cancel scopes, SQL per run

Prints the top functions by own time and by cumulative time, and the host's CPU per
operation measured from its rusage (the profiler's own cost included, so read the
shares, not the absolute figures). ``counts`` runs the host unprofiled but counting, over
the same N one-node runs: trio tasks spawned, cancel scopes entered, task reschedules,
SQL statements executed (and which), write transactions (``BEGIN IMMEDIATE``) and read
snapshots (``BEGIN``), per run. Counts do not depend on the machine's load (the
reschedules and the claim rounds a little: runs that end together share a claim), so
they compare two trees on a noisy machine where CPU time cannot.
"""

from __future__ import annotations

import json
import os
import pstats
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import measure_host
from piwf.client import Client

SERVE = """
import cProfile, signal, sys, time
from piwf.cli import main
profiler = cProfile.Profile(time.process_time)
profiler.enable()
try:
    main(["serve", "--state-dir", sys.argv[1], "--durability", sys.argv[2], "--max-workers", "8"])
finally:
    profiler.disable()
    profiler.dump_stats(sys.argv[3])
"""
COUNT = """
import collections, json, sys, atexit
import trio, trio._core._run as run
from piwf.cli import main
from piwf.store.sqlite import db as sqlite_db

counts = collections.Counter()
statements = collections.Counter()

class Shape(trio.abc.Instrument):
    def task_spawned(self, task):
        counts["tasks"] += 1

    def task_scheduled(self, task):
        counts["reschedules"] += 1

enter = run.CancelScope.__enter__
def counted_enter(self):
    counts["cancel scopes"] += 1
    return enter(self)
run.CancelScope.__enter__ = counted_enter

def trace(cursor, sql, bindings):
    statements[" ".join(sql.split())[:90]] += 1
    return True

opened = sqlite_db.Database.__init__
connections = []
def traced(self, conn, path):
    opened(self, conn, path)
    conn.exec_trace = trace
    connections.append(conn)
sqlite_db.Database.__init__ = traced

real_run = trio.run
def instrumented(*args, **kwargs):
    kwargs.setdefault("instruments", []).append(Shape())
    return real_run(*args, **kwargs)
trio.run = instrumented

def snapshot(signum, frame):
    with open(sys.argv[3], "a") as out:
        for key in ("hits", "misses", "too_big", "no_cache", "evictions"):
            counts["statement cache " + key] = 0
        for conn in connections:
            try:
                stats = conn.cache_stats()
            except Exception:  # closed
                continue
            for key in ("hits", "misses", "too_big", "no_cache", "evictions"):
                counts["statement cache " + key] += stats[key]
        out.write(json.dumps({"counts": counts, "statements": statements}) + "\\n")
import signal
signal.signal(signal.SIGUSR1, snapshot)
main(["serve", "--state-dir", sys.argv[1], "--durability", sys.argv[2], "--max-workers", "8"])
"""


def shape(n: int, durability: str) -> None:
    """``counts``: the host's shape per run, from a counting (unprofiled) host: a snapshot
    of its counters after a warm-up run and another after N runs, subtracted."""
    with tempfile.TemporaryDirectory(prefix="piwf-profile-") as tmp:
        out = Path(tmp) / "counts.jsonl"
        host, paths, payload = _serve(Path(tmp), COUNT, durability, out)
        try:
            with Client(paths, timeout=120) as client:
                _warm(client, payload)
                before = _snapshot(host, out, 1)
                ids = [client.call("run.start", payload=payload).receipt["runId"] for _ in range(n)]
                for run_id in ids:
                    client.call("run.wait", run_id=run_id)
                after = _snapshot(host, out, 2)
        finally:
            host.send_signal(signal.SIGTERM)
            host.wait(timeout=60)
    print(f"shape of one one-node run ({durability}, {n} runs started by one client, then waited for; "
          "the client's run.start and run.wait included)")
    for key in ("tasks", "cancel scopes", "reschedules", "statement cache misses", "statement cache too_big",
                "statement cache evictions"):
        print(f"  {key:<28}{(after['counts'].get(key, 0) - before['counts'].get(key, 0)) / n:8.1f}")
    per_run = {sql: (count - before["statements"].get(sql, 0)) / n for sql, count in after["statements"].items()}
    total = sum(per_run.values())
    writes = per_run.get("BEGIN IMMEDIATE", 0)
    reads = per_run.get("BEGIN", 0)
    print(f"  {'SQL statements':<28}{total:8.1f}")
    print(f"  {'write transactions':<28}{writes:8.1f}")
    print(f"  {'read snapshots (BEGIN)':<28}{reads:8.1f}")
    print("  statements per run, most first:")
    for sql, count in sorted(per_run.items(), key=lambda item: -item[1]):
        if count >= 0.05:
            print(f"  {count:6.2f}  {sql}")


def _serve(root: Path, script: str, durability: str, out: Path
           ) -> tuple[subprocess.Popen[bytes], measure_host.StatePaths, dict[str, str]]:
    """``script`` serving a fresh state directory under ``root``, beside a one-node project;
    the host, its paths, and the payload that starts a run."""
    project = root / "project"
    (project / ".piwf" / "workflows").mkdir(parents=True)
    (project / ".piwf" / "workflows" / "noop.py").write_text(measure_host.textwrap.dedent(measure_host.NOOP))
    paths = measure_host.StatePaths.resolve(root / "state")
    host = subprocess.Popen([sys.executable, "-c", script, str(paths.root), durability, str(out)],
                            stderr=subprocess.DEVNULL)
    measure_host._wait_serving(paths, host)
    return host, paths, {"workflow": "noop", "projectPath": str(project)}


def _warm(client: Client, payload: dict[str, str]) -> str:
    """One run started and waited for (the catalog caches the workflow): its id."""
    warm: str = client.call("run.start", payload=payload).receipt["runId"]
    client.call("run.wait", run_id=warm)
    return warm


def _snapshot(host: subprocess.Popen[bytes], out: Path, lines: int) -> dict[str, dict[str, float]]:
    host.send_signal(signal.SIGUSR1)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if out.exists() and len(text := out.read_text().splitlines()) >= lines and text[-1].endswith("}"):
            result: dict[str, dict[str, float]] = json.loads(text[lines - 1])
            return result
        time.sleep(0.01)
    raise RuntimeError("the counting host did not write its counts")


def main() -> None:
    mode, n = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 300
    durability = os.environ.get("DURABILITY", "full")
    if mode == "counts":
        shape(n, durability)
        return
    with tempfile.TemporaryDirectory(prefix="piwf-profile-") as tmp:
        keep = os.environ.get("PROFILE_OUT")
        out = Path(tmp) / "host.prof"
        host, paths, payload = _serve(Path(tmp), SERVE, durability, out)
        with Client(paths, timeout=120) as client:
            warm = _warm(client, payload)
            cpu = measure_host._cpu_s(host.pid)
            began = time.perf_counter()
            if mode == "e2e":
                ids = [client.call("run.start", payload=payload).receipt["runId"] for _ in range(n)]
                for run_id in ids:
                    client.call("run.wait", run_id=run_id)
            else:
                for _ in range(n):
                    client.call("run.status", run_id=warm)
            elapsed = time.perf_counter() - began
            cpu = measure_host._cpu_s(host.pid) - cpu
        host.send_signal(signal.SIGTERM)
        host.wait(timeout=60)
        print(f"{mode}: {n} in {elapsed:.2f} s; host CPU {cpu * 1000 / n:.3f} ms per operation (profiled)")
        if keep:
            Path(keep).write_bytes(out.read_bytes())
        stats = pstats.Stats(str(out))
        stats.sort_stats("tottime").print_stats(35)
        stats.sort_stats("cumulative").print_stats("piwf|trio_util|msgspec|psutil", 70)


if __name__ == "__main__":
    main()
