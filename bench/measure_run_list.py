"""run.list latency against the number of runs stored, for each filter of `piwf run list`.

    python bench/measure_run_list.py                         # 1k and 100k runs (about 2 minutes)
    python bench/measure_run_list.py --counts 1000 --calls 20

For each count a fresh state directory is filled through the store with that many runs
(three workflows, one in ten started by one of seven sessions, one in a hundred failed, one
in five hundred held after crashes), a real ``piwf serve`` is started on it, and one client
times sequential ``run.list`` round trips over the socket, 50 runs a page, for each filter.
Nothing here is asserted by the test suite (tests/test_run_list.py checks the query plans).
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
BATCH = 1000


def seed(db_path: Path, count: int) -> int:
    """``count`` runs, one transaction per thousand; returns the creation time of the middle one."""
    from piwf.store.sql import queue, runs
    from piwf.store.sqlite import Database

    db = Database.open(db_path, durability="normal")
    start = int(time.time() * 1000) - count
    for first in range(0, count, BATCH):
        with db.write():
            for i in range(first, min(count, first + BATCH)):
                run_id, now = f"run-{i:016x}", start + i
                runs.create_run(db, run_id=run_id, workflow=("build", "deploy", "report")[i % 3],
                                project_path="/nowhere", source=b"s", digest="d", input={"i": i},
                                origin_session_id=f"s{i % 7}" if i % 10 == 0 else None, now=now)
                token = f"t-{run_id}"
                queue.claim_run(db, run_id, runner_id="bench", token=token, lease_ms=60_000, now=now, epoch=0)
                if i % 500 == 3:
                    queue.park_run(db, run_id, token, now, hold="crashed", detail="crashed 5 times in a row")
                elif i % 100 == 7:
                    queue.fail_run(db, run_id, token, {"type": "X", "message": "m"}, now)
                elif i % 10 != 0:  # a session's run ends before its next one starts
                    queue.complete_run(db, run_id, token, {"i": i}, now)
                else:
                    queue.cancel_run(db, run_id, now, token=token)
    db.close()
    return start + count // 2


def filters(middle: int, after: str) -> dict[str, dict[str, Any]]:
    return {
        "none": {}, "status failed": {"status": "failed"}, "workflow": {"workflow": "deploy"},
        "session": {"originSessionId": "s3"}, "since (the newer half)": {"since": middle}, "held": {"held": True},
        "after (the middle run)": {"after": after},
    }


def measure(count: int, calls: int) -> dict[str, float]:
    from piwf.client import Client
    from piwf.paths import StatePaths

    with tempfile.TemporaryDirectory() as tmp:
        paths = StatePaths.resolve(Path(tmp) / "state")
        paths.root.mkdir(mode=0o700)
        middle = seed(paths.db, count)
        after = f"run-{count // 2:016x}"
        host = subprocess.Popen([sys.executable, "-m", "piwf", "serve", "--state-dir", str(paths.root)],
                                stderr=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
        try:
            _until_it_answers(paths)
            figures = {}
            with Client(paths, timeout=30) as client:
                for name, payload in filters(middle, after).items():
                    payload = {**payload, "limit": 50}
                    took = []
                    for _ in range(calls):
                        began = time.perf_counter()
                        response = client.call("run.list", payload=payload)
                        took.append(time.perf_counter() - began)
                        assert response.outcome == "accepted", response
                    figures[name] = statistics.median(took) * 1000
            return figures
        finally:
            host.terminate()
            host.wait(30)


def _until_it_answers(paths: Any) -> None:
    from piwf.client import Client
    from piwf.errors import HostUnavailable

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with Client(paths, timeout=5) as client:
                if client.call("host.status").outcome == "accepted":
                    return
        except HostUnavailable:
            time.sleep(0.1)  # a benchmark's start-up, not a test's synchronisation
    raise SystemExit("the host did not start within 60 s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--counts", default="1000,100000")
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "src"))
    results = {int(n): measure(int(n), args.calls) for n in args.counts.split(",")}
    if args.json:
        print(json.dumps(results, indent=2))
        return
    names = list(next(iter(results.values())))
    print("| filter | " + " | ".join(f"{n:,} runs (ms)" for n in results) + " |")
    print("| --- |" + " --- |" * len(results))
    for name in names:
        print(f"| {name} | " + " | ".join(f"{results[n][name]:.2f}" for n in results) + " |")


if __name__ == "__main__":
    main()
