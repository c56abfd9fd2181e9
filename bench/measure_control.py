"""Control through any host, measured (issue 21): how long after a request the host that
runs the run has acted, when the request reaches that host and when it reaches another
host sharing the PostgreSQL store (only a wake-up tells it: every host polls once in hours
and renews its claims once in hours).

    python bench/measure_control.py [--rounds N] [--json]

- cancel: from sending ``run.cancel`` to the worker process gone (its shell node running);
- answer: from sending ``decision.answer`` to the run completed (its next node a no-op).

Each round does both paths, alternating which goes first. Two in-process hosts, real worker
processes, a throwaway PostgreSQL (tests/postgres_server.py) unless PIWF_TEST_STORE names one.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import psutil
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from piwf.client import AsyncClient
from piwf.host.host import Host
from piwf.host.state import HostConfig
from piwf.paths import StatePaths
from tests.postgres_server import External, start_server

HOURS = 3 * 3600.0
WORKFLOWS = {
    "sleepy": """
        from piwf import Workflow, shell
        workflow = Workflow(name="sleepy", start_at="nap", nodes={"nap": shell(["sleep", "300"])})
    """,
    "approve": """
        from piwf import Workflow, compute, decision
        workflow = Workflow(name="approve", start_at="ask", nodes={
            "ask": decision("Go?", choices={"yes": "Go"}), "go": compute(lambda ctx: 1)},
            edges=[("ask.yes", "go")])
    """,
}


async def call(paths: StatePaths, operation: str, **kwargs: Any) -> Any:
    async with AsyncClient(paths) as client:
        response = await client.call(operation, **kwargs)
    assert response.outcome == "accepted", response
    return response.receipt


async def until(predicate: Any, interval: float = 0.001) -> Any:
    with trio.fail_after(60):
        while not (value := await predicate()):
            await trio.sleep(interval)
        return value


async def cancel_round(front: StatePaths, to: StatePaths, project: Path) -> float:
    run_id = (await call(front, "run.start", payload={"workflow": "sleepy", "projectPath": str(project)}))["runId"]

    async def worker() -> int | None:
        run = await call(front, "run.status", run_id=run_id)
        pid = run["workers"][-1]["pid"] if run["workers"] else None
        return pid if pid and psutil.Process(pid).children() else None  # its shell started

    pid = await until(worker, 0.01)
    began = time.perf_counter()
    await call(to, "run.cancel", run_id=run_id)

    async def gone() -> bool:
        return not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE

    await until(gone)
    return time.perf_counter() - began


async def answer_round(front: StatePaths, to: StatePaths, project: Path) -> float:
    run_id = (await call(front, "run.start", payload={"workflow": "approve", "projectPath": str(project)}))["runId"]

    async def opened() -> str | None:
        page = await call(front, "interaction.list", payload={"runId": run_id})
        return page["requests"][0]["requestId"] if page["requests"] else None

    request_id = await until(opened, 0.01)
    began = time.perf_counter()
    await call(to, "decision.answer", payload={"requestId": request_id, "choice": "yes"})

    async def completed() -> bool:
        return bool((await call(front, "run.status", run_id=run_id))["status"] == "completed")

    await until(completed)
    return time.perf_counter() - began


async def measure(url: str, rounds: int, root: Path) -> dict[str, list[float]]:
    project = root / "project"
    for name, source in WORKFLOWS.items():
        path = project / ".piwf" / "workflows" / f"{name}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source))
    figures: dict[str, list[float]] = {k: [] for k in ("cancel/owner", "cancel/other", "answer/owner",
                                                       "answer/other")}
    async with trio.open_nursery() as nursery:
        hosts = []
        for name, workers in (("front", 0), ("owner", 4)):
            paths = StatePaths.resolve(root / name)
            hosts.append(await nursery.start(Host(HostConfig(
                paths, store_url=url, max_workers=workers, poll_s=HOURS, run_lease_ms=int(HOURS * 3000),
                kill_grace_s=1.0)).serve))
        front, owner = (h.config.state_dir for h in hosts)
        for n in range(rounds):
            order = [("owner", owner), ("other", front)][:: 1 if n % 2 else -1]
            for label, to in order:
                figures[f"cancel/{label}"].append(await cancel_round(front, to, project))
                figures[f"answer/{label}"].append(await answer_round(front, to, project))
        for host in hosts:
            host.stop_requested.set()
    return figures


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    server = External(os.environ["PIWF_TEST_STORE"]) if os.environ.get("PIWF_TEST_STORE") else start_server(fsync=True)
    if server is None:
        sys.exit("no PostgreSQL here (see tests/postgres_server.py)")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            url = f"{server.url()}&schema=control_{os.getpid()}"
            figures = trio.run(measure, url, args.rounds, Path(tmp))
    finally:
        if not isinstance(server, External):
            server.stop("immediate")
            server.remove()
    summary = {key: {"p50_ms": round(statistics.median(values) * 1000, 1),
                     "max_ms": round(max(values) * 1000, 1), "n": len(values)} for key, values in figures.items()}
    if args.json:
        print(json.dumps(summary, indent=2))
        return
    for key, row in summary.items():
        print(f"{key:14} p50 {row['p50_ms']:7.1f} ms   max {row['max_ms']:7.1f} ms   (n={row['n']})")


if __name__ == "__main__":
    main()
