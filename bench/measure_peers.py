"""Peers, each measured in a child process of its own: ``python measure_peers.py huey|dbos N DIR DURABILITY``
prints one JSON object. Huey: SqliteHuey enqueue, then dequeue + execute in one process.
DBOS: trivial one-step workflows started and completed on SQLite."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def huey(n: int, root: Path, durability: str) -> dict:
    from huey import SqliteHuey

    queue = SqliteHuey("bench", filename=str(root / "huey.db"), fsync=True)
    queue.storage.conn.execute(f"PRAGMA synchronous = {durability.upper()}")  # same setting as piwf's

    @queue.task()
    def noop(i: int) -> int:
        return i

    for i in range(n):
        noop(i)
    began = time.perf_counter()
    done = 0
    while (task := queue.dequeue()) is not None:
        queue.execute(task)
        done += 1
    elapsed = time.perf_counter() - began
    assert done == n, done
    return {"per_s": n / elapsed, "n": n}


def dbos(n: int, root: Path, durability: str) -> dict:
    import logging

    from dbos import DBOS

    logging.disable(logging.INFO)
    # DURABILITY may name a PostgreSQL server instead (bench/measure_pg.py): DBOS on it.
    database = durability if durability.startswith("postgresql") else f"sqlite:///{root / 'dbos.sqlite'}"
    DBOS(config={"name": "bench", "system_database_url": database, "run_admin_server": False})

    @DBOS.step()
    def step(i: int) -> int:
        return i

    @DBOS.workflow()
    def workflow(i: int) -> int:
        return step(i)

    DBOS.launch()
    workflow(-1)  # warm up
    began = time.perf_counter()
    handles = [DBOS.start_workflow(workflow, i) for i in range(n)]
    results = [handle.get_result() for handle in handles]
    elapsed = time.perf_counter() - began
    DBOS.destroy()
    assert results == list(range(n))
    return {"per_s": n / elapsed, "n": n}


if __name__ == "__main__":
    name, count, directory, durability_setting = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]), sys.argv[4]
    figures = {"huey": huey, "dbos": dbos}[name](count, directory, durability_setting)
    sys.stdout.write(json.dumps(figures) + "\n")
