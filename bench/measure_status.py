"""host.status latency against the number of runs stored, before and after layout 4.

    python bench/measure_status.py                      # 0, 1k, 10k, 50k runs; before and after
    python bench/measure_status.py --counts 0,1000 --calls 200
    python bench/measure_status.py --before REF         # compare against another commit

"Before" is the code of ``--before`` (default: the last commit whose host.status counted
every run), exported with ``git archive`` and run from its own ``src``; "after" is this
tree. For each count a fresh state directory is filled with that many ended runs
(completed, failed, cancelled) and 10 paused ones, a real ``piwf serve`` is started on it,
and one client times sequential ``host.status`` round trips over the socket. The store
read alone (``runs.status_counts`` in this process) is timed too.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BEFORE = "b9d7ed7"  # layout 3: status_counts ran COUNT(*) over runs and run_queue
BATCH = 1000


def seed(db_path: Path, count: int) -> None:
    """``count`` ended runs, one transaction per thousand, and 10 paused (held) ones."""
    from piwf.store.sql import queue, runs
    from piwf.store.sqlite import Database

    db = Database.open(db_path, durability="normal")
    now = int(time.time() * 1000)
    for start in range(0, count, BATCH):
        with db.write():
            for i in range(start, min(count, start + BATCH)):
                _ended_run(db, queue, runs, f"run-{i:08d}", i, now)
    for i in range(10):
        runs.create_run(db, run_id=f"held-{i}", workflow="w", project_path="/nowhere", source=b"s", digest="d",
                        input=None, origin_session_id=None, now=now)
        runs.pause_run(db, f"held-{i}", now)
    db.close()


def _ended_run(db: Any, queue: Any, runs: Any, run_id: str, i: int, now: int) -> None:
    runs.create_run(db, run_id=run_id, workflow="w", project_path="/nowhere", source=b"s", digest="d",
                    input={"i": i}, origin_session_id=None, now=now)
    if i % 10 == 1:
        queue.cancel_run(db, run_id, now)
        return
    token = f"t-{run_id}"
    queue.claim_run(db, run_id, runner_id="bench", token=token, lease_ms=60_000, now=now, epoch=0)
    if i % 10 == 2:
        queue.fail_run(db, run_id, token, {"type": "X", "message": "m"}, now)
    else:
        queue.complete_run(db, run_id, token, {"ok": True}, now)


def measure_one(count: int, calls: int) -> dict[str, Any]:
    """Everything with the piwf this interpreter imports (the caller sets PYTHONPATH)."""
    from piwf.client import Client
    from piwf.paths import StatePaths
    from piwf.store.sql import runs
    from piwf.store.sqlite import Database

    with tempfile.TemporaryDirectory(prefix="piwf-status-") as tmp:
        paths = StatePaths.resolve(Path(tmp) / "state")
        paths.ensure()
        seed(paths.db, count)
        store_ms = _time_store(Database, runs, paths.db, calls)
        host = subprocess.Popen([sys.executable, "-m", "piwf", "serve", "--state-dir", str(paths.root)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            with Client(paths, timeout=30) as client:
                _wait_serving(client, host)
                samples = []
                for _ in range(calls):
                    began = time.perf_counter()
                    response = client.call("host.status")
                    samples.append((time.perf_counter() - began) * 1000)
                    assert response.outcome == "accepted", response
                receipt = response.receipt
        finally:
            host.terminate()
            host.wait(timeout=60)
    assert receipt["completedRuns"] + receipt["failedRuns"] + receipt["cancelledRuns"] == count, receipt
    return {"runs": count, "statusMs": statistics.median(samples), "statusP90Ms": _p90(samples),
            "storeMs": store_ms}


def _time_store(database: Any, runs: Any, path: Path, calls: int) -> float:
    db = database.open_readonly(path)
    try:
        now = int(time.time() * 1000)
        samples = []
        for _ in range(calls):
            began = time.perf_counter()
            runs.status_counts(db, now)
            samples.append((time.perf_counter() - began) * 1000)
    finally:
        db.close()
    return statistics.median(samples)


def _wait_serving(client: Any, host: subprocess.Popen[bytes]) -> None:
    from piwf.errors import HostUnavailable

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if host.poll() is not None:
            raise RuntimeError(f"piwf serve exited with {host.returncode}")
        try:
            for _ in range(20):  # the first calls also warm the host's statement cache
                client.call("host.status")
            return
        except HostUnavailable:
            time.sleep(0.02)
    raise RuntimeError("piwf serve did not answer within 30 s")


def _p90(values: list[float]) -> float:
    return sorted(values)[int(0.9 * (len(values) - 1))]


def run_variant(src: Path, count: int, calls: int) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(src)}
    done = subprocess.run([sys.executable, __file__, "--one", str(count), "--calls", str(calls)],
                          env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"measuring {count} runs with {src} failed:\n{done.stderr}")
    return json.loads(done.stdout)


def export(ref: str, into: Path) -> Path:
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "src"], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into / "src"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--counts", default="0,1000,10000,50000", help="runs stored, comma-separated")
    parser.add_argument("--calls", type=int, default=300, help="host.status calls timed per count")
    parser.add_argument("--before", default=BEFORE, help="the commit to compare against")
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(measure_one(args.one, args.calls)))
        return
    with tempfile.TemporaryDirectory(prefix="piwf-before-") as tmp:
        before_src = export(args.before, Path(tmp))
        print(f"host.status round trip, median (p90) ms; store read alone, median ms; {args.calls} calls")
        print(f"{'runs stored':>12}  {'before ' + args.before:>22}  {'after':>22}  {'store before':>12}  "
              f"{'store after':>11}")
        for count in (int(c) for c in args.counts.split(",")):
            old = run_variant(before_src, count, args.calls)
            new = run_variant(ROOT / "src", count, args.calls)
            print(f"{count:>12,}  {_cell(old):>22}  {_cell(new):>22}  {old['storeMs']:>12.3f}  "
                  f"{new['storeMs']:>11.3f}", flush=True)


def _cell(result: dict[str, Any]) -> str:
    return f"{result['statusMs']:.2f} ({result['statusP90Ms']:.2f})"


if __name__ == "__main__":
    main()
